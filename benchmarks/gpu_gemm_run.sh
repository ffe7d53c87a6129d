#!/usr/bin/env bash
# One call on the GPU machine for the GEMM kernels (issue 4): build, install, test,
# compute-sanitizer memcheck, benchmark. Logs go to $OUT (the device tool brings them back).
#
#   bash benchmarks/gpu_gemm_run.sh [quick]
#
# The library is prebuilt on the CPU machine into .kbuild (carried with the call) with
#   QOQTOOL_KERNEL_CACHE=.kbuild QOQTOOL_KERNEL_SOURCES=w4a8_gemm,w8a8_gemm,fused_ops python -m qoqtool.kernels.build
# and rebuilt here only if the sources differ. Each stage has its own time limit and the
# later stages run even when an earlier one fails.
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gemm_out}
export QOQTOOL_KERNEL_SOURCES=w4a8_gemm,w8a8_gemm,fused_ops
source benchmarks/gpu_stages.sh
setup_machine 300

stage "tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short --maxfail=15 \
  tests/test_kernels_gemm.py tests/test_kernels_fused.py 2>&1 | tee "$OUT/tests.txt" | tail -60
TESTS_RC=$?

stage "benchmark"
timeout 180 python3 benchmarks/gemm.py ${1:+--$1} --explore --json "$OUT/gemm.json" 2>&1 | tee "$OUT/bench.txt" | tail -80
BENCH_RC=$?

stage "compute-sanitizer memcheck (small and large shapes, split-K, every wgmma configuration)"
SAN_IDS=$(python3 -m pytest --collect-only -q tests/test_kernels_gemm.py tests/test_kernels_fused.py 2>/dev/null |
  grep -E 'odd_shapes_exact\[3-|benchmark_shapes_exact\[(16|256|1024)-4096-4096-per_group|every_configuration_exact\[wgmma2-split3|quantize_per_token_is_bit_exact\[33-')
memcheck 100 $SAN_IDS

stage "summary"
echo "tests rc=$TESTS_RC  sanitizer rc=$SAN_RC  benchmark rc=$BENCH_RC" | tee -a "$LOG"
grep -E "passed|failed|error" "$OUT/tests.txt" | tail -2 | tee -a "$LOG"
grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitizer.txt" | tail -2 | tee -a "$LOG"
grep -E "^(MET|MISSED)" "$OUT/bench.txt" | tee -a "$LOG"
