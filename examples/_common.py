"""What the DLRM examples share: their flags, their data and their summary.

``dlrm.py`` (one device), ``dlrm_pjit.py`` and ``dlrm_pmap.py`` (many
devices) train the same model on the same data; each builds its cache and
model and runs its own training loop through ``jaxcache.prefetch``. What is
here is the rest, once: the command line, the data (the synthetic stream or
Criteo files, behind one small interface), the progress bar, and the summary
whose last line is one JSON object.

The scripts run from the repository root (``python examples/dlrm.py``), so
this directory is ``sys.path[0]`` and ``import _common`` finds this module.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import logging
import math
import pathlib
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from _flags import check_ranges  # examples/_flags.py
from tqdm import tqdm

import jaxcache

Batch = dict[str, np.ndarray]

# Learning rates per --optimizer: (dense optax optimizer, sparse row optimizer).
LEARNING_RATES = {"adagrad": (0.05, 0.05), "adam": (1e-3, 1e-2)}
# --scale when not given: a small synthetic table; Criteo's own vocabulary.
DEFAULT_SCALE = {"synthetic": 0.01, "criteo": 1.0}
# Simulated CPU devices of the many-device examples when --devices is not given.
DEFAULT_CPU_DEVICES = 4


# ------------------------------------------------------------------- flags
def parse_args(
    doc: str,
    argv: list[str] | None = None,
    *,
    host_callback: bool = False,
    devices: bool = False,
) -> argparse.Namespace:
    """The flags of a DLRM example, checked (``parser.error`` names the fix).

    Args:
      doc: the script's docstring; its first paragraph is the description.
      argv: the arguments (default: ``sys.argv[1:]``).
      host_callback: offer ``--host-callback`` (the one-device example).
      devices: offer ``--devices`` (the many-device examples).
    """
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=1000, help="training steps")
    parser.add_argument("--batch-size", type=int, default=1024, help="samples per step")
    parser.add_argument("--seed", type=int, default=0, help="data, table and model seed")
    data = parser.add_argument_group("data")
    data.add_argument(
        "--data",
        default="synthetic",
        choices=("synthetic", "criteo"),
        help="synthetic: the embedded Criteo-like stream; criteo: Criteo TSV files (--manual-dir)",
    )
    data.add_argument(
        "--manual-dir",
        type=pathlib.Path,
        default=None,
        help="with --data criteo: directory holding the Kaggle train.txt or day_N files",
    )
    data.add_argument(
        "--data-dir",
        type=pathlib.Path,
        default=None,
        help="with --data criteo: where the dataset is built (TFDS's default if unset)",
    )
    data.add_argument(
        "--train-split",
        default=None,
        help="with --data criteo: split trained on (default: train[:90%%], or every day but "
        "the last)",
    )
    data.add_argument(
        "--eval-split",
        default=None,
        help="with --data criteo: held-out split (default: train[90%%:], or the last day)",
    )
    data.add_argument(
        "--scale",
        type=float,
        default=None,
        help="fraction of Criteo's cardinalities kept; Criteo ids are hashed into the smaller "
        "vocabulary (default: 0.01 synthetic, 1 criteo)",
    )
    data.add_argument(
        "--multi-hot",
        action="store_true",
        help="synthetic only: bags of DCNv2 sizes, summed, instead of one id; a batch then "
        "holds more distinct ids than the default --cache-fraction has rows: raise it too "
        "(0.035 holds them with the default flags on 1, 4 and 8 devices)",
    )
    data.add_argument(
        "--bag-size",
        type=int,
        default=argparse.SUPPRESS,  # left unset, so that _check sees whether it was given
        help="longest bag with --multi-hot (default: 8)",
    )
    parser.add_argument(
        "--cache-fraction", type=float, default=0.02, help="rows on device / table rows"
    )
    parser.add_argument(
        "--policy", default="frequency", choices=jaxcache.planning.POLICIES, help="eviction policy"
    )
    parser.add_argument(
        "--optimizer",
        default="adagrad",
        choices=sorted(LEARNING_RATES),
        help="adagrad: optax.adagrad + row-wise Adagrad rows; adam: optax.adam + lazy Adam rows",
    )
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=None,
        help="dense learning rate (default per optimizer)",
    )
    parser.add_argument(
        "--row-learning-rate",
        type=float,
        default=None,
        help="embedding row learning rate (default per optimizer)",
    )
    parser.add_argument("--features", type=int, default=16, help="D, embedding width")
    parser.add_argument(
        "--bottom", default="512,256,64", help="hidden widths of the bottom MLP (output is D)"
    )
    parser.add_argument("--top", default="512,256", help="hidden widths of the top MLP")
    parser.add_argument(
        "--profile-batches",
        type=int,
        default=20,
        help="training batches counted for the frequency profile given to the policy (with "
        "--data criteo the whole training split is counted, once; 0 = no profile)",
    )
    parser.add_argument("--eval-batches", type=int, default=20, help="held-out batches for AUC")
    parser.add_argument(
        "--full-table", action="store_true", help="whole table on device (the baseline)"
    )
    parser.add_argument(
        "--lookahead",
        type=int,
        default=2,
        help="batches staged ahead on a host thread (jaxcache.prefetch); 0 = unpipelined",
    )
    if host_callback:
        parser.add_argument(
            "--host-callback",
            action="store_true",
            help="pass the ids into the jitted step, looked up there by CachedEmbed.lookup_ids",
        )
        parser.add_argument(
            "--callback-rows",
            type=int,
            default=None,
            help="with --host-callback: pad the step's row lists to this many rows (at least "
            "the most distinct ids of a batch) instead of the batch's number of ids",
        )
    if devices:
        parser.add_argument(
            "--devices",
            type=int,
            default=None,
            help="devices to train on: the first N accelerators, or N simulated CPU devices "
            f"(default: every accelerator, or {DEFAULT_CPU_DEVICES} CPU devices)",
        )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    args.host_callback = getattr(args, "host_callback", False)
    args.callback_rows = getattr(args, "callback_rows", None)
    _check(parser, args)
    dense, rows = LEARNING_RATES[args.optimizer]
    if args.learning_rate is None:
        args.learning_rate = dense
    if args.row_learning_rate is None:
        args.row_learning_rate = rows
    return args


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if "bag_size" not in args:
        args.bag_size = 8
    elif not args.multi_hot:
        parser.error(
            "--bag-size sizes the bags of --multi-hot (synthetic data only); add --multi-hot, "
            "or drop --bag-size."
        )
    check_ranges(
        parser,
        args,
        counts=("steps", "batch_size", "features", "eval_batches", "bag_size"),
        fractions=("cache_fraction",),
    )
    if getattr(args, "devices", None) is not None and args.devices < 1:
        parser.error(f"--devices={args.devices} must be at least 1.")
    for name in ("learning_rate", "row_learning_rate"):
        value = getattr(args, name)
        if value is not None and not 0 <= value < math.inf:
            parser.error(f"--{name.replace('_', '-')}={value} must be a finite rate >= 0.")
    if args.profile_batches < 0:
        parser.error(f"--profile-batches={args.profile_batches} must be 0 (no profile) or more.")
    if args.profile_batches == 0 and args.policy == "frequency" and not args.full_table:
        parser.error(
            "--profile-batches=0 leaves --policy frequency without the counts it ranks rows "
            "by; count some batches (e.g. 20) or pick --policy adaptive, lfu or lru."
        )
    if args.callback_rows is not None:
        if not args.host_callback:
            parser.error("--callback-rows sizes the host-callback form; add --host-callback.")
        if args.callback_rows < 1:
            parser.error(f"--callback-rows={args.callback_rows} must be at least 1, e.g. 4096.")
    if args.scale is None:
        args.scale = DEFAULT_SCALE[args.data]
    if not 0 < args.scale <= 1:
        parser.error(f"--scale={args.scale} must be in (0, 1], e.g. 0.01.")
    if args.data == "criteo":
        if args.manual_dir is None:
            parser.error(
                "--data criteo needs --manual-dir DIR, the directory holding the Criteo files "
                "(the Kaggle train.txt, or day_0 ... day_23), plain or gzipped."
            )
        if not args.manual_dir.is_dir():
            parser.error(
                f"--manual-dir={args.manual_dir} is not a directory; pass the directory that "
                "holds train.txt or the day_N files."
            )
        if args.multi_hot:
            parser.error(
                "--multi-hot is for --data synthetic: Criteo has one id per feature; drop "
                "--multi-hot."
            )
    else:
        given = [
            flag
            for flag, value in (
                ("--manual-dir", args.manual_dir),
                ("--data-dir", args.data_dir),
                ("--train-split", args.train_split),
                ("--eval-split", args.eval_split),
            )
            if value is not None
        ]
        if given:
            parser.error(
                f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} only for Criteo "
                f"files; add --data criteo, or drop {'it' if len(given) == 1 else 'them'} for "
                "the synthetic stream."
            )
    try:
        args.bottom = _widths(args.bottom)
        args.top = _widths(args.top)
    except ValueError as error:
        parser.error(str(error))


def _widths(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(w) for w in text.split(",") if w.strip())
    except ValueError:
        widths = ()
    if not widths or min(widths) < 1:
        raise ValueError(f"layer widths {text!r} must be positive integers like 512,256.")
    return widths


@contextlib.contextmanager
def capacity_errors() -> Iterator[None]:
    """Exits with a batch the cache cannot hold as a usage error, naming the
    flag to change. A held-out batch can hold more distinct ids than any
    training batch did, so evaluation goes through it too."""
    try:
        yield
    except jaxcache.CapacityError as error:
        sys.exit(f"error: {error} (--cache-fraction sets the capacity.)")


def devices(args: argparse.Namespace) -> list[jax.Device]:
    """The ``--devices`` devices the batch splits over.

    On a machine without accelerators they are ``--devices`` simulated CPU
    devices, so call it before anything asks JAX for its devices: the CPU
    device count is fixed when JAX starts its backends.
    """
    count = args.devices
    # Only the CPU backend reads it; on accelerators the devices present are used.
    jax.config.update("jax_num_cpu_devices", count or DEFAULT_CPU_DEVICES)
    present = jax.devices()
    if count is not None and count > len(present):
        sys.exit(
            f"error: --devices={count}, but only {len(present)} {present[0].platform} devices "
            f"are present; pass --devices {len(present)} or fewer."
        )
    chosen = present[:count]
    if args.batch_size % len(chosen):
        sys.exit(
            f"error: --batch-size={args.batch_size} does not split over {len(chosen)} devices; "
            f"use a multiple of {len(chosen)}."
        )
    return chosen


# -------------------------------------------------------------------- data
@dataclasses.dataclass(frozen=True)
class Data:
    """One interface over the synthetic stream and Criteo files.

    Attributes:
      description: what the data is, for the summary.
      num_embeddings: ``N``, rows of the one table all features share.
      num_features: ``F``, sparse features per sample.
      padding_id: bag padding (``--multi-hot``), else ``None``.
      frequencies: ``int64 [N]`` access counts for the policy, or ``None``.
      train: ``{"dense": float32 [B, 13], "sparse": int64 [B, F(, L)],
        "label": float32 [B]}`` batches, ``--steps`` of them.
      held_out: the evaluation batches (same layout), read up front.
    """

    description: str
    num_embeddings: int
    num_features: int
    padding_id: int | None
    frequencies: np.ndarray | None
    train: Iterator[Batch]
    held_out: list[Batch]


def load_data(args: argparse.Namespace) -> Data:
    """The ``--data`` source, with a frequency profile when the cache uses one."""
    profile = args.profile_batches > 0 and not args.full_table
    if args.data == "criteo":
        return _criteo(args, profile)
    data = jaxcache.synthetic.SyntheticCriteo(
        scale=args.scale,
        batch_size=args.batch_size,
        seed=args.seed,
        multi_hot=args.multi_hot,
        bag_size=args.bag_size,
    )
    return Data(
        description=f"synthetic Criteo-like stream, scale {args.scale:g}",
        num_embeddings=data.num_embeddings,
        num_features=data.num_features,
        padding_id=data.padding_id if args.multi_hot else None,
        frequencies=data.count_frequencies(args.profile_batches) if profile else None,
        train=data.batches(args.steps),
        held_out=list(data.batches(args.eval_batches, held_out=True)),
    )


def _criteo(args: argparse.Namespace, profile: bool) -> Data:
    """Criteo files through ``jaxcache.datasets`` (built once under ``--data-dir``)."""
    import jaxcache.datasets as jd

    # TFDS logs a warning for every configuration it does not ship.
    logging.getLogger("absl").setLevel(logging.ERROR)
    if args.scale == 1:
        config: str | jd.CriteoConfig = "kaggle"
    else:
        # The synthetic stream's scaled cardinalities: the same table for the same --scale.
        sizes = jaxcache.synthetic.SyntheticCriteo(scale=args.scale).cardinalities
        config = jd.CriteoConfig(name=f"kaggle_scale{args.scale:g}", vocab_sizes=sizes)
    try:
        builder = jd.prepare(
            jd.CriteoBuilder(config=config, data_dir=args.data_dir), args.manual_dir
        )
    except (FileNotFoundError, jd.DataFormatError) as error:
        sys.exit(f"error: {error}")
    train_split, eval_split = _criteo_splits(builder, args.train_split, args.eval_split)
    train = jd.criteo_batches(
        builder=builder,
        batch_size=args.batch_size,
        split=train_split,
        seed=args.seed,
        shuffle=True,
        num_epochs=None,  # as many passes as --steps needs
        frequencies=profile,
    )
    held_out = jd.criteo_batches(
        builder=builder,
        batch_size=args.batch_size,
        split=eval_split,
        shuffle=False,
        frequencies=False,
    )
    try:
        eval_batches = list(itertools.islice(held_out.batches, args.eval_batches))
    except ValueError as error:  # fewer rows than one batch
        sys.exit(f"error: --eval-split {eval_split!r}: {error}")
    return Data(
        description=f"Criteo files in {args.manual_dir}, trained on {train_split!r}, "
        f"evaluated on {eval_split!r}, vocabulary scale {args.scale:g}",
        num_embeddings=train.num_embeddings,
        num_features=len(train.cardinalities),
        padding_id=None,
        frequencies=train.frequencies,
        train=itertools.islice(train.batches, args.steps),
        held_out=eval_batches,
    )


def _criteo_splits(builder: Any, train: str | None, held_out: str | None) -> tuple[str, str]:
    """The splits given, else the latest tenth of train.txt (or the last day) held out."""
    names = list(builder.info.splits)
    if "train" in names:
        default = ("train[:90%]", "train[90%:]")
    else:
        days = sorted(names, key=lambda name: int(name.removeprefix("day_")))
        if len(days) == 1:
            default = (f"{days[0]}[:90%]", f"{days[0]}[90%:]")
        else:
            default = ("+".join(days[:-1]), days[-1])
    splits = (train or default[0], held_out or default[1])
    for flag, split in zip(("--train-split", "--eval-split"), splits, strict=True):
        try:
            records = builder.info.splits[split].num_examples
        except ValueError as error:
            sys.exit(f"error: {flag} {split!r}: {error}")
        if records == 0:
            sys.exit(f"error: {flag} {split!r} holds no records: {_too_few(builder, split)}")
    return splits


def _too_few(builder: Any, split: str) -> str:
    """Why a slice of ``split`` came out empty, and what would not."""
    # The split the slice is taken of: "train" of "train[90%:]".
    whole = [part.split("[")[0] for part in split.split("+")]
    rows = sum(builder.info.metadata["rows"].get(name, 0) for name in whole)
    records = sum(builder.info.splits[name].num_examples for name in whole)
    per_record = builder.builder_config.rows_per_record
    held = (
        f"{'+'.join(whole)} holds {rows:,} rows in {records} record{'s' * (records != 1)} "
        f"of up to {per_record:,} rows, and a percentage slices whole records (holding out "
        "10% needs 5 records or more)."
    )
    if records < 2:
        return (
            f"{held} Training on some and holding out others needs 2 records, more than "
            f"{per_record:,} rows: use more data."
        )
    if len(whole) > 1:
        return f"{held} Pass splits of whole days, or use more data."
    return (
        f"{held} Pass coarser splits, --train-split '{whole[0]}[:50%]' and --eval-split "
        f"'{whole[0]}[50%:]', or use more data."
    )


# ----------------------------------------------------------------- summary
class Started(NamedTuple):
    """When the run started: wall clock and XLA compilations so far."""

    seconds: float
    compilations: int


def start() -> Started:
    """Marks the start of a run (for ``wall_seconds`` and ``compilations``)."""
    return Started(time.perf_counter(), jaxcache.testing.compilations())


class Progress:
    """The training loop's progress bar, and the figures of its summary.

    Made just before the loop; ``step(loss)`` after every step; ``finish()``
    after the loop, before the evaluation looks rows up too.

    Args:
      args: the flags (``--steps``, ``--no-progress``).
      cache: the cache trained through.
    """

    def __init__(self, args: argparse.Namespace, cache: jaxcache.EmbeddingCache) -> None:
        self.cache = cache
        self.steps = args.steps
        self.losses: list[Any] = []
        self.start = self.warm = time.perf_counter()
        self.compilations_warm = jaxcache.testing.compilations()
        self.bar = tqdm(
            total=args.steps,
            desc="train",
            unit="step",
            disable=True if args.no_progress else None,
        )

    def step(self, loss: Any) -> None:
        """Counts a step and its (not yet computed) loss."""
        index = len(self.losses)
        self.losses.append(loss)
        if index == 0:
            # The first step compiles; throughput is measured after it.
            loss.block_until_ready()
            self.warm = time.perf_counter()
            self.compilations_warm = jaxcache.testing.compilations()
        if index % 50 == 49 or index == self.steps - 1:
            self.bar.set_postfix(
                loss=f"{float(loss):.4f}", hit_rate=f"{self.cache.stats.total.hit_rate:.3f}"
            )
        self.bar.update()

    def finish(self) -> dict[str, Any]:
        """The losses (NumPy), timings and the cache's counters after training."""
        self.bar.close()
        losses = np.array([float(x) for x in self.losses])
        end = time.perf_counter()
        steps = len(losses)
        return {
            "losses": losses,
            "seconds": end - self.start,
            "steps_per_s": (steps - 1) / (end - self.warm) if steps > 1 else 0.0,
            "compilations_after_first_step": (
                jaxcache.testing.compilations() - self.compilations_warm
            ),
            "counters": self.cache.stats.as_dict(),
            # Mean ms per occurrence of each phase of the cache's work. With a
            # look-ahead, plan/write_back/gather run on the producer thread;
            # deferred, transfer, swap, wait (the loop waiting for a staged
            # batch) and device_wait are spent in the training loop.
            "phase_mean_ms": self.cache.stats.timers.mean_ms(),
        }


def report(
    args: argparse.Namespace,
    started: Started,
    data: Data,
    cache: jaxcache.EmbeddingCache,
    trained: dict[str, Any],
    probabilities: Sequence[Any],
    *,
    parallelism: str,
) -> dict[str, Any]:
    """Prints the summary and, as the last line, the results as one JSON object.

    Args:
      args: the flags.
      started: from ``start()``.
      data: the data source.
      cache: the cache trained.
      trained: from ``Progress.finish``.
      probabilities: the click probabilities of each batch of ``data.held_out``.
      parallelism: ``"none"``, ``"pjit"`` or ``"pmap"``.

    Returns:
      The results.
    """
    losses, counters = trained["losses"], trained["counters"]
    steps = len(losses)
    tail = max(1, steps // 10)
    result = {
        "loss": float(losses[-tail:].mean()),
        "last_loss": float(losses[-1]),
        **_held_out_metrics(data, probabilities),
        "hit_rate": counters["hit_rate"],
        "access_hit_rate": counters["access_hit_rate"],
        "rows_fetched": counters["rows_to_device"],
        "rows_written_back": counters["rows_to_host"],
        "bytes_to_device": counters["bytes_to_device"],
        "bytes_to_host": counters["bytes_to_host"],
        "steps_per_s": trained["steps_per_s"],
        "samples_per_s": trained["steps_per_s"] * args.batch_size,
        "phase_mean_ms": trained["phase_mean_ms"],
        "write_back_waits": counters["write_back_waits"],
        "train_seconds": trained["seconds"],
        "wall_seconds": time.perf_counter() - started.seconds,
        "cache_rows": cache.config.capacity,
        "table_rows": cache.config.num_embeddings,
        "cache_fraction": cache.config.capacity / cache.config.num_embeddings,
        "lookups": counters["lookups"],
        "distinct_per_step": counters["distinct"] / steps,
        "compilations": jaxcache.testing.compilations() - started.compilations,
        "compilations_after_first_step": trained["compilations_after_first_step"],
        "full_table": args.full_table,
        "lookahead": args.lookahead,
        "host_callback": args.host_callback,
        "policy": "full-table" if args.full_table else args.policy,
        "optimizer": args.optimizer,
        "data": args.data,
        "parallelism": parallelism,
        "devices": cache.devices,
        "steps": steps,
        "batch_size": args.batch_size,
        "seed": args.seed,
    }
    print_summary(result, data.description)
    print(json.dumps(result))
    return result


def _held_out_metrics(data: Data, probabilities: Sequence[Any]) -> dict[str, Any]:
    """Held-out AUC and log loss of the click probabilities of ``data.held_out``."""
    y = np.concatenate([batch["label"] for batch in data.held_out])
    p = np.concatenate([np.asarray(x).reshape(-1) for x in probabilities])
    p = np.clip(p.astype(np.float64), 1e-7, 1 - 1e-7)
    return {
        "auc": jaxcache.synthetic.roc_auc(y, p),
        "eval_loss": float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p))),
        "eval_samples": int(y.size),
    }


def print_summary(r: dict[str, Any], description: str) -> None:
    """A few lines for people; the JSON line that follows is for programs."""
    where = "whole table on device" if r["full_table"] else f"{r['policy']} cache"
    over = "" if r["parallelism"] == "none" else f", {r['devices']} devices ({r['parallelism']})"
    print(
        f"DLRM, {where}{over}: {r['cache_rows']:,} of {r['table_rows']:,} rows on device "
        f"({100 * r['cache_fraction']:.2f}%)"
    )
    print(f"  data: {description}")
    how = f"look-ahead {r['lookahead']}" if r["lookahead"] else "unpipelined"
    if r["host_callback"]:
        how += ", ids looked up in the step by host callback"
    print(
        f"  trained {r['steps']} steps x {r['batch_size']} samples in {r['train_seconds']:.1f} s "
        f"({r['steps_per_s']:.1f} steps/s; {how})"
    )
    phases = ", ".join(f"{k} {v:.2f}" for k, v in r["phase_mean_ms"].items())
    print(f"  cache phases, mean ms per call: {phases}")
    print(
        f"  train loss {r['loss']:.4f} (last {r['last_loss']:.4f}); held-out AUC "
        f"{r['auc']:.4f}, log loss {r['eval_loss']:.4f} on {r['eval_samples']:,} samples"
    )
    print(
        f"  hit rate {r['hit_rate']:.3f} of distinct ids ({r['access_hit_rate']:.3f} of "
        f"lookups); {r['rows_fetched']:,} rows fetched ({r['bytes_to_device'] / 2**20:.1f} MiB), "
        f"{r['rows_written_back']:,} written back ({r['bytes_to_host'] / 2**20:.1f} MiB)"
    )
    print(
        f"  {r['compilations']} XLA compilations, {r['compilations_after_first_step']} after the "
        "first step"
    )
