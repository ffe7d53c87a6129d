// W4A16 GEMMs for small M: fp16 activations x packed UINT4 weights with fp16 group scales and
// UINT4 zero points -> fp16, on the fp16 tensor cores with fp32 accumulation.
//
//   qoq_w4a16_gemm               out[m, n] = fp16(sum_k x[m, k] * (q[n, k] - z[n, g]) * s[n, g])
//   qoq_w4a16_sparse_dense_gemm  the same plus the linear's fp16 Tile-COO outliers,
//                                sum_k S[n, k] * x[m, k], in the same accumulators (issue 8)
//
// The weight stream of the W4A8 stream kernel (gemm_stream.cuh: CTA = 2 row tiles x 4 warps
// splitting K, chunks of U k-tiles loaded global -> registers, k-slice reduction, split-K),
// with three differences:
//  * The packed W4 fragment (qoqtool/packing/layout.py) gives lane (g, t) the codes of rows
//    g + 8i at k = 4t + j (low nibbles) and 16 + 4t + j (high nibbles). mma.m16n8k16 wants
//    rows g, g + 8 at k = 2t, 2t + 1 (a0, a1) and 2t + 8, 2t + 9 (a2, a3). Calling physical
//    k 16h + 4t + j the step-h k "2t + j" (j < 2) and "8 + 2t + j - 2" (j >= 2) makes bytes 0, 1 of a word
//    the lane's a0/a1 pair and bytes 2, 3 its a2/a3 pair, and the activations the lane needs for
//    step h are x[16h + 4t .. 16h + 4t + 3]: ONE 8-byte load gives both B registers.
//  * Dequantization, per pair of codes: a byte permute spreads two bytes into the halves of
//    a word, one LOP3 keeps a nibble and ORs in the exponent of 1024 (0x6400 | q is 1024 + q;
//    a high nibble gives 1024 + 16q), one HSUB2 / HFMA2 removes 1024 + z exactly (integers
//    below 2048 are exact in fp16; 16q is scaled back by 1/16, exactly), one HMUL2 applies the
//    group scale: (q - z) * s rounded once to fp16, as a dequantized fp16 weight would be.
//  * Split-K and the k-slice tree carry fp32 partial sums (the fused W4A8 kernel's outlier
//    path: p.sparse_workspace); the INT32 workspace that reduce_splits also fills holds zeros.
#include "gemm_kernels.cuh"

namespace qoq::gemm {

// Two codes of a fragment word (bytes 2*pair and 2*pair + 1, low or high nibbles) as the fp16
// pair (q - z) * s.
template <bool HIGH>
__device__ __forceinline__ uint32_t w4_pair_f16(uint32_t w, int pair, __half2 s, __half2 z_lo, __half2 z_hi) {
  const uint32_t spread = __byte_perm(w, 0, pair ? 0x4342 : 0x4140);  // [b0, 0, b1, 0] or [b2, 0, b3, 0]
  uint32_t v = (spread & (HIGH ? 0x00F000F0u : 0x000F000Fu)) | 0x64006400u;  // 1024 + q or 1024 + 16q
  __half2 d = *reinterpret_cast<__half2*>(&v);
  d = HIGH ? __hfma2(d, __float2half2_rn(1.f / 16), z_hi) : __hsub2(d, z_lo);  // q - z, exact
  const __half2 a = __hmul2(d, s);
  return *reinterpret_cast<const uint32_t*>(&a);
}

// The A registers of one packed k-tile: a[blk][h][r] for m16 block blk (words 2blk, 2blk + 1:
// rows g, g + 8 of the block) and k16 step h (low nibbles h = 0, high nibbles h = 1).
struct GroupConstants {
  __half2 s[4], z_lo[4], z_hi[4];  // per word i (row 8i + g): scale, 1024 + z, -(64 + z)

  __device__ __forceinline__ void load(uint2 scale4, uint32_t zero4) {
    const __half* sc = reinterpret_cast<const __half*>(&scale4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float z = static_cast<float>((zero4 >> (8 * i)) & 0xFF);
      s[i] = __half2half2(sc[i]);
      z_lo[i] = __float2half2_rn(1024.f + z);
      z_hi[i] = __float2half2_rn(-64.f - z);
    }
  }
};

__device__ __forceinline__ void w4_group_to_f16_a(const uint4& w, const GroupConstants& c, uint32_t (&a)[2][2][4]) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int blk = 0; blk < 2; ++blk)
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // word 2blk + r: row g (r = 0) or g + 8 (r = 1) of the block
      const int i = 2 * blk + r;
      a[blk][0][r] = w4_pair_f16<false>(words[i], 0, c.s[i], c.z_lo[i], c.z_hi[i]);      // k 2t, 2t+1
      a[blk][0][2 + r] = w4_pair_f16<false>(words[i], 1, c.s[i], c.z_lo[i], c.z_hi[i]);  // k 2t+8, 2t+9
      a[blk][1][r] = w4_pair_f16<true>(words[i], 0, c.s[i], c.z_lo[i], c.z_hi[i]);
      a[blk][1][2 + r] = w4_pair_f16<true>(words[i], 1, c.s[i], c.z_lo[i], c.z_hi[i]);
    }
}

// CTA = RT row tiles x WK warps splitting K, 8 NB tokens; grid (NT / RT, M / (8 NB), splits).
// Params: x = fp16 [M, Kp] (as int8_t*), scale = fp16 [NT, groups, 32] and zero = uint8
// [NT, groups, 32] in layout.pack_group_params order, group_shift = log2(group / 32).
template <int NB, int RT, int WK, int U, int MIN_BLOCKS, bool OUTLIERS>
__global__ void __launch_bounds__(RT* WK* kWarp, MIN_BLOCKS) w4a16_stream_kernel(const Params p) {
  constexpr int CB = U / 2;  // OUTLIERS: buckets per chunk
  // A programmatic dependent launch (launch_maybe_pdl): let the next kernel start, and wait for
  // the previous one before anything is read or written.
  pdl_launch_dependents();
  pdl_wait();
  const StreamThread<NB, RT, WK, OUTLIERS ? 2 : 1> th(p);
  const auto [warp, lane, g, t, rt, wk, nt, m0, kt_begin, kt_end] = th;

  __shared__ int red[WK > 1 ? RT * (WK / 2) * 2 * NB * 4 * kWarp : 1];
  extern __shared__ __align__(128) uint8_t w4a16_dynamic[];  // OUTLIERS: a compact tile and entries per warp
  const uint32_t scratch = smem_u32(w4a16_dynamic) + warp * kOutlierWarpBytes, entries = scratch + kCompactTileBytes;
  if constexpr (OUTLIERS) zero_shared(scratch, kCompactTileBytes, lane);

  float acc[2][NB][4] = {};  // dense and (OUTLIERS) outlier products alike
  if (nt < p.NT) {
    const __half* x = reinterpret_cast<const __half*>(p.x);
    const __half* xrow[NB];  // token m0 + 8nb + g; rows past M re-read row M - 1 (never stored)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) xrow[nb] = x + static_cast<size_t>(min(m0 + 8 * nb + g, p.M - 1)) * p.Kp + 4 * t;
    const uint8_t* wrow = p.qweight + static_cast<size_t>(nt) * p.KT * 512 + lane * 16;
    const size_t params_row = static_cast<size_t>(nt) * p.groups * 32 + 4 * g;  // element index
    const __half* group_scale = reinterpret_cast<const __half*>(p.scale);
    int2 lookup{};
    if constexpr (OUTLIERS) lookup = next_lookup<CB>(p, nt, kt_begin + wk * U, kt_end, lane);

    for (int kt0 = kt_begin + wk * U; kt0 < kt_end; kt0 += WK * U) {
      uint4 w[U];
      uint2 sc[U], b[U][NB][2];
      uint32_t zr[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int kt = min(kt0 + u, kt_end - 1);  // the tail re-loads a valid tile; its mma is skipped
        const size_t grp = params_row + static_cast<size_t>(kt >> p.group_shift) * 32;
        w[u] = ldg_stream_v4(wrow + static_cast<size_t>(kt) * 512);
        sc[u] = __ldg(reinterpret_cast<const uint2*>(group_scale + grp));  // rows g, 8+g, 16+g, 24+g
        zr[u] = ldg_u32(p.zero + grp);
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
          for (int h = 0; h < 2; ++h) b[u][nb][h] = __ldg(reinterpret_cast<const uint2*>(xrow[nb] + kt * 32 + 16 * h));
      }
      ChunkOutliers<NB, CB> outliers;
      if constexpr (OUTLIERS) {
        outliers.load(p, lookup, entries, lane);
        lookup = next_lookup<CB>(p, nt, kt0 + WK * U, kt_end, lane);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (kt0 + u < kt_end) {
          GroupConstants c;
          c.load(sc[u], zr[u]);
          uint32_t a[2][2][4];
          w4_group_to_f16_a(w[u], c, a);
#pragma unroll
          for (int blk = 0; blk < 2; ++blk)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
              for (int nb = 0; nb < NB; ++nb) mma_f16_16816(acc[blk][nb], a[blk][h], b[u][nb][h].x, b[u][nb][h].y);
        }
      }
      // The outliers multiply the same fp16 activations (their rows just read through L1),
      // into the same accumulators.
      if constexpr (OUTLIERS) {
        outliers.add(p, scratch, entries, [&](int nb, int c0, int c1) -> uint32_t {
          const unsigned short* row = reinterpret_cast<const unsigned short*>(xrow[nb] - 4 * th.t + kt0 * 32);
          return static_cast<uint32_t>(__ldg(row + c0)) | (static_cast<uint32_t>(__ldg(row + c1)) << 16);
        }, acc, lane);
      }
    }
  }

  if constexpr (WK > 1) reduce_k_slices<NB, RT, WK>(acc, red, rt, wk, lane);

  const bool holds = th.holds_sums(p);
  auto visit = [&](auto&& f) {
    if (!holds) return;
    int no_int_sum = 0;  // reduce_splits' INT32 partials: unused here
    th.for_each_output([&](int blk, int nb, int r, int m, int n) { f(m, n, no_int_sum, acc[blk][nb][r]); });
  };
  if (reduce_splits(p, visit)) {
    visit([&](int m, int n, int&, float& v) {
      if (m < p.M && n < p.N) static_cast<__half*>(p.out)[static_cast<size_t>(m) * p.N + n] = __float2half_rn(v);
    });
  }
}

template <int NB, bool OUTLIERS>
cudaError_t launch_w4a16(const Params& p, cudaStream_t stream) {
  constexpr int RT = 2, WK = 4;
  // Chunk length: as long as the registers allow without spills (ptxas -v) at this occupancy.
  constexpr int U = NB == 1 && !OUTLIERS ? 8 : (NB <= 4 ? 4 : 2);
  constexpr int MIN_BLOCKS = NB <= 2 ? 2 : 1;
  constexpr int kSmem = OUTLIERS ? RT * WK * kOutlierWarpBytes : 0;
  const auto kernel = w4a16_stream_kernel<NB, RT, WK, U, MIN_BLOCKS, OUTLIERS>;
  if constexpr (kSmem > 0) QOQ_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  const dim3 grid(ceil_div(p.NT, RT), ceil_div(p.M, 8 * NB), p.splits);
  return launch_maybe_pdl(kernel, grid, dim3(RT * WK * kWarp), kSmem, stream, dependent_launch(), p);
}

template <bool OUTLIERS>
cudaError_t launch_w4a16_tile(const Params& p, int tile, cudaStream_t stream) {
  if (p.M <= 0) return cudaSuccess;
  if (p.splits < 1 || p.splits > p.KT) return cudaErrorInvalidValue;
  if (p.splits > 1 && (p.sparse_workspace == nullptr || p.workspace == nullptr)) return cudaErrorInvalidValue;
  switch (tile) {
    case 1: return launch_w4a16<1, OUTLIERS>(p, stream);
    case 2: return launch_w4a16<2, OUTLIERS>(p, stream);
    case 4: return launch_w4a16<4, OUTLIERS>(p, stream);
    case 8: return launch_w4a16<8, OUTLIERS>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace qoq::gemm

static qoq::gemm::Params w4a16_params(const __half* x, const uint8_t* qweight, const __half* scale, const uint8_t* zero,
                                      __half* out, int M, int N, int Kp, int group_shift, int splits,
                                      int32_t* workspace, float* float_workspace, int32_t* counters) {
  qoq::gemm::Params p = qoq::gemm::base_params(reinterpret_cast<const int8_t*>(x), nullptr, qweight, scale, M, N, Kp,
                                               splits, workspace, counters);
  p.zero = zero;
  p.group_shift = group_shift;
  p.groups = p.KT >> group_shift;
  p.out = out;
  p.sparse_workspace = float_workspace;
  p.NBk = qoq::ceil_div(Kp, qoq::gemm::kBucketK);
  return p;
}

// x fp16 [M, Kp] (zero past K), qweight [NT, KT, 32, 16], scale fp16 / zero uint8 [NT, groups, 32];
// with splits > 1, workspace int32 and float_workspace fp32 [splits, M, NT*32] and the counters.
extern "C" int qoq_w4a16_gemm(int tile, int splits, const __half* x, const uint8_t* qweight, const __half* scale,
                              const uint8_t* zero, __half* out, int M, int N, int Kp, int group_shift,
                              int32_t* workspace, float* float_workspace, int32_t* counters, cudaStream_t stream) {
  auto p = w4a16_params(x, qweight, scale, zero, out, M, N, Kp, group_shift, splits, workspace, float_workspace, counters);
  return qoq::gemm::launch_w4a16_tile<false>(p, tile, stream);
}

// The same plus a Tile-COO section validated by the caller (entries [Q, 16] uint8, start and
// count [NT, ceil(Kp / 64)] int32).
extern "C" int qoq_w4a16_sparse_dense_gemm(int tile, int splits, const __half* x, const uint8_t* qweight,
                                           const __half* scale, const uint8_t* zero, const void* tc_entries,
                                           const int32_t* tc_start, const int32_t* tc_count, __half* out, int M, int N,
                                           int Kp, int group_shift, int32_t* workspace, float* float_workspace,
                                           int32_t* counters, cudaStream_t stream) {
  auto p = w4a16_params(x, qweight, scale, zero, out, M, N, Kp, group_shift, splits, workspace, float_workspace, counters);
  p.tc_entries = static_cast<const uint4*>(tc_entries);
  p.tc_start = tc_start;
  p.tc_count = tc_count;
  return qoq::gemm::launch_w4a16_tile<true>(p, tile, stream);
}
