// The GEMM main loops shared by w4a8_gemm.cu and w8a8_gemm.cu: out[m, n] = sum_k x[m, k] W[n, k]
// with INT8 activations, INT32 accumulation and the scales in the epilogue.
//
// Swap-AB: the WEIGHTS are the A operand of the INT8 tensor-core instructions (out^T = W x^T)
// and the tokens are their N dimension. That is what lets the offline layout of
// qoqtool/packing/layout.py feed the tensor cores straight from one 128-bit load per lane:
// each lane's 16 bytes of a 32x32 tile are exactly its A fragments of mma.m16n8k32 for the
// tile's two m16 blocks (and of wgmma, whose per-warp A fragment is the same).
//
// Two kernels, chosen by qoqtool/runtime/cuda_ops.py (`plan`, with the table and reasons):
//
//   stream_kernel (mma.sync, sm_80 and sm_90a) - decode-sized M. A memory-bound weight
//     stream: each warp loads its lanes' 16-byte fragments global -> registers with
//     L1-bypassing 128-bit loads, U k-tiles in flight at once; activations (small, shared by
//     every row tile) come through L1 as the 32-bit B fragments; the warps of a CTA split K
//     and reduce in shared memory; CTAs split K too when the grid would not fill the GPU.
//     QoQ's per-group level is applied to partial sums, once per group (fold_group), not to
//     every weight; the kernel goes out as a programmatic dependent launch (dependent_launch).
//
//   wgmma_kernel (sm_90a only) - larger M. The copy engine (TMA) brings the activations
//     (K-major, 128-byte swizzle applied by the copy), the packed weights and the group
//     parameters into a multistage shared-memory ring, completing on mbarriers; each warp
//     dequantizes its row tile's fragment into registers and the warpgroup issues
//     wgmma.m64n128k32 with A from registers and B from shared memory. A warpgroup owns 4
//     row tiles (128 rows): warp w holds row tile w, and the tile's two m16 blocks go to two
//     wgmma instructions (block 0 of all four warps, then block 1), so every lane still reads
//     its 16 bytes with one 128-bit load. The INT32 tile then goes through shared memory
//     so that split-K partials and outputs move as coalesced vectors (wgmma_epilogue).
//
// Split-K across CTAs (both kernels): each split writes its INT32 partial sums to a
// workspace; the last CTA of a tile to arrive (an atomic counter per tile) adds the others
// and runs the epilogue, then resets its counter to zero, so one launch does it all and
// the counters stay zero between launches (CUDA-graph friendly). INT32 addition is exact
// and associative: the result does not depend on the split.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums (types only: the encoder comes via the runtime)
#include <cudaTypedefs.h>

#include <type_traits>

#include "common.cuh"

namespace qoq::gemm {

enum class Kind : int {
  kProgressive = 0,   // QoQ W4 per group: w8 = (q - z) * s1, level-0 scale per row
  kUInt4Channel = 1,  // W4 per channel: raw codes q in the main loop, zero in the epilogue
  kInt8Channel = 2,   // W8 per channel
};

struct Params {
  const int8_t* x;          // [M, Kp] activation codes, row-major, zero past K
  const __half* x_scale;    // [M] per-token scales
  const int32_t* x_rowsum;  // [M] sum of each row's codes (kUInt4Channel)
  const uint8_t* qweight;   // packed codes, [NT, KT, 32, 16] (W4) or [NT, KT, 32, 32] (W8)
  const __half* scale;      // [NT*32] level-0 scale (kProgressive) or per-channel scale
  const uint8_t* scale1;    // [NT, groups, 32] (kProgressive), layout.pack_group_params order
  const uint8_t* zxs1;      // [NT, groups, 32] z * s1 (kProgressive)
  const uint8_t* zero;      // [NT*32] zero points (kUInt4Channel)
  void* out;                // [M, N] fp16, or the raw INT32 accumulators when out_i32
  int32_t* workspace;       // [splits, M, NT*32] partial sums (splits > 1)
  int32_t* counters;        // one per (x, y) CTA tile, zero on entry and on exit
  int M, N, Kp, NT, KT;     // NT = Np / 32 row tiles, KT = Kp / 32 k-tiles
  int groups, group_shift;  // progressive: Kp / G groups, G = 32 << group_shift
  int groups_per_stage;     // progressive, wgmma: groups in one 128-wide pipeline stage
  int splits, out_i32;
  // Tile-COO outliers (stream_kernel<..., OUTLIERS = true> only; docs/tile-coo.md). The
  // section must have passed qoqtool.packing.tile_coo.validate (the packed loader runs it).
  const uint4* tc_entries;  // [Q] 16-byte entries
  const int32_t* tc_start;  // [NT, NBk] first entry of bucket (row tile, 64-column block)
  const int32_t* tc_count;  // [NT, NBk] entries of that bucket
  float* sparse_workspace;  // [splits, M, NT*32] fp32 outlier partial sums (splits > 1)
  int NBk;                  // ceil(Kp / 64) buckets along K
};

// What every entry point sets alike: the activations, the shape, split-K and its buffers.
inline Params base_params(const int8_t* x, const __half* x_scale, const uint8_t* qweight, const __half* scale,
                          int M, int N, int Kp, int splits, int32_t* workspace, int32_t* counters) {
  Params p{};
  p.x = x;
  p.x_scale = x_scale;
  p.qweight = qweight;
  p.scale = scale;
  p.M = M;
  p.N = N;
  p.Kp = Kp;
  p.NT = ceil_div(N, 32);
  p.KT = Kp / 32;
  p.splits = splits;
  p.workspace = workspace;
  p.counters = counters;
  return p;
}

// Tile-COO buckets: one row tile x two k-tiles (qoqtool.packing.tile_coo.BUCKET_N, BUCKET_K;
// cuda_ops checks the two agree).
constexpr int kBucketN = 32, kBucketK = 64;

template <Kind K>
constexpr int kLaneBytes = K == Kind::kInt8Channel ? 32 : 16;  // one lane's share of a tile

// ---------------------------------------------------------------------------------------
// Packed fragment -> mma A registers. a[b][r] is register r of m16 block b of the tile.
// ---------------------------------------------------------------------------------------

// Progressive (QoQ) dequantization of four k of one row, all in one 32-bit word: q4 holds
// four codes q (one per byte), s1 the row's level-1 scale, c = 128 - z*s1 in every byte.
// q*s1 <= 15*16 < 256, so ONE 32-bit multiply scales all four bytes without carries; the
// true byte value (q - z)*s1 + 128 lies in [0, 255] (the quantizer keeps (q - z)*s1 in
// [-128, 127] and z*s1 <= 128), so the multiply-add cannot carry either. Flipping each
// byte's top bit then subtracts the 128: the bytes are the exact INT8 weights (q - z)*s1.
// Two instructions for four weights (IMAD + LOP3), after the mask that extracts q4.
__device__ __forceinline__ uint32_t progressive_quad(uint32_t q4, uint32_t s1, uint32_t c) {
  return (q4 * s1 + c) ^ 0x80808080u;
}

// Word i of a W4 fragment holds row 8i + g: its low nibbles are k = 4t + j (registers a0 of
// block i/2 for even i, a1 for odd i), its high nibbles k = 16 + 4t + j (a2 / a3).
__device__ __forceinline__ void w4_progressive_to_a(const uint4& w, uint32_t s1_word, uint32_t zs1_word,
                                                    uint32_t (&a)[2][4]) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // Byte i of the parameter words belongs to row 8i + g (layout.pack_group_params).
    const uint32_t s1 = __byte_perm(s1_word, 0, 0x4440 | i);           // byte i, zero-extended
    const uint32_t c = 0x80808080u - __byte_perm(zs1_word, 0, 0x1111 * i);  // 128 - z*s1, x4
    a[i >> 1][i & 1] = progressive_quad(words[i] & 0x0F0F0F0Fu, s1, c);
    a[i >> 1][2 + (i & 1)] = progressive_quad((words[i] >> 4) & 0x0F0F0F0Fu, s1, c);
  }
}

// Per-channel W4: the raw codes 0..15 are already valid s8 operands; the zero point is
// applied once per output in the epilogue (acc - z * rowsum(x)).
__device__ __forceinline__ void w4_codes_to_a(const uint4& w, uint32_t (&a)[2][4]) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    a[i >> 1][i & 1] = words[i] & 0x0F0F0F0Fu;
    a[i >> 1][2 + (i & 1)] = (words[i] >> 4) & 0x0F0F0F0Fu;
  }
}

// W8: word 2i + h holds row 8i + g at k = 16h + 4t + j, so block b is words 4b, 4b+2, 4b+1, 4b+3.
__device__ __forceinline__ void w8_to_a(const uint4& lo, const uint4& hi, uint32_t (&a)[2][4]) {
  a[0][0] = lo.x; a[0][1] = lo.z; a[0][2] = lo.y; a[0][3] = lo.w;
  a[1][0] = hi.x; a[1][1] = hi.z; a[1][2] = hi.y; a[1][3] = hi.w;
}

// One lane's raw fragment of one tile, plus its group parameters (progressive).
template <Kind K>
struct Fragment {
  uint4 w[kLaneBytes<K> / 16];
  uint32_t s1, zs1;

  __device__ __forceinline__ void to_a(uint32_t (&a)[2][4]) const {
    if constexpr (K == Kind::kProgressive) w4_progressive_to_a(w[0], s1, zs1, a);
    if constexpr (K == Kind::kUInt4Channel) w4_codes_to_a(w[0], a);
    if constexpr (K == Kind::kInt8Channel) w8_to_a(w[0], w[kLaneBytes<K> / 16 - 1], a);
  }
};

// ---------------------------------------------------------------------------------------
// Epilogue and split-K
// ---------------------------------------------------------------------------------------

// Items [split_begin(n, z), split_begin(n, z + 1)) of n belong to split z (k-tiles in the
// stream kernel, 4-k-tile pipeline stages in the wgmma kernel).
__device__ __forceinline__ int split_begin(int n, int z, int splits) {
  return static_cast<int>(static_cast<int64_t>(n) * z / splits);
}

// The dense value of out[m, n] from its INT32 accumulator (after the per-channel zero-point
// term), in the reference path's order of float operations (quantizers.formats.*.linear_int8).
template <Kind K>
__device__ __forceinline__ float dense_value(int acc, float sx, float sw) {
  // UInt4Weight.linear_int8 scales by the weight first, the others by the token first.
  return K == Kind::kUInt4Channel ? (static_cast<float>(acc) * sw) * sx : (static_cast<float>(acc) * sx) * sw;
}

template <Kind K>
__device__ __forceinline__ float dense_result(const Params& p, int m, int n, int acc) {
  return dense_value<K>(acc, __half2float(p.x_scale[m]), __half2float(p.scale[n]));
}

template <Kind K>
__device__ __forceinline__ void store_result(const Params& p, int m, int n, int acc) {
  if (m >= p.M || n >= p.N) return;
  if constexpr (K == Kind::kUInt4Channel) acc -= static_cast<int>(p.zero[n]) * p.x_rowsum[m];
  const size_t at = static_cast<size_t>(m) * p.N + n;
  if (p.out_i32) {
    static_cast<int32_t*>(p.out)[at] = acc;
    return;
  }
  static_cast<__half*>(p.out)[at] = __float2half_rn(dense_result<K>(p, m, n, acc));
}

// The same with the outliers' fp32 sum `sparse` = sum_k S[n, k] * xq[m, k] (docs/tile-coo.md,
// section 1): the reference path (QuantLinear.forward) computes
//     y = linear_int8(xq, sx) + (S xq^T)^T * sx
//       = (acc * sx) * s0 + sparse * sx                       progressive
//       = ((acc - z * rowsum(xq)) * s) * sx + sparse * sx     uint4 per channel
// i.e. y = sx * (sw * acc + sparse): the token scale once per term, in fp32, one fp16
// rounding at the end. (No INT32 output: the sparse sum is not an integer.)
template <Kind K>
__device__ __forceinline__ void store_result_with_outliers(const Params& p, int m, int n, int acc, float sparse) {
  if (m >= p.M || n >= p.N) return;
  if constexpr (K == Kind::kUInt4Channel) acc -= static_cast<int>(p.zero[n]) * p.x_rowsum[m];
  const float y = dense_result<K>(p, m, n, acc) + sparse * __half2float(p.x_scale[m]);
  static_cast<__half*>(p.out)[static_cast<size_t>(m) * p.N + n] = __float2half_rn(y);
}

// After this CTA has written its split's partials: counts it in, and returns true in the last
// split of the tile to arrive (which resets the counter for the next launch), once every
// other split's partials are visible to it. Every thread of the CTA must call this.
__device__ __forceinline__ bool arrive_last_split(const Params& p) {
  __shared__ int last_split;
  __threadfence();  // our partials are visible device-wide before we are counted
  __syncthreads();
  if (threadIdx.x == 0) {
    int* counter = p.counters + blockIdx.y * gridDim.x + blockIdx.x;
    last_split = atomicAdd(counter, 1) == p.splits - 1;
    if (last_split) *counter = 0;  // every split has arrived: reset for the next launch
  }
  __syncthreads();
  if (!last_split) return false;
  __threadfence();
  return true;
}

// Split-K across CTAs. `visit(f)` calls f(m, n, int& acc) for every accumulator this thread
// holds (threads holding none call nothing); the fused sparse-dense kernel's visit calls
// f(m, n, int& acc, float& sparse), and the fp32 outlier partials travel through
// p.sparse_workspace beside the INT32 ones (`sparse...` is empty for the dense kernels).
// Every thread of the CTA must call this. Returns true in the CTA that must run the
// epilogue: the only one when splits == 1, otherwise the last split to arrive, with the
// other splits' partials added to its own.
template <class Visit>
__device__ __forceinline__ bool reduce_splits(const Params& p, Visit&& visit) {
  if (p.splits == 1) return true;
  const size_t ld = static_cast<size_t>(p.NT) * 32, slice = static_cast<size_t>(p.M) * ld;
  int32_t* mine = p.workspace + blockIdx.z * slice;
  visit([&](int m, int n, int& acc, auto&... sparse) {
    if (m < p.M) {
      mine[m * ld + n] = acc;
      ((p.sparse_workspace[blockIdx.z * slice + m * ld + n] = sparse), ...);
    }
  });
  if (!arrive_last_split(p)) return false;
#pragma unroll 1
  for (int z = 0; z < p.splits; ++z) {
    if (z == static_cast<int>(blockIdx.z)) continue;
    const int32_t* theirs = p.workspace + z * slice;
    visit([&](int m, int n, int& acc, auto&... sparse) {
      if (m < p.M) {
        acc += __ldcg(theirs + m * ld + n);  // through L2: L1 is not coherent
        ((sparse += __ldcg(p.sparse_workspace + z * slice + m * ld + n)), ...);
      }
    });
  }
  return true;
}

// ---------------------------------------------------------------------------------------
// stream_kernel: mma.sync, for small M
// ---------------------------------------------------------------------------------------
//
// CTA = RT row tiles x WK warps splitting K (one warp per (row tile, k slice)), 8*NB tokens.
// Grid = (NT / RT, M / (8 NB), splits). Each warp walks its k-tiles in chunks of U
// consecutive tiles (U*512 contiguous bytes of W4 per warp) and issues the loads of all U
// before the first mma, so U 128-bit loads per lane are in flight.
//
// OUTLIERS = true is the fused sparse-dense GEMM (issue 8, W4A8): the same warps also add the
// Tile-COO outliers of their row tile (docs/tile-coo.md), sum_k S[n, k] * xq[m, k], on the
// tensor cores, before the single write of the output. Per chunk of U k-tiles (U/2 whole
// buckets: splits and chunks start on even k-tiles, see aligned_split_begin):
//  * the chunk's entries (its buckets' runs one after the other) are loaded one per lane,
//    issued right after the chunk's weight loads, so they arrive with them; the (start,
//    count) lookups they need were fetched one chunk earlier (next_lookup);
//  * after the dense mma, each lane scatters its entries' fp16 values into a per-warp
//    shared-memory tile per bucket, [32 rows x 64 k] fp16, otherwise zero (scatter_entry) -
//    every (row, column) occurs once in a section, so the scattered stores never collide;
//  * the tile is read back as the A operand of mma.m16n8k16 (fp16 x fp16 -> fp32) with
//    ldmatrix, and multiplied with the SAME INT8 activation registers the dense mma just used
//    as its B fragments, converted to fp16 (exact for |x| <= 127). The k order of the tile is
//    permuted (logical_k) so that the s8 fragment a lane holds is exactly its fp16 fragment;
//  * the fp32 sums land in registers laid out like the INT32 accumulators (the two mma's C
//    fragments agree), travel through the k-slice reduction and split-K beside them, and the
//    epilogue applies sx once: y = sx * (sw * acc + sparse) (store_result_with_outliers);
//  * the lanes write zeros back where they scattered, so the tile is zero for the next chunk.
// Cost per bucket and warp: ~2 scattered stores per entry, 8 ldmatrix, 4 x 2NB conversions
// and 8 NB fp16 mma - independent of how the outliers are spread, with no atomics (the first
// version's shared-memory fp32 atomics, one per outlier and token, made the kernel 3-6x
// slower than the dense one at 1%).

constexpr int kBucketTileBytes = kBucketN * kBucketK * 2;  // one bucket as fp16 [32][64]: 4 KB

// k-tiles [aligned_split_begin(z), aligned_split_begin(z + 1)) of split z of a stream-style
// kernel: whole units of `align` k-tiles (a split never cuts a Tile-COO bucket, 2 k-tiles, or a
// progressive group fold); a split may be empty when splits > ceil(KT / align).
__device__ __forceinline__ int aligned_split_begin(int KT, int align, int z, int splits) {
  return min(KT, align * split_begin(ceil_div(KT, align), z, splits));
}

// Physical column c of a bucket (0..63) -> its k in the bucket's fp16 A tile. Lane (g, t) holds,
// in its s8 B register of k-tile c >> 5, half (c >> 4) & 1, the activations at physical
// 16h + 4t + j (j = 0..3); mma.m16n8k16 wants, in its fp16 B registers, k = 2t, 2t + 1 (b0) and
// 2t + 8, 2t + 9 (b1). Calling physical 4t + j "k 2t + j" (j < 2) and "k 8 + 2t + j - 2"
// (j >= 2) makes bytes 0,1 of the s8 register b0 and bytes 2,3 b1: the tile is stored in that k
// order, and the sum over k does not care.
__device__ __forceinline__ int logical_k(int c) {
  const int t = (c >> 2) & 3, j = c & 3;
  return (c & ~15) + (j < 2 ? 2 * t + j : 8 + 2 * t + j - 2);
}

// Byte offset of (row, k) in a bucket tile: 128-byte rows whose 16-byte chunks are XOR-swizzled
// by row & 7, so that ldmatrix's eight row reads of one chunk column hit eight bank groups.
__device__ __forceinline__ uint32_t tile_offset(int row, int k) {
  return row * 128 + ((((k >> 3) ^ row) & 7) << 4) + (k & 7) * 2;
}

// Zeroes `bytes` (a multiple of 16) of shared memory from addr, the lanes of a warp side by side.
__device__ __forceinline__ void zero_shared(uint32_t addr, int bytes, int lane) {
  for (int i = lane; i < bytes / 16; i += kWarp) asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr + 16 * i), "r"(0));
}

// Writes the real slots of one entry into its bucket's tile (or zeros there, to clean up).
__device__ __forceinline__ void scatter_entry(uint32_t tile, const uint4& e, bool zero) {
  const int k = logical_k(e.w & (kBucketK - 1));  // byte 12: the bucket-local column
  const uint32_t real = (e.w >> 8) & 0xF;         // byte 13: which slots hold outliers
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const int row = (e.z >> (8 * s)) & (kBucketN - 1);  // bytes 8..11 (`&`: stays in the tile)
    const uint32_t bits = zero ? 0u : ((s < 2 ? e.x : e.y) >> (16 * (s & 1))) & 0xFFFFu;  // bytes 0..7
    if ((real >> s) & 1) asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(tile + tile_offset(row, k)), "h"(static_cast<unsigned short>(bits)));
  }
}

// Four INT8 activations (one s8 B register) as two fp16x2 registers, exactly: biased to
// x + 128 and placed under the exponent of 1024 (0x64XX = 1024 + byte), then 1152 subtracted.
__device__ __forceinline__ void s8x4_to_f16x2(uint32_t v, uint32_t& lo, uint32_t& hi) {
  const uint32_t biased = v ^ 0x80808080u;
  const __half2 offset = __halves2half2(__ushort_as_half(0x6480), __ushort_as_half(0x6480));  // 1152
  uint32_t a = __byte_perm(biased, 0x64646464u, 0x4140), b = __byte_perm(biased, 0x64646464u, 0x4342);
  const __half2 ha = __hsub2(*reinterpret_cast<__half2*>(&a), offset), hb = __hsub2(*reinterpret_cast<__half2*>(&b), offset);
  lo = *reinterpret_cast<const uint32_t*>(&ha);
  hi = *reinterpret_cast<const uint32_t*>(&hb);
}

// The (start, count) of the CB buckets of the chunk starting at k-tile kt0 (lane b < CB holds
// bucket kt0 / 2 + b's; 0 and 0 past the split). Issued a chunk early: only the entries wait.
template <int CB>
__device__ __forceinline__ int2 next_lookup(const Params& p, int nt, int kt0, int kt_end, int lane) {
  int2 r = make_int2(0, 0);
  const int nbk = kt0 < kt_end ? (min(kt0 + 2 * CB, kt_end) - kt0 + 1) / 2 : 0;
  if (lane < nbk) r = make_int2(__ldg(p.tc_start + nt * p.NBk + kt0 / 2 + lane), __ldg(p.tc_count + nt * p.NBk + kt0 / 2 + lane));
  return r;
}

// One chunk's outliers: CB buckets, entries dealt one per lane (E per lane loaded with the
// weights; more, at high density, loaded here), scattered, multiplied, cleaned up.
template <int NB, int CB, int E>
struct ChunkOutliers {
  int base[CB], end[CB], total;  // entry f of the chunk list = entry base[b] + f of bucket b's run
  uint4 e[E];

  __device__ __forceinline__ void load(const Params& p, int2 lookup, int lane) {
    total = 0;
#pragma unroll
    for (int b = 0; b < CB; ++b) {
      base[b] = __shfl_sync(0xffffffffu, lookup.x, b) - total;
      total += __shfl_sync(0xffffffffu, lookup.y, b);
      end[b] = total;
    }
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const int f = lane + kWarp * j;
      e[j] = f < total ? ldg_stream_v4(p.tc_entries + at(f)) : make_uint4(0, 0, 0, 0);  // zero: no real slot
    }
  }
  __device__ __forceinline__ int bucket(int f) const {
    int b = 0;
#pragma unroll
    for (int i = 0; i + 1 < CB; ++i) b += f >= end[i];  // ends never decrease
    return b;
  }
  __device__ __forceinline__ int at(int f) const {
    const int b = bucket(f);
    int a = base[0];
#pragma unroll
    for (int i = 1; i < CB; ++i) a = b == i ? base[i] : a;  // a select, not a local-memory index
    return a + f;
  }

  // b_f16(u, nb, h, lo, hi): the fp16 B registers (k 2t, 2t+1 and 2t+8, 2t+9 of the tile's k
  // order) of k-tile u (= 2 * bucket + u % 2), token block nb, k16 step h; sparse: the fp32 sums.
  template <class BF16>
  __device__ __forceinline__ void add(const Params& p, uint32_t scratch, BF16&& b_f16, float (&sparse)[2][NB][4],
                                      int lane) {
    if (total == 0) return;  // warp-uniform
    __syncwarp();            // the previous chunk's clean-up is done before new values land
#pragma unroll
    for (int j = 0; j < E; ++j) scatter_entry(scratch + bucket(lane + kWarp * j) * kBucketTileBytes, e[j], false);
    for (int f = E * kWarp + lane; f < total; f += kWarp)  // past E per lane: loaded now
      scatter_entry(scratch + bucket(f) * kBucketTileBytes, ldg_stream_v4(p.tc_entries + at(f)), false);
    __syncwarp();
#pragma unroll
    for (int bk = 0; bk < CB; ++bk) {
      if (end[bk] == (bk ? end[bk - 1] : 0)) continue;  // an empty bucket (warp-uniform)
#pragma unroll
      for (int s = 0; s < 4; ++s) {  // the bucket's four k16 steps: k-tile 2bk + s/2, half s%2
        uint32_t a[2][4];
#pragma unroll
        for (int blk = 0; blk < 2; ++blk)  // lane l gives row 16blk + l%16 at k 16s + 8(l/16)
          ldmatrix_x4(a[blk], scratch + bk * kBucketTileBytes + tile_offset(16 * blk + (lane & 15), 16 * s + 8 * (lane >> 4)));
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          uint32_t lo, hi;
          b_f16(2 * bk + s / 2, nb, s % 2, lo, hi);
#pragma unroll
          for (int blk = 0; blk < 2; ++blk) mma_f16_16816(sparse[blk][nb], a[blk], lo, hi);
        }
      }
    }
    __syncwarp();  // every lane has read the tiles before any lane clears them
    if (total <= E * kWarp) {
#pragma unroll
      for (int j = 0; j < E; ++j) scatter_entry(scratch + bucket(lane + kWarp * j) * kBucketTileBytes, e[j], true);
    } else {  // entries this lane did not keep: clear the chunk's tiles whole
      zero_shared(scratch, CB * kBucketTileBytes, lane);
    }
  }
};

// The k-slice reduction of the stream kernel: WK warps of a row tile hold partial sums of the
// same outputs in the same registers; a tree through shared memory, laid out
// [row tile][slot][register][lane] so that every access is one conflict-free word per lane.
// T is int (the dense sums) or float (the outliers'), carried as bits.
template <int NB, int RT, int WK, class T>
__device__ __forceinline__ void reduce_k_slices(T (&v)[2][NB][4], int* red, int rt, int wk, int lane) {
  constexpr int kRegs = 2 * NB * 4;
  auto bits = [](T x) { if constexpr (sizeof(T) == 4 && !std::is_integral_v<T>) return __float_as_int(x); else return x; };
  auto value = [](int x) { if constexpr (!std::is_integral_v<T>) return __int_as_float(x); else return x; };
#pragma unroll
  for (int s = WK / 2; s >= 1; s /= 2) {
    if (wk >= s && wk < 2 * s) {
#pragma unroll
      for (int r = 0; r < kRegs; ++r) red[((rt * (WK / 2) + wk - s) * kRegs + r) * kWarp + lane] = bits(v[r / (4 * NB)][(r / 4) % NB][r % 4]);
    }
    __syncthreads();
    if (wk < s) {
#pragma unroll
      for (int r = 0; r < kRegs; ++r) v[r / (4 * NB)][(r / 4) % NB][r % 4] += value(red[((rt * (WK / 2) + wk) * kRegs + r) * kWarp + lane]);
    }
    __syncthreads();
  }
}

// Where a thread of a stream-style CTA (RT row tiles x WK warps splitting K, 8 NB tokens; the
// stream and W4A16 kernels) works: its lane's (g, t) in the mma fragments, its warp's row
// tile and k slice, the CTA's first token, and the k-tiles of its split - whole units of ALIGN
// k-tiles (aligned_split_begin): whole buckets when the kernel adds outliers, whole group
// folds in the progressive stream kernel.
template <int NB, int RT, int WK, int ALIGN>
struct StreamThread {
  int warp, lane, g, t, rt, wk, nt, m0, kt_begin, kt_end;

  __device__ __forceinline__ explicit StreamThread(const Params& p)
      : warp(threadIdx.x / kWarp), lane(threadIdx.x % kWarp), g(lane / 4), t(lane % 4), rt(warp / WK), wk(warp % WK),
        nt(blockIdx.x * RT + rt), m0(blockIdx.y * 8 * NB),
        kt_begin(aligned_split_begin(p.KT, ALIGN, blockIdx.z, p.splits)),
        kt_end(aligned_split_begin(p.KT, ALIGN, blockIdx.z + 1, p.splits)) {}

  // After the k-slice reduction, the k-slice-0 warp of each row tile holds the sums.
  __device__ __forceinline__ bool holds_sums(const Params& p) const { return wk == 0 && nt < p.NT; }

  // f(blk, nb, r, m, n) for every accumulator register [blk][nb][r] of the mma C layout: token
  // m0 + 8nb + 2t + (r & 1), row nt*32 + 16blk + g + 8(r >> 1).
  template <class F>
  __device__ __forceinline__ void for_each_output(F&& f) const {
#pragma unroll
    for (int blk = 0; blk < 2; ++blk)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int r = 0; r < 4; ++r) f(blk, nb, r, m0 + 8 * nb + 2 * t + (r & 1), nt * 32 + 16 * blk + g + 8 * (r >> 1));
  }
};

// One warp's chunk of U consecutive k-tiles, as loaded: its lanes' weight fragments, the B
// fragments of its NB token blocks and, progressive, the level-1 parameter words of each of
// the chunk's F folds (F = U / GKc; see stream_kernel).
template <Kind K, int NB, int U, int F>
struct StreamChunk {
  uint4 w[U][kLaneBytes<K> / 16];
  uint32_t b[U][NB][2];
  uint32_t s1[F], zs1[F];
};

// The k-tile of slot u of a chunk starting at kt0: WHOLE chunks (kt0 + U <= kt_end, the steady
// state) use kt0 + u, so that every address is one base plus an immediate; the tail re-loads
// the split's last tile for the slots past it (their mma is skipped).
template <bool WHOLE>
__device__ __forceinline__ int chunk_tile(int kt0, int u, int kt_end) {
  return WHOLE ? kt0 + u : min(kt0 + u, kt_end - 1);
}

// QoQ progressive weights in the stream kernel: group scaling in accumulator space. The exact
// INT8 weight is (q - z) * s1, with q the raw code, s1 and z per (row, group). Instead of
// rebuilding it for every 32-bit word (the wgmma kernel's progressive_quad: a byte
// select, a subtract, a multiply-add and an xor per word, and the group's constants per
// k-tile), the stream kernel multiplies the RAW codes, like the per-channel kernel, into a
// per-group partial sum P = sum_k q x, sums the group's activations X = sum_k x with one more
// mma whose A operand is all ones, and once per group folds both into the accumulator:
//     acc += s1 * P - (z * s1) * X  =  sum_k (q - z) * s1 * x           (exact INT32)
// That moves the level-1 work from per weight word (8 words a k-tile) to per accumulator and
// group (2 multiply-adds per accumulator register every GKc k-tiles): at g128 and NB = 1 the
// loop drops from the 85 instructions per k-tile and warp profiled for version 4 to about 40
// (counted in the source, not profiled). Partial sums stay small (|P| <= 256 * 15 * 128 for
// GKc <= 8). Flushing part of a group (a chunk or a split ends inside it) is exact too: the
// fold is linear. The fold's cost grows with the accumulators (8 NB registers) while the
// per-word dequantization's does not, so from NB = 4 (M > 16) the kernel dequantizes per word
// as the wgmma kernel does (measured on the H200: the fold made M = 32 ~10-25% slower).
__device__ __forceinline__ void fold_group(int (&acc)[4], const int (&part)[4], const int (&xsum)[4], int s1_lo,
                                           int s1_hi, int zs_lo, int zs_hi) {
  // Registers 0, 1 are row g (level-1 parameters *_lo), 2, 3 row g + 8 (*_hi); tokens 2t, 2t+1.
  acc[0] += s1_lo * part[0] - zs_lo * xsum[0];
  acc[1] += s1_lo * part[1] - zs_lo * xsum[1];
  acc[2] += s1_hi * part[2] - zs_hi * xsum[2];
  acc[3] += s1_hi * part[3] - zs_hi * xsum[3];
}

template <Kind K, int NB, int RT, int WK, int U, int MIN_BLOCKS, bool OUTLIERS = false, int GKc = 1>
__global__ void __launch_bounds__(RT* WK* kWarp, MIN_BLOCKS) stream_kernel(const Params p) {
  static_assert((WK & (WK - 1)) == 0, "the k-slice reduction is a tree");
  static_assert(!OUTLIERS || (U % 2 == 0 && U / 2 <= kWarp), "a chunk holds U / 2 whole buckets, one lookup lane each");
  constexpr bool kProgressive = K == Kind::kProgressive;
  constexpr bool kFold = kProgressive && NB <= 2;  // group scaling in accumulator space (fold_group)
  static_assert(!kProgressive || U % GKc == 0, "a chunk holds whole folds");
  static_assert(kFold || GKc == 1, "per-word dequantization loads parameters per k-tile");
  constexpr int kBytes = kLaneBytes<K>;
  constexpr int CB = U / 2;                       // OUTLIERS: buckets per chunk
  constexpr int F = kProgressive ? U / GKc : 1;   // progressive: parameter words (folds) per chunk
  // Splits start on whole folds (progressive) and whole buckets (OUTLIERS), so chunks do too:
  // both units are powers of two, and the larger is a multiple of the smaller.
  constexpr int kFoldTiles = kProgressive ? GKc : 1, kBucketTiles = OUTLIERS ? 2 : 1;
  constexpr int kAlign = kFoldTiles > kBucketTiles ? kFoldTiles : kBucketTiles;
  const StreamThread<NB, RT, WK, kAlign> th(p);
  const auto [warp, lane, g, t, rt, wk, nt, m0, kt_begin, kt_end] = th;  // (lambdas below read th.kt_end)

  __shared__ int red[WK > 1 ? RT * (WK / 2) * 2 * NB * 4 * kWarp : 1];
  extern __shared__ __align__(128) uint8_t stream_dynamic[];  // OUTLIERS: CB bucket tiles per warp
  const uint32_t scratch = smem_u32(stream_dynamic) + warp * CB * kBucketTileBytes;
  if constexpr (OUTLIERS) zero_shared(scratch, CB * kBucketTileBytes, lane);

  // The next kernel of the stream (if launched by launch_maybe_pdl) may start once every CTA
  // of this grid has come this far; its CTAs take the slots ours free.
  pdl_launch_dependents();
  int acc[2][NB][4] = {};
  float sparse[2][NB][4] = {};  // OUTLIERS: the fp32 outlier sums, same (row, token) as acc
  if (nt >= p.NT) pdl_wait();  // (the others wait below, after their first weight loads)
  if (nt < p.NT) {
    // B fragment rows: token m0 + 8nb + g. Rows past M re-read row M - 1 (never stored).
    const int8_t* xrow[NB];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) xrow[nb] = p.x + static_cast<size_t>(min(m0 + 8 * nb + g, p.M - 1)) * p.Kp + 4 * t;
    const uint8_t* wrow = p.qweight + static_cast<size_t>(nt) * p.KT * 32 * kBytes + lane * kBytes;
    const size_t params_row = (static_cast<size_t>(nt) * p.groups) * 32 + 4 * g;  // progressive only
    using Chunk = StreamChunk<K, NB, U, F>;

    // Loads a chunk's weights and parameters (WEIGHTS: data no earlier kernel writes) or its
    // activations (!WEIGHTS).
    auto load = [&](Chunk& c, int kt0, auto whole, auto weights) {
      constexpr bool kWhole = decltype(whole)::value, kWeights = decltype(weights)::value;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int kt = chunk_tile<kWhole>(kt0, u, th.kt_end);
        if constexpr (kWeights) {
#pragma unroll
          for (int h = 0; h < kBytes / 16; ++h) c.w[u][h] = ldg_stream_v4(wrow + static_cast<size_t>(kt) * 32 * kBytes + 16 * h);
        } else {
#pragma unroll
          for (int nb = 0; nb < NB; ++nb) {
            c.b[u][nb][0] = ldg_u32(xrow[nb] + kt * 32);       // k = 4t .. 4t+3
            c.b[u][nb][1] = ldg_u32(xrow[nb] + kt * 32 + 16);  // k = 16+4t ..
          }
        }
      }
      if constexpr (kProgressive && kWeights) {
#pragma unroll
        for (int f = 0; f < F; ++f) {  // byte i of the words: row 8i + g (layout.pack_group_params)
          const size_t at = params_row + static_cast<size_t>(chunk_tile<kWhole>(kt0, f * GKc, th.kt_end) >> p.group_shift) * 32;
          c.s1[f] = ldg_u32(p.scale1 + at);
          c.zs1[f] = ldg_u32(p.zxs1 + at);
        }
      }
    };
    auto load_chunk = [&](Chunk& c, int kt0, auto weights) {  // warp-uniform branch
      if (kt0 + U <= th.kt_end) load(c, kt0, std::true_type{}, weights);
      else load(c, kt0, std::false_type{}, weights);
    };

    // The dense products of one loaded chunk.
    auto compute = [&](const Chunk& c, int kt0) {
      constexpr uint32_t kOnes[4] = {0x01010101u, 0x01010101u, 0x01010101u, 0x01010101u};
#pragma unroll
      for (int f = 0; f < F; ++f) {
        int part[2][NB][4] = {}, xsum[NB][4] = {};  // kFold: this fold's P and X
#pragma unroll
        for (int j = 0; j < (kProgressive ? GKc : U); ++j) {
          const int u = f * (kProgressive ? GKc : U) + j;
          if (kt0 + u < th.kt_end) {
            uint32_t a[2][4];
            if constexpr (K == Kind::kInt8Channel) w8_to_a(c.w[u][0], c.w[u][kBytes / 16 - 1], a);
            else if constexpr (kProgressive && !kFold) w4_progressive_to_a(c.w[u][0], c.s1[u], c.zs1[u], a);
            else w4_codes_to_a(c.w[u][0], a);  // folded progressive and per-channel alike: raw codes
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
              for (int blk = 0; blk < 2; ++blk) mma_s8_16832(kFold ? part[blk][nb] : acc[blk][nb], a[blk], c.b[u][nb][0], c.b[u][nb][1]);
              if constexpr (kFold) mma_s8_16832(xsum[nb], kOnes, c.b[u][nb][0], c.b[u][nb][1]);
            }
          }
        }
        if constexpr (kFold) {
          int s1[4], zs[4];  // rows g, g + 8, g + 16, g + 24 (block 0 lo/hi, block 1 lo/hi)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            s1[i] = static_cast<int>(__byte_perm(c.s1[f], 0, 0x4440 | i));
            zs[i] = static_cast<int>(__byte_perm(c.zs1[f], 0, 0x4440 | i));
          }
#pragma unroll
          for (int blk = 0; blk < 2; ++blk)
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) fold_group(acc[blk][nb], part[blk][nb], xsum[nb], s1[2 * blk], s1[2 * blk + 1], zs[2 * blk], zs[2 * blk + 1]);
        }
      }
    };

    const int first = kt_begin + wk * U, step = WK * U;
    // Before pdl_wait, while the previous kernel may still run: the first chunk's weights
    // (static data). (Measured and not kept: asking L2 for the next chunks ahead with bulk
    // prefetches, 2 or 4 chunks per warp, made every shape 2-19% slower.)
    Chunk c;
    if (first < kt_end) load_chunk(c, first, std::true_type{});
    pdl_wait();
    int2 lookup{};
    if constexpr (OUTLIERS) lookup = next_lookup<CB>(p, nt, first, kt_end, lane);
    for (int kt0 = first; kt0 < kt_end; kt0 += step) {
      if (kt0 != first) load_chunk(c, kt0, std::true_type{});
      load_chunk(c, kt0, std::false_type{});
      // OUTLIERS: the entries go out right after the weights (their lookups came a chunk ago,
      // except for the first chunk), and the next chunk's lookups after them.
      ChunkOutliers<NB, CB, 2> outliers;
      if constexpr (OUTLIERS) {
        outliers.load(p, lookup, lane);
        lookup = next_lookup<CB>(p, nt, kt0 + step, kt_end, lane);
      }
      compute(c, kt0);
      // (A k-tile past kt_end holds a re-loaded B fragment; its bucket columns hold no outliers.)
      if constexpr (OUTLIERS) {
        outliers.add(p, scratch, [&](int u, int nb, int h, uint32_t& lo, uint32_t& hi) { s8x4_to_f16x2(c.b[u][nb][h], lo, hi); },
                     sparse, lane);
      }
    }
  }

  if constexpr (WK > 1) {
    reduce_k_slices<NB, RT, WK>(acc, red, rt, wk, lane);
    if constexpr (OUTLIERS) reduce_k_slices<NB, RT, WK>(sparse, red, rt, wk, lane);
  }

  const bool holds = th.holds_sums(p);
  auto visit = [&](auto&& f) {
    if (!holds) return;
    th.for_each_output([&](int blk, int nb, int r, int m, int n) {
      if constexpr (OUTLIERS) f(m, n, acc[blk][nb][r], sparse[blk][nb][r]);
      else f(m, n, acc[blk][nb][r]);
    });
  };
  if (reduce_splits(p, visit)) {
    if constexpr (OUTLIERS) visit([&](int m, int n, int& v, float& s) { store_result_with_outliers<K>(p, m, n, v, s); });
    else visit([&](int m, int n, int& v) { store_result<K>(p, m, n, v); });
  }
}

// ---------------------------------------------------------------------------------------
// wgmma_kernel: Hopper warpgroup MMA fed by TMA, for large M (sm_90a)
// ---------------------------------------------------------------------------------------
//
// CTA = WGS warpgroups x 128 rows (4 row tiles each) x 128 tokens; grid = (NT / (4 WGS),
// M / 128, splits). One pipeline stage = 4 k-tiles = 128 bytes of K: exactly one row of the
// 128-byte swizzle, so a stage's activations are one TMA box of 128 tokens x 128 bytes,
// swizzled by the copy engine as wgmma wants them. Per stage, shared memory holds
//   [activations 128 x 128 B, swizzled][weights: row tile x k-tile x lane x 16 B, the packed
//    order][progressive: scale1 box, z*s1 box: row tile x group x 32 B]
// all brought by TMA (rows and k-tiles past the end arrive as zeros). Thread 0 issues the
// copies S-1 stages ahead and they complete on the stage's `full` mbarrier; each warp
// arrives on the stage's `empty` mbarrier once its wgmmas of that stage have retired, which
// lets thread 0 reuse the slot. Warpgroups never wait for each other otherwise.

struct TmaMaps {
  CUtensorMap x, w, s1, zs1;  // s1/zs1 only for progressive weights
};

template <Kind K, int WGS>
struct WgmmaShape {
  static constexpr int kBN = 128;      // tokens per CTA
  static constexpr int kRT = 4 * WGS;  // row tiles per CTA
  static constexpr int kKT = 4;        // k-tiles per stage
  static constexpr int kXBytes = kBN * 128;
  static constexpr int kWBytes = kRT * kKT * 32 * kLaneBytes<K>;
  static constexpr int kPBytes = K == Kind::kProgressive ? 2 * kRT * 4 * 32 : 0;  // up to 4 groups a stage
  static constexpr int kStage = (kXBytes + kWBytes + kPBytes + 1023) / 1024 * 1024;
  static constexpr int kStages = (200 * 1024 / kStage) < 6 ? (200 * 1024 / kStage) : 6;
  static constexpr int kSmem = kStages * kStage + 1024;  // + 1024: the base is rounded up to 1024
  static constexpr int kThreads = WGS * 128;
  static_assert(kStages >= 3, "the pipeline needs three stages");
};

// The wgmma kernel's split-K and epilogue go through shared memory. A lane's accumulators
// are scattered over the tile (d[i] of m16 block b of warp w: row 32w + 16b + g + 8((i>>1)&1),
// token 8(i>>2) + 2t + (i&1)), and storing them where they lie (what reduce_splits and
// store_result do for the stream kernel, with a handful per lane) cost the wgmma kernel one
// dependent global load/store chain per accumulator: 128 round trips per thread, a fixed
// 20-29 us per wave of CTAs (benchmarks/notes-gemm.md, version 6; now 4.7 us). Staged as a [128 tokens] x
// [rows] INT32 tile, each thread owns instead 32 chunks of 4 consecutive rows of one token
// (tokens 4 apart): partial sums move as coalesced 16-byte loads and stores, 16 in flight
// at once, and the scales are read before anything is stored.
template <int WGS>
struct WgmmaStaging {
  static constexpr int kRows = 128 * WGS;                // rows of the CTA's tile
  static constexpr int kPitch = kRows + 4;               // words per token: +4 puts a warp's 32 staging stores on 32 banks
  static constexpr int kChunks = kRows / 4;              // 16-byte chunks per token
  static constexpr int kTokenStep = 128 * WGS / kChunks; // = 4 tokens per pass of the CTA's threads
  static constexpr int kPasses = 128 / kTokenStep;       // = 32 chunks per thread
  static constexpr int kBytes = 128 * kPitch * 4;
};

__device__ __forceinline__ uint32_t pack_half2(__half lo, __half hi) {
  return static_cast<uint32_t>(__half_as_ushort(lo)) | static_cast<uint32_t>(__half_as_ushort(hi)) << 16;
}

__device__ __forceinline__ void add4(int4& a, const int4& b) {
  a.x += b.x;
  a.y += b.y;
  a.z += b.z;
  a.w += b.w;
}

template <Kind K, int WGS>
__device__ __forceinline__ void wgmma_epilogue(const Params& p, const int (&acc)[2][64], int* tile, int m0, int nt0) {
  using T = WgmmaStaging<WGS>;
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int i = 0; i < 64; ++i)
      tile[(8 * (i >> 2) + 2 * t + (i & 1)) * T::kPitch + 32 * warp + 16 * b + g + 8 * ((i >> 1) & 1)] = acc[b][i];
  __syncthreads();

  const int c = tid % T::kChunks, first = tid / T::kChunks;  // rows n0..n0+3 of tokens m0 + first + 4j
  const int n0 = nt0 * 32 + 4 * c;
  auto token = [&](int j) { return m0 + first + T::kTokenStep * j; };
  auto staged = [&](int j) { return *reinterpret_cast<const int4*>(tile + (first + T::kTokenStep * j) * T::kPitch + 4 * c); };
  const size_t ld = static_cast<size_t>(p.NT) * 32, slice = static_cast<size_t>(p.M) * ld;  // workspace [split][M][NT*32]
  const bool rows_in = n0 < static_cast<int>(ld);  // false past the last row tile (grid rounding)
  if (p.splits > 1) {  // as reduce_splits, in whole chunks
    int32_t* mine = p.workspace + blockIdx.z * slice + n0;
#pragma unroll 4
    for (int j = 0; j < T::kPasses; ++j)
      if (rows_in && token(j) < p.M) *reinterpret_cast<int4*>(mine + token(j) * ld) = staged(j);
    if (!arrive_last_split(p)) return;
  }
  if (n0 >= p.N) return;

  // Whole chunks (N % 4 == 0, so n0 < N means all four rows are in) go out as one vector store.
  const bool whole = p.N % 4 == 0 && (reinterpret_cast<uintptr_t>(p.out) & 15) == 0;
  float sw[4];
  int zero[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const bool in = n0 + r < p.N;
    sw[r] = in ? __half2float(p.scale[n0 + r]) : 0.f;
    zero[r] = K == Kind::kUInt4Channel && in ? static_cast<int>(p.zero[n0 + r]) : 0;
  }
  // Blocks of 16 tokens: the other splits' partials (16 loads in flight per split) and the
  // tokens' scales are all read before the block's stores.
  constexpr int kBlock = 16;
#pragma unroll 1
  for (int j0 = 0; j0 < T::kPasses; j0 += kBlock) {
    int4 v[kBlock];
#pragma unroll
    for (int j = 0; j < kBlock; ++j) v[j] = staged(j0 + j);
#pragma unroll 1
    for (int z = 0; z < p.splits; ++z) {
      if (z == static_cast<int>(blockIdx.z)) continue;
      const int32_t* theirs = p.workspace + z * slice + n0;
      int4 w[kBlock];
#pragma unroll
      for (int j = 0; j < kBlock; ++j) {
        const int m = token(j0 + j);
        w[j] = m < p.M ? __ldcg(reinterpret_cast<const int4*>(theirs + m * ld)) : make_int4(0, 0, 0, 0);  // L2: L1 is not coherent
      }
#pragma unroll
      for (int j = 0; j < kBlock; ++j) add4(v[j], w[j]);
    }
    float sx[kBlock];
    int rowsum[kBlock];
#pragma unroll
    for (int j = 0; j < kBlock; ++j) {
      const int m = token(j0 + j);
      sx[j] = m < p.M ? __half2float(p.x_scale[m]) : 0.f;
      rowsum[j] = K == Kind::kUInt4Channel && m < p.M ? p.x_rowsum[m] : 0;
    }
#pragma unroll
    for (int j = 0; j < kBlock; ++j) {
      const int m = token(j0 + j);
      if (m >= p.M) continue;
      int a[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
      for (int r = 0; r < 4; ++r) a[r] -= zero[r] * rowsum[j];  // per-channel zero point (0 otherwise)
      const size_t at = static_cast<size_t>(m) * p.N + n0;
      if (p.out_i32) {
        int32_t* out = static_cast<int32_t*>(p.out) + at;
        if (whole) {
          *reinterpret_cast<int4*>(out) = make_int4(a[0], a[1], a[2], a[3]);
        } else {
#pragma unroll
          for (int r = 0; r < 4; ++r)
            if (n0 + r < p.N) out[r] = a[r];
        }
        continue;
      }
      __half y[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) y[r] = __float2half_rn(dense_value<K>(a[r], sx[j], sw[r]));
      __half* out = static_cast<__half*>(p.out) + at;
      if (whole) {
        *reinterpret_cast<uint2*>(out) = make_uint2(pack_half2(y[0], y[1]), pack_half2(y[2], y[3]));
      } else {
#pragma unroll
        for (int r = 0; r < 4; ++r)
          if (n0 + r < p.N) out[r] = y[r];
      }
    }
  }
}

template <Kind K, int WGS>
__global__ void __launch_bounds__(WGS * 128, 1) wgmma_kernel(const Params p, const __grid_constant__ TmaMaps maps) {
#if QOQ_HAS_WGMMA
  using S = WgmmaShape<K, WGS>;
  constexpr int kBytes = kLaneBytes<K>;
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t bars[2 * S::kStages];  // full[0, S), empty[S, 2S)
  const uint32_t smem = (smem_u32(smem_raw) + 1023) & ~1023u;  // swizzle atoms are 1024-aligned
  const uint32_t full = smem_u32(&bars[0]), empty = smem_u32(&bars[S::kStages]);

  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp, g = lane / 4;
  const int nt0 = blockIdx.x * S::kRT, m0 = blockIdx.y * S::kBN;
  // Splits are whole stages, so a stage always starts at a multiple of 4 k-tiles and never
  // straddles a group (groups are 32 * 2^j wide).
  const int stages = ceil_div(p.KT, S::kKT);
  const int st_begin = split_begin(stages, blockIdx.z, p.splits), n_stages = split_begin(stages, blockIdx.z + 1, p.splits) - st_begin;
  const int kt_begin = st_begin * S::kKT;
  const int gps = p.groups_per_stage;
  const uint32_t param_box = S::kRT * gps * 32;  // bytes of one parameter box
  const uint32_t tx_bytes = S::kXBytes + S::kWBytes + (K == Kind::kProgressive ? 2 * param_box : 0);

  pdl_launch_dependents();  // the next kernel may start; it waits for us before it reads our output
  if (tid == 0) {
    for (int i = 0; i < S::kStages; ++i) {
      mbar_init(full + 8 * i, 1);                 // thread 0's arrive.expect_tx
      mbar_init(empty + 8 * i, S::kThreads / kWarp);  // one arrival per warp
    }
    mbar_fence_init();
  }
  __syncthreads();
  pdl_wait();  // the previous kernel (which may write our activations) has finished

  auto issue = [&](int s) {  // thread 0: all copies of stage s
    const int slot = s % S::kStages, kt0 = kt_begin + s * S::kKT;
    const uint32_t base = smem + slot * S::kStage, bar = full + 8 * slot;
    mbar_arrive_expect_tx(bar, tx_bytes);
    tma_load_2d(base, &maps.x, kt0 * 32, m0, bar);
    tma_load_3d(base + S::kXBytes, &maps.w, 0, kt0, nt0, bar);
    if constexpr (K == Kind::kProgressive) {
      const int grp0 = kt0 >> p.group_shift;
      tma_load_3d(base + S::kXBytes + S::kWBytes, &maps.s1, 0, grp0, nt0, bar);
      tma_load_3d(base + S::kXBytes + S::kWBytes + param_box, &maps.zs1, 0, grp0, nt0, bar);
    }
  };

  int acc[2][64];  // [m16 block of the row tile][wgmma fragment]
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[b][i] = 0;

  if (tid == 0)
    for (int s = 0; s < S::kStages - 1 && s < n_stages; ++s) issue(s);
  const int rt = warp;  // this warp's row tile in the CTA (warp w of warpgroup q: 4q + w)
  for (int s = 0; s < n_stages; ++s) {
    const int ahead = s + S::kStages - 1;  // refill the slot of stage s-1, released at the end of iteration s-1
    if (tid == 0 && ahead < n_stages) {
      if (ahead >= S::kStages) mbar_wait(empty + 8 * (ahead % S::kStages), (ahead / S::kStages - 1) & 1);
      issue(ahead);
    }
    mbar_wait(full + 8 * (s % S::kStages), (s / S::kStages) & 1);
    __syncwarp();  // wgmma is .aligned: the whole warp must arrive together

    const uint32_t base = smem + (s % S::kStages) * S::kStage;
    // All of the stage's fragments first: their shared-memory latencies overlap. No k-tile is
    // skipped in the last, partial stage: TMA filled the k-tiles past K with zeros (weights,
    // group parameters and activations alike), and they add zero.
    Fragment<K> f[S::kKT];
#pragma unroll
    for (int kk = 0; kk < S::kKT; ++kk) {
      const uint32_t wtile = base + S::kXBytes + ((rt * S::kKT + kk) * 32 + lane) * kBytes;
#pragma unroll
      for (int h = 0; h < kBytes / 16; ++h) f[kk].w[h] = lds_v4(wtile + 16 * h);
      if constexpr (K == Kind::kProgressive) {
        // Stages start on multiples of 4 k-tiles, so k-tile kk is in group kk >> group_shift of the stage.
        const uint32_t params = base + S::kXBytes + S::kWBytes + (rt * gps + (kk >> p.group_shift)) * 32 + 4 * g;
        f[kk].s1 = lds_u32(params);
        f[kk].zs1 = lds_u32(params + param_box);
      }
    }
    // Every A operand of the stage is written before its first wgmma, and every wgmma of the
    // stage has retired before the next stage writes any: a wgmma reads its A registers
    // asynchronously until a wait retires it, and ptxas neither knows that nor keeps the
    // registers from other uses, so nothing may be written while one is in flight. (With
    // per-k-tile waits instead, ptxas moved the next k-tiles' writes above the waits and
    // the results went wrong: notes-gemm.md, version 6.)
    uint32_t a[S::kKT][2][4];
#pragma unroll
    for (int kk = 0; kk < S::kKT; ++kk) f[kk].to_a(a[kk]);
    wgmma_fence();  // a[] was written by ordinary instructions
#pragma unroll
    for (int kk = 0; kk < S::kKT; ++kk) {
      const uint64_t desc = wgmma_desc_k128b(base + kk * 32);  // k-tile kk: bytes 32kk.. of each row
      wgmma_m64n128k32_rs(acc[0], a[kk][0], desc);
      wgmma_m64n128k32_rs(acc[1], a[kk][1], desc);
    }
    wgmma_commit();
    wgmma_wait<0>();
    if (lane == 0) mbar_arrive(empty + 8 * (s % S::kStages));  // this stage's slot can be refilled
  }
  __syncthreads();  // every warp is done with the pipeline's slots: they become the staging tile
  static_assert(S::kStages * S::kStage >= WgmmaStaging<WGS>::kBytes, "the staging tile must fit in the pipeline's slots");
  wgmma_epilogue<K, WGS>(p, acc, reinterpret_cast<int*>(smem_raw + (smem - smem_u32(smem_raw))), m0, nt0);
#endif  // QOQ_HAS_WGMMA
}

// ---------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------

enum class KernelId : int { kStream = 0, kWgmma = 1 };

// Whether the GEMM kernels (stream, W4A16, wgmma) go out as programmatic dependent launches
// (on by default; qoq_gemm_set_dependent_launch): their CTAs start while the previous kernel
// of the stream finishes - the stream kernel also loads its first chunk of weights then.
// Measured on the H200 (benchmarks/gemm.py --explore-stream): -1.6 to -2.4 us per stream
// GEMM at M = 1 and 16 on the benchmark shapes.
inline bool& dependent_launch() {
  static bool enabled = true;
  return enabled;
}

// Stream-kernel shapes by tokens per CTA (8*NB): RT row tiles x WK k-slices = 8 warps;
// U k-tiles in flight per warp, fewer when the accumulators grow.
// OUTLIERS: chunks of 4 k-tiles (2 buckets; 8 KB of bucket tiles per warp, 64 KB per CTA) keep
// the outlier registers and two CTAs per SM within budget at NB <= 2.
// Progressive weights at NB <= 2 fold a group every GKc = min(group k-tiles, 4, U) k-tiles;
// with one-k-tile groups (g32) and NB = 2 the chunk is halved, so that its per-k-tile
// parameter words fit beside the partial sums.
// (Measured on the H200 and not kept: two chunks in registers, the next one's loads in flight
// while one multiplies, with U or U / 2 k-tiles - within +-5% of this, better or worse by shape.)
template <Kind K, int NB, bool OUTLIERS, int GKc>
cudaError_t launch_stream_shape(const Params& p, cudaStream_t stream) {
  constexpr int RT = 2, WK = 4;
  constexpr int U0 = OUTLIERS ? (NB == 8 ? 2 : 4) : (NB <= 2 ? 8 : (NB == 4 ? 4 : 2));
  constexpr int U = K == Kind::kProgressive && GKc == 1 && NB == 2 ? U0 / 2 : U0;
  constexpr int G = GKc < U ? GKc : U;
  constexpr int MIN_BLOCKS = NB <= (OUTLIERS ? 2 : 4) ? 2 : 1;
  constexpr int kSmem = OUTLIERS ? RT * WK * (U / 2) * kBucketTileBytes : 0;
  const auto kernel = stream_kernel<K, NB, RT, WK, U, MIN_BLOCKS, OUTLIERS, G>;
  // (Static + dynamic shared memory above 48 KB needs the opt-in, whatever the split.)
  if constexpr (kSmem > 0) QOQ_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  const dim3 grid(ceil_div(p.NT, RT), ceil_div(p.M, 8 * NB), p.splits);
  return launch_maybe_pdl(kernel, grid, dim3(RT * WK * kWarp), kSmem, stream, dependent_launch(), p);
}

template <Kind K, int NB, bool OUTLIERS = false>
cudaError_t launch_stream(const Params& p, cudaStream_t stream) {
  if constexpr (K != Kind::kProgressive || NB > 2) {  // no group fold (see stream_kernel): GKc = 1
    return launch_stream_shape<K, NB, OUTLIERS, 1>(p, stream);
  } else {
    switch (p.group_shift) {  // k-tiles per group: 1, 2, 4 or more (folded every 4)
      case 0: return launch_stream_shape<K, NB, OUTLIERS, 1>(p, stream);
      case 1: return launch_stream_shape<K, NB, OUTLIERS, 2>(p, stream);
      default: return launch_stream_shape<K, NB, OUTLIERS, 4>(p, stream);
    }
  }
}

// cuTensorMapEncodeTiled from the driver, found through the runtime (no -lcuda needed).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t status = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
    return status == cudaSuccess && found == cudaDriverEntryPointSuccess ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn) : nullptr;
  }();
  return encode;
}

// A tiled TMA map of a rank-R tensor: dims and box innermost first, strides in bytes of dims 1..R-1.
template <int R>
cudaError_t encode_map(CUtensorMap* map, CUtensorMapDataType type, const void* base, const cuuint64_t (&dims)[R],
                       const cuuint64_t (&strides)[R - 1], const cuuint32_t (&box)[R], CUtensorMapSwizzle swizzle) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  cuuint32_t unit[R];
  for (int i = 0; i < R; ++i) unit[i] = 1;
  const CUresult status = encode(map, type, R, const_cast<void*>(base), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                 swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return status == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

template <Kind K, int WGS>
cudaError_t launch_wgmma(const Params& p_in, cudaStream_t stream) {
  using S = WgmmaShape<K, WGS>;
  int major = 0;
  QOQ_RETURN_IF_ERROR(current_device_major(&major));
  if (major != 9) return cudaErrorInvalidDeviceFunction;  // wgmma exists only in the sm_90a image
  Params p = p_in;
  if (p.splits > ceil_div(p.KT, S::kKT)) return cudaErrorInvalidValue;  // splits are whole stages
  TmaMaps maps{};
  const cuuint64_t M = p.M, Kp = p.Kp, KT = p.KT, NT = p.NT, words = 8 * kLaneBytes<K>;  // u32 words per tile
  // Activations [M, Kp] bytes: boxes of 128 tokens x 128 bytes, swizzled for wgmma.
  QOQ_RETURN_IF_ERROR(encode_map<2>(&maps.x, CU_TENSOR_MAP_DATA_TYPE_UINT8, p.x, {Kp, M}, {Kp}, {128, S::kBN},
                                    CU_TENSOR_MAP_SWIZZLE_128B));
  // Packed weights [NT, KT, tile words]: boxes of 4 k-tiles x 4*WGS row tiles, copied as stored.
  QOQ_RETURN_IF_ERROR(encode_map<3>(&maps.w, CU_TENSOR_MAP_DATA_TYPE_UINT32, p.qweight, {words, KT, NT},
                                    {4 * words, 4 * words * KT}, {static_cast<cuuint32_t>(words), S::kKT, S::kRT},
                                    CU_TENSOR_MAP_SWIZZLE_NONE));
  if constexpr (K == Kind::kProgressive) {
    // Group parameters [NT, groups, 32 bytes]: the groups of one stage x 4*WGS row tiles.
    p.groups_per_stage = p.group_shift >= 2 ? 1 : 4 >> p.group_shift;
    const cuuint64_t G = p.groups;
    const cuuint32_t box[3] = {8, static_cast<cuuint32_t>(p.groups_per_stage), S::kRT};
    QOQ_RETURN_IF_ERROR(encode_map<3>(&maps.s1, CU_TENSOR_MAP_DATA_TYPE_UINT32, p.scale1, {8, G, NT}, {32, 32 * G}, box,
                                      CU_TENSOR_MAP_SWIZZLE_NONE));
    QOQ_RETURN_IF_ERROR(encode_map<3>(&maps.zs1, CU_TENSOR_MAP_DATA_TYPE_UINT32, p.zxs1, {8, G, NT}, {32, 32 * G}, box,
                                      CU_TENSOR_MAP_SWIZZLE_NONE));
  }
  QOQ_RETURN_IF_ERROR(cudaFuncSetAttribute(wgmma_kernel<K, WGS>, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmem));
  const dim3 grid(ceil_div(p.NT, S::kRT), ceil_div(p.M, S::kBN), p.splits);
  return launch_maybe_pdl(wgmma_kernel<K, WGS>, grid, dim3(S::kThreads), S::kSmem, stream, dependent_launch(), p, maps);
}

// kernel/tile as chosen by qoqtool.runtime.cuda_ops.plan: stream with NB = tile (1, 2, 4, 8),
// wgmma with WGS = tile (1, 2).
template <Kind K>
cudaError_t launch(const Params& p, int kernel, int tile, cudaStream_t stream) {
  if (p.M <= 0) return cudaSuccess;
  if (p.splits < 1 || p.splits > p.KT) return cudaErrorInvalidValue;
  if (kernel == static_cast<int>(KernelId::kStream)) {
    switch (tile) {
      case 1: return launch_stream<K, 1>(p, stream);
      case 2: return launch_stream<K, 2>(p, stream);
      case 4: return launch_stream<K, 4>(p, stream);
      case 8: return launch_stream<K, 8>(p, stream);
    }
  } else if (kernel == static_cast<int>(KernelId::kWgmma)) {
    switch (tile) {
      case 1: return launch_wgmma<K, 1>(p, stream);
      case 2: return launch_wgmma<K, 2>(p, stream);
    }
  }
  return cudaErrorInvalidValue;
}

// The fused sparse-dense GEMM (W4A8 + Tile-COO outliers): the stream kernel only, NB = tile.
// The wgmma kernel has no outlier path yet (qoqtool.runtime.packed_linear adds the outliers
// after it). Needs an fp16 output and, with splits > 1, p.sparse_workspace.
template <Kind K>
cudaError_t launch_sparse_dense(const Params& p, int tile, cudaStream_t stream) {
  if (p.M <= 0) return cudaSuccess;
  if (p.splits < 1 || p.splits > p.KT || p.out_i32 || p.NBk != ceil_div(p.KT * 32, kBucketK)) return cudaErrorInvalidValue;
  if (p.splits > 1 && p.sparse_workspace == nullptr) return cudaErrorInvalidValue;
  switch (tile) {
    case 1: return launch_stream<K, 1, true>(p, stream);
    case 2: return launch_stream<K, 2, true>(p, stream);
    case 4: return launch_stream<K, 4, true>(p, stream);
    case 8: return launch_stream<K, 8, true>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace qoq::gemm
