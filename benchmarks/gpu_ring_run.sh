#!/usr/bin/env bash
# One call on the GPU machine for the ring kernel (issue 4, small M): install, tests (ring and
# the existing GEMM tests), a compute-sanitizer memcheck of four ring cases, then the
# stream-vs-ring exploration. Logs and JSON go to $OUT (the device tool brings them back).
#
#   bash benchmarks/gpu_ring_run.sh          (about 7 minutes at most; carry .kbuild)
#
# The library is prebuilt on the CPU machine into .kbuild (carry it with the call) with
#   QOQTOOL_KERNEL_CACHE=$PWD/.kbuild python -m qoqtool.kernels.build --jobs 2
# and rebuilt here only if the sources differ. Each stage has its own time limit and the
# later stages run even when an earlier one fails.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ring_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 QOQTOOL_KERNEL_CACHE=$PWD/.kbuild
source benchmarks/gpu_stages.sh
setup_machine 150

stage "tests (ring kernel, then every GEMM test)"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short --maxfail=20 \
  tests/test_kernels_ring.py tests/test_kernels_gemm.py 2>&1 | tee "$OUT/tests.txt" | tail -60
TESTS_RC=$?

stage "compute-sanitizer memcheck (ring: small split, wrapped ring W8 unsplit, deep ring split, 4096^2)"
SAN_IDS=$(python3 -m pytest --collect-only -q tests/test_kernels_ring.py 2>/dev/null |
  grep -E 'every_split\[per_group-0-3\]|wraps\[(w8a8-3-1|per_group-4-3)\]|benchmark_shapes\[per_channel-4096-4096-1\]')
echo "$SAN_IDS" | tee -a "$LOG"
memcheck 75 $SAN_IDS

stage "benchmark: stream vs ring, M <= 32"
timeout 150 python3 benchmarks/gemm.py --explore-small --json "$OUT/ring.json" 2>&1 | tee "$OUT/bench.txt" | tail -40
BENCH_RC=$?

stage "summary"
echo "tests rc=$TESTS_RC  sanitizer rc=$SAN_RC  benchmark rc=$BENCH_RC" | tee -a "$LOG"
grep -E "passed|failed" "$OUT/tests.txt" | tail -2 | tee -a "$LOG"
grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitizer.txt" | tail -2 | tee -a "$LOG"
