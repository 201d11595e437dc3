"""Where ids live: their home device, and which process stores which host rows.

The cache's slots split into ``n`` blocks, one per device of the rows axis,
and each id may only use the slots of its home device (``Layout``). Under
``jax.distributed.initialize`` the devices of that axis belong to several
processes; each process owns a run of consecutive blocks, and stores the host
rows of the ids homed there: id ``i`` belongs to process ``i % count``.
Interleaving (rather than contiguous id ranges) spreads the hot ids of every
feature evenly over the devices and processes, since datasets number each
feature's values from its most frequent one.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import Mesh

from jaxcache._src.config import CacheConfig
from jaxcache._src.hashing import bucket_count

__all__ = ["Layout", "axis_processes", "homed_ids", "process_shard"]


def homed_ids(config: CacheConfig, blocks: int, residue: int) -> str:
    """Which of a user's ids block ``residue`` of ``blocks`` holds, in words
    (for error messages). Ids that are rows: by their value. Raw ids: by the
    rows they are given, which are their bucket's, so by the bucket when
    the buckets split evenly over the blocks.

    Examples:
      >>> import jaxcache
      >>> homed_ids(jaxcache.CacheConfig(1000, 4, 64), 8, 3)
      'ids i with i % 8 == 3'
      >>> raw = jaxcache.CacheConfig(1000, 4, 64, vocabulary=jaxcache.DynamicVocabulary())
      >>> homed_ids(raw, 8, 3)
      'raw ids whose bucket b (cache.vocabulary.bucket_of) has b % 8 == 3'
    """
    spec = config.vocabulary
    if spec is None:
        return f"ids i with i % {blocks} == {residue}"
    buckets = bucket_count(spec.id_rows(config.num_embeddings), int(spec.ways))
    if buckets % blocks == 0:
        return f"raw ids whose bucket b (cache.vocabulary.bucket_of) has b % {blocks} == {residue}"
    return f"raw ids given rows r with r % {blocks} == {residue}"


def process_shard(mesh: Mesh, axis: str = "rows") -> tuple[int, int]:
    """This process's share of a table sharded over ``mesh``: ``(index, count)``.

    ``count`` processes own the devices of ``axis`` (in consecutive runs of
    equal length); this one is the ``index``-th of them in mesh order and
    stores the host rows of ids ``i`` with ``i % count == index``. Pass the
    result as ``HostTable(..., shard=...)``. One process: ``(0, 1)``.

    Args:
      mesh: the device mesh of the cache.
      axis: the mesh axis its rows are split over.

    Raises:
      ValueError: a device block spans processes, the processes' devices
        are not consecutive runs of equal length along ``axis``, or this
        process owns none of them.

    Examples:
      >>> import jax, numpy as np, jaxcache
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("rows",))
      >>> jaxcache.host.process_shard(mesh)
      (0, 1)
    """
    order = axis_processes(mesh, axis)
    me = jax.process_index()
    if me not in order:
        raise ValueError(
            f"process {me} owns none of the devices of axis {axis!r} (owners {order}); "
            "build the cache on a mesh that includes this process's devices."
        )
    return order.index(me), len(order)


def axis_processes(mesh: Mesh, axis: str = "rows") -> list[int]:
    """The processes (``jax.process_index``) owning the devices of ``axis``,
    in mesh order, each once (see ``process_shard``).

    Examples:
      >>> import jax, numpy as np
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("rows",))
      >>> axis_processes(mesh)
      [0]
    """
    if axis not in mesh.shape:
        raise ValueError(f"axis={axis!r} is not an axis of the mesh {dict(mesh.shape)}.")
    n = mesh.shape[axis]
    blocks = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), 0).reshape(n, -1)
    owners = []
    for position, block in enumerate(blocks):
        processes = sorted({device.process_index for device in block})
        if len(processes) > 1:
            raise ValueError(
                f"the devices of block {position} of axis {axis!r} belong to processes "
                f"{processes}; each block of rows must live in one process: lay the other "
                "mesh axes out within a process."
            )
        owners.append(processes[0])
    order = list(dict.fromkeys(owners))
    if n % len(order) or owners != [p for p in order for _ in range(n // len(order))]:
        raise ValueError(
            f"the devices of axis {axis!r} belong to processes {owners}; each process must "
            "own one run of consecutive devices, all runs of equal length (build the mesh "
            "from jax.devices(), which lists them by process)."
        )
    return order


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each id lives: its home device, its local id there, the owner process.

    The cache's slots are split over the ``n`` devices of the rows axis, and
    every id has one home device whose slots alone may hold its row. Homes
    interleave: id ``i`` has residue ``r = i % n`` and local id ``i // n``,
    so each feature's hot rows (datasets number a feature's values from the
    most frequent one) spread evenly over the devices. With ``P`` processes
    owning ``L = n / P`` consecutive devices each, residue ``r`` lives on
    device ``(r % P) L + r // P``: process ``p`` then owns exactly the ids
    ``i % P == p``, the host rows it stores (``process_shard``), and the
    homes depend on ``n`` alone, so one process and several plan the same
    slots.

    Each device's share splits into ``q`` partitions (``split``), each a
    planner of its own over ``C_l / q`` consecutive slots of the device, so
    that one device's batch is planned on ``q`` host threads. Partition
    ``t`` (of ``n q``, a device's ``q`` one after another) is partition
    ``j = t % q`` of device ``t // q`` and holds the ids ``i % (n q) == r +
    n j`` of the device's residue ``r``: its *residue* ``r + n j``, and
    its local ids ``i // (n q)``, ``0 .. N_t - 1``. With ``q = 1`` a
    partition is a device.

    Args:
      devices: ``n``, devices of the rows axis.
      processes: ``P``, processes owning them (``n % P == 0``).
      process: this process's index ``p`` among them.
      split: ``q``, partitions per device.

    Examples:
      >>> import numpy as np
      >>> layout = Layout(devices=4, processes=2, process=1)
      >>> layout.device_of(np.arange(8)).tolist()  # ids 1, 3, 5, 7 live on process 1
      [0, 2, 1, 3, 0, 2, 1, 3]
      >>> list(layout.own), layout.residue(3), layout.part_local_ids(np.array([7])).tolist()
      ([2, 3], 3, [1])
      >>> halves = Layout(devices=2, split=2)  # ids 0 and 4 in partition 0 of device 0
      >>> halves.part_of(np.arange(8)).tolist(), halves.part_residue(1)
      ([0, 2, 1, 3, 0, 2, 1, 3], 2)
    """

    devices: int = 1
    processes: int = 1
    process: int = 0
    split: int = 1

    def __post_init__(self) -> None:
        if self.devices < 1 or self.processes < 1 or self.devices % self.processes:
            raise ValueError(
                f"{self.devices} devices do not split over {self.processes} processes; every "
                "process must own the same number of devices of the rows axis."
            )
        if not 0 <= self.process < self.processes:
            raise ValueError(f"process={self.process} is not in [0, {self.processes}).")
        if isinstance(self.split, bool) or not isinstance(self.split, int) or self.split < 1:
            raise ValueError(
                f"partitions_per_device={self.split!r} must be a positive integer (1: one "
                "planner per device)."
            )

    @property
    def per_process(self) -> int:
        """``L``, devices each process owns."""
        return self.devices // self.processes

    @property
    def own(self) -> range:
        """The devices (partitions) of this process, in mesh order."""
        return range(self.process * self.per_process, (self.process + 1) * self.per_process)

    def residue(self, device: int) -> int:
        """The residue ``i % n`` of the ids homed on ``device``."""
        return (device % self.per_process) * self.processes + device // self.per_process

    def device_of(self, ids: np.ndarray) -> np.ndarray:
        """The home device of each id."""
        residue = np.asarray(ids) % self.devices
        return (residue % self.processes) * self.per_process + residue // self.processes

    # ------------------------------------------------------------ partitions
    @property
    def parts(self) -> int:
        """``n q``, partitions of all devices."""
        return self.devices * self.split

    @property
    def own_parts(self) -> range:
        """The partitions of this process's devices, in mesh order."""
        per = self.per_process * self.split
        return range(self.process * per, (self.process + 1) * per)

    def part_residue(self, part: int) -> int:
        """The residue ``i % (n q)`` of the ids of partition ``part``."""
        return self.residue(part // self.split) + self.devices * (part % self.split)

    @functools.cached_property
    def part_homes(self) -> np.ndarray:
        """``int64 [n q]``: the partition of each residue ``i % (n q)`` (read-only)."""
        homes = self.part_of(np.arange(self.parts))
        homes.flags.writeable = False
        return homes

    def per_device(self, values: np.ndarray | list[int]) -> np.ndarray:
        """Per-partition values ``[L q, ...]`` (a device's ``q`` one after
        another) summed over each device's partitions: ``[L, ...]``."""
        values = np.asarray(values)
        if self.split == 1:
            return values
        return values.reshape(-1, self.split, *values.shape[1:]).sum(1)

    def part_of(self, ids: np.ndarray) -> np.ndarray:
        """The partition of each id."""
        ids = np.asarray(ids)
        return self.device_of(ids) * self.split + (ids // self.devices) % self.split

    def part_local_ids(self, ids: np.ndarray) -> np.ndarray:
        """Each id's local id in its partition."""
        return np.asarray(ids) // self.parts

    def part_global_ids(self, part: int, local: np.ndarray) -> np.ndarray:
        """The ids of partition ``part``'s local ids ``local``."""
        return np.asarray(local, np.int64) * self.parts + self.part_residue(part)

    def part_rows(self, num_embeddings: int, part: int) -> int:
        """``N_t``: ids of partition ``part`` in a table of ``num_embeddings`` rows."""
        return len(range(self.part_residue(part), num_embeddings, self.parts))

    def part_values(self, values: np.ndarray, part: int) -> np.ndarray:
        """The entries of a per-id array ``[N, ...]`` of partition ``part``, in local order."""
        return values[self.part_residue(part) :: self.parts]

    def share_start(self, part: int) -> int:
        """Where partition ``part``'s ids begin in its process's share of the
        ids (``i % P == p``, in id order), which holds them every
        ``L q``-th entry on."""
        return part // self.split % self.per_process + self.per_process * (part % self.split)
