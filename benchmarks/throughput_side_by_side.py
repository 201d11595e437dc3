"""Device alone, host alone and every training loop of a 2% cache, side by side.

For the embedding-heavy configuration at 2%, the table compares (a) the
device step alone and (b) host staging alone with the loops: unpipelined,
pipelined, the host-callback form (``CachedEmbed.lookup_ids`` inside the
step; its lists ``CacheConfig.callback_rows`` long, the most distinct ids of
a batch rounded up to a power of two, and once as long as the batch's ids,
the default), and the full table; and (g), a control: the full table's loop
with every batch staged beforehand, so no host work is left in it. These
runs go round ``--rounds`` times, interleaved, so that a change of load on
the machine falls on all of them; the table gives the median over the rounds
and their range. A perfect pipeline would run a step in ``max(a, b)``;
``pipelined_over_ideal=R`` is the pipelined step time over that. On a CPU
the "device" is the same cores as the host thread, so the two compete: the
loops' CPU time per step, by thread (training thread, the pipeline's
producer, JAX's runtime threads), shows the floor that puts under a step
(all of it over the cores), and how far above that floor each loop ran.
``cached_2pct_over_full=R``: full-table step time over 2%-cache step time,
both in the loop at ``--lookahead``.

    python benchmarks/throughput_side_by_side.py --rounds 5
"""

from __future__ import annotations

import functools
from typing import Any

import _harness
import _training
import numpy as np


def side_by_side(bench: _training.Bench) -> tuple[float, float]:
    """Device alone, host alone and every loop of the 2% cache, side by side.

    The runs go round ``--rounds`` times, one of each per round, so that a
    change of load on the machine falls on all of them alike; each figure is
    the median over the rounds of a run's median, and ``range`` spans the
    rounds.

    Returns ``(pipelined over ideal, full table over pipelined)``.
    """
    args = bench.args
    k = args.lookahead
    lookaheads = sorted({0, k})
    runs = {
        "blocking": functools.partial(bench.blocking, 0.02, "cache 2%, blocking"),
        "staged": bench.staged,
    }
    probe = bench.cache(0.02)  # the backend's default planner, as every run here
    try:
        probe.callbacks.check()
        callbacks = True
    except RuntimeError as refused:  # one CPU core
        print(f"\nhost-callback form skipped: {refused}")
        callbacks = False
    for n in lookaheads:
        runs["cached", n] = functools.partial(bench.loop, 0.02, f"cache 2%, lookahead {n}", n)
        if callbacks:
            runs["callback", n] = functools.partial(
                bench.loop, 0.02, f"cache 2%, host callback, lookahead {n}", n, host_callback=True
            )
        runs["full", n] = functools.partial(bench.loop, None, f"full table, lookahead {n}", n)
    if callbacks:
        runs["batch-sized", k] = functools.partial(
            bench.loop,
            0.02,
            f"cache 2%, host callback, batch-sized lists, lookahead {k}",
            k,
            host_callback=True,
            batch_sized=True,
        )
    results = _harness.interleave(runs, args.rounds)

    def per_round(key: Any, part: str) -> list[float]:
        return [t.blocking if part == "blocking" else t.median(part) for t in results[key]]

    rows = [  # label, run, part
        ("(a) device step alone", "blocking", "device"),
        ("(b) host staging alone", "blocking", "staging"),
        ("    blocking: staging + swap + step", "blocking", "blocking"),
        *(
            (f"({'d' if n else 'c'}) cached, lookahead {n}", ("cached", n), "step")
            for n in lookaheads
        ),
        *((f"(e) host callback, lookahead {n}", ("callback", n), "step") for n in lookaheads),
        (f"    lists of all ids, lookahead {k}", ("batch-sized", k), "step"),
        *((f"(f) full table, lookahead {n}", ("full", n), "step") for n in lookaheads),
        ("(g) full table, staged beforehand", "staged", "step"),
    ]
    rows = [row for row in rows if row[1] in results]
    device = float(np.median(per_round("blocking", "device")))
    host = float(np.median(per_round("blocking", "staging")))
    ideal = max(device, host)
    full_step = float(np.median(per_round(("full", k), "step")))
    pipelined = float(np.median(per_round(("cached", k), "step")))
    reference = results["cached", 0][0].loss
    print()
    print(
        f"{bench.setup.name}, cache 2% ({args.policy}, {probe.planner_kind} planner, the "
        f"backend's default; the full table's too), side by side: {args.rounds} round(s) of "
        f"{args.steps} steps after {args.warmup} warm-up; median over the rounds of each run's "
        "median, ms per step"
    )
    header = (
        f"{'':<36}{'ms/step':>8}{'range':>14}{'steps/s':>8}{'/ ideal':>8}{'full/this':>10}"
        f"{'cores':>6}{'hit rate':>9}{'final loss':>11}{'|dloss|':>9}"
    )
    print(header)
    print("-" * len(header))
    for label, key, part in rows:
        values = per_round(key, part)
        seconds = float(np.median(values))
        spread = _harness.ms_range(values)
        line = (
            f"{label:<36}{1e3 * seconds:>8.2f}{spread:>14}{1 / seconds:>8.1f}"
            f"{seconds / ideal:>8.2f}{full_step / seconds:>10.2f}"
        )
        if part in ("device", "step"):
            line += f"{np.median([t.cores for t in results[key]]):>6.2f}"
        if part in ("step", "blocking"):
            first = results[key][0]
            line += f"{'':>6}" if part == "blocking" else ""
            line += f"{first.hit_rate:>9.3f}{first.loss:>11.6f}{abs(first.loss - reference):>9.1e}"
        print(line)
        if part == "staging":
            print(f"{'    ideal: max(a, b)':<36}{1e3 * ideal:>8.2f}")
    _training.report_compilations(t for timings in results.values() for t in timings)
    _print_cpu(rows, results, ideal, pipelined, ("cached", k))
    for key in [key for key in runs if key[0] in ("cached", "callback", "batch-sized")]:
        timings = results[key]
        phases = {p: np.mean([t.phases.get(p, 0.0) for t in timings]) for p in timings[0].phases}
        parts = ", ".join(f"{p} {x:.2f}" for p, x in phases.items() if x > 0)
        waits = np.mean([t.write_back_waits for t in timings])
        print(f"  {timings[0].name}: {parts} (mean ms per call); {waits:.0f} write-back waits")
    print(
        "  (a), (b): parts of the blocking run; loops read each loss one step later. "
        f"/ ideal: over max(a, b); full/this: the full table at lookahead {k} over this; "
        f"cores: process CPU time over wall time, of {_harness.cores()} (a pipeline "
        "can only overlap host and device work with more than one); hit rate and final loss "
        "of the first round; |dloss|: vs the unpipelined loop."
    )
    return pipelined / ideal, full_step / pipelined


def _print_cpu(
    rows: list[tuple[str, Any, str]],
    results: dict[Any, list[_training.Timing]],
    ideal: float,
    pipelined: float,
    key_pipelined: Any,
) -> None:
    """The loops' CPU per step by thread, and the floor it puts under a step:
    on ``cores`` cores no loop runs a step in less than all its threads' CPU
    time over ``cores``, however well it overlaps."""
    loops = [(label, key) for label, key, part in rows if part == "step" and results[key][0].cpu]
    if not loops:
        return
    cores = _harness.cores()
    print(
        f"  CPU per step, ms (median over the rounds): {'loop':>6}{'prefetch':>9}"
        f"{'runtime':>8}{'all':>7}{f'all/{cores}':>7}{'/ ideal':>8}"
    )
    floors = {}
    for label, key in loops:
        parts = {p: np.median([t.cpu[p] for t in results[key]]) for p in results[key][0].cpu}
        total = float(np.median([sum(t.cpu.values()) for t in results[key]]))
        floors[key] = total / cores
        print(
            f"  {label.strip():<41}{1e3 * parts['loop']:>6.2f}{1e3 * parts['prefetch']:>9.2f}"
            f"{1e3 * parts['runtime']:>8.2f}{1e3 * total:>7.2f}{1e3 * floors[key]:>7.2f}"
            f"{floors[key] / ideal:>8.2f}"
        )
    if key_pipelined in floors:
        floor = floors[key_pipelined]
        print(
            f"  loop: the training thread; prefetch: the pipeline's producer; runtime: JAX's "
            f"threads (XLA's). Pipelined over ideal {pipelined / ideal:.2f} = its CPU floor "
            f"{floor / ideal:.2f} x ideal, times {pipelined / floor:.2f} that did not overlap."
        )


def main(argv: list[str] | None = None) -> None:
    over_ideal, cached_over_full = side_by_side(_training.standalone(__doc__, argv))
    _harness.print_results(
        {"pipelined_over_ideal": over_ideal, "cached_2pct_over_full": cached_over_full}
    )


if __name__ == "__main__":
    main()
