"""Checks for tests of code built on jaxcache: the planners' invariants, a compilation count."""

from jaxcache._src.engine import EmbeddingCache
from jaxcache._src.stats import compilations

__all__ = ["check_invariants", "compilations"]


def check_invariants(cache: EmbeddingCache) -> None:
    """Checks the host bookkeeping of ``cache``; raises ``AssertionError`` if broken.

    In every device partition of this process: the directory is a bijection
    between resident ids and their slots, ids are in range (local ids of the
    partition), only resident rows are dirty, recency never runs ahead of the
    plans, and a counting policy's per-slot counts mirror its per-id counts.
    ``O(N + C)``.

    Args:
      cache: the cache to check (take it between steps).

    Examples:
      >>> import numpy as np, jaxcache
      >>> cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, capacity=8))
      >>> state, _ = cache.prepare(cache.init_state(), np.array([3, 5, 3]))
      >>> jaxcache.testing.check_invariants(cache)
      >>> cache.planner.planners[0].slot_of_id[7] = 0  # corrupt the directory
      >>> try:
      ...     jaxcache.testing.check_invariants(cache)
      ... except AssertionError as error:
      ...     print(error)
      table 'embedding': 3 ids map to a slot but 2 slots hold an id
    """
    cache.planner.check_invariants(cache.name)
