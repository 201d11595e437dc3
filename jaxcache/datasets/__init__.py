"""Datasets for jaxcache: TFDS builders, fast NumPy batches and id frequencies.

Three TFDS builders write ArrayRecord files (built and read without
TensorFlow), many rows per record:

- ``CriteoBuilder``: the Criteo click logs (Kaggle ``train.txt``, Terabyte
  ``day_N``) from local files, hashed ids reduced modulo a vocabulary;
- ``MovieLensBuilder``: MovieLens 100K/1M ratings from the GroupLens zips,
  split by time (default) or at random;
- ``SyntheticCriteoBuilder``: the synthetic ``jaxcache.synthetic.SyntheticCriteo``
  stream, no files needed.

``prepare`` builds one, ``Loader`` streams fixed-size batches of a split,
``count_frequencies`` counts ids for the ``"frequency"`` policy (cached next
to the data), and ``criteo_batches`` does all three for DLRM.

They need the ``datasets`` extra: ``pip install "jaxcache[datasets]"``.
"""

try:
    import tensorflow_datasets  # noqa: F401
except ModuleNotFoundError as error:
    # tensorflow-datasets imports importlib_resources without declaring it.
    if error.name not in ("tensorflow_datasets", "importlib_resources"):
        raise
    raise ImportError(
        f"jaxcache.datasets needs tensorflow-datasets, which could not be imported (no module "
        f'named {error.name!r}); install the datasets extra: pip install "jaxcache[datasets]"',
        name=error.name,
    ) from error

from jaxcache.datasets._base import prepare
from jaxcache.datasets._criteo import (
    CRITEO_TERABYTE_CARDINALITIES,
    CriteoBuilder,
    CriteoConfig,
    CriteoData,
    criteo_batches,
    raw_id,
)
from jaxcache.datasets._fake import write_fake_criteo, write_fake_movielens
from jaxcache.datasets._frequency import count_frequencies, frequencies_path
from jaxcache.datasets._loader import Loader
from jaxcache.datasets._movielens import MovieLensBuilder, MovieLensConfig, movielens_from_recbole
from jaxcache.datasets._shared_table import shared_offsets, to_shared_table
from jaxcache.datasets._synthetic_builder import SyntheticCriteoBuilder, SyntheticCriteoConfig
from jaxcache.datasets._tsv import DataFormatError

__all__ = [
    "CRITEO_TERABYTE_CARDINALITIES",
    "CriteoBuilder",
    "CriteoConfig",
    "CriteoData",
    "DataFormatError",
    "Loader",
    "MovieLensBuilder",
    "MovieLensConfig",
    "SyntheticCriteoBuilder",
    "SyntheticCriteoConfig",
    "count_frequencies",
    "criteo_batches",
    "frequencies_path",
    "movielens_from_recbole",
    "prepare",
    "raw_id",
    "shared_offsets",
    "to_shared_table",
    "write_fake_criteo",
    "write_fake_movielens",
]
