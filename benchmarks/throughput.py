"""Training throughput: the cache, pipelined or not, against the whole table on device.

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

Each cached variant runs twice. The **blocking** run waits for every part of
a step before starting the next, and times the parts alone: ``staging``
(``EmbeddingCache.stage``: plan, land the write-backs it needs, gather,
start the transfer), ``swap`` (``EmbeddingCache.apply`` on device) and
``device`` (the jitted forward/backward/update). The **loop** run is a
training loop fed by ``jaxcache.prefetch`` with ``--lookahead`` batches
staged ahead on a host thread (``0``: staged in the loop, unpipelined); it
reads each step's loss one step later, as a loop that logs its loss does, and
times the interval between steps. All times are medians over the timed steps
(warm-up excluded). The caches end with the full table's loss (a cache is
exact, pipelined or not); the naive variant computes the same thing in
another XLA program, so rounding makes it drift.

For the embedding-heavy configuration at 2%, the side-by-side table compares
(a) the device step alone and (b) host staging alone with the loops:
unpipelined, pipelined, the host-callback form (``CachedEmbed.lookup_ids``
inside the step; its lists ``CacheConfig.callback_rows`` long, the most
distinct ids of a batch rounded up to a power of two, and once as long as the
batch's ids, the default), and the full table; and (g), a control: the full table's
loop with every batch staged beforehand, so no host work is left in it.
These runs go round ``--rounds`` times, interleaved, so that a change of load
on the machine falls on all of them; the table gives the median over the
rounds and their range. A perfect pipeline
would run a step in ``max(a, b)``; ``pipelined_over_ideal=R`` is the
pipelined step time over that. On a CPU the "device" is the same cores as the
host thread, so the two compete: the loops' CPU time per step, by thread
(training thread, the pipeline's producer, JAX's runtime threads), shows the
floor that puts under a step (all of it over the cores), and how far above
that floor each loop ran. So (a)-(d) and (g) run once more with
host and device on cores of their own, as with an accelerator: JAX's runtime
threads on the first half of the cores, the training thread and the
pipeline's producer on the rest (Linux); ``pipelined_over_ideal_split_cores=R``
is (d) over ``max(a, b)`` there.

Then: planner throughput on batches of 100k+ ids, and the blocking parts at
capacities x1 and x8 of 2% (the training step must not grow with the
capacity: the cache is donated to it, never copied), and the training step
with every batch staged beforehand: the CPU time the training thread spends
calling it, through ``nnx.jit`` and through ``jaxcache.models.make_train_step``,
and its time when pooling reads every position of the bags instead of the
real ids only. The last line is
``cached_2pct_over_full=R`` for the embedding-heavy configuration: full-table
step time over 2%-cache step time, both in the loop at ``--lookahead``, from
the side-by-side runs.

    python benchmarks/throughput.py                # about 5 minutes on 2 CPU cores
    python benchmarks/throughput.py --lookahead 0  # the loops unpipelined
    python benchmarks/throughput.py --quick        # a minute or two, smaller table
    python benchmarks/throughput.py --side-by-side-only --rounds 5  # the two ratios alone
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxcache
from jaxcache._src import models as models_src

ROW_LEARNING_RATE = 0.05
DENSE_LEARNING_RATE = 0.01


@dataclasses.dataclass(frozen=True)
class Setup:
    """One benchmark configuration: data, model sizes and cache fractions."""

    name: str
    data: jaxcache.synthetic.SyntheticCriteo
    features: int
    bottom: tuple[int, ...]
    top: tuple[int, ...]

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
    # A loop's CPU seconds per step by thread (see ThreadCPU); empty where
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


class ThreadCPU:
    """CPU time of a loop split by thread: the training thread (``loop``),
    the JAX runtime's threads (``runtime``: those alive from start to end,
    XLA's among them) and the rest (``prefetch``: the pipeline's producer,
    which ends with its source).

    Linux only (each thread's CPU clock, found through ``/proc``); elsewhere
    ``per_step`` is empty.
    """

    def __init__(self) -> None:
        self.main = threading.get_native_id()
        self.process, self.threads = time.process_time(), _thread_seconds()

    def per_step(self, steps: int) -> dict[str, float]:
        threads = _thread_seconds()
        if not threads:
            return {}
        ran = {t: threads[t] - self.threads[t] for t in threads.keys() & self.threads.keys()}
        total = time.process_time() - self.process
        loop = ran.pop(self.main)
        runtime = sum(ran.values())
        return {
            "loop": loop / steps,
            "prefetch": (total - loop - runtime) / steps,
            "runtime": runtime / steps,
        }


def _threads() -> list[int]:
    """Native ids of the live threads of this process (Linux; else empty)."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return []


def _thread_seconds() -> dict[int, float]:
    """CPU seconds of each live thread of this process, by native id."""
    seconds = {}
    for tid in _threads():
        try:  # a thread's CPU clock id (Linux: MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED))
            seconds[tid] = time.clock_gettime((~tid << 3) | 6)
        except OSError:  # it ended meanwhile
            pass
    return seconds


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


# --------------------------------------------------------------------- cache
def _trainer(setup: Setup, cache: jaxcache.EmbeddingCache, seed: int, host_callback: bool):
    embed = jaxcache.nnx.CachedEmbed(cache, combiner=setup.combiner)
    model = _model(setup, embed, seed)
    tx = jaxcache.models.dense_optimizer("adagrad", DENSE_LEARNING_RATE)
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
        _time_steps(timing, train_step, steps, warmup, lambda: windows.append(_Window(cache)))
    return windows[0].close(timing)


def _time_steps(
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
            cpu, wall = ThreadCPU(), time.perf_counter()
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


def run_staged_loop(
    setup: Setup, batches: list[dict], cache: jaxcache.EmbeddingCache, *, warmup: int, seed: int
) -> Timing:
    """The training loop with no host work left: every batch staged beforehand.

    For the full table only (no row moves, so nothing to apply in between):
    a control for how close a loop of device steps comes to the step alone.
    """
    _, train_step = _trainer(setup, cache, seed, host_callback=False)
    lookups, inputs = _stage_all(cache, batches)
    timing = Timing("staged beforehand", cache.config.capacity)
    steps = ((d, lookup, y) for (d, y), lookup in zip(inputs, lookups, strict=True))
    _time_steps(timing, train_step, steps, warmup)
    return timing


def _stage_all(
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


# --------------------------------------------------------------------- naive
class HostIds(NamedTuple):
    """A batch's distinct ids and each id's position among them (naive baseline).

    Attributes:
      unique_ids: ``int32 [U]`` distinct table ids, padded with ``N``.
      inverse: ``int32`` of the ids' shape, padding as ``U``.
      delta: ``[U, D]`` zeros added to the rows while differentiating.
    """

    unique_ids: jax.Array
    inverse: jax.Array
    delta: jax.Array | None = None


class HostCallbackEmbed(nnx.Module):
    """Rows read from a host NumPy table by ``jax.pure_callback`` inside the step."""

    def __init__(self, rows: np.ndarray, combiner: str | None) -> None:
        self.gather = _host_gather(rows)
        self.features = rows.shape[1]
        self.combiner = combiner

    def __call__(self, ids: HostIds) -> jax.Array:
        unique = ids.unique_ids.shape[0]
        shape = jax.ShapeDtypeStruct((unique, self.features), jnp.float32)
        rows = jax.pure_callback(self.gather, shape, ids.unique_ids)
        if ids.delta is not None:
            rows = rows + ids.delta
        embeddings = rows.at[ids.inverse].get(mode="fill", fill_value=0)
        if self.combiner is None:
            return embeddings
        real = (ids.inverse < unique).astype(embeddings.dtype)
        return jnp.einsum("...l,...ld->...d", real, embeddings)


def _host_gather(rows: np.ndarray):
    n = rows.shape[0]

    def gather(ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        out = rows[np.minimum(ids, n - 1)]
        out[ids >= n] = 0
        return out

    return gather


@nnx.jit(donate_argnums=(0, 1))
def _naive_step(model, optimizer, dense, ids, labels):
    def loss_fn(model, delta):
        logits = model(dense, ids._replace(delta=delta))
        return jaxcache.models.bce_loss(logits, labels)

    delta = jnp.zeros((ids.unique_ids.shape[0], model.embed.features), jnp.float32)
    diff = (nnx.DiffState(0, nnx.Param), 1)
    loss, (grads, row_grads) = nnx.value_and_grad(loss_fn, argnums=diff)(model, delta)
    optimizer.update(model, grads)
    return loss, row_grads


def run_naive(
    setup: Setup, batches: list[dict], rows: np.ndarray, *, warmup: int, seed: int
) -> Timing:
    """The host-table baseline: callback gather, host row-wise Adagrad (blocking)."""
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
    staging, update, device = [], [], []
    bucket = 0
    for i, batch in enumerate(batches):
        if i == warmup:
            compilations = jaxcache.testing.compilations()
        t0 = time.perf_counter()
        ids = batch["sparse"].reshape(-1)
        valid = ids >= 0
        unique, inverse = np.unique(ids[valid], return_inverse=True)
        bucket = jaxcache.device.bucket_size(unique.size, 64, bucket)
        padded = np.full(bucket, rows.shape[0], np.int32)
        padded[: unique.size] = unique
        positions = np.full(ids.shape, bucket, np.int32)
        positions[valid] = inverse
        host_ids = HostIds(
            jnp.asarray(padded), jnp.asarray(positions.reshape(batch["sparse"].shape))
        )
        t1 = time.perf_counter()
        loss, row_grads = step(batch["dense"], host_ids, batch["label"])
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
            staging.append(t1 - t0)
            device.append(t2 - t1)
            update.append(t3 - t2)
    # The host row update takes the swap's column; the loop is this same loop.
    timing.parts = {"staging": staging, "swap": update, "device": device}
    timing.compilations = jaxcache.testing.compilations() - compilations
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
@dataclasses.dataclass
class Variant:
    """One variant of a configuration: its blocking run and its loop run."""

    name: str
    blocking: Timing
    loop: Timing | None = None

    @property
    def step(self) -> float:
        return self.loop.median("step") if self.loop else self.blocking.blocking


class Bench:
    """The batches, frequencies and initial table of one configuration."""

    def __init__(self, setup: Setup, args: argparse.Namespace) -> None:
        self.setup = setup
        self.args = args
        self.batches = list(setup.data.batches(args.warmup + args.steps))
        self.frequencies = setup.data.count_frequencies(args.profile_batches)
        self.base = jaxcache.HostTable(setup.config(1, "lru"), seed=args.seed).rows
        self.common = {"warmup": args.warmup, "seed": args.seed}

    @functools.cached_property
    def callback_rows(self) -> int:
        """The host-callback form's list size: the most distinct ids of a
        batch (padding counted), rounded up to a power of two."""
        most = max(np.unique(b["sparse"]).size for b in self.batches)
        return 1 << (most - 1).bit_length()

    def cache(
        self, fraction: float | None, callback_rows: int | None = None
    ) -> jaxcache.EmbeddingCache:
        """A fresh cache of ``fraction`` of the rows (``None``: the full table)."""
        if fraction is None:
            cfg = self.setup.config(1, "lru")
            return jaxcache.EmbeddingCache.full_table(
                cfg, table=jaxcache.HostTable(cfg, rows=self.base)
            )
        cfg = self.setup.config(fraction, self.args.policy, callback_rows)
        table = jaxcache.HostTable(cfg, rows=self.base)
        return jaxcache.EmbeddingCache(cfg, table=table, frequencies=self.frequencies)

    def blocking(self, fraction: float | None, name: str) -> Timing:
        return run_blocking(self.setup, self.batches, self.cache(fraction), name, **self.common)

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
    ) -> Timing:
        """``host_callback``: the step looks the ids up with the host-callback
        form, its lists ``callback_rows`` long (``batch_sized``: the default,
        as long as the batch's ids)."""
        rows = self.callback_rows if host_callback and not batch_sized else None
        return run_loop(
            self.setup,
            self.batches,
            self.cache(fraction, rows),
            name,
            lookahead=lookahead,
            host_callback=host_callback,
            **self.common,
        )

    def variant(self, fraction: float | None) -> Variant:
        name = "full table" if fraction is None else f"cache {100 * fraction:g}%"
        lookahead = self.args.lookahead
        return Variant(
            name,
            self.blocking(fraction, name),
            self.loop(fraction, f"{name}, lookahead {lookahead}", lookahead),
        )

    def compare(self) -> list[Variant]:
        """Every variant of the configuration on the same batches."""
        variants = [self.variant(None)]
        variants += [self.variant(fraction) for fraction in self.args.fractions]
        naive = run_naive(self.setup, self.batches, self.base, **self.common)
        variants.append(Variant(naive.name, naive))
        print_table(self.setup, variants, self.args.lookahead)
        return variants


def print_table(setup: Setup, variants: list[Variant], lookahead: int) -> None:
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


def side_by_side(bench: Bench) -> tuple[float, float]:
    """Device alone, host alone and every loop of the 2% cache, side by side.

    The runs go round ``--rounds`` times, one of each per round, so that a
    change of load on the machine falls on all of them alike; each figure is
    the median over the rounds of a run's median, and ``range`` spans the
    rounds.

    Returns ``(pipelined over ideal, full table over pipelined)``.
    """
    args = bench.args
    k = args.lookahead
    lookaheads = sorted({0, k})
    runs = {
        "blocking": functools.partial(bench.blocking, 0.02, "cache 2%, blocking"),
        "staged": bench.staged,
    }
    try:
        bench.cache(0.02).callbacks.check()
        callbacks = True
    except RuntimeError as refused:  # one CPU core
        print(f"\nhost-callback form skipped: {refused}")
        callbacks = False
    for n in lookaheads:
        runs["cached", n] = functools.partial(bench.loop, 0.02, f"cache 2%, lookahead {n}", n)
        if callbacks:
            runs["callback", n] = functools.partial(
                bench.loop, 0.02, f"cache 2%, host callback, lookahead {n}", n, host_callback=True
            )
        runs["full", n] = functools.partial(bench.loop, None, f"full table, lookahead {n}", n)
    if callbacks:
        runs["batch-sized", k] = functools.partial(
            bench.loop,
            0.02,
            f"cache 2%, host callback, batch-sized lists, lookahead {k}",
            k,
            host_callback=True,
            batch_sized=True,
        )
    results: dict[Any, list[Timing]] = {key: [] for key in runs}
    for _ in range(args.rounds):
        for key, run in runs.items():
            results[key].append(run())

    def per_round(key: Any, part: str) -> list[float]:
        return [t.blocking if part == "blocking" else t.median(part) for t in results[key]]

    rows = [  # label, run, part
        ("(a) device step alone", "blocking", "device"),
        ("(b) host staging alone", "blocking", "staging"),
        ("    blocking: staging + swap + step", "blocking", "blocking"),
        *(
            (f"({'d' if n else 'c'}) cached, lookahead {n}", ("cached", n), "step")
            for n in lookaheads
        ),
        *((f"(e) host callback, lookahead {n}", ("callback", n), "step") for n in lookaheads),
        (f"    lists of all ids, lookahead {k}", ("batch-sized", k), "step"),
        *((f"(f) full table, lookahead {n}", ("full", n), "step") for n in lookaheads),
        ("(g) full table, staged beforehand", "staged", "step"),
    ]
    rows = [row for row in rows if row[1] in results]
    device = float(np.median(per_round("blocking", "device")))
    host = float(np.median(per_round("blocking", "staging")))
    ideal = max(device, host)
    full_step = float(np.median(per_round(("full", k), "step")))
    pipelined = float(np.median(per_round(("cached", k), "step")))
    reference = results["cached", 0][0].loss
    print()
    print(
        f"{bench.setup.name}, cache 2% ({args.policy}), side by side: {args.rounds} round(s) of "
        f"{args.steps} steps after {args.warmup} warm-up; median over the rounds of each run's "
        "median, ms per step"
    )
    header = (
        f"{'':<36}{'ms/step':>8}{'range':>14}{'steps/s':>8}{'/ ideal':>8}{'full/this':>10}"
        f"{'cores':>6}{'hit rate':>9}{'final loss':>11}{'|dloss|':>9}"
    )
    print(header)
    print("-" * len(header))
    for label, key, part in rows:
        values = per_round(key, part)
        seconds = float(np.median(values))
        spread = f"{1e3 * min(values):.2f}-{1e3 * max(values):.2f}"
        line = (
            f"{label:<36}{1e3 * seconds:>8.2f}{spread:>14}{1 / seconds:>8.1f}"
            f"{seconds / ideal:>8.2f}{full_step / seconds:>10.2f}"
        )
        if part in ("device", "step"):
            line += f"{np.median([t.cores for t in results[key]]):>6.2f}"
        if part in ("step", "blocking"):
            first = results[key][0]
            line += f"{'':>6}" if part == "blocking" else ""
            line += f"{first.hit_rate:>9.3f}{first.loss:>11.6f}{abs(first.loss - reference):>9.1e}"
        print(line)
        if part == "staging":
            print(f"{'    ideal: max(a, b)':<36}{1e3 * ideal:>8.2f}")
    _print_cpu(rows, results, ideal, pipelined, ("cached", k))
    for key in [key for key in runs if key[0] in ("cached", "callback", "batch-sized")]:
        timings = results[key]
        phases = {p: np.mean([t.phases.get(p, 0.0) for t in timings]) for p in timings[0].phases}
        parts = ", ".join(f"{p} {x:.2f}" for p, x in phases.items() if x > 0)
        waits = np.mean([t.write_back_waits for t in timings])
        print(f"  {timings[0].name}: {parts} (mean ms per call); {waits:.0f} write-back waits")
    print(
        "  (a), (b): parts of the blocking run; loops read each loss one step later. "
        f"/ ideal: over max(a, b); full/this: the full table at lookahead {k} over this; "
        f"cores: process CPU time over wall time, of {len(os.sched_getaffinity(0))} (a pipeline "
        "can only overlap host and device work with more than one); hit rate and final loss "
        "of the first round; |dloss|: vs the unpipelined loop."
    )
    return pipelined / ideal, full_step / pipelined


def _print_cpu(
    rows: list[tuple[str, Any, str]],
    results: dict[Any, list[Timing]],
    ideal: float,
    pipelined: float,
    key_pipelined: Any,
) -> None:
    """The loops' CPU per step by thread, and the floor it puts under a step:
    on ``cores`` cores no loop runs a step in less than all its threads' CPU
    time over ``cores``, however well it overlaps."""
    loops = [(label, key) for label, key, part in rows if part == "step" and results[key][0].cpu]
    if not loops:
        return
    cores = len(os.sched_getaffinity(0))
    print(
        f"  CPU per step, ms (median over the rounds): {'loop':>6}{'prefetch':>9}"
        f"{'runtime':>8}{'all':>7}{f'all/{cores}':>7}{'/ ideal':>8}"
    )
    floors = {}
    for label, key in loops:
        parts = {p: np.median([t.cpu[p] for t in results[key]]) for p in results[key][0].cpu}
        total = float(np.median([sum(t.cpu.values()) for t in results[key]]))
        floors[key] = total / cores
        print(
            f"  {label.strip():<41}{1e3 * parts['loop']:>6.2f}{1e3 * parts['prefetch']:>9.2f}"
            f"{1e3 * parts['runtime']:>8.2f}{1e3 * total:>7.2f}{1e3 * floors[key]:>7.2f}"
            f"{floors[key] / ideal:>8.2f}"
        )
    if key_pipelined in floors:
        floor = floors[key_pipelined]
        print(
            f"  loop: the training thread; prefetch: the pipeline's producer; runtime: JAX's "
            f"threads (XLA's). Pipelined over ideal {pipelined / ideal:.2f} = its CPU floor "
            f"{floor / ideal:.2f} x ideal, times {pipelined / floor:.2f} that did not overlap."
        )


@contextlib.contextmanager
def _split_cores(device: set[int], host: set[int]) -> Iterator[None]:
    """This (the training) thread, and so the producer threads it starts, on
    the ``host`` cores; every other thread of the process (JAX's runtime:
    XLA's compute pool, and the threads that run its programs) on the
    ``device`` cores; all back afterwards."""
    everything = os.sched_getaffinity(0)
    me = threading.get_native_id()
    try:
        for tid in _threads():
            with contextlib.suppress(OSError):  # it ended meanwhile
                os.sched_setaffinity(tid, host if tid == me else device)
        yield
    finally:
        for tid in _threads():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, everything)


def split_cores(bench: Bench) -> float | None:
    """The side-by-side runs with host and device on cores of their own.

    On a CPU the "device" is the host's own cores. Here JAX's runtime threads
    (XLA's among them) get half of the cores (the first) and the training
    thread, with the pipeline's producer, the rest, as an accelerator and its
    host would: then the pipeline can only hide the host work behind the
    device step, never take cores from it. (a) and (b) are measured under the
    same split, so the ideal is ``max(a, b)`` again.

    Returns ``pipelined over ideal`` under the split, or ``None`` where it
    cannot be made (one core, or not Linux).
    """
    args = bench.args
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or not _threads():
        print(f"\nsplit cores: skipped ({len(cores)} core(s); threads listed: {bool(_threads())})")
        return None
    device, host = set(cores[: len(cores) // 2]), set(cores[len(cores) // 2 :])
    k = args.lookahead
    lookaheads = sorted({0, k})
    runs: dict[Any, Callable[[], Timing]] = {
        "blocking": functools.partial(bench.blocking, 0.02, "cache 2%, blocking")
    }
    for n in lookaheads:
        runs[n] = functools.partial(bench.loop, 0.02, f"cache 2%, lookahead {n}", n)
    runs["staged"] = bench.staged
    results: dict[Any, list[Timing]] = {key: [] for key in runs}
    with _split_cores(device, host):
        for _ in range(args.rounds):
            for key, run in runs.items():
                results[key].append(run())

    def per_round(key: Any, part: str) -> list[float]:
        return [t.median(part) for t in results[key]]

    rows = [  # label, run, part
        ("(a) device step alone", "blocking", "device"),
        ("(b) host staging alone", "blocking", "staging"),
        ("    swap alone (device)", "blocking", "swap"),
        *((f"({'d' if n else 'c'}) cached, lookahead {n}", n, "step") for n in lookaheads),
        ("(g) full table, staged beforehand", "staged", "step"),
    ]
    ideal = max(float(np.median(per_round("blocking", part))) for part in ("device", "staging"))
    print(
        f"\nsplit cores: JAX's runtime threads on core(s) {sorted(device)}, the training thread "
        f"and the producer on {sorted(host)}; {args.rounds} round(s), median over the rounds of "
        "each run's median, ms per step"
    )
    header = f"{'':<36}{'ms/step':>8}{'range':>14}{'/ ideal':>8}{'|dloss|':>9}"
    print(header)
    print("-" * len(header))
    reference = results[0][0].loss
    for label, key, part in rows:
        values = per_round(key, part)
        seconds = float(np.median(values))
        spread = f"{1e3 * min(values):.2f}-{1e3 * max(values):.2f}"
        line = f"{label:<36}{1e3 * seconds:>8.2f}{spread:>14}{seconds / ideal:>8.2f}"
        if part == "step":
            line += f"{abs(results[key][0].loss - reference):>9.1e}"
        print(line)
    print(
        "  ideal: max(a, b) under the split; (g): a loop of device steps with no host work "
        "left, the pace of the device (the device step alone, (a), also waits for its own "
        "dispatch; in a loop the next step's dispatch overlaps the step before). The cache's "
        "swap is device work too, between the steps. |dloss|: vs lookahead 0."
    )
    return float(np.median(per_round(k, "step"))) / ideal


def planner_throughput(setup: Setup, args: argparse.Namespace) -> None:
    """Ids/s of ``Planner.plan`` on large batches, after the cache has warmed up."""
    data = dataclasses.replace(setup.data, batch_size=args.planner_batch)
    batches = [data.batch(i)["sparse"] for i in range(args.warmup + args.steps)]
    cfg = setup.config(0.05, args.policy)
    planner = jaxcache.planning.Planner(
        cfg, frequencies=data.count_frequencies(args.profile_batches)
    )
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


def staged_steps(bench: Bench) -> None:
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
    results: dict[tuple[str, str], list[tuple[float, float]]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for variant in variants:
            results[variant].append(_staged_step_times(bench, *variant))
    print()
    print(
        f"training step, {bench.setup.name}, full table, every batch staged beforehand; "
        f"{args.rounds} round(s), ms:"
    )
    print(f"  {'step':<34}{'pooling reads':<16}{'CPU per call':>18}{'step':>18}")
    for (kind, pooling), rounds in results.items():
        cells = ""
        for values in zip(*rounds, strict=True):
            spread = f"({1e3 * min(values):.2f}-{1e3 * max(values):.2f})"
            cells += f"{1e3 * np.median(values):>6.2f} {spread:>11}"
        print(f"  {kind:<34}{pooling:<16}{cells}")


def _staged_step_times(bench: Bench, kind: str, pooling: str) -> tuple[float, float]:
    """Medians of the CPU time per call and of the step time of one run."""
    tx = jaxcache.models.dense_optimizer("adagrad", DENSE_LEARNING_RATE)
    cache = bench.cache(None)
    embed = jaxcache.nnx.CachedEmbed(cache, combiner=bench.setup.combiner)
    model = _model(bench.setup, embed, bench.args.seed)
    if kind.startswith("nnx"):
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        step = nnx.cached_partial(_nnx_train_step, model, optimizer)
    else:
        _, step = jaxcache.models.make_train_step(model, tx)
    lookups, inputs = _stage_all(cache, bench.batches, all_positions=pooling == "all positions")
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


def capacity_scaling(bench: Bench) -> None:
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
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
    parser.add_argument(
        "--side-by-side-only",
        action="store_true",
        help="only the embedding-heavy side-by-side rounds and pipelined_over_ideal "
        "(about 2.5 minutes)",
    )
    parser.add_argument("--scale", type=float, default=None, help="SyntheticCriteo scale")
    parser.add_argument("--policy", default="frequency", choices=jaxcache.planning.POLICIES)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.lookahead < 0:
        parser.error(f"--lookahead={args.lookahead} must be 0 (unpipelined) or more, e.g. 2.")
    args.scale = args.scale or (0.02 if args.quick else 0.1)
    args.steps = args.steps or (20 if args.quick else 100)
    args.warmup = args.warmup if args.warmup is not None else (5 if args.quick else 20)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.fractions = (0.005, 0.02, 0.05)
    args.profile_batches = 20
    args.planner_batch = 1024
    quick = args.quick
    dlrm = Setup(
        "dlrm",
        jaxcache.synthetic.SyntheticCriteo(
            scale=args.scale, batch_size=512 if quick else 2048, seed=0
        ),
        features=16,
        bottom=(512, 256, 64),
        top=(512, 256),
    )
    heavy = Setup(
        "embedding-heavy",
        jaxcache.synthetic.SyntheticCriteo(
            scale=args.scale, batch_size=128 if quick else 512, multi_hot=True, bag_size=16
        ),
        features=16,
        bottom=(16,),
        top=(32,),
    )
    if quick:
        args.fractions = (0.02, 0.05)  # 0.5% of the small table is below one batch
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}, "
        f"{len(os.sched_getaffinity(0))} cores; {args.steps} timed steps after {args.warmup} "
        f"warm-up; loops at lookahead {args.lookahead}"
    )
    if not args.side_by_side_only:
        Bench(dlrm, args).compare()
    bench = Bench(heavy, args)
    if not args.side_by_side_only:
        bench.compare()
    over_ideal, cached_over_full = side_by_side(bench)
    over_ideal_split = split_cores(bench)
    print(f"pipelined_over_ideal={over_ideal:.3f}")
    if over_ideal_split is not None:
        print(f"pipelined_over_ideal_split_cores={over_ideal_split:.3f}")
    if not args.side_by_side_only:
        planner_throughput(heavy, args)
        capacity_scaling(bench)
        staged_steps(bench)
    print(f"cached_2pct_over_full={cached_over_full:.3f}")


if __name__ == "__main__":
    main()
