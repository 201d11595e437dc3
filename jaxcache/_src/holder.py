"""Holders of cached tables: the ``CacheHolder`` protocol; a Flax model's tables and dense state.

A table's engine (``EmbeddingCache``) lives on the host and its device state
wherever the model keeps it; a holder gives both (``cache``, ``get_state``,
``set_state``). The pipeline swaps each batch's rows into holders, checkpoints
save and restore through them, and a server scores through them.

Both Flax shells provide the holders of a model's tables: an NNX model holds
a ``CachedEmbed`` module per table (``nnx_module.cached_embeds``); a Linen
model holds no state, so a ``jaxcache.linen.Holder`` keeps its variables and
makes a holder of each table sharing them (``Holder.tables``).
``model_tables`` finds them in either, and ``dense_state`` and
``load_dense_state`` read and replace the rest of the model's state (every
variable but the cached rows and their optimizer state).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import flax.linen as nn
from flax import nnx

from jaxcache._src import linen_module, nnx_module
from jaxcache._src.device_ops import CacheState
from jaxcache._src.engine import EmbeddingCache

__all__ = ["CacheHolder", "dense_state", "find_tables", "load_dense_state", "model_tables"]

# The NNX variables the tables hold, not the rest of the model.
_TABLE_VARIABLES = nnx.Any(nnx_module.CacheRows, nnx_module.CacheOptState)


class CacheHolder(Protocol):
    """What the pipeline needs of a table: its engine and its device state.

    ``jaxcache.nnx.CachedEmbed`` is one; ``jaxcache.linen.Holder`` makes one of
    a Linen model's variables.

    Examples:
      >>> import jaxcache
      >>> class Holder:  # a plain container works too
      ...     def __init__(self, cache):
      ...         self.cache, self.state = cache, cache.init_state()
      ...     def get_state(self):
      ...         return self.state
      ...     def set_state(self, state):
      ...         self.state = state
      >>> holder = Holder(jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, capacity=8)))
      >>> [b["ids"].shape for b in jaxcache.prefetch([{"ids": [[1, 2]]}], {"ids": holder})]
      [(1, 2)]
    """

    cache: EmbeddingCache

    def get_state(self) -> CacheState: ...

    def set_state(self, state: CacheState) -> None: ...


def model_tables(model: Any) -> dict[str, CacheHolder]:
    """The cached tables of a Flax model, by table name.

    Args:
      model: an NNX model (its ``CachedEmbed`` modules), or the
        ``jaxcache.linen.Holder`` of a Linen model's variables (the holders
        of every table of them, ``Holder.tables``).

    Returns:
      ``{name: holder}``; a ``CachedEmbed`` of an NNX model.

    Raises:
      TypeError: ``model`` is a Linen module (it holds no state).
      ValueError: two tables share a name, or a Linen model's table has no
        holder.

    Examples:
      >>> import jaxcache
      >>> from flax import nnx
      >>> from jaxcache._src.holder import model_tables
      >>> cfg = jaxcache.CacheConfig(100, 4, capacity=8, name="users")
      >>> model = nnx.List([jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg))])
      >>> list(model_tables(model))
      ['users']
    """
    if isinstance(model, linen_module.Holder):
        return _by_name(model.tables().values())
    if isinstance(model, nn.Module):
        raise TypeError(
            f"{type(model).__name__} is a Linen module, which holds no state; pass the "
            "jaxcache.linen.Holder of its variables (with a holder for each of its tables)."
        )
    return _by_name(nnx_module.cached_embeds(model))


def find_tables(model: Any, caches: Iterable[Any] = ()) -> dict[str, CacheHolder]:
    """The tables of ``model`` (if not ``None``, see ``model_tables``) and of
    ``caches`` (holders), by name.

    Raises:
      TypeError: an entry of ``caches`` is not a holder.
      ValueError: two tables share a name.
    """
    found = [] if model is None else list(model_tables(model).values())
    for holder in caches:
        if not all(hasattr(holder, a) for a in ("cache", "get_state", "set_state")):
            raise TypeError(
                f"caches holds a {type(holder).__name__}, not a cached table; pass the "
                "jaxcache.nnx.CachedEmbed (or any jaxcache.pipeline.CacheHolder) of each table."
            )
        found.append(holder)
    return _by_name(found)


def _by_name(holders: Iterable[CacheHolder]) -> dict[str, CacheHolder]:
    """``holders`` by table name, the first of a cache's holders kept; two
    caches of one name are refused."""
    tables: dict[str, CacheHolder] = {}
    for holder in holders:
        name = holder.cache.name
        other = tables.setdefault(name, holder)
        if other.cache is not holder.cache:
            raise ValueError(f"two tables are named {name!r}; give each CacheConfig its own name=.")
    return tables


def dense_state(node: Any) -> dict[str, Any]:
    """The state of a model or optimizer besides its cached tables, as a pure
    dict of arrays: an NNX node's variables but the cached rows and their
    optimizer state; a Linen ``Holder``'s collections but the caches' (none
    when it holds the caches' collection alone).

    Examples:
      >>> import jaxcache
      >>> from flax import nnx
      >>> from jaxcache._src.holder import dense_state
      >>> cfg = jaxcache.CacheConfig(100, 4, capacity=8)
      >>> model = nnx.List([jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg)),
      ...                   nnx.Linear(4, 1, rngs=nnx.Rngs(0))])
      >>> sorted(dense_state(model)[1])
      ['bias', 'kernel']
    """
    if isinstance(node, linen_module.Holder):
        variables = node.variables
        if not isinstance(variables.get(linen_module.COLLECTION), Mapping):
            return {}
        return {k: v for k, v in variables.items() if k != linen_module.COLLECTION}
    return nnx.to_pure_dict(nnx.state(node, nnx.Not(_TABLE_VARIABLES)))


def load_dense_state(node: Any, values: Mapping[str, Any]) -> None:
    """Replaces the state ``dense_state`` read with ``values`` (same structure)."""
    if isinstance(node, linen_module.Holder):
        if values:
            node.variables = {**node.variables, **values}
        return
    state = nnx.state(node, nnx.Not(_TABLE_VARIABLES))
    nnx.replace_by_pure_dict(state, dict(values))
    nnx.update(node, state)
