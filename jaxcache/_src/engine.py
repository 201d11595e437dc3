"""The cache engine: host table + planner + statistics, driving the device state.

``EmbeddingCache`` holds everything that lives on the host. The device half,
a ``CacheState``, is passed in and returned, so the same engine serves an NNX
module (which keeps the state in variables), a Linen module (in a variable
collection) or a hand-written training loop.

One step, unpipelined::

    state, lookup = cache.prepare(state, ids)   # host: plan, gather, transfer; device: swap
    state, ... = train_step(state, lookup, ...)  # device: lookup + sparse update
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxcache._src import device_ops, kernels, routing
from jaxcache._src.config import CacheConfig
from jaxcache._src.device_ops import CacheState, Lookup
from jaxcache._src.frequency import hottest
from jaxcache._src.host_table import HostTable, take_rows
from jaxcache._src.placement import process_shard
from jaxcache._src.planner import Plan, Planner
from jaxcache._src.stats import CacheStats, StepStats

__all__ = ["Deferred", "EmbeddingCache", "HostStaged", "Staged", "bucket_size"]


class Deferred(NamedTuple):
    """Rows a batch fetches whose latest values an earlier plan's write-back
    holds, not landed in the host table when the batch was staged.

    Attributes:
      ids: the rows' ids (sorted).
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
      plan: the host plan.
      ids: the ids it was planned for.
      moves: ``(evict_slots, fetch_slots, fetch_rows, fetch_opt)`` or
        ``None``: for each of this process's devices, ``P`` local slots
        (padding ``C_l``) and rows, blocks one after another (``[L P]``).
      route: which rows each device fetches from which owner.
      deferred: the ``Deferred`` fetched rows whose write-back from an
        earlier plan had not landed when this one was staged: ``to_device``
        copies them from that plan's read-out (its swap has been applied by
        then) into the fetch rows; in the host-callback form the step's
        stage callback reads them from the host table (the earlier steps'
        write-back callbacks have run by then). ``None`` when there are none.
    """

    plan: Plan
    ids: np.ndarray
    moves: tuple[Any, ...] | None
    route: routing.HostRoute
    deferred: Deferred | None = None


class Staged(NamedTuple):
    """A batch planned and transferred, waiting for its swap.

    Attributes:
      plan: the host plan.
      moves: device ``(evict_slots, fetch_slots, fetch_rows, fetch_opt)`` for
        ``swap``, or ``None`` when no row moves.
      lookup: the batch's device ``Lookup``.

    On a single CPU device the arrays stay NumPy arrays (fresh ones, never
    written again): the jitted programs take them without ``device_put``.

    Examples:
      >>> import numpy as np, jaxcache
      >>> cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, capacity=8))
      >>> state = cache.init_state()
      >>> staged = cache.stage(np.array([1, 2, 3]))  # host side, any thread
      >>> state = cache.apply(state, staged)  # device side, in plan order
      >>> staged.plan.misses, staged.lookup.shape
      (3, (3,))
    """

    plan: Plan
    moves: tuple[Any, ...] | None
    lookup: Lookup


def bucket_size(n: int, minimum: int, previous: int = 0) -> int:
    """Padded size for a list of ``n`` rows: a power of two ``>= minimum``.

    With ``previous`` (the last size used) the size only shrinks once ``n``
    falls to a quarter of it, so a count that hovers around a power of two
    does not flip between two compiled shapes.

    Examples:
      >>> from jaxcache import bucket_size
      >>> bucket_size(200, 64), bucket_size(200, 64, previous=512), bucket_size(200, 64, 1024)
      (256, 512, 256)
    """
    size = max(minimum, 1 << max(0, int(n) - 1).bit_length())
    if size < previous and n > previous // 4:
        return previous
    return size


class EmbeddingCache:
    """A host-offloaded embedding table with a device cache of hot rows.

    Args:
      config: the table's static configuration.
      table: the host table (default: a new one initialised with ``seed``).
      frequencies: ``int [N]`` dataset access counts: the priority of the
        ``"frequency"`` policy, the prior of ``"adaptive"``, the seed of
        ``"lfu"``, and the rows to warm.
      warm: preload the hottest rows (by ``frequencies``) before the first
        step; defaults to ``True`` for the ``"frequency"`` policy, and for
        ``"adaptive"`` when ``frequencies`` are given.
      seed: seed of a new host table.
      mesh: device mesh the rows are sharded over (default: one device).
        When its devices belong to several processes (under
        ``jax.distributed.initialize``), every process runs the same program
        on the same global batches; each stores the host rows of its ids
        (``process_shard``) and moves rows only for its own devices.
      axis: mesh axis of the rows.

    Attributes:
      config: the configuration.
      table: the ``HostTable`` (id order; this process's share of it when
        the mesh spans several processes).
      planner: the ``Planner`` (directory and policy).
      stats: the ``CacheStats``.
      shard: ``(index, count)``: which share of the host rows this process
        stores (``process_shard``); ``(0, 1)`` in one process.

    Examples:
      >>> import numpy as np, jaxcache
      >>> cfg = jaxcache.CacheConfig(num_embeddings=100, features=4, capacity=10)
      >>> cache = jaxcache.EmbeddingCache(cfg)
      >>> state = cache.init_state()
      >>> state, lookup = cache.prepare(state, np.array([[3, 5], [5, 7]]))
      >>> jaxcache.lookup_rows(state.rows, lookup).shape
      (2, 2, 4)
      >>> cache.stats.last.misses, cache.stats.last.lookups
      (3, 4)
    """

    def __init__(
        self,
        config: CacheConfig,
        *,
        table: HostTable | None = None,
        frequencies: np.ndarray | None = None,
        warm: bool | None = None,
        seed: int = 0,
        mesh: Mesh | None = None,
        axis: str = "rows",
    ) -> None:
        if table is not None and table.config.num_embeddings != config.num_embeddings:
            raise ValueError(
                f"table has {table.config.num_embeddings} rows but config.num_embeddings is "
                f"{config.num_embeddings}; build the HostTable from the same config."
            )
        if mesh is None:
            mesh = Mesh(np.array(jax.devices()[:1]), (axis,))
        if axis not in mesh.shape:
            names = " or ".join(f"axis={name!r}" for name in mesh.axis_names)
            raise ValueError(
                f"axis={axis!r} is not an axis of the mesh {dict(mesh.shape)}; pass {names}, "
                "the mesh axis to split the rows over."
            )
        devices = mesh.shape[axis]
        self.shard = process_shard(mesh, axis)
        shard, groups = self.shard
        if table is not None and table.shard != self.shard:
            raise ValueError(
                f"the host table holds shard {table.shard} of the ids but this process stores "
                f"shard {self.shard} of a mesh over {groups} process(es); build it with "
                "HostTable(config, shard=jaxcache.process_shard(mesh, axis))."
            )
        if config.capacity % devices:
            rounded = -(-config.capacity // devices) * devices
            if rounded > config.num_embeddings:
                raise ValueError(
                    f"capacity={config.capacity} does not split over {devices} devices and "
                    f"rounding it up exceeds the table; use a multiple of {devices}."
                )
            config = dataclasses.replace(config, capacity=rounded)
        self.config = config
        self.table = table if table is not None else HostTable(config, seed=seed, shard=self.shard)
        self.planner = Planner(config, frequencies=frequencies, devices=devices, groups=groups)
        self.stats = CacheStats(config.row_bytes)
        self.mesh = mesh
        self.axis = axis
        self.devices = devices
        self.local_capacity = config.capacity // devices
        # The device blocks whose rows this process stores and moves.
        self._blocks = devices // groups
        self._first = shard * self._blocks
        self.row_sharding = NamedSharding(mesh, PartitionSpec(axis))
        self.replicated = NamedSharding(mesh, PartitionSpec())
        # On one CPU device a batch's host arrays are already where the device
        # reads them: the jitted programs take them as they are (JAX's C++
        # dispatch), where jax.device_put would spend Python time on each
        # array, on the thread the training loop needs.
        self._host_is_device = mesh.size == 1 and mesh.devices.flat[0].platform == "cpu"
        # Write-backs: evicted ids by plan index, from planning until landed,
        # and the device rows read out by each applied swap.
        self._write_back_lock = threading.Condition()
        self._unlanded: dict[int, np.ndarray] = {}
        self._dispatched: dict[int, tuple[jax.Array, dict[str, jax.Array]]] = {}
        self._landing: set[int] = set()  # plans a thread is writing back now
        # The host-callback form: batches staged ahead, and one planner user at a time.
        self._offers: collections.deque[HostStaged] = collections.deque()
        self._offer_lock = threading.Lock()
        self._plan_lock = threading.Lock()
        self._fetch_bucket = 0
        self._route_buckets = (0, 0, 0)  # K, V, O in use
        self._bag_bucket = 0  # P: real ids per device in a batch of bags
        self._applied = -1  # index of the last plan whose rows reached the device
        if warm is None:
            warm = self.planner.policy.warms
        if warm:
            if frequencies is None:
                raise ValueError("warm=True needs frequencies= to know the hottest rows.")
            # With several groups, rank more ids: the hottest C may not split evenly.
            ranked = config.capacity if groups == 1 else 2 * config.capacity
            self.planner.warm(hottest(frequencies, min(ranked, config.num_embeddings)))

    @classmethod
    def full_table(cls, config: CacheConfig, **kwargs) -> EmbeddingCache:
        """The whole table on device (capacity ``N``, slot ``i`` holds id ``i``).

        The baseline a cache is measured and checked against: the same lookups
        and sparse optimizer, with no rows ever moving after the start.

        Examples:
          >>> import jaxcache
          >>> cfg = jaxcache.CacheConfig(num_embeddings=50, features=4, capacity=5)
          >>> full = jaxcache.EmbeddingCache.full_table(cfg)
          >>> full.config.capacity, int(full.planner.slot_of_id[7])
          (50, 7)
        """
        config = dataclasses.replace(config, capacity=config.num_embeddings, policy="lru")
        kwargs.pop("frequencies", None)
        cache = cls(config, warm=False, **kwargs)
        cache.planner.warm(np.arange(config.num_embeddings))
        return cache

    @property
    def name(self) -> str:
        """The table's name (``config.name``)."""
        return self.config.name

    # ----------------------------------------------------------------- state
    def init_state(self) -> CacheState:
        """Device state holding the host rows of every resident id.

        Call it at the start (or after ``flush``): resident rows are copied
        from the host table, free slots hold zeros.
        """
        planner = self.planner
        stale = planner.dirty & (planner.last_use <= planner.released)
        if stale.any() or self._unlanded or self._applied < planner.next_index - 1:
            raise RuntimeError(
                "the cache has rows changed on device; call flush(state) before building a "
                "new device state from the host table."
            )
        cfg = self.config
        first, cl = self._first * self.local_capacity, self._blocks * self.local_capacity
        ids = self.planner.id_of_slot[first : first + cl]
        slots = np.flatnonzero(ids >= 0)
        rows, opt = self.table.gather(ids[slots])
        host_rows = np.zeros((cl, cfg.features), cfg.row_dtype)
        host_rows[slots] = rows
        host_opt = {}
        for name, spec in cfg.optimizer.state_spec(cfg.features).items():
            array = np.full((cl, *spec.shape), spec.init, spec.dtype)
            array[slots] = opt[name]
            host_opt[name] = array
        return self._put(CacheState(host_rows, host_opt), self.row_sharding)

    def _put(self, tree: Any, sharding: NamedSharding) -> Any:
        """Device arrays of ``sharding`` from this process's part of each
        (its blocks ``[L X, ...]`` of a row-split ``[n X, ...]``; all of a
        replicated array)."""
        if self.shard[1] == 1:  # every block is here: one batched transfer
            return jax.device_put(tree, sharding)
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), tree)

    def _local_blocks(
        self, slots: np.ndarray, size: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | slice]:
        """This process's ``[L size]`` blocks of sorted global ``slots``.

        Returns:
          ``(blocks, at, mine)``: the blocks, as local slots padded with
          ``C_l``; ``mine`` selects the slots of this process's devices (a
          mask, or all of them on one device) and ``at`` is each one's
          position in the blocks (block, then rank within its device).
        """
        cl, first = self.local_capacity, self._first
        if self.devices == 1:  # the slots are the block, in order
            blocks = np.full(size, cl, np.int32)
            blocks[: slots.size] = slots
            return blocks, np.arange(slots.size), slice(None)
        device = slots // cl
        start = np.searchsorted(device, np.arange(self.devices))
        rank = np.arange(slots.size) - start[device]
        mine = (device >= first) & (device < first + self._blocks)
        at = (device[mine] - first) * size + rank[mine]
        blocks = np.full(self._blocks * size, cl, np.int32)
        blocks[at] = slots[mine] % cl
        return blocks, at, mine

    def _write_back(self, ids: np.ndarray, at: np.ndarray, rows: jax.Array, opt: dict) -> None:
        """Writes the rows at ``at`` of this process's blocks of a read-out to ``ids``."""
        opt = {k: _local_data(v) for k, v in opt.items()}
        self.table.scatter(ids, _local_data(rows), opt, at=at)

    def _per_device_size(self, *slot_lists: np.ndarray, previous: int = 0) -> int:
        """Padded rows per device for lists of global slots (the largest device's)."""
        n = self.devices
        if n == 1:
            most = max(s.size for s in slot_lists)
        else:
            most = max(
                int(np.bincount(s // self.local_capacity, minlength=n).max()) for s in slot_lists
            )
        return bucket_size(most, max(1, self.config.min_bucket // n), previous)

    # ------------------------------------------------------------------ step
    def prepare(self, state: CacheState, ids: np.ndarray, *, train: bool = True):
        """Makes the rows of ``ids`` resident and maps the ids to slots.

        Plans the batch, copies its missing rows (and optimizer state) to the
        device, swaps them into the victims' slots (the old state is donated)
        and queues the dirty victims' write-back. The unpipelined step: every
        earlier batch counts as finished. ``jaxcache.prefetch`` runs ``stage``
        ahead on a thread and ``apply`` in the training loop instead.

        Args:
          state: the device state (donated: do not use it afterwards).
          ids: integer ids ``[B, ...]``.
          train: the step will update these rows.

        Returns:
          ``(state, lookup)``: the new device state and the ``Lookup``.
        """
        self.planner.release(self.planner.next_index - 1)
        staged = self.stage(ids, train=train)
        return self.apply(state, staged), staged.lookup

    def stage(self, ids: np.ndarray, *, train: bool = True) -> Staged:
        """Host half of a step: plan, land needed write-backs, gather, transfer.

        Safe to run on a background thread while the device trains: it touches
        the planner and the host table, never the device state. The staging
        buffers are fresh arrays, never reused, so a device copy that aliases
        them (``device_put`` on CPU may) can never see them change.

        Args:
          ids: integer ids ``[B, ...]``.
          train: the step will update these rows.

        Returns:
          The ``Staged`` batch, to pass to ``apply`` in plan order.
        """
        return self.to_device(self.stage_host(ids, train=train, defer=True))

    def to_device(self, host: HostStaged) -> Staged:
        """Starts the transfer of a host-staged batch (``device_put``, asynchronous;
        on a single CPU device the arrays are handed over as they are).

        Call it after every earlier plan was applied (``apply``): rows it
        fetches that an earlier plan evicted are read from that plan's
        read-out, or from the host table once it landed
        (``HostStaged.deferred``).
        """
        if host.deferred is not None:
            self._fetch_deferred(host)
        with self.stats.timers.time("transfer"):
            moves = None if host.moves is None else self._transfer(host.moves, self.row_sharding)
            lookup = self._device_lookup(host.route)
        return Staged(host.plan, moves, lookup)

    def _transfer(self, tree: Any, sharding: NamedSharding) -> Any:
        """A staged batch's arrays for the device: ``_put``, or on one CPU
        device the fresh NumPy arrays themselves."""
        return tree if self._host_is_device else self._put(tree, sharding)

    def _device_lookup(self, route: routing.HostRoute) -> Lookup:
        first, last = self._first, self._first + self._blocks
        per = route.inverse.shape[0] // self.devices  # batch rows per device
        requests, inverse, owner_slots, owner_inverse = self._transfer(
            (
                route.requests[first:last],
                route.inverse[first * per : last * per],
                route.owner_slots[first:last],
                route.owner_inverse[first:last],
            ),
            self.row_sharding,
        )
        overflow = self._transfer(route.overflow, self.replicated)
        positions = None
        if route.positions is not None:
            positions = self._transfer(route.positions[first:last], self.row_sharding)
        return Lookup(
            requests,
            overflow,
            inverse,
            owner_slots,
            owner_inverse,
            positions=positions,
            table=self.name,
            mesh=self.mesh,
            axis=self.axis,
        )

    def empty_lookup(self, shape: tuple[int, ...]) -> Lookup:
        """A ``Lookup`` of padding ids only, of the ids' ``shape``.

        For building a model before the first batch (``model.init``); it
        touches no cache state and looks up zero rows.

        Examples:
          >>> import jaxcache
          >>> cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, capacity=8))
          >>> lookup = cache.empty_lookup((2, 3))
          >>> jaxcache.lookup_rows(cache.init_state().rows, lookup).shape
          (2, 3, 4)
        """
        self._check_batch(shape)
        ids = np.zeros((0,), np.int32)
        route = routing.plan_route(
            ids,
            np.full(shape, -1, np.int32),
            devices=self.devices,
            local_capacity=self.local_capacity,
            per_destination=1,
            overflow_size=0,
            owner_size=1,
        )
        return self._device_lookup(route)

    def _check_batch(self, shape: tuple[int, ...]) -> None:
        if len(shape) and shape[0] % self.devices:
            raise ValueError(
                f"ids of shape {tuple(shape)} do not split over the {self.devices} devices of "
                f"axis {self.axis!r}; the batch size (leading axis) must be a multiple of "
                f"{self.devices}."
            )

    def stage_host(
        self,
        ids: np.ndarray,
        *,
        train: bool = True,
        size: int | None = None,
        released: int | None = None,
        defer: bool = False,
    ):
        """``stage`` without the transfer: the padded host arrays of a step.

        Args:
          ids: integer ids ``[B, ...]``.
          train: the step will update these rows.
          size: pad every per-step list to exactly this many rows (the
            host-callback form needs one fixed shape, ``callback_size``); a
            batch with more distinct ids is refused. Default: buckets.
          released: plan as if only plans up to this index were finished
            (see ``Planner.plan``).
          defer: a row to fetch whose write-back from an earlier plan has
            not landed is left for ``to_device`` (or the host-callback form's
            stage callback) to read, once that plan's swap ran, instead of
            waiting here for it.

        Returns:
          A ``HostStaged``.
        """
        timers = self.stats.timers
        self._check_batch(np.shape(ids))
        with timers.time("plan"):
            with self._plan_lock:
                plan = self.planner.plan(ids, train=train, released=released, max_distinct=size)
            route = self._route(plan, size)
        moves = deferred = None
        if plan.misses or len(plan.evict_ids):
            moves, deferred = self._moves(plan, defer)
        self.stats.record(
            StepStats(
                lookups=plan.lookups,
                distinct=plan.distinct,
                hits=plan.hits,
                misses=plan.misses,
                access_hits=plan.access_hits,
                evictions=plan.evictions,
                rows_to_device=plan.misses,
                rows_to_host=len(plan.evict_ids),
                overflow=route.overflowed,
            )
        )
        return HostStaged(plan, np.asarray(ids), moves, route, deferred)

    def _moves(self, plan: Plan, defer: bool) -> tuple[tuple[Any, ...], Any]:
        """This process's blocks of ``plan``'s swap and the fetches deferred
        to ``to_device``; lands the write-backs it needs first (or defers the
        rows that wait for one) and queues its own evictions' write-back."""
        timers = self.stats.timers
        size = self._fetch_bucket = self._per_device_size(
            plan.evict_slots, plan.fetch_slots, previous=self._fetch_bucket
        )
        evict_slots, evict_at, evict_mine = self._local_blocks(plan.evict_slots, size)
        fetch_slots, fetch_at, fetch_mine = self._local_blocks(plan.fetch_slots, size)
        fetch_ids = plan.fetch_ids[fetch_mine]  # sorted: one home group's run
        deferred = None
        with timers.time("write_back"):
            if defer:
                self._land(fetch_ids[:0])  # those ready
                plans, read_out = self._pending(fetch_ids)
                late = plans >= 0
                if late.any():
                    deferred = Deferred(
                        fetch_ids[late], fetch_at[late], plans[late], read_out[late]
                    )
                    self.stats.deferred_fetches += int(late.sum())
                    fetch_ids, fetch_at = fetch_ids[~late], fetch_at[~late]
            else:
                self._land(fetch_ids)
        if evict_at.size:  # after landing: a plan never fetches what it evicts
            with self._write_back_lock:
                self._unlanded[plan.index] = (plan.evict_ids[evict_mine], evict_at)
        with timers.time("gather"):  # into fresh buffers: the device may alias them
            table, total = self.table, self._blocks * size
            rows = np.zeros((total, *table.rows.shape[1:]), table.rows.dtype)
            opt = {k: np.zeros((total, *v.shape[1:]), v.dtype) for k, v in table.state.items()}
            table.gather_into(fetch_ids, rows, opt, fetch_at)
        return (evict_slots, fetch_slots, rows, opt), deferred

    def _pending(self, ids: np.ndarray, before: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Which of distinct ``ids`` an unlanded write-back holds (only those of
        plans with an index below ``before``, when given).

        Returns:
          ``(plans, read_out)``: for each id, the last plan that evicted it
          (``-1``: none) and the row's position in that plan's read-out.
        """
        plans = np.full(ids.shape, -1, np.int64)
        read_out = np.zeros(ids.shape, np.int64)
        with self._write_back_lock:  # a snapshot: the entries never change
            unlanded = sorted(self._unlanded.items())
        if before is not None:
            unlanded = [(index, entry) for index, entry in unlanded if index < before]
        if not unlanded or ids.size == 0:
            return plans, read_out
        wanted = kernels.IdIndex(ids)
        for index, (evicted, at) in unlanded:  # later evictions overwrite
            which, where = wanted.find(evicted)
            plans[where], read_out[where] = index, at[which]
        return plans, read_out

    def _fetch_deferred(self, host: HostStaged) -> None:
        """Copies the deferred rows of ``host`` into its fetch rows: from the
        read-out of the plan that evicted each (dispatched, since every
        earlier plan was applied), or from the host table if it landed."""
        ids, at, plans, read_out = host.deferred
        timers = self.stats.timers
        with self._write_back_lock:
            sources = {p: self._dispatched.get(p) for p in sorted(set(plans.tolist()))}
            unapplied = [p for p, s in sources.items() if s is None and p in self._unlanded]
        if unapplied:
            raise RuntimeError(
                f"batch {host.plan.index} fetches rows that plans {unapplied} evicted, but "
                "those plans were not applied yet; apply staged batches in plan order."
            )
        read_outs = [rows for rows, _ in filter(None, sources.values())]
        if read_outs:
            with timers.time("device_wait"):  # the evicting swaps may still be queued
                for rows in read_outs:  # their state comes out of the same program
                    rows.block_until_ready()
        with timers.time("gather"):
            for plan, source in sources.items():
                mine = plans == plan
                if source is None:  # landed meanwhile: the host table has them
                    self.table.gather_into(ids[mine], *host.moves[2:], at[mine])
                else:
                    _copy_read_out(host, at[mine], *source, read_out[mine])

    def _route(self, plan: Plan, size: int | None) -> routing.HostRoute:
        """Routes ``plan`` over the devices, with padded sizes from buckets (or
        the fixed ``size`` of the host-callback form: no overflow possible)."""
        n, cl = self.devices, self.local_capacity
        need = None
        if size is not None:
            k, v, o = self.callback_per_destination(size, plan.inverse.size), size, 0
        else:
            if n == 1:  # one device needs every distinct row, from itself
                k_need = v_need = plan.distinct
            else:
                need = routing.route_demand(
                    plan.unique_slots, plan.inverse, devices=n, local_capacity=cl
                )
                k_need, v_need = need.needs()
            k_prev, v_prev, o_prev = self._route_buckets
            minimum = max(1, self.config.min_bucket // n)
            if self.config.route_capacity is not None:
                k = self.config.route_capacity
            else:
                k = bucket_size(k_need, minimum, k_prev)
            v = bucket_size(v_need, minimum, v_prev)
            overflowing = 0
            if k_need > k:
                if need is None:  # one device, with a route_capacity below its rows
                    need = routing.route_demand(
                        plan.unique_slots, plan.inverse, devices=n, local_capacity=cl
                    )
                overflowing = need.overflow_count(k)
            o = bucket_size(overflowing, 8, o_prev) if overflowing or o_prev else 0
            self._route_buckets = (k, v, o)
        route = routing.plan_route(
            plan.unique_slots,
            plan.inverse,
            devices=n,
            local_capacity=cl,
            per_destination=k,
            overflow_size=o,
            owner_size=v,
            demand=need,
        )
        if size is not None or self.config.padding_id is None or plan.inverse.ndim < 2:
            return route  # no padding to skip (or the callback form: its own sizes)
        return route._replace(positions=self._real_positions(plan.inverse))

    def _real_positions(self, inverse: np.ndarray) -> np.ndarray:
        """``[n, P]`` positions of the real ids in each device's share of a
        batch of bags (``HostRoute.positions``); ``P`` from buckets."""
        flat = np.ascontiguousarray(inverse, dtype=np.int32).reshape(-1)
        minimum = max(1, self.config.min_bucket // self.devices)
        size = max(self._bag_bucket, minimum)
        positions, most = kernels.real_positions(flat, self.devices, size)
        self._bag_bucket = bucket_size(most, minimum, self._bag_bucket)
        if self._bag_bucket != size:  # cut short, or the bucket shrinks
            positions, _ = kernels.real_positions(flat, self.devices, self._bag_bucket)
        return positions

    # ------------------------------------------------------- host callbacks
    def check_host_callback(self) -> None:
        """Refuses the host-callback form where the step can hang in it.

        On JAX's CPU backend with one core, XLA runs the step's callbacks on
        its only compute thread, and a callback reading a large argument that
        is not 64-byte aligned waits there for JAX's copy of it, which can
        then never complete: the step waits for the callback, the callback for
        the copy (runs at one core hung; none at two).

        Raises:
          RuntimeError: a CPU backend and fewer than two cores for this
            process.
        """
        if self.mesh.devices.flat[0].platform != "cpu":
            return
        if hasattr(os, "sched_getaffinity"):
            cores = len(os.sched_getaffinity(0))
        else:
            cores = os.cpu_count() or 1
        if cores < 2:
            raise RuntimeError(
                f"the host-callback form (CachedEmbed.lookup_ids) needs at least 2 CPU cores "
                f"on JAX's CPU backend, and this process may run on {cores}: with one core "
                "XLA runs the step's callbacks on its only compute thread, and a callback can "
                "wait there forever for JAX's copy of its arguments. "
                "Pass the step the Lookup that jaxcache.prefetch (without callback=True) or "
                "CachedEmbed.prepare makes, or let the process use two cores or more."
            )

    def callback_size(self, num_ids: int) -> int:
        """Rows per list of the host-callback form for a batch of ``num_ids``
        ids: ``CacheConfig.callback_rows``, or the number of ids."""
        rows = self.config.callback_rows
        return num_ids if rows is None else min(rows, num_ids)

    def callback_per_destination(self, size: int, num_ids: int) -> int:
        """``K`` of a route padded to ``size`` rows, for a batch of ``num_ids``
        ids: a device needs no more rows from one owner than the batch's
        distinct ids or its own ids, so nothing overflows."""
        return min(size, num_ids // self.devices)

    def offer(self, staged: HostStaged) -> None:
        """Queues a batch staged ahead for the host-callback form (in plan order)."""
        with self._offer_lock:
            self._offers.append(staged)

    def take_offers(self) -> list[HostStaged]:
        """Removes and returns the offered batches no step has consumed."""
        with self._offer_lock:
            offers = list(self._offers)
            self._offers.clear()
        return offers

    def callback_stage(self, ids: np.ndarray, *, train: bool = True):
        """Host side of ``CachedEmbed.lookup_ids``, run by ``io_callback`` in the step.

        Serves the batch a pipeline offered (it must be these ids), or plans
        it on the spot. Every list is padded to ``callback_size(ids.size)``
        rows so the callback has one fixed output shape.

        Returns:
          ``(plan index, requests, overflow, inverse, owner_slots,
          owner_inverse, evict_slots, fetch_slots, fetch_rows, fetch_opt)``
          as NumPy arrays.
        """
        ids = np.asarray(ids)
        size = self.callback_size(ids.size)
        with self._offer_lock:
            host = self._offers.popleft() if self._offers else None
        if host is not None:
            self._applied = max(self._applied, host.plan.index)
            if host.ids.shape != ids.shape or not np.array_equal(host.ids, ids):
                raise RuntimeError(
                    "the step looked up ids that differ from the batch the pipeline prepared; "
                    "pass each step the batch the pipeline yields, in order."
                )
            if host.deferred is not None:
                # Every earlier step's write-back callback ran before this one
                # (ordered callbacks), so the rows are home. Plans made after
                # this batch was released may have evicted them again: their
                # write-backs hold later values and land in later steps.
                late = host.deferred
                if (self._pending(late.ids, before=host.plan.index)[0] >= 0).any():
                    raise RuntimeError(
                        f"batch {host.plan.index} fetches rows an earlier step has not written "
                        "back; run a step for every batch the pipeline yields, in order."
                    )
                with self.stats.timers.time("gather"):
                    self.table.gather_into(late.ids, *host.moves[2:], late.at)
        else:
            self.planner.release(self.planner.next_index - 1)
            host = self.stage_host(ids, train=train, size=size)
            self._applied = max(self._applied, host.plan.index)
        return (np.int32(host.plan.index), *host.route[:5], *self._global_moves(host, size))

    def _global_moves(self, host: HostStaged, size: int) -> tuple[Any, ...]:
        """``host.moves`` as global slot lists padded to ``size``, for ``swap``
        (the host-callback form: one process, one fixed shape)."""
        cfg, cl = self.config, self.local_capacity
        shapes = cfg.optimizer.state_spec(cfg.features)
        if host.moves is None:
            empty = np.zeros(0, np.int64)
            evict, fetch, at = empty, empty, empty
            rows = np.zeros((0, cfg.features), cfg.row_dtype)
            opt = {k: np.zeros((0, *spec.shape), spec.dtype) for k, spec in shapes.items()}
        else:
            evict_blocks, fetch_blocks, rows, opt = host.moves
            per = evict_blocks.size // self._blocks
            offset = (self._first + np.arange(evict_blocks.size) // per) * cl
            evict = (evict_blocks + offset)[evict_blocks < cl]
            at = np.flatnonzero(fetch_blocks < cl)
            fetch = (fetch_blocks + offset)[at]
        return (
            _pad(evict.astype(np.int32), size, cfg.capacity),
            _pad(fetch.astype(np.int32), size, cfg.capacity),
            _pad(take_rows(rows, at), size, 0),
            {k: _pad(take_rows(v, at), size, 0) for k, v in opt.items()},
        )

    def callback_write_back(self, index: np.ndarray, rows: np.ndarray, opt: dict) -> None:
        """Lands the rows evicted by plan ``index`` (run by ``io_callback`` in the step)."""
        with self._write_back_lock:
            ids, _ = self._unlanded.get(int(index), (None, None))
        if ids is not None:
            n = len(ids)
            self.table.scatter(
                ids, np.asarray(rows)[:n], {k: np.asarray(v)[:n] for k, v in opt.items()}
            )
            with self._write_back_lock:
                del self._unlanded[int(index)]
                self._write_back_lock.notify_all()

    def apply(self, state: CacheState, staged: Staged) -> CacheState:
        """Device half of a step: the donated swap that brings ``staged`` rows in.

        Call it in plan order, between the training steps, on the thread that
        owns the device state. The victims' rows it reads out are queued for
        write-back.
        """
        self._applied = max(self._applied, staged.plan.index)
        if staged.moves is None:
            return state
        with self.stats.timers.time("swap"):
            state, rows, opt = device_ops.swap_blocks(
                state, *staged.moves, mesh=self.mesh, axis=self.axis
            )
        with self._write_back_lock:
            if staged.plan.index in self._unlanded:  # this process stores evicted rows
                self._dispatched[staged.plan.index] = (rows, opt)
                self._write_back_lock.notify_all()
        return state

    def land_write_backs(self) -> None:
        """Copies every dispatched write-back into the host table (blocks until ready).

        Raises ``RuntimeError`` if a planned eviction was never applied.
        """
        with self.stats.timers.time("write_back"):
            self._land(None)
        if self._unlanded:
            raise RuntimeError(
                f"plans {sorted(self._unlanded)} evicted rows but were never applied to the "
                "device state; apply every staged batch, in order, before flushing."
            )

    def _land(self, needed: np.ndarray | None) -> None:
        """Lands write-backs: all dispatched ones when ``needed`` is ``None``;
        else those ready now plus those evicting an id in distinct ``needed``.

        A row is read only after its write-back landed: when an earlier plan
        evicted a row this one fetches, this waits until that plan's swap is
        dispatched (the training loop applies plans in order, so it comes).
        Two threads may land at once (the producer what is ready, the
        training loop a deferred fetch's): each claims the plans it writes,
        in plan order, and one that needs a plan another claimed waits for it.
        """
        with self._write_back_lock:
            if needed is None:  # all: wait for those another thread is writing
                must = set(self._landing)
            elif needed.size == 0:  # only those ready
                must = set()
            else:
                wanted = kernels.IdIndex(needed)
                must = {i for i, (ids, _) in self._unlanded.items() if wanted.find(ids)[0].size}

            def unread() -> bool:  # evicted, not read out by a swap yet
                return any(i in self._unlanded and i not in self._dispatched for i in must)

            def missing() -> bool:  # or being landed by another thread (still unlanded)
                return unread() or any(i in self._landing for i in must)

            if unread():
                self.stats.write_back_waits += 1
            while missing():
                self._write_back_lock.wait()
            claimed = []
            for index, (rows, opt) in sorted(self._dispatched.items()):
                if index in self._landing:
                    continue
                if needed is not None and index not in must:
                    if not (rows.is_ready() and all(v.is_ready() for v in opt.values())):
                        continue
                self._landing.add(index)
                claimed.append((index, self._unlanded[index], rows, opt))
        for index, (ids, at), rows, opt in claimed:
            landed = False
            try:
                self._write_back(ids, at, rows, opt)
                landed = True
            finally:  # a failed write stays unlanded, to be landed again
                with self._write_back_lock:
                    self._landing.discard(index)
                    if landed:
                        del self._unlanded[index], self._dispatched[index]
                    self._write_back_lock.notify_all()

    # ---------------------------------------------------------------- export
    def flush(self, state: CacheState) -> None:
        """Writes every dirty row (and its optimizer state) back to the host.

        The device state is read, not donated; afterwards the host table is
        complete. Rows of batches still in flight (planned and not released)
        stay marked dirty, since their step may still change them.

        Raises:
          RuntimeError: a planned batch was not applied to ``state`` yet (a
            pipeline still holds staged batches): its slots do not hold its
            rows, and reading them would overwrite the host table.
        """
        planner = self.planner
        first, last = self._applied + 1, planner.next_index - 1
        if first <= last:
            plans = f"plan {first} was" if first == last else f"plans {first}..{last} were"
            raise RuntimeError(
                f"{plans} staged but not applied to this device state; apply every staged "
                "batch in order (EmbeddingCache.apply, or close the pipeline, which applies "
                "them) before flushing or exporting."
            )
        self.land_write_backs()
        slots = np.flatnonzero(planner.dirty)
        if slots.size == 0:
            return
        blocks, at, mine = self._local_blocks(slots, self._per_device_size(slots))
        rows, opt = device_ops.read_blocks(
            state, self._put(blocks, self.row_sharding), mesh=self.mesh, axis=self.axis
        )
        self._write_back(self.planner.id_of_slot[slots[mine]], at, rows, opt)
        in_flight = planner.last_use[slots] > planner.released
        planner.dirty[slots[~in_flight]] = False
        self.stats.record_write_back(slots.size)

    def export(self, state: CacheState) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The full table and optimizer state in id order (copies).

        Flushes first, so the host table is also complete afterwards. When
        the host rows are split over processes, every process must call it
        (a collective) and each receives the whole table.
        """
        self.flush(state)
        table = self.table
        if self.shard[1] == 1:
            return np.array(table.rows), {k: np.array(v) for k, v in table.state.items()}
        return _gather_shards(table, self.shard)

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Host state of the cache besides the table, for a checkpoint.

        The planner's directory and policy (``Planner.state_dict``), the
        padded sizes in use (they fix the compiled shapes) and the
        statistics. Take it after ``flush``, with no batch in flight.

        Examples:
          >>> import numpy as np, jaxcache
          >>> cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, capacity=8))
          >>> state, _ = cache.prepare(cache.init_state(), np.array([1, 2]))
          >>> cache.flush(state)
          >>> saved = cache.state_dict()
          >>> saved["planner"]["next_index"], saved["stats"]["total"]["misses"]
          (1, 2)
        """
        self._check_idle()
        stats = self.stats
        return {
            "planner": self.planner.state_dict(),
            "buckets": {"fetch": self._fetch_bucket, "route": list(self._route_buckets)},
            "stats": {
                "total": dataclasses.asdict(stats.total),
                "last": dataclasses.asdict(stats.last),
                "steps": stats.steps,
                "write_back_waits": stats.write_back_waits,
                "deferred_fetches": stats.deferred_fetches,
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a ``state_dict``; the host table must already hold the rows.

        The planner always (onto any capacity, see ``Planner.load_state_dict``);
        the padded sizes and the statistics when ``state`` has them. Build the
        device state afterwards with ``init_state``.

        Examples:
          >>> import numpy as np, jaxcache
          >>> cfg = jaxcache.CacheConfig(100, 4, capacity=8)
          >>> cache = jaxcache.EmbeddingCache(cfg)
          >>> state, _ = cache.prepare(cache.init_state(), np.array([1, 2]))
          >>> cache.flush(state)
          >>> other = jaxcache.EmbeddingCache(cfg, table=cache.table)
          >>> other.load_state_dict(cache.state_dict())
          >>> other.planner.resident_ids().tolist(), other.stats.total.misses
          ([1, 2], 2)
        """
        self._check_idle()
        self.planner.load_state_dict(state["planner"])
        self._applied = self.planner.next_index - 1  # restored rows are on the device
        buckets = state.get("buckets")
        if buckets is not None:
            self._fetch_bucket = int(buckets["fetch"])
            route = tuple(int(size) for size in buckets["route"])
            if len(route) == len(self._route_buckets):
                self._route_buckets = route
        saved = state.get("stats")
        if saved is not None:
            fields = [f.name for f in dataclasses.fields(StepStats)]
            self.stats.total = StepStats(**{k: int(saved["total"].get(k, 0)) for k in fields})
            self.stats.last = StepStats(**{k: int(saved["last"].get(k, 0)) for k in fields})
            self.stats.steps = int(saved["steps"])
            self.stats.write_back_waits = int(saved["write_back_waits"])
            self.stats.deferred_fetches = int(saved.get("deferred_fetches", 0))

    def _check_idle(self) -> None:
        with self._write_back_lock:
            busy = sorted(set(self._unlanded) | set(self._dispatched))
        if busy or self._offers:
            raise RuntimeError(
                f"batches are in flight (plans {busy}, {len(self._offers)} offered); close the "
                "pipeline and call flush(state) before saving or restoring the cache."
            )


def _gather_shards(
    table: HostTable, shard: tuple[int, int]
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Every process's rows of a split host table, in id order (a collective)."""
    from jax.experimental import multihost_utils

    index, count = shard
    arrays = {"rows": table.rows, **{f"state.{k}": v for k, v in table.state.items()}}
    longest = len(range(0, table.num_embeddings, count))
    padded = {k: _pad(np.asarray(v), longest, 0) for k, v in arrays.items()}
    gathered = multihost_utils.process_allgather({"index": np.int32(index), **padded})
    out = {}
    for key, array in arrays.items():
        whole = np.empty((table.num_embeddings, *array.shape[1:]), array.dtype)
        for process, part in zip(gathered["index"], gathered[key], strict=True):
            whole[int(process) :: count] = part[: len(range(int(process), len(whole), count))]
        out[key] = whole
    rows = out.pop("rows")
    return rows, {k.removeprefix("state."): v for k, v in out.items()}


def _local_data(array: jax.Array) -> np.ndarray:
    """This process's blocks of a row-split array, in block order, as NumPy."""
    shards = {s.index[0].start or 0: s.data for s in array.addressable_shards}
    if len(shards) == 1:
        return np.asarray(next(iter(shards.values())))
    return np.concatenate([np.asarray(shards[start]) for start in sorted(shards)])


def _copy_read_out(
    host: HostStaged, at: np.ndarray, rows: jax.Array, opt: dict[str, jax.Array], read: np.ndarray
) -> None:
    """Copies rows ``read`` of this process's blocks of a swap's read-out (and
    their state) into ``host``'s fetch rows at ``at``."""
    _, _, fetch_rows, fetch_opt = host.moves
    kernels.copy_rows(fetch_rows, at, _local_data(rows), read)
    for name, values in opt.items():
        kernels.copy_rows(fetch_opt[name], at, _local_data(values), read)


def _pad(values: np.ndarray, size: int, fill: int | float) -> np.ndarray:
    out = np.full((size, *values.shape[1:]), fill, values.dtype)
    out[: len(values)] = values
    return out
