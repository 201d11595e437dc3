"""The Criteo display-advertising click logs as a TFDS dataset, and batches for DLRM.

Source format (Kaggle ``train.txt`` and the Terabyte ``day_0`` ... ``day_23``
files, optionally gzipped): one sample per line, 40 tab-separated fields: the
click label (0 or 1), 13 integer counts ``I1``-``I13`` and 26 categorical
features ``C1``-``C26`` as 32-bit hexadecimal hashes. Any field but the label
may be empty.

Stored form, per sample:

- ``"dense"``: ``float32 [13]``, ``log(1 + max(x, 0))`` of the counts, with a
  missing count read as 0 (DLRM's preprocessing);
- ``"sparse"``: ``int64 [26]``, feature ``f``'s id in ``[0, V_f)`` where
  ``V_f = vocab_sizes[f]``: an empty field is id 0 (row 0 of every feature
  is reserved for "missing"), a hash ``h`` is ``1 + h mod (V_f - 1)``,
  reduced on the host in 64-bit integers (hashes reach ``2**32``; nothing is
  ever wrapped to int32). With ``raw_ids`` (the ``"kaggle_raw"`` config)
  nothing is reduced: the id is ``f 2^33 + h``, or ``f 2^33 + 2^32`` for an
  empty field, so that no two features or values share an id (for a
  dynamic vocabulary, which gives each id a row of its own);
- ``"label"``: ``float32``, 0 or 1.

``jaxcache.datasets.to_shared_table`` moves the ids of all features into one table of
``sum(V)`` rows, the layout ``jaxcache.models.DLRM`` uses.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np
import tensorflow_datasets as tfds

from jaxcache._src.synthetic import CRITEO_KAGGLE_CARDINALITIES
from jaxcache.datasets import _tsv
from jaxcache.datasets._base import (
    DEFAULT_ROWS_PER_RECORD,
    ChunkedBuilder,
    metadata_of,
    prepare,
    rechunk,
)
from jaxcache.datasets._frequency import count_frequencies
from jaxcache.datasets._loader import Loader
from jaxcache.datasets._shared_table import shared_offsets, to_shared_table

__all__ = [
    "CRITEO_TERABYTE_CARDINALITIES",
    "CriteoBuilder",
    "CriteoConfig",
    "CriteoData",
    "criteo_batches",
    "raw_id",
]

CRITEO_TERABYTE_CARDINALITIES: tuple[int, ...] = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
    2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)  # fmt: skip
"""Rows of the 26 features of Criteo Terabyte as MLPerf DLRM caps them (40M), 204,184,588 in all."""

NUM_DENSE = 13
NUM_SPARSE = 26
_COLUMNS = 1 + NUM_DENSE + NUM_SPARSE
_DENSE_COLUMNS, _DENSE_NAMES = range(1, 1 + NUM_DENSE), [f"I{j + 1}" for j in range(NUM_DENSE)]
_SPARSE_COLUMNS = range(1 + NUM_DENSE, _COLUMNS)
_SPARSE_NAMES = [f"C{j + 1}" for j in range(NUM_SPARSE)]
MISSING_ID = 0
"""Id of an empty categorical field: row 0 of every feature is reserved for it."""

_KAGGLE_FILES = ("train.txt", "train.txt.gz")
_DAY_FILE = re.compile(r"day_(\d+)(\.gz)?")
_EXPECTED = (
    "the Criteo click logs: the Kaggle 'train.txt' (from dac.tar.gz) or Terabyte files "
    "'day_0' ... 'day_23', each optionally gzipped ('train.txt.gz', 'day_0.gz')"
)


@dataclasses.dataclass(eq=False)
class CriteoConfig(tfds.core.BuilderConfig):
    """How Criteo files are turned into records.

    The config's ``name`` names the folder of the built data: give a config
    with other values another name.

    Attributes:
      vocab_sizes: ``V_f``, rows of each of the 26 categorical features
        (row 0 is the missing value); default: Criteo Kaggle's cardinalities.
      skip_malformed: drop malformed lines and count them (in
        ``info.metadata["skipped"]``) instead of raising ``DataFormatError``.
      rows_per_record: rows stored in one record.
      raw_ids: keep the hashes, feature by feature, as raw int64 ids
        (``raw_id``) instead of reducing them modulo ``vocab_sizes``.

    Examples:
      >>> import jaxcache.datasets as jd
      >>> config = jd.CriteoConfig(name="small", vocab_sizes=(1000,) * 26, skip_malformed=True)
      >>> config.vocab_sizes[:2], config.rows_per_record
      ((1000, 1000), 4096)
      >>> jd.CriteoConfig(name="bad", vocab_sizes=(1,) * 26)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ValueError: vocab_sizes[0]=1 is too small: a feature needs row 0 for a missing value ...
    """

    vocab_sizes: tuple[int, ...] = CRITEO_KAGGLE_CARDINALITIES
    skip_malformed: bool = False
    rows_per_record: int = DEFAULT_ROWS_PER_RECORD
    raw_ids: bool = False

    def __post_init__(self) -> None:
        sizes = tuple(self.vocab_sizes)
        if len(sizes) != NUM_SPARSE:
            raise ValueError(
                f"vocab_sizes has {len(sizes)} entries; Criteo has {NUM_SPARSE} categorical "
                "features, give one vocabulary size per feature."
            )
        for f, size in enumerate(sizes):
            if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 2:
                raise ValueError(
                    f"vocab_sizes[{f}]={size!r} is too small: a feature needs row "
                    f"{MISSING_ID} for a missing value and at least one row for ids; use >= 2."
                )
        object.__setattr__(self, "vocab_sizes", tuple(int(s) for s in sizes))
        if self.rows_per_record < 1:
            raise ValueError(f"rows_per_record must be >= 1, got {self.rows_per_record}.")


class CriteoBuilder(ChunkedBuilder):
    """Criteo display-advertising click logs (Kaggle or Terabyte), built from local files.

    Put the Kaggle ``train.txt`` (extracted from ``dac.tar.gz``) or the
    Terabyte ``day_N`` files, plain or gzipped, in a directory and pass it as
    ``manual_dir`` to ``jaxcache.datasets.prepare``. ``train.txt`` becomes the
    split ``"train"`` and ``day_N`` the split ``"day_N"`` (combine them as
    ``"day_0+day_1"``); records keep the file order, so ``"train[90%:]"`` is
    the latest tenth. See the module docstring for the stored features.

    ``info.metadata`` holds ``rows`` and ``skipped`` (malformed lines) per
    split, ``skipped_examples`` (the first few, with their problem),
    ``cardinalities`` (``{"sparse": vocab_sizes}``) and ``missing_id``.

    Examples:
      >>> import pathlib, tempfile, numpy as np, jaxcache.datasets as jd
      >>> manual = pathlib.Path(tempfile.mkdtemp())
      >>> line = "\\t".join(["1", *["3"] * 13, *["68fd1e64"] * 26])
      >>> _ = (manual / "train.txt").write_text(f"{line}\\n{line}\\n")
      >>> builder = jd.CriteoBuilder(config="kaggle", data_dir=tempfile.mkdtemp())
      >>> chunk = jd.prepare(builder, manual).as_data_source("train")[0]
      >>> chunk["sparse"].shape, int(chunk["sparse"][0, 2]) == 1 + 0x68FD1E64 % (10131227 - 1)
      ((2, 26), True)
      >>> builder.info.metadata["rows"]
      {'train': 2}
    """

    name = "criteo"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {
        "1.0.0": "Chunked records; ids reduced modulo the vocabulary, 0 = missing."
    }
    BUILDER_CONFIGS: ClassVar[list[tfds.core.BuilderConfig]] = [
        CriteoConfig(name="kaggle", description="Criteo Kaggle cardinalities."),
        CriteoConfig(
            name="terabyte",
            vocab_sizes=CRITEO_TERABYTE_CARDINALITIES,
            description="MLPerf's Criteo Terabyte cardinalities (capped at 40M).",
        ),
        CriteoConfig(
            name="kaggle_raw",
            raw_ids=True,
            description="Raw ids: each feature's 32-bit hashes, unreduced (raw_id).",
        ),
    ]
    DEFAULT_CONFIG_NAME = "kaggle"
    MANUAL_DOWNLOAD_INSTRUCTIONS = f"Put {_EXPECTED} in the manual directory."

    def _features(self) -> dict[str, tuple[tuple[int | None, ...], type]]:
        return {
            "dense": ((None, NUM_DENSE), np.float32),
            "sparse": ((None, NUM_SPARSE), np.int64),
            "label": ((None,), np.float32),
        }

    def _split_generators(self, dl_manager: Any) -> dict[str, Iterator[tuple[int, dict]]]:
        root = self._manual_root(dl_manager, _EXPECTED)
        files: dict[str, Any] = {}
        for path in sorted(root.iterdir(), key=lambda p: p.name):
            match = _DAY_FILE.fullmatch(path.name)
            split = "train" if path.name in _KAGGLE_FILES else match and f"day_{int(match[1])}"
            if not split:
                continue
            if split in files:
                raise FileNotFoundError(
                    f"{root} holds both {files[split].name!r} and {path.name!r} for the split "
                    f"{split!r}; keep one of them."
                )
            files[split] = path
        if not files:
            raise self._missing(dl_manager, _EXPECTED)
        metadata = self.info.metadata
        config = self.builder_config
        metadata["cardinalities"] = {"sparse": None if config.raw_ids else list(config.vocab_sizes)}
        metadata["missing_id"] = MISSING_ID
        metadata["raw_ids"] = config.raw_ids
        metadata["files"] = {split: path.name for split, path in files.items()}
        return {split: self._generate_examples(split, path) for split, path in files.items()}

    def _generate_examples(self, split: str, path: Any) -> Iterator[tuple[int, dict]]:
        config = self.builder_config
        vocab = None if config.raw_ids else config.vocab_sizes
        parsed = _ParsedFile(path, vocab, skip=config.skip_malformed)
        rows = 0
        for index, chunk in enumerate(rechunk(parsed, config.rows_per_record)):
            rows += len(chunk["label"])
            yield index, chunk
        if rows == 0:
            problem = (
                f"no well-formed line ({parsed.skipped} malformed lines skipped)"
                if parsed.skipped
                else "the file is empty"
            )
            raise _tsv.DataFormatError(
                path,
                None,
                f"{problem}; it must hold Criteo click logs, one per line: a label, 13 "
                "integers and 26 hexadecimal ids separated by tabs.",
            )
        self._record_meta("rows", split, rows)
        self._record_meta("skipped", split, parsed.skipped)
        self._record_meta("skipped_examples", split, parsed.examples)


class _ParsedFile:
    """Iterates over the parsed blocks of one Criteo file; counts skipped lines."""

    def __init__(self, path: Any, vocab_sizes: Sequence[int] | None, *, skip: bool) -> None:
        self.path = os.fspath(path)
        self.vocab = None if vocab_sizes is None else np.asarray(vocab_sizes, np.uint64)
        self.skip = skip
        self.skipped = 0
        self.examples: list[str] = []

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        for first_line, raw in _tsv.read_blocks(self.path):
            yield self.parse(_tsv.split_block(raw, first_line, _COLUMNS))

    def parse(self, block: _tsv.Block) -> dict[str, np.ndarray]:
        """The block's samples in stored form, malformed lines removed or raised."""
        label = block.integers(range(1), ["label"])[:, 0]
        block.mark(
            range(1), ((label < 0) | (label > 1))[:, None], ["column 1 (label) must be 0 or 1"]
        )
        counts = block.integers(_DENSE_COLUMNS, _DENSE_NAMES, allow_empty=True)
        hashes, empty = block.hexadecimal(_SPARSE_COLUMNS, _SPARSE_NAMES)
        if self.vocab is None:
            # A raw id holds its feature above bit 33: a value of 2^32 or
            # more would take another feature's id (or the empty field's).
            block.mark(
                _SPARSE_COLUMNS,
                hashes >= np.uint64(1 << 32),
                [
                    f"column {c + 1} ({n}) must be a 32-bit hexadecimal hash (below 2^32: at most "
                    "8 significant digits), or empty, for raw ids, which keep it unreduced"
                    for c, n in zip(_SPARSE_COLUMNS, _SPARSE_NAMES, strict=True)
                ],
            )
            ids = raw_id(np.arange(NUM_SPARSE), np.where(empty, np.uint64(1 << 32), hashes))
        else:
            reduced = (hashes % (self.vocab - np.uint64(1)) + np.uint64(1)).astype(np.int64)
            ids = np.where(empty, MISSING_ID, reduced)
        keep, dropped, examples = block.check(self.path, skip=self.skip)
        self.skipped += dropped
        self.examples.extend(examples[: _tsv.MAX_EXAMPLES - len(self.examples)])
        return {
            "dense": np.log1p(np.maximum(counts[keep], 0).astype(np.float32)),
            "sparse": ids[keep],
            "label": label[keep].astype(np.float32),
        }


_RAW_BATCHES = (
    "criteo_batches lays the ids out for one table of sum(vocab_sizes) rows, which raw ids "
    "have not; read a raw-id dataset's records with jaxcache.datasets.Loader("
    "builder.as_data_source(split), batch_size) instead."
)


def raw_id(feature: Any, value: Any) -> np.ndarray:
    """The raw int64 id of a categorical ``value`` (a 32-bit hash, or
    ``2^32`` for an empty field) of ``feature`` (0-25): ``feature 2^33 +
    value``, unique over features and values.

    Examples:
      >>> raw_id(2, 0x68FD1E64).item() == 2 * 2**33 + 0x68FD1E64
      True
    """
    return (np.asarray(feature, np.int64) << 33) + np.asarray(value, np.uint64).astype(np.int64)


class CriteoData(NamedTuple):
    """Batches of a Criteo-shaped split, laid out for one shared embedding table.

    Attributes:
      batches: iterator of ``{"dense": float32 [B, 13], "sparse": int64 [B, F]
        (or [B, F, L]), "label": float32 [B]}`` with ``sparse`` already
        moved into the shared table (``to_shared_table``).
      cardinalities: ``V_f`` of each feature.
      offsets: ``int64 [F]``, first row of each feature in the shared table.
      num_embeddings: ``N = sum(cardinalities)``, rows of the shared table.
      frequencies: ``int64 [N]`` access counts over the split (for the
        ``"frequency"`` policy and warming), or ``None``.
      padding_id: bag padding of multi-hot data, or ``None``.
      builder: the prepared TFDS builder.

    Examples:
      >>> import tempfile, jaxcache.datasets as jd
      >>> config = jd.SyntheticCriteoConfig(name="tiny", scale=0.001, num_rows=64,
      ...                                   num_test_rows=16)
      >>> builder = jd.prepare(jd.SyntheticCriteoBuilder(config=config,
      ...                                                data_dir=tempfile.mkdtemp()))
      >>> data = jd.criteo_batches(builder=builder, batch_size=32)
      >>> type(data).__name__, data.num_embeddings, data.frequencies.sum()
      ('CriteoData', 33803, np.int64(1664))
    """

    batches: Iterator[dict[str, np.ndarray]]
    cardinalities: tuple[int, ...]
    offsets: np.ndarray
    num_embeddings: int
    frequencies: np.ndarray | None
    padding_id: int | None
    builder: tfds.core.DatasetBuilder


def criteo_batches(
    manual_dir: str | os.PathLike[str] | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    batch_size: int = 1024,
    *,
    split: str = "train",
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = 1,
    drop_remainder: bool = True,
    config: str | CriteoConfig = "kaggle",
    frequencies: bool = True,
    frequency_split: str | None = None,
    frequency_sample_rate: float = 1.0,
    window: int = 16,
    builder: tfds.core.DatasetBuilder | None = None,
) -> CriteoData:
    """Criteo batches for DLRM: builds the dataset once, then streams a split.

    Builds ``CriteoBuilder(config, data_dir)`` from the files in
    ``manual_dir`` unless already built, counts the ids' frequencies over
    ``frequency_split`` (cached next to the dataset), and returns batches
    whose ids index one table of ``sum(cardinalities)`` rows.

    Args:
      manual_dir: directory with ``train.txt`` or ``day_N`` (see
        ``CriteoBuilder``).
      data_dir: where the built dataset lives (TFDS's default when ``None``).
      batch_size: ``B``.
      split: the split to read, e.g. ``"train"``, ``"train[:90%]"``,
        ``"day_0+day_1"``.
      seed: seed of the shuffling (each epoch reshuffles).
      shuffle: shuffle the record order and rows within a window of records.
      num_epochs: passes over the split; ``None`` repeats forever.
      drop_remainder: drop the last, smaller batch of each epoch.
      config: a ``CriteoConfig`` or the name of a built-in one (``"kaggle"``,
        ``"terabyte"``).
      frequencies: count the ids' frequencies (``CriteoData.frequencies``).
      frequency_split: split counted (default: ``split``).
      frequency_sample_rate: fraction of the samples counted.
      window: records shuffled together (see ``Loader``).
      builder: a prepared Criteo-shaped builder to read instead (e.g. a
        ``SyntheticCriteoBuilder``), without ``manual_dir`` and ``data_dir``.

    Returns:
      A ``CriteoData``.

    Examples:
      >>> import pathlib, tempfile, jaxcache.datasets as jd
      >>> manual = pathlib.Path(tempfile.mkdtemp())
      >>> lines = ["\\t".join([str(i % 2), *[str(i)] * 13, *[f"{i:08x}"] * 26])
      ...          for i in range(10)]
      >>> _ = (manual / "train.txt").write_text("\\n".join(lines) + "\\n")
      >>> data = jd.criteo_batches(manual, tempfile.mkdtemp(), batch_size=4, shuffle=False)
      >>> [b["sparse"].shape for b in data.batches]
      [(4, 26), (4, 26)]
      >>> data.num_embeddings, int(data.frequencies.sum())
      (33762577, 260)
    """
    if builder is not None and (manual_dir is not None or data_dir is not None):
        raise ValueError(
            "pass either builder= (a prepared dataset) or manual_dir/data_dir (to build one), "
            "not both."
        )
    raw = config == "kaggle_raw" or (isinstance(config, CriteoConfig) and config.raw_ids)
    if builder is None and raw:
        raise ValueError(_RAW_BATCHES)
    if builder is None:
        builder = prepare(
            CriteoBuilder(
                config=config, data_dir=None if data_dir is None else os.fspath(data_dir)
            ),
            manual_dir,
        )
    metadata = metadata_of(builder)
    if metadata.get("raw_ids"):
        raise ValueError(_RAW_BATCHES)
    cardinalities = tuple(int(c) for c in metadata["cardinalities"]["sparse"])
    padding_id = metadata.get("padding_id")
    counts = None
    if frequencies:
        counts = count_frequencies(
            builder,
            split if frequency_split is None else frequency_split,
            sample_rate=frequency_sample_rate,
            seed=seed,
        )
    loader = Loader(
        builder.as_data_source(split),
        batch_size,
        shuffle=shuffle,
        seed=seed,
        window=window,
        drop_remainder=drop_remainder,
        num_epochs=num_epochs,
        keys=("dense", "sparse", "label"),
    )

    def shared(batches: Iterator[dict[str, np.ndarray]]) -> Iterator[dict[str, np.ndarray]]:
        for batch in batches:
            batch["sparse"] = to_shared_table(batch["sparse"], cardinalities, padding_id=padding_id)
            yield batch

    return CriteoData(
        batches=shared(iter(loader)),
        cardinalities=cardinalities,
        offsets=shared_offsets(cardinalities),
        num_embeddings=sum(cardinalities),
        frequencies=counts,
        padding_id=padding_id,
        builder=builder,
    )
