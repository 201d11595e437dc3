"""The prefetch pipeline: host work for the next batches overlaps the device step.

Stage by stage, for batch ``t + k`` while the device runs step ``t``:

* **producer thread** — ``EmbeddingCache.stage_host``: plan the batch
  (distinct ids, hits, misses, victims among rows no in-flight batch uses),
  route it over the devices, land the write-back of any row it is about to
  fetch again, and gather the missing rows and their optimizer state into
  fresh staging buffers.
* **training loop** (``next()``) — ``EmbeddingCache.to_device`` and
  ``apply``: start the asynchronous transfer, then the donated swap that
  writes the fetched rows into their slots and reads the victims out for
  write-back, dispatched in plan order between training steps. Every JAX
  dispatch happens on this thread, so the device state has one owner and
  several processes issue their collectives in the same order.

A cache that plans on the device (``planner="device"``) splits the first
stage: its plans are dispatched by the training loop (every JAX dispatch of
a process on one thread, in one order), plan ``t + k`` during
``next()`` of batch ``t``, and a **stager thread** reads each plan's lists
back, lands the write-backs its misses wait on and gathers their rows
(``EmbeddingCache.gather``); a **feeder thread** pulls the batches from the
source. A plan that finds no room next to the batches in flight is planned
again, in the loop, once the batch it waits for is released.

Rows of batches planned but not yet handed to the training loop are protected
from eviction; a batch is released when the loop asks for the next one (its
step has been dispatched, and device order puts every later swap after it).
Because swaps run in plan order between steps, the pipelined run computes
exactly what the unpipelined run computes.

While a producer thread runs, the interpreter's thread switch interval is
lowered (``switch_interval``, 0.5 ms by default instead of Python's 5 ms).
The producer's NumPy work holds the GIL in long stretches, and the training
thread gives the GIL up inside every JAX call; with the default interval each
time it wants it back it can wait up to 5 ms, many times per step, so the
device idles behind the host thread that was meant to hide host work.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import queue
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxcache._src.device_ops import Lookup, check_bags
from jaxcache._src.device_planner import DevicePlanner, Dispatched, PlanSkipped
from jaxcache._src.engine import CLOSE_DROPPED, DeviceStaged, EmbeddingCache, HostStaged, Staged
from jaxcache._src.holder import CacheHolder
from jaxcache._src.lifecycle import deliver_held_interrupt, interrupts_held
from jaxcache._src.planner import CapacityError

__all__ = ["Prefetcher", "prefetch"]

_POLL_SECONDS = 0.05
_OPEN: weakref.WeakSet[Prefetcher] = weakref.WeakSet()
# Batches a closed pipeline took from its source and did not plan for every
# table, by source: the next pipeline over the same iterator yields them first.
_UNSTAGED: weakref.WeakKeyDictionary[Iterator[Any], list[Any]] = weakref.WeakKeyDictionary()
SWITCH_INTERVAL = 5e-4


class _SwitchInterval:
    """Lowers ``sys.setswitchinterval`` while at least one producer thread runs.

    Pipelines may overlap: the interval is lowered by the first to start (to
    the smallest any of them asks for) and restored by the last to stop, to
    what it was before, unless something else changed it meanwhile.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[int, float] = {}
        self._saved: float | None = None
        self._set: float | None = None

    def hold(self, owner: object, seconds: float) -> None:
        with self._lock:
            if not self._holders:
                self._saved = sys.getswitchinterval()
            self._holders[id(owner)] = seconds
            self._apply()

    def drop(self, owner: object) -> None:
        with self._lock:
            if self._holders.pop(id(owner), None) is None:
                return
            if self._holders:
                self._apply()
            elif self._saved is not None and sys.getswitchinterval() == self._set:
                sys.setswitchinterval(self._saved)

    def _apply(self) -> None:
        wanted = min(min(self._holders.values()), self._saved or float("inf"))
        sys.setswitchinterval(wanted)
        self._set = sys.getswitchinterval()


_SWITCH = _SwitchInterval()


class PipelineStopped(Exception):
    """Ends a producer that was waiting for capacity when its pipeline closed."""


class _End:
    """The source is exhausted."""


class _Raised:
    """The source raised ``error`` when asked for its next batch."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Wake:
    """Put in the stager's queue at close: it stops now instead of at its next poll."""


class _Failure:
    """The producer failed (or was stopped) while staging a batch."""

    def __init__(
        self, error: BaseException, partial: Mapping[str, Staged | HostStaged | DeviceStaged]
    ) -> None:
        self.error = error
        self.partial = partial


class _Work(NamedTuple):
    """A batch whose device plans were dispatched, for the stager thread.

    ``dispatched`` holds the plans of the device-planned caches; with
    ``merge``, only those (planned again after a failure): the batch's other
    tables are staged already and wait in the stager's partials.
    """

    index: int  # type: ignore[assignment]  # the field shadows tuple.index
    batch: Mapping[str, Any]
    dispatched: dict[str, Dispatched]
    merge: bool = False


class _Refused(NamedTuple):
    """Device plans of batch ``index`` of the pipeline failed: for each
    table that refused, ``(key, plan, error)`` (the batch's other tables
    wait in the stager's partials)."""

    index: int  # type: ignore[assignment]  # the field shadows tuple.index
    refusals: tuple[tuple[str, int, BaseException], ...]


class Prefetcher(Iterator[dict[str, Any]]):
    """Iterates over ``batches`` with each table's ids replaced by a ready ``Lookup``.

    Use ``jaxcache.prefetch`` to build one. It is an iterator and a context
    manager; leaving the ``with`` block (or ``close()``) stops the thread and
    applies every batch already staged, so the device state matches the
    planner and ``flush()`` leaves the host table complete.

    Args:
      batches: iterable of mappings (e.g. dicts of NumPy arrays).
      tables: batch key -> table holder (``jaxcache.nnx.CachedEmbed``, or
        ``jaxcache.linen.Holder`` for Linen variables); the
        ids under that key are planned for that table.
      lookahead: batches staged ahead of the training loop; ``0`` runs
        everything in the loop (the unpipelined path, same results).
      train: the steps update the looked-up rows.
      callback: the training step looks ids up with ``CachedEmbed.lookup_ids``
        (the host-callback form): batches keep their raw ids, and the step's
        callback is served the batch staged here.
      switch_interval: seconds; ``sys.setswitchinterval`` while the producer
        thread runs (restored afterwards), so that the training thread gets
        the GIL back promptly between its JAX calls. ``None`` leaves the
        interpreter's setting alone.

    Attributes:
      unstaged: after ``close``, the batches the thread took from the source
        and did not plan for every table (one waited for room when the loop
        left early), in order; a batch the source returns after ``close``
        (the thread was waiting inside it) is added last. When ``batches``
        is an iterator that takes weak references (a generator), the next
        pipeline over it yields them first; otherwise a warning says so, and
        they are here to chain back.

    Examples:
      >>> import numpy as np, jaxcache
      >>> embed = jaxcache.nnx.CachedEmbed(
      ...     jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, capacity=16)))
      >>> batches = [{"ids": np.array([[i, i + 1]])} for i in range(4)]
      >>> with jaxcache.pipeline.Prefetcher(batches, {"ids": embed}, lookahead=1) as pipeline:
      ...     first = next(pipeline)
      >>> type(first["ids"]).__name__, embed.cache.stats.steps >= 1
      ('Lookup', True)
    """

    def __init__(
        self,
        batches: Iterable[Mapping[str, Any]],
        tables: Mapping[str, CacheHolder],
        *,
        lookahead: int = 2,
        train: bool = True,
        callback: bool = False,
        switch_interval: float | None = SWITCH_INTERVAL,
    ) -> None:
        if switch_interval is not None and not 0 < switch_interval <= 1:
            raise ValueError(
                f"switch_interval={switch_interval!r} must be a number of seconds in (0, 1] "
                f"(default {SWITCH_INTERVAL}), or None to leave sys.getswitchinterval() alone."
            )
        check_lookahead(lookahead)
        if not isinstance(tables, Mapping):
            raise TypeError(
                f"tables must map each batch key holding ids to its module, such as "
                f"{{'ids': embed}}, got a {type(tables).__name__}."
            )
        if not isinstance(batches, Iterable):
            raise TypeError(
                f"batches must be an iterable of mappings (e.g. a generator of dicts of "
                f"arrays), got a {type(batches).__name__}."
            )
        if not tables:
            raise ValueError("tables is empty; map each batch key holding ids to its module.")
        for key, holder in tables.items():
            if not all(hasattr(holder, a) for a in ("cache", "get_state", "set_state")):
                raise TypeError(
                    f"tables[{key!r}] is a {type(holder).__name__}, not a cached table; pass "
                    "the jaxcache.nnx.CachedEmbed that looks those ids up (with Linen, a "
                    "jaxcache.linen.Holder of the model's variables)."
                )
        caches = [holder.cache for holder in tables.values()]
        if callback:
            for cache in caches:
                cache.callbacks.check()
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError(
                "two batch keys map to the same cache; concatenate their ids into one array "
                "(one plan per table per step)."
            )
        for key, holder in tables.items():
            if holder.cache.pipelines:
                raise RuntimeError(
                    f"tables[{key!r}] is staged ahead by another open jaxcache.prefetch: a "
                    "second pipeline would plan between its batches, taking their rows or "
                    "waiting for them forever. Close the first one (leave its with-block, or "
                    "let it run to its end) before opening this one, or build both with "
                    f"lookahead=0. {CLOSE_DROPPED}"
                )
            if lookahead > 0 and holder.cache.open_pipelines:
                raise RuntimeError(
                    f"tables[{key!r}] is iterated by another open jaxcache.prefetch (without "
                    "look-ahead), which plans each batch as it hands it out and counts every "
                    "earlier plan as finished: it would release the batches this one stages "
                    "ahead, and their rows could be taken before their steps. Close the first "
                    "one (leave its with-block, or let it run to its end) before opening this "
                    "one, or build both with lookahead=0."
                )
        for key, holder in tables.items():
            vocabulary = holder.cache.config.vocabulary
            if train and vocabulary is not None and lookahead > vocabulary.protect:
                raise ValueError(
                    f"lookahead={lookahead} keeps {lookahead} batches in flight, but the "
                    f"vocabulary of tables[{key!r}] holds the rows of the {vocabulary.protect} "
                    "before each batch (DynamicVocabulary.protect): new ids could not take "
                    "the rows the others hold as they would unpipelined. Build it with "
                    f"DynamicVocabulary(protect={lookahead}) or more, or pass "
                    f"lookahead={vocabulary.protect}."
                )
        self.lookahead = lookahead
        self.train = train
        self.callback = callback
        self._tables = dict(tables)
        # The producer thread reads only these, never the holders: a Flax NNX
        # module may be mid-transform on the training thread (inside nnx.jit
        # its attributes are briefly taken apart).
        self._caches = {key: holder.cache for key, holder in tables.items()}
        self._combiners = {key: getattr(holder, "combiner", None) for key, holder in tables.items()}
        kinds = {key: cache.planner_kind for key, cache in self._caches.items()}
        if lookahead > 0 and len(set(kinds.values())) > 1:
            # The loop dispatches device plans ahead while the stager waits
            # for room for host plans: the two waits can hold each other.
            raise ValueError(
                f"the tables mix planners ({kinds}); a pipeline with look-ahead runs one "
                "kind: build every table's EmbeddingCache with the same planner=, or pass "
                "lookahead=0."
            )
        for cache in self._caches.values():
            # Plans made before this pipeline are finished, as for a
            # ``prepare``: a batch an earlier loop left (a break, an error)
            # holds no rows that this one would wait for forever.
            cache.lifecycle.release_all()
        self._origin = iter(batches)
        # Only an iterator the caller holds can go on in a later pipeline
        # (``iter`` of a list is new each time).
        self._resumable = self._origin is batches
        self._source = self._origin
        left = _take_unstaged(self._origin)
        if left:
            self._source = itertools.chain(left, self._origin)
        # Batches pulled from the source and not yet handed out, the first
        # being batch ``_log_base`` of this pipeline: at close, those some
        # table did not plan go back to the source (``unstaged``).
        self._log: collections.deque[Any] = collections.deque()
        self._log_base = 0
        self._log_lock = threading.Lock()
        self._put_back_done = False
        self._start = {key: cache.planner.next_index for key, cache in self._caches.items()}
        self.unstaged: list[Any] = []
        self._queue: queue.Queue[Any] = queue.Queue()
        self._permits = threading.Semaphore(max(lookahead, 1))
        # The producer's progress, under ``_released``: batches the permits
        # let it stage (``_granted``), staged (``_produced``), and the plan
        # whose release a batch waits for, with its planner (``_room_wait``).
        self._granted = max(lookahead, 1)
        self._produced = 0
        self._room_wait: tuple[Any, int] | None = None
        self._stop = threading.Event()
        self._released = threading.Condition()
        self._staging = threading.Lock()
        self._handed_out: dict[str, Staged] = {}
        self._handed_out_epochs: dict[str, int] = {}
        self._closed = False
        self._done = False
        # The thread that iterates it (its first ``next``): it owns the
        # tables' device state, so only it may close the pipeline.
        self._owner: threading.Thread | None = None
        self._thread: threading.Thread | None = None
        self._feeder: threading.Thread | None = None
        # Device-planned tables: the plans the loop dispatches ahead.
        self._device = any(isinstance(c.planner, DevicePlanner) for c in caches)
        self._multi_process = any(c.shard[1] > 1 for c in caches)
        self._taken = 0  # batches handed out
        self._planned: list[tuple[int, Mapping[str, Any]]] = []  # dispatched, not handed out
        self._deferred: dict[int, _Refused] = {}  # refusals of batches after the next
        self._pulled: queue.Queue[Any] = queue.Queue(maxsize=lookahead + 1)
        self._work: queue.Queue[Any] = queue.Queue()
        self._partials: dict[int, dict[str, Staged | HostStaged | DeviceStaged]] = {}
        self._source_done = False
        for cache in caches:
            cache.open_pipelines.add(self)
        if lookahead > 0:
            target = self._stage_planned if self._device else self._produce
            self._thread = threading.Thread(target=target, name="jaxcache-prefetch", daemon=True)
            _OPEN.add(self)
            if switch_interval is not None:
                _SWITCH.hold(self, switch_interval)
            if self._device:
                self._feeder = threading.Thread(
                    target=self._feed, name="jaxcache-feeder", daemon=True
                )
                self._feeder.start()
            self._thread.start()

    # ------------------------------------------------------------ consumer
    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._closed or self._done:
            raise StopIteration
        if self._owner is None:
            self._owner = threading.current_thread()
        self._release_handed_out()
        # Read before the interrupts are held: a slow source stays interruptible.
        pulled = self._pull_now() if self._thread is None else None
        # From the plans on to the swaps, a Ctrl-C waits (the waits for a
        # staged batch deliver it before they take one).
        with interrupts_held():
            if self._thread is None:
                item = self._stage_now(pulled)
            elif self._device:
                item = self._take_planned()
            else:
                item = self._take()
            return self._hand_out(item)

    def _hand_out(self, item: Any) -> dict[str, Any]:
        """The batch of a staged ``item``, its tables' rows swapped in, or
        the end or the error it stands for, raised."""
        if isinstance(item, _End):
            self._done = True
            _SWITCH.drop(self)  # the producer has finished
            self._let_go()
            if self._device:
                self._stop.set()  # nothing is left for the stager
            raise StopIteration
        if isinstance(item, _Failure):
            self._apply(item.partial)
            self._forget_pulled(self._taken + 1)  # the failed batch goes with its error
            self.close()
            raise item.error
        batch, staged = item
        self._taken += 1
        self._forget_pulled(self._taken)
        self._handed_out = staged
        self._handed_out_epochs = {key: self._caches[key].lifecycle.epoch for key in staged}
        if self.callback:
            for key, s in staged.items():
                self._caches[key].callbacks.offer(s)
            return dict(batch)
        out = dict(batch)
        out.update(self._apply(staged))
        return out

    def _forget_pulled(self, count: int) -> None:
        """Drops the first ``count`` batches pulled from the log: handed out
        (planned), or raised with their error; none goes back to the source."""
        while self._log and self._log_base < count:
            self._log.popleft()
            self._log_base += 1

    def _take(self) -> Any:
        start = time.perf_counter()
        item = _get_delivering(self._queue)
        waited = time.perf_counter() - start
        for cache in self._caches.values():
            cache.stats.timers.add("wait", waited)
        if not isinstance(item, (_End, _Failure)):
            with self._released:
                self._granted += 1
            self._permits.release()
        return item

    def _pull_now(self) -> Any:
        try:
            return next(self._source)
        except StopIteration:
            return _End()

    def _stage_now(self, batch: Any) -> Any:
        if isinstance(batch, _End):
            return batch
        if self.callback:  # the step's callback plans on the spot
            return batch, {}
        staged: dict[str, Staged] = {}
        try:
            ids = _all_ids(batch, self._caches, self._combiners)
            for key, cache in self._caches.items():
                cache.lifecycle.release_all()
                staged[key] = cache.stage(ids[key], train=self.train)
        except Exception as error:  # the tables staged before it are applied
            return _Failure(error, staged)
        return batch, staged

    def _apply(self, staged: Mapping[str, Staged | HostStaged | DeviceStaged]) -> dict[str, Lookup]:
        """Transfers and swaps staged batches in, in order; returns their lookups.

        On the training thread, so that every JAX dispatch of a process comes
        from one thread in one order: with several processes, their
        collectives must match.
        """
        lookups = {}
        for key, s in staged.items():
            holder, cache = self._tables[key], self._caches[key]
            if isinstance(s, (HostStaged, DeviceStaged)):
                s = cache.to_device(s)
            holder.set_state(cache.apply(holder.get_state(), s))
            lookups[key] = s.lookup
        return lookups

    def _release_handed_out(self) -> None:
        # The loop asks for the next batch: the last one's step is dispatched.
        # A restore since (a rollback in a loop without look-ahead) started
        # the table's plans again from the saved index: this one's is not
        # of them, and releasing it would count plans to come as finished.
        with self._released:
            for key, s in self._handed_out.items():
                lifecycle = self._caches[key].lifecycle
                if lifecycle.epoch == self._handed_out_epochs[key]:
                    lifecycle.release(s.plan.index)
            self._handed_out = {}
            self._released.notify_all()

    # ------------------------------------------------------------ producer
    def _produce(self) -> None:
        staged: dict[str, Staged | HostStaged] = {}
        try:
            while True:
                while not self._permits.acquire(timeout=_POLL_SECONDS):
                    if self._stop.is_set():
                        return
                if self._stop.is_set():
                    return
                batch = self._pull()
                if isinstance(batch, _End):
                    self._queue.put(batch)
                    return
                if isinstance(batch, _Raised):
                    raise batch.error
                with self._staging:
                    if self._stop.is_set():
                        return
                    staged = {}
                    ids = _all_ids(batch, self._caches, self._combiners)
                    for key, cache in self._caches.items():
                        staged[key] = self._stage_with_retry(cache, ids[key])
                    self._queue.put((batch, staged))
                    staged = {}
                with self._released:
                    self._produced += 1
                    self._released.notify_all()
        except BaseException as error:  # re-raised in the training loop
            self._queue.put(_Failure(error, staged))
        finally:
            with self._released:
                self._released.notify_all()  # a close that lets it settle stops waiting

    def _pull(self) -> Any:
        """The source's next batch, ``_End``, or ``_Raised`` with its error."""
        try:
            batch = next(self._source)
        except StopIteration:
            return _End()
        except BaseException as error:  # SystemExit too: the loop raises it, never waits
            return _Raised(error)
        with self._log_lock:
            if not self._put_back_done:
                self._log.append(batch)
                return batch
        # The pipeline closed while the source was busy: the batch goes back.
        self._give_back([batch])
        return _End()

    def _stage_with_retry(self, cache: EmbeddingCache, ids: Any) -> HostStaged:
        """Stages ``ids``; while in-flight batches hold too many rows, waits for them.

        The look-ahead window shrinks instead of failing: the batch waits
        until the training loop has released the plans in its way (the
        refused plan says which), then plans again. Only a batch that cannot
        fit with nothing in flight raises ``CapacityError``.
        """
        planner = cache.planner
        size = cache.callbacks.size(np.size(ids)) if self.callback else None
        # At most `lookahead` earlier plans are in flight now (staged, or the
        # one the loop trains on): plans up to `finished` are surely released.
        # Planning with that bound, not with whatever the loop has released
        # by now, makes every plan independent of thread timing, so the
        # processes of a multi-process run choose the same slots.
        finished = planner.next_index - 1 - self.lookahead
        while True:
            try:
                return cache.stage_host(
                    ids, train=self.train, size=size, released=finished, defer=True
                )
            except CapacityError as error:
                if error.fits_after is None or error.fits_after >= planner.next_index:
                    raise
                with self._released:
                    self._room_wait = (planner, error.fits_after)
                    self._released.notify_all()
                    try:
                        while planner.released < error.fits_after:
                            if self._stop.is_set():
                                raise PipelineStopped(
                                    "stopped while waiting for capacity"
                                ) from None
                            self._released.wait(timeout=_POLL_SECONDS)
                    finally:
                        self._room_wait = None
                finished = max(finished, error.fits_after)

    # ------------------------------------------------------ device planners
    def _feed(self) -> None:
        """The feeder thread: pulls batches for the loop to plan, ``lookahead
        + 1`` at most ahead."""
        while not self._stop.is_set():
            item = self._pull()
            while True:
                try:
                    self._pulled.put(item, timeout=_POLL_SECONDS)
                    break
                except queue.Full:
                    if self._stop.is_set():
                        return
            if isinstance(item, (_End, _Raised)):
                return

    def _take_planned(self) -> Any:
        """The loop's part for device-planned tables: dispatches the plans of
        every batch up to ``lookahead`` past the one it hands out now (a
        fixed point in the step sequence, so several processes dispatch
        their collectives in the same order), then takes that one.

        A refusal of a later batch waits until that batch is next: planning
        it again earlier would count the rows of batches not yet handed out
        as released."""
        self._dispatch_until(self._taken + self.lookahead)
        while True:
            item = self._deferred.pop(self._taken, None)
            if item is None:
                item = self._take()
            if not isinstance(item, _Refused):
                if not isinstance(item, (_End, _Failure)):
                    self._planned.pop(0)
                return item
            if item.index > self._taken:  # another of its tables may refuse in it too
                self._defer(item)
                continue
            failure = self._plan_again(item)
            if failure is not None:
                return failure

    def _defer(self, refused: _Refused) -> None:
        """Holds ``refused`` until its batch is next, with any refusals of
        the batch's other tables held before it."""
        held = self._deferred.get(refused.index)
        if held is not None:
            refused = _Refused(refused.index, held.refusals + refused.refusals)
        self._deferred[refused.index] = refused

    def _dispatch_until(self, last: int) -> None:
        """Dispatches the device plans of the batches up to index ``last``
        that the feeder has pulled, and waits for the one handed out next.
        With several processes it waits for each: every process then
        dispatches each plan between the same two steps, so the collectives
        of plans and steps meet in the same order everywhere."""
        wait = self._multi_process
        while not self._source_done and len(self._planned) + self._taken <= last:
            index = self._taken + len(self._planned)
            try:
                block = wait or index == self._taken
                item = _get_delivering(self._pulled) if block else self._pulled.get(False)
            except queue.Empty:
                return
            if isinstance(item, _End):
                self._source_done = True
                self._work.put(item)
                return
            if isinstance(item, _Raised):
                self._source_done = True
                self._work.put(_Failure(item.error, {}))
                return
            planned = {
                key: cache
                for key, cache in self._caches.items()
                if isinstance(cache.planner, DevicePlanner)
            }
            try:  # every table's ids, before any plan: a refusal leaves none half-made
                _all_ids(item, self._caches, self._combiners)
            except Exception as error:  # raised in order, after the batches before it
                self._source_done = True
                self._work.put(_Failure(error, {}))
                return
            dispatched = {key: self._dispatch(cache, item, key) for key, cache in planned.items()}
            self._planned.append((index, item))
            self._work.put(_Work(index, item, dispatched))

    def _dispatch(self, cache: EmbeddingCache, batch: Mapping[str, Any], key: str) -> Dispatched:
        # The bound the host planner's producer uses (``_stage_with_retry``):
        # at most ``lookahead`` earlier plans are in flight.
        finished = cache.planner.next_index - 1 - self.lookahead
        return cache.dispatch(_ids(batch, key), train=self.train, released=finished)

    def _plan_again(self, refused: _Refused) -> _Failure | None:
        """Device plans found no room next to the batches in flight: plans
        each refused table again, now that the plan it waits for is released
        (the loop takes batches in order, so every earlier one is), and every
        later plan of those tables (each did nothing after the failure).
        Another error, or a batch that cannot fit, ends the loop: the
        ``_Failure`` to raise."""
        index = refused.index
        waits: dict[str, int] = {}
        for key, plan, _ in refused.refusals:  # every one, before an error ends the loop
            planner = self._caches[key].planner
            assert isinstance(planner, DevicePlanner)
            planner.rollback(plan)
        for key, plan, error in refused.refusals:
            if (
                not isinstance(error, CapacityError)
                or error.fits_after is None
                or error.fits_after >= plan
            ):
                return _Failure(error, self._partials.pop(index, {}))
            waits[key] = int(error.fits_after)
        for later, batch in self._planned:
            if later < index:
                continue
            dispatched = {}
            for key, fits_after in waits.items():
                cache = self._caches[key]
                finished = cache.planner.next_index - 1 - self.lookahead
                if later == index:
                    finished = max(finished, fits_after)
                dispatched[key] = cache.dispatch(
                    _ids(batch, key), train=self.train, released=finished
                )
            self._work.put(_Work(later, batch, dispatched, merge=True))
        return None

    def _stage_planned(self) -> None:
        """The stager thread: reads back each dispatched plan, gathers its
        rows, and stages the batch's host-planned tables, batch by batch.

        A batch with a refused plan waits in ``_partials`` (its other tables
        staged) until the loop plans that table again (a ``merge``); so do
        the batches after it, whose plans of that table did nothing. The
        end of the source waits for them too, and the thread runs until the
        pipeline stops."""
        last: _End | _Failure | None = None
        while True:
            try:
                work = self._work.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                work = _Wake()
            if isinstance(work, _Wake):
                if self._stop.is_set():
                    return
                continue
            if isinstance(work, (_End, _Failure)):
                last = work
            else:
                try:
                    self._stage_work(work)
                except BaseException as error:  # re-raised in the training loop
                    self._queue.put(_Failure(error, self._partials.pop(work.index, {})))
                    return
            if last is not None and not self._partials:
                self._queue.put(last)
                last = None

    def _stage_work(self, work: _Work) -> None:
        """Stages what ``work`` holds; the batch goes to the loop once every
        table is staged. Until then it waits in ``_partials``: for a refused
        table (the loop plans it again), or for a table whose plan was
        skipped after an earlier refusal."""
        staged = self._partials.pop(work.index, {}) if work.merge else {}
        refusals: list[tuple[str, int, BaseException]] = []
        try:
            for key, cache in self._caches.items():
                if key in work.dispatched:
                    plan = work.dispatched[key]
                    try:
                        staged[key] = cache.gather(plan, defer=True)
                    except PlanSkipped:
                        pass  # planned again after an earlier refusal
                    except (ValueError, CapacityError) as error:
                        refusals.append((key, plan.index, error))
                elif not work.merge:
                    staged[key] = self._stage_with_retry(cache, _ids(work.batch, key))
        finally:
            complete = len(staged) == len(self._caches)
            if not complete:
                self._partials[work.index] = staged
        if refusals:
            self._queue.put(_Refused(work.index, tuple(refusals)))
        elif complete:
            self._queue.put((work.batch, staged))

    def _finish_planned(self) -> None:
        """At close, after the stager stopped: gathers the device plans it
        left and applies every table's staged rows of the batches that
        waited, in order (each plan that ran must reach the device state).
        A table's plans from its first refused one on did nothing: that
        plan is taken back, so the table plans it next."""
        refused: dict[str, int] = {}  # each table's first plan that did nothing
        for item in self._deferred.values():
            for key, plan, _ in item.refusals:
                refused[key] = min(plan, refused.get(key, plan))
        while True:
            try:
                work = self._work.get_nowait()
            except queue.Empty:
                break
            if not isinstance(work, _Work):
                continue
            staged = self._partials.setdefault(work.index, {})
            for key, dispatched in work.dispatched.items():
                try:
                    staged[key] = self._caches[key].gather(dispatched, defer=True)
                except PlanSkipped:
                    pass  # it did nothing, after a refusal
                except (ValueError, CapacityError):
                    refused[key] = min(dispatched.index, refused.get(key, dispatched.index))
        for index in sorted(self._partials):
            self._apply(self._partials.pop(index))
        for key, plan in refused.items():
            planner = self._caches[key].planner
            assert isinstance(planner, DevicePlanner)
            planner.rollback(plan)

    # ------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Stops the thread and applies every batch it already staged.

        Idempotent. Returns promptly: the producer polls the stop flag while
        it waits, and a batch being staged takes milliseconds.

        Raises:
          RuntimeError: called on another thread than the one iterating the
            pipeline, while that one lives (nothing changed).
        """
        with interrupts_held():  # it swaps the staged batches in, and lets the tables go
            if self._closed:
                return
            owner = self._owner
            if owner is not None and owner is not threading.current_thread() and owner.is_alive():
                raise RuntimeError(
                    f"close the pipeline on the thread that iterates it ({owner.name}): "
                    "closing swaps the batches it staged into the tables, between that "
                    "thread's steps. To stop it from another thread, end its source (have "
                    "the iterator return); the loop then leaves with the batches staged so far."
                )
            self._closed = True
            try:
                self._close()
            finally:
                # Even when a swap failed (a batch it loses stops the cache at
                # its next swap, ``EmbeddingCache.apply``): the tables are free.
                _SWITCH.drop(self)
                _OPEN.discard(self)
                self._let_go()

    def _close(self) -> None:
        """``close``'s work: stops the threads and applies what they staged."""
        if self._thread is not None and not self._device and self._multi_process:
            self._settle()
        self._stop.set()
        with self._released:
            self._released.notify_all()
        if self.callback:
            # Batches handed out whose step never ran: wait for the steps that
            # did run (their callbacks consume offers), then swap the rest in,
            # before the batches staged after them (plan order).
            for key, holder in self._tables.items():
                jax.block_until_ready(holder.get_state())
                for staged in self._caches[key].callbacks.take():
                    self._apply({key: staged})
        if self._thread is not None and self._device:
            self._source_done = True  # the loop dispatches no more plans
            self._work.put(_Wake())
            while self._thread.is_alive():
                self._drain()
                self._thread.join(timeout=_POLL_SECONDS)
            self._drain()
            self._finish_planned()
        elif self._thread is not None:
            # Apply what is queued until the producer is gone or idle: applying
            # also dispatches the swaps a staging batch may wait on. Once the
            # producer holds no staging lock it never stages again (it checks
            # the stop flag under that lock).
            while True:
                self._drain()
                self._thread.join(timeout=_POLL_SECONDS)
                if not self._thread.is_alive():
                    break
                if self._staging.acquire(blocking=False):
                    self._staging.release()
                    # Idle: it returns at its next check of the stop flag,
                    # unless the source blocks it (then it ends with the source).
                    self._thread.join(timeout=_POLL_SECONDS)
                    break
            self._drain()
        if self._thread is not None:
            self._put_back()

    def _settle(self) -> None:
        """At close, on several processes: lets the producer stage every
        batch its permits allow, as far as it gets without the loop.

        Each host plan takes part in one exchange between the processes, so
        every process must make the same plans. How far a producer got when
        the loop left is a matter of its thread's timing (a process whose
        source is slower has staged fewer); where it settles is not: the
        batches up to ``lookahead`` past the last one handed out, short of
        the end of the source, an error, or a batch waiting for room that
        only a step of the loop would free."""
        self._release_handed_out()  # the loop takes no more steps
        assert self._thread is not None
        while True:
            self._drain()  # its swaps may be what a staging batch waits on
            with self._released:
                waiting = self._room_wait
                if (
                    self._produced >= self._granted
                    or not self._thread.is_alive()
                    or (waiting is not None and waiting[0].released < waiting[1])
                ):
                    return
                self._released.wait(timeout=_POLL_SECONDS)

    def _put_back(self) -> None:
        """At close: a batch the thread took from the source that some table
        planned counts as seen, as the batches staged ahead do, so the
        tables that had not planned it (one waited for capacity, or the
        thread stopped first) plan it now, with nothing in flight, and swap
        it in: no table plans a batch twice. The batches no table planned
        go back to the source, so that a later pipeline over it goes on from
        the batch after the last one staged; none is lost in silence."""
        planned = {
            key: cache.planner.next_index - self._start[key] for key, cache in self._caches.items()
        }
        with self._log_lock:
            pulled = list(self._log)
            self._log.clear()
            self._put_back_done = True
        # Batches before ``first`` were handed out, or raised their error.
        first, seen = self._log_base, max(planned.values())
        for k in range(max(min(planned.values()), first), seen):
            batch = pulled[k - first]
            try:
                ids = _all_ids(batch, self._caches, self._combiners)
                for key, cache in self._caches.items():
                    if planned[key] <= k:
                        cache.lifecycle.release_all()  # as ``_stage_now`` stages
                        self._apply({key: cache.stage(ids[key], train=self.train)})
            except Exception:  # it fits no table's room: the next pipeline raises it
                seen = k
                break
        self._give_back(pulled[max(seen - first, 0) :])

    def _give_back(self, batches: list[Any]) -> None:
        """Adds ``batches`` to ``unstaged``, and hands them to the next
        pipeline over the source (a batch the source returns after close,
        to a thread that waited in it, comes after those given back then)."""
        if not batches:
            return
        self.unstaged.extend(batches)
        if not self._resumable:
            return
        try:
            _UNSTAGED[self._origin] = [*_UNSTAGED.get(self._origin, []), *batches]
        except TypeError:  # an iterator without weak references
            warnings.warn(
                f"{len(batches)} batch(es) taken from the source were never staged; "
                "a later pipeline over this iterator would skip them. They are in this "
                "pipeline's .unstaged: chain them before the source "
                "(itertools.chain(pipeline.unstaged, source)), or use a generator, whose "
                "unstaged batches the next pipeline over it takes first.",
                RuntimeWarning,
                stacklevel=4,
            )

    def _let_go(self) -> None:
        """Nothing is staged ahead any more: ``prepare`` may plan its tables."""
        for cache in self._caches.values():
            cache.open_pipelines.discard(self)

    def _drain(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Failure):
                self._apply(item.partial)
            elif isinstance(item, _Refused):  # taken back by ``_finish_planned``
                self._defer(item)
            elif not isinstance(item, _End):
                self._apply(item[1])

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _get_delivering(items: queue.Queue[Any]) -> Any:
    """The next of ``items``, waited for; a Ctrl-C held meanwhile
    (``interrupts_held``) is delivered while nothing is taken yet."""
    while True:
        try:
            return items.get(timeout=_POLL_SECONDS)
        except queue.Empty:
            deliver_held_interrupt()


def _take_unstaged(source: Iterator[Any]) -> list[Any]:
    """The batches a closed pipeline left unstaged from ``source``, removed."""
    try:
        return _UNSTAGED.pop(source, [])
    except TypeError:  # an iterator without weak references: none was kept
        return []


def check_lookahead(lookahead: Any) -> None:
    """Raises ``ValueError`` unless ``lookahead`` is an integer >= 0."""
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
        raise ValueError(
            f"lookahead={lookahead!r} must be an integer >= 0 (0 = no background thread)."
        )


def _all_ids(
    batch: Mapping[str, Any],
    caches: Mapping[str, EmbeddingCache],
    combiners: Mapping[str, str | None],
) -> dict[str, Any]:
    """Every table's ids of ``batch``, each checked as far as the host can
    before planning (``EmbeddingCache.check_batch``, and bags for a module
    that pools them): a batch missing a table, or with ids of a wrong type
    or shape, is refused before any table plans it."""
    ids = {key: _ids(batch, key) for key in caches}
    for key, cache in caches.items():
        cache.check_batch(ids[key])
        check_bags(combiners[key], np.shape(ids[key]))
    return ids


def _ids(batch: Mapping[str, Any], key: str) -> Any:
    try:
        return batch[key]
    except (KeyError, TypeError, IndexError):  # IndexError: an array indexed by a name
        raise KeyError(
            f"the batch has no ids under {key!r}; it must be a mapping with that key "
            f"(keys: {sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__})."
        ) from None


def prefetch(
    batches: Iterable[Mapping[str, Any]],
    tables: Mapping[str, CacheHolder],
    *,
    lookahead: int = 2,
    train: bool = True,
    callback: bool = False,
    switch_interval: float | None = SWITCH_INTERVAL,
) -> Prefetcher:
    """Prepares the next ``lookahead`` batches on a host thread while the device trains.

    Args:
      batches: iterable of mappings (e.g. dicts of NumPy arrays).
      tables: batch key -> table holder (``jaxcache.nnx.CachedEmbed`` or
        ``jaxcache.linen.Holder``).
      lookahead: batches staged ahead; ``0`` for the unpipelined path.
      train: the steps update the looked-up rows.
      callback: serve ``CachedEmbed.lookup_ids`` (the host-callback form)
        instead of replacing ids by lookups.
      switch_interval: the interpreter's thread switch interval while the
        producer runs (default 0.5 ms; ``None``: unchanged). See ``Prefetcher``.

    Returns:
      A ``Prefetcher``: iterate it (ideally in a ``with`` block).

    Examples:
      >>> import numpy as np, jaxcache
      >>> cfg = jaxcache.CacheConfig(num_embeddings=1000, features=4, capacity=100)
      >>> embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg))
      >>> batches = ({"ids": np.arange(8).reshape(4, 2) + i} for i in range(5))
      >>> with jaxcache.prefetch(batches, {"ids": embed}, lookahead=2) as pipeline:
      ...     shapes = [embed(batch["ids"]).shape for batch in pipeline]
      >>> shapes[0], len(shapes)
      ((4, 2, 4), 5)
    """
    return Prefetcher(
        batches,
        tables,
        lookahead=lookahead,
        train=train,
        callback=callback,
        switch_interval=switch_interval,
    )


@atexit.register
def _close_open_pipelines() -> None:
    for pipeline in list(_OPEN):
        try:
            pipeline.close()
        except RuntimeError:  # still iterated by a daemon thread, which dies with the process
            pass
