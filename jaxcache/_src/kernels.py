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

``copy_rows`` moves a step's rows between the host table and the staging
buffers or read-outs: NumPy's fancy indexing of 2-D arrays goes element by
element.

``adaptive_keys``, ``adaptive_record`` and ``shadow_step`` are the per-id
passes of the ``"adaptive"`` policy (see ``policies.AdaptivePolicy``): its
keys, its counts, and the small shadow caches it learns from.
"""

from __future__ import annotations

import math

import numba
import numpy as np

__all__ = [
    "IdIndex",
    "adaptive_keys",
    "adaptive_record",
    "as_index_array",
    "copy_rows",
    "fill_negative",
    "in_sample",
    "lookup",
    "mark_new",
    "real_positions",
    "shadow_step",
    "victim_candidates",
]

_JIT = {"nogil": True, "cache": True, "boundscheck": False}


def as_index_array(ids: np.ndarray) -> np.ndarray:
    """``ids`` flattened, as int32 or int64 (the kernels' compiled types)."""
    flat = ids.reshape(-1)
    if flat.dtype not in (np.int32, np.int64):
        flat = flat.astype(np.int64)
    return flat


@numba.njit(**_JIT)
def lookup(flat, pad, num_embeddings, slot_of_id, rank, mark, stamp, inverse, hits, misses):
    """Looks a batch's ids up in the directory.

    Writes ``inverse[p]``: ``-1`` for padding, the hit's rank among the
    distinct hits (in order of first appearance) for a resident id, and
    leaves misses unwritten; ``hits[:h]``: the distinct hit slots, marked
    ``stamp``; ``misses[:m]``: the positions of the misses.

    Returns:
      ``(h, m, valid, bad)``: ``valid`` non-padding positions; ``bad`` the
      first position holding an id outside ``[0, num_embeddings)`` (then the
      other outputs are incomplete), else ``-1``.
    """
    h = 0
    m = 0
    valid = 0
    for p in range(flat.size):
        i = flat[p]
        if i == pad:
            inverse[p] = -1
            continue
        if i < 0 or i >= num_embeddings:
            return h, m, valid, p
        valid += 1
        s = slot_of_id[i]
        if s < 0:
            misses[m] = p
            m += 1
            continue
        if mark[s] != stamp:
            mark[s] = stamp
            rank[s] = h
            hits[h] = s
            h += 1
        inverse[p] = rank[s]
    return h, m, valid, -1


@numba.njit(**_JIT)
def mark_new(slots, mark, stamp, group_capacity, counts):
    """Marks ``slots`` with ``stamp``; adds the newly marked ones per group to ``counts``."""
    for s in slots:
        if mark[s] != stamp:
            mark[s] = stamp
            counts[s // group_capacity] += 1


@numba.njit(**_JIT)
def victim_candidates(reserve, mark, stamp, last_use, finished, id_of_slot, priority):
    """The slots of ``reserve`` a plan may evict, with their eviction keys.

    A slot is protected when stamped (a hit of the batch, or counted in
    flight) or used by a plan after ``finished``. A key is ``-1`` for a free
    slot, else ``priority[slot]``.

    Returns:
      ``(slots, keys)``, in the order of ``reserve``.
    """
    slots = np.empty(reserve.size, np.int64)
    keys = np.empty(reserve.size, np.int64)
    k = 0
    for s in reserve:
        if mark[s] == stamp or last_use[s] > finished:
            continue
        slots[k] = s
        keys[k] = -1 if id_of_slot[s] < 0 else priority[s]
        k += 1
    return slots[:k], keys[:k]


@numba.njit(**_JIT)
def fill_negative(values, fill):
    """A copy of 1-D ``values`` with every negative entry (padding) set to ``fill``."""
    out = np.empty_like(values)
    for p in range(values.size):
        v = values[p]
        out[p] = fill if v < 0 else v
    return out


@numba.njit(**_JIT)
def real_positions(values, devices, size):
    """Where the real (non-negative) entries of 1-D ``values`` are, per device.

    ``values`` splits evenly over ``devices``; row ``d`` of the result lists
    the positions, within device ``d``'s share, of its real entries in order,
    padded to ``size`` with the share's length. Returns ``(positions [devices,
    size], the most real entries of a device)``; when that exceeds ``size``
    the positions are cut short and the caller must retry with more room.
    """
    share = values.size // devices
    out = np.full((devices, size), share, np.int32)
    most = 0
    for d in range(devices):
        j = 0
        base = d * share
        for p in range(share):
            if values[base + p] >= 0:
                if j < size:
                    out[d, j] = p
                j += 1
        most = max(most, j)
    return out, most


# Fibonacci hashing: the top bits of id * 2^64 / golden ratio (as int64).
_GOLDEN = -7046029254386353131


@numba.njit(**_JIT)
def _hash_fill(keys, table, bits):
    mask, shift = table.size - 1, 64 - bits
    for j in range(keys.size):
        h = ((keys[j] * _GOLDEN) >> shift) & mask
        while table[h] >= 0:  # linear probing
            h = (h + 1) & mask
        table[h] = j


@numba.njit(**_JIT)
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


@numba.njit(**_JIT)
def _copy_words(dst, dst_at, src, src_at):
    n, m = dst.shape[0], src.shape[0]
    for j in range(dst_at.size):  # every index first: nothing written on a bad one
        if not (0 <= dst_at[j] < n and 0 <= src_at[j] < m):
            return j
    width = dst.shape[1]
    for j in range(dst_at.size):
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
@numba.njit(**_JIT)
def log2_fixed(count, table):
    """``log2(count)`` in 1/256ths, rounded down on 8 bits of mantissa
    (``count >= 1``): ``256 * (e - 1) + table[index]`` where ``count = m * 2^e``,
    ``m`` in ``[0.5, 1)``, ``index = floor(256 * (2m - 1))``. Exact integer
    arithmetic on the float's parts, the same in every implementation."""
    m, e = math.frexp(float(count))
    return 256 * (e - 1) + table[int((2.0 * m - 1.0) * 256.0)]


@numba.njit(**_JIT)
def _sampled(i, bits):
    """Whether id ``i`` is in the shadow caches' sample: the top ``bits`` bits
    of its Fibonacci hash are zero (one id in ``2^bits``)."""
    if bits == 0:
        return True
    return ((i * _GOLDEN) >> (64 - bits)) & ((1 << bits) - 1) == 0


@numba.njit(**_JIT)
def _weight(i, counts, prior):
    """The count that ranks id ``i``: its lookups, or its prior when larger
    (``prior`` empty: none). At least 1."""
    c = counts[i]
    if prior.size and prior[i] > c:
        c = prior[i]
    return max(c, 1)


@numba.njit(**_JIT)
def in_sample(ids, bits):
    """Which of ``ids`` are in the shadow caches' sample (``bool``, like ``ids``)."""
    out = np.empty(ids.size, np.bool_)
    for u in range(ids.size):
        out[u] = _sampled(ids[u], bits)
    return out


@numba.njit(**_JIT)
def _key(t, weight, bonus, table):
    """The adaptive key of a row last used by batch ``t``: ``256 * t + bonus *
    log2_fixed(weight)``, or ``weight`` alone for ``bonus < 0`` (by count)."""
    if bonus < 0:
        return weight
    return 256 * t + bonus * log2_fixed(weight, table)


@numba.njit(**_JIT)
def adaptive_keys(slots, ids, last_use, counts, prior, keys, bonus, offset, table):
    """``keys[s] = _key(last_use[s], weight of its id, bonus) + offset``."""
    for u in range(slots.size):
        s = slots[u]
        keys[s] = _key(last_use[s], _weight(ids[u], counts, prior), bonus, table) + offset


@numba.njit(**_JIT)
def adaptive_record(slots, ids, looked_up, counts, prior, keys, t, bonus, offset, table, bits):
    """Adds batch ``t``'s lookups to ``counts``, sets the keys of its slots
    and returns its distinct ids that are in the shadow sample, in the order
    of ``slots``."""
    sample = np.empty(slots.size, np.int64)
    k = 0
    for u in range(slots.size):
        i = ids[u]
        counts[i] += looked_up[u]
        keys[slots[u]] = _key(t, _weight(i, counts, prior), bonus, table) + offset
        if _sampled(i, bits):
            sample[k] = i
            k += 1
    return sample[:k]


@numba.njit(**_JIT)
def _heap_less(hk, hs, a, b):
    return hk[a] < hk[b] or (hk[a] == hk[b] and hs[a] < hs[b])


@numba.njit(**_JIT)
def _heap_swap(hk, hs, hv, a, b):
    hk[a], hk[b] = hk[b], hk[a]
    hs[a], hs[b] = hs[b], hs[a]
    hv[a], hv[b] = hv[b], hv[a]


@numba.njit(**_JIT)
def _heap_down(hk, hs, hv, size, i):
    while True:
        low = i
        for child in (2 * i + 1, 2 * i + 2):
            if child < size and _heap_less(hk, hs, child, low):
                low = child
        if low == i:
            return
        _heap_swap(hk, hs, hv, i, low)
        i = low


@numba.njit(**_JIT)
def _heap_push(hk, hs, hv, size, key, slot, version):
    i = size
    hk[i], hs[i], hv[i] = key, slot, version
    while i > 0:
        parent = (i - 1) // 2
        if not _heap_less(hk, hs, i, parent):
            break
        _heap_swap(hk, hs, hv, i, parent)
        i = parent
    return size + 1


@numba.njit(**_JIT)
def _heap_pop(hk, hs, hv, size):
    size -= 1
    _heap_swap(hk, hs, hv, 0, size)
    _heap_down(hk, hs, hv, size, 0)
    return size


@numba.njit(**_JIT)
def _home(i, bits, table_bits):
    return ((i * _GOLDEN) >> (64 - bits - table_bits)) & ((1 << table_bits) - 1)


@numba.njit(**_JIT)
def _find(table, row_id, i, bits, table_bits):
    """Position of id ``i`` in the open-addressing ``table``, or ``-1``."""
    mask = table.size - 1
    h = _home(i, bits, table_bits)
    while table[h] >= 0:
        if row_id[table[h]] == i:
            return h
        h = (h + 1) & mask
    return -1


@numba.njit(**_JIT)
def _insert(table, i, slot, bits, table_bits):
    mask = table.size - 1
    h = _home(i, bits, table_bits)
    while table[h] >= 0:
        h = (h + 1) & mask
    table[h] = slot


@numba.njit(**_JIT)
def _delete(table, row_id, h, bits, table_bits):
    """Empties position ``h``, shifting later entries of its run back."""
    mask = table.size - 1
    j = h
    while True:
        j = (j + 1) & mask
        if table[j] < 0:
            break
        home = _home(row_id[table[j]], bits, table_bits)
        # Entry j may fill the hole at h unless its home lies in (h, j] (cyclically).
        if (h <= j and (home <= h or home > j)) or (h > j and home <= h and home > j):
            table[h] = table[j]
            h = j
    table[h] = -1


@numba.njit(**_JIT)
def shadow_step(sample, t, counts, prior, bonuses, rows, heap, table, state, bits, log_table):
    """Plans the sampled distinct ids of batch ``t`` through every shadow cache.

    Shadow cache ``j`` holds ``S`` rows and ranks them by the adaptive key
    with ``bonuses[j]`` (``_key``); like the planner it evicts the lowest ``(key, slot)``
    among the rows this batch does not use, and gives new rows free slots in
    order first. A sampled id that finds no room is not inserted.

    Args:
      sample: the batch's sampled distinct ids, sorted.
      rows: ``int64 [K, 4, S]``: per slot its id (``-1`` free), key, last
        batch and version (bumped whenever its key changes).
      heap: ``int64 [K, 3, 3S]``: a binary min-heap of ``(key, slot,
        version)`` per cache; entries whose version is stale are skipped.
      table: ``int32 [K, T]``: open-addressing map id -> slot (``-1`` empty).
      state: ``int64 [K, 3]``: slots filled, heap size, hits of this batch.
    """
    size = rows.shape[2]
    table_bits = 0
    while (1 << table_bits) < table.shape[1]:
        table_bits += 1
    misses = np.empty(sample.size, np.int64)
    held_key = np.empty(sample.size, np.int64)
    held_slot = np.empty(sample.size, np.int64)
    held_version = np.empty(sample.size, np.int64)
    for j in range(bonuses.size):
        row_id, key, used, version = rows[j, 0], rows[j, 1], rows[j, 2], rows[j, 3]
        hk, hs, hv = heap[j, 0], heap[j, 1], heap[j, 2]
        tab = table[j]
        filled, heap_size = state[j, 0], state[j, 1]
        if heap_size > 2 * size:  # mostly stale entries: rebuild from the slots
            heap_size = 0
            for s in range(filled):
                hk[heap_size], hs[heap_size], hv[heap_size] = key[s], s, version[s]
                heap_size += 1
            for i in range(heap_size // 2 - 1, -1, -1):
                _heap_down(hk, hs, hv, heap_size, i)
        hits = 0
        m = 0
        for i in sample:
            at = _find(tab, row_id, i, bits, table_bits)
            if at < 0:
                misses[m] = i
                m += 1
                continue
            hits += 1
            s = tab[at]
            used[s] = t
            key[s] = _key(t, _weight(i, counts, prior), bonuses[j], log_table)
            version[s] += 1
            heap_size = _heap_push(hk, hs, hv, heap_size, key[s], s, version[s])
        held = 0
        for q in range(m):
            i = misses[q]
            s = -1
            if filled < size:
                s = filled
                filled += 1
            else:
                while heap_size > 0:
                    top_key, top_slot, top_version = hk[0], hs[0], hv[0]
                    heap_size = _heap_pop(hk, hs, hv, heap_size)
                    if top_version != version[top_slot]:
                        continue  # stale
                    if used[top_slot] == t:  # this batch's row: keep it
                        held_key[held], held_slot[held] = top_key, top_slot
                        held_version[held] = top_version
                        held += 1
                        continue
                    s = top_slot
                    _delete(
                        tab,
                        row_id,
                        _find(tab, row_id, row_id[s], bits, table_bits),
                        bits,
                        table_bits,
                    )
                    break
            if s < 0:
                continue  # every row is this batch's: no room
            row_id[s] = i
            used[s] = t
            key[s] = _key(t, _weight(i, counts, prior), bonuses[j], log_table)
            version[s] += 1
            _insert(tab, i, s, bits, table_bits)
            heap_size = _heap_push(hk, hs, hv, heap_size, key[s], s, version[s])
        for q in range(held):
            heap_size = _heap_push(
                hk, hs, hv, heap_size, held_key[q], held_slot[q], held_version[q]
            )
        state[j, 0], state[j, 1], state[j, 2] = filled, heap_size, hits
