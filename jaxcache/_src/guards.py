"""Guards: skip a training update that would write non-finite values.

``update_if_finite`` is the training update of ``jaxcache.nnx`` (the loss,
its gradients, the dense optimizer and the sparse row updates) made
conditional on the loss and every gradient being finite. What it costs:

* inside the step, ``isfinite`` reductions over the dense gradients
  (``O(P)``), over each table's row gradients (``O(U x D)``) and over the
  rows the batch looked up (one more gather of them, ``O(B x D)`` per id
  position), so a row already stored non-finite is named with its table;
* the updates run under ``lax.cond``, which XLA keeps in place: a skipped
  step copies nothing, a taken one computes what the unguarded step
  computes (XLA compiles it as another program, so results may differ from
  the unguarded step's in the last bit, as any two programs may);
* reading the flags on the host (``raise_if_nonfinite``) waits for that step
  to finish: checking after every step costs one device-to-host sync per
  step, so the host can no longer queue the next step ahead. Checking every
  ``k`` steps is cheaper; a bad step is still skipped, but the training loop
  has gone on for up to ``k - 1`` steps when the error is raised.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jaxcache._src.nnx_module import cached_tables, value_and_grad
from jaxcache._src.optimizers import check_rate_scale
from jaxcache._src.sparse_grad import FiniteCheck, RowGrads, finite_check

__all__ = [
    "FiniteCheck",
    "NonFiniteError",
    "raise_if_nonfinite",
    "update_if_finite",
]


class NonFiniteError(FloatingPointError):
    """A training update had a non-finite loss or gradient and was skipped.

    Attributes:
      step: the step the caller named.
      tables: tables whose rows or row gradients were not finite.

    Examples:
      >>> import jaxcache
      >>> error = jaxcache.NonFiniteError("step 3: ...", step=3, tables=["t"])
      >>> error.step, error.tables
      (3, ['t'])
    """

    def __init__(self, message: str, *, step: int, tables: list[str]) -> None:
        super().__init__(message)
        self.step = step
        self.tables = tables


def _apply(
    model: nnx.Module, optimizer: nnx.Optimizer, grads: Any, rows: RowGrads, scale: Any
) -> None:
    optimizer.update(model, grads)
    modules = cached_tables(model)
    for table, (lookup, grad) in rows.items():
        modules[table].apply_gradients(lookup, grad, learning_rate_scale=scale)


def _skip(
    model: nnx.Module, optimizer: nnx.Optimizer, grads: Any, rows: RowGrads, scale: Any
) -> None:
    del model, optimizer, grads, rows, scale


def update_if_finite(
    fn: Callable[..., Any],
    *,
    has_aux: bool = False,
    wrt: Any = nnx.Param,
    learning_rate_scale: Any = None,
) -> Callable[..., tuple[Any, FiniteCheck]]:
    """The training update of ``fn``, skipped as a whole unless everything is finite.

    ``update_if_finite(loss_fn)(model, optimizer, *args)`` does what
    ``jaxcache.nnx.value_and_grad(loss_fn)(model, *args)`` followed by
    ``optimizer.update(model, grads)`` does, but only when the loss, every
    dense gradient, every row looked up and its gradient are finite;
    otherwise the model, the optimizer and the cached rows (and their
    optimizer state) are left exactly as they were. Use it inside the jitted
    step and check the returned flags on the host with
    ``raise_if_nonfinite``.

    Args:
      fn: the loss function ``fn(model, *args) -> loss`` (or ``(loss, aux)``).
      has_aux: ``fn`` returns ``(loss, aux)``.
      wrt: filter of the dense variables to differentiate.
      learning_rate_scale: as for ``value_and_grad``.

    Returns:
      A function ``(model, optimizer, *args) -> (value, FiniteCheck)``.

    Examples:
      >>> import numpy as np, optax, jaxcache
      >>> from flax import nnx
      >>> cfg = jaxcache.CacheConfig(100, 4, capacity=16, optimizer=jaxcache.sgd(0.1))
      >>> embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg), combiner="sum")
      >>> optimizer = nnx.Optimizer(embed, optax.sgd(0.1), wrt=nnx.Param)
      >>> @nnx.jit
      ... def step(embed, optimizer, lookup, scale):
      ...     def loss_fn(embed, lookup):
      ...         return (embed(lookup) ** 2).sum() * scale
      ...     return jaxcache.nnx.update_if_finite(loss_fn)(embed, optimizer, lookup)
      >>> lookup = embed.prepare(np.array([[1, 2]]))
      >>> loss, check = step(embed, optimizer, lookup, np.float32(np.nan))
      >>> try:
      ...     jaxcache.nnx.raise_if_nonfinite(check, step=0)
      ... except jaxcache.NonFiniteError as error:
      ...     print(str(error).split(";")[0])
      step 0: non-finite values in the loss and the rows or row gradients of table 'embedding'
    """
    if learning_rate_scale is not None:
        check_rate_scale(learning_rate_scale)
    grad_fn = value_and_grad(fn, has_aux=has_aux, wrt=wrt, apply_rows=False)

    def step(model: nnx.Module, optimizer: nnx.Optimizer, *args: Any) -> tuple[Any, FiniteCheck]:
        value, grads, rows = grad_fn(model, *args)
        states = {name: module.get_state() for name, module in cached_tables(model).items()}
        check = finite_check(value[0] if has_aux else value, grads, rows, states)
        nnx.cond(check.ok(), _apply, _skip, model, optimizer, grads, rows, learning_rate_scale)
        return value, check

    return step


def raise_if_nonfinite(check: FiniteCheck, *, step: int) -> None:
    """Raises ``NonFiniteError`` naming ``step`` and the tables if ``check`` failed.

    Reading the flags waits for the step that computed them (see the module
    notes on the cost).

    Args:
      check: what ``update_if_finite`` returned.
      step: the step number to name in the error.

    Examples:
      >>> import jax.numpy as jnp, jaxcache
      >>> ok = jaxcache.nnx.FiniteCheck(jnp.array(True), jnp.array(True), {})
      >>> jaxcache.nnx.raise_if_nonfinite(ok, step=7)  # nothing happens
    """
    flags = jax.device_get(check)
    tables = [name for name, ok in flags.tables.items() if not ok]
    parts = [
        part for part, ok in (("the loss", flags.loss), ("dense gradients", flags.dense)) if not ok
    ]
    parts += [f"the rows or row gradients of table {name!r}" for name in tables]
    if parts:
        what = ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]
        raise NonFiniteError(
            f"step {step}: non-finite values in {what}; the update was skipped, so the model, "
            "the optimizer and the tables are as they were before this step. Check this "
            "batch's inputs, lower the learning rate, or restore the last checkpoint.",
            step=step,
            tables=tables,
        )
