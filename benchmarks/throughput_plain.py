"""The cache against the plain baseline: the whole table as one device array.

What a user would compare a cache with: the same model (``_training.py``'s
dense layers, from the same initial parameters and table), its whole table
one array on the device, no jaxcache planner or cache in the loop. The ids
go to the device as they are (``jax.device_put``); inside the jitted step
the real ids of the bags (a negative id is padding: it reads nothing and
takes no update) are looked up with ``jnp.take`` and summed per bag; the
batch's ids are deduplicated on the device (``jnp.unique`` at a fixed
size), the gradients summed per distinct id, and the same sparse row
optimizer as the cache's (``CacheConfig.optimizer.update``) updates those
rows and their state alone, gathered and scattered back; the dense
parameters are trained by optax as in the cached runs.

The plain loop and the loop of a 2% cache fed by ``jaxcache.prefetch`` at
``--lookahead`` (one per planner ``--planner`` names) go round ``--rounds``
times, interleaved. ``cached_2pct_over_plain=R``: the plain step time over
the cache's (``_PLANNER`` appended to the name where the cache takes a
planner), on the embedding-heavy configuration (``throughput_dcnv2.py``:
the same for the DCNv2-shaped one).

    python benchmarks/throughput_plain.py --quick
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import _harness
import _training
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxcache


class TableRows(nnx.Variable):
    """The whole table ``[N, D]``; the sparse row optimizer trains it, not optax."""


class TableOptState(nnx.Variable):
    """The sparse row optimizer's state of every row, ``{name: [N, ...]}``."""


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["ids", "bags", "delta"],
    meta_fields=["bags_shape"],
)
@dataclasses.dataclass(frozen=True)
class PlainIds:
    """The real ids of a batch of bags, found on the device.

    Attributes:
      ids: ``int32 [P]`` the ids of the real positions, in order; ``N`` (one
        past the table's end) where fewer than ``P`` are real.
      bags: ``int32 [P]`` each id's bag in the flattened ``[B, F]``; ``B F``
        (dropped) past the real ones.
      delta: ``[P, D]`` zeros added to the rows while differentiating, so that
        the gradient w.r.t. it is each position's; ``None`` otherwise.
      bags_shape: ``(B, F)``.
    """

    ids: jax.Array
    bags: jax.Array
    delta: jax.Array | None
    bags_shape: tuple[int, ...]

    @classmethod
    def of(cls, ids: jax.Array, real: int, num_embeddings: int, pooled: bool) -> PlainIds:
        """The ``real`` (at most) non-negative ids of ``ids`` ``[B, F(, L)]``."""
        flat = ids.reshape(-1)
        at = jnp.nonzero(flat >= 0, size=real, fill_value=flat.size)[0]
        bag = ids.shape[-1] if pooled else 1
        found = flat.at[at].get(mode="fill", fill_value=num_embeddings)
        shape = ids.shape[:-1] if pooled else ids.shape
        return cls(found.astype(jnp.int32), (at // bag).astype(jnp.int32), None, shape)


class PlainEmbed(nnx.Module):
    """The whole table on the device: ``jnp.take`` of the ids, pooled per bag.

    Args:
      rows: the initial table ``[N, D]``.
      optimizer: the sparse row optimizer (the cache's ``CacheConfig.optimizer``).
    """

    def __init__(self, rows: np.ndarray, optimizer: jaxcache.SparseOptimizer) -> None:
        self.optimizer = optimizer
        # A copy: on the CPU backend an array made from NumPy may share its
        # memory, and the step, donated the table, would write into the
        # initial table the other runs start from.
        self.rows = TableRows(jnp.array(rows, copy=True))
        n, d = rows.shape
        self.opt_state = TableOptState(
            {
                name: jnp.full((n, *spec.shape), spec.init, spec.dtype)
                for name, spec in optimizer.state_spec(d).items()
            }
        )

    def __call__(self, ids: PlainIds) -> jax.Array:
        """``[B, F, D]``: each bag's real rows summed (one row each, one-hot)."""
        rows = jnp.take(self.rows[...], ids.ids, axis=0, mode="fill", fill_value=0)
        if ids.delta is not None:
            rows = rows + ids.delta
        bags = int(np.prod(ids.bags_shape))
        pooled = jax.ops.segment_sum(rows, ids.bags, num_segments=bags, indices_are_sorted=True)
        return pooled.reshape(*ids.bags_shape, rows.shape[-1])

    def update(self, ids: jax.Array, grads: jax.Array) -> None:
        """The sparse row optimizer on the distinct ids among ``ids`` ``[P]``
        (``N`` and beyond: none), ``grads`` ``[P, D]`` one per position."""
        table = self.rows[...]
        n = table.shape[0]
        unique, inverse = jnp.unique(ids, size=ids.size, fill_value=n, return_inverse=True)
        summed = jax.ops.segment_sum(grads, inverse.reshape(-1), num_segments=ids.size)
        rows = table.at[unique].get(mode="fill", fill_value=0)
        opt = self.opt_state.get_value()
        state = {k: v.at[unique].get(mode="fill", fill_value=0) for k, v in opt.items()}
        rows, state = self.optimizer.update(rows, summed, state)
        # Past the table's end (padding, and the unused tail): dropped.
        self.rows.set_value(table.at[unique].set(rows, mode="drop"))
        self.opt_state.set_value(
            {k: v.at[unique].set(state[k], mode="drop") for k, v in opt.items()}
        )


def _plain_step(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    dense: jax.Array,
    ids: jax.Array,
    labels: jax.Array,
    *,
    real: int,
    pooled: bool,
) -> jax.Array:
    embed = model.embed
    table = embed.rows[...]
    found = PlainIds.of(ids, real, table.shape[0], pooled)

    def loss_fn(model, delta):
        logits = model(dense, dataclasses.replace(found, delta=delta))
        return jaxcache.models.bce_loss(logits, labels)

    delta = jnp.zeros((real, table.shape[1]), table.dtype)
    diff = (nnx.DiffState(0, nnx.Param), 1)
    loss, (grads, row_grads) = nnx.value_and_grad(loss_fn, argnums=diff)(model, delta)
    optimizer.update(model, grads)
    embed.update(found.ids, row_grads)
    return loss


def run_plain(
    setup: _training.Setup, batches: list[dict], rows: np.ndarray, *, warmup: int, seed: int
) -> _training.Timing:
    """The plain baseline's training loop, timed as the cache's (``time_steps``)."""
    embed = PlainEmbed(rows, setup.config(1, "lru").optimizer)
    model = _training.make_model(setup, embed, seed)
    optimizer = nnx.Optimizer(model, setup.dense_optimizer(), wrt=nnx.Param)
    # The most real ids of a batch: the step's static size for them.
    real = max(int(np.count_nonzero(b["sparse"] >= 0)) for b in batches)
    step_fn = functools.partial(_plain_step, real=real, pooled=setup.combiner is not None)
    step = jaxcache.nnx.jit_step(step_fn, model, optimizer)
    # int32 as a loader would hand them over (``Bench`` gives the cache the
    # same): with 64-bit types off, JAX would convert int64 on this thread.
    ids = [np.asarray(b["sparse"], np.int32) for b in batches]
    timing = _training.Timing("plain", rows.shape[0])
    steps = ((b["dense"], jax.device_put(i), b["label"]) for b, i in zip(batches, ids, strict=True))
    _training.time_steps(timing, step, steps, warmup)
    return timing


def cached_over_plain(bench: _training.Bench, prefix: str = "") -> dict[str, float]:
    """The plain loop and the 2% cache's loop (per planner), side by side.

    Returns ``{PREFIXcached_2pct_over_plain[_PLANNER]: plain step / cached step}``.
    """
    args = bench.args
    k = args.lookahead
    runs: dict[Any, Any] = {
        "plain": functools.partial(
            run_plain, bench.setup, bench.batches, bench.base, **bench.common
        )
    }
    for planner in args.planners:
        planned = "" if planner is None else f", {planner} planner"
        name = f"cache 2%{planned}, lookahead {k}"
        runs[planner] = functools.partial(bench.loop, 0.02, name, k, planner=planner)
    results = _harness.interleave(runs, args.rounds)
    step = {key: [t.median("step") for t in timings] for key, timings in results.items()}
    plain = float(np.median(step["plain"]))
    print()
    print(bench.setup.describe())
    print(
        f"plain table against a 2% cache ({args.policy}): {args.rounds} round(s) of "
        f"{args.steps} steps after {args.warmup} warm-up; median over the rounds of each "
        "run's median, ms per step"
    )
    header = (
        f"{'':<40}{'ms/step':>8}{'range':>14}{'steps/s':>8}{'plain/this':>11}"
        f"{'hit rate':>9}{'final loss':>11}{'|dloss|':>9}"
    )
    print(header)
    print("-" * len(header))
    reference = results["plain"][0].loss
    for key, timings in results.items():
        seconds = float(np.median(step[key]))
        first = timings[0]
        hit = "-" if np.isnan(first.hit_rate) else f"{first.hit_rate:.3f}"
        label = "plain: whole table on device" if key == "plain" else first.name
        print(
            f"{label:<40}{1e3 * seconds:>8.2f}{_harness.ms_range(step[key]):>14}"
            f"{1 / seconds:>8.1f}{plain / seconds:>11.2f}{hit:>9}{first.loss:>11.6f}"
            f"{abs(first.loss - reference):>9.1e}"
        )
    _training.report_compilations(t for timings in results.values() for t in timings)
    print(
        "  loops read each loss one step later; plain/this: the plain step over this one; "
        "hit rate and final loss of the first round; |dloss|: vs plain (the same model "
        "and sparse optimizer: equal up to summation order)."
    )
    return {
        _harness.with_planner(f"{prefix}cached_2pct_over_plain", planner): plain
        / float(np.median(step[planner]))
        for planner in args.planners
    }


def main(argv: list[str] | None = None) -> None:
    _harness.print_results(cached_over_plain(_training.standalone(__doc__, argv)))


if __name__ == "__main__":
    main()
