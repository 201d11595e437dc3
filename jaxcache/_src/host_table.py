"""The full embedding table and its per-row optimizer state, in host memory.

Rows are always stored in the caller's id order (row ``i`` is id ``i``), so
exporting or checkpointing never scrambles them. Arrays are plain NumPy, or
``np.memmap`` files when a directory is given, for tables larger than RAM.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import numpy as np

from jaxcache._src.config import CacheConfig

__all__ = ["HostTable", "embed_init", "normal_init", "uniform_init"]

# Rows initialised per chunk, so a memory-mapped table never needs a full copy.
_INIT_CHUNK_ROWS = 1 << 16

Initializer = Callable[[np.random.Generator, tuple[int, int]], np.ndarray]


def normal_init(stddev: float = 0.01) -> Initializer:
    """Rows drawn from ``N(0, stddev**2)``.

    Args:
      stddev: standard deviation.

    Returns:
      An initializer ``(rng, shape) -> float32 array``.

    Examples:
      >>> import numpy as np, jaxcache
      >>> jaxcache.normal_init(0.1)(np.random.default_rng(0), (2, 3)).shape
      (2, 3)
    """

    def init(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
        return rng.normal(0.0, stddev, size=shape).astype(np.float32)

    return init


def uniform_init(scale: float = 0.05) -> Initializer:
    """Rows drawn uniformly from ``[-scale, scale)``.

    Args:
      scale: half-width of the interval.

    Returns:
      An initializer ``(rng, shape) -> float32 array``.

    Examples:
      >>> import numpy as np, jaxcache
      >>> x = jaxcache.uniform_init(0.5)(np.random.default_rng(0), (100, 4))
      >>> bool(np.abs(x).max() <= 0.5)
      True
    """

    def init(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
        return rng.uniform(-scale, scale, size=shape).astype(np.float32)

    return init


def embed_init() -> Initializer:
    """The distribution of Flax's default embedding initializer.

    ``flax.linen.initializers.variance_scaling(1.0, "fan_in", "normal",
    out_axis=0)`` on a ``[N, D]`` table has fan-in ``D``: a normal with
    variance ``1 / D`` (not truncated). Same distribution, NumPy's generator.

    Returns:
      An initializer ``(rng, shape) -> float32 array``.

    Examples:
      >>> import numpy as np, jaxcache
      >>> x = jaxcache.embed_init()(np.random.default_rng(0), (20000, 16))
      >>> round(float(x.var() * 16), 1)
      1.0
    """

    def init(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
        return (rng.standard_normal(size=shape) * math.sqrt(1.0 / shape[1])).astype(np.float32)

    return init


class HostTable:
    """Rows ``[N, D]`` plus per-row optimizer state, in id order.

    Args:
      config: the table's configuration.
      rows: an existing ``[N, D]`` array to start from (copied, or used as is
        with ``copy=False``); when ``None`` rows are drawn from ``init``.
      init: initializer for new rows (default: ``embed_init()``).
      seed: seed of the initializer.
      directory: when given, rows and state live in ``np.memmap`` files there
        (``rows.npy`` and ``<state>.npy``), for tables larger than RAM.
      copy: copy ``rows`` (default) or adopt the array as the table.

    Attributes:
      rows: ``[N, D]`` array of the table's dtype.
      state: ``{name: [N, ...]}`` optimizer state per row.

    Examples:
      >>> import jaxcache
      >>> cfg = jaxcache.CacheConfig(100, 4, capacity=10, optimizer=jaxcache.adagrad(0.1))
      >>> table = jaxcache.HostTable(cfg, seed=0)
      >>> table.rows.shape, table.state["accumulator"].shape
      ((100, 4), (100, 4))
    """

    def __init__(
        self,
        config: CacheConfig,
        *,
        rows: np.ndarray | None = None,
        init: Initializer | None = None,
        seed: int = 0,
        directory: str | os.PathLike[str] | None = None,
        copy: bool = True,
    ) -> None:
        self.config = config
        shape = (config.num_embeddings, config.features)
        if rows is not None:
            rows = np.asarray(rows)
            if rows.shape != shape:
                raise ValueError(
                    f"rows has shape {rows.shape} but the config needs {shape} "
                    "(num_embeddings, features)."
                )
            if not np.issubdtype(rows.dtype, np.floating) and rows.dtype != config.row_dtype:
                raise TypeError(f"rows must be floating point, got dtype {rows.dtype}.")
        self.directory = None if directory is None else os.fspath(directory)
        if self.directory is not None:
            os.makedirs(self.directory, exist_ok=True)
        self.rows = self._allocate("rows", shape, config.row_dtype)
        if rows is not None:
            if copy or self.directory is not None or rows.dtype != config.row_dtype:
                for lo in range(0, shape[0], _INIT_CHUNK_ROWS):
                    self.rows[lo : lo + _INIT_CHUNK_ROWS] = rows[lo : lo + _INIT_CHUNK_ROWS]
            else:
                self.rows = rows
        else:
            init = init or embed_init()
            rng = np.random.default_rng(seed)
            for lo in range(0, shape[0], _INIT_CHUNK_ROWS):
                hi = min(lo + _INIT_CHUNK_ROWS, shape[0])
                self.rows[lo:hi] = init(rng, (hi - lo, shape[1]))
        self.state: dict[str, np.ndarray] = {}
        for name, spec in config.optimizer.state_spec(config.features).items():
            array = self._allocate(name, (config.num_embeddings, *spec.shape), spec.dtype)
            array[...] = spec.init
            self.state[name] = array

    def _allocate(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if self.directory is None:
            return np.empty(shape, dtype)
        path = os.path.join(self.directory, f"{name}.npy")
        return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)

    @property
    def num_embeddings(self) -> int:
        """``N``, the number of rows."""
        return self.config.num_embeddings

    def gather(self, ids: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Fresh copies of rows ``ids`` and their state (safe to hand to a device)."""
        return self.rows[ids], {name: array[ids] for name, array in self.state.items()}

    def scatter(self, ids: np.ndarray, rows: np.ndarray, state: dict[str, np.ndarray]) -> None:
        """Writes rows ``ids`` and their state back."""
        self.rows[ids] = rows
        for name, array in self.state.items():
            array[ids] = state[name]
