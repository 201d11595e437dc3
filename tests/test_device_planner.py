"""The device planner: the host planner's plans, computed in jit on the devices.

A small dict model of the cache checks what must hold of any plan; the host
planner (an independent implementation, compiled loops over NumPy) checks
that the device's choices are its choices, slot for slot.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxcache
from jaxcache._src import device_plan
from jaxcache._src.device_planner import DevicePlanner
from tests.models import host_planners, make_cached, zipf_batches

N = 64


def _mesh(devices):
    return jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("rows",))


def _resident(cache) -> dict[int, int]:
    """Resident id -> global slot (device block after device block)."""
    ids = cache.planner.id_of_slot
    return {int(i): s for s, i in enumerate(ids) if i >= 0}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    devices=st.sampled_from([1, 2, 4]),
    policy=st.sampled_from(jaxcache.planning.POLICIES),
    lookahead=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_plans_against_a_dict_model_and_the_host_planner(devices, policy, lookahead, seed):
    rng = np.random.default_rng(seed)
    batches = [rng.integers(0, N, size=(devices * 2, 3)) for _ in range(8)]
    freq = np.bincount(np.concatenate([b.ravel() for b in batches]), minlength=N)
    cfg = jaxcache.CacheConfig(N, 2, capacity=devices * 8, policy=policy)
    caches = {
        kind: jaxcache.EmbeddingCache(
            cfg, planner=kind, mesh=_mesh(devices), frequencies=freq, warm=False
        )
        for kind in ("host", "device")
    }
    device = caches["device"]
    states = {kind: cache.init_state() for kind, cache in caches.items()}
    in_flight: dict[int, set[int]] = {}  # plan index -> its ids
    for ids in batches:
        # As a pipeline: at most ``lookahead`` earlier plans still in flight.
        released = device.planner.next_index - 1 - lookahead
        for cache in caches.values():
            cache.lifecycle.release(released)
        before = _resident(device)
        staged = {}
        for kind, cache in caches.items():
            try:
                staged[kind] = cache.stage_host(ids)
            except jaxcache.CapacityError as error:
                staged[kind] = error
        if isinstance(staged["device"], jaxcache.CapacityError):
            # Refused alike, with nothing changed.
            assert isinstance(staged["host"], jaxcache.CapacityError)
            assert staged["device"].fits_after == staged["host"].fits_after
            assert _resident(device) == before
            for cache in caches.values():
                cache.lifecycle.release_all()
            continue
        assert not isinstance(staged["host"], jaxcache.CapacityError)
        for kind, cache in caches.items():
            states[kind] = cache.apply(states[kind], cache.to_device(staged[kind]))
        after = _resident(device)
        batch = {int(i) for i in ids.ravel()}
        # Every id of the batch is resident, on its home device, in one slot.
        local = cfg.capacity // devices
        for i in batch:
            assert after[i] // local == i % devices
        assert len(set(after.values())) == len(after)
        # Rows of the batches still in flight were not evicted.
        for plan, plan_ids in in_flight.items():
            if plan > device.planner.released:
                assert plan_ids <= set(after), (plan, plan_ids - set(after))
        # Hits and misses split the distinct ids; evicted ids left the directory.
        stats = device.stats.last
        assert stats.hits + stats.misses == stats.distinct == len(batch)
        assert stats.hits == len(batch & set(before))
        evicted = set(before) - set(after)
        assert len(evicted) == stats.evictions
        mirror = device.planner.host_mirror()
        for part, planner in zip(mirror.parts, mirror.planners, strict=True):
            mine = [i // devices for i in evicted if i % devices == part]
            assert (planner.slot_of_id[mine] == -1).all()
        mirror.check_invariants("device")
        # The host planner chose the same slots and counted the same.
        np.testing.assert_array_equal(device.planner.id_of_slot, caches["host"].planner.id_of_slot)
        assert stats == caches["host"].stats.last
        in_flight[staged["device"].plan.index] = batch


@pytest.mark.parametrize("policy", jaxcache.planning.POLICIES)
def test_training_is_the_host_planners_bit_for_bit(policy):
    # The same slots, hence the same routes and sums: every number agrees.
    def train(planner):
        cfg = jaxcache.CacheConfig(2000, 4, capacity=150, policy=policy)
        batches = list(zipf_batches(2000, 32, 4, 12, seed=2))
        freq = jaxcache.FrequencyCounter(2000).update_all(b for b, _ in batches).counts
        cache = jaxcache.EmbeddingCache(
            cfg, table=jaxcache.HostTable(cfg, seed=1), frequencies=freq, planner=planner
        )
        model, step = make_cached(cache, 4)
        losses = [float(step(ids, y)) for ids, y in batches]
        rows, state = model.embed.export()
        return cache, losses, rows, state

    host, device = train("host"), train("device")
    assert device[0].stats.total.evictions > 100
    assert device[1] == host[1]
    np.testing.assert_array_equal(device[2], host[2])
    assert device[0].stats.total == host[0].stats.total


@pytest.mark.parametrize("policy", ["lfu", "frequency"])
def test_a_pipeline_that_waits_for_room_plans_as_the_host_planner(policy):
    # Batches that often find no room next to the two in flight: the device
    # pipeline has dispatched later plans when a plan fails, and those must
    # not lend the plan made again a later bound than the host planner's.
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(30):
        ids = rng.integers(0, 800, size=(8, 4))
        ids[rng.random((8, 4)) < 0.3] = -1
        batches.append({"ids": ids})
    flat = np.concatenate([b["ids"].ravel() for b in batches])
    freq = np.bincount(flat[flat >= 0], minlength=800)
    cfg = jaxcache.CacheConfig(800, 4, capacity=48, policy=policy, padding_id=-1)

    def run(planner):
        cache = jaxcache.EmbeddingCache(cfg, planner=planner, frequencies=freq)
        embed = jaxcache.nnx.CachedEmbed(cache)
        with jaxcache.prefetch(batches, {"ids": embed}, lookahead=2) as pipeline:
            for _ in pipeline:
                pass
        return cache

    host, device = run("host"), run("device")
    assert host.stats.total.rows_to_device > 20 * 30  # mostly misses: room is short
    assert device.stats.total == host.stats.total
    np.testing.assert_array_equal(device.planner.id_of_slot, host.planner.id_of_slot)


@pytest.mark.parametrize(
    ("devices", "raw", "bags"), [(1, False, False), (2, False, True), (2, True, True)]
)
def test_an_empty_batch_plans_as_on_the_host(devices, raw, bags):
    # A batch of no ids is a plan of nothing on either planner: an empty
    # lookup, and the stream goes on with the same slots and statistics.
    vocabulary = jaxcache.DynamicVocabulary(ways=16) if raw else None
    cfg = jaxcache.CacheConfig(
        N, 2, capacity=devices * 16, padding_id=-1 if bags else None, vocabulary=vocabulary
    )
    rng = np.random.default_rng(3)
    width = (3,) if bags else ()
    batches = [rng.integers(0, N, size=(devices * 2, *width)) for _ in range(4)]
    batches.insert(2, np.zeros((0, *width), np.int64))
    caches = {
        kind: jaxcache.EmbeddingCache(cfg, planner=kind, mesh=_mesh(devices))
        for kind in ("host", "device")
    }
    states = {kind: cache.init_state() for kind, cache in caches.items()}
    for ids in batches:
        for kind, cache in caches.items():
            states[kind], lookup = cache.prepare(states[kind], ids)
            assert jaxcache.device.lookup_rows(states[kind].rows, lookup).shape == (*ids.shape, 2)
        assert caches["device"].stats.last == caches["host"].stats.last
        assert _resident(caches["device"]) == _resident(caches["host"])
    assert caches["device"].stats.steps == len(batches)


def test_raw_ids_waiting_for_room_plan_as_the_host_planner():
    # Rows of forgotten ids, still resident, are given to new ids and
    # fetched again into their slots: a refusal for room must count them
    # among the hits, as the host planner does, or it waits for a later
    # plan than the host and then protects fewer rows.
    rng = np.random.default_rng(6)  # a stream where such a refusal happens
    pool = rng.integers(-(2**62), 2**62, 600)
    zipf = 1.0 / np.arange(1, 601) ** 1.05
    batches = [{"r": pool[rng.choice(600, (32, 1), p=zipf / zipf.sum())]} for _ in range(30)]
    vocabulary = jaxcache.DynamicVocabulary(admit_after=2, forget="lru", ways=16)
    cfg = jaxcache.CacheConfig(64, 4, capacity=48, vocabulary=vocabulary)

    def run(planner):
        cache = jaxcache.EmbeddingCache(cfg, planner=planner, mesh=_mesh(4))
        with jaxcache.prefetch(batches, {"r": jaxcache.nnx.CachedEmbed(cache)}) as pipeline:
            for _ in pipeline:
                pass
        return cache

    host, device = run("host"), run("device")
    assert host.stats.total.forgotten_ids > 50
    assert device.stats.total == host.stats.total
    np.testing.assert_array_equal(device.planner.id_of_slot, host.planner.id_of_slot)


@pytest.mark.parametrize("devices", [1, 2])
def test_adaptive_keys_stay_in_int32_in_a_run_of_any_length(devices):
    # The host's keys grow by 256 a plan (int64); the device's move down
    # with their base every ``key_span`` plans (2^20; 3 here, so that a short
    # run crosses a hundred moves, re-keys and a round trip to the host), and
    # the plans stay the host planner's.
    cfg = jaxcache.CacheConfig(N, 2, capacity=devices * 8, policy="adaptive")
    rng = np.random.default_rng(5)
    caches = {
        kind: jaxcache.EmbeddingCache(cfg, planner=kind, mesh=_mesh(devices))
        for kind in ("host", "device")
    }
    planner = caches["device"].planner
    assert isinstance(planner, DevicePlanner)
    planner.key_span = 3
    states = {kind: cache.init_state() for kind, cache in caches.items()}
    bonuses, bases = set(), set()
    for step in range(300):
        ids = np.minimum(rng.zipf(1.3, size=(devices * 2, 3)), N) - 1
        for kind, cache in caches.items():
            states[kind], _ = cache.prepare(states[kind], ids)
        np.testing.assert_array_equal(planner.id_of_slot, caches["host"].planner.id_of_slot)
        assert caches["device"].stats.last == caches["host"].stats.last
        bonuses.update(learner.bonus for learner in planner.learners)
        scalars = np.asarray(planner.state.scalars).reshape(devices, -1)
        by_time = scalars[:, 2] >= 0
        # By time, the base follows the plans (a re-key puts it span before).
        assert (planner.next_index - scalars[by_time, 4] <= 2 * planner.key_span).all()
        bases.update(scalars[by_time, 4].tolist())
        if step == 150:
            planner.edit(lambda mirror: None)  # to the host's keys and back
    keys = np.asarray(planner.state.keys)
    assert device_plan.KEY_FLOOR <= keys.min() and keys.max() <= device_plan.KEY_CEIL
    assert len(bases) > 10  # moved on the way
    assert len(bonuses) > 2  # and re-keyed


def test_a_re_key_with_nothing_resident_leaves_the_new_keys_room():
    # Keyed by count with an offset of 2^28 - KEY_FLOOR, every new row's key
    # would sit at the ceiling, and its order among them would be lost.
    cfg = jaxcache.CacheConfig(N, 2, capacity=8, policy="adaptive")
    planner = jaxcache.EmbeddingCache(cfg, planner="device").planner
    assert isinstance(planner, DevicePlanner)
    rekey = device_plan.make_rekey(planner.mesh, planner.axis, planner.key_span)
    planner.state = rekey(planner.state, np.array([-1], np.int32))
    _, _, bonus, offset, _ = np.asarray(planner.state.scalars).tolist()
    assert (bonus, offset) == (-1, 0)


@pytest.mark.parametrize("saved, restored", [("host", "device"), ("device", "host")])
def test_a_checkpoint_of_one_planner_restores_exactly_into_the_other(saved, restored):
    cfg = jaxcache.CacheConfig(2000, 4, capacity=150, policy="adaptive")
    batches = list(zipf_batches(2000, 32, 4, 16, seed=4))

    def make(planner, table=None):
        cache = jaxcache.EmbeddingCache(
            cfg, table=table or jaxcache.HostTable(cfg, seed=1), planner=planner
        )
        return cache, *make_cached(cache, 4)

    original, model, step = make(saved)
    for ids, y in batches[:8]:
        step(ids, y)
    model.embed.flush()
    state = original.state_dict()
    # The other planner, on a copy of the host table: it continues exactly.
    table = jaxcache.HostTable(cfg, rows=np.array(original.table.rows))
    table.state.update({k: np.array(v) for k, v in original.table.state.items()})
    other, other_model, other_step = make(restored, table)
    other.load_state_dict(state)
    other_model.embed.set_state(other.init_state())
    from flax import nnx

    nnx.update(other_model, nnx.state(model, nnx.Param))
    for a, b in zip(host_planners(original), host_planners(other), strict=True):
        np.testing.assert_array_equal(a.id_of_slot, b.id_of_slot)
        np.testing.assert_array_equal(a.policy.counts, b.policy.counts)
    for ids, y in batches[8:]:
        step(ids, y)
        other_step(ids, y)
    np.testing.assert_array_equal(original.planner.id_of_slot, other.planner.id_of_slot)
    assert original.stats.last == other.stats.last


@pytest.mark.parametrize("devices", [1, 4])
def test_a_restore_onto_more_slots_plans_as_the_host_planner(tmp_path, devices):
    # Restored onto more slots than there are counted ids, the cache warms
    # its free slots with the hottest counted rows; those never used keep
    # the adaptive key of a row last used before plan 0, below every key of
    # normal running. Free slots must still be taken before any of them.
    def embed(capacity, devices, planner):
        cfg = jaxcache.CacheConfig(100, 2, capacity=capacity, optimizer=jaxcache.adagrad(0.1))
        cache = jaxcache.EmbeddingCache(cfg, planner=planner, mesh=_mesh(devices))
        return jaxcache.nnx.CachedEmbed(cache)

    saved = embed(8 * devices, devices, "host")
    for b in range(6):  # 48 ids, each seen once
        saved.prepare(np.arange(8 * b, 8 * b + 8).reshape(4, 2))
    checkpointer = jaxcache.Checkpointer(tmp_path)
    checkpointer.save(6, caches=[saved])
    restored = {kind: embed(64, 1, kind) for kind in ("host", "device")}
    for module in restored.values():
        checkpointer.restore(caches=[module])
    rng = np.random.default_rng(0)
    for step in range(8):
        ids = np.arange(60 + 8 * step, 68 + 8 * step) if step < 2 else rng.integers(0, 100, 8)
        for module in restored.values():
            module.prepare(ids.reshape(4, 2))
        host, device = (restored[kind].cache for kind in ("host", "device"))
        assert device.stats.last == host.stats.last, step
        np.testing.assert_array_equal(device.planner.id_of_slot, host.planner.id_of_slot)
        if step == 0:  # 16 slots were free: 8 misses take 8 of them
            assert (host.stats.last.misses, host.stats.last.evictions) == (8, 0)


def test_ids_past_int32_are_found_on_the_device_with_nothing_changed():
    cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, 8), planner="device")
    state, _ = cache.prepare(cache.init_state(), np.array([1, 2]))
    slots = cache.planner.id_of_slot
    # 2^32 + 1 would become 1 if it were cut to int32 on the way.
    with pytest.raises(ValueError, match=r"holds 4294967297 at index \(1,\)"):
        cache.prepare(state, np.array([3, 2**32 + 1], np.int64))
    np.testing.assert_array_equal(cache.planner.id_of_slot, slots)
    assert cache.planner.next_index == 1
    state, _ = cache.prepare(state, np.array([3], np.int64))
    assert cache.stats.last.misses == 1 and cache.planner.next_index == 2


def test_the_plan_state_is_donated_and_warm_steps_compile_nothing():
    cfg = jaxcache.CacheConfig(1000, 4, capacity=64, policy="lfu")
    cache = jaxcache.EmbeddingCache(cfg, planner="device", mesh=_mesh(2))
    assert isinstance(cache.planner, DevicePlanner)
    state = cache.init_state()
    batches = [ids for ids, _ in zipf_batches(1000, 8, 4, 12, seed=3)]
    for ids in batches[:6]:
        old = cache.planner.state.slot_of_id
        state, _ = cache.prepare(state, ids)
        assert old.is_deleted()
    before = jaxcache.testing.compilations()
    for ids in batches[6:]:
        state, _ = cache.prepare(state, ids)
    assert jaxcache.testing.compilations() == before
    assert cache.stats.total.evictions > 0


def test_the_host_callback_form_and_split_devices_are_refused_with_the_fix():
    cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, 8), planner="device")
    with pytest.raises(RuntimeError, match='planner="host"'):
        cache.callbacks.check()
    with pytest.raises(ValueError, match=r"partitions_per_device=2 .* leave it None"):
        jaxcache.EmbeddingCache(
            jaxcache.CacheConfig(100, 4, 8), planner="device", partitions_per_device=2
        )
    with pytest.raises(ValueError, match="planner='gpu' is not a planner"):
        jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, 8), planner="gpu")


@pytest.mark.parametrize("policy", ["lru", "adaptive"])
def test_the_plan_updates_the_directory_in_place(policy):
    # The [N] arrays (directory, counts) are donated and written in place:
    # a plan's scratch memory follows the batch and the capacity, never N.
    n = 1 << 22
    cache = jaxcache.EmbeddingCache(
        jaxcache.CacheConfig(n, 4, capacity=4096, policy=policy), planner="device"
    )
    planner = cache.planner
    ids = np.arange(512, dtype=np.int32).reshape(64, 8)
    program = device_plan.make_plan(
        planner._spec(False, ids.size, True), planner.mesh, planner.axis
    )
    args = np.array([0, -1, 1, 0], np.int32)
    memory = program.lower(planner.state, ids, args).compile().memory_analysis()
    directory = 4 * n * (1 if policy == "lru" else 2)
    assert memory.alias_size_in_bytes >= directory
    assert memory.temp_size_in_bytes < n  # a quarter of one [N] int32 array


def test_a_replay_counts_the_same_with_either_planner():
    trace = np.random.default_rng(0).zipf(1.2, size=6000) % 600
    counts = np.bincount(trace, minlength=600)
    for policy in jaxcache.planning.POLICIES:
        results = [
            jaxcache.sizing.sweep(
                trace,
                batch=200,
                capacities=[160, 320],
                policies=[policy],
                num_embeddings=600,
                frequencies=counts,
                planner=planner,
            )
            for planner in ("host", "device")
        ]
        assert results[0] == results[1], policy
    assert results[0][0]["evictions"] > 0
