"""Small models shared by the tests: one through the cache, one full-table reference.

The reference keeps the whole table on device as a differentiable variable,
takes the dense gradient w.r.t. it with plain ``jax.grad`` and applies the
sparse optimizer's row rule to exactly the rows the batch touched. It shares
no planning, slot or swap code with the cache, so agreement is evidence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxcache


class FullTable(nnx.Variable):
    """The whole table ``[N, D]``, differentiated densely by the reference."""


class ReferenceEmbed(nnx.Module):
    """Full table on device; ``__call__`` takes raw ids."""

    def __init__(self, rows: np.ndarray, optimizer: jaxcache.SparseOptimizer, combiner=None):
        self.table = FullTable(jnp.asarray(rows))
        self.optimizer = optimizer
        self.combiner = combiner
        self.opt_state = jaxcache.nnx.CacheOptState(
            {
                name: jnp.full((rows.shape[0], *spec.shape), spec.init, spec.dtype)
                for name, spec in optimizer.state_spec(rows.shape[1]).items()
            }
        )

    def __call__(self, ids, weights=None):
        real = ids >= 0  # negative ids are bag padding
        emb = self.table[...][jnp.where(real, ids, 0)]
        if self.combiner is None:
            return emb
        w = real.astype(emb.dtype) if weights is None else real * weights
        total = jnp.einsum("...l,...ld->...d", w, emb)
        if self.combiner == "sum":
            return total
        count = w.sum(-1, keepdims=True)
        return total / jnp.where(count == 0, 1, count)


class Tower(nnx.Module):
    """Embeddings of ``F`` features ``[B, F, D]`` -> flatten -> MLP -> logit."""

    def __init__(self, embed, num_features: int, features: int, *, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.embed = embed
        self.hidden = nnx.Linear(num_features * features, 16, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, ids_or_lookup, weights=None):
        emb = self.embed(ids_or_lookup, weights)
        x = emb.reshape(emb.shape[0], -1)
        return self.out(nnx.relu(self.hidden(x)))[:, 0]


def bce(logits, labels):
    return optax.sigmoid_binary_cross_entropy(logits, labels).mean()


def _tower(cache: jaxcache.EmbeddingCache, num_features: int, seed: int, combiner=None):
    """A ``Tower`` over a ``CachedEmbed`` of ``cache`` and its dense optimizer."""
    embed = jaxcache.nnx.CachedEmbed(cache, combiner=combiner)
    model = Tower(embed, num_features, cache.config.features, seed=seed)
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def make_cached(cache: jaxcache.EmbeddingCache, num_features: int, *, seed=0, combiner=None):
    model, optimizer = _tower(cache, num_features, seed, combiner)

    @nnx.jit
    def step(model, optimizer, lookup, labels, weights):
        def loss_fn(model, lookup):
            return bce(model(lookup, weights), labels)

        loss, grads = jaxcache.nnx.value_and_grad(loss_fn)(model, lookup)
        optimizer.update(model, grads)
        return loss

    def train_lookup(lookup, labels, weights=None):
        return step(model, optimizer, lookup, labels, weights)

    def train(ids, labels, weights=None):
        return train_lookup(model.embed.prepare(ids), labels, weights)

    train.with_lookup = train_lookup  # for loops fed by jaxcache.prefetch
    return model, train


def make_callback(cache: jaxcache.EmbeddingCache, num_features: int, *, seed=0):
    """The model of ``make_cached`` with a step that takes raw ids and looks
    them up inside with ``CachedEmbed.lookup_ids`` (the host-callback form)."""
    model, optimizer = _tower(cache, num_features, seed)

    @nnx.jit
    def step(model, optimizer, ids, labels):
        lookup = model.embed.lookup_ids(ids)  # slots obtained inside the step

        def loss_fn(model, lookup):
            return bce(model(lookup), labels)

        loss, grads = jaxcache.nnx.value_and_grad(loss_fn)(model, lookup)
        optimizer.update(model, grads)
        return loss

    return model, optimizer, step


def make_reference(
    rows, opt: jaxcache.SparseOptimizer, num_features: int, *, seed=0, combiner=None
):
    model = Tower(ReferenceEmbed(rows, opt, combiner), num_features, rows.shape[1], seed=seed)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, ids, touched, labels, weights):
        def loss_fn(model):
            return bce(model(ids, weights), labels)

        diff = nnx.DiffState(0, nnx.Any(nnx.Param, FullTable))
        loss, grads = nnx.value_and_grad(loss_fn, argnums=diff)(model)
        table_grad = grads["embed"]["table"][...]
        grads = nnx.state(grads, nnx.Param)
        optimizer.update(model, grads)
        embed = model.embed
        table = embed.table[...]
        state = embed.opt_state.get_value()
        new_rows, new_state = embed.optimizer.update(
            table[touched], table_grad[touched], {k: v[touched] for k, v in state.items()}
        )
        embed.table.set_value(table.at[touched].set(new_rows))
        embed.opt_state.set_value({k: v.at[touched].set(new_state[k]) for k, v in state.items()})
        return loss

    def train(ids, labels, weights=None):
        touched = np.unique(ids[ids >= 0])
        return step(model, optimizer, jnp.asarray(ids), jnp.asarray(touched), labels, weights)

    return model, train


def zipf_batches(num_embeddings, batch, num_features, steps, *, alpha=1.1, seed=0):
    """Skewed id batches ``[batch, num_features]`` with scattered hot ids, and labels."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(num_embeddings)
    p = 1.0 / np.arange(1, num_embeddings + 1) ** alpha
    p /= p.sum()
    for _ in range(steps):
        ids = perm[rng.choice(num_embeddings, size=(batch, num_features), p=p)]
        yield ids.astype(np.int64), (rng.random(batch) < 0.5).astype(np.float32)


def dense_params(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def host_planners(cache: jaxcache.EmbeddingCache) -> list[jaxcache.planning.Planner]:
    """The host ``Planner`` of each partition of ``cache``: the host planner's
    own, or copies of the device planner's state (``DevicePlanner.host_mirror``)."""
    planner = cache.planner
    if cache.planner_kind == "device":
        return planner.host_mirror().planners
    return planner.planners
