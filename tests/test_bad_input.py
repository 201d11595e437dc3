"""Bad input: a clear error (argument, value, fix) and no state change."""

from __future__ import annotations

import dataclasses
import fractions
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxcache


def _snapshot(cache):
    p = cache.planner
    if cache.planner_kind == "host":
        directory = [q.slot_of_id.copy() for q in p.planners]
    else:  # the directory and the policy (not the plans' sticky failure flag)
        directory = [np.array(leaf) for leaf in jax.tree.leaves(p.state._replace(scalars=None))]
    return (
        *directory,
        p.id_of_slot,
        p.last_use,
        p.dirty,
        p.next_index,
        cache.stats.steps,
        np.array(cache.table.rows),
    )


def _assert_unchanged(cache, snapshot):
    for before, after in zip(snapshot, _snapshot(cache), strict=True):
        np.testing.assert_array_equal(before, after)


@pytest.fixture
def cache_and_state(planner):
    cfg = jaxcache.CacheConfig(100, 4, 8, policy="lfu", padding_id=-1)
    cache = jaxcache.EmbeddingCache(cfg, planner=planner)
    state = cache.init_state()
    state, _ = cache.prepare(state, np.array([1, 2, 3]))
    return cache, state


@pytest.mark.parametrize(
    ("ids", "error", "pattern"),
    [
        (np.array([1, 100]), ValueError, r"holds 100 at index \(1,\), outside \[0, 100\)"),
        (np.array([[1, -5]]), ValueError, r"holds -5 .*hold the padding id, -1\."),
        (np.array([1.0, 2.0]), TypeError, r"integer array, got dtype float64.*np.int64"),
        (np.array([True, False]), TypeError, r"integer array, got dtype bool"),
        (np.array([1, 2], "m8[s]"), TypeError, r"integer array, got dtype timedelta64\[s\]"),
        (np.int64(3), ValueError, r"rank >= 1.*np.array"),
        (
            np.array([4225744279]),
            ValueError,
            r"holds 4225744279 .*DynamicVocabulary\(\).*modulo the vocabulary",
        ),
        (np.arange(9), jaxcache.CapacityError, r"9 distinct ids but capacity is 8.*at least 9"),
    ],
)
def test_bad_ids_raise_before_any_change(cache_and_state, ids, error, pattern):
    cache, state = cache_and_state
    snapshot = _snapshot(cache)
    with pytest.raises(error, match=pattern):
        cache.prepare(state, ids)
    _assert_unchanged(cache, snapshot)
    # The state is still usable afterwards.
    cache.prepare(state, np.array([1, 2]))
    assert cache.stats.last.hits == 2


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize(
    ("ids", "padding_id"),
    [
        (np.array([[1, np.iinfo(np.int64).min]]), None),  # the host loops' "no padding"
        (np.array([[1, 2**64 - 1]], np.uint64), -1),  # would wrap onto the padding id
    ],
)
def test_ids_that_could_pass_for_padding_are_refused(planner, devices, ids, padding_id):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("rows",))
    cfg = jaxcache.CacheConfig(100, 4, 8, padding_id=padding_id)
    cache = jaxcache.EmbeddingCache(cfg, planner=planner, mesh=mesh)
    state = cache.init_state()
    snapshot = _snapshot(cache)
    with pytest.raises(ValueError, match=rf"holds {ids[0, 1]} at index \(0, 1\), outside"):
        cache.prepare(state, np.repeat(ids, 2, axis=0))
    _assert_unchanged(cache, snapshot)


def test_dataset_counts_of_an_id_outside_the_table_name_only_the_fixes_they_can_take():
    # A dynamic vocabulary takes no dataset counts, so their error does not offer it.
    counter = jaxcache.FrequencyCounter(10)
    with pytest.raises(ValueError, match=r"holds 12 .*modulo the vocabulary") as error:
        counter.update(np.array([[3, 12]]))
    assert "DynamicVocabulary" not in str(error.value)
    assert counter.samples_seen == 0 and not counter.counts.any()


@pytest.mark.parametrize("shape", [(), (-1, 2), (2.5, 2), (True, 2)])
def test_init_lookup_refuses_a_shape_that_is_no_batch(shape):
    cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, capacity=16))
    with pytest.raises(ValueError, match="is not the shape of a batch of ids"):
        jaxcache.linen.init_lookup(cache, shape)


@pytest.mark.parametrize("shape", [(3, 0), (0, 3)])
def test_a_batch_of_empty_bags_looks_up_nothing(planner, shape):
    cfg = jaxcache.CacheConfig(100, 4, 8, padding_id=-1)
    cache = jaxcache.EmbeddingCache(cfg, planner=planner)
    state, lookup = cache.prepare(cache.init_state(), np.zeros(shape, np.int64))
    assert jaxcache.device.lookup_rows(state.rows, lookup).shape == (*shape, 4)
    for combiner in ("sum", "mean"):  # no real ids: nothing to pool, zeros
        pooled = jaxcache.device.embed(state.rows, lookup, table="embedding", combiner=combiner)
        np.testing.assert_array_equal(pooled, np.zeros((shape[0], 4)))
    assert cache.stats.last.lookups == 0


@pytest.mark.parametrize("capacity", [16, 32, 64])
def test_a_batch_too_large_for_a_device_counts_the_ids_homed_there(planner, capacity):
    # 4 devices; the batch's 64 ids overfill the device of most of them,
    # by far at the smallest capacity (where a plan sees only part of them).
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("rows",))
    cache = jaxcache.EmbeddingCache(
        jaxcache.CacheConfig(100_000, 4, capacity, policy="lru"), mesh=mesh, planner=planner
    )
    ids = np.random.default_rng(capacity).choice(100_000, 64, replace=False)
    per_device = np.bincount(ids % 4, minlength=4)
    most = int(per_device.max())
    snapshot = _snapshot(cache)
    with pytest.raises(jaxcache.CapacityError) as refused:
        cache.prepare(cache.init_state(), ids.reshape(4, 16))
    device = int(np.argmax(per_device))
    assert refused.value.distinct == most
    assert (
        f"the batch has {most} distinct ids homed on device {device} (ids i with i % 4 == "
        f"{device}) but each device holds {capacity // 4} rows; raise capacity to at least "
        f"{4 * most}" in str(refused.value)
    )
    _assert_unchanged(cache, snapshot)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (dict(capacity=101), ValueError, r"capacity=101 rows is larger than the table"),
        (dict(capacity=0), ValueError, r"capacity=0 must be at least 1"),
        (dict(capacity=1.5), ValueError, r"capacity=1.5 is neither a fraction"),
        (dict(capacity=0.02, policy="fifo"), ValueError, r"policy='fifo'.*frequency, lfu, lru"),
        (dict(capacity=10, dtype="float16"), ValueError, r"dtype='float16'.*bfloat16"),
        (dict(capacity=10, padding_id=5), ValueError, r"padding_id=5 is a real row id"),
        (dict(capacity="all"), TypeError, r"got 'all'; pass a row count such as 5000"),
        (dict(capacity=10, callback_rows=0), ValueError, r"callback_rows=0 must be a positive"),
        (dict(capacity=10, route_capacity=0), ValueError, r"route_capacity=0 must be a positive"),
        (dict(capacity=10, route_capacity="x"), ValueError, r"route_capacity='x' must be"),
        (dict(capacity=10, padding_id=2**70), ValueError, r"padding_id=\d+ must be an int64 id"),
        (dict(capacity=10, padding_id="-1"), ValueError, r"padding_id='-1' must be an int64"),
        (dict(capacity=10, padding_id=-1.5), ValueError, r"padding_id=-1.5 must be an int64"),
        (dict(capacity=10, name=None), ValueError, r"name=None must be 1 to 128 letters"),
        (dict(capacity=10, name=""), ValueError, r"name='' must be 1 to 128 letters"),
        (dict(capacity=10, dtype=None), ValueError, r"dtype=None is not supported"),
        (
            dict(capacity=10, optimizer="sgd"),
            TypeError,
            r"sparse row optimizer, got an object of type str; pass jaxcache.sgd",
        ),
        (
            dict(capacity=10, optimizer=optax.adagrad(0.1)),
            TypeError,
            r"of type optax\.GradientTransformation\w*; pass jaxcache\.sgd, jaxcache\.adagrad, "
            r"jaxcache\.rowwise_adagrad or jaxcache\.adam .*optax transformations are for the "
            r"dense parameters",
        ),
    ],
)
def test_bad_config(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        jaxcache.CacheConfig(num_embeddings=100, features=4, **kwargs)


def test_a_dtype_object_is_taken_as_its_name():
    assert jaxcache.CacheConfig(100, 4, 10, dtype=jax.numpy.bfloat16).dtype == "bfloat16"
    assert jaxcache.CacheConfig(100, 4, 10, dtype=np.float32) == jaxcache.CacheConfig(100, 4, 10)
    with pytest.raises(ValueError, match=r"dtype='float16' is not supported"):
        jaxcache.CacheConfig(100, 4, 10, dtype=np.float16)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (dict(admit_after=0), r"admit_after=0 must be a positive integer"),
        (dict(forget="fifo"), r"forget='fifo' is not one of"),
        (dict(init="ones"), r"init='ones' is not one of"),
        (dict(scale=-1.0), r"scale=-1.0: the spread of init must be >= 0"),
        (dict(scale=float("inf")), r"scale=inf must be a finite number"),
        (dict(ttl=0), r"ttl=0 must be a positive number of steps"),
        (dict(ways=0), r"ways=0 must be an integer of at least 2"),
        (dict(ways=1), r"ways=1 must be an integer of at least 2"),
        (dict(sketch_width=1000), r"sketch_width=1000 must be a power of two"),
        (dict(seed=-1), r"seed=-1 must be an integer in \[0, 2\*\*63\)"),
        (dict(seed=1.9), r"seed=1.9 must be an integer"),
        (dict(seed=2**70), r"seed=\d+ must be an integer"),
    ],
)
def test_bad_vocabulary_settings(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        jaxcache.DynamicVocabulary(**kwargs)


def test_frequency_policy_needs_frequencies():
    cfg = jaxcache.CacheConfig(100, 4, 10, policy="frequency")
    with pytest.raises(ValueError, match="pass frequencies="):
        jaxcache.EmbeddingCache(cfg)


def test_frequencies_of_wrong_shape():
    cfg = jaxcache.CacheConfig(100, 4, 10, policy="lfu")
    with pytest.raises(
        ValueError, match=r"shape \(100,\), one count per table row, got int64 \(99,\)"
    ):
        jaxcache.EmbeddingCache(cfg, frequencies=np.zeros(99, np.int64))
    counts = np.full(100, 2**64 - 1, np.uint64)  # would wrap onto -1 as int64
    with pytest.raises(ValueError, match=r"hold 18446744073709551615, too near the int64"):
        jaxcache.EmbeddingCache(cfg, frequencies=counts)
    counts = np.zeros(100, np.int64)
    counts[0] = 2**63 - 1  # a lookup added to it would wrap to the least count
    with pytest.raises(ValueError, match=r"pass counts below 2\*\*62, divided down"):
        jaxcache.EmbeddingCache(cfg, frequencies=counts)
    with pytest.raises(ValueError, match=r"pass counts below 2\*\*62"):
        jaxcache.sizing.sweep(
            np.array([[0, 1]]),
            capacities=[10],
            policies="lfu",
            num_embeddings=100,
            frequencies=counts,
        )


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"seed": -1}, r"seed=-1 must be an integer >= 0"),
        ({"shards": 0}, r"shards=0 must be an integer >= 1 \(default 16\)"),
        ({"segment_bytes": -1}, r"segment_bytes=-1 must be an integer >= 1"),
        ({"disk_spare": float("nan")}, r"disk_spare=nan must be a fraction >= 0"),
    ],
)
def test_bad_table_settings(tmp_path, kwargs, pattern):
    cfg = jaxcache.CacheConfig(100, 4, 10)
    with pytest.raises(ValueError, match=pattern):
        jaxcache.TieredTable(cfg, tmp_path / "table", **kwargs)
    assert not (tmp_path / "table").exists()  # refused before any file
    if "seed" in kwargs:
        with pytest.raises(ValueError, match=pattern):
            jaxcache.EmbeddingCache(cfg, **kwargs)


@pytest.mark.parametrize(
    ("make", "learning_rate", "error", "pattern"),
    [
        (
            jaxcache.adam,
            -1.0,
            ValueError,
            r"Adam\(learning_rate=-1.0\): the learning rate must be > 0",
        ),
        (jaxcache.rowwise_adagrad, 0, ValueError, r"RowwiseAdagrad\(learning_rate=0\): .* > 0"),
        (jaxcache.sgd, float("inf"), ValueError, r"SGD\(learning_rate=inf\): .* finite"),
        (
            jaxcache.sgd,
            optax.constant_schedule(0.1),
            TypeError,
            r"SGD\(learning_rate=\.\.\.\) takes a constant step size, got a function",
        ),
        (jaxcache.sgd, 1e39, ValueError, r"SGD\(learning_rate=1e\+39\): .* finite in float32"),
        (jaxcache.adam, 1e-50, ValueError, r"Adam\(learning_rate=1e-50\): .* > 0 and finite"),
        (jaxcache.sgd, fractions.Fraction(1, 10), TypeError, r"constant step size, got a Fraction"),
    ],
)
def test_bad_learning_rate(make, learning_rate, error, pattern):
    with pytest.raises(error, match=pattern):
        make(learning_rate)


@pytest.mark.parametrize(
    ("make", "error", "pattern"),
    [
        (
            lambda: jaxcache.adagrad(0.1, eps=-1.0),
            ValueError,
            r"Adagrad\(eps=-1.0\): eps must be >= 0",
        ),
        (
            lambda: jaxcache.rowwise_adagrad(0.1, initial_accumulator_value=-0.5),
            ValueError,
            r"RowwiseAdagrad\(initial_accumulator_value=-0.5\): .* >= 0.0 and finite",
        ),
        (
            lambda: jaxcache.adam(0.1, b1=1.5),
            ValueError,
            r"Adam\(b1=1.5\): b1 must be .* < 1.0.* 0.9",
        ),
        (lambda: jaxcache.adam(0.1, b2=1.0), ValueError, r"Adam\(b2=1.0\)"),
        (lambda: jaxcache.adam(0.1, eps=float("nan")), ValueError, r"Adam\(eps=nan\)"),
        (lambda: jaxcache.adagrad(0.1, eps="small"), TypeError, r"takes an int or a float.*1e-7"),
        (
            lambda: jaxcache.adam(0.1, eps=0.0),
            ValueError,
            r"Adam\(eps=0.0\): .*NaN \(0 / 0 in float32.*pass eps >= 1.18e-38 such as 1e-8\.",
        ),
        (
            lambda: jaxcache.rowwise_adagrad(0.1, eps=0.0),
            ValueError,
            r"RowwiseAdagrad\(eps=0.0, initial_accumulator_value=0.0\).*or initial_accumulator",
        ),
        (
            lambda: jaxcache.adagrad(0.1, initial_accumulator_value=0.0, eps=0.0),
            ValueError,
            r"Adagrad\(eps=0.0, initial_accumulator_value=0.0\)",
        ),
        # In range as Python floats, out of it in float32, where rows are updated.
        (lambda: jaxcache.adam(0.1, b1=1 - 1e-11), ValueError, r"b1 must be .* also in float32"),
        (lambda: jaxcache.adam(0.1, b2=1 - 1e-11), ValueError, r"b2 must be .* also in float32"),
        (lambda: jaxcache.adagrad(0.1, initial_accumulator_value=1e39), ValueError, "finite, also"),
        (lambda: jaxcache.adam(0.1, eps=1e-50), ValueError, r"Adam\(eps=1e-50\): .*NaN"),
        (
            lambda: jaxcache.adagrad(0.1, initial_accumulator_value=0.0, eps=1e-40),
            ValueError,
            r"Adagrad\(eps=1e-40, .*values below 1.18e-38 are 0",
        ),
        (
            lambda: jaxcache.rowwise_adagrad(0.1, initial_accumulator_value=1e-50, eps=0.0),
            ValueError,
            r"RowwiseAdagrad\(eps=0.0, initial_accumulator_value=1e-50\)",
        ),
    ],
)
def test_bad_optimizer_settings(make, error, pattern):
    # Refused when built, as the learning rate is: a negative eps, a decay
    # of 1 or more, or a denominator that a zero gradient leaves at 0 would
    # train rows into NaN without an error.
    with pytest.raises(error, match=pattern):
        make()


def test_eps_zero_is_taken_where_the_accumulator_starts_above_zero():
    opt = jaxcache.adagrad(1.0, initial_accumulator_value=0.1, eps=0.0)
    rows, _ = opt.update(
        jax.numpy.ones((1, 2)),
        jax.numpy.zeros((1, 2)),
        {"accumulator": jax.numpy.full((1, 2), 0.1)},
    )
    assert rows.tolist() == [[1.0, 1.0]]
    assert jaxcache.rowwise_adagrad(1.0, initial_accumulator_value=0.5, eps=0.0).eps == 0.0


def test_mesh_without_the_rows_axis():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("rows",))
    with pytest.raises(
        ValueError, match=r"axis='data' is not an axis of the mesh \{'rows': 1\}; pass axis='rows'"
    ):
        jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, 10), mesh=mesh, axis="data")


def test_flush_names_the_plans_staged_but_not_applied():
    cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, 10))
    state, _ = cache.prepare(cache.init_state(), np.array([1, 2]))
    cache.stage(np.array([3]))
    with pytest.raises(RuntimeError, match=r"^plan 1 was staged but not applied"):
        cache.flush(state)
    cache.stage(np.array([4]))
    with pytest.raises(RuntimeError, match=r"^plans 1..2 were staged but not applied"):
        cache.flush(state)


def test_saving_through_a_read_only_checkpointer(tmp_path):
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, 10)))
    checkpointer = jaxcache.Checkpointer(tmp_path, read_only=True)
    with pytest.raises(RuntimeError, match="is read-only; save through one built with read_only"):
        checkpointer.save(0, caches=[embed])


def test_loop_and_checkpoint_arguments_are_checked_when_given(tmp_path):
    cfg = jaxcache.CacheConfig(100, 4, 10)
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg))
    with pytest.raises(ValueError, match=r"max_to_keep=1.5 must be a positive count or None"):
        jaxcache.Checkpointer(tmp_path, max_to_keep=1.5)
    checkpointer = jaxcache.Checkpointer(tmp_path)
    with pytest.raises(ValueError, match=r"step must be an integer in \[0, 2\*\*63\)"):
        checkpointer.save(2**70, caches=[embed])
    checkpointer.save(1, caches=[embed])  # a refused step leaves later saves possible
    assert checkpointer.steps() == [1]
    for shard in [(0.5, 2), (0,), (True, 2)]:
        with pytest.raises(ValueError, match=r"is not \(index, count\)"):
            jaxcache.HostTable(cfg, shard=shard)
    with pytest.raises(TypeError, match=r"tables must map each batch key .*got a list"):
        jaxcache.prefetch([{"ids": np.arange(3)}], [embed])
    with pytest.raises(TypeError, match=r"batches must be an iterable .*got a NoneType"):
        jaxcache.prefetch(None, {"ids": embed})
    with jaxcache.prefetch([np.arange(3)], {"ids": embed}, lookahead=0) as pipeline:
        with pytest.raises(KeyError, match=r"no ids under 'ids'; it must be a mapping"):
            next(iter(pipeline))
    serving = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(jaxcache.serving_config(cfg)))
    with pytest.raises(ValueError, match=r"lookahead=-1 must be an integer >= 0"):
        jaxcache.Server(serving, lambda batch: batch, {"ids": serving}, lookahead=-1)


def test_host_rows_of_wrong_shape():
    cfg = jaxcache.CacheConfig(100, 4, 10)
    with pytest.raises(ValueError, match=r"shape \(100, 3\) but the config needs \(100, 4\)"):
        jaxcache.HostTable(cfg, rows=np.zeros((100, 3), np.float32))


@pytest.mark.parametrize(
    ("table", "pattern"),
    [
        ({"num_embeddings": 99}, "num_embeddings is 99 but the cache's config has 100"),
        ({"features": 8}, "features is 8 but the cache's config has 4"),
        ({"dtype": "bfloat16"}, "dtype is bfloat16 but the cache's config has float32"),
        ({"optimizer": jaxcache.sgd(0.1)}, r"row state is \{\} but .*'accumulator'"),
    ],
)
def test_a_table_built_for_another_config_is_refused(table, pattern):
    cfg = jaxcache.CacheConfig(100, 4, 8, optimizer=jaxcache.adagrad(0.1))
    other = jaxcache.HostTable(dataclasses.replace(cfg, **table))
    with pytest.raises(ValueError, match=pattern + ".*from the same config"):
        jaxcache.EmbeddingCache(cfg, table=other)


def test_lookup_for_another_table_is_refused():
    a = jaxcache.nnx.CachedEmbed(
        jaxcache.EmbeddingCache(jaxcache.CacheConfig(10, 2, 4, name="users"))
    )
    b = jaxcache.nnx.CachedEmbed(
        jaxcache.EmbeddingCache(jaxcache.CacheConfig(10, 2, 4, name="items"))
    )
    lookup = a.prepare(np.array([1, 2]))
    with pytest.raises(ValueError, match="lookup is for table 'users' but this module serves"):
        b(lookup)


def test_training_through_an_evaluation_lookup_is_refused(planner):
    # Rows of a train=False batch are not marked changed, so an update
    # through its Lookup would be dropped when they leave the cache.
    cfg = jaxcache.CacheConfig(10, 2, 4, optimizer=jaxcache.sgd(0.5))
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg, seed=0, planner=planner))
    assert embed.prepare(np.array([1, 2]), train=True).train
    lookup = embed.prepare(np.array([1, 2, 3]), train=False)
    assert not lookup.train
    rows = np.array(embed.get_state().rows)

    @jax.jit
    def step(state, lookup):  # an update as a hand-written loop makes it
        grads = jax.numpy.ones((lookup.requests.shape[0], lookup.received, 2))
        return jaxcache.device.apply_sparse(state, lookup, grads, cfg.optimizer)

    with pytest.raises(ValueError, match=r"'embedding' was prepared with train=False.*train=True"):
        step(embed.get_state(), lookup)
    with pytest.raises(ValueError, match="prepared with train=False"):
        jaxcache.nnx.value_and_grad(lambda m, lk: m(lk).sum())(embed, lookup)
    np.testing.assert_array_equal(embed.get_state().rows, rows)


def test_host_table_shards_are_checked():
    cfg = jaxcache.CacheConfig(100, 4, 10)
    with pytest.raises(ValueError, match=r"shard=\(2, 2\) is not \(index, count\)"):
        jaxcache.HostTable(cfg, shard=(2, 2))
    # One process stores every row: a half table is refused, not half used.
    half = jaxcache.HostTable(cfg, shard=(0, 2))
    with pytest.raises(ValueError, match=r"holds shard \(0, 2\) .* stores shard \(0, 1\)"):
        jaxcache.EmbeddingCache(cfg, table=half)
    with pytest.raises(ValueError, match="axis='data' is not an axis"):
        jaxcache.host.process_shard(
            jax.sharding.Mesh(np.array(jax.devices()[:1]), ("rows",)), "data"
        )


@pytest.mark.parametrize("padding_id", [-1, None])
@pytest.mark.parametrize("shape", [(2, 2), (2, 4), (3, 3), (6,), (3,)])
def test_weights_of_another_shape_than_the_ids_are_refused(padding_id, shape):
    # With padding the pooling reads weights at the real ids' positions, and
    # without it they would broadcast: either way the wrong weights, silently.
    cfg = jaxcache.CacheConfig(10, 2, capacity=8, padding_id=padding_id)
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg), combiner="sum")
    lookup = embed.prepare(np.array([[1, 2, 3], [4, 5, 6]]))
    right = embed(lookup, np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"weights have shape .* ids have shape \(2, 3\)"):
        embed(lookup, np.ones(shape, np.float32))
    # Refused before anything ran: the same lookup pools as before.
    np.testing.assert_array_equal(embed(lookup, np.ones((2, 3), np.float32)), right)


def test_weights_that_are_not_real_numbers_are_refused():
    # A complex weight would lose its imaginary part in the cast, with no
    # more than a warning Python hides by default.
    cfg = jaxcache.CacheConfig(10, 2, capacity=8)
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg), combiner="sum")
    lookup = embed.prepare(np.array([[1, 2, 3], [4, 5, 6]]))
    with pytest.raises(ValueError, match="weights have dtype complex64; pass real weights"):
        embed(lookup, np.full((2, 3), 1 + 2j, np.complex64))
    mask = np.array([[True, False, True], [True, True, False]])  # a mask weighs 0 or 1
    np.testing.assert_array_equal(embed(lookup, mask), embed(lookup, mask.astype(np.float32)))


def test_a_staged_batch_applies_once_and_only_to_its_cache(planner):
    # Applied twice, its swap would move rows over slots others hold now; by
    # another cache, into slots that cache never planned. Both are refused
    # before the state changes, and training goes on as if never tried.
    cfg = jaxcache.CacheConfig(40, 3, 4, policy="lru", optimizer=jaxcache.sgd(1.0))

    def run(mistakes):
        cache = jaxcache.EmbeddingCache(cfg, planner=planner)
        state = cache.init_state()
        for k, ids in enumerate([[1, 2], [3, 4], [5, 6], [1, 3], [7, 8], [9, 10], [1, 7]]):
            cache.lifecycle.release_all()  # the steps before it ran
            staged = cache.stage(np.array(ids))
            if mistakes and k == 2:
                other = jaxcache.EmbeddingCache(cfg, planner=planner)
                with pytest.raises(ValueError, match=r"made by another cache \(cache \d+\)"):
                    cache.apply(state, other.stage(np.array(ids)))
            state = cache.apply(state, staged)
            if mistakes and k == 2:
                with pytest.raises(RuntimeError, match="batch 2 of table 'embedding' was applied"):
                    cache.apply(state, staged)
            grads = jnp.ones((staged.lookup.requests.shape[0], staged.lookup.received, 3))
            state = jaxcache.device.apply_sparse(state, staged.lookup, grads, cfg.optimizer)
        assert cache.stats.total.evictions > 6
        return cache.export(state)

    (rows, _), (base, _) = run(True), run(False)
    np.testing.assert_array_equal(rows, base)


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_a_combiner_refuses_ids_without_a_bag_axis(combiner):
    # Pooling the last axis of [B] ids would make the whole batch one row.
    cfg = jaxcache.CacheConfig(10, 2, capacity=8)
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg), combiner=combiner)
    with pytest.raises(ValueError, match=r"ids have shape \(3,\).*ids\[:, None\]"):
        embed.prepare(np.array([1, 2, 3]))
    # A module over the same cache without a combiner prepares them; the
    # pooling module still refuses the lookup.
    lookup = jaxcache.nnx.CachedEmbed(embed.cache).prepare(np.array([1, 2, 3]))
    with pytest.raises(ValueError, match=r"ids have shape \(3,\).*ids\[:, None\]"):
        embed(lookup)
    assert embed(embed.prepare(np.array([[1], [2], [3]]))).shape == (3, 2)


def test_capacities_that_do_not_split_over_the_mesh_name_the_fix():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:3]), ("rows",))
    cfg = jaxcache.CacheConfig(4000, 2, capacity=4000)
    with pytest.raises(ValueError, match="use a multiple of 3, such as 3999"):
        jaxcache.EmbeddingCache(cfg, mesh=mesh)
    with pytest.raises(ValueError, match=r"full_table keeps all 4000 rows .* 3 devices"):
        jaxcache.EmbeddingCache.full_table(cfg, mesh=mesh)
    full = jaxcache.EmbeddingCache.full_table(jaxcache.CacheConfig(3999, 2, 30), mesh=mesh)
    assert full.planner.resident_ids().size == 3999


def test_a_loss_given_no_lookup_or_two_tables_of_one_name_is_refused():
    # A loss that takes its Lookup by closure would train no row; two tables
    # of one name would have one's gradients applied to the other.
    from flax import nnx

    def embed(name="embedding"):
        cfg = jaxcache.CacheConfig(100, 4, 16, name=name)
        return jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg))

    model = nnx.List([embed()])
    lookup = model[0].prepare(np.array([[1, 2]]))
    with pytest.raises(ValueError, match="given no Lookup, so no cached row would get a grad"):
        jaxcache.nnx.value_and_grad(lambda m: m[0](lookup).sum())(model)
    value, _ = jaxcache.nnx.value_and_grad(lambda m, lk: m[0](lk).sum())(model, lookup)
    assert np.isfinite(value)
    twins = nnx.List([embed(), embed()])
    lookup = twins[1].prepare(np.array([[1, 2]]))
    with pytest.raises(ValueError, match="two CachedEmbed modules of the model serve a table"):
        jaxcache.nnx.value_and_grad(lambda m, lk: m[1](lk).sum())(twins, lookup)
    named = nnx.List([embed("users"), embed("items")])
    lookup = named[1].prepare(np.array([[1, 2]]))
    jaxcache.nnx.value_and_grad(lambda m, lk: m[1](lk).sum())(named, lookup)


def test_a_lookup_used_after_a_later_plan_is_refused(planner, tmp_path):
    # prepare([1, 2]), prepare([3, 4]), prepare([5, 6]) give 1's and 2's
    # slots to 5 and 6: a step through the first lookup would train them.
    cfg = jaxcache.CacheConfig(100, 2, 4, optimizer=jaxcache.sgd(1.0))
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg, planner=planner), combiner="sum")
    first = embed.prepare(np.array([[1, 2]]))
    embed.prepare(np.array([[3, 4]]))
    last = embed.prepare(np.array([[5, 6]]))
    rows = np.array(embed.get_state().rows)
    grad = jaxcache.nnx.value_and_grad(lambda m, lk: m(lk).sum())
    stale = r"Lookup of table 'embedding' \(plan 0\) is stale: plan 2 has been applied since"
    with pytest.raises(ValueError, match=stale + r".*jaxcache\.prefetch"):
        grad(embed, first)
    with pytest.raises(ValueError, match=stale):
        embed(first)
    with pytest.raises(ValueError, match=stale):
        jax.jit(lambda lk: lk.inverse.sum())(first)  # entering any jitted step
    np.testing.assert_array_equal(embed.get_state().rows, rows)  # nothing trained
    grad(embed, last)  # the current lookup serves its step
    # Through a pipeline: each batch's lookup serves until the next is applied.
    batches = [{"ids": np.array([[i, i + 1]])} for i in range(0, 20, 2)]
    with jaxcache.prefetch(batches, {"ids": embed}, lookahead=2) as pipeline:
        kept = next(pipeline)["ids"]
        grad(embed, kept)
        grad(embed, next(pipeline)["ids"])
        with pytest.raises(ValueError, match="is stale"):
            grad(embed, kept)
        for batch in pipeline:
            grad(embed, batch["ids"])
    # A restore replaces every slot: lookups made before it are stale.
    current = embed.prepare(np.array([[7, 8]]))
    checkpointer = jaxcache.Checkpointer(tmp_path)
    checkpointer.save(1, caches=[embed])
    checkpointer.restore(1, caches=[embed])
    with pytest.raises(ValueError, match=r"\(plan 13\) is stale: a restore has been applied since"):
        embed(current)
    embed(embed.prepare(np.array([[7, 8]])))


@pytest.mark.parametrize(
    ("factor", "error", "message"),
    [
        (-1.0, ValueError, r"learning_rate_scale=-1.0 must be >= 0 and finite"),
        (float("nan"), ValueError, r"learning_rate_scale=nan must be >= 0"),
        (1e39, ValueError, r"finite in float32"),
        ("0.5", TypeError, r"takes a number or a scalar array, got a str"),
        (True, TypeError, r"got a bool"),
        (np.ones(2, np.float32), ValueError, r"must be a real scalar, got shape \(2,\)"),
        (np.array(1 + 1j), ValueError, r"dtype complex128"),
    ],
)
def test_a_bad_learning_rate_scale_is_refused_before_any_step(factor, error, message):
    loss_fn = lambda model, lookup: model(lookup).sum()  # noqa: E731
    with pytest.raises(error, match=message):
        jaxcache.nnx.value_and_grad(loss_fn, learning_rate_scale=factor)
    cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 2, 8))
    with pytest.raises(error, match=message):
        jaxcache.linen.value_and_grad(loss_fn, cache, learning_rate_scale=factor)
    with pytest.raises(error, match=message):
        jaxcache.sgd(0.1).scaled(factor)


def test_a_learning_rate_scale_for_rows_the_caller_applies_is_refused():
    loss_fn = lambda model, lookup: model(lookup).sum()  # noqa: E731
    with pytest.raises(ValueError, match=r"pass it to CachedEmbed\.apply_gradients instead"):
        jaxcache.nnx.value_and_grad(loss_fn, apply_rows=False, learning_rate_scale=0.5)


def _other_state(capacity=8, **optimizer):
    cfg = jaxcache.CacheConfig(100, 4, capacity, padding_id=-1, **optimizer)
    return jaxcache.EmbeddingCache(cfg, planner="host").init_state()


@pytest.mark.parametrize(
    ("bad", "error", "pattern"),
    [
        ("donated", ValueError, r"donated to an earlier swap.*Pass the state the last call"),
        ("capacity", ValueError, r"rows has shape \[16, 4\].*holds \[8, 4\] float32"),
        ("optimizer", ValueError, r"holds \['accumulator'\].*whose state is \[\]"),
        ("tuple", TypeError, r"takes its device state as a CacheState.*got tuple"),
    ],
)
def test_a_state_not_of_the_cache_is_refused_before_the_plan(cache_and_state, bad, error, pattern):
    # Planned against a state it then cannot swap into, the cache would
    # count rows resident that the device never received, and later write
    # what those slots hold over the host table.
    cache, state = cache_and_state
    old = state
    state, _ = cache.prepare(state, np.array([4, 5]))  # donates ``old``
    wrong = {
        "donated": old,
        "capacity": _other_state(16),
        "optimizer": _other_state(optimizer=jaxcache.adagrad(0.1)),
        "tuple": tuple(state),
    }[bad]
    snapshot = _snapshot(cache)
    for call in (lambda: cache.prepare(wrong, np.array([6, 7])), lambda: cache.flush(wrong)):
        with pytest.raises(error, match=pattern):
            call()
        _assert_unchanged(cache, snapshot)
    state, lookup = cache.prepare(state, np.array([6, 1]))  # the right state still works
    rows = jaxcache.device.lookup_rows(state.rows, lookup)
    np.testing.assert_array_equal(rows, cache.table.rows[[6, 1]])


def test_a_lookup_of_another_cache_of_the_same_name_is_refused(planner):
    # Both tables are named "embedding": only the cache tells their slots apart.
    def embed(seed):
        cfg = jaxcache.CacheConfig(100, 4, 8, optimizer=jaxcache.sgd(0.5))
        return jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg, planner=planner, seed=seed))

    a, b = embed(0), embed(1)
    b.prepare(np.array([50, 60, 70]))
    lookup = a.prepare(np.array([1, 2, 3]))
    with pytest.raises(ValueError, match=r"made by another EmbeddingCache.*different CacheConfig"):
        b(lookup)
    with pytest.raises(ValueError, match=r"made by another EmbeddingCache"):
        jax.jit(lambda lk: b(lk))(lookup)
    grads = jax.numpy.ones((1, lookup.received, 4))
    before = np.array(b.rows[...])
    with pytest.raises(ValueError, match=r"made by another EmbeddingCache"):
        b.apply_gradients(lookup, grads)
    np.testing.assert_array_equal(b.rows[...], before)
    np.testing.assert_array_equal(a(lookup), a.cache.table.rows[[1, 2, 3]])


def test_bags_of_the_wrong_rank_are_refused_before_the_plan(planner):
    cfg = jaxcache.CacheConfig(100, 4, 8)
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg, planner=planner), combiner="sum")
    snapshot = _snapshot(embed.cache)
    with pytest.raises(ValueError, match=r"combiner='sum' pools the last axis.*shape \(3,\)"):
        embed.prepare(np.array([5, 6, 7]))
    # The refused batch goes with its error: nothing is kept to give back.
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(ValueError, match=r"combiner='sum' pools the last axis"):
            source = iter([{"ids": np.array([5, 6, 7])}])
            with jaxcache.prefetch(source, {"ids": embed}) as batches:
                next(iter(batches))
    assert batches.unstaged == []
    _assert_unchanged(embed.cache, snapshot)


def test_apply_gradients_refuses_grads_of_another_shape(planner):
    cfg = jaxcache.CacheConfig(100, 4, 8, optimizer=jaxcache.sgd(0.5))
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg, planner=planner))
    lookup = embed.prepare(np.array([3, 5]))
    before = np.array(embed.rows[...])
    for shape in [(2, 4), (1, lookup.received, 1), (1, 1, 4), ()]:
        with pytest.raises(ValueError, match=r"\[devices, received, features\] = \(1, "):
            embed.apply_gradients(lookup, jax.numpy.ones(shape))
    np.testing.assert_array_equal(embed.rows[...], before)


@pytest.mark.no_planner
@pytest.mark.parametrize("kind", ["host", "tiered"])
def test_host_tables_refuse_ids_and_rows_they_would_misread(kind, tmp_path):
    cfg = jaxcache.CacheConfig(10, 2, 4, optimizer=jaxcache.adagrad(0.1))
    if kind == "host":
        table = jaxcache.HostTable(cfg)
    else:
        table = jaxcache.TieredTable(cfg, tmp_path, dram_budget=1 << 20)
    rows, state = table.gather(np.arange(10))
    row = np.ones((1, 2), np.float32)
    one = {"accumulator": np.ones((1, 2), np.float32)}
    for ids, error in [
        (np.array([-1]), IndexError),
        (np.array([10]), IndexError),
        (np.array([2**64 - 1], np.uint64), IndexError),
        (np.array([1.7]), TypeError),
        (np.array([True]), TypeError),
    ]:
        with pytest.raises(error, match=r"outside this table's|integer array"):
            table.gather(ids)
        with pytest.raises(error, match=r"outside this table's|integer array"):
            table.scatter(ids, row, one)
    with pytest.raises(ValueError, match=r"scatter of 1 ids got 2 rows.*Nothing was copied"):
        table.scatter(np.array([3]), np.ones((2, 2), np.float32), one)
    with pytest.raises((TypeError, ValueError)):
        table.scatter(np.array([3]), row, {"accumulator": np.ones((1, 3), np.float32)})
    after, after_state = table.gather(np.arange(10))
    np.testing.assert_array_equal(after, rows)
    np.testing.assert_array_equal(after_state["accumulator"], state["accumulator"])


def test_prepare_inside_jit_names_the_fix(planner):
    embed = jaxcache.nnx.CachedEmbed(
        jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, 8), planner=planner)
    )
    snapshot = _snapshot(embed.cache)

    @nnx.jit
    def step(embed, ids):
        return embed(embed.prepare(ids)).sum()

    with pytest.raises(TypeError, match=r"ids are traced: .*outside jit.*lookup_ids"):
        step(embed, np.array([1, 2]))
    _assert_unchanged(embed.cache, snapshot)


@pytest.mark.no_planner
@pytest.mark.parametrize("wrt", [nnx.Variable, nnx.Any(nnx.Param, jaxcache.nnx.CacheRows)])
def test_a_dense_filter_that_takes_in_the_rows_is_refused(wrt):
    # The rows' dense gradient would be the whole cached table, and an
    # optimizer over it would move the rows a second time.
    cfg = jaxcache.CacheConfig(100, 4, 8, optimizer=jaxcache.sgd(0.5))
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg))
    lookup = embed.prepare(np.array([1, 2]))
    before = np.array(embed.rows[...])
    with pytest.raises(ValueError, match=r"includes the cached rows.*wrt=nnx.Param"):
        jaxcache.nnx.value_and_grad(lambda m, lk: m(lk).sum(), wrt=wrt)(embed, lookup)
    np.testing.assert_array_equal(embed.rows[...], before)
