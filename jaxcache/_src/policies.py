"""Eviction policies: the priority of a resident row (lowest is evicted first).

A policy gives each resident row an integer priority and may learn from every
planned batch. Priorities never decrease while a row stays resident: the
planner relies on it to keep a small reserve of victim candidates instead of
sorting every slot on every step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from jaxcache._src import kernels, validation
from jaxcache._src.config import POLICIES
from jaxcache._src.frequency import hottest
from jaxcache._src.hashing import LOG2_TABLE


class Planner(Protocol):
    """What a policy reads of the planner whose slots it ranks (``Planner``)."""

    next_index: int
    id_of_slot: np.ndarray
    last_use: np.ndarray


__all__ = [
    "AdaptivePolicy",
    "FrequencyPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "Policy",
    "make_policy",
]


class Policy:
    """Base class: priority of resident rows, updated from each batch."""

    name = ""
    #: Names of the ``state_dict`` arrays with one entry per id (leading axis
    #: ``N``); the others describe slots or the policy as a whole.
    per_id: tuple[str, ...] = ()
    #: Whether ``record`` reads the lookups of each distinct slot (``counts``);
    #: the planner counts them only for policies that do.
    needs_counts = False
    #: Whether a cache starts with the hottest rows by dataset counts loaded.
    warms = False
    #: ``(per_id, per_slot)``, ``int64 [N]`` and ``int64 [C]``: a value of
    #: each id the policy ranks by, and its copy for the row each slot holds
    #: (so ranking reads ``[C]``, not ``[N]``). The planner copies it for
    #: every row it places, in the pass that places them, before ``on_insert``.
    mirror: tuple[np.ndarray, np.ndarray] | None = None
    #: Whether each planned batch's lookups of a row are added to its
    #: ``mirror`` count (by the planner, in the pass that commits the plan,
    #: before ``record``).
    counts_lookups = False

    def priorities(self, planner: Planner) -> np.ndarray:
        """``int64 [C]``: the priority of the row each slot holds (the
        policy's own array, read by the planner, not a copy)."""
        raise NotImplementedError

    def on_insert(self, planner: Planner, slots: np.ndarray, ids: np.ndarray) -> None:
        """Rows ``ids`` were just placed in ``slots`` (``mirror`` already copied)."""

    def record(self, planner: Planner, unique_slots: np.ndarray, counts: np.ndarray | None) -> None:
        """Learns from a planned batch: its distinct slots ``int32 [U]`` and,
        when ``needs_counts``, the lookups of each ``int [U]`` (padding
        excluded); else ``counts`` is ``None``."""

    # -------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What the policy learned, for a checkpoint: ``{"name": ...}`` plus arrays.

        The arrays are the policy's own, not copies. Recency is the planner's
        (``last_use``); per-slot mirrors are rebuilt as the rows are placed.
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

    per_id = ("counts",)

    def __init__(self, counts: np.ndarray, capacity: int) -> None:
        self.counts = counts
        self.slot_counts = np.zeros(capacity, np.int64)
        self.mirror = (counts, self.slot_counts)

    def priorities(self, planner):
        return self.slot_counts

    def state_dict(self):
        return {"name": self.name, "counts": self.counts}

    def load_state_dict(self, state):
        _take_counts(self.counts, state)


def _take_counts(counts: np.ndarray, state: Mapping[str, Any]) -> None:
    """Copies the per-id ``counts`` saved in ``state`` (of any counting
    policy), if any, into ``counts``."""
    saved = state.get("counts")
    if saved is None or saved is counts:
        return
    if np.shape(saved) != counts.shape:
        raise ValueError(
            f"saved access counts have shape {np.shape(saved)} but the table has "
            f"{counts.shape[0]} rows; restore into a table of the same size."
        )
    counts[...] = saved


class FrequencyPolicy(_CountPolicy):
    """Static dataset frequency (the policy of Fang et al. 2022).

    The priority of a row is how often its id occurs in the dataset; it never
    changes. The cache starts warmed with the hottest rows.
    """

    name = "frequency"
    warms = True


class LFUPolicy(_CountPolicy):
    """Online least frequently used: counts every lookup seen so far.

    Counts are kept for every id (not only resident ones), so a row that
    comes back keeps its history. Optionally seeded with dataset counts.
    """

    name = "lfu"
    counts_lookups = True  # all LFU learns from a batch


# The rules of ``AdaptivePolicy``: indices into ``rules[1:]`` and ``rule_scores``.
_QUICK, _STEADY = 0, 1


class AdaptivePolicy(Policy):
    """Recency plus a learned weight of frequency, with admission control.

    The priority of a row is the batch that last used it plus a bonus that
    grows with the row's *weight*: its lookups so far, or its dataset count
    (the prior, when given) if that is larger::

        key = 256 * last_use + bonus * log2_fixed(weight)   # log2 in 1/256ths

    A row keeps its place for ``bonus`` more batches each time its weight
    doubles. ``bonus = 0`` is LRU; large bonuses rank by weight with recency
    breaking ties; the last choice, ``-1``, ranks by weight alone (``key =
    weight``: LFU, or the static frequency policy when the prior dominates).

    Admission: a row seen once and unknown to the prior has weight 1 and no
    bonus, so newcomers form the short-lived low end of the order and are
    evicted first, oldest first, unless they come back; one-off ids churn
    among themselves and never push out rows that proved themselves.
    Popularity that goes stale fades: a bonus is a fixed lead in time, so a
    row that is no longer looked up is overtaken by newer ones.

    How much frequency deserves is learned online. One shadow cache per bonus
    of ``BONUSES`` replays a fixed sample of the ids (one in ``2^bits`` by
    hash, ``bits`` such that a shadow holds ``capacity / 2^bits`` rows, about
    ``SHADOW_ROWS``) under the same batch rule and counts its hits; decaying
    sums of those hits pick the bonus of the cache. When the choice
    changes, the resident rows are re-keyed under the new bonus and shifted up
    by a common offset so that no key decreases (the planner's victim reserve
    relies on it). With a prior, the shadows start warmed with their hottest
    sampled ids, as the cache does.

    A change of bonus has a cost the fixed shadows do not see: the cache
    keeps the rows the old bonus chose. Two rules turn scores into a choice:
    *quick* follows the best score losing ``1 / 2^DECAY`` a batch, *steady*
    moves only when the lead also holds on scores losing ``1 / 2^SLOW_DECAY``.
    Each rule has a shadow of its own that switches as the rule does (its
    rows re-keyed), and the cache follows the rule whose shadow scored more.
    Where popularity alternates faster than the quick scores forget, the
    quick rule would switch with every phase, each time just too late.

    State: ``counts`` ``int64 [N]`` (per id), the shadow caches
    (``O((len(BONUSES) + 2) * SHADOW_ROWS)``), their scores, two scalars (the
    choice and the offset) and ``rules`` (the rule followed and each rule's
    choice). The keys ``int64 [C]`` follow from those and the planner's
    ``last_use``; the prior is the constructor's.

    Examples:
      >>> import numpy as np, jaxcache
      >>> cfg = jaxcache.CacheConfig(100, 1, capacity=4, policy="adaptive")
      >>> planner = jaxcache.planning.Planner(cfg)
      >>> for ids in ([1, 2, 1, 2], [1, 2, 3], [4, 5]):  # 1 and 2 come back
      ...     planner.release(planner.plan(np.array(ids)).index)
      >>> plan = planner.plan(np.array([6]))  # a newcomer evicts a newcomer
      >>> sorted(planner.resident_ids().tolist()), planner.policy.bonus
      ([1, 2, 5, 6], 16)
    """

    name = "adaptive"
    needs_counts = True
    per_id = ("counts",)
    #: Bonuses the shadow caches try, in batches per doubling of the weight
    #: (``-1``: by weight alone).
    BONUSES = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 8192, -1)
    #: Rows each shadow cache aims at (it holds all ``capacity`` when smaller).
    SHADOW_ROWS = 1024
    #: Each batch, the shadows' quick scores lose ``1 / 2^DECAY`` of their value.
    DECAY = 5
    #: Each batch, the steady scores, and the scores of the rules' own
    #: shadows, lose ``1 / 2^SLOW_DECAY``.
    SLOW_DECAY = 8
    #: A score leads another when it is higher by more than ``1 / 2^MARGIN``
    #: of the other's.
    MARGIN = 8
    #: The bonus used before any evidence (an index into ``BONUSES``). With a
    #: prior the policy starts by weight alone (the last candidate) instead:
    #: the cache starts warmed with the hottest rows by the prior, the rows
    #: that ranking keeps, and a recency bonus would give them away before
    #: any evidence (rows it evicts return only when looked up again).
    START = 5

    def __init__(self, counts: np.ndarray, capacity: int, prior: np.ndarray | None = None) -> None:
        self.counts = counts
        self.prior = np.zeros(0, np.int64) if prior is None else prior
        self.warms = prior is not None
        self.keys = np.zeros(capacity, np.int64)
        # The prior of each resident row: a batch's keys read [C], not [N].
        self.slot_prior = np.zeros(capacity if self.warms else 0, np.int64)
        self.mirror = (self.prior, self.slot_prior) if self.warms else None
        self._inserted: list[tuple[int, np.ndarray]] = []  # (next plan index, slots)
        self.bits = 0
        while capacity >> (self.bits + 1) >= self.SHADOW_ROWS:
            self.bits += 1
        size = capacity >> self.bits
        k = len(self.BONUSES)
        start = k - 1 if self.warms else self.START
        # The shadows' bonuses: one per candidate, then the two rules' own
        # shadows (``_QUICK``, ``_STEADY``), at the bonus each rule chose.
        self._bonuses = np.array([*self.BONUSES, *[self.BONUSES[start]] * 2], np.int64)
        table = 4
        while table < 2 * size:
            table *= 2
        self.shadow_rows = np.zeros((k + 2, size, 3), np.int64)
        self.shadow_rows[:, :, 0] = -1
        self.shadow_heap = np.zeros((k + 2, size, 2), np.int64)
        self.shadow_table = np.full((k + 2, table), -1, np.int32)
        self.shadow_state = np.zeros((k + 2, 3), np.int64)
        self.scores = np.zeros(k, np.int64)  # quick
        self.slow_scores = np.zeros(k, np.int64)  # steady
        self.rule_scores = np.zeros(2, np.int64)  # of the rules' shadows
        # [chosen bonus index, key offset]
        self.scalars = np.array([start, 0], np.int64)
        # [rule followed, quick rule's choice, steady rule's choice]
        self.rules = np.array([_STEADY, start, start], np.int64)
        if self.warms:  # the shadows start as a warmed cache does
            if self.bits:
                ids = kernels.sample_ids(counts.size, self.bits)
                hot = ids[hottest(self.prior[ids], size)]
            else:
                hot = hottest(self.prior, size)
            self._shadow_step(np.sort(hot), -1)
            self.shadow_state[:, 2] = 0

    @property
    def bonus(self) -> int:
        """The bonus in use, in batches per doubling of a row's weight (``-1``:
        by weight alone)."""
        return self.BONUSES[self.scalars[0]]

    def priorities(self, planner):
        self._key_inserted(planner)
        return self.keys

    def on_insert(self, planner, slots, ids):
        # Keyed when the keys are next read: the rows a plan inserts are keyed
        # by its record right after, so they are never keyed twice.
        self._inserted.append((planner.next_index, slots))

    def _key_inserted(self, planner, skip: int | None = None) -> None:
        """Keys the rows inserted since the keys were last read (except those
        of plan ``skip - 1``, which ``record`` keys)."""
        for index, slots in self._inserted:
            if index != skip:
                self._key(planner, slots)
        self._inserted.clear()

    def _key(self, planner, slots: np.ndarray) -> None:
        kernels.adaptive_keys(
            slots,
            planner.id_of_slot[slots],
            planner.last_use,
            self.counts,
            self.slot_prior,
            self.keys,
            self.bonus,
            int(self.scalars[1]),
            LOG2_TABLE,
        )

    def record(self, planner, unique_slots, counts):
        self._key_inserted(planner, skip=planner.next_index)
        t = planner.next_index - 1
        ids = planner.id_of_slot[unique_slots]
        sample = kernels.adaptive_record(
            unique_slots,
            ids,
            counts,
            self.counts,
            self.slot_prior,
            self.keys,
            t,
            self.bonus,
            int(self.scalars[1]),
            LOG2_TABLE,
            self.bits,
        )
        sample.sort()
        choice = self.learn(sample, t)
        if choice != int(self.scalars[0]):
            self._choose(planner, choice)

    def learn(self, sample: np.ndarray, t: int) -> int:
        """Plans batch ``t``'s sampled distinct ids (sorted; their ``counts``
        already include the batch) through the shadow caches, updates the
        scores and the rules, and returns the index into ``BONUSES`` the
        cache should use from the next batch on."""
        self._shadow_step(sample, t)
        k = len(self.BONUSES)
        hits = self.shadow_state[:, 2]
        self.scores -= self.scores >> self.DECAY
        self.scores += hits[:k] << 16
        self.slow_scores -= self.slow_scores >> self.SLOW_DECAY
        self.slow_scores += hits[:k] << 16
        self.rule_scores -= self.rule_scores >> self.SLOW_DECAY
        self.rule_scores += hits[k:] << 16
        best = int(np.argmax(self.scores))
        for rule in (_QUICK, _STEADY):
            held = int(self.rules[1 + rule])
            if best == held or not self._leads(self.scores, best, held):
                continue
            if rule == _STEADY and not self._leads(self.slow_scores, best, held):
                continue
            self.rules[1 + rule] = best
            self._rekey_shadow(k + rule)
        followed = int(self.rules[0])
        if self._leads(self.rule_scores, 1 - followed, followed):
            self.rules[0] = followed = 1 - followed
        return int(self.rules[1 + followed])

    def _leads(self, scores: np.ndarray, a: int, b: int) -> bool:
        """Whether ``scores[a]`` leads ``scores[b]`` (by more than ``1 / 2^MARGIN``)."""
        return bool(scores[a] > scores[b] + (scores[b] >> self.MARGIN))

    def _rekey_shadow(self, j: int) -> None:
        """Shadow ``j`` (a rule's) takes its rule's choice: its bonus, its rows re-keyed."""
        k = len(self.BONUSES)
        self._bonuses[j] = self.BONUSES[int(self.rules[1 + j - k])]
        kernels.shadow_rekey(
            j,
            self._bonuses[j],
            self.counts,
            self.prior,
            self.shadow_rows,
            self.shadow_heap,
            self.shadow_state,
            LOG2_TABLE,
        )

    def _shadow_step(self, sample: np.ndarray, t: int) -> None:
        kernels.shadow_step(
            sample,
            t,
            self.counts,
            self.prior,
            self._bonuses,
            self.shadow_rows,
            self.shadow_heap,
            self.shadow_table,
            self.shadow_state,
            self.bits,
            LOG2_TABLE,
        )

    def _choose(self, planner, choice: int) -> None:
        """Uses bonus ``BONUSES[choice]`` from now on, re-keying the resident rows."""
        self._key_inserted(planner)
        self.scalars[0] = choice
        slots = np.flatnonzero(planner.id_of_slot >= 0)
        old = self.keys[slots]
        self._key(planner, slots)
        if slots.size:
            lift = max(0, int((old - self.keys[slots]).max()))
            self.scalars[1] += lift
            self.keys[slots] += lift

    def state_dict(self):
        return {
            "name": self.name,
            "counts": self.counts,
            "scores": self.scores,
            "slow_scores": self.slow_scores,
            "rule_scores": self.rule_scores,
            "scalars": self.scalars,
            "rules": self.rules,
            "shadow_rows": self.shadow_rows,
            "shadow_heap": self.shadow_heap,
            "shadow_table": self.shadow_table,
            "shadow_state": self.shadow_state,
        }

    def load_state_dict(self, state):
        _take_counts(self.counts, state)
        if state.get("name") != self.name:
            return
        own = self.state_dict()
        if all(
            state.get(k) is not None and np.shape(state[k]) == np.shape(own[k])
            for k in own
            if k != "name"
        ):
            for key, value in own.items():
                if key not in ("name", "counts") and state[key] is not value:
                    value[...] = state[key]
            k = len(self.BONUSES)
            self._bonuses[k:] = [self.BONUSES[int(c)] for c in self.rules[1:]]
        elif np.shape(state.get("scalars")) == self.scalars.shape:
            # Another capacity (or a state saved before the rules): the
            # shadows start afresh, the choice carries over, and both rules
            # start from it.
            self.scalars[...] = state["scalars"]
            self.rules[1:] = self.scalars[0]
            for j in range(len(self.BONUSES), len(self._bonuses)):
                self._rekey_shadow(j)


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
    if name == "adaptive":
        return AdaptivePolicy(np.zeros(num_embeddings, np.int64), capacity, frequencies)
    if name == "frequency":
        if frequencies is None:
            raise ValueError(
                "policy='frequency' ranks rows by dataset counts: pass frequencies= "
                "(e.g. jaxcache.FrequencyCounter(N).update_all(batches).counts), or use 'lfu'."
            )
        return FrequencyPolicy(frequencies, capacity)
    raise ValueError(f"unknown policy {name!r}; use one of {', '.join(POLICIES)}.")
