// Generic device helpers shared by the qoqtool kernels: loads with cache hints, cp.async,
// ldmatrix, the INT8 tensor-core instructions (mma.sync and Hopper wgmma), and the error
// convention of the C entry points. Nothing here knows a weight format.
//
// Entry points are `extern "C" int qoq_<name>(..., cudaStream_t)` returning a cudaError_t;
// Python (qoqtool.runtime.cuda_ops) validates every argument before it calls one, so the
// checks here only guard against programming errors, never against user input.
#pragma once

#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <utility>

// Return the launch error (or any earlier sticky error) of the kernel just launched.
#define QOQ_RETURN_LAUNCH_STATUS() return static_cast<int>(cudaGetLastError())
#define QOQ_RETURN_IF_ERROR(expr)                      \
  do {                                                 \
    cudaError_t qoq_status_ = (expr);                  \
    if (qoq_status_ != cudaSuccess) return qoq_status_; \
  } while (0)

// The wgmma paths exist only in the sm_90a pass of the build (kernels/build.py).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QOQ_HAS_WGMMA 1
#else
#define QOQ_HAS_WGMMA 0
#endif

namespace qoq {

// The compute capability major of the current device, queried once per device (launchers ask
// on every launch; the attribute query is a driver call).
inline cudaError_t current_device_major(int* major) {
  static int known[64] = {};  // 0: not asked yet
  int device = 0;
  QOQ_RETURN_IF_ERROR(cudaGetDevice(&device));
  if (device >= 64) return cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, device);
  if (known[device] == 0) QOQ_RETURN_IF_ERROR(cudaDeviceGetAttribute(&known[device], cudaDevAttrComputeCapabilityMajor, device));
  *major = known[device];
  return cudaSuccess;
}

// Launches kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent launch
// when `pdl` is set and the device is a Hopper (the kernel must call pdl_wait before it reads
// what earlier kernels write, and before it writes anything), in clusters of `cluster_z` CTAs
// along z when that is more than 1 (Hopper only).
template <class... KArgs, class... Args>
cudaError_t launch_in_clusters_maybe_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                         bool pdl, unsigned cluster_z, Args&&... args) {
  int major = 0;
  if (pdl) QOQ_RETURN_IF_ERROR(current_device_major(&major));
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl && major >= 9;
  attr[1].id = cudaLaunchAttributeClusterDimension;
  attr[1].val.clusterDim.x = 1;
  attr[1].val.clusterDim.y = 1;
  attr[1].val.clusterDim.z = cluster_z;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = cluster_z > 1 ? 2 : 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}
template <class... KArgs, class... Args>
cudaError_t launch_maybe_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
                             Args&&... args) {
  return launch_in_clusters_maybe_pdl(kernel, grid, block, smem, stream, pdl, 1, std::forward<Args>(args)...);
}

// Whether the GEMM kernels (stream, W4A16, wgmma) go out as programmatic dependent launches
// (on by default; qoq_gemm_set_dependent_launch): their CTAs start while the previous kernel
// of the stream finishes - the stream kernel also loads its first chunk of weights then.
// Measured on the H200 (benchmarks/gemm.py --explore-stream): -1.6 to -2.4 us per stream
// GEMM at M = 1 and 16 on the benchmark shapes.
inline bool& dependent_launch() {
  static bool enabled = true;
  return enabled;
}

// The same for the small kernels between the GEMMs (fused_ops.cu's row kernels, qk_rope.cu),
// which read what does not depend on the kernel before them (norm weights, the key rotation)
// before they wait for it. Off by default (qoq_fused_set_dependent_launch): in decode steps on
// an H100 (benchmarks/decode.py --fused-pdl, 2026-12-07) it gained 3% at batch 1 and lost 3-4% at
// batch 16 and 11-12% at batch 64.
inline bool& fused_dependent_launch() {
  static bool enabled = false;
  return enabled;
}

constexpr int kWarp = 32;

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------------------
// Global loads
// ---------------------------------------------------------------------------------------

// 16 bytes that are read exactly once (streamed weights): keep them out of L1, and ask L2
// to fetch the whole 256-byte line, since the neighbouring lanes want the rest of it.
__device__ __forceinline__ uint4 ldg_stream_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// 4 read-only bytes that other warps of the block read too (activations, group params).
__device__ __forceinline__ uint32_t ldg_u32(const void* p) {
  return __ldg(reinterpret_cast<const unsigned int*>(p));
}

// The same, issued exactly where it is written: a prefetch that the compiler must neither
// sink to its first use nor move past a wait (volatile asm keeps its place among the others).
__device__ __forceinline__ uint32_t ldg_u32_now(const void* p) {
  uint32_t v;
  asm volatile("ld.global.nc.u32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}

// ---------------------------------------------------------------------------------------
// Shared memory
// ---------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint4 lds_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

__device__ __forceinline__ uint2 lds_v2(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}

__device__ __forceinline__ uint32_t lds_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}

// cp.async of 16 bytes, global -> shared, bypassing L1. With `valid` false nothing is read
// and the 16 bytes are zero-filled (src-size 0), so rows past the end need no branch.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// The same through L1 (.ca): for bytes other warps of the CTA copy too (activations).
__device__ __forceinline__ void cp_async_16_ca(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// 4 bytes through L1 (.ca; cp.async copies 4 or 8 bytes only through L1).
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Every cp.async of this thread has landed; a compiler barrier too, so that plain loads of
// the copied bytes are not moved above it.
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
// At most the N newest groups of this thread are still in flight (a compiler barrier too).
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ldmatrix: four (or two) 8x8 b16 matrices; lane l gives the row address of matrix l/8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// Writes by the generic proxy (st.shared, cp.async) must be fenced before the async proxy
// (wgmma operand reads, TMA) may read them; each writing thread fences, then a barrier.
__device__ __forceinline__ void fence_proxy_async_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// ---------------------------------------------------------------------------------------
// mbarriers and the tensor memory accelerator (TMA, sm_90)
// ---------------------------------------------------------------------------------------
//
// A TMA copy writes shared memory through the async proxy and completes on an mbarrier
// by transaction bytes: the thread that issues it announces the bytes (arrive.expect_tx),
// consumers wait for the barrier's phase. wgmma reads shared memory through the same
// proxy, so data that arrived by TMA needs no proxy fence (cp.async data would: its fence,
// MEMBAR.ALL.CTA in SASS, also waits for every later cp.async still in flight).

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
// Make initialised barriers visible to the async proxy (and the other threads, after a barrier).
__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Wait until the phase of parity `parity` has completed (phases count from 0).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}
// 1-D bulk copy (TMA without a tensor map): `bytes` contiguous bytes global -> shared,
// completing on `bar` as transaction bytes. dst, src and bytes must be multiples of 16.
__device__ __forceinline__ void bulk_copy_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
// The same with an L2 cache policy (l2_evict_first_policy: bytes read once should not push
// the reused ones, activations and the other operands, out of L2).
__device__ __forceinline__ void bulk_copy_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                              uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(policy)
      : "memory");
}
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
// TMA tile loads: box at the given element coordinates (innermost first) of the tensor
// map `map` (a __grid_constant__ kernel parameter) into shared memory at `dst`.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* map, int c0, int c1, int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
#endif

// The GPU-wide nanosecond timer and this thread's multiprocessor (diagnostic timelines).
__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned sm_id() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;\n" : "=r"(id));
  return id;
}

// Programmatic dependent launch (sm_90; no-ops elsewhere). A kernel launched with
// launch_maybe_pdl may start while the previous kernel in its stream still runs, once that
// one has called pdl_launch_dependents (or finished): everything before pdl_wait must touch
// only data no earlier kernel writes (weights, their parameters); pdl_wait returns when
// the previous grids have completed and their memory is visible.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Thread block clusters (sm_90): a CTA's rank in its cluster and the cluster's size, another
// CTA's shared memory (distributed shared memory: the address of `addr` in rank `rank`'s
// window, then read with ld.shared::cluster), and the cluster-wide barrier, whose arrive
// releases and whose wait acquires this CTA's and the others' shared-memory writes. A CTA
// must not exit while another may still read its shared memory. (The remote read is volatile
// so that it stays after the barrier, which is volatile too, but has no memory clobber, so
// that a block of them can be issued before their first use.)
__device__ __forceinline__ uint32_t cluster_size() {
  uint32_t n = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(n));
#endif
  return n;
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
#endif
  return r;
}
// Not .aligned: the threads of a warp may arrive from different branches.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}
__device__ __forceinline__ int4 ld_shared_remote_v4(uint32_t addr, uint32_t rank) {
  int4 v = make_int4(0, 0, 0, 0);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.v4.s32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(remote));
#endif
  return v;
}

// ---------------------------------------------------------------------------------------
// INT8 tensor cores
// ---------------------------------------------------------------------------------------

// D += A (16x32 s8, row) * B (32x8 s8, col), s32 accumulate. Fragments as in the PTX ISA:
// lane = 4*g + t; a0 (row g, k 4t..4t+3), a1 (row g+8, same k), a2/a3 the same rows at
// k 16+4t..; b0 (k 4t.., col g), b1 (k 16+4t.., col g); c0,c1 (row g, cols 2t, 2t+1),
// c2,c3 (row g+8, cols 2t, 2t+1).
__device__ __forceinline__ void mma_s8_16832(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// D += A (16x16 f16, row) * B (16x8 f16, col), f32 accumulate: a0 (row g, k 2t, 2t+1), a1 (row
// g+8), a2/a3 the same rows at k 2t+8, 2t+9; b0 (k 2t, 2t+1, col g), b1 (k 2t+8, 2t+9); C as above.
__device__ __forceinline__ void mma_f16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#if QOQ_HAS_WGMMA
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Shared-memory matrix descriptor of a K-major operand in the canonical 128-byte swizzle:
// rows of 128 bytes, 8-row atoms of 1024 bytes (the stride between 8-row groups), the
// 16-byte chunk c of row r stored at chunk c ^ (r % 8). The atom must be 1024-aligned;
// stepping K inside the 128-byte row is adding the byte offset to the start address.
__device__ __forceinline__ uint64_t wgmma_desc_k128b(uint32_t smem_addr) {
  uint64_t desc = (smem_addr & 0x3FFFF) >> 4;  // start address, 16-byte units
  desc |= uint64_t(1) << 16;                    // leading byte offset: unused for swizzled K-major
  desc |= uint64_t(1024 >> 4) << 32;            // stride byte offset: 8 rows x 128 bytes
  desc |= uint64_t(1) << 62;                    // layout: 128-byte swizzle
  return desc;
}

// D (64 x 128, s32) += A (64 x 32 s8, or u8 with A_U8, registers) * B (32 x 128 s8, K-major in
// shared memory). Warp w of the warpgroup holds rows 16w..16w+15 of A in the mma.m16n8k32 A
// fragment, and d[i] = D[16w + g + 8*((i>>1)&1)][8*(i>>2) + 2t + (i&1)].
#define QOQ_WGMMA_N128_RS(ATYPE)                                                                                     \
  asm volatile(                                                                                                     \
      "{\n"                                                                                                         \
      "wgmma.mma_async.sync.aligned.m64n128k32.s32." ATYPE ".s8 "                                                    \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                      \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                             \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                             \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "                            \
      "{%64, %65, %66, %67}, %68, 1;\n"                                                                             \
      "}\n"                                                                                                         \
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),              \
        "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),        \
        "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),      \
        "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]),      \
        "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]),      \
        "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]),      \
        "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]),      \
        "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])       \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b))
template <bool A_U8 = false>
__device__ __forceinline__ void wgmma_m64n128k32_rs(int (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (A_U8) QOQ_WGMMA_N128_RS("u8");
  else QOQ_WGMMA_N128_RS("s8");
}
#undef QOQ_WGMMA_N128_RS

// The same with 64 columns (d[i] as above, i < 32).
#define QOQ_WGMMA_N64_RS(ATYPE)                                                                                      \
  asm volatile(                                                                                                     \
      "{\n"                                                                                                         \
      "wgmma.mma_async.sync.aligned.m64n64k32.s32." ATYPE ".s8 "                                                     \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                      \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "                             \
      "{%32, %33, %34, %35}, %36, 1;\n"                                                                             \
      "}\n"                                                                                                         \
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),              \
        "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),        \
        "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),      \
        "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])       \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b))
template <bool A_U8 = false>
__device__ __forceinline__ void wgmma_m64n64k32_rs(int (&d)[32], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (A_U8) QOQ_WGMMA_N64_RS("u8");
  else QOQ_WGMMA_N64_RS("s8");
}
#undef QOQ_WGMMA_N64_RS

// m64 x N x k32 for N = 128 or 64 (d holds N / 2 accumulators), as above.
template <bool A_U8, int N>
__device__ __forceinline__ void wgmma_m64nNk32_rs(int (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (N == 128) wgmma_m64n128k32_rs<A_U8>(d, a, desc_b);
  else wgmma_m64n64k32_rs<A_U8>(d, a, desc_b);
}
#endif  // QOQ_HAS_WGMMA

// ---------------------------------------------------------------------------------------
// Block reductions (blockDim.x a multiple of 32, at most 1024 threads)
// ---------------------------------------------------------------------------------------

template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Every thread gets the result; `identity` pads the lanes past the last warp. `scratch`
// holds 32 values and may be reused after return.
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, Op op, T identity, T* scratch) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  v = warp_reduce(v, op);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : identity;
  return warp_reduce(v, op);
}

}  // namespace qoq
