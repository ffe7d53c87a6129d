#!/usr/bin/env bash
# Foundation benchmarks on the CPU machine (issue 2; issue 9 with RUNS including qoq-*):
# wall time and peak memory of `quantize` and of a full WikiText-2 eval (148 windows) for
# smollm2-135m, one process at a time. Results land in $OUT (default bench-out/): one
# <name>.json per eval, one <name>.time per command (GNU time -v).
#   RUNS="fp32 rtn-w4a8kv4-g64 rtn-w8a8" bash benchmarks/cpu_perplexity.sh
set -euo pipefail
OUT=${OUT:-bench-out}
DATA=${QOQTOOL_DATA_DIR:-$(cd "$(dirname "$0")/../.." && pwd)/shared/data}
RUNS=${RUNS:-"fp32 rtn-w4a8kv4-g64 rtn-w8a8"}
CALIB=${CALIB:-"--calib wikitext2 --calib-samples 64 --calib-seqlen 512"}
mkdir -p "$OUT"
timed() { local name=$1; shift; /usr/bin/time -v -o "$OUT/$name.time" "$@"; }
for run in $RUNS; do
  if [ "$run" = fp32 ]; then
    timed eval-fp32 qoqtool eval smollm2-135m --tasks wikitext2 --data-dir "$DATA" -q --json "$OUT/eval-fp32.json"
  else
    timed "quantize-$run" qoqtool quantize smollm2-135m -r "$run" $CALIB --data-dir "$DATA" \
      -o "$OUT/$run" --overwrite -q --json "$OUT/quantize-$run.json"
    timed "eval-$run" qoqtool eval "$OUT/$run" --tasks wikitext2 --data-dir "$DATA" -q --json "$OUT/eval-$run.json"
  fi
done
