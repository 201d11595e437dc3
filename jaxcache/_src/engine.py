"""The cache engine: a façade over the host table, the partitions' planners,
the stager and the write-back ledger, driving the device state.

``EmbeddingCache`` holds everything that lives on the host. The device half,
a ``CacheState``, is passed in and returned, so the same engine serves an NNX
module (which keeps the state in variables), a Linen module (in a variable
collection) or a hand-written training loop.

One step, unpipelined::

    state, lookup = cache.prepare(state, ids)   # host: plan, gather, transfer; device: swap
    state, ... = train_step(state, lookup, ...)  # device: lookup + sparse update

Who owns what: ``Partitions`` (``partitions.py``) the directory and policy
of each device's share; ``Stager`` (``stager.py``) the padded sizes and the
host arrays of a step; ``WriteBacks`` (``write_back.py``) the evicted rows
until they land; ``Layout`` (``placement.py``) where ids live.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import io_callback
from jax.sharding import Mesh

from jaxcache._src import device_ops, kernels, npy_files, routing, validation
from jaxcache._src.agreement import agreement
from jaxcache._src.blocks import Blocks, gather_entries, gather_shards, local_data
from jaxcache._src.config import CacheConfig
from jaxcache._src.device_ops import CacheState, Lookup
from jaxcache._src.device_planner import DevicePlanner, DeviceStep, Dispatched
from jaxcache._src.host_callback import HostCallbacks
from jaxcache._src.host_table import HostTable
from jaxcache._src.lifecycle import Lifecycle, interrupts_held
from jaxcache._src.partitions import Partitions
from jaxcache._src.placement import Layout, axis_processes, process_shard
from jaxcache._src.planner import CapacityError
from jaxcache._src.raw_ids import ROW_PAD, RawIds
from jaxcache._src.stager import Deferred, HostStaged, Stager, bucket_size, fresh_buffers
from jaxcache._src.stats import CacheStats
from jaxcache._src.threads import HostThreads, default_threads
from jaxcache._src.validation import is_int
from jaxcache._src.vocabulary import Vocabulary
from jaxcache._src.write_back import WriteBacks

__all__ = [
    "PLANNERS",
    "Deferred",
    "DeviceStaged",
    "EmbeddingCache",
    "HostStaged",
    "Staged",
    "bucket_size",
]

# ``EmbeddingCache.cache_id``: from 1, never reused in a process (``id`` is).
_CACHE_IDS = itertools.count(1)

#: Where a cache plans its batches (``EmbeddingCache(planner=...)``).
PLANNERS = ("device", "host")


# Caches over several processes, numbered in the order every process builds them.
_MULTI_PROCESS_CACHES = itertools.count()


class Staged(NamedTuple):
    """A batch planned and transferred, waiting for its swap.

    Attributes:
      plan: the host plan (a ``StepPlan``: one ``Plan`` per device partition).
      moves: device ``(evict_slots, fetch_slots, fetch_rows, fetch_opt)`` for
        ``swap_blocks``, or ``None`` when no row moves.
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

    plan: Any
    moves: tuple[Any, ...] | None
    lookup: Lookup


class DeviceStaged(NamedTuple):
    """A batch planned on the devices whose missing rows were gathered on
    the host, not yet transferred (the device planner's ``HostStaged``).

    Attributes:
      plan: the ``DeviceStep``.
      rows: ``[L P, D]`` the fetched rows, one block of ``P`` per device of
        this process (padding rows are zeros).
      opt: ``{name: [L P, ...]}`` their optimizer state.
      deferred: the fetched rows whose write-back from an earlier plan had
        not landed (``HostStaged.deferred``), or ``None``.
    """

    plan: DeviceStep
    rows: np.ndarray
    opt: dict[str, np.ndarray]
    deferred: Deferred | None = None


# The end of every refusal that names an open look-ahead pipeline: how to
# close one the caller no longer holds (its threads keep it alive).
CLOSE_DROPPED = (
    "A pipeline you no longer hold (a for-loop over it left by break) closes with "
    "`for p in cache.pipelines: p.close()`."
)


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
        Every id has a home device whose slots alone hold its row
        (``i % n`` decides it); each device's share is planned on its own.
        When the devices belong to several processes (under
        ``jax.distributed.initialize``), every process runs the same program
        on the same global batches; each plans and stores only the rows of
        the ids homed on its devices (``process_shard``).
      axis: mesh axis of the rows.
      threads: host threads that plan, gather and write back the devices'
        shares of a step in parallel (default: the cores the device runtime
        does not need, at most one per partition of this process). Results
        do not depend on it.
      partitions_per_device: ``q``, planners per device (default 1). Each
        plans the ids ``i % (n q)`` of one residue over ``C_l / q`` of the
        device's slots, so one device's batch is planned, gathered and
        written back on up to ``q`` host threads. Like the device count, it
        decides which slots rows take and which rows a full partition
        evicts, so results depend on it (within float rounding of the
        full-table reference, as always), and ``capacity`` rounds up to a
        multiple of ``n q``.
      planner: where batches are planned: ``"device"`` (a jitted program on
        the mesh's devices: dedupe, directory, victims and routes there, the
        host moving only missing and dirty rows) or ``"host"`` (compiled
        loops on the host threads). Default: ``"device"`` on accelerators,
        ``"host"`` on the CPU backend, where the "device" is the host's own
        cores and XLA's gathers and scatters are slower than the host
        loops. Both plan the same slots and give the same results, and a
        checkpoint of one restores into the other.

    Attributes:
      config: the configuration.
      table: the ``HostTable`` (id order; this process's share of it when
        the mesh spans several processes).
      planner: the ``Partitions`` (a ``Planner`` per partition of this
        process) or the ``DevicePlanner``.
      stats: the ``CacheStats``.
      shard: ``(index, count)``: which share of the host rows this process
        stores (``process_shard``); ``(0, 1)`` in one process.

    Examples:
      >>> import numpy as np, jaxcache
      >>> cfg = jaxcache.CacheConfig(num_embeddings=100, features=4, capacity=10)
      >>> cache = jaxcache.EmbeddingCache(cfg)
      >>> state = cache.init_state()
      >>> state, lookup = cache.prepare(state, np.array([[3, 5], [5, 7]]))
      >>> jaxcache.device.lookup_rows(state.rows, lookup).shape
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
        threads: int | None = None,
        partitions_per_device: int | None = None,
        planner: str | None = None,
    ) -> None:
        if table is not None:
            _check_table(table.config, config)
            if getattr(table, "closed", False):
                raise ValueError(
                    "the table given was closed (TieredTable.close removed its files): build a "
                    "new one for this cache."
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
        shard, processes = self.shard
        if table is not None and table.shard != self.shard:
            raise ValueError(
                f"the host table holds shard {table.shard} of the ids but this process stores "
                f"shard {self.shard} of a mesh over {processes} process(es); build it with "
                "HostTable(config, shard=jaxcache.host.process_shard(mesh, axis))."
            )
        split = 1 if partitions_per_device is None else partitions_per_device
        layout = Layout(devices, processes, shard, split)  # checks the split first
        parts = layout.parts
        if config.capacity % parts:
            over = (
                f"{devices} devices" if split == 1 else f"{devices} device(s) x {split} partitions"
            )
            rounded = -(-config.capacity // parts) * parts
            if rounded > config.num_embeddings:
                below = config.capacity // parts * parts
                raise ValueError(
                    f"capacity={config.capacity} does not split over {over} and "
                    f"rounding it up exceeds the table; use a multiple of {parts}"
                    + (f", such as {below}." if below else " within the table.")
                )
            config = dataclasses.replace(config, capacity=rounded)
        if processes > 1 and config.route_capacity is not None:
            raise ValueError(
                f"route_capacity={config.route_capacity} needs the whole batch's routes in one "
                f"process, but this mesh spans {processes}; leave it None (the routes are "
                "then sized from each batch)."
            )
        self.layout = layout
        platform = mesh.devices.flat[0].platform
        planner = _planner(planner, platform)
        if config.vocabulary is not None:
            _check_dynamic(config, frequencies, warm)
        if planner == "device" and config.route_capacity is not None:
            raise ValueError(
                f"route_capacity={config.route_capacity} sizes the host planner's routes; the "
                "device planner sizes its own from each batch. Leave it None with "
                'planner="device".'
            )
        self.planner_kind = planner
        self.threads = HostThreads(
            default_threads(platform, layout.per_process * split) if threads is None else threads
        )
        self.config = config
        # Lookups carry it: a module over another cache of this name refuses them.
        self.cache_id = next(_CACHE_IDS)
        # Why the cache may not be used: a restore failed part-way, or a plan
        # was lost before its rows reached the device (``apply``).
        self._damaged: str | None = None
        # With raw ids the planners see host rows, and row -1 for padding and
        # for ids not admitted, unless they read a shared row (``raw_ids``).
        self.raw = None if config.vocabulary is None else RawIds(config, self.shard)
        rows_config = config
        if self.raw is not None:
            rows_config = dataclasses.replace(config, padding_id=ROW_PAD, vocabulary=None)
        self.table = table if table is not None else HostTable(config, seed=seed, shard=self.shard)
        if self.raw is not None:
            self.raw.start_shared_row(self.table)
        processes_agreement = (
            agreement(
                f"{config.name}-{next(_MULTI_PROCESS_CACHES)}", axis_processes(mesh, axis), shard
            )
            if processes > 1
            else None
        )
        self.planner: Partitions | DevicePlanner
        if planner == "device":
            self.planner = DevicePlanner(
                config,
                self.layout,
                mesh,
                axis,
                frequencies=frequencies,
                agreement=processes_agreement,
                learner=None if self.raw is None else self.raw.learner,
                clock=None if self.raw is None else self.raw.clock,
            )
        else:
            self.planner = Partitions(
                rows_config,
                self.layout,
                frequencies=frequencies,
                threads=self.threads,
                ids=config,
                agreement=processes_agreement,
            )
        self.stats = CacheStats(config.row_bytes)
        self.mesh = mesh
        self.axis = axis
        self.devices = devices
        self.local_capacity = config.capacity // devices
        # The device blocks whose rows this process stores and moves.
        self._blocks = self.layout.per_process
        self._first = self.layout.own[0]
        self.blocks = Blocks(mesh, axis, processes)
        self.row_sharding = self.blocks.row_sharding
        self._write_back = functools.partial(
            _write_back, self.table, self.threads, self._blocks * split
        )
        self.write_backs = WriteBacks(self._write_back, functools.partial(_count_wait, self.stats))
        self.stager = Stager(
            rows_config,
            self.planner,
            self.table,
            self.write_backs,
            self.stats,
            self.threads,
            self.raw,
        )
        self.lifecycle = Lifecycle(self.planner, self.write_backs)
        # Every open pipeline over this table (``jaxcache.prefetch``), until
        # closed: one without look-ahead plans each batch as it hands it
        # out, which would release the plans one with look-ahead holds.
        self.open_pipelines: weakref.WeakSet[Any] = weakref.WeakSet()
        self.callbacks = HostCallbacks(self.stager, self.lifecycle, platform, planner)
        # On an accelerator a read-out starts its copy to the host as soon as
        # the swap has run, so that landing it later finds it there; the CPU
        # backend's arrays are host memory already.
        self._copy_ahead = platform != "cpu"
        if warm is None:
            warm = self.planner.warms
        if warm:
            if frequencies is None:
                raise ValueError("warm=True needs frequencies= to know the hottest rows.")
            self.planner.warm_hottest(frequencies)

    @classmethod
    def full_table(cls, config: CacheConfig, **kwargs) -> EmbeddingCache:
        """The whole table on device (capacity ``N``, every id resident).

        The baseline a cache is measured and checked against: the same lookups
        and sparse optimizer, with no rows ever moving after the start.

        Examples:
          >>> import jaxcache
          >>> cfg = jaxcache.CacheConfig(num_embeddings=50, features=4, capacity=5)
          >>> full = jaxcache.EmbeddingCache.full_table(cfg)
          >>> full.config.capacity, full.planner.resident_ids().size
          (50, 50)
        """
        mesh, axis = kwargs.get("mesh"), kwargs.get("axis", "rows")
        devices = dict(mesh.shape).get(axis, 1) if mesh is not None else 1
        if config.num_embeddings % devices:
            raise ValueError(
                f"full_table keeps all {config.num_embeddings} rows on the devices, but they do "
                f"not split evenly over the {devices} devices of the mesh axis {axis!r}; use a "
                f"mesh whose size divides {config.num_embeddings}, or a cache (capacity below "
                "the table)."
            )
        config = dataclasses.replace(config, capacity=config.num_embeddings, policy="lru")
        kwargs.pop("frequencies", None)
        cache = cls(config, warm=False, **kwargs)
        cache.planner.warm(np.arange(config.num_embeddings))
        return cache

    @property
    def pipelines(self) -> list[Any]:
        """The open pipelines staging this table's batches ahead (with
        look-ahead): ``prepare`` would plan past them. One the caller no
        longer holds (a ``for`` loop over it left by ``break``) still holds
        the table until it is closed: ``for p in cache.pipelines:
        p.close()``."""
        return [pipeline for pipeline in self.open_pipelines if pipeline.lookahead > 0]

    @property
    def name(self) -> str:
        """The table's name (``config.name``)."""
        return self.config.name

    @property
    def vocabulary(self) -> Vocabulary | None:
        """The raw ids' ``Vocabulary`` (id -> row) with
        ``CacheConfig(vocabulary=...)``; ``None`` when ids are rows. With
        the device planner it lives on the devices, and this is a host copy
        of this process's share, taken between steps. Its ``bonus`` is the
        one the next batch forgets by (learned, with ``forget="adaptive"``)."""
        if self.raw is None:
            return None
        if isinstance(self.planner, DevicePlanner):
            return self.planner.vocabulary()
        self.raw.vocabulary.bonus = self.raw.bonus()
        return self.raw.vocabulary

    def _check_not_raw(self, form: str) -> None:
        if self.raw is not None:
            raise ValueError(
                f"{form} does not take raw ids yet; with CacheConfig(vocabulary=...) pass each "
                "step the Lookup of CachedEmbed.prepare (or jaxcache.prefetch) instead."
            )

    # ----------------------------------------------------------------- state
    def init_state(self) -> CacheState:
        """Device state holding the host rows of every resident id.

        Call it at the start (or after ``flush``): resident rows are copied
        from the host table, free slots hold zeros.
        """
        if self.lifecycle.stale():
            raise RuntimeError(
                "the cache has rows changed on device; call flush(state) before building a "
                "new device state from the host table."
            )
        cfg = self.config
        ids = self.planner.id_of_slot  # this process's blocks, global ids
        slots = np.flatnonzero(ids >= 0)
        rows, opt = self.table.gather(ids[slots])
        host_rows = np.zeros((ids.size, cfg.features), cfg.row_dtype)
        host_rows[slots] = rows
        host_opt = {}
        for name, spec in cfg.optimizer.state_spec(cfg.features).items():
            array = np.full((ids.size, *spec.shape), spec.init, spec.dtype)
            array[slots] = opt[name]
            host_opt[name] = array
        host = CacheState(host_rows, host_opt)  # type: ignore[arg-type]  # NumPy, put on device
        return self.blocks.put(host, self.row_sharding)

    def check_state(self, state: Any) -> None:
        """Refuses a device state that is not one of this cache's, before any
        plan: a state of another cache, or one a swap has donated, would
        have the plan's rows swapped into arrays the next step never reads,
        and the rows evicted later written over the host table.

        Checks the type, each array's shape and dtype against this cache's
        capacity, row width and optimizer, and that no array was donated.

        Raises:
          TypeError: ``state`` is not a ``CacheState``.
          ValueError: its arrays are not this cache's, or one was donated.
        """
        self.check_whole()
        if not isinstance(state, CacheState):
            raise TypeError(
                f"table {self.name!r} takes its device state as a CacheState (from init_state, "
                f"prepare or apply, or kept by CachedEmbed), got {type(state).__name__}."
            )
        cfg = self.config
        spec = cfg.optimizer.state_spec(cfg.features)
        opt = state.opt if isinstance(state.opt, Mapping) else {}
        if sorted(opt) != sorted(spec):
            raise ValueError(
                f"the device state's optimizer state holds {sorted(opt)}, but table "
                f"{self.name!r} trains with {type(cfg.optimizer).__name__}, whose state is "
                f"{sorted(spec)}: pass the state this cache returned (one of another cache?)."
            )
        capacity = int(cfg.capacity)
        expected: dict[str, tuple[tuple[int, ...], np.dtype]] = {
            "rows": ((capacity, cfg.features), np.dtype(cfg.row_dtype))
        }
        for name, field in spec.items():
            expected[f"opt[{name!r}]"] = ((capacity, *field.shape), np.dtype(field.dtype))
        arrays = {"rows": state.rows, **{f"opt[{k!r}]": v for k, v in opt.items()}}
        for what, (shape, dtype) in expected.items():
            array = arrays[what]
            got = (tuple(np.shape(array)), np.dtype(getattr(array, "dtype", None)))
            if got != (shape, dtype):
                raise ValueError(
                    f"the device state's array {what} has shape {list(got[0])} and dtype {got[1]}, "
                    f"but table {self.name!r} holds {list(shape)} {dtype} (capacity "
                    f"{cfg.capacity}, {cfg.features} features): pass the state this cache "
                    "returned (one of another cache, or from before a restore onto another "
                    "capacity?)."
                )
            if device_ops.is_donated(array):
                raise ValueError(
                    f"the device state of table {self.name!r} was donated to an earlier "
                    f"swap (its array {what} is deleted): prepare and apply consume the state "
                    "they are given. Pass the state the last call returned (CachedEmbed "
                    "keeps it for you)."
                )

    def restore_failed(self, error: str | None) -> None:
        """A restore failed part-way with ``error`` (the cache holds part of a
        checkpoint), or completed (``None``): until one completes, every
        step, save and export is refused (``check_whole``)."""
        self._damaged = None
        if error is not None:
            self._damaged = (
                f"a restore failed after it had begun to change the cache ({error}), so the cache "
                "holds part of a checkpoint and would read other ids' rows; restore a complete "
                "checkpoint (Checkpointer.restore) before using it."
            )

    def check_whole(self) -> None:
        """Refuses to use a cache that a failed restore left half-restored.

        Raises:
          RuntimeError: a restore failed after it began to change the cache.
        """
        if self._damaged is not None:
            raise RuntimeError(f"table {self.name!r}: {self._damaged}")

    # ------------------------------------------------------------------ step
    def prepare(self, state: CacheState, ids: np.ndarray, *, train: bool = True):
        """Makes the rows of ``ids`` resident and maps the ids to slots.

        Plans the batch, copies its missing rows (and optimizer state) to the
        device, swaps them into the victims' slots (the old state is donated)
        and queues the dirty victims' write-back. The unpipelined step: every
        earlier batch counts as finished. ``jaxcache.prefetch`` runs the host
        phases of ``stage`` (``stage_host``) ahead on a thread, and the
        transfer and ``apply`` in the training loop, instead.

        Args:
          state: the device state (donated: do not use it afterwards).
          ids: integer ids ``[B, ...]``.
          train: the step will update these rows.

        Returns:
          ``(state, lookup)``: the new device state and the ``Lookup``, for
          one step before the next ``prepare``: that call counts this batch
          as finished and may give its slots to other rows (to look ahead,
          use ``jaxcache.prefetch``, which protects the batches in flight).

        Raises:
          RuntimeError: a ``jaxcache.prefetch`` with look-ahead is staging
            this table's batches (close it first).
        """
        if self.pipelines:
            raise RuntimeError(
                f"prepare on table {self.name!r} while a jaxcache.prefetch stages its batches "
                "ahead: the batch would take rows from under the batches staged, or wait for "
                f"them. Close that pipeline first (leave its with-block), then prepare, or "
                f"build it with lookahead=0. {CLOSE_DROPPED}"
            )
        validation.check_not_traced(ids, "ids")
        self.check_state(state)
        with interrupts_held():  # a Ctrl-C waits for the swap
            self.lifecycle.release_all()
            staged = self.stage(ids, train=train)
            return self.apply(state, staged), staged.lookup

    def lookup_in_step(
        self, state: CacheState, ids: jax.Array, *, train: bool
    ) -> tuple[CacheState, Lookup]:
        """The host-callback form of ``EmbeddingCache.prepare``, inside the jitted step.

        An ordered ``io_callback`` obtains the slots of ``ids`` from the host
        (``HostCallbacks.stage``), the swap runs in the step, and a second
        callback lands the evicted rows (``HostCallbacks.write_back``). Both
        Flax shells' ``lookup_ids`` call it.

        Args:
          state: the device state before the step.
          ids: integer ids ``[B, ...]`` (traced).
          train: the step will update these rows.

        Returns:
          ``(state, lookup)``: the state after the swap, and the batch's lookup.
        """
        if isinstance(ids, Lookup):
            raise TypeError(
                "lookup_ids takes a batch's ids, got a Lookup (a batch prefetch or prepare "
                "already planned): pass that Lookup to the module itself, or prefetch with "
                "callback=True to hand the step ids."
            )
        dtype = ids.dtype if hasattr(ids, "dtype") else np.asarray(ids).dtype
        validation.check_id_layout(dtype, np.ndim(ids), "ids")
        self.check_state(state)
        self.callbacks.check()
        self._check_not_raw("lookup_ids (the host-callback form)")
        if self.shard[1] > 1:
            raise ValueError(
                f"lookup_ids (the host-callback form) runs in one process, but this cache's "
                f"mesh spans {self.shard[1]} processes; pass each step the Lookup that "
                "jaxcache.prefetch (or CachedEmbed.prepare) makes instead."
            )
        cfg = self.config
        num_ids = int(np.prod(ids.shape))
        size = self.callbacks.size(num_ids)
        devices = self.devices
        opt_specs = {
            name: jax.ShapeDtypeStruct((size, *spec.shape), spec.dtype)
            for name, spec in cfg.optimizer.state_spec(cfg.features).items()
        }

        def int32(*shape):
            return jax.ShapeDtypeStruct(shape, np.int32)

        # Fixed sizes: V = the list size, K (no overflow), R = n K rows received per device.
        k = self.callbacks.per_destination(size, num_ids)
        shapes = (
            int32(),
            int32(devices, devices, k),  # requests
            int32(0),  # overflow
            int32(*ids.shape),  # inverse
            int32(devices, size),  # owner_slots
            int32(devices, devices * k),  # owner_inverse
            int32(size),
            int32(size),
            jax.ShapeDtypeStruct((size, cfg.features), cfg.row_dtype),
            opt_specs,
        )
        index, *route, evict, fetch, rows, opt = io_callback(
            functools.partial(self.callbacks.stage, train=train), shapes, ids, ordered=True
        )
        state, rows, opt = device_ops.swap(state, evict, fetch, rows, opt)
        io_callback(self.callbacks.write_back, None, index, rows, opt, ordered=True)
        return state, Lookup(  # type: ignore[misc]
            *route,
            table=self.name,
            mesh=self.mesh,
            axis=self.axis,
            train=train,
            cache_id=self.cache_id,
        )

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

    # ------------------------------------------------- the device planner's step
    def dispatch(
        self,
        ids: np.ndarray,
        *,
        train: bool = True,
        released: int | None = None,
    ) -> Dispatched:
        """Dispatches the device plan of a batch (the device planner; the
        thread that dispatches the training steps, in batch order).

        The first phase of a step planned on the device; ``gather`` (any
        thread) reads the plan's lists and gathers the missing rows, then
        ``to_device`` and ``apply`` as for any staged batch.

        Args:
          ids: integer ids ``[B, ...]``.
          train: the step will update these rows.
          released: plan as if only plans up to this index were finished.
        """
        if not isinstance(self.planner, DevicePlanner):
            raise RuntimeError(
                'dispatch plans on the device: build the cache with planner="device", or '
                "stage the batch with stage_host."
            )
        self.check_batch(ids)
        with self.stats.timers.time("plan"):
            # A read-only table (``serving_config``) never trains: no row of
            # it is marked dirty and written back, and no raw id admitted.
            train = bool(train) and self.config.optimizer.trains
            return self.planner.dispatch(ids, train=train, released=released)

    def check_batch(self, ids: np.ndarray) -> None:
        """Raises the error planning ``ids`` would raise before it plans
        (ids of a wrong type or rank, a batch that does not split over the
        devices); either planner checks the values as it plans. A pipeline
        checks every table of a batch before any plans it."""
        self.check_whole()
        if isinstance(self.planner, DevicePlanner):
            self.planner.checked_ids(ids)
        elif self.config.vocabulary is not None:
            validation.check_raw_ids(ids, "ids")
        else:
            validation.check_id_type(ids, "ids")
        self.stager.check_batch(np.shape(ids))

    def gather(self, planned: DeviceStep | Dispatched, *, defer: bool = False) -> DeviceStaged:
        """The host phases of a step planned on the device: the plan's lists
        read back (``collect``), the write-backs its misses wait on landed
        (or deferred to ``to_device``), its evictions queued, and its
        missing rows with their optimizer state gathered into fresh buffers.
        Safe on any thread, in plan order.

        Raises:
          PlanSkipped, ValueError, CapacityError: see ``DevicePlanner.collect``.
        """
        assert isinstance(self.planner, DevicePlanner)
        timers, ledger = self.stats.timers, self.write_backs
        if isinstance(planned, DeviceStep):
            step = planned
        else:
            with timers.time("collect"):
                step = self.planner.collect(planned)
        wanted, at = step.fetch_ids, step.fetch_at
        if step.new_rows.size:  # raw ids given rows now: their first values
            assert self.raw is not None
            with timers.time("write_back"):
                self.raw.first_values(step.new_rows, step.new_ids, self.table, ledger)
        with timers.time("write_back"):
            keep = None
            deferred = None
            if defer:
                ledger.land_ready()
                plans, read_out = ledger.pending(wanted)
                late = plans >= 0
                if late.any():
                    deferred = Deferred(wanted[late], at[late], plans[late], read_out[late])
                    self.stats.deferred_fetches += int(late.sum())
                    keep = ~late
            else:
                ledger.land_for(wanted)
        if step.evict_ids.size:  # after landing: a plan never fetches what it evicts
            ledger.register(step.index, step.evict_ids, step.evict_at)
        with timers.time("gather"):
            rows, opt = fresh_buffers(self.table, len(self.layout.own) * step.moves)
            if keep is not None:
                wanted, at = wanted[keep], at[keep]
            if wanted.size:
                self.table.gather_into(wanted, rows, opt, at)
        self.stats.record(step.stats)
        return DeviceStaged(step, rows, opt, deferred)

    def stage_host(
        self,
        ids: np.ndarray,
        *,
        train: bool = True,
        size: int | None = None,
        released: int | None = None,
        defer: bool = False,
    ) -> HostStaged:
        """``stage`` without the transfer: the padded host arrays of a step.

        Args:
          ids: integer ids ``[B, ...]``.
          train: the step will update these rows.
          size: pad the route to exactly this many rows (the host-callback
            form needs one fixed shape, ``HostCallbacks.size``); a batch with more
            distinct ids is refused. Default: buckets.
          released: plan as if only plans up to this index were finished
            (see ``Planner.plan``). With raw ids the vocabulary also holds
            the rows of the ``DynamicVocabulary.protect`` plans before this
            one, so that which ids it forgets does not depend on how many
            plans are in flight.
          defer: a row to fetch whose write-back from an earlier plan has
            not landed is left for ``to_device`` (or the host-callback form's
            stage callback) to read, once that plan's swap ran, instead of
            waiting here for it.

        Returns:
          A ``HostStaged``.
        """
        self.check_whole()
        if size is not None:
            self._check_not_raw("the host-callback form")
        if isinstance(self.planner, DevicePlanner):
            if size is not None:
                self.callbacks.check()  # refuses: the callback form plans on the host
            dispatched = self.dispatch(ids, train=train, released=released)
            try:
                return self.gather(dispatched, defer=defer)  # type: ignore[return-value]
            except (ValueError, CapacityError):
                self.planner.rollback(dispatched.index)
                raise
        return self.stager.stage(
            ids,
            train=train,
            size=size,
            released=released,
            defer=defer,
        )

    def to_device(self, host: HostStaged | DeviceStaged) -> Staged:
        """Starts the transfer of a host-staged batch (``device_put``, asynchronous;
        on a single CPU device the arrays are handed over as they are).

        Call it after every earlier plan was applied (``apply``): rows it
        fetches that an earlier plan evicted are read from that plan's
        read-out, or from the host table once it landed
        (``HostStaged.deferred``).
        """
        if isinstance(host, DeviceStaged):
            return self._device_staged(host)
        if host.deferred is not None:
            assert host.moves is not None
            self._fetch_deferred(host.deferred, *host.moves[2:])
        with self.stats.timers.time("transfer"):
            moves = (
                None if host.moves is None else self.blocks.transfer(host.moves, self.row_sharding)
            )
            lookup = self._device_lookup(host.route, train=host.train)
        return Staged(host.plan, moves, self.lifecycle.guard(lookup, host.plan.index, self.name))

    def _device_staged(self, host: DeviceStaged) -> Staged:
        """``to_device`` of a batch planned on the device: its rows go over;
        its slot lists and route are the plan's, on the devices already."""
        if host.deferred is not None:
            self._fetch_deferred(host.deferred, host.rows, host.opt)
        assert isinstance(self.planner, DevicePlanner)
        requests, inverse, owner_slots, owner_inverse, fetch_slots, evict_slots, overflow, *more = (
            self.planner.compact(host.plan)
        )
        with self.stats.timers.time("transfer"):
            moves = None
            if host.plan.moves_rows:
                rows, opt = self.blocks.transfer((host.rows, host.opt), self.row_sharding)
                moves = (evict_slots, fetch_slots, rows, opt)
        lookup = Lookup(
            requests,
            overflow,
            inverse,
            owner_slots,
            owner_inverse,
            positions=more[0] if more else None,
            table=self.name,
            mesh=self.mesh,
            axis=self.axis,
            train=host.plan.train,
            cache_id=self.cache_id,
        )
        return Staged(host.plan, moves, self.lifecycle.guard(lookup, host.plan.index, self.name))

    def _device_lookup(self, route: routing.HostRoute, *, train: bool = True) -> Lookup:
        """The device ``Lookup`` of this process's blocks of a route."""
        requests, inverse, owner_slots, owner_inverse = self.blocks.transfer(
            (route.requests, route.inverse, route.owner_slots, route.owner_inverse),
            self.row_sharding,
        )
        overflow = self.blocks.transfer(route.overflow, self.blocks.replicated)
        positions = None
        if route.positions is not None:
            positions = self.blocks.transfer(route.positions, self.row_sharding)
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
            train=train,
            cache_id=self.cache_id,
        )

    def empty_lookup(self, shape: tuple[int, ...]) -> Lookup:
        """A ``Lookup`` of padding ids only, of the ids' ``shape``.

        For building a model before the first batch (``model.init``); it
        touches no cache state and looks up zero rows.

        Examples:
          >>> import jaxcache
          >>> cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, capacity=8))
          >>> lookup = cache.empty_lookup((2, 3))
          >>> jaxcache.device.lookup_rows(cache.init_state().rows, lookup).shape
          (2, 3, 4)
        """
        if not len(shape) or not all(map(is_int, shape)) or min(shape) < 0:
            raise ValueError(
                f"shape={shape!r} is not the shape of a batch of ids: give whole numbers "
                ">= 0 with a leading batch axis, e.g. (batch,) or (batch, bag)."
            )
        self.stager.check_batch(shape)
        n, cl, own = self.devices, self.local_capacity, self._blocks
        rows = shape[0] // n * own  # this process's rows of the batch
        route = routing.HostRoute(
            requests=np.full((own, n, 1), cl, np.int32),
            overflow=np.zeros(0, np.int32),
            inverse=np.full((rows, *shape[1:]), n, np.int32),
            owner_slots=np.full((own, 1), cl, np.int32),
            owner_inverse=np.full((own, n), 1, np.int32),
            overflowed=0,
        )
        return self._device_lookup(route)

    def _fetch_deferred(
        self, deferred: Deferred, fetch_rows: np.ndarray, fetch_opt: dict[str, np.ndarray]
    ) -> None:
        """Copies ``deferred`` rows into a staged batch's fetch rows: from the
        read-out of the plan that evicted each (dispatched, since every
        earlier plan was applied), or from the host table if it landed."""
        ids, at, plans, read_out = deferred
        timers = self.stats.timers
        sources = self.write_backs.sources(sorted(set(plans.tolist())))
        read_outs = [rows for rows, _ in filter(None, sources.values())]
        if read_outs:
            with timers.time("device_wait"):  # the evicting swaps may still be queued
                for rows in read_outs:  # their state comes out of the same program
                    rows.block_until_ready()
        with timers.time("deferred"):
            for plan, source in sources.items():
                mine = plans == plan
                if source is None:  # landed meanwhile: the host table has them
                    self.table.gather_into(ids[mine], fetch_rows, fetch_opt, at[mine])
                else:
                    _copy_read_out(fetch_rows, fetch_opt, at[mine], *source, read_out[mine])

    def apply(self, state: CacheState, staged: Staged) -> CacheState:
        """Device half of a step: the donated swap that brings ``staged`` rows in.

        Call it in plan order, between the training steps, on the thread that
        owns the device state. The victims' rows it reads out are queued for
        write-back.

        Raises:
          ValueError: another cache staged the batch, or it was staged
            before a restore (nothing changed).
          RuntimeError: the batch was applied already (its swap would move
            the rows again, over slots that other rows hold now); or an
            earlier batch was planned and never applied (lost to an error
            before its swap), which stops the cache until a restore.
        """
        self.check_state(state)
        made_by = staged.lookup.cache_id
        if made_by and made_by != self.cache_id:
            raise ValueError(
                f"the staged batch was made by another cache (cache {made_by}) than table "
                f"{self.name!r} (cache {self.cache_id}); apply it to the cache that staged it."
            )
        if staged.plan.index <= self.lifecycle.applied:
            raise RuntimeError(
                f"batch {staged.plan.index} of table {self.name!r} was applied already; apply "
                "each staged batch once, in plan order."
            )
        staged.lookup.check_fresh()  # staged before a restore: refused, nothing changed
        if staged.plan.index > self.lifecycle.applied + 1:
            # The batches between were planned, and their rows counted on the
            # device, but never swapped in (an error between a batch's plan
            # and its swap): applying past them would read other ids' rows.
            lost = range(self.lifecycle.applied + 1, staged.plan.index)
            which = (
                f"batch {lost[0]} was" if len(lost) == 1 else f"batches {lost[0]}..{lost[-1]} were"
            )
            self._damaged = (
                f"{which} planned but never applied (an error came between a batch's plan and "
                "its swap), so the planner counts rows on the device that never reached it, "
                "and lookups would read other ids' rows. Restore a checkpoint "
                "(Checkpointer.restore) before using it."
            )
            self.check_whole()
        self.lifecycle.mark_applied(staged.plan.index)
        if staged.moves is None:
            return state
        with self.stats.timers.time("swap"):
            state, rows, opt = device_ops.swap_blocks(
                state, *staged.moves, mesh=self.mesh, axis=self.axis
            )
        if self._copy_ahead and self.write_backs.expects(staged.plan.index):
            for array in (rows, *opt.values()):
                array.copy_to_host_async()
        self.write_backs.dispatched(staged.plan.index, rows, opt)
        return state

    def land_write_backs(self) -> None:
        """Copies every dispatched write-back into the host table (blocks until ready).

        Raises ``RuntimeError`` if a planned eviction was never applied.
        """
        with self.stats.timers.time("write_back"):
            self.write_backs.land_all()
        unapplied = self.write_backs.unapplied()
        if unapplied:
            raise RuntimeError(
                f"plans {unapplied} evicted rows but were never applied to the device state; "
                "apply every staged batch, in order, before flushing."
            )

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
        self.check_state(state)
        planner = self.planner
        unapplied = self.lifecycle.unapplied()
        if unapplied:
            first, last = unapplied[0], unapplied[-1]
            plans = f"plan {first} was" if first == last else f"plans {first}..{last} were"
            raise RuntimeError(
                f"{plans} staged but not applied to this device state; apply every staged "
                "batch in order (EmbeddingCache.apply, or close the pipeline, which applies "
                "them) before flushing or exporting."
            )
        self.land_write_backs()
        dirty = planner.dirty_rows()
        count = sum(slots.size for slots, _ in dirty)
        if count == 0:
            return
        most = max(slots.size for slots, _ in dirty)
        size = bucket_size(most, max(1, self.config.min_bucket // self.devices))
        blocks = np.full(self._blocks * size, self.local_capacity, np.int32)
        ids, at = [], []
        for block, (slots, block_ids) in enumerate(dirty):
            blocks[block * size : block * size + slots.size] = slots
            ids.append(block_ids)
            at.append(block * size + np.arange(slots.size))
        rows, opt = device_ops.read_blocks(
            state, self.blocks.put(blocks, self.row_sharding), mesh=self.mesh, axis=self.axis
        )
        self._write_back(np.concatenate(ids), np.concatenate(at), rows, opt)
        planner.mark_clean()
        self.stats.record_write_back(count)

    def export(self, state: CacheState) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The full table and optimizer state in id order (copies).

        Flushes first, so the host table is also complete afterwards. When
        the host rows are split over processes, every process must call it
        (a collective) and each receives the whole table.
        """
        self.flush(state)
        table = self.table
        if self.shard[1] == 1:
            return npy_files.read_whole(table)
        return gather_shards(table, self.shard)

    def export_ids(self, state: CacheState) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """The live raw ids with their rows and optimizer state (copies), by
        row; ``CacheConfig(vocabulary=...)`` only. Flushes first; when the
        host rows are split over processes, every process must call it (a
        collective, as ``export``).

        Examples:
          >>> import numpy as np, jaxcache
          >>> cfg = jaxcache.CacheConfig(
          ...     10, 2, capacity=4, vocabulary=jaxcache.DynamicVocabulary(init="zeros")
          ... )
          >>> cache = jaxcache.EmbeddingCache(cfg)
          >>> state, _ = cache.prepare(cache.init_state(), np.array([2**40, 5]))
          >>> ids, rows, _ = cache.export_ids(state)
          >>> ids.tolist(), rows.tolist()
          ([1099511627776, 5], [[0.0, 0.0], [0.0, 0.0]])
        """
        if self.raw is None:
            raise ValueError(
                "export_ids lists raw ids, but this cache's ids are rows; use export()."
            )
        vocabulary = self.vocabulary
        assert vocabulary is not None
        live = vocabulary.live_rows()
        ids = vocabulary.id_of_row[live]
        if self.shard[1] > 1:
            table, state_arrays = self.export(state)
            if isinstance(self.planner, DevicePlanner):  # each process holds its share
                ids, live = gather_entries(ids, live, self.shard, self.config.num_embeddings)
            return ids, table[live], {k: v[live] for k, v in state_arrays.items()}
        self.flush(state)
        rows, opt = self.table.gather(live)
        return ids, rows, opt

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Host state of the cache besides the table, for a checkpoint.

        The planners' directory and policy (``Partitions.state_dict``: this
        process's part), the padded sizes in use (they fix the compiled
        shapes) and the statistics. Take it after ``flush``, with no batch in
        flight.

        Examples:
          >>> import numpy as np, jaxcache
          >>> cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, capacity=8))
          >>> state, _ = cache.prepare(cache.init_state(), np.array([1, 2]))
          >>> cache.flush(state)
          >>> saved = cache.state_dict()
          >>> saved["planner"]["next_index"], saved["stats"]["total"]["misses"]
          (1, 2)
        """
        self.lifecycle.check_idle("saving or restoring the cache")
        state = {
            "planner": self.planner.state_dict(),
            "buckets": self.stager.state_dict(),
            "stats": self.stats.state_dict(),
        }
        if self.raw is not None:
            state["vocabulary"] = self.raw.state_arrays(self.vocabulary)
        return state

    def state_arrays(self) -> dict[str, np.ndarray]:
        """This process's part of the host state besides the table, as flat
        arrays for a checkpoint (``Partitions.state_arrays``); its scalars are
        ``state_meta``'s. Take it after ``flush``, with no batch in flight."""
        self.check_whole()
        self.lifecycle.check_idle("saving or restoring the cache")
        arrays = self.planner.state_arrays()
        if self.raw is not None:
            arrays.update(self.raw.state_arrays(self.vocabulary))
        # Each process's own: its statistics count its devices' shares.
        arrays["stats"] = self.stats.state_array()
        return arrays

    def state_meta(self) -> dict[str, Any]:
        """What ``state_arrays`` leaves out, JSON-serialisable: the planners'
        scalars, the padded sizes and the statistics.

        Examples:
          >>> import numpy as np, jaxcache
          >>> cfg = jaxcache.CacheConfig(100, 4, capacity=8, policy="lru")
          >>> cache = jaxcache.EmbeddingCache(cfg)
          >>> state, _ = cache.prepare(cache.init_state(), np.array([1, 2]))
          >>> cache.flush(state)
          >>> arrays, meta = cache.state_arrays(), cache.state_meta()
          >>> sorted(arrays), sorted(meta)  # doctest: +NORMALIZE_WHITESPACE
          (['planner.id_of_slot', 'planner.last_use', 'stats'],
           ['buckets', 'finished', 'next_index', 'policy', 'stats', 'stats_fields'])
          >>> other = jaxcache.EmbeddingCache(cfg, table=cache.table)
          >>> other.load_state_arrays([arrays], meta)
          >>> other.planner.resident_ids().tolist(), other.stats.total.misses
          ([1, 2], 2)
        """
        return {
            **self.planner.state_meta(),
            "buckets": self.stager.state_dict(),
            "stats": self.stats.state_dict(),
            "stats_fields": CacheStats.state_fields(),  # of each process's "stats" array
        }

    def check_state_arrays(
        self, parts: Sequence[Mapping[str, np.ndarray]], meta: Mapping[str, Any]
    ) -> None:
        """Raises ``ValueError`` unless ``load_state_arrays`` takes ``parts``
        and ``meta`` (``Partitions.check_state_arrays``, and the padded sizes
        and statistics of ``meta``); changes nothing."""
        self.planner.check_state_arrays(parts, meta)
        self._check_vocabulary(parts)
        if meta.get("buckets") is not None:
            Stager.parse_state_dict(meta["buckets"])
        if meta.get("stats") is not None:
            CacheStats.parse_state_dict(meta["stats"])
        self._check_saved_stats(parts, meta)

    @staticmethod
    def _check_saved_stats(
        parts: Sequence[Mapping[str, np.ndarray]], meta: Mapping[str, Any]
    ) -> None:
        """Raises ``ValueError`` unless every process's saved statistics
        (when they were saved) read back."""
        if parts and all("stats" in part for part in parts):
            CacheStats.from_state_arrays(
                [part["stats"] for part in parts], meta.get("stats_fields")
            )

    def _check_vocabulary(self, parts: Sequence[Mapping[str, np.ndarray]]) -> None:
        """Raises ``ValueError`` unless the saved parts hold a vocabulary
        exactly when this cache takes raw ids, one that fits it."""
        saved = any(key.startswith("vocabulary.") for part in parts for key in part)
        if self.raw is not None:
            self.raw.check_state_arrays(parts)
        elif saved:
            raise ValueError(
                "the saved state holds a dynamic vocabulary (raw ids) but this cache takes "
                "rows; build it with the saved CacheConfig(vocabulary=...)."
            )

    def load_state_arrays(
        self,
        parts: Sequence[Mapping[str, np.ndarray]],
        meta: Mapping[str, Any],
        *,
        exact: bool = True,
    ) -> None:
        """Restores what ``state_arrays`` and ``state_meta`` returned; the host
        table must already hold the rows. Build the device state afterwards
        with ``init_state``.

        Args:
          parts: every saving process's ``state_arrays``, in process order.
          meta: the ``state_meta`` saved with them.
          exact: the state comes from a cache of the same capacity, policy,
            optimizer and device count: take its padded sizes and statistics
            too. Otherwise the planners place the saved rows afresh
            (``Partitions.load_state_dict``) and the statistics start at zero.

        Raises:
          ValueError: the state does not fit this table (nothing changed).
        """
        self.lifecycle.check_idle("saving or restoring the cache")
        self._check_vocabulary(parts)  # the planners check their part as they load
        self._check_saved_stats(parts, meta)  # before anything changes
        self.planner.load_state_arrays(parts, meta)
        if self.raw is not None:
            self._load_vocabulary(parts)
        self._restored({**meta, "stats": self._saved_stats(parts, meta)} if exact else {})

    def _saved_stats(
        self, parts: Sequence[Mapping[str, np.ndarray]], meta: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """The statistics this process takes from a checkpoint: its own
        share's on as many processes as saved it, every share's added up in
        one process, zero on another number of several processes, where no
        share is this process's; the first process's from checkpoints that
        kept only those."""
        if not all("stats" in part for part in parts):
            return meta.get("stats")
        index, count = self.shard
        fields = meta.get("stats_fields")
        if len(parts) == count:
            return CacheStats.from_state_arrays([parts[index]["stats"]], fields)
        if count == 1:
            return CacheStats.from_state_arrays([part["stats"] for part in parts], fields)
        return CacheStats(self.config.row_bytes).state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a ``state_dict``; the host table must already hold the rows.

        The planners always (onto any capacity and device count, see
        ``Partitions.load_state_dict``: ``state["planner"]`` is the whole
        cache's, every process's part joined); the padded sizes and the
        statistics when ``state`` has them. Build the device state afterwards
        with ``init_state``.

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
        self.lifecycle.check_idle("saving or restoring the cache")
        if (self.raw is None) != (state.get("vocabulary") is None):
            have = "takes raw ids" if self.raw is not None else "takes rows"
            raise ValueError(
                f"the state and this cache disagree on raw ids (this cache {have}); build it "
                "with the saved CacheConfig(vocabulary=...)."
            )
        if self.raw is not None:
            self.raw.check_state_arrays([state["vocabulary"]])
        self.planner.load_state_dict(state["planner"])
        if self.raw is not None:
            self._load_vocabulary([state["vocabulary"]])
        self._restored(state)

    def _load_vocabulary(self, parts: Sequence[Mapping[str, np.ndarray]]) -> None:
        """Restores the raw ids' vocabulary from every process's share: on
        the host, or with the device planner onto the devices."""
        assert self.raw is not None
        vocabulary = self.raw.load_state_arrays(parts)
        if isinstance(self.planner, DevicePlanner):
            self.planner.load_vocabulary(vocabulary)

    def _restored(self, state: Mapping[str, Any]) -> None:
        """After the planners were restored: the rows come back on the device,
        and the padded sizes and statistics of ``state`` are taken, if any."""
        self.lifecycle.restored()
        if state.get("buckets") is not None:
            self.stager.load_state_dict(state["buckets"])
        if state.get("stats") is not None:
            self.stats.load_state_dict(state["stats"])


def _planner(planner: str | None, platform: str) -> str:
    """The planner a cache uses: ``planner``, else the ``JAXCACHE_PLANNER``
    environment variable, else the backend's default."""
    source = "planner"
    if planner is None:
        planner = os.environ.get("JAXCACHE_PLANNER") or None
        source = "JAXCACHE_PLANNER"
    if planner is None:
        return "host" if platform == "cpu" else "device"
    if planner not in PLANNERS:
        raise ValueError(
            f"{source}={planner!r} is not a planner; use 'device' (plan in jit on the devices) "
            "or 'host' (plan on the host threads), or leave it unset to pick by backend."
        )
    return planner


def _check_dynamic(config: CacheConfig, frequencies: np.ndarray | None, warm: bool | None) -> None:
    """Refuses what a dynamic vocabulary does not support."""
    if config.policy == "frequency" or frequencies is not None or warm:
        raise ValueError(
            "CacheConfig(vocabulary=...) does not support frequencies, warm or "
            "policy='frequency': dataset counts are per row, and rows are given to raw ids as "
            "they come; use the adaptive, lfu or lru policy without them."
        )


def _write_back(
    table: HostTable,
    threads: HostThreads,
    pieces: int,
    ids: np.ndarray,
    at: np.ndarray,
    rows: Any,
    opt: dict,
) -> None:
    """Writes the rows at ``at`` of a read-out of this process's blocks to
    ``ids`` (distinct), in ``pieces`` pieces of about as many rows on the
    host threads (one per partition of this process)."""
    rows = local_data(rows)
    opt = {k: local_data(v) for k, v in opt.items()}
    bounds = np.linspace(0, ids.size, min(pieces, ids.size) + 1).astype(np.int64)
    threads.map(
        lambda lo_hi: table.scatter(
            ids[lo_hi[0] : lo_hi[1]], rows, opt, at=at[lo_hi[0] : lo_hi[1]]
        ),
        list(itertools.pairwise(bounds)),
    )


def _count_wait(stats: CacheStats) -> None:
    stats.write_back_waits += 1


def _copy_read_out(
    fetch_rows: np.ndarray,
    fetch_opt: dict[str, np.ndarray],
    at: np.ndarray,
    rows: jax.Array,
    opt: dict[str, jax.Array],
    read: np.ndarray,
) -> None:
    """Copies rows ``read`` of this process's blocks of a swap's read-out (and
    their state) into a staged batch's fetch rows at ``at``."""
    kernels.copy_rows(fetch_rows, at, local_data(rows), read)
    for name, values in opt.items():
        kernels.copy_rows(fetch_opt[name], at, local_data(values), read)


def _check_table(held: CacheConfig, config: CacheConfig) -> None:
    """Raises unless a table built from ``held`` stores the rows and row
    state that a cache of ``config`` moves: their count, width, dtype, and
    each state array's name, shape and dtype."""

    def layout(cfg: CacheConfig) -> dict[str, Any]:
        spec = cfg.optimizer.state_spec(cfg.features)
        return {
            "num_embeddings": cfg.num_embeddings,
            "features": cfg.features,
            "dtype": np.dtype(cfg.dtype).name,
            "row state": {k: (v.shape, np.dtype(v.dtype).name) for k, v in sorted(spec.items())},
        }

    mine, theirs = layout(config), layout(held)
    for key, value in mine.items():
        if theirs[key] != value:
            raise ValueError(
                f"the table's {key} is {theirs[key]} but the cache's config has {value}; "
                "build the HostTable (or TieredTable) from the same config."
            )
