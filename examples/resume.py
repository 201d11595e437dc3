"""Trains a small DLRM with checkpoints; run it again and it continues where it stopped.

Every ``--every`` steps the loop saves a checkpoint with ``jaxcache.Checkpointer``:
the host table and each row's optimizer state, the cache's resident rows and
policy counts, the dense parameters and their optax state, and the number of
batches consumed. On start the script restores the latest checkpoint in
``--checkpoint-dir``, if there is one, and reads the data from the next batch
on (the synthetic stream produces any batch from its index)::

    python examples/resume.py --checkpoint-dir /tmp/run --steps 60 --kill-at 20
    # killed with SIGKILL right after the checkpoint of step 20 is committed
    python examples/resume.py --checkpoint-dir /tmp/run --steps 60
    # restores step 20 and trains steps 20 to 59

The resumed run ends with the same losses, table, optimizer state and dense
parameters as one uninterrupted run, bit for bit. Between checkpoints the
batches flow through ``jaxcache.prefetch``: each segment of ``--every``
batches is one pipeline that runs to the end of its batches, so no batch is
planned ahead of the training loop when a checkpoint is taken.

``--dump FILE`` writes the final state to an ``.npz`` file, to compare runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile

import jax
import numpy as np
from _flags import check_ranges, refuse_other_options  # examples/_flags.py
from flax import nnx

import jaxcache


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-dir", help="where checkpoints go (default: a new temp dir)")
    parser.add_argument("--steps", type=int, default=60, help="total training steps")
    parser.add_argument("--every", type=int, default=20, help="steps between checkpoints")
    parser.add_argument(
        "--kill-at", type=int, help="kill this process (SIGKILL) right after this checkpoint"
    )
    parser.add_argument("--policy", choices=jaxcache.planning.POLICIES, default="lfu")
    parser.add_argument("--optimizer", choices=("adagrad", "adam"), default="adagrad")
    parser.add_argument("--lookahead", type=int, default=2, help="batches staged ahead")
    parser.add_argument("--scale", type=float, default=0.0005, help="fraction of Criteo's rows")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--cache-fraction", type=float, default=0.06)
    parser.add_argument("--features", type=int, default=8, help="embedding width D")
    parser.add_argument("--max-to-keep", type=int, default=3, help="checkpoints kept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dump", help="write the final state to this .npz file")
    args = parser.parse_args(argv)
    check_ranges(
        parser,
        args,
        counts=("steps", "every", "batch_size", "features", "max_to_keep"),
        fractions=("scale", "cache_fraction"),
    )
    if args.kill_at is not None and not 1 <= args.kill_at <= args.steps:
        parser.error(
            f"--kill-at={args.kill_at} must be a checkpoint step from 1 to --steps="
            f"{args.steps}, e.g. {min(args.every, args.steps)}."
        )
    return args


def build(args: argparse.Namespace):
    """The data stream, the cached embedding, the DLRM and its training step."""
    data = jaxcache.synthetic.SyntheticCriteo(
        scale=args.scale, batch_size=args.batch_size, seed=args.seed
    )
    row_optimizer = (
        jaxcache.rowwise_adagrad(0.05) if args.optimizer == "adagrad" else jaxcache.adam(0.01)
    )
    config = jaxcache.CacheConfig(
        num_embeddings=data.num_embeddings,
        features=args.features,
        capacity=args.cache_fraction,
        policy=args.policy,
        optimizer=row_optimizer,
    )
    frequencies = data.count_frequencies(8) if args.policy == "frequency" else None
    cache = jaxcache.EmbeddingCache(config, frequencies=frequencies, seed=args.seed)
    embed = jaxcache.nnx.CachedEmbed(cache)
    model = build_model(embed, data, args.features, args.seed)
    tx = jaxcache.models.dense_optimizer(
        args.optimizer, 0.05 if args.optimizer == "adagrad" else 1e-3
    )
    optimizer, train_step = jaxcache.models.make_train_step(model, tx)
    return data, embed, model, optimizer, train_step


def build_model(
    embed: nnx.Module, data: jaxcache.synthetic.SyntheticCriteo, features: int, seed: int
):
    """A small DLRM around ``embed`` (the serving example builds the same one)."""
    return jaxcache.models.DLRM(
        embed,
        num_sparse=data.num_features,
        features=features,
        bottom=(32,),
        top=(32,),
        rngs=nnx.Rngs(seed),
    )


def train(args: argparse.Namespace) -> dict:
    directory = args.checkpoint_dir or tempfile.mkdtemp(prefix="jaxcache-resume-")
    if args.checkpoint_dir is None:
        # Now, not only in the summary: --kill-at ends the process before it.
        print(f"checkpoints go to {directory}; resume with --checkpoint-dir {directory}")
    checkpointer = jaxcache.Checkpointer(directory, max_to_keep=args.max_to_keep)
    latest = checkpointer.latest_step()
    saved = None if latest is None else checkpointer.info(latest)
    start = 0 if saved is None else saved.batches_consumed
    # Every refusal comes before the model is built and the checkpoint read.
    if saved is not None:
        # The stream and the model must be the saved run's: another seed or
        # batch size would train on other batches in silence.
        data = jaxcache.synthetic.SyntheticCriteo(
            scale=args.scale, batch_size=args.batch_size, seed=args.seed
        )
        refuse_other_options(
            "resume.py",
            "--checkpoint-dir",
            directory,
            saved.extra["model"],
            model_options(args, data),
        )
        if args.steps < start:
            raise SystemExit(
                f"resume.py: --steps {args.steps} is below the {start} steps the latest "
                f"checkpoint in {directory} has trained; pass --steps {start} or more to "
                "continue it, or give another --checkpoint-dir."
            )
    # Segments of --every batches, each ending in a checkpoint.
    segments = [
        (first, min(first + args.every, args.steps))
        for first in range(start, args.steps, args.every)
    ]
    saves = [step for _, step in segments]
    if args.kill_at is not None and args.kill_at not in saves:
        raise SystemExit(
            f"resume.py: --kill-at {args.kill_at} is not a step this run saves a checkpoint "
            f"at ({saves}); pick one of them."
        )
    data, embed, model, optimizer, train_step = build(args)
    losses: list[float] = []
    resumed_from = None
    if saved is not None:
        info = checkpointer.restore(model=model, optimizer=optimizer)
        start, losses, resumed_from = info.batches_consumed, info.extra["losses"], info.step
        print(f"restored step {info.step}: continuing from batch {start}")
    for first, step in segments:
        count = step - first
        batches = data.batches(count, start=first)
        with jaxcache.prefetch(batches, {"sparse": embed}, lookahead=args.lookahead) as pipeline:
            step_losses = [
                train_step(batch["dense"], batch["sparse"], batch["label"]) for batch in pipeline
            ]
        losses += [float(loss) for loss in step_losses]
        checkpointer.save(
            step,
            model=model,
            optimizer=optimizer,
            batches_consumed=step,
            extra={"losses": losses, "model": model_options(args, data)},
        )
        print(f"step {step}: loss {np.mean(losses[-count:]):.4f}, checkpoint saved")
        if args.kill_at == step:
            sys.stdout.flush()  # SIGKILL drops what is still buffered
            os.kill(os.getpid(), signal.SIGKILL)
    if args.dump:
        dump(args.dump, embed, model, optimizer, losses)
    return {
        "resumed_from": resumed_from,
        "steps": len(losses),
        "last_loss": losses[-1] if losses else None,
        "hit_rate": embed.cache.stats.total.hit_rate,
        "checkpoints": checkpointer.steps(),
        "checkpoint_dir": directory,
    }


def model_options(args: argparse.Namespace, data: jaxcache.synthetic.SyntheticCriteo) -> dict:
    """What it takes to build the same model again (saved with each checkpoint)."""
    return {
        "scale": args.scale,
        "batch_size": args.batch_size,
        "features": args.features,
        "seed": args.seed,
        "optimizer": args.optimizer,
        "num_embeddings": data.num_embeddings,
    }


def dump(path: str, embed, model, optimizer, losses: list[float]) -> None:
    """The final table, optimizer state, dense state, losses and cache state, as ``.npz``."""
    rows, state = embed.export()
    planner = embed.cache.planner
    arrays = {
        "rows": rows,
        **{f"state.{name}": value for name, value in state.items()},
        "losses": np.array(losses),
        "id_of_slot": planner.id_of_slot,
        "last_use": planner.last_use,
        "stats": np.array(list(vars(embed.cache.stats.total).values())),
    }
    counts = planner.policy_state().get("counts")
    if counts is not None:
        arrays["counts"] = counts
    for prefix, node in (("model", model), ("optimizer", optimizer)):
        leaves = jax.tree.leaves(
            nnx.state(node, nnx.Not(nnx.Any(jaxcache.nnx.CacheRows, jaxcache.nnx.CacheOptState)))
        )
        arrays.update({f"{prefix}.{i}": np.asarray(leaf) for i, leaf in enumerate(leaves)})
    np.savez(path, **arrays)


def main(argv: list[str] | None = None) -> dict:
    result = train(parse_args(argv))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
