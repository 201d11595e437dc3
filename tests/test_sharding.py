"""Rows sharded over a mesh: routed lookups and updates stay exact."""

from __future__ import annotations

import contextlib
import functools
import sys
import threading

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxcache
from jaxcache._src.agreement import Agreement
from jaxcache._src.blocks import local_data
from jaxcache._src.partitions import Partitions
from jaxcache._src.placement import Layout
from jaxcache._src.threads import HostThreads
from tests.models import dense_params, make_cached, make_callback, make_reference, zipf_batches

# Every test here runs with both planners (``conftest.planner``).
pytestmark = pytest.mark.usefixtures("planner")

N, D, B, F = 20000, 8, 32, 4


def _mesh(devices):
    return Mesh(np.array(jax.devices()[:devices]), ("rows",))


def _train(
    devices,
    policy,
    capacity,
    lookahead,
    steps=12,
    route_capacity=None,
    opt=None,
    threads=1,
    split=None,
    agree=False,
):
    opt = opt or jaxcache.adam(0.02)
    batches = [{"ids": i, "y": y} for i, y in zipf_batches(N, B, F, steps, seed=11)]
    cfg = jaxcache.CacheConfig(
        N, D, capacity, policy=policy, optimizer=opt, route_capacity=route_capacity
    )
    freq = jaxcache.FrequencyCounter(N).update_all(b["ids"] for b in batches[:3]).counts
    cache = jaxcache.EmbeddingCache(
        cfg,
        table=jaxcache.HostTable(cfg, seed=1),
        frequencies=freq,
        mesh=_mesh(devices),
        threads=threads,
        partitions_per_device=split,
    )
    if agree:  # the path of several processes, with an agreement of one
        cache.planner.agreement = Agreement()
    model, train = make_cached(cache, F)
    with jaxcache.prefetch(batches, {"ids": model.embed}, lookahead=lookahead) as pipeline:
        losses = [float(train.with_lookup(b["ids"], b["y"])) for b in pipeline]
    return cache, model, losses, batches


@functools.cache
def _reference(steps=12):
    """The full-table run on one device (Adam), shared by every sharded run."""
    batches = [{"ids": i, "y": y} for i, y in zipf_batches(N, B, F, steps, seed=11)]
    cfg = jaxcache.CacheConfig(N, D, 8)
    reference, ref_train = make_reference(
        np.array(jaxcache.HostTable(cfg, seed=1).rows), jaxcache.adam(0.02), F
    )
    losses = [float(ref_train(b["ids"], b["y"])) for b in batches]
    return reference, losses


def _assert_matches(model, losses, reference, ref_losses, tol=1e-5):
    rows, state = model.embed.export()
    assert np.abs(rows - np.asarray(reference.embed.table[...])).max() <= tol
    ref_state = reference.embed.opt_state.get_value()
    for name in state:
        assert np.abs(state[name] - np.asarray(ref_state[name])).max() <= tol, name
    for a, b in zip(dense_params(model), dense_params(reference), strict=True):
        assert np.abs(a - b).max() <= tol
    np.testing.assert_allclose(losses, ref_losses, atol=tol)


@pytest.mark.parametrize(
    "devices, split",
    [
        (1, 1),
        (2, 1),
        (4, 1),
        (8, 1),
        pytest.param(1, 4, marks=pytest.mark.host_planner),
        pytest.param(2, 3, marks=pytest.mark.host_planner),
    ],
)
def test_sharded_training_matches_full_table(devices, split, planner):
    reference, ref_losses = _reference()
    for policy in jaxcache.planning.POLICIES:
        # Heavy churn: the cache holds barely more than the look-ahead window.
        cache, model, losses, _ = _train(devices, policy, 400, lookahead=2, split=split)
        assert cache.devices == devices and cache.stats.total.evictions > 60, policy
        assert cache.planner_kind == planner
        assert cache.layout.parts == devices * split
        rows = model.embed.rows[...]
        capacity = -(-400 // (devices * split)) * devices * split  # rounded up
        assert rows.sharding.shard_shape(rows.shape)[0] == capacity // devices
        _assert_matches(model, losses, reference, ref_losses)


@pytest.mark.parametrize(
    "lookahead, devices, split",
    [(0, 4, 1), (2, 4, 1), pytest.param(2, 1, 4, marks=pytest.mark.host_planner)],
)
def test_training_is_bit_identical_for_any_number_of_host_threads(
    lookahead, devices, split, planner
):
    # Heavy churn on 4 devices, or on one device of 4 partitions: each
    # partition planned, routed, gathered and written back on 1, 2 or 4
    # host threads. The device planner's policies choose on the devices:
    # its threads gather, write back and (adaptive) learn, whatever the policy.
    policies = jaxcache.planning.POLICIES if planner == "host" else ("adaptive", "lru")
    for policy in policies:
        runs = []
        for threads in (1, 2, 4):
            cache, model, losses, _ = _train(
                devices, policy, 400, lookahead, threads=threads, split=split
            )
            assert cache.threads.count == threads and cache.stats.total.evictions > 60
            rows, state = model.embed.export()
            runs.append((losses, rows, state, cache.stats.total, cache.planner.id_of_slot))
        for losses, rows, state, stats, slots in runs[1:]:
            assert losses == runs[0][0], policy
            np.testing.assert_array_equal(rows, runs[0][1])
            for name in state:
                np.testing.assert_array_equal(state[name], runs[0][2][name])
            assert stats == runs[0][3]
            np.testing.assert_array_equal(slots, runs[0][4])


@pytest.mark.parametrize("devices", [2, 8])
def test_sharded_weighted_bags_with_padding_match_full_table(devices):
    # [B, F, L] bags, three quarters of the positions padding, per-id weights: pooling
    # reads only the real positions of each device's share of the batch.
    bag, steps, rng = 8, 10, np.random.default_rng(3)
    batches = []
    for ids, y in zipf_batches(N, B * bag, F, steps, seed=12):
        ids = ids.reshape(B, bag, F).transpose(0, 2, 1).copy()
        ids[rng.random(ids.shape) < 0.75] = -1
        ids[0, 0] = -1  # an empty bag
        batches.append({"ids": ids, "w": rng.uniform(0.5, 2.0, ids.shape), "y": y[:B]})
    cfg = jaxcache.CacheConfig(N, D, 600, optimizer=jaxcache.adam(0.02), padding_id=-1)
    rows = np.array(jaxcache.HostTable(cfg, seed=1).rows)
    reference, ref_train = make_reference(rows, cfg.optimizer, F, combiner="mean")
    ref_losses = [float(ref_train(b["ids"], b["y"], b["w"].astype(np.float32))) for b in batches]
    cache = jaxcache.EmbeddingCache(
        cfg, table=jaxcache.HostTable(cfg, rows=rows), mesh=_mesh(devices)
    )
    model, train = make_cached(cache, F, combiner="mean")
    losses = []
    with jaxcache.prefetch(batches, {"ids": model.embed}, lookahead=2) as pipeline:
        for b in pipeline:
            share = b["ids"].inverse.size // devices
            assert b["ids"].positions.shape[0] == devices
            assert b["ids"].positions.shape[1] < share  # padding is skipped
            losses.append(float(train.with_lookup(b["ids"], b["y"], b["w"].astype(np.float32))))
    assert cache.stats.total.evictions > 100
    _assert_matches(model, losses, reference, ref_losses)


@pytest.mark.host_planner
def test_forced_overflow_is_exact():
    # One row per (device, owner) pair through all_to_all: most rows overflow.
    cache, model, losses, _ = _train(8, "lru", 400, lookahead=1, route_capacity=1)
    assert cache.stats.total.overflow > 100
    _assert_matches(model, losses, *_reference())


def _route_in_ids(cache, lookup):
    """A lookup's arrays with every slot replaced by the id it holds (-1:
    padding): what must not depend on the capacity."""
    n, cl = cache.devices, cache.local_capacity
    id_of_slot = np.append(cache.planner.id_of_slot, -1)  # the last: padding
    owners = np.arange(n)[:, None]
    requests = np.asarray(lookup.requests)
    owner_slots = np.asarray(lookup.owner_slots)
    overflow = np.asarray(lookup.overflow)
    return {
        "inverse": np.asarray(lookup.inverse),
        "owner_inverse": np.asarray(lookup.owner_inverse),
        "requests": id_of_slot[
            np.where(requests == cl, n * cl, owners[:, :, None] * cl + requests)
        ],
        "owner_slots": id_of_slot[np.where(owner_slots == cl, n * cl, owners * cl + owner_slots)],
        "overflow": id_of_slot[overflow],  # padding: n * cl
    }


@pytest.mark.parametrize(
    "devices,route_capacity",
    [
        (1, None),
        pytest.param(1, 16, marks=pytest.mark.host_planner),
        (4, None),
        pytest.param(4, 2, marks=pytest.mark.host_planner),
    ],
)
def test_routes_number_rows_alike_at_any_capacity(devices, route_capacity):
    # Each id's row in the received buffer, each received row's number among
    # its owner's rows, the order of the rows requested and overflowed: all
    # follow the batch's ids, not which rows were cached or where, so a
    # device sums each row's gradients in the same order at any capacity (a
    # GPU's deterministic scatter-add sums in the order of these numbers).
    def routes(capacity):
        cfg = jaxcache.CacheConfig(
            N,
            D,
            capacity,
            policy="lru",
            optimizer=jaxcache.adagrad(0.1),
            route_capacity=route_capacity,
        )
        table = jaxcache.HostTable(cfg, seed=1)
        make = jaxcache.EmbeddingCache if capacity < N else jaxcache.EmbeddingCache.full_table
        cache = make(cfg, table=table, mesh=_mesh(devices))
        model, train = make_cached(cache, F)
        out = []
        for ids, y in zipf_batches(N, B, F, 10, seed=11):
            lookup = model.embed.prepare(ids)
            out.append(_route_in_ids(cache, lookup))
            train.with_lookup(lookup, y)
        return cache, out

    tight, tight_routes = routes(400)
    _, full_routes = routes(N)
    assert tight.stats.total.evictions > 100
    if route_capacity is not None:
        assert tight.stats.total.overflow > 20
    for step, (a, b) in enumerate(zip(tight_routes, full_routes, strict=True)):
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=f"{name} of step {step}")


def test_every_row_lives_on_its_home_device():
    cache, _, _, batches = _train(4, "lru", 400, lookahead=0, steps=3)
    assert cache.stats.total.evictions == 0
    ids = cache.planner.id_of_slot
    occupied = np.flatnonzero(ids >= 0)
    assert (occupied // 100 == ids[occupied] % 4).all()  # id i only on device i % 4
    # So each device holds exactly the distinct ids homed on it.
    distinct = np.unique(np.concatenate([b["ids"].ravel() for b in batches[:3]]))
    per_device = np.bincount(occupied // 100, minlength=4)
    assert per_device.tolist() == np.bincount(distinct % 4, minlength=4).tolist()


def test_sharded_swap_donates():
    cfg = jaxcache.CacheConfig(N, D, 64)
    cache = jaxcache.EmbeddingCache(cfg, mesh=_mesh(8))
    state = cache.init_state()
    old = state.rows
    state, _ = cache.prepare(state, np.arange(16).reshape(8, 2))
    assert old.is_deleted() and not state.rows.is_deleted()


def test_batch_must_split_over_devices():
    cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(N, D, 64), mesh=_mesh(4))
    state = cache.init_state()
    with pytest.raises(ValueError, match=r"shape \(6, 2\) do not split over the 4 devices"):
        cache.prepare(state, np.zeros((6, 2), np.int64))
    assert cache.planner.next_index == 0


def test_capacity_rounds_up_to_the_devices():
    cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(N, D, 61), mesh=_mesh(8))
    assert cache.config.capacity == 64 and cache.local_capacity == 8


@pytest.mark.host_planner
def test_capacity_rounds_up_to_the_partitions_and_a_bad_split_is_refused():
    cache = jaxcache.EmbeddingCache(
        jaxcache.CacheConfig(N, D, 61), mesh=_mesh(2), partitions_per_device=3
    )
    assert cache.config.capacity == 66 and cache.planner.part_capacity == 11
    assert [p.capacity for p in cache.planner.planners] == [11] * 6
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="partitions_per_device"):
            jaxcache.EmbeddingCache(jaxcache.CacheConfig(N, D, 64), partitions_per_device=bad)
    with pytest.raises(ValueError, match="2 device\\(s\\) x 3 partitions"):
        jaxcache.EmbeddingCache(
            jaxcache.CacheConfig(10, D, 9), mesh=_mesh(2), partitions_per_device=3
        )


@pytest.mark.host_planner  # the host planner's routes
@pytest.mark.parametrize("k, split", [(1, 1), (2, 1), (8, 1), (1, 2), (8, 5)])
def test_routed_gather_and_update_against_numpy(k, split):
    from jax.sharding import PartitionSpec as P

    from jaxcache._src import device_ops, routing

    n, cl, d = 8, 50, 4
    mesh = _mesh(n)
    rng = np.random.default_rng(0)
    table = rng.normal(size=(n * cl, d)).astype(np.float32)
    ids = rng.choice(1000, size=(16, 5))
    ids[0, 0] = -1  # padding
    real = ids >= 0
    layout = Layout(devices=n, split=split)
    parts = Partitions(jaxcache.CacheConfig(1000, d, n * cl, padding_id=-1), layout)
    step = parts.plan(ids)
    # Each id's global slot: its home partition's block (of its home
    # device's), its local slot there.
    homes = layout.part_of(ids)
    slots = np.where(real, -1, -1)
    for part, planner in enumerate(parts.planners):
        mine = real & (homes == part)
        slots[mine] = part * (cl // split) + planner.slot_of_id[layout.part_local_ids(ids[mine])]
    owner_size = int(step.own_needs(layout)[1])
    overflow = routing.overflow_slots(step, layout, cl, k)
    overflowing = overflow.size
    route = routing.build_route(
        step,
        ids.reshape(-1),
        layout=layout,
        local_capacity=cl,
        per_destination=k,
        overflow=overflow,
        overflow_size=overflowing,
        owner_size=owner_size,
        pad=-1,
        threads=HostThreads(2),
    )
    assert route.overflowed >= overflowing
    spec = P("rows")
    rows = jax.device_put(table, jax.sharding.NamedSharding(mesh, spec))
    weights = rng.normal(size=(*slots.shape, d)).astype(np.float32)

    def lookup(delta):
        def body(rows, requests, overflow, inverse, delta):
            got = device_ops.routed_gather(rows, requests, overflow, "rows") + delta[0]
            return got.at[inverse].get(mode="fill", fill_value=0)

        return jax.shard_map(
            body, mesh=mesh, in_specs=(spec, spec, P(), spec, spec), out_specs=spec
        )(rows, route.requests, route.overflow, route.inverse, delta)

    received = n * k + route.overflow.shape[0]
    zero = np.zeros((n, received, d), np.float32)
    expected = np.where(real[..., None], table[np.maximum(slots, 0)], 0)
    np.testing.assert_array_equal(np.asarray(lookup(zero)), expected)

    grads = jax.grad(lambda delta: (lookup(delta) * weights).sum())(zero)

    def update(rows, grads, owner_slots, owner_inverse):
        return device_ops.routed_apply(
            rows,
            {},
            grads,
            owner_slots,
            owner_inverse,
            per_destination=k,
            optimizer=jaxcache.sgd(1.0),
            axis="rows",
        )[0]

    new = jax.shard_map(update, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)(
        rows, grads, route.owner_slots, route.owner_inverse
    )
    summed = np.zeros_like(table)
    np.add.at(summed, slots[real], weights[real])
    np.testing.assert_allclose(np.asarray(new), table - summed, atol=1e-5)


@pytest.mark.host_planner
@pytest.mark.parametrize("split, capacity", [(1, 64), (2, 128)])
def test_host_callback_form_with_lists_shorter_than_a_device_share_matches_full_table(
    split, capacity
):
    # Batches of few distinct ids, each repeated: the host-callback form's
    # lists (callback_rows) are shorter than one device's share of the ids,
    # so a device's requests to one owner are bounded by the list size. With
    # two partitions per device, the form stages through them alike.
    rng = np.random.default_rng(5)
    batches = [
        {"ids": (rng.choice(40, (B, F)) + 25 * step) * 7, "y": rng.random(B).astype(np.float32)}
        for step in range(10)
    ]
    rows = max(np.unique(b["ids"]).size for b in batches)
    assert rows < B * F // 2  # the share of one of two devices
    cfg = jaxcache.CacheConfig(
        N, D, capacity, policy="lru", optimizer=jaxcache.adam(0.02), callback_rows=rows
    )
    cache = jaxcache.EmbeddingCache(
        cfg, table=jaxcache.HostTable(cfg, seed=1), mesh=_mesh(2), partitions_per_device=split
    )
    model, optimizer, step = make_callback(cache, F)
    with jaxcache.prefetch(batches, {"ids": model.embed}, lookahead=1, callback=True) as pipeline:
        losses = [float(step(model, optimizer, b["ids"], b["y"])) for b in pipeline]
    reference, ref_train = make_reference(
        np.array(jaxcache.HostTable(cfg, seed=1).rows), jaxcache.adam(0.02), F
    )
    ref_losses = [float(ref_train(b["ids"], b["y"])) for b in batches]
    assert cache.stats.total.evictions > 100  # rows really move
    _assert_matches(model, losses, reference, ref_losses)


def _read_on_two_threads(array):
    """``local_data(array)`` on two threads started together (``None`` where it raised)."""
    barrier, out = threading.Barrier(2), [None, None]

    def read(k):
        barrier.wait()
        with contextlib.suppress(RuntimeError):
            out[k] = local_data(array)

    threads = [threading.Thread(target=read, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


@pytest.mark.no_planner
def test_arrays_read_on_two_threads_at_once_are_read_whole():
    # A fresh JAX array lists its per-device buffers on first use; two
    # threads doing it at once could each see part of the list (and keep
    # it), as the landing threads and the training loop reading one swap's
    # read-out did. The pipeline lowers the switch interval, which makes
    # the race likely: without local_data's lock, about one read in ten here.
    sharding = NamedSharding(_mesh(4), PartitionSpec("rows"))
    double = jax.jit(lambda x: 2 * x, out_shardings=sharding)
    x = jax.device_put(np.arange(64.0, dtype=np.float32).reshape(32, 2), sharding)
    expected = 2 * np.arange(64.0, dtype=np.float32).reshape(32, 2)
    saved = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        reads = [_read_on_two_threads(double(x)) for _ in range(300)]
    finally:
        sys.setswitchinterval(saved)
    for out in reads:
        for read in out:
            np.testing.assert_array_equal(read, expected)


@pytest.mark.no_planner
def test_an_array_listing_part_of_its_buffers_is_refused():
    whole = jax.device_put(
        np.zeros((8, 2), np.float32), NamedSharding(_mesh(4), PartitionSpec("rows"))
    )

    class Partial:  # what a racing first listing leaves: two of four buffers
        shape, sharding = whole.shape, whole.sharding
        addressable_shards = whole.addressable_shards[:2]

    with pytest.raises(RuntimeError, match="lists 2 of its 4 buffers"):
        local_data(Partial())
    np.testing.assert_array_equal(local_data(whole), np.zeros((8, 2), np.float32))


def _raw_ids_run(agree: bool):
    """Raw ids through a vocabulary of 32 rows on 2 devices holding them all:
    new ids take rows that stay resident, and fetch them again."""
    vocabulary = jaxcache.DynamicVocabulary(protect=0, forget="lru", init="uniform", scale=1.0)
    cfg = jaxcache.CacheConfig(32, D, 32, optimizer=jaxcache.adagrad(0.5), vocabulary=vocabulary)
    cache = jaxcache.EmbeddingCache(cfg, mesh=_mesh(2))
    if agree:
        cache.planner.agreement = Agreement()
    model, train = make_cached(cache, F)
    rng = np.random.default_rng(5)
    losses = []
    for _ in range(12):
        ids = rng.integers(0, 200, size=(8, F)) * 7919 + (1 << 40)
        losses.append(float(train(ids, (rng.random(8) < 0.5).astype(np.float32))))
    ids, rows, _ = cache.export_ids(model.embed.get_state())
    return losses, ids, rows, cache.stats.total, cache.stager.fetch_bucket


@pytest.mark.host_planner
def test_the_processes_agreement_plans_as_one_process_does():
    # Several processes agree on each plan between its check and its commit
    # (refusals, padded sizes). Taken by one process, with an agreement of
    # one, that path must plan, size and train exactly as one process does:
    # it counted no moves for new raw ids' rows fetched where resident,
    # whose values were then dropped (the new ids trained the old ids' rows).
    for policy in ("lfu", "adaptive"):
        runs = []
        for agree in (False, True):
            cache, model, losses, _ = _train(4, policy, 400, lookahead=2, agree=agree)
            rows, _ = model.embed.export()
            sizes = (cache.stager.fetch_bucket, cache.stager.route_buckets)
            runs.append((losses, rows, cache.stats.total, sizes))
        assert runs[0][0] == runs[1][0] and runs[0][2] == runs[1][2] and runs[0][3] == runs[1][3]
        np.testing.assert_array_equal(runs[0][1], runs[1][1])
    alone, agreed = _raw_ids_run(agree=False), _raw_ids_run(agree=True)
    assert alone[3].forgotten_ids > 0 and alone[4] > 0
    assert alone[0] == agreed[0] and alone[3:] == agreed[3:]
    np.testing.assert_array_equal(alone[1], agreed[1])
    np.testing.assert_array_equal(alone[2], agreed[2])
