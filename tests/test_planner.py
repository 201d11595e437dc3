"""The planner against a small, obviously-correct dict model (hypothesis)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxcache


class DictPlanner:
    """Slots as a Python list, one id at a time: the specification."""

    def __init__(self, capacity, policy, frequencies, devices=1, groups=1):
        local = capacity // devices
        self.groups, self.size = groups, capacity // groups
        self.tie = [(s % local) * devices + s // local for s in range(capacity)]
        self.ids = [None] * capacity
        self.last_use = [-1] * capacity
        self.policy = policy
        self.counts = dict(enumerate(frequencies.tolist())) if frequencies is not None else {}
        self.index = 0

    def resident(self):
        return {i: s for s, i in enumerate(self.ids) if i is not None}

    def key(self, slot):
        if self.ids[slot] is None:
            return -1
        if callable(self.policy):  # the priority of (last use, id), from a model
            return self.policy(self.last_use[slot], self.ids[slot])
        if self.policy == "lru":
            return self.last_use[slot]
        return self.counts.get(self.ids[slot], 0)

    def plan(self, ids, released):
        t = self.index
        self.index += 1
        resident = self.resident()
        distinct = sorted(set(ids))
        misses = [i for i in distinct if i not in resident]
        protected = {s for s in range(len(self.ids)) if self.last_use[s] > released}
        protected |= {resident[i] for i in distinct if i in resident}
        fetched = []
        for group in range(self.groups):  # id i lives in the slots of group i % groups
            block = range(group * self.size, (group + 1) * self.size)
            mine = [i for i in misses if i % self.groups == group]
            guarded = {s for s in protected if s in block}
            candidates = sorted(
                (s for s in block if s not in guarded), key=lambda s: (self.key(s), self.tie[s])
            )
            victims = sorted(candidates[: len(mine)])
            for slot, new in zip(victims, mine, strict=True):
                self.ids[slot] = new
            fetched += mine
        resident = self.resident()
        for i in distinct:
            self.last_use[resident[i]] = t
        if self.policy == "lfu":
            for i in ids:
                self.counts[i] = self.counts.get(i, 0) + 1
        return len(distinct) - len(misses), fetched


def _too_full(ids, in_flight, capacity, groups):
    """Whether some group's distinct ids and in-flight rows exceed its slots."""
    needed = set(ids) | in_flight
    return any(
        len([i for i in needed if i % groups == g]) > capacity // groups for g in range(groups)
    )


# The adaptive policy has a model of its own (tests/test_adaptive.py) that
# reuses DictPlanner with its keys.
FIXED_POLICIES = ("frequency", "lfu", "lru")


@settings(max_examples=150, deadline=None)
@given(
    policy=st.sampled_from(FIXED_POLICIES),
    capacity=st.integers(4, 24),
    seed=st.integers(0, 2**31 - 1),
    lags=st.lists(st.integers(0, 2), min_size=1, max_size=30),
    reserve=st.sampled_from([1, 3, 4096]),
    devices=st.sampled_from([1, 2, 4]),
    groups=st.sampled_from([1, 2]),
    padded=st.booleans(),
)
def test_planner_matches_dict_model(policy, capacity, seed, lags, reserve, devices, groups, padded):
    n = 40
    groups = groups if devices % groups == 0 else 1
    capacity = capacity // devices * devices
    rng = np.random.default_rng(seed)
    frequencies = rng.integers(0, 50, n)
    cfg = jaxcache.CacheConfig(n, 1, capacity, policy=policy, padding_id=-1 if padded else None)
    counts = frequencies if policy != "lru" else None
    planner = jaxcache.Planner(
        cfg, frequencies=counts, reserve=reserve, devices=devices, groups=groups
    )
    model = DictPlanner(capacity, policy, counts, devices, groups)
    for lag in lags:
        # Release all but the last `lag` plans, as a pipeline with look-ahead does.
        released = planner.next_index - 1 - lag
        planner.release(released)
        ids = rng.integers(0, n, size=int(rng.integers(1, 12)))
        if padded:  # bags padded with -1, which the model never sees
            ids = np.where(rng.random(ids.size) < 0.3, -1, ids)
        real = ids[ids >= 0]
        in_flight = set(planner.id_of_slot[planner.last_use > planner.released].tolist())
        before = dict(enumerate(planner.id_of_slot.tolist()))
        try:
            plan = planner.plan(ids)
        except jaxcache.CapacityError:
            # Refused: nothing may have changed, and it was really too full.
            assert dict(enumerate(planner.id_of_slot.tolist())) == before
            assert _too_full(real.tolist(), in_flight, capacity, groups)
            _check_fits_after(planner, ids)
            continue
        hits, misses = model.plan(real.tolist(), planner.released)
        assert plan.hits == hits
        assert plan.fetch_ids.tolist() == misses
        assert plan.hits + plan.misses == plan.distinct == len(set(real.tolist()))
        assert plan.lookups == real.size
        assert (plan.inverse[ids < 0] == -1).all()
        # Same slots as the specification.
        assert planner.id_of_slot.tolist() == [-1 if i is None else i for i in model.ids]
        # Directory is a bijection between resident ids and occupied slots.
        occupied = np.flatnonzero(planner.id_of_slot >= 0)
        assert (planner.slot_of_id[planner.id_of_slot[occupied]] == occupied).all()
        assert np.count_nonzero(planner.slot_of_id >= 0) == occupied.size
        # Rows of in-flight plans never leave.
        assert in_flight <= set(planner.id_of_slot.tolist())
        # Every id maps to a slot that holds it.
        assert (planner.id_of_slot[plan.unique_slots[plan.inverse[ids >= 0]]] == real).all()
        # Every row sits in its home group's slots; fetches come in slot order.
        occupied_ids = planner.id_of_slot[occupied]
        assert (occupied // (capacity // groups) == occupied_ids % groups).all()
        assert (np.diff(plan.fetch_slots) > 0).all()
        assert len(set(plan.unique_slots.tolist())) == plan.distinct


def _check_fits_after(planner, ids):
    """A refused plan names the first release after which it fits, exactly."""
    with pytest.raises(jaxcache.CapacityError) as info:
        planner.plan(ids)
    after = info.value.fits_after
    if _too_full(ids[ids >= 0].tolist(), set(), planner.capacity, planner.groups):
        assert after is None
        return
    assert planner.released < after < planner.next_index
    earlier = copy.deepcopy(planner)
    earlier.release(after - 1)
    with pytest.raises(jaxcache.CapacityError):
        earlier.plan(ids)
    planner = copy.deepcopy(planner)
    planner.release(after)
    planner.plan(ids)


def test_padding_ids_map_to_minus_one_and_are_not_counted():
    cfg = jaxcache.CacheConfig(10, 2, 4, policy="lru", padding_id=-1)
    planner = jaxcache.Planner(cfg)
    plan = planner.plan(np.array([[3, -1, 3], [-1, -1, 5]]))
    assert plan.inverse.tolist() == [[0, -1, 0], [-1, -1, 1]]
    assert plan.lookups == 3
    assert plan.fetch_ids.tolist() == [3, 5]


def test_only_dirty_victims_are_written_back():
    cfg = jaxcache.CacheConfig(10, 2, 2, policy="lru")
    planner = jaxcache.Planner(cfg)
    planner.plan(np.array([0]), train=True)  # 0 becomes dirty
    planner.release(0)
    planner.plan(np.array([1]), train=False)  # 1 stays clean
    planner.release(1)
    plan = planner.plan(np.array([2, 3]))  # evicts both
    assert plan.evictions == 2
    assert plan.evict_ids.tolist() == [0]


def test_frequency_policy_evicts_the_rarest_row():
    freq = np.array([100, 1, 50, 7, 0, 0])
    cfg = jaxcache.CacheConfig(6, 2, 3, policy="frequency")
    cache = jaxcache.EmbeddingCache(cfg, frequencies=freq)
    assert sorted(cache.planner.resident_ids().tolist()) == [0, 2, 3]  # warmed with hottest
    cache.planner.release(cache.planner.next_index - 1)
    plan = cache.planner.plan(np.array([4]))
    assert plan.fetch_ids.tolist() == [4]
    assert 3 not in cache.planner.resident_ids().tolist()


@pytest.mark.parametrize("policy", jaxcache.POLICIES)
def test_warm_then_repeat_batch_is_all_hits(policy):
    freq = np.arange(20)[::-1].copy()
    cfg = jaxcache.CacheConfig(20, 2, 8, policy=policy)
    planner = jaxcache.Planner(cfg, frequencies=None if policy == "lru" else freq)
    planner.plan(np.array([1, 2, 3, 2]))
    planner.release(0)
    plan = planner.plan(np.array([3, 1, 2]))
    assert (plan.hits, plan.misses, plan.access_hits) == (3, 0, 3)


def test_new_rows_spread_over_devices():
    cfg = jaxcache.CacheConfig(1000, 1, 64, policy="lru")
    planner = jaxcache.Planner(cfg, devices=4)
    plan = planner.plan(np.arange(40))
    per_device = np.bincount(plan.fetch_slots // 16, minlength=4)
    assert per_device.tolist() == [10, 10, 10, 10]


def test_a_directory_saved_with_other_groups_is_placed_by_home():
    cfg = jaxcache.CacheConfig(40, 1, 8, policy="lfu")
    one = jaxcache.Planner(cfg, devices=4)
    one.plan(np.arange(0, 16, 2))  # even ids only: all in group 0 of two groups
    two = jaxcache.Planner(cfg, devices=4, groups=2)
    two.load_state_dict(one.state_dict())
    slots = np.flatnonzero(two.id_of_slot >= 0)
    # Four fit in group 0's slots (0-3); the hottest others would need group 1.
    assert (two.id_of_slot[slots] % 2 == slots // 4).all()
    assert sorted(two.resident_ids().tolist()) == [0, 2, 4, 6]
