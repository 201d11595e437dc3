"""Training throughput: the cache, pipelined or not, against the whole table on device.

Every experiment below, in one run, on the same synthetic batches and the
same initial model (``_training.py``: the setups and how a run is timed).
Three configurations: ``dlrm`` (the DLRM reference MLPs, one id per
feature), ``embedding-heavy`` (small MLPs, multi-hot bags of DCNv2 sizes
capped at 16: about 4.6x the ids per sample), where host work is a large
share of a step, and ``dcnv2`` (MLPerf DCNv2's bags, MLPs and cross network,
``D = 128``, the table MLPerf's Criteo 1TB's scaled by ``--dcnv2-scale``).
Each experiment is a file of its own and runs alone too, with the same
flags:

1. ``throughput_variants.py``: every variant of both configurations in one
   table: the full table, caches of 0.5%, 2% and 5% (blocking, and in a loop
   fed by ``jaxcache.prefetch``), and the naive baseline of
   ``throughput_naive.py`` (rows gathered from a host NumPy table by
   ``jax.pure_callback`` inside the step).
2. ``throughput_side_by_side.py``: for the embedding-heavy configuration at
   2%, the device step alone and host staging alone beside every loop
   (unpipelined, pipelined, the host-callback form, the full table, and the
   full table with every batch staged beforehand), ``--rounds`` interleaved
   rounds, with each loop's CPU time per step by thread.
   ``pipelined_over_ideal=R``: the pipelined step over ``max(device, host)``.
3. ``throughput_split_cores.py``: the same runs with JAX's runtime threads
   and the host threads on cores of their own, as with an accelerator
   (``pipelined_over_ideal_split_cores=R``).
4. ``throughput_planner.py``: planner throughput on batches of 100k+ ids.
5. ``throughput_capacity.py``: the blocking parts at capacities x1 and x8
   of 2% (the training step must not grow with the capacity: the cache is
   donated to it, never copied).
6. ``throughput_staged_steps.py``: the training step with every batch
   staged beforehand: the CPU time the training thread spends calling it,
   through ``nnx.jit`` and through ``jaxcache.models.make_train_step``, and
   its time when pooling reads every position of the bags instead of the
   real ids only.
7. ``throughput_plain.py``: what a user would compare a cache with, the
   same model with its whole table one device array (``jnp.take``, the
   cache's sparse row optimizer on the batch's distinct ids, no jaxcache
   in the loop), against the 2% cache's loop, on the embedding-heavy
   configuration; ``throughput_dcnv2.py``: the same on the ``dcnv2`` one.

The ratios of the loops at ``--lookahead`` are printed as each is
measured: ``pipelined_over_ideal=R`` and ``cached_2pct_over_full=R``
(embedding-heavy, from the side-by-side runs: the full table's step time
over the 2% cache's), then
``cached_2pct_over_plain=R`` and ``dcnv2_cached_2pct_over_plain=R`` (the
plain step time over the 2% cache's). Where ``jaxcache.EmbeddingCache``
takes a ``planner=``, each plain ratio comes once per planner ``--planner``
names (default both), the planner appended: ``cached_2pct_over_plain_host``.

    python benchmarks/throughput.py                # about 8 minutes on 2 CPU cores
    python benchmarks/throughput.py --lookahead 0  # the loops unpipelined
    python benchmarks/throughput.py --quick        # a few minutes, smaller tables
    python benchmarks/throughput.py --side-by-side-only --rounds 5  # embedding-heavy ratios
    python benchmarks/throughput.py --no-dcnv2     # all but the dcnv2 runs
"""

from __future__ import annotations

import _harness
import _training
import throughput_capacity
import throughput_plain
import throughput_planner
import throughput_side_by_side
import throughput_split_cores
import throughput_staged_steps
import throughput_variants


def main(argv: list[str] | None = None) -> None:
    args = _training.parse_args(__doc__, argv, side_by_side_only=True)
    _training.print_machine(args)
    if not args.side_by_side_only:
        throughput_variants.compare(_training.Bench(_training.dlrm(args), args))
    bench = _training.Bench(_training.embedding_heavy(args), args)
    if not args.side_by_side_only:
        throughput_variants.compare(bench)
    over_ideal, cached_over_full = throughput_side_by_side.side_by_side(bench)
    # Printed as soon as measured: a run cut short keeps them.
    _harness.print_results(
        {"pipelined_over_ideal": over_ideal, "cached_2pct_over_full": cached_over_full}
    )
    over_ideal_split = throughput_split_cores.split_cores(bench)
    if over_ideal_split is not None:
        _harness.print_results({"pipelined_over_ideal_split_cores": over_ideal_split})
    if not args.side_by_side_only:
        throughput_planner.planner_throughput(bench.setup, args)
        throughput_capacity.capacity_scaling(bench)
        throughput_staged_steps.staged_steps(bench)
    _harness.print_results(throughput_plain.cached_over_plain(bench))
    if not (args.side_by_side_only or args.no_dcnv2):
        dcnv2 = _training.Bench(_training.dcnv2(args), args)
        _harness.print_results(throughput_plain.cached_over_plain(dcnv2, prefix="dcnv2_"))


if __name__ == "__main__":
    main()
