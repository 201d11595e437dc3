"""jaxcache: host-offloaded embedding tables with a device cache of hot rows.

The full table and its optimizer state live in host memory; a small set of hot
rows lives on the accelerators. Training through the cache gives the same
result as training with the whole table on device.

The names here are what a training or serving program needs; the rest is
grouped in public submodules: ``jaxcache.nnx`` and ``jaxcache.linen`` (the
Flax modules), ``device`` (state, lookups and the pure device functions),
``host`` (what configures a host table), ``planning`` (planner and policies),
``sizing`` (hit rate per capacity), ``optimizers`` (the optimizer classes),
``stats``, ``pipeline``, ``checkpoint``, ``testing`` (checks for tests),
``synthetic`` (demo data), ``models`` (DLRM) and ``datasets`` (the
``datasets`` extra).
"""

from jaxcache import (
    checkpoint,
    device,
    host,
    linen,
    models,
    nnx,
    optimizers,
    pipeline,
    planning,
    sizing,
    stats,
    synthetic,
    testing,
)
from jaxcache._src.checkpoint import Checkpointer
from jaxcache._src.config import CacheConfig, DynamicVocabulary
from jaxcache._src.device_ops import CacheState, Lookup
from jaxcache._src.engine import EmbeddingCache
from jaxcache._src.frequency import FrequencyCounter
from jaxcache._src.guards import NonFiniteError
from jaxcache._src.host_table import HostTable
from jaxcache._src.optimizers import SparseOptimizer, adagrad, adam, rowwise_adagrad, sgd
from jaxcache._src.pipeline import prefetch
from jaxcache._src.planner import CapacityError
from jaxcache._src.replay import replay
from jaxcache._src.serving import Server, serving_config
from jaxcache._src.stats import CacheStats
from jaxcache._src.tiered_table import TieredTable

__version__ = "0.2.0"

__all__ = [
    "CacheConfig",
    "DynamicVocabulary",
    "CacheState",
    "CacheStats",
    "CapacityError",
    "Checkpointer",
    "EmbeddingCache",
    "FrequencyCounter",
    "HostTable",
    "Lookup",
    "NonFiniteError",
    "Server",
    "SparseOptimizer",
    "TieredTable",
    "adagrad",
    "adam",
    "linen",
    "nnx",
    "prefetch",
    "replay",
    "rowwise_adagrad",
    "serving_config",
    "sgd",
]
