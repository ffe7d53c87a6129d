// The small kernels between the GEMMs: per-token INT8 quantization, fused with what
// produces its input, so each activation is read once and written once as INT8.
//
//   qoq_quantize_per_token   x                      -> (x_q, x_scale, x_rowsum)
//   qoq_rmsnorm_quantize     RMSNorm(x) * weight    -> (x_q, x_scale, x_rowsum)
//   qoq_silu_mul_quantize    silu(gate) * up        -> (x_q, x_scale, x_rowsum)
//   qoq_silu_mul_rotate_quantize
//                            fp16((silu(gate) * up) R) -> (x_q, x_scale, x_rowsum), R the online
//                            down_proj rotation (qoqtool.runtime.mlp.KroneckerRotation) of a
//                            Kronecker form Sylvester(a) (x) F (a = 32..1024, m x m, m <= 32)
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

// The token's scale from this thread's |max| over its values (a block reduction; its barrier
// also orders the block's earlier shared-memory writes): fp16(amax / 127), at least 2^-24, and
// the same as the float the codes are divided by.
struct TokenScale {
  __half h;
  float f;
};
__device__ __forceinline__ TokenScale token_scale(float amax, float* scratch) {
  amax = block_reduce(amax, [](float a, float b) { return fmaxf(a, b); }, 0.f, scratch);
  const __half h = __float2half_rn(fmaxf(__fdiv_rn(amax, 127.f), kFp16Tiny));
  return {h, fmaxf(__half2float(h), kFp16Tiny)};
}

// One INT8 code: an IEEE division by the fp16-rounded scale, rounded to nearest even, clamped.
__device__ __forceinline__ int token_code(float v, float scale) {
  return max(-127, min(127, __float2int_rn(__fdiv_rn(v, scale))));
}

// The token's scale and the sum of its codes (this thread's part in `sum`), by thread 0.
__device__ __forceinline__ void store_token(int sum, __half scale, int* scratch, __half* xs, int32_t* rowsum,
                                            size_t row) {
  sum = block_reduce(sum, [](int a, int b) { return a + b; }, 0, scratch);
  if (threadIdx.x == 0) {
    xs[row] = scale;
    rowsum[row] = sum;
  }
}

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
  const TokenScale scale = token_scale(amax, scratch_f);

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
      const int q = token_code(v[it][j], scale.f);
      sum += q;
      packed[j / 4] |= (static_cast<uint32_t>(q) & 0xFFu) << (8 * (j % 4));
    }
    *reinterpret_cast<uint2*>(out + at) = make_uint2(packed[0], packed[1]);  // Kp % 32 == 0: aligned
  }
  store_token(sum, scale.h, scratch_i, p.xs, p.rowsum, row);
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

// silu(gate) * up, rotated, quantized: the online down_proj rotation of the default recipe
// (qoqtool.runtime.mlp) inside the quantization kernel instead of ~8 small kernels (an fp32 cast,
// two tensordots with their permuted copies, the signs, the cast back). One CTA per token; the
// row lives in shared memory as X [a, m] (index r m + c), and R = (S_a / sqrt(a)) (x) F diag(s)
// acts as y = vec(S_a^T X F) * s / sqrt(a): S_a the Sylvester Hadamard matrix of order a = 32 RPL
// (symmetric), F the scaled m x m factor as KroneckerRotation holds it (fp32), s the signs.
//  * S_a^T X: a warp per column (a column's a values, RPL per lane: row 32 k + lane in register
//    k), butterflies between rows r and r + h in registers (h >= 32) and by shuffles (h < 32) -
//    no barrier and no index arithmetic between the log2(a) passes (a first version with a pass
//    per barrier over the whole shared row, its indices by division, took ~20 us a token at
//    14336 = 512 x 28 on an H200: slower than the unfused kernels at batch 1 and 16);
//  * X F: a thread per row, F in shared memory read as float4 (rows padded to 4 columns).
// Then fp16 (the unfused path casts the rotation back to the model's dtype) and the quantization of
// row_quantize_kernel, to the same rules. The sums run in another order than the unfused path's
// GEMMs: codes may differ by one at rounding boundaries (tests/test_kernels_fused.py bounds how often).
constexpr int kRotateThreads = 512;
constexpr int kRotateMaxM = 32;  // the dense factor's order (Llama-3, Mistral: 28; SmolLM2: 12); 64 spilled

struct RotateParams {
  const __half* gate;
  const __half* up;
  const float* factor;  // [m, m]
  const float* signs;   // [K]
  int M, K, Kp, a, m;
  int8_t* xq;
  __half* xs;
  int32_t* rowsum;
};

template <int RPL, int MMAX>
__global__ void __launch_bounds__(kRotateThreads) silu_mul_rotate_quantize_kernel(const RotateParams p) {
  extern __shared__ float rotate_smem[];  // the row [K], then F [m][m4]
  __shared__ float scratch_f[32];
  __shared__ int scratch_i[32];
  pdl_launch_dependents();
  const int m = p.m, m4 = (m + 3) & ~3, lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  float* x = rotate_smem;
  float* f = rotate_smem + p.K;
  const size_t row = blockIdx.x;
  for (int i = threadIdx.x; i < m * m4; i += kRotateThreads) {
    const int c = i / m4, j = i - c * m4;
    f[i] = j < m ? p.factor[c * m + j] : 0.f;
  }
  for (int i = threadIdx.x; i < p.K; i += kRotateThreads) {
    const float g = __half2float(p.gate[row * p.K + i]), u = __half2float(p.up[row * p.K + i]);
    x[i] = round_fp16(__fdividef(g, 1.f + __expf(-g)) * u);  // as qoq_silu_mul_quantize
  }
  __syncthreads();
  // S_a^T X, a warp per column.
  for (int c = warp; c < m; c += kRotateThreads / kWarp) {
    float v[RPL];
#pragma unroll
    for (int k = 0; k < RPL; ++k) v[k] = x[(32 * k + lane) * m + c];
#pragma unroll
    for (int h = 1; h < 32; h *= 2) {  // rows r and r + h: lanes lane and lane ^ h
      const bool upper = lane & h;
#pragma unroll
      for (int k = 0; k < RPL; ++k) {
        const float o = __shfl_xor_sync(0xffffffffu, v[k], h);
        v[k] = upper ? o - v[k] : v[k] + o;
      }
    }
#pragma unroll
    for (int h = 1; h < RPL; h *= 2)  // rows 32 k and 32 (k + h): registers k and k + h
#pragma unroll
      for (int k = 0; k < RPL; ++k)
        if (!(k & h)) {
          const float u = v[k], w = v[k + h];
          v[k] = u + w;
          v[k + h] = u - w;
        }
#pragma unroll
    for (int k = 0; k < RPL; ++k) x[(32 * k + lane) * m + c] = v[k];
  }
  __syncthreads();
  // (S_a^T X) F, a thread per row (in place: a thread owns its rows).
  if (m > 1) {
    for (int r = threadIdx.x; r < p.a; r += kRotateThreads) {
      float out[MMAX];
#pragma unroll
      for (int j = 0; j < MMAX; ++j) out[j] = 0.f;
#pragma unroll
      for (int c = 0; c < MMAX; ++c) {
        if (c >= m) break;
        const float in = x[r * m + c];
#pragma unroll
        for (int j = 0; j < MMAX; j += 4) {
          if (j >= m) break;
          const float4 w = *reinterpret_cast<const float4*>(f + c * m4 + j);
          out[j] = fmaf(in, w.x, out[j]);
          out[j + 1] = fmaf(in, w.y, out[j + 1]);
          out[j + 2] = fmaf(in, w.z, out[j + 2]);
          out[j + 3] = fmaf(in, w.w, out[j + 3]);
        }
      }
#pragma unroll
      for (int j = 0; j < MMAX; ++j)
        if (j < m) x[r * m + j] = out[j];
    }
    __syncthreads();
  }
  const float inv_sqrt_a = rsqrtf(static_cast<float>(p.a));
  float amax = 0.f;
  for (int i = threadIdx.x; i < p.K; i += kRotateThreads) {
    const float v = round_fp16(x[i] * inv_sqrt_a * p.signs[i]);
    x[i] = v;
    amax = fmaxf(amax, fabsf(v));
  }
  const TokenScale scale = token_scale(amax, scratch_f);  // (its barrier orders x too)
  int sum = 0;
  int8_t* out = p.xq + row * p.Kp;
  for (int i = threadIdx.x * 4; i < p.Kp; i += kRotateThreads * 4) {  // Kp % 32 == 0: whole words
    uint32_t packed = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int q = i + j < p.K ? token_code(x[i + j], scale.f) : 0;
      sum += q;
      packed |= (static_cast<uint32_t>(q) & 0xFFu) << (8 * j);
    }
    *reinterpret_cast<uint32_t*>(out + i) = packed;
  }
  store_token(sum, scale.h, scratch_i, p.xs, p.rowsum, row);
}

template <int RPL, int MMAX>
cudaError_t launch_rotate(const RotateParams& p, cudaStream_t stream) {
  const int smem = 4 * (p.K + p.m * ((p.m + 3) & ~3));
  const auto kernel = silu_mul_rotate_quantize_kernel<RPL, MMAX>;
  QOQ_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<p.M, kRotateThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <int MMAX>
cudaError_t launch_rotate_rows(const RotateParams& p, cudaStream_t stream) {
  switch (p.a / kWarp) {  // rows per lane of a column's warp
    case 1: return launch_rotate<1, MMAX>(p, stream);
    case 2: return launch_rotate<2, MMAX>(p, stream);
    case 4: return launch_rotate<4, MMAX>(p, stream);
    case 8: return launch_rotate<8, MMAX>(p, stream);
    case 16: return launch_rotate<16, MMAX>(p, stream);
    case 32: return launch_rotate<32, MMAX>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace qoq::fused

using qoq::fused::Op;

// gate, up [M, K] fp16; factor [m, m] fp32; signs [K] fp32; K = a * m with a a power of two from
// 32 to 1024 and m <= kRotateMaxM (m = 1: no dense factor); the row in shared memory.
extern "C" int qoq_silu_mul_rotate_quantize(const __half* gate, const __half* up, const float* factor, const float* signs,
                                            int M, int K, int Kp, int a, int m, int8_t* xq, __half* xs,
                                            int32_t* rowsum, cudaStream_t stream) {
  if (M <= 0) return cudaSuccess;
  if (a < 32 || a > 1024 || (a & (a - 1)) || m < 1 || m > qoq::fused::kRotateMaxM || a * m != K || Kp % 32 ||
      Kp < K)
    return cudaErrorInvalidValue;
  const qoq::fused::RotateParams p{gate, up, factor, signs, M, K, Kp, a, m, xq, xs, rowsum};
  return m <= 16 ? qoq::fused::launch_rotate_rows<16>(p, stream) : qoq::fused::launch_rotate_rows<32>(p, stream);
}

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
