#!/bin/bash
# 1 % outliers: kernels (fused sparse-dense at M = 16) vs the GPU reference linears by decoding, 128 x 256 tokens
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 QOQTOOL_KERNEL_CACHE=/tmp/g/kbuild PYTHONPATH=/tmp/site
q=/tmp/q/decode-outliers1
date +%T; qoqtool quantize smollm2-135m -r qoq-w4a8kv4-g128 --outliers 1% --calib-samples 16 --calib wikitext2 --data-dir /tmp/g/data \
  --device cuda -o $q -q --overwrite > /dev/null 2>&1
date +%T; qoqtool pack $q -o $q-packed --overwrite > /dev/null 2>&1
W=(--tasks wikitext2 --data-dir /tmp/g/data --seqlen 256 --max-windows 128 -q --device cuda --decode-batch 16)
date +%T; timeout 120 qoqtool eval $q-packed "${W[@]}" --json $OUT/o-k128.json 2>&1 | tail -1
date +%T; timeout 120 qoqtool eval $q-packed "${W[@]}" --dtype float16 --json $OUT/o-k128-fp16.json 2>&1 | tail -1
date +%T; timeout 250 qoqtool eval $q "${W[@]}" --json $OUT/o-r128.json 2>&1 | tail -1
date +%T; python3 benchmarks/compare_ppl.py $OUT/o-r128.json $OUT/o-k128.json $OUT/o-k128-fp16.json
