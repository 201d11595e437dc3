"""Ctrl-C at random moments of a training loop: the loop goes on exactly, or refuses.

A tiny cache under heavy churn trains on 60 batches with sparse SGD
(learning rate 1) of ``sum(rows)``: each touched row falls by its count in
the batch, exactly in float32, so the rows say which batches trained. A
timer sends SIGINT to the main thread at a random moment of the run (up to
the time an uninterrupted run takes). After the ``KeyboardInterrupt``, the
exported table must equal the batches whose steps completed (the step of
the batch being prepared or handed out when it came may not have run), and
training the remaining batches must end where an uninterrupted run ends.

Each trial ends as one of: ``exact`` (both held), ``refused`` (the cache
raised an error saying it needs a restore), ``wrong`` (rows differ: silent
corruption), or ``finished`` (the signal came after the run ended; not
counted). Settings: unpipelined ``prepare`` and ``jaxcache.prefetch`` with
look-ahead 0 and 2, each planner.

    python benchmarks/interrupts.py               # a few minutes on 2 CPU cores
    python benchmarks/interrupts.py --trials 5
"""

from __future__ import annotations

import argparse
import collections
import signal
import threading
import time

import _harness
import numpy as np
from flax import nnx

import jaxcache

N, D, CAPACITY, STEPS = 400, 4, 64, 60


@nnx.jit
def step(embed, lookup):
    return jaxcache.nnx.value_and_grad(lambda e, lookup: e(lookup).sum())(embed, lookup)


def expected(first: np.ndarray, batches: list[np.ndarray]) -> np.ndarray:
    rows = first.copy()
    for batch in batches:
        ids, counts = np.unique(batch, return_counts=True)
        rows[ids] -= counts.astype(rows.dtype)[:, None]  # one update per batch, as on device
    return rows


def train(embed, batches: list[np.ndarray], mode: str, done: list[int]) -> None:
    if mode == "prepare":
        for ids in batches:
            step(embed, embed.prepare(ids))
            done.append(1)
        return
    source = [{"ids": ids} for ids in batches]
    with jaxcache.prefetch(source, {"ids": embed}, lookahead=int(mode)) as pipeline:
        for batch in pipeline:
            step(embed, batch["ids"])
            done.append(1)


def trial(
    planner: str, mode: str, batches: list[np.ndarray], delay: float | None
) -> tuple[str, float]:
    """One run, interrupted after ``delay`` seconds (``None``: not at all):
    how it ended, and the seconds its training took up to the end or the
    interrupt."""
    cfg = jaxcache.CacheConfig(N, D, capacity=CAPACITY, policy="lru", optimizer=jaxcache.sgd(1.0))
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg, planner=planner))
    first = np.array(embed.cache.table.rows)
    train(embed, batches[:2], mode, [])  # compiled before the clock starts
    done: list[int] = []
    main = threading.main_thread().ident
    assert main is not None
    timer = threading.Timer(delay or 0.0, signal.pthread_kill, (main, signal.SIGINT))
    start = time.perf_counter()
    try:
        if delay is not None:
            timer.start()
        train(embed, batches[2:], mode, done)
        timer.cancel()
        if delay is not None:
            timer.join()
        return "finished", time.perf_counter() - start
    except KeyboardInterrupt:
        timer.join()
    seconds = time.perf_counter() - start
    trained = 2 + len(done)
    try:
        rows, _ = embed.export()
        match = [
            k for k in (trained, trained + 1) if np.array_equal(rows, expected(first, batches[:k]))
        ]
        if not match:
            return "wrong", seconds
        train(embed, batches[match[0] :], mode, [])
        rows, _ = embed.export()
    except (RuntimeError, ValueError):
        return "refused", seconds
    return ("exact" if np.array_equal(rows, expected(first, batches)) else "wrong"), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="trials per setting")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(_harness.machine())
    rng = np.random.default_rng(args.seed)
    batches = [rng.integers(0, N, (16, 3)) for _ in range(STEPS)]
    totals: collections.Counter[str] = collections.Counter()
    for planner in ("host", "device"):
        for mode in ("prepare", "0", "2"):
            _, run = trial(planner, mode, batches, None)
            outcomes = collections.Counter(
                trial(planner, mode, batches, float(rng.uniform(0.0, run)))[0]
                for _ in range(args.trials)
            )
            totals.update(outcomes)
            setting = "prepare" if mode == "prepare" else f"prefetch, look-ahead {mode}"
            print(f"{planner} planner, {setting}: {dict(sorted(outcomes.items()))}")
    interrupted = totals["exact"] + totals["refused"] + totals["wrong"]
    _harness.print_results(
        {
            "interrupted_trials": interrupted,
            "interrupted_exact_share": totals["exact"] / max(1, interrupted),
            "interrupted_wrong": totals["wrong"],
        }
    )


if __name__ == "__main__":
    main()
