#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md, in one run of at most 8 minutes on a
# GPU host:
#
#   1. the software and the card;
#   2. benchmarks/throughput.py --side-by-side-only: the embedding-heavy
#      configuration's loops side by side, with each planner, against the
#      whole table and the plain baseline (cached_2pct_over_plain_*);
#   3. benchmarks/throughput_dcnv2.py on a table of 12.8M rows x 128 (6.5 GB;
#      batches of 1,024 samples x 214 ids), one round: the plain table
#      against the 2% cache at MLPerf DCNv2's shape, with each planner;
#   4. benchmarks/plan_share.py: the device plan's share of the DCNv2 step,
#      and what a dynamic vocabulary of raw ids adds to it;
#   5. training through the cache against the whole table on the GPU, heavy
#      churn, planned on the device (tests/test_exactness.py, 1e-6);
#   6. with XLA's deterministic GPU scatters, the checks that are bit for bit:
#      pipelined against unpipelined, and bfloat16 rows against the whole
#      table (without the flag, scatter-adds sum in arrival order).
#
# Each step has a time limit in seconds (THROUGHPUT_S, DCNV2_S, SHARE_S,
# EXACTNESS_S) and writes its log to LOG_DIR; the benchmarks print each
# ratio as soon as it is measured, so a step cut short still leaves what it
# printed. Compiled programs go to a persistent cache in LOG_DIR, which the
# later rounds and steps reuse. jaxcache is imported from this checkout
# (PYTHONPATH), not installed: a GPU image's jax and numba are used as they
# are.
#
#     bash benchmarks/on_gpu.sh [LOG_DIR]
set -u
cd "$(dirname "$0")/.."
logs=${1:-gpu-logs}
mkdir -p "$logs"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR="$(cd "$logs" && pwd)/xla-cache" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
py=${PYTHON:-python3}

step() {  # step NAME SECONDS COMMAND...: run it under a limit, log it, go on
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s): $*"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$logs/$name.log"
  echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start))s"
}

step software 30 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv; nproc; $py -c '
import jax, flax, optax, numba, numpy
print(\"jax\", jax.__version__, \"flax\", flax.__version__, \"optax\", optax.__version__,
      \"numba\", numba.__version__, \"numpy\", numpy.__version__)
print(jax.devices())'"
step throughput "${THROUGHPUT_S:-140}" "$py" benchmarks/throughput.py --side-by-side-only --rounds 2
step dcnv2 "${DCNV2_S:-100}" "$py" benchmarks/throughput_dcnv2.py --dcnv2-scale 0.0625 --rounds 1
step plan-share "${SHARE_S:-80}" "$py" benchmarks/plan_share.py --dcnv2-scale 0.0625 \
  --steps 20 --warmup 10
step exactness "${EXACTNESS_S:-50}" "$py" -m pytest -q -p no:cacheprovider \
  tests/test_exactness.py -k "device and heavy_churn"
step bit-for-bit "${EXACTNESS_S:-60}" env XLA_FLAGS=--xla_gpu_deterministic_ops=true "$py" -m \
  pytest -q -p no:cacheprovider tests/test_pipeline.py tests/test_exactness.py \
  -k "device and (bit_identical or bfloat16)"
