"""Raw ids through a dynamic vocabulary equal a dict reference over the whole table."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import jaxcache
from tests.models import dense_params, make_cached, make_raw_reference

D, B, F = 8, 32, 4
PAD = 7  # a raw padding id (any int64 may be one)
OPTIMIZERS = {
    "sgd": jaxcache.sgd(0.2),
    "adagrad": jaxcache.adagrad(0.2),
    "rowwise_adagrad": jaxcache.rowwise_adagrad(0.2),
    "adam": jaxcache.adam(0.02),
}


def raw_batches(steps, *, universe=1500, alpha=1.05, seed=0, padding=0.1):
    """Skewed batches ``[B, F]`` of raw int64 ids drawn from ``universe`` ids
    anywhere in int64, a share of them padding, and labels."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(-(1 << 62), 1 << 62, universe)
    ids[ids == PAD] += 1
    p = 1.0 / np.arange(1, universe + 1) ** alpha
    p /= p.sum()
    for _ in range(steps):
        batch = ids[rng.choice(universe, size=(B, F), p=p)]
        batch[rng.random((B, F)) < padding] = PAD
        yield batch, (rng.random(B) < 0.5).astype(np.float32)


def drift_batches(steps, *, window=150, shift=30, seed=0):
    """Batches ``[B, F]`` of raw ids drawn from a window of ``window`` ids
    that moves on by ``shift`` a batch, and labels: ids popular a while ago
    never come back, so lookups counted then only keep stale ids."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(-(1 << 62), 1 << 62, window + steps * shift)
    ids[ids == PAD] += 1
    for t in range(steps):
        batch = rng.choice(ids[t * shift : t * shift + window], (B, F))
        yield batch, (rng.random(B) < 0.5).astype(np.float32)


def config(rows, capacity, opt, **vocabulary):
    # Budgets here are tight: only the rows of batches in flight are held
    # (``run_both`` raises ``protect`` to its look-ahead), unless a test
    # says otherwise.
    vocabulary.setdefault("protect", 0)
    return jaxcache.CacheConfig(
        rows,
        D,
        capacity,
        policy=vocabulary.pop("policy", "adaptive"),
        optimizer=opt,
        padding_id=PAD,
        vocabulary=jaxcache.DynamicVocabulary(**vocabulary),
    )


def run_both(
    cfg,
    *,
    steps=14,
    lookahead=0,
    mesh=None,
    seed=0,
    table=None,
    planner="host",
    combiner=None,
    stream=raw_batches,
):
    batches = [{"ids": i, "y": y} for i, y in stream(steps, seed=seed)]
    if cfg.vocabulary.protect < lookahead:
        cfg = dataclasses.replace(
            cfg, vocabulary=dataclasses.replace(cfg.vocabulary, protect=lookahead)
        )
    table = jaxcache.HostTable(cfg, seed=3) if table is None else table
    features = F if combiner is None else 1  # one pooled bag a sample
    reference, ref_train, vocab = make_raw_reference(
        np.array(table.rows), cfg, features, lookahead=lookahead, combiner=combiner
    )
    cache = jaxcache.EmbeddingCache(cfg, table=table, mesh=mesh, planner=planner)
    model, train = make_cached(cache, features, combiner=combiner)
    with jaxcache.prefetch(batches, {"ids": model.embed}, lookahead=lookahead) as pipeline:
        losses = [float(train.with_lookup(b["ids"], b["y"])) for b in pipeline]
    ref_losses = [float(ref_train(b["ids"], b["y"])) for b in batches]
    return cache, model, reference, vocab, losses, ref_losses


def assert_same(cache, model, reference, vocab, losses, ref_losses):
    rows, state = model.embed.export()
    np.testing.assert_allclose(rows, reference.embed.table[...], rtol=0, atol=1e-6)
    ref_state = reference.embed.opt_state.get_value()
    for name in state:
        np.testing.assert_allclose(state[name], ref_state[name], rtol=0, atol=1e-6)
    for a, b in zip(dense_params(model), dense_params(reference), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-6)
    # The same ids hold the same rows as in the dict model.
    live = np.array(list(vocab.row_of), np.int64)
    assert cache.vocabulary.lookup(live).tolist() == [vocab.row_of[i] for i in live.tolist()]
    assert cache.vocabulary.size == len(vocab.row_of)


@pytest.mark.parametrize(
    ("opt_name", "planned_by"),
    [(name, "host") for name in sorted(OPTIMIZERS)] + [("adagrad", "device"), ("adam", "device")],
)
def test_raw_ids_under_churn_match_the_dict_reference(opt_name, planned_by):
    # 300 rows for ~1,000 distinct ids and 130 slots for ~100 a batch: the
    # budget forgets ids and the device cache evicts rows every step.
    cfg = config(300, 130, OPTIMIZERS[opt_name])
    run = run_both(cfg, planner=planned_by)
    cache = run[0]
    total = cache.stats.total
    assert total.forgotten_ids > 100 and total.rows_to_host > 100
    assert total.new_ids > cfg.num_embeddings
    assert_same(*run)


@pytest.mark.parametrize(
    ("lookahead", "rows", "vocabulary"),
    [
        (1, 320, {"forget": "lrfu", "bonus": 4, "policy": "lru"}),
        # One bucket of 120 rows: as tight as the batches in flight allow.
        (2, 120, {"admit_after": 2, "init": "uniform", "scale": 0.5, "policy": "lfu", "ways": 128}),
    ],
)
def test_pipelined_raw_ids_match_the_dict_reference(lookahead, rows, vocabulary, planner):
    # Rows of the batches in flight are held: the budget leaves room for them.
    cfg = config(rows, min(rows, 130 * (lookahead + 1) + 10), OPTIMIZERS["adam"], **vocabulary)
    run = run_both(cfg, lookahead=lookahead, steps=20, planner=planner)
    total = run[0].stats.total
    assert total.forgotten_ids > 30
    if vocabulary.get("admit_after", 1) > 1:
        assert total.refused_lookups > 100
    assert_same(*run)


def test_ids_unused_for_ttl_steps_are_forgotten_as_in_the_dict_reference(planner):
    # A budget with room to spare: only the time-to-live forgets ids, and
    # their rows count as free.
    cfg = config(1500, 150, OPTIMIZERS["rowwise_adagrad"], policy="lfu", forget="lrfu", ttl=3)
    run = run_both(cfg, lookahead=1, planner=planner)
    total = run[0].stats.total
    assert total.forgotten_ids > 100 and run[0].vocabulary.size < 600
    assert_same(*run)


@pytest.mark.parametrize(
    ("stream", "rows", "lookahead", "devices"),
    [(raw_batches, 300, 0, 1), (drift_batches, 200, 1, 1), (drift_batches, 256, 0, 4)],
)
def test_a_learned_bonus_forgets_as_the_dict_reference(stream, rows, lookahead, devices, planner):
    # forget="adaptive": the bonus each plan forgets by is learned from the
    # batches before it. Where popularity drifts, lookups counted earlier
    # only keep stale ids: the learner leaves the starting bonus for LRU's
    # within a few batches.
    mesh = Mesh(np.array(jax.devices()[:devices]), ("rows",))
    capacity = min(rows, 130 * (lookahead + 1) + 10)
    cfg = config(rows, capacity, OPTIMIZERS["adam"], forget="adaptive")
    cfg = dataclasses.replace(cfg, min_bucket=8)
    run = run_both(cfg, steps=16, lookahead=lookahead, mesh=mesh, planner=planner, stream=stream)
    cache, learner = run[0], run[3].learner
    assert cache.stats.total.forgotten_ids > 100
    if stream is drift_batches:
        assert learner.bonus == 0
    assert cache.vocabulary.bonus == learner.bonus
    assert_same(*run)


def test_raw_ids_over_eight_devices_match_the_dict_reference(planner):
    mesh = Mesh(np.array(jax.devices()[:8]), ("rows",))
    # Small lists: ids refused by admission leave holes among a device's
    # distinct ids, which the lists cut to the batch's size must keep.
    cfg = config(128, 100, OPTIMIZERS["rowwise_adagrad"], forget="lfu", admit_after=2, ways=16)
    cfg = dataclasses.replace(cfg, min_bucket=8)
    run = run_both(cfg, lookahead=1, mesh=mesh, steps=12, planner=planner)
    total = run[0].stats.total
    assert total.forgotten_ids > 20 and total.refused_lookups > 100, total
    assert_same(*run)


@pytest.mark.parametrize(
    ("default", "combiner", "devices"),
    [("shared", None, 1), ("shared", "mean", 8), ("zeros", "mean", 2)],
)
def test_ids_without_a_row_read_the_default_row_as_in_the_dict_reference(
    default, combiner, devices, planner
):
    # Ids seen only once have no row: they read the shared row,
    # which every such lookup trains, or zeros; a mean of a bag counts them
    # on the shared row and as padding on zeros. Small lists on several
    # devices: the shared row's lookups come from every device.
    mesh = Mesh(np.array(jax.devices()[:devices]), ("rows",))
    vocabulary = {"admit_after": 2, "default": default, "forget": "lfu", "ways": 12}
    cfg = config(96, 90, OPTIMIZERS["adagrad"], **vocabulary)
    cfg = dataclasses.replace(cfg, min_bucket=8)
    run = run_both(cfg, steps=10, mesh=mesh, planner=planner, combiner=combiner)
    cache, model = run[0], run[1]
    total = cache.stats.total
    assert total.refused_lookups > 100 and total.forgotten_ids > 10, total
    assert cache.vocabulary.rows == (95 if default == "shared" else 96)
    if default == "shared":
        assert model.embed.export()[0][95].any()  # trained from zeros
    assert_same(*run)


def test_raw_ids_over_a_tiered_table_match_the_dict_reference(tmp_path, planner):
    # The row budget on disk behind a DRAM tier of 64 rows: new rows are
    # written through it, and rows forgotten in DRAM come back from disk.
    cfg = config(300, 130, OPTIMIZERS["adam"], policy="lru")
    row_bytes = cfg.row_bytes
    table = jaxcache.TieredTable(cfg, tmp_path, dram_budget=64 * row_bytes, seed=3)
    run = run_both(cfg, table=table, planner=planner)
    assert run[0].stats.total.forgotten_ids > 100
    assert table.stats().disk.rows_read > 0
    assert_same(*run)


def _snapshot(cache):
    saved = cache.vocabulary.state_dict()
    return (
        {k: np.array(v) for k, v in saved.items()},
        np.array(cache.planner.id_of_slot),
        np.array(cache.table.rows),
        cache.planner.next_index,
    )


def _assert_unchanged(before, after):
    for a, b in zip(before[0].values(), after[0].values(), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(before[1], after[1])
    np.testing.assert_array_equal(before[2], after[2])
    assert before[3] == after[3]


def _after_one_batch(rows, capacity, ids, planner):
    """A cache of ``rows`` rows and ``capacity`` slots after one batch, and a
    snapshot of its state as the next plan, refused or not, finds it."""
    cfg = config(rows, capacity, jaxcache.sgd(0.1), policy="lru")
    cache = jaxcache.EmbeddingCache(cfg, planner=planner)
    state, _ = cache.prepare(cache.init_state(), np.array(ids))
    cache.lifecycle.release_all()
    return cache, state, _snapshot(cache)


def test_a_batch_with_more_new_ids_than_rows_is_refused_with_nothing_changed(planner):
    cache, state, before = _after_one_batch(6, 6, [10, 11, 12, 13], planner)
    # 4 rows are released after the step, 2 free: 7 new ids do not fit.
    with pytest.raises(jaxcache.CapacityError, match="7 new ids to admit but only 6"):
        cache.prepare(state, np.arange(100, 107))
    _assert_unchanged(before, _snapshot(cache))
    # 6 do: the four rows of the first batch are taken back.
    state, _ = cache.prepare(state, np.arange(100, 106))
    assert cache.stats.last.forgotten_ids == 4
    assert cache.vocabulary.lookup(np.array([10, 11, 12, 13])).tolist() == [-1] * 4


def test_unsigned_ids_past_int64_are_refused_with_nothing_changed(planner):
    # 2^64 - 1 would wrap onto -1 and 2^63 + 5 onto a negative id: refused
    # rather than cast (a padding id of -1 would drop the first in silence).
    cache, state, before = _after_one_batch(100, 8, [1, 2, 3], planner)
    ids = np.array([5, 2**64 - 1, 2**63 + 5], np.uint64)
    with pytest.raises(ValueError, match=r"18446744073709551615 at index \(1,\).*view\(np.int64\)"):
        cache.prepare(state, ids)
    _assert_unchanged(before, _snapshot(cache))
    state, _ = cache.prepare(state, np.array([5, 2**40], np.uint64))  # values int64 holds
    assert cache.vocabulary.lookup(np.array([5, 2**40])).min() >= 0
    with pytest.raises(ValueError, match="trace holds 18446744073709551615"):
        jaxcache.sizing.replay_vocabulary(ids, rows=10)
    # Python ints past int64: NumPy makes the list float64, and the dtype
    # error advised a conversion to int64 that overflows.
    before = _snapshot(cache)
    for listed in ([2**63, 7], [[2**63], [7]]):
        with pytest.raises(ValueError, match=r"beyond int64 \(1, such as 9223372036854775808\)"):
            cache.prepare(state, listed)
    _assert_unchanged(before, _snapshot(cache))


def test_a_batch_the_device_cache_refuses_takes_its_admission_back(planner):
    # The row budget admits 10 new ids, but 8 slots cannot hold them.
    cache, state, before = _after_one_batch(100, 8, [1, 2, 3], planner)
    with pytest.raises(jaxcache.CapacityError, match="10 distinct ids but capacity is 8"):
        cache.prepare(state, np.arange(50, 60))
    _assert_unchanged(before, _snapshot(cache))
    assert cache.vocabulary.lookup(np.arange(50, 60)).tolist() == [-1] * 10


def test_a_batch_too_large_for_a_device_names_the_raw_ids_homed_there(planner):
    # 4 devices of 4 slots; a raw id's home is its bucket's residue, not its value's.
    cfg = config(1024, 16, jaxcache.sgd(0.1), policy="lru")
    mesh = Mesh(np.array(jax.devices()[:4]), ("rows",))
    cache = jaxcache.EmbeddingCache(cfg, mesh=mesh, planner=planner)
    ids = (np.arange(64, dtype=np.int64) * 0x9E3779B97F4A7C1) >> 3
    homes = cache.vocabulary.bucket_of(ids) % 4
    device = int(np.argmax(np.bincount(homes, minlength=4)))
    with pytest.raises(jaxcache.CapacityError) as refused:
        cache.prepare(cache.init_state(), ids.reshape(4, 16))
    message = str(refused.value)
    assert f"ids homed on device {device} (raw ids whose bucket b" in message
    assert f"has b % 4 == {device})" in message
    assert refused.value.distinct == np.count_nonzero(homes == device)


def test_a_new_id_given_a_resident_row_starts_from_its_first_values(planner):
    # The full table: every row is resident from the start, so each new id
    # takes a row whose slot holds another id's trained values.
    cfg = config(4, 4, jaxcache.adagrad(0.5), policy="lru", init="uniform", scale=1.0)
    cache = jaxcache.EmbeddingCache.full_table(cfg, planner=planner)
    model, train = make_cached(cache, 2)
    y = np.ones(2, np.float32)
    train(np.array([[10, 11], [12, 13]]), y)  # trains rows 0..3
    train(np.array([[20, 21], [10, 11]]), y)  # 20, 21 take the rows of 12, 13
    assert cache.stats.last.forgotten_ids == 2 and cache.stats.last.misses == 2
    state = model.embed.get_state()
    ids, rows, _ = cache.export_ids(state)
    first = jaxcache.host.hashed_rows(np.array([20, 21]), D, seed=0, init="uniform", scale=1.0)
    trained = {i: r for i, r in zip(ids.tolist(), rows, strict=True)}
    # One update from the first values (adagrad: the step is lr * sign(g)).
    for i, start in zip((20, 21), first, strict=True):
        assert np.abs(trained[i] - start).max() <= 0.5 + 1e-6
        assert not np.allclose(trained[i], start)
    assert sorted(trained) == [10, 11, 20, 21]


@pytest.mark.parametrize(
    ("saved_by", "restored_by", "vocabulary"),
    [
        ("host", "device", {"forget": "adaptive", "ways": 32}),
        ("device", "host", {"admit_after": 2, "default": "shared"}),
    ],
)
def test_checkpoint_restores_raw_ids_onto_another_layout_and_planner(
    tmp_path, saved_by, restored_by, vocabulary
):
    # Saved after 7 steps on one device; restored into 8 devices with
    # another capacity and the other planner; the 7 steps after equal an
    # uninterrupted reference (the sketch, the shared row and the learned
    # bonus included: popularity drifts, and the bonus moves after the save).
    cfg = config(256, 128, jaxcache.adam(0.02), **{"forget": "lfu", **vocabulary})
    adaptive = cfg.vocabulary.forget == "adaptive"
    batches = list((drift_batches if adaptive else raw_batches)(14, seed=5))
    table = jaxcache.HostTable(cfg, seed=3)
    reference, ref_train, vocab = make_raw_reference(np.array(table.rows), cfg, F)
    ref_losses = [float(ref_train(ids, y)) for ids, y in batches]
    cache = jaxcache.EmbeddingCache(cfg, table=table, planner=saved_by)
    model, train = make_cached(cache, F)
    losses = [float(train(ids, y)) for ids, y in batches[:7]]
    ckpt = jaxcache.Checkpointer(tmp_path)
    ckpt.save(7, model=model, optimizer=train.optimizer)
    saved_bonus = cache.vocabulary.bonus
    restored_cfg = ckpt.cache_config("embedding")
    assert restored_cfg.vocabulary == cfg.vocabulary
    mesh = Mesh(np.array(jax.devices()[:8]), ("rows",))
    other = jaxcache.EmbeddingCache(
        dataclasses.replace(restored_cfg, capacity=160), mesh=mesh, planner=restored_by
    )
    model2, train2 = make_cached(other, F)
    ckpt.restore(7, model=model2, optimizer=train2.optimizer)
    assert other.vocabulary.size == cache.vocabulary.size
    assert other.vocabulary.bonus == cache.vocabulary.bonus
    if cfg.vocabulary.admit_after > 1:
        assert cache.stats.total.refused_lookups > 50
    losses += [float(train2(ids, y)) for ids, y in batches[7:]]
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-6)
    rows, _ = model2.embed.export()
    np.testing.assert_allclose(rows, reference.embed.table[...], rtol=0, atol=1e-6)
    if adaptive:
        learner = vocab.learner
        assert other.vocabulary.bonus == learner.bonus != saved_bonus == 8


def test_a_vocabulary_saved_without_its_training_steps_ages_ids_by_plans(planner):
    # Saved before plans were told from steps: every plan was a step, so the
    # clock resumes at the next plan with as many steps, and nothing moves.
    cfg = config(300, 130, jaxcache.sgd(0.1), ttl=3)
    cache = jaxcache.EmbeddingCache(cfg, planner=planner)
    state = cache.init_state()
    for ids, _ in raw_batches(5):
        state, _ = cache.prepare(state, ids)
    cache.flush(state)
    saved = cache.state_dict()
    assert saved["vocabulary"].pop("vocabulary.steps").tolist()[-1] == 5
    other = jaxcache.EmbeddingCache(cfg, table=cache.table, planner=planner)
    other.load_state_dict(saved)
    assert (other.raw.clock.next_index, other.raw.clock.steps) == (5, 5)
    assert other.vocabulary.state_dict()["last_use"].tolist() == (
        cache.vocabulary.state_dict()["last_use"].tolist()
    )


def test_unsupported_uses_are_refused_with_the_way_out():
    cfg = config(100, 8, jaxcache.sgd(0.1))
    mesh = Mesh(np.array(jax.devices()[:8]), ("rows",))
    # 100 rows in buckets of 64 ways are 2 buckets: too few for 8 devices.
    with pytest.raises(ValueError, match=r"2 buckets.*over 8 devices.*ways=12"):
        jaxcache.EmbeddingCache(cfg, planner="device", mesh=mesh)
    jaxcache.EmbeddingCache(
        dataclasses.replace(cfg, vocabulary=jaxcache.DynamicVocabulary(ways=12)),
        planner="device",
        mesh=mesh,
    )
    with pytest.raises(ValueError, match="frequencies"):
        jaxcache.EmbeddingCache(cfg, frequencies=np.ones(100, np.int64))
    cache = jaxcache.EmbeddingCache(cfg)
    with pytest.raises(TypeError, match="integer array"):
        cache.prepare(cache.init_state(), np.array([1.5]))
    with pytest.raises(ValueError, match="host-callback form"):
        cache.stage_host(np.array([1, 2]), size=4)
    with pytest.raises(ValueError, match="ids are rows"):
        jaxcache.EmbeddingCache(jaxcache.CacheConfig(10, 2, 4)).export_ids(None)


def test_batches_that_do_not_train_admit_nothing_and_read_zeros_for_unknown_ids(planner):
    cfg = config(50, 16, jaxcache.sgd(0.1), init="uniform", scale=1.0)
    cache = jaxcache.EmbeddingCache(cfg, planner=planner)
    state, _ = cache.prepare(cache.init_state(), np.array([10, 11]))
    known = cache.vocabulary.state_dict()
    state, lookup = cache.prepare(state, np.array([10, 99, PAD]), train=False)
    rows = np.asarray(jaxcache.device.lookup_rows(state.rows, lookup))
    first = jaxcache.host.hashed_rows(np.array([10]), D, seed=0, init="uniform", scale=1.0)
    np.testing.assert_array_equal(rows[0], first[0])
    assert not rows[1:].any()  # the unknown id and the padding read zeros
    assert cache.vocabulary.lookup(np.array([99])).tolist() == [-1]
    assert cache.stats.last.refused_lookups == 1 and cache.stats.last.new_ids == 0
    after = cache.vocabulary.state_dict()
    for key in ("ids", "last_use", "counts"):  # a known id's use is not counted either
        np.testing.assert_array_equal(after[key], known[key], err_msg=key)


@pytest.mark.parametrize("forget", ["lru", "lfu", "lrfu"])
def test_evaluating_does_not_change_which_id_training_forgets(planner, forget):
    # Two rows: 7 used once, 9 twice. A new id takes 7's row, whether or not
    # an evaluation read 7 three times in between.
    spec = jaxcache.DynamicVocabulary(forget=forget, ways=2, protect=0)

    def rows_after(evaluate):
        cache = jaxcache.EmbeddingCache(
            jaxcache.CacheConfig(2, 4, 2, vocabulary=spec), planner=planner
        )
        state, _ = cache.prepare(cache.init_state(), np.array([7, 9]))
        state, _ = cache.prepare(state, np.array([9]))
        if evaluate:
            state, _ = cache.prepare(state, np.array([7, 7, 7]), train=False)
        cache.prepare(state, np.array([5]))
        return cache.vocabulary.lookup(np.array([7, 9, 5])).tolist()

    assert rows_after(False) == [-1, 1, 0]
    assert rows_after(True) == [-1, 1, 0]


@pytest.mark.parametrize("forget", ["lru", "lrfu"])
def test_an_evaluation_ages_no_id_even_across_a_checkpoint(tmp_path, planner, forget):
    # ttl=2 training steps: an evaluation of 6 batches (pipelined) between
    # training steps must expire no id, and a restore must resume the steps,
    # so that training equals the dict reference, which never evaluates.
    cfg = config(400, 150, OPTIMIZERS["adagrad"], forget=forget, ttl=2, protect=1)
    batches = [{"ids": i, "y": y} for i, y in raw_batches(12, seed=2)]
    table = jaxcache.HostTable(cfg, seed=3)
    reference, ref_train, vocab = make_raw_reference(np.array(table.rows), cfg, F, lookahead=1)
    ref_losses = [float(ref_train(b["ids"], b["y"])) for b in batches[:6]]
    cache = jaxcache.EmbeddingCache(cfg, table=table, planner=planner)
    model, train = make_cached(cache, F)
    with jaxcache.prefetch(batches[:6], {"ids": model.embed}, lookahead=1) as pipeline:
        losses = [float(train.with_lookup(b["ids"], b["y"])) for b in pipeline]
    # Ids the reference holds after its latest step (5): every one reads its row.
    live = {i for row, (i, _, _) in vocab.entry.items() if not vocab.expired(row, 5, 5)}
    before = cache.stats.total.refused_lookups
    with jaxcache.prefetch(batches[:6], {"ids": model.embed}, lookahead=2, train=False) as pipeline:
        assert len(list(pipeline)) == 6
    ids = np.concatenate([b["ids"].reshape(-1) for b in batches[:6]])
    unknown = sum(i not in live for i in ids[ids != PAD].tolist())
    assert cache.stats.total.refused_lookups - before == unknown < ids.size // 2
    ckpt = jaxcache.Checkpointer(tmp_path)
    ckpt.save(6, model=model, optimizer=train.optimizer)
    other = jaxcache.EmbeddingCache(ckpt.cache_config("embedding"), planner=planner)
    model2, train2 = make_cached(other, F)
    ckpt.restore(6, model=model2, optimizer=train2.optimizer)
    with jaxcache.prefetch(batches[6:], {"ids": model2.embed}, lookahead=1) as pipeline:
        losses += [float(train2.with_lookup(b["ids"], b["y"])) for b in pipeline]
    ref_losses += [float(ref_train(b["ids"], b["y"])) for b in batches[6:]]
    assert other.stats.total.forgotten_ids > 50
    assert_same(other, model2, reference, vocab, losses, ref_losses)


def test_an_evaluation_finds_the_ids_training_left_and_moves_nothing(planner):
    # ttl=1: after training steps 0 and 1, id 10 (last used at step 0) is
    # live; an evaluation reads its trained row, and the vocabulary says
    # the same before and after it.
    spec = jaxcache.DynamicVocabulary(ttl=1, protect=0, init="uniform", scale=1.0)
    cache = jaxcache.EmbeddingCache(
        jaxcache.CacheConfig(64, 4, 32, vocabulary=spec), planner=planner
    )
    state, _ = cache.prepare(cache.init_state(), np.array([10, 11]))
    state, _ = cache.prepare(state, np.array([12]))

    def view(state):
        ids, rows, _ = cache.export_ids(state)
        vocab = cache.vocabulary
        return ids.tolist(), rows, vocab.lookup(np.array([10, 11, 12])).tolist(), vocab.size

    before = view(state)
    assert before[0] == [10, 11, 12] and before[3] == 3
    state, lookup = cache.prepare(state, np.array([10, 12, 99]), train=False)
    read = np.asarray(jaxcache.device.lookup_rows(state.rows, lookup))
    np.testing.assert_array_equal(read[:2], before[1][[0, 2]])
    assert not read[2].any() and cache.stats.last.refused_lookups == 1
    after = view(state)
    assert after[0] == before[0] and after[2:] == before[2:]


def test_batches_that_do_not_train_read_the_shared_row_for_unknown_ids(planner):
    cfg = config(50, 16, jaxcache.sgd(0.5), admit_after=2, default="shared")
    cache = jaxcache.EmbeddingCache(cfg, planner=planner)
    model, train = make_cached(cache, 2)
    # 10 is admitted (seen twice), 11 and 12 read the shared row and train it.
    train(np.array([[10, 11], [10, 12]]), np.ones(2, np.float32))
    assert cache.vocabulary.size == 1 and cache.stats.last.refused_lookups == 2
    state = model.embed.get_state()
    shared = model.embed.export()[0][49]
    assert shared.any()
    state, lookup = cache.prepare(state, np.array([11, 99, PAD]), train=False)
    rows = np.asarray(jaxcache.device.lookup_rows(state.rows, lookup))
    np.testing.assert_array_equal(rows[:2], [shared, shared])
    assert not rows[2].any()  # padding reads zeros
    assert cache.stats.last.refused_lookups == 2


@pytest.mark.parametrize("default", ["zeros", "shared"])
def test_more_unknown_ids_than_slots_read_the_default_row_when_not_training(planner, default):
    # 4 slots on each of 2 devices, 2 known ids; a batch that does not train
    # brings 30 unknown ones, which need no slot: it is served, not refused.
    cfg = config(64, 8, jaxcache.sgd(0.1), default=default, init="uniform", scale=1.0, ways=16)
    mesh = Mesh(np.array(jax.devices()[:2]), ("rows",))
    cache = jaxcache.EmbeddingCache(cfg, mesh=mesh, planner=planner)
    state, _ = cache.prepare(cache.init_state(), np.array([10, 11]))
    cache.lifecycle.release_all()
    ids = np.concatenate([[10, 11], np.arange(1000, 1030)])
    state, lookup = cache.prepare(state, ids, train=False)
    rows = np.asarray(jaxcache.device.lookup_rows(state.rows, lookup))
    first = jaxcache.host.hashed_rows(np.array([10, 11]), D, seed=0, init="uniform", scale=1.0)
    np.testing.assert_array_equal(rows[:2], first)
    assert not rows[2:].any()  # zeros, or the shared row, untrained
    assert cache.stats.last.refused_lookups == 30 and cache.vocabulary.size == 2


@pytest.mark.parametrize("rules", [dict(forget="lfu"), dict(forget="lru", ttl=1)])
def test_forgetting_does_not_depend_on_the_look_ahead(planner, rules):
    # The rows of the two batches before each batch are held whether or not
    # they are in flight (protect=2, the default), so a pipeline of
    # look-ahead 0, 1 or 2 forgets the same ids: the same rows, bit for bit,
    # and the dict reference's.
    cfg = config(300, 300, OPTIMIZERS["adagrad"], policy="lru", ways=256, protect=2, **rules)
    runs = [
        run_both(cfg, lookahead=k, steps=12, planner=planner, stream=drift_batches) for k in (0, 2)
    ]
    assert runs[0][0].stats.total.forgotten_ids > 100
    for run in runs:
        assert_same(*run)
        assert run[0].stats.total == runs[0][0].stats.total
    (ids, rows, state), (ids_2, rows_2, state_2) = (
        run[0].export_ids(run[1].embed.get_state()) for run in runs
    )
    np.testing.assert_array_equal(ids, ids_2)
    np.testing.assert_array_equal(rows, rows_2)
    for name in state:
        np.testing.assert_array_equal(state[name], state_2[name])


def test_a_look_ahead_past_what_the_vocabulary_protects_is_refused(planner):
    cfg = config(400, 400, OPTIMIZERS["sgd"], protect=1)
    cache = jaxcache.EmbeddingCache(cfg, planner=planner)
    model, _ = make_cached(cache, F)
    batches = [{"ids": ids} for ids, _ in raw_batches(2)]
    with pytest.raises(ValueError, match=r"DynamicVocabulary\(protect=2\) or more"):
        jaxcache.prefetch(batches, {"ids": model.embed}, lookahead=2)
    with jaxcache.prefetch(batches, {"ids": model.embed}, lookahead=2, train=False) as pipeline:
        assert len(list(pipeline)) == 2  # evaluation admits no id: nothing to protect
