"""Hashes of raw ids and fixed-point logs, the same on the host (NumPy,
Numba) and on the devices (JAX).

A dynamic vocabulary finds an id's bucket, and its admission counters, from
a 32-bit hash of the id's two 32-bit words (``id_hash``): JAX runs without
64-bit integers, and the device planner hashes the ids where they are. The
functions here take NumPy or JAX ``uint32`` arrays alike and wrap as 32-bit
arithmetic does, so host and devices agree bit for bit. ``splitmix64``
(64-bit, host only) seeds them and draws new rows' first values.
``log2_fixed`` is the adaptive policy's weight, in integers, so the host
and device planners rank rows alike.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "LOG2_TABLE",
    "LRFU_AGE_FLOOR",
    "SKETCH_DEPTH",
    "bucket_count",
    "bucket_of",
    "fmix32",
    "id_hash",
    "id_words",
    "log2_fixed",
    "seed_word",
    "sketch_salts",
    "splitmix64",
]

SKETCH_DEPTH = 4  # rows of a vocabulary's admission sketch
#: floor(256 * log2(1 + i / 256)): the mantissa part of ``log2_fixed`` (and
#: of the host's ``kernels.log2_fixed``).
LOG2_TABLE = np.array([math.floor(256 * math.log2(1 + i / 256)) for i in range(256)], np.int32)
#: The oldest age, in plans, that ``forget="lrfu"`` keys tell apart: with it
#: ``256 * age + bonus * log2_fixed(lookups)`` stays within int32 on the
#: devices (``bonus <= 256``) in a run of any length.
LRFU_AGE_FLOOR = -(1 << 22)
_GOLDEN32 = 0x9E3779B9


def splitmix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer of ``uint64`` values: a bijection whose output
    bits each depend on every input bit (Steele et al. 2014).

    Examples:
      >>> splitmix64(np.array([0, 1], np.uint64)).tolist()
      [0, 6238072747940578789]
    """
    z = np.asarray(values, np.uint64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def fmix32(x: Any) -> Any:
    """MurmurHash3's 32-bit finalizer of ``uint32`` values (NumPy or JAX
    arrays alike): a bijection that mixes every input bit into every output
    bit, in 32-bit arithmetic only.

    Examples:
      >>> fmix32(np.array([0, 1], np.uint32)).tolist()
      [0, 1364076727]
    """
    x = x ^ (x >> 16)
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def seed_word(seed: int) -> np.uint32:
    """The 32-bit word a vocabulary's ``seed`` salts its hashes with."""
    return np.uint32(int(splitmix64(np.array([seed], np.uint64))[0]) & 0xFFFFFFFF)


def sketch_salts(seed: int) -> np.ndarray:
    """``uint32 [4]``: the salt of each row of the admission sketch."""
    salts = np.uint32(seed_word(seed)) + np.arange(
        1, SKETCH_DEPTH + 1, dtype=np.uint32
    ) * np.uint32(_GOLDEN32)
    return fmix32(salts)


def id_hash(low: Any, high: Any, salt: np.uint32) -> Any:
    """The 32-bit hash of raw ids given as their ``uint32`` words (``low``,
    ``high``; NumPy or JAX arrays alike): a bucket is its low bits.

    Examples:
      >>> words = np.array([5, 2**40], np.int64).view(np.uint32).reshape(-1, 2)
      >>> id_hash(words[:, 0], words[:, 1], seed_word(0)).dtype
      dtype('uint32')
    """
    return fmix32(low ^ fmix32(high ^ salt))


def bucket_count(rows: int, ways: int) -> int:
    """``B``: the smallest power of two with ``B * ways >= rows``.

    Examples:
      >>> bucket_count(300, 64), bucket_count(64, 64), bucket_count(65, 64)
      (8, 1, 2)
    """
    buckets = 1
    while buckets * ways < rows:
        buckets *= 2
    return buckets


def id_words(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The low and high ``uint32`` words of int64 ids.

    Examples:
      >>> [w.tolist() for w in id_words(np.array([-1, 2**32 + 5]))]
      [[4294967295, 5], [4294967295, 1]]
    """
    words = np.ascontiguousarray(ids, np.int64).view(np.uint32).reshape(-1, 2)
    if not np.little_endian:
        words = words[:, ::-1]
    return words[:, 0], words[:, 1]


def bucket_of(ids: np.ndarray, salt: np.uint32, buckets: int) -> np.ndarray:
    """``int64``: the bucket of each raw int64 id among ``buckets`` (a power
    of two): the low bits of ``id_hash``.

    Examples:
      >>> bucket_of(np.array([5, 2**40]), seed_word(0), 8).dtype
      dtype('int64')
    """
    low, high = id_words(ids)
    return (id_hash(low, high, np.uint32(salt)) & np.uint32(buckets - 1)).astype(np.int64)


def log2_fixed(count: jax.Array) -> jax.Array:
    """``log2(count)`` in 1/256ths for int32 ``count >= 1``, as the host
    planner's ``kernels.log2_fixed``: ``256 e + table[f]`` with ``2^e <=
    count < 2^(e + 1)`` and ``f`` the 8 bits after the leading one.

    Examples:
      >>> import jax.numpy as jnp
      >>> log2_fixed(jnp.array([1, 2, 3, 1024], jnp.int32)).tolist()
      [0, 256, 405, 2560]
    """
    e = 31 - lax.clz(count)
    f = jnp.where(e >= 8, count >> jnp.maximum(e - 8, 0), count << jnp.maximum(8 - e, 0))
    return 256 * e + jnp.asarray(LOG2_TABLE)[f - 256]
