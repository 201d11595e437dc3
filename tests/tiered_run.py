"""Training runs through a ``TieredTable`` in a process of their own, for the tests.

``train``: a ``Tower`` over a small DRAM tier, with a checkpoint every
``--every`` steps; started again on the same directories it restores the
latest checkpoint. ``--kill-after K`` kills the process (SIGKILL) right after
step ``K``, between checkpoints; ``--dump`` writes the final state.

``memory``: the peak resident memory of training through a table whose file
is ``--times`` times its DRAM budget, printed as JSON.

    python -m tests.tiered_run train --table-dir T --checkpoint-dir C --dump out.npz
    python -m tests.tiered_run memory --table-dir T
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time

import jax
import numpy as np
import optax
from flax import nnx

import jaxcache
from tests.models import Tower, bce, zipf_batches

N, D, B, F = 4000, 8, 32, 4


@nnx.jit
def _step(model, optimizer, lookup, labels):
    def loss_fn(model, lookup):
        return bce(model(lookup), labels)

    loss, grads = jaxcache.nnx.value_and_grad(loss_fn)(model, lookup)
    optimizer.update(model, grads)
    return loss


def _model(table, config, features):
    cache = jaxcache.EmbeddingCache(config, table=table)
    model = Tower(jaxcache.nnx.CachedEmbed(cache), features, config.features, seed=0)
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def train(args: argparse.Namespace) -> None:
    config = jaxcache.CacheConfig(N, D, capacity=130, policy="lru", optimizer=jaxcache.adam(0.02))
    record = D * 4 + 2 * D * 4 + 4  # rows, two moments, a count
    budget = 12 * N + args.dram_rows * record
    table = jaxcache.TieredTable(
        config, args.table_dir, dram_budget=budget, seed=1, shards=4, segment_bytes=40 * record
    )
    model, optimizer = _model(table, config, F)
    batches = [{"ids": i, "y": y} for i, y in zipf_batches(N, B, F, args.steps, seed=3)]
    checkpointer = jaxcache.Checkpointer(args.checkpoint_dir)
    start, losses = 0, []
    if checkpointer.latest_step() is not None:
        info = checkpointer.restore(model=model, optimizer=optimizer)
        start, losses = info.batches_consumed, info.extra["losses"]
        print(f"restored step {info.step}", flush=True)
    for first in range(start, args.steps, args.every):
        segment = batches[first : first + args.every]
        with jaxcache.prefetch(segment, {"ids": model.embed}, lookahead=2) as pipeline:
            for step, batch in enumerate(pipeline, start=first + 1):
                losses.append(float(_step(model, optimizer, batch["ids"], batch["y"])))
                if step == args.kill_after:
                    print(f"killed after step {step}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
        checkpointer.save(
            first + len(segment), model=model, optimizer=optimizer, extra={"losses": losses}
        )
    assert table.stats().dram.evicted_dirty > 0 and table.stats().disk.rows_read > 0
    rows, state = model.embed.export()
    dense = jax.tree.leaves(nnx.state(model, nnx.Param))
    np.savez(
        args.dump,
        rows=rows,
        losses=np.array(losses),
        **{f"state.{k}": v for k, v in state.items()},
        **{f"dense.{i}": np.asarray(x) for i, x in enumerate(dense)},
    )


def _memory() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def memory(args: argparse.Namespace) -> None:
    rows, features, batch = args.rows, 64, 2048
    config = jaxcache.CacheConfig(
        rows, features, capacity=24576, policy="lru", optimizer=jaxcache.rowwise_adagrad(0.1)
    )
    batches = [{"ids": i, "y": y} for i, y in zipf_batches(rows, batch, F, 100, seed=0)]

    def run(table, cfg):
        model, optimizer = _model(table, cfg, F)
        data = [{**b, "ids": b["ids"] % cfg.num_embeddings} for b in batches]
        with jaxcache.prefetch(data, {"ids": model.embed}, lookahead=2) as pipeline:
            for b in pipeline:
                _step(model, optimizer, b["ids"], b["y"])
        model.embed.flush()

    # Compile every program first, with a small table of the same widths.
    small = jaxcache.CacheConfig(
        100_000, features, capacity=24576, policy="lru", optimizer=config.optimizer
    )
    run(jaxcache.HostTable(small), small)
    baseline = _memory()["VmRSS"]
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM starts again from VmRSS
        f.write("5")
    record = features * 4 + 4
    budget = rows * record // args.times
    start = time.perf_counter()
    table = jaxcache.TieredTable(config, args.table_dir, dram_budget=budget, seed=0)
    run(table, config)
    stats = table.stats()
    file_bytes = sum(
        os.path.getsize(os.path.join(args.table_dir, name)) for name in os.listdir(args.table_dir)
    )
    print(
        json.dumps(
            {
                "baseline": baseline,
                "peak": _memory()["VmHWM"],
                "budget": table.dram_budget,
                "file_bytes": file_bytes,
                "rows_read": stats.disk.rows_read,
                "evicted_dirty": stats.dram.evicted_dirty,
                "seconds": time.perf_counter() - start,
                "threads": threading.active_count(),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("train")
    run.add_argument("--table-dir", required=True)
    run.add_argument("--checkpoint-dir", required=True)
    run.add_argument("--steps", type=int, default=12)
    run.add_argument("--every", type=int, default=4)
    run.add_argument("--kill-after", type=int)
    run.add_argument("--dram-rows", type=int, default=200)
    run.add_argument("--dump")
    peak = commands.add_parser("memory")
    peak.add_argument("--table-dir", required=True)
    peak.add_argument("--times", type=int, default=8, help="table file over DRAM budget")
    peak.add_argument("--rows", type=int, default=1_000_000)
    args = parser.parse_args()
    train(args) if args.command == "train" else memory(args)


if __name__ == "__main__":
    main()
