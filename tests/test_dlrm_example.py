"""The DLRM examples end to end: their JSON results, determinism, and exactness of the cache.

Exactness covers the three ways examples/dlrm.py feeds the step: the
prefetch pipeline (the default, ``--lookahead 2``), the unpipelined loop
(``--lookahead 0``) and the host-callback form (``--host-callback``); both
data sources: the synthetic stream and Criteo files (``--data criteo``); and
the many-device examples, dlrm_pjit.py and dlrm_pmap.py, against dlrm.py.
"""

import importlib.util
import itertools
import json
import math
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import jaxcache

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
EXAMPLE = EXAMPLES / "dlrm.py"
# Short runs of a small model (it compiles faster); the cache logic is the same.
# The large row learning rate makes the rows matter to the loss within 20
# steps: with the default, a row gradient applied twice (or scaled by the
# device count) moved the loss by less than 1e-7 (Adagrad is nearly invariant
# to the scale of a gradient); with 0.5 it moves it by 1e-2.
QUICK = [
    *("--steps", "20", "--batch-size", "128", "--eval-batches", "4"),
    *("--bottom", "64", "--top", "64", "--row-learning-rate", "0.5", "--no-progress"),
]
# A small LRU cache, so rows really are fetched, evicted and written back.
CACHED = [*QUICK, "--policy", "lru", "--cache-fraction", "0.005"]
KEYS = {"loss", "auc", "hit_rate", "rows_fetched", "steps_per_s", "cache_rows", "table_rows"}


def run_all(commands):
    """Runs every ``[script, *flags]`` at once; returns each run's JSON result, by name."""
    procs = {
        name: subprocess.Popen(
            [sys.executable, *map(str, command)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, command in commands.items()
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
            "cached": [EXAMPLE, *CACHED],
            "again": [EXAMPLE, *CACHED],
            "unpipelined": [EXAMPLE, *CACHED, "--lookahead", "0"],
            # At most 924 distinct ids per batch here, of 3,328 ids.
            "callback": [EXAMPLE, *CACHED, "--host-callback", "--callback-rows", "1024"],
            "full": [EXAMPLE, *QUICK, "--full-table"],
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
    flags = [EXAMPLE, *QUICK, "--data", "criteo", "--manual-dir", manual, "--scale", "0.001"]

    def data_dir():
        return ["--data-dir", tmp_path_factory.mktemp("data")]

    return run_all(
        {
            "cached": [*flags, *data_dir(), "--policy", "lru", "--cache-fraction", "0.05"],
            "full": [*flags, *data_dir(), "--full-table"],
        }
    )


@pytest.fixture(scope="module")
def many_device_runs():
    """dlrm_pjit.py and dlrm_pmap.py on 4 simulated CPU devices, with the flags
    of the cached one-device run."""
    return run_all(
        {
            name: [EXAMPLES / f"dlrm_{name}.py", *CACHED, "--devices", "4"]
            for name in ("pjit", "pmap")
        }
    )


def test_last_line_is_a_json_result(runs):
    for result in runs.values():
        assert KEYS <= set(result)
        assert 0 <= result["hit_rate"] <= 1 and 0 <= result["auc"] <= 1
        assert result["steps_per_s"] > 0
        assert set(result["phase_mean_ms"]) == set(jaxcache.stats.PhaseTimers.PHASES)
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
        (["--callback-rows", "64"], "--callback-rows sizes the host-callback form"),
        (["--host-callback", "--callback-rows", "0"], "--callback-rows=0 must be at least 1"),
        (["--profile-batches", "-1"], "--profile-batches=-1 must be 0"),
        (["--profile-batches", "0"], "leaves --policy frequency without the counts"),
        (["--learning-rate", "nan"], "--learning-rate=nan must be a finite rate"),
        (["--row-learning-rate", "-1"], "--row-learning-rate=-1.0 must be a finite rate"),
        (["--bag-size", "3"], "--bag-size sizes the bags of --multi-hot"),
    ],
)
def test_bad_flags_are_refused(example, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        example.main(flags)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_held_out_batch_the_cache_cannot_hold_is_a_usage_error(example, capsys):
    # It may hold more distinct ids than any training batch did.
    flags = "--steps 8 --batch-size 64 --scale 0.001 --eval-batches 2 --profile-batches 2 "
    flags += "--bottom 16,8 --top 16 --features 8 --no-progress --multi-hot --bag-size 3"
    with pytest.raises(SystemExit) as exit_info:
        example.main(flags.split())
    assert str(exit_info.value).startswith("error: the batch has 684 distinct ids but capacity")
    assert "(--cache-fraction sets the capacity.)" in str(exit_info.value)


def test_a_full_table_that_does_not_split_over_the_devices_is_a_usage_error(example):
    import jax
    from jax.sharding import Mesh

    data = example._common.Data("", 1001, 4, None, np.ones(1001, np.int64), iter(()), [])
    args = example._common.parse_args(example.__doc__, ["--full-table"])
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    with pytest.raises(SystemExit, match=r"^error: full_table keeps all 1001 rows .*--devices"):
        example.build_cache(args, data, mesh=mesh, axis="data")


def test_a_learning_rate_of_zero_is_kept(example):
    args = example._common.parse_args("", ["--learning-rate", "0", "--row-learning-rate", "0"])
    assert args.learning_rate == 0 and args.row_learning_rate == 0
    default = example._common.parse_args("", [])
    assert default.learning_rate > 0 and default.row_learning_rate > 0


def test_host_callback_builds_a_host_planned_cache(example, monkeypatch):
    # Accelerators default to the device planner, which refuses the form.
    monkeypatch.setenv("JAXCACHE_PLANNER", "device")
    counts = np.ones(1000, np.int64)
    data = example._common.Data("", 1000, 4, None, counts, iter(()), [])
    for flags, planner in ((["--host-callback"], "host"), ([], "device")):
        args = example._common.parse_args(example.__doc__, flags, host_callback=True)
        assert example.build_cache(args, data).planner_kind == planner


def test_many_device_examples_train_the_one_device_model(runs, many_device_runs):
    for name, result in many_device_runs.items():
        assert KEYS <= set(result)
        assert result["parallelism"] == name and result["devices"] == 4
        assert result["cache_rows"] % 4 == 0 and result["rows_fetched"] > 0
    results = {"one device": runs["cached"], **many_device_runs}
    for (a, x), (b, y) in itertools.combinations(results.items(), 2):
        # The same model on the same data, summed in another order: the dense
        # gradients and the loss are reduced over the devices, each row's
        # gradient is summed over the devices that used it. Those float32 sums
        # differ in the last bits (1e-8 measured over 20 steps), far below
        # what a row gradient applied twice or scaled by the device count moves
        # (1e-2, see QUICK). AUC ranks samples: near-ties may swap.
        for key in ("loss", "last_loss", "eval_loss"):
            assert abs(x[key] - y[key]) <= 1e-5, (a, b, key)
        assert abs(x["auc"] - y["auc"]) <= 1e-4, (a, b)


@pytest.mark.parametrize(
    ("name", "flags", "message"),
    [
        ("resume", ["--max-to-keep", "0"], "--max-to-keep must be at least 1"),
        ("resume", ["--lookahead", "-1"], "--lookahead=-1 must be 0"),
        ("resume", ["--cache-fraction", "2"], "--cache-fraction=2.0 must be in (0, 1]"),
        ("serve", ["--lookahead", "-1"], "--lookahead=-1 must be 0"),
        ("serve", ["--capacity", "0"], "--capacity=0.0 must be in (0, 1]"),
        ("serve", ["--warmup", "-1"], "--warmup=-1 must be 0 or more"),
        ("multiprocess", ["--num-processes", "0"], "--num-processes must be at least 1"),
        ("multiprocess", ["--process-id", "2"], "--process-id=2 must be in [0, --num-processes)"),
        ("multiprocess", ["--raw-ids", "0"], "--raw-ids=0 must be a row budget"),
        ("multiprocess", ["--process-id", "0"], "--num-processes=2 needs --coordinator"),
        ("multiprocess", ["--coordinator", "h:1"], "--coordinator is for processes started"),
        ("multiprocess", ["--admit-after", "2", "--forget", "lru"], "are only for raw ids"),
        ("multiprocess", ["--default", "shared"], "--default is only for raw ids"),
        ("multiprocess", ["--raw-ids", "9", "--admit-after", "0"], "--admit-after must be at"),
        ("resume", ["--kill-at", "0"], "--kill-at=0 must be a checkpoint step from 1"),
    ],
)
def test_other_examples_refuse_bad_flags(monkeypatch, capsys, name, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        _load(monkeypatch, name).parse_args(flags)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def _load(monkeypatch, name):
    """examples/NAME.py as a module, its directory on ``sys.path``."""
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))
    spec = importlib.util.spec_from_file_location(f"{name}_example", EXAMPLE.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_serve_names_a_missing_checkpoint_step(monkeypatch, tmp_path):
    serve = _load(monkeypatch, "serve")
    with pytest.raises(SystemExit, match="--checkpoint/--step: no checkpoint in"):
        serve.main(["--checkpoint", str(tmp_path)])


# One process of one device, on a small table: it starts in a few seconds.
SMALL_MULTIPROCESS = [
    *("--num-processes", "1", "--devices-per-process", "1", "--skip-reference"),
    *("--steps", "2", "--batch-size", "32", "--scale", "0.0005"),
]


def test_multiprocess_launches_with_the_arguments_main_was_given(monkeypatch, capsys, tmp_path):
    multiprocess = _load(monkeypatch, "multiprocess")
    checkpoint = ["--checkpoint", str(tmp_path / "ckpt")]
    assert multiprocess.main([*SMALL_MULTIPROCESS, *checkpoint]) == 0
    (process,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["processes"]
    assert len(process["losses"]) == 2
    # Resumed on another stream: refused, where it trained on in silence.
    with pytest.raises(SystemExit, match="process 0 failed"):
        multiprocess.main([*SMALL_MULTIPROCESS, *checkpoint, "--seed", "1"])
    assert "holds a run of other options: --seed 1 (saved: 0)" in capsys.readouterr().err


def test_resume_refuses_what_its_checkpoint_cannot_continue(monkeypatch, capsys, tmp_path):
    resume = _load(monkeypatch, "resume")
    flags = ["--checkpoint-dir", str(tmp_path), "--every", "2", "--batch-size", "16"]
    assert resume.main([*flags, "--steps", "2"])["steps"] == 2
    capsys.readouterr()
    refusals = {
        "--optimizer adam (saved: adagrad); resume with the saved ones": ["--optimizer", "adam"],
        "--steps 1 is below the 2 steps the latest checkpoint": ["--steps", "1"],
        "--kill-at 3 is not a step this run saves a checkpoint at ([4])": ["--kill-at", "3"],
    }
    for message, changed in refusals.items():
        with pytest.raises(SystemExit, match=re.escape(message)):
            resume.main([*flags, "--steps", "4", *changed])
        assert "restored" not in capsys.readouterr().out  # refused before restoring


def test_resume_killed_in_a_temporary_directory_names_it_first(tmp_path):
    out = subprocess.run(
        [sys.executable, EXAMPLES / "resume.py", "--steps", "2", "--every", "2", "--kill-at", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == -9, out.stderr
    first, saved = out.stdout.strip().splitlines()
    directory = first.rsplit(" ", 1)[1]
    assert first.startswith("checkpoints go to") and saved.startswith("step 2: loss")
    assert jaxcache.Checkpointer(directory, read_only=True).steps() == [2]
