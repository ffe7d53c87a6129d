// The read ceiling of a small-M GEMM on one H200: how fast any kernel can read a weight
// matrix's bytes once, back to back in a CUDA graph, with nothing else to do. At M <= 16 the
// W4A8 stream kernel (kernels/gemm_stream.cuh) reads the same bytes plus a few kilobytes of
// activations, so the best period here bounds that kernel's, and bf16 time / this period
// bounds the ratio against cuBLAS that any W4 kernel can show there.
// Built and driven by benchmarks/read_ceiling.py (a plain C entry point through ctypes).
//
// Two ways to read, each CTA taking its blocks of the matrix either as one contiguous slice
// (as the stream kernel's warps take their chunks) or interleaved with the other CTAs':
//   loads:  every thread keeps `depth` 16-byte streaming loads in flight (the stream kernel's
//           ldg_stream_v4) and xors them into a word that is stored only if it matches a
//           constant, so the loads stay and nothing is written;
//   bulk:   one thread streams the blocks through a ring of `depth` shared-memory slots with
//           cp.async.bulk (the copy engine; no registers), reusing a slot once its mbarrier
//           says the bytes have landed.
// The dependent-launch modes model what a GEMM may do before `griddepcontrol.wait`:
//   0  no dependent launch: a CTA starts after the previous kernel has finished;
//   1  dependent launch, wait first: CTAs may be resident early but read only after the wait
//      (a kernel that loads nothing before its activations);
//   2  dependent launch, wait last: every byte may be read while the previous kernel still
//      runs, only the (never taken) store waits (weights need no wait; the stream kernel
//      loads its first chunk so).
// `smem` (loads) asks for dynamic shared memory only to limit how many CTAs share an SM (the
// stream kernel's 16-warp CTAs take one SM each), so that the next call's CTAs cannot start
// early.

#include "../kernels/common.cuh"

using namespace qoq;

// Block b of this CTA (of `blocks` in all, `per` per CTA when contiguous), or -1 past the end.
__device__ __forceinline__ long long my_block(long long b, long long blocks, bool interleave) {
  const long long per = (blocks + gridDim.x - 1) / gridDim.x;
  if (b >= per) return -1;
  const long long at = interleave ? blockIdx.x + b * gridDim.x : blockIdx.x * per + b;
  return at < blocks ? at : -1;
}

template <int DEPTH>
__global__ void __launch_bounds__(1024) read_by_loads(const uint4* __restrict__ w, long long n16, int* sink, int wait_mode,
                                                      bool interleave) {
  if (wait_mode != 0) pdl_launch_dependents();
  if (wait_mode == 1) pdl_wait();
  const long long block = static_cast<long long>(blockDim.x) * DEPTH;  // 16-byte words per block: one load per thread and slot
  const long long blocks = (n16 + block - 1) / block;
  uint32_t acc = 0;
  for (long long b = 0;; ++b) {
    const long long at = my_block(b, blocks, interleave);
    if (at < 0) break;
    uint4 v[DEPTH];
#pragma unroll
    for (int u = 0; u < DEPTH; ++u) {
      const long long i = at * block + static_cast<long long>(u) * blockDim.x + threadIdx.x;
      v[u] = i < n16 ? ldg_stream_v4(w + i) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < DEPTH; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (wait_mode == 2) pdl_wait();
  if (acc == 0x9E3779B9u) sink[blockIdx.x] = static_cast<int>(acc);  // (all but never) keeps the loads
}

__global__ void __launch_bounds__(32) read_by_bulk_copies(const uint8_t* __restrict__ w, long long bytes, int block_bytes,
                                                          int depth, int* sink, int wait_mode, bool interleave) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) uint8_t ring[];
  __shared__ __align__(8) uint64_t bars[16];
  if (wait_mode != 0) pdl_launch_dependents();
  if (threadIdx.x != 0) return;
  for (int s = 0; s < depth; ++s) mbar_init(smem_u32(&bars[s]), 1);
  mbar_fence_init();
  if (wait_mode == 1) pdl_wait();
  const long long blocks = (bytes + block_bytes - 1) / block_bytes;
  auto issue = [&](long long b) {  // block b of this CTA into slot b % depth; false past the end
    const long long at = my_block(b, blocks, interleave);
    if (at < 0) return false;
    const uint32_t n = static_cast<uint32_t>(min(static_cast<long long>(block_bytes), bytes - at * block_bytes));
    const uint32_t bar = smem_u32(&bars[b % depth]);
    mbar_arrive_expect_tx(bar, n);
    bulk_copy_g2s(smem_u32(ring) + (b % depth) * block_bytes, w + at * block_bytes, n, bar);
    return true;
  };
  long long issued = 0;
  while (issued < depth && issue(issued)) ++issued;
  for (long long b = 0; b < issued; ++b) {
    mbar_wait(smem_u32(&bars[b % depth]), (b / depth) & 1);
    if (issued == b + depth && issue(issued)) ++issued;  // the slot just emptied takes the next block
  }
  if (wait_mode == 2) pdl_wait();
  if (bytes < 0) sink[blockIdx.x] = 0;  // (never) the kernel's one store, after the wait as a GEMM's output
#endif
}

template <int DEPTH>
static cudaError_t launch_loads(const void* w, long long bytes, int* sink, int ctas, int threads, int wait_mode, bool interleave,
                                int smem, cudaStream_t stream) {
  QOQ_RETURN_IF_ERROR(cudaFuncSetAttribute(read_by_loads<DEPTH>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  return launch_maybe_pdl(read_by_loads<DEPTH>, dim3(ctas), dim3(threads), smem, stream, wait_mode != 0,
                          static_cast<const uint4*>(w), bytes / 16, sink, wait_mode, interleave);
}

// method 0: loads (threads per CTA, depth = loads in flight per thread: 4, 8 or 16; smem only
// to limit CTAs per SM); method 1: bulk copies (depth slots of block_bytes each, <= 16 slots).
extern "C" int qoq_read_once(const void* w, long long bytes, int* sink, int method, int ctas, int threads, int depth,
                             int block_bytes, int interleave, int wait_mode, int smem, cudaStream_t stream) {
  if (bytes % 16 != 0 || wait_mode < 0 || wait_mode > 2) return cudaErrorInvalidValue;
  if (method == 1) {
    if (depth < 1 || depth > 16 || block_bytes % 16 != 0) return cudaErrorInvalidValue;
    const int ring = depth * block_bytes;
    QOQ_RETURN_IF_ERROR(cudaFuncSetAttribute(read_by_bulk_copies, cudaFuncAttributeMaxDynamicSharedMemorySize, ring));
    return launch_maybe_pdl(read_by_bulk_copies, dim3(ctas), dim3(32), ring, stream, wait_mode != 0,
                            static_cast<const uint8_t*>(w), bytes, block_bytes, depth, sink, wait_mode, interleave != 0);
  }
  if (threads % 32 != 0 || threads > 1024) return cudaErrorInvalidValue;
  switch (depth) {
    case 4: return launch_loads<4>(w, bytes, sink, ctas, threads, wait_mode, interleave != 0, smem, stream);
    case 8: return launch_loads<8>(w, bytes, sink, ctas, threads, wait_mode, interleave != 0, smem, stream);
    case 16: return launch_loads<16>(w, bytes, sink, ctas, threads, wait_mode, interleave != 0, smem, stream);
    default: return cudaErrorInvalidValue;
  }
}
