"""Checkpoints: everything needed to continue training exactly, written atomically.

``Checkpointer`` wires the pieces into orbax. A checkpoint is one step
directory of an orbax ``CheckpointManager``. orbax writes it under a
temporary name and renames it once every item is complete, so a process
killed while saving leaves the earlier checkpoints as they were; the partial
one is never listed, and the next writable ``Checkpointer`` on the directory
removes it.

Items of a step directory:

* ``tables/<name>/``: one directory per cached table, written by the
  ``tables`` handler here: its record (``table_record``: rows and row state
  in id order as streamed ``.npy`` files, the cache's state arrays and
  ``table.json``).
* ``model/`` and ``optimizer/``: orbax PyTrees of the dense state of the
  model (every variable except the cached rows, which the tables hold) and
  of the optimizer.
* ``meta/``: JSON: the batches consumed from the data and the caller's extras.

The device half of a cache is never saved. On restore it is rebuilt from the
host table and the restored directory, so a checkpoint restores onto any
capacity and any number of devices: the logical table is what is saved.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxcache._src import table_record
from jaxcache._src.config import CacheConfig
from jaxcache._src.engine import CLOSE_DROPPED, EmbeddingCache
from jaxcache._src.holder import CacheHolder, dense_state, find_tables, load_dense_state
from jaxcache._src.linen_module import Holder
from jaxcache._src.validation import is_int

__all__ = ["CheckpointInfo", "Checkpointer"]

_FORMAT = 1


class CheckpointInfo(NamedTuple):
    """What a checkpoint holds, besides its arrays.

    Attributes:
      step: the step it was saved at.
      batches_consumed: batches the training loop had consumed when it was
        saved; resume the data source from this index.
      extra: the JSON-serialisable ``extra`` given to ``save``.
      tables: names of the cached tables it holds.

    Examples:
      >>> import jaxcache
      >>> from jaxcache.checkpoint import CheckpointInfo
      >>> info = CheckpointInfo(step=20, batches_consumed=20, extra={}, tables=("t",))
      >>> info.batches_consumed
      20
    """

    step: int
    batches_consumed: int
    extra: dict[str, Any]
    tables: tuple[str, ...]


class Checkpointer:
    """Saves and restores training state, keeping the last ``max_to_keep`` steps.

    A checkpoint holds everything needed to continue exactly: each cached
    table (rows and per-row optimizer state in id order, the planner's
    resident set and the policy's counts, padded sizes and statistics), the
    dense NNX state of the model and of the optimizer, the step, the number
    of batches consumed from the data, and JSON extras. ``save`` writes every
    changed row back to the host first (``flush``), so the tables are
    complete; it blocks until the step directory is renamed into place.

    Take a checkpoint between steps with no batch in flight: let a
    ``jaxcache.prefetch`` pipeline finish its source (iterate it over the
    batches up to the checkpoint) rather than leaving it with batches staged
    ahead. ``save`` refuses otherwise, because the planner would already
    count batches that the resumed run reads again. ``restore`` may roll
    back after such a break: it replaces the plans of the batches staged.

    Args:
      directory: where the step directories go (created if missing).
      max_to_keep: how many of the latest checkpoints to keep (``None``: all).
      fsync: flush each table file to the disk before the step is committed,
        so a checkpoint also survives a power loss, not only a killed process.
      read_only: only restore and export: never delete or write anything
        there (for a server reading a directory that training writes to).

    Examples:
      >>> import tempfile, numpy as np, jaxcache
      >>> cfg = jaxcache.CacheConfig(100, 4, capacity=8, optimizer=jaxcache.adagrad(0.1))
      >>> embed = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg))
      >>> lookup = embed.prepare(np.array([1, 2, 3]))
      >>> ckpt = jaxcache.Checkpointer(tempfile.mkdtemp(), max_to_keep=2)
      >>> ckpt.save(1, caches=[embed]).tables
      ('embedding',)
      >>> restored = jaxcache.nnx.CachedEmbed(jaxcache.EmbeddingCache(cfg, seed=7))
      >>> ckpt.restore(caches=[restored]).step
      1
      >>> bool((restored.cache.table.rows == embed.cache.table.rows).all())
      True
      >>> restored.cache.planner.resident_ids().tolist()
      [1, 2, 3]
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = 3,
        fsync: bool = True,
        read_only: bool = False,
    ) -> None:
        if max_to_keep is not None and (not is_int(max_to_keep) or max_to_keep < 1):
            raise ValueError(f"max_to_keep={max_to_keep!r} must be a positive count or None.")
        self.directory = os.path.abspath(os.fspath(directory))
        self.read_only = read_only
        # read_only is enforced here rather than by orbax, which logs warnings
        # for read-only managers; without saves, the manager writes nothing.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=False,
            cleanup_tmp_directories=not read_only,
            create=not read_only,
        )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "meta": ocp.JsonCheckpointHandler(),
                "model": ocp.StandardCheckpointHandler(),
                "optimizer": ocp.StandardCheckpointHandler(),
                "tables": _TablesHandler(fsync=fsync),
            },
        )

    # ------------------------------------------------------------------ steps
    def steps(self) -> list[int]:
        """Steps with a complete checkpoint, oldest first."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or ``None`` when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def info(self, step: int | None = None) -> CheckpointInfo:
        """What checkpoint ``step`` (default: the latest) holds, without reading arrays."""
        step = self._resolve(step)
        return _info(step, self._meta(step))

    def cache_config(self, name: str = "embedding", *, step: int | None = None) -> CacheConfig:
        """The ``CacheConfig`` table ``name`` was saved with.

        Build a cache from it (changing ``capacity``, ``policy`` or, with
        ``jaxcache.serving_config``, the optimizer) to restore the table.

        Raises:
          ValueError: the table was trained with a sparse optimizer that is
            not registered (import the module defining it first, see
            ``jaxcache.SparseOptimizer``).
        """
        saved = self._tables(self._resolve(step), [name])[name]
        return table_record.config_from_json(saved.meta["config"])

    # ------------------------------------------------------------------ save
    def save(
        self,
        step: int,
        *,
        model: nnx.Module | Holder | None = None,
        optimizer: nnx.Optimizer | None = None,
        caches: Iterable[CacheHolder] = (),
        batches_consumed: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> CheckpointInfo:
        """Writes checkpoint ``step`` and returns once it is committed.

        Args:
          step: the step number: new, and above every saved step.
          model: an NNX model (its ``CachedEmbed`` tables are saved with it),
            or the ``jaxcache.linen.Holder`` of a Linen model's variables (its
            collections, and the tables of every holder sharing them).
          optimizer: the dense optimizer (``nnx.Optimizer``).
          caches: more tables: anything with ``cache``, ``get_state`` and
            ``set_state`` (``jaxcache.pipeline.CacheHolder``) outside ``model``.
          batches_consumed: batches the training loop has consumed (default:
            ``step``); resume the data from this index.
          extra: JSON-serialisable extras (losses, seeds, configuration).

        Returns:
          The ``CheckpointInfo`` of what was saved.

        Raises:
          ValueError: ``step`` is saved already or older than the latest
            saved step, or nothing to save.
          TypeError: ``extra`` is not JSON-serialisable.
          RuntimeError: a table has batches in flight (nothing was written).
        """
        if self.read_only:
            raise RuntimeError(
                f"this Checkpointer of {self.directory} is read-only; save through one built "
                "with read_only=False (the default)."
            )
        step = _check_step(step, "step")
        if step in self.steps():
            raise ValueError(
                f"step {step} is already saved in {self.directory}; save a new step number "
                "(or restore it and continue from there)."
            )
        latest = self.latest_step()
        if latest is not None and step < latest:
            raise ValueError(
                f"step {step} is older than the latest saved step {latest} in "
                f"{self.directory}; steps must increase: save a step above {latest}, or save "
                "into a new directory."
            )
        _check_optimizer(optimizer)
        holders = find_tables(model, caches)
        if model is None and optimizer is None and not holders:
            raise ValueError("nothing to save: pass model=, optimizer= or caches=.")
        extra = dict(extra or {})
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"extra must be JSON-serialisable (numbers, strings, lists, dicts): {error}"
            ) from None
        if batches_consumed is None:
            batches_consumed = step
        consumed = _check_step(batches_consumed, "batches_consumed")
        for name, holder in holders.items():
            table_record.check_saveable(name, holder.cache.config)
            _check_nothing_in_flight(name, holder.cache)
        # Checked: from here on, state changes (rows are written back).
        for holder in holders.values():
            # Saving means every step so far has run: release, then flush, so
            # no row is left marked as possibly changing.
            holder.cache.lifecycle.release_all()
            holder.cache.flush(holder.get_state())
        items: dict[str, Any] = {}
        for item, node in (("model", model), ("optimizer", optimizer)):
            tree = {} if node is None else _saveable(dense_state(node))
            if jax.tree.leaves(tree):
                items[item] = ocp.args.StandardSave(tree)
        if holders:
            items["tables"] = _TablesSave({name: h.cache for name, h in holders.items()})
        info = CheckpointInfo(step, consumed, extra, tuple(holders))
        meta = {
            "format": _FORMAT,
            "batches_consumed": info.batches_consumed,
            "extra": extra,
            "tables": list(info.tables),
            "items": sorted(items),
        }
        args = ocp.args.Composite(meta=ocp.args.JsonSave(meta), **items)
        # Forced: the steps were checked above, and orbax's own save policy
        # would otherwise skip a save silently (it returns False).
        if not self._manager.save(step, args=args, force=True):
            raise RuntimeError(f"orbax did not save step {step} in {self.directory}.")
        self._manager.wait_until_finished()
        return info

    # --------------------------------------------------------------- restore
    def restore(
        self,
        step: int | None = None,
        *,
        model: nnx.Module | Holder | None = None,
        optimizer: nnx.Optimizer | None = None,
        caches: Iterable[CacheHolder] = (),
    ) -> CheckpointInfo:
        """Restores checkpoint ``step`` (default: the latest) into the given objects.

        Each table's host rows (and optimizer state) are read back in id
        order and its device state is rebuilt from them. With the capacity,
        policy, optimizer and device count it was saved with, the cache comes
        back exactly (slots, policy, padded sizes, statistics). Otherwise the
        logical table is the same and the new cache is warmed with the
        hottest previously resident rows (``Planner.load_state_dict``); its
        statistics start afresh. A table restored into a cache whose
        optimizer keeps no per-row state (``jaxcache.serving_config``) gets
        its rows only.

        Everything is checked before anything changes: a table or a model
        that does not match raises ``ValueError`` and leaves the objects as
        they were.

        Args:
          step: the step to restore; default: the latest.
          model: the NNX model to restore (built like the saved one), its
            ``CachedEmbed`` tables with it; or the ``jaxcache.linen.Holder``
            of a Linen model's variables (built like the saved ones), whose
            variables are replaced.
          optimizer: the dense optimizer to restore.
          caches: more tables (``jaxcache.pipeline.CacheHolder``) outside ``model``.

        Returns:
          The ``CheckpointInfo``; resume the data at ``batches_consumed``.
        """
        _check_optimizer(optimizer)
        step = self._resolve(step)
        meta = self._meta(step)
        holders = find_tables(model, caches)
        saved = self._tables(step, list(holders)) if holders else {}
        for name, holder in holders.items():
            table_record.check_restorable(name, saved[name], holder.cache)
            _check_nothing_in_flight(name, holder.cache, restoring=True)
        updates = []
        for item, node in (("model", model), ("optimizer", optimizer)):
            if node is None or not jax.tree.leaves(dense_state(node)):
                continue
            if item not in meta["items"]:
                raise ValueError(f"checkpoint {step} has no {item} state; pass {item}=None.")
            updates.append((node, self._restore_dense(step, item, node)))
        # Everything matched: from here on, state changes. Rows evicted by
        # the last steps land first, or they would land over restored ones;
        # those of batches staged and never applied (one lost to an error
        # before its swap, ``EmbeddingCache.apply``) never will.
        for holder in holders.values():
            holder.cache.write_backs.drop_unapplied()
            holder.cache.land_write_backs()
        for name, holder in holders.items():
            table_record.restore_table(saved[name], holder)
        for node, state in updates:
            load_dense_state(node, state)
        return _info(step, meta)

    def _restore_dense(self, step: int, item: str, node: Any) -> dict[str, Any]:
        target = dense_state(node)
        abstract = jax.tree.map(_abstract, _saveable(target))
        saved = _shapes(self._manager.item_metadata(step)[item].tree)
        wanted = _shapes(abstract)
        if saved != wanted:
            name = min(set(saved) ^ set(wanted) or {k for k in saved if saved[k] != wanted[k]})
            raise ValueError(
                f"the {item}'s variables do not match checkpoint {step}: {name!r} is "
                f"{saved.get(name, 'absent')} there and {wanted.get(name, 'absent')} here; "
                "build it with the same architecture and options as the saved one."
            )
        restored = self._manager.restore(
            step, args=ocp.args.Composite(**{item: ocp.args.StandardRestore(abstract)})
        )[item]
        return jax.tree.map(_unsaveable, target, restored)

    # ---------------------------------------------------------------- export
    def export(
        self,
        directory: str | os.PathLike[str],
        *,
        step: int | None = None,
        tables: Iterable[str] | None = None,
    ) -> dict[str, str]:
        """Writes each table's rows as a plain ``<directory>/<name>.npy``, in id order.

        Nothing but NumPy is needed to read them, and they load into any
        embedding layer, e.g. ``nnx.Embed(N, D, rngs=...)`` with
        ``embed.embedding.set_value(jnp.asarray(np.load(path)))``. float32
        rows are copied file to file; bfloat16 rows are widened to float32
        (exactly), which NumPy reads without ``ml_dtypes``.

        Args:
          directory: where the files go (created if missing).
          step: the checkpoint; default: the latest.
          tables: names of the tables to export; default: all.

        Returns:
          ``{name: path}``.
        """
        step = self._resolve(step)
        names = list(tables) if tables is not None else list(self.info(step).tables)
        saved = self._tables(step, names)
        os.makedirs(directory, exist_ok=True)
        paths = {}
        for name in names:
            paths[name] = os.path.join(os.fspath(directory), f"{name}.npy")
            saved[name].export_rows(paths[name])
        return paths

    # ----------------------------------------------------------------- other
    def close(self) -> None:
        """Waits for pending work and releases orbax's resources."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _meta(self, step: int) -> dict[str, Any]:
        args = ocp.args.Composite(meta=ocp.args.JsonRestore())
        return self._manager.restore(step, args=args)["meta"]

    def _resolve(self, step: int | None) -> int:
        steps = self.steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no checkpoint in {self.directory}.")
            return steps[-1]
        if step not in steps:
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {self.directory}; saved steps: {steps}."
            )
        return step

    def _tables(self, step: int, names: list[str]) -> dict[str, table_record.SavedTable]:
        saved = {}
        if "tables" in self._meta(step)["items"]:
            args = ocp.args.Composite(tables=_TablesRestore())
            saved = self._manager.restore(step, args=args)["tables"]
        missing = [name for name in names if name not in saved]
        if missing:
            raise ValueError(
                f"checkpoint {step} has no table {missing[0]!r}; it holds {sorted(saved)}. "
                "Name each table's CacheConfig as it was named when saved."
            )
        return saved


def _info(step: int, meta: dict[str, Any]) -> CheckpointInfo:
    return CheckpointInfo(
        step, int(meta["batches_consumed"]), dict(meta["extra"]), tuple(meta["tables"])
    )


def _check_step(value: Any, name: str) -> int:
    if not is_int(value) or not 0 <= value < 2**63:
        raise ValueError(f"{name} must be an integer in [0, 2**63), got {value!r}.")
    return int(value)


def _check_nothing_in_flight(name: str, cache: EmbeddingCache, *, restoring: bool = False) -> None:
    """Refuses a table whose pipeline may plan while it is saved or
    restored, or which holds batches offered to a host-callback step. A save
    also refuses batches staged that no step took, and plans its training
    loop may not have stepped (it would record their rows as trained); a
    restore replaces them, their lookups refused from then on
    (``Lifecycle.guard``). (Write-backs of applied plans are no reason: they
    land first.)"""
    if cache.pipelines:
        # Its thread plans the next batches meanwhile: refusing only when
        # it has planned one would depend on timing.
        raise RuntimeError(
            f"table {name!r} is staged by an open jaxcache.prefetch with look-ahead, which "
            "plans its next batches meanwhile; save or restore after its with-block ends "
            f"(let it run to the end of the batches up to this step). {CLOSE_DROPPED}"
        )
    lifecycle = cache.lifecycle
    # A restore replaces the plans of batches staged and never applied (a
    # batch an error lost before its swap, and those after it): their
    # lookups and staged batches are refused from then on.
    unapplied = range(0) if restoring else lifecycle.unapplied()
    if lifecycle.offered() or unapplied:
        raise RuntimeError(
            f"table {name!r} has batches staged that no step has taken (plans "
            f"{list(unapplied)}, {lifecycle.offered()} offered to a host-callback "
            "step); step or close them before saving or restoring."
        )
    ahead = lifecycle.in_flight()
    if len(ahead) > 1 and not restoring:
        raise RuntimeError(
            f"table {name!r} has {len(ahead)} batches planned that the training loop may not "
            f"have stepped (plans {ahead[0]}..{ahead[-1]}); checkpoint "
            "between steps with nothing staged ahead: let the jaxcache.prefetch pipeline "
            "finish its source (iterate it over the batches up to this step) instead of "
            "leaving it early."
        )


# ----------------------------------------------------------------- dense state
def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _saveable(tree: dict[str, Any]) -> dict[str, Any]:
    """The arrays of a pure dict, typed PRNG keys as their raw data, for orbax."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{dotted path: (shape, dtype)}`` of the arrays of a pytree (or its metadata)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path): (
            tuple(leaf.shape),
            np.dtype(leaf.dtype).name,
        )
        for path, leaf in leaves
    }


def _abstract(leaf: Any) -> jax.ShapeDtypeStruct:
    """What orbax restores ``leaf`` as. A NumPy leaf (Linen params loaded
    from a file, say) comes back as NumPy, read onto this process's first
    device: with no layout of its own, orbax would take the saved one,
    another mesh's devices after a restore onto another device count."""
    if isinstance(leaf, (np.ndarray, np.generic)):
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return jax.ShapeDtypeStruct(np.shape(leaf), np.asarray(leaf).dtype, sharding=device)
    return ocp.utils.to_shape_dtype_struct(leaf)


def _unsaveable(target: Any, value: Any) -> Any:
    if isinstance(target, np.ndarray):
        return np.asarray(value)
    if isinstance(target, np.generic):
        return np.asarray(value)[()]
    if _is_key(target):
        return jax.random.wrap_key_data(value, impl=jax.random.key_impl(target))
    if isinstance(target, jax.Array) and not target.committed:
        # orbax commits what it restores to a device; a variable that was
        # not committed (made without a sharding) stays free to follow the
        # step's other arguments, as with several processes it must.
        return jax.device_put(np.asarray(value))
    return value


# ---------------------------------------------------------------- orbax items
class _TablesHandler(ocp.CheckpointHandler):
    """orbax handler of the ``tables`` item: one table record per directory."""

    def __init__(self, *, fsync: bool = True) -> None:
        self._fsync = fsync

    def save(self, directory: Any, args: _TablesSave) -> None:
        for name, cache in args.caches.items():
            path = os.path.join(os.fspath(directory), name)
            table_record.save_table(path, cache, fsync=self._fsync)

    def restore(self, directory: Any, args: _TablesRestore | None = None) -> dict[str, Any]:
        del args
        return table_record.read_tables(os.fspath(directory))

    def metadata(self, directory: Any) -> None:
        del directory


@ocp.args.register_with_handler(_TablesHandler, for_save=True)
@dataclasses.dataclass
class _TablesSave(ocp.args.CheckpointArgs):
    caches: dict[str, EmbeddingCache]


@ocp.args.register_with_handler(_TablesHandler, for_restore=True)
@dataclasses.dataclass
class _TablesRestore(ocp.args.CheckpointArgs):
    pass


def _check_optimizer(optimizer: object) -> None:
    """Raises ``TypeError`` unless ``optimizer`` is ``None`` or an NNX object
    (its state is restored in place; a Flax ``TrainState`` cannot be)."""
    if optimizer is not None and not isinstance(optimizer, nnx.Pytree):
        raise TypeError(
            f"optimizer= takes an nnx.Optimizer, got {type(optimizer).__name__}; the optax "
            "state of a Linen run is not saved here: save it beside the checkpoint."
        )
