"""The non-finite guard skips a bad update as a whole and names it; finite steps are unchanged."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxcache
from tests.models import Tower, bce, host_planners, zipf_batches

N, D, B, F = 2000, 8, 16, 3
DENSE = nnx.Not(nnx.Any(jaxcache.nnx.CacheRows, jaxcache.nnx.CacheOptState))


def _model():
    config = jaxcache.CacheConfig(N, D, capacity=100, policy="lru", optimizer=jaxcache.adam(0.05))
    cache = jaxcache.EmbeddingCache(config, seed=1)
    model = Tower(jaxcache.nnx.CachedEmbed(cache), F, D)
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def _loss_fn(model, lookup, labels):
    return bce(model(lookup), labels)


@nnx.jit
def _plain_step(model, optimizer, lookup, labels):
    loss, grads = jaxcache.nnx.value_and_grad(_loss_fn)(model, lookup, labels)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def _guarded_step(model, optimizer, lookup, labels):
    return jaxcache.nnx.update_if_finite(_loss_fn)(model, optimizer, lookup, labels)


def _snapshot(model, optimizer):
    rows, state = model.embed.export()
    dense = [np.asarray(x) for x in jax.tree.leaves(nnx.state((model, optimizer), DENSE))]
    return [rows, *state.values(), *dense]


def _batches(steps, seed=0):
    return [{"ids": ids, "y": y} for ids, y in zipf_batches(N, B, F, steps, seed=seed)]


def test_guarded_steps_match_plain_steps_when_finite():
    batches = _batches(12)
    runs = []
    for guarded in (False, True):
        model, optimizer = _model()
        losses = []
        with jaxcache.prefetch(batches, {"ids": model.embed}, lookahead=2) as pipeline:
            for i, b in enumerate(pipeline):
                if guarded:
                    loss, check = _guarded_step(model, optimizer, b["ids"], b["y"])
                    jaxcache.nnx.raise_if_nonfinite(check, step=i)
                else:
                    loss = _plain_step(model, optimizer, b["ids"], b["y"])
                losses.append(float(loss))
        runs.append((losses, _snapshot(model, optimizer)))
    # The same computation, compiled as another program: equal up to rounding.
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-6)
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_learning_rate_scale_of_zero_trains_the_dense_part_alone():
    model, optimizer = _model()
    start = _snapshot(model, optimizer)

    @nnx.jit
    def step(model, optimizer, lookup, labels, factor):
        update = jaxcache.nnx.update_if_finite(_loss_fn, learning_rate_scale=factor)
        return update(model, optimizer, lookup, labels)

    for b in _batches(3):
        _, check = step(model, optimizer, model.embed.prepare(b["ids"]), b["y"], np.float32(0))
        jaxcache.nnx.raise_if_nonfinite(check, step=0)
    after = _snapshot(model, optimizer)
    np.testing.assert_array_equal(after[0], start[0])  # the rows
    assert not np.array_equal(after[-1], start[-1])  # a dense parameter moved


@pytest.mark.parametrize("poison", ["labels", "row"])
def test_a_nonfinite_step_is_skipped_and_named(poison):
    model, optimizer = _model()
    batches = _batches(6, seed=1)
    for i, b in enumerate(batches[:3]):
        _, check = _guarded_step(model, optimizer, model.embed.prepare(b["ids"]), b["y"])
        jaxcache.nnx.raise_if_nonfinite(check, step=i)
    bad = dict(batches[3])
    if poison == "labels":
        bad["y"] = np.full_like(bad["y"], np.nan)
    else:  # a row not on device yet turns non-finite on the host
        directory = host_planners(model.embed.cache)[0].slot_of_id
        row = next(int(i) for i in bad["ids"].ravel() if directory[i] < 0)
        model.embed.flush()
        model.embed.cache.table.rows[row] = np.inf
    before = _snapshot(model, optimizer)
    lookup = model.embed.prepare(bad["ids"])
    _, check = _guarded_step(model, optimizer, lookup, bad["y"])
    with pytest.raises(jaxcache.NonFiniteError, match="step 3: non-finite") as info:
        jaxcache.nnx.raise_if_nonfinite(check, step=3)
    assert info.value.step == 3 and info.value.tables == ["embedding"]
    assert "table 'embedding'" in str(info.value) and "as they were" in str(info.value)
    after = _snapshot(model, optimizer)
    for x, y in zip(before, after, strict=True):
        np.testing.assert_array_equal(x, y)  # nothing changed, the poisoned row included
    if poison == "labels":  # training goes on from the unchanged state
        b = batches[4]
        _, check = _guarded_step(model, optimizer, model.embed.prepare(b["ids"]), b["y"])
        jaxcache.nnx.raise_if_nonfinite(check, step=4)
