"""Device side: cache state, the donated swap, lookups and sparse updates.

All functions here are pure and jit-friendly. Over a mesh, a lookup is an
exchange inside ``jax.shard_map`` (``routed_gather``): every owner gathers
the rows each source asks of it (``Lookup.requests``) and one
``all_to_all`` delivers them; rows past a fixed ``K`` per pair take an
overflow path that every device reads (summed over the axis), so nothing is
dropped. Gradients go back the same way, are summed per row on the owner,
and the sparse optimizer updates the owner's rows (``routed_apply``). Which
row goes where (the route) is the planner's: ``routing.build_route`` on the
host, or the device planner's program. The cache's rows are ``[C, D]``
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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxcache._src.optimizers import SparseOptimizer

__all__ = [
    "COMBINERS",
    "CacheState",
    "Lookup",
    "apply_sparse",
    "check_combiner",
    "check_weights",
    "embed",
    "lookup_rows",
    "pool",
    "routed_apply",
    "routed_gather",
    "swap",
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


@dataclasses.dataclass(frozen=True)
class Lookup:
    """A batch of ids already mapped to cache slots and routed (device arrays).

    Produced on the host by ``EmbeddingCache.prepare`` (or ``stage``);
    consumed inside the jitted step. It is a pytree, so it can sit anywhere in
    a batch. The cache's rows are split over the ``n`` devices of ``axis``
    and so is the batch; the arrays say which rows each device fetches from
    which owner (see ``routed_gather``). One device is a mesh of one.

    Attributes:
      requests: ``int32 [n, n, K]`` local slots each device asks each owner for.
      overflow: ``int32 [O]`` global slots beyond ``K``, shared by all devices.
      inverse: ``int32`` of the ids' shape: each id's row in its device's
        received rows ``[R = n K + O]``; ``R`` marks padding (a zero row, no
        gradient).
      owner_slots: ``int32 [n, V]`` distinct local slots each owner updates.
      owner_inverse: ``int32 [n, R]`` where each gradient an owner receives adds.
      delta: ``[n, R, D]`` zeros added to the received rows while
        differentiating, so the gradient w.r.t. it is the per-row gradient;
        set by the ``value_and_grad`` of ``jaxcache.nnx`` and
        ``jaxcache.linen``, ``None`` otherwise.
      positions: ``int32 [n, P]`` or ``None``: for bags with padding, where
        the real ids are in each device's share of the flattened ids, padded
        with the share's length. Pooling reads and differentiates only these
        ``P`` rows per device instead of every position of the bags (mostly
        padding in multi-hot batches).
      table: name of the table.
      mesh: the device mesh of the table's rows.
      axis: the mesh axis the rows and the batch are split over.
      train: the batch was prepared for training (``train=True``), so its
        rows are written back when they leave the cache. The sparse update
        refuses a lookup prepared with ``train=False``.
      cache_id: the ``EmbeddingCache.cache_id`` of the cache that made it
        (``0``: not known), so that a module over another cache of the same
        table name refuses it rather than reading its own rows at these
        slots.

    A lookup made by ``prepare`` serves until the cache applies the next
    plan: that swap may give its slots to other rows, so passing it to a
    step afterwards (to a jitted function, or to the module) raises
    ``ValueError`` instead of reading and training the wrong rows.

    Examples:
      >>> import numpy as np, jaxcache
      >>> cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, capacity=8))
      >>> state, lookup = cache.prepare(cache.init_state(), np.array([[5, 9, 5]]))
      >>> lookup.shape, lookup.inverse.tolist(), lookup.requests.shape
      ((1, 3), [[0, 1, 0]], (1, 1, 64))
    """

    requests: jax.Array
    overflow: jax.Array
    inverse: jax.Array
    owner_slots: jax.Array
    owner_inverse: jax.Array
    delta: jax.Array | None = None
    positions: jax.Array | None = None
    table: str = "embedding"
    mesh: Mesh | None = None
    axis: str = "rows"
    train: bool = True
    cache_id: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the looked-up ids."""
        return tuple(self.inverse.shape)

    @property
    def received(self) -> int:
        """``R``: rows each device receives (``n K + O``)."""
        n, _, k = self.requests.shape
        return n * k + self.overflow.shape[0]

    def with_delta(self, delta: jax.Array | None) -> Lookup:
        """The same lookup with ``delta`` attached."""
        return dataclasses.replace(self, delta=delta)

    def check_fresh(self) -> None:
        """Raises ``ValueError`` if the cache that made this lookup has
        applied a later plan since (set by the cache, which knows; a
        lookup inside a traced function is always fresh)."""
        guard = self.__dict__.get("_guard")
        if guard is not None:
            guard()


# Flattening is where a host-side lookup enters every jitted call (and
# ``jax.tree`` functions), so a stale one is refused there.
_LOOKUP_DATA = (
    "requests",
    "overflow",
    "inverse",
    "owner_slots",
    "owner_inverse",
    "delta",
    "positions",
)
_LOOKUP_META = ("table", "mesh", "axis", "train", "cache_id")


def _flatten_lookup(lookup: Lookup) -> tuple[list, tuple]:
    lookup.check_fresh()
    return [getattr(lookup, n) for n in _LOOKUP_DATA], tuple(
        getattr(lookup, n) for n in _LOOKUP_META
    )


def _flatten_lookup_with_keys(lookup: Lookup) -> tuple[list, tuple]:
    children, meta = _flatten_lookup(lookup)
    keys = [jax.tree_util.GetAttrKey(n) for n in _LOOKUP_DATA]
    return list(zip(keys, children, strict=True)), meta


jax.tree_util.register_pytree_with_keys(
    Lookup,
    _flatten_lookup_with_keys,
    lambda meta, children: Lookup(*children, *meta),
    _flatten_lookup,
)


def lookup_rows(rows: jax.Array, lookup: Lookup) -> jax.Array:
    """Rows of each looked-up id: ``[*ids.shape, D]`` (zeros for padding).

    Runs under ``jax.shard_map`` over ``lookup.mesh``: each device fetches
    the rows of its share of the batch from their owners (``all_to_all``).

    Examples:
      >>> import numpy as np, jaxcache
      >>> cfg = jaxcache.CacheConfig(10, 2, capacity=4, padding_id=-1)
      >>> rows = np.arange(20.0, dtype=np.float32).reshape(10, 2)
      >>> cache = jaxcache.EmbeddingCache(cfg, table=jaxcache.HostTable(cfg, rows=rows))
      >>> state, lookup = cache.prepare(cache.init_state(), np.array([[7, 2], [2, -1]]))
      >>> jaxcache.device.lookup_rows(state.rows, lookup).tolist()
      [[[14.0, 15.0], [4.0, 5.0]], [[4.0, 5.0], [0.0, 0.0]]]
    """
    spec = PartitionSpec(lookup.axis)
    axis = lookup.axis

    def body(rows, requests, overflow, inverse, *delta):
        received = _received(rows, requests, overflow, axis, *delta)
        return received.at[inverse].get(mode="fill", fill_value=0).astype(rows.dtype)

    args = [rows, lookup.requests, lookup.overflow, lookup.inverse]
    specs = [spec, spec, PartitionSpec(), spec]
    if lookup.delta is not None:
        args.append(lookup.delta)
        specs.append(spec)
    return jax.shard_map(
        body, mesh=lookup.mesh, in_specs=tuple(specs), out_specs=spec, check_vma=False
    )(*args)


def _received(
    rows: jax.Array, requests: jax.Array, overflow: jax.Array, axis: str, *delta: jax.Array
) -> jax.Array:
    """Inside ``shard_map``: this device's received rows ``[R, D]``, plus its
    block of ``Lookup.delta`` when given (so the gradient w.r.t. it is each
    received row's), in float32 at least: the gradients of an id's
    lookups add up into its received row in that type, not in bfloat16
    (where 256 equal terms already stop growing)."""
    received = routed_gather(rows, requests, overflow, axis)
    received = received.astype(_accumulator(received.dtype))
    if delta:
        received = received + delta[0][0].astype(received.dtype)
    return received


def routed_gather(
    rows: jax.Array, requests: jax.Array, overflow: jax.Array, axis: str
) -> jax.Array:
    """Inside ``shard_map``: this device's received rows ``[R, D]``.

    Args:
      rows: this device's ``[C_l, D]`` cached rows.
      requests: ``[1, n, K]`` local slots this device serves each source.
      overflow: ``[O]`` global slots of the overflow path (same on all devices).
      axis: the mesh axis the rows and the batch are split over.
    """
    cl = rows.shape[0]
    served = rows.at[requests[0]].get(mode="fill", fill_value=0)  # [n, K, D], per source
    got = jax.lax.all_to_all(served, axis, 0, 0, tiled=True)  # [n, K, D] from each owner
    mine = overflow // cl == jax.lax.axis_index(axis)
    local = jnp.where(mine, overflow % cl, cl)
    extra = jax.lax.psum(rows.at[local].get(mode="fill", fill_value=0), axis)
    return jnp.concatenate([got.reshape(-1, rows.shape[1]), extra.astype(rows.dtype)])


def routed_apply(
    rows: jax.Array,
    opt: dict[str, jax.Array],
    grads: jax.Array,
    owner_slots: jax.Array,
    owner_inverse: jax.Array,
    *,
    per_destination: int,
    optimizer: SparseOptimizer,
    axis: str,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Inside ``shard_map``: sends gradients back to the owners, sums them per
    row and applies ``optimizer`` to the owner's rows.

    Args:
      rows: this device's ``[C_l, D]`` cached rows.
      opt: their optimizer state ``{name: [C_l, ...]}``.
      grads: ``[1, R, D]`` gradient of each row this device received.
      owner_slots: ``[1, V]`` distinct local slots this device updates.
      owner_inverse: ``[1, R]`` row of ``owner_slots`` each gradient it gets adds to.
      per_destination: ``K``.
      optimizer: the sparse optimizer.
      axis: the mesh axis.

    Returns:
      The updated local ``(rows, opt)``.
    """
    g = grads[0]
    n = jax.lax.axis_size(axis)
    direct = g[: n * per_destination].reshape(n, per_destination, -1)
    back = jax.lax.all_to_all(direct, axis, 0, 0, tiled=True).reshape(n * per_destination, -1)
    extra = jax.lax.psum(g[n * per_destination :], axis)
    summed = jax.ops.segment_sum(
        jnp.concatenate([back, extra]), owner_inverse[0], num_segments=owner_slots.shape[1]
    )
    slots = owner_slots[0]

    def read(array):
        return array.at[slots].get(mode="fill", fill_value=0)

    new_rows, new_opt = optimizer.update(read(rows), summed, {k: read(v) for k, v in opt.items()})

    def write(array, values):
        return array.at[slots].set(values.astype(array.dtype), mode="drop")

    return write(rows, new_rows), {k: write(v, new_opt[k]) for k, v in opt.items()}


#: What a cached embedding module accepts as ``combiner``.
COMBINERS = (None, "sum", "mean")


def check_combiner(combiner: str | None, *, pooled: bool = False) -> None:
    """Refuses a combiner other than ``None``, ``"sum"`` or ``"mean"``.

    Args:
      combiner: the value to check.
      pooled: the caller pools, so ``None`` is refused too.

    Raises:
      ValueError: naming the value and the accepted ones.
    """
    accepted = COMBINERS[1:] if pooled else COMBINERS
    if combiner not in accepted:
        names = " or ".join(repr(c) for c in accepted)
        raise ValueError(f"combiner={combiner!r} is not supported; use {names}.")


def pool(
    embeddings: jax.Array,
    lookup: Lookup,
    combiner: str,
    weights: jax.Array | None = None,
) -> jax.Array:
    """Pools bags ``[..., L, D]`` over ``L`` by ``"sum"`` or ``"mean"``.

    Padding positions count for nothing; ``mean`` divides by the (weighted)
    number of real ids, and an empty bag pools to zeros (a bag whose
    weights sum to zero is not divided). Sums run in float32 at least, so
    bfloat16 rows pool long bags and keep the weights' digits; the result
    has the rows' dtype. ``weights``, when given, has the ids' shape
    (``lookup.shape``); another shape raises a ``ValueError``.

    Examples:
      >>> import numpy as np, jaxcache
      >>> cfg = jaxcache.CacheConfig(10, 2, capacity=4, padding_id=-1)
      >>> rows = np.arange(20.0, dtype=np.float32).reshape(10, 2)
      >>> cache = jaxcache.EmbeddingCache(cfg, table=jaxcache.HostTable(cfg, rows=rows))
      >>> state, lookup = cache.prepare(cache.init_state(), np.array([[7, 2], [2, -1]]))
      >>> emb = jaxcache.device.lookup_rows(state.rows, lookup)
      >>> jaxcache.device.pool(emb, lookup, "mean").tolist()
      [[9.0, 10.0], [4.0, 5.0]]
    """
    check_weights(weights, lookup)
    acc = _accumulator(embeddings.dtype)
    real = lookup.inverse < lookup.received
    # ``where``, not a product: a weight at padding may be anything, NaN too.
    w = real.astype(acc) if weights is None else jnp.where(real, weights.astype(acc), 0)
    total = jnp.einsum("...l,...ld->...d", w, embeddings, preferred_element_type=acc)
    check_combiner(combiner, pooled=True)
    if combiner == "mean":
        count = jnp.sum(w, axis=-1, keepdims=True)
        total = total / jnp.where(count == 0, 1, count)
    return total.astype(embeddings.dtype)


def _accumulator(dtype: jnp.dtype) -> jnp.dtype:
    """The dtype a batch's sums over rows run in (received rows, their
    gradients, pooling): float32 at least. Summed in bfloat16, a bag of a few
    hundred ids loses most of its last terms (256 copies of a row already add
    nothing more), and weights lose their low digits."""
    return jnp.promote_types(dtype, jnp.float32)


def _read_rows(
    rows: jax.Array, opt: dict[str, jax.Array], slots: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Rows and state at ``slots``; out-of-range slots read zeros."""

    def read(array):
        return array.at[slots].get(mode="fill", fill_value=0)

    return read(rows), {k: read(v) for k, v in opt.items()}


def _write_rows(
    rows: jax.Array,
    opt: dict[str, jax.Array],
    slots: jax.Array,
    new_rows: jax.Array,
    new_opt: dict[str, jax.Array],
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Rows and state with ``slots`` overwritten; out-of-range slots dropped."""

    def write(array, values):
        return array.at[slots].set(values.astype(array.dtype), mode="drop")

    return write(rows, new_rows), {k: write(v, new_opt[k]) for k, v in opt.items()}


@jax.jit
def _read(state: CacheState, slots: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    return _read_rows(state.rows, state.opt, slots)


@functools.partial(jax.jit, donate_argnums=0)
def _write(
    state: CacheState, slots: jax.Array, rows: jax.Array, opt: dict[str, jax.Array]
) -> CacheState:
    return CacheState(*_write_rows(state.rows, state.opt, slots, rows, opt))


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
      >>> state, out, _ = jaxcache.device.swap(state, jnp.array([1, 3]), jnp.array([1, 3]),
      ...                               jnp.array([[9.0, 9.0], [7.0, 7.0]]), {})
      >>> out.tolist(), state.rows.tolist()  # slot 3 is padding: read 0, write dropped
      ([[2.0, 3.0], [0.0, 0.0]], [[0.0, 1.0], [9.0, 9.0], [4.0, 5.0]])
    """
    evicted_rows, evicted_opt = _read(state, evict_slots)
    return _write(state, fetch_slots, fetch_rows, fetch_opt), evicted_rows, evicted_opt


@functools.partial(jax.jit, static_argnames=("mesh", "axis"))
def read_blocks(
    state: CacheState, slots: jax.Array, *, mesh: Mesh, axis: str
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Each device reads its own rows: ``slots`` ``[n P]`` holds local slots,
    ``P`` per device (padding ``C_l``, read as zeros); rows come back split
    the same way. No data crosses devices.

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np, jaxcache
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("rows",))
      >>> state = jaxcache.CacheState(jnp.arange(6.0).reshape(3, 2), {})
      >>> rows, _ = read_blocks(state, jnp.array([2, 3]), mesh=mesh, axis="rows")
      >>> rows.tolist()
      [[4.0, 5.0], [0.0, 0.0]]
    """
    spec = PartitionSpec(axis)
    return jax.shard_map(
        _read_rows, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, spec), check_vma=False
    )(state.rows, state.opt, slots)


@functools.partial(jax.jit, static_argnames=("mesh", "axis"), donate_argnums=0)
def _write_blocks(
    state: CacheState,
    slots: jax.Array,
    rows: jax.Array,
    opt: dict[str, jax.Array],
    *,
    mesh: Mesh,
    axis: str,
) -> CacheState:
    spec = PartitionSpec(axis)
    rows, opt = jax.shard_map(
        _write_rows, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec, spec), check_vma=False
    )(state.rows, state.opt, slots, rows, opt)
    return CacheState(rows, opt)


def swap_blocks(
    state: CacheState,
    evict_slots: jax.Array,
    fetch_slots: jax.Array,
    fetch_rows: jax.Array,
    fetch_opt: dict[str, jax.Array],
    *,
    mesh: Mesh,
    axis: str,
) -> tuple[CacheState, jax.Array, dict[str, jax.Array]]:
    """``swap`` with every device moving only its own rows.

    The lists are split over ``axis`` like the cache: ``[n P]`` arrays hold
    ``P`` local slots (padding ``C_l``) and rows per device, so a device
    receives only the rows it stores and the host of a process builds only
    its devices' blocks. Read then donated write, as in ``swap``.

    Returns:
      ``(state, evicted_rows [n P, D], evicted_opt)``, split like the lists.
    """
    evicted_rows, evicted_opt = read_blocks(state, evict_slots, mesh=mesh, axis=axis)
    state = _write_blocks(state, fetch_slots, fetch_rows, fetch_opt, mesh=mesh, axis=axis)
    return state, evicted_rows, evicted_opt


def apply_sparse(
    state: CacheState,
    lookup: Lookup,
    grads: jax.Array,
    optimizer: SparseOptimizer,
    *,
    learning_rate_scale: Any = None,
) -> CacheState:
    """Applies ``optimizer`` to the rows ``lookup`` touched, on their owners.

    ``O(rows touched x D)`` work: gradients travel back to the devices that own
    the rows (``all_to_all``), are summed per row there, and the touched rows
    and their state are gathered, updated and scattered back; padding is
    dropped.

    Args:
      state: the cache.
      lookup: the batch's ``Lookup``.
      grads: ``[n, R, D]`` gradient of each row each device received (the
        gradient of the lookup's ``delta``).
      optimizer: the sparse optimizer.
      learning_rate_scale: multiplies its learning rate for this step (a
        number or a scalar array: a schedule's value); default: none.

    Returns:
      The updated state.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxcache
      >>> cfg = jaxcache.CacheConfig(10, 2, capacity=4, optimizer=jaxcache.sgd(0.5))
      >>> cache = jaxcache.EmbeddingCache(cfg, table=jaxcache.HostTable(
      ...     cfg, rows=np.zeros((10, 2), np.float32)))
      >>> state, lookup = cache.prepare(cache.init_state(), np.array([3, 3]))
      >>> grads = jnp.ones((1, lookup.received, 2))
      >>> state = jaxcache.device.apply_sparse(state, lookup, grads, cfg.optimizer)
      >>> rows, _ = cache.export(state)
      >>> rows[3].tolist(), rows[4].tolist()
      ([-0.5, -0.5], [0.0, 0.0])
    """
    if not lookup.train and optimizer.trains:  # a read-only table's own update refuses
        raise ValueError(
            f"the Lookup of table {lookup.table!r} was prepared with train=False, so its rows "
            "are not written back when they leave the cache and this update would be lost; "
            "prepare (or prefetch) the batches you train on with train=True."
        )
    lookup.check_fresh()
    expected = (lookup.requests.shape[0], lookup.received, state.rows.shape[-1])
    if tuple(jnp.shape(grads)) != expected:
        raise ValueError(
            f"grads for table {lookup.table!r} have shape {tuple(jnp.shape(grads))}, but its "
            f"lookup's rows take [devices, received, features] = {expected}: the gradient "
            "of the lookup's delta, which value_and_grad(..., apply_rows=False) returns "
            "per table."
        )
    if learning_rate_scale is not None:
        optimizer = optimizer.scaled(learning_rate_scale)
    spec = PartitionSpec(lookup.axis)
    k = lookup.requests.shape[2]

    def body(rows, opt, grads, owner_slots, owner_inverse):
        return routed_apply(
            rows,
            opt,
            grads,
            owner_slots,
            owner_inverse,
            per_destination=k,
            optimizer=optimizer,
            axis=lookup.axis,
        )

    rows, opt = jax.shard_map(
        body,
        mesh=lookup.mesh,
        in_specs=(spec, spec, spec, spec, spec),
        out_specs=(spec, spec),
        check_vma=False,
    )(state.rows, state.opt, grads, lookup.owner_slots, lookup.owner_inverse)
    return CacheState(rows, opt)


def embed(
    rows: jax.Array,
    lookup: Lookup,
    *,
    table: str,
    combiner: str | None = None,
    weights: jax.Array | None = None,
    cache_id: int = 0,
) -> jax.Array:
    """The body of a cached embedding module's call: check, gather, pool.

    Args:
      rows: ``[C, D]`` cached rows of ``table``.
      lookup: the batch's ``Lookup``; it must be for ``table``.
      table: name of the table the module serves.
      combiner: ``None`` (a row per id), ``"sum"`` or ``"mean"`` over the last id axis.
      weights: optional per-id weights of the ids' shape (pooled modes only);
        another shape raises a ``ValueError``.

    Returns:
      ``[*ids.shape, D]``, or ``[*ids.shape[:-1], D]`` with a combiner.

    Examples:
      >>> import numpy as np, jaxcache
      >>> cfg = jaxcache.CacheConfig(10, 2, capacity=4, padding_id=-1, name="t")
      >>> rows = np.arange(20.0, dtype=np.float32).reshape(10, 2)
      >>> cache = jaxcache.EmbeddingCache(cfg, table=jaxcache.HostTable(cfg, rows=rows))
      >>> state, lookup = cache.prepare(cache.init_state(), np.array([[7, 2, -1]]))
      >>> jaxcache.device.embed(state.rows, lookup, table="t", combiner="sum").tolist()
      [[18.0, 20.0]]
    """
    if lookup.table != table:
        raise ValueError(
            f"lookup is for table {lookup.table!r} but this module serves {table!r}; "
            "prepare ids with the cache of the module that looks them up."
        )
    check_cache(lookup, cache_id)
    lookup.check_fresh()
    if combiner is None and weights is not None:
        raise ValueError(
            "weights need a combiner ('sum' or 'mean'); build the module with "
            "combiner='sum' or 'mean' to pool weighted bags, or pass no weights."
        )
    check_bags(combiner, lookup.inverse.shape)
    check_weights(weights, lookup)
    return _gather_and_pool(rows, lookup, combiner, weights)


def is_donated(array: Any) -> bool:
    """``array`` is a concrete JAX array a donating call has consumed (a
    traced one, or NumPy, never is)."""
    return (
        isinstance(array, jax.Array)
        and not isinstance(array, jax.core.Tracer)
        and array.is_deleted()
    )


def check_cache(lookup: Lookup, cache_id: int) -> None:
    """Refuses a ``lookup`` that another cache made (``cache_id`` ``0``, or
    the lookup's: not known). Two caches of one table name share every
    static part of a lookup but their slots: each slot holds another id's row.

    Raises:
      ValueError: naming the table and the fix.
    """
    if cache_id and lookup.cache_id and lookup.cache_id != cache_id:
        raise ValueError(
            f"this Lookup of table {lookup.table!r} was made by another EmbeddingCache "
            f"(cache {lookup.cache_id}) than the one this module serves (cache {cache_id}); "
            "its slots hold other rows here. Prepare the ids with this module's cache "
            "(module.prepare, or prefetch with this module), or give the two tables "
            "different CacheConfig names."
        )


def check_bags(combiner: str | None, shape: tuple[int, ...]) -> None:
    """Refuses ids of ``shape`` for a ``combiner`` that pools their last axis
    when they have none to pool (fewer than two axes): the whole batch would
    pool into one row.

    Raises:
      ValueError: naming the combiner, the shape and the fix.
    """
    if combiner is not None and len(shape) < 2:
        raise ValueError(
            f"combiner={combiner!r} pools the last axis of bags [B, L], but the ids have "
            f"shape {tuple(shape)}, so the whole batch would become one row; "
            "reshape the ids to [B, L] (e.g. ids[:, None] for one id per bag) or use "
            "combiner=None."
        )


def check_weights(weights: jax.Array | None, lookup: Lookup) -> None:
    """Refuses per-id weights whose shape is not the ids' (``lookup.shape``),
    or that are not real numbers.

    Broadcast or read at the real ids' positions, weights of another shape
    would pool silently with the wrong weights; complex ones would lose
    their imaginary part in the cast to the rows' dtype.

    Raises:
      ValueError: naming both shapes, or the dtype.
    """
    if weights is None:
        return
    dtype = weights.dtype if hasattr(weights, "dtype") else jnp.asarray(weights).dtype
    if not any(jnp.issubdtype(dtype, kind) for kind in (jnp.floating, jnp.integer, jnp.bool_)):
        raise ValueError(
            f"weights have dtype {dtype}; pass real weights (float32, or the rows' dtype)."
        )
    if tuple(jnp.shape(weights)) != lookup.shape:
        raise ValueError(
            f"weights have shape {tuple(jnp.shape(weights))} but the ids have shape "
            f"{lookup.shape}; pass one weight per id (any value at padding positions)."
        )


@functools.partial(jax.jit, static_argnames="combiner")
def _gather_and_pool(
    rows: jax.Array, lookup: Lookup, combiner: str | None, weights: jax.Array | None
) -> jax.Array:
    # One program when called outside a jitted step (``model.init``, a first
    # eager call): op by op, the routed gather and pooling compile ~50 times.
    if combiner is not None and lookup.positions is not None:
        return _pool_real(rows, lookup, combiner, weights)
    embeddings = lookup_rows(rows, lookup)
    return embeddings if combiner is None else pool(embeddings, lookup, combiner, weights)


def _pool_real(
    rows: jax.Array, lookup: Lookup, combiner: str, weights: jax.Array | None
) -> jax.Array:
    """``pool(lookup_rows(rows, lookup), ...)`` from the real ids alone.

    Each device gathers the rows of the ``P`` real positions of its share
    (``lookup.positions``) and sums them into their bags (``segment_sum``,
    positions in order); padding is never read, and the backward pass
    scatters ``P`` gradients, not one per position of the bags.
    """
    check_combiner(combiner, pooled=True)
    spec = PartitionSpec(lookup.axis)
    axis = lookup.axis
    received = lookup.received
    bag = lookup.shape[-1]

    deltas = int(lookup.delta is not None)  # the optional arguments: delta, then weights

    def body(rows, requests, overflow, inverse, positions, *rest):
        got = _received(rows, requests, overflow, axis, *rest[:deltas])
        w = rest[deltas] if weights is not None else None
        at = positions[0]  # [P]; padding: the share's length
        real = inverse.reshape(-1).at[at].get(mode="fill", fill_value=received)
        # The padding of ``at`` reads zeros and falls in the bag that
        # ``segment_sum`` drops, so no mask multiplies the rows: with one, XLA
        # fuses gather and product into a loop that redoes the index chain for
        # every element of a row (the pooled lookup's forward and backward
        # took 1.2-1.4x as long).
        embeddings = got.at[real].get(mode="fill", fill_value=0)
        dtype, acc = rows.dtype, got.dtype  # float32 at least (``_received``)
        scale = None
        if w is not None:
            scale = w.reshape(-1).at[at].get(mode="fill", fill_value=0).astype(acc)
            embeddings = embeddings * scale[:, None]
        bags = inverse.size // bag
        segment = at // bag  # padding falls in bag ``bags``: dropped

        def per_bag(values):
            return jax.ops.segment_sum(values, segment, num_segments=bags, indices_are_sorted=True)

        total = per_bag(embeddings)
        if combiner == "mean":  # a bag's (weighted) number of real ids
            count = per_bag(jnp.ones(at.shape, acc) if scale is None else scale)
            count = count[:, None]
            total = total / jnp.where(count == 0, 1, count)
        return total.astype(dtype).reshape(*inverse.shape[:-1], total.shape[-1])

    args = [rows, lookup.requests, lookup.overflow, lookup.inverse, lookup.positions]
    specs = [spec, spec, PartitionSpec(), spec, spec]
    for extra in (lookup.delta, weights):
        if extra is not None:
            args.append(extra)
            specs.append(spec)
    return jax.shard_map(
        body, mesh=lookup.mesh, in_specs=tuple(specs), out_specs=spec, check_vma=False
    )(*args)
