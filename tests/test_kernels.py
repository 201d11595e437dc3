"""Compiled helpers against plain Python."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcache._src.kernels import IdIndex, copy_rows, split_by_home

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
    local = np.full(hi - lo, -5, np.int64)
    at = np.full(hi - lo, -5, np.int32)
    starts = np.empty(devices + 1, np.int64)
    assert split_by_home(ids, lo, hi, pad, n, devices, keep, local, at, starts) == -1
    real = [(int(i), p) for p, i in enumerate(ids[lo:hi].tolist(), lo) if i != pad]
    kept = [(i % devices, i // devices, p) for i, p in real if keep[i % devices]]
    expected = sorted(kept, key=lambda entry: entry[0])  # stable: in order within a group
    groups = [sum(1 for r, _, _ in expected if r == g) for g in range(devices)]
    assert starts.tolist() == np.concatenate([[0], np.cumsum(groups)]).tolist()
    assert local[: len(expected)].tolist() == [q for _, q, _ in expected]
    if keep.all():  # positions only for a slice split for every residue
        assert at[: len(expected)].tolist() == [p for _, _, p in expected]


@pytest.mark.parametrize("keep_all", [True, False])
def test_split_by_home_finds_the_first_id_out_of_range(keep_all):
    ids = np.array([3, 9, 12, -4, 20], np.int64)
    keep = np.array([keep_all, True])
    out = np.empty(5, np.int64), np.empty(5, np.int32), np.empty(3, np.int64)
    assert split_by_home(ids, 0, 5, -1, 12, 2, keep, *out) == 2  # 12 >= 12
    assert split_by_home(ids, 3, 5, 20, 12, 2, keep, *out) == 3  # -4; 20 is padding
    assert split_by_home(ids, 0, 2, -1, 12, 2, keep, *out) == -1
