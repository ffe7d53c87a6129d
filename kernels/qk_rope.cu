// Queries and keys, from the q/k projections' output to what attention reads, in one launch:
//
//   qoq_qk_norm_rope   per head: RMSNorm (Qwen3's q_norm / k_norm; optional), RoPE, the online
//                      key rotation R (the rotate step's key_hadamard; optional) and, for the
//                      keys, the key shift c (the center_keys step; optional)
//
// Why: in the paged-cache loop (qoqtool.runtime.generate) torch spends 6 launches on RoPE, 1 on
// R and 1 on the shift, and for Qwen3 16 more on the two norms - per layer and decode step, on
// tensors of a few KB. In a CUDA graph each launch still costs microseconds of the step's serial
// chain: for Qwen3-8B's 36 layers that was ~800 launches a step.
//
// Semantics: those of the torch path (qoqtool.runtime.fusion.rotary_queries_and_keys falls back
// to it), with each of its elementwise ops rounding as torch's CUDA ops do: fp32 arithmetic on
// fp16 operands, one rounding to fp16 per op. RoPE and the shift are therefore torch's to the
// bit; the norm's sum of squares and R's products sum in another order (and rsqrtf is approximate),
// so with a norm or R the outputs agree up to rounding.
//   RMSNorm   y = fp16(w * fp16(x * rsqrt(sum(x^2) / D + eps)))       transformers' Qwen3RMSNorm
//   RoPE      z_i = fp16(fp16(y_i cos_i) + fp16(-y_{i+D/2} sin_i))     i <  D/2   apply_rotary_pos_emb
//             z_i = fp16(fp16(y_i cos_i) + fp16( y_{i-D/2} sin_i))     i >= D/2   (rotate_half)
//   R         z = fp16(z R), fp32 sums                                  both @ R
//   shift     keys: z = fp16(z - fp16(c_head))                           key - c
//
// Layout: token r's query heads at q + r * q_stride (Hq x D contiguous) and its key heads at
// k + r * k_stride (Hkv x D): row-strided views into the q/k/v GEMM's output, read in place;
// cos, sin [rows, D]; outputs q_out [rows, Hq, D] and k_out [rows, Hkv, D], contiguous (for a
// decode step, already the [B, H, D] rows the cache append and the decode kernel take).
#include <algorithm>

#include "common.cuh"

namespace qoq::qk_rope {

constexpr int kWarps = 8;          // head rows in flight per CTA, one per warp
constexpr int kMaxJ = 8;           // D = 32 J: up to 256
constexpr int kMaxRotateJ = 4;     // R [D, D] fp16 in static shared memory: up to 128 (32 KB)
constexpr int kCtasPerSm = 2;      // a grid of at most this many CTAs per SM walks all rows

struct Params {
  const __half* q;
  const __half* k;
  long long q_stride, k_stride;  // elements between consecutive tokens
  const __half* cos;
  const __half* sin;
  const __half* q_weight;  // [D] or null (then k_weight is null too: no norm)
  const __half* k_weight;
  float eps;
  const __half* rotation;  // [D, D] row-major, or null
  const float* shift;      // [Hkv, D], or null
  int rows, q_heads, kv_heads;
  __half* q_out;
  __half* k_out;
};

// The value torch would store for an fp32 result in an fp16 tensor.
__device__ __forceinline__ float fp16_round(float v) { return __half2float(__float2half_rn(v)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <int J, bool NORM, bool ROTATE>
__global__ void __launch_bounds__(kWarps * kWarp) qk_norm_rope_kernel(const Params p) {
  constexpr int D = kWarp * J;
  // R is read by every warp for every row: staged once per CTA. (A 1-element array when unused.)
  __shared__ __align__(16) __half rotation[ROTATE ? D * D : 1];
  // One head row per warp, for the two cross-lane reads: RoPE's partner element and z R.
  __shared__ float row_buf[kWarps][D];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  pdl_launch_dependents();  // the next kernel (the cache append) may launch; it waits for us
  if constexpr (ROTATE) {
    // R does not depend on the kernel before us (the q/k/v GEMM): staged before the wait, while
    // that kernel finishes (when launched as a dependent launch). All of a thread's 16-byte loads
    // are issued before its first store: a rolled loop would wait out one L2 round trip per load.
    constexpr int kChunks = D * D / 8, kThreads = kWarps * kWarp, kPerThread = (kChunks + kThreads - 1) / kThreads;
    uint4 staged[kPerThread];
#pragma unroll
    for (int s = 0; s < kPerThread; ++s)
      if (s * kThreads + threadIdx.x < kChunks)
        staged[s] = __ldg(reinterpret_cast<const uint4*>(p.rotation) + s * kThreads + threadIdx.x);
#pragma unroll
    for (int s = 0; s < kPerThread; ++s)
      if (s * kThreads + threadIdx.x < kChunks) reinterpret_cast<uint4*>(rotation)[s * kThreads + threadIdx.x] = staged[s];
    __syncthreads();
  }
  pdl_wait();  // the q/k/v GEMM (which writes q, k) has finished
  float* row = row_buf[warp];
  const int heads = p.q_heads + p.kv_heads;
  const long long items = static_cast<long long>(p.rows) * heads;
  for (long long item = static_cast<long long>(blockIdx.x) * kWarps + warp; item < items;
       item += static_cast<long long>(gridDim.x) * kWarps) {
    const int token = static_cast<int>(item / heads), head = static_cast<int>(item % heads);
    const bool is_key = head >= p.q_heads;
    const int kv_head = head - p.q_heads;
    const __half* src = is_key ? p.k + token * p.k_stride + kv_head * D : p.q + token * p.q_stride + head * D;
    float v[J];  // lane holds elements lane + 32 j: every load and store is one coalesced 64-byte line
#pragma unroll
    for (int j = 0; j < J; ++j) v[j] = __half2float(src[lane + kWarp * j]);

    if constexpr (NORM) {
      float squares = 0.f;
#pragma unroll
      for (int j = 0; j < J; ++j) squares += v[j] * v[j];
      const float inv = rsqrtf(warp_sum(squares) * (1.f / D) + p.eps);
      const __half* w = is_key ? p.k_weight : p.q_weight;
#pragma unroll
      for (int j = 0; j < J; ++j) v[j] = fp16_round(__half2float(w[lane + kWarp * j]) * fp16_round(v[j] * inv));
    }

    // RoPE: element i pairs with i +- D/2, another lane's (or, for D a multiple of 64, another j's).
#pragma unroll
    for (int j = 0; j < J; ++j) row[lane + kWarp * j] = v[j];
    __syncwarp();
    const __half* cos_row = p.cos + static_cast<long long>(token) * D;
    const __half* sin_row = p.sin + static_cast<long long>(token) * D;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int i = lane + kWarp * j;
      const float rotated_half = i < D / 2 ? -row[i + D / 2] : row[i - D / 2];
      // Each product rounded to fp16 before the sum (torch's three ops): fp16_round's conversion
      // also keeps the compiler from contracting a product and the add into one FMA.
      v[j] = fp16_round(fp16_round(v[j] * __half2float(cos_row[i])) + fp16_round(rotated_half * __half2float(sin_row[i])));
    }

    if constexpr (ROTATE) {
      __syncwarp();  // every lane has read its partner before the row is overwritten
#pragma unroll
      for (int j = 0; j < J; ++j) row[lane + kWarp * j] = v[j];
      __syncwarp();
      float acc[J] = {};
#pragma unroll 8
      for (int r = 0; r < D; ++r) {
        const float x = row[r];  // a broadcast; R's row r: consecutive lanes, consecutive columns
#pragma unroll
        for (int j = 0; j < J; ++j) acc[j] += x * __half2float(rotation[r * D + lane + kWarp * j]);
      }
#pragma unroll
      for (int j = 0; j < J; ++j) v[j] = fp16_round(acc[j]);
    }

    __half* dst;
    if (is_key) {
      if (p.shift != nullptr) {
#pragma unroll
        for (int j = 0; j < J; ++j) v[j] = fp16_round(v[j] - fp16_round(p.shift[kv_head * D + lane + kWarp * j]));
      }
      dst = p.k_out + (static_cast<long long>(token) * p.kv_heads + kv_head) * D;
    } else {
      dst = p.q_out + (static_cast<long long>(token) * p.q_heads + head) * D;
    }
#pragma unroll
    for (int j = 0; j < J; ++j) dst[lane + kWarp * j] = __float2half_rn(v[j]);
    __syncwarp();  // the row buffer is free for the warp's next item
  }
}

inline cudaError_t current_device_sms(int* sms) {
  int device = 0;
  QOQ_RETURN_IF_ERROR(cudaGetDevice(&device));
  return cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device);
}

template <int J>
int launch(const Params& p, cudaStream_t stream) {
  static int sms = 0;  // (queried once; a process with GPUs of different sizes only over-subscribes)
  if (sms == 0) QOQ_RETURN_IF_ERROR(current_device_sms(&sms));
  const long long items = static_cast<long long>(p.rows) * (p.q_heads + p.kv_heads);
  const int grid = static_cast<int>(std::min<long long>((items + kWarps - 1) / kWarps, static_cast<long long>(sms) * kCtasPerSm));
  const bool norm = p.q_weight != nullptr, rotate = p.rotation != nullptr;
  const auto go = [&](auto kernel) {
    return static_cast<int>(qoq::launch_maybe_pdl(kernel, dim3(grid), dim3(kWarps * kWarp), 0, stream,
                                                  qoq::fused_dependent_launch(), p));
  };
  if constexpr (J <= kMaxRotateJ) {
    if (rotate) return norm ? go(qk_norm_rope_kernel<J, true, true>) : go(qk_norm_rope_kernel<J, false, true>);
  } else {
    if (rotate) return cudaErrorInvalidValue;
  }
  return norm ? go(qk_norm_rope_kernel<J, true, false>) : go(qk_norm_rope_kernel<J, false, false>);
}

}  // namespace qoq::qk_rope

// q [rows, *] with token r's Hq x D query heads at q + r * q_stride (elements), k likewise with
// Hkv heads; cos, sin [rows, D]; q_weight and k_weight [D] (both or neither); rotation [D, D]
// (16-byte aligned; D <= 128) or null; shift [Hkv, D] fp32 or null; q_out [rows, Hq, D], k_out
// [rows, Hkv, D]. D a multiple of 32 up to 256 (cudaErrorInvalidValue otherwise).
extern "C" int qoq_qk_norm_rope(const __half* q, const __half* k, long long q_stride, long long k_stride,
                                const __half* cos, const __half* sin, const __half* q_weight, const __half* k_weight,
                                float eps, const __half* rotation, const float* shift, int rows, int q_heads,
                                int kv_heads, int head_dim, __half* q_out, __half* k_out, cudaStream_t stream) {
  using namespace qoq::qk_rope;
  if (rows <= 0) return cudaSuccess;
  if (head_dim % qoq::kWarp || head_dim > qoq::kWarp * kMaxJ || (q_weight == nullptr) != (k_weight == nullptr) ||
      q_heads <= 0 || kv_heads <= 0)
    return cudaErrorInvalidValue;
  const Params p{q, k, q_stride, k_stride, cos, sin, q_weight, k_weight, eps, rotation, shift, rows, q_heads, kv_heads,
                 q_out, k_out};
  switch (head_dim / qoq::kWarp) {
    case 1: return launch<1>(p, stream);
    case 2: return launch<2>(p, stream);
    case 3: return launch<3>(p, stream);
    case 4: return launch<4>(p, stream);
    case 5: return launch<5>(p, stream);
    case 6: return launch<6>(p, stream);
    case 7: return launch<7>(p, stream);
    default: return launch<8>(p, stream);
  }
}
