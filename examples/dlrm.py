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
(the unpipelined path); ``--host-callback`` passes the raw ids into the jitted
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

import _common  # examples/_common.py: flags, data, loop and summary of the DLRM examples

import jaxcache


def main(argv: list[str] | None = None) -> dict:
    args = _common.parse_args(__doc__, argv, host_callback=True)
    started = _common.start()
    data = _common.load_data(args)
    cache = _common.build_cache(args, data)
    embed = jaxcache.nnx.CachedEmbed(cache, combiner=_common.combiner(args))
    model = _common.build_dlrm(args, data, embed)
    _, train_step = jaxcache.models.make_train_step(
        model, _common.dense_optimizer(args), host_callback=args.host_callback
    )
    predict_step = jaxcache.models.make_predict_step(model)

    def step(batch):
        # batch["sparse"] is a ready Lookup, or the ids with --host-callback.
        return train_step(batch["dense"], batch["sparse"], batch["label"])

    def predict(batch):
        return predict_step(batch["dense"], embed.prepare(batch["sparse"], train=False))

    run = _common.train(args, data, embed, step)
    metrics = _common.evaluate(data, predict)
    return _common.report(args, started, data, cache, run, metrics, parallelism="none")


if __name__ == "__main__":
    main()
