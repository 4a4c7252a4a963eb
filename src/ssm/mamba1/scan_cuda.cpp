#include "ssm/mamba1/scan_cuda.hpp"

#include <Kokkos_Core.hpp>
#include <Kokkos_Profiling_ScopedRegion.hpp>
#include <algorithm>
#include <type_traits>

#include "core/cuda_launch.hpp"
#include "core/error.hpp"
#include "core/kokkos_types.hpp"

namespace mm::mamba1_cuda {

bool shape_fits(index_t E, index_t N, index_t cpg) {
  return (N == 8 || N == 16) && E % kChannels == 0 && cpg % kChannels == 0;
}

constexpr int kOldVariants = 4;  // variants 1..4 are the time-parallel kernel's shapes, 5..8 the state lanes
static_assert(kVariants == kOldVariants + 4);

namespace {
// (slots per channel, tokens per slot, states per group, u and delta staged in shared memory) of variants
// 1..4 (kDefault: the fallback of variant 0 where the state lanes do not fit).
struct Shape {
  int S, K, G;
  bool stage;
  const char* name;
};
constexpr Shape kShapes[kOldVariants] = {{16, 8, 2, false, "S16 K8 G2"},
                                      {8, 8, 2, true, "S8 K8 G2 staged"},
                                      {8, 8, 2, false, "S8 K8 G2"},
                                      {8, 8, 4, true, "S8 K8 G4 staged"}};
constexpr int kDefault = 4;  // S8 K8 G4 staged: 1.466 ms against 1.753-1.799 ms for the others on an H200 (16530e6)
}  // namespace

bool lanes_fit(index_t E, index_t N, index_t cpg, index_t Q) {
  return (N == 8 || N == 16) && E % 16 == 0 && cpg % 16 == 0 && Q % 32 == 0;
}

bool backward_fits(index_t E, index_t N, index_t cpg, index_t Q) { return lanes_fit(E, N, cpg, Q) && Q <= 512; }

const char* variant_name(int v) {
  if (v == 5) return "lanes T32";
  if (v == 6) return "lanes T32 U8";
  if (v == 7) return "lanes T32 U8 pipelined";
  if (v == 8) return "lanes T32 U8 pipelined warp-summed";
  if (v >= 1 && v <= kOldVariants) return kShapes[v - 1].name;
  return "lanes T32 U8 pipelined warp-summed, or S8 K8 G4 staged where the lanes do not fit";
}

#if defined(KOKKOS_ENABLE_CUDA)
bool compiled() { return true; }

namespace {

constexpr int kCB = int(kChannels);  // channels per block
using cuda_k::kLog2e;
// Blocks each SM must hold (the register cap follows): 4 x 1,536 channels make 768 blocks, 5.8 per SM on an H200,
// and every block walks the whole sequence, so they should all be resident at once.
constexpr int kMinBlocks = 6;

using cuda_k::cp_async;
using cuda_k::cp_async_commit;
using cuda_k::ex2;  // 2^x for the decays (x <= 0)

// softplus (identity above 20, as mamba_ssm) with log1pf kept exact-rounded and exp from the exp unit (2 ulp), and
// silu with a fast reciprocal: the per-(token, channel) work is divided over only N states, so the library's
// expf and IEEE division were a visible share of the kernel's instructions.
__device__ __forceinline__ float softplus_fast(float x) { return x > 20.f ? x : log1pf(__expf(x)); }
// (silu on the exp unit's flush-to-zero form: __expf's same exp2 of the same product without its rescaling of
// results below 2^-126, which only 1 + exp(-x) = 1 would absorb anyway: for x > 87 silu(x) = x either way; for
// x < -88 the exp is infinite and the fast division gives -0)
__device__ __forceinline__ float silu_fast(float x) { return __fdividef(x, 1.f + ex2(-x * kLog2e)); }

// softplus for the state lanes: max(x, 0) + log1p(exp(-|x|)), with log1p(v) = 2 atanh(v / (2 + v)) by six terms of
// its odd series (w = v / (2 + v) <= 1/3: truncation below 1.5e-7 relative); 2 exp-unit operations and 9 others,
// where log1pf takes about 30 (the lanes do this per (token, channel) for only 16 states).
__device__ __forceinline__ float softplus_lanes(float x) {
  const float v = ex2(-fabsf(x) * kLog2e), w = __fdividef(v, 2.f + v), w2 = w * w;
  float p = fmaf(w2, 1.f / 11.f, 1.f / 9.f);
  p = fmaf(w2, p, 1.f / 7.f);
  p = fmaf(w2, p, 1.f / 5.f);
  p = fmaf(w2, p, 1.f / 3.f);
  p = fmaf(w2, p, 1.f);
  return fmaxf(x, 0.f) + 2.f * w * p;
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

// One B|C tile: TI rows (tokens) of 2N floats (B then C) in units of G floats (what a lane reads at once); unit j of
// row r is stored at unit (j + r / K) % (2N / G), so that the S slots, reading the same state of different rows,
// find it in different banks (for G = 2 and S <= N: conflict-free).
template <int N, int S, int K, int G>
__device__ void load_bc(const FwdArgs& a, float* tile, index_t b, index_t t0, index_t g) {
  constexpr int TI = S * K, NU = 2 * N / G, NT = kCB * S, RS = NT / NU;  // a thread copies unit j of every RS-th row
  static_assert(NT % NU == 0 && TI % RS == 0);
  const int j = threadIdx.x % NU, r0 = threadIdx.x / NU;
  const float* base = (j < N / G ? a.B + G * j : a.C + G * (j - N / G)) + g * N;
  const index_t t1 = t0 + r0;
  const float* src = base + (b * a.L + t1) * a.ld_bc;
  const index_t step = index_t(RS) * a.ld_bc;
#pragma unroll 4
  for (int r = r0; r < TI; r += RS, src += step) {
    const bool in = t0 + r < a.L;
    cp_async<4 * G>(tile + r * 2 * N + ((j + r / K) % NU) * G, in ? src : base, in ? 4 * G : 0);
  }
}

// Floats of one staged array of u or delta: TI rows of the block's kCB channels, row r at r kCB + 4 (r / K) (a skew
// of 4 floats per slot, so that the slots reading the same token of their own rows spread over the banks).
template <int S, int K>
__host__ __device__ constexpr int ud_floats() {
  return S * K * kCB + 4 * S;
}
__device__ __forceinline__ int ud_at(int r, int K) { return r * kCB + 4 * (r / K); }

// u and delta of TI tokens for the block's channels into `ud` (u, then delta at ud_floats), 16 bytes at a time.
template <int S, int K>
__device__ void load_ud(const FwdArgs& a, float* ud, index_t b, index_t t0, index_t d0) {
  constexpr int TI = S * K, NT = kCB * S, CH = kCB / 4;  // 16-byte pieces per row
  for (int i = threadIdx.x; i < 2 * TI * CH; i += NT) {
    const int arr = i / (TI * CH), r = (i / CH) % TI, j = i % CH;
    const index_t t = t0 + r;
    const bool in = t < a.L;
    const index_t row = b * a.L + (in ? t : 0);
    const float* src = arr == 0 ? a.u + row * a.ld_u + d0 + 4 * j : a.delta + row * a.ld_delta + d0 + 4 * j;
    cp_async<16>(ud + arr * ud_floats<S, K>() + ud_at(r, K) + 4 * j, src, in ? 16 : 0);
  }
}

template <int N, int S, int K, int G, bool kStage>
__host__ __device__ constexpr int stage_floats() {
  return S * K * 2 * N + (kStage ? 2 * ud_floats<S, K>() : 0);
}

template <int N, int S, int K, int G, bool kStage, bool kSeq>
__global__ void __launch_bounds__(kCB * S, kMinBlocks) forward_kernel(const FwdArgs a) {
  constexpr int TI = S * K, NU = 2 * N / G, CPW = 32 / S, NT = kCB * S;
  constexpr unsigned kFull = 0xffffffffu;
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  constexpr int SF = stage_floats<N, S, K, G, kStage>();
  float* sbc = smem;                  // 2 stages of B|C (TI, 2N), then (kStage) u and delta
  float* sa2 = sbc + 2 * SF;          // (kCB, N): A log2(e)
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
  load_bc<N, S, K, G>(a, sbc, b, 0, g);
  if constexpr (kStage) load_ud<S, K>(a, sbc + TI * 2 * N, b, 0, d0);
  cp_async_commit();

  for (index_t it = 0; it < niter; ++it) {
    const index_t t0 = it * TI, tb = t0 + index_t(s) * K;  // the iteration's and this lane's first token
    float dl[K], du[K], y[K];
    if constexpr (!kStage) {  // this lane's K tokens of u and delta straight from device memory, before the wait
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const index_t t = tb + k;
        const index_t row = b * L + (t < L ? t : 0);
        du[k] = __ldg(a.u + row * a.ld_u + d);
        dl[k] = __ldg(a.delta + row * a.ld_delta + d);
      }
    }
    cuda_k::cp_async_wait<0>();
    __syncthreads();  // this iteration's tile has landed for every lane, and the other stage is no longer read
    if (it + 1 < niter) {
      float* next = sbc + ((it + 1) & 1) * SF;
      load_bc<N, S, K, G>(a, next, b, t0 + TI, g);
      if constexpr (kStage) load_ud<S, K>(a, next + TI * 2 * N, b, t0 + TI, d0);
    }
    cp_async_commit();
    const float* tile = sbc + (it & 1) * SF;
    if constexpr (kStage) {
      const float* su = tile + TI * 2 * N;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        du[k] = su[ud_at(s * K + k, K) + cl];
        dl[k] = su[ud_floats<S, K>() + ud_at(s * K + k, K) + cl];
      }
    }
#pragma unroll
    for (int k = 0; k < K; ++k)
      if (tb + k >= L) dl[k] = -1e30f, du[k] = 0.f;  // softplus -> 0: the state passes unchanged
    unsigned rst = 0, ckm = 0;  // per token: a record starts here; a chunk starts after it
    float sdl = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const float dlk = softplus_fast(dl[k] + bias);
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
    const float* rows = tile + s * K * 2 * N;  // this lane's K rows

#pragma unroll 1
    for (int n0 = 0; n0 < N; n0 += G) {  // (not unrolled: the groups would share registers)
      const int pb = ((n0 / G + s) % NU) * G, pc = ((N / G + n0 / G + s) % NU) * G;
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
        if (a.z) o *= silu_fast(__ldg(a.z + row * a.ld_z + d));
        a.out[row * a.ld_out + d] = o;
      }
    }
  }
  cuda_k::cp_async_wait<0>();
  __syncwarp();
  if (a.final_state && s == 0)
    for (int n = 0; n < N; ++n) a.final_state[bd * N + n] = scarry[cl * N + n];
}

// ---- The "state lanes" kernel (variants 5 to 8): a thread per (channel, slot of N / SL states), walking the
// sequence in order. 4 x 1,536 channels x 16 states are 98,304 independent recurrences: enough threads without
// parallelising over time, so every (token, state) costs one exp and one pass (the time-parallel kernel above runs
// its tokens twice). A block owns 16 channels (of one group) and walks tiles of T tokens in three phases:
//   A. each thread turns 4 tokens of one channel (u, delta, z, read one tile ahead into registers) into
//      Delta = softplus(delta + bias) and Delta u, and copies a piece of the tile's B and C, all into shared
//      memory, transposed so that 4 consecutive tokens are one 16-byte load;
//   B. each thread runs its states through the tile (h = exp2(Delta A log2 e) h + Delta u B, y += C h), summing
//      its own states' C h per token, and leaves those partial outputs in shared memory;
//   C. each thread sums the SL slots' partials for its 4 tokens, adds D u, gates with silu(z) and stores.
// Variant 8 (the default) sums 4 slots' partials in the warp by shuffles before B stores them, so C sums 2.
// Checkpoints fall on tile starts (T divides Q), so the recurrence has no per-token branch; only the last tile checks
// the sequence's end. What bounds it (ncu on an H200, perf/RESULTS.md), as first read: the exp unit (one exp2 per
// (token, state) plus four per (token, channel): busy about half the time, as is the issue) and the latency of its and
// of the shared-memory loads' results, with 11-12 warps per SM (all that 4 x 1,536 channels x 8 slots make); as later
// measured, the L1/TEX unit's wavefronts (the end of this comment). By ncu's per-instruction samples at da1d82e, phase
// B (with the next tile's loads) holds 72 % of the stalls, C 17 %, A 8 %; in B the exp instructions wait on the exp
// unit's queue (64 of a warp's 80 exp-unit operations a tile are there, 8 cycles each on a scheduler's quarter of the
// unit, against about 441 instructions to issue), but the unit's throughput is not the bound: 1 or 2 of a quad's 8
// decays on the FMA pipe instead (2^x by a degree-6 fit and the exponent bits, 10 instructions each; 0f4b09c) ran
// 0.4836 and 0.4991 ms against 0.4791 ms in one run. Also tried and dropped: one interval per tile doing C(i - 1), A(i
// + 1) and B(i) on two sets of shared buffers (one barrier a tile instead of two; 5-10 % slower, more stall on the
// loads' and stores' registers). Removing parts of variant 7 one at a time (diagnostic builds, not kept, e5ef47a): the
// 64 phase-B exps a warp-tile 0.480 -> 0.465 ms, every global load (an L1-resident address instead) 0.435 ms, phase B's
// B and C shared loads 0.435 ms, the output stores 0.477 ms; ncu put the L1/TEX unit (shared memory and the global
// loads' data path) at 87 % of its peak, issue at 55 %, the exp unit about half, DRAM 28 %. Variant 8 cuts the
// shared-memory wavefronts a warp-tile by about a third (its phase-B warp of 8 channels x 4 slots reads Delta and Delta
// u in one wavefront each instead of two; the partial outputs, 4 slots summed by 3 shuffles a quad, take 8
// one-wavefront stores and 8 four-wavefront loads instead of 32 and 32): 0.461-0.464 against 0.481-0.483 ms. ncu on
// variant 8 (60109bc): L1/TEX's data pipe 83 % of its peak, 236 wavefronts a warp-tile, 185 of them shared memory (the
// shuffles counted), its 50 16-byte shared loads 2.72 wavefronts each. Tried and dropped: the same warp with a
// channel's 4 slots in neighbouring lanes (2 channels x 4 slots a quarter-warp: the B and C loads uniform across
// quarters, Delta and Delta u not; 0.492-0.496 against 0.463-0.468 ms); the global loads as
// ld.global.nc.L1::no_allocate (0.467-0.468 against 0.463 ms).
constexpr int kLC = 16;  // channels per block
static_assert(kLC == kBwdBlock);
// SL threads ("slots") per channel, each owning N / SL states; a block has 16 SL threads. Phases A and C: thread =
// (channel tid % 16, quads tid / 16 + SL j); phase B: (channel, slot) = (tid % 16, tid / 16) (variant 8: 8 channels
// x 4 slots a warp, lanes 8 apart in slot), its loop over the
// tile's quads unrolled U times (U = 8, the whole tile: 1.5 % faster than U = 2 on an H200). Tried on an H200 and
// dropped: tiles of 64 tokens (no faster), 4 slots of 4 states (1.2x slower: 5.5 warps per SM), a phase-B warp of
// 8 channels x 4 slots with the partials stored per slot (the same time and the same shared-memory wavefronts,
// about 3 per 16-byte load; variant 8 is this warp with the partials summed in it first) and of
// 4 channels x 8 slots (8-way bank conflicts on the partial-output stores, 1.65x slower); 16 slots of one state
// (phases A and C on token pairs: twice the warps, 0.796 ms against 0.512 ms: twice the Delta and Delta u loads a
// (token, state) and 16 partials a token to sum); a thread of 2 channels x 2 states (64-thread blocks: 0.5 shared
// loads a (token, state) instead of 0.75, 20 % fewer load wavefronts, but 5.4 warps per SM issuing on 43 % of
// cycles: 0.655 ms); phase B's shared-memory loads two quads ahead instead of one (the same instruction count
// after ptxas's scheduling, 0.4813 against 0.4809 ms); phase B reading B and C straight from global memory (one
// 8-byte load a token and operand, a lane's 2 states adjacent) instead of from phase A's staged tile, with and
// without an L1 prefetch of the next tile's rows (the dropped variant 9's warp, below; the staging's loads and
// stores, about 24 of a warp-tile's L1 wavefronts, gone): 0.656 and 0.638 ms against variant 8's 0.462 ms
// (d509ce6, reverted). perf/RESULTS.md, 2026-12-04.
template <int T>
__host__ __device__ constexpr int lanes_row() {
  return T + 4;  // a padded row of T floats: 16-byte aligned, and 8 consecutive rows start in 8 different bank quads
}

template <int N, int T, int SL>
__host__ __device__ constexpr int lanes_floats() {
  return (2 * kLC + 2 * N + SL * kLC) * lanes_row<T>() + T;
}

template <int N, int T, int SL, int U, int M, bool kSeq>
__global__ void __launch_bounds__(kLC * SL, 3) lanes_kernel(const FwdArgs a) {
  constexpr bool kWR = M == 2;  // phase B's partial outputs summed over 4 slots in the warp (below)
  static_assert(!kWR || (kLC == 16 && SL == 8));
  constexpr int NT = kLC * SL;  // threads
  constexpr int SP = N / SL, TP = lanes_row<T>(), NQ = T / 4, QPT = NQ * kLC / NT;  // states, quads per thread
  constexpr int BQ = N * NQ;  // 16-byte pieces of one tile of B (and of C)
  static_assert(N % SL == 0 && (NQ * kLC) % NT == 0 && BQ <= NT * QPT && NT % N == 0);
  extern __shared__ float4 lsmem4[];  // lanes_floats<N, T, SL>(): Delta, Delta u, B, C, partial outputs, keep flags
  float* sdt = reinterpret_cast<float*>(lsmem4);
  float *sdu = sdt + kLC * TP, *sb = sdu + kLC * TP, *sc = sb + N * TP, *sy = sc + N * TP;
  float* skeep = sy + SL * kLC * TP;
  const int tid = int(threadIdx.x);
  const index_t b = blockIdx.y, d0 = index_t(blockIdx.x) * kLC, g = d0 / a.cpg, L = a.L, BE = a.batch * a.E;
  // channel c; r: the slot in phase B (states r + SL q), the first quad in phases A and C (quads r + SL j)
  const int c = tid % kLC, r = tid / kLC;
  const index_t d = d0 + c;
  // phase B's channel cs and slot rs: a warp of 16 channels x 2 slots (lanes 16 apart: slots), or with kWR of 8
  // channels x 4 slots (warps 0 and 1 hold slots 0..3 of channels 0..7 and 8..15, warps 2 and 3 slots 4..7), a
  // channel's slots lanes 8 apart. Its 16-byte shared loads take 4 wavefronts (Delta, Delta u: 8 channels a
  // quarter-warp) and 2 (B, C: one slot's row a quarter-warp) by ncu. Tried and dropped (53e638a, variant 9):
  // quarter-warps of 4 channels x 2 slots, the two quarters of each half-warp differing in both, meant to bring
  // Delta and Delta u to 2 wavefronts by a rule fitted to those counts (a half-warp's two quarters share a
  // wavefront where their banks are disjoint); ncu counted the same 53.5 M shared-load wavefronts as variant 8 and
  // it ran 0.469 against 0.462 ms: the rule holds for quarters that each read one address, not in general.
  const int cs = kWR ? (tid / 32 % 2) * 8 + tid % 8 : c, rs = kWR ? (tid / 64) * 4 + tid % 32 / 8 : r;
  const index_t ds = d0 + cs, bds = b * a.E + ds;
  float a2[SP], h[SP];
#pragma unroll
  for (int q = 0; q < SP; ++q) {
    const int n = rs + SL * q;
    a2[q] = a.A[ds * a.N + n] * kLog2e;
    h[q] = a.init ? a.init[bds * a.N + n] : 0.f;
    a.ckpt[index_t(n) * BE + bds] = h[q];  // the state entering chunk 0
  }
  const float De = a.D[d], bias = a.bias[d];
  const bool has_z = a.z != nullptr;
  const std::int32_t* seq = kSeq ? a.seq + b * a.ld_seq : nullptr;
  // The next tile's inputs, in flight during the current tile's recurrence: quad j of this thread covers tokens
  // 4 (r + SL j) .. + 3 of channel c; piece j of B and C covers tokens 4 (tid / N + j NT / N) .. + 3 of state
  // tid % N. Rows are reached from per-thread pointers to the tile's first row and 32-bit row offsets (the caller
  // checks that 2 T rows of every operand span fewer than 2^31 floats).
  float pu[QPT][4], pd[QPT][4], pz[QPT][4], pb[QPT][4], pc[QPT][4];
  int ps[QPT][5];
  // without z, its loads read u again (always a valid row: no null test a load) and phase C multiplies by 1
  const int lu = int(a.ld_u), ldl = int(a.ld_delta), lz = int(has_z ? a.ld_z : a.ld_u), lbc = int(a.ld_bc),
            lo = int(a.ld_out);
  const float* gu = a.u + (b * L + 4 * r) * a.ld_u + d;
  const float* gd = a.delta + (b * L + 4 * r) * a.ld_delta + d;
  const float* gz = (has_z ? a.z : a.u) + (b * L + 4 * r) * lz + d;
  const index_t bc_off = (b * L + 4 * (tid / N)) * a.ld_bc + g * N + tid % N;
  const float *gb = a.B + bc_off, *gc = a.C + bc_off;
  float* go = a.out + (b * L + 4 * r) * a.ld_out + d;
  // the tile at t0 (kFull: all T tokens inside the sequence, no checks); the pointers then move on by T rows
  auto fetch = [&](index_t t0, auto full_tag) {
    constexpr bool kFull = decltype(full_tag)::value;
#pragma unroll
    for (int j = 0; j < QPT; ++j) {
      const index_t tq = t0 + 4 * (r + SL * j);
      // rows by pointer steps (one wide multiply-add a load, where an offset row * ld took three instructions)
      const float *qu = gu + 4 * SL * j * lu, *qd = gd + 4 * SL * j * ldl, *qz = gz + 4 * SL * j * lz;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const bool in = kFull || tq + k < L;
        pu[j][k] = in ? __ldg(qu) : 0.f;
        pd[j][k] = in ? __ldg(qd) : 0.f;
        pz[j][k] = in ? __ldg(qz) : 0.f;
        qu += lu, qd += ldl, qz += lz;
        if constexpr (kSeq) ps[j][k + 1] = c == 0 && tq + k < L ? seq[tq + k] : 0;
      }
      if constexpr (kSeq) ps[j][0] = c == 0 && tq > 0 && tq < L ? seq[tq - 1] : 0;
      if (tid + NT * j < BQ) {
        const index_t tb = t0 + 4 * ((tid + NT * j) / N);
        const float *qb = gb + 4 * (NT / N) * j * lbc, *qc = gc + 4 * (NT / N) * j * lbc;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const bool in = kFull || tb + k < L;
          pb[j][k] = in ? __ldg(qb) : 0.f;
          pc[j][k] = in ? __ldg(qc) : 0.f;
          qb += lbc, qc += lbc;
        }
      }
    }
    gu += T * index_t(lu), gd += T * index_t(ldl), gz += T * index_t(lz), gb += T * index_t(lbc),
        gc += T * index_t(lbc);
  };
  auto fetch_at = [&](index_t t0) {
    if (t0 + T <= L)
      fetch(t0, std::true_type{});
    else
      fetch(t0, std::false_type{});
  };
  // Phase B's terms for quad qd of the tile in shared memory: per state q and token k the decay
  // e = exp2(Delta A log2 e) (times the record-start flag), the input x = Delta u B and C
  auto quad_terms = [&](int qd, float (&e)[SP][4], float (&x)[SP][4], float (&cc)[SP][4]) {
    const float4 dt4 = *reinterpret_cast<const float4*>(sdt + cs * TP + 4 * qd);
    const float4 du4 = *reinterpret_cast<const float4*>(sdu + cs * TP + 4 * qd);
    const float dtk[4] = {dt4.x, dt4.y, dt4.z, dt4.w}, duk[4] = {du4.x, du4.y, du4.z, du4.w};
    [[maybe_unused]] float keep[4] = {1.f, 1.f, 1.f, 1.f};
    if constexpr (kSeq) {
      const float4 k4 = *reinterpret_cast<const float4*>(skeep + 4 * qd);
      keep[0] = k4.x, keep[1] = k4.y, keep[2] = k4.z, keep[3] = k4.w;
    }
#pragma unroll
    for (int q = 0; q < SP; ++q) {
      const int n = rs + SL * q;
      const float4 b4 = *reinterpret_cast<const float4*>(sb + n * TP + 4 * qd);
      const float4 c4 = *reinterpret_cast<const float4*>(sc + n * TP + 4 * qd);
      const float bk[4] = {b4.x, b4.y, b4.z, b4.w}, ck[4] = {c4.x, c4.y, c4.z, c4.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        e[q][k] = ex2(dtk[k] * a2[q]);
        if constexpr (kSeq) e[q][k] *= keep[k];
        x[q][k] = duk[k] * bk[k];
        cc[q][k] = ck[k];
      }
    }
  };
  // the recurrence through the quad's 4 tokens, y[k]: the sum of this thread's C h at token k
  auto quad_chain = [&](const float (&e)[SP][4], const float (&x)[SP][4], const float (&cc)[SP][4], float (&y)[4]) {
#pragma unroll
    for (int q = 0; q < SP; ++q)
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        h[q] = fmaf(e[q][k], h[q], x[q][k]);
        y[k] = q == 0 ? cc[q][k] * h[q] : fmaf(cc[q][k], h[q], y[k]);
      }
  };
  index_t next_ck = a.Q;
  // one tile (kFull: all T tokens inside the sequence)
  auto tile = [&](index_t t0, auto full_tag) {
    constexpr bool kFull = decltype(full_tag)::value;
    // A. this tile's inputs into shared memory; u and z stay in registers for phase C
    float uu[QPT][4], zz[QPT][4];
#pragma unroll
    for (int j = 0; j < QPT; ++j) {
      const int qd = r + SL * j;
      float4 vdt, vdu;
      float* pdt = &vdt.x;
      float* pdu = &vdu.x;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const bool in = kFull || t0 + 4 * qd + k < L;
        const float dl = in ? softplus_lanes(pd[j][k] + bias) : 0.f;  // past the end: the state passes unchanged
        pdt[k] = dl;
        pdu[k] = dl * pu[j][k];
        uu[j][k] = pu[j][k];
        zz[j][k] = pz[j][k];
      }
      *reinterpret_cast<float4*>(sdt + c * TP + 4 * qd) = vdt;
      *reinterpret_cast<float4*>(sdu + c * TP + 4 * qd) = vdu;
      if constexpr (kSeq) {
        if (c == 0) {
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const index_t t = t0 + 4 * qd + k;
            skeep[4 * qd + k] = t > 0 && t < L && ps[j][k + 1] != ps[j][k] ? 0.f : 1.f;  // a record starts at t
          }
        }
      }
      if (tid + NT * j < BQ) {
        const int piece = tid + NT * j, at = (piece % N) * TP + 4 * (piece / N);
        *reinterpret_cast<float4*>(sb + at) = make_float4(pb[j][0], pb[j][1], pb[j][2], pb[j][3]);
        *reinterpret_cast<float4*>(sc + at) = make_float4(pc[j][0], pc[j][1], pc[j][2], pc[j][3]);
      }
    }
    __syncthreads();
    if (t0 + T < L) fetch_at(t0 + T);
    if (t0 == next_ck) {  // the state entering chunk t0 / Q
#pragma unroll
      for (int q = 0; q < SP; ++q) a.ckpt[((t0 / a.Q) * N + rs + SL * q) * BE + bds] = h[q];
      next_ck += a.Q;
    }
    // B. the recurrence over the tile, this thread's states; partial outputs per token. M = 0 stores each quad's
    // partials as it goes; M = 1 (U = NQ) forms the next quad's decays and inputs (exp2, Delta u B) before this
    // quad's recurrence and stores the tile's partials after the loop (stores between the quads keep the compiler
    // from moving the next quad's shared-memory loads above them): 1-1.5 % faster on an H200 (perf/RESULTS.md);
    // keeping the partials in registers alone gained about half of that.
    if constexpr (M == 0) {
#pragma unroll U
      for (int qd = 0; qd < NQ; ++qd) {
        float e[SP][4], x[SP][4], cc[SP][4], y[4];
        quad_terms(qd, e, x, cc);
        quad_chain(e, x, cc, y);
        *reinterpret_cast<float4*>(sy + (r * kLC + c) * TP + 4 * qd) = make_float4(y[0], y[1], y[2], y[3]);
      }
    } else {
      static_assert(U == NQ, "the pipelined phase B unrolls the whole tile");  // (M = 1 or 2)
      float yq[NQ][4], e[2][SP][4], x[2][SP][4], cc[2][SP][4];
      quad_terms(0, e[0], x[0], cc[0]);
#pragma unroll
      for (int qd = 0; qd < NQ; ++qd) {
        if (qd + 1 < NQ) quad_terms(qd + 1, e[(qd + 1) & 1], x[(qd + 1) & 1], cc[(qd + 1) & 1]);
        quad_chain(e[qd & 1], x[qd & 1], cc[qd & 1], yq[qd]);
      }
      if constexpr (kWR) {
        // the warp's 4 slots of a channel summed by halving exchanges (lanes 16, then 8 apart), each lane left with
        // one token k = rs % 4 of the quad, which it stores: the partial outputs are 2 sets (slots 0..3, 4..7)
        // instead of SL, with a quarter of the stores' bytes
        const bool hi16 = (tid & 16) != 0, hi8 = (tid & 8) != 0;
#pragma unroll
        for (int qd = 0; qd < NQ; ++qd) {
          const float* y = yq[qd];
          const float s0 = __shfl_xor_sync(0xffffffffu, hi16 ? y[0] : y[2], 16);
          const float s1 = __shfl_xor_sync(0xffffffffu, hi16 ? y[1] : y[3], 16);
          const float k0 = (hi16 ? y[2] : y[0]) + s0, k1 = (hi16 ? y[3] : y[1]) + s1;
          const float v = (hi8 ? k1 : k0) + __shfl_xor_sync(0xffffffffu, hi8 ? k0 : k1, 8);
          sy[((rs / 4) * kLC + cs) * TP + 4 * qd + rs % 4] = v;
        }
      } else {
#pragma unroll
        for (int qd = 0; qd < NQ; ++qd)
          *reinterpret_cast<float4*>(sy + (r * kLC + c) * TP + 4 * qd) =
              make_float4(yq[qd][0], yq[qd][1], yq[qd][2], yq[qd][3]);
      }
    }
    __syncthreads();
    // C. the slots' partials summed (in slot order; kWR: the two sets), D skip, gate, store
#pragma unroll
    for (int j = 0; j < QPT; ++j) {
      const int qd = r + SL * j;
      const float4 p0 = *reinterpret_cast<const float4*>(sy + c * TP + 4 * qd);
      float y[4] = {p0.x, p0.y, p0.z, p0.w};
#pragma unroll
      for (int sl = 1; sl < (kWR ? 2 : SL); ++sl) {
        const float4 p = *reinterpret_cast<const float4*>(sy + (sl * kLC + c) * TP + 4 * qd);
        y[0] += p.x, y[1] += p.y, y[2] += p.z, y[3] += p.w;
      }
      // the gates of the 4 tokens without a branch between them (a test of a.z per token kept their exp and
      // reciprocal chains apart: phase C was 30 % of the kernel's stall samples for 16 % of its instructions,
      // ncu at 9526804); without z, zz holds u and the gate is 1
      float o[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float s = silu_fast(zz[j][k]);
        o[k] = fmaf(De, uu[j][k], y[k]) * (has_z ? s : 1.f);
      }
      float* qo = go + 4 * SL * j * lo;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (kFull || t0 + 4 * qd + k < L) *qo = o[k];
        qo += lo;
      }
    }
    go += T * index_t(lo);
  };
  fetch_at(0);
  const index_t L_full = L / T * T;
  for (index_t t0 = 0; t0 < L_full; t0 += T) tile(t0, std::true_type{});
  if (L_full < L) tile(L_full, std::false_type{});
  if (a.final_state) {
#pragma unroll
    for (int q = 0; q < SP; ++q) a.final_state[bds * N + rs + SL * q] = h[q];
  }
}

template <int N, int T, int SL, int U, int M, bool kSeq>
void launch_lanes_one(const FwdArgs& a) {
  constexpr int bytes = int(sizeof(float)) * lanes_floats<N, T, SL>();
  static_assert(bytes <= 48 * 1024, "past 48 KiB a launch must first raise cudaFuncAttributeMaxDynamicSharedMemorySize");
  lanes_kernel<N, T, SL, U, M, kSeq><<<dim3(unsigned(a.E / kLC), unsigned(a.batch)), kLC * SL, bytes,
                             Kokkos::DefaultExecutionSpace().cuda_stream()>>>(a);
  const cudaError_t e = cudaGetLastError();
  require(e == cudaSuccess, "selective_scan_forward (CUDA)", "the kernel failed to launch: ", cudaGetErrorString(e));
}

template <int N, int T, int SL, int U, int M>
void launch_lanes(const FwdArgs& a) {
  if (a.seq)
    launch_lanes_one<N, T, SL, U, M, true>(a);
  else
    launch_lanes_one<N, T, SL, U, M, false>(a);
}

template <int N, int S, int K, int G, bool kStage, bool kSeq>
void launch_one(const FwdArgs& a) {
  const std::size_t bytes = sizeof(float) * (std::size_t(2) * stage_floats<N, S, K, G, kStage>() + 2 * std::size_t(kCB) * N);
  static bool raised = false;  // once per kernel: the largest shared-memory carveout (room for many blocks)
  if (!raised) {
    cudaError_t e = cudaFuncSetAttribute(forward_kernel<N, S, K, G, kStage, kSeq>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(bytes));
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(forward_kernel<N, S, K, G, kStage, kSeq>, cudaFuncAttributePreferredSharedMemoryCarveout,
                               int(cudaSharedmemCarveoutMaxShared));
    require(e == cudaSuccess, "selective_scan_forward (CUDA)", bytes, " bytes of shared memory: ",
            cudaGetErrorString(e));
    raised = true;
  }
  const cudaStream_t st = Kokkos::DefaultExecutionSpace().cuda_stream();
  forward_kernel<N, S, K, G, kStage, kSeq>
      <<<dim3(unsigned(a.E / kChannels), unsigned(a.batch)), unsigned(kCB * S), bytes, st>>>(a);
  const cudaError_t e = cudaGetLastError();
  require(e == cudaSuccess, "selective_scan_forward (CUDA)", "the kernel failed to launch: ", cudaGetErrorString(e));
}

template <int N, int S, int K, int G, bool kStage>
void launch(const FwdArgs& a) {
  if (a.seq)
    launch_one<N, S, K, G, kStage, true>(a);
  else
    launch_one<N, S, K, G, kStage, false>(a);
}

template <int N>
void launch_n(const FwdArgs& a, int v) {
  static_assert(kShapes[0].S == 16 && kShapes[0].K == 8 && kShapes[0].G == 2 && !kShapes[0].stage);
  static_assert(kShapes[1].S == 8 && kShapes[1].K == 8 && kShapes[1].G == 2 && kShapes[1].stage);
  static_assert(kShapes[2].S == 8 && kShapes[2].K == 8 && kShapes[2].G == 2 && !kShapes[2].stage);
  static_assert(kShapes[3].S == 8 && kShapes[3].K == 8 && kShapes[3].G == 4 && kShapes[3].stage);
  switch (v) {
    case 1: launch<N, 16, 8, 2, false>(a); break;
    case 2: launch<N, 8, 8, 2, true>(a); break;
    case 3: launch<N, 8, 8, 2, false>(a); break;
    default: launch<N, 8, 8, 4, true>(a); break;
  }
}

}  // namespace

void forward(const FwdArgs& a) {
  Kokkos::Profiling::ScopedRegion region("selective_scan::forward_cuda");
  require(a.variant >= 0 && a.variant <= kVariants, "selective_scan_forward (CUDA)", "kernel variant ", a.variant,
          " is not one of 0..", kVariants);
  // variant 0: the state lanes over 32-token tiles where the shape allows (the fastest measured on an H200,
  // perf/RESULTS.md), else the time-parallel kernel; a lanes variant whose tile does not divide Q falls back alike
  int v = a.variant;
  // (the lanes address 2 x 32 rows of each operand with 32-bit offsets)
  const index_t ld_max = std::max({a.ld_u, a.ld_delta, a.ld_z, a.ld_bc, a.ld_out});
  const bool fits = lanes_fit(a.E, a.N, a.cpg, a.Q) && ld_max * 64 < (index_t(1) << 31);
  if (v == 0) v = fits ? 8 : kDefault;
  if (v >= 5 && !fits) v = kDefault;
  if (v >= 5) {
    switch (v) {  // (N = 8 in 8 slots: one state each)
      case 5: a.N == 16 ? launch_lanes<16, 32, 8, 2, 0>(a) : launch_lanes<8, 32, 8, 2, 0>(a); break;
      case 6: a.N == 16 ? launch_lanes<16, 32, 8, 8, 0>(a) : launch_lanes<8, 32, 8, 8, 0>(a); break;
      case 7: a.N == 16 ? launch_lanes<16, 32, 8, 8, 1>(a) : launch_lanes<8, 32, 8, 8, 1>(a); break;
      default:  // 8 (v is 5..kVariants here)
        a.N == 16 ? launch_lanes<16, 32, 8, 8, 2>(a) : launch_lanes<8, 32, 8, 8, 2>(a); break;
    }
    return;
  }
  if (a.N == 16)
    launch_n<16>(a, v);
  else
    launch_n<8>(a, v);
}

// ---- The native backward's chunk kernels (scan_cuda.hpp): blocks of 16 channels x 8 slots (2 states a thread for
// N = 16), one per (16 channels, batch row, chunk), tiles of 32 tokens.
namespace bwd {
constexpr int kT = 32, kTP = kT + 4, kSL = 8, kNT = kLC * kSL, kMaxTiles = 16;  // kMaxTiles: Q <= 512

__device__ __forceinline__ float dsilu_fast(float x) {
  const float s = cuda_k::sigm(x);
  return s * (1.f + x * (1.f - s));
}

// Shared-memory tile of a chunk's tokens [t0, t0 + 32), tokens at or past `end` (the chunk's end) read as zeros
// (Delta 0: the state and dh pass unchanged) with keep 1.
template <int N>
struct Tile {
  float dt[kLC * kTP], du[kLC * kTP], g[kLC * kTP], b[N * kTP], c[N * kTP], keep[kT];
};
// What a thread keeps of its 4 tokens (channel tid % 16, tokens 4 (tid / 16) ..): u, dout, z and delta + bias.
struct Quad {
  float u[4], go[4], z[4], x[4], dt[4], g[4];
};

// kB, kC: stage B, C; kG: read dout and z (g = dout silu(z)); without them g reads as 0.
template <int N, bool kB, bool kC, bool kG>
__device__ void stage(const BwdArgs& a, Tile<N>& tl, Quad& qd, index_t b, index_t d0, index_t t0, index_t end) {
  const int tid = int(threadIdx.x), c = tid % kLC, r = tid / kLC;
  const index_t d = d0 + c, g = d0 / a.cpg;
  const float bias = a.bias[d];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const index_t t = t0 + 4 * r + k;
    const bool in = t < end;
    const index_t row = b * a.L + (in ? t : 0);
    const float x = in ? __ldg(a.delta + row * a.ld_delta + d) + bias : 0.f;
    const float uu = in ? __ldg(a.u + row * a.ld_u + d) : 0.f;
    const float go = kG && in ? __ldg(a.dout + row * a.ld_dout + d) : 0.f;
    const float zz = kG && in && a.z ? __ldg(a.z + row * a.ld_z + d) : 0.f;
    const float dt = in ? softplus_lanes(x) : 0.f;
    const float gg = a.z ? go * silu_fast(zz) : go;
    qd.u[k] = uu, qd.go[k] = go, qd.z[k] = zz, qd.x[k] = x, qd.dt[k] = dt, qd.g[k] = gg;
    tl.dt[c * kTP + 4 * r + k] = dt;
    tl.du[c * kTP + 4 * r + k] = dt * uu;
    tl.g[c * kTP + 4 * r + k] = gg;
    if (c == 0) {
      const bool rs = a.seq && in && t > 0 && a.seq[b * a.ld_seq + t] != a.seq[b * a.ld_seq + t - 1];
      tl.keep[4 * r + k] = rs ? 0.f : 1.f;
    }
  }
  if (tid < N * (kT / 4)) {  // a piece of 4 tokens of one state of B and C
    const int n = tid % N, tq = tid / N;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const index_t t = t0 + 4 * tq + k;
      const bool in = t < end;
      const index_t at = (b * a.L + (in ? t : 0)) * a.ld_bc + g * N + n;
      if constexpr (kB) tl.b[n * kTP + 4 * tq + k] = in ? __ldg(a.B + at) : 0.f;
      if constexpr (kC) tl.c[n * kTP + 4 * tq + k] = in ? __ldg(a.C + at) : 0.f;
    }
  }
}

template <int N>
__global__ void __launch_bounds__(kNT, 4) local_kernel(const BwdArgs a) {
  constexpr int SP = N / kSL;
  __shared__ Tile<N> tl;
  const int tid = int(threadIdx.x), c = tid % kLC, r = tid / kLC;
  const index_t b = blockIdx.y, ch = blockIdx.z, d0 = index_t(blockIdx.x) * kLC, BE = a.batch * a.E;
  const index_t bd = b * a.E + d0 + c, c0 = ch * a.Q, c1 = c0 + a.Q < a.L ? c0 + a.Q : a.L;
  float a2[SP], dh[SP], m[SP];
#pragma unroll
  for (int q = 0; q < SP; ++q) a2[q] = a.A[(d0 + c) * N + r + kSL * q] * kLog2e, dh[q] = 0.f, m[q] = 1.f;
  Quad qd;
  for (index_t t0 = c0 + (c1 - c0 - 1) / kT * kT; t0 >= c0; t0 -= kT) {
    stage<N, false, true, true>(a, tl, qd, b, d0, t0, c1);
    __syncthreads();
#pragma unroll 4
    for (int t = kT - 1; t >= 0; --t) {
      const float dt = tl.dt[c * kTP + t], gt = tl.g[c * kTP + t], keep = tl.keep[t];
#pragma unroll
      for (int q = 0; q < SP; ++q) {
        const float e = ex2(dt * a2[q]) * keep;
        dh[q] = e * fmaf(tl.c[(r + kSL * q) * kTP + t], gt, dh[q]);
        m[q] *= e;
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int q = 0; q < SP; ++q) {
    const index_t at = (ch * N + r + kSL * q) * BE + bd;
    a.dl[at] = dh[q];
    a.dm[at] = m[q];
  }
}

template <int N>
struct ChunkSmem {
  Tile<N> tl;
  float p1[kSL * kLC * kTP];  // partial outputs y (phase B1), then partial sums of dh B (phase B2)
  float p2[kSL * kLC * kTP];  // partial sums of dh A exp(Delta A) h_{t-1}
  float hs[kMaxTiles * kNT * (N / kSL)];  // the states entering each tile of the chunk, per thread
  float red[2 * kNT];
  float bcp[N * kLC * kTP];  // per (state, channel, token) the terms of dC (phase B1), then of dB (phase B2)
};

// The tile's part of dB or dC (column `col` + n of the parts) from bcp: thread (state tid / 8, tokens 4 (tid % 8)
// .. + 3) sums the block's 16 channels in order.
template <int N>
__device__ __forceinline__ void bc_part_store(const BwdArgs& a, const float* bcp, float* part_row0, index_t col,
                                              index_t t0, index_t c1) {
  const int tid = int(threadIdx.x);
  if (tid >= N * (kT / 4)) return;
  const int n = tid / (kT / 4), t4 = 4 * (tid % (kT / 4));
  float4 s = *reinterpret_cast<const float4*>(bcp + (n * kLC) * kTP + t4);
#pragma unroll
  for (int c = 1; c < kLC; ++c) {
    const float4 v = *reinterpret_cast<const float4*>(bcp + (n * kLC + c) * kTP + t4);
    s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
  }
  const float sv[4] = {s.x, s.y, s.z, s.w};
  const index_t ld = 2 * (a.E / a.cpg) * N;
#pragma unroll
  for (int k = 0; k < 4; ++k)
    if (t0 + t4 + k < c1) part_row0[(t0 + t4 + k) * ld + col + n] = sv[k];
}

template <int N>
__global__ void __launch_bounds__(kNT, 2) chunk_kernel(const BwdArgs a) {
  constexpr int SP = N / kSL;
  extern __shared__ float4 csmem4[];
  ChunkSmem<N>& sm = *reinterpret_cast<ChunkSmem<N>*>(csmem4);
  Tile<N>& tl = sm.tl;
  const int tid = int(threadIdx.x), c = tid % kLC, r = tid / kLC;
  // block (group gi, its channel block blk0 + j)
  const index_t gi = index_t(blockIdx.x) / a.nblk, j = index_t(blockIdx.x) % a.nblk;
  const index_t b = blockIdx.y, ch = blockIdx.z, d0 = gi * a.cpg + (a.blk0 + j) * kLC, BE = a.batch * a.E;
  const index_t d = d0 + c, bd = b * a.E + d, c0 = ch * a.Q, c1 = c0 + a.Q < a.L ? c0 + a.Q : a.L;
  const int nt = int((c1 - c0 + kT - 1) / kT);
  const float De = a.D[d];
  // this block's part of dB and dC, at the batch row's token 0
  float* const part_row0 = a.bc_parts + (j * a.batch * a.L + b * a.L) * (2 * (a.E / a.cpg) * N);
  const index_t colB = gi * N, colC = (a.E / a.cpg) * N + gi * N;
  float a2[SP], an[SP], h[SP], dh[SP], dA[SP];
#pragma unroll
  for (int q = 0; q < SP; ++q) {
    const int n = r + kSL * q;
    an[q] = a.A[d * N + n];
    a2[q] = an[q] * kLog2e;
    h[q] = a.ckpt[(ch * N + n) * BE + bd];
    dh[q] = a.dcarry[(ch * N + n) * BE + bd];
    dA[q] = 0.f;
  }
  Quad qd;
  // the states entering each tile
  for (int k = 0; k < nt; ++k) {
    stage<N, true, false, false>(a, tl, qd, b, d0, c0 + index_t(k) * kT, c1);
    __syncthreads();
#pragma unroll
    for (int q = 0; q < SP; ++q) sm.hs[(k * kNT + tid) * SP + q] = h[q];
#pragma unroll 4
    for (int t = 0; t < kT; ++t) {
      const float dt = tl.dt[c * kTP + t], du = tl.du[c * kTP + t], keep = tl.keep[t];
#pragma unroll
      for (int q = 0; q < SP; ++q) h[q] = fmaf(ex2(dt * a2[q]) * keep, h[q], du * tl.b[(r + kSL * q) * kTP + t]);
    }
    __syncthreads();
  }
  float dD_acc = 0.f, dbias_acc = 0.f;
  for (int k = nt - 1; k >= 0; --k) {
    const index_t t0 = c0 + index_t(k) * kT;
    stage<N, true, true, true>(a, tl, qd, b, d0, t0, c1);
    __syncthreads();
    float hstart[SP], hr[kT][SP];
#pragma unroll
    for (int q = 0; q < SP; ++q) hstart[q] = h[q] = sm.hs[(k * kNT + tid) * SP + q];
    // B1. the tile's states, kept in registers; partial outputs y (for dz); the terms g h of dC
#pragma unroll
    for (int t4 = 0; t4 < kT; t4 += 4) {
      float y[4] = {0.f, 0.f, 0.f, 0.f};
      const float4 g4 = *reinterpret_cast<const float4*>(tl.g + c * kTP + t4);
      const float gk[4] = {g4.x, g4.y, g4.z, g4.w};
#pragma unroll
      for (int k4 = 0; k4 < 4; ++k4) {
        const int t = t4 + k4;
        const float dt = tl.dt[c * kTP + t], du = tl.du[c * kTP + t], keep = tl.keep[t];
#pragma unroll
        for (int q = 0; q < SP; ++q) {
          const int n = r + kSL * q;
          h[q] = fmaf(ex2(dt * a2[q]) * keep, h[q], du * tl.b[n * kTP + t]);
          hr[t][q] = h[q];
          y[k4] = fmaf(tl.c[n * kTP + t], h[q], y[k4]);
        }
      }
#pragma unroll
      for (int q = 0; q < SP; ++q)
        *reinterpret_cast<float4*>(sm.bcp + ((r + kSL * q) * kLC + c) * kTP + t4) =
            make_float4(gk[0] * hr[t4][q], gk[1] * hr[t4 + 1][q], gk[2] * hr[t4 + 2][q], gk[3] * hr[t4 + 3][q]);
      if (a.z) *reinterpret_cast<float4*>(sm.p1 + (r * kLC + c) * kTP + t4) = make_float4(y[0], y[1], y[2], y[3]);
    }
    __syncthreads();
    bc_part_store<N>(a, sm.bcp, part_row0, colC, t0, c1);
    // C1. dz = dout y silu'(z), y = sum of the slots' partials + D u
    if (a.z) {
#pragma unroll
      for (int k4 = 0; k4 < 4; ++k4) {
        const index_t t = t0 + 4 * r + k4;
        float y = De * qd.u[k4];
#pragma unroll
        for (int sl = 0; sl < kSL; ++sl) y += sm.p1[(sl * kLC + c) * kTP + 4 * r + k4];
        if (t < c1) a.dz[(b * a.L + t) * a.ld_dz + d] = qd.go[k4] * y * dsilu_fast(qd.z[k4]);
      }
    }
    __syncthreads();
    // B2. the reverse scan through the tile; the terms dh Delta u of dB
#pragma unroll
    for (int t4 = kT - 4; t4 >= 0; t4 -= 4) {
      float p1[4], p2[4], p3[SP][4];
#pragma unroll
      for (int k4 = 3; k4 >= 0; --k4) {
        const int t = t4 + k4;
        const float dt = tl.dt[c * kTP + t], gt = tl.g[c * kTP + t], keep = tl.keep[t], du = tl.du[c * kTP + t];
        p1[k4] = 0.f, p2[k4] = 0.f;
#pragma unroll
        for (int q = 0; q < SP; ++q) {
          const int n = r + kSL * q;
          const float e = ex2(dt * a2[q]) * keep, prev = t > 0 ? hr[t - 1][q] : hstart[q];
          const float dhn = fmaf(tl.c[n * kTP + t], gt, dh[q]);
          p3[q][k4] = dhn * du;
          p1[k4] = fmaf(dhn, tl.b[n * kTP + t], p1[k4]);
          const float w = dhn * e * prev;
          p2[k4] = fmaf(an[q], w, p2[k4]);
          dA[q] = fmaf(dt, w, dA[q]);
          dh[q] = e * dhn;
        }
      }
      *reinterpret_cast<float4*>(sm.p1 + (r * kLC + c) * kTP + t4) = make_float4(p1[0], p1[1], p1[2], p1[3]);
      *reinterpret_cast<float4*>(sm.p2 + (r * kLC + c) * kTP + t4) = make_float4(p2[0], p2[1], p2[2], p2[3]);
#pragma unroll
      for (int q = 0; q < SP; ++q)
        *reinterpret_cast<float4*>(sm.bcp + ((r + kSL * q) * kLC + c) * kTP + t4) =
            make_float4(p3[q][0], p3[q][1], p3[q][2], p3[q][3]);
    }
    __syncthreads();
    bc_part_store<N>(a, sm.bcp, part_row0, colB, t0, c1);
    // C2. du = Delta sum dh B + D g, d(raw delta) = (u sum dh B + sum dh A e h_{t-1}) softplus'(delta + bias)
#pragma unroll
    for (int k4 = 0; k4 < 4; ++k4) {
      const index_t t = t0 + 4 * r + k4;
      float s1 = 0.f, s2 = 0.f;
#pragma unroll
      for (int sl = 0; sl < kSL; ++sl) {
        s1 += sm.p1[(sl * kLC + c) * kTP + 4 * r + k4];
        s2 += sm.p2[(sl * kLC + c) * kTP + 4 * r + k4];
      }
      if (t < c1) {
        const index_t row = b * a.L + t;
        const float draw = fmaf(qd.u[k4], s1, s2) * cuda_k::sigm(qd.x[k4]);
        a.du[row * a.ld_du + d] = fmaf(qd.dt[k4], s1, De * qd.g[k4]);
        a.ddelta[row * a.ld_ddelta + d] = draw;
        a.dlt[row * a.E + d] = qd.dt[k4];
        a.g[row * a.E + d] = qd.g[k4];
        dD_acc = fmaf(qd.g[k4], qd.u[k4], dD_acc);
        dbias_acc += draw;
      }
    }
  }
  const index_t kk = b * ((a.L + a.Q - 1) / a.Q) + ch;  // the partials' block: b nchunks + ch
#pragma unroll
  for (int q = 0; q < SP; ++q) a.dA_part[(kk * a.E + d) * N + r + kSL * q] = dA[q];
  sm.red[tid] = dD_acc;
  sm.red[kNT + tid] = dbias_acc;
  __syncthreads();
  if (r == 0) {  // the channel's 8 quads summed in order
    float sd = 0.f, sb = 0.f;
    for (int rr = 0; rr < kSL; ++rr) sd += sm.red[rr * kLC + c], sb += sm.red[kNT + rr * kLC + c];
    a.dv_part[(kk * a.E + d) * 2] = sd;
    a.dv_part[(kk * a.E + d) * 2 + 1] = sb;
  }
}

template <int N>
void launch_local(const BwdArgs& a) {
  const dim3 grid(unsigned(a.E / kLC), unsigned(a.batch), unsigned((a.L + a.Q - 1) / a.Q));
  cuda_k::launch_grid("selective_scan::bwd_local_cuda", grid, dim3(kNT), local_kernel<N>, a);
}

template <int N>
void launch_chunk(const BwdArgs& a) {
  constexpr int bytes = int(sizeof(ChunkSmem<N>));
  static const cudaError_t raised =
      cudaFuncSetAttribute(chunk_kernel<N>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  require(raised == cudaSuccess, "selective_scan_backward (CUDA)", bytes, " bytes of shared memory: ",
          cudaGetErrorString(raised));
  const dim3 grid(unsigned((a.E / a.cpg) * a.nblk), unsigned(a.batch), unsigned((a.L + a.Q - 1) / a.Q));
  Kokkos::Profiling::ScopedRegion region("selective_scan::bwd_chunk_cuda");
  chunk_kernel<N><<<grid, kNT, bytes, Kokkos::DefaultExecutionSpace().cuda_stream()>>>(a);
  const cudaError_t e = cudaGetLastError();
  require(e == cudaSuccess, "selective_scan_backward (CUDA)", "the kernel failed to launch: ", cudaGetErrorString(e));
}
}  // namespace bwd

void backward_local(const BwdArgs& a) {
  require(backward_fits(a.E, a.N, a.cpg, a.Q), "selective_scan_backward (CUDA)", "shape outside the kernel's rules");
  a.N == 16 ? bwd::launch_local<16>(a) : bwd::launch_local<8>(a);
}
void backward_chunk(const BwdArgs& a) {
  require(backward_fits(a.E, a.N, a.cpg, a.Q), "selective_scan_backward (CUDA)", "shape outside the kernel's rules");
  require(a.bc_parts && a.nblk > 0 && (a.blk0 + a.nblk) * kLC <= a.cpg, "selective_scan_backward (CUDA)",
          "channel blocks ", a.blk0, " + ", a.nblk, " outside the group's ", a.cpg / kLC);
  a.N == 16 ? bwd::launch_chunk<16>(a) : bwd::launch_chunk<8>(a);
}

#else
bool compiled() { return false; }
void forward(const FwdArgs&) { require(false, "selective_scan_forward", "the CUDA kernel is not in this build"); }
void backward_local(const BwdArgs&) {
  require(false, "selective_scan_backward", "the CUDA kernel is not in this build");
}
void backward_chunk(const BwdArgs&) {
  require(false, "selective_scan_backward", "the CUDA kernel is not in this build");
}
#endif

}  // namespace mm::mamba1_cuda
