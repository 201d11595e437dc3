"""Checkpoints: exact resume across a killed process, crash safety, other capacities, export."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxcache
from jaxcache._src.table_record import SavedTable
from tests.models import Tower, bce, failing_transfer, host_planners, zipf_batches

# Every test here runs with both planners (``conftest.planner``).
pytestmark = pytest.mark.usefixtures("planner")

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESUME = ROOT / "examples" / "resume.py"
N, D, B, F = 3000, 8, 16, 3


# --------------------------------------------------------- across processes
def _resume(directory, *args):
    argv = [sys.executable, str(RESUME), "--checkpoint-dir", str(directory)]
    argv += ["--steps", "16", "--batch-size", "32", *args]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(process):
    out, err = process.communicate(timeout=300)
    return process.returncode, out, err


# Each planner resumes the default policy and one other across processes; the
# restores in process below cover every policy with either planner.
_POLICIES_ACROSS_PROCESSES = {"host": ("adaptive", "lru"), "device": ("adaptive", "lfu")}


@pytest.mark.slow
def test_resume_after_sigkill_is_bit_exact(tmp_path, planner):
    """One process trains 16 steps; another is killed right after its checkpoint at
    step 8 and a third resumes from it: same losses, table, row state, dense
    parameters and optax state, bit for bit, with the pipeline on (look-ahead 2)."""
    policies = _POLICIES_ACROSS_PROCESSES[planner]
    runs = {}
    for policy in policies:
        common = ("--policy", policy, "--lookahead", "2")
        whole = tmp_path / f"{policy}-whole"
        split = tmp_path / f"{policy}-split"
        runs[policy] = (
            _resume(whole, *common, "--every", "16", "--dump", f"{whole}.npz"),
            _resume(split, *common, "--every", "8", "--kill-at", "8"),
            split,
            common,
        )
    resumed = {}
    for policy, (whole, killed, split, common) in runs.items():
        code, _, err = _finish(whole)
        assert code == 0, err
        code, out, err = _finish(killed)
        assert code == -signal.SIGKILL, (code, err)
        assert "step 8: loss" in out and "step 16" not in out
        resumed[policy] = _resume(split, *common, "--every", "8", "--dump", f"{split}.npz")
    for policy, process in resumed.items():
        code, out, err = _finish(process)
        assert code == 0, err
        assert "restored step 8: continuing from batch 8" in out
        whole = np.load(tmp_path / f"{policy}-whole.npz")
        split = np.load(tmp_path / f"{policy}-split.npz")
        assert len(whole["losses"]) == 16
        for key in whole.files:
            if key.startswith(("rows", "state.", "model.", "optimizer.", "losses")):
                np.testing.assert_array_equal(split[key], whole[key], err_msg=f"{policy} {key}")
        assert np.abs(whole["rows"]).sum() > 0 and len(whole.files) > 10


# ----------------------------------------------------------------- in process
def _model(cache, seed=0):
    model = Tower(jaxcache.nnx.CachedEmbed(cache), F, D, seed=seed)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    return model, optimizer


@nnx.jit
def _train_step(model, optimizer, lookup, labels):
    def loss_fn(model, lookup):
        return bce(model(lookup), labels)

    loss, grads = jaxcache.nnx.value_and_grad(loss_fn)(model, lookup)
    optimizer.update(model, grads)
    return loss


def _cache(policy="lfu", capacity=120, seed=1, optimizer=None, **kwargs):
    config = jaxcache.CacheConfig(
        N,
        D,
        capacity=capacity,
        policy=policy,
        optimizer=optimizer or jaxcache.adagrad(0.2),
        **kwargs,
    )
    frequencies = None
    if policy == "frequency":
        frequencies = jaxcache.FrequencyCounter(N).update_all(i for i, _ in _data(4)).counts
    return jaxcache.EmbeddingCache(config, frequencies=frequencies, seed=seed)


def _data(steps, start=0):
    return list(zipf_batches(N, B, F, start + steps, seed=5))[start:]


def _train(model, optimizer, batches, lookahead=0):
    items = [{"ids": ids, "y": y} for ids, y in batches]
    with jaxcache.prefetch(items, {"ids": model.embed}, lookahead=lookahead) as pipeline:
        return [float(_train_step(model, optimizer, b["ids"], b["y"])) for b in pipeline]


_DENSE = nnx.Not(nnx.Any(jaxcache.nnx.CacheRows, jaxcache.nnx.CacheOptState))


def _dense(node):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(node, _DENSE))]


def _assert_same_values(a, b):
    (model_a, opt_a), (model_b, opt_b) = a, b
    rows_a, state_a = model_a.embed.export()
    rows_b, state_b = model_b.embed.export()
    np.testing.assert_array_equal(rows_a, rows_b)
    for name in state_a:
        np.testing.assert_array_equal(state_a[name], state_b[name])
    for x, y in zip(_dense(model_a) + _dense(opt_a), _dense(model_b) + _dense(opt_b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("policy", jaxcache.planning.POLICIES)
def test_restore_continues_exactly_with_the_same_cache_state(tmp_path, policy):
    """Unpipelined, the cache's choices are deterministic: the restored cache makes
    the same ones as the one that kept going (slots, recency, counts, statistics)."""
    first, second = _data(10), _data(10, start=10)
    original = _model(_cache(policy))
    _train(*original, first)
    checkpointer = jaxcache.Checkpointer(tmp_path)
    checkpointer.save(10, model=original[0], optimizer=original[1], extra={"note": "x"})
    restored = _model(_cache(policy, seed=9), seed=3)  # other initial values
    info = checkpointer.restore(model=restored[0], optimizer=restored[1])
    assert info == jaxcache.checkpoint.CheckpointInfo(10, 10, {"note": "x"}, ("embedding",))
    losses = _train(*original, second)
    assert _train(*restored, second) == losses
    _assert_same_values(original, restored)
    a, b = original[0].embed.cache, restored[0].embed.cache
    for pa, pb in zip(host_planners(a), host_planners(b), strict=True):
        for name in ("id_of_slot", "last_use", "slot_of_id"):
            np.testing.assert_array_equal(getattr(pa, name), getattr(pb, name))
        state_a, state_b = pa.policy.state_dict(), pb.policy.state_dict()
        assert sorted(state_a) == sorted(state_b)
        for key in state_a:  # counts, and the adaptive policy's shadows and choice
            np.testing.assert_array_equal(state_a[key], state_b[key], err_msg=key)
        if policy == "adaptive":
            np.testing.assert_array_equal(pa.policy.keys, pb.policy.keys)
    assert a.stats.as_dict() | {"compilations": 0} == b.stats.as_dict() | {"compilations": 0}
    assert a.stats.total.evictions > 50  # rows really moved


@dataclasses.dataclass(frozen=True)
class ClippedAdagrad(jaxcache.SparseOptimizer, name="tests.clipped_adagrad"):
    """A user-defined optimizer with per-row state: row-wise Adagrad on clipped gradients."""

    clip: float = 1.0

    def state_spec(self, features):
        return {"accumulator": jaxcache.optimizers.RowStateSpec((), np.dtype(np.float32), 0.1)}

    def update(self, rows, grads, state):
        g = jnp.clip(grads, -self.clip, self.clip)
        acc = state["accumulator"] + jnp.mean(g * g, axis=-1)
        return rows - self.learning_rate * g / jnp.sqrt(acc)[:, None], {"accumulator": acc}


def test_a_user_defined_optimizer_is_rebuilt_through_the_registry(tmp_path):
    first, second = _data(6), _data(6, start=6)
    original = _model(_cache("lfu", optimizer=ClippedAdagrad(0.3, clip=0.05)))
    _train(*original, first)
    checkpointer = jaxcache.Checkpointer(tmp_path)
    checkpointer.save(6, model=original[0], optimizer=original[1])
    config = checkpointer.cache_config()
    assert config == original[0].embed.cache.config
    assert type(config.optimizer) is ClippedAdagrad
    restored = _model(jaxcache.EmbeddingCache(config, seed=9), seed=3)
    checkpointer.restore(model=restored[0], optimizer=restored[1])
    a, b = original[0].embed.cache, restored[0].embed.cache
    np.testing.assert_array_equal(a.planner.id_of_slot, b.planner.id_of_slot)  # exact
    assert a.stats.total == b.stats.total
    assert _train(*restored, second) == _train(*original, second)
    _assert_same_values(original, restored)
    # The registered name and the hyperparameters are what the table records.
    path = tmp_path / "6" / "tables" / "embedding" / "table.json"
    record = json.loads(path.read_text())
    saved = record["config"]["optimizer"]
    assert saved == {"type": "tests.clipped_adagrad", "learning_rate": 0.3, "clip": 0.05}
    saved["type"] = "tests.nowhere"
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"'tests\.nowhere', which is not registered.*name="):
        checkpointer.cache_config()


def test_a_config_that_json_cannot_rebuild_is_refused_before_saving(tmp_path):
    embed = jaxcache.nnx.CachedEmbed(_cache("lru", optimizer=ClippedAdagrad(0.3, clip=(1, 2))))
    checkpointer = jaxcache.Checkpointer(tmp_path)
    with pytest.raises(ValueError, match="cannot be saved as JSON and rebuilt"):
        checkpointer.save(1, caches=[embed])
    assert checkpointer.steps() == []


def test_numpy_scalars_in_a_config_are_saved_as_the_numbers_they_hold(tmp_path):
    # Sizes computed with NumPy (``ids.max() + 1``) are what a user passes.
    ids = np.array([[3, 17], [999, 17]])
    vocabulary = jaxcache.DynamicVocabulary(forget="lrfu", bonus=np.int64(3), scale=np.float32(0.5))
    configs = {
        "rows": jaxcache.CacheConfig(
            ids.max() + 1, np.int64(4), capacity=np.float32(0.5), padding_id=np.int32(-1)
        ),
        "raw": jaxcache.CacheConfig(np.int64(64), 4, capacity=8, vocabulary=vocabulary, name="raw"),
    }
    for config in configs.values():
        assert all(not isinstance(v, np.generic) for v in dataclasses.asdict(config).values())
    assert configs["rows"] == jaxcache.CacheConfig(1000, 4, capacity=500, padding_id=-1)
    embeds = [jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(c)) for c in configs.values()]
    for embed in embeds:
        embed.prepare(ids)
    checkpointer = jaxcache.Checkpointer(tmp_path)
    checkpointer.save(1, caches=embeds)
    for name, config in configs.items():
        assert checkpointer.cache_config(config.name) == config, name


def test_keeps_the_last_checkpoints_and_lists_them(tmp_path):
    embed = jaxcache.nnx.CachedEmbed(_cache())
    checkpointer = jaxcache.Checkpointer(tmp_path, max_to_keep=2)
    assert checkpointer.latest_step() is None
    for step in range(1, 5):
        embed.prepare(np.arange(step, step + 4))
        checkpointer.save(step * 10, caches=[embed], batches_consumed=step)
    assert checkpointer.steps() == [30, 40]
    assert checkpointer.info().batches_consumed == 4
    assert sorted(os.listdir(tmp_path)) == ["30", "40"]
    with pytest.raises(ValueError, match="step 40 is already saved"):
        checkpointer.save(40, caches=[embed])
    with pytest.raises(ValueError, match="step 35 is older than the latest saved step 40"):
        checkpointer.save(35, caches=[embed])
    assert checkpointer.steps() == [30, 40]
    with pytest.raises(FileNotFoundError, match=r"saved steps: \[30, 40\]"):
        checkpointer.restore(10, caches=[embed])


@pytest.mark.parametrize("capacity", [40, 400])
def test_restore_onto_another_capacity_warms_the_hottest_rows(tmp_path, capacity):
    batches = _data(12)
    original = _model(_cache("lfu"))
    _train(*original, batches[:8])
    saved = original[0].embed.cache
    before = saved.planner.resident_ids()
    jaxcache.Checkpointer(tmp_path).save(8, model=original[0], optimizer=original[1])
    restored = _model(_cache("lfu", capacity=capacity))
    jaxcache.Checkpointer(tmp_path).restore(model=restored[0], optimizer=restored[1])
    cache = restored[0].embed.cache
    counts = cache.planner.policy_state()["counts"]
    np.testing.assert_array_equal(counts, saved.planner.policy_state()["counts"])
    resident = cache.planner.resident_ids()
    if capacity < before.size:  # the hottest of the rows that were resident
        assert resident.size == capacity and np.isin(resident, before).all()
        left_out = before[~np.isin(before, resident)]
        assert counts[resident].min() >= counts[left_out].max()
    else:  # all of them, then the hottest others
        assert np.isin(before, resident).all() and resident.size > before.size
    assert cache.stats.steps == 0  # another cache: its own statistics
    jaxcache.testing.check_invariants(cache)
    assert _train(*restored, batches[8:]) == _train(*original, batches[8:])
    _assert_same_values(original, restored)


def test_restore_onto_two_devices(tmp_path):
    """Saved from one device, restored onto a cache split over two (another process)."""
    batches = _data(6)
    original = _model(_cache("lru", capacity=64))
    _train(*original, batches[:4])
    jaxcache.Checkpointer(tmp_path / "ckpt").save(4, model=original[0], optimizer=original[1])
    _train(*original, batches[4:])
    rows, _ = original[0].embed.export()
    np.save(tmp_path / "expected.npy", rows)
    np.savez(tmp_path / "batches.npz", *[x for pair in batches[4:] for x in pair])
    script = f"""
        import jax
        jax.config.update("jax_num_cpu_devices", 2)
        import numpy as np, jaxcache
        from flax import nnx
        from jax.sharding import Mesh, NamedSharding, PartitionSpec
        from tests.test_checkpoint import _DENSE, _model, _train, _cache
        mesh = Mesh(np.array(jax.devices()), ("rows",))
        cache = jaxcache.EmbeddingCache(_cache("lru", capacity=64).config, mesh=mesh)
        model, optimizer = _model(cache, seed=4)
        for node in (model, optimizer):  # dense state replicated over the two devices
            state = nnx.state(node, _DENSE)
            nnx.update(node, jax.device_put(state, NamedSharding(mesh, PartitionSpec())))
        jaxcache.Checkpointer("{tmp_path / "ckpt"}").restore(model=model, optimizer=optimizer)
        saved = np.load("{tmp_path / "batches.npz"}")
        arrays = [saved[f"arr_{{i}}"] for i in range(len(saved.files))]
        _train(model, optimizer, list(zip(arrays[::2], arrays[1::2])))
        rows, _ = model.embed.export()
        np.testing.assert_allclose(rows, np.load("{tmp_path / "expected.npy"}"), atol=1e-6)
        print("devices", cache.devices)
    """
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "devices 2" in out.stdout


@pytest.mark.host_planner
@pytest.mark.parametrize("saved_split, restored_split", [(4, 4), (1, 4), (4, 1)])
def test_restore_across_partitions_per_device(tmp_path, saved_split, restored_split):
    """A checkpoint of a cache of one partition per device restores into
    one of four, and back; onto the same split every row goes back to its
    slot and training continues bit for bit."""
    batches = _data(8)
    config = _cache("lfu", capacity=120).config

    def cache(split):
        return jaxcache.EmbeddingCache(config, seed=1, partitions_per_device=split)

    original = _model(cache(saved_split))
    _train(*original, batches[:4], lookahead=2)
    jaxcache.Checkpointer(tmp_path / "ckpt").save(4, model=original[0], optimizer=original[1])
    restored = _model(cache(restored_split), seed=9)
    jaxcache.Checkpointer(tmp_path / "ckpt").restore(model=restored[0], optimizer=restored[1])
    target = restored[0].embed.cache
    assert len(target.planner.planners) == restored_split
    jaxcache.testing.check_invariants(target)
    resident = target.planner.resident_ids()
    saved = original[0].embed.cache.planner.resident_ids()
    if saved_split == restored_split:
        np.testing.assert_array_equal(
            target.planner.id_of_slot, original[0].embed.cache.planner.id_of_slot
        )
    else:  # the hottest of the saved rows that fit each partition
        assert np.isin(resident, saved).all() and resident.size > 0.8 * saved.size
    losses = _train(*restored, batches[4:], lookahead=2)
    expected = _train(*original, batches[4:], lookahead=2)
    if saved_split == restored_split:
        assert losses == expected
        _assert_same_values(original, restored)
    else:
        np.testing.assert_allclose(losses, expected, atol=1e-6)
        rows, _ = restored[0].embed.export()
        np.testing.assert_allclose(rows, original[0].embed.export()[0], atol=1e-6)


def test_export_loads_into_a_plain_nnx_embed_without_jaxcache(tmp_path):
    original = _model(_cache("lru"))
    _train(*original, _data(5))
    checkpointer = jaxcache.Checkpointer(tmp_path / "ckpt")
    checkpointer.save(5, model=original[0], optimizer=original[1])
    paths = checkpointer.export(tmp_path / "export")
    assert list(paths) == ["embedding"]
    ids = np.array([[5, 17, 2999], [0, 5, 1234]])
    script = f"""
        import sys
        import jax.numpy as jnp, numpy as np
        from flax import nnx
        rows = np.load("{paths["embedding"]}")  # plain NumPy: float32, id order
        assert rows.dtype == np.float32 and rows.shape == ({N}, {D})
        embed = nnx.Embed({N}, {D}, rngs=nnx.Rngs(0))
        embed.embedding.set_value(jnp.asarray(rows))
        np.save("{tmp_path / "out.npy"}", embed(np.array({ids.tolist()})))
        assert not any(name.startswith("jaxcache") for name in sys.modules)
    """
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    lookup = original[0].embed.prepare(ids, train=False)
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), original[0].embed(lookup))


def test_bfloat16_rows_export_as_float32(tmp_path):
    cache = _cache("lru", dtype="bfloat16", optimizer=jaxcache.sgd(0.1))
    embed = jaxcache.nnx.CachedEmbed(cache)
    checkpointer = jaxcache.Checkpointer(tmp_path / "ckpt")
    checkpointer.save(1, caches=[embed])
    rows = np.load(checkpointer.export(tmp_path / "export")["embedding"])
    assert rows.dtype == np.float32
    np.testing.assert_array_equal(rows, cache.table.rows.astype(np.float32))
    again = jaxcache.nnx.CachedEmbed(
        _cache("lru", dtype="bfloat16", seed=5, optimizer=jaxcache.sgd(0.1))
    )
    checkpointer.restore(caches=[again])
    np.testing.assert_array_equal(again.cache.table.rows, cache.table.rows)


@pytest.mark.parametrize(
    ("save_mapped", "restore_mapped"), [(True, True), (False, True), (True, False)]
)
def test_memory_mapped_tables_round_trip(tmp_path, save_mapped, restore_mapped):
    def cache(name, mapped, seed):
        config = _cache("lru").config
        directory = tmp_path / name if mapped else None
        table = jaxcache.HostTable(config, seed=seed, directory=directory)
        return jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(config, table=table))

    source = cache("a", save_mapped, 1)
    source.cache.table.state["accumulator"][7] = 3.5
    checkpointer = jaxcache.Checkpointer(tmp_path / "ckpt")
    checkpointer.save(1, caches=[source])
    target = cache("b", restore_mapped, 2)
    checkpointer.restore(caches=[target])
    np.testing.assert_array_equal(target.cache.table.rows, source.cache.table.rows)
    np.testing.assert_array_equal(
        target.cache.table.state["accumulator"], source.cache.table.state["accumulator"]
    )
    if restore_mapped:  # the restored table still is the file it maps
        assert isinstance(target.cache.table.rows, np.memmap)
        on_disk = np.load(tmp_path / "b" / "rows.npy")
        np.testing.assert_array_equal(on_disk, source.cache.table.rows)


def test_typed_rng_keys_round_trip(tmp_path):
    class Noisy(nnx.Module):
        def __init__(self):
            self.dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))
            self.linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    model = Noisy()
    model.dropout(jnp.ones(4))  # advances the stream
    checkpointer = jaxcache.Checkpointer(tmp_path)
    checkpointer.save(1, model=model)
    other = Noisy()
    checkpointer.restore(model=other)
    np.testing.assert_array_equal(model.dropout(jnp.ones(8)), other.dropout(jnp.ones(8)))
    with pytest.raises(ValueError, match=r"has no table 'embedding'; it holds \[\]"):
        checkpointer.restore(caches=[jaxcache.nnx.CachedEmbed(_cache())])


def test_mismatches_are_refused_before_anything_changes(tmp_path):
    original = _model(_cache("lru"))
    _train(*original, _data(3))
    checkpointer = jaxcache.Checkpointer(tmp_path)
    checkpointer.save(3, model=original[0], optimizer=original[1])

    target = _model(_cache("lru", seed=4))
    rows = np.array(target[0].embed.cache.table.rows)
    dense = _dense(target[0])
    wider = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(jaxcache.CacheConfig(N, D + 1, 50)))
    with pytest.raises(ValueError, match="the checkpoint has features=8 but the cache has 9"):
        checkpointer.restore(caches=[wider])
    other_state = _model(_cache("lru", optimizer=jaxcache.adam(0.1)))
    with pytest.raises(ValueError, match="per-row optimizer state"):
        checkpointer.restore(model=other_state[0])
    # Training with sgd from here would silently drop the accumulators.
    stateless = _model(_cache("lru", optimizer=jaxcache.sgd(0.1)))
    with pytest.raises(ValueError, match=r"keeps none; restore with .*'Adagrad'.*serving_config"):
        checkpointer.restore(model=stateless[0])
    bigger = Tower(target[0].embed, F, D, seed=0)
    bigger.hidden = nnx.Linear(F * D, 32, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="model's variables do not match"):
        checkpointer.restore(model=bigger)
    state = {"count": np.zeros(()), "mu": {"w": np.zeros(3)}}  # a TrainState-like pytree
    with pytest.raises(TypeError, match=r"optimizer= takes an nnx\.Optimizer, got dict"):
        checkpointer.restore(model=target[0], optimizer=state)
    with pytest.raises(TypeError, match=r"optimizer= takes an nnx\.Optimizer"):
        checkpointer.save(4, model=target[0], optimizer=state)
    np.testing.assert_array_equal(target[0].embed.cache.table.rows, rows)
    for x, y in zip(_dense(target[0]), dense, strict=True):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="has no table 'users'"):
        checkpointer.restore(caches=[jaxcache.nnx.CachedEmbed(_cache(name="users"))])
    assert checkpointer.cache_config() == original[0].embed.cache.config
    # A row file gone: refused before the planner or any row changes.
    os.remove(tmp_path / "3" / "tables" / "embedding" / "state.accumulator.npy")
    next_index = target[0].embed.cache.planner.next_index
    with pytest.raises(ValueError, match=r"state\.accumulator\.npy is missing"):
        checkpointer.restore(model=target[0])
    assert target[0].embed.cache.planner.next_index == next_index
    np.testing.assert_array_equal(target[0].embed.cache.table.rows, rows)


@pytest.mark.parametrize("name", ["..", ".", "x" * 129, "a/b", "../up"])
def test_a_table_name_that_cannot_name_a_directory_is_refused_when_configured(name):
    # Before any training: a checkpoint names the table's directory by it.
    with pytest.raises(ValueError, match=r"must be 1 to 128 letters, digits, '_', '-' or '\.'"):
        _cache(name=name)


@pytest.mark.parametrize(
    "change", [{"seed": 1}, {"ways": 32}, {"default": "shared"}, {"padding_id": 7919}]
)
def test_raw_ids_restore_only_into_the_vocabulary_that_placed_them(tmp_path, change):
    # The seed and ways place an id in its bucket, the default may take a
    # row: another value would not find the saved ids in their rows. A
    # padding id that is a saved id (7919) would strand its row.
    def embed(padding_id=-1, **fields):
        vocabulary = jaxcache.DynamicVocabulary(**fields)
        return jaxcache.nnx.CachedEmbed(
            _cache(capacity=64, vocabulary=vocabulary, padding_id=padding_id)
        )

    saved = embed()
    saved.prepare(np.arange(40) * 7919)
    checkpointer = jaxcache.Checkpointer(tmp_path)
    checkpointer.save(1, caches=[saved])
    target = embed(**change)
    (field,) = change
    with pytest.raises(ValueError, match=rf"{field}=.*Checkpointer.cache_config"):
        checkpointer.restore(caches=[target])
    assert target.cache.vocabulary.size == 0


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("an id twice", "an id twice"),
        ("two ids one row", "a row given to two ids"),
        ("the padding id", "the padding id -1 as an id"),
        ("fewer rows", "39 ids with 38 rows"),
    ],
)
def test_a_vocabulary_whose_ids_and_rows_do_not_pair_is_refused(tmp_path, damage, message):
    vocabulary = jaxcache.DynamicVocabulary()
    saved = jaxcache.nnx.CachedEmbed(_cache(capacity=64, vocabulary=vocabulary, padding_id=-1))
    saved.prepare(np.arange(1, 40) * 7919)
    jaxcache.Checkpointer(tmp_path).save(1, caches=[saved])
    table = tmp_path / "1" / "tables" / "embedding"
    record = json.loads((table / "table.json").read_text())
    ids, rows = (np.load(table / f"vocabulary.{k}.npy") for k in ("ids", "rows"))
    if damage == "an id twice":
        ids[1] = ids[0]
    elif damage == "two ids one row":
        rows[1] = rows[0]
    elif damage == "the padding id":
        ids[2] = -1
    else:
        rows = rows[:-1]
    for key, array in {"ids": ids, "rows": rows}.items():
        np.save(table / f"vocabulary.{key}.npy", array)
        record["arrays"][f"vocabulary.{key}"].update(shape=list(array.shape), bytes=array.nbytes)
    (table / "table.json").write_text(json.dumps(record))
    target = jaxcache.nnx.CachedEmbed(_cache(capacity=64, vocabulary=vocabulary, padding_id=-1))
    with pytest.raises(ValueError, match=rf"vocabulary lists {message}: its files are damaged"):
        jaxcache.Checkpointer(tmp_path).restore(caches=[target])
    assert target.cache.vocabulary.size == 0
    target.prepare(np.arange(1, 40) * 7919)  # and it trains on as a fresh table


def test_a_corrupt_table_state_is_refused_before_any_table_changes(tmp_path):
    saved = [jaxcache.nnx.CachedEmbed(_cache("lfu", name=name)) for name in ("users", "items")]
    for embed in saved:
        embed.prepare(np.arange(5))
    checkpointer = jaxcache.Checkpointer(tmp_path)
    checkpointer.save(1, caches=saved)
    counts = tmp_path / "1" / "tables" / "items" / "policy.counts.npy"
    np.save(counts, np.load(counts)[:10])  # the second table's counts cut short
    record = counts.parent / "table.json"  # and recorded so: a whole file that does not fit
    meta = json.loads(record.read_text())
    meta["arrays"]["policy.counts"].update(shape=[10], bytes=10 * np.load(counts).itemsize)
    record.write_text(json.dumps(meta))
    targets = [jaxcache.nnx.CachedEmbed(_cache("lfu", name=n, seed=3)) for n in ("users", "items")]
    rows = np.array(targets[0].cache.table.rows)
    with pytest.raises(ValueError, match=r"table 'items': .*counts cover 10 ids but the table"):
        checkpointer.restore(caches=targets)
    np.testing.assert_array_equal(targets[0].cache.table.rows, rows)  # the first one unchanged
    assert targets[0].cache.planner.resident_ids().size == 0


def _saved_and_target(tmp_path):
    """A table saved at step 1 under ``tmp_path`` (30 ids resident), its
    ``Checkpointer``, and a table of the same configuration that planned
    ids of its own: what a restore into it must leave alone or replace."""
    saved = jaxcache.nnx.CachedEmbed(_cache("lru"))
    saved.prepare(np.arange(30))
    checkpointer = jaxcache.Checkpointer(tmp_path)
    checkpointer.save(1, caches=[saved])
    target = jaxcache.nnx.CachedEmbed(_cache("lru", seed=3))
    target.prepare(np.arange(100, 110))
    return saved, checkpointer, target


@pytest.mark.parametrize(
    "damage",
    ["rows cut short", "state cut short", "planner array cut short", "table.json garbled"],
)
def test_a_damaged_file_is_refused_before_the_cache_changes(tmp_path, damage):
    _, checkpointer, target = _saved_and_target(tmp_path)
    table = tmp_path / "1" / "tables" / "embedding"
    file = {
        "rows cut short": "rows.npy",
        "state cut short": "state.accumulator.npy",
        "planner array cut short": "planner.id_of_slot.npy",
        "table.json garbled": "table.json",
    }[damage]
    if file == "table.json":
        (table / file).write_text("{not json")
    else:
        os.truncate(table / file, os.path.getsize(table / file) - 8)

    rows = np.array(target.cache.table.rows)
    state = {k: np.array(v) for k, v in target.cache.table.state.items()}
    resident = target.cache.planner.resident_ids()
    steps = target.cache.stats.steps
    expected = "cannot be read" if file == "table.json" else "(truncated)"
    with pytest.raises(
        ValueError, match=rf"{re.escape(file)} .*{re.escape(expected)}.*earlier step"
    ):
        checkpointer.restore(caches=[target])
    np.testing.assert_array_equal(target.cache.table.rows, rows)
    for key, values in state.items():
        np.testing.assert_array_equal(target.cache.table.state[key], values)
    np.testing.assert_array_equal(target.cache.planner.resident_ids(), resident)
    assert target.cache.stats.steps == steps


def _damage(table: pathlib.Path, damage: str) -> None:
    """Damages a saved table the way ``damage`` says, recording the damaged
    file in ``table.json`` as if it had been saved so."""
    record = table / "table.json"
    meta = json.loads(record.read_text())

    def rewrite(file: str, array: np.ndarray) -> None:
        np.save(table / file, array)
        meta["arrays"][file[: -len(".npy")]] = {
            "shape": list(array.shape),
            "dtype": array.dtype.name,
            "bytes": array.nbytes,
        }

    if damage == "rows of half the table":
        rewrite("rows.npy", np.load(table / "rows.npy")[: N // 2])
    elif damage == "state of another shape":
        rewrite("state.accumulator.npy", np.load(table / "state.accumulator.npy")[:, 0])
    elif damage == "rows of another dtype":  # the record still says float32
        np.save(table / "rows.npy", np.load(table / "rows.npy").view(np.int32))
    elif damage == "statistics garbled":
        meta["stats"] = {"x": 1}
    elif damage == "padded sizes garbled":
        meta["buckets"] = [1, 2, 3]
    elif damage == "plan count negative":
        meta["next_index"] = -5
    record.write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "damage",
    [
        "rows of half the table",
        "state of another shape",
        "rows of another dtype",
        "statistics garbled",
        "padded sizes garbled",
        "plan count negative",
    ],
)
def test_a_whole_file_that_does_not_fit_the_table_is_refused_before_the_cache_changes(
    tmp_path, damage
):
    # Each file is whole and table.json agrees with it: only the table (or
    # the record's dtype) says it is wrong. Nothing may change before that.
    _, checkpointer, target = _saved_and_target(tmp_path)
    _damage(tmp_path / "1" / "tables" / "embedding", damage)
    rows = np.array(target.cache.table.rows)
    resident = target.cache.planner.resident_ids()
    stats = target.cache.stats.state_dict()
    with pytest.raises(ValueError, match=r"table 'embedding': .*(damaged|corrupt)"):
        checkpointer.restore(caches=[target])
    np.testing.assert_array_equal(target.cache.table.rows, rows)
    np.testing.assert_array_equal(target.cache.planner.resident_ids(), resident)
    assert target.cache.stats.state_dict() == stats
    target.prepare(np.arange(100, 120))  # and it goes on


def test_a_restore_that_fails_as_it_reads_leaves_the_cache_refused_until_one_completes(
    tmp_path, monkeypatch
):
    # A file checked beforehand can still fail as it is read (the process
    # that wrote the directory deleted the step meanwhile): the cache then
    # holds part of the checkpoint, and must not be used as if it were whole.
    saved, checkpointer, target = _saved_and_target(tmp_path)

    def vanished(*args, **kwargs):
        raise FileNotFoundError("rows.npy was deleted")

    with monkeypatch.context() as patch:
        patch.setattr(SavedTable, "copy_rows", vanished)
        patch.setattr(SavedTable, "take", vanished)
        with pytest.raises(FileNotFoundError):
            checkpointer.restore(caches=[target])
    refused = r"a restore failed after it had begun to change the cache .*rows\.npy was deleted"
    with pytest.raises(RuntimeError, match=refused):
        target.prepare(np.arange(5))
    with pytest.raises(RuntimeError, match=refused):
        checkpointer.save(2, caches=[target])
    with pytest.raises(RuntimeError, match=refused):
        target.export()
    checkpointer.restore(caches=[target])  # a complete one: usable again
    np.testing.assert_array_equal(target.export()[0], saved.export()[0])
    target.prepare(np.arange(5))


def test_save_refuses_batches_staged_ahead(tmp_path):
    model, optimizer = _model(_cache("lru", capacity=400))
    items = [{"ids": ids, "y": y} for ids, y in _data(10)]
    with jaxcache.prefetch(items, {"ids": model.embed}, lookahead=3) as pipeline:
        for i, batch in enumerate(pipeline):
            _train_step(model, optimizer, batch["ids"], batch["y"])
            if i == 2:
                time.sleep(0.3)  # the producer stages the next batches
                break
    checkpointer = jaxcache.Checkpointer(tmp_path)
    with pytest.raises(RuntimeError, match="batches planned that the training loop"):
        checkpointer.save(3, model=model, optimizer=optimizer)
    assert checkpointer.steps() == []


def test_save_and_restore_refuse_an_open_look_ahead_pipeline(tmp_path):
    # Its thread plans the next batches meanwhile: refused every time, not
    # only when it happens to have planned one already.
    model, optimizer = _model(_cache("lru"))
    checkpointer = jaxcache.Checkpointer(tmp_path)
    checkpointer.save(0, model=model, optimizer=optimizer)
    items = [{"ids": ids, "y": y} for ids, y in _data(5)]
    with jaxcache.prefetch(items, {"ids": model.embed}, lookahead=1) as pipeline:
        for i, batch in enumerate(pipeline):
            _train_step(model, optimizer, batch["ids"], batch["y"])
            with pytest.raises(RuntimeError, match=r"open jaxcache\.prefetch with look-ahead"):
                checkpointer.save(i + 1, model=model, optimizer=optimizer)
            with pytest.raises(RuntimeError, match=r"open jaxcache\.prefetch with look-ahead"):
                checkpointer.restore(0, model=model, optimizer=optimizer)
    assert checkpointer.steps() == [0]
    checkpointer.save(5, model=model, optimizer=optimizer)  # after its with-block


def test_a_rollback_lands_evicted_rows_first_and_restores_every_table(tmp_path):
    # Table b's last step evicts rows its step before changed: their
    # write-back is pending when the model is rolled back to step 1.
    def table(name):
        cfg = jaxcache.CacheConfig(100, 4, 4, policy="lru", optimizer=jaxcache.sgd(0.1), name=name)
        return jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg), combiner="sum")

    model = nnx.List([table("a"), table("b")])

    @nnx.jit
    def step(model, la, lb):
        grad = jaxcache.nnx.value_and_grad(lambda m, la, lb: (m[0](la) * m[1](lb)).sum() + 1)
        grad(model, la, lb)

    def train(a, b):
        step(model, model[0].prepare(np.array([a])), model[1].prepare(np.array([b])))

    train([1, 2, 3, 4], [1, 2, 3, 4])
    checkpointer = jaxcache.Checkpointer(tmp_path)
    checkpointer.save(1, caches=list(model))
    saved = [m.export() for m in model]
    train([1, 2, 3, 4], [5, 6, 7, 8])
    train([1, 2, 3, 4], [9, 10, 11, 12])  # evicts b's changed rows 5..8
    assert model[1].cache.write_backs.busy()
    checkpointer.restore(1, caches=list(model))
    for m, (rows, _) in zip(model, saved, strict=True):
        np.testing.assert_array_equal(m.export()[0], rows)
    # A write-back landing after the restore would have put 5..8 back.
    train([1, 2, 3, 4], [1, 2, 3, 4])
    model[1].flush()
    np.testing.assert_array_equal(model[1].cache.table.rows[5:9], saved[1][0][5:9])


def test_a_rollback_inside_a_pipeline_without_look_ahead_trains_as_one_after_it(tmp_path):
    # Rolled back inside the loop (after a non-finite loss, say), the next
    # batches of the same pipeline train as those of a new pipeline after
    # the restore: the batch handed out before it must release no plan of
    # the restored cache, whose plans start again from the saved index.
    data = _data(16)
    results = []
    for inside in (False, True):
        model, optimizer = _model(_cache("lru", capacity=48))
        checkpointer = jaxcache.Checkpointer(tmp_path / str(inside))
        _train(model, optimizer, data[:4])
        checkpointer.save(4, model=model, optimizer=optimizer)
        items = [{"ids": ids, "y": y} for ids, y in (data[4:] if inside else data[4:10])]
        with jaxcache.prefetch(items, {"ids": model.embed}, lookahead=0) as pipeline:
            for n, batch in enumerate(pipeline, start=4):
                _train_step(model, optimizer, batch["ids"], batch["y"])
                if n == 9:
                    checkpointer.restore(4, model=model, optimizer=optimizer)
        if not inside:
            checkpointer.restore(4, model=model, optimizer=optimizer)
            _train(model, optimizer, data[10:])
        jaxcache.testing.check_invariants(model.embed.cache)
        results.append((model.embed.export()[0], _dense(model) + _dense(optimizer)))
    (after, after_dense), (inside, inside_dense) = results
    np.testing.assert_allclose(inside, after, rtol=0, atol=1e-6)
    for a, b in zip(inside_dense, after_dense, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_a_rollback_after_leaving_a_look_ahead_pipeline_early_trains_as_one_after_it(tmp_path):
    # Left early (a loss went non-finite, say), the pipeline's cache holds
    # the plans of the batches it staged ahead, which no step took: a save
    # would record their rows as trained, but a rollback replaces them.
    data = _data(16)
    results = []
    for early in (False, True):
        model, optimizer = _model(_cache("lru", capacity=300))
        checkpointer = jaxcache.Checkpointer(tmp_path / str(early))
        _train(model, optimizer, data[:4])
        checkpointer.save(4, model=model, optimizer=optimizer)
        items = [{"ids": ids, "y": y} for ids, y in (data[4:] if early else data[4:10])]
        with jaxcache.prefetch(items, {"ids": model.embed}, lookahead=2) as pipeline:
            for n, batch in enumerate(pipeline, start=4):
                _train_step(model, optimizer, batch["ids"], batch["y"])
                if n == 9:
                    handed_out = batch["ids"]
                    lifecycle = model.embed.cache.lifecycle
                    if early:  # the two batches after it staged
                        _wait_for(lambda lifecycle=lifecycle: len(lifecycle.in_flight()) == 3)
                    break
        if early:
            with pytest.raises(RuntimeError, match="planned that the training loop may not"):
                checkpointer.save(10, model=model, optimizer=optimizer)
        checkpointer.restore(4, model=model, optimizer=optimizer)
        with pytest.raises(ValueError, match="restore"):
            _train_step(model, optimizer, handed_out, data[9][1])
        _train(model, optimizer, data[10:])
        jaxcache.testing.check_invariants(model.embed.cache)
        results.append((model.embed.export(), _dense(model) + _dense(optimizer)))
    (after, after_dense), (early, early_dense) = results
    after_arrays, early_arrays = ((rows, *state.values()) for rows, state in (after, early))
    for a, b in zip(after_arrays, early_arrays, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(after_dense, early_dense, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("lookahead", [0, 2])
def test_a_cache_that_lost_a_batch_rolls_back_in_place(tmp_path, monkeypatch, lookahead):
    # A transfer failed after its batch was planned (the device out of
    # memory, say): the cache stops at the next swap, and a restore of the
    # last checkpoint into the same objects trains on as a fresh model would.
    data = _data(12)
    model, optimizer = _model(_cache("lru", capacity=48))
    _train(model, optimizer, data[:4])
    checkpointer = jaxcache.Checkpointer(tmp_path)
    checkpointer.save(4, model=model, optimizer=optimizer)
    with monkeypatch.context() as patch:
        patch.setattr(jaxcache.EmbeddingCache, "to_device", failing_transfer(3))
        with pytest.raises(RuntimeError, match=r"RESOURCE_EXHAUSTED|planned but never applied"):
            _train(model, optimizer, data[4:], lookahead=lookahead)
    with pytest.raises(RuntimeError, match=r"planned but never applied|staged but not applied"):
        model.embed.export()  # the table lacks the lost batch's rows: refused
    checkpointer.restore(4, model=model, optimizer=optimizer)
    _train(model, optimizer, data[4:], lookahead=lookahead)
    jaxcache.testing.check_invariants(model.embed.cache)

    # A batch staged before the restore is refused, and changes nothing.
    stale = model.embed.cache.stage(data[5][0])
    checkpointer.restore(4, model=model, optimizer=optimizer)
    with pytest.raises(ValueError, match="stale: a restore has been applied since"):
        model.embed.cache.apply(model.embed.get_state(), stale)
    _train(model, optimizer, data[4:], lookahead=lookahead)

    fresh, fresh_optimizer = _model(_cache("lru", capacity=48), seed=3)
    checkpointer.restore(4, model=fresh, optimizer=fresh_optimizer)
    _train(fresh, fresh_optimizer, data[4:], lookahead=lookahead)
    for a, b in zip(
        (model.embed.export()[0], *_dense(model), *_dense(optimizer)),
        (fresh.embed.export()[0], *_dense(fresh), *_dense(fresh_optimizer)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_restored_cache_plans_the_next_pipeline_as_the_saved_one(tmp_path, planner, policy):
    # The first plans of the next pipeline still protect the rows of the
    # last ones (their bound is the pipeline's, not "all finished"): the
    # restored cache must keep that bound, or it evicts other rows.
    rng = np.random.default_rng(0)
    p = 1 / np.arange(1, 401) ** 1.0
    batches = [{"ids": rng.choice(400, size=(8, 2), p=p / p.sum())} for _ in range(24)]
    cfg = jaxcache.CacheConfig(400, 4, 48, policy=policy, optimizer=jaxcache.adagrad(0.1))
    saved = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg))
    with jaxcache.prefetch(batches[:12], {"ids": saved}, lookahead=2) as pipeline:
        for _ in pipeline:
            pass
    checkpointer = jaxcache.Checkpointer(tmp_path)
    checkpointer.save(12, caches=[saved])
    restored = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg))
    checkpointer.restore(caches=[restored])
    for embed in (saved, restored):
        with jaxcache.prefetch(batches[12:], {"ids": embed}, lookahead=2) as pipeline:
            for _ in pipeline:
                pass
    assert restored.cache.stats.total == saved.cache.stats.total
    np.testing.assert_array_equal(
        restored.cache.planner.resident_ids(), saved.cache.planner.resident_ids()
    )


# ---------------------------------------------------------- crash safety
_CRASH_CHILD = """
import os, signal, sys
import numpy as np, jaxcache
from jaxcache._src import checkpoint, npy_files, table_record
from flax import nnx

directory, mode, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
config = jaxcache.CacheConfig(rows, 16, capacity=256, policy="lru",
                              optimizer=jaxcache.adagrad(0.1))
embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(config, seed=1))

@nnx.jit
def step(embed, lookup):
    jaxcache.nnx.value_and_grad(lambda m, lk: (m(lk) ** 2).sum())(embed, lookup)

def train(first):
    for i in range(first, first + 3):
        step(embed, embed.prepare(np.arange(100) * 7 + i))

def die():
    os.kill(os.getpid(), signal.SIGKILL)

train(0)
checkpointer = jaxcache.Checkpointer(directory)
checkpointer.save(1, caches=[embed])
rows_, state = embed.export()
np.savez(directory + ".npz", rows=rows_, **state, resident=embed.cache.planner.id_of_slot)
train(3)
if mode == "before-tables":
    table_record.save_table = lambda *a, **k: die()
elif mode == "between-files":
    write, calls = npy_files.write_array, []
    def write_then_die(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            die()
        return write(*args, **kwargs)
    npy_files.write_array = write_then_die
elif mode == "mid-file":
    chunks = npy_files.row_chunks
    npy_files.CHUNK_BYTES = 4096
    def chunks_then_die(array):
        for i, rows in enumerate(chunks(array)):
            if i == 5:
                die()
            yield rows
    npy_files.row_chunks = chunks_then_die
elif mode == "before-commit":
    save = checkpoint._TablesHandler.save
    def save_then_die(self, *args, **kwargs):
        save(self, *args, **kwargs)
        die()
    checkpoint._TablesHandler.save = save_then_die
print("saving", flush=True)
checkpointer.save(2, caches=[embed])
print("saved", flush=True)
"""


def _crash(tmp_path, mode, rows=5000):
    # One script per child: rewriting a shared one while an earlier child
    # reads it can hand that child an empty file (which exits 0 silently).
    script = tmp_path / f"child-{mode}.py"
    script.write_text(_CRASH_CHILD)
    directory = tmp_path / mode
    process = subprocess.Popen(
        [sys.executable, str(script), str(directory), mode, str(rows)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return directory, process


def _wait_for(condition, seconds=60.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _check_previous_checkpoint_survives(directory, rows=5000):
    leftovers = [name for name in os.listdir(directory) if name != "1"]
    assert leftovers and all("tmp" in name for name in leftovers), leftovers
    expected = np.load(f"{directory}.npz")
    config = jaxcache.CacheConfig(
        rows, 16, capacity=256, policy="lru", optimizer=jaxcache.adagrad(0.1)
    )
    embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(config, seed=3))
    checkpointer = jaxcache.Checkpointer(directory)  # removes the partial step
    assert checkpointer.steps() == [1]
    checkpointer.restore(caches=[embed])
    np.testing.assert_array_equal(embed.cache.table.rows, expected["rows"])
    np.testing.assert_array_equal(embed.cache.table.state["accumulator"], expected["accumulator"])
    np.testing.assert_array_equal(embed.cache.planner.id_of_slot, expected["resident"])
    checkpointer.save(2, caches=[embed])  # the directory is usable again
    assert checkpointer.steps() == [1, 2]
    assert sorted(os.listdir(directory)) == ["1", "2"]


# The savers crash inside file writes, which see the planner's state through
# the host copy both planners save from: one planner is enough.
@pytest.mark.no_planner
def test_a_crash_during_save_leaves_the_previous_checkpoint(tmp_path):
    """Savers killed before, between and in the middle of the table files, right
    before the commit, and by a signal from outside while orbax writes a large
    table (64 MiB of rows and 64 MiB of accumulators)."""
    modes = ("before-tables", "between-files", "mid-file", "before-commit")
    children = {mode: _crash(tmp_path, mode) for mode in modes}
    large = 1 << 20
    directory, process = children["signal"] = _crash(tmp_path, "signal", large)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        if directory.exists() and any(
            "tmp" in name and name.startswith("2") for name in os.listdir(directory)
        ):
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.001)
    for mode, (directory, process) in children.items():
        out, err = process.communicate(timeout=300)
        assert out.split() == ["saving"], (mode, process.returncode, out, err)
        assert process.returncode == -signal.SIGKILL, (mode, process.returncode, err)
        _check_previous_checkpoint_survives(directory, large if mode == "signal" else 5000)
