"""The host planner: which rows a batch needs, which are resident, what moves.

For a batch of ids the planner finds the distinct ids, the hits (already in a
device slot) and the misses, chooses victims by the policy among the slots no
in-flight batch uses, assigns the misses to those slots and remaps every id to
a slot. Every per-id pass is a compiled loop (Numba, GIL released,
``kernels.py``) over the batch; the only per-step work proportional to the
capacity is the victim choice, and only on steps with
misses.

Shape letters: ``C`` capacity (slots), ``N`` table rows, ``U`` distinct ids of
a batch, ``M`` misses, ``E`` dirty evictions.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from jaxcache._src import kernels, policies, validation
from jaxcache._src.config import CacheConfig
from jaxcache._src.frequency import hottest

__all__ = ["CapacityError", "Plan", "Planner"]


class CapacityError(ValueError):
    """A batch needs more rows on device than the cache can give it.

    Attributes:
      fits_after: when rows of in-flight batches are in the way, the index
        of the plan whose release makes room for the batch (releasing it
        and every earlier plan); ``None`` when the batch can never fit.
      distinct: when it can never fit, the batch's distinct ids (on the
        device that overflows, with rows split over several).
      rows_needed, rows_available: a dynamic vocabulary's refusal: the
        batch's new ids and the rows that could take them.

    Examples:
      >>> import numpy as np, jaxcache
      >>> planner = jaxcache.planning.Planner(jaxcache.CacheConfig(100, 2, capacity=3))
      >>> try:
      ...     planner.plan(np.arange(5))
      ... except jaxcache.CapacityError as error:
      ...     print(str(error).split(";")[0])
      the batch has 5 distinct ids but capacity is 3 rows
      >>> first = planner.plan(np.array([0, 1, 2]))  # in flight: not released yet
      >>> try:
      ...     planner.plan(np.array([3]))
      ... except jaxcache.CapacityError as error:
      ...     print(error.fits_after)  # fits once plan 0 is released
      0
    """

    fits_after: int | None = None
    distinct: int | None = None
    rows_needed: int | None = None  # a dynamic vocabulary's: new ids to admit
    rows_available: int | None = None  # and the rows it could give them


class Plan(NamedTuple):
    """What one batch needs from the cache (host arrays).

    Attributes:
      index: sequence number of the plan.
      unique_slots: ``int32 [U]`` slot of each distinct id of the batch, in
        the order the ids first appear in it (whether they hit or missed,
        so the order depends on the batch alone; a device partition's,
        ``jaxcache._src.partitions``: source after source).
      inverse: ``int32`` of the ids' shape: position of each id in
        ``unique_slots``; ``-1`` for padding.
      fetch_ids: ``int64 [M]`` ids to copy host -> device.
      fetch_slots: ``int32 [M]`` their slots.
      evict_ids: ``int64 [E]`` evicted ids whose rows changed on device and
        must be written back.
      evict_slots: ``int32 [E]`` their (old) slots.
      lookups: ids looked up, padding excluded.
      hits: distinct ids that were resident.
      access_hits: lookups served by resident rows.
      evictions: resident rows replaced (clean ones included).

    Examples:
      >>> import numpy as np, jaxcache
      >>> planner = jaxcache.planning.Planner(jaxcache.CacheConfig(100, 2, capacity=4))
      >>> plan = planner.plan(np.array([[8, 3], [3, 3]]))
      >>> plan.distinct, plan.misses, plan.lookups, plan.inverse.tolist()
      (2, 2, 4, [[0, 1], [1, 1]])
    """

    index: int  # type: ignore[assignment]  # the field shadows tuple.index
    unique_slots: np.ndarray
    inverse: np.ndarray
    fetch_ids: np.ndarray
    fetch_slots: np.ndarray
    evict_ids: np.ndarray
    evict_slots: np.ndarray
    lookups: int
    hits: int
    access_hits: int
    evictions: int

    @property
    def distinct(self) -> int:
        """Distinct ids in the batch."""
        return len(self.unique_slots)

    @property
    def misses(self) -> int:
        """Distinct ids fetched from the host."""
        return len(self.fetch_ids)


# Compared with ids where there is no padding id: equal to none of them.
_NO_PAD = np.iinfo(np.int64).min
# ``place_rows``' arrays for what a plan does not have: a policy's mirror
# (``per_id``, ``per_slot``) or lookups to count.
_NONE = (np.zeros(0, np.int64), np.zeros(0, np.int64))


def check_state(state: dict[str, Any], num_embeddings: int) -> None:
    """Raises ``ValueError`` when a planner ``state_dict`` does not fit a
    table of ``num_embeddings`` rows (ids out of range, twice, bad shapes)."""
    n = num_embeddings
    ids = np.asarray(state["id_of_slot"], np.int64)
    last_use = np.asarray(state["last_use"], np.int64)
    if ids.ndim != 1 or last_use.shape != ids.shape:
        raise ValueError(
            f"id_of_slot {ids.shape} and last_use {last_use.shape} must be two vectors "
            "of the same length (one entry per slot)."
        )
    resident_ids = ids[ids >= 0]
    if ids.size and (ids.min() < -1 or ids.max() >= n):
        raise ValueError(f"saved slots hold ids outside [0, {n}); is this the same table?")
    if np.unique(resident_ids).size != resident_ids.size:
        raise ValueError("saved slots hold an id twice; the state is corrupt.")
    index, finished = state.get("next_index", 0), state.get("finished", -1)
    if index < 0 or not -1 <= finished < index:
        raise ValueError(
            f"saved next_index={index} and finished={finished} are not a plan count and a plan "
            "made before it; the state is corrupt."
        )
    counts = dict(state.get("policy", {})).get("counts")
    if counts is not None and np.shape(counts) != (n,):
        raise ValueError(
            f"saved access counts have shape {np.shape(counts)}, the table has {n} rows."
        )


class _Checked(NamedTuple):
    """A batch looked up and checked against the capacity, not yet planned
    (``Planner.check``, then ``Planner.commit`` or ``Planner.abandon``). Its
    misses are coded in the directory meanwhile (see ``kernels.lookup``)."""

    shape: tuple[int, ...]
    inverse: np.ndarray | None  # int32 [ids]: each id's row, -1 for padding
    hits: np.ndarray  # int32 [h] distinct hit slots, in order of appearance
    miss_ids: np.ndarray  # [m] distinct missed ids, in order of appearance
    counts: np.ndarray  # int64 [h + m] lookups of each row
    lookups: int
    missed: int  # missed lookups
    stamp: int
    hit_rows: np.ndarray  # int32 [h] each hit's row (in order of first appearance)
    miss_rows: np.ndarray  # int32 [m] each miss's row
    first: np.ndarray | None = None  # entries: each source's ranks' rows (lookup_entries)
    bounds: np.ndarray | None = None
    sent: np.ndarray | None = None


class Planner:
    """Directory of resident rows plus the eviction policy, for one device.

    With rows split over several devices each device has a planner of its own
    over the ids homed there (``jaxcache.Partitions``); this class plans one
    such partition, or a whole table on one device.

    Args:
      config: the table's configuration (capacity, policy, padding id).
      frequencies: ``int [N]`` access counts from the dataset: the static
        priority of the ``"frequency"`` policy (required there) and the seed
        of ``"lfu"`` counts (optional).
      reserve: victim candidates kept between full scans of the slots (at
        least twice the misses of a step); it changes speed, never the choice.

    Attributes:
      slot_of_id: ``int32 [N]``, ``-1`` when the id is not resident.
      id_of_slot: ``int64 [C]``, ``-1`` for a free slot.
      last_use: ``int64 [C]``, index of the last plan that used the slot.
      dirty: ``bool [C]``, the slot's row changed since it was fetched.
      released: plans with an index up to this one are finished; their rows
        may be evicted.

    Examples:
      >>> import numpy as np, jaxcache
      >>> cfg = jaxcache.CacheConfig(num_embeddings=10, features=2, capacity=3, policy="lru")
      >>> planner = jaxcache.planning.Planner(cfg)
      >>> plan = planner.plan(np.array([7, 2, 7]))
      >>> plan.fetch_ids.tolist(), plan.inverse.tolist()
      ([7, 2], [0, 1, 0])
      >>> planner.release(plan.index)  # its step is done: rows may be evicted
      >>> plan = planner.plan(np.array([2, 5, 9]))  # 7 is the least recent
      >>> plan.hits, plan.fetch_ids.tolist(), int(planner.slot_of_id[7])
      (1, [5, 9], -1)
    """

    def __init__(
        self,
        config: CacheConfig,
        *,
        frequencies: np.ndarray | None = None,
        reserve: int = 4096,
    ) -> None:
        self.config = config
        capacity, n = int(config.capacity), config.num_embeddings
        self.policy = policies.make_policy(config.policy, n, capacity, frequencies)
        # place_rows adds lookups to the mirror's per-id values: none to add to
        # would write past an empty array.
        assert self.policy.mirror is not None or not self.policy.counts_lookups
        self.slot_of_id = np.full(n, -1, np.int32)
        self.id_of_slot = np.full(capacity, -1, np.int64)
        self.last_use = np.full(capacity, -1, np.int64)
        self.dirty = np.zeros(capacity, np.bool_)
        self.released = -1
        self.next_index = 0
        # Scratch for each distinct slot's rank in a plan; only entries written
        # in the same plan are read, so it is never cleared.
        self._rank = np.empty(capacity, np.int32)
        # Slots protected from eviction while planning: the batch's hits carry
        # the current stamp (and, when room is tight, the in-flight plans'
        # slots, to count them); the other in-flight ones are known by
        # last_use. A plan never scans all C slots to find them.
        self._mark = np.zeros(capacity, np.int64)
        self._stamp = 0
        # Per slot, the last source that sent it and its rank there (lazily;
        # ``lookup_entries``).
        self._source: np.ndarray | None = None
        self._in_flight: dict[int, np.ndarray] = {}  # plan index -> its slots
        self._finished = -1  # the plan being made protects what plans after it use
        # Victim candidates (see _snapshot) and the (key, slot) bound they cover.
        self.reserve = int(reserve)
        self._candidates: np.ndarray | None = None
        self._threshold: tuple[int, int] | None = None
        self._keys: np.ndarray | None = None  # the rebuild's scratch (lazily)

    @property
    def capacity(self) -> int:
        """``C``, the number of slots."""
        return int(self.config.capacity)

    def release(self, index: int) -> None:
        """Marks plans up to ``index`` finished: their rows become evictable."""
        self.released = max(self.released, int(index))

    def resident_ids(self) -> np.ndarray:
        """Ids currently in a slot, in slot order."""
        return self.id_of_slot[self.id_of_slot >= 0]

    def check_invariants(self, name: str = "planner") -> None:
        """Checks the bookkeeping; raises ``AssertionError`` naming ``name`` if broken.

        The directory is a bijection between resident ids and their slots,
        ids are in range, only resident rows are dirty, recency never runs
        ahead of the plans, and a policy's per-slot mirror (a counting
        policy's counts, the adaptive policy's prior) matches its per-id
        values. ``O(N + C)``: for tests and soak runs.
        """
        n, capacity = self.config.num_embeddings, self.capacity
        ids = self.id_of_slot
        occupied = np.flatnonzero(ids >= 0)
        resident = ids[occupied]

        def fail(message: str) -> None:
            raise AssertionError(f"{name}: {message}")

        if ids.size != capacity or ids.min(initial=0) < -1 or ids.max(initial=-1) >= n:
            fail(f"slots hold ids outside [0, {n})")
        if np.unique(resident).size != resident.size:
            fail("an id is held by two slots")
        mapped = np.count_nonzero(self.slot_of_id >= 0)
        if mapped != resident.size:
            fail(f"{mapped} ids map to a slot but {resident.size} slots hold an id")
        if not np.array_equal(self.slot_of_id[resident], occupied):
            fail("slot_of_id and id_of_slot disagree")
        if self.slot_of_id.max(initial=-1) >= capacity:
            fail(f"an id maps to a slot beyond the capacity {capacity}")
        if self.dirty[ids < 0].any():
            fail("a free slot is marked dirty")
        if self.last_use.max(initial=-1) >= self.next_index:
            fail("a slot was used by a plan that does not exist yet")
        if self.released >= self.next_index:
            fail("a plan was released before it was made")
        mirror = self.policy.mirror
        if mirror is not None and not np.array_equal(mirror[1][occupied], mirror[0][resident]):
            fail("the policy's per-slot mirror disagrees with its per-id values")

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The planner's state for a checkpoint: directory, recency and policy.

        Taken with every row clean (after ``EmbeddingCache.flush``), so the
        ``dirty`` flags are not part of it. The arrays are the planner's own,
        not copies: write them out before planning again.

        Returns:
          ``{"id_of_slot": int64 [C], "last_use": int64 [C], "finished": int,
          "next_index": int, "policy": dict}``: ``finished`` is the bound of
          the latest plan (``finished``), which a restore onto the same
          capacity and policy keeps.

        Examples:
          >>> import numpy as np, jaxcache
          >>> cfg = jaxcache.CacheConfig(10, 2, capacity=3, policy="lru")
          >>> planner = jaxcache.planning.Planner(cfg)
          >>> _ = planner.plan(np.array([4, 7]), train=False)
          >>> state = planner.state_dict()
          >>> state["id_of_slot"].tolist(), state["next_index"], state["policy"]
          ([4, 7, -1], 1, {'name': 'lru'})
        """
        # Rows of the batches in flight stay marked dirty after a flush (their
        # step may still change them); any other dirty row was never written.
        stale = self.dirty & (self.last_use <= self.released)
        if stale.any():
            raise RuntimeError(
                f"{int(stale.sum())} resident rows changed on device since they were "
                "fetched; write them back with EmbeddingCache.flush(state) first."
            )
        return {
            "id_of_slot": self.id_of_slot,
            "last_use": self.last_use,
            "finished": self._finished,
            "next_index": self.next_index,
            "policy": self.policy.state_dict(),
        }

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """Raises ``ValueError`` when ``state`` (a ``state_dict``) does not fit this table."""
        check_state(state, self.config.num_embeddings)

    @property
    def finished(self) -> int:
        """The latest bound a plan was made under (``plan``'s ``finished``):
        rows of the plans after it are still protected from the next plan."""
        return self._finished

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a ``state_dict``, onto this planner's capacity.

        With the capacity and policy it was saved with, every row goes back to
        its slot. Otherwise the previously resident rows are placed hottest
        first (by the saved access counts where the policy kept them, then by
        recency) until the slots are full; where counts were saved, slots left
        over take the hottest other ids. Either way nothing is in flight and
        every row is clean afterwards. The host table must hold the rows.

        Args:
          state: what ``state_dict`` returned (possibly read back from disk).

        Raises:
          ValueError: the state does not fit this table (nothing changed).

        Examples:
          >>> import numpy as np, jaxcache
          >>> planner = jaxcache.planning.Planner(jaxcache.CacheConfig(10, 2, capacity=3))
          >>> _ = planner.plan(np.array([4, 7, 7, 2]), train=False)
          >>> smaller = jaxcache.planning.Planner(jaxcache.CacheConfig(10, 2, capacity=1))
          >>> smaller.load_state_dict(planner.state_dict())
          >>> smaller.resident_ids().tolist(), smaller.next_index  # the hottest row
          ([7], 1)
        """
        self.check_state_dict(state)
        ids = np.asarray(state["id_of_slot"], np.int64)
        last_use = np.asarray(state["last_use"], np.int64)
        next_index = int(state["next_index"])
        resident = np.flatnonzero(ids >= 0)
        resident_ids = ids[resident]
        policy_state = dict(state.get("policy", {}))
        counts = policy_state.get("counts")
        self.policy.load_state_dict(policy_state)
        self.slot_of_id[:] = -1
        self.id_of_slot[:] = -1
        self.last_use[:] = -1
        self.dirty[:] = False
        self.next_index = next_index
        self.released = next_index - 1
        self._in_flight = {}
        self._finished = self.released
        self.forget_candidates()
        if ids.size == self.capacity and policy_state.get("name") == self.policy.name:
            self.id_of_slot[:] = ids
            self.slot_of_id[resident_ids] = resident
            self.last_use[:] = last_use
            # The same bound as before: the next pipeline's first plans keep
            # protecting the rows of the last ones, as they would have; the
            # room check counts those rows by the plans that used them last.
            self._finished = min(int(state.get("finished", self.released)), self.released)
            kept = np.flatnonzero(self.last_use > self._finished)
            for index in np.unique(self.last_use[kept]):
                self._in_flight[int(index)] = kept[self.last_use[kept] == index]
            self._placed(resident, resident_ids)
            return
        recency = last_use[resident]
        if counts is None:
            order = np.lexsort((resident, -recency))
            ranked = resident_ids[order]
        else:
            counts = np.asarray(counts)
            order = np.lexsort((resident, -recency, -counts[resident_ids]))
            extra = hottest(counts, self.capacity + resident_ids.size)
            ranked = np.concatenate([resident_ids[order], extra])
        placed, slots = self.warm(ranked)
        if resident_ids.size and placed.size:
            sorter = np.argsort(resident_ids)
            at = np.minimum(np.searchsorted(resident_ids, placed, sorter=sorter), sorter.size - 1)
            was_resident = resident_ids[sorter[at]] == placed
            self.last_use[slots[was_resident]] = recency[sorter[at[was_resident]]]

    def warm(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Places ``ids`` (not yet resident) into free slots, in order.

        Used to preload the hottest rows. Ids beyond the free slots are
        ignored. Returns the placed ``(ids, slots)``; the caller copies those
        rows to the device.
        """
        ids = validation.check_ids(ids, self.config.num_embeddings, None, "ids").reshape(-1)
        ids = ids[self.slot_of_id[ids] < 0]
        _, first = np.unique(ids, return_index=True)
        ids = ids[np.sort(first)]
        free = np.flatnonzero(self.id_of_slot < 0)[: ids.size]
        ids = ids[: free.size]
        self.slot_of_id[ids] = free
        self.id_of_slot[free] = ids
        self._placed(free, ids)
        return ids, free.astype(np.int32)

    def _placed(self, slots: np.ndarray, ids: np.ndarray) -> None:
        """Tells the policy that rows ``ids`` were placed in ``slots``
        outside a plan (a plan's ``place_rows`` copies the mirror itself)."""
        if self.policy.mirror is not None:
            per_id, per_slot = self.policy.mirror
            per_slot[slots] = per_id[ids]
        self.policy.on_insert(self, slots, ids)

    def forget_candidates(self) -> None:
        """Drops the victim candidates: call it when priorities of resident
        rows may have decreased (the next victim choice rescans the slots)."""
        self._candidates = None
        self._threshold = None

    def plan(
        self,
        ids: np.ndarray,
        *,
        train: bool = True,
        released: int | None = None,
        max_distinct: int | None = None,
    ) -> Plan:
        """Plans one batch: ``check``, then ``commit``.

        Args:
          ids: integer ids of any shape ``[B, ...]``.
          train: the batch will update its rows (they become dirty).
          released: plan as if only the plans up to this index were
            finished (at most ``self.released``; default: all released). A
            pipeline passes a bound that does not depend on the timing of
            its threads, so that a run plans the same slots however its
            threads interleave.
          max_distinct: refuse a batch with more distinct ids (the lists of
            the host-callback form have this fixed size).

        Returns:
          The plan. The directory already reflects it.

        Raises:
          TypeError, ValueError: bad ids, or more than ``max_distinct``
            distinct ids (nothing changed).
          CapacityError: the batch's distinct ids do not fit next to the rows
            that in-flight batches protect (nothing changed).
        """
        checked = self.check(ids, released=released, max_distinct=max_distinct)
        return self.commit(checked, train=train)

    def check(
        self, ids: np.ndarray, *, released: int | None = None, max_distinct: int | None = None
    ) -> _Checked:
        """Looks ``ids`` up and checks that the batch fits; the directory only
        holds codes for its misses until ``commit`` (or ``abandon``), which
        must come before the next batch is checked. Arguments and errors as
        for ``plan`` (after an error nothing has changed)."""
        cfg = self.config
        # The values: in the loop below, but for those it would take for padding.
        array = validation.check_host_ids(ids, cfg.num_embeddings, cfg.padding_id, "ids")
        flat = kernels.as_index_array(array)
        pad = _NO_PAD if cfg.padding_id is None else cfg.padding_id
        self._stamp += 1  # the hits are marked protected as they are found
        size = flat.size
        hits = np.empty(min(size, self.capacity), np.int32)
        hit_rows = np.empty(hits.size, np.int32)
        miss_ids = np.empty(min(size, cfg.num_embeddings), np.int64)
        miss_rows = np.empty(miss_ids.size, np.int32)
        counts = np.empty(miss_ids.size, np.int64)  # room for every distinct id
        inverse = np.empty(size, np.int32)
        h, m, missed, lookups, bad = kernels.lookup(
            flat,
            pad,
            cfg.num_embeddings,
            self.slot_of_id,
            self._rank,
            self._mark,
            self._stamp,
            inverse,
            hits,
            hit_rows,
            miss_ids,
            miss_rows,
            counts,
        )
        if bad >= 0:  # check_ids words the error; the kernel found where
            validation.check_ids(array, cfg.num_embeddings, cfg.padding_id, "ids")
            raise ValueError(f"ids hold {flat[bad]}, outside [0, {cfg.num_embeddings}).")
        checked = _Checked(
            array.shape,
            inverse,
            hits[:h],
            miss_ids[:m],
            counts[: h + m],
            int(lookups),
            int(missed),
            self._stamp,
            hit_rows[:h],
            miss_rows[:m],
        )
        return self._admit(checked, released, max_distinct)

    def check_entries(
        self,
        local: np.ndarray,
        chunk_lo: np.ndarray,
        chunk_hi: np.ndarray,
        ranks: np.ndarray,
        source_stamp: int,
        entries: int,
        *,
        released: int | None = None,
        per_source: int = 1,
    ) -> _Checked:
        """``check`` for a device partition's entries: real local ids
        ``local[chunk_lo[g]:chunk_hi[g]]``, ``per_source`` chunks ``g`` from
        each source in turn.

        Also ranks the distinct ids each source sends (``lookup_entries``),
        writing each entry's rank to ``ranks`` at the entry's index.
        ``entries``: how many entries the chunks hold in all (the caller
        counts them for every partition at once).
        """
        self._stamp += 1
        size = entries
        if self._source is None:
            self._source = np.zeros((self.capacity, 2), np.int64)
        hits = np.empty(min(size, self.capacity), np.int32)
        hit_rows = np.empty(hits.size, np.int32)
        miss_ids = np.empty(min(size, self.config.num_embeddings), np.int64)
        miss_rows = np.empty(miss_ids.size, np.int32)
        counts = np.empty(miss_ids.size, np.int64)  # room for every distinct id
        first = np.empty(size, np.int32)
        sources = chunk_lo.size // per_source
        sent = np.empty(sources, np.int64)
        bounds = np.empty(sources + 1, np.int64)
        h, m, missed = kernels.lookup_entries(
            local,
            chunk_lo,
            chunk_hi,
            self.slot_of_id,
            self._rank,
            self._mark,
            self._stamp,
            self._source,
            source_stamp,
            hits,
            hit_rows,
            miss_ids,
            miss_rows,
            counts,
            np.empty(miss_ids.size, np.int64),  # by row: a miss's last source
            np.empty(miss_ids.size, np.int32),  # and its rank there
            first,
            sent,
            bounds,
            ranks,
            per_source,
        )
        checked = _Checked(
            (size,),
            None,
            hits[:h],
            miss_ids[:m],
            counts[: h + m],
            size,
            int(missed),
            self._stamp,
            hit_rows[:h],
            miss_rows[:m],
            first,
            bounds,
            sent,
        )
        return self._admit(checked, released, None)

    def _admit(self, checked: _Checked, released: int | None, max_distinct: int | None) -> _Checked:
        """``checked`` if the batch fits next to the in-flight rows; else the
        directory's miss codes are cleared and the refusal raised."""
        h, m = checked.hits.size, checked.miss_ids.size
        distinct = h + m
        error: Exception | None = None
        if max_distinct is not None and distinct > max_distinct:
            error = ValueError(
                f"the batch has {distinct} distinct ids, but the host-callback form pads its "
                f"lists to callback_rows={max_distinct}; raise CacheConfig(callback_rows=...) "
                f"to at least {distinct}, or leave it None to pad to the batch's number of ids."
            )
        elif distinct > self.capacity:
            error = CapacityError(
                f"the batch has {distinct} distinct ids but capacity is {self.capacity} rows; "
                f"raise capacity to at least {distinct} or use smaller batches."
            )
            error.distinct = distinct
        else:
            finished = self.released if released is None else min(int(released), self.released)
            available = self.capacity - h - self._guard(finished, distinct)
            if m > available:
                error = self._no_room(checked.hits, m, available)
        if error is not None:
            self.abandon(checked)
            raise error
        return checked

    def abandon(self, checked: _Checked) -> None:
        """Forgets a checked batch that will not be committed."""
        kernels.restore_misses(self.slot_of_id, checked.miss_ids, checked.miss_ids.size)

    def commit(self, checked: _Checked, *, train: bool = True) -> Plan:
        """Plans the batch ``check`` accepted: victims, directory, recency, policy.

        Nothing may have been checked or planned in between.
        """
        if checked.stamp != self._stamp:
            raise RuntimeError("the planner checked another batch since; check this one again.")
        hits, miss_ids = checked.hits, checked.miss_ids
        index = self.next_index
        self.next_index += 1
        victims = self._choose_victims(miss_ids.size)
        evict_ids = np.empty(victims.size, np.int64)
        evict_slots = np.empty(victims.size, np.int32)
        # Distinct slots: in the order their ids first appear in the batch
        # (a partition's: source after source), the rows ``lookup`` numbered;
        # the misses take victims of rising slot in their order of appearance.
        h = hits.size
        unique_slots = np.empty(h + victims.size, np.int32)
        policy = self.policy
        # Old rows out (the dirty ones listed), new rows in (the misses'
        # directory codes replaced by their slots), every slot used.
        evictions, written = kernels.place_rows(
            victims,
            miss_ids,
            hits,
            self.slot_of_id,
            self.id_of_slot,
            self.dirty,
            self.last_use,
            *(policy.mirror or _NONE),
            checked.counts if policy.counts_lookups else _NONE[0],
            checked.hit_rows,
            checked.miss_rows,
            index,
            train,
            evict_ids,
            evict_slots,
            unique_slots,
        )
        policy.on_insert(self, victims, miss_ids)
        inverse = checked.inverse
        if inverse is not None:
            inverse = inverse.reshape(checked.shape)
        else:  # a partition's: its sources' ranks' rows
            inverse = checked.first
            assert inverse is not None, "a plan without ranks has its sources' entries"
        self._in_flight[index] = unique_slots
        policy.record(self, unique_slots, checked.counts if policy.needs_counts else None)
        return Plan(
            index=index,
            unique_slots=unique_slots,
            inverse=inverse,
            fetch_ids=miss_ids,  # int64, fresh: each check's own
            fetch_slots=victims,
            evict_ids=evict_ids[:written],
            evict_slots=evict_slots[:written],
            lookups=checked.lookups,
            hits=int(h),
            access_hits=int(checked.lookups - checked.missed),
            evictions=int(evictions),
        )

    def _no_room(self, hit_unique: np.ndarray, misses: int, available: int) -> CapacityError:
        """The error for misses that do not fit next to in-flight rows, with
        ``fits_after``: the batch fits once at most ``room`` other slots stay
        protected, that is once the plan holding the room-th most recent of
        them is released."""
        room = self.capacity - hit_unique.size - misses
        others = np.delete(self.last_use, hit_unique)
        error = CapacityError(
            f"the batch needs {misses} new rows but only {available} of {self.capacity} "
            "slots are free of in-flight batches; raise capacity, use smaller batches or a "
            "shorter look-ahead."
        )
        error.fits_after = int(-np.partition(-others, room)[room])
        return error

    def _guard(self, finished: int, distinct: int) -> int:
        """How many slots the plans after ``finished`` protect, besides the
        batch's hits; ``self._finished`` rises to ``finished``.

        A slot is protected while a plan after ``_finished`` uses it, that is
        while ``last_use > _finished``. When the in-flight plans hold too few
        slots to crowd out the batch's ``distinct`` ids (the usual case),
        their total bounds the count well enough and nothing is counted (0);
        otherwise their slots are stamped and counted exactly.
        ``O(slots of the plans in flight)`` at most, never ``O(C)``.
        """
        # Never lowered: a plan made after a wait for room (a later bound)
        # leaves the plans it waited for unprotected for good.
        self._finished = max(self._finished, finished)
        for index in [i for i in self._in_flight if i <= self._finished]:
            del self._in_flight[index]
        bound = sum(slots.size for slots in self._in_flight.values())
        if distinct + bound <= self.capacity:
            return 0  # room, however they overlap
        counts = np.zeros(1, np.int64)
        for slots in self._in_flight.values():
            kernels.mark_new(slots, self._mark, self._stamp, self.capacity, counts)
        return int(counts[0])

    def _snapshot(self, size: int) -> None:
        """Keeps the ``size`` slots of lowest ``(key, slot)`` as victim candidates.

        Keys never decrease while a row stays (policies guarantee it, or call
        ``forget_candidates``; a slot that gets a new row is a victim, hence a
        candidate already), so every slot left out keeps a ``(key, slot)``
        above the threshold, and a choice made among candidates that stays at
        or below it is the global choice.
        """
        if size >= self.capacity:
            self._candidates = np.arange(self.capacity)
            self._threshold = None  # every slot is a candidate
            return
        if self._keys is None:
            self._keys = np.empty(self.capacity, np.uint64)
        candidates = np.empty(size, np.int64)
        key, slot = kernels.reserve_candidates(
            self.id_of_slot, self.policy.priorities(self), size, self._keys, candidates
        )
        self._candidates = candidates
        self._threshold = (int(key), int(slot))

    def _choose_victims(self, count: int) -> np.ndarray:
        """The ``count`` unprotected slots of lowest ``(key, slot)``, by slot.

        Free slots come first (the lowest int64 key, below any priority, as on
        the device planner); then the policy's priority of the resident row,
        lowest first; ties go to the lower slot. Victims are picked among a
        reserve of low-key candidates, so a step costs ``O(reserve)`` rather
        than ``O(C)``; the reserve is rebuilt with one partial sort over all
        slots only when it no longer provably holds the answer.
        """
        if count == 0:
            return np.empty(0, np.int32)
        size = max(self.reserve, 2 * count, math.isqrt(self.capacity * count))
        # A reserve of every slot (grown while many slots were protected, or
        # while the cache filled) is dropped once a smaller one will do:
        # kept, it would make every later step scan all C slots.
        everything = self._threshold is None and size < self.capacity
        fresh = self._candidates is None or self._candidates.size < count or everything
        if fresh:
            self._snapshot(size)
        victims = np.empty(count, np.int32)
        while True:
            reserve, threshold = self._candidates, self._threshold
            assert reserve is not None, "_snapshot made the reserve"
            found, key, slot = kernels.choose_victims(
                reserve,
                self._mark,
                self._stamp,
                self.last_use,
                self._finished,
                self.id_of_slot,
                self.policy.priorities(self),
                count,
                victims,
            )
            if found >= count and (threshold is None or (key, slot) <= threshold):
                return victims
            if threshold is None:  # every slot was a candidate: _guard let too much in
                raise RuntimeError(
                    f"{count} victims needed but only {found} slots are "
                    "unprotected; the planner's room check is wrong."
                )
            # A reserve left from earlier steps gets a fresh one of the usual
            # size; only a fresh one that failed (too many protected) grows.
            if fresh:
                size *= 2
            self._snapshot(size)
            fresh = True
