"""The training step with every batch staged beforehand: its cost to the calling thread.

The embedding-heavy configuration, full table, every batch's lookup and
inputs on the device before the loop (no host work left): the CPU time the
training thread spends calling the step, through ``nnx.jit`` (with
``nnx.cached_partial``) and through ``jaxcache.models.make_train_step``'s
single ``jax.jit`` over the variables; and the step's time when pooling
reads every position of the bags (``Lookup.positions`` dropped) instead of
the real ids only. ``--rounds`` interleaved rounds.

    python benchmarks/throughput_staged_steps.py --quick
"""

from __future__ import annotations

import functools
import time

import _harness
import _training
import numpy as np
from flax import nnx

import jaxcache
from jaxcache._src import models as models_src


def staged_steps(bench: _training.Bench) -> None:
    """The training step with every batch staged beforehand (full table):
    the CPU time of the calling thread per call through ``nnx.jit`` (and
    ``nnx.cached_partial``) against ``make_train_step``'s single ``jax.jit``
    over the variables, and the step's time when pooling reads every
    position of the bags (``Lookup.positions`` dropped) against the real
    ids only. ``--rounds`` interleaved rounds; medians over the rounds of
    each run's median, and their range."""
    args = bench.args
    variants = [
        ("nnx.jit + nnx.cached_partial", "real ids"),
        ("jaxcache.models.make_train_step", "real ids"),
        ("jaxcache.models.make_train_step", "all positions"),
    ]
    runs = {variant: functools.partial(_staged_step_times, bench, *variant) for variant in variants}
    results = _harness.interleave(runs, args.rounds)
    print()
    print(
        f"training step, {bench.setup.name}, full table, every batch staged beforehand; "
        f"{args.rounds} round(s), ms:"
    )
    print(f"  {'step':<34}{'pooling reads':<16}{'CPU per call':>18}{'step':>18}")
    for (kind, pooling), rounds in results.items():
        cells = ""
        for values in zip(*rounds, strict=True):
            spread = f"({_harness.ms_range(values)})"
            cells += f"{1e3 * np.median(values):>6.2f} {spread:>11}"
        print(f"  {kind:<34}{pooling:<16}{cells}")


def _staged_step_times(bench: _training.Bench, kind: str, pooling: str) -> tuple[float, float]:
    """Medians of the CPU time per call and of the step time of one run."""
    tx = bench.setup.dense_optimizer()
    cache = bench.cache(None)
    embed = jaxcache.nnx.CachedEmbed(cache, combiner=bench.setup.combiner)
    model = _training.make_model(bench.setup, embed, bench.args.seed)
    if kind.startswith("nnx"):
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        step = nnx.cached_partial(_nnx_train_step, model, optimizer)
    else:
        _, step = jaxcache.models.make_train_step(model, tx)
    lookups, inputs = _training.stage_all(
        cache, bench.batches, all_positions=pooling == "all positions"
    )
    cpu, wall = [], []
    for (dense, labels), lookup in zip(inputs, lookups, strict=True):
        start, tick = time.thread_time(), time.perf_counter()
        loss = step(dense, lookup, labels)
        cpu.append(time.thread_time() - start)
        loss.block_until_ready()
        wall.append(time.perf_counter() - tick)
    w = bench.args.warmup
    return float(np.median(cpu[w:])), float(np.median(wall[w:]))


# The body make_train_step jits, here through nnx.jit: the same step both ways.
_nnx_train_step = nnx.jit(models_src._train_step, donate_argnums=(0, 1))


def main(argv: list[str] | None = None) -> None:
    staged_steps(_training.standalone(__doc__, argv))


if __name__ == "__main__":
    main()
