"""Replay of an id trace through the device cache and a DRAM tier below it.

Sizing the DRAM budget of a ``TieredTable``: the trace is planned batch by
batch as in :func:`jaxcache.replay`, and the rows each plan fetches and
writes back go through the real DRAM tier (``DramTier``, the same
replacement code, with records of no bytes) over a disk that only counts.
The order is that of a training loop that lands each step's write-backs
before planning the next batch: fetch the plan's misses, then write back
its dirty evictions. A pipelined loop lands them a little later, so its
figures can differ slightly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxcache._src import replay as replay_lib
from jaxcache._src.config import CacheConfig
from jaxcache._src.dram_tier import SLOT_BYTES, DramTier, fields
from jaxcache._src.frequency import hottest
from jaxcache._src.host_table import _INIT_CHUNK_ROWS
from jaxcache._src.planner import CapacityError, Planner
from jaxcache._src.tiered_table import INDEX_BYTES_PER_ROW
from jaxcache._src.validation import is_int

__all__ = ["replay_dram_tier"]


class _CountingDisk:
    """A disk tier that stores nothing and counts the rows moved."""

    def __init__(self) -> None:
        self.rows_read = 0
        self.rows_written = 0

    def reserve(self, owners: np.ndarray, records: np.ndarray) -> None:
        self.rows_written += len(owners)

    def write(self, ticket: object) -> None:
        pass

    def write_unwritten(self) -> None:
        pass

    def forget(self, owners: np.ndarray) -> None:
        pass

    def read(self, owners: np.ndarray, out: np.ndarray) -> None:
        self.rows_read += len(owners)

    def collect(self) -> None:
        pass


def replay_dram_tier(
    trace: np.ndarray,
    *,
    capacity: int | float,
    dram_budget: int,
    row_bytes: int,
    policy: str = "lfu",
    batch: int | None = None,
    num_embeddings: int | None = None,
    frequencies: np.ndarray | None = None,
    shards: int = 16,
    padding_id: int | None = None,
) -> dict[str, Any]:
    """Plans every batch of ``trace`` and runs its row traffic through a DRAM tier.

    Args:
      trace, capacity, policy, batch, num_embeddings, frequencies, padding_id:
        as in :func:`jaxcache.replay`.
      dram_budget: bytes of the ``TieredTable``'s budget (its index, 12 bytes
        a row, and the rows it keeps in memory).
      row_bytes: bytes of one row with its optimizer state (``D * 4 + 4``
        for float32 rows and row-wise Adagrad; ``TieredTable.record_bytes``).
      shards: the table's ``shards``.

    Returns:
      A JSON-ready dict: ``dram_budget``, ``row_bytes``, ``dram_rows`` (rows
      the tier holds), ``dram_lookups`` (rows fetched from the host table),
      ``dram_hits``, ``dram_hit_rate``, ``dram_steady_hit_rate`` (over the
      batches after the first quarter), ``disk_rows_read``,
      ``disk_rows_written`` (dirty rows evicted to the disk) and their bytes.

    Raises:
      ValueError: a bad argument, or a budget too small for the index.

    Examples:
      >>> import numpy as np
      >>> from jaxcache.sizing import replay_dram_tier
      >>> trace = np.random.default_rng(0).zipf(1.2, size=(40, 64)) % 2000
      >>> out = replay_dram_tier(trace, capacity=200, dram_budget=12 * 2000 + 500 * 100,
      ...                        row_bytes=100, policy="lru", num_embeddings=2000)
      >>> out["dram_rows"], out["dram_lookups"] > out["dram_hits"] > 0
      (416, True)
    """
    batches, ids = replay_lib._read_trace(trace, batch, padding_id)
    n = replay_lib._table_size(ids, num_embeddings, frequencies)
    frequencies = replay_lib._check_frequencies(frequencies, n)
    policy = replay_lib._check_policies([policy])[0]
    if policy == "belady":
        raise ValueError(
            "the DRAM tier is replayed behind a cache policy, and belady is an offline "
            "ceiling, not one; leave belady out of --policy when giving --dram-budget."
        )
    capacity = replay_lib._resolve_capacity(capacity, n)
    for name, value in (("dram_budget", dram_budget), ("row_bytes", row_bytes)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive number of bytes.")
    slots = min(n, (int(dram_budget) - INDEX_BYTES_PER_ROW * n) // (int(row_bytes) + SLOT_BYTES))
    if slots < 1:
        raise ValueError(
            f"dram_budget={dram_budget:,} does not hold the index of {n:,} rows "
            f"({INDEX_BYTES_PER_ROW * n:,} bytes) and one row of {row_bytes} bytes (and "
            f"{SLOT_BYTES} for its slot)."
        )
    disk = _CountingDisk()
    tier = DramTier(n, slots, 0, disk, shards=shards, batch_for=int(row_bytes))
    for lo in range(0, n if tier.slots >= n else 0, _INIT_CHUNK_ROWS):  # as TieredTable
        rows = np.arange(lo, min(lo + _INIT_CHUNK_ROWS, n), dtype=np.int64)
        tier.fill(rows, np.empty((rows.size, 0), np.uint8))
    counts = frequencies
    if counts is None and policy == "frequency":
        counts = np.bincount(ids, minlength=n)
    config = CacheConfig(num_embeddings=n, features=1, capacity=capacity, policy=policy)
    prior = counts if policy == "frequency" else frequencies
    planner = Planner(config, frequencies=prior)
    nothing = fields([], np.empty(0, np.int64))

    def fetch(ids: np.ndarray, keep: bool) -> None:
        tier.read(ids.astype(np.int64), np.zeros(ids.size, np.int64), nothing, keep=keep)

    if planner.policy.warms:  # warmed, then read by the cache's first device state
        assert prior is not None, "a policy warms only from dataset counts"
        planner.warm(hottest(prior, capacity))
        fetch(planner.id_of_slot[planner.id_of_slot >= 0], keep=False)
    steady_from = len(batches) // 4
    steady = tier.stats()
    for step, ids in enumerate(batches):
        if step == steady_from:
            steady = tier.stats()
        try:
            plan = planner.plan(ids, train=True)
        except CapacityError as error:
            raise CapacityError(f"batch {step} of the trace: {error}") from None
        planner.release(plan.index)
        fetch(plan.fetch_ids, keep=True)
        evicted = plan.evict_ids.astype(np.int64)
        tier.write(evicted, np.zeros(evicted.size, np.int64), nothing)
    stats = tier.stats()
    steady_lookups = stats.lookups - steady.lookups
    return {
        "dram_budget": int(dram_budget),
        "row_bytes": int(row_bytes),
        "dram_rows": tier.slots,
        "dram_lookups": stats.lookups,
        "dram_hits": stats.hits,
        "dram_hit_rate": stats.hit_rate,
        "dram_steady_hit_rate": (stats.hits - steady.hits) / steady_lookups
        if steady_lookups
        else 0.0,
        "disk_rows_read": disk.rows_read,
        "disk_rows_written": disk.rows_written,
        "disk_bytes_read": disk.rows_read * int(row_bytes),
        "disk_bytes_written": disk.rows_written * int(row_bytes),
    }
