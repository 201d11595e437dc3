"""benchmarks/throughput_plain.py's baseline trains what the cache trains, padding included."""

from __future__ import annotations

import importlib
import pathlib
import sys

import jax.numpy as jnp
import numpy as np

import jaxcache

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
# The benchmarks import each other as scripts do, from their own directory.
sys.path.insert(0, str(BENCHMARKS))
try:
    training = importlib.import_module("_training")
    plain = importlib.import_module("throughput_plain")
finally:
    sys.path.remove(str(BENCHMARKS))


def test_plain_table_trains_as_the_cache_does():
    # The dcnv2 setup, small: bags of up to 100 ids, mostly padding, D = 128.
    args = training.parse_args(
        "plain", ["--dcnv2-scale", "0.0005", "--steps", "3", "--warmup", "2"]
    )
    bench = training.Bench(training.dcnv2(args), args)
    base = bench.base.copy()
    baseline = plain.run_plain(bench.setup, bench.batches, bench.base, **bench.common)
    # The step is donated its table: the initial one the other runs share stays as it was.
    np.testing.assert_array_equal(bench.base, base)
    cached = bench.loop(0.02, "cache 2%", args.lookahead)
    np.testing.assert_allclose(
        [float(x) for x in baseline.losses], [float(x) for x in cached.losses], atol=1e-6
    )


def test_padding_reads_zeros_and_takes_no_update():
    rows = np.arange(20, dtype=np.float32).reshape(10, 2)
    embed = plain.PlainEmbed(rows, jaxcache.sgd(1.0))
    ids = jnp.array([[[3, -1, 3]], [[-1, -1, 9]]])  # [B, F, L]: two bags, padding -1
    # One slot more than the real ids: it reads and updates nothing either.
    found = plain.PlainIds.of(ids, real=4, num_embeddings=10, pooled=True)
    np.testing.assert_array_equal(embed(found), [[[12.0, 14.0]], [[18.0, 19.0]]])
    embed.update(found.ids, jnp.ones((4, 2)))
    expected = rows.copy()
    expected[3] -= 2.0  # twice in the batch: the gradients summed
    expected[9] -= 1.0  # the last row, where a padding id of -1 would wrap to
    np.testing.assert_array_equal(embed.rows[...], expected)
