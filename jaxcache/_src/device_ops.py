"""Device side: cache state, the donated swap, lookups and sparse updates.

All functions here are pure and jit-friendly. The cache's rows are ``[C, D]``
and every per-row optimizer state array has the same leading ``C`` axis, so
the whole state shards row-wise over a mesh with one ``PartitionSpec``.
Out-of-range indices are the padding convention: ``C`` (one past the end) for
slots, ``U`` for positions, read with ``mode="fill"`` (zeros) and written with
``mode="drop"`` (ignored). ``-1`` is never used as padding: it would wrap to
the last row.

Shape letters: ``C`` capacity, ``D`` row width, ``U`` padded distinct rows of
a batch, ``P`` padded rows moved by a swap.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcache._src.optimizers import SparseOptimizer

__all__ = [
    "CacheState",
    "Lookup",
    "apply_sparse",
    "attach_deltas",
    "embed",
    "find_lookups",
    "lookup_rows",
    "pool",
    "swap",
    "zero_deltas",
]


class CacheState(NamedTuple):
    """The device half of a cache.

    Attributes:
      rows: ``[C, D]`` cached rows.
      opt: ``{name: [C, ...]}`` their optimizer state.

    Examples:
      >>> import jaxcache
      >>> cfg = jaxcache.CacheConfig(100, 4, capacity=8, optimizer=jaxcache.adagrad(0.1))
      >>> state = jaxcache.EmbeddingCache(cfg).init_state()
      >>> state.rows.shape, state.opt["accumulator"].shape
      ((8, 4), (8, 4))
    """

    rows: jax.Array
    opt: dict[str, jax.Array]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["unique_slots", "inverse", "delta"],
    meta_fields=["table"],
)
@dataclasses.dataclass(frozen=True)
class Lookup:
    """A batch of ids already mapped to cache slots (device arrays).

    Produced on the host by ``EmbeddingCache.prepare``; consumed inside the
    jitted step. It is a pytree, so it can sit anywhere in a batch.

    Attributes:
      unique_slots: ``int32 [U]`` slot of each distinct id, padded with ``C``.
      inverse: ``int32`` of the ids' shape: index into ``unique_slots``; ``U``
        marks padding (a zero row, no gradient).
      delta: ``[U, D]`` zeros added to the distinct rows while differentiating,
        so the gradient of the loss w.r.t. it is the per-row gradient; set by
        the ``value_and_grad`` of ``jaxcache.nnx`` and ``jaxcache.linen``,
        ``None`` otherwise.
      table: name of the table the slots belong to.

    Examples:
      >>> import numpy as np, jaxcache
      >>> cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, capacity=8))
      >>> state, lookup = cache.prepare(cache.init_state(), np.array([[5, 9, 5]]))
      >>> lookup.shape, lookup.inverse.tolist(), lookup.unique_slots.shape
      ((1, 3), [[0, 1, 0]], (64,))
    """

    unique_slots: jax.Array
    inverse: jax.Array
    delta: jax.Array | None = None
    table: str = "embedding"

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the looked-up ids."""
        return tuple(self.inverse.shape)

    def with_delta(self, delta: jax.Array | None) -> Lookup:
        """The same lookup with ``delta`` attached."""
        return dataclasses.replace(self, delta=delta)


def lookup_rows(rows: jax.Array, lookup: Lookup) -> jax.Array:
    """Rows of each looked-up id: ``[*ids.shape, D]`` (zeros for padding).

    Examples:
      >>> import jax.numpy as jnp, jaxcache
      >>> rows = jnp.arange(6.0).reshape(3, 2)
      >>> lk = jaxcache.Lookup(jnp.array([2, 0, 3]), jnp.array([[0, 1], [1, 3]]))
      >>> jaxcache.lookup_rows(rows, lk).tolist()
      [[[4.0, 5.0], [0.0, 1.0]], [[0.0, 1.0], [0.0, 0.0]]]
    """
    distinct = rows.at[lookup.unique_slots].get(mode="fill", fill_value=0)
    if lookup.delta is not None:
        distinct = distinct + lookup.delta.astype(distinct.dtype)
    return distinct.at[lookup.inverse].get(mode="fill", fill_value=0)


def pool(
    embeddings: jax.Array,
    lookup: Lookup,
    combiner: str,
    weights: jax.Array | None = None,
) -> jax.Array:
    """Pools bags ``[..., L, D]`` over ``L`` by ``"sum"`` or ``"mean"``.

    Padding positions count for nothing; ``mean`` divides by the (weighted)
    number of real ids, and an empty bag pools to zeros.

    Examples:
      >>> import jax.numpy as jnp, jaxcache
      >>> rows = jnp.arange(6.0).reshape(3, 2)
      >>> lk = jaxcache.Lookup(jnp.array([2, 0, 3]), jnp.array([[0, 1], [1, 3]]))
      >>> emb = jaxcache.lookup_rows(rows, lk)
      >>> jaxcache.pool(emb, lk, "mean").tolist()
      [[2.0, 3.0], [0.0, 1.0]]
    """
    real = (lookup.inverse < lookup.unique_slots.shape[0]).astype(embeddings.dtype)
    w = real if weights is None else real * weights.astype(embeddings.dtype)
    total = jnp.einsum("...l,...ld->...d", w, embeddings)
    if combiner == "sum":
        return total
    if combiner == "mean":
        count = jnp.sum(w, axis=-1, keepdims=True)
        return total / jnp.where(count == 0, 1, count)
    raise ValueError(f"combiner={combiner!r} is not supported; use 'sum', 'mean' or None.")


@jax.jit
def _read(state: CacheState, slots: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    def read(array):
        return array.at[slots].get(mode="fill", fill_value=0)

    return read(state.rows), {k: read(v) for k, v in state.opt.items()}


@functools.partial(jax.jit, donate_argnums=0)
def _write(
    state: CacheState, slots: jax.Array, rows: jax.Array, opt: dict[str, jax.Array]
) -> CacheState:
    def write(array, values):
        return array.at[slots].set(values.astype(array.dtype), mode="drop")

    return CacheState(write(state.rows, rows), {k: write(v, opt[k]) for k, v in state.opt.items()})


def swap(
    state: CacheState,
    evict_slots: jax.Array,
    fetch_slots: jax.Array,
    fetch_rows: jax.Array,
    fetch_opt: dict[str, jax.Array],
) -> tuple[CacheState, jax.Array, dict[str, jax.Array]]:
    """Reads the evicted rows out, then writes the fetched rows in (donated).

    Two programs, not one: when a single program both reads the victims and
    updates the donated buffer in place, XLA copies the whole ``[C, D]``
    cache to keep the read safe, so the swap would cost ``O(C x D)``. Read
    first, then the donated in-place write: ``O(P x D)``, ordered by the
    runtime because the write waits for every reader of the buffer it takes.

    Args:
      state: the cache; its buffers are donated and updated in place.
      evict_slots: ``int32 [P]`` slots to read for write-back, padded with ``C``.
      fetch_slots: ``int32 [P]`` slots to fill, padded with ``C``.
      fetch_rows: ``[P, D]`` rows for them.
      fetch_opt: ``{name: [P, ...]}`` their optimizer state.

    Returns:
      ``(state, evicted_rows [P, D], evicted_opt)``; padding reads zeros.

    Examples:
      >>> import jax.numpy as jnp, jaxcache
      >>> state = jaxcache.CacheState(jnp.arange(6.0).reshape(3, 2), {})
      >>> state, out, _ = jaxcache.swap(state, jnp.array([1, 3]), jnp.array([1, 3]),
      ...                               jnp.array([[9.0, 9.0], [7.0, 7.0]]), {})
      >>> out.tolist(), state.rows.tolist()  # slot 3 is padding: read 0, write dropped
      ([[2.0, 3.0], [0.0, 0.0]], [[0.0, 1.0], [9.0, 9.0], [4.0, 5.0]])
    """
    evicted_rows, evicted_opt = _read(state, evict_slots)
    return _write(state, fetch_slots, fetch_rows, fetch_opt), evicted_rows, evicted_opt


def apply_sparse(
    state: CacheState,
    unique_slots: jax.Array,
    grads: jax.Array,
    optimizer: SparseOptimizer,
) -> CacheState:
    """Applies ``optimizer`` to the rows ``unique_slots`` only.

    ``O(U x D)`` work: the touched rows and their state are gathered, updated
    and scattered back; padding slots (``C``) are dropped.

    Args:
      state: the cache.
      unique_slots: ``int32 [U]`` distinct slots, padded with ``C``.
      grads: ``[U, D]`` summed gradient of each.
      optimizer: the sparse optimizer.

    Returns:
      The updated state.

    Examples:
      >>> import jax.numpy as jnp, jaxcache
      >>> state = jaxcache.CacheState(jnp.zeros((3, 2)), {})
      >>> grads = jnp.ones((2, 2))
      >>> state = jaxcache.apply_sparse(state, jnp.array([2, 3]), grads, jaxcache.sgd(0.5))
      >>> state.rows.tolist()  # only slot 2 changed; 3 is padding
      [[0.0, 0.0], [0.0, 0.0], [-0.5, -0.5]]
    """

    def read(array):
        return array.at[unique_slots].get(mode="fill", fill_value=0)

    rows, opt = optimizer.update(
        read(state.rows), grads, {k: read(v) for k, v in state.opt.items()}
    )

    def write(array, values):
        return array.at[unique_slots].set(values.astype(array.dtype), mode="drop")

    return CacheState(write(state.rows, rows), {k: write(v, opt[k]) for k, v in state.opt.items()})


def embed(
    rows: jax.Array,
    lookup: Lookup,
    *,
    table: str,
    combiner: str | None = None,
    weights: jax.Array | None = None,
) -> jax.Array:
    """The body of a cached embedding module's call: check, gather, pool.

    Args:
      rows: ``[C, D]`` cached rows of ``table``.
      lookup: the batch's ``Lookup``; it must be for ``table``.
      table: name of the table the module serves.
      combiner: ``None`` (a row per id), ``"sum"`` or ``"mean"`` over the last id axis.
      weights: optional per-id weights (pooled modes only).

    Returns:
      ``[*ids.shape, D]``, or ``[*ids.shape[:-1], D]`` with a combiner.

    Examples:
      >>> import jax.numpy as jnp, jaxcache
      >>> lk = jaxcache.Lookup(jnp.array([1, 0]), jnp.array([[0, 1, 2]]), table="t")
      >>> jaxcache.embed(jnp.eye(2), lk, table="t", combiner="sum").tolist()
      [[1.0, 1.0]]
    """
    if lookup.table != table:
        raise ValueError(
            f"lookup is for table {lookup.table!r} but this module serves {table!r}; "
            "prepare ids with the cache of the module that looks them up."
        )
    embeddings = lookup_rows(rows, lookup)
    if combiner is None:
        if weights is not None:
            raise ValueError("weights need a combiner ('sum' or 'mean').")
        return embeddings
    return pool(embeddings, lookup, combiner, weights)


def _is_lookup(x: object) -> bool:
    return isinstance(x, Lookup)


def find_lookups(args: object, features: dict[str, int], hint: str) -> list[Lookup]:
    """The ``Lookup`` leaves of ``args``, checked: known tables, one per table.

    Args:
      args: any pytree (the arguments of a loss function).
      features: row width ``D`` of each known table, by name.
      hint: what to do when a lookup's table is unknown.
    """
    lookups = [x for x in jax.tree.leaves(args, is_leaf=_is_lookup) if _is_lookup(x)]
    tables = [lookup.table for lookup in lookups]
    for name in tables:
        if name not in features:
            raise ValueError(
                f"a Lookup for table {name!r} was passed but nothing serves it "
                f"(tables: {sorted(features)}); {hint}."
            )
    if len(set(tables)) != len(tables):
        raise ValueError(
            f"tables {tables} are looked up more than once in one step; prepare all ids of "
            "a table as one array (one Lookup per table per step)."
        )
    return lookups


def zero_deltas(lookups: list[Lookup], features: dict[str, int]) -> list[jax.Array]:
    """A zero ``[U, D]`` delta per lookup: differentiating it gives the row gradients."""
    return [
        jnp.zeros((lk.unique_slots.shape[0], features[lk.table]), jnp.float32) for lk in lookups
    ]


def attach_deltas(args: object, deltas: list[jax.Array]) -> object:
    """``args`` with each ``Lookup`` leaf carrying its delta (same order as ``find_lookups``)."""
    it = iter(deltas)
    return jax.tree.map(
        lambda x: x.with_delta(next(it)) if _is_lookup(x) else x, args, is_leaf=_is_lookup
    )
