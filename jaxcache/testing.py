"""Checks for tests of code built on jaxcache: the planners' invariants, a compilation count."""

from jaxcache._src.partitions import check_invariants
from jaxcache._src.stats import compilations

__all__ = ["check_invariants", "compilations"]
