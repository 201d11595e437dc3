"""The host pipeline: ``prefetch`` stages the next batches while the device runs the current one.

``CacheHolder`` is what the pipeline (and checkpoints, and serving) need of
whatever keeps a cache's device state between steps.
"""

from jaxcache._src.holder import CacheHolder
from jaxcache._src.pipeline import Prefetcher

__all__ = ["CacheHolder", "Prefetcher"]
