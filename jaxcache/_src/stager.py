"""The host half of a step: a batch planned, routed, padded and gathered.

``Stager.stage`` plans a batch over this process's partitions, routes it,
pads every per-step list to a bucket size (so compiled shapes repeat), and
copies the rows it fetches (with their optimizer state) out of the host
table into fresh buffers, one block per device; the gathers run per
partition on the host threads. It touches the planners, the host table and
fresh arrays only, never the device state, so it can run on a pipeline's
background thread while the device trains.

Shape letters: ``n`` devices, ``L`` devices of this process, ``P`` padded
rows moved per device, ``C_l`` slots per device.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple, Protocol, cast

import numpy as np

from jaxcache._src import kernels, routing, validation
from jaxcache._src.config import CacheConfig
from jaxcache._src.host_table import HostTable
from jaxcache._src.partitions import Partitions, StepPlan
from jaxcache._src.placement import Layout
from jaxcache._src.planner import _NO_PAD
from jaxcache._src.raw_ids import RawIds
from jaxcache._src.stats import CacheStats, StepStats
from jaxcache._src.threads import HostThreads
from jaxcache._src.write_back import WriteBacks


class Planners(Protocol):
    """What a stager reads of either planner (``Partitions`` plans here; a
    ``DevicePlanner`` plans on the devices)."""

    layout: Layout
    local_capacity: int


__all__ = ["Deferred", "HostStaged", "Stager", "bucket_size", "fresh_buffers"]


def bucket_size(n: int, minimum: int, previous: int = 0) -> int:
    """Padded size for a list of ``n`` rows: a power of two ``>= minimum``.

    With ``previous`` (the last size used) the size only shrinks once ``n``
    falls to a quarter of it, so a count that hovers around a power of two
    does not flip between two compiled shapes.

    Examples:
      >>> from jaxcache.device import bucket_size
      >>> bucket_size(200, 64), bucket_size(200, 64, previous=512), bucket_size(200, 64, 1024)
      (256, 512, 256)
    """
    size = max(minimum, 1 << max(0, int(n) - 1).bit_length())
    if size < previous and n > previous // 4:
        return previous
    return size


# A step's moves for this process's devices: (evict_slots, fetch_slots, fetch_rows, fetch_opt).
Moves = tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]


class Deferred(NamedTuple):
    """Rows a batch fetches whose latest values an earlier plan's write-back
    holds, not landed in the host table when the batch was staged.

    Attributes:
      ids: the rows' ids.
      at: each row's position in the batch's fetch rows.
      plans: the plan whose eviction read each row out last.
      read_out: each row's position in that plan's read-out (this process's
        blocks of the swap's evicted rows).
    """

    ids: np.ndarray
    at: np.ndarray
    plans: np.ndarray
    read_out: np.ndarray


class HostStaged(NamedTuple):
    """A batch planned and gathered on the host, padded, not yet transferred.

    Attributes:
      plan: the ``StepPlan``.
      ids: the ids it was planned for.
      moves: ``(evict_slots, fetch_slots, fetch_rows, fetch_opt)`` or
        ``None``: for each of this process's devices, ``P`` local slots
        (padding ``C_l``) and rows, blocks one after another (``[L P]``).
      route: which rows each owner serves each device.
      deferred: the ``Deferred`` fetched rows whose write-back from an
        earlier plan had not landed when this one was staged: they are
        copied from that plan's read-out (its swap has been applied by then)
        into the fetch rows before the transfer. ``None`` when there are none.
      train: the batch updates its rows (its ``Lookup`` says so).

    Examples:
      >>> import numpy as np, jaxcache
      >>> cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, capacity=8))
      >>> state = cache.init_state()
      >>> host = cache.stage_host(np.array([3, 5, 3]))  # on any thread
      >>> host.plan.index, int((host.moves[1] < 8).sum())  # plan 0 fetches 2 rows
      (0, 2)
      >>> staged = cache.to_device(host)  # on the training thread
      >>> state = cache.apply(state, staged)
      >>> staged.lookup.shape
      (3,)
    """

    plan: StepPlan
    ids: np.ndarray
    moves: Moves | None
    route: routing.HostRoute
    deferred: Deferred | None = None
    train: bool = True


class _Sizes(NamedTuple):
    """Padded sizes of one step's lists."""

    per_destination: int  # K
    owner: int  # V
    overflow: int  # O
    moves: int  # P rows moved per device; 0 when no row moves
    bags: int  # real ids per device of a batch of bags; 0: not skipped


class Stager:
    """Plans, routes, pads and gathers batches for one cache.

    Args:
      config: the table's configuration.
      partitions: the planners of this process's partitions (a device
        planner's cache uses only the stager's checks and sizes).
      table: the host table.
      ledger: the write-back ledger.
      stats: the statistics to record each batch in.
      threads: the host threads.
      raw: the raw ids of a dynamic vocabulary, translated to rows before
        each plan (``raw_ids``), or ``None``.
    """

    def __init__(
        self,
        config: CacheConfig,
        partitions: Planners,
        table: HostTable,
        ledger: WriteBacks,
        stats: CacheStats,
        threads: HostThreads,
        raw: RawIds | None = None,
    ) -> None:
        self.config = config
        self.raw = raw
        self.partitions = partitions
        self.layout = partitions.layout
        self.table = table
        self.ledger = ledger
        self.stats = stats
        self.threads = threads
        self.local_capacity = partitions.local_capacity
        self.lock = threading.Lock()  # one planner user at a time
        self.fetch_bucket = 0  # P
        self.route_buckets = (0, 0, 0)  # K, V, O in use
        self.bag_bucket = 0  # real ids per device in a batch of bags
        # The residue of each own partition's ids (``_blocks``).
        self.residues = np.array(
            [self.layout.part_residue(t) for t in self.layout.own_parts], np.int64
        )

    @property
    def _minimum(self) -> int:
        return max(1, self.config.min_bucket // self.layout.devices)

    def stage(
        self,
        ids: np.ndarray,
        *,
        train: bool = True,
        size: int | None = None,
        released: int | None = None,
        defer: bool = False,
    ) -> HostStaged:
        """Plans, routes and gathers one batch (see ``EmbeddingCache.stage_host``)."""
        train = bool(train) and self.config.optimizer.trains  # as ``EmbeddingCache.dispatch``
        timers = self.stats.timers
        assert isinstance(self.partitions, Partitions), "the host planner stages on the host"
        partitions = self.partitions
        try:
            ids = validation.id_array(ids, "ids")
            self.check_batch(ids.shape)
        except ValueError:
            partitions.refuse_unchecked()
            raise
        with self.lock:
            with timers.time("plan"):
                vocabulary: dict[str, int] = {}
                if self.raw is None:
                    rows = ids
                    step = partitions.plan(ids, train=train, released=released, max_distinct=size)
                else:  # raw ids: translated to rows first
                    step, rows, vocabulary = self.raw.plan(
                        partitions,
                        ids,
                        self.table,
                        self.ledger,
                        train=train,
                        released=released,
                        max_distinct=size,
                    )
                sizes = self._sizes(step, rows, size)
            # One map for the route and the moves: the ledger's part and the
            # buffers on one thread while the others fill the route, then
            # the evictions and each block's gather, on any thread.
            job = _MovesJob(self, step, defer, sizes.moves) if sizes.moves else None
            before, after = ((job.prepare,), job.pieces()) if job else ((), [])
            start = time.perf_counter()
            route = self._route(step, rows, sizes, before, after)
            timers.add("gather", time.perf_counter() - start - (job.write_back if job else 0.0))
            moves, deferred = (job.moves, job.deferred) if job else (None, None)
            self.stats.record(
                StepStats(
                    lookups=step.total("lookups"),
                    distinct=step.distinct,
                    hits=step.total("hits"),
                    misses=step.misses,
                    access_hits=step.total("access_hits"),
                    evictions=step.total("evictions"),
                    rows_to_device=step.misses,
                    rows_to_host=step.rows_to_host,
                    overflow=route.overflowed,
                    **vocabulary,
                )
            )
            return HostStaged(step, ids, moves, route, deferred, train)

    def state_dict(self) -> dict[str, Any]:
        """The padded sizes in use (they fix the compiled shapes), for a checkpoint."""
        route = list(self.route_buckets)
        return {"fetch": self.fetch_bucket, "route": route, "bag": self.bag_bucket}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Takes over the padded sizes of a ``state_dict``; a route of another
        length (saved by another version) leaves the route's sizes as they are.

        Raises:
          ValueError: ``state`` is incomplete or corrupt (nothing changed).
        """
        fetch, route, bag = self.parse_state_dict(state)
        self.fetch_bucket = fetch
        if len(route) == len(self.route_buckets):
            self.route_buckets = cast(tuple[int, int, int], route)
        self.bag_bucket = self.bag_bucket if bag is None else bag

    @staticmethod
    def parse_state_dict(state: Any) -> tuple[int, tuple[int, ...], int | None]:
        """``(fetch, route, bag)`` of a ``state_dict`` read back from JSON.

        Raises:
          ValueError: ``state`` is incomplete or corrupt.
        """
        try:
            fetch = int(state["fetch"])
            route = tuple(int(size) for size in state["route"])
            bag = None if state.get("bag") is None else int(state["bag"])
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"saved padded sizes are incomplete or corrupt: {error!r}.") from None
        if min(fetch, *route, 1 if bag is None else bag) < 0:
            raise ValueError(f"saved padded sizes are corrupt: {dict(state)!r} holds a negative.")
        return fetch, route, bag

    def check_batch(self, shape: tuple[int, ...]) -> None:
        """Refuses ids whose batch (leading) axis does not split over the devices."""
        n = self.layout.devices
        if len(shape) and shape[0] % n:
            raise ValueError(
                f"ids of shape {tuple(shape)} do not split over the {n} devices of the mesh "
                f"axis; the batch size (leading axis) must be a multiple of {n}."
            )

    # ----------------------------------------------------------------- sizes
    def _sizes(self, step: StepPlan, ids: np.ndarray, size: int | None) -> _Sizes:
        """The padded sizes of a step: from buckets (with every process's
        needs, which they agree on), or the fixed ``size`` of the
        host-callback form (no overflow possible, no bags skipped). A
        partition evicts at most as many rows as it fetches (its victims
        are its misses' slots), so the fetches size the moves."""
        # Several processes: every one's needs, agreed at the plan.
        needs = step.needs if step.needs is not None else step.own_needs(self.layout)
        k_need, v_need, moved, real = needs.tolist()
        minimum = self._minimum
        if moved:
            self.fetch_bucket = bucket_size(moved, minimum, self.fetch_bucket)
        moves = self.fetch_bucket if moved else 0
        if size is not None:
            k = self.callback_per_destination(size, ids.size)
            return _Sizes(k, size, 0, moves, 0)
        k_prev, v_prev, o_prev = self.route_buckets
        if self.config.route_capacity is not None:
            k = self.config.route_capacity
        else:
            k = bucket_size(k_need, minimum, k_prev)
        v = bucket_size(v_need, minimum, v_prev)
        overflowing = 0
        if k_need > k:  # one process (see EmbeddingCache): it sees every route
            overflowing = routing.overflow_slots(step, self.layout, self.local_capacity, k).size
        o = bucket_size(overflowing, 8, o_prev) if overflowing or o_prev else 0
        self.route_buckets = (k, v, o)
        bags = 0
        share = ids.size // self.layout.devices
        if self.config.padding_id is not None and ids.ndim >= 2 and share:
            self.bag_bucket = bucket_size(real, minimum, self.bag_bucket)
            # Never past the share (as the device planner's): an empty batch
            # has no positions to read.
            bags = min(self.bag_bucket, share)
        return _Sizes(k, v, o, moves, bags)

    # ----------------------------------------------------------------- route
    def _route(
        self,
        step: StepPlan,
        ids: np.ndarray,
        sizes: _Sizes,
        before: Sequence[Callable[[], None]] = (),
        after: Sequence[Callable[[], None]] = (),
    ) -> routing.HostRoute:
        """Routes ``step`` over the devices, padded to ``sizes``; the pieces
        ``before`` and ``after`` run in the same map as the route's, first
        and last (one start of the threads)."""
        cl, k = self.local_capacity, sizes.per_destination
        overflow = np.zeros(0, np.int64)
        if sizes.overflow:
            overflow = routing.overflow_slots(step, self.layout, cl, k)
        pad = _NO_PAD if self.config.padding_id is None else self.config.padding_id
        route = routing.build_route(
            step,
            kernels.as_index_array(ids),
            layout=self.layout,
            local_capacity=cl,
            per_destination=k,
            overflow=overflow,
            overflow_size=sizes.overflow,
            owner_size=sizes.owner,
            pad=pad,
            threads=self.threads,
            before=before,
            after=after,
        )
        if not sizes.bags:
            return route
        return route._replace(positions=self._real_positions(route, sizes.bags))

    def callback_per_destination(self, size: int, num_ids: int) -> int:
        """``K`` of a route padded to ``size`` rows, for a batch of ``num_ids``
        ids: a device needs no more rows from one owner than the batch's
        distinct ids or its own ids, so nothing overflows."""
        return min(size, num_ids // self.layout.devices)

    def _real_positions(self, route: routing.HostRoute, size: int) -> np.ndarray:
        """``[L, P]`` positions of the real ids in each of this process's
        devices' share of a batch of bags (``HostRoute.positions``)."""
        own = len(self.layout.own)
        flat = route.inverse.reshape(own, -1)
        limit = route.owner_inverse.shape[1]  # R: padding
        positions = np.empty((own, size), np.int32)
        self.threads.map(lambda d: kernels.real_positions(flat[d], limit, positions[d]), range(own))
        return positions


class _MovesJob:
    """This process's blocks of a step's swap, made as pieces of the route's map.

    ``prepare`` (one piece, first) lands the write-backs the fetches need (or
    defers the rows that wait for one) and makes the buffers; it is the only
    piece the others wait for, so it does no more. ``pieces`` (run last)
    are ``evictions``, which queues the step's own evictions' write-back and
    fills the blocks' evicted slots, and one gather per partition with rows
    to fetch, which fills its block's fetched slots and copies its rows and
    their optimizer state out of the host table; each waits for ``prepare``
    first (a thread with nothing else left to take). Then ``moves`` are
    ``(evict_slots, fetch_slots, fetch_rows, fetch_opt)`` and ``deferred``
    the fetches deferred to the transfer (``None`` when there are none).
    """

    def __init__(self, stager: Stager, step: StepPlan, defer: bool, size: int) -> None:
        self.stager, self.step, self.defer, self.size = stager, step, defer, size
        self.moves: Moves | None = None
        self.deferred: Deferred | None = None
        self.write_back = 0.0  # seconds spent landing write-backs
        self._ready = threading.Event()

    def prepare(self) -> None:
        try:
            self._prepare()
        finally:  # on an error the other pieces do nothing; the map raises it
            self._ready.set()

    def _prepare(self) -> None:
        stager, step, size = self.stager, self.step, self.size
        ledger, cl, layout = stager.ledger, stager.local_capacity, stager.layout
        self._fetch = wanted, at, bounds = _blocks(step, "fetch_ids", size, stager.residues, layout)
        # Per partition: None, all gathered now.
        self._home: list[np.ndarray | None] = [None] * len(step.plans)
        start = time.perf_counter()
        if self.defer:
            ledger.land_ready()
            plans, read_out = ledger.pending(wanted)
            late = plans >= 0
            if late.any():
                self.deferred = Deferred(wanted[late], at[late], plans[late], read_out[late])
                stager.stats.deferred_fetches += int(late.sum())
                self._home = list(np.split(~late, bounds[1:-1]))
        else:
            ledger.land_for(wanted)
        self.write_back = time.perf_counter() - start
        stager.stats.timers.add("write_back", self.write_back)
        # Fresh buffers (the device may alias them); the pieces fill the slots.
        total = len(layout.own) * size
        evict_slots = np.full(total, cl, np.int32)
        fetch_slots = np.full(total, cl, np.int32)
        self.moves = (evict_slots, fetch_slots, *fresh_buffers(stager.table, total))

    def pieces(self) -> list[Callable[[], None]]:
        """``evictions``, then one gather per partition with rows to fetch."""
        gathers = [
            partial(self._gather, b) for b, plan in enumerate(self.step.plans) if plan.misses
        ]
        return [self._evictions, *gathers]

    def _evictions(self) -> None:
        self._ready.wait()
        if self.moves is None:  # ``prepare`` failed
            return
        stager, step = self.stager, self.step
        layout, cl = stager.layout, stager.local_capacity
        evicted, evicted_at, _ = _blocks(step, "evict_ids", self.size, stager.residues, layout)
        if evicted.size:  # after landing (``prepare``): a plan never fetches what it evicts
            stager.ledger.register(step.index, evicted, evicted_at)
            self.moves[0][evicted_at] = _device_slots(step, "evict_slots", layout, cl)

    def _gather(self, part: int) -> None:
        self._ready.wait()
        if self.moves is None:  # ``prepare`` failed
            return
        wanted, at, bounds = self._fetch
        lo, hi, keep = bounds[part], bounds[part + 1], self._home[part]
        ids, places = wanted[lo:hi], at[lo:hi]
        _, fetch_slots, rows, opt = self.moves
        start = int(places[0])  # a block's places are a run (``_blocks``)
        layout = self.stager.layout
        fetch_slots[start : start + places.size] = _part_slots(
            self.step, "fetch_slots", part, layout, self.stager.local_capacity
        )
        if keep is not None:  # NumPy calls here only where some rows wait
            if not keep.any():
                return
            ids, places = ids[keep], places[keep]
        self.stager.table.gather_into(ids, rows, opt, places)


def fresh_buffers(table: HostTable, size: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Zeroed staging rows ``[size, D]`` and optimizer state of ``table``'s
    dtypes. Fresh for every batch, never reused: a device copy may alias a
    NumPy buffer (``device_put`` on the CPU backend), so a buffer must not
    change until the step that read it has finished."""
    rows = np.zeros((size, *table.rows.shape[1:]), table.rows.dtype)
    return rows, {k: np.zeros((size, *v.shape[1:]), v.dtype) for k, v in table.state.items()}


def _blocks(
    step: StepPlan, field: str, size: int, residues: np.ndarray, layout: Layout
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ids, at, bounds)`` of every own partition's ``field`` (``fetch_ids``
    or ``evict_ids``, in local ids): the ids, one partition after another;
    each id's place in blocks of ``size`` rows, one block per device (its
    partitions' ids one after another); where each partition's ids begin
    and end (``[L q + 1]``). ``residues``: each partition's residue modulo
    ``n q``. Two NumPy calls and one compiled pass, whatever the number of
    partitions."""
    local = [getattr(plan, field) for plan in step.plans]
    bounds = np.zeros(len(local) + 1, np.int64)
    np.cumsum([ids.size for ids in local], out=bounds[1:])
    q = layout.split
    device = np.arange(len(local)) // q
    starts = device * size - bounds[device * q]  # a device's first partition starts its block
    flat = np.concatenate(local).astype(np.int64, copy=False)
    ids, at = np.empty_like(flat), np.empty_like(flat)
    kernels.block_ids(flat, bounds, residues, layout.parts, starts, ids, at)
    return ids, at, bounds


def _device_slots(step: StepPlan, field: str, layout: Layout, local_capacity: int) -> np.ndarray:
    """Every own partition's ``field`` (``fetch_slots`` or ``evict_slots``),
    one after another, as local slots of its device (``_part_slots``)."""
    if layout.split == 1:
        return np.concatenate([getattr(plan, field) for plan in step.plans])
    parts = range(len(step.plans))
    return np.concatenate([_part_slots(step, field, t, layout, local_capacity) for t in parts])


def _part_slots(
    step: StepPlan, field: str, part: int, layout: Layout, local_capacity: int
) -> np.ndarray:
    """Own partition ``part``'s ``field`` as local slots of its device
    (partition ``j`` of a device has its ``j``-th ``C_l / q`` slots)."""
    slots = getattr(step.plans[part], field)
    q = layout.split
    return slots if q == 1 else slots + (part % q) * (local_capacity // q)
