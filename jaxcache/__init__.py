"""jaxcache: host-offloaded embedding tables with a device cache of hot rows.

The full table and its optimizer state live in host memory; a small set of hot
rows lives on the accelerators. Training through the cache gives the same
result as training with the whole table on device.
"""

from jaxcache import linen, models, nnx
from jaxcache._src.checkpoint import Checkpointer, CheckpointInfo
from jaxcache._src.config import POLICIES, CacheConfig
from jaxcache._src.device_ops import (
    CacheState,
    Lookup,
    apply_sparse,
    embed,
    lookup_rows,
    pool,
    swap,
)
from jaxcache._src.dram_tier import TierStats
from jaxcache._src.engine import EmbeddingCache, Staged, bucket_size
from jaxcache._src.frequency import FrequencyCounter, hottest
from jaxcache._src.guards import (
    FiniteCheck,
    NonFiniteError,
    check_invariants,
    raise_if_nonfinite,
)
from jaxcache._src.host_table import HostTable, embed_init, normal_init, uniform_init
from jaxcache._src.metrics import roc_auc
from jaxcache._src.optimizers import (
    SGD,
    Adagrad,
    Adam,
    RowStateSpec,
    RowwiseAdagrad,
    SparseOptimizer,
    adagrad,
    adam,
    rowwise_adagrad,
    sgd,
)
from jaxcache._src.pipeline import CacheHolder, Prefetcher, prefetch
from jaxcache._src.placement import process_shard
from jaxcache._src.planner import CapacityError, Plan, Planner
from jaxcache._src.replay import plot_curve, replay, sweep
from jaxcache._src.row_log import DiskStats
from jaxcache._src.serving import Server, serving_config
from jaxcache._src.stats import CacheStats, PhaseTimers, StepStats, compilations
from jaxcache._src.synthetic import (
    CRITEO_KAGGLE_CARDINALITIES,
    DCNV2_BAG_SIZES,
    SyntheticCriteo,
)
from jaxcache._src.tiered_table import (
    TableColumn,
    TieredStats,
    TieredTable,
    default_dram_budget,
)

__version__ = "0.1.0"

__all__ = [
    "Adagrad",
    "Adam",
    "CRITEO_KAGGLE_CARDINALITIES",
    "CacheConfig",
    "CacheHolder",
    "CacheState",
    "CacheStats",
    "CapacityError",
    "CheckpointInfo",
    "Checkpointer",
    "DCNV2_BAG_SIZES",
    "DiskStats",
    "EmbeddingCache",
    "FiniteCheck",
    "FrequencyCounter",
    "HostTable",
    "Lookup",
    "NonFiniteError",
    "POLICIES",
    "PhaseTimers",
    "Plan",
    "Planner",
    "Prefetcher",
    "RowStateSpec",
    "RowwiseAdagrad",
    "SGD",
    "Server",
    "SparseOptimizer",
    "Staged",
    "StepStats",
    "SyntheticCriteo",
    "TableColumn",
    "TierStats",
    "TieredStats",
    "TieredTable",
    "adagrad",
    "adam",
    "apply_sparse",
    "bucket_size",
    "check_invariants",
    "compilations",
    "default_dram_budget",
    "embed",
    "embed_init",
    "hottest",
    "linen",
    "lookup_rows",
    "models",
    "nnx",
    "normal_init",
    "plot_curve",
    "pool",
    "prefetch",
    "process_shard",
    "raise_if_nonfinite",
    "replay",
    "roc_auc",
    "rowwise_adagrad",
    "serving_config",
    "sgd",
    "swap",
    "sweep",
    "uniform_init",
]
