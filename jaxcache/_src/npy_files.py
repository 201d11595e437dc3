"""Streamed ``.npy`` files: a table's arrays written and read in chunks, never whole in memory.

A memory-mapped array is copied file to file inside the kernel
(``os.copy_file_range``); any other array is written from its own buffer a
chunk of rows at a time; a table that is not in memory (a ``TieredTable``)
is read through ``gather`` in one pass over its ids, every array of a chunk
at once. Reads go the other way: file to file into a memory map, or
straight into the target's buffer.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = [
    "CHUNK_BYTES",
    "id_chunks",
    "read_header",
    "read_into",
    "row_chunks",
    "write_array",
    "write_streamed",
]

# Bytes moved per write or read when a file is streamed through user space.
CHUNK_BYTES = 1 << 26


def _mapped_file(array: np.ndarray) -> tuple[str, int] | None:
    """``(path, offset)`` when ``array`` is a memory map of all the data of a file."""
    if not isinstance(array, np.memmap) or not array.filename or not array.flags.c_contiguous:
        return None
    try:
        size = os.path.getsize(array.filename)
    except OSError:
        return None
    # np.memmap maps from the offset to the end of the data: a C-contiguous
    # view this large can only start at the offset.
    if array.offset + array.nbytes != size:
        return None
    return array.filename, array.offset


def _copy_range(source: int, target: int, source_offset: int, target_offset: int, size: int):
    """Copies ``size`` bytes between files inside the kernel; ``False`` if unsupported."""
    done = 0
    try:
        while done < size:
            moved = os.copy_file_range(
                source, target, size - done, source_offset + done, target_offset + done
            )
            if moved == 0:
                raise OSError(errno.EIO, "the source file ended early")
            done += moved
    except (OSError, AttributeError) as error:
        unsupported = getattr(error, "errno", None) in (
            errno.EXDEV,
            errno.ENOSYS,
            errno.EOPNOTSUPP,
            errno.EINVAL,
            None,
        )
        if done == 0 and unsupported:
            return False
        raise
    return True


def row_chunks(array: np.ndarray) -> Iterable[slice]:
    """Slices of ``array``'s rows of about ``CHUNK_BYTES`` each."""
    step = max(1, CHUNK_BYTES // max(1, array[:1].nbytes))
    for start in range(0, array.shape[0], step):
        yield slice(start, start + step)


def write_array(path: str, array: np.ndarray, *, fsync: bool, dtype: Any = None) -> dict:
    """Writes ``array`` as ``.npy`` without a full copy in memory (``dtype``: convert)."""
    dtype = array.dtype if dtype is None else np.dtype(dtype)
    header = {
        "descr": np.lib.format.dtype_to_descr(dtype),
        "fortran_order": False,
        "shape": array.shape,
    }
    mapped = _mapped_file(array) if dtype == array.dtype else None
    size = array.size * dtype.itemsize
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        f.flush()
        offset = f.tell()
        copied = False
        if mapped is not None:
            with open(mapped[0], "rb") as source:
                copied = _copy_range(source.fileno(), f.fileno(), mapped[1], offset, size)
        if not copied:
            for rows in row_chunks(array):
                chunk = np.ascontiguousarray(array[rows], dtype=dtype)
                f.write(chunk.reshape(-1).view(np.uint8).data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return {"shape": list(array.shape), "dtype": dtype.name, "bytes": size}


def id_chunks(table: Any) -> Iterable[np.ndarray]:
    """The global ids a table stores, in order, about ``CHUNK_BYTES`` of rows at a time."""
    index, count = table.shard
    local = len(table.rows)
    row_bytes = table.rows[:1].nbytes + sum(v[:1].nbytes for v in table.state.values())
    step = max(1, CHUNK_BYTES // max(1, row_bytes))
    for start in range(0, local, step):
        yield index + count * np.arange(start, min(start + step, local), dtype=np.int64)


def read_whole(table: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """This process's rows of ``table`` and their state, as NumPy copies in
    local order. A table not in memory (``TableColumn`` views) is read in
    one pass, each chunk's records once for all arrays: reading the columns
    one by one read every record once per column."""
    if isinstance(table.rows, np.ndarray):
        return np.array(table.rows), {k: np.array(v) for k, v in table.state.items()}
    columns = {"rows": table.rows, **table.state}
    out = {k: np.empty((len(v), *v.shape[1:]), v.dtype) for k, v in columns.items()}
    start = 0
    for ids in id_chunks(table):
        rows, state = table.gather(ids)
        for key, part in {"rows": rows, **state}.items():
            out[key][start : start + ids.size] = part
        start += ids.size
    rows = out.pop("rows")
    return rows, out


def write_streamed(directory: str, table: Any, keys: list[str], *, fsync: bool) -> dict:
    """Writes a table that is not in memory (``TableColumn`` views) as ``.npy``
    files, one pass over its rows: each chunk read once, all arrays at once."""
    columns = [table.rows, *table.state.values()]
    files, meta = [], {}
    try:
        for key, column in zip(keys, columns, strict=True):
            f = open(os.path.join(directory, f"{key}.npy"), "wb")
            files.append(f)
            header = {
                "descr": np.lib.format.dtype_to_descr(column.dtype),
                "fortran_order": False,
                "shape": column.shape,
            }
            np.lib.format.write_array_header_1_0(f, header)
            meta[key] = {
                "shape": list(column.shape),
                "dtype": column.dtype.name,
                "bytes": column.nbytes,
            }
        for ids in id_chunks(table):
            rows, state = table.gather(ids)
            for f, values in zip(files, [rows, *state.values()], strict=True):
                f.write(np.ascontiguousarray(values).reshape(-1).view(np.uint8).data)
        for f in files:
            f.flush()
            if fsync:
                os.fsync(f.fileno())
    finally:
        for f in files:
            f.close()
    return meta


def read_header(f: Any) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """``(shape, fortran_order, dtype, data offset)`` of the open ``.npy`` file ``f``,
    read from its start (``ValueError`` when it has no ``.npy`` header)."""
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    return tuple(shape), bool(fortran), dtype, f.tell()


def read_into(path: str, out: np.ndarray) -> None:
    """Reads the ``.npy`` file at ``path`` into ``out`` (same shape and item size)."""
    with open(path, "rb") as f:
        shape, fortran, dtype, offset = read_header(f)
        if tuple(shape) != out.shape or fortran or dtype.itemsize != out.dtype.itemsize:
            raise ValueError(
                f"{path} holds {dtype} {tuple(shape)}, expected {out.dtype} {out.shape}."
            )
        if os.fstat(f.fileno()).st_size != offset + out.nbytes:
            raise ValueError(f"{path} is truncated or corrupt (size does not match its header).")
        mapped = _mapped_file(out)
        if mapped is not None:
            with open(mapped[0], "r+b") as target:
                if _copy_range(f.fileno(), target.fileno(), offset, mapped[1], out.nbytes):
                    return
        if out.flags.c_contiguous:
            flat = out.reshape(-1).view(np.uint8)
            done = 0
            while done < flat.size:
                read = f.readinto(flat[done : done + CHUNK_BYTES].data)
                if not read:
                    raise ValueError(f"{path} ended early.")
                done += read
            return
    source = np.load(path, mmap_mode="r")
    for rows in row_chunks(out):
        out[rows] = source[rows].view(out.dtype)
