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

import _common  # examples/_common.py: the flags, data and summary of the DLRM examples
import dlrm  # examples/dlrm.py: its cache
import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcache

# The one mesh axis: the batch is split along it (data parallel), and so are
# the cache's rows.
AXIS = "data"


def main(argv: list[str] | None = None) -> dict:
    args = _common.parse_args(__doc__, argv, devices=True)
    mesh = Mesh(np.array(_common.devices(args)), (AXIS,))
    started = _common.start()
    data = _common.load_data(args)

    # The cache of dlrm.py, its rows split over the mesh: C / n slots per device.
    cache = dlrm.build_cache(args, data, mesh=mesh, axis=AXIS)

    embed = jaxcache.nnx.CachedEmbed(cache, combiner="sum" if args.multi_hot else None)
    model = jaxcache.models.DLRM(
        embed,
        num_sparse=data.num_features,
        features=args.features,
        bottom=args.bottom,
        top=args.top,
        rngs=nnx.Rngs(args.seed),
    )
    replicated = NamedSharding(mesh, P())
    split = NamedSharding(mesh, P(AXIS))
    # Dense parameters and their optimizer state on every device; the cache's
    # rows are already split by the cache.
    nnx.update(model, jax.device_put(nnx.state(model, nnx.Param), replicated))
    optimizer, train_step = jaxcache.models.make_train_step(
        model, jaxcache.models.dense_optimizer(args.optimizer, args.learning_rate)
    )
    nnx.update(optimizer, jax.device_put(nnx.state(optimizer), replicated))
    predict_step = jaxcache.models.make_predict_step(model)

    progress = _common.Progress(args, cache)
    # As in dlrm.py: a host thread stages the next --lookahead batches, for
    # every device, while the devices train on this one.
    with (
        _common.capacity_errors(),
        jaxcache.prefetch(data.train, {"sparse": embed}, lookahead=args.lookahead) as pipeline,
    ):
        for batch in pipeline:
            # Each device gets B / n samples. The step is compiled for these
            # shardings; the lookup routes each id to the device of its row.
            dense, labels = jax.device_put((batch["dense"], batch["label"]), split)
            progress.step(train_step(dense, batch["sparse"], labels))
    trained = progress.finish()

    with _common.capacity_errors():
        probabilities = [
            predict_step(
                jax.device_put(batch["dense"], split), embed.prepare(batch["sparse"], train=False)
            )
            for batch in data.held_out
        ]
    return _common.report(args, started, data, cache, trained, probabilities, parallelism="pjit")


if __name__ == "__main__":
    main()
