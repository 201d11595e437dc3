"""Serving: read-only tables from a checkpoint score like the trained model, write nothing back."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import jaxcache

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = jaxcache.synthetic.SyntheticCriteo(scale=0.0003, batch_size=32, seed=2)


def _dlrm(cache):
    embed = jaxcache.nnx.CachedEmbed(cache)
    model = jaxcache.models.DLRM(
        embed, num_sparse=DATA.num_features, features=8, bottom=(16,), top=(16,), rngs=nnx.Rngs(0)
    )
    return embed, model


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A DLRM trained through an LFU cache, its eval scores, and its checkpoint."""
    config = jaxcache.CacheConfig(
        DATA.num_embeddings,
        8,
        capacity=0.1,
        policy="lfu",
        optimizer=jaxcache.rowwise_adagrad(0.05),
    )
    embed, model = _dlrm(jaxcache.EmbeddingCache(config))
    optimizer, step = jaxcache.models.make_train_step(
        model, jaxcache.models.dense_optimizer("adagrad", 0.05)
    )
    with jaxcache.prefetch(DATA.batches(30), {"sparse": embed}, lookahead=2) as pipeline:
        for batch in pipeline:
            step(batch["dense"], batch["sparse"], batch["label"])
    directory = tmp_path_factory.mktemp("ckpt")
    jaxcache.Checkpointer(directory).save(30, model=model, optimizer=optimizer)
    planner = embed.cache.planner
    saved = planner.policy_state()["counts"], planner.resident_ids()
    model.eval()
    predict = jaxcache.models.make_predict_step(model)
    held_out = list(DATA.batches(6, held_out=True))
    scores = [
        np.asarray(predict(b["dense"], embed.prepare(b["sparse"], train=False))) for b in held_out
    ]
    return directory, held_out, scores, saved


@pytest.mark.parametrize("capacity", [0.05, 0.2])
def test_serving_scores_equal_the_trained_models(trained, capacity):
    directory, held_out, expected, (saved_counts, was) = trained
    checkpointer = jaxcache.Checkpointer(directory, read_only=True)
    config = jaxcache.serving_config(checkpointer.cache_config(), capacity=capacity)
    embed, model = _dlrm(jaxcache.EmbeddingCache(config))
    checkpointer.restore(model=model)
    assert embed.get_state().opt == {}  # no optimizer state on device
    assert embed.cache.table.state == {}  # nor on the host
    # Preloaded by frequency: the hottest of the training cache's resident rows.
    counts = embed.cache.planner.policy_state()["counts"]
    np.testing.assert_array_equal(counts, saved_counts)
    resident = embed.cache.planner.resident_ids()
    assert resident.size == min(config.capacity, np.count_nonzero(counts))
    left_out = was[~np.isin(was, resident)]
    if left_out.size:
        assert counts[resident[np.isin(resident, was)]].min() >= counts[left_out].max()
    predict = jaxcache.models.make_predict_step(model)
    server = jaxcache.Server(
        model, lambda b: predict(b["dense"], b["sparse"]), {"sparse": embed}, lookahead=2
    )
    scores = list(server.score(held_out))
    for got, want in zip(scores, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    summary = server.summary()
    assert summary["batches"] == len(held_out) and summary["hit_rate"] > 0.3
    assert summary["bytes_to_host"] == 0 and embed.cache.stats.total.rows_to_host == 0
    assert summary["p50_ms"] <= summary["p90_ms"] <= summary["p99_ms"]
    # One cache serves every request: the next request starts from the rows
    # the last one left, not from a fresh cache.
    resident = set(embed.cache.planner.resident_ids().tolist())
    ids = set(np.asarray(held_out[0]["sparse"]).reshape(-1).tolist())
    list(server.score(held_out[:1]))
    assert embed.cache.stats.last.hits == len(ids & resident)
    assert embed.cache.stats.bytes_to_host == 0


def test_serving_tables_are_read_only(trained):
    directory, held_out, _, _ = trained
    checkpointer = jaxcache.Checkpointer(directory, read_only=True)
    training = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(checkpointer.cache_config()))
    with pytest.raises(ValueError, match="not a serving table"):
        jaxcache.Server(training, lambda b: b, {"sparse": training})
    config = jaxcache.serving_config(checkpointer.cache_config())
    embed, model = _dlrm(jaxcache.EmbeddingCache(config))
    checkpointer.restore(model=model)
    _, step = jaxcache.models.make_train_step(model, jaxcache.models.dense_optimizer("adam", 0.1))
    batch = held_out[0]
    with pytest.raises(TypeError, match="read-only"):
        step(batch["dense"], embed.prepare(batch["sparse"]), batch["label"])
    with pytest.raises(RuntimeError, match="read-only"):
        checkpointer.save(99, model=model)


def test_a_read_only_table_plans_every_batch_as_an_evaluation(trained, planner):
    # prepare defaults to train=True: on a read-only table no row can change,
    # so none may be marked dirty and written back as it leaves the cache.
    directory, held_out, expected, _ = trained
    checkpointer = jaxcache.Checkpointer(directory, read_only=True)
    config = jaxcache.serving_config(checkpointer.cache_config(), capacity=0.05)
    embed, model = _dlrm(jaxcache.EmbeddingCache(config))
    checkpointer.restore(model=model)
    predict = jaxcache.models.make_predict_step(model)
    for _ in range(2):  # the second pass evicts the rows of the first
        for batch, want in zip(held_out, expected, strict=True):
            np.testing.assert_array_equal(
                predict(batch["dense"], embed.prepare(batch["sparse"])), want
            )
        with jaxcache.prefetch(held_out, {"sparse": embed}, lookahead=2) as pipeline:
            for batch, want in zip(pipeline, expected, strict=True):
                np.testing.assert_array_equal(predict(batch["dense"], batch["sparse"]), want)
    embed.flush()
    assert embed.cache.stats.total.evictions > 0
    assert embed.cache.stats.total.rows_to_host == 0 and embed.cache.stats.bytes_to_host == 0


def test_a_server_keeps_the_latest_latencies():
    cfg = jaxcache.serving_config(jaxcache.CacheConfig(100, 4, capacity=16))
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg), combiner="sum")
    for window in (0, 2.5, True):
        with pytest.raises(ValueError, match=f"latency_window={window!r}: pass how many"):
            jaxcache.Server(embed, lambda b: b, {"ids": embed}, latency_window=window)
    server = jaxcache.Server(
        embed, lambda b: embed(b["ids"]).sum(-1), {"ids": embed}, latency_window=3
    )
    batches = [{"ids": np.array([[i, i + 1], [i + 2, i + 3]])} for i in range(5)]
    assert len(list(server.score(batches))) == 5
    assert len(server.latencies) == 3 and server.summary()["batches"] == 3
    assert server.summary()["hit_rate"] == 12 / 20  # the first sight of each id missed
    # After a warm-up, reset: the figures count the batches since, whose ids
    # (1..7, all resident by now) all hit.
    server.reset()
    assert server.summary()["batches"] == 0
    list(server.score(batches[1:3]))
    assert server.summary()["batches"] == 2 and server.summary()["hit_rate"] == 1.0


@pytest.mark.parametrize("lookahead", [0, 2])
def test_a_server_scores_one_stream_at_a_time(lookahead):
    # Two streams planning over the same caches at once would read each
    # other's rows: a second one is refused while the first runs, and once
    # it is closed (or ran to its end) the next one scores as if alone.
    cfg = jaxcache.serving_config(jaxcache.CacheConfig(100, 4, capacity=16))
    rows = np.arange(400, dtype=np.float32).reshape(100, 4)
    cache = jaxcache.EmbeddingCache(cfg, table=jaxcache.HostTable(cfg, rows=rows))
    embed = jaxcache.nnx.CachedEmbed(cache, combiner="sum")
    server = jaxcache.Server(
        embed, lambda b: embed(b["ids"]).sum(-1), {"ids": embed}, lookahead=lookahead
    )
    batches = [{"ids": np.array([[i, i + 1], [i + 2, i + 3]])} for i in range(0, 40, 4)]
    expected = [rows[b["ids"]].sum((1, 2)) for b in batches]
    first = server.score(batches)
    np.testing.assert_array_equal(next(first), expected[0])
    with pytest.raises(RuntimeError, match=r"Server.score is already running"):
        next(server.score(batches))
    first.close()
    for got, want in zip(server.score(batches), expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_serve_example_runs_with_no_arguments():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "serve.py"), "--batches", "20"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"p50_ms", "p90_ms", "p99_ms", "hit_rate", "auc"} <= set(result)
    assert result["batches"] == 20 and result["bytes_to_host"] == 0
    assert result["optimizer_state_on_device"] == []
    assert 0 < result["hit_rate"] < 1 and result["p50_ms"] <= result["p99_ms"]


def test_serving_raw_ids_scores_like_the_trained_model(tmp_path, planner):
    # Raw ids through a vocabulary of 1,200 rows for the stream's 1,708 ids:
    # the server restores the vocabulary, admits nothing, and unknown ids
    # read zeros, as they do in the trained model's evaluation. With either
    # planner (the device planner is the default on accelerators).
    def raw(batch):
        sparse = (batch["sparse"].astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)
        return {**batch, "sparse": sparse}

    config = jaxcache.CacheConfig(
        1200,
        8,
        capacity=0.4,
        optimizer=jaxcache.rowwise_adagrad(0.05),
        vocabulary=jaxcache.DynamicVocabulary(forget="lfu"),
    )
    embed, model = _dlrm(jaxcache.EmbeddingCache(config))
    optimizer, step = jaxcache.models.make_train_step(
        model, jaxcache.models.dense_optimizer("adagrad", 0.05)
    )
    batches = [raw(b) for b in DATA.batches(30)]
    with jaxcache.prefetch(batches, {"sparse": embed}, lookahead=2) as pipeline:
        for batch in pipeline:
            step(batch["dense"], batch["sparse"], batch["label"])
    assert embed.cache.stats.total.forgotten_ids > 0
    jaxcache.Checkpointer(tmp_path).save(30, model=model, optimizer=optimizer)
    model.eval()
    predict = jaxcache.models.make_predict_step(model)
    held_out = [raw(b) for b in DATA.batches(6, held_out=True)]
    live = embed.cache.vocabulary.size
    expected = [
        np.asarray(predict(b["dense"], embed.prepare(b["sparse"], train=False))) for b in held_out
    ]
    assert embed.cache.stats.last.refused_lookups > 0  # ids the model never kept
    assert embed.cache.vocabulary.size == live  # evaluation admits nothing

    checkpointer = jaxcache.Checkpointer(tmp_path, read_only=True)
    served = jaxcache.serving_config(checkpointer.cache_config(), capacity=0.25)
    served_embed, served_model = _dlrm(jaxcache.EmbeddingCache(served))
    checkpointer.restore(model=served_model)
    assert served_embed.cache.vocabulary.size == live
    served_predict = jaxcache.models.make_predict_step(served_model)
    server = jaxcache.Server(
        served_model,
        lambda b: served_predict(b["dense"], b["sparse"]),
        {"sparse": served_embed},
    )
    for got, want in zip(server.score(held_out), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert served_embed.cache.vocabulary.size == live
    assert served_embed.cache.stats.total.new_ids == 0
    assert served_embed.cache.stats.total.rows_to_host == 0


def test_batch_sizes_bound_the_shapes_and_keep_the_scores(trained):
    directory, held_out, expected, _ = trained
    checkpointer = jaxcache.Checkpointer(directory, read_only=True)
    embed, model = _dlrm(
        jaxcache.EmbeddingCache(jaxcache.serving_config(checkpointer.cache_config()))
    )
    checkpointer.restore(model=model)
    predict = jaxcache.models.make_predict_step(model)
    shapes = set()

    def scored(batch):
        shapes.add(batch["dense"].shape[0])
        return predict(batch["dense"], batch["sparse"])

    server = jaxcache.Server(model, scored, {"sparse": embed}, batch_sizes=[16, 8, 8])
    assert server.batch_sizes == (8, 16)
    every = {k: np.concatenate([b[k] for b in held_out]) for k in ("dense", "sparse", "label")}
    want = np.concatenate(expected)
    cuts = np.cumsum([1, 5, 8, 16, 27, 35])  # sizes below, at and above the largest
    requests = [
        {k: v[a:b] for k, v in every.items()} for a, b in zip([0, *cuts[:-1]], cuts, strict=True)
    ]
    got = list(server.score(requests))
    assert [len(s) for s in got] == [1, 5, 8, 16, 27, 35]
    np.testing.assert_allclose(np.concatenate(got), want[: cuts[-1]], rtol=1e-6, atol=1e-7)
    assert shapes == {8, 16} and server.summary()["batches"] == len(requests)
    # Repeated samples add no distinct id: the cache saw the request's own ids.
    assert embed.cache.stats.last.distinct == len(np.unique(requests[-1]["sparse"][32:]))


def test_batch_sizes_refuse_what_they_cannot_pad(trained):
    directory, held_out, _, _ = trained
    checkpointer = jaxcache.Checkpointer(directory, read_only=True)
    embed, model = _dlrm(
        jaxcache.EmbeddingCache(jaxcache.serving_config(checkpointer.cache_config()))
    )
    for sizes in ([], [0, 8], [2.5]):
        with pytest.raises(ValueError, match=r"batch_sizes=.*whole numbers of at least 1"):
            jaxcache.Server(model, lambda b: b, {"sparse": embed}, batch_sizes=sizes)
    predict = jaxcache.models.make_predict_step(model)
    server = jaxcache.Server(
        model, lambda b: predict(b["dense"], b["sparse"]), {"sparse": embed}, batch_sizes=[8]
    )
    batch = dict(held_out[0], dense=held_out[0]["dense"][:5])
    with pytest.raises(
        ValueError, match=r"batch\['dense'\] has 5 entries along axis 0 but the batch has 32"
    ):
        list(server.score([batch]))
    summing = jaxcache.Server(
        model, lambda b: predict(b["dense"], b["sparse"]).sum(), {"sparse": embed}, batch_sizes=[8]
    )
    with pytest.raises(ValueError, match=r"scores of shape \(\) for a batch of 8 samples"):
        list(summing.score(held_out[:1]))
    # The server scores again after a refused batch.
    assert len(next(server.score(held_out[:1]))) == 32
    # A size the devices cannot split is refused when the server is built,
    # not at the first request that pads to it (naming a shape of its own).
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("rows",))
    cfg = jaxcache.serving_config(jaxcache.CacheConfig(100, 4, capacity=16))
    split = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg, mesh=mesh))
    with pytest.raises(ValueError, match=r"over 4 devices.*multiple of 4; \[6\] is not"):
        jaxcache.Server(split, lambda b: b, {"ids": split}, batch_sizes=[4, 6, 8])
