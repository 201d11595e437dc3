"""Matrix factorization on MovieLens with cached user and item tables, checked against full tables.

Builds the MovieLens dataset (TFDS, ArrayRecord, no TensorFlow) from the
GroupLens archive in ``--manual-dir``, then trains the same Flax NNX model
twice through ``jaxcache.prefetch``: once with only ``--cache-fraction`` of
the user and item rows on the device (two ``jaxcache.nnx.CachedEmbed``), once
with the whole tables on the device (``EmbeddingCache.full_table``). Training
through the cache is exact, so both runs end with the same test RMSE.

    python examples/movielens.py --manual-dir DIR   # DIR holds ml-100k.zip
    python examples/movielens.py --manual-dir DIR --config 1m --epochs 5
    python examples/movielens.py --manual-dir DIR --split random

``--split time`` (the default) tests on each user's latest 10% of ratings,
``--split random`` on a seeded random 10% of all ratings (the builder configs
``"100k"`` and ``"100k_random"``, built into separate folders).

No archive at hand? ``jaxcache.datasets.movielens_from_recbole`` writes
``ml-100k.zip`` from the RecBole wheel (``pip download --no-deps
recbole==1.2.1``).

Prints a summary, then as its last line one JSON object with the results
(``rmse_cached``, ``rmse_full``, ``user_hit_rate``, ``item_hit_rate``, ...).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxcache
import jaxcache.datasets as jd


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--manual-dir", required=True, help="directory holding ml-100k.zip (or ml-1m.zip)"
    )
    parser.add_argument(
        "--data-dir", default=None, help="where the built dataset goes (TFDS's default if unset)"
    )
    parser.add_argument("--config", default="100k", choices=("100k", "1m"), help="MovieLens size")
    parser.add_argument(
        "--split",
        default="time",
        choices=("time", "random"),
        help="test split: each user's latest 10%% of ratings, or a random 10%% of all ratings",
    )
    parser.add_argument("--epochs", type=int, default=6, help="passes over the training split")
    parser.add_argument(
        "--steps", type=int, default=None, help="stop after this many steps (default: no limit)"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="ratings per step")
    parser.add_argument("--seed", type=int, default=0, help="shuffling, table and model seed")
    parser.add_argument(
        "--cache-fraction",
        type=float,
        default=0.1,
        help="rows on device / table rows, per table (raised to (lookahead + 1) batches)",
    )
    parser.add_argument("--features", type=int, default=32, help="factors per row (plus a bias)")
    parser.add_argument("--learning-rate", type=float, default=0.005, help="Adam learning rate")
    parser.add_argument(
        "--weight-decay", type=float, default=0.05, help="L2 penalty on the rows of a batch"
    )
    parser.add_argument("--lookahead", type=int, default=2, help="batches prepared ahead (>= 0)")
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "features"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1.")
    if args.lookahead < 0:
        parser.error("--lookahead must be at least 0.")
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be at least 1.")
    if not 0 < args.cache_fraction <= 1:
        parser.error(f"--cache-fraction={args.cache_fraction} must be in (0, 1], e.g. 0.1.")
    if not 0 < args.learning_rate < math.inf:
        parser.error(f"--learning-rate={args.learning_rate} must be a finite rate > 0, e.g. 0.005.")
    if not 0 <= args.weight_decay < math.inf:
        parser.error(f"--weight-decay={args.weight_decay} must be finite and >= 0, e.g. 0.05.")
    return args


class MatrixFactorization(nnx.Module):
    """Biased matrix factorization, the user and item rows each from a ``CachedEmbed``.

    A row is ``[bias, factors...]``: ``rating ~ mean + b + b_u + b_i + <p_u, q_i>``.
    """

    def __init__(self, users: jaxcache.nnx.CachedEmbed, items: jaxcache.nnx.CachedEmbed, mean):
        self.users = users
        self.items = items
        self.mean = mean
        self.bias = nnx.Param(jnp.zeros((), jnp.float32))

    def rows(self, user: jaxcache.Lookup, item: jaxcache.Lookup) -> tuple[jax.Array, jax.Array]:
        """The rows ``[B, D]`` of the batch's users and items."""
        return self.users(user), self.items(item)

    def __call__(self, user: jaxcache.Lookup, item: jaxcache.Lookup) -> jax.Array:
        u, i = self.rows(user, item)
        return self.mean + self.bias[...] + u[:, 0] + i[:, 0] + (u[:, 1:] * i[:, 1:]).sum(-1)


def _train_step(model, optimizer, user, item, rating, weight_decay):
    def loss_fn(model, user, item):
        u, i = model.rows(user, item)
        # L2 on the rows the batch uses: a sparse gradient, like the rows' updates.
        penalty = weight_decay * ((u**2).sum(-1) + (i**2).sum(-1)).mean()
        return ((model(user, item) - rating) ** 2).mean() + penalty

    loss, grads = jaxcache.nnx.value_and_grad(loss_fn)(model, user, item)
    optimizer.update(model, grads)
    return loss


def _predict(model, user, item):
    return jnp.clip(model(user, item), 1.0, 5.0)


# Model and optimizer are donated: the cache rows are updated in place.
_jit_train_step = nnx.jit(_train_step, donate_argnums=(0, 1))
_jit_predict = nnx.jit(_predict)


def build_model(args, num_rows: dict[str, int], mean: float, *, full: bool):
    """The model with a cached (or whole, ``full``) table per id field."""
    embeds = {}
    for name, rows in num_rows.items():
        # The rows of every batch in flight must fit: the one training, the
        # staged ones and the one being staged, at most (lookahead + 1)
        # batches of distinct ids. A smaller cache would make the pipeline
        # wait for the device and lose its overlap.
        in_flight = (args.lookahead + 1) * args.batch_size
        capacity = min(rows, max(math.ceil(args.cache_fraction * rows), in_flight))
        config = jaxcache.CacheConfig(
            num_embeddings=rows,
            features=1 + args.features,
            capacity=capacity,
            policy="lfu",
            optimizer=jaxcache.adam(args.learning_rate),
            name=name,
        )
        table = jaxcache.HostTable(config, init=jaxcache.host.normal_init(0.05), seed=args.seed)
        cache = (
            jaxcache.EmbeddingCache.full_table(config, table=table)
            if full
            else jaxcache.EmbeddingCache(config, table=table)
        )
        embeds[name] = jaxcache.nnx.CachedEmbed(cache)
    model = MatrixFactorization(embeds["user"], embeds["item"], mean)
    optimizer = nnx.Optimizer(model, optax.adam(args.learning_rate), wrt=nnx.Param)
    return model, optimizer


def run(args, builder, *, full: bool) -> dict:
    """Trains one model and evaluates it on the test split."""
    metadata = builder.info.metadata
    num_rows = {"user": metadata["num_users"], "item": metadata["num_items"]}
    train = builder.as_data_source("train")
    mean = float(np.mean([train[i]["rating"].mean() for i in range(len(train))]))
    model, optimizer = build_model(args, num_rows, mean, full=full)
    step = nnx.cached_partial(_jit_train_step, model, optimizer)
    loader = jd.Loader(
        train,
        args.batch_size,
        shuffle=True,
        seed=args.seed,
        num_epochs=args.epochs,
        keys=("user", "item", "rating"),
    )
    tables = {"user": model.users, "item": model.items}
    losses = []
    start = time.perf_counter()
    with jaxcache.prefetch(
        itertools.islice(loader, args.steps), tables, lookahead=args.lookahead
    ) as batches:
        for batch in batches:
            losses.append(step(batch["user"], batch["item"], batch["rating"], args.weight_decay))
    losses = np.array([float(x) for x in losses])
    seconds = time.perf_counter() - start
    hit_rates = {
        f"{name}_hit_rate": embed.cache.stats.total.hits / max(1, embed.cache.stats.total.distinct)
        for name, embed in tables.items()
    }
    # A test batch may not hold more distinct ids than a cache has rows.
    test = jd.Loader(
        builder.as_data_source("test"),
        min(embed.cache.config.capacity for embed in tables.values()),
        drop_remainder=False,
        keys=("user", "item", "rating"),
    )
    predict = nnx.cached_partial(_jit_predict, model)
    squared, count = 0.0, 0
    for batch in test:
        user = model.users.prepare(batch["user"], train=False)
        item = model.items.prepare(batch["item"], train=False)
        error = np.asarray(predict(user, item), np.float64) - batch["rating"]
        squared += float((error**2).sum())
        count += error.size
    for embed in tables.values():
        embed.flush()
    return {
        "rmse": math.sqrt(squared / count),
        "loss": float(losses[-max(1, len(losses) // 10) :].mean()),
        "steps": len(losses),
        "seconds": seconds,
        "tables": {name: embed.export()[0] for name, embed in tables.items()},
        "capacity": {name: embed.cache.config.capacity for name, embed in tables.items()},
        **hit_rates,
    }


def builder_config(args) -> str:
    """The ``MovieLensBuilder`` config of ``--config`` and ``--split``."""
    return args.config if args.split == "time" else f"{args.config}_random"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    wall = time.perf_counter()
    try:
        builder = jd.prepare(
            jd.MovieLensBuilder(config=builder_config(args), data_dir=args.data_dir),
            args.manual_dir,
        )
    except (FileNotFoundError, jd.DataFormatError) as error:
        sys.exit(f"error: {error}")
    metadata = builder.info.metadata
    if metadata["rows"]["train"] < args.batch_size:
        # The loader drops a short last batch, so an epoch would have none.
        sys.exit(
            f"error: --batch-size={args.batch_size} is more than the "
            f"{metadata['rows']['train']} training ratings of MovieLens {args.config}; "
            "lower --batch-size."
        )
    cached = run(args, builder, full=False)
    full = run(args, builder, full=True)
    table_diff = max(
        float(np.abs(cached["tables"][name] - full["tables"][name]).max())
        for name in cached["tables"]
    )
    result = {
        "rmse_cached": cached["rmse"],
        "rmse_full": full["rmse"],
        "rmse_difference": abs(cached["rmse"] - full["rmse"]),
        "max_table_difference": table_diff,
        "user_hit_rate": cached["user_hit_rate"],
        "item_hit_rate": cached["item_hit_rate"],
        "user_cache_rows": cached["capacity"]["user"],
        "item_cache_rows": cached["capacity"]["item"],
        "num_users": metadata["num_users"],
        "num_items": metadata["num_items"],
        "train_ratings": metadata["rows"]["train"],
        "test_ratings": metadata["rows"]["test"],
        "loss_cached": cached["loss"],
        "loss_full": full["loss"],
        "steps": cached["steps"],
        "steps_per_s_cached": cached["steps"] / cached["seconds"],
        "steps_per_s_full": full["steps"] / full["seconds"],
        "batch_size": args.batch_size,
        "epochs": args.epochs,
        "seed": args.seed,
        "config": args.config,
        "split": args.split,
        "wall_seconds": time.perf_counter() - wall,
    }
    print(
        f"MovieLens {args.config} ({args.split} split): {result['num_users']} users, "
        f"{result['num_items']} items, {result['train_ratings']} training and "
        f"{result['test_ratings']} test ratings"
    )
    print(
        f"  cached: {result['user_cache_rows']} user rows and {result['item_cache_rows']} item "
        f"rows on device, hit rates {result['user_hit_rate']:.3f} (users) "
        f"{result['item_hit_rate']:.3f} (items)"
    )
    print(
        f"  test RMSE {result['rmse_cached']:.5f} cached, {result['rmse_full']:.5f} whole "
        f"tables ({result['steps']} steps); tables differ by at most "
        f"{result['max_table_difference']:.2e}"
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
