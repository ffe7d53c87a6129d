#!/usr/bin/env bash
# One GPU call for the KV4 decode attention (issue 7): install, load the kernel library
# (prebuilt into .kbuild on the CPU machine and carried; rebuilt here if it will not load),
# the GPU tests, compute-sanitizer memcheck on one small case, and the benchmark.
# Everything is logged to $OUT/log.txt; benchmark tables to $OUT/results.{md,json}.
#
#   here:  QOQTOOL_KERNEL_CACHE=.kbuild QOQTOOL_KERNEL_SOURCES=kv_attention python -m qoqtool.kernels.build
#   there: bash benchmarks/gpu_attention_run.sh     (carry .kbuild; BENCH_ARGS=--sweep adds the
#          split-count sweep; PROFILE=1 an ncu profile of KV4 at B=16, L=4096 to $OUT/ncu.txt)
set -o pipefail
OUT=${OUT:-/tmp/qoq-attention}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export QOQTOOL_KERNEL_SOURCES=${QOQTOOL_KERNEL_SOURCES:-kv_attention}
export QOQTOOL_KERNEL_CACHE=${QOQTOOL_KERNEL_CACHE:-$PWD/.kbuild}

stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, report the status, go on
  local name=$1 limit=$2
  shift 2
  echo "=== $name"
  local start=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - start)) s"
}

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  stage install 120 python3 -m pip install -q --no-deps --no-build-isolation -e .
  stage library 240 python3 -c "
from qoqtool.runtime import kernel_library, attention_ops
try:
    attention_ops._lib()
except Exception as err:  # a carried build that will not load here: build it on this machine
    print('carried library unusable:', err)
    from qoqtool.kernels import build
    build.build(force=True)
    kernel_library.library.cache_clear()
    attention_ops._lib()
from qoqtool.kernels import build
print('kernels:', build.library_path())
"
  stage gpu-tests 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_attention.py -rs
  stage memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attention.py -k memcheck_case
  stage benchmark 360 python3 benchmarks/attention.py --out "$OUT" ${BENCH_ARGS:-}
  if [ -n "${PROFILE:-}" ]; then
    stage profile 180 /usr/local/cuda/bin/ncu --clock-control none -k regex:decode_kernel --launch-skip 5 \
      --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats \
      --section WarpStateStats --section Occupancy --section LaunchStats --section InstructionStats \
      --log-file "$OUT/ncu.txt" python3 benchmarks/attention.py --profile
  fi
} 2>&1 | tee "$OUT/log.txt"
