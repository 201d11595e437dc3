"""The device plan's share of a step, on the DCNv2-shaped configuration.

Trains through a 2% cache planned on the device, one part at a time and
waiting for each (``run_blocking``), and times, on a cache of its own fed
the same batches, the plan program alone: its dispatch until its counts are
back on the host. ``dcnv2_plan_over_step=R`` is the median plan over the
median device step. ``dcnv2_raw_plan_over_step`` is the same for the same
batches as raw int64 ids (a bijective mix of them) through a dynamic
vocabulary of as many rows, and ``dcnv2_raw_added_over_step`` what the
vocabulary adds to the plan, over the step: against row ids under the same
policy (``lru`` where ``--policy`` is ``frequency``, which raw ids cannot
take), both caches started empty. On a GPU, with the step at
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


def plan_cache(bench: _training.Bench, policy: str, raw: bool = False) -> jaxcache.EmbeddingCache:
    """A device-planned 2% cache of the bench's rows under ``policy``, with
    no frequencies (rows go to ids as they come). ``raw``: its ids are raw,
    through a vocabulary of as many rows."""
    cfg = bench.setup.config(0.02, policy)
    table = jaxcache.HostTable(cfg, rows=bench.base)
    if raw:
        cfg = dataclasses.replace(cfg, vocabulary=jaxcache.DynamicVocabulary())
    return jaxcache.EmbeddingCache(cfg, table=table, planner="device")


def plan_seconds(
    bench: _training.Bench, cache: jaxcache.EmbeddingCache, raw: bool = False
) -> list[float]:
    """Seconds from each plan's dispatch until its counts are on the host."""
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
    _training.report_compilations([timing])
    step = float(np.median(timing.parts["device"]))
    print(f"device step {1e3 * step:.3f} ms")
    # Each figure as soon as it is measured: a run cut short keeps them.
    plan = plan_seconds(bench, bench.cache(0.02, planner="device"))
    print(f"plan ({args.policy}) {1e3 * np.median(plan):.3f} ms ({_harness.ms_range(plan)})")
    _harness.print_results({"dcnv2_plan_over_step": float(np.median(plan)) / step})
    # The raw ids' vocabulary against row ids under the same policy, both
    # started empty: what the vocabulary adds, and nothing else.
    policy = "lru" if args.policy == "frequency" else args.policy
    rows = plan_seconds(bench, plan_cache(bench, policy))
    raw = plan_seconds(bench, plan_cache(bench, policy, raw=True), raw=True)
    print(
        f"plan ({policy}, started empty) {1e3 * np.median(rows):.3f} ms "
        f"({_harness.ms_range(rows)}), raw ids' plan {1e3 * np.median(raw):.3f} ms "
        f"({_harness.ms_range(raw)})"
    )
    _harness.print_results(
        {
            "dcnv2_raw_plan_over_step": float(np.median(raw)) / step,
            "dcnv2_raw_added_over_step": float(np.median(raw) - np.median(rows)) / step,
        }
    )


if __name__ == "__main__":
    main()
