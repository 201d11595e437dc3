"""The adaptive policy against a small, obviously-correct pure-Python model of it."""

from __future__ import annotations

import collections
import contextlib
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxcache
from jaxcache._src import policies
from tests.test_planner import DictPlanner

BONUSES = policies.AdaptivePolicy.BONUSES
LOG2 = [math.floor(256 * math.log2(1 + i / 256)) for i in range(256)]
GOLDEN = 0x9E3779B97F4A7C15


def log2_fixed(count):
    """log2(count) in 1/256ths, from the float's exponent and 8 bits of mantissa."""
    mantissa, exponent = math.frexp(float(count))
    return 256 * (exponent - 1) + LOG2[int((2 * mantissa - 1) * 256)]


def key(t, weight, bonus):
    return weight if bonus < 0 else 256 * t + bonus * log2_fixed(weight)


def sampled(i, bits):
    return bits == 0 or ((i * GOLDEN) % 2**64) >> (64 - bits) == 0


class Shadow:
    """One shadow cache: a dict id -> [key, last batch, slot]."""

    def __init__(self, bonus, size):
        self.bonus, self.size, self.rows, self.filled = bonus, size, {}, 0

    def step(self, sample, t, weight):
        hits, misses = 0, []
        for i in sample:
            if i in self.rows:
                hits += 1
                self.rows[i][:2] = [key(t, weight(i), self.bonus), t]
            else:
                misses.append(i)
        for i in misses:
            if self.filled < self.size:
                slot, self.filled = self.filled, self.filled + 1
            else:
                evictable = [(k, s, j) for j, (k, used, s) in self.rows.items() if used != t]
                if not evictable:
                    continue
                _, slot, victim = min(evictable)
                del self.rows[victim]
            self.rows[i] = [key(t, weight(i), self.bonus), t, slot]
        return hits

    def rekey(self, bonus, weight):
        self.bonus = bonus
        for i, row in self.rows.items():
            row[0] = key(row[1], weight(i), bonus)


def leads(scores, a, b):
    return scores[a] > scores[b] + (scores[b] >> policies.AdaptivePolicy.MARGIN)


class Model:
    """The policy's specification: counts, shadows, scores, the rules, the chosen bonus."""

    def __init__(self, capacity, prior=None, shadow_rows=1024):
        self.counts = collections.Counter()
        self.prior = prior
        self.bits = 0
        while capacity >> (self.bits + 1) >= shadow_rows:
            self.bits += 1
        size = capacity >> self.bits
        # By weight alone with a prior (the cache starts warmed by it).
        start = len(BONUSES) - 1 if prior is not None else policies.AdaptivePolicy.START
        # A shadow per bonus, then the quick and the steady rule's own.
        self.shadows = [Shadow(b, size) for b in [*BONUSES, BONUSES[start], BONUSES[start]]]
        self.scores = [0] * len(BONUSES)
        self.slow_scores = [0] * len(BONUSES)
        self.rule_scores = [0, 0]
        self.rules = [start, start]  # quick, steady
        self.followed = 1  # steady
        self.choice = start
        if prior is not None:
            ids = [i for i in range(len(prior)) if sampled(i, self.bits) and prior[i] > 0]
            hot = sorted(ids, key=lambda i: (-prior[i], i))[:size]
            for shadow in self.shadows:
                shadow.step(sorted(hot), -1, self.weight)

    def weight(self, i):
        return max(self.counts[i], 0 if self.prior is None else int(self.prior[i]), 1)

    def key(self, last_use, i):
        return key(last_use, self.weight(i), BONUSES[self.choice])

    def record(self, t, ids):
        self.counts.update(ids)
        sample = sorted(i for i in set(ids) if sampled(i, self.bits))
        hits = [shadow.step(sample, t, self.weight) for shadow in self.shadows]
        k, quick, slow = (
            len(BONUSES),
            policies.AdaptivePolicy.DECAY,
            policies.AdaptivePolicy.SLOW_DECAY,
        )
        for j in range(k):
            self.scores[j] += (hits[j] << 16) - (self.scores[j] >> quick)
            self.slow_scores[j] += (hits[j] << 16) - (self.slow_scores[j] >> slow)
        for r in range(2):
            self.rule_scores[r] += (hits[k + r] << 16) - (self.rule_scores[r] >> slow)
        best = self.scores.index(max(self.scores))
        for r in range(2):
            held = self.rules[r]
            if best != held and leads(self.scores, best, held):
                if r == 0 or leads(self.slow_scores, best, held):
                    self.rules[r] = best
                    self.shadows[k + r].rekey(BONUSES[best], self.weight)
        if leads(self.rule_scores, 1 - self.followed, self.followed):
            self.followed = 1 - self.followed
        self.choice = self.rules[self.followed]


@contextlib.contextmanager
def shadow_rows(rows):
    saved = policies.AdaptivePolicy.SHADOW_ROWS
    policies.AdaptivePolicy.SHADOW_ROWS = rows
    try:
        yield
    finally:
        policies.AdaptivePolicy.SHADOW_ROWS = saved


@settings(max_examples=120, deadline=None)
@given(
    capacity=st.integers(4, 24),
    seed=st.integers(0, 2**31 - 1),
    lags=st.lists(st.integers(0, 2), min_size=1, max_size=40),
    rows=st.sampled_from([1024, 3]),
    with_prior=st.booleans(),
    reserve=st.sampled_from([1, 4096]),
)
def test_policy_matches_the_model(capacity, seed, lags, rows, with_prior, reserve):
    # One partition's planner, slot for slot, under in-flight batches and
    # victim reserves as small as one slot; with shadows of a few rows, ids
    # are sampled by hash.
    n = 40
    rng = np.random.default_rng(seed)
    prior = rng.integers(0, 30, n) if with_prior else None
    cfg = jaxcache.CacheConfig(n, 1, capacity, policy="adaptive")
    with shadow_rows(rows):
        planner = jaxcache.planning.Planner(cfg, frequencies=prior, reserve=reserve)
        model = Model(capacity, prior, rows)
    dict_planner = DictPlanner(n, capacity, model.key, None)
    if with_prior:  # warmed as a cache is, in the order of the hottest
        ids, slots = planner.warm(jaxcache.planning.hottest(prior, capacity))
        for i, s in zip(ids.tolist(), slots.tolist(), strict=True):
            dict_planner.ids[s] = i
    # Phases of a popular set, a drifting one and one-off ids: the bonus moves.
    hot = rng.choice(n, 6, replace=False)
    for step, lag in enumerate(lags):
        released = planner.next_index - 1 - lag
        planner.release(released)
        size = int(rng.integers(1, 10))
        if step % 12 < 6:
            ids = np.where(rng.random(size) < 0.7, rng.choice(hot, size), rng.integers(0, n, size))
        else:
            ids = rng.integers(0, n, size)
        try:
            plan = planner.plan(ids)
        except jaxcache.CapacityError:
            continue
        hits, misses = dict_planner.plan(ids.tolist(), planner.released)
        model.record(plan.index, ids.tolist())
        assert (plan.hits, plan.fetch_ids.tolist()) == (hits, misses)
        assert planner.id_of_slot.tolist() == [-1 if i is None else i for i in dict_planner.ids]
        policy = planner.policy
        assert policy.scores.tolist() == model.scores
        assert policy.slow_scores.tolist() == model.slow_scores
        assert policy.rule_scores.tolist() == model.rule_scores
        assert policy.rules.tolist() == [model.followed, *model.rules]
        assert policy.bonus == BONUSES[model.choice]
        weights = [model.weight(i) for i in range(n)]
        assert np.maximum(policy.counts, prior if with_prior else 0).clip(1).tolist() == weights


def test_one_off_ids_do_not_flush_the_hot_rows():
    # A hot set that fits, then batches of ids never seen again: the hot rows
    # stay (admission), while LRU loses them all.
    hot = np.arange(8)
    warm_up = [hot] * 4
    scan = [np.arange(100 + 4 * k, 104 + 4 * k) for k in range(20)]
    for policy, kept in (("adaptive", 8), ("lru", 0)):
        planner = jaxcache.planning.Planner(jaxcache.CacheConfig(1000, 1, 12, policy=policy))
        for ids in warm_up + scan:
            planner.release(planner.plan(ids).index)
        assert np.isin(hot, planner.resident_ids()).sum() == kept, policy
        # A row seen once lands in the short-lived region: it goes first.
        assert planner.slot_of_id[scan[-2]].min() < 0 or policy == "lru"


def test_learns_recency_on_a_moving_working_set_and_frequency_on_a_fixed_one():
    rng = np.random.default_rng(0)
    n, capacity = 5000, 400
    moving = [rng.integers(10 * t, 10 * t + 300, 200) for t in range(300)]
    popular = [np.minimum(rng.zipf(1.2, 200), n) - 1 for _ in range(300)]
    chosen = {}
    for name, trace in (("moving", moving), ("popular", popular)):
        planner = jaxcache.planning.Planner(jaxcache.CacheConfig(n, 1, capacity))
        for ids in trace:
            planner.release(planner.plan(ids).index)
        chosen[name] = planner.policy.bonus
    assert 0 <= chosen["moving"] <= 4
    assert chosen["popular"] >= 64 or chosen["popular"] == -1


def test_keys_never_decrease_while_a_row_stays():
    # Across changes of the bonus too: the planner's victim reserve relies on it.
    rng = np.random.default_rng(1)
    planner = jaxcache.planning.Planner(jaxcache.CacheConfig(3000, 1, 200))
    changes = 0
    before_ids, before_keys = planner.id_of_slot.copy(), planner.policy.keys.copy()
    for t in range(400):
        low = 0 if (t // 50) % 2 else 5 * t
        ids = rng.integers(low, low + 400, 150) if low else np.minimum(rng.zipf(1.3, 150), 2999)
        bonus = planner.policy.bonus
        planner.release(planner.plan(ids).index)
        changes += planner.policy.bonus != bonus
        stayed = (planner.id_of_slot == before_ids) & (before_ids >= 0)
        assert (planner.policy.keys[stayed] >= before_keys[stayed]).all()
        before_ids, before_keys = planner.id_of_slot.copy(), planner.policy.keys.copy()
    assert changes >= 2


def test_state_dict_restores_onto_another_capacity_and_policy():
    rng = np.random.default_rng(2)
    cfg = jaxcache.CacheConfig(500, 1, 64)
    planner = jaxcache.planning.Planner(cfg)
    for _ in range(30):
        planner.release(planner.plan(rng.integers(0, 500, 40), train=False).index)
    state = planner.state_dict()
    assert planner.policy.per_id == ("counts",)
    assert set(state["policy"]) >= {"name", "counts", "scalars"}
    smaller = jaxcache.planning.Planner(jaxcache.CacheConfig(500, 1, 48))
    smaller.load_state_dict(state)
    np.testing.assert_array_equal(smaller.policy.counts, planner.policy.counts)
    assert smaller.policy.bonus == planner.policy.bonus
    smaller.plan(rng.integers(0, 500, 40))
    # Counts of a counting policy carry over to the adaptive one, and back.
    lfu = jaxcache.planning.Planner(jaxcache.CacheConfig(500, 1, 64, policy="lfu"))
    lfu.load_state_dict(state)
    np.testing.assert_array_equal(lfu.policy.counts, planner.policy.counts)


@pytest.mark.parametrize("bad", [np.ones(3), -np.ones(500)])
def test_bad_frequencies_are_refused(bad):
    with pytest.raises((TypeError, ValueError), match="frequencies"):
        jaxcache.planning.Planner(jaxcache.CacheConfig(500, 1, 64), frequencies=bad)


def test_a_state_saved_before_the_rules_restores_with_its_choice():
    # Saved by the policy before it had rules: 13 shadows, no rule state.
    rng = np.random.default_rng(3)
    planner = jaxcache.planning.Planner(jaxcache.CacheConfig(500, 1, 64))
    for _ in range(40):
        planner.release(planner.plan(rng.integers(0, 500, 40), train=False).index)
    planner.policy.scalars[0] = 2  # a choice other than the start
    state = planner.state_dict()
    k = len(BONUSES)
    policy = {key: value for key, value in state["policy"].items() if "rule" not in key}
    del policy["slow_scores"]
    for key in ("shadow_rows", "shadow_heap", "shadow_table", "shadow_state"):
        policy[key] = policy[key][:k]
    restored = jaxcache.planning.Planner(jaxcache.CacheConfig(500, 1, 64))
    restored.load_state_dict({**state, "policy": policy})
    assert restored.policy.bonus == BONUSES[2]
    assert restored.policy.rules.tolist() == [1, 2, 2]  # steady followed, both at the choice
    np.testing.assert_array_equal(restored.policy.counts, planner.policy.counts)
    restored.release(restored.plan(rng.integers(0, 500, 40)).index)
