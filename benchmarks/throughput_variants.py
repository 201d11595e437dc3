"""Every variant of a configuration in one table: full table, caches, naive callback.

One run, the same synthetic batches and the same initial model for every
variant of a configuration:

- ``full table``: every row on device (``EmbeddingCache.full_table``), sparse
  row updates: the speed a cache aims at;
- ``cache X%``: X% of the rows on device, the rest in host memory;
- ``naive callback``: rows gathered from a host NumPy table by
  ``jax.pure_callback`` inside the step (``throughput_naive.py``).

Each cached variant runs twice: blocking (``staging``, ``swap`` and
``device`` timed alone) and in a loop fed by ``jaxcache.prefetch`` with
``--lookahead`` batches staged ahead (``_training.py`` says how each is
timed). The caches end with the full table's loss (a cache is exact,
pipelined or not); the naive variant computes the same thing in another XLA
program, so rounding makes it drift. Both configurations, ``dlrm`` and
``embedding-heavy``:

    python benchmarks/throughput_variants.py --quick
"""

from __future__ import annotations

import dataclasses

import _training
import numpy as np
import throughput_naive


@dataclasses.dataclass
class Variant:
    """One variant of a configuration: its blocking run and its loop run."""

    name: str
    blocking: _training.Timing
    loop: _training.Timing | None = None

    @property
    def step(self) -> float:
        return self.loop.median("step") if self.loop else self.blocking.blocking


def variant(bench: _training.Bench, fraction: float | None) -> Variant:
    """The blocking run and the loop of ``fraction`` of the rows (``None``: the full table)."""
    name = "full table" if fraction is None else f"cache {100 * fraction:g}%"
    lookahead = bench.args.lookahead
    return Variant(
        name,
        bench.blocking(fraction, name),
        bench.loop(fraction, f"{name}, lookahead {lookahead}", lookahead),
    )


def compare(bench: _training.Bench) -> list[Variant]:
    """Every variant of the configuration on the same batches, and their table."""
    variants = [variant(bench, None)]
    variants += [variant(bench, fraction) for fraction in bench.args.fractions]
    naive = throughput_naive.run_naive(bench.setup, bench.batches, bench.base, **bench.common)
    variants.append(Variant(naive.name, naive))
    print_table(bench.setup, variants, bench.args.lookahead)
    return variants


def print_table(setup: _training.Setup, variants: list[Variant], lookahead: int) -> None:
    full = variants[0]
    print()
    print(setup.describe())
    header = (
        f"{'variant':<16}{'rows on dev':>12}{'hit rate':>9}{'staging':>9}{'swap':>7}"
        f"{'device':>8}{'blocking':>9}{'loop ms':>9}{'steps/s':>9}{'vs full':>8}"
        f"{'compiles':>9}{'final loss':>12}{'|dloss|':>9}"
    )
    print(header)
    print("-" * len(header))
    for v in variants:
        b = v.blocking
        hit = "-" if np.isnan(b.hit_rate) else f"{b.hit_rate:.3f}"
        loss = v.loop.loss if v.loop else b.loss
        compiles = b.compilations + (v.loop.compilations if v.loop else 0)
        print(
            f"{v.name:<16}{b.rows_on_device:>12,}{hit:>9}{1e3 * b.median('staging'):>9.2f}"
            f"{1e3 * b.median('swap'):>7.2f}{1e3 * b.median('device'):>8.2f}"
            f"{1e3 * b.blocking:>9.2f}{1e3 * v.step:>9.2f}{1 / v.step:>9.1f}"
            f"{full.step / v.step:>7.2f}x{compiles:>9}{loss:>12.6f}"
            f"{abs(loss - full.loop.loss):>9.1e}"
        )
    for v in variants:
        for t in (v.blocking, v.loop):
            if t and t.phases and not v.name.startswith("full"):
                parts = ", ".join(f"{k} {x:.2f}" for k, x in t.phases.items() if x > 0)
                run = "loop" if t is v.loop else "blocking"
                print(f"  {v.name} {run}, cache phases, mean ms per call: {parts}")
    print(
        "staging: plan + needed write-backs + gather + transfer start; swap: on device "
        "(naive: host row update); device: jitted step (naive: with callback gathers); "
        "blocking: the three, one after the other."
    )
    print(
        f"loop: interval between steps of a loop fed by jaxcache.prefetch(lookahead="
        f"{lookahead}) (naive: blocking); steps/s and vs full from it. Medians."
    )
    print(
        "|dloss|: final loss vs full table. The caches run the full table's step and match "
        "it; the naive step is another XLA program, whose rounding drifts over the steps."
    )


def main(argv: list[str] | None = None) -> None:
    args = _training.parse_args(__doc__, argv)
    _training.print_machine(args)
    compare(_training.Bench(_training.dlrm(args), args))
    compare(_training.Bench(_training.embedding_heavy(args), args))


if __name__ == "__main__":
    main()
