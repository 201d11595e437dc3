"""Two processes on localhost (gloo) train exactly like one process."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "multiprocess.py"
FLAGS = ["--steps", "6", "--batch-size", "64", "--seed", "3"]


def _run(*args):
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), *FLAGS, *args],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_two_processes_match_one_process():
    launched = _run("--num-processes", "2", "--devices-per-process", "2")
    single = _run("--num-processes", "1", "--process-id", "0", "--devices-per-process", "4")
    assert launched["agree"]
    first = launched["processes"][0]
    assert first["global_devices"] == single["global_devices"] == 4
    # Cross-process reductions may sum in another order.
    np.testing.assert_allclose(first["losses"], single["losses"], atol=1e-5)
    assert (
        abs(first["table_checksum"] - single["table_checksum"]) <= 1e-4 * single["table_checksum"]
    )
    assert first["hit_rate"] == single["hit_rate"]
