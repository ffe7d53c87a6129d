// stream_kernel (mma.sync, decode-sized M) and its fused Tile-COO outlier path; see the
// overview in gemm_kernels.cuh.
#pragma once

#include "gemm_common.cuh"

namespace qoq::gemm {

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
//  * the chunk's entries (its buckets' runs one after the other) are copied into a per-warp
//    buffer in shared memory (cp.async) right after the chunk's activations; the (start,
//    count) lookups they need go out a chunk earlier (the first chunk's at entry). The dense
//    mma waits for the activations only, and the next chunk's weights go out between the
//    dense mma and the outlier work, whose time their DRAM round trip then overlaps
//    (H200: 1.07x at M = 8, 1.04x at M = 16 for these two, 1% uniform outliers);
//  * after the dense mma, the entries are multiplied in groups of 32, COMPACTED in k: entry f
//    of a group is column f of a per-warp fp16 A tile [32 rows x 32], holding its four values
//    at their rows (scatter_entry; every other element stays zero), and the B operand's row f
//    is the activation column that entry belongs to, gathered per lane (x_pair) from the
//    staged chunk in shared memory or from L1. One entry, four outliers of one column, so a
//    group of <= 16 entries is one k16 step: 2 NB mma.m16n8k16 (fp16 x fp16 -> fp32) for
//    what the first version multiplied as whole 32 x 64 bucket tiles (8 NB mma per bucket, and
//    at 1% nearly every bucket is non-empty). The cost now follows the entries, not the area;
//  * the fp32 sums land in registers laid out like the INT32 accumulators (the two mma's C
//    fragments agree), travel through the k-slice reduction and split-K beside them, and the
//    epilogue applies sx once: y = sx * (sw * acc + sparse) (stream_epilogue);
//  * the lanes write zeros back where they scattered, so the tile is zero for the next group.
// Per group and warp: one 16-byte entry read and 4 + 4 predicated 2-byte stores per lane
// (1.09x / 1.07x at M = 8 / 16 against the same stores under branches), 2 ldmatrix,
// 4 shuffles, 4 NB activation gathers and 2 NB conversions, 2 NB mma per k16 step - no
// atomics (the first version's shared-memory fp32 atomics, one per outlier and token, made
// the kernel 3-6x slower than the dense one at 1%). Measured and not kept: double-buffered
// entries, the next chunk's sent with its weights (0.97x at M = 8 and 0.90x at M = 16
// against the single buffer; at NB = 2 it spilled 68-248 bytes).

// The compact A tile of one warp: [32 rows][32 entries] fp16, 64-byte rows; after it the
// warp's entry buffer (kEntryGroups x 32 entries of 16 bytes).
constexpr int kCompactTileBytes = kBucketN * kWarp * 2;  // 2 KB
constexpr int kEntryGroups = 3;
constexpr int kOutlierWarpBytes = kCompactTileBytes + kEntryGroups * kWarp * 16;  // 3.5 KB
static_assert(kOutlierWarpBytes % 64 == 0, "each warp's compact tile is 64-byte aligned (ChunkOutliers::add's ldmatrix addresses)");

// k-tiles [aligned_split_begin(z), aligned_split_begin(z + 1)) of split z of a stream-style
// kernel: whole units of `align` k-tiles (a split never cuts a Tile-COO bucket, 2 k-tiles, or a
// progressive group fold); a split may be empty when splits > ceil(KT / align).
__device__ __forceinline__ int aligned_split_begin(int KT, int align, int z, int splits) {
  return min(KT, align * split_begin(ceil_div(KT, align), z, splits));
}

// Byte offset of (row, k) in the compact tile: the four 16-byte pieces of a row XOR-swizzled
// by row / 2, so that ldmatrix's eight row reads of one piece column (rows 8i .. 8i + 7, two
// rows per 128-byte line) hit eight different 16-byte bank groups.
__device__ __forceinline__ uint32_t compact_offset(int row, int k) {
  return row * 64 + ((((k >> 3) ^ (row >> 1)) & 3) << 4) + (k & 7) * 2;
}

// Zeroes `bytes` (a multiple of 16) of shared memory from addr, the lanes of a warp side by side.
__device__ __forceinline__ void zero_shared(uint32_t addr, int bytes, int lane) {
  for (int i = lane; i < bytes / 16; i += kWarp) asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr + 16 * i), "r"(0));
}

// A 16-bit shared-memory store under a predicate (no branch around it).
__device__ __forceinline__ void st_shared_u16_if(uint32_t addr, uint32_t bits, uint32_t pred) {
  asm volatile(
      "{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q st.shared.u16 [%0], %1;\n}\n" ::"r"(addr),
      "h"(static_cast<unsigned short>(bits)), "r"(pred));
}

// Where the four slots of one entry go in column k of the compact tile (bytes 8..11: their
// rows; the mask keeps them in the tile). Computed once per group: the same addresses take the
// values, then the zeros that clean up. All four rows at once, one per byte: compact_offset is
// 16 * (4 row + x) + 2 (k & 7) with x = ((k >> 3) ^ (row >> 1)) & 3, and 4 row + x < 128 fits
// its byte, so a shift, a LOP3 and a multiply-add give the four 16-byte piece indices, and each
// address is then one byte extract and one shift-add (12 instructions; compact_offset per slot
// compiled to ~35).
__device__ __forceinline__ void entry_slots(uint32_t tile, const uint4& e, int k, uint32_t (&addr)[4]) {
  const uint32_t rows = e.z & 0x1f1f1f1fu;                                   // kBucketN = 32 rows
  const uint32_t x = ((rows >> 1) ^ (((k >> 3) & 3) * 0x01010101u)) & 0x03030303u;  // bits 1, 2 of each row byte
  const uint32_t piece = rows * 4 + x;                                       // no carries: each byte < 128
  const uint32_t base = tile + (k & 7) * 2;
#pragma unroll
  for (int s = 0; s < 4; ++s) addr[s] = base + (__byte_perm(piece, 0, 0x4440 | s) << 4);
}
// Writes the real slots of one entry (byte 13: which slots hold outliers) at their addresses,
// their fp16 values (bytes 0..7) or zeros. The four rows of an entry differ, so the stores
// never collide. Predicated stores: as `if`s, each store sat in its own branch (nvdisasm),
// ~110 instructions per group for the values and the zeros.
__device__ __forceinline__ void scatter_entry(const uint32_t (&addr)[4], const uint4& e, bool zero) {
  const uint32_t real = e.w >> 8;
#pragma unroll
  for (int s = 0; s < 4; ++s)
    st_shared_u16_if(addr[s], zero ? 0u : (s < 2 ? e.x : e.y) >> (16 * (s & 1)), real & (1u << s));
}

// Two INT8 activations a, b (bytes, as loaded) as one fp16x2 register, exactly: biased to
// x + 128 and placed under the exponent of 1024 (0x64XX = 1024 + byte), then 1152 subtracted.
// Three instructions: a byte-wise load leaves bytes 1..3 of its register zero, so one PRMT
// spreads a and b to bytes 0 and 2 with zeros between, and one XOR both biases them and sets
// the exponent bytes (the version with a second PRMT for the exponents also cost a move of
// its selector per call in the compiled code).
__device__ __forceinline__ uint32_t s8x2_to_f16x2(uint8_t a, uint8_t b) {
  uint32_t v = __byte_perm(static_cast<uint32_t>(a), static_cast<uint32_t>(b), 0x1410) ^ 0x64806480u;  // [a, 0, b, 0] -> [a^0x80, 0x64, b^0x80, 0x64]
  const __half2 offset = __halves2half2(__ushort_as_half(0x6480), __ushort_as_half(0x6480));  // 1152
  const __half2 h = __hsub2(*reinterpret_cast<__half2*>(&v), offset);
  return *reinterpret_cast<const uint32_t*>(&h);
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

// One chunk's outliers: CB buckets, entries dealt one per lane, multiplied in compact groups
// of 32. The first kEntryGroups groups are copied into the warp's entry buffer with cp.async
// when the chunk's weights are loaded (load), so that every group finds its entries there:
// the uniform 1% benchmark pattern (mostly one outlier per entry) gives a chunk of 8 k-tiles
// ~80 entries, and with one group prefetched in registers the others were each loaded, then
// waited for, inside the chunk. Past kEntryGroups (outliers above ~3.5%, one per entry), add
// copies the next kEntryGroups groups into the buffer the same way.
template <int NB, int CB>
struct ChunkOutliers {
  int base[CB], end[CB], total;  // entry f of the chunk list = entry base[b] + f of bucket b's run

  __device__ __forceinline__ void load(const Params& p, int2 lookup, uint32_t entries, int lane) {
    total = 0;
#pragma unroll
    for (int b = 0; b < CB; ++b) {
      base[b] = __shfl_sync(0xffffffffu, lookup.x, b) - total;
      total += __shfl_sync(0xffffffffu, lookup.y, b);
      end[b] = total;
    }
    copy_entries(p, entries, 0, lane);
  }
  // Entries f0 .. f0 + kEntryGroups * 32 - 1 of the chunk (those that exist) into the entry
  // buffer, by cp.async as one commit group.
  __device__ __forceinline__ void copy_entries(const Params& p, uint32_t entries, int f0, int lane) const {
#pragma unroll
    for (int j = 0; j < kEntryGroups; ++j) {
      const int f = f0 + lane + kWarp * j;
      if (f < total) cp_async_16(entries + 16 * (f - f0), p.tc_entries + at(f), true);
    }
    cp_async_commit();
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

  // x_pair(nb, c0, c1): the fp16x2 B register {x[token 8 nb + g, c0], x[token 8 nb + g, c1]}
  // for chunk-relative columns c0, c1 (0 .. 32 U - 1); sparse: the fp32 sums.
  template <class XPair>
  __device__ __forceinline__ void add(const Params& p, uint32_t tile, uint32_t entries, XPair&& x_pair,
                                      float (&sparse)[2][NB][4], int lane) {
    if (total == 0) return;  // warp-uniform
    cp_async_wait_all();     // this lane's entry copies (and any earlier ones) have landed
    __syncwarp();            // ... and every other lane's
    // This lane's ldmatrix row address for k16 step 0, block 0 (lane l: row l % 16, k 8 (l / 16)).
    // Block 1 is 16 rows = 1024 bytes further, and step 1 (k + 16) flips bit 1 of the 16-byte
    // piece index, i.e. bit 5 of the address (row / 2 adds 8 blk, a multiple of 4, to the
    // swizzle, and the tile is 64-byte aligned): lane constants, not recomputed per group.
    const uint32_t ldm = tile + compact_offset(lane & 15, 8 * (lane >> 4));
    constexpr int kBuffered = kEntryGroups * kWarp;
    for (int f0 = 0; f0 < total; f0 += kWarp) {
      // Past the buffer (more than kEntryGroups groups in the chunk) its next kEntryGroups
      // groups are copied in the same way; an entry is never loaded from global memory into a
      // register here. Such a load shared its SASS scoreboard with the next chunk's weight
      // loads, in flight at this point (the kernel's global loads all count on one), so the
      // first group of every chunk waited for those weights to come from DRAM, not only for
      // its entry from shared memory (nvdisasm: the entry's first use waited on both
      // scoreboards; ncu: a tenth of the fused kernel's stall samples on that instruction).
      // Without: 1.055x at M = 8, 1.039x at M = 16 (H200, 1% uniform, six shapes).
      if (f0 % kBuffered == 0 && f0 > 0) {
        __syncwarp();  // every lane has read its entry of the buffer's last group
        copy_entries(p, entries, f0, lane);
        cp_async_wait_all();
        __syncwarp();
      }
      const int f = f0 + lane;
      uint4 e = make_uint4(0, 0, 0, 0);  // no real slot
      if (f < total) e = lds_v4(entries + 16 * (f % kBuffered));
      group(tile, ldm, e, f0, x_pair, sparse, lane);
    }
  }

  // Entries f0 .. f0 + 31 (this lane's: e, entry f0 + lane; an all-zero e has no real slot).
  template <class XPair>
  __device__ __forceinline__ void group(uint32_t tile, uint32_t ldm, const uint4& e, int f0, XPair&& x_pair,
                                        float (&sparse)[2][NB][4], int lane) {
    // This entry's chunk-relative column (byte 12: the bucket-local one); a lane without an
    // entry gathers column 0 of the chunk, which exists (a k-tile past the split does not).
    const int col = f0 + lane < total ? bucket(f0 + lane) * kBucketK + static_cast<int>(e.w & (kBucketK - 1)) : 0;
    uint32_t slots[4];
    entry_slots(tile, e, lane, slots);
    __syncwarp();  // the previous group's clean-up (and reads) are done before new values land
    scatter_entry(slots, e, false);
    __syncwarp();
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      if (s == 1 && total - f0 <= 16) break;  // a group of <= 16 entries is one k16 step (warp-uniform)
      uint32_t a[2][4];
#pragma unroll
      for (int blk = 0; blk < 2; ++blk)  // lane l gives row 16blk + l%16 at k 16s + 8(l/16)
        ldmatrix_x4(a[blk], (s == 0 ? ldm : ldm ^ 32u) + 1024 * blk);
      // mma.m16n8k16's B registers: k 2t, 2t + 1 (b0) and 2t + 8, 2t + 9 (b1) of this step,
      // i.e. the columns of entries 16s + 2t + {0, 1, 8, 9}.
      const int k = 16 * s + 2 * (lane & 3);
      const int c0 = __shfl_sync(0xffffffffu, col, k), c1 = __shfl_sync(0xffffffffu, col, k + 1);
      const int c2 = __shfl_sync(0xffffffffu, col, k + 8), c3 = __shfl_sync(0xffffffffu, col, k + 9);
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        const uint32_t lo = x_pair(nb, c0, c1), hi = x_pair(nb, c2, c3);
#pragma unroll
        for (int blk = 0; blk < 2; ++blk) mma_f16_16816(sparse[blk][nb], a[blk], lo, hi);
      }
    }
    __syncwarp();  // every lane has read the tile before any lane clears its column
    scatter_entry(slots, e, true);
  }
};

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

// The stream kernel's epilogue, through shared memory like wgmma_epilogue. Stored where they
// lie in the registers (as the W4A16 kernel still does through reduce_splits), the last split
// of a tile read the other splits' partials one split after another, each a round trip to
// L2: at 4 splits the slowest CTAs spent 3.2-3.7 us from the k-slice reduction to the end of
// split-K, 1.5 us once staged (benchmarks/gemm_timeline.py, 4096^2, M = 1 and 16), and the
// next kernel waits for the slowest. Staged as a [8 NB tokens] x [RT * 32 rows] tile, each
// thread of the CTA owns instead vectors of 4 consecutive rows of one token: its split-K
// partials move as 16-byte stores and loads, every other split's in flight at once, and the
// outputs go out as 8-byte stores.
template <int NB, int RT>
struct StreamStaging {
  static constexpr int kRows = RT * 32;
  static constexpr int kPitch = kRows + 4;       // words per token: +4 puts the staging stores on 32 banks
  static constexpr int kVectors = 8 * NB * kRows / 4;
  static constexpr int kWords = 8 * NB * kPitch;  // one tile (the outliers' fp32 sums: a second one)

  // Where register i = [blk][nb][r] (reg) of lane (g, t) of a row tile rt warp lands in the
  // tile: the mma C layout's token 8nb + 2t + (r & 1), row 32 rt + 16 blk + g + 8 (r >> 1) (with
  // the pitch of 4 mod 32 words, a warp's 32 stores of one register hit 32 banks).
  __device__ __forceinline__ static int at(int rt, int i, int lane) {
    const int blk = i / (4 * NB), nb = (i / 4) % NB, r = i % 4, g = lane / 4, t = lane % 4;
    return (8 * nb + 2 * t + (r & 1)) * kPitch + 32 * rt + 16 * blk + g + 8 * (r >> 1);
  }
};

// Register i (0 .. 8 NB - 1) of a lane's [2][NB][4] accumulators (T may be const), and the
// 32-bit words int (the dense sums) and float (the outliers' and W4A16's) sums travel as
// through shared memory.
template <int NB, class T>
__device__ __forceinline__ T& reg(T (&v)[2][NB][4], int i) { return v[i / (4 * NB)][(i / 4) % NB][i % 4]; }
template <class T>
__device__ __forceinline__ int to_bits(T x) {
  if constexpr (std::is_integral_v<T>) return x; else return __float_as_int(x);
}
template <class T>
__device__ __forceinline__ T from_bits(int x) {
  if constexpr (std::is_integral_v<T>) return x; else return __int_as_float(x);
}

// The k-slice reduction of the 8-warp stream-style kernels (stream, W4A16): the WK warps of a row
// tile hold partial sums of the same outputs in the same registers; a tree through shared memory, laid out
// [row tile][slot][register][lane] so that every access is one conflict-free word per lane.
// T is int (the dense sums) or float (the outliers' and W4A16's), carried as bits. Afterwards the
// k-slice-0 warps hold the sums.
//
// PAIR (the fused kernel at NB <= 2): the outliers' fp32 sums f are reduced in the same rounds,
// their partials passed through the writing warp's own outlier region (fbase: warp w's at
// fbase + w * kOutlierWarpWords; its compact tile and entries, idle once its main loop is
// done), so that the two reductions share their barriers. (Run one after the other, the second
// added 0.5 us to the 9.3 of 4096^2 at M = 16 with 16 warps: gemm_timeline.py --outliers.)
constexpr int kOutlierWarpWords = kOutlierWarpBytes / 4;

template <int NB, int RT, int WK, class T, bool PAIR>
__device__ __forceinline__ void reduce_k_slices_pair(T (&v)[2][NB][4], float (&f)[2][NB][4], int* red, float* fbase, int rt,
                                                     int wk, int lane) {
  constexpr int kRegs = 2 * NB * 4;
  static_assert(!PAIR || kRegs * kWarp <= kOutlierWarpWords, "a warp's fp32 partials fit its outlier region");
  const int warp = rt * WK + wk;
#pragma unroll
  for (int s = WK / 2; s >= 1; s /= 2) {
    if (wk >= s && wk < 2 * s) {
#pragma unroll
      for (int r = 0; r < kRegs; ++r) {
        red[((rt * (WK / 2) + wk - s) * kRegs + r) * kWarp + lane] = to_bits(reg<NB>(v, r));
        if constexpr (PAIR) fbase[warp * kOutlierWarpWords + r * kWarp + lane] = reg<NB>(f, r);
      }
    }
    __syncthreads();
    if (wk < s) {
#pragma unroll
      for (int r = 0; r < kRegs; ++r) {
        reg<NB>(v, r) += from_bits<T>(red[((rt * (WK / 2) + wk) * kRegs + r) * kWarp + lane]);
        if constexpr (PAIR) reg<NB>(f, r) += fbase[(warp + s) * kOutlierWarpWords + r * kWarp + lane];
      }
    }
    __syncthreads();
  }
}
template <int NB, int RT, int WK, class T>
__device__ __forceinline__ void reduce_k_slices(T (&v)[2][NB][4], int* red, int rt, int wk, int lane) {
  float none[2][NB][4];
  reduce_k_slices_pair<NB, RT, WK, T, false>(v, none, red, nullptr, rt, wk, lane);
}

// How the stream kernel's k-slice warps hand their sums to the epilogue's tile: the tree above
// (8-warp CTAs), or, with 16 warps, flat: every warp stores all its 8 NB registers ([warp]
// [register][lane]: one conflict-free word per lane), one barrier, and every thread adds the
// WK partials of 8 NB / WK words and writes each sum where the tile wants it
// (StreamStaging::at). The tree needs 2 log2(WK) barriers, 8 at WK = 16,
// and leaves the adding to fewer and fewer warps. Measured on the H200
// (benchmarks/library_ab.py): flat is 1.02x faster with 16 warps (0.99-1.07x) and 0.96x with
// 8 (0.90-1.00x; there its buffer was twice the tree's, and at NB = 4 it took two rounds).
template <int NB, int RT, int WK, bool OUTLIERS>
struct KSliceReduction {
  static constexpr int kRegs = 2 * NB * 4;
  static constexpr bool kFlat = WK >= 8;
  static constexpr int kRedWords = (kFlat ? RT * WK : RT * (WK / 2)) * kRegs * kWarp;
  static constexpr int kTileWords = StreamStaging<NB, RT>::kWords * (OUTLIERS ? 2 : 1);
  // The tree is done with its buffer before the tile is written there; flat reads one while writing the other.
  static constexpr int kTileAt = kFlat ? kRedWords : 0;
  static constexpr int kWords = kFlat ? kRedWords + kTileWords : (kRedWords > kTileWords ? kRedWords : kTileWords);
  static_assert(!kFlat || kRegs <= 16, "the flat buffer holds every register of every warp (<= 32 KB)");
};

// The dense INT32 sums v into tile; PAIR: with the outliers' fp32 sums f into ftile, as
// reduce_k_slices_pair. (Flat CTAs have 16 warps, so NB <= 2: the fused kernel always pairs.)
template <int NB, int RT, int WK, bool PAIR>
__device__ __forceinline__ void reduce_k_slices_flat(const int (&v)[2][NB][4], const float (&f)[2][NB][4], int* red,
                                                     int* tile, float* fbase, float* ftile, int rt, int wk, int lane) {
  constexpr int kRegs = 2 * NB * 4, kThreads = RT * WK * kWarp;
  static_assert(!PAIR || kRegs * kWarp <= kOutlierWarpWords, "a warp's fp32 partials fit its outlier region");
#pragma unroll
  for (int r = 0; r < kRegs; ++r) {
    red[((rt * WK + wk) * kRegs + r) * kWarp + lane] = reg<NB>(v, r);
    if constexpr (PAIR) fbase[(rt * WK + wk) * kOutlierWarpWords + r * kWarp + lane] = reg<NB>(f, r);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < RT * kRegs * kWarp; i += kThreads) {
    const int tile_rt = i / (kRegs * kWarp), r = (i / kWarp) % kRegs, l = i % kWarp;
    int sum = 0;
    float fsum = 0.f;
#pragma unroll
    for (int w = 0; w < WK; ++w) {
      sum += red[((tile_rt * WK + w) * kRegs + r) * kWarp + l];
      if constexpr (PAIR) fsum += fbase[(tile_rt * WK + w) * kOutlierWarpWords + r * kWarp + l];
    }
    tile[StreamStaging<NB, RT>::at(tile_rt, r, l)] = sum;
    if constexpr (PAIR) ftile[StreamStaging<NB, RT>::at(tile_rt, r, l)] = fsum;
  }
  __syncthreads();  // the tile is whole (and the buffer free again)
}

// The k-slice reduction into the epilogue's tile (smem: KSliceReduction::kWords); returns the
// tile (OUTLIERS: the outliers' fp32 tile right after it; outlier_smem: the warps' outlier
// regions, which carry the fp32 partials at NB <= 2).
template <int NB, int RT, int WK, bool OUTLIERS>
__device__ __forceinline__ int* reduce_k_slices_to_tile(int (&acc)[2][NB][4], float (&sparse)[2][NB][4], int* smem, bool holds,
                                                        int rt, int wk, int lane, float* outlier_smem) {
  using R = KSliceReduction<NB, RT, WK, OUTLIERS>;
  using Tile = StreamStaging<NB, RT>;
  constexpr bool kPair = OUTLIERS && NB <= 2;
  int* tile = smem + R::kTileAt;
  float* sparse_tile = reinterpret_cast<float*>(tile + Tile::kWords);
  if constexpr (R::kFlat) {
    static_assert(!OUTLIERS || kPair, "flat CTAs pair the outliers' sums with the dense ones");
    reduce_k_slices_flat<NB, RT, WK, kPair>(acc, sparse, smem, tile, outlier_smem, sparse_tile, rt, wk, lane);
  } else {
    if constexpr (WK > 1) {
      reduce_k_slices_pair<NB, RT, WK, int, kPair>(acc, sparse, smem, outlier_smem, rt, wk, lane);
      if constexpr (OUTLIERS && !kPair) reduce_k_slices<NB, RT, WK>(sparse, smem, rt, wk, lane);
    }
    if (holds) {
#pragma unroll
      for (int i = 0; i < 8 * NB; ++i) {
        const int at = Tile::at(rt, i, lane);
        tile[at] = reg<NB>(acc, i);
        if constexpr (OUTLIERS) sparse_tile[at] = reg<NB>(sparse, i);
      }
    }
    __syncthreads();
  }
  return tile;
}

// The epilogue's per-row inputs of one thread. Every vector a thread stores covers the same
// 4 rows (its vectors are kThreads apart, a multiple of the vectors per token), so the rows'
// scales (and zero points) are loaded once, at kernel entry: no earlier kernel writes them, so
// they are read before the dependent-launch wait, with the first weights, and their DRAM
// latency no longer follows the reductions (on the H200, benchmarks/library_ab.py: 1.02x with
// 8 warps, 1.03x with 16, geometric means at M <= 32).
template <Kind K>
struct RowParams {
  uint32_t scale[2];  // the 4 rows' fp16 scales, two per word (3 words in all: they live through the main loop)
  uint32_t zero;      // kUInt4Channel: the 4 rows' zero points, one per byte

  template <int NB, int RT, int WK>
  __device__ __forceinline__ static int first_row() {
    static_assert((RT * WK * kWarp) % (StreamStaging<NB, RT>::kRows / 4) == 0, "a thread's vectors share their rows");
    return blockIdx.x * RT * 32 + 4 * (threadIdx.x % (StreamStaging<NB, RT>::kRows / 4));
  }
  __device__ __forceinline__ void load(const Params& p, int n0) {
    __half h[4];
    zero = 0;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const bool in = n0 + r < p.N;
      h[r] = in ? p.scale[n0 + r] : __float2half(0.f);
      if constexpr (K == Kind::kUInt4Channel) zero |= (in ? static_cast<uint32_t>(p.zero[n0 + r]) : 0u) << (8 * r);
    }
    scale[0] = pack_half2(h[0], h[1]);
    scale[1] = pack_half2(h[2], h[3]);
  }
  __device__ __forceinline__ float scale_of(int r) const {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(scale[r / 2] >> (16 * (r % 2)))));
  }
  __device__ __forceinline__ int zero_of(int r) const { return static_cast<int>((zero >> (8 * r)) & 0xFFu); }
};

// The epilogue's per-token inputs of one thread: the token scale (and, per channel, the row sum
// of the codes) of the token its output vector belongs to. Unlike the row scales these are
// written by the kernel before this one (the quantize kernel), so they can be read only after
// the dependent-launch wait - but then at once, not after the main loop and the reductions,
// where their L2 round trip was the epilogue's critical path (the timeline of 8192^2 at M = 1:
// 0.6 us from the reduced tile to the last store). Early only where a thread owns at most one
// vector (2 NB <= WK: every CTA shape at M <= 16); otherwise read in place.
template <Kind K, int NB, int RT, int WK>
struct TokenParams {
  using T = StreamStaging<NB, RT>;
  static constexpr bool kEarly = T::kVectors <= RT * WK * kWarp;
  float sx = 0.f;
  int rowsum = 0;

  __device__ __forceinline__ void load(const Params& p) {
    if constexpr (kEarly) {
      const int m = blockIdx.y * 8 * NB + static_cast<int>(threadIdx.x) / (T::kRows / 4);
      if (static_cast<int>(threadIdx.x) < T::kVectors && m < p.M) {
        sx = __half2float(p.x_scale[m]);
        if constexpr (K == Kind::kUInt4Channel) rowsum = p.x_rowsum[m];
      }
    }
  }
  __device__ __forceinline__ float scale_of(const Params& p, int m) const { return kEarly ? sx : __half2float(p.x_scale[m]); }
  __device__ __forceinline__ int rowsum_of(const Params& p, int m) const { return kEarly ? rowsum : p.x_rowsum[m]; }
};

// The epilogue of a staged tile (reduce_k_slices_to_tile; OUTLIERS: the fp32 outlier sums in a
// second tile right after it). Returns whether this CTA ran it (the last split of its tile to
// arrive).
template <Kind K, int NB, int RT, int WK, bool OUTLIERS>
__device__ __forceinline__ bool stream_epilogue(const Params& p, const int* tile, const RowParams<K>& rows,
                                                const TokenParams<K, NB, RT, WK>& tokens) {
  using T = StreamStaging<NB, RT>;
  constexpr int kThreads = RT * WK * kWarp, kMaxSplits = 8;
  const float* sparse_tile = reinterpret_cast<const float*>(tile + T::kWords);
  const size_t ld = static_cast<size_t>(p.NT) * 32, slice = static_cast<size_t>(p.M) * ld;  // workspace [split][M][NT*32]
  const int m0 = blockIdx.y * 8 * NB, n_base = blockIdx.x * RT * 32;
  if (p.splits > 1) {
    for (int v = threadIdx.x; v < T::kVectors; v += kThreads) {
      const int j = v / (T::kRows / 4), n0 = n_base + 4 * (v % (T::kRows / 4));
      if (m0 + j >= p.M || n0 >= static_cast<int>(ld)) continue;
      const size_t at = blockIdx.z * slice + (m0 + j) * ld + n0;
      *reinterpret_cast<int4*>(p.workspace + at) = *reinterpret_cast<const int4*>(tile + j * T::kPitch + n0 - n_base);
      if constexpr (OUTLIERS)
        *reinterpret_cast<float4*>(p.sparse_workspace + at) = *reinterpret_cast<const float4*>(sparse_tile + j * T::kPitch + n0 - n_base);
    }
    const bool last = arrive_last_split(p);
    trace_stamp(p, kSplitsReduced);
    if (!last) return false;
  } else {
    trace_stamp(p, kSplitsReduced);
  }

  const bool whole = p.N % 4 == 0 && (reinterpret_cast<uintptr_t>(p.out) & 15) == 0;
  for (int v = threadIdx.x; v < T::kVectors; v += kThreads) {
    const int j = v / (T::kRows / 4), m = m0 + j, n0 = n_base + 4 * (v % (T::kRows / 4));
    if (m >= p.M || n0 >= p.N) continue;
    int4 sum = *reinterpret_cast<const int4*>(tile + j * T::kPitch + n0 - n_base);
    float4 sp = make_float4(0.f, 0.f, 0.f, 0.f);
    if constexpr (OUTLIERS) sp = *reinterpret_cast<const float4*>(sparse_tile + j * T::kPitch + n0 - n_base);
    if (p.splits > 1) {  // every other split's partials in flight at once (through L2: L1 is not coherent)
      // The fp32 outlier sums are added in split order, this CTA's own (which it wrote to the
      // workspace above, in this thread) read back in its place: the CTA that arrives last
      // varies from call to call, and an order that followed it changed the last bit of an
      // output now and then (benchmarks/library_ab.py --compare-outputs, a library against
      // itself). INT32 sums are exact in any order.
      int4 w[kMaxSplits];
      float4 f[kMaxSplits];
#pragma unroll
      for (int z = 0; z < kMaxSplits; ++z) {
        const bool other = z < p.splits && z != static_cast<int>(blockIdx.z);
        const size_t at = z * slice + m * ld + n0;
        w[z] = other ? __ldcg(reinterpret_cast<const int4*>(p.workspace + at)) : make_int4(0, 0, 0, 0);
        if constexpr (OUTLIERS) f[z] = z < p.splits ? __ldcg(reinterpret_cast<const float4*>(p.sparse_workspace + at)) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      if constexpr (OUTLIERS) sp = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int z = 0; z < kMaxSplits; ++z) {
        add4(sum, w[z]);
        if constexpr (OUTLIERS) add4(sp, f[z]);
      }
      for (int z = kMaxSplits; z < p.splits; ++z) {  // (the plan never splits more than 8 ways)
        const size_t at = z * slice + m * ld + n0;
        if (z != static_cast<int>(blockIdx.z)) add4(sum, __ldcg(reinterpret_cast<const int4*>(p.workspace + at)));
        if constexpr (OUTLIERS) add4(sp, __ldcg(reinterpret_cast<const float4*>(p.sparse_workspace + at)));
      }
    }
    int a[4] = {sum.x, sum.y, sum.z, sum.w};
    if constexpr (K == Kind::kUInt4Channel) {  // the zero point: acc - z[n] * rowsum(x[m])
#pragma unroll
      for (int r = 0; r < 4; ++r) a[r] -= rows.zero_of(r) * tokens.rowsum_of(p, m);
    }
    const size_t at = static_cast<size_t>(m) * p.N + n0;
    if (p.out_i32) {  // (never with outliers)
      store_row4(static_cast<int32_t*>(p.out) + at, a, n0, p.N, whole);
      continue;
    }
    // With outliers, `sp` = sum_k S[n, k] * xq[m, k] (docs/tile-coo.md, section 1) and the
    // reference path (QuantLinear.forward) computes y = linear_int8(xq, sx) + (S xq^T)^T * sx,
    // i.e. y = sx * (sw * acc + sparse) (acc less z * rowsum(xq) per channel): the token scale
    // once per term, in fp32, one fp16 rounding at the end.
    const float sx = tokens.scale_of(p, m);
    const float sps[4] = {sp.x, sp.y, sp.z, sp.w};
    __half y[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float dense = dense_value<K>(a[r], sx, rows.scale_of(r));
      y[r] = __float2half_rn(OUTLIERS ? dense + sps[r] * sx : dense);
    }
    store_row4(static_cast<__half*>(p.out) + at, y, n0, p.N, whole);
  }
  return true;
}

// One warp's chunk of U consecutive k-tiles, as loaded: its lanes' weight fragments, the B
// fragments of its NB token blocks and, progressive, the level-1 parameter words of each of
// the chunk's F folds (F = U / GKc; see stream_kernel).
template <Kind K, int NB, int U, int F, bool STAGE>
struct StreamChunk {
  uint4 w[U][kLaneBytes<K> / 16];
  uint32_t b[STAGE ? 1 : U][NB][2];  // STAGE: the activations are in shared memory instead
  uint32_t s1[F], zs1[F];
};

// Dynamic shared memory of a stream CTA: OUTLIERS, a compact tile and entry buffer per warp
// (kOutlierWarpBytes); then, STAGE, each warp's activation buffer for one chunk: [8 NB
// tokens][U k-tiles x 32 bytes + 16]. The 16-byte pad makes the pitch 4 words mod 32 banks, so
// the B-fragment reads (lane (g, t): token g, word t of a k-tile half) hit 32 different banks.
template <int U>
constexpr int kActPitch = U * 32 + 16;
template <int NB, int U>
constexpr int kActWarpBytes = 8 * NB * kActPitch<U>;
// The slot for a warp's next chunk (stream_kernel, copy_next): its weights, [U k-tiles][32
// lanes][16 bytes], then (progressive) each lane's F words of s1 and of z * s1. Only the dense W4
// kernel with staged activations and per-fold parameters (folded progressive, NB <= 2, or per
// channel) has one; measured on the H200 against the same kernel without (benchmarks/library_ab.py,
// four shapes): 1.03x / 1.01x at M = 8, 1.03x / 1.045x at M = 16 (per group / per channel), per
// channel 1.05x at M = 32; but the per-word progressive kernel (NB = 4), which copies two
// parameter words per k-tile, 0.89x, and unstaged (M < 8) 0.98-1.00x.
template <Kind K, int NB, int U, int F, bool OUTLIERS, bool STAGE>
constexpr int kNextChunkBytes = !OUTLIERS && STAGE && kLaneBytes<K> == 16 && (K != Kind::kProgressive || NB <= 2)
                                    ? U * kWarp * 16 + (K == Kind::kProgressive ? kWarp * 2 * F * 4 : 0)
                                    : 0;

// The group-parameter words of a chunk of U k-tiles (progressive: one per fold of GKc k-tiles).
template <Kind K, int U, int GKc>
constexpr int kChunkFolds = K == Kind::kProgressive ? U / GKc : 1;

// Where the regions of a stream CTA's dynamic shared memory start, and its size (the one
// place that lays them out): the warps' outlier regions, their activation buffers, their
// next-chunk slots.
template <Kind K, int NB, int RT, int WK, int U, int GKc, bool OUTLIERS, bool STAGE>
struct StreamSmem {
  static constexpr int kNextBytes = kNextChunkBytes<K, NB, U, kChunkFolds<K, U, GKc>, OUTLIERS, STAGE>;  // per warp
  static constexpr int kActAt = OUTLIERS ? RT * WK * kOutlierWarpBytes : 0;
  static constexpr int kNextAt = kActAt + (STAGE ? RT * WK * kActWarpBytes<NB, U> : 0);
  static constexpr int kBytes = kNextAt + RT * WK * kNextBytes;
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

template <Kind K, int NB, int RT, int WK, int U, int MIN_BLOCKS, bool OUTLIERS = false, int GKc = 1, bool STAGE = false>
__global__ void __launch_bounds__(RT* WK* kWarp, MIN_BLOCKS) stream_kernel(const Params p) {
  static_assert((WK & (WK - 1)) == 0, "the k-slice reduction is a tree");
  static_assert(!OUTLIERS || (U % 2 == 0 && U / 2 <= kWarp), "a chunk holds U / 2 whole buckets, one lookup lane each");
  constexpr bool kProgressive = K == Kind::kProgressive;
  constexpr bool kFold = kProgressive && NB <= 2;  // group scaling in accumulator space (fold_group)
  static_assert(!kProgressive || U % GKc == 0, "a chunk holds whole folds");
  static_assert(kFold || GKc == 1, "per-word dequantization loads parameters per k-tile");
  constexpr int kBytes = kLaneBytes<K>;
  constexpr int CB = U / 2;                       // OUTLIERS: buckets per chunk
  constexpr int F = kChunkFolds<K, U, GKc>;       // progressive: parameter words (folds) per chunk
  // Splits start on whole folds (progressive) and whole buckets (OUTLIERS), so chunks do too:
  // both units are powers of two, and the larger is a multiple of the smaller.
  constexpr int kFoldTiles = kProgressive ? GKc : 1, kBucketTiles = OUTLIERS ? 2 : 1;
  constexpr int kAlign = kFoldTiles > kBucketTiles ? kFoldTiles : kBucketTiles;
  const StreamThread<NB, RT, WK, kAlign> th(p);
  const auto [warp, lane, g, t, rt, wk, nt, m0, kt_begin, kt_end] = th;  // (lambdas below read th.*)
  RowParams<K> rows;
  rows.load(p, RowParams<K>::template first_row<NB, RT, WK>());

  // The k-slice reduction's buffer and the epilogue's tile (OUTLIERS: and the outliers' tile).
  __shared__ __align__(16) int red[KSliceReduction<NB, RT, WK, OUTLIERS>::kWords];
  extern __shared__ __align__(128) uint8_t stream_dynamic[];  // OUTLIERS: a compact tile and entries per warp
  const uint32_t scratch = smem_u32(stream_dynamic) + warp * kOutlierWarpBytes, entries = scratch + kCompactTileBytes;
  if constexpr (OUTLIERS) zero_shared(scratch, kCompactTileBytes, lane);
  using Smem = StreamSmem<K, NB, RT, WK, U, GKc, OUTLIERS, STAGE>;
  // STAGE: this warp's activation buffer (kActWarpBytes).
  const uint8_t* act_tile = stream_dynamic + Smem::kActAt + warp * kActWarpBytes<NB, U>;
  // The dense W4 kernel with staged activations and parameters per fold (or none): this warp's
  // slot for its next chunk (kNextChunkBytes; see copy_next).
  constexpr bool kNextInSlot = Smem::kNextBytes > 0;
  const uint32_t next_slot = smem_u32(stream_dynamic) + Smem::kNextAt + warp * Smem::kNextBytes;

  trace_stamp(p, kEntry);
  // The next kernel of the stream (if launched by launch_maybe_pdl) may start once every CTA
  // of this grid has come this far; its CTAs take the slots ours free.
  pdl_launch_dependents();
  int acc[2][NB][4] = {};
  float sparse[2][NB][4] = {};  // OUTLIERS: the fp32 outlier sums, same (row, token) as acc
  TokenParams<K, NB, RT, WK> tokens;
  if (nt >= p.NT) {  // (the others wait below, after their first weight loads)
    pdl_wait();
    tokens.load(p);
  }
  if (nt < p.NT) {
    // B fragment rows: token m0 + 8nb + g. Rows past M re-read row M - 1 (never stored).
    const int8_t* xrow[NB];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) xrow[nb] = p.x + static_cast<size_t>(min(m0 + 8 * nb + g, p.M - 1)) * p.Kp + 4 * t;
    const uint8_t* wrow = p.qweight + static_cast<size_t>(nt) * p.KT * 32 * kBytes + lane * kBytes;
    const size_t params_row = (static_cast<size_t>(nt) * p.groups) * 32 + 4 * g;  // progressive only
    // Byte offset of this lane's parameter word (byte i: row 8i + g; layout.pack_group_params) of k-tile kt's group.
    auto params_at = [&](int kt) { return params_row + static_cast<size_t>(kt >> p.group_shift) * 32; };
    using Chunk = StreamChunk<K, NB, U, F, STAGE>;

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
        } else if constexpr (!STAGE) {
#pragma unroll
          for (int nb = 0; nb < NB; ++nb) {
            c.b[u][nb][0] = ldg_u32(xrow[nb] + kt * 32);       // k = 4t .. 4t+3
            c.b[u][nb][1] = ldg_u32(xrow[nb] + kt * 32 + 16);  // k = 16+4t ..
          }
        }
      }
      if constexpr (kProgressive && kWeights) {
#pragma unroll
        for (int f = 0; f < F; ++f) {
          const size_t at = params_at(chunk_tile<kWhole>(kt0, f * GKc, th.kt_end));
          c.s1[f] = ldg_u32(p.scale1 + at);
          c.zs1[f] = ldg_u32(p.zxs1 + at);
        }
      }
    };
    auto load_chunk = [&](Chunk& c, int kt0, auto weights) {  // warp-uniform branch
      if (kt0 + U <= th.kt_end) load(c, kt0, std::true_type{}, weights);
      else load(c, kt0, std::false_type{}, weights);
    };
    // kNextInSlot: the next chunk's weights and parameters go out with cp.async into the warp's
    // slot while this chunk multiplies, and are moved into the registers after it. Each lane
    // copies, waits for and reads back only its own bytes, so no warp barrier is needed.
    // Why not straight into registers: loading the next chunk into each register as soon as it
    // was converted made the kernel 1.1-1.9x slower at M <= 32 (H200). Most likely (not checked
    // in the SASS) because loads in flight into registers share the SASS scoreboards with the
    // older loads still being consumed, so every use waits for the newest load too; cp.async
    // has no register destination.
    // This lane's pieces in the slot: k-tile u's 16 bytes at slot_w + 512 u, its F s1 words
    // and then its F z * s1 words at slot_p.
    const uint32_t slot_w = next_slot + th.lane * 16, slot_p = next_slot + U * kWarp * 16 + th.lane * 2 * F * 4;
    auto copy_next = [&](int kt0) {  // (the next chunk may be the split's partial last one)
#pragma unroll
      for (int u = 0; u < U; ++u)
        cp_async_16(slot_w + u * kWarp * 16, wrow + static_cast<size_t>(chunk_tile<false>(kt0, u, th.kt_end)) * 32 * kBytes, true);
      if constexpr (kProgressive) {
#pragma unroll
        for (int f = 0; f < F; ++f) {
          const size_t at = params_at(chunk_tile<false>(kt0, f * GKc, th.kt_end));
          cp_async_4(slot_p + 4 * f, p.scale1 + at);
          cp_async_4(slot_p + 4 * (F + f), p.zxs1 + at);
        }
      }
      cp_async_commit();
    };
    auto take_next = [&](Chunk& c) {
#pragma unroll
      for (int u = 0; u < U; ++u) c.w[u][0] = lds_v4(slot_w + u * kWarp * 16);
      if constexpr (kProgressive) {
#pragma unroll
        for (int f = 0; f < F; ++f) {
          c.s1[f] = lds_u32(slot_p + 4 * f);
          c.zs1[f] = lds_u32(slot_p + 4 * (F + f));
        }
      }
    };

    // STAGE: the chunk's activations, 8 NB token rows of U k-tiles, copied into this warp's
    // buffer with 16-byte cp.async (a row is 2U contiguous 16-byte pieces; lanes take
    // consecutive pieces, so each instruction reads whole lines) instead of 32-bit B
    // fragment loads straight from global memory. Each of those touches 8 token rows, i.e.
    // 8 L1 wavefronts for 128 bytes, and at M >= 8 that made the L1 the kernel's limit
    // (measured on the H200: staging is 1.15-1.6x faster at M = 16 and 32; at M <= 4, where
    // the fragment loads touch few rows, it is 0-7% slower, hence stage_activations' M >= 8).
    // Through L1 (.ca): the warps of the CTA's other row tile copy the same bytes. Tokens
    // past M and k-tiles past the split are zero-filled, not read.
    // HALF = 0 or 1: only that half of the chunk's k-tiles (the dense kernel's ring, below);
    // -1: all of them.
    auto stage = [&](int kt0, auto half) {
      constexpr int H = decltype(half)::value, kParts = H < 0 ? 2 * U : U;  // 16-byte pieces per row
      static_assert((8 * NB * kParts) % kWarp == 0, "whole pieces per lane");
#pragma unroll
      for (int i = 0; i < 8 * NB * kParts / kWarp; ++i) {
        const int piece = th.lane + kWarp * i, row = piece / kParts, part = (H < 0 ? 0 : H * U) + piece % kParts;
        const int kt = kt0 + part / 2;
        const int8_t* src = p.x + static_cast<size_t>(min(th.m0 + row, p.M - 1)) * p.Kp + min(kt, th.kt_end - 1) * 32 + 16 * (part & 1);
        cp_async_16_ca(smem_u32(act_tile) + row * kActPitch<U> + 16 * part, src, kt < th.kt_end && th.m0 + row < p.M);
      }
      cp_async_commit();
    };
    // B register h (k 16h + 4t .. + 3) of token block nb, k-tile u of the chunk.
    auto act = [&](const Chunk& c, int u, int nb, int h) -> uint32_t {
      if constexpr (STAGE) return *reinterpret_cast<const uint32_t*>(act_tile + (8 * nb + th.g) * kActPitch<U> + u * 32 + 16 * h + 4 * th.t);
      else return c.b[u][nb][h];
    };

    // The dense products of one loaded chunk (HALF = 0 or 1: that half of its k-tiles, whole
    // folds: F >= 2 splits the folds, F = 1 the fold's k-tiles; -1: all of them).
    auto compute = [&](const Chunk& c, int kt0, auto half) {
      [[maybe_unused]] constexpr uint32_t kOnes[4] = {0x01010101u, 0x01010101u, 0x01010101u, 0x01010101u};
      constexpr int H = decltype(half)::value, kInner = kProgressive ? GKc : U;
      constexpr int f_lo = H < 0 || F == 1 ? 0 : H * F / 2, f_hi = H < 0 || F == 1 ? F : (H + 1) * F / 2;
      constexpr int j_lo = H < 0 || F > 1 ? 0 : H * kInner / 2, j_hi = H < 0 || F > 1 ? kInner : (H + 1) * kInner / 2;
#pragma unroll
      for (int f = f_lo; f < f_hi; ++f) {
        [[maybe_unused]] int part[2][NB][4] = {}, xsum[NB][4] = {};  // kFold: this fold's P and X
#pragma unroll
        for (int j = j_lo; j < j_hi; ++j) {
          const int u = f * kInner + j;
          if (kt0 + u < th.kt_end) {
            uint32_t a[2][4];
            if constexpr (K == Kind::kInt8Channel) w8_to_a(c.w[u][0], c.w[u][kBytes / 16 - 1], a);
            else if constexpr (kProgressive && !kFold) w4_progressive_to_a(c.w[u][0], c.s1[u], c.zs1[u], a);
            else w4_codes_to_a(c.w[u][0], a);  // folded progressive and per-channel alike: raw codes
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
              const uint32_t b0 = act(c, u, nb, 0), b1 = act(c, u, nb, 1);
#pragma unroll
              for (int blk = 0; blk < 2; ++blk) mma_s8_16832(kFold ? part[blk][nb] : acc[blk][nb], a[blk], b0, b1);
              if constexpr (kFold) mma_s8_16832(xsum[nb], kOnes, b0, b1);
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
    // OUTLIERS: the first chunk's lookups go out first of all: behind the weights they came
    // back only after most of them (1.5-2 us on the H200, 4096^2 at M = 16, gemm_timeline.py
    // --outliers), and a warp that waited for them before the dependent-launch wait, to send
    // its entries out early, passed the wait that much later.
    int2 lookup{};
    if constexpr (OUTLIERS) lookup = next_lookup<CB>(p, nt, first, kt_end, lane);
    Chunk c;
    if (first < kt_end) load_chunk(c, first, std::true_type{});
    pdl_wait();
    tokens.load(p);
    trace_stamp(p, kWaited);
    // kRing, the dense kernel with staged activations and NB <= 2: the activation buffer is a
    // ring of two halves (the chunk's first and last U / 2 k-tiles). Each half of the next
    // chunk is copied as soon as this chunk's products of that half are done, so that its L2
    // round trip overlaps the other half's products instead of following them at the top of
    // the next chunk (ncu, 8192^2 at M = 16: ~8% of the stall samples waited there). H200,
    // benchmarks/library_ab.py, one process: 1.02x at M = 8, 1.03x at M = 16 (four shapes, per
    // group and per channel); with NB = 4 (M = 32, split 4 ways on 4096^2) 0.96-0.98x, and for
    // W8A8 (32-byte lanes, no slot) 0.985x at M = 8, so W4 at NB <= 2 only. (The fused kernel
    // reads the whole staged chunk after its products, for the outliers.) cp.async groups in
    // flight, oldest first, at the top of a chunk: its halves 0 and 1, then the next chunk's
    // weights in the slot (every ring kernel has one).
    constexpr bool kRing = STAGE && !OUTLIERS && NB <= 2 && K != Kind::kInt8Channel;
    static_assert(!kRing || kNextInSlot, "the ring's waits count the slot's group");
    if constexpr (kRing) {
      if (first < kt_end) {
        stage(first, std::integral_constant<int, 0>{});
        stage(first, std::integral_constant<int, 1>{});
      }
    }
    ChunkOutliers<NB, CB> outliers;
    for (int kt0 = first; kt0 < kt_end; kt0 += step) {
      const bool has_next = kt0 + step < kt_end;
      // (OUTLIERS: loaded during the previous chunk; kNextInSlot: taken from the slot after it)
      if (!OUTLIERS && !kNextInSlot && kt0 != first) load_chunk(c, kt0, std::true_type{});
      if constexpr (kRing) {
        if (has_next) copy_next(kt0 + step);
        if (has_next) cp_async_wait<2>(); else cp_async_wait<1>();  // half 0 has landed
        __syncwarp();
        compute(c, kt0, std::integral_constant<int, 0>{});
        __syncwarp();  // every lane has read half 0
        if (has_next) stage(kt0 + step, std::integral_constant<int, 0>{});
        // Half 1 (behind it, still in flight: the slot and the next chunk's half 0, if any).
        if (has_next) cp_async_wait<2>(); else cp_async_wait_all();
        __syncwarp();
        compute(c, kt0, std::integral_constant<int, 1>{});
        __syncwarp();  // every lane has read half 1
        if (has_next) {
          stage(kt0 + step, std::integral_constant<int, 1>{});
          cp_async_wait<2>();  // the slot (the next chunk's two halves may stay in flight)
          take_next(c);
        }
        if (kt0 == first) trace_stamp(p, kFirstChunk);
        continue;
      }
      if constexpr (STAGE) stage(kt0, std::integral_constant<int, -1>{});
      else load_chunk(c, kt0, std::false_type{});
      // After the activations' copies, so that waiting for those does not wait for these.
      if constexpr (kNextInSlot) {
        if (has_next) copy_next(kt0 + step);
      }
      // OUTLIERS: the entries go out right after the activations (their lookups came a chunk
      // ago, the weights during the previous chunk), and the next chunk's lookups after them.
      if constexpr (OUTLIERS) {
        outliers.load(p, lookup, entries, lane);
        lookup = next_lookup<CB>(p, nt, kt0 + step, kt_end, lane);
      }
      if constexpr (STAGE) {
        // OUTLIERS: the entries (the newest group) may still be in flight: add waits for them;
        // kNextInSlot: the next chunk's copies, if any.
        if (OUTLIERS || (kNextInSlot && has_next)) cp_async_wait<1>(); else cp_async_wait_all();
        __syncwarp();  // every lane's pieces have landed
      }
      compute(c, kt0, std::integral_constant<int, -1>{});
      if constexpr (kNextInSlot) {
        if (has_next) {
          cp_async_wait_all();
          take_next(c);
        }
      }
      if constexpr (OUTLIERS) {
        // The next chunk's weights go out before the outlier work, into the registers compute
        // has just consumed, so that their DRAM round trip overlaps it.
        if (kt0 + step < kt_end) load_chunk(c, kt0 + step, std::true_type{});
        // The outliers' activations: the staged chunk, or the rows the B fragments came from
        // (just read through L1). (Past kt_end there are no entries.)
        outliers.add(p, scratch, entries, [&](int nb, int c0, int c1) -> uint32_t {
          if constexpr (STAGE) {
            const uint8_t* row = act_tile + (8 * nb + th.g) * kActPitch<U>;
            return s8x2_to_f16x2(row[c0], row[c1]);
          } else {
            const uint8_t* row = reinterpret_cast<const uint8_t*>(xrow[nb] - 4 * th.t + kt0 * 32);
            return s8x2_to_f16x2(__ldg(row + c0), __ldg(row + c1));
          }
        }, sparse, lane);
      }
      if constexpr (STAGE) __syncwarp();  // every lane has read the chunk before the next one's copies land
      if (kt0 == first) trace_stamp(p, kFirstChunk);
    }
  }
  trace_stamp(p, kLoopDone);

  const int* tile = reduce_k_slices_to_tile<NB, RT, WK, OUTLIERS>(acc, sparse, red, th.holds_sums(p), rt, wk, lane,
                                                                  reinterpret_cast<float*>(stream_dynamic));
  trace_stamp(p, kSlicesReduced);

  const bool epilogue = stream_epilogue<K, NB, RT, WK, OUTLIERS>(p, tile, rows, tokens);
  trace_stamp(p, kStored);
  trace_put(p, kWhere, sm_id() | (static_cast<unsigned long long>(epilogue) << 32));
}
}  // namespace qoq::gemm
