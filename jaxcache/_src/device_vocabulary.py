"""The device planner's vocabulary: raw ids found, admitted and given rows in their buckets, in jit.

Pure ``jnp``, like ``device_plan`` which calls it: the device half of
``vocabulary.Vocabulary``, with the same rules, the same hashes
(``hashing``) and so the same choices. A resident id costs the host nothing:
only the ids given rows now cross to it, for their first values.

Each device of the rows axis holds the buckets ``b`` of its residue (``b %
n``, as the rows of ``Layout``; ``n`` divides ``B``). Its local bucket ``j``
is bucket ``j n + r``; way ``w`` of it holds the entry of local row ``j +
B_l w``, the host table's row ``n (j + B_l w) + r``. The entries are laid
out bucket by bucket, so finding an id reads one run of ``W`` keys.

Shape letters: ``V`` distinct ids an owner received, ``W`` ways of a bucket
at most (``ceil(R / B)``), ``B_l = B / n`` buckets per device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcache._src.hashing import LRFU_AGE_FLOOR, SKETCH_DEPTH, fmix32, id_hash, log2_fixed

__all__ = ["Admitted", "VocabSpec", "VocabState", "admit", "bucket_of"]

_INT32_MAX = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True)
class VocabSpec:
    """The static shape and rules of a device vocabulary (hashable).

    Attributes:
      rows: ``R``, the row budget.
      buckets: ``B`` (a power of two, a multiple of ``devices``).
      ways: ``W``, the most rows of a bucket.
      devices: ``n``, devices of the rows axis.
      admit_after: lookups before an id is admitted.
      forget: ``"lru"``, ``"lfu"``, ``"lrfu"`` or ``"adaptive"``
        (``DynamicVocabulary``); the bonus of the last two is each plan's
        argument.
      ttl: plans without a lookup before an id expires, or ``None``.
      columns: sketch columns per bucket (``0``: no sketch).
      salt: the hashes' seed word.
      salts: the sketch rows' salts.
      shared: ids without a row read host row ``rows``, the shared row
        past the vocabulary's (``DynamicVocabulary(default="shared")``).
      learner_bits: ``forget="adaptive"``: the plan lists the batch's
        distinct ids whose hash has this many leading zero bits, the
        sample its bonus learner replays (``vocabulary_learner``); ``None``
        for the other rules.
    """

    rows: int
    buckets: int
    ways: int
    devices: int
    admit_after: int
    forget: str
    ttl: int | None
    columns: int
    salt: int
    salts: tuple[int, ...]
    shared: bool = False
    learner_bits: int | None = None

    @property
    def counts_uses(self) -> bool:
        """Whether forgetting reads the ids' lookups (``VocabState.uses``)."""
        return self.forget != "lru"

    @property
    def local_buckets(self) -> int:
        """``B_l``, buckets per device."""
        return self.buckets // self.devices

    @property
    def local_entries(self) -> int:
        """Entries per device, ``B_l W`` (ways past a bucket's rows stay empty)."""
        return self.local_buckets * self.ways

    @property
    def local_cells(self) -> int:
        """Counters per sketch row per device, ``B_l S``."""
        return self.local_buckets * self.columns


class VocabState(NamedTuple):
    """A vocabulary on the devices, each array split row-wise over the rows
    axis (one block per device, its entries bucket by bucket).

    Attributes:
      key_lo: ``int32 [n B_l W]``: each entry's id, low word.
      key_hi: ``int32 [n B_l W]``: high word.
      last: ``int32 [n B_l W]``: the plan of its last lookup; ``-1``: no entry.
      uses: ``int32 [n B_l W]``: its lookups since admitted (``lfu``,
        ``lrfu``), or ``None``.
      sketch: ``int32 [n 4 B_l S]``: the admission sketch's counters of the
        device's buckets (local cell ``j + B_l c``), or ``None``.
    """

    key_lo: jax.Array
    key_hi: jax.Array
    last: jax.Array
    uses: jax.Array | None
    sketch: jax.Array | None


class Admitted(NamedTuple):
    """What ``admit`` found and chose for one owner's distinct ids.

    Attributes:
      rows: ``int32 [V]``: each id's local row, ``-1`` when it has none
        (not admitted, or not an id).
      new: ``bool [V]``: the id got its row now (its first values are due).
      forgotten: ids whose rows new ids took (expired ones admitted again too).
      refused: lookups of ids not admitted.
      full: a bucket has more ids to admit than rows it can free.
      commit: ``commit(state, ok) -> state``: the vocabulary after the plan,
        or as it was unless ``ok``.
    """

    rows: jax.Array
    new: jax.Array
    forgotten: jax.Array
    refused: jax.Array
    full: jax.Array
    commit: Callable[[VocabState, jax.Array], VocabState]


def bucket_of(spec: VocabSpec, low: jax.Array, high: jax.Array) -> jax.Array:
    """``int32``: the bucket of each raw id (two int32 words)."""
    h = _hash(spec, low, high)
    return (h & np.uint32(spec.buckets - 1)).astype(jnp.int32)


def learner_sample(spec: VocabSpec, low: jax.Array, high: jax.Array) -> jax.Array:
    """``bool``: whether each raw id is in the bonus learner's sample
    (``BonusLearner.sampled``)."""
    bits = spec.learner_bits
    assert bits is not None
    if bits == 0:
        return jnp.ones(low.shape, bool)
    return (_hash(spec, low, high) >> np.uint32(32 - bits)) == 0


def _hash(spec: VocabSpec, low: jax.Array, high: jax.Array) -> jax.Array:
    as_u32 = lambda x: lax.bitcast_convert_type(x, jnp.uint32)  # noqa: E731
    return id_hash(as_u32(low), as_u32(high), np.uint32(spec.salt))


def admit(
    spec: VocabSpec,
    state: VocabState,
    low: jax.Array,
    high: jax.Array,
    lookups: jax.Array,
    live: jax.Array,
    t: jax.Array,
    finished: jax.Array,
    train: jax.Array,
    bonus: jax.Array,
) -> Admitted:
    """One owner's distinct raw ids found or admitted (``Vocabulary.admit``).

    Args:
      spec: the vocabulary's shape and rules.
      state: this device's block of the ``VocabState``.
      low, high: ``int32 [V]``: the ids' words (distinct where ``live``).
      lookups: ``int32 [V]``: their lookups in the batch.
      live: ``bool [V]``: entries that are ids.
      t: the plan's training step (``TrainingClock``); ``finished``: the
        steps up to it hold no rows.
      train: the batch trains (admits and counts); else nothing is admitted.
      bonus: of ``"lrfu"`` and ``"adaptive"`` (the learned one).
    """
    n, w, nb = spec.devices, spec.ways, spec.local_buckets
    v = low.shape[0]
    h = _hash(spec, low, high)
    bucket = (h & np.uint32(spec.buckets - 1)).astype(jnp.int32)
    local = bucket // n
    ways_of = spec.rows // spec.buckets + (bucket < spec.rows % spec.buckets).astype(jnp.int32)
    valid = lax.iota(jnp.int32, w)[None, :] < ways_of[:, None]
    key_lo = state.key_lo.reshape(nb, w)[local]
    key_hi = state.key_hi.reshape(nb, w)[local]
    last = state.last.reshape(nb, w)[local]
    match = valid & (last >= 0) & (key_lo == low[:, None]) & (key_hi == high[:, None])
    found = live & jnp.any(match, axis=1)
    way = jnp.argmax(match, axis=1).astype(jnp.int32)
    entry_last = jnp.take_along_axis(last, way[:, None], axis=1)[:, 0]
    expired = found & _expired(spec, entry_last, t, finished)
    known = found & ~expired
    unknown = live & ~known
    train = train != 0

    cells = None
    counted = jnp.where(unknown & train, lookups, 0)
    if spec.columns:
        assert state.sketch is not None
        salts = jnp.asarray(np.array(spec.salts, np.uint32))
        columns = fmix32(h[None, :] ^ salts[:, None]) & np.uint32(spec.columns - 1)
        cells = local[None, :] + nb * columns.astype(jnp.int32)
        depth = lax.iota(jnp.int32, SKETCH_DEPTH)[:, None]
        sketch = state.sketch.reshape(SKETCH_DEPTH, spec.local_cells)
        added = sketch.at[depth, cells].add(counted[None, :])
        seen = jnp.min(added[depth, cells], axis=0)
        admitted = unknown & train & (seen >= spec.admit_after)
    else:
        admitted = unknown & train
    back = admitted & expired  # takes its own way again
    alloc = admitted & ~expired

    def allocate():
        held_at = jnp.where(known | back, local * w + way, spec.local_entries)
        held = (
            jnp.zeros(spec.local_entries, bool)
            .at[held_at]
            .set(True, mode="drop")
            .reshape(nb, w)[local]
        )
        free = valid & ~held & ((last < 0) | _expired(spec, last, t, finished))
        stale = valid & ~held & ~free & (last <= finished)
        if spec.forget == "lru":
            key = last
        else:
            assert state.uses is not None
            uses = state.uses.reshape(nb, w)[local]
            if spec.forget == "lfu":
                key = uses
            else:  # as the host's, less a constant: int32 in a run of any length
                age = jnp.maximum(last - t, LRFU_AGE_FLOOR)
                key = 256 * age + bonus * log2_fixed(jnp.maximum(uses, 1))
        available = jnp.sum(free | stale, axis=1, dtype=jnp.int32)
        # Each id's rank among the batch's ids to admit into its bucket.
        by_bucket, at = lax.sort(
            (jnp.where(alloc, local, _INT32_MAX), lax.iota(jnp.int32, v)),
            num_keys=1,
            is_stable=True,
        )
        head = jnp.concatenate([jnp.ones(1, bool), by_bucket[1:] != by_bucket[:-1]])
        start = lax.cummax(jnp.where(head, lax.iota(jnp.int32, v), 0))
        rank = jnp.zeros(v, jnp.int32).at[at].set(lax.iota(jnp.int32, v) - start)
        rank = jnp.where(alloc, rank, -1)
        # The id of rank j takes its bucket's j-th way in the order (free
        # first, by way; then stale, by key and way): j rounds, each taking
        # every id's best way left. Buckets are many and a batch's new ids
        # few, so j stays small, where a sort of every id's W ways would not.
        stale_key = jnp.where(stale, key, _INT32_MAX)

        def best(candidates):
            free_left = free & candidates
            least = jnp.min(jnp.where(candidates, stale_key, _INT32_MAX), axis=1)
            stalest = candidates & (stale_key == least[:, None])
            pick = jnp.where(jnp.any(free_left, axis=1)[:, None], free_left, stalest)
            return jnp.argmax(pick, axis=1).astype(jnp.int32)

        def take(carry):
            round_, candidates, chosen = carry
            way = best(candidates)
            chosen = jnp.where(rank == round_, way, chosen)
            taken = lax.iota(jnp.int32, w)[None, :] == way[:, None]
            return round_ + 1, candidates & ~taken, chosen

        _, _, chosen = lax.while_loop(
            lambda carry: carry[0] <= jnp.max(rank),
            take,
            (jnp.int32(0), free | stale, jnp.zeros(v, jnp.int32)),
        )
        return chosen, jnp.any(alloc & (rank >= available))

    chosen, full = lax.cond(
        jnp.any(alloc), allocate, lambda: (jnp.zeros(v, jnp.int32), jnp.zeros((), bool))
    )
    new_way = jnp.where(back, way, chosen)
    old_last = jnp.take_along_axis(last, new_way[:, None], axis=1)[:, 0]
    rows = jnp.where(known, local + nb * way, jnp.where(admitted, local + nb * new_way, -1))
    forgotten = jnp.sum(admitted & (old_last >= 0), dtype=jnp.int32)
    refused = jnp.sum(jnp.where(live & ~known & ~admitted, lookups, 0))

    def commit(state: VocabState, ok: jax.Array) -> VocabState:
        size = spec.local_entries
        # A batch that trains nothing leaves known rows' use and counts be.
        seen_at = jnp.where(ok & known & train, local * w + way, size)
        new_at = jnp.where(ok & admitted, local * w + new_way, size)
        last_out = state.last.at[seen_at].set(t, mode="drop").at[new_at].set(t, mode="drop")
        uses = state.uses
        if uses is not None:
            before = uses.at[seen_at].get(mode="fill", fill_value=0)
            uses = uses.at[seen_at].set(
                jnp.minimum(before, _INT32_MAX - lookups) + lookups, mode="drop"
            )
            uses = uses.at[new_at].set(lookups, mode="drop")
        sketch = state.sketch
        if cells is not None and sketch is not None:
            # The batch's counts stay only if the plan did; a counter that
            # passes 2^31 - 1 saturates, as on the host.
            grown = added.at[depth, cells].add(jnp.where(ok, 0, -counted)[None, :])
            touched = grown[depth, cells]
            grown = grown.at[depth, cells].set(jnp.where(touched < 0, _INT32_MAX, touched))
            sketch = grown.reshape(-1)
        return VocabState(
            state.key_lo.at[new_at].set(low, mode="drop"),
            state.key_hi.at[new_at].set(high, mode="drop"),
            last_out,
            uses,
            sketch,
        )

    return Admitted(rows, admitted, forgotten, refused, full, commit)


def _expired(spec: VocabSpec, last: jax.Array, t: jax.Array, finished: jax.Array) -> jax.Array:
    """Entries (``last >= 0``) no plan looked up for ``ttl`` steps, none in flight."""
    if spec.ttl is None:
        return jnp.zeros(last.shape, bool)
    return (last >= 0) & (last < t - spec.ttl) & (last <= finished)
