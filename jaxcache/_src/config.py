"""The static description of one cached embedding table."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxcache._src import optimizers

__all__ = ["POLICIES", "CacheConfig"]

#: Names of the eviction policies ``CacheConfig(policy=...)`` accepts.
POLICIES = ("adaptive", "frequency", "lfu", "lru")


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
      dtype: dtype of the rows, ``float32`` or ``bfloat16``.
      padding_id: id that marks an empty position in a bag; it looks up a zero
        row and gets no gradient. ``None`` allows no padding.
      min_bucket: smallest padded size of the per-step row lists; they are
        padded to powers of two at or above it so shapes stay static.
      name: names the table; lookups carry it to find their module.
      route_capacity: with rows split over several devices, how many rows one
        device takes from one owner per step through the fast ``all_to_all``
        path; the rest take an exact overflow path. ``None`` sizes it from
        each batch (padded to buckets), so nothing overflows.
      callback_rows: how many rows the host-callback form
        (``CachedEmbed.lookup_ids``) pads its per-step lists to (distinct
        ids, fetched and evicted rows); it needs one fixed size. ``None``: the
        number of ids in the batch, which always suffices but with padded
        multi-hot bags is many times their distinct ids. A batch with more
        distinct ids than this is refused before anything changes.

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

    def __post_init__(self) -> None:
        for field in ("num_embeddings", "features", "min_bucket"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
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
        if rows is not None and (
            isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 1
        ):
            raise ValueError(
                f"callback_rows={rows!r} must be a positive integer (at least the most distinct "
                "ids of a batch), or None to pad the host-callback form's lists to the batch's "
                "number of ids."
            )
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r} is not supported; use 'float32' or 'bfloat16'.")
        if self.padding_id is not None and 0 <= self.padding_id < self.num_embeddings:
            raise ValueError(
                f"padding_id={self.padding_id} is a real row id (0 <= id < {self.num_embeddings}); "
                "use a negative id such as -1."
            )

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
