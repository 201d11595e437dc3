"""The side-by-side runs with host and device on cores of their own.

On a CPU the "device" is the host's own cores, so a pipeline's host thread
and the device step compete for them. Here (a)-(d) and (g) of
``throughput_side_by_side.py`` run once more with JAX's runtime threads on
the first half of the cores and the training thread and the pipeline's
producer on the rest (Linux), as with an accelerator.
``pipelined_over_ideal_split_cores=R`` is (d) over ``max(a, b)`` there.

    python benchmarks/throughput_split_cores.py --quick
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import _harness
import _training
import jax
import numpy as np


def split_cores(bench: _training.Bench) -> float | None:
    """The side-by-side runs with host and device on cores of their own.

    On a CPU the "device" is the host's own cores. Here JAX's runtime threads
    (XLA's among them) get half of the cores (the first) and the training
    thread, with the pipeline's producer, the rest, as an accelerator and its
    host would: then the pipeline can only hide the host work behind the
    device step, never take cores from it. (a) and (b) are measured under the
    same split, so the ideal is ``max(a, b)`` again.

    Returns ``pipelined over ideal`` under the split, or ``None`` where it
    cannot be made (one core, or not Linux).
    """
    args = bench.args
    if jax.default_backend() != "cpu":
        print("\nsplit cores: skipped (the device is an accelerator, with cores of its own)")
        return None
    cores = sorted(os.sched_getaffinity(0))
    listed = bool(_harness.threads())
    if len(cores) < 2 or not listed:
        print(f"\nsplit cores: skipped ({len(cores)} core(s); threads listed: {listed})")
        return None
    device, host = set(cores[: len(cores) // 2]), set(cores[len(cores) // 2 :])
    k = args.lookahead
    lookaheads = sorted({0, k})
    runs: dict[Any, Callable[[], _training.Timing]] = {
        "blocking": functools.partial(bench.blocking, 0.02, "cache 2%, blocking")
    }
    for n in lookaheads:
        runs[n] = functools.partial(bench.loop, 0.02, f"cache 2%, lookahead {n}", n)
    runs["staged"] = bench.staged
    with _harness.split_cores(device, host):
        results = _harness.interleave(runs, args.rounds)

    def per_round(key: Any, part: str) -> list[float]:
        return [t.median(part) for t in results[key]]

    rows = [  # label, run, part
        ("(a) device step alone", "blocking", "device"),
        ("(b) host staging alone", "blocking", "staging"),
        ("    swap alone (device)", "blocking", "swap"),
        *((f"({'d' if n else 'c'}) cached, lookahead {n}", n, "step") for n in lookaheads),
        ("(g) full table, staged beforehand", "staged", "step"),
    ]
    ideal = max(float(np.median(per_round("blocking", part))) for part in ("device", "staging"))
    print(
        f"\nsplit cores: JAX's runtime threads on core(s) {sorted(device)}, the training thread "
        f"and the producer on {sorted(host)}; {args.rounds} round(s), median over the rounds of "
        "each run's median, ms per step"
    )
    header = f"{'':<36}{'ms/step':>8}{'range':>14}{'/ ideal':>8}{'|dloss|':>9}"
    print(header)
    print("-" * len(header))
    reference = results[0][0].loss
    for label, key, part in rows:
        values = per_round(key, part)
        seconds = float(np.median(values))
        spread = _harness.ms_range(values)
        line = f"{label:<36}{1e3 * seconds:>8.2f}{spread:>14}{seconds / ideal:>8.2f}"
        if part == "step":
            line += f"{abs(results[key][0].loss - reference):>9.1e}"
        print(line)
    print(
        "  ideal: max(a, b) under the split; (g): a loop of device steps with no host work "
        "left, the pace of the device (the device step alone, (a), also waits for its own "
        "dispatch; in a loop the next step's dispatch overlaps the step before). The cache's "
        "swap is device work too, between the steps. |dloss|: vs lookahead 0."
    )
    return float(np.median(per_round(k, "step"))) / ideal


def main(argv: list[str] | None = None) -> None:
    over_ideal = split_cores(_training.standalone(__doc__, argv))
    if over_ideal is not None:
        _harness.print_results({"pipelined_over_ideal_split_cores": over_ideal})


if __name__ == "__main__":
    main()
