"""The naive baseline: rows read from a host NumPy table by ``jax.pure_callback``.

What a cache is measured against besides the full table: the table stays in
host memory and the step itself fetches its rows, by ``jax.pure_callback``
inside the jitted step; the step returns the rows' gradients and the host
applies the same row-wise Adagrad update as ``jaxcache.rowwise_adagrad``.
No row is kept on the device between steps, nothing is staged ahead: the
run is blocking (``staging`` is finding the batch's distinct ids, ``swap``
the host row update, ``device`` the step with its callback gathers).

``throughput_variants.py`` runs it beside the full table and the caches, on
the same batches and initial model:

    python benchmarks/throughput_variants.py --quick
"""

from __future__ import annotations

import time
from typing import NamedTuple

import _training
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxcache


class HostIds(NamedTuple):
    """A batch's distinct ids and each id's position among them (naive baseline).

    Attributes:
      unique_ids: ``int32 [U]`` distinct table ids, padded with ``N``.
      inverse: ``int32`` of the ids' shape, padding as ``U``.
      delta: ``[U, D]`` zeros added to the rows while differentiating.
    """

    unique_ids: jax.Array
    inverse: jax.Array
    delta: jax.Array | None = None


class HostCallbackEmbed(nnx.Module):
    """Rows read from a host NumPy table by ``jax.pure_callback`` inside the step."""

    def __init__(self, rows: np.ndarray, combiner: str | None) -> None:
        self.gather = _host_gather(rows)
        self.features = rows.shape[1]
        self.combiner = combiner

    def __call__(self, ids: HostIds) -> jax.Array:
        unique = ids.unique_ids.shape[0]
        shape = jax.ShapeDtypeStruct((unique, self.features), jnp.float32)
        rows = jax.pure_callback(self.gather, shape, ids.unique_ids)
        if ids.delta is not None:
            rows = rows + ids.delta
        embeddings = rows.at[ids.inverse].get(mode="fill", fill_value=0)
        if self.combiner is None:
            return embeddings
        real = (ids.inverse < unique).astype(embeddings.dtype)
        return jnp.einsum("...l,...ld->...d", real, embeddings)


def _host_gather(rows: np.ndarray):
    n = rows.shape[0]

    def gather(ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        out = rows[np.minimum(ids, n - 1)]
        out[ids >= n] = 0
        return out

    return gather


@nnx.jit(donate_argnums=(0, 1))
def _naive_step(model, optimizer, dense, ids, labels):
    def loss_fn(model, delta):
        logits = model(dense, ids._replace(delta=delta))
        return jaxcache.models.bce_loss(logits, labels)

    delta = jnp.zeros((ids.unique_ids.shape[0], model.embed.features), jnp.float32)
    diff = (nnx.DiffState(0, nnx.Param), 1)
    loss, (grads, row_grads) = nnx.value_and_grad(loss_fn, argnums=diff)(model, delta)
    optimizer.update(model, grads)
    return loss, row_grads


def run_naive(
    setup: _training.Setup, batches: list[dict], rows: np.ndarray, *, warmup: int, seed: int
) -> _training.Timing:
    """The host-table baseline: callback gather, host row-wise Adagrad (blocking)."""
    rows = rows.copy()
    accumulator = np.zeros(rows.shape[0], np.float32)
    optimizer = jaxcache.rowwise_adagrad(_training.ROW_LEARNING_RATE)
    embed = HostCallbackEmbed(rows, setup.combiner)
    model = _training.make_model(setup, embed, seed)
    dense_opt = nnx.Optimizer(model, setup.dense_optimizer(), wrt=nnx.Param)
    step = nnx.cached_partial(_naive_step, model, dense_opt)
    timing = _training.Timing("naive callback", 0)
    staging, update, device = [], [], []
    bucket = 0
    for i, batch in enumerate(batches):
        if i == warmup:
            compilations = jaxcache.testing.compilations()
        t0 = time.perf_counter()
        ids = batch["sparse"].reshape(-1)
        valid = ids >= 0
        unique, inverse = np.unique(ids[valid], return_inverse=True)
        bucket = jaxcache.device.bucket_size(unique.size, 64, bucket)
        padded = np.full(bucket, rows.shape[0], np.int32)
        padded[: unique.size] = unique
        positions = np.full(ids.shape, bucket, np.int32)
        positions[valid] = inverse
        host_ids = HostIds(
            jnp.asarray(padded), jnp.asarray(positions.reshape(batch["sparse"].shape))
        )
        t1 = time.perf_counter()
        loss, row_grads = step(batch["dense"], host_ids, batch["label"])
        timing.losses.append(loss)
        row_grads = np.asarray(row_grads)[: unique.size]
        t2 = time.perf_counter()
        # Row-wise Adagrad on the host, the rule of jaxcache.rowwise_adagrad.
        acc = accumulator[unique] + np.mean(row_grads * row_grads, axis=-1)
        accumulator[unique] = acc
        scale = optimizer.learning_rate / (np.sqrt(acc) + optimizer.eps)
        rows[unique] -= scale[:, None] * row_grads
        t3 = time.perf_counter()
        if i >= warmup:
            staging.append(t1 - t0)
            device.append(t2 - t1)
            update.append(t3 - t2)
    # The host row update takes the swap's column; the loop is this same loop.
    timing.parts = {"staging": staging, "swap": update, "device": device}
    timing.compilations = jaxcache.testing.compilations() - compilations
    return timing
