"""The DRAM tier of a ``TieredTable``: a fixed number of row records in memory.

The tier holds ``slots`` records (a row with its optimizer state, packed into
words) and an index ``slot_of [N]`` from row to slot. Rows are split into
``shards`` by ``row % shards``; each shard owns a contiguous range of slots,
its own lock, free list and clock hand, so threads working on different rows
copy in parallel and only meet on a shard's lock for the rows they share a
shard with. Records are copied under the shard's lock; disk reads and
writes happen outside every shard lock.

Replacement is CLOCK (second chance), per shard: a row read or written gets
its reference bit; the hand clears set bits and evicts the first row found
with none. A clean row is dropped (its record on disk is current); a dirty
one (written since it came from the disk) is copied out and, with the other
dirty victims of the sweep, appended to the disk log in one write.
Evictions run in batches of ``reclaim_batch`` slots (up to 4 MiB of
records, at most a thirty-second of a shard), so that rows leave for the
disk in large writes, not one at a time, once a shard holds a few thousand.

A row that becomes dirty in the tier has its disk record marked garbage
(``RowLog.forget``): garbage collection never moves a stale copy, and the
row's next write is its only copy on disk.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any, NamedTuple, Protocol

import numpy as np
from numba import types

from jaxcache._src.compiled import kernel

__all__ = ["DramTier", "Fields", "TierStats", "fields", "pack"]

_REFERENCED, _DIRTY = 1, 2
# Bytes a slot takes beside its record: the row it holds (``slot_id``,
# int64), its place in the free list (``free``, int64) and its flags (uint8).
SLOT_BYTES = 17
# Slots a shard frees per eviction sweep: about this many bytes of records,
# at most a thirty-second of the shard (then it keeps few slots idle).
_RECLAIM_BYTES = 4 << 20
# Per-shard counters (rows of TierStats).
_LOOKUPS, _HITS, _FILLED, _UPDATED, _INSERTED, _EVICTED, _EVICTED_DIRTY = range(7)


class Store(Protocol):
    """What the tier needs from the disk below it (``RowLog``)."""

    def reserve(self, owners: np.ndarray, records: np.ndarray) -> object: ...

    def write(self, ticket: Any) -> None: ...  # what reserve returned

    def write_unwritten(self) -> None: ...  # the writes that failed, again

    def forget(self, owners: np.ndarray) -> None: ...

    def read(self, owners: np.ndarray, out: np.ndarray) -> None: ...

    def collect(self) -> None: ...


@dataclasses.dataclass
class TierStats:
    """What the DRAM tier served and moved.

    Attributes:
      slots: rows the tier holds.
      lookups: rows the device cache fetched (``gather_into``; exports,
        checkpoints and column views are not counted, and leave the tier
        as it was).
      hits: of those, rows found in the tier.
      updated: rows written while in the tier.
      inserted: rows written that were not in the tier (a slot taken).
      filled: rows read from the disk and kept in the tier.
      evicted: rows that left the tier.
      evicted_dirty: of those, rows written to the disk (changed since read).

    Examples:
      >>> from jaxcache.stats import TierStats
      >>> TierStats(lookups=10, hits=7).hit_rate
      0.7
    """

    slots: int = 0
    lookups: int = 0
    hits: int = 0
    updated: int = 0
    inserted: int = 0
    filled: int = 0
    evicted: int = 0
    evicted_dirty: int = 0

    @property
    def hit_rate(self) -> float:
        """Hits over lookups (``0`` before any lookup)."""
        return self.hits / self.lookups if self.lookups else 0.0


class DramTier:
    """``slots`` records of ``num_rows`` rows in memory, over a ``Store``.

    Records are ``[slots, record_bytes]`` bytes; callers pass their rows as
    ``Fields`` (``fields(arrays, offsets)``): C-contiguous arrays, each placed
    at a byte offset of the record.

    Args:
      num_rows: rows of the table.
      slots: records the tier holds (rounded down to a multiple of the shards).
      record_bytes: bytes per record.
      store: the disk below.
      shards: independent parts (locks, clock hands); at most ``slots``.
      batch_for: the record size eviction batches are sized for (default:
        ``record_bytes``; a replay with empty records passes the real one).

    Examples:
      >>> import numpy as np
      >>> from jaxcache._src.dram_tier import DramTier
      >>> class Nowhere:  # a store that is never needed: every row fits
      ...     pass
      >>> tier = DramTier(4, 4, 4, Nowhere(), shards=2)
      >>> tier.fill(np.arange(4), np.arange(10, 14, dtype=np.uint32)[:, None].view(np.uint8)).size
      0
      >>> out = np.zeros((2, 1), np.uint32)
      >>> tier.read(np.array([3, 1]), np.arange(2), fields([out], [0]), keep=True)
      >>> out.ravel().tolist(), tier.stats().hit_rate
      ([13, 11], 1.0)
    """

    def __init__(
        self,
        num_rows: int,
        slots: int,
        record_bytes: int,
        store: Store,
        *,
        shards: int = 16,
        batch_for: int | None = None,
    ) -> None:
        shards = max(1, min(int(shards), int(slots)))
        per = int(slots) // shards
        if slots >= num_rows:
            # Room for every row: row r goes to shard r % shards, so each
            # shard gets room for all of its rows (a few slots past
            # ``num_rows`` when the shards do not divide it).
            per = -(-int(num_rows) // shards)
        self.shards = shards
        self.per_shard = per
        self.slots = per * shards
        self.store = store
        self.record_bytes = int(record_bytes)
        self.records = np.zeros((self.slots, self.record_bytes), np.uint8)
        index = np.int32 if self.slots < 2**31 - 1 else np.int64
        self.slot_of = np.full(num_rows, -1, index)
        self.slot_id = np.full(self.slots, -1, np.int64)
        self.flags = np.zeros(self.slots, np.uint8)
        # Shard k's free slots are free[k * per : k * per + free_count[k]].
        self.free = np.arange(self.slots, dtype=np.int64)
        self.free_count = np.full(shards, per, np.int64)
        self.hands = np.arange(shards, dtype=np.int64) * per
        self.counters = np.zeros((shards, 7), np.int64)
        self.locks = [threading.Lock() for _ in range(shards)]
        sized = self.record_bytes if batch_for is None else batch_for
        self.reclaim_batch = max(1, min(per // 32, _RECLAIM_BYTES // max(1, sized)))

    # ----------------------------------------------------------------- reads
    def read(
        self,
        rows: np.ndarray,
        at: np.ndarray,
        into: Fields,
        *,
        keep: bool,
    ) -> None:
        """Copies rows ``rows[j]`` into row ``at[j]`` of the fields: from the tier,
        or from the store for the rows it does not hold. With ``keep`` (the
        device cache's fetches) they are kept in the tier afterwards, clean,
        and the read counts as a use: hits get their reference bit, and the
        lookups and hits are counted. Without (exports, checkpoints, column
        views), the tier is left as it was, so that its choices and figures
        stay those a replay of the cache's fetches gives."""
        missing = []
        for shard, chosen in self._by_shard(rows):
            misses = np.empty(chosen.size, np.int64)
            with self.locks[shard]:
                m = _read_hits(
                    chosen, rows, at, self.slot_of, self.records.ctypes.data, self.record_bytes,
                    self.flags, keep, *into, misses,
                )  # fmt: skip
                if keep:
                    counters = self.counters[shard]
                    counters[_LOOKUPS] += chosen.size
                    counters[_HITS] += chosen.size - m
            if m:
                missing.append(misses[:m])
        if not missing:
            return
        misses = np.concatenate(missing)
        records = np.empty((misses.size, self.record_bytes), np.uint8)
        self.store.read(rows[misses], records)
        _unpack(records.ctypes.data, self.record_bytes, at[misses], *into)
        if keep:
            tickets: list[object] = []
            positions = np.arange(misses.size)
            for shard, chosen in self._by_shard(rows[misses]):
                with self.locks[shard]:
                    self._take(shard, chosen, rows[misses], positions, records, tickets)
            # The rows were read: a write that fails (the disk full) keeps
            # its rows in memory for the next write, which reports it.
            self._write_out(tickets, report=False)

    # ---------------------------------------------------------------- writes
    def write(
        self,
        rows: np.ndarray,
        at: np.ndarray,
        source: Fields,
    ) -> None:
        """Writes row ``at[j]`` of the fields as row ``rows[j]``, dirty, taking slots
        (and evicting) for rows the tier does not hold."""
        tickets: list[object] = []
        for shard, chosen in self._by_shard(rows):
            with self.locks[shard]:
                self._take(shard, chosen, rows, at, source, tickets)
        self._write_out(tickets)

    def fill(self, rows: np.ndarray, records: np.ndarray) -> np.ndarray:
        """Puts ``records`` of rows not yet anywhere into free slots, dirty,
        without evicting; returns the positions of those that did not fit."""
        left = []
        for shard, chosen in self._by_shard(rows):
            with self.locks[shard]:
                lo = shard * self.per_shard
                done = _insert(
                    chosen, rows, np.arange(rows.size), records.ctypes.data, _DIRTY,
                    self.slot_of, self.slot_id, self.records.ctypes.data, self.record_bytes,
                    self.flags, self.free[lo : lo + self.per_shard],
                    self.free_count[shard : shard + 1],
                )  # fmt: skip
                self.counters[shard, _INSERTED] += done
            left.append(chosen[done:])
        return np.sort(np.concatenate(left)) if left else np.zeros(0, np.int64)

    def _take(self, shard, chosen, rows, at, source, tickets) -> None:
        """Writes the ``chosen`` rows into shard ``shard`` (with its lock held):
        from ``Fields`` at ``at`` (dirty), or from records at ``at`` (clean,
        read from the store)."""
        lo = shard * self.per_shard
        free = self.free[lo : lo + self.per_shard]
        free_count = self.free_count[shard : shard + 1]
        counters = self.counters[shard]
        done = 0
        while True:
            rest = chosen[done:]
            if isinstance(source, np.ndarray):
                written = _insert(
                    rest, rows, at, source.ctypes.data, 0, self.slot_of, self.slot_id,
                    self.records.ctypes.data, self.record_bytes, self.flags, free, free_count,
                )  # fmt: skip
                counters[_FILLED] += written
            else:
                dirtied = np.empty(rest.size, np.int64)
                written, inserted, d = _write_rows(
                    rest, rows, at, *source, self.slot_of, self.slot_id, self.records.ctypes.data,
                    self.record_bytes, self.flags, free, free_count, dirtied,
                )  # fmt: skip
                counters[_INSERTED] += inserted
                counters[_UPDATED] += written - inserted
                if d:  # their disk records are stale from now on
                    self.store.forget(dirtied[:d])
            done += written
            if done == chosen.size:
                return
            target = max(chosen.size - done, self.reclaim_batch)
            out = np.empty((target, self.record_bytes), np.uint8)
            owners = np.empty(target, np.int64)
            freed, dirty, self.hands[shard] = _reclaim(
                lo, lo + self.per_shard, self.hands[shard], target, self.flags, self.slot_id,
                self.slot_of, self.records.ctypes.data, self.record_bytes, free, free_count,
                out.ctypes.data, owners,
            )  # fmt: skip
            if freed == 0:
                raise RuntimeError("the DRAM tier found no slot to free; it is corrupt.")
            counters[_EVICTED] += freed
            counters[_EVICTED_DIRTY] += dirty
            if dirty:  # published before the lock is released: readers find them
                tickets.append(self.store.reserve(owners[:dirty], out[:dirty]))

    def _write_out(self, tickets: list[object], *, report: bool = True) -> None:
        """Writes evicted dirty rows to the store, with those earlier writes
        failed to write. Every batch is tried: one that fails (the disk
        full) stays in memory, where reads find it, for the next call.

        Raises:
          OSError: a write failed (with ``report``); the rows are in the
            tier or in memory.
        """
        failed: OSError | None = None
        try:
            self.store.write_unwritten()
        except OSError as error:
            failed = error
        for ticket in tickets:
            try:
                self.store.write(ticket)
            except OSError as error:
                failed = failed or error
        if failed is None:
            if tickets:
                self.store.collect()
        elif report:
            raise OSError(
                failed.errno,
                f"writing evicted rows to the disk tier failed ({failed.strerror or failed}); "
                "nothing is lost: the rows stay in memory, beyond the DRAM budget, and go to "
                "the disk at the next eviction once it has room.",
            ) from failed

    # ----------------------------------------------------------------- other
    def _by_shard(self, rows: np.ndarray):
        """``(shard, positions of rows in it)`` for each shard with rows."""
        if self.shards == 1:
            yield 0, np.arange(rows.size)
            return
        order, starts = _group(rows, self.shards)
        for shard in range(self.shards):
            if starts[shard + 1] > starts[shard]:
                yield shard, order[starts[shard] : starts[shard + 1]]

    def stats(self) -> TierStats:
        """The counters, summed over the shards."""
        total = self.counters.sum(axis=0)
        return TierStats(
            slots=self.slots,
            lookups=int(total[_LOOKUPS]),
            hits=int(total[_HITS]),
            updated=int(total[_UPDATED]),
            inserted=int(total[_INSERTED]),
            filled=int(total[_FILLED]),
            evicted=int(total[_EVICTED]),
            evicted_dirty=int(total[_EVICTED_DIRTY]),
        )


class Fields(NamedTuple):
    """Where the rows of a call live: per array, its buffer's address, the
    bytes from one row to the next, and the bytes of the record it fills
    (``offset``, ``width``). Built by ``fields``; the arrays must outlive it."""

    address: np.ndarray
    stride: np.ndarray
    offset: np.ndarray
    width: np.ndarray


def fields(arrays: list[np.ndarray], offsets: np.ndarray) -> Fields:
    """``Fields`` of C-contiguous ``arrays`` placed at byte ``offsets`` of a record."""
    for array in arrays:
        if not array.flags.c_contiguous:
            raise ValueError(
                f"rows must be C-contiguous (got strides {array.strides}); copy them with "
                "np.ascontiguousarray first."
            )
    widths = [math.prod(a.shape[1:]) * a.itemsize for a in arrays]
    return Fields(
        np.array([a.ctypes.data for a in arrays], np.int64),
        np.array(widths, np.int64),
        np.asarray(offsets, np.int64),
        np.array(widths, np.int64),
    )


def pack(arrays: list[np.ndarray], offsets: np.ndarray, record_bytes: int) -> np.ndarray:
    """Records ``[n, record_bytes]`` of the rows of ``arrays``."""
    out = np.empty((len(arrays[0]), record_bytes), np.uint8)
    _pack(out.shape[0], *fields(arrays, offsets), out.ctypes.data, record_bytes)
    return out


# libc's memcpy, called from compiled loops with addresses as 64-bit integers
# (passed as pointers are on x86-64 and AArch64): a row is copied whole, where
# a loop over its words was several times slower.
_memcpy = types.ExternalFunction("memcpy", types.int64(types.int64, types.int64, types.uint64))


@kernel
def _group(rows, shards):
    """Positions of ``rows`` grouped by ``row % shards`` (counting sort)."""
    starts = np.zeros(shards + 1, np.int64)
    for r in rows:
        starts[r % shards + 1] += 1
    for k in range(shards):
        starts[k + 1] += starts[k]
    fill = starts[:-1].copy()
    order = np.empty(rows.size, np.int64)
    for j in range(rows.size):
        k = rows[j] % shards
        order[fill[k]] = j
        fill[k] += 1
    return order, starts


@kernel
def _copy_out(record, x, address, stride, offset, width):
    """Record at ``record`` into row ``x`` of each field."""
    for f in range(address.size):
        _memcpy(address[f] + x * stride[f], record + offset[f], width[f])


@kernel
def _copy_in(record, x, address, stride, offset, width):
    """Row ``x`` of each field into the record at ``record``."""
    for f in range(address.size):
        _memcpy(record + offset[f], address[f] + x * stride[f], width[f])


@kernel
def _read_hits(
    chosen,
    rows,
    at,
    slot_of,
    records,
    record_bytes,
    flags,
    touch,
    address,
    stride,
    offset,
    width,
    misses,
):
    """Copies the rows of ``chosen`` the tier holds (each a use when
    ``touch``); lists the others in ``misses``."""
    m = 0
    for j in chosen:
        s = slot_of[rows[j]]
        if s < 0:
            misses[m] = j
            m += 1
            continue
        if touch:
            flags[s] |= _REFERENCED
        _copy_out(records + s * record_bytes, at[j], address, stride, offset, width)
    return m


@kernel
def _unpack(records, record_bytes, at, address, stride, offset, width):
    for j in range(at.size):
        _copy_out(records + j * record_bytes, at[j], address, stride, offset, width)


@kernel
def _pack(n, address, stride, offset, width, out, record_bytes):
    for j in range(n):
        _copy_in(out + j * record_bytes, j, address, stride, offset, width)


@kernel
def _write_rows(
    chosen,
    rows,
    at,
    address,
    stride,
    offset,
    width,
    slot_of,
    slot_id,
    records,
    record_bytes,
    flags,
    free,
    free_count,
    dirtied,
):
    """Writes rows of ``chosen`` (dirty, referenced) until no slot is free.

    Returns ``(written, inserted, d)``: rows written, of which ``inserted``
    took a slot; ``dirtied[:d]`` the rows that were clean or new.
    """
    inserted = 0
    d = 0
    for i in range(chosen.size):
        j = chosen[i]
        x = rows[j]
        s = slot_of[x]
        if s < 0:
            if free_count[0] == 0:
                return i, inserted, d
            free_count[0] -= 1
            s = free[free_count[0]]
            slot_of[x] = s
            slot_id[s] = x
            flags[s] = 0
            inserted += 1
        if flags[s] & _DIRTY == 0:
            dirtied[d] = x
            d += 1
        flags[s] = _REFERENCED | _DIRTY
        _copy_in(records + s * record_bytes, at[j], address, stride, offset, width)
    return chosen.size, inserted, d


@kernel
def _insert(
    chosen,
    rows,
    at,
    source,
    flag,
    slot_of,
    slot_id,
    records,
    record_bytes,
    flags,
    free,
    free_count,
):
    """Puts records ``at`` of the buffer at ``source`` (rows not in the tier)
    into free slots with ``flag``; returns how many of ``chosen`` fit."""
    for i in range(chosen.size):
        j = chosen[i]
        x = rows[j]
        if slot_of[x] >= 0:  # a repeated row, put in by its first occurrence
            continue
        if free_count[0] == 0:
            return i
        free_count[0] -= 1
        s = free[free_count[0]]
        slot_of[x] = s
        slot_id[s] = x
        flags[s] = flag
        _memcpy(records + s * record_bytes, source + at[j] * record_bytes, record_bytes)
    return chosen.size


@kernel
def _reclaim(
    lo,
    hi,
    hand,
    target,
    flags,
    slot_id,
    slot_of,
    records,
    record_bytes,
    free,
    free_count,
    out,
    owners,
):
    """Frees up to ``target`` slots of ``[lo, hi)`` by CLOCK; dirty victims'
    records go to the buffer at ``out`` with their rows in ``owners``.

    Returns ``(freed, dirty, hand)``.
    """
    freed = 0
    dirty = 0
    steps = 0
    limit = 3 * (hi - lo)
    while freed < target and steps < limit:
        s = hand
        hand += 1
        if hand == hi:
            hand = lo
        steps += 1
        x = slot_id[s]
        if x < 0:
            continue
        fl = flags[s]
        if fl & _REFERENCED:
            flags[s] = fl & ~_REFERENCED
            continue
        if fl & _DIRTY:
            _memcpy(out + dirty * record_bytes, records + s * record_bytes, record_bytes)
            owners[dirty] = x
            dirty += 1
        slot_of[x] = -1
        slot_id[s] = -1
        flags[s] = 0
        free[free_count[0]] = s
        free_count[0] += 1
        freed += 1
    return freed, dirty, hand
