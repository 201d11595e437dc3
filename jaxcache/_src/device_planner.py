"""The device planner's host side: it dispatches plans and reads back only their lists.

``DevicePlanner`` keeps a cache's directory and policy on the devices
(``device_plan.PlanState``) and plans each batch there in one jitted program
(``device_plan.make_plan``). The host sends the batch's ids and receives
what moves: per device the missed ids (to gather their rows) and the dirty
evicted ones (to write back), a few counters, and for the adaptive policy a
small sample of the batch's ids (its shadow caches learn on the host, as
the host planner's do). Host work per batch is a fixed cost plus the misses
and evictions; it does not grow with the batch's ids.

A plan's padded sizes (``K`` ids per source and owner, ``P`` misses, ``S``
sampled ids) are static shapes, picked from the sizes earlier batches
needed. A batch that needs more fails with nothing changed and is planned
again at sizes that fit (``grow``); so does every batch dispatched after it
(a failed plan makes later ones do nothing until the planner's ``epoch``
moves on). Bad ids and batches that do not fit raise the host planner's
errors, with nothing changed.

The plans are the host planner's: the same distinct ids in the same order,
the same victims (lowest ``(key, slot)`` among the slots no in-flight batch
uses), the same policies. So the two give the same slots, statistics and
results, and a checkpoint of one restores into the other: set-up, warming
and checkpoints go through a host ``Partitions`` (``host_mirror``) and are
copied to the devices (``load_mirror``).

Shape letters: ``n`` devices, ``L`` devices of this process, ``C_l`` slots
per device, ``N_l`` local ids per device.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxcache._src import device_plan, validation
from jaxcache._src.agreement import Agreement
from jaxcache._src.blocks import _LISTING, Blocks, local_data
from jaxcache._src.config import CacheConfig
from jaxcache._src.device_plan import COLUMN, PlanOut, PlanSpec, PlanState
from jaxcache._src.device_vocabulary import VocabSpec, VocabState
from jaxcache._src.hashing import bucket_of
from jaxcache._src.partitions import Partitions
from jaxcache._src.placement import Layout, homed_ids
from jaxcache._src.planner import CapacityError
from jaxcache._src.policies import AdaptivePolicy
from jaxcache._src.stager import bucket_size
from jaxcache._src.stats import StepStats
from jaxcache._src.training_clock import TrainingClock
from jaxcache._src.vocabulary import Vocabulary, distinct_ids
from jaxcache._src.vocabulary_learner import BonusLearner

__all__ = ["DevicePlanner", "DeviceStep", "Dispatched", "PlanSkipped"]

_INT32_MAX = np.iinfo(np.int32).max


class PlanSkipped(Exception):
    """A dispatched plan did nothing because an earlier one failed (the
    planner plans again from the failed one)."""

    def __init__(self, index: int) -> None:
        super().__init__(f"plan {index} was skipped after an earlier plan failed")
        self.index = index


class Dispatched(NamedTuple):
    """A plan dispatched to the devices, its results not read yet.

    Attributes:
      index: the plan's sequence number.
      ids: the batch's ids (host; for error messages).
      out: the program's ``PlanOut`` (device arrays).
      train: the batch updates its rows.
      epoch: the planner's epoch when it was dispatched.
      read: what the host read of it, once (``DevicePlanner._info``, ``_lists``).
    """

    index: int  # type: ignore[assignment]  # the field shadows tuple.index
    ids: np.ndarray
    out: PlanOut
    train: bool
    epoch: int
    read: dict[str, Any]


class DeviceStep(NamedTuple):
    """A batch planned on the devices, with this process's lists on the host.

    Attributes:
      index: the plan's sequence number.
      out: the program's ``PlanOut``: the route (``Lookup``'s arrays) and the
        slot lists the swap takes, on the devices, before ``compact``.
      sizes: ``(K', V', P', R')``: the padded sizes of the step's route
        (``compact``), of each device's moved rows and of its real ids
        (``0``: the batch is not of bags with padding).
      fetch_ids: ``int64``: this process's missed ids (global), device block
        after device block.
      fetch_at: each one's row in the staging blocks ``[L P]``.
      evict_ids: ``int64``: the dirty evicted ids (global).
      evict_at: each one's row in the swap's read-out ``[L P]``.
      stats: the batch's counts on this process's devices.
      moves_rows: whether any device (of any process) moves a row.
      new_rows: ``int64``: with raw ids, the rows (global) of this process's
        devices given to ids now: their first values are due before the
        gather.
      new_ids: ``int64``: those ids.
      train: the batch updates its rows.
    """

    index: int  # type: ignore[assignment]  # the field shadows tuple.index
    out: PlanOut
    sizes: tuple[int, int, int, int]
    fetch_ids: np.ndarray
    fetch_at: np.ndarray
    evict_ids: np.ndarray
    evict_at: np.ndarray
    stats: StepStats
    moves_rows: bool
    new_rows: np.ndarray = np.zeros(0, np.int64)
    new_ids: np.ndarray = np.zeros(0, np.int64)
    train: bool = True

    @property
    def misses(self) -> int:
        """Distinct ids fetched on this process's devices."""
        return self.fetch_ids.size

    @property
    def moves(self) -> int:
        """``P'``, rows each device's swap moves (its lists' padded size)."""
        return self.sizes[2]


class DevicePlanner:
    """A cache's directory and policy on its devices, planned in jit.

    Args:
      config: the table's configuration.
      layout: the homes of ids (one partition per device).
      mesh: the device mesh; its ``axis`` splits the rows and the batch.
      axis: the rows axis.
      frequencies: ``int [N]`` dataset counts (as for ``Partitions``).
      agreement: how processes agree on a value (one process: alone).

    Examples:
      >>> import jax, numpy as np, jaxcache
      >>> cache = jaxcache.EmbeddingCache(
      ...     jaxcache.CacheConfig(100, 4, capacity=8, policy="lru"), planner="device")
      >>> state, lookup = cache.prepare(cache.init_state(), np.array([[3, 5], [5, 7]]))
      >>> cache.planner.resident_ids().tolist(), cache.stats.last.misses
      ([3, 5, 7], 3)
    """

    def __init__(
        self,
        config: CacheConfig,
        layout: Layout,
        mesh: Mesh,
        axis: str,
        *,
        frequencies: np.ndarray | None = None,
        agreement: Agreement | None = None,
        learner: BonusLearner | None = None,
        clock: TrainingClock | None = None,
    ) -> None:
        if layout.split != 1:
            raise ValueError(
                f"partitions_per_device={layout.split} splits a device's share over host "
                "threads, which the device planner does not use; leave it None with "
                'planner="device".'
            )
        n = layout.devices
        self.config = config
        # With raw ids the directory holds the vocabulary's rows, and -1 pads.
        self.rows_config = config
        self.vocabulary_spec: VocabSpec | None = None
        if config.vocabulary is not None:
            self.rows_config = dataclasses.replace(config, padding_id=-1, vocabulary=None)
            self.vocabulary_spec = _vocabulary_spec(
                Vocabulary.of(config.vocabulary, config.num_embeddings),
                layout,
                config.vocabulary.default == "shared",
                None if learner is None else learner.bits,
            )
        self.layout = layout
        self.mesh = mesh
        self.axis = axis
        self.agreement = agreement or Agreement()
        # ``forget="adaptive"``: the vocabulary's bonus learner (``RawIds``'),
        # fed each plan's sample, which every process must see whole.
        self.vocabulary_learner = learner
        self._sample_agreement = self.agreement.sibling("learner")
        self.local_capacity = int(config.capacity) // n
        self.part_capacity = self.local_capacity
        self.local_rows = -(-config.num_embeddings // n)
        if self.local_rows > _INT32_MAX or self.local_capacity > _INT32_MAX:
            raise ValueError(
                f"num_embeddings={config.num_embeddings} over {n} device(s) is more than 2^31 "
                "ids per device, which the device planner's int32 directory cannot hold; use "
                'more devices or planner="host".'
            )
        self._frequencies = frequencies
        self.blocks = Blocks(mesh, axis, layout.processes)
        self._rows = NamedSharding(mesh, PartitionSpec(axis))
        self.next_index = 0
        self.released = -1
        self._finished = -1  # never lowered (see ``Planner._guard``)
        # ``_finished`` before each plan not yet collected was dispatched:
        # ``rollback`` takes back what plans dispatched past a failed one
        # raised it to, so that plan is made again with the bound it would
        # have had in order (the host planner's), not a later one.
        self._finished_before: dict[int, int] = {}
        self.epoch = 0
        # Plans between moves of the adaptive keys' base (a test lowers it).
        self.key_span = device_plan.KEY_SPAN
        self.sizes = (0, 0, 0, 0)  # K', V', P', real ids in use
        self._lock = threading.RLock()  # the state, the sizes and the counters
        self._learned = -1  # the last plan the adaptive policy learned from
        self._dispatched: dict[int, Dispatched] = {}  # not yet learned from (adaptive)
        self._learning = threading.Lock()
        self._admit_finished = -1  # the vocabulary's bound at the latest plan
        # Plans before each plan whose vocabulary rows it holds (raw ids).
        self._protect = 0 if config.vocabulary is None else int(config.vocabulary.protect)
        # Plans to the training steps the vocabulary ages ids by (``RawIds``').
        self.clock = clock if clock is not None else TrainingClock()
        mirror = self._new_mirror()
        self.state: PlanState
        self.learners: list[AdaptivePolicy] = []
        self.load_mirror(mirror)
        if config.vocabulary is not None:
            self.load_vocabulary(Vocabulary.of(config.vocabulary, config.num_embeddings))

    # ---------------------------------------------------------------- status
    @property
    def capacity(self) -> int:
        """``C``, slots over all devices."""
        return int(self.config.capacity)

    @property
    def in_flight(self) -> range:
        """Indices of the plans made and not released yet."""
        return range(self.released + 1, self.next_index)

    def release(self, index: int) -> None:
        """Marks plans up to ``index`` finished: their rows become evictable."""
        with self._lock:
            self.released = max(self.released, int(index))

    def release_all(self) -> None:
        """Marks every plan made so far finished."""
        self.release(self.next_index - 1)

    def _local(self, array: jax.Array, width: int) -> np.ndarray:
        """This process's blocks of a state array, ``[L, width]``."""
        return local_data(array).reshape(len(self.layout.own), width)

    @property
    def id_of_slot(self) -> np.ndarray:
        """``int64 [L C_l]``: the (global) id in each slot of this process's
        devices, ``-1`` for a free slot; a copy."""
        local = self._local(self.state.id_of_slot, self.local_capacity).astype(np.int64)
        residues = np.array([self.layout.residue(d) for d in self.layout.own], np.int64)
        ids = local * self.layout.devices + residues[:, None]
        return np.where(local >= 0, ids, -1).reshape(-1)

    @property
    def last_use(self) -> np.ndarray:
        """``int64 [L C_l]``: the last plan that used each slot; a copy."""
        return local_data(self.state.last_use).astype(np.int64)

    @property
    def dirty(self) -> np.ndarray:
        """``bool [L C_l]``: slots whose row changed since it was fetched; a copy."""
        return local_data(self.state.dirty).copy()

    def resident_ids(self) -> np.ndarray:
        """Ids currently in a slot of this process's devices, in slot order."""
        ids = self.id_of_slot
        return ids[ids >= 0]

    def stale(self) -> bool:
        """Whether a row of a finished plan changed on device (is dirty)."""
        return bool((self.dirty & (self.last_use <= self.released)).any())

    @property
    def nbytes(self) -> int:
        """Device memory of this process's directories and policies."""
        leaves = jax.tree.leaves(self.state)
        return sum(local_data(leaf).nbytes for leaf in leaves)

    def check_invariants(self, table: str) -> None:
        """``Planner.check_invariants`` of every device's partition (their
        host copies), naming ``table``."""
        self.host_mirror().check_invariants(table)

    @property
    def warms(self) -> bool:
        """Whether the policy starts the cache with the hottest rows loaded."""
        return self.config.policy == "frequency" or bool(self.learners and self.learners[0].warms)

    def dirty_rows(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per device of this process: its dirty slots and their rows' ids."""
        dirty = self._local(self.state.dirty, self.local_capacity)
        ids = self.id_of_slot.reshape(dirty.shape)
        out = []
        for block, row_ids in zip(dirty, ids, strict=True):
            slots = np.flatnonzero(block)
            out.append((slots, row_ids[slots]))
        return out

    def mark_clean(self) -> None:
        """Marks the rows of finished plans clean (``Partitions.mark_clean``)."""
        with self._lock:
            args = np.array([self.released], np.int32)
            self.state = device_plan.make_clean(self.mesh, self.axis)(self.state, args)

    # ------------------------------------------------------------ checkpoints
    def policy_state(self) -> dict[str, Any]:
        """What the policies learned (``Partitions.policy_state``)."""
        return self.host_mirror().policy_state()

    def state_dict(self) -> dict[str, Any]:
        """The planner's state for a checkpoint (``Partitions.state_dict``,
        the same format: either planner restores it)."""
        return self.host_mirror().state_dict()

    def state_arrays(self) -> dict[str, np.ndarray]:
        """This process's part of the state as flat arrays (``Partitions.state_arrays``)."""
        return self.host_mirror().state_arrays()

    def state_meta(self) -> dict[str, Any]:
        """The scalars of ``state_arrays`` (``Partitions.state_meta``)."""
        return {
            "next_index": int(self.next_index),
            "finished": int(self._finished),
            "policy": self.config.policy,
        }

    def check_state_arrays(
        self, parts: Sequence[Mapping[str, np.ndarray]], meta: Mapping[str, Any]
    ) -> None:
        """Raises ``ValueError`` unless ``load_state_arrays`` takes them."""
        self._new_mirror().check_state_arrays(parts, meta)

    def load_state_arrays(
        self, parts: Sequence[Mapping[str, np.ndarray]], meta: Mapping[str, Any]
    ) -> None:
        """Restores the ``state_arrays`` of every saving process (either planner's)."""
        self.edit(lambda mirror: mirror.load_state_arrays(parts, meta))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a ``state_dict`` (either planner's), onto any capacity
        and device count (``Partitions.load_state_dict``)."""
        self.edit(lambda mirror: mirror.load_state_dict(state))

    # ----------------------------------------------------------- host mirror
    def _new_mirror(self) -> Partitions:
        return Partitions(self.rows_config, self.layout, frequencies=self._frequencies)

    # ------------------------------------------------------------ vocabulary
    def vocabulary(self) -> Vocabulary:
        """A host copy of the raw ids' vocabulary: the entries of this
        process's devices (all of them with one process). Take it between
        steps."""
        spec, cfg = self.vocabulary_spec, self.config
        assert spec is not None and cfg.vocabulary is not None
        self._learn_until(self.next_index - 1)  # the learner's state goes with it
        with self._lock:
            vocab = Vocabulary.of(cfg.vocabulary, cfg.num_embeddings)
            vocab.bonus = self._vocabulary_bonus()
            state = self.state.vocabulary
            assert state is not None
            blocks = {
                name: None if value is None else self._local(value, value.size // spec.devices)
                for name, value in state._asdict().items()
            }
            residues = [self.layout.residue(d) for d in self.layout.own]
            _vocabulary_from_blocks(vocab, spec, residues, blocks)
            vocab.clock = (self.clock.steps - 1, self._admit_finished)  # the latest step
        return vocab

    def load_vocabulary(self, vocab: Vocabulary) -> None:
        """Puts a host ``Vocabulary``'s entries and sketch onto this process's
        devices (its buckets' share)."""
        spec = self.vocabulary_spec
        assert spec is not None
        residues = [self.layout.residue(d) for d in self.layout.own]
        host = _vocabulary_blocks(vocab, spec, residues)
        with self._lock:
            self.state = self.state._replace(vocabulary=self.blocks.put(host, self._rows))
            self._admit_finished = vocab.clock[1]

    def host_mirror(self) -> Partitions:
        """A host ``Partitions`` holding this planner's state (a copy): for
        checkpoints and checks. Take it between steps."""
        self._learn_until(self.next_index - 1)  # before the lock, which it takes
        with self._lock:
            mirror = self._new_mirror()
            cl, nl = self.local_capacity, self.local_rows
            slot_of_id = self._local(self.state.slot_of_id, nl)
            id_of_slot = self._local(self.state.id_of_slot, cl)
            last_use = self._local(self.state.last_use, cl)
            dirty = self._local(self.state.dirty, cl)
            n = self.layout.devices
            arrays: dict[str, Any] = {
                name: None if value is None else self._local(value, value.size // n)
                for name, value in self.state._asdict().items()
                if name in ("per_id", "keys", "slot_prior")
            }
            scalars = self._local(self.state.scalars, 5).astype(np.int64)
            for b, planner in enumerate(mirror.planners):
                # A device whose ids are fewer than its slots has a host
                # partition of one slot per id; its other slots stay free.
                rows, slots = planner.slot_of_id.size, planner.capacity
                planner.slot_of_id[:] = slot_of_id[b, :rows]
                planner.id_of_slot[:] = id_of_slot[b, :slots]
                planner.last_use[:] = last_use[b, :slots]
                planner.dirty[:] = dirty[b, :slots]
                planner.next_index = self.next_index
                planner.released = self.released
                planner._finished = self._finished
                policy: Any = planner.policy
                if self.config.policy in ("lfu", "frequency"):
                    policy.counts[:] = arrays["per_id"][b, :rows]
                    policy.slot_counts[:] = arrays["keys"][b, :slots]
                elif self.config.policy == "adaptive":
                    learner = self.learners[b]
                    learner.counts[:] = arrays["per_id"][b, :rows]
                    # The host's keys are the device's moved up by 2^31 (all
                    # positive), its offset relative to plan 0, not the base.
                    _, _, bonus, offset, base = scalars[b]
                    learner.keys[:] = arrays["keys"][b, :slots].astype(np.int64) + (1 << 31)
                    offset += (1 << 31) - (256 * base if bonus >= 0 else 0)
                    if learner.warms:
                        learner.slot_prior[:] = arrays["slot_prior"][b, :slots]
                    learner.scalars[:] = [learner.BONUSES.index(int(bonus)), offset]
                    learner._inserted.clear()
                    planner.policy = learner
            return mirror

    def load_mirror(self, mirror: Partitions) -> None:
        """Takes a host ``Partitions``' state (its directory, recency, dirty
        bits and policies) onto the devices; the adaptive policies' learners
        are taken over, not copied."""
        cl, nl = self.local_capacity, self.local_rows
        policy = self.config.policy
        own = len(self.layout.own)

        def blocks(width: int, fill: Any, dtype: Any, values) -> np.ndarray:
            out = np.full((own, width), fill, dtype)
            for b, value in enumerate(values):
                if value is not None:
                    out[b, : len(value)] = _int32(value) if dtype == np.int32 else value
            return out.reshape(-1)

        planners = mirror.planners
        with self._lock:
            per_id = prior = keys = slot_prior = None
            priorities = [p.policy.priorities(p) for p in planners]
            if policy in ("lfu", "frequency", "adaptive"):
                policies: list[Any] = [p.policy for p in planners]
                per_id = blocks(nl, 0, np.int32, [p.counts for p in policies])
            learners: list[AdaptivePolicy] = []
            bonus = np.zeros(own, np.int32)
            base = max(0, mirror.next_index - self.key_span)
            if policy == "adaptive":
                learners = [p.policy for p in planners]  # type: ignore[misc]
                if learners[0].warms:
                    prior = blocks(nl, 0, np.int32, [p.prior for p in learners])
                    slot_prior = blocks(cl, 0, np.int32, [p.slot_prior for p in learners])
                bonus[:] = [p.bonus for p in learners]
                # Keys relative to the base plan, less the offset (``KEY_SPAN``).
                priorities = [
                    np.clip(
                        key - int(p.scalars[1]) - (256 * base if p.bonus >= 0 else 0),
                        device_plan.KEY_FLOOR,
                        device_plan.KEY_CEIL,
                    )
                    for key, p in zip(priorities, learners, strict=True)
                ]
            if policy in ("lfu", "frequency", "adaptive"):
                keys = blocks(cl, 0, np.int32, priorities)
            scalars = np.zeros((own, 5), np.int32)
            scalars[:, 0] = self.epoch
            scalars[:, 2] = bonus
            scalars[:, 4] = base
            host: dict[str, Any] = {  # NumPy blocks of this process's devices
                "slot_of_id": blocks(nl, -1, np.int32, [p.slot_of_id for p in planners]),
                "id_of_slot": blocks(cl, -1, np.int32, [p.id_of_slot for p in planners]),
                "last_use": blocks(cl, -1, np.int32, [p.last_use for p in planners]),
                "dirty": blocks(cl, False, bool, [p.dirty for p in planners]),
                "per_id": per_id,
                "prior": prior,
                "keys": keys,
                "slot_prior": slot_prior,
                "scalars": scalars.reshape(-1),
            }
            vocabulary = getattr(self, "state", None)
            self.state = self.blocks.put(PlanState(**host), self._rows)
            if vocabulary is not None:
                self.state = self.state._replace(vocabulary=vocabulary.vocabulary)
            self.learners = learners
            self.next_index = mirror.next_index
            self.released = mirror.released
            self._finished = max(p._finished for p in planners)
            self._learned = self.next_index - 1
            self._dispatched.clear()

    def edit(self, change) -> None:
        """Applies ``change`` (a function of a host ``Partitions``) to this
        planner's state: warming, restoring. ``O(N)``: at set-up only."""
        mirror = self.host_mirror()
        with self._lock:
            change(mirror)
            self.load_mirror(mirror)

    def warm(self, ids: np.ndarray) -> None:
        """Places ``ids`` into free slots of their homes (``Partitions.warm``)."""
        self.edit(lambda mirror: mirror.warm(ids))

    def warm_hottest(self, frequencies: np.ndarray) -> None:
        """Fills every device's free slots with its hottest ids."""
        self.edit(lambda mirror: mirror.warm_hottest(frequencies))

    # ------------------------------------------------------------------ plan
    def compact(self, step: DeviceStep) -> tuple[jax.Array, ...]:
        """``step``'s route and swap lists cut to its padded sizes (on the
        thread that dispatches to the devices): ``(requests, inverse,
        owner_slots, owner_inverse, fetch_slots, evict_slots, overflow)``,
        and ``positions`` for a batch of bags with padding."""
        out = step.out
        return device_plan.make_compact(self.mesh, self.axis, *step.sizes)(
            out.requests,
            out.inverse,
            out.owner_slots,
            out.owner_inverse,
            out.fetch_slots,
            out.evict_slots,
            out.overflow,
        )

    def _spec(self, wide: bool, slice_ids: int, train: bool) -> PlanSpec:
        cfg, layout = self.config, self.layout
        vocabulary = self.vocabulary_spec
        return PlanSpec(
            devices=layout.devices,
            processes=layout.processes,
            num_embeddings=cfg.num_embeddings,
            local_rows=self.local_rows,
            local_capacity=self.local_capacity,
            policy=cfg.policy,
            prior=bool(self.learners and self.learners[0].warms),
            # The smallest: its sample holds every learner's (``_learn_until``).
            sample_bits=min((learner.bits for learner in self.learners), default=0),
            pad=cfg.padding_id,
            wide=wide,
            slice_ids=slice_ids,
            key_span=self.key_span,
            vocabulary=vocabulary,
            admits_all=self._admits_all(train),
        )

    def _admits_all(self, train: bool) -> bool:
        """Every id of a batch gets a row, or the batch is refused: ids are
        rows, or raw ids of a training batch admitted on first sight."""
        spec = self.vocabulary_spec
        return spec is None or (train and spec.admit_after == 1)

    def dispatch(
        self,
        ids: np.ndarray,
        *,
        train: bool = True,
        released: int | None = None,
    ) -> Dispatched:
        """Dispatches the plan of a batch (asynchronous; ``collect`` reads it).

        Args:
          ids: the batch's integer ids ``[B, ...]`` (the whole batch; with
            several processes, the same in every process).
          train: the batch will update its rows.
          released: plan as if only the plans up to this index were finished
            (at most ``self.released``; default: all released). With raw
            ids the vocabulary also holds the rows of the
            ``DynamicVocabulary.protect`` plans before this one.
        """
        array = self.checked_ids(ids)
        words, wide = _id_words(array)
        n = self.layout.devices
        share = array.shape[0] // n
        first = self.layout.own[0] * share
        mine = words[first : first + share * len(self.layout.own)]
        if self._learns:  # before the lock: a learner takes it to re-key
            self._learn_until(self.next_index - 1)
        with self._lock:
            index = self.next_index
            finished = self.released if released is None else min(int(released), self.released)
            self._finished_before[index] = self._finished
            self._finished = max(self._finished, finished)
            step = self.clock.plan(index, train)
            admit = min(self.clock.finished(finished), step - 1 - self._protect)
            program = device_plan.make_plan(
                self._spec(wide, array.size // n, train), self.mesh, self.axis
            )
            bonus = self._vocabulary_bonus()
            args = np.array(
                [index, self._finished, int(train), self.epoch, admit, bonus, step], np.int32
            )
            # A fresh copy: a transfer may alias host memory (the CPU backend),
            # and the caller may reuse its batch's buffer before the plan runs.
            # On one CPU device the program takes the host arrays as they are.
            ids_device = self.blocks.transfer(np.array(mine), self._rows)
            args_device = self.blocks.transfer(args, self.blocks.replicated)
            self.state, out = program(self.state, ids_device, args_device)
            self.next_index = index + 1
            read = {"admit": admit, "bonus": bonus, "step": step}
            dispatched = Dispatched(index, array, out, train, self.epoch, read)
            if self._learns:
                self._dispatched[index] = dispatched
        if not self.blocks.host_is_device:
            out.info.copy_to_host_async()
        return dispatched

    def checked_ids(self, ids: np.ndarray) -> np.ndarray:
        """``ids`` as a NumPy integer array, or the host's error (type,
        rank, raw ids past int64); their values are checked in the plan."""
        if self.vocabulary_spec is None:
            return validation.check_id_type(ids, "ids")
        return validation.check_raw_ids(ids, "ids")  # they travel as two words

    def collect(self, dispatched: Dispatched) -> DeviceStep:
        """Reads a dispatched plan's counts and this process's lists (blocks
        until the plan ran), and picks the padded sizes of its step.

        Raises:
          PlanSkipped: an earlier plan failed, so this one did nothing.
          ValueError, CapacityError: the batch's ids are bad or do not fit;
            nothing changed (the dispatching thread then calls ``rollback``).
        """
        out = dispatched.out
        info = self._info(dispatched)
        status = int(info[0, COLUMN["status"]])
        if status:
            self._failed(dispatched, info, status)
        if self._learns:
            self._learn_until(dispatched.index)
        with self._lock:
            self._finished_before.pop(dispatched.index, None)
            self._admit_finished = max(self._admit_finished, dispatched.read["admit"])
            minimum = max(1, self.config.min_bucket // self.layout.devices)
            needs = [int(info[0, COLUMN[f"need_{x}"]]) for x in "kvpr"]
            k, v, p, r = (
                bucket_size(need, minimum, previous)
                for need, previous in zip(needs, self.sizes, strict=True)
            )
            if self.layout.devices == 1:
                # The source is the owner: its ranks are the owner's rows
                # (and the shared row's entry is past them).
                v = max(k, v) if out.overflow.shape[1] else k
            self.sizes = (k, v, p, r)
            # Never past the plan's own sizes (a batch smaller than the bucket).
            k = min(k, out.requests.shape[2])
            v = min(v, out.owner_slots.shape[1])
            p = min(p, out.fetch_slots.shape[0] // self.layout.devices)
            share = out.inverse.size // self.layout.devices
            # Pooling reads the real ids of bags with padding only (``Lookup.positions``).
            bags = self.config.padding_id is not None and out.inverse.ndim >= 2
            r = min(r, share) if bags else 0
        misses = info[:, COLUMN["misses"]]
        written = info[:, COLUMN["written"]]
        lists = self._lists(dispatched)
        fetch_ids, fetch_at, evict_ids, evict_at = [], [], [], []
        new_rows, new_ids = [], []
        n = self.layout.devices
        for b, device in enumerate(self.layout.own):
            residue = self.layout.residue(device)
            fetched, evicted, _, _, given, low, high = lists[b][:7]
            fetch_ids.append(fetched.astype(np.int64) * n + residue)
            fetch_at.append(b * p + np.arange(misses[b]))
            evict_ids.append(evicted.astype(np.int64) * n + residue)
            evict_at.append(b * p + np.arange(written[b]))
            new_rows.append(given.astype(np.int64) * n + residue)
            words = np.stack([low, high], axis=1) if np.little_endian else np.stack([high, low], 1)
            new_ids.append(np.ascontiguousarray(words, np.int32).view(np.int64).reshape(-1))
        total = info.sum(0)
        stats = StepStats(
            lookups=int(total[COLUMN["lookups"]]),
            distinct=int(total[COLUMN["distinct"]]),
            hits=int(total[COLUMN["hits"]]),
            misses=int(total[COLUMN["misses"]]),
            access_hits=int(total[COLUMN["access_hits"]]),
            evictions=int(total[COLUMN["evictions"]]),
            rows_to_device=int(total[COLUMN["misses"]]),
            rows_to_host=int(total[COLUMN["written"]]),
            new_ids=int(total[COLUMN["new_ids"]]),
            forgotten_ids=int(total[COLUMN["forgotten_ids"]]),
            refused_lookups=int(total[COLUMN["refused_lookups"]]),
        )
        return DeviceStep(
            dispatched.index,
            out,
            (k, v, p, r),
            np.concatenate(fetch_ids),
            np.concatenate(fetch_at),
            np.concatenate(evict_ids),
            np.concatenate(evict_at),
            stats,
            bool(info[0, COLUMN["need_p"]]),
            np.concatenate(new_rows),
            np.concatenate(new_ids),
            dispatched.train,
        )

    def _info(self, dispatched: Dispatched) -> np.ndarray:
        """A dispatched plan's counts, ``[L, len(INFO)]`` (waits for the plan)."""
        read = dispatched.read
        if "info" not in read:
            info = local_data(dispatched.out.info)
            read["info"] = info.reshape(len(self.layout.own), len(device_plan.INFO))
        return read["info"]

    def _lists(self, dispatched: Dispatched) -> list[list[np.ndarray]]:
        """Each own device's lists (``PlanOut.lists``): its fetched local ids,
        the local ids of its dirty evictions, the adaptive sample and the
        sample's lookups, the rows given to raw ids now and those ids' low
        and high words, and the bonus learner's sampled raw ids (low and
        high words) and their lookups; one read from each device."""
        read = dispatched.read
        if "lists" not in read:
            info = self._info(dispatched)
            columns = ("misses", "written", "sampled", "new_ids", "learner_sampled")
            m, w, s, a, q = (info[:, COLUMN[c]] for c in columns)
            heads = _heads(dispatched.out.lists, m + w + 2 * s + 3 * a + 3 * q)
            read["lists"] = [
                np.split(head, np.cumsum([m[b], w[b], s[b], s[b], a[b], a[b], a[b], q[b], q[b]]))
                for b, head in enumerate(heads)
            ]
        return read["lists"]

    def rollback(self, index: int) -> None:
        """After plan ``index`` failed, the next plan is ``index`` again, in a
        new epoch (plans dispatched after the failure did nothing). Called
        by the thread that dispatches, before it dispatches again."""
        with self._lock:
            self.epoch += 1
            self.next_index = index
            self.clock.rollback(index)
            if index in self._finished_before:
                self._finished = self._finished_before[index]
            for later in [i for i in self._finished_before if i >= index]:
                del self._finished_before[later]
            for later in [i for i in self._dispatched if i >= index]:
                del self._dispatched[later]

    def _failed(self, dispatched: Dispatched, info: np.ndarray, status: int) -> None:
        """Raises what a failed plan's status says (nothing changed)."""
        index = dispatched.index
        if status & device_plan.SKIPPED:
            raise PlanSkipped(index)
        if status & device_plan.BAD_ID:
            self._raise_bad_ids(dispatched.ids)
        if self.vocabulary_spec is not None and status & (
            device_plan.VOCABULARY_FULL | device_plan.TOO_MANY
        ):
            # The vocabulary's refusal first, as on the host, where it admits
            # a batch's ids before the planners see their rows (ids beyond a
            # source's sending room never reached it here).
            self._vocabulary_full(dispatched, status)
        if status & device_plan.TOO_MANY:
            raise self._too_many(dispatched, info)
        raise self._no_room(dispatched, info)

    def _too_many(self, dispatched: Dispatched, info: np.ndarray) -> CapacityError:
        """The error of a batch with more distinct rows homed on a device
        than it has slots. Where every id gets a row, its ids are counted on
        the host, ``O(ids)`` on this path only, as the plan's counts stop at
        what each source could send (every process names the same device);
        else each source sent its whole slice, and the plan's counts of
        rows are exact."""
        n = self.layout.devices
        if self._admits_all(dispatched.train):
            unique, _, _ = distinct_ids(dispatched.ids, self.config.padding_id)
            homed = unique
            spec = self.vocabulary_spec
            if spec is not None:  # a raw id's rows are its bucket's
                homed = bucket_of(unique, np.uint32(spec.salt), spec.buckets)
            per_residue = np.bincount(homed % n, minlength=n)
            residue = int(np.argmax(per_residue))
            count = int(per_residue[residue])
            device = int(self.layout.device_of(np.array(residue)))
        else:
            distinct = info[:, COLUMN["distinct"]]
            count = int(distinct.max())
            device = self.layout.own[int(np.argmax(distinct))]
            residue = self.layout.residue(device)
        error = CapacityError(
            f"the batch has {count} distinct ids homed on device {device} ("
            f"{homed_ids(self.config, n, residue)}) but each device holds "
            f"{self.local_capacity} rows; raise capacity to at least {n * count} or use "
            "smaller batches."
            if n > 1
            else f"the batch has {count} distinct ids but capacity is {self.local_capacity} "
            f"rows; raise capacity to at least {count} or use smaller batches."
        )
        error.distinct = count
        return error

    def _vocabulary_full(self, dispatched: Dispatched, status: int) -> None:
        """Raises the error of a batch a vocabulary bucket cannot take: the
        host copy of the vocabulary (as it was: the plan failed) admits the
        batch by the same rules and says which bucket and why. ``O(R)``, on
        this path only. Returns if the vocabulary takes the batch."""
        cfg = self.config
        unique, _, counts = distinct_ids(dispatched.ids, cfg.padding_id)
        vocab = self.vocabulary()
        vocab.bonus = dispatched.read["bonus"]  # the bonus the plan forgot by
        error: CapacityError | None = None
        try:
            vocab.admit(
                unique,
                counts,
                step=dispatched.read["step"],
                finished=dispatched.read["admit"],
                new=dispatched.train,
                distinct=True,
            )
        except CapacityError as refused:
            error = refused
            error.fits_after = self.clock.plan_of(error.fits_after)
        never = 1 << 62  # the agreed value of "no release makes room"
        after = -1 if error is None else never if error.fits_after is None else error.fits_after
        after = int(self.agreement.max(dispatched.index, np.array([after]))[0])
        if error is None:
            if not status & device_plan.VOCABULARY_FULL:
                return
            assert after >= 0, "the device vocabulary refused a batch its host copy takes"
            # A bucket of another process's devices.
            error = CapacityError("a vocabulary bucket of another process is full for the batch.")
            error.rows_needed = error.rows_available = 0
        error.fits_after = None if after >= never else after
        raise error

    def _raise_bad_ids(self, ids: np.ndarray) -> None:
        cfg = self.config
        validation.check_ids(ids, cfg.num_embeddings, cfg.padding_id, "ids")
        if self.layout.processes > 1:  # another process's slice of the batch
            raise ValueError(
                f"another process's batch holds an id outside [0, {cfg.num_embeddings}) "
                "(its error names it); every process must pass the same global batch. "
                "Nothing was planned in any process."
            )
        raise AssertionError("the device plan found a bad id that check_ids did not")

    def _no_room(self, dispatched: Dispatched, info: np.ndarray) -> CapacityError:
        """The error of a batch whose misses do not fit next to in-flight rows,
        with ``fits_after`` (``Planner._no_room``) over this process's devices."""
        cl = self.local_capacity
        with self._lock:  # unchanged by the failed plan, and not donated meanwhile
            last_use = self._local(self.state.last_use, cl)
        hit_slots = local_data(dispatched.out.hit_slots).reshape(len(self.layout.own), -1)
        worst, message = -1, ""
        for b, device in enumerate(self.layout.own):
            hits = hit_slots[b][hit_slots[b] >= 0]
            # A raw id given a row that is resident with its old id's values
            # keeps the slot (fetched again into it): one of the hits, as on
            # the host, not one of the misses that need a victim, although
            # the "misses" column counts every fetch.
            again = hits.size - int(info[b, COLUMN["hits"]])
            misses = int(info[b, COLUMN["misses"]]) - again
            available = int(info[b, COLUMN["available"]])
            if misses <= available:
                continue
            room = cl - hits.size - misses
            others = np.delete(last_use[b].astype(np.int64), hits)
            fits_after = int(-np.partition(-others, room)[room])
            if fits_after > worst:
                worst = fits_after
                where = f"device {device}: " if self.layout.devices > 1 else ""
                message = (
                    f"{where}the batch needs {misses} new rows but only {available} of {cl} "
                    "slots are free of in-flight batches; raise capacity, use smaller batches "
                    "or a shorter look-ahead."
                )
        worst = int(self.agreement.max(dispatched.index, np.array([worst]))[0])
        error = CapacityError(message or "another process's device has no room for the batch.")
        error.fits_after = worst
        return error

    # -------------------------------------------------------------- learning
    @property
    def _learns(self) -> bool:
        """Whether plans teach a learner: the adaptive policy's, the vocabulary's."""
        return bool(self.learners) or self.vocabulary_learner is not None

    def _vocabulary_bonus(self) -> int:
        """The bonus the next plan's vocabulary forgets by (learned up to
        the plan before it, by ``_learn_until``)."""
        learner, spec = self.vocabulary_learner, self.config.vocabulary
        if learner is not None:
            return learner.bonus
        return 0 if spec is None else int(spec.bonus)

    def _learn_vocabulary(self, dispatched: Dispatched, lists: list[list[np.ndarray]]) -> None:
        """The vocabulary's bonus learner learns from a plan's sample: every
        device's, of every process."""
        index = dispatched.index
        assert self.vocabulary_learner is not None
        # [3, Q]: low words, high words and lookups of this process's devices.
        mine = np.stack([np.concatenate([x[c] for x in lists]) for c in (7, 8, 9)])
        parts = self._sample_agreement.gather(index, mine)
        low, high, counts = np.concatenate(parts, axis=1).astype(np.int64)
        ids = (low & 0xFFFFFFFF) | (high << 32)
        self.vocabulary_learner.offer(ids, counts, dispatched.read["step"], sampled=True)
        self.vocabulary_learner.settle()

    def _learn_until(self, index: int) -> None:
        """The adaptive policy learns from every plan up to ``index`` not yet
        learned, in order (blocking until each ran), and the devices take its
        choice of bonus before the next plan. A failed plan stops it."""
        if not self._learns:
            return
        with self._learning:
            bits = min((learner.bits for learner in self.learners), default=0)
            while self._learned < index:
                dispatched = self._dispatched.get(self._learned + 1)
                if dispatched is None:
                    return
                info = self._info(dispatched)
                if int(info[0, COLUMN["status"]]):
                    return
                lists = self._lists(dispatched)
                if self.vocabulary_learner is not None and dispatched.train:
                    self._learn_vocabulary(dispatched, lists)
                choices = []
                for b, learner in enumerate(self.learners):
                    sample, counts = lists[b][2:4]
                    sample = sample.astype(np.int64)
                    learner.counts[sample] = counts
                    if learner.bits > bits:  # a smaller sample than the plan's
                        sample = sample[_sampled(sample, learner.bits)]
                    sample.sort()
                    choices.append(learner.learn(sample, dispatched.index))
                del self._dispatched[dispatched.index]
                self._learned = dispatched.index
                if any(
                    c != int(learner.scalars[0])
                    for c, learner in zip(choices, self.learners, strict=True)
                ):
                    for c, learner in zip(choices, self.learners, strict=True):
                        learner.scalars[0] = c
                    bonus = np.array([learner.bonus for learner in self.learners], np.int32)
                    with self._lock:
                        rekey = device_plan.make_rekey(self.mesh, self.axis, self.key_span)
                        self.state = rekey(self.state, self.blocks.put(bonus, self._rows))


def _heads(array: jax.Array, counts: np.ndarray) -> list[np.ndarray]:
    """The first ``counts[b]`` entries of each of this process's blocks of a
    row-split 1-D device array. Only those cross to the host: a block is
    cut on its device first (to a power of two, so compiled slices repeat),
    unless it is host memory already (the CPU backend)."""
    if isinstance(array, np.ndarray) or next(iter(array.devices())).platform == "cpu":
        data = local_data(array).reshape(len(counts), -1)
        return [data[b, : int(c)] for b, c in enumerate(counts)]
    with _LISTING:
        shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)
    out = []
    for shard, count in zip(shards, counts, strict=True):
        size = min(shard.data.shape[0], bucket_size(int(count), 8))
        out.append(np.asarray(shard.data[:size])[: int(count)])
    return out


def _sampled(ids: np.ndarray, bits: int) -> np.ndarray:
    """Whether each id is in an adaptive policy's sample of ``bits``
    (``kernels._sampled``, vectorized)."""
    product = ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)  # wraps, as int64 does
    return (product >> np.uint64(64 - bits)) == 0


def _int32(values: np.ndarray) -> np.ndarray:
    """``values`` as int32, saturated (counts and keys past 2^31 - 1)."""
    return np.clip(np.asarray(values), -1 << 31, _INT32_MAX).astype(np.int32)


def _id_words(array: np.ndarray) -> tuple[np.ndarray, bool]:
    """The ids as the device planner takes them, and whether they are wide:
    int32 as they are; int64 as two int32 words each (a view of a
    contiguous array, no copy), so that a value beyond int32 is found on the
    device rather than truncated on transfer; other integer types (rare)
    converted to int64 first."""
    if array.dtype == np.int32:
        return array, False
    if array.dtype != np.int64:
        if array.dtype.kind == "u" and array.size and int(array.max()) > np.iinfo(np.int64).max:
            array = np.where(array > np.iinfo(np.int64).max, np.iinfo(np.int64).max, array)
        array = array.astype(np.int64)
    words = np.ascontiguousarray(array).view(np.int32).reshape(*array.shape, 2)
    return (words if np.little_endian else words[..., ::-1]), True


def _vocabulary_spec(
    vocab: Vocabulary, layout: Layout, shared: bool = False, learner_bits: int | None = None
) -> VocabSpec:
    """The device vocabulary of ``vocab``'s rules over ``layout``'s devices
    (``shared``: with the shared row past its rows; ``learner_bits``: the
    bonus learner's sample, ``forget="adaptive"``)."""
    n = layout.devices
    if vocab.buckets % n:
        raise ValueError(
            f"a dynamic vocabulary of {vocab.rows} rows in buckets of {vocab.ways} ways has "
            f"{vocab.buckets} buckets, which the device planner cannot split over {n} "
            f"devices; use DynamicVocabulary(ways={max(1, vocab.rows // n)}) or fewer, or "
            'planner="host".'
        )
    return VocabSpec(
        rows=vocab.rows,
        buckets=vocab.buckets,
        ways=-(-vocab.rows // vocab.buckets),
        devices=n,
        admit_after=vocab.admit_after,
        forget=vocab.forget,
        ttl=vocab.ttl,
        columns=vocab.sketch_columns,
        salt=int(vocab.salt),
        salts=tuple(int(x) for x in vocab.sketch_salts),
        shared=shared,
        learner_bits=learner_bits,
    )


def _entries(spec: VocabSpec, residue: int) -> np.ndarray:
    """``int64 [B_l W]``: the host row of each entry of a device of
    ``residue`` (bucket ``j n + r``, way ``w``: row ``b + B w``), or ``-1``
    for ways past its bucket's rows."""
    local = np.arange(spec.local_buckets, dtype=np.int64)[:, None]
    ways = np.arange(spec.ways, dtype=np.int64)[None, :]
    rows = local * spec.devices + residue + spec.buckets * ways
    return np.where(rows < spec.rows, rows, -1).reshape(-1)


def _cells(spec: VocabSpec, residue: int) -> np.ndarray:
    """``int64 [B_l S]``: the host sketch column of each local cell of a
    device of ``residue`` (local cell ``j + B_l c``: column ``b + B c``)."""
    columns = np.arange(spec.columns, dtype=np.int64)[:, None]
    local = np.arange(spec.local_buckets, dtype=np.int64)[None, :]
    return (local * spec.devices + residue + spec.buckets * columns).reshape(-1)


def _vocabulary_blocks(vocab: Vocabulary, spec: VocabSpec, residues: list[int]) -> VocabState:
    """The device blocks (NumPy, one after another) of ``vocab`` for the
    devices of ``residues``."""
    low, high, last, uses, sketch = [], [], [], [], []
    for residue in residues:
        rows = _entries(spec, residue)
        held = np.where(rows >= 0, vocab.last_use[np.maximum(rows, 0)], -1)
        held[rows < 0] = -1
        ids = np.where(held >= 0, vocab.id_of_row[np.maximum(rows, 0)], 0)
        words = np.ascontiguousarray(ids, np.int64).view(np.int32).reshape(-1, 2)
        if not np.little_endian:
            words = words[:, ::-1]
        low.append(words[:, 0])
        high.append(words[:, 1])
        last.append(_int32(held))
        uses.append(_int32(np.where(held >= 0, vocab.counts[np.maximum(rows, 0)], 0)))
        if spec.columns:
            sketch.append(vocab.sketch[:, _cells(spec, residue)].reshape(-1))
    join = np.concatenate
    blocks: dict[str, Any] = {
        "key_lo": join(low),
        "key_hi": join(high),
        "last": join(last),
        "uses": join(uses) if spec.counts_uses else None,
        "sketch": join(sketch).astype(np.int32) if spec.columns else None,
    }
    return VocabState(**blocks)


def _vocabulary_from_blocks(
    vocab: Vocabulary, spec: VocabSpec, residues: list[int], blocks: dict[str, Any]
) -> None:
    """Fills an empty host ``vocab`` from the device blocks ``[L, ...]`` of
    the devices of ``residues``."""
    ids, rows, last_use, counts = [], [], [], []
    for b, residue in enumerate(residues):
        entry = _entries(spec, residue)
        last = blocks["last"][b].astype(np.int64)
        live = (entry >= 0) & (last >= 0)
        words = np.stack([blocks["key_lo"][b], blocks["key_hi"][b]], axis=1)
        if not np.little_endian:
            words = words[:, ::-1]
        ids.append(np.ascontiguousarray(words, np.int32).view(np.int64).reshape(-1)[live])
        rows.append(entry[live])
        last_use.append(last[live])
        if blocks["uses"] is not None:
            counts.append(blocks["uses"][b][live].astype(np.int64))
        else:
            counts.append(np.zeros(int(live.sum()), np.int64))
        if spec.columns:
            cells = blocks["sketch"][b].reshape(vocab.sketch.shape[0], -1)
            vocab.sketch[:, _cells(spec, residue)] = cells
    sketch = vocab.sketch.copy()
    vocab.load_state_dict(
        {
            "ids": np.concatenate(ids),
            "rows": np.concatenate(rows),
            "last_use": np.concatenate(last_use),
            "counts": np.concatenate(counts),
            "sketch": sketch,
            "clock": np.array(vocab.clock, np.int64),
        }
    )
