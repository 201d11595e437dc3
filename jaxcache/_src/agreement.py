"""Padded sizes every process agrees on, when a cache spans several processes.

The arrays of a step are global arrays of the mesh: every process must pad
its blocks to the same sizes, though each plans only its own devices'
partitions and sees only their needs. So after planning a batch, each process
publishes its needs (a few integers) and takes the elementwise maximum of
everyone's: one small exchange per step through the key-value store of
``jax.distributed``'s coordination service. It runs on whatever host thread
stages the batch, never on the device streams, so it cannot be ordered
differently from the step's collectives in another process.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Agreement", "agreement"]

# Keys older than this many plans are deleted: processes never drift further
# apart than their look-ahead, since every step is a collective.
_KEEP = 64
_TIMEOUT_MS = 10 * 60 * 1000


class Agreement:
    """One process: its own needs are everyone's.

    Examples:
      >>> Agreement().max(0, np.array([3, 5])).tolist()
      [3, 5]
    """

    def max(self, index: int, needs: np.ndarray) -> np.ndarray:
        """The elementwise maximum of every process's ``needs`` for plan ``index``."""
        return needs


class _KeyValueAgreement(Agreement):
    """Several processes: needs meet in the coordination service's key-value store."""

    def __init__(self, client, prefix: str, process: int, processes: int) -> None:
        self._client = client
        self._prefix = prefix
        self._process = process
        self._processes = processes

    def _key(self, index: int, process: int) -> str:
        return f"{self._prefix}/{index}/{process}"

    def max(self, index: int, needs: np.ndarray) -> np.ndarray:
        needs = np.ascontiguousarray(needs, np.int64)
        self._client.key_value_set_bytes(self._key(index, self._process), needs.tobytes())
        out = needs.copy()
        for process in range(self._processes):
            if process == self._process:
                continue
            try:
                raw = self._client.blocking_key_value_get_bytes(
                    self._key(index, process), _TIMEOUT_MS
                )
            except Exception as error:
                raise RuntimeError(
                    f"process {process} did not publish its sizes for batch {index} of "
                    f"{self._prefix!r} within {_TIMEOUT_MS // 1000} s; every process must "
                    "stage the same batches in the same order."
                ) from error
            np.maximum(out, np.frombuffer(raw, np.int64), out=out)
        if index >= _KEEP:
            try:
                self._client.key_value_delete(self._key(index - _KEEP, self._process))
            except Exception:  # already gone: nothing to free
                pass
        return out


def agreement(name: str, processes: int, process: int) -> Agreement:
    """The agreement of a cache whose devices span ``processes`` processes.

    Args:
      name: unique among the caches of the program, the same in every process.
      processes: processes of the mesh axis.
      process: this process's index among them.
    """
    if processes == 1:
        return Agreement()
    from jax._src import distributed  # the coordination service's client

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            f"the cache's devices span {processes} processes but jax.distributed is not "
            "initialized; call jax.distributed.initialize() first."
        )
    return _KeyValueAgreement(client, f"jaxcache/{name}", process, processes)
