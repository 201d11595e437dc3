"""The disk tier of a ``TieredTable``: rows as fixed-size records in a log.

Every row of the table, with its optimizer state, is one record of ``R``
bytes (``TieredTable`` packs them). The records live in one file, cut into
segments of ``records_per_segment`` records. Writes only ever append: a batch
of rows goes to the end of the open segment (then the next free one) in one
``pwrite``, so the disk sees large sequential writes however scattered the
ids are. An index in memory (``where [N]``, 8 bytes a row) says where each
row's newest record is; the older one becomes garbage.

Garbage is collected a segment at a time: when the log holds more segments
than the table needs plus ``spare``, the segment with the fewest live
records is read in one sequential read, its live records are appended again,
and it is reused. A segment is only collected while at most ``max_live`` of
it is live, so each collection writes at most ``max_live / (1 - max_live)``
bytes of old records per byte it frees (0.82 with the default ``0.45``): with
the 8 bytes of owner per record, the disk takes less than 2 bytes per byte of
row written. When every segment is fuller than that, the file grows instead.

Reads of scattered records are sorted by location, adjacent records are read
together, and the ``pread`` calls are issued from compiled loops on several
threads, with the GIL released. Read-ahead is turned off
(``POSIX_FADV_RANDOM``): a cold record costs one page, not a read-ahead
window.

A write is first *reserved* (its locations assigned and the index updated,
under the log's lock) and then *written* (outside it). Until the write lands,
readers of those rows are served from the reserved buffer. A segment read by a
reader is pinned, so collection never reuses it under the reader.

Nothing here is durable on its own: the index is in memory, and the files
are scratch space, removed when the table is closed. Checkpoints
(``jaxcache.Checkpointer``) are the durable copy.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
import weakref
from typing import Any

import numpy as np
from numba import types

from jaxcache._src import kernels
from jaxcache._src.compiled import kernel

__all__ = ["DiskStats", "RowLog"]

# libc's pread, called from compiled loops (no Python per record). The buffer
# address goes as a 64-bit integer, which the x86-64 and AArch64 calling
# conventions pass as they pass a pointer.
_pread: Any = types.ExternalFunction(
    "pread", types.int64(types.int32, types.int64, types.uint64, types.int64)
)

# Segment states.
_FREE, _OPEN, _SEALED, _COLLECTING, _RETIRED = range(5)
# Reads are split over threads in parts of at least this many records.
_READ_PART = 1024
_READ_THREADS = 8
_executor: concurrent.futures.ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(
                _READ_THREADS, thread_name_prefix="jaxcache-disk"
            )
        return _executor


@dataclasses.dataclass
class DiskStats:
    """What the disk tier read and wrote.

    Attributes:
      rows_read: records read from the disk.
      bytes_read: bytes those reads asked for.
      read_calls: ``pread`` calls (adjacent records are read together).
      rows_written: rows the DRAM tier wrote out because they were evicted
        changed (dirty).
      row_bytes_written: their bytes: the payload the disk had to take.
      bytes_written: every byte written to the disk after the table was
        built: dirty rows, records moved by garbage collection, and the
        8-byte owner of each record.
      rows_collected: live records that garbage collection moved.
      segments_collected: segments garbage collection freed.
      segments: segments the log file holds (its size over the segment size).
      initial_bytes: bytes written while the table was built or reloaded
        (not counted in ``bytes_written``).

    Examples:
      >>> from jaxcache.stats import DiskStats
      >>> DiskStats(row_bytes_written=100, bytes_written=130).write_amplification
      1.3
    """

    rows_read: int = 0
    bytes_read: int = 0
    read_calls: int = 0
    rows_written: int = 0
    row_bytes_written: int = 0
    bytes_written: int = 0
    rows_collected: int = 0
    segments_collected: int = 0
    segments: int = 0
    initial_bytes: int = 0

    @property
    def write_amplification(self) -> float:
        """Disk bytes written per byte of dirty row written (``0`` before any)."""
        return self.bytes_written / self.row_bytes_written if self.row_bytes_written else 0.0


@dataclasses.dataclass(eq=False)  # tickets are told apart by identity
class _Ticket:
    """A reserved write: ``pieces`` of ``(first location, first row, rows)``."""

    owners: np.ndarray
    records: np.ndarray
    pieces: list[tuple[int, int, int]]
    initial: bool
    collected: bool


class RowLog:
    """Fixed-size records of ``num_rows`` rows in a log-structured file.

    Args:
      path: the file's path (``<path>`` holds the records, ``<path>.owners``
        the owner of each record, for garbage collection); both are created
        anew and removed by ``close``.
      num_rows: rows of the table (ids ``0 .. num_rows - 1``).
      record_bytes: bytes per record.
      segment_bytes: bytes per segment (rounded down to whole records).
      spare: segments beyond what the rows fill, as a fraction of them,
        before garbage collection starts.
      max_live: collect only segments at most this fraction live.

    Examples:
      >>> import os, tempfile, numpy as np
      >>> from jaxcache._src.row_log import RowLog
      >>> log = RowLog(os.path.join(tempfile.mkdtemp(), "rows"), 10, 2, segment_bytes=8)
      >>> log.write(log.reserve(np.array([3, 7]), np.array([[1, 2], [3, 4]], np.uint8)))
      >>> out = np.zeros((1, 2), np.uint8)
      >>> log.read(np.array([7]), out)
      >>> out.tolist()
      [[3, 4]]
      >>> log.close()
    """

    def __init__(
        self,
        path: str,
        num_rows: int,
        record_bytes: int,
        *,
        segment_bytes: int = 64 << 20,
        spare: float = 0.5,
        max_live: float = 0.45,
    ) -> None:
        self.path = path
        self.record_bytes = int(record_bytes)
        self.records_per_segment = max(1, int(segment_bytes) // max(1, self.record_bytes))
        self.max_live = float(max_live)
        per = self.records_per_segment
        self._target = max(2, -(-int(num_rows * (1.0 + spare)) // per) + 1)
        self.where = np.full(num_rows, -1, np.int64)
        self._lock = threading.Lock()
        self._collect_lock = threading.Lock()
        self._state = np.zeros(0, np.int8)
        self._fill = np.zeros(0, np.int64)  # records written or reserved
        self._live = np.zeros(0, np.int64)  # records that are some row's newest
        self._pins = np.zeros(0, np.int64)  # records being read
        self._pending = np.zeros(0, np.int64)  # reserved records not written yet
        self._head = -1
        self._flying: list[_Ticket] = []
        self._unwritten: list[_Ticket] = []  # writes that failed: tried again later
        self.stats = DiskStats()
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self._fd = os.open(path, flags, 0o644)
        self._owners_fd = os.open(path + ".owners", flags, 0o644)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
        self._finalizer = weakref.finalize(
            self, _remove, (self._fd, self._owners_fd), (path, path + ".owners")
        )

    # ----------------------------------------------------------------- writes
    def reserve(
        self,
        owners: np.ndarray,
        records: np.ndarray,
        *,
        initial: bool = False,
        _collected: bool = False,
    ) -> _Ticket:
        """Assigns locations at the end of the log to ``records`` (rows
        ``owners``) and points the index at them; ``write`` puts them on disk.

        Until then, reads of those rows are served from ``records``: the
        caller hands them over and must not change them.
        """
        owners = np.ascontiguousarray(owners, np.int64)
        with self._lock:
            return self._reserve(owners, records, initial, _collected)

    def _reserve(self, owners, records, initial, collected) -> _Ticket:
        per, n, done = self.records_per_segment, len(owners), 0
        pieces = []
        while done < n:
            if self._head < 0 or self._fill[self._head] == per:
                self._open_segment()
            seg = self._head
            start = int(self._fill[seg])
            count = min(per - start, n - done)
            pieces.append((seg * per + start, done, count))
            self._fill[seg] += count
            self._pending[seg] += count
            done += count
        locations = np.concatenate(
            [np.arange(a, a + k) for a, _, k in pieces] or [np.empty(0, np.int64)]
        )
        _relocate(self.where, self._live, owners, locations.astype(np.int64), per)
        ticket = _Ticket(owners, records, pieces, initial, collected)
        self._flying.append(ticket)
        return ticket

    def _open_segment(self) -> None:
        if self._head >= 0:
            self._state[self._head] = _SEALED
        free = np.flatnonzero(self._state == _FREE)
        if free.size:
            seg = int(free[0])
        else:
            seg = self._state.size
            grow = max(8, seg // 4)
            self._state = np.concatenate([self._state, np.full(grow, _FREE, np.int8)])
            for name in ("_fill", "_live", "_pins", "_pending"):
                setattr(self, name, np.concatenate([getattr(self, name), np.zeros(grow, np.int64)]))
            self.stats.segments = max(self.stats.segments, seg + 1)
        self._state[seg] = _OPEN
        self._fill[seg] = 0
        self._head = seg

    def write(self, ticket: _Ticket) -> None:
        """Writes a reserved batch: one ``pwrite`` per segment it spans. A
        batch whose write fails (the disk full) stays in memory, where reads
        find it, until ``write_unwritten`` writes it.

        Raises:
          OSError: the write failed.
        """
        word_bytes = self.record_bytes
        try:
            for first, row, count in ticket.pieces:
                _pwrite_all(self._fd, ticket.records[row : row + count], first * word_bytes)
                _pwrite_all(self._owners_fd, ticket.owners[row : row + count], first * 8)
        except OSError:
            with self._lock:
                self._unwritten.append(ticket)
            raise
        record_bytes = len(ticket.owners) * word_bytes
        with self._lock:
            self._flying.remove(ticket)
            for first, _, count in ticket.pieces:
                self._pending[first // self.records_per_segment] -= count
            total = record_bytes + 8 * len(ticket.owners)
            if ticket.initial:
                self.stats.initial_bytes += total
            else:
                self.stats.bytes_written += total
                if ticket.collected:
                    self.stats.rows_collected += len(ticket.owners)
                else:
                    self.stats.rows_written += len(ticket.owners)
                    self.stats.row_bytes_written += record_bytes

    def write_unwritten(self) -> None:
        """Writes the batches earlier writes failed to write, each once.

        Raises:
          OSError: one still failed (it stays in memory for the next call).
        """
        with self._lock:  # each claimed by one caller
            tickets, self._unwritten = self._unwritten, []
        failed: OSError | None = None
        for ticket in tickets:
            try:
                self.write(ticket)
            except OSError as error:
                failed = failed or error
        if failed is not None:
            raise failed

    def forget(self, owners: np.ndarray) -> None:
        """Marks the records of rows ``owners`` garbage: the rows changed
        elsewhere (in the DRAM tier) and will be written again."""
        if len(owners):
            with self._lock:
                _relocate(
                    self.where,
                    self._live,
                    np.ascontiguousarray(owners, np.int64),
                    np.full(len(owners), -1, np.int64),
                    self.records_per_segment,
                )

    # ------------------------------------------------------------------ reads
    def read(self, owners: np.ndarray, out: np.ndarray) -> None:
        """Copies the newest record of each row ``owners[j]`` into ``out[j]``."""
        if not len(owners):
            return
        per = self.records_per_segment
        with self._lock:
            locations = self.where[owners]
            if locations.min() < 0:
                row = int(owners[np.argmin(locations)])
                raise RuntimeError(f"row {row} has no record on disk; the table is corrupt.")
            on_disk = np.ones(locations.size, bool)
            for ticket in self._flying:
                for first, row, count in ticket.pieces:
                    inside = (locations >= first) & (locations < first + count)
                    if inside.any():
                        at = np.flatnonzero(inside)
                        kernels.copy_rows(out, at, ticket.records, locations[at] - first + row)
                        on_disk[at] = False
            todo = np.flatnonzero(on_disk)
            segments = locations[todo] // per
            _count(self._pins, segments, 1)
        try:
            if todo.size:
                self._read_sorted(locations[todo], todo, out)
        finally:
            with self._lock:
                _count(self._pins, segments, -1)
                self._free_retired()

    def _read_sorted(self, locations: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
        order = np.argsort(locations, kind="stable")
        locations, rows = locations[order], rows[order]
        parts = max(1, min(_READ_THREADS, locations.size // _READ_PART))
        bounds = np.linspace(0, locations.size, parts + 1).astype(np.int64)
        address = out.ctypes.data

        def read(lo: int, hi: int) -> int:
            return _read_records(
                self._fd, locations[lo:hi], rows[lo:hi], self.record_bytes, address
            )

        if parts == 1:
            results = [read(0, locations.size)]
        else:
            futures = [_pool().submit(read, bounds[i], bounds[i + 1]) for i in range(parts)]
            results = [f.result() for f in futures]
        if min(results) < 0:
            raise OSError(f"reading records of {self.path} failed (a short or failed pread).")
        with self._lock:
            self.stats.rows_read += locations.size
            self.stats.bytes_read += locations.size * self.record_bytes
            self.stats.read_calls += sum(results)

    # ------------------------------------------------------------- collection
    def collect(self) -> None:
        """Frees segments while the log holds more than it needs (one thread
        at a time; a call while another collects returns at once)."""
        if not self._collect_lock.acquire(blocking=False):
            return
        try:
            while (segment := self._victim()) is not None:
                self._collect(segment)
        finally:
            self._collect_lock.release()

    def _victim(self) -> int | None:
        with self._lock:
            used = int(np.count_nonzero(self._state != _FREE))
            if used <= self._target:
                return None
            candidates = np.flatnonzero((self._state == _SEALED) & (self._pending == 0))
            if not candidates.size:
                return None
            segment = int(candidates[np.argmin(self._live[candidates])])
            if self._live[segment] > self.max_live * self.records_per_segment:
                return None  # every segment is too full to be worth it: grow
            self._state[segment] = _COLLECTING
            return segment

    def _collect(self, segment: int) -> None:
        per = self.records_per_segment
        count = int(self._fill[segment])
        first = segment * per
        ticket = None
        if self._live[segment]:
            records = np.empty((count, self.record_bytes), np.uint8)
            owners = np.empty(count, np.int64)
            _pread_all(self._fd, records, first * self.record_bytes)
            _pread_all(self._owners_fd, owners, first * 8)
            with self._lock:
                live = self.where[owners] == first + np.arange(count)
                if live.any():
                    ticket = self._reserve(owners[live], records[live], False, True)
        with self._lock:
            self._state[segment] = _RETIRED
            self.stats.segments_collected += 1
            self._free_retired()
        if ticket is not None:
            self.write(ticket)

    def _free_retired(self) -> None:
        """Retired segments no reader holds become free (call with the lock)."""
        done = (self._state == _RETIRED) & (self._pins == 0)
        self._state[done] = _FREE
        self._fill[done] = 0

    # ------------------------------------------------------------------ other
    def close(self) -> None:
        """Closes and removes the files. The descriptors are forgotten: the
        system gives their numbers to the next files opened, which a late
        read or write must never reach."""
        self._finalizer()
        self._fd = self._owners_fd = -1


def _remove(fds: tuple[int, ...], paths: tuple[str, ...]) -> None:
    # Unlinked while the table still holds its files' lock (``claim_files``):
    # a table another process opens there afterwards keeps its new files.
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _bytes(array: np.ndarray) -> memoryview:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


def _pwrite_all(fd: int, array: np.ndarray, offset: int) -> None:
    data = _bytes(array)
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def _pread_all(fd: int, array: np.ndarray, offset: int) -> None:
    data = _bytes(array)
    done = 0
    while done < len(data):
        read = os.preadv(fd, [data[done:]], offset + done)
        if read <= 0:
            raise OSError(f"the disk tier's file ended early at byte {offset + done}.")
        done += read


@kernel
def _relocate(where, live, owners, locations, per):
    """Points each row ``owners[j]`` at ``locations[j]`` (``-1``: nowhere),
    keeping the live count of each segment."""
    for j in range(owners.size):
        old = where[owners[j]]
        if old >= 0:
            live[old // per] -= 1
        new = locations[j]
        where[owners[j]] = new
        if new >= 0:
            live[new // per] += 1


@kernel
def _count(counts, segments, delta):
    for s in segments:
        counts[s] += delta


@kernel
def _read_records(fd, locations, rows, record_bytes, address):
    """``pread`` of record ``locations[j]`` into row ``rows[j]`` of the buffer
    at ``address``; runs adjacent on disk and in the buffer are read at once.

    Returns the number of calls, or ``-1`` if one failed or came up short.
    """
    calls = 0
    j = 0
    while j < locations.size:
        k = j + 1
        while (
            k < locations.size
            and locations[k] == locations[k - 1] + 1
            and rows[k] == rows[k - 1] + 1
        ):
            k += 1
        size = (k - j) * record_bytes
        done = 0
        while done < size:
            got = _pread(
                fd,
                address + rows[j] * record_bytes + done,
                size - done,
                locations[j] * record_bytes + done,
            )
            if got <= 0:
                return -1
            done += got
        calls += 1
        j = k
    return calls
