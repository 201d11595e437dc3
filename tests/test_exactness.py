"""Training through the cache equals training with the whole table on device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxcache
from tests.models import dense_params, make_cached, make_reference, zipf_batches

# Every test here runs with both planners (``conftest.planner``).
pytestmark = pytest.mark.usefixtures("planner")

N, D, B, F = 4000, 8, 32, 4
OPTIMIZERS = {
    "sgd": jaxcache.sgd(0.2),
    "adagrad": jaxcache.adagrad(0.2),
    "rowwise_adagrad": jaxcache.rowwise_adagrad(0.2),
    "adam": jaxcache.adam(0.02),
}


def _max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def run_both(opt, policy, capacity, steps=12, seed=0, directory=None):
    batches = list(zipf_batches(N, B, F, steps, seed=seed))
    cfg = jaxcache.CacheConfig(N, D, capacity=capacity, policy=policy, optimizer=opt)
    freq = jaxcache.FrequencyCounter(N).update_all(ids for ids, _ in batches).counts
    table = jaxcache.HostTable(cfg, seed=seed + 1, directory=directory)
    reference, ref_train = make_reference(np.array(table.rows), opt, F)
    cache = jaxcache.EmbeddingCache(cfg, table=table, frequencies=freq)
    cached, cached_train = make_cached(cache, F)
    losses = [(float(cached_train(ids, y)), float(ref_train(ids, y))) for ids, y in batches]
    return cache, cached, reference, losses


def assert_same_training(cached, reference, losses):
    rows, state = cached.embed.export()
    assert _max_diff(rows, reference.embed.table[...]) <= 1e-6
    ref_state = reference.embed.opt_state.get_value()
    assert sorted(state) == sorted(ref_state)
    for name in state:
        assert _max_diff(state[name], ref_state[name]) <= 1e-6, name
    for a, b in zip(dense_params(cached), dense_params(reference), strict=True):
        assert _max_diff(a, b) <= 1e-6
    for a, b in losses:
        assert abs(a - b) <= 1e-6


@pytest.mark.parametrize("policy", jaxcache.planning.POLICIES)
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_heavy_churn_matches_full_table(opt_name, policy):
    # Capacity barely above one batch's distinct ids (B * F = 128): rows are
    # evicted and fetched again almost every step.
    cache, cached, reference, losses = run_both(OPTIMIZERS[opt_name], policy, capacity=130)
    assert cache.stats.total.evictions > 3 * cache.config.capacity
    assert cache.stats.total.rows_to_host > 0
    assert_same_training(cached, reference, losses)


@pytest.mark.parametrize("opt_name", ["adagrad", "adam"])
def test_a_learning_rate_schedule_under_churn_matches_full_table(opt_name):
    # Warm-up from 0 then decay, read from the dense optimizer's step inside
    # the jitted step; the rows it trains are evicted and fetched again.
    schedule = optax.join_schedules(
        [optax.linear_schedule(0.0, 1.0, 4), optax.exponential_decay(1.0, 1, 0.7)], [4]
    )
    opt = OPTIMIZERS[opt_name]
    batches = list(zipf_batches(N, B, F, 12, seed=3))
    cfg = jaxcache.CacheConfig(N, D, capacity=130, optimizer=opt)
    table = jaxcache.HostTable(cfg, seed=4)
    reference, ref_train = make_reference(np.array(table.rows), opt, F, schedule=schedule)
    cache = jaxcache.EmbeddingCache(cfg, table=table)
    cached, train = make_cached(cache, F, schedule=schedule)
    batch_items = [{"ids": ids, "y": y} for ids, y in batches]
    losses = []
    with jaxcache.prefetch(batch_items, {"ids": cached.embed}, lookahead=2) as pipeline:
        for item, (ids, y) in zip(pipeline, batches, strict=True):
            losses.append((float(train.with_lookup(item["ids"], y)), float(ref_train(ids, y))))
    assert cache.stats.total.evictions > 3 * cfg.capacity
    assert_same_training(cached, reference, losses)
    # The first step's factor is 0: the rows it alone touched kept their values.
    first_only = np.setdiff1d(batches[0][0], np.concatenate([ids for ids, _ in batches[1:]]))
    assert first_only.size > 0
    rows, _ = cached.embed.export()
    np.testing.assert_array_equal(
        rows[first_only], jaxcache.HostTable(cfg, seed=4).rows[first_only]
    )


def test_memory_mapped_table_under_churn_matches_full_table(tmp_path):
    # Rows and state live in files; every write-back lands in their pages.
    cache, cached, reference, losses = run_both(
        OPTIMIZERS["adam"], "lru", capacity=130, directory=tmp_path
    )
    assert isinstance(cache.table.rows, np.memmap)
    assert cache.stats.total.rows_to_host > 3 * cache.config.capacity
    assert_same_training(cached, reference, losses)
    cache.flush(cached.embed.get_state())
    on_disk = np.load(tmp_path / "rows.npy")
    np.testing.assert_array_equal(on_disk, cached.embed.export()[0])


def test_bfloat16_rows_under_churn_equal_the_full_table():
    # bfloat16 rows (2-byte words through every host copy): the cache under
    # heavy churn and the whole table on device end bit for bit the same.
    def train(capacity):
        cfg = jaxcache.CacheConfig(
            N,
            D,
            capacity=capacity,
            policy="lru",
            optimizer=OPTIMIZERS["adagrad"],
            dtype="bfloat16",
        )
        table = jaxcache.HostTable(cfg, seed=1)
        cache = (
            jaxcache.EmbeddingCache(cfg, table=table)
            if capacity < N
            else jaxcache.EmbeddingCache.full_table(cfg, table=table)
        )
        cached, step = make_cached(cache, F)
        losses = [float(step(ids, y)) for ids, y in zipf_batches(N, B, F, 12, seed=0)]
        return cache, cached.embed.export(), losses

    cache, (rows, state), losses = train(130)
    _, (full_rows, full_state), full_losses = train(N)
    assert cache.stats.total.rows_to_host > 3 * cache.config.capacity
    assert rows.dtype == cache.config.row_dtype
    assert rows.tobytes() == full_rows.tobytes()
    assert state["accumulator"].tobytes() == full_state["accumulator"].tobytes()
    assert losses == full_losses


@pytest.mark.parametrize("padding_id", [-1, None])
def test_bfloat16_bags_pool_in_float32(padding_id):
    # Summed in bfloat16, a bag of 1,000 copies of a row had a mean of up to
    # 1.7x the row, and a weight of 1.003 counted as 1.
    cfg = jaxcache.CacheConfig(64, 4, capacity=16, padding_id=padding_id, dtype="bfloat16")
    row = np.asarray(jaxcache.HostTable(cfg, seed=0).rows[3], np.float32)
    embed = jaxcache.nnx.CachedEmbed(
        jaxcache.EmbeddingCache(cfg, table=jaxcache.HostTable(cfg, seed=0)), combiner="mean"
    )
    ids = np.full((2, 1000), 3)
    if padding_id is not None:
        ids[1, 500:] = padding_id
    pooled = np.asarray(embed(embed.prepare(ids, train=False)), np.float32)
    np.testing.assert_array_equal(pooled, np.stack([row, row]))
    weights = np.full((2, 1000), 1.003, np.float32)
    embed_sum = jaxcache.nnx.CachedEmbed(
        jaxcache.EmbeddingCache(cfg, table=jaxcache.HostTable(cfg, seed=0)), combiner="sum"
    )
    total = np.asarray(embed_sum(embed_sum.prepare(ids, train=False), weights), np.float32)
    real = (ids != padding_id).sum(1, keepdims=True)
    np.testing.assert_allclose(total, 1.003 * real * row, rtol=1e-2)
    assert not np.allclose(total, real * row, rtol=1e-3)  # the weights' digits count


@pytest.mark.parametrize(("combiner", "padding_id"), [(None, None), ("sum", -1)])
def test_bfloat16_gradients_of_a_repeated_id_add_up_in_float32(combiner, padding_id):
    # 1,024 lookups of one row, each with gradient 1: summed in bfloat16 the
    # total stopped at 256; the row takes one step of lr x 1024 = 1.
    cfg = jaxcache.CacheConfig(
        64, 4, 16, padding_id=padding_id, dtype="bfloat16", optimizer=jaxcache.sgd(1 / 1024)
    )
    embed = jaxcache.nnx.CachedEmbed(
        jaxcache.EmbeddingCache(cfg, table=jaxcache.HostTable(cfg, rows=np.zeros((64, 4)))),
        combiner=combiner,
    )

    def loss(embed, lookup):
        return embed(lookup).astype(jnp.float32).sum()

    nnx.jit(jaxcache.nnx.value_and_grad(loss))(embed, embed.prepare(np.full((4, 256), 3)))
    np.testing.assert_array_equal(np.asarray(embed.export()[0][3], np.float32), -np.ones(4))


@pytest.mark.parametrize("opt_name", ["adam", "rowwise_adagrad"])
def test_five_percent_cache_matches_full_table(opt_name):
    _, cached, reference, losses = run_both(OPTIMIZERS[opt_name], "lfu", capacity=0.05, steps=20)
    assert_same_training(cached, reference, losses)


def test_untouched_rows_and_state_do_not_change():
    opt = OPTIMIZERS["adam"]
    cache, cached, _, _ = run_both(opt, "lru", capacity=130, steps=5)
    rows, state = cached.embed.export()
    touched = np.zeros(N, bool)
    for ids, _ in zipf_batches(N, B, F, 5, seed=0):
        touched[ids.reshape(-1)] = True
    initial = jaxcache.HostTable(cache.config, seed=1)
    np.testing.assert_array_equal(rows[~touched], initial.rows[~touched])
    assert (state["count"][~touched] == 0).all()
    assert (state["count"][touched] >= 1).all()


def test_row_evicted_and_needed_again_keeps_its_updates():
    # Capacity 2: id 0 is trained, evicted by [1, 2], then needed again.
    cfg = jaxcache.CacheConfig(10, 4, 2, policy="lru", optimizer=jaxcache.adam(0.1))
    table = jaxcache.HostTable(cfg, seed=0)
    rows0 = np.array(table.rows)
    cache = jaxcache.EmbeddingCache(cfg, table=table)
    model, train = make_cached(cache, 1)
    reference, ref_train = make_reference(rows0, cfg.optimizer, 1)
    y = np.ones(2, np.float32)
    for ids in ([[0], [0]], [[1], [2]], [[0], [1]], [[2], [0]]):
        ids = np.array(ids)
        train(ids, y)
        ref_train(ids, y)
    assert cache.stats.total.evictions >= 3
    rows, state = model.embed.export()
    assert _max_diff(rows, reference.embed.table[...]) <= 1e-6
    assert state["count"][0] == 3


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_weighted_bags_with_padding_match_full_table(combiner):
    # [B, F, L] bags of varying length padded with -1, per-id weights.
    n, bag = 3000, 4
    rng = np.random.default_rng(5)
    cfg = jaxcache.CacheConfig(
        n, D, capacity=B * F * bag + 8, optimizer=OPTIMIZERS["adagrad"], padding_id=-1
    )
    table = jaxcache.HostTable(cfg, seed=2)
    reference, ref_train = make_reference(np.array(table.rows), cfg.optimizer, F, combiner=combiner)
    cached, cached_train = make_cached(
        jaxcache.EmbeddingCache(cfg, table=table), F, combiner=combiner
    )
    for ids, y in zipf_batches(n, B * bag, F, 10, seed=4):
        ids = ids.reshape(B, bag, F).transpose(0, 2, 1).copy()
        ids[rng.random(ids.shape) < 0.3] = -1
        ids[0, 0] = -1  # one empty bag
        weights = rng.uniform(0.5, 2.0, ids.shape).astype(np.float32)
        a = cached_train(ids, y[:B], weights)
        b = ref_train(ids, y[:B], weights)
        assert abs(float(a) - float(b)) <= 1e-6
    assert_same_training(cached, reference, [])


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_weight_at_padding_counts_for_nothing_whatever_its_value(bad):
    # Eager and jitted alike: a product with the padding mask would make
    # 0 * nan (or 0 * inf) a NaN in the bag's sum.
    cfg = jaxcache.CacheConfig(10, 2, capacity=4, padding_id=-1)
    rows = np.arange(20.0, dtype=np.float32).reshape(10, 2)
    cache = jaxcache.EmbeddingCache(cfg, table=jaxcache.HostTable(cfg, rows=rows))
    state, lookup = cache.prepare(cache.init_state(), np.array([[7, 2], [2, -1]]))
    emb = jaxcache.device.lookup_rows(state.rows, lookup)
    weights = jnp.array([[1.0, 2.0], [3.0, bad]], jnp.float32)
    for combiner, expected in {
        "sum": [[22, 25], [12, 15]],
        "mean": [[22 / 3, 25 / 3], [4, 5]],
    }.items():
        eager = jaxcache.device.pool(emb, lookup, combiner, weights)
        jitted = jax.jit(jaxcache.device.pool, static_argnums=2)(emb, lookup, combiner, weights)
        for pooled in (eager, jitted):
            np.testing.assert_allclose(np.asarray(pooled), expected, rtol=1e-6)


def test_an_evaluation_model_over_the_training_cache_reads_the_trained_rows():
    # A second CachedEmbed over the training model's cache, as an evaluation
    # model is built beside the training one: its lookups between training
    # steps bring rows in and evict others, and it must read what training
    # wrote, while training goes on to match the whole table.
    opt = OPTIMIZERS["adam"]
    batches = list(zipf_batches(N, B, F, 10, seed=7))
    cfg = jaxcache.CacheConfig(N, D, capacity=130, optimizer=opt)
    table = jaxcache.HostTable(cfg, seed=8)
    reference, ref_train = make_reference(np.array(table.rows), opt, F)
    cache = jaxcache.EmbeddingCache(cfg, table=table)
    cached, train = make_cached(cache, F)
    evaluator = jaxcache.nnx.CachedEmbed(cache)
    rng = np.random.default_rng(9)
    losses = []
    for ids, y in batches:
        losses.append((float(train(ids, y)), float(ref_train(ids, y))))
        probe = np.concatenate([ids[:2].reshape(-1), rng.integers(0, N, 24)])
        got = evaluator(evaluator.prepare(probe, train=False))
        assert _max_diff(got, reference.embed.table[...][probe]) <= 1e-6
    assert cache.stats.total.evictions > 3 * cfg.capacity
    assert_same_training(cached, reference, losses)
