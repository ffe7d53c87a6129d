#!/usr/bin/env bash
# One device call for the demo model on the H200 (see benchmarks/RESULTS.md):
#   stage=ablation  QoQ ablation + the three QoQ recipes, WikiText-2 (148 windows), on CUDA
#   stage=kernels   CLI quantize timing on CUDA, pack, eval through the kernels and through
#                   the reference path on the GPU, greedy generation CPU reference vs kernels
# The demo GGUF (98 MB) exceeds one call's carry: the previous call leaves its first half in
# /tmp/gguf.part1 (a warm machine keeps /tmp), this call carries the second half.
set -uo pipefail
stage=${1:?usage: gpu_qoq_run.sh ablation|kernels}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 QOQTOOL_KERNEL_CACHE=$PWD/.kbuild TOKENIZERS_PARALLELISM=false
M=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
D=$PWD/.carry/data
if [ ! -f "$M" ]; then
  mkdir -p /tmp/smol && cat /tmp/gguf.part1 .carry/gguf.part2 > "$M" || exit 3
fi
sha256sum "$M"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv

if [ "$stage" = ablation ]; then
  timeout "${ABLATION_TIMEOUT:-520}" python3 benchmarks/ablation.py --model "$M" --data-dir "$D" --device cuda \
    --calib wikitext2 --calib-samples 128 --calib-seqlen 1024 --extras-first --rows "${ROWS:-}" \
    --extra "${EXTRA:-qoq-w4a8kv4-g128,qoq-w4a8kv4-g64,qoq-w4a8kv4-chn}" --json "$OUT/ablation.json" 2>&1 | grep -v "it/s" | tee "$OUT/ablation.log"
fi

if [ "$stage" = kernels ]; then
  ( /usr/bin/time -v qoqtool quantize "$M" -r qoq-w4a8kv4-g128 --calib wikitext2 --data-dir "$D" \
      --calib-samples 128 --calib-seqlen 1024 --device cuda -o /tmp/q128 -q --json "$OUT/quantize_cuda.json" ) 2>&1 | tail -25 | tee "$OUT/quantize_cuda.log"
  qoqtool pack /tmp/q128 -o /tmp/p128 --json "$OUT/pack.json" > /dev/null 2>&1
  timeout 120 qoqtool eval /tmp/p128 --tasks wikitext2 --data-dir "$D" --device cuda -q --json "$OUT/eval_packed_kernels.json" 2>&1 | tail -12
  timeout 120 qoqtool eval /tmp/q128 --tasks wikitext2 --data-dir "$D" --device cuda -q --json "$OUT/eval_reference_cuda.json" 2>&1 | tail -12


  timeout 100 python3 -m qoqtool.runtime.generate /tmp/p128 --steps 32 2>&1 | tail -40 | tee "$OUT/generate.log"
fi
