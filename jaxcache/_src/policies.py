"""Eviction policies: the priority of a resident row (lowest is evicted first).

A policy gives each resident row an integer priority and may learn from every
planned batch. Priorities never decrease while a row stays resident: the
planner relies on it to keep a small reserve of victim candidates instead of
sorting every slot on every step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxcache._src import validation

if TYPE_CHECKING:
    from jaxcache._src.planner import Planner

__all__ = ["FrequencyPolicy", "LFUPolicy", "LRUPolicy", "Policy", "make_policy"]


class Policy:
    """Base class: priority of resident rows, updated from each batch."""

    name = ""
    #: Whether ``record`` reads the lookups of each distinct slot (``counts``);
    #: the planner counts them only for policies that do.
    needs_counts = False

    def priorities(self, planner: Planner) -> np.ndarray:
        """``int64 [C]``: the priority of the row each slot holds (the
        policy's own array, read by the planner, not a copy)."""
        raise NotImplementedError

    def on_insert(self, planner: Planner, slots: np.ndarray, ids: np.ndarray) -> None:
        """Rows ``ids`` were just placed in ``slots``."""

    def record(self, planner: Planner, unique_slots: np.ndarray, counts: np.ndarray | None) -> None:
        """Learns from a planned batch: its distinct slots ``int32 [U]`` and,
        when ``needs_counts``, the lookups of each ``int [U]`` (padding
        excluded); else ``counts`` is ``None``."""

    # -------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What the policy learned, for a checkpoint: ``{"name": ...}`` plus arrays.

        The arrays are the policy's own, not copies. Recency is the planner's
        (``last_use``); per-slot mirrors are rebuilt by ``on_insert``.
        """
        return {"name": self.name}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Takes over what ``state_dict`` of a policy returned (before the
        planner re-inserts the resident rows). A policy keeps what it can use:
        counting policies take any saved per-id counts.
        """


class LRUPolicy(Policy):
    """Least recently used: priority is the index of the last plan using the row."""

    name = "lru"

    def priorities(self, planner):
        return planner.last_use


class _CountPolicy(Policy):
    """Priority is a count per id, mirrored per slot so ranking reads ``[C]``."""

    def __init__(self, counts: np.ndarray, capacity: int) -> None:
        self.counts = counts
        self.slot_counts = np.zeros(capacity, np.int64)

    def priorities(self, planner):
        return self.slot_counts

    def on_insert(self, planner, slots, ids):
        self.slot_counts[slots] = self.counts[ids]

    def state_dict(self):
        return {"name": self.name, "counts": self.counts}

    def load_state_dict(self, state):
        counts = state.get("counts")
        if counts is None or counts is self.counts:
            return
        if np.shape(counts) != self.counts.shape:
            raise ValueError(
                f"saved access counts have shape {np.shape(counts)} but the table has "
                f"{self.counts.shape[0]} rows; restore into a table of the same size."
            )
        self.counts[...] = counts


class FrequencyPolicy(_CountPolicy):
    """Static dataset frequency (the policy of Fang et al. 2022).

    The priority of a row is how often its id occurs in the dataset; it never
    changes. The cache starts warmed with the hottest rows.
    """

    name = "frequency"


class LFUPolicy(_CountPolicy):
    """Online least frequently used: counts every lookup seen so far.

    Counts are kept for every id (not only resident ones), so a row that
    comes back keeps its history. Optionally seeded with dataset counts.
    """

    name = "lfu"

    needs_counts = True

    def record(self, planner, unique_slots, counts):
        ids = planner.id_of_slot[unique_slots]
        self.counts[ids] += counts
        self.slot_counts[unique_slots] = self.counts[ids]


def make_policy(
    name: str, num_embeddings: int, capacity: int, frequencies: np.ndarray | None
) -> Policy:
    """Builds the policy ``name`` for ``capacity`` slots over ``num_embeddings`` rows."""
    if frequencies is not None:
        frequencies = validation.check_frequencies(
            frequencies, num_embeddings, "count them with jaxcache.FrequencyCounter"
        )
    if name == "lru":
        return LRUPolicy()
    if name == "lfu":
        counts = np.zeros(num_embeddings, np.int64)
        if frequencies is not None:
            counts[:] = frequencies
        return LFUPolicy(counts, capacity)
    if name == "frequency":
        if frequencies is None:
            raise ValueError(
                "policy='frequency' ranks rows by dataset counts: pass frequencies= "
                "(e.g. jaxcache.FrequencyCounter(N).update_all(batches).counts), or use 'lfu'."
            )
        return FrequencyPolicy(frequencies, capacity)
    raise ValueError(f"unknown policy {name!r}; use 'frequency', 'lfu' or 'lru'.")
