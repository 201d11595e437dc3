"""Serves a trained DLRM from a checkpoint: read-only tables, hot rows on device.

    python examples/serve.py --checkpoint DIR   # a directory written by examples/resume.py
    python examples/serve.py                    # trains a tiny model first, in a temp dir

The checkpoint's table goes into a serving cache (``jaxcache.serving_config``):
the host keeps the rows only, no optimizer state, and the device keeps
``--capacity`` of them, preloaded with the hottest by the access counts the
training cache kept. Batches of held-out requests are scored through
``jaxcache.prefetch`` with ``train=False`` by the same Flax module the model
was trained with, in eval mode; one cache serves every request and nothing is
ever written back. Prints latency percentiles and the hit rate, and ends with
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np
import resume  # examples/resume.py: the model, and the training run if no checkpoint is given
from _flags import check_ranges  # examples/_flags.py

import jaxcache


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="checkpoint directory (default: train one first)")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    parser.add_argument("--capacity", type=float, default=0.1, help="rows on device (fraction)")
    parser.add_argument("--batches", type=int, default=200, help="request batches to score")
    parser.add_argument("--batch-size", type=int, default=128, help="requests per batch")
    parser.add_argument("--warmup", type=int, default=5, help="batches before measuring")
    parser.add_argument("--lookahead", type=int, default=2, help="batches staged ahead")
    args = parser.parse_args(argv)
    check_ranges(parser, args, counts=("batches", "batch_size"), fractions=("capacity",))
    if args.warmup < 0:
        parser.error(f"--warmup={args.warmup} must be 0 or more.")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    directory = args.checkpoint
    if directory is None:
        directory = tempfile.mkdtemp(prefix="jaxcache-serve-")
        print(f"no --checkpoint given: training a tiny model first, in {directory}")
        resume.main(["--checkpoint-dir", directory, "--steps", "20", "--every", "20"])
    try:
        checkpointer = jaxcache.Checkpointer(directory, read_only=True)
        info = checkpointer.info(args.step)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"serve.py: --checkpoint/--step: {error}") from None
    options = info.extra["model"]
    data = jaxcache.synthetic.SyntheticCriteo(
        scale=options["scale"], batch_size=args.batch_size, seed=options["seed"]
    )
    config = jaxcache.serving_config(
        checkpointer.cache_config(step=info.step), capacity=args.capacity
    )
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(config))
    model = resume.build_model(embed, data, options["features"], options["seed"])
    checkpointer.restore(info.step, model=model)
    predict = jaxcache.models.make_predict_step(model)
    server = jaxcache.Server(
        model,
        lambda batch: predict(batch["dense"], batch["sparse"]),
        {"sparse": embed},
        lookahead=args.lookahead,
    )
    try:
        for _ in server.score(data.batches(args.warmup, start=0, held_out=True)):
            pass  # compiles the step and its padded shapes
        server.reset()  # the figures below leave the warm-up out
        labels, scores = [], []
        start = time.perf_counter()
        requests = data.batches(args.batches, start=args.warmup, held_out=True)
        for batch, batch_scores in zip(
            data.batches(args.batches, start=args.warmup, held_out=True),
            server.score(requests),
            strict=True,
        ):
            labels.append(batch["label"])
            scores.append(batch_scores)
    except jaxcache.CapacityError as error:
        raise SystemExit(f"serve.py: {error} (--capacity sets the rows on device.)") from None
    seconds = time.perf_counter() - start
    summary = server.summary()
    result = {
        "checkpoint": directory,
        "step": info.step,
        **summary,
        "batch_size": args.batch_size,
        "requests_per_s": args.batches * args.batch_size / seconds,
        "auc": jaxcache.synthetic.roc_auc(np.concatenate(labels), np.concatenate(scores)),
        "device_rows": config.capacity,
        "table_rows": config.num_embeddings,
        "device_bytes_per_row": config.row_bytes,
        "optimizer_state_on_device": sorted(embed.get_state().opt),
    }
    print(
        f"served {summary['batches']} batches of {args.batch_size} requests from step "
        f"{info.step}: {config.capacity:,} of {config.num_embeddings:,} rows on device "
        f"({config.row_bytes} bytes each, no optimizer state)"
    )
    print(
        f"  latency per batch: p50 {summary['p50_ms']:.2f} ms, p90 {summary['p90_ms']:.2f} ms, "
        f"p99 {summary['p99_ms']:.2f} ms; {result['requests_per_s']:,.0f} requests/s"
    )
    print(
        f"  hit rate {summary['hit_rate']:.3f}; {summary['bytes_to_host']} bytes written back; "
        f"AUC {result['auc']:.4f}"
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
