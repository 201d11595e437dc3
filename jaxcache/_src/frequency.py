"""Streaming access counts per id, to rank rows and warm a cache."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from jaxcache._src import validation

__all__ = ["FrequencyCounter", "hottest"]


def hottest(counts: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` most frequent ids that occur at all, hottest first (ties: smaller id).

    Args:
      counts: non-negative access count per id.
      k: how many ids at most.

    Returns:
      ``int64`` ids.

    Examples:
      >>> import numpy as np, jaxcache
      >>> jaxcache.planning.hottest(np.array([3, 0, 9, 3], np.uint32), 3).tolist()
      [2, 0, 3]
    """
    counts = np.asarray(counts).astype(np.int64)  # negating unsigned counts would wrap
    order = np.argsort(-counts, kind="stable")[:k]
    return order[counts[order] > 0]


class FrequencyCounter:
    """Counts how often each id is looked up, over a stream of batches.

    With ``sample_rate < 1`` only that fraction of the samples (rows of a
    batch) is counted, as FAE profiles 5% of the training data; counts are
    then estimates, but rankings of hot rows are stable.

    Args:
      num_embeddings: ``N``, ids are in ``[0, N)``.
      sample_rate: fraction of samples counted, in ``(0, 1]``.
      padding_id: id to ignore (bag padding), or ``None``.
      seed: seed of the sampler.

    Examples:
      >>> import numpy as np, jaxcache
      >>> counter = jaxcache.FrequencyCounter(5)
      >>> counter.update(np.array([[0, 3], [3, 3]]))
      >>> counter.counts.tolist()
      [1, 0, 0, 3, 0]
      >>> counter.ranking()[:2].tolist()
      [3, 0]
    """

    def __init__(
        self,
        num_embeddings: int,
        *,
        sample_rate: float = 1.0,
        padding_id: int | None = None,
        seed: int = 0,
    ) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate={sample_rate} must be in (0, 1], e.g. 0.05 for 5%.")
        self.num_embeddings = int(num_embeddings)
        self.sample_rate = float(sample_rate)
        self.padding_id = padding_id
        self.counts = np.zeros(self.num_embeddings, np.int64)
        self.samples_seen = 0
        self._rng = np.random.default_rng(seed)

    def update(self, ids: np.ndarray) -> None:
        """Counts one batch of ids ``[B, ...]`` (the first axis is samples)."""
        # Counts are per row of a fixed table: a dynamic vocabulary takes none.
        ids = validation.check_ids(
            ids, self.num_embeddings, self.padding_id, "ids", dynamic_fix=False
        )
        self.samples_seen += ids.shape[0]
        if self.sample_rate < 1:
            ids = ids[self._rng.random(ids.shape[0]) < self.sample_rate]
        flat = ids.reshape(-1)
        if self.padding_id is not None:
            flat = flat[flat != self.padding_id]
        np.add.at(self.counts, flat, 1)

    def update_all(self, batches: Iterable[np.ndarray]) -> FrequencyCounter:
        """Counts every batch of an iterable; returns ``self``."""
        for ids in batches:
            self.update(ids)
        return self

    def ranking(self) -> np.ndarray:
        """Ids from most to least frequent (ties by smaller id first)."""
        return np.argsort(-self.counts, kind="stable")

    def hottest(self, k: int) -> np.ndarray:
        """The ``k`` most frequent ids that were seen at least once, hottest first."""
        return hottest(self.counts, k)
