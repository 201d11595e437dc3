"""The vocabulary of raw ids: against a dict model of its rules, op for op."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxcache
from jaxcache._src.training_clock import WINDOW, TrainingClock
from jaxcache._src.vocabulary import Vocabulary, distinct_ids, hashed_rows, rows_to_hold
from jaxcache._src.vocabulary_learner import BonusLearner
from tests.models import LearnerModel, VocabularyModel


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.sampled_from([1, 3, 12, 40]),
    ways=st.sampled_from([4, 64]),
    admit_after=st.sampled_from([1, 1, 2, 3]),
    forget=st.sampled_from(["lru", "lfu", "lrfu"]),
    bonus=st.sampled_from([0, 2, 256]),
    ttl=st.sampled_from([None, None, 2, 5]),
    seed=st.integers(0, 2**16),
)
def test_admits_and_forgets_by_the_rules_of_a_dict_model(
    rows, ways, admit_after, forget, bonus, ttl, seed
):
    rng = np.random.default_rng(seed)
    # Raw ids anywhere in int64, a few dozen of them, many sharing index probes.
    universe = rng.integers(-(1 << 62), 1 << 62, 60)
    universe[:5] = [0, -1, 1 << 40, (1 << 63) - 1, -(1 << 63)]
    settings_ = dict(
        admit_after=admit_after, forget=forget, bonus=bonus, ways=ways, ttl=ttl, seed=seed
    )
    vocab = Vocabulary(rows, sketch_width=1 << 16, **settings_)
    model = VocabularyModel(rows, admit_after, forget, bonus=bonus, ways=ways, ttl=ttl, seed=seed)
    assert vocab.buckets == model.buckets
    assert vocab.bucket_of(universe).tolist() == [model.bucket(int(i)) for i in universe]
    step = 0
    for _ in range(80):
        if step == 30:  # a restore mid-run continues exactly
            restored = Vocabulary(rows, sketch_width=1 << 16, **settings_)
            restored.load_state_dict(vocab.state_dict())
            vocab = restored
        lag = int(rng.integers(0, 4))  # plans in flight: their rows are held
        ids = rng.choice(universe, size=rng.integers(1, min(rows, 8) + 2), replace=False)
        counts = rng.integers(1, 4, ids.size)
        new = bool(rng.random() < 0.9)
        kwargs = dict(step=step, finished=step - 1 - lag, new=new)
        if rng.random() < 0.2:  # admitted, then taken back (its batch refused later)
            before = vocab.state_dict()
            try:
                vocab.revert(vocab.admit(ids, counts, **kwargs))
            except jaxcache.CapacityError:
                pass
            after = vocab.state_dict()
            assert all(np.array_equal(before[k], after[k]) for k in before), "reverted"
            continue
        try:
            expected = model.admit(ids.tolist(), counts.tolist(), step, step - 1 - lag, new)
        except jaxcache.CapacityError:
            before = vocab.state_dict()
            with pytest.raises(jaxcache.CapacityError, match="new ids to admit") as refusal:
                vocab.admit(ids, counts, **kwargs)
            after = vocab.state_dict()
            assert all(np.array_equal(before[k], after[k]) for k in before)  # nothing changed
            after_plan = refusal.value.fits_after
            if after_plan is not None:  # releasing that plan makes room
                assert step - 1 - lag < after_plan < step
                model.admit(ids.tolist(), counts.tolist(), step, after_plan, new)
                done = vocab.admit(ids, counts, step=step, finished=after_plan, new=new)
                step += 1
            continue
        done = vocab.admit(ids, counts, **kwargs)
        assert done.rows.tolist() == expected[0]
        assert done.new_ids.tolist() == expected[1]
        assert done.forgotten_ids.tolist() == expected[2]
        assert done.refused == int((done.rows < 0).sum())
        step += 1
        # The index holds exactly the model's live ids.
        live = model.row_of
        assert vocab.lookup(np.array(list(live), np.int64)).tolist() == list(live.values())
        gone = [i for i in universe.tolist() if i not in live]
        assert (vocab.lookup(np.array(gone, np.int64)) == -1).all()
        assert vocab.size == len(live)


@pytest.mark.parametrize(("rows", "admit_after"), [(5000, 1), (300, 2)])
def test_the_learned_bonus_follows_the_plain_python_learner(rows, admit_after):
    # 5,000 rows: shadows of 1,250 rows replay the quarter of the ids whose
    # hash starts with two zero bits. Popularity first stays put behind a
    # scan (lookups deserve a bonus), then drifts (they do not): the choice
    # moves both ways. With admission the scan's ids get no row.
    rng = np.random.default_rng(0)
    universe = rng.integers(-(1 << 62), 1 << 62, 200_000)
    learner = BonusLearner(rows, ways=64, admit_after=admit_after, sketch_width=1 << 16, seed=3)
    model = LearnerModel(rows, 64, admit_after, 3)
    assert learner.bits == model.bits == (2 if rows == 5000 else 0)
    hot = universe[rng.zipf(1.1, 30_000) % 20_000]
    scan = universe[50_000:]
    choices = []
    for step in range(60):
        if step < 30:  # a fixed skew, and a scan of ids seen once
            part = rows // 5
            batch = np.concatenate(
                [
                    hot[step * part : (step + 1) * part],
                    scan[step * rows // 2 : (step + 1) * rows // 2],
                ]
            )
        else:  # a window of popularity moving on
            start = (step - 30) * rows // 12
            batch = rng.choice(universe[start : start + rows // 2], rows // 2)
        ids, _, counts = distinct_ids(batch)
        if step == 20:  # restored mid-run, and a plan taken back teaches nothing
            restored = BonusLearner(rows, ways=64, admit_after=admit_after,
                                    sketch_width=1 << 16, seed=3)  # fmt: skip
            restored.load_state_dict(learner.state_dict())
            learner = restored
            learner.offer(ids[::-1], counts[::-1], step)
            learner.drop()
        learner.settle()
        model.settle()
        assert learner.bonus == model.bonus and learner.scores.tolist() == model.scores
        choices.append(learner.bonus)
        learner.offer(ids, counts, step)
        model.offer(ids.tolist(), counts.tolist(), step)
    assert choices[-1] < 8, choices
    if admit_after == 1:  # ids of the scan never come back: counts earn a bonus
        assert max(choices[:30]) > 8, choices


def test_a_bucket_holds_at_most_its_ways_and_the_ids_spread_over_the_buckets():
    vocab = Vocabulary(1000, ways=16)
    assert vocab.buckets == 64
    assert sorted({vocab.ways_of(b) for b in range(64)}) == [15, 16]
    ids = np.random.default_rng(1).integers(-(1 << 62), 1 << 62, 64_000)
    load = np.bincount(vocab.bucket_of(ids), minlength=64)
    assert load.min() > 900 and load.max() < 1100  # 1000 each, within 3 sigma
    done = vocab.admit(ids[:400], np.ones(400), step=0)
    # Row r of bucket r % 64: each id's row is in its own bucket.
    assert (done.rows[done.rows >= 0] % 64 == vocab.bucket_of(ids[:400])[done.rows >= 0]).all()


def test_the_budget_that_forgets_nothing_holds_every_bucket():
    ids = np.random.default_rng(2).integers(-(1 << 62), 1 << 62, 5000)
    need = rows_to_hold(ids, ways=32, seed=4)
    assert 5000 <= need <= 3 * 5000  # buckets fill unevenly: some room is never used
    for rows, forgets in ((need, False), (need - 1, True)):
        vocab = Vocabulary(rows, ways=32, seed=4)
        forgotten = 0
        for step, batch in enumerate(np.array_split(ids, 10)):
            forgotten += vocab.admit(batch, np.ones(batch.size), step=step).forgotten_ids.size
        assert (forgotten > 0) == forgets


def test_the_budget_of_ids_that_share_a_hash_is_found_without_a_bucket_per_hash():
    # Ids whose 32-bit hashes share their low 31 bits part only at 2^32
    # buckets: counted in an array of 2^32 loads, that ran out of memory,
    # and ids sharing a whole hash past ``ways`` (no budget holds them)
    # went through every size up to it.
    from jaxcache._src.hashing import fmix32, seed_word

    inner = np.arange(1 << 20, dtype=np.uint32)
    low31 = fmix32(inner) & np.uint32(0x7FFFFFFF)
    order = np.argsort(low31, kind="stable")
    pair = np.flatnonzero(np.diff(low31[order]) == 0)[0]
    x1, x2 = inner[order[pair]], inner[order[pair + 1]]  # hashes fmix32(x) part at bit 31

    def raw(high, x):  # the id whose hash is fmix32(x); words as arrays, as the library's
        word = np.array([high], np.uint32)
        low = fmix32(word ^ seed_word(0)) ^ np.array([x], np.uint32)
        return np.int64((high << 32) | int(low[0]))

    ids = np.array([raw(1, x1), raw(2, x1), raw(3, x2)])
    assert rows_to_hold(ids, ways=2) == (1 << 32) + int(fmix32(np.array([x1]))[0]) + 1
    assert rows_to_hold(np.array([raw(h, x1) for h in (1, 2, 3)]), ways=2) is None
    with pytest.raises(ValueError, match="ways=1 must be an integer of at least 2"):
        jaxcache.DynamicVocabulary(ways=1)  # budgets not a power of two had empty buckets


def test_many_ids_through_a_small_budget_keep_the_index_exact():
    # 50,000 distinct ids through 1,000 rows: every probe run is shifted on
    # deletion many times over.
    vocab = Vocabulary(1000, ways=1000)  # one bucket: it forgets only when all are full
    rng = np.random.default_rng(0)
    ids = rng.permutation(rng.integers(-(1 << 62), 1 << 62, 50_000))
    alive: dict[int, int] = {}
    for step, batch in enumerate(np.array_split(ids, 100)):
        done = vocab.admit(batch, np.ones(batch.size), step=step)
        for i in done.forgotten_ids.tolist():
            del alive[i]
        alive.update(zip(done.new_ids.tolist(), done.new_rows.tolist(), strict=True))
    assert len(alive) == vocab.size == 1000
    assert vocab.lookup(np.array(list(alive))).tolist() == list(alive.values())
    assert (vocab.lookup(ids[:-1000][~np.isin(ids[:-1000], list(alive))]) == -1).all()


def test_a_batch_too_large_for_the_budget_is_refused_with_nothing_changed():
    vocab = Vocabulary(3, admit_after=2, sketch_width=1 << 8)
    first = vocab.admit(np.array([1, 2]), np.array([2, 2]), step=0)
    assert first.rows.tolist() == [0, 1]
    before = vocab.state_dict()
    with pytest.raises(jaxcache.CapacityError, match="2 new ids to admit but only 1 of the 3"):
        # Plan 0 is in flight (its rows held), and 5 is not admitted yet.
        vocab.admit(np.array([3, 4, 5]), np.array([2, 2, 1]), step=1, finished=-1)
    after = vocab.state_dict()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert vocab.estimate(np.array([3, 4, 5])).tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rows": 0}, "rows=0"),
        ({"rows": 4, "admit_after": 0}, "admit_after=0"),
        ({"rows": 4, "forget": "fifo"}, "forget='fifo'"),
        ({"rows": 4, "sketch_width": 1000}, "power of two"),
        ({"rows": 4, "ways": 0}, "ways=0"),
        ({"rows": 4, "ttl": 0}, "ttl=0"),
        ({"rows": 4, "forget": "lrfu", "bonus": 257}, "bonus=257"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Vocabulary(**kwargs)


def test_first_values_depend_on_the_seed_and_the_id_alone():
    ids = np.arange(-50_000, 50_000, dtype=np.int64) * 7919
    rows = hashed_rows(ids, 6, seed=3, scale=0.5)
    again = hashed_rows(ids[::-1], 6, seed=3, scale=0.5)[::-1]
    np.testing.assert_array_equal(rows, again)
    assert abs(rows.mean()) < 0.01 and abs(rows.std() - 0.5) < 0.01
    assert not np.array_equal(rows, hashed_rows(ids, 6, seed=4, scale=0.5))
    uniform = hashed_rows(ids, 5, seed=3, init="uniform", scale=0.2)
    assert uniform.min() >= -0.2 and uniform.max() < 0.2 and abs(uniform.mean()) < 0.01
    assert not hashed_rows(ids[:3], 4, seed=0, init="zeros").any()


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(st.sampled_from([0, -1, 5, 1 << 40, -(1 << 63), (1 << 63) - 1, 77]), max_size=40),
    pad=st.sampled_from([None, -1, 5]),
)
def test_distinct_ids_are_numpys_in_order_of_first_appearance(ids, pad):
    array = np.array(ids, np.int64)
    unique, inverse, counts = distinct_ids(array, pad)
    real = array if pad is None else array[array != pad]
    expected = list(dict.fromkeys(real.tolist()))  # dicts keep insertion order
    assert unique.tolist() == expected
    assert counts.tolist() == [int((real == i).sum()) for i in expected]
    assert [-1 if i < 0 else unique[i] for i in inverse.tolist()] == [
        -1 if pad is not None and x == pad else x for x in ids
    ]


@settings(max_examples=60, deadline=None)
@given(
    plans=st.lists(st.tuples(st.booleans(), st.integers(0, 3)), min_size=1, max_size=40),
)
def test_the_training_clock_counts_the_training_plans_before_each(plans):
    # Plans made in order, some taken back (a refusal, a rollback) and made
    # again, against a list of every plan's training flag.
    clock, made = TrainingClock(), []
    for train, back in plans:
        index = max(len(made) - back, 0)
        del made[index:]
        assert clock.plan(index, train) == sum(made) - (not train)  # the latest step
        made.append(train)
        assert clock.steps == sum(made) and clock.next_index == len(made)
        for f in range(-1, len(made)):  # the last training plan up to f
            assert clock.finished(f) == sum(made[: f + 1]) - 1
        for index, trains in enumerate(made):
            if trains:
                assert clock.plan_of(sum(made[:index])) == index
    restored = TrainingClock.from_array(clock.state_array())
    assert restored.state_array().tolist() == clock.state_array().tolist()


def test_the_training_clock_keeps_a_window_and_refuses_a_damaged_save():
    clock = TrainingClock()
    for index in range(WINDOW + 10):
        clock.plan(index, index % 2 == 0)
    assert clock.steps == (WINDOW + 11) // 2
    # Past the window every plan counts as a training one: a lower bound,
    # which holds ids longer, never shorter.
    assert clock.finished(5) <= 2 and clock.plan_of(0) is None
    assert clock.finished(WINDOW + 8) == clock.steps - 1
    for damaged in ([0], [0, 3, 5], [-1, 0, 1], [0.5, 1.0]):
        with pytest.raises(ValueError, match="training clock"):
            TrainingClock.from_array(np.array(damaged))
