#include "ssm/mamba1/scan_cuda.hpp"

#include <Kokkos_Core.hpp>
#include <Kokkos_Profiling_ScopedRegion.hpp>

#include "core/error.hpp"
#include "core/kokkos_types.hpp"  // softplus, silu

namespace mm::mamba1_cuda {

bool shape_fits(index_t E, index_t N, index_t cpg) {
  return (N == 8 || N == 16) && E % kChannels == 0 && cpg % kChannels == 0;
}

#if defined(KOKKOS_ENABLE_CUDA)
bool compiled() { return true; }

namespace {

constexpr int kTile = 32;    // tokens per shared-memory stage
constexpr int kStages = 3;   // stages in flight (two tiles load while one is computed)

// Shared-memory floats of one stage: u, delta and z for the block's channels, then B and C (N each) per token.
__host__ __device__ constexpr int stage_floats(int N) { return kTile * (3 * int(kChannels) + 2 * N); }

__device__ __forceinline__ void cp_async16(float* smem, const float* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_stages() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2));
}
// 2^x for x <= 0 (the decays): one MUFU.EX2, flushing results below the normal range to zero.
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Issues the asynchronous copies of the tile starting at token t0 into stage `s` (rows past L are left as they
// are; the compute never reads them).
template <int N>
__device__ void load_tile(const FwdArgs& a, float* s, index_t b, index_t t0, index_t d0, index_t g) {
  constexpr int C = int(kChannels), per_row = 3 * C / 4 + 2 * N / 4;  // 16-byte pieces per token
  float* su = s;
  float* sd = su + kTile * C;
  float* sz = sd + kTile * C;
  float* sB = sz + kTile * C;
  float* sC = sB + kTile * N;
  const int rows = int(a.L - t0 < kTile ? a.L - t0 : kTile);
  for (int i = threadIdx.x; i < rows * per_row; i += blockDim.x) {
    const int r = i / per_row, k = i % per_row;
    const index_t row = b * a.L + t0 + r;
    if (k < C / 4) {
      cp_async16(su + r * C + 4 * k, a.u + row * a.ld_u + d0 + 4 * k);
    } else if (k < C / 2) {
      const int j = k - C / 4;
      cp_async16(sd + r * C + 4 * j, a.delta + row * a.ld_delta + d0 + 4 * j);
    } else if (k < 3 * C / 4) {
      const int j = k - C / 2;
      if (a.z) cp_async16(sz + r * C + 4 * j, a.z + row * a.ld_z + d0 + 4 * j);
    } else if (k < 3 * C / 4 + N / 4) {
      const int j = k - 3 * C / 4;
      cp_async16(sB + r * N + 4 * j, a.B + row * a.ld_bc + g * N + 4 * j);
    } else {
      const int j = k - 3 * C / 4 - N / 4;
      cp_async16(sC + r * N + 4 * j, a.C + row * a.ld_bc + g * N + 4 * j);
    }
  }
}

// Shared memory beside the stages: Delta and Delta u per (token, channel), the record starts per token, and the
// per-lane partial outputs per (token, channel, lane of the channel).
template <int N>
__host__ __device__ constexpr int extra_floats() {
  return 2 * kTile * int(kChannels) + kTile + kTile * int(kChannels) * (N / 4);
}

// One block per (16 channels, batch row), LPC = N / 4 lanes per channel, 4 states each. Per tile, three phases
// separated by barriers, so that the sequential part does nothing but the recurrence:
//   1. every thread: softplus and Delta u for (token, channel) elements, the record starts per token;
//   2. each lane: its 4 states through the tile's tokens (one exp2 per state and token), the partial y per token;
//   3. every thread: the partials summed per (token, channel), D skip, z gate, the store.
template <int N>
__global__ void __launch_bounds__(int(kChannels) * N / 4) forward_kernel(const FwdArgs a) {
  constexpr int LPC = N / 4, C = int(kChannels), NT = C * LPC;
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  float* sdl = smem + kStages * stage_floats(N);  // (kTile, C)
  float* sdu = sdl + kTile * C;                    // (kTile, C)
  float* srs = sdu + kTile * C;                    // (kTile): 1 where a record starts at the token
  float* spart = srs + kTile;                      // (kTile, C, LPC)
  const index_t b = blockIdx.y, d0 = index_t(blockIdx.x) * C, g = d0 / a.cpg;
  const int tid = threadIdx.x, q = tid % LPC;
  const int c = tid / LPC;  // the block's channel of this lane in phase 2
  const int ce = tid % C;   // the channel of this thread's elements in phases 1 and 3 (NT is a multiple of C)
  const index_t d = d0 + c, bd = b * a.E + d;
  constexpr float kLog2e = 1.4426950408889634f;

  float h[4], a2[4];
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    a2[s] = a.A[d * N + 4 * q + s] * kLog2e;
    h[s] = a.init ? a.init[bd * N + 4 * q + s] : 0.f;
  }
  const float De = a.D[d0 + ce], biase = a.bias[d0 + ce];
  const index_t ntiles = (a.L + kTile - 1) / kTile, BE = a.batch * a.E;
  const std::int32_t* seq = a.seq ? a.seq + b * a.ld_seq : nullptr;
  index_t next_ck = 0;  // the next chunk start, where the state entering it is saved

#pragma unroll
  for (int k = 0; k < kStages - 1; ++k) {
    if (k < ntiles) load_tile<N>(a, smem + k * stage_floats(N), b, k * kTile, d0, g);
    cp_async_commit();
  }
  for (index_t tile = 0; tile < ntiles; ++tile) {
    cp_async_wait_stages();
    __syncthreads();  // the tile has landed for every thread; the stage loaded below is no longer read
    {
      const index_t nt = tile + kStages - 1;
      if (nt < ntiles) load_tile<N>(a, smem + (nt % kStages) * stage_floats(N), b, nt * kTile, d0, g);
      cp_async_commit();
    }
    const float* su = smem + (tile % kStages) * stage_floats(N);
    const float* sd = su + kTile * C;
    const float* sz = sd + kTile * C;
    const float* sB = sz + kTile * C;
    const float* sC = sB + kTile * N;
    const index_t t0 = tile * kTile;
    const int rows = int(a.L - t0 < kTile ? a.L - t0 : kTile);

    // phase 1
    for (int e = tid; e < rows * C; e += NT) {
      const float dl = softplus(sd[e] + biase);
      sdl[e] = dl;
      sdu[e] = dl * su[e];
    }
    if (seq)
      for (int t = tid; t < rows; t += NT) srs[t] = (t0 + t > 0 && seq[t0 + t] != seq[t0 + t - 1]) ? 1.f : 0.f;
    __syncthreads();

    // phase 2
    int ck = next_ck - t0 < kTile ? int(next_ck - t0) : kTile;  // the tile's next chunk start
#pragma unroll 4
    for (int t = 0; t < rows; ++t) {
      if (t == ck) {  // the state entering chunk (t0 + t) / Q
        const index_t ch = (t0 + t) / a.Q;
#pragma unroll
        for (int s = 0; s < 4; ++s) a.ckpt[(ch * N + 4 * q + s) * BE + bd] = h[s];
        next_ck += a.Q;
        ck = next_ck - t0 < kTile ? int(next_ck - t0) : kTile;
      }
      if (seq && srs[t] != 0.f) {  // a record starts here (the same for the whole block)
#pragma unroll
        for (int s = 0; s < 4; ++s) h[s] = 0.f;
      }
      const float dl = sdl[t * C + c], du = sdu[t * C + c];
      const float4 Bv = *reinterpret_cast<const float4*>(sB + t * N + 4 * q);
      const float4 Cv = *reinterpret_cast<const float4*>(sC + t * N + 4 * q);
      h[0] = fmaf(ex2(dl * a2[0]), h[0], du * Bv.x);
      h[1] = fmaf(ex2(dl * a2[1]), h[1], du * Bv.y);
      h[2] = fmaf(ex2(dl * a2[2]), h[2], du * Bv.z);
      h[3] = fmaf(ex2(dl * a2[3]), h[3], du * Bv.w);
      spart[(t * C + c) * LPC + q] = fmaf(Cv.x, h[0], fmaf(Cv.y, h[1], fmaf(Cv.z, h[2], Cv.w * h[3])));
    }
    __syncthreads();

    // phase 3
    for (int e = tid; e < rows * C; e += NT) {
      const float* p = spart + e * LPC;
      float y = De * su[e];
#pragma unroll
      for (int k = 0; k < LPC; ++k) y += p[k];
      if (a.z) y *= silu(sz[e]);
      a.out[(b * a.L + t0 + e / C) * a.ld_out + d0 + ce] = y;
    }
  }
  asm volatile("cp.async.wait_all;\n" ::);
  if (a.final_state) {
#pragma unroll
    for (int s = 0; s < 4; ++s) a.final_state[bd * N + 4 * q + s] = h[s];
  }
}

template <int N>
void launch(const FwdArgs& a) {
  const std::size_t bytes = sizeof(float) * (std::size_t(kStages) * stage_floats(N) + extra_floats<N>());
  static bool raised = false;  // once per kernel: the dynamic shared-memory limit, and the largest shared-memory
  if (!raised) {               // carveout (else the driver may leave room for one block per SM)
    cudaError_t e = cudaFuncSetAttribute(forward_kernel<N>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(forward_kernel<N>, cudaFuncAttributePreferredSharedMemoryCarveout,
                               int(cudaSharedmemCarveoutMaxShared));
    require(e == cudaSuccess, "selective_scan_forward (CUDA)", bytes, " bytes of shared memory: ",
            cudaGetErrorString(e));
    raised = true;
  }
  const cudaStream_t st = Kokkos::DefaultExecutionSpace().cuda_stream();
  forward_kernel<N><<<dim3(unsigned(a.E / kChannels), unsigned(a.batch)), unsigned(kChannels * N / 4), bytes, st>>>(a);
  const cudaError_t e = cudaGetLastError();
  require(e == cudaSuccess, "selective_scan_forward (CUDA)", "the kernel failed to launch: ", cudaGetErrorString(e));
}

}  // namespace

void forward(const FwdArgs& a) {
  Kokkos::Profiling::ScopedRegion region("selective_scan::forward_cuda");
  if (a.N == 16)
    launch<16>(a);
  else
    launch<8>(a);
}

#else
bool compiled() { return false; }
void forward(const FwdArgs&) { require(false, "selective_scan_forward", "the CUDA kernel is not in this build"); }
#endif

}  // namespace mm::mamba1_cuda
