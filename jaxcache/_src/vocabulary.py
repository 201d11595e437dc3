"""Raw ids to host rows: a row budget in buckets that admits new ids and forgets stale ones.

Recommendation data carries raw 64-bit ids (hashed categorical values, user
and item ids that grow every day). A ``Vocabulary`` gives such an id a row
of the host table the first time it is admitted, and takes a row back from
a stale id when its bucket is full, so that no two live ids share a row.

- **Buckets**: the budget's ``R`` rows form ``B`` buckets, ``B`` the
  smallest power of two with ``B * ways >= R``: row ``r`` is way ``r // B``
  of bucket ``r % B``, so each bucket has at most ``ways`` rows and at least
  about half as many (all alike, or one fewer for the last buckets). An
  id's bucket is the low bits of ``id_hash``, a 32-bit hash of its two
  32-bit words: the device planner computes it where the ids are, without
  64-bit integers, and the devices split the buckets as they split rows
  (``r % n``), so a bucket's rows and the ids that may take them share a
  home. A choice within a bucket (a new id, a forgotten one) depends on
  that bucket's ids alone, never on the device count.
- **Index** (host only): id -> row in an open-addressing hash table (linear
  probing, at most half full, deletion by backward shift), ``O(1)`` per id.
- **Admission**: an id seen fewer than ``admit_after`` times gets no row
  (``-1``); the lookups of ids without a row are counted in a count-min
  sketch of ``4`` rows of counters, each bucket owning its own columns (it
  over-counts only when other ids of the bucket share all four counters).
- **Forgetting**: an id admitted into a bucket takes the bucket's lowest
  free way, else the way of least ``(key, way)`` among the ids that no batch
  in flight uses: key the plan of last use (``"lru"``), the lookups so far
  (``"lfu"``), or ``256 * max(last use - plan, LRFU_AGE_FLOOR) + bonus *
  log2_fixed(lookups)`` (``"lrfu"``, and ``"adaptive"``, whose ``bonus``
  its owner sets before each admission: ``vocabulary_learner``). Held rows
  (used by a plan after ``finished``, by one of the ``protect`` plans before
  this one, or by the batch itself) are never taken.
- **Steps**: ``admit``'s ``step`` and ``finished`` count training plans
  (``training_clock``), so that batches that train nothing age no id.
- **Expiry** (``ttl``): an id no plan looked up in the last ``ttl`` steps
  and no batch in flight uses has expired: it has no row, and its way
  counts as free. Expiry is read from each row's last use when the row is
  looked at, so it costs nothing per step; an expired id that is admitted
  again takes its own way back.
- **All or nothing**: a batch with more admitted new ids in some bucket
  than that bucket can free raises ``CapacityError`` with nothing changed
  (the sketch's counts are taken back).

Rows taken by new ids come back from ``admit`` with those ids, so that the
caller writes their first values (``hashed_rows``: a function of the seed
and the id alone) and fresh optimizer state; ``jaxcache._src.raw_ids``
does that for a cache.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from jaxcache._src.compiled import kernel
from jaxcache._src.config import FORGET, DynamicVocabulary
from jaxcache._src.hashing import (
    LOG2_TABLE,
    LRFU_AGE_FLOOR,
    SKETCH_DEPTH,
    bucket_count,
    bucket_of,
    fmix32,
    id_hash,
    id_words,
    seed_word,
    sketch_salts,
    splitmix64,
)
from jaxcache._src.kernels import log2_fixed
from jaxcache._src.planner import CapacityError

__all__ = ["Admission", "Vocabulary", "distinct_ids", "hashed_rows", "rows_to_hold"]

_INT32_MAX = np.iinfo(np.int32).max


def rows_to_hold(ids: np.ndarray, *, ways: int = 64, seed: int = 0) -> int | None:
    """The least row budget whose buckets hold all of ``ids`` (distinct raw
    ids) at once: a vocabulary this large never forgets them. ``None`` when
    no budget does (more than ``ways`` ids share all 32 bits of a hash).

    Examples:
      >>> rows_to_hold(np.arange(10), ways=64), rows_to_hold(np.arange(100), ways=64) >= 100
      (10, True)
    """
    low, high = id_words(np.asarray(ids, np.int64))
    hashes = id_hash(low, high, seed_word(seed)).astype(np.int64)
    if hashes.size == 0:
        return 0
    if np.unique(hashes, return_counts=True)[1].max() > ways:
        return None  # no number of buckets parts them
    buckets = 1
    while True:  # by 2^32 buckets every id has a bucket to itself or a shared full hash
        if buckets <= 4 * hashes.size:
            loads = np.bincount(hashes & (buckets - 1), minlength=buckets)
            used = np.flatnonzero(loads)
            loads = loads[used]
        else:  # more buckets than ids: count the used ones only
            used, loads = np.unique(hashes & (buckets - 1), return_counts=True)
        # Bucket b of R rows has ceil((R - b) / B) ways.
        need = int(((loads - 1) * buckets + used + 1).max())
        need = max(need, buckets // 2 * ways + 1 if buckets > 1 else 1)
        if need <= buckets * ways:
            return need
        buckets *= 2


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

    clock: tuple[int, int]  # the vocabulary's (step, finished) before
    known_rows: np.ndarray  # the batch's known rows and their last use and
    known_last: np.ndarray  # lookups before
    known_counts: np.ndarray
    old_ids: np.ndarray  # each new row's entry before (last use -1: none)
    old_last: np.ndarray
    old_counts: np.ndarray
    cells: np.ndarray | None  # the sketch's counters the batch added to
    added: np.ndarray | None  # and what it added


class Admission(NamedTuple):
    """What ``Vocabulary.admit`` did for a batch's distinct ids.

    Attributes:
      rows: ``int64 [U]``: each id's row, ``-1`` for an id not admitted.
      new_ids: ``int64 [A]``: the ids that got a row now, in batch order.
      new_rows: ``int64 [A]``: their rows (write their first values there).
      forgotten_ids: ``int64 [F]``: the ids whose rows new ids took (an
        expired id admitted again is among them: its row starts afresh).
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
      forget: which way of its bucket a new id takes when none is free:
        ``"lru"`` (looked up longest ago), ``"lfu"`` (fewest lookups) or
        ``"lrfu"`` (both, by ``bonus``: see the module).
      bonus: of ``"lrfu"``: plans an id stays per doubling of its lookups.
      ways: the most rows of one bucket.
      ttl: ids unused for more than this many steps expire, whatever the
        ``forget`` rule (``None``: never).
      sketch_width: counters per row of the admission sketch over all
        buckets (a power of two; with ``admit_after > 1``).
      seed: of the hashes.
      protect: rows used by the ``protect`` plans before a plan are held
        for it, whatever ``finished`` says (``DynamicVocabulary.protect``).

    Examples:
      >>> vocab = Vocabulary(2)
      >>> vocab.admit(np.array([10**12, 5]), np.array([1, 1]), step=0).rows.tolist()
      [0, 1]
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
        bonus: int = 8,
        ways: int = 64,
        ttl: int | None = None,
        sketch_width: int = 1 << 20,
        seed: int = 0,
        protect: int = 0,
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
        if isinstance(ways, bool) or not isinstance(ways, int) or ways < 1:
            raise ValueError(f"ways={ways!r} must be a positive integer, such as 64.")
        if isinstance(bonus, bool) or not isinstance(bonus, int) or not 0 <= bonus <= 256:
            raise ValueError(f"bonus={bonus!r} must be an integer in [0, 256].")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1):
            raise ValueError(f"ttl={ttl!r} must be a positive number of steps, or None.")
        if sketch_width < 1 or sketch_width & (sketch_width - 1):
            raise ValueError(f"sketch_width={sketch_width} must be a power of two.")
        if isinstance(protect, bool) or not isinstance(protect, int) or protect < 0:
            raise ValueError(f"protect={protect!r} must be an integer >= 0.")
        self.rows = rows
        self.protect = protect
        self.admit_after = admit_after
        self.forget = forget
        self.bonus = bonus
        self.ways = ways
        self.ttl = ttl
        self.seed = seed
        self.buckets = bucket_count(rows, ways)
        self.salt = seed_word(seed)
        self.sketch_salts = sketch_salts(seed)
        size = 16
        while size < 2 * rows:
            size *= 2
        self._keys = np.zeros(size, np.int64)
        self._slots = np.full(size, -1, np.int32)  # the row of each index entry
        self.id_of_row = np.zeros(rows, np.int64)
        self.last_use = np.full(rows, -1, np.int64)  # -1: no entry
        self.counts = np.zeros(rows, np.int64)  # lookups since admitted (lfu, lrfu)
        self._stamp = np.full(rows, -1, np.int64)  # rows the batch being admitted holds
        self._token = 0
        # Each bucket owns ``sketch_width / B`` columns of every sketch row.
        columns = max(16, sketch_width // self.buckets) if admit_after > 1 else 0
        self.sketch_columns = columns
        self.sketch = np.zeros((SKETCH_DEPTH, columns * self.buckets), np.int32)
        self.clock = (-1, -1)  # the (step, finished) of the latest admission

    @classmethod
    def of(cls, spec: DynamicVocabulary, budget: int) -> Vocabulary:
        """The empty vocabulary of a ``budget`` of rows by the rules of
        ``spec``: all of them, or all but the shared row (``spec.id_rows``)."""
        return cls(
            spec.id_rows(budget),
            admit_after=int(spec.admit_after),
            forget=spec.forget,
            bonus=int(spec.bonus),
            ways=int(spec.ways),
            ttl=None if spec.ttl is None else int(spec.ttl),
            sketch_width=int(spec.sketch_width),
            seed=int(spec.seed),
            protect=int(spec.protect),
        )

    # ------------------------------------------------------------------ reads
    def bucket_of(self, ids: np.ndarray) -> np.ndarray:
        """``int64``: each id's bucket."""
        return bucket_of(ids, self.salt, self.buckets)

    def ways_of(self, bucket: int) -> int:
        """Rows of ``bucket`` (``ceil(R / B)``, or one fewer for the last buckets)."""
        return len(range(int(bucket), self.rows, self.buckets))

    def _expired(self, rows: np.ndarray, clock: tuple[int, int] | None = None) -> np.ndarray:
        """Whether each row's entry (rows ``>= 0``) has expired at ``clock``
        (``(step, finished)``, default the latest admission's)."""
        step, finished = self.clock if clock is None else clock
        if self.ttl is None:
            return np.zeros(rows.shape, bool)
        last = self.last_use[rows]
        return (last >= 0) & (last < step - self.ttl) & (last <= finished)

    def live_rows(self) -> np.ndarray:
        """``int64``: the rows that hold a live id, in row order."""
        rows = np.flatnonzero(self.last_use >= 0)
        return rows[~self._expired(rows)]

    @property
    def size(self) -> int:
        """Live ids (rows in use)."""
        return int(self.live_rows().size)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """``int64``: each id's row, ``-1`` for an id without one. Changes nothing."""
        rows = self._find(ids)
        found = rows >= 0
        rows[found] = np.where(self._expired(rows[found]), -1, rows[found])
        return rows

    def _find(self, ids: np.ndarray) -> np.ndarray:
        """Each id's entry in the index (expired ones too), ``-1`` if none."""
        ids = np.ascontiguousarray(ids, np.int64).reshape(-1)
        out = np.empty(ids.size, np.int64)
        _find(self._keys, self._slots, ids, out)
        return out

    def estimate(self, ids: np.ndarray) -> np.ndarray:
        """``int64``: the sketch's count of each id's lookups (an upper bound;
        zeros with ``admit_after == 1``, which keeps no sketch)."""
        ids = np.ascontiguousarray(ids, np.int64).reshape(-1)
        if not self.sketch.size:
            return np.zeros(ids.size, np.int64)
        depth = np.arange(SKETCH_DEPTH)[:, None]
        return self.sketch[depth, self._cells(ids)].min(0).astype(np.int64)

    def _cells(self, ids: np.ndarray) -> np.ndarray:
        """``[4, U]`` each id's counter in each row of the sketch: one of
        its bucket's columns, by a hash salted per row."""
        low, high = id_words(ids)
        h = id_hash(low, high, self.salt)
        bucket = (h & np.uint32(self.buckets - 1)).astype(np.int64)
        column = fmix32(h[None, :] ^ self.sketch_salts[:, None]) & np.uint32(
            self.sketch_columns - 1
        )
        return bucket[None, :] + self.buckets * column.astype(np.int64)

    # ----------------------------------------------------------------- writes
    def admit(
        self,
        ids: np.ndarray,
        counts: np.ndarray,
        *,
        step: int,
        finished: int | None = None,
        new: bool = True,
        distinct: bool = False,
    ) -> Admission:
        """Rows for the distinct ``ids`` of plan ``step`` (``counts``: their lookups).

        Known ids keep their rows; an unknown id seen ``admit_after`` times
        (this batch's lookups included) gets a way of its bucket (see the
        module). Rows used by plans after ``finished`` (default ``step -
        1``: none in flight), or by the ``protect`` plans before ``step``,
        are held. All or nothing. With ``new=False`` (a
        batch that trains nothing) no id is admitted or counted, and known
        ids keep their last use and counts. ``step`` counts training
        plans (``TrainingClock``): one that trains nothing reads at the
        latest training plan's, so that it ages no id.
        ``distinct=True``: the caller vouches that ``ids`` are distinct
        (``distinct_ids``).

        Raises:
          CapacityError: a bucket has more ids to admit than rows it can
            free; the vocabulary, sketch included, is as it was.
            ``fits_after`` is the plan whose release would make room, or
            ``None`` when none would (held by ``protect``, releases do not
            free a row).
        """
        ids = np.ascontiguousarray(ids, np.int64).reshape(-1)
        counts = np.ascontiguousarray(counts, np.int64).reshape(-1)
        if ids.size != counts.size:
            raise ValueError(f"{ids.size} ids but {counts.size} counts; pass one count per id.")
        if not distinct and np.unique(ids).size != ids.size:
            raise ValueError("ids must be distinct: pass a batch's distinct ids and their lookups.")
        step = int(step)
        bound = step - 1 - self.protect
        finished = bound if finished is None else min(int(finished), bound)
        clock = (step, finished)
        rows = self._find(ids)
        returning = np.full(ids.size, -1, np.int64)
        if self.ttl is not None:
            found = np.flatnonzero(rows >= 0)
            gone = found[self._expired(rows[found], clock)]
            returning[gone] = rows[gone]
            rows[gone] = -1
        unknown = np.flatnonzero(rows < 0)
        admitted = unknown if new else unknown[:0]
        cells = added = None
        if new and self.sketch.size and unknown.size:
            cells = self._cells(ids[unknown])
            added = np.minimum(counts[unknown], _INT32_MAX).astype(np.int32)
            _sketch_add(self.sketch, cells, added)
            seen = self.sketch[np.arange(SKETCH_DEPTH)[:, None], cells].min(0)
            admitted = unknown[seen >= self.admit_after]
        known = np.flatnonzero(rows >= 0)
        self._token += 1
        token = self._token
        self._stamp[rows[known]] = token
        back = returning[admitted]  # an expired id admitted again takes its own way
        self._stamp[back[back >= 0]] = token
        others = admitted[back < 0]
        buckets = self.bucket_of(ids[others])
        order = np.argsort(buckets, kind="stable")
        group_of, starts = np.unique(buckets[order], return_index=True)
        starts = np.append(starts, order.size).astype(np.int64)
        placed = np.empty(order.size, np.int64)
        short = np.zeros((group_of.size, 3), np.int64)  # needed, available, fits after
        failed = _allocate(
            self.last_use, self.counts, FORGET.index(self.forget), self.bonus, LOG2_TABLE,
            self._stamp, token, self.buckets, self.rows, step, finished,
            -1 if self.ttl is None else self.ttl, group_of.astype(np.int64), starts, placed,
            short,
        )  # fmt: skip
        if failed:
            if cells is not None and added is not None:
                _sketch_add(self.sketch, cells, -added)
            raise self._refusal(group_of, short, bound)
        new_rows = np.where(back >= 0, back, 0)
        new_rows[np.flatnonzero(back < 0)[order]] = placed
        known_rows = rows[known]
        undo = _Undo(
            self.clock,
            known_rows,
            self.last_use[known_rows],
            self.counts[known_rows],
            self.id_of_row[new_rows],
            self.last_use[new_rows],
            self.counts[new_rows],
            cells,
            added,
        )
        forgotten = np.empty(admitted.size, np.int64)
        # Lookups are counted for forgetting by them only (the device
        # planner keeps no counts for LRU).
        uses = np.zeros_like(counts) if self.forget == "lru" else counts
        # A batch that trains nothing leaves its known rows' use and counts
        # as they were: evaluating must not change which ids training forgets.
        seen = known if new else known[:0]
        taken = _commit(
            self._keys, self._slots, self.id_of_row, self.last_use, self.counts,
            ids, uses, seen, rows[seen], admitted, new_rows, step, forgotten,
        )  # fmt: skip
        self.clock = (max(step, self.clock[0]), max(finished, self.clock[1]))
        rows[admitted] = new_rows
        return Admission(
            rows,
            ids[admitted],
            new_rows,
            forgotten[:taken],
            int(unknown.size - admitted.size),
            admitted.astype(np.int64),
            undo,
        )

    def _refusal(self, group_of: np.ndarray, short: np.ndarray, bound: int) -> CapacityError:
        """The error of an admission that some bucket cannot hold; a release
        past ``bound`` (``protect``) would not make room."""
        failing = np.flatnonzero(short[:, 0] > short[:, 1])
        worst = failing[np.argmax(short[failing, 0] - short[failing, 1])]
        needed, available = int(short[worst, 0]), int(short[worst, 1])
        bucket = int(group_of[worst])
        ways = self.ways_of(bucket)
        where = "" if self.buckets == 1 else f" of bucket {bucket} (of {self.buckets})"
        held = f"the batch or the {self.protect} before it" if self.protect else "the batch"
        error = CapacityError(
            f"the batch has {needed} new ids to admit but only {available} of the {ways} "
            f"rows{where} can take one ({ways - available} are held by {held}, or by batches "
            "in flight); raise num_embeddings, use smaller batches, protect fewer batches "
            "(DynamicVocabulary(protect=...), at least the look-ahead), or admit new ids "
            "later (admit_after)."
        )
        error.rows_needed, error.rows_available = needed, available
        after = short[failing, 2]
        error.fits_after = None if (after < 0).any() or after.max() > bound else int(after.max())
        return error

    def revert(self, admission: Admission) -> None:
        """Takes back the latest ``admit`` (its batch was refused later):
        the vocabulary, sketch included, is as it was before it."""
        undo = admission.undo
        if undo is None:
            raise ValueError("revert takes the Admission that admit returned.")
        _revert(
            self._keys, self._slots, self.id_of_row, self.last_use, self.counts,
            admission.new_ids, admission.new_rows, undo.old_ids, undo.old_last, undo.old_counts,
        )  # fmt: skip
        self.last_use[undo.known_rows] = undo.known_last
        self.counts[undo.known_rows] = undo.known_counts
        self.clock = undo.clock
        if undo.cells is not None and undo.added is not None:
            _sketch_add(self.sketch, undo.cells, -undo.added)

    # -------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The vocabulary as arrays: every entry (expired ones too: such an
        id admitted again takes its own way back) with its row, last use
        and lookups, the sketch, and the clock ``(step, finished)``."""
        rows = np.flatnonzero(self.last_use >= 0)
        return {
            "ids": self.id_of_row[rows].copy(),
            "rows": rows.astype(np.int64),
            "last_use": self.last_use[rows].copy(),
            "counts": self.counts[rows].copy(),
            "sketch": self.sketch.copy(),
            "clock": np.array(self.clock, np.int64),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Takes a ``state_dict`` (of a vocabulary of the same budget and sketch)."""
        ids, rows = np.asarray(state["ids"], np.int64), np.asarray(state["rows"], np.int64)
        if rows.size and (rows.max() >= self.rows or rows.min() < 0):
            raise ValueError(f"the saved vocabulary has rows past this budget of {self.rows}.")
        if np.shape(state["sketch"]) != self.sketch.shape:
            raise ValueError(
                f"the saved sketch is {np.shape(state['sketch'])}, this one {self.sketch.shape}: "
                "build the vocabulary with the saved admit_after, ways and sketch_width."
            )
        self._keys[:] = 0
        self._slots[:] = -1
        self.last_use[:] = -1
        self.counts[:] = 0
        self.id_of_row[:] = 0
        self.id_of_row[rows] = ids
        self.last_use[rows] = state["last_use"]
        self.counts[rows] = state["counts"]
        self.sketch[:] = state["sketch"]
        step, finished = (int(v) for v in np.asarray(state["clock"]).tolist())
        self.clock = (step, finished)
        _insert_all(self._keys, self._slots, ids, rows)


# ------------------------------------------------------------------ kernels
@kernel
def _allocate(
    last_use, counts, forget, bonus, table, stamp, token, buckets, rows, step, finished, ttl,
    group_of, starts, placed, short,
):  # fmt: skip
    """Ways for the admitted ids of each bucket (``group_of[g]``'s are
    ``starts[g]:starts[g + 1]``, in batch order): the bucket's free or
    expired ways by way, then its stale ones by ``(key, way)`` (``forget``:
    an index into ``FORGET``); rows the batch holds are stamped ``token``.
    Fills ``placed``; for each bucket, ``short[g] = (needed, available,
    plan whose release frees enough or -1)``. Returns whether some bucket
    is short."""
    failed = False
    limit = buckets * ((rows + buckets - 1) // buckets)
    free = np.empty(limit // buckets + 1, np.int64)
    stale = np.empty(limit // buckets + 1, np.int64)
    held = np.empty(limit // buckets + 1, np.int64)
    for g in range(group_of.size):
        b = group_of[g]
        nf = 0
        ns = 0
        nh = 0
        r = b
        while r < rows:
            last = last_use[r]
            if stamp[r] != token:
                if last < 0 or (ttl >= 0 and last < step - ttl and last <= finished):
                    free[nf] = r
                    nf += 1
                elif last <= finished:
                    if forget == 0:
                        key = last
                    elif forget == 1:
                        key = counts[r]
                    else:  # lrfu, made non-negative as the others are
                        age = max(last - step, LRFU_AGE_FLOOR) - LRFU_AGE_FLOOR
                        key = 256 * age + bonus * log2_fixed(max(counts[r], 1), table)
                    stale[ns] = key * rows + r  # unique: (key, way) order
                    ns += 1
                else:
                    held[nh] = last
                    nh += 1
            r += buckets
        needed = starts[g + 1] - starts[g]
        short[g, 0] = needed
        short[g, 1] = nf + ns
        if needed > nf + ns:
            failed = True
            extra = needed - nf - ns
            if extra <= nh:
                plans = np.sort(held[:nh])
                short[g, 2] = plans[extra - 1]
            else:
                short[g, 2] = -1
            continue
        order = np.sort(stale[:ns])
        for k in range(needed):
            placed[starts[g] + k] = free[k] if k < nf else order[k - nf] % rows
    return failed


@kernel
def _commit(
    keys, slots, id_of_row, last_use, counts, ids, lookups, known, known_rows, admitted,
    new_rows, step, forgotten,
):  # fmt: skip
    """The batch's known rows used at ``step``, its new ids written into
    their rows (the old entries' ids in ``forgotten``); returns how many
    entries were replaced."""
    for k in range(known.size):
        r = known_rows[k]
        last_use[r] = step
        counts[r] = min(counts[r] + lookups[known[k]], 2147483647)
    taken = 0
    for k in range(admitted.size):
        u = admitted[k]
        r = new_rows[k]
        if last_use[r] >= 0:
            forgotten[taken] = id_of_row[r]
            taken += 1
            _delete(keys, slots, id_of_row[r])
        _insert(keys, slots, ids[u], r)
        id_of_row[r] = ids[u]
        last_use[r] = step
        counts[r] = min(lookups[u], 2147483647)
    return taken


@kernel
def _revert(
    keys, slots, id_of_row, last_use, counts, new_ids, new_rows, old_ids, old_last, old_counts
):
    """``_commit``'s new entries taken back, last first."""
    for k in range(new_rows.size - 1, -1, -1):
        r = new_rows[k]
        _delete(keys, slots, new_ids[k])
        if old_last[k] >= 0:
            _insert(keys, slots, old_ids[k], r)
        id_of_row[r] = old_ids[k]
        last_use[r] = old_last[k]
        counts[r] = old_counts[k]


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
