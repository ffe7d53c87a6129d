// The small kernels between the GEMMs: per-token INT8 quantization, fused with what
// produces its input, so each activation is read once and written once as INT8.
//
//   qoq_quantize_per_token   x                      -> (x_q, x_scale, x_rowsum)
//   qoq_rmsnorm_quantize     RMSNorm(x) * weight    -> (x_q, x_scale, x_rowsum)
//   qoq_silu_mul_quantize    silu(gate) * up        -> (x_q, x_scale, x_rowsum)
//
// Semantics are those of qoqtool.quantizers.activations.quantize_per_token, to the bit:
// scale = fp16(amax / 127) (at least 2^-24), codes = clamp(rint(x / scale), -127, 127) with
// x / scale an IEEE fp32 division by the fp16-rounded scale. The build uses --use_fast_math,
// so the divisions are written __fdiv_rn explicitly. Rows are zero-padded from K to Kp
// (the GEMMs' padded K); x_rowsum (sum of a row's codes) feeds the per-channel W4 epilogue.
//
// RMSNorm follows transformers' LlamaRMSNorm: fp32 x * rsqrt(mean(x^2) + eps), rounded to
// fp16, times the fp16 weight (one more fp16 rounding). silu(gate) * up is computed in fp32
// and rounded to fp16 once. One CTA per row; the row stays in registers between passes.
#include "common.cuh"

namespace qoq::fused {

constexpr int kThreads = 256;
constexpr int kVec = 8;  // fp16 values per thread and item: one 16-byte load
constexpr float kFp16Tiny = 5.9604644775390625e-08f;  // 2^-24, the smallest fp16 subnormal

enum class Op { kQuantize, kRmsNorm, kSiluMul };

struct Params {
  const __half* x;    // [M, K] (the gate for kSiluMul)
  const __half* aux;  // kRmsNorm: weight [K]; kSiluMul: up [M, K]
  float eps;
  int M, K, Kp;
  int8_t* xq;       // [M, Kp]
  __half* xs;       // [M]
  int32_t* rowsum;  // [M]
};

// Eight consecutive fp16 values from `row` at `at` as floats; zeros past K. VEC: K is a
// multiple of 8 (and rows 16-byte aligned), so an item is either wholly inside or outside.
template <bool VEC>
__device__ __forceinline__ void load8(const __half* row, int at, int K, float (&v)[kVec]) {
  if constexpr (VEC) {
    if (at < K) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(row + at));
      const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
      for (int j = 0; j < kVec / 2; ++j) {
        const float2 f = __half22float2(h[j]);
        v[2 * j] = f.x;
        v[2 * j + 1] = f.y;
      }
      return;
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] = 0.f;
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] = at + j < K ? __half2float(row[at + j]) : 0.f;
  }
}

__device__ __forceinline__ float round_fp16(float v) { return __half2float(__float2half_rn(v)); }

template <int ITEMS, bool VEC, Op OP>
__global__ void __launch_bounds__(kThreads) row_quantize_kernel(const Params p) {
  __shared__ float scratch_f[32];
  __shared__ int scratch_i[32];
  // The GEMM that follows (a programmatic dependent launch, gemm_kernels.cuh) may start its
  // weight loads now; it waits for this grid before it reads what we write.
  pdl_launch_dependents();
  const size_t row = blockIdx.x;
  const __half* x = p.x + row * p.K;
  float v[ITEMS][kVec];
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) load8<VEC>(x, (it * kThreads + threadIdx.x) * kVec, p.K, v[it]);

  if constexpr (OP == Op::kSiluMul) {
    const __half* up = p.aux + row * p.K;
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) {
      float u[kVec];
      load8<VEC>(up, (it * kThreads + threadIdx.x) * kVec, p.K, u);
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[it][j] = round_fp16(__fdividef(v[it][j], 1.f + __expf(-v[it][j])) * u[j]);
    }
  }
  if constexpr (OP == Op::kRmsNorm) {
    float ss = 0.f;
#pragma unroll
    for (int it = 0; it < ITEMS; ++it)
#pragma unroll
      for (int j = 0; j < kVec; ++j) ss += v[it][j] * v[it][j];
    ss = block_reduce(ss, [](float a, float b) { return a + b; }, 0.f, scratch_f);
    const float r = rsqrtf(__fdiv_rn(ss, static_cast<float>(p.K)) + p.eps);
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) {
      float w[kVec];
      load8<VEC>(p.aux, (it * kThreads + threadIdx.x) * kVec, p.K, w);
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[it][j] = round_fp16(round_fp16(v[it][j] * r) * w[j]);
    }
  }

  float amax = 0.f;
#pragma unroll
  for (int it = 0; it < ITEMS; ++it)
#pragma unroll
    for (int j = 0; j < kVec; ++j) amax = fmaxf(amax, fabsf(v[it][j]));
  amax = block_reduce(amax, [](float a, float b) { return fmaxf(a, b); }, 0.f, scratch_f);
  const __half scale_h = __float2half_rn(fmaxf(__fdiv_rn(amax, 127.f), kFp16Tiny));
  const float scale = fmaxf(__half2float(scale_h), kFp16Tiny);

  int sum = 0;
  int8_t* out = p.xq + row * p.Kp;
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int at = (it * kThreads + threadIdx.x) * kVec;
    if (at >= p.Kp) continue;
    uint32_t packed[2] = {0u, 0u};
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      // Past K the value is 0 and so is its code: the padding comes out zero.
      const int q = max(-127, min(127, __float2int_rn(__fdiv_rn(v[it][j], scale))));
      sum += q;
      packed[j / 4] |= (static_cast<uint32_t>(q) & 0xFFu) << (8 * (j % 4));
    }
    *reinterpret_cast<uint2*>(out + at) = make_uint2(packed[0], packed[1]);  // Kp % 32 == 0: aligned
  }
  sum = block_reduce(sum, [](int a, int b) { return a + b; }, 0, scratch_i);
  if (threadIdx.x == 0) {
    p.xs[row] = scale_h;
    p.rowsum[row] = sum;
  }
}

template <bool VEC, Op OP>
cudaError_t launch_vec(const Params& p, cudaStream_t stream) {
  const int items = ceil_div(p.Kp, kThreads * kVec);  // the row, padded, must fit the registers
  const dim3 grid(p.M);
  if (items <= 1) row_quantize_kernel<1, VEC, OP><<<grid, kThreads, 0, stream>>>(p);
  else if (items <= 2) row_quantize_kernel<2, VEC, OP><<<grid, kThreads, 0, stream>>>(p);
  else if (items <= 4) row_quantize_kernel<4, VEC, OP><<<grid, kThreads, 0, stream>>>(p);
  else if (items <= 8) row_quantize_kernel<8, VEC, OP><<<grid, kThreads, 0, stream>>>(p);
  else if (items <= 16) row_quantize_kernel<16, VEC, OP><<<grid, kThreads, 0, stream>>>(p);
  else return cudaErrorInvalidValue;  // Kp > 32768: cuda_ops refuses it before the call
  return cudaGetLastError();
}

template <Op OP>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  if (p.M <= 0) return cudaSuccess;
  if (p.Kp % 32 || p.Kp < p.K) return cudaErrorInvalidValue;
  return p.K % kVec == 0 ? launch_vec<true, OP>(p, stream) : launch_vec<false, OP>(p, stream);
}

}  // namespace qoq::fused

using qoq::fused::Op;

extern "C" int qoq_quantize_per_token(const __half* x, int M, int K, int Kp, int8_t* xq, __half* xs, int32_t* rowsum,
                                      cudaStream_t stream) {
  const qoq::fused::Params p{x, nullptr, 0.f, M, K, Kp, xq, xs, rowsum};
  return qoq::fused::launch<Op::kQuantize>(p, stream);
}

extern "C" int qoq_rmsnorm_quantize(const __half* x, const __half* weight, float eps, int M, int K, int Kp, int8_t* xq,
                                    __half* xs, int32_t* rowsum, cudaStream_t stream) {
  const qoq::fused::Params p{x, weight, eps, M, K, Kp, xq, xs, rowsum};
  return qoq::fused::launch<Op::kRmsNorm>(p, stream);
}

extern "C" int qoq_silu_mul_quantize(const __half* gate, const __half* up, int M, int K, int Kp, int8_t* xq,
                                     __half* xs, int32_t* rowsum, cudaStream_t stream) {
  const qoq::fused::Params p{gate, up, 0.f, M, K, Kp, xq, xs, rowsum};
  return qoq::fused::launch<Op::kSiluMul>(p, stream);
}
