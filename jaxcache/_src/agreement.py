"""Padded sizes every process agrees on, when a cache spans several processes.

The arrays of a step are global arrays of the mesh: every process must pad
its blocks to the same sizes, though each plans only its own devices'
partitions and sees only their needs. So after planning a batch, each process
publishes its needs (a few integers) and takes the elementwise maximum of
everyone's, through the key-value store of ``jax.distributed``'s coordination
service. Each process writes its needs under the batch's directory; with a
few processes it then reads each other's key (a blocking read each), with
more it waits at a barrier of the cache's processes and reads the directory
back: three requests per process and step however many processes there are,
where a read per process grew with the job (``benchmarks/agreement.py``).
One process in turn deletes an old exchange's directory. It runs on whatever
host thread stages the batch, never on the device streams, so it cannot be
ordered differently from the step's collectives in another process.

Directories are numbered by exchange, not by plan: a restore plans an
index again (and a plan refused for room is planned again), and a key is
written once. Every process makes an agreement's exchanges in the same
order, and each entry names its plan, so one out of step is an error.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["Agreement", "agreement"]

# An exchange's directory is deleted this many exchanges later. Every process
# needs every other's entry to finish an exchange, so none is more than one
# behind another, and all have read the directory by then.
_KEEP = 4
# Up to this many processes a blocking read of each other's key costs no
# more requests than the barrier and the directory read.
_READ_EACH = 3
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

    def gather(self, index: int, values: np.ndarray) -> list[np.ndarray]:
        """Every process's ``values`` (``int64``; the same shape but for the
        last axis) for plan ``index``, in process order."""
        return [np.asarray(values, np.int64)]

    def sibling(self, name: str) -> Agreement:
        """An agreement of the same processes under keys of its own, for
        another exchange of each plan."""
        return self


class _KeyValueAgreement(Agreement):
    """Several processes: needs meet in the coordination service's key-value store.

    Args:
      client: the ``jax.distributed`` client (``key_value_set_bytes``,
        ``blocking_key_value_get_bytes``, ``wait_at_barrier``,
        ``key_value_dir_get_bytes``, ``key_value_delete``).
      prefix: the cache's keys and barrier, the same in every process.
      members: the processes (``jax.process_index``) of the cache's mesh axis.
      process: this process's index among ``members``.
    """

    def __init__(self, client, prefix: str, members: Sequence[int], process: int) -> None:
        self._client = client
        self._prefix = prefix
        self._members = [int(m) for m in members]
        self._process = process
        # One barrier, passed once per plan (the service counts its rounds).
        self._barrier = f"{prefix}/agreed"
        self._exchanges = 0  # made so far, the same count in every process

    def max(self, index: int, needs: np.ndarray) -> np.ndarray:
        needs = np.ascontiguousarray(needs, np.int64)
        out = needs.copy()
        for raw in self._exchange(index, needs.tobytes()):
            np.maximum(out, np.frombuffer(raw, np.int64), out=out)
        return out

    def gather(self, index: int, values: np.ndarray) -> list[np.ndarray]:
        values = np.ascontiguousarray(values, np.int64)
        # [process, rank, *shape, *values]
        head = np.array([self._process, values.ndim, *values.shape], np.int64)
        parts = {self._process: values}
        for raw in self._exchange(index, np.concatenate([head, values.reshape(-1)]).tobytes()):
            flat = np.frombuffer(raw, np.int64)
            rank = int(flat[1])
            parts[int(flat[0])] = flat[2 + rank :].reshape([int(x) for x in flat[2 : 2 + rank]])
        return [parts[p] for p in sorted(parts)]

    def sibling(self, name: str) -> Agreement:
        return _KeyValueAgreement(
            self._client, f"{self._prefix}-{name}", self._members, self._process
        )

    def _exchange(self, index: int, payload: bytes) -> list[bytes]:
        """Publishes ``payload`` for plan ``index`` and returns the other
        processes' (and with many processes this one's too)."""
        client, count = self._client, len(self._members)
        number = self._exchanges
        self._exchanges += 1
        directory = f"{self._prefix}/{number}"
        client.key_value_set_bytes(
            f"{directory}/{self._process}", np.int64(index).tobytes() + payload
        )
        try:
            if count <= _READ_EACH:
                others = [p for p in range(count) if p != self._process]
                entries = [
                    client.blocking_key_value_get_bytes(f"{directory}/{p}", _TIMEOUT_MS)
                    for p in others
                ]
            else:
                client.wait_at_barrier(self._barrier, _TIMEOUT_MS, process_ids=self._members)
                entries = [raw for _, raw in client.key_value_dir_get_bytes(f"{directory}/")]
        except Exception as error:
            raise RuntimeError(
                f"processes {self._members} did not all publish their sizes for batch "
                f"{index} of {self._prefix!r} within {_TIMEOUT_MS // 1000} s; every process "
                "must stage the same batches in the same order."
            ) from error
        if count > _READ_EACH and len(entries) != count:
            raise RuntimeError(
                f"batch {index} of {self._prefix!r} has sizes from {len(entries)} processes "
                f"past the barrier, not {count}: another program uses these keys."
            )
        if number >= _KEEP and number % count == self._process:
            try:
                client.key_value_delete(f"{self._prefix}/{number - _KEEP}")  # and its keys
            except Exception:  # already gone: nothing to free
                pass
        plans = [int(np.frombuffer(raw[:8], np.int64)[0]) for raw in entries]
        if any(plan != index for plan in plans):
            raise RuntimeError(
                f"processes {self._members} are out of step on {self._prefix!r}: this one "
                f"staged batch {index} where the others staged {sorted(set(plans))}; every "
                "process must stage the same batches in the same order."
            )
        return [raw[8:] for raw in entries]


def agreement(name: str, members: Sequence[int], process: int) -> Agreement:
    """The agreement of a cache whose devices span the processes ``members``.

    Args:
      name: unique among the caches of the program, the same in every process.
      members: the processes (``jax.process_index``) owning the devices of
        the cache's mesh axis (``placement.axis_processes``).
      process: this process's index among them.
    """
    if len(members) == 1:
        return Agreement()
    from jax._src import distributed  # the coordination service's client

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            f"the cache's devices span {len(members)} processes but jax.distributed is not "
            "initialized; call jax.distributed.initialize() first."
        )
    return _KeyValueAgreement(client, f"jaxcache/{name}", members, process)
