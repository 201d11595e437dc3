"""Flax NNX integration: ``CachedEmbed`` and the fused sparse ``value_and_grad``."""

from jaxcache._src.guards import update_if_finite
from jaxcache._src.nnx_module import CachedEmbed, CacheOptState, CacheRows, value_and_grad

__all__ = ["CacheOptState", "CacheRows", "CachedEmbed", "update_if_finite", "value_and_grad"]
