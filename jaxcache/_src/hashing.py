"""Hashes of raw ids, the same on the host (NumPy) and on the devices (JAX).

A dynamic vocabulary finds an id's bucket, and its admission counters, from
a 32-bit hash of the id's two 32-bit words (``id_hash``): JAX runs without
64-bit integers, and the device planner hashes the ids where they are. The
functions here take NumPy or JAX ``uint32`` arrays alike and wrap as 32-bit
arithmetic does, so host and devices agree bit for bit. ``splitmix64``
(64-bit, host only) seeds them and draws new rows' first values.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "SKETCH_DEPTH",
    "bucket_count",
    "fmix32",
    "id_hash",
    "id_words",
    "seed_word",
    "sketch_salts",
    "splitmix64",
]

SKETCH_DEPTH = 4  # rows of a vocabulary's admission sketch
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
