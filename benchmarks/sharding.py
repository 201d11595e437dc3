"""Sharded cache on simulated CPU devices: routed lookups vs XLA's partitioner.

Measures, in one run on the same rows and ids:

1. A lookup plus a sparse SGD update of the looked-up rows, on a cache whose
   rows are split over 8 devices: jaxcache's routed path (``all_to_all``
   inside ``shard_map``, distinct rows only) against a plain ``jnp.take`` and
   ``.at[].add`` that XLA partitions automatically.
2. Training steps per second of a small model through the cache on 1, 2, 4 and
   8 devices (one mesh axis: rows and batch split over it).

Run: ``python benchmarks/sharding.py [--quick]``. The devices are simulated on
the host's cores, so the absolute times say little about accelerators; the
ratio says what the routing saves in work and traffic.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import _harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcache


def _zipf_ids(rng, n, shape, alpha=1.1):
    u = rng.random(shape)
    ranks = np.floor(((n ** (1 - alpha) - 1) * u + 1) ** (1 / (1 - alpha))).astype(np.int64) - 1
    return (ranks * 2654435761) % n


def lookup_comparison(args) -> float:
    devices = 8
    mesh = Mesh(np.array(jax.devices()[:devices]), ("rows",))
    n, d = args.rows, args.features
    rng = np.random.default_rng(0)
    ids = _zipf_ids(rng, n, (args.batch, args.bag))
    cfg = jaxcache.CacheConfig(n, d, n, policy="lru", optimizer=jaxcache.sgd(0.1))
    cache = jaxcache.EmbeddingCache.full_table(cfg, mesh=mesh)
    state = cache.init_state()
    state, lookup = cache.prepare(state, ids)
    weights = jnp.asarray(rng.normal(size=(args.batch, args.bag, d)), jnp.float32)

    @jax.jit
    def routed(state, lookup):
        def loss(delta):
            return jnp.sum(
                jaxcache.device.lookup_rows(state.rows, lookup.with_delta(delta)) * weights
            )

        delta = jnp.zeros((devices, lookup.received, d), jnp.float32)
        grads = jax.grad(loss)(delta)
        return jaxcache.device.apply_sparse(state, lookup, grads, cfg.optimizer)

    rows = jax.device_put(np.asarray(state.rows), NamedSharding(mesh, P("rows")))
    slots = jax.device_put(ids.astype(np.int32), NamedSharding(mesh, P("rows")))

    @jax.jit
    def automatic(rows, slots):
        def loss(rows):
            return jnp.sum(jnp.take(rows, slots, axis=0) * weights)

        # The gradient of a gather is a scatter-add: XLA partitions both.
        return rows - 0.1 * jax.grad(loss)(rows)

    @jax.jit
    def routed_forward(state, lookup):
        return jnp.sum(jaxcache.device.lookup_rows(state.rows, lookup) * weights)

    @jax.jit
    def automatic_forward(rows, slots):
        return jnp.sum(jnp.take(rows, slots, axis=0) * weights)

    # Both are exact and agree.
    a = np.asarray(routed(state, lookup).rows)
    b = np.asarray(automatic(rows, slots))
    agree = float(np.abs(a - b).max())

    def median_ms(fn) -> float:  # the first call compiles
        return 1e3 * _harness.median_time(fn, args.repeats, warmup=1)

    t_routed = median_ms(lambda: jax.block_until_ready(routed(state, lookup)))
    t_auto = median_ms(lambda: jax.block_until_ready(automatic(rows, slots)))
    f_routed = median_ms(lambda: jax.block_until_ready(routed_forward(state, lookup)))
    f_auto = median_ms(lambda: jax.block_until_ready(automatic_forward(rows, slots)))
    distinct = len(np.unique(ids))
    print(
        f"\nlookup + sparse SGD update, 8 devices, {n:,} rows x {d}, ids {args.batch}x{args.bag} "
        f"({distinct:,} distinct), max |difference| {agree:.1e}"
    )
    print(f"{'path':<34}{'lookup ms':>10}{'+ update ms':>13}")
    print(f"{'routed (shard_map + all_to_all)':<34}{f_routed:>10.2f}{t_routed:>13.2f}")
    print(f"{'automatic partitioning (jnp.take)':<34}{f_auto:>10.2f}{t_auto:>13.2f}")
    ratio = t_auto / t_routed
    _harness.print_results(
        {"lookup_only_speedup": f_auto / f_routed, "routed_over_automatic_speedup": ratio},
        digits=2,
    )
    return ratio


class _Tower(nnx.Module):
    def __init__(self, embed, features, num_sparse):
        rngs = nnx.Rngs(0)
        self.embed = embed
        self.hidden = nnx.Linear(num_sparse * features, 32, rngs=rngs)
        self.out = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, lookup):
        x = self.embed(lookup)
        return self.out(nnx.relu(self.hidden(x.reshape(x.shape[0], -1))))[:, 0]


def throughput(args) -> None:
    print(f"\ntraining through a {args.cache_fraction:.0%} cache, lookahead 2")
    print(f"{'devices':>8}{'steps/s':>10}{'ms/step':>10}{'hit rate':>10}")
    rng = np.random.default_rng(1)
    batches = [
        {"ids": _zipf_ids(rng, args.rows, (args.batch, args.bag)), "y": rng.random(args.batch)}
        for _ in range(args.steps)
    ]
    for devices in (1, 2, 4, 8):
        mesh = Mesh(np.array(jax.devices()[:devices]), ("rows",))
        cfg = jaxcache.CacheConfig(
            args.rows, args.features, args.cache_fraction, optimizer=jaxcache.adagrad(0.1)
        )
        cache = jaxcache.EmbeddingCache(cfg, mesh=mesh)
        model = _Tower(jaxcache.nnx.CachedEmbed(cache), args.features, args.bag)
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

        @nnx.jit(donate_argnums=(0, 1))
        def step(model, optimizer, lookup, labels):
            def loss_fn(model, lookup):
                return optax.sigmoid_binary_cross_entropy(model(lookup), labels).mean()

            loss, grads = jaxcache.nnx.value_and_grad(loss_fn)(model, lookup)
            optimizer.update(model, grads)
            return loss

        times = []
        with jaxcache.prefetch(batches, {"ids": model.embed}, lookahead=2) as pipeline:
            for b in pipeline:
                start = time.perf_counter()
                step(model, optimizer, b["ids"], b["y"]).block_until_ready()
                times.append(time.perf_counter() - start)
        ms = 1e3 * statistics.median(times[args.steps // 4 :])
        print(f"{devices:>8}{1e3 / ms:>10.1f}{ms:>10.2f}{cache.stats.total.hit_rate:>10.3f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1 << 19)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--bag", type=int, default=26)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--cache-fraction", type=float, default=0.05)
    parser.add_argument("--quick", action="store_true", help="small sizes, a few repeats")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.batch, args.repeats, args.steps = 1 << 16, 512, 5, 12
        args.cache_fraction = 0.25
    print(f"jax {jax.__version__}, {jax.device_count()} simulated devices, {os.cpu_count()} cores")
    lookup_comparison(args)
    throughput(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
