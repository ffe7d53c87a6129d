// W8A8 GEMM: INT8 per-token activations x packed INT8 per-channel weights -> fp16.
// The weight fragment of a lane is 32 bytes (two 128-bit loads) and needs no dequantization;
// out = acc * sx[m] * s[n]. Kernels and tiles: gemm_kernels.cuh; the choice by M:
// qoqtool.runtime.cuda_ops.plan. `out_i32` writes the raw INT32 accumulations (tests).
#include "gemm_kernels.cuh"

using qoq::gemm::Kind;
using qoq::gemm::Params;

extern "C" int qoq_w8a8_gemm(int kernel, int tile, int splits, const int8_t* x, const __half* x_scale,
                             const int8_t* qweight, const __half* scale, void* out, int out_i32, int M, int N, int Kp,
                             int32_t* workspace, int32_t* counters, cudaStream_t stream) {
  Params p = qoq::gemm::base_params(x, x_scale, reinterpret_cast<const uint8_t*>(qweight), scale, M, N, Kp, splits,
                                    workspace, counters);
  p.out = out;
  p.out_i32 = out_i32;
  return qoq::gemm::launch<Kind::kInt8Channel>(p, kernel, tile, stream);
}
