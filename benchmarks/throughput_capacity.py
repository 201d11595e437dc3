"""The blocking parts at capacities x1 and x8 of 2%: the step must not grow with the capacity.

The embedding-heavy configuration, blocking runs (``_training.run_blocking``)
through caches of 2% and 16% of the rows: the device step's median (and
minimum), staging and swap, in milliseconds. The cache is donated to the
training step, never copied, so a larger cache must not make the step
slower.

    python benchmarks/throughput_capacity.py --quick
"""

from __future__ import annotations

import _training


def capacity_scaling(bench: _training.Bench) -> None:
    """Device step time at capacities x1 and x8: must not grow with the capacity."""
    print()
    print(f"capacity x1 vs x8 ({bench.setup.name}, {bench.args.policy}), blocking, medians in ms:")
    for multiple in (1, 8):
        t = bench.blocking(min(1.0, 0.02 * multiple), "")
        print(
            f"  x{multiple}: capacity {t.rows_on_device:>9,} rows   device step "
            f"{1e3 * t.median('device'):6.2f} (min {1e3 * min(t.parts['device']):5.2f})   "
            f"staging {1e3 * t.median('staging'):6.2f}   swap {1e3 * t.median('swap'):5.2f}   "
            f"(hit rate {t.hit_rate:.3f})"
        )
    print("  The device step must not grow with the capacity (the cache is donated to it).")


def main(argv: list[str] | None = None) -> None:
    capacity_scaling(_training.standalone(__doc__, argv))


if __name__ == "__main__":
    main()
