"""Checks on ids coming from users, done on the host before any state changes."""

from __future__ import annotations

from typing import Any, TypeGuard

import jax
import numpy as np

__all__ = [
    "check_frequencies",
    "check_host_ids",
    "check_id_type",
    "check_ids",
    "check_raw_ids",
    "is_int",
    "is_integer_dtype",
]


def is_int(value: object) -> TypeGuard[int | np.integer]:
    """A whole number: a Python or NumPy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_padding_id(pad: object) -> None:
    """Raises ``ValueError`` unless ``pad`` is ``None`` or an int64 value."""
    if pad is not None and (not is_int(pad) or not -(2**63) <= pad < 2**63):
        raise ValueError(
            f"padding_id={pad!r} must be an int64 id (such as -1) or None: ids are "
            "compared with it as int64."
        )


def check_padding_outside(pad: int | None, num_embeddings: int) -> None:
    """Raises ``ValueError`` for a padding id that is a row of the table:
    its lookups would read and train a real row."""
    if pad is not None and 0 <= pad < num_embeddings:
        raise ValueError(
            f"padding_id={pad} is a real row id (0 <= id < {num_embeddings}); "
            "use a negative id such as -1."
        )


def is_integer_dtype(dtype: np.dtype) -> bool:
    """A signed or unsigned integer dtype: not bool, and not ``timedelta64``,
    which NumPy counts among its integers."""
    return dtype.kind in "iu"


def check_ids(
    ids: object,
    num_embeddings: int,
    padding_id: int | None,
    name: str,
    *,
    dynamic_fix: bool = True,
) -> np.ndarray:
    """Returns ``ids`` as a NumPy integer array, or raises a clear error.

    Ids must be integers of rank >= 1 in ``[0, num_embeddings)``, or equal to
    ``padding_id``. Nothing is cast silently: a float or bool array is refused
    rather than truncated, and a large int64 is never wrapped to int32.
    ``dynamic_fix=False`` leaves the dynamic vocabulary out of the error's
    fixes, for ids of a fixed table that cannot take raw ids (dataset counts).
    """
    array = check_id_type(ids, name)
    if array.size == 0:
        return array
    lo, hi = array.min(), array.max()
    if lo >= 0 and hi < num_embeddings:
        return array
    bad = (array < 0) | (array >= num_embeddings)
    if padding_id is not None:
        bad &= array != padding_id
    if bad.any():
        value = int(array[bad].flat[0])
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        hint = "ids must be in [0, num_embeddings); "
        if dynamic_fix:
            # Raw ids (hashed values, growing user ids) first get the fix that
            # keeps them apart; reducing them modulo the table makes ids share rows.
            hint += (
                "for raw ids, give each its own row with "
                "CacheConfig(vocabulary=jaxcache.DynamicVocabulary()), or "
            )
        hint += "reduce hashed ids modulo the vocabulary on the host"
        if value < 0 and padding_id is None:
            hint += ", or set padding_id to mark empty bag positions"
        elif value < 0:
            hint += f"; empty bag positions hold the padding id, {padding_id}"
        raise ValueError(
            f"{name} holds {value} at index {where}, outside [0, {num_embeddings}) "
            f"({int(bad.sum())} bad value(s)); {hint}."
        )
    return array


def check_id_type(ids: object, name: str) -> np.ndarray:
    """Returns ``ids`` as a NumPy integer array of rank >= 1, or raises a clear
    error; the values are not checked (``check_ids`` checks them too)."""
    check_not_traced(ids, name)
    array = id_array(ids, name)
    check_id_layout(array.dtype, array.ndim, name)
    return array


def id_array(ids: object, name: str) -> np.ndarray:
    """``np.asarray(ids)``, refusing first Python ints that no int64 holds:
    NumPy makes a list of them float64 (losing their low bits) or object,
    and converting to int64 as the dtype error advises would overflow."""
    array = np.asarray(ids)
    if not isinstance(ids, np.ndarray) and array.dtype.kind in "fO":
        _check_python_ints(ids, name)
    return array


def _check_python_ints(ids: object, name: str) -> None:
    try:
        values = np.asarray(ids, dtype=object).reshape(-1)
    except ValueError:  # ragged: the dtype error says enough
        return
    if not all(isinstance(v, (int, np.integer)) for v in values):
        return
    beyond = [int(v) for v in values if not -(2**63) <= int(v) < 2**63]
    if beyond:
        raise ValueError(
            f"{name} holds integers beyond int64 ({len(beyond)}, such as {beyond[0]}), which "
            "NumPy turns into floats; ids must fit int64. Raw ids of 64 unsigned bits: pass "
            f"np.asarray({name}, dtype=np.uint64).view(np.int64), one int64 each."
        )


def check_not_traced(ids: object, name: str) -> None:
    """Raises ``TypeError`` for ids traced by ``jit``: a batch is planned on
    the host, from values a traced array does not have yet."""
    if isinstance(ids, jax.core.Tracer):
        raise TypeError(
            f"{name} are traced: planning a batch runs on the host, outside jit. Call "
            "prepare (or jaxcache.prefetch) before the jitted step and pass the Lookup "
            "it returns into the step, or look the ids up inside the step with "
            "CachedEmbed.lookup_ids."
        )


def check_id_layout(dtype: Any, ndim: int, name: str) -> None:
    """Raises unless ids of ``dtype`` and rank ``ndim`` are integers of rank
    >= 1: ``check_id_type`` for ids known only by type, as in a traced step."""
    if not is_integer_dtype(np.dtype(dtype)):
        raise TypeError(
            f"{name} must be an integer array, got dtype {np.dtype(dtype)}; "
            f"convert with np.asarray({name}, dtype=np.int64) if the values are whole ids."
        )
    if ndim == 0:
        raise ValueError(
            f"{name} must have rank >= 1 (e.g. [batch] or [batch, bag]), got a scalar; "
            f"wrap it as np.array([{name}])."
        )


def check_host_ids(
    ids: object, num_embeddings: int, padding_id: int | None, name: str
) -> np.ndarray:
    """``check_id_type``, and the bad values the host planner's compiled loops
    would take for padding (they check the others as they read the ids): an
    unsigned value past int64, which converting would wrap onto a negative
    id (``2^64 - 1`` onto ``-1``), and with no padding id the int64 minimum,
    their stand-in for none. One vectorized pass over an int64 or uint64
    batch.

    Examples:
      >>> try:
      ...     check_host_ids(np.array([3, np.iinfo(np.int64).min]), 10, None, "ids")
      ... except ValueError as error:
      ...     print(str(error).split(";")[0])
      ids holds -9223372036854775808 at index (1,), outside [0, 10) (1 bad value(s))
    """
    array = check_id_type(ids, name)
    if array.size and array.dtype.itemsize == 8:
        if array.dtype.kind == "u":
            suspect = int(array.max()) > np.iinfo(np.int64).max
        else:
            suspect = padding_id is None and int(array.min()) == np.iinfo(np.int64).min
        if suspect:
            check_ids(array, num_embeddings, padding_id, name)  # raises, naming the value
    return array


def check_raw_ids(ids: object, name: str) -> np.ndarray:
    """Returns raw ids (any int64) as an ``int64`` NumPy array, or raises a
    clear error. An unsigned 64-bit value of ``2^63`` or more has no int64 of
    its own: converting it would wrap it onto a negative id (``2^64 - 1``
    onto ``-1``, a common padding id), so it is refused, not cast.

    Examples:
      >>> check_raw_ids(np.array([7, 2**40], np.uint64), "ids").dtype
      dtype('int64')
      >>> try:
      ...     check_raw_ids(np.array([7, 2**64 - 1], np.uint64), "ids")
      ... except ValueError as error:
      ...     print(str(error).split(";")[0])
      ids holds 18446744073709551615 at index (1,), above the int64 raw ids take (1 such value(s))
    """
    array = check_id_type(ids, name)
    if array.dtype.kind == "u" and array.size and int(array.max()) > np.iinfo(np.int64).max:
        above = array > np.iinfo(np.int64).max
        where = tuple(int(i) for i in np.argwhere(above)[0])
        raise ValueError(
            f"{name} holds {int(array[where])} at index {where}, above the int64 raw ids "
            f"take ({int(above.sum())} such value(s)); pass {name}.view(np.int64) to keep "
            "all 64 bits (each value then maps to one int64; none may equal padding_id)."
        )
    return array.astype(np.int64, copy=False)


def check_frequencies(frequencies: object, num_embeddings: int, hint: str) -> np.ndarray:
    """Returns access counts as ``int64 [N]``, or raises a clear error.

    Args:
      frequencies: one non-negative integer count per table row.
      num_embeddings: ``N``.
      hint: how the caller can get correct counts.
    """
    counts = np.asarray(frequencies)
    if counts.shape != (num_embeddings,) or not is_integer_dtype(counts.dtype):
        raise ValueError(
            f"frequencies must be an integer array of shape ({num_embeddings},), one count per "
            f"table row, got {counts.dtype} {counts.shape}; {hint}."
        )
    if counts.size and counts.min() < 0:
        raise ValueError(f"frequencies must be >= 0 (access counts), got {int(counts.min())}.")
    if counts.size and int(counts.max()) >= 2**62:
        # The policies add each lookup to them in int64: room for 2**62 more.
        raise ValueError(
            f"frequencies hold {int(counts.max())}, too near the int64 counts are kept in "
            "(each lookup adds to them); pass counts below 2**62, divided down if need be."
        )
    return counts.astype(np.int64)
