"""The device planner's program: a batch planned in jit, on the devices that hold its rows.

Pure ``jnp`` over explicit state, like the other device functions
(``device_ops``). Each device of the rows axis holds a *partition* of the
cache: the ids homed on it (``Layout``: residue ``i % n``), its ``C_l``
slots, a dense directory of its ``N_l`` local ids (``i // n``) and its
policy's state. One call of ``plan`` (inside ``jax.shard_map``) does every
per-id step of a batch:

1. **source** (each device, over its slice of the batch): validate the ids,
   dedupe them in order of first appearance (one stable sort), group the
   distinct ids by home device and rank them there, still in order of first
   appearance; send them home with ``all_to_all`` in blocks of ``K`` per
   destination.
2. **owner** (each device, over what it received): dedupe across sources
   (source after source, each in its ranks' order: the host planner's order),
   look the ids up, choose victims for the misses among the slots no
   in-flight batch uses (the lowest ``(key, slot)``, as the host planner),
   update the directory, recency, dirty bits and the policy's keys.
3. The route of the batch's lookups and sparse updates (``Lookup``'s
   arrays) comes out of the same program, with the lists the host needs:
   the misses ``(local id, slot)`` and the dirty evictions, padded to ``P``.

The plan's arrays have the sizes no batch of its shape can exceed (``K``,
the distinct ids one source can send one owner, is at most the slice's ids
and the owner's slots), so a plan never fails for want of room in its own
arrays; ``compact`` cuts its outputs to the padded sizes a batch needs
(powers of two, so compiled shapes repeat) before the swap and the step.
Nothing changes unless the whole batch is planned: a bad id, a batch with
more distinct ids than a partition holds, or too few slots free of
in-flight batches fails the plan on every device (the flags are reduced
over the axis before the first write), and the state stays as it was. A
failed plan leaves a sticky ``failed`` flag: plans dispatched after it (a
pipeline dispatches ahead) do nothing, until a plan with a newer ``epoch``
clears it.

With x64 off there are no 64-bit arrays on the device: ids, slots, plan
indices, counts and keys are int32. Ids of a host int64 array travel as
two 32-bit words (``wide``), so a value beyond int32 is found here rather
than truncated on transfer; counts saturate at ``2^31 - 1``.

Shape letters: ``n`` devices, ``m`` ids of one device's slice, ``K =
min(m, C_l)`` distinct ids one source may send one owner, ``V`` entries an
owner receives (``n K``; ``K`` on one device, where the source is the
owner), ``P = min(V, C_l)`` misses (and evictions) per owner, ``C_l`` slots,
``N_l`` local ids.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from jaxcache._src import device_vocabulary
from jaxcache._src.device_vocabulary import VocabSpec, VocabState
from jaxcache._src.hashing import log2_fixed

__all__ = [
    "BAD_ID",
    "NO_ROOM",
    "SKIPPED",
    "TOO_MANY",
    "VOCABULARY_FULL",
    "PlanSpec",
    "PlanState",
    "make_clean",
    "make_compact",
    "make_plan",
    "make_rekey",
    "sampled",
]

# Status bits of a plan (``PlanOut.info[:, STATUS]``).
BAD_ID = 1  # an id outside [0, N) that is not padding
TOO_MANY = 2  # a partition's distinct ids exceed its slots
NO_ROOM = 4  # too few slots free of in-flight batches
SKIPPED = 8  # an earlier plan failed: this one did nothing
VOCABULARY_FULL = 16  # a vocabulary bucket has more new ids than rows it can free

# Columns of ``PlanOut.info`` (one row per device).
INFO = (
    "status",  # the batch's status bits, the same on every device
    "k_need",  # as source: the most distinct ids it sends one owner
    "distinct",  # as owner: distinct ids homed here
    "hits",  # distinct ids resident
    "misses",  # distinct ids fetched
    "lookups",  # real ids homed here
    "access_hits",  # of those, served by resident rows
    "evictions",  # resident rows replaced
    "written",  # dirty evictions (written back)
    "sampled",  # ids in the adaptive policy's sample
    "available",  # slots free of in-flight batches (after the hits)
    "bad_at",  # as source: first position of a bad id in the slice, or m
    "real",  # as source: real (not padding) ids of the slice
    "need_k",  # the most of k_need over the axis
    "need_v",  # the most distinct ids a device received (admitted or not)
    "need_p",  # the most misses of a device
    "need_r",  # the most real ids of a device's slice
    "new_ids",  # raw ids given rows now (a dynamic vocabulary)
    "forgotten_ids",  # ids whose rows they took
    "refused_lookups",  # lookups of ids not admitted
    "learner_sampled",  # raw ids in the vocabulary's bonus learner's sample
)
COLUMN = {name: i for i, name in enumerate(INFO)}

_INT32_MAX = np.iinfo(np.int32).max
_INT32_MIN = np.iinfo(np.int32).min
# The adaptive policy's keys on the device: int32 in [KEY_FLOOR, KEY_CEIL],
# with the time term relative to a base plan (``PlanState.scalars``). The
# host planner's keys are int64 and grow with the plan index (``256 t``);
# here the base moves up ``KEY_SPAN`` plans (the keys down ``256 KEY_SPAN``)
# whenever a plan is ``2 KEY_SPAN`` past it, so that no key overflows in a
# run of any length. The order of the keys is the host's, except that rows
# idle for millions of plans tie (``2^21`` at a re-key; the floor after
# about five moves).
KEY_SPAN = 1 << 20
KEY_FLOOR = -(1 << 30) + 1
KEY_CEIL = 1 << 30
# Where a re-key puts the highest key: the keys of the next ``2 KEY_SPAN``
# plans then stay below ``KEY_CEIL`` (``256 * 2 KEY_SPAN`` plus ``bonus *
# log2 < 2^26`` above it, less the ``256 KEY_SPAN`` the rows re-keyed at least
# had).
_KEY_TOP = 1 << 28
# The Fibonacci hash of the adaptive policy's sample (``kernels._sampled``),
# as two 32-bit words of 0x9E3779B97F4A7C15.
_GOLDEN_HI = np.uint32(0x9E3779B9)
_GOLDEN_LO = np.uint32(0x7F4A7C15)


@dataclasses.dataclass(frozen=True)
class PlanSpec:
    """What a plan program is compiled for (static, hashable).

    Attributes:
      devices: ``n``, devices of the rows axis.
      processes: processes owning them (``Layout``'s homes depend on it).
      num_embeddings: ``N``.
      local_rows: ``N_l``, local ids per device (``ceil(N / n)``).
      local_capacity: ``C_l``.
      policy: ``"lru"``, ``"lfu"``, ``"frequency"`` or ``"adaptive"``.
      prior: the adaptive policy has dataset counts.
      sample_bits: the adaptive policy samples ids whose hash has this many
        leading zero bits.
      pad: the padding id, or ``None``.
      wide: ids arrive as two 32-bit words (low, high) in a last axis of 2.
      slice_ids: ``m``, ids of one device's slice of the batch.
      key_span: ``KEY_SPAN`` (smaller in tests, to cross many rebases).
      vocabulary: raw ids through a dynamic vocabulary
        (``device_vocabulary``): the ids are two words each, homed by
        bucket, and the directory holds the rows the vocabulary gives them;
        ``None``: ids are rows.
      admits_all: with raw ids, every id of the batch gets a row or the
        batch is refused: it trains and ids are admitted on first sight.
    """

    devices: int
    processes: int
    num_embeddings: int
    local_rows: int
    local_capacity: int
    policy: str
    prior: bool
    sample_bits: int
    pad: int | None
    wide: bool
    slice_ids: int
    key_span: int = KEY_SPAN
    vocabulary: VocabSpec | None = None
    admits_all: bool = True

    @property
    def per_destination(self) -> int:
        """``K``: the most distinct ids one source can send one owner. Raw
        ids without a row take no slot, so unless every id gets one
        (``admits_all``), a source may send all of its slice."""
        if self.vocabulary is not None and not self.admits_all:
            return max(1, self.slice_ids)
        return max(1, min(self.slice_ids, self.local_capacity))

    @property
    def received(self) -> int:
        """``V``: entries an owner receives, and a place for the shared row."""
        return self.per_destination * self.devices + self.overflow

    @property
    def overflow(self) -> int:
        """``O``: rows every device reads past the routes (``Lookup.overflow``):
        the shared row of a vocabulary that has one."""
        return int(self.vocabulary is not None and self.vocabulary.shared)

    @property
    def misses(self) -> int:
        """``P``: the most misses (and evictions) of an owner."""
        return min(self.received, self.local_capacity)

    @property
    def lists(self) -> int:
        """Entries of a device's packed lists (``PlanOut.lists``)."""
        new = 3 * self.misses if self.vocabulary is not None else 0
        learned = 3 * self.received if self.learns else 0
        return 2 * self.misses + 2 * self.sample + new + learned

    @property
    def learns(self) -> bool:
        """Whether the vocabulary's bonus is learned (``forget="adaptive"``)."""
        return self.vocabulary is not None and self.vocabulary.learner_bits is not None

    @property
    def sample(self) -> int:
        """Room for the adaptive policy's sampled ids of an owner (every
        distinct id at most; none for the other policies)."""
        return self.misses if self.policy == "adaptive" else 0

    @property
    def counting(self) -> bool:
        """Whether the policy counts lookups per id."""
        return self.policy in ("lfu", "adaptive")


class PlanState(NamedTuple):
    """A cache's directory and policy on the devices; every array is split
    row-wise over the rows axis, one block per device.

    Attributes:
      slot_of_id: ``int32 [n N_l]``: each local id's slot, ``-1`` if not resident.
      id_of_slot: ``int32 [n C_l]``: each slot's local id, ``-1`` if free.
      last_use: ``int32 [n C_l]``: the last plan that used the slot.
      dirty: ``bool [n C_l]``: the slot's row changed since it was fetched.
      per_id: ``int32 [n N_l]``: lookups so far (``lfu``, ``adaptive``) or
        the dataset counts (``frequency``); ``None`` for ``lru``.
      prior: ``int32 [n N_l]``: the adaptive policy's dataset counts, or ``None``.
      keys: ``int32 [n C_l]``: each slot's priority (lowest evicted first),
        ``None`` for ``lru`` (whose key is ``last_use``).
      slot_prior: ``int32 [n C_l]``: ``prior`` of each slot's row, or ``None``.
      scalars: ``int32 [n 5]``: per device ``(epoch, failed, bonus, offset,
        base)``: the plans' epoch, whether a plan of it failed, and the
        adaptive policy's bonus, key offset and base plan (``KEY_SPAN``).
      vocabulary: raw ids' ``VocabState`` (``PlanSpec.vocabulary``), or
        ``None``; the local ids above are then its rows.
    """

    slot_of_id: jax.Array
    id_of_slot: jax.Array
    last_use: jax.Array
    dirty: jax.Array
    per_id: jax.Array | None
    prior: jax.Array | None
    keys: jax.Array | None
    slot_prior: jax.Array | None
    scalars: jax.Array
    vocabulary: VocabState | None = None


class PlanOut(NamedTuple):
    """What a plan returns besides the new state (split over the rows axis).

    Attributes:
      info: ``int32 [n, len(INFO)]``: each device's counts (``INFO``).
      requests: ``int32 [n, n, K]``: ``Lookup.requests`` (owner, source,
        rank), before ``compact``.
      inverse: ``int32``, the ids' shape: ``Lookup.inverse``.
      owner_slots: ``int32 [n, V]``: ``Lookup.owner_slots``.
      owner_inverse: ``int32 [n, V]``: ``Lookup.owner_inverse``.
      lists: ``int32 [n (2 P + 2 S + 3 P)]``: what the host reads of a
        plan, each device's packed at the front of its block so that one
        prefix holds it: its missed local ids (``misses`` of them, in the
        order of their slots in ``fetch_slots``), the local ids of its dirty
        evicted rows (``written``, in the order of ``evict_slots``), then the
        adaptive policy's sampled local ids and their lookups so far
        (``sampled`` each; ``S = 0`` for the other policies), then with a
        vocabulary the rows given to raw ids now and those ids' low and
        high words (``new_ids`` each; none without one), then with
        ``forget="adaptive"`` the distinct raw ids homed here of the
        bonus learner's sample: low words, high words and lookups
        (``learner_sampled`` each).
      fetch_slots: ``int32 [n P]``: the slots of the misses, padded with ``C_l``.
      evict_slots: ``int32 [n P]``: the slots of the dirty evicted rows,
        padded with ``C_l``.
      hit_slots: ``int32 [n V]``: the distinct ids' slots before the plan
        (``-1``: missed); read when the plan fails for room.
      overflow: ``int32 [n O]``: ``Lookup.overflow``, the same on every
        device: the global slot of the shared row (``-1`` when no id of the
        batch reads it).
    """

    info: jax.Array
    requests: jax.Array
    inverse: jax.Array
    owner_slots: jax.Array
    owner_inverse: jax.Array
    lists: jax.Array
    fetch_slots: jax.Array
    evict_slots: jax.Array
    hit_slots: jax.Array
    overflow: jax.Array


# ------------------------------------------------------------------ helpers
def _mulhi_u32(a: jax.Array, b: np.uint32) -> jax.Array:
    """The high 32 bits of the 64-bit product of uint32 ``a`` and ``b``."""
    b0, b1 = np.uint32(b & 0xFFFF), np.uint32(b >> 16)
    a0, a1 = a & 0xFFFF, a >> 16
    t = a0 * b0
    t = a1 * b0 + (t >> 16)
    w1, w2 = t & 0xFFFF, t >> 16
    t = a0 * b1 + w1
    return a1 * b1 + w2 + (t >> 16)


def sampled(ids: jax.Array, bits: int) -> jax.Array:
    """Whether each non-negative int32 id is in the adaptive policy's
    sample: the top ``bits`` bits of its 64-bit Fibonacci hash are zero
    (``kernels._sampled``), computed in 32-bit words.

    Examples:
      >>> import jax.numpy as jnp
      >>> sampled(jnp.arange(8, dtype=jnp.int32), 1).tolist()
      [True, False, True, False, True, True, False, True]
    """
    if bits == 0:
        return jnp.ones(ids.shape, bool)
    a = ids.astype(jnp.uint32)
    high = _mulhi_u32(a, _GOLDEN_LO) + a * _GOLDEN_HI
    return (high >> np.uint32(32 - bits)) == 0


def _adaptive_key(age: jax.Array, weight: jax.Array, bonus: jax.Array, offset: jax.Array):
    """``256 age + bonus * log2_fixed(weight) + offset``, or ``weight +
    offset`` for ``bonus < 0`` (``kernels._key``, with the plan index
    relative to the base: ``age = t - base``), within ``[KEY_FLOOR,
    KEY_CEIL]``. No step overflows: ``|age| <= 2 KEY_SPAN``,
    ``bonus * log2 < 2^26``, ``|offset| < 2^31 - KEY_CEIL`` (a re-key's
    shift, ``_rekey_device``) and a count is at most ``2^31 - 1``."""
    keyed = 256 * age + bonus * log2_fixed(weight)
    value = jnp.where(bonus < 0, weight, keyed)
    summed = jnp.where(
        offset >= 0, jnp.minimum(value, KEY_CEIL - offset) + offset, value + jnp.minimum(offset, 0)
    )
    return jnp.clip(summed, KEY_FLOOR, KEY_CEIL)


def _saturating_add(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.minimum(a, _INT32_MAX - b) + b


def dedupe(values: jax.Array, valid: jax.Array, weights: jax.Array):
    """Distinct ``values`` in order of first appearance, by one stable sort.

    Args:
      values: ``int32 [m]``.
      valid: ``bool [m]``: entries to count (others are padding).
      weights: ``int32 [m]``: what each entry adds to its distinct value's count.

    Returns:
      ``(distinct, inverse, count, lookups)``: ``int32 [m]`` the distinct
      values in order of first appearance (``-1`` after ``count``); ``int32
      [m]`` each entry's index into them (``-1`` for padding); the number of
      distinct values; ``int32 [m]`` the weights summed per distinct value.

    Examples:
      >>> import jax.numpy as jnp
      >>> v = jnp.array([7, 3, 7, 9, 3], jnp.int32)
      >>> d, inv, count, w = dedupe(v, v != 9, jnp.ones(5, jnp.int32))
      >>> d.tolist(), inv.tolist(), int(count), w.tolist()
      ([7, 3, -1, -1, -1], [0, 1, 0, -1, 1], 2, [2, 2, 0, 0, 0])
    """
    m = values.shape[0]
    keys = jnp.where(valid, values, _INT32_MAX)
    # Two operands compared by the first alone: XLA runs that as a radix
    # sort on GPUs (CUB); a third operand or a second key would make it a
    # comparison sort. The weights follow by a gather.
    sorted_keys, positions = lax.sort((keys, lax.iota(jnp.int32, m)), num_keys=1, is_stable=True)
    new_run = jnp.concatenate([jnp.ones(1, bool), sorted_keys[1:] != sorted_keys[:-1]])
    at, inverse, count, lookups = _by_appearance(
        positions, new_run, sorted_keys != _INT32_MAX, weights
    )
    distinct = jnp.full(m, -1, jnp.int32).at[at].set(sorted_keys, mode="drop", unique_indices=True)
    return distinct, inverse, count, lookups


def dedupe_wide(low: jax.Array, high: jax.Array, valid: jax.Array, weights: jax.Array):
    """``dedupe`` of 64-bit values given as two int32 words (raw ids), by two
    stable sorts of two operands each: low word, then high word, so that XLA
    radix-sorts both on GPUs.

    Returns:
      ``(low, high, inverse, count, lookups)``: the distinct values' words
      (``[m]``, valid up to ``count``), each entry's index into them
      (``-1`` where not ``valid``), their number and summed ``weights``.

    Examples:
      >>> import jax.numpy as jnp
      >>> lo = jnp.array([7, 3, 7, 7, 3], jnp.int32)
      >>> hi = jnp.array([1, 0, 1, 2, 0], jnp.int32)
      >>> d_lo, d_hi, inv, count, w = dedupe_wide(lo, hi, lo != 0, jnp.ones(5, jnp.int32))
      >>> d_lo[:3].tolist(), d_hi[:3].tolist(), inv.tolist(), int(count), w[:3].tolist()
      ([7, 3, 7], [1, 0, 2], [0, 1, 0, 2, 1], 3, [2, 2, 1])
    """
    m = low.shape[0]
    _, first = lax.sort((low, lax.iota(jnp.int32, m)), num_keys=1, is_stable=True)
    _, positions = lax.sort((high[first], first), num_keys=1, is_stable=True)
    s_low, s_high, real = low[positions], high[positions], valid[positions]
    # Invalid entries sort among the values (any int64 is a raw id), so a
    # run starts at every change of value or of validity.
    changed = (s_low[1:] != s_low[:-1]) | (s_high[1:] != s_high[:-1]) | (real[1:] != real[:-1])
    new_run = jnp.concatenate([jnp.ones(1, bool), changed])
    at, inverse, count, lookups = _by_appearance(positions, new_run, real, weights)
    d_low = jnp.zeros(m, jnp.int32).at[at].set(s_low, mode="drop", unique_indices=True)
    d_high = jnp.zeros(m, jnp.int32).at[at].set(s_high, mode="drop", unique_indices=True)
    return d_low, d_high, inverse, count, lookups


def _by_appearance(positions, new_run, real, weights):
    """The dedupe of values a stable sort put in order (``positions``: each
    sorted entry's place; ``new_run``: where a run of equal values starts;
    ``real``: sorted entries to count). A stable sort puts each value's
    first place at its run's head, so the heads, counted in place order,
    number the values by appearance.

    Returns ``(at, inverse, count, lookups)``: each sorted entry's distinct
    index where it heads a run (``m`` elsewhere), each entry's distinct
    index (``-1`` if not real), the count, and ``weights`` summed per value."""
    m = positions.shape[0]
    head = real & new_run
    first = jnp.zeros(m, jnp.int32).at[positions].set(head.astype(jnp.int32), unique_indices=True)
    appearance = jnp.cumsum(first) - 1
    run = jnp.cumsum(new_run.astype(jnp.int32)) - 1
    run_rank = (
        jnp.zeros(m, jnp.int32)
        .at[jnp.where(head, run, m)]
        .set(appearance[positions], mode="drop", unique_indices=True)
    )
    rank = jnp.where(real, run_rank[run], -1)
    inverse = jnp.zeros(m, jnp.int32).at[positions].set(rank, unique_indices=True)
    drop = jnp.where(real, rank, m)
    lookups = (
        jnp.zeros(m, jnp.int32).at[drop].add(jnp.where(real, weights[positions], 0), mode="drop")
    )
    return jnp.where(head, rank, m), inverse, jnp.sum(head, dtype=jnp.int32), lookups


def home_device(ids: Any, devices: int, processes: int) -> Any:
    """The home device of each id (``Layout.device_of``): of an array of
    ids, or of one Python int."""
    residue = ids % devices
    per_process = devices // processes
    return (residue % processes) * per_process + residue // processes


# ------------------------------------------------------------------ the plan
def _source(spec: PlanSpec, ids: jax.Array, axis: str):
    """Step 1 on one device: its slice's distinct ids, sent home (local ids;
    raw ids as their two words, homed by bucket).

    Returns ``(bad, bad_at, real, route, k_need, received, received_counts)``,
    ``received`` a tuple of ``[n K]`` arrays (the local ids, or the words).
    """
    n, k = spec.devices, spec.per_destination
    vocabulary = spec.vocabulary
    words = ids.reshape(-1, 2) if spec.wide else ids.reshape(-1, 1)
    positions_in = words.shape[0]
    # An empty slice plans as one padding id (no array below is empty); its
    # route is cut back to nothing.
    empty = positions_in == 0
    if empty:
        words = jnp.zeros((1, words.shape[1]), jnp.int32)
    if spec.wide:
        low, high = words[:, 0], words[:, 1]
        fits = high == (low >> 31)  # the int64 value is an int32
        flat = low
    else:
        flat = words[:, 0]
        fits = jnp.ones(flat.shape, bool)
    m = flat.shape[0]
    if empty:
        padding = jnp.ones(m, bool)
    elif spec.pad is None:
        padding = jnp.zeros(m, bool)
    elif spec.wide:
        pad_low, pad_high = np.array([spec.pad], np.int64).view(np.int32)
        padding = (low == pad_low) & (high == pad_high)
    elif np.iinfo(np.int32).min <= spec.pad <= _INT32_MAX:
        padding = flat == spec.pad
    else:  # int32 ids never hold it
        padding = jnp.zeros(m, bool)
    if vocabulary is not None:  # any int64 is a raw id
        valid = ~padding
    else:
        valid = fits & (flat >= 0) & (flat < spec.num_embeddings) & ~padding
    bad = ~valid & ~padding
    positions = lax.iota(jnp.int32, m)
    bad_at = jnp.min(jnp.where(bad, positions, m))
    ones = jnp.ones(m, jnp.int32)
    if vocabulary is not None:
        d_low, d_high, inverse, count, lookups = dedupe_wide(low, high, valid, ones)
        values: tuple[jax.Array, ...] = (d_low, d_high)
        homed = device_vocabulary.bucket_of(vocabulary, d_low, d_high)
    else:
        distinct, inverse, count, lookups = dedupe(flat, valid, ones)
        values = (distinct // n,)  # local ids; -1 stays -1
        homed = distinct
    live = lax.iota(jnp.int32, m) < count
    if n == 1:
        home = jnp.where(live, 0, 1)
        rank = lax.iota(jnp.int32, m)
        k_need = count
    else:
        home = jnp.where(live, home_device(homed, n, spec.processes), n)
        by_home, order = lax.sort((home, lax.iota(jnp.int32, m)), num_keys=1, is_stable=True)
        per_home = jnp.zeros(n, jnp.int32).at[home].add(1, mode="drop")
        start = jnp.cumsum(per_home) - per_home
        ranked = lax.iota(jnp.int32, m) - start[jnp.minimum(by_home, n - 1)]
        rank = jnp.zeros(m, jnp.int32).at[order].set(ranked, unique_indices=True)
        k_need = jnp.max(per_home)
    send_home = jnp.where(live & (rank < k), home, n)
    # Unsent places: -1 (no local id); raw ids are told apart by a count of 0.
    sends = [
        jnp.full((n, k), -1, jnp.int32).at[send_home, rank].set(x, mode="drop") for x in values
    ]
    send_counts = jnp.zeros((n, k), jnp.int32).at[send_home, rank].set(lookups, mode="drop")
    row = jnp.maximum(inverse, 0)
    route = jnp.where(inverse >= 0, home[row] * k + rank[row], n * k)
    if n > 1:
        sends = [lax.all_to_all(x, axis, 0, 0, tiled=True) for x in sends]
        send_counts = lax.all_to_all(send_counts, axis, 0, 0, tiled=True)
    real = jnp.sum(valid, dtype=jnp.int32)
    return jnp.any(bad), bad_at, real, route[:positions_in], k_need, tuple(sends), send_counts


def _room(spec: PlanSpec, state: PlanState, hits, t, finished, count):
    """Victims for ``count`` misses, and how many slots are free of in-flight
    batches (``C_l`` less the slots used by plans after ``finished`` or by
    this batch's ``hits``): the ``count`` such slots of lowest ``(key,
    slot)``, by slot, padded to ``P`` with ``C_l``. A free slot comes
    first, else the policy's priority (``last_use`` for LRU). Only plans
    with misses run it: its ``O(C_l)`` passes and sort are the plan's only
    work that grows with the capacity."""
    cl, p = spec.local_capacity, spec.misses
    last_use = state.last_use.at[hits].set(t, mode="drop")
    protected = last_use > finished
    available = cl - jnp.sum(protected, dtype=jnp.int32)
    priority = state.last_use if state.keys is None else state.keys
    # One key, so that the sort is a radix sort on GPUs (see ``dedupe``):
    # free slots first, then the rest by priority, protected ones last.
    key = jnp.where(
        protected,
        _INT32_MAX,
        jnp.where(state.id_of_slot < 0, _INT32_MIN, jnp.minimum(priority, _INT32_MAX - 1)),
    )
    _, order = lax.sort((key, lax.iota(jnp.int32, cl)), num_keys=1, is_stable=True)
    victims = jnp.sort(jnp.where(lax.iota(jnp.int32, p) < count, order[:p], cl))
    return victims, available


def _plan_device(spec: PlanSpec, axis: str, state: PlanState, ids, args):
    """``plan``'s body on one device of ``axis`` (inside ``shard_map``)."""
    n, k, cl, p = spec.devices, spec.per_destination, spec.local_capacity, spec.misses
    nl = spec.local_rows
    v = spec.received
    t, finished, train, epoch, admit_finished, bonus, step = (args[i] for i in range(7))
    scalars = state.scalars
    fresh = epoch > scalars[0]
    skipped = (scalars[1] != 0) & ~fresh

    # 1. source: distinct ids, sent home
    bad, bad_at, real, route, k_need, received, received_counts = _source(spec, ids, axis)

    # 2. owner: distinct ids over every source, looked up
    counts_in = received_counts.reshape(-1)
    if spec.vocabulary is None:
        entries = received[0].reshape(-1)
        sent = entries >= 0
    else:
        # One more entry, never sent: the shared row's place (``overflow``).
        pad = jnp.zeros(spec.overflow, jnp.int32)
        entries_low, entries_high = (jnp.concatenate([x.reshape(-1), pad - 1]) for x in received)
        counts_in = jnp.concatenate([counts_in, pad])
        sent = counts_in > 0
    if n == 1:  # the source's distinct ids are the owner's
        owner_inverse = jnp.where(sent, lax.iota(jnp.int32, v), -1)
        distinct = jnp.sum(sent, dtype=jnp.int32)
        lookups = counts_in
        if spec.vocabulary is None:
            uniq = entries
        else:
            uniq_low, uniq_high = entries_low, entries_high
    elif spec.vocabulary is None:
        uniq, owner_inverse, distinct, lookups = dedupe(entries, sent, counts_in)
    else:
        uniq_low, uniq_high, owner_inverse, distinct, lookups = dedupe_wide(
            entries_low, entries_high, sent, counts_in
        )
    live = lax.iota(jnp.int32, v) < distinct
    # The owner's lists span its received distinct ids, admitted or not: an
    # id refused leaves a hole, and ``compact`` cuts them at this count.
    spanned = distinct
    learner_sample = jnp.zeros(v, bool)
    if spec.learns:  # every distinct raw id homed here, admitted or not
        assert spec.vocabulary is not None
        learner_sample = (
            live
            & (train != 0)
            & device_vocabulary.learner_sample(spec.vocabulary, uniq_low, uniq_high)
        )
        sample_lookups = lookups
    new = jnp.zeros(v, bool)
    full = jnp.zeros((), bool)
    admitted = None
    if spec.vocabulary is not None:
        # Raw ids to the rows of their buckets: ids not admitted have none
        # and read zeros, like padding.
        assert state.vocabulary is not None
        admitted = device_vocabulary.admit(
            spec.vocabulary,
            state.vocabulary,
            uniq_low,
            uniq_high,
            lookups,
            live,
            step,
            admit_finished,
            train,
            bonus,
        )
        uniq = admitted.rows
        rowless = live & (uniq < 0)
        live = live & (uniq >= 0)
        new, full = admitted.new & live, admitted.full
        if spec.vocabulary.shared:
            # The ids without a row read the shared row, one more distinct
            # row of its home device, looked up as often as they are.
            uniq, live, lookups, shared_at, reads = _shared_entry(
                spec, axis, uniq, live, lookups, rowless, spanned
            )
            spanned = spanned + (shared_at < v)
        distinct = jnp.sum(live, dtype=jnp.int32)
        lookups = jnp.where(live, lookups, 0)
    slot = state.slot_of_id.at[jnp.where(live, uniq, nl)].get(mode="fill", fill_value=-1)
    # A row given to a new id now may be resident with its old id's values:
    # it is fetched again into its own slot.
    again = live & new & (slot >= 0)
    hit = live & (slot >= 0) & ~again
    miss = live & (slot < 0)
    hits = jnp.sum(hit, dtype=jnp.int32)
    misses = jnp.sum(miss, dtype=jnp.int32)
    refetched = jnp.sum(again, dtype=jnp.int32)
    victims, available = lax.cond(
        misses > 0,
        functools.partial(_room, spec),
        lambda *_: (jnp.full(p, cl, jnp.int32), jnp.int32(cl)),
        state,
        jnp.where(hit | again, slot, cl),
        t,
        finished,
        misses,
    )
    per_slot_lookups = jnp.where(hit, lookups, 0)
    access_hits = jnp.sum(per_slot_lookups)
    if spec.policy == "adaptive":
        sample = live & sampled(jnp.maximum(uniq, 0), spec.sample_bits)
    else:
        sample = jnp.zeros(v, bool)
    sample_count = jnp.sum(sample, dtype=jnp.int32)

    # A source with more distinct ids for one owner than it has slots (its
    # ranks past ``K`` were not sent) fails the batch as its owner would.
    too_many = (distinct > cl) | (k_need > k)
    no_room = ~too_many & (misses > available)
    fetches = misses + refetched
    needs = jnp.stack([k_need, spanned, fetches, real])
    flags = jnp.stack([bad, too_many, no_room, full]).astype(jnp.int32)
    if n > 1:
        flags = lax.pmax(flags, axis)
        needs = lax.pmax(needs, axis)
    status = (
        flags[0] * BAD_ID + flags[1] * TOO_MANY + flags[2] * NO_ROOM + flags[3] * VOCABULARY_FULL
    ).astype(jnp.int32)
    status = jnp.where(skipped, SKIPPED, status)
    ok = status == 0

    # 3. the directory (every write dropped unless ``ok``)
    victims = jnp.where(ok, victims, cl)
    miss_rank = jnp.cumsum(miss.astype(jnp.int32)) - 1
    placed = victims.at[jnp.where(miss, miss_rank, p)].get(mode="fill", fill_value=cl)
    unique_slots = jnp.where(hit | again, slot, jnp.where(miss, placed, cl))
    # The swap's fetches: the misses into their victims, then the rows
    # fetched again into their own slots.
    again_at = misses + jnp.cumsum(again.astype(jnp.int32)) - 1
    fetch_slots = victims.at[jnp.where(again & ok, again_at, p)].set(slot, mode="drop")
    fetch_ids = jnp.full(p, -1, jnp.int32).at[jnp.where(miss, miss_rank, p)].set(uniq, mode="drop")
    fetch_ids = jnp.where(victims < cl, fetch_ids, -1)
    old = state.id_of_slot.at[victims].get(mode="fill", fill_value=-1)
    evicted = old >= 0
    dirty_out = evicted & state.dirty.at[victims].get(mode="fill", fill_value=False)
    out_rank = jnp.where(dirty_out, jnp.cumsum(dirty_out.astype(jnp.int32)) - 1, p)
    evict_slots = jnp.full(p, cl, jnp.int32).at[out_rank].set(victims, mode="drop")

    used = jnp.where(ok, unique_slots, cl)
    fetched = jnp.where(victims < cl, fetch_ids, nl)
    slot_of_id = state.slot_of_id.at[jnp.where(evicted, old, nl)].set(-1, mode="drop")
    slot_of_id = slot_of_id.at[fetched].set(victims, mode="drop")
    id_of_slot = state.id_of_slot.at[victims].set(fetch_ids, mode="drop")
    dirty = state.dirty.at[victims].set(False, mode="drop")
    dirty = dirty.at[jnp.where(train != 0, used, cl)].set(True, mode="drop")
    last_use = state.last_use.at[used].set(t, mode="drop")

    per_id, keys, slot_prior = state.per_id, state.keys, state.slot_prior
    base = scalars[4]
    counted = jnp.where(ok & live, uniq, nl)
    counts = jnp.zeros(v, jnp.int32)
    if spec.counting:
        assert per_id is not None
        # A row given to a new id counts that id's lookups only.
        before = jnp.where(new, 0, per_id.at[counted].get(mode="fill", fill_value=0))
        counts = _saturating_add(before, lookups)
        per_id = per_id.at[counted].set(counts, mode="drop")
    if spec.policy == "lfu":
        assert keys is not None
        keys = keys.at[used].set(counts, mode="drop")
    elif spec.policy == "frequency":
        assert keys is not None and per_id is not None
        keys = keys.at[victims].set(per_id.at[fetched].get(mode="fill", fill_value=0), mode="drop")
    elif spec.policy == "adaptive":
        assert keys is not None
        weight = counts
        if spec.prior:
            assert slot_prior is not None and state.prior is not None
            slot_prior = slot_prior.at[victims].set(
                state.prior.at[fetched].get(mode="fill", fill_value=0), mode="drop"
            )
            weight = jnp.maximum(weight, slot_prior.at[used].get(mode="fill", fill_value=0))
        key = _adaptive_key(t - base, jnp.maximum(weight, 1), scalars[2], scalars[3])
        keys = keys.at[used].set(key, mode="drop")
        # The base moves up (keys by time only: a bonus >= 0).
        rebase = ok & (scalars[2] >= 0) & (t - base >= 2 * spec.key_span)
        shift = jnp.where(rebase, 256 * spec.key_span, 0)
        keys = jnp.maximum(keys - shift, KEY_FLOOR)
        base = jnp.where(rebase, base + spec.key_span, base)

    # The host's lists, packed: fetches, dirty evictions, sample, its
    # counts, and the rows given to raw ids now with those ids' words.
    written = jnp.sum(dirty_out, dtype=jnp.int32)
    size = spec.lists
    lists = jnp.zeros(size, jnp.int32)
    lists = lists.at[jnp.where(miss, miss_rank, size)].set(uniq, mode="drop")
    lists = lists.at[jnp.where(again, again_at, size)].set(uniq, mode="drop")
    lists = lists.at[jnp.where(dirty_out, fetches + out_rank, size)].set(old, mode="drop")
    sample_rank = jnp.cumsum(sample.astype(jnp.int32)) - 1
    at = jnp.where(sample, fetches + written + sample_rank, size)
    lists = lists.at[at].set(uniq, mode="drop")
    lists = lists.at[jnp.where(sample, at + sample_count, size)].set(counts, mode="drop")
    new_count = jnp.sum(new, dtype=jnp.int32)
    vocabulary = state.vocabulary
    forgotten = refused = jnp.int32(0)
    if admitted is not None:
        new_at = jnp.where(new, fetches + written + 2 * sample_count + jnp.cumsum(new) - 1, size)
        lists = lists.at[new_at].set(uniq, mode="drop")
        lists = lists.at[jnp.where(new, new_at + new_count, size)].set(uniq_low, mode="drop")
        lists = lists.at[jnp.where(new, new_at + 2 * new_count, size)].set(uniq_high, mode="drop")
        if spec.learns:
            learner_at = jnp.where(
                learner_sample,
                fetches + written + 2 * sample_count + 3 * new_count
                + jnp.cumsum(learner_sample) - 1,
                size,
            )  # fmt: skip
            learner_count = jnp.sum(learner_sample, dtype=jnp.int32)
            lists = lists.at[learner_at].set(uniq_low, mode="drop")
            lists = lists.at[jnp.where(learner_sample, learner_at + learner_count, size)].set(
                uniq_high, mode="drop"
            )
            lists = lists.at[jnp.where(learner_sample, learner_at + 2 * learner_count, size)].set(
                sample_lookups, mode="drop"
            )
        assert vocabulary is not None
        vocabulary = admitted.commit(vocabulary, ok)
        forgotten, refused = admitted.forgotten, admitted.refused

    new_scalars = jnp.stack(
        [
            jnp.where(fresh, epoch, scalars[0]),
            jnp.where(ok, 0, 1).astype(jnp.int32),
            scalars[2],
            scalars[3],
            base,
        ]
    )
    new_state = PlanState(
        slot_of_id,
        id_of_slot,
        last_use,
        dirty,
        per_id,
        state.prior,
        keys,
        slot_prior,
        new_scalars,
        vocabulary,
    )

    # The route: what each source asks this owner for, and where each
    # gradient it sends back adds.
    routed = owner_inverse[: n * k]
    entry_slot = unique_slots.at[jnp.maximum(routed, 0)].get(mode="fill", fill_value=cl)
    requests = jnp.where(routed >= 0, entry_slot, cl).reshape(1, n, k)
    owner_route = jnp.where(owner_inverse >= 0, owner_inverse, v)
    overflow = jnp.zeros((1, 0), jnp.int32)
    if spec.vocabulary is not None:
        # Each source's ids without a row read padding, or the shared row
        # (the overflow row), not their place in the route: the owners say
        # which, back along it.
        said = jnp.where(routed >= 0, rowless.at[jnp.maximum(routed, 0)].get(mode="fill"), False)
        told = said.astype(jnp.int32).reshape(n, k)
        if n > 1:
            told = lax.all_to_all(told, axis, 0, 0, tiled=True)
        unrowed = told.reshape(-1).at[route].get(mode="fill", fill_value=0) > 0
        padding = n * k + spec.overflow
        route = jnp.where(route >= n * k, padding, jnp.where(unrowed, n * k, route))
    if spec.overflow:
        owner_route = owner_route.at[n * k].set(shared_at)
        here = unique_slots.at[shared_at].get(mode="fill", fill_value=0)
        mine = jnp.where(shared_at < v, lax.axis_index(axis) * cl + here, 0)
        if n > 1:
            mine = lax.psum(mine, axis)
        overflow = jnp.where(reads > 0, mine, -1).reshape(1, 1)
    info = jnp.stack(
        [
            status,
            k_need,
            distinct,
            hits,
            fetches,
            jnp.sum(lookups),
            access_hits,
            jnp.sum(evicted, dtype=jnp.int32),
            written,
            sample_count,
            available,
            bad_at,
            real,
            needs[0],
            needs[1],
            needs[2],
            needs[3],
            new_count,
            forgotten,
            refused,
            jnp.sum(learner_sample, dtype=jnp.int32),
        ]
    ).astype(jnp.int32)
    out = PlanOut(
        info[None],
        requests,
        route.reshape(ids.shape[:-1] if spec.wide else ids.shape),
        unique_slots[None],
        owner_route[None],
        lists,
        fetch_slots,
        evict_slots,
        jnp.where(live, slot, -1)[None],
        overflow,
    )
    return new_state, out


def _shared_entry(spec: PlanSpec, axis: str, uniq, live, lookups, rowless, spanned):
    """The shared row of a vocabulary as one more distinct row of its home
    device, at its first unused entry (``spanned``), when any device has
    ids without a row: their lookups are its lookups.

    Returns ``(uniq, live, lookups, at, reads)``: the owner's entries with
    it, its entry (``V`` on the other devices and when no id reads it) and
    how many lookups read it over every device."""
    vocabulary = spec.vocabulary
    assert vocabulary is not None
    n, v = spec.devices, uniq.shape[0]
    row = vocabulary.rows  # the host row past the vocabulary's
    home = home_device(row, n, spec.processes)
    reads = jnp.sum(jnp.where(rowless, lookups, 0))
    if n > 1:
        reads = lax.psum(reads, axis)
    put = (lax.axis_index(axis) == home) & (reads > 0)
    at = jnp.where(put, spanned, v)
    place = lax.iota(jnp.int32, v) == at
    uniq = jnp.where(place, row // n, uniq)
    return uniq, live | place, jnp.where(place, reads, lookups), at, reads


# The programs of the latest specs are kept, so that every cache with the same
# configuration shares them; each batch shape (``slice_ids``) compiles its
# own, so a stream of ever new shapes is bounded by these counts.
@functools.lru_cache(maxsize=128)
def make_plan(spec: PlanSpec, mesh: Mesh, axis: str):
    """The jitted plan program for ``spec`` over ``mesh``'s ``axis``.

    ``plan(state, ids, args) -> (state, PlanOut)``: ``state`` is donated;
    ``ids`` are the batch's ids split over ``axis`` (int32, or two words
    each when ``spec.wide``); ``args`` is ``int32 [7]``, replicated:
    ``(plan index, finished, train, epoch, admit_finished, bonus, step)``:
    plans up to ``finished`` no longer protect their slots; ``epoch`` above
    the state's clears a failure; the vocabulary ages ids by ``step``, the
    plan's training step (``TrainingClock``), holds the rows of steps after
    ``admit_finished``, and forgets by ``bonus`` (``"lrfu"``,
    ``"adaptive"``).
    """
    rows = PartitionSpec(axis)
    body = functools.partial(_plan_device, spec, axis)
    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(rows, rows, PartitionSpec()),
        out_specs=(rows, rows),
        check_vma=False,
    )
    return jax.jit(mapped, donate_argnums=0)


def _compact_device(
    k2: int,
    v2: int,
    p2: int,
    r2: int,
    requests,
    inverse,
    owner_slots,
    owner_inverse,
    fetch_slots,
    evict_slots,
    overflow,
):
    """``compact``'s body on one device."""
    _, n, k = requests.shape
    v = owner_slots.shape[1]
    requests = requests[:, :, :k2]
    # Past the routes: the overflow rows, then padding.
    inverse = jnp.where(inverse >= n * k, inverse - n * k + n * k2, inverse // k * k2 + inverse % k)
    routed = owner_inverse[:, : n * k].reshape(n, k)[:, :k2].reshape(1, -1)
    owner_inverse = jnp.concatenate([routed, owner_inverse[:, n * k :]], axis=1)
    owner_inverse = jnp.where(owner_inverse >= v, v2, owner_inverse)
    out = (
        requests,
        inverse,
        owner_slots[:, :v2],
        owner_inverse,
        fetch_slots[:p2],
        evict_slots[:p2],
        overflow[0],
    )
    if not r2:
        return out
    # Where the real ids are in the slice (``Lookup.positions``), in order.
    flat = inverse.reshape(-1)
    real = flat < n * k2 + overflow.shape[1]
    at = jnp.where(real, jnp.cumsum(real.astype(jnp.int32)) - 1, r2)
    positions = (
        jnp.full(r2, flat.size, jnp.int32).at[at].set(lax.iota(jnp.int32, flat.size), mode="drop")
    )
    return (*out, positions[None])


@functools.lru_cache(maxsize=512)
def make_compact(
    mesh: Mesh, axis: str, per_destination: int, owner: int, moves: int, positions: int
):
    """``compact(requests, inverse, owner_slots, owner_inverse, fetch_slots,
    evict_slots, overflow)``: a plan's route and swap lists cut to the
    padded sizes its batch needs: ``K'`` ranks per source and owner
    (``per_destination``), ``V'`` distinct rows per owner (``owner``) and
    ``P'`` moved rows per device (``moves``), and ``Lookup.overflow``
    (replicated). Slices and an index remap, on each device. With
    ``positions`` (bags with padding), an eighth output: ``int32 [n,
    positions]``, where each device's ids that read a row are in its slice
    (``Lookup.positions``)."""
    rows = PartitionSpec(axis)
    body = functools.partial(_compact_device, per_destination, owner, moves, positions)
    outputs = (rows,) * 6 + (PartitionSpec(),) + ((rows,) if positions else ())
    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(rows,) * 7, out_specs=outputs, check_vma=False
    )
    return jax.jit(mapped)


def _rekey_device(span: int, state: PlanState, bonus) -> PlanState:
    """``rekey``'s body on one device."""
    bonus = bonus[0]
    scalars = state.scalars
    assert state.per_id is not None and state.keys is not None
    resident = state.id_of_slot >= 0
    ids = jnp.maximum(state.id_of_slot, 0)
    weight = jnp.maximum(state.per_id.at[ids].get(mode="fill", fill_value=0), 1)
    if state.slot_prior is not None:
        weight = jnp.maximum(weight, state.slot_prior)
    # Keys by time: the base ``span`` plans before the newest row's.
    newest = jnp.max(jnp.where(resident, state.last_use, 0))
    base = jnp.where(bonus < 0, scalars[4], jnp.maximum(newest - span, 0))
    age = jnp.maximum(state.last_use - base, -2 * KEY_SPAN)
    new = _adaptive_key(age, weight, bonus, jnp.int32(0))
    # Every key and the plans' keys to come move by one shift (the order is
    # all that counts): the highest resident key goes to ``_KEY_TOP`` (none
    # resident: no shift, so that new keys keep their room below the ceiling).
    top = jnp.max(jnp.where(resident, new, KEY_FLOOR))
    offset = jnp.where(jnp.any(resident), _KEY_TOP - top, 0)
    keys = jnp.where(resident, jnp.clip(new + offset, KEY_FLOOR, KEY_CEIL), state.keys)
    return state._replace(
        keys=keys, scalars=jnp.stack([scalars[0], scalars[1], bonus, offset, base])
    )


@functools.cache
def make_rekey(mesh: Mesh, axis: str, span: int = KEY_SPAN):
    """``rekey(state, bonus) -> state`` (donated): each device's adaptive
    policy takes its bonus of ``bonus`` (``int32 [n]``, split over the
    axis); every resident row is keyed afresh under it, and all keys, the
    plans' to come included, move by one common shift that puts the
    highest at ``2^29`` (the host planner lifts its keys so that none
    decreases; either way only their order counts)."""
    rows = PartitionSpec(axis)
    mapped = jax.shard_map(
        functools.partial(_rekey_device, span),
        mesh=mesh,
        in_specs=(rows, rows),
        out_specs=rows,
        check_vma=False,
    )
    return jax.jit(mapped, donate_argnums=0)


def _clean_device(state: PlanState, released) -> PlanState:
    """``clean``'s body on one device."""
    return state._replace(dirty=state.dirty & (state.last_use > released[0]))


@functools.cache
def make_clean(mesh: Mesh, axis: str):
    """``clean(state, released) -> state`` (donated): rows of plans up to
    ``released`` (``int32 [1]``, replicated) are marked clean (after a flush
    wrote them back); rows of plans in flight stay dirty, since their step
    may still change them."""
    rows = PartitionSpec(axis)
    mapped = jax.shard_map(
        _clean_device, mesh=mesh, in_specs=(rows, PartitionSpec()), out_specs=rows, check_vma=False
    )
    return jax.jit(mapped, donate_argnums=0)
