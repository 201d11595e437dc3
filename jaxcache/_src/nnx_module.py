"""Flax NNX shell: a cached embedding module and a fused sparse gradient step."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxcache._src import device_ops, sparse_grad
from jaxcache._src.device_ops import CacheState, Lookup, check_combiner
from jaxcache._src.engine import EmbeddingCache
from jaxcache._src.lifecycle import interrupts_held
from jaxcache._src.optimizers import check_rate_scale

__all__ = [
    "CacheOptState",
    "CacheRows",
    "CachedEmbed",
    "cached_embeds",
    "jit_step",
    "value_and_grad",
]


class CacheRows(nnx.Variable):
    """Cached embedding rows ``[C, D]``.

    Not an ``nnx.Param``: the rows are trained by the cache's sparse optimizer,
    not by the dense optax optimizer, and filtered out of it by type.

    Examples:
      >>> import jaxcache
      >>> from flax import nnx
      >>> cfg = jaxcache.CacheConfig(100, 4, capacity=8)
      >>> embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg))
      >>> nnx.state(embed, jaxcache.nnx.CacheRows)["rows"].shape, len(nnx.state(embed, nnx.Param))
      ((8, 4), 0)
    """


class CacheOptState(nnx.Variable):
    """Per-row optimizer state of the cached rows, ``{name: [C, ...]}``.

    Examples:
      >>> import jaxcache
      >>> from flax import nnx
      >>> cfg = jaxcache.CacheConfig(100, 4, capacity=8, optimizer=jaxcache.adam(0.01))
      >>> embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg))
      >>> sorted(embed.opt_state.get_value())
      ['count', 'mu', 'nu']
    """


class CachedEmbed(nnx.Module):
    """An embedding lookup served from an ``EmbeddingCache``, used like ``nnx.Embed``.

    The module holds the device half of the cache (rows and their optimizer
    state) as ``CacheRows`` and ``CacheOptState`` variables. Outside ``jit``,
    ``prepare(ids)`` maps a batch of ids to slots and brings missing rows in;
    inside the jitted step, calling the module with the returned ``Lookup``
    gathers the rows. Train with ``jaxcache.nnx.value_and_grad``, which applies
    the sparse optimizer to the touched rows in the same step.

    Modules built over one cache share its device half, as Flax modules share
    a variable: an evaluation model beside the training model reads the rows
    the training model wrote, and rows either one brings in serve both.

    Args:
      cache: the engine (host table, planner, statistics).
      combiner: ``None`` to return one row per id, or ``"sum"``/``"mean"`` to
        pool the last axis of the ids (fixed-width bags).

    Examples:
      >>> import numpy as np, jaxcache
      >>> from flax import nnx
      >>> cfg = jaxcache.CacheConfig(num_embeddings=1000, features=4, capacity=64)
      >>> embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg))
      >>> lookup = embed.prepare(np.array([[1, 2], [2, 999]]))
      >>> embed(lookup).shape
      (2, 2, 4)
    """

    def __init__(self, cache: EmbeddingCache, *, combiner: str | None = None) -> None:
        check_combiner(combiner)
        self.cache = cache
        self.combiner = combiner
        self.rows, self.opt_state = _device_half(cache)

    def get_state(self) -> CacheState:
        """The device state as a ``CacheState``."""
        return CacheState(self.rows[...], self.opt_state.get_value())

    def set_state(self, state: CacheState) -> None:
        """Replaces the device state."""
        self.rows.set_value(state.rows)
        self.opt_state.set_value(state.opt)

    def prepare(self, ids: np.ndarray, *, train: bool = True) -> Lookup:
        """Plans ``ids`` and swaps their missing rows in (eager, outside ``jit``).

        Args:
          ids: integer ids ``[B, ...]`` (``[B, L]`` bags with a combiner).
          train: the step will update these rows.

        Returns:
          The ``Lookup`` to pass to the module inside the step, before the
          next ``prepare`` (which may give its slots to other rows; to look
          ahead, use ``jaxcache.prefetch``).
        """
        device_ops.check_bags(self.combiner, np.shape(ids))
        with interrupts_held():  # a Ctrl-C waits until the module holds the new state
            state, lookup = self.cache.prepare(self.get_state(), ids, train=train)
            self.set_state(state)
        return lookup

    def lookup_ids(self, ids: jax.Array, *, train: bool = True) -> Lookup:
        """The host-callback form of ``prepare``, for use inside the jitted step.

        For input pipelines that cannot be changed to call ``prepare``: the
        ids go into the step, and an ordered ``jax.experimental.io_callback``
        obtains their slots from the host (from a batch ``jaxcache.prefetch``
        staged with ``callback=True``, or planned on the spot), then the swap
        runs inside the step and a second callback writes evicted rows back.
        Same results as ``prepare``; slower, because every list is padded to
        one fixed size (``CacheConfig.callback_rows``, by default the number of
        ids in the batch) and the callbacks serialize host and device work.
        Under a sharded ``jit`` a callback runs on one device (see the docs).
        It plans on the host: the cache needs ``planner="host"`` (the
        default on the CPU backend only; accelerators default to the device
        planner, which refuses this form).

        Ids travel into the step as JAX integers: with 64-bit types disabled
        they must be below ``2**31``. JAX wraps larger ones to ``int32`` at
        the ``jit`` boundary, before jaxcache sees them, so nothing can
        catch it here: ``2**32 + 5`` arrives as ``5``. Pass such ids through
        ``prepare`` or ``jaxcache.prefetch``, which take NumPy arrays.

        Args:
          ids: integer ids ``[B, ...]`` (traced).
          train: the step will update these rows.

        Returns:
          The ``Lookup`` to pass to the module in the same step.
        """
        device_ops.check_bags(self.combiner, np.shape(ids))
        state, lookup = self.cache.lookup_in_step(self.get_state(), ids, train=train)
        self.set_state(state)
        return lookup

    def __call__(self, lookup: Lookup, weights: jax.Array | None = None) -> jax.Array:
        """Rows ``[*ids.shape, D]``, or pooled ``[*ids.shape[:-1], D]`` with a combiner.

        Args:
          lookup: from ``prepare`` (of this module's cache).
          weights: optional per-id weights of the ids' shape (pooled modes).
        """
        return device_ops.embed(
            self.rows[...],
            lookup,
            table=self.cache.name,
            combiner=self.combiner,
            weights=weights,
            cache_id=self.cache.cache_id,
        )

    def apply_gradients(
        self, lookup: Lookup, grads: jax.Array, *, learning_rate_scale: Any = None
    ) -> None:
        """Sparse optimizer step on the rows of ``lookup``, at the configured
        learning rate times ``learning_rate_scale`` if given.

        ``grads`` is ``[devices, received, features]``: the gradient of the
        lookup's delta, as ``value_and_grad(..., apply_rows=False)`` returns
        it for each table."""
        device_ops.check_cache(lookup, self.cache.cache_id)
        self.set_state(
            device_ops.apply_sparse(
                self.get_state(),
                lookup,
                grads,
                self.cache.config.optimizer,
                learning_rate_scale=learning_rate_scale,
            )
        )

    def flush(self) -> None:
        """Writes every row changed on device back to the host table."""
        self.cache.flush(self.get_state())

    def export(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Full table and optimizer state in id order (NumPy copies)."""
        return self.cache.export(self.get_state())


def cached_embeds(model: nnx.Module) -> list[CachedEmbed]:
    """The ``CachedEmbed`` modules of an NNX model, in graph order: its cached tables.

    Examples:
      >>> import jaxcache
      >>> from flax import nnx
      >>> from jaxcache._src.nnx_module import cached_embeds
      >>> cfg = jaxcache.CacheConfig(100, 4, capacity=8)
      >>> model = nnx.List([jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg))])
      >>> [embed.cache.name for embed in cached_embeds(model)]
      ['embedding']
    """
    return [module for _, module in nnx.iter_modules(model) if isinstance(module, CachedEmbed)]


def value_and_grad(
    fn: Callable[..., Any],
    *,
    has_aux: bool = False,
    wrt: Any = nnx.Param,
    apply_rows: bool = True,
    learning_rate_scale: Any = None,
) -> Callable[..., tuple[Any, ...]]:
    """Like ``nnx.value_and_grad``, with the cached rows trained in the same step.

    ``fn(model, *args)`` must take the model first; every ``Lookup`` found in
    ``args`` is differentiated through a zero ``delta`` of shape ``[U, D]``,
    so the gradient of each distinct row costs ``O(U x D)``, never
    ``O(C x D)``. The sparse optimizer of the matching ``CachedEmbed`` is then
    applied to those rows. The returned gradients cover ``wrt`` (the dense
    parameters) for the optax optimizer.

    Args:
      fn: the loss function ``fn(model, *args) -> loss`` (or ``(loss, aux)``).
      has_aux: ``fn`` returns ``(loss, aux)``.
      wrt: filter of the dense variables to differentiate.
      apply_rows: apply the sparse optimizer to the rows (the default). With
        ``False`` the rows are left alone and the function returns
        ``(value, grads, row_grads)``, ``row_grads`` mapping each table's name
        to ``(lookup, grad)`` for ``CachedEmbed.apply_gradients``: for updates
        applied conditionally (``update_if_finite``).
      learning_rate_scale: multiplies every table's sparse learning rate in
        this step: a number >= 0 or a scalar array, such as an optax
        schedule's value at the dense optimizer's step for warm-up and
        decay, ``schedule(optimizer.step[...])`` with ``schedule`` giving a
        factor (1.0 at the configured rate). Default: the configured rates.
        Refused with ``apply_rows=False``, whose caller applies the rows.

    Returns:
      A function ``(model, *args) -> (value, grads)``. It raises
      ``ValueError`` when ``args`` hold no ``Lookup`` (a loss that takes its
      ``Lookup`` by closure would train no row) or two of the model's
      ``CachedEmbed`` modules share a table name.

    Examples:
      >>> import numpy as np, optax, jaxcache
      >>> from flax import nnx
      >>> cfg = jaxcache.CacheConfig(100, 4, capacity=16, optimizer=jaxcache.sgd(0.1))
      >>> class Model(nnx.Module):
      ...     def __init__(self, rngs):
      ...         cache = jaxcache.EmbeddingCache(cfg)
      ...         self.embed = jaxcache.nnx.CachedEmbed(cache, combiner="sum")
      ...         self.head = nnx.Linear(4, 1, rngs=rngs)
      ...     def __call__(self, lookup):
      ...         return self.head(self.embed(lookup))[:, 0]
      >>> model = Model(nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      >>> @nnx.jit
      ... def train_step(model, optimizer, lookup, labels):
      ...     def loss_fn(model, lookup):
      ...         return ((model(lookup) - labels) ** 2).mean()
      ...     loss, grads = jaxcache.nnx.value_and_grad(loss_fn)(model, lookup)
      ...     optimizer.update(model, grads)
      ...     return loss
      >>> lookup = model.embed.prepare(np.array([[1, 2], [3, 4]]))
      >>> float(train_step(model, optimizer, lookup, np.ones(2))) > 0
      True
    """

    if learning_rate_scale is not None:
        check_rate_scale(learning_rate_scale)
        if not apply_rows:
            raise ValueError(
                "learning_rate_scale scales the rows' update, which apply_rows=False leaves "
                "to the caller; pass it to CachedEmbed.apply_gradients instead."
            )

    def wrapped(model: nnx.Module, *args: Any) -> tuple[Any, ...]:
        _check_dense_filter(model, wrt)
        modules = cached_tables(model)
        features = {name: m.cache.config.features for name, m in modules.items()}

        def inner(model, deltas, args):
            return fn(model, *sparse_grad.attach_deltas(args, deltas))

        def differentiate(deltas):
            value, (grads, delta_grads) = nnx.value_and_grad(
                inner, argnums=(nnx.DiffState(0, wrt), 1), has_aux=has_aux
            )(model, deltas, args)
            return value, grads, delta_grads

        value, grads, row_grads = sparse_grad.sparse_value_and_grad(
            differentiate, args, features, hint="add a CachedEmbed for it to the model"
        )
        if not apply_rows:
            return value, grads, row_grads
        for table, (lookup, grad) in row_grads.items():
            modules[table].apply_gradients(lookup, grad, learning_rate_scale=learning_rate_scale)
        return value, grads

    return wrapped


def _check_dense_filter(model: nnx.Module, wrt: Any) -> None:
    """Refuses a ``wrt`` that takes in the cached rows or their optimizer
    state: their dense gradient would be the whole ``[C, D]`` table, and an
    optimizer over it would move the rows a second time."""
    cached = nnx.state(model, nnx.All(wrt, nnx.Any(CacheRows, CacheOptState)))
    if jax.tree.leaves(cached):
        raise ValueError(
            f"wrt={wrt!r} includes the cached rows (CacheRows or CacheOptState), which "
            "the cache's sparse optimizer trains in this step: differentiate the dense "
            "parameters only (the default, wrt=nnx.Param), and build nnx.Optimizer with "
            "wrt=nnx.Param too."
        )


# The device half of each cache that a CachedEmbed serves, built once. The
# cache's directory says which rows its slots hold; a second module with
# rows of its own would read rows resident only in the first one's.
_DEVICE_HALVES: weakref.WeakKeyDictionary[EmbeddingCache, tuple[CacheRows, CacheOptState]] = (
    weakref.WeakKeyDictionary()
)


def _device_half(cache: EmbeddingCache) -> tuple[CacheRows, CacheOptState]:
    half = _DEVICE_HALVES.get(cache)
    if half is None:
        state = cache.init_state()
        half = _DEVICE_HALVES[cache] = (CacheRows(state.rows), CacheOptState(state.opt))
    return half


def cached_tables(model: nnx.Module) -> dict[str, CachedEmbed]:
    """The ``CachedEmbed`` modules of ``model`` by table name.

    Raises:
      ValueError: two modules serve one table name: a lookup could not say
        which of them it reads.
    """
    modules: dict[str, CachedEmbed] = {}
    for module in cached_embeds(model):
        other = modules.setdefault(module.cache.name, module)
        if other is not module:
            raise ValueError(
                f"two CachedEmbed modules of the model serve a table named "
                f"{module.cache.name!r}; give each table's CacheConfig its own name= (a "
                "Lookup names the table it reads), or use one CachedEmbed where one table "
                "is looked up twice."
            )
    return modules


def jit_step(fn: Callable[..., Any], *nodes: Any, update: bool = True) -> Callable[..., Any]:
    """``fn(*nodes, *args)`` as one ``jax.jit`` over the variables of ``nodes``.

    What ``nnx.cached_partial(nnx.jit(fn), *nodes)`` does, with the module
    graph walked once instead of at every call. ``nnx.jit`` walks the object
    graph of the model and optimizer in Python at each call (2.5x this
    step's call, on the benchmark's DLRM on a CPU). The variables are found
    when the step is built; a call reads their arrays, runs one ``jax.jit``
    program on them (merging the modules inside, Flax's functional training
    loop) and writes the new arrays back into the same variables, so the
    modules stay the one place the state lives: ``jaxcache.prefetch`` swaps
    rows into a ``CachedEmbed`` between steps, and checkpoints read the
    modules.

    Args:
      fn: ``fn(*nodes, *args) -> out``; it may update the nodes' variables
        but must not change their structure (no new attributes holding
        variables), as with ``nnx.cached_partial``.
      *nodes: the modules (and optimizer) ``fn`` takes first.
      update: ``True`` (a training step): the variables' arrays are donated
        to the step and replaced by its results. ``False`` (prediction): the
        step only reads them; nothing is copied out or written back.

    Returns:
      ``step(*args) -> out``.

    Examples:
      >>> import numpy as np, optax, jaxcache
      >>> from flax import nnx
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      >>> def train_step(model, optimizer, x, y):
      ...     loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(model)
      ...     optimizer.update(model, grads)
      ...     return loss
      >>> step = jaxcache.nnx.jit_step(train_step, model, optimizer)
      >>> x, y = np.ones((4, 2), np.float32), np.zeros((4, 1), np.float32)
      >>> losses = [float(step(x, y)) for _ in range(3)]
      >>> losses[2] < losses[0], int(optimizer.step[...])
      (True, 3)
    """
    return _JitStep(fn, *nodes, update=update)


class _JitStep:
    """The callable ``jit_step`` returns."""

    def __init__(self, fn: Callable[..., Any], *nodes: Any, update: bool) -> None:
        graphdef, state = nnx.split(nodes)
        treedef: jax.tree_util.PyTreeDef = jax.tree.structure(state)
        paths = [
            path
            for path, _ in jax.tree_util.tree_flatten_with_path(
                state, is_leaf=lambda x: isinstance(x, nnx.Variable)
            )[0]
        ]
        live = {
            path: node
            for path, node in nnx.graph.iter_graph(nodes)
            if isinstance(node, nnx.Variable)
        }
        self._variables = [live[tuple(_path_key(k) for k in path)] for path in paths]
        values: jax.tree_util.PyTreeDef = jax.tree.structure(
            [v.get_raw_value() for v in self._variables]
        )
        self._values = values
        if values.num_leaves != treedef.num_leaves:  # a variable's value is not its leaves
            raise TypeError(
                f"the variables of {type(nodes[0]).__name__} hold {values.num_leaves} "
                f"arrays but their state {treedef.num_leaves}; use nnx.jit for this model."
            )

        def pure(values: list[Any], *args: Any) -> Any:
            inside = nnx.merge(graphdef, jax.tree.unflatten(treedef, jax.tree.leaves(values)))
            out = fn(*inside, *args)
            if not update:
                return out
            after, new_state = nnx.split(inside)
            if after != graphdef:
                raise ValueError(
                    f"{getattr(fn, '__name__', fn)} changed the structure of the modules its "
                    "step was built with; create every variable before building the step (in "
                    "__init__) and only update variables inside it."
                )
            return jax.tree.leaves(new_state), out

        self._update = update
        self._jitted = jax.jit(pure, donate_argnums=(0,) if update else ())
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any) -> Any:
        values = [v.get_raw_value() for v in self._variables]
        if not self._update:
            return self._jitted(values, *args)
        new, out = self._jitted(values, *args)
        for variable, value in zip(self._variables, self._values.unflatten(new), strict=True):
            variable.set_raw_value(value)
        return out


def _path_key(key: Any) -> Any:
    """The plain key of a ``jax.tree_util`` path entry (dict key, index, attribute)."""
    for name in ("key", "idx", "name"):
        if hasattr(key, name):
            return getattr(key, name)
    raise TypeError(f"unexpected path entry {key!r}")
