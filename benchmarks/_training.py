"""The training setups of the throughput benchmarks, and the runs that time them.

``throughput.py`` runs every experiment on the same setups; each
``throughput_*.py`` file is one experiment and runs alone too, with the same
flags (``parse_args``). Three setups: ``dlrm``, ``embedding-heavy`` and
``dcnv2`` (MLPerf DCNv2's shape, its table scaled by ``--dcnv2-scale``). A
``Bench`` holds one configuration's batches, frequency profile and initial
table, and trains through a fresh cache of any capacity (built by
``_harness.embedding_cache``, with the planner ``--planner`` names), from
the same initial model, in two ways:

- the **blocking** run (``run_blocking``) waits for every part of a step
  before starting the next, and times the parts alone: ``staging``
  (``EmbeddingCache.stage``: plan, land the write-backs it needs, gather,
  start the transfer), ``swap`` (``EmbeddingCache.apply`` on device) and
  ``device`` (the jitted forward/backward/update);
- the **loop** (``run_loop``) is a training loop fed by ``jaxcache.prefetch``
  with ``--lookahead`` batches staged ahead on a host thread (``0``: staged
  in the loop, unpipelined); it reads each step's loss one step later, as a
  loop that logs its loss does, and times the interval between steps.

All times are medians over the timed steps (warm-up excluded).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import _harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxcache

ROW_LEARNING_RATE = 0.05
DENSE_LEARNING_RATE = 0.01


@dataclasses.dataclass(frozen=True)
class Setup:
    """One benchmark configuration: data, model sizes and cache fractions.

    Attributes:
      cross: ``(layers, rank)`` of a DCNv2 cross network between the
        embeddings and the top MLP; ``None``: DLRM's dot interaction.
      per_feature_init: draw the initial table as torchrec does for
        MLPerf's DCNv2 (``initial_rows``) instead of as the host table does.
      dense_learning_rate: of the dense parameters' Adagrad.
    """

    name: str
    data: jaxcache.synthetic.SyntheticCriteo
    features: int
    bottom: tuple[int, ...]
    top: tuple[int, ...]
    cross: tuple[int, int] | None = None
    per_feature_init: bool = False
    dense_learning_rate: float = DENSE_LEARNING_RATE

    @property
    def combiner(self) -> str | None:
        return "sum" if self.data.multi_hot else None

    def config(
        self, capacity: float | int, policy: str, callback_rows: int | None = None
    ) -> jaxcache.CacheConfig:
        return jaxcache.CacheConfig(
            num_embeddings=self.data.num_embeddings,
            features=self.features,
            capacity=capacity,
            policy=policy,
            optimizer=jaxcache.rowwise_adagrad(ROW_LEARNING_RATE),
            padding_id=self.data.padding_id if self.data.multi_hot else None,
            callback_rows=callback_rows,
        )

    def dense_optimizer(self) -> optax.GradientTransformation:
        """The dense parameters' optimizer, in every run of this setup."""
        return jaxcache.models.dense_optimizer("adagrad", self.dense_learning_rate)

    def describe(self) -> str:
        d = self.data
        ids = sum(d.bag_sizes)
        mlp = "-".join(map(str, (13, *self.bottom, self.features)))
        top = "-".join(map(str, (*self.top, 1)))
        cross = "" if self.cross is None else f", cross {self.cross[0]} x rank {self.cross[1]}"
        return (
            f"{self.name}: batch {d.batch_size}, {ids} ids/sample, table {d.num_embeddings:,} "
            f"rows x {self.features}, bottom {mlp}{cross}, top ...-{top}"
        )

    def initial_rows(self, seed: int) -> np.ndarray:
        """The initial table ``[N, D]`` every run of this setup starts from.

        With ``per_feature_init``, each feature's rows are uniform in
        ``+-sqrt(1 / its rows)``, torchrec's default: bags of up to 100 rows
        of the host table's variance ``1 / D`` make the cross network's
        products grow until the loss diverges. They are drawn on the default
        device: NumPy's generator, on one host thread, takes seconds to
        minutes for tens of millions of rows of 128.
        """
        cfg = self.config(1, "lru")
        if not self.per_feature_init:
            return jaxcache.HostTable(cfg, seed=seed).rows
        rows = np.asarray(self.data.cardinalities)
        bound = jnp.repeat(
            jnp.asarray(1 / np.sqrt(rows), jnp.float32), rows, total_repeat_length=rows.sum()
        )
        shape = (cfg.num_embeddings, cfg.features)
        unit = jax.random.uniform(jax.random.key(seed), shape, jnp.float32, -1.0, 1.0)
        return np.array(unit * bound[:, None])


@dataclasses.dataclass
class Timing:
    """Per-step times (seconds) and results of one run.

    ``parts`` holds the blocking run's ``staging``, ``swap`` and ``device``
    times, or the loop's ``step`` intervals.
    """

    name: str
    rows_on_device: int
    parts: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    losses: list[jax.Array] = dataclasses.field(default_factory=list)
    hit_rate: float = float("nan")
    compilations: int = 0
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    write_back_waits: int = 0
    # Cores busy (process CPU time over wall time, every thread): during the
    # device steps of a blocking run, during the timed steps of a loop.
    cores: float = float("nan")
    # A loop's CPU seconds per step by thread (see _harness.ThreadCPU); empty where
    # threads' CPU clocks cannot be read.
    cpu: dict[str, float] = dataclasses.field(default_factory=dict)

    def median(self, part: str) -> float:
        values = self.parts.get(part, [])
        return float(np.median(values)) if values else float("nan")

    @property
    def loss(self) -> float:
        return float(self.losses[-1])

    @property
    def blocking(self) -> float:
        """Median of the sum of the blocking parts."""
        parts = [self.parts[p] for p in ("staging", "swap", "device") if p in self.parts]
        return float(np.median(np.sum(parts, axis=0)))


class _Window:
    """Counters of a cache from the end of the warm-up on."""

    def __init__(self, cache: jaxcache.EmbeddingCache) -> None:
        self.cache = cache
        self.hits, self.distinct = cache.stats.total.hits, cache.stats.total.distinct
        self.seconds = dict(cache.stats.timers.seconds)
        self.counts = dict(cache.stats.timers.counts)
        self.waits = cache.stats.write_back_waits
        self.compilations = jaxcache.testing.compilations()

    def close(self, timing: Timing) -> Timing:
        stats = self.cache.stats
        timers = stats.timers
        timing.phases = {
            phase: 1e3
            * (timers.seconds[phase] - self.seconds[phase])
            / (timers.counts[phase] - self.counts[phase])
            for phase in timers.seconds
            if timers.counts[phase] > self.counts[phase]
        }
        timing.hit_rate = (stats.total.hits - self.hits) / max(
            1, stats.total.distinct - self.distinct
        )
        timing.write_back_waits = stats.write_back_waits - self.waits
        timing.compilations = jaxcache.testing.compilations() - self.compilations
        return timing


class LowRankCross(nnx.Module):
    """One layer of DCNv2's cross network: ``x0 * (U (V x) + b) + x``, ``V`` of rank ``rank``."""

    def __init__(self, width: int, rank: int, *, rngs: nnx.Rngs) -> None:
        self.down = nnx.Linear(width, rank, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(rank, width, rngs=rngs)

    def __call__(self, x0: jax.Array, x: jax.Array) -> jax.Array:
        return x0 * self.up(self.down(x)) + x


class DCNv2(nnx.Module):
    """DCNv2 (Wang et al. 2021) as MLPerf trains it on Criteo 1TB, around any embedding.

    The bottom MLP maps the dense features to ``D``; it and the ``F`` pooled
    embeddings, concatenated (``(F + 1) D`` wide), pass through low-rank
    cross layers, then the top MLP gives one click logit. ``jaxcache.models``
    has no cross network, so the benchmarks define MLPerf's here.

    Args:
      embed: module mapping the step's sparse input to ``[B, F, D]``.
      num_sparse: ``F``.
      features: ``D``.
      bottom: hidden widths of the bottom MLP (its output is ``D``).
      top: hidden widths of the top MLP (its output is 1).
      cross: ``(layers, rank)`` of the cross network.
      num_dense: ``I``, dense inputs.
      rngs: random streams for the dense layers.
    """

    def __init__(
        self,
        embed: nnx.Module,
        *,
        num_sparse: int,
        features: int,
        bottom: tuple[int, ...],
        top: tuple[int, ...],
        cross: tuple[int, int],
        num_dense: int = 13,
        rngs: nnx.Rngs,
    ) -> None:
        self.embed = embed
        self.bottom = jaxcache.models.MLP(
            [num_dense, *bottom, features], rngs=rngs, final_activation=True
        )
        width = (num_sparse + 1) * features
        layers, rank = cross
        self.cross = nnx.List([LowRankCross(width, rank, rngs=rngs) for _ in range(layers)])
        self.top = jaxcache.models.MLP([width, *top, 1], rngs=rngs)

    def __call__(self, dense: jax.Array, sparse: Any) -> jax.Array:
        """Click logits ``[B]`` from dense ``[B, I]`` and the embedding's input."""
        x = self.bottom(dense)
        emb = self.embed(sparse)
        x0 = jnp.concatenate([x, emb.reshape(emb.shape[0], -1).astype(x.dtype)], axis=1)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        return self.top(x)[:, 0]


def make_model(setup: Setup, embed: nnx.Module, seed: int) -> nnx.Module:
    """The model of ``setup`` around ``embed``, initialised from ``seed``: a
    DCNv2 where the setup has a cross network, else a DLRM."""
    if setup.cross is not None:
        return DCNv2(
            embed,
            num_sparse=setup.data.num_features,
            features=setup.features,
            bottom=setup.bottom,
            top=setup.top,
            cross=setup.cross,
            rngs=nnx.Rngs(seed),
        )
    return jaxcache.models.DLRM(
        embed,
        num_sparse=setup.data.num_features,
        features=setup.features,
        bottom=setup.bottom,
        top=setup.top,
        rngs=nnx.Rngs(seed),
    )


# --------------------------------------------------------------------- runs
def _trainer(setup: Setup, cache: jaxcache.EmbeddingCache, seed: int, host_callback: bool):
    embed = jaxcache.nnx.CachedEmbed(cache, combiner=setup.combiner)
    model = make_model(setup, embed, seed)
    tx = setup.dense_optimizer()
    _, train_step = jaxcache.models.make_train_step(model, tx, host_callback=host_callback)
    return embed, train_step


def run_blocking(
    setup: Setup,
    batches: list[dict],
    cache: jaxcache.EmbeddingCache,
    name: str,
    *,
    warmup: int,
    seed: int,
) -> Timing:
    """Trains through ``cache``, waiting for each part: staging, swap, device step."""
    embed, train_step = _trainer(setup, cache, seed, host_callback=False)
    timing = Timing(name, cache.config.capacity)
    staging, swap, device, cpu = [], [], [], []
    for i, batch in enumerate(batches):
        if i == warmup:
            window = _Window(cache)
        t0 = time.perf_counter()
        cache.lifecycle.release_all()  # every earlier step has run
        staged = cache.stage(batch["sparse"])
        t1 = time.perf_counter()
        embed.set_state(cache.apply(embed.get_state(), staged))
        jax.block_until_ready(embed.get_state())
        t2, c2 = time.perf_counter(), time.process_time()
        timing.losses.append(train_step(batch["dense"], staged.lookup, batch["label"]))
        timing.losses[-1].block_until_ready()
        t3, c3 = time.perf_counter(), time.process_time()
        if i >= warmup:
            staging.append(t1 - t0)
            swap.append(t2 - t1)
            device.append(t3 - t2)
            cpu.append(c3 - c2)
    timing.parts = {"staging": staging, "swap": swap, "device": device}
    timing.cores = float(np.sum(cpu) / np.sum(device))
    return window.close(timing)


def run_loop(
    setup: Setup,
    batches: list[dict],
    cache: jaxcache.EmbeddingCache,
    name: str,
    *,
    lookahead: int,
    host_callback: bool = False,
    warmup: int,
    seed: int,
) -> Timing:
    """A training loop fed by ``jaxcache.prefetch``; times the interval between steps."""
    embed, train_step = _trainer(setup, cache, seed, host_callback=host_callback)
    timing = Timing(name, cache.config.capacity)
    windows = []
    pipeline = jaxcache.prefetch(
        batches, {"sparse": embed}, lookahead=lookahead, callback=host_callback
    )
    with pipeline:
        steps = ((b["dense"], b["sparse"], b["label"]) for b in pipeline)
        time_steps(timing, train_step, steps, warmup, lambda: windows.append(_Window(cache)))
    return windows[0].close(timing)


def time_steps(
    timing: Timing,
    train_step: Callable[..., jax.Array],
    steps: Iterable[tuple[Any, ...]],
    warmup: int,
    at_warmup: Callable[[], Any] | None = None,
) -> None:
    """Runs ``train_step(*args)`` for each of ``steps``, reading each loss one
    step later as a logging loop does; fills ``timing``'s losses, the step
    intervals after ``warmup``, the cores busy meanwhile and each thread's
    CPU per step. ``at_warmup`` is called when the timed steps begin."""
    intervals = []
    tick = time.perf_counter()
    for i, args in enumerate(steps):
        if i == warmup:
            if at_warmup is not None:
                at_warmup()
            cpu, wall = _harness.ThreadCPU(), time.perf_counter()
            compiled = jaxcache.testing.compilations()
        timing.losses.append(train_step(*args))
        if i:
            timing.losses[-2].block_until_ready()  # the loss of the step before
        tock = time.perf_counter()
        if i > warmup:
            intervals.append(tock - tick)
        tick = tock
    timing.losses[-1].block_until_ready()
    timing.cores = (time.process_time() - cpu.process) / (time.perf_counter() - wall)
    timing.cpu = cpu.per_step(i + 1 - warmup)
    timing.parts = {"step": intervals}
    timing.compilations = jaxcache.testing.compilations() - compiled


def report_compilations(timings: Iterable[Timing]) -> None:
    """A warning line naming the runs that compiled inside their timed steps
    (a batch of a new padded size): their medians hold a compile or two."""
    compiled = {t.name: t.compilations for t in timings if t.compilations}
    if compiled:
        print(f"warning: compilations inside the timed steps (raise --warmup): {compiled}")


def run_staged_loop(
    setup: Setup, batches: list[dict], cache: jaxcache.EmbeddingCache, *, warmup: int, seed: int
) -> Timing:
    """The training loop with no host work left: every batch staged beforehand.

    For the full table only (no row moves, so nothing to apply in between):
    a control for how close a loop of device steps comes to the step alone.
    """
    _, train_step = _trainer(setup, cache, seed, host_callback=False)
    lookups, inputs = stage_all(cache, batches)
    timing = Timing("staged beforehand", cache.config.capacity)
    steps = ((d, lookup, y) for (d, y), lookup in zip(inputs, lookups, strict=True))
    time_steps(timing, train_step, steps, warmup)
    return timing


def stage_all(
    cache: jaxcache.EmbeddingCache, batches: list[dict], all_positions: bool = False
) -> tuple[list[jaxcache.Lookup], list[tuple[jax.Array, jax.Array]]]:
    """Every batch's lookup (the full table: no rows move) and its dense
    features and labels on the device, ready. ``all_positions``: drop
    ``Lookup.positions``, so pooling reads every position of the bags."""
    lookups = []
    for batch in batches:
        cache.lifecycle.release_all()
        lookup = cache.stage(batch["sparse"]).lookup
        lookups.append(dataclasses.replace(lookup, positions=None) if all_positions else lookup)
    inputs = jax.device_put([(b["dense"], b["label"]) for b in batches])
    jax.block_until_ready((lookups, inputs))
    return lookups, inputs


class Bench:
    """The batches, frequencies and initial table of one configuration."""

    def __init__(self, setup: Setup, args: argparse.Namespace) -> None:
        self.setup = setup
        self.args = args
        # int32 ids, as a loader hands them over, for the cache and the plain
        # table alike: 64-bit ids would cost the device planner two words an
        # id, and JAX would convert them on the training thread of the plain.
        self.batches = [
            {**b, "sparse": np.asarray(b["sparse"], np.int32)}
            for b in setup.data.batches(args.warmup + args.steps)
        ]
        self.frequencies = setup.data.count_frequencies(args.profile_batches)
        self.base = setup.initial_rows(args.seed)
        self.common = {"warmup": args.warmup, "seed": args.seed}

    @functools.cached_property
    def callback_rows(self) -> int:
        """The host-callback form's list size: the most distinct ids of a
        batch (padding counted), rounded up to a power of two."""
        most = max(np.unique(b["sparse"]).size for b in self.batches)
        return 1 << (most - 1).bit_length()

    def cache(
        self,
        fraction: float | None,
        callback_rows: int | None = None,
        planner: str | None = None,
    ) -> jaxcache.EmbeddingCache:
        """A fresh cache of ``fraction`` of the rows (``None``: the full table),
        planned by ``planner`` (``None``: the cache's default)."""
        if fraction is None:
            cfg = self.setup.config(1, "lru")
            return jaxcache.EmbeddingCache.full_table(
                cfg, table=jaxcache.HostTable(cfg, rows=self.base)
            )
        cfg = self.setup.config(fraction, self.args.policy, callback_rows)
        table = jaxcache.HostTable(cfg, rows=self.base)
        return _harness.embedding_cache(cfg, planner, table=table, frequencies=self.frequencies)

    def blocking(self, fraction: float | None, name: str, planner: str | None = None) -> Timing:
        cache = self.cache(fraction, planner=planner)
        return run_blocking(self.setup, self.batches, cache, name, **self.common)

    def staged(self) -> Timing:
        """The full table's loop with every batch staged beforehand."""
        return run_staged_loop(self.setup, self.batches, self.cache(None), **self.common)

    def loop(
        self,
        fraction: float | None,
        name: str,
        lookahead: int,
        host_callback: bool = False,
        batch_sized: bool = False,
        planner: str | None = None,
    ) -> Timing:
        """``host_callback``: the step looks the ids up with the host-callback
        form, its lists ``callback_rows`` long (``batch_sized``: the default,
        as long as the batch's ids). ``planner``: as for ``cache``."""
        rows = self.callback_rows if host_callback and not batch_sized else None
        return run_loop(
            self.setup,
            self.batches,
            self.cache(fraction, rows, planner),
            name,
            lookahead=lookahead,
            host_callback=host_callback,
            **self.common,
        )


# ----------------------------------------------------------- flags, setups
def parse_args(
    doc: str, argv: list[str] | None = None, *, side_by_side_only: bool = False
) -> argparse.Namespace:
    """The flags of the throughput benchmarks, their defaults filled in.

    Args:
      doc: the script's docstring; its first paragraph is the description.
      argv: the arguments (default: ``sys.argv[1:]``).
      side_by_side_only: offer ``--side-by-side-only`` and ``--no-dcnv2``
        (``throughput.py``).
    """
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first")
    parser.add_argument(
        "--lookahead",
        type=int,
        default=2,
        help="batches staged ahead in the loops; 0 = unpipelined",
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="rounds of the side-by-side runs (default 3)"
    )
    parser.add_argument("--quick", action="store_true", help="small table, few steps")
    if side_by_side_only:
        parser.add_argument(
            "--side-by-side-only",
            action="store_true",
            help="only the embedding-heavy side-by-side rounds, pipelined_over_ideal and "
            "the plain table's runs (about 3 minutes)",
        )
        parser.add_argument(
            "--no-dcnv2",
            action="store_true",
            help="leave out the dcnv2 setup's runs (throughput_dcnv2.py runs them alone)",
        )
    parser.add_argument("--scale", type=float, default=None, help="SyntheticCriteo scale")
    parser.add_argument(
        "--dcnv2-scale",
        type=float,
        default=None,
        help="the dcnv2 setup's table, a fraction of MLPerf's Criteo 1TB (204M rows at 1.0), "
        "and its batch, that fraction of 16,384 samples (default 0.001: two minutes on 2 CPU "
        "cores)",
    )
    parser.add_argument("--policy", default="frequency", choices=jaxcache.planning.POLICIES)
    parser.add_argument(
        "--planner",
        choices=_harness.PLANNERS,
        default=None,
        help="the cache's planner in the runs against the plain table (default: both where "
        "jaxcache.EmbeddingCache takes planner=, else its only one)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.lookahead < 0:
        parser.error(f"--lookahead={args.lookahead} must be 0 (unpipelined) or more, e.g. 2.")
    try:
        args.planners = _harness.planners(args.planner)
    except ValueError as error:
        parser.error(str(error))
    args.scale = args.scale or (0.02 if args.quick else 0.1)
    args.dcnv2_scale = args.dcnv2_scale or 0.001
    if not 0 < args.dcnv2_scale <= 1:
        parser.error(f"--dcnv2-scale={args.dcnv2_scale} must be in (0, 1], e.g. 0.001.")
    args.steps = args.steps or (20 if args.quick else 100)
    args.warmup = args.warmup if args.warmup is not None else (5 if args.quick else 20)
    args.rounds = args.rounds or (1 if args.quick else 3)
    # 0.5% of the quick runs' small table is below one batch.
    args.fractions = (0.02, 0.05) if args.quick else (0.005, 0.02, 0.05)
    args.profile_batches = 20
    args.planner_batch = 1024
    return args


def dlrm(args: argparse.Namespace) -> Setup:
    """``dlrm``: the DLRM reference MLPs, one id per feature."""
    return Setup(
        "dlrm",
        jaxcache.synthetic.SyntheticCriteo(
            scale=args.scale, batch_size=512 if args.quick else 2048, seed=0
        ),
        features=16,
        bottom=(512, 256, 64),
        top=(512, 256),
    )


def embedding_heavy(args: argparse.Namespace) -> Setup:
    """``embedding-heavy``: small MLPs, multi-hot bags of DCNv2 sizes (about
    4.6x the ids per sample), where host work is a large share of a step."""
    return Setup(
        "embedding-heavy",
        jaxcache.synthetic.SyntheticCriteo(
            scale=args.scale, batch_size=128 if args.quick else 512, multi_hot=True, bag_size=16
        ),
        features=16,
        bottom=(16,),
        top=(32,),
    )


# Rows of the 26 categorical features of MLPerf's Criteo 1TB, ids capped at
# 40M: 204,184,588 rows in all.
MLPERF_CRITEO_1TB_CARDINALITIES = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
    2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class SyntheticCriteo1TB(jaxcache.synthetic.SyntheticCriteo):
    """``SyntheticCriteo`` with the features of MLPerf's Criteo 1TB instead of
    Criteo Kaggle's, scaled by ``scale`` (at least 3 rows a feature, as there)."""

    @functools.cached_property
    def cardinalities(self) -> tuple[int, ...]:
        return tuple(max(3, math.ceil(c * self.scale)) for c in MLPERF_CRITEO_1TB_CARDINALITIES)


def dcnv2(args: argparse.Namespace) -> Setup:
    """``dcnv2``: MLPerf DCNv2's shape, scaled by ``--dcnv2-scale``.

    26 multi-hot features of DCNv2's bag sizes (214 ids a sample, bags of up
    to 100), ``D = 128``, MLPerf's MLPs (bottom 13-512-256-128, top
    1024-1024-512-256-1) and cross network (3 layers of rank 512). The table
    is MLPerf's Criteo 1TB's features times the scale (204,184,588 rows at
    1.0), the batch 16,384 samples times the scale, to a power of two: at
    1.0 a step looks up 3.5M ids and its dense layers take about 1.6 TFLOP
    forward and backward, milliseconds of a current GPU; at every scale one
    batch's distinct ids fill 13-33% of a 2% cache, so the pipeline's
    batches in flight fit in it.
    """
    scale = args.dcnv2_scale
    batch = 1 << max(4, round(math.log2(16384 * scale)))
    bags = jaxcache.synthetic.DCNV2_BAG_SIZES
    return Setup(
        "dcnv2",
        SyntheticCriteo1TB(scale=scale, batch_size=batch, multi_hot=True, bag_size=max(bags)),
        features=128,
        bottom=(512, 256),
        top=(1024, 1024, 512, 256),
        cross=(3, 512),
        per_feature_init=True,
        # Adagrad's first steps move every weight by about the rate; at 0.01
        # the cross layers' wide sums made the loss diverge.
        dense_learning_rate=0.001,
    )


def print_machine(args: argparse.Namespace) -> None:
    """The first line: the machine, and how many steps each run times."""
    print(
        f"{_harness.machine()}; {args.steps} timed steps after {args.warmup} warm-up; "
        f"loops at lookahead {args.lookahead}"
    )


def standalone(doc: str, argv: list[str] | None = None) -> Bench:
    """Where an experiment run alone starts: its flags parsed, the machine
    line printed, and the embedding-heavy configuration's ``Bench``."""
    args = parse_args(doc, argv)
    print_machine(args)
    return Bench(embedding_heavy(args), args)
