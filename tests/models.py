"""Small models shared by the tests: one through the cache, one full-table reference.

The reference keeps the whole table on device as a differentiable variable,
takes the dense gradient w.r.t. it with plain ``jax.grad`` and applies the
sparse optimizer's row rule to exactly the rows the batch touched. It shares
no planning, slot or swap code with the cache, so agreement is evidence.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxcache
from jaxcache.host import hashed_rows


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
            return jnp.where(real[..., None], emb, 0)
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


def make_cached(
    cache: jaxcache.EmbeddingCache, num_features: int, *, seed=0, combiner=None, schedule=None
):
    """The cached model and its step; ``schedule(step)`` (optional) scales
    the sparse learning rate at each step of the dense optimizer."""
    model, optimizer = _tower(cache, num_features, seed, combiner)

    @nnx.jit
    def step(model, optimizer, lookup, labels, weights):
        def loss_fn(model, lookup):
            return bce(model(lookup, weights), labels)

        scale = None if schedule is None else schedule(optimizer.step[...])
        loss, grads = jaxcache.nnx.value_and_grad(loss_fn, learning_rate_scale=scale)(model, lookup)
        optimizer.update(model, grads)
        return loss

    def train_lookup(lookup, labels, weights=None):
        return step(model, optimizer, lookup, labels, weights)

    def train(ids, labels, weights=None):
        return train_lookup(model.embed.prepare(ids), labels, weights)

    train.with_lookup = train_lookup  # for loops fed by jaxcache.prefetch
    train.optimizer = optimizer  # the dense optimizer, for checkpoints
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
    rows, opt: jaxcache.SparseOptimizer, num_features: int, *, seed=0, combiner=None, schedule=None
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
        sparse = opt if schedule is None else opt.scaled(schedule(optimizer.step[...]))
        optimizer.update(model, grads)
        embed = model.embed
        table = embed.table[...]
        state = embed.opt_state.get_value()

        def take(x):
            return x.at[touched].get(mode="fill", fill_value=0)

        new_rows, new_state = sparse.update(
            take(table), take(table_grad), {k: take(v) for k, v in state.items()}
        )
        # Padding (one past the last row) updates nothing.
        embed.table.set_value(table.at[touched].set(new_rows, mode="drop"))
        embed.opt_state.set_value(
            {k: v.at[touched].set(new_state[k], mode="drop") for k, v in state.items()}
        )
        return loss

    def train(ids, labels, weights=None):
        # The touched rows padded to the batch's size, so that the step
        # compiles once per batch shape, not once per count of distinct ids.
        touched = np.unique(ids[ids >= 0])
        padded = np.full(ids.size, rows.shape[0], np.int64)
        padded[: touched.size] = touched
        return step(model, optimizer, jnp.asarray(ids), jnp.asarray(padded), labels, weights)

    return model, train


def _fmix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _splitmix64(z: int) -> int:
    m = (1 << 64) - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


class VocabularyModel:
    """The rules in plain Python: ``B`` buckets (the least power of two with
    ``B ways >= rows``), row ``r`` in bucket ``r % B``, an id in the bucket
    of the low bits of its hash; a new id takes its bucket's lowest free or
    expired way (an expired id its own), else the way of least ``(key,
    row)`` among ids no plan after ``finished`` and not this batch uses;
    admission by exact counts."""

    def __init__(self, rows, admit_after, forget, *, bonus=8, ways=64, ttl=None, seed=0) -> None:
        self.rows, self.admit_after, self.forget, self.ttl = rows, admit_after, forget, ttl
        self.bonus = bonus
        self.buckets = 1
        while self.buckets * ways < rows:
            self.buckets *= 2
        self.salt = _splitmix64(seed) & 0xFFFFFFFF
        self.entry: dict[int, list[int]] = {}  # row -> [id, last use, lookups]
        self.seen: dict[int, int] = {}
        self.clock = (-1, -1)

    def bucket(self, i: int) -> int:
        u = i & ((1 << 64) - 1)
        low, high = u & 0xFFFFFFFF, u >> 32
        return _fmix32(low ^ _fmix32(high ^ self.salt)) % self.buckets

    def expired(self, row, step, finished) -> bool:
        last = self.entry[row][1]
        return self.ttl is not None and last < step - self.ttl and last <= finished

    def key(self, row, step) -> int:
        """The stalest leaves first: the plan of last use (lru), the lookups
        (lfu), or 256 x the age (at most 2^22 plans) plus ``bonus`` x the
        lookups' log2 in 1/256ths, 8 bits of mantissa rounded down (lrfu)."""
        _, last, lookups = self.entry[row]
        if self.forget == "lru":
            return last
        if self.forget == "lfu":
            return lookups
        lookups = max(lookups, 1)  # lrfu, and adaptive at the bonus it learned
        e = lookups.bit_length() - 1
        log2 = 256 * e + math.floor(256 * math.log2(((lookups << 8) >> e) / 256))
        return 256 * max(last - step, -(1 << 22)) + self.bonus * log2

    @property
    def row_of(self) -> dict[int, int]:
        """Live id -> row at the latest admission."""
        return {e[0]: r for r, e in self.entry.items() if not self.expired(r, *self.clock)}

    def admit(self, ids, counts, step, finished=None, new=True):
        finished = step - 1 if finished is None else min(finished, step - 1)
        found = {e[0]: r for r, e in self.entry.items()}
        rows, back = [], {}
        for i in ids:
            r = found.get(i, -1)
            if r >= 0 and self.expired(r, step, finished):
                back[i], r = r, -1
            rows.append(r)
        unknown = [u for u, r in enumerate(rows) if r < 0]
        seen = {ids[u]: self.seen.get(ids[u], 0) + counts[u] for u in unknown}
        admitted = [u for u in unknown if seen[ids[u]] >= self.admit_after] if new else []
        held = {r for r in rows if r >= 0} | {back[ids[u]] for u in admitted if ids[u] in back}
        chosen: dict[int, int] = {}
        for b in sorted({self.bucket(ids[u]) for u in admitted if ids[u] not in back}):
            mine = [u for u in admitted if ids[u] not in back and self.bucket(ids[u]) == b]
            ways = [r for r in range(b, self.rows, self.buckets) if r not in held]
            free = [r for r in ways if r not in self.entry or self.expired(r, step, finished)]
            stale = sorted(
                (r for r in ways if r not in free and self.entry[r][1] <= finished),
                key=lambda r: (self.key(r, step), r),
            )
            if len(mine) > len(free) + len(stale):
                raise jaxcache.CapacityError("full")
            chosen.update(zip(mine, free + stale, strict=False))
        if new and self.admit_after > 1:
            self.seen.update(seen)
        for u, r in enumerate(rows):
            if r >= 0 and new:  # a batch that trains nothing counts no use
                self.entry[r][1] = step
                self.entry[r][2] += counts[u]
        forgotten = []
        for u in admitted:
            r = back[ids[u]] if ids[u] in back else chosen[u]
            if r in self.entry:
                forgotten.append(self.entry[r][0])
            self.entry[r] = [ids[u], step, counts[u]]
            rows[u] = r
        self.clock = (max(step, self.clock[0]), max(finished, self.clock[1]))
        return rows, [ids[u] for u in admitted], forgotten


class LearnerModel:
    """The bonus of ``forget="adaptive"`` in plain Python: shadow
    ``VocabularyModel``s of ``rows >> bits`` rows (``bits`` the least with
    fewer than 2048) forget by lrfu at each candidate bonus; the ids whose
    32-bit hash has its top ``bits`` bits zero pass through them sorted,
    once their plan is settled; decaying scores of the lookups each found
    pick the bonus."""

    BONUSES = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)

    def __init__(self, rows, ways, admit_after, seed) -> None:
        self.bits = 0
        while rows >> (self.bits + 1) >= 1024:
            self.bits += 1
        self.shadows = [
            VocabularyModel(max(1, rows >> self.bits), admit_after, "lrfu", bonus=b, ways=ways,
                            seed=seed)
            for b in self.BONUSES
        ]  # fmt: skip
        self.salt = _splitmix64(seed) & 0xFFFFFFFF
        self.scores = [0] * len(self.BONUSES)
        self.choice = 4
        self.pending = None

    @property
    def bonus(self) -> int:
        return self.BONUSES[self.choice]

    def offer(self, ids, counts, step) -> None:
        def sampled(i):
            u = i & ((1 << 64) - 1)
            h = _fmix32((u & 0xFFFFFFFF) ^ _fmix32((u >> 32) ^ self.salt))
            return self.bits == 0 or h >> (32 - self.bits) == 0

        kept = sorted((i, c) for i, c in zip(ids, counts, strict=True) if sampled(i))
        self.pending = ([i for i, _ in kept], [c for _, c in kept], step)

    def settle(self) -> None:
        if self.pending is None:
            return
        ids, counts, step = self.pending
        self.pending = None
        for j, shadow in enumerate(self.shadows):
            rows = shadow.row_of
            found = sum(c for i, c in zip(ids, counts, strict=True) if i in rows)
            try:
                shadow.admit(ids, counts, step)
            except jaxcache.CapacityError:
                pass
            self.scores[j] += found - (self.scores[j] >> 5)
        best = self.scores.index(max(self.scores))
        held = self.scores[self.choice]
        if self.scores[best] > held + (held >> 8):
            self.choice = best


def _set_rows(array: jax.Array, rows: np.ndarray, values) -> jax.Array:
    """``array`` with ``rows`` set to ``values``, on a host copy: an eager
    ``.at[].set`` would compile a program for every count of rows."""
    copy = np.array(array)
    copy[rows] = values
    return jax.device_put(copy, array.sharding)


def make_raw_reference(
    rows, config: jaxcache.CacheConfig, num_features: int, *, lookahead=0, combiner=None
):
    """The full-table reference of a cache with raw ids: a ``VocabularyModel``
    gives rows by the same rules (rows held while a batch within
    ``lookahead``, or ``DynamicVocabulary.protect``, of the current one uses
    them), new rows start from
    ``hashed_rows`` with fresh optimizer state, ids without a row read
    padding or, with ``default="shared"``, the last row (zeros at first),
    then ``make_reference`` trains the rows. Returns ``(model, train,
    vocabulary)``."""
    spec = config.vocabulary
    shared = config.num_embeddings - 1 if spec.default == "shared" else None
    vocab = VocabularyModel(
        config.num_embeddings - (shared is not None), spec.admit_after, spec.forget,
        bonus=spec.bonus, ways=spec.ways, ttl=spec.ttl, seed=spec.seed,
    )  # fmt: skip
    learner = None
    if spec.forget == "adaptive":
        learner = LearnerModel(vocab.rows, spec.ways, spec.admit_after, spec.seed)
        vocab.learner = learner
    rows = np.array(rows)
    if shared is not None:
        rows[shared] = 0
    model, ref_train = make_reference(rows, config.optimizer, num_features, combiner=combiner)
    step = [0]

    def train(ids, labels, weights=None):
        t = step[0]
        step[0] += 1
        real = (
            ids != config.padding_id if config.padding_id is not None else np.ones_like(ids, bool)
        )
        # The distinct ids in the order they first appear (row-major).
        unique, first, inverse, counts = np.unique(
            ids[real], return_index=True, return_inverse=True, return_counts=True
        )
        order = np.argsort(first)
        unique, counts, inverse = unique[order], counts[order], np.argsort(order)[inverse]
        if learner is not None:
            learner.settle()
            vocab.bonus = learner.bonus
        held = max(lookahead, spec.protect)  # plans before t whose rows t may not take
        rows_u, new_ids, _ = vocab.admit(unique.tolist(), counts.tolist(), t, t - 1 - held)
        if learner is not None:
            learner.offer(unique.tolist(), counts.tolist(), t)
        rows_u = np.array(rows_u, np.int64)
        if new_ids:
            position = {i: u for u, i in enumerate(unique.tolist())}
            new_rows = rows_u[[position[i] for i in new_ids]]
            first = hashed_rows(
                np.array(new_ids, np.int64), rows.shape[1], seed=spec.seed, init=spec.init,
                scale=spec.scale,
            )  # fmt: skip
            embed = model.embed
            embed.table.set_value(_set_rows(embed.table[...], new_rows, first))
            specs = config.optimizer.state_spec(rows.shape[1])
            embed.opt_state.set_value(
                {
                    k: _set_rows(v, new_rows, specs[k].init)
                    for k, v in embed.opt_state.get_value().items()
                }
            )
        if shared is not None:
            rows_u = np.where(rows_u < 0, shared, rows_u)
        mapped = np.full(ids.shape, -1, np.int64)
        mapped[real] = rows_u[inverse]
        return ref_train(mapped, labels, weights)

    return model, train, vocab


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


def failing_transfer(nth: int):
    """An ``EmbeddingCache.to_device`` that raises on its ``nth`` call, as a
    transfer to a device out of memory does: that batch was planned, and
    its rows never reach the device. Patch it over the class."""
    to_device, calls = jaxcache.EmbeddingCache.to_device, [0]

    def failing(self, host):
        calls[0] += 1
        if calls[0] == nth:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
        return to_device(self, host)

    return failing
