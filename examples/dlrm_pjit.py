"""Trains DLRM through a device cache sharded over many devices, in the pjit style.

The same model, data and flags as ``examples/dlrm.py``, on ``--devices``
devices (simulated CPU devices where no accelerator is). One mesh axis,
``data``, runs over all of them:

- the cache's rows are split along it, row-wise: ``C / n`` slots per device
  (``EmbeddingCache(..., mesh=mesh, axis="data")``);
- each batch is split along it too (``NamedSharding(mesh, P("data"))``), so
  every device trains on ``B / n`` samples;
- the dense parameters and their optimizer state are replicated
  (``NamedSharding(mesh, P())``).

The step is the one-device step, ``jax.jit``-compiled (through ``nnx.jit``)
for those shardings: XLA sums the dense gradients over the devices, and the
cached lookup and the sparse update route ids and row gradients to the
devices owning the rows with ``all_to_all`` inside ``jax.shard_map``. Batches
go through ``jaxcache.prefetch`` as in ``dlrm.py``. With the same flags it
trains the same model as ``dlrm.py`` and ``dlrm_pmap.py``: their losses agree
up to the order of floating-point sums (docs/sharding.md says how far that
carries over long runs).

    python examples/dlrm_pjit.py                  # 4 simulated CPU devices
    python examples/dlrm_pjit.py --devices 8 --steps 200
    python examples/dlrm_pjit.py --data criteo --manual-dir ~/criteo

Prints a summary, then as its last line the JSON object of ``dlrm.py``
(``parallelism`` is ``"pjit"``, ``devices`` the device count).
"""

from __future__ import annotations

import _common  # examples/_common.py: flags, data, loop and summary of the DLRM examples
import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcache


def main(argv: list[str] | None = None) -> dict:
    args = _common.parse_args(__doc__, argv, devices=True)
    mesh = _common.make_mesh(args)
    started = _common.start()
    data = _common.load_data(args)
    cache = _common.build_cache(args, data, mesh=mesh, axis=_common.AXIS)
    embed = jaxcache.nnx.CachedEmbed(cache, combiner=_common.combiner(args))
    model = _common.build_dlrm(args, data, embed)

    replicated = NamedSharding(mesh, P())
    split = NamedSharding(mesh, P(_common.AXIS))
    # Dense parameters on every device; the cache rows are already split by the engine.
    nnx.update(model, jax.device_put(nnx.state(model, nnx.Param), replicated))
    optimizer, train_step = jaxcache.models.make_train_step(model, _common.dense_optimizer(args))
    nnx.update(optimizer, jax.device_put(nnx.state(optimizer), replicated))
    predict_step = jaxcache.models.make_predict_step(model)

    def step(batch):
        dense, labels = jax.device_put((batch["dense"], batch["label"]), split)
        return train_step(dense, batch["sparse"], labels)

    def predict(batch):
        lookup = embed.prepare(batch["sparse"], train=False)
        return predict_step(jax.device_put(batch["dense"], split), lookup)

    run = _common.train(args, data, embed, step)
    metrics = _common.evaluate(data, predict)
    return _common.report(args, started, data, cache, run, metrics, parallelism="pjit")


if __name__ == "__main__":
    main()
