"""Where each plan of a cache stands: planned, offered, applied, released, landed.

A plan is made by the stager, may be offered to a host-callback step, is
applied when its swap reaches the device, is released when its step has
been dispatched (its rows may be evicted again), and its evicted rows land
in the host table later (the write-back ledger). ``Lifecycle`` answers the
questions callers ask of that: release everything, what is in flight, and
refuse an action unless the cache is idle.

A Ctrl-C between a plan and its swap would leave rows that the planner
counts on the device which never reached it: ``interrupts_held`` keeps it
out of that span, so that an interrupted training loop can go on, or be
saved, without a restore.
"""

from __future__ import annotations

import collections
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

from jaxcache._src.device_ops import Lookup
from jaxcache._src.device_planner import DevicePlanner
from jaxcache._src.partitions import Partitions
from jaxcache._src.stager import HostStaged
from jaxcache._src.write_back import WriteBacks

__all__ = ["Lifecycle", "deliver_held_interrupt", "interrupts_held"]


class Lifecycle:
    """The plans of one cache, from planning until their rows are home.

    Args:
      partitions: the planners (which plans were made and released).
      write_backs: the ledger (which evicted rows have not landed).

    Examples:
      >>> import numpy as np, jaxcache
      >>> cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, capacity=8))
      >>> host = cache.stage_host(np.array([1, 2]))
      >>> cache.lifecycle.in_flight(), cache.lifecycle.unapplied()
      (range(0, 1), range(0, 1))
      >>> cache.lifecycle.release_all()
      >>> cache.lifecycle.in_flight()
      range(1, 1)
    """

    def __init__(self, partitions: Partitions | DevicePlanner, write_backs: WriteBacks) -> None:
        self.partitions = partitions
        self.write_backs = write_backs
        self.applied = -1  # the last plan whose rows reached the device
        # Bumped when a restore replaces the device state: every lookup
        # made before it is stale, whatever the plan indices say.
        self.epoch = 0
        self._offers: collections.deque[HostStaged] = collections.deque()
        self._offer_lock = threading.Lock()

    @property
    def next_index(self) -> int:
        """Index the next plan gets."""
        return self.partitions.next_index

    def release(self, index: int) -> None:
        """Plans up to ``index`` are finished: their rows may be evicted."""
        self.partitions.release(index)

    def release_all(self) -> None:
        """Every plan made so far is finished (its step has been dispatched)."""
        self.partitions.release_all()

    def in_flight(self) -> range:
        """Plans made and not released."""
        return self.partitions.in_flight

    def mark_applied(self, index: int) -> None:
        """Plan ``index``'s rows reached the device."""
        self.applied = max(self.applied, int(index))

    def restored(self) -> None:
        """A checkpoint put every planned row on the device: all applied."""
        self.applied = self.next_index - 1
        self.epoch += 1

    def guard(self, lookup: Lookup, index: int, table: str) -> Lookup:
        """Ties ``lookup``, the route of plan ``index``, to this cache: from
        the next plan applied (or a restore) on, using it raises."""
        epoch = self.epoch

        def check() -> None:
            if self.applied > index or self.epoch != epoch:
                since = "a restore" if self.epoch != epoch else f"plan {self.applied}"
                raise ValueError(
                    f"this Lookup of table {table!r} (plan {index}) is stale: {since} has been "
                    "applied since, and may have given its slots to other rows. A Lookup "
                    "serves the step after its prepare; prepare each batch just before its "
                    "step, or look ahead with jaxcache.prefetch."
                )

        object.__setattr__(lookup, "_guard", check)
        return lookup

    def unapplied(self) -> range:
        """Plans made whose rows have not reached the device yet."""
        return range(self.applied + 1, self.next_index)

    def stale(self) -> bool:
        """Whether rows changed on device that the host table does not hold:
        dirty rows of finished plans, unlanded write-backs or unapplied plans."""
        return self.partitions.stale() or bool(self.write_backs.busy()) or bool(self.unapplied())

    # ------------------------------------------------------------------ offers
    def offer(self, staged: HostStaged) -> None:
        """Queues a batch staged ahead for a host-callback step (in plan order)."""
        with self._offer_lock:
            self._offers.append(staged)

    def take_offer(self) -> HostStaged | None:
        """The oldest offered batch, or ``None``."""
        with self._offer_lock:
            return self._offers.popleft() if self._offers else None

    def return_offer(self, staged: HostStaged) -> None:
        """Puts back the oldest offered batch, taken by a step that was refused."""
        with self._offer_lock:
            self._offers.appendleft(staged)

    def take_offers(self) -> list[HostStaged]:
        """Removes and returns every offered batch no step has consumed."""
        with self._offer_lock:
            offers = list(self._offers)
            self._offers.clear()
        return offers

    def offered(self) -> int:
        """Batches offered that no step has consumed."""
        with self._offer_lock:
            return len(self._offers)

    # -------------------------------------------------------------------- idle
    def check_idle(self, action: str) -> None:
        """Refuses ``action`` while write-backs or offered batches are pending.

        Raises:
          RuntimeError: something is in flight; the message names it.
        """
        busy = self.write_backs.busy()
        offered = self.offered()
        if busy or offered:
            raise RuntimeError(
                f"batches are in flight (plans {busy}, {offered} offered); close the pipeline "
                f"and call flush(state) before {action}."
            )


class _Held:
    """A SIGINT handler that holds the signal for ``previous`` (the handler
    it replaced) until ``deliver``; a second signal meanwhile goes through
    at once, so that a step that hangs can still be stopped."""

    def __init__(self, previous: Callable[[int, FrameType | None], object]) -> None:
        self.previous = previous
        self.pending: tuple[int, FrameType | None] | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.pending is None:
            self.pending = (signum, frame)
            return
        self.pending = None
        self.previous(signum, frame)

    def deliver(self) -> None:
        if self.pending is not None:
            signum, frame = self.pending
            self.pending = None
            self.previous(signum, frame)


# The handler installed by the outermost ``interrupts_held`` of the main thread.
_HELD: list[_Held] = []


def deliver_held_interrupt() -> None:
    """Delivers a Ctrl-C that ``interrupts_held`` holds back, now. Called
    where a held block only waits, with nothing half done, so that a
    Ctrl-C does not wait for, say, a slow data source."""
    if _HELD and threading.current_thread() is threading.main_thread():
        _HELD[-1].deliver()


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Holds a Ctrl-C (SIGINT) back until the block ends, then delivers it.

    Wraps the span from a batch's plan to its swap on the thread that runs
    it: interrupted in between, the planner would count rows on the device
    that never reached it, and the cache would stop until a restore. Held
    only on the main thread (the one Python delivers signals to) and only
    for a handler set in Python (the default raises ``KeyboardInterrupt``);
    a second Ctrl-C while one is held goes through at once. Nested blocks
    share the outermost one's (``deliver_held_interrupt`` delivers it early).
    """
    if _HELD or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # ignored, the OS default, or set outside Python
        yield
        return
    held = _Held(previous)
    signal.signal(signal.SIGINT, held)
    _HELD.append(held)
    try:
        yield
    finally:
        _HELD.pop()
        signal.signal(signal.SIGINT, previous)
        held.deliver()
