"""Flax NNX integration: ``CachedEmbed``, the fused sparse ``value_and_grad``, ``jit_step``."""

from jaxcache._src.guards import update_if_finite
from jaxcache._src.nnx_module import (
    CachedEmbed,
    CacheOptState,
    CacheRows,
    jit_step,
    value_and_grad,
)

__all__ = [
    "CacheOptState",
    "CacheRows",
    "CachedEmbed",
    "jit_step",
    "update_if_finite",
    "value_and_grad",
]
