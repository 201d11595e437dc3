"""Training through host tables on disk: the DRAM tier against NumPy and a memory map.

The model of the sizing question: a lookup of ``--features`` hashed-Zipf ids
per sample (``D = 64`` float32, row-wise Adagrad) feeding a linear model,
``--batch`` samples a step, a device cache of ``--capacity`` rows (LRU),
fed by ``jaxcache.prefetch(lookahead=2)``. The same batches and the
same initial model go through every host table:

- ``numpy``: ``HostTable``, NumPy arrays in memory (the reference);
- ``memmap``: ``HostTable(directory=...)``, the same rows memory-mapped;
- ``tiered fits``: ``TieredTable`` with a DRAM budget larger than the table;
- ``tiered 8x``: ``TieredTable`` with a DRAM budget of an eighth of the table
  (``--times``), the rest on disk;
- ``tiered 8x cold`` (with ``--cold``): the same, with the table's file
  dropped from the page cache after every step (``POSIX_FADV_DONTNEED``), so
  that every row not in DRAM is read from the device, as when the table is
  larger than the machine's memory.

Every variant runs ``--warmup`` steps, then ``--rounds`` rounds of
``--steps`` timed steps, interleaved (round 1 of every variant, then round 2,
...), so that a change of load falls on all of them, with an ``os.sync()``
after each (untimed), so that the disk writes one variant left in the page
cache do not slow the next. A step's time is the interval between two steps
of the loop; figures are the median over the rounds of each round's median.
The losses of all variants agree bit for bit (the cache is exact whatever
the host table).

The last lines are ``name=value`` ratios: ``tiered_fits_over_ram`` and
``tiered_8x_over_ram`` (steps/s over the NumPy table's), ``memmap_over_ram``,
``write_amplification`` (disk bytes the 8x table wrote per byte of dirty row
it wrote, over the timed steps), and ``disk_bytes_per_write_back_byte`` (the
same bytes per byte the device cache wrote back into the table).

    python benchmarks/beyond_ram.py                    # 4M rows (1 GiB), ~5 minutes
    python benchmarks/beyond_ram.py --rows 1000000 --steps 20 --rounds 1   # quick

The files go to ``--dir`` (default: a temporary directory) and are removed
at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import _harness
import jax
import numpy as np
import optax
from flax import nnx

import jaxcache
from jaxcache._src.tiered_table import INDEX_BYTES_PER_ROW


class Linear(nnx.Module):
    def __init__(self, embed: jaxcache.nnx.CachedEmbed, width: int) -> None:
        self.embed = embed
        self.out = nnx.Linear(width, 1, rngs=nnx.Rngs(0))

    def __call__(self, lookup: jaxcache.Lookup) -> jax.Array:
        emb = self.embed(lookup)
        return self.out(emb.reshape(emb.shape[0], -1))[:, 0]


@nnx.jit
def train_step(model, optimizer, lookup, labels):
    def loss_fn(model, lookup):
        return optax.sigmoid_binary_cross_entropy(model(lookup), labels).mean()

    loss, grads = jaxcache.nnx.value_and_grad(loss_fn)(model, lookup)
    optimizer.update(model, grads)
    return loss


def make_batches(args: argparse.Namespace) -> list[dict[str, np.ndarray]]:
    """Hashed Zipf ids: the hot rows are scattered over the table."""
    rng = np.random.default_rng(0)
    steps = args.warmup + args.rounds * args.steps
    out = []
    for _ in range(steps):
        ranks = rng.zipf(args.alpha, size=(args.batch, args.features)).astype(np.uint64)
        ids = ((ranks * np.uint64(0x9E3779B97F4A7C15)) % np.uint64(args.rows)).astype(np.int64)
        labels = (rng.random(args.batch) < 0.3).astype(np.float32)
        out.append({"ids": ids, "y": labels})
    return out


class Variant:
    """One host table, its cache and model, trained round by round."""

    def __init__(self, name: str, table: jaxcache.HostTable, args: argparse.Namespace) -> None:
        self.name = name
        self.table = table
        self.cache = jaxcache.EmbeddingCache(table.config, table=table)
        self.model = Linear(jaxcache.nnx.CachedEmbed(self.cache), args.features * 64)
        self.optimizer = nnx.Optimizer(self.model, optax.adam(1e-3), wrt=nnx.Param)
        self.cold = name.endswith("cold")
        self.medians: list[float] = []
        self.loss = float("nan")
        self.marks: dict[str, float] = {}

    def run(self, batches: list[dict], timed: bool) -> None:
        embed = self.model.embed
        times = []
        pending = None
        with jaxcache.prefetch(batches, {"ids": embed}, lookahead=2) as pipeline:
            last = time.perf_counter()
            for batch in pipeline:
                loss = train_step(self.model, self.optimizer, batch["ids"], batch["y"])
                if pending is not None:
                    self.loss = float(pending)  # read one step late, as a logging loop does
                pending = loss
                if self.cold:
                    for name in os.listdir(self.table.directory):
                        fd = os.open(os.path.join(self.table.directory, name), os.O_RDONLY)
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                        os.close(fd)
                now = time.perf_counter()
                times.append(now - last)
                last = now
        self.loss = float(pending)
        # The disk writes this variant left in the page cache go to the disk
        # now, not while the next variant runs (a memory map leaves most).
        os.sync()
        if timed:
            self.medians.append(float(np.median(times[1:])))

    def counters(self) -> dict[str, float]:
        timers = self.cache.stats.timers
        out = {
            "write_back": timers.seconds["write_back"],
            "gather": timers.seconds["gather"],
            "steps": self.cache.stats.steps,
            "rows_to_host": self.cache.stats.total.rows_to_host,
        }
        if isinstance(self.table, jaxcache.TieredTable):
            stats = self.table.stats()
            out.update(
                lookups=stats.dram.lookups,
                hits=stats.dram.hits,
                rows_read=stats.disk.rows_read,
                bytes_written=stats.disk.bytes_written,
                row_bytes_written=stats.disk.row_bytes_written,
            )
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4_000_000, help="rows of the table")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--features", type=int, default=26, help="ids per sample")
    parser.add_argument("--alpha", type=float, default=1.1, help="Zipf exponent")
    parser.add_argument(
        "--capacity", type=int, default=160_000, help="rows of the device cache (3 batches' ids)"
    )
    parser.add_argument("--times", type=int, default=8, help="table over DRAM budget")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cold", action="store_true", help="add the 8x table read cold")
    parser.add_argument("--no-memmap", action="store_true", help="leave the memory map out")
    parser.add_argument("--dir", help="where the files go (default: a temporary directory)")
    args = parser.parse_args()
    config = jaxcache.CacheConfig(
        args.rows,
        64,
        capacity=args.capacity,
        policy="lru",
        optimizer=jaxcache.rowwise_adagrad(0.05),
    )
    record = 64 * 4 + 4
    table_bytes = args.rows * record
    scratch = tempfile.mkdtemp(prefix="jaxcache-beyond-ram-", dir=args.dir)
    batches = make_batches(args)
    print(
        f"jax {jax.__version__} on {jax.default_backend()}, {os.cpu_count()} cores; table "
        f"{args.rows:,} rows x 64 float32 + row-wise Adagrad = {table_bytes / 2**30:.2f} GiB; "
        f"batch {args.batch} x {args.features} ids (Zipf {args.alpha}, hashed); device cache "
        f"{args.capacity:,} rows (LRU); prefetch lookahead 2"
    )
    try:
        tables = {"numpy": jaxcache.HostTable(config)}
        if not args.no_memmap:
            tables["memmap"] = jaxcache.HostTable(config, directory=os.path.join(scratch, "mm"))
        index = INDEX_BYTES_PER_ROW * args.rows
        tables["tiered fits"] = jaxcache.TieredTable(
            config, os.path.join(scratch, "fits"), dram_budget=index + table_bytes + (1 << 20)
        )
        small = table_bytes // args.times
        tables["tiered 8x"] = jaxcache.TieredTable(
            config, os.path.join(scratch, "8x"), dram_budget=small
        )
        if args.cold:
            tables["tiered 8x cold"] = jaxcache.TieredTable(
                config, os.path.join(scratch, "8x-cold"), dram_budget=small
            )
        variants = [Variant(name, table, args) for name, table in tables.items()]
        warm = batches[: args.warmup]
        for variant in variants:
            variant.run(warm, timed=False)
        start = {v.name: v.counters() for v in variants}
        for r in range(args.rounds):
            chunk = batches[args.warmup + r * args.steps : args.warmup + (r + 1) * args.steps]
            for variant in variants:
                variant.run(chunk, timed=True)
        report(variants, start, args, record)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def report(variants: list[Variant], start: dict, args: argparse.Namespace, record: int) -> None:
    timed = args.rounds * args.steps
    print(
        f"{args.warmup} warm-up steps, then {args.rounds} round(s) of {args.steps} timed steps, "
        "interleaved; medians over the rounds of each round's median"
    )
    header = (
        f"{'host table':<16}{'DRAM budget':>12}{'ms/step':>9}{'range':>14}{'steps/s':>9}"
        f"{'vs numpy':>9}{'write_back':>11}{'gather':>8}{'DRAM hit':>9}{'disk rd/step':>13}"
        f"{'final loss':>12}"
    )
    print(header)
    print("-" * len(header))
    base = float(np.median(variants[0].medians))
    figures = {}
    for v in variants:
        end = v.counters()
        delta = {k: end[k] - start[v.name][k] for k in end}
        ms = float(np.median(v.medians))
        figures[v.name] = (ms, delta)
        tiered = "lookups" in delta
        budget = f"{v.table.dram_budget / 2**20:,.0f} MiB" if tiered else "-"
        hit = f"{delta['hits'] / max(1, delta['lookups']):.3f}" if tiered else "-"
        reads = f"{delta['rows_read'] / timed:,.0f}" if tiered else "-"
        steps = delta["steps"]
        print(
            f"{v.name:<16}{budget:>12}{1e3 * ms:>9.1f}"
            f"{_harness.ms_range(v.medians, 1):>14}{1 / ms:>9.2f}"
            f"{base / ms:>9.2f}{1e3 * delta['write_back'] / steps:>11.1f}"
            f"{1e3 * delta['gather'] / steps:>8.1f}{hit:>9}{reads:>13}{v.loss:>12.6f}"
        )
    print(
        "write_back, gather: ms per step the pipeline's producer spent writing evicted rows "
        "into the host table and reading missed rows out of it (hidden behind the step while "
        "it is shorter); DRAM hit: rows found in the DRAM tier over rows asked of the table; "
        "disk rd/step: rows read from the disk per step."
    )
    ratios = {
        "tiered_fits_over_ram": base / figures["tiered fits"][0],
        "tiered_8x_over_ram": base / figures["tiered 8x"][0],
    }
    if "memmap" in figures:
        ratios["memmap_over_ram"] = base / figures["memmap"][0]
    if "tiered 8x cold" in figures:
        ratios["tiered_8x_cold_over_ram"] = base / figures["tiered 8x cold"][0]
    delta = figures["tiered 8x"][1]
    ratios["write_amplification"] = delta["bytes_written"] / max(1, delta["row_bytes_written"])
    ratios["disk_bytes_per_write_back_byte"] = delta["bytes_written"] / max(
        1, delta["rows_to_host"] * record
    )
    _harness.print_results(ratios)


if __name__ == "__main__":
    main()
