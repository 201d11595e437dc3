"""The training steps of a stream of plans: the clock a vocabulary ages ids by.

A dynamic vocabulary forgets ids by age (``ttl``, the ages of ``"lrfu"``)
and holds the rows of the latest batches (``protect``), in training steps.
A batch that trains nothing (evaluation, serving) admits no id and leaves
every id's last use as it was, so it must not age the ids either: counted
as a step, an evaluation longer than ``ttl`` batches would expire every
id, and a server would read default rows after ``ttl`` batches.

Plans, though, are numbered by every batch planned: the planners hold the
rows of evaluation batches in flight as they hold those of training ones.
So the vocabulary's owner maps each plan's index to its **step**: a
training plan's is the training plans before it, and a plan that trains
nothing reads at the step of the latest training plan, as that step left
the vocabulary (``export_ids`` lists exactly the ids it finds). A bound
on finished plans maps to the step of the last training plan within it,
and a held step back to the plan that holds it, for ``fits_after``.

Only the latest ``WINDOW`` plans are kept: bounds reach back no further
than the look-ahead and ``protect``. Past it, ``finished`` counts each
plan as a training one, which holds no id that a later plan may take.
"""

from __future__ import annotations

import bisect

import numpy as np

__all__ = ["TrainingClock"]

WINDOW = 4096  # plans remembered (far more than any look-ahead or protect)


class TrainingClock:
    """Steps of plans: the training plans before each (see the module).

    Args:
      next_index: the index of the next plan.
      steps: the training plans before it.

    Examples:
      >>> clock = TrainingClock()
      >>> [clock.plan(i, train) for i, train in enumerate([True, False, False, True])]
      [0, 0, 0, 1]
      >>> clock.steps, clock.finished(2), clock.plan_of(1)
      (2, 0, 3)
    """

    def __init__(self, next_index: int = 0, steps: int = 0) -> None:
        self._start = int(next_index)  # the plan of ``_before[0]``
        self._before = [int(steps)]  # training plans before plan _start + i

    @property
    def next_index(self) -> int:
        """The index of the next plan."""
        return self._start + len(self._before) - 1

    @property
    def steps(self) -> int:
        """Training plans made so far: the next plan's step."""
        return self._before[-1]

    def plan(self, index: int, train: bool) -> int:
        """Plan ``index``'s step (``-1``: a plan that trains nothing, before
        any training one); plans from ``index`` on made before are taken
        back (a plan made again after a refusal or a rollback)."""
        index = int(index)
        if index < self._start:
            raise ValueError(f"plan {index} is before the clock's first, {self._start}")
        while self.next_index < index:  # plans never seen count as training ones
            self._before.append(self._before[-1] + 1)
        del self._before[index - self._start + 1 :]
        step = self._before[-1]
        self._before.append(step + bool(train))
        if len(self._before) > WINDOW:
            self._start += 1
            del self._before[0]
        return step if train else step - 1

    def rollback(self, index: int) -> None:
        """Takes back plan ``index`` and every later one."""
        keep = int(index) - self._start + 1
        if 1 <= keep < len(self._before):
            del self._before[keep:]

    def finished(self, index: int) -> int:
        """The step of the last training plan up to plan ``index`` (``-1``:
        none): an id whose last use is later is held by a later plan."""
        i = int(index) + 1 - self._start
        if i >= len(self._before):
            return self._before[-1] - 1
        if i < 0:  # past the window: as if each plan trained (the lower bound)
            return max(self._before[0] + i, 0) - 1
        return self._before[i] - 1

    def plan_of(self, step: int | None) -> int | None:
        """The index of the training plan of ``step``, if remembered (``None``
        passes through: a ``fits_after`` that no release meets)."""
        if step is None:
            return None
        i = bisect.bisect_left(self._before, int(step) + 1)
        if 0 < i < len(self._before) and self._before[i - 1] == step:
            return self._start + i - 1
        return None

    def load(self, other: TrainingClock) -> None:
        """Takes ``other``'s plans and steps (a restore: the planners keep
        this clock)."""
        self._start, self._before = other._start, list(other._before)

    def state_array(self) -> np.ndarray:
        """``int64 [2 + P]``: the first plan remembered, then the steps
        before it and before each plan after it, up to the next one."""
        return np.array([self._start, *self._before], np.int64)

    @classmethod
    def from_array(cls, array: np.ndarray) -> TrainingClock:
        """A clock from ``state_array``; ``ValueError`` if it is not one."""
        values = np.asarray(array).reshape(-1)
        steps = values[1:]
        if (
            values.dtype.kind not in "iu"
            or steps.size == 0
            or values[0] < 0
            or steps[0] < 0
            or not np.isin(np.diff(steps), (0, 1)).all()
        ):
            raise ValueError(
                "the saved training clock is not one (each plan adds a step or none); the "
                "checkpoint is damaged."
            )
        clock = cls(int(values[0]), int(steps[0]))
        clock._before = [int(s) for s in steps]
        return clock
