// Device helpers of the paged KV cache kernels (kv_attention.cu).
//
// Every inline-PTX instruction the attention kernels use lives here, behind a small named
// function, so that the kernel file reads as plain C++ and so that a host emulation of this
// header can run the kernels' logic on a CPU (how kv_attention.cu was debugged before it
// ever ran on a GPU).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace qoq_kv {

__device__ __forceinline__ uint32_t as_u32(half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ half2 as_half2(uint32_t u) { return *reinterpret_cast<half2*>(&u); }

// (a & mask) | bits in one LOP3 (lookup table 0xEA = (A & B) | C).
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t mask, uint32_t bits) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(mask), "r"(bits));
  return r;
}

// Byte permute: result byte i = byte selector.nibble(i) of the 8-byte value {hi, lo}.
__device__ __forceinline__ uint32_t byte_perm(uint32_t lo, uint32_t hi, uint32_t selector) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(selector));
  return r;
}

// Asynchronous 16-byte copy global -> shared (bypassing L1), and its group bookkeeping.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {  // until at most PENDING newest groups are in flight
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING));
}

// D = A * B + C on tensor cores: A 16x16 fp16 (row), B 16x8 fp16 (col), C/D 16x8 fp32.
// Fragment of lane l (g = l / 4, t = l % 4), each a[i]/b[i] holding two consecutive k:
//   a0 = A[g][2t..], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]
//   b0 = B[2t..][g],  b1 = B[2t+8..][g]
//   c0, c1 = C[g][2t], C[g][2t+1];  c2, c3 = C[g+8][2t], C[g+8][2t+1]
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                          const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]),
        "f"(c[3]));
}

// Transpose an 8x8 fp16 matrix held as mma fragments (lane l: row l / 4, columns 2(l % 4), +1)
// into the same fragment layout (lane l then holds column l / 4, rows 2(l % 4), +1).
__device__ __forceinline__ uint32_t transpose_8x8(uint32_t x) {
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}

template <typename T>
__device__ __forceinline__ T* dynamic_smem() {
  extern __shared__ __align__(16) unsigned char qoq_kv_smem[];
  return reinterpret_cast<T*>(qoq_kv_smem);
}

// Launch with `smem` bytes of dynamic shared memory (raising the kernel's 48 KB default once
// when more is asked for).
template <typename... KernelArgs, typename... Args>
inline cudaError_t launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          Args... args) {
  if (smem > 48 * 1024) {  // also ask for the largest shared-memory carveout: several such CTAs per SM
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (err == cudaSuccess)
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid, block, smem, stream>>>(args...);
  return cudaGetLastError();
}

}  // namespace qoq_kv
