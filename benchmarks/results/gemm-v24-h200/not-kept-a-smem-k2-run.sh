#!/usr/bin/env bash
# One device call: the A-through-shared-memory K2 form, tested, memchecked and timed against the baseline.
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ss_out}
source benchmarks/gpu_stages.sh
setup_machine 300
python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" .carry/base.so.xz /tmp/baseline.so
stage "gemm tests"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short --maxfail=10 tests/test_kernels_gemm.py 2>&1 | tee "$OUT/tests.txt" | tail -15
stage "memcheck wgmma forced"
SAN_IDS=$(python3 -m pytest --collect-only -q tests/test_kernels_gemm.py 2>/dev/null | grep -E 'every_configuration_exact\[wgmma_k2' | grep -E 'per_group|per_channel' | head -8)
echo "$SAN_IDS"
SAN_LOG=sanitizer-wgmma memcheck 150 $SAN_IDS
stage "A/B wgmma"
timeout 200 python3 benchmarks/library_ab.py /tmp/baseline.so --no-fused --ms 64,256,1024 --shapes all --json "$OUT/ab-wgmma.json" 2>&1 | tee "$OUT/ab-wgmma.txt" | tail -45
stage "explore (candidate)"
timeout ${EXPLORE_S:-100} python3 benchmarks/gemm.py --explore-wgmma --json "$OUT/explore-wgmma.json" 2>&1 | tee "$OUT/explore-wgmma.txt" | tail -30
