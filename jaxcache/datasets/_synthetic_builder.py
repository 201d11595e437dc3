"""``jaxcache.synthetic.SyntheticCriteo`` written as a TFDS dataset (no source files needed)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import tensorflow_datasets as tfds

from jaxcache._src.synthetic import NUM_DENSE, SyntheticCriteo
from jaxcache.datasets._base import DEFAULT_ROWS_PER_RECORD, ChunkedBuilder

__all__ = ["SyntheticCriteoBuilder", "SyntheticCriteoConfig"]


@dataclasses.dataclass(eq=False)
class SyntheticCriteoConfig(tfds.core.BuilderConfig):
    """Parameters of the synthetic stream and the size of its splits.

    The config's ``name`` names the folder of the built data: give a config
    with other values another name.

    Attributes:
      scale: fraction of each Criteo Kaggle cardinality kept.
      seed: seed of the stream (``SyntheticCriteo(seed=...)``).
      alpha: Zipf exponent of the ids.
      multi_hot: bags of DCNv2 sizes, padded with ``-1``, instead of one id.
      bag_size: ``L``, the longest bag with ``multi_hot``.
      num_rows: rows of the ``"train"`` split (the training stream).
      num_test_rows: rows of the ``"test"`` split (the held-out stream).
      rows_per_record: rows stored in one record.

    Examples:
      >>> import jaxcache.datasets as jd
      >>> jd.SyntheticCriteoConfig(name="mine", scale=0.001, num_rows=1000).num_rows
      1000
    """

    scale: float = 0.01
    seed: int = 0
    alpha: float = 1.15
    multi_hot: bool = False
    bag_size: int = 8
    num_rows: int = 1 << 20
    num_test_rows: int = 1 << 16
    rows_per_record: int = DEFAULT_ROWS_PER_RECORD

    def __post_init__(self) -> None:
        for field in ("num_rows", "num_test_rows", "rows_per_record"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}.")
        self.stream(1)  # validates the stream's parameters

    def stream(self, batch_size: int) -> SyntheticCriteo:
        """The ``SyntheticCriteo`` stream the records are drawn from."""
        return SyntheticCriteo(
            scale=self.scale,
            batch_size=batch_size,
            seed=self.seed,
            alpha=self.alpha,
            multi_hot=self.multi_hot,
            bag_size=self.bag_size,
        )


class SyntheticCriteoBuilder(ChunkedBuilder):
    """The synthetic Criteo-like stream of ``jaxcache.synthetic.SyntheticCriteo`` as a TFDS dataset.

    Split ``"train"`` holds the first ``num_rows`` rows of the training
    stream, ``"test"`` the first ``num_test_rows`` of the held-out stream,
    with the features of ``CriteoBuilder``: ``"dense"`` ``float32 [13]``,
    ``"label"`` ``float32`` and ``"sparse"`` ``int64 [26]`` (``[26, L]`` bags
    padded with ``-1`` when ``multi_hot``) with feature ``f``'s ids in
    ``[0, V_f)``; ``to_shared_table`` gives back the stream's shared-table
    ids. No source files: pass no ``manual_dir``.

    Examples:
      >>> import tempfile, numpy as np, jaxcache, jaxcache.datasets as jd
      >>> config = jd.SyntheticCriteoConfig(name="tiny", scale=0.001, num_rows=10,
      ...                                   num_test_rows=10, rows_per_record=4)
      >>> builder = jd.prepare(jd.SyntheticCriteoBuilder(config=config,
      ...                                                data_dir=tempfile.mkdtemp()))
      >>> source = builder.as_data_source("train")
      >>> len(source), source[2]["sparse"].shape
      (3, (2, 26))
      >>> stream = jaxcache.synthetic.SyntheticCriteo(scale=0.001, batch_size=4)
      >>> ids = jd.to_shared_table(source[1]["sparse"], stream.cardinalities)
      >>> bool((ids == stream.batch(1)["sparse"]).all())
      True
    """

    name = "synthetic_criteo"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {
        "1.0.0": "Chunked records of jaxcache.synthetic.SyntheticCriteo."
    }
    BUILDER_CONFIGS: ClassVar[list[tfds.core.BuilderConfig]] = [
        SyntheticCriteoConfig(name="default", description="1% of Criteo's cardinalities."),
        SyntheticCriteoConfig(
            name="multi_hot",
            multi_hot=True,
            description="1% of Criteo's cardinalities, bags of DCNv2 sizes.",
        ),
    ]
    DEFAULT_CONFIG_NAME = "default"

    def _features(self) -> dict[str, tuple[tuple[int | None, ...], type]]:
        config = self.builder_config
        stream = config.stream(1)
        return {
            "dense": ((None, NUM_DENSE), np.float32),
            "sparse": ((None, *stream.ids_shape[1:]), np.int64),
            "label": ((None,), np.float32),
        }

    def _split_generators(self, dl_manager: Any) -> dict[str, Iterator[tuple[int, dict]]]:
        del dl_manager  # nothing to read
        config = self.builder_config
        stream = config.stream(config.rows_per_record)
        metadata = self.info.metadata
        metadata["cardinalities"] = {"sparse": list(stream.cardinalities)}
        metadata["padding_id"] = stream.padding_id if config.multi_hot else None
        return {
            "train": self._generate_examples("train", config.num_rows),
            "test": self._generate_examples("test", config.num_test_rows),
        }

    def _generate_examples(self, split: str, num_rows: int) -> Iterator[tuple[int, dict]]:
        config = self.builder_config
        stream = config.stream(config.rows_per_record)
        offsets = stream.feature_offsets.reshape(-1, *([1] * (len(stream.ids_shape) - 2)))
        for index in range(-(-num_rows // config.rows_per_record)):
            batch = stream.batch(index, held_out=split == "test")
            rows = min(config.rows_per_record, num_rows - index * config.rows_per_record)
            sparse = batch["sparse"][:rows]
            if config.multi_hot:
                sparse = np.where(sparse == stream.padding_id, sparse, sparse - offsets)
            else:
                sparse = sparse - offsets
            yield (
                index,
                {
                    "dense": batch["dense"][:rows],
                    "sparse": sparse,
                    "label": batch["label"][:rows],
                },
            )
        self._record_meta("rows", split, num_rows)
