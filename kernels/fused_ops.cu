// The small kernels between the GEMMs: per-token INT8 quantization, fused with what
// produces its input, so each activation is read once and written once as INT8.
//
//   qoq_quantize_per_token   x                      -> (x_q, x_scale, x_rowsum)
//   qoq_rmsnorm_quantize     RMSNorm(x) * weight    -> (x_q, x_scale, x_rowsum)
//   qoq_add_rmsnorm_quantize h = x + delta, then the same for RMSNorm(h) * weight, and h written:
//                            the decoder's residual add in the kernel that reads its sum next
//   qoq_add_rmsnorm          RMSNorm(x [+ delta]) * weight in fp16, not quantized (fp16 models)
//   qoq_silu_mul_quantize    silu(gate) * up        -> (x_q, x_scale, x_rowsum)
//   qoq_silu_mul_rotate_quantize
//                            fp16((silu(gate) * up) R) -> (x_q, x_scale, x_rowsum), R the online
//                            down_proj rotation (qoqtool.runtime.mlp.KroneckerRotation) of a
//                            Kronecker form Sylvester(a) (x) F (a = 32..1024, m x m, m <= 32)
//   qoq_silu_mul_rotate_quantize_bits
//                            the same for F = H / sqrt(m), H a +-1 matrix of an even order up to
//                            512 given as sign bits, on the tensor cores
//
// Semantics are those of qoqtool.quantizers.activations.quantize_per_token, to the bit:
// scale = fp16(amax / 127) (at least 2^-24), codes = clamp(rint(x / scale), -127, 127) with
// x / scale an IEEE fp32 division by the fp16-rounded scale. The build uses --use_fast_math,
// so the divisions are written __fdiv_rn explicitly. Rows are zero-padded from K to Kp
// (the GEMMs' padded K); x_rowsum (sum of a row's codes) feeds the per-channel W4 epilogue.
//
// RMSNorm follows transformers' LlamaRMSNorm: fp32 x * rsqrt(mean(x^2) + eps), rounded to
// fp16, times the fp16 weight (one more fp16 rounding). The residual add is torch's fp16 add
// (an fp32 sum rounded once), so add_rmsnorm_quantize is rmsnorm_quantize of x + delta to the bit. silu(gate) * up is computed in fp32
// and rounded to fp16 once. One CTA per row; the row stays in registers between passes.
#include "common.cuh"

namespace qoq::fused {

constexpr int kThreads = 256;
constexpr int kVec = 8;  // fp16 values per thread and item: one 16-byte load
constexpr float kFp16Tiny = 5.9604644775390625e-08f;  // 2^-24, the smallest fp16 subnormal

// kRmsNormHalf / kAddRmsNormHalf: the norm's fp16 output itself, not quantized (fp16 models).
enum class Op { kQuantize, kRmsNorm, kAddRmsNorm, kSiluMul, kRmsNormHalf, kAddRmsNormHalf };

struct Params {
  const __half* x;    // [M, K] (the gate for kSiluMul)
  const __half* aux;  // kRmsNorm: weight [K]; kSiluMul: up [M, K]
  float eps;
  int M, K, Kp;
  int8_t* xq;       // [M, Kp]
  __half* xs;       // [M]
  int32_t* rowsum;  // [M]
  const __half* delta = nullptr;  // kAddRmsNorm: added to x first ([M, K]) ...
  __half* sum = nullptr;          // ... and the sum written here ([M, K]; not x: x is read through the
                                  // read-only cache, which a write during the kernel would break)
  __half* out = nullptr;          // k*RmsNormHalf: the normalized rows [M, K] (xq, xs, rowsum unused)
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

// The counterpart of load8: eight values (already fp16-exact) stored from `at`, none past K.
template <bool VEC>
__device__ __forceinline__ void store8(__half* row, int at, int K, const float (&v)[kVec]) {
  if constexpr (VEC) {
    if (at < K) {
      uint4 raw;
      __half2* h = reinterpret_cast<__half2*>(&raw);
#pragma unroll
      for (int j = 0; j < kVec / 2; ++j) h[j] = __floats2half2_rn(v[2 * j], v[2 * j + 1]);
      *reinterpret_cast<uint4*>(row + at) = raw;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j)
      if (at + j < K) row[at + j] = __float2half_rn(v[j]);
  }
}

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
  constexpr bool kAdd = OP == Op::kAddRmsNorm || OP == Op::kAddRmsNormHalf;
  constexpr bool kHalf = OP == Op::kRmsNormHalf || OP == Op::kAddRmsNormHalf;
  constexpr bool kNorm = kAdd || kHalf || OP == Op::kRmsNorm;
  // The norm's weight does not depend on the kernel before us (we too may be a dependent launch):
  // read it before the wait, where it fits the registers (ITEMS <= 4: K up to 8192), so that its
  // latency is not paid after the row's sum of squares.
  constexpr bool kEarlyWeight = kNorm && ITEMS <= 4;
  float w_early[kEarlyWeight ? ITEMS : 1][kVec];
  if constexpr (kEarlyWeight) {
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) load8<VEC>(p.aux, (it * kThreads + threadIdx.x) * kVec, p.K, w_early[it]);
  }
  pdl_wait();  // the previous kernel (which writes x, delta) has finished
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
  if constexpr (kAdd) {  // the residual add first, its sum written out
    const __half* d = p.delta + row * p.K;
    __half* out = p.sum + row * p.K;
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) {
      const int at = (it * kThreads + threadIdx.x) * kVec;
      float dv[kVec];
      load8<VEC>(d, at, p.K, dv);
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[it][j] = round_fp16(v[it][j] + dv[j]);
      store8<VEC>(out, at, p.K, v[it]);
    }
  }
  if constexpr (kNorm) {
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
      if constexpr (kEarlyWeight) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) w[j] = w_early[it][j];
      } else {
        load8<VEC>(p.aux, (it * kThreads + threadIdx.x) * kVec, p.K, w);
      }
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[it][j] = round_fp16(round_fp16(v[it][j] * r) * w[j]);
    }
  }
  if constexpr (kHalf) {
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) store8<VEC>(p.out + row * p.K, (it * kThreads + threadIdx.x) * kVec, p.K, v[it]);
    return;
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
  const auto go = [&](auto kernel) {
    return launch_maybe_pdl(kernel, dim3(p.M), dim3(kThreads), 0, stream, fused_dependent_launch(), p);
  };
  if (items <= 1) return go(row_quantize_kernel<1, VEC, OP>);
  if (items <= 2) return go(row_quantize_kernel<2, VEC, OP>);
  if (items <= 4) return go(row_quantize_kernel<4, VEC, OP>);
  if (items <= 8) return go(row_quantize_kernel<8, VEC, OP>);
  if (items <= 16) return go(row_quantize_kernel<16, VEC, OP>);
  return cudaErrorInvalidValue;  // Kp > 32768: cuda_ops refuses it before the call
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
// row lives in shared memory as X [a, m] (value r m + c at row r, column c), and R = (S_a / sqrt(a))
// (x) F diag(s) acts as y = vec(S_a^T X F) * s / sqrt(a): S_a the Sylvester Hadamard matrix of order
// a = 32 RPL (symmetric), F the scaled m x m factor as KroneckerRotation holds it (fp32), s the
// signs (+-1).
//  * S_a^T X: a warp per column (sylvester_columns);
//  * X F, by the factor's order:
//    - m <= kRotateMaxM (Llama-3 / Mistral 28, the demo 12): a thread per row on the CUDA cores,
//      F in shared memory read as float4 (rows padded to 4 columns) - silu_mul_rotate_quantize_kernel;
//    - m even up to kRotateMaxBitsM (Llama-2's 344, Qwen2.5's 76-148, TinyLlama's 44), where a
//      thread per row would need m accumulators and a x m^2 multiply-adds on one SM: on the tensor
//      cores, F = H / sqrt(m) with H the +-1 Hadamard factor given as sign bits -
//      silu_mul_rotate_quantize_mma_kernel, below (runtime.fusion picks the form by m);
// then fp16 (the unfused path casts the rotation back to the model's dtype) and the quantization of
// row_quantize_kernel, to the same rules (the CUDA-core kernel from its registers, the tensor-core
// one by rotate_quantize_tail). The sums run in another order than
// the unfused path's GEMMs: codes may differ by one at rounding boundaries
// (tests/test_kernels_fused.py bounds how often).
constexpr int kRotateThreads = 512;
constexpr int kRotateMaxM = 32;       // the CUDA-core factor's largest order; 64 spilled
constexpr int kRotateMaxBitsM = 512;  // the tensor-core factor's largest order
constexpr int kRotateMaxSmem = 227 * 1024;  // a CTA's dynamic shared memory on sm_90 (rotate_mma_smem bounds a x m)

struct RotateParams {
  const __half* gate;
  const __half* up;
  const float* factor;     // [m, m] (CUDA-core path)
  const uint32_t* hbits;   // [m][ceil(m / 32)]: bit k % 32 of word [n][k / 32] set <=> H[k, n] = -1 (tensor-core path)
  const float* signs;      // [K], +-1 (the CUDA-core kernel reads only their sign bits)
  int M, K, Kp, a, m;
  int8_t* xq;
  __half* xs;
  int32_t* rowsum;
};

// S_a^T X in place for X = x as [a, m] in shared memory, row r at r * pitch (a = 32 RPL), a warp per column (a
// column's a values, RPL per lane: row 32 k + lane in register k), butterflies between rows r
// and r + h in registers (h >= 32) and by shuffles (h < 32) - no barrier and no index arithmetic
// between the log2(a) passes (a first version with a pass per barrier over the whole shared
// row, its indices by division, took ~20 us a token at 14336 = 512 x 28 on an H200: slower than
// the unfused kernels at batch 1 and 16).
template <int RPL>
__device__ __forceinline__ void sylvester_columns(float* x, int m, int pitch) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  for (int c = warp; c < m; c += kRotateThreads / kWarp) {
    float v[RPL];
#pragma unroll
    for (int k = 0; k < RPL; ++k) v[k] = x[(32 * k + lane) * pitch + c];
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
    for (int k = 0; k < RPL; ++k) x[(32 * k + lane) * pitch + c] = v[k];
  }
}

// The rotated row x [K] (in shared memory, before its scale) -> y = fp16(x * scale * s), and
// y's codes, scale and code sum as row_quantize_kernel writes them. Starts with no barrier: the
// caller has made x visible.
__device__ __forceinline__ void rotate_quantize_tail(const RotateParams& p, float* x, float scale_all, size_t row,
                                                     float* scratch_f, int* scratch_i) {
  float amax = 0.f;
  for (int i = threadIdx.x; i < p.K; i += kRotateThreads) {
    const float v = round_fp16(x[i] * scale_all * p.signs[i]);
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

// The CUDA-core form. One CTA per token is all the GPU runs at batch 1, so the kernel is one chain
// of latencies; it is laid out to keep that chain short (version 3; version 2 took ~16 us a token
// for Qwen3-8B's 12288 = 1024 x 12 in an H100 decode step, as long as a GEMM):
//  * every global read is sent before the first one is used: the factor (cp.async), the signs of
//    the rows this thread will own at the end, then gate and up as 16-byte vectors (version 2:
//    scalar loads in loops, a round trip per few elements, and the signs read in the tail);
//  * X sits in shared memory with an odd row pitch (m | 1), so a column's 32 lanes (sylvester_columns)
//    and a row per lane (X F) each hit 32 different banks (with pitch m = 12 or 28: 4-way conflicts);
//  * after S_a^T X, a thread multiplies its own rows by F and keeps the results in registers
//    through the signs, the fp16 rounding, the token's |max| and the codes: the rotated row never
//    goes back to shared memory, and each thread writes its rows' codes (m bytes, whole words
//    when m % 4 == 0).
// Bit for bit version 2's results: the same products in the same order.
constexpr int kRotateLoadBatch = 4;  // gate / up vectors in flight per thread

__device__ __forceinline__ float flip_if(float v, uint32_t negative) {
  return __uint_as_float(__float_as_uint(v) ^ (negative << 31));
}

template <int RPL, int MMAX>
__global__ void __launch_bounds__(kRotateThreads, 1) silu_mul_rotate_quantize_kernel(const RotateParams p) {
  constexpr int kRows = ceil_div(32 * RPL, kRotateThreads);  // rows of X a thread owns in X F (a = 32 RPL)
  extern __shared__ float rotate_smem[];  // X [a][pitch], then F [m][m4]
  __shared__ float scratch_f[32];
  __shared__ int scratch_i[32];
  pdl_launch_dependents();
  const int m = p.m, m4 = (m + 3) & ~3, pitch = m | 1, a = p.a;
  float* x = rotate_smem;
  float* f = rotate_smem + a * pitch;
  const size_t row = blockIdx.x;

  // F, zero-padded to m4 columns (float4 reads below), by cp.async: no registers held for it.
  for (int i = threadIdx.x; i < m * m4; i += kRotateThreads) {
    const int c = i / m4, j = i - c * m4;
    if (j < m) {
      cp_async_4(smem_u32(f + i), p.factor + c * m + j);
    } else {
      f[i] = 0.f;
    }
  }
  cp_async_commit();
  // The signs (+-1) of this thread's rows r = threadIdx.x + kRotateThreads * t (used after X F;
  // kept as bits once they have arrived).
  float sign[kRows][MMAX];
#pragma unroll
  for (int t = 0; t < kRows; ++t) {
    const int r = threadIdx.x + kRotateThreads * t;
#pragma unroll
    for (int c = 0; c < MMAX; ++c) sign[t][c] = r < a && c < m ? __ldg(p.signs + r * m + c) : 0.f;
  }
  // silu(gate) * up into X: 8 values a vector (K = a m is a multiple of 32), value i at row i / m,
  // column i % m.
  const int vectors = p.K / kVec;
  const __half* gate = p.gate + row * p.K;
  const __half* up = p.up + row * p.K;
  for (int base = threadIdx.x; base < vectors; base += kRotateLoadBatch * kRotateThreads) {
    uint4 g[kRotateLoadBatch], u[kRotateLoadBatch];
#pragma unroll
    for (int b = 0; b < kRotateLoadBatch; ++b) {
      const int v = base + b * kRotateThreads;
      if (v < vectors) {
        g[b] = __ldg(reinterpret_cast<const uint4*>(gate) + v);
        u[b] = __ldg(reinterpret_cast<const uint4*>(up) + v);
      }
    }
#pragma unroll
    for (int b = 0; b < kRotateLoadBatch; ++b) {
      const int v = base + b * kRotateThreads;
      if (v >= vectors) break;
      const __half2* gh = reinterpret_cast<const __half2*>(&g[b]);
      const __half2* uh = reinterpret_cast<const __half2*>(&u[b]);
      int r = v * kVec / m, c = v * kVec - r * m;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float gv = e % 2 ? __high2float(gh[e / 2]) : __low2float(gh[e / 2]);
        const float uv = e % 2 ? __high2float(uh[e / 2]) : __low2float(uh[e / 2]);
        x[r * pitch + c] = round_fp16(__fdividef(gv, 1.f + __expf(-gv)) * uv);  // as qoq_silu_mul_quantize
        if (++c == m) {
          c = 0;
          ++r;
        }
      }
    }
  }
  uint32_t negative[kRows] = {};
#pragma unroll
  for (int t = 0; t < kRows; ++t)
#pragma unroll
    for (int c = 0; c < MMAX; ++c) negative[t] |= static_cast<uint32_t>(sign[t][c] < 0.f) << c;
  cp_async_wait_all();
  __syncthreads();
  sylvester_columns<RPL>(x, m, pitch);
  __syncthreads();

  // (S_a^T X) F for this thread's rows, then y = fp16(. / sqrt(a) * s), s = +-1 a sign flip (exact,
  // as the product): kept as fp16 pairs.
  const float scale_all = rsqrtf(static_cast<float>(a));
  __half2 y[kRows][MMAX / 2];
  float amax = 0.f;
#pragma unroll
  for (int t = 0; t < kRows; ++t) {
    const int r = threadIdx.x + kRotateThreads * t;
    float out[MMAX];
#pragma unroll
    for (int j = 0; j < MMAX; ++j) out[j] = 0.f;
    if (r < a) {
#pragma unroll
      for (int c = 0; c < MMAX; ++c) {
        if (c >= m) break;
        const float in = x[r * pitch + c];
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
    }
#pragma unroll
    for (int j = 0; j < MMAX; j += 2) {  // (columns past m, and rows past a, are zeros)
      const float y0 = round_fp16(flip_if(out[j] * scale_all, negative[t] >> j & 1u));
      const float y1 = round_fp16(flip_if(out[j + 1] * scale_all, negative[t] >> (j + 1) & 1u));
      amax = fmaxf(amax, fmaxf(fabsf(y0), fabsf(y1)));
      y[t][j / 2] = __floats2half2_rn(y0, y1);
    }
  }
  const TokenScale scale = token_scale(amax, scratch_f);

  // The codes of this thread's rows at r m .. r m + m - 1; the padding K .. Kp zeroed by all.
  int sum = 0;
  int8_t* out = p.xq + row * p.Kp;
#pragma unroll
  for (int t = 0; t < kRows; ++t) {
    const int r = threadIdx.x + kRotateThreads * t;
    if (r >= a) break;
    uint32_t packed[MMAX / 4] = {};
#pragma unroll
    for (int j = 0; j < MMAX; ++j) {
      if (j >= m) break;
      const __half2 pair = y[t][j / 2];
      const int q = token_code(j % 2 ? __high2float(pair) : __low2float(pair), scale.f);
      sum += q;
      packed[j / 4] |= (static_cast<uint32_t>(q) & 0xFFu) << (8 * (j % 4));
    }
    if (m % 4 == 0) {  // r m is then a multiple of 4, and the row's base is (Kp % 32 == 0)
#pragma unroll
      for (int w = 0; w < MMAX / 4; ++w)
        if (4 * w < m) *reinterpret_cast<uint32_t*>(out + r * m + 4 * w) = packed[w];
    } else {
#pragma unroll
      for (int j = 0; j < MMAX; ++j)
        if (j < m) out[r * m + j] = static_cast<int8_t>(packed[j / 4] >> (8 * (j % 4)));
    }
  }
  for (int i = p.K + 4 * threadIdx.x; i < p.Kp; i += 4 * kRotateThreads) *reinterpret_cast<uint32_t*>(out + i) = 0u;
  store_token(sum, scale.h, scratch_i, p.xs, p.rowsum, row);
}

// The tensor-core form, for factors F = H / sqrt(m) of an even order up to kRotateMaxBitsM, H +-1. The
// two products may go in either order (S_a^T X F = S_a^T (X F)), so X F comes first: X is then the SiLU product itself,
// which is exactly fp16 (rounded once, as qoq_silu_mul_quantize), and H is exactly +-1 in fp16, so
// Z = X H on the fp16 tensor cores with fp32 accumulation is the product to fp32 summation order -
// no operand split, no overflow (|z| <= m * 65504 fits fp32). Then S_a^T Z in fp32 as above, and the
// scale 1 / sqrt(a m) with the signs.
// Shared memory: X fp16 [a][pitch] (pitch = m rounded up to 16, plus 8: an odd number of 16-byte
// pieces per row, so ldmatrix's eight row reads hit eight different bank groups; zero past m,
// which also zeroes the k16 steps' reach past m), Z fp32 [a][m] (the row, index r m + c), the sign
// bits [m][W].
// Z = X H by warps, each taking blocks of 2 m16 row tiles x 4 n8 column tiles (32 fp32 accumulators):
// per k16 step two ldmatrix.x4 (the A fragments of both row tiles), per column tile its B fragment
// built from two 2-bit fields of one sign word (+-1 fp16 pairs: 0x3C00 with the sign bit set by the
// bit), eight mma.m16n8k16. B is never stored as fp16: m^2 halves would not fit beside the row at
// m = 344 (236 KB), the bits take m^2 / 8 bytes.
constexpr int kMmaRowTiles = 2, kMmaColTiles = 4;

__host__ __device__ constexpr int rotate_pitch(int m) { return ((m + 15) & ~15) + 8; }
__host__ __device__ constexpr int rotate_words(int m) { return (m + 31) / 32; }
__host__ __device__ constexpr int rotate_mma_smem(int a, int m) {
  return a * rotate_pitch(m) * 2 + a * m * 4 + m * rotate_words(m) * 4;
}

// The B fragment of mma.m16n8k16 for column n = 8 nt + g and k = 16 ks + {2t, 2t+1} (b0) and
// {2t+8, 2t+9} (b1): H[k, n] as fp16 +-1 pairs from the sign word holding k's bits.
__device__ __forceinline__ void hadamard_fragment(uint32_t word, int ks, int t, uint32_t& b0, uint32_t& b1) {
  const uint32_t lo = word >> (16 * (ks & 1) + 2 * t), hi = lo >> 8;  // bits 2t, 2t+1 and 2t+8, 2t+9 at the bottom
  b0 = 0x3C003C00u | ((lo & 1u) << 15) | ((lo & 2u) << 30);
  b1 = 0x3C003C00u | ((hi & 1u) << 15) | ((hi & 2u) << 30);
}

template <int RPL>
__global__ void __launch_bounds__(kRotateThreads) silu_mul_rotate_quantize_mma_kernel(const RotateParams p) {
  extern __shared__ __align__(16) uint8_t rotate_mma_smem_bytes[];
  __shared__ float scratch_f[32];
  __shared__ int scratch_i[32];
  pdl_launch_dependents();
  const int m = p.m, a = p.a, pitch = rotate_pitch(m), words = rotate_words(m);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, g = lane / 4, t = lane % 4;
  __half* xh = reinterpret_cast<__half*>(rotate_mma_smem_bytes);
  float* z = reinterpret_cast<float*>(rotate_mma_smem_bytes + a * pitch * 2);
  uint32_t* bits = reinterpret_cast<uint32_t*>(rotate_mma_smem_bytes + a * pitch * 2 + a * m * 4);
  const size_t row = blockIdx.x;
  for (int i = threadIdx.x; i < m * words; i += kRotateThreads) bits[i] = p.hbits[i];
  // X: a warp per row r (the token's values r m .. r m + m - 1), zeros from m to the pitch.
  for (int r = warp; r < a; r += kRotateThreads / kWarp) {
    const size_t at = row * p.K + static_cast<size_t>(r) * m;
    for (int c = lane; c < pitch; c += kWarp) {
      float v = 0.f;
      if (c < m) {
        const float gv = __half2float(p.gate[at + c]), uv = __half2float(p.up[at + c]);
        v = __fdividef(gv, 1.f + __expf(-gv)) * uv;  // as qoq_silu_mul_quantize
      }
      xh[r * pitch + c] = __float2half_rn(v);
    }
  }
  __syncthreads();
  const int row_tiles = a / 16, col_tiles = (m + 7) / 8, k_steps = (m + 15) / 16;
  const int row_blocks = row_tiles / kMmaRowTiles, col_blocks = (col_tiles + kMmaColTiles - 1) / kMmaColTiles;
  // ldmatrix rows: lane l gives row l % 16 of the tile, k + 8 (l / 16) (matrices: rows 0-7 / 8-15 x
  // k 0-7 / 8-15, i.e. the A fragment's a0a1, a2a3, a4a5, a6a7).
  const uint32_t a_lane = smem_u32(xh) + ((lane % 16) * pitch + (lane / 16) * 8) * 2;
  for (int blk = warp; blk < row_blocks * col_blocks; blk += kRotateThreads / kWarp) {
    const int rt0 = (blk / col_blocks) * kMmaRowTiles, ct0 = (blk % col_blocks) * kMmaColTiles;
    float acc[kMmaRowTiles][kMmaColTiles][4] = {};
    for (int ks = 0; ks < k_steps; ++ks) {
      uint32_t afrag[kMmaRowTiles][4];
#pragma unroll
      for (int i = 0; i < kMmaRowTiles; ++i) ldmatrix_x4(afrag[i], a_lane + ((rt0 + i) * 16 * pitch + ks * 16) * 2);
#pragma unroll
      for (int j = 0; j < kMmaColTiles; ++j) {
        const int n = (ct0 + j) * 8 + g;  // columns past m: any B (their outputs are dropped)
        uint32_t b0, b1;
        hadamard_fragment(n < m ? bits[n * words + ks / 2] : 0u, ks, t, b0, b1);
#pragma unroll
        for (int i = 0; i < kMmaRowTiles; ++i) mma_f16_16816(acc[i][j], afrag[i], b0, b1);
      }
    }
#pragma unroll
    for (int i = 0; i < kMmaRowTiles; ++i)
#pragma unroll
      for (int j = 0; j < kMmaColTiles; ++j) {
        const int r = (rt0 + i) * 16 + g, n = (ct0 + j) * 8 + 2 * t;  // C: rows g, g + 8; columns 2t, 2t + 1
        if (n < m) {  // (m even: both columns or neither)
          *reinterpret_cast<float2*>(z + r * m + n) = make_float2(acc[i][j][0], acc[i][j][1]);
          *reinterpret_cast<float2*>(z + (r + 8) * m + n) = make_float2(acc[i][j][2], acc[i][j][3]);
        }
      }
  }
  __syncthreads();
  sylvester_columns<RPL>(z, m, m);
  __syncthreads();
  rotate_quantize_tail(p, z, rsqrtf(static_cast<float>(a)) * rsqrtf(static_cast<float>(m)), row, scratch_f, scratch_i);
}

template <int RPL, int MMAX>
cudaError_t launch_rotate(const RotateParams& p, cudaStream_t stream) {
  const int smem = 4 * (p.a * (p.m | 1) + p.m * ((p.m + 3) & ~3));
  const auto kernel = silu_mul_rotate_quantize_kernel<RPL, MMAX>;
  QOQ_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<p.M, kRotateThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <int RPL>
cudaError_t launch_rotate_mma(const RotateParams& p, cudaStream_t stream) {
  const int smem = rotate_mma_smem(p.a, p.m);
  const auto kernel = silu_mul_rotate_quantize_mma_kernel<RPL>;
  QOQ_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<p.M, kRotateThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

// launch(std::integral_constant<int, RPL>) for the rows per lane of a column's warp, RPL = a / 32.
template <class LAUNCH>
cudaError_t launch_by_rows(int a, LAUNCH&& launch) {
  switch (a / kWarp) {
    case 1: return launch(std::integral_constant<int, 1>{});
    case 2: return launch(std::integral_constant<int, 2>{});
    case 4: return launch(std::integral_constant<int, 4>{});
    case 8: return launch(std::integral_constant<int, 8>{});
    case 16: return launch(std::integral_constant<int, 16>{});
    case 32: return launch(std::integral_constant<int, 32>{});
  }
  return cudaErrorInvalidValue;
}

// K = a m with a a power of two from 32 to 1024.
inline bool rotate_shape_ok(int K, int Kp, int a, int m) {
  return a >= 32 && a <= 1024 && !(a & (a - 1)) && m >= 1 && a * m == K && Kp % 32 == 0 && Kp >= K;
}

}  // namespace qoq::fused

using qoq::fused::Op;

// gate, up [M, K] fp16; factor [m, m] fp32; signs [K] fp32, +-1; K = a * m with a a power of two from
// 32 to 1024 and m <= kRotateMaxM (m = 1: no dense factor); the row in shared memory.
extern "C" int qoq_silu_mul_rotate_quantize(const __half* gate, const __half* up, const float* factor, const float* signs,
                                            int M, int K, int Kp, int a, int m, int8_t* xq, __half* xs,
                                            int32_t* rowsum, cudaStream_t stream) {
  using namespace qoq::fused;
  if (M <= 0) return cudaSuccess;
  if (!rotate_shape_ok(K, Kp, a, m) || m > kRotateMaxM) return cudaErrorInvalidValue;
  const RotateParams p{gate, up, factor, nullptr, signs, M, K, Kp, a, m, xq, xs, rowsum};
  return launch_by_rows(a, [&](auto rpl) {
    return m <= 16 ? launch_rotate<decltype(rpl)::value, 16>(p, stream) : launch_rotate<decltype(rpl)::value, 32>(p, stream);
  });
}

// The same with the second factor H / sqrt(m), H +-1 of an even order 2..kRotateMaxBitsM given as
// sign bits (hbits [m][ceil(m / 32)] uint32: bit k % 32 of word [n][k / 32] set <=> H[k, n] = -1),
// on the tensor cores; the shared memory of rotate_mma_smem(a, m) within the device's limit
// (cudaErrorInvalidValue otherwise).
extern "C" int qoq_silu_mul_rotate_quantize_bits(const __half* gate, const __half* up, const uint32_t* hbits,
                                                 const float* signs, int M, int K, int Kp, int a, int m, int8_t* xq,
                                                 __half* xs, int32_t* rowsum, cudaStream_t stream) {
  using namespace qoq::fused;
  if (M <= 0) return cudaSuccess;
  if (!rotate_shape_ok(K, Kp, a, m) || m > kRotateMaxBitsM || m % 2 ||
      rotate_mma_smem(a, m) > kRotateMaxSmem)
    return cudaErrorInvalidValue;
  const RotateParams p{gate, up, nullptr, hbits, signs, M, K, Kp, a, m, xq, xs, rowsum};
  return launch_by_rows(a, [&](auto rpl) { return launch_rotate_mma<decltype(rpl)::value>(p, stream); });
}

extern "C" int qoq_fused_set_dependent_launch(int enabled) {
  qoq::fused_dependent_launch() = enabled != 0;
  return cudaSuccess;
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

// x + delta -> sum (fp16), then qoq_rmsnorm_quantize of the sum; sum overlaps neither x nor delta.
extern "C" int qoq_add_rmsnorm_quantize(const __half* x, const __half* delta, const __half* weight, float eps, int M,
                                        int K, int Kp, __half* sum, int8_t* xq, __half* xs, int32_t* rowsum,
                                        cudaStream_t stream) {
  const qoq::fused::Params p{x, weight, eps, M, K, Kp, xq, xs, rowsum, delta, sum};
  return qoq::fused::launch<Op::kAddRmsNorm>(p, stream);
}

// RMSNorm(x + delta) * weight -> out (fp16), with x + delta -> sum, or without delta (null) of x
// alone: the norms of a model whose linears are not quantized. out and sum overlap neither input.
extern "C" int qoq_add_rmsnorm(const __half* x, const __half* delta, const __half* weight, float eps, int M, int K,
                               __half* sum, __half* out, cudaStream_t stream) {
  using qoq::fused::Op;
  const int Kp = qoq::ceil_div(K, 32) * 32;  // (sizes the register tile; nothing is padded)
  qoq::fused::Params p{x, weight, eps, M, K, Kp, nullptr, nullptr, nullptr, delta, sum, out};
  return delta != nullptr ? qoq::fused::launch<Op::kAddRmsNormHalf>(p, stream)
                          : qoq::fused::launch<Op::kRmsNormHalf>(p, stream);
}

extern "C" int qoq_silu_mul_quantize(const __half* gate, const __half* up, int M, int K, int Kp, int8_t* xq,
                                     __half* xs, int32_t* rowsum, cudaStream_t stream) {
  const qoq::fused::Params p{gate, up, 0.f, M, K, Kp, xq, xs, rowsum};
  return qoq::fused::launch<Op::kSiluMul>(p, stream);
}
