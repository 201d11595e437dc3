"""Flax Linen integration: ``CachedEmbed`` and functional helpers for a train step.

The caches' device state lives in the ``COLLECTION`` variable collection;
``prepare`` (eager) and ``value_and_grad`` (inside ``jit``) take and return
the variables, ``flush`` and ``export`` read them; a ``Holder`` keeps them
between steps for ``jaxcache.prefetch``.
"""

from jaxcache._src.linen_module import (
    COLLECTION,
    CachedEmbed,
    Holder,
    export,
    flush,
    init_lookup,
    lookup_ids,
    prepare,
    update_if_finite,
    value_and_grad,
)

__all__ = [
    "COLLECTION",
    "CachedEmbed",
    "Holder",
    "export",
    "flush",
    "init_lookup",
    "lookup_ids",
    "prepare",
    "update_if_finite",
    "value_and_grad",
]
