"""Two processes on localhost (gloo) train exactly like one process."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "multiprocess.py"
# A cache of 4% of a small table: rows are evicted and fetched again.
FLAGS = ["--steps", "8", "--batch-size", "64", "--seed", "3"]
FLAGS += ["--scale", "0.0005", "--cache-fraction", "0.04"]


def _run(*args):
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), *FLAGS, *args],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_two_processes_match_one_process(tmp_path):
    two, one = tmp_path / "two.npy", tmp_path / "one.npy"
    launched = _run("--num-processes", "2", "--devices-per-process", "2", "--save", str(two))
    single = _run(
        "--num-processes", "1", "--process-id", "0", "--devices-per-process", "4",
        "--save", str(one),
    )  # fmt: skip
    assert launched["agree"]
    first = launched["processes"][0]
    assert first["global_devices"] == single["global_devices"] == 4
    # Cross-process reductions may sum in another order.
    np.testing.assert_allclose(first["losses"], single["losses"], atol=1e-5)
    assert (
        abs(first["table_checksum"] - single["table_checksum"]) <= 1e-4 * single["table_checksum"]
    )
    # The whole trained table, gathered from both processes, is the same.
    np.testing.assert_allclose(np.load(two), np.load(one), atol=1e-5)
    # Rows really move. The hit rates differ a little: with two processes
    # each id may only use the slots of its home process's devices.
    assert first["evictions"] > 0 and single["evictions"] > 0
    assert first["hit_rate"] < 0.9 and abs(first["hit_rate"] - single["hit_rate"]) < 0.02
    # Each process stores only its half of the host rows; one process stores all.
    n = single["num_embeddings"]
    assert single["host_rows"] == n
    assert sorted(p["host_rows"] for p in launched["processes"]) == [n // 2, n - n // 2]
