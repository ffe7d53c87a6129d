#!/usr/bin/env bash
# One call on the GPU machine for the fused sparse-dense W4A8 GEMM (issue 8): install, tests,
# a compute-sanitizer memcheck of a few fused cases, the benchmark. Logs and JSON go to $OUT
# (the device tool brings them back).
#
#   bash benchmarks/gpu_sparse_dense_run.sh [quick]
#   TESTS=tests TESTS_TIMEOUT=300 bash benchmarks/gpu_sparse_dense_run.sh quick   # every GPU test first
#
# The library is prebuilt on the CPU machine into .kbuild (carry it with the call) with
#   QOQTOOL_KERNEL_CACHE=$PWD/.kbuild python -m qoqtool.kernels.build --jobs 2
# and rebuilt here only if the sources differ. Each stage has its own time limit and the
# later stages run even when an earlier one fails.
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sparse_dense_out}
source benchmarks/gpu_stages.sh
setup_machine 300

stage "tests"
timeout ${TESTS_TIMEOUT:-180} python3 -m pytest -q -m "gpu and not slow" -p no:cacheprovider --tb=short --maxfail=20 \
  ${TESTS:-tests/test_sparse_dense_gpu.py tests/test_packing_outliers.py} 2>&1 | tee "$OUT/tests.txt" | tail -60
TESTS_RC=$?

stage "compute-sanitizer memcheck (fused kernel: split and unsplit, full bucket, NB = 1..8)"
SAN_IDS=$(python3 -m pytest --collect-only -q tests/test_sparse_dense_gpu.py 2>/dev/null |
  grep -E "matches_dense_plus_sparse\[3-0.05-(1|33)-|full_and_empty_buckets\[3-5-|several_chunks_per_warp\[5-16-" |
  grep -E "per_group-128|per_channel-0")
memcheck 75 $SAN_IDS

stage "benchmark"
timeout 270 python3 benchmarks/sparse_dense.py ${1:+--$1} --json "$OUT/sparse_dense.json" 2>&1 |
  tee "$OUT/bench.txt" | tail -45
BENCH_RC=$?

stage "summary"
echo "tests rc=$TESTS_RC  sanitizer rc=$SAN_RC  benchmark rc=$BENCH_RC" | tee -a "$LOG"
grep -E "passed|failed" "$OUT/tests.txt" | tail -2 | tee -a "$LOG"
grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitizer.txt" | tail -2 | tee -a "$LOG"
grep -E "^(MET|MISSED)" "$OUT/bench.txt" | tee -a "$LOG"
