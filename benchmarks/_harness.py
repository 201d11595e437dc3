"""What every benchmark shares: the machine, timing, CPU time by thread, cores,
the cache's construction, results.

Benchmarks are scripts run from the repository root (``python
benchmarks/NAME.py``), so this directory is ``sys.path[0]`` and ``import
_harness`` finds this module. They print tables for people and, last, their
figures as ``name=value`` lines (``print_results``) for programs comparing
runs.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import jax
import numpy as np

import jaxcache
from jaxcache._src.threads import cores

Key = TypeVar("Key")
Result = TypeVar("Result")


def raw_ids(ids: np.ndarray) -> np.ndarray:
    """Integer ids made raw int64 values, spread over all of int64 by a
    bijection (multiplication by an odd constant, wrapping)."""
    return (np.asarray(ids).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)


def machine() -> str:
    """``jax VERSION on DEVICE KIND, N cores``: the first words of a benchmark's output."""
    return f"jax {jax.__version__} on {jax.devices()[0].device_kind}, {cores()} cores"


def median_time(
    fn: Callable[[], object],
    repeats: int,
    *,
    warmup: int = 0,
    before: Callable[[], object] | None = None,
) -> float:
    """Median seconds of ``fn()`` over ``repeats`` timed calls.

    Args:
      fn: what is timed.
      repeats: timed calls.
      warmup: untimed calls first (the first one compiles).
      before: called, untimed, before each timed call (e.g. to flush caches).
    """
    for _ in range(warmup):
        fn()
    seconds = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds))


def interleave(runs: Mapping[Key, Callable[[], Result]], rounds: int) -> dict[Key, list[Result]]:
    """Each run once per round, in turn, ``rounds`` times: a change of load on
    the machine falls on all of them alike. Returns each run's results, one per
    round."""
    results: dict[Key, list[Result]] = {key: [] for key in runs}
    for _ in range(rounds):
        for key, run in runs.items():
            results[key].append(run())
    return results


def ms_range(seconds: Iterable[float], digits: int = 2) -> str:
    """``min-max`` of ``seconds``, in milliseconds."""
    values = list(seconds)
    return f"{1e3 * min(values):.{digits}f}-{1e3 * max(values):.{digits}f}"


def print_results(results: Mapping[str, float], digits: int = 3) -> None:
    """One ``name=value`` line per result; whole numbers as they are."""
    for name, value in results.items():
        print(f"{name}={value}" if isinstance(value, int) else f"{name}={value:.{digits}f}")


# ------------------------------------------------------------------- caches
PLANNERS = ("host", "device", "both")
"""The values of a ``--planner`` flag: one planner of the cache, or each in turn."""


def planners(choice: str | None) -> tuple[str | None, ...]:
    """The planners a benchmark builds its caches with, from ``--planner``.

    Args:
      choice: ``"host"``, ``"device"``, ``"both"``, or ``None`` (the flag
        left out): both where ``jaxcache.EmbeddingCache`` takes a
        ``planner=`` argument, else the cache's only one.

    Returns:
      The planners in order; ``(None,)`` means ``planner=`` is not passed.

    Raises:
      ValueError: a planner is named but the constructor takes none.
    """
    accepted = "planner" in inspect.signature(jaxcache.EmbeddingCache).parameters
    if not accepted:
        if choice is not None:
            raise ValueError(
                f"--planner={choice}: this jaxcache's EmbeddingCache takes no planner= "
                "argument; leave --planner out to run the cache's only planner."
            )
        return (None,)
    return ("host", "device") if choice in (None, "both") else (choice,)


def embedding_cache(
    config: jaxcache.CacheConfig, planner: str | None = None, **kwargs: Any
) -> jaxcache.EmbeddingCache:
    """``jaxcache.EmbeddingCache(config, **kwargs)``, with ``planner=`` unless it is ``None``.

    Every cache the throughput benchmarks time is built here, so that a
    figure can be taken once per planner (``planners``).
    """
    if planner is not None:
        kwargs["planner"] = planner
    return jaxcache.EmbeddingCache(config, **kwargs)


def with_planner(name: str, planner: str | None) -> str:
    """``name`` of a figure taken with ``planner``: ``name_PLANNER``, or ``name`` for ``None``."""
    return name if planner is None else f"{name}_{planner}"


# ------------------------------------------------------------------ threads
class ThreadCPU:
    """CPU time of a loop split by thread: the training thread (``loop``),
    the JAX runtime's threads (``runtime``: those alive from start to end,
    XLA's among them) and the rest (``prefetch``: the pipeline's producer,
    which ends with its source).

    Linux only (each thread's CPU clock, found through ``/proc``); elsewhere
    ``per_step`` is empty.
    """

    def __init__(self) -> None:
        self.main = threading.get_native_id()
        self.process, self.threads = time.process_time(), _thread_seconds()

    def per_step(self, steps: int) -> dict[str, float]:
        threads = _thread_seconds()
        if not threads:
            return {}
        ran = {t: threads[t] - self.threads[t] for t in threads.keys() & self.threads.keys()}
        total = time.process_time() - self.process
        loop = ran.pop(self.main)
        runtime = sum(ran.values())
        return {
            "loop": loop / steps,
            "prefetch": (total - loop - runtime) / steps,
            "runtime": runtime / steps,
        }


def threads() -> list[int]:
    """Native ids of the live threads of this process (Linux; else empty)."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return []


def _thread_seconds(tids: list[int] | None = None) -> dict[int, float]:
    """CPU seconds of each live thread of this process (or of ``tids``), by native id."""
    seconds = {}
    for tid in threads() if tids is None else tids:
        try:  # a thread's CPU clock id (Linux: MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED))
            seconds[tid] = time.clock_gettime((~tid << 3) | 6)
        except OSError:  # it ended meanwhile
            pass
    return seconds


@contextlib.contextmanager
def split_cores(device: set[int], host: set[int]) -> Iterator[None]:
    """This (the training) thread, and so the producer threads it starts, on
    the ``host`` cores; every other thread of the process (JAX's runtime:
    XLA's compute pool, and the threads that run its programs) on the
    ``device`` cores; all back afterwards."""
    everything = os.sched_getaffinity(0)
    me = threading.get_native_id()
    try:
        for tid in threads():
            with contextlib.suppress(OSError):  # it ended meanwhile
                os.sched_setaffinity(tid, host if tid == me else device)
        yield
    finally:
        for tid in threads():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, everything)
