"""The record of one saved table: what its directory holds, and writing, checking and reading it.

A table's directory holds:

* its rows and their per-row optimizer state in id order, as plain ``.npy``
  files (``rows.npy``, ``state.<name>.npy``), streamed (``npy_files``);
* the cache's state arrays (``EmbeddingCache.state_arrays``: the planners'
  directory and the policies' arrays, ``planner.*.npy``, ``policy.*.npy``);
* ``table.json``: the record's format, the table's configuration (its sparse
  optimizer by registered name and hyperparameters, the shapes of its row
  state), the device count, the number of process shares and the files
  written, then the cache's JSON state (``EmbeddingCache.state_meta``: the
  plan index, the policy's name, the padded sizes and the statistics).

When the host rows are split over processes, each process writes its own
rows and state arrays (``rows.shard-<i>-of-<p>.npy``, ...) and the first
process ``table.json``. A table restores into any capacity, policy, device
and process count: the rows each process stores are read from whatever
shares they were saved in.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxcache._src import npy_files, optimizers
from jaxcache._src.config import CacheConfig, DynamicVocabulary
from jaxcache._src.engine import EmbeddingCache

__all__ = [
    "FORMAT",
    "SavedTable",
    "check_restorable",
    "check_saveable",
    "config_from_json",
    "read_tables",
    "restore_table",
    "save_table",
    "shard_key",
]

#: The version of the record; a table saved in another is refused.
FORMAT = 1
# Entries of table.json that describe the record; the others are the cache's state.
_RECORD_KEYS = ("format", "config", "devices", "shards", "arrays")


def read_tables(directory: str) -> dict[str, SavedTable]:
    """The tables saved under ``directory`` (one subdirectory each), by name."""
    tables = {}
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.is_dir():
            path = os.path.join(entry.path, "table.json")
            try:
                with open(path) as f:
                    meta = json.load(f)
            except (OSError, ValueError) as error:
                raise ValueError(
                    f"table {entry.name!r}: {path} cannot be read ({error}); the checkpoint is "
                    "damaged: restore an earlier step (Checkpointer.steps())."
                ) from None
            missing = [key for key in _RECORD_KEYS if not isinstance(meta, dict) or key not in meta]
            if missing:
                raise ValueError(
                    f"table {entry.name!r}: {path} lacks {missing}; the checkpoint is damaged: "
                    "restore an earlier step (Checkpointer.steps())."
                )
            tables[entry.name] = SavedTable(entry.path, meta)
    return tables


@dataclasses.dataclass(frozen=True)
class SavedTable:
    """One table of a checkpoint on disk: its directory and ``table.json``.

    Attributes:
      directory: the table's directory.
      meta: its ``table.json``.
    """

    directory: str
    meta: dict[str, Any]

    @property
    def shards(self) -> int:
        """Processes whose host rows were saved (one file each), 1 for a whole table."""
        return int(self.meta.get("shards", 1))

    def path(self, key: str) -> str:
        return os.path.join(self.directory, f"{key}.npy")

    def state_parts(self) -> list[dict[str, np.ndarray]]:
        """The cache's state arrays (``EmbeddingCache.state_arrays``) of each
        process that saved them, in process order, as memory maps: every
        saved array but the rows and their optimizer state."""
        saved = {key.split(".shard-")[0] for key in self.meta["arrays"]}
        keys = sorted(key for key in saved if key != "rows" and not key.startswith("state."))
        return [
            {key: self.array(shard_key(key, shard, self.shards)) for key in keys}
            for shard in range(self.shards)
        ]

    def state_meta(self) -> dict[str, Any]:
        """The cache's JSON state (``EmbeddingCache.state_meta``): every entry
        of ``table.json`` that does not describe the record itself."""
        return {k: v for k, v in self.meta.items() if k not in _RECORD_KEYS}

    def check_files(self, name: str) -> None:
        """Raises ``ValueError`` unless every file of the table is there, whole:
        its ``.npy`` header names the shape and dtype ``table.json`` recorded,
        and its size is the header's plus those bytes. A restore reads the
        files only after this check, so a damaged one changes nothing."""
        keys = {"rows", *(f"state.{k}" for k in self.meta["config"]["row_state"])}
        keys.update(key.split(".shard-")[0] for key in self.meta["arrays"])
        for key in sorted(keys):
            for shard in range(self.shards):
                path = self.path(shard_key(key, shard, self.shards))
                if not os.path.exists(path):
                    raise ValueError(
                        f"table {name!r}: {path} is missing; the checkpoint is incomplete."
                    )
                _check_npy(name, path, self.meta["arrays"].get(shard_key(key, shard, self.shards)))

    def copy_rows(
        self, key: str, out: np.ndarray, shard: tuple[int, int], stored: Any = None
    ) -> None:
        """Reads array ``key`` (``rows`` or ``state.<name>``) into ``out``, the
        ``shard=(index, count)`` of a host table, whatever split it was saved with.

        ``stored``: the saved values' dtype when it differs from ``out``'s
        (bfloat16 rows, kept as raw bytes, exported widened to float32)."""
        index, count = shard
        if self.shards == 1 and count == 1:
            npy_files.read_into(self.path(key), out)
            return
        for saved in range(self.shards):
            source = self.array(shard_key(key, saved, self.shards))
            # Row r of this file is id saved + r * shards; keep the ids of `shard`.
            for rows in npy_files.row_chunks(source):
                ids = saved + self.shards * np.arange(rows.start, min(rows.stop, len(source)))
                keep = ids % count == index
                if keep.any():
                    out[ids[keep] // count] = source[rows][keep].view(
                        out.dtype if stored is None else stored
                    )

    def take(self, key: str, ids: np.ndarray, dtype: Any) -> np.ndarray:
        """The saved values of global ``ids`` in array ``key``, as ``dtype``
        (the table's), whatever split they were saved with."""
        if self.shards == 1:
            return np.asarray(self.array(key)[ids]).view(dtype)
        out = None
        for saved in range(self.shards):
            mine = ids % self.shards == saved
            if mine.any():
                part = self.array(shard_key(key, saved, self.shards))[ids[mine] // self.shards]
                if out is None:
                    out = np.empty((ids.size, *part.shape[1:]), part.dtype)
                out[mine] = part
        assert out is not None, "take() is called with at least one id"
        return out.view(dtype)

    def export_rows(self, path: str) -> None:
        """Writes the rows in id order as a plain float32 ``.npy`` at ``path``:
        copied file to file when they are float32 and in one file; bfloat16
        rows are widened (exactly); rows split over processes interleaved."""
        dtype = jnp.dtype(self.meta["config"]["dtype"])
        if self.shards == 1:
            rows = self.array("rows")
            if dtype == np.float32:
                npy_files.write_array(path, rows, fsync=False)
            else:
                npy_files.write_array(path, rows.view(dtype), fsync=False, dtype=np.float32)
            return
        config = self.meta["config"]
        shape = (config["num_embeddings"], config["features"])
        out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=shape)
        self.copy_rows("rows", out, (0, 1), stored=dtype)
        out.flush()
        del out

    def array(self, key: str) -> np.ndarray:
        """A read-only memory map of array ``key`` (stored dtype; bfloat16 as raw bytes)."""
        return np.load(self.path(key), mmap_mode="r")


def _check_npy(
    name: str, path: str, recorded: dict[str, Any] | None, by: str = "the checkpoint recorded"
) -> None:
    """Raises ``ValueError`` naming table ``name`` unless the ``.npy`` file at
    ``path`` is whole and holds what ``recorded`` says (``_npy_fault``)."""
    fault = _npy_fault(path, recorded, by)
    if fault:
        raise ValueError(
            f"table {name!r}: {path} {fault}; the checkpoint is damaged: restore an earlier "
            "step (Checkpointer.steps())."
        )


def _npy_fault(path: str, recorded: dict[str, Any] | None, by: str) -> str | None:
    """What is wrong with the ``.npy`` file at ``path`` given the shape,
    dtype and bytes ``recorded`` of it (``write_array``'s record in
    ``table.json``, or what the table holds, as ``by`` says), or ``None``."""
    try:
        with open(path, "rb") as f:
            shape, fortran, dtype, offset = npy_files.read_header(f)
            size = os.fstat(f.fileno()).st_size
    except (OSError, ValueError, SyntaxError) as error:
        return f"has no readable .npy header ({error})"
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if recorded is not None and (
        list(shape) != list(recorded["shape"])
        or fortran
        or nbytes != recorded.get("bytes", nbytes)
        or not _same_dtype(dtype, recorded.get("dtype"))
    ):
        return (
            f"holds {dtype} {tuple(shape)}, but {by} {recorded['dtype']} {tuple(recorded['shape'])}"
        )
    if size != offset + nbytes:
        return f"has {size:,} bytes, but its header needs {offset + nbytes:,} (truncated)"
    return None


def _same_dtype(header: np.dtype, recorded: Any) -> bool:
    """Whether a ``.npy`` header's dtype is the one ``table.json`` recorded by
    name (``bfloat16`` rows are written as raw two-byte values)."""
    if recorded is None:
        return True
    try:
        expected = np.dtype(recorded)
    except TypeError:
        return False
    fmt = np.lib.format
    return bool(fmt.descr_to_dtype(fmt.dtype_to_descr(expected)) == header)


def shard_key(key: str, index: int, count: int) -> str:
    """The file name (without ``.npy``) of process ``index``'s part of array
    ``key`` when ``count`` processes save one each."""
    return key if count == 1 else f"{key}.shard-{index}-of-{count}"


def save_table(directory: str, cache: EmbeddingCache, *, fsync: bool) -> None:
    """Writes one table. Every process writes its own host rows and its own
    part of the cache's state arrays (one file per array and process when
    they are split); the first process also writes ``table.json``."""
    os.makedirs(directory, exist_ok=True)
    own, state = cache.state_arrays(), cache.state_meta()
    table = cache.table
    index, count = table.shard
    rows = {"rows": table.rows, **{f"state.{k}": v for k, v in table.state.items()}}
    arrays = {shard_key(key, index, count): array for key, array in rows.items()}
    files: dict[str, dict[str, Any]] = {}
    if not isinstance(table.rows, np.ndarray):  # a TieredTable: its rows are read in chunks
        files = npy_files.write_streamed(directory, table, list(arrays), fsync=fsync)
        arrays = {}
    arrays.update({shard_key(key, index, count): array for key, array in own.items()})
    files.update(
        (key, npy_files.write_array(os.path.join(directory, f"{key}.npy"), array, fsync=fsync))
        for key, array in arrays.items()
    )
    if index:
        return
    meta = {
        "format": FORMAT,
        "config": _config_json(cache.config),
        "devices": int(cache.devices),
        "shards": count,
        "arrays": files,
        **state,
    }
    path = os.path.join(directory, "table.json")
    with open(path, "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def check_restorable(name: str, saved: SavedTable, cache: EmbeddingCache) -> None:
    """Raises ``ValueError`` unless table ``name`` restores into ``cache``: the
    same rows, width, dtype and row state (or none), every file there, and
    the cache's state arrays fit it (``EmbeddingCache.check_state_arrays``)."""
    _check_compatible(name, saved.meta, cache)
    saved.check_files(name)
    _check_row_files(name, saved, cache)
    try:
        cache.check_state_arrays(saved.state_parts(), saved.state_meta())
    except ValueError as error:
        raise ValueError(f"table {name!r}: {error}") from None


def _check_row_files(name: str, saved: SavedTable, cache: EmbeddingCache) -> None:
    """Raises ``ValueError`` unless the files a restore reads into ``cache``'s
    table (its rows, and its optimizer state) hold each saving process's
    rows in the table's width and dtype, whatever ``table.json`` says."""
    config, count = cache.config, saved.shards
    wanted: dict[str, tuple[tuple[int, ...], np.dtype]] = {
        "rows": ((config.features,), np.dtype(config.row_dtype))
    }
    for key, spec in config.optimizer.state_spec(config.features).items():
        if key in cache.table.state:
            wanted[f"state.{key}"] = (tuple(spec.shape), np.dtype(spec.dtype))
    for key, (tail, dtype) in wanted.items():
        for shard in range(count):
            shape = [len(range(shard, config.num_embeddings, count)), *tail]
            record = {"shape": shape, "dtype": dtype.name}
            path = saved.path(shard_key(key, shard, count))
            _check_npy(name, path, record, by=f"the table's {key} there are")


def _check_compatible(name: str, meta: dict[str, Any], cache: EmbeddingCache) -> None:
    saved, config = meta["config"], cache.config
    if meta.get("format") != FORMAT:
        raise ValueError(f"table {name!r} was saved in format {meta.get('format')}, not {FORMAT}.")
    for field in ("num_embeddings", "features", "dtype"):
        if saved[field] != getattr(config, field):
            raise ValueError(
                f"table {name!r}: the checkpoint has {field}={saved[field]!r} but the cache has "
                f"{getattr(config, field)!r}; build the cache from "
                f"Checkpointer.cache_config({name!r}) (capacity, policy and devices may differ)."
            )
    vocabulary = saved.get("vocabulary")
    if vocabulary is not None and config.vocabulary is not None:
        # Where each id's row is (its bucket hashes with the seed over the
        # buckets ``ways`` makes), and whether a row is the shared default.
        for field in ("seed", "ways", "default"):
            if vocabulary[field] != getattr(config.vocabulary, field):
                raise ValueError(
                    f"table {name!r}: the checkpoint's vocabulary has {field}="
                    f"{vocabulary[field]!r} but the cache's has "
                    f"{getattr(config.vocabulary, field)!r}, and the saved rows are laid out for "
                    f"the saved value; build the cache from Checkpointer.cache_config({name!r})."
                )
        # Any int64 may be a raw id: another padding id may be a saved live
        # id, whose row no lookup would reach again.
        if saved.get("padding_id") != config.padding_id:
            raise ValueError(
                f"table {name!r}: the checkpoint's raw ids were padded with padding_id="
                f"{saved.get('padding_id')!r} but the cache has padding_id={config.padding_id!r}, "
                "which may be an id with a saved row; build the cache from "
                f"Checkpointer.cache_config({name!r})."
            )
    row_state = _row_state_json(config)
    # A serving cache keeps rows only; a training cache dropping the saved
    # state would silently restart each row's optimizer from nothing.
    if row_state != saved["row_state"] and (row_state or config.optimizer.trains):
        raise ValueError(
            f"table {name!r}: the checkpoint's per-row optimizer state is "
            f"{saved['row_state'] or 'none'} but this cache's optimizer keeps "
            f"{row_state or 'none'}; restore with the same sparse optimizer "
            f"({saved['optimizer']['type']!r}; Checkpointer.cache_config({name!r}) rebuilds "
            "it), or into a serving cache (jaxcache.serving_config), which keeps rows only."
        )


def _is_exact(meta: dict[str, Any], cache: EmbeddingCache) -> bool:
    """Same capacity, policy, optimizer and devices: the cache comes back as it was."""
    saved, config = meta["config"], cache.config
    return (
        saved["capacity"] == config.capacity
        and saved["policy"] == config.policy
        and saved["optimizer"] == optimizers.to_json(config.optimizer)
        and meta["devices"] == cache.devices
    )


def restore_table(saved: SavedTable, holder: Any) -> None:
    """Restores a table into the cache of ``holder`` (checked with
    ``check_restorable``): its state, this process's rows, and a device
    state built from them."""
    cache = holder.cache
    try:
        cache.load_state_arrays(
            saved.state_parts(), saved.state_meta(), exact=_is_exact(saved.meta, cache)
        )
        table = cache.table
        if isinstance(table.rows, np.ndarray):
            saved.copy_rows("rows", table.rows, table.shard)
            for key, array in table.state.items():
                saved.copy_rows(f"state.{key}", array, table.shard)
        else:  # a TieredTable: written in chunks through its tiers
            for ids in npy_files.id_chunks(table):
                rows = saved.take("rows", ids, table.rows.dtype)
                state = {k: saved.take(f"state.{k}", ids, v.dtype) for k, v in table.state.items()}
                table.scatter(ids, rows, state)
        holder.set_state(cache.init_state())
    except BaseException as error:
        # Checked beforehand, a file can still fail as it is read (another
        # process deleted the step, a disk error): the cache now holds part
        # of the checkpoint, and is refused until a restore completes.
        cache.restore_failed(f"{type(error).__name__}: {error}")
        raise
    cache.restore_failed(None)


# --------------------------------------------------------------- configuration
def _row_state_json(config: CacheConfig) -> dict[str, Any]:
    return {
        name: {"shape": list(spec.shape), "dtype": np.dtype(spec.dtype).name}
        for name, spec in config.optimizer.state_spec(config.features).items()
    }


def _config_json(config: CacheConfig) -> dict[str, Any]:
    out = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    out["optimizer"] = optimizers.to_json(config.optimizer)
    if config.vocabulary is not None:
        out["vocabulary"] = dataclasses.asdict(config.vocabulary)
    out["row_state"] = _row_state_json(config)
    return out


def check_saveable(name: str, config: CacheConfig) -> None:
    """Raises ``ValueError`` unless the configuration comes back equal from
    the JSON a checkpoint records (its sparse optimizer above all)."""
    again: CacheConfig | None
    try:
        again = config_from_json(json.loads(json.dumps(_config_json(config))))
    except (TypeError, ValueError) as error:
        again, reason = None, f": {error}"
    else:
        reason = f", but as {again.optimizer!r}" if again != config else ""
    if again != config:
        raise ValueError(
            f"table {name!r}: its sparse optimizer {config.optimizer!r} cannot be saved as "
            f"JSON and rebuilt{reason}; give it numbers, strings or booleans as "
            "hyperparameters (its dataclass fields)."
        )


def config_from_json(saved: dict[str, Any]) -> CacheConfig:
    """The ``CacheConfig`` a table was saved with, its optimizer rebuilt
    through the registry (``optimizers.from_json``)."""
    names = {f.name for f in dataclasses.fields(CacheConfig)}
    fields = {k: v for k, v in saved.items() if k in names and k != "optimizer"}
    if fields.get("vocabulary") is not None:
        fields["vocabulary"] = DynamicVocabulary(**fields["vocabulary"])
    return CacheConfig(**fields, optimizer=optimizers.from_json(saved["optimizer"]))
