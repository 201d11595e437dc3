"""Planner throughput: ids per second of ``Planner.plan`` on batches of 100k+ ids.

The embedding-heavy configuration's ids at ``--planner-batch`` (1024)
samples a batch, a 5% capacity, the policy of ``--policy`` given a frequency
profile of 20 batches; ``--warmup`` untimed plans, then ``--steps`` timed
ones (each plan released before the next). Median milliseconds per plan.

    python benchmarks/throughput_planner.py --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import _training
import numpy as np

import jaxcache


def planner_throughput(setup: _training.Setup, args: argparse.Namespace) -> None:
    """Ids/s of ``Planner.plan`` on large batches, after the cache has warmed up."""
    data = dataclasses.replace(setup.data, batch_size=args.planner_batch)
    batches = [data.batch(i)["sparse"] for i in range(args.warmup + args.steps)]
    cfg = setup.config(0.05, args.policy)
    planner = jaxcache.planning.Planner(
        cfg, frequencies=data.count_frequencies(args.profile_batches)
    )
    times = []
    for i, ids in enumerate(batches):
        t0 = time.perf_counter()
        plan = planner.plan(ids)
        planner.release(plan.index)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    ids_per_batch = int((batches[0] != data.padding_id).sum())
    median = float(np.median(times))
    print()
    print(
        f"planner ({args.policy}, capacity {cfg.capacity:,} of {cfg.num_embeddings:,} rows): "
        f"{ids_per_batch:,} ids/batch, median {1e3 * median:.2f} ms/plan = "
        f"{ids_per_batch / median / 1e6:.2f} M ids/s"
    )


def main(argv: list[str] | None = None) -> None:
    args = _training.parse_args(__doc__, argv)
    _training.print_machine(args)
    planner_throughput(_training.embedding_heavy(args), args)


if __name__ == "__main__":
    main()
