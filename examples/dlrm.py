"""Trains DLRM on Criteo-like clicks through a device cache of hot rows.

The clicks come from an embedded synthetic Criteo-like stream (the default)
or, with ``--data criteo --manual-dir DIR``, from the Criteo files in ``DIR``
(the Kaggle ``train.txt`` or the Terabyte ``day_N`` files, built once into a
TFDS dataset under ``--data-dir``): trained on the first 90% of ``train.txt``
(or every day but the last), evaluated on the rest.

All 26 sparse features share one embedding table kept in host memory; only
``--cache-fraction`` of its rows (2% by default) live on the device. The cache
is exact: ``--full-table`` trains the same model with the whole table on
device and, with the same seed, ends with the same loss.

Batches go through ``jaxcache.prefetch``: a host thread plans, gathers and
transfers the next ``--lookahead`` batches while the device trains on the
current one. ``--lookahead 0`` does that work in the training loop instead
(the unpipelined path); ``--host-callback`` passes the ids into the jitted
step, which looks them up with ``CachedEmbed.lookup_ids`` (``--callback-rows
N`` pads its per-step lists to ``N`` rows instead of the batch's number of
ids; a batch with more distinct ids stops the run). All three compute the
same thing: with the same seed they end with the same loss, bit for bit.

    python examples/dlrm.py                      # ~1 minute on 2 CPU cores
    python examples/dlrm.py --full-table         # the baseline
    python examples/dlrm.py --lookahead 0        # unpipelined
    python examples/dlrm.py --host-callback      # ids looked up inside the step
    python examples/dlrm.py --policy lru --steps 200
    python examples/dlrm.py --data criteo --manual-dir ~/criteo --data-dir ~/tfds

``examples/dlrm_pjit.py`` and ``examples/dlrm_pmap.py`` train the same model
with the same flags on many devices.

Prints a summary, then as its last line one JSON object with the results
(``loss``, ``auc``, ``hit_rate``, ``rows_fetched``, ``steps_per_s``,
``lookahead``, ``host_callback``, ``phase_mean_ms``, ...).
"""

from __future__ import annotations

import argparse
import sys

import _common  # examples/_common.py: the flags, data and summary of the DLRM examples
from flax import nnx

import jaxcache


def build_cache(
    args: argparse.Namespace, data: _common.Data, **placement
) -> jaxcache.EmbeddingCache:
    """The example's cache: one table for all sparse features, in host memory
    with its optimizer state; ``--cache-fraction`` of its rows on the device,
    updated there by the sparse row optimizer and written back when evicted.
    ``placement``: ``mesh`` and ``axis`` to split its rows over devices
    (``dlrm_pjit.py``, ``dlrm_pmap.py``)."""
    row_optimizer = (
        jaxcache.rowwise_adagrad(args.row_learning_rate)
        if args.optimizer == "adagrad"
        else jaxcache.adam(args.row_learning_rate)
    )
    config = jaxcache.CacheConfig(
        num_embeddings=data.num_embeddings,
        features=args.features,
        capacity=args.cache_fraction,
        policy=args.policy,
        optimizer=row_optimizer,
        padding_id=data.padding_id,
        callback_rows=args.callback_rows,
    )
    table = jaxcache.HostTable(config, seed=args.seed)
    if args.host_callback:
        # The host-callback form plans on the host, inside the step; the
        # default on accelerators is the device planner.
        placement["planner"] = "host"
    if args.full_table:  # the baseline: every row on the device
        try:
            return jaxcache.EmbeddingCache.full_table(config, table=table, **placement)
        except ValueError as error:  # the rows do not split over the devices
            sys.exit(f"error: {error} (--devices sets the devices, --scale the rows.)")
    # The policy starts from the ids' counts in training data (--profile-batches).
    return jaxcache.EmbeddingCache(config, table=table, frequencies=data.frequencies, **placement)


def main(argv: list[str] | None = None) -> dict:
    args = _common.parse_args(__doc__, argv, host_callback=True)
    started = _common.start()
    data = _common.load_data(args)

    cache = build_cache(args, data)

    # The model holds the cache's device rows in its embedding module.
    embed = jaxcache.nnx.CachedEmbed(cache, combiner="sum" if args.multi_hot else None)
    model = jaxcache.models.DLRM(
        embed,
        num_sparse=data.num_features,
        features=args.features,
        bottom=args.bottom,
        top=args.top,
        rngs=nnx.Rngs(args.seed),
    )
    _, train_step = jaxcache.models.make_train_step(
        model,
        jaxcache.models.dense_optimizer(args.optimizer, args.learning_rate),
        host_callback=args.host_callback,
    )
    predict_step = jaxcache.models.make_predict_step(model)

    progress = _common.Progress(args, cache)
    try:
        # A host thread stages the next --lookahead batches (plans them, writes
        # back evicted rows, gathers the missing ones) while the device trains
        # on this one; the loop transfers each. Leaving the block stops it.
        with (
            _common.capacity_errors(),
            jaxcache.prefetch(
                data.train, {"sparse": embed}, lookahead=args.lookahead, callback=args.host_callback
            ) as pipeline,
        ):
            for batch in pipeline:
                # batch["sparse"] is a Lookup whose rows are on the device, or
                # with --host-callback the ids, looked up inside the step.
                loss = train_step(batch["dense"], batch["sparse"], batch["label"])
                progress.step(loss)
    except ValueError as error:
        if args.callback_rows is None or "callback_rows" not in str(error):
            raise
        sys.exit(f"error: {error} (--callback-rows sets it.)")
    trained = progress.finish()

    # Held-out batches look their rows up for reading only (train=False).
    with _common.capacity_errors():
        probabilities = [
            predict_step(batch["dense"], embed.prepare(batch["sparse"], train=False))
            for batch in data.held_out
        ]
    return _common.report(args, started, data, cache, trained, probabilities, parallelism="none")


if __name__ == "__main__":
    main()
