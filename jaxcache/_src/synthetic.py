"""A synthetic, Criteo-like click stream generated on the fly.

No files and no downloads: every batch is drawn from a seeded NumPy generator,
so batch ``i`` of a dataset is the same on every run and can be produced out of
order. The shapes follow the Criteo Kaggle data as DLRM preprocesses it:

- 26 categorical features whose cardinalities are Criteo's, scaled by
  ``scale``; all of them share ONE table of ``sum(cardinalities)`` rows, feature
  ``f``'s ids being ``feature_offsets[f] + [0, cardinalities[f])``;
- ids of each feature follow a Zipf law of exponent ``alpha`` over ranks
  (sampled by inverting the CDF of the continuous power law, ``O(1)`` per id
  whatever the cardinality), with the hot ranks scattered over the feature's range by an affine
  bijection ``rank -> (a * rank + b) mod cardinality`` (as FBGEMM's benchmark
  generator shuffles hot rows), which costs no memory;
- 13 dense features ``log(1 + count)``;
- a click label drawn from a hidden logistic model: a bias, a weight per
  dense feature and a weight per id taken from a hash of the id (no ``O(N)``
  memory), so a model that learns the hot rows' weights reaches a clearly
  better-than-chance AUC.

With ``multi_hot=True`` every feature is a bag of up to ``bag_size`` ids, of
the sizes MLPerf's DCNv2 benchmark uses (capped at ``bag_size``), padded with
``padding_id``; the ids of a bag are drawn independently, so one may repeat.

Shape letters: ``B`` batch, ``F`` sparse features (26), ``L`` bag length,
``N`` table rows.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator

import numpy as np

from jaxcache._src.frequency import FrequencyCounter
from jaxcache._src.validation import is_int

__all__ = ["CRITEO_KAGGLE_CARDINALITIES", "DCNV2_BAG_SIZES", "SyntheticCriteo"]

CRITEO_KAGGLE_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
"""Rows of the 26 categorical features of Criteo Kaggle (DLRM preprocessing)."""

DCNV2_BAG_SIZES: tuple[int, ...] = (
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1,
)  # fmt: skip
"""Ids per feature of MLPerf's multi-hot DCNv2 benchmark."""

NUM_DENSE = 13
"""Dense (continuous) features per sample."""

# Smallest scaled cardinality: the smallest Criteo feature has 3 values.
_MIN_ROWS = 3
# Hidden label model: per-id weights are uniform in [-_ID_WEIGHT, _ID_WEIGHT]
# and dense weights normal with this standard deviation; the bias sets the
# click rate near Criteo's ~25%.
_ID_WEIGHT = 0.6
_DENSE_WEIGHT = 0.25
_BIAS = -2.2
# Streams of the seeded generators: the dataset's fixed structure, training
# batches and held-out batches.
_STRUCTURE, _TRAIN, _HELD_OUT = 0, 1, 2


def _hash32(values: np.ndarray, key: np.uint32 | np.ndarray) -> np.ndarray:
    """Well-mixed ``uint32`` hash of non-negative ids below ``2**32`` (murmur3 finaliser)."""
    x = values.astype(np.uint32) ^ key
    x *= np.uint32(0x9E3779B1)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x85EBCA6B)
    x ^= x >> np.uint32(13)
    x *= np.uint32(0xC2B2AE35)
    x ^= x >> np.uint32(16)
    return x


@dataclasses.dataclass(frozen=True)
class SyntheticCriteo:
    """A deterministic, Criteo-shaped stream of click batches.

    Batches are dicts of NumPy arrays:

    - ``"dense"``: ``float32 [B, 13]``, ``log(1 + count)`` features;
    - ``"sparse"``: ``int64 [B, F]`` ids into the shared table, or
      ``[B, F, L]`` bags padded with ``padding_id`` when ``multi_hot``;
    - ``"label"``: ``float32 [B]``, clicks in ``{0, 1}``.

    Args:
      scale: fraction of each Criteo Kaggle cardinality to keep (at least 3
        rows per feature); ``1.0`` gives the full 33.8M-row table.
      batch_size: ``B``, samples per batch.
      seed: picks the hot ids, the hidden label model and every batch.
      alpha: Zipf exponent of each feature's ids (FBGEMM uses about 1.15).
      multi_hot: bags of DCNv2 sizes instead of one id per feature.
      bag_size: ``L``, the longest bag; larger DCNv2 sizes are capped to it.
      padding_id: fills the unused positions of a bag.

    Examples:
      >>> import jaxcache
      >>> data = jaxcache.synthetic.SyntheticCriteo(scale=0.001, batch_size=4)
      >>> data.num_embeddings, data.cardinalities[:3]
      (33803, (3, 3, 10132))
      >>> batch = data.batch(0)
      >>> {k: (v.dtype.name, v.shape) for k, v in batch.items()}
      {'dense': ('float32', (4, 13)), 'sparse': ('int64', (4, 26)), 'label': ('float32', (4,))}
      >>> bool((data.batch(0)["sparse"] == batch["sparse"]).all())
      True
    """

    scale: float = 0.01
    batch_size: int = 1024
    seed: int = 0
    alpha: float = 1.15
    multi_hot: bool = False
    bag_size: int = 8
    padding_id: int = -1

    def __post_init__(self) -> None:
        if not 0 < self.scale <= 1:
            raise ValueError(
                f"scale={self.scale} must be in (0, 1]; it is the fraction of each Criteo "
                "cardinality kept, e.g. 0.01."
            )
        for field in ("batch_size", "bag_size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}.")
        if not self.alpha > 1:
            raise ValueError(f"alpha={self.alpha} must be > 1 (FBGEMM's benchmarks use 1.15).")
        if self.padding_id >= 0:
            raise ValueError(
                f"padding_id={self.padding_id} would be a real row id; use a negative id "
                "such as -1."
            )

    # ------------------------------------------------------------- structure
    @functools.cached_property
    def cardinalities(self) -> tuple[int, ...]:
        """Rows of each of the ``F`` features."""
        return tuple(max(_MIN_ROWS, math.ceil(c * self.scale)) for c in CRITEO_KAGGLE_CARDINALITIES)

    @functools.cached_property
    def feature_offsets(self) -> np.ndarray:
        """``int64 [F]``: first row of each feature in the shared table."""
        sizes = np.asarray(self.cardinalities, np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        offsets.setflags(write=False)
        return offsets

    @property
    def num_embeddings(self) -> int:
        """``N``: rows of the shared table, ``sum(cardinalities)``."""
        return sum(self.cardinalities)

    @property
    def num_features(self) -> int:
        """``F``: sparse features per sample (26)."""
        return len(CRITEO_KAGGLE_CARDINALITIES)

    @functools.cached_property
    def bag_sizes(self) -> tuple[int, ...]:
        """Ids per feature: DCNv2 sizes capped at ``bag_size``, or all 1 (one-hot)."""
        if not self.multi_hot:
            return (1,) * self.num_features
        return tuple(min(s, self.bag_size) for s in DCNV2_BAG_SIZES)

    @property
    def ids_shape(self) -> tuple[int, ...]:
        """Shape of ``"sparse"``: ``(B, F)``, or ``(B, F, L)`` when ``multi_hot``."""
        if self.multi_hot:
            return (self.batch_size, self.num_features, self.bag_size)
        return (self.batch_size, self.num_features)

    @functools.cached_property
    def _structure(self) -> dict[str, np.ndarray]:
        """The fixed part of the dataset: where hot ids sit and the label model.

        Ids are sampled in a compact layout ``[B, K]`` with one column per
        real bag position (``K = F`` one-hot, ``sum(bag_sizes)`` multi-hot);
        ``column_feature`` names each column's feature and ``column_target``
        its position in the flattened ``[F * L]`` bag layout.
        """
        rng = np.random.default_rng([self.seed, _STRUCTURE])
        n = np.asarray(self.cardinalities, np.int64)
        # rank -> (a * rank + b) mod n is a bijection when gcd(a, n) == 1.
        a = rng.integers(1, np.maximum(n, 2))
        for f in range(n.size):
            while math.gcd(int(a[f]), int(n[f])) != 1:
                a[f] = a[f] % (n[f] - 1) + 1
        b = rng.integers(0, n)
        # Inverse CDF of a power law on [1, n + 1): rank = floor(x) - 1 with
        # x = (1 - u * (1 - (n + 1)^(1 - alpha)))^(1 / (1 - alpha)).
        mass = 1.0 - (n + 1.0) ** (1.0 - self.alpha)
        dense_scale = np.exp(rng.uniform(0.0, 6.0, NUM_DENSE)).astype(np.float32)
        dense_weight = rng.normal(0.0, _DENSE_WEIGHT, NUM_DENSE).astype(np.float32)
        # Center the dense term on its mean (estimated once) so the bias alone
        # sets the click rate.
        probe = np.log1p(rng.standard_exponential((4096, NUM_DENSE)) * dense_scale)
        dense_center = float((probe.mean(0) * dense_weight).sum())
        sizes = np.asarray(self.bag_sizes)
        column_feature = np.repeat(np.arange(n.size), sizes)
        column_slot = np.arange(column_feature.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        return {
            "n": n[column_feature],
            "a": a[column_feature],
            "b": b[column_feature],
            "mass": mass[column_feature],
            "offsets": self.feature_offsets[column_feature],
            "bag_weight": (1.0 / sizes[column_feature]).astype(np.float32),
            "column_target": column_feature * self.bag_size + column_slot,
            "dense_scale": dense_scale,
            "dense_weight": dense_weight,
            "bias": np.float32(_BIAS - dense_center),
            "hash_key": np.uint32(rng.integers(0, 2**32)),
        }

    # --------------------------------------------------------------- batches
    def _rng(self, index: int, held_out: bool) -> np.random.Generator:
        if not is_int(index) or index < 0:
            raise ValueError(f"index must be a non-negative integer, got {index!r}.")
        return np.random.default_rng([self.seed, _HELD_OUT if held_out else _TRAIN, int(index)])

    def _sample_ids(self, rng: np.random.Generator) -> np.ndarray:
        """Ids in the compact layout ``int64 [B, K]``."""
        s = self._structure
        u = rng.random((self.batch_size, s["n"].size))
        x = np.exp(np.log1p(-u * s["mass"]) * (1.0 / (1.0 - self.alpha)))
        rank = np.minimum(x.astype(np.int64) - 1, s["n"] - 1)
        return (s["a"] * rank + s["b"]) % s["n"] + s["offsets"]

    def _to_bags(self, compact: np.ndarray) -> np.ndarray:
        """Compact ids ``[B, K]`` as the batch layout ``[B, F]`` or padded ``[B, F, L]``."""
        if not self.multi_hot:
            return compact
        bags = np.full((self.batch_size, self.num_features * self.bag_size), self.padding_id)
        bags[:, self._structure["column_target"]] = compact
        return bags.reshape(self.ids_shape)

    def id_weights(self, ids: np.ndarray) -> np.ndarray:
        """The hidden label model's weight of each id (``0`` for padding).

        Args:
          ids: ids of any shape (``padding_id`` allowed).

        Returns:
          ``float32`` weights of the same shape.

        Examples:
          >>> import numpy as np, jaxcache
          >>> data = jaxcache.synthetic.SyntheticCriteo(scale=0.001)
          >>> w = data.id_weights(np.array([0, 1, -1]))
          >>> bool(abs(w[0]) <= 0.6 and w[0] != w[1] and w[2] == 0)
          True
        """
        ids = np.asarray(ids)
        unit = _hash32(np.maximum(ids, 0), self._structure["hash_key"]).astype(np.float32)
        weights = (unit * np.float32(2.0**-31) - np.float32(1.0)) * np.float32(_ID_WEIGHT)
        return np.where(ids == self.padding_id, np.float32(0), weights)

    def logits(self, batch: dict[str, np.ndarray]) -> np.ndarray:
        """The hidden model's click logits ``float32 [B]`` (the best possible scores).

        A bag contributes the mean weight of its ids.

        Examples:
          >>> import jaxcache
          >>> data = jaxcache.synthetic.SyntheticCriteo(scale=0.001, batch_size=8)
          >>> data.logits(data.batch(0)).shape
          (8,)
        """
        s = self._structure
        weights = self.id_weights(batch["sparse"])
        if self.multi_hot:
            weights = weights.sum(-1) / np.asarray(self.bag_sizes, np.float32)
        return s["bias"] + weights.sum(-1) + batch["dense"] @ s["dense_weight"]

    def batch(self, index: int, *, held_out: bool = False) -> dict[str, np.ndarray]:
        """Batch ``index`` of the training (or held-out) stream.

        Args:
          index: position in the stream, ``>= 0``.
          held_out: draw from the held-out stream (same dataset, disjoint
            samples) for evaluation.

        Returns:
          ``{"dense": float32 [B, 13], "sparse": int64 [B, F(, L)], "label": float32 [B]}``.

        Examples:
          >>> import jaxcache
          >>> data = jaxcache.synthetic.SyntheticCriteo(scale=0.001, batch_size=2,
          ...                                           multi_hot=True, bag_size=4)
          >>> data.batch(3)["sparse"][0, :3].tolist() == data.batch(3)["sparse"][0, :3].tolist()
          True
          >>> data.batch(0)["sparse"].shape
          (2, 26, 4)
        """
        rng = self._rng(index, held_out)
        s = self._structure
        compact = self._sample_ids(rng)
        counts = rng.standard_exponential((self.batch_size, NUM_DENSE), dtype=np.float32)
        dense = np.log1p(counts * s["dense_scale"])
        logits = s["bias"] + self.id_weights(compact) @ s["bag_weight"] + dense @ s["dense_weight"]
        p = 1.0 / (1.0 + np.exp(-logits))
        label = (rng.random(self.batch_size, dtype=np.float32) < p).astype(np.float32)
        return {"dense": dense, "sparse": self._to_bags(compact), "label": label}

    def batches(
        self, count: int, *, start: int = 0, held_out: bool = False
    ) -> Iterator[dict[str, np.ndarray]]:
        """Batches ``start, ..., start + count - 1`` of a stream.

        Examples:
          >>> import jaxcache
          >>> data = jaxcache.synthetic.SyntheticCriteo(scale=0.001, batch_size=2)
          >>> [b["label"].shape for b in data.batches(2, held_out=True)]
          [(2,), (2,)]
        """
        for index in range(start, start + count):
            yield self.batch(index, held_out=held_out)

    def count_frequencies(self, num_batches: int, *, start: int = 0) -> np.ndarray:
        """Access counts ``int64 [N]`` of every id over training batches.

        The profile a ``"frequency"`` policy ranks rows by (and ``"lfu"`` can
        start from): counts over the first ``num_batches`` batches, padding
        excluded. Only ids are drawn, so it is cheaper than ``batches``.

        Args:
          num_batches: batches to count.
          start: first batch.

        Returns:
          The counts, indexed by id.

        Examples:
          >>> import jaxcache
          >>> data = jaxcache.synthetic.SyntheticCriteo(scale=0.001, batch_size=64)
          >>> counts = data.count_frequencies(3)
          >>> counts.shape, int(counts.sum())
          ((33803,), 4992)
        """
        counter = FrequencyCounter(self.num_embeddings)
        for index in range(start, start + num_batches):
            counter.update(self._sample_ids(self._rng(index, held_out=False)))
        return counter.counts
