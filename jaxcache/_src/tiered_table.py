"""A host table larger than memory: every row on disk, the hot ones in DRAM.

``TieredTable`` is a ``HostTable`` whose rows (with their optimizer state)
live in two tiers below the device cache:

* the **DRAM tier** (``dram_tier.DramTier``): a fixed number of rows in
  memory, replaced by CLOCK; rows written back by the device cache stay
  there, dirty, until evicted;
* the **disk tier** (``row_log.RowLog``): every other row, as fixed-size
  records in a log file that is only ever appended to. Dirty rows evicted
  from DRAM leave in batches of a few MiB, one sequential write each.

The device cache above does not change: the engine still gathers and
scatters rows by id. The DRAM budget covers both the rows kept in memory and
the index of every row (12 bytes a row); the default is a fraction of the
memory available when the table is built (``default_dram_budget``).

The disk tier is a cache between checkpoints, not a durable copy: its index
lives in memory, and its files are scratch space, overwritten by the next
table built in the directory. ``jaxcache.Checkpointer`` writes every row
(those only in DRAM included) and is the point to resume from.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
import weakref
from collections.abc import Iterator
from typing import Any, cast

import numpy as np

from jaxcache._src.config import CacheConfig
from jaxcache._src.dram_tier import SLOT_BYTES, DramTier, Fields, TierStats, fields, pack
from jaxcache._src.host_table import (
    HostTable,
    Initializer,
    _check_count,
    _check_rows,
    _check_shard,
    claim_files,
    release_files,
)
from jaxcache._src.kernels import as_index_array
from jaxcache._src.row_log import DiskStats, RowLog
from jaxcache._src.validation import is_int

__all__ = ["DRAM_FRACTION", "TableColumn", "TieredStats", "TieredTable", "default_dram_budget"]

# The share of the memory available at construction a table's DRAM tier takes by default.
DRAM_FRACTION = 0.5
# Index bytes per row: its disk location (int64) and its DRAM slot (int32).
INDEX_BYTES_PER_ROW = 12
# Rows read or written per chunk when a whole column is materialised.
_CHUNK_BYTES = 1 << 26


def default_dram_budget() -> int:
    """The default DRAM budget: ``DRAM_FRACTION`` of the memory available now.

    Available memory is Linux's ``MemAvailable`` (free memory plus what the
    page cache can give back); elsewhere, the free physical pages.

    Returns:
      Bytes.

    Examples:
      >>> import jaxcache
      >>> jaxcache.host.default_dram_budget() > 0
      True
    """
    return int(DRAM_FRACTION * _available_memory())


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclasses.dataclass
class TieredStats:
    """Statistics of a ``TieredTable``, per tier.

    Attributes:
      dram: the DRAM tier's ``TierStats``: lookups, hits, rows written and
        evicted (``dram.hit_rate``).
      disk: the disk tier's ``DiskStats``: rows and bytes read and written
        (``disk.write_amplification``).

    Examples:
      >>> import tempfile, numpy as np, jaxcache
      >>> cfg = jaxcache.CacheConfig(1000, 4, capacity=10)
      >>> table = jaxcache.TieredTable(cfg, tempfile.mkdtemp(), dram_budget=20_000)
      >>> rows = np.empty((1000, 4), np.float32)  # as the device cache fetches them
      >>> table.gather_into(np.arange(1000), rows, {}, np.arange(1000))
      >>> stats = table.stats()
      >>> stats.dram.slots, stats.dram.lookups, stats.disk.rows_read
      (240, 1000, 1000)
    """

    dram: TierStats
    disk: DiskStats


class TieredTable(HostTable):
    """A ``HostTable`` on disk, with its hot and changed rows in a DRAM tier.

    For tables larger than host memory. Rows and their optimizer state are
    records on disk in ``directory``; at most ``dram_budget`` bytes of memory
    hold the index of every row (12 bytes each) and as many rows as fit
    besides (``stats().dram.slots``). Rows the device cache writes back stay
    in DRAM until evicted; evicted changed rows go to the disk in large
    sequential writes; rows read from the disk are kept in DRAM.

    ``gather``, ``gather_into`` and ``scatter`` are the ``HostTable``'s and may
    be called from several threads at once on disjoint ids. ``rows`` and
    ``state`` are ``TableColumn`` views: they index and assign like arrays,
    reading and writing through the tiers; ``np.asarray`` reads a whole
    column into memory.

    The files are a cache between checkpoints: built anew by each table (a
    table in a directory overwrites its predecessor's files; while that
    table is in use, neither closed nor dropped, it is refused) and removed
    by ``close``. Save with ``jaxcache.Checkpointer``, which writes every row.

    Args:
      config: the table's configuration.
      directory: where the disk tier's files go (created if missing):
        ``<name>.log`` and ``<name>.log.owners`` after ``config.name``
        (``embedding.log`` by default), or ``<name>.shard-<i>-of-<p>.log``
        and so on for a shard, so that tables of other names (and other
        shards) can share the directory.
      dram_budget: bytes of memory for the index and the DRAM tier (default:
        ``default_dram_budget()``, a fraction of the memory available now).
        More than the table needs (every row, rounded up to a whole number
        per shard) is not allocated.
      rows: an existing ``[N, D]`` array (or memory map) to start from; when
        ``None`` rows are drawn from ``init``.
      init: initializer for new rows (default: ``embed_init()``).
      seed: seed of the initializer (the same rows as ``HostTable``'s).
      shard: ``(index, count)``: keep only this process's ids, as
        ``HostTable``.
      shards: independent parts of the DRAM tier (each with its own lock),
        so that threads on different rows copy in parallel.
      segment_bytes: size of a segment of the disk log, the unit of garbage
        collection.
      disk_spare: disk space beyond the table's own size, as a fraction of
        it, before garbage collection starts.

    Attributes:
      rows: ``TableColumn`` of ``[N, D]`` rows (``N_local`` for a shard).
      state: ``{name: TableColumn}`` of the per-row optimizer state.
      dram_budget: the bytes of memory the table uses for index and rows.
      shard: ``(index, count)``.
      closed: ``close`` removed its files; it can no longer be read or written.

    Examples:
      >>> import tempfile, numpy as np, jaxcache
      >>> cfg = jaxcache.CacheConfig(10_000, 8, capacity=100, optimizer=jaxcache.adagrad(0.1))
      >>> table = jaxcache.TieredTable(cfg, tempfile.mkdtemp(), dram_budget=200_000)
      >>> table.stats().dram.slots  # rows DRAM holds; all 10,000 are on disk
      976
      >>> plain = jaxcache.HostTable(cfg)
      >>> bool((table.gather([3, 9999])[0] == plain.gather([3, 9999])[0]).all())
      True
      >>> table.rows.shape, table.rows[9999].shape, table.state["accumulator"].dtype
      ((10000, 8), (8,), dtype('float32'))
      >>> table.close()
    """

    # Array-like views through the tiers in place of HostTable's arrays.
    rows: TableColumn  # type: ignore[assignment]
    state: dict[str, TableColumn]  # type: ignore[assignment]

    def __init__(
        self,
        config: CacheConfig,
        directory: str | os.PathLike[str],
        *,
        dram_budget: int | None = None,
        rows: np.ndarray | None = None,
        init: Initializer | None = None,
        seed: int = 0,
        shard: tuple[int, int] | None = None,
        shards: int = 16,
        segment_bytes: int = 64 << 20,
        disk_spare: float = 0.5,
    ) -> None:
        _check_count("seed", seed, 0, low=0)
        _check_count("shards", shards, 16)
        _check_count("segment_bytes", segment_bytes, 64 << 20)
        spare_ok = isinstance(disk_spare, numbers.Real) and not isinstance(disk_spare, bool)
        if not (spare_ok and 0 <= disk_spare < math.inf):
            raise ValueError(
                f"disk_spare={disk_spare!r} must be a fraction >= 0 of the table's size "
                "(default 0.5)."
            )
        self.config = config
        self.shard = _check_shard(shard)
        index, count = self.shard
        rows = _check_rows(rows, config)
        self.directory = os.fspath(directory)
        specs: dict[str, tuple[np.dtype, tuple[int, ...]]] = {
            "rows": (np.dtype(config.row_dtype), (config.features,))
        }
        for name, spec in config.optimizer.state_spec(config.features).items():
            specs[name] = (np.dtype(spec.dtype), tuple(spec.shape))
        sizes = [dtype.itemsize * math.prod(shape) for dtype, shape in specs.values()]
        self._offsets = np.cumsum([0, *sizes[:-1]]).astype(np.int64)
        self._specs = specs
        self.record_bytes = sum(sizes)
        n = len(range(index, config.num_embeddings, count))
        self._n = n
        budget = default_dram_budget() if dram_budget is None else dram_budget
        if not is_int(budget) or budget < 1:
            raise ValueError(f"dram_budget={dram_budget!r} must be a positive number of bytes.")
        index_bytes = INDEX_BYTES_PER_ROW * n
        slot_bytes = self.record_bytes + SLOT_BYTES
        slots = min(n, (int(budget) - index_bytes) // slot_bytes)
        if slots < 1:
            raise ValueError(
                f"dram_budget={budget:,} bytes does not hold the index of {n:,} rows "
                f"({index_bytes:,} bytes, {INDEX_BYTES_PER_ROW} a row) and one row of "
                f"{self.record_bytes} bytes (and {SLOT_BYTES} for its slot); give at least "
                f"{index_bytes + slot_bytes:,}."
            )
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", config.name)
        name = name if count == 1 else f"{name}.shard-{index}-of-{count}"
        path = os.path.join(self.directory, f"{name}.log")
        os.makedirs(self.directory, exist_ok=True)  # once the arguments are checked
        release = claim_files(
            self,
            [path],
            "give this table another directory or another CacheConfig(name=...), or close() "
            "the other table first",
        )
        self._log = RowLog(
            path,
            n,
            self.record_bytes,
            segment_bytes=segment_bytes,
            spare=disk_spare,
        )
        # Collected without close: the log's files go before the lock, as in
        # ``close``, so that a table another process opens there after the
        # lock drops keeps its own files.
        detached = release.detach()
        assert detached is not None, "the table being built lives"
        _, unlock, args, _ = detached
        weakref.finalize(self, _close_then_unlock, self._log, unlock, args)
        self._tier = DramTier(n, slots, self.record_bytes, self._log, shards=shards)
        self.closed = False
        self.dram_budget = index_bytes + self._tier.slots * slot_bytes
        self.rows = TableColumn(self, "rows")
        self.state = {name: TableColumn(self, name) for name in list(specs)[1:]}
        self._fill(rows, init, seed)

    def _fill(self, rows: np.ndarray | None, init: Initializer | None, seed: int) -> None:
        """Writes the initial rows: all into DRAM when they fit (nothing goes to
        disk until evicted), else all to disk, in id order (DRAM starts empty:
        rows put there now would be written out again, unchanged, when evicted)."""
        fits = self._tier.slots >= self._n
        state = {
            name: np.full((1, *shape), spec.init, dtype)
            for (name, (dtype, shape)), spec in zip(
                list(self._specs.items())[1:],
                self.config.optimizer.state_spec(self.config.features).values(),
                strict=True,
            )
        }
        for keep, values in self._initial_rows(rows, init, seed):
            local = np.arange(keep.start, keep.stop, dtype=np.int64)
            arrays = [np.ascontiguousarray(values, self._specs["rows"][0])]
            arrays += [np.repeat(v, local.size, axis=0) for v in state.values()]
            records = pack(arrays, self._offsets, self.record_bytes)
            if fits:
                self._tier.fill(local, records)
            else:
                self._log.write(self._log.reserve(local, records, initial=True))

    # ------------------------------------------------------------ table API
    def gather(self, ids: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Fresh copies of rows ``ids`` and their state; the tiers are left as
        they were (rows read from disk are not kept in DRAM)."""
        return self._read(self._checked(ids), keep=False)

    def gather_into(
        self, ids: np.ndarray, rows: np.ndarray, state: dict[str, np.ndarray], at: np.ndarray
    ) -> None:
        """Copies rows ``ids`` and their state into ``rows[at]`` and
        ``state[name][at]`` (C-contiguous arrays of the table's dtypes). Rows
        read from disk are kept in DRAM (clean)."""
        local = self._checked(ids)
        self._check_state_given("gather_into", state)
        for name, array in {"rows": rows, **state}.items():
            if not array.flags.writeable:
                # The compiled copy writes through the buffer's address: a
                # read-only one would change, or fault on a read-only map.
                raise ValueError(
                    f"gather_into writes into {name}, a read-only array; pass writable "
                    "arrays (np.empty, or a copy). Nothing was copied."
                )
        into = self._fields(rows, state)
        self._tier.read(local, self._positions_in(at, local, len(rows)), into, keep=True)

    def scatter(
        self,
        ids: np.ndarray,
        rows: np.ndarray,
        state: dict[str, np.ndarray],
        at: np.ndarray | None = None,
    ) -> None:
        """Writes rows ``ids`` and their state back, into the DRAM tier:
        ``rows`` and ``state`` in the order of ``ids``, or their entries
        ``at`` when given."""
        local = self._checked(ids)
        self._check_state_given("scatter", state)
        arrays = {"rows": rows, **{k: state[k] for k in self.state}}
        values = {
            name: np.ascontiguousarray(array, dtype=self._specs[name][0])  # as assignment casts
            for name, array in arrays.items()
        }
        size = len(values["rows"])
        if at is None and size != local.size:
            raise ValueError(
                f"scatter of {local.size} ids got {size} rows; pass one per id, or their "
                "places with at=. Nothing was copied."
            )
        at = np.arange(local.size) if at is None else at
        source = self._fields(values["rows"], {k: v for k, v in values.items() if k != "rows"})
        self._tier.write(local, self._positions_in(at, local, size), source)

    def stats(self) -> TieredStats:
        """Hit rate, rows and bytes read and written, per tier (since built)."""
        return TieredStats(self._tier.stats(), dataclasses.replace(self._log.stats))

    def close(self) -> None:
        """Removes the disk tier's files; the table cannot be used afterwards
        (reading or writing it raises ``RuntimeError``)."""
        self.closed = True
        self._log.close()
        release_files(self)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(
                f"this TieredTable of {self.config.num_embeddings} rows was closed: its disk "
                "tier's files are gone, so it holds no rows. Build a new one (and restore a "
                "checkpoint into it) instead."
            )

    # -------------------------------------------------------------- helpers
    def _checked(self, ids: Any) -> np.ndarray:
        """Local rows of global ``ids`` (1-D, int64), checked as ``HostTable``'s."""
        self._check_open()
        local = as_index_array(np.asarray(self._local(self._valid_ids(ids))))
        return local.astype(np.int64, copy=False)

    @staticmethod
    def _positions_in(at: Any, local: np.ndarray, size: int) -> np.ndarray:
        at = as_index_array(np.asarray(at)).astype(np.int64, copy=False)
        if at.size != local.size:
            raise ValueError(f"{at.size} positions for {local.size} ids.")
        if at.size and (at.min() < 0 or at.max() >= size):
            raise IndexError(f"a position in at is outside the {size} rows; nothing was copied.")
        return at

    def _fields(self, rows: np.ndarray, state: dict[str, np.ndarray]) -> Fields:
        """``rows`` and ``state``, checked, as the tier's ``Fields``."""
        arrays = [rows, *(state[name] for name in self.state)]
        for (name, (dtype, shape)), array in zip(self._specs.items(), arrays, strict=True):
            if array.dtype != dtype or array.shape[1:] != shape or len(array) != len(rows):
                raise TypeError(
                    f"{name} must be [{len(rows)}, {', '.join(map(str, shape))}] {dtype}, the "
                    f"table's; got {array.dtype} {array.shape}."
                )
        return fields(arrays, self._offsets)

    def _read(
        self, local: np.ndarray, *, keep: bool, names: list[str] | None = None
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Rows ``local`` (and their state) as fresh arrays; with ``names``,
        only those arrays (``rows`` among them or not)."""
        self._check_open()
        names = list(self._specs) if names is None else names
        arrays = {
            name: np.empty((local.size, *self._specs[name][1]), self._specs[name][0])
            for name in names
        }
        where = [list(self._specs).index(name) for name in names]
        into = fields(list(arrays.values()), self._offsets[where])
        self._tier.read(local, np.arange(local.size), into, keep=keep)
        rows = arrays.pop("rows", None)  # None only when names leaves it out
        return cast(np.ndarray, rows), arrays

    def _row_chunks(self) -> Iterator[slice]:
        step = max(1, _CHUNK_BYTES // self.record_bytes)
        for start in range(0, self._n, step):
            yield slice(start, min(start + step, self._n))


def _close_then_unlock(log: RowLog, unlock: Any, args: tuple[Any, ...]) -> None:
    log.close()
    unlock(*args)


class TableColumn:
    """One array of a ``TieredTable``: its rows, or one optimizer state.

    Indexes and assigns as a NumPy array of shape ``[N_local, ...]`` does
    (its first axis by an index, a slice, a list or array of indices or a
    boolean mask; further axes as NumPy's rules say, arrays on two axes
    pairing their elements), reading and writing through the DRAM tier
    without changing what it holds. ``np.asarray(column)``
    reads the whole column into memory.

    Examples:
      >>> import tempfile, numpy as np, jaxcache
      >>> cfg = jaxcache.CacheConfig(100, 4, capacity=10)
      >>> table = jaxcache.TieredTable(cfg, tempfile.mkdtemp(), dram_budget=2_000)
      >>> table.rows[[5, 7]] = 1.0
      >>> table.rows[[5, 7], 0].tolist(), table.rows[5].tolist(), np.asarray(table.rows).shape
      ([1.0, 1.0], [1.0, 1.0, 1.0, 1.0], (100, 4))
    """

    def __init__(self, table: TieredTable, name: str) -> None:
        self._table = table
        self.name = name
        self.dtype, row_shape = table._specs[name]
        self.shape = (table._n, *row_shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"TableColumn({self.name!r}, shape={self.shape}, dtype={self.dtype})"

    def _rows(self, key: Any) -> tuple[np.ndarray, Any]:
        """``(rows, position)``: the distinct local rows ``key`` selects along
        the first axis, and the index into a block of them (in that order)
        that takes the place of ``key``, so that the rest of an index applies
        as NumPy applies it (an array beside another array pairs them)."""
        n = self.shape[0]
        if key is Ellipsis or isinstance(key, slice):
            rows = np.arange(n, dtype=np.int64)
            return (rows, Ellipsis) if key is Ellipsis else (rows[key], slice(None))
        index = np.asarray(key)
        if index.dtype == bool:
            if index.shape != (n,):
                raise IndexError(f"a boolean mask of {self.name} needs shape ({n},).")
            rows = np.flatnonzero(index)
            return rows, np.arange(rows.size)
        if index.size == 0 and index.dtype == np.float64:  # ``[]``, as NumPy takes it
            index = index.astype(np.int64)
        if not np.issubdtype(index.dtype, np.integer):
            raise IndexError(f"{self.name} is indexed by integers, slices or masks, not {key!r}.")
        flat = index.reshape(-1).astype(np.int64)
        flat = np.where(flat < 0, flat + n, flat)
        if flat.size and (flat.min() < 0 or flat.max() >= n):
            raise IndexError(f"index out of range for {self.name} of {n} rows.")
        # Distinct rows, so that writing the block back cannot undo one of
        # its own cells with an older copy of the same row.
        rows, inverse = np.unique(flat, return_inverse=True)
        return rows, int(inverse[0]) if index.ndim == 0 else inverse.reshape(index.shape)

    def _select(self, key: Any) -> tuple[np.ndarray, tuple]:
        """``(local rows, the index of a block of them that does what key does)``."""
        if isinstance(key, tuple):
            first, rest = (key[0], key[1:]) if key else (slice(None), ())
        else:
            first, rest = key, ()
        local, position = self._rows(first)
        return local, (position, *rest)

    def __getitem__(self, key: Any) -> Any:
        local, index = self._select(key)
        return self._column(local)[index]

    def __setitem__(self, key: Any, value: Any) -> None:
        local, index = self._select(key)
        table = self._table
        rows, state = table._read(local, keep=False)
        target = rows if self.name == "rows" else state[self.name]
        target[index] = value
        table._tier.write(local, np.arange(local.size), table._fields(rows, state))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        for rows in self._table._row_chunks():
            out[rows] = self._column(np.arange(rows.start, rows.stop, dtype=np.int64))
        return out if dtype is None else out.astype(dtype)

    def _column(self, local: np.ndarray) -> np.ndarray:
        rows, state = self._table._read(local, keep=False, names=[self.name])
        return rows if self.name == "rows" else state[self.name]
