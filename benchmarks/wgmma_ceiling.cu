// The INT8 wgmma issue ceiling on one H200 multiprocessor: how many cycles one
// wgmma.m64nNk32.s32.s8.s8 with A from registers (the form the W4A8 kernel uses) takes when a
// warpgroup does nothing else, for N = 64 / 128 tokens, 1 or 2 independent accumulators per
// warpgroup and 1 or 2 warpgroups per multiprocessor. What the main loop of the wgmma kernel
// (kernels/gemm_wgmma.cuh) can reach at best with this instruction; no memory traffic.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a benchmarks/wgmma_ceiling.cu -o wgmma_ceiling
//   ./wgmma_ceiling          (one CTA per multiprocessor, 132 CTAs; clock64 inside the kernel)

#include <cstdio>

#include "../kernels/common.cuh"

using namespace qoq;

// Each warpgroup: `stages` x (4 k-steps x (fence, CHAINS wgmmas, commit)), then wait<4>, as the
// kernel's stage loop; B is a zeroed 128-byte-swizzled tile in shared memory. DEQUANT: each
// k-step first rebuilds the A registers of both chains from a changing 16-byte word with the
// kernel's progressive dequantization (byte selects, multiply-add, xor), as the real loop does
// after its shared-memory load.
template <int N, int CHAINS, bool DEQUANT = false>
__global__ void __launch_bounds__(256, 1) wgmma_loop(int stages, unsigned long long* cycles, int* sink) {
#if QOQ_HAS_WGMMA
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023) & ~1023u;
  for (int i = threadIdx.x; i < N * 128 / 4; i += blockDim.x) reinterpret_cast<int*>(smem_raw + (base - smem_u32(smem_raw)))[i] = 0;
  __syncthreads();
  int acc[CHAINS][N / 2];
#pragma unroll
  for (int c = 0; c < CHAINS; ++c)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) acc[c][i] = 0;
  uint32_t a[2][4] = {{threadIdx.x, threadIdx.x * 3u, 7u, 9u}, {threadIdx.x, 5u, 7u, 9u}};
  const uint32_t s1_word = 0x05040302u ^ threadIdx.x, zs1_word = 0x20181008u;
  const unsigned long long t0 = clock64();
  for (int s = 0; s < stages; ++s) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      if constexpr (DEQUANT) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint32_t word = threadIdx.x * 0x01010101u + 0x11u * (4 * s + kk) + i;
          const uint32_t s1 = __byte_perm(s1_word, 0, 0x4440 | i);
          const uint32_t c = 0x80808080u - __byte_perm(zs1_word, 0, 0x1111 * i);
          a[i >> 1][i & 1] = ((word & 0x0F0F0F0Fu) * s1 + c) ^ 0x80808080u;
          a[i >> 1][2 + (i & 1)] = (((word >> 4) & 0x0F0F0F0Fu) * s1 + c) ^ 0x80808080u;
        }
      }
      wgmma_fence();
      const uint64_t desc = wgmma_desc_k128b(base + 32 * kk);
#pragma unroll
      for (int c = 0; c < CHAINS; ++c) {
        if constexpr (N == 128) wgmma_m64n128k32_rs(acc[c], a[c % 2], desc);
        else wgmma_m64n64k32_rs(acc[c], a[c % 2], desc);
      }
      wgmma_commit();
    }
    wgmma_wait<4>();
  }
  wgmma_wait<0>();
  const unsigned long long t1 = clock64();
  if (threadIdx.x % 128 == 0) cycles[blockIdx.x * 2 + threadIdx.x / 128] = t1 - t0;
  int sum = 0;
#pragma unroll
  for (int c = 0; c < CHAINS; ++c)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) sum += acc[c][i];
  if (sum == 0x12345678) *sink = sum;  // keeps the accumulators alive
#endif
}

template <int N, int CHAINS, bool DEQUANT = false>
void run(int warpgroups) {
  constexpr int kStages = 2048, kCtas = 132;
  unsigned long long* cycles;
  int* sink;
  cudaMalloc(&cycles, kCtas * 2 * sizeof(unsigned long long));
  cudaMalloc(&sink, sizeof(int));
  const int smem = N * 128 + 1024;
  cudaFuncSetAttribute(wgmma_loop<N, CHAINS, DEQUANT>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  for (int rep = 0; rep < 2; ++rep) wgmma_loop<N, CHAINS, DEQUANT><<<kCtas, 128 * warpgroups, smem>>>(kStages, cycles, sink);
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    std::printf("error: %s\n", cudaGetErrorString(err));
    return;
  }
  unsigned long long host[kCtas * 2] = {};
  cudaMemcpy(host, cycles, sizeof(host), cudaMemcpyDeviceToHost);
  double worst = 0;
  for (int b = 0; b < kCtas; ++b)
    for (int w = 0; w < warpgroups; ++w) worst = host[2 * b + w] > worst ? host[2 * b + w] : worst;
  const double per_sm = worst / (kStages * 4.0 * CHAINS * warpgroups);  // cycles per wgmma, whole SM
  const double macs = 64.0 * N * 32;
  std::printf("m64n%dk32 RS, %d accumulator(s) per warpgroup, %d warpgroup(s) per SM%s: %6.1f cycles per wgmma per SM, "
              "%6.0f int8 MAC per cycle per SM\n",
              N, CHAINS, warpgroups, DEQUANT ? ", dequantizing A" : "", per_sm, macs / per_sm);
  cudaFree(cycles);
  cudaFree(sink);
}

int main() {
  for (int wgs = 1; wgs <= 2; ++wgs) {
    run<128, 1>(wgs);
    run<128, 2>(wgs);
    run<128, 2, true>(wgs);
    run<64, 2>(wgs);
  }
  return 0;
}
