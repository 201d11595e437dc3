"""Access counts of the ids of a built split, computed once and kept next to the dataset."""

from __future__ import annotations

import hashlib
import os
import pathlib
import re

import numpy as np
import tensorflow_datasets as tfds

from jaxcache._src.frequency import FrequencyCounter
from jaxcache.datasets._base import metadata_of
from jaxcache.datasets._shared_table import to_shared_table

__all__ = ["count_frequencies", "frequencies_path"]


def frequencies_path(
    builder: tfds.core.DatasetBuilder,
    split: str = "train",
    *,
    key: str = "sparse",
    sample_rate: float = 1.0,
    seed: int = 0,
) -> pathlib.Path:
    """Where ``count_frequencies`` keeps its counts: ``<builder.data_dir>/frequencies/*.npy``.

    Examples:
      >>> import tempfile, jaxcache.datasets as jd
      >>> builder = jd.MovieLensBuilder(config="100k", data_dir=tempfile.mkdtemp())
      >>> jd.frequencies_path(builder, "train", key="item").name
      'item-train.npy'
      >>> jd.frequencies_path(builder, "train[:50%]", key="item", sample_rate=0.1).name
      'item-train_50-f46712e4-sample0.1-seed0.npy'
    """
    name = re.sub(r"[^A-Za-z0-9_.+-]+", "_", split).strip("_")
    if name != split:  # keep distinct split strings apart
        name += "-" + hashlib.sha1(split.encode()).hexdigest()[:8]
    if sample_rate != 1:
        name += f"-sample{sample_rate:g}-seed{seed}"
    return pathlib.Path(os.fspath(builder.data_dir)) / "frequencies" / f"{key}-{name}.npy"


def count_frequencies(
    builder: tfds.core.DatasetBuilder,
    split: str = "train",
    *,
    key: str = "sparse",
    sample_rate: float = 1.0,
    seed: int = 0,
    cache: bool = True,
) -> np.ndarray:
    """How often each row of an id field's table is looked up in a split.

    Ids of a multi-feature field (Criteo's ``"sparse"``) are counted in the
    shared table of ``sum(cardinalities)`` rows (``to_shared_table``); a
    single-feature field (MovieLens ``"user"``) in its own table. The counts
    are saved as ``.npy`` under the dataset's ``data_dir``
    (``frequencies_path``) and loaded from there on the next call.

    Args:
      builder: a prepared jaxcache builder.
      split: the split counted, e.g. ``"train"`` or ``"train[:10%]"``.
      key: the id field.
      sample_rate: fraction of the samples counted (``jaxcache.FrequencyCounter``).
      seed: seed of the sampling.
      cache: load saved counts when present, and save new ones.

    Returns:
      ``int64 [N]`` access counts, for ``jaxcache.EmbeddingCache(frequencies=...)``.

    Examples:
      >>> import tempfile, jaxcache.datasets as jd
      >>> config = jd.SyntheticCriteoConfig(name="tiny", scale=0.001, num_rows=100,
      ...                                   num_test_rows=10)
      >>> builder = jd.prepare(jd.SyntheticCriteoBuilder(config=config,
      ...                                                data_dir=tempfile.mkdtemp()))
      >>> counts = jd.count_frequencies(builder, "train")
      >>> counts.shape, int(counts.sum()), jd.frequencies_path(builder).exists()
      ((33803,), 2600, True)
    """
    metadata = metadata_of(builder)
    cardinalities = metadata["cardinalities"]
    if key not in cardinalities:
        raise KeyError(
            f"{builder.name} has no id field {key!r}; its id fields are {sorted(cardinalities)}."
        )
    sizes = [int(c) for c in cardinalities[key]]
    padding_id = metadata.get("padding_id")
    num_embeddings = sum(sizes)
    path = frequencies_path(builder, split, key=key, sample_rate=sample_rate, seed=seed)
    if cache and path.exists():
        counts = np.load(path)
        if counts.shape == (num_embeddings,):
            return counts
    counter = FrequencyCounter(
        num_embeddings, sample_rate=sample_rate, padding_id=padding_id, seed=seed
    )
    source = builder.as_data_source(split)
    for index in range(len(source)):
        ids = source[index][key]
        if ids.ndim >= 2:
            ids = to_shared_table(ids, sizes, padding_id=padding_id)
        counter.update(ids)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp.npy")
        np.save(partial, counter.counts)
        os.replace(partial, path)
    return counter.counts
