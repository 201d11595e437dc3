"""Trace replay: counters worked out by hand, invariants, and the command line."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest

import jaxcache
from jaxcache._src.cli import main
from jaxcache._src.replay import REPLAY_POLICIES, plot_curve, replay, sweep

KEYS = (
    "policy",
    "capacity",
    "capacity_fraction",
    "num_embeddings",
    "batches",
    "lookups",
    "distinct",
    "feasible",
    "hits",
    "access_hits",
    "unique_hit_rate",
    "access_hit_rate",
    "steady_unique_hit_rate",
    "miss_ratio",
    "rows_warmed",
    "rows_fetched",
    "rows_written_back",
    "evictions",
)

# Five batches of two ids over a table of three rows. Counts: id 0 x4, 1 x3, 2 x3.
HAND_TRACE = np.array([0, 1, 0, 2, 1, 0, 2, 2, 0, 1])

# Capacity 2. Victims are the unprotected slots of lowest priority, ties to the
# lower slot; every batch trains, so every evicted row was used and goes back.
#
# lru (priority: last batch that used the slot), starts empty:
#   b0 [0 1]  miss 0 1 -> s0=0 s1=1                   hits 0/2  fetch 2  back 0
#   b1 [0 2]  hit 0; miss 2 evicts s1=1               hits 1/2  fetch 1  back 1
#   b2 [1 0]  hit 0; miss 1 evicts s1=2               hits 1/2  fetch 1  back 1
#   b3 [2 2]  miss 2; s0, s1 both last used in b2,
#             the tie goes to s0: evicts 0            hits 0/1  fetch 1  back 1
#   b4 [0 1]  hit 1; miss 0 evicts s0=2               hits 1/2  fetch 1  back 1
#   total hits 3/9 distinct, 3/10 lookups; after the first quarter (b1..b4) 3/7.
#
# frequency (priority: dataset count 0:4 1:3 2:3), warmed with the two hottest,
# s0=0 s1=1 (clean until used):
#   b0 [0 1]  hit 0 1                                 hits 2/2  fetch 0  back 0
#   b1 [0 2]  hit 0; miss 2 evicts s1=1 (count 3)     hits 1/2  fetch 1  back 1
#   b2 [1 0]  hit 0; miss 1 evicts s1=2               hits 1/2  fetch 1  back 1
#   b3 [2 2]  miss 2 evicts s1=1 (3 < 4)              hits 0/1  fetch 1  back 1
#   b4 [0 1]  hit 0; miss 1 evicts s1=2               hits 1/2  fetch 1  back 1
#   total hits 5/9 distinct, 5/10 lookups; b1..b4 3/7.
# belady (offline optimum), starts with the two rows needed first, s0=0 s1=1:
#   b0 [0 1]  hit 0 1; next uses 0:b1 1:b2               hits 2/2  fetch 0  back 0
#   b1 [0 2]  hit 0; miss 2 evicts 1 (the only other)   hits 1/2  fetch 1  back 1
#   b2 [1 0]  hit 0; miss 1 evicts 2 (next b3)          hits 1/2  fetch 1  back 1
#   b3 [2 2]  miss 2; 0 and 1 are both next used in b4,
#             the tie goes to the lower id: evicts 0    hits 0/1  fetch 1  back 1
#   b4 [0 1]  hit 1; miss 0 evicts 2 (never used again) hits 1/2  fetch 1  back 1
#   total hits 5/9. Its steady rate is its own replay of b1..b4, started with
#   the rows they need first (0 and 2): b1 hits 2/2; b2 hit 0, 1 evicts 2;
#   b3 misses 2, which evicts 0 (0 and 1 next used in b4; lower id); b4 hit
#   1: 4/7.
HAND_EXPECTED = {
    "lru": dict(
        hits=3,
        distinct=9,
        access_hits=3,
        lookups=10,
        unique_hit_rate=3 / 9,
        access_hit_rate=3 / 10,
        steady_unique_hit_rate=3 / 7,
        rows_warmed=0,
        rows_fetched=6,
        rows_written_back=4,
        evictions=4,
    ),
    "belady": dict(
        hits=5,
        distinct=9,
        access_hits=5,
        lookups=10,
        unique_hit_rate=5 / 9,
        access_hit_rate=5 / 10,
        steady_unique_hit_rate=4 / 7,
        rows_warmed=2,
        rows_fetched=4,
        rows_written_back=4,
        evictions=4,
    ),
    "frequency": dict(
        hits=5,
        distinct=9,
        access_hits=5,
        lookups=10,
        unique_hit_rate=5 / 9,
        access_hit_rate=5 / 10,
        steady_unique_hit_rate=3 / 7,
        rows_warmed=2,
        rows_fetched=4,
        rows_written_back=4,
        evictions=4,
    ),
}


def zipf_trace(size: int = 20_000, num_embeddings: int = 2_000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ranks = rng.zipf(1.15, size) % num_embeddings
    return rng.permutation(num_embeddings)[ranks]  # hot rows scattered over the table


@pytest.mark.parametrize("policy", REPLAY_POLICIES)
def test_result_has_documented_keys(policy):
    out = replay(HAND_TRACE, batch=2, capacity=2, policy=policy)
    assert tuple(out) == KEYS
    assert out["policy"] == policy
    assert (out["capacity"], out["num_embeddings"], out["batches"]) == (2, 3, 5)
    json.dumps(out)  # plain numbers only


@pytest.mark.parametrize("policy", sorted(HAND_EXPECTED))
def test_hand_computed_counts(policy):
    out = replay(HAND_TRACE, batch=2, capacity=2, policy=policy)
    assert {key: out[key] for key in HAND_EXPECTED[policy]} == HAND_EXPECTED[policy]
    assert out["miss_ratio"] == 1 - out["unique_hit_rate"]


def test_warmed_rows_never_used_are_evicted_clean():
    # Explicit counts make 3 and 0 the hottest; the trace wants 1 and 2, which
    # evict both warmed rows. Neither was used since its fetch: nothing goes back.
    counts = np.array([1, 1, 1, 9])
    out = replay(np.array([[1, 2]]), capacity=2, policy="frequency", frequencies=counts)
    assert (out["rows_warmed"], out["rows_fetched"], out["evictions"]) == (2, 2, 2)
    assert out["rows_written_back"] == 0


@pytest.mark.parametrize("policy", REPLAY_POLICIES)
@pytest.mark.parametrize("batch", [64, 48])
def test_1d_trace_matches_2d_trace(policy, batch):
    trace = zipf_trace(size=3_200, num_embeddings=300)
    flat = replay(trace, batch=batch, capacity=0.5, policy=policy)
    if trace.size % batch == 0:
        rows = trace.reshape(-1, batch)
        assert replay(rows, capacity=0.5, policy=policy) == flat
    # A batch size re-splits a 2-D trace in reading order.
    other = trace.reshape(-1, 32)
    assert replay(other, batch=batch, capacity=0.5, policy=policy) == flat


def test_sweep_is_a_miss_ratio_curve():
    trace = zipf_trace()
    capacities = [0.25, 0.3, 0.4, 0.6, 1.0]
    curve = sweep(trace, batch=500, capacities=capacities, policies=["lru", "frequency"])
    assert len(curve) == 2 * len(capacities)
    assert [r["policy"] for r in curve] == ["lru"] * 5 + ["frequency"] * 5
    lru = curve[: len(capacities)]
    assert [r["capacity"] for r in lru] == [500, 600, 800, 1200, 2000]
    rates = [r["unique_hit_rate"] for r in lru]
    assert rates == sorted(rates)
    assert rates[0] < rates[-1]
    # The whole table fits: each id is fetched once and nothing is evicted.
    full = lru[-1]
    assert full["rows_fetched"] == np.unique(trace).size
    assert full["rows_written_back"] == full["evictions"] == 0


def test_sweep_takes_one_capacity_as_it_takes_one_policy():
    trace = zipf_trace()
    one = sweep(trace, batch=500, capacities=0.5, policies="lru")
    assert one == sweep(trace, batch=500, capacities=[0.5], policies=["lru"])
    with pytest.raises(ValueError, match="no capacity given"):
        sweep(trace, batch=500, capacities=[], policies="lru")


def best_hits(batches, capacity):
    """The most distinct-id hits any choice of victims can get (exhaustive), starting
    from the best set of preloaded rows."""
    ids = sorted(set(itertools.chain(*batches)))
    states = {frozenset(s): 0 for s in itertools.combinations(ids, min(capacity, len(ids)))}
    for batch in batches:
        needed, after = set(batch), {}
        for resident, hits in states.items():
            others = sorted(resident - needed)
            room = capacity - len(needed)
            for kept in itertools.combinations(others, min(room, len(others))):
                state = frozenset(needed | set(kept))
                after[state] = max(after.get(state, -1), hits + len(needed & resident))
        states = after
    return max(states.values())


def test_belady_replays_steady_batches_of_padding_only():
    # The steady part (after the first quarter) looks no id up.
    trace = np.array([[0, 1], [-1, -1], [-1, -1], [-1, -1], [-1, -1]])
    runs = {
        policy: replay(trace, capacity=2, policy=policy, padding_id=-1)
        for policy in ("belady", "lru")
    }
    for out in runs.values():
        assert out["lookups"] == 2 and out["steady_unique_hit_rate"] == 0.0
    assert runs["belady"]["hits"] == 2  # warmed for free, as documented


@pytest.mark.parametrize("seed", range(12))
def test_belady_is_the_optimum(seed):
    rng = np.random.default_rng(seed)
    capacity = int(rng.integers(2, 4))
    batches = [rng.integers(0, 6, int(rng.integers(1, capacity + 1))) for _ in range(7)]
    sizes = [np.unique(b).size for b in batches]
    batches = [b for b, size in zip(batches, sizes, strict=True) if size <= capacity]
    trace = np.concatenate(batches)
    # One batch per row of a 2-D trace needs equal lengths: pad with a repeat.
    width = max(b.size for b in batches)
    rows = np.stack([np.resize(b, width) for b in batches])
    out = replay(rows, capacity=capacity, policy="belady", num_embeddings=6)
    assert out["hits"] == best_hits([b.tolist() for b in batches], capacity)
    for policy in jaxcache.planning.POLICIES:
        other = replay(
            rows,
            capacity=capacity,
            policy=policy,
            num_embeddings=6,
            frequencies=np.bincount(trace, minlength=6),
        )
        assert other["hits"] <= out["hits"], policy


@pytest.mark.parametrize("policy", jaxcache.planning.POLICIES)
def test_only_used_rows_are_written_back(policy):
    out = replay(zipf_trace(), batch=400, capacity=0.3, policy=policy)
    assert 0 < out["rows_written_back"] <= out["evictions"]
    assert out["rows_fetched"] == out["distinct"] - out["hits"]
    if policy != "frequency":  # nothing warmed: every evicted row was used
        assert out["rows_written_back"] == out["evictions"]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(trace=np.ones(4), batch=2), TypeError, "integer ids, got dtype float64"),
        (dict(trace=np.zeros((2, 2, 2), int)), ValueError, r"got shape \(2, 2, 2\)"),
        (
            dict(trace=np.array([3, -1]), batch=2),
            ValueError,
            r"holds -1 at index.*padding_id \(--padding-id\) if it marks.*replay_vocabulary",
        ),
        (dict(trace=np.array([-1, -1]), batch=2, padding_id=-1), ValueError, "padding_id=-1 only"),
        (dict(trace=HAND_TRACE, batch=2, padding_id=2**63), ValueError, "must be an int64 id"),
        (dict(trace=HAND_TRACE, batch=2, padding_id=0), ValueError, "padding_id=0 is a real row"),
        (dict(trace=HAND_TRACE), ValueError, "batch is needed"),
        (dict(trace=HAND_TRACE, batch=4), jaxcache.CapacityError, "batch 0 of the trace"),
        (dict(trace=HAND_TRACE, batch=2, policy="fifo"), ValueError, "unknown policy 'fifo'"),
        (dict(trace=HAND_TRACE, batch=2, num_embeddings=2), ValueError, "at least 3 rows"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, error, match):
    kwargs = {"capacity": 2, "policy": "lru", **kwargs}
    with pytest.raises(error, match=match):
        replay(**kwargs)


@pytest.mark.parametrize("policy", ["lru", "lfu", "adaptive"])
def test_padding_takes_no_row_as_in_a_cache_with_that_padding_id(policy, planner):
    # Multi-hot bags padded with -1, one step all padding: the replay counts
    # what a training cache of that padding id counts. (The device planner
    # makes the host planner's plans; one policy of it is enough here.)
    if planner == "device" and policy != "adaptive":
        pytest.skip("the device planner's padding is checked with the adaptive policy")
    rng = np.random.default_rng(3)
    trace = rng.zipf(1.2, size=(24, 30)) % 400
    trace[rng.random(trace.shape) < 0.4] = -1
    trace[7] = -1
    out = sweep(
        trace,
        capacities=[40, 90],
        policies=[policy],
        padding_id=-1,
        planner=planner,
        num_embeddings=400,
    )
    for result in out:
        cfg = jaxcache.CacheConfig(
            400, 2, capacity=result["capacity"], policy=policy, padding_id=-1
        )
        cache = jaxcache.EmbeddingCache(cfg, planner=planner)
        state = cache.init_state()
        for ids in trace:
            state, _ = cache.prepare(state, ids.reshape(6, 5))
        total = cache.stats.total
        assert result["num_embeddings"] == 400 and result["lookups"] == total.lookups
        assert (result["distinct"], result["hits"]) == (total.distinct, total.hits)
        assert (result["rows_fetched"], result["evictions"]) == (total.misses, total.evictions)
    tier = jaxcache.sizing.replay_dram_tier(
        trace,
        capacity=40,
        dram_budget=12 * 400 + 60 * 8,
        row_bytes=8,
        policy=policy,
        padding_id=-1,
    )
    assert tier["dram_lookups"] == out[0]["rows_fetched"] + out[0]["rows_warmed"]


@pytest.fixture
def files(tmp_path):
    np.save(tmp_path / "trace.npy", HAND_TRACE)
    np.save(tmp_path / "padded.npy", np.stack([HAND_TRACE, np.full(10, -1)], 1).reshape(5, 4))
    np.save(tmp_path / "float.npy", HAND_TRACE.astype(np.float32))
    np.save(tmp_path / "rank3.npy", HAND_TRACE[:8].reshape(2, 2, 2))
    np.save(tmp_path / "short_counts.npy", np.ones(2, np.int64))
    np.save(tmp_path / "float_counts.npy", np.ones(3))
    np.savez(tmp_path / "archive.npz", ids=HAND_TRACE)
    (tmp_path / "text.npy").write_text("0 1 2")
    return tmp_path


def run_main(argv, files):
    return main([arg.format(d=files) for arg in argv])


def test_cli_prints_one_json_object_per_run(files, capsys):
    argv = [
        "replay",
        "{d}/trace.npy",
        "--batch",
        "2",
        "--sweep",
        "2,3",
        "--policy",
        "lru,frequency",
    ]
    assert run_main(argv, files) == 0
    lines = capsys.readouterr().out.splitlines()
    results = [json.loads(line) for line in lines]
    assert [(r["policy"], r["capacity"]) for r in results] == [
        ("lru", 2),
        ("lru", 3),
        ("frequency", 2),
        ("frequency", 3),
    ]
    assert results[0] == replay(HAND_TRACE, batch=2, capacity=2, policy="lru")


def test_cli_replays_a_padded_trace(files, capsys):
    # Each step's two ids, then two padding ids: the same counts as without.
    argv = ["replay", "{d}/padded.npy", "--capacity", "2", "--policy", "lru", "--padding-id", "-1"]
    assert run_main(argv, files) == 0
    (result,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert result == replay(HAND_TRACE, batch=2, capacity=2, policy="lru")


def test_a_sweep_marks_capacities_below_a_batchs_distinct_ids_and_goes_on(files, capsys):
    # Batches of 2 ids: capacity 1 can hold no batch of 2 distinct ids.
    assert run_main(["replay", "{d}/trace.npy", "--batch", "2", "--sweep", "3,1,2"], files) == 0
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["capacity"], r["feasible"]) for r in results] == [(3, True), (1, False), (2, True)]
    assert results[1]["infeasible"] == (
        "batch 0 of the trace: the batch has 2 distinct ids but capacity is 1 rows; raise "
        "capacity to at least 2 or use smaller batches."
    )
    assert results[1]["lookups"] == results[0]["lookups"] == HAND_TRACE.size
    assert results[2] == replay(HAND_TRACE, batch=2, capacity=2, policy="adaptive")
    # Every policy, Belady's too; the curve leaves the point out; replay() refuses it.
    both = sweep(HAND_TRACE, batch=2, capacities=[1, 2], policies=["lru", "belady"])
    assert [r["feasible"] for r in both] == [False, True, False, True]
    assert len(plot_curve(both).axes[0].lines[0].get_xdata()) == 1
    with pytest.raises(ValueError, match="no capacity of the results is feasible"):
        plot_curve(both[::2])
    with pytest.raises(jaxcache.CapacityError, match="batch 0 of the trace: the batch has 2"):
        replay(HAND_TRACE, batch=2, capacity=1, policy="lru")


def test_cli_plot_writes_a_png(files, capsys):
    argv = ["replay", "{d}/trace.npy", "--batch", "2", "--sweep", "2,3", "--plot", "{d}/curve.png"]
    assert run_main(argv, files) == 0
    png = (files / "curve.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000


def test_plot_curve_labels_axes():
    curve = sweep(HAND_TRACE, batch=2, capacities=[2, 3], policies=["lru", "lfu", "belady"])
    fig = plot_curve(curve, title="hand trace")
    ceiling = [line for line in fig.axes[1].lines if line.get_label() == "belady (optimum)"]
    assert len(ceiling) == 1 and ceiling[0].get_linestyle() == "--"
    assert fig.get_suptitle() == "hand trace"
    large = sweep(np.arange(3000) % 7, batch=1500, capacities=[7], policies=["lru"])
    assert plot_curve(large).get_suptitle() == "Cache replay: 3,000 lookups in 2 batches"
    assert [ax.get_ylabel() for ax in fig.axes] == [
        "hit rate (distinct ids)",
        "miss ratio (distinct ids)",
    ]
    assert all(ax.get_xlabel() == "capacity (rows of 3)" for ax in fig.axes)


BAD_INPUT = [
    (["{d}/missing.npy", "--batch", "2", "--capacity", "2"], "argument trace: no such file"),
    (["{d}/float.npy", "--batch", "2", "--capacity", "2"], "dtype float32; convert it"),
    (["{d}/rank3.npy", "--capacity", "2"], "argument trace: trace must be 1-D"),
    (["{d}/archive.npz", "--batch", "2", "--capacity", "2"], "is an .npz archive"),
    (["{d}/text.npy", "--batch", "2", "--capacity", "2"], "as a .npy array (no .npy header)"),
    (["{d}/trace.npy", "--capacity", "2"], "argument --batch: batch is needed"),
    (["{d}/trace.npy", "--batch", "0", "--capacity", "2"], "positive whole number, got '0'"),
    (
        ["{d}/trace.npy", "--batch", "4", "--capacity", "2"],
        "argument --capacity: batch 0 of the trace: the batch has 3 distinct ids but capacity "
        "is 2 rows; raise capacity to at least 3 or use smaller batches.",
    ),
    (["{d}/trace.npy", "--batch", "2", "--capacity", "abc"], "a fraction of the table such as"),
    (["{d}/trace.npy", "--batch", "2", "--capacity", "9"], "larger than the table"),
    (["{d}/trace.npy", "--batch", "2", "--capacity", "1.5"], "neither a fraction in (0, 1]"),
    (["{d}/trace.npy", "--batch", "2", "--capacity", "2", "--policy", "fifo"], "'fifo'; use one"),
    (
        ["{d}/trace.npy", "--batch", "2", "--capacity", "2", "--num-embeddings", "2"],
        "argument --num-embeddings: num_embeddings=2 is too small",
    ),
    (
        ["{d}/trace.npy", "--batch", "2", "--capacity", "2", "--frequencies", "{d}/no.npy"],
        "argument --frequencies: no such file",
    ),
    (
        [
            "{d}/trace.npy",
            "--batch",
            "2",
            "--capacity",
            "2",
            "--frequencies",
            "{d}/short_counts.npy",
        ],
        "argument --frequencies: frequencies has 2 counts",
    ),
    (
        [
            "{d}/trace.npy",
            "--batch",
            "2",
            "--capacity",
            "2",
            "--frequencies",
            "{d}/float_counts.npy",
        ],
        "argument --frequencies: frequencies must be an integer array",
    ),
    (
        ["{d}/trace.npy", "--batch", "2", "--capacity", "2", "--plot", "{d}/no/curve.png"],
        "argument --plot: no such folder",
    ),
    (
        ["{d}/trace.npy", "--batch", "2", "--capacity", "2", "--plot", "{d}/"],
        "is a folder; give a file in it",
    ),
    (
        ["{d}/trace.npy", "--batch", "2", "--capacity", "2", "--plot", "{d}/curve.xyz"],
        "matplotlib cannot write",
    ),
    (["{d}/trace.npy", "--batch", "2", "--capacity", "nan"], "a fraction of the table such as"),
    (
        ["{d}/trace.npy", "--batch", "2", "--capacity", "2", "--padding-id", str(2**63)],
        "argument --padding-id: padding_id=9223372036854775808 must be an int64 id",
    ),
    (
        ["{d}/trace.npy", "--batch", "2", "--capacity", "2", "--padding-id", "0"],
        "argument --padding-id: padding_id=0 is a real row id",
    ),
    (
        ["{d}/trace.npy", "--batch", "2", "--sweep", "2,3", "--padding-id", "0"],
        "argument --padding-id: padding_id=0 is a real row id",
    ),
    (["{d}/padded.npy", "--capacity", "2"], "argument trace: trace holds -1 at index (0, 1)"),
    (["{d}/trace.npy", "--batch", "2", "--capacity", "inf"], "a fraction of the table such as"),
    (
        ["{d}/trace.npy", "--batch", "2", "--capacity", "2", "--dram-budget", "infG"],
        "expected a byte count such as 512M",
    ),
    (
        ["{d}/trace.npy", "--batch", "2", "--capacity", "2", "--dram-budget", "nanG"],
        "expected a byte count such as 512M",
    ),
]


@pytest.mark.parametrize(("argv", "message"), BAD_INPUT)
def test_cli_bad_input_exits_2_with_a_message(files, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        run_main(["replay", *argv], files)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing replayed or printed before the error
    assert message in captured.err
    assert "Traceback" not in captured.err
    assert "allow_pickle" not in captured.err  # never advise loading pickles


def test_cli_names_a_table_too_large_to_replay(tmp_path, capsys):
    # The largest id sets the table's size: 10^15 rows cannot be replayed.
    path = tmp_path / "huge.npy"
    np.save(path, np.array([[1, 10**15]], dtype=np.int64))
    with pytest.raises(SystemExit) as exit_info:
        main(["replay", str(path), "--batch", "1", "--capacity", "2"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert f"a table of {10**15 + 1} rows needs more memory" in err, err
    # Ids near 2**63 make a table no array can even address.
    np.save(path, np.array([[1, 2**63 - 1]], dtype=np.int64))
    np.save(small := tmp_path / "small.npy", np.array([[1, 2]], dtype=np.int64))
    for trace, size in (
        (path, ["--capacity", "2"]),
        (path, ["--sweep", "2,3"]),
        (small, ["--capacity", "2", "--num-embeddings", str(2**62)]),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["replay", str(trace), "--batch", "1", *size])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "Traceback" not in err
        assert "argument trace: a table of" in err and "jaxcache vocabulary" in err, err


def test_console_script_runs(files):
    command = [sys.executable, "-m", "jaxcache._src.cli", "replay", str(files / "trace.npy")]
    done = subprocess.run(
        [*command, "--batch", "2", "--capacity", "2", "--policy", "lru"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == replay(HAND_TRACE, batch=2, capacity=2, policy="lru")


@pytest.mark.parametrize(
    ("default", "policy"), [("zeros", "lru"), ("shared", "lfu"), ("zeros", "adaptive")]
)
def test_vocabulary_replay_predicts_what_training_with_raw_ids_does(
    tmp_path, capsys, default, policy
):
    # The counts of a replay with no model equal the statistics of a cache
    # that trains on the same raw ids: rows given, forgotten, refused, hits
    # (with a shared row, that row's too). A row given to a new id counts
    # that id's lookups only: the replay's lfu and adaptive counts kept the
    # forgotten id's, and evicted other rows than training does.
    from tests.test_raw_ids import PAD, config, raw_batches

    batches = [ids for ids, _ in raw_batches(12, seed=4)]
    cfg = config(130, 70, jaxcache.sgd(0.1), policy=policy, admit_after=2, default=default)
    cache = jaxcache.EmbeddingCache(cfg)
    state = cache.init_state()
    for ids in batches:
        state, _ = cache.prepare(state, ids)
    total = cache.stats.total
    out = jaxcache.sizing.replay_vocabulary(
        np.stack([ids.reshape(-1) for ids in batches]),
        rows=130,
        vocabulary=cfg.vocabulary,
        capacity=70,
        policy=policy,
        padding_id=PAD,
    )
    assert out["forgotten_ids"] > 20 and out["refused_lookups"] > 100
    assert total.evictions > 20  # the device cache evicts by the policy's counts
    assert (out["new_ids"], out["forgotten_ids"], out["refused_lookups"]) == (
        total.new_ids,
        total.forgotten_ids,
        total.refused_lookups,
    )
    assert out["rows_fetched"] == total.misses
    assert out["unique_hit_rate"] == pytest.approx(total.hits / total.distinct)
    assert out["live_ids"] == cache.vocabulary.size
    # The command line prints the same.
    path = tmp_path / "raw.npy"
    np.save(path, np.stack([ids.reshape(-1) for ids in batches]))
    args = ["vocabulary", str(path), "--rows", "130", "--admit-after", "2", "--capacity", "70"]
    args += ["--policy", policy, "--padding-id", str(PAD), "--default", default, "--protect", "0"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out) == out


def test_vocabulary_replay_learns_the_bonus_a_cache_learns(tmp_path, capsys):
    # forget="adaptive": the replay's learner sees the batches the cache's
    # does, so it forgets the same ids and ends on the same bonus.
    from tests.test_raw_ids import PAD, config, drift_batches

    batches = [ids for ids, _ in drift_batches(12, seed=4)]
    cfg = config(200, 130, jaxcache.sgd(0.1), policy="lru", forget="adaptive")
    cache = jaxcache.EmbeddingCache(cfg)
    state = cache.init_state()
    for ids in batches:
        state, _ = cache.prepare(state, ids)
    trace = np.stack([ids.reshape(-1) for ids in batches])
    out = jaxcache.sizing.replay_vocabulary(
        trace, rows=200, vocabulary=cfg.vocabulary, padding_id=PAD
    )
    assert out["bonus"] == cache.vocabulary.bonus == 0
    assert (out["new_ids"], out["forgotten_ids"]) == (
        cache.stats.total.new_ids,
        cache.stats.total.forgotten_ids,
    )
    path = tmp_path / "raw.npy"
    np.save(path, trace)
    args = ["vocabulary", str(path), "--rows", "200", "--padding-id", str(PAD), "--protect", "0"]
    assert main([*args, "--forget", "adaptive"]) == 0
    assert json.loads(capsys.readouterr().out) == out


@pytest.mark.parametrize("default", ["zeros", "shared"])
def test_the_budget_to_forget_nothing_forgets_nothing_and_one_less_does(default):
    # With a shared row the ids have one row fewer than the budget.
    rng = np.random.default_rng(5)
    trace = rng.integers(-(2**62), 2**62, 40)[rng.integers(0, 40, (20, 6))]
    vocabulary = jaxcache.DynamicVocabulary(protect=0, default=default)
    need = jaxcache.sizing.replay_vocabulary(trace, rows=100, vocabulary=vocabulary)
    need = need["rows_to_forget_nothing"]
    enough = jaxcache.sizing.replay_vocabulary(trace, rows=need, vocabulary=vocabulary)
    short = jaxcache.sizing.replay_vocabulary(trace, rows=need - 1, vocabulary=vocabulary)
    assert enough["forgotten_ids"] == 0 < short["forgotten_ids"]


def test_vocabulary_replay_names_the_batch_its_cache_cannot_hold():
    trace = np.concatenate([np.zeros((1, 7), np.int64), np.arange(7)[None]])
    with pytest.raises(jaxcache.CapacityError, match=r"^batch 1: the batch has 7 distinct ids"):
        jaxcache.sizing.replay_vocabulary(trace, rows=64, capacity=3, policy="lru")


@pytest.mark.parametrize("pad", [2**63, -(2**63) - 1, 1.5])
def test_vocabulary_replay_refuses_a_padding_id_past_int64(tmp_path, capsys, pad):
    trace = np.array([[2**63 - 1, 2**63 - 2, 5]])
    with pytest.raises(ValueError, match=rf"padding_id={pad!r} must be an int64 id"):
        jaxcache.sizing.replay_vocabulary(trace, rows=8, padding_id=pad)
    if isinstance(pad, int):
        path = tmp_path / "raw.npy"
        np.save(path, trace)
        with pytest.raises(SystemExit) as exit_:
            main(["vocabulary", str(path), "--rows", "8", "--padding-id", str(pad)])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "argument --padding-id: " in err
        assert "must be an int64 id" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--forget", "lrfu", "--bonus", "999"], "argument --bonus: bonus=999 must be an integer"),
        # Every vocabulary error was blamed on --bonus.
        (["--ways", "1"], "argument --ways: ways=1 must be an integer of at least 2"),
        # Flags that changed nothing were ignored.
        (["--bonus", "4"], "argument --bonus: it sets --forget \"lrfu\", not 'lru'"),
        (["--policy", "lfu"], "argument --policy: it is the device cache's, which --capacity"),
    ],
)
def test_vocabulary_replay_names_the_flag_of_a_bad_vocabulary(tmp_path, capsys, flags, message):
    path = tmp_path / "raw.npy"
    np.save(path, np.arange(40, dtype=np.int64).reshape(4, 10))
    with pytest.raises(SystemExit) as exit_:
        main(["vocabulary", str(path), "--rows", "30", *flags])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_vocabulary_command_offers_only_policies_raw_ids_can_take(tmp_path, capsys):
    # "frequency" ranks rows by dataset counts, which a trace of raw ids has not.
    path = tmp_path / "raw.npy"
    np.save(path, np.arange(40, dtype=np.int64) * 7919)
    with pytest.raises(SystemExit) as exit_info:
        main(["vocabulary", str(path), "--rows", "64", "--batch", "8", "--policy", "frequency"])
    assert exit_info.value.code == 2
    assert "argument --policy: invalid choice: 'frequency'" in capsys.readouterr().err
    assert main(["vocabulary", str(path), "--rows", "64", "--batch", "8", "--capacity", "16"]) == 0


def test_vocabulary_command_names_batch_for_a_flat_trace(tmp_path, capsys):
    # As `jaxcache replay` does: the usage error names the flag to add, not the trace.
    path = tmp_path / "raw.npy"
    np.save(path, np.arange(40, dtype=np.int64) * 7919)
    with pytest.raises(SystemExit) as exit_info:
        main(["vocabulary", str(path), "--rows", "64"])
    assert exit_info.value.code == 2
    assert "argument --batch: a 1-D trace" in capsys.readouterr().err


def test_vocabulary_command_rounds_a_capacity_fraction_up_as_a_cache_does(tmp_path, capsys):
    path = tmp_path / "raw.npy"
    np.save(path, np.zeros(40, dtype=np.int64))  # one distinct id a batch
    assert (
        main(["vocabulary", str(path), "--rows", "40", "--batch", "8", "--capacity", "0.01"]) == 0
    )
    printed = json.loads(capsys.readouterr().out)
    expected = jaxcache.sizing.replay_vocabulary(np.zeros((5, 8), np.int64), rows=40, capacity=0.01)
    assert printed == expected and jaxcache.CacheConfig(40, 1, capacity=0.01).capacity == 1
    assert main(["vocabulary", str(path), "--rows", "40", "--batch", "8", "--capacity", "2.0"]) == 0
    two = jaxcache.sizing.replay_vocabulary(np.zeros((5, 8), np.int64), rows=40, capacity=2)
    assert json.loads(capsys.readouterr().out) == two


def test_vocabulary_command_takes_every_forgetting_rule(tmp_path, capsys):
    # --forget, --bonus, --ttl, --ways and --protect reach the vocabulary the
    # command replays: it prints what the Python API says for the same rules.
    from tests.test_raw_ids import PAD, raw_batches

    trace = np.stack([ids.reshape(-1) for ids, _ in raw_batches(12, seed=4)])
    path = tmp_path / "raw.npy"
    np.save(path, trace)
    vocabulary = jaxcache.DynamicVocabulary(forget="lrfu", bonus=2, ttl=3, ways=16, protect=1)
    expected = jaxcache.sizing.replay_vocabulary(
        trace, rows=600, vocabulary=vocabulary, padding_id=PAD
    )
    assert expected["forgotten_ids"] > 0
    args = ["vocabulary", str(path), "--rows", "600", "--padding-id", str(PAD)]
    args += ["--forget", "lrfu", "--bonus", "2", "--ttl", "3", "--ways", "16", "--protect", "1"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out) == expected
    assert main([*args[:6], "--forget", "lru"]) == 0  # another rule, another count
    assert json.loads(capsys.readouterr().out) != expected


@pytest.mark.parametrize(
    ("options", "blamed", "words"),
    [
        (["--rows", "30", "--capacity", "40"], "--capacity", "40 is not a cache of 1 to 30 rows"),
        (["--rows", "30", "--capacity", "1.5"], "--capacity", "1.5 is not a cache of 1 to 30 rows"),
        (["--rows", "30", "--capacity", "nan"], "--capacity", "a fraction of the table such as"),
        (["--rows", "1", "--default", "shared"], "--rows", "1 must be in [2, 2^31 - 1] (one"),
        (["--rows", str(2**40)], "--rows", f"{2**40} must be in [1, 2^31 - 1]"),
        (["--rows", "8"], "--rows", "batch 0: the batch has 10 new ids to admit but only 8"),
        (["--rows", "30", "--capacity", "5"], "--capacity", "the batch has 10 distinct ids"),
    ],
)
def test_vocabulary_command_blames_the_option_to_change(tmp_path, capsys, options, blamed, words):
    path = tmp_path / "raw.npy"
    np.save(path, np.arange(40, dtype=np.int64).reshape(4, 10))
    with pytest.raises(SystemExit) as exit_:
        main(["vocabulary", str(path), *options])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {blamed}: " in err and words in err, err


def test_vocabulary_replay_counts_the_ids_ttl_forgot():
    # ttl=1 keeps the ids of the last two steps (18, 12); 11 and 12 come back
    # to rows of their own (counted forgotten, then new again); the other
    # six ids expired with their rows left free.
    trace = np.array([[11], [12], [13], [14], [15], [11], [16], [17], [18], [12]])
    spec = jaxcache.DynamicVocabulary(ttl=1, protect=0)
    out = jaxcache.sizing.replay_vocabulary(trace, rows=1024, vocabulary=spec)
    counts = {k: out[k] for k in ("new_ids", "forgotten_ids", "live_ids", "expired_ids")}
    assert counts == {"new_ids": 10, "forgotten_ids": 2, "live_ids": 2, "expired_ids": 6}
