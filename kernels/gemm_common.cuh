// What the GEMM main loops share (gemm_stream.cuh, gemm_wgmma.cuh; the overview is in
// gemm_kernels.cuh): the weight kinds, a launch's parameters, packed fragments -> mma A
// registers, the dense epilogue and split-K across CTAs.
#pragma once

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
  const int32_t* x_rowsum;  // [M] sum of each row's codes (kUInt4Channel; kProgressive: optional, the wgmma kernel's UINT8 weights)
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
  // Diagnostics (stream kernel; benchmarks/gemm_timeline.py): when set, thread 0 of each CTA
  // writes kTraceWords words at trace[cta * kTraceWords] (TraceStamp).
  unsigned long long* trace;
};

// The stamps of a CTA's timeline (global timer, ns), then its multiprocessor and whether it
// ran the epilogue.
enum TraceStamp : int { kEntry, kWaited, kFirstChunk, kLoopDone, kSlicesReduced, kSplitsReduced, kStored, kWhere, kTraceWords };
__device__ __forceinline__ void trace_put(const Params& p, int word, unsigned long long value) {
  if (p.trace != nullptr && threadIdx.x == 0) {
    const int cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    p.trace[cta * kTraceWords + word] = value;
  }
}
__device__ __forceinline__ void trace_stamp(const Params& p, int stamp) {
  if (p.trace != nullptr && threadIdx.x == 0) trace_put(p, stamp, global_timer_ns());
}

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
// BIASED: the flip is left out and the bytes are the UINT8 weights (q - z)*s1 + 128, for an
// unsigned A operand whose sums exceed the true ones by 128 * sum_k x (the wgmma kernel
// subtracts that in its epilogue, from the token's row sum): one instruction for four weights.
template <bool BIASED = false>
__device__ __forceinline__ uint32_t progressive_quad(uint32_t q4, uint32_t s1, uint32_t c) {
  return BIASED ? q4 * s1 + c : (q4 * s1 + c) ^ 0x80808080u;
}

// A lane's 16 bytes of a W4 tile are its A fragments of the tile's two m16 blocks: word i holds
// row 8i + g, so block b is words 2b (rows g) and 2b + 1 (rows g + 8). A word's low nibbles are
// k = 4t + j (register a0 of its block for the even word, a1 for the odd one), its high
// nibbles k = 16 + 4t + j (a2 / a3). One block at a time below (the wgmma kernel's K2 form
// multiplies one block per warpgroup); the whole fragment is both blocks.
//
// Progressive: byte i of the parameter words belongs to row 8i + g (layout.pack_group_params),
// i = 2b + j for word j of block b.
template <bool BIASED = false>
__device__ __forceinline__ void w4_progressive_block_to_a(uint32_t w0, uint32_t w1, uint32_t s1_word, uint32_t zs1_word,
                                                          int b, uint32_t (&a)[4]) {
  const uint32_t words[2] = {w0, w1};
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int i = 2 * b + j;
    const uint32_t s1 = __byte_perm(s1_word, 0, 0x4440 | i);           // byte i, zero-extended
    const uint32_t c = 0x80808080u - __byte_perm(zs1_word, 0, 0x1111 * i);  // 128 - z*s1, x4
    a[j] = progressive_quad<BIASED>(words[j] & 0x0F0F0F0Fu, s1, c);
    a[2 + j] = progressive_quad<BIASED>((words[j] >> 4) & 0x0F0F0F0Fu, s1, c);
  }
}
template <bool BIASED = false>
__device__ __forceinline__ void w4_progressive_to_a(const uint4& w, uint32_t s1_word, uint32_t zs1_word,
                                                    uint32_t (&a)[2][4]) {
  w4_progressive_block_to_a<BIASED>(w.x, w.y, s1_word, zs1_word, 0, a[0]);
  w4_progressive_block_to_a<BIASED>(w.z, w.w, s1_word, zs1_word, 1, a[1]);
}

// Per-channel W4: the raw codes 0..15 are already valid s8 operands; the zero point is
// applied once per output in the epilogue (acc - z * rowsum(x)).
__device__ __forceinline__ void w4_codes_block_to_a(uint32_t w0, uint32_t w1, uint32_t (&a)[4]) {
  a[0] = w0 & 0x0F0F0F0Fu;
  a[1] = w1 & 0x0F0F0F0Fu;
  a[2] = (w0 >> 4) & 0x0F0F0F0Fu;
  a[3] = (w1 >> 4) & 0x0F0F0F0Fu;
}
__device__ __forceinline__ void w4_codes_to_a(const uint4& w, uint32_t (&a)[2][4]) {
  w4_codes_block_to_a(w.x, w.y, a[0]);
  w4_codes_block_to_a(w.z, w.w, a[1]);
}

// W8: 32 bytes a lane, block b's 16 bytes (b = 0: lo, 1: hi); word 2i + h of a block holds
// row 8i + g at k = 16h + 4t + j, so its registers are words 0, 2, 1, 3.
__device__ __forceinline__ void w8_block_to_a(const uint4& w, uint32_t (&a)[4]) {
  a[0] = w.x; a[1] = w.z; a[2] = w.y; a[3] = w.w;
}
__device__ __forceinline__ void w8_to_a(const uint4& lo, const uint4& hi, uint32_t (&a)[2][4]) {
  w8_block_to_a(lo, a[0]);
  w8_block_to_a(hi, a[1]);
}

// A lane's raw fragment of one tile in the wgmma kernel's shared memory - BLOCKS of its two
// m16 blocks from block blk0 on (the K2 form: one, its half of the lane's bytes) - plus its group
// parameter words (progressive).
template <Kind K, int BLOCKS = 2>
struct Fragment {
  static constexpr int kBlockWords = kLaneBytes<K> / 8;  // W4: 2 words a block, W8: 4
  uint32_t w[BLOCKS * kBlockWords];
  uint32_t s1, zs1;

  // lane_tile: the lane's bytes of the tile (kLaneBytes of them).
  __device__ __forceinline__ void load(uint32_t lane_tile, int blk0) {
    const uint32_t at = lane_tile + 4 * kBlockWords * blk0;
    if constexpr (BLOCKS * kBlockWords == 2) {
      const uint2 v = lds_v2(at);
      w[0] = v.x, w[1] = v.y;
    } else {
#pragma unroll
      for (int h = 0; h < BLOCKS * kBlockWords / 4; ++h) {
        const uint4 v = lds_v4(at + 16 * h);
        w[4 * h] = v.x, w[4 * h + 1] = v.y, w[4 * h + 2] = v.z, w[4 * h + 3] = v.w;
      }
    }
  }

  template <bool BIASED = false>  // progressive: UINT8 weights + 128 (progressive_quad)
  __device__ __forceinline__ void to_a(uint32_t (&a)[BLOCKS][4], int blk0) const {
#pragma unroll
    for (int b = 0; b < BLOCKS; ++b) {
      const uint32_t* v = w + kBlockWords * b;
      if constexpr (K == Kind::kProgressive) w4_progressive_block_to_a<BIASED>(v[0], v[1], s1, zs1, blk0 + b, a[b]);
      if constexpr (K == Kind::kUInt4Channel) w4_codes_block_to_a(v[0], v[1], a[b]);
      if constexpr (K == Kind::kInt8Channel) w8_block_to_a(make_uint4(v[0], v[1], v[2], v[3]), a[b]);
    }
  }
};

// ---------------------------------------------------------------------------------------
// Epilogue and split-K
// ---------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t pack_half2(__half lo, __half hi) {
  return static_cast<uint32_t>(__half_as_ushort(lo)) | static_cast<uint32_t>(__half_as_ushort(hi)) << 16;
}

template <class V>  // int4 or float4
__device__ __forceinline__ void add4(V& a, const V& b) {
  a.x += b.x;
  a.y += b.y;
  a.z += b.z;
  a.w += b.w;
}

// out[n0 .. n0 + 3] of one output row: one 16-byte (INT32) or 8-byte (fp16) store when
// `whole` (all four inside N and the row aligned), else one store per row inside N.
__device__ __forceinline__ void store_row4(int32_t* out, const int (&a)[4], int n0, int N, bool whole) {
  if (whole) {
    *reinterpret_cast<int4*>(out) = make_int4(a[0], a[1], a[2], a[3]);
  } else {
#pragma unroll
    for (int r = 0; r < 4; ++r)
      if (n0 + r < N) out[r] = a[r];
  }
}
__device__ __forceinline__ void store_row4(__half* out, const __half (&y)[4], int n0, int N, bool whole) {
  if (whole) {
    *reinterpret_cast<uint2*>(out) = make_uint2(pack_half2(y[0], y[1]), pack_half2(y[2], y[3]));
  } else {
#pragma unroll
    for (int r = 0; r < 4; ++r)
      if (n0 + r < N) out[r] = y[r];
  }
}

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

// After this CTA has written its split's partials: counts it in, and returns true in the last
// split of the tile to arrive (which resets the counter for the next launch), once every
// other split's partials are visible to it. Every thread of the CTA must call this.
// The barrier orders every thread's partials before thread 0's count, and the count is one
// acq_rel atomic at GPU scope: its release is cumulative (it publishes what the barrier
// ordered before it) and its acquire, in the last split, passes to the CTA's threads through
// the second barrier - the semaphore pattern of CUTLASS's GenericBarrier, instead of a
// sequentially consistent fence in every thread before the count and after it (MEMBAR.SC.GPU,
// 6% of the stall samples at M = 16: benchmarks/notes-gemm.md, version 8).
__device__ __forceinline__ bool arrive_last_split(const Params& p) {
  __shared__ int last_split;
  __syncthreads();
  if (threadIdx.x == 0) {
    int* counter = p.counters + blockIdx.y * gridDim.x + blockIdx.x;
    int before;
    asm volatile("atom.add.acq_rel.gpu.global.s32 %0, [%1], 1;\n" : "=r"(before) : "l"(counter) : "memory");
    last_split = before == p.splits - 1;
    if (last_split) *counter = 0;  // every split has arrived: reset for the next launch
  }
  __syncthreads();
  return last_split;
}

// Split-K across CTAs for the W4A16 kernels, where each accumulator stays in its register
// (the W4A8 kernels stage their tiles instead: stream_epilogue, wgmma_epilogue). `visit(f)`
// calls f(m, n, int& acc, float&... sums) for every accumulator this thread holds (threads
// holding none call nothing); the fp32 sums travel through p.sparse_workspace beside the
// INT32 ones.
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
  // The fp32 sums in split order, this CTA's own read back in its place (as stream_epilogue:
  // the last CTA to arrive varies, and an order that followed it is not deterministic).
#pragma unroll 1
  for (int z = 0; z < p.splits; ++z) {
    const int32_t* theirs = p.workspace + z * slice;
    visit([&](int m, int n, int& acc, auto&... sparse) {
      if (m < p.M) {
        if (z != static_cast<int>(blockIdx.z)) acc += __ldcg(theirs + m * ld + n);  // through L2: L1 is not coherent
        ((sparse = (z == 0 ? 0.f : sparse) + __ldcg(p.sparse_workspace + z * slice + m * ld + n)), ...);
      }
    });
  }
  return true;
}
}  // namespace qoq::gemm
