"""Replay of a raw-id trace through a dynamic vocabulary: sizing a row budget.

The rows a ``CacheConfig(vocabulary=DynamicVocabulary(...))`` table would give
and take back over a trace of raw ids, with no model: each batch is admitted
as a training step (``Vocabulary.admit``, with nothing in flight), and,
with a ``capacity``, the rows are planned by the real ``Planner`` as the
cache would plan them (a new row found resident is fetched again, as
``raw_ids`` does). ``jaxcache vocabulary`` on the command
line runs it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxcache._src import validation
from jaxcache._src.config import CacheConfig, DynamicVocabulary
from jaxcache._src.planner import CapacityError, Planner
from jaxcache._src.replay import _ratio, _split
from jaxcache._src.vocabulary import Vocabulary, distinct_ids, rows_to_hold
from jaxcache._src.vocabulary_learner import BonusLearner

__all__ = ["replay_vocabulary"]


def replay_vocabulary(
    trace: np.ndarray,
    *,
    rows: int,
    batch: int | None = None,
    vocabulary: DynamicVocabulary | None = None,
    capacity: int | float | None = None,
    policy: str = "adaptive",
    padding_id: int | None = None,
) -> dict[str, Any]:
    """Admits every batch of a raw-id ``trace`` into a budget of ``rows`` rows.

    Args:
      trace: int64 raw ids, ``[T]`` (split into batches of ``batch``) or
        ``[S, B]`` (one batch per row).
      rows: the row budget (``num_embeddings``).
      batch: ids per batch; required for a 1-D trace.
      vocabulary: the admission and forgetting rules (default:
        ``DynamicVocabulary()``: admit on first sight, forget LRU).
      capacity: also plan the rows through a device cache of this many rows
        (or fraction of ``rows``) with ``policy``, and count its hits.
      padding_id: a raw id to skip.

    Returns:
      A flat, JSON-ready dict: ``rows``, ``batches``, ``lookups``,
      ``distinct_ids`` (in the whole trace), ``found_lookups`` (of ids
      that had a row before their batch), ``new_ids`` (rows given),
      ``readmitted_ids`` (of those, ids that had a row before and were
      forgotten), ``forgotten_ids`` (ids whose rows new ids took),
      ``refused_lookups`` (ids not admitted yet), ``live_ids`` at the end,
      ``expired_ids`` (forgotten by ``ttl``, their rows not taken by the
      end: ``new_ids = forgotten_ids + live_ids + expired_ids``),
      ``rows_to_forget_nothing`` (the least
      budget whose buckets hold every id ever admitted, ``rows_to_hold``,
      and the shared row if there is one: one this large never forgets an
      id for want of room, though ``ttl`` still forgets; ``None`` if none
      would), with
      ``forget="adaptive"`` the ``bonus`` learned by the end, and with
      ``capacity``: ``capacity``, ``unique_hit_rate``, ``rows_fetched``.

    Raises:
      TypeError, ValueError: a bad argument.
      CapacityError: a batch has more new ids than the budget can take.

    Examples:
      >>> import numpy as np
      >>> trace = np.array([[5, -9], [7, 5], [8, -9], [5, 7]])
      >>> spec = DynamicVocabulary(protect=0)  # unpipelined steps: no batch held
      >>> out = replay_vocabulary(trace, rows=2, vocabulary=spec)
      >>> out["new_ids"], out["forgotten_ids"], out["readmitted_ids"], out["rows_to_forget_nothing"]
      (7, 5, 3, 4)
    """
    spec = DynamicVocabulary() if vocabulary is None else vocabulary
    validation.check_padding_id(padding_id)
    array = np.asarray(trace)
    if not validation.is_integer_dtype(array.dtype):
        raise TypeError(f"trace must hold integer raw ids, got dtype {array.dtype}.")
    if array.ndim not in (1, 2) or array.size == 0:
        raise ValueError(
            f"trace must be a non-empty 1-D or 2-D [steps, ids] array, got shape {array.shape}."
        )
    batches = _split(validation.check_raw_ids(array, "trace"), batch)
    vocab = Vocabulary.of(spec, int(rows))
    learner = BonusLearner.of(spec, vocab.rows)
    shared = spec.shared_row(int(rows))
    planner = None
    if capacity is not None:
        config = CacheConfig(rows, 1, capacity, policy=policy, padding_id=-1)
        planner = Planner(config)
    had_row: set[int] = set()
    counts = dict.fromkeys(
        (
            "lookups",
            "found_lookups",
            "new_ids",
            "readmitted_ids",
            "forgotten_ids",
            "refused_lookups",
        ),
        0,
    )
    distinct = hits = fetched = 0
    seen: list[np.ndarray] = []
    for step, ids in enumerate(batches):
        unique, inverse, lookups = distinct_ids(ids, padding_id)
        seen.append(unique)
        if learner is not None:
            learner.settle()
            vocab.bonus = learner.bonus
        try:
            done = vocab.admit(unique, lookups, step=step, distinct=True)
        except CapacityError as error:
            raise _in_batch(step, error) from None
        if learner is not None:
            learner.offer(unique, lookups, step)
        new = done.new_ids.tolist()
        counts["readmitted_ids"] += sum(i in had_row for i in new)
        had_row.update(new)
        counts["lookups"] += int(lookups.sum())
        found = done.rows >= 0
        found[done.new_at] = False
        counts["found_lookups"] += int(lookups[found].sum())
        counts["new_ids"] += len(new)
        counts["forgotten_ids"] += done.forgotten_ids.size
        counts["refused_lookups"] += int(lookups[done.rows < 0].sum())
        if planner is not None:
            counted = getattr(planner.policy, "counts", None)
            if counted is not None:  # a row given to a new id counts its lookups only,
                counted[done.new_rows] = 0  # as in training (``RawIds.plan``)
            resident = done.new_rows[planner.slot_of_id[done.new_rows] >= 0]
            given = done.rows
            if shared is not None:  # ids without a row read the shared row
                given = np.where(given < 0, shared, given)
            try:
                plan = planner.plan(np.append(given, -1)[inverse], train=True)
            except CapacityError as error:
                raise _in_batch(step, error) from None
            planner.release(plan.index)
            distinct += plan.distinct
            hits += plan.hits - resident.size  # refetched: the device holds the old id's row
            fetched += plan.misses + resident.size
    out: dict[str, Any] = {
        "rows": int(rows),
        "batches": len(batches),
        **counts,
        "distinct_ids": int(np.unique(np.concatenate(seen)).size),
        "live_ids": vocab.size,
        # Every id given a row ended as forgotten (a new id took its row),
        # live, or expired by ``ttl`` with its row not taken yet.
        "expired_ids": counts["new_ids"] - counts["forgotten_ids"] - vocab.size,
        "rows_to_forget_nothing": _budget_to_hold(spec, had_row),
    }
    if learner is not None:
        learner.settle()
        out["bonus"] = learner.bonus
    if planner is not None:
        out.update(
            capacity=planner.capacity,
            unique_hit_rate=_ratio(hits, distinct),
            rows_fetched=fetched,
        )
    return out


def _budget_to_hold(spec: DynamicVocabulary, ids: set[int]) -> int | None:
    """The least budget whose rows for ids hold all of ``ids`` at once: the
    rows ``rows_to_hold`` finds, and the shared row past them if any
    (``DynamicVocabulary.id_rows``)."""
    array = np.fromiter(ids, np.int64, len(ids))
    hold = rows_to_hold(array, ways=int(spec.ways), seed=int(spec.seed))
    return None if hold is None else hold + (spec.default == "shared")


def _in_batch(step: int, error: CapacityError) -> CapacityError:
    """``error`` naming the batch of the trace it came from."""
    refused = CapacityError(f"batch {step}: {error}")
    refused.__dict__.update(vars(error))  # what was needed, and what was free
    return refused
