"""Raw ids to host rows: a row budget that admits new ids and forgets stale ones.

Recommendation data carries raw 64-bit ids (hashed categorical values, user
and item ids that grow every day). A ``Vocabulary`` gives such an id a row
of the host table the first time it is admitted, and takes a row back from
a stale id when the budget is full, so that no two live ids share a row.

- **Index**: id -> row in an open-addressing hash table (linear probing,
  at most half full, deletion by backward shift, so no tombstones build
  up); ``O(1)`` per id, compiled loops.
- **Admission**: an id seen fewer than ``admit_after`` times gets no row
  (``-1``); its lookups are counted in a count-min sketch of ``4 x width``
  int32 counters (a row count it never under-counts; it over-counts only
  when other ids share all four of its counters).
- **Forgetting**: a row the caller holds (a batch in flight uses it) is
  never taken. Rows the caller released form a min-heap on
  ``(key, row)``: the step of the row's last admission (``"lru"``) or its
  lookups so far (``"lfu"``); a new id takes a free row first, then the
  heap's least. Every operation is ``O(log R)``.
- **All or nothing**: a batch whose admitted new ids outnumber the free and
  released rows raises ``CapacityError`` with nothing changed (the sketch's
  counts are taken back).

Rows taken by new ids come back from ``admit`` with those ids, so that the
caller writes their first values (``hashed_rows``: a function of the seed
and the id alone) and fresh optimizer state; ``jaxcache._src.raw_ids``
does that for a cache.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from jaxcache._src.compiled import kernel
from jaxcache._src.planner import CapacityError

__all__ = ["Admission", "Vocabulary", "distinct_ids", "hashed_rows", "splitmix64"]

FORGET = ("lru", "lfu")
_SKETCH_DEPTH = 4
_INT32_MAX = np.iinfo(np.int32).max


def splitmix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer of ``uint64`` values: a bijection whose output
    bits each depend on every input bit (Steele et al. 2014).

    Examples:
      >>> splitmix64(np.array([0, 1], np.uint64)).tolist()
      [0, 6238072747940578789]
    """
    z = np.asarray(values, np.uint64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def hashed_rows(
    ids: np.ndarray, features: int, *, seed: int, init: str = "normal", scale: float = 0.01
) -> np.ndarray:
    """The first values of the rows of raw ``ids``: ``float32 [len(ids),
    features]``, a function of ``(seed, id, column)`` alone, so an id starts
    from the same values whatever the batch order, thread, device or
    process count.

    Args:
      ids: int64 raw ids.
      features: the row width.
      seed: the table's seed.
      init: ``"normal"`` (standard deviation ``scale``), ``"uniform"``
        (in ``[-scale, scale)``) or ``"zeros"``.

    Examples:
      >>> a = hashed_rows(np.array([7, 1 << 40]), 4, seed=0)
      >>> b = hashed_rows(np.array([1 << 40]), 4, seed=0)
      >>> bool((a[1] == b[0]).all()), a.dtype, a.shape
      (True, dtype('float32'), (2, 4))
    """
    if init not in ("normal", "uniform", "zeros"):
        raise ValueError(f"init={init!r} is not one of 'normal', 'uniform', 'zeros'.")
    ids = np.asarray(ids, np.int64).reshape(-1)
    if init == "zeros":
        return np.zeros((ids.size, features), np.float32)
    mixed = splitmix64(ids.view(np.uint64) ^ splitmix64(np.array([seed], np.uint64)))
    columns = np.arange(2 * ((features + 1) // 2), dtype=np.uint64)
    bits = splitmix64(
        mixed[:, None] + (columns[None, :] + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    )
    uniform = ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53  # in (0, 1)
    if init == "uniform":
        return ((2.0 * uniform[:, :features] - 1.0) * scale).astype(np.float32)
    u, v = uniform[:, 0::2], uniform[:, 1::2]  # Box-Muller, a pair of columns at a time
    radius = np.sqrt(-2.0 * np.log(u))
    normal = np.empty_like(uniform)
    normal[:, 0::2] = radius * np.cos(2.0 * np.pi * v)
    normal[:, 1::2] = radius * np.sin(2.0 * np.pi * v)
    return (normal[:, :features] * scale).astype(np.float32)


def distinct_ids(
    ids: np.ndarray, padding_id: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct ids of a batch in the order they first appear, with one
    compiled pass over a hash set (``O(ids)``, no sort).

    Returns:
      ``(unique [U], inverse, counts [U])``: ``inverse`` has the shape of
      ``ids`` and gives each id's place in ``unique`` (``-1`` for
      ``padding_id``); ``counts`` are the lookups of each distinct id.

    Examples:
      >>> unique, inverse, counts = distinct_ids(np.array([[9, -1], [2**40, 9]]), -1)
      >>> unique.tolist(), inverse.tolist(), counts.tolist()
      ([9, 1099511627776], [[0, -1], [1, 0]], [2, 1])
    """
    array = np.ascontiguousarray(ids, np.int64)
    flat = array.reshape(-1)
    size = 16
    while size < 2 * flat.size:
        size *= 2
    keys = np.empty(size, np.int64)
    slots = np.full(size, -1, np.int32)
    unique = np.empty(flat.size, np.int64)
    counts = np.empty(flat.size, np.int64)
    inverse = np.empty(flat.size, np.int64)
    pad = 0 if padding_id is None else int(padding_id)
    found = _distinct(flat, pad, padding_id is not None, keys, slots, unique, inverse, counts)
    return unique[:found].copy(), inverse.reshape(array.shape), counts[:found].copy()


class _Undo(NamedTuple):
    """What ``Vocabulary.revert`` needs to take an admission back."""

    known_rows: np.ndarray  # the batch's known rows, their keys before, and
    known_keys: np.ndarray  # whether they were released
    known_released: np.ndarray
    from_free: int  # the first new rows came from the free rows
    forgotten_keys: np.ndarray  # the keys of the rows taken from other ids
    cells: np.ndarray | None  # the sketch's counters the batch added to
    added: np.ndarray | None  # and what it added


class Admission(NamedTuple):
    """What ``Vocabulary.admit`` did for a batch's distinct ids.

    Attributes:
      rows: ``int64 [U]``: each id's row, ``-1`` for an id not admitted.
      new_ids: ``int64 [A]``: the ids that got a row now, in batch order.
      new_rows: ``int64 [A]``: their rows (write their first values there).
      forgotten_ids: ``int64 [F]``: ids whose rows were taken (``F <= A``),
        the last ``F`` of ``new_rows``.
      refused: ids not admitted (seen fewer than ``admit_after`` times).
      new_at: ``int64 [A]``: where each new id is in the ids given.
      undo: what ``Vocabulary.revert`` takes back.

    Examples:
      >>> vocab = Vocabulary(1)
      >>> try:
      ...     vocab.admit(np.array([42, 43]), np.array([1, 1]), step=0)
      ... except CapacityError as error:
      ...     print(error.rows_needed, error.rows_available)
      2 1
      >>> done = vocab.admit(np.array([42]), np.array([3]), step=0)
      >>> done.rows.tolist(), done.new_ids.tolist(), done.forgotten_ids.tolist(), done.refused
      ([0], [42], [], 0)
    """

    rows: np.ndarray
    new_ids: np.ndarray
    new_rows: np.ndarray
    forgotten_ids: np.ndarray
    refused: int
    new_at: np.ndarray | None = None
    undo: _Undo | None = None


class Vocabulary:
    """Raw int64 ids to rows ``[0, rows)`` of a host table (see the module).

    Args:
      rows: the row budget ``R`` (the host table's ``num_embeddings``).
      admit_after: an id gets a row once seen this many times (1: at once).
      forget: which released row a new id takes when none is free:
        ``"lru"`` (admitted longest ago) or ``"lfu"`` (fewest lookups).
      sketch_width: counters per row of the admission sketch (a power of
        two; with ``admit_after > 1``).
      seed: of the sketch's hashes.

    Examples:
      >>> vocab = Vocabulary(2)
      >>> vocab.admit(np.array([10**12, 5]), np.array([1, 1]), step=0).rows.tolist()
      [0, 1]
      >>> vocab.release(np.array([0, 1]))  # no batch in flight uses them
      >>> done = vocab.admit(np.array([7]), np.array([1]), step=1)  # takes the LRU row
      >>> done.rows.tolist(), done.forgotten_ids.tolist()
      ([0], [1000000000000])
    """

    def __init__(
        self,
        rows: int,
        *,
        admit_after: int = 1,
        forget: str = "lru",
        sketch_width: int = 1 << 20,
        seed: int = 0,
    ) -> None:
        if isinstance(rows, bool) or not isinstance(rows, int) or not 0 < rows <= _INT32_MAX:
            raise ValueError(f"rows={rows!r} must be an integer in [1, 2^31 - 1].")
        if isinstance(admit_after, bool) or not isinstance(admit_after, int) or admit_after < 1:
            raise ValueError(
                f"admit_after={admit_after!r} must be a positive integer (1 admits an id "
                "the first time it is seen)."
            )
        if forget not in FORGET:
            raise ValueError(f"forget={forget!r} is not one of {FORGET}.")
        if sketch_width < 1 or sketch_width & (sketch_width - 1):
            raise ValueError(f"sketch_width={sketch_width} must be a power of two.")
        self.rows = rows
        self.admit_after = admit_after
        self.forget = forget
        self.seed = seed
        size = 16
        while size < 2 * rows:
            size *= 2
        self._keys = np.zeros(size, np.int64)
        self._slots = np.full(size, -1, np.int32)  # the row of each index entry
        self.id_of_row = np.zeros(rows, np.int64)
        self.live = np.zeros(rows, bool)
        self.key = np.zeros(rows, np.int64)  # the forgetting order: step or lookups
        self._free = np.arange(rows - 1, -1, -1, dtype=np.int32)  # popped from the end
        self._free_count = rows
        self._heap = np.zeros(rows, np.int32)
        self._heap_at = np.full(rows, -1, np.int32)  # -1: held (or free)
        self._heap_size = np.zeros(1, np.int64)
        width = sketch_width if admit_after > 1 else 1
        self.sketch = np.zeros((_SKETCH_DEPTH, width), np.int32)
        self._sketch_seeds = splitmix64(
            np.arange(1, _SKETCH_DEPTH + 1, dtype=np.uint64) + np.uint64(seed)
        )

    # ------------------------------------------------------------------ reads
    @property
    def size(self) -> int:
        """Live ids (rows in use)."""
        return self.rows - self._free_count

    @property
    def released(self) -> int:
        """Live rows the caller released (a new id may take them)."""
        return int(self._heap_size[0])

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """``int64``: each id's row, ``-1`` for an id without one. Changes nothing."""
        ids = np.ascontiguousarray(ids, np.int64).reshape(-1)
        out = np.empty(ids.size, np.int64)
        _find(self._keys, self._slots, ids, out)
        return out

    def estimate(self, ids: np.ndarray) -> np.ndarray:
        """``int64``: the sketch's count of each id's lookups (an upper bound;
        zeros with ``admit_after == 1``, which keeps no sketch)."""
        ids = np.ascontiguousarray(ids, np.int64).reshape(-1)
        if self.admit_after == 1:
            return np.zeros(ids.size, np.int64)
        return (
            self.sketch[np.arange(_SKETCH_DEPTH)[:, None], self._cells(ids)].min(0).astype(np.int64)
        )

    def _cells(self, ids: np.ndarray) -> np.ndarray:
        """``[4, U]`` the sketch counter of each id in each of its rows: the
        top bits of a hash of the id salted per row."""
        bits = int(self.sketch.shape[1]).bit_length() - 1
        if bits == 0:
            return np.zeros((_SKETCH_DEPTH, ids.size), np.int64)
        mixed = splitmix64(ids.view(np.uint64)[None, :] ^ self._sketch_seeds[:, None])
        return (mixed >> np.uint64(64 - bits)).astype(np.int64)

    # ----------------------------------------------------------------- writes
    def admit(
        self,
        ids: np.ndarray,
        counts: np.ndarray,
        *,
        step: int,
        new: bool = True,
        distinct: bool = False,
    ) -> Admission:
        """Rows for a batch's distinct ``ids`` (``counts``: their lookups).

        Known ids keep their rows; an unknown id seen ``admit_after`` times
        (this batch's lookups included) gets a free row, else the least
        released row (its old id is forgotten). Every row returned is held
        until ``release``. All or nothing. With ``new=False`` (a batch that
        trains nothing) no id is admitted or counted. ``distinct=True``:
        the caller vouches that ``ids`` are distinct (``distinct_ids``).

        Raises:
          CapacityError: more ids to admit than free and released rows; the
            vocabulary, sketch included, is as it was.
        """
        ids = np.ascontiguousarray(ids, np.int64).reshape(-1)
        counts = np.ascontiguousarray(counts, np.int64).reshape(-1)
        if ids.size != counts.size:
            raise ValueError(f"{ids.size} ids but {counts.size} counts; pass one count per id.")
        if not distinct and np.unique(ids).size != ids.size:
            raise ValueError("ids must be distinct: pass a batch's distinct ids and their lookups.")
        rows = self.lookup(ids)
        unknown = np.flatnonzero(rows < 0)
        admitted = unknown if new else unknown[:0]
        cells = None
        if new and self.admit_after > 1 and unknown.size:
            cells = self._cells(ids[unknown])
            depth = np.arange(_SKETCH_DEPTH)[:, None]
            _sketch_add(
                self.sketch, cells, np.minimum(counts[unknown], _INT32_MAX).astype(np.int32)
            )
            seen = self.sketch[depth, cells].min(0)
            admitted = unknown[seen >= self.admit_after]
        known = np.flatnonzero(rows >= 0)
        # The batch's own released rows are held again, not taken.
        available = self._free_count + self.released - int((self._heap_at[rows[known]] >= 0).sum())
        if admitted.size > available:
            if cells is not None:
                _sketch_add(
                    self.sketch, cells, -np.minimum(counts[unknown], _INT32_MAX).astype(np.int32)
                )
            error = CapacityError(
                f"the batch has {admitted.size} new ids to admit but only {available} of the "
                f"{self.rows} rows can take one ({self.rows - available} are held by batches "
                "in flight); raise num_embeddings, use smaller batches or a shorter "
                "look-ahead, or admit new ids later (admit_after)."
            )
            error.rows_needed, error.rows_available = int(admitted.size), int(available)
            raise error
        new_rows = np.empty(admitted.size, np.int64)
        forgotten = np.empty(admitted.size, np.int64)
        forgotten_keys = np.empty(admitted.size, np.int64)
        key = counts if self.forget == "lfu" else np.full(ids.size, step, np.int64)
        known_rows = rows[known]
        undo = _Undo(
            known_rows,
            self.key[known_rows],
            self._heap_at[known_rows] >= 0,
            min(admitted.size, self._free_count),
            forgotten_keys,
            cells,
            None if cells is None else np.minimum(counts[unknown], _INT32_MAX).astype(np.int32),
        )
        free_count = np.array([self._free_count], np.int64)
        taken = _admit(
            self._keys, self._slots, self.id_of_row, self.live, self.key, self._free,
            free_count, self._heap, self._heap_at, self._heap_size,
            ids, rows, key, known, admitted, self.forget == "lfu", new_rows, forgotten,
            forgotten_keys,
        )  # fmt: skip
        self._free_count = int(free_count[0])
        rows[admitted] = new_rows
        return Admission(
            rows,
            ids[admitted],
            new_rows,
            forgotten[:taken],
            int(unknown.size - admitted.size),
            admitted.astype(np.int64),
            undo._replace(forgotten_keys=forgotten_keys[:taken]),
        )

    def revert(self, admission: Admission) -> None:
        """Takes back the latest ``admit`` (its batch was refused later):
        the vocabulary, sketch included, is as it was before it, up to the
        layout of its arrays."""
        undo = admission.undo
        if undo is None:
            raise ValueError("revert takes the Admission that admit returned.")
        free_count = np.array([self._free_count], np.int64)
        _revert(
            self._keys, self._slots, self.id_of_row, self.live, self.key, self._free,
            free_count, self._heap, self._heap_at, self._heap_size,
            admission.new_ids, admission.new_rows, undo.from_free,
            admission.forgotten_ids, undo.forgotten_keys,
        )  # fmt: skip
        self._free_count = int(free_count[0])
        self.key[undo.known_rows] = undo.known_keys
        _release(
            self._heap,
            self._heap_at,
            self._heap_size,
            self.key,
            undo.known_rows[undo.known_released],
        )
        if undo.cells is not None and undo.added is not None:
            _sketch_add(self.sketch, undo.cells, -undo.added)

    def expire(self, before: int) -> np.ndarray:
        """Forgets the released ids last admitted or looked up before step
        ``before`` (``forget="lru"``, whose keys are those steps): their rows
        become free, the last expired taken first. Returns their ids."""
        if self.forget != "lru":
            raise ValueError('expire needs forget="lru": its keys are the steps of last use.')
        out = np.empty(self.released, np.int64)
        free_count = np.array([self._free_count], np.int64)
        count = _expire(
            self._keys, self._slots, self.id_of_row, self.live, self.key, self._free,
            free_count, self._heap, self._heap_at, self._heap_size, int(before), out,
        )  # fmt: skip
        self._free_count = int(free_count[0])
        return out[:count]

    def release(self, rows: np.ndarray) -> None:
        """The caller no longer holds ``rows`` (no batch in flight uses
        them): a new id may take them, least first."""
        rows = np.ascontiguousarray(rows, np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= self.rows or not self.live[rows].all()):
            raise ValueError("release takes live rows of this vocabulary (from admit).")
        _release(self._heap, self._heap_at, self._heap_size, self.key, rows)

    # -------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The vocabulary as arrays: live ids with their rows and keys, the
        released rows, the free rows in the order they are taken, the sketch."""
        live = np.flatnonzero(self.live)
        return {
            "ids": self.id_of_row[live].copy(),
            "rows": live.astype(np.int64),
            "keys": self.key[live].copy(),
            "released": np.sort(self._heap[: self.released]).astype(np.int64),
            "free": self._free[: self._free_count][::-1].astype(np.int64),
            "sketch": self.sketch.copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Takes a ``state_dict`` (of a vocabulary of the same budget and sketch)."""
        ids, rows = np.asarray(state["ids"], np.int64), np.asarray(state["rows"], np.int64)
        if rows.size and (rows.max() >= self.rows or rows.min() < 0):
            raise ValueError(f"the saved vocabulary has rows past this budget of {self.rows}.")
        if np.shape(state["sketch"]) != self.sketch.shape:
            raise ValueError(
                f"the saved sketch is {np.shape(state['sketch'])}, this one {self.sketch.shape}: "
                "build the vocabulary with the saved admit_after and sketch_width."
            )
        fresh = Vocabulary(
            self.rows, admit_after=self.admit_after, forget=self.forget,
            sketch_width=self.sketch.shape[1], seed=self.seed,
        )  # fmt: skip
        self.__dict__.update(fresh.__dict__)
        self.sketch[:] = state["sketch"]
        self.live[rows] = True
        self.id_of_row[rows] = ids
        self.key[rows] = state["keys"]
        _insert_all(self._keys, self._slots, ids, rows)
        free = np.asarray(state["free"], np.int64)
        self._free_count = free.size
        self._free[: free.size] = free[::-1]
        _release(
            self._heap,
            self._heap_at,
            self._heap_size,
            self.key,
            np.asarray(state["released"], np.int64),
        )


# ------------------------------------------------------------------ kernels
@kernel
def _mix(i):
    z = np.uint64(i)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@kernel
def _find(keys, slots, ids, out):
    mask = keys.size - 1
    for u in range(ids.size):
        h = np.int64(_mix(ids[u]) & np.uint64(mask))
        out[u] = -1
        while slots[h] >= 0:
            if keys[h] == ids[u]:
                out[u] = slots[h]
                break
            h = (h + 1) & mask


@kernel
def _insert(keys, slots, i, row):
    mask = keys.size - 1
    h = np.int64(_mix(i) & np.uint64(mask))
    while slots[h] >= 0:
        h = (h + 1) & mask
    keys[h] = i
    slots[h] = row


@kernel
def _insert_all(keys, slots, ids, rows):
    for u in range(ids.size):
        _insert(keys, slots, ids[u], rows[u])


@kernel
def _delete(keys, slots, i):
    """Removes ``i`` by backward shift: entries after it in its probe run
    move up, so that no lookup stops early."""
    mask = keys.size - 1
    h = np.int64(_mix(i) & np.uint64(mask))
    while keys[h] != i or slots[h] < 0:
        h = (h + 1) & mask
    hole = h
    j = (h + 1) & mask
    while slots[j] >= 0:
        home = np.int64(_mix(keys[j]) & np.uint64(mask))
        # Move j into the hole unless its home lies cyclically in (hole, j].
        if (j > hole and (home <= hole or home > j)) or (j < hole and home <= hole and home > j):
            keys[hole] = keys[j]
            slots[hole] = slots[j]
            hole = j
        j = (j + 1) & mask
    slots[hole] = -1


@kernel
def _sketch_add(sketch, cells, counts):
    for d in range(cells.shape[0]):
        for u in range(cells.shape[1]):
            c = np.int64(sketch[d, cells[d, u]]) + counts[u]
            sketch[d, cells[d, u]] = min(max(c, 0), 2147483647)


@kernel
def _less(key, a, b):
    return key[a] < key[b] or (key[a] == key[b] and a < b)


@kernel
def _sift_up(heap, at, key, k):
    row = heap[k]
    while k > 0:
        parent = (k - 1) // 2
        if not _less(key, row, heap[parent]):
            break
        heap[k] = heap[parent]
        at[heap[k]] = k
        k = parent
    heap[k] = row
    at[row] = k


@kernel
def _sift_down(heap, at, key, size, k):
    row = heap[k]
    while True:
        child = 2 * k + 1
        if child >= size:
            break
        if child + 1 < size and _less(key, heap[child + 1], heap[child]):
            child += 1
        if not _less(key, heap[child], row):
            break
        heap[k] = heap[child]
        at[heap[k]] = k
        k = child
    heap[k] = row
    at[row] = k


@kernel
def _heap_remove(heap, at, key, size, row):
    """Removes ``row`` from the heap of ``size[0]`` entries."""
    k = at[row]
    last = size[0] - 1
    size[0] = last
    at[row] = -1
    if k == last:
        return
    moved = heap[last]
    heap[k] = moved
    at[moved] = k
    _sift_up(heap, at, key, k)
    _sift_down(heap, at, key, last, at[moved])


@kernel
def _heap_push(heap, at, size, key, r):
    """Puts ``r`` (not in the heap) into the heap of ``size[0]`` entries."""
    k = size[0]
    heap[k] = r
    at[r] = k
    size[0] = k + 1
    _sift_up(heap, at, key, k)


@kernel
def _release(heap, at, size, key, rows):
    """Puts ``rows`` not in the heap yet into it."""
    for r in rows:
        if at[r] < 0:
            _heap_push(heap, at, size, key, r)


@kernel
def _admit(
    keys, slots, id_of_row, live, key, free, free_count, heap, at, heap_size,
    ids, rows, new_key, known, admitted, add, new_rows, forgotten, forgotten_keys,
):  # fmt: skip
    """Holds the known rows (their keys updated), then gives each admitted
    id a free row or the heap's least; returns how many rows were taken
    from other ids (their old ids in ``forgotten``)."""
    for u in known:
        r = rows[u]
        if at[r] >= 0:
            _heap_remove(heap, at, key, heap_size, r)
        key[r] = key[r] + new_key[u] if add else new_key[u]
    taken = 0
    for k in range(admitted.size):
        u = admitted[k]
        if free_count[0] > 0:
            free_count[0] -= 1
            r = free[free_count[0]]
        else:
            r = heap[0]
            _heap_remove(heap, at, key, heap_size, r)
            forgotten[taken] = id_of_row[r]
            forgotten_keys[taken] = key[r]
            taken += 1
            _delete(keys, slots, id_of_row[r])
        _insert(keys, slots, ids[u], r)
        id_of_row[r] = ids[u]
        live[r] = True
        key[r] = new_key[u]
        new_rows[k] = r
    return taken


@kernel
def _revert(
    keys, slots, id_of_row, live, key, free, free_count, heap, at, heap_size,
    new_ids, new_rows, from_free, forgotten, forgotten_keys,
):  # fmt: skip
    """``_admit``'s new rows given back, last first: to the free rows, or
    to the ids they were taken from (released again)."""
    for k in range(new_rows.size - 1, -1, -1):
        r = new_rows[k]
        _delete(keys, slots, new_ids[k])
        if k < from_free:
            free[free_count[0]] = r
            free_count[0] += 1
            live[r] = False
        else:
            j = k - from_free
            _insert(keys, slots, forgotten[j], r)
            id_of_row[r] = forgotten[j]
            key[r] = forgotten_keys[j]
            _heap_push(heap, at, heap_size, key, r)


@kernel
def _expire(
    keys, slots, id_of_row, live, key, free, free_count, heap, at, heap_size, before, out,
):  # fmt: skip
    """``Vocabulary.expire``: the heap's least while its key is below ``before``."""
    count = 0
    while heap_size[0] > 0 and key[heap[0]] < before:
        r = heap[0]
        _heap_remove(heap, at, key, heap_size, r)
        _delete(keys, slots, id_of_row[r])
        live[r] = False
        free[free_count[0]] = r
        free_count[0] += 1
        out[count] = id_of_row[r]
        count += 1
    return count


@kernel
def _distinct(ids, pad, use_pad, keys, slots, unique, inverse, counts):
    """``distinct_ids``' pass: each id found in, or added to, a hash set of
    its first place; returns the number of distinct ids."""
    mask = keys.size - 1
    found = 0
    for i in range(ids.size):
        x = ids[i]
        if use_pad and x == pad:
            inverse[i] = -1
            continue
        h = np.int64(_mix(x) & np.uint64(mask))
        while True:
            s = slots[h]
            if s < 0:
                slots[h] = found
                keys[h] = x
                unique[found] = x
                counts[found] = 1
                inverse[i] = found
                found += 1
                break
            if keys[h] == x:
                counts[s] += 1
                inverse[i] = s
                break
            h = (h + 1) & mask
    return found
