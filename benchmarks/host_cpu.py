"""Host CPU per step of a cache planned on the device: a fixed cost plus the misses.

The host's part of a step (plan dispatch, the lists read back, write-backs
landed, missing rows gathered and transferred, the swap dispatched) is
timed as CPU time of this process's Python threads: XLA's own threads,
which run the programs (on the CPU backend the "device" is the host's
cores), are left out. Steps run unpipelined on the training thread, and
every run of a figure is timed in the same process, round after round, so
that a change of load on the machine falls on all of them.

1. ``host_cpu_8x_ids_over_1x``: the device planner's host CPU per step with
   8x the ids per step over 1x, at a fixed number of misses (each batch
   re-reads resident rows and brings ``--misses`` new ids; an LFU cache
   seeded with the resident rows' counts evicts only earlier newcomers).
   The ids are int32, so no copy of them is made on the host.
2. ``host_cpu_device_over_host_planner``: on the embedding-heavy batch of
   ``throughput.py`` (multi-hot bags, a 2% cache, the adaptive policy), the
   device planner's host CPU per step over the host planner's; ``..._lfu``:
   the same with LFU, whose plans learn nothing on the host (the adaptive
   policy's shadow caches run on the host with either planner).
   ``host_cpu_host_planner_unplanned_share`` (and ``..._lfu``): the host
   planner's host CPU per step outside its plan (per step less the median
   plan), over its whole: the rows it lands, gathers and hands over and the
   swap it dispatches, which a step planned on the device does as well. No
   planner's host CPU goes below that share of the host planner's.
3. ``host_cpu_raw_8x_ids_over_1x``: the same as 1. for raw int64 ids through
   a dynamic vocabulary (``CacheConfig(vocabulary=...)``) planned on the
   device, each batch bringing ``--misses`` new ids; ``..._less_copy``
   without the copy of the ids the device planner makes (timed alone);
   ``..._host_planner``: planned on the host, where every id passes through
   the vocabulary's index; ``host_cpu_raw_over_rows``: raw ids over the
   same batches as rows, both on the host planner, at 1x: what the
   translation to rows costs there.
4. ``host_cpu_host_planner_after_wait_over_without``: the host planner's
   host CPU per step on the embedding-heavy batch (LFU) with the training
   thread asleep for ``--wait`` ms before each step, over without: the same
   work, only the wait differs. The device planner's thread waits for the
   plan in the middle of each step, as long as the plan runs; what a wait
   adds to the code that follows it on this machine is in figure 2 too.

    python benchmarks/host_cpu.py            # a few minutes on 2 CPU cores
    python benchmarks/host_cpu.py --quick
"""

from __future__ import annotations

import argparse
import threading
import time

import _harness
import _training
import jax
import numpy as np

import jaxcache


def python_cpu() -> float:
    """CPU seconds of this process's Python threads (XLA's threads left out),
    read from their clocks alone: listing every thread of the process would
    add its own cost to each step timed."""
    ours = [t.native_id for t in threading.enumerate() if t.native_id is not None]
    return sum(_harness._thread_seconds(ours).values())


class Loop:
    """A cache and its device state, trained on by hand (no model: the host
    part of each step is what is timed)."""

    def __init__(self, cache: jaxcache.EmbeddingCache) -> None:
        self.cache = cache
        self.state = cache.init_state()

    def host_cpu_per_step(self, batches: list[np.ndarray], wait: float = 0.0) -> float:
        """Median host CPU seconds of ``prepare`` (stage and swap) over
        ``batches``, the thread asleep for ``wait`` seconds before each."""
        per_step = []
        for ids in batches:
            if wait:
                time.sleep(wait)
            start = python_cpu()
            self.state, _ = self.cache.prepare(self.state, ids)
            per_step.append(python_cpu() - start)
            jax.block_until_ready(self.state)  # the next step starts with an idle device
        return float(np.median(per_step))


def fixed_misses(args: argparse.Namespace) -> float:
    """``host_cpu_8x_ids_over_1x``: the device planner at 1x and 8x the ids."""
    n, hot, misses = 1 << 21, 1 << 16, args.misses
    counts = np.zeros(n, np.int64)
    counts[:hot] = 1 << 20  # the resident rows; newcomers never outrank them
    cfg = jaxcache.CacheConfig(n, 16, capacity=hot + 8 * misses, policy="lfu")
    rng = np.random.default_rng(0)
    fresh = iter(range(hot, n))

    def batches(ids_per_step: int, count: int) -> list[np.ndarray]:
        out = []
        for _ in range(count):
            new = np.fromiter(fresh, np.int32, misses)
            old = rng.integers(0, hot, ids_per_step - misses, dtype=np.int32)
            out.append(rng.permutation(np.concatenate([old, new])).reshape(64, -1))
        return out

    base = args.ids
    loops = {
        scale: Loop(jaxcache.EmbeddingCache(cfg, frequencies=counts, warm=True, planner="device"))
        for scale in (1, 8)
    }
    for scale, loop in loops.items():  # compile, and fill the free slots
        loop.host_cpu_per_step(batches(base * scale, args.warmup))
    seconds: dict[int, list[float]] = {1: [], 8: []}
    for _ in range(args.rounds):
        for scale, loop in loops.items():
            seconds[scale].append(loop.host_cpu_per_step(batches(base * scale, args.steps)))
    for scale, loop in loops.items():
        last = loop.cache.stats.last
        print(
            f"device planner, {base * scale:>7} ids a step, {last.misses} misses: "
            f"host CPU {1e3 * np.median(seconds[scale]):.3f} ms a step "
            f"({_harness.ms_range(seconds[scale], 3)} over {args.rounds} rounds)"
        )
    return float(np.median(seconds[8]) / np.median(seconds[1]))


def raw_ids(args: argparse.Namespace) -> dict[str, float]:
    """``host_cpu_raw_8x_ids_over_1x`` (the device planner, with and without
    the copy of the ids), ``..._host_planner`` and ``host_cpu_raw_over_rows``."""
    hot, misses, base = 1 << 15, args.misses, args.ids
    total = hot + 8 * misses * (args.warmup + args.rounds * args.steps) + 64
    n = 1 << int(total - 1).bit_length()

    def cache(planner: str, raw: bool) -> Loop:
        vocabulary = jaxcache.DynamicVocabulary() if raw else None
        cfg = jaxcache.CacheConfig(n, 16, capacity=n, policy="lru", vocabulary=vocabulary)
        loop = Loop(jaxcache.EmbeddingCache(cfg, planner=planner))
        warm = np.arange(hot, dtype=np.uint64).reshape(64, -1)
        loop.host_cpu_per_step([_harness.raw_ids(warm) if raw else warm.astype(np.int64)])
        return loop

    kinds = [("host", False), ("host", True), ("device", True)]
    loops = {(*kind, scale): cache(*kind) for kind in kinds for scale in (1, 8)}
    fresh = {key: iter(range(hot, n)) for key in loops}
    rng = np.random.default_rng(0)

    def batches(key: tuple[str, bool, int], count: int) -> list[np.ndarray]:
        _, raw, scale = key
        out = []
        for _ in range(count):
            new = np.fromiter(fresh[key], np.int64, misses)
            old = rng.integers(0, hot, base * scale - misses)
            ids = rng.permutation(np.concatenate([old, new])).reshape(64, -1)
            out.append(_harness.raw_ids(ids) if raw else ids)
        return out

    for key, loop in loops.items():
        loop.host_cpu_per_step(batches(key, args.warmup))
    seconds: dict[tuple[str, bool, int], list[float]] = {key: [] for key in loops}
    for _ in range(args.rounds):
        for key, loop in loops.items():
            seconds[key].append(loop.host_cpu_per_step(batches(key, args.steps)))
    print()
    for (planner, raw, scale), loop in loops.items():
        last = loop.cache.stats.last
        print(
            f"{planner} planner, {'raw ids' if raw else 'rows'}, {base * scale:>7} ids a step, "
            f"{last.misses} misses: host CPU {1e3 * np.median(seconds[planner, raw, scale]):.3f} "
            f"ms a step ({_harness.ms_range(seconds[planner, raw, scale], 3)})"
        )
    # The device planner copies the batch's ids once, into a buffer the
    # transfer may keep (``DevicePlanner.dispatch``): timed alone.
    copies = {}
    for scale in (1, 8):
        ids = batches(("device", True, scale), 1)[0]
        start = python_cpu()
        for _ in range(20):
            np.array(ids)
        copies[scale] = (python_cpu() - start) / 20
    print(
        f"the copy of the raw ids: {1e3 * copies[1]:.3f} ms at 1x, {1e3 * copies[8]:.3f} ms at 8x"
    )
    median = {key: float(np.median(values)) for key, values in seconds.items()}
    device = median["device", True, 8], median["device", True, 1]
    return {
        "host_cpu_raw_8x_ids_over_1x": device[0] / device[1],
        "host_cpu_raw_8x_ids_over_1x_less_copy": (device[0] - copies[8]) / (device[1] - copies[1]),
        "host_cpu_raw_8x_ids_over_1x_host_planner": median["host", True, 8]
        / median["host", True, 1],
        "host_cpu_raw_over_rows": median["host", True, 1] / median["host", False, 1],
    }


def embedding_heavy(args: argparse.Namespace, policy: str) -> tuple[float, float]:
    """``host_cpu_device_over_host_planner`` on the embedding-heavy batch,
    and the host planner's host CPU outside its plan over its whole."""
    setup = _training.embedding_heavy(args)
    batches = [b["sparse"] for b in setup.data.batches(args.warmup + args.steps)]
    frequencies = setup.data.count_frequencies(8)
    cfg = setup.config(0.02, policy)
    loops = {
        planner: Loop(jaxcache.EmbeddingCache(cfg, frequencies=frequencies, planner=planner))
        for planner in ("host", "device")
    }
    plans = plan_cpu(loops["host"].cache)
    seconds: dict[str, list[float]] = {planner: [] for planner in loops}
    for loop in loops.values():  # compile, and warm the cache
        loop.host_cpu_per_step(batches[: args.warmup])
    rest = []
    for _ in range(args.rounds):  # the same batches each round: the caches are warm
        for planner, loop in loops.items():
            plans.clear()
            seconds[planner].append(loop.host_cpu_per_step(batches[args.warmup :]))
            if planner == "host":
                rest.append(seconds[planner][-1] - float(np.median(plans)))
    print(f"\n{setup.describe()}, 2% cache, {policy}")
    for planner, loop in loops.items():
        total = loop.cache.stats.total
        print(
            f"  {planner} planner: host CPU {1e3 * np.median(seconds[planner]):.3f} ms a step "
            f"({_harness.ms_range(seconds[planner], 3)}), hit rate {total.hit_rate:.3f}"
        )
    print(
        f"  host planner outside its plan: {1e3 * np.median(rest):.3f} ms a step "
        f"({_harness.ms_range(rest, 3)})"
    )
    host = float(np.median(seconds["host"]))
    return float(np.median(seconds["device"])) / host, float(np.median(rest)) / host


def plan_cpu(cache: jaxcache.EmbeddingCache) -> list[float]:
    """Records the CPU seconds of each host plan of ``cache`` (the plan and
    route of a batch, on the calling thread) in the returned list."""
    partitions = cache.stager.partitions
    plan, seconds = partitions.plan, []

    def timed(*args, **kwargs):
        start = time.thread_time()
        try:
            return plan(*args, **kwargs)
        finally:
            seconds.append(time.thread_time() - start)

    partitions.plan = timed
    return seconds


def after_wait(args: argparse.Namespace) -> float:
    """``host_cpu_host_planner_after_wait_over_without``."""
    setup = _training.embedding_heavy(args)
    batches = [b["sparse"] for b in setup.data.batches(args.warmup + args.steps)]
    cache = jaxcache.EmbeddingCache(
        setup.config(0.02, "lfu"), frequencies=setup.data.count_frequencies(8), planner="host"
    )
    loop = Loop(cache)
    loop.host_cpu_per_step(batches[: args.warmup])
    waits = {"without": 0.0, "after": args.wait / 1e3}
    seconds: dict[str, list[float]] = {name: [] for name in waits}
    for _ in range(args.rounds):
        for name, wait in waits.items():
            seconds[name].append(loop.host_cpu_per_step(batches[args.warmup :], wait))
    print(f"\n{setup.describe()}, 2% cache, lfu, host planner")
    for name, values in seconds.items():
        print(
            f"  {'after a ' + str(args.wait) + ' ms wait' if waits[name] else 'back to back'}: "
            f"host CPU {1e3 * np.median(values):.3f} ms a step ({_harness.ms_range(values, 3)})"
        )
    return float(np.median(seconds["after"]) / np.median(seconds["without"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, runs interleaved")
    parser.add_argument("--ids", type=int, default=8192, help="ids a step at 1x")
    parser.add_argument("--misses", type=int, default=256, help="new ids a step")
    parser.add_argument("--wait", type=int, default=30, help="ms asleep before a step (4.)")
    parser.add_argument("--quick", action="store_true", help="fewer steps, smaller table")
    parser.add_argument("--scale", type=float, default=None, help="SyntheticCriteo scale")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.rounds = 10, 4, 2
    if args.scale is None:
        args.scale = 0.02 if args.quick else 0.1  # as throughput.py's
    print(_harness.machine())
    start = time.perf_counter()
    ids_ratio = fixed_misses(args)
    raw = raw_ids(args)
    planners = {policy: embedding_heavy(args, policy) for policy in ("adaptive", "lfu")}
    waited = after_wait(args)
    print(f"\n({time.perf_counter() - start:.0f} s)")
    _harness.print_results(
        {
            "host_cpu_8x_ids_over_1x": ids_ratio,
            "host_cpu_device_over_host_planner": planners["adaptive"][0],
            "host_cpu_device_over_host_planner_lfu": planners["lfu"][0],
            "host_cpu_host_planner_unplanned_share": planners["adaptive"][1],
            "host_cpu_host_planner_unplanned_share_lfu": planners["lfu"][1],
            **raw,
            "host_cpu_host_planner_after_wait_over_without": waited,
        }
    )


if __name__ == "__main__":
    main()
