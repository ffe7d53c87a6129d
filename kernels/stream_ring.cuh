// ring_kernel: the small-M weight stream of the stream kernel, fed by the copy engine
// through a shared-memory ring per warp (Hopper, sm_90a). Included by gemm_kernels.cuh.
//
// Measured on the H200 (benchmarks/notes-gemm.md, version 4): correct, but no faster than the
// stream kernel (0.58-1.12x): the W4 main loop is bound by instruction issue, not by bytes in
// flight. The plan does not choose it; QOQTOOL_RING=1 does, for comparison.
//
// Why: the stream kernel loads each warp's weight fragments global -> registers, U k-tiles
// at a time, then multiplies; the bytes in flight are bounded by the registers that receive
// them (~32 KB per SM on average), about half of what Little's law asks of HBM. Here a warp
// keeps S chunks in flight in shared memory instead, whatever it is computing:
//
//  * Work: exactly the stream kernel's. CTA = RT row tiles x WK warps splitting K, 8*NB
//    tokens; grid (NT / RT, M / (8 NB), splits); split z owns k-tiles
//    [split_begin(z), split_begin(z + 1)); warp wk of a row tile owns the chunks of U
//    consecutive k-tiles starting at kt_begin + (i * WK + wk) * U, i = 0, 1, ... (the WK
//    warps of a row tile walk its bytes side by side). Same fragments and chunks per warp,
//    same k-slice reduction tree, same reduce_splits and store_result: the INT32 sums (exact,
//    in any order) are the stream kernel's, and so are the fp16 outputs, bit for bit.
//  * Ring: S slots per warp, each [weights: U k-tiles x 32 lanes x kLaneBytes, in the packed
//    order][progressive: scale1 of the chunk's groups, 32 B each][z*s1, likewise]. The
//    packed layout stores a row tile's k-tiles one after the other, so a chunk's weights
//    are ONE contiguous run of U*32*kLaneBytes bytes, and its group parameters (per row
//    tile, group after group) one run of 32 B per group: one 1-D bulk copy each
//    (cp.async.bulk, no tensor map), issued by lane 0, completing on the slot's mbarrier.
//  * Loop, per chunk i: issue the chunk's activation loads (B fragments, 32-bit, through
//    L1: they are tiny and shared by the CTAs of the multiprocessor), wait for slot i % S,
//    read the fragments with 128-bit shared loads (16 contiguous bytes per lane: no bank
//    conflict for W4), multiply; then lane 0 refills the slot with chunk i + S. So S chunks
//    are always in flight, while the warp computes or waits.
//  * Activations are issued before the wait of their chunk rather than a chunk earlier: the
//    wait is where the warp spends its time in a bandwidth-bound stream (one slot arrives
//    every ~1-2 us / S per warp, longer than an L2 hit), so their latency hides behind it,
//    and the chunk's B registers stay live after its mma (for a per-chunk outlier pass).
#pragma once

#include "common.cuh"

namespace qoq::gemm {

// The ring shapes the plan may pick (qoqtool.runtime.cuda_ops.RING_SHAPES mirrors this
// table): RT row tiles x WK k-slice warps per CTA, U k-tiles per chunk (W4; W8 chunks take
// U / 2 k-tiles, the same bytes), S ring slots per warp, and the CTAs per multiprocessor
// the register budget is made for.
//
//   shape  RT WK  U  S  ring per CTA (progressive)   why
//     0     1  8  4  4  72 KB (3 CTAs / SM)          the default: 8 warps on one row tile
//     1     2  4  4  4  72 KB                        half the CTAs, two row tiles each
//     2     1  4  4  4  36 KB (4+ CTAs / SM)         small CTAs: more of them per SM
//     3     1  8  8  3  108 KB (2 CTAs / SM)         4 KB chunks: fewer, larger copies
//     4     1  8  2  8  72 KB                        1 KB chunks, a deeper ring
template <Kind K, int SHAPE>
struct RingShape {
  static constexpr int kRT = SHAPE == 1 ? 2 : 1;
  static constexpr int kWK = SHAPE == 1 || SHAPE == 2 ? 4 : 8;
  static constexpr int kU4 = SHAPE == 3 ? 8 : SHAPE == 4 ? 2 : 4;
  static constexpr int kU = K == Kind::kInt8Channel ? (kU4 / 2 > 0 ? kU4 / 2 : 1) : kU4;  // same bytes per chunk
  static constexpr int kS = SHAPE == 3 ? 3 : SHAPE == 4 ? 8 : 4;
  static constexpr int kMinBlocks = SHAPE == 2 ? 4 : 2;
  static constexpr int kWarps = kRT * kWK;
  static constexpr int kWBytes = kU * 32 * kLaneBytes<K>;                     // a chunk's weights
  static constexpr int kPBytes = K == Kind::kProgressive ? kU * 32 : 0;       // scale1 (or z*s1) of <= U groups
  static constexpr int kSlot = kWBytes + 2 * kPBytes;                         // a multiple of 16 (bulk copies)
  static constexpr int kSmem = kWarps * kS * kSlot;
  static_assert(kSlot % 16 == 0, "bulk copies need 16-byte aligned slots");
};
constexpr int kRingShapes = 5;

template <Kind K, int NB, int SHAPE>
__global__ void __launch_bounds__(RingShape<K, SHAPE>::kWarps* kWarp, RingShape<K, SHAPE>::kMinBlocks)
    ring_kernel(const Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using R = RingShape<K, SHAPE>;
  constexpr int RT = R::kRT, WK = R::kWK, U = R::kU, S = R::kS;
  constexpr int kBytes = kLaneBytes<K>;
  static_assert((WK & (WK - 1)) == 0, "the k-slice reduction is a tree");
  // The reduction buffer (RT * WK/2 * 2 * NB * 4 words * 32 lanes) reuses the ring.
  static_assert(RT * (WK / 2) * 2 * NB * 4 * kWarp * 4 <= R::kSmem, "the ring must hold the k-slice reduction");

  extern __shared__ __align__(16) uint8_t ring_smem[];
  __shared__ __align__(8) uint64_t ring_bars[R::kWarps * S];  // [warp][slot]: "slot holds its chunk"

  const StreamThread<NB, RT, WK, 1> th(p);
  const auto [warp, lane, g, t, rt, wk, nt, m0, kt_begin, kt_end] = th;
  // This warp's chunks: i = 0 .. n-1 start at kt_begin + (i * WK + wk) * U (none past NT).
  const int first = kt_begin + wk * U;
  const int n = nt < p.NT && first < kt_end ? ceil_div(kt_end - first, WK * U) : 0;

  const uint32_t ring = smem_u32(ring_smem) + warp * S * R::kSlot;  // this warp's S slots
  const uint32_t bars = smem_u32(&ring_bars[warp * S]);
  if (lane == 0) {
    for (int s = 0; s < S; ++s) mbar_init(bars + 8 * s, 1);  // one arrival (lane 0's expect_tx) per phase
    mbar_fence_init();  // the copy engine must see the initialised barriers
  }
  __syncwarp();  // ... and so must the other lanes before they wait on them

  const uint8_t* wrow = p.qweight + static_cast<size_t>(nt) * p.KT * 32 * kBytes;  // row tile nt, k-tile 0
  const size_t params_row = static_cast<size_t>(nt) * p.groups * 32;            // progressive only
  const uint64_t policy = l2_evict_first_policy();  // weights are read once: evict them first

  // Lane 0: copy chunk i (k-tiles kt0 .. kt0 + kts - 1) into slot i % S. A tail chunk
  // (kts < U) copies kts * 32 * kBytes bytes: still a multiple of 512. Its groups are
  // (kt0 >> shift) .. ((kt0 + kts - 1) >> shift), at most kts of them, 32 bytes each,
  // contiguous per row tile: a chunk may straddle groups, and a split need not start on a
  // group (or chunk) boundary.
  auto issue = [&](int i) {
    const int kt0 = first + i * WK * U, kts = min(U, th.kt_end - kt0);  // (th.: a lambda may not capture a structured binding in C++17)
    const uint32_t slot = ring + (i % S) * R::kSlot, bar = bars + 8 * (i % S);
    const uint32_t wbytes = kts * 32 * kBytes;
    uint32_t pbytes = 0;
    int grp0 = 0;
    if constexpr (K == Kind::kProgressive) {
      grp0 = kt0 >> p.group_shift;
      pbytes = (((kt0 + kts - 1) >> p.group_shift) - grp0 + 1) * 32;
    }
    mbar_arrive_expect_tx(bar, wbytes + 2 * pbytes);  // the phase completes when all these bytes have landed
    bulk_copy_g2s(slot, wrow + static_cast<size_t>(kt0) * 32 * kBytes, wbytes, bar, policy);
    if constexpr (K == Kind::kProgressive) {
      // Group parameters: the default L2 policy (every token block, blockIdx.y, reads them).
      bulk_copy_g2s(slot + R::kWBytes, p.scale1 + params_row + grp0 * 32, pbytes, bar);
      bulk_copy_g2s(slot + R::kWBytes + R::kPBytes, p.zxs1 + params_row + grp0 * 32, pbytes, bar);
    }
  };
  if (lane == 0)
    for (int i = 0; i < S && i < n; ++i) issue(i);  // fill the ring

  // B fragment rows: token m0 + 8nb + g. Rows past M re-read row M - 1 (never stored).
  const int8_t* xrow[NB];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) xrow[nb] = p.x + static_cast<size_t>(min(m0 + 8 * nb + g, p.M - 1)) * p.Kp + 4 * t;

  int acc[2][NB][4] = {};
#pragma unroll 1
  for (int i = 0; i < n; ++i) {
    const int kt0 = first + i * WK * U, kts = min(U, kt_end - kt0);
    uint32_t b[U][NB][2];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kt = min(kt0 + u, kt_end - 1);  // a tail chunk re-reads a valid k-tile (zeroed below)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        b[u][nb][0] = ldg_u32_now(xrow[nb] + kt * 32);       // k = 4t .. 4t+3
        b[u][nb][1] = ldg_u32_now(xrow[nb] + kt * 32 + 16);  // k = 16+4t ..
      }
    }
    // The j-th use of a slot (chunk i = j*S + slot) is its barrier's phase j: wait for parity
    // j & 1. Lane 0 re-arms a slot only after every lane has passed this wait for it (the
    // __syncwarp below), so no lane can miss a phase.
    mbar_wait(bars + 8 * (i % S), (i / S) & 1);
    __syncwarp();  // mma.sync is .aligned: reconverge the lanes after their spin loops

    // A tail chunk (kts < U, warp-uniform) multiplies its missing k-tiles by zero activations
    // instead of branching around them: exact (integers), and the U shared loads and mma of
    // a chunk stay one branch-free block that the scheduler can interleave. Their weights
    // are re-read from k-tile kts - 1 (landed, so no stale or unwritten shared memory is read).
#pragma unroll
    for (int u = 1; u < U; ++u)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
        if (u >= kts) b[u][nb][0] = b[u][nb][1] = 0;

    const uint32_t slot = ring + (i % S) * R::kSlot;
    const int grp0 = K == Kind::kProgressive ? kt0 >> p.group_shift : 0;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int uu = min(u, kts - 1);
      Fragment<K> f;
#pragma unroll
      for (int h = 0; h < kBytes / 16; ++h) f.w[h] = lds_v4(slot + (uu * 32 + lane) * kBytes + 16 * h);
      if constexpr (K == Kind::kProgressive) {
        // The k-tile's group, counted from the chunk's first (the copied parameter runs).
        const uint32_t params = slot + R::kWBytes + (((kt0 + uu) >> p.group_shift) - grp0) * 32 + 4 * g;
        f.s1 = lds_u32(params);  // byte i: row 8i + g (one word, broadcast to the 4 lanes of g)
        f.zs1 = lds_u32(params + R::kPBytes);
      }
      uint32_t a[2][4];
      f.to_a(a);
#pragma unroll
      for (int blk = 0; blk < 2; ++blk)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) mma_s8_16832(acc[blk][nb], a[blk], b[u][nb][0], b[u][nb][1]);
    }
    // (fused outliers: the per-chunk call goes here, with b[][][] and k-tiles kt0 .. kt0 + kts - 1)

    // Write-after-read: every lane's shared loads of this slot fed an mma above, so they
    // have completed (the mma waited for their registers) before the lane reaches this
    // barrier; only then may the copy engine overwrite the slot.
    __syncwarp();
    if (lane == 0 && i + S < n) issue(i + S);
  }

  // Reduce the WK k-slices of each row tile: the stream kernel's tree, laid out
  // [row tile][slot][register][lane] (one conflict-free word per lane), in the ring's memory.
  if constexpr (WK > 1) {
    __syncthreads();  // every warp is done reading its ring (and all its copies have landed)
    reduce_k_slices<NB, RT, WK>(acc, reinterpret_cast<int*>(ring_smem), rt, wk, lane);
  }

  const bool holds = th.holds_sums(p);
  auto visit = [&](auto&& f) {
    if (!holds) return;
    th.for_each_output([&](int blk, int nb, int r, int m, int n_) { f(m, n_, acc[blk][nb][r]); });
  };
  if (reduce_splits(p, visit)) visit([&](int m, int n_, int& v) { store_result<K>(p, m, n_, v); });
#endif  // __CUDA_ARCH__ >= 900
}

template <Kind K, int NB, int SHAPE>
cudaError_t launch_ring_shape(const Params& p, cudaStream_t stream) {
  using R = RingShape<K, SHAPE>;
  int device = 0, major = 0;
  QOQ_RETURN_IF_ERROR(cudaGetDevice(&device));
  QOQ_RETURN_IF_ERROR(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  // Bulk copies exist from sm_90, and the library has only the sm_90a image of this kernel;
  // qoqtool.runtime.cuda_ops runs the stream kernel instead on other GPUs.
  if (major != 9) return cudaErrorInvalidDeviceFunction;
  const auto kernel = ring_kernel<K, NB, SHAPE>;
  QOQ_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, R::kSmem));
  // All of the unified L1 as shared memory, so that several rings fit on one multiprocessor
  // (the driver might otherwise pick a carveout that holds a single CTA).
  QOQ_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                           cudaSharedmemCarveoutMaxShared));
  const dim3 grid(ceil_div(p.NT, R::kRT), ceil_div(p.M, 8 * NB), p.splits);
  kernel<<<grid, R::kWarps * kWarp, R::kSmem, stream>>>(p);
  return cudaGetLastError();
}

template <Kind K, int NB>
cudaError_t launch_ring_nb(const Params& p, int shape, cudaStream_t stream) {
  switch (shape) {
    case 0: return launch_ring_shape<K, NB, 0>(p, stream);
    case 1: return launch_ring_shape<K, NB, 1>(p, stream);
    case 2: return launch_ring_shape<K, NB, 2>(p, stream);
    case 3: return launch_ring_shape<K, NB, 3>(p, stream);
    case 4: return launch_ring_shape<K, NB, 4>(p, stream);
  }
  return cudaErrorInvalidValue;
}

// `tile` of a ring plan = NB + 8 * shape (qoqtool.runtime.cuda_ops.ring_tile), NB in {1, 2, 4}.
template <Kind K>
cudaError_t launch_ring(const Params& p, int tile, cudaStream_t stream) {
  const int nb = tile % 8, shape = tile / 8;
  if (shape < 0 || shape >= kRingShapes) return cudaErrorInvalidValue;
  switch (nb) {
    case 1: return launch_ring_nb<K, 1>(p, shape, stream);
    case 2: return launch_ring_nb<K, 2>(p, shape, stream);
    case 4: return launch_ring_nb<K, 4>(p, shape, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace qoq::gemm
