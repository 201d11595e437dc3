"""The device plan's share of a step, on the DCNv2-shaped configuration.

Trains through a 2% cache planned on the device, one part at a time and
waiting for each (``run_blocking``), and times, on a cache of its own fed
the same batches, the plan program alone: its dispatch until its counts are
back on the host. ``dcnv2_plan_over_step=R`` is the median plan over the
median device step. ``dcnv2_raw_plan_over_step`` is the same for the same
batches as raw int64 ids (a bijective mix of them) through a dynamic
vocabulary of as many rows, and ``dcnv2_raw_added_over_step`` what the
vocabulary adds to the plan, over the step. On a GPU, with the step at
MLPerf's scale, they say how much of the accelerator's time the per-id work
takes; on the CPU backend both run on the host's cores and the figures only
show that the script runs.

    python benchmarks/plan_share.py --dcnv2-scale 0.0625    # on a GPU host
    python benchmarks/plan_share.py --quick                 # CPU smoke run
"""

from __future__ import annotations

import dataclasses
import time

import _harness
import _training
import numpy as np

import jaxcache
from jaxcache._src.blocks import local_data
from jaxcache._src.device_plan import COLUMN


def raw_cache(bench: _training.Bench) -> jaxcache.EmbeddingCache:
    """A 2% cache of the same rows whose ids are raw, through a vocabulary of
    as many rows (no frequencies: rows go to raw ids as they come)."""
    cfg = bench.setup.config(0.02, "lru" if bench.args.policy == "frequency" else bench.args.policy)
    cfg = dataclasses.replace(cfg, vocabulary=jaxcache.DynamicVocabulary())
    return jaxcache.EmbeddingCache(cfg, planner="device")


def plan_seconds(bench: _training.Bench, raw: bool = False) -> list[float]:
    """Seconds from each plan's dispatch until its counts are on the host."""
    cache = raw_cache(bench) if raw else bench.cache(0.02, planner="device")
    state = cache.init_state()
    seconds = []
    for i, batch in enumerate(bench.batches):
        ids = batch["sparse"]
        if raw:  # padding stays padding
            pad = bench.setup.data.padding_id
            ids = np.where(ids == pad, pad, _harness.raw_ids(ids))
        cache.lifecycle.release_all()
        start = time.perf_counter()
        dispatched = cache.dispatch(ids)
        info = local_data(dispatched.out.info)
        if i >= bench.args.warmup:
            seconds.append(time.perf_counter() - start)
        assert info[0, COLUMN["status"]] == 0
        # The swap too, untimed: a later plan may fetch a row this one
        # evicts, whose write-back comes from the swap's read-out.
        state = cache.apply(state, cache.to_device(cache.gather(dispatched)))
    return seconds


def main() -> None:
    args = _training.parse_args(__doc__)
    _training.print_machine(args)
    bench = _training.Bench(_training.dcnv2(args), args)
    print(bench.setup.describe())
    timing = bench.blocking(0.02, "cache 2%, blocking", planner="device")
    step = float(np.median(timing.parts["device"]))
    plan = plan_seconds(bench)
    raw = plan_seconds(bench, raw=True)
    print(
        f"device step {1e3 * step:.3f} ms, plan {1e3 * np.median(plan):.3f} ms "
        f"({_harness.ms_range(plan)}), raw ids' plan {1e3 * np.median(raw):.3f} ms "
        f"({_harness.ms_range(raw)})"
    )
    _harness.print_results(
        {
            "dcnv2_plan_over_step": float(np.median(plan)) / step,
            "dcnv2_raw_plan_over_step": float(np.median(raw)) / step,
            "dcnv2_raw_added_over_step": float(np.median(raw) - np.median(plan)) / step,
        }
    )


if __name__ == "__main__":
    main()
