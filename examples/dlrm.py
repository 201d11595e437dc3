"""Trains DLRM on a synthetic Criteo-like stream through a device cache of hot rows.

All 26 sparse features share one embedding table kept in host memory; only
``--cache-fraction`` of its rows (2% by default) live on the device. The cache
is exact: ``--full-table`` trains the same model with the whole table on
device and, with the same seed, ends with the same loss.

Batches go through ``jaxcache.prefetch``: a host thread plans, gathers and
transfers the next ``--lookahead`` batches while the device trains on the
current one. ``--lookahead 0`` does that work in the training loop instead
(the unpipelined path); ``--host-callback`` passes the raw ids into the jitted
step, which looks them up with ``CachedEmbed.lookup_ids``. All three compute
the same thing: with the same seed they end with the same loss, bit for bit.

    python examples/dlrm.py                      # ~1 minute on 2 CPU cores
    python examples/dlrm.py --full-table         # the baseline
    python examples/dlrm.py --lookahead 0        # unpipelined
    python examples/dlrm.py --host-callback      # ids looked up inside the step
    python examples/dlrm.py --policy lru --steps 200

Prints a summary, then as its last line one JSON object with the results
(``loss``, ``auc``, ``hit_rate``, ``rows_fetched``, ``steps_per_s``,
``lookahead``, ``host_callback``, ``phase_mean_ms``, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from flax import nnx
from tqdm import tqdm

import jaxcache

# Learning rates per --optimizer: (dense optax optimizer, sparse row optimizer).
_LEARNING_RATES = {"adagrad": (0.05, 0.05), "adam": (1e-3, 1e-2)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=1000, help="training steps")
    parser.add_argument("--batch-size", type=int, default=1024, help="samples per step")
    parser.add_argument("--seed", type=int, default=0, help="data, table and model seed")
    parser.add_argument(
        "--scale", type=float, default=0.01, help="fraction of Criteo's cardinalities kept"
    )
    parser.add_argument(
        "--cache-fraction", type=float, default=0.02, help="rows on device / table rows"
    )
    parser.add_argument(
        "--policy", default="frequency", choices=jaxcache.POLICIES, help="eviction policy"
    )
    parser.add_argument(
        "--optimizer",
        default="adagrad",
        choices=sorted(_LEARNING_RATES),
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
        "--multi-hot", action="store_true", help="bags of DCNv2 sizes, summed, instead of one id"
    )
    parser.add_argument("--bag-size", type=int, default=8, help="longest bag with --multi-hot")
    parser.add_argument(
        "--profile-batches",
        type=int,
        default=20,
        help="training batches counted for the frequency profile given to the policy",
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
    parser.add_argument(
        "--host-callback",
        action="store_true",
        help="pass the ids into the jitted step, looked up there by CachedEmbed.lookup_ids",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "features", "eval_batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1.")
    if args.lookahead < 0:
        parser.error(f"--lookahead={args.lookahead} must be 0 (unpipelined) or more, e.g. 2.")
    if not 0 < args.cache_fraction <= 1:
        parser.error(f"--cache-fraction={args.cache_fraction} must be in (0, 1], e.g. 0.02.")
    try:
        args.bottom = _widths(args.bottom)
        args.top = _widths(args.top)
    except ValueError as error:
        parser.error(str(error))
    return args


def _widths(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(w) for w in text.split(",") if w.strip())
    except ValueError:
        widths = ()
    if not widths or min(widths) < 1:
        raise ValueError(f"layer widths {text!r} must be positive integers like 512,256.")
    return widths


def build(args: argparse.Namespace):
    """The data stream, the cache engine, the model and its two steps."""
    data = jaxcache.SyntheticCriteo(
        scale=args.scale,
        batch_size=args.batch_size,
        seed=args.seed,
        multi_hot=args.multi_hot,
        bag_size=args.bag_size,
    )
    dense_lr, row_lr = _LEARNING_RATES[args.optimizer]
    dense_lr = args.learning_rate or dense_lr
    row_lr = args.row_learning_rate or row_lr
    row_optimizer = (
        jaxcache.rowwise_adagrad(row_lr) if args.optimizer == "adagrad" else jaxcache.adam(row_lr)
    )
    config = jaxcache.CacheConfig(
        num_embeddings=data.num_embeddings,
        features=args.features,
        capacity=args.cache_fraction,
        policy=args.policy,
        optimizer=row_optimizer,
        padding_id=data.padding_id if args.multi_hot else None,
    )
    if args.full_table:
        cache = jaxcache.EmbeddingCache.full_table(config, seed=args.seed)
    else:
        frequencies = (
            data.count_frequencies(args.profile_batches) if args.profile_batches > 0 else None
        )
        cache = jaxcache.EmbeddingCache(config, frequencies=frequencies, seed=args.seed)
    embed = jaxcache.nnx.CachedEmbed(cache, combiner="sum" if args.multi_hot else None)
    model = jaxcache.models.DLRM(
        embed,
        num_sparse=data.num_features,
        features=args.features,
        bottom=args.bottom,
        top=args.top,
        rngs=nnx.Rngs(args.seed),
    )
    tx = jaxcache.models.dense_optimizer(args.optimizer, dense_lr)
    _, train_step = jaxcache.models.make_train_step(model, tx, host_callback=args.host_callback)
    predict_step = jaxcache.models.make_predict_step(model)
    return data, cache, embed, train_step, predict_step


def train(args, data, cache, embed, train_step) -> dict:
    """Runs the training loop through the prefetch pipeline; returns losses and timings."""
    losses = []
    start = time.perf_counter()
    warm_start = start
    compilations_warm = jaxcache.compilations()
    batches = (data.batch(step) for step in range(args.steps))
    pipeline = jaxcache.prefetch(
        batches, {"sparse": embed}, lookahead=args.lookahead, callback=args.host_callback
    )
    progress = tqdm(
        pipeline,
        total=args.steps,
        desc="train",
        unit="step",
        disable=True if args.no_progress else None,
    )
    # Leaving the block stops the producer thread, even on an error.
    with pipeline:
        for step, batch in enumerate(progress):
            # batch["sparse"] is a ready Lookup, or the ids with --host-callback.
            losses.append(train_step(batch["dense"], batch["sparse"], batch["label"]))
            if step == 0:
                # The first step compiles; throughput is measured after it.
                losses[0].block_until_ready()
                warm_start = time.perf_counter()
                compilations_warm = jaxcache.compilations()
            if step % 50 == 49 or step == args.steps - 1:
                progress.set_postfix(
                    loss=f"{float(losses[-1]):.4f}", hit_rate=f"{cache.stats.total.hit_rate:.3f}"
                )
    losses = np.array([float(x) for x in losses])
    end = time.perf_counter()
    return {
        "losses": losses,
        "seconds": end - start,
        "steps_per_s": (args.steps - 1) / (end - warm_start) if args.steps > 1 else 0.0,
        "compilations_after_first_step": jaxcache.compilations() - compilations_warm,
    }


def evaluate(args, data, embed, predict_step) -> dict:
    """Held-out AUC and log loss."""
    labels, probabilities = [], []
    for batch in data.batches(args.eval_batches, held_out=True):
        lookup = embed.prepare(batch["sparse"], train=False)
        probabilities.append(np.asarray(predict_step(batch["dense"], lookup)))
        labels.append(batch["label"])
    y = np.concatenate(labels)
    p = np.clip(np.concatenate(probabilities).astype(np.float64), 1e-7, 1 - 1e-7)
    return {
        "auc": jaxcache.roc_auc(y, p),
        "eval_loss": float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p))),
        "eval_samples": int(y.size),
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    compilations_start = jaxcache.compilations()
    wall_start = time.perf_counter()
    data, cache, embed, train_step, predict_step = build(args)
    try:
        run = train(args, data, cache, embed, train_step)
    except jaxcache.CapacityError as error:
        sys.exit(f"error: {error} (--cache-fraction sets the capacity.)")
    stats = cache.stats
    train_totals = dict(vars(stats.total))
    # Mean ms per occurrence of each phase of the cache's work during training.
    # With a look-ahead, plan/write_back/gather/transfer run on the producer
    # thread and only "wait" (the loop waiting for a staged batch) and "swap"
    # are spent in the training loop.
    phase_mean_ms = stats.timers.mean_ms()
    train_bytes = {"bytes_to_device": stats.bytes_to_device, "bytes_to_host": stats.bytes_to_host}
    metrics = evaluate(args, data, embed, predict_step)
    tail = max(1, args.steps // 10)
    result = {
        "loss": float(run["losses"][-tail:].mean()),
        "last_loss": float(run["losses"][-1]),
        **metrics,
        "hit_rate": train_totals["hits"] / max(1, train_totals["distinct"]),
        "access_hit_rate": train_totals["access_hits"] / max(1, train_totals["lookups"]),
        "rows_fetched": train_totals["rows_to_device"],
        "rows_written_back": train_totals["rows_to_host"],
        **train_bytes,
        "steps_per_s": run["steps_per_s"],
        "samples_per_s": run["steps_per_s"] * args.batch_size,
        "phase_mean_ms": phase_mean_ms,
        "write_back_waits": stats.write_back_waits,
        "train_seconds": run["seconds"],
        "wall_seconds": time.perf_counter() - wall_start,
        "cache_rows": cache.config.capacity,
        "table_rows": cache.config.num_embeddings,
        "cache_fraction": cache.config.capacity / cache.config.num_embeddings,
        "lookups": train_totals["lookups"],
        "distinct_per_step": train_totals["distinct"] / args.steps,
        "compilations": jaxcache.compilations() - compilations_start,
        "compilations_after_first_step": run["compilations_after_first_step"],
        "full_table": args.full_table,
        "lookahead": args.lookahead,
        "host_callback": args.host_callback,
        "policy": "full-table" if args.full_table else args.policy,
        "optimizer": args.optimizer,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seed": args.seed,
    }
    print_summary(result)
    print(json.dumps(result))
    return result


def print_summary(r: dict) -> None:
    where = "whole table on device" if r["full_table"] else f"{r['policy']} cache"
    print(
        f"DLRM, {where}: {r['cache_rows']:,} of {r['table_rows']:,} rows on device "
        f"({100 * r['cache_fraction']:.2f}%)"
    )
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


if __name__ == "__main__":
    main()
