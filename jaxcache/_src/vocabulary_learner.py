"""The bonus of ``DynamicVocabulary(forget="adaptive")``, learned online.

``forget="lrfu"`` forgets the way of least ``256 * age + bonus *
log2(lookups)`` at a fixed bonus; ``"adaptive"`` learns the bonus as the
adaptive cache policy learns its own (``policies.AdaptivePolicy``): one
shadow vocabulary per candidate of ``BONUSES`` replays a fixed sample of
the ids by the same rules and counts its *found* lookups (those of ids that
had a row), and a decaying sum of those counts picks the bonus.

- **Sample**: the ids whose 32-bit hash (``hashing.id_hash``, whose low bits
  name the bucket) has its top ``bits`` bits zero, ``bits`` the least such
  that a shadow of ``rows >> bits`` rows holds fewer than ``2 *
  SHADOW_ROWS`` (every id when the budget is smaller). A sampled id is
  sampled in every batch, so a shadow sees all of its lookups; buckets are
  sampled alike, since the bucket bits are the other end of the hash.
- **Shadows**: ``Vocabulary``s of ``rows >> bits`` rows, the vocabulary's
  ways, admission and seed, forgetting by ``"lrfu"`` at their bonus. They
  hold no rows for batches in flight (a shadow has none) and have no
  ``ttl``. A shadow bucket that cannot take a batch's sampled new ids
  takes none of the batch (it only counts what it found).
- **Order**: a batch's sampled distinct ids, sorted by value, with their
  lookups: what every planner, device count and process count agree on.
  A plan's sample is learned from just before the next plan (``settle``),
  so a plan taken back (``drop``) teaches nothing, and the bonus of plan
  ``t`` depends on the training batches before ``t`` alone: the look-ahead
  and the threads never change it.
- **Choice**: each candidate's score loses ``1 / 2^DECAY`` a training batch
  and gains its shadow's found lookups; the vocabulary moves to the best
  candidate when it leads the one in use by more than ``1 / 2^MARGIN``.
  A change costs nothing to apply: the keys are computed from each way's
  last use and lookups when a bucket is full.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxcache._src.config import DynamicVocabulary
from jaxcache._src.hashing import id_hash, id_words, seed_word
from jaxcache._src.planner import CapacityError
from jaxcache._src.vocabulary import Vocabulary

__all__ = ["BonusLearner"]


class BonusLearner:
    """Learns the bonus of ``forget="adaptive"`` (see the module).

    Args:
      rows: the vocabulary's row budget (its id rows).
      ways: its most rows per bucket.
      admit_after: its admission threshold.
      sketch_width: its sketch's width (the shadows' is ``1 / 2^bits`` of it).
      seed: its seed.

    Examples:
      >>> learner = BonusLearner(4, ways=4, admit_after=1, sketch_width=16, seed=0)
      >>> # 1 and 2 come back every batch; each batch also brings two one-off ids.
      >>> for t in range(40):
      ...     learner.offer(np.array([1, 2, 100 + 2 * t, 101 + 2 * t]), np.ones(4, np.int64), t)
      ...     learner.settle()
      >>> learner.bonus > 0  # frequency earns a bonus: 1 and 2 keep their rows
      True
    """

    #: The candidate bonuses, in plans per doubling of an id's lookups.
    BONUSES = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
    #: Rows each shadow aims at (all ``rows`` when fewer).
    SHADOW_ROWS = 1024
    #: Each training batch, the scores lose ``1 / 2^DECAY`` of their value.
    DECAY = 5
    #: A score leads another when higher by more than ``1 / 2^MARGIN`` of it.
    MARGIN = 8
    #: The bonus before any evidence (an index into ``BONUSES``): lrfu's default.
    START = 4

    def __init__(
        self, rows: int, *, ways: int, admit_after: int, sketch_width: int, seed: int
    ) -> None:
        self.bits = 0
        while rows >> (self.bits + 1) >= self.SHADOW_ROWS:
            self.bits += 1
        self.salt = seed_word(seed)
        self.shadows = [
            Vocabulary(
                max(1, rows >> self.bits),
                admit_after=admit_after,
                forget="lrfu",
                bonus=bonus,
                ways=ways,
                sketch_width=max(1, sketch_width >> self.bits),
                seed=seed,
            )
            for bonus in self.BONUSES
        ]
        self.scores = np.zeros(len(self.BONUSES), np.int64)
        self.choice = self.START
        self._pending: tuple[np.ndarray, np.ndarray, int] | None = None

    @classmethod
    def of(cls, spec: DynamicVocabulary, rows: int) -> BonusLearner | None:
        """The learner of a vocabulary of ``rows`` id rows by the rules of
        ``spec``, or ``None`` unless it forgets by ``"adaptive"``."""
        if spec.forget != "adaptive":
            return None
        return cls(
            rows,
            ways=int(spec.ways),
            admit_after=int(spec.admit_after),
            sketch_width=int(spec.sketch_width),
            seed=int(spec.seed),
        )

    @property
    def bonus(self) -> int:
        """The bonus in use, in plans per doubling of an id's lookups."""
        return self.BONUSES[self.choice]

    def sampled(self, ids: np.ndarray) -> np.ndarray:
        """``bool``: whether each raw id is in the sample."""
        ids = np.asarray(ids, np.int64)
        if self.bits == 0:
            return np.ones(ids.shape, bool)
        low, high = id_words(ids)
        return (id_hash(low, high, self.salt) >> np.uint32(32 - self.bits)) == 0

    def offer(
        self, ids: np.ndarray, counts: np.ndarray, step: int, *, sampled: bool = False
    ) -> None:
        """A training batch's distinct ``ids`` (its sampled ones if
        ``sampled``) and their lookups, planned as plan ``step``: learned
        from at the next ``settle`` unless dropped first."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        counts = np.asarray(counts, np.int64).reshape(-1)
        if not sampled:
            keep = self.sampled(ids)
            ids, counts = ids[keep], counts[keep]
        order = np.argsort(ids, kind="stable")
        self._pending = (ids[order], counts[order], int(step))

    def drop(self) -> None:
        """Forgets the sample offered last (its plan was taken back)."""
        self._pending = None

    def settle(self) -> None:
        """Learns from the sample offered last, if any."""
        if self._pending is not None:
            ids, counts, step = self._pending
            self._pending = None
            self.learn(ids, counts, step)

    def learn(self, ids: np.ndarray, counts: np.ndarray, step: int) -> None:
        """Plans one batch's sampled distinct ids (sorted) through the shadows
        and updates the scores and the choice."""
        found = np.zeros(len(self.shadows), np.int64)
        for j, shadow in enumerate(self.shadows):
            found[j] = counts[shadow.lookup(ids) >= 0].sum()
            try:
                shadow.admit(ids, counts, step=step, distinct=True)
            except CapacityError:
                pass  # a bucket the sample overfills: the shadow takes none of the batch
        self.scores -= self.scores >> self.DECAY
        self.scores += found
        best = int(np.argmax(self.scores))
        held = self.scores[self.choice]
        if self.scores[best] > held + (held >> self.MARGIN):
            self.choice = best

    # -------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, np.ndarray]:
        """The learner as flat arrays (a pending sample learned first)."""
        self.settle()
        state = {"scores": self.scores.copy(), "choice": np.array([self.choice], np.int64)}
        for j, shadow in enumerate(self.shadows):
            state.update({f"{j}.{k}": v for k, v in shadow.state_dict().items()})
        return state

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Raises ``ValueError`` unless ``load_state_dict`` takes ``state``."""
        scores = np.shape(state["scores"]) if "scores" in state else None
        if scores != self.scores.shape:
            raise ValueError(
                f"the saved bonus learner has scores of shape {scores}, this one "
                f"{self.scores.shape}: it was saved by another jaxcache."
            )
        for j, shadow in enumerate(self.shadows):
            missing = [k for k in shadow.state_dict() if f"{j}.{k}" not in state]
            if missing:
                raise ValueError(f"the saved bonus learner has no {j}.{missing[0]}.")
            rows = np.asarray(state[f"{j}.rows"])
            sketch = np.shape(state[f"{j}.sketch"])
            if (rows.size and (rows.min() < 0 or rows.max() >= shadow.rows)) or (
                sketch != shadow.sketch.shape
            ):
                raise ValueError(
                    f"the saved bonus learner's shadow {j} does not fit this one of "
                    f"{shadow.rows} rows: restore it into a cache with the saved "
                    "num_embeddings, ways, admit_after and sketch_width."
                )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Takes a ``state_dict`` of a learner of the same budget and rules
        (``check_state_dict``)."""
        self.check_state_dict(state)
        for j, shadow in enumerate(self.shadows):
            shadow.load_state_dict({k: state[f"{j}.{k}"] for k in shadow.state_dict()})
        self.scores[:] = state["scores"]
        self.choice = int(np.asarray(state["choice"]).reshape(-1)[0])
        self._pending = None
