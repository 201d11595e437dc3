"""Compiled loops of the planner's per-id passes (Numba, GIL released).

A plan touches every id position of a batch (hundreds of thousands for
multi-hot bags, most of them padding). In NumPy that is a dozen full passes
(range check, padding mask, compress, directory gather, distinct, inverse,
expand) with a temporary array each; here it is one pass. The loops release
the GIL, so the pipeline's producer thread plans while the training thread
dispatches.

Scratch arrays (``rank``, ``mark``) are indexed by slot and only read where
the same call wrote them; ``mark[s] == stamp`` means slot ``s`` is protected
in the plan being made (``stamp`` grows by one per plan, so old marks never
match).

``IdIndex`` finds a few thousand ids among a few thousand others (the rows a
batch fetches among those a pending write-back holds) by hashing, where a
binary search per id cost several times as much.

``split_by_home``, ``lookup_entries``, ``owner_route`` and ``fill_inverse``
are the per-id passes of a batch whose rows are split over several devices
(``jaxcache._src.partitions``): one source slice or one home partition per
call, so calls for different slices or partitions run on different threads.

``copy_rows`` moves a step's rows between the host table and the staging
buffers or read-outs: NumPy's fancy indexing of 2-D arrays goes element by
element.

``adaptive_keys``, ``adaptive_record``, ``shadow_step`` and ``shadow_rekey``
are the per-id passes of the ``"adaptive"`` policy (see
``policies.AdaptivePolicy``): its keys, its counts, and the small shadow
caches it learns from.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.cpython.unsafe.numbers import leading_zeros, trailing_zeros
from numba.extending import intrinsic

from jaxcache._src.compiled import kernel

__all__ = [
    "IdIndex",
    "adaptive_keys",
    "adaptive_record",
    "as_index_array",
    "choose_victims",
    "copy_rows",
    "distinct_ranks",
    "fill_inverse",
    "fill_negative",
    "lookup",
    "lookup_entries",
    "mark_new",
    "owner_route",
    "place_rows",
    "real_positions",
    "region",
    "reserve_candidates",
    "restore_misses",
    "sample_ids",
    "shadow_rekey",
    "shadow_step",
    "split_by_home",
    "table_rows",
]


# How far ahead the directory passes ask for what they will read: the
# directory entry of the id ``_AHEAD`` positions on, and the slot state of the
# id ``_AHEAD_SLOT`` on (its directory entry asked for ``_AHEAD - _AHEAD_SLOT``
# positions earlier). A directory read misses the CPU caches (a random entry
# of megabytes, the caches full of the step's other work) and waits ~100 ns;
# a pass spends a few ns per id, so the reads it waits on must be asked for
# dozens of ids before. Measured in place on the scaling benchmark's batches:
# 16/8 ahead saved a quarter of the pass, 128/48 more than half.
_AHEAD = 128
_AHEAD_SLOT = 48
# Rows copied at random from or to a table of hundreds of megabytes (each a
# TLB and a cache miss) are asked for this many rows ahead: a gather of
# random 64-byte rows ran 1.2x as fast as with none asked (16 ahead: 1.1x).
_AHEAD_ROW = 32
# ``place_rows`` asks for a victim's directory entries (its old id's and its
# new id's) and the new id's count this many victims ahead: a victim costs
# a few times an id of a directory pass.
_AHEAD_VICTIM = 16


def _row_pointer(context, builder, signature, args):
    """LLVM pointer to the start of row ``args[1]`` of the array ``args[0]``
    (its element when 1-D), for the intrinsics below; no bounds check."""
    array_type, index_type = signature.args[0], signature.args[1]
    view = context.make_array(array_type)(context, builder, args[0])
    index = context.cast(builder, args[1], index_type, types.intp)  # as wide as the row's 0
    indices = [index] + [context.get_constant(types.intp, 0)] * (array_type.ndim - 1)
    return cgutils.get_item_pointer(context, builder, array_type, view, indices, wraparound=False)


def _prefetch_intrinsic(typingctx, array, index):
    """``_prefetch(array, index)``: asks the CPU to bring ``array[index]``
    (the start of row ``index`` of a 2-D array) into its caches; changes
    nothing else and never faults (``llvm.prefetch``: a read, kept in all
    cache levels)."""

    def codegen(context, builder, signature, args):
        pointer = _row_pointer(context, builder, signature, args)
        byte = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        kind = ir.FunctionType(ir.VoidType(), [byte, i32, i32, i32])
        # LLVM mangles the name with the pointer type as it needs it.
        function = cgutils.get_or_insert_function(builder.module, kind, "llvm.prefetch")
        builder.call(function, [builder.bitcast(pointer, byte), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(array, index), codegen


_prefetch: Any = intrinsic(_prefetch_intrinsic)


def as_index_array(ids: np.ndarray) -> np.ndarray:
    """``ids`` flattened, as int32 or int64 (the kernels' compiled types)."""
    flat = ids.reshape(-1)
    if flat.dtype not in (np.int32, np.int64):
        flat = flat.astype(np.int64)
    return flat


@kernel
def lookup(
    flat,
    pad,
    num_embeddings,
    slot_of_id,
    rank,
    mark,
    stamp,
    inverse,
    hits,
    hit_rows,
    miss_ids,
    miss_rows,
    counts,
):
    """Looks a batch's ids up in the directory, counting each distinct id.

    The batch's distinct ids are numbered in order of first appearance,
    hits and misses alike: their *rows*. Writes ``inverse[p]``: ``-1`` for
    padding, else the row of position ``p``'s id; ``hits[:h]``: the distinct
    hit slots (in order of appearance), marked ``stamp``, and
    ``hit_rows[:h]`` their rows; ``miss_ids[:m]``, ``miss_rows[:m]``: the
    distinct missed ids and their rows; ``counts[:h + m]``: each row's
    lookups (room for every distinct id). Misses are told apart through the
    directory itself: while a batch is being planned, ``slot_of_id`` of a
    missed id holds ``-2 - row`` (``restore_misses`` undoes it;
    ``Planner.commit`` overwrites it).

    Returns:
      ``(h, m, missed, valid, bad)``: ``missed`` missed lookups, ``valid``
      non-padding positions; ``bad`` the first position holding an id
      outside ``[0, num_embeddings)`` (then the directory is restored and
      the other outputs are incomplete), else ``-1``.
    """
    h = 0
    m = 0
    missed = 0
    valid = 0
    size = flat.size
    for p in range(size):
        if p + _AHEAD < size:
            ahead = flat[p + _AHEAD]
            if 0 <= ahead < num_embeddings:
                _prefetch(slot_of_id, ahead)
        if p + _AHEAD_SLOT < size:
            ahead = flat[p + _AHEAD_SLOT]
            if 0 <= ahead < num_embeddings:
                slot = slot_of_id[ahead]
                if slot >= 0:
                    _prefetch(mark, slot)
                    _prefetch(rank, slot)
        i = flat[p]
        if i == pad:
            inverse[p] = -1
            continue
        if i < 0 or i >= num_embeddings:
            restore_misses(slot_of_id, miss_ids, m)
            return h, m, missed, valid, p
        valid += 1
        s = slot_of_id[i]
        if s >= 0:
            if mark[s] != stamp:
                mark[s] = stamp
                rank[s] = h + m
                hits[h] = s
                hit_rows[h] = h + m
                counts[h + m] = 0
                h += 1
            r = rank[s]
        else:
            if s == -1:  # the first lookup of this miss
                r = h + m
                slot_of_id[i] = -2 - r
                miss_ids[m] = i
                miss_rows[m] = r
                counts[r] = 0
                m += 1
            else:
                r = -2 - s
            missed += 1
        counts[r] += 1
        inverse[p] = r
    return h, m, missed, valid, -1


@kernel
def lookup_entries(
    local,
    chunk_lo,
    chunk_hi,
    slot_of_id,
    rank,
    mark,
    stamp,
    source,
    source_stamp,
    hits,
    hit_rows,
    miss_ids,
    miss_rows,
    counts,
    miss_source,
    miss_rank,
    first,
    sent,
    bounds,
    ranks,
    per_source,
):
    """``lookup`` for a device partition, and the ranks of what each source sends.

    The partition's entries (real local ids, checked) come in chunks
    ``local[chunk_lo[g]:chunk_hi[g]]``, ``per_source`` chunks from each
    source in turn (source ``s``'s are ``s per_source`` to ``(s + 1)
    per_source - 1``, in order). Besides the
    distinct hits and misses with their rows and lookups (as ``lookup``:
    rows in order of first appearance, source after source; misses coded in
    the directory), it ranks the distinct ids of each source in order of
    appearance: rank ``k`` of source ``s`` is ``first[b_s + k]`` (the row;
    ``b_s = bounds[s]``, the entries of the sources before ``s``), ``sent[s]``
    how many there are, and ``ranks[j]`` each entry's rank, at the entry's own index
    ``j`` of ``local``. Row ``v`` of ``source`` (``[slots, 2]``) is slot
    ``v``'s source tag, ``source_stamp + s`` once source ``s`` sends it, and
    its rank there, the two in one cache line. From a single source (one
    device of several partitions) the ranks come out as the rows.

    The tag and the rank share a row (a hit reads three lines of slot state,
    not four), and the branch on "one source" is taken outside the loop
    (LLVM did not hoist it): together 1.2x as fast on the eight partitions
    of ``benchmarks/scaling.py``'s 8-device batch.

    The hit and miss steps are written out here and in ``lookup`` rather
    than shared: called as compiled helpers, even asked to inline, they
    made both loops about four times slower.

    Returns:
      ``(h, m, missed)``: distinct hits and misses, and lookups of misses.
    """
    h = 0
    m = 0
    missed = 0
    base = 0
    k = 0
    bounds[0] = 0
    for g in range(chunk_lo.size):
        s = g // per_source
        if g % per_source == 0:  # a source's first chunk
            k = 0
        tag = source_stamp + s
        hi = chunk_hi[g]
        for j in range(chunk_lo[g], hi):
            if j + _AHEAD < hi:
                _prefetch(slot_of_id, local[j + _AHEAD])
            if j + _AHEAD_SLOT < hi:
                slot = slot_of_id[local[j + _AHEAD_SLOT]]
                if slot >= 0:
                    _prefetch(mark, slot)
                    _prefetch(rank, slot)
                    _prefetch(source, slot)
            i = local[j]
            v = slot_of_id[i]
            if v >= 0:
                if mark[v] != stamp:
                    mark[v] = stamp
                    rank[v] = h + m
                    hits[h] = v
                    hit_rows[h] = h + m
                    counts[h + m] = 0
                    h += 1
                r = rank[v]
                counts[r] += 1
                if source[v, 0] != tag:
                    source[v, 0] = tag
                    source[v, 1] = k
                    first[base + k] = r
                    k += 1
                ranks[j] = source[v, 1]
                continue
            if v == -1:  # the first lookup of this miss
                r = h + m
                slot_of_id[i] = -2 - r
                miss_ids[m] = i
                miss_rows[m] = r
                counts[r] = 0
                miss_source[r] = -1
                m += 1
            else:
                r = -2 - v
            counts[r] += 1
            missed += 1
            if miss_source[r] != s:
                miss_source[r] = s
                miss_rank[r] = k
                first[base + k] = r
                k += 1
            ranks[j] = miss_rank[r]
        if g % per_source == per_source - 1:  # a source's last chunk
            sent[s] = k
            for c in range(g + 1 - per_source, g + 1):
                base += chunk_hi[c] - chunk_lo[c]
            bounds[s + 1] = base
    return h, m, missed


@kernel
def place_rows(
    victims,
    miss_ids,
    hits,
    slot_of_id,
    id_of_slot,
    dirty,
    last_use,
    per_id,
    per_slot,
    lookups,
    hit_rows,
    miss_rows,
    index,
    train,
    evicted_ids,
    evicted_slots,
    unique_slots,
):
    """Commits a checked batch as plan ``index``: the directory, recency,
    the policy's mirror and the sources' ranks, in one call (each call more
    lets go of the GIL and takes it back once more; see ``threads``).

    Puts misses ``miss_ids`` into slots ``victims``. Each victim's old row
    leaves the directory; those that were dirty are listed in
    ``evicted_ids`` / ``evicted_slots`` (for write-back). A new row's
    ``per_slot`` entry is copied from ``per_id`` (the policy's ``mirror``;
    empty arrays: none). The plan's distinct slots go to ``unique_slots``:
    hit ``j`` at row ``hit_rows[j]`` and victim ``q`` at ``miss_rows[q]``
    (the rows ``lookup`` numbered); each gets ``index`` as its last use, and
    is dirty if the plan trains (a new row is clean otherwise).
    With ``lookups`` (the policy counts them; else empty), each distinct
    row's lookups are added to its ``per_id`` count, and the new count
    mirrored into ``per_slot`` (LFU).

    The victims' directory entries and counts are asked for
    ``_AHEAD_VICTIM`` victims ahead, and the count goes in the same pass
    over the distinct slots as their last use: about 1.2x as fast as a pass of
    its own with no reads asked ahead, on the eight partitions of
    ``benchmarks/scaling.py``'s 8-device batch.

    Returns:
      ``(evictions, dirty evictions)``.
    """
    mirrored = per_slot.size > 0
    evictions = 0
    written = 0
    n = victims.size
    for j in range(n):
        if j + _AHEAD_VICTIM < n:
            ahead = miss_ids[j + _AHEAD_VICTIM]
            _prefetch(slot_of_id, ahead)
            if mirrored:
                _prefetch(per_id, ahead)
            old = id_of_slot[victims[j + _AHEAD_VICTIM]]
            if old >= 0:
                _prefetch(slot_of_id, old)
        v = victims[j]
        old = id_of_slot[v]
        if old >= 0:
            evictions += 1
            slot_of_id[old] = -1
            if dirty[v]:
                evicted_ids[written] = old
                evicted_slots[written] = v
                written += 1
        i = miss_ids[j]
        id_of_slot[v] = i
        slot_of_id[i] = v
        dirty[v] = False
        if mirrored:
            per_slot[v] = per_id[i]
    for j in range(hits.size):
        unique_slots[hit_rows[j]] = hits[j]
    for j in range(n):
        unique_slots[miss_rows[j]] = victims[j]
    u = unique_slots.size
    if lookups.size:
        for k in range(u):
            if k + _AHEAD < u:
                _prefetch(id_of_slot, unique_slots[k + _AHEAD])
            if k + _AHEAD_SLOT < u:
                _prefetch(per_id, id_of_slot[unique_slots[k + _AHEAD_SLOT]])
            s = unique_slots[k]
            last_use[s] = index
            if train:
                dirty[s] = True
            i = id_of_slot[s]
            c = per_id[i] + lookups[k]
            per_id[i] = c
            per_slot[s] = c
    else:
        for s in unique_slots:
            last_use[s] = index
            if train:
                dirty[s] = True
    return evictions, written


@kernel
def restore_misses(slot_of_id, miss_ids, m):
    """Clears the codes ``lookup`` left in the directory for ``miss_ids[:m]``."""
    for q in range(m):
        slot_of_id[miss_ids[q]] = -1


@kernel
def mark_new(slots, mark, stamp, group_capacity, counts):
    """Marks ``slots`` with ``stamp``; adds the newly marked ones per group to ``counts``."""
    for s in slots:
        if mark[s] != stamp:
            mark[s] = stamp
            counts[s // group_capacity] += 1


@kernel
def _select(keys, n, lo, hi, rank):
    """The key of rank ``rank`` (from 0) among ``keys[:n]``, all in ``[lo,
    hi]``, and how many keys are below it: ``(key, below)``.

    Keys are signed integers as unsigned words with the sign bit flipped,
    which keeps their order and makes every difference of two of them
    exact. A radix select, 11 bits a pass (2,048 counts, in the core's
    cache). The first pass counts each of the 2,048 values from the lowest
    key up, which holds the answer in one pass when the keys are counts or
    plan indices (LFU, LRU); otherwise each pass narrows the range to one of
    2,048 buckets. A key outside the range counts in a spare bucket, so no
    pass branches on a key. Four rows of counts, taken in turn, keep a run
    of equal keys from waiting on one counter.
    """
    below = 0  # keys under ``lo``
    counts = np.empty((4, 2049), np.int64)  # bucket 2048: keys outside the range
    low_first = True
    while lo < hi:
        span = hi - lo
        bits = 64 - leading_zeros(span)  # type: ignore[call-arg]  # typed by numba
        shift = np.uint64(0 if low_first or bits <= 11 else bits - 11)
        low_first = False
        top = min(span, np.uint64(2047) << shift | ((np.uint64(1) << shift) - np.uint64(1)))
        counts[:] = 0
        for s in range(n):
            d = keys[s] - lo  # wraps above ``top`` for a key under ``lo``
            counts[s & 3, (d >> shift) if d <= top else np.uint64(2048)] += 1
        b = 0
        while b < 2048:
            c = counts[0, b] + counts[1, b] + counts[2, b] + counts[3, b]
            if rank < c:
                break
            rank -= c
            below += c
            b += 1
        if b == 2048:  # only the low window (shift 0) can miss: the rest is above it
            lo += top + np.uint64(1)
            continue
        first = np.uint64(b) << shift
        hi = lo + min(span, first + ((np.uint64(1) << shift) - np.uint64(1)))
        lo += first
    return lo, below


@kernel
def choose_victims(reserve, mark, stamp, last_use, finished, id_of_slot, priority, count, out):
    """The ``count`` slots of ``reserve`` of lowest ``(key, slot)`` that a
    plan may evict, by slot, into ``out``.

    A slot of ``reserve`` may be evicted unless stamped (a hit of the batch,
    or counted in flight) or used by a plan after ``finished``; its key is
    the lowest int64 for a free slot (free slots go first, whatever the
    priorities), else ``priority[slot]``. One pass lists those
    slots with their keys, ``_select`` finds the ``count``-th key (a radix
    select, as ``reserve_candidates``), and the slots are put in order
    through a bitmap of all slots (two passes over ``C / 64`` words), not
    sorted: a compiled sort of a few thousand slots took four times
    NumPy's. No pass branches on a key: twice as fast as ``np.partition``
    for the ``count``-th key and a branch per slot filling the bitmaps, on
    the reserves of the scaling benchmark's embedding-heavy batch.

    Returns:
      ``(candidates, key, slot)``: how many slots of ``reserve`` may be
      evicted (``out`` is written only when at least ``count``), and the
      ``(key, slot)`` of the last one chosen.
    """
    sign = np.uint64(1) << np.uint64(63)  # keys as unsigned words (``_select``)
    slots = np.empty(reserve.size, np.int64)
    keys = np.empty(reserve.size, np.uint64)
    lo = ~np.uint64(0)
    hi = np.uint64(0)
    found = 0
    for s in reserve:
        if mark[s] == stamp or last_use[s] > finished:
            continue
        key = np.uint64(0) if id_of_slot[s] < 0 else np.uint64(priority[s]) ^ sign
        slots[found] = s
        keys[found] = key
        lo = min(lo, key)
        hi = max(hi, key)
        found += 1
    if found < count:
        return found, 0, 0
    kth, below = _select(keys, found, lo, hi, count - 1)
    words = (id_of_slot.size + 63) // 64
    chosen = np.zeros(words, np.uint64)  # slots below the k-th key, then the ties taken
    tied = np.zeros(words, np.uint64)
    one = np.uint64(1)
    zero = np.uint64(0)
    for j in range(found):
        s = slots[j]
        bit = one << np.uint64(s & 63)
        chosen[s >> 6] |= bit if keys[j] < kth else zero
        tied[s >> 6] |= bit if keys[j] == kth else zero
    need = count - below
    last = -1
    w = 0
    while need > 0:  # the lowest slots among equal keys
        bits = tied[w]
        while bits and need > 0:
            b = trailing_zeros(bits)  # type: ignore[call-arg,var-annotated]  # typed by numba
            bits &= bits - one
            chosen[w] |= one << b
            last = w * 64 + np.int64(b)
            need -= 1
        w += 1
    n = 0
    for w in range(words):
        bits = chosen[w]
        while bits:
            out[n] = w * 64 + np.int64(trailing_zeros(bits))  # type: ignore[call-arg]
            bits &= bits - one
            n += 1
    return found, np.int64(kth ^ sign), last


@kernel
def reserve_candidates(id_of_slot, priority, size, keys, out):
    """The ``size`` slots of lowest ``(key, slot)``, into ``out``: every slot
    whose key is below the ``size``-th lowest key, by slot, then the lowest
    slots of that key. A key is the lowest int64 for a free slot, else
    ``priority[slot]``;
    ``keys`` is scratch of the slots' number.

    The ``size``-th key is found by ``_select``. No pass branches on a key
    (the keys of a step follow no pattern a branch predictor could learn):
    every slot is written to both lists, whose ends move only for the slots
    each keeps.

    Returns:
      ``(key, slot)``: the ``size``-th key and the last slot taken.
    """
    capacity = id_of_slot.size
    sign = np.uint64(1) << np.uint64(63)  # keys as unsigned words (``_select``)
    lo = ~np.uint64(0)
    hi = np.uint64(0)
    for s in range(capacity):
        k = np.uint64(0) if id_of_slot[s] < 0 else np.uint64(priority[s]) ^ sign
        keys[s] = k
        lo = min(lo, k)
        hi = max(hi, k)
    lo, below = _select(keys, capacity, lo, hi, size - 1)
    need = size - below  # ties taken, the lowest slots first
    lows = np.empty(below + 1, np.int64)  # the last entry takes the slots not kept
    ties = np.empty(need + 1, np.int64)
    n = 0
    t = 0
    for s in range(capacity):
        k = keys[s]
        lows[n] = s
        n += k < lo
        ties[t] = s
        t += (k == lo) & (t < need)
    out[:below] = lows[:below]
    out[below:size] = ties[:need]
    return np.int64(lo ^ sign), out[size - 1]


@kernel
def fill_negative(values, fill):
    """A copy of 1-D ``values`` with every negative entry (padding) set to ``fill``."""
    out = np.empty_like(values)
    for p in range(values.size):
        v = values[p]
        out[p] = fill if v < 0 else v
    return out


@kernel
def real_positions(values, limit, out):
    """Where the real entries (``< limit``) of one device's share ``values``
    are, in order, into ``out`` (the rest of it padded with the share's
    length). Returns how many there are; when that exceeds ``out``'s length
    the positions are cut short and the caller must retry with more room."""
    size = out.size
    j = 0
    for p in range(values.size):
        if values[p] < limit:
            if j < size:
                out[j] = p
            j += 1
    for q in range(j, size):
        out[q] = values.size
    return j


@kernel
def split_by_home(
    flat, lo, hi, pad, num_embeddings, devices, keep, local, at, positions, begin, end
):
    """Groups the real ids of ``flat[lo:hi]`` by residue ``id % devices``.

    Writes, grouped by residue and in order within each group, the local id
    (``id // devices``) and, with ``positions``, the position in ``flat`` of
    every real id whose residue ``r`` has ``keep[r]`` to ``local`` and
    ``at``: residue ``r``'s group is ``[begin[r], end[r])`` (empty where not
    kept). Every id is range-checked, kept or not. Without ``positions``
    (the slices of another process's devices, whose ids this process only
    plans) ``at`` is left as it was, and the pass costs a fifth less.

    One pass, each group in a region of its own: ``local`` and ``at`` hold
    ``devices`` regions of ``region(hi - lo, devices)`` entries and one
    entry more, where the ids not kept land (each over the last), so the
    loop has no branch for them. Ids spread over residues fill about half of
    each region; when one overflows (a slice of skewed residues) the slice
    is split again in two passes, one counting each group's size, the
    groups then back to back. Counting first always cost a third more
    (the eight slices of ``benchmarks/scaling.py``'s 8-device batch).

    A power-of-two number of devices and regions of at least two blocks
    take ``_split_blocks``; the rest, or a slice it gives up on, the loop of
    ``_split_checked``, which tests each id for overflow.

    Returns:
      The first position holding an id outside ``[0, num_embeddings)``
      (then the outputs are incomplete), else ``-1``.
    """
    if devices & (devices - 1) == 0 and region(hi - lo, devices) >= 2 * _SPLIT_BLOCK:
        bad = _split_blocks(
            flat, lo, hi, pad, num_embeddings, devices, keep, local, at, positions, begin, end
        )
        if bad != -2:
            return bad
    return _split_checked(
        flat, lo, hi, pad, num_embeddings, devices, keep, local, at, positions, begin, end
    )


@kernel
def _split_blocks(
    flat, lo, hi, pad, num_embeddings, devices, keep, local, at, positions, begin, end
):
    """``split_by_home`` for a power-of-two number of devices, in blocks of
    ``_SPLIT_BLOCK`` ids that every kept region has room for, so that no id
    tests for overflow; each block's loop is picked once, with positions or
    without. Returns ``-2`` (nothing else told) where a region lacks room
    for the next block.

    Against ``_split_checked``, whose per-id loop also tests for division
    and for positions (LLVM hoisted neither test out of it), on one thread:
    alone, the eight slices of ``benchmarks/scaling.py``'s 8-device batch
    were split in 0.88 of the time, and the four slices of another process
    in its 2 x 4 layout (half the residues kept, no positions) in 0.86; in
    place, the two kernels taking turns step by step in the 2 x 4 stager,
    its own slices in 0.92 and the other process's in 0.88. The loops
    were that fast only as written here, with the state arrays made in this
    function and every way out a return: passed in, handed to another
    function, or the room taken as a minimum over the regions, they ran
    slower than ``_split_checked``.
    """
    # The shift counted here rather than taken from ``_mask_shift``: with
    # its ``(-1, -1)`` case in reach, both loops ran 10-14% slower.
    shift = 0
    while (1 << shift) < devices:
        shift += 1
    mask = devices - 1
    size = region(hi - lo, devices)
    fill = np.full(devices, devices * size, np.int64)  # the ids not kept: the last entry
    step = np.zeros(devices, np.int64)
    limit = np.full(devices, devices * size + hi - lo, np.int64)  # never reached where not kept
    for r in range(devices):
        if keep[r]:
            fill[r] = r * size
            step[r] = 1
            limit[r] = (r + 1) * size
    start = lo
    while start < hi:
        stop = min(start + _SPLIT_BLOCK, hi)
        for r in range(devices):
            if fill[r] + (stop - start) > limit[r]:
                return -2
        if positions:
            for p in range(start, stop):
                i = flat[p]
                if i == pad:
                    continue
                if i < 0 or i >= num_embeddings:
                    return p
                r = i & mask
                c = fill[r]
                local[c] = i >> shift
                at[c] = p
                fill[r] = c + step[r]
        else:
            for p in range(start, stop):
                i = flat[p]
                if i == pad:
                    continue
                if i < 0 or i >= num_embeddings:
                    return p
                r = i & mask
                c = fill[r]
                local[c] = i >> shift
                fill[r] = c + step[r]
        start = stop
    for r in range(devices):
        begin[r] = r * size if keep[r] else 0
        end[r] = fill[r] if keep[r] else 0
    return -1


# Ids of a block of ``_split_blocks``.
_SPLIT_BLOCK = 256


@kernel
def _split_checked(
    flat, lo, hi, pad, num_embeddings, devices, keep, local, at, positions, begin, end
):
    """``split_by_home`` one id at a time, each tested for overflow."""
    mask, shift = _mask_shift(devices)
    size = region(hi - lo, devices)
    # Each group's next entry, in an array of this call's own: the callers'
    # rows of ``end`` share cache lines, and two threads bumping counters
    # there made every slice two and a half times slower.
    fill = np.full(devices, devices * size, np.int64)  # the ids not kept: the last entry
    step = np.zeros(devices, np.int64)
    limit = np.full(devices, -1, np.int64)  # never reached where not kept
    for r in range(devices):
        if keep[r]:
            fill[r] = r * size
            step[r] = 1
            limit[r] = (r + 1) * size
    for p in range(lo, hi):
        i = flat[p]
        if i == pad:
            continue
        if i < 0 or i >= num_embeddings:
            return p
        if shift >= 0:
            r, q = i & mask, i >> shift
        else:
            r, q = i % devices, i // devices
        c = fill[r]
        if c == limit[r]:  # the rest checked, then split again in two passes
            for rest in range(p + 1, hi):
                i = flat[rest]
                if i != pad and (i < 0 or i >= num_embeddings):
                    return rest
            _split_counted(flat, lo, hi, pad, devices, keep, local, at, positions, begin, end)
            return -1
        local[c] = q
        if positions:
            at[c] = p
        fill[r] = c + step[r]
    for r in range(devices):
        begin[r] = r * size if keep[r] else 0
        end[r] = fill[r] if keep[r] else 0
    return -1


@kernel
def _mask_shift(divisor):
    """``(divisor - 1, log2(divisor))`` for a power of two, whose ``i %
    divisor`` and ``i // divisor`` are ``i & mask`` and ``i >> shift``
    for ``i >= 0``; ``(-1, -1)`` otherwise (divide)."""
    if divisor & (divisor - 1):
        return -1, -1
    shift = 0
    while (1 << shift) < divisor:
        shift += 1
    return divisor - 1, shift


@kernel
def region(entries, devices):
    """Entries of each residue's region in ``split_by_home``'s output, for a
    slice of ``entries`` ids: twice an even share, and a little more."""
    return 2 * ((entries + devices - 1) // devices) + 16


@kernel
def _split_counted(flat, lo, hi, pad, devices, keep, local, at, positions, begin, end):
    """``split_by_home`` in two passes, when a region overflowed: each kept
    group's size counted first, then the groups written back to back (the
    ids were checked by then)."""
    counts = np.zeros(devices + 1, np.int64)
    for p in range(lo, hi):
        i = flat[p]
        if i != pad:
            r = i % devices
            if keep[r]:
                counts[r + 1] += 1
    for r in range(devices):
        counts[r + 1] += counts[r]
        begin[r] = counts[r]
    for p in range(lo, hi):
        i = flat[p]
        if i != pad:
            r = i % devices
            if keep[r]:
                c = counts[r]
                local[c] = i // devices
                if positions:
                    at[c] = p
                counts[r] = c + 1
    for r in range(devices):
        end[r] = counts[r]


@kernel
def distinct_ranks(local, lo, hi, ranks, counts):
    """Ranks the distinct ids of each group ``local[lo[g]:hi[g]]`` in order of
    appearance, writing each entry's rank to ``ranks[j]`` and the group's
    number of distinct ids to ``counts[g]``.

    For the ids a source sends the owners of another process, which rank
    them the same way (``lookup_entries``). One open-addressing hash table of
    at least twice the largest group's entries serves every group in turn:
    each clears only the buckets it filled (one per distinct id, not one
    probe per entry again). The table is made afresh for each call: kept
    between steps it is cold by the next, and ranking took 2.5 times as long.

    The entries go in windows of ``_WINDOW``. A first pass over a window has
    no branch: it writes each entry the rank of its id's first bucket and
    lists the entries whose id is not there. Only those (a new id, one that
    collided, one first seen earlier in the window) take the second pass,
    in order, which probes and inserts. An id found in the first pass was
    inserted by an earlier window, so its rank is final, and every new id
    is met in the second pass in order of appearance. With one branch per
    entry (seen or new), the ranking waited on the branch predictor: the
    same entries ranked 2.7 times faster once it had learned them.
    """
    most = 0
    for g in range(lo.size):
        most = max(most, hi[g] - lo[g])
    bits = 4
    while (1 << bits) < 2 * most:
        bits += 1
    keys = np.full(1 << bits, -1, np.int64)
    values = np.zeros(1 << bits, np.int32)
    filled = np.empty(most, np.int64)
    pending = np.empty(_WINDOW, np.int64)
    mask, shift = (1 << bits) - 1, 64 - bits
    for g in range(lo.size):
        count = 0
        start, end = lo[g], hi[g]
        while start < end:
            stop = min(start + _WINDOW, end)
            waiting = 0
            for j in range(start, stop):  # no branch: a select and a count
                v = local[j]
                h = ((v * _GOLDEN) >> shift) & mask
                ranks[j] = values[h]
                pending[waiting] = j
                waiting += keys[h] != v
            for w in range(waiting):
                j = pending[w]
                v = local[j]
                h = ((v * _GOLDEN) >> shift) & mask
                while True:
                    key = keys[h]
                    if key == v:
                        ranks[j] = values[h]
                        break
                    if key < 0:
                        keys[h] = v
                        values[h] = count
                        ranks[j] = count
                        filled[count] = h
                        count += 1
                        break
                    h = (h + 1) & mask
            start = stop
        for q in range(count):
            keys[filled[q]] = -1
        counts[g] = count


# Entries of a window of ``distinct_ranks``' first pass: 64 ranked 1.27x as
# fast as 16, and 256 no faster (the groups one source of
# ``benchmarks/scaling.py``'s 2 x 4 batch sends the other process).
_WINDOW = 64


@kernel
def owner_route(
    unique_slots, first, bounds, sent, per_destination, pad, slots, requests, owner_inverse
):
    """One owner's share of a route: its distinct local slots copied to
    ``slots``; ``requests[s, k]``, the local slot of the k-th row it serves
    source ``s``, and ``owner_inverse[s K + k]``, that row's index among its
    distinct rows (their plan's rows, numbered as the batch's ids first
    appear); rows at ``K`` or beyond are left for the overflow path. Every
    other entry is padding: ``pad`` (``C_l``) in ``slots`` and
    ``requests``, ``slots.size`` (``V``) in ``owner_inverse``, filled here
    on the owner's thread rather than before the map on the caller's."""
    used = unique_slots.size
    slots[:used] = unique_slots
    slots[used:] = pad
    requests[:, :] = pad
    owner_inverse[:] = slots.size
    for s in range(bounds.size - 1):
        base = bounds[s]
        for k in range(min(sent[s], per_destination)):
            u = first[base + k]
            requests[s, k] = unique_slots[u]
            owner_inverse[s * per_destination + k] = u


@kernel
def fill_inverse(at, ranks, begin, end, base, out, lo, hi, fill):
    """One source's ids' rows in its device's received buffer: ``out[lo:hi]``
    (the source's slice of the batch) set to ``fill`` (padding's row), then,
    for the entries of residue ``r`` (``begin[r]`` to ``end[r]`` of the
    split's grouped ``at`` and ``ranks``, positions in the slice),
    ``out[at[j]] = base[r] + ranks[j]`` (``base[r]``: ``K`` times the home
    device of residue ``r``). One call: a fill in NumPy would let go of the
    GIL and take it back once more (see ``threads``)."""
    out[lo:hi] = fill  # a slice: vectorized (an index loop runs 10x slower)
    for r in range(base.size):
        b = base[r]
        for j in range(begin[r], end[r]):
            out[at[j]] = b + ranks[j]


# Fibonacci hashing: the top bits of id * 2^64 / golden ratio (as int64).
_GOLDEN = -7046029254386353131


@kernel
def fingerprint(values):
    """A 64-bit fingerprint of ``values`` in order: each value mixed (its
    product with the golden ratio, folded) and weighted by an odd number
    of its position, summed with wraparound. Batches that differ in a value
    or in order differ in it but for a chance of about 2^-64; one pass, no
    chain of dependent steps."""
    total = 0
    for j in range(values.size):
        mixed = values[j] * _GOLDEN
        mixed ^= mixed >> 29
        total += mixed * (2 * j + 1)
    return total


@kernel
def _hash_fill(keys, table, bits):
    mask, shift = table.size - 1, 64 - bits
    for j in range(keys.size):
        h = ((keys[j] * _GOLDEN) >> shift) & mask
        while table[h] >= 0:  # linear probing
            h = (h + 1) & mask
        table[h] = j


@kernel
def _hash_find(values, keys, table, bits):
    mask, shift = table.size - 1, 64 - bits
    which = np.empty(values.size, np.int64)
    where = np.empty(values.size, np.int64)
    k = 0
    for i in range(values.size):
        v = values[i]
        h = ((v * _GOLDEN) >> shift) & mask
        while table[h] >= 0:
            j = table[h]
            if keys[j] == v:
                which[k] = i
                where[k] = j
                k += 1
                break
            h = (h + 1) & mask
    return which[:k], where[:k]


class IdIndex:
    """Where each of distinct integer ``keys`` is, for ``find``.

    An open-addressing hash table of at least twice as many entries as
    keys, built in one compiled pass.

    Examples:
      >>> import numpy as np
      >>> index = IdIndex(np.array([40, 7, 12]))
      >>> [a.tolist() for a in index.find(np.array([12, 5, 40]))]
      [[0, 2], [2, 0]]
    """

    def __init__(self, keys: np.ndarray) -> None:
        self.keys = as_index_array(np.asarray(keys))
        self.bits = max(4, (2 * self.keys.size).bit_length())
        self.table = np.full(1 << self.bits, -1, np.int64)
        _hash_fill(self.keys, self.table, self.bits)

    def find(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(i, j)`` with ``values[i] == keys[j]``, for the ``values`` among
        the keys, in the order of ``values``."""
        return _hash_find(as_index_array(np.asarray(values)), self.keys, self.table, self.bits)


@kernel
def block_ids(local, bounds, residues, parts, starts, ids, at):
    """Groups of local ids, one per partition, as ids and places: entry
    ``j`` of group ``b`` (``bounds[b] <= j < bounds[b + 1]``) is local id
    ``local[j]`` of the partition whose ids have residue ``residues[b]``
    (modulo ``parts``); writes its id ``local[j] * parts + residues[b]`` to
    ``ids[j]`` and its place, ``starts[b] + j``, to ``at[j]``."""
    for b in range(residues.size):
        r, start = residues[b], starts[b]
        for j in range(bounds[b], bounds[b + 1]):
            ids[j] = local[j] * parts + r
            at[j] = start + j


@kernel
def table_rows(ids, index, count, rows, at, size, local):
    """Checks a gather of ids ``ids`` from a table shard into places ``at``
    of buffers of ``size`` rows, in one pass: writes each id's row of the
    shard (``id // count``; the shard holds the ids ``i % count == index``
    among ``rows * count``) to ``local``.

    Returns:
      ``-1`` when every id and place is valid and ``at`` is a run
      (``at[0], at[0] + 1, ...``), ``-2`` when valid but not a run, else the
      first entry ``j`` whose id or place is not (``local`` incomplete).
    """
    run = True
    if count == 1:  # the whole table: no division (tens of cycles an id)
        for j in range(ids.size):
            i, a = ids[j], at[j]
            if i < 0 or i >= rows or a < 0 or a >= size:
                return j
            local[j] = i
            run &= a == at[0] + j
        return -1 if run else -2
    # Three loops, not one with a branch per id, which took 1.2x as long
    # over the ids of a whole table.
    mask, shift = _mask_shift(count)
    if shift >= 0:
        for j in range(ids.size):
            i, a = ids[j], at[j]
            if i < 0 or i & mask != index or i >> shift >= rows or a < 0 or a >= size:
                return j
            local[j] = i >> shift
            run &= a == at[0] + j
        return -1 if run else -2
    for j in range(ids.size):
        i, a = ids[j], at[j]
        if i < 0 or i % count != index or i // count >= rows or a < 0 or a >= size:
            return j
        local[j] = i // count
        run &= a == at[0] + j
    return -1 if run else -2


@kernel
def _copy_words(dst, dst_at, src, src_at):
    n, m = dst.shape[0], src.shape[0]
    for j in range(dst_at.size):  # every index first: nothing written on a bad one
        if not (0 <= dst_at[j] < n and 0 <= src_at[j] < m):
            return j
    width, count = dst.shape[1], dst_at.size
    for j in range(count):
        if j + _AHEAD_ROW < count:  # rows at random in a large table: ask ahead
            _prefetch(src, src_at[j + _AHEAD_ROW])
            _prefetch(dst, dst_at[j + _AHEAD_ROW])
        a, b = dst_at[j], src_at[j]
        for w in range(width):
            dst[a, w] = src[b, w]
    return -1


def _words(array: np.ndarray, name: str) -> np.ndarray:
    """``array`` as ``[rows, words]`` unsigned words: the same memory, no copy."""
    array = np.asarray(array)
    if not array.flags.c_contiguous:
        raise ValueError(
            f"the {name} rows must be C-contiguous (got strides {array.strides}); copy them "
            "with np.ascontiguousarray first."
        )
    per_row = math.prod(array.shape[1:])
    size = next(b for b in (8, 4, 2, 1) if per_row * array.itemsize % b == 0)
    return array.reshape(len(array), per_row).view(np.uint8).view(f"u{size}")


def copy_rows(dst: np.ndarray, dst_at: np.ndarray, src: np.ndarray, src_at: np.ndarray) -> None:
    """``dst[dst_at[j]] = src[src_at[j]]`` for every ``j``, rows whole.

    The rows are copied bit for bit, so ``dst`` and ``src`` must have the
    same dtype and row shape; ``dst`` (and ``src``) must be C-contiguous.
    Indices are checked before anything is written.

    Raises:
      TypeError: different dtypes or row shapes.
      IndexError: an index outside ``dst`` or ``src`` (nothing written).

    Examples:
      >>> import numpy as np
      >>> dst = np.zeros((4, 2), np.float32)
      >>> copy_rows(dst, np.array([3, 0]), np.arange(6.0, dtype=np.float32).reshape(3, 2),
      ...           np.array([1, 2]))
      >>> dst.tolist()
      [[4.0, 5.0], [0.0, 0.0], [0.0, 0.0], [2.0, 3.0]]
    """
    if dst.dtype != src.dtype or dst.shape[1:] != src.shape[1:]:
        raise TypeError(
            f"cannot copy rows of {src.dtype} {src.shape[1:]} into rows of {dst.dtype} "
            f"{dst.shape[1:]}; convert them first."
        )
    if np.shape(dst_at) != np.shape(src_at):
        raise ValueError(f"{np.size(dst_at)} destinations for {np.size(src_at)} sources.")
    dst_at, src_at = as_index_array(np.asarray(dst_at)), as_index_array(np.asarray(src_at))
    bad = _copy_words(_words(dst, "destination"), dst_at, _words(src, "source"), src_at)
    if bad >= 0:
        raise IndexError(
            f"row {dst_at[bad]} of {len(dst)} (from row {src_at[bad]} of {len(src)}) is out "
            "of range; nothing was copied."
        )


# ------------------------------------------------------------ adaptive policy
@kernel
def log2_fixed(count, table):
    """``log2(count)`` in 1/256ths, rounded down on 8 bits of mantissa
    (``count >= 1``): ``256 * e + table[f]`` where ``2^e <= count < 2^(e+1)``
    and ``f`` are the 8 bits after the leading one (``floor(256 * (count /
    2^e - 1))``). Integer arithmetic, the same in every implementation."""
    e = 63 - leading_zeros(count)  # type: ignore[call-arg]  # typed by numba when compiled
    f = ((count << 8) >> e) if e <= 55 else (count >> (e - 8))
    return 256 * e + table[f - 256]


@kernel
def _sampled(i, bits):
    """Whether id ``i`` is in the shadow caches' sample: the top ``bits`` bits
    of its Fibonacci hash are zero (one id in ``2^bits``)."""
    if bits == 0:
        return True
    return ((i * _GOLDEN) >> (64 - bits)) & ((1 << bits) - 1) == 0


@kernel
def sample_ids(n, bits):
    """The ids in ``[0, n)`` that are in the shadow caches' sample, in order."""
    k = 0
    for i in range(n):
        k += _sampled(i, bits)
    out = np.empty(k, np.int64)
    k = 0
    for i in range(n):
        if _sampled(i, bits):
            out[k] = i
            k += 1
    return out


@kernel
def _key(t, weight, bonus, table):
    """The adaptive key of a row last used by batch ``t``: ``256 * t + bonus *
    log2_fixed(weight)``, or ``weight`` alone for ``bonus < 0`` (by count)."""
    if bonus < 0:
        return weight
    return 256 * t + bonus * log2_fixed(weight, table)


@kernel
def adaptive_keys(slots, ids, last_use, counts, slot_prior, keys, bonus, offset, table):
    """``keys[s] = _key(last_use[s], weight, bonus) + offset`` for the rows
    ``ids`` in ``slots``; a row's weight is its count or, when larger, its
    prior (``slot_prior[s]``; empty: none), at least 1."""
    for u in range(slots.size):
        s = slots[u]
        c = max(counts[ids[u]], 1)
        if slot_prior.size:
            c = max(c, slot_prior[s])
        keys[s] = _key(last_use[s], c, bonus, table) + offset


@kernel
def adaptive_record(slots, ids, looked_up, counts, slot_prior, keys, t, bonus, offset, table, bits):
    """Adds batch ``t``'s lookups to ``counts``, sets the keys of its slots
    (as ``adaptive_keys``) and returns its distinct ids that are in the
    shadow sample, in the order of ``slots``."""
    weight = np.empty(slots.size, np.int64)
    for u in range(slots.size):  # the random reads of [N] alone: they overlap
        c = counts[ids[u]] + looked_up[u]
        counts[ids[u]] = c
        weight[u] = c
    sample = np.empty(slots.size, np.int64)
    k = 0
    for u in range(slots.size):
        s = slots[u]
        c = max(weight[u], slot_prior[s]) if slot_prior.size else weight[u]
        keys[s] = _key(t, c, bonus, table) + offset
        if _sampled(ids[u], bits):
            sample[k] = ids[u]
            k += 1
    return sample[:k]


@kernel
def _weight(i, counts, prior):
    """The weight of id ``i``: its count or, when larger, its prior (``prior``
    empty: none), at least 1."""
    c = max(counts[i], 1)
    if prior.size:
        c = max(c, prior[i])
    return c


@kernel
def _heap_less(heap, a, b):
    return heap[a, 0] < heap[b, 0] or (heap[a, 0] == heap[b, 0] and heap[a, 1] < heap[b, 1])


@kernel
def _heap_swap(heap, a, b):
    heap[a, 0], heap[b, 0] = heap[b, 0], heap[a, 0]
    heap[a, 1], heap[b, 1] = heap[b, 1], heap[a, 1]


@kernel
def _heap_down(heap, size, i):
    while True:
        low = i
        for child in (2 * i + 1, 2 * i + 2):
            if child < size and _heap_less(heap, child, low):
                low = child
        if low == i:
            return
        _heap_swap(heap, i, low)
        i = low


@kernel
def _heap_push(heap, size, key, slot):
    i = size
    heap[i, 0], heap[i, 1] = key, slot
    while i > 0:
        parent = (i - 1) // 2
        if not _heap_less(heap, i, parent):
            break
        _heap_swap(heap, i, parent)
        i = parent
    return size + 1


@kernel
def _heap_pop(heap, size):
    size -= 1
    _heap_swap(heap, 0, size)
    _heap_down(heap, size, 0)
    return size


@kernel
def _home(i, bits, table_bits):
    return ((i * _GOLDEN) >> (64 - bits - table_bits)) & ((1 << table_bits) - 1)


@kernel
def _find(table, row, i, bits, table_bits):
    """Position of id ``i`` in the open-addressing ``table`` (of slots of
    ``row``, whose column 0 holds the ids), or ``-1``."""
    mask = table.size - 1
    h = _home(i, bits, table_bits)
    while table[h] >= 0:
        if row[table[h], 0] == i:
            return h
        h = (h + 1) & mask
    return -1


@kernel
def _insert(table, i, slot, bits, table_bits):
    mask = table.size - 1
    h = _home(i, bits, table_bits)
    while table[h] >= 0:
        h = (h + 1) & mask
    table[h] = slot


@kernel
def _delete(table, row, h, bits, table_bits):
    """Empties position ``h``, shifting later entries of its run back."""
    mask = table.size - 1
    j = h
    while True:
        j = (j + 1) & mask
        if table[j] < 0:
            break
        home = _home(row[table[j], 0], bits, table_bits)
        # Entry j may fill the hole at h unless its home lies in (h, j] (cyclically).
        if (h <= j and (home <= h or home > j)) or (h > j and home <= h and home > j):
            table[h] = table[j]
            h = j
    table[h] = -1


@kernel
def shadow_step(sample, t, counts, prior, bonuses, rows, heap, table, state, bits, log_table):
    """Plans the sampled distinct ids of batch ``t`` through every shadow cache.

    Shadow cache ``j`` holds ``S`` rows and ranks them by the adaptive key
    with ``bonuses[j]`` (``_key``); like the planner it evicts the lowest
    ``(key, slot)`` among the rows this batch does not use, and gives new
    rows free slots in order first. A sampled id that finds no room is not
    inserted.

    Args:
      sample: the batch's sampled distinct ids, sorted.
      rows: ``int64 [K, S, 3]``: per slot its id (``-1`` free), key and last
        batch (side by side: one cache line per row).
      heap: ``int64 [K, S, 2]``: a binary min-heap of ``(key, slot)`` per
        cache, one entry per row. Keys only grow, so an entry may hold an
        older, lower key than its row: it is pushed back with the row's key
        when it comes to the top, and a hit costs no heap work.
      table: ``int32 [K, T]``: open-addressing map id -> slot (``-1`` empty).
      state: ``int64 [K, 3]``: slots filled, heap size, hits of this batch.
    """
    size = rows.shape[1]
    table_bits = 0
    while (1 << table_bits) < table.shape[1]:
        table_bits += 1
    weight = np.empty(sample.size, np.int64)
    for q in range(sample.size):
        weight[q] = _weight(sample[q], counts, prior)
    misses = np.empty(sample.size, np.int64)
    held = np.empty(min(sample.size, size), np.int64)
    for j in range(bonuses.size):
        row, hp, tab, bonus = rows[j], heap[j], table[j], bonuses[j]
        filled, heap_size = state[j, 0], state[j, 1]
        hits = 0
        m = 0
        for q in range(sample.size):
            at = _find(tab, row, sample[q], bits, table_bits)
            if at < 0:
                misses[m] = q
                m += 1
                continue
            hits += 1
            s = tab[at]
            row[s, 1] = _key(t, weight[q], bonus, log_table)
            row[s, 2] = t
        h = 0
        for r in range(m):
            q = misses[r]
            s = -1
            if filled < size:
                s = filled
                filled += 1
            else:
                while heap_size > 0:
                    top_key, top = hp[0, 0], hp[0, 1]
                    heap_size = _heap_pop(hp, heap_size)
                    if top_key != row[top, 1]:  # its key grew: back in at its place
                        heap_size = _heap_push(hp, heap_size, row[top, 1], top)
                    elif row[top, 2] == t:  # this batch's row: keep it
                        held[h] = top
                        h += 1
                    else:
                        s = top
                        _delete(
                            tab, row, _find(tab, row, row[s, 0], bits, table_bits), bits, table_bits
                        )
                        break
            if s < 0:
                continue  # every row is this batch's: no room
            row[s, 0] = sample[q]
            row[s, 1] = _key(t, weight[q], bonus, log_table)
            row[s, 2] = t
            _insert(tab, sample[q], s, bits, table_bits)
            heap_size = _heap_push(hp, heap_size, row[s, 1], s)
        for r in range(h):
            heap_size = _heap_push(hp, heap_size, row[held[r], 1], held[r])
        state[j, 0], state[j, 1], state[j, 2] = filled, heap_size, hits


@kernel
def shadow_rekey(j, bonus, counts, prior, rows, heap, state, log_table):
    """Keys every row of shadow cache ``j`` afresh under ``bonus`` and
    rebuilds its heap (a shadow whose bonus changes, as the cache's does).

    The rows keep their ids and last batches; ``rows``, ``heap`` and
    ``state`` are ``shadow_step``'s. Entries in slot order, sorted by
    ``(key, slot)``, form a valid min-heap.
    """
    row = rows[j]
    size = state[j, 0]
    keys = np.empty(size, np.int64)
    slots = np.empty(size, np.int64)
    n = 0
    for s in range(size):
        if row[s, 0] < 0:
            continue
        row[s, 1] = _key(row[s, 2], _weight(row[s, 0], counts, prior), bonus, log_table)
        keys[n] = row[s, 1]
        slots[n] = s
        n += 1
    order = np.argsort(keys[:n], kind="mergesort")  # stable: equal keys by slot
    for q in range(n):
        heap[j, q, 0] = keys[order[q]]
        heap[j, q, 1] = slots[order[q]]
    state[j, 1] = n
