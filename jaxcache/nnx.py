"""Flax NNX integration: ``CachedEmbed``, the sparse ``value_and_grad``, ``jit_step``, guards."""

from jaxcache._src.guards import FiniteCheck, raise_if_nonfinite, update_if_finite
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
    "FiniteCheck",
    "jit_step",
    "raise_if_nonfinite",
    "update_if_finite",
    "value_and_grad",
]
