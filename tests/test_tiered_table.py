"""The tiered host table: rows on disk, a DRAM tier of hot rows, exact training."""

from __future__ import annotations

import errno
import gc
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxcache
from jaxcache._src import cli, host_table, row_log
from jaxcache._src.dram_tier import SLOT_BYTES
from jaxcache._src.tier_replay import replay_dram_tier
from jaxcache._src.tiered_table import INDEX_BYTES_PER_ROW
from tests.models import dense_params, make_cached, make_reference, zipf_batches
from tests.test_exactness import OPTIMIZERS

# Every test here runs with both planners (``conftest.planner``).
pytestmark = pytest.mark.usefixtures("planner")

ROOT = pathlib.Path(__file__).resolve().parents[1]
N, D, B, F = 4000, 8, 32, 4


def tiered(config, directory, rows_in_dram, **kwargs):
    """A tiered table whose DRAM tier holds about ``rows_in_dram`` rows, with
    small log segments so that garbage collection runs in a short test."""
    probe = jaxcache.TieredTable(config, directory, dram_budget=1 << 30, **kwargs)
    record, index = probe.record_bytes, INDEX_BYTES_PER_ROW
    local = len(probe.rows)
    probe.close()
    kwargs.setdefault("shards", 4)
    kwargs.setdefault("segment_bytes", 40 * record)
    budget = index * local + rows_in_dram * record
    return jaxcache.TieredTable(config, directory, dram_budget=budget, **kwargs)


def _random_rows(rng, table, n):
    rows = rng.normal(size=(n, table.config.features)).astype(np.float32)
    state = {k: rng.normal(size=(n, *v.shape[1:])).astype(v.dtype) for k, v in table.state.items()}
    return rows, state


# ------------------------------------------------------------- the table alone
@pytest.mark.no_planner
@pytest.mark.parametrize("shard", [None, (1, 3)])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_random_reads_and_writes_match_the_host_table(tmp_path, opt_name, shard):
    # A DRAM tier of 40 rows and segments of 40 records: rows spill, come back,
    # and the log is collected many times over.
    rng = np.random.default_rng(0)
    cfg = jaxcache.CacheConfig(3000, 6, capacity=10, optimizer=OPTIMIZERS[opt_name])
    reference = jaxcache.HostTable(cfg, seed=2, shard=shard)
    table = tiered(cfg, tmp_path, 40, seed=2, shard=shard)
    ids = reference.ids()
    for _ in range(200):
        chosen = rng.choice(ids, rng.integers(1, 120), replace=False)
        if rng.random() < 0.5:
            rows, state = _random_rows(rng, reference, chosen.size)
            reference.scatter(chosen, rows, state)
            table.scatter(chosen, rows, state)
            continue
        expected_rows, expected_state = reference.gather(chosen)
        size = chosen.size + 3
        rows = np.zeros((size, 6), np.float32)
        state = {k: np.zeros((size, *v.shape[1:]), v.dtype) for k, v in reference.state.items()}
        at = rng.permutation(size)[: chosen.size]
        table.gather_into(chosen, rows, state, at)
        np.testing.assert_array_equal(rows[at], expected_rows)
        for name in state:
            np.testing.assert_array_equal(state[name][at], expected_state[name])
    np.testing.assert_array_equal(np.asarray(table.rows), reference.rows)
    for name in reference.state:
        np.testing.assert_array_equal(np.asarray(table.state[name]), reference.state[name])
    stats = table.stats()
    assert stats.dram.evicted_dirty > 1000 and stats.disk.rows_read > 1000
    assert stats.disk.segments_collected > 10
    assert 1.0 < stats.disk.write_amplification <= 2.0


@pytest.mark.no_planner
def test_initial_rows_are_the_host_tables(tmp_path):
    cfg = jaxcache.CacheConfig(70001, 3, 100, optimizer=jaxcache.adagrad(0.1))
    whole = jaxcache.HostTable(cfg, seed=5)
    for shard in (None, (2, 3)):
        index, count = shard or (0, 1)
        drawn = tiered(cfg, tmp_path / f"drawn{index}", 1000, seed=5, shard=shard)
        given = tiered(cfg, tmp_path / f"given{index}", 1000, rows=whole.rows, shard=shard)
        for table in (drawn, given):
            np.testing.assert_array_equal(np.asarray(table.rows), whole.rows[index::count])
            assert (np.asarray(table.state["accumulator"]) == 0.1).all()
    name = "embedding.shard-2-of-3.log"
    assert (tmp_path / "drawn2" / name).exists()
    drawn.close()
    assert not (tmp_path / "drawn2" / name).exists()


@pytest.mark.no_planner
def test_bfloat16_rows_pack_with_float32_state(tmp_path):
    # Records of 2-byte rows (6 of them, 12 bytes) and a 4-byte-wide state.
    cfg = jaxcache.CacheConfig(2000, 6, 10, dtype="bfloat16", optimizer=OPTIMIZERS["adagrad"])
    reference = jaxcache.HostTable(cfg, seed=3)
    table = tiered(cfg, tmp_path, 30, seed=3)
    assert table.record_bytes == 6 * 2 + 6 * 4
    rng = np.random.default_rng(0)
    for _ in range(30):
        ids = rng.choice(2000, 50, replace=False)
        rows, state = _random_rows(rng, reference, 50)
        reference.scatter(ids, rows, state)
        table.scatter(ids, rows, state)
    rows, state = table.gather(np.arange(2000))
    assert rows.dtype == cfg.row_dtype
    assert rows.tobytes() == reference.rows.tobytes()
    assert state["accumulator"].tobytes() == reference.state["accumulator"].tobytes()


@pytest.mark.no_planner
def test_columns_index_and_assign_like_arrays(tmp_path):
    cfg = jaxcache.CacheConfig(500, 4, 10, optimizer=jaxcache.adam(0.1))
    reference = jaxcache.HostTable(cfg, seed=1)
    table = tiered(cfg, tmp_path, 20, seed=1)
    mask = np.arange(500) % 7 == 0
    for key in (3, -1, slice(10, 40, 3), [5, 5, 499], np.array([[1, 2], [3, 4]]), mask):
        np.testing.assert_array_equal(table.rows[key], reference.rows[key])
    np.testing.assert_array_equal(table.rows[7:9, 2], reference.rows[7:9, 2])
    np.testing.assert_array_equal(table.state["count"][[1, 2]], reference.state["count"][[1, 2]])
    for key, value in ((4, 1.5), (slice(100, 300), 2.0), ([7, 450], np.ones((2, 4)))):
        table.rows[key] = value
        reference.rows[key] = value
    table.state["mu"][(slice(0, 50), 1)] = -3.0
    reference.state["mu"][0:50, 1] = -3.0
    np.testing.assert_array_equal(np.asarray(table.rows), reference.rows)
    np.testing.assert_array_equal(np.asarray(table.state["mu"]), reference.state["mu"])
    assert table.rows.shape == (500, 4) and table.state["count"].shape == (500,)
    assert len(table.rows) == 500 and table.rows.nbytes == 500 * 16
    with pytest.raises(IndexError, match="out of range"):
        table.rows[[500]]


def _keys(n, d):
    """Index keys of an ``[n, d]`` array: NumPy's forms along both axes."""
    ints = st.lists(st.integers(-n, n - 1), max_size=6)
    first = st.one_of(
        st.integers(-n, n - 1),
        ints,
        ints.map(lambda x: np.array(x, np.int64)),
        st.builds(
            slice,
            st.none() | st.integers(-n, n),
            st.none() | st.integers(-n, n),
            st.sampled_from([None, 1, 2, -1, -3]),
        ),
        st.lists(st.booleans(), min_size=n, max_size=n).map(np.array),
        st.just(Ellipsis),
    )
    second = st.one_of(
        st.integers(-d, d - 1),
        st.lists(st.integers(-d, d - 1), max_size=6),
        st.just(slice(None, None, -1)),
    )
    return st.one_of(first, st.tuples(first), st.tuples(first, second))


@pytest.mark.no_planner
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_columns_index_and_assign_as_numpy_does(tmp_path_factory, data):
    # Arrays on both axes pair their elements; duplicate rows assign as
    # NumPy's last-wins; an empty list selects nothing.
    cfg = jaxcache.CacheConfig(12, 3, 4)
    table = tiered(cfg, tmp_path_factory.mktemp("t"), 3, seed=2)
    reference = np.array(np.asarray(table.rows))
    for _ in range(3):
        key = data.draw(_keys(12, 3))
        try:
            want = reference[key]
        except IndexError:  # pairs that do not broadcast: refused by both
            with pytest.raises(IndexError):
                table.rows[key]
            continue
        np.testing.assert_array_equal(table.rows[key], want)
        value = np.arange(np.size(want), dtype=np.float32).reshape(np.shape(want)) + 100
        reference[key] = value
        table.rows[key] = value
        np.testing.assert_array_equal(np.asarray(table.rows), reference)


@pytest.mark.no_planner
def test_budget_is_checked_and_defaults_to_a_share_of_memory(tmp_path):
    cfg = jaxcache.CacheConfig(10_000, 4, 10)
    small = jaxcache.TieredTable(cfg, tmp_path / "a")  # the default fits the whole table
    assert small.stats().dram.slots == 10_000
    assert small.dram_budget == 10_000 * (INDEX_BYTES_PER_ROW + 16 + SLOT_BYTES)

    # The budget covers what the index and the tier hold (it left out each
    # slot's bookkeeping, 17 bytes beside a record of 16 here).
    def held(table):
        tier = table._tier
        arrays = [tier.records, tier.slot_of, tier.slot_id, tier.flags, tier.free]
        return sum(array.nbytes for array in [*arrays, table._log.where])

    assert held(small) <= small.dram_budget
    narrow = jaxcache.TieredTable(cfg, tmp_path / "e", dram_budget=300_000)
    assert narrow.stats().dram.slots < 10_000
    assert held(narrow) <= narrow.dram_budget <= 300_000
    # A budget for every row holds every row, whether the shards divide them or not.
    odd = jaxcache.TieredTable(jaxcache.CacheConfig(1000, 4, 10), tmp_path / "d", shards=16)
    assert odd.stats().dram.slots == 1008
    odd.gather(np.arange(1000))
    assert odd.stats().disk.rows_read == 0
    with pytest.raises(ValueError, match="does not hold the index of 10,000 rows"):
        jaxcache.TieredTable(cfg, tmp_path / "b", dram_budget=100_000)
    with pytest.raises(ValueError, match="must be a positive number of bytes"):
        jaxcache.TieredTable(cfg, tmp_path / "c", dram_budget=0.5)
    assert 0 < jaxcache.host.default_dram_budget()
    with pytest.raises(IndexError, match="outside this table's"):
        small.gather([10_000])
    with pytest.raises(TypeError, match="rows must be"):
        small.gather_into([1], np.zeros((1, 4)), {}, [0])


@pytest.mark.no_planner
def test_a_live_tables_files_are_not_built_over(tmp_path):
    users = jaxcache.TieredTable(
        jaxcache.CacheConfig(1000, 4, 16), tmp_path, rows=np.ones((1000, 4))
    )
    with pytest.raises(ValueError, match=r"embedding\.log holds the rows of another table.*name="):
        jaxcache.TieredTable(jaxcache.CacheConfig(1000, 4, 16), tmp_path, rows=np.zeros((1000, 4)))
    items = jaxcache.CacheConfig(1000, 4, 16, name="items")  # another name: files of its own
    other = jaxcache.TieredTable(items, tmp_path, rows=np.full((1000, 4), 2.0))
    assert (users.gather(np.arange(1000))[0] == 1).all()
    assert (other.gather(np.arange(1000))[0] == 2).all()
    users.close()  # closed, its files may be built anew
    again = jaxcache.TieredTable(jaxcache.CacheConfig(1000, 4, 16), tmp_path, seed=0)
    assert again.gather([5])[0].shape == (1, 4)


@pytest.mark.no_planner
def test_threads_on_disjoint_rows_see_their_own_writes(tmp_path):
    # Eight threads, each owning the rows r % 8 == t, write and read back
    # through a DRAM tier of 64 rows over 4 shards (evictions and garbage
    # collection on behalf of each other), and check every value they read.
    cfg = jaxcache.CacheConfig(4000, 5, 10, optimizer=jaxcache.rowwise_adagrad(0.1))
    table = tiered(cfg, tmp_path, 64, seed=0)
    expected = {
        "rows": np.asarray(table.rows),
        "accumulator": np.asarray(table.state["accumulator"]),
    }
    errors = []

    def work(thread: int) -> None:
        rng = np.random.default_rng(thread)
        mine = np.arange(thread, 4000, 8)
        try:
            for step in range(150):
                ids = rng.choice(mine, rng.integers(1, 60), replace=False)
                if step % 2 == 0:
                    rows, state = _random_rows(rng, table, ids.size)
                    table.scatter(ids, rows, state)
                    expected["rows"][ids] = rows
                    expected["accumulator"][ids] = state["accumulator"]
                else:
                    rows = np.empty((ids.size, 5), np.float32)
                    state = {"accumulator": np.empty(ids.size, np.float32)}
                    table.gather_into(ids, rows, state, np.arange(ids.size))
                    np.testing.assert_array_equal(rows, expected["rows"][ids])
                    np.testing.assert_array_equal(
                        state["accumulator"], expected["accumulator"][ids]
                    )
        except Exception as error:  # surfaced by the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]
    np.testing.assert_array_equal(np.asarray(table.rows), expected["rows"])
    stats = table.stats()
    assert stats.dram.evicted_dirty > 500 and stats.disk.segments_collected > 0


# ------------------------------------------------------------------- training
def _max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_training_through_a_small_dram_tier_matches_the_full_table(tmp_path, opt_name):
    # A device cache of 130 rows over a DRAM tier of 200: rows are evicted
    # from the device every step and spill from DRAM to disk every few steps.
    opt = OPTIMIZERS[opt_name]
    batches = list(zipf_batches(N, B, F, 12, seed=0))
    cfg = jaxcache.CacheConfig(N, D, capacity=130, policy="lru", optimizer=opt)
    table = tiered(cfg, tmp_path, 200, seed=1)
    reference, ref_train = make_reference(np.asarray(table.rows), opt, F)
    cached, train = make_cached(jaxcache.EmbeddingCache(cfg, table=table), F)
    for ids, y in batches:
        assert abs(float(train(ids, y)) - float(ref_train(ids, y))) <= 1e-6
    stats = table.stats()
    assert stats.dram.evicted_dirty > 200 and stats.disk.rows_read > 200
    rows, state = cached.embed.export()
    assert _max_diff(rows, reference.embed.table[...]) <= 1e-6
    ref_state = reference.embed.opt_state.get_value()
    for name in state:
        assert _max_diff(state[name], ref_state[name]) <= 1e-6, name
    for a, b in zip(dense_params(cached), dense_params(reference), strict=True):
        assert _max_diff(a, b) <= 1e-6


def _train_pipelined(directory, lookahead, batches):
    cfg = jaxcache.CacheConfig(
        20000, D, capacity=130 * (lookahead + 1) + 10, policy="lru", optimizer=jaxcache.adagrad(0.2)
    )
    table = tiered(cfg, directory, 300, seed=1)
    model, train = make_cached(jaxcache.EmbeddingCache(cfg, table=table), F)
    with jaxcache.prefetch(batches, {"ids": model.embed}, lookahead=lookahead) as pipeline:
        losses = [np.asarray(train.with_lookup(b["ids"], b["y"])) for b in pipeline]
    rows, state = model.embed.export()
    return table, model, losses, rows, state


def test_pipelined_is_bit_identical_to_unpipelined(tmp_path):
    batches = [{"ids": i, "y": y} for i, y in zipf_batches(20000, B, F, 16, seed=0)]
    base = _train_pipelined(tmp_path / "0", 0, batches)
    for lookahead in (1, 3):
        table, model, losses, rows, state = _train_pipelined(
            tmp_path / f"{lookahead}", lookahead, batches
        )
        assert table.stats().dram.evicted_dirty > 100
        np.testing.assert_array_equal(rows, base[3])
        np.testing.assert_array_equal(state["accumulator"], base[4]["accumulator"])
        np.testing.assert_array_equal(np.array(losses), np.array(base[2]))
        for a, b in zip(dense_params(model), dense_params(base[1]), strict=True):
            np.testing.assert_array_equal(a, b)


# ------------------------------------------------------ checkpoints and memory
def _run(*args):
    argv = [sys.executable, "-m", "tests.tiered_run", *map(str, args)]
    return subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(process):
    out, err = process.communicate(timeout=300)
    return process.returncode, out, err


def test_kill_between_checkpoints_then_restore_is_exact(tmp_path):
    """A run killed (SIGKILL) two steps after its checkpoint at step 4, its disk
    tier and DRAM tier lost with it, resumes from that checkpoint in a new
    process and ends bit for bit where an uninterrupted run ends."""
    whole = _run(
        "train",
        "--table-dir",
        tmp_path / "t1",
        "--checkpoint-dir",
        tmp_path / "c1",
        "--dump",
        tmp_path / "whole.npz",
    )
    killed = _run(
        "train",
        "--table-dir",
        tmp_path / "t2",
        "--checkpoint-dir",
        tmp_path / "c2",
        "--kill-after",
        6,
    )
    code, _, err = _finish(whole)
    assert code == 0, err
    code, out, err = _finish(killed)
    assert code == -signal.SIGKILL, (code, err)
    assert "killed after step 6" in out
    resumed = _run(
        "train",
        "--table-dir",
        tmp_path / "t2",
        "--checkpoint-dir",
        tmp_path / "c2",
        "--dump",
        tmp_path / "resumed.npz",
    )
    code, out, err = _finish(resumed)
    assert code == 0, err
    assert "restored step 4" in out
    whole, resumed = np.load(tmp_path / "whole.npz"), np.load(tmp_path / "resumed.npz")
    assert sorted(whole.files) == sorted(resumed.files) and len(whole["losses"]) == 12
    for key in whole.files:
        np.testing.assert_array_equal(resumed[key], whole[key], err_msg=key)


def test_peak_memory_stays_within_the_budget(tmp_path):
    # A table of 1M rows x 64 float32 + an accumulator (260 MB) over a DRAM
    # budget of an eighth of it: the process grows by the budget plus a fixed
    # amount (initial draws of a 65,536-row chunk, staging buffers), far less
    # than the table.
    code, out, err = _finish(_run("memory", "--table-dir", tmp_path, "--times", 8))
    assert code == 0, err
    figures = json.loads(out.strip().splitlines()[-1])
    table_bytes = 1_000_000 * 260
    assert table_bytes >= 8 * figures["budget"] * 0.99
    assert figures["rows_read"] > 1000 and figures["evicted_dirty"] > 1000
    growth = figures["peak"] - figures["baseline"]
    assert growth <= figures["budget"] + (128 << 20), figures


@pytest.mark.parametrize("into_tiered", [True, False])
def test_checkpoints_move_rows_between_tiered_and_plain_tables(tmp_path, into_tiered):
    cfg = jaxcache.CacheConfig(3000, D, capacity=130, policy="lru", optimizer=OPTIMIZERS["adam"])
    batches = list(zipf_batches(3000, B, F, 6, seed=2))
    source = tiered(cfg, tmp_path / "a", 150, seed=4) if into_tiered else jaxcache.HostTable(cfg)
    model, train = make_cached(jaxcache.EmbeddingCache(cfg, table=source), F)
    for ids, y in batches:
        train(ids, y)
    with jaxcache.Checkpointer(tmp_path / "ckpt") as checkpointer:
        checkpointer.save(1, caches=[model.embed])
        target = (
            jaxcache.HostTable(cfg, seed=9) if into_tiered else tiered(cfg, tmp_path / "b", 150)
        )
        embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg, table=target))
        checkpointer.restore(caches=[embed])
        saved = np.load(tmp_path / "ckpt" / "1" / "tables" / "embedding" / "rows.npy")
    rows, state = model.embed.export()
    np.testing.assert_array_equal(saved, rows)
    restored_rows, restored_state = embed.export()
    np.testing.assert_array_equal(restored_rows, rows)
    for name in state:
        np.testing.assert_array_equal(restored_state[name], state[name])


# -------------------------------------------------------------------- sizing
def test_replay_gives_the_dram_tiers_figures(tmp_path, capsys):
    batches = list(zipf_batches(N, B, F, 12, seed=0))
    cfg = jaxcache.CacheConfig(N, D, capacity=130, policy="lru", optimizer=OPTIMIZERS["adagrad"])
    table = tiered(cfg, tmp_path, 200, seed=1)
    cache = jaxcache.EmbeddingCache(cfg, table=table)
    _, train = make_cached(cache, F)
    for ids, y in batches:
        train(ids, y)
        cache.land_write_backs()  # each step's write-backs land before the next plan
    stats = table.stats()
    trace = np.stack([ids.reshape(-1) for ids, _ in batches])
    np.save(tmp_path / "trace.npy", trace)
    options = {"dram_budget": table.dram_budget, "row_bytes": table.record_bytes}
    out = replay_dram_tier(trace, capacity=130, policy="lru", num_embeddings=N, shards=4, **options)
    assert out["dram_rows"] == stats.dram.slots
    assert (out["dram_lookups"], out["dram_hits"]) == (stats.dram.lookups, stats.dram.hits)
    assert out["disk_rows_written"] == stats.dram.evicted_dirty > 0
    assert out["disk_rows_read"] == stats.disk.rows_read > 0
    # The command line adds the same figures to each result (16 shards by default).
    argv = ["replay", str(tmp_path / "trace.npy"), "--capacity", "130", "--policy", "lru"]
    argv += ["--num-embeddings", str(N), "--dram-budget", str(table.dram_budget)]
    assert cli.main([*argv, "--row-bytes", str(table.record_bytes)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["capacity"] == 130 and 0 < printed["dram_hit_rate"] < 1
    with pytest.raises(SystemExit):
        cli.main(argv)  # --dram-budget without --row-bytes
    assert "needs --row-bytes" in capsys.readouterr().err


def test_a_closed_table_is_refused_and_never_reaches_the_next_tables_files(tmp_path):
    # Closing frees the file descriptors, and the system gives their numbers
    # to the next files opened: a late read or write of the closed table
    # must not land in another table's files.
    cfg = jaxcache.CacheConfig(400, 4, 16, optimizer=jaxcache.adagrad(0.1))
    closed = tiered(cfg, tmp_path / "a", rows_in_dram=4)
    closed.close()
    live = tiered(cfg, tmp_path / "b", rows_in_dram=4)
    ids = np.arange(0, 400, 7)
    before = live.gather(ids)
    rows = np.ones((ids.size, 4), np.float32)
    state = {"accumulator": np.ones((ids.size, 4), np.float32)}
    for use in (
        lambda: closed.gather(ids),
        lambda: closed.scatter(ids, rows, state),
        lambda: closed.rows[:10],
        lambda: closed.state["accumulator"].__setitem__(3, 2.0),
    ):
        with pytest.raises(RuntimeError, match="TieredTable of 400 rows was closed"):
            use()
    with pytest.raises(ValueError, match="closed"):
        jaxcache.EmbeddingCache(cfg, table=closed)
    after = live.gather(ids)
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1]["accumulator"], before[1]["accumulator"])


_BUILD_IN_ANOTHER_PROCESS = """
import sys, numpy as np, jaxcache
kind, directory = sys.argv[1:]
cfg = jaxcache.CacheConfig(1000, 4, 16)
try:
    if kind == "tiered":
        table = jaxcache.TieredTable(cfg, directory, rows=np.full((1000, 4), 7.0))
    else:
        table = jaxcache.HostTable(cfg, rows=np.full((1000, 4), 7.0), directory=directory)
except ValueError as error:
    print("refused:", error)
else:
    print("built")
"""


@pytest.mark.no_planner
@pytest.mark.parametrize("kind", ["tiered", "host"])
def test_a_table_in_use_by_another_process_is_not_built_over(tmp_path, kind):
    # Two processes given one table's files (shares of a table without
    # shard=, a second job on the same directory): the second emptied the
    # first one's disk log, and each read the other's records as its rows.
    cfg = jaxcache.CacheConfig(1000, 4, 16)
    if kind == "tiered":
        table = jaxcache.TieredTable(cfg, tmp_path, rows=np.ones((1000, 4)), dram_budget=20_000)
    else:
        table = jaxcache.HostTable(cfg, rows=np.ones((1000, 4)), directory=tmp_path)

    def other_process() -> str:
        result = subprocess.run(
            [sys.executable, "-c", _BUILD_IN_ANOTHER_PROCESS, kind, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    refusal = other_process()
    assert "another process is using" in refusal and "shard=" in refusal, refusal
    assert (table.gather(np.arange(1000))[0] == 1).all()
    if kind == "tiered":
        table.close()  # closed, another process may build there
        assert other_process() == "built"


@pytest.mark.no_planner
def test_bad_arguments_are_refused_as_the_host_tables_are(tmp_path):
    cfg = jaxcache.CacheConfig(100, 4, 16, optimizer=jaxcache.adagrad(0.1))
    with pytest.raises(ValueError, match="does not hold the index"):
        jaxcache.TieredTable(cfg, tmp_path / "new", dram_budget=100)
    assert not (tmp_path / "new").exists()  # refused before anything changed
    table = jaxcache.TieredTable(cfg, tmp_path / "t", dram_budget=1_600)
    host = jaxcache.HostTable(cfg)
    for each in (table, host):
        with pytest.raises(ValueError, match=r"optimizer state \['accumulator'\].*missing"):
            each.scatter([3], np.ones((1, 4), np.float32), {})
    # The compiled copy wrote through a read-only buffer (a read-only map
    # crashed the process).
    rows = np.zeros((2, 4), np.float32)
    accumulator = np.zeros((2, 4), np.float32)
    rows.flags.writeable = False
    for each in (table, host):
        with pytest.raises(ValueError, match="read-only"):
            each.gather_into([1, 90], rows, {"accumulator": accumulator}, [0, 1])
    assert not rows.any() and not accumulator.any()


@pytest.mark.no_planner
def test_reads_outside_the_caches_fetches_leave_the_tier_as_it_was(tmp_path):
    # Exports, checkpoints and column views counted as the device cache's
    # lookups (a whole export of an Adam table, four times over) and gave
    # their rows second chances, so that the tier's hit rate and choices
    # were no longer those a replay of the cache's fetches gives.
    cfg = jaxcache.CacheConfig(1000, 4, 16, optimizer=jaxcache.adagrad(0.1))
    table = jaxcache.TieredTable(cfg, tmp_path, dram_budget=20_000)
    out = np.empty((64, 4), np.float32)
    state = {"accumulator": np.empty((64, 4), np.float32)}
    table.gather_into(np.arange(64), out, state, np.arange(64))
    before = table.stats().dram, table._tier.flags.copy()
    np.asarray(table.rows), table.state["accumulator"][:10], table.gather(np.arange(500))
    after = table.stats().dram, table._tier.flags
    assert after[0] == before[0] and after[0].lookups == 64
    np.testing.assert_array_equal(after[1], before[1])


@pytest.mark.no_planner
def test_a_full_disk_loses_nothing_and_writes_out_once_it_has_room(tmp_path, monkeypatch):
    # A write of evicted rows that failed stopped the others after it, and
    # the batches it left unwritten stayed in memory for good (their
    # segments never collected), though the disk had room again.
    cfg = jaxcache.CacheConfig(2000, 4, 10)
    budget = 12 * 2000 + 64 * (16 + SLOT_BYTES)
    table = jaxcache.TieredTable(cfg, tmp_path, dram_budget=budget, shards=1, segment_bytes=16 * 64)
    expected = np.asarray(table.rows).copy()
    write = row_log._pwrite_all
    full = [True]

    def pwrite(fd, array, offset):
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(fd, array, offset)

    monkeypatch.setattr(row_log, "_pwrite_all", pwrite)
    rng = np.random.default_rng(0)

    def scatter():
        ids = rng.choice(2000, 50, replace=False)
        values = rng.normal(size=(50, 4)).astype(np.float32)
        expected[ids] = values  # in the table, raised or not
        table.scatter(ids, values, {})

    failures = []
    for _ in range(20):
        try:
            scatter()
        except OSError as error:
            failures.append(str(error))
    assert failures and all("nothing is lost" in failure for failure in failures)
    np.testing.assert_array_equal(np.asarray(table.rows), expected)
    # The device cache's fetches still read, though the rows they evict
    # wait for the disk (they raised, and the batch was lost to the cache).
    ids = np.arange(1000, 1200)
    out = np.empty((ids.size, 4), np.float32)
    table.gather_into(ids, out, {}, np.arange(ids.size))
    np.testing.assert_array_equal(out, expected[ids])
    full[0] = False
    for _ in range(3):
        scatter()
    assert not table._log._unwritten and not table._log._flying
    np.testing.assert_array_equal(np.asarray(table.rows), expected)


@pytest.mark.no_planner
# The child runs no JAX (it reads a pipe and exits), which the warning is about.
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")
def test_a_forked_child_does_not_keep_a_tables_files_locked(tmp_path):
    # A process forked while a table lived (a data loader's worker) held its
    # copy of the lock: the parent could not build the table there again
    # until the child exited.
    cfg = jaxcache.CacheConfig(100, 4, 10)
    first = jaxcache.HostTable(cfg, directory=tmp_path)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never touches the table
        os.read(read, 1)
        os._exit(0)
    try:
        del first
        gc.collect()
        again = jaxcache.HostTable(cfg, seed=1, directory=tmp_path)
        np.testing.assert_array_equal(again.rows, jaxcache.HostTable(cfg, seed=1).rows)
    finally:
        os.write(write, b"x")
        os.waitpid(pid, 0)


@pytest.mark.no_planner
def test_a_dropped_table_removes_its_files_before_letting_them_go(tmp_path, monkeypatch):
    # Collected without close, a table dropped its lock before its log's
    # files were removed: a table another process built there meanwhile
    # would have lost its new files.
    table = jaxcache.TieredTable(jaxcache.CacheConfig(100, 4, 10), tmp_path)
    seen = []
    unlock = host_table._unlock

    def spy(fds):
        seen.append(sorted(os.listdir(tmp_path)))
        unlock(fds)

    monkeypatch.setattr(host_table, "_unlock", spy)
    del table
    gc.collect()
    assert seen == [[]]


@pytest.mark.no_planner
def test_a_filesystem_without_locks_builds_the_table_with_a_warning(tmp_path, monkeypatch):
    # Some network and user-space filesystems refuse flock: the table must
    # still work there, saying what it cannot guard against.
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(host_table.fcntl, "flock", no_locks)
    cfg = jaxcache.CacheConfig(100, 4, 10)
    with pytest.warns(RuntimeWarning, match="cannot be locked"):
        table = jaxcache.TieredTable(cfg, tmp_path, rows=np.ones((100, 4)))
    assert (table.gather(np.arange(100))[0] == 1).all()
