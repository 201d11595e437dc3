"""Sizing a cache from an id trace: hit rate per capacity and policy, and its
plot; the row budget of a dynamic vocabulary from a raw-id trace.

The same computations as ``jaxcache replay`` and ``jaxcache vocabulary`` on
the command line.
"""

from jaxcache._src.replay import REPLAY_POLICIES, plot_curve, sweep
from jaxcache._src.tier_replay import replay_dram_tier
from jaxcache._src.vocabulary_replay import replay_vocabulary

__all__ = ["REPLAY_POLICIES", "plot_curve", "replay_dram_tier", "replay_vocabulary", "sweep"]
