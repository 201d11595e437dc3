"""The device vocabulary against the host one: the same rows, op for op."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxcache
from jaxcache._src import device_plan, device_planner, device_vocabulary
from jaxcache._src.hashing import id_words
from jaxcache._src.placement import Layout
from jaxcache._src.vocabulary import Vocabulary

V = 16  # distinct ids an owner receives, padded


@functools.cache
def _admit(spec):
    """One device's admission, jitted: rows, new, forgotten, refused, full,
    and the state after it (committed unless full)."""

    def run(state, low, high, lookups, live, t, finished, train, bonus):
        done = device_vocabulary.admit(
            spec, state, low, high, lookups, live, t, finished, train, bonus
        )
        return (*done[:5], done.commit(state, ~done.full))

    return jax.jit(run)


def _device_admit(vocab, spec, layout, ids, counts, step, finished, new):
    """``Vocabulary.admit`` on the devices of ``layout``, one at a time, from
    ``vocab``'s state: each device takes the ids of its buckets. Returns the
    global rows, the count of new and forgotten ids, whether any device was
    full, and the host copy of the state after it."""
    residues = [layout.residue(d) for d in range(layout.devices)]
    buckets = vocab.bucket_of(ids)
    rows = np.full(ids.size, -2, np.int64)
    new_count = forgotten = 0
    full = False
    blocks = []
    for residue in residues:
        state = device_planner._vocabulary_blocks(vocab, spec, [residue])
        mine = np.flatnonzero(buckets % layout.devices == residue)
        low, high = (np.zeros(V, np.int32) for _ in range(2))
        lookups, live = np.zeros(V, np.int32), np.zeros(V, bool)
        words = id_words(ids[mine])
        low[: mine.size], high[: mine.size] = (w.view(np.int32) for w in words)
        lookups[: mine.size], live[: mine.size] = counts[mine], True
        out = _admit(spec)(
            jax.tree.map(jnp.asarray, state), low, high, lookups, live, step, finished, int(new),
            vocab.bonus,
        )  # fmt: skip
        local, is_new, lost, _, is_full, after = out
        local = np.asarray(local)[: mine.size].astype(np.int64)
        rows[mine] = np.where(local >= 0, local * layout.devices + residue, -1)
        new_count += int(np.asarray(is_new)[: mine.size].sum())
        forgotten += int(lost)
        full |= bool(is_full)
        blocks.append(jax.tree.map(lambda x: None if x is None else np.asarray(x), after))
    merged = Vocabulary(
        vocab.rows,
        admit_after=vocab.admit_after,
        forget=vocab.forget,
        bonus=vocab.bonus,
        ways=vocab.ways,
        ttl=vocab.ttl,
        sketch_width=vocab.sketch.shape[1] if vocab.sketch.size else 1 << 10,
        seed=vocab.seed,
    )
    stacked = {
        name: None if blocks[0][i] is None else np.stack([b[i] for b in blocks])
        for i, name in enumerate(device_vocabulary.VocabState._fields)
    }
    device_planner._vocabulary_from_blocks(merged, spec, residues, stacked)
    return rows, new_count, forgotten, full, merged


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.sampled_from([3, 40, 200]),
    ways=st.sampled_from([4, 64]),
    devices=st.sampled_from([1, 2, 4]),
    admit_after=st.sampled_from([1, 1, 2, 3]),
    forget=st.sampled_from(["lru", "lfu", "lrfu"]),
    bonus=st.sampled_from([0, 2, 256]),
    ttl=st.sampled_from([None, 2, 5]),
    seed=st.integers(0, 2**16),
)
def test_the_device_admits_and_forgets_as_the_host_does(
    rows, ways, devices, admit_after, forget, bonus, ttl, seed
):
    host = Vocabulary(
        rows, admit_after=admit_after, forget=forget, bonus=bonus, ways=ways, ttl=ttl,
        sketch_width=1 << 10, seed=seed,
    )  # fmt: skip
    if host.buckets % devices:
        devices = 1
    layout = Layout(devices=devices)
    spec = device_planner._vocabulary_spec(host, layout)
    rng = np.random.default_rng(seed)
    universe = rng.integers(-(1 << 62), 1 << 62, 60)
    universe[:3] = [-1, (1 << 63) - 1, -(1 << 63)]
    step = 0
    for _ in range(30):
        ids = rng.choice(universe, size=int(rng.integers(1, min(rows, 8) + 2)), replace=False)
        counts = rng.integers(1, 4, ids.size).astype(np.int64)
        finished = step - 1 - int(rng.integers(0, 4))
        new = bool(rng.random() < 0.9)
        rows_d, new_d, forgotten_d, full, after = _device_admit(
            host, spec, layout, ids, counts, step, finished, new
        )
        try:
            done = host.admit(ids, counts, step=step, finished=finished, new=new)
        except jaxcache.CapacityError:
            assert full, "the host refused a batch the devices took"
            continue
        assert not full, "the devices refused a batch the host took"
        assert rows_d.tolist() == done.rows.tolist()
        assert (new_d, forgotten_d) == (done.new_ids.size, done.forgotten_ids.size)
        expected, got = host.state_dict(), after.state_dict()
        for key in ("ids", "rows", "last_use", "counts", "sketch"):
            np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
        step += 1


def test_lrfu_ranks_ids_past_the_age_floor_by_lookups_alike():
    # Ids unused for more than 2^22 plans are equally old to "lrfu" (the
    # device's int32 keys would overflow otherwise): their lookups decide.
    host = Vocabulary(2, forget="lrfu", bonus=1, ways=2)
    host.admit(np.array([10]), np.array([2]), step=0)
    host.admit(np.array([11]), np.array([1]), step=2)
    spec = device_planner._vocabulary_spec(host, Layout(devices=1))
    t = (1 << 23) + 5
    new = np.array([12])
    rows_d, *_ = _device_admit(host, spec, Layout(devices=1), new, np.array([1]), t, t - 1, True)
    done = host.admit(new, np.array([1]), step=t, finished=t - 1)
    assert done.forgotten_ids.tolist() == [11]  # unclamped ages would forget 10
    assert rows_d.tolist() == done.rows.tolist()


def test_raw_words_dedupe_in_order_of_first_appearance():
    ids = np.array([5, -1, 5, 2**40, -1, 7, 2**40 + 5, 5], np.int64)
    valid = ids != 7
    low, high = (w.view(np.int32) for w in id_words(ids))
    d_low, d_high, inverse, count, lookups = device_plan.dedupe_wide(
        jnp.asarray(low), jnp.asarray(high), jnp.asarray(valid), jnp.ones(ids.size, jnp.int32)
    )
    words = np.stack([np.asarray(d_low), np.asarray(d_high)], 1)[: int(count)]
    distinct = np.ascontiguousarray(words).view(np.int64).reshape(-1)
    assert distinct.tolist() == [5, -1, 2**40, 2**40 + 5]
    assert np.asarray(inverse).tolist() == [0, 1, 0, 2, 1, -1, 3, 0]
    assert np.asarray(lookups)[: int(count)].tolist() == [3, 2, 1, 1]


@pytest.mark.parametrize("devices", [2, 4])
def test_host_and_device_blocks_round_trip(devices):
    vocab = Vocabulary(500, admit_after=2, forget="lfu", ways=16, sketch_width=1 << 9, seed=3)
    rng = np.random.default_rng(0)
    ids = rng.integers(-(1 << 62), 1 << 62, 300)
    for step, batch in enumerate(np.array_split(ids, 6)):  # some admitted, some counted
        vocab.admit(batch, rng.integers(1, 3, batch.size), step=step)
    assert 0 < vocab.size < 300 and vocab.sketch.any()
    layout = Layout(devices=devices)
    spec = device_planner._vocabulary_spec(vocab, layout)
    residues = [layout.residue(d) for d in range(devices)]
    blocks = device_planner._vocabulary_blocks(vocab, spec, residues)
    stacked = {
        name: None if value is None else value.reshape(devices, -1)
        for name, value in blocks._asdict().items()
    }
    back = Vocabulary(500, admit_after=2, forget="lfu", ways=16, sketch_width=1 << 9, seed=3)
    device_planner._vocabulary_from_blocks(back, spec, residues, stacked)
    expected, got = vocab.state_dict(), back.state_dict()
    for key in ("ids", "rows", "last_use", "counts", "sketch"):
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
