"""Sizing a cache from an id trace: hit rate per capacity and policy, and its plot.

The same computations as ``jaxcache replay`` on the command line.
"""

from jaxcache._src.replay import REPLAY_POLICIES, plot_curve, sweep
from jaxcache._src.tier_replay import replay_dram_tier

__all__ = ["REPLAY_POLICIES", "plot_curve", "replay_dram_tier", "sweep"]
