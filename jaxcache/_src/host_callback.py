"""The host-callback form: a step that takes raw ids and asks the host for their slots.

``CachedEmbed.lookup_ids`` runs inside the jitted step: an ordered
``io_callback`` hands the batch's ids to ``HostCallbacks.stage``, which
serves the batch a pipeline staged ahead (``offer``) or stages it on the
spot through the cache's own ``stage_host``, the same path as ``prepare`` and
``prefetch``, with every list padded to one fixed size; the swap runs in the
step, and a second callback lands its evicted rows (``write_back``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxcache._src import threads
from jaxcache._src.host_table import pad_rows, take_rows
from jaxcache._src.lifecycle import Lifecycle
from jaxcache._src.stager import HostStaged, Stager

__all__ = ["HostCallbacks"]

# The refusals below name both entries into this form, and what to use instead.
_FORM = "the host-callback form (lookup_ids of jaxcache.nnx.CachedEmbed or jaxcache.linen)"
_INSTEAD = (
    "pass the step the Lookup that jaxcache.prefetch (without callback=True) or "
    "CachedEmbed.prepare makes"
)


class HostCallbacks:
    """The host side of one cache's host-callback form (``EmbeddingCache.callbacks``).

    Args:
      stager: the cache's stager (plans, routes and gathers the batches).
      lifecycle: the cache's plans (offers, what reached the device).
      platform: the platform of the cache's devices.
      planner: where the cache plans (``"host"`` or ``"device"``).
    """

    def __init__(
        self, stager: Stager, lifecycle: Lifecycle, platform: str, planner: str = "host"
    ) -> None:
        self._stager = stager
        self._lifecycle = lifecycle
        self._platform = platform
        self._planner = planner

    def check(self) -> None:
        """Refuses the host-callback form where the step can hang in it.

        On JAX's CPU backend with one core, XLA runs the step's callbacks on
        its only compute thread, and a callback reading a large argument that
        is not 64-byte aligned waits there for JAX's copy of it, which can
        then never complete: the step waits for the callback, the callback for
        the copy (runs at one core hung; none at two).

        Raises:
          RuntimeError: a CPU backend and fewer than two cores for this
            process, or a cache planned on the device.
        """
        if self._planner != "host":
            raise RuntimeError(
                f"{_FORM} plans each batch on the host inside the step, but this cache plans "
                f'on the device; {_INSTEAD}, or build the cache with planner="host".'
            )
        if self._platform != "cpu":
            return
        cores = threads.cores()
        if cores < 2:
            raise RuntimeError(
                f"{_FORM} needs at least 2 CPU cores on JAX's CPU backend, and this process may "
                f"run on {cores}: with one core XLA runs the step's callbacks on its only compute "
                "thread, and a callback can wait there forever for JAX's copy of its arguments; "
                f"{_INSTEAD}, or let the process use two cores or more."
            )

    def size(self, num_ids: int) -> int:
        """Rows per list for a batch of ``num_ids``
        ids: ``CacheConfig.callback_rows``, or the number of ids."""
        rows = self._stager.config.callback_rows
        return num_ids if rows is None else min(rows, num_ids)

    def per_destination(self, size: int, num_ids: int) -> int:
        """``K`` of a route padded to ``size`` rows, for a batch of ``num_ids``
        ids: a device needs no more rows from one owner than the batch's
        distinct ids or its own ids, so nothing overflows."""
        return self._stager.callback_per_destination(size, num_ids)

    def offer(self, staged: HostStaged) -> None:
        """Queues a batch staged ahead for a step (in plan order)."""
        self._lifecycle.offer(staged)

    def take(self) -> list[HostStaged]:
        """Removes and returns the offered batches no step has consumed."""
        return self._lifecycle.take_offers()

    def stage(self, ids: np.ndarray, *, train: bool = True):
        """Host side of ``CachedEmbed.lookup_ids``, run by ``io_callback`` in the step.

        Serves the batch a pipeline offered (it must be these ids), or stages
        it on the spot, through the same stager as every other form.
        Every list is padded to ``size(ids.size)`` rows so the
        callback has one fixed output shape.

        Returns:
          ``(plan index, requests, overflow, inverse, owner_slots,
          owner_inverse, evict_slots, fetch_slots, fetch_rows, fetch_opt)``
          as NumPy arrays.
        """
        ids = np.asarray(ids)
        size = self.size(ids.size)
        stager, lifecycle = self._stager, self._lifecycle
        host = lifecycle.take_offer()
        if host is not None:
            if host.ids.shape != ids.shape or not np.array_equal(host.ids, ids):
                # Refused before anything changed: the batch waits for its step,
                # or for the pipeline's close, which swaps it in.
                lifecycle.return_offer(host)
                raise RuntimeError(
                    "the step looked up ids that differ from the batch the pipeline prepared; "
                    "pass each step the batch the pipeline yields, in order."
                )
            lifecycle.mark_applied(host.plan.index)
            if host.deferred is not None:
                # Every earlier step's write-back callback ran before this one
                # (ordered callbacks), so the rows are home. Plans made after
                # this batch was released may have evicted them again: their
                # write-backs hold later values and land in later steps.
                late = host.deferred
                pending, _ = stager.ledger.pending(late.ids, before=host.plan.index)
                if (pending >= 0).any():
                    raise RuntimeError(
                        f"batch {host.plan.index} fetches rows an earlier step has not written "
                        "back; run a step for every batch the pipeline yields, in order."
                    )
                assert host.moves is not None
                with stager.stats.timers.time("gather"):
                    stager.table.gather_into(late.ids, *host.moves[2:], late.at)
        else:
            lifecycle.release_all()
            host = stager.stage(ids, train=train, size=size)
            lifecycle.mark_applied(host.plan.index)
        return (np.int32(host.plan.index), *host.route[:5], *self._global_moves(host, size))

    def _global_moves(self, host: HostStaged, size: int) -> tuple[Any, ...]:
        """``host.moves`` as global slot lists padded to ``size``, for ``swap``
        (the host-callback form: one process, one fixed shape)."""
        stager = self._stager
        cfg, cl, layout = stager.config, stager.local_capacity, stager.layout
        shapes = cfg.optimizer.state_spec(cfg.features)
        if host.moves is None:
            empty = np.zeros(0, np.int64)
            evict, fetch, at = empty, empty, empty
            rows = np.zeros((0, cfg.features), cfg.row_dtype)
            opt = {k: np.zeros((0, *spec.shape), spec.dtype) for k, spec in shapes.items()}
        else:
            evict_blocks, fetch_blocks, rows, opt = host.moves
            per = evict_blocks.size // layout.per_process
            offset = (layout.own[0] + np.arange(evict_blocks.size) // per) * cl
            evict = (evict_blocks + offset)[evict_blocks < cl]
            at = np.flatnonzero(fetch_blocks < cl)
            fetch = (fetch_blocks + offset)[at]
        return (
            pad_rows(evict.astype(np.int32), size, cfg.capacity),
            pad_rows(fetch.astype(np.int32), size, cfg.capacity),
            pad_rows(take_rows(rows, at), size, 0),
            {k: pad_rows(take_rows(v, at), size, 0) for k, v in opt.items()},
        )

    def write_back(self, index: np.ndarray, rows: np.ndarray, opt: dict) -> None:
        """Lands the rows evicted by plan ``index`` (run by ``io_callback`` in the step)."""
        self._stager.ledger.land_one(
            int(index), np.asarray(rows), {k: np.asarray(v) for k, v in opt.items()}
        )
