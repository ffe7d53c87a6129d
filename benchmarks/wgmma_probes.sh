#!/usr/bin/env bash
# The wgmma kernel taken apart: libraries built from this checkout's kernels with parts of the
# main loop removed (benchmarks/wgmma_probes.patch, compiled with QOQ_WGMMA_PROBE = n), each
# timed against the unmodified library in one process (benchmarks/library_ab.py). A probe's
# results are wrong by design; its time says what the removed part costs.
#   1 no feed: the ring is filled once, later stages reuse stale slots without waiting
#   2 no dequantization: the raw code words go to the tensor cores
#   3 no wgmma: the A fragments are folded into the accumulators by xor
#   4 = 1 + 2   5 refills without activations   6 refills without weights / group parameters
#   7 = 1 + 3   8 = 2 + 3
#   9 nothing removed: the kernel with the stream kernel's timeline stamps (their checks cost ~2%),
#     for benchmarks/gemm_timeline.py --library (run: the timelines of CASES, N:K:M,...)
#
#   bash benchmarks/wgmma_probes.sh build [N ...]   on this machine: .carry/base.so.xz (the unmodified
#                                                   library) and .carry/pN.so.xz (~7 MB each)
#   bash benchmarks/wgmma_probes.sh run [N ...]     on the GPU machine, carrying .carry; MS, SHAPES
#                                                   (library_ab.py --ms / --shapes) and OUT as usual
# Records of the first run: benchmarks/results/gemm-v25-h200/, notes-gemm.md version 25.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?build or run}
shift
probes=${*:-1 2 3 4 5 6 7 8 9}
case "$mode" in
build)
  mkdir -p .carry
  work=$(mktemp -d)
  base=$(python3 kernels/build.py | tail -1)  # this checkout's library (its usual cache)
  xz -T0 -6 -c "$base" > .carry/base.so.xz
  for n in $probes; do
    rm -rf "$work/kernels"
    cp -r kernels "$work/kernels"
    patch -s -p1 -d "$work" < benchmarks/wgmma_probes.patch
    sed -i "s/^#define QOQ_WGMMA_PROBE 0$/#define QOQ_WGMMA_PROBE $n/" "$work/kernels/gemm_wgmma.cuh"
    lib=$(QOQTOOL_KERNEL_CACHE=$work/cache$n python3 "$work/kernels/build.py" | tail -1)
    xz -T0 -6 -c "$lib" > ".carry/p$n.so.xz"
    echo "probe $n: .carry/p$n.so.xz"
  done
  rm -rf "$work"
  ;;
run)
  OUT=${OUT:-/tmp/probe_out}
  export QOQTOOL_KERNEL_CACHE=/tmp/kcache
  set +e
  source benchmarks/gpu_stages.sh
  # The unmodified library goes where this checkout's build would be cached, so setup_machine finds it.
  base="$QOQTOOL_KERNEL_CACHE/$(python3 -c 'import sys; sys.path.insert(0, "kernels"); import build; print(build.library_path().parent.name)')/libqoqkernels.so"
  mkdir -p "$(dirname "$base")"
  unxz .carry/base.so.xz "$base"
  setup_machine 300
  for n in $probes; do
    unxz ".carry/p$n.so.xz" "/tmp/p$n.so"
    if [ "$n" = 9 ]; then
      stage "timelines (probe 9)"
      timeout 200 python3 benchmarks/gemm_timeline.py --library /tmp/p9.so --cases "${CASES:-4096:4096:256,11008:4096:256}" \
        2>&1 | tee "$OUT/timeline.txt" | tail -40
      continue
    fi
    stage "probe $n against the unmodified library"
    timeout 150 python3 benchmarks/library_ab.py "$base" --candidate "/tmp/p$n.so" --no-fused --ms "${MS:-64,256,1024}" \
      --shapes "${SHAPES:-all}" 2>&1 | tee "$OUT/probe$n.txt" | tail -8
  done
  ;;
*)
  echo "wgmma_probes.sh: unknown mode '$mode'; use build or run" >&2
  exit 2
  ;;
esac
