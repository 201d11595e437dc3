"""Compiled helpers against plain Python."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcache._src.kernels import (
    IdIndex,
    block_ids,
    choose_victims,
    copy_rows,
    distinct_ranks,
    owner_route,
    region,
    reserve_candidates,
    split_by_home,
)

# Ids as they come: anywhere in int64, in runs, or on a stride of a power of
# two (which a hash of the low bits alone would pile into one bucket).
_ids = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.integers(0, 3000),
    st.integers(0, 200).map(lambda i: i << 20),
)


@settings(max_examples=200, deadline=None)
@given(
    keys=st.lists(_ids, max_size=300, unique=True),
    values=st.lists(_ids, max_size=300),
    sample=st.lists(st.integers(0, 10**6), max_size=100),
)
def test_id_index_finds_exactly_the_values_among_the_keys(keys, values, sample):
    if keys:  # values that are keys too, wherever they sit
        values = values + [keys[i % len(keys)] for i in sample]
    keys, values = np.array(keys, np.int64), np.array(values, np.int64)
    which, where = IdIndex(keys).find(values)
    position = {k: j for j, k in enumerate(keys.tolist())}
    expected = [(i, position[v]) for i, v in enumerate(values.tolist()) if v in position]
    assert list(zip(which.tolist(), where.tolist(), strict=True)) == expected


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    dtype=st.sampled_from([np.float32, np.float64, np.int8, ml_dtypes.bfloat16]),
    row_shape=st.sampled_from([(), (1,), (3,), (16,), (2, 5)]),
    sizes=st.tuples(st.integers(1, 40), st.integers(1, 40)),
)
def test_copy_rows_matches_assignment(data, dtype, row_shape, sizes):
    # Any dtype and row width (odd byte counts too); repeated destinations: the last wins.
    n_dst, n_src = sizes
    count = data.draw(st.integers(0, 60))
    dst_at = np.array(
        data.draw(st.lists(st.integers(0, n_dst - 1), min_size=count, max_size=count))
    )
    src_at = np.array(
        data.draw(st.lists(st.integers(0, n_src - 1), min_size=count, max_size=count))
    )
    rng = np.random.default_rng(count)
    dst = rng.normal(size=(n_dst, *row_shape)).astype(dtype)
    src = rng.normal(size=(n_src, *row_shape)).astype(dtype)
    expected = dst.copy()
    for a, b in zip(dst_at.tolist(), src_at.tolist(), strict=True):
        expected[a] = src[b]
    copy_rows(dst, dst_at.astype(np.int64), src, src_at.astype(np.int64))
    assert dst.tobytes() == expected.tobytes()


def test_copy_rows_refuses_before_writing():
    dst, src = np.zeros((4, 2), np.float32), np.ones((3, 2), np.float32)
    for dst_at, src_at in (([0, 4], [0, 1]), ([0, -1], [0, 1]), ([0, 1], [0, 3])):
        with pytest.raises(IndexError, match="out of range; nothing was copied"):
            copy_rows(dst, np.array(dst_at), src, np.array(src_at))
        assert not dst.any()
    with pytest.raises(TypeError, match="cannot copy rows of float64"):
        copy_rows(dst, np.array([0]), src.astype(np.float64), np.array([0]))
    with pytest.raises(ValueError, match="destination rows must be C-contiguous"):
        copy_rows(np.zeros((4, 4), np.float32)[:, :2], np.array([0]), src, np.array([0]))


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    spread=st.sampled_from([3, 40, 10**6]),
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=5),
)
def test_distinct_ranks_number_each_group_in_order_of_first_appearance(data, spread, sizes):
    # Groups of any length (empty ones, and longer than a window), few or
    # many distinct ids, on a stride that piles the low bits into one value;
    # each group's ranks start again from 0, gaps between groups untouched.
    stride = data.draw(st.sampled_from([1, 1 << 20]))
    lo, hi, parts, at = [], [], [], 0
    for size in sizes:
        at += data.draw(st.integers(0, 3))  # a gap
        ids = data.draw(st.lists(st.integers(0, spread), min_size=size, max_size=size))
        lo.append(at)
        parts.append((at, np.array(ids, np.int64) * stride))
        at += size
        hi.append(at)
    local = np.full(at, -5, np.int64)
    for start, ids in parts:
        local[start : start + ids.size] = ids
    ranks = np.full(at, -7, np.int32)
    counts = np.empty(len(sizes), np.int64)
    distinct_ranks(local, np.array(lo), np.array(hi), ranks, counts)
    expected = np.full(at, -7, np.int32)
    for g, (start, ids) in enumerate(parts):
        first: dict[int, int] = {}
        for j, v in enumerate(ids.tolist()):
            expected[start + j] = first.setdefault(v, len(first))
        assert counts[g] == len(first)
    np.testing.assert_array_equal(ranks, expected)


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    devices=st.sampled_from([1, 2, 3, 4, 6, 8]),
    pad=st.sampled_from([-1, 7, np.iinfo(np.int64).min]),
)
def test_split_by_home_groups_like_a_stable_sort(data, devices, pad):
    n = 50
    ids = np.array(data.draw(st.lists(st.integers(-1, n - 1), max_size=60)), np.int64)
    ids[ids == -1] = pad  # padding wherever the draw says
    lo = data.draw(st.integers(0, ids.size))
    hi = data.draw(st.integers(lo, ids.size))
    keep = np.array(data.draw(st.lists(st.booleans(), min_size=devices, max_size=devices)))
    _check_split(ids, lo, hi, pad, n, keep, data.draw(st.booleans()))


@pytest.mark.parametrize("devices", [3, 4, 8])
@pytest.mark.parametrize("keep_all", [True, False])
@pytest.mark.parametrize("positions", [True, False])
def test_split_by_home_of_skewed_residues_overflows_into_two_passes(devices, keep_all, positions):
    # Ids of one residue overflow its region; the rest are in order too.
    rng = np.random.default_rng(devices)
    ids = rng.integers(0, 1000, 300) // devices * devices
    ids[::7] += 1  # a few of another residue
    ids[::11] = -1  # padding
    keep = np.ones(devices, bool) if keep_all else np.arange(devices) % 2 == 0
    assert np.sum(ids % devices == 0) > region(290, devices)
    _check_split(ids, 5, 295, -1, 1000, keep, positions)


@pytest.mark.parametrize("size", [255, 257, 1300])
@pytest.mark.parametrize("skewed", [False, True])
@pytest.mark.parametrize("positions", [True, False])
def test_split_by_home_of_long_slices(size, skewed, positions):
    # Slices longer than a few hundred ids, an id out of range near the end;
    # the padding's residue (-4 % 4 == 0) is kept.
    rng = np.random.default_rng(size)
    ids = rng.integers(0, 5000, size)
    if skewed:
        ids = ids // 4 * 4  # one residue of four: its region overflows
    ids[::13] = -4
    keep = np.arange(4) % 2 == 0
    _check_split(ids, 1, size, -4, 5000, keep, positions)
    ids[size - 3] = 5000
    room = 4 * region(size, 4) + 1
    out = (np.empty(room, np.int64), np.empty(room, np.int32), positions)
    assert (
        split_by_home(ids, 0, size, -4, 5000, 4, keep, *out, *np.empty((2, 4), np.int64))
        == size - 3
    )


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    devices=st.sampled_from([1, 2, 4, 8]),
    size=st.integers(0, 6000),
    skew=st.sampled_from([0.0, 0.3, 0.6, 1.0]),
    positions=st.booleans(),
)
def test_split_by_home_of_slices_long_enough_for_blocks(seed, devices, size, skew, positions):
    # Slices whose regions hold several blocks of 256 ids (a power of two of
    # devices), with a share ``skew`` of the ids on residue 0, so that some
    # fill a region and are split again from the start.
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 100_000, size)
    heavy = rng.random(size) < skew
    ids[heavy] = ids[heavy] // devices * devices
    ids[rng.random(size) < 0.1] = -7  # padding
    keep = rng.random(devices) < 0.7
    lo = int(rng.integers(0, 40)) if size > 40 else 0
    _check_split(ids, lo, size, -7, 100_000, keep, positions)


@pytest.mark.parametrize("positions", [True, False])
def test_split_by_home_of_a_region_overflowing_in_the_last_block(positions):
    # 2,048 ids over 4 devices (regions of 1,040 entries, blocks of 256): the
    # first seven blocks fill residue 0's region to 40 short of full, the
    # last block is all residue 0.
    rng = np.random.default_rng(3)
    head = np.concatenate([rng.integers(0, 2500, 1000) * 4, rng.integers(0, 2500, 792) * 4 + 1])
    ids = np.concatenate([rng.permutation(head), rng.integers(0, 2500, 256) * 4])
    assert region(ids.size, 4) == 1040
    _check_split(ids, 0, ids.size, -1, 10_000, np.ones(4, bool), positions)


def _check_split(ids, lo, hi, pad, n, keep, positions):
    """``split_by_home`` against a stable sort of the kept ids by residue;
    without ``positions``, ``at`` untouched."""
    devices = keep.size
    room = devices * region(hi - lo, devices) + 1
    local = np.full(room, -5, np.int64)
    at = np.full(room, -5, np.int32)
    begin, end = np.empty(devices, np.int64), np.empty(devices, np.int64)
    assert split_by_home(ids, lo, hi, pad, n, devices, keep, local, at, positions, begin, end) == -1
    real = [(int(i), p) for p, i in enumerate(ids[lo:hi].tolist(), lo) if i != pad]
    for r in range(devices):  # each group in order of appearance, apart from the others
        group = [(i // devices, p) for i, p in real if i % devices == r and keep[r]]
        assert 0 <= begin[r] <= end[r] <= room - 1
        assert local[begin[r] : end[r]].tolist() == [q for q, _ in group]
        if positions:
            assert at[begin[r] : end[r]].tolist() == [p for _, p in group]
    if not positions:
        assert (at == -5).all()
    spans = sorted((begin[r], end[r]) for r in range(devices) if end[r] > begin[r])
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


@pytest.mark.parametrize("keep_all", [True, False])
def test_split_by_home_finds_the_first_id_out_of_range(keep_all):
    ids = np.array([3, 9, 12, -4, 20], np.int64)
    keep = np.array([keep_all, True])
    room = 2 * region(5, 2) + 1
    local, at = np.empty(room, np.int64), np.empty(room, np.int32)
    out = (local, at, keep_all, np.empty(2, np.int64), np.empty(2, np.int64))
    assert split_by_home(ids, 0, 5, -1, 12, 2, keep, *out) == 2  # 12 >= 12
    assert split_by_home(ids, 3, 5, 20, 12, 2, keep, *out) == 3  # -4; 20 is padding
    assert split_by_home(ids, 0, 2, -1, 12, 2, keep, *out) == -1


_FREE = -(2**63)  # a free slot's key: below every priority, so taken first


def _check_victims(priority: np.ndarray, data: st.DataObject) -> None:
    """``choose_victims`` against a sort of the unprotected slots of a
    random reserve by ``(key, slot)``; ``priority`` has one key per slot."""
    capacity = priority.size
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    reserve = rng.permutation(capacity)[: data.draw(st.integers(0, capacity))].astype(np.int64)
    mark = np.where(rng.random(capacity) < 0.2, 7, 0).astype(np.int64)  # stamp 7: hits
    last_use = rng.integers(0, 10, capacity)  # used after plan 8: in flight
    id_of_slot = np.where(rng.random(capacity) < 0.1, -1, rng.integers(0, 10**6, capacity))
    free = [s for s in reserve if mark[s] != 7 and last_use[s] <= 8]
    key = {s: _FREE if id_of_slot[s] < 0 else int(priority[s]) for s in free}
    expected = sorted(free, key=lambda s: (key[s], s))
    count = data.draw(st.integers(1, len(free) + 2))
    out = np.full(count, -5, np.int64)
    found, kth, last = choose_victims(
        reserve, mark, 7, last_use, 8, id_of_slot, priority, count, out
    )
    assert found == len(free)
    if count > found:
        assert (out == -5).all()  # nothing written
        return
    assert out.tolist() == sorted(expected[:count])
    assert (kth, last) == (key[expected[count - 1]], expected[count - 1])


@settings(max_examples=60, deadline=None)
@given(
    keys=st.integers(1, 6),  # few distinct keys: many ties
    capacity=st.integers(1, 200),
    data=st.data(),
)
def test_choose_victims_takes_the_lowest_key_then_slot_among_unprotected(keys, capacity, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    _check_victims(rng.integers(0, keys, capacity), data)


# Keys as policies give them (counts, plan indices) and anywhere in int64,
# where the radix select needs several passes.
_keys = st.one_of(
    st.integers(-1, 6),
    st.integers(-1, 5000),
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([-(2**63), 2**63 - 1, -1, 0, 2**40]),
    st.sampled_from([2045, 2046, 2047, 2048, 4095, 4096]),  # at the first window's edge
)


def _check_reserve(priority: list[int], id_of_slot: np.ndarray, size: int) -> None:
    """``reserve_candidates`` against a sort of every slot by ``(key, slot)``."""
    capacity = len(priority)
    key = [_FREE if i < 0 else k for i, k in zip(id_of_slot.tolist(), priority, strict=True)]
    ranked = sorted(range(capacity), key=lambda s: (key[s], s))
    out = np.full(size, -5, np.int64)
    scratch = np.empty(capacity, np.uint64)
    kth, last = reserve_candidates(id_of_slot, np.array(priority, np.int64), size, scratch, out)
    below = [s for s in ranked[:size] if key[s] < key[ranked[size - 1]]]
    assert out.tolist() == sorted(below) + ranked[len(below) : size]  # each part by slot
    assert (kth, last) == (key[ranked[size - 1]], ranked[size - 1])


@settings(max_examples=100, deadline=None)
@given(priority=st.lists(_keys, min_size=1, max_size=3000), data=st.data())
def test_choose_victims_with_keys_anywhere_in_int64(priority, data):
    # Wide keys take the radix select several passes, as in the reserve's rebuild.
    _check_victims(np.array(priority, np.int64), data)


@settings(max_examples=200, deadline=None)
@given(
    priority=st.lists(_keys, min_size=1, max_size=5000),
    free=st.floats(0, 1),
    data=st.data(),
)
def test_reserve_candidates_are_the_lowest_key_then_slot(priority, free, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    id_of_slot = np.where(rng.random(len(priority)) < free, -1, 3)
    _check_reserve(priority, id_of_slot, data.draw(st.integers(1, len(priority))))


@pytest.mark.parametrize(
    "priority, size",
    [
        ([0, 2047, 2047, 3000], 4),  # past the first window, whose last key repeats
        ([5, 5, 5, 5], 2),  # one key: no pass at all
        ([2**63 - 1, -(2**63), 0, 2**62], 3),  # the whole int64 range: several passes
        ([7, 3, 2054, 3, 2055, 1 << 40], 5),
    ],
)
def test_reserve_candidates_at_the_edges_of_the_radix_passes(priority, size):
    _check_reserve(priority, np.zeros(len(priority), np.int64), size)


@settings(max_examples=100, deadline=None)
@given(
    blocks=st.integers(1, 4),
    split=st.integers(1, 3),
    parts=st.integers(1, 9),
    data=st.data(),
)
def test_block_ids_places_each_partitions_local_ids_in_its_device_block(blocks, split, parts, data):
    # ``blocks`` devices of ``split`` partitions each, residues modulo ``parts``;
    # a device's partitions' ids go one after another into its block.
    groups = blocks * split
    sizes = data.draw(st.lists(st.integers(0, 6), min_size=groups, max_size=groups))
    residues = np.array(data.draw(st.lists(st.integers(0, parts - 1), min_size=groups,
                                            max_size=groups)), np.int64)  # fmt: skip
    local = [np.array(data.draw(st.lists(st.integers(0, 2**40), min_size=m, max_size=m)),
                      np.int64) for m in sizes]  # fmt: skip
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    per_device = [sum(sizes[d * split : (d + 1) * split]) for d in range(blocks)]
    size = max(per_device) + data.draw(st.integers(0, 3))
    device = np.arange(groups) // split
    starts = device * size - bounds[device * split]
    flat = np.concatenate(local)
    ids, at = np.full(flat.size, -1, np.int64), np.full(flat.size, -1, np.int64)
    block_ids(flat, bounds, residues, parts, starts, ids, at)
    expected = [q * parts + r for q_block, r in zip(local, residues, strict=True) for q in q_block]
    places = [d * size + k for d in range(blocks) for k in range(per_device[d])]
    assert ids.tolist() == [int(i) for i in expected]
    assert at.tolist() == places


@settings(max_examples=100, deadline=None)
@given(sources=st.integers(1, 4), per_destination=st.integers(1, 5), data=st.data())
def test_owner_route_fills_its_rows_padding_and_all(sources, per_destination, data):
    # One owner's route written into buffers of junk: the first K rows each
    # source asks for, the rest of every row padding (C_l, or V among the
    # owner's rows), nothing left as it was.
    local_capacity, k = 50, per_destination
    distinct = data.draw(st.integers(0, 12))
    owner_size = distinct + data.draw(st.integers(0, 3))
    unique_slots = np.array(data.draw(st.permutations(range(local_capacity)))[:distinct], np.int32)
    sent = np.array(data.draw(st.lists(st.integers(0, distinct), min_size=sources,
                                       max_size=sources)), np.int64)  # fmt: skip
    bounds = np.concatenate([[0], np.cumsum(sent)]).astype(np.int64)
    first = np.array([data.draw(st.integers(0, max(distinct - 1, 0))) for _ in range(bounds[-1])],
                     np.int32)  # fmt: skip
    received = sources * k + data.draw(st.integers(0, 3))  # and the overflow's rows
    slots = np.full(owner_size, -7, np.int32)
    requests = np.full((sources, k), -7, np.int32)
    owner_inverse = np.full(received, -7, np.int32)
    owner_route(
        unique_slots, first, bounds, sent, k, local_capacity, slots, requests, owner_inverse
    )
    assert slots.tolist() == unique_slots.tolist() + [local_capacity] * (owner_size - distinct)
    expected_inverse = [owner_size] * received
    for s in range(sources):
        rows = first[bounds[s] : bounds[s] + min(sent[s], k)].tolist()
        assert requests[s].tolist() == [int(unique_slots[u]) for u in rows] + [local_capacity] * (
            k - len(rows)
        )
        expected_inverse[s * k : s * k + len(rows)] = rows
    assert owner_inverse.tolist() == expected_inverse
