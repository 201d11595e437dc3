"""The sparse gradient of a step, shared by the NNX and Linen shells.

Every ``Lookup`` among a loss function's arguments is differentiated through
a zero ``delta`` of shape ``[n, R, D]`` added to the rows it receives, so the
gradient of each distinct row costs ``O(U x D)``, never ``O(C x D)``. The
shells differ only in how they differentiate the dense parameters (NNX
modules or Linen ``params``) and where the cache's device state lives; the
finding of lookups, the row gradients, the sparse update and the finiteness
check are here, once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp

from jaxcache._src.device_ops import CacheState, Lookup, apply_sparse, lookup_rows
from jaxcache._src.optimizers import SparseOptimizer

__all__ = [
    "FiniteCheck",
    "RowGrads",
    "apply_rows",
    "attach_deltas",
    "finite_check",
    "sparse_value_and_grad",
]

#: ``{table: (lookup, grad [n, R, D])}``: the row gradients of one step.
RowGrads = dict[str, tuple[Lookup, jax.Array]]


def _is_lookup(x: object) -> bool:
    return isinstance(x, Lookup)


def find_lookups(args: object, features: Mapping[str, int], hint: str) -> list[Lookup]:
    """The ``Lookup`` leaves of ``args``, checked: known tables, one per table.

    Args:
      args: any pytree (the arguments of a loss function).
      features: row width ``D`` of each known table, by name.
      hint: what to do when a lookup's table is unknown.
    """
    lookups = [x for x in jax.tree.leaves(args, is_leaf=_is_lookup) if _is_lookup(x)]
    tables = [lookup.table for lookup in lookups]
    for name in tables:
        if name not in features:
            raise ValueError(
                f"a Lookup for table {name!r} was passed but nothing serves it "
                f"(tables: {sorted(features)}); {hint}."
            )
    if len(set(tables)) != len(tables):
        raise ValueError(
            f"tables {tables} are looked up more than once in one step; prepare all ids of "
            "a table as one array (one Lookup per table per step)."
        )
    return lookups


_Tree = TypeVar("_Tree")


def attach_deltas(args: _Tree, deltas: list[jax.Array]) -> _Tree:
    """``args`` with each ``Lookup`` leaf carrying its delta (same order as ``find_lookups``)."""
    it = iter(deltas)
    return jax.tree.map(
        lambda x: x.with_delta(next(it)) if _is_lookup(x) else x, args, is_leaf=_is_lookup
    )


def sparse_value_and_grad(
    differentiate: Callable[[list[jax.Array]], tuple[Any, Any, list[jax.Array]]],
    args: object,
    features: Mapping[str, int],
    *,
    hint: str,
) -> tuple[Any, Any, RowGrads]:
    """The loss, the dense gradients and the row gradients of one step.

    Args:
      differentiate: ``differentiate(deltas) -> (value, dense_grads,
        delta_grads)``: the shell's ``value_and_grad`` of the loss over its
        dense parameters and ``deltas``, the loss called on
        ``attach_deltas(args, deltas)``.
      args: the loss function's arguments, holding the step's lookups.
      features: row width ``D`` of each table the model serves, by name.
      hint: what to do when a lookup's table is not served.

    Returns:
      ``(value, dense_grads, row_grads)``, ``row_grads`` mapping each looked
      up table to ``(lookup, grad)``.
    """
    lookups = find_lookups(args, features, hint)
    if not lookups:
        raise ValueError(
            "the loss function was given no Lookup, so no cached row would get a gradient; "
            "pass each step's Lookup to it as an argument (a Lookup the function takes from "
            "outside, by closure, is not differentiated)."
        )
    deltas = [
        jnp.zeros((lk.requests.shape[0], lk.received, features[lk.table]), jnp.float32)
        for lk in lookups
    ]
    value, grads, delta_grads = differentiate(deltas)
    row_grads = {lk.table: (lk, g) for lk, g in zip(lookups, delta_grads, strict=True)}
    return value, grads, row_grads


def apply_rows(
    states: Mapping[str, CacheState],
    row_grads: RowGrads,
    optimizers: Mapping[str, SparseOptimizer],
    learning_rate_scale: Any = None,
) -> dict[str, CacheState]:
    """Each looked up table's new device state after its sparse optimizer
    step (at its learning rate times ``learning_rate_scale``, if given)."""
    return {
        table: apply_sparse(
            states[table],
            lookup,
            grad,
            optimizers[table],
            learning_rate_scale=learning_rate_scale,
        )
        for table, (lookup, grad) in row_grads.items()
    }


class FiniteCheck(NamedTuple):
    """Which parts of a training update were finite (boolean device scalars).

    Attributes:
      loss: the loss.
      dense: every gradient of the dense parameters.
      tables: ``{name: flag}``: the rows each table looked up and their
        gradients.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxcache.nnx import FiniteCheck
      >>> check = FiniteCheck(jnp.array(True), jnp.array(True), {"t": jnp.array(False)})
      >>> bool(check.tables["t"]), bool(check.ok())
      (False, False)
    """

    loss: jax.Array
    dense: jax.Array
    tables: dict[str, jax.Array]

    def ok(self) -> jax.Array:
        """Everything finite (a device boolean)."""
        ok = self.loss & self.dense
        for flag in self.tables.values():
            ok = ok & flag
        return ok


def all_finite(tree: Any) -> jax.Array:
    """Whether every leaf of ``tree`` is finite everywhere (a device boolean)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    if not leaves:
        return jnp.array(True)
    return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


def finite_check(
    loss: Any, grads: Any, row_grads: RowGrads, states: Mapping[str, CacheState]
) -> FiniteCheck:
    """What of an update is finite: the loss, the dense gradients, and per
    table the rows looked up (from ``states``) and their gradients."""
    return FiniteCheck(
        all_finite(loss),
        all_finite(grads),
        {
            table: all_finite(grad) & all_finite(lookup_rows(states[table].rows, lookup))
            for table, (lookup, grad) in row_grads.items()
        },
    )
