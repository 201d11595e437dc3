"""The host planner's route of a batch: which device serves which row to whom.

The cache's ``C`` slots are split row-wise over the ``n`` devices of a mesh
axis: slot ``s`` lives on device ``s // C_l`` at local slot ``s % C_l``
(``C_l = C / n``), and an id's row only ever sits on its home device
(``jaxcache._src.partitions``). The batch is split over the same axis (data
parallel): device ``d`` looks up the ids of rows ``[d B/n, (d+1) B/n)``.

A route is the host arrays the device exchange (``device_ops.routed_gather``
and ``routed_apply``) reads: for each owner, the ``K`` local slots it
serves each source (``requests``: the distinct ids the source sends it, in
order of appearance); rows a source needs beyond ``K`` from one owner, on a
short overflow list every device reads (never dropped, never truncated);
and where each gradient adds on its owner. They are built here per owner
and per source in parallel, from the partitions' plans; the device only
moves data. (The device planner builds the same arrays in its program.)
Every number a route gives a row (its place in a received buffer, among an
owner's rows, in the overflow list) follows the order in which the batch's
ids first appear (a plan numbers its rows so), never the slots, so the
device's sums of a row's gradients take the same order at any capacity.

Shape letters: ``n`` devices, ``K`` rows per (source, destination) pair,
``O`` overflow rows, ``R = n K + O`` rows each device receives, ``V`` distinct
rows an owner serves, ``C_l`` slots per device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

import numpy as np

from jaxcache._src import kernels
from jaxcache._src.partitions import StepPlan
from jaxcache._src.placement import Layout
from jaxcache._src.threads import HostThreads

__all__ = [
    "HostRoute",
    "build_route",
    "overflow_slots",
]


class HostRoute(NamedTuple):
    """Host arrays that route one batch (see the module docstring): this
    process's blocks (all of them in one process).

    Attributes:
      requests: ``int32 [L, n, K]``: ``[e, s, k]`` is the local slot owner
        ``e`` serves source ``s`` at ``k``; padding ``C_l``.
      overflow: ``int32 [O]`` global slots of the overflow path; padding ``C``.
      inverse: ``int32`` of the shape of this process's rows of the ids:
        each id's row in its device's received buffer ``[R]``; padding ``R``.
      owner_slots: ``int32 [L, V]`` distinct local slots each owner updates;
        padding ``C_l``.
      owner_inverse: ``int32 [L, R]``: for owner ``e``, the row of
        ``owner_slots[e]`` each received gradient adds to; ``V`` drops it.
      overflowed: rows that took the overflow path (statistics).
      positions: ``int32 [L, P]`` or ``None``: for batches of bags with
        padding, where the real ids are in each device's share of the
        (flattened) batch, padded with the share's length; pooling reads
        only these (the stager fills it in).
    """

    requests: np.ndarray
    overflow: np.ndarray
    inverse: np.ndarray
    owner_slots: np.ndarray
    owner_inverse: np.ndarray
    overflowed: int
    positions: np.ndarray | None = None


def overflow_slots(step: StepPlan, layout: Layout, local_capacity: int, k: int) -> np.ndarray:
    """Global slots of the rows that take the overflow path when ``K = k``,
    in order of first appearance (owner by owner, source by source, then by
    rank), so that their order, like every number of a route, depends on
    the batch's ids and not on the slots they have.

    Examples:
      >>> import numpy as np, jaxcache
      >>> from jaxcache._src.partitions import Partitions
      >>> from jaxcache._src.placement import Layout
      >>> parts = Partitions(jaxcache.CacheConfig(100, 2, capacity=8), Layout(devices=2))
      >>> step = parts.plan(np.array([[1, 3], [5, 7]]))  # every id homed on device 1
      >>> overflow_slots(step, Layout(devices=2), 4, 1).tolist()  # 2nd row of each source
      [5, 7]
    """
    found = []
    for device, unique_slots, first, bounds, sent in _owners(step, layout, local_capacity):
        rows = [first[b + k : b + m] for b, m in zip(bounds[:-1], sent, strict=True) if m > k]
        if rows:
            found.append(device * local_capacity + unique_slots[np.concatenate(rows)])
    if not found:
        return np.zeros(0, np.int64)
    every = np.concatenate(found).astype(np.int64)
    _, firsts = np.unique(every, return_index=True)  # a row two sources overflow: once
    return every[np.sort(firsts)]


def _positions_in(overflow: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """Where global slots are in the ``overflow`` list (each is there)."""
    sorter = np.argsort(overflow)
    ordered = overflow[sorter]
    return lambda slots: sorter[np.searchsorted(ordered, slots)].astype(np.int32)


def _owners(step: StepPlan, layout: Layout, local_capacity: int):
    """``_owner`` of each own device, in order."""
    for row in range(len(layout.own)):
        yield _owner(step, layout, local_capacity, row)


def _owner(
    step: StepPlan, layout: Layout, local_capacity: int, row: int
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(device, unique_slots, first, bounds, sent)`` of own device ``row``:
    its distinct rows' local slots, and for source ``s``'s rank ``k`` the
    row at ``first[bounds[s] + k]`` (``sent[s]`` ranks). With one partition
    the plan's distinct rows are its ranks (one source), already in order
    of first appearance; a device of several partitions numbers its rows
    and each source's ranks partition after partition."""
    device = layout.own[row]
    if step.bounds is None:
        plan = step.plans[0]
        first = np.arange(plan.distinct, dtype=np.int32)
        bounds = np.array([0, plan.distinct])
        return device, plan.unique_slots, first, bounds, step.sent[0]
    q = layout.split
    if q == 1:
        plan = step.plans[row]
        return device, plan.unique_slots, plan.inverse, step.bounds[row], step.sent[row]
    width = local_capacity // q
    parts = range(row * q, (row + 1) * q)
    plans = [step.plans[t] for t in parts]
    rows = np.cumsum([0] + [plan.distinct for plan in plans])
    unique = np.concatenate([plan.unique_slots + j * width for j, plan in enumerate(plans)])
    sent = step.sent[parts.start : parts.stop].sum(0)
    bounds = np.zeros(sent.size + 1, np.int64)
    np.cumsum(sent, out=bounds[1:])
    ranked = np.concatenate(
        [
            step.plans[t].inverse[b[s] : b[s] + m[s]] + rows[j]
            for s in range(sent.size)
            for j, t in enumerate(parts)
            for b, m in ((step.bounds[t], step.sent[t]),)
        ]
    )
    return device, unique.astype(np.int32), ranked.astype(np.int32), bounds, sent


def _rank_base(step: StepPlan, layout: Layout, k: int) -> np.ndarray:
    """``int64 [L, n q]``: for each own source and residue ``i % (n q)``,
    what a rank of the source's ids of that residue adds to become the row
    of its device's received buffer: ``K`` times the home device, and with
    several partitions per device, the ranks the source's ids of the
    device's partitions before this one took."""
    homes = layout.part_homes
    q = layout.split
    if q == 1:
        return np.repeat((homes * k)[None], len(layout.own), axis=0)
    counts = np.zeros((len(layout.own), layout.parts), np.int64)  # [own source, partition]
    if step.sent_out is not None:
        counts += step.sent_out
    counts[:, layout.own_parts.start : layout.own_parts.stop] = step.sent[:, layout.own].T
    grouped = counts.reshape(len(layout.own), layout.devices, q)
    before = (np.cumsum(grouped, axis=2) - grouped).reshape(counts.shape)
    return (homes // q) * k + before[:, homes]


def build_route(
    step: StepPlan,
    flat: np.ndarray,
    *,
    layout: Layout,
    local_capacity: int,
    per_destination: int,
    overflow: np.ndarray,
    overflow_size: int,
    owner_size: int,
    pad: int,
    threads: HostThreads,
    before: Sequence[Callable[[], None]] = (),
    after: Sequence[Callable[[], None]] = (),
) -> HostRoute:
    """The padded route of a planned batch.

    Args:
      step: the plan.
      flat: the batch's ids, flattened.
      layout: the homes of ids.
      local_capacity: ``C_l``.
      per_destination: ``K``; rows beyond it take the overflow path.
      overflow: the rows that do (``overflow_slots``).
      overflow_size: ``O``, padded length of the overflow list.
      owner_size: ``V``, padded distinct rows per owner.
      pad: the padding id (a value no id takes when there is none).
      threads: the host threads; owners and sources are filled in parallel.
      before, after: other pieces of the step (the moves and the gathers of
        its rows), run first and last in the same map as the route's, so
        the threads start once for all.

    Returns:
      The ``HostRoute``.

    Examples:
      >>> import numpy as np, jaxcache
      >>> from jaxcache._src.partitions import Partitions
      >>> from jaxcache._src.placement import Layout
      >>> from jaxcache._src.threads import HostThreads
      >>> # 2 devices, 4 slots each; device 0 looks up ids 1 and 4, device 1 id 1 twice.
      >>> cfg = jaxcache.CacheConfig(100, 2, capacity=8)
      >>> layout = Layout(devices=2)
      >>> ids = np.array([[1, 4], [1, 1]])
      >>> step = Partitions(cfg, layout).plan(ids)
      >>> r = build_route(step, ids.reshape(-1), layout=layout, local_capacity=4,
      ...                 per_destination=1, overflow=np.zeros(0, np.int64), overflow_size=0,
      ...                 owner_size=1, pad=-1, threads=HostThreads(1))
      >>> r.requests.tolist()  # [owner][source][k]: local slots
      [[[0], [4]], [[0], [0]]]
      >>> r.inverse.tolist()  # rows of each device's received buffer [owner 0, owner 1]
      [[1, 0], [1, 1]]
      >>> r.owner_slots.tolist(), r.owner_inverse.tolist()
      ([[0], [0]], [[0, 1], [0, 0]])
    """
    n, cl, k = layout.devices, local_capacity, per_destination
    own = len(layout.own)
    received = n * k + overflow_size
    # Filled, padding and all, by each owner's piece (``kernels.owner_route``).
    requests = np.empty((own, n, k), np.int32)
    owner_slots = np.empty((own, owner_size), np.int32)
    owner_inverse = np.empty((own, received), np.int32)
    position = _positions_in(overflow)
    owners = range(own)

    def fill_owner(e: int) -> None:
        device, unique_slots, first, bounds, sent = _owner(step, layout, cl, e)
        kernels.owner_route(
            unique_slots, first, bounds, sent, k, cl, owner_slots[e], requests[e], owner_inverse[e]
        )
        if overflow.size:
            parts = [first[b + k : b + m] for b, m in zip(bounds[:-1], sent, strict=True) if m > k]
            if parts:
                rows = np.concatenate(parts)
                owner_inverse[e, n * k + position(device * cl + unique_slots[rows])] = rows

    split = step.split
    if split is None:  # one device: the plan's rows, -1 for padding
        _run(threads, [*before, *(partial(fill_owner, o) for o in owners), *after])
        out_inverse = kernels.fill_negative(
            np.ascontiguousarray(step.plans[0].inverse, dtype=np.int32).reshape(-1), received
        )
        if overflow.size:
            late = out_inverse >= k
            late &= out_inverse < received
            slots = step.plans[0].unique_slots[out_inverse[late]]
            out_inverse[late] = n * k + position(slots)
    else:
        out_inverse = np.empty(flat.size, np.int32)
        base = _rank_base(step, layout, k)  # by own source and residue
        c, first_own = split.per_source, layout.own[0]

        def fill_source(chunk: int) -> None:
            kernels.fill_inverse(
                split.at,
                split.ranks,
                split.begin[chunk],
                split.end[chunk],
                base[chunk // c - first_own],
                out_inverse,
                *split.span(chunk),
                received,  # padding's row: past the rows received
            )

        chunks = range(first_own * c, (layout.own[-1] + 1) * c)
        sources = [partial(fill_source, chunk) for chunk in chunks]
        _run(threads, [*before, *sources, *(partial(fill_owner, o) for o in owners), *after])
        if overflow.size:  # one process (see EmbeddingCache): every source is here
            for device, unique_slots, first, bounds, _ in _owners(step, layout, cl):
                for t in range(device * layout.split, (device + 1) * layout.split):
                    residue = layout.part_residue(t)
                    lo, hi = split.chunks(residue)
                    for chunk in range(lo.size):
                        source = chunk // split.per_source
                        ranks = split.ranks[lo[chunk] : hi[chunk]]
                        ranks = ranks + (base[source, residue] - device * k)
                        late = ranks >= k
                        rows = first[bounds[source] + ranks[late]]
                        slots = device * cl + unique_slots[rows]
                        at = split.at[lo[chunk] : hi[chunk]][late]
                        out_inverse[at] = n * k + position(slots)
    full_overflow = np.full(overflow_size, n * cl, np.int32)
    full_overflow[: overflow.size] = overflow
    share = flat.size // n  # the entries of this process's sources
    mine = out_inverse[layout.own[0] * share : (layout.own[-1] + 1) * share]
    rows = step.shape[0] // n * (layout.own[-1] + 1 - layout.own[0])  # known when bags are empty
    return HostRoute(
        requests,
        full_overflow,
        mine.reshape(rows, *step.shape[1:]),
        owner_slots,
        owner_inverse,
        0 if not overflow.size else _overflowed(step, layout, k),
    )


def _overflowed(step: StepPlan, layout: Layout, k: int) -> int:
    """Rows (per source and owner) that take the overflow path at ``K = k``."""
    return int(np.maximum(layout.per_device(step.sent) - k, 0).sum())


def _run(threads: HostThreads, pieces: Sequence[Callable[[], None]]) -> None:
    """Runs ``pieces`` (calls without arguments) as one map of ``threads``."""
    threads.map(lambda piece: piece(), pieces)
