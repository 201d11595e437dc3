"""Raw ids: a dynamic vocabulary against ids reduced modulo the table, at the same memory.

A Criteo-shaped stream (``SyntheticCriteo``: 26 categorical fields, 13 dense
features, clicks drawn from a hidden model of the ids) whose ids become raw
int64 values (a bijective mix of them). DLRM trains on it twice through a
cache of the same capacity over a table of the same ``R`` rows (``--rows``,
a fraction of the stream's id space):

- **modulo**: the raw ids reduced modulo ``R``, as a fixed table forces;
  unrelated ids share rows;
- **dynamic**: ``CacheConfig(vocabulary=DynamicVocabulary(forget=...))``
  with a budget of ``R`` rows: an id gets a row of its own, and stale ids
  give theirs back when their bucket is full, by each rule of ``--forget``
  (the least recently used, the least often, both at a fixed bonus:
  ``"lrfu"``, or both at a learned one: ``"adaptive"``);
- **admission** (``--admission``): ``"lrfu"`` with ``admit_after=2``, so
  that ids seen once get no row, twice: their lookups read zeros
  (``default="zeros"``) or one shared trainable row (``"shared"``).

Printed: ``modulo_loss`` and, per rule, ``dynamic_<rule>_loss`` (the mean
training loss over the second half of the steps, each batch scored before
the model trains on it) and ``dynamic_<rule>_over_modulo_loss``;
``modulo_auc`` and ``dynamic_<rule>_auc`` (ROC AUC on held-out batches,
scored with ``train=False``: the dynamic vocabulary's unknown ids read its
default row); ``modulo_shared_ids`` (share of the stream's distinct ids
whose row another id also uses) and ``dynamic_<rule>_forgotten_ids``; the
admission runs as rules ``lrfu_admit2_zeros`` and ``lrfu_admit2_shared``.

    python benchmarks/raw_ids.py          # about a minute on 2 CPU cores
    python benchmarks/raw_ids.py --quick
"""

from __future__ import annotations

import argparse
import time

import _harness
import numpy as np
from flax import nnx

import jaxcache

RULES = ("lru", "lfu", "lrfu", "adaptive")  # DynamicVocabulary(forget=...)


def train(
    args, data, rows: int, vocabulary: jaxcache.DynamicVocabulary | None
) -> tuple[float, float, jaxcache.EmbeddingCache]:
    dynamic = vocabulary is not None
    cfg = jaxcache.CacheConfig(
        rows,
        16,
        capacity=args.capacity,
        optimizer=jaxcache.rowwise_adagrad(0.05),
        vocabulary=vocabulary,
    )
    cache = jaxcache.EmbeddingCache(cfg, planner="host")
    embed = jaxcache.nnx.CachedEmbed(cache)
    model = jaxcache.models.DLRM(
        embed, num_sparse=data.num_features, features=16, bottom=(64, 16), top=(64, 32),
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    _, step = jaxcache.models.make_train_step(model, jaxcache.models.dense_optimizer("adam", 1e-3))

    def ids(batch):
        sparse = _harness.raw_ids(batch["sparse"])
        return sparse if dynamic else sparse.view(np.uint64) % np.uint64(rows)

    losses = [
        float(step(b["dense"], embed.prepare(ids(b)), b["label"])) for b in data.batches(args.steps)
    ]
    predict = jaxcache.models.make_predict_step(model)
    labels, scores = [], []
    for b in data.batches(args.eval_steps, start=10 * args.steps):
        scores.append(np.asarray(predict(b["dense"], embed.prepare(ids(b), train=False))))
        labels.append(b["label"])
    auc = jaxcache.synthetic.roc_auc(np.concatenate(labels), np.concatenate(scores))
    return float(np.mean(losses[len(losses) // 2 :])), auc, cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=0.01, help="SyntheticCriteo scale")
    parser.add_argument("--rows", type=float, default=0.1, help="R, a fraction of the ids")
    parser.add_argument("--capacity", type=float, default=0.5, help="device rows, of R")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--eval-steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--forget", nargs="+", choices=RULES, default=RULES)
    parser.add_argument(
        "--admission",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also lrfu with admit_after=2, on a zero and on a shared default row",
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.scale, args.steps, args.eval_steps, args.batch = 0.002, 100, 5, 512
    print(_harness.machine())
    data = jaxcache.synthetic.SyntheticCriteo(scale=args.scale, batch_size=args.batch, seed=0)
    rows = max(1, int(args.rows * data.num_embeddings))
    seen = np.unique(np.concatenate([b["sparse"].ravel() for b in data.batches(args.steps)]))
    per_row = np.bincount(_harness.raw_ids(seen).view(np.uint64) % np.uint64(rows), minlength=rows)
    shared = float(per_row[per_row > 1].sum() / seen.size)
    print(
        f"{data.num_embeddings} ids, {seen.size} seen in {args.steps} batches of {args.batch}; "
        f"R = {rows} rows, {args.capacity:.0%} of them on the device"
    )
    start = time.perf_counter()
    modulo_loss, modulo_auc, _ = train(args, data, rows, None)
    results = {"modulo_loss": modulo_loss, "modulo_auc": modulo_auc, "modulo_shared_ids": shared}
    runs = {rule: jaxcache.DynamicVocabulary(forget=rule) for rule in args.forget}
    if args.admission:
        for default in ("zeros", "shared"):
            runs[f"lrfu_admit2_{default}"] = jaxcache.DynamicVocabulary(
                forget="lrfu", admit_after=2, default=default
            )
    for name, vocabulary in runs.items():
        loss, auc, cache = train(args, data, rows, vocabulary)
        total = cache.stats.total
        learned = f", bonus {cache.vocabulary.bonus}" if vocabulary.forget == "adaptive" else ""
        print(
            f"dynamic, {name}: {total.new_ids} rows given, {total.forgotten_ids} taken back, "
            f"{total.refused_lookups} lookups without a row{learned} "
            f"({time.perf_counter() - start:.0f} s)"
        )
        results |= {
            f"dynamic_{name}_loss": loss,
            f"dynamic_{name}_over_modulo_loss": loss / modulo_loss,
            f"dynamic_{name}_auc": auc,
            f"dynamic_{name}_forgotten_ids": total.forgotten_ids,
        }
    _harness.print_results(results, digits=4)


if __name__ == "__main__":
    main()
