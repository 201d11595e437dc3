"""Flax Linen shell: a cached embedding module and functional training helpers.

A Linen module holds no state between calls, so the device half of each cache
(its rows and their optimizer state) lives in the variable collection
``COLLECTION`` of the model's variables, under the module's path and then the
table's name::

    variables["jaxcache"][*module_path][table] = {"rows": [C, D], "opt": {name: [C, ...]}}

The table-name level lets the helpers find a table's state from the cache
alone, wherever the module sits in the model: ``prepare``, ``flush`` and
``export`` take the ``EmbeddingCache`` and the variables. ``value_and_grad``
returns the updated variables instead of mutating a model: the functional
counterpart of ``jaxcache.nnx.value_and_grad``.

Every helper accepts either the model's variables (a dict that holds the
``COLLECTION`` collection) or that collection alone, and returns the same kind.
For ``jaxcache.prefetch``, a ``Holder`` owns the variables between steps and
lets the pipeline swap each batch's rows into them.

One training step::

    variables, lookup = jaxcache.linen.prepare(cache, variables, ids)  # eager, host
    loss, grads, variables = train_step(variables, lookup, labels)     # jit, device

Examples:
  >>> import jax, numpy as np, optax, jaxcache, jaxcache.linen
  >>> import flax.linen as nn
  >>> cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, capacity=16))
  >>> class Model(nn.Module):
  ...     @nn.compact
  ...     def __call__(self, lookup):
  ...         return nn.Dense(1)(jaxcache.linen.CachedEmbed(cache, combiner="sum")(lookup))[:, 0]
  >>> model, tx = Model(), optax.sgd(0.1)
  >>> variables = model.init(jax.random.key(0), jaxcache.linen.init_lookup(cache, (2, 2)))
  >>> opt_state = tx.init(variables["params"])
  >>> @jax.jit
  ... def train_step(variables, opt_state, lookup, labels):
  ...     def loss_fn(params, variables, lookup):
  ...         logits = model.apply({**variables, "params": params}, lookup)
  ...         return ((logits - labels) ** 2).mean()
  ...     grad_fn = jaxcache.linen.value_and_grad(loss_fn, cache)
  ...     loss, grads, variables = grad_fn(variables["params"], variables, lookup)
  ...     updates, opt_state = tx.update(grads, opt_state)
  ...     params = optax.apply_updates(variables["params"], updates)
  ...     return {**variables, "params": params}, opt_state, loss
  >>> variables, lookup = jaxcache.linen.prepare(cache, variables, np.array([[1, 2], [3, 4]]))
  >>> variables, opt_state, loss = train_step(variables, opt_state, lookup, np.ones(2))
  >>> rows, opt = jaxcache.linen.export(cache, variables)
  >>> rows.shape
  (100, 4)
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax

from jaxcache._src import device_ops, sparse_grad
from jaxcache._src.device_ops import CacheState, Lookup, check_combiner
from jaxcache._src.engine import EmbeddingCache
from jaxcache._src.optimizers import check_rate_scale
from jaxcache._src.sparse_grad import FiniteCheck

__all__ = [
    "COLLECTION",
    "CachedEmbed",
    "Holder",
    "export",
    "flush",
    "init_lookup",
    "prepare",
    "value_and_grad",
]

#: Name of the Linen variable collection that holds the cached rows and their state.
COLLECTION = "jaxcache"
"""Name of the variable collection that holds the caches' device state."""

Variables = Mapping[str, Any]
_Path = tuple[str, ...]


class CachedEmbed(nn.Module):
    """An embedding lookup served from an ``EmbeddingCache``, used like ``nn.Embed``.

    The module's variables are the device half of the cache, in the
    ``COLLECTION`` collection under the table's name: ``{"rows": [C, D],
    "opt": {name: [C, ...]}}``, filled from ``cache.init_state()`` by
    ``init``. They are not ``params``: the rows are trained by the cache's
    sparse optimizer through ``value_and_grad``, not by optax. Outside ``jit``,
    ``prepare`` maps a batch of ids to slots and brings missing rows in;
    inside the step, calling the module with the returned ``Lookup`` gathers
    the rows. Serve each cache from one module.

    Attributes:
      cache: the engine (host table, planner, statistics).
      combiner: ``None`` to return one row per id, or ``"sum"``/``"mean"`` to
        pool the last axis of the ids (fixed-width bags).

    Examples:
      >>> import jax, numpy as np, jaxcache, jaxcache.linen
      >>> cfg = jaxcache.CacheConfig(num_embeddings=1000, features=4, capacity=64)
      >>> cache = jaxcache.EmbeddingCache(cfg)
      >>> embed = jaxcache.linen.CachedEmbed(cache)
      >>> variables = embed.init(jax.random.key(0), jaxcache.linen.init_lookup(cache, (2, 2)))
      >>> jax.tree.map(jax.numpy.shape, variables)
      {'jaxcache': {'embedding': {'opt': {}, 'rows': (64, 4)}}}
      >>> variables, lookup = jaxcache.linen.prepare(cache, variables, np.array([[1, 2], [2, 999]]))
      >>> embed.apply(variables, lookup).shape
      (2, 2, 4)
    """

    cache: EmbeddingCache
    combiner: str | None = None

    def __post_init__(self) -> None:
        check_combiner(self.combiner)
        super().__post_init__()

    @nn.compact
    def __call__(self, lookup: Lookup, weights: jax.Array | None = None) -> jax.Array:
        """Rows ``[*ids.shape, D]``, or pooled ``[*ids.shape[:-1], D]`` with a combiner.

        Args:
          lookup: from ``prepare`` (of this module's cache), or ``init_lookup``.
          weights: optional per-id weights of the ids' shape (pooled modes).
        """
        name = self.cache.name
        if not self.is_initializing() and not self.has_variable(COLLECTION, name):
            where = f"module {'/'.join(self.path)!r}" if self.path else "the top-level module"
            raise ValueError(
                f"no {COLLECTION!r} variables for table {name!r} in {where}; apply the model "
                f"with the variables from model.init, {COLLECTION!r} collection included "
                "(after jaxcache.linen.prepare, the variables it returned)."
            )
        state = self.variable(COLLECTION, name, self._init_state).value
        if device_ops.is_donated(state["rows"]):  # eager apply: under jit, JAX refuses first
            raise ValueError(
                f"the {COLLECTION!r} variables of table {name!r} were donated to a swap: "
                "apply the model with the variables the last jaxcache.linen.prepare "
                "(or the training step) returned, not the ones passed to it."
            )
        return device_ops.embed(
            state["rows"],
            lookup,
            table=name,
            combiner=self.combiner,
            weights=weights,
            cache_id=self.cache.cache_id,
        )

    def _init_state(self) -> dict[str, Any]:
        return _as_variable(self.cache.init_state())


def init_lookup(cache: EmbeddingCache, shape: Sequence[int]) -> Lookup:
    """A ``Lookup`` of padding ids of ``shape``, to initialise a model with.

    ``model.init`` needs an example input but runs before any batch can be
    prepared (``prepare`` needs the state that ``init`` creates). This lookup
    touches no cache state; every id is padding and looks up a zero row.

    Args:
      cache: the cache of the module it is passed to.
      shape: shape of the ids, ``[B, ...]`` (``[B, L]`` bags with a combiner).

    Returns:
      The ``Lookup``.

    Examples:
      >>> import jax, jaxcache, jaxcache.linen
      >>> cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, capacity=16))
      >>> lookup = jaxcache.linen.init_lookup(cache, (3, 2))
      >>> embed = jaxcache.linen.CachedEmbed(cache, combiner="mean")
      >>> variables = embed.init(jax.random.key(0), lookup)
      >>> embed.apply(variables, lookup).tolist()
      [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    """
    return cache.empty_lookup(tuple(shape))


def prepare(
    cache: EmbeddingCache, variables: Variables, ids: np.ndarray, *, train: bool = True
) -> tuple[Variables, Lookup]:
    """Plans ``ids`` and swaps their missing rows in (eager, outside ``jit``).

    The module is found by the cache's table name, wherever it sits in the
    model. The old device state is donated: use only the returned variables.

    Args:
      cache: the cache of the module that looks the ids up.
      variables: the model's variables, or their ``COLLECTION`` collection.
      ids: integer ids ``[B, ...]`` (``[B, L]`` bags with a combiner).
      train: the step will update these rows.

    Returns:
      ``(variables, lookup)``: the variables with the new device state, and
      the ``Lookup`` to pass to the model inside the step, before the next
      ``prepare`` (which may give its slots to other rows; to look ahead,
      use ``jaxcache.prefetch``).

    Examples:
      >>> import jax, numpy as np, jaxcache, jaxcache.linen
      >>> cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, capacity=16))
      >>> embed = jaxcache.linen.CachedEmbed(cache)
      >>> variables = embed.init(jax.random.key(0), jaxcache.linen.init_lookup(cache, (1, 3)))
      >>> variables, lookup = jaxcache.linen.prepare(cache, variables, np.array([[7, 8, 7]]))
      >>> lookup.shape, cache.stats.last.misses
      ((1, 3), 2)
    """
    states, put = _table_states(variables, [cache.name])
    state, lookup = cache.prepare(states[cache.name], ids, train=train)
    return put({cache.name: state}), lookup


def value_and_grad(
    fn: Callable[..., Any],
    caches: EmbeddingCache | Sequence[EmbeddingCache],
    *,
    has_aux: bool = False,
    learning_rate_scale: Any = None,
) -> Callable[..., tuple[Any, Any, Variables]]:
    """Like ``jax.value_and_grad``, with the cached rows trained in the same step.

    ``fn(params, variables, *args)`` computes the loss, typically with
    ``model.apply({**variables, "params": params}, ...)``. Every ``Lookup``
    found in ``args`` is differentiated through a zero ``delta`` of shape
    ``[U, D]``, so the gradient of each distinct row costs ``O(U x D)``,
    never ``O(C x D)``; the sparse optimizer of its cache is then applied to
    those rows. The gradients returned are those of ``params`` only (for
    optax); the updated rows come back in the returned variables, which
    replace the ones passed in. Call it inside ``jit``.

    Args:
      fn: the loss ``fn(params, variables, *args) -> loss`` (or ``(loss, aux)``).
      caches: the cache (or caches) of the tables ``fn`` looks up.
      has_aux: ``fn`` returns ``(loss, aux)``.
      learning_rate_scale: multiplies every table's sparse learning rate in
        this step: a number >= 0 or a scalar array, such as an optax
        schedule's value at the step (warm-up, decay). Default: the
        configured rates.

    Returns:
      A function ``(params, variables, *args) -> (value, grads, variables)``,
      where ``variables`` (the model's variables, or their ``COLLECTION``
      collection) are passed to ``fn`` unchanged and returned with the looked
      up rows and their optimizer state updated; ``value`` is ``(loss, aux)``
      with ``has_aux``. It raises ``ValueError`` when ``args`` hold no
      ``Lookup`` (a loss that takes its ``Lookup`` by closure would train no
      row).

    Examples:
      >>> import jax, numpy as np, jaxcache, jaxcache.linen
      >>> cfg = jaxcache.CacheConfig(100, 2, capacity=8, optimizer=jaxcache.sgd(1.0))
      >>> cache = jaxcache.EmbeddingCache(cfg)
      >>> embed = jaxcache.linen.CachedEmbed(cache, combiner="sum")
      >>> variables = embed.init(jax.random.key(0), jaxcache.linen.init_lookup(cache, (1, 2)))
      >>> def loss_fn(params, variables, lookup):
      ...     return embed.apply(variables, lookup).sum()
      >>> grad_fn = jax.jit(jaxcache.linen.value_and_grad(loss_fn, cache))
      >>> variables, lookup = jaxcache.linen.prepare(cache, variables, np.array([[5, 5]]))
      >>> before = cache.table.rows[5].copy()
      >>> loss, grads, variables = grad_fn({}, variables, lookup)
      >>> rows, _ = jaxcache.linen.export(cache, variables)
      >>> np.allclose(rows[5], before - 2.0)  # id 5 appears twice: gradient 2, step 1.0
      True
    """
    if learning_rate_scale is not None:
        check_rate_scale(learning_rate_scale)
    by_table = _by_table(caches)
    grads_of = _row_grads_of(fn, by_table, has_aux)
    optimizers = {name: cache.config.optimizer for name, cache in by_table.items()}

    def wrapped(params: Any, variables: Variables, *args: Any) -> tuple[Any, Any, Variables]:
        value, grads, row_grads = grads_of(params, variables, args)
        states, put = _table_states(variables, row_grads)
        new = sparse_grad.apply_rows(states, row_grads, optimizers, learning_rate_scale)
        return value, grads, put(new)

    return wrapped


def _row_grads_of(
    fn: Callable[..., Any], by_table: Mapping[str, EmbeddingCache], has_aux: bool
) -> Callable[[Any, Variables, tuple[Any, ...]], tuple[Any, Any, sparse_grad.RowGrads]]:
    """``(params, variables, args) -> (value, grads, row_grads)`` of the loss ``fn``."""
    features = {name: cache.config.features for name, cache in by_table.items()}

    def value_and_row_grads(params: Any, variables: Variables, args: tuple[Any, ...]):
        def inner(params, deltas):
            return fn(params, variables, *sparse_grad.attach_deltas(args, deltas))

        def differentiate(deltas):
            value, (grads, delta_grads) = jax.value_and_grad(
                inner, argnums=(0, 1), has_aux=has_aux
            )(params, deltas)
            return value, grads, delta_grads

        return sparse_grad.sparse_value_and_grad(
            differentiate, args, features, hint="pass its EmbeddingCache to value_and_grad"
        )

    return value_and_row_grads


def _by_table(caches: EmbeddingCache | Sequence[EmbeddingCache]) -> dict[str, EmbeddingCache]:
    if isinstance(caches, EmbeddingCache):
        caches = [caches]
    by_table = {cache.name: cache for cache in caches}
    if len(by_table) != len(caches):
        names = [cache.name for cache in caches]
        raise ValueError(f"caches {names} share a table name; give each CacheConfig its own name.")
    return by_table


def lookup_ids(
    cache: EmbeddingCache, variables: Variables, ids: jax.Array, *, train: bool = True
) -> tuple[Variables, Lookup]:
    """The host-callback form of ``prepare``, for use inside the jitted step.

    What ``jaxcache.nnx.CachedEmbed.lookup_ids`` does, for Linen: the ids
    go into the step, an ordered ``io_callback`` obtains their slots from the
    host (from a batch ``jaxcache.prefetch`` staged with ``callback=True``,
    or planned on the spot), the swap runs inside the step and a second
    callback writes evicted rows back. Same results as ``prepare``; slower,
    because every list is padded to one fixed size. The cache needs
    ``planner="host"`` (the default on the CPU backend only). With 64-bit types
    disabled the ids must be below ``2**31``: JAX wraps larger ones to
    ``int32`` at the ``jit`` boundary, before jaxcache sees them.

    Args:
      cache: the cache of the module that looks the ids up.
      variables: the model's variables, or their ``COLLECTION`` collection.
      ids: integer ids ``[B, ...]`` (traced).
      train: the step will update these rows.

    Returns:
      ``(variables, lookup)``: the variables with the new device state, and
      the ``Lookup`` to pass to the model in the same step.

    Examples:
      >>> import jax, numpy as np, jaxcache, jaxcache.linen
      >>> cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, capacity=16))
      >>> embed = jaxcache.linen.CachedEmbed(cache, combiner="sum")
      >>> variables = embed.init(jax.random.key(0), jaxcache.linen.init_lookup(cache, (1, 3)))
      >>> @jax.jit
      ... def step(variables, ids):
      ...     variables, lookup = jaxcache.linen.lookup_ids(cache, variables, ids)
      ...     return variables, embed.apply(variables, lookup)
      >>> variables, pooled = step(variables, np.array([[7, 8, 7]]))
      >>> pooled.shape, cache.stats.last.misses
      ((1, 4), 2)
    """
    states, put = _table_states(variables, [cache.name])
    state, lookup = cache.lookup_in_step(states[cache.name], ids, train=train)
    return put({cache.name: state}), lookup


def update_if_finite(
    fn: Callable[..., Any],
    caches: EmbeddingCache | Sequence[EmbeddingCache],
    tx: optax.GradientTransformation,
    *,
    has_aux: bool = False,
    learning_rate_scale: Any = None,
) -> Callable[..., tuple[Any, Any, Any, Variables, FiniteCheck]]:
    """The training update of ``fn``, skipped as a whole unless everything is finite.

    The Linen counterpart of ``jaxcache.nnx.update_if_finite``: ``value_and_grad``
    followed by ``tx``'s update of ``params``, applied only when the loss,
    every dense gradient, every row looked up and its gradient are finite;
    otherwise the parameters, the optimizer state and the cached rows (and
    their optimizer state) come back exactly as they were. Call it inside the
    jitted step and check the flags on the host with
    ``jaxcache.nnx.raise_if_nonfinite``.

    Args:
      fn: the loss ``fn(params, variables, *args) -> loss`` (or ``(loss, aux)``).
      caches: the cache (or caches) of the tables ``fn`` looks up.
      tx: the optax optimizer of ``params``.
      has_aux: ``fn`` returns ``(loss, aux)``.
      learning_rate_scale: as for ``value_and_grad``.

    Returns:
      A function ``(params, opt_state, variables, *args) -> (value, params,
      opt_state, variables, FiniteCheck)``.

    Examples:
      >>> import jax, numpy as np, optax, jaxcache, jaxcache.linen
      >>> cfg = jaxcache.CacheConfig(100, 2, capacity=8, optimizer=jaxcache.sgd(1.0))
      >>> cache = jaxcache.EmbeddingCache(cfg)
      >>> embed = jaxcache.linen.CachedEmbed(cache, combiner="sum")
      >>> variables = embed.init(jax.random.key(0), jaxcache.linen.init_lookup(cache, (1, 2)))
      >>> tx = optax.sgd(0.1)
      >>> def loss_fn(params, variables, lookup, scale):
      ...     return embed.apply(variables, lookup).sum() * scale
      >>> step = jax.jit(jaxcache.linen.update_if_finite(loss_fn, cache, tx))
      >>> variables, lookup = jaxcache.linen.prepare(cache, variables, np.array([[5, 6]]))
      >>> params, opt_state = {}, tx.init({})
      >>> out = step(params, opt_state, variables, lookup, np.float32(np.nan))
      >>> loss, params, opt_state, after, check = out
      >>> bool(check.ok()), np.array_equal(after["jaxcache"]["embedding"]["rows"],
      ...                                  variables["jaxcache"]["embedding"]["rows"])
      (False, True)
    """
    if learning_rate_scale is not None:
        check_rate_scale(learning_rate_scale)
    by_table = _by_table(caches)
    grads_of = _row_grads_of(fn, by_table, has_aux)
    optimizers = {name: cache.config.optimizer for name, cache in by_table.items()}

    def step(params: Any, opt_state: Any, variables: Variables, *args: Any):
        value, grads, row_grads = grads_of(params, variables, args)
        states, put = _table_states(variables, row_grads)
        check = sparse_grad.finite_check(value[0] if has_aux else value, grads, row_grads, states)

        def apply(params, opt_state, states):
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            new = sparse_grad.apply_rows(states, row_grads, optimizers, learning_rate_scale)
            return params, opt_state, new

        def skip(params, opt_state, states):
            return params, opt_state, states

        params, opt_state, states = jax.lax.cond(check.ok(), apply, skip, params, opt_state, states)
        return value, params, opt_state, put(states), check

    return step


def flush(cache: EmbeddingCache, variables: Variables) -> None:
    """Writes every row changed on device back to the host table.

    The variables are read, not donated, and stay valid.

    Args:
      cache: the cache to flush.
      variables: the model's variables, or their ``COLLECTION`` collection.

    Examples:
      >>> import jax, numpy as np, jaxcache, jaxcache.linen
      >>> cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, capacity=16))
      >>> embed = jaxcache.linen.CachedEmbed(cache)
      >>> variables = embed.init(jax.random.key(0), jaxcache.linen.init_lookup(cache, (1,)))
      >>> variables, _ = jaxcache.linen.prepare(cache, variables, np.array([3]))
      >>> before = cache.table.rows[3].copy()
      >>> variables = jaxcache.linen.prepare(cache, variables, np.array([5]))[0]
      >>> jaxcache.linen.flush(cache, variables)  # writes rows 3 and 5 back
      >>> int(cache.planner.dirty.sum())  # row 5's batch is still in flight
      1
    """
    collection, _ = _split(variables)
    cache.flush(_get_state(collection, _locate(collection, cache.name)))


def export(cache: EmbeddingCache, variables: Variables) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The full table and optimizer state in id order (NumPy copies).

    Flushes first, so the host table is also complete afterwards.

    Args:
      cache: the cache to export.
      variables: the model's variables, or their ``COLLECTION`` collection.

    Returns:
      ``(rows [N, D], {name: [N, ...]})``.

    Examples:
      >>> import jax, jaxcache, jaxcache.linen
      >>> cfg = jaxcache.CacheConfig(100, 4, capacity=16, optimizer=jaxcache.adagrad(0.1))
      >>> cache = jaxcache.EmbeddingCache(cfg)
      >>> embed = jaxcache.linen.CachedEmbed(cache)
      >>> variables = embed.init(jax.random.key(0), jaxcache.linen.init_lookup(cache, (1,)))
      >>> rows, opt = jaxcache.linen.export(cache, variables)
      >>> rows.shape, opt["accumulator"].shape
      ((100, 4), (100, 4))
    """
    collection, _ = _split(variables)
    return cache.export(_get_state(collection, _locate(collection, cache.name)))


class Holder:
    """Owns a Linen model's variables between steps, for ``jaxcache.prefetch``.

    The pipeline needs an object holding a cache's device state that it can
    read and replace (a ``jaxcache.pipeline.CacheHolder``); a Linen module holds none,
    so this one holds the variables. It finds the table's state by the
    cache's name, wherever its ``CachedEmbed`` sits in the model, and
    ``set_state`` replaces ``variables`` with a copy holding the new state.
    The training loop reads ``holder.variables`` for each step and assigns
    the step's variables back; the pipeline swaps the next batch's rows in
    between steps, so each step sees the rows of its batch.

    Attributes:
      cache: the cache of the table.
      variables: the current variables: the model's, or their ``COLLECTION``
        collection, whichever was given.

    Args:
      cache: the cache of a ``CachedEmbed`` in the model.
      variables: the model's variables (from ``model.init``), or their
        ``COLLECTION`` collection.

    Raises:
      ValueError: ``variables`` hold no state of ``cache``'s table, or hold
        it in several modules.

    Examples:
      >>> import jax, numpy as np, jaxcache, jaxcache.linen
      >>> cfg = jaxcache.CacheConfig(100, 2, capacity=8, optimizer=jaxcache.sgd(1.0))
      >>> cache = jaxcache.EmbeddingCache(cfg)
      >>> embed = jaxcache.linen.CachedEmbed(cache, combiner="sum")
      >>> variables = embed.init(jax.random.key(0), jaxcache.linen.init_lookup(cache, (1, 2)))
      >>> holder = jaxcache.linen.Holder(cache, variables)
      >>> grad_fn = jax.jit(jaxcache.linen.value_and_grad(
      ...     lambda params, variables, lookup: embed.apply(variables, lookup).sum(), cache))
      >>> before = cache.table.rows.copy()
      >>> batches = [{"ids": np.array([[i, i + 1]])} for i in range(5)]
      >>> with jaxcache.prefetch(batches, {"ids": holder}, lookahead=2) as pipeline:
      ...     for batch in pipeline:  # this batch's rows are in holder.variables
      ...         loss, _, holder.variables = grad_fn({}, holder.variables, batch["ids"])
      >>> rows, _ = jaxcache.linen.export(cache, holder.variables)
      >>> (before - rows)[:7, 0].round(4).tolist()  # sgd(1.0): one step per occurrence
      [1.0, 2.0, 2.0, 2.0, 2.0, 1.0, 0.0]
    """

    def __init__(self, cache: EmbeddingCache, variables: Variables) -> None:
        _locate(_split(variables)[0], cache.name)  # fail here, not in the pipeline
        self.cache = cache
        self._variables = _Cell(variables)
        self._variables.caches[cache.name] = cache

    @property
    def variables(self) -> Variables:
        return self._variables.value

    @variables.setter
    def variables(self, variables: Variables) -> None:
        self._variables.value = variables

    def for_cache(self, cache: EmbeddingCache) -> Holder:
        """A holder of another table of the same model, sharing these variables.

        A model with several cached tables needs one holder per table for
        ``jaxcache.prefetch``; holders built with ``for_cache`` read and
        replace one ``variables``, so assigning it on any of them updates all.

        Args:
          cache: the cache of another ``CachedEmbed`` in the model.

        Returns:
          The ``Holder`` of ``cache``.

        Examples:
          >>> import flax.linen as nn, jax, numpy as np, jaxcache, jaxcache.linen
          >>> users, items = (jaxcache.EmbeddingCache(jaxcache.CacheConfig(50, 2, 8, name=n))
          ...                 for n in ("users", "items"))
          >>> class TwoTower(nn.Module):
          ...     @nn.compact
          ...     def __call__(self, user, item):
          ...         return (jaxcache.linen.CachedEmbed(users)(user)
          ...                 * jaxcache.linen.CachedEmbed(items)(item)).sum(-1)
          >>> model = TwoTower()
          >>> variables = model.init(jax.random.key(0), jaxcache.linen.init_lookup(users, (2,)),
          ...                        jaxcache.linen.init_lookup(items, (2,)))
          >>> user_holder = jaxcache.linen.Holder(users, variables)
          >>> item_holder = user_holder.for_cache(items)
          >>> tables = {"user": user_holder, "item": item_holder}
          >>> batches = [{"user": np.array([1, 2]), "item": np.array([3, 4])}]
          >>> for batch in jaxcache.prefetch(batches, tables, train=False):
          ...     scores = model.apply(user_holder.variables, batch["user"], batch["item"])
          >>> item_holder.variables is user_holder.variables, scores.shape
          (True, (2,))
        """
        _locate(_split(self.variables)[0], cache.name)
        holder = copy.copy(self)  # shares the variables' cell
        holder.cache = cache
        holder._variables.caches[cache.name] = cache
        return holder

    def tables(self) -> dict[str, Holder]:
        """The holder of every table of these variables, by name: the model's cached tables.

        Each table's cache is this holder's or one given to ``for_cache`` of a
        holder sharing these variables (a Linen module keeps no reference to
        its cache). ``jaxcache.Checkpointer`` saves a Linen model's tables
        through them.

        Raises:
          ValueError: the variables hold the state of a table whose cache no
            holder sharing them was given.

        Examples:
          >>> import jax, jaxcache, jaxcache.linen
          >>> cache = jaxcache.EmbeddingCache(jaxcache.CacheConfig(100, 4, capacity=8))
          >>> embed = jaxcache.linen.CachedEmbed(cache)
          >>> variables = embed.init(jax.random.key(0), jaxcache.linen.init_lookup(cache, (2,)))
          >>> holder = jaxcache.linen.Holder(cache, variables)
          >>> {name: h.cache is cache for name, h in holder.tables().items()}
          {'embedding': True}
        """
        caches = self._variables.caches
        missing = sorted(set(_table_paths(_split(self.variables)[0])) - set(caches))
        if missing:
            raise ValueError(
                f"the variables hold table {missing[0]!r} but no holder of them has its cache; "
                "make one with holder.for_cache(cache) for each table of the model."
            )
        return {name: self.for_cache(cache) for name, cache in sorted(caches.items())}

    def get_state(self) -> CacheState:
        """The table's device state, read from ``variables``."""
        collection, _ = _split(self.variables)
        return _get_state(collection, _locate(collection, self.cache.name))

    def set_state(self, state: CacheState) -> None:
        """Replaces ``variables`` with a copy holding ``state`` for the table."""
        collection, rebuild = _split(self.variables)
        path = _locate(collection, self.cache.name)
        self.variables = rebuild(_set_state(collection, path, state))


class _Cell:
    """One mutable slot, shared by the holders of one model's tables, and their caches."""

    __slots__ = ("caches", "value")

    def __init__(self, value: Variables) -> None:
        self.value = value
        self.caches: dict[str, EmbeddingCache] = {}


# ------------------------------------------------------------- variable trees
def _as_variable(state: CacheState) -> dict[str, Any]:
    return {"rows": state.rows, "opt": dict(state.opt)}


def _is_table_state(node: Any) -> bool:
    return (
        isinstance(node, Mapping)
        and set(node) == {"rows", "opt"}
        and isinstance(node["opt"], Mapping)
        and not isinstance(node["rows"], Mapping)
    )


def _table_states(
    variables: Variables, tables: Iterable[str]
) -> tuple[dict[str, CacheState], Callable[[Mapping[str, CacheState]], Variables]]:
    """The device state of each of ``tables`` in ``variables``, and ``put``:
    ``put(states)`` is ``variables`` (of the same kind) with those replaced."""
    collection, rebuild = _split(variables)
    paths = {table: _locate(collection, table) for table in tables}

    def put(states: Mapping[str, CacheState]) -> Variables:
        out = collection
        for table, state in states.items():
            out = _set_state(out, paths[table], state)
        return rebuild(out)

    return {table: _get_state(collection, path) for table, path in paths.items()}, put


def _split(variables: Variables) -> tuple[Variables, Callable[[Variables], Variables]]:
    """The cache collection of ``variables`` and a function putting a new one back."""
    if not isinstance(variables, Mapping):
        raise TypeError(
            f"variables must be a dict of variables (from model.init) or its {COLLECTION!r} "
            f"collection, got {type(variables).__name__}."
        )
    collection = variables.get(COLLECTION)
    if isinstance(collection, Mapping):
        return collection, lambda new: {**variables, COLLECTION: new}
    return variables, lambda new: new


def _table_paths(collection: Variables) -> dict[str, list[_Path]]:
    """The paths of every table's state in the collection, by table name."""
    found: dict[str, list[_Path]] = {}

    def walk(node: Mapping[str, Any], path: _Path) -> None:
        for key, value in node.items():
            if _is_table_state(value):
                found.setdefault(key, []).append((*path, key))
            elif isinstance(value, Mapping):
                walk(value, (*path, key))

    walk(collection, ())
    return found


def _locate(collection: Variables, table: str) -> _Path:
    """Path of ``table``'s state in the collection (module path + table name)."""
    found = _table_paths(collection)
    paths = found.get(table, [])
    if not paths:
        raise ValueError(
            f"no device state for table {table!r} in the variables (tables found: "
            f"{sorted(found)}); pass the variables from model.init of a model with a "
            f"jaxcache.linen.CachedEmbed of this cache, or their {COLLECTION!r} collection."
        )
    if len(paths) > 1:
        where = ["/".join(path[:-1]) for path in paths]
        raise ValueError(
            f"table {table!r} has device state in several modules {where}; serve each "
            "EmbeddingCache from one CachedEmbed and give each table its own CacheConfig name."
        )
    return paths[0]


def _get_state(collection: Variables, path: _Path) -> CacheState:
    node: Any = collection
    for key in path:
        node = node[key]
    return CacheState(node["rows"], dict(node["opt"]))


def _set_state(collection: Variables, path: _Path, state: CacheState) -> dict[str, Any]:
    head, *rest = path
    value = _set_state(collection[head], tuple(rest), state) if rest else _as_variable(state)
    return {**collection, head: value}
