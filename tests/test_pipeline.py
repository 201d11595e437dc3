"""The prefetch pipeline: identical results to the unpipelined run, clean shutdown."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import sys
import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx

import jaxcache
from tests.models import (
    dense_params,
    failing_transfer,
    make_cached,
    make_callback,
    make_reference,
    zipf_batches,
)

# Every test here runs with both planners (``conftest.planner``).
pytestmark = pytest.mark.usefixtures("planner")

N, D, B, F = 20000, 8, 32, 4


def _batches(steps, seed=0):
    return [{"ids": ids, "y": y} for ids, y in zipf_batches(N, B, F, steps, seed=seed)]


def _train(policy, capacity, lookahead, batches, opt=None):
    opt = opt or jaxcache.adagrad(0.2)
    cfg = jaxcache.CacheConfig(N, D, capacity=capacity, policy=policy, optimizer=opt)
    # Counts from a sample of the stream, so the warmed rows do not cover it all.
    freq = jaxcache.FrequencyCounter(N).update_all(b["ids"] for b in batches[:3]).counts
    cache = jaxcache.EmbeddingCache(cfg, table=jaxcache.HostTable(cfg, seed=1), frequencies=freq)
    model, train = make_cached(cache, F)
    with jaxcache.prefetch(batches, {"ids": model.embed}, lookahead=lookahead) as pipeline:
        losses = [np.asarray(train.with_lookup(b["ids"], b["y"])) for b in pipeline]
    rows, state = model.embed.export()
    return cache, model, losses, rows, state


@pytest.mark.parametrize("policy", jaxcache.planning.POLICIES)
def test_pipelined_is_bit_identical_to_unpipelined(policy):
    batches = _batches(20)
    runs = {k: _train(policy, 130 * (k + 1) + 10, k, batches) for k in (0, 1, 2, 4)}
    _, base_model, base_losses, base_rows, base_state = runs[0]
    for k, (cache, model, losses, rows, state) in runs.items():
        assert cache.stats.total.evictions > 100  # rows really move
        np.testing.assert_array_equal(rows, base_rows)
        for name in state:
            np.testing.assert_array_equal(state[name], base_state[name])
        for a, b in zip(dense_params(model), dense_params(base_model), strict=True):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(np.array(losses), np.array(base_losses)), k
    # ... and the unpipelined run matches the full-table reference.
    reference, ref_train = make_reference(
        np.array(jaxcache.HostTable(runs[0][0].config, seed=1).rows), jaxcache.adagrad(0.2), F
    )
    for b in batches:
        ref_train(b["ids"], b["y"])
    assert np.abs(base_rows - np.asarray(reference.embed.table[...])).max() <= 1e-6


@pytest.mark.parametrize("lookahead", [1, 2, 4])
def test_window_larger_than_capacity_shrinks_instead_of_failing(lookahead):
    # Capacity fits one batch only: the producer must wait for each release.
    batches = _batches(8, seed=3)
    _, _, losses, rows, _ = _train("lru", 130, lookahead, batches)
    _, _, base_losses, base_rows, _ = _train("lru", 130, 0, batches)
    np.testing.assert_array_equal(rows, base_rows)
    np.testing.assert_array_equal(np.array(losses), np.array(base_losses))


def _train_tables(capacities, lookahead, batches):
    """One model per table, all fed by one pipeline; each table's rows."""
    models = {}
    for key, capacity in capacities.items():
        cfg = jaxcache.CacheConfig(N, D, capacity, policy="lru", name=key)
        cache = jaxcache.EmbeddingCache(cfg, table=jaxcache.HostTable(cfg, seed=1))
        models[key] = make_cached(cache, F)
    tables = {key: model.embed for key, (model, _) in models.items()}
    with jaxcache.prefetch(batches, tables, lookahead=lookahead) as pipeline:
        for batch in pipeline:
            for key, (_, train) in models.items():
                train.with_lookup(batch[key], batch["y"])
    return {key: model.embed.export()[0] for key, (model, _) in models.items()}


@pytest.mark.parametrize("lookahead", [1, 2, 4])
def test_tables_that_wait_for_room_in_the_same_and_in_later_batches(lookahead):
    # Tables a and b fit one batch, so both wait for room in the same
    # batches; c fits two, so it waits in others. Each batch goes out with
    # every table's rows, planned as without look-ahead.
    streams = {key: _batches(10, seed=seed) for key, seed in (("a", 3), ("b", 4), ("c", 5))}
    batches = [
        {"y": streams["a"][i]["y"], **{key: s[i]["ids"] for key, s in streams.items()}}
        for i in range(10)
    ]
    capacities = {"a": 130, "b": 130, "c": 260}
    rows = _train_tables(capacities, lookahead, batches)
    base = _train_tables(capacities, 0, batches)
    for key in capacities:
        np.testing.assert_array_equal(rows[key], base[key])


def test_producer_error_surfaces_in_the_loop_with_its_traceback():
    def source():
        yield {"ids": np.array([[1, 2]])}
        yield {"ids": np.array([[1, N + 5]])}  # out of range: raised by the planner

    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(jaxcache.CacheConfig(N, D, 50)))
    pipeline = jaxcache.prefetch(source(), {"ids": embed}, lookahead=2)
    next(pipeline)
    with pytest.raises(ValueError, match=f"holds {N + 5}") as info:
        next(pipeline)
    assert any("check_ids" in entry.name for entry in info.traceback)
    assert not pipeline._thread.is_alive()
    embed.flush()  # the host table is consistent


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (np.array([[1.0, 2.0]] * B), TypeError),  # refused on the host
        (np.array([[1, -5]] * B), ValueError),  # a value, found where it is planned
        (np.array([[1, 2]] * (B + 1)), ValueError),  # does not split over 2 devices
    ],
)
def test_a_bad_batch_is_raised_after_the_batches_before_it(bad, error):
    # With either planner, however the error is found, the loop gets every
    # batch before the bad one, then the error; what was planned is applied,
    # and a new pipeline goes on from there.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("rows",))
    cfg = jaxcache.CacheConfig(N, D, 600, optimizer=jaxcache.sgd(0.1), padding_id=-1)
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg, mesh=mesh))
    good = [{"ids": batch["ids"]} for batch in _batches(4)]
    taken = 0
    with pytest.raises(error):
        with jaxcache.prefetch(
            [*good[:3], {"ids": bad}, good[3]], {"ids": embed}, lookahead=2
        ) as p:
            for batch in p:
                embed(batch["ids"])
                taken += 1
    assert taken == 3
    with jaxcache.prefetch(good, {"ids": embed}, lookahead=1) as pipeline:
        assert len([embed(batch["ids"]) for batch in pipeline]) == 4
    embed.flush()


@pytest.mark.parametrize("lookahead", [0, 2])
def test_a_batch_one_table_refuses_leaves_the_other_tables_whole(lookahead):
    # The tables staged before the refusing one have planned the batch: their
    # plans are applied (rows come in, untrained), never left half-made.
    def embed(name):
        cfg = jaxcache.CacheConfig(100, 4, 16, name=name)
        return jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg, seed=0))

    a, b = embed("a"), embed("b")
    truth = jaxcache.HostTable(a.cache.config, seed=0).rows
    good = {"a": np.array([[1, 2]]), "b": np.array([[3, 4]])}
    bad = {"a": np.array([[5, 6]]), "b": np.array([[7, 100]])}  # 100: outside table b
    with pytest.raises(ValueError, match="holds 100"):
        with jaxcache.prefetch([good, bad], {"a": a, "b": b}, lookahead=lookahead) as pipeline:
            for _ in pipeline:
                pass
    assert a.cache.stats.steps == 2 and b.cache.stats.steps == 1
    again = {"a": np.array([[5, 6]]), "b": np.array([[3, 4]])}
    with jaxcache.prefetch([again], {"a": a, "b": b}, lookahead=lookahead) as pipeline:
        rows = [np.asarray(a(batch["a"]))[0] for batch in pipeline]
    np.testing.assert_array_equal(rows[0], truth[[5, 6]])
    np.testing.assert_array_equal(a.export()[0], truth)


@pytest.mark.parametrize("lookahead", [0, 2])
@pytest.mark.parametrize(
    ("b", "error", "message"),
    [
        (None, KeyError, r"no ids under 'b'"),
        (np.array([[3.0, 4.0]]), TypeError, r"ids must be an integer array, got dtype float64"),
    ],
)
def test_a_batch_a_table_cannot_take_is_refused_before_any_table_plans_it(
    lookahead, b, error, message
):
    # A missing table or ids of a wrong type are found on the host before
    # any plan: the raw-id table before the refusing one neither counts the
    # batch's ids as seen nor gives them rows. (Values are checked as each
    # table plans: see test_a_batch_one_table_refuses_leaves_the_other_tables_whole.)
    def embed(name, vocabulary=None):
        cfg = jaxcache.CacheConfig(100, 4, 16, name=name, vocabulary=vocabulary)
        return jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg))

    a, other = embed("a", jaxcache.DynamicVocabulary()), embed("b")
    good = {"a": np.array([[10**12, 7]]), "b": np.array([[3, 4]])}
    bad = {"a": good["a"] + 1} | ({} if b is None else {"b": b})
    with pytest.raises(error, match=message):
        tables = {"a": a, "b": other}
        with jaxcache.prefetch([good, bad], tables, lookahead=lookahead) as pipeline:
            for _ in pipeline:
                pass
    assert a.cache.stats.steps == other.cache.stats.steps == 1
    assert a.cache.vocabulary.size == 2  # 10**12 + 1 and 8 got no row


def test_tables_waiting_for_room_when_another_refuses_stay_whole(planner):
    # Tables a, c and d wait for room in the batch whose ids table b
    # refuses: the error ends the loop, and every table is left as after
    # the batch before it, exportable and ready for a new pipeline.
    keys = "abcd"
    embeds = {}
    for key in keys:
        cfg = jaxcache.CacheConfig(500, 4, 20, policy="lru", name=key)
        embeds[key] = jaxcache.nnx.CachedEmbed(
            jaxcache.EmbeddingCache(cfg, seed=0, planner=planner)
        )
    rng = np.random.default_rng(0)
    data = [{k: rng.integers(0, 500, (8, 2)) for k in keys} for _ in range(12)]
    data[7]["b"][0, 0] = 9999
    taken = 0
    with pytest.raises(ValueError, match="holds 9999"):
        with jaxcache.prefetch(data, embeds, lookahead=2) as pipeline:
            for _ in pipeline:
                taken += 1
    assert taken == 7
    truth = jaxcache.HostTable(embeds["a"].cache.config, seed=0).rows
    for key in keys:
        np.testing.assert_array_equal(embeds[key].export()[0], truth)
    with jaxcache.prefetch(data[8:], embeds, lookahead=2) as pipeline:
        assert len(list(pipeline)) == 4


def test_prepare_waits_until_no_pipeline_stages_ahead(planner):
    # A batch prepared between the staged ones would take their rows or
    # wait for them forever: refused until the pipeline is closed or done.
    cfg = jaxcache.CacheConfig(200, 4, 34, policy="lru")
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg, planner=planner))
    rng = np.random.default_rng(0)
    batches = [{"ids": rng.integers(0, 200, (4, 4))} for _ in range(6)]
    with jaxcache.prefetch(batches, {"ids": embed}, lookahead=1) as pipeline:
        next(pipeline)
        with pytest.raises(RuntimeError, match=r"while a jaxcache\.prefetch stages its batches"):
            embed.prepare(batches[0]["ids"], train=False)
    embed.prepare(batches[0]["ids"], train=False)
    assert len(list(jaxcache.prefetch(batches, {"ids": embed}, lookahead=1))) == 6
    embed.prepare(batches[0]["ids"], train=False)  # a pipeline run to its end lets go
    for _ in jaxcache.prefetch(batches, {"ids": embed}, lookahead=0):  # nothing ahead
        embed.prepare(batches[0]["ids"], train=False)


@pytest.mark.no_planner
def test_a_batch_one_table_cannot_hold_leaves_the_others_planned_as_on_the_host():
    # Table b cannot hold batch 2; table a's plans after it were refused for
    # room when the error ended the loop. Each table is left as the host
    # planner leaves it, and the next pipeline goes on alike.
    rng = np.random.default_rng(0)

    def batch():
        return {"a": rng.integers(0, 64, (8, 3)), "b": rng.integers(0, 40, (8, 2))}

    data = [batch(), batch(), {**batch(), "b": np.tile(np.arange(17), (8, 1))}, batch()]
    more = [batch() for _ in range(6)]
    stats = {}
    for planner in ("host", "device"):
        embeds = {
            key: jaxcache.nnx.CachedEmbed(
                jaxcache.EmbeddingCache(
                    jaxcache.CacheConfig(64, 4, capacity, policy="lru", name=key), planner=planner
                )
            )
            for key, capacity in (("a", 32), ("b", 16))
        }
        with pytest.raises(jaxcache.CapacityError, match="17 distinct ids"):
            with jaxcache.prefetch(data, embeds, lookahead=2) as pipeline:
                for _ in pipeline:
                    pass
        for embed in embeds.values():
            embed.export()
        with jaxcache.prefetch(more, embeds, lookahead=2) as pipeline:
            assert len(list(pipeline)) == len(more)
        stats[planner] = {key: embed.cache.stats.total for key, embed in embeds.items()}
    assert stats["device"] == stats["host"]


@pytest.mark.no_planner
def test_tables_of_both_planners_are_refused_with_look_ahead():
    embeds = {
        key: jaxcache.nnx.CachedEmbed(
            jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, 40, name=key), planner=key)
        )
        for key in ("host", "device")
    }
    batches = [{"host": np.array([[1, 2]]), "device": np.array([[3, 4]])}]
    with pytest.raises(ValueError, match=r"mix planners .*same planner=, or pass lookahead=0"):
        jaxcache.prefetch(batches, embeds, lookahead=1)
    with jaxcache.prefetch(batches, embeds, lookahead=0) as pipeline:
        assert len(list(pipeline)) == 1


def _no_prefetch_threads(within=1.0):
    """Whether every producer thread ends within ``within`` seconds (it may
    still be between its last check of the stop flag and its return)."""
    deadline = time.perf_counter() + within
    while any(t.name == "jaxcache-prefetch" for t in threading.enumerate()):
        if time.perf_counter() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_close_mid_epoch_is_prompt_and_leaves_no_thread():
    def endless():
        rng = np.random.default_rng(0)
        while True:
            yield {"ids": rng.integers(0, N, size=(B, F))}

    cfg = jaxcache.CacheConfig(N, D, 600, optimizer=jaxcache.sgd(0.1))
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg))
    with jaxcache.prefetch(endless(), {"ids": embed}, lookahead=3) as pipeline:
        for i, batch in enumerate(pipeline):
            embed(batch["ids"])
            if i == 5:
                start = time.perf_counter()
                break
    assert time.perf_counter() - start < 1.0
    assert _no_prefetch_threads()
    # Every staged batch was applied, so the device matches the planner.
    rows, _ = embed.export()
    np.testing.assert_array_equal(rows, embed.cache.table.rows)
    slots = np.flatnonzero(embed.cache.planner.id_of_slot >= 0)
    np.testing.assert_array_equal(
        np.asarray(embed.rows[...])[slots], rows[embed.cache.planner.id_of_slot[slots]]
    )


def test_close_while_the_source_blocks():
    release = threading.Event()

    def slow():
        yield {"ids": np.array([[1, 2]])}
        release.wait(5)
        yield {"ids": np.array([[3, 4]])}

    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(jaxcache.CacheConfig(N, D, 50)))
    pipeline = jaxcache.prefetch(slow(), {"ids": embed}, lookahead=2)
    next(pipeline)
    start = time.perf_counter()
    pipeline.close()
    assert time.perf_counter() - start < 1.0
    release.set()
    pipeline._thread.join(2)
    assert _no_prefetch_threads()
    assert embed.cache.planner.next_index == 1  # the late batch was never planned


@pytest.mark.parametrize("iterable", ["generator", "list_iterator"])
def test_a_break_loses_no_batch_the_pipeline_took_from_its_source(planner, iterable):
    # 16 distinct ids a batch in 24 slots: with a batch in flight the next
    # one waits for room, taken from the source but not staged. After a
    # break, a later pipeline over the same source goes on from the batch
    # after the last one staged: every batch is planned exactly once.
    cfg = jaxcache.CacheConfig(200, D, 24, policy="lru", optimizer=jaxcache.sgd(0.1))
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg, planner=planner))
    batches = [{"k": k, "ids": (16 * k + np.arange(16)).reshape(8, 2) % 200} for k in range(10)]
    source = (b for b in batches) if iterable == "generator" else iter(batches)
    first = []
    # An iterator without weak references keeps them in ``unstaged``, and says so.
    warns = pytest.warns(RuntimeWarning, match=r"never staged.*\.unstaged: chain them")
    with warns if iterable == "list_iterator" else contextlib.nullcontext():
        with jaxcache.prefetch(source, {"ids": embed}, lookahead=2) as pipeline:
            for batch in pipeline:
                embed(batch["ids"])
                first.append(batch["k"])
                if len(first) == 4:
                    time.sleep(0.2)  # the producer takes batch 4 and waits for room
                    break
    planned = embed.cache.planner.next_index
    assert first == [0, 1, 2, 3] and planned >= 4
    assert [b["k"] for b in pipeline.unstaged] == list(
        range(planned, planned + len(pipeline.unstaged))
    )
    assert pipeline.unstaged, "the producer was waiting with a batch taken from the source"
    if iterable == "list_iterator":  # the caller chains them back
        source = itertools.chain(pipeline.unstaged, source)
    with jaxcache.prefetch(source, {"ids": embed}, lookahead=2) as pipeline:
        second = [batch["k"] for batch in pipeline]
    assert second == list(range(planned, 10))


def test_a_batch_one_table_planned_at_a_break_is_planned_by_every_table_once(planner):
    # Two tables: "a" holds every batch in flight, "b" (24 slots, 16 ids a
    # batch) waits for room for the batch after the one in flight. At a
    # break, "a" has planned a batch that "b" has not: it counts as seen, as
    # a batch staged ahead does, so "b" plans it at close; the batches no
    # table planned go back to the source. Each table plans each batch once.
    def cache(capacity):
        cfg = jaxcache.CacheConfig(200, D, capacity, policy="lru", optimizer=jaxcache.sgd(0.1))
        return jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg, planner=planner))

    embeds = {"a": cache(200), "b": cache(24)}
    batches = [
        {"k": k, **{key: (16 * k + np.arange(16)).reshape(8, 2) % 200 for key in embeds}}
        for k in range(10)
    ]
    source = (b for b in batches)
    first = []
    with jaxcache.prefetch(source, embeds, lookahead=2) as pipeline:
        for batch in pipeline:
            for key, embed in embeds.items():
                embed(batch[key])
            first.append(batch["k"])
            if len(first) == 4:
                time.sleep(0.2)  # "b" waits for room for batch 4; "a" planned it
                break
    planned = {key: embed.cache.planner.next_index for key, embed in embeds.items()}
    assert first == [0, 1, 2, 3]
    assert planned["a"] == planned["b"] >= 5, planned
    assert [b["k"] for b in pipeline.unstaged] == list(range(planned["b"], 10))[
        : len(pipeline.unstaged)
    ]
    with jaxcache.prefetch(source, embeds, lookahead=2) as pipeline:
        second = [batch["k"] for batch in pipeline]
    assert second == list(range(planned["b"], 10))
    for embed in embeds.values():
        assert embed.cache.planner.next_index == 10
        assert embed.cache.stats.total.lookups == 10 * 16


def test_a_batch_one_table_refuses_raises_and_the_next_pipeline_goes_on_after_it(planner):
    # Batch 3 has more distinct ids than "b" holds: "a" planned it, "b"
    # refused it. The loop raises the refusal; the batch goes with its
    # error, and a later pipeline over the source goes on after it.
    def cache(capacity):
        cfg = jaxcache.CacheConfig(400, D, capacity, policy="lru", optimizer=jaxcache.sgd(0.1))
        return jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg, planner=planner))

    embeds = {"a": cache(400), "b": cache(12)}

    def ids(k):
        return (16 * k + np.arange(16)).reshape(8, 2) % (16 if k != 3 else 400)

    batches = [{"k": k, "a": ids(k) + 100, "b": ids(k) % (6 if k != 3 else 400)} for k in range(8)]
    source = (b for b in batches)
    first = []
    with pytest.raises(jaxcache.CapacityError, match="capacity"):
        with jaxcache.prefetch(source, embeds, lookahead=1) as pipeline:
            for batch in pipeline:
                first.append(batch["k"])
    assert first == [0, 1, 2]
    with jaxcache.prefetch(source, embeds, lookahead=1) as pipeline:
        second = [batch["k"] for batch in pipeline]
    assert second and second == list(range(second[0], 8)) and second[0] >= 4


def test_a_batch_the_source_returns_after_close_goes_back_to_it(planner):
    # The thread waits inside the source for batch 3 when the loop leaves;
    # the source returns it after the pipeline closed: the batch goes back,
    # and the next pipeline over the source starts with it.
    cfg = jaxcache.CacheConfig(200, D, 64, policy="lru", optimizer=jaxcache.sgd(0.1))
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg, planner=planner))
    gate, waiting = threading.Event(), threading.Event()

    def batches():
        for k in range(6):
            if k == 3:
                waiting.set()
                gate.wait(30)
            yield {"k": k, "ids": (8 * k + np.arange(8)).reshape(4, 2)}

    source = batches()
    first = []
    with jaxcache.prefetch(source, {"ids": embed}, lookahead=2) as pipeline:
        for batch in pipeline:
            embed(batch["ids"])
            first.append(batch["k"])
            if len(first) == 3:
                assert waiting.wait(30)
                break
    assert first == [0, 1, 2] and pipeline.unstaged == []
    gate.set()
    for thread in (pipeline._thread, pipeline._feeder):
        if thread is not None:
            thread.join(30)
    assert [b["k"] for b in pipeline.unstaged] == [3]
    with jaxcache.prefetch(source, {"ids": embed}, lookahead=2) as pipeline:
        second = [batch["k"] for batch in pipeline]
    assert second == [3, 4, 5]


@pytest.mark.parametrize(("first_lookahead", "second_lookahead"), [(2, 0), (2, 2), (0, 2)])
def test_a_second_pipeline_over_a_cache_another_stages_ahead_is_refused(
    planner, first_lookahead, second_lookahead
):
    # Planned between the first one's batches, its plans would take their
    # rows or wait for them forever (the device planner hung); a first one
    # without look-ahead would release the plans of the second's batches
    # staged ahead, whose rows then went to other ids before their steps.
    # Refused before it changes anything: the first one goes on as if alone.
    cfg = jaxcache.CacheConfig(200, D, 64, policy="lru", optimizer=jaxcache.sgd(0.1))
    batches = [{"ids": (8 * k + np.arange(8)).reshape(4, 2) % 200} for k in range(8)]
    refusal = "staged ahead by another open" if first_lookahead else "iterated by another open"
    runs = []
    for second in (False, True):
        embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg, planner=planner))
        with jaxcache.prefetch(batches, {"ids": embed}, lookahead=first_lookahead) as pipeline:
            for k, batch in enumerate(pipeline):
                embed(batch["ids"])
                if second and k == 2:
                    with pytest.raises(RuntimeError, match=refusal):
                        jaxcache.prefetch(batches, {"ids": embed}, lookahead=second_lookahead)
        with jaxcache.prefetch(batches[:2], {"ids": embed}, lookahead=second_lookahead) as after:
            for batch in after:  # once it closed, a pipeline of its own works
                embed(batch["ids"])
        runs.append((embed.cache.stats.total, embed.cache.planner.resident_ids()))
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("lookahead", [None, 0, 2])
def test_a_batch_lost_between_its_plan_and_its_swap_stops_the_cache(
    planner, lookahead, monkeypatch
):
    # A transfer that fails (the device out of memory, an interrupt) after
    # the batch was planned: its rows never reached the device, though the
    # planner counts them there. Training on read other ids' rows in silence.
    cfg = jaxcache.CacheConfig(100, D, 16, policy="lru", optimizer=jaxcache.sgd(0.1))
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg, planner=planner))
    batches = [{"ids": (5 * k + np.arange(6)).reshape(3, 2) % 100} for k in range(8)]

    def train(batches):
        if lookahead is None:
            for batch in batches:
                embed(embed.prepare(batch["ids"]))
            return
        with jaxcache.prefetch(batches, {"ids": embed}, lookahead=lookahead) as pipeline:
            for batch in pipeline:
                embed(batch["ids"])

    monkeypatch.setattr(jaxcache.EmbeddingCache, "to_device", failing_transfer(3))
    # Closing the pipeline applies the batches staged after it: refused then.
    with pytest.raises(RuntimeError, match=r"RESOURCE_EXHAUSTED|batch 2 was planned but never"):
        train(batches)
    lost = "batch 2 was planned but never applied"
    for refused in (lambda: train(batches[3:]), embed.export):
        with pytest.raises(RuntimeError, match=lost):
            refused()


def _count_step():
    """A step whose loss sums the batch's rows: with sgd(1.0) each row goes
    down by how often the batch holds it, so the rows say which batches
    trained."""

    @nnx.jit
    def step(embed, lookup):
        return jaxcache.nnx.value_and_grad(lambda e, lookup: e(lookup).sum())(embed, lookup)

    return step


def _counted(rows: np.ndarray, batches) -> np.ndarray:
    rows = rows.copy()
    for batch in batches:
        ids, counts = np.unique(batch["ids"], return_counts=True)
        rows[ids] -= counts.astype(rows.dtype)[:, None]  # one update per batch, as on device
    return rows


@pytest.mark.parametrize("lookahead", [None, 0, 2])
def test_a_ctrl_c_waits_for_the_swap_and_training_goes_on_exactly(planner, lookahead, monkeypatch):
    # A Ctrl-C between a batch's plan and its swap left rows the planner
    # counted on the device that never reached it: the cache refused every
    # step until a restore, or (a loop without look-ahead) went on training
    # other ids' rows.
    cfg = jaxcache.CacheConfig(40, D, 16, policy="lru", optimizer=jaxcache.sgd(1.0))
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg, planner=planner))
    first = np.array(embed.cache.table.rows)
    batches = [{"ids": (3 * k + np.arange(4)).reshape(2, 2) % 40} for k in range(12)]
    step, trained = _count_step(), []

    def train(batches):
        if lookahead is None:
            for batch in batches:
                step(embed, embed.prepare(batch["ids"]))
                trained.append(batch)
            return
        with jaxcache.prefetch(batches, {"ids": embed}, lookahead=lookahead) as pipeline:
            for k, batch in enumerate(pipeline):
                step(embed, batch["ids"])  # a Lookup in place of the ids
                trained.append(batches[k])

    apply, swaps = jaxcache.EmbeddingCache.apply, itertools.count()

    def interrupted(self, state, staged):
        if next(swaps) == 5:  # as from the keyboard: the handler runs on the main thread
            signal.raise_signal(signal.SIGINT)
        return apply(self, state, staged)

    monkeypatch.setattr(jaxcache.EmbeddingCache, "apply", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(batches)
    monkeypatch.undo()
    assert len(trained) == 5  # the interrupted batch's step never ran
    np.testing.assert_array_equal(embed.export()[0], _counted(first, trained))
    train(batches[5:])
    assert embed.cache.stats.total.evictions > 10  # rows really moved
    np.testing.assert_array_equal(embed.export()[0], _counted(first, batches[:5] + batches[5:]))


def test_a_held_ctrl_c_comes_at_the_end_and_a_second_at_once():
    from jaxcache._src.lifecycle import interrupts_held

    reached = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held():
            signal.raise_signal(signal.SIGINT)
            reached.append("after the first")
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            reached.append("after the second")
    assert reached == ["after the first"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_while_the_loop_waits_for_a_slow_source_stops_it(planner):
    # The loop waits for the batch held back by its source, with nothing
    # taken: the Ctrl-C must reach it then, not once the source goes on.
    release, resumed = threading.Event(), threading.Event()

    def source():
        for k in range(4):
            if k == 2:
                release.wait(timeout=30)
                resumed.set()
            yield {"ids": np.array([[k, k + 1]])}

    cfg = jaxcache.CacheConfig(100, D, 16, optimizer=jaxcache.sgd(0.1))
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg, planner=planner))
    main = threading.main_thread().ident
    timer = threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT))
    try:
        with pytest.raises(KeyboardInterrupt):
            with jaxcache.prefetch(source(), {"ids": embed}, lookahead=2) as pipeline:
                for k, batch in enumerate(pipeline):
                    embed(batch["ids"])
                    if k == 1:
                        timer.start()
        assert not resumed.is_set()  # the source was still waiting
    finally:
        release.set()
        timer.cancel()


class _Cancelled(BaseException):
    """Not an Exception, as asyncio.CancelledError and SystemExit are not."""


def test_a_source_raising_what_is_not_an_exception_reaches_the_loop(planner):
    # The device planner's feeder thread died of it, and the loop waited forever.
    def source():
        for k in range(3):
            yield {"ids": np.array([[k, k + 1]])}
        raise _Cancelled("stop")

    cfg = jaxcache.CacheConfig(100, D, 16, optimizer=jaxcache.sgd(0.1))
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg, planner=planner))
    stepped = []
    with pytest.raises(_Cancelled, match="stop"):
        with jaxcache.prefetch(source(), {"ids": embed}, lookahead=2) as pipeline:
            for batch in pipeline:
                stepped.append(embed(batch["ids"]).shape)
    assert len(stepped) == 3 and not embed.cache.pipelines


def test_only_the_thread_iterating_a_pipeline_may_close_it(planner):
    # Closing swaps the staged batches in: from another thread, between the
    # loop's steps, batches went in out of order (or the loop, waiting for
    # a slow source, waited forever).
    batches = [{"ids": np.array([[k, k + 1]])} for k in range(6)]
    cfg = jaxcache.CacheConfig(100, D, 16, optimizer=jaxcache.sgd(0.1))
    runs, refused = [], []

    def close_elsewhere(pipeline):
        try:
            pipeline.close()
        except RuntimeError as error:
            refused.append(str(error))

    for other in (False, True):
        embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg, planner=planner))
        with jaxcache.prefetch(batches, {"ids": embed}, lookahead=2) as pipeline:
            for k, batch in enumerate(pipeline):
                embed(batch["ids"])
                if other and k == 1:
                    closer = threading.Thread(target=close_elsewhere, args=(pipeline,))
                    closer.start()
                    closer.join()
        if other:
            assert len(refused) == 1 and "on the thread that iterates it" in refused[0]
        runs.append((embed.cache.stats.total, embed.export()[0]))
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


def test_abandoned_pipeline_does_not_hang_exit(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "abandon.py"
    script.write_text(
        "import numpy as np, jaxcache\n"
        "cfg = jaxcache.CacheConfig(1000, 4, 100)\n"
        "embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg))\n"
        "batches = ({'ids': np.arange(8).reshape(4, 2) + i} for i in range(10**9))\n"
        "p = jaxcache.prefetch(batches, {'ids': embed}, lookahead=2)\n"
        "next(p)\n"
        "print('left')\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "left" in out.stdout


def test_row_evicted_and_needed_again_carries_its_updates():
    # Capacity 3, look-ahead 2, a slow training loop: plan 3 evicts the
    # updated row 0 and plan 4 needs it while plan 3's swap is still queued.
    # The producer leaves that row to the transfer of batch 4, which reads
    # it from plan 3's read-out (or from the host table, if it landed).
    cfg = jaxcache.CacheConfig(10, 4, 3, policy="lru", optimizer=jaxcache.adam(0.1))
    rows0 = np.array(jaxcache.HostTable(cfg, seed=0).rows)
    ids = [[[0]], [[1]], [[2]], [[3]], [[0]], [[1]]]
    batches = [{"ids": np.array(i), "y": np.ones(1, np.float32)} for i in ids]
    cache = jaxcache.EmbeddingCache(cfg, table=jaxcache.HostTable(cfg, seed=0))
    model, train = make_cached(cache, 1)
    with jaxcache.prefetch(batches, {"ids": model.embed}, lookahead=2) as pipeline:
        for b in pipeline:
            train.with_lookup(b["ids"], b["y"]).block_until_ready()
            time.sleep(0.2)  # the producer runs ahead
    reference, ref_train = make_reference(rows0, cfg.optimizer, 1)
    for b in batches:
        ref_train(b["ids"], b["y"])
    rows, state = model.embed.export()
    assert state["count"][0] == 2
    assert np.abs(rows - np.asarray(reference.embed.table[...])).max() <= 1e-6
    assert cache.stats.deferred_fetches >= 1 and cache.stats.write_back_waits == 0


@pytest.mark.parametrize("landed", [False, True])
def test_deferred_rows_come_from_the_read_out_or_the_landed_table(landed):
    # By hand, what the pipeline does: plan 1 evicts the updated rows 0 and 1,
    # plan 2 (staged before plan 1's swap runs) fetches them again. Its
    # transfer reads them from plan 1's read-out, or from the host table
    # when that write-back has landed in between.
    cfg = jaxcache.CacheConfig(100, 2, capacity=2, policy="lru", optimizer=jaxcache.sgd(0.1))
    cache = jaxcache.EmbeddingCache(cfg)
    first = np.array(cache.table.rows[:2])
    state = cache.apply(cache.init_state(), cache.stage(np.array([0, 1])))
    state = state._replace(rows=state.rows + 1.0)  # what a training step would do
    cache.planner.release(0)
    evicting = cache.stage_host(np.array([2, 3]), defer=True)
    cache.planner.release(1)
    refetching = cache.stage_host(np.array([0, 1]), defer=True)
    assert refetching.deferred is not None and refetching.deferred.ids.tolist() == [0, 1]
    with pytest.raises(RuntimeError, match=r"plans \[1\] evicted.*not applied yet"):
        cache.to_device(refetching)  # plan 1's swap has not been applied
    state = cache.apply(state, cache.to_device(evicting))
    if landed:  # as the producer does when it stages the next batch: lands those ready
        jax.block_until_ready(state)
        cache.write_backs.land_ready()
        assert not cache.write_backs.expects(1)
    staged = cache.to_device(refetching)
    # Waiting for plan 1's swap is timed apart from the copy; not once landed.
    # The copy is the training thread's, timed apart from the staging.
    timers = cache.stats.timers
    assert timers.counts["device_wait"] == (0 if landed else 1)
    assert timers.counts["deferred"] == 1 and timers.counts["gather"] == 3
    _, fetch_slots, fetch_rows, _ = staged.moves
    fetched = np.asarray(fetch_rows)[np.asarray(fetch_slots) < cfg.capacity]
    np.testing.assert_array_equal(fetched, first + 1.0)  # the updated rows, not the first ones
    state = cache.apply(state, staged)
    cache.flush(state)
    np.testing.assert_array_equal(cache.table.rows[:2], first + 1.0)


def test_deferred_row_evicted_twice_comes_from_the_later_read_out():
    # By hand, with a capacity of one row and every plan staged before any
    # swap runs: row 0 is evicted by plan 1, fetched back by plan 2, trained,
    # evicted again by plan 3 and fetched by plan 4. Both evictions are
    # pending when plan 4 is staged; its row must be plan 3's read-out.
    cfg = jaxcache.CacheConfig(100, 2, capacity=1, policy="lru", optimizer=jaxcache.sgd(0.1))
    cache = jaxcache.EmbeddingCache(cfg)
    first = np.array(cache.table.rows[0])
    state = cache.apply(cache.init_state(), cache.stage(np.array([0])))
    state = state._replace(rows=state.rows + 1.0)
    staged = []
    for index, ids in enumerate([[1], [0], [1], [0]]):
        cache.planner.release(index)
        staged.append(cache.stage_host(np.array(ids), defer=True))
    assert staged[3].deferred.plans.tolist() == [3]  # not plan 1, which evicted it first
    for host, trained in zip(staged, [1.0, 10.0, 0.0, 0.0], strict=True):
        transferred = cache.to_device(host)
        state = cache.apply(state, transferred)
        state = state._replace(rows=state.rows + trained)  # what a step would do
    _, _, fetch_rows, _ = transferred.moves
    np.testing.assert_array_equal(np.asarray(fetch_rows)[0], first + 11.0)
    cache.flush(state)
    np.testing.assert_array_equal(cache.table.rows[0], first + 11.0)


def test_no_recompilation_with_the_pipeline():
    cfg = jaxcache.CacheConfig(5000, 8, 600, policy="lfu", optimizer=jaxcache.adagrad(0.1))
    cache = jaxcache.EmbeddingCache(cfg)
    model, train = make_cached(cache, 4)
    batches = ({"ids": i, "y": y} for i, y in zipf_batches(5000, 32, 4, 300, seed=3))
    with jaxcache.prefetch(batches, {"ids": model.embed}, lookahead=2) as pipeline:
        for step, b in enumerate(pipeline):
            if step == 60:
                warm = jaxcache.testing.compilations()
            train.with_lookup(b["ids"], b["y"])
    assert jaxcache.testing.compilations() == warm
    timers = cache.stats.timers
    assert timers.counts["plan"] == 300 and timers.counts["wait"] == 301  # + end of data


def test_bad_arguments():
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(jaxcache.CacheConfig(N, D, 50)))
    with pytest.raises(ValueError, match="lookahead=-1 must be an integer >= 0"):
        jaxcache.prefetch([], {"ids": embed}, lookahead=-1)
    with pytest.raises(TypeError, match=r"tables\['ids'\] is a int"):
        jaxcache.prefetch([], {"ids": 3})
    with pytest.raises(ValueError, match="same cache"):
        jaxcache.prefetch([], {"a": embed, "b": embed})
    with pytest.raises(KeyError, match="no ids under 'ids'"):
        next(jaxcache.prefetch([{"x": 1}], {"ids": embed}, lookahead=0))
    with pytest.raises(ValueError, match=r"switch_interval=0 must be a number of seconds"):
        jaxcache.prefetch([], {"ids": embed}, switch_interval=0)


def test_switch_interval_is_lowered_while_the_producer_runs_then_restored():
    embed, other = (
        jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(jaxcache.CacheConfig(N, D, 500)))
        for _ in range(2)
    )
    batches = [{"ids": np.arange(8).reshape(4, 2) + i} for i in range(4)]
    before = sys.getswitchinterval()
    with jaxcache.prefetch(batches, {"ids": embed}, switch_interval=2e-4) as pipeline:
        assert sys.getswitchinterval() == pytest.approx(2e-4)
        # Overlapping pipelines: the smallest interval wins; the last to stop restores.
        second = jaxcache.prefetch(batches, {"ids": other}, switch_interval=1e-4)
        assert sys.getswitchinterval() == pytest.approx(1e-4)
        second.close()
        assert sys.getswitchinterval() == pytest.approx(2e-4)
        assert len(list(pipeline)) == 4  # exhausting it restores it too
        assert sys.getswitchinterval() == before
    assert sys.getswitchinterval() == before
    with jaxcache.prefetch(batches, {"ids": embed}, switch_interval=None):
        assert sys.getswitchinterval() == before
    with jaxcache.prefetch(batches, {"ids": embed}, lookahead=0):  # no thread, no change
        assert sys.getswitchinterval() == before


@pytest.mark.host_planner
@pytest.mark.parametrize("lookahead", [0, 2])
@pytest.mark.parametrize("tight", [False, True], ids=["batch-sized", "tight"])
def test_host_callback_form_matches_prepared_slots(lookahead, tight):
    batches = _batches(16, seed=7)
    # Tight: the lists padded to the most distinct ids of a batch, not its ids.
    rows = max(np.unique(b["ids"]).size for b in batches) if tight else None
    assert not tight or rows < B * F
    cfg = jaxcache.CacheConfig(
        N, D, 300, policy="lfu", optimizer=jaxcache.adagrad(0.2), callback_rows=rows
    )
    cache = jaxcache.EmbeddingCache(cfg, table=jaxcache.HostTable(cfg, seed=1))
    model, optimizer, step = make_callback(cache, F)
    with jaxcache.prefetch(
        batches, {"ids": model.embed}, lookahead=lookahead, callback=True
    ) as pipeline:
        losses = [np.asarray(step(model, optimizer, b["ids"], b["y"])) for b in pipeline]
    _, _, base_losses, base_rows, base_state = _train("lfu", 300, 0, batches)
    rows, state = model.embed.export()
    assert cache.stats.total.evictions > 100
    if lookahead:
        # Rows evicted by a batch not yet stepped are read by the stage
        # callback of the step that needs them: the producer never waits.
        assert cache.stats.deferred_fetches > 0 and cache.stats.write_back_waits == 0
    np.testing.assert_array_equal(rows, base_rows)
    np.testing.assert_array_equal(state["accumulator"], base_state["accumulator"])
    np.testing.assert_array_equal(np.array(losses), np.array(base_losses))


@pytest.mark.host_planner
def test_host_callback_step_over_other_ids_is_refused_and_the_batch_then_trains():
    # A step given ids other than the batch the pipeline staged is refused
    # before it takes that batch: the step over the right ids then trains
    # it, and the run equals one that never made the mistake.
    batches = _batches(12, seed=9)
    cfg = jaxcache.CacheConfig(N, D, 200, policy="lru", optimizer=jaxcache.adagrad(0.2))

    def run(mistake):
        cache = jaxcache.EmbeddingCache(cfg, table=jaxcache.HostTable(cfg, seed=1))
        model, optimizer, step = make_callback(cache, F)
        losses = []
        with jaxcache.prefetch(batches, {"ids": model.embed}, lookahead=1, callback=True) as p:
            for i, b in enumerate(p):
                if mistake and i == 4:
                    with pytest.raises(Exception, match="differ from the batch"):
                        np.asarray(step(model, optimizer, (b["ids"] + 1) % N, b["y"]))
                losses.append(np.asarray(step(model, optimizer, b["ids"], b["y"])))
        assert cache.stats.total.evictions > 50
        return np.array(losses), model.embed.export()

    (losses, (rows, state)), (base_losses, (base_rows, base_state)) = run(True), run(False)
    np.testing.assert_array_equal(losses, base_losses)
    np.testing.assert_array_equal(rows, base_rows)
    np.testing.assert_array_equal(state["accumulator"], base_state["accumulator"])


@pytest.mark.host_planner
def test_host_callback_refuses_a_batch_over_callback_rows():
    cfg = jaxcache.CacheConfig(N, D, 300, optimizer=jaxcache.sgd(0.1), callback_rows=5)
    cache = jaxcache.EmbeddingCache(cfg)
    model, optimizer, step = make_callback(cache, F)
    ids = np.array([[1, 2, 3, 1], [4, 5, 6, 2]])  # 6 distinct ids
    with pytest.raises(ValueError, match=r"6 distinct ids.*callback_rows=5.*at least 6"):
        cache.callbacks.stage(ids)
    with pytest.raises(Exception, match=r"callback_rows=5.*at least 6"):
        step(model, optimizer, ids, np.zeros(2, np.float32)).block_until_ready()
    # Refused before anything changed: no plan, no resident row, no statistics.
    assert cache.planner.next_index == 0 and cache.stats.steps == 0
    assert (cache.planner.id_of_slot == -1).all()
    np.testing.assert_array_equal(  # and a batch that fits trains
        cache.callbacks.stage(ids[:, :2])[0], 0
    )


@pytest.mark.host_planner
def test_host_callback_form_refuses_a_lookup_for_ids():
    # A batch prefetched without callback=True holds a Lookup, not ids.
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(jaxcache.CacheConfig(N, D, 300)))
    lookup = embed.prepare(np.array([[1, 2]]))
    with pytest.raises(TypeError, match=r"lookup_ids takes a batch's ids, got a Lookup"):
        embed.lookup_ids(lookup)


@pytest.mark.host_planner
def test_host_callback_form_is_refused_on_one_cpu_core(monkeypatch):
    # On one core the step can hang in its callbacks (the engine's docstring
    # says why), so both entries into the host-callback form refuse before
    # anything is planned or started.
    cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(N, D, 300, optimizer=jaxcache.sgd(0.1)))
    model, optimizer, step = make_callback(cache, F)
    batches = _batches(4, seed=3)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    threads = set(threading.enumerate())
    message = r"needs at least 2 CPU cores .* may run on 1: .*without callback=True"
    with pytest.raises(RuntimeError, match=message):
        jaxcache.prefetch(batches, {"ids": model.embed}, lookahead=2, callback=True)
    with pytest.raises(RuntimeError, match=message):
        step(model, optimizer, batches[0]["ids"], batches[0]["y"])
    assert set(threading.enumerate()) == threads
    assert cache.planner.next_index == 0 and cache.stats.steps == 0
    with jaxcache.prefetch(batches, {"ids": model.embed}, lookahead=2) as pipeline:
        assert len(list(pipeline)) == 4  # the prefetched-slots path still runs
    monkeypatch.undo()  # two cores again: the callback form trains
    cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(N, D, 300, optimizer=jaxcache.sgd(0.1)))
    model, optimizer, step = make_callback(cache, F)
    assert np.isfinite(step(model, optimizer, batches[0]["ids"], batches[0]["y"]))


@pytest.mark.host_planner
def test_host_callbacks_outlive_a_temporary_cache():
    # The callbacks hold the stager and the plans, not the cache: asking a
    # cache made in the same expression for them must not fail later.
    callbacks = jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, capacity=8)).callbacks
    import gc

    gc.collect()
    assert callbacks.size(10) == 10


@pytest.mark.host_planner
def test_host_callback_reads_a_deferred_row_that_a_later_plan_evicts_again():
    # The callback form releases a batch when its step is dispatched; the step's
    # callbacks run later. Here, by hand: batch 2 fetches A and B, which batch 1
    # evicted (deferred: batch 1's step has not run), and batch 3, planned after
    # batch 2's release, evicts them again before batch 2's step runs. Batch 2's
    # stage callback must read the values batch 1's write-back landed.
    cfg = jaxcache.CacheConfig(100, 2, capacity=4, policy="lru", optimizer=jaxcache.sgd(0.1))
    cache = jaxcache.EmbeddingCache(cfg)
    a_b, c_to_f = np.array([[10, 11]]), np.array([[20, 21, 22, 23]])

    def stage(ids):  # what the producer does, then the loop's release
        host = cache.stage_host(ids, size=ids.size, defer=True)
        cache.callbacks.offer(host)
        cache.planner.release(host.plan.index)
        return host

    def run_step(ids, written_back):  # the step's two callbacks, in order
        index, *_, fetch, rows, _ = cache.callbacks.stage(ids)
        evicted = cache.write_backs.ids_of(int(index))
        evicted = np.zeros(0, np.int64) if evicted is None else evicted
        marks = np.stack([written_back.get(int(i), np.zeros(2)) for i in evicted] or [[0, 0]])
        cache.callbacks.write_back(index, marks.astype(np.float32), {})
        return fetch, rows

    stage(a_b)
    run_step(a_b, {})
    stage(c_to_f)  # evicts A and B
    second = stage(a_b)  # A and B wait for batch 1's write-back
    assert second.deferred is not None and sorted(second.deferred[0]) == [10, 11]
    stage(c_to_f)  # evicts A and B again, before batch 2's step
    assert any(10 in cache.write_backs.ids_of(i) for i in cache.write_backs.busy())
    run_step(c_to_f, {10: np.array([1.0, 1.5]), 11: np.array([2.0, 2.5])})
    fetch, rows = run_step(a_b, {})
    fetched = rows[fetch < cfg.capacity]
    np.testing.assert_array_equal(
        sorted(fetched.tolist()), [[1.0, 1.5], [2.0, 2.5]]
    )  # batch 1's write-back, not the table's first values


@pytest.mark.host_planner
def test_host_callback_pipeline_closed_early_applies_staged_batches():
    batches = _batches(30, seed=8)
    cfg = jaxcache.CacheConfig(N, D, 600, policy="lru", optimizer=jaxcache.sgd(0.5))
    cache = jaxcache.EmbeddingCache(cfg)
    model, optimizer, step = make_callback(cache, F)
    with jaxcache.prefetch(batches, {"ids": model.embed}, lookahead=3, callback=True) as p:
        for i, b in enumerate(p):
            if i == 4:
                break  # handed out, never stepped
            step(model, optimizer, b["ids"], b["y"])
    assert cache.callbacks.take() == []
    rows, _ = model.embed.export()
    slots = np.flatnonzero(cache.planner.id_of_slot >= 0)
    np.testing.assert_array_equal(
        np.asarray(model.embed.rows[...])[slots], rows[cache.planner.id_of_slot[slots]]
    )


def test_flush_refuses_while_staged_batches_are_not_applied():
    cfg = jaxcache.CacheConfig(N, D, 200, optimizer=jaxcache.sgd(0.5))
    cache = jaxcache.EmbeddingCache(cfg)
    state = cache.init_state()
    before = np.array(cache.table.rows)
    staged = cache.stage(np.arange(20).reshape(10, 2))  # planned, not applied
    with pytest.raises(RuntimeError, match="staged but not applied"):
        cache.flush(state)
    np.testing.assert_array_equal(cache.table.rows, before)  # nothing overwritten
    state = cache.apply(state, staged)
    cache.flush(state)
    np.testing.assert_array_equal(cache.table.rows, before)


def test_flush_keeps_rows_of_batches_in_flight_dirty():
    cfg = jaxcache.CacheConfig(N, D, 200, optimizer=jaxcache.sgd(0.5))
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg))
    lookup = embed.prepare(np.array([[1, 2]]))
    embed.flush()  # before the step that will update rows 1 and 2
    grads = np.ones((1, lookup.received, D), np.float32)
    embed.apply_gradients(lookup, grads)
    rows, _ = embed.export()
    initial = jaxcache.HostTable(cfg, seed=0).rows
    np.testing.assert_allclose(rows[1], initial[1] - 0.5)  # the update was not lost


def test_plans_do_not_depend_on_thread_timing():
    """Every process of a multi-process run plans the same batches and must
    choose the same slots: the plans may not depend on how far the loop got."""

    def run(slow_source):
        def source():
            rng = np.random.default_rng(1)
            for _ in range(30):
                if slow_source:  # the loop releases each step before the next plan
                    time.sleep(0.004)
                yield {"ids": rng.zipf(1.3, size=(8, 6)) % 400}

        # Static priorities: rows of the last batch are often the rarest, so
        # whether its plan counts as finished changes the victims.
        frequencies = np.random.default_rng(2).integers(0, 1000, 400)
        cfg = jaxcache.CacheConfig(400, 4, 96, policy="frequency")
        cache = jaxcache.EmbeddingCache(cfg, frequencies=frequencies)
        embed = jaxcache.nnx.CachedEmbed(cache)
        with jaxcache.prefetch(source(), {"ids": embed}, lookahead=1) as pipeline:
            for batch in pipeline:
                embed(batch["ids"])
                if not slow_source:  # the producer plans ahead of every release
                    time.sleep(0.004)
        return cache.planner.id_of_slot.copy(), cache.stats.total

    fast_slots, fast_stats = run(slow_source=False)
    slow_slots, slow_stats = run(slow_source=True)
    assert fast_stats.evictions > 50  # heavy churn: victims are chosen every step
    assert fast_stats == slow_stats
    np.testing.assert_array_equal(fast_slots, slow_slots)


def test_a_pipeline_dropped_without_closing_can_be_closed_through_its_table(planner):
    # A for-loop left by break does not close its iterator, and the
    # pipeline's threads keep it alive: the table stays held, and every
    # refusal says how to close a pipeline the caller no longer holds.
    cfg = jaxcache.CacheConfig(200, D, 32, policy="lru", optimizer=jaxcache.sgd(0.1))
    batches = [{"ids": (8 * k + np.arange(8)).reshape(4, 2) % 200} for k in range(8)]
    runs = []
    for dropped in (False, True):
        embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg, planner=planner))
        pipeline = jaxcache.prefetch(iter(batches[:4]), {"ids": embed}, lookahead=2)
        for k, batch in enumerate(pipeline):
            embed(batch["ids"])
            if k == 1:
                break
        if dropped:
            del pipeline
            hint = re.escape("for p in cache.pipelines: p.close()")
            with pytest.raises(RuntimeError, match=hint):
                jaxcache.prefetch(batches[4:], {"ids": embed}, lookahead=2)
            with pytest.raises(RuntimeError, match=hint):
                embed.prepare(batches[4]["ids"])
            for open_pipeline in embed.cache.pipelines:
                open_pipeline.close()
        else:
            pipeline.close()
        assert not embed.cache.pipelines
        with jaxcache.prefetch(batches[4:], {"ids": embed}, lookahead=2) as after:
            for batch in after:
                embed(batch["ids"])
        runs.append(embed.export()[0])
    np.testing.assert_array_equal(runs[0], runs[1])
