"""The block layout of a cache's device arrays over devices and processes.

Every device array of a cache is split row-wise over the rows axis of the
mesh: device ``d`` holds block ``d``. A process holds, and builds on the
host, only the blocks of its own devices (``[L X, ...]`` for a row-split
``[n X, ...]``), which ``put`` assembles into the global array; ``local``
takes them back out. On one CPU device the host arrays are already where the
device reads them and are handed over as they are.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxcache._src import npy_files
from jaxcache._src.host_table import HostTable, pad_rows

__all__ = ["Blocks", "local_data"]


class Blocks:
    """How one cache's arrays map to the devices of its mesh and processes.

    Args:
      mesh: the device mesh.
      axis: the mesh axis of the rows.
      processes: processes owning the devices of ``axis``.

    Attributes:
      row_sharding: split row-wise over ``axis``.
      replicated: the same on every device.
    """

    def __init__(self, mesh: Mesh, axis: str, processes: int) -> None:
        self.row_sharding = NamedSharding(mesh, PartitionSpec(axis))
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.processes = processes
        # On one CPU device a batch's host arrays are already where the device
        # reads them: the jitted programs take them as they are (JAX's C++
        # dispatch), where jax.device_put would spend Python time on each
        # array, on the thread the training loop needs.
        self.host_is_device = mesh.size == 1 and mesh.devices.flat[0].platform == "cpu"

    def put(self, tree: Any, sharding: NamedSharding) -> Any:
        """Device arrays of ``sharding`` from this process's part of each
        (its blocks of a row-split array; all of a replicated one)."""
        if self.processes == 1:  # every block is here: one batched transfer
            return jax.device_put(tree, sharding)
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), tree)

    def transfer(self, tree: Any, sharding: NamedSharding) -> Any:
        """A staged batch's fresh host arrays for the device: ``put``, or on
        one CPU device the arrays themselves."""
        return tree if self.host_is_device else self.put(tree, sharding)


def local_data(array: Any) -> np.ndarray:
    """This process's blocks of a row-split array, in block order, as NumPy.

    Safe on any thread: a JAX array lists its per-device buffers on first
    use, and in jax 0.10 two threads doing that at once can each see part of
    the list, which the array then keeps as its shards for good (two threads
    asking a fresh 4-device array for its shards, with the lowered switch
    interval a pipeline sets, got a short list in about one trial of eleven;
    a pipelined run read half of a swap's read-out, and rows past the half
    ran out of range). Here the first listing takes a lock, so the threads
    that land write-backs and the training loop, which read the same
    read-outs, list them one at a time; the listing stays off the training
    loop's path unless it reads the array itself.

    Raises:
      RuntimeError: the array lists fewer buffers than its sharding has
        devices here (listed on two threads at once elsewhere): nothing is
        read from it.
    """
    if isinstance(array, np.ndarray):
        return array
    with _LISTING:
        listed = array.addressable_shards
    if len(listed) != len(array.sharding.addressable_devices):
        raise RuntimeError(
            f"a device array of shape {array.shape} lists {len(listed)} of its "
            f"{len(array.sharding.addressable_devices)} buffers on this process: it was first "
            "read on two threads at once, and reading it would misplace rows; nothing was read."
        )
    shards = {s.index[0].start or 0: s.data for s in listed}
    if len(shards) == 1:
        return np.asarray(next(iter(shards.values())))
    return np.concatenate([np.asarray(shards[start]) for start in sorted(shards)])


# Held while an array lists its device buffers (``local_data``).
_LISTING = threading.Lock()


def gather_shards(
    table: HostTable, shard: tuple[int, int]
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Every process's rows of a split host table, in id order (a collective)."""
    from jax.experimental import multihost_utils

    index, count = shard
    rows, state = table.rows, table.state
    if not isinstance(rows, np.ndarray):  # a TieredTable's records, read once
        rows, state = npy_files.read_whole(table)
    arrays = {"rows": rows, **{f"state.{k}": v for k, v in state.items()}}
    longest = len(range(0, table.num_embeddings, count))
    padded = {k: pad_rows(np.asarray(v), longest, 0) for k, v in arrays.items()}
    gathered = multihost_utils.process_allgather({"index": np.int32(index), **padded})
    out = {}
    for key, array in arrays.items():
        whole = np.empty((table.num_embeddings, *array.shape[1:]), array.dtype)
        for process, part in zip(gathered["index"], gathered[key], strict=True):
            whole[int(process) :: count] = part[: len(range(int(process), len(whole), count))]
        out[key] = whole
    rows = out.pop("rows")
    return rows, {k.removeprefix("state."): v for k, v in out.items()}


def gather_entries(
    ids: np.ndarray, rows: np.ndarray, shard: tuple[int, int], num_rows: int
) -> tuple[np.ndarray, np.ndarray]:
    """Every process's ``(ids, rows)`` of a split vocabulary (each process
    holds the entries of the rows it stores, ``row % count == index``),
    joined in row order (a collective)."""
    from jax.experimental import multihost_utils

    index, count = shard
    longest = len(range(0, num_rows, count))
    local = np.asarray(rows, np.int64) // count
    share_ids = np.zeros(longest, np.int64)
    share_live = np.zeros(longest, bool)
    share_ids[local], share_live[local] = ids, True
    gathered = multihost_utils.process_allgather(
        {"index": np.int32(index), "ids": share_ids, "live": share_live}
    )
    whole_ids = np.zeros(num_rows, np.int64)
    whole_live = np.zeros(num_rows, bool)
    for process, part_ids, part_live in zip(
        gathered["index"], gathered["ids"], gathered["live"], strict=True
    ):
        size = len(range(int(process), num_rows, count))
        whole_ids[int(process) :: count] = part_ids[:size]
        whole_live[int(process) :: count] = part_live[:size]
    joined = np.flatnonzero(whole_live)
    return whole_ids[joined], joined
