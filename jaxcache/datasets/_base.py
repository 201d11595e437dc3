"""What the jaxcache TFDS builders share: chunked records in ArrayRecord files.

Every builder writes ``file_format="array_record"`` (the one format TFDS
writes and reads without TensorFlow) and stores many rows per record: a
record is a chunk of up to ``rows_per_record`` rows as packed NumPy arrays
(``{"dense": float32 [R, 13], ...}``), which reads about 80 times faster
than one row per record. Shuffling at write time is disabled, so records keep
the order of the source files (time order for Criteo and MovieLens): a split
slice such as ``"train[90%:]"`` is the latest 10% of the records.

The builders are not registered under their names with ``tfds.builder``
(TFDS ships an unrelated ``movielens`` builder); use the classes directly.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import tensorflow_datasets as tfds
from tensorflow_datasets.core import file_adapters

__all__ = ["ChunkedBuilder", "prepare"]

DEFAULT_ROWS_PER_RECORD = 4096
"""Rows stored in one record by default."""

_Builder = TypeVar("_Builder", bound=tfds.core.DatasetBuilder)


class ChunkedBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):  # type: ignore[call-arg]
    """Base of the builders: ArrayRecord files of row chunks, in source order.

    Subclasses define ``_features`` (field -> ``(shape, dtype)`` of one
    record, the first axis being rows), ``_split_generators`` and
    ``_generate_examples``, and fill ``info.metadata`` (``rows`` per split,
    ``cardinalities`` per id field). Arrays are stored as TFDS tensors in
    a ``tf.train.Example`` (varint integers: ids take 1-4 bytes each), which
    read about 40% faster than raw bytes (``Encoding.BYTES``) because the
    records are smaller to decompress; raw bytes would build faster.
    """

    def __init__(self, *, file_format: str | file_adapters.FileFormat = "array_record", **kwargs):
        if (
            file_adapters.FileFormat.from_value(file_format)
            != file_adapters.FileFormat.ARRAY_RECORD
        ):
            raise ValueError(
                f"file_format={file_format!r} is not supported: {type(self).__name__} writes "
                "'array_record', the format TFDS reads without TensorFlow (through "
                "builder.as_data_source(split)); leave file_format unset."
            )
        super().__init__(file_format=file_format, **kwargs)

    def _features(self) -> dict[str, tuple[tuple[int | None, ...], type]]:
        raise NotImplementedError

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=(type(self).__doc__ or "").split("\n\n", 1)[0],
            features=tfds.features.FeaturesDict(
                {
                    name: tfds.features.Tensor(shape=shape, dtype=dtype)
                    for name, (shape, dtype) in self._features().items()
                }
            ),
            metadata=tfds.core.MetadataDict(),
            disable_shuffling=True,
        )

    def _record_meta(self, key: str, split: str, value: Any) -> None:
        """Sets ``info.metadata[key][split]`` (per-split statistics)."""
        self.info.metadata.setdefault(key, {})[split] = value

    def _manual_root(self, dl_manager: Any, expected: str) -> pathlib.Path:
        """The manual directory, or an error naming ``expected`` files and where to put them."""
        try:
            return pathlib.Path(os.fspath(dl_manager.manual_dir))
        except AssertionError:  # TFDS: the manual directory is missing or empty
            raise self._missing(dl_manager, expected) from None

    def _missing(self, dl_manager: Any, expected: str) -> FileNotFoundError:
        """The error for missing source files."""
        # TFDS only exposes the manual directory once it exists and is not empty.
        where = getattr(dl_manager, "_manual_dir", None)
        return FileNotFoundError(
            f"{self.name} ({self.builder_config.name}) needs {expected} in the manual "
            f"directory {os.fspath(where) if where else '(not set)'}; put the files there and "
            "pass the directory as jaxcache.datasets.prepare(builder, manual_dir=...) (or "
            "download_config=tfds.download.DownloadConfig(manual_dir=...)). Nothing is "
            "downloaded."
        )


def prepare(
    builder: _Builder, manual_dir: str | os.PathLike[str] | None = None, *, verbose: bool = False
) -> _Builder:
    """Builds ``builder``'s dataset from the files in ``manual_dir`` (once).

    A thin wrapper over ``builder.download_and_prepare``: nothing is
    downloaded, an existing dataset is reused, and unless ``verbose`` the
    TFDS progress bars and messages are hidden.

    Args:
      builder: a jaxcache builder (e.g. ``CriteoBuilder(data_dir=...)``).
      manual_dir: directory holding the source files; ``None`` for builders
        that need none (``SyntheticCriteoBuilder``) or TFDS's default
        ``<data_dir>/downloads/manual``.
      verbose: show TFDS's progress bars and messages.

    Returns:
      ``builder``, ready for ``builder.as_data_source(split)``.

    Examples:
      >>> import tempfile, jaxcache.datasets as jd
      >>> config = jd.SyntheticCriteoConfig(name="tiny", scale=0.001, num_rows=100,
      ...                                   num_test_rows=10)
      >>> builder = jd.prepare(jd.SyntheticCriteoBuilder(config=config,
      ...                                                data_dir=tempfile.mkdtemp()))
      >>> len(builder.as_data_source("train")), builder.info.metadata["rows"]["train"]
      (1, 100)
    """
    download_config = tfds.download.DownloadConfig(
        manual_dir=None if manual_dir is None else os.fspath(manual_dir),
        try_download_gcs=False,
    )
    if verbose:
        builder.download_and_prepare(download_config=download_config)
        return builder
    from tensorflow_datasets.core.utils import tqdm_utils

    active = getattr(tqdm_utils, "_active", True)
    tfds.display_progress_bar(False)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            builder.download_and_prepare(download_config=download_config)
    finally:
        tfds.display_progress_bar(active)
    return builder


def rechunk(
    parts: Iterable[Mapping[str, np.ndarray]], rows: int
) -> Iterator[dict[str, np.ndarray]]:
    """Regroups a stream of row blocks into chunks of exactly ``rows`` rows (the last: fewer)."""
    pending: list[Mapping[str, np.ndarray]] = []
    count = 0
    for part in parts:
        n = len(next(iter(part.values())))
        if n == 0:
            continue
        pending.append(part)
        count += n
        if count < rows:
            continue
        merged = concat_rows(pending)
        full = count - count % rows
        for lo in range(0, full, rows):
            yield {k: v[lo : lo + rows] for k, v in merged.items()}
        pending = [{k: v[full:] for k, v in merged.items()}] if full < count else []
        count -= full
    if count:
        yield concat_rows(pending)


def concat_rows(parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The rows of several chunks as one chunk (no copy for a single chunk)."""
    if len(parts) == 1:
        return dict(parts[0])
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def metadata_of(builder: tfds.core.DatasetBuilder) -> Mapping[str, Any]:
    """The builder's metadata, or a clear error when it is not a prepared jaxcache dataset."""
    metadata = builder.info.metadata
    if not metadata or "cardinalities" not in metadata:
        raise ValueError(
            f"{builder.name} at {builder.data_dir} has no jaxcache metadata; build it first with "
            "jaxcache.datasets.prepare(builder, manual_dir=...) (a jaxcache builder records "
            "its table sizes there)."
        )
    return metadata
