"""Which process stores which host rows when a mesh spans several processes.

The cache's slots split into ``n`` blocks, one per device of the rows axis.
Under ``jax.distributed.initialize`` the devices of that axis belong to
several processes; each process owns a run of consecutive blocks, and stores
the host rows of the ids homed there: id ``i`` belongs to process group
``i % count``. Interleaving (rather than contiguous id ranges) spreads the
hot ids of every feature evenly over the processes, since datasets number
each feature's values from its most frequent one.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

__all__ = ["process_shard"]


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
      >>> jaxcache.process_shard(mesh)
      (0, 1)
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
    count = len(order)
    if n % count or owners != [p for p in order for _ in range(n // count)]:
        raise ValueError(
            f"the devices of axis {axis!r} belong to processes {owners}; each process must "
            "own one run of consecutive devices, all runs of equal length (build the mesh "
            "from jax.devices(), which lists them by process)."
        )
    me = jax.process_index()
    if me not in order:
        raise ValueError(
            f"process {me} owns none of the devices of axis {axis!r} (owners {order}); "
            "build the cache on a mesh that includes this process's devices."
        )
    return order.index(me), count
