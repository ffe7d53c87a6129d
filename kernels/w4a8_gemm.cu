// W4A8 GEMMs: INT8 per-token activations x packed UINT4 weights -> fp16, INT32 accumulation.
//
//   qoq_w4a8_gemm_per_group    QoQ progressive weights: in the main loop each 32-bit word
//                              of four codes becomes four exact INT8 weights (q - z)*s1
//                              with one multiply-add and one xor (gemm_kernels.cuh,
//                              progressive_quad); epilogue out = acc * sx[m] * s0[n].
//   qoq_w4a8_gemm_per_channel  raw codes multiply the activations; the zero point moves to
//                              the epilogue: out = (acc - z[n] * rowsum(x[m])) * s[n] * sx[m].
//
// The kernels, tile shapes and split-K live in gemm_kernels.cuh; the choice among them by
// M is qoqtool.runtime.cuda_ops.plan. `out_i32` writes the raw INT32 accumulations instead
// of fp16 (after the zero-point term for per-channel): the tests compare them bit for bit.
#include "gemm_kernels.cuh"

using qoq::gemm::Kind;
using qoq::gemm::Params;

extern "C" int qoq_w4a8_gemm_per_group(int kernel, int tile, int splits, const int8_t* x, const __half* x_scale,
                                       const uint8_t* qweight, const __half* scale0, const uint8_t* scale1,
                                       const uint8_t* zero_x_scale1, void* out, int out_i32, int M, int N, int Kp,
                                       int group_shift, int32_t* workspace, int32_t* counters,
                                       cudaStream_t stream) {
  Params p{};
  p.x = x;
  p.x_scale = x_scale;
  p.qweight = qweight;
  p.scale = scale0;
  p.scale1 = scale1;
  p.zxs1 = zero_x_scale1;
  p.out = out;
  p.out_i32 = out_i32;
  p.workspace = workspace;
  p.counters = counters;
  p.M = M;
  p.N = N;
  p.Kp = Kp;
  p.NT = qoq::ceil_div(N, 32);
  p.KT = Kp / 32;
  p.group_shift = group_shift;
  p.groups = p.KT >> group_shift;
  p.splits = splits;
  return qoq::gemm::launch<Kind::kProgressive>(p, kernel, tile, stream);
}

extern "C" int qoq_w4a8_gemm_per_channel(int kernel, int tile, int splits, const int8_t* x, const __half* x_scale,
                                         const int32_t* x_rowsum, const uint8_t* qweight, const __half* scale,
                                         const uint8_t* zero, void* out, int out_i32, int M, int N, int Kp,
                                         int32_t* workspace, int32_t* counters, cudaStream_t stream) {
  Params p{};
  p.x = x;
  p.x_scale = x_scale;
  p.x_rowsum = x_rowsum;
  p.qweight = qweight;
  p.scale = scale;
  p.zero = zero;
  p.out = out;
  p.out_i32 = out_i32;
  p.workspace = workspace;
  p.counters = counters;
  p.M = M;
  p.N = N;
  p.Kp = Kp;
  p.NT = qoq::ceil_div(N, 32);
  p.KT = Kp / 32;
  p.splits = splits;
  return qoq::gemm::launch<Kind::kUInt4Channel>(p, kernel, tile, stream);
}
