"""The Flax Linen shell against a full-table reference, the NNX shell and NumPy."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcache
import jaxcache.linen
from tests.models import bce, make_cached, zipf_batches

N, D, B, F = 3000, 8, 32, 4
STEPS = 15
TOL = 1e-6


class Tower(nn.Module):
    """Embeddings of ``F`` features ``[B, F, D]`` -> flatten -> MLP -> logit (as models.Tower)."""

    embed: nn.Module

    @nn.compact
    def __call__(self, ids_or_lookup):
        emb = self.embed(ids_or_lookup)
        x = emb.reshape(emb.shape[0], -1)
        return nn.Dense(1, name="out")(nn.relu(nn.Dense(16, name="hidden")(x)))[:, 0]


class FullEmbed(nn.Module):
    """The whole table ``[N, D]`` in the ``"reference"`` collection; takes raw ids."""

    num_embeddings: int
    features: int

    @nn.compact
    def __call__(self, ids):
        shape = (self.num_embeddings, self.features)
        return self.variable("reference", "table", jnp.zeros, shape).value[ids]


def make_linen(cache, params=None):
    """A Linen ``Tower`` trained through ``cache``; the variables are kept in a dict.

    Returns the dict and ``train(ids, labels)``, which prepares the ids and runs
    ``held["step"](params, opt_state, cache_vars, lookup, labels)``.
    """
    model = Tower(jaxcache.linen.CachedEmbed(cache))
    tx = optax.adam(1e-2)
    variables = model.init(jax.random.key(0), jaxcache.linen.init_lookup(cache, (B, F)))
    held = {
        "params": variables["params"] if params is None else params,
        "cache": variables[jaxcache.linen.COLLECTION],
    }
    held["opt_state"] = tx.init(held["params"])

    @jax.jit
    def step(params, opt_state, cache_vars, lookup, labels):
        def loss_fn(params, cache_vars, lookup):
            logits = model.apply({"params": params, jaxcache.linen.COLLECTION: cache_vars}, lookup)
            return bce(logits, labels)

        grad_fn = jaxcache.linen.value_and_grad(loss_fn, cache)
        loss, grads, cache_vars = grad_fn(params, cache_vars, lookup)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, cache_vars, loss

    def train(ids, labels):
        # prepare takes the collection alone as well as the full variables.
        held["cache"], lookup = jaxcache.linen.prepare(cache, held["cache"], ids)
        held["params"], held["opt_state"], held["cache"], loss = step(
            held["params"], held["opt_state"], held["cache"], lookup, labels
        )
        return loss

    held["step"] = step
    return held, train


def make_linen_reference(rows, optimizer, params, tx=None):
    """Full table, dense ``jax.grad`` w.r.t. it, the row rule on exactly the touched rows."""
    model = Tower(FullEmbed(*rows.shape))
    tx = tx or optax.adam(1e-2)
    held = {
        "params": params,
        "opt_state": tx.init(params),
        "table": jnp.asarray(rows),
        "table_opt": {
            name: jnp.full((rows.shape[0], *spec.shape), spec.init, spec.dtype)
            for name, spec in optimizer.state_spec(rows.shape[1]).items()
        },
    }

    @jax.jit
    def step(params, opt_state, table, table_opt, ids, touched, labels):
        def loss_fn(params, table):
            logits = model.apply({"params": params, "reference": {"embed": {"table": table}}}, ids)
            return bce(logits, labels)

        loss, (grads, table_grad) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, table)
        updates, opt_state = tx.update(grads, opt_state, params)
        # The row rule is row-wise, so applying it to every row and keeping the
        # touched ones is the same as applying it to the touched rows only.
        new_table, new_opt = optimizer.update(table, table_grad, table_opt)
        keep = touched[:, None]
        table = jnp.where(keep, new_table, table)
        table_opt = {
            k: jnp.where(touched.reshape(-1, *[1] * (v.ndim - 1)), new_opt[k], v)
            for k, v in table_opt.items()
        }
        return optax.apply_updates(params, updates), opt_state, table, table_opt, loss

    def train(ids, labels):
        touched = np.zeros(rows.shape[0], bool)
        touched[ids.ravel()] = True
        *state, loss = step(
            held["params"],
            held["opt_state"],
            held["table"],
            held["table_opt"],
            ids,
            touched,
            labels,
        )
        held["params"], held["opt_state"], held["table"], held["table_opt"] = state
        return loss

    return held, train


def max_diff(a, b) -> float:
    diffs = jax.tree.map(lambda x, y: float(np.max(np.abs(np.asarray(x) - np.asarray(y)))), a, b)
    return max(jax.tree.leaves(diffs), default=0.0)


@pytest.mark.parametrize(
    "optimizer", [jaxcache.adagrad(0.1), jaxcache.adam(0.05)], ids=["adagrad", "adam"]
)
def test_training_matches_full_table_reference_under_heavy_churn(optimizer):
    cfg = jaxcache.CacheConfig(N, D, capacity=130, policy="lru", optimizer=optimizer)
    cache = jaxcache.EmbeddingCache(cfg)
    initial_rows = np.array(cache.table.rows)
    held, train = make_linen(cache)
    ref, ref_train = make_linen_reference(initial_rows, optimizer, held["params"])

    for ids, labels in zipf_batches(N, B, F, STEPS, seed=1):
        loss = train(ids, labels)
        ref_loss = ref_train(ids, labels)
        assert abs(float(loss) - float(ref_loss)) <= TOL

    assert cache.stats.total.evictions > 3 * cfg.capacity  # rows really moved
    rows, opt = jaxcache.linen.export(cache, held["cache"])
    assert max_diff(rows, ref["table"]) <= TOL
    assert max_diff(opt, ref["table_opt"]) <= TOL
    assert max_diff(held["params"], ref["params"]) <= TOL
    untouched = np.ones(N, bool)
    for ids, _ in zipf_batches(N, B, F, STEPS, seed=1):
        untouched[ids.ravel()] = False
    np.testing.assert_array_equal(rows[untouched], initial_rows[untouched])


def test_prefetch_through_a_holder_is_bit_identical_to_the_unpipelined_run():
    cfg = jaxcache.CacheConfig(N, D, capacity=130, policy="lru", optimizer=jaxcache.adagrad(0.1))
    batches = list(zipf_batches(N, B, F, 8, seed=3))
    cache = jaxcache.EmbeddingCache(cfg)
    held, train = make_linen(cache)
    losses = [float(train(ids, labels)) for ids, labels in batches]

    piped_cache = jaxcache.EmbeddingCache(cfg)
    piped, _ = make_linen(piped_cache)
    holder = jaxcache.linen.Holder(piped_cache, piped["cache"])  # the collection alone
    stream = ({"ids": ids, "labels": labels} for ids, labels in batches)
    piped_losses = []
    with jaxcache.prefetch(stream, {"ids": holder}, lookahead=2) as pipeline:
        for batch in pipeline:  # the pipeline has swapped this batch's rows into holder.variables
            piped["params"], piped["opt_state"], holder.variables, loss = piped["step"](
                piped["params"], piped["opt_state"], holder.variables, batch["ids"], batch["labels"]
            )
            piped_losses.append(float(loss))

    assert piped_cache.stats.total.evictions > 0  # rows really moved between steps
    assert piped_losses == losses
    rows, opt = jaxcache.linen.export(cache, held["cache"])
    piped_rows, piped_opt = jaxcache.linen.export(piped_cache, holder.variables)
    np.testing.assert_array_equal(piped_rows, rows)
    np.testing.assert_array_equal(piped_opt["accumulator"], opt["accumulator"])
    assert max_diff(piped["params"], held["params"]) == 0.0


def test_a_holder_refuses_variables_without_its_table():
    cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(30, 2, capacity=8, name="users"))
    other = jaxcache.EmbeddingCache(jaxcache.CacheConfig(30, 2, capacity=8, name="items"))
    embed = jaxcache.linen.CachedEmbed(cache)
    variables = embed.init(jax.random.key(0), jaxcache.linen.init_lookup(cache, (2,)))
    with pytest.raises(ValueError, match=r"no device state for table 'items'.*\['users'\]"):
        jaxcache.linen.Holder(other, variables)
    with pytest.raises(ValueError, match=r"no device state for table 'items'"):
        jaxcache.linen.Holder(cache, variables).for_cache(other)


def _prepared_run_and_a_second_tower(batches):
    """Trains ``make_linen`` over ``batches`` (ids prepared on the host) and
    builds a second tower of the same configuration, to be trained otherwise.

    Returns ``(cache, held, losses)`` of the first and ``(cache, held, model,
    tx)`` of the second.
    """
    cfg = jaxcache.CacheConfig(N, D, capacity=130, policy="lru", optimizer=jaxcache.adam(0.05))
    cache = jaxcache.EmbeddingCache(cfg)
    held, train = make_linen(cache)
    losses = [float(train(ids, labels)) for ids, labels in batches]
    other = jaxcache.EmbeddingCache(cfg)
    other_held, _ = make_linen(other)
    model = Tower(jaxcache.linen.CachedEmbed(other))
    return (cache, held, losses), (other, other_held, model, optax.adam(1e-2))


def test_lookup_ids_inside_the_step_matches_prepare_bit_for_bit():
    # The host-callback form: raw ids go into the jitted step.
    batches = list(zipf_batches(N, B, F, 8, seed=4))
    (cache, held, losses), (ids_cache, ids_held, model, tx) = _prepared_run_and_a_second_tower(
        batches
    )

    @jax.jit
    def step(params, opt_state, cache_vars, ids, labels):
        cache_vars, lookup = jaxcache.linen.lookup_ids(ids_cache, cache_vars, ids)

        def loss_fn(params, cache_vars, lookup):
            logits = model.apply({"params": params, jaxcache.linen.COLLECTION: cache_vars}, lookup)
            return bce(logits, labels)

        loss, grads, cache_vars = jaxcache.linen.value_and_grad(loss_fn, ids_cache)(
            params, cache_vars, lookup
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, cache_vars, loss

    ids_losses = []
    for ids, labels in batches:
        ids_held["params"], ids_held["opt_state"], ids_held["cache"], loss = step(
            ids_held["params"], ids_held["opt_state"], ids_held["cache"], ids, labels
        )
        ids_losses.append(float(loss))

    assert ids_cache.stats.total.evictions > 0
    assert ids_losses == losses
    rows, opt = jaxcache.linen.export(cache, held["cache"])
    ids_rows, ids_opt = jaxcache.linen.export(ids_cache, ids_held["cache"])
    np.testing.assert_array_equal(ids_rows, rows)
    assert max_diff(ids_opt, opt) == 0.0
    assert max_diff(ids_held["params"], held["params"]) == 0.0


def test_update_if_finite_trains_as_value_and_grad_and_skips_a_nonfinite_step():
    batches = list(zipf_batches(N, B, F, 6, seed=5))
    (cache, held, plain), (guarded_cache, guarded, model, tx) = _prepared_run_and_a_second_tower(
        batches
    )

    def loss_fn(params, cache_vars, lookup, labels):
        logits = model.apply({"params": params, jaxcache.linen.COLLECTION: cache_vars}, lookup)
        return bce(logits, labels)

    step = jax.jit(jaxcache.linen.update_if_finite(loss_fn, guarded_cache, tx))

    def run(ids, labels):
        guarded["cache"], lookup = jaxcache.linen.prepare(guarded_cache, guarded["cache"], ids)
        loss, guarded["params"], guarded["opt_state"], guarded["cache"], check = step(
            guarded["params"], guarded["opt_state"], guarded["cache"], lookup, labels
        )
        return loss, check

    losses = []
    for i, (ids, labels) in enumerate(batches):
        loss, check = run(ids, labels)
        jaxcache.nnx.raise_if_nonfinite(check, step=i)
        losses.append(float(loss))
    # The same computation, compiled as another program: equal up to rounding.
    np.testing.assert_allclose(losses, plain, rtol=1e-6)
    rows, opt = jaxcache.linen.export(cache, held["cache"])
    guarded_rows, guarded_opt = jaxcache.linen.export(guarded_cache, guarded["cache"])
    np.testing.assert_allclose(guarded_rows, rows, rtol=1e-5, atol=1e-6)
    for name, state in opt.items():
        np.testing.assert_allclose(guarded_opt[name], state, rtol=1e-5, atol=1e-6)

    before = jaxcache.linen.export(guarded_cache, guarded["cache"])
    params, opt_state = guarded["params"], guarded["opt_state"]
    ids, labels = batches[0]
    _, check = run(ids, np.full_like(labels, np.nan))
    with pytest.raises(jaxcache.NonFiniteError, match="step 6: non-finite"):
        jaxcache.nnx.raise_if_nonfinite(check, step=6)
    after = jaxcache.linen.export(guarded_cache, guarded["cache"])
    np.testing.assert_array_equal(after[0], before[0])
    assert max_diff(after[1], before[1]) == 0.0
    assert max_diff(guarded["params"], params) == 0.0
    assert max_diff(guarded["opt_state"], opt_state) == 0.0


def make_held_linen(cache, learning_rate, seed=0):
    """A Linen ``Tower`` through ``cache`` whose variables (params included) a
    ``Holder`` keeps; the dense parameters take plain SGD steps, so the
    variables are the whole training state. Returns the holder and
    ``train(ids, labels)``."""
    model = Tower(jaxcache.linen.CachedEmbed(cache))
    variables = model.init(jax.random.key(seed), jaxcache.linen.init_lookup(cache, (B, F)))
    holder = jaxcache.linen.Holder(cache, variables)

    @jax.jit
    def step(variables, lookup, labels):
        def loss_fn(params, variables, lookup):
            return bce(model.apply({**variables, "params": params}, lookup), labels)

        grad_fn = jaxcache.linen.value_and_grad(loss_fn, cache)
        loss, grads, variables = grad_fn(variables["params"], variables, lookup)
        params = jax.tree.map(lambda p, g: p - learning_rate * g, variables["params"], grads)
        return {**variables, "params": params}, loss

    def train(ids, labels):
        variables, lookup = jaxcache.linen.prepare(cache, holder.variables, ids)
        holder.variables, loss = step(variables, lookup, labels)
        return float(loss)

    return holder, train


@pytest.mark.parametrize("guarded", [False, True])
@pytest.mark.parametrize(("factor", "rate"), [(3.0, 1.5), (0.0, 0.0)])
def test_a_learning_rate_scale_multiplies_the_sparse_rate(guarded, factor, rate):
    # sgd(0.5) at a traced factor of 3 steps as sgd(1.5); at 0 the rows stay.
    cfg = jaxcache.CacheConfig(100, 2, capacity=8, optimizer=jaxcache.sgd(0.5))
    cache = jaxcache.EmbeddingCache(cfg)
    embed = jaxcache.linen.CachedEmbed(cache, combiner="sum")
    variables = embed.init(jax.random.key(0), jaxcache.linen.init_lookup(cache, (1, 2)))

    def loss_fn(params, variables, lookup):
        return embed.apply(variables, lookup).sum()

    @jax.jit
    def step(variables, lookup, factor):
        if guarded:
            tx = optax.sgd(0.1)
            update = jaxcache.linen.update_if_finite(loss_fn, cache, tx, learning_rate_scale=factor)
            return update({}, tx.init({}), variables, lookup)[3]
        grad_fn = jaxcache.linen.value_and_grad(loss_fn, cache, learning_rate_scale=factor)
        return grad_fn({}, variables, lookup)[2]

    variables, lookup = jaxcache.linen.prepare(cache, variables, np.array([[5, 5]]))
    before = cache.table.rows[5].copy()
    variables = step(variables, lookup, jnp.float32(factor))
    rows, _ = jaxcache.linen.export(cache, variables)
    np.testing.assert_allclose(rows[5], before - 2 * rate, rtol=1e-6)  # gradient 2


def test_a_linen_model_is_checkpointed_and_restored_exactly(tmp_path):
    """Checkpointer(model=holder) saves a Linen model's variables and every table
    of its holders; restored into another cache and other variables, training
    goes on exactly as the saved run does, and both match the full-table reference."""
    cfg = jaxcache.CacheConfig(N, D, capacity=130, policy="lfu", optimizer=jaxcache.adagrad(0.1))
    batches = list(zipf_batches(N, B, F, 16, seed=6))
    cache = jaxcache.EmbeddingCache(cfg)
    initial_rows = np.array(cache.table.rows)
    holder, train = make_held_linen(cache, 0.05)
    params = holder.variables["params"]
    ref, ref_train = make_linen_reference(initial_rows, cfg.optimizer, params, optax.sgd(0.05))
    for ids, labels in batches[:8]:
        assert abs(train(ids, labels) - float(ref_train(ids, labels))) <= TOL

    checkpointer = jaxcache.Checkpointer(tmp_path)
    assert checkpointer.save(8, model=holder).tables == ("embedding",)
    restored_cache = jaxcache.EmbeddingCache(cfg, seed=5)
    restored, restored_train = make_held_linen(restored_cache, 0.05, seed=1)
    assert max_diff(restored.variables["params"], holder.variables["params"]) > 0
    checkpointer.restore(model=restored)
    assert max_diff(restored.variables["params"], holder.variables["params"]) == 0.0
    # The same cache: rows in the same slots, the same counts and statistics.
    np.testing.assert_array_equal(restored_cache.planner.id_of_slot, cache.planner.id_of_slot)
    np.testing.assert_array_equal(
        restored_cache.planner.policy_state()["counts"], cache.planner.policy_state()["counts"]
    )
    assert restored_cache.stats.total == cache.stats.total

    for ids, labels in batches[8:]:
        loss, ref_loss = train(ids, labels), float(ref_train(ids, labels))
        assert restored_train(ids, labels) == loss and abs(loss - ref_loss) <= TOL
    assert cache.stats.total.evictions > 3 * cfg.capacity  # rows really moved
    rows, opt = jaxcache.linen.export(cache, holder.variables)
    restored_rows, restored_opt = jaxcache.linen.export(restored_cache, restored.variables)
    np.testing.assert_array_equal(restored_rows, rows)
    np.testing.assert_array_equal(restored_opt["accumulator"], opt["accumulator"])
    assert max_diff(restored.variables["params"], holder.variables["params"]) == 0.0
    assert max_diff(rows, ref["table"]) <= TOL
    assert max_diff(opt, ref["table_opt"]) <= TOL
    assert max_diff(holder.variables["params"], ref["params"]) <= TOL


def test_numpy_params_restore_as_numpy_onto_another_device_count(tmp_path):
    # Params kept as NumPy (loaded from a file, say) have no layout: orbax
    # restored them on the saved run's devices, and a model on another
    # mesh failed its first step on incompatible devices.
    def build(devices):
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("rows",))
        cfg = jaxcache.CacheConfig(100, 4, capacity=32, optimizer=jaxcache.sgd(0.1))
        cache = jaxcache.EmbeddingCache(cfg, mesh=mesh)

        class Scaled(nn.Module):
            @nn.compact
            def __call__(self, lookup):
                scale = self.param("scale", nn.initializers.ones, (1,))
                return jaxcache.linen.CachedEmbed(cache)(lookup).sum(-1) * scale[0]

        model = Scaled()
        variables = model.init(jax.random.key(0), jaxcache.linen.init_lookup(cache, (8,)))
        variables = {**variables, "params": {"scale": np.full(1, 2.0, np.float32)}}
        loss = jaxcache.linen.value_and_grad(
            lambda p, v, lookup: model.apply({**v, "params": p}, lookup).sum(), cache
        )
        step = jax.jit(loss)
        holder = jaxcache.linen.Holder(cache, variables)

        def train(ids):
            holder.variables, lookup = jaxcache.linen.prepare(cache, holder.variables, ids)
            value, _, holder.variables = step(holder.variables["params"], holder.variables, lookup)
            return float(value)

        return holder, train

    holder, train = build(1)
    train(np.arange(8))
    jaxcache.Checkpointer(tmp_path).save(1, model=holder)
    restored, restored_train = build(2)
    jaxcache.Checkpointer(tmp_path).restore(model=restored)
    scale = restored.variables["params"]["scale"]
    assert isinstance(scale, np.ndarray) and scale.tolist() == [2.0]
    # The step runs on the new mesh, from the saved rows.
    assert restored_train(np.arange(8)) == pytest.approx(train(np.arange(8)), abs=1e-6)


def test_a_linen_checkpoint_needs_a_holder_for_every_table(tmp_path):
    users, items = (
        jaxcache.EmbeddingCache(jaxcache.CacheConfig(40, 2, capacity=8, name=name))
        for name in ("users", "items")
    )
    model = TwoTables(users, items)
    variables = model.init(
        jax.random.key(0),
        jaxcache.linen.init_lookup(users, (1, 3)),
        jaxcache.linen.init_lookup(items, (1, 2)),
    )
    holder = jaxcache.linen.Holder(users, variables)
    checkpointer = jaxcache.Checkpointer(tmp_path)
    with pytest.raises(ValueError, match=r"table 'items' but no holder.*for_cache"):
        checkpointer.save(1, model=holder)
    with pytest.raises(TypeError, match=r"Linen module, which holds no state.*linen\.Holder"):
        checkpointer.save(1, model=model)
    assert checkpointer.steps() == []
    holder.for_cache(items)
    assert checkpointer.save(1, model=holder).tables == ("items", "users")


def nnx_dense_params(model):
    """The NNX ``Tower``'s dense parameters laid out as the Linen ``Tower``'s params."""
    layers = {"hidden": model.hidden, "out": model.out}
    return {
        name: {"kernel": layer.kernel[...], "bias": layer.bias[...]}
        for name, layer in layers.items()
    }


def test_linen_and_nnx_shells_train_the_same_table():
    cfg = jaxcache.CacheConfig(N, D, capacity=130, optimizer=jaxcache.rowwise_adagrad(0.1))
    nnx_cache, linen_cache = jaxcache.EmbeddingCache(cfg), jaxcache.EmbeddingCache(cfg)
    nnx_model, nnx_train = make_cached(nnx_cache, F)
    held, linen_train = make_linen(linen_cache, nnx_dense_params(nnx_model))

    for ids, labels in zipf_batches(N, B, F, 10, seed=2):
        nnx_train(ids, labels)
        linen_train(ids, labels)

    nnx_rows, nnx_opt = nnx_model.embed.export()
    linen_rows, linen_opt = jaxcache.linen.export(linen_cache, held["cache"])
    assert max_diff(linen_rows, nnx_rows) <= TOL
    assert max_diff(linen_opt, nnx_opt) <= TOL
    assert max_diff(held["params"], nnx_dense_params(nnx_model)) <= TOL


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_pooled_bags_with_padding_match_numpy(combiner):
    cfg = jaxcache.CacheConfig(50, 3, capacity=20, padding_id=-1)
    cache = jaxcache.EmbeddingCache(cfg)
    ids = np.array([[4, 7, -1, 7], [-1, -1, -1, -1], [0, 49, 13, -1], [2, -1, 2, 2]])
    weights = np.random.default_rng(0).uniform(0.5, 2.0, ids.shape).astype(np.float32)
    embed = jaxcache.linen.CachedEmbed(cache, combiner=combiner)
    variables = embed.init(jax.random.key(0), jaxcache.linen.init_lookup(cache, ids.shape))
    variables, lookup = jaxcache.linen.prepare(cache, variables, ids, train=False)
    out = np.asarray(jax.jit(embed.apply)(variables, lookup, weights))

    real = (ids != -1) * weights
    expected = np.einsum("bl,bld->bd", real, cache.table.rows[np.where(ids < 0, 0, ids)])
    if combiner == "mean":
        count = real.sum(-1, keepdims=True)
        expected = expected / np.where(count == 0, 1, count)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(out[1], 0.0)


def test_padding_ids_look_up_zero_rows_without_a_combiner():
    cfg = jaxcache.CacheConfig(50, 3, capacity=20, padding_id=-1)
    cache = jaxcache.EmbeddingCache(cfg)
    ids = np.array([[5, -1], [-1, 9]])
    embed = jaxcache.linen.CachedEmbed(cache)
    variables = embed.init(jax.random.key(0), jaxcache.linen.init_lookup(cache, ids.shape))
    variables, lookup = jaxcache.linen.prepare(cache, variables, ids, train=False)
    out = np.asarray(embed.apply(variables, lookup))
    np.testing.assert_array_equal(out[ids < 0], 0.0)
    np.testing.assert_array_equal(out[ids >= 0], cache.table.rows[[5, 9]])
    with pytest.raises(ValueError, match=r"weights need a combiner.*or pass no weights"):
        embed.apply(variables, lookup, np.ones(ids.shape))


class TwoTables(nn.Module):
    """A user and an item table at different depths of the module tree."""

    users: jaxcache.EmbeddingCache
    items: jaxcache.EmbeddingCache

    @nn.compact
    def __call__(self, user_lookup, item_lookup):
        user = jaxcache.linen.CachedEmbed(self.users, combiner="sum")(user_lookup)
        item = nn.Sequential([jaxcache.linen.CachedEmbed(self.items, combiner="sum")])(item_lookup)
        return jnp.concatenate([user, item], axis=-1)


def test_two_tables_are_found_by_name_and_updated_by_their_own_optimizer():
    def config(name, lr):
        return jaxcache.CacheConfig(40, 2, capacity=8, optimizer=jaxcache.sgd(lr), name=name)

    users = jaxcache.EmbeddingCache(config("user", 1.0))
    items = jaxcache.EmbeddingCache(config("item", 0.5))
    model = TwoTables(users, items)
    variables = model.init(
        jax.random.key(0),
        jaxcache.linen.init_lookup(users, (1, 3)),
        jaxcache.linen.init_lookup(items, (1, 2)),
    )
    before_users, before_items = np.array(users.table.rows), np.array(items.table.rows)
    variables, user_lookup = jaxcache.linen.prepare(users, variables, np.array([[3, 3, 5]]))
    variables, item_lookup = jaxcache.linen.prepare(items, variables, np.array([[7, 8]]))

    def loss_fn(params, variables, user_lookup, item_lookup):
        return model.apply({**variables, "params": params}, user_lookup, item_lookup).sum()

    grad_fn = jax.jit(jaxcache.linen.value_and_grad(loss_fn, [users, items]))
    _, grads, variables = grad_fn({}, variables, user_lookup, item_lookup)
    assert grads == {}

    user_rows, _ = jaxcache.linen.export(users, variables)
    item_rows, _ = jaxcache.linen.export(items, variables)
    # d(sum)/d(row) is the row's count in its bag; sgd steps by lr * count.
    np.testing.assert_allclose(user_rows[[3, 5]], before_users[[3, 5]] - [[2.0], [1.0]])
    np.testing.assert_allclose(item_rows[[7, 8]], before_items[[7, 8]] - 0.5)
    untouched = np.setdiff1d(np.arange(40), [3, 5])
    np.testing.assert_array_equal(user_rows[untouched], before_users[untouched])


def test_a_lookup_for_another_table_raises():
    cache_a = jaxcache.EmbeddingCache(jaxcache.CacheConfig(30, 2, capacity=8, name="a"))
    cache_b = jaxcache.EmbeddingCache(jaxcache.CacheConfig(30, 2, capacity=8, name="b"))
    embed = jaxcache.linen.CachedEmbed(cache_a)
    variables = embed.init(jax.random.key(0), jaxcache.linen.init_lookup(cache_a, (2,)))
    _, lookup_b = cache_b.prepare(cache_b.init_state(), np.array([1, 2]))

    with pytest.raises(ValueError, match="lookup is for table 'b' but this module serves 'a'"):
        embed.apply(variables, lookup_b)
    with pytest.raises(ValueError, match="Lookup for table 'b' was passed but nothing serves it"):
        jaxcache.linen.value_and_grad(lambda p, v, lk: embed.apply(v, lk).sum(), cache_a)(
            {}, variables, lookup_b
        )
    with pytest.raises(ValueError, match=r"no device state for table 'b'.*tables found: \['a'\]"):
        jaxcache.linen.prepare(cache_b, variables, np.array([1, 2]))


def test_misuse_fails_early_with_a_fix():
    cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(30, 2, capacity=8))
    with pytest.raises(ValueError, match="combiner='max' is not supported"):
        jaxcache.linen.CachedEmbed(cache, combiner="max")

    embed = jaxcache.linen.CachedEmbed(cache)
    lookup = jaxcache.linen.init_lookup(cache, (2,))
    with pytest.raises(
        ValueError, match=r"in the top-level module; .*'jaxcache' collection included"
    ):
        embed.apply({}, lookup)

    class Wrapper(nn.Module):
        @nn.compact
        def __call__(self, lookup):
            return jaxcache.linen.CachedEmbed(cache, name="embed")(lookup)

    with pytest.raises(ValueError, match="for table 'embedding' in module 'embed'; apply"):
        Wrapper().apply({}, lookup)

    class Twice(nn.Module):
        @nn.compact
        def __call__(self, lookup):
            return jaxcache.linen.CachedEmbed(cache)(lookup) + jaxcache.linen.CachedEmbed(cache)(
                lookup
            )

    variables = Twice().init(jax.random.key(0), jaxcache.linen.init_lookup(cache, (2,)))
    with pytest.raises(ValueError, match="several modules"):
        jaxcache.linen.prepare(cache, variables, np.array([1, 2]))


def test_raw_ids_through_linen_equal_the_whole_table():
    # A dynamic vocabulary of 300 rows under churn, through a Linen model:
    # a cache of 130 slots and the whole table on device train alike.
    from tests.test_raw_ids import config, raw_batches

    def run(capacity):
        cfg = config(300, capacity, jaxcache.adagrad(0.2), policy="lru")
        table = jaxcache.HostTable(cfg, seed=1)
        cache = (
            jaxcache.EmbeddingCache(cfg, table=table)
            if capacity < 300
            else jaxcache.EmbeddingCache.full_table(cfg, table=table)
        )
        held, train = make_linen(cache)
        losses = [float(train(ids, y)) for ids, y in raw_batches(10, seed=2)]
        rows, _ = jaxcache.linen.export(cache, held["cache"])
        return cache, losses, rows, cache.vocabulary.state_dict()["ids"]

    cache, losses, rows, ids = run(130)
    _, full_losses, full_rows, full_ids = run(300)
    assert cache.stats.total.forgotten_ids > 50 and cache.stats.total.rows_to_host > 100
    np.testing.assert_allclose(losses, full_losses, rtol=0, atol=TOL)
    np.testing.assert_array_equal(ids, full_ids)  # the same ids in the same rows
    np.testing.assert_allclose(rows, full_rows, rtol=0, atol=TOL)


def test_variables_passed_to_prepare_are_refused_afterwards_with_the_fix():
    cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, capacity=16))
    embed = jaxcache.linen.CachedEmbed(cache)
    variables = embed.init(jax.random.key(0), jaxcache.linen.init_lookup(cache, (1, 3)))
    new, lookup = jaxcache.linen.prepare(cache, variables, np.array([[7, 8, 7]]))
    with pytest.raises(ValueError, match=r"were donated to a swap: apply the model with the"):
        embed.apply(variables, lookup)
    with pytest.raises(ValueError, match=r"donated to an earlier swap"):
        jaxcache.linen.prepare(cache, variables, np.array([[1, 2, 3]]))
    np.testing.assert_array_equal(embed.apply(new, lookup)[0, 0], cache.table.rows[7])
