"""Checkpoint cost for a large memory-mapped table: time and extra host memory.

Builds a ``HostTable`` memory-mapped in ``--dir`` (by default 32M rows x 16
float32 plus a row-wise Adagrad accumulator: 2.1 GiB), trains a few steps
through an LFU cache so rows are dirty and the planner has state, then times
``Checkpointer.save`` and ``Checkpointer.restore`` (into a second
memory-mapped table) while a thread samples ``/proc/self/status``:

* ``RssAnon``: anonymous memory, what a copy of the table would add;
* ``VmRSS``: everything resident, file pages mapped into the process
  included (they belong to the page cache and are reclaimable);
* ``VmHWM``: the kernel's peak of ``VmRSS``, reset before each phase.

Figures are printed as ratios to the table's size. For comparison, the same
arrays are also saved the usual way, with orbax's ``StandardSave``
(``--no-baseline`` skips it).

    python benchmarks/checkpoint.py                     # 2.1 GiB table
    python benchmarks/checkpoint.py --rows 4000000      # a quick run
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

import jaxcache

_FIELDS = ("RssAnon", "VmRSS", "VmHWM")


def memory() -> dict[str, int]:
    """``RssAnon``, ``VmRSS`` and ``VmHWM`` of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in _FIELDS:
                out[key] = int(value.split()[0]) * 1024
    return out


def measure(fn: Callable[[], object]) -> dict[str, float]:
    """Runs ``fn``; its seconds and the peak growth of each memory figure, in bytes."""
    try:  # resets VmHWM to the current VmRSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    before = memory()
    peak = dict(before)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for key, value in memory().items():
                peak[key] = max(peak[key], value)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    for key, value in memory().items():
        peak[key] = max(peak[key], value)
    return {"seconds": seconds, **{k: peak[k] - before[k] for k in _FIELDS}}


@nnx.jit
def _step(embed, lookup):
    def loss_fn(embed, lookup):
        return (embed(lookup) ** 2).sum() * 1e-3

    jaxcache.nnx.value_and_grad(loss_fn)(embed, lookup)


def build(directory: str, rows: int, features: int, capacity: int, seed: int):
    config = jaxcache.CacheConfig(
        rows, features, capacity=capacity, policy="lfu", optimizer=jaxcache.rowwise_adagrad(0.1)
    )
    table = jaxcache.HostTable(
        config, directory=directory, init=jaxcache.host.uniform_init(0.05), seed=seed
    )
    return jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(config, table=table))


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32 * 2**20)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--capacity", type=int, default=65536)
    parser.add_argument("--steps", type=int, default=20, help="training steps before saving")
    parser.add_argument("--dir", help="scratch directory (default: a new one in /tmp)")
    parser.add_argument("--no-fsync", action="store_true", help="do not fsync the files")
    parser.add_argument("--no-baseline", action="store_true", help="skip orbax StandardSave")
    args = parser.parse_args(argv)
    scratch = args.dir or tempfile.mkdtemp(prefix="jaxcache-ckpt-bench-")
    try:
        return run(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run(args: argparse.Namespace, scratch: str) -> dict[str, dict[str, float]]:
    start = time.perf_counter()
    embed = build(os.path.join(scratch, "table"), args.rows, args.features, args.capacity, 0)
    table = embed.cache.table
    size = table.rows.nbytes + sum(a.nbytes for a in table.state.values())
    rng = np.random.default_rng(0)
    for _ in range(args.steps):
        _step(embed, embed.prepare(rng.integers(0, args.rows, (4096,))))
    print(
        f"table: {args.rows:,} rows x {args.features} float32 + row-wise Adagrad state = "
        f"{size / 2**30:.2f} GiB, memory-mapped in {scratch}; {args.steps} steps through a "
        f"{args.capacity:,}-row LFU cache (set up in {time.perf_counter() - start:.0f} s)"
    )
    checkpointer = jaxcache.Checkpointer(
        os.path.join(scratch, "ckpt"), fsync=not args.no_fsync, max_to_keep=1
    )
    results = {"save": measure(lambda: checkpointer.save(1, caches=[embed]))}
    target = build(os.path.join(scratch, "restored"), args.rows, args.features, args.capacity, 1)
    # The cache's own arrays (the LFU counts: 8 bytes per row) are paged in
    # before measuring, as in a cache that has trained: restore fills them.
    target.cache.planner.planners[0].policy.counts.fill(0)
    results["restore"] = measure(lambda: checkpointer.restore(caches=[target]))
    restored = target.cache.table
    pairs = [
        (table.rows, restored.rows),
        *((table.state[k], restored.state[k]) for k in table.state),
    ]
    chunk = 1 << 22
    same = all(
        np.array_equal(a[lo : lo + chunk], b[lo : lo + chunk])
        for a, b in pairs
        for lo in range(0, args.rows, chunk)
    )
    if not args.no_baseline:
        arrays = {"rows": table.rows, **table.state}
        manager = ocp.CheckpointManager(
            os.path.join(scratch, "orbax"),
            options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False),
        )

        def orbax_save() -> None:
            manager.save(1, args=ocp.args.Composite(table=ocp.args.StandardSave(arrays)))

        results["orbax StandardSave (baseline)"] = measure(orbax_save)
        manager.close()
    header = (
        f"{'':<31} {'seconds':>8} {'GiB/s':>6} {'extra RssAnon':>14} {'extra VmRSS':>12} "
        f"{'VmHWM growth':>13}"
    )
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        print(
            f"{name:<31} {r['seconds']:>8.2f} {size / 2**30 / r['seconds']:>6.2f} "
            f"{r['RssAnon'] / size:>13.1%} {r['VmRSS'] / size:>12.1%} {r['VmHWM'] / size:>13.1%}"
        )
    print(
        "(extra memory as a share of the table's size; the restored table equals the saved "
        f"one: {same}; fsync {'off' if args.no_fsync else 'on'})"
    )
    return results


if __name__ == "__main__":
    main()
