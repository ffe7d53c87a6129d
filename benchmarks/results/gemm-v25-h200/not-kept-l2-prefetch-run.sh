#!/usr/bin/env bash
# One device call (version 25): the candidate (weights' L2 prefetch a ring ahead + wgmma trace
# stamps) tested, memchecked, timed against the committed library and against the prefetch-only
# build (the stamps' cost), then timelines of the wgmma kernel at M = 256.
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/v25_out}
source benchmarks/gpu_stages.sh
setup_machine 300
unxz() { python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" "$1" "$2"; }
unxz .carry/base.so.xz /tmp/baseline.so; unxz .carry/prefetch.so.xz /tmp/prefetch.so
stage "gemm tests"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short --maxfail=10 tests/test_kernels_gemm.py 2>&1 | tee "$OUT/tests.txt" | tail -6
stage "memcheck wgmma forced"
SAN_IDS=$(python3 -m pytest --collect-only -q tests/test_kernels_gemm.py 2>/dev/null | grep -E 'every_configuration_exact\[(wgmma1|wgmma2|wgmma_k21|wgmma_k2t641)-split(1|3)-per_group')
SAN_LOG=sanitizer-wgmma memcheck 150 $SAN_IDS
stage "A/B wgmma against the committed library"
timeout 150 python3 benchmarks/library_ab.py /tmp/baseline.so --no-fused --ms 32,64,256,1024 --shapes all 2>&1 | tee "$OUT/ab-wgmma.txt" | tail -10
stage "A/B wgmma against the prefetch-only build (the stamps' cost)"
timeout 150 python3 benchmarks/library_ab.py /tmp/prefetch.so --no-fused --ms 64,256,1024 --shapes all 2>&1 | tee "$OUT/ab-stamps.txt" | tail -8
stage "timelines M = 256"
timeout 120 python3 benchmarks/gemm_timeline.py --cases 4096:4096:256,11008:4096:256,8192:8192:256,4096:4096:1024 2>&1 | tee "$OUT/timeline.txt" | tail -60
