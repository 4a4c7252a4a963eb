#include "ssm/mamba1/scan_cuda.hpp"

#include <Kokkos_Core.hpp>
#include <Kokkos_Profiling_ScopedRegion.hpp>

#include "core/error.hpp"
#include "core/kokkos_types.hpp"  // softplus, silu

namespace mm::mamba1_cuda {

bool shape_fits(index_t E, index_t N, index_t cpg) {
  return (N == 8 || N == 16) && E % kChannels == 0 && cpg % kChannels == 0;
}

namespace {
// (slots per channel, tokens per slot, states per group) of variants 1..kVariants; variant 0 is kDefault.
struct Shape {
  int S, K, G;
  const char* name;
};
constexpr Shape kShapes[kVariants] = {
    {16, 8, 2, "S16 K8 G2"}, {8, 16, 2, "S8 K16 G2"}, {16, 8, 4, "S16 K8 G4"}, {8, 8, 4, "S8 K8 G4"}};
constexpr int kDefault = 1;
}  // namespace

const char* variant_name(int v) { return v >= 1 && v <= kVariants ? kShapes[v - 1].name : kShapes[kDefault - 1].name; }

#if defined(KOKKOS_ENABLE_CUDA)
bool compiled() { return true; }

namespace {

constexpr int kCB = int(kChannels);  // channels per block
constexpr float kLog2e = 1.4426950408889634f;
// Blocks each SM must hold (the register cap follows): 4 x 1,536 channels make 768 blocks, 5.8 per SM on an H200,
// and every block walks the whole sequence, so they should all be resident at once.
constexpr int kMinBlocks = 6;

// 16-byte asynchronous copy; src_bytes 0 fills the destination with zeros (rows past the sequence's end).
__device__ __forceinline__ void cp_async16(float* smem, const float* gmem, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;\n" ::); }
// 2^x for x <= 0 (the decays): one MUFU.EX2, flushing results below the normal range to zero.
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// G consecutive floats from shared memory (G = 2 or 4, aligned to G floats).
template <int G>
struct Vec {
  float v[G];
};
template <int G>
__device__ __forceinline__ Vec<G> lds(const float* p) {
  Vec<G> r;
  if constexpr (G == 4) {
    const float4 x = *reinterpret_cast<const float4*>(p);
    r.v[0] = x.x, r.v[1] = x.y, r.v[2] = x.z, r.v[3] = x.w;
  } else {
    const float2 x = *reinterpret_cast<const float2*>(p);
    r.v[0] = x.x, r.v[1] = x.y;
  }
  return r;
}

// One B|C tile: TI rows (tokens) of 2N floats (B then C), row r's 16-byte chunk j stored at chunk (j + r / K) % NC.
template <int N, int S, int K>
__device__ void load_bc(const FwdArgs& a, float* tile, index_t b, index_t t0, index_t g) {
  constexpr int TI = S * K, NC = 2 * N / 4, NT = kCB * S;
  for (int i = threadIdx.x; i < TI * NC; i += NT) {
    const int r = i / NC, j = i % NC;
    const index_t t = t0 + r;
    const bool in = t < a.L;
    const index_t row = b * a.L + (in ? t : 0);
    const float* src = j < N / 4 ? a.B + row * a.ld_bc + g * N + 4 * j : a.C + row * a.ld_bc + g * N + 4 * (j - N / 4);
    cp_async16(tile + r * 2 * N + ((j + r / K) % NC) * 4, src, in ? 16 : 0);
  }
}

template <int N, int S, int K, int G, bool kSeq>
__global__ void __launch_bounds__(kCB * S, kMinBlocks) forward_kernel(const FwdArgs a) {
  constexpr int TI = S * K, NC = 2 * N / 4, CPW = 32 / S, NT = kCB * S;
  constexpr unsigned kFull = 0xffffffffu;
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  float* sbc = smem;                  // 2 stages of (TI, 2N)
  float* sa2 = sbc + 2 * TI * 2 * N;  // (kCB, N): A log2(e)
  float* scarry = sa2 + kCB * N;      // (kCB, N): the state carried into the iteration, per channel
  const index_t b = blockIdx.y, d0 = index_t(blockIdx.x) * kCB, g = d0 / a.cpg, L = a.L, BE = a.batch * a.E;
  const int lane = threadIdx.x % 32, s = lane % S, cl = (threadIdx.x / 32) * CPW + lane / S;
  const index_t d = d0 + cl, bd = b * a.E + d;
  for (int i = threadIdx.x; i < kCB * N; i += NT) sa2[i] = a.A[d0 * N + i] * kLog2e;
  if (s == 0) {
    for (int n = 0; n < N; ++n) {
      const float h0 = a.init ? a.init[bd * N + n] : 0.f;
      scarry[cl * N + n] = h0;
      a.ckpt[index_t(n) * BE + bd] = h0;  // the state entering chunk 0
    }
  }
  const float De = a.D[d], bias = a.bias[d];
  const std::int32_t* seq = kSeq ? a.seq + b * a.ld_seq : nullptr;
  const index_t niter = (L + TI - 1) / TI;
  load_bc<N, S, K>(a, sbc, b, 0, g);
  cp_async_commit();

  for (index_t it = 0; it < niter; ++it) {
    const index_t t0 = it * TI, tb = t0 + index_t(s) * K;  // the iteration's and this lane's first token
    // This lane's K tokens of u and delta, straight from device memory (issued before the barriers).
    float dl[K], du[K], y[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const index_t t = tb + k;
      if (t < L) {
        const index_t row = b * L + t;
        const float uu = __ldg(a.u + row * a.ld_u + d);
        dl[k] = __ldg(a.delta + row * a.ld_delta + d);
        du[k] = uu;
      } else {
        dl[k] = -1e30f;  // softplus -> 0: the state passes unchanged
        du[k] = 0.f;
      }
    }
    __syncthreads();  // every lane is done with the stage the next tile goes to
    if (it + 1 < niter) load_bc<N, S, K>(a, sbc + ((it + 1) & 1) * TI * 2 * N, b, t0 + TI, g);
    cp_async_commit();
    unsigned rst = 0, ckm = 0;  // per token: a record starts here; a chunk starts after it
    float sdl = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const float dlk = softplus(dl[k] + bias);
      y[k] = De * du[k];
      du[k] *= dlk;
      dl[k] = dlk;
      sdl += dlk;
      if constexpr (kSeq) {
        const index_t t = tb + k;
        if (t > 0 && t < L && seq[t] != seq[t - 1]) rst |= 1u << k;
      }
    }
    // Chunk starts t + 1 = j Q inside this lane's tokens (j >= 1, j Q < L): the state after t enters chunk j.
    index_t ck0 = (tb + 1 + a.Q - 1) / a.Q;  // the first chunk starting at or after token tb + 1
    if (ck0 == 0) ck0 = 1;
    for (index_t j = ck0; j * a.Q <= tb + K && j * a.Q < L; ++j) ckm |= 1u << int(j * a.Q - 1 - tb);
    cp_async_wait_one();
    __syncthreads();  // this iteration's tile has landed for every lane
    const float* tile = sbc + (it & 1) * TI * 2 * N;
    const float* rows = tile + s * K * 2 * N;  // this lane's K rows

#pragma unroll 1
    for (int n0 = 0; n0 < N; n0 += G) {  // (not unrolled: the groups would share registers)
      const int pb = (((n0 / 4) + s) % NC) * 4 + n0 % 4, pc = (((N / 4 + n0 / 4) + s) % NC) * 4 + n0 % 4;
      const Vec<G> a2 = lds<G>(sa2 + cl * N + n0);
      float dA[G][K], hl[G], P[G];
#pragma unroll
      for (int q = 0; q < G; ++q) hl[q] = 0.f;
      // 1. this lane's tokens from a zero state; the decays kept
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const Vec<G> Bv = lds<G>(rows + k * 2 * N + pb);
#pragma unroll
        for (int q = 0; q < G; ++q) {
          float e = ex2(dl[k] * a2.v[q]);
          if constexpr (kSeq) e = (rst >> k) & 1u ? 0.f : e;
          dA[q][k] = e;
          hl[q] = fmaf(e, hl[q], du[k] * Bv.v[q]);
        }
      }
      // 2. the slots' aggregates composed in token order (inclusive), then the carried state enters
#pragma unroll
      for (int q = 0; q < G; ++q) P[q] = (kSeq && rst) ? 0.f : ex2(a2.v[q] * sdl);
#pragma unroll
      for (int off = 1; off < S; off <<= 1) {
#pragma unroll
        for (int q = 0; q < G; ++q) {
          const float Pp = __shfl_up_sync(kFull, P[q], off, S), hp = __shfl_up_sync(kFull, hl[q], off, S);
          if (s >= off) {
            hl[q] = fmaf(P[q], hp, hl[q]);
            P[q] *= Pp;
          }
        }
      }
      float h[G];
      const Vec<G> cr = lds<G>(scarry + cl * N + n0);
      __syncwarp();  // every lane of the channel has read the carry before its last slot replaces it
#pragma unroll
      for (int q = 0; q < G; ++q) {
        const float Pe = __shfl_up_sync(kFull, P[q], 1, S), he = __shfl_up_sync(kFull, hl[q], 1, S);
        if (s == S - 1) scarry[cl * N + n0 + q] = fmaf(P[q], cr.v[q], hl[q]);
        h[q] = s == 0 ? cr.v[q] : fmaf(Pe, cr.v[q], he);
      }
      // 3. this lane's tokens again from its entering state: outputs and checkpoints
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const Vec<G> Bv = lds<G>(rows + k * 2 * N + pb), Cv = lds<G>(rows + k * 2 * N + pc);
#pragma unroll
        for (int q = 0; q < G; ++q) {
          h[q] = fmaf(dA[q][k], h[q], du[k] * Bv.v[q]);
          y[k] = fmaf(Cv.v[q], h[q], y[k]);
        }
        if ((ckm >> k) & 1u) {
          const index_t ch = (tb + k + 1) / a.Q;
#pragma unroll
          for (int q = 0; q < G; ++q) a.ckpt[(ch * N + n0 + q) * BE + bd] = h[q];
        }
      }
    }
    // D skip (in y already), the gate, the store
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const index_t t = tb + k;
      if (t < L) {
        const index_t row = b * L + t;
        float o = y[k];
        if (a.z) o *= silu(__ldg(a.z + row * a.ld_z + d));
        a.out[row * a.ld_out + d] = o;
      }
    }
  }
  asm volatile("cp.async.wait_all;\n" ::);
  __syncwarp();
  if (a.final_state && s == 0)
    for (int n = 0; n < N; ++n) a.final_state[bd * N + n] = scarry[cl * N + n];
}

template <int N, int S, int K, int G, bool kSeq>
void launch_one(const FwdArgs& a) {
  constexpr int TI = S * K;
  const std::size_t bytes = sizeof(float) * (std::size_t(2) * TI * 2 * N + 2 * std::size_t(kCB) * N);
  static bool raised = false;  // once per kernel: the largest shared-memory carveout (room for many blocks)
  if (!raised) {
    cudaError_t e = cudaFuncSetAttribute(forward_kernel<N, S, K, G, kSeq>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(bytes));
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(forward_kernel<N, S, K, G, kSeq>, cudaFuncAttributePreferredSharedMemoryCarveout,
                               int(cudaSharedmemCarveoutMaxShared));
    require(e == cudaSuccess, "selective_scan_forward (CUDA)", bytes, " bytes of shared memory: ",
            cudaGetErrorString(e));
    raised = true;
  }
  const cudaStream_t st = Kokkos::DefaultExecutionSpace().cuda_stream();
  forward_kernel<N, S, K, G, kSeq>
      <<<dim3(unsigned(a.E / kChannels), unsigned(a.batch)), unsigned(kCB * S), bytes, st>>>(a);
  const cudaError_t e = cudaGetLastError();
  require(e == cudaSuccess, "selective_scan_forward (CUDA)", "the kernel failed to launch: ", cudaGetErrorString(e));
}

template <int N, int S, int K, int G>
void launch(const FwdArgs& a) {
  if (a.seq)
    launch_one<N, S, K, G, true>(a);
  else
    launch_one<N, S, K, G, false>(a);
}

template <int N>
void launch_n(const FwdArgs& a, int v) {
  static_assert(kShapes[0].S == 16 && kShapes[0].K == 8 && kShapes[0].G == 2);
  static_assert(kShapes[1].S == 8 && kShapes[1].K == 16 && kShapes[1].G == 2);
  static_assert(kShapes[2].S == 16 && kShapes[2].K == 8 && kShapes[2].G == 4);
  static_assert(kShapes[3].S == 8 && kShapes[3].K == 8 && kShapes[3].G == 4);
  switch (v) {
    case 1: launch<N, 16, 8, 2>(a); break;
    case 2: launch<N, 8, 16, 2>(a); break;
    case 3: launch<N, 16, 8, 4>(a); break;
    default: launch<N, 8, 8, 4>(a); break;
  }
}

}  // namespace

void forward(const FwdArgs& a) {
  Kokkos::Profiling::ScopedRegion region("selective_scan::forward_cuda");
  require(a.variant >= 0 && a.variant <= kVariants, "selective_scan_forward (CUDA)", "kernel variant ", a.variant,
          " is not one of 0..", kVariants);
  const int v = a.variant == 0 ? kDefault : a.variant;
  if (a.N == 16)
    launch_n<16>(a, v);
  else
    launch_n<8>(a, v);
}

#else
bool compiled() { return false; }
void forward(const FwdArgs&) { require(false, "selective_scan_forward", "the CUDA kernel is not in this build"); }
#endif

}  // namespace mm::mamba1_cuda
