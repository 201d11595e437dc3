"""Small files in the Criteo and MovieLens source formats, for tests, docs and benchmarks.

The files only have the shape of the real data (skewed ids, missing values,
32-bit hexadecimal hashes, per-user rating histories); their values are
random.
"""

from __future__ import annotations

import gzip
import os
import pathlib
import zipfile

import numpy as np

__all__ = ["write_fake_criteo", "write_fake_movielens"]

_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", np.uint8)


def _hex8(values: np.ndarray) -> np.ndarray:
    """``uint32`` values as 8-digit lowercase hexadecimal ``bytes`` (``S8``)."""
    shifts = np.arange(28, -1, -4, dtype=np.uint32)
    nibbles = (values[:, None] >> shifts) & np.uint32(15)
    return _HEX_DIGITS[nibbles].view("S8").reshape(-1)


def write_fake_criteo(
    path: str | os.PathLike[str],
    num_rows: int,
    *,
    seed: int = 0,
    missing: float = 0.1,
) -> pathlib.Path:
    """Writes ``num_rows`` random lines in the Criteo click-log format.

    Each line: a 0/1 label, 13 integer counts (``I2`` sometimes negative),
    26 categorical features as 8-digit hexadecimal hashes of Zipf-distributed
    values (so some ids are hot); any field but the label is empty with
    probability ``missing``. A path ending in ``.gz`` is gzipped.

    Args:
      path: the file to write (e.g. ``manual_dir / "train.txt"``).
      num_rows: lines.
      seed: seed of the values.
      missing: probability of an empty field.

    Returns:
      ``path``.

    Examples:
      >>> import pathlib, tempfile, jaxcache.datasets as jd
      >>> path = jd.write_fake_criteo(pathlib.Path(tempfile.mkdtemp()) / "train.txt", 3)
      >>> [len(line.split("\\t")) for line in path.read_text().splitlines()]
      [40, 40, 40]
    """
    rng = np.random.default_rng(seed)
    columns: list[np.ndarray] = [rng.choice(np.array([b"0", b"1"]), num_rows, p=[0.75, 0.25])]
    counts = np.floor(rng.exponential(np.exp(rng.uniform(0, 6, 13)), (num_rows, 13)))
    counts[:, 1] -= rng.random(num_rows) < 0.05  # I2 holds a few negative values
    for j in range(13):
        columns.append(counts[:, j].astype(np.int64).astype("S"))
    for f in range(26):
        ranks = np.minimum(rng.zipf(1.2, num_rows), 2**31).astype(np.uint64)
        hashes = (ranks * np.uint64(0x9E3779B1) + np.uint64(f * 0x85EBCA6B)) % np.uint64(2**32)
        columns.append(_hex8(hashes.astype(np.uint32)))
    for column in columns[1:]:
        column[rng.random(num_rows) < missing] = b""
    text = b"".join(b"\t".join(row) + b"\n" for row in zip(*columns, strict=True))
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        text = gzip.compress(text, compresslevel=1)
    path.write_bytes(text)
    return path


def write_fake_movielens(
    manual_dir: str | os.PathLike[str],
    *,
    num_users: int = 50,
    num_items: int = 80,
    ratings_per_user: int = 20,
    seed: int = 0,
) -> pathlib.Path:
    """Writes ``manual_dir/ml-100k.zip`` holding random ratings as ``ml-100k/u.data``.

    Users and items get ids from 1 (as in MovieLens); item popularity is
    skewed; ratings 1-5 depend on a hidden user and item score, so a
    factorization model can learn them.

    Args:
      manual_dir: where to write ``ml-100k.zip`` (created if needed).
      num_users: users, each with ``ratings_per_user`` ratings of distinct items.
      num_items: items (at least ``ratings_per_user``).
      ratings_per_user: ratings per user.
      seed: seed of the ratings.

    Returns:
      The path of ``ml-100k.zip``.

    Examples:
      >>> import tempfile, zipfile, jaxcache.datasets as jd
      >>> archive = jd.write_fake_movielens(tempfile.mkdtemp(), num_users=3, num_items=10,
      ...                                   ratings_per_user=4)
      >>> len(zipfile.ZipFile(archive).read("ml-100k/u.data").splitlines())
      12
    """
    if ratings_per_user > num_items:
        raise ValueError(
            f"ratings_per_user={ratings_per_user} exceeds num_items={num_items}; a user rates "
            "each item at most once."
        )
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, num_items + 1) ** 0.8
    popularity /= popularity.sum()
    user_score, item_score = rng.normal(0, 1, num_users), rng.normal(0, 1, num_items)
    lines = []
    for user in range(num_users):
        items = rng.choice(num_items, ratings_per_user, replace=False, p=popularity)
        score = 3 + user_score[user] + item_score[items] + rng.normal(0, 0.5, items.size)
        ratings = np.clip(np.rint(score), 1, 5).astype(np.int64)
        times = 874_724_710 + np.sort(rng.integers(0, 20_000_000, items.size))
        lines += [
            f"{user + 1}\t{item + 1}\t{rating}\t{time}"
            for item, rating, time in zip(items, ratings, times, strict=True)
        ]
    manual_dir = pathlib.Path(manual_dir)
    manual_dir.mkdir(parents=True, exist_ok=True)
    archive = manual_dir / "ml-100k.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("ml-100k/u.data", "\n".join(lines) + "\n")
    return archive
