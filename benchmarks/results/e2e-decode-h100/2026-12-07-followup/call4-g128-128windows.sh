#!/bin/bash
# kernels vs the GPU reference linears by decoding, on 8x the windows (128 x 256 tokens)
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 QOQTOOL_KERNEL_CACHE=/tmp/g/kbuild PYTHONPATH=/tmp/site
W=(--tasks wikitext2 --data-dir /tmp/g/data --seqlen 256 --max-windows 128 -q --device cuda --decode-batch 16)
date +%T; timeout 120 qoqtool eval /tmp/q/decode-g128-packed "${W[@]}" --json $OUT/k128.json 2>&1 | tail -1
date +%T; timeout 120 qoqtool eval /tmp/q/decode-g128-packed "${W[@]}" --dtype float16 --json $OUT/k128-fp16.json 2>&1 | tail -1
date +%T; timeout 250 qoqtool eval /tmp/q/decode-g128 "${W[@]}" --json $OUT/r128.json 2>&1 | tail -1
date +%T; python3 benchmarks/compare_ppl.py $OUT/r128.json $OUT/k128.json $OUT/k128-fp16.json
