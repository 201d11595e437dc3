"""A cache's raw ids: each batch translated to host rows before it is planned.

With ``CacheConfig(vocabulary=DynamicVocabulary(...))`` the ids of a batch
are raw int64 values. ``RawIds`` holds the ``Vocabulary`` (id -> row) and
does, for each batch, in the stager's lock and in plan order:

1. **Admit** the batch's distinct ids, in the order they first appear
   (``distinct_ids``: one hash pass, no sort), so that rows depend on the
   batch alone, never on the device count. Rows whose last plan is not
   finished by the vocabulary's bound (``finished``, set by the look-ahead,
   never by thread timing) are held. Ages count training batches only
   (``TrainingClock``: a plan's step). The padding id becomes row ``-1``,
   the planners' padding, and so do ids not admitted, unless the
   vocabulary has a shared row (``DynamicVocabulary(default="shared")``):
   then they become that row, which the planners plan like any other.
2. The planners plan the rows. If they refuse the batch, the admission is
   taken back (``Vocabulary.revert``): nothing changed.
3. **Renew** the rows given to new ids: their unlanded write-backs (of the
   ids that had them) are dropped, their first values and fresh optimizer
   state are written to the host table, and a row the plan found resident
   (its old id's values on the device) is fetched again like a miss, over
   its own slot.

A row's values therefore depend only on the ids that had it and the steps
that trained them, never on the device cache: training with raw ids
through a cache equals the same vocabulary over the whole table on device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxcache._src import validation
from jaxcache._src.config import CacheConfig
from jaxcache._src.host_table import HostTable
from jaxcache._src.partitions import Partitions, StepPlan
from jaxcache._src.planner import CapacityError
from jaxcache._src.training_clock import TrainingClock
from jaxcache._src.vocabulary import Admission, Vocabulary, distinct_ids, hashed_rows
from jaxcache._src.vocabulary_learner import BonusLearner
from jaxcache._src.write_back import WriteBacks

__all__ = ["RawIds", "Translated"]

# The planners' padding row (rows are never negative).
ROW_PAD = -1
_STATE_KEYS = ("ids", "rows", "last_use", "counts", "sketch", "clock")


class Translated(NamedTuple):
    """A batch's raw ids as rows (``RawIds.translate``).

    Attributes:
      rows: ``int64`` of the ids' shape: each id's row, ``-1`` for padding
        and for ids not admitted (the shared row, if the vocabulary has one).
      admission: what the vocabulary did (``Vocabulary.admit``).
      new_counts: ``int64 [A]``: lookups of each new id in the batch.
      refused_lookups: lookups of ids not admitted.
      plan_index: the plan's index.
    """

    rows: np.ndarray
    admission: Admission
    new_counts: np.ndarray
    refused_lookups: int
    plan_index: int


class RawIds:
    """The raw ids of one cache: vocabulary, rows in flight, new rows' values.

    Args:
      config: the table's configuration (``config.vocabulary`` set).
      shard: ``(process, processes)``: this process's share of the host
        rows (``process_shard``).
    """

    def __init__(self, config: CacheConfig, shard: tuple[int, int] = (0, 1)) -> None:
        spec = config.vocabulary
        assert spec is not None, "RawIds serves a dynamic vocabulary"
        self.spec = spec
        self.config = config
        self.shard = shard
        self.vocabulary = Vocabulary.of(spec, config.num_embeddings)
        self.shared_row = spec.shared_row(config.num_embeddings)
        # ``forget="adaptive"``: the bonus each plan forgets by, learned from
        # the training batches before it (either planner feeds it).
        self.learner = BonusLearner.of(spec, self.vocabulary.rows)
        if self.learner is not None:
            self.vocabulary.bonus = self.learner.bonus
        # Plans to the training steps the vocabulary ages ids by (either planner's).
        self.clock = TrainingClock()

    def bonus(self) -> int:
        """The bonus the next plan forgets by (``"lrfu"``'s, or the learned
        one of ``"adaptive"``, with what earlier plans taught it)."""
        if self.learner is None:
            return int(self.spec.bonus)
        self.learner.settle()
        return self.learner.bonus

    # ----------------------------------------------------------------- steps
    def plan(
        self,
        partitions: Partitions,
        ids: np.ndarray,
        table: HostTable,
        ledger: WriteBacks,
        *,
        train: bool,
        released: int | None,
        max_distinct: int | None,
    ) -> tuple[StepPlan, np.ndarray, dict[str, int]]:
        """Plans a batch of raw ids (steps 1-4 of the module; arguments as
        for ``Partitions.plan``): its ``StepPlan``, its rows, and its
        vocabulary's statistics (``StepStats`` fields). All or nothing."""
        finished = partitions.released
        if released is not None:
            finished = min(finished, int(released))
        try:
            translated = self.translate(
                ids, index=partitions.next_index, finished=finished, train=train
            )
        except Exception:
            partitions.refuse_unchecked()
            raise
        # A row given to a new id counts that id's lookups only.
        new_rows = translated.admission.new_rows
        counts = partitions.swap_counts(new_rows, np.zeros(new_rows.size, np.int64))
        try:
            step = partitions.plan(
                translated.rows,
                train=train,
                released=released,
                max_distinct=max_distinct,
                refetch=new_rows,  # ``renew`` fetches them where resident
            )
        except BaseException:
            partitions.swap_counts(new_rows, counts)
            self.revert(translated)
            raise
        step = self.renew(step, translated, partitions, table, ledger)
        return step, translated.rows, self.record(translated)

    def translate(
        self, ids: np.ndarray, *, index: int, finished: int, train: bool = True
    ) -> Translated:
        """Admits the distinct ids of batch ``index`` and maps every id to its row.

        A batch that does not train (``train=False``: evaluation, serving)
        admits no id: unknown ids read the padding row, or the shared row.

        Raises:
          CapacityError: a bucket has more new ids than rows that can take
            one (nothing changed); ``fits_after`` is the plan whose release
            would make room (``Vocabulary.admit``).
        """
        array = validation.check_raw_ids(ids, "ids")
        unique, inverse, counts = distinct_ids(array, self.config.padding_id)
        self.vocabulary.bonus = self.bonus()
        step = self.clock.plan(index, train)
        try:
            admission = self.vocabulary.admit(
                unique,
                counts,
                step=step,
                finished=self.clock.finished(finished),
                new=train,
                distinct=True,
            )
        except CapacityError as error:
            self.clock.rollback(index)
            error.fits_after = self.clock.plan_of(error.fits_after)
            raise
        if self.learner is not None and train:
            self.learner.offer(unique, counts, step)
        given = admission.rows
        if self.shared_row is not None:
            given = np.where(given < 0, self.shared_row, given)
        # Padding's inverse is -1: the last entry, the planners' padding row.
        rows = np.append(given, ROW_PAD)[inverse]
        refused = int(counts[admission.rows < 0].sum())
        assert admission.new_at is not None
        return Translated(rows, admission, counts[admission.new_at], refused, int(index))

    def revert(self, translated: Translated) -> None:
        """Takes back ``translate`` (the planners refused the batch)."""
        self.vocabulary.revert(translated.admission)
        self.clock.rollback(translated.plan_index)
        if self.learner is not None:
            self.learner.drop()

    def renew(
        self,
        step: StepPlan,
        translated: Translated,
        partitions: Partitions,
        table: HostTable,
        ledger: WriteBacks,
    ) -> StepPlan:
        """Gives the batch's new rows their first values (host table) and
        fetches those the plan found resident again; returns the plan with
        them among its fetches."""
        admission = translated.admission
        rows = admission.new_rows
        if rows.size == 0:
            return step
        # Every process keeps the whole vocabulary (the same batches make the
        # same choices everywhere) and writes the rows it stores.
        layout = partitions.layout
        mine = rows % layout.processes == layout.process
        self.first_values(rows[mine], admission.new_ids[mine], table, ledger)
        return _refetch_resident(step, partitions, rows, translated.new_counts)

    def first_values(
        self, rows: np.ndarray, ids: np.ndarray, table: HostTable, ledger: WriteBacks
    ) -> None:
        """Writes the first values of ``rows`` (of this process), given to
        raw ``ids`` now, and fresh optimizer state into the host table; an
        unlanded write-back of their old ids is dropped first, so that it
        never lands over them."""
        ledger.cancel(rows)
        cfg, spec = self.config, self.spec
        first = hashed_rows(
            ids, cfg.features, seed=int(spec.seed), init=spec.init, scale=spec.scale
        )
        table.scatter(rows, first, self._fresh_state(first.shape[0]))

    def start_shared_row(self, table: HostTable) -> None:
        """Writes the shared row's first values (zeros) and fresh optimizer
        state into the host table, if the vocabulary has one and this
        process stores it: the start of a new vocabulary, whose rows belong
        to no id yet."""
        row = self.shared_row
        if row is None or row % self.shard[1] != self.shard[0]:
            return
        cfg = self.config
        zeros = np.zeros((1, cfg.features), cfg.row_dtype)
        table.scatter(np.array([row]), zeros, self._fresh_state(1))

    def _fresh_state(self, count: int) -> dict[str, np.ndarray]:
        """Fresh optimizer state for ``count`` rows."""
        cfg = self.config
        return {
            name: np.full((count, *s.shape), s.init, s.dtype)
            for name, s in cfg.optimizer.state_spec(cfg.features).items()
        }

    def record(self, translated: Translated) -> dict[str, int]:
        """The statistics of a translated batch (``StepStats`` fields)."""
        admission = translated.admission
        return {
            "new_ids": int(admission.new_ids.size),
            "forgotten_ids": int(admission.forgotten_ids.size),
            "refused_lookups": translated.refused_lookups,
        }

    # ------------------------------------------------------------ checkpoint
    def state_arrays(self, vocabulary: Vocabulary | None = None) -> dict[str, np.ndarray]:
        """A vocabulary (default: this one) as flat arrays
        (``Vocabulary.state_dict``), this process's share: the entries of
        the rows it stores and the sketch counters of the same residues
        (the rest zero), so that the shares of all processes join into the
        whole. Each entry's last use holds its row while a plan in flight
        uses it, so a pipeline resumed after a checkpoint forgets as one
        that ran on."""
        state = (self.vocabulary if vocabulary is None else vocabulary).state_dict()
        process, processes = self.shard
        if processes > 1:
            mine = state["rows"] % processes == process
            for key in ("ids", "rows", "last_use", "counts"):
                state[key] = state[key][mine]
            cells = np.arange(state["sketch"].shape[1]) % processes == process
            state["sketch"] = np.where(cells[None, :], state["sketch"], 0)
        state["steps"] = self.clock.state_array()  # the same in every process
        if self.learner is not None:
            state.update({f"learner.{k}": v for k, v in self.learner.state_dict().items()})
        return {f"vocabulary.{k}": v for k, v in state.items()}

    def check_state_arrays(self, parts: Sequence[Mapping[str, Any]]) -> None:
        """Raises ``ValueError`` unless ``load_state_arrays`` takes ``parts``
        (every saving process's ``state_arrays``)."""
        arrays = parts[0] if parts else {}
        missing = [k for k in _STATE_KEYS if f"vocabulary.{k}" not in arrays]
        if missing:
            raise ValueError(
                f"the saved state has no vocabulary.{missing[0]}: it was saved by a cache "
                "without a dynamic vocabulary (restore it into one built with vocabulary=None), "
                "or by an older jaxcache whose vocabulary this one cannot read."
            )
        rows = np.concatenate([np.asarray(part["vocabulary.rows"]) for part in parts])
        if rows.size and (rows.min() < 0 or rows.max() >= self.config.num_embeddings):
            raise ValueError(
                f"the saved vocabulary has rows past this budget of {self.config.num_embeddings}; "
                "restore it into a cache with the saved num_embeddings."
            )
        _check_saved_ids(
            np.concatenate([np.asarray(part["vocabulary.ids"]) for part in parts]),
            rows,
            self.config.padding_id,
            self.shared_row,
        )
        _saved_clock(arrays)
        saved = _learner_state(arrays)
        if self.learner is not None and saved:
            self.learner.check_state_dict(saved)
        sketch = np.shape(arrays["vocabulary.sketch"])
        if sketch != self.vocabulary.sketch.shape:
            raise ValueError(
                f"the saved admission sketch is {sketch}, this cache's "
                f"{self.vocabulary.sketch.shape}; build it with the saved admit_after, ways "
                "and sketch_width."
            )

    def load_state_arrays(self, parts: Sequence[Mapping[str, Any]]) -> Vocabulary:
        """Restores the ``state_arrays`` of every saving process (checked by
        ``check_state_arrays``), joined, into this vocabulary; returns it."""
        joined: dict[str, Any] = {
            k: np.concatenate([np.asarray(part[f"vocabulary.{k}"]) for part in parts])
            for k in ("ids", "rows", "last_use", "counts")
        }
        joined["sketch"] = sum(np.asarray(part["vocabulary.sketch"]) for part in parts)
        joined["clock"] = np.max([np.asarray(part["vocabulary.clock"]) for part in parts], axis=0)
        self.vocabulary.load_state_dict(joined)
        self.clock.load(_saved_clock(parts[0]))
        if self.learner is not None:
            saved = _learner_state(parts[0])
            if saved:
                self.learner.load_state_dict(saved)
            # A state saved under another rule: the learner starts afresh.
            self.vocabulary.bonus = self.learner.bonus
        return self.vocabulary


def _check_saved_ids(
    ids: np.ndarray, rows: np.ndarray, pad: int | None, shared: int | None
) -> None:
    """Raises ``ValueError`` unless saved ids and their rows pair one to
    one, apart from the padding id and the shared row: a vocabulary never
    saves others, and a restore of them would give two ids one row."""
    problem = None
    if ids.shape != rows.shape:
        problem = f"{ids.size} ids with {rows.size} rows"
    elif np.unique(ids).size != ids.size:
        problem = "an id twice"
    elif np.unique(rows).size != rows.size:
        problem = "a row given to two ids"
    elif pad is not None and np.any(ids == pad):
        problem = f"the padding id {pad} as an id"
    elif shared is not None and np.any(rows == shared):
        problem = f"the shared default row {shared} as an id's row"
    if problem is not None:
        raise ValueError(
            f"the saved vocabulary lists {problem}: its files are damaged; restore an earlier step."
        )


def _saved_clock(arrays: Mapping[str, Any]) -> TrainingClock:
    """The training clock of saved ``state_arrays``. A vocabulary saved
    before plans were told from steps aged ids by every plan: its clock
    starts at its next plan, each plan a step."""
    if "vocabulary.steps" in arrays:
        return TrainingClock.from_array(arrays["vocabulary.steps"])
    latest = int(np.asarray(arrays["vocabulary.clock"]).reshape(-1)[0])
    return TrainingClock(latest + 1, latest + 1)


def _learner_state(arrays: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The bonus learner's part of saved ``state_arrays`` (empty if none)."""
    prefix = "vocabulary.learner."
    return {k[len(prefix) :]: np.asarray(v) for k, v in arrays.items() if k.startswith(prefix)}


def _refetch_resident(
    step: StepPlan, partitions: Partitions, rows: np.ndarray, counts: np.ndarray
) -> StepPlan:
    """``step`` with the resident ones of ``rows`` (new rows, counted
    ``counts`` times in the batch) fetched again into their own slots: the
    device holds their old ids' values. A hit turns into a fetch."""
    layout = partitions.layout
    part_of, local = layout.part_of(rows), layout.part_local_ids(rows)
    plans = list(step.plans)
    for i, (part, planner) in enumerate(zip(partitions.parts, partitions.planners, strict=True)):
        mine = part_of == part
        if not mine.any():
            continue
        plan = plans[i]
        hit = ~np.isin(local[mine], plan.fetch_ids)
        if not hit.any():
            continue
        again = local[mine][hit]
        plans[i] = plan._replace(
            fetch_ids=np.concatenate([plan.fetch_ids, again]),
            fetch_slots=np.concatenate([plan.fetch_slots, planner.slot_of_id[again]]).astype(
                np.int32
            ),
            hits=plan.hits - int(hit.sum()),
            access_hits=plan.access_hits - int(counts[mine][hit].sum()),
        )
    return step._replace(plans=tuple(plans))
