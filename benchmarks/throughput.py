"""Training throughput: the cache against the whole table on device and a naive host table.

One run, the same synthetic batches and the same initial model for every
variant of a configuration:

- ``full table``: every row on device (``EmbeddingCache.full_table``), sparse
  row updates: the speed a cache aims at;
- ``cache X%``: X% of the rows on device, the rest in host memory;
- ``naive callback``: rows gathered from a host NumPy table by
  ``jax.pure_callback`` inside the step; the step returns the rows' gradients
  and the host applies the same row-wise Adagrad update.

Two configurations: ``dlrm`` (the DLRM reference MLPs, one id per feature)
and ``embedding-heavy`` (small MLPs, multi-hot bags of DCNv2 sizes: about
4.6x the ids per sample), where host work is a large share of a step.

Each step is measured synchronously in three parts: ``plan`` (host planner:
distinct ids, hits, victims), ``move`` (host gather of missing rows, transfer,
swap on device, write-back of evicted rows) and ``device`` (the jitted
forward/backward/update). Medians over the timed steps (warm-up excluded). The
caches end with the full table's loss (a cache is exact); the naive variant
computes the same thing in another XLA program, so rounding makes it drift.

Then: planner throughput on batches of 100k+ ids, and the three parts at
capacities x1 and x8 of 2% (the training step must not grow with the capacity:
the cache is donated to it, never copied). The last line is ``cached_2pct_over_full=R`` for the
embedding-heavy configuration: full-table step time over 2%-cache step time.

    python benchmarks/throughput.py            # a few minutes on 2 CPU cores
    python benchmarks/throughput.py --quick    # under a minute, smaller table
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxcache

ROW_LEARNING_RATE = 0.05
DENSE_LEARNING_RATE = 0.01


@dataclasses.dataclass(frozen=True)
class Setup:
    """One benchmark configuration: data, model sizes and cache fractions."""

    name: str
    data: jaxcache.SyntheticCriteo
    features: int
    bottom: tuple[int, ...]
    top: tuple[int, ...]

    @property
    def combiner(self) -> str | None:
        return "sum" if self.data.multi_hot else None

    def config(self, capacity: float | int, policy: str) -> jaxcache.CacheConfig:
        return jaxcache.CacheConfig(
            num_embeddings=self.data.num_embeddings,
            features=self.features,
            capacity=capacity,
            policy=policy,
            optimizer=jaxcache.rowwise_adagrad(ROW_LEARNING_RATE),
            padding_id=self.data.padding_id if self.data.multi_hot else None,
        )

    def describe(self) -> str:
        d = self.data
        ids = sum(d.bag_sizes)
        mlp = "-".join(map(str, (13, *self.bottom, self.features)))
        top = "-".join(map(str, (*self.top, 1)))
        return (
            f"{self.name}: batch {d.batch_size}, {ids} ids/sample, table {d.num_embeddings:,} "
            f"rows x {self.features}, bottom {mlp}, top ...-{top}"
        )


@dataclasses.dataclass
class Timing:
    """Per-step times (seconds) and results of one variant."""

    name: str
    rows_on_device: int
    plan: list[float] = dataclasses.field(default_factory=list)
    move: list[float] = dataclasses.field(default_factory=list)
    device: list[float] = dataclasses.field(default_factory=list)
    losses: list[jax.Array] = dataclasses.field(default_factory=list)
    hit_rate: float = float("nan")
    compilations: int = 0
    phases: dict[str, float] = dataclasses.field(default_factory=dict)

    def median(self, part: str) -> float:
        values = getattr(self, part)
        return float(np.median(values)) if values else 0.0

    @property
    def loss(self) -> float:
        return float(self.losses[-1])

    @property
    def step(self) -> float:
        return float(np.median(np.add(np.add(self.plan, self.move), self.device)))


# --------------------------------------------------------------------- cache
def run_cache(
    setup: Setup,
    batches: list[dict],
    cache: jaxcache.EmbeddingCache,
    name: str,
    *,
    warmup: int,
    seed: int,
) -> Timing:
    """Trains through ``cache`` (full table or not), timing plan, move and device."""
    embed = jaxcache.nnx.CachedEmbed(cache, combiner=setup.combiner)
    model = _model(setup, embed, seed)
    tx = jaxcache.models.dense_optimizer("adagrad", DENSE_LEARNING_RATE)
    _, train_step = jaxcache.models.make_train_step(model, tx)
    timing = Timing(name, cache.config.capacity)
    for i, batch in enumerate(batches):
        if i == warmup:
            hits, distinct = cache.stats.total.hits, cache.stats.total.distinct
            compilations = jaxcache.compilations()
            timers = cache.stats.timers
            seconds, counts = dict(timers.seconds), dict(timers.counts)
        t0 = time.perf_counter()
        planning = cache.stats.timers.seconds["plan"]
        lookup = embed.prepare(batch["sparse"])
        jax.block_until_ready(embed.rows[...])  # the swap has run
        t2 = time.perf_counter()
        t1 = t0 + cache.stats.timers.seconds["plan"] - planning
        timing.losses.append(train_step(batch["dense"], lookup, batch["label"]))
        timing.losses[-1].block_until_ready()
        t3 = time.perf_counter()
        if i >= warmup:
            timing.plan.append(t1 - t0)
            timing.move.append(t2 - t1)
            timing.device.append(t3 - t2)
    timing.phases = {
        phase: 1e3
        * (timers.seconds[phase] - seconds[phase])
        / (timers.counts[phase] - counts[phase])
        for phase in timers.seconds
        if timers.counts[phase] > counts[phase]
    }
    total = cache.stats.total
    timing.hit_rate = (total.hits - hits) / max(1, total.distinct - distinct)
    timing.compilations = jaxcache.compilations() - compilations
    return timing


# --------------------------------------------------------------------- naive
class HostCallbackEmbed(nnx.Module):
    """Rows read from a host NumPy table by ``jax.pure_callback`` inside the step.

    Takes a ``jaxcache.Lookup`` whose ``unique_slots`` are table ids (padded
    with ``N``); nothing is kept on device.
    """

    def __init__(self, rows: np.ndarray, combiner: str | None) -> None:
        self.gather = _host_gather(rows)
        self.features = rows.shape[1]
        self.combiner = combiner

    def __call__(self, lookup: jaxcache.Lookup) -> jax.Array:
        shape = jax.ShapeDtypeStruct((lookup.unique_slots.shape[0], self.features), jnp.float32)
        rows = jax.pure_callback(self.gather, shape, lookup.unique_slots)
        if lookup.delta is not None:
            rows = rows + lookup.delta
        embeddings = rows.at[lookup.inverse].get(mode="fill", fill_value=0)
        if self.combiner is None:
            return embeddings
        return jaxcache.pool(embeddings, lookup, self.combiner)


def _host_gather(rows: np.ndarray):
    n = rows.shape[0]

    def gather(ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        out = rows[np.minimum(ids, n - 1)]
        out[ids >= n] = 0
        return out

    return gather


@nnx.jit(donate_argnums=(0, 1))
def _naive_step(model, optimizer, dense, lookup, labels):
    def loss_fn(model, delta):
        logits = model(dense, lookup.with_delta(delta))
        return jaxcache.models.bce_loss(logits, labels)

    delta = jnp.zeros((lookup.unique_slots.shape[0], model.embed.features), jnp.float32)
    diff = (nnx.DiffState(0, nnx.Param), 1)
    loss, (grads, row_grads) = nnx.value_and_grad(loss_fn, argnums=diff)(model, delta)
    optimizer.update(model, grads)
    return loss, row_grads


def run_naive(
    setup: Setup, batches: list[dict], rows: np.ndarray, *, warmup: int, seed: int
) -> Timing:
    """The host-table baseline: callback gather, host row-wise Adagrad."""
    rows = rows.copy()
    accumulator = np.zeros(rows.shape[0], np.float32)
    optimizer = jaxcache.rowwise_adagrad(ROW_LEARNING_RATE)
    embed = HostCallbackEmbed(rows, setup.combiner)
    model = _model(setup, embed, seed)
    dense_opt = nnx.Optimizer(
        model, jaxcache.models.dense_optimizer("adagrad", DENSE_LEARNING_RATE), wrt=nnx.Param
    )
    step = nnx.cached_partial(_naive_step, model, dense_opt)
    timing = Timing("naive callback", 0)
    bucket = 0
    for i, batch in enumerate(batches):
        if i == warmup:
            compilations = jaxcache.compilations()
        t0 = time.perf_counter()
        ids = batch["sparse"].reshape(-1)
        valid = ids >= 0
        unique, inverse = np.unique(ids[valid], return_inverse=True)
        bucket = jaxcache.bucket_size(unique.size, 64, bucket)
        padded = np.full(bucket, rows.shape[0], np.int32)
        padded[: unique.size] = unique
        positions = np.full(ids.shape, bucket, np.int32)
        positions[valid] = inverse
        lookup = jaxcache.Lookup(
            jnp.asarray(padded), jnp.asarray(positions.reshape(batch["sparse"].shape))
        )
        t1 = time.perf_counter()
        loss, row_grads = step(batch["dense"], lookup, batch["label"])
        timing.losses.append(loss)
        row_grads = np.asarray(row_grads)[: unique.size]
        t2 = time.perf_counter()
        # Row-wise Adagrad on the host, the rule of jaxcache.rowwise_adagrad.
        acc = accumulator[unique] + np.mean(row_grads * row_grads, axis=-1)
        accumulator[unique] = acc
        scale = optimizer.learning_rate / (np.sqrt(acc) + optimizer.eps)
        rows[unique] -= scale[:, None] * row_grads
        t3 = time.perf_counter()
        if i >= warmup:
            timing.plan.append(t1 - t0)
            timing.device.append(t2 - t1)
            timing.move.append(t3 - t2)
    timing.compilations = jaxcache.compilations() - compilations
    return timing


def _model(setup: Setup, embed: nnx.Module, seed: int) -> jaxcache.models.DLRM:
    return jaxcache.models.DLRM(
        embed,
        num_sparse=setup.data.num_features,
        features=setup.features,
        bottom=setup.bottom,
        top=setup.top,
        rngs=nnx.Rngs(seed),
    )


# -------------------------------------------------------------------- tables
def compare(setup: Setup, args: argparse.Namespace) -> list[Timing]:
    """Every variant of one configuration on the same batches."""
    steps = args.warmup + args.steps
    batches = list(setup.data.batches(steps))
    frequencies = setup.data.count_frequencies(args.profile_batches)
    base = jaxcache.HostTable(setup.config(1, "lru"), seed=args.seed).rows
    results = []

    def cache(fraction: float | None) -> jaxcache.EmbeddingCache:
        if fraction is None:
            cfg = setup.config(1, "lru")
            return jaxcache.EmbeddingCache.full_table(cfg, table=jaxcache.HostTable(cfg, rows=base))
        cfg = setup.config(fraction, args.policy)
        table = jaxcache.HostTable(cfg, rows=base)
        return jaxcache.EmbeddingCache(cfg, table=table, frequencies=frequencies)

    common = {"warmup": args.warmup, "seed": args.seed}
    results.append(run_cache(setup, batches, cache(None), "full table", **common))
    for fraction in args.fractions:
        name = f"cache {100 * fraction:g}%"
        results.append(run_cache(setup, batches, cache(fraction), name, **common))
    results.append(run_naive(setup, batches, base, **common))
    print_table(setup, results)
    return results


def print_table(setup: Setup, results: list[Timing]) -> None:
    full = results[0]
    print()
    print(setup.describe())
    header = (
        f"{'variant':<16}{'rows on dev':>12}{'hit rate':>9}{'plan ms':>9}{'move ms':>9}"
        f"{'device ms':>10}{'step ms':>9}{'steps/s':>9}{'vs full':>8}{'compiles':>9}"
        f"{'final loss':>12}{'|dloss|':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        hit = "-" if np.isnan(r.hit_rate) else f"{r.hit_rate:.3f}"
        print(
            f"{r.name:<16}{r.rows_on_device:>12,}{hit:>9}{1e3 * r.median('plan'):>9.2f}"
            f"{1e3 * r.median('move'):>9.2f}{1e3 * r.median('device'):>10.2f}"
            f"{1e3 * r.step:>9.2f}{1 / r.step:>9.1f}{full.step / r.step:>7.2f}x"
            f"{r.compilations:>9}{r.loss:>12.6f}{abs(r.loss - full.loss):>9.1e}"
        )
    for r in results:
        if r.phases and r.name != "full table":
            parts = ", ".join(f"{k} {v:.2f}" for k, v in r.phases.items() if v > 0)
            print(f"  {r.name} host phases, mean ms per call: {parts}")
    print(
        "plan: host planner; move: host gather + transfer + swap + write-back (naive: host "
        "row update); device: jitted step (naive: with callback gathers). Medians."
    )
    print(
        "|dloss|: final loss vs full table. The caches run the full table's step and match "
        "it; the naive step is another XLA program, whose rounding drifts over the steps."
    )


def planner_throughput(setup: Setup, args: argparse.Namespace) -> None:
    """Ids/s of ``Planner.plan`` on large batches, after the cache has warmed up."""
    data = dataclasses.replace(setup.data, batch_size=args.planner_batch)
    batches = [data.batch(i)["sparse"] for i in range(args.warmup + args.steps)]
    cfg = setup.config(0.05, args.policy)
    planner = jaxcache.Planner(cfg, frequencies=data.count_frequencies(args.profile_batches))
    times = []
    for i, ids in enumerate(batches):
        t0 = time.perf_counter()
        plan = planner.plan(ids)
        planner.release(plan.index)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    ids_per_batch = int((batches[0] != data.padding_id).sum())
    median = float(np.median(times))
    print()
    print(
        f"planner ({args.policy}, capacity {cfg.capacity:,} of {cfg.num_embeddings:,} rows): "
        f"{ids_per_batch:,} ids/batch, median {1e3 * median:.2f} ms/plan = "
        f"{ids_per_batch / median / 1e6:.2f} M ids/s"
    )


def capacity_scaling(setup: Setup, args: argparse.Namespace) -> None:
    """Device step time at capacities x1 and x8: must not grow with the capacity."""
    steps = args.warmup + args.steps
    batches = list(setup.data.batches(steps))
    frequencies = setup.data.count_frequencies(args.profile_batches)
    print()
    print(f"capacity x1 vs x8 ({setup.name}, {args.policy}), medians in ms:")
    for multiple in (1, 8):
        cfg = setup.config(min(1.0, 0.02 * multiple), args.policy)
        cache = jaxcache.EmbeddingCache(cfg, frequencies=frequencies, seed=args.seed)
        t = run_cache(setup, batches, cache, "", warmup=args.warmup, seed=args.seed)
        print(
            f"  x{multiple}: capacity {cfg.capacity:>9,} rows   device step "
            f"{1e3 * t.median('device'):6.2f} (min {1e3 * min(t.device):5.2f})   plan "
            f"{1e3 * t.median('plan'):6.2f}   move {1e3 * t.median('move'):6.2f}   "
            f"(hit rate {t.hit_rate:.3f})"
        )
    print("  The device step must not grow with the capacity (the cache is donated to it).")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first")
    parser.add_argument("--quick", action="store_true", help="small table, few steps")
    parser.add_argument("--scale", type=float, default=None, help="SyntheticCriteo scale")
    parser.add_argument("--policy", default="frequency", choices=jaxcache.POLICIES)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.scale = args.scale or (0.02 if args.quick else 0.1)
    args.steps = args.steps or (10 if args.quick else 50)
    args.warmup = args.warmup if args.warmup is not None else (3 if args.quick else 10)
    args.fractions = (0.005, 0.02, 0.05)
    args.profile_batches = 20
    args.planner_batch = 1024
    quick = args.quick
    dlrm = Setup(
        "dlrm",
        jaxcache.SyntheticCriteo(scale=args.scale, batch_size=512 if quick else 2048, seed=0),
        features=16,
        bottom=(512, 256, 64),
        top=(512, 256),
    )
    heavy = Setup(
        "embedding-heavy",
        jaxcache.SyntheticCriteo(
            scale=args.scale, batch_size=128 if quick else 512, multi_hot=True, bag_size=16
        ),
        features=16,
        bottom=(16,),
        top=(32,),
    )
    if quick:
        args.fractions = (0.02, 0.05)  # 0.5% of the small table is below one batch
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {args.steps} timed steps")
    compare(dlrm, args)
    results = compare(heavy, args)
    planner_throughput(heavy, args)
    capacity_scaling(heavy, args)
    by_name = {r.name: r for r in results}
    ratio = by_name["full table"].step / by_name["cache 2%"].step
    print(f"cached_2pct_over_full={ratio:.3f}")


if __name__ == "__main__":
    main()
