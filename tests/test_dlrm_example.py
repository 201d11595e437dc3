"""examples/dlrm.py end to end: its JSON result, determinism, and exactness of the cache.

Exactness covers the three ways the example feeds the step: the prefetch
pipeline (the default, ``--lookahead 2``), the unpipelined loop
(``--lookahead 0``) and the host-callback form (``--host-callback``), and
both data sources: the synthetic stream and Criteo files (``--data criteo``).
"""

import importlib.util
import json
import math
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


def run_all(argvs):
    """Runs the example once per argv, all at once; returns each run's JSON result."""
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


@pytest.fixture(scope="module")
def runs():
    """The runs, started together: the cached run (pipelined, the default) twice
    with the same seed, unpipelined, with the host-callback form, and full table."""
    return run_all(
        {
            "cached": CACHED,
            "again": CACHED,
            "unpipelined": [*CACHED, "--lookahead", "0"],
            "callback": [*CACHED, "--host-callback"],
            "full": [*QUICK, "--full-table"],
        }
    )


@pytest.fixture(scope="module")
def criteo_runs(tmp_path_factory):
    """A cached and a full-table run on files in the Criteo format.

    20,000 lines make five records of 4096 rows: ``train[:90%]`` is four of
    them, ``train[90%:]`` (the held-out split) the last. ``--scale 0.001``
    hashes the ids into a table of 33,803 rows. Each run builds its own copy
    of the dataset, so the two never write the same directory.
    """
    import jaxcache.datasets as jd

    manual = tmp_path_factory.mktemp("criteo")
    jd.write_fake_criteo(manual / "train.txt", 20_000, seed=0)
    flags = [*QUICK, "--data", "criteo", "--manual-dir", str(manual), "--scale", "0.001"]

    def data_dir():
        return ["--data-dir", str(tmp_path_factory.mktemp("data"))]

    return run_all(
        {
            "cached": [*flags, *data_dir(), "--policy", "lru", "--cache-fraction", "0.05"],
            "full": [*flags, *data_dir(), "--full-table"],
        }
    )


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


def test_criteo_files_train_exactly_through_the_cache(criteo_runs):
    cached, full = criteo_runs["cached"], criteo_runs["full"]
    for result in (cached, full):
        assert KEYS <= set(result) and result["data"] == "criteo"
        assert math.isfinite(result["loss"]) and 0 <= result["auc"] <= 1
        assert result["table_rows"] == 33_803 and result["eval_samples"] == 4 * 128
    assert cached["cache_rows"] < cached["table_rows"] // 10 and cached["rows_fetched"] > 0
    assert abs(cached["loss"] - full["loss"]) <= 1e-5
    assert abs(cached["last_loss"] - full["last_loss"]) <= 1e-5
    assert abs(cached["auc"] - full["auc"]) <= 1e-4


@pytest.fixture
def example(monkeypatch):
    """examples/dlrm.py as a module, its directory on ``sys.path`` (for ``_common``)."""
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))
    spec = importlib.util.spec_from_file_location("dlrm_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--lookahead", "-1"], "--lookahead=-1 must be 0"),
        (["--data", "criteo"], "--data criteo needs --manual-dir DIR"),
        (["--data", "criteo", "--manual-dir", "no/such/dir"], "--manual-dir=no/such/dir is not"),
        (["--manual-dir", "."], "--manual-dir is only for Criteo files"),
    ],
)
def test_bad_flags_are_refused(example, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        example.main(flags)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
