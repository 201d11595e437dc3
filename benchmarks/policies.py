"""Eviction policies on generated traces: steady hit rates, Belady's ceiling, planner speed.

Every trace is generated here (seeded), in the shapes that decide which fixed
policy wins:

- ``zipf``: the synthetic Criteo-like stream (26 features, Zipf 1.15 per
  feature, one shared table), stationary;
- ``drift``: Zipf popularity over a table whose ranking slides by 25 ranks a
  batch, so rows rise through the ranks and fall out of favour;
- ``reuse``: half of each batch drawn from a small pool of active ids that
  turns over (sessions), half from a stationary Zipf;
- ``scan``: 30% of every batch are ids never seen before or again, mixed into
  a stationary Zipf hot set;
- ``turns``: two populations (Zipf over the two halves of the table) take
  turns every 10 batches, as day and night traffic do;
- ``movielens``: MovieLens-100K ratings in time order (user and item rows in
  one table, 256 ratings a batch), when ``--recbole-wheel`` points at the
  RecBole 1.2.1 wheel (``pip download --no-deps recbole==1.2.1``), read
  through ``jaxcache.datasets.movielens_from_recbole``.

Each at three capacities. Every run is a replay (``jaxcache.sizing.sweep``) with the
steady hit rate of ``jaxcache replay``: distinct ids resident over distinct
ids, after the first quarter of the batches. The dataset counts (counted over
the whole trace, as a frequency profile of the training data is) go to the
``frequency`` policy and as the prior of ``adaptive``; ``lfu`` and ``lru``
are online and take none. Two simulators of published layouts, for this
benchmark only, complete the fixed policies:

- ``setassoc``: a 32-way set-associative LRU (FBGEMM's cache layout): an id
  may only live in the 32 slots of its hashed set; when a batch needs more
  than 32 rows of one set, the extra ones are served uncached (misses);
- ``hotset``: a static hot set (FAE): the hottest rows by the dataset
  counts, pinned, leave exactly room for the largest batch, whose other
  rows pass through an LRU buffer.

``best fixed`` is the best of those five; ``belady`` the offline optimum
under the same batch rule. Prints one row per trace and capacity, then the
summary ratios as ``name=value`` lines, and (``--planner``) the planner's ids/s
with each policy on the embedding-heavy batch of ``benchmarks/throughput.py``.

    python benchmarks/policies.py                      # about 3 minutes on 2 cores
    python benchmarks/policies.py --recbole-wheel recbole-1.2.1-py3-none-any.whl
    python benchmarks/policies.py --planner            # and the planner's speed
    python benchmarks/policies.py --device-planner     # and the device planner's rates
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import tempfile
import time
import zipfile
from collections.abc import Callable

import _harness
import numba
import numpy as np

import jaxcache
import jaxcache.datasets as jd

FIXED = ("frequency", "lfu", "lru", "setassoc", "hotset")


# ------------------------------------------------------------------- traces
def _zipf_ranks(rng: np.random.Generator, n: int, size: int, alpha: float) -> np.ndarray:
    """Ranks in ``[0, n)`` of a Zipf law (inverse CDF of the continuous power law)."""
    mass = 1.0 - (n + 1.0) ** (1.0 - alpha)
    x = (1.0 - rng.random(size) * mass) ** (1.0 / (1.0 - alpha))
    return np.minimum(x.astype(np.int64) - 1, n - 1)


def zipf(steps: int = 400, batch: int = 128, scale: float = 0.01, seed: int = 0):
    """The synthetic Criteo-like stream: ``([S, B * 26] ids, N)``."""
    data = jaxcache.synthetic.SyntheticCriteo(scale=scale, batch_size=batch, seed=seed)
    trace = np.stack([b["sparse"].reshape(-1) for b in data.batches(steps)])
    return trace, data.num_embeddings


def drift(steps: int = 400, batch: int = 4096, n: int = 200_000, speed: int = 25, seed: int = 1):
    """Zipf (1.05) over ranks that slide by ``speed`` every batch."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    trace = np.stack(
        [order[(_zipf_ranks(rng, n, batch, 1.05) + speed * t) % n] for t in range(steps)]
    )
    return trace, n


def reuse(
    steps: int = 400,
    batch: int = 4096,
    n: int = 200_000,
    active: int = 3000,
    turnover: float = 0.2,
    seed: int = 2,
):
    """Half of each batch from ``active`` ids of which ``turnover`` are replaced
    every batch, half from a stationary Zipf (1.05)."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    pool = rng.integers(0, n, active)
    half = batch // 2
    trace = np.empty((steps, batch), np.int64)
    for t in range(steps):
        fresh = rng.random(active) < turnover
        pool[fresh] = rng.integers(0, n, int(fresh.sum()))
        trace[t, :half] = pool[rng.integers(0, active, half)]
        trace[t, half:] = order[_zipf_ranks(rng, n, batch - half, 1.05)]
    return trace, n


def scan(
    steps: int = 400, batch: int = 4096, hot: int = 100_000, share: float = 0.3, seed: int = 3
):
    """``share`` of each batch are fresh ids (never repeated), the rest Zipf
    (1.05) over ``hot`` ids."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(hot)
    once = int(share * batch)
    trace = np.empty((steps, batch), np.int64)
    for t in range(steps):
        trace[t, :once] = hot + t * once + np.arange(once)
        trace[t, once:] = order[_zipf_ranks(rng, hot, batch - once, 1.05)]
    return trace, hot + steps * once


def turns(steps: int = 400, batch: int = 4096, n: int = 200_000, turn: int = 10, seed: int = 4):
    """Two populations, Zipf (1.05) over the two halves of a shuffled table,
    take turns every ``turn`` batches (day and night)."""
    rng = np.random.default_rng(seed)
    halves = rng.permutation(n).reshape(2, -1)
    return np.stack(
        [halves[(t // turn) % 2][_zipf_ranks(rng, n // 2, batch, 1.05)] for t in range(steps)]
    ), n


def movielens(wheel: str | pathlib.Path, ratings_per_batch: int = 256):
    """MovieLens-100K in time order: per rating its user row and its item row
    (items after the users), ``ratings_per_batch`` ratings a batch."""
    with tempfile.TemporaryDirectory() as folder:
        archive = jd.movielens_from_recbole(wheel, folder)
        with zipfile.ZipFile(archive) as z:
            rows = np.loadtxt(z.open("ml-100k/u.data"), dtype=np.int64)
    user, item, when = rows[:, 0], rows[:, 1], rows[:, 3]
    order = np.lexsort((item, user, when))
    users, user_index = np.unique(user, return_inverse=True)
    items, item_index = np.unique(item, return_inverse=True)
    ids = np.stack([user_index, users.size + item_index], axis=1)[order]
    steps = len(ids) // ratings_per_batch
    return ids[: steps * ratings_per_batch].reshape(steps, -1), users.size + items.size


@dataclasses.dataclass(frozen=True)
class Trace:
    """A generated trace and the capacities (fractions of its table) to try."""

    name: str
    make: Callable[[], tuple[np.ndarray, int]]
    capacities: tuple[float, ...]


def traces(wheel: str | None = None) -> list[Trace]:
    """The benchmark's traces at full size."""
    out = [
        Trace("zipf", zipf, (0.005, 0.015, 0.05)),
        Trace("drift", drift, (0.015, 0.03, 0.06)),
        Trace("reuse", reuse, (0.015, 0.03, 0.06)),
        Trace("scan", scan, (0.005, 0.01, 0.02)),
        Trace("turns", turns, (0.015, 0.03, 0.06)),
    ]
    if wheel is not None:
        out.append(Trace("movielens", lambda: movielens(wheel), (0.2, 0.3, 0.4)))
    return out


# -------------------------------------------------- reference simulators
@numba.njit
def _set_associative(unique, sizes, sets, ways):
    """Hits per batch of a ``ways``-way set-associative LRU over ``sets`` sets."""
    row = np.full((sets, ways), -1, np.int64)
    stamp = np.full((sets, ways), -1, np.int64)
    hits = np.zeros(sizes.size, np.int64)
    start = 0
    for t in range(sizes.size):
        batch = unique[start : start + sizes[t]]
        start += sizes[t]
        homes = (batch * -7046029254386353131 >> 20) % sets
        for u in range(batch.size):
            i, home = batch[u], homes[u]
            for w in range(ways):
                if row[home, w] == i:
                    hits[t] += 1
                    stamp[home, w] = t
                    break
        for u in range(batch.size):
            i, home = batch[u], homes[u]
            present = False
            for w in range(ways):
                present |= row[home, w] == i
            if present:
                continue
            oldest = -1
            for w in range(ways):  # the least recent way no row of this batch holds
                if stamp[home, w] < t and (oldest < 0 or stamp[home, w] < stamp[home, oldest]):
                    oldest = w
            if oldest >= 0:  # else: every way holds this batch's rows; served uncached
                row[home, oldest] = i
                stamp[home, oldest] = t
    return hits


def set_associative(batches: list[np.ndarray], capacity: int, ways: int = 32) -> np.ndarray:
    """FBGEMM's layout: hits per batch of a ``ways``-way set-associative LRU."""
    unique = [np.unique(b) for b in batches]
    sizes = np.array([u.size for u in unique])
    return _set_associative(np.concatenate(unique), sizes, max(1, capacity // ways), ways)


def hot_set(batches: list[np.ndarray], capacity: int, counts: np.ndarray) -> np.ndarray:
    """FAE: hits per batch of a pinned hot set that leaves room for the largest
    batch, the other rows going through an LRU buffer of that room."""
    room = max(np.unique(b).size for b in batches)
    hot = np.zeros(counts.size, bool)
    hot[jaxcache.planning.hottest(counts, capacity - room)] = True
    buffer = jaxcache.planning.Planner(jaxcache.CacheConfig(counts.size, 1, room, policy="lru"))
    hits = np.zeros(len(batches), np.int64)
    for t, ids in enumerate(batches):
        unique = np.unique(ids)
        cold = unique[~hot[unique]]
        hits[t] = unique.size - cold.size
        if cold.size:
            plan = buffer.plan(cold)
            buffer.release(plan.index)
            hits[t] += plan.hits
    return hits


def steady(hits: np.ndarray, sizes: np.ndarray) -> float:
    """Hits over distinct ids after the first quarter of the batches."""
    quarter = len(sizes) // 4
    return float(hits[quarter:].sum() / sizes[quarter:].sum())


# -------------------------------------------------------------------- runs
def run_trace(
    trace: np.ndarray, n: int, fractions: tuple[float, ...], device_planner: bool = False
) -> list[dict]:
    """Steady hit rates of every policy at each capacity: one dict per capacity.
    With ``device_planner``, each of the four policies is replayed again by
    the device planner (its rate under ``"<policy> (device)"``)."""
    counts = np.bincount(trace.reshape(-1), minlength=n)
    capacities = [jaxcache.CacheConfig(n, 1, f).capacity for f in fractions]
    rates: dict[tuple[str, int], float] = {}
    for policy, prior in (
        ("adaptive", counts),
        ("frequency", counts),
        ("lfu", None),
        ("lru", None),
        ("belady", None),
    ):
        for r in jaxcache.sizing.sweep(
            trace, capacities=capacities, policies=[policy], num_embeddings=n, frequencies=prior
        ):
            rates[policy, r["capacity"]] = r["steady_unique_hit_rate"]
        if device_planner and policy != "belady":
            for r in jaxcache.sizing.sweep(
                trace,
                capacities=capacities,
                policies=[policy],
                num_embeddings=n,
                frequencies=prior,
                planner="device",
            ):
                rates[f"{policy} (device)", r["capacity"]] = r["steady_unique_hit_rate"]
    for r in jaxcache.sizing.sweep(
        trace, capacities=capacities, policies=["adaptive"], num_embeddings=n
    ):
        rates["adaptive (no counts)", r["capacity"]] = r["steady_unique_hit_rate"]
    batches = list(trace)
    sizes = np.array([np.unique(b).size for b in batches])
    rows = []
    for fraction, c in zip(fractions, capacities, strict=True):
        rates["setassoc", c] = steady(set_associative(batches, c), sizes)
        rates["hotset", c] = steady(hot_set(batches, c, counts), sizes)
        row = {"capacity": c, "fraction": fraction}
        row.update({name: rate for (name, cap), rate in rates.items() if cap == c})
        row["best fixed"] = max(FIXED, key=lambda name: row[name])
        rows.append(row)
    return rows


def summary(rows: list[dict]) -> dict[str, float]:
    """The targets' ratios over all rows."""
    margins = np.array([r["adaptive"] - r[r["best fixed"]] for r in rows])
    gap_fixed = np.mean([r["belady"] - r[r["best fixed"]] for r in rows])
    gap_adaptive = np.mean([r["belady"] - r["adaptive"] for r in rows])
    return {
        "rows": len(rows),
        "rows_at_least_best_fixed_minus_0.005": int((margins >= -0.005).sum()),
        "rows_at_least_best_fixed_plus_0.02": int((margins >= 0.02).sum()),
        "worst_margin_over_best_fixed": float(margins.min()),
        "mean_margin_over_best_fixed": float(margins.mean()),
        "mean_gap_to_belady_best_fixed": float(gap_fixed),
        "mean_gap_to_belady_adaptive": float(gap_adaptive),
        "gap_to_belady_adaptive_over_best_fixed": float(gap_adaptive / gap_fixed),
    }


def planner_speed(policies: tuple[str, ...], rounds: int, steps: int) -> dict[str, float]:
    """M ids/s of ``Planner.plan`` + ``release`` per policy, on the
    embedding-heavy batch of ``benchmarks/throughput.py`` (1024 samples of 26
    multi-hot bags of up to 16 ids, a 3.4M-row table, 5% capacity, a profile
    of 20 batches for the counting policies).

    Every batch is planned by each policy's planner in turn, ``steps`` timed
    batches after 20 untimed ones, ``rounds`` times with fresh planners; the
    time is the planning thread's CPU time (``time.thread_time``), which
    other processes on a shared machine disturb far less than the wall
    clock. Medians over all timed plans.
    """
    data = jaxcache.synthetic.SyntheticCriteo(
        scale=0.1, batch_size=1024, multi_hot=True, bag_size=16
    )
    batches = [data.batch(i)["sparse"] for i in range(20 + steps)]
    profile = data.count_frequencies(20)
    ids_per_batch = int((batches[0] != data.padding_id).sum())
    times: dict[str, list[float]] = {p: [] for p in policies}
    for _ in range(rounds):
        planners = {
            policy: jaxcache.planning.Planner(
                jaxcache.CacheConfig(
                    data.num_embeddings, 16, 0.05, policy=policy, padding_id=data.padding_id
                ),
                frequencies=None if policy == "lru" else profile,
            )
            for policy in policies
        }
        for i, ids in enumerate(batches):
            for policy, planner in planners.items():
                start = time.thread_time()
                planner.release(planner.plan(ids).index)
                if i >= 20:
                    times[policy].append(time.thread_time() - start)
    return {p: ids_per_batch / float(np.median(t)) / 1e6 for p, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recbole-wheel", help="the RecBole 1.2.1 wheel, for MovieLens-100K")
    parser.add_argument("--planner", action="store_true", help="also time the planner")
    parser.add_argument("--rounds", type=int, default=3, help="planner rounds")
    parser.add_argument("--steps", type=int, default=30, help="timed plans per round")
    parser.add_argument(
        "--device-planner",
        action="store_true",
        help="replay the policies with the device planner too, and print the largest "
        "difference of its hit rates from the host planner's",
    )
    args = parser.parse_args()
    names = ["adaptive", *FIXED, "belady", "adaptive (no counts)"]
    header = "".join(f"{name.split(' ')[0][:9]:>10}" for name in names)
    print("steady hit rate (distinct ids, after the first quarter of the batches)")
    print(f"{'trace':<10}{'capacity':>16}{header}{'best fixed':>12}{'margin':>8}")
    rows = []
    for trace in traces(args.recbole_wheel):
        ids, n = trace.make()
        for row in run_trace(ids, n, trace.capacities, args.device_planner):
            rows.append(row)
            cells = "".join(f"{row[name]:>10.3f}" for name in names)
            margin = row["adaptive"] - row[row["best fixed"]]
            size = f"{row['capacity']:,} ({row['fraction']:.1%})"
            print(
                f"{trace.name:<10}{size:>16}{cells}{row['best fixed']:>12}{margin:>+8.3f}",
                flush=True,
            )
    print("(last column of rates: the adaptive policy without the dataset counts)")
    _harness.print_results(summary(rows), digits=4)
    if args.device_planner:
        differences = [
            abs(row[f"{policy} (device)"] - row[policy])
            for row in rows
            for policy in ("adaptive", "frequency", "lfu", "lru")
        ]
        _harness.print_results({"device_planner_max_hit_rate_difference": max(differences)})
    if args.planner:
        speed = planner_speed(("lfu", "adaptive", "lru", "frequency"), args.rounds, args.steps)
        _harness.print_results(
            {f"planner_mids_per_s_{policy}": rate for policy, rate in speed.items()}, digits=2
        )
        _harness.print_results({"planner_adaptive_over_lfu": speed["adaptive"] / speed["lfu"]})


if __name__ == "__main__":
    main()
