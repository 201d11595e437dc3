"""Which training runs agree bit for bit on this machine's JAX backend.

Trains a small DLRM through ``jaxcache`` several ways on the same batches
and compares the exported rows, optimizer state and losses of each pair:

- the whole table on device, trained twice in one process (does the backend
  repeat itself?);
- a cache under heavy churn (capacity just above one batch's distinct ids)
  against the whole table;
- two caches of different capacities (other slots, other eviction orders);
- a loop fed by ``jaxcache.prefetch(lookahead=2)`` against the unpipelined
  loop, same capacity.

For float32 and bfloat16 rows. Each line prints the rows that differ, the
largest difference and whether every loss is equal. On a CPU every pair is
equal bit for bit. On GPUs XLA's scatter-adds and matrix products may sum in
another order from one program to the next: run it as it is, then with
``XLA_FLAGS=--xla_gpu_deterministic_ops=true`` (and, further,
``--xla_gpu_autotune_level=0``), to see which settings a bit-for-bit
reproducible run needs there (docs/benchmarks.md has the figures).

    python benchmarks/determinism.py          # under a minute on 2 CPU cores
"""

from __future__ import annotations

import argparse
import os
from typing import NamedTuple

import _harness
import _training
import jax
import numpy as np

import jaxcache


class Run(NamedTuple):
    """What one training run ends with."""

    rows: np.ndarray
    state: dict[str, np.ndarray]
    losses: np.ndarray
    evictions: int


STEPS = 15
BATCH = 256


def train(
    data: jaxcache.synthetic.SyntheticCriteo,
    dtype: str,
    capacity: int | None,
    lookahead: int | None,
) -> Run:
    """Rows, optimizer state, losses and evictions after ``STEPS`` steps;
    ``capacity`` None is the whole table on device, ``lookahead`` None
    unpipelined."""
    cfg = jaxcache.CacheConfig(
        data.num_embeddings,
        8,
        capacity or data.num_embeddings,
        policy="lfu",
        optimizer=jaxcache.adagrad(0.1),
        dtype=dtype,
    )
    table = jaxcache.HostTable(cfg, seed=1)
    cache = (
        jaxcache.EmbeddingCache(cfg, table=table)
        if capacity
        else jaxcache.EmbeddingCache.full_table(cfg, table=table)
    )
    embed = jaxcache.nnx.CachedEmbed(cache)
    setup = _training.Setup("determinism", data, features=8, bottom=(32, 8), top=(32,))
    model = _training.make_model(setup, embed, seed=0)
    tx = jaxcache.models.dense_optimizer("adagrad", 0.05)
    _, step = jaxcache.models.make_train_step(model, tx)
    batches = list(data.batches(STEPS))
    if lookahead is None:
        out = [step(b["dense"], embed.prepare(b["sparse"]), b["label"]) for b in batches]
    else:
        with jaxcache.prefetch(batches, {"sparse": embed}, lookahead=lookahead) as pipeline:
            out = [step(b["dense"], b["sparse"], b["label"]) for b in pipeline]
    rows, state = embed.export()
    return Run(rows, state, np.array([float(x) for x in out]), cache.stats.total.evictions)


def compare(name: str, dtype: str, a: Run, b: Run) -> None:
    """One line: rows that differ, the largest difference, equal state and losses."""
    differ = np.any(a.rows != b.rows, axis=1)
    largest = np.abs(a.rows.astype(np.float64) - b.rows.astype(np.float64)).max()
    states = all(np.array_equal(a.state[k], b.state[k]) for k in a.state)
    losses = np.array_equal(a.losses, b.losses)
    print(
        f"{name:<36} {dtype:<9} {int(differ.sum()):>8} {largest:>10.1e} "
        f"{'yes' if states else 'no':>6} {'yes' if losses else 'no':>7}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    flags = os.environ.get("XLA_FLAGS", "")
    print(f"{_harness.machine()}; XLA_FLAGS={flags!r}; {STEPS} steps of {BATCH} samples")
    data = jaxcache.synthetic.SyntheticCriteo(scale=0.002, batch_size=BATCH, seed=0)
    distinct = max(len(np.unique(b["sparse"])) for b in data.batches(STEPS))
    tight, roomy = distinct + 64, 4 * distinct
    print(
        f"{data.num_embeddings:,} rows; at most {distinct:,} distinct ids a batch; "
        f"caches of {tight:,} and {roomy:,} rows"
    )
    head = f"{'runs compared':<36} {'rows':<9} {'rows off':>8} {'max diff':>10}"
    print(f"{head} {'state':>6} {'losses':>7}")
    for dtype in ("float32", "bfloat16"):
        full = train(data, dtype, None, None)
        tight_run = train(data, dtype, tight, None)
        print(f"  ({dtype}: {tight_run.evictions:,} evictions in the cache of {tight:,} rows)")
        compare("full table, twice", dtype, full, train(data, dtype, None, None))
        compare(f"cache of {tight:,} vs full table", dtype, tight_run, full)
        compare(
            f"cache of {tight:,} vs of {roomy:,}", dtype, tight_run, train(data, dtype, roomy, None)
        )
        compare("lookahead 2 vs unpipelined", dtype, train(data, dtype, tight, 2), tight_run)
    print(
        "rows off: rows of the exported table that differ; max diff: largest |difference|; "
        "state, losses: equal bit for bit."
    )
    jax.clear_caches()


if __name__ == "__main__":
    main()
