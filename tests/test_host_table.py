"""Host table, initializers and frequency counts."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import linen

import jaxcache


def test_embed_init_has_flax_distribution():
    shape = (40000, 16)
    ours = jaxcache.host.embed_init()(np.random.default_rng(0), shape)
    flax_init = linen.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
    theirs = np.asarray(flax_init(jax.random.key(0), shape))
    # Same spread and the same tails (an untruncated normal: ~4.6% beyond 2 sigma).
    quantiles = [0.001, 0.01, 0.25, 0.5, 0.75, 0.99, 0.999]
    np.testing.assert_allclose(
        np.quantile(ours, quantiles), np.quantile(theirs, quantiles), rtol=0.05, atol=0.005
    )
    sigma = 1 / np.sqrt(shape[1])
    assert abs(np.std(ours) - sigma) < 0.01 * sigma
    assert abs(np.mean(np.abs(ours) > 2 * sigma) - np.mean(np.abs(theirs) > 2 * sigma)) < 0.003
    assert ours.dtype == np.float32


def test_seeded_and_memmapped(tmp_path):
    cfg = jaxcache.CacheConfig(70000, 4, 100, optimizer=jaxcache.adam(0.1))
    a = jaxcache.HostTable(cfg, seed=3)
    b = jaxcache.HostTable(cfg, seed=3, directory=tmp_path)
    np.testing.assert_array_equal(a.rows, b.rows)
    assert isinstance(b.rows, np.memmap)
    assert (tmp_path / "rows.npy").exists() and (tmp_path / "mu.npy").exists()
    assert (b.state["count"] == 0).all()
    reopened = np.load(tmp_path / "rows.npy", mmap_mode="r")
    np.testing.assert_array_equal(reopened, a.rows)


def test_a_directory_holds_one_live_tables_files(tmp_path):
    cfg = jaxcache.CacheConfig(1000, 4, 16)
    first = jaxcache.HostTable(cfg, seed=3, directory=tmp_path)
    rows = np.array(first.rows)
    # Its own file as the rows of a new table there: opening the new file
    # would truncate the one it copies from.
    saved = np.load(tmp_path / "rows.npy", mmap_mode="r")
    with pytest.raises(ValueError, match=r"rows is a memory map of .*rows\.npy.*Checkpointer"):
        jaxcache.HostTable(cfg, rows=np.asarray(saved), directory=tmp_path)
    with pytest.raises(ValueError, match=r"rows\.npy holds the rows of another table"):
        jaxcache.HostTable(cfg, seed=4, directory=tmp_path)
    np.testing.assert_array_equal(first.rows, rows)
    np.testing.assert_array_equal(np.load(tmp_path / "rows.npy"), rows)
    del first, saved  # once the first table is gone, its directory may be reused
    second = jaxcache.HostTable(cfg, seed=4, directory=tmp_path)
    np.testing.assert_array_equal(second.rows, jaxcache.HostTable(cfg, seed=4).rows)


def test_existing_rows_and_bfloat16():
    rows = np.random.default_rng(0).normal(size=(50, 4)).astype(np.float32)
    cfg = jaxcache.CacheConfig(50, 4, 10, dtype="bfloat16")
    table = jaxcache.HostTable(cfg, rows=rows)
    assert table.rows.dtype == cfg.row_dtype
    np.testing.assert_allclose(table.rows.astype(np.float32), rows, rtol=1e-2)
    adopted = jaxcache.HostTable(jaxcache.CacheConfig(50, 4, 10), rows=rows, copy=False)
    assert adopted.rows is rows


@pytest.mark.parametrize(
    ("rows", "kwargs", "why"),
    [
        (np.zeros((50, 4)), {}, "rows are float64 and the table holds float32"),
        (np.zeros((4, 50), np.float32).T, {}, "C-contiguous, writeable"),
        (np.zeros((50, 4), np.float32), {"shard": (0, 2)}, "process's share"),
    ],
)
def test_rows_that_cannot_be_the_table_are_not_copied_in_silence(rows, kwargs, why):
    # Copied behind the caller's back, the array they keep would go stale.
    with pytest.raises(ValueError, match=rf"copy=False adopts rows .*{why}.*copy=True"):
        jaxcache.HostTable(jaxcache.CacheConfig(50, 4, 10), rows=rows, copy=False, **kwargs)


def test_bfloat16_cache_round_trip():
    cfg = jaxcache.CacheConfig(50, 4, 5, dtype="bfloat16", optimizer=jaxcache.sgd(0.5))
    cache = jaxcache.EmbeddingCache(cfg)
    embed = jaxcache.nnx.CachedEmbed(cache)
    before = np.array(cache.table.rows)
    for ids in ([1, 2], [3, 4], [1, 5]):
        embed(embed.prepare(np.array(ids), train=False))
    rows, _ = embed.export()
    np.testing.assert_array_equal(rows, before)
    assert embed.rows[...].dtype == np.dtype(cfg.row_dtype)


def test_frequency_counts_equal_bincount():
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 300, size=(16, 3)) for _ in range(10)]
    counter = jaxcache.FrequencyCounter(300).update_all(batches)
    expected = np.bincount(np.concatenate([b.ravel() for b in batches]), minlength=300)
    np.testing.assert_array_equal(counter.counts, expected)
    assert counter.samples_seen == 160
    top = counter.hottest(5)
    assert (np.diff(expected[top]) <= 0).all() and expected[top[0]] == expected.max()


def test_sampled_counts_rank_hot_rows():
    rng = np.random.default_rng(1)
    p = 1.0 / np.arange(1, 1001) ** 1.2
    batches = [rng.choice(1000, size=(512, 2), p=p / p.sum()) for _ in range(40)]
    full = jaxcache.FrequencyCounter(1000).update_all(batches)
    sampled = jaxcache.FrequencyCounter(1000, sample_rate=0.1, seed=0).update_all(batches)
    assert 0.05 < sampled.counts.sum() / full.counts.sum() < 0.15
    assert set(sampled.hottest(5).tolist()) == set(full.hottest(5).tolist())


def test_padding_is_not_counted():
    counter = jaxcache.FrequencyCounter(5, padding_id=-1)
    counter.update(np.array([[1, -1], [-1, 1]]))
    assert counter.counts.tolist() == [0, 2, 0, 0, 0]


def test_shards_hold_the_whole_tables_rows(tmp_path):
    # Two init chunks and a count that does not divide them: every shard's rows
    # are the whole table's, and gather/scatter take global ids.
    cfg = jaxcache.CacheConfig(70001, 3, 100, optimizer=jaxcache.adagrad(0.1))
    whole = jaxcache.HostTable(cfg, seed=5)
    for count in (2, 3):
        for index in range(count):
            drawn = jaxcache.HostTable(cfg, seed=5, shard=(index, count))
            given = jaxcache.HostTable(cfg, rows=whole.rows, shard=(index, count))
            mapped = jaxcache.HostTable(
                cfg, seed=5, shard=(index, count), directory=tmp_path / f"{index}of{count}"
            )
            for table in (drawn, given, mapped):
                np.testing.assert_array_equal(table.rows, whole.rows[index::count])
                assert table.state["accumulator"].shape[0] == len(table.ids())
            np.testing.assert_array_equal(drawn.ids(), np.arange(70001)[index::count])
    # Shards may share a directory: each keeps its own files.
    shared = [
        jaxcache.HostTable(cfg, seed=5, shard=(index, 2), directory=tmp_path / "shared")
        for index in range(2)
    ]
    for index, table in enumerate(shared):
        assert table.rows.filename.endswith(f"rows.shard-{index}-of-2.npy")
        np.testing.assert_array_equal(table.rows, whole.rows[index::2])
    odd = jaxcache.HostTable(cfg, seed=5, shard=(1, 2))
    ids = np.array([69999, 1, 7])
    np.testing.assert_array_equal(odd.gather(ids)[0], whole.rows[ids])
    odd.scatter(ids[:1], np.ones((1, 3), np.float32), {"accumulator": np.ones((1, 3))})
    assert (odd.gather(ids[:1])[0] == 1).all() and (odd.rows[34999] == 1).all()
    with pytest.raises(ValueError, match=r"ids \[4\] are not in this table's shard"):
        odd.gather(np.array([3, 4]))


def test_gather_into_and_scatter_from_positions():
    cfg = jaxcache.CacheConfig(100, 3, 10, optimizer=jaxcache.adam(0.1))
    table = jaxcache.HostTable(cfg, seed=1)
    before = {"rows": table.rows.copy(), **{k: v.copy() for k, v in table.state.items()}}
    ids, at = np.array([7, 93, 7, 0]), np.array([5, 0, 2, 3])
    rows = np.full((6, 3), -1.0, np.float32)
    state = {k: np.full((6, *v.shape[1:]), -1, v.dtype) for k, v in table.state.items()}
    table.gather_into(ids, rows, state, at)
    np.testing.assert_array_equal(rows[at], table.rows[ids])
    assert (rows[[1, 4]] == -1).all()  # positions not named stay as they were
    for name, values in state.items():
        np.testing.assert_array_equal(values[at], table.state[name][ids])
    # Back from positions of a larger buffer (a swap's read-out); rows cast to the table's dtype.
    table.scatter(np.array([4, 50]), rows.astype(np.float64), state, at=np.array([0, 3]))
    np.testing.assert_array_equal(table.rows[[4, 50]], before["rows"][[93, 0]])
    for name, values in table.state.items():
        np.testing.assert_array_equal(values[[4, 50]], before[name][[93, 0]])
    untouched = np.setdiff1d(np.arange(100), [4, 50])
    np.testing.assert_array_equal(table.rows[untouched], before["rows"][untouched])
    with pytest.raises(IndexError, match="nothing was copied"):
        table.scatter(np.array([4, 100]), rows, state, at=np.array([0, 1]))
    np.testing.assert_array_equal(table.rows[4], before["rows"][93])


@pytest.mark.parametrize("at", [[2, 3, 4], [4, 2, 3]], ids=["run", "scattered"])
def test_gather_into_places_rows_and_refuses_bad_ids_before_writing(at):
    cfg = jaxcache.CacheConfig(100, 3, 10, optimizer=jaxcache.rowwise_adagrad(0.1))
    table = jaxcache.HostTable(cfg, seed=2)
    ids, at = np.array([99, 0, 41]), np.array(at)
    rows = np.full((6, 3), -1.0, np.float32)
    state = {k: np.full((6, *v.shape[1:]), -1, v.dtype) for k, v in table.state.items()}
    table.gather_into(ids, rows, state, at)
    np.testing.assert_array_equal(rows[at], table.rows[ids])
    assert (rows[[0, 1, 5]] == -1).all()
    for name, values in state.items():
        np.testing.assert_array_equal(values[at], table.state[name][ids])
    fresh = np.full((6, 3), -1.0, np.float32)
    with pytest.raises(IndexError, match=r"\[100\]|100"):
        table.gather_into(np.array([1, 100, 2]), fresh, state, at)
    assert (fresh == -1).all()


@pytest.mark.parametrize("count", [2, 3, 4])  # a mask and a shift, or a division
@pytest.mark.parametrize("at", [[0, 1, 2], [2, 0, 1]], ids=["run", "scattered"])
def test_gather_into_a_shard_refuses_other_shards_and_bad_places_before_writing(at, count):
    cfg = jaxcache.CacheConfig(101, 3, 10, optimizer=jaxcache.adam(0.1))
    whole = jaxcache.HostTable(cfg, seed=4)
    shard = jaxcache.HostTable(cfg, seed=4, shard=(1, count))
    ids, at = np.array([1 + 24 * count, 1, 1 + 11 * count]), np.array(at)
    rows = np.full((3, 3), -1.0, np.float32)
    state = {k: np.full((3, *v.shape[1:]), -1, v.dtype) for k, v in shard.state.items()}
    shard.gather_into(ids, rows, state, at)
    np.testing.assert_array_equal(rows[at], whole.rows[ids])
    for name, values in state.items():
        np.testing.assert_array_equal(values[at], whole.state[name][ids])
    fresh = np.full((3, 3), -1.0, np.float32)
    with pytest.raises(ValueError, match=r"ids \[2\] are not in this table's shard"):
        shard.gather_into(np.array([1, 2, 1 + count]), fresh, state, at)
    beyond = 1 + 50 * count  # in the shard's residue, past the table's rows
    with pytest.raises(IndexError, match=rf"\[{beyond}\]"):
        shard.gather_into(np.array([1, beyond, 1 + count]), fresh, state, at)
    with pytest.raises(IndexError, match="place 3 is outside the 3 rows"):
        shard.gather_into(ids, fresh, state, np.array([0, 3, 1]))
    assert (fresh == -1).all()
