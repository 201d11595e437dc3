"""The device side of a cache: its state, a batch's lookup and the pure functions over them.

What a step built by hand (rather than through ``jaxcache.nnx`` or
``jaxcache.linen``) uses: ``EmbeddingCache.prepare`` returns the new
``jaxcache.CacheState`` and the batch's ``jaxcache.Lookup``; ``lookup_rows`` and ``pool`` read
rows through it inside ``jit``; ``apply_sparse`` updates the touched rows.
"""

from jaxcache._src.device_ops import apply_sparse, embed, lookup_rows, pool, swap
from jaxcache._src.engine import Staged
from jaxcache._src.stager import HostStaged, bucket_size

__all__ = [
    "HostStaged",
    "Staged",
    "apply_sparse",
    "bucket_size",
    "embed",
    "lookup_rows",
    "pool",
    "swap",
]
