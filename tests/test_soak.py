"""Soak: thousands of steps of a tiny cache under heavy churn lose no row and leak nothing."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"
_spec = importlib.util.spec_from_file_location("soak_benchmark", PATH)
soak = sys.modules["soak_benchmark"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_every_step_checked(policy):
    """Unpipelined, checked after every step: invariants, device == host, table == replay."""
    samples = soak.run(soak.Soak(capacity=128, lookahead=0, policy=policy), 1000, 1)
    assert len(samples) == 1000
    assert samples[-1]["evictions"] > 25_000 and samples[-1]["rows_to_host"] > 25_000
    assert samples[-1]["live_arrays"] == samples[0]["live_arrays"]


def test_pipelined_soak_keeps_memory_flat():
    samples = soak.run(soak.Soak(lookahead=2), 3000, 50)
    assert samples[-1]["evictions"] > 75_000
    counts = {s["live_arrays"] for s in samples}
    assert len(counts) == 1  # nothing accumulates on device
    growth = samples[-1]["rss_mib"] - samples[len(samples) // 4]["rss_mib"]
    assert growth < 32, f"RSS grew {growth:.1f} MiB"
