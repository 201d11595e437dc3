"""Serving: read-only tables, hot rows preloaded, batched lookups through the pipeline.

A serving table is an ``EmbeddingCache`` built from ``serving_config``: its
"optimizer" keeps no per-row state and refuses to update, so the host table
and the device hold rows only. Its batches are planned as with ``train=False``
whatever ``train`` says, so no row is ever dirty and nothing is ever written
back (``cache.stats`` counts zero bytes device -> host), and a raw id it has
no row for is never admitted. Restoring a training checkpoint into it
(``Checkpointer.restore``) reads the rows and preloads the rows the training
cache held, hottest first by the access counts it kept, then the hottest
other ids by those counts while slots are left.

``Server`` scores batches with the same Flax module the model was trained
with, in eval mode, through ``jaxcache.prefetch``: one cache per table is
shared by every request, and the next batches are planned and transferred
while the device scores the current one.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jaxcache._src import optimizers
from jaxcache._src.config import CacheConfig
from jaxcache._src.holder import CacheHolder
from jaxcache._src.pipeline import check_lookahead, prefetch
from jaxcache._src.validation import is_int

__all__ = ["ReadOnly", "Server", "serving_config"]


@dataclasses.dataclass(frozen=True)
class ReadOnly(optimizers.SparseOptimizer):
    """The sparse "optimizer" of a serving table: no per-row state, no update.

    Examples:
      >>> from jaxcache._src.serving import ReadOnly
      >>> ReadOnly().state_spec(16)
      {}
    """

    learning_rate: float = 0.0
    trains: ClassVar[bool] = False

    def __post_init__(self) -> None:
        """Nothing to check: a read-only table has no learning rate."""

    def update(self, rows, grads, state):
        raise TypeError(
            "this table is read-only (built with jaxcache.serving_config): it serves lookups "
            "and cannot be trained; train through a cache built with the training config."
        )


def serving_config(
    config: CacheConfig, *, capacity: int | float | None = None, policy: str = "lfu"
) -> CacheConfig:
    """The configuration of a read-only copy of a table, for inference.

    The same table (rows, width, dtype, padding id, name) with no optimizer
    state, and the capacity and policy of the serving device.

    Args:
      config: the table's training configuration, e.g.
        ``Checkpointer.cache_config(name)``.
      capacity: rows on device, a count or a fraction of the table; default:
        the training capacity.
      policy: eviction policy while serving. The default ``"lfu"`` starts
        from the access counts a checkpoint kept (``"adaptive"``, ``"lfu"``
        and ``"frequency"`` training caches keep them), so the hottest rows
        are preloaded and stay; ``"frequency"`` also needs ``frequencies=`` when
        the cache is built.

    Returns:
      A ``CacheConfig``; build the serving cache with it and restore the
      checkpoint into the model that holds it.

    Examples:
      >>> import jaxcache
      >>> train = jaxcache.CacheConfig(1000, 8, capacity=100, optimizer=jaxcache.adam(0.01))
      >>> serve = jaxcache.serving_config(train, capacity=0.5)
      >>> serve.capacity, serve.optimizer.state_spec(8), serve.row_bytes
      (500, {}, 32)
    """
    return dataclasses.replace(
        config,
        optimizer=ReadOnly(),
        capacity=config.capacity if capacity is None else capacity,
        policy=policy,
    )


class Server:
    """Scores batches with a model whose tables are read-only serving caches.

    Every batch goes through ``jaxcache.prefetch`` with ``train=False``: its
    ids are planned and their missing rows transferred ahead, on a host
    thread, while the device scores the batch before it. The caches are
    shared by all requests, so the hot rows stay on device from one request
    to the next; nothing is ever written back.

    Args:
      model: the NNX model, built like the trained one around serving caches
        (``serving_config``); it is put in eval mode.
      predict: ``predict(batch) -> scores`` for a batch whose ids were
        replaced by ``Lookup`` objects, e.g. built from
        ``jaxcache.models.make_predict_step(model)``.
      tables: batch key -> ``CachedEmbed`` of a serving cache, as for
        ``jaxcache.prefetch``.
      lookahead: batches planned and transferred ahead.
      latency_window: how many of the latest batches' latencies are kept
        (a server runs for days: older ones are dropped).
      batch_sizes: the batch sizes the model and the planner are compiled
        for, e.g. ``(64, 256, 1024)``; default ``None``: each batch as it
        comes, which compiles once per new size. With them, a batch of ``n``
        samples is padded to the smallest size of at least ``n`` by
        repeating its last sample (along the first axis of every array in
        the batch), and one larger than the largest is scored in pieces of
        that size; its scores are cut back to ``n``. Repeated samples add no
        distinct id, so the batch itself fetches the same rows; figures per
        lookup (``cache.stats`` lookups and refused lookups) include the
        repeats, and so do the lookup counts ``lfu`` and ``adaptive`` rank
        rows by, which can change what later batches find resident (``lru``,
        which ranks by last use only, is unchanged).

    Attributes:
      latencies: seconds per batch of the latest ``latency_window``
        batches (a ``collections.deque``),
        from taking the batch from the source to its scores being on the
        host (the time it waited in the pipeline included). ``reset()``
        after a warm-up starts them, and ``summary``'s counts, afresh.

    Examples:
      >>> import numpy as np, jax.numpy as jnp, jaxcache
      >>> cfg = jaxcache.serving_config(jaxcache.CacheConfig(100, 4, capacity=16))
      >>> embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg), combiner="sum")
      >>> server = jaxcache.Server(embed, lambda b: embed(b["ids"]).sum(-1), {"ids": embed})
      >>> batches = [{"ids": np.array([[1, 2], [2, 3]])}, {"ids": np.array([[2, 5], [1, 1]])}]
      >>> [s.shape for s in server.score(batches)], embed.cache.stats.bytes_to_host
      ([(2,), (2,)], 0)
      >>> sorted(server.summary())
      ['batches', 'bytes_to_host', 'hit_rate', 'p50_ms', 'p90_ms', 'p99_ms']
    """

    def __init__(
        self,
        model: nnx.Module,
        predict: Callable[[dict[str, Any]], Any],
        tables: Mapping[str, CacheHolder],
        *,
        lookahead: int = 2,
        latency_window: int = 100_000,
        batch_sizes: Iterable[int] | None = None,
    ) -> None:
        check_lookahead(lookahead)
        self.batch_sizes = None if batch_sizes is None else _check_batch_sizes(batch_sizes)
        if not is_int(latency_window) or latency_window < 1:
            raise ValueError(
                f"latency_window={latency_window!r}: pass how many batches' latencies to "
                "keep, a whole number of at least 1."
            )
        for key, holder in tables.items():
            config = getattr(getattr(holder, "cache", None), "config", None)
            if getattr(getattr(config, "optimizer", None), "trains", True):
                raise ValueError(
                    f"tables[{key!r}] is not a serving table; build its cache from "
                    "jaxcache.serving_config(config), which keeps no optimizer state and "
                    "never writes rows back."
                )
            devices = holder.cache.devices
            uneven = [n for n in self.batch_sizes or () if n % devices]
            if uneven:
                raise ValueError(
                    f"batch_sizes={list(self.batch_sizes or ())}: tables[{key!r}] splits each "
                    f"batch over {devices} devices, so every size must be a multiple of "
                    f"{devices}; {uneven} {'is' if len(uneven) == 1 else 'are'} not."
                )
        model.eval()
        self.model = model
        self.predict = predict
        self.tables = dict(tables)
        self.lookahead = lookahead
        self.latencies: collections.deque[float] = collections.deque(maxlen=int(latency_window))
        self._since = self._counts()
        self._scoring = threading.Lock()  # held while a score() stream runs

    def reset(self) -> None:
        """Starts ``summary`` afresh, e.g. after a warm-up: clears
        ``latencies`` and counts hits and bytes from now on."""
        self.latencies.clear()
        self._since = self._counts()

    def _counts(self) -> np.ndarray:
        """Hits, distinct ids and bytes written back so far, all tables together."""
        caches = [holder.cache for holder in self.tables.values()]
        return np.array(
            [
                sum(c.stats.total.hits for c in caches),
                sum(c.stats.total.distinct for c in caches),
                sum(c.stats.bytes_to_host for c in caches),
            ]
        )

    def score(self, batches: Iterable[Mapping[str, Any]]) -> Iterator[np.ndarray]:
        """Scores of each batch, in order, as NumPy arrays.

        Args:
          batches: mappings holding each table's ids under its key.

        Yields:
          ``predict(batch)`` as NumPy (copied to the host; over several
          processes, every process gets the whole batch's scores).

        Closing the stream before its end (``close()``, or an error in
        ``predict``) drops the batches the pipeline had taken from
        ``batches`` ahead of the last one yielded: up to ``lookahead``
        batches, or pieces with ``batch_sizes``. Score them again if they
        matter.

        Raises:
          RuntimeError: another ``score`` stream of this server is running
            (on another thread, or an earlier iterator neither run to its
            end nor closed): the caches plan one stream at a time, and two
            planning at once would read each other's rows.
        """
        if not self._scoring.acquire(blocking=False):
            raise RuntimeError(
                "Server.score is already running (on another thread, or an earlier score() "
                "iterator that was neither run to its end nor closed): a Server scores one "
                "stream at a time. Serve requests from one thread (queue them in front of it), "
                "or close the earlier iterator first."
            )
        try:
            yield from self._score(batches)
        finally:
            self._scoring.release()

    def _score(self, batches: Iterable[Mapping[str, Any]]) -> Iterator[np.ndarray]:
        taken: collections.deque[float] = collections.deque()
        # (samples of the piece that are real, its padded size, whether it
        # ends its batch), one per piece the pipeline stages, in order.
        pieces: collections.deque[tuple[int, int, bool]] = collections.deque()

        def source() -> Iterator[Mapping[str, Any]]:
            for batch in batches:
                if self.batch_sizes is None:
                    taken.append(time.perf_counter())
                    yield batch
                    continue
                cut = list(_pieces(batch, self.batch_sizes, list(self.tables)))
                taken.append(time.perf_counter())
                for i, (piece, used, size) in enumerate(cut):
                    pieces.append((used, size, i == len(cut) - 1))
                    yield piece

        parts: list[np.ndarray] = []
        with prefetch(source(), self.tables, lookahead=self.lookahead, train=False) as pipeline:
            for batch in pipeline:
                scores = _to_host(self.predict(batch))
                if self.batch_sizes is not None:
                    used, size, last = pieces.popleft()
                    parts.append(_cut(scores, used, size))
                    if not last:
                        continue
                    scores = parts[0] if len(parts) == 1 else np.concatenate(parts)
                    parts = []
                self.latencies.append(time.perf_counter() - taken.popleft())
                yield scores

    def summary(self) -> dict[str, float]:
        """Latency percentiles (ms) of the batches in ``latencies`` and their
        number, and the hit rate and bytes written back since the server was
        built or last ``reset``.

        The hit rate is over distinct ids per batch, all tables together;
        over several processes, of this process's devices (as
        ``cache.stats``).
        """
        latencies = np.asarray(self.latencies or [np.nan]) * 1e3
        p50, p90, p99 = np.percentile(latencies, [50, 90, 99])
        hits, distinct, written = (int(x) for x in self._counts() - self._since)
        return {
            "batches": len(self.latencies),
            "p50_ms": float(p50),
            "p90_ms": float(p90),
            "p99_ms": float(p99),
            "hit_rate": hits / max(1, distinct),
            "bytes_to_host": written,
        }


def _to_host(scores: Any) -> np.ndarray:
    """``scores`` as NumPy. An array split over the devices of several
    processes is gathered from all of them (a collective: every process
    scores the same batches), so each process gets every score."""
    if isinstance(scores, jax.Array) and not scores.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(scores, tiled=True))
    return np.asarray(jax.device_get(scores))


def _check_batch_sizes(batch_sizes: Iterable[int]) -> tuple[int, ...]:
    sizes = list(batch_sizes)
    if not sizes or not all(is_int(n) and n >= 1 for n in sizes):
        raise ValueError(
            f"batch_sizes={sizes!r}: pass the batch sizes to compile for, whole numbers of "
            "at least 1, e.g. (64, 256, 1024); or None to score each batch as it comes."
        )
    return tuple(sorted({int(n) for n in sizes}))


def _samples(batch: Mapping[str, Any], keys: list[str]) -> int:
    """The batch's number of samples: the first axis of its tables' ids."""
    sizes = {key: np.shape(batch[key])[:1] for key in keys if key in batch}
    if len(set(sizes.values())) != 1 or () in sizes.values():
        raise ValueError(
            f"the ids under {sorted(sizes)} have first axes {sizes}: with batch_sizes, every "
            "table's ids must be an array of the same number of samples along axis 0."
        )
    return sizes.popitem()[1][0]


def _pieces(
    batch: Mapping[str, Any], sizes: tuple[int, ...], keys: list[str]
) -> Iterator[tuple[dict[str, Any], int, int]]:
    """``(piece, samples used, padded size)``: ``batch`` cut into pieces of
    at most ``sizes[-1]`` samples, each padded to the smallest size that
    holds it by repeating its last sample (every array leaf along axis 0;
    scalars and strings as they are). All is checked before the first piece."""
    batch = {key: np.asarray(value) if key in keys else value for key, value in batch.items()}
    n = _samples(batch, keys)
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        if np.ndim(leaf) and np.shape(leaf)[0] != n:
            raise ValueError(
                f"batch{jax.tree_util.keystr(path)} has {np.shape(leaf)[0]} entries along "
                f"axis 0 but the batch has {n} samples; with batch_sizes every array of a batch "
                "is cut and padded along axis 0, so each must hold one entry per sample (or be "
                "a scalar)."
            )
    if n == 0:  # nothing to repeat: scored as it is
        yield batch, 0, 0
        return
    for start in range(0, n, sizes[-1]):
        used = min(sizes[-1], n - start)
        size = next(s for s in sizes if s >= used)

        def piece(leaf: Any, start: int = start, used: int = used, size: int = size) -> Any:
            if not np.ndim(leaf):
                return leaf
            return _padded(np.asarray(leaf)[start : start + used], size)

        yield jax.tree.map(piece, batch), used, size


def _padded(value: np.ndarray, size: int) -> np.ndarray:
    if len(value) == size:
        return value
    return np.concatenate([value, np.repeat(value[-1:], size - len(value), axis=0)])


def _cut(scores: np.ndarray, used: int, size: int) -> np.ndarray:
    if scores.ndim == 0 or scores.shape[0] != size:
        raise ValueError(
            f"predict returned scores of shape {scores.shape} for a batch of {size} samples; "
            "with batch_sizes the scores must have one entry per sample along axis 0, which "
            "are cut back to the batch's own samples."
        )
    return scores[:used]
