"""Replay of an id trace through the planner, with no model: sizing a cache.

A trace is the ids a training run would look up, in order: 1-D (split into
consecutive batches of ``batch`` ids) or 2-D ``[steps, ids]`` (one batch per
row). Each batch is planned by the real :class:`jaxcache.planning.Planner` as a
training step (the rows it uses become dirty), and released at once since
nothing is in flight. The counters say how much would cross the bus at a
given capacity and policy; :func:`sweep` gives a miss-ratio curve over
capacities and :func:`plot_curve` draws it.

Shape letters: ``T`` ids in a trace, ``S`` steps (batches), ``B`` ids per
batch, ``N`` table rows.
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxcache._src import validation
from jaxcache._src.compiled import kernel
from jaxcache._src.config import POLICIES, CacheConfig
from jaxcache._src.frequency import hottest
from jaxcache._src.planner import CapacityError, Planner

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["REPLAY_POLICIES", "plot_curve", "replay", "sweep"]

#: What ``replay`` accepts: the cache's policies and Belady's offline optimum.
REPLAY_POLICIES = (*POLICIES, "belady")

Result = dict[str, Any]


def replay(
    trace: np.ndarray,
    *,
    capacity: int | float,
    policy: str = "adaptive",
    batch: int | None = None,
    num_embeddings: int | None = None,
    frequencies: np.ndarray | None = None,
    planner: str = "host",
    padding_id: int | None = None,
) -> Result:
    """Plans every batch of ``trace`` through one cache and counts what moved.

    Args:
      trace: integer ids, ``[T]`` (split into batches of ``batch`` ids, the
        last one possibly shorter) or ``[S, B]`` (one batch per row; with
        ``batch`` the ids are re-split into batches of that size).
      capacity: rows on device, or a fraction of ``num_embeddings`` in
        ``(0, 1]``, as in :class:`jaxcache.CacheConfig`.
      policy: ``"adaptive"``, ``"frequency"``, ``"lfu"``, ``"lru"``, or
        ``"belady"``: the offline optimum under the same rule (every row of a
        batch resident while it runs), which evicts the row needed furthest in
        the future and starts with the rows needed first loaded (its steady
        rate: replayed over the steady batches alone, started the same way).
        It needs the whole trace, so it is a ceiling to compare with, not a
        policy to train with.
      batch: ids per batch; required for a 1-D trace.
      num_embeddings: ``N``; defaults to ``len(frequencies)`` when they are
        given, else to the largest id plus one.
      frequencies: ``int [N]`` dataset access counts. The ``"frequency"``
        policy ranks rows by them and is warmed with the hottest ones; when
        not given they are counted over the whole trace. Passed explicitly,
        they are also the prior of ``"adaptive"`` (which is then warmed the
        same way) and seed ``"lfu"``; ``"lru"`` and ``"belady"`` ignore them.
      planner: ``"host"`` or ``"device"`` (the device planner's program, on
        the default device): both make the same plans, so the same counts.
      padding_id: an id that marks padding (of multi-hot bags), as in
        :class:`jaxcache.CacheConfig`: it takes no row and is not counted;
        the batches keep their other ids.

    Returns:
      A flat, JSON-ready dict: ``policy``, ``capacity``
      (rows), ``capacity_fraction``, ``num_embeddings``, ``batches``,
      ``lookups``, ``distinct`` (summed per batch), ``feasible`` (``True``:
      see :func:`sweep`), ``hits`` (distinct ids
      resident), ``access_hits`` (lookups served by resident rows),
      ``unique_hit_rate`` (hits over distinct), ``access_hit_rate``,
      ``steady_unique_hit_rate`` (the same over the batches after the first
      quarter), ``miss_ratio`` (``1 - unique_hit_rate``), ``rows_warmed``
      (preloaded before the first batch), ``rows_fetched`` (misses),
      ``rows_written_back`` (evicted rows used since they were fetched; rows
      still resident at the end are not counted) and ``evictions``.

    Raises:
      TypeError, ValueError: a bad argument; the message names it.
      CapacityError: a batch has more distinct ids than ``capacity``.

    Examples:
      >>> import numpy as np
      >>> from jaxcache import replay
      >>> trace = np.array([0, 1, 0, 2, 1, 0, 2, 2, 0, 1])
      >>> out = replay(trace, batch=2, capacity=2, policy="lru")
      >>> out["hits"], out["distinct"], out["rows_fetched"], out["rows_written_back"]
      (3, 9, 6, 4)
      >>> round(out["unique_hit_rate"], 3), round(out["steady_unique_hit_rate"], 3)
      (0.333, 0.429)
    """
    (result,) = sweep(
        trace,
        capacities=[capacity],
        policies=[policy],
        batch=batch,
        num_embeddings=num_embeddings,
        frequencies=frequencies,
        planner=planner,
        padding_id=padding_id,
    )
    if not result["feasible"]:
        raise CapacityError(result["infeasible"])
    return result


def sweep(
    trace: np.ndarray,
    *,
    capacities: Iterable[int | float] | int | float,
    policies: Iterable[str] | str = ("adaptive",),
    batch: int | None = None,
    num_embeddings: int | None = None,
    frequencies: np.ndarray | None = None,
    planner: str = "host",
    padding_id: int | None = None,
) -> list[Result]:
    """Replays ``trace`` at every capacity for every policy: a miss-ratio curve.

    The trace is checked, split and counted once. Arguments are as in
    :func:`replay`; every argument is checked before the first replay.

    Returns:
      One :func:`replay` dict per ``(policy, capacity)``, policy-major, each
      in the given order. A capacity below some batch's distinct ids is no
      cache a run could use: its dicts say ``feasible: False`` and why
      (``infeasible``), with the trace's counts only, and the sweep goes on.

    Examples:
      >>> import numpy as np
      >>> from jaxcache.sizing import sweep
      >>> trace = np.random.default_rng(0).zipf(1.3, size=4000) % 500
      >>> curve = sweep(trace, batch=100, capacities=[0.2, 0.5, 1.0], policies=["lru"],
      ...               num_embeddings=500)
      >>> [r["capacity"] for r in curve]
      [100, 250, 500]
      >>> [r["hits"] <= s["hits"] for r, s in zip(curve, curve[1:])]
      [True, True]
      >>> small = sweep(trace, batch=100, capacities=[10, 100], policies=["lru"])
      >>> [r["feasible"] for r in small], small[0]["infeasible"].split(";")[0]
      ([False, True], 'batch 0 of the trace: the batch has 58 distinct ids but capacity is 10 rows')
    """
    batches, ids = _read_trace(trace, batch, padding_id)
    n = _table_size(ids, num_embeddings, frequencies)
    validation.check_padding_outside(padding_id, n)  # no cache could be built with it
    frequencies = _check_frequencies(frequencies, n)
    names = _check_policies(policies)
    if isinstance(capacities, (int, float, np.number)):
        capacities = [capacities]  # one capacity, as one policy may be a bare name
    rows = [_resolve_capacity(capacity, n) for capacity in capacities]
    if not rows:
        raise ValueError("no capacity given; pass a list such as capacities=[0.01, 0.05].")
    if planner not in ("host", "device"):
        raise ValueError(f"planner={planner!r} is not a planner; use 'host' or 'device'.")
    counts = frequencies
    if counts is None and "frequency" in names:
        counts = np.bincount(ids, minlength=n)
    # A capacity below a batch's distinct ids is refused here, in the words
    # of the planner's CapacityError, so no replay below meets one.
    distinct = np.array([np.unique(ids).size for ids in batches])
    most = int(distinct.max(initial=0))
    return [
        _run(batches, n, capacity, name, frequencies, counts, planner)
        if capacity >= most
        else _infeasible(name, capacity, n, batches, distinct)
        for name in names
        for capacity in rows
    ]


def _infeasible(
    policy: str, capacity: int, num_embeddings: int, batches: list[np.ndarray], distinct: np.ndarray
) -> Result:
    """The dict of a capacity that the first batch of more distinct ids
    would refuse (``CapacityError``'s words), with the trace's counts."""
    step = int(np.argmax(distinct > capacity))
    return {
        "policy": policy,
        "capacity": capacity,
        "capacity_fraction": capacity / num_embeddings,
        "num_embeddings": num_embeddings,
        "batches": len(batches),
        "lookups": int(sum(ids.size for ids in batches)),
        "distinct": int(distinct.sum()),
        "feasible": False,
        "infeasible": (
            f"batch {step} of the trace: the batch has {distinct[step]} distinct ids but "
            f"capacity is {capacity} rows; raise capacity to at least {distinct[step]} or use "
            "smaller batches."
        ),
    }


def plot_curve(
    results: Sequence[Result], path: str | None = None, *, title: str | None = None
) -> Figure:
    """Draws hit rate and miss ratio against capacity, one line per policy.

    Needs matplotlib (``pip install 'jaxcache[examples]'``). The figure is
    drawn without pyplot, so no global backend is changed.

    Args:
      results: dicts from :func:`sweep` or :func:`replay` (infeasible
        capacities are left out).
      path: where to save the figure (PNG, SVG, PDF by extension); not saved
        when ``None``.
      title: the figure's title; by default it names the trace's size.

    Returns:
      The ``matplotlib.figure.Figure``: hit rates on the left (solid: all
      batches, faint dashes: steady state), miss ratio on a log scale on the
      right. Belady's results, when present, are the black dashed ceiling.

    Examples:
      >>> import numpy as np
      >>> from jaxcache.sizing import plot_curve, sweep
      >>> trace = np.random.default_rng(0).integers(0, 50, size=600)
      >>> curve = sweep(trace, batch=20, capacities=[20, 30, 40], policies=["lru", "lfu"],
      ...               num_embeddings=50)
      >>> fig = plot_curve(curve)
      >>> [ax.get_xlabel() for ax in fig.axes]
      ['capacity (rows of 50)', 'capacity (rows of 50)']
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import NullLocator
    except ImportError as error:
        raise ImportError(
            "plot_curve needs matplotlib; install it with pip install 'jaxcache[examples]'."
        ) from error
    if not results:
        raise ValueError("results is empty; pass the dicts returned by sweep() or replay().")
    fig = Figure(figsize=(10, 4), layout="constrained")
    hit_ax, miss_ax = fig.subplots(1, 2)
    results = [r for r in results if r.get("feasible", True)]
    if not results:
        raise ValueError("no capacity of the results is feasible; there is no curve to draw.")
    names = list(dict.fromkeys(r["policy"] for r in results))
    for color, name in enumerate(n for n in names if n != "belady"):
        curve = sorted((r for r in results if r["policy"] == name), key=lambda r: r["capacity"])
        x = [r["capacity"] for r in curve]
        style = {"color": f"C{color}", "marker": "o"}
        hit_ax.plot(x, [r["unique_hit_rate"] for r in curve], label=name, **style)
        hit_ax.plot(
            x, [r["steady_unique_hit_rate"] for r in curve], linestyle="--", alpha=0.6, **style
        )
        miss_ax.plot(x, [r["miss_ratio"] for r in curve], label=name, **style)
    if "belady" in names:  # the ceiling: a dashed line, no markers
        curve = sorted((r for r in results if r["policy"] == "belady"), key=lambda r: r["capacity"])
        x = [r["capacity"] for r in curve]
        style = {"color": "black", "linestyle": "--", "label": "belady (optimum)"}
        hit_ax.plot(x, [r["unique_hit_rate"] for r in curve], **style)
        miss_ax.plot(x, [r["miss_ratio"] for r in curve], **style)
    first = results[0]
    xlabel = f"capacity (rows of {first['num_embeddings']:,})"
    hit_ax.set(xlabel=xlabel, ylabel="hit rate (distinct ids)", ylim=(0, 1.02))
    hit_ax.set_title("hit rate (faint dashes: after the first quarter)", fontsize="medium")
    miss_ax.set(xlabel=xlabel, ylabel="miss ratio (distinct ids)")
    miss_ax.set_title("miss ratio", fontsize="medium")
    misses = [r["miss_ratio"] for r in results]
    if min(misses) > 0:
        miss_ax.set_yscale("log")
    elif max(misses) > 0:  # a log scale that still shows a miss ratio of zero
        miss_ax.set_yscale("symlog", linthresh=1e-3)
    capacities = sorted({r["capacity"] for r in results})
    for ax in (hit_ax, miss_ax):
        if capacities[-1] >= 10 * capacities[0]:
            ax.set_xscale("log")
            ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(capacities, [f"{c:,}" for c in capacities])
        ax.tick_params(axis="x", labelrotation=45 if len(capacities) > 5 else 0)
        ax.grid(True, alpha=0.3)
        ax.legend(title="policy")
    fig.suptitle(
        title or f"Cache replay: {first['lookups']:,} lookups in {first['batches']:,} batches"
    )
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def _run(
    batches: list[np.ndarray],
    num_embeddings: int,
    capacity: int,
    policy: str,
    frequencies: np.ndarray | None,
    counts: np.ndarray | None,
    planner_kind: str = "host",
) -> Result:
    """Replays the checked ``batches`` through a fresh planner (or Belady's)."""
    if policy == "belady":
        # The steady rate's ceiling: the optimum over the steady batches alone,
        # started with the rows they need first (any policy's state is some set
        # of rows); the totals come from the whole trace.
        per_batch, rows_warmed = _belady(batches, capacity)
        steady, _ = _belady(batches[len(batches) // 4 :], capacity)
        return _summary(policy, capacity, num_embeddings, per_batch, rows_warmed, steady)
    config = CacheConfig(
        num_embeddings=num_embeddings, features=1, capacity=capacity, policy=policy
    )
    prior = counts if policy == "frequency" else frequencies
    if planner_kind == "device":
        return _run_on_device(batches, config, prior)
    planner = Planner(config, frequencies=prior)
    rows_warmed = 0
    if planner.policy.warms:
        # Warmed as EmbeddingCache does: the hottest rows that occur at all.
        assert prior is not None, "a policy warms only from dataset counts"
        rows_warmed = planner.warm(hottest(prior, capacity))[0].size
    per_batch = np.zeros((len(batches), len(_COUNTERS)), np.int64)
    for step, ids in enumerate(batches):
        plan = planner.plan(ids, train=True)
        planner.release(plan.index)
        per_batch[step] = (
            plan.lookups,
            plan.distinct,
            plan.hits,
            plan.access_hits,
            plan.misses,
            plan.evict_ids.size,
            plan.evictions,
        )
    return _summary(policy, capacity, num_embeddings, per_batch, rows_warmed)


def _run_on_device(
    batches: list[np.ndarray], config: CacheConfig, prior: np.ndarray | None
) -> Result:
    """``_run`` with the device planner's program on the default device."""
    import jax  # only when asked for

    from jaxcache._src.device_planner import DevicePlanner
    from jaxcache._src.placement import Layout

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("rows",))
    planner = DevicePlanner(config, Layout(), mesh, "rows", frequencies=prior)
    if planner.warms:
        assert prior is not None, "a policy warms only from dataset counts"
        planner.warm_hottest(prior)
    rows_warmed = planner.resident_ids().size
    per_batch = np.zeros((len(batches), len(_COUNTERS)), np.int64)
    for step, ids in enumerate(batches):
        dispatched = planner.dispatch(ids)
        stats = planner.collect(dispatched).stats
        planner.release(dispatched.index)
        per_batch[step] = (
            stats.lookups,
            stats.distinct,
            stats.hits,
            stats.access_hits,
            stats.misses,
            stats.rows_to_host,
            stats.evictions,
        )
    return _summary(
        config.policy, int(config.capacity), config.num_embeddings, per_batch, rows_warmed
    )


# Per-batch counters of a replay, in this order.
_COUNTERS = (
    "lookups",
    "distinct",
    "hits",
    "access_hits",
    "rows_fetched",
    "rows_written_back",
    "evictions",
)


def _summary(
    policy: str,
    capacity: int,
    num_embeddings: int,
    per_batch: np.ndarray,
    rows_warmed: int,
    steady: np.ndarray | None = None,
) -> Result:
    """The result dict of a replay from its ``int [S, 7]`` per-batch counters
    (and those of the batches after the first quarter, when replayed apart)."""
    total = dict(zip(_COUNTERS, (int(v) for v in per_batch.sum(axis=0)), strict=True))
    if steady is None:
        steady = per_batch[len(per_batch) // 4 :]
    steady = steady.sum(axis=0)
    distinct, hits = total["distinct"], total["hits"]
    hit_rate = _ratio(hits, distinct)
    return {
        "policy": policy,
        "capacity": capacity,
        "capacity_fraction": capacity / num_embeddings,
        "num_embeddings": num_embeddings,
        "batches": len(per_batch),
        "lookups": total["lookups"],
        "distinct": distinct,
        "feasible": True,
        "hits": hits,
        "access_hits": total["access_hits"],
        "unique_hit_rate": hit_rate,
        "access_hit_rate": _ratio(total["access_hits"], total["lookups"]),
        "steady_unique_hit_rate": _ratio(int(steady[2]), int(steady[1])),
        "miss_ratio": 1.0 - hit_rate if distinct else 0.0,
        "rows_warmed": int(rows_warmed),
        "rows_fetched": total["rows_fetched"],
        "rows_written_back": total["rows_written_back"],
        "evictions": total["evictions"],
    }


def _belady(batches: list[np.ndarray], capacity: int) -> tuple[np.ndarray, int]:
    """Belady's offline optimum under the batch rule: per-batch counters and
    rows warmed.

    Every distinct id of a batch is resident while it runs; a miss evicts the
    resident row whose next use is furthest away (never used again first,
    ties to the lower id), never one of the batch's own. The cache starts with
    the ``capacity`` rows the trace needs first already loaded, for free as
    warming is, so no policy can do better, warmed or not.
    """
    if any(np.unique(ids).size > capacity for ids in batches):
        bad = next(s for s, ids in enumerate(batches) if np.unique(ids).size > capacity)
        distinct = np.unique(batches[bad]).size
        raise CapacityError(
            f"batch {bad} of the trace: the batch has {distinct} distinct ids but capacity "
            f"is {capacity} rows; raise capacity to at least {distinct} or use smaller batches."
        )
    unique, looked_up, sizes = [], [], []
    for ids in batches:
        values, counts = np.unique(ids, return_counts=True)
        unique.append(values)
        looked_up.append(counts)
        sizes.append(values.size)
    ids = np.concatenate(unique).astype(np.int64)
    if not ids.size:  # batches of padding only: nothing to look up or warm
        return np.zeros((len(batches), 7), np.int64), 0
    step = np.repeat(np.arange(len(batches)), sizes)
    # Each (batch, id)'s next use: the next batch of the same id.
    order = np.lexsort((step, ids))
    next_use = np.full(ids.size, _NEVER, np.int64)
    same = ids[order[1:]] == ids[order[:-1]]
    next_use[order[:-1][same]] = step[order[1:][same]]
    first = order[np.r_[True, ~same]]  # the first use of every id
    first = first[np.lexsort((ids[first], step[first]))][:capacity]
    per_batch = _belady_loop(
        ids,
        np.concatenate(looked_up).astype(np.int64),
        next_use,
        np.array(sizes),
        ids[first],
        step[first],
        capacity,
        int(ids.max()) + 1,
    )
    return per_batch, first.size


_NEVER = np.iinfo(np.int64).max


@kernel
def _belady_loop(ids, looked_up, next_use, sizes, warm_ids, warm_next, capacity, n):
    """The compiled replay of ``_belady``; returns its ``int64 [S, 7]`` counters."""
    key = np.full(n, -1, np.int64)  # next use of a resident id, -1 when not resident
    dirty = np.zeros(n, np.bool_)
    heap = [(0, 0)]  # (-next use, id): the furthest next use on top
    heap.pop()
    for j in range(warm_ids.size):
        key[warm_ids[j]] = warm_next[j]
        heapq.heappush(heap, (-warm_next[j], warm_ids[j]))
    resident = warm_ids.size
    out = np.zeros((sizes.size, 7), np.int64)
    p = 0
    for t in range(sizes.size):
        end = p + sizes[t]
        misses = 0
        for j in range(p, end):
            out[t, 0] += looked_up[j]
            if key[ids[j]] >= 0:
                out[t, 2] += 1
                out[t, 3] += looked_up[j]
            else:
                misses += 1
        evict = resident + misses - capacity
        while evict > 0:
            far, i = heapq.heappop(heap)
            if key[i] != -far or -far == t:  # stale, or used by this batch
                continue
            key[i] = -1
            out[t, 5] += dirty[i]
            dirty[i] = False
            out[t, 6] += 1
            resident -= 1
            evict -= 1
        for j in range(p, end):
            resident += key[ids[j]] < 0
            key[ids[j]] = next_use[j]
            dirty[ids[j]] = True
            heapq.heappush(heap, (-next_use[j], ids[j]))
        out[t, 1] = sizes[t]
        out[t, 4] = misses
        p = end
    return out


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


# Checks, one argument each, so the command line can say which flag is wrong.


def _read_trace(
    trace: object, batch: int | None, padding_id: int | None
) -> tuple[list[np.ndarray], np.ndarray]:
    """``(batches, ids)``: the checked trace's batches without their padding,
    and all its ids but padding, flat."""
    array = _check_trace(trace, padding_id)
    batches = _split(array, batch)
    if padding_id is None:
        return batches, array.reshape(-1)
    return [ids[ids != padding_id] for ids in batches], array[array != padding_id]


def _check_trace(trace: object, padding_id: int | None = None) -> np.ndarray:
    """``trace`` as an integer array of rank 1 or 2 with ids >= 0 (but
    ``padding_id``), and at least one that is not padding."""
    validation.check_padding_id(padding_id)
    array = np.asarray(trace)
    if not validation.is_integer_dtype(array.dtype):
        raise TypeError(
            f"trace must hold integer ids, got dtype {array.dtype}; convert it with "
            "trace.astype(np.int64) if the values are whole ids."
        )
    if array.ndim not in (1, 2):
        raise ValueError(
            f"trace must be 1-D (ids, split into batches of `batch`) or 2-D [steps, ids] "
            f"(one batch per row), got shape {array.shape}; reshape it, e.g. "
            "trace.reshape(len(trace), -1) to keep one batch per step."
        )
    if array.size == 0:
        raise ValueError(f"trace is empty (shape {array.shape}); it needs at least one id.")
    if padding_id is not None and (array == padding_id).all():
        raise ValueError(
            f"trace holds padding_id={padding_id} only; it needs at least one id to replay."
        )
    negative = array < 0 if array.min() < 0 else None  # the usual trace: no mask at all
    if negative is not None and padding_id is not None:
        negative &= array != padding_id
    if negative is not None and negative.any():
        where = tuple(int(i) for i in np.argwhere(negative)[0])
        raise ValueError(
            f"trace holds {int(array[where])} at index {where}; ids must be >= 0. Pass "
            "padding_id (--padding-id) if it marks padding. Size raw ids' rows with `jaxcache "
            "vocabulary` (in Python, jaxcache.sizing.replay_vocabulary)."
        )
    return array


def _split(trace: np.ndarray, batch: int | None) -> list[np.ndarray]:
    """The batches of a checked trace: rows of a 2-D trace, or ``batch``-sized chunks."""
    if batch is None:
        if trace.ndim == 2:
            return list(trace)
        raise ValueError(
            f"batch is needed to split a 1-D trace of {trace.size} ids into batches; set it to "
            "the ids per training step (e.g. 4096), or pass a 2-D trace [steps, ids]."
        )
    if not validation.is_int(batch) or batch < 1:
        raise ValueError(f"batch={batch!r} must be a positive number of ids per step.")
    flat = trace.reshape(-1)
    full = flat.size - flat.size % batch
    batches = list(flat[:full].reshape(-1, batch))
    if full < flat.size:
        batches.append(flat[full:])
    return batches


def _table_size(ids: np.ndarray, num_embeddings: int | None, frequencies: np.ndarray | None) -> int:
    """``N``: given, else the length of ``frequencies``, else the largest id
    (of ``ids``, the trace's without padding) plus one."""
    largest = int(ids.max())
    if num_embeddings is None:
        if frequencies is None or np.ndim(frequencies) != 1:
            return _addressable(largest + 1)
        num_embeddings = len(frequencies)
        if largest >= num_embeddings:
            raise ValueError(
                f"frequencies has {num_embeddings} counts but the trace's largest id is "
                f"{largest}; it needs one count per table row (at least {largest + 1})."
            )
        return num_embeddings
    if (
        isinstance(num_embeddings, bool)
        or not isinstance(num_embeddings, (int, np.integer))
        or num_embeddings < 1
    ):
        raise ValueError(f"num_embeddings={num_embeddings!r} must be a positive number of rows.")
    if largest >= num_embeddings:
        raise ValueError(
            f"num_embeddings={num_embeddings} is too small for the trace, whose largest id is "
            f"{largest}; the table needs at least {largest + 1} rows (or leave it out)."
        )
    return _addressable(int(num_embeddings))


def _addressable(rows: int) -> int:
    """``rows``, unless a replay's per-row arrays (8 bytes a row and more)
    could not even be addressed: ``MemoryError`` naming the fix."""
    if rows > sys.maxsize // 16:
        raise MemoryError(
            f"a table of {rows:,} rows is too large for any machine's memory (its size is "
            "num_embeddings, else the trace's largest id + 1); give ids in [0, N) for a "
            "smaller N, or replay raw ids with jaxcache.sizing.replay_vocabulary "
            "(`jaxcache vocabulary`)."
        )
    return rows


def _check_frequencies(frequencies: object, num_embeddings: int) -> np.ndarray | None:
    """``int64 [N]`` counts >= 0, or ``None``."""
    if frequencies is None:
        return None
    return validation.check_frequencies(
        frequencies,
        num_embeddings,
        "count them with jaxcache.FrequencyCounter, or leave them out to count the trace",
    )


def _check_policies(names: Iterable[str]) -> list[str]:
    """Distinct policy names, in order; each must be a known policy."""
    names = [names] if isinstance(names, str) else list(dict.fromkeys(names))
    if not names:
        raise ValueError(f"no policy given; name at least one of {', '.join(REPLAY_POLICIES)}.")
    for name in names:
        if name not in REPLAY_POLICIES:
            raise ValueError(f"unknown policy {name!r}; use one of {', '.join(REPLAY_POLICIES)}.")
    return names


def _resolve_capacity(capacity: int | float, num_embeddings: int) -> int:
    """Rows for ``capacity`` (a row count or a fraction), checked by CacheConfig."""
    return int(CacheConfig(num_embeddings=num_embeddings, features=1, capacity=capacity).capacity)
