#!/bin/bash
# GGUF part 3, then perplexity by decoding of g128: kernels (fp32 and fp16 float parts), GPU reference linears, CPU reference path
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
cp .gpucarry/p3 /tmp/g/
OUT=$OUT JOBS=decode DECODE_CHAINS=g128 DECODE_EVALS="kernels kernels-fp16 reference cpu" CPU_THREADS=16 \
  DECODE_QUANT="--calib-samples 16" timeout 580 bash benchmarks/gpu_quality_run.sh quality
