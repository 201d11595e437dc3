"""Flax NNX integration: ``CachedEmbed`` and the fused sparse ``value_and_grad``."""

from jaxcache._src.nnx_module import CachedEmbed, CacheOptState, CacheRows, value_and_grad

__all__ = ["CacheOptState", "CacheRows", "CachedEmbed", "value_and_grad"]
