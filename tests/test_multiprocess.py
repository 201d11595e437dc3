"""Two processes on localhost (gloo) train exactly like one process."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import jaxcache
from tests.multiprocess_run import broken_off, pipelined_counts

# Every test here runs with both planners (``conftest.planner``).
pytestmark = pytest.mark.usefixtures("planner")

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "multiprocess.py"
WORKER = pathlib.Path(__file__).resolve().parent / "multiprocess_run.py"
# A cache of 4% of a small table: rows are evicted and fetched again.
FLAGS = ["--batch-size", "64", "--seed", "3", "--scale", "0.0005", "--cache-fraction", "0.04"]
TWO = ["--num-processes", "2", "--devices-per-process", "2"]
# The tests compare with one process themselves, as the launcher does unless told not to.
TWO_ONLY = [*TWO, "--skip-reference"]
ONE = ["--num-processes", "1", "--process-id", "0", "--devices-per-process", "4"]


def _run(*args):
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), *FLAGS, *args],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_two_processes_match_one_process_and_resume_on_any_process_count(planner, tmp_path):
    # The launcher trains the same steps in one process of four devices and
    # compares the losses and the whole trained table (1e-5: cross-process
    # reductions may sum in another order).
    launched = _run(*TWO, "--steps", "8", "--save", str(tmp_path / "two.npy"))
    assert launched["agree"]
    first, single = launched["processes"][0], launched["one_process"]
    assert first["global_devices"] == single["global_devices"] == 4
    np.testing.assert_allclose(first["losses"], single["losses"], atol=1e-5)
    eight_steps = np.load(tmp_path / "two.npy")
    assert eight_steps.shape == (single["num_embeddings"], 16)
    # Rows really move, and the two processes plan what one plans: each
    # counts its own devices' shares, which add up to one process's, also
    # where a pipeline's batch waits for room (the processes agree on when).
    assert first["evictions"] > 0 and first["hit_rate"] < 0.9
    assert sum(p["evictions"] for p in launched["processes"]) == single["evictions"]
    # Each process stores only its half of the host rows; one process stores all.
    n = single["num_embeddings"]
    assert single["host_rows"] == n
    assert sorted(p["host_rows"] for p in launched["processes"]) == [n // 2, n - n // 2]
    # Each process planned only the ids homed on its devices: half of them each,
    # with directories and policy counts for its half of the table only.
    for process in launched["processes"]:
        assert process["planned_ids"] == process["homed_ids"] > 0
        assert abs(process["planner_bytes"] - single["planner_bytes"] / 2) < 64
    assert sum(p["planned_ids"] for p in launched["processes"]) == single["planned_ids"]

    # Two processes train four steps and save: each writes its own host rows.
    saved = tmp_path / "saved"
    _run(*TWO_ONLY, "--steps", "4", "--checkpoint", str(saved), "--save", str(tmp_path / "at4.npy"))
    table = saved / "4" / "tables" / "embedding"
    assert (table / "rows.shard-0-of-2.npy").exists() and (table / "rows.shard-1-of-2.npy").exists()
    # The checkpoint's exported table is the one trained so far, in id order.
    exported = jaxcache.Checkpointer(saved, read_only=True).export(tmp_path / "export")
    np.testing.assert_array_equal(np.load(exported["embedding"]), np.load(tmp_path / "at4.npy"))
    # Resumed on two processes, or on one, the next four steps end where the
    # eight uninterrupted steps above end.
    for name, processes in (("two", TWO_ONLY), ("one", ONE)):
        directory = tmp_path / name
        shutil.copytree(saved, directory)
        rows = tmp_path / f"{name}.npy"
        resumed = _run(
            *processes, "--steps", "4", "--checkpoint", str(directory), "--save", str(rows)
        )
        losses = resumed["processes"][0]["losses"] if "processes" in resumed else resumed["losses"]
        np.testing.assert_allclose(losses, single["losses"][4:], atol=1e-5)
        np.testing.assert_allclose(np.load(rows), eight_steps, atol=1e-5)


@pytest.mark.slow
def test_raw_ids_on_two_processes_match_one_and_resume_on_one(tmp_path):
    # Raw ids through a vocabulary of 400 rows (the batches hold 1,338
    # distinct ids; unpipelined, so that a batch may take the rows of the
    # one before it: a pipeline would hold more than this budget gives a
    # bucket): each process stores its half of the rows (and with the
    # device planner its devices hold their buckets of the vocabulary). Ids
    # seen once read a shared row, which one process stores and whose
    # lookups come from the devices of both. The bonus the vocabulary
    # forgets by is learned from the sample of both processes' devices.
    raw = ["--raw-ids", "400", "--cache-fraction", "0.9", "--admit-after", "2", "--lookahead", "0"]
    raw += ["--default", "shared", "--forget", "adaptive"]
    single = _run(*ONE, *raw, "--steps", "8", "--save", str(tmp_path / "one.npy"))
    assert single["forgotten_ids"] > 100 and single["refused_lookups"] > 100
    saved = tmp_path / "saved"
    two = _run(*TWO_ONLY, *raw, "--steps", "4", "--checkpoint", str(saved))
    assert two["agree"] and sorted(p["host_rows"] for p in two["processes"]) == [200, 200]
    np.testing.assert_allclose(two["processes"][0]["losses"], single["losses"][:4], atol=1e-5)
    assert two["processes"][0]["bonus"] == two["processes"][1]["bonus"]
    # Every process exports every live id, whichever process's devices hold it.
    first, second = (p["live_ids"] for p in two["processes"])
    assert first == second and 0 < first[0] < 400
    # Saved by two processes, resumed by one: it ends where eight steps in one end.
    resumed = _run(
        *ONE, *raw, "--steps", "4", "--checkpoint", str(saved), "--save", str(tmp_path / "r.npy")
    )
    np.testing.assert_allclose(resumed["losses"], single["losses"][4:], atol=1e-5)
    np.testing.assert_allclose(
        np.load(tmp_path / "r.npy"), np.load(tmp_path / "one.npy"), atol=1e-5
    )
    assert resumed["live_ids"] == single["live_ids"]
    assert resumed["bonus"] == single["bonus"]


@pytest.mark.slow
def test_two_processes_roll_back_in_place_and_refuse_a_batch_together(planner, tmp_path):
    # A restore of an earlier step in place planned indices the processes
    # had already exchanged sizes for, and every later batch failed. A batch
    # one process's devices refused raised there alone, while the other
    # committed its plan and waited ten minutes for the first. Processes
    # given different batches (host planner) read other ids' rows in silence.
    # Every process took the first one's statistics back from a checkpoint.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, JAXCACHE_PLANNER=planner)
    env.pop("XLA_FLAGS", None)
    runs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), f"127.0.0.1:{port}", str(p), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for p in range(2)
    ]
    seen = []
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
        seen.append(json.loads(out.strip().splitlines()[-1]))
    # Each process counts its own devices' shares, and gets them back.
    assert sum(saw["stats_saved"][1] for saw in seen) == 2 * 8
    for saw in seen:
        assert saw["stats_restored"] == saw["stats_saved"]
        np.testing.assert_array_equal(saw["again"], saw["ahead"])
        assert saw["same_table"]
        assert saw["too_large"].startswith("CapacityError"), saw["too_large"]
        if planner == "host":  # the device planner takes each process's own slice
            assert "staged different batches" in saw["different"], saw["different"]
    # An id outside the table in one process's batch: both raise at once
    # (the other one waited for it, or, planned on the device, failed an
    # assertion and skipped every later plan).
    assert seen[1]["bad_on_one"].startswith("ValueError: ids holds 64")
    other = "staged different batches" if planner == "host" else "another process's batch"
    assert other in seen[0]["bad_on_one"], seen[0]["bad_on_one"]
    assert seen[0]["ahead"] == seen[1]["ahead"] and seen[0]["after"] == seen[1]["after"]
    # Pipelined batches that wait for room: the processes agree on the wait,
    # so the two plan what one process of four devices plans (a refusing
    # process alone waited for its own release, and their choices parted).
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("rows",))
    cfg = jaxcache.CacheConfig(2000, 4, capacity=96, policy="lfu", optimizer=jaxcache.sgd(0.1))
    one = pipelined_counts(jaxcache, jaxcache.EmbeddingCache(cfg, mesh=mesh, planner=planner))
    assert np.add(seen[0]["pipelined"], seen[1]["pipelined"]).tolist() == one
    # A loop left early while one process's source was slower: the processes
    # had staged different numbers of batches ahead, so the faster one waited
    # in its plan's exchange for good and the other's next pipeline was
    # refused. Closing lets every process stage the same window first.
    cfg = jaxcache.CacheConfig(2000, 4, capacity=96, policy="lru", optimizer=jaxcache.sgd(0.1))
    planned, *counts = broken_off(
        jaxcache, jaxcache.EmbeddingCache(cfg, mesh=mesh, planner=planner)
    )
    assert seen[0]["broken_off"][0] == seen[1]["broken_off"][0] == planned
    assert np.add(seen[0]["broken_off"][1:], seen[1]["broken_off"][1:]).tolist() == counts
    assert counts[2] > 0  # rows were evicted
    # Scores split over both processes' devices reach each process whole.
    assert seen[0]["served"] == seen[1]["served"] == 0.0
