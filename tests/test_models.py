"""The steps of ``jaxcache.models``: one ``jax.jit`` over the modules' variables."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import jaxcache
from jaxcache._src import models

DATA = jaxcache.synthetic.SyntheticCriteo(scale=0.0003, batch_size=32, seed=5)


def _model(seed: int = 0):
    config = jaxcache.CacheConfig(
        DATA.num_embeddings,
        8,
        capacity=800,  # three batches of distinct ids need up to 729 slots: heavy churn
        optimizer=jaxcache.rowwise_adagrad(0.05),
    )
    rows = jaxcache.HostTable(config, seed=seed).rows
    embed = jaxcache.nnx.CachedEmbed(
        jaxcache.EmbeddingCache(config, table=jaxcache.HostTable(config, rows=rows))
    )
    model = jaxcache.models.DLRM(
        embed, num_sparse=DATA.num_features, features=8, bottom=(16,), top=(16,), rngs=nnx.Rngs(0)
    )
    return embed, model


def _train(embed, model, optimizer, step, steps: int) -> list[float]:
    with jaxcache.prefetch(DATA.batches(steps), {"sparse": embed}, lookahead=2) as pipeline:
        losses = [step(b["dense"], b["sparse"], b["label"]) for b in pipeline]
    embed.flush()
    return [float(loss) for loss in losses]


def test_the_train_step_computes_what_nnx_jit_computes():
    """Same losses, table, optimizer state and dense parameters, bit for bit,
    through a pipeline that swaps rows into the module between steps (so the
    step must read the module's current arrays and write its results back)."""
    tx = jaxcache.models.dense_optimizer("adam", 0.01)
    embed, model = _model()
    optimizer, step = jaxcache.models.make_train_step(model, tx)
    staged = _train(embed, model, optimizer, step, 25)

    ref_embed, ref_model = _model()
    ref_optimizer = nnx.Optimizer(ref_model, tx, wrt=nnx.Param)
    ref_step = nnx.cached_partial(
        nnx.jit(models._train_step, donate_argnums=(0, 1)), ref_model, ref_optimizer
    )
    expected = _train(ref_embed, ref_model, ref_optimizer, ref_step, 25)

    assert embed.cache.stats.total.evictions > 0
    assert staged == expected
    for got, want in zip(embed.export(), ref_embed.export(), strict=True):
        jax.tree.map(np.testing.assert_array_equal, got, want)
    jax.tree.map(
        np.testing.assert_array_equal,
        nnx.state((model.bottom, model.top, optimizer)),
        nnx.state((ref_model.bottom, ref_model.top, ref_optimizer)),
    )


def test_a_sparse_schedule_scales_the_rows_rate_alone():
    # A factor of 0 for the first three steps, then 1: rows train from step 3.
    tx = jaxcache.models.dense_optimizer("adam", 0.01)
    embed, model = _model()
    start = embed.export()[0]
    dense = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model.top))]
    _, step = jaxcache.models.make_train_step(
        model, tx, sparse_schedule=lambda count: (count >= 3).astype(np.float32)
    )
    _train(embed, model, None, step, 3)
    np.testing.assert_array_equal(embed.export()[0], start)
    moved = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model.top))]
    assert not all(np.array_equal(a, b) for a, b in zip(dense, moved, strict=True))
    _train(embed, model, None, step, 1)
    assert not np.array_equal(embed.export()[0], start)
    with pytest.raises(TypeError, match=r"sparse_schedule must be a function of the step"):
        jaxcache.models.make_train_step(model, tx, sparse_schedule=0.5)


def test_the_predict_step_reads_the_variables_and_leaves_them_alone():
    embed, model = _model()
    predict = jaxcache.models.make_predict_step(model)
    batch = DATA.batch(0)
    lookup = embed.prepare(batch["sparse"], train=False)
    rows, kernel = embed.rows[...], model.top.layers[0].kernel[...]
    scores = predict(batch["dense"], lookup)
    assert scores.shape == (DATA.batch_size,)
    # Not donated, not copied out: the very same arrays stay in the modules.
    assert embed.rows[...] is rows and model.top.layers[0].kernel[...] is kernel
    assert not rows.is_deleted()
    # A later change to a variable is what the next call reads.
    model.top.layers[-1].bias[...] = model.top.layers[-1].bias[...] + 100.0
    assert float(predict(batch["dense"], lookup).min()) > float(scores.min())


def test_a_step_that_changes_the_model_structure_is_refused():
    class Counter(nnx.Module):
        def __init__(self):
            self.count = nnx.Variable(np.zeros((), np.int32))

    def grows(module, x):
        module.extra = nnx.Variable(x)
        return x

    step = jaxcache.nnx.jit_step(grows, Counter())
    with pytest.raises(ValueError, match="grows changed the structure"):
        step(np.float32(1.0))


def test_dlrm_refuses_sizes_that_build_no_model_and_rows_of_another_width():
    embed, _ = _model()
    for kwargs, pattern in (
        ({"num_sparse": 0}, r"DLRM\(num_sparse=0\): num_sparse must be a whole number >= 1"),
        ({"features": 0}, r"DLRM\(features=0\)"),
        ({"bottom": (16, -1)}, r"sizes=\[13, 16, -1, 8\]: every width"),
    ):
        options = {"num_sparse": DATA.num_features, "features": 8, **kwargs}
        with pytest.raises(ValueError, match=pattern):
            jaxcache.models.DLRM(embed, **options, rngs=nnx.Rngs(0))
    wider = jaxcache.models.DLRM(embed, num_sparse=DATA.num_features, features=16, rngs=nnx.Rngs(0))
    batch = next(iter(DATA.batches(1)))
    lookup = embed.prepare(batch["sparse"], train=False)
    with pytest.raises(ValueError, match=r"the rows' width must be the model's features=16"):
        wider(batch["dense"], lookup)
    with pytest.raises(ValueError, match="the batch sizes must agree"):
        jaxcache.models.DLRM(embed, num_sparse=DATA.num_features, features=8, rngs=nnx.Rngs(0))(
            batch["dense"][:5], lookup
        )
