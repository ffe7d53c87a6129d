#!/usr/bin/env bash
# One call on the GPU machine for a change to the small-M GEMM kernels: the candidate (this
# working tree's kernels) is tested, memchecked and timed against a baseline build in the same
# process (benchmarks/library_ab.py), then its per-CTA timelines are taken.
#
#   [TABLES=1] [SD_EXPLORE=1] [WGMMA_AB=1] [AB_ARGS="--no-gemm"] bash benchmarks/gpu_ab_run.sh BASELINE.so.xz [OTHER.so.xz ...]
#   bash benchmarks/gpu_ab_run.sh --tests-only      (the tests and memcheck of this tree's library only)
#
# AB_ARGS go to library_ab.py; SD_EXPLORE=1 adds benchmarks/sparse_dense.py --explore (the fused
# kernel's CTA shapes x activation staging) for the candidate; WGMMA_AB=1 a memcheck of the
# wgmma kernels' forced configurations, the dense A/B at M = 64, 256, 1024 (the wgmma kernel)
# and benchmarks/gemm.py --explore-wgmma for the candidate (WGMMA_EXPLORE=0: not that one;
# WGMMA_AB_ARGS, e.g. "--shapes all", go to that A/B).
# Each further library is a second baseline for the same candidate (a second A/B, ab-<name>.*,
# and with WGMMA_AB=1 a second wgmma A/B, ab-wgmma-<name>.*).
# TIMELINES="a.so.xz b.so.xz": the wgmma kernel's timelines of each such library (probe-9 builds:
# benchmarks/wgmma_probes.sh) on the cases WGMMA_CASES (N:K:M,...), timeline-<name>.txt.
# Carry .kbuild (the candidate, prebuilt here with QOQTOOL_KERNEL_CACHE=$PWD/.kbuild python -m
# qoqtool.kernels.build; one hash folder, ~40 MB) and the baseline library xz-compressed (~4.5 MB;
# e.g. `xz -T2 -3 -c .kbuild/<hash>/libqoqkernels.so > .carry/baseline.so.xz` before the
# candidate is built), both git-ignored. Logs go to $OUT.
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ab_out}
source benchmarks/gpu_stages.sh
setup_machine 300
[ "${1:?baseline}" = --tests-only ] || unxz "$1" /tmp/baseline.so

stage "tests"
timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short --maxfail=15 tests/test_kernels_gemm.py \
  tests/test_sparse_dense_gpu.py tests/test_kernels_w4a16.py tests/test_kernels_fused.py 2>&1 | tee "$OUT/tests.txt" | tail -30

stage "compute-sanitizer memcheck (every stream shape, split and unsplit; fused kernel)"
SAN_IDS=$( (python3 -m pytest --collect-only -q tests/test_kernels_gemm.py | grep -E 'every_configuration_exact\[stream'
  python3 -m pytest --collect-only -q tests/test_sparse_dense_gpu.py |
    grep -E "matches_dense_plus_sparse\[3-0.05-(1|33)-|full_and_empty_buckets\[3-5-|cta_shape_and_staging\[full-and-empty-3-staged-(8|13)-" |
    grep -E "per_group-128|per_channel-0"
) 2>/dev/null)
memcheck 120 $SAN_IDS
[ "$1" = --tests-only ] && exit

stage "A/B against the baseline"
timeout 240 python3 benchmarks/library_ab.py /tmp/baseline.so ${AB_ARGS:-} --json "$OUT/ab.json" 2>&1 | tee "$OUT/ab.txt" | tail -40
for other in "${@:2}"; do
  name=$(basename "$other" .so.xz)
  stage "A/B against $name"
  unxz "$other" "/tmp/$name.so"
  timeout 240 python3 benchmarks/library_ab.py "/tmp/$name.so" ${AB_ARGS:-} --json "$OUT/ab-$name.json" 2>&1 | tee "$OUT/ab-$name.txt" | tail -14
done

if [ -n "${WGMMA_AB:-}" ]; then
  stage "compute-sanitizer memcheck (wgmma kernels, forced configurations)"
  SAN_IDS=$(python3 -m pytest --collect-only -q tests/test_kernels_gemm.py 2>/dev/null |
    grep -E 'every_configuration_exact\[(wgmma|wgmma_k2)1-split(1|2|3)-per_group' | head -9)
  SAN_LOG=sanitizer-wgmma memcheck 120 $SAN_IDS
  stage "A/B against the baseline: the wgmma kernel (M = 64, 256, 1024)"
  timeout 300 python3 benchmarks/library_ab.py /tmp/baseline.so --no-fused --ms 64,256,1024 ${WGMMA_AB_ARGS:-} --json "$OUT/ab-wgmma.json" 2>&1 |
    tee "$OUT/ab-wgmma.txt" | tail -14
  for other in "${@:2}"; do
    name=$(basename "$other" .so.xz)
    stage "A/B against $name: the wgmma kernel"
    timeout 300 python3 benchmarks/library_ab.py "/tmp/$name.so" --no-fused --ms 64,256,1024 ${WGMMA_AB_ARGS:-} \
      --json "$OUT/ab-wgmma-$name.json" 2>&1 | tee "$OUT/ab-wgmma-$name.txt" | tail -14
  done
  if [ "${WGMMA_EXPLORE:-1}" != 0 ]; then
    stage "wgmma choices (candidate)"
    timeout 300 python3 benchmarks/gemm.py --explore-wgmma --json "$OUT/explore-wgmma.json" 2>&1 |
      tee "$OUT/explore-wgmma.txt" | tail -24
  fi
fi

if [ -n "${SD_EXPLORE:-}" ]; then
  stage "fused kernel: CTA shapes x staging (candidate)"
  timeout 200 python3 benchmarks/sparse_dense.py --explore --json "$OUT/sd-explore.json" 2>&1 | tee "$OUT/sd-explore.txt" | tail -30
fi

for lib in ${TIMELINES:-}; do
  name=$(basename "$lib" .so.xz)
  stage "wgmma timelines ($name)"
  unxz "$lib" "/tmp/$name.so"
  timeout 200 python3 benchmarks/gemm_timeline.py --library "/tmp/$name.so" \
    --cases "${WGMMA_CASES:-4096:4096:256,11008:4096:256}" 2>&1 | tee "$OUT/timeline-$name.txt" | tail -40
done

stage "timelines (candidate)"
timeout 60 python3 benchmarks/gemm_timeline.py --cases 4096:4096:16,8192:8192:16,4096:4096:1 --json "$OUT/timeline.json" \
  2>&1 | tee "$OUT/timeline.txt" | tail -40
timeout 60 python3 benchmarks/gemm_timeline.py --outliers 0.01 --cases 4096:4096:16,4096:4096:8,14336:4096:16 \
  --json "$OUT/timeline-fused.json" 2>&1 | tee "$OUT/timeline-fused.txt" | tail -40

if [ -n "${TABLES:-}" ]; then  # TABLES=1: the candidate's full tables too (benchmarks/RESULTS.md)
  stage "gemm table (candidate)"
  timeout 150 python3 benchmarks/gemm.py --json "$OUT/gemm.json" 2>&1 | tee "$OUT/gemm.txt" | tail -25
  stage "sparse-dense targets (candidate)"
  timeout 120 python3 benchmarks/sparse_dense.py --targets --json "$OUT/sd.json" 2>&1 | tee "$OUT/sd.txt" | tail -25
fi

# At most 8 files come back from a call: everything but the log in one archive.
(cd "$OUT" && tar -czf results.tgz --exclude=log.txt --exclude=results.tgz ./* && find . -type f ! -name log.txt ! -name results.tgz -delete)
