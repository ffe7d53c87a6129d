// wgmma_kernel (Hopper warpgroup MMA fed by TMA, larger M) and its epilogue; see the
// overview in gemm_kernels.cuh.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums (types only: the encoder comes via the runtime)

#include "gemm_common.cuh"

namespace qoq::gemm {

// ---------------------------------------------------------------------------------------
// wgmma_kernel: Hopper warpgroup MMA fed by TMA, for large M (sm_90a)
// ---------------------------------------------------------------------------------------
//
// CTA = WGS warpgroups x 128 rows (4 row tiles each) x BN = 128 tokens; grid = (NT / (4 WGS),
// M / BN, splits). One pipeline stage = 4 k-tiles = 128 bytes of K: exactly one row of the
// 128-byte swizzle, so a stage's activations are one TMA box of BN tokens x 128 bytes,
// swizzled by the copy engine as wgmma wants them. Per stage, shared memory holds
//   [activations BN x 128 B, swizzled][weights: row tile x k-tile x lane x 16 B, the packed
//    order][progressive: scale1 box, z*s1 box (each in its half of the space for 4 groups): row
//    tile x group x 32 B]
// all brought by TMA (rows and k-tiles past the end arrive as zeros). Thread 0 issues the
// copies S-2 stages ahead (the first stage's weights before the dependent-launch wait) and
// they complete on the stage's `full` mbarrier; each warp arrives on the stage's `empty`
// mbarrier once its wgmmas of that stage have retired, which lets thread 0 reuse the slot.
// Warpgroups never wait for each other otherwise. Each warpgroup keeps two stages' A operands
// in registers, so that its wgmmas of one stage run while it dequantizes the next (the main
// loop, in the kernel).
//
// KS = 2 (kernel id kWgmmaK2, WGS = 1): four warpgroups share one 128-row tile. The tile's
// stages are split in two halves, warpgroups of half q taking stages q, q + 2, q + 4, ...;
// each half has its own half of the slots (a ring of kStages / 2, refilled by its own first
// thread after that thread's own stage, a whole ring ahead: kRefillAfter), so the halves run
// as independent pipelines. And each half's rows are split by m16 block (BS = 2, kBS):
// warpgroup (q, b) multiplies only block b (rows 32w + 16b .. + 15 of its warps' row tiles) -
// one m64 wgmma per k-tile, half of each lane's fragment, 64 accumulator registers - and both
// block warpgroups of a half read its slots (`empty` counts their 8 warps). The four partial tiles meet once, in shared memory, before the epilogue.
// Why: with one warpgroup a stage costs ~0.72 us against 0.26 us of tensor-core work (a
// latency chain: wait for the slot, fragments, dequantization, 8 wgmmas, their retirement),
// and at M ~ 256 there are too few 128 x 128 tiles to give every SM two CTAs (splitting K
// across CTAs costs a workspace round trip and a fixed cost per CTA). Two pipelines of two
// blocks each (version 14, 128 accumulators a thread) were 1.7x one warpgroup's throughput;
// the block split puts four pipelines of half the work on the SM for the same registers and
// is 1.05x faster again (H200, benchmarks/gemm.py --explore-wgmma: 1.00-1.09x in all 130
// case x split pairs; notes-gemm.md, version 17).
//
// BN = 64 (kernel id kWgmmaK2T64, the K2 form only): 64 tokens per CTA, m64n64 wgmmas, 32
// accumulators a thread, five slots per half. At M <= 64 a 128-token tile multiplies half
// zeros; 64-token tiles do half the tensor-core work per stage for the same dequantization
// (a stage costs ~0.78x the 128-token one) and, at M = 65..128, twice the CTAs without a K
// split. H200 (benchmarks/gemm.py --explore-wgmma, notes-gemm.md, version 18): 1.14-1.27x the
// best 128-token choice at M = 64 on five shapes, 1.11x at M = 128 on 4096^2; from M = 256 the
// 128-token forms are as fast or faster.
//
// RPW = 64 (kernel id kWgmmaM64, KS = 1): warpgroups of 64 rows - one m64 block each, one
// wgmma per k-tile - so a CTA of WGS = 3 warpgroups holds 6 row tiles (192 rows; warp v
// multiplies m16 block v % 2 of row tile v / 2, warpgroup q rows 64q .. 64q + 63), all of them
// walking every stage of one pipeline. Why: a 256-row CTA of two row warpgroups leaves SMs
// idle where the row count does not fill them (11008 x 4096 at M = 256: 86 CTAs for 132 SMs),
// and 128-row CTAs (172) need a second wave; 192-row CTAs give 116.

struct TmaMaps {
  CUtensorMap x, w, s1, zs1;  // s1/zs1 only for progressive weights
};

template <Kind K, int WGS, int KS = 1, int BN = 128, int RPW = 128>
struct WgmmaShape {
  static_assert(KS == 1 || (KS == 2 && WGS == 1 && RPW == 128), "a K split of one 128-row tile");
  static_assert(BN == 128 || (BN == 64 && KS == 2), "64-token tiles: the K2 form only");
  static_assert(RPW == 128 || (RPW == 64 && KS == 1 && BN == 128), "64-row warpgroups: one pipeline, 128 tokens");
  // A warp multiplies one m16 block of its row tile (the K2 form, whose halves split their rows
  // by block too, and the 64-row warpgroups) or both.
  static constexpr int kBS = RPW == 64 ? 2 : KS;
  static constexpr int kBlocks = 2 / kBS;   // m64 blocks (wgmma accumulators) per warpgroup
  static constexpr int kBN = BN;       // tokens per CTA
  static constexpr int kRT = WGS * RPW / 32;  // row tiles per CTA
  static constexpr int kKT = 4;        // k-tiles per stage
  static constexpr int kXBytes = kBN * 128;
  static constexpr int kWBytes = kRT * kKT * 32 * kLaneBytes<K>;
  static constexpr int kPBytes = K == Kind::kProgressive ? 2 * kRT * 4 * 32 : 0;  // up to 4 groups a stage
  static constexpr int kStage = (kXBytes + kWBytes + kPBytes + 1023) / 1024 * 1024;
  // KS = 2: up to 4 slots per warpgroup, 5 with 64 tokens (H200, benchmarks/library_ab.py: 1.03x
  // at M = 64 per group against 4)
  static constexpr int kMaxStages = KS == 1 ? 6 : (BN == 64 ? 10 : 8);
  static constexpr int kFit = 200 * 1024 / kStage;
  static constexpr int kStages = (kFit < kMaxStages ? kFit : kMaxStages) / KS * KS;
  static constexpr int kRing = kStages / KS;             // the slots of one warpgroup's pipeline
  static constexpr int kSmem = kStages * kStage + 1024;  // + 1024: the base is rounded up to 1024
  static constexpr int kConsumerWarps = kRT * kBS;     // the warps of one pipeline, which read each of its stages (its `empty` count)
  static constexpr int kThreads = KS * kConsumerWarps * kWarp;
  static_assert(kRing >= 3, "each pipeline needs three stages");

  // Where warp `warp` works: its K half (KS = 2), its m16 block (kBS = 2) and its row tile.
  // K2: warp = (half kBS + block) kRT + row tile; 64-row warpgroups: warp = 2 row tile + block.
  __device__ __forceinline__ static int half_of(int warp) { return KS == 1 ? 0 : warp / kConsumerWarps; }
  __device__ __forceinline__ static int block_of(int warp) {
    return kBS == 1 ? 0 : RPW == 64 ? warp % 2 : (warp / kRT) % kBS;
  }
  __device__ __forceinline__ static int tile_of(int warp) { return RPW == 64 ? warp / 2 : warp % kRT; }
};

// The wgmma kernel's split-K and epilogue go through shared memory. A lane's accumulators
// are scattered over the tile (d[i] of m16 block b of warp w: row 32w + 16b + g + 8((i>>1)&1),
// token 8(i>>2) + 2t + (i&1)), and storing them where they lie (what reduce_splits does for
// the W4A16 kernel, with a handful per lane) cost the wgmma kernel one
// dependent global load/store chain per accumulator: 128 round trips per thread, a fixed
// 20-29 us per wave of CTAs (benchmarks/notes-gemm.md, version 6; now 4.7 us). Staged as a [128 tokens] x
// [rows] INT32 tile, each thread owns instead 32 chunks of 4 consecutive rows of one token
// (tokens 4 apart): partial sums move as coalesced 16-byte loads and stores, 16 in flight
// at once, and the scales are read before anything is stored.
template <class S>  // a WgmmaShape
struct WgmmaStaging {
  static constexpr int kRows = S::kRT * 32;              // rows of the CTA's tile
  static constexpr int kPitch = kRows + 4;               // words per token: +4 puts a warp's 32 staging stores on 32 banks
  static constexpr int kChunks = kRows / 4;              // 16-byte chunks per token
  static constexpr int kTokenStep = S::kThreads / kChunks;  // = 4 (K2: 16; 64-row warpgroups: 8) tokens per pass of the CTA's threads
  static constexpr int kPasses = S::kBN / kTokenStep;    // = 32 (8; BN = 64: 4; 64-row warpgroups: 16) chunks per thread
  static constexpr int kBytes = S::kBN * kPitch * 4;
  static_assert(S::kThreads % kChunks == 0, "every pass covers whole tokens");
};

template <Kind K, int WGS, int KS = 1, bool BIASED = false, int BN = 128, int RPW = 128>
__device__ __forceinline__ void wgmma_epilogue(const Params& p, const int (&acc)[WgmmaShape<K, WGS, KS, BN, RPW>::kBlocks][BN / 2],
                                               int* tile, int m0, int nt0) {
  using S = WgmmaShape<K, WGS, KS, BN, RPW>;
  using T = WgmmaStaging<S>;
  constexpr int kBlocks = S::kBlocks;
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp, g = lane / 4, t = lane % 4;
  // KS = 2: which K half; the warp's first m16 block (both when kBlocks = 2) and its row tile.
  const int kq = S::half_of(warp), blk0 = S::block_of(warp), rw = S::tile_of(warp);
  auto at = [&](int b, int i) { return (8 * (i >> 2) + 2 * t + (i & 1)) * T::kPitch + 32 * rw + 16 * (blk0 + b) + g + 8 * ((i >> 1) & 1); };
  if (kq == KS - 1) {  // KS = 2: the second half's sums first, then the first half adds its own
#pragma unroll
    for (int b = 0; b < kBlocks; ++b)
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) tile[at(b, i)] = acc[b][i];
  }
  __syncthreads();
  if constexpr (KS == 2) {
    if (kq == 0) {
#pragma unroll
      for (int b = 0; b < kBlocks; ++b)
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) tile[at(b, i)] += acc[b][i];  // exact: INT32
    }
    __syncthreads();
  }

  const int c = tid % T::kChunks, first = tid / T::kChunks;  // rows n0..n0+3 of tokens m0 + first + 4j
  const int n0 = nt0 * 32 + 4 * c;
  auto token = [&](int j) { return m0 + first + T::kTokenStep * j; };
  auto staged_at = [&](int j) { return (first + T::kTokenStep * j) * T::kPitch + 4 * c; };  // in words
  auto staged = [&](int j) { return *reinterpret_cast<const int4*>(tile + staged_at(j)); };
  const size_t ld = static_cast<size_t>(p.NT) * 32, slice = static_cast<size_t>(p.M) * ld;  // workspace [split][M][NT*32]
  const bool rows_in = n0 < static_cast<int>(ld);  // false past the last row tile (grid rounding)
  // Two splits launched as a cluster of two CTAs (launch_wgmma): each stays resident until
  // both are done, so the partials never leave the chip. Both tiles staged, each CTA reads
  // the other's half of the tokens (passes) through distributed shared memory, adds it to its
  // own and writes those outputs: no round trip of 64 KB of partials through L2, no counter,
  // and half the epilogue per CTA. The second barrier keeps each tile alive until the other
  // CTA has read it (its arrive right after the reads, its wait after the stores).
  const bool paired = cluster_size() == 2;
  if (paired) {
    cluster_sync();
  } else if (p.splits > 1) {  // as reduce_splits, in whole chunks
    int32_t* mine = p.workspace + blockIdx.z * slice + n0;
#pragma unroll 4
    for (int j = 0; j < T::kPasses; ++j)
      if (rows_in && token(j) < p.M) *reinterpret_cast<int4*>(mine + token(j) * ld) = staged(j);
    if (!arrive_last_split(p)) return;
  }
  if (n0 >= p.N) {
    if (paired) cluster_sync();
    return;
  }

  // Whole chunks (N % 4 == 0, so n0 < N means all four rows are in) go out as one vector store.
  const bool whole = p.N % 4 == 0 && (reinterpret_cast<uintptr_t>(p.out) & 15) == 0;
  // The zero term acc - zero * rowsum(x): per channel the rows' zero points; BIASED, 128 (the
  // kernel multiplied UINT8 weights + 128: progressive_quad).
  float sw[4];
  int zero[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const bool in = n0 + r < p.N;
    sw[r] = in ? __half2float(p.scale[n0 + r]) : 0.f;
    zero[r] = K == Kind::kUInt4Channel && in ? static_cast<int>(p.zero[n0 + r]) : (BIASED ? 128 : 0);
  }
  // Blocks of kBlock of a thread's chunks (16; the K2 form, 128 registers a thread: 8, or all
  // 4 with 64 tokens): the other splits' partials (kBlock loads in flight per split) and the
  // tokens' scales are all read before the block's stores. Paired, the thread's passes
  // [rank * kPasses / 2, ...) only, in blocks of at most that many.
  constexpr int kBlock = KS == 2 ? (T::kPasses < 8 ? T::kPasses : 8) : 16;
  static_assert(T::kPasses % kBlock == 0 && T::kPasses % 2 == 0, "whole blocks of tokens");
  // `checked` false: fp16 out, whole chunks and every token of the tile inside M (the
  // CTA-uniform common case), so the passes carry no bounds test, no branch on the output's
  // kind and no 64-bit address arithmetic beyond one add; each pair of outputs is converted
  // by one F2FP (__floats2half2_rn rounds as __float2half_rn does). In the SASS the per-block
  // code of the other form had a compare and a branch for nearly every store and one F2FP per
  // output (benchmarks/notes-gemm.md, version 25), and with 256 threads for 32768 outputs
  // (the one-pipeline forms) that chain is the 4.6 us of their final epilogue.
  auto emit = [&](auto checked, auto pair) {
    constexpr bool kChecked = decltype(checked)::value, kPaired = decltype(pair)::value;
    constexpr int kB = kPaired && T::kPasses / 2 < kBlock ? T::kPasses / 2 : kBlock;  // passes per block
    const int jb = kPaired ? static_cast<int>(cluster_rank()) * (T::kPasses / 2) : 0;
#pragma unroll 1
    for (int j0 = jb; j0 < jb + (kPaired ? T::kPasses / 2 : T::kPasses); j0 += kB) {
      int4 v[kB];
#pragma unroll
      for (int j = 0; j < kB; ++j) v[j] = staged(j0 + j);
      if constexpr (kPaired) {
        const uint32_t other = cluster_rank() ^ 1;
        int4 w[kB];
#pragma unroll
        for (int j = 0; j < kB; ++j) w[j] = ld_shared_remote_v4(smem_u32(tile + staged_at(j0 + j)), other);
#pragma unroll
        for (int j = 0; j < kB; ++j) add4(v[j], w[j]);
        // The last of this thread's reads of the other tile is done: the other CTA may leave
        // once all of ours are (cluster_wait after the stores).
        if (j0 + kB == jb + T::kPasses / 2) cluster_arrive();
      }
#pragma unroll 1
      for (int z = 0; z < (kPaired ? 0 : p.splits); ++z) {
        if (z == static_cast<int>(blockIdx.z)) continue;
        const int32_t* theirs = p.workspace + z * slice + n0;
        int4 w[kB];
#pragma unroll
        for (int j = 0; j < kB; ++j) {
          const int m = token(j0 + j);
          w[j] = !kChecked || m < p.M ? __ldcg(reinterpret_cast<const int4*>(theirs + m * ld)) : make_int4(0, 0, 0, 0);  // L2: L1 is not coherent
        }
#pragma unroll
        for (int j = 0; j < kB; ++j) add4(v[j], w[j]);
      }
      float sx[kB];
      int rowsum[kB];
#pragma unroll
      for (int j = 0; j < kB; ++j) {
        const int m = token(j0 + j);
        const bool in = !kChecked || m < p.M;
        sx[j] = in ? __half2float(p.x_scale[m]) : 0.f;
        rowsum[j] = (K == Kind::kUInt4Channel || BIASED) && in ? p.x_rowsum[m] : 0;
      }
      if constexpr (!kChecked) {
        // Row n0 of token(j0): consecutive passes are kTokenStep output rows apart.
        __half* out = static_cast<__half*>(p.out) + static_cast<size_t>(token(j0)) * p.N + n0;
        const int step = T::kTokenStep * p.N;  // < 2^31: M * N fits the int32 of tile offsets
#pragma unroll
        for (int j = 0; j < kB; ++j) {
          int a[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
          float y[4];
#pragma unroll
          for (int r = 0; r < 4; ++r) y[r] = dense_value<K>(a[r] - zero[r] * rowsum[j], sx[j], sw[r]);  // (zero 0 for the other kinds)
          const __half2 lo = __floats2half2_rn(y[0], y[1]), hi = __floats2half2_rn(y[2], y[3]);
          *reinterpret_cast<uint2*>(out + j * step) = make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
        }
      } else {
#pragma unroll
        for (int j = 0; j < kB; ++j) {
          const int m = token(j0 + j);
          if (m >= p.M) continue;
          int a[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
          for (int r = 0; r < 4; ++r) a[r] -= zero[r] * rowsum[j];  // (0 for the other kinds)
          const size_t at = static_cast<size_t>(m) * p.N + n0;
          if (p.out_i32) {
            store_row4(static_cast<int32_t*>(p.out) + at, a, n0, p.N, whole);
            continue;
          }
          __half y[4];
#pragma unroll
          for (int r = 0; r < 4; ++r) y[r] = __float2half_rn(dense_value<K>(a[r], sx[j], sw[r]));
          store_row4(static_cast<__half*>(p.out) + at, y, n0, p.N, whole);
        }
      }
    }
  };
  const bool fast = !p.out_i32 && whole && m0 + BN <= p.M;
  if (paired) {
    if (fast) emit(std::false_type{}, std::true_type{});
    else emit(std::true_type{}, std::true_type{});
    cluster_wait();
  } else {
    if (fast) emit(std::false_type{}, std::false_type{});
    else emit(std::true_type{}, std::false_type{});
  }
}

// BIASED (progressive, launched when the tokens' row sums are given): the weights go to the
// tensor cores as UINT8 (q - z) s1 + 128, one instruction fewer per four weights
// (progressive_quad), and the epilogue subtracts 128 * rowsum(x) (H200, benchmarks/library_ab.py:
// per group 1.04x at M = 256, 1.05x at M = 1024). A kernel of its own rather than a branch in the
// stage loop: with four stage variants in one kernel, ptxas serialized the wgmmas for want of
// registers (its C7511 note).
template <Kind K, int WGS, int KS = 1, bool BIASED = false, int BN = 128, int RPW = 128>
__global__ void __launch_bounds__(WgmmaShape<K, WGS, KS, BN, RPW>::kThreads, 1) wgmma_kernel(const Params p, const __grid_constant__ TmaMaps maps) {
#if QOQ_HAS_WGMMA
  static_assert(!BIASED || K == Kind::kProgressive, "only progressive weights are biased");
  using S = WgmmaShape<K, WGS, KS, BN, RPW>;
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
  // This warp's pipeline (KS = 2: half q takes the split's stages q, q + KS, ...; its slots
  // are q * kRing .. + kRing - 1), the thread that issues its copies (the first of its warps),
  // and its stages; kBS = 2: the m16 block it multiplies (WgmmaShape::half_of, block_of, tile_of).
  const int kq = S::half_of(warp), blk = S::block_of(warp);
  const int lead = kq * S::kConsumerWarps * kWarp, mine = KS == 1 ? n_stages : (n_stages - kq + KS - 1) / KS;
  auto slot = [&](int j) { return kq * S::kRing + j % S::kRing; };
  // Stage j's slot: its bytes, and its barriers (full: the stage has landed; empty: every warp
  // of the pipeline is done with it).
  auto stage_smem = [&](int j) { return smem + slot(j) * S::kStage; };
  auto full_bar = [&](int j) { return full + 8 * slot(j); };
  auto empty_bar = [&](int j) { return empty + 8 * slot(j); };
  const int gps = p.groups_per_stage;
  const uint32_t param_box = S::kRT * gps * 32;  // bytes of one parameter box
  // The z * s1 box sits half the parameter space after the s1 box: TMA writes only to 128-byte
  // aligned shared memory, and one box of kRT row tiles x 32 bytes (g128 and coarser: one group
  // a stage) is 192 bytes with the 6 row tiles of 64-row warpgroups.
  constexpr uint32_t kZs1At = S::kPBytes / 2;
  static_assert(kZs1At % 128 == 0, "the z * s1 box starts 128-byte aligned");
  const uint32_t tx_bytes = S::kXBytes + S::kWBytes + (K == Kind::kProgressive ? 2 * param_box : 0);

  pdl_launch_dependents();  // the next kernel may start; it waits for us before it reads our output
  if (tid == 0) {
    for (int i = 0; i < S::kStages; ++i) {
      mbar_init(full + 8 * i, 1);                       // the issuing thread's arrive.expect_tx
      mbar_init(empty + 8 * i, S::kConsumerWarps);      // one arrival per warp that reads the stage
    }
    mbar_fence_init();
  }
  __syncthreads();

  // The pipeline's lead thread issues all copies of its j-th stage: the static ones (weights
  // and group parameters, which no earlier kernel writes) with the stage's whole byte count,
  // and the activations, which it may only read after pdl_wait. The stage's `full` barrier
  // completes when both have landed, in either order.
  auto stage_k = [&](int j) { return kt_begin + (kq + KS * j) * S::kKT; };
  auto issue_static = [&](int j) {
    const int kt0 = stage_k(j);
    const uint32_t base = stage_smem(j), bar = full_bar(j);
    mbar_arrive_expect_tx(bar, tx_bytes);
    tma_load_3d(base + S::kXBytes, &maps.w, 0, kt0, nt0, bar);
    if constexpr (K == Kind::kProgressive) {
      const int grp0 = kt0 >> p.group_shift;
      tma_load_3d(base + S::kXBytes + S::kWBytes, &maps.s1, 0, grp0, nt0, bar);
      tma_load_3d(base + S::kXBytes + S::kWBytes + kZs1At, &maps.zs1, 0, grp0, nt0, bar);
    }
  };
  auto issue_x = [&](int j) { tma_load_2d(stage_smem(j), &maps.x, stage_k(j) * 32, m0, full_bar(j)); };
  auto issue = [&](int j) {
    issue_static(j);
    issue_x(j);
  };
  // Before pdl_wait, while the previous kernel may still run (its last CTAs, or a quantize
  // kernel): the first stage's weights, so that after the wait that stage waits only for its
  // activations (from L2). Only the first: with every stage of the initial fill sent early,
  // the first activations queued behind them (H200, benchmarks/library_ab.py, one process:
  // 0.96-0.99x; the first stage alone 1.03x at M = 64, 1.02x at M = 256, 1.01x at M = 1024,
  // the first two 1.00-1.01x; prefetch.tensormap of the maps added nothing).
  // Refills (kRefillAfter: the K2 forms) wait, after the lead warp has released stage j, until
  // every warp of the pipeline is done with it and refill its slot with stage j + kRing;
  // otherwise the lead refills, before it dequantizes stage j, the slot of stage j - 2 (the last
  // one released: see the loop below) with stage j + kRing - 2. With four slots per half the K2
  // form gains a stage of lookahead that way (H200, benchmarks/library_ab.py, one process:
  // 1.01-1.06x at M = 256, 1.05x at M = 1024 on 14336 x 4096), while the forms with one
  // pipeline per CTA (six slots) lose 2-4% to the lead warp waiting for the slowest one.
  constexpr bool kRefillAfter = KS == 2;
  constexpr int kAhead = kRefillAfter ? S::kRing : S::kRing - 2;  // how far ahead a refill goes
  static_assert(kAhead >= 1, "a refill goes at least one stage ahead");
  const int filled = min(kAhead, mine);
  // The lead thread's refill at stage j: stage j + kAhead, into the slot of stage j + kAhead -
  // kRing (j - 2, or kRefillAfter j itself) once every warp of the pipeline has released it.
  auto refill = [&](int j) {
    const int ahead = j + kAhead;
    if (tid == lead && ahead < mine) {
      if (ahead >= S::kRing) mbar_wait(empty_bar(ahead), (ahead / S::kRing - 1) & 1);
      issue(ahead);
    }
  };
  if (tid == lead && filled > 0) issue_static(0);
  pdl_wait();  // the previous kernel (which may write our activations) has finished

  int acc[S::kBlocks][BN / 2];  // [m16 block of the row tile (K2: this warpgroup's)][wgmma fragment]
#pragma unroll
  for (int b = 0; b < S::kBlocks; ++b)
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[b][i] = 0;

  if (tid == lead)
    for (int j = 0; j < filled; ++j) {
      if (j == 0) issue_x(0);  // its weights went out before the wait
      else issue(j);
    }
  const int rt = S::tile_of(warp);  // this warp's row tile in the CTA

  // The main loop keeps two stages' A operands in registers (buffers a0, a1): stage j's wgmmas
  // run on the tensor cores while the warpgroup loads and dequantizes stage j + 1 into the
  // other buffer; after stage j + 1's commit, `wait_group 1` retires stage j, whose slot is
  // released and whose buffer takes stage j + 2. With one buffer (until version 30) every stage
  // waited for its own wgmmas before the next could be dequantized, and version 25's probes put
  // the cost of that sequence at up to ~1.25x. Measured (H100, benchmarks/library_ab.py, forced
  // forms, five shapes, M = 64-1024): 1.16-1.22x on the 64-row warpgroups, 1.34-1.47x on one
  // 128-row warpgroup, 1.04-1.08x on two, 1.02-1.09x on the K2 forms (notes-gemm.md, version 30).
  //
  // The hazard: a wgmma reads its A registers asynchronously until a wait retires it, but
  // ptxas models it as reading them at issue, so after the issue it may give those registers
  // to other values (version 23 found exactly that). keep_alive() reads the retired buffer
  // after the wait with a real instruction - a shared-memory store under a predicate that is
  // false at run time (M < 0) - so ptxas keeps the registers allocated to it until then; an
  // empty asm with register operands does not reach ptxas (version 5). kernels/check_sass.py
  // verifies the result in the SASS (in CI too).
  using ARegs = uint32_t[S::kKT][S::kBlocks][4];  // one stage's A operands: [k-tile][m16 block][fragment]
  auto keep_alive = [&](const ARegs& a) {
#pragma unroll
    for (int kk = 0; kk < S::kKT; ++kk)
#pragma unroll
      for (int b = 0; b < S::kBlocks; ++b)
        asm volatile("{\n.reg .pred q;\nsetp.lt.s32 q, %4, 0;\n@q st.shared.v4.b32 [%5], {%0, %1, %2, %3};\n}\n" ::"r"(a[kk][b][0]),
                     "r"(a[kk][b][1]), "r"(a[kk][b][2]), "r"(a[kk][b][3]), "r"(p.M), "r"(smem)
                     : "memory");
  };
  // Stage j's A operands: all of its fragments first (their shared-memory latencies overlap),
  // then their conversion. No k-tile is skipped in the last, partial stage: TMA filled the
  // k-tiles past K with zeros (weights, group parameters and activations alike), and they add
  // zero. The warpgroup's m16 blocks only (kBlocks from blk: both, or in the K2 form and the
  // 64-row warpgroups its one block - half of each lane's bytes, and of each parameter word's).
  // one_group (progressive, groups of >= 4 k-tiles, so the stage lies in one group): the
  // group's parameter words are read once for the four k-tiles, not per k-tile (H200,
  // benchmarks/library_ab.py: per group 1.03x at M = 256, 1.07x at M = 1024).
  auto dequantize = [&](int j, ARegs& a, auto one_group) {
    constexpr bool kOneGroup = decltype(one_group)::value;
    const uint32_t base = stage_smem(j);
    const uint32_t params = base + S::kXBytes + S::kWBytes + rt * gps * 32 + 4 * g;  // progressive: group 0 of the stage
    Fragment<K, S::kBlocks> f[S::kKT];
    uint32_t s1_word = 0, zs1_word = 0;
    if constexpr (kOneGroup) {
      s1_word = lds_u32(params);
      zs1_word = lds_u32(params + kZs1At);
    }
#pragma unroll
    for (int kk = 0; kk < S::kKT; ++kk) {
      f[kk].load(base + S::kXBytes + ((rt * S::kKT + kk) * 32 + lane) * kBytes, blk);
      if constexpr (K == Kind::kProgressive) {
        // Stages start on multiples of 4 k-tiles, so k-tile kk is in group kk >> group_shift of the stage.
        f[kk].s1 = kOneGroup ? s1_word : lds_u32(params + (kk >> p.group_shift) * 32);
        f[kk].zs1 = kOneGroup ? zs1_word : lds_u32(params + (kk >> p.group_shift) * 32 + kZs1At);
      }
    }
#pragma unroll
    for (int kk = 0; kk < S::kKT; ++kk) f[kk].template to_a<BIASED>(a[kk], blk);
  };
  // Stage j's wgmmas (one per k-tile and m64 block) as one commit group.
  auto multiply = [&](int j, const ARegs& a) {
    const uint32_t base = stage_smem(j);
    wgmma_fence();  // a[] was written by ordinary instructions
#pragma unroll
    for (int kk = 0; kk < S::kKT; ++kk) {
      const uint64_t desc = wgmma_desc_k128b(base + kk * 32);  // k-tile kk: bytes 32 kk.. of each row
#pragma unroll
      for (int b = 0; b < S::kBlocks; ++b) wgmma_m64nNk32_rs<BIASED, BN>(acc[b], a[kk][b], desc);
    }
    wgmma_commit();
  };
  auto ready = [&](int j) {  // stage j has landed in its slot
    mbar_wait(full_bar(j), (j / S::kRing) & 1);
    __syncwarp();  // wgmma is .aligned: the whole warp must arrive together
  };
  auto release = [&](int j) {  // this warp is done with stage j's slot
    if (lane == 0) mbar_arrive(empty_bar(j));
    if (kRefillAfter) refill(j);
  };
  // Unrolled by two so that each buffer is its own registers. Every exit leaves from a branch
  // that waited for all groups: ptxas's analysis follows paths, not the loop's arithmetic (with
  // the exit test after `wait_group 1` it injected a wait and serialized the wgmmas, C7514).
  auto main_loop = [&](auto one_group) {
    ARegs a0, a1;
    // Stage j is in flight from `cur`: issue stage j + 1 from `next`, then retire stage j.
    // False when stage j was this warp's last (all groups retired).
    auto step = [&](int j, ARegs& cur, ARegs& next) -> bool {
      if (j + 1 >= mine) {
        wgmma_wait<0>();
        release(j);
        return false;
      }
      if (!kRefillAfter) refill(j + 1);
      ready(j + 1);
      dequantize(j + 1, next, one_group);
      multiply(j + 1, next);
      wgmma_wait<1>();  // stage j retired
      keep_alive(cur);
      release(j);
      return true;
    };
    if (!kRefillAfter) refill(0);
    ready(0);
    dequantize(0, a0, one_group);
    multiply(0, a0);
    for (int j = 0;; j += 2) {
      if (!step(j, a0, a1)) break;
      if (!step(j + 1, a1, a0)) break;
    }
  };
  // One copy of the loop per parameter form, the branch outside it: with the wgmmas issued
  // after a join of two forms, ptxas merged their A registers past the fence and injected a
  // warpgroup.arrive before most wgmmas (its C7519 notes).
  if (mine > 0) {
    if (K == Kind::kProgressive && gps == 1) main_loop(std::true_type{});
    else main_loop(std::false_type{});
  }
  __syncthreads();  // every warp is done with the pipeline's slots: they become the staging tile
  static_assert(S::kStages * S::kStage >= WgmmaStaging<S>::kBytes, "the staging tile must fit in the pipeline's slots");
  wgmma_epilogue<K, WGS, KS, BIASED, BN, RPW>(p, acc, reinterpret_cast<int*>(smem_raw + (smem - smem_u32(smem_raw))), m0, nt0);
#endif  // QOQ_HAS_WGMMA
}
}  // namespace qoq::gemm
