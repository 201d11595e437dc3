"""One process of a two-process run on localhost, for ``test_multiprocess.py``.

    python tests/multiprocess_run.py COORDINATOR PROCESS_ID CHECKPOINT_DIR

Trains a cached table with the devices of both processes, saves, trains on,
restores the earlier step in place and trains the same batches again; then
stages a batch too large for one process's devices, and batches that differ
between the processes; leaves a pipeline early while one process's source
is slower; and serves scores split over both processes' devices. Prints one
JSON line of what it saw.
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import numpy as np


def main(coordinator: str, process: int, directory: str) -> dict:
    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=2, process_id=process)
    from flax import nnx
    from jax.sharding import Mesh

    import jaxcache

    mesh = Mesh(np.array(jax.devices()), ("rows",))
    cfg = jaxcache.CacheConfig(64, 4, capacity=16, policy="lru", optimizer=jaxcache.adagrad(0.1))
    table = jaxcache.HostTable(cfg, seed=0, shard=jaxcache.host.process_shard(mesh))
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg, table=table, mesh=mesh))

    @nnx.jit
    def step(embed, lookup):
        def loss_fn(embed, lookup):
            return (embed(lookup) ** 2).sum()

        loss, _ = jaxcache.nnx.value_and_grad(loss_fn)(embed, lookup)
        return loss

    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 64, size=(8,)) for _ in range(6)]

    def train(batches):
        return [float(step(embed, embed.prepare(ids))) for ids in batches]

    def counters():
        stats = embed.cache.stats
        return [stats.steps, stats.total.lookups, stats.total.misses]

    def refusal(ids) -> str:
        try:
            embed.prepare(ids)
        except Exception as error:  # the test reads what it was
            return f"{type(error).__name__}: {error}"
        return "accepted"

    seen = {"first": train(batches[:2])}
    checkpointer = jaxcache.Checkpointer(os.path.join(directory, "checkpoints"))
    checkpointer.save(2, caches=[embed])
    seen["stats_saved"] = counters()
    seen["ahead"] = train(batches[2:6])
    ahead = np.asarray(embed.export()[0])
    # Back to step 2 in place: the processes plan indices 2.. again.
    checkpointer.restore(2, caches=[embed])
    seen["stats_restored"] = counters()  # each process's own share, as saved
    seen["again"] = train(batches[2:6])
    seen["same_table"] = bool((np.asarray(embed.export()[0]) == ahead).all())
    # Five distinct ids homed on device 2 (process 1's), which holds 4 rows:
    # refused there, and so in both processes, at once.
    seen["too_large"] = refusal(np.array([2, 6, 10, 14, 18, 3, 7, 11]))
    seen["different"] = refusal(batches[0] + process)
    # An id outside the table in process 1's batch only: each process
    # raises at once, and the processes stay in step.
    seen["bad_on_one"] = refusal(batches[0] if process == 0 else np.full(8, 64))
    seen["after"] = train(batches[:1])  # nothing changed: training goes on
    seen["pipelined"] = pipelined(jaxcache, mesh)
    cfg = jaxcache.CacheConfig(2000, 4, capacity=96, policy="lru", optimizer=jaxcache.sgd(0.1))
    table = jaxcache.HostTable(cfg, shard=jaxcache.host.process_shard(mesh))
    cache = jaxcache.EmbeddingCache(cfg, table=table, mesh=mesh)
    seen["broken_off"] = broken_off(jaxcache, cache, slow=process == 1)
    seen["served"] = served(jaxcache, mesh)
    return seen


def broken_off(jaxcache, cache, *, slow: bool = False) -> list[int]:
    """A loop that leaves its pipeline after two steps (the source of one
    process slower: that process's thread has staged fewer batches ahead),
    then trains on in a second pipeline: the plans made by the break, and
    this process's hits, misses and evictions at the end."""
    embed = jaxcache.nnx.CachedEmbed(cache)
    rng = np.random.default_rng(1)
    batches = [{"ids": rng.zipf(1.3, size=(32, 2)) % 2000} for _ in range(12)]

    def source():
        for batch in batches:
            if slow:
                time.sleep(0.3)
            yield batch

    with jaxcache.prefetch(source(), {"ids": embed}, lookahead=2) as pipeline:
        for step, _ in enumerate(pipeline):
            if step == 1:
                break
    planned = cache.planner.next_index
    with jaxcache.prefetch(batches[6:], {"ids": embed}, lookahead=2) as pipeline:
        for _ in pipeline:
            pass
    total = cache.stats.total
    return [planned, total.hits, total.misses, total.evictions]


def served(jaxcache, mesh) -> float:
    """The largest error of scores a ``Server`` returns when ``predict``
    leaves them split over both processes' devices."""
    full = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)
    cfg = jaxcache.serving_config(jaxcache.CacheConfig(64, 4, capacity=48))
    table = jaxcache.HostTable(cfg, rows=full, shard=jaxcache.host.process_shard(mesh))
    embed = jaxcache.nnx.CachedEmbed(
        jaxcache.EmbeddingCache(cfg, table=table, mesh=mesh), combiner="sum"
    )
    server = jaxcache.Server(embed, lambda b: embed(b["ids"]).sum(-1), {"ids": embed})
    rng = np.random.default_rng(2)
    requests = [{"ids": rng.integers(0, 64, size=(8, 2))} for _ in range(4)]
    scores = list(server.score(requests))
    return max(
        float(np.abs(got - full[r["ids"]].sum((1, 2))).max())
        for got, r in zip(scores, requests, strict=True)
    )


def pipelined(jaxcache, mesh) -> list[int]:
    """Hits, misses and evictions of this process's devices over a pipeline
    whose batches wait for room (``pipelined_counts``)."""
    cfg = jaxcache.CacheConfig(2000, 4, capacity=96, policy="lfu", optimizer=jaxcache.sgd(0.1))
    shard = jaxcache.host.process_shard(mesh)
    cache = jaxcache.EmbeddingCache(cfg, table=jaxcache.HostTable(cfg, shard=shard), mesh=mesh)
    return pipelined_counts(jaxcache, cache)


def pipelined_counts(jaxcache, cache) -> list[int]:
    """Thirty skewed batches through a look-ahead of 2 in a cache of 96 rows."""
    embed = jaxcache.nnx.CachedEmbed(cache)
    rng = np.random.default_rng(0)
    batches = [{"ids": rng.zipf(1.3, size=(32, 2)) % 2000} for _ in range(30)]
    with jaxcache.prefetch(batches, {"ids": embed}, lookahead=2) as pipeline:
        for _ in pipeline:
            pass
    total = cache.stats.total
    return [total.hits, total.misses, total.evictions]


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), sys.argv[3])))
