"""The static description of one cached embedding table."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np

from jaxcache._src import optimizers
from jaxcache._src.validation import check_padding_id, check_padding_outside, is_int

# A table's name names its directory in checkpoints: not "." or "..", and
# short enough for any file system.
_TABLE_NAME = re.compile(r"(?!\.+\Z)[A-Za-z0-9_.-]{1,128}")

__all__ = ["FORGET", "INITS", "POLICIES", "CacheConfig", "DynamicVocabulary"]

#: Names of the eviction policies ``CacheConfig(policy=...)`` accepts.
POLICIES = ("adaptive", "frequency", "lfu", "lru")
#: Which row a dynamic vocabulary takes back when its budget is full.
FORGET = ("lru", "lfu", "lrfu", "adaptive")
#: First values of a dynamic vocabulary's new rows.
INITS = ("normal", "uniform", "zeros")
#: What a dynamic vocabulary's ids without a row read.
DEFAULTS = ("zeros", "shared")


@dataclasses.dataclass(frozen=True)
class DynamicVocabulary:
    """Raw ids: rows given to ids on first sight and taken back from stale ones.

    With ``CacheConfig(vocabulary=DynamicVocabulary(...))`` the ids of a
    batch are any int64 values (except ``padding_id``): hashed categorical
    values, user or item ids. ``num_embeddings`` becomes the row budget of
    the host table. An id gets a row when it is admitted; its row starts
    from ``init`` as a function of ``(seed, id)`` alone, with fresh
    optimizer state, so it starts the same whatever the batch order or the
    device count. The budget's rows form buckets of at most ``ways`` rows,
    and an id's bucket is a hash of the id (as in a set-associative cache):
    when its bucket is full, a new id takes the row of the bucket's stalest
    id (``forget``), whose row and state start afresh. Rows of batches in
    flight are never taken, and a batch with more new ids for a bucket than
    it can free raises ``CapacityError`` with nothing changed.

    Attributes:
      admit_after: an id gets a row once it was looked up this many times
        (counted in a count-min sketch, which over-counts only when other
        ids share all four of its counters). Until then it reads the
        ``default`` row and gets no row of its own. 1: on first sight.
        Batches that do not train (``train=False``, ``jaxcache.Server``)
        admit no id and count nothing: unknown ids read the default row,
        and known ids keep the last use and lookups that ``forget`` ranks
        them by. Nor does such a batch count as a step: ``ttl``, the ages
        of ``"lrfu"`` and ``protect`` count training batches, so that no
        evaluation, however long, and no server changes which ids stay.
      default: what an id without a row reads: ``"zeros"`` (a zero row
        with no update, like padding) or ``"shared"``: one trainable row,
        the budget's last (``num_embeddings - 1``, which no id is given),
        that every such lookup reads and trains with the sparse optimizer
        like any row, as a managed-collision table's shared row does. It
        starts at zeros with fresh optimizer state. Mean pooling counts an
        id on the shared row; on zeros it counts it as padding.
      forget: which row a new id takes once its bucket has none free,
        among the bucket's ids no batch in flight uses: the one looked up
        longest ago (``"lru"``), with the fewest lookups (``"lfu"``), or of
        least ``256 * (last use - now) + bonus * log2(lookups)`` (in 1/256ths
        of a step; ``"lrfu"``): the adaptive cache policy's key at a fixed
        ``bonus``, where each doubling of an id's lookups keeps it ``bonus``
        steps longer, so ids seen once leave before those that came back;
        or ``"adaptive"``: lrfu at a bonus learned online, as the adaptive
        cache policy learns its own: shadow vocabularies replay a hashed
        sample of the ids at each bonus of ``(0, 1, 2, 4, ..., 256)`` and the
        one that found the most lookups lately wins (its choice depends on
        the training batches alone: ``vocabulary_learner``).
      bonus: of ``"lrfu"``, in steps per doubling of the lookups (``0``:
        LRU); an integer in ``[0, 256]``.
      ways: the most rows of a bucket (at least 2): ``B``, the least power
        of two with ``B * ways >= num_embeddings``, buckets share the rows. More ways
        forget more like a global LRU or LFU and refuse fewer batches; the
        device planner compares an id with every way of its bucket. The
        device planner splits the buckets over the devices, so their number
        must be a multiple of the device count.
      init: the first values of a new row: ``"normal"`` (standard deviation
        ``scale``), ``"uniform"`` (in ``[-scale, scale)``) or ``"zeros"``.
      scale: of ``init``.
      ttl: also forget the ids no training batch looked up in the last
        ``ttl`` steps (training batches), even while rows are free (their
        rows count as free), under any ``forget`` rule; ``None``: only when
        a bucket is full.
      protect: the rows used by the ``protect`` training batches before a batch are
        never given to its new ids (nor forgotten by ``ttl``), whether or
        not those batches are still in flight. A pipeline
        (``jaxcache.prefetch``) of look-ahead up to ``protect`` then
        forgets what unpipelined steps forget: which ids hold rows depends
        on the batches and the budget alone. A training ``prefetch`` refuses
        a larger look-ahead (evaluation admits nothing). Default 2, its default look-ahead.
      seed: of the first values and of the sketch's hashes.
      sketch_width: counters per row of the admission sketch (a power of
        two; used with ``admit_after > 1``).

    Examples:
      >>> import numpy as np, jaxcache
      >>> cfg = jaxcache.CacheConfig(
      ...     1000, 4, capacity=64, vocabulary=jaxcache.DynamicVocabulary()
      ... )
      >>> cache = jaxcache.EmbeddingCache(cfg)
      >>> state, lookup = cache.prepare(cache.init_state(), np.array([10**15, -7]))
      >>> vocabulary = cache.vocabulary  # 16 buckets: row r is in bucket r % 16
      >>> vocabulary.buckets, vocabulary.lookup(np.array([10**15, -7, 3])).tolist()
      (16, [15, 0, -1])
      >>> vocabulary.bucket_of(np.array([10**15, -7])).tolist()
      [15, 0]
      >>> # Two rows for ids 7 (three lookups) and 9 (one), then a new id, 5
      >>> # (protect=0: the batch before it is not held, as with no pipeline):
      >>> # lru takes the lower row of two used as long ago, lrfu id 9's.
      >>> for rule in ("lru", "lrfu"):
      ...     spec = jaxcache.DynamicVocabulary(forget=rule, ways=2, protect=0)
      ...     cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(2, 4, 2, vocabulary=spec))
      ...     state, _ = cache.prepare(cache.init_state(), np.array([7, 7, 7, 9]))
      ...     state, _ = cache.prepare(state, np.array([5]))
      ...     print(rule, cache.vocabulary.lookup(np.array([7, 9, 5])).tolist())
      lru [-1, 1, 0]
      lrfu [0, -1, 1]
    """

    admit_after: int = 1
    bonus: int = 8
    default: str = "zeros"
    forget: str = "lru"
    init: str = "normal"
    scale: float = 0.01
    seed: int = 0
    sketch_width: int = 1 << 20
    ttl: int | None = None
    ways: int = 64
    protect: int = 2

    def __post_init__(self) -> None:
        _plain_numbers(self)
        after = self.admit_after
        if not is_int(after) or after < 1:
            raise ValueError(
                f"admit_after={after!r} must be a positive integer (1 admits an id the first "
                "time it is looked up)."
            )
        if self.default not in DEFAULTS:
            raise ValueError(
                f"default={self.default!r} is not one of {', '.join(map(repr, DEFAULTS))}: "
                "what an id without a row reads."
            )
        if self.forget not in FORGET:
            raise ValueError(f"forget={self.forget!r} is not one of {', '.join(FORGET)}.")
        bonus = self.bonus
        if not is_int(bonus) or not 0 <= bonus <= 256:
            raise ValueError(
                f"bonus={bonus!r} must be an integer in [0, 256]: the steps an id of forget="
                '"lrfu" stays for each doubling of its lookups.'
            )
        if self.init not in INITS:
            raise ValueError(f"init={self.init!r} is not one of {', '.join(INITS)}.")
        if not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale)):
            raise ValueError(f"scale={self.scale!r} must be a finite number.")
        if self.scale < 0:
            raise ValueError(
                f"scale={self.scale!r}: the spread of init must be >= 0; pass a value such as 0.01."
            )
        ttl = self.ttl
        if ttl is not None and (not is_int(ttl) or ttl < 1):
            raise ValueError(f"ttl={ttl!r} must be a positive number of steps, or None.")
        ways = self.ways
        if not is_int(ways) or ways < 2:
            raise ValueError(
                f"ways={ways!r} must be an integer of at least 2, such as 64: with one way, "
                "a budget that is not a power of two leaves buckets without a row, whose ids "
                "could never be admitted."
            )
        protect = self.protect
        if not is_int(protect) or protect < 0:
            raise ValueError(
                f"protect={protect!r} must be an integer >= 0: the batches before a batch "
                "whose rows its new ids may not take (at least the pipeline's look-ahead)."
            )
        width = self.sketch_width
        if not is_int(width) or width < 1 or (width & (width - 1)):
            raise ValueError(f"sketch_width={width!r} must be a power of two, such as 2**20.")
        seed = self.seed
        if not is_int(seed) or not 0 <= seed < 2**63:
            raise ValueError(
                f"seed={seed!r} must be an integer in [0, 2**63), such as 0: it draws each "
                "id's first values and salts its bucket's hash."
            )

    def id_rows(self, budget: int) -> int:
        """Rows of a ``budget`` the vocabulary gives to ids: all of them, or
        all but the shared row (``default="shared"``)."""
        return int(budget) - (self.default == "shared")

    def shared_row(self, budget: int) -> int | None:
        """The row ids without one read (``default="shared"``), else ``None``."""
        return int(budget) - 1 if self.default == "shared" else None


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Frozen, hashable configuration of a cached embedding table.

    Attributes:
      num_embeddings: ``N``, rows in the full (host) table.
      features: ``D``, width of a row.
      capacity: ``C``, rows kept on device: a row count, or a fraction of
        ``num_embeddings`` in ``(0, 1]`` (rounded up). After construction it
        is always the row count.
      policy: which resident rows to evict. ``"adaptive"`` (the default):
        recency plus a learned weight of frequency (lookups so far, or the
        dataset counts if larger), which admits newcomers at the low end, so
        ids seen once leave first (``AdaptivePolicy`` in
        ``jaxcache/_src/policies.py``). ``"frequency"``: static dataset
        counts (``EmbeddingCache(frequencies=...)``), warmed with the hottest
        rows. ``"lfu"``: online lookup counts. ``"lru"``: least recently used.
      optimizer: the sparse row optimizer (``jaxcache.sgd`` and friends).
      dtype: dtype of the rows, ``"float32"`` or ``"bfloat16"`` (a NumPy or
        JAX dtype such as ``jnp.bfloat16`` is taken as its name).
      padding_id: id that marks an empty position in a bag; it looks up a zero
        row and gets no gradient. ``None`` allows no padding.
      min_bucket: smallest padded size of the per-step row lists; they are
        padded to powers of two at or above it so shapes stay static.
      name: names the table; lookups carry it to find their module, and
        checkpoints name its directory by it: 1 to 128 letters, digits,
        ``_``, ``-`` or ``.`` (not dots alone).
      route_capacity: with rows split over several devices, how many rows one
        device takes from one owner per step through the fast ``all_to_all``
        path; the rest take an exact overflow path. ``None`` sizes it from
        each batch (padded to buckets), so nothing overflows. The host
        planner's only: the device planner sizes its own and refuses it.
      callback_rows: how many rows the host-callback form
        (``CachedEmbed.lookup_ids``) pads its per-step lists to (distinct
        ids, fetched and evicted rows); it needs one fixed size. ``None``: the
        number of ids in the batch, which always suffices but with padded
        multi-hot bags is many times their distinct ids. A batch with more
        distinct ids than this is refused before anything changes.
      vocabulary: ``None``: ids are rows ``[0, num_embeddings)``. A
        ``DynamicVocabulary``: ids are raw int64 values, given rows as they
        come (``num_embeddings`` is then the row budget).

    Examples:
      >>> import jaxcache
      >>> cfg = jaxcache.CacheConfig(num_embeddings=1000, features=8, capacity=0.05)
      >>> cfg.capacity
      50
    """

    num_embeddings: int
    features: int
    capacity: int | float
    policy: str = "adaptive"
    optimizer: optimizers.SparseOptimizer = optimizers.SGD(0.01)  # noqa: RUF009 (frozen)
    dtype: str = "float32"
    padding_id: int | None = None
    min_bucket: int = 64
    name: str = "embedding"
    route_capacity: int | None = None
    callback_rows: int | None = None
    vocabulary: DynamicVocabulary | None = None

    def __post_init__(self) -> None:
        _plain_numbers(self)
        for field in ("num_embeddings", "features", "min_bucket"):
            value = getattr(self, field)
            if not is_int(value) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}.")
        object.__setattr__(self, "capacity", _resolve_capacity(self.capacity, self.num_embeddings))
        if self.policy not in POLICIES:
            raise ValueError(
                f"policy={self.policy!r} is not a known policy; use one of {', '.join(POLICIES)}."
            )
        if not isinstance(self.optimizer, optimizers.SparseOptimizer):
            kind = type(self.optimizer)
            package = kind.__module__.partition(".")[0]
            given = f"{package}.{kind.__name__}" if package != "builtins" else kind.__name__
            raise TypeError(
                f"optimizer must be a jaxcache sparse row optimizer, got an object of type "
                f"{given}; pass jaxcache.sgd, jaxcache.adagrad, jaxcache.rowwise_adagrad or "
                "jaxcache.adam (e.g. optimizer=jaxcache.adagrad(0.1)). optax transformations "
                "are for the dense parameters, not the cached rows."
            )
        rows = self.callback_rows
        if rows is not None and (not is_int(rows) or rows < 1):
            raise ValueError(
                f"callback_rows={rows!r} must be a positive integer (at least the most distinct "
                "ids of a batch), or None to pad the host-callback form's lists to the batch's "
                "number of ids."
            )
        given = self.dtype
        if given is not None and not isinstance(given, str):  # np.float32, jnp.bfloat16, ...
            try:
                object.__setattr__(self, "dtype", np.dtype(given).name)
            except TypeError:
                pass
        if self.dtype not in ("float32", "bfloat16"):
            shown = given if given is None else self.dtype  # np.dtype(None) is float64
            raise ValueError(f"dtype={shown!r} is not supported; use 'float32' or 'bfloat16'.")
        if self.vocabulary is not None and not isinstance(self.vocabulary, DynamicVocabulary):
            raise TypeError(
                f"vocabulary must be None (ids are rows) or a jaxcache.DynamicVocabulary, got "
                f"{self.vocabulary!r}."
            )
        if self.vocabulary is not None and self.vocabulary.id_rows(self.num_embeddings) < 1:
            raise ValueError(
                f"num_embeddings={self.num_embeddings} leaves no row for ids besides the shared "
                'row of DynamicVocabulary(default="shared"); use at least 2.'
            )
        check_padding_id(self.padding_id)
        route = self.route_capacity
        if route is not None and (not is_int(route) or route < 1):
            raise ValueError(
                f"route_capacity={route!r} must be a positive number of rows, or None to size "
                "the route from each batch."
            )
        if not isinstance(self.name, str) or not _TABLE_NAME.fullmatch(self.name):
            raise ValueError(
                f"name={self.name!r} must be 1 to 128 letters, digits, '_', '-' or '.' (not "
                "dots alone), such as 'users': it names the table in lookups and its "
                "directory in checkpoints."
            )
        if self.vocabulary is None:
            check_padding_outside(self.padding_id, self.num_embeddings)

    @property
    def row_dtype(self) -> np.dtype:
        """NumPy dtype of the rows (``ml_dtypes.bfloat16`` for bfloat16)."""
        return np.dtype(self.dtype) if self.dtype == "float32" else _bfloat16()

    @property
    def row_bytes(self) -> int:
        """Bytes moved per row (the row plus its optimizer state)."""
        total = self.features * self.row_dtype.itemsize
        for spec in self.optimizer.state_spec(self.features).values():
            total += math.prod(spec.shape) * np.dtype(spec.dtype).itemsize
        return total


def _plain_numbers(config: Any) -> None:
    """Replaces a frozen dataclass's NumPy scalars (``ids.max() + 1``) by
    the Python numbers they hold, before its checks: a checkpoint records
    the configuration as JSON, and equal configurations compare and hash
    alike whichever type gave their numbers."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, np.generic) and value.dtype.kind in "biuf":
            object.__setattr__(config, field.name, value.item())


def _bfloat16() -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _resolve_capacity(capacity: int | float, num_embeddings: int) -> int:
    if isinstance(capacity, bool) or not isinstance(
        capacity, (int, float, np.integer, np.floating)
    ):
        raise TypeError(
            f"capacity must be a row count or a fraction, got {capacity!r}; pass a row count "
            "such as 5000, or a fraction of the table such as 0.02."
        )
    if isinstance(capacity, (float, np.floating)):
        if 0 < capacity <= 1:
            return max(1, math.ceil(capacity * num_embeddings))
        if not float(capacity).is_integer():
            raise ValueError(
                f"capacity={capacity} is neither a fraction in (0, 1] nor a whole row count; "
                "pass a fraction of the table such as 0.02, or a row count such as 5000."
            )
    rows = int(capacity)
    if rows < 1:
        raise ValueError(f"capacity={capacity} must be at least 1 row.")
    if rows > num_embeddings:
        raise ValueError(
            f"capacity={rows} rows is larger than the table (num_embeddings={num_embeddings}); "
            "use capacity <= num_embeddings, or keep the whole table on device without a cache."
        )
    return rows
