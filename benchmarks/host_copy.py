"""Host row copies: NumPy indexing against the compiled row copy.

The two host copies of every cached step, at the embedding-heavy benchmark's
sizes (a 3.4M-row table of 16 float32 plus a row-wise Adagrad accumulator;
about 3,000 rows each way):

- **write-back**: rows at given positions of a swap's read-out into random
  rows of the table. NumPy: ``np.take`` out of the read-out, then fancy
  assignment ``table[ids] = rows``; compiled: ``kernels.copy_rows`` straight
  from the read-out (what ``HostTable.scatter(..., at=)`` does).
- **read**: random rows of the table into a fresh array. NumPy: ``np.take``
  (what ``HostTable.gather`` does); compiled: ``kernels.copy_rows``.

Each repetition first writes a buffer larger than the last-level cache, so
the table's rows come from memory as they do in a training loop. Medians and
ranges over ``--repeats`` repetitions, ``--rounds`` times, interleaved.

    python benchmarks/host_copy.py
"""

from __future__ import annotations

import argparse
import functools

import _harness
import numpy as np

from jaxcache._src import kernels

FLUSH_BYTES = 64 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=3_376_279, help="rows of the table")
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--moved", type=int, default=3_157, help="rows copied each way")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    table = rng.normal(size=(args.rows, args.features)).astype(np.float32)
    accumulator = rng.random(args.rows).astype(np.float32)
    read_out = rng.normal(size=(4096, args.features)).astype(np.float32)
    read_out_acc = rng.random(4096).astype(np.float32)
    ids = rng.choice(args.rows, args.moved, replace=False)
    at = rng.choice(4096, args.moved, replace=False)
    order = np.arange(args.moved)
    flush = np.zeros(FLUSH_BYTES // 8)

    def write_numpy() -> None:
        table[ids] = np.take(read_out, at, axis=0)
        accumulator[ids] = np.take(read_out_acc, at, axis=0)

    def write_compiled() -> None:
        kernels.copy_rows(table, ids, read_out, at)
        kernels.copy_rows(accumulator, ids, read_out_acc, at)

    def read_numpy() -> None:
        np.take(table, ids, axis=0)
        np.take(accumulator, ids, axis=0)

    def read_compiled() -> None:
        rows = np.empty((args.moved, args.features), np.float32)
        acc = np.empty(args.moved, np.float32)
        kernels.copy_rows(rows, order, table, ids)
        kernels.copy_rows(acc, order, accumulator, ids)

    variants = {
        "write-back, np.take + fancy assignment": write_numpy,
        "write-back, compiled copy": write_compiled,
        "read, np.take": read_numpy,
        "read, compiled copy": read_compiled,
    }
    for fn in variants.values():  # compile, and touch the pages once
        fn()

    def flush_caches() -> None:
        np.add(flush, 1, out=flush)

    runs = {
        name: functools.partial(_harness.median_time, fn, args.repeats, before=flush_caches)
        for name, fn in variants.items()
    }
    results = _harness.interleave(runs, args.rounds)
    print(
        f"{args.moved:,} rows of {args.features} float32 and an accumulator, table of "
        f"{args.rows:,} rows; median of {args.repeats} per round, {args.rounds} rounds, ms"
    )
    for name, values in results.items():
        print(f"  {name:<42}{1e3 * np.median(values):7.3f}  ({_harness.ms_range(values, 3)})")


if __name__ == "__main__":
    main()
