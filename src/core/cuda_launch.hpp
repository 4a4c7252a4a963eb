// Launch helpers and small device functions shared by the native CUDA kernels (CUDA builds only; empty otherwise):
// kernels run on Kokkos' default execution space stream, so they order with the Kokkos kernels around them, each under a profiling
// region named like the Kokkos kernels' labels, and a failed launch is an error naming the kernel.
#pragma once

#include <Kokkos_Core.hpp>

#if defined(KOKKOS_ENABLE_CUDA)
#include <Kokkos_Profiling_ScopedRegion.hpp>
#include <cuda_bf16.h>
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <utility>

#include "core/error.hpp"
#include "core/kokkos_types.hpp"

namespace mm::cuda_k {

using mm::aligned16;
using mm::float4_rows;

// Eight bf16 in 16 bytes and eight floats: unpack8 widens them, pack8 rounds (nearest even) and packs.
__device__ __forceinline__ void unpack8(const uint4& q, float* f) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&q);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(p[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}
__device__ __forceinline__ uint4 pack8(const float* f) {
  uint4 q;
  __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&q);
#pragma unroll
  for (int i = 0; i < 4; ++i) p[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return q;
}
// Four floats rounded to bf16 (nearest even) in 8 bytes, x in the lowest.
__device__ __forceinline__ uint2 pack4(const float4& v) {
  uint2 q;
  __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&q);
  p[0] = __floats2bfloat162_rn(v.x, v.y);
  p[1] = __floats2bfloat162_rn(v.z, v.w);
  return q;
}

// Device math shared by the kernels: the logistic function from the exp unit with a fast reciprocal, and a warp's
// sum by a fixed butterfly (every lane gets the same, deterministic, total).
__device__ __forceinline__ float sigm(float u) { return __fdividef(1.f, 1.f + __expf(-u)); }
// 2^x by the exp unit (one MUFU.EX2; results below the normal range flush to zero): exp(d) as 2^(d log2 e), with
// log2 e folded into a per-token or per-channel factor instead of a multiply per element.
constexpr float kLog2e = 1.4426950408889634f;
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Asynchronous copy of BYTES (8 or 16) from global to shared memory (cp.async; .cg, bypassing L1, for 16 bytes);
// src_bytes 0 fills the destination with zeros (rows past a sequence's end). cp_async_commit closes a group;
// cp_async_wait<G>() waits until at most G groups are in flight (G = 0: all of this thread's copies landed).
// L2_PREFETCH (16 bytes only: 0, 128 or 256): the L2 hint to fetch the whole aligned 128 or 256 bytes around the
// source from DRAM at once (for a row whose other parts a later copy reads).
template <int BYTES, int L2_PREFETCH = 0>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem, int src_bytes) {
  static_assert(BYTES == 8 || BYTES == 16);
  static_assert(L2_PREFETCH == 0 || (BYTES == 16 && (L2_PREFETCH == 128 || L2_PREFETCH == 256)));
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (BYTES == 16 && L2_PREFETCH == 256)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
  else if constexpr (BYTES == 16 && L2_PREFETCH == 128)
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
  else if constexpr (BYTES == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int G>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(G));
}

// kernel(args...) on a grid of blocks, on Kokkos' stream, under the profiling region `name`.
template <class... P, class... A>
void launch_grid(const char* name, dim3 grid, dim3 block, void (*kernel)(P...), const A&... args) {
  Kokkos::Profiling::ScopedRegion region(name);
  kernel<<<grid, block, 0, Kokkos::DefaultExecutionSpace().cuda_stream()>>>(args...);
  const cudaError_t e = cudaGetLastError();
  require(e == cudaSuccess, name, "the kernel failed to launch: ", cudaGetErrorString(e));
}

// kernel(args...) over `items` work items (256 threads a block, grid-stride loops past 132 x 32 blocks).
template <class... P, class... A>
void launch(const char* name, long long items, void (*kernel)(P...), const A&... args) {
  const long long blocks = std::clamp((items + 255) / 256, 1LL, 132LL * 32);
  launch_grid(name, dim3(unsigned(blocks)), dim3(256), kernel, args...);
}

// The device's SM count (one device per process, i.e. per rank).
inline int sm_count() {
  static const int sms = [] {
    int dev = 0, n = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return std::max(1, n);
  }();
  return sms;
}

// How many blocks of `block` threads of `kernel` the device holds at once (all SMs): a grid of that many blocks
// runs in one wave.
template <class... P>
int resident_blocks(void (*kernel)(P...), int block) {
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, block, 0);
  return std::max(1, sm_count() * per_sm);
}

// out[i] += sum_b part[b, i] over b < nb, b in order (blocks of 32 x 8 threads: row y sums b = y, y + 8, ...,
// then the 8 sums in order): the deterministic second stage of a reduction whose first stage wrote one row of
// partials per block or warp.
template <class R>
__global__ void __launch_bounds__(256) sum_partials(const R* __restrict__ part, int nb, long long q,
                                                    R* __restrict__ out) {
  __shared__ R sh[8][33];
  const long long i = blockIdx.x * 32LL + threadIdx.x;
  R s = R(0);
  if (i < q)
    for (int b = threadIdx.y; b < nb; b += 8) s += part[b * q + i];
  sh[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && i < q) {
    R t = out[i];
#pragma unroll
    for (int y = 0; y < 8; ++y) t += sh[y][threadIdx.x];
    out[i] = t;
  }
}

template <class R>
void add_partials(const char* name, const R* part, long long nb, long long q, R* out) {
  launch_grid(name, dim3(unsigned((q + 31) / 32)), dim3(32, 8), sum_partials<R>, part, int(nb), q, out);
}

}  // namespace mm::cuda_k
#endif
