"""The host planner of one device's share of a cache, its eviction policies and access counts.

``EmbeddingCache`` drives one ``Planner`` per device; use one directly to
study a policy, or ``jaxcache.replay`` to size a cache from a trace.
"""

from jaxcache._src.config import POLICIES
from jaxcache._src.frequency import hottest
from jaxcache._src.planner import Plan, Planner

__all__ = ["POLICIES", "Plan", "Planner", "hottest"]
