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
//     L1-bypassing 128-bit loads, U k-tiles in flight at once (from M = 8 the next chunk's also
//     in flight, copied into shared memory while this one multiplies); activations (small, shared by
//     every row tile) come through L1, copied per chunk into a per-warp shared-memory buffer
//     from M = 8 (as 32-bit B fragments straight from global memory below); the warps of a CTA split K
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
//     Its K2 form (kWgmmaK2) gives one 128-row tile four warpgroups: two halves, each with its
//     own ring, taking alternate stages, and in each half one warpgroup per m16 block; their
//     sums meet in shared memory before the epilogue. kWgmmaK2T64: the same with 64 tokens per
//     CTA (m64n64 wgmmas), for M <= 64 and M ~ 128. kWgmmaM64: three warpgroups of 64 rows (one
//     m16 block per warp), 192-row CTAs, where 256- and 128-row CTAs fill the SMs badly.
//     Progressive weights: the group's constants are built once per stage when the group spans
//     it, and with the tokens' row sums the weights go in as UINT8 + 128 (BIASED; the epilogue
//     subtracts 128 * rowsum(x)).
//
// Split-K across CTAs (both kernels): each split writes its INT32 partial sums to a
// workspace; the last CTA of a tile to arrive (an atomic counter per tile) adds the others
// and runs the epilogue, then resets its counter to zero, so one launch does it all and
// the counters stay zero between launches (CUDA-graph friendly). INT32 addition is exact
// and associative: the result does not depend on the split.
//
// Files: gemm_common.cuh (kinds, parameters, fragments, epilogue, split-K), gemm_stream.cuh
// (stream_kernel and the fused outlier path), gemm_wgmma.cuh (wgmma_kernel), and here the
// launchers that w4a8_gemm.cu, w8a8_gemm.cu and w4a16_gemm.cu call.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include "gemm_stream.cuh"
#include "gemm_wgmma.cuh"

namespace qoq::gemm {

// ---------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------

// kStream: the stream kernel with 8 warps per CTA (2 row tiles x 4 k-slices), two CTAs per SM;
// kStream1x16 / kStream2x8: 16 warps per CTA (1 x 16, 2 x 8), one CTA per SM - for decode
// shapes whose row tiles alone fill the GPU, so that K needs no split across CTAs.
// kWgmmaK2T64: the K2 form with 64 tokens per CTA (m64n64 wgmmas); kWgmmaM64: warpgroups of
// 64 rows (one m64 block each), tile = how many (3: 192-row CTAs).
enum class KernelId : int { kStream = 0, kWgmma = 1, kStream1x16 = 2, kStream2x8 = 3, kWgmmaK2 = 4, kWgmmaK2T64 = 5, kWgmmaM64 = 6 };

// Whether the dense stream kernel copies each chunk's activations into shared memory with
// 16-byte cp.async (STAGE, at M >= kStageMinM) instead of loading its B fragments straight
// from global memory (on by default; qoq_gemm_set_stage_activations turns it off for
// benchmarks). The fused sparse-dense kernel stages by fused_staging().
// Measured on the H200 (benchmarks/gemm.py --stage-ab): 1.15-1.6x faster at M = 16 and 32,
// 0.98-1.07x at M = 8, 0.93-1.0x at M = 2 and 4, where the fragment loads touch few rows.
inline bool& stage_activations() {
  static bool enabled = true;
  return enabled;
}
constexpr int kStageMinM = 8;

// When the fused sparse-dense kernel stages its activations (only while stage_activations()
// holds): never, with 16 tokens per CTA (NB = 2, M > 8), or from M = kStageMinM like the dense
// kernel (the default) (qoq_gemm_set_fused_staging; benchmarks/sparse_dense.py --explore).
// Measured on the H200 at 1% outliers (six shapes, 8- and 16-warp CTAs), with the compact
// outlier path, which gathers its activations from the staged chunk or else through L1:
// staged is faster at M = 8 (fused / dense 1.65-1.83 against 1.81-2.00 unstaged) and at M = 16.
enum class FusedStaging : int { kNever = 0, kTwoBlocks = 1, kAlways = 2 };
inline FusedStaging& fused_staging() {
  static FusedStaging mode = FusedStaging::kAlways;
  return mode;
}

// Where the stream kernel writes its CTAs' timelines (Params::trace; null: nowhere; set by
// qoq_gemm_set_trace for benchmarks/gemm_timeline.py).
inline unsigned long long*& trace_buffer() {
  static unsigned long long* buffer = nullptr;
  return buffer;
}

// Stream-kernel shapes by tokens per CTA (8*NB): RT row tiles x WK k-slices = 8 warps;
// U k-tiles in flight per warp, fewer when the accumulators grow.
// OUTLIERS: the same chunks (one chunk per warp of the 16-warp CTAs at K = 4096, like the
// dense kernel; with chunks of 4 k-tiles the second chunk's weights were requested only after
// the first was multiplied).
// Progressive weights at NB <= 2 fold a group every GKc = min(group k-tiles, 4, U) k-tiles;
// with one-k-tile groups (g32) and NB = 2 the chunk is halved, so that its per-k-tile
// parameter words fit beside the partial sums.
// (Measured on the H200 and not kept: two chunks in registers, the next one's loads in flight
// while one multiplies, with U or U / 2 k-tiles - within +-5% of this, better or worse by shape;
// what is kept instead, from M = 8, is the next chunk copied into a per-warp shared-memory slot
// while this one multiplies: kNextChunkBytes.)
template <Kind K, int NB, bool OUTLIERS, int GKc, int RT = 2, int WK = 4>
cudaError_t launch_stream_shape(const Params& p, cudaStream_t stream) {
  constexpr int U0 = NB <= 2 ? 8 : (NB == 4 ? 4 : 2);
  constexpr int U = K == Kind::kProgressive && GKc == 1 && NB == 2 ? U0 / 2 : U0;
  constexpr int G = GKc < U ? GKc : U;
  constexpr int MIN_BLOCKS = RT * WK > 8 ? 1 : (NB <= (OUTLIERS ? 2 : 4) ? 2 : 1);
  const dim3 grid(ceil_div(p.NT, RT), ceil_div(p.M, 8 * NB), p.splits);
  auto go = [&](auto stage) {
    constexpr bool STAGE = decltype(stage)::value;
    constexpr int kSmem = StreamSmem<K, NB, RT, WK, U, G, OUTLIERS, STAGE>::kBytes;
    const auto kernel = stream_kernel<K, NB, RT, WK, U, MIN_BLOCKS, OUTLIERS, G, STAGE>;
    // (Static + dynamic shared memory above 48 KB needs the opt-in, whatever the split.)
    if constexpr (kSmem > 0) QOQ_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    Params q = p;
    q.trace = trace_buffer();
    return launch_maybe_pdl(kernel, grid, dim3(RT * WK * kWarp), kSmem, stream, dependent_launch(), q);
  };
  bool stage = stage_activations() && p.M >= kStageMinM;
  if constexpr (OUTLIERS) {
    const FusedStaging mode = fused_staging();
    stage = stage && (mode == FusedStaging::kAlways || (mode == FusedStaging::kTwoBlocks && NB >= 2));
  }
  return stage ? go(std::true_type{}) : go(std::false_type{});
}

template <Kind K, int NB, bool OUTLIERS = false, int RT = 2, int WK = 4>
cudaError_t launch_stream(const Params& p, cudaStream_t stream) {
  if constexpr (K != Kind::kProgressive || NB > 2) {  // no group fold (see stream_kernel): GKc = 1
    return launch_stream_shape<K, NB, OUTLIERS, 1, RT, WK>(p, stream);
  } else {
    switch (p.group_shift) {  // k-tiles per group: 1, 2, 4 or more (folded every 4)
      case 0: return launch_stream_shape<K, NB, OUTLIERS, 1, RT, WK>(p, stream);
      case 1: return launch_stream_shape<K, NB, OUTLIERS, 2, RT, WK>(p, stream);
      default: return launch_stream_shape<K, NB, OUTLIERS, 4, RT, WK>(p, stream);
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

template <Kind K, int WGS, int KS = 1, int BN = 128, int RPW = 128>
cudaError_t launch_wgmma(const Params& p_in, cudaStream_t stream) {
  using S = WgmmaShape<K, WGS, KS, BN, RPW>;
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
  // Packed weights [NT, KT, tile words]: boxes of 4 k-tiles x kRT row tiles, copied as stored.
  QOQ_RETURN_IF_ERROR(encode_map<3>(&maps.w, CU_TENSOR_MAP_DATA_TYPE_UINT32, p.qweight, {words, KT, NT},
                                    {4 * words, 4 * words * KT}, {static_cast<cuuint32_t>(words), S::kKT, S::kRT},
                                    CU_TENSOR_MAP_SWIZZLE_NONE));
  if constexpr (K == Kind::kProgressive) {
    // Group parameters [NT, groups, 32 bytes]: the groups of one stage x kRT row tiles.
    p.groups_per_stage = p.group_shift >= 2 ? 1 : 4 >> p.group_shift;
    const cuuint64_t G = p.groups;
    const cuuint32_t box[3] = {8, static_cast<cuuint32_t>(p.groups_per_stage), S::kRT};
    QOQ_RETURN_IF_ERROR(encode_map<3>(&maps.s1, CU_TENSOR_MAP_DATA_TYPE_UINT32, p.scale1, {8, G, NT}, {32, 32 * G}, box,
                                      CU_TENSOR_MAP_SWIZZLE_NONE));
    QOQ_RETURN_IF_ERROR(encode_map<3>(&maps.zs1, CU_TENSOR_MAP_DATA_TYPE_UINT32, p.zxs1, {8, G, NT}, {32, 32 * G}, box,
                                      CU_TENSOR_MAP_SWIZZLE_NONE));
  }
  const dim3 grid(ceil_div(p.NT, S::kRT), ceil_div(p.M, S::kBN), p.splits);
  auto go = [&](auto biased) {  // progressive with the tokens' row sums: the UINT8 form (wgmma_kernel's BIASED)
    const auto kernel = wgmma_kernel<K, WGS, KS, decltype(biased)::value, BN, RPW>;
    QOQ_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmem));
    // Two splits go out as clusters of two CTAs, whose epilogue adds the partner's partials
    // through distributed shared memory (wgmma_epilogue), when all of the grid's pairs fit on
    // the GPU at once (a pair needs two multiprocessors of one GPC); otherwise, as for more
    // splits, through the workspace.
    static int max_pairs = -1;  // per kernel (and device: one GPU per process here)
    if (max_pairs < 0) {
      cudaLaunchAttribute pair{};
      pair.id = cudaLaunchAttributeClusterDimension;
      pair.val.clusterDim.x = 1;
      pair.val.clusterDim.y = 1;
      pair.val.clusterDim.z = 2;
      cudaLaunchConfig_t config{};
      config.gridDim = dim3(1, 1, 2);
      config.blockDim = dim3(S::kThreads);
      config.dynamicSmemBytes = S::kSmem;
      config.attrs = &pair;
      config.numAttrs = 1;
      QOQ_RETURN_IF_ERROR(cudaOccupancyMaxActiveClusters(&max_pairs, kernel, &config));
    }
    const unsigned cluster_z = p.splits == 2 && static_cast<int>(grid.x * grid.y) <= max_pairs ? 2 : 1;
    return launch_in_clusters_maybe_pdl(kernel, grid, dim3(S::kThreads), S::kSmem, stream, dependent_launch(), cluster_z, p, maps);
  };
  if constexpr (K == Kind::kProgressive) {
    if (p.x_rowsum != nullptr) return go(std::true_type{});
  }
  return go(std::false_type{});
}

// One of the stream kernel's CTA shapes by kernel id (kStream: 8 warps, NB = tile in 1, 2, 4, 8;
// kStream1x16 / kStream2x8: 16 warps, NB = 1, 2), dense or fused with the outliers.
template <Kind K, bool OUTLIERS>
cudaError_t launch_stream_kernel(const Params& p, int kernel, int tile, cudaStream_t stream) {
  if (kernel == static_cast<int>(KernelId::kStream)) {
    switch (tile) {
      case 1: return launch_stream<K, 1, OUTLIERS>(p, stream);
      case 2: return launch_stream<K, 2, OUTLIERS>(p, stream);
      case 4: return launch_stream<K, 4, OUTLIERS>(p, stream);
      case 8: return launch_stream<K, 8, OUTLIERS>(p, stream);
    }
  } else if (kernel == static_cast<int>(KernelId::kStream1x16)) {
    switch (tile) {
      case 1: return launch_stream<K, 1, OUTLIERS, 1, 16>(p, stream);
      case 2: return launch_stream<K, 2, OUTLIERS, 1, 16>(p, stream);
    }
  } else if (kernel == static_cast<int>(KernelId::kStream2x8)) {
    switch (tile) {
      case 1: return launch_stream<K, 1, OUTLIERS, 2, 8>(p, stream);
      case 2: return launch_stream<K, 2, OUTLIERS, 2, 8>(p, stream);
    }
  }
  return cudaErrorInvalidValue;
}

// kernel/tile as chosen by qoqtool.runtime.cuda_ops.plan: stream with NB = tile (1, 2, 4, 8),
// wgmma with WGS = tile (1, 2), wgmma with two halves of warpgroups splitting the stages of
// one 128-row tile (kWgmmaK2, tile 1: four warpgroups, two per half, one m16 block each) with
// 128 or 64 (kWgmmaK2T64) tokens, wgmma with tile (3) warpgroups of 64 rows (kWgmmaM64), the
// 16-warp stream shapes with NB = tile (1, 2).
template <Kind K>
cudaError_t launch(const Params& p, int kernel, int tile, cudaStream_t stream) {
  if (p.M <= 0) return cudaSuccess;
  if (p.splits < 1 || p.splits > p.KT) return cudaErrorInvalidValue;
  if (kernel == static_cast<int>(KernelId::kWgmmaK2)) return tile == 1 ? launch_wgmma<K, 1, 2>(p, stream) : cudaErrorInvalidValue;
  if (kernel == static_cast<int>(KernelId::kWgmmaK2T64)) return tile == 1 ? launch_wgmma<K, 1, 2, 64>(p, stream) : cudaErrorInvalidValue;
  if (kernel == static_cast<int>(KernelId::kWgmmaM64)) return tile == 3 ? launch_wgmma<K, 3, 1, 128, 64>(p, stream) : cudaErrorInvalidValue;
  if (kernel != static_cast<int>(KernelId::kWgmma)) return launch_stream_kernel<K, false>(p, kernel, tile, stream);
  switch (tile) {
    case 1: return launch_wgmma<K, 1>(p, stream);
    case 2: return launch_wgmma<K, 2>(p, stream);
  }
  return cudaErrorInvalidValue;
}

// The fused sparse-dense GEMM (W4A8 + Tile-COO outliers): the stream kernel's shapes only
// (launch_stream_kernel). The wgmma kernel has no outlier path yet
// (qoqtool.runtime.packed_linear adds the outliers after it). Needs an fp16 output and, with
// splits > 1, p.sparse_workspace.
template <Kind K>
cudaError_t launch_sparse_dense(const Params& p, int kernel, int tile, cudaStream_t stream) {
  if (p.M <= 0) return cudaSuccess;
  if (p.splits < 1 || p.splits > p.KT || p.out_i32 || p.NBk != ceil_div(p.KT * 32, kBucketK)) return cudaErrorInvalidValue;
  if (p.splits > 1 && p.sparse_workspace == nullptr) return cudaErrorInvalidValue;
  return launch_stream_kernel<K, true>(p, kernel, tile, stream);
}

}  // namespace qoq::gemm
