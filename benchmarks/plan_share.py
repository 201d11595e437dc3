"""The device plan's share of a step, on the DCNv2-shaped configuration.

Trains through a 2% cache planned on the device, one part at a time and
waiting for each (``run_blocking``), and times, on a cache of its own fed
the same batches, the plan program alone: its dispatch until its counts are
back on the host. ``dcnv2_plan_over_step=R`` is the median plan over the
median device step. On a GPU, with the step at MLPerf's scale, it says how
much of the accelerator's time the per-id work takes; on the CPU backend
both run on the host's cores and the figure only shows that the script runs.

    python benchmarks/plan_share.py --dcnv2-scale 0.0625    # on a GPU host
    python benchmarks/plan_share.py --quick                 # CPU smoke run
"""

from __future__ import annotations

import time

import _harness
import _training
import numpy as np

from jaxcache._src.blocks import local_data
from jaxcache._src.device_plan import COLUMN


def plan_seconds(bench: _training.Bench) -> list[float]:
    """Seconds from each plan's dispatch until its counts are on the host."""
    cache = bench.cache(0.02, planner="device")
    seconds = []
    for i, batch in enumerate(bench.batches):
        cache.lifecycle.release_all()
        start = time.perf_counter()
        dispatched = cache.dispatch(batch["sparse"])
        info = local_data(dispatched.out.info)
        if i >= bench.args.warmup:
            seconds.append(time.perf_counter() - start)
        assert info[0, COLUMN["status"]] == 0
        cache.gather(dispatched)  # the host lists, so the ledger stays in step
    return seconds


def main() -> None:
    args = _training.parse_args(__doc__)
    _training.print_machine(args)
    bench = _training.Bench(_training.dcnv2(args), args)
    print(bench.setup.describe())
    timing = bench.blocking(0.02, "cache 2%, blocking", planner="device")
    step = float(np.median(timing.parts["device"]))
    plan = plan_seconds(bench)
    print(
        f"device step {1e3 * step:.3f} ms, plan {1e3 * np.median(plan):.3f} ms "
        f"({_harness.ms_range(plan)})"
    )
    _harness.print_results({"dcnv2_plan_over_step": float(np.median(plan)) / step})


if __name__ == "__main__":
    main()
