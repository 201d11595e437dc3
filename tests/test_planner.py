"""The planner against a small, obviously-correct dict model (hypothesis)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxcache
from jaxcache._src.partitions import Partitions
from jaxcache._src.placement import Layout
from jaxcache._src.threads import HostThreads


class DictPlanner:
    """Slots as Python lists, one id at a time: the specification.

    Id ``i`` lives only in the slots of its home partition (``Layout``:
    ``i % devices`` picks the device, ``i // devices % split`` which of its
    ``split`` partitions; each partition's ``local`` slots, or as many as it
    has ids); each partition chooses its victims among its own unprotected
    slots, and its misses, in order of first appearance, take them in
    rising slot order."""

    def __init__(self, n, capacity, policy, frequencies, devices=1, split=1):
        layout = Layout(devices=devices, split=split)
        self.home = lambda i: int(layout.part_of(np.array(i)))
        self.parts, self.local = layout.parts, capacity // layout.parts
        self.sizes = [min(self.local, layout.part_rows(n, t)) for t in range(self.parts)]
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
        distinct = list(dict.fromkeys(ids))  # in order of first appearance
        misses = [i for i in distinct if i not in resident]
        protected = {s for s in range(len(self.ids)) if self.last_use[s] > released}
        protected |= {resident[i] for i in distinct if i in resident}
        fetched = []
        for part in range(self.parts):
            block = range(part * self.local, part * self.local + self.sizes[part])
            mine = [i for i in misses if self.home(i) == part]
            candidates = sorted(
                (s for s in block if s not in protected), key=lambda s: (self.key(s), s)
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


def _too_full(ids, in_flight, sizes, home):
    """Whether some partition's distinct ids and in-flight rows exceed its slots."""
    needed = set(ids) | in_flight
    return any(len([i for i in needed if home(i) == t]) > sizes[t] for t in range(len(sizes)))


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
    split=st.sampled_from([1, 1, 2, 3]),
    padded=st.booleans(),
)
def test_planner_matches_dict_model(policy, capacity, seed, lags, reserve, devices, split, padded):
    n = 40
    layout = Layout(devices=devices, split=split)
    parts = layout.parts
    capacity = max(parts, capacity // parts * parts)
    rng = np.random.default_rng(seed)
    frequencies = rng.integers(0, 50, n)
    cfg = jaxcache.CacheConfig(n, 1, capacity, policy=policy, padding_id=-1 if padded else None)
    counts = frequencies if policy != "lru" else None
    planner = Partitions(cfg, layout, frequencies=counts, reserve=reserve)
    model = DictPlanner(n, capacity, policy, counts, devices, split)
    local = capacity // parts
    for lag in lags:
        # Release all but the last `lag` plans, as a pipeline with look-ahead does.
        released = planner.next_index - 1 - lag
        planner.release(released)
        ids = rng.integers(0, n, size=devices * int(rng.integers(1, 6)))
        if padded:  # bags padded with -1, which the model never sees
            ids = np.where(rng.random(ids.size) < 0.3, -1, ids)
        real = ids[ids >= 0]
        in_flight = set(planner.id_of_slot[planner.last_use > planner.released].tolist())
        before = planner.id_of_slot
        try:
            step = planner.plan(ids)
        except jaxcache.CapacityError:
            # Refused: nothing may have changed, and it was really too full.
            np.testing.assert_array_equal(planner.id_of_slot, before)
            assert _too_full(real.tolist(), in_flight, model.sizes, model.home)
            _check_fits_after(planner, ids, model.sizes, model.home)
            continue
        hits, misses = model.plan(real.tolist(), planner.released)
        assert step.total("hits") == hits
        fetched = [layout.part_global_ids(t, plan.fetch_ids) for t, plan in enumerate(step.plans)]
        assert np.concatenate(fetched).tolist() == misses
        assert step.total("hits") + step.misses == step.distinct == len(set(real.tolist()))
        assert step.total("lookups") == real.size
        # Same slots as the specification.
        assert planner.id_of_slot.tolist() == [-1 if i is None else i for i in model.ids]
        # Rows of in-flight plans never leave.
        assert in_flight <= set(planner.id_of_slot.tolist())
        # Every row sits in its home partition's slots (of its home device).
        occupied = np.flatnonzero(planner.id_of_slot >= 0)
        assert (occupied // local == layout.part_of(planner.id_of_slot[occupied])).all()
        assert (occupied // (local * layout.split) == planner.id_of_slot[occupied] % devices).all()
        for d, (part, plan) in enumerate(zip(planner.planners, step.plans, strict=True)):
            # Each directory is a bijection between resident ids and occupied slots.
            mine = np.flatnonzero(part.id_of_slot >= 0)
            assert (part.slot_of_id[part.id_of_slot[mine]] == mine).all()
            assert np.count_nonzero(part.slot_of_id >= 0) == mine.size
            assert (np.diff(plan.fetch_slots) > 0).all()  # fetches in slot order
            assert len(set(plan.unique_slots.tolist())) == plan.distinct
            # Every id maps to a slot that holds it: through its rank among the
            # distinct ids its source (a slice of the batch) sends its home.
            real_at = np.flatnonzero((ids >= 0) & (layout.part_of(ids) == d))
            if parts == 1:
                rows = plan.inverse.reshape(-1)[real_at]
            else:
                source = real_at // (ids.size // devices)
                split = step.split  # each source's groups, apart in its room
                filled = np.concatenate(
                    [
                        np.arange(b, e)
                        for b, e in zip(split.begin.ravel(), split.end.ravel(), strict=True)
                    ]
                )
                ranks = np.empty(ids.size, np.int64)
                ranks[split.at[filled]] = split.ranks[filled]  # by position in the batch
                ranks = ranks[real_at]
                assert (ranks < step.sent[d][source]).all()
                rows = plan.inverse[step.bounds[d][source] + ranks]
                # Each source's ranks name distinct rows.
                for s in range(devices):
                    named = plan.inverse[step.bounds[d][s] : step.bounds[d][s] + step.sent[d][s]]
                    assert np.unique(named).size == named.size
            held = part.id_of_slot[plan.unique_slots[rows]]
            assert (layout.part_global_ids(d, held) == ids[real_at]).all()
        # The planners' own checks: directories, recency, the policy's mirror.
        planner.check_invariants("t")


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    devices=st.sampled_from([2, 4, 8]),
    processes=st.sampled_from([2, 4]),
    steps=st.integers(1, 4),
    threads=st.sampled_from([1, 2]),
    split=st.sampled_from([1, 2]),
)
def test_processes_rank_what_crosses_between_them_alike(
    seed, devices, processes, steps, threads, split
):
    # A source ranks the ids it sends another process's device with a hash
    # table; that owner ranks them in its planner. Both must agree on every
    # rank (the row each entry reads) and on how many rows cross, on any
    # number of host threads.
    if devices % processes:
        processes = devices
    rng = np.random.default_rng(seed)
    n = 64
    cfg = jaxcache.CacheConfig(n, 1, n, policy="lru", padding_id=-1)  # every row fits
    parts = [
        Partitions(cfg, Layout(devices, processes, p, split), threads=HostThreads(threads))
        for p in range(processes)
    ]
    for _ in range(steps):
        ids = rng.integers(0, n, size=(devices * int(rng.integers(1, 12)), 2))
        ids = np.where(rng.random(ids.shape) < 0.2, -1, ids)
        plans = [part.plan(ids) for part in parts]
        for part in parts:
            part.release_all()
        for home, plan in zip(parts, plans, strict=True):
            others = [(s, p) for s, p in zip(parts, plans, strict=True) if s is not home]
            for row, part in enumerate(home.parts):
                residue = home.layout.part_residue(part)
                got_lo, got_hi = plan.split.chunks(residue)
                for sender, sent in others:
                    lo, hi = sent.split.chunks(residue)
                    for at, source in enumerate(sender.layout.own):
                        assert sent.sent_out[at, part] == plan.sent[row, source]
                        for field in ("ranks", "local"):
                            np.testing.assert_array_equal(
                                getattr(sent.split, field)[lo[source] : hi[source]],
                                getattr(plan.split, field)[got_lo[source] : got_hi[source]],
                            )


def _check_fits_after(planner, ids, sizes, home):
    """A refused plan names the first release after which it fits, exactly."""
    with pytest.raises(jaxcache.CapacityError) as info:
        planner.plan(ids)
    after = info.value.fits_after
    if _too_full(ids[ids >= 0].tolist(), set(), sizes, home):
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
    planner = jaxcache.planning.Planner(cfg)
    plan = planner.plan(np.array([[3, -1, 3], [-1, -1, 5]]))
    assert plan.inverse.tolist() == [[0, -1, 0], [-1, -1, 1]]
    assert plan.lookups == 3
    assert plan.fetch_ids.tolist() == [3, 5]


def test_only_dirty_victims_are_written_back():
    cfg = jaxcache.CacheConfig(10, 2, 2, policy="lru")
    planner = jaxcache.planning.Planner(cfg)
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
    cache.lifecycle.release_all()
    plan = cache.planner.plan(np.array([4])).plans[0]
    assert plan.fetch_ids.tolist() == [4]
    assert 3 not in cache.planner.resident_ids().tolist()


@pytest.mark.parametrize("policy", jaxcache.planning.POLICIES)
def test_warm_then_repeat_batch_is_all_hits(policy):
    freq = np.arange(20)[::-1].copy()
    cfg = jaxcache.CacheConfig(20, 2, 8, policy=policy)
    planner = jaxcache.planning.Planner(cfg, frequencies=None if policy == "lru" else freq)
    planner.plan(np.array([1, 2, 3, 2]))
    planner.release(0)
    plan = planner.plan(np.array([3, 1, 2]))
    assert (plan.hits, plan.misses, plan.access_hits) == (3, 0, 3)


def test_new_rows_go_to_their_home_devices():
    cfg = jaxcache.CacheConfig(1000, 1, 64, policy="lru")
    step = Partitions(cfg, Layout(devices=4)).plan(np.arange(40))
    assert [plan.misses for plan in step.plans] == [10, 10, 10, 10]
    assert step.plans[3].fetch_ids.tolist() == list(range(10))  # ids 3, 7, ..., 39


def test_a_directory_saved_with_other_devices_is_placed_by_home():
    cfg = jaxcache.CacheConfig(40, 1, 8, policy="lfu")
    one = Partitions(cfg, Layout(devices=1))
    one.plan(np.arange(0, 16, 2))  # even ids only: all homed on device 0 of two
    two = Partitions(cfg, Layout(devices=2))
    two.load_state_dict(one.state_dict())
    slots = np.flatnonzero(two.id_of_slot >= 0)
    # Four fit in device 0's slots (0-3); the hottest others would need device 1.
    assert (two.id_of_slot[slots] % 2 == slots // 4).all()
    assert sorted(two.resident_ids().tolist()) == [0, 2, 4, 6]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_victim_reserve_shrinks_once_the_cache_has_filled(policy):
    # Filling the cache needs a reserve of every slot; kept, it would make
    # every later step scan all of them. The choice is that of a planner
    # that always scans every slot.
    cfg = jaxcache.CacheConfig(100_000, 1, 2000, policy=policy)
    small = jaxcache.planning.Planner(cfg, reserve=64)
    everything = jaxcache.planning.Planner(cfg, reserve=10**9)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 100_000, 1500)] + [rng.zipf(1.3, 60) % 100_000 for _ in range(40)]
    for planner in (small, everything):
        for batch in batches:
            planner.release(planner.next_index - 1)
            planner.plan(batch)
    np.testing.assert_array_equal(small.id_of_slot, everything.id_of_slot)
    assert everything._candidates.size == 2000
    assert small._candidates.size < 2000 // 4
