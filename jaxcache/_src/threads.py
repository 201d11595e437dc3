"""The host threads that plan, gather and write back a step's partitions in parallel.

A step's host work splits into independent pieces, one per source slice of
the batch or per device partition of the cache. Each piece is a compiled
kernel or NumPy call that releases the GIL, so a few threads run
them truly in parallel. Every piece writes only its own outputs and every
reduction over pieces runs afterwards in a fixed order, so results never
depend on the number of threads or on their timing.

A step runs half a dozen such maps of a few hundred microseconds each, so
how a map starts matters: the calling thread works on the pieces itself,
and the other threads are woken once per map (not once per piece) and take
pieces from a shared counter until none is left. Handing every piece to a
``concurrent.futures`` pool instead (a wake-up and a future per piece, the
caller idle) lost a quarter of the second thread's gain on the scaling
benchmark. Threads beyond the cores the process may use are not started:
they could only take turns on a core, and a piece whose thread lost its
turn holds up the whole map.

Helpers sleep between maps on a condition variable. Spinning without the
GIL instead, for the caller at a map's end and for the helpers between maps
(so that no thread sleeps while another holds the GIL), gained 3% of the
staging wall time of 8 partitions on 2 threads, and was dropped.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar

__all__ = ["HostThreads", "cores", "default_threads"]

T = TypeVar("T")
R = TypeVar("R")


def cores() -> int:
    """The cores this process may run on (its affinity, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_threads(platform: str, partitions: int) -> int:
    """Host threads for a process whose cache has ``partitions`` device partitions.

    The cores the device runtime does not need: on an accelerator it keeps
    one core busy dispatching, so the rest plan (at most one per partition);
    on JAX's CPU backend the "device" computes on the same cores, so the host
    takes half of them.

    Examples:
      >>> default_threads("gpu", 1)
      1
    """
    count = cores()
    spare = count // 2 if platform == "cpu" else count - 1
    return max(1, min(partitions, spare))


class HostThreads:
    """Runs the pieces of a step on ``count`` threads (inline for one).

    Args:
      count: threads; ``1`` runs every piece on the calling thread.

    Examples:
      >>> HostThreads(2).map(lambda x: x * x, [1, 2, 3])
      [1, 4, 9]
    """

    def __init__(self, count: int) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(
                f"threads={count!r} must be a positive integer (1 runs the host work of a "
                "step on the calling thread), or None for the default."
            )
        self.count = count
        # Read once: a system call at every map cost more than the rest of
        # its start (threads beyond the cores, should the affinity shrink
        # later, only take turns).
        self._cores = cores()

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """``[fn(item) for item in items]``, the calls spread over the threads.

        Every call runs to its end; if some raise, the error of the first such
        item (in order) is raised afterwards.
        """
        results = self.gather(fn, list(items))
        for result in results:
            if isinstance(result, _Raised):
                raise result.error
        return results

    def gather(self, fn: Callable[[T], R], items: Sequence[T]) -> list[Any]:
        """Like ``map``, but a call that raises leaves a ``_Raised`` (its
        ``error``) in its place instead of raising."""
        if self.count == 1 or len(items) < 2:  # no thread to wake, nothing to share
            return [_call(fn, item) for item in items]
        job = _Job(fn, items)
        helpers = min(self.count, self._cores, len(items)) - 1
        crew = _crew(helpers) if helpers > 0 else None
        if crew is not None and crew.busy.acquire(blocking=False):
            try:
                crew.start(job)
                job.work()
                job.wait()
            finally:
                crew.clear()
                crew.busy.release()
        else:  # one thread, or the crew works on another map: this thread alone
            job.work()
        return job.results


class _Job(Generic[T]):
    """One map: its pieces, taken in turn by whichever thread asks next.

    A map starts several times a step, so its bookkeeping is a lock and a
    latch (a lock the last piece releases), not a ``threading.Event``: an
    Event's condition variable cost more to make and to set than the rest of
    the start.
    """

    def __init__(self, fn: Callable[[T], Any], items: Sequence[T]) -> None:
        self.fn = fn
        self.items = items
        self.results: list[Any] = [None] * len(items)
        self._lock = threading.Lock()
        self._finished = threading.Lock()  # held until the last piece ends
        self._finished.acquire()
        self._next = 0
        self._left = len(items)

    def work(self) -> None:
        """Runs pieces until none is left to take."""
        while True:
            with self._lock:
                k = self._next
                if k >= len(self.items):
                    return
                self._next = k + 1
            self.results[k] = _call(self.fn, self.items[k])
            with self._lock:
                self._left -= 1
                if not self._left:
                    self._finished.release()

    def wait(self) -> None:
        """Returns once every piece has ended."""
        self._finished.acquire()
        self._finished.release()


class _Crew:
    """Threads that help the thread calling ``HostThreads.gather``, one map at a time."""

    def __init__(self, size: int) -> None:
        self.busy = threading.Lock()  # held by the thread whose map the crew works on
        self._wake = threading.Condition()
        self._job: _Job[Any] | None = None
        self._generation = 0
        for k in range(size):
            threading.Thread(target=self._serve, name=f"jaxcache-host-{k}", daemon=True).start()

    def start(self, job: _Job[Any]) -> None:
        """Wakes every thread of the crew to work on ``job``."""
        with self._wake:
            self._job = job
            self._generation += 1
            self._wake.notify_all()

    def clear(self) -> None:
        """Drops the finished job: the crew holds no pieces (nor the arrays
        they use) between maps."""
        with self._wake:
            self._job = None

    def _serve(self) -> None:
        seen = 0
        while True:
            with self._wake:
                while self._generation == seen:
                    self._wake.wait()
                seen, job = self._generation, self._job
            if job is not None:  # a helper woken late finds the map done or none
                job.work()


_CREWS: dict[int, _Crew] = {}
_CREWS_LOCK = threading.Lock()


def _crew(size: int) -> _Crew:
    """The shared crew of ``size`` threads (started on first use)."""
    with _CREWS_LOCK:
        crew = _CREWS.get(size)
        if crew is None:
            crew = _CREWS[size] = _Crew(size)
        return crew


def _call(fn: Callable[[T], R], item: T) -> R | _Raised:
    """``fn(item)``, or the error it raised (raised again by the calling thread)."""
    try:
        return fn(item)
    except BaseException as error:
        return _Raised(error)


class _Raised:
    """The error a piece raised (see ``HostThreads.gather``)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def raised(result: object) -> BaseException | None:
    """The error a ``HostThreads.gather`` result holds, or ``None``."""
    return result.error if isinstance(result, _Raised) else None
