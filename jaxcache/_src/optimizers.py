"""Sparse row optimizers: update only the rows a batch touched.

Each optimizer is a frozen, hashable dataclass (so it can sit in a static
config) with two pure pieces:

* ``state_spec(features)`` names the per-row state (shape after the row axis,
  dtype, initial value); the host table stores it for every row and it moves
  with the row between host and device.
* ``update(rows, grads, state)`` maps the ``U`` touched rows ``[U, D]``, their
  summed gradients ``[U, D]`` and their state ``{name: [U, ...]}`` to new rows
  and state. Work is ``O(U x D)``: rows not in the batch are never read or
  written (lazy semantics), so an untouched row and its state do not change.

Every subclass of ``SparseOptimizer`` is registered by name when it is
defined; a checkpoint records that name and the hyperparameters
(``to_json``) and rebuilds the optimizer through the registry (``from_json``).

Shape letters: ``U`` distinct rows in a batch, ``D`` row width.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Adagrad",
    "Adam",
    "RowStateSpec",
    "RowwiseAdagrad",
    "SGD",
    "SparseOptimizer",
    "adagrad",
    "adam",
    "from_json",
    "registered",
    "rowwise_adagrad",
    "sgd",
    "to_json",
]


class RowStateSpec(NamedTuple):
    """One array of per-row optimizer state.

    Attributes:
      shape: shape after the row axis, ``()`` for a scalar per row.
      dtype: NumPy dtype of the state.
      init: value every row starts with.

    Examples:
      >>> import jaxcache
      >>> spec = jaxcache.adagrad(0.1).state_spec(8)["accumulator"]
      >>> spec.shape, spec.dtype.name, spec.init
      ((8,), 'float32', 0.1)
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    init: float


# Every SparseOptimizer subclass, by the name checkpoints record.
_REGISTRY: dict[str, type[SparseOptimizer]] = {}
# A hyperparameter's range: ``low <= value < high``, and a value to suggest.
Bounds = Mapping[str, tuple[float, float, str]]


@dataclasses.dataclass(frozen=True)
class SparseOptimizer:
    """Base class of the sparse row optimizers.

    A subclass names its per-row state in ``state_spec`` and maps touched
    rows, their gradients and their state to new ones in ``update``. Make it
    a frozen dataclass: its fields are the hyperparameters a checkpoint
    records, as JSON, beside the name it is registered under.

    Every subclass is registered when it is defined, under the ``name``
    given in its class statement (default: the class name); a name taken by
    another class is refused. ``Checkpointer.cache_config`` rebuilds a
    saved optimizer by that name, so the module defining it must be imported
    before a checkpoint of a table trained with it is read
    (``jaxcache.optimizers.registered`` lists the names).

    Attributes:
      registered_name: the name the class is registered under.
      trains: ``False`` only for an optimizer that never updates rows (a
        serving table's): a checkpoint's per-row state may be restored into
        such a cache without its state; any other must keep the saved state.

    Examples:
      >>> import dataclasses, jax.numpy as jnp, jaxcache
      >>> @dataclasses.dataclass(frozen=True)
      ... class SignSGD(jaxcache.SparseOptimizer, name="sign_sgd"):
      ...     def update(self, rows, grads, state):
      ...         return rows - self.learning_rate * jnp.sign(grads), state
      >>> SignSGD(0.5).update(jnp.zeros((1, 2)), jnp.array([[3.0, -1.0]]), {})[0].tolist()
      [[-0.5, 0.5]]
      >>> SignSGD.registered_name, jaxcache.optimizers.registered()["sign_sgd"] is SignSGD
      ('sign_sgd', True)
    """

    learning_rate: float
    registered_name: ClassVar[str] = ""
    # False for a serving table's optimizer, which keeps no state and never
    # updates: a checkpoint's per-row state may be left behind only there.
    trains: ClassVar[bool] = True
    # Each hyperparameter's range, ``name: (low, high, example)``: ``low <=
    # value < high``, checked at construction like the learning rate.
    bounds: ClassVar[Bounds] = {}

    def __init_subclass__(cls, *, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is None:  # a class made again from this one's namespace keeps its name
            name = cls.__dict__.get("registered_name") or cls.__name__
        if not isinstance(name, str) or not name:
            raise TypeError(
                f"class {cls.__name__}(SparseOptimizer, name={name!r}): the name must be a "
                "non-empty string."
            )
        other = _REGISTRY.get(name)
        if other is not None and not _same_class(other, cls):
            raise TypeError(
                f"the sparse optimizer name {name!r} is taken by {_where(other)}; register "
                f"{_where(cls)} under a name of its own: class {cls.__name__}("
                "jaxcache.SparseOptimizer, name='...')."
            )
        # The same class defined again (a reloaded module, or made again from
        # its namespace, as dataclass(slots=True) does) takes its name over.
        _REGISTRY[name] = cls
        cls.registered_name = name

    def __post_init__(self) -> None:
        rate, name = self.learning_rate, type(self).__name__
        if not _is_number(rate):
            raise TypeError(
                f"{name}(learning_rate=...) takes a constant step size, got a "
                f"{type(rate).__name__}; pass a positive number such as 0.01 (optax schedules "
                "are for the dense parameters)."
            )
        if not 0 < _as_float32(rate) < float("inf"):
            raise ValueError(
                f"{name}(learning_rate={rate!r}): the learning rate must be > 0 and finite "
                "in float32, in which rows are updated; pass a positive step size such as 0.01."
            )
        for field, (low, high, example) in self.bounds.items():
            value = getattr(self, field)
            if not _is_number(value):
                raise TypeError(
                    f"{name}({field}={value!r}) takes an int or a float; pass one such as "
                    f"{example}."
                )
            # Updates run in float32: a value in range as a Python float can
            # round out of it (a b1 of 1 - 1e-11 is 1.0, and divides by 0).
            if not (low <= value < high and low <= _as_float32(value) < high):
                upper = "finite" if high == float("inf") else f"< {high}"
                raise ValueError(
                    f"{name}({field}={value!r}): {field} must be >= {low} and {upper}, also "
                    f"in float32, in which rows are updated; pass a value such as {example}."
                )

    def state_spec(self, features: int) -> dict[str, RowStateSpec]:
        """Per-row state arrays, by name."""
        del features
        return {}

    def update(
        self, rows: jax.Array, grads: jax.Array, state: dict[str, jax.Array]
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Returns updated ``rows [U, D]`` and ``state`` for the touched rows."""
        raise NotImplementedError

    def scaled(self, factor: Any) -> SparseOptimizer:
        """This optimizer stepping at ``learning_rate * factor``, for one step.

        ``factor`` is a number >= 0 or a scalar array, typically traced in a
        jitted step: a learning-rate schedule's value at the step
        (``jaxcache.nnx.value_and_grad(..., learning_rate_scale=)``). The
        copy lives in that step's trace only; the configuration, its hash
        and checkpoints keep the constant rate.

        Examples:
          >>> import jax.numpy as jnp, jaxcache
          >>> half = jaxcache.sgd(0.5).scaled(jnp.float32(0.5))
          >>> rows, _ = half.update(jnp.ones((1, 2)), jnp.ones((1, 2)), {})
          >>> rows.tolist()
          [[0.75, 0.75]]
        """
        check_rate_scale(factor)
        out = copy.copy(self)
        # Frozen, as the configuration is: set on the copy alone.
        object.__setattr__(out, "learning_rate", self.learning_rate * factor)
        return out


def check_rate_scale(factor: Any) -> None:
    """Raises unless ``factor`` is a number >= 0 and finite in float32, or a
    real scalar array (a traced one is checked for shape and type only)."""
    if _is_number(factor):
        if not 0 <= _as_float32(factor) < float("inf"):
            raise ValueError(
                f"learning_rate_scale={factor!r} must be >= 0 and finite in float32 (it "
                "multiplies each table's sparse learning rate); pass a schedule's factor "
                "such as 1.0."
            )
        return
    dtype = getattr(factor, "dtype", None)
    if dtype is None or isinstance(factor, bool | np.bool_):
        raise TypeError(
            f"learning_rate_scale takes a number or a scalar array, got a "
            f"{type(factor).__name__}; pass e.g. schedule(step) of an optax schedule."
        )
    if np.ndim(factor) != 0 or not (
        jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
    ):
        raise ValueError(
            f"learning_rate_scale must be a real scalar, got shape {np.shape(factor)} and "
            f"dtype {dtype}; pass one value for the step, e.g. schedule(step)."
        )


def _is_number(value: object) -> bool:
    """An int or a float (NumPy's too): what JAX multiplies a float32 array by."""
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(
        value, bool | np.bool_
    )


def _as_float32(value: float) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(value))


# The least normal float32: XLA flushes smaller ones to 0.
_TINY = float(np.finfo(np.float32).tiny)


def _check_denominator(optimizer: Any, start: str | None) -> None:
    """Refuses an ``eps`` of 0 in float32 (below its least normal number,
    which XLA flushes to 0) where nothing else keeps a row's denominator
    above 0: a row whose gradient is 0 on its first update would become
    0 / 0 = NaN."""
    if _as_float32(optimizer.eps) >= _TINY:
        return
    if start is not None and _as_float32(getattr(optimizer, start)) >= _TINY:
        return
    name = type(optimizer).__name__
    given = f"eps={optimizer.eps!r}"
    if start is not None:
        given += f", {start}={getattr(optimizer, start)!r}"
    other = "" if start is None else f", or {start} of at least that"
    raise ValueError(
        f"{name}({given}): a row whose gradient is 0 on its first update would become NaN "
        f"(0 / 0 in float32, where values below {_TINY:.3g} are 0); pass eps >= {_TINY:.3g} "
        f"such as {optimizer.bounds['eps'][2]}{other}."
    )


@dataclasses.dataclass(frozen=True)
class SGD(SparseOptimizer):
    """Plain stochastic gradient descent: ``row -= lr * grad``.

    Examples:
      >>> import jaxcache
      >>> jaxcache.optimizers.SGD(0.1) == jaxcache.sgd(0.1)
      True
    """

    def update(self, rows, grads, state):
        new = rows.astype(jnp.float32) - self.learning_rate * grads.astype(jnp.float32)
        return new.astype(rows.dtype), state


@dataclasses.dataclass(frozen=True)
class Adagrad(SparseOptimizer):
    """Element-wise Adagrad, the same rule as ``optax.adagrad``.

    ``acc += g**2; row -= lr * g / sqrt(acc + eps)``.

    Examples:
      >>> import jax.numpy as jnp, jaxcache
      >>> opt = jaxcache.optimizers.Adagrad(1.0, initial_accumulator_value=0.0)
      >>> rows, state = opt.update(jnp.zeros((1, 2)), jnp.array([[2.0, -4.0]]),
      ...                          {"accumulator": jnp.zeros((1, 2))})
      >>> rows.tolist(), state["accumulator"].tolist()
      ([[-1.0, 1.0]], [[4.0, 16.0]])
    """

    initial_accumulator_value: float = 0.1
    eps: float = 1e-7
    bounds: ClassVar[Bounds] = {
        "initial_accumulator_value": (0.0, float("inf"), "0.1"),
        "eps": (0.0, float("inf"), "1e-7"),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_denominator(self, "initial_accumulator_value")

    def state_spec(self, features):
        return {
            "accumulator": RowStateSpec(
                (features,), np.dtype(np.float32), self.initial_accumulator_value
            )
        }

    def update(self, rows, grads, state):
        g = grads.astype(jnp.float32)
        acc = state["accumulator"] + g * g
        new = rows.astype(jnp.float32) - self.learning_rate * g * jax.lax.rsqrt(acc + self.eps)
        return new.astype(rows.dtype), {"accumulator": acc}


@dataclasses.dataclass(frozen=True)
class RowwiseAdagrad(SparseOptimizer):
    """Row-wise Adagrad (one accumulator per row, as in FBGEMM and DLRM).

    ``acc += mean(g**2); row -= lr * g / (sqrt(acc) + eps)``. It keeps one float
    per row instead of ``D``, so moving a row's state costs almost nothing.

    Examples:
      >>> import jax.numpy as jnp, jaxcache
      >>> opt = jaxcache.optimizers.RowwiseAdagrad(1.0)
      >>> rows, state = opt.update(jnp.zeros((1, 2)), jnp.array([[3.0, 4.0]]),
      ...                          {"accumulator": jnp.zeros(1)})
      >>> state["accumulator"].tolist()  # mean of the squared gradient
      [12.5]
    """

    initial_accumulator_value: float = 0.0
    eps: float = 1e-8
    bounds: ClassVar[Bounds] = {
        "initial_accumulator_value": (0.0, float("inf"), "0.0"),
        "eps": (0.0, float("inf"), "1e-8"),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_denominator(self, "initial_accumulator_value")

    def state_spec(self, features):
        del features
        return {
            "accumulator": RowStateSpec((), np.dtype(np.float32), self.initial_accumulator_value)
        }

    def update(self, rows, grads, state):
        g = grads.astype(jnp.float32)
        acc = state["accumulator"] + jnp.mean(g * g, axis=-1)
        scale = self.learning_rate / (jnp.sqrt(acc) + self.eps)
        new = rows.astype(jnp.float32) - scale[:, None] * g
        return new.astype(rows.dtype), {"accumulator": acc}


@dataclasses.dataclass(frozen=True)
class Adam(SparseOptimizer):
    """Lazy Adam: moments and the step count are kept per row.

    A row's moments decay only on steps that touch it and its bias correction
    uses its own update count, so a row updated ``k`` times follows exactly
    ``optax.adam`` applied ``k`` times to that row alone.

    Examples:
      >>> import jax.numpy as jnp, jaxcache
      >>> opt = jaxcache.optimizers.Adam(0.1)
      >>> state = {"mu": jnp.zeros((1, 2)), "nu": jnp.zeros((1, 2)),
      ...          "count": jnp.zeros(1, jnp.int32)}
      >>> rows, state = opt.update(jnp.zeros((1, 2)), jnp.array([[1.0, -1.0]]), state)
      >>> [round(x, 3) for x in rows[0].tolist()], state["count"].tolist()
      ([-0.1, 0.1], [1])
    """

    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    bounds: ClassVar[Bounds] = {
        "b1": (0.0, 1.0, "0.9"),
        "b2": (0.0, 1.0, "0.999"),
        "eps": (0.0, float("inf"), "1e-8"),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_denominator(self, None)

    def state_spec(self, features):
        f32 = np.dtype(np.float32)
        return {
            "mu": RowStateSpec((features,), f32, 0.0),
            "nu": RowStateSpec((features,), f32, 0.0),
            "count": RowStateSpec((), np.dtype(np.int32), 0),
        }

    def update(self, rows, grads, state):
        g = grads.astype(jnp.float32)
        count = state["count"] + 1
        mu = self.b1 * state["mu"] + (1.0 - self.b1) * g
        nu = self.b2 * state["nu"] + (1.0 - self.b2) * (g * g)
        t = count.astype(jnp.float32)[:, None]
        mu_hat = mu / (1.0 - self.b1**t)
        nu_hat = nu / (1.0 - self.b2**t)
        new = rows.astype(jnp.float32) - self.learning_rate * mu_hat / (jnp.sqrt(nu_hat) + self.eps)
        return new.astype(rows.dtype), {"mu": mu, "nu": nu, "count": count}


def _where(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _same_class(registered: type[SparseOptimizer], cls: type[SparseOptimizer]) -> bool:
    """Whether ``cls`` is ``registered`` defined again: the same module and
    qualified name, or a class made from its namespace (which carries the
    name it was registered under, before its qualified name is set)."""
    if _where(registered) == _where(cls):
        return True
    same_name = (registered.__module__, registered.__name__) == (cls.__module__, cls.__name__)
    return same_name and cls.__dict__.get("registered_name") == registered.registered_name


def registered() -> dict[str, type[SparseOptimizer]]:
    """The sparse optimizer classes defined so far, by the name checkpoints record.

    Returns:
      ``{name: class}`` (a copy): jaxcache's own, the serving tables'
      read-only one, and every ``SparseOptimizer`` subclass imported.

    Examples:
      >>> import jaxcache
      >>> registered = jaxcache.optimizers.registered()
      >>> registered["Adagrad"] is jaxcache.optimizers.Adagrad
      True
      >>> {"SGD", "Adagrad", "RowwiseAdagrad", "Adam", "ReadOnly"} <= set(registered)
      True
    """
    return dict(_REGISTRY)


def to_json(optimizer: SparseOptimizer) -> dict[str, Any]:
    """``{"type": registered name, **hyperparameters}``: what a checkpoint records."""
    fields = {f.name: getattr(optimizer, f.name) for f in dataclasses.fields(optimizer)}
    return {"type": type(optimizer).registered_name, **fields}


def from_json(saved: Mapping[str, Any]) -> SparseOptimizer:
    """The optimizer ``to_json`` described, built through the registry.

    Raises:
      ValueError: no class is registered under the saved name, or it does
        not take the saved hyperparameters.
    """
    fields = dict(saved)
    name = fields.pop("type", None)
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(
            f"the table was trained with the sparse optimizer {name!r}, which is not registered "
            f"(registered: {sorted(_REGISTRY)}); import the module that defines it first, or "
            f"define it: @dataclasses.dataclass(frozen=True) class MyOptimizer("
            f"jaxcache.SparseOptimizer, name={name!r}) with the saved hyperparameters "
            f"{sorted(fields)} as fields."
        )
    try:
        return cls(**fields)
    except TypeError as error:
        raise ValueError(
            f"the sparse optimizer {name!r} ({_where(cls)}) does not take the saved "
            f"hyperparameters {fields}: {error}; register the class it was trained with "
            "under this name."
        ) from None


def sgd(learning_rate: float) -> SGD:
    """Sparse SGD.

    Args:
      learning_rate: step size.

    Returns:
      The optimizer, to pass as ``CacheConfig(optimizer=...)``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxcache
      >>> opt = jaxcache.sgd(0.5)
      >>> rows, _ = opt.update(jnp.ones((1, 2)), jnp.ones((1, 2)), {})
      >>> rows.tolist()
      [[0.5, 0.5]]
    """
    return SGD(learning_rate)


def adagrad(
    learning_rate: float, *, initial_accumulator_value: float = 0.1, eps: float = 1e-7
) -> Adagrad:
    """Sparse element-wise Adagrad (same rule and defaults as ``optax.adagrad``).

    Args:
      learning_rate: step size.
      initial_accumulator_value: starting value of each accumulator.
      eps: added inside the square root.

    Returns:
      The optimizer.

    Examples:
      >>> import jaxcache
      >>> sorted(jaxcache.adagrad(0.1).state_spec(4))
      ['accumulator']
    """
    return Adagrad(learning_rate, initial_accumulator_value, eps)


def rowwise_adagrad(
    learning_rate: float, *, initial_accumulator_value: float = 0.0, eps: float = 1e-8
) -> RowwiseAdagrad:
    """Sparse row-wise Adagrad: one accumulator per row.

    Args:
      learning_rate: step size.
      initial_accumulator_value: starting value of each row's accumulator.
      eps: added to the square root.

    Returns:
      The optimizer.

    Examples:
      >>> import jaxcache
      >>> jaxcache.rowwise_adagrad(0.1).state_spec(4)["accumulator"].shape
      ()
    """
    return RowwiseAdagrad(learning_rate, initial_accumulator_value, eps)


def adam(learning_rate: float, *, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> Adam:
    """Sparse lazy Adam with a per-row step count.

    Args:
      learning_rate: step size.
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to the root of the second moment.

    Returns:
      The optimizer.

    Examples:
      >>> import jaxcache
      >>> sorted(jaxcache.adam(1e-3).state_spec(4))
      ['count', 'mu', 'nu']
    """
    return Adam(learning_rate, b1, b2, eps)
