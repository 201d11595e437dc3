"""examples/dlrm.py end to end: its JSON result, determinism, and exactness of the cache.

Exactness covers the three ways the example feeds the step: the prefetch
pipeline (the default, ``--lookahead 2``), the unpipelined loop
(``--lookahead 0``) and the host-callback form (``--host-callback``).
"""

import json
import pathlib
import subprocess
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "dlrm.py"
# Short runs of a small model (it compiles faster); the cache logic is the same.
QUICK = [
    *("--steps", "20", "--batch-size", "128", "--eval-batches", "4"),
    *("--bottom", "64", "--top", "64", "--no-progress"),
]
# A small LRU cache, so rows really are fetched, evicted and written back.
CACHED = [*QUICK, "--policy", "lru", "--cache-fraction", "0.005"]
KEYS = {"loss", "auc", "hit_rate", "rows_fetched", "steps_per_s", "cache_rows", "table_rows"}


@pytest.fixture(scope="module")
def runs():
    """The runs, started together: the cached run (pipelined, the default) twice
    with the same seed, unpipelined, with the host-callback form, and full table."""
    argvs = {
        "cached": CACHED,
        "again": CACHED,
        "unpipelined": [*CACHED, "--lookahead", "0"],
        "callback": [*CACHED, "--host-callback"],
        "full": [*QUICK, "--full-table"],
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(EXAMPLE), *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, argv in argvs.items()
    }
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        results[name] = json.loads(out.strip().splitlines()[-1])
    return results


def test_last_line_is_a_json_result(runs):
    for result in runs.values():
        assert KEYS <= set(result)
        assert 0 <= result["hit_rate"] <= 1 and 0 <= result["auc"] <= 1
        assert result["steps_per_s"] > 0
        assert set(result["phase_mean_ms"]) == {
            "plan",
            "write_back",
            "gather",
            "transfer",
            "swap",
            "wait",
        }
    assert runs["cached"]["lookahead"] == 2 and not runs["cached"]["host_callback"]
    assert runs["unpipelined"]["lookahead"] == 0
    assert runs["callback"]["host_callback"]


def test_cache_moves_rows(runs):
    cached, full = runs["cached"], runs["full"]
    assert cached["cache_rows"] < cached["table_rows"] // 100
    assert cached["rows_fetched"] > 0 and cached["rows_written_back"] > 0
    assert cached["hit_rate"] < 1
    assert full["cache_rows"] == full["table_rows"] and full["rows_fetched"] == 0


def test_same_seed_same_run(runs):
    assert runs["cached"]["loss"] == runs["again"]["loss"]
    assert runs["cached"]["auc"] == runs["again"]["auc"]


@pytest.mark.parametrize("other", ["unpipelined", "callback"])
def test_pipelined_unpipelined_and_callback_runs_are_identical(runs, other):
    # Rows fetched may differ: batches staged ahead keep their rows protected,
    # so the policy may choose other victims. What is computed may not.
    for key in ("loss", "last_loss", "auc", "eval_loss"):
        assert runs[other][key] == runs["cached"][key], key


def test_training_through_the_cache_is_exact(runs):
    cached, full = runs["cached"], runs["full"]
    assert abs(cached["loss"] - full["loss"]) <= 1e-5
    assert abs(cached["last_loss"] - full["last_loss"]) <= 1e-5
    assert abs(cached["auc"] - full["auc"]) <= 1e-4


def test_bad_flags_are_refused():
    for flags, message in [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--lookahead", "-1"], "--lookahead=-1 must be 0"),
    ]:
        proc = subprocess.run(
            [sys.executable, str(EXAMPLE), *flags], capture_output=True, text=True
        )
        assert proc.returncode != 0 and message in proc.stderr
