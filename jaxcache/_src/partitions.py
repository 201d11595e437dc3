"""Planning a batch whose rows are split over devices: one planner per partition.

Every id has a home device (``Layout``) and its row only ever sits in that
device's slots, so the cache is a set of independent partitions, each with a
``Planner`` of its own over the ids homed there (its local ids), its own
policy, victim reserve and protection of in-flight batches. A device is one
partition, or ``q`` (``Layout.split``), each over ``C_l / q`` of its slots.
A process plans only the partitions of its own devices.

A batch is split over the same devices (data parallel): device ``s`` (a
*source*) looks up the ids of its slice. Planning a batch takes three
passes, each split into independent pieces that run on the host threads:

1. **split** (per source, or per chunk of a source's slice): the real ids
   of the slice, grouped by home, as local ids; padding and range errors
   are found here.
2. **plan** (per home partition): the partition's planner checks the ids
   sent to it by every source (hits, misses, room); only when every
   partition fits does each commit (victims, directory, policy). The check
   ranks the distinct ids each source sends the partition in order of
   appearance: rank ``k`` of source ``s`` is the row the owner serves ``s``
   at position ``k`` of its ``all_to_all`` block (``device_ops.routed_gather``).
   In a process of several, the ids an own source sends the devices of
   other processes are ranked the same way by the source's split piece.
3. The route's padded arrays, built once the sizes are known (the stager).

On one device of one partition the split and the ranking are skipped: the
planner looks the batch up directly and its ranks are the ranks.

A checkpoint holds each process's part of the planners' state as flat
arrays (``Partitions.state_arrays``); a restore joins the parts of every
process that saved them and places each row on its home device, whatever
the device count. ``check_invariants`` checks every partition's
bookkeeping (for tests).

Shape letters: ``n`` devices, ``L`` devices of this process, ``q``
partitions per device, ``E`` entries (real ids) a partition receives, ``U``
its distinct ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxcache._src import kernels, validation
from jaxcache._src.agreement import Agreement
from jaxcache._src.config import CacheConfig
from jaxcache._src.frequency import hottest
from jaxcache._src.placement import Layout, homed_ids
from jaxcache._src.planner import _NO_PAD, CapacityError, Plan, Planner, check_state
from jaxcache._src.threads import HostThreads, raised

__all__ = ["Partitions", "Split", "StepPlan", "plan_needs"]

# What a process's partitions made of a batch, as the processes exchange it.
_FITS, _FITS_LATER, _NEVER_FITS, _OTHER = range(4)
# What a process publishes for a batch it refused before checking it (bad
# ids): no fingerprint, so the others refuse theirs as a different batch.
_REFUSED_BEFORE_CHECK = np.array([0, 0, _OTHER, -1, 0, 0, 0, 0], np.int64)


def plan_needs(
    layout: Layout,
    sent: np.ndarray,
    sent_out: np.ndarray | None,
    distinct: Sequence[int],
    moved: Sequence[int],
    real: np.ndarray,
) -> np.ndarray:
    """What a plan needs of a step's padded sizes, as far as this process
    sees it (its owners, and its sources), ``int64 [4]``: ``K``, the most
    distinct rows one source needs from one owner (without overflow); ``V``,
    the most distinct rows one owner serves; the most rows moved into one
    device; and the most real ids of one source's slice.

    Args:
      layout: the homes of ids.
      sent, sent_out, real: as ``StepPlan``'s.
      distinct, moved: each own partition's distinct rows and rows fetched.
    """
    k = int(layout.per_device(sent).max(initial=0))
    if sent_out is not None:
        out = sent_out.reshape(len(sent_out), layout.devices, layout.split)
        k = max(k, int(out.sum(2).max(initial=0)))
    v = int(layout.per_device(list(distinct)).max())
    m = int(layout.per_device(list(moved)).max())
    return np.array([k, v, m, int(np.max(real, initial=0))], np.int64)


class Split(NamedTuple):
    """A batch's real ids grouped by source slice, then by residue (home).

    Each source's slice is split in ``per_source`` chunks of consecutive
    positions (``span``), split on their own (in parallel): chunk ``g``'s
    entries of residue ``r`` are ``[begin[g, r], end[g, r])`` of each array
    (each chunk's in a room of its own, with gaps between the groups);
    source ``s``'s chunks are ``s per_source`` to ``(s + 1) per_source -
    1``. The sources of other processes keep only the residues homed here
    (the others' groups are empty).

    Attributes:
      local: ``int64``: each entry's local id (``id // (n q)``).
      at: ``int32``: its position in the flattened batch (for the sources
        of this process; not written for other processes' sources).
      begin: ``int64 [n c, n q]``: where each (chunk, residue) group begins.
      end: ``int64 [n c, n q]``: where it ends.
      ranks: ``int32``: each entry's rank among the distinct ids its source
        sends its home partition, in order of first appearance.
      per_source: ``c``, chunks of each source's slice.
      share: positions of each source's slice.
    """

    local: np.ndarray
    at: np.ndarray
    begin: np.ndarray
    end: np.ndarray
    ranks: np.ndarray
    per_source: int = 1
    share: int = 0

    def chunks(self, residue: int) -> tuple[np.ndarray, np.ndarray]:
        """``(lo, hi)``, each ``[n c]``: every chunk's entries of ``residue``."""
        return self.begin[:, residue], self.end[:, residue]

    def span(self, chunk: int) -> tuple[int, int]:
        """The positions ``[lo, hi)`` of the flattened batch that ``chunk`` covers."""
        return _span(chunk, self.per_source, self.share)


def _span(chunk: int, per_source: int, share: int) -> tuple[int, int]:
    source, part = divmod(chunk, per_source)
    start = source * share
    return start + part * share // per_source, start + (part + 1) * share // per_source


class StepPlan(NamedTuple):
    """One batch planned over this process's partitions (host arrays).

    Attributes:
      index: sequence number of the plan (the same in every partition).
      shape: shape of the batch's ids.
      plans: one ``Plan`` per own partition (``L q``, a device's ``q`` one
        after another), in local ids and local slots (of the partition's
        ``C_l / q``). With several partitions a plan's ``inverse`` holds,
        for source ``s``'s rank ``k``, the distinct row (index into its
        ``unique_slots``) at ``bounds[s] + k``.
      bounds: per own partition, ``int64 [n + 1]``: where each source's
        ranks start (``None`` with one partition).
      sent: ``int64 [L q, n]``: distinct ids each source sends each own partition.
      real: ``int64 [L]``: real (not padding) ids of each own source's slice.
      sent_out: ``int64 [L, n q]``: distinct ids each own source sends each
        partition of another process (ranked here too; 0 for those here);
        ``None`` in one process, where ``sent`` covers every pair.
      split: the batch's real ids grouped by source and home (``None`` with
        one partition, where the plan's ``inverse`` holds the ranks).
      needs: with several processes, ``int64 [4]``: the most any process's
        plan needs of ``K``, ``V``, rows moved and real ids per device (what
        the padded sizes grow to), agreed before the plan was committed;
        ``None`` in one process.
    """

    index: int  # type: ignore[assignment]  # the field shadows tuple.index
    shape: tuple[int, ...]
    plans: tuple[Plan, ...]
    bounds: tuple[np.ndarray, ...] | None
    sent: np.ndarray
    real: np.ndarray
    sent_out: np.ndarray | None
    split: Split | None
    needs: np.ndarray | None = None

    def own_needs(self, layout: Layout) -> np.ndarray:
        """What this process's plan needs of the step's padded sizes
        (``plan_needs``); ``needs`` holds every process's."""
        distinct = [plan.distinct for plan in self.plans]
        moved = [plan.misses for plan in self.plans]
        return plan_needs(layout, self.sent, self.sent_out, distinct, moved, self.real)

    def total(self, field: str) -> int:
        """A count of the plans (``lookups``, ``hits``, ...) summed over the partitions."""
        return sum(getattr(plan, field) for plan in self.plans)

    @property
    def distinct(self) -> int:
        """Distinct ids of the batch homed on this process's devices."""
        return sum(plan.distinct for plan in self.plans)

    @property
    def misses(self) -> int:
        """Distinct ids fetched from the host."""
        return sum(plan.misses for plan in self.plans)

    @property
    def rows_to_host(self) -> int:
        """Dirty rows evicted (written back)."""
        return sum(len(plan.evict_ids) for plan in self.plans)


class Partitions:
    """The planners of this process's device partitions, planned as one.

    Args:
      config: the table's configuration (``capacity`` a multiple of ``n q``).
      layout: the homes of ids (devices, processes, this process).
      frequencies: ``int [N]`` dataset access counts (see ``Planner``).
      reserve: victim candidates per partition (see ``Planner``).
      threads: the host threads that plan partitions in parallel.
      ids: the configuration of the user's ids, where they are raw ids
        translated to the rows planned here (default ``config``): errors
        name the ids a partition holds by it.
      agreement: with the devices over several processes, how they agree
        on each plan (``_agree``); ``None`` in one process.

    Attributes:
      planners: the ``Planner`` of each own partition (local ids).
      parts: the own partitions (``Layout``'s numbers).
      local_capacity: ``C_l``, slots per device.
      part_capacity: ``C_l / q``, slots per partition.

    Examples:
      >>> import numpy as np, jaxcache
      >>> from jaxcache._src.placement import Layout
      >>> cfg = jaxcache.CacheConfig(100, 2, capacity=8, policy="lru")
      >>> parts = Partitions(cfg, Layout(devices=2))
      >>> step = parts.plan(np.array([[3, 4], [5, 3]]))  # ids 4 on device 0; 3, 5 on device 1
      >>> [plan.fetch_ids.tolist() for plan in step.plans]  # local ids (id // 2)
      [[2], [1, 2]]
      >>> parts.id_of_slot.reshape(2, 4).tolist()
      [[4, -1, -1, -1], [3, 5, -1, -1]]
    """

    def __init__(
        self,
        config: CacheConfig,
        layout: Layout,
        *,
        frequencies: np.ndarray | None = None,
        reserve: int = 4096,
        threads: HostThreads | None = None,
        ids: CacheConfig | None = None,
        agreement: Agreement | None = None,
    ) -> None:
        n, parts = layout.devices, layout.parts
        if config.capacity % parts:
            over = f"{n} devices" if parts == n else f"{n} device(s) x {layout.split} partitions"
            raise ValueError(
                f"capacity={config.capacity} does not split over {over}; use a multiple of {parts}."
            )
        if frequencies is not None:
            frequencies = validation.check_frequencies(
                frequencies, config.num_embeddings, "count them with jaxcache.FrequencyCounter"
            )
        self.config = config
        self.ids_config = config if ids is None else ids
        self.layout = layout
        self.threads = threads or HostThreads(1)
        # With several processes: each plan is committed in all of them or in none.
        self.agreement = agreement
        self.local_capacity = int(config.capacity) // n
        self.part_capacity = int(config.capacity) // parts
        self.parts = tuple(layout.own_parts)
        self._source_stamp = 1  # stamps of the sources' ranking, n per plan
        # What the split of each source keeps, fixed by the layout: a source
        # of this process needs every residue ranked, another process's
        # source only the residues of the partitions here (``_split``).
        self._keep_all = np.ones(parts, bool)
        self._keep_mine = np.zeros(parts, bool)
        self._keep_mine[[layout.part_residue(t) for t in self.parts]] = True
        self._foreign = np.array([t for t in range(parts) if t not in layout.own_parts], np.int64)
        self._foreign_residues = np.array([layout.part_residue(t) for t in self._foreign], np.int64)
        self._row_of = {source: row for row, source in enumerate(layout.own)}
        self._own = np.array(layout.own, np.int64)
        self.planners = [
            Planner(
                self._partition_config(t),
                frequencies=None if frequencies is None else layout.part_values(frequencies, t),
                reserve=reserve,
            )
            for t in self.parts
        ]

    def _partition_config(self, part: int) -> CacheConfig:
        if self.layout.parts == 1:
            return self.config
        rows = self.layout.part_rows(self.config.num_embeddings, part)
        return dataclasses.replace(
            self.config,
            num_embeddings=rows,
            capacity=min(self.part_capacity, rows),
            padding_id=None,  # the split drops padding
        )

    # ---------------------------------------------------------------- status
    @property
    def capacity(self) -> int:
        """``C``, slots over all devices."""
        return int(self.config.capacity)

    @property
    def next_index(self) -> int:
        """Index the next plan gets."""
        return self.planners[0].next_index

    @property
    def released(self) -> int:
        """Plans up to this index are finished."""
        return self.planners[0].released

    @property
    def in_flight(self) -> range:
        """Indices of the plans made and not released yet."""
        return range(self.released + 1, self.next_index)

    def release(self, index: int) -> None:
        """Marks plans up to ``index`` finished: their rows become evictable."""
        for planner in self.planners:
            planner.release(index)

    def release_all(self) -> None:
        """Marks every plan made so far finished."""
        self.release(self.next_index - 1)

    def swap_counts(self, ids: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Sets the policies' per-id lookup counts of ``ids`` (those of this
        process's partitions) to ``values`` and returns what they were:
        a row a dynamic vocabulary gives to a new id counts that id's
        lookups only (``raw_ids``), and a refused batch puts them back."""
        ids = np.asarray(ids, np.int64)
        values = np.asarray(values, np.int64)
        old = np.zeros(ids.size, np.int64)
        part_of, local = self.layout.part_of(ids), self.layout.part_local_ids(ids)
        for part, planner in zip(self.parts, self.planners, strict=True):
            counts = getattr(planner.policy, "counts", None)
            mine = np.flatnonzero(part_of == part)
            if counts is None or not mine.size:
                continue
            old[mine] = counts[local[mine]]
            counts[local[mine]] = values[mine]
        return old

    def _blocks(self, values: list[np.ndarray], fill: Any, dtype: Any) -> np.ndarray:
        """Per-partition slot arrays, each padded to ``C_l / q``, one after
        another (a device's ``C_l`` slots are its partitions')."""
        out = np.full(len(values) * self.part_capacity, fill, dtype)
        for block, array in enumerate(values):
            start = block * self.part_capacity
            out[start : start + array.size] = array
        return out

    @property
    def id_of_slot(self) -> np.ndarray:
        """``int64 [L C_l]``: the id in each slot of this process's devices
        (global ids, ``-1`` for a free slot); a copy."""
        return self._blocks(
            [
                np.where(p.id_of_slot >= 0, self.layout.part_global_ids(t, p.id_of_slot), -1)
                for t, p in zip(self.parts, self.planners, strict=True)
            ],
            -1,
            np.int64,
        )

    @property
    def last_use(self) -> np.ndarray:
        """``int64 [L C_l]``: the last plan that used each slot; a copy."""
        return self._blocks([p.last_use for p in self.planners], -1, np.int64)

    @property
    def dirty(self) -> np.ndarray:
        """``bool [L C_l]``: slots whose row changed since it was fetched; a copy."""
        return self._blocks([p.dirty for p in self.planners], False, bool)

    @property
    def nbytes(self) -> int:
        """Host memory of the directories and policies of this process's partitions."""
        total = 0
        for planner in self.planners:
            arrays: list[np.ndarray] = [
                planner.slot_of_id,
                planner.id_of_slot,
                planner.last_use,
                planner.dirty,
            ]
            arrays += [v for v in vars(planner.policy).values() if isinstance(v, np.ndarray)]
            total += sum(a.nbytes for a in arrays)
        return total

    @property
    def warms(self) -> bool:
        """Whether the policy starts the cache with the hottest rows loaded."""
        return self.planners[0].policy.warms

    def stale(self) -> bool:
        """Whether a row of a finished plan changed on device (is dirty)."""
        return any((p.dirty & (p.last_use <= p.released)).any() for p in self.planners)

    def dirty_rows(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per device of this process: its dirty slots (local to the device)
        and their rows' (global) ids."""
        q, width = self.layout.split, self.part_capacity
        out = []
        for device in range(len(self.layout.own)):
            slots, ids = [], []
            for j in range(q):
                part, planner = self.parts[device * q + j], self.planners[device * q + j]
                dirty = np.flatnonzero(planner.dirty)
                slots.append(dirty + j * width)
                ids.append(self.layout.part_global_ids(part, planner.id_of_slot[dirty]))
            out.append((np.concatenate(slots), np.concatenate(ids)))
        return out

    def mark_clean(self) -> None:
        """Marks the rows of finished plans clean (after a flush wrote them
        back); rows of plans in flight stay dirty, since their step may still
        change them."""
        for planner in self.planners:
            planner.dirty &= planner.last_use > planner.released

    def check_invariants(self, table: str) -> None:
        """``Planner.check_invariants`` of every own partition, naming
        ``table`` (and the device, with several)."""
        several = self.layout.parts > 1
        for part, planner in zip(self.parts, self.planners, strict=True):
            where = f" on {self._where(part)}" if several else ""
            planner.check_invariants(f"table {table!r}{where}")

    def resident_ids(self) -> np.ndarray:
        """Ids currently in a slot of this process's devices, in slot order."""
        ids = self.id_of_slot
        return ids[ids >= 0]

    # ------------------------------------------------------------------ warm
    def warm(self, ids: np.ndarray) -> None:
        """Places ``ids`` (global, not yet resident) into free slots of their
        homes, in order; ids beyond a partition's free slots are ignored."""
        ids = validation.check_ids(ids, self.config.num_embeddings, None, "ids").reshape(-1)
        homes = self.layout.part_of(ids)
        for part, planner in zip(self.parts, self.planners, strict=True):
            planner.warm(self.layout.part_local_ids(ids[homes == part]))

    def warm_hottest(self, frequencies: np.ndarray) -> None:
        """Fills every partition's free slots with its hottest ids by ``frequencies``."""
        for part, planner in zip(self.parts, self.planners, strict=True):
            counts = self.layout.part_values(np.asarray(frequencies), part)
            planner.warm(hottest(counts, planner.capacity))

    # ------------------------------------------------------------------ plan
    def plan(
        self,
        ids: np.ndarray,
        *,
        train: bool = True,
        released: int | None = None,
        max_distinct: int | None = None,
        refetch: np.ndarray | None = None,
    ) -> StepPlan:
        """Plans one batch in every own partition (arguments as for ``Planner.plan``;
        ``refetch``: rows of the batch its caller fetches even where they
        are resident, which the padded sizes agreed by several processes
        count among the moves).

        The leading axis of ``ids`` splits evenly over the devices. Either every
        partition plans the batch or, when one refuses it, none does.

        Raises:
          TypeError, ValueError: bad ids (nothing changed).
          CapacityError: a partition's distinct ids do not fit next to its
            in-flight rows (nothing changed); ``fits_after`` covers them all.
        """
        try:
            array = validation.check_id_type(ids, "ids")
        except Exception:
            self.refuse_unchecked()
            raise
        if self.layout.parts == 1:
            plan = self.planners[0].plan(
                array, train=train, released=released, max_distinct=max_distinct
            )
            sent = np.array([[plan.distinct]], np.int64)
            real = np.array([plan.lookups], np.int64)
            return StepPlan(plan.index, array.shape, (plan,), None, sent, real, None, None)
        n = self.layout.devices
        cfg = self.config
        try:
            validation.check_host_ids(array, cfg.num_embeddings, cfg.padding_id, "ids")
            flat = kernels.as_index_array(array)
            split, sent_out = self._split(array, flat)  # checks the values too
        except Exception:
            self.refuse_unchecked()
            raise
        stamp = self._source_stamp
        self._source_stamp += n
        counts = split.end - split.begin  # [chunk, residue]
        entries = counts.sum(0).tolist()

        def check(item):
            part, planner = item
            residue = self.layout.part_residue(part)
            lo, hi = split.chunks(residue)
            return planner.check_entries(
                split.local,
                lo,
                hi,
                split.ranks,
                stamp,
                entries[residue],
                released=released,
                per_source=split.per_source,
            )

        own = list(zip(self.parts, self.planners, strict=True))
        checked = self.threads.gather(check, own)
        needs = None
        if self.agreement is not None:
            needs = self._agree(flat, checked, counts, sent_out, refetch)
        self._raise_refusals(checked, max_distinct)
        plans = self.threads.map(
            lambda item: item[0].commit(item[1], train=train),
            list(zip(self.planners, checked, strict=True)),
        )
        return StepPlan(
            plans[0].index,
            array.shape,
            tuple(plans),
            tuple(c.bounds for c in checked),
            np.stack([c.sent for c in checked]),
            counts.reshape(n, -1)[self._own].sum(1),
            sent_out,
            split,
            needs,
        )

    def refuse_unchecked(self) -> None:
        """Several processes: tells the others that this one refuses the
        next batch before checking it (bad ids, a full vocabulary), in the
        exchange the check would have made, so that they refuse it too and
        every process stays in step; its caller raises the error."""
        if self.agreement is not None:
            self.agreement.gather(self.next_index, _REFUSED_BEFORE_CHECK)

    def _agree(
        self,
        flat: np.ndarray,
        checked: list[Any],
        counts: np.ndarray,
        sent_out: np.ndarray | None,
        refetch: np.ndarray | None,
    ) -> np.ndarray:
        """Several processes, between check and commit: each publishes its
        batch's fingerprint, whether its partitions take the batch, and
        what its plan needs of the padded sizes. The batch is committed in
        every process or in none, and every process raises the same error:
        a refusal raised in one process alone left the others waiting for
        it, and their plans committed. Returns the needs' maxima.

        Raises:
          ValueError: the processes staged different batches (nothing changed).
          CapacityError: a process's partitions refused the batch (nothing
            changed); ``fits_after`` is the latest any process needs.
        """
        layout = self.layout
        errors = [raised(c) for c in checked]
        refusals = [e for e in errors if isinstance(e, CapacityError)]
        fits = [e.fits_after for e in refusals if e.fits_after is not None]
        if any(e is not None and not isinstance(e, CapacityError) for e in errors):
            status = _OTHER
        elif len(fits) < len(refusals):
            status = _NEVER_FITS
        else:
            status = _FITS_LATER if refusals else _FITS
        needs = np.zeros(4, np.int64)
        if status == _FITS:  # what ``StepPlan.own_needs`` gives once committed
            distinct = [c.hits.size + c.miss_ids.size for c in checked]
            moved = [c.miss_ids.size for c in checked]
            if refetch is not None and refetch.size:  # fetched where resident too
                part_of, local = layout.part_of(refetch), layout.part_local_ids(refetch)
                for i, part in enumerate(self.parts):
                    mine = local[part_of == part]
                    moved[i] += int(np.count_nonzero(~np.isin(mine, checked[i].miss_ids)))
            sent = np.stack([c.sent for c in checked])
            real = counts.reshape(layout.devices, -1)[self._own].sum(1)
            needs = plan_needs(layout, sent, sent_out, distinct, moved, real)
        mine = [kernels.fingerprint(flat), flat.size, status, max(fits, default=-1), *needs]
        index = self.next_index
        assert self.agreement is not None
        table = np.stack(self.agreement.gather(index, np.array(mine, np.int64)))
        different = bool((table[:, :2] != table[0, :2]).any())
        worst = int(table[:, 2].max())
        if not different and worst == _FITS:
            return table[:, 4:].max(0)
        latest = int(table[:, 3].max())
        if not different and status == worst:
            # This process's own refusal, as one process raises it (it
            # clears the codes of the partitions that took the batch).
            self._raise_refusals(checked, None, fits_after=latest if latest >= 0 else None)
        for planner, c in zip(self.planners, checked, strict=True):
            if raised(c) is None:  # refused: clear its misses' codes
                planner.abandon(c)
        if different:
            raise ValueError(
                f"the processes staged different batches as plan {index}: each process "
                "must pass the same global batch (every process picks out the ids of its "
                "own devices from it), in the same order."
            )
        process = int(np.flatnonzero(table[:, 2] == worst)[0])
        if worst == _OTHER:
            raise ValueError(
                f"process {process} refused batch {index} (its error says why); nothing "
                "was planned in any process."
            )
        refusal = CapacityError(
            f"the batch does not fit on the devices of process {process} (its error says "
            "why); nothing was planned in any process."
        )
        refusal.fits_after = latest if worst == _FITS_LATER else None
        raise refusal

    def _split(self, array: np.ndarray, flat: np.ndarray) -> tuple[Split, np.ndarray | None]:
        """The real ids of each source's slice grouped by residue
        (``split_by_home``), one piece per chunk of a slice, and ``sent_out``
        (``None`` in one process): the distinct ids each own source sends
        each partition of another process. Those ids are ranked as their
        owners rank them (``distinct_ranks``) in the source's own piece, with
        no map of their own; the other ranks are the check's.

        In one process each slice splits in ``q`` chunks (the partitions per
        device), so that a device's slice is split on ``q`` threads as its
        partitions are planned on ``q``; the ranks do not depend on it. With
        several processes a slice is one chunk (the ranking of what it sends
        elsewhere runs over the whole slice)."""
        cfg, layout, n, parts = self.config, self.layout, self.layout.devices, self.layout.parts
        share = flat.size // n
        c = layout.split if layout.processes == 1 else 1
        pad = _NO_PAD if cfg.padding_id is None else cfg.padding_id
        longest = -(-share // c)
        room = parts * int(kernels.region(longest, parts)) + 1  # each chunk's (split_by_home)
        local = np.empty(n * c * room, np.int64)
        at = np.empty(n * c * room, np.int32)
        ranks = np.empty(n * c * room, np.int32)
        begin = np.empty((n * c, parts), np.int64)
        end = np.empty((n * c, parts), np.int64)
        everything, mine, row_of = self._keep_all, self._keep_mine, self._row_of
        foreign, residues = self._foreign, self._foreign_residues
        sent_out = None
        if layout.processes > 1:
            sent_out = np.zeros((layout.per_process, parts), np.int64)

        def split(chunk: int) -> int:
            lo, hi = _span(chunk, c, share)
            source = chunk // c
            own = source in row_of  # only its entries' positions are routed here
            out = slice(chunk * room, (chunk + 1) * room)
            bad = kernels.split_by_home(
                flat, lo, hi, pad, cfg.num_embeddings, parts, everything if own else mine,
                local[out], at[out], own, begin[chunk], end[chunk],
            )  # fmt: skip
            if bad < 0 and own and sent_out is not None:  # one chunk a source
                counts = np.empty(foreign.size, np.int64)
                kernels.distinct_ranks(
                    local[out], begin[chunk, residues], end[chunk, residues], ranks[out], counts
                )
                sent_out[row_of[source], foreign] = counts
            return bad

        bad = [p for p in self.threads.map(split, range(n * c)) if p >= 0]
        if bad:  # check_ids words the error; the kernel found where
            validation.check_ids(array, cfg.num_embeddings, cfg.padding_id, "ids")
            raise ValueError(f"ids hold {flat[bad[0]]}, outside [0, {cfg.num_embeddings}).")
        offsets = room * np.arange(n * c)[:, None]
        begin += offsets
        end += offsets
        return Split(local, at, begin, end, ranks, c, share), sent_out

    def _where(self, part: int) -> str:
        """Partition ``part`` in words: its device (and which of its partitions)."""
        split = self.layout.split
        where = f"device {part // split}"
        return where if split == 1 else f"{where}, partition {part % split}"

    def _raise_refusals(
        self, checked: list[Any], max_distinct: int | None, *, fits_after: int | None = None
    ) -> None:
        """Raises the error of a partition that refused the batch, or when the
        batch has more than ``max_distinct`` distinct ids in all; a refusal
        that fits later names ``fits_after`` when given (the processes' latest)."""
        found = [(t, raised(c)) for t, c in zip(self.parts, checked, strict=True)]
        errors: list[tuple[int, Any]] = [(d, e) for d, e in found if e is not None]
        distinct = sum(c.hits.size + c.miss_ids.size for c in checked if raised(c) is None)
        if errors or (max_distinct is not None and distinct > max_distinct):
            for planner, c in zip(self.planners, checked, strict=True):
                if raised(c) is None:  # the batch is refused: clear its misses' codes
                    planner.abandon(c)
        for _, error in errors:
            if not isinstance(error, CapacityError):
                raise error
        never = [(d, e) for d, e in errors if e.fits_after is None]
        if never:
            part, error = max(never, key=lambda item: item[1].distinct or 0)
            distinct = error.distinct
            refusal = CapacityError(
                f"the batch has {distinct} distinct ids homed on {self._where(part)} ("
                f"{homed_ids(self.ids_config, self.layout.parts, self.layout.part_residue(part))}"
                ") but each "
                f"{'partition' if self.layout.split > 1 else 'device'} holds "
                f"{self.part_capacity} rows; raise capacity to at least "
                f"{self.layout.parts * distinct} or use smaller batches."
            )
            refusal.distinct = distinct
            raise refusal
        if errors:
            part, error = max(errors, key=lambda item: item[1].fits_after)
            refusal = CapacityError(f"{self._where(part)}: {error}")
            refusal.fits_after = error.fits_after if fits_after is None else fits_after
            raise refusal
        if max_distinct is not None:
            if distinct > max_distinct:
                raise ValueError(
                    f"the batch has {distinct} distinct ids, but the host-callback form pads "
                    f"its lists to callback_rows={max_distinct}; raise "
                    f"CacheConfig(callback_rows=...) to at least {distinct}, or leave it None "
                    "to pad to the batch's number of ids."
                )

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The planners' state, as this process's part of the whole cache's.

        Returns:
          ``{"id_of_slot": int64 [L C_l] (global ids), "last_use": int64
          [L C_l], "next_index": int, "policy": {"name": ..., per-id arrays
          in this process's share of the ids (``i % P == p``, as its host
          table stores them), the policies' other arrays stacked ``[L,
          ...]``}}``.
        """
        for planner in self.planners:
            planner.state_dict()  # refuses rows changed on device
        return {
            "id_of_slot": self.id_of_slot,
            "last_use": self.last_use,
            "next_index": self.next_index,
            "finished": self.finished,
            "policy": self.policy_state(),
        }

    def state_arrays(self) -> dict[str, np.ndarray]:
        """This process's part of the planners' state as flat arrays, for a checkpoint.

        Each process saves its own part; ``load_state_arrays`` joins the parts
        of every process that saved them. The scalars are ``state_meta``'s.

        Returns:
          ``{"planner.id_of_slot": int64 [L C_l] (global ids),
          "planner.last_use": int64 [L C_l], "policy.<name>": ...}``: each
          array of ``policy_state`` (per-id arrays over this process's share
          of the ids, the others stacked ``[L, ...]``).

        Raises:
          RuntimeError: rows changed on device were not written back.

        Examples:
          >>> import numpy as np, jaxcache
          >>> from jaxcache._src.placement import Layout
          >>> parts = Partitions(jaxcache.CacheConfig(6, 2, 4, policy="lfu"), Layout(devices=2))
          >>> _ = parts.plan(np.array([[5, 5], [2, 5]]), train=False)
          >>> arrays = parts.state_arrays()
          >>> sorted(arrays), arrays["planner.id_of_slot"].tolist()
          (['planner.id_of_slot', 'planner.last_use', 'policy.counts'], [2, -1, 5, -1])
          >>> other = Partitions(jaxcache.CacheConfig(6, 2, 2, policy="lfu"), Layout(devices=1))
          >>> other.load_state_arrays([arrays], parts.state_meta())
          >>> other.resident_ids().tolist()  # the hottest rows that fit
          [5, 2]
        """
        state = self.state_dict()
        arrays = {"planner.id_of_slot": state["id_of_slot"], "planner.last_use": state["last_use"]}
        arrays.update((f"policy.{k}", v) for k, v in state["policy"].items() if k != "name")
        return arrays

    def state_meta(self) -> dict[str, Any]:
        """The planners' scalars for a checkpoint, JSON-serialisable:
        ``{"next_index": int, "finished": int, "policy": name}``."""
        return {
            "next_index": int(self.next_index),
            "finished": self.finished,
            "policy": self.planners[0].policy.name,
        }

    @property
    def finished(self) -> int:
        """The latest bound a plan was made under: plans after it still
        protect their rows from the next plan (``Planner.finished``)."""
        return max(p.finished for p in self.planners)

    def check_state_arrays(
        self, parts: Sequence[Mapping[str, np.ndarray]], meta: Mapping[str, Any]
    ) -> None:
        """Raises ``ValueError`` unless ``load_state_arrays`` takes ``parts`` and
        ``meta``: every array is there, the saved slots hold distinct ids of
        this table, and per-id arrays cover its ``N`` ids. Changes nothing."""
        self._joined(parts, meta)

    def load_state_arrays(
        self, parts: Sequence[Mapping[str, np.ndarray]], meta: Mapping[str, Any]
    ) -> None:
        """Restores the ``state_arrays`` of every process that saved them.

        Args:
          parts: each saving process's ``state_arrays``, in process order
            (one for a single process); arrays may be memory maps.
          meta: the ``state_meta`` they were saved with (other keys ignored).

        Raises:
          ValueError: the state does not fit this table (nothing changed).
        """
        self.load_state_dict(self._joined(parts, meta))

    def _joined(
        self, parts: Sequence[Mapping[str, np.ndarray]], meta: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The whole cache's state (``load_state_dict``'s) of every saving
        process's parts, checked as ``check_state_arrays`` says."""
        missing = [
            f"{key} of process {i}"
            for i, part in enumerate(parts)
            for key in ("planner.id_of_slot", "planner.last_use")
            if key not in part
        ]
        if not parts or missing or "next_index" not in meta:
            lacking = missing[0] if missing else "next_index" if parts else "every process's part"
            raise ValueError(f"the saved planner state lacks {lacking}; it is incomplete.")
        shards, n = len(parts), self.config.num_embeddings

        def joined(key: str) -> np.ndarray:  # every process's slot blocks, in order
            values = [np.asarray(part[key]) for part in parts]
            return values[0] if shards == 1 else np.concatenate(values)

        policy: dict[str, Any] = {"name": meta.get("policy")}
        for key in parts[0]:
            if key.startswith("policy."):  # one array, or each process's share
                values = [part[key] for part in parts]
                policy[key.removeprefix("policy.")] = values[0] if shards == 1 else values
        state = {
            "id_of_slot": joined("planner.id_of_slot"),
            "last_use": joined("planner.last_use"),
            "next_index": int(meta["next_index"]),
            "policy": policy,
        }
        if "finished" in meta:  # absent from checkpoints saved before it was kept
            state["finished"] = int(meta["finished"])
        check_state({**state, "policy": {}}, n)
        for key in _per_id_keys(policy, self.planners[0].policy.per_id):
            shares = [policy[key]] if shards == 1 else policy[key]
            rows = sum(np.shape(share)[0] if np.ndim(share) else 0 for share in shares)
            if rows != n:
                raise ValueError(
                    f"the saved policy's {key} cover {rows} ids but the table has {n} rows; is "
                    "this the same table?"
                )
        return state

    def policy_state(self) -> dict[str, Any]:
        """What the policies learned: ``{"name": ..., per-id arrays}`` over this
        process's ids (all ids in one process), in id order, and the
        policies' other arrays (``Policy.per_id`` tells which are which), one
        per partition stacked ``[L, ...]``; copies.

        Examples:
          >>> import numpy as np, jaxcache
          >>> from jaxcache._src.placement import Layout
          >>> parts = Partitions(jaxcache.CacheConfig(6, 2, capacity=4), Layout(devices=2))
          >>> _ = parts.plan(np.array([[5, 5], [2, 5]]))
          >>> parts.policy_state()["counts"].tolist()
          [0, 0, 1, 0, 0, 3]
        """
        states = [planner.policy.state_dict() for planner in self.planners]
        policy: dict[str, Any] = {"name": states[0]["name"]}
        per_id = _per_id_keys(states[0], self.planners[0].policy.per_id)
        for key, value in states[0].items():
            if key in per_id:
                policy[key] = self._merge_per_id([np.array(s[key]) for s in states])
            elif isinstance(value, np.ndarray):  # per partition: exact on the same layout
                policy[key] = np.stack([s[key] for s in states])
        return policy

    def _merge_per_id(self, parts: list[np.ndarray]) -> np.ndarray:
        """Per-partition arrays over local ids as one array over this
        process's ids ``i % P == p`` (id order)."""
        layout = self.layout
        if layout.parts == 1:
            return parts[0]
        share = len(range(layout.process, self.config.num_embeddings, layout.processes))
        out = np.empty((share, *parts[0].shape[1:]), parts[0].dtype)
        stride = layout.per_process * layout.split
        for t, part in zip(self.parts, parts, strict=True):
            out[layout.share_start(t) :: stride] = part
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the whole cache's state (every process's part, joined).

        ``state`` holds ``id_of_slot`` and ``last_use`` of every slot of the
        cache it was saved from (global ids; any device count and capacity),
        ``next_index`` and the policy with per-id arrays over all ``N`` ids:
        one array, or a list of the ``Q`` shares of the processes that saved
        it (share ``q`` holds ids ``i % Q == q`` in order; each partition then
        reads only its own ids of them).
        Saved on the same devices, capacity and policy, every row goes back
        to its slot; otherwise each partition places its previously resident
        rows hottest first (``Planner.load_state_dict``).

        Raises:
          ValueError: the state does not fit this table (nothing changed).
        """
        layout, cl = self.layout, self.part_capacity
        ids = np.asarray(state["id_of_slot"], np.int64)
        last_use = np.asarray(state["last_use"], np.int64)
        policy = dict(state.get("policy", {}))
        keys = _per_id_keys(policy, self.planners[0].policy.per_id)
        if layout.parts == 1:
            policy = {k: self._policy_part(k in keys, v, 0, 0) for k, v in policy.items()}
            self.planners[0].load_state_dict({**state, "policy": policy})
            return
        check_state(
            {"id_of_slot": ids, "last_use": last_use, "policy": {}}, self.config.num_embeddings
        )
        same_layout = ids.size == self.capacity and bool(
            (layout.part_of(ids[ids >= 0]) == np.flatnonzero(ids >= 0) // cl).all()
        )
        parts = []
        for index, (t, planner) in enumerate(zip(self.parts, self.planners, strict=True)):
            part_policy = {
                key: self._policy_part(key in keys, value, t, index if same_layout else -1)
                for key, value in policy.items()
            }
            if same_layout:
                block = slice(t * cl, t * cl + planner.capacity)
                slots, used = ids[block], last_use[block]
            else:
                mine = (ids >= 0) & (layout.part_of(ids) == t)
                slots, used = ids[mine], last_use[mine]
                if slots.size == planner.capacity:  # not the same slots: rank them
                    slots, used = np.append(slots, -1), np.append(used, -1)
            local = np.where(slots >= 0, layout.part_local_ids(slots), -1)
            part = {
                "id_of_slot": local,
                "last_use": used,
                "next_index": state["next_index"],
                "policy": part_policy,
            }
            if "finished" in state:
                part["finished"] = state["finished"]
            planner.check_state_dict(part)
            parts.append(part)
        for planner, part in zip(self.planners, parts, strict=True):
            planner.load_state_dict(part)

    def _policy_part(self, per_id: bool, value: Any, part: int, index: int) -> Any:
        """Partition ``part``'s part of a saved policy entry: its ids' entries
        of a per-id array; of another array saved per partition (``[L, ...]``,
        or the list of the processes' stacks), entry ``index`` of this
        process's when the layout is the same (``index >= 0``), else nothing
        (``None``: the policy starts that state afresh); other values as
        they are."""
        if per_id:
            return self._per_id_part(value, part)
        if isinstance(value, (list, tuple)):  # the processes' stacks, in order
            if len(value) != self.layout.processes:
                return None
            value = np.asarray(value[self.layout.process])
        if not isinstance(value, np.ndarray):
            return value
        if index < 0 or value.ndim == 0 or value.shape[0] != len(self.planners):
            return None
        return value[index]

    def _per_id_part(self, value: Any, part: int) -> np.ndarray:
        """Partition ``part``'s local ids' entries of a per-id array ``[N]``, or of
        the list of its process shares."""
        if not isinstance(value, (list, tuple)):
            value = np.asarray(value)
            n = self.config.num_embeddings
            if value.shape[:1] != (n,):
                raise ValueError(
                    f"saved access counts have shape {value.shape}, the table has {n} rows."
                )
            return self.layout.part_values(value, part)
        shares = len(value)
        ids = self.layout.part_global_ids(
            part, np.arange(self.layout.part_rows(self.config.num_embeddings, part))
        )
        out = np.empty((ids.size, *np.shape(value[0])[1:]), np.asarray(value[0][:0]).dtype)
        for share, part in enumerate(value):
            mine = ids % shares == share
            out[mine] = np.asarray(part)[ids[mine] // shares]
        return out


def _per_id_keys(policy_state: dict[str, Any], per_id: tuple[str, ...]) -> tuple[str, ...]:
    """The policy state's arrays with one entry per id: those the policy
    declares (``per_id``), and the access counts of any counting policy."""
    return tuple(key for key in policy_state if key in per_id or key == "counts")
