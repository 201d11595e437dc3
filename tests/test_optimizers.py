"""Each sparse optimizer follows its dense optax counterpart on the rows it touches."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcache

CASES = [
    (jaxcache.sgd(0.3), optax.sgd(0.3)),
    (jaxcache.adagrad(0.3), optax.adagrad(0.3)),
    (jaxcache.adam(0.05), optax.adam(0.05)),
]


@pytest.mark.parametrize(("sparse", "dense"), CASES, ids=lambda x: type(x).__name__)
def test_rows_follow_optax(sparse, dense):
    rng = np.random.default_rng(0)
    rows = jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)
    state = {k: jnp.full((5, *s.shape), s.init, s.dtype) for k, s in sparse.state_spec(3).items()}
    dense_params, dense_state = rows, dense.init(rows)
    for _ in range(4):
        grads = jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)
        rows, state = sparse.update(rows, grads, state)
        updates, dense_state = dense.update(grads, dense_state, dense_params)
        dense_params = optax.apply_updates(dense_params, updates)
    np.testing.assert_allclose(rows, dense_params, atol=1e-6)


@pytest.mark.parametrize(("sparse", "dense"), CASES, ids=lambda x: type(x).__name__)
def test_a_scaled_rate_follows_an_optax_schedule(sparse, dense):
    # Warm-up from 0, then decay: each step's factor of the configured rate
    # against optax reading the same rates from its schedule (at the
    # update's count, 0 first).
    factors = [0.0, 0.25, 1.0, 0.5, 0.125]
    rates = jnp.asarray([sparse.learning_rate * f for f in factors], jnp.float32)
    scheduled = {"SGD": optax.sgd, "Adagrad": optax.adagrad, "Adam": optax.adam}
    dense = scheduled[type(sparse).__name__](lambda count: rates[count])
    rng = np.random.default_rng(1)
    rows = jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)
    state = {k: jnp.full((5, *s.shape), s.init, s.dtype) for k, s in sparse.state_spec(3).items()}
    dense_params, dense_state = rows, dense.init(rows)
    for factor in factors:
        grads = jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)
        rows, state = sparse.scaled(jnp.float32(factor)).update(rows, grads, state)
        updates, dense_state = dense.update(grads, dense_state, dense_params)
        dense_params = optax.apply_updates(dense_params, updates)
    np.testing.assert_allclose(rows, dense_params, atol=1e-6)
    assert float(sparse.learning_rate) in (0.3, 0.05)  # the configuration keeps its rate


def test_rowwise_adagrad_rule():
    opt = jaxcache.rowwise_adagrad(0.5, initial_accumulator_value=1.0)
    rows = jnp.zeros((1, 2))
    g = jnp.array([[3.0, 1.0]])
    rows, state = opt.update(rows, g, {"accumulator": jnp.ones(1)})
    acc = 1.0 + (9.0 + 1.0) / 2
    np.testing.assert_allclose(state["accumulator"], [acc])
    np.testing.assert_allclose(rows, -0.5 * np.array([[3.0, 1.0]]) / (np.sqrt(acc) + 1e-8))


def test_lazy_adam_counts_per_row():
    opt = jaxcache.adam(0.1)
    state = {k: jnp.full((2, *s.shape), s.init, s.dtype) for k, s in opt.state_spec(2).items()}
    _, state = opt.update(jnp.zeros((2, 2)), jnp.ones((2, 2)), state)
    assert state["count"].tolist() == [1, 1]


def test_every_optimizer_class_is_registered_and_names_are_not_shared():
    registered = jaxcache.optimizers.registered()
    for cls in (
        jaxcache.optimizers.SGD,
        jaxcache.optimizers.Adagrad,
        jaxcache.optimizers.RowwiseAdagrad,
        jaxcache.optimizers.Adam,
    ):  # under the class names the checkpoints of 0.1 recorded
        assert registered[cls.__name__] is cls and cls.registered_name == cls.__name__
    serving = jaxcache.serving_config(jaxcache.CacheConfig(10, 2, 4)).optimizer
    assert registered["ReadOnly"] is type(serving)

    with pytest.raises(TypeError, match=r"name 'Adam' is taken by jaxcache\._src\.optimizers"):

        @dataclasses.dataclass(frozen=True)
        class Adam(jaxcache.SparseOptimizer):
            pass

    with pytest.raises(TypeError, match="must be a non-empty string"):

        class Unnamed(jaxcache.SparseOptimizer, name=""):
            pass

    @dataclasses.dataclass(frozen=True)
    class Halved(jaxcache.SparseOptimizer, name="tests.halved"):
        def update(self, rows, grads, state):
            return rows - 0.5 * self.learning_rate * grads, state

    @dataclasses.dataclass(frozen=True, slots=True)  # made again by dataclass: same name
    class Slotted(jaxcache.SparseOptimizer, name="tests.slotted"):
        def update(self, rows, grads, state):
            return rows - self.learning_rate * grads, state

    assert Slotted.registered_name == "tests.slotted"
    assert "Slotted" not in jaxcache.optimizers.registered()
    assert jaxcache.optimizers.registered()["tests.slotted"] is Slotted
    assert jaxcache.optimizers.registered()["Adam"] is jaxcache.optimizers.Adam
    assert jaxcache.optimizers.registered()["tests.halved"] is Halved
    assert "tests.halved" not in registered  # a copy, not the registry itself
