"""MovieLens ratings (GroupLens 100K and 1M) as a TFDS dataset, split by time or at random.

Source files, as GroupLens distributes them (https://grouplens.org/datasets/movielens/):

- ``ml-100k.zip`` holding ``ml-100k/u.data``: ``user item rating timestamp``
  separated by tabs;
- ``ml-1m.zip`` holding ``ml-1m/ratings.dat``: ``user::item::rating::timestamp``.

User and item ids are remapped to dense indices ``0 .. U-1`` and
``0 .. I-1`` in the order of the original ids (``info.metadata`` keeps the
original id of every index). The default split (``split="time"``, configs
``"100k"`` and ``"1m"``) is by time, per user: the latest
``floor(test_fraction * n)`` of a user's ``n`` ratings (by timestamp, ties by
item) form ``"test"``, the others ``"train"``, so every test rating is later
than the same user's training ratings. The random split (``split="random"``,
configs ``"100k_random"`` and ``"1m_random"``) holds out
``floor(test_fraction * N)`` of all ``N`` ratings, drawn uniformly with
``split_seed``, the kind of split behind most published MovieLens figures
(GroupLens's own ``u1`` .. ``u5`` files are random 80/20 splits: a config
with ``test_fraction=0.2`` matches their size). Each split is stored in time
order.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pathlib
import zipfile
from collections.abc import Iterator
from typing import Any, ClassVar, cast

import numpy as np
import tensorflow_datasets as tfds

from jaxcache.datasets import _tsv
from jaxcache.datasets._base import DEFAULT_ROWS_PER_RECORD, ChunkedBuilder, rechunk

__all__ = ["MovieLensBuilder", "MovieLensConfig", "movielens_from_recbole"]

_FIELDS = ("user", "item", "rating", "timestamp")
_RECBOLE_MEMBER = "dataset_example/ml-100k/ml-100k.inter"
_SPLITS = ("time", "random")


@dataclasses.dataclass(eq=False)
class MovieLensConfig(tfds.core.BuilderConfig):
    """Which MovieLens archive to read and how to split it.

    The config's ``name`` names the folder of the built data: give a config
    with other values another name.

    Attributes:
      archive: the zip file expected in the manual directory.
      ratings_file: the ratings inside it (also accepted extracted, under
        the manual directory).
      separator: between the fields of a line.
      test_fraction: share of the ratings held out for ``"test"``: of each
        user's latest ratings (``split="time"``) or of all ratings
        (``split="random"``).
      split: ``"time"`` (each user's latest ratings are the test split) or
        ``"random"`` (a uniform sample of all ratings is).
      split_seed: seed of the random split (unused by the time split).
      skip_malformed: drop malformed lines (counted in
        ``info.metadata["skipped"]``) instead of raising ``DataFormatError``.
      rows_per_record: rows stored in one record.

    Examples:
      >>> import jaxcache.datasets as jd
      >>> config = jd.MovieLensConfig(name="100k_20", test_fraction=0.2)
      >>> config.archive, config.ratings_file, config.split
      ('ml-100k.zip', 'ml-100k/u.data', 'time')
      >>> jd.MovieLensConfig(name="100k_shuffled", split="shuffled")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ValueError: split='shuffled' is not a MovieLens split; use 'time' ...
    """

    archive: str = "ml-100k.zip"
    ratings_file: str = "ml-100k/u.data"
    separator: str = "\t"
    test_fraction: float = 0.1
    skip_malformed: bool = False
    rows_per_record: int = DEFAULT_ROWS_PER_RECORD
    split: str = "time"
    split_seed: int = 0

    def __post_init__(self) -> None:
        if self.split not in _SPLITS:
            raise ValueError(
                f"split={self.split!r} is not a MovieLens split; use 'time' (each user's latest "
                "ratings are the test split) or 'random' (a seeded sample of all ratings is)."
            )
        if not 0 <= self.test_fraction < 1:
            raise ValueError(
                f"test_fraction={self.test_fraction} must be in [0, 1), e.g. 0.1 for the "
                "latest 10% of each user's ratings."
            )
        if self.rows_per_record < 1:
            raise ValueError(f"rows_per_record must be >= 1, got {self.rows_per_record}.")
        if isinstance(self.split_seed, bool) or not isinstance(self.split_seed, int | np.integer):
            raise ValueError(f"split_seed={self.split_seed!r} must be an int, e.g. 0.")


class MovieLensBuilder(ChunkedBuilder):
    """MovieLens 100K or 1M ratings from the GroupLens zip files, split by time or at random.

    Put ``ml-100k.zip`` (configs ``"100k"`` and ``"100k_random"``) or
    ``ml-1m.zip`` (configs ``"1m"`` and ``"1m_random"``) in a directory and
    pass it as ``manual_dir`` to ``jaxcache.datasets.prepare``. Records hold
    ``"user"`` and ``"item"`` (``int64``, dense indices), ``"rating"``
    (``float32``) and ``"timestamp"`` (``int64``, seconds). ``info.metadata`` holds
    ``cardinalities`` (``{"user": [U], "item": [I]}``), ``num_users``,
    ``num_items``, ``user_ids`` and ``item_ids`` (original id of each index),
    ``rows`` and ``skipped`` per split, ``split``, ``split_seed`` and
    ``test_fraction``. See the module docstring for the two splits; each
    config builds its own folder, so one split is never read for the other.

    Examples:
      >>> import pathlib, tempfile, zipfile, jaxcache.datasets as jd
      >>> manual = pathlib.Path(tempfile.mkdtemp())
      >>> lines = [f"{u}\\t{i}\\t{1 + (u + i) % 5}\\t{1000 + 10 * i}"
      ...          for u in (7, 9) for i in range(10, 30)]
      >>> with zipfile.ZipFile(manual / "ml-100k.zip", "w") as z:
      ...     z.writestr("ml-100k/u.data", "\\n".join(lines) + "\\n")
      >>> builder = jd.prepare(jd.MovieLensBuilder(config="100k", data_dir=tempfile.mkdtemp()),
      ...                      manual)
      >>> builder.info.metadata["rows"], builder.info.metadata["cardinalities"]
      ({'train': 36, 'test': 4}, {'user': [2], 'item': [20]})
      >>> test = builder.as_data_source("test")[0]
      >>> test["user"].tolist(), test["item"].tolist()
      ([0, 1, 0, 1], [18, 18, 19, 19])
    """

    name = "movielens"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {
        "1.0.0": "Chunked records; dense ids; per-user time split."
    }
    BUILDER_CONFIGS: ClassVar[list[tfds.core.BuilderConfig]] = [
        MovieLensConfig(
            name=f"{size}{suffix}",
            split=split,
            description=f"MovieLens {size.upper()} ({counts}), {how}.",
            **cast(dict[str, Any], files),
        )
        for size, counts, files in (
            ("100k", "943 users, 1682 movies", {}),
            (
                "1m",
                "6040 users, 3706 movies",
                {"archive": "ml-1m.zip", "ratings_file": "ml-1m/ratings.dat", "separator": "::"},
            ),
        )
        for split, suffix, how in (
            ("time", "", "each user's latest 10% of ratings held out"),
            ("random", "_random", "a random 10% of the ratings held out"),
        )
    ]
    DEFAULT_CONFIG_NAME = "100k"
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Put the GroupLens archive (ml-100k.zip or ml-1m.zip, from "
        "https://grouplens.org/datasets/movielens/) in the manual directory."
    )

    def _features(self) -> dict[str, tuple[tuple[int | None, ...], type]]:
        return {
            "user": ((None,), np.int64),
            "item": ((None,), np.int64),
            "rating": ((None,), np.float32),
            "timestamp": ((None,), np.int64),
        }

    def _split_generators(self, dl_manager: Any) -> dict[str, Iterator[tuple[int, dict]]]:
        config = self.builder_config
        expected = f"{config.archive!r} (holding {config.ratings_file!r})"
        root = self._manual_root(dl_manager, expected)
        text, where = self._read_ratings(root, dl_manager, expected)
        user, item, rating, timestamp, skipped, examples = _parse(
            text, where, config.separator, skip=config.skip_malformed
        )
        user_ids, user = np.unique(user, return_inverse=True)
        item_ids, item = np.unique(item, return_inverse=True)
        if config.split == "time":
            test = _latest_per_user(user, item, timestamp, config.test_fraction)
        else:
            test = _random_sample(len(user), config.test_fraction, config.split_seed)
        metadata = self.info.metadata
        metadata["cardinalities"] = {"user": [len(user_ids)], "item": [len(item_ids)]}
        metadata["num_users"], metadata["num_items"] = len(user_ids), len(item_ids)
        metadata["user_ids"], metadata["item_ids"] = user_ids.tolist(), item_ids.tolist()
        metadata["skipped"], metadata["skipped_examples"] = skipped, examples
        metadata["test_fraction"] = config.test_fraction
        metadata["split"], metadata["split_seed"] = config.split, config.split_seed
        columns = {"user": user, "item": item, "rating": rating, "timestamp": timestamp}
        return {
            split: self._generate_examples(split, columns, mask)
            for split, mask in (("train", ~test), ("test", test))
            if mask.any()
        }

    def _read_ratings(self, root: pathlib.Path, dl_manager: Any, expected: str):
        config = self.builder_config
        archive = root / config.archive
        if archive.exists():
            with zipfile.ZipFile(archive) as z:
                try:
                    return z.read(config.ratings_file), f"{archive}:{config.ratings_file}"
                except KeyError:
                    raise FileNotFoundError(
                        f"{archive} holds no {config.ratings_file!r} (it has "
                        f"{sorted(z.namelist())[:5]}...); use the GroupLens archive "
                        f"{config.archive!r} as distributed."
                    ) from None
        extracted = root / config.ratings_file
        if extracted.exists():
            return extracted.read_bytes(), os.fspath(extracted)
        raise self._missing(dl_manager, expected)

    def _generate_examples(
        self, split: str, columns: dict[str, np.ndarray], mask: np.ndarray
    ) -> Iterator[tuple[int, dict]]:
        chosen = np.flatnonzero(mask)
        order = chosen[np.lexsort((columns["item"][chosen], columns["timestamp"][chosen]))]
        rows = {k: v[order] for k, v in columns.items()}
        yield from enumerate(rechunk([rows], self.builder_config.rows_per_record))
        self._record_meta("rows", split, len(order))


def _parse(text: bytes, where: str, separator: str, *, skip: bool):
    """Columns of a ratings file: user, item, rating (float32), timestamp."""
    if not text.strip():
        raise _tsv.DataFormatError(where, None, "the ratings file is empty.")
    if separator != "\t":
        text = text.replace(separator.encode(), b"\t")
    if not text.endswith(b"\n"):
        text += b"\n"
    block = _tsv.split_block(text, 1, len(_FIELDS))
    user, item, rating, timestamp = block.integers(range(len(_FIELDS)), _FIELDS).T
    keep, skipped, examples = block.check(where, skip=skip)
    if not keep.any():
        raise _tsv.DataFormatError(where, None, f"no well-formed line ({skipped} skipped).")
    return (
        user[keep],
        item[keep],
        rating[keep].astype(np.float32),
        timestamp[keep],
        skipped,
        examples,
    )


def _latest_per_user(
    user: np.ndarray, item: np.ndarray, timestamp: np.ndarray, fraction: float
) -> np.ndarray:
    """``bool`` mask of each user's latest ``floor(fraction * n)`` ratings."""
    order = np.lexsort((item, timestamp, user))
    counts = np.bincount(user)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    sorted_user = user[order]
    rank = np.arange(len(order)) - first[sorted_user]
    held = np.floor(fraction * counts).astype(np.int64)
    test = np.zeros(len(user), bool)
    test[order] = rank >= counts[sorted_user] - held[sorted_user]
    return test


def _random_sample(size: int, fraction: float, seed: int) -> np.ndarray:
    """``bool`` mask of ``floor(fraction * size)`` positions drawn uniformly with ``seed``."""
    test = np.zeros(size, bool)
    held = int(np.floor(fraction * size))
    test[np.random.default_rng(seed).choice(size, held, replace=False)] = True
    return test


def movielens_from_recbole(
    wheel: str | os.PathLike[str], manual_dir: str | os.PathLike[str]
) -> pathlib.Path:
    """Writes ``ml-100k.zip`` (GroupLens layout) from a RecBole wheel's copy of MovieLens 100K.

    The RecBole 1.2.1 wheel on PyPI ships the 100,000 ratings of MovieLens
    100K as ``recbole/dataset_example/ml-100k/ml-100k.inter``. Get the wheel
    with ``pip download --no-deps recbole==1.2.1`` (nothing is installed);
    this opens it as a zip and writes ``manual_dir/ml-100k.zip`` holding
    ``ml-100k/u.data`` for ``MovieLensBuilder(config="100k")``. MovieLens is
    distributed by GroupLens under its own terms of use: read them before use.

    Args:
      wheel: path of ``recbole-1.2.1-py3-none-any.whl``.
      manual_dir: where to write ``ml-100k.zip`` (created if needed).

    Returns:
      The path of ``ml-100k.zip``.

    Examples:
      >>> import pathlib, tempfile, zipfile, jaxcache.datasets as jd
      >>> tmp = pathlib.Path(tempfile.mkdtemp())
      >>> inter = ("user_id:token\\titem_id:token\\trating:float\\ttimestamp:float\\n"
      ...          "196\\t242\\t3\\t881250949\\n")
      >>> wheel = tmp / "recbole-1.2.1-py3-none-any.whl"
      >>> with zipfile.ZipFile(wheel, "w") as z:
      ...     z.writestr("recbole/dataset_example/ml-100k/ml-100k.inter", inter)
      >>> archive = jd.movielens_from_recbole(wheel, tmp / "manual")
      >>> zipfile.ZipFile(archive).read("ml-100k/u.data")
      b'196\\t242\\t3\\t881250949\\n'
    """
    wheel = pathlib.Path(wheel)
    try:
        with zipfile.ZipFile(wheel) as z:
            members = [n for n in z.namelist() if n.endswith(_RECBOLE_MEMBER)]
            if not members:
                raise FileNotFoundError(
                    f"{wheel} holds no {_RECBOLE_MEMBER!r}; use the RecBole 1.2.1 wheel: "
                    "pip download --no-deps recbole==1.2.1"
                )
            text = z.read(members[0]).decode("utf-8")
    except zipfile.BadZipFile:
        raise ValueError(
            f"{wheel} is not a wheel (zip) file; get it with pip download --no-deps recbole==1.2.1"
        ) from None
    lines = text.splitlines()
    if not lines:
        raise _tsv.DataFormatError(f"{wheel}:{members[0]}", None, "the file is empty.")
    header = [field.split(":", 1)[0] for field in lines[0].split("\t")]
    wanted = ("user_id", "item_id", "rating", "timestamp")
    missing = [name for name in wanted if name not in header]
    if missing:
        raise _tsv.DataFormatError(
            f"{wheel}:{members[0]}", 1, f"the header {lines[0]!r} lacks the columns {missing}."
        )
    columns = [header.index(name) for name in wanted]
    out = io.StringIO()
    for number, line in enumerate(lines[1:], start=2):
        fields = line.split("\t")
        if not line.strip():
            continue
        try:
            values = [fields[c] for c in columns]
            out.write("\t".join(str(int(float(v))) for v in values) + "\n")
        except (IndexError, ValueError):
            raise _tsv.DataFormatError(
                f"{wheel}:{members[0]}",
                number,
                f"expected {len(header)} tab-separated numbers, got {line!r}.",
            ) from None
    manual_dir = pathlib.Path(manual_dir)
    manual_dir.mkdir(parents=True, exist_ok=True)
    archive = manual_dir / "ml-100k.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("ml-100k/u.data", out.getvalue())
    return archive
