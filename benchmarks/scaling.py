"""Host staging against devices, threads and processes, with the device idle.

Times the host half of a step, ``EmbeddingCache.stage_host`` (plan every
device partition, route, pad, land the write-backs it needs, gather the
fetched rows), while the device does nothing: each staged batch is then
transferred, swapped in and its write-backs landed outside the timed region.
One run measures, on a Criteo-shaped table of about 4M rows x 16 (LFU,
40,000 rows per device, 2,048 samples x 26 ids per device and step):

1. **Weak scaling** in one process: 1, 2, 4, 8 simulated CPU devices, the
   per-device batch fixed, one host thread: staging CPU per step and per
   device partition. The four caches take turns in blocks of ``BLOCK``
   steps (as in section 2), so that a change of load on the machine falls
   on each of them. ``partition_cpu_8_over_1``: CPU per partition at 8
   devices over that at 1. For reference, 8 independent one-device caches
   (batches of their own) staged in turn on the same thread: what one
   thread pays per cache once 8 caches' planner state share its CPU caches,
   with no split and no route (``caches_8_in_turn_over_1``).
2. **Threads**: 8 devices, staging wall time with 1, 2 and 4 host threads.
   The three caches take turns in blocks of ``BLOCK`` steps, so that a
   change of load on the machine falls on all of them while each block
   runs with its own cache's state in the CPU caches, as a real run does
   (turns of one step would start every step on another cache's state).
   ``threads_2_over_1``.
3. **Processes**: the staging CPU of one process of 2 processes x 4 devices
   against 1 process x 8 devices. Process 0's share is staged here by a
   stager of that layout (its planners, its share of the host table), with
   no device: the batches are staged for inference (rows fetched, none
   written back) on both sides alike. A real run adds the agreement on the
   padded sizes through the key-value store, a few requests per step
   (``tests/test_multiprocess.py`` runs it; ``benchmarks/agreement.py``
   times it against the number of processes). ``per_process_2_over_1``.
4. **One thread, one device**, the embedding-heavy batch of
   ``benchmarks/throughput.py`` (512 samples x 26 bags of up to 16 ids,
   3.4M rows, 2% cache): real ids staged per second of CPU.
   ``stage_ids_per_s`` (millions).
5. **One device, several partitions**: the one-device batch of part 1 on a
   cache of ``q`` partitions per device (``partitions_per_device``), ``q``
   the cores this process may use (at most 8), staged on ``q`` threads,
   against one partition on one thread, in turns of ``BLOCK`` steps;
   staging wall time. ``one_device_partitions_over_1`` (the figure a
   one-GPU host cares about; on 2 cores, 2 partitions on 2 threads).

Medians over the timed steps; ratios printed as ``name=value``. On a CPU the
"devices" are simulated on the host's cores; run it with the machine
otherwise idle. A run takes 100 timed steps per cache by default: the
staging itself is a small part of a run (most of it is making the caches
and compiling their programs), and with 30 the 2- and 4-thread caches of
section 2, which run alike on 2 cores, came out 0.13 apart in one run;
with 100, 0.00-0.05 apart in three (2026-11-28).

    python benchmarks/scaling.py            # under a minute on 2 cores
    python benchmarks/scaling.py --quick    # fewer steps
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterable

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import _harness
import jax
import numpy as np
from jax.sharding import Mesh

import jaxcache
from jaxcache._src.host_table import HostTable
from jaxcache._src.partitions import Partitions
from jaxcache._src.placement import Layout
from jaxcache._src.stager import Stager
from jaxcache._src.stats import CacheStats
from jaxcache._src.threads import HostThreads, cores
from jaxcache._src.write_back import WriteBacks

SCALE = 0.12  # of the Criteo Kaggle cardinalities: about 4.05M rows
PER_DEVICE = 2048  # samples per device and step
CAPACITY = 40_000  # rows per device
BLOCK = 10  # steps a cache stages before the next takes its turn (threads)


def _config(
    data: jaxcache.synthetic.SyntheticCriteo, capacity: int | float
) -> jaxcache.CacheConfig:
    return jaxcache.CacheConfig(
        data.num_embeddings,
        16,
        capacity,
        policy="lfu",
        optimizer=jaxcache.rowwise_adagrad(0.05),
        padding_id=data.padding_id if data.multi_hot else None,
    )


def _cache(cfg: jaxcache.CacheConfig, devices: int, threads: int) -> jaxcache.EmbeddingCache:
    mesh = Mesh(np.array(jax.devices()[:devices]), ("rows",))
    return jaxcache.EmbeddingCache(cfg, mesh=mesh, threads=threads)


class Runner:
    """Stages batches through one cache, timing only ``stage_host``."""

    def __init__(self, cache: jaxcache.EmbeddingCache) -> None:
        self.cache = cache
        self.state = cache.init_state()
        self.cpu: list[float] = []
        self.wall: list[float] = []

    def step(self, ids: np.ndarray, timed: bool) -> None:
        cache = self.cache
        cache.lifecycle.release_all()
        wall, cpu = time.perf_counter(), time.thread_time()
        host = cache.stage_host(ids, defer=True)
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        if timed:
            self.cpu.append(cpu)
            self.wall.append(wall)
        self.state = cache.apply(self.state, cache.to_device(host))
        jax.block_until_ready(self.state)
        cache.land_write_backs()


def weak_scaling(args: argparse.Namespace) -> tuple[float, float]:
    print(f"1. weak scaling: {PER_DEVICE} samples x 26 ids per device, 1 host thread")
    print(
        f"   {'devices':>7} {'ids/step':>9} {'CPU ms/step':>12} {'ms/partition':>13} {'M ids/s':>8}"
    )
    per_partition = {}
    runs = {}
    for devices in (1, 2, 4, 8):
        data = jaxcache.synthetic.SyntheticCriteo(
            scale=SCALE, batch_size=PER_DEVICE * devices, seed=0
        )
        runs[devices] = (
            data,
            Runner(_cache(_config(data, CAPACITY * devices), devices, threads=1)),
        )
    _in_turns(args, runs.values())
    for devices, (data, runner) in runs.items():
        cpu = float(np.median(runner.cpu))
        ids = PER_DEVICE * devices * data.num_features
        per_partition[devices] = cpu / devices
        print(
            f"   {devices:>7} {ids:>9,} {1e3 * cpu:>12.2f} {1e3 * cpu / devices:>13.2f} "
            f"{ids / cpu / 1e6:>8.1f}"
        )
    in_turn = caches_in_turn(args, 8)
    print(
        f"   8 one-device caches staged in turn: {1e3 * in_turn:.2f} ms per cache and step "
        f"({in_turn / per_partition[1]:.2f}x one cache alone)"
    )
    return per_partition[8] / per_partition[1], in_turn / per_partition[1]


def caches_in_turn(args: argparse.Namespace, count: int) -> float:
    """Median CPU per step of ``count`` independent one-device caches, each
    with batches of its own, staged one after another on one thread."""
    sources = [
        jaxcache.synthetic.SyntheticCriteo(scale=SCALE, batch_size=PER_DEVICE, seed=seed)
        for seed in range(count)
    ]
    runners = [Runner(_cache(_config(data, CAPACITY), 1, threads=1)) for data in sources]
    for index in range(args.warmup + args.steps):
        for data, runner in zip(sources, runners, strict=True):
            runner.step(data.batch(index)["sparse"], index >= args.warmup)
    return float(np.median(np.concatenate([runner.cpu for runner in runners])))


def _in_turns(
    args: argparse.Namespace, runs: Iterable[tuple[jaxcache.synthetic.SyntheticCriteo, Runner]]
) -> None:
    """Stages each runner's batches (from its data) through it, the runners
    taking turns in blocks of ``BLOCK`` steps (see section 2 of the docstring)."""
    total = args.warmup + args.steps
    runs = list(runs)
    for start in range(0, total, BLOCK):
        indices = range(start, min(start + BLOCK, total))
        blocks = {id(data): [data.batch(index)["sparse"] for index in indices] for data, _ in runs}
        for data, runner in runs:
            for index, ids in enumerate(blocks[id(data)], start):
                runner.step(ids, index >= args.warmup)


def thread_scaling(args: argparse.Namespace) -> float:
    devices = 8
    counts = (1, 2, 4)
    print(f"2. threads: {devices} devices, staging wall time, caches in turns of {BLOCK} steps")
    data = jaxcache.synthetic.SyntheticCriteo(scale=SCALE, batch_size=PER_DEVICE * devices, seed=0)
    cfg = _config(data, CAPACITY * devices)
    runners = {t: Runner(_cache(cfg, devices, threads=t)) for t in counts}
    _in_turns(args, [(data, runner) for runner in runners.values()])
    one = float(np.median(runners[1].wall))
    print(f"   {'threads':>7} {'wall ms/step':>13} {'vs 1 thread':>12}")
    for threads, runner in runners.items():
        wall = float(np.median(runner.wall))
        print(f"   {threads:>7} {1e3 * wall:>13.2f} {wall / one:>12.3f}")
    same = [r.cache.stats.total for r in runners.values()]
    assert all(s == same[0] for s in same), "thread counts planned differently"
    return float(np.median(runners[2].wall)) / one


def _host_stager(cfg: jaxcache.CacheConfig, layout: Layout) -> Stager:
    """A stager of ``layout``'s process with no device (for inference batches)."""
    shard = (layout.process, layout.processes)
    threads = HostThreads(1)
    partitions = Partitions(cfg, layout, threads=threads)
    ledger = WriteBacks(lambda *args: None)  # inference: nothing is written back
    table = HostTable(cfg, shard=shard)
    return Stager(cfg, partitions, table, ledger, CacheStats(cfg.row_bytes), threads)


def process_scaling(args: argparse.Namespace) -> float:
    devices = 8
    print(f"3. processes: {devices} devices, staging CPU of one process, no device")
    data = jaxcache.synthetic.SyntheticCriteo(scale=SCALE, batch_size=PER_DEVICE * devices, seed=0)
    cfg = _config(data, CAPACITY * devices)
    stagers = {processes: _host_stager(cfg, Layout(devices, processes, 0)) for processes in (1, 2)}
    cpu: dict[int, list[float]] = {p: [] for p in stagers}
    for index in range(args.warmup + args.steps):
        ids = data.batch(index)["sparse"]
        for processes, stager in stagers.items():
            stager.partitions.release_all()
            start = time.thread_time()
            stager.stage(ids, train=False, defer=True)
            if index >= args.warmup:
                cpu[processes].append(time.thread_time() - start)
    print(f"   {'layout':>14} {'CPU ms/step':>12} {'ids planned':>12} {'planner MiB':>12}")
    for processes, stager in stagers.items():
        layout = f"{processes} x {devices // processes} devices"
        planned = stager.stats.last.lookups
        mib = stager.partitions.nbytes / 2**20
        print(
            f"   {layout:>14} {1e3 * np.median(cpu[processes]):>12.2f} {planned:>12,} {mib:>12.1f}"
        )
    return float(np.median(cpu[2]) / np.median(cpu[1]))


def heavy_batch(args: argparse.Namespace) -> float:
    data = jaxcache.synthetic.SyntheticCriteo(
        scale=0.1, batch_size=512, multi_hot=True, bag_size=16
    )
    runner = Runner(_cache(_config(data, 0.02), 1, threads=1))
    batches = [data.batch(index)["sparse"] for index in range(args.warmup + args.steps)]
    for index, ids in enumerate(batches):
        runner.step(ids, index >= args.warmup)
    real = float(np.mean([(ids != data.padding_id).sum() for ids in batches]))
    cpu = float(np.median(runner.cpu))
    print(
        f"4. one thread, one device, embedding-heavy batch ({real:,.0f} real ids of "
        f"{batches[0].size:,} positions): {1e3 * cpu:.2f} ms CPU per step = "
        f"{real / cpu / 1e6:.1f} M real ids/s"
    )
    return real / cpu / 1e6


def one_device_partitions(args: argparse.Namespace) -> float:
    q = min(8, cores())
    print(f"5. one device, {PER_DEVICE} samples x 26 ids, partitions per device on host threads")
    data = jaxcache.synthetic.SyntheticCriteo(scale=SCALE, batch_size=PER_DEVICE, seed=0)
    cfg = _config(data, CAPACITY)
    mesh = Mesh(np.array(jax.devices()[:1]), ("rows",))
    runs = {
        (parts, threads): Runner(
            jaxcache.EmbeddingCache(cfg, mesh=mesh, threads=threads, partitions_per_device=parts)
        )
        for parts, threads in dict.fromkeys([(1, 1), (q, 1), (q, q)])
    }
    _in_turns(args, [(data, runner) for runner in runs.values()])
    one = float(np.median(runs[1, 1].wall))
    print(f"   {'partitions':>10} {'threads':>7} {'wall ms/step':>13} {'vs 1 x 1':>9} {'hits':>9}")
    for (parts, threads), runner in runs.items():
        wall = float(np.median(runner.wall))
        hits = runner.cache.stats.total.hits / max(1, runner.cache.stats.total.distinct)
        print(f"   {parts:>10} {threads:>7} {1e3 * wall:>13.2f} {wall / one:>9.3f} {hits:>9.3f}")
    return float(np.median(runs[q, q].wall)) / one


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    args = parser.parse_args()
    args.steps = args.steps or (10 if args.quick else 100)
    print(f"{_harness.machine()}; {args.steps} timed steps after {args.warmup} warm-up; medians")
    partition, in_turn = weak_scaling(args)
    threads = thread_scaling(args)
    processes = process_scaling(args)
    ids_per_s = heavy_batch(args)
    one_device = one_device_partitions(args)
    _harness.print_results(
        {
            "partition_cpu_8_over_1": partition,
            "caches_8_in_turn_over_1": in_turn,
            "threads_2_over_1": threads,
            "per_process_2_over_1": processes,
            "one_device_partitions_over_1": one_device,
        }
    )
    _harness.print_results({"stage_ids_per_s": ids_per_s}, digits=1)


if __name__ == "__main__":
    main()
