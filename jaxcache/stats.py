"""What a cache counts: per step, over a run, per phase, and per tier of a ``TieredTable``."""

from jaxcache._src.dram_tier import TierStats
from jaxcache._src.row_log import DiskStats
from jaxcache._src.stats import PhaseTimers, StepStats
from jaxcache._src.tiered_table import TieredStats

__all__ = ["DiskStats", "PhaseTimers", "StepStats", "TierStats", "TieredStats"]
