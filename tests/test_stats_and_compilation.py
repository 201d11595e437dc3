"""Statistics add up; shapes stay static so nothing recompiles once warm."""

from __future__ import annotations

import numpy as np
import pytest

import jaxcache
from tests.models import make_cached, zipf_batches


def test_no_recompilation_after_warm_up():
    n, features = 5000, 4
    cfg = jaxcache.CacheConfig(n, 8, 200, policy="lru", optimizer=jaxcache.adagrad(0.1))
    cache = jaxcache.EmbeddingCache(cfg)
    _, train = make_cached(cache, features)
    batches = zipf_batches(n, 32, features, 560, alpha=1.05, seed=3)
    misses = []
    for step, (ids, y) in enumerate(batches):
        if step == 60:
            warm = jaxcache.testing.compilations()
        train(ids, y).block_until_ready()
        misses.append(cache.stats.last.misses)
    assert jaxcache.testing.compilations() == warm
    assert len(set(misses[60:])) > 10  # miss counts really varied


def test_statistics_add_up():
    n = 3000
    cfg = jaxcache.CacheConfig(n, 8, 150, policy="lfu", optimizer=jaxcache.adam(0.01))
    cache = jaxcache.EmbeddingCache(cfg)
    model, train = make_cached(cache, 4)
    lookups = distinct = 0
    for ids, y in zipf_batches(n, 32, 4, 30, seed=1):
        train(ids, y)
        last = cache.stats.last
        assert last.hits + last.misses == last.distinct == len(np.unique(ids))
        assert last.lookups == ids.size
        assert last.access_hits <= last.lookups
        assert last.rows_to_device == last.misses
        lookups += ids.size
        distinct += len(np.unique(ids))
    model.embed.flush()
    stats = cache.stats
    total = stats.total
    assert total.lookups == lookups and total.distinct == distinct
    assert stats.steps == 30
    # Every row that went to the device went back once changed: after a flush
    # rows_to_host counts dirty evictions plus flushed resident rows.
    assert total.rows_to_host == total.rows_to_device
    assert stats.bytes_to_device == total.rows_to_device * cfg.row_bytes
    assert stats.bytes_to_host == total.rows_to_host * cfg.row_bytes
    # row + mu + nu (8 floats each) + count (int32)
    assert cfg.row_bytes == 3 * 8 * 4 + 4
    assert 0 < total.hit_rate < 1 and 0 < total.access_hit_rate < 1
    assert total.access_hit_rate > total.hit_rate  # hot rows are reused within a batch
    d = stats.as_dict()
    assert d["hit_rate"] == total.hit_rate and d["steps"] == 30


def test_inference_moves_nothing_back():
    n = 2000
    cfg = jaxcache.CacheConfig(n, 8, 140, policy="lru")
    cache = jaxcache.EmbeddingCache(cfg)
    embed = jaxcache.nnx.CachedEmbed(cache)
    for ids, _ in zipf_batches(n, 32, 4, 20, seed=2):
        embed(embed.prepare(ids, train=False))
    assert cache.stats.total.evictions > 0
    assert cache.stats.total.rows_to_host == 0
    embed.flush()
    assert cache.stats.total.rows_to_host == 0


def test_swap_donates_the_cache():
    cfg = jaxcache.CacheConfig(100, 4, 8)
    cache = jaxcache.EmbeddingCache(cfg)
    state = cache.init_state()
    old = state.rows
    state, _ = cache.prepare(state, np.array([1, 2, 3]))
    assert old.is_deleted()
    assert not state.rows.is_deleted()


@pytest.mark.parametrize("policy", jaxcache.planning.POLICIES)
def test_export_is_in_id_order(policy):
    n = 500
    rows = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    cfg = jaxcache.CacheConfig(n, 2, 20, policy=policy, optimizer=jaxcache.sgd(1.0))
    freq = np.arange(n)[::-1].copy()
    cache = jaxcache.EmbeddingCache(cfg, table=jaxcache.HostTable(cfg, rows=rows), frequencies=freq)
    embed = jaxcache.nnx.CachedEmbed(cache)
    rng = np.random.default_rng(0)
    for _ in range(10):
        embed(embed.prepare(rng.integers(0, n, 15), train=False))
    exported, _ = embed.export()
    np.testing.assert_array_equal(exported, rows)


def test_saved_statistics_are_read_by_the_names_saved_beside_them():
    # Each process's counters are one array in a checkpoint: read by name,
    # so that a version with more or fewer counters still restores them.
    stats = jaxcache.CacheStats(row_bytes=16)
    stats.record(jaxcache.stats.StepStats(lookups=10, distinct=4, hits=3, misses=1))
    stats.record(jaxcache.stats.StepStats(lookups=6, distinct=2, hits=2))
    names = jaxcache.CacheStats.state_fields()
    array = stats.state_array()
    assert dict(zip(names, array.tolist(), strict=True))["total.lookups"] == 16
    # Shares of two processes add up; the steps are the most either took.
    both = jaxcache.CacheStats.from_state_arrays([array, array])
    assert both["total"]["hits"] == 10 and both["steps"] == 2
    # Saved by a version with a counter more and one less: by name.
    older = [name for name in names if name != "total.overflow"] + ["total.someday"]
    values = [dict(zip(names, array.tolist(), strict=True)).get(n, 7) for n in older]
    read = jaxcache.CacheStats.from_state_arrays([np.array(values)], older)
    assert read["total"]["overflow"] == 0 and read["total"]["lookups"] == 16
    assert "someday" not in read["total"]
    with pytest.raises(ValueError, match="statistics are corrupt"):
        jaxcache.CacheStats.from_state_arrays([array[:-1]])
