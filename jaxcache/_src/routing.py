"""Routing a batch's rows between devices: the host plan and the device exchange.

The cache's ``C`` slots are split row-wise over the ``n`` devices of a mesh
axis: slot ``s`` lives on device ``s // C_l`` at local slot ``s % C_l``
(``C_l = C / n``). The batch is split over the same axis (data parallel):
device ``d`` looks up the ids of rows ``[d B/n, (d+1) B/n)``.

Forward, inside ``jax.shard_map``: every device sends the local slots it needs
to their owners with one ``all_to_all`` (a fixed ``K`` per destination), the
owners gather those rows and a second ``all_to_all`` brings them back. Rows a
device needs beyond ``K`` from one owner take the overflow path: a short list
shared by all devices, gathered by the owners and summed over the axis. Never
dropped, never truncated. Backward, the gradients travel the same way in
reverse, are summed per row on the owner and the sparse optimizer updates the
owner's rows.

Everything about *which* row goes *where* is computed on the host, in
vectorized NumPy, from the planner's slots; the device only moves data.

Shape letters: ``n`` devices, ``K`` rows per (source, destination) pair,
``O`` overflow rows, ``R = n K + O`` rows each device receives, ``V`` distinct
rows an owner serves, ``C_l`` slots per device.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcache._src import kernels
from jaxcache._src.optimizers import SparseOptimizer

__all__ = [
    "Demand",
    "HostRoute",
    "plan_route",
    "route_demand",
    "routed_apply",
    "routed_gather",
]


class HostRoute(NamedTuple):
    """Host arrays that route one batch (see the module docstring).

    Attributes:
      requests: ``int32 [n, n, K]``: ``[d, e, k]`` is the local slot device
        ``d`` needs from owner ``e``; padding ``C_l``.
      overflow: ``int32 [O]`` global slots of the overflow path; padding ``C``.
      inverse: ``int32`` of the ids' shape: each id's row in its device's
        received buffer ``[R]``; padding ``R``.
      owner_slots: ``int32 [n, V]`` distinct local slots each owner updates;
        padding ``C_l``.
      owner_inverse: ``int32 [n, R]``: for owner ``e``, the row of
        ``owner_slots[e]`` each received gradient adds to; ``V`` drops it.
      overflowed: rows that took the overflow path (statistics).
      positions: ``int32 [n, P]`` or ``None``: for batches of bags with
        padding, where the real ids are in each device's share of the
        (flattened) batch, padded with the share's length; pooling reads
        only these (``EmbeddingCache`` fills it in).
    """

    requests: np.ndarray
    overflow: np.ndarray
    inverse: np.ndarray
    owner_slots: np.ndarray
    owner_inverse: np.ndarray
    overflowed: int
    positions: np.ndarray | None = None


def _first_occurrence(keys: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct ``keys`` (values in ``[0, size)``) in order of appearance, and the
    index of each key among them. ``O(len(keys) + size)``."""
    positions = np.arange(keys.size, dtype=np.int64)
    first = np.empty(size, np.int64)
    first[keys[::-1]] = positions[::-1]
    distinct = keys[first[keys] == positions]
    rank = np.empty(size, np.int64)
    rank[distinct] = np.arange(distinct.size)
    return distinct, rank[keys]


def _pairs(
    unique_slots: np.ndarray, inverse: np.ndarray, devices: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct (device, row) pairs a batch needs: ``(pairs, pair of each
    real id, which ids are real)``; ``pair = device * U + row``."""
    u = unique_slots.size
    per_device = inverse.reshape(devices, -1)
    valid = per_device >= 0
    device_of = np.broadcast_to(np.arange(devices)[:, None], per_device.shape)
    pairs, pair_of_id = _first_occurrence((device_of * u + per_device)[valid], devices * u)
    return pairs, pair_of_id, valid


def _group_positions(groups: np.ndarray, num_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """For each item, its position within its group (stable), and the group sizes."""
    order = np.argsort(groups, kind="stable")
    counts = np.bincount(groups, minlength=num_groups)
    starts = np.cumsum(counts) - counts
    position = np.empty(groups.size, np.int64)
    position[order] = np.arange(groups.size) - starts[groups[order]]
    return position, counts


def plan_route(
    unique_slots: np.ndarray,
    inverse: np.ndarray,
    *,
    devices: int,
    local_capacity: int,
    per_destination: int,
    overflow_size: int,
    owner_size: int,
    demand: Demand | None = None,
) -> HostRoute:
    """Routes a planned batch over ``devices`` devices.

    Args:
      unique_slots: ``[U]`` distinct global slots of the batch (from the plan).
      inverse: each id's index into ``unique_slots``, ``-1`` for padding; the
        leading axis is split evenly over the devices.
      devices: ``n``.
      local_capacity: ``C_l``.
      per_destination: ``K``; rows beyond it take the overflow path.
      overflow_size: ``O``, padded length of the overflow list (at least
        ``Demand.overflow_count``).
      owner_size: ``V``, padded distinct rows per owner.
      demand: the batch's ``route_demand``, when the sizes were chosen from it.

    Returns:
      The ``HostRoute``.

    Examples:
      >>> import numpy as np
      >>> from jaxcache._src.routing import plan_route
      >>> # 2 devices, 4 slots each; device 0 looks up slots 1 and 6, device 1 slot 6.
      >>> r = plan_route(np.array([1, 6]), np.array([[0, 1], [1, 1]]), devices=2,
      ...                local_capacity=4, per_destination=2, overflow_size=0, owner_size=1)
      >>> r.requests.tolist()  # [source][owner][k]: local slots
      [[[1, 4], [2, 4]], [[4, 4], [2, 4]]]
      >>> r.inverse.tolist()  # rows of each device's received buffer [owner 0 x2, owner 1 x2]
      [[0, 2], [2, 2]]
      >>> r.owner_slots.tolist(), r.owner_inverse.tolist()
      ([[1], [2]], [[0, 1, 1, 1], [0, 1, 0, 1]])
    """
    n, cl = devices, local_capacity
    k_size, o_size, v_size = per_destination, overflow_size, owner_size
    received = n * k_size + o_size
    u = unique_slots.size
    if n == 1 and u <= min(k_size, v_size):
        return _one_device(unique_slots, inverse, cl, k_size, o_size, v_size)
    # Distinct (device, row) pairs: what each device must receive.
    d = demand
    if d is None:
        d = route_demand(unique_slots, inverse, devices=n, local_capacity=cl)
    src, dst, slot, k = d.src, d.dst, d.slot, d.position
    direct = k < k_size

    requests = np.full((n, n, k_size), cl, np.int32)
    requests[src[direct], dst[direct], k[direct]] = slot[direct] % cl
    overflow_slots = np.unique(slot[~direct])
    if overflow_slots.size > o_size:
        raise ValueError(
            f"{overflow_slots.size} rows overflow but the overflow list holds {o_size}; "
            "size it with Demand.overflow_count."
        )
    overflow = np.full(o_size, n * cl, np.int32)
    overflow[: overflow_slots.size] = overflow_slots
    buffer_row = np.where(
        direct, dst * k_size + k, n * k_size + np.searchsorted(overflow_slots, slot)
    )
    out_inverse = np.full(d.valid.shape, received, np.int32)
    out_inverse[d.valid] = buffer_row[d.pair_of_id]

    # Each distinct row has one owner; its index among that owner's rows.
    owner, owner_rank = d.owner, d.owner_rank
    owner_slots = np.full((n, v_size), cl, np.int32)
    owner_slots[owner, owner_rank] = unique_slots % cl
    owner_inverse = np.full((n, received), v_size, np.int32)
    owner_inverse[dst[direct], src[direct] * k_size + k[direct]] = owner_rank[d.row[direct]]
    if overflow_slots.size:
        by_slot = np.argsort(unique_slots)
        ov_rows = by_slot[np.searchsorted(unique_slots, overflow_slots, sorter=by_slot)]
        owner_inverse[owner[ov_rows], n * k_size + np.arange(overflow_slots.size)] = owner_rank[
            ov_rows
        ]
    return HostRoute(
        requests,
        overflow,
        out_inverse.reshape(inverse.shape),
        owner_slots,
        owner_inverse,
        int((~direct).sum()),
    )


def _one_device(
    unique_slots: np.ndarray, inverse: np.ndarray, cl: int, k: int, o: int, v: int
) -> HostRoute:
    """``plan_route`` for one device with room for every row: the received rows
    are the distinct rows in order, and each is its own owner row."""
    u = unique_slots.size
    received = k + o
    requests = np.full((1, 1, k), cl, np.int32)
    requests[0, 0, :u] = unique_slots
    owner_slots = np.full((1, v), cl, np.int32)
    owner_slots[0, :u] = unique_slots
    owner_inverse = np.full((1, received), v, np.int32)
    owner_inverse[0, :u] = np.arange(u, dtype=np.int32)
    # One compiled pass: np.where over a mostly-padding batch cost 0.2-0.6 ms.
    flat = np.ascontiguousarray(inverse, dtype=np.int32).reshape(-1)
    out_inverse = kernels.fill_negative(flat, received).reshape(inverse.shape)
    overflow = np.full(o, cl, np.int32)
    return HostRoute(requests, overflow, out_inverse, owner_slots, owner_inverse, 0)


class Demand(NamedTuple):
    """What a planned batch needs from each owner: computed once per batch by
    ``route_demand``, then shared by the sizing (``needs``, ``overflow_count``) and
    ``plan_route``.

    A *pair* is a distinct (device, row of ``unique_slots``) the batch needs.

    Attributes:
      pair_of_id: for each real id (in ``valid`` order), its pair.
      valid: ``bool [n, B/n ...]``: which ids are real (not padding).
      src: ``[P]`` device that needs each pair.
      row: ``[P]`` its row of ``unique_slots``.
      slot: ``int64 [P]`` its global slot.
      dst: ``[P]`` the owner of that slot.
      position: ``[P]`` its position among the pairs of the same
        (``src``, ``dst``): pairs at ``K`` or beyond overflow.
      per_pair: ``[n * n]`` pairs per (``src``, ``dst``).
      owner: ``[U]`` the owner of each row of ``unique_slots``.
      owner_rank: ``[U]`` its index among that owner's rows.
      per_owner: ``[n]`` distinct rows per owner.
    """

    pair_of_id: np.ndarray
    valid: np.ndarray
    src: np.ndarray
    row: np.ndarray
    slot: np.ndarray
    dst: np.ndarray
    position: np.ndarray
    per_pair: np.ndarray
    owner: np.ndarray
    owner_rank: np.ndarray
    per_owner: np.ndarray

    def needs(self) -> tuple[int, int]:
        """The most rows one device takes from one owner (the ``K`` without
        overflow), and the most distinct rows one owner serves (``V``).

        Examples:
          >>> import numpy as np
          >>> from jaxcache._src.routing import route_demand
          >>> route_demand(np.array([1, 6, 7]), np.array([[0, 1, 2], [1, 1, -1]]),
          ...              devices=2, local_capacity=4).needs()
          (2, 2)
        """
        return int(self.per_pair.max(initial=0)), int(self.per_owner.max(initial=0))

    def overflow_count(self, k: int) -> int:
        """Distinct rows that take the overflow path when ``K = k``."""
        return int(np.unique(self.slot[self.position >= k]).size)


def route_demand(
    unique_slots: np.ndarray, inverse: np.ndarray, *, devices: int, local_capacity: int
) -> Demand:
    """The ``Demand`` of a planned batch over ``devices`` devices (arguments as
    for ``plan_route``)."""
    n, cl = devices, local_capacity
    u = unique_slots.size
    pairs, pair_of_id, valid = _pairs(unique_slots, inverse, n)
    src, row = pairs // max(u, 1), pairs % max(u, 1)
    slot = unique_slots[row].astype(np.int64)
    dst = slot // cl
    position, per_pair = _group_positions(src * n + dst, n * n)
    owner = (unique_slots // cl).astype(np.int64)
    owner_rank, per_owner = _group_positions(owner, n)
    return Demand(
        pair_of_id, valid, src, row, slot, dst, position, per_pair, owner, owner_rank, per_owner
    )


def routed_gather(
    rows: jax.Array, requests: jax.Array, overflow: jax.Array, axis: str
) -> jax.Array:
    """Inside ``shard_map``: this device's received rows ``[R, D]``.

    Args:
      rows: this device's ``[C_l, D]`` cached rows.
      requests: ``[1, n, K]`` local slots this device needs from each owner.
      overflow: ``[O]`` global slots of the overflow path (same on all devices).
      axis: the mesh axis the rows and the batch are split over.
    """
    cl = rows.shape[0]
    asked = jax.lax.all_to_all(requests[0], axis, 0, 0, tiled=True)  # [n, K] from each source
    served = rows.at[asked].get(mode="fill", fill_value=0)  # [n, K, D]
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
