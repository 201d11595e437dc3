"""DLRM in Flax NNX, with its training and prediction steps.

The model takes its embedding as a module: any ``nnx.Module`` that maps a
``jaxcache.Lookup`` to ``[B, F, D]`` rows (a ``jaxcache.nnx.CachedEmbed``), so
one class serves a cached table and the whole table on device
(``EmbeddingCache.full_table``) alike.

Shape letters: ``B`` batch, ``F`` sparse features, ``D`` embedding width,
``I`` dense features.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxcache._src.device_ops import Lookup
from jaxcache._src.nnx_module import CachedEmbed, jit_step, value_and_grad
from jaxcache._src.validation import is_int

__all__ = [
    "DLRM",
    "MLP",
    "bce_loss",
    "dense_optimizer",
    "make_predict_step",
    "make_train_step",
]

TrainStep = Callable[[jax.Array, Lookup | jax.Array, jax.Array], jax.Array]
PredictStep = Callable[[jax.Array, Lookup], jax.Array]


class MLP(nnx.Module):
    """Linear layers with ReLU between them (and after the last, if asked).

    Args:
      sizes: widths ``[in, hidden..., out]``.
      rngs: random streams for the initialisation.
      final_activation: apply ReLU to the output too.

    Examples:
      >>> import jax.numpy as jnp, jaxcache
      >>> from flax import nnx
      >>> mlp = jaxcache.models.MLP([13, 32, 16], rngs=nnx.Rngs(0))
      >>> mlp(jnp.ones((4, 13))).shape
      (4, 16)
    """

    def __init__(
        self, sizes: Sequence[int], *, rngs: nnx.Rngs, final_activation: bool = False
    ) -> None:
        if len(sizes) < 2:
            raise ValueError(f"sizes={list(sizes)} needs at least an input and an output width.")
        if not all(is_int(n) and n >= 1 for n in sizes):
            raise ValueError(f"sizes={list(sizes)}: every width must be a whole number >= 1.")
        self.layers = nnx.List([nnx.Linear(i, o, rngs=rngs) for i, o in itertools.pairwise(sizes)])
        self.final_activation = final_activation

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[..., in] -> [..., out]``."""
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1 or self.final_activation:
                x = nnx.relu(x)
        return x


class DLRM(nnx.Module):
    """Deep Learning Recommendation Model (Naumov et al. 2019), dot interaction.

    The bottom MLP maps the dense features to ``D``; the embeddings of the
    ``F`` sparse features and the bottom output interact by pairwise dot
    products (the strict upper triangle of ``[F + 1, F + 1]``); the top MLP
    maps ``[bottom output, interactions]`` to one click logit.

    The defaults are the reference sizes for Criteo Kaggle at ``D = 16``
    (bottom 13-512-256-64-16, top 512-256-1); pass smaller ``bottom`` and
    ``top`` widths for quick runs.

    Args:
      embed: module mapping a ``Lookup`` of ``[B, F]`` ids (or bags) to
        ``[B, F, D]``, e.g. ``jaxcache.nnx.CachedEmbed(cache)``.
      num_sparse: ``F``.
      features: ``D``, the embedding width (the bottom MLP's output).
      num_dense: ``I``, dense inputs.
      bottom: hidden widths of the bottom MLP (its output is ``D``).
      top: hidden widths of the top MLP (its output is 1).
      rngs: random streams for the dense layers.

    Examples:
      >>> import numpy as np, jax.numpy as jnp, jaxcache
      >>> from flax import nnx
      >>> cfg = jaxcache.CacheConfig(num_embeddings=100, features=4, capacity=32)
      >>> embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg))
      >>> model = jaxcache.models.DLRM(embed, num_sparse=3, features=4, bottom=(8,), top=(8,),
      ...                              rngs=nnx.Rngs(0))
      >>> lookup = embed.prepare(np.array([[1, 2, 3], [4, 5, 6]]))
      >>> model(jnp.ones((2, 13)), lookup).shape
      (2,)
    """

    def __init__(
        self,
        embed: nnx.Module,
        *,
        num_sparse: int,
        features: int,
        num_dense: int = 13,
        bottom: Sequence[int] = (512, 256, 64),
        top: Sequence[int] = (512, 256),
        rngs: nnx.Rngs,
    ) -> None:
        for name, value in (("num_sparse", num_sparse), ("features", features)):
            if not is_int(value) or value < 1:
                raise ValueError(
                    f"DLRM({name}={value!r}): {name} must be a whole number >= 1 (the "
                    "categorical features of a sample; the width D of the table's rows)."
                )
        self.embed = embed
        self.num_sparse = num_sparse
        self.bottom = MLP([num_dense, *bottom, features], rngs=rngs, final_activation=True)
        pairs = (num_sparse + 1) * num_sparse // 2
        self.top = MLP([features + pairs, *top, 1], rngs=rngs)

    def __call__(self, dense: jax.Array, sparse: Lookup) -> jax.Array:
        """Click logits ``[B]`` from dense ``[B, I]`` and the sparse ``Lookup``."""
        x = self.bottom(dense)
        emb = self.embed(sparse)
        if emb.shape[1:-1] != (self.num_sparse,):
            raise ValueError(
                f"the embedding returned {emb.shape}, expected [B, {self.num_sparse}, D]; pass "
                "ids as [B, F] (or [B, F, L] bags with a pooling CachedEmbed)."
            )
        if emb.shape[-1] != x.shape[-1] or emb.shape[0] != x.shape[0]:
            raise ValueError(
                f"the embedding returned {emb.shape} but the dense features give "
                f"{tuple(x.shape)} after the bottom MLP: the batch sizes must agree and the "
                f"rows' width must be the model's features={x.shape[-1]}."
            )
        z = jnp.concatenate([x[:, None, :], emb.astype(x.dtype)], axis=1)
        gram = jnp.einsum("bid,bjd->bij", z, z)
        rows, cols = np.triu_indices(self.num_sparse + 1, k=1)
        interactions = gram[:, rows, cols]
        return self.top(jnp.concatenate([x, interactions], axis=1))[:, 0]


def bce_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean binary cross-entropy of logits ``[B]`` against ``{0, 1}`` labels ``[B]``.

    Examples:
      >>> import jax.numpy as jnp, jaxcache
      >>> round(float(jaxcache.models.bce_loss(jnp.zeros(2), jnp.array([0.0, 1.0]))), 4)
      0.6931
    """
    return optax.sigmoid_binary_cross_entropy(logits, labels).mean()


def dense_optimizer(name: str, learning_rate: float) -> optax.GradientTransformation:
    """The optax optimizer of the dense parameters: ``"adagrad"`` or ``"adam"``.

    Examples:
      >>> import jaxcache
      >>> tx = jaxcache.models.dense_optimizer("adam", 1e-3)
      >>> jaxcache.models.dense_optimizer("sgd", 0.1)
      Traceback (most recent call last):
      ValueError: optimizer='sgd' is not supported; use 'adagrad' or 'adam'.
    """
    if name == "adagrad":
        return optax.adagrad(learning_rate)
    if name == "adam":
        return optax.adam(learning_rate)
    raise ValueError(f"optimizer={name!r} is not supported; use 'adagrad' or 'adam'.")


def _train_step(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    dense: jax.Array,
    sparse: Lookup,
    labels: jax.Array,
    *,
    sparse_schedule: Callable[[jax.Array], Any] | None = None,
) -> jax.Array:
    def loss_fn(model, dense, sparse, labels):
        return bce_loss(model(dense, sparse), labels)

    # The step's factor, read before optimizer.update counts this step.
    scale = None if sparse_schedule is None else sparse_schedule(optimizer.step[...])
    loss, grads = value_and_grad(loss_fn, learning_rate_scale=scale)(model, dense, sparse, labels)
    optimizer.update(model, grads)
    return loss


def _train_step_ids(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    dense: jax.Array,
    ids: jax.Array,
    labels: jax.Array,
    *,
    sparse_schedule: Callable[[jax.Array], Any] | None = None,
) -> jax.Array:
    lookup = model.embed.lookup_ids(ids)  # type: ignore[attr-defined]  # make_train_step checks
    return _train_step(model, optimizer, dense, lookup, labels, sparse_schedule=sparse_schedule)


def _predict_step(model: nnx.Module, dense: jax.Array, sparse: Lookup) -> jax.Array:
    return jax.nn.sigmoid(model(dense, sparse))


def make_train_step(
    model: nnx.Module,
    tx: optax.GradientTransformation,
    *,
    host_callback: bool = False,
    sparse_schedule: Callable[[jax.Array], Any] | None = None,
) -> tuple[nnx.Optimizer, TrainStep]:
    """The jitted training step of ``model`` (BCE loss).

    Dense parameters (``nnx.Param``) are trained by ``tx``; rows of every
    ``CachedEmbed`` in the model by their cache's sparse optimizer, through
    ``jaxcache.nnx.value_and_grad``, in the same step. The model and optimizer
    are donated to the step, so their buffers (the cache rows too) are updated
    in place.

    Args:
      model: ``model(dense, lookup) -> logits [B]``, e.g. a ``DLRM``.
      tx: the dense optimizer, e.g. ``dense_optimizer("adagrad", 0.05)``.
      host_callback: the step takes the ids instead of a ``Lookup`` and
        looks them up inside with ``model.embed.lookup_ids`` (the host-callback
        form, same results, slower); feed it from
        ``jaxcache.prefetch(..., callback=True)`` to stage batches ahead.
      sparse_schedule: ``step -> factor`` of the rows' learning rates (an
        optax schedule, 1.0 at the configured rates), read at the dense
        optimizer's step count: warm-up and decay of the rows (pass a
        schedule to ``tx`` for the dense parameters). Default: constant.

    Returns:
      ``(optimizer, step)``: the ``nnx.Optimizer`` state and
      ``step(dense [B, I], lookup, labels [B]) -> loss``. Prepare the lookup
      with the model's ``CachedEmbed`` first (outside ``jit``), or pass the
      ids ``[B, F]`` with ``host_callback=True``.

    Examples:
      >>> import numpy as np, jaxcache
      >>> from flax import nnx
      >>> cfg = jaxcache.CacheConfig(100, 4, capacity=32, optimizer=jaxcache.rowwise_adagrad(0.1))
      >>> embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg))
      >>> model = jaxcache.models.DLRM(embed, num_sparse=2, features=4, bottom=(8,), top=(8,),
      ...                              rngs=nnx.Rngs(0))
      >>> _, step = jaxcache.models.make_train_step(
      ...     model, jaxcache.models.dense_optimizer("adagrad", 0.1))
      >>> dense, labels = np.ones((2, 13), np.float32), np.array([0.0, 1.0], np.float32)
      >>> losses = [float(step(dense, embed.prepare(np.array([[1, 2], [3, 4]])), labels))
      ...           for _ in range(3)]
      >>> losses[-1] < losses[0]
      True

      The host-callback form takes the ids themselves:

      >>> _, step_ids = jaxcache.models.make_train_step(
      ...     model, jaxcache.models.dense_optimizer("adagrad", 0.1), host_callback=True)
      >>> float(step_ids(dense, np.array([[1, 2], [3, 4]]), labels)) < losses[0]
      True
    """
    if host_callback and not isinstance(getattr(model, "embed", None), CachedEmbed):
        raise ValueError(
            f"host_callback=True needs model.embed to be a jaxcache.nnx.CachedEmbed (got "
            f"{type(getattr(model, 'embed', None)).__name__}); pass lookups from "
            "CachedEmbed.prepare with host_callback=False instead."
        )
    if sparse_schedule is not None and not callable(sparse_schedule):
        raise TypeError(
            f"sparse_schedule must be a function of the step (an optax schedule), got a "
            f"{type(sparse_schedule).__name__}; e.g. optax.linear_schedule(0.0, 1.0, 1000)."
        )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    # The model and optimizer are donated: every variable, the cache rows
    # included, is updated in place instead of being copied each step.
    step = _train_step_ids if host_callback else _train_step
    step = functools.partial(step, sparse_schedule=sparse_schedule)
    return optimizer, jit_step(step, model, optimizer)


def make_predict_step(model: nnx.Module) -> PredictStep:
    """The jitted prediction step: ``(dense [B, I], lookup) -> click probabilities [B]``.

    Prepare the lookup with ``train=False``: the rows are read, not updated,
    so nothing is written back when they leave the cache.

    Examples:
      >>> import numpy as np, jaxcache
      >>> from flax import nnx
      >>> cfg = jaxcache.CacheConfig(100, 4, capacity=32)
      >>> embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg))
      >>> model = jaxcache.models.DLRM(embed, num_sparse=2, features=4, bottom=(8,), top=(8,),
      ...                              rngs=nnx.Rngs(0))
      >>> predict = jaxcache.models.make_predict_step(model)
      >>> p = predict(np.ones((2, 13), np.float32), embed.prepare(np.array([[1, 2], [3, 4]]),
      ...                                                       train=False))
      >>> p.shape, bool(((p > 0) & (p < 1)).all())
      ((2,), True)
    """
    return jit_step(_predict_step, model, update=False)
