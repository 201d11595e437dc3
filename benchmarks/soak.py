"""Soak: many steps of a tiny cache under heavy churn; memory stays flat, nothing is lost.

Each step looks up a batch of ids, half from a small hot set and half drawn
uniformly from a table many times larger than the cache, so most rows are
fetched, updated, evicted dirty, written back and fetched again. The update
is sparse SGD (learning rate 1) of ``weight * sum(rows)`` with a small integer
``weight``: each touched row falls by ``weight`` times its count, exactly in
float32, so a NumPy replay of the ids is an exact reference. Batches go
through ``jaxcache.prefetch``; every ``--check-every`` steps the pipeline
segment ends and the soak checks:

* the planner's invariants (``jaxcache.testing.check_invariants``) and that the
  device rows of resident ids equal the host table's;
* that no dirty row was lost: after ``flush`` the host table equals the
  replay, bit for bit;
* memory: the resident set size (``/proc/self/statm``) and JAX's live arrays
  (count and bytes).

    python benchmarks/soak.py                         # 100,000 steps
    python benchmarks/soak.py --steps 5000 --check-every 500
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Iterator

import jax
import numpy as np
from flax import nnx

import jaxcache


@dataclasses.dataclass(frozen=True)
class Soak:
    """A soak run's shape: the table, the cache and the stream of ids."""

    num_embeddings: int = 4096
    features: int = 8
    capacity: int = 256
    batch_size: int = 64
    hot_ids: int = 64
    policy: str = "lru"
    lookahead: int = 2
    seed: int = 0

    def batch(self, index: int) -> dict[str, np.ndarray]:
        """Step ``index``'s ids ``int64 [B]`` and its integer weight."""
        rng = np.random.default_rng([self.seed, index])
        half = self.batch_size // 2
        ids = np.concatenate(
            [
                rng.integers(0, self.hot_ids, half),
                rng.integers(0, self.num_embeddings, self.batch_size - half),
            ]
        )
        return {"ids": ids, "weight": np.float32(1 + index % 3)}

    def batches(self, start: int, count: int) -> Iterator[dict[str, np.ndarray]]:
        for index in range(start, start + count):
            yield self.batch(index)


@nnx.jit
def _step(embed: jaxcache.nnx.CachedEmbed, lookup: jaxcache.Lookup, weight: jax.Array) -> None:
    def loss_fn(embed, lookup):
        return embed(lookup).sum() * weight

    jaxcache.nnx.value_and_grad(loss_fn)(embed, lookup)


def rss_mib() -> float:
    """Resident set size of this process, MiB (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def live_arrays() -> tuple[int, float]:
    """JAX arrays alive in this process: ``(count, MiB)``."""
    arrays = jax.live_arrays()
    return len(arrays), sum(a.nbytes for a in arrays) / 2**20


def check(embed: jaxcache.nnx.CachedEmbed, replay: np.ndarray) -> None:
    """Flushes, then checks the invariants and the table against the replay."""
    cache = embed.cache
    embed.flush()
    jaxcache.testing.check_invariants(cache)
    rows = cache.table.rows
    expected = np.broadcast_to(replay[:, None], rows.shape)
    if not np.array_equal(rows, expected):
        bad = int(np.flatnonzero((rows != expected).any(axis=1))[0])
        raise AssertionError(
            f"row {bad} lost an update: the host table has {rows[bad, 0]}, the replay "
            f"{replay[bad]}."
        )
    planner = cache.planner
    slots = np.flatnonzero(planner.id_of_slot >= 0)
    device = np.asarray(embed.rows[...])[slots]
    if not np.array_equal(device, rows[planner.id_of_slot[slots]]):
        raise AssertionError("a resident row differs between the device and the host table.")


def run(soak: Soak, steps: int, check_every: int, *, report=None) -> list[dict[str, float]]:
    """Trains ``steps`` steps, checking every ``check_every``; returns the samples.

    Args:
      soak: the run's shape.
      steps: steps in all.
      check_every: steps per pipeline segment, checked at its end.
      report: called with each sample as it is taken (e.g. to print it).

    Returns:
      One dict per check: ``step``, ``steps_per_s``, ``hit_rate``,
      ``evictions``, ``rss_mib``, ``live_arrays``, ``live_mib``.
    """
    config = jaxcache.CacheConfig(
        soak.num_embeddings,
        soak.features,
        capacity=soak.capacity,
        policy=soak.policy,
        optimizer=jaxcache.sgd(1.0),
    )
    zeros = np.zeros((soak.num_embeddings, soak.features), np.float32)
    table = jaxcache.HostTable(config, rows=zeros)
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(config, table=table))
    replay = np.zeros(soak.num_embeddings, np.float32)
    samples = []
    start, last = time.perf_counter(), 0
    for first in range(0, steps, check_every):
        count = min(check_every, steps - first)
        source = soak.batches(first, count)
        with jaxcache.prefetch(source, {"ids": embed}, lookahead=soak.lookahead) as pipeline:
            for batch in pipeline:
                _step(embed, batch["ids"], batch["weight"])
        for index in range(first, first + count):
            batch = soak.batch(index)
            np.subtract.at(replay, batch["ids"], batch["weight"])
        check(embed, replay)
        now = time.perf_counter()
        stats = embed.cache.stats.total
        count_arrays, live_mib = live_arrays()
        sample = {
            "step": first + count,
            "steps_per_s": (first + count - last) / (now - start),
            "hit_rate": stats.hit_rate,
            "evictions": stats.evictions,
            "rows_to_host": stats.rows_to_host,
            "rss_mib": rss_mib(),
            "live_arrays": count_arrays,
            "live_mib": live_mib,
        }
        samples.append(sample)
        if report is not None:
            report(sample)
        start, last = now, first + count
    return samples


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--check-every", type=int, default=5_000)
    parser.add_argument("--capacity", type=int, default=Soak.capacity)
    parser.add_argument("--lookahead", type=int, default=Soak.lookahead)
    parser.add_argument("--policy", choices=jaxcache.planning.POLICIES[1:], default=Soak.policy)
    args = parser.parse_args(argv)
    soak = Soak(capacity=args.capacity, lookahead=args.lookahead, policy=args.policy)
    print(
        f"soak: {args.steps:,} steps, {soak.batch_size} ids a step from "
        f"{soak.num_embeddings:,} rows through a cache of {soak.capacity} ({soak.policy}, "
        f"look-ahead {soak.lookahead}); checks every {args.check_every:,} steps"
    )
    header = (
        f"{'step':>9} {'steps/s':>8} {'hit rate':>8} {'evictions':>10} {'written back':>12} "
        f"{'RSS MiB':>8} {'live arrays':>11} {'live MiB':>8}  invariants"
    )
    print(header)
    print("-" * len(header))

    def report(s: dict[str, float]) -> None:
        print(
            f"{s['step']:>9,} {s['steps_per_s']:>8.0f} {s['hit_rate']:>8.3f} "
            f"{s['evictions']:>10,} {s['rows_to_host']:>12,} {s['rss_mib']:>8.1f} "
            f"{s['live_arrays']:>11} {s['live_mib']:>8.3f}  ok",
            flush=True,
        )

    try:
        samples = run(soak, args.steps, args.check_every, report=report)
    except AssertionError as error:
        print(f"FAILED: {error}")
        sys.exit(1)
    first, last = samples[0], samples[-1]
    print(
        f"RSS {first['rss_mib']:.1f} -> {last['rss_mib']:.1f} MiB and live arrays "
        f"{first['live_arrays']} -> {last['live_arrays']} from the first check to the last; "
        "every check found the table equal to the replay."
    )
    return samples


if __name__ == "__main__":
    main()
