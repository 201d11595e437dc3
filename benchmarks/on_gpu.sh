#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md, in one run on a GPU host:
#
#   1. the software and the card;
#   2. benchmarks/throughput.py on the GPU (every table, then the ratios),
#      but for its dcnv2 runs, which
#   3. benchmarks/throughput_dcnv2.py takes on a table of 12.8M rows x 128
#      (6.5 GB; batches of 1,024 samples x 214 ids), one round: the plain
#      table against the 2% cache at MLPerf DCNv2's shape;
#   4. benchmarks/scaling.py on the host's own cores (JAX_PLATFORMS=cpu, 8
#      simulated devices, the device idle): host staging with the cores a
#      GPU host has rather than this project's 2-core development machine;
#   5. training through the cache against the whole table on the GPU, heavy
#      churn (tests/test_exactness.py, one device), then, with XLA's
#      deterministic GPU scatters, the tests that compare runs bit for bit
#      across capacities;
#   6. benchmarks/determinism.py with XLA's deterministic GPU scatters: which
#      runs agree bit for bit there.
#
# Each step has a time limit in seconds (THROUGHPUT_S, DCNV2_S, SCALING_S,
# EXACTNESS_S, DETERMINISM_S) and writes its log to LOG_DIR, so a step cut short still
# leaves what it printed. The dcnv2 step has a limit of its own so that, where
# drawing its table and compiling its steps run long, it alone is cut short. jaxcache is imported from this checkout
# (PYTHONPATH), not installed: a GPU image's jax and numba are used as they
# are.
#
#     bash benchmarks/on_gpu.sh [LOG_DIR]     # about 8 minutes on an H200 host, and the dcnv2 step's minute
set -u
cd "$(dirname "$0")/.."
logs=${1:-gpu-logs}
mkdir -p "$logs"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

step() {  # step NAME SECONDS COMMAND...: run it under a limit, log it, go on
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s): $*"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$logs/$name.log"
  echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start))s"
}

step software 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv; nproc; $py -c '
import jax, flax, optax, numba, numpy
print(\"jax\", jax.__version__, \"flax\", flax.__version__, \"optax\", optax.__version__,
      \"numba\", numba.__version__, \"numpy\", numpy.__version__)
print(jax.devices())'"
step throughput "${THROUGHPUT_S:-270}" "$py" benchmarks/throughput.py --no-dcnv2
step dcnv2 "${DCNV2_S:-60}" "$py" benchmarks/throughput_dcnv2.py --dcnv2-scale 0.0625 --rounds 1
step scaling "${SCALING_S:-90}" env JAX_PLATFORMS=cpu "$py" benchmarks/scaling.py
step exactness "${EXACTNESS_S:-90}" "$py" -m pytest -q -p no:cacheprovider \
  tests/test_exactness.py -k "heavy_churn or bfloat16"
deterministic=--xla_gpu_deterministic_ops=true
step bit-for-bit "${EXACTNESS_S:-90}" env XLA_FLAGS=$deterministic "$py" -m pytest -q \
  -p no:cacheprovider tests/test_exactness.py::test_bfloat16_rows_under_churn_equal_the_full_table \
  tests/test_pipeline.py::test_pipelined_is_bit_identical_to_unpipelined
step determinism "${DETERMINISM_S:-90}" env XLA_FLAGS=$deterministic "$py" benchmarks/determinism.py
