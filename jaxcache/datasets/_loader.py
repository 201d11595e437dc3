"""Fixed-size NumPy batches from a split stored as chunked records.

A record holds a chunk of rows (``{"sparse": int64 [R, 26], ...}``); the
loader reads records, regroups their rows into batches of exactly ``B`` rows
and hands them out as dicts of NumPy arrays. Shuffling is two-level, as in
TFDS and Grain: the record order is permuted every epoch, and the rows of a
window of ``window`` records are permuted together. All of it is NumPy over
whole chunks, so a batch costs a few array copies, never a Python loop over
rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["Loader"]


class RecordSource(Protocol):
    """What the loader reads: ``len`` and records by index (``builder.as_data_source``)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Mapping[str, Any]: ...


class Loader:
    """Batches of ``batch_size`` rows from a source of row chunks, optionally shuffled.

    Every epoch is a deterministic function of ``(seed, epoch)``: without
    shuffling, rows come in storage order; with shuffling, the records are
    read in a permuted order, ``window`` records at a time, and the rows of a
    window (plus the rows left over from the previous one) are permuted
    before they are cut into batches. A larger window mixes better and costs
    memory (``window x rows per record`` rows).

    Args:
      source: records, each a mapping of arrays with the same first axis
        (rows), e.g. ``builder.as_data_source("train")`` or a list of dicts.
      batch_size: ``B``, rows per batch.
      shuffle: permute records and rows every epoch.
      seed: seed of the permutations.
      window: records whose rows are shuffled together.
      drop_remainder: drop the last batch of an epoch when it has fewer than
        ``B`` rows.
      num_epochs: epochs ``iter(loader)`` runs; ``None`` repeats forever.
      keys: the fields to keep (default: every array field of the records).

    Examples:
      >>> import numpy as np, jaxcache.datasets as jd
      >>> chunks = [{"x": np.arange(4) + 4 * i} for i in range(3)]  # 12 rows, 4 per record
      >>> [b["x"].tolist() for b in jd.Loader(chunks, batch_size=5)]
      [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
      >>> [b["x"].tolist() for b in jd.Loader(chunks, batch_size=5, drop_remainder=False)][-1]
      [10, 11]
      >>> loader = jd.Loader(chunks, batch_size=6, shuffle=True, seed=0, num_epochs=2)
      >>> [sorted(np.concatenate([b["x"] for b in loader.epoch(e)]).tolist()) == list(range(12))
      ...  for e in range(2)]
      [True, True]
    """

    def __init__(
        self,
        source: RecordSource | Sequence[Mapping[str, Any]],
        batch_size: int,
        *,
        shuffle: bool = False,
        seed: int = 0,
        window: int = 16,
        drop_remainder: bool = True,
        num_epochs: int | None = 1,
        keys: Sequence[str] | None = None,
    ) -> None:
        for name, value in (("batch_size", batch_size), ("window", window)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if num_epochs is not None and (not isinstance(num_epochs, int) or num_epochs < 0):
            raise ValueError(
                f"num_epochs must be an integer >= 0 or None (repeat), got {num_epochs!r}."
            )
        if len(source) == 0:
            raise ValueError(
                "the source holds no records; check the split name and that the dataset was "
                "built (builder.info.splits lists the splits and their records)."
            )
        self.source = source
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.seed = seed
        self.window = int(window)
        self.drop_remainder = drop_remainder
        self.num_epochs = num_epochs
        self.keys = None if keys is None else tuple(keys)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        epochs = itertools.count() if self.num_epochs is None else range(self.num_epochs)
        for epoch in epochs:
            yield from self.epoch(epoch)

    def _read(self, index: int) -> dict[str, np.ndarray]:
        record = self.source[int(index)]
        keys: Sequence[str] | None = self.keys
        if keys is None:
            keys = [k for k, v in record.items() if isinstance(v, np.ndarray) and v.ndim >= 1]
        try:
            chunk = {k: record[k] for k in keys}
        except KeyError as error:
            raise KeyError(
                f"record {index} has no field {error.args[0]!r}; its fields are "
                f"{sorted(record)}. Pass keys= with some of those."
            ) from None
        rows = {len(v) for v in chunk.values()}
        if len(rows) != 1:
            raise ValueError(
                f"the fields of record {index} have different numbers of rows "
                f"({ {k: len(v) for k, v in chunk.items()} }); every field must be a chunk of "
                "the same rows."
            )
        return chunk

    def epoch(self, index: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """The batches of epoch ``index`` (the same on every call).

        Args:
          index: the epoch, ``>= 0``: picks the permutations.

        Yields:
          Dicts of NumPy arrays, ``batch_size`` rows each (the last one may be
          smaller unless ``drop_remainder``).
        """
        rng = np.random.default_rng([self.seed, index])
        order = rng.permutation(len(self.source)) if self.shuffle else range(len(self.source))
        size = self.batch_size
        carry: dict[str, np.ndarray] | None = None
        emitted = False
        for lo in range(0, len(self.source), self.window):
            parts = [self._read(i) for i in order[lo : lo + self.window]]
            if carry is not None:
                parts.insert(0, carry)
            # Always a fresh copy: batches are writable and never alias a decoded record.
            rows = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
            n = len(next(iter(rows.values())))
            full = n - n % size
            if self.shuffle:
                perm = rng.permutation(n)
                for start in range(0, full, size):
                    take = perm[start : start + size]
                    # np.take is several times faster than v[take] for 2-D rows.
                    yield {k: np.take(v, take, axis=0) for k, v in rows.items()}
                carry = {k: np.take(v, perm[full:], axis=0) for k, v in rows.items()}
            else:
                for start in range(0, full, size):
                    yield {k: v[start : start + size] for k, v in rows.items()}
                carry = {k: v[full:] for k, v in rows.items()}
            emitted |= full > 0
        if carry is not None and len(next(iter(carry.values()))) and not self.drop_remainder:
            yield carry
            emitted = True
        if not emitted:
            raise ValueError(
                f"the source holds fewer rows than batch_size={size}, so an epoch has no "
                "batch; lower batch_size or pass drop_remainder=False."
            )
