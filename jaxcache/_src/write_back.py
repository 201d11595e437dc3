"""The write-back ledger: evicted rows from planning until they land in the host table.

A plan that evicts dirty rows registers them (``register``); the swap that
applies the plan on the device reads them out (``dispatched``); a host thread
later copies them into the host table (``land``). Until then the rows'
latest values exist only in that read-out, so a later plan that fetches one
of them again must read it from there, or wait for it to land: ``pending``
says which fetched rows are in that state (invariant 4, ordering).

Two threads may land at once (the pipeline's producer what is ready, the
training loop a deferred fetch's): each claims the plans it writes, in plan
order, and one that needs a plan another claimed waits for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxcache._src import kernels

__all__ = ["WriteBacks"]

# Writes the rows at ``at`` of this process's blocks of a read-out to ``ids``.
# The rows are a device read-out, or host copies of it (the host-callback form).
Writer = Callable[[np.ndarray, np.ndarray, jax.Array | np.ndarray, dict[str, Any]], None]


class WriteBacks:
    """Evicted rows by plan index, from planning until they landed.

    Args:
      write: copies rows of a read-out into the host table:
        ``write(ids, at, rows, opt)``.
      on_wait: called when a landing has to wait for a swap not yet
        dispatched. Neither callable should hold the cache that holds the
        ledger (a cycle would keep read-outs alive until garbage collection).

    Examples:
      >>> import numpy as np
      >>> landed = []
      >>> ledger = WriteBacks(lambda ids, at, rows, opt: landed.append(ids.tolist()))
      >>> ledger.register(0, np.array([7, 9]), np.array([0, 1]))
      >>> ledger.pending(np.array([9, 4]))[0].tolist()  # 9's row waits in plan 0's read-out
      [0, -1]
      >>> ledger.dispatched(0, np.zeros((2, 1)), {})
      >>> ledger.land_all()
      >>> landed, ledger.busy()
      ([[7, 9]], [])
    """

    def __init__(self, write: Writer, on_wait: Callable[[], None] = lambda: None) -> None:
        self._write = write
        self._on_wait = on_wait
        self._lock = threading.Condition()
        self._unlanded: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # index -> (ids, at)
        self._dispatched: dict[int, tuple[Any, dict[str, Any]]] = {}  # index -> read-out
        self._landing: set[int] = set()  # plans a thread is writing back now

    def register(self, index: int, ids: np.ndarray, at: np.ndarray) -> None:
        """Plan ``index`` evicts dirty rows ``ids``, at ``at`` of its read-out."""
        with self._lock:
            self._unlanded[index] = (ids, at)

    def expects(self, index: int) -> bool:
        """Whether plan ``index`` evicted rows that have not landed."""
        with self._lock:
            return index in self._unlanded

    def dispatched(self, index: int, rows: Any, opt: dict[str, Any]) -> None:
        """The swap of plan ``index`` read its evicted rows out into ``rows``, ``opt``."""
        with self._lock:
            if index in self._unlanded:
                self._dispatched[index] = (rows, opt)
                self._lock.notify_all()

    def busy(self) -> list[int]:
        """Plans whose evicted rows have not landed yet, in order."""
        with self._lock:
            return sorted(set(self._unlanded) | set(self._dispatched))

    def unapplied(self) -> list[int]:
        """Plans that evicted rows but whose swap was never dispatched."""
        with self._lock:
            return sorted(i for i in self._unlanded if i not in self._dispatched)

    def drop_unapplied(self) -> None:
        """Forgets the evictions of plans whose swap will never run (their
        batch was lost, and a restore replaces the table)."""
        with self._lock:  # reentrant: ``unapplied`` takes it again
            for index in self.unapplied():
                del self._unlanded[index]
            self._lock.notify_all()

    def ids_of(self, index: int) -> np.ndarray | None:
        """The ids plan ``index`` evicted, while they have not landed."""
        with self._lock:
            entry = self._unlanded.get(index)
        return None if entry is None else entry[0]

    def land_one(self, index: int, rows: np.ndarray, opt: dict[str, np.ndarray]) -> None:
        """Lands plan ``index`` from host copies of its evicted rows, in the
        order they were registered (the host-callback form, which receives
        them in a callback)."""
        with self._lock:
            entry = self._unlanded.get(index)
        if entry is None:
            return
        count = len(entry[0])
        self._write(
            entry[0], np.arange(count), rows[:count], {k: v[:count] for k, v in opt.items()}
        )
        with self._lock:
            del self._unlanded[index]
            self._dispatched.pop(index, None)
            self._lock.notify_all()

    def land_all(self) -> None:
        """Lands every dispatched write-back (blocks until their rows are ready)."""
        self._land(None)

    def land_ready(self) -> None:
        """Lands the dispatched write-backs whose rows are ready now."""
        self._land(np.zeros(0, np.int64))

    def land_for(self, needed: np.ndarray) -> None:
        """Lands those ready and those evicting an id of distinct ``needed``,
        waiting for the latter's swaps if need be."""
        self._land(needed)

    def _land(self, needed: np.ndarray | None) -> None:
        """Lands write-backs: all dispatched ones when ``needed`` is ``None``;
        else those ready now plus those evicting an id in distinct ``needed``.

        A row is read only after its write-back landed: when an earlier plan
        evicted a row this one fetches, this waits until that plan's swap is
        dispatched (the training loop applies plans in order, so it comes).
        """
        with self._lock:
            if needed is None:  # all: wait for those another thread is writing
                must = set(self._landing)
            elif needed.size == 0:  # only those ready
                must = set()
            else:
                wanted = kernels.IdIndex(needed)
                must = {i for i, (ids, _) in self._unlanded.items() if wanted.find(ids)[0].size}

            def unread() -> bool:  # evicted, not read out by a swap yet
                return any(i in self._unlanded and i not in self._dispatched for i in must)

            def missing() -> bool:  # or being landed by another thread (still unlanded)
                return unread() or any(i in self._landing for i in must)

            if unread():
                self._on_wait()
            while missing():
                self._lock.wait()
            claimed = []
            for index, (rows, opt) in sorted(self._dispatched.items()):
                if index in self._landing:
                    continue
                if needed is not None and index not in must:
                    if not (rows.is_ready() and all(v.is_ready() for v in opt.values())):
                        continue
                self._landing.add(index)
                claimed.append((index, self._unlanded[index], rows, opt))
        for index, (ids, at), rows, opt in claimed:
            landed = False
            try:
                self._write(ids, at, rows, opt)
                landed = True
            finally:  # a failed write stays unlanded, to be landed again
                with self._lock:
                    self._landing.discard(index)
                    if landed:
                        del self._unlanded[index], self._dispatched[index]
                    self._lock.notify_all()

    def cancel(self, ids: np.ndarray) -> None:
        """Drops the unlanded write-backs of distinct ``ids``: their rows now
        belong to other ids (a dynamic vocabulary gave them away), so the
        old values must never land over the new ones. Waits for a landing
        under way that holds one of them."""
        if ids.size == 0:
            return
        wanted = kernels.IdIndex(ids)
        with self._lock:

            def holds(index: int) -> bool:
                return wanted.find(self._unlanded[index][0])[0].size > 0

            while any(holds(i) for i in self._landing):
                self._lock.wait()
            for index, (evicted, at) in list(self._unlanded.items()):
                which, _ = wanted.find(evicted)
                if which.size:
                    keep = np.ones(evicted.size, bool)
                    keep[which] = False
                    self._unlanded[index] = (evicted[keep], at[keep])

    def pending(self, ids: np.ndarray, before: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Which of distinct ``ids`` an unlanded write-back holds (only those of
        plans with an index below ``before``, when given).

        Returns:
          ``(plans, read_out)``: for each id, the last plan that evicted it
          (``-1``: none) and the row's position in that plan's read-out.
        """
        plans = np.full(ids.shape, -1, np.int64)
        read_out = np.zeros(ids.shape, np.int64)
        with self._lock:  # a snapshot: entries are replaced (cancel), never changed
            unlanded = sorted(self._unlanded.items())
        if before is not None:
            unlanded = [(index, entry) for index, entry in unlanded if index < before]
        if not unlanded or ids.size == 0:
            return plans, read_out
        wanted = kernels.IdIndex(ids)
        for index, (evicted, at) in unlanded:  # later evictions overwrite
            which, where = wanted.find(evicted)
            plans[where], read_out[where] = index, at[which]
        return plans, read_out

    def sources(self, plans: list[int]) -> dict[int, tuple[Any, dict[str, Any]] | None]:
        """The read-out of each of ``plans`` (``None``: landed meanwhile).

        Raises:
          RuntimeError: one of them was never applied (its swap not dispatched).
        """
        with self._lock:
            sources = {p: self._dispatched.get(p) for p in plans}
            unapplied = [p for p, s in sources.items() if s is None and p in self._unlanded]
        if unapplied:
            raise RuntimeError(
                f"a batch fetches rows that plans {unapplied} evicted, but those plans were "
                "not applied yet; apply staged batches in plan order."
            )
        return sources
