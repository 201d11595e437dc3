"""Trains DLRM with ``jax.pmap`` data parallelism around a sharded device cache.

The same model, data and flags as ``examples/dlrm.py``, on ``--devices``
devices (simulated CPU devices where no accelerator is). The embedding is
model parallel and the dense network data parallel, as in TorchRec: each
step runs three programs on the devices of one mesh axis, ``data``.

1. **Look up** (``jax.jit``): the cache's rows are split row-wise over the
   devices (``EmbeddingCache(..., mesh=mesh, axis="data")``) and each device
   receives the rows of its ``B / n`` samples from their owners
   (``all_to_all`` inside ``jax.shard_map``, the library's routed lookup).
   The result, ``[n, B / n, F, D]``, is already laid out for ``pmap``.
2. **Dense step** (``jax.pmap``): every device holds a replica of the dense
   parameters and their optax state, runs the DLRM on its samples and
   averages the dense gradients with ``lax.pmean``; every replica applies the
   same update. It also returns the gradient of the loss with respect to the
   embeddings it was given.
3. **Row update** (``jax.jit``): the embedding gradients go back through the
   lookup's transpose to the rows' owners, which sum the contributions of all
   devices per row and run the sparse row optimizer once per row
   (``jaxcache.device.apply_sparse``).

The lookup stays out of the pmapped step because the cache belongs to the
mesh, not to a replica: a row lives on one device, each device's samples
need rows from all of them, and a row's gradient must reach the sparse
optimizer once per step, summed over every device that used it. The
library's routed lookup and update do exactly that over the mesh. Inside
``pmap`` it would take either a copy of the cache per replica (each updated
with only its share of the gradients: no longer one table) or that routing
rewritten by hand. Batches go through ``jaxcache.prefetch`` as in
``dlrm.py``. With the same flags it trains the same model as ``dlrm.py`` and
``dlrm_pjit.py``: their losses agree up to the order of floating-point sums
(docs/sharding.md says how far that carries over long runs).

    python examples/dlrm_pmap.py                  # 4 simulated CPU devices
    python examples/dlrm_pmap.py --devices 8 --steps 200
    python examples/dlrm_pmap.py --data criteo --manual-dir ~/criteo

Prints a summary, then as its last line the JSON object of ``dlrm.py``
(``parallelism`` is ``"pmap"``, ``devices`` the device count).
"""

from __future__ import annotations

import functools

import _common  # examples/_common.py: the flags, data and summary of the DLRM examples
import dlrm  # examples/dlrm.py: its cache
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcache

# The one mesh axis: the cache's rows and the batch are split along it, and
# pmap maps the dense step over it.
AXIS = "data"


class LookedUp(nnx.Module):
    """The DLRM's embedding inside the pmapped step: the rows, looked up before it."""

    def __call__(self, rows: jax.Array) -> jax.Array:
        return rows


class DataParallelDLRM:
    """The dense DLRM replicated over the mesh's devices, and its three programs.

    Args:
      model: the DLRM around a ``LookedUp`` embedding.
      tx: the dense optax optimizer.
      embed: holds the cache's device state (the rows split over ``mesh``).
      mesh: the one-axis mesh of the cache.
    """

    def __init__(
        self,
        model: jaxcache.models.DLRM,
        tx: optax.GradientTransformation,
        embed: jaxcache.nnx.CachedEmbed,
        mesh: jax.sharding.Mesh,
    ) -> None:
        self.embed = embed
        self.devices = mesh.devices.size
        graphdef, params = nnx.split(model)
        params = nnx.as_pure(params)
        # One replica per device: a leading axis of n, split over the devices.
        replicas = NamedSharding(mesh, P(AXIS))
        self.params, self.opt_state = jax.device_put(
            jax.tree.map(self._stack, (params, tx.init(params))), replicas
        )
        cache = embed.cache
        n, features = self.devices, cache.config.features

        def logits(params, dense, rows):
            return nnx.merge(graphdef, params)(dense, rows)

        def dense_step(params, opt_state, dense, rows, labels):
            def loss_fn(params, rows):
                return jaxcache.models.bce_loss(logits(params, dense, rows), labels)

            loss, (grads, row_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, rows)
            # The loss is the mean over the whole batch, the mean of the n device means.
            grads = jax.lax.pmean(grads, AXIS)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            return params, opt_state, jax.lax.pmean(loss, AXIS), row_grads / n

        def predict(params, dense, rows):
            return jax.nn.sigmoid(logits(params, dense, rows))

        def embed_rows(rows, lookup):
            return jaxcache.device.embed(rows, lookup, table=cache.name, combiner=embed.combiner)

        @jax.jit
        def look_up(rows, lookup):
            out = embed_rows(rows, lookup)
            return out.reshape(n, -1, *out.shape[1:])

        @functools.partial(jax.jit, donate_argnums=0)
        def update_rows(state, lookup, grads):
            # The lookup is linear in a zero delta added to each received row:
            # its transpose turns embedding gradients into per-row gradients.
            zeros = jnp.zeros((n, lookup.received, features), jnp.float32)
            _, transpose = jax.vjp(lambda d: embed_rows(state.rows, lookup.with_delta(d)), zeros)
            (row_grads,) = transpose(grads.reshape(-1, *grads.shape[2:]))
            return jaxcache.device.apply_sparse(state, lookup, row_grads, cache.config.optimizer)

        self._dense_step = jax.pmap(dense_step, AXIS, donate_argnums=(0, 1))
        self._predict = jax.pmap(predict, AXIS)
        self._look_up = look_up
        self._update_rows = update_rows

    def _stack(self, x: jax.Array) -> np.ndarray:
        return np.broadcast_to(np.asarray(x), (self.devices, *np.shape(x)))

    def _split(self, x: np.ndarray) -> np.ndarray:
        """``[B, ...] -> [n, B / n, ...]``: device ``d`` gets the ``d``-th share."""
        return x.reshape(self.devices, -1, *x.shape[1:])

    def step(self, batch: dict) -> jax.Array:
        """One training step on a batch whose ``"sparse"`` is a ready ``Lookup``."""
        lookup = batch["sparse"]
        rows = self._look_up(self.embed.rows[...], lookup)
        self.params, self.opt_state, loss, row_grads = self._dense_step(
            self.params,
            self.opt_state,
            self._split(batch["dense"]),
            rows,
            self._split(batch["label"]),
        )
        self.embed.set_state(self._update_rows(self.embed.get_state(), lookup, row_grads))
        return loss[0]

    def predict(self, batch: dict) -> jax.Array:
        """Click probabilities ``[n, B / n]`` of a batch of NumPy arrays."""
        lookup = self.embed.prepare(batch["sparse"], train=False)
        rows = self._look_up(self.embed.rows[...], lookup)
        return self._predict(self.params, self._split(batch["dense"]), rows)


def main(argv: list[str] | None = None) -> dict:
    args = _common.parse_args(__doc__, argv, devices=True)
    mesh = Mesh(np.array(_common.devices(args)), (AXIS,))
    started = _common.start()
    data = _common.load_data(args)

    # The cache of dlrm.py, its rows split over the mesh: C / n slots per device.
    cache = dlrm.build_cache(args, data, mesh=mesh, axis=AXIS)
    embed = jaxcache.nnx.CachedEmbed(cache, combiner="sum" if args.multi_hot else None)

    # The dense DLRM takes the rows looked up before the pmapped step.
    model = jaxcache.models.DLRM(
        LookedUp(),
        num_sparse=data.num_features,
        features=args.features,
        bottom=args.bottom,
        top=args.top,
        rngs=nnx.Rngs(args.seed),
    )
    tx = jaxcache.models.dense_optimizer(args.optimizer, args.learning_rate)
    trainer = DataParallelDLRM(model, tx, embed, mesh)

    progress = _common.Progress(args, cache)
    # As in dlrm.py: a host thread stages the next --lookahead batches, for
    # every device, while the devices train on this one.
    with (
        _common.capacity_errors(),
        jaxcache.prefetch(data.train, {"sparse": embed}, lookahead=args.lookahead) as pipeline,
    ):
        for batch in pipeline:
            progress.step(trainer.step(batch))
    trained = progress.finish()

    with _common.capacity_errors():
        probabilities = [trainer.predict(batch) for batch in data.held_out]
    return _common.report(args, started, data, cache, trained, probabilities, parallelism="pmap")


if __name__ == "__main__":
    main()
