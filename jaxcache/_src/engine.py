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
import functools
import threading
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxcache._src import device_ops, routing
from jaxcache._src.config import CacheConfig
from jaxcache._src.device_ops import CacheState, Lookup
from jaxcache._src.frequency import hottest
from jaxcache._src.host_table import HostTable
from jaxcache._src.planner import Plan, Planner
from jaxcache._src.stats import CacheStats, StepStats

__all__ = ["EmbeddingCache", "HostStaged", "Staged", "bucket_size"]


class HostStaged(NamedTuple):
    """A batch planned and gathered on the host, padded, not yet transferred.

    Attributes:
      plan: the host plan.
      ids: the ids it was planned for.
      moves: ``(evict_slots, fetch_slots, fetch_rows, fetch_opt)`` or ``None``.
      route: which rows each device fetches from which owner.
    """

    plan: Plan
    ids: np.ndarray
    moves: tuple[Any, ...] | None
    route: routing.HostRoute


class Staged(NamedTuple):
    """A batch planned and transferred, waiting for its swap.

    Attributes:
      plan: the host plan.
      moves: device ``(evict_slots, fetch_slots, fetch_rows, fetch_opt)`` for
        ``swap``, or ``None`` when no row moves.
      lookup: the batch's device ``Lookup``.

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


@functools.partial(jax.jit, static_argnums=1)
def _read_slots(state: CacheState, size: int, slots: jax.Array):
    del size  # only part of the cache key: slots already has that length
    return (
        state.rows.at[slots].get(mode="fill", fill_value=0),
        {k: v.at[slots].get(mode="fill", fill_value=0) for k, v in state.opt.items()},
    )


class EmbeddingCache:
    """A host-offloaded embedding table with a device cache of hot rows.

    Args:
      config: the table's static configuration.
      table: the host table (default: a new one initialised with ``seed``).
      frequencies: ``int [N]`` dataset access counts: the priority of the
        ``"frequency"`` policy, the seed of ``"lfu"``, and the rows to warm.
      warm: preload the hottest rows (by ``frequencies``) before the first
        step; defaults to ``True`` for the ``"frequency"`` policy.
      seed: seed of a new host table.
      mesh: device mesh the rows are sharded over (default: one device).
      axis: mesh axis of the rows.

    Attributes:
      config: the configuration.
      table: the ``HostTable`` (id order).
      planner: the ``Planner`` (directory and policy).
      stats: the ``CacheStats``.

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
        if config.capacity % devices:
            rounded = -(-config.capacity // devices) * devices
            if rounded > config.num_embeddings:
                raise ValueError(
                    f"capacity={config.capacity} does not split over {devices} devices and "
                    f"rounding it up exceeds the table; use a multiple of {devices}."
                )
            config = dataclasses.replace(config, capacity=rounded)
        self.config = config
        self.table = table if table is not None else HostTable(config, seed=seed)
        self.planner = Planner(config, frequencies=frequencies, devices=devices)
        self.stats = CacheStats(config.row_bytes)
        self.mesh = mesh
        self.axis = axis
        self.devices = devices
        self.local_capacity = config.capacity // devices
        self.row_sharding = NamedSharding(mesh, PartitionSpec(axis))
        self.replicated = NamedSharding(mesh, PartitionSpec())
        # Write-backs: evicted ids by plan index, from planning until landed,
        # and the device rows read out by each applied swap.
        self._write_back_lock = threading.Condition()
        self._unlanded: dict[int, np.ndarray] = {}
        self._dispatched: dict[int, tuple[jax.Array, dict[str, jax.Array]]] = {}
        # The host-callback form: batches staged ahead, and one planner user at a time.
        self._offers: collections.deque[HostStaged] = collections.deque()
        self._offer_lock = threading.Lock()
        self._plan_lock = threading.Lock()
        self._fetch_bucket = 0
        self._route_buckets = (0, 0, 0)  # K, V, O in use
        self._applied = -1  # index of the last plan whose rows reached the device
        if warm is None:
            warm = config.policy == "frequency"
        if warm:
            if frequencies is None:
                raise ValueError("warm=True needs frequencies= to know the hottest rows.")
            self.planner.warm(hottest(frequencies, config.capacity))

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
        slots = np.flatnonzero(self.planner.id_of_slot >= 0)
        rows, opt = self.table.gather(self.planner.id_of_slot[slots])
        host_rows = np.zeros((cfg.capacity, cfg.features), cfg.row_dtype)
        host_rows[slots] = rows
        host_opt = {}
        for name, spec in cfg.optimizer.state_spec(cfg.features).items():
            array = np.full((cfg.capacity, *spec.shape), spec.init, spec.dtype)
            array[slots] = opt[name]
            host_opt[name] = array
        return jax.device_put(CacheState(host_rows, host_opt), self.row_sharding)

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
        return self.to_device(self.stage_host(ids, train=train))

    def to_device(self, host: HostStaged) -> Staged:
        """Starts the transfer of a host-staged batch (``device_put``, asynchronous)."""
        with self.stats.timers.time("transfer"):
            moves = None if host.moves is None else jax.device_put(host.moves, self.replicated)
            lookup = self._device_lookup(host.route)
        return Staged(host.plan, moves, lookup)

    def _device_lookup(self, route: routing.HostRoute) -> Lookup:
        rows, replicated = self.row_sharding, self.replicated
        requests, overflow, inverse, owner_slots, owner_inverse = jax.device_put(
            route[:5], (rows, replicated, rows, rows, rows)
        )
        return Lookup(
            requests,
            overflow,
            inverse,
            owner_slots,
            owner_inverse,
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
        upcoming: Any = None,
    ):
        """``stage`` without the transfer: the padded host arrays of a step.

        Args:
          ids: integer ids ``[B, ...]``.
          train: the step will update these rows.
          size: pad every per-step list to exactly this many rows (the
            host-callback form needs one fixed shape); default: buckets.
          upcoming: ids of the next batch, when known: their resident rows
            are kept if there is room (see ``Planner.plan``).

        Returns:
          A ``HostStaged``.
        """
        timers = self.stats.timers
        self._check_batch(np.shape(ids))
        with timers.time("plan"):
            with self._plan_lock:
                plan = self.planner.plan(ids, train=train, upcoming=upcoming)
            route = self._route(plan, size)
        with timers.time("write_back"):
            self._land(plan.fetch_ids)
        if len(plan.evict_ids):  # after landing: a plan never fetches what it evicts
            with self._write_back_lock:
                self._unlanded[plan.index] = plan.evict_ids
        cfg = self.config
        moves = None
        moved = max(plan.misses, len(plan.evict_ids))
        if moved or size is not None:
            rows_size = size
            if rows_size is None:
                rows_size = self._fetch_bucket = bucket_size(
                    moved, cfg.min_bucket, self._fetch_bucket
                )
            with timers.time("gather"):
                rows, opt = self.table.gather(plan.fetch_ids)
                moves = (
                    _pad(plan.evict_slots, rows_size, cfg.capacity),
                    _pad(plan.fetch_slots, rows_size, cfg.capacity),
                    _pad(rows, rows_size, 0),
                    {k: _pad(v, rows_size, 0) for k, v in opt.items()},
                )
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
        return HostStaged(plan, np.asarray(ids), moves, route)

    def _route(self, plan: Plan, size: int | None) -> routing.HostRoute:
        """Routes ``plan`` over the devices, with padded sizes from buckets (or
        the fixed ``size`` of the host-callback form: no overflow possible)."""
        n, cl = self.devices, self.local_capacity
        need = None
        if size is not None:
            per_device = size // n
            k, v, o = per_device, size, 0
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
        return routing.plan_route(
            plan.unique_slots,
            plan.inverse,
            devices=n,
            local_capacity=cl,
            per_destination=k,
            overflow_size=o,
            owner_size=v,
            demand=need,
        )

    # ------------------------------------------------------- host callbacks
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
        it on the spot. Every list is padded to ``ids.size`` so the callback
        has one fixed output shape.

        Returns:
          ``(plan index, requests, overflow, inverse, owner_slots,
          owner_inverse, evict_slots, fetch_slots, fetch_rows, fetch_opt)``
          as NumPy arrays.
        """
        ids = np.asarray(ids)
        with self._offer_lock:
            host = self._offers.popleft() if self._offers else None
        if host is not None:
            self._applied = max(self._applied, host.plan.index)
            if host.ids.shape != ids.shape or not np.array_equal(host.ids, ids):
                raise RuntimeError(
                    "the step looked up ids that differ from the batch the pipeline prepared; "
                    "pass each step the batch the pipeline yields, in order."
                )
        else:
            self.planner.release(self.planner.next_index - 1)
            host = self.stage_host(ids, train=train, size=ids.size)
            self._applied = max(self._applied, host.plan.index)
        return (np.int32(host.plan.index), *host.route[:5], *host.moves)

    def callback_write_back(self, index: np.ndarray, rows: np.ndarray, opt: dict) -> None:
        """Lands the rows evicted by plan ``index`` (run by ``io_callback`` in the step)."""
        with self._write_back_lock:
            ids = self._unlanded.get(int(index))
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
            state, rows, opt = device_ops.swap(state, *staged.moves)
        if len(staged.plan.evict_ids):
            with self._write_back_lock:
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
        else those ready now plus those evicting an id in ``needed``.

        A row is read only after its write-back landed: when an earlier plan
        evicted a row this one fetches, this waits until that plan's swap is
        dispatched (the training loop applies plans in order, so it comes).
        """
        with self._write_back_lock:
            must = {
                index
                for index, ids in self._unlanded.items()
                if needed is not None and _intersects(ids, needed)
            }

            def missing() -> bool:  # evicted, not yet read out by a swap, not landed
                return any(i in self._unlanded and i not in self._dispatched for i in must)

            if missing():
                self.stats.write_back_waits += 1
            while missing():
                self._write_back_lock.wait()
            dispatched = sorted(self._dispatched.items())
        for index, (rows, opt) in dispatched:
            if needed is not None and index not in must:
                if not (rows.is_ready() and all(v.is_ready() for v in opt.values())):
                    continue
            ids = self._unlanded[index]
            n = len(ids)
            self.table.scatter(
                ids, np.asarray(rows)[:n], {k: np.asarray(v)[:n] for k, v in opt.items()}
            )
            with self._write_back_lock:
                del self._unlanded[index], self._dispatched[index]

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
        size = bucket_size(slots.size, self.config.min_bucket)
        rows, opt = _read_slots(state, size, jnp.asarray(_pad(slots, size, self.config.capacity)))
        n = slots.size
        ids = self.planner.id_of_slot[slots]
        self.table.scatter(
            ids, np.asarray(rows)[:n], {k: np.asarray(v)[:n] for k, v in opt.items()}
        )
        in_flight = planner.last_use[slots] > planner.released
        planner.dirty[slots[~in_flight]] = False
        self.stats.record_write_back(n)

    def export(self, state: CacheState) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The full table and optimizer state in id order (copies).

        Flushes first, so the host table is also complete afterwards.
        """
        self.flush(state)
        return np.array(self.table.rows), {k: np.array(v) for k, v in self.table.state.items()}

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

    def _check_idle(self) -> None:
        with self._write_back_lock:
            busy = sorted(set(self._unlanded) | set(self._dispatched))
        if busy or self._offers:
            raise RuntimeError(
                f"batches are in flight (plans {busy}, {len(self._offers)} offered); close the "
                "pipeline and call flush(state) before saving or restoring the cache."
            )


def _intersects(values: np.ndarray, sorted_ids: np.ndarray) -> bool:
    """Whether any of ``values`` is in ``sorted_ids`` (binary search, no sort)."""
    if values.size == 0 or sorted_ids.size == 0:
        return False
    at = np.minimum(np.searchsorted(sorted_ids, values), sorted_ids.size - 1)
    return bool((sorted_ids[at] == values).any())


def _pad(values: np.ndarray, size: int, fill: int | float) -> np.ndarray:
    out = np.full((size, *values.shape[1:]), fill, values.dtype)
    out[: len(values)] = values
    return out
