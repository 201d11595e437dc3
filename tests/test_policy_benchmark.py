"""Small versions of benchmarks/policies.py's traces: the adaptive policy keeps up."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "policies.py"
_spec = importlib.util.spec_from_file_location("policies_benchmark", PATH)
bench = sys.modules["policies_benchmark"] = importlib.util.module_from_spec(_spec)
# The benchmark imports benchmarks/_harness.py, as it does run as a script.
sys.path.insert(0, str(PATH.parent))
try:
    _spec.loader.exec_module(bench)
finally:
    sys.path.remove(str(PATH.parent))

SMALL = {
    "zipf": (lambda: bench.zipf(steps=160, batch=64, scale=0.003), 0.03),
    "drift": (lambda: bench.drift(steps=160, batch=1024, n=40_000, speed=10), 0.03),
    "reuse": (lambda: bench.reuse(steps=160, batch=1024, n=40_000, active=800), 0.05),
    "scan": (lambda: bench.scan(steps=160, batch=1024, hot=20_000), 0.02),
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_adaptive_is_within_a_point_of_the_best_fixed_policy(name):
    make, fraction = SMALL[name]
    trace, n = make()
    (row,) = bench.run_trace(trace, n, (fraction,))
    best = row[row["best fixed"]]
    assert row["adaptive"] >= best - 0.01, row
    assert row["adaptive"] <= row["belady"], row
