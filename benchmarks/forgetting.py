"""Which ids a full vocabulary forgets: each rule, and the learned bonus, on four traces.

A dynamic vocabulary gives a new id a row by taking a stale id's
(``DynamicVocabulary(forget=...)``). A lookup of an id that had no row
before its batch reads a fresh row, not a trained one: the better rule
misses fewer lookups. ``jaxcache.sizing.replay_vocabulary`` admits each
trace into the same budget under each rule (no model: the vocabulary's
choices depend on the ids alone):

- **zipf**: a fixed Zipf skew over 400,000 ids;
- **scan**: half of each batch from that skew, half ids never seen before;
- **rise**: the skew's ranks move on through the ids by ``1/10`` of the
  budget a batch: an id climbs towards the top ranks batch by batch, then
  leaves them for good;
- **cycle**: the same over a ring of 400,000 ids, so that each id comes
  back 100 batches after it left (a day's traffic, in small).

Printed per trace: ``<trace>_<rule>_missed`` (the share of lookups of ids
without a row before their batch) for ``lru``, ``lfu``, ``lrfu`` (bonus 8)
and ``adaptive`` (the bonus learned by the end, ``<trace>_adaptive_bonus``),
``<trace>_<rule>_missed_late`` (the same over the second half of the
batches: what the learned bonus does once it has seen ids come back), and
``<trace>_adaptive_over_best_fixed`` (``_late``): the adaptive rule's
missed lookups over the fewest of the fixed rules'.

    python benchmarks/forgetting.py          # under a minute on 2 CPU cores
    python benchmarks/forgetting.py --quick
"""

from __future__ import annotations

import argparse
import time

import _harness
import numpy as np

import jaxcache

RULES = ("lru", "lfu", "lrfu", "adaptive")


def traces(steps: int, batch: int, rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``[steps, batch]`` raw-id traces (see the module)."""
    rng = np.random.default_rng(seed)
    universe = 400_000
    ranks = np.minimum(rng.zipf(1.1, (steps, batch)) - 1, universe - 1)
    permutation = rng.permutation(universe + steps * batch)
    zipf = permutation[ranks]
    scan = zipf.copy()
    scan[:, batch // 2 :] = universe + np.arange(steps * (batch - batch // 2)).reshape(steps, -1)
    shift = (np.arange(steps) * (rows // 10))[:, None]
    rise = permutation[ranks + shift]  # an id that left the top ranks stays out
    cycle = permutation[(ranks + shift) % universe]
    named = (("zipf", zipf), ("scan", scan), ("rise", rise), ("cycle", cycle))
    return {name: _harness.raw_ids(t) for name, t in named}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=40_000, help="the row budget")
    parser.add_argument("--quick", action="store_true", help="60 steps of 4,096 ids")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.rows = 60, 4096, 20_000
    print(_harness.machine())
    print(f"{args.steps} batches of {args.batch} ids, a budget of {args.rows} rows")
    results: dict[str, float] = {}
    start = time.perf_counter()
    for name, trace in traces(args.steps, args.batch, args.rows).items():
        missed, late = {}, {}
        for rule in RULES:
            spec = jaxcache.DynamicVocabulary(forget=rule)
            # The replay of the first half is the whole one's prefix: the
            # difference of the two is the second half's.
            half, out = (
                jaxcache.sizing.replay_vocabulary(t, rows=args.rows, vocabulary=spec)
                for t in (trace[: args.steps // 2], trace)
            )
            missed[rule] = 1 - out["found_lookups"] / out["lookups"]
            late[rule] = 1 - (out["found_lookups"] - half["found_lookups"]) / (
                out["lookups"] - half["lookups"]
            )
            results[f"{name}_{rule}_missed"] = missed[rule]
            results[f"{name}_{rule}_missed_late"] = late[rule]
            if rule == "adaptive":
                results[f"{name}_adaptive_bonus"] = out["bonus"]
        for label, shares in (("", missed), ("_late", late)):
            best = min(shares[rule] for rule in RULES if rule != "adaptive")
            results[f"{name}_adaptive_over_best_fixed{label}"] = shares["adaptive"] / best
        for label, shares in (("missed", missed), ("late", late)):
            text = ", ".join(f"{rule} {share:.4f}" for rule, share in shares.items())
            print(f"{name}: {label} {text} ({time.perf_counter() - start:.0f} s)")
    _harness.print_results(results, digits=4)


if __name__ == "__main__":
    main()
