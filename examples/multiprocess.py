"""DLRM through a cache sharded over the devices of several processes.

Every process runs this same program under ``jax.distributed.initialize``; the
cache's rows are split over all global devices, lookups and gradients travel
between processes by ``all_to_all`` inside ``shard_map`` (gloo collectives on
CPU, NCCL on GPU). Every id has a home device; each process reads the global
batch once to pick out the ids homed on its devices, plans only those (its
devices' partitions: their directories and policies live nowhere else),
stores only their host rows (``jaxcache.host.process_shard``), and fetches and
writes back only its devices' rows. Planned on the host, the processes
exchange a few integers per step (the batch's fingerprint, whether it fits,
the padded sizes of the step's arrays) and nothing else.

Run it on one machine (it starts the processes itself)::

    python examples/multiprocess.py --num-processes 2 --devices-per-process 2

or start each process yourself, on one or several hosts::

    python examples/multiprocess.py --process-id 0 --num-processes 2 \\
        --coordinator 10.0.0.1:12355

With ``--checkpoint DIR`` every process resumes from the latest checkpoint
there (each reading the host rows it stores, whatever number of processes
saved them) and saves one at the end; run it again to continue training::

    python examples/multiprocess.py --steps 10 --checkpoint /tmp/dlrm-ckpt
    python examples/multiprocess.py --steps 10 --checkpoint /tmp/dlrm-ckpt

With ``--raw-ids ROWS`` the ids become raw int64 values (a bijective mix of
the synthetic ids) and the table a dynamic vocabulary of ``ROWS`` rows
(``jaxcache.DynamicVocabulary``): the host planner keeps the whole
vocabulary in every process, the device planner each device its buckets.

Started here, the launcher then trains the same steps in one process of as
many devices and checks that the processes' losses and the whole trained
table equal that run's (within 1e-5: reductions across processes may sum
in another order); ``--skip-reference`` leaves that run out, and so does
``--checkpoint``, whose processes resume where the last run stopped.

The last line of stdout is one JSON object (from process 0, or from the
launcher: the processes' results, the one-process run's, and whether they
agree).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

from _flags import check_ranges, refuse_other_options  # examples/_flags.py


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--process-id", type=int, default=None, help="omit to launch locally")
    parser.add_argument("--coordinator", default=None, help="host:port of process 0")
    parser.add_argument("--devices-per-process", type=int, default=2, help="CPU devices")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lookahead", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-fraction", type=float, default=0.1)
    parser.add_argument("--scale", type=float, default=0.002, help="of the Criteo cardinalities")
    parser.add_argument(
        "--save", default=None, help="process 0 saves the trained table here (.npy)"
    )
    parser.add_argument(
        "--checkpoint", default=None, help="directory: resume from its latest step, save at the end"
    )
    parser.add_argument(
        "--skip-reference",
        action="store_true",
        help="launcher only: do not train in one process to compare with",
    )
    parser.add_argument(
        "--raw-ids", type=int, default=None, help="raw ids through a vocabulary of this many rows"
    )
    # Their defaults are filled in below, so that giving one without --raw-ids shows.
    parser.add_argument(
        "--admit-after",
        type=int,
        default=None,
        help="with --raw-ids: lookups before an id gets a row (default: 1)",
    )
    parser.add_argument(
        "--forget",
        choices=("lru", "lfu", "lrfu", "adaptive"),
        default=None,
        help="with --raw-ids: which id a full bucket forgets (default: lfu)",
    )
    parser.add_argument(
        "--default",
        choices=("zeros", "shared"),
        default=None,
        help="with --raw-ids: what an id without a row reads (default: zeros)",
    )
    args = parser.parse_args(argv)
    check_ranges(
        parser,
        args,
        counts=("num_processes", "devices_per_process", "steps", "batch_size"),
        fractions=("scale", "cache_fraction"),
    )
    if args.process_id is not None and not 0 <= args.process_id < args.num_processes:
        parser.error(f"--process-id={args.process_id} must be in [0, --num-processes).")
    if args.process_id is None and args.coordinator is not None:
        parser.error(
            "--coordinator is for processes started by hand; add --process-id, or drop "
            "--coordinator to start the processes here."
        )
    if args.process_id is not None and args.num_processes > 1 and args.coordinator is None:
        parser.error(
            f"--process-id with --num-processes={args.num_processes} needs --coordinator "
            "HOST:PORT, the address of process 0 (the same in every process)."
        )
    if args.raw_ids is not None and args.raw_ids < 1:
        parser.error(f"--raw-ids={args.raw_ids} must be a row budget of at least 1.")
    raw_only = {"admit_after": 1, "forget": "lfu", "default": "zeros"}
    given = [f"--{k.replace('_', '-')}" for k in raw_only if getattr(args, k) is not None]
    if given and args.raw_ids is None:
        parser.error(
            f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} only for raw ids; add "
            f"--raw-ids ROWS, or drop {'it' if len(given) == 1 else 'them'}."
        )
    for name, value in raw_only.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    check_ranges(parser, args, counts=("admit_after",))
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Starts ``--num-processes`` copies of this program on localhost, then
    (unless told not to) one process of as many devices, and compares them.
    Each gets ``argv``, the launcher's own arguments, and its role."""
    import numpy as np

    coordinator = f"127.0.0.1:{_free_port()}"
    with tempfile.TemporaryDirectory() as work:
        tables = os.path.join(work, "processes.npy"), os.path.join(work, "one.npy")
        saved = ["--save", args.save or tables[0]]
        results = _collect(
            [
                [*argv, *saved, "--process-id", str(i), "--coordinator", coordinator]
                for i in range(args.num_processes)
            ]
        )
        agree = all(r["losses"] == results[0]["losses"] for r in results)
        one = None
        if not (args.skip_reference or args.checkpoint):
            devices = str(args.num_processes * args.devices_per_process)
            single = ["--num-processes", "1", "--process-id", "0", "--devices-per-process", devices]
            (one,) = _collect([[*argv, "--save", tables[1], *single]])
            agree = (
                agree
                and len(one["losses"]) == len(results[0]["losses"])
                and np.allclose(one["losses"], results[0]["losses"], rtol=0, atol=1e-5)
                and np.allclose(np.load(saved[1]), np.load(tables[1]), rtol=0, atol=1e-5)
                and one["live_ids"] == results[0]["live_ids"]
            )
    print(json.dumps({"processes": results, "one_process": one, "agree": bool(agree)}))
    return 0 if agree else 1


def _collect(commands: list[list[str]]) -> list[dict]:
    """Runs this program once per argument list, all at once, and returns
    each one's last line of stdout as JSON."""
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for command in commands
    ]
    results = []
    for i, proc in enumerate(procs):
        out, err = proc.communicate(timeout=600)
        if proc.returncode:
            sys.stderr.write(err)
            raise SystemExit(f"process {i} failed with exit code {proc.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def run(args: argparse.Namespace) -> dict:
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices_per_process)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.num_processes > 1:
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
        )
    import numpy as np
    from jax.sharding import Mesh

    import jaxcache

    mesh = Mesh(np.array(jax.devices()), ("rows",))
    data = jaxcache.synthetic.SyntheticCriteo(
        scale=args.scale, batch_size=args.batch_size, seed=args.seed
    )
    # Every process saves and restores together; each writes and reads its own host rows.
    checkpointer = jaxcache.Checkpointer(args.checkpoint) if args.checkpoint else None
    saved = None
    if checkpointer is not None and checkpointer.latest_step() is not None:
        saved = checkpointer.info()
        # The data stream and the table must be the saved run's: another seed
        # or batch size would train on other batches in silence.
        refuse_other_options(
            "multiprocess.py",
            "--checkpoint",
            args.checkpoint,
            saved.extra.get("options", {}),
            checkpoint_options(args),
        )
    vocabulary = None
    if args.raw_ids is not None:
        vocabulary = jaxcache.DynamicVocabulary(
            forget=args.forget,
            admit_after=args.admit_after,
            default=args.default,
            protect=args.lookahead,  # the pipeline's: it forgets as unpipelined steps would
        )
    rows = data.num_embeddings if args.raw_ids is None else args.raw_ids
    cfg = jaxcache.CacheConfig(
        rows,
        16,
        args.cache_fraction,
        policy="lfu",
        optimizer=jaxcache.rowwise_adagrad(0.05),
        vocabulary=vocabulary,
    )
    # This process's share of the host rows: ids i with i % count == index.
    table = jaxcache.HostTable(cfg, seed=args.seed, shard=jaxcache.host.process_shard(mesh))
    cache = jaxcache.EmbeddingCache(cfg, table=table, mesh=mesh)
    from flax import nnx

    model = jaxcache.models.DLRM(
        jaxcache.nnx.CachedEmbed(cache),
        num_sparse=data.num_features,
        features=16,
        bottom=(64, 32),
        top=(64, 32),
        rngs=nnx.Rngs(args.seed),
    )
    optimizer, step = jaxcache.models.make_train_step(
        model, jaxcache.models.dense_optimizer("adam", 1e-3)
    )
    start = 0
    if checkpointer is not None and saved is not None:
        start = checkpointer.restore(model=model, optimizer=optimizer).batches_consumed
    losses = []
    batches = data.batches(args.steps, start=start)
    if vocabulary is not None:
        batches = ({**b, "sparse": raw_ids(b["sparse"])} for b in batches)
    with jaxcache.prefetch(batches, {"sparse": model.embed}, lookahead=args.lookahead) as pipeline:
        for batch in pipeline:
            losses.append(float(step(batch["dense"], batch["sparse"], batch["label"])))
    if checkpointer is not None:
        checkpointer.save(
            start + args.steps,
            model=model,
            optimizer=optimizer,
            extra={"options": checkpoint_options(args)},
        )
        checkpointer.close()
    rows, _ = model.embed.export()  # every process calls it: a collective
    if args.save and jax.process_index() == 0:
        np.save(args.save, rows)
    live = None
    if vocabulary is not None:  # a collective too: every process gets every live id
        ids, _, _ = cache.export_ids(model.embed.get_state())
        live = [int(ids.size), int(np.bitwise_xor.reduce(ids, initial=0))]
    return {
        "process": jax.process_index(),
        "global_devices": jax.device_count(),
        "losses": losses,
        "table_checksum": float(np.abs(rows.astype(np.float64)).sum()),
        "hit_rate": cache.stats.total.hit_rate,
        "evictions": cache.stats.total.evictions,
        "host_rows": int(table.rows.shape[0]),
        "num_embeddings": cfg.num_embeddings,
        # What this process's planners saw: the ids homed on its devices only.
        "planned_ids": cache.stats.total.lookups,
        "homed_ids": sum(
            int((batch["sparse"] % table.shard[1] == table.shard[0]).sum())
            for batch in data.batches(args.steps, start=start)
        )
        if vocabulary is None
        else None,
        "forgotten_ids": cache.stats.total.forgotten_ids,
        "refused_lookups": cache.stats.total.refused_lookups,
        "bonus": None if args.raw_ids is None else cache.vocabulary.bonus,
        "live_ids": live,  # with raw ids: how many, and their xor
        "planner_bytes": cache.planner.nbytes,
    }


def checkpoint_options(args: argparse.Namespace) -> dict:
    """The options a checkpoint's run must be resumed with (saved with it)."""
    return {
        "scale": args.scale,
        "batch_size": args.batch_size,
        "seed": args.seed,
        "raw_ids": args.raw_ids,
    }


def raw_ids(ids):
    """Synthetic ids as raw int64 ids: times an odd constant modulo 2^64, a
    bijection that spreads them over all of int64."""
    import numpy as np

    return (ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.process_id is None:
        return launch(args, argv)
    print(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    raise SystemExit(main())
