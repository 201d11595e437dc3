"""Evaluation metrics in NumPy."""

from __future__ import annotations

import numpy as np

__all__ = ["roc_auc"]


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve, from ranks (the Mann-Whitney statistic).

    The probability that a random positive scores higher than a random
    negative, ties counting one half. ``O(n log n)``, exact for any scores.

    Args:
      labels: ``[n]`` binary labels (``0``/``1``, or booleans).
      scores: ``[n]`` scores; any monotone transform (logits, probabilities)
        gives the same AUC.

    Returns:
      The AUC in ``[0, 1]``.

    Raises:
      ValueError: shapes differ, labels are not binary, or one class is
        missing (the AUC is undefined).

    Examples:
      >>> import numpy as np, jaxcache
      >>> jaxcache.synthetic.roc_auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8]))
      0.75
      >>> jaxcache.synthetic.roc_auc(np.array([0, 1, 0, 1]), np.array([0.5, 0.5, 0.2, 0.9]))
      0.875
    """
    labels = np.asarray(labels).reshape(-1)
    scores = np.asarray(scores, np.float64).reshape(-1)
    if labels.shape != scores.shape:
        raise ValueError(
            f"labels has {labels.size} values but scores has {scores.size}; pass one score "
            "per label."
        )
    binary = np.isin(labels, (0, 1))
    if not binary.all():
        where = int(np.argmin(binary))
        raise ValueError(
            f"labels must be binary (0/1 or booleans), got {labels[where].item()!r} at index "
            f"{where}; threshold them or map them to 0/1 first."
        )
    positive = labels.astype(bool)
    num_pos = int(positive.sum())
    num_neg = positive.size - num_pos
    if num_pos == 0 or num_neg == 0:
        raise ValueError(
            f"the AUC needs both classes, got {num_pos} positive and {num_neg} negative "
            "labels; evaluate on more samples."
        )
    order = np.argsort(scores, kind="stable")
    sorted_scores = scores[order]
    # Average rank (1-based) of each run of tied scores.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], sorted_scores.size]
    run_rank = (starts + ends + 1) / 2.0
    ranks = np.empty(scores.size)
    ranks[order] = np.repeat(run_rank, ends - starts)
    u = ranks[positive].sum() - num_pos * (num_pos + 1) / 2.0
    return float(u / (num_pos * num_neg))
