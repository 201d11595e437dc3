"""The host threads that plan, gather and write back a step's partitions in parallel.

A step's host work splits into independent pieces, one per source slice of
the batch or per device partition of the cache. Each piece is a compiled
kernel or NumPy call that releases the GIL, so a small pool of threads runs
them truly in parallel. Every piece writes only its own outputs and every
reduction over pieces runs afterwards in a fixed order, so results never
depend on the number of threads or on their timing.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

__all__ = ["HostThreads", "default_threads"]

T = TypeVar("T")
R = TypeVar("R")

_POOLS: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _cores() -> int:
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
    cores = _cores()
    spare = cores // 2 if platform == "cpu" else cores - 1
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

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with _POOLS_LOCK:
            pool = _POOLS.get(self.count)
            if pool is None:
                pool = concurrent.futures.ThreadPoolExecutor(
                    self.count, thread_name_prefix="jaxcache-host"
                )
                _POOLS[self.count] = pool
            return pool

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """``[fn(item) for item in items]``, the calls spread over the threads.

        Every call runs to its end; if some raise, the error of the first such
        item (in order) is raised afterwards.
        """
        items = list(items)
        if self.count == 1 or len(items) < 2:
            return [fn(item) for item in items]
        results = self.gather(fn, items)
        for result in results:
            if isinstance(result, _Raised):
                raise result.error
        return results

    def gather(self, fn: Callable[[T], R], items: Sequence[T]) -> list[Any]:
        """Like ``map``, but a call that raises leaves a ``_Raised`` (its
        ``error``) in its place instead of raising."""

        def call(item: T) -> Any:
            try:
                return fn(item)
            except Exception as error:
                return _Raised(error)

        if self.count == 1 or len(items) < 2:
            return [call(item) for item in items]
        return list(self._pool().map(call, items))


class _Raised:
    """The error a piece raised (see ``HostThreads.gather``)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def raised(result: object) -> Exception | None:
    """The error a ``HostThreads.gather`` result holds, or ``None``."""
    return result.error if isinstance(result, _Raised) else None
