#!/usr/bin/env bash
# Does `--outliers 1%` improve a GPTQ recipe beyond GPTQ's own spread between calibration
# samples? For each calibration seed, quantize smollm2-135m with and without the outliers on
# the same calibration text, evaluate both on the same WikiText-2 windows, and print each
# seed's paired perplexity ratio (benchmarks/compare_ppl.py). One pair is not an answer:
# GPTQ's result moves by ~1-2% between calibration samples (and between thread counts).
#   SEEDS="0 1 2 3" WINDOWS=40 RECIPE=qoq-w4a8kv4-g128 bash benchmarks/outlier_seeds.sh
# Results land in $OUT (default bench-out/outlier-seeds): quantize-s<seed>-<share>.json and
# eval-s<seed>-<share>.json for each run, the folders beside them.
set -euo pipefail
OUT=${OUT:-bench-out/outlier-seeds}
DATA=${QOQTOOL_DATA_DIR:-$(cd "$(dirname "$0")/../.." && pwd)/shared/data}
SEEDS=${SEEDS:-"0 1 2 3"}
WINDOWS=${WINDOWS:-40}
RECIPE=${RECIPE:-qoq-w4a8kv4-g128}
SHARE=${SHARE:-1%}
TAG=${SHARE%\%}  # the share in file names: 1% -> s<seed>-1
mkdir -p "$OUT"
for seed in $SEEDS; do
  for tag in none "$TAG"; do
    name="s$seed-$tag"
    extra=(); [ "$tag" = none ] || extra=(--outliers "$SHARE")
    qoqtool quantize smollm2-135m -r "$RECIPE" --calib wikitext2 --seed "$seed" "${extra[@]}" --data-dir "$DATA" \
      -o "$OUT/$name" --overwrite -q --json "$OUT/quantize-$name.json"
    qoqtool eval "$OUT/$name" --tasks wikitext2 --max-windows "$WINDOWS" --data-dir "$DATA" -q \
      --json "$OUT/eval-$name.json"
  done
  python "$(dirname "$0")/compare_ppl.py" "$OUT/eval-s$seed-none.json" "$OUT/eval-s$seed-$TAG.json" | tail -1
done
