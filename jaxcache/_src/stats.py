"""Counters of what a cache did: per step and since it was built."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["CacheStats", "PhaseTimers", "StepStats", "compilations"]

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compile_lock = threading.Lock()
_compile_count = 0
_listening = False


def _on_event(event: str, duration_secs: float, **kwargs) -> None:
    global _compile_count
    if event == _COMPILE_EVENT:
        with _compile_lock:
            _compile_count += 1


def compilations() -> int:
    """XLA compilations in this process since jaxcache started counting.

    Counting starts at the first call (or the first cache built).

    Examples:
      >>> import jax, jax.numpy as jnp, jaxcache
      >>> x = jnp.ones(7)
      >>> before = jaxcache.testing.compilations()
      >>> _ = jax.jit(lambda x: x * 3)(x)
      >>> jaxcache.testing.compilations() - before
      1
    """
    global _listening
    with _compile_lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            _listening = True
        return _compile_count


@dataclasses.dataclass
class StepStats:
    """What one planned batch did (or the sum over many).

    Attributes:
      lookups: lookups of the cache's rows: ids looked up, padding excluded.
        With raw ids a lookup of an id without a row (``refused_lookups``)
        reads the shared row under ``default="shared"`` and counts here as
        a lookup of that row; under ``default="zeros"`` it reads no row and
        is left out, as padding is.
      distinct: distinct rows looked up (with raw ids: ids with a row, and
        the shared default row when read).
      hits: distinct ids already on device.
      misses: distinct ids fetched from the host.
      access_hits: lookups served by resident rows.
      evictions: resident rows replaced.
      rows_to_device: rows copied host -> device.
      rows_to_host: rows copied device -> host (dirty evictions and flushes).
      overflow: rows routed through the overflow path (several devices).
      new_ids: raw ids given a row (``CacheConfig.vocabulary``).
      forgotten_ids: raw ids whose rows new ids took.
      refused_lookups: lookups of raw ids without a row: not admitted yet,
        or unknown in a batch that does not train (they read the
        vocabulary's default row).

    Examples:
      >>> import jaxcache
      >>> step = jaxcache.stats.StepStats(lookups=8, distinct=4, hits=3, access_hits=7)
      >>> step.hit_rate, step.access_hit_rate
      (0.75, 0.875)
    """

    lookups: int = 0
    distinct: int = 0
    hits: int = 0
    misses: int = 0
    access_hits: int = 0
    evictions: int = 0
    rows_to_device: int = 0
    rows_to_host: int = 0
    overflow: int = 0
    new_ids: int = 0
    forgotten_ids: int = 0
    refused_lookups: int = 0

    def add(self, other: StepStats) -> None:
        """Adds ``other``'s counts to these."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    @property
    def hit_rate(self) -> float:
        """Hits over distinct ids (the share of rows that did not cross the bus)."""
        return self.hits / self.distinct if self.distinct else 0.0

    @property
    def access_hit_rate(self) -> float:
        """Lookups served by resident rows over all lookups."""
        return self.access_hits / self.lookups if self.lookups else 0.0


class PhaseTimers:
    """Seconds and counts spent in each phase of the cache's work.

    Phases: ``plan`` (planning a batch on the host, or dispatching its
    device plan), ``collect`` (reading a device plan's lists back, waiting
    for the device to run it), ``write_back`` and ``gather`` (staging a batch),
    ``deferred`` (copying into a staged batch the rows it fetches whose
    write-back had not landed when it was staged, from the read-out that
    holds them, before its transfer), ``transfer`` (host side), ``swap``
    (dispatching the device swap), ``wait`` (the training loop waiting for a
    prefetched batch) and ``device_wait`` (the training loop waiting for a
    swap still queued on the device, whose read-out holds rows the batch it
    transfers fetches: time the device is busy, not the host). With a
    pipeline the staging phases run on a background thread, so their time
    is hidden behind the device step unless ``wait`` grows; the others run
    on the training thread.

    Examples:
      >>> import jaxcache
      >>> timers = jaxcache.stats.PhaseTimers()
      >>> with timers.time("plan"):
      ...     pass
      >>> timers.counts["plan"], timers.seconds["plan"] >= 0
      (1, True)
    """

    PHASES = (
        "plan",
        "collect",
        "write_back",
        "gather",
        "deferred",
        "transfer",
        "swap",
        "wait",
        "device_wait",
    )

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.counts = dict.fromkeys(self.PHASES, 0)

    @contextlib.contextmanager
    def time(self, phase: str) -> Iterator[None]:
        """Adds the time spent in the ``with`` block to ``phase``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - start)

    def add(self, phase: str, seconds: float) -> None:
        """Adds one occurrence of ``phase`` that took ``seconds`` (timed elsewhere)."""
        self.seconds[phase] += seconds
        self.counts[phase] += 1

    def mean_ms(self) -> dict[str, float]:
        """Mean milliseconds per occurrence of each phase."""
        return {k: 1e3 * self.seconds[k] / max(1, self.counts[k]) for k in self.PHASES}


class CacheStats:
    """Cumulative and last-step counters of one cache.

    Attributes:
      row_bytes: bytes moved per row (the row plus its optimizer state).
      total: counts since the cache was built.
      last: counts of the last planned batch.
      steps: batches planned.
      timers: ``PhaseTimers`` of the host and swap phases.
      write_back_waits: times a batch being staged needed a row whose eviction
        had not been applied yet, and waited for it (look-ahead cost).
      deferred_fetches: rows a prefetched batch needed while their
        write-back from an earlier plan was pending: read when the batch is
        transferred, after that write-back landed, instead of waiting.

    Examples:
      >>> import jaxcache
      >>> stats = jaxcache.CacheStats(row_bytes=64)
      >>> stats.record(jaxcache.stats.StepStats(lookups=10, distinct=4, hits=3, misses=1,
      ...                                 rows_to_device=1))
      >>> stats.total.hit_rate, stats.bytes_to_device
      (0.75, 64)
    """

    def __init__(self, row_bytes: int) -> None:
        self.row_bytes = row_bytes
        self.total = StepStats()
        self.last = StepStats()
        self.steps = 0
        self.timers = PhaseTimers()
        self.write_back_waits = 0
        self.deferred_fetches = 0
        self._compilations_at_start = compilations()

    def record(self, step: StepStats) -> None:
        """Adds one planned batch."""
        self.last = step
        self.total.add(step)
        self.steps += 1

    def record_write_back(self, rows: int) -> None:
        """Adds rows written back outside a planned batch (a flush)."""
        self.total.rows_to_host += rows

    @property
    def bytes_to_device(self) -> int:
        """Bytes copied host -> device."""
        return self.total.rows_to_device * self.row_bytes

    @property
    def bytes_to_host(self) -> int:
        """Bytes copied device -> host."""
        return self.total.rows_to_host * self.row_bytes

    @property
    def compilations(self) -> int:
        """XLA compilations in the process since this cache was built."""
        return compilations() - self._compilations_at_start

    def state_dict(self) -> dict[str, Any]:
        """The counters as JSON-serialisable values, for a checkpoint.

        The timers and the compilation count describe this process, not the
        cache, and are not part of it.

        Examples:
          >>> import jaxcache
          >>> stats = jaxcache.CacheStats(row_bytes=64)
          >>> stats.record(jaxcache.stats.StepStats(lookups=10, distinct=4, hits=3))
          >>> again = jaxcache.CacheStats(row_bytes=64)
          >>> again.load_state_dict(stats.state_dict())
          >>> again.steps, again.total.hits
          (1, 3)
        """
        return {
            "total": dataclasses.asdict(self.total),
            "last": dataclasses.asdict(self.last),
            "steps": self.steps,
            "write_back_waits": self.write_back_waits,
            "deferred_fetches": self.deferred_fetches,
        }

    def state_array(self) -> np.ndarray:
        """The counters of ``state_dict`` as one ``int64`` array, named by
        ``state_fields()``. A checkpoint keeps one per process, each
        counting its own devices' shares.

        Examples:
          >>> import jaxcache
          >>> stats = jaxcache.CacheStats(row_bytes=64)
          >>> stats.record(jaxcache.stats.StepStats(lookups=10, distinct=4, hits=3))
          >>> again = jaxcache.CacheStats(row_bytes=64)
          >>> again.load_state_dict(jaxcache.CacheStats.from_state_arrays([stats.state_array()]))
          >>> again.steps, again.total.hits
          (1, 3)
        """
        state = self.state_dict()
        values = {f"{part}.{k}": v for part in ("total", "last") for k, v in state[part].items()}
        values.update((k, state[k]) for k in ("steps", "write_back_waits", "deferred_fetches"))
        return np.array([values[name] for name in self.state_fields()], np.int64)

    @staticmethod
    def state_fields() -> list[str]:
        """The names of ``state_array``'s entries, saved beside it, so that
        a version with other counters reads it by name."""
        fields = [f.name for f in dataclasses.fields(StepStats)]
        return [f"{part}.{k}" for part in ("total", "last") for k in fields] + [
            "steps",
            "write_back_waits",
            "deferred_fetches",
        ]

    @staticmethod
    def from_state_arrays(
        arrays: Sequence[np.ndarray], fields: Sequence[str] | None = None
    ) -> dict[str, Any]:
        """The ``state_dict`` of the counters of several ``state_array``
        (processes' shares of one cache): their sums (the most steps).
        ``fields`` names their entries (default: ``state_fields()``); a
        counter they lack is zero, one this version lacks is left out.

        Raises:
          ValueError: an array does not hold one integer per field.
        """
        names = CacheStats.state_fields() if fields is None else [str(f) for f in fields]
        rows = [np.asarray(a) for a in arrays]
        if not rows or any(a.shape != (len(names),) or a.dtype.kind not in "iu" for a in rows):
            shapes = [(a.shape, str(a.dtype)) for a in rows]
            raise ValueError(
                f"saved statistics are corrupt: {shapes}, where each process keeps "
                f"{len(names)} integers."
            )
        summed = dict(zip(names, np.asarray(np.sum(rows, axis=0)).tolist(), strict=True))
        most = dict(zip(names, np.asarray(np.max(rows, axis=0)).tolist(), strict=True))
        counters = [f.name for f in dataclasses.fields(StepStats)]
        return {
            "total": {k: summed.get(f"total.{k}", 0) for k in counters},
            "last": {k: summed.get(f"last.{k}", 0) for k in counters},
            "steps": int(most.get("steps", 0)),
            "write_back_waits": int(summed.get("write_back_waits", 0)),
            "deferred_fetches": int(summed.get("deferred_fetches", 0)),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Takes over the counters of a ``state_dict`` (possibly read back from JSON).

        Raises:
          ValueError: ``state`` lacks a counter (nothing changed).
        """
        total, last, steps, waits, deferred = self.parse_state_dict(state)
        self.total, self.last, self.steps, self.write_back_waits = total, last, steps, waits
        self.deferred_fetches = deferred

    @staticmethod
    def parse_state_dict(state: Any) -> tuple[StepStats, StepStats, int, int, int]:
        """``(total, last, steps, write_back_waits, deferred_fetches)`` of a
        ``state_dict`` read back from JSON.

        Raises:
          ValueError: ``state`` lacks a counter, or holds one that is not a number.
        """
        fields = [f.name for f in dataclasses.fields(StepStats)]
        try:
            total = StepStats(**{k: int(state["total"].get(k, 0)) for k in fields})
            last = StepStats(**{k: int(state["last"].get(k, 0)) for k in fields})
            steps, waits = int(state["steps"]), int(state["write_back_waits"])
            deferred = int(state.get("deferred_fetches", 0))
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"saved statistics are incomplete or corrupt: {error!r}.") from None
        return total, last, steps, waits, deferred

    def as_dict(self) -> dict[str, float]:
        """Cumulative counters and rates as a flat dict (for logging)."""
        out: dict[str, float] = dataclasses.asdict(self.total)
        out.update(
            steps=self.steps,
            hit_rate=self.total.hit_rate,
            access_hit_rate=self.total.access_hit_rate,
            bytes_to_device=self.bytes_to_device,
            bytes_to_host=self.bytes_to_host,
            compilations=self.compilations,
            write_back_waits=self.write_back_waits,
            deferred_fetches=self.deferred_fetches,
        )
        return out
