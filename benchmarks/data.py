"""Data throughput: building Criteo-format files into TFDS, and the batch loader.

Writes a Criteo-format file of ``--rows`` random lines (``write_fake_criteo``:
skewed ids, 10% missing fields) in a temporary directory (removed at the
end), then measures:

- **build**: ``CriteoBuilder`` from the text file (parse, reduce the ids,
  write ArrayRecord chunks of 4096 rows), plain and gzipped; and the
  ``SyntheticCriteoBuilder`` for comparison;
- **read**: ``source[i]`` over every record (ArrayRecord read, zstd
  decompression, protobuf decoding), no batching;
- **loader**: ``jaxcache.datasets.Loader`` batches (``{"dense": float32
  [B, 13], "sparse": int64 [B, 26], "label": float32 [B]}``), in order and
  shuffled (record order + a window of 16 records), for a few batch sizes;
- **criteo_batches**: the loader plus the shared-table ids, as DLRM reads;
- **frequencies**: ``count_frequencies`` over the split (first call).

Rates are samples per second of wall-clock time, and per CPU-second of this
process (``time.process_time``), which is steadier on a busy machine. By
default the process is pinned to one core (``--cores``).

    python benchmarks/data.py               # about a minute
    python benchmarks/data.py --rows 2000000
"""

from __future__ import annotations

import argparse
import itertools
import os
import pathlib
import tempfile
import time

import _harness
import numpy as np

import jaxcache.datasets as jd


def timed(fn):
    """``(result, wall seconds, CPU seconds)`` of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def row(name: str, samples: int, wall: float, cpu: float) -> None:
    print(f"{name:<44} {samples:>10,} {samples / wall:>14,.0f} {samples / max(cpu, 1e-9):>14,.0f}")


def consume(batches) -> int:
    return sum(len(b["label"]) for b in batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=500_000, help="lines of the Criteo file")
    parser.add_argument("--epochs", type=int, default=3, help="loader passes per measurement")
    parser.add_argument(
        "--cores", type=int, default=1, help="pin the process to this many cores (0: no pinning)"
    )
    args = parser.parse_args()
    if args.cores > 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.cores])
    with tempfile.TemporaryDirectory(prefix="jaxcache-data-") as scratch:
        measure(args, pathlib.Path(scratch), _harness.cores())


def measure(args: argparse.Namespace, tmp: pathlib.Path, cores: int) -> None:
    """Writes the files under ``tmp`` (removed afterwards) and prints the table."""
    manual, manual_gz = tmp / "manual", tmp / "manual_gz"
    text = jd.write_fake_criteo(manual / "train.txt", args.rows, seed=0)
    jd.write_fake_criteo(manual_gz / "train.txt.gz", args.rows, seed=0)
    print(
        f"{args.rows:,} Criteo lines ({text.stat().st_size / 2**20:.0f} MiB) in {tmp}; "
        f"{cores} core(s)"
    )
    print(f"{'':<44} {'samples':>10} {'samples/s':>14} {'samples/cpu-s':>14}")

    builder = jd.CriteoBuilder(config="kaggle", data_dir=tmp / "data")
    _, wall, cpu = timed(lambda: jd.prepare(builder, manual))
    row("build criteo (train.txt)", args.rows, wall, cpu)
    gz = jd.CriteoBuilder(config="kaggle", data_dir=tmp / "data_gz")
    _, wall, cpu = timed(lambda: jd.prepare(gz, manual_gz))
    row("build criteo (train.txt.gz)", args.rows, wall, cpu)
    config = jd.SyntheticCriteoConfig(name="bench", num_rows=args.rows, num_test_rows=4096)
    synthetic = jd.SyntheticCriteoBuilder(config=config, data_dir=tmp / "data")
    _, wall, cpu = timed(lambda: jd.prepare(synthetic))
    row("build synthetic_criteo", args.rows, wall, cpu)
    size = sum(f.stat().st_size for f in pathlib.Path(builder.data_dir).glob("*array_record*"))
    print(f"  stored: {size / 2**20:.0f} MiB, {size / args.rows:.0f} bytes per sample")

    source = builder.as_data_source("train")
    _, wall, cpu = timed(lambda: [source[i] for i in range(len(source))])
    row("read records (no batching)", args.rows, wall, cpu)
    for batch_size, shuffle in itertools.product((1024, 4096, 16384), (False, True)):
        loader = jd.Loader(source, batch_size, shuffle=shuffle, num_epochs=args.epochs)
        samples, wall, cpu = timed(lambda loader=loader: consume(loader))
        row(f"loader B={batch_size} {'shuffled' if shuffle else 'in order'}", samples, wall, cpu)
    data = jd.criteo_batches(builder=builder, batch_size=4096, num_epochs=args.epochs)
    samples, wall, cpu = timed(lambda: consume(data.batches))
    row("criteo_batches B=4096 shuffled, shared ids", samples, wall, cpu)
    _, wall, cpu = timed(lambda: jd.count_frequencies(builder, "train", cache=False))
    row("count_frequencies (33.8M-row table)", args.rows, wall, cpu)
    counts = jd.count_frequencies(builder, "train")
    top = np.sort(counts)[::-1]
    print(
        f"  hottest 1% of used rows take "
        f"{top[: max(1, np.count_nonzero(counts) // 100)].sum() / counts.sum():.0%} of lookups"
    )


if __name__ == "__main__":
    main()
