"""The full embedding table and its per-row optimizer state, in host memory.

Rows are always stored in the caller's id order (row ``i`` is id ``i``), so
exporting or checkpointing never scrambles them. Arrays are plain NumPy, or
``np.memmap`` files when a directory is given. For tables larger than memory,
``TieredTable`` (``tiered_table.py``) keeps the rows on disk behind a DRAM tier.
"""

from __future__ import annotations

import gc
import math
import os
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

try:
    import fcntl
except ImportError:  # not a POSIX system: tables claim their files in this process only
    fcntl = None  # type: ignore[assignment]

from jaxcache._src import kernels
from jaxcache._src.config import CacheConfig
from jaxcache._src.validation import check_id_type, is_int

__all__ = ["HostTable", "embed_init", "normal_init", "uniform_init"]

# Rows initialised per chunk, so a memory-mapped table never needs a full copy.
_INIT_CHUNK_ROWS = 1 << 16

Initializer = Callable[[np.random.Generator, tuple[int, int]], np.ndarray]


def normal_init(stddev: float = 0.01) -> Initializer:
    """Rows drawn from ``N(0, stddev**2)``.

    Args:
      stddev: standard deviation.

    Returns:
      An initializer ``(rng, shape) -> float32 array``.

    Examples:
      >>> import numpy as np, jaxcache
      >>> jaxcache.host.normal_init(0.1)(np.random.default_rng(0), (2, 3)).shape
      (2, 3)
    """

    def init(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
        return rng.normal(0.0, stddev, size=shape).astype(np.float32)

    return init


def uniform_init(scale: float = 0.05) -> Initializer:
    """Rows drawn uniformly from ``[-scale, scale)``.

    Args:
      scale: half-width of the interval.

    Returns:
      An initializer ``(rng, shape) -> float32 array``.

    Examples:
      >>> import numpy as np, jaxcache
      >>> x = jaxcache.host.uniform_init(0.5)(np.random.default_rng(0), (100, 4))
      >>> bool(np.abs(x).max() <= 0.5)
      True
    """

    def init(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
        return rng.uniform(-scale, scale, size=shape).astype(np.float32)

    return init


def embed_init() -> Initializer:
    """The distribution of Flax's default embedding initializer.

    ``flax.linen.initializers.variance_scaling(1.0, "fan_in", "normal",
    out_axis=0)`` on a ``[N, D]`` table has fan-in ``D``: a normal with
    variance ``1 / D`` (not truncated). Same distribution, NumPy's generator.

    Returns:
      An initializer ``(rng, shape) -> float32 array``.

    Examples:
      >>> import numpy as np, jaxcache
      >>> x = jaxcache.host.embed_init()(np.random.default_rng(0), (20000, 16))
      >>> round(float(x.var() * 16), 1)
      1.0
    """

    def init(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
        return (rng.standard_normal(size=shape) * math.sqrt(1.0 / shape[1])).astype(np.float32)

    return init


class HostTable:
    """Rows ``[N, D]`` plus per-row optimizer state, in id order.

    With ``shard=(index, count)`` the table keeps only the ids ``i`` with
    ``i % count == index``, in id order: the share of one of ``count``
    processes (see ``process_shard``). Its rows are the same values the
    whole table would hold for those ids; ``gather`` and ``scatter`` still
    take global ids.

    Args:
      config: the table's configuration.
      rows: an existing ``[N, D]`` array to start from (copied, or used as is
        with ``copy=False``); when ``None`` rows are drawn from ``init``.
      init: initializer for new rows (default: ``embed_init()``).
      seed: seed of the initializer.
      directory: when given, rows and state live in ``np.memmap`` files there
        (``rows.npy`` and ``<state>.npy``; ``rows.shard-<i>-of-<p>.npy`` and
        so on for a shard), for tables that fit in the page cache or files
        shared with other processes. Every evicted row dirties a page of the
        file; for tables larger than memory use ``jaxcache.TieredTable``.
        The files are built anew: a directory whose files another table in
        use holds, or whose ``rows.npy`` is ``rows`` itself, is refused (a
        table is resumed from a ``jaxcache.Checkpointer`` step).
      copy: copy ``rows`` (default) or adopt the array as the table, which
        needs one of the table's dtype, C-contiguous and writeable, and no
        ``shard`` or ``directory`` (``ValueError`` otherwise).
      shard: ``(index, count)``: keep only this process's ids; ``rows``, when
        given, is still the whole ``[N, D]`` table (or a memory map of it).

    Attributes:
      rows: ``[N, D]`` array of the table's dtype (``[N_local, D]`` for a
        shard, ``N_local = len(range(index, N, count))``).
      state: ``{name: [N, ...]}`` optimizer state per row (``N_local`` rows
        for a shard).
      shard: ``(index, count)``; ``(0, 1)`` for the whole table.

    Examples:
      >>> import jaxcache
      >>> cfg = jaxcache.CacheConfig(100, 4, capacity=10, optimizer=jaxcache.adagrad(0.1))
      >>> table = jaxcache.HostTable(cfg, seed=0)
      >>> table.rows.shape, table.state["accumulator"].shape
      ((100, 4), (100, 4))
      >>> half = jaxcache.HostTable(cfg, seed=0, shard=(1, 2))  # odd ids only
      >>> half.rows.shape, bool((half.gather([5])[0] == table.gather([5])[0]).all())
      ((50, 4), True)
    """

    def __init__(
        self,
        config: CacheConfig,
        *,
        rows: np.ndarray | None = None,
        init: Initializer | None = None,
        seed: int = 0,
        directory: str | os.PathLike[str] | None = None,
        copy: bool = True,
        shard: tuple[int, int] | None = None,
    ) -> None:
        _check_count("seed", seed, 0, low=0)
        self.config = config
        self.shard = _check_shard(shard)
        index, count = self.shard
        rows = _check_rows(rows, config)
        if rows is not None and not copy:
            _check_adoptable(rows, config, count > 1, directory is not None)
        self.directory = None if directory is None else os.fspath(directory)
        if self.directory is not None:
            names = ["rows", *config.optimizer.state_spec(config.features)]
            paths = [self._path(name) for name in names]
            _check_not_mapped(rows, paths)
            claim_files(self, paths, "give each table a directory of its own")
            os.makedirs(self.directory, exist_ok=True)
        local = (len(range(index, config.num_embeddings, count)), config.features)
        self.rows = self._allocate("rows", local, config.row_dtype)
        if rows is not None and not copy:  # adoptable: checked above
            self.rows = rows
        if rows is None or self.rows is not rows:
            for keep, values in self._initial_rows(rows, init, seed):
                self.rows[keep] = values
        self.state: dict[str, np.ndarray] = {}
        for name, spec in config.optimizer.state_spec(config.features).items():
            array = self._allocate(name, (local[0], *spec.shape), spec.dtype)
            array[...] = spec.init
            self.state[name] = array

    def _check_state_given(self, what: str, state: dict[str, np.ndarray]) -> None:
        """Raises ``ValueError`` unless ``state`` holds every optimizer state."""
        missing = sorted(set(self.state) - set(state))
        if missing:
            raise ValueError(
                f"{what} needs the optimizer state {sorted(self.state)} with the rows; "
                f"{missing} missing. Nothing was copied."
            )

    def _path(self, name: str) -> str:
        assert self.directory is not None
        index, count = self.shard
        if count > 1:  # processes may share the directory (a network filesystem)
            name = f"{name}.shard-{index}-of-{count}"
        return os.path.join(self.directory, f"{name}.npy")

    def _allocate(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if self.directory is None:
            return np.empty(shape, dtype)
        return np.lib.format.open_memmap(self._path(name), mode="w+", dtype=dtype, shape=shape)

    def _chunks(self):
        """``(lo, hi, local slice)`` per init chunk of global ids ``[lo, hi)``."""
        index, count = self.shard
        n = self.config.num_embeddings
        for lo in range(0, n, _INIT_CHUNK_ROWS):
            hi = min(lo + _INIT_CHUNK_ROWS, n)
            first, end = -(-(lo - index) // count), -(-(hi - index) // count)
            yield lo, hi, slice(max(first, 0), max(end, 0))

    def _initial_rows(self, rows: np.ndarray | None, init: Initializer | None, seed: int):
        """``(local slice, values)`` of this shard's initial rows, chunk by chunk:
        from ``rows`` (the whole table), or the whole table's draws from ``init``,
        so that a shard holds exactly the values the whole table would."""
        index, count = self.shard
        init = init or embed_init()
        if rows is None:
            rng = np.random.default_rng(seed)
        for lo, hi, keep in self._chunks():
            if rows is None:
                chunk = init(rng, (hi - lo, self.config.features))
            else:
                chunk = rows[lo:hi]
            yield keep, chunk[(index - lo) % count :: count]

    @property
    def num_embeddings(self) -> int:
        """``N``, the number of rows of the whole table."""
        return self.config.num_embeddings

    def ids(self) -> np.ndarray:
        """The ids this table stores, in row order (``arange(N)`` when whole)."""
        index, count = self.shard
        return np.arange(index, self.config.num_embeddings, count)

    def _local(self, ids: np.ndarray) -> np.ndarray:
        index, count = self.shard
        if count == 1:
            return ids
        ids = np.asarray(ids)
        if ids.size and (ids % count != index).any():
            wrong = ids[ids % count != index][:5].tolist()
            raise ValueError(
                f"ids {wrong} are not in this table's shard (ids i with i % {count} == "
                f"{index}); another process stores them."
            )
        return ids // count

    def gather(self, ids: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Fresh copies of rows ``ids`` and their state (safe to hand to a device).

        Raises:
          TypeError: ids that are not integers.
          IndexError: an id outside the table (nothing is read).
        """
        local = self._local(self._valid_ids(ids))
        return take_rows(self.rows, local), {k: take_rows(v, local) for k, v in self.state.items()}

    def _valid_ids(self, ids: Any) -> np.ndarray:
        """Global ``ids`` as int32 or int64 of their shape, each in ``[0, num_embeddings)``:
        NumPy would read a negative id from the end, a bool as 0 or 1, and a
        uint64 past int64 as a negative id."""
        array = check_id_type(ids, "ids")
        flat = kernels.as_index_array(array)  # a uint64 past int64 turns negative: refused
        n = self.config.num_embeddings
        if flat.size and (flat.min() < 0 or flat.max() >= n):
            bad = array.reshape(-1)[(flat < 0) | (flat >= n)][:5].tolist()
            raise IndexError(
                f"ids {bad} are outside this table's {n:,} rows (ids in [0, {n})); "
                "nothing was copied."
            )
        return flat.reshape(array.shape)

    def gather_into(
        self, ids: np.ndarray, rows: np.ndarray, state: dict[str, np.ndarray], at: np.ndarray
    ) -> None:
        """Copies rows ``ids`` and their state into ``rows[at]`` and
        ``state[name][at]`` (C-contiguous arrays of the table's dtypes).

        Runs on the host threads, a piece per device block: one compiled
        check of ids and places, then one copy per array. Each NumPy call
        that lets go of the GIL must take it back, and on a machine where
        another thread holds it that is a sleep (see ``threads``); here
        there are as few as the arrays.
        """
        ids = kernels.as_index_array(np.asarray(ids))
        at = kernels.as_index_array(np.asarray(at))
        if ids.shape != at.shape:
            raise ValueError(f"{ids.size} ids for {at.size} places.")
        local = np.empty(ids.size, np.int64)
        index, count = self.shard
        found = kernels.table_rows(ids, index, count, len(self.rows), at, len(rows), local)
        if found >= 0:
            self._refuse(ids[found], at[found], len(rows))
        pairs = [(rows, self.rows), *((state[k], v) for k, v in self.state.items())]
        if found == -1 and all(out.dtype == array.dtype for out, array in pairs):
            # Rows bound for consecutive places (a device's block, nothing
            # deferred): np.take straight into them, one call per array, the
            # GIL released throughout (a take into a temporary and a copy to
            # ``at`` cost a third more, and two host threads gathering at once
            # made each half again slower). np.take reads random rows of a
            # large table 1.2x as fast as a compiled loop: a memcpy per row.
            place = slice(int(at[0]), int(at[0]) + at.size) if at.size else slice(0, 0)
            for out, array in pairs:
                np.take(array, local, axis=0, out=out[place], mode="clip")  # checked above
            return
        # Random rows read fastest through np.take (a memcpy per row), and
        # written to ``at`` fastest by the compiled copy.
        order = np.arange(local.size)
        for out, array in pairs:
            kernels.copy_rows(out, at, take_rows(array, local), order)

    def _refuse(self, bad_id: int, place: int, size: int) -> NoReturn:
        """Raises the error for a gather of id ``bad_id`` into place ``place``
        of ``size``: outside the table, in another shard, or a bad place."""
        index, count = self.shard
        if count > 1 and bad_id % count != index:
            self._local(np.array([bad_id]))  # words the shard's error
        if not 0 <= place < size:
            raise IndexError(
                f"place {place} is outside the {size} rows gathered into; nothing was gathered."
            )
        raise IndexError(
            f"ids [{bad_id}] are outside this table's {self.config.num_embeddings} rows; "
            "nothing was gathered."
        )

    def scatter(
        self,
        ids: np.ndarray,
        rows: np.ndarray,
        state: dict[str, np.ndarray],
        at: np.ndarray | None = None,
    ) -> None:
        """Writes rows ``ids`` and their state back: ``rows`` and ``state``
        in the order of ``ids``, or their entries ``at`` when given.

        Everything is checked before the first row is written: the ids, the
        places, and each array's rows (one per id, or enough for ``at``) and
        row shape.

        Raises:
          TypeError: ids that are not integers, or rows of another row shape.
          IndexError: an id outside the table, or a place outside the arrays.
          ValueError: another number of rows than ids, or a missing state.
        """
        local = self._local(self._valid_ids(ids)).reshape(-1)
        self._check_state_given("scatter", state)
        pairs = [(self.rows, rows, "rows"), *((v, state[k], k) for k, v in self.state.items())]
        sources = [np.ascontiguousarray(values, dtype=array.dtype) for array, values, _ in pairs]
        given = at is not None
        at = kernels.as_index_array(np.asarray(at)) if given else np.arange(local.size)
        if at.size != local.size:
            raise ValueError(f"{at.size} places for {local.size} ids; nothing was copied.")
        low, high = (int(at.min()), int(at.max())) if at.size else (0, -1)
        for (array, _, name), values in zip(pairs, sources, strict=True):
            if not given and len(values) != local.size:
                raise ValueError(
                    f"scatter of {local.size} ids got {len(values)} {name}; pass one per "
                    "id, or their places with at=. Nothing was copied."
                )
            if values.ndim < 1 or values.shape[1:] != array.shape[1:]:
                raise TypeError(
                    f"scatter's {name} have rows of shape {values.shape[1:]}, but the table's "
                    f"are {array.shape[1:]}; nothing was copied."
                )
            if low < 0 or high >= len(values):
                raise IndexError(
                    f"a place in at is outside the {len(values)} {name} given; nothing was copied."
                )
        for (array, _, _), values in zip(pairs, sources, strict=True):
            kernels.copy_rows(array, local, values, at)


def _check_adoptable(rows: np.ndarray, config: CacheConfig, shard: bool, files: bool) -> None:
    """Raises unless ``rows`` can be the table itself (``copy=False``): a
    table that silently copied them would leave the caller's array stale."""
    why = None
    if shard:
        why = "a process's share (shard=) keeps only its own ids, in an array of its own"
    elif files:
        why = "a table with directory= keeps its rows in files there"
    elif rows.dtype != np.dtype(config.row_dtype):
        why = f"rows are {rows.dtype} and the table holds {np.dtype(config.row_dtype)}"
    elif not (rows.flags.c_contiguous and rows.flags.writeable):
        why = "the table needs a C-contiguous, writeable array and rows are not one"
    if why is not None:
        raise ValueError(
            f"copy=False adopts rows as the table, but {why}; pass copy=True (the "
            "default) to copy them into the table."
        )


def _check_shard(shard: tuple[int, int] | None) -> tuple[int, int]:
    if shard is None:
        return 0, 1
    pair = isinstance(shard, tuple | list) and len(shard) == 2 and all(map(is_int, shard))
    index, count = (int(shard[0]), int(shard[1])) if pair else (-1, 0)
    if count < 1 or not 0 <= index < count:
        raise ValueError(
            f"shard={shard!r} is not (index, count) with 0 <= index < count; pass "
            "jaxcache.host.process_shard(mesh) or leave it out for the whole table."
        )
    return index, count


def _check_count(name: str, value: Any, default: Any, low: int = 1) -> None:
    """Raises unless ``value`` is an integer of at least ``low``."""
    if not is_int(value) or value < low:
        raise ValueError(f"{name}={value!r} must be an integer >= {low} (default {default}).")


def _check_rows(rows: np.ndarray | None, config: CacheConfig) -> np.ndarray | None:
    if rows is None:
        return None
    rows = np.asarray(rows)
    shape = (config.num_embeddings, config.features)
    if rows.shape != shape:
        raise ValueError(
            f"rows has shape {rows.shape} but the config needs {shape} (num_embeddings, features)."
        )
    if not np.issubdtype(rows.dtype, np.floating) and rows.dtype != config.row_dtype:
        raise TypeError(f"rows must be floating point, got dtype {rows.dtype}.")
    return rows


def pad_rows(values: np.ndarray, size: int, fill: int | float) -> np.ndarray:
    """``values`` followed by rows of ``fill``, ``size`` rows in all (fresh)."""
    out = np.full((size, *values.shape[1:]), fill, values.dtype)
    out[: len(values)] = values
    return out


def take_rows(array: np.ndarray, at: np.ndarray) -> np.ndarray:
    """``array[at]`` as a fresh ``np.ndarray``, rows whole.

    ``np.take`` along the rows copies a row at a time; indexing a 2-D array
    with a list goes element by element (3-4x slower for rows of 16 floats,
    measured in and out of cache). For 1-D arrays indexing is the faster.
    """
    if array.ndim < 2:
        return np.asarray(array[at])
    return np.asarray(np.take(array, at, axis=0))


# The files of this process's live tables, by real path. A second table
# built over them would overwrite the rows the first one still reads and
# writes, so that one table silently shows the other's rows.
_CLAIMS: dict[str, weakref.ref[Any]] = {}
# The descriptors holding each live table's lock on its files, by real path.
_LOCKS: dict[str, int] = {}


def claim_files(owner: Any, paths: list[str], fix: str) -> weakref.finalize:
    """Registers ``paths`` as the files of table ``owner`` and locks them
    against other processes (an exclusive ``flock``, which the system drops
    when the owner is closed or collected, or its process dies). Creates
    the files and their directory; changes no file's content. Returns the
    finalizer that lets them go when ``owner`` is collected.

    Raises:
      ValueError: a live table of this process, or another process, holds
        one of them (``fix`` says how to avoid it). Nothing is kept locked.
    """
    keys = [os.path.realpath(path) for path in paths]
    for key, path in zip(keys, paths, strict=True):
        if _holder(key) not in (None, owner):
            gc.collect()  # a table dropped but kept by a reference cycle
        if _holder(key) not in (None, owner):
            raise ValueError(
                f"{path} holds the rows of another table that is still in use; building this "
                f"table there would overwrite them. {fix[0].upper()}{fix[1:]}."
            )
    locks: dict[str, int] = {}
    try:
        for key, path in zip(keys, paths, strict=True):
            if key not in _LOCKS:
                locks[key] = _lock(path, fix)
    except BaseException:
        _unlock(list(locks.values()))
        raise
    for key in keys:
        _CLAIMS[key] = weakref.ref(owner)
    _LOCKS.update(locks)
    for key in [key for key in _CLAIMS if _holder(key) is None]:
        del _CLAIMS[key]
    return weakref.finalize(owner, release_files, None, list(locks))


def _lock(path: str, fix: str) -> int:
    """A descriptor of ``path`` (created) holding its exclusive lock."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        if fcntl is None:
            return fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(
                f"{path} holds the rows of a table that another process is using; building "
                f"this table there would overwrite them. {fix[0].upper()}{fix[1:]}; with "
                "several processes, give each its share of the table "
                "(shard=jaxcache.host.process_shard(mesh))."
            ) from None
        except OSError as error:  # a filesystem without locks: this process's claim only
            warnings.warn(
                f"{path} cannot be locked on its filesystem ({error.strerror or error}): "
                "nothing keeps another process from building a table over it, which would "
                "overwrite its rows. Give each process its own files.",
                RuntimeWarning,
                stacklevel=4,
            )
            return fd
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:  # not a file its closing owner unlinked meanwhile
            return fd
        os.close(fd)


def _forget_locks_in_child() -> None:
    """In a forked child (a data loader's worker): its copies of the lock
    descriptors would keep the tables' files locked after the parent let
    them go, until the child exits. Its tables are the parent's."""
    fds = list(_LOCKS.values())
    _LOCKS.clear()
    _CLAIMS.clear()
    _unlock(fds)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_locks_in_child)


def _unlock(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)  # drops the lock
        except OSError:
            pass


def release_files(owner: Any, keys: list[str] | None = None) -> None:
    """Forgets the files of ``owner`` (closed: another table may use them)
    and drops their locks; with ``keys``, those files' (``owner`` collected)."""
    if keys is None:
        keys = [key for key in _CLAIMS if _holder(key) in (None, owner)]
    for key in keys:
        if _holder(key) in (None, owner):
            _CLAIMS.pop(key, None)
            fd = _LOCKS.pop(key, None)
            if fd is not None:
                _unlock([fd])


def _holder(key: str) -> Any:
    ref = _CLAIMS.get(key)
    return None if ref is None else ref()


def _check_not_mapped(rows: np.ndarray | None, paths: list[str]) -> None:
    """Refuses ``rows`` that map one of the files a table would create over it."""
    array: Any = rows
    while isinstance(array, np.ndarray):
        name = getattr(array, "filename", None)
        if name:
            for path in paths:
                if os.path.exists(path) and os.path.samefile(name, path):
                    raise ValueError(
                        f"rows is a memory map of {path}, which this table would overwrite "
                        "with its own file before copying from it (a table is resumed by "
                        "jaxcache.Checkpointer); copy that file out of the "
                        "directory first, or give the table another directory."
                    )
        array = array.base
