"""One embedding table shared by several categorical features.

DLRM-style models keep every feature's rows in ONE table: feature ``f``'s id
``i`` (``0 <= i < V_f``) is row ``offsets[f] + i``, with
``offsets = [0, V_0, V_0 + V_1, ...]``, so one ``jaxcache.EmbeddingCache``
serves all features and their hot rows compete for the same cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["shared_offsets", "to_shared_table"]


def shared_offsets(cardinalities: Sequence[int] | np.ndarray) -> np.ndarray:
    """``int64 [F]``: the first row of each feature in the shared table.

    Examples:
      >>> import jaxcache.datasets as jd
      >>> jd.shared_offsets([3, 5, 2]).tolist()
      [0, 3, 8]
    """
    sizes = np.asarray(cardinalities, np.int64)
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


def to_shared_table(
    ids: np.ndarray, cardinalities: Sequence[int], *, padding_id: int | None = None
) -> np.ndarray:
    """Ids of ``F`` features, each in ``[0, V_f)``, as rows of ONE table of ``sum(V)`` rows.

    Feature ``f``'s id ``i`` becomes ``offsets[f] + i`` with
    ``offsets = [0, V_0, V_0 + V_1, ...]``: all features share one
    ``jaxcache.EmbeddingCache`` (as ``jaxcache.models.DLRM`` expects).

    Args:
      ids: ``int [B, F]``, or bags ``[B, F, L]``.
      cardinalities: ``V_f`` of each feature.
      padding_id: bag padding, kept as is.

    Returns:
      ``int64`` ids of the same shape.

    Raises:
      ValueError: an id outside its feature's vocabulary (the vocabulary is
        smaller than the id).

    Examples:
      >>> import numpy as np, jaxcache.datasets as jd
      >>> jd.to_shared_table(np.array([[0, 0], [2, 4]]), [3, 5]).tolist()
      [[0, 3], [2, 7]]
      >>> jd.to_shared_table(np.array([[3, 0]]), [3, 5])  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ValueError: feature 0 has id 3 at sample 0, but its vocabulary has 3 rows (ids 0..2); ...
    """
    ids = np.asarray(ids)
    sizes = np.asarray(cardinalities, np.int64)
    if ids.ndim < 2 or ids.shape[1] != sizes.size:
        raise ValueError(
            f"ids of shape {ids.shape} do not match {sizes.size} cardinalities; pass ids as "
            "[B, F] (or [B, F, L]) with one cardinality per feature."
        )
    bcast = sizes.reshape(-1, *([1] * (ids.ndim - 2)))
    real = ids if padding_id is None else np.where(ids == padding_id, 0, ids)
    if real.size:
        # Per-feature extremes first: cheaper than a mask of the whole batch.
        axes = (0, *range(2, ids.ndim))
        if (real.min(axis=axes) < 0).any() or (real.max(axis=axes) >= sizes).any():
            where = np.argwhere((real < 0) | (real >= bcast))[0]
            sample, feature, value = int(where[0]), int(where[1]), int(ids[tuple(where)])
            raise ValueError(
                f"feature {feature} has id {value} at sample {sample}, but its vocabulary has "
                f"{sizes[feature]} rows (ids 0..{sizes[feature] - 1}); build the dataset with "
                "vocabularies at least this large, or reduce the ids modulo the vocabulary."
            )
    shared = real.astype(np.int64, copy=False) + shared_offsets(sizes).reshape(bcast.shape)
    if padding_id is not None:
        shared = np.where(ids == padding_id, padding_id, shared)
    return shared
