"""Compiled helpers against plain Python."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcache._src.kernels import IdIndex

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
