"""The cache against the plain table at MLPerf DCNv2's shape.

``throughput_plain.py``'s experiment on the ``dcnv2`` setup of
``_training.py``: 26 multi-hot features of DCNv2's bag sizes (214 ids a
sample), ``D = 128``, MLPerf's MLPs and cross network, the table MLPerf's
Criteo 1TB's features scaled by ``--dcnv2-scale`` (204M rows at 1.0) and a
batch of 16,384 samples times that scale. The plain loop (the whole table
one device array) and the loop of a 2% cache at ``--lookahead``, side by
side; ``dcnv2_cached_2pct_over_plain=R`` is the plain step time over the
cache's (one figure per planner where the cache takes one).

The default scale (0.001: 204k rows, 16 samples a batch) keeps the run to
about two minutes on 2 CPU cores, where the dense layers take most of a step;
on a GPU host take a table of millions of rows:

    python benchmarks/throughput_dcnv2.py --quick
    python benchmarks/throughput_dcnv2.py --dcnv2-scale 0.0625 --rounds 1  # as on_gpu.sh
"""

from __future__ import annotations

import _harness
import _training
import throughput_plain


def main(argv: list[str] | None = None) -> None:
    args = _training.parse_args(__doc__, argv)
    _training.print_machine(args)
    bench = _training.Bench(_training.dcnv2(args), args)
    _harness.print_results(throughput_plain.cached_over_plain(bench, prefix="dcnv2_"))


if __name__ == "__main__":
    main()
