"""Row stores on disk for the tier below DRAM: a log of our own against the alternatives.

The traffic of a DRAM tier's misses: every step writes ``--moved`` rows at
random ids (dirty rows evicted from DRAM) and reads ``--moved`` others (rows
fetched from the disk), ``--record`` bytes each, in a table of ``--rows``
rows. Each store starts from the whole table written once (not timed), then
runs ``--steps`` steps. Per store: milliseconds per step for the writes and
for the reads, and the bytes the process sent to the disk per byte of row
written, read from the block device's own counter (``/sys/dev/block/.../stat``:
every process's writes to that device, so run it on a quiet machine), with an
``fsync`` (or the store's own flush) after every step, untimed, as a long
run's periodic write-back would do: a page dirtied again after it was
written is written again. (``write_bytes`` of ``/proc/self/io`` counts a
whole large folio of the page cache when a row of it is dirtied, up to
hundreds of KiB, far more than the disk is sent.)

- ``memmap``: the rows in id order in a memory-mapped file (``HostTable(directory=)``):
  ``rows[ids] = values``, ``np.take``;
- ``pwrite in place``: the same file, rows sorted by id and written with one
  ``pwrite`` each (``os.pwrite``), read with ``pread``;
- ``RowLog``: jaxcache's append log (``TieredTable``'s disk tier), with its
  garbage collection;
- ``lmdb`` (the ``lmdb`` package) and ``rocksdb`` (``rocksdict``, RocksDB with
  its write-ahead log off), keyed by the id, when they are installed
  (``pip install lmdb rocksdict``; jaxcache does not depend on them).

    python benchmarks/row_stores.py                        # 2M rows of 260 bytes
    python benchmarks/row_stores.py --rows 8000000 --steps 20

The files go to ``--dir`` (default: a temporary directory) and are removed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable

import numpy as np

from jaxcache._src.row_log import RowLog


def written_bytes(path: str) -> int:
    """Bytes written to the block device holding ``path`` so far (all processes)."""
    device = os.stat(path).st_dev
    with open(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}/stat") as f:
        return int(f.read().split()[6]) * 512


class Store:
    """``write(ids, values)``, ``read(ids) -> values``, ``sync()``, ``close()``."""

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass


class Mapped(Store):
    def __init__(self, path: str, initial: np.ndarray) -> None:
        path = os.path.join(path, "rows.npy")
        self.rows = np.lib.format.open_memmap(path, "w+", initial.dtype, initial.shape)
        self.rows[:] = initial

    def write(self, ids, values):
        self.rows[ids] = values

    def read(self, ids):
        return np.take(self.rows, ids, axis=0)

    def sync(self):
        self.rows.flush()


class InPlace(Store):
    def __init__(self, path: str, initial: np.ndarray) -> None:
        self.fd = os.open(os.path.join(path, "rows.bin"), os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        os.pwrite(self.fd, initial.tobytes(), 0)
        self.size = initial.shape[1]

    def write(self, ids, values):
        order = np.argsort(ids)
        for i, row in zip(ids[order].tolist(), values[order], strict=True):
            os.pwrite(self.fd, row, i * self.size)

    def read(self, ids):
        out = np.empty((ids.size, self.size), np.uint8)
        for j, i in enumerate(ids.tolist()):
            os.preadv(self.fd, [out[j]], i * self.size)
        return out

    def sync(self):
        os.fsync(self.fd)

    def close(self):
        os.close(self.fd)


class Log(Store):
    def __init__(self, path: str, initial: np.ndarray) -> None:
        self.log = RowLog(os.path.join(path, "rows.log"), len(initial), initial.shape[1])
        ids = np.arange(len(initial))
        self.log.write(self.log.reserve(ids, initial, initial=True))
        self.size = initial.shape[1]

    def write(self, ids, values):
        self.log.write(self.log.reserve(ids, np.ascontiguousarray(values)))
        self.log.collect()

    def read(self, ids):
        out = np.empty((ids.size, self.size), np.uint8)
        self.log.read(ids, out)
        return out

    def sync(self):
        os.fsync(self.log._fd)
        os.fsync(self.log._owners_fd)

    def close(self):
        self.log.close()


class Lmdb(Store):
    def __init__(self, path: str, initial: np.ndarray) -> None:
        import lmdb

        self.env = lmdb.open(
            path,
            map_size=4 * initial.nbytes + (1 << 30),
            sync=False,
            writemap=False,
            readahead=False,
        )
        self.size = initial.shape[1]
        with self.env.begin(write=True) as txn:
            txn.cursor().putmulti(
                (int(i).to_bytes(8, "big"), row.tobytes()) for i, row in enumerate(initial)
            )

    def write(self, ids, values):
        with self.env.begin(write=True) as txn:
            txn.cursor().putmulti(
                (int(i).to_bytes(8, "big"), row.tobytes())
                for i, row in zip(ids.tolist(), values, strict=True)
            )

    def read(self, ids):
        with self.env.begin() as txn:
            found = txn.cursor().getmulti(int(i).to_bytes(8, "big") for i in ids.tolist())
        return np.frombuffer(b"".join(v for _, v in found), np.uint8).reshape(-1, self.size)

    def sync(self):
        self.env.sync(True)

    def close(self):
        self.env.close()


class Rocks(Store):
    def __init__(self, path: str, initial: np.ndarray) -> None:
        from rocksdict import Options, Rdict, WriteBatch, WriteOptions

        self.WriteBatch = WriteBatch
        self.db = Rdict(path, Options(raw_mode=True))
        self.options = WriteOptions()
        self.options.disable_wal = True
        self.size = initial.shape[1]
        for lo in range(0, len(initial), 1 << 16):
            self.write(
                np.arange(lo, min(lo + (1 << 16), len(initial))), initial[lo : lo + (1 << 16)]
            )

    def write(self, ids, values):
        batch = self.WriteBatch(raw_mode=True)
        for i, row in zip(ids.tolist(), values, strict=True):
            batch.put(int(i).to_bytes(8, "big"), row.tobytes())
        self.db.write(batch, self.options)

    def read(self, ids):
        found = self.db[[int(i).to_bytes(8, "big") for i in ids.tolist()]]
        return np.frombuffer(b"".join(found), np.uint8).reshape(-1, self.size)

    def sync(self):
        self.db.flush()

    def close(self):
        self.db.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--record", type=int, default=260, help="bytes per row")
    parser.add_argument("--moved", type=int, default=30_000, help="rows written and read a step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dir", help="where the files go (default: a temporary directory)")
    parser.add_argument("--only", help="run only this store (e.g. RowLog)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    initial = rng.integers(0, 256, size=(args.rows, args.record), dtype=np.uint8)
    truth = initial.copy()
    steps = [
        (rng.choice(args.rows, args.moved, replace=False), rng.choice(args.rows, args.moved))
        for _ in range(args.steps)
    ]
    values = [rng.integers(0, 256, (args.moved, args.record), dtype=np.uint8) for _ in steps]
    for (written, _), rows in zip(steps, values, strict=True):
        truth[written] = rows
    stores: dict[str, Callable[[str, np.ndarray], Store]] = {
        "memmap": Mapped,
        "pwrite in place": InPlace,
        "RowLog": Log,
    }
    for name, cls, module in (("lmdb", Lmdb, "lmdb"), ("rocksdb", Rocks, "rocksdict")):
        try:
            __import__(module)
            stores[name] = cls
        except ImportError:
            print(f"({name}: {module} is not installed; left out)")
    if args.only:
        stores = {args.only: stores[args.only]}
    print(
        f"{args.rows:,} rows of {args.record} bytes ({args.rows * args.record / 2**30:.2f} GiB); "
        f"{args.steps} steps, each writing {args.moved:,} random rows and reading {args.moved:,}"
    )
    print(f"{'store':<18}{'write ms/step':>14}{'read ms/step':>14}{'disk bytes/row byte':>21}")
    scratch = tempfile.mkdtemp(prefix="jaxcache-row-stores-", dir=args.dir)
    try:
        for name, cls in stores.items():
            place = os.path.join(scratch, name.replace(" ", "-"))
            os.makedirs(place)
            store = cls(place, initial)
            store.sync()
            before = written_bytes(place)
            write_s = read_s = 0.0
            for (written, read), rows in zip(steps, values, strict=True):
                start = time.perf_counter()
                store.write(written, rows)
                middle = time.perf_counter()
                got = store.read(read)
                write_s += middle - start
                read_s += time.perf_counter() - middle
                store.sync()  # what a long run's periodic write-back does, not timed
            amplification = (written_bytes(place) - before) / (
                args.steps * args.moved * args.record
            )
            check = rng.choice(args.rows, 1000, replace=False)
            assert np.array_equal(store.read(check), truth[check]), name
            del got
            store.close()
            shutil.rmtree(place, ignore_errors=True)
            print(
                f"{name:<18}{1e3 * write_s / args.steps:>14.1f}{1e3 * read_s / args.steps:>14.1f}"
                f"{amplification:>21.2f}"
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
