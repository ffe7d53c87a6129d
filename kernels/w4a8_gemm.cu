// W4A8 GEMMs: INT8 per-token activations x packed UINT4 weights -> fp16, INT32 accumulation.
//
//   qoq_w4a8_gemm_per_group    QoQ progressive weights: in the main loop each 32-bit word
//                              of four codes becomes four exact INT8 weights (q - z)*s1
//                              with one multiply-add and one xor (gemm_common.cuh,
//                              progressive_quad); epilogue out = acc * sx[m] * s0[n].
//   qoq_w4a8_gemm_per_group_rowsum
//                              the same with the row sums of x (the quantize kernels'
//                              x_rowsum): the wgmma kernel leaves out the xor, multiplies
//                              UINT8 weights (q - z)*s1 + 128 and subtracts 128 * rowsum(x[m])
//                              in its epilogue; the stream kernels ignore the sums.
//   qoq_w4a8_gemm_per_channel  raw codes multiply the activations; the zero point moves to
//                              the epilogue: out = (acc - z[n] * rowsum(x[m])) * s[n] * sx[m].
//
//   qoq_w4a8_sparse_dense_gemm_per_group / _per_channel
//                              the same GEMMs fused with the linear's fp16 outliers in
//                              Tile-COO (docs/tile-coo.md): the stream kernel's CTA of a row
//                              tile also adds sum_k S[n, k] * xq[m, k] (fp32) of the buckets
//                              of its k range, and the epilogue writes once
//                              out = sx[m] * (sw[n] * acc + sparse); `kernel` one of
//                              the stream kernel's CTA shapes and `tile` its NB (no wgmma
//                              path yet), `sparse_workspace` holds [splits, M, NT*32] fp32
//                              partials when splits > 1.
//
// The kernels, tile shapes and split-K live in gemm_kernels.cuh (and the files it includes);
// the choice among them by M is qoqtool.runtime.cuda_ops.plan. `out_i32` writes the raw INT32
// accumulations instead of fp16 (after the zero-point term for per-channel): the tests compare
// them bit for bit.
#include "gemm_kernels.cuh"

using qoq::gemm::Kind;
using qoq::gemm::Params;

// The dense operands of each weight kind, shared by the dense and the fused entry points.
static Params progressive_params(const int8_t* x, const __half* x_scale, const uint8_t* qweight, const __half* scale0,
                                 const uint8_t* scale1, const uint8_t* zero_x_scale1, int M, int N, int Kp,
                                 int group_shift, int splits, int32_t* workspace, int32_t* counters) {
  Params p = qoq::gemm::base_params(x, x_scale, qweight, scale0, M, N, Kp, splits, workspace, counters);
  p.scale1 = scale1;
  p.zxs1 = zero_x_scale1;
  p.group_shift = group_shift;
  p.groups = p.KT >> group_shift;
  return p;
}

static Params per_channel_params(const int8_t* x, const __half* x_scale, const int32_t* x_rowsum,
                                 const uint8_t* qweight, const __half* scale, const uint8_t* zero, int M, int N, int Kp,
                                 int splits, int32_t* workspace, int32_t* counters) {
  Params p = qoq::gemm::base_params(x, x_scale, qweight, scale, M, N, Kp, splits, workspace, counters);
  p.x_rowsum = x_rowsum;
  p.zero = zero;
  return p;
}

extern "C" int qoq_w4a8_gemm_per_group_rowsum(int kernel, int tile, int splits, const int8_t* x, const __half* x_scale,
                                              const int32_t* x_rowsum, const uint8_t* qweight, const __half* scale0,
                                              const uint8_t* scale1, const uint8_t* zero_x_scale1, void* out, int out_i32,
                                              int M, int N, int Kp, int group_shift, int32_t* workspace,
                                              int32_t* counters, cudaStream_t stream) {
  Params p = progressive_params(x, x_scale, qweight, scale0, scale1, zero_x_scale1, M, N, Kp, group_shift, splits,
                                workspace, counters);
  p.x_rowsum = x_rowsum;  // may be null: the signed-weight form
  p.out = out;
  p.out_i32 = out_i32;
  return qoq::gemm::launch<Kind::kProgressive>(p, kernel, tile, stream);
}

extern "C" int qoq_w4a8_gemm_per_group(int kernel, int tile, int splits, const int8_t* x, const __half* x_scale,
                                       const uint8_t* qweight, const __half* scale0, const uint8_t* scale1,
                                       const uint8_t* zero_x_scale1, void* out, int out_i32, int M, int N, int Kp,
                                       int group_shift, int32_t* workspace, int32_t* counters,
                                       cudaStream_t stream) {
  return qoq_w4a8_gemm_per_group_rowsum(kernel, tile, splits, x, x_scale, nullptr, qweight, scale0, scale1, zero_x_scale1,
                                        out, out_i32, M, N, Kp, group_shift, workspace, counters, stream);
}

extern "C" int qoq_w4a8_gemm_per_channel(int kernel, int tile, int splits, const int8_t* x, const __half* x_scale,
                                         const int32_t* x_rowsum, const uint8_t* qweight, const __half* scale,
                                         const uint8_t* zero, void* out, int out_i32, int M, int N, int Kp,
                                         int32_t* workspace, int32_t* counters, cudaStream_t stream) {
  Params p = per_channel_params(x, x_scale, x_rowsum, qweight, scale, zero, M, N, Kp, splits, workspace, counters);
  p.out = out;
  p.out_i32 = out_i32;
  return qoq::gemm::launch<Kind::kUInt4Channel>(p, kernel, tile, stream);
}

// The fused sparse-dense entry points: the dense operands as above, plus the Tile-COO section
// (entries [Q, 16] uint8, start and count [ceil(N/32), ceil(Kp/64)] int32), validated by the
// caller (qoqtool.packing.tile_coo.validate). fp16 output only.
static void set_outliers(Params& p, __half* out, const void* tc_entries, const int32_t* tc_start,
                         const int32_t* tc_count, float* sparse_workspace) {
  p.out = out;
  p.tc_entries = static_cast<const uint4*>(tc_entries);
  p.tc_start = tc_start;
  p.tc_count = tc_count;
  p.sparse_workspace = sparse_workspace;
  p.NBk = qoq::ceil_div(p.Kp, qoq::gemm::kBucketK);
}

extern "C" int qoq_w4a8_sparse_dense_gemm_per_group(int kernel, int tile, int splits, const int8_t* x, const __half* x_scale,
                                                    const uint8_t* qweight, const __half* scale0, const uint8_t* scale1,
                                                    const uint8_t* zero_x_scale1, const void* tc_entries,
                                                    const int32_t* tc_start, const int32_t* tc_count, __half* out,
                                                    int M, int N, int Kp, int group_shift, int32_t* workspace,
                                                    float* sparse_workspace, int32_t* counters, cudaStream_t stream) {
  Params p = progressive_params(x, x_scale, qweight, scale0, scale1, zero_x_scale1, M, N, Kp, group_shift, splits,
                                workspace, counters);
  set_outliers(p, out, tc_entries, tc_start, tc_count, sparse_workspace);
  return qoq::gemm::launch_sparse_dense<Kind::kProgressive>(p, kernel, tile, stream);
}

extern "C" int qoq_w4a8_sparse_dense_gemm_per_channel(int kernel, int tile, int splits, const int8_t* x, const __half* x_scale,
                                                      const int32_t* x_rowsum, const uint8_t* qweight,
                                                      const __half* scale, const uint8_t* zero, const void* tc_entries,
                                                      const int32_t* tc_start, const int32_t* tc_count, __half* out,
                                                      int M, int N, int Kp, int32_t* workspace, float* sparse_workspace,
                                                      int32_t* counters, cudaStream_t stream) {
  Params p = per_channel_params(x, x_scale, x_rowsum, qweight, scale, zero, M, N, Kp, splits, workspace, counters);
  set_outliers(p, out, tc_entries, tc_start, tc_count, sparse_workspace);
  return qoq::gemm::launch_sparse_dense<Kind::kUInt4Channel>(p, kernel, tile, stream);
}

// Whether the GEMM kernels (stream, W4A16, wgmma) go out as programmatic dependent launches
// (gemm_kernels.cuh, dependent_launch; benchmarks compare).
extern "C" int qoq_gemm_set_dependent_launch(int enabled) {
  qoq::dependent_launch() = enabled != 0;
  return cudaSuccess;
}

// Whether the stream kernel stages each chunk's activations in shared memory from M = 8 (the
// default) or loads them from global memory (gemm_kernels.cuh, stage_activations; benchmarks compare).
extern "C" int qoq_gemm_set_stage_activations(int enabled) {
  qoq::gemm::stage_activations() = enabled != 0;
  return cudaSuccess;
}

// When the fused sparse-dense kernel stages its activations: 0 never, 1 with 16 tokens per CTA,
// 2 from M = 8 (the default) (gemm_kernels.cuh, fused_staging; benchmarks compare).
extern "C" int qoq_gemm_set_fused_staging(int mode) {
  if (mode < 0 || mode > 2) return cudaErrorInvalidValue;
  qoq::gemm::fused_staging() = static_cast<qoq::gemm::FusedStaging>(mode);
  return cudaSuccess;
}

// Diagnostics: the stream kernels launched from now on write their CTAs' timelines to
// `trace` (gemm_common.cuh, TraceStamp; kTraceWords words per CTA), or nowhere (null).
extern "C" int qoq_gemm_set_trace(void* trace) {
  qoq::gemm::trace_buffer() = static_cast<unsigned long long*>(trace);
  return cudaSuccess;
}
