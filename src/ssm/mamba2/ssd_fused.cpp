#include "ssm/mamba2/ssd_fused.hpp"

#include <Kokkos_Core.hpp>
#include <Kokkos_Profiling_ScopedRegion.hpp>

#include "core/cuda_launch.hpp"
#include "core/error.hpp"

#include <cstdint>
#include <type_traits>

#if defined(KOKKOS_ENABLE_CUDA)
#include <cuda_bf16.h>
#include <mma.h>
#endif

namespace mm::ssd_fused {

Form scan_form = Form::mma_ring, intra_form = Form::mma;
StateForm state_form = StateForm::heads;
FwdForm fwd_form = FwdForm::automatic;
BwdStateForm bwd_state_form = BwdStateForm::automatic;
BcForm bc_form = BcForm::automatic;
bool bf16_state_gemms = true;

bool bc_kernel_for(int heads_per_group) {
  return bc_form == BcForm::kernel || (bc_form == BcForm::automatic && heads_per_group == 1);
}

#if defined(KOKKOS_ENABLE_CUDA)
namespace {

namespace wmma = nvcuda::wmma;
using bf = __nv_bfloat16;

// Tiles: 64 tokens by 64 columns per shared-memory stage; four warps, each owning 16 rows (chunk scan) or 16
// columns (chunk state) of the block's output and every 16-wide fragment of the other dimension. Rows of the bf16
// stages are padded by 8 elements (16 bytes): the ld of a WMMA load must be a multiple of 8, and the padding
// spreads the rows of a fragment over the banks.
constexpr int kTile = 64, kThreads = 128, kPad = 8, kLdTile = kTile + kPad;

__device__ __forceinline__ float decay(float d) { return __expf(fminf(d, 0.f)); }

// The skip coefficient of head h at token t of the batch row whose first token row is row0 (= b L): D[h], plus
// D_token (a.dtok, (batch, H, L)) where given.
__device__ __forceinline__ float skip_coef(const Args& a, float Dh, std::int64_t row0, int h, int t) {
  return a.dtok ? Dh + a.dtok[row0 * a.H + std::int64_t(h) * a.L + t] : Dh;
}

void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  require(e == cudaSuccess, "ssd fused", what, " failed to launch: ", cudaGetErrorString(e));
}

// Raises Kernel's dynamic shared-memory limit to `bytes` where that exceeds the default 48 KB, once per new size.
template <auto Kernel>
void allow_smem(std::size_t bytes, const char* what) {
  static std::size_t allowed = 48 * 1024;
  if (bytes <= allowed) return;
  const cudaError_t e = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  require(e == cudaSuccess, "ssd fused", what, ": ", bytes, " bytes of shared memory: ", cudaGetErrorString(e));
  allowed = bytes;
}

// Kernel<<<grid, threads, bytes, st>>>(a), its shared memory allowed first.
template <auto Kernel>
void launch_with(const dim3& grid, int threads, std::size_t bytes, cudaStream_t st, const Args& a, const char* what) {
  allow_smem<Kernel>(bytes, what);
  Kernel<<<grid, threads, bytes, st>>>(a);
}

// Four consecutive floats at p (16-byte aligned when V4, else four scalar loads).
template <bool V4>
__device__ __forceinline__ float4 load4(const float* p) {
  if constexpr (V4) return *reinterpret_cast<const float4*>(p);
  return make_float4(p[0], p[1], p[2], p[3]);
}

// Four consecutive floats to p (one 16-byte store when V4, else four scalar stores).
template <bool V4>
__device__ __forceinline__ void store4(float* p, float4 v) {
  if constexpr (V4)
    *reinterpret_cast<float4*>(p) = v;
  else
    p[0] = v.x, p[1] = v.y, p[2] = v.z, p[3] = v.w;
}

// Four bf16 (two pairs) at d in one 8-byte shared-memory store (d 8-byte aligned: every tile row holds a multiple
// of 8 elements and groups start at multiples of 4). Two 4-byte stores, as the compiler left them, took twice the
// instructions, and ncu counted 3.3- to 3.9-way bank conflicts on these kernels' shared stores (seventeenth session).
__device__ __forceinline__ void store_pairs(bf* d, __nv_bfloat162 lo, __nv_bfloat162 hi) {
  *reinterpret_cast<uint2*>(d) = make_uint2(*reinterpret_cast<const unsigned*>(&lo), *reinterpret_cast<const unsigned*>(&hi));
}

__device__ __forceinline__ void store4_bf16(bf* d, float4 v) {
  store_pairs(d, __floats2bfloat162_rn(v.x, v.y), __floats2bfloat162_rn(v.z, v.w));
}

__device__ __forceinline__ float4 scale4(float4 v, float f) { return make_float4(v.x * f, v.y * f, v.z * f, v.w * f); }

// The largest divisor of n that is at most 8: the loads of a batch in batched().
__host__ __device__ constexpr int batch_of(int n) {
  int b = n < 8 ? n : 8;
  while (n % b != 0) --b;
  return b;
}

// Over the groups of 4 (row r, columns c .. c + 3) of a ROWS x COLS tile that this thread owns (thread t, step
// it: group t + it kThreads, COLS / 4 groups a row): v = ld(r, c), then st(r, c, v), with the loads of up to 8
// groups issued before their stores. Loads and stores go through different pointers that the compiler must
// assume may alias, so in a plain load-store loop it cannot issue a load before the store ahead of it and every
// load's latency is waited out in turn; here a batch's loads are in flight together.
template <int ROWS, int COLS, class Ld, class St>
__device__ __forceinline__ void batched(Ld&& ld, St&& st) {
  constexpr int C4 = COLS / 4, kIt = ROWS * C4 / kThreads, kB = batch_of(kIt);
  static_assert(ROWS * C4 % kThreads == 0, "whole steps of the block");
#pragma unroll
  for (int i0 = 0; i0 < kIt; i0 += kB) {
    float4 v[kB];
#pragma unroll
    for (int j = 0; j < kB; ++j) {
      const int i = threadIdx.x + (i0 + j) * kThreads;
      v[j] = ld(i / C4, (i % C4) * 4);
    }
#pragma unroll
    for (int j = 0; j < kB; ++j) {
      const int i = threadIdx.x + (i0 + j) * kThreads;
      st(i / C4, (i % C4) * 4, v[j]);
    }
  }
}

// dst (ROWS x COLS bf16, row stride ldd) <- src(r, c) for r < nr, c < nc, zero elsewhere; src rows lds apart;
// COLS and nc multiples of 4. Four elements per thread and group, the loads batched.
template <int ROWS, int COLS, bool V4>
__device__ __forceinline__ void stage(bf* dst, int ldd, const float* src, std::int64_t lds, int nr, int nc) {
  batched<ROWS, COLS>(
      [&](int r, int c) { return r < nr && c < nc ? load4<V4>(src + r * lds + c) : make_float4(0.f, 0.f, 0.f, 0.f); },
      [&](int r, int c, float4 v) { store4_bf16(dst + r * ldd + c, v); });
}

// ------------------------------------------------------------------ forward

// The forward kernels walk their reduction dimension in slices of kSl: each slice is copied from global memory in
// fp32 by cp.async into one of two staging buffers (the next slice in flight while the current one is multiplied),
// then every thread converts the elements it copied itself (once its own copies have landed: no barrier needed
// for that) to bf16 tiles, applying the slice's factors (decays, masks, Delta) on the way, and the block
// multiplies the bf16 tiles on tensor cores (WMMA 16 x 16 x 16, fp32 accumulation). bf16 fragments load from
// shared memory by whole rows; an earlier form multiplied the fp32 staging in tf32 (one load per element of a
// fragment) and ran slower than the synchronous kernels it replaced (perf/RESULTS.md, sixteenth session).
constexpr int kSl = 32, kLdS = kSl + 4;  // slice width; fp32 staging rows: 16-byte aligned, 4 banks apart
constexpr int kLdH = kSl + 8;            // bf16 rows of a slice: a multiple of 8 elements, 80 bytes apart

// The steps of this thread over a ROWS x COLS tile in groups of 4 (for_own's default unroll: all of them).
template <int ROWS, int COLS>
constexpr int own_steps = ROWS * (COLS / 4) / kThreads;

// f(r, c) for the 4-wide groups (r, c .. c + 3) of a ROWS x COLS tile that this thread stages in stage_f32, the
// loop unrolled kUnroll steps at a time (by default fully; bc_backward's pipeline inlines its staging twice next
// to 64 accumulator registers, and fully unrolled there the addresses took it to 255 registers and hundreds of
// bytes of spills).
template <int ROWS, int COLS, int kUnroll = own_steps<ROWS, COLS>, class F>
__device__ __forceinline__ void for_own(F&& f) {
  constexpr int C4 = COLS / 4;
  static_assert(ROWS * C4 % kThreads == 0, "whole steps of the block");
#pragma unroll kUnroll
  for (int it = 0; it < own_steps<ROWS, COLS>; ++it) {
    const int i = threadIdx.x + it * kThreads;
    f(i / C4, (i % C4) * 4);
  }
}

// dst (ROWS x COLS fp32, row stride ldd) <- src(r, c) for r < nr, c < nc, zero elsewhere (COLS, nc multiples of 4);
// kAsync: 16-byte cp.async copies (src rows 16-byte aligned), left in flight; else plain loads and stores.
template <int ROWS, int COLS, bool kAsync, int kUnroll = own_steps<ROWS, COLS>>
__device__ __forceinline__ void stage_f32(float* dst, int ldd, const float* src, std::int64_t lds, int nr, int nc) {
  for_own<ROWS, COLS, kUnroll>([&](int r, int c) {
    const bool in = r < nr && c < nc;
    if constexpr (kAsync) {
      cuda_k::cp_async<16>(dst + r * ldd + c, in ? src + r * lds + c : src, in ? 16 : 0);
    } else {
      const float4 v = in ? load4<false>(src + r * lds + c) : make_float4(0.f, 0.f, 0.f, 0.f);
      *reinterpret_cast<float4*>(dst + r * ldd + c) = v;
    }
  });
}

// cp.async of a ROWS x COLS tile of fp32 or bf16 elements E (rows 16-byte aligned, 16 bytes a copy) by the NT
// threads of a block; rows past nr as zeros. PF: the copies' L2 prefetch size (cuda_k::cp_async).
template <int ROWS, int COLS, int NT, int PF = 0, class E>
__device__ __forceinline__ void stage_async(E* dst, int ldd, const E* src, std::int64_t lds, int nr) {
  constexpr int kE = 16 / int(sizeof(E)), CG = COLS / kE;  // elements a copy, copies a row
  static_assert(COLS % kE == 0 && ROWS * CG % NT == 0, "whole copies, whole steps of the block");
#pragma unroll
  for (int it = 0; it < ROWS * CG / NT; ++it) {
    const int i = threadIdx.x + it * NT, r = i / CG, c = (i % CG) * kE;
    const bool in = r < nr;
    cuda_k::cp_async<16, PF>(dst + r * ldd + c, in ? src + r * lds + c : src, in ? 16 : 0);
  }
}

// dst (bf16, row stride ldd) <- f(r, c, src) over this thread's groups of a ROWS x COLS fp32 slice staged by
// stage_f32 at src (row stride lds); f returns the group's 4 values.
template <int ROWS, int COLS, int kUnroll = own_steps<ROWS, COLS>, class F>
__device__ __forceinline__ void convert_own(bf* dst, int ldd, const float* src, int lds, F&& f) {
  for_own<ROWS, COLS, kUnroll>([&](int r, int c) {
    const float4 v = *reinterpret_cast<const float4*>(src + r * lds + c);
    store4_bf16(dst + r * ldd + c, f(r, c, v));
  });
}

__host__ __device__ constexpr std::size_t align128(std::size_t b) { return (b + 127) / 128 * 128; }

// Chunk state: two fp32 stages of x (kSl tokens, P + 4) and B (kSl tokens, kTile + 4 columns of n); bf16 tiles of
// w o x (kSl, P + 8) and B (kSl, kTile + 8); the per-token weights w (Q).
__host__ __device__ constexpr std::size_t cstate_buf_floats(int P) {
  return std::size_t(kSl) * (P + 4) + std::size_t(kSl) * (kTile + 4);
}
__host__ __device__ constexpr std::size_t cstate_tiles_offset(int P) { return align128(2 * cstate_buf_floats(P) * 4); }
__host__ __device__ constexpr std::size_t cstate_w_offset(int P) {
  return cstate_tiles_offset(P) + align128((std::size_t(kSl) * (P + kPad) + std::size_t(kSl) * kLdTile) * 2);
}

// The chunk states' weights: the record whose state they follow, the chunk's last token's (es Delta), or with
// ein_weights the one entering the chunk (e_in: the last token of the chunk before, the first for chunk 0) ...
__device__ __forceinline__ int state_weight_record(const Args& a, std::int64_t row0, int ch, int t0, int q) {
  return a.seq ? a.seq[row0 + (a.ein_weights ? (ch == 0 ? 0 : t0 - 1) : t0 + q - 1)] : 0;
}

// ... and the weight of the chunk's token s: zero past its q tokens, outside that record or below the cutoff, else
// exp(acs_last - acs_s) Delta_s (e_in: exp(acs_s)); acs and dlt are the head's rows of a.acs and a.delta.
__device__ __forceinline__ float state_weight(const Args& a, const float* acs, const float* dlt, float acs_last,
                                              std::int64_t row0, int t0, int q, int s, int rec_w) {
  if (s >= q || (a.seq && a.seq[row0 + t0 + s] != rec_w)) return 0.f;
  const float e = a.ein_weights ? decay(acs[t0 + s]) : decay(acs_last - acs[t0 + s]);
  return e < a.cutoff ? 0.f : (a.ein_weights ? e : e * dlt[t0 + s]);
}

// acc[i] += (w o X)^T B over one 16-token step: fragment i of P from xh ((w o X)^T: element (p, s) at s ldx + p)
// against the 16 columns of B at bh (element (s, n) at s ldb + n), bf16 operands.
template <int PT>
__device__ __forceinline__ void state_mma_step(wmma::fragment<wmma::accumulator, 16, 16, 16, float> (&acc)[PT],
                                               const bf* xh, int ldx, const bf* bh, int ldb) {
  wmma::fragment<wmma::matrix_b, 16, 16, 16, bf, wmma::row_major> fb;
  wmma::load_matrix_sync(fb, bh, ldb);
#pragma unroll
  for (int i = 0; i < PT; ++i) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, bf, wmma::col_major> fa;
    wmma::load_matrix_sync(fa, xh + i * 16, ldx);
    wmma::mma_sync(acc[i], fa, fb, acc[i]);
  }
}

// One block per (64 columns n of the state, head, (row, chunk)); warp w owns columns 16 w .. 16 w + 15 and every
// 16-row fragment of P: states = (w o X)^T B over the chunk's tokens, kSl at a time, with the weights
// state_weight.
template <int PT, bool V4>
__global__ void __launch_bounds__(kThreads, PT <= 4 ? 4 : 2) chunk_state_kernel(const Args a) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int P = PT * 16, ldxs = P + 4, ldbs = kTile + 4, ldxh = P + kPad;
  constexpr std::size_t kBuf = cstate_buf_floats(P);
  float* buf0 = reinterpret_cast<float*>(smem);
  bf* xh = reinterpret_cast<bf*>(smem + cstate_tiles_offset(P));  // (kSl tokens, P): w o x, read as X^T
  bf* bh = xh + kSl * ldxh;                                          // (kSl tokens, 64 columns of B)
  float* w = reinterpret_cast<float*>(smem + cstate_w_offset(P));

  const int n0 = blockIdx.x * kTile, h = blockIdx.y, bc = blockIdx.z;
  const int b = bc / a.nc, ch = bc % a.nc, t0 = ch * a.Q, q = min(a.Q, a.L - t0), g = h / (a.H / a.G);
  const int tid = threadIdx.x, warp = tid / 32, nw = min(kTile, a.N - n0);
  const std::int64_t row0 = std::int64_t(b) * a.L;
  const float* acs = a.acs + (std::int64_t(b) * a.H + h) * a.L;
  const float* dlt = a.delta + (std::int64_t(b) * a.H + h) * a.L;
  const float* xrow = a.xbc + (row0 + t0) * a.ldx;
  const int nsl = (q + kSl - 1) / kSl;
  auto stage_slice = [&](int k) {
    float* xs = buf0 + (k & 1) * kBuf;
    float* bs = xs + kSl * ldxs;
    const int s0 = k * kSl, ns = min(kSl, q - s0);
    const float* src = xrow + std::int64_t(s0) * a.ldx;
    stage_f32<kSl, P, V4>(xs, ldxs, a.xs + (row0 + t0 + s0) * a.ldxs + h * P, a.ldxs, ns, P);
    stage_f32<kSl, kTile, V4>(bs, ldbs, src + a.b_col + g * a.N + n0, a.ldx, ns, nw);
    cuda_k::cp_async_commit();
  };
  stage_slice(0);
  {
    const float acs_last = acs[t0 + q - 1];
    const int rec_w = state_weight_record(a, row0, ch, t0, q);
    for (int s = tid; s < nsl * kSl; s += kThreads) w[s] = state_weight(a, acs, dlt, acs_last, row0, t0, q, s, rec_w);
  }
  __syncthreads();

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[PT];
#pragma unroll
  for (int i = 0; i < PT; ++i) wmma::fill_fragment(acc[i], 0.f);
  for (int k = 0; k < nsl; ++k) {
    if (k + 1 < nsl) stage_slice(k + 1);
    else cuda_k::cp_async_commit();  // an empty group: the wait below always leaves one group in flight
    cuda_k::cp_async_wait<1>();
    const float* xs = buf0 + (k & 1) * kBuf;
    const float* bs = xs + kSl * ldxs;
    const float* wk = w + k * kSl;
    convert_own<kSl, P>(xh, ldxh, xs, ldxs, [wk](int r, int, float4 v) { return scale4(v, wk[r]); });
    convert_own<kSl, kTile>(bh, kLdTile, bs, ldbs, [](int, int, float4 v) { return v; });
    __syncthreads();
    if (warp * 16 < nw) {
#pragma unroll
      for (int kk = 0; kk < kSl; kk += 16)
        state_mma_step<PT>(acc, xh + kk * ldxh, ldxh, bh + kk * kLdTile + warp * 16, kLdTile);
    }
    __syncthreads();  // before the tiles are rewritten and this stage is refilled
  }
  if (warp * 16 < nw) {
    float* S = a.states + ((std::int64_t(bc) * a.H + h) * P) * a.N + n0 + warp * 16;
#pragma unroll
    for (int i = 0; i < PT; ++i) wmma::store_matrix_sync(S + std::int64_t(i) * 16 * a.N, acc[i], a.N, wmma::mem_row_major);
  }
}

// Chunk scan: two fp32 stages of the A slice (64 l, kLdS) and the B slice (S_in: P x kLdS, or x: kSl x (P + 4));
// the fp32 output tile (64 x (P + 4)) over the stages at the end; bf16 tiles of A (64, kLdH) and B (S_in: P x kLdH,
// or x: kSl x (P + 8)); then acs, Delta and the record of the chunk's tokens (Q each).
__host__ __device__ constexpr std::size_t scan_buf_floats(int P) {
  const std::size_t b1 = std::size_t(P) * kLdS, b2 = std::size_t(kSl) * (P + 4);
  return std::size_t(kTile) * kLdS + (b1 > b2 ? b1 : b2);
}
__host__ __device__ constexpr std::size_t scan_tiles_offset(int P) {
  const std::size_t st = 2 * scan_buf_floats(P) * 4, out = std::size_t(kTile) * (P + 4) * 4;
  return align128(st > out ? st : out);
}
__host__ __device__ constexpr std::size_t scan_bh_elems(int P) {
  const std::size_t b1 = std::size_t(P) * kLdH, b2 = std::size_t(kSl) * (P + kPad);
  return b1 > b2 ? b1 : b2;
}
__host__ __device__ constexpr std::size_t scan_tok_offset(int P) {
  return scan_tiles_offset(P) + align128((std::size_t(kTile) * kLdH + scan_bh_elems(P)) * 2);
}

// One block per (64 output tokens l, head, (row, chunk)); warp w owns rows 16 w .. 16 w + 15 of the tile and every
// 16-column fragment of P. One walk over k-slices: first d_state (A = e_in C, B = S_in^T: the inter-chunk term),
// then the source tokens up to the tile's end (A = the masked decays M(l, s) = (C_l . B_s) exp(acs_l - acs_s)
// Delta_s for s <= l in the same record, B = x_s: the intra-chunk term); then y = acc + D x.
template <int PT, bool V4>
__global__ void __launch_bounds__(kThreads, PT <= 4 ? 4 : 2) chunk_scan_kernel(const Args a) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int P = PT * 16, ldxs = P + 4, ldy = P + 4, ldxh = P + kPad;
  constexpr std::size_t kBuf = scan_buf_floats(P);
  float* buf0 = reinterpret_cast<float*>(smem);
  float* ys = buf0;
  bf* ah = reinterpret_cast<bf*>(smem + scan_tiles_offset(P));
  bf* bh = ah + kTile * kLdH;
  float* acs_s = reinterpret_cast<float*>(smem + scan_tok_offset(P));
  float* dt_s = acs_s + a.Q;
  int* rec_s = reinterpret_cast<int*>(dt_s + a.Q);

  const int l0 = blockIdx.x * kTile, h = blockIdx.y, bc = blockIdx.z;
  const int b = bc / a.nc, ch = bc % a.nc, t0 = ch * a.Q, q = min(a.Q, a.L - t0), g = h / (a.H / a.G);
  if (l0 >= q) return;  // the short last chunk
  const int tid = threadIdx.x, warp = tid / 32, nl = min(kTile, q - l0);
  const std::int64_t row0 = std::int64_t(b) * a.L;
  const float* acs = a.acs + (std::int64_t(b) * a.H + h) * a.L;
  const float* dlt = a.delta + (std::int64_t(b) * a.H + h) * a.L;
  const float* S = a.states + (std::int64_t(bc) * a.H + h) * P * a.N;
  const float* lrow = a.xbc + (row0 + t0 + l0) * a.ldx;
  const float* CB = a.cb + ((std::int64_t(bc) * a.G + g) * a.Q + l0) * a.Q;
  const float* xsrc = a.xs + (row0 + t0) * a.ldxs + h * P;
  const int nsl_n = (a.N + kSl - 1) / kSl, s_end = min(q, l0 + kTile);
  const int nsl = nsl_n + (s_end + kSl - 1) / kSl;
  auto stage_slice = [&](int k) {
    float* as = buf0 + (k & 1) * kBuf;
    float* bs = as + kTile * kLdS;
    if (k < nsl_n) {
      const int n0 = k * kSl, nw = min(kSl, a.N - n0);
      stage_f32<kTile, kSl, V4>(as, kLdS, lrow + a.c_col + g * a.N + n0, a.ldx, nl, nw);
      stage_f32<P, kSl, true>(bs, kLdS, S + n0, a.N, P, nw);  // N % 16 == 0: S_in rows are 16-byte aligned
    } else {
      // CB rows are Q (a multiple of 64) apart: 16-byte aligned; columns past the chunk's end are read (they are
      // inside the row) and masked when converted
      const int s0 = (k - nsl_n) * kSl;
      stage_f32<kTile, kSl, true>(as, kLdS, CB + s0, a.Q, nl, kSl);
      stage_f32<kSl, P, V4>(bs, ldxs, xsrc + std::int64_t(s0) * a.ldxs, a.ldxs, min(kSl, q - s0), P);
    }
    cuda_k::cp_async_commit();
  };
  stage_slice(0);
  const int r_in = a.seq ? a.seq[row0 + (ch == 0 ? 0 : t0 - 1)] : 0;
  for (int s = tid; s < (s_end + kSl - 1) / kSl * kSl; s += kThreads) {
    const bool in = s < q;
    acs_s[s] = in ? acs[t0 + s] : 0.f;
    dt_s[s] = in ? dlt[t0 + s] : 0.f;
    rec_s[s] = in ? (a.seq ? a.seq[row0 + t0 + s] : 0) : -1;
  }
  __syncthreads();

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[PT];
#pragma unroll
  for (int i = 0; i < PT; ++i) wmma::fill_fragment(acc[i], 0.f);
  const int warp_last = l0 + warp * 16 + 15;  // the last output token of the warp's rows
  for (int k = 0; k < nsl; ++k) {
    if (k + 1 < nsl) stage_slice(k + 1);
    else cuda_k::cp_async_commit();  // an empty group: the wait below always leaves one group in flight
    cuda_k::cp_async_wait<1>();
    const float* as = buf0 + (k & 1) * kBuf;
    const float* bs = as + kTile * kLdS;
    const bool inter = k < nsl_n;
    const int s0 = inter ? 0 : (k - nsl_n) * kSl;
    if (inter) {
      convert_own<kTile, kSl>(ah, kLdH, as, kLdS, [&](int r, int, float4 v) {
        float e = 0.f;
        if (r < nl) {
          e = rec_s[l0 + r] == r_in ? decay(acs_s[l0 + r]) : 0.f;
          e = e < a.cutoff ? 0.f : e;
        }
        return make_float4(v.x * e, v.y * e, v.z * e, v.w * e);
      });
      convert_own<P, kSl>(bh, kLdH, bs, kLdS, [](int, int, float4 v) { return v; });
    } else {
      convert_own<kTile, kSl>(ah, kLdH, as, kLdS, [&](int r, int c, float4 v) {
        if (r >= nl) return make_float4(0.f, 0.f, 0.f, 0.f);
        const int l = l0 + r, rl = rec_s[l];
        const float al = acs_s[l];
        float m[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int sj = s0 + c + j;
          const float e = decay(al - acs_s[sj]);
          m[j] = sj <= l && rec_s[sj] == rl && e >= a.cutoff ? m[j] * e * dt_s[sj] : 0.f;
        }
        return make_float4(m[0], m[1], m[2], m[3]);
      });
      convert_own<kSl, P>(bh, ldxh, bs, ldxs, [](int, int, float4 v) { return v; });
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kSl; kk += 16) {
      if (!inter && s0 + kk > warp_last) break;  // past the diagonal: the warp's rows of M are zero
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf, wmma::row_major> fa;
      wmma::load_matrix_sync(fa, ah + warp * 16 * kLdH + kk, kLdH);
      if (inter) {
#pragma unroll
        for (int i = 0; i < PT; ++i) {
          // S_in^T: element (n, p) at p kLdH + n
          wmma::fragment<wmma::matrix_b, 16, 16, 16, bf, wmma::col_major> fb;
          wmma::load_matrix_sync(fb, bh + i * 16 * kLdH + kk, kLdH);
          wmma::mma_sync(acc[i], fa, fb, acc[i]);
        }
      } else {
#pragma unroll
        for (int i = 0; i < PT; ++i) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, bf, wmma::row_major> fb;
          wmma::load_matrix_sync(fb, bh + kk * ldxh + i * 16, ldxh);
          wmma::mma_sync(acc[i], fa, fb, acc[i]);
        }
      }
    }
    __syncthreads();  // before the tiles are rewritten and this stage is refilled
  }

  // y = acc + D x (the output tile over the stages: every copy has landed and been read)
#pragma unroll
  for (int i = 0; i < PT; ++i) wmma::store_matrix_sync(ys + warp * 16 * ldy + i * 16, acc[i], ldy, wmma::mem_row_major);
  __syncthreads();
  const float Dh = a.D[h];
  batched<kTile, P>(
      [&](int l, int p) {
        return l < nl ? load4<V4>(a.xs + (row0 + t0 + l0 + l) * a.ldxs + h * P + p)
                      : make_float4(0.f, 0.f, 0.f, 0.f);
      },
      [&](int l, int p, float4 x) {
        if (l >= nl) return;
        const float* yv = ys + l * ldy + p;
        const float Dl = skip_coef(a, Dh, row0, h, t0 + l0 + l);
        store4<V4>(a.y + (row0 + t0 + l0 + l) * a.ldy + h * P + p,
                   make_float4(yv[0] + Dl * x.x, yv[1] + Dl * x.y, yv[2] + Dl * x.z, yv[3] + Dl * x.w));
      });
}

// ------------------------------------------------------------------ backward, intra-chunk part

// One block per (64 source tokens s, run of heads, (row, chunk)). For each head of the run it walks the output
// tiles l >= s: DX = dY_l X_s^T on tensor cores, then per element K = E o (C B^T) (masked) and
//   A_s += K'^T dY_l            (tensor cores; K' = K without its diagonal, as a bf16 pair hi + lo so that A
//                                carries K to ~16 bits: dA's sums over all tokens cancel, bf16 K alone lost 8 %),
//   insum part of row l = sum_{s < l} Delta_s K DX   (a thread owns half a row: the row sum stays local),
//   W(l, s) += DX E Delta_s     (the run's dC B^T, kept on chip for every tile l of the block),
// and after its last tile, with DX = dY X^T:
//   dX_s = Delta_s (A_s + K(s, s) dY_s),  off(s) = X_s . A_s = sum_{l > s} K DX,  dd(s) = off(s) + K(s, s) DX(s, s).
// So DX is formed once per tile pair and head, no column sum walks the tile, and nothing is added atomically.
constexpr int kLdF = kTile + 4;  // fp32 tile rows: 16-byte aligned, 4 banks apart
constexpr int kMaxChunk = 512;   // the W tiles of a block (Q / 64 of them) must fit in shared memory

__host__ __device__ constexpr std::size_t bwd_f_floats(int P) {
  // DX (64 x kLdF), A (64 x (P + 4)), or K in two bf16 parts (2 x 64 x kLdTile bf16 = 64 x kLdTile floats)
  const std::size_t w = (P + 4) > kLdF ? (P + 4) : kLdF;
  return std::size_t(kTile) * (w > std::size_t(kLdTile) ? w : std::size_t(kLdTile));
}
// xs and dys (bf16), f (fp32 DX; bf16 K over its start once DX is read; A at a head's end), the W tiles (fp32),
// then seven per-token arrays.
__host__ __device__ constexpr std::size_t bwd_smem(int P, int Q) {
  return 2 * std::size_t(kTile) * (P + kPad) * 2 + bwd_f_floats(P) * 4 + std::size_t(Q / kTile) * kTile * kLdF * 4 +
         8 * kTile * 4;
}

// DX tile (64 l x 64 s) = dY_l X_s^T into f (warp w: rows 16 w ..); K = P.
template <int PT>
__device__ __forceinline__ void dx_tile(const bf* dys, const bf* xs, float* f) {
  constexpr int ldx = PT * 16 + kPad;
  const int warp = threadIdx.x / 32;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kTile / 16];
#pragma unroll
  for (int j = 0; j < kTile / 16; ++j) wmma::fill_fragment(acc[j], 0.f);
#pragma unroll
  for (int k = 0; k < PT * 16; k += 16) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, bf, wmma::row_major> fa;
    wmma::load_matrix_sync(fa, dys + warp * 16 * ldx + k, ldx);
#pragma unroll
    for (int j = 0; j < kTile / 16; ++j) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf, wmma::col_major> fb;  // X^T: element (p, s) at s ldx + p
      wmma::load_matrix_sync(fb, xs + j * 16 * ldx + k, ldx);
      wmma::mma_sync(acc[j], fa, fb, acc[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < kTile / 16; ++j) wmma::store_matrix_sync(f + warp * 16 * kLdF + j * 16, acc[j], kLdF, wmma::mem_row_major);
}

template <int PT, bool V4>
__global__ void __launch_bounds__(kThreads, 2) intra_bwd_kernel(const Args a) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int P = PT * 16, ldx = P + kPad, ldo = P + 4;
  const int nt = a.Q / kTile;
  bf* xs = reinterpret_cast<bf*>(smem);
  bf* dys = xs + kTile * ldx;
  float* f = reinterpret_cast<float*>(dys + kTile * ldx);
  bf* ms = reinterpret_cast<bf*>(f);  // K hi (64 l, 64 s, rows kLdTile apart) over f once every thread has read DX
  bf* ml = ms + kTile * kLdTile;      // K lo = bf16(K - hi)
  float* wt = f + bwd_f_floats(P);    // (tiles l >= s of the block, 64, kLdF): the run's dC B^T
  float* acs_s = wt + std::size_t(nt) * kTile * kLdF;
  float* dt_s = acs_s + kTile;
  float* acs_l = dt_s + kTile;
  float* diag = acs_l + kTile;
  float* kss = diag + kTile;  // K(s, s) = (C B^T)(s, s)
  int* rec_s = reinterpret_cast<int*>(kss + kTile);
  int* rec_l = rec_s + kTile;

  const int is = blockIdx.z, s0 = is * kTile, u = blockIdx.y, bc = blockIdx.x;  // tiles s outermost (see launch)
  const int b = bc / a.nc, ch = bc % a.nc, t0 = ch * a.Q, q = min(a.Q, a.L - t0);
  const int tid = threadIdx.x, warp = tid / 32;
  const int ns = s0 < q ? min(kTile, q - s0) : 0;
  const std::int64_t nbc = std::int64_t(a.batch) * a.nc;
  const int hi0 = u * a.run_len, hi1 = min(hi0 + a.run_len, a.nh);

  if (ns > 0 && hi0 < hi1) {
    const std::int64_t row0 = std::int64_t(b) * a.L, nr = std::int64_t(a.batch) * a.L;
    const int g = (a.h0 + hi0) / (a.H / a.G);  // a run never straddles a group
    const float* CB = a.cb + (std::int64_t(bc) * a.G + g) * a.Q * a.Q;
    if (tid < kTile) {
      rec_s[tid] = tid < ns ? (a.seq ? a.seq[row0 + t0 + s0 + tid] : 0) : -1;
      kss[tid] = tid < ns ? CB[std::int64_t(s0 + tid) * a.Q + s0 + tid] : 0.f;
    }
    for (int i = tid; i < (nt - is) * kTile * kLdF; i += kThreads) wt[i] = 0.f;
    // the elementwise step: row lr, columns 32 hh .. 32 hh + 31 in groups of 4 rotated by 4 hh (the 8 threads of a
    // quarter warp then touch 8 distinct 16-byte bank groups of the fp32 tiles)
    const int lr = tid >> 1, hh = tid & 1;
    for (int hi = hi0; hi < hi1; ++hi) {
      const int h = a.h0 + hi;
      const float* acs = a.acs + (std::int64_t(b) * a.H + h) * a.L;
      const float* dlt = a.delta + (std::int64_t(b) * a.H + h) * a.L;
      if (tid < kTile) {
        acs_s[tid] = tid < ns ? acs[t0 + s0 + tid] : 0.f;
        dt_s[tid] = tid < ns ? dlt[t0 + s0 + tid] : 0.f;
        diag[tid] = 0.f;
      }
      stage<kTile, P, V4>(xs, ldx, a.xs + (row0 + t0 + s0) * a.ldxs + h * P, a.ldxs, ns, P);
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[PT];  // A: rows s 16 w .., all of P
#pragma unroll
      for (int i = 0; i < PT; ++i) wmma::fill_fragment(acc[i], 0.f);

      for (int l0 = s0, jt = 0; l0 < q; l0 += kTile, ++jt) {
        const int nl = min(kTile, q - l0);
        // this thread's part of the tile's C B^T row (read in the elementwise step): issued first, so that the
        // loads are in flight during the dY staging and the DX product instead of stalling the elementwise step
        // (l0 + lr < Q: inside the chunk's Q x Q block; Q % 64 == 0: 16-byte aligned)
        float4 cbp[8];
        {
          const float* cbrow = CB + std::int64_t(l0 + lr) * a.Q + s0;
#pragma unroll
          for (int k = 0; k < 8; ++k) cbp[k] = *reinterpret_cast<const float4*>(cbrow + 32 * hh + 4 * ((k + 4 * hh) & 7));
        }
        if (tid < kTile) {
          acs_l[tid] = tid < nl ? acs[t0 + l0 + tid] : 0.f;
          rec_l[tid] = tid < nl ? (a.seq ? a.seq[row0 + t0 + l0 + tid] : 0) : -2;
        }
        stage<kTile, P, V4>(dys, ldx, a.dy + (row0 + t0 + l0) * a.ldy + h * P, a.ldy, nl, P);
        __syncthreads();
        dx_tile<PT>(dys, xs, f);
        __syncthreads();
        __nv_bfloat162 kp[16], kl[16];
        float rs = 0.f;
        {
          const float al = acs_l[lr];
          const int rl = rec_l[lr], dl = l0 + lr - s0;  // dl: the row's column on the diagonal
          float* wrow = wt + (jt * kTile + lr) * kLdF;
#pragma unroll
          for (int k = 0; k < 8; ++k) {
            const int s = 32 * hh + 4 * ((k + 4 * hh) & 7);
            const float4 dx4 = *reinterpret_cast<const float4*>(f + lr * kLdF + s);
            const float4 cb4 = cbp[k];
            const float4 w4 = *reinterpret_cast<const float4*>(wrow + s);
            const float dxv[4] = {dx4.x, dx4.y, dx4.z, dx4.w}, cbv[4] = {cb4.x, cb4.y, cb4.z, cb4.w};
            float wv[4] = {w4.x, w4.y, w4.z, w4.w}, kv[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const int sj = s + j;
              float kk = 0.f;
              if (sj <= dl && rec_s[sj] == rl) {  // rec_s of columns past the chunk never equals rec_l of any row
                const float e = decay(al - acs_s[sj]);
                if (e >= a.cutoff) {
                  const float ed = e * dt_s[sj];
                  wv[j] += dxv[j] * ed;
                  kk = e * cbv[j];
                  if (sj < dl) rs += cbv[j] * ed * dxv[j];
                }
              }
              if (sj == dl) {
                diag[sj] = dxv[j];
                kk = 0.f;  // the diagonal goes in at fp32 in the epilogue
              }
              kv[j] = kk;
            }
            *reinterpret_cast<float4*>(wrow + s) = make_float4(wv[0], wv[1], wv[2], wv[3]);
            kp[2 * k] = __floats2bfloat162_rn(kv[0], kv[1]);
            kp[2 * k + 1] = __floats2bfloat162_rn(kv[2], kv[3]);
            const float2 h0 = __bfloat1622float2(kp[2 * k]), h1 = __bfloat1622float2(kp[2 * k + 1]);
            kl[2 * k] = __floats2bfloat162_rn(kv[0] - h0.x, kv[1] - h0.y);
            kl[2 * k + 1] = __floats2bfloat162_rn(kv[2] - h1.x, kv[3] - h1.y);
          }
        }
        rs += __shfl_xor_sync(0xffffffffu, rs, 1);
        if (hh == 0 && lr < nl) a.insum[(std::int64_t(is) * a.nh + hi) * nr + row0 + t0 + l0 + lr] = rs;
        __syncthreads();  // every thread has read its DX: K may overwrite f
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const int s = 32 * hh + 4 * ((k + 4 * hh) & 7);
          store_pairs(ms + lr * kLdTile + s, kp[2 * k], kp[2 * k + 1]);
          store_pairs(ml + lr * kLdTile + s, kl[2 * k], kl[2 * k + 1]);
        }
        __syncthreads();
        // A (rows s) += K^T dY: element (s, l) of K^T at l kLdTile + s
#pragma unroll
        for (int k = 0; k < kTile; k += 16) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, bf, wmma::col_major> fa, fl;
          wmma::load_matrix_sync(fa, ms + k * kLdTile + warp * 16, kLdTile);
          wmma::load_matrix_sync(fl, ml + k * kLdTile + warp * 16, kLdTile);
#pragma unroll
          for (int i = 0; i < PT; ++i) {
            wmma::fragment<wmma::matrix_b, 16, 16, 16, bf, wmma::row_major> fb;
            wmma::load_matrix_sync(fb, dys + k * ldx + i * 16, ldx);
            wmma::mma_sync(acc[i], fl, fb, acc[i]);
            wmma::mma_sync(acc[i], fa, fb, acc[i]);
          }
        }
        __syncthreads();
      }

      // the head's epilogue: A into f, then the per-token sums (row lr, half hh of P) and dX
#pragma unroll
      for (int i = 0; i < PT; ++i) wmma::store_matrix_sync(f + warp * 16 * ldo + i * 16, acc[i], ldo, wmma::mem_row_major);
      __syncthreads();
      {
        float off = 0.f;
#pragma unroll 8
        for (int k = 0; k < P / 2; ++k) {
          const int p = hh * (P / 2) + (k + 4 * lr) % (P / 2);  // rotated: rows 4 banks apart start apart
          off += __bfloat162float(xs[lr * ldx + p]) * f[lr * ldo + p];
        }
        off += __shfl_xor_sync(0xffffffffu, off, 1);
        if (hh == 0 && lr < ns) {
          float* vr = a.v + (std::int64_t(hi) * nr + row0 + t0 + s0 + lr) * 6;
          vr[0] = off + kss[lr] * diag[lr];
          vr[1] = dt_s[lr] * off;
          vr[3] = diag[lr];
        }
      }
      batched<kTile, P>(
          [&](int s, int p) {
            return s < ns ? load4<V4>(a.dy + (row0 + t0 + s0 + s) * a.ldy + h * P + p)
                          : make_float4(0.f, 0.f, 0.f, 0.f);
          },
          [&](int s, int p, float4 g) {
            if (s >= ns) return;
            const float* fa = f + s * ldo + p;
            const float d = dt_s[s], k = kss[s];
            store4<V4>(a.dx + (row0 + t0 + s0 + s) * a.ldd + h * P + p,
                       make_float4(d * (fa[0] + k * g.x), d * (fa[1] + k * g.y), d * (fa[2] + k * g.z),
                                   d * (fa[3] + k * g.w)));
          });
      __syncthreads();  // before the next head restages xs and the per-token arrays and reuses f
    }
  }
  // the block's column of W tiles: tiles l >= s inside the chunk from wt, the rest zero
  float* W = a.w2 + (std::int64_t(u) * nbc + bc) * a.Q * a.Q + s0;
  for (int il = 0; il < nt; ++il) {
    const bool kept = ns > 0 && hi0 < hi1 && il >= is && il * kTile < q;
    const float* src = wt + (kept ? il - is : 0) * kTile * kLdF;
#pragma unroll
    for (int k = 0; k < kTile * kTile / 4 / kThreads; ++k) {
      const int idx = tid + k * kThreads, l = idx / (kTile / 4), s = (idx % (kTile / 4)) * 4;
      const float4 val = kept ? *reinterpret_cast<const float4*>(src + l * kLdF + s) : make_float4(0.f, 0.f, 0.f, 0.f);
      *reinterpret_cast<float4*>(W + std::int64_t(il * kTile + l) * a.Q + s) = val;
    }
  }
}

// Kernel (either intra-chunk backward form) on its grid: a block per ((row, chunk), run of heads, source tile),
// the source tile outermost in the launch order: the blocks of tile 0, which walk every output tile, start first
// and the short ones fill in behind them.
template <auto Kernel>
void launch_intra(const Args& a, std::size_t bytes, const char* what) {
  const cudaStream_t st = Kokkos::DefaultExecutionSpace().cuda_stream();
  allow_smem<Kernel>(bytes, what);
  const int runs = (a.nh + a.run_len - 1) / a.run_len;
  Kernel<<<dim3(a.batch * a.nc, runs, a.Q / kTile), kThreads, bytes, st>>>(a);
  check_launch(what);
}

// ------------------------------------------------------------------ backward, intra-chunk part: the mma.sync form
//
// The same per-block work as intra_bwd_kernel with the tile pair's products and its elementwise step in registers:
// each warp owns 16 source rows s of the block and forms the transposed tile DX^T = X_s dY_l^T (16 s x 64 l) with
// mma.sync m16n8k16 (bf16 operands, fp32 accumulation), whose accumulator layout is known: the thread of lane
// 4 g + c holds rows s = g, g + 8 and columns l = 8 j + 2 c, + 1 of every 8-wide block j. The elementwise step then
// works on those registers, and K^T = (E o C B^T)^T leaves it as the A operand of A_s += K^T dY_l (an accumulator
// of two adjacent column blocks is an A fragment of one 16-wide k-step), so neither DX nor K goes through shared
// memory, and a tile pair needs two barriers instead of five. The thread-private parts of W (the same thread owns
// the same (l, s) of every tile) accumulate in shared memory without barriers; the sums over s of each row l leave
// the warp by a butterfly that ends with two of them per lane, and the four warps' parts are added by the block.
// ncu at 9526804 (L 65,536, 24 heads, headdim 64, d_state 128, H200): 240 registers and 104 KB of shared memory a
// block (64 KB of it the W parts), so 2 blocks of 4 warps an SM; issue slots busy 26 % of cycles; stall samples
// 26 % fixed-latency dependencies, 23 % global loads (the head's x tile staged at its start, acs per output tile,
// the epilogue's dY), 17 % shared loads, 12 % barriers. Tried and not kept: those loads issued ahead (the next
// head's x by cp.async into the C B^T buffer during the epilogue, acs and the records one tile ahead, the next
// head's first dY tile during the last output tile, the epilogue's dY before its dot products): 1.463-1.473 ms
// against 1.452-1.461 ms in the same run (perf/RESULTS.md, twenty-seventh session).
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// decays exp(d) as 2^(d log2 e), the cumsums scaled by log2 e once per token instead of once per element
using cuda_k::ex2;
using cuda_k::kLog2e;

// Four 8 x 8 bf16 matrices from shared memory (lane i gives the address of row i % 8 of matrix i / 8); TRANS loads
// each transposed.
template <bool TRANS>
__device__ __forceinline__ void ldsm4(unsigned (&r)[4], const bf* p) {
  if constexpr (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

// d += a b for one m16n8k16 tile: a the 16 x 16 A fragment, (b0, b1) the 16 x 8 B fragment.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// (x0, x1) rounded to a bf16 pair hi (x0 in the low half: the lower column of a fragment) and the residuals
// x - hi rounded to the pair lo.
__device__ __forceinline__ void split_bf16(float x0, float x1, unsigned& hi, unsigned& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  const float2 hf = __bfloat1622float2(h);
  const __nv_bfloat162 l = __floats2bfloat162_rn(x0 - hf.x, x1 - hf.y);
  hi = *reinterpret_cast<const unsigned*>(&h);
  lo = *reinterpret_cast<const unsigned*>(&l);
}

// Of v[16] summed over the 8 lanes of equal lane % 4, this lane's two: entries 2 g and 2 g + 1 (g = lane / 4),
// by halving exchanges (14 shuffles).
__device__ __forceinline__ float2 reduce_scatter8(const float (&v)[16]) {
  const int lane = threadIdx.x % 32;
  float r8[8], r4[4];
  const bool u16 = lane & 16, u8 = lane & 8, u4 = lane & 4;
#pragma unroll
  for (int k = 0; k < 8; ++k)
    r8[k] = (u16 ? v[k + 8] : v[k]) + __shfl_xor_sync(0xffffffffu, u16 ? v[k] : v[k + 8], 16);
#pragma unroll
  for (int k = 0; k < 4; ++k)
    r4[k] = (u8 ? r8[k + 4] : r8[k]) + __shfl_xor_sync(0xffffffffu, u8 ? r8[k] : r8[k + 4], 8);
  float2 r;
  r.x = (u4 ? r4[2] : r4[0]) + __shfl_xor_sync(0xffffffffu, u4 ? r4[0] : r4[2], 4);
  r.y = (u4 ? r4[3] : r4[1]) + __shfl_xor_sync(0xffffffffu, u4 ? r4[1] : r4[3], 4);
  return r;
}

constexpr int kLdCB = kTile + 4;  // the C B^T tile's fp32 rows: (l = 2 c, s = g) of a warp's lanes in 32 banks

// xs and dys (bf16), the C B^T tile (fp32), the W parts (Q / 64 tiles x 8 float4 x kThreads), the row sums' warp
// parts (4 x 64), then the per-token arrays (7 words a token: 8 reserved).
__host__ __device__ constexpr std::size_t mma_bwd_smem(int P, int Q) {
  return 2 * std::size_t(kTile) * (P + kPad) * 2 + std::size_t(kTile) * kLdCB * 4 +
         std::size_t(Q / kTile) * 8 * kThreads * 16 + 4 * kTile * 4 + 8 * kTile * 4;
}

template <int PT, bool V4>
__global__ void __launch_bounds__(kThreads, 2) intra_bwd_mma_kernel(const Args a) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int P = PT * 16, ldx = P + kPad, NB = 2 * PT;  // NB: 8-wide column blocks of P
  const int nt = a.Q / kTile;
  bf* xs = reinterpret_cast<bf*>(smem);
  bf* dys = xs + kTile * ldx;
  float* cbs = reinterpret_cast<float*>(dys + kTile * ldx);  // (64 l, kLdCB): C B^T of the tile pair
  float4* wt = reinterpret_cast<float4*>(cbs + kTile * kLdCB);  // ((tile - is) 8 + j) kThreads + tid
  float* rsum = reinterpret_cast<float*>(wt + std::size_t(nt) * 8 * kThreads);  // (4 warps, 64 l)
  float2* lrow = reinterpret_cast<float2*>(rsum + 4 * kTile);  // per row l: (acs_l log2 e, the record's id bits)
  float* acs_s = reinterpret_cast<float*>(lrow + kTile);        // acs_s log2 e
  float* dt_s = acs_s + kTile;
  float* diag = dt_s + kTile;
  float* kss = diag + kTile;  // K(s, s) = (C B^T)(s, s)
  int* rec_s = reinterpret_cast<int*>(kss + kTile);

  const int is = blockIdx.z, s0 = is * kTile, u = blockIdx.y, bc = blockIdx.x;  // tiles s outermost (see launch)
  const int b = bc / a.nc, ch = bc % a.nc, t0 = ch * a.Q, q = min(a.Q, a.L - t0);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, cq = lane % 4;
  const int ns = s0 < q ? min(kTile, q - s0) : 0;
  const std::int64_t nbc = std::int64_t(a.batch) * a.nc;
  const int hi0 = u * a.run_len, hi1 = min(hi0 + a.run_len, a.nh);
  // headdim <= 64: the next tile's dY in registers (8 float4 a thread) while this tile is multiplied; at larger
  // headdims they would not fit beside the accumulators, and the tile is staged after the previous one's barrier
  constexpr bool kPre = PT <= 4;
  constexpr int kPreIt = kPre ? kTile * (P / 4) / kThreads : 1;
  float4 pre[kPreIt];

  if (ns > 0 && hi0 < hi1) {
    const std::int64_t row0 = std::int64_t(b) * a.L, nr = std::int64_t(a.batch) * a.L;
    const int grp = (a.h0 + hi0) / (a.H / a.G);  // a run never straddles a group
    const float* CB = a.cb + (std::int64_t(bc) * a.G + grp) * a.Q * a.Q;
    if (tid < kTile) {
      rec_s[tid] = tid < ns ? (a.seq ? a.seq[row0 + t0 + s0 + tid] : 0) : -1;
      kss[tid] = tid < ns ? CB[std::int64_t(s0 + tid) * a.Q + s0 + tid] : 0.f;
    }
    for (int i = tid; i < (nt - is) * 8 * kThreads; i += kThreads) wt[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    // the row sums of the tile at l0 (nl rows): the four warps' parts added, once a barrier has passed
    auto flush_rows = [&](int hi, int l0, int nl) {
      if (tid < nl)
        a.insum[(std::int64_t(is) * a.nh + hi) * nr + row0 + t0 + l0 + tid] =
            rsum[tid] + rsum[kTile + tid] + rsum[2 * kTile + tid] + rsum[3 * kTile + tid];
    };
    for (int hi = hi0; hi < hi1; ++hi) {
      const int h = a.h0 + hi;
      const float* acs = a.acs + (std::int64_t(b) * a.H + h) * a.L;
      const float* dlt = a.delta + (std::int64_t(b) * a.H + h) * a.L;
      const float* dyh = a.dy + (row0 + t0) * a.ldy + h * P;  // the head's dY at the chunk's first row
      // this thread's groups of 4 of the dY tile at l0 (nl rows) into pre
      auto fetch_dy = [&](int l0, int nl) {
#pragma unroll
        for (int it = 0; it < kPreIt; ++it) {
          const int i = tid + it * kThreads, r = i / (P / 4), c = (i % (P / 4)) * 4;
          pre[it] = r < nl ? load4<V4>(dyh + std::int64_t(l0 + r) * a.ldy + c) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
      };
      if constexpr (kPre) fetch_dy(s0, ns);
      if (tid < kTile) {
        acs_s[tid] = tid < ns ? acs[t0 + s0 + tid] * kLog2e : 0.f;
        dt_s[tid] = tid < ns ? dlt[t0 + s0 + tid] : 0.f;
        diag[tid] = 0.f;
      }
      stage<kTile, P, V4>(xs, ldx, a.xs + (row0 + t0 + s0) * a.ldxs + h * P, a.ldxs, ns, P);
      float acc[NB][4];  // A = K'^T dY: rows s = 16 warp + g (+ 8), columns p = 8 jp + 2 cq (+ 1)
#pragma unroll
      for (int jp = 0; jp < NB; ++jp) acc[jp][0] = acc[jp][1] = acc[jp][2] = acc[jp][3] = 0.f;

      int prev_l0 = -1, prev_nl = 0;
      for (int l0 = s0, jt = 0; l0 < q; l0 += kTile, ++jt) {
        const int nl = min(kTile, q - l0);
        // the tile pair's C B^T (rows l0 .., columns s0 ..: inside the chunk's Q x Q block), in flight during the
        // dY staging
        stage_f32<kTile, kTile, true>(cbs, kLdCB, CB + std::int64_t(l0) * a.Q + s0, a.Q, kTile, kTile);
        cuda_k::cp_async_commit();
        if (prev_l0 >= 0) flush_rows(hi, prev_l0, prev_nl);
        if (tid < kTile)
          lrow[tid] = tid < nl ? make_float2(acs[t0 + l0 + tid] * kLog2e,
                                             __int_as_float(a.seq ? a.seq[row0 + t0 + l0 + tid] : 0))
                               : make_float2(0.f, __int_as_float(-2));
        if constexpr (kPre) {
#pragma unroll
          for (int it = 0; it < kPreIt; ++it) {
            const int i = tid + it * kThreads;
            store4_bf16(dys + (i / (P / 4)) * ldx + (i % (P / 4)) * 4, pre[it]);
          }
        } else {
          stage<kTile, P, V4>(dys, ldx, dyh + std::int64_t(l0) * a.ldy, a.ldy, nl, P);
        }
        cuda_k::cp_async_wait<0>();
        __syncthreads();
        if constexpr (kPre)
          if (l0 + kTile < q) fetch_dy(l0 + kTile, min(kTile, q - l0 - kTile));  // in flight until the next tile

        // DX^T = X_s dY_l^T: A = X_s (rows s, k = p), B^T = dY_l (rows l, k = p)
        float dx[8][4];
#pragma unroll
        for (int j = 0; j < 8; ++j) dx[j][0] = dx[j][1] = dx[j][2] = dx[j][3] = 0.f;
#pragma unroll
        for (int k = 0; k < P; k += 16) {
          unsigned fa[4];
          ldsm4<false>(fa, xs + (16 * warp + lane % 16) * ldx + k + (lane / 16) * 8);
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) {
            unsigned fb[4];
            ldsm4<false>(fb, dys + (16 * jj + lane % 8 + (lane / 16) * 8) * ldx + k + ((lane / 8) % 2) * 8);
            mma_bf16(dx[2 * jj], fa, fb[0], fb[1]);
            mma_bf16(dx[2 * jj + 1], fa, fb[2], fb[3]);
          }
        }

        // the elementwise step on this thread's 32 elements (s = srow[i >> 1], l = 8 j + 2 cq + (i & 1))
        const int lg = l0 - s0;  // an element is on the diagonal where l + lg == s
        int srow[2];
        float as[2], ds[2];
        int rs_[2];
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          srow[hr] = 16 * warp + g + 8 * hr;
          as[hr] = acs_s[srow[hr]];
          ds[hr] = dt_s[srow[hr]];
          rs_[hr] = rec_s[srow[hr]];
        }
        float rsp[16];  // rsp[2 j + e]: this thread's part of row l = 8 j + 2 cq + e's sum over s < l
        unsigned khi[4][4], klo[4][4];  // K^T as the A fragments of the 4 k-steps over l
        // kFull: a tile pair below the diagonal (every s < every l) with all 64 rows l inside the chunk and one
        // record: no mask, record or diagonal test per element
        auto elementwise = [&](auto full_tag) {
          constexpr bool kFull = decltype(full_tag)::value;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            float4* wp = wt + (jt * 8 + j) * kThreads + tid;
            const float4 w4 = *wp;
            float wv[4] = {w4.x, w4.y, w4.z, w4.w}, kv[4];
            rsp[2 * j] = rsp[2 * j + 1] = 0.f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int hr = i >> 1, e = i & 1, ll = 8 * j + 2 * cq + e, sl = srow[hr], dl = ll + lg;
              const float d = dx[j][i];
              const float2 lr = lrow[ll];
              float kk = 0.f;
              // rec_s past the chunk never equals rec_l of a row
              if (kFull || (sl <= dl && rs_[hr] == __float_as_int(lr.y))) {
                const float ev = ex2(fminf(lr.x - as[hr], 0.f));
                if (ev >= a.cutoff) {
                  const float ed = ev * ds[hr], cb = cbs[ll * kLdCB + sl];
                  wv[i] += d * ed;
                  kk = ev * cb;
                  if (kFull || sl < dl) rsp[2 * j + e] += cb * ed * d;
                }
              }
              if (!kFull && sl == dl) {
                diag[sl] = d;
                kk = 0.f;  // the diagonal goes in at fp32 in the epilogue
              }
              kv[i] = kk;
            }
            *wp = make_float4(wv[0], wv[1], wv[2], wv[3]);
            // block j is the half (j & 1) of k-step j / 2: a0 / a1 (rows g / g + 8, k 2 cq ..) from the even block,
            // a2 / a3 from the odd one
            split_bf16(kv[0], kv[1], khi[j / 2][2 * (j & 1)], klo[j / 2][2 * (j & 1)]);
            split_bf16(kv[2], kv[3], khi[j / 2][2 * (j & 1) + 1], klo[j / 2][2 * (j & 1) + 1]);
          }
        };
        if (lg > 0 && nl == kTile && !a.seq)
          elementwise(std::true_type{});
        else
          elementwise(std::false_type{});
        {
          const float2 r = reduce_scatter8(rsp);  // rows l = 8 g + 2 cq, + 1
          *reinterpret_cast<float2*>(rsum + warp * kTile + 8 * g + 2 * cq) = r;
        }
        // A (rows s) += K^T dY_l: B = dY_l (k = l rows, n = p columns), loaded transposed
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
          for (int jp = 0; jp < NB / 2; ++jp) {
            unsigned fb[4];
            ldsm4<true>(fb, dys + (16 * kk + lane % 8 + ((lane / 8) % 2) * 8) * ldx + 16 * jp + (lane / 16) * 8);
            mma_bf16(acc[2 * jp], klo[kk], fb[0], fb[1]);
            mma_bf16(acc[2 * jp], khi[kk], fb[0], fb[1]);
            mma_bf16(acc[2 * jp + 1], klo[kk], fb[2], fb[3]);
            mma_bf16(acc[2 * jp + 1], khi[kk], fb[2], fb[3]);
          }
        }
        __syncthreads();  // every warp is done with dys, cbs and the per-token arrays; rsum is complete
        prev_l0 = l0, prev_nl = nl;
      }
      flush_rows(hi, prev_l0, prev_nl);

      // the head's epilogue on this thread's rows of A: off(s) = X_s . A_s (a row over the 4 lanes of its g),
      // the per-token sums, and dX_s = Delta_s (A_s + K(s, s) dY_s)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int sl = 16 * warp + g + 8 * hr;
        float off = 0.f;
#pragma unroll
        for (int jp = 0; jp < NB; ++jp) {
          const float2 xv =
              __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(xs + sl * ldx + 8 * jp + 2 * cq));
          off += xv.x * acc[jp][2 * hr] + xv.y * acc[jp][2 * hr + 1];
        }
        off += __shfl_xor_sync(0xffffffffu, off, 1);
        off += __shfl_xor_sync(0xffffffffu, off, 2);
        if (sl < ns) {
          if (cq == 0) {
            float* vr = a.v + (std::int64_t(hi) * nr + row0 + t0 + s0 + sl) * 6;
            vr[0] = off + kss[sl] * diag[sl];
            vr[1] = dt_s[sl] * off;
            vr[3] = diag[sl];
          }
          const float* dyr = a.dy + (row0 + t0 + s0 + sl) * a.ldy + h * P + 2 * cq;
          float* dxr = a.dx + (row0 + t0 + s0 + sl) * a.ldd + h * P + 2 * cq;
          float2 gv[NB];
#pragma unroll
          for (int jp = 0; jp < NB; ++jp) {
            if constexpr (V4)
              gv[jp] = *reinterpret_cast<const float2*>(dyr + 8 * jp);
            else
              gv[jp] = make_float2(dyr[8 * jp], dyr[8 * jp + 1]);
          }
          const float d = dt_s[sl], k = kss[sl];
#pragma unroll
          for (int jp = 0; jp < NB; ++jp) {
            const float2 o =
                make_float2(d * (acc[jp][2 * hr] + k * gv[jp].x), d * (acc[jp][2 * hr + 1] + k * gv[jp].y));
            if constexpr (V4)
              *reinterpret_cast<float2*>(dxr + 8 * jp) = o;
            else
              dxr[8 * jp] = o.x, dxr[8 * jp + 1] = o.y;
          }
        }
      }
      __syncthreads();  // before the next head restages xs and the per-token arrays
    }
  }
  // the block's column of W tiles: tiles l >= s inside the chunk from this thread's parts, the rest zero
  float* W = a.w2 + (std::int64_t(u) * nbc + bc) * a.Q * a.Q + s0;
  for (int il = 0; il < nt; ++il) {
    const bool kept = ns > 0 && hi0 < hi1 && il >= is && il * kTile < q;
    if (kept) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float4 w4 = wt[((il - is) * 8 + j) * kThreads + tid];
        const float wv[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
          W[std::int64_t(il * kTile + 8 * j + 2 * cq + (i & 1)) * a.Q + 16 * warp + g + 8 * (i >> 1)] = wv[i];
      }
    } else {
#pragma unroll
      for (int k = 0; k < kTile * kTile / 4 / kThreads; ++k) {
        const int idx = tid + k * kThreads, l = idx / (kTile / 4), s = (idx % (kTile / 4)) * 4;
        *reinterpret_cast<float4*>(W + std::int64_t(il * kTile + l) * a.Q + s) = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
  }
}

// ------------------------------------------------------------------ forward: the chunk scan on mma.sync
//
// One block per (head, (row, chunk)): x of the chunk's tokens and S_in are staged once in bf16 (the WMMA kernel's
// blocks, one per 64-token output tile, staged them up to four times through fp32 slices), and every warp walks
// 16-row output tiles of the chunk (tiles w, 7 - w, 8 + w, 15 - w, ... for warp w, so that the causal work is
// spread evenly) with mma.sync m16n8k16 (bf16 operands, fp32 accumulation). The A operands never touch shared
// memory: each thread loads the fp32 elements its fragment holds (rows g, g + 8 and columns 2 c, 2 c + 1,
// 2 c + 8, 2 c + 9 of a 16 x 16 step: C for the inter-chunk term, C B^T for the intra-chunk one) straight from
// global memory, a step or two at a time with the next in flight (pipelined), applies the decays, mask and Delta
// in registers and rounds them to bf16 pairs; the B operands (S_in rows p, k = n; x rows s, k = s transposed) come
// from shared memory by ldmatrix. The inter-chunk term's factor e_in(l) scales the accumulator's rows instead of
// C's elements. y = acc + D x goes out from the accumulator's registers. At L 65,536, 24 heads, headdim 64,
// d_state 128 on an H200: 0.88 ms against 1.18 ms for the WMMA kernel, bound by the latency of those global loads
// (perf/RESULTS.md, twenty-first session).
template <bool V2>
__device__ __forceinline__ float2 load2(const float* p) {
  if constexpr (V2) return *reinterpret_cast<const float2*>(p);
  return make_float2(p[0], p[1]);
}

template <bool V2>
__device__ __forceinline__ void store2(float* p, float2 v) {
  if constexpr (V2)
    *reinterpret_cast<float2*>(p) = v;
  else
    p[0] = v.x, p[1] = v.y;
}

// (lo, hi) as one bf16 pair, lo in the low half (the lower column of a fragment).
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
}

// dst (rows x cols bf16, row stride ldd) <- scale(r) src(r, c) for r < nr, zero for r >= nr; cols a multiple of 4,
// src rows lds apart (16-byte aligned when V4); NT threads in the block. Up to KB groups of 4 a thread in flight.
template <bool V4, int NT = kThreads, int KB = 8, class Scale>
__device__ __forceinline__ void stage_rows(bf* dst, int ldd, const float* src, std::int64_t lds, int rows, int nr,
                                           int cols, Scale&& scale) {
  const int c4 = cols / 4, total = rows * c4;
  for (int i0 = 0; i0 < total; i0 += KB * NT) {
    float4 v[KB];
#pragma unroll
    for (int j = 0; j < KB; ++j) {
      const int i = i0 + threadIdx.x + j * NT, r = i / c4;
      v[j] = i < total && r < nr ? load4<V4>(src + r * lds + (i % c4) * 4) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int j = 0; j < KB; ++j) {
      const int i = i0 + threadIdx.x + j * NT;
      if (i < total) store4_bf16(dst + (i / c4) * ldd + (i % c4) * 4, scale4(v[j], scale(i / c4)));
    }
  }
}

template <bool V4>
__device__ __forceinline__ void stage_rows(bf* dst, int ldd, const float* src, std::int64_t lds, int rows, int nr,
                                           int cols) {
  stage_rows<V4>(dst, ldd, src, lds, rows, nr, cols, [](int) { return 1.f; });
}

// ------------------------------------------------------------------ forward: chunk states, heads form
//
// One block per (run of up to kStHeads heads of one group, (row, chunk)), kStThreads threads: B of the whole chunk
// (Q x N) is staged once in bf16 and kept for the run's heads; for each head, w o x of the chunk (Q x P, w as in
// chunk_state_kernel) is staged in bf16 and warp j walks the 16-column strips j, j + 8, .. of the state with every
// 16-row fragment of P (WMMA 16 x 16 x 16, bf16 operands, fp32 accumulation), the states stored from the
// accumulators. The tiles form (chunk_state_kernel: one block per 64 columns of the state and head) reads x once
// per 64 columns and B once per head and tile: at headdim 64, d_state 128 and 24 heads a group, 2 reads of x and
// 48 of B per chunk against 1 and 6 here. Measured (perf/RESULTS.md, thirty-sixth session; L 65,536, 24 heads):
// on an H100, 376 us under ncu against 401 us for the tiles form (L2 throughput 55 % against 86 %; DRAM 51 % and
// 48 %; both at 25 % occupancy, 10.5 cycles between a warp's instructions), the SSD forward 1.476 against 1.492 ms;
// on an H200 the same form with the next head's x loaded during the products (reverted: 48 bytes of spills) ran
// 391 against 392 us. Both forms wait on their loads; the next step is to overlap them with the products.
constexpr int kStThreads = 256, kStHeads = 4;
__host__ __device__ constexpr std::size_t cstate_heads_smem(int P, int N, int Q) {
  return std::size_t(Q) * (N + kPad) * 2 + std::size_t(Q) * (P + kPad) * 2 + std::size_t(Q) * 4;
}

template <int PT, bool V4>
__global__ void __launch_bounds__(kStThreads, 2) chunk_state_heads_kernel(const Args a, int hb) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int P = PT * 16, ldxh = P + kPad, kWarps = kStThreads / 32;
  const int ldbh = a.N + kPad;
  bf* bh = reinterpret_cast<bf*>(smem);           // (Q tokens, N): B of the chunk
  bf* xh = bh + std::size_t(a.Q) * ldbh;          // (Q tokens, P): w o x of one head, read as X^T
  float* w = reinterpret_cast<float*>(xh + std::size_t(a.Q) * ldxh);  // (Q)

  const int h0 = blockIdx.x * hb, bc = blockIdx.y;
  const int b = bc / a.nc, ch = bc % a.nc, t0 = ch * a.Q, q = min(a.Q, a.L - t0), g = h0 / (a.H / a.G);
  const int tid = threadIdx.x, warp = tid / 32, kq = (q + 15) / 16 * 16;
  const std::int64_t row0 = std::int64_t(b) * a.L;
  stage_rows<V4, kStThreads, 16>(bh, ldbh, a.xbc + (row0 + t0) * a.ldx + a.b_col + std::int64_t(g) * a.N, a.ldx, a.Q,
                                 q, a.N, [](int) { return 1.f; });
  const int rec_w = state_weight_record(a, row0, ch, t0, q);
  for (int hi = 0; hi < hb; ++hi) {
    const int h = h0 + hi;
    const float* acs = a.acs + (std::int64_t(b) * a.H + h) * a.L;
    const float* dlt = a.delta + (std::int64_t(b) * a.H + h) * a.L;
    const float acs_last = acs[t0 + q - 1];
    for (int s = tid; s < a.Q; s += kStThreads) w[s] = state_weight(a, acs, dlt, acs_last, row0, t0, q, s, rec_w);
    __syncthreads();  // w written; the previous head's products have read xh
    // (16 loads a thread in flight: all of x at headdim 64 and chunk 256)
    stage_rows<V4, kStThreads, 16>(xh, ldxh, a.xs + (row0 + t0) * a.ldxs + std::int64_t(h) * P, a.ldxs, a.Q, q, P,
                                   [w](int r) { return w[r]; });
    __syncthreads();
    float* S = a.states + ((std::int64_t(bc) * a.H + h) * P) * a.N;
    for (int j = warp; j * 16 < a.N; j += kWarps) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[PT];
#pragma unroll
      for (int i = 0; i < PT; ++i) wmma::fill_fragment(acc[i], 0.f);
      for (int kk = 0; kk < kq; kk += 16) state_mma_step<PT>(acc, xh + kk * ldxh, ldxh, bh + kk * ldbh + j * 16, ldbh);
#pragma unroll
      for (int i = 0; i < PT; ++i)
        wmma::store_matrix_sync(S + std::int64_t(i) * 16 * a.N + j * 16, acc[i], a.N, wmma::mem_row_major);
    }
  }
}

// ------------------------------------------------------------------ forward: chunk states, heads form, cp.async ring
//
// StateForm::heads_ring (not the default until an H200 has timed it; ssd_fused.hpp): the heads form with x moved
// through a ring of kSrRing fp32 slices of kSrSl tokens by cp.async, two slices ahead of their use, over the run's
// (head, slice) steps in order, so that the next slices' loads are in flight while this one's products run (the heads
// form stages a head's x with plain loads between its products, and ncu counted it waiting on them at 25 %
// occupancy). Each thread converts the groups of 4 it copied itself to the bf16 slice (Delta- and decay-weighted, as
// in the heads form), a barrier, then warp j multiplies the slice into the accumulators of its 16 columns of the
// state (one strip a warp: d_state up to 128), stored when the head's last slice is in. Needs 16-byte aligned rows of
// x.
constexpr int kSrSl = 32, kSrRing = 3;
__host__ __device__ constexpr std::size_t cstate_ring_smem(int P, int N, int Q, int hb) {
  return std::size_t(Q) * (N + kPad) * 2 + std::size_t(kSrSl) * (P + kPad) * 2 +
         std::size_t(kSrRing) * kSrSl * (P + 4) * 4 + std::size_t(hb) * Q * 4;
}

template <int PT>
__global__ void __launch_bounds__(kStThreads, 2) chunk_state_ring_kernel(const Args a, int hb) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int P = PT * 16, ldxh = P + kPad, ldr = P + 4, C4 = P / 4, kGroups = kSrSl * C4;
  constexpr int kOwn = (kGroups + kStThreads - 1) / kStThreads;  // groups of 4 a thread copies and converts a step
  const int ldbh = a.N + kPad;
  bf* bh = reinterpret_cast<bf*>(smem);                                // (Q tokens, N): B of the chunk
  bf* xh = bh + std::size_t(a.Q) * ldbh;                               // (kSrSl tokens, P): w o x of one slice
  float* ring = reinterpret_cast<float*>(xh + kSrSl * ldxh);          // kSrRing x (kSrSl tokens, P): x, fp32
  float* w = ring + kSrRing * kSrSl * ldr;                             // (hb, Q): the run's weights

  const int h0 = blockIdx.x * hb, bc = blockIdx.y;
  const int b = bc / a.nc, ch = bc % a.nc, t0 = ch * a.Q, q = min(a.Q, a.L - t0), g = h0 / (a.H / a.G);
  const int tid = threadIdx.x, warp = tid / 32;
  const std::int64_t row0 = std::int64_t(b) * a.L;
  const int nsl = (q + kSrSl - 1) / kSrSl, nsteps = hb * nsl;
  const float* xbase = a.xs + (row0 + t0) * a.ldxs + std::int64_t(h0) * P;
  // step t: head h0 + t / nsl, tokens (t % nsl) kSrSl .. of the chunk, into ring slot t % kSrRing
  auto issue = [&](int t) {
    if (t < nsteps) {
      const int s0 = (t % nsl) * kSrSl, ns = min(kSrSl, q - s0);
      float* dst = ring + (t % kSrRing) * kSrSl * ldr;
      const float* src = xbase + std::int64_t(s0) * a.ldxs + (t / nsl) * P;
#pragma unroll
      for (int m = 0; m < kOwn; ++m) {
        const int i = tid + m * kStThreads, r = i / C4, c = (i % C4) * 4;
        const bool in = r < ns;
        if (i < kGroups) cuda_k::cp_async<16>(dst + r * ldr + c, in ? src + r * a.ldxs + c : src, in ? 16 : 0);
      }
    }
    cuda_k::cp_async_commit();  // (an empty group past the last step: the wait below always leaves two)
  };
  issue(0);
  issue(1);
  stage_rows<true, kStThreads, 16>(bh, ldbh, a.xbc + (row0 + t0) * a.ldx + a.b_col + std::int64_t(g) * a.N, a.ldx,
                                   a.Q, q, a.N, [](int) { return 1.f; });
  // the weights of the run's heads, zero past the chunk's tokens
  const int rec_w = state_weight_record(a, row0, ch, t0, q);
  for (int i = tid; i < hb * a.Q; i += kStThreads) {
    const std::int64_t hrow = (std::int64_t(b) * a.H + h0 + i / a.Q) * a.L;
    const float* acs = a.acs + hrow;
    w[i] = state_weight(a, acs, a.delta + hrow, acs[t0 + q - 1], row0, t0, q, i % a.Q, rec_w);
  }
  __syncthreads();  // B and w in place

  const bool mine = warp * 16 < a.N;  // this warp's strip: columns 16 warp .. of the state
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[PT];
#pragma unroll
  for (int i = 0; i < PT; ++i) wmma::fill_fragment(acc[i], 0.f);
  for (int t = 0; t < nsteps; ++t) {
    issue(t + 2);
    cuda_k::cp_async_wait<2>();  // this thread's copies of step t have landed
    const int hi = t / nsl, k = t % nsl, s0 = k * kSrSl;
    const float* src = ring + (t % kSrRing) * kSrSl * ldr;
    const float* wt = w + hi * a.Q + s0;
#pragma unroll
    for (int m = 0; m < kOwn; ++m) {
      const int i = tid + m * kStThreads, r = i / C4, c = (i % C4) * 4;
      if (i < kGroups) {
        const float4 v = *reinterpret_cast<const float4*>(src + r * ldr + c);
        store4_bf16(xh + r * ldxh + c, scale4(v, wt[r]));
      }
    }
    __syncthreads();  // the slice's bf16 tile complete
    if (mine) {
#pragma unroll
      for (int kk = 0; kk < kSrSl; kk += 16)
        state_mma_step<PT>(acc, xh + kk * ldxh, ldxh, bh + (s0 + kk) * ldbh + warp * 16, ldbh);
      if (k == nsl - 1) {  // the head's last slice: its states out, the accumulators cleared for the next head
        float* S = a.states + ((std::int64_t(bc) * a.H + h0 + hi) * P) * a.N + warp * 16;
#pragma unroll
        for (int i = 0; i < PT; ++i) {
          wmma::store_matrix_sync(S + std::int64_t(i) * 16 * a.N, acc[i], a.N, wmma::mem_row_major);
          wmma::fill_fragment(acc[i], 0.f);
        }
      }
    }
    __syncthreads();  // before the tile is rewritten (and this step's ring slot refilled, two steps on)
  }
}

// use(i, f) for the steps i = 0 .. n - 1 of a loop whose operands (4 float2 a step, f) come from fetch(i, f): the
// operands of KB steps are loaded as a block, and the next block is in flight while this one is used, in two
// register buffers taken in turn (no copies between them). A ring of single steps two ahead kept too few loads in
// flight (ncu at 908c59c and 88dc094); KB = 1 here (one step ahead, the registers bounded for 4 blocks an SM) ran
// faster than KB = 2 at headdim 64 (kScanSteps).
template <int KB, class Fetch, class Use>
__device__ __forceinline__ void pipelined(int n, Fetch&& fetch, Use&& use) {
  float2 b0[KB][4], b1[KB][4];
  auto fetch_block = [&](int k0, float2 (&f)[KB][4]) {
#pragma unroll
    for (int i = 0; i < KB; ++i)
      if (k0 + i < n) fetch(k0 + i, f[i]);
  };
  auto use_block = [&](int k0, const float2 (&f)[KB][4]) {
#pragma unroll
    for (int i = 0; i < KB; ++i)
      if (k0 + i < n) use(k0 + i, f[i]);
  };
  fetch_block(0, b0);
  for (int k0 = 0; k0 < n; k0 += 2 * KB) {
    fetch_block(k0 + KB, b1);
    use_block(k0, b0);
    fetch_block(k0 + 2 * KB, b0);
    use_block(k0 + KB, b1);
  }
}

// x (Q x (P + 8) bf16), S_in (P x (N + 8) bf16), then acs log2 e, Delta and the record per token (Q each).
__host__ __device__ constexpr std::size_t scan_mma_smem(int P, int N, int Q) {
  return std::size_t(Q) * (P + kPad) * 2 + std::size_t(P) * (N + kPad) * 2 + 3 * std::size_t(Q) * 4;
}
// The device's opt-in shared-memory limit per block (227 KB on an H100 or H200), asked once.
std::size_t max_block_smem() {
  static const std::size_t bytes = [] {
    int dev = 0, v = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
      v = 48 * 1024;  // the limit every device grants
    return std::size_t(v);
  }();
  return bytes;
}

// Up to headdim 64, single steps with the next one in flight and the registers bounded for 4 blocks an SM (128 a
// thread; ptxas spills 16 to 32 bytes at headdim 64; the shared memory, 56 KB a block at d_state 128 and chunk 256,
// plus 1 KB reserved a block, is exactly the SM's 228 KB at 4 blocks: whether 4 are resident was not checked with
// ncu): the SSD forward ran 1.664 ms against 1.788 ms with two-step blocks bounded for 3 blocks an SM in the same
// run at L 65,536, 24 heads, d_state 128 on an H200 (perf/RESULTS.md, twenty-second session). Wider heads keep
// two-step blocks at 2 blocks an SM (not measured otherwise).
template <int PT>
constexpr int kScanSteps = PT <= 4 ? 1 : 2;
template <int PT>
constexpr int kScanBlocks = PT <= 4 ? 4 : 2;
// Form::mma_ring (the default, ssd_fused.hpp): blocks an SM with the ring's shared memory (kRing stages of 1 KB a
// warp: 16 KB a block, 72 KB with the 56 KB above at headdim 64, d_state 128, chunk 256: 3 blocks an SM). ncu on
// an H200 (one launch at L 65,536, 24 heads): 6.2 cycles between a warp's instructions against 11.1 for the
// register form (whose stalls were mostly on those loads: long scoreboard 4.6 of 10.9), 274 M instructions
// against 224 M, 836 against 906 us; a first form that formed the copies' addresses in every step ran 952 us.
constexpr int kRing = 4;
template <int PT>
constexpr int kRingBlocks = PT <= 4 ? 3 : 2;
__host__ __device__ constexpr std::size_t scan_ring_smem(int P, int N, int Q) {
  return scan_mma_smem(P, N, Q) + std::size_t(kThreads / 32) * kRing * 256 * 4;
}

template <int PT, bool V4, int RS>
__global__ void __launch_bounds__(kThreads, RS == 0 ? kScanBlocks<PT> : kRingBlocks<PT>)
    chunk_scan_mma_kernel(const Args a) {
  static_assert(RS == 0 || (RS >= 2 && (RS & (RS - 1)) == 0 && V4), "a ring of 2^k stages, 16-byte aligned rows");
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int P = PT * 16, ldx = P + kPad, NB = 2 * PT;  // NB: 8-wide column blocks of P
  const int ldn = a.N + kPad;
  bf* xs = reinterpret_cast<bf*>(smem);  // (Q, ldx): x, zero past the chunk's end
  bf* ss = xs + a.Q * ldx;               // (P, ldn): S_in
  float* acs_s = reinterpret_cast<float*>(ss + P * ldn);  // acs log2 e
  float* dt_s = acs_s + a.Q;
  int* rec_s = reinterpret_cast<int*>(dt_s + a.Q);  // -1 past the chunk's end
  [[maybe_unused]] float* ring = reinterpret_cast<float*>(rec_s + a.Q);  // RS: kThreads / 32 x RS stages of 256

  const int h = blockIdx.x, bc = blockIdx.y;
  const int b = bc / a.nc, ch = bc % a.nc, t0 = ch * a.Q, q = min(a.Q, a.L - t0), grp = h / (a.H / a.G);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, cq = lane % 4;
  const std::int64_t row0 = std::int64_t(b) * a.L;
  const float* xg = a.xs + (row0 + t0) * a.ldxs + h * P;  // x of the chunk's first token
  {
    const float* acs = a.acs + (std::int64_t(b) * a.H + h) * a.L + t0;
    const float* dlt = a.delta + (std::int64_t(b) * a.H + h) * a.L + t0;
    for (int i = tid; i < a.Q; i += kThreads) {
      const bool in = i < q;
      acs_s[i] = in ? acs[i] * kLog2e : 0.f;
      dt_s[i] = in ? dlt[i] : 0.f;
      rec_s[i] = in ? (a.seq ? a.seq[row0 + t0 + i] : 0) : -1;
    }
  }
  stage_rows<V4>(xs, ldx, xg, a.ldxs, a.Q, q, P);
  // N % 16 == 0: S_in rows are 16-byte aligned
  stage_rows<true>(ss, ldn, a.states + (std::int64_t(bc) * a.H + h) * P * a.N, a.N, P, P, a.N);
  __syncthreads();

  const int r_in = a.seq ? a.seq[row0 + (ch == 0 ? 0 : t0 - 1)] : 0;
  const float Dh = a.D[h];
  const float* cg0 = a.xbc + (row0 + t0) * a.ldx + a.c_col + grp * a.N;      // C of the chunk
  const float* CB0 = a.cb + (std::int64_t(bc) * a.G + grp) * a.Q * a.Q;      // C B^T of the chunk
  const float *cg = cg0 + 2 * cq, *CB = CB0 + 2 * cq;                        // at column 2 c
  const int nm = (q + 15) / 16;
  // RS: this warp's ring, a stage of 16 rows x 16 floats with the 16-byte piece c of row r at piece
  // c ^ 2 [(r / 2) odd], so that a fragment's 8-byte reads (rows g and g + 8, columns 2 c and 2 c + 8) fall on
  // distinct banks in each half-warp; wr0: where this lane's first copied piece goes (row lane / 2, piece
  // 2 (lane % 2)), rd: where its fragment's 4 pairs are (as the fetches of the RS = 0 form: f[i] at row
  // g + 8 (i % 2), column 2 c + 8 (i / 2))
  [[maybe_unused]] float* ring_w = ring + warp * RS * 256;
  [[maybe_unused]] const int pc0x4 = 8 * (lane % 2);
  [[maybe_unused]] const int wr0 = (lane / 2) * 16 + 4 * ((2 * (lane % 2)) ^ ((((lane / 2) >> 1) & 1) << 1));
  [[maybe_unused]] int rd[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = g + 8 * (i % 2), col = 2 * cq + 8 * (i / 2);
    rd[i] = r * 16 + 4 * ((col / 4) ^ (((r >> 1) & 1) << 1)) + col % 4;
  }
  for (int it = 0; it < a.Q / 64; ++it) {
    const int mt = 4 * it + ((it & 1) ? 3 - warp : warp);
    if (mt >= nm) continue;  // past the short last chunk's end (no barrier below)
    const int r0 = 16 * mt, l[2] = {r0 + g, r0 + g + 8};
    const bool in[2] = {l[0] < q, l[1] < q};
    float acc[NB][4];
    float2 xv[2][NB];  // x of the tile's rows for y's D x, loaded with the diagonal intra-chunk step
#pragma unroll
    for (int j = 0; j < NB; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

    // inter-chunk term: acc = C S_in^T (k = n), then row l scaled by e_in(l); `inter` takes one step of 16
    // columns of C (the A fragment, fp32 pairs), `scale_in` the rows' factors after the last
    auto inter = [&](int k, const float2 (&cur)[4]) {
      const unsigned fa[4] = {pack_bf16(cur[0].x, cur[0].y), pack_bf16(cur[1].x, cur[1].y),
                              pack_bf16(cur[2].x, cur[2].y), pack_bf16(cur[3].x, cur[3].y)};
#pragma unroll
      for (int jj = 0; jj < PT; ++jj) {
        unsigned fb[4];  // S_in rows p = 16 jj .. (k = n): B fragments of column blocks 2 jj and 2 jj + 1
        ldsm4<false>(fb, ss + (16 * jj + lane % 8 + (lane / 16) * 8) * ldn + k + ((lane / 8) % 2) * 8);
        mma_bf16(acc[2 * jj], fa, fb[0], fb[1]);
        mma_bf16(acc[2 * jj + 1], fa, fb[2], fb[3]);
      }
    };
    auto scale_in = [&]() {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        float e = 0.f;
        if (in[hr] && rec_s[l[hr]] == r_in) {
          e = ex2(fminf(acs_s[l[hr]], 0.f));
          e = e < a.cutoff ? 0.f : e;
        }
#pragma unroll
        for (int j = 0; j < NB; ++j) acc[j][2 * hr] *= e, acc[j][2 * hr + 1] *= e;
      }
    };
    // intra-chunk term: acc += M X over the source steps s0 <= r0, M(l, s) = (C B^T)(l, s) exp(acs_l - acs_s)
    // Delta_s for s <= l in l's record and decays at or above the cutoff
    const float al[2] = {acs_s[l[0]], acs_s[l[1]]};
    const int rl[2] = {in[0] ? rec_s[l[0]] : -2, in[1] ? rec_s[l[1]] : -2};  // rows past the end: no source
    // the step at s0 from cur (C B^T at rows l, columns s0 ..); kDiag: the diagonal step (s0 == r0), where s <= l
    // is tested per element
    auto step = [&](int s0, const float2 (&cur)[4], auto diag_tag) {
      constexpr bool kDiag = decltype(diag_tag)::value;
      unsigned fa[4];
#pragma unroll
      for (int kh = 0; kh < 2; ++kh) {  // columns s = s0 + 2 c + 8 kh (+ 1)
        const int s = s0 + 2 * cq + 8 * kh;
        const float2 as = *reinterpret_cast<const float2*>(acs_s + s);
        const float2 ds = *reinterpret_cast<const float2*>(dt_s + s);
        const int2 rs = *reinterpret_cast<const int2*>(rec_s + s);
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const float2 cbv = cur[2 * kh + hr];
          float m[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float ev = ex2(fminf(al[hr] - (e ? as.y : as.x), 0.f));
            const bool keep = (!kDiag || s + e <= l[hr]) && (e ? rs.y : rs.x) == rl[hr] && ev >= a.cutoff;
            m[e] = keep ? (e ? cbv.y : cbv.x) * ev * (e ? ds.y : ds.x) : 0.f;
          }
          fa[2 * kh + hr] = pack_bf16(m[0], m[1]);
        }
      }
#pragma unroll
      for (int jj = 0; jj < PT; ++jj) {
        unsigned fb[4];  // x rows s0 .. s0 + 15, columns 16 jj ..: transposed, B fragments of 2 jj and 2 jj + 1
        ldsm4<true>(fb, xs + (s0 + lane % 8 + ((lane / 8) % 2) * 8) * ldx + 16 * jj + (lane / 16) * 8);
        mma_bf16(acc[2 * jj], fa, fb[0], fb[1]);
        mma_bf16(acc[2 * jj + 1], fa, fb[2], fb[3]);
      }
    };
    // x of the tile's rows for the epilogue, in flight during the diagonal step
    auto load_xv = [&]() {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
#pragma unroll
        for (int j = 0; j < NB; ++j)
          xv[hr][j] = in[hr] ? load2<V4>(xg + std::int64_t(l[hr]) * a.ldxs + 2 * cq + 8 * j) : make_float2(0.f, 0.f);
    };
    if constexpr (RS == 0) {
      {
        const float* c0 = cg + std::int64_t(l[0]) * a.ldx;
        const float* c1 = c0 + 8 * a.ldx;
        auto fetch = [&](int k, float2 (&f)[4]) {
          const float2 z = make_float2(0.f, 0.f);
          f[0] = in[0] ? load2<V4>(c0 + k) : z;
          f[1] = in[1] ? load2<V4>(c1 + k) : z;
          f[2] = in[0] ? load2<V4>(c0 + k + 8) : z;
          f[3] = in[1] ? load2<V4>(c1 + k + 8) : z;
        };
        // blocks of kScanSteps steps (16 columns of C each), the next block in flight
        pipelined<kScanSteps<PT>>(
            a.N / 16, [&](int i, float2(&f)[4]) { fetch(16 * i, f); },
            [&](int i, const float2(&cur)[4]) { inter(16 * i, cur); });
        scale_in();
      }
      const float* cb0 = CB + std::int64_t(l[0]) * a.Q;
      const float* cb1 = cb0 + 8 * a.Q;
      auto fetch = [&](int s0, float2 (&f)[4]) {
        f[0] = load2<true>(cb0 + s0);
        f[1] = load2<true>(cb1 + s0);
        f[2] = load2<true>(cb0 + s0 + 8);
        f[3] = load2<true>(cb1 + s0 + 8);
      };
      // the diagonal step's C B^T in flight from the start; the steps below it in blocks, the next in flight
      float2 dg[4];
      fetch(r0, dg);
      pipelined<kScanSteps<PT>>(
          mt, [&](int i, float2(&f)[4]) { fetch(16 * i, f); },
          [&](int i, const float2(&cur)[4]) { step(16 * i, cur, std::false_type{}); });
      load_xv();
      step(r0, dg, std::true_type{});
    } else {
      // The tile's A operands as one sequence of 16 x 16 fp32 steps: N / 16 of C (columns 16 j), mt of C B^T
      // below the diagonal (columns 16 (j - nI)), then the diagonal's (columns r0), each copied by cp.async into
      // stage j % RS of this warp's ring (above), RS - 1 steps ahead of its use.
      const int nI = a.N / 16, total = nI + mt + 1;
      // the copies of step j (two adjacent 16-byte pieces a lane: row lane / 2 of the step, pieces 2 (lane % 2)
      // and + 1, at this lane's ring offsets wr0 and wr0 ^ 4); an empty group past the last step keeps the count
      // of groups in flight the same for every wait. C's rows past the chunk's end (or the sequence's) read as
      // zeros; C B^T's rows exist for the whole chunk.
      const int rr = r0 + lane / 2;
      const bool cok = rr < q;
      const float* csrc = cok ? cg0 + std::int64_t(rr) * a.ldx + pc0x4 : cg0;
      const float* cbsrc = CB0 + std::int64_t(rr) * a.Q + pc0x4;
      auto issue = [&](int j) {
        if (j < total) {
          float* dst = ring_w + (j & (RS - 1)) * 256;
          const float* src = j < nI ? (cok ? csrc + 16 * j : cg0) : cbsrc + (j < nI + mt ? 16 * (j - nI) : r0);
          const int bytes = j < nI && !cok ? 0 : 16;
          cuda_k::cp_async<16>(dst + wr0, src, bytes);
          cuda_k::cp_async<16>(dst + (wr0 ^ 4), src + 4, bytes);
        }
        cuda_k::cp_async_commit();
      };
      // step j's A fragment from its stage (this lane's offsets rd) once every lane's copies of it have landed,
      // then the copies of step j + RS - 1 into the stage step j - 1 used
      auto advance = [&](int j, float2 (&f)[4]) {
        cuda_k::cp_async_wait<RS - 2>();  // this lane's copies of step j have landed
        __syncwarp();                     // and every lane's; every lane is also done reading step j - 1's stage
        const float* st = ring_w + (j & (RS - 1)) * 256;
#pragma unroll
        for (int i = 0; i < 4; ++i) f[i] = *reinterpret_cast<const float2*>(st + rd[i]);
        issue(j + RS - 1);
      };
#pragma unroll
      for (int j = 0; j < RS - 1; ++j) issue(j);
      float2 cur[4];
      int j = 0;
      for (; j < nI; ++j) {
        advance(j, cur);
        inter(16 * j, cur);
      }
      scale_in();
      for (; j < nI + mt; ++j) {
        advance(j, cur);
        step(16 * (j - nI), cur, std::false_type{});
      }
      advance(j, cur);
      load_xv();
      step(r0, cur, std::true_type{});
      __syncwarp();  // every lane done with the ring before the next tile's copies
    }

    // y = acc + D x for the rows inside the chunk (D_token added per row where given)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      if (!in[hr]) continue;
      float* yr = a.y + (row0 + t0 + l[hr]) * a.ldy + h * P + 2 * cq;
      const float Dl = skip_coef(a, Dh, row0, h, t0 + l[hr]);
#pragma unroll
      for (int j = 0; j < NB; ++j)
        store2<V4>(yr + 8 * j, make_float2(acc[j][2 * hr] + Dl * xv[hr][j].x, acc[j][2 * hr + 1] + Dl * xv[hr][j].y));
    }
  }
}

// ------------------------------------------------------------------ forward, one block walking a row's chunks

// The sequential forward (scan_seq): headdim and chunk 64. Shared memory: C and B of the chunk (fp32, 64 x (N + 4),
// or with kB16 bf16, 64 x (N + 8)), x (64 x 68), S_in in bf16 (64 x (N + 8)), then acs, Delta and the record per
// token. The row strides make every fragment read below touch 32 distinct banks: a lane (g = lane / 4, c = lane % 4)
// reads element (g, c) of C or B (word 4 g + c; bf16: 4 g + c / 2, two lanes a word), (2 c, g) of x or B (8 c + g;
// bf16: 8 c + g / 2), and the bf16 S_in's (g, c) (4 g + c / 2).
constexpr int kSqQ = 64, kSqP = 64;
template <int N, bool kB16 = false>
struct SeqLayout {
  static constexpr int ldc = kB16 ? N + 8 : N + 4, ldx = kSqP + 4, lds = N + 8;
  static constexpr std::size_t cb_bytes = std::size_t(kSqQ) * ldc * (kB16 ? 2 : 4);
  static constexpr std::size_t c_off = 0, b_off = c_off + cb_bytes, x_off = b_off + cb_bytes,
                               s_off = x_off + std::size_t(kSqQ) * ldx * 4,
                               t_off = s_off + std::size_t(kSqP) * lds * 2, bytes = t_off + 3 * std::size_t(kSqQ) * 4;
};

__device__ __forceinline__ unsigned to_tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

// d += a b for one m16n8k8 tile in tf32: a the 16 x 8 A fragment (a0 (g, c), a1 (g + 8, c), a2 (g, c + 4),
// a3 (g + 8, c + 4)), (b0, b1) the 8 x 8 B fragment ((c, g), (c + 4, g)).
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A staged element of B or C as a tf32 operand, and two as a bf16 pair (lo in the low half): from fp32 (rounded
// here) or from bf16 bits (Args::bc16; exact in tf32, whose low mantissa bits are then zero).
__device__ __forceinline__ unsigned tf32_of(float x) { return to_tf32(x); }
__device__ __forceinline__ unsigned tf32_of(std::uint16_t x) { return unsigned(x) << 16; }
__device__ __forceinline__ unsigned bf16_pair(float lo, float hi) { return pack_bf16(lo, hi); }
__device__ __forceinline__ unsigned bf16_pair(std::uint16_t lo, std::uint16_t hi) {
  return unsigned(lo) | unsigned(hi) << 16;
}

// The array B and C are staged from as elements E: fp32 (Args::xbc) or bf16 bits (Args::bc16).
template <class E>
__device__ __forceinline__ const E* bc_base(const Args& a) {
  if constexpr (std::is_same_v<E, float>)
    return a.xbc;
  else
    return a.bc16;
}

// One block of 4 warps per (head, row), walking the row's chunks in order. Warp w owns rows l = 16 w .. 16 w + 15
// of each chunk's output (C B^T, y) and rows p = 16 w .. 16 w + 15 of the state, which stays in its registers as
// mma accumulators from chunk to chunk. Per chunk: S_in to the states (fp32) and to shared memory (bf16); the state
// update S = decay S + (w o x)^T B (S_in stays in shared memory for the outputs); C B^T and C S_in^T over d_state in
// tf32 (one A fragment of C for both); C B^T out, the masked decays M from its accumulators as bf16 A fragments,
// y += M x and D x. The next chunk's C and B are copied (cp.async) once every warp is done with them, during the
// outputs' M x, its x at the chunk's end. kB16: B and C come in bf16 (Args::bc16) and stay so in shared memory.
template <int N, bool kB16>
__global__ void __launch_bounds__(kThreads, 2) scan_seq_kernel(const Args a) {
  using Lay = SeqLayout<N, kB16>;
  using E = std::conditional_t<kB16, std::uint16_t, float>;  // a staged element of B or C
  constexpr int Q = kSqQ, P = kSqP, ldc = Lay::ldc, ldx = Lay::ldx, lds = Lay::lds, NJ = N / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  E* cs = reinterpret_cast<E*>(smem + Lay::c_off);
  E* bs = reinterpret_cast<E*>(smem + Lay::b_off);
  float* xs = reinterpret_cast<float*>(smem + Lay::x_off);
  bf* ss = reinterpret_cast<bf*>(smem + Lay::s_off);
  float* acs_s = reinterpret_cast<float*>(smem + Lay::t_off);
  float* dt_s = acs_s + Q;
  int* rec_s = reinterpret_cast<int*>(dt_s + Q);

  const int h = blockIdx.x, b = blockIdx.y, hpg = a.H / a.G, grp = h / hpg;
  const bool cb_writer = a.cb_out && h % hpg == 0;  // C B^T is per group: its first head writes it
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, cq = lane % 4, r0 = 16 * warp;
  const std::int64_t row0 = std::int64_t(b) * a.L;
  const float* acs_row = a.acs + (std::int64_t(b) * a.H + h) * a.L;
  const float* dlt_row = a.delta + (std::int64_t(b) * a.H + h) * a.L;
  const float Dh = a.D[h];
  const int nc = a.nc;

  // cp.async of chunk ch's C, B and x (fp32: stage_f32, 4 steps unrolled); rows past the sequence's end read as zeros
  auto rows = [&](int ch) { return min(Q, a.L - ch * Q); };
  auto tok0 = [&](int ch) { return row0 + std::int64_t(ch) * Q; };  // the chunk's first token row
  auto issue_bc = [&](E* dst, int ch, std::int64_t col) {
    const E* src = bc_base<E>(a) + tok0(ch) * a.ldx + col + grp * N;
    if constexpr (kB16)
      stage_async<Q, N, kThreads>(dst, ldc, src, a.ldx, rows(ch));
    else
      stage_f32<Q, N, true, 4>(dst, ldc, src, a.ldx, rows(ch), N);
  };
  auto issue_c = [&](int ch) { issue_bc(cs, ch, a.c_col); };
  auto issue_b = [&](int ch) { issue_bc(bs, ch, a.b_col); };
  auto issue_x = [&](int ch) {
    stage_f32<Q, P, true, 4>(xs, ldx, a.xs + tok0(ch) * a.ldxs + h * P, a.ldxs, rows(ch), P);
  };
  // chunk ch's per-token values (thread i < Q: token i) and the record entering it, into registers one chunk ahead
  float nacs = 0.f, ndt = 0.f;
  int nrec = -1, nrin = 0;
  auto fetch_tok = [&](int ch) {
    const int t0 = ch * Q, q = min(Q, a.L - t0);
    if (tid < Q) {
      const bool in = tid < q;
      nacs = in ? acs_row[t0 + tid] : 0.f;
      ndt = in ? dlt_row[t0 + tid] : 0.f;
      nrec = in ? (a.seq ? a.seq[row0 + t0 + tid] : 0) : -1;
    }
    nrin = a.seq ? a.seq[row0 + (ch == 0 ? 0 : t0 - 1)] : 0;
  };

  // the state: st[j] holds S(p, n) at p = r0 + g (entries 0, 1) and r0 + g + 8 (2, 3), n = 8 j + 2 c (+ 1)
  float st[NJ][4];
  {
    const float* S0 = a.init ? a.init + (std::int64_t(b) * a.H + h) * P * N : nullptr;
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const float2 v = S0 ? *reinterpret_cast<const float2*>(S0 + (r0 + g + 8 * hr) * N + 8 * j + 2 * cq)
                            : make_float2(0.f, 0.f);
        st[j][2 * hr] = v.x, st[j][2 * hr + 1] = v.y;
      }
  }
  issue_c(0);
  issue_b(0);
  issue_x(0);
  cuda_k::cp_async_commit();
  fetch_tok(0);

  for (int ch = 0; ch < nc; ++ch) {
    const int t0 = ch * Q, q = min(Q, a.L - t0);
    // S_in of this chunk: to the states (fp32) and to shared memory (bf16, the inter-chunk term's operand)
    {
      float* S = a.write_states ? a.states + ((std::int64_t(b) * nc + ch) * a.H + h) * P * N : nullptr;
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int p = r0 + g + 8 * hr, n = 8 * j + 2 * cq;
          if (S) *reinterpret_cast<float2*>(S + p * N + n) = make_float2(st[j][2 * hr], st[j][2 * hr + 1]);
          *reinterpret_cast<unsigned*>(ss + p * lds + n) = pack_bf16(st[j][2 * hr], st[j][2 * hr + 1]);
        }
    }
    if (tid < Q) acs_s[tid] = nacs, dt_s[tid] = ndt, rec_s[tid] = nrec;
    const int r_in = nrin;
    if (ch + 1 < nc) fetch_tok(ch + 1);
    cuda_k::cp_async_wait<0>();
    __syncthreads();

    // the state: S = [last token in the record entering] exp(acs_last) S + (w o x)^T B, w_s = exp(acs_last - acs_s)
    // Delta_s for s in the last token's record (zero below the cutoff), on bf16 operands
    {
      const float acs_last = acs_s[q - 1];
      const int rec_last = rec_s[q - 1];
      const float cd = rec_last == r_in ? decay(acs_last) : 0.f;
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[j][e] *= cd;
#pragma unroll
      for (int kk = 0; kk < Q / 16; ++kk) {
        unsigned fa[4];  // (w o x)^T: rows p = r0 + g (+ 8), columns s = 16 kk + 8 kh + 2 c (+ 1)
#pragma unroll
        for (int kh = 0; kh < 2; ++kh) {
          const int s = 16 * kk + 8 * kh + 2 * cq;
          float w[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int se = s + e;
            float v = 0.f;
            if (se < q && rec_s[se] == rec_last) {
              const float ev = decay(acs_last - acs_s[se]);
              v = ev < a.cutoff ? 0.f : ev * dt_s[se];
            }
            w[e] = v;
          }
          const float* xp = xs + s * ldx + r0 + g;
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) fa[2 * kh + hr] = pack_bf16(xp[8 * hr] * w[0], xp[ldx + 8 * hr] * w[1]);
        }
#pragma unroll
        for (int j = 0; j < NJ; ++j) {  // B rows s = 16 kk + 2 c (+ 1, + 8, + 9), column n = 8 j + g
          const E* bp = bs + (16 * kk + 2 * cq) * ldc + 8 * j + g;
          mma_bf16(st[j], fa, bf16_pair(bp[0], bp[ldc]), bf16_pair(bp[8 * ldc], bp[9 * ldc]));
        }
      }
    }
    // C B^T (columns s) and C S_in^T (columns p) over k = n in tf32: rows l = r0 + g (entries 0, 1), + 8 (2, 3)
    float cb[8][4], y[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) cb[j][e] = y[j][e] = 0.f;
    {
      const E* c0 = cs + (r0 + g) * ldc + cq;
      const unsigned short* sb = reinterpret_cast<const unsigned short*>(ss) + g * lds + cq;
#pragma unroll 2
      for (int k0 = 0; k0 < N; k0 += 8) {
        const unsigned fa[4] = {tf32_of(c0[k0]), tf32_of(c0[8 * ldc + k0]), tf32_of(c0[k0 + 4]),
                                tf32_of(c0[8 * ldc + k0 + 4])};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const E* bp = bs + (8 * j + g) * ldc + cq + k0;
          mma_tf32(cb[j], fa, tf32_of(bp[0]), tf32_of(bp[4]));
          const unsigned short* sp = sb + 8 * j * lds + k0;
          mma_tf32(y[j], fa, unsigned(sp[0]) << 16, unsigned(sp[4]) << 16);
        }
      }
    }
    __syncthreads();  // every warp done with C, B and S_in: the next chunk's C and B can come
    if (ch + 1 < nc) issue_c(ch + 1), issue_b(ch + 1);
    cuda_k::cp_async_commit();

    const int l[2] = {r0 + g, r0 + g + 8};
    if (cb_writer) {
      float* CBo = a.cb_out + ((std::int64_t(b) * nc + ch) * a.G + grp) * Q * Q;
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
          *reinterpret_cast<float2*>(CBo + l[hr] * Q + 8 * j + 2 * cq) = make_float2(cb[j][2 * hr], cb[j][2 * hr + 1]);
    }
    const float al[2] = {acs_s[l[0]], acs_s[l[1]]};
    const int rl[2] = {l[0] < q ? rec_s[l[0]] : -2, l[1] < q ? rec_s[l[1]] : -2};  // rows past the end: no source
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {  // the inter-chunk term scaled by e_in(l)
      float e = 0.f;
      if (rl[hr] == r_in) {
        e = decay(al[hr]);
        e = e < a.cutoff ? 0.f : e;
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) y[j][2 * hr] *= e, y[j][2 * hr + 1] *= e;
    }
    // y += M x over the source steps up to the warp's rows: M(l, s) = (C B^T)(l, s) exp(acs_l - acs_s) Delta_s for
    // s <= l in l's record and decays at or above the cutoff, packed from the C B^T accumulators (columns
    // 16 kk + 8 kh + 2 c (+ 1) are entries of cb[2 kk + kh]) as the A fragment
#pragma unroll
    for (int kk = 0; kk < Q / 16; ++kk) {
      if (kk > warp) break;
      unsigned fa[4];
#pragma unroll
      for (int kh = 0; kh < 2; ++kh) {
        const int s = 16 * kk + 8 * kh + 2 * cq;
        const float2 as = *reinterpret_cast<const float2*>(acs_s + s);
        const float2 ds = *reinterpret_cast<const float2*>(dt_s + s);
        const int2 rs = *reinterpret_cast<const int2*>(rec_s + s);
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          float m[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float ev = decay(al[hr] - (e ? as.y : as.x));
            const bool keep = s + e <= l[hr] && (e ? rs.y : rs.x) == rl[hr] && ev >= a.cutoff;
            m[e] = keep ? cb[2 * kk + kh][2 * hr + e] * ev * (e ? ds.y : ds.x) : 0.f;
          }
          fa[2 * kh + hr] = pack_bf16(m[0], m[1]);
        }
      }
#pragma unroll
      for (int jp = 0; jp < 8; ++jp) {  // x rows s = 16 kk + 2 c (+ 1, + 8, + 9), column p = 8 jp + g
        const float* xp = xs + (16 * kk + 2 * cq) * ldx + 8 * jp + g;
        mma_bf16(y[jp], fa, pack_bf16(xp[0], xp[ldx]), pack_bf16(xp[8 * ldx], xp[9 * ldx]));
      }
    }
    // y = acc + D x for the rows inside the chunk
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      if (l[hr] >= q) continue;
      float* yr = a.y + (row0 + t0 + l[hr]) * a.ldy + h * P + 2 * cq;
      const float Dl = skip_coef(a, Dh, row0, h, t0 + l[hr]);
      const float* xr = xs + l[hr] * ldx + 2 * cq;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 xv = *reinterpret_cast<const float2*>(xr + 8 * j);
        *reinterpret_cast<float2*>(yr + 8 * j) = make_float2(y[j][2 * hr] + Dl * xv.x, y[j][2 * hr + 1] + Dl * xv.y);
      }
    }
    __syncthreads();  // every warp done with x and the token arrays: the next chunk's x can come
    if (ch + 1 < nc) issue_x(ch + 1);
    cuda_k::cp_async_commit();
  }
  if (a.final_state) {
    float* S = a.final_state + (std::int64_t(b) * a.H + h) * P * N;
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
        *reinterpret_cast<float2*>(S + (r0 + g + 8 * hr) * N + 8 * j + 2 * cq) =
            make_float2(st[j][2 * hr], st[j][2 * hr + 1]);
  }
}

// ------------------------------------------------------------------ backward, one block walking a row's chunks back

// es (the decay to the chunk's end), e_in (from the chunk's start) and Delta of token l0 + i of chunk ch (starting
// at row row0 + t0, q tokens), head h, as (x, y, z); zero where i >= nl. (The reverse walks below and the state
// epilogue and bc_backward further on.)
__device__ __forceinline__ float3 token_factors(const Args& a, int b, int h, int ch, std::int64_t row0, int t0, int q,
                                                int l0, int nl, int i) {
  float es = 0.f, ein = 0.f, d = 0.f;
  if (i < nl) {
    const float* acs = a.acs + (std::int64_t(b) * a.H + h) * a.L;
    const int t = t0 + l0 + i, last = t0 + q - 1;
    const int r = a.seq ? a.seq[row0 + t] : 0, r_last = a.seq ? a.seq[row0 + last] : 0;
    const int r_in = a.seq ? a.seq[row0 + (ch == 0 ? 0 : t0 - 1)] : 0;
    es = r == r_last ? decay(acs[last] - acs[t]) : 0.f;
    ein = r == r_in ? decay(acs[t]) : 0.f;
    es = es < a.cutoff ? 0.f : es;
    ein = ein < a.cutoff ? 0.f : ein;
    d = a.delta[(std::int64_t(b) * a.H + h) * a.L + t];
  }
  return make_float3(es, ein, d);
}

// The backward's state passing in one pass (dstates_seq): dH(c), the gradient of the state at chunk c's end, from
// the last chunk to the first,
//   dH(nc - 1) = dL/d(final state),   dH(c - 1) = [last token of c in the record entering c] exp(acs_last) dH(c)
//                                                 + sum_{l in c, record entering c} e_in(l) dY_l^T C_l
// and dL/d(initial state) = dH(-1). It replaces the chunk-local products (chunk_state with ein_weights, every
// chunk in parallel, written to device memory) and the reverse state passing that read and wrote them again. One
// block of 4 warps per (64 columns n0 .. of d_state, head, row); warp w owns rows p = 16 w .. 16 w + 15 of the
// tile, which stays in its registers as mma accumulators from chunk to chunk. Per chunk: dH out (fp32), the decay,
// then the chunk's product over its tokens on bf16 operands (fp32 accumulation), the A fragments (e_in o dY)^T and
// the B fragments C read from the fp32 staging (the same bank-free strides as scan_seq's x and B). The next
// chunk's dY and C columns arrive by cp.async in a second buffer while the current one is multiplied; its e_in and
// decay are formed one chunk ahead in registers. Shared memory: two buffers of dY (64 x 68) and C (64 x 68) fp32,
// then e_in of two chunks: 70 KB, three blocks an SM. (H100, the Mamba-3 block of 8 x 8,192 tokens, 24 heads,
// d_state 128: 0.763 ms where the chunk-local products and the state passing took 0.711 + 0.654 ms; perf/RESULTS.md,
// thirty-ninth session.)
constexpr int kDsT = 64, kDsLd = kDsT + 4;
constexpr std::size_t kDsBuf = 2 * std::size_t(kSqQ) * kDsLd;  // floats a buffer: dY, then C
constexpr std::size_t kDsSmem = (2 * kDsBuf + 2 * kSqQ) * 4;

__global__ void __launch_bounds__(kThreads, 3) dstates_seq_kernel(const Args a) {
  constexpr int Q = kSqQ, P = kSqP, ld = kDsLd;
  extern __shared__ __align__(128) unsigned char smem[];
  float* buf = reinterpret_cast<float*>(smem);
  float* ein_s = buf + 2 * kDsBuf;  // (2, Q): e_in of the chunks in buffers 0 and 1

  const int n0 = blockIdx.x * kDsT, h = blockIdx.y, b = blockIdx.z, grp = h / (a.H / a.G);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, cq = lane % 4, r0 = 16 * warp;
  const std::int64_t row0 = std::int64_t(b) * a.L, PN = std::int64_t(P) * a.N;
  const float* acs_row = a.acs + (std::int64_t(b) * a.H + h) * a.L;
  const int nc = a.nc;
  auto rows = [&](int ch) { return min(Q, a.L - ch * Q); };
  auto tok0 = [&](int ch) { return row0 + std::int64_t(ch) * Q; };
  // cp.async of chunk ch's dY (the head's P columns) and C (the tile's columns) into buffer ch & 1; rows past the
  // sequence's end read as zeros
  auto issue = [&](int ch) {
    float* ys = buf + (ch & 1) * kDsBuf;
    stage_f32<Q, P, true, 4>(ys, ld, a.dy + tok0(ch) * a.ldy + h * P, a.ldy, rows(ch), P);
    stage_f32<Q, kDsT, true, 4>(ys + Q * ld, ld, a.xbc + tok0(ch) * a.ldx + a.c_col + std::int64_t(grp) * a.N + n0,
                                a.ldx, rows(ch), kDsT);
    cuda_k::cp_async_commit();
  };
  // chunk ch's e_in of token tid (threads < Q; zero past the chunk, outside the record entering it or below the
  // cutoff: token_factors) and its decay factor cd (every thread)
  float ein = 0.f, cd = 0.f;
  auto factors = [&](int ch) {
    const int t0 = ch * Q, q = rows(ch);
    const int r_in = a.seq ? a.seq[row0 + (ch == 0 ? 0 : t0 - 1)] : 0;
    const int r_last = a.seq ? a.seq[row0 + t0 + q - 1] : 0;
    cd = r_last == r_in ? decay(acs_row[t0 + q - 1]) : 0.f;
    ein = token_factors(a, b, h, ch, row0, t0, q, 0, q, tid).y;
  };

  // dh[j] holds dH(p, n) at p = r0 + g (entries 0, 1) and r0 + g + 8 (2, 3), n = n0 + 8 j + 2 c (+ 1)
  float dh[kDsT / 8][4];
  {
    const float* D0 = a.dfinal ? a.dfinal + (std::int64_t(b) * a.H + h) * PN + n0 : nullptr;
#pragma unroll
    for (int j = 0; j < kDsT / 8; ++j)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const float2 v = D0 ? *reinterpret_cast<const float2*>(D0 + (r0 + g + 8 * hr) * a.N + 8 * j + 2 * cq)
                            : make_float2(0.f, 0.f);
        dh[j][2 * hr] = v.x, dh[j][2 * hr + 1] = v.y;
      }
  }
  issue(nc - 1);
  factors(nc - 1);

  for (int ch = nc - 1; ch >= 0; --ch) {
    {  // dH at chunk ch's end
      float* D = a.dstates_out + ((std::int64_t(b) * nc + ch) * a.H + h) * PN + n0;
#pragma unroll
      for (int j = 0; j < kDsT / 8; ++j)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
          *reinterpret_cast<float2*>(D + (r0 + g + 8 * hr) * a.N + 8 * j + 2 * cq) =
              make_float2(dh[j][2 * hr], dh[j][2 * hr + 1]);
    }
    if (tid < Q) ein_s[(ch & 1) * Q + tid] = ein;
    const float cdc = cd;
    cuda_k::cp_async_wait<0>();
    __syncthreads();  // chunk ch's dY, C and e_in visible; every warp done with the other buffer (chunk ch + 1)
    if (ch > 0) {
      issue(ch - 1);
      factors(ch - 1);
    }
    const float* ys = buf + (ch & 1) * kDsBuf;
    const float* cs = ys + Q * ld;
    const float* es = ein_s + (ch & 1) * Q;
#pragma unroll
    for (int j = 0; j < kDsT / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) dh[j][e] *= cdc;
#pragma unroll
    for (int kk = 0; kk < Q / 16; ++kk) {
      unsigned fa[4];  // (e_in o dY)^T: rows p = r0 + g (+ 8), columns l = 16 kk + 8 kh + 2 c (+ 1)
#pragma unroll
      for (int kh = 0; kh < 2; ++kh) {
        const int l = 16 * kk + 8 * kh + 2 * cq;
        const float2 w = *reinterpret_cast<const float2*>(es + l);
        const float* yp = ys + l * ld + r0 + g;
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) fa[2 * kh + hr] = pack_bf16(yp[8 * hr] * w.x, yp[ld + 8 * hr] * w.y);
      }
#pragma unroll
      for (int j = 0; j < kDsT / 8; ++j) {  // C rows l = 16 kk + 2 c (+ 1, + 8, + 9), column n = 8 j + g
        const float* cp = cs + (16 * kk + 2 * cq) * ld + 8 * j + g;
        mma_bf16(dh[j], fa, pack_bf16(cp[0], cp[ld]), pack_bf16(cp[8 * ld], cp[9 * ld]));
      }
    }
  }
  if (a.dinit) {
    float* D = a.dinit + (std::int64_t(b) * a.H + h) * PN + n0;
#pragma unroll
    for (int j = 0; j < kDsT / 8; ++j)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
        *reinterpret_cast<float2*>(D + (r0 + g + 8 * hr) * a.N + 8 * j + 2 * cq) =
            make_float2(dh[j][2 * hr], dh[j][2 * hr + 1]);
  }
}

// ------------------------------------------------------------------ backward, the state terms in one reverse pass

// state_bwd_seq: dstates_seq's reverse walk with the state epilogue folded in, for a block of heads h0 .. h0 + nh - 1
// (the epilogue adds to dX, which the block's intra-chunk backward wrote first). One block of 8 warps per (head,
// row) walks the chunks from the last with dH (P x N) in registers: warp w holds rows p = 16 (w % 4) .. + 15 and,
// in every slice of 32 state columns, the 16 columns 16 (w / 4) .. of it. Per chunk:
//   dH to dstates_out (fp32; bc_backward reads it) and to shared memory (bf16), S_in (the forward's kept states)
//   to shared memory (bf16), wdecay = sum(dH o S_in) in fp32;
//   over the slices of 32 state columns (B and C of the slice by cp.async, the next slice in flight, the chunk's
//   dY with its first slice): T1 += B dH^T and T2 += C S_in^T in tf32 (A fragments from the fp32 slices, B from
//   the bf16 copies: rows l = 16 (w % 4) .., columns p = 32 (w / 4) ..), and the slice's columns of dH take the
//   decay and the chunk's product (e_in o dY)^T C on bf16 operands;
//   per token (state_epilogue's terms): dX_l += D dY_l + Delta_l es_l T1_l, v4(l) = e_in(l) dY_l . T2_l,
//   v5(l) = es(l) X_l . T1_l (and v3(l) = dY_l . X_l with ddot_f32), the two column halves summed through shared
//   memory.
// Shared memory: two slices (B, C: 64 x 36 fp32 each), two dY buffers (64 x 68 fp32), dH and S_in in bf16
// (64 x (N + 8)), the chunk's factors and the halves' partial sums: 106 KB at N = 128, two blocks an SM.
// (H100, the Mamba-3 block as above: 2.628 ms where dstates_seq and the state epilogue took 0.763 + 1.927 ms, about
// 1.7 TB/s on its 4.4 GB; S_in, X and dX are loaded once a chunk without a copy ahead: held in registers over the
// slices they spilled at the 128 registers of two blocks an SM. perf/RESULTS.md, thirty-ninth session.)
// With kB16 (B and C from Args::bc16) the staged slices stay bf16, two slices of 32 columns a buffer (64 x 72:
// each row's 128 bytes one copy, the same 106 KB as fp32; ptxas spills 44 bytes at N = 128). One slice a buffer
// (64 x 40, 64-byte copies, 90 KB, no spills) ran this kernel in 4.9-5.7 ms against 2.4-3.0 ms for two, also with
// the L2 prefetch below; ncu put it at 16 % DRAM throughput and 28 cycles between a warp's instructions, against
// 15 (H200 and H100, perf/RESULTS.md, forty-first session).
constexpr int kSbThreads = 256, kSbSl = 32;
template <int N, bool kB16 = false>
struct SbLayout {
  static constexpr int per = kB16 ? 2 : 1;  // slices a staged buffer
  static constexpr int ldy = kSqP + 4, ldh = N + 8, lds = kSbSl * per + (kB16 ? 8 : 4);
  static constexpr std::size_t slice = 2 * std::size_t(kSqQ) * lds;  // elements: B, then C, of one buffer
  static constexpr std::size_t y_off = 2 * slice * (kB16 ? 2 : 4), h_off = y_off + 2 * std::size_t(kSqQ) * ldy * 4,
                               s_off = h_off + std::size_t(kSqP) * ldh * 2,
                               f_off = s_off + std::size_t(kSqP) * ldh * 2, r_off = f_off + 4 * std::size_t(kSqQ) * 4,
                               bytes = r_off + (3 * std::size_t(kSqQ) + kSbThreads / 32) * 4;
};

template <int N, bool kB16>
__global__ void __launch_bounds__(kSbThreads, 2) state_bwd_seq_kernel(const Args a) {
  using Lay = SbLayout<N, kB16>;
  constexpr int kPer = Lay::per;
  static_assert((N / kSbSl) % kPer == 0, "whole buffers of slices");
  using E = std::conditional_t<kB16, std::uint16_t, float>;  // a staged element of B or C
  constexpr int Q = kSqQ, P = kSqP, NS = N / kSbSl, ldy = Lay::ldy, ldh = Lay::ldh, lds = Lay::lds;
  // bf16 B, C: each copy asks L2 to fetch the head's whole row (N = 128: 256 bytes, two buffers' worth) at once
  // (the form timed against fp32 B, C; its effect alone was not measured)
  constexpr int kPf = !kB16 ? 0 : N * 2 >= 256 ? 256 : 128;
  extern __shared__ __align__(128) unsigned char smem[];
  E* slices = reinterpret_cast<E*>(smem);
  float* ybuf = reinterpret_cast<float*>(smem + Lay::y_off);
  bf* hs = reinterpret_cast<bf*>(smem + Lay::h_off);
  bf* ss = reinterpret_cast<bf*>(smem + Lay::s_off);
  float* ein_s = reinterpret_cast<float*>(smem + Lay::f_off);
  float* es_s = ein_s + Q;
  float* dt_s = es_s + Q;
  float* dl_s = dt_s + Q;
  float* red = reinterpret_cast<float*>(smem + Lay::r_off);  // (64 tokens, 3): the second column half's sums
  float* wsum = red + 3 * Q;

  const int hi = blockIdx.x, h = a.h0 + hi, b = blockIdx.y, grp = h / (a.H / a.G);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, cq = lane % 4;
  const int wc = warp / 4, r0 = 16 * (warp % 4);
  const std::int64_t row0 = std::int64_t(b) * a.L, PN = std::int64_t(P) * N, nr = std::int64_t(a.batch) * a.L;
  const float* acs_row = a.acs + (std::int64_t(b) * a.H + h) * a.L;
  const float Dh = a.D[h];
  const int nc = a.nc;
  auto rows = [&](int ch) { return min(Q, a.L - ch * Q); };
  auto tok0 = [&](int ch) { return row0 + std::int64_t(ch) * Q; };
  // slice sl of chunk ch's B and C into slice buffer `buf`, with sl == 0 the chunk's dY into dY buffer ch & 1
  auto issue = [&](int ch, int sl, int buf) {
    E* bsl = slices + buf * Lay::slice;
    const E* src = bc_base<E>(a) + tok0(ch) * a.ldx + std::int64_t(grp) * N + kSbSl * sl;
    stage_async<Q, kSbSl * kPer, kSbThreads, kPf>(bsl, lds, src + a.b_col, a.ldx, rows(ch));
    stage_async<Q, kSbSl * kPer, kSbThreads, kPf>(bsl + Q * lds, lds, src + a.c_col, a.ldx, rows(ch));
    if (sl == 0)
      stage_async<Q, P, kSbThreads>(ybuf + (ch & 1) * Q * ldy, ldy, a.dy + tok0(ch) * a.ldy + h * P, a.ldy, rows(ch));
    cuda_k::cp_async_commit();
  };
  // chunk ch's factors of token tid (threads < Q; zero past the chunk): e_in, es (zero outside their records or
  // below the cutoff), Delta and the skip coefficient; and the chunk's decay cd (every thread). (token_factors'
  // values, formed here with the record ids and acs_last shared with cd: through token_factors ptxas spilled 52
  // bytes at N = 128 against 4.)
  float f_ein = 0.f, f_es = 0.f, f_dt = 0.f, f_dl = 0.f, f_cd = 0.f;
  auto factors = [&](int ch) {
    const int t0 = ch * Q, q = rows(ch);
    const int r_in = a.seq ? a.seq[row0 + (ch == 0 ? 0 : t0 - 1)] : 0;
    const int r_last = a.seq ? a.seq[row0 + t0 + q - 1] : 0;
    const float acs_last = acs_row[t0 + q - 1];
    f_cd = r_last == r_in ? decay(acs_last) : 0.f;
    f_ein = f_es = f_dt = f_dl = 0.f;
    if (tid < q) {
      const int t = t0 + tid, r = a.seq ? a.seq[row0 + t] : 0;
      const float ac = acs_row[t];
      if (r == r_in) {
        const float e = decay(ac);
        f_ein = e < a.cutoff ? 0.f : e;
      }
      if (r == r_last) {
        const float e = decay(acs_last - ac);
        f_es = e < a.cutoff ? 0.f : e;
      }
      f_dt = a.delta[(std::int64_t(b) * a.H + h) * a.L + t];
      f_dl = skip_coef(a, Dh, row0, h, t);
    }
  };

  // dh[sl][jj] holds dH(p, n) at p = r0 + g (entries 0, 1) and r0 + g + 8 (2, 3), n = 32 sl + 16 wc + 8 jj + 2 c
  float dh[NS][2][4];
  {
    const float* D0 = a.dfinal ? a.dfinal + (std::int64_t(b) * a.H + h) * PN : nullptr;
#pragma unroll
    for (int sl = 0; sl < NS; ++sl)
#pragma unroll
      for (int jj = 0; jj < 2; ++jj)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int p = r0 + g + 8 * hr, n = kSbSl * sl + 16 * wc + 8 * jj + 2 * cq;
          const float2 v = D0 ? *reinterpret_cast<const float2*>(D0 + p * N + n) : make_float2(0.f, 0.f);
          dh[sl][jj][2 * hr] = v.x, dh[sl][jj][2 * hr + 1] = v.y;
        }
  }
  issue(nc - 1, 0, 0);
  factors(nc - 1);
  int buf = 0;  // the slice buffer of the next slice to multiply

  for (int ch = nc - 1; ch >= 0; --ch) {
    const int q = rows(ch);
    const std::int64_t st_off = ((std::int64_t(b) * nc + ch) * a.H + h) * PN;
    {  // dH at chunk ch's end out (fp32) and to hs (bf16), S_in to ss (bf16), this warp's part of sum(dH o S_in);
       // S_in loaded two slices at a time (all of it at once spilled at N = 128: ptxas, 128 registers)
      const float* Sin = a.states + st_off;
      float* Dst = a.dstates_b16 ? nullptr : a.dstates_out + st_off;  // fp32, or bf16 (the copy hs holds) at Db
      std::uint16_t* Db = a.dstates_b16 ? a.dstates_b16 + st_off : nullptr;
      float wd = 0.f;
      constexpr int kHalf = NS / 2;
#pragma unroll
      for (int s0 = 0; s0 < NS; s0 += kHalf) {
        float2 sv[kHalf][2][2];
#pragma unroll
        for (int si = 0; si < kHalf; ++si)
#pragma unroll
          for (int jj = 0; jj < 2; ++jj)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr)
              sv[si][jj][hr] = *reinterpret_cast<const float2*>(
                  Sin + (r0 + g + 8 * hr) * N + kSbSl * (s0 + si) + 16 * wc + 8 * jj + 2 * cq);
#pragma unroll
        for (int si = 0; si < kHalf; ++si)
#pragma unroll
          for (int jj = 0; jj < 2; ++jj)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
              const int p = r0 + g + 8 * hr, n = kSbSl * (s0 + si) + 16 * wc + 8 * jj + 2 * cq;
              const float d0 = dh[s0 + si][jj][2 * hr], d1 = dh[s0 + si][jj][2 * hr + 1];
              const float2 sx = sv[si][jj][hr];
              const unsigned hb2 = pack_bf16(d0, d1);
              if (Dst)
                *reinterpret_cast<float2*>(Dst + p * N + n) = make_float2(d0, d1);
              else
                *reinterpret_cast<unsigned*>(Db + p * N + n) = hb2;
              *reinterpret_cast<unsigned*>(hs + p * ldh + n) = hb2;
              *reinterpret_cast<unsigned*>(ss + p * ldh + n) = pack_bf16(sx.x, sx.y);
              wd += d0 * sx.x + d1 * sx.y;
            }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) wd += __shfl_xor_sync(0xffffffffu, wd, o);
      if (lane == 0) wsum[warp] = wd;
    }
    if (tid < Q) ein_s[tid] = f_ein, es_s[tid] = f_es, dt_s[tid] = f_dt, dl_s[tid] = f_dl;
    const float cd = f_cd;
    float t1[4][4], t2[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) t1[j][e] = t2[j][e] = 0.f;
    const float* ys = ybuf + (ch & 1) * Q * ldy;
    int cur = 0;  // the buffer of slice sl
#pragma unroll
    for (int sl = 0; sl < NS; ++sl) {
      if (sl % kPer == 0) {  // a buffer's first slice
        cuda_k::cp_async_wait<0>();
        __syncthreads();  // its slices (with sl == 0: dY, hs, ss, the factors) visible; the other buffer free
        if (sl + kPer < NS) issue(ch, sl + kPer, buf ^ 1);
        else if (ch > 0) issue(ch - 1, 0, buf ^ 1);
        if (sl == 0 && ch > 0) factors(ch - 1);
        cur = buf;
        buf ^= 1;
      }
      const E* bsl = slices + cur * Lay::slice + kSbSl * (sl % kPer);
      const E* csl = bsl + Q * lds;
      // T1 += B dH^T, T2 += C S_in^T over the slice's columns k in tf32
#pragma unroll
      for (int k0 = 0; k0 < kSbSl; k0 += 8) {
        const E* bp = bsl + (r0 + g) * lds + cq + k0;
        const E* cp = csl + (r0 + g) * lds + cq + k0;
        const unsigned fb[4] = {tf32_of(bp[0]), tf32_of(bp[8 * lds]), tf32_of(bp[4]), tf32_of(bp[8 * lds + 4])};
        const unsigned fc[4] = {tf32_of(cp[0]), tf32_of(cp[8 * lds]), tf32_of(cp[4]), tf32_of(cp[8 * lds + 4])};
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // dH^T and S_in^T: element (k = n, column p) at p ldh + n
          const int off = (32 * wc + 8 * j + g) * ldh + kSbSl * sl + k0 + cq;
          const unsigned short* hp = reinterpret_cast<const unsigned short*>(hs) + off;
          const unsigned short* sp = reinterpret_cast<const unsigned short*>(ss) + off;
          mma_tf32(t1[j], fb, unsigned(hp[0]) << 16, unsigned(hp[4]) << 16);
          mma_tf32(t2[j], fc, unsigned(sp[0]) << 16, unsigned(sp[4]) << 16);
        }
      }
      // the slice's columns of dH: cd dH + (e_in o dY)^T C over the chunk's tokens, bf16 operands
#pragma unroll
      for (int jj = 0; jj < 2; ++jj)
#pragma unroll
        for (int e = 0; e < 4; ++e) dh[sl][jj][e] *= cd;
#pragma unroll
      for (int kk = 0; kk < Q / 16; ++kk) {
        unsigned fa[4];  // (e_in o dY)^T: rows p = r0 + g (+ 8), columns l = 16 kk + 8 kh + 2 c (+ 1)
#pragma unroll
        for (int kh = 0; kh < 2; ++kh) {
          const int l = 16 * kk + 8 * kh + 2 * cq;
          const float2 w = *reinterpret_cast<const float2*>(ein_s + l);
          const float* yp = ys + l * ldy + r0 + g;
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) fa[2 * kh + hr] = pack_bf16(yp[8 * hr] * w.x, yp[ldy + 8 * hr] * w.y);
        }
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {  // C rows l = 16 kk + 2 c (+ 1, + 8, + 9), column 16 wc + 8 jj + g
          const E* cp = csl + (16 * kk + 2 * cq) * lds + 16 * wc + 8 * jj + g;
          mma_bf16(dh[sl][jj], fa, bf16_pair(cp[0], cp[lds]), bf16_pair(cp[8 * lds], cp[9 * lds]));
        }
      }
    }
    // the per-token terms: dX out, this thread's parts of the three dot products, summed over its quad
    // (X and dX loaded here a row at a time: held over the slices they spilled at 128 registers)
    float p3[2] = {0.f, 0.f}, p4[2] = {0.f, 0.f}, p5[2] = {0.f, 0.f};
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int l = r0 + g + 8 * hr;
      const float des = dt_s[l] * es_s[l], Dl = dl_s[l];
      const float* yr = ys + l * ldy + 32 * wc + 2 * cq;
      const float* xr = a.xs + (tok0(ch) + l) * a.ldxs + h * P + 32 * wc + 2 * cq;
      float* dxr = a.dx + (tok0(ch) + l) * a.ldd + h * P + 32 * wc + 2 * cq;
      float2 xv[4], dxv[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        xv[j] = l < q ? *reinterpret_cast<const float2*>(xr + 8 * j) : make_float2(0.f, 0.f);
        dxv[j] = l < q ? *reinterpret_cast<const float2*>(dxr + 8 * j) : make_float2(0.f, 0.f);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 y = *reinterpret_cast<const float2*>(yr + 8 * j), x = xv[j], dx = dxv[j];
        const float a1 = t1[j][2 * hr], b1 = t1[j][2 * hr + 1], a2 = t2[j][2 * hr], b2 = t2[j][2 * hr + 1];
        p5[hr] += x.x * a1 + x.y * b1;
        p4[hr] += y.x * a2 + y.y * b2;
        p3[hr] += y.x * x.x + y.y * x.y;
        if (l < q)
          *reinterpret_cast<float2*>(dxr + 8 * j) = make_float2(dx.x + Dl * y.x + des * a1, dx.y + Dl * y.y + des * b1);
      }
#pragma unroll
      for (int o = 1; o < 4; o <<= 1) {
        p3[hr] += __shfl_xor_sync(0xffffffffu, p3[hr], o);
        p4[hr] += __shfl_xor_sync(0xffffffffu, p4[hr], o);
        p5[hr] += __shfl_xor_sync(0xffffffffu, p5[hr], o);
      }
      if (wc == 1 && cq == 0) red[3 * l] = p3[hr], red[3 * l + 1] = p4[hr], red[3 * l + 2] = p5[hr];
    }
    __syncthreads();  // the second half's sums and every warp's part of wdecay
    if (wc == 0 && cq == 0) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int l = r0 + g + 8 * hr;
        if (l >= q) continue;
        float* vr = a.v + (std::int64_t(hi) * nr + tok0(ch) + l) * 6;
        if (a.ddot_f32) vr[3] = p3[hr] + red[3 * l];
        vr[4] = ein_s[l] * (p4[hr] + red[3 * l + 1]);
        vr[5] = es_s[l] * (p5[hr] + red[3 * l + 2]);
      }
    }
    if (tid == 0 && a.wdecay) {
      float t = 0.f;
#pragma unroll
      for (int w = 0; w < kSbThreads / 32; ++w) t += wsum[w];
      a.wdecay[(std::int64_t(b) * nc + ch) * a.H + h] = t;
    }
    __syncthreads();  // before the next chunk writes hs, ss, the factors, the sums
  }
  if (a.dinit) {
    float* D = a.dinit + (std::int64_t(b) * a.H + h) * PN;
#pragma unroll
    for (int sl = 0; sl < NS; ++sl)
#pragma unroll
      for (int jj = 0; jj < 2; ++jj)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
          *reinterpret_cast<float2*>(D + (r0 + g + 8 * hr) * N + kSbSl * sl + 16 * wc + 8 * jj + 2 * cq) =
              make_float2(dh[sl][jj][2 * hr], dh[sl][jj][2 * hr + 1]);
  }
}

// ------------------------------------------------------------------ backward, the state terms per token

// One block per (64 tokens l, head of the block, (row, chunk)): T1 = B_l dH^T and T2 = C_l S_in^T on tensor cores
// in tf32 (fp32 staging: the arithmetic cuBLAS gave these products before, when they went through device memory as
// two n x H P arrays), then per token
//   dX_l += D dY_l + Delta_l es_l T1_l,   v4(l) = e_in(l) dY_l . T2_l,   v5(l) = es_l X_l . T1_l.
// The products walk d_state in slices of 32 through two shared-memory buffers: the next slice's B, C, dH and S_in
// are in flight (cp.async) while the current one is multiplied. The per-token pass runs 16 threads along a row (a
// warp reads two rows of x, dy and dx as whole 256-byte lines) and sums the dot products over those 16 lanes.
// (ncu on an H200 at 0933312, one slice of 64 staged by plain loads and a thread per half row: 2.52 ms for
// L = 65,536, 24 heads, P 64, N 128; 12 warps per SM with 5.4 of 11 cycles between instructions waiting on loads,
// and 26 % of the sectors moved were excess from the half-row accesses; this form ran 1.39 ms fenced in the same
// benchmark at f9b6d6e, perf/RESULTS.md.)

// The factors of the tokens l0 .. l0 + nl - 1 (token_factors) into shared memory (threads 0 .. 63; zero past nl).
__device__ __forceinline__ void epilogue_factors(const Args& a, int b, int h, int ch, std::int64_t row0, int t0, int q,
                                                 int l0, int nl, float* es_l, float* ein_l, float* dt_l) {
  const int tid = threadIdx.x;
  if (tid >= kTile) return;
  const float3 f = token_factors(a, b, h, ch, row0, t0, q, l0, nl, tid);
  es_l[tid] = f.x;
  ein_l[tid] = f.y;
  dt_l[tid] = f.z;
}

// The per-token pass of the state epilogue over the tokens l0 .. l0 + nl - 1 of the chunk starting at row
// row0 + t0, head h (hi in the call's block), with T1 in f1 and T2 in f2 (64 x P fp32, rows P + 4 apart) and the
// tile's es, e_in and Delta in shared memory:
//   dX_l += D dY_l + Delta_l es_l T1_l,   v4(l) = e_in(l) dY_l . T2_l,   v5(l) = es(l) X_l . T1_l
// (D = D[h] + dtok(l) where dtok is given; with ddot_f32 also v3(l) = dY_l . X_l in fp32).
template <int PT, bool V4>
__device__ __forceinline__ void epilogue_tokens(const Args& a, const float* f1, const float* f2, const float* es_l,
                                                const float* ein_l, const float* dt_l, std::int64_t row0, int t0,
                                                int l0, int nl, int h, int hi, std::int64_t nr) {
  constexpr int P = PT * 16, ldo = P + 4;
  const int tid = threadIdx.x;
  // rows r = tid / 16 + 8 i; lane cq of a row's 16 takes its float4 columns cq, cq + 16, ...; the loads of kRB
  // rows are issued before their stores to dx (see batched())
  constexpr int kTpr = 16, C4 = P / 4, kRowStep = kThreads / kTpr, kCPer = (C4 + kTpr - 1) / kTpr;
  constexpr int kRB = kCPer == 1 ? 4 : 2;
  static_assert(kTile / kRowStep % kRB == 0, "whole batches of rows");
  const int cq = tid % kTpr;
  const float Dh = a.D[h];
  for (int rb = 0; rb < kTile / kRowStep; rb += kRB) {
    float4 x4[kRB][kCPer], dy4[kRB][kCPer], dx4[kRB][kCPer];
#pragma unroll
    for (int i = 0; i < kRB; ++i) {
      const int r = tid / kTpr + (rb + i) * kRowStep;
      const std::int64_t row = row0 + t0 + l0 + r;
#pragma unroll
      for (int j = 0; j < kCPer; ++j) {
        const int p = 4 * (cq + j * kTpr);
        const bool in = r < nl && p < P;
        const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
        x4[i][j] = in ? load4<V4>(a.xs + row * a.ldxs + h * P + p) : z;
        dy4[i][j] = in ? load4<V4>(a.dy + row * a.ldy + h * P + p) : z;
        dx4[i][j] = in ? load4<V4>(a.dx + row * a.ldd + h * P + p) : z;
      }
    }
#pragma unroll
    for (int i = 0; i < kRB; ++i) {
      const int r = tid / kTpr + (rb + i) * kRowStep;
      const std::int64_t row = row0 + t0 + l0 + r;
      float dds = 0.f, win = 0.f, dot = 0.f;
      if (r < nl) {
        float* dxr = a.dx + row * a.ldd + h * P;
        const float des = dt_l[r] * es_l[r], Dl = skip_coef(a, Dh, row0, h, t0 + l0 + r);
#pragma unroll
        for (int j = 0; j < kCPer; ++j) {
          const int p = 4 * (cq + j * kTpr);
          if (p >= P) continue;
          const float4 x = x4[i][j], dy = dy4[i][j], dx = dx4[i][j];
          const float4 t1 = *reinterpret_cast<const float4*>(f1 + r * ldo + p);
          const float4 t2 = *reinterpret_cast<const float4*>(f2 + r * ldo + p);
          dds += x.x * t1.x + x.y * t1.y + x.z * t1.z + x.w * t1.w;
          win += dy.x * t2.x + dy.y * t2.y + dy.z * t2.z + dy.w * t2.w;
          if (a.ddot_f32) dot += dy.x * x.x + dy.y * x.y + dy.z * x.z + dy.w * x.w;
          const float4 o = make_float4(dx.x + Dl * dy.x + des * t1.x, dx.y + Dl * dy.y + des * t1.y,
                                       dx.z + Dl * dy.z + des * t1.z, dx.w + Dl * dy.w + des * t1.w);
          store4<V4>(dxr + p, o);
        }
      }
#pragma unroll
      for (int o = kTpr / 2; o > 0; o >>= 1) {
        dds += __shfl_xor_sync(0xffffffffu, dds, o);
        win += __shfl_xor_sync(0xffffffffu, win, o);
        if (a.ddot_f32) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      }
      if (cq == 0 && r < nl) {
        float* vr = a.v + (std::int64_t(hi) * nr + row0 + t0 + l0 + r) * 6;
        if (a.ddot_f32) vr[3] = dot;
        vr[4] = ein_l[r] * win;
        vr[5] = es_l[r] * dds;
      }
    }
  }
}

__host__ __device__ constexpr std::size_t epi_buf_floats(int P) { return std::size_t(2 * kTile + 2 * P) * kLdS; }
__host__ __device__ constexpr std::size_t epi_stage_bytes(int P) {
  const std::size_t stage = 2 * epi_buf_floats(P) * 4, out = 2 * std::size_t(kTile) * (P + 4) * 4;
  return stage > out ? stage : out;
}
__host__ __device__ constexpr std::size_t epi_smem(int P) { return epi_stage_bytes(P) + 3 * kTile * 4; }

template <int PT, bool V4>
__global__ void __launch_bounds__(kThreads, PT <= 4 ? 3 : 2) state_epilogue_kernel(const Args a) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int P = PT * 16, ldo = P + 4;
  constexpr std::size_t kBuf = epi_buf_floats(P);
  float* buf0 = reinterpret_cast<float*>(smem);  // per buffer: B (64 l, 32 n), C (64 l, 32 n), dH (P, 32 n), S_in
  float* f1 = buf0;                              // T1 (64 l, P), after the products
  float* f2 = buf0 + kTile * ldo;                // T2
  float* es_l = reinterpret_cast<float*>(smem + epi_stage_bytes(P));
  float* ein_l = es_l + kTile;
  float* dt_l = ein_l + kTile;

  const int l0 = blockIdx.x * kTile, hi = blockIdx.y, h = a.h0 + hi, bc = blockIdx.z;
  const int b = bc / a.nc, ch = bc % a.nc, t0 = ch * a.Q, q = min(a.Q, a.L - t0), g = h / (a.H / a.G);
  if (l0 >= q) return;
  const int tid = threadIdx.x, warp = tid / 32, nl = min(kTile, q - l0);
  const std::int64_t row0 = std::int64_t(b) * a.L, nr = std::int64_t(a.batch) * a.L;
  const float* lrow = a.xbc + (row0 + t0 + l0) * a.ldx;
  const std::int64_t PN = std::int64_t(P) * a.N;
  const float* dH = a.dstates + (std::int64_t(bc) * a.H + h) * PN;
  const float* S = a.states + (std::int64_t(bc) * a.H + h) * PN;
  // slice n0 .. n0 + 31 of B, C, dH and S_in into buffer `bi` (N % 16 == 0: dH and S_in rows are 16-byte aligned;
  // B and C rows too when V4)
  auto stage_slice = [&](int bi, int n0) {
    float* bs = buf0 + bi * kBuf;
    float *cs = bs + kTile * kLdS, *hs = cs + kTile * kLdS, *ss = hs + P * kLdS;
    const int nw = min(kSl, a.N - n0);
    stage_f32<kTile, kSl, V4>(bs, kLdS, lrow + a.b_col + g * a.N + n0, a.ldx, nl, nw);
    stage_f32<kTile, kSl, V4>(cs, kLdS, lrow + a.c_col + g * a.N + n0, a.ldx, nl, nw);
    stage_f32<P, kSl, true>(hs, kLdS, dH + n0, a.N, P, nw);
    stage_f32<P, kSl, true>(ss, kLdS, S + n0, a.N, P, nw);
    cuda_k::cp_async_commit();
  };
  stage_slice(0, 0);
  epilogue_factors(a, b, h, ch, row0, t0, q, l0, nl, es_l, ein_l, dt_l);

  wmma::fragment<wmma::accumulator, 16, 16, 8, float> acc1[PT], acc2[PT];
#pragma unroll
  for (int i = 0; i < PT; ++i) {
    wmma::fill_fragment(acc1[i], 0.f);
    wmma::fill_fragment(acc2[i], 0.f);
  }
  const int ns = (a.N + kSl - 1) / kSl;
  for (int sl = 0; sl < ns; ++sl) {
    if (sl + 1 < ns) stage_slice((sl + 1) & 1, (sl + 1) * kSl);
    else cuda_k::cp_async_commit();  // (an empty group: the wait below then always leaves one group in flight)
    cuda_k::cp_async_wait<1>();      // this thread's copies of slice sl have landed
    __syncthreads();                 // ... and everyone's
    const float* bs = buf0 + (sl & 1) * kBuf;
    const float *cs = bs + kTile * kLdS, *hs = cs + kTile * kLdS, *ss = hs + P * kLdS;
    const int nw = min(kSl, a.N - sl * kSl);
    for (int k = 0; k < nw; k += 8) {
      wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> fb, fc;
      wmma::load_matrix_sync(fb, bs + warp * 16 * kLdS + k, kLdS);
      wmma::load_matrix_sync(fc, cs + warp * 16 * kLdS + k, kLdS);
#pragma unroll
      for (int e = 0; e < fb.num_elements; ++e) {
        fb.x[e] = wmma::__float_to_tf32(fb.x[e]);
        fc.x[e] = wmma::__float_to_tf32(fc.x[e]);
      }
#pragma unroll
      for (int i = 0; i < PT; ++i) {
        // dH^T and S_in^T: element (n, p) at p kLdS + n
        wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major> fh, fs;
        wmma::load_matrix_sync(fh, hs + i * 16 * kLdS + k, kLdS);
        wmma::load_matrix_sync(fs, ss + i * 16 * kLdS + k, kLdS);
#pragma unroll
        for (int e = 0; e < fh.num_elements; ++e) {
          fh.x[e] = wmma::__float_to_tf32(fh.x[e]);
          fs.x[e] = wmma::__float_to_tf32(fs.x[e]);
        }
        wmma::mma_sync(acc1[i], fb, fh, acc1[i]);
        wmma::mma_sync(acc2[i], fc, fs, acc2[i]);
      }
    }
    __syncthreads();  // before this buffer is staged again (iteration sl + 1 stages sl + 2 into it)
  }
#pragma unroll
  for (int i = 0; i < PT; ++i) {
    wmma::store_matrix_sync(f1 + warp * 16 * ldo + i * 16, acc1[i], ldo, wmma::mem_row_major);
    wmma::store_matrix_sync(f2 + warp * 16 * ldo + i * 16, acc2[i], ldo, wmma::mem_row_major);
  }
  __syncthreads();
  epilogue_tokens<PT, V4>(a, f1, f2, es_l, ein_l, dt_l, row0, t0, l0, nl, h, hi, nr);
}

// The same with dH and S_in resident: one block per (head of the block, (row, chunk)) walks the chunk's 64-token
// tiles with dH and S_in staged once, in bf16 (rows N + 8 apart), and each tile's B and C in bf16 next to them;
// T1 and T2 then on tensor cores in bf16 (WMMA 16 x 16 x 16, fp32 accumulation) over all of d_state without a
// barrier per slice, into fp32 tiles over the B and C ones. It also writes the chunk's sum(dH o S_in) (wdecay,
// the decay term of the state passing, which the dA pass otherwise reads both arrays again for). Used where its
// shared memory (epr_smem) leaves two blocks an SM; the kernel above otherwise.
__host__ __device__ constexpr std::size_t epr_tiles_bytes(int P, int N) {
  const std::size_t bc = 2 * std::size_t(kTile) * (N + kPad) * 2, t = 2 * std::size_t(kTile) * (P + 4) * 4;
  return align128(bc > t ? bc : t);
}
__host__ __device__ constexpr std::size_t epr_smem(int P, int N) {
  return align128(2 * std::size_t(P) * (N + kPad) * 2) + epr_tiles_bytes(P, N) + 3 * kTile * 4;
}
constexpr std::size_t kEprMaxSmem = 113 * 1024;

template <int PT, bool V4>
__global__ void __launch_bounds__(kThreads, PT <= 4 ? 3 : 2) state_epilogue_res_kernel(const Args a) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float wsum[kThreads / 32];
  constexpr int P = PT * 16, ldo = P + 4;
  const int ldn = a.N + kPad;
  bf* hb = reinterpret_cast<bf*>(smem);  // dH (P, N)
  bf* sb = hb + P * ldn;                 // S_in (P, N)
  unsigned char* tiles = smem + align128(2 * std::size_t(P) * ldn * 2);
  bf* bb = reinterpret_cast<bf*>(tiles);  // B (64 l, N)
  bf* cbt = bb + kTile * ldn;             // C (64 l, N)
  float* f1 = reinterpret_cast<float*>(tiles);  // T1 (64 l, P), over B and C once the products are done
  float* f2 = f1 + kTile * ldo;                 // T2
  float* es_l = reinterpret_cast<float*>(tiles + epr_tiles_bytes(P, a.N));
  float* ein_l = es_l + kTile;
  float* dt_l = ein_l + kTile;

  const int hi = blockIdx.x, h = a.h0 + hi, bc = blockIdx.y;  // heads fastest: a chunk's blocks share B and C in L2
  const int b = bc / a.nc, ch = bc % a.nc, t0 = ch * a.Q, q = min(a.Q, a.L - t0), g = h / (a.H / a.G);
  const int tid = threadIdx.x, warp = tid / 32;
  const std::int64_t row0 = std::int64_t(b) * a.L, nr = std::int64_t(a.batch) * a.L;
  const std::int64_t PN = std::int64_t(P) * a.N;
  const float* dH = a.dstates + (std::int64_t(bc) * a.H + h) * PN;
  const float* S = a.states + (std::int64_t(bc) * a.H + h) * PN;
  constexpr int C4 = kSl / 4;

  // dH and S_in in slices of kSl columns (rows 16-byte aligned: N % 16 == 0), with this thread's part of their dot
  float wd = 0.f;
  for (int n0 = 0; n0 < a.N; n0 += kSl) {
    const int nw = min(kSl, a.N - n0);
    constexpr int kIt = P * C4 / kThreads;
    float4 hv[kIt], sv[kIt];
#pragma unroll
    for (int j = 0; j < kIt; ++j) {
      const int i = tid + j * kThreads, r = i / C4, c = (i % C4) * 4;
      const bool in = c < nw;
      hv[j] = in ? load4<true>(dH + r * a.N + n0 + c) : make_float4(0.f, 0.f, 0.f, 0.f);
      sv[j] = in ? load4<true>(S + r * a.N + n0 + c) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int j = 0; j < kIt; ++j) {
      const int i = tid + j * kThreads, r = i / C4, c = (i % C4) * 4;
      if (c >= nw) continue;  // past column N (a last slice of 16): the row's end and the next row's start
      store4_bf16(hb + r * ldn + n0 + c, hv[j]);
      store4_bf16(sb + r * ldn + n0 + c, sv[j]);
      wd += hv[j].x * sv[j].x + hv[j].y * sv[j].y + hv[j].z * sv[j].z + hv[j].w * sv[j].w;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) wd += __shfl_xor_sync(0xffffffffu, wd, o);
  if (tid % 32 == 0) wsum[warp] = wd;

  for (int l0 = 0; l0 < q; l0 += kTile) {
    const int nl = min(kTile, q - l0);
    const float* lrow = a.xbc + (row0 + t0 + l0) * a.ldx;
    for (int n0 = 0; n0 < a.N; n0 += kSl) {
      const int nw = min(kSl, a.N - n0);
      constexpr int kIt = kTile * C4 / kThreads;
      float4 bv[kIt], cv[kIt];
#pragma unroll
      for (int j = 0; j < kIt; ++j) {
        const int i = tid + j * kThreads, r = i / C4, c = (i % C4) * 4;
        const bool in = r < nl && c < nw;
        const float* src = lrow + std::int64_t(r) * a.ldx + g * a.N + n0 + c;
        bv[j] = in ? load4<V4>(src + a.b_col) : make_float4(0.f, 0.f, 0.f, 0.f);
        cv[j] = in ? load4<V4>(src + a.c_col) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int j = 0; j < kIt; ++j) {
        const int i = tid + j * kThreads, r = i / C4, c = (i % C4) * 4;
        if (c >= nw) continue;  // (as for dH above; rows past nl get zeros)
        store4_bf16(bb + r * ldn + n0 + c, bv[j]);
        store4_bf16(cbt + r * ldn + n0 + c, cv[j]);
      }
    }
    epilogue_factors(a, b, h, ch, row0, t0, q, l0, nl, es_l, ein_l, dt_l);
    __syncthreads();  // the tiles (and, the first time, dH and S_in) are staged

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc1[PT], acc2[PT];
#pragma unroll
    for (int i = 0; i < PT; ++i) {
      wmma::fill_fragment(acc1[i], 0.f);
      wmma::fill_fragment(acc2[i], 0.f);
    }
    for (int k = 0; k < a.N; k += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf, wmma::row_major> fb, fc;
      wmma::load_matrix_sync(fb, bb + warp * 16 * ldn + k, ldn);
      wmma::load_matrix_sync(fc, cbt + warp * 16 * ldn + k, ldn);
#pragma unroll
      for (int i = 0; i < PT; ++i) {
        // dH^T and S_in^T: element (n, p) at p ldn + n
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf, wmma::col_major> fh, fs;
        wmma::load_matrix_sync(fh, hb + i * 16 * ldn + k, ldn);
        wmma::load_matrix_sync(fs, sb + i * 16 * ldn + k, ldn);
        wmma::mma_sync(acc1[i], fb, fh, acc1[i]);
        wmma::mma_sync(acc2[i], fc, fs, acc2[i]);
      }
    }
    __syncthreads();  // every warp is done with B and C: T1 and T2 go over them
#pragma unroll
    for (int i = 0; i < PT; ++i) {
      wmma::store_matrix_sync(f1 + warp * 16 * ldo + i * 16, acc1[i], ldo, wmma::mem_row_major);
      wmma::store_matrix_sync(f2 + warp * 16 * ldo + i * 16, acc2[i], ldo, wmma::mem_row_major);
    }
    __syncthreads();
    epilogue_tokens<PT, V4>(a, f1, f2, es_l, ein_l, dt_l, row0, t0, l0, nl, h, hi, nr);
    __syncthreads();  // before the next tile is staged over T1 and T2 and the factors
  }
  if (tid == 0 && a.wdecay) {
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) t += wsum[w];
    a.wdecay[std::int64_t(bc) * a.H + h] = t;
  }
}

template <int PT, bool V4>
void launch_epilogue(const Args& a) {
  const cudaStream_t st = Kokkos::DefaultExecutionSpace().cuda_stream();
  if (epilogue_writes_wdecay(a.P, a.N)) {  // the resident form
    const std::size_t bytes = epr_smem(PT * 16, a.N);
    allow_smem<state_epilogue_res_kernel<PT, V4>>(bytes, "state epilogue");
    state_epilogue_res_kernel<PT, V4><<<dim3(a.nh, a.batch * a.nc), kThreads, bytes, st>>>(a);
  } else {
    const std::size_t bytes = epi_smem(PT * 16);
    allow_smem<state_epilogue_kernel<PT, V4>>(bytes, "state epilogue");
    state_epilogue_kernel<PT, V4><<<dim3(a.Q / kTile, a.nh, a.batch * a.nc), kThreads, bytes, st>>>(a);
  }
  check_launch("state epilogue");
}

// ------------------------------------------------------------------ backward, dB and dC of whole groups

// bc_backward's shared memory: a bf16 A tile (64 rows by KA = max(P, 64): the scaled X or dY rows, or a 64 x 64
// slice of W2) and a bf16 B tile (KA rows by 128 columns of d_state: dH or S_in, or 64 rows of C or B); the fp32
// staging of a head's state-term operands (64 x P rows of X or dY, P x 128 of dH or S_in), which cp.async fills
// for the next head while the current one is multiplied; the fp32 output tile (64 x 128) over all of these once
// the products are done; then the 64 tokens' row factors of the next head.
constexpr int kNT = 128;  // d_state columns per block
__host__ __device__ constexpr int bcg_ka(int P) { return P > kTile ? P : kTile; }
__host__ __device__ constexpr std::size_t bcg_stage_offset(int P) {
  return align128((std::size_t(kTile) * (bcg_ka(P) + kPad) + std::size_t(bcg_ka(P)) * (kNT + kPad)) * 2);
}
__host__ __device__ constexpr std::size_t bcg_fac_offset(int P, bool one) {
  const std::size_t staged =
      one ? bcg_stage_offset(P) : bcg_stage_offset(P) + (std::size_t(kTile) * (P + 4) + std::size_t(P) * (kNT + 4)) * 4;
  const std::size_t out = std::size_t(kTile) * (kNT + 4) * 4;
  return align128(staged > out ? staged : out);
}
// one: one head a group, no staging, the head's es, e_in and Delta (3 x 64); else the next head's row factors (64)
__host__ __device__ constexpr std::size_t bcg_smem(int P, bool one) {
  return bcg_fac_offset(P, one) + (one ? 3 : 1) * kTile * 4;
}

// dst (ROWS x COLS bf16, row stride ldd) <- src (bf16 bits, rows lds apart) for r < nr, c < nc, zero elsewhere
// (COLS, nc multiples of 4): four elements a group, by 8-byte loads where V8 (src rows and columns 8-byte aligned),
// the loads of up to 8 groups in flight before their stores (as batched()).
template <int ROWS, int COLS, bool V8>
__device__ __forceinline__ void copy_b16(bf* dst, int ldd, const std::uint16_t* src, std::int64_t lds, int nr,
                                         int nc) {
  constexpr int kSteps = own_steps<ROWS, COLS>, kB = batch_of(kSteps);
#pragma unroll
  for (int i0 = 0; i0 < kSteps; i0 += kB) {
    uint2 hv[kB];
#pragma unroll
    for (int it = 0; it < kB; ++it) {
      const int i = threadIdx.x + (i0 + it) * kThreads, r = i / (COLS / 4), c = (i % (COLS / 4)) * 4;
      const std::uint16_t* p = src + std::int64_t(r) * lds + c;
      if (r >= nr || c >= nc)
        hv[it] = make_uint2(0u, 0u);
      else if constexpr (V8)
        hv[it] = *reinterpret_cast<const uint2*>(p);
      else
        hv[it] = make_uint2(unsigned(p[0]) | unsigned(p[1]) << 16, unsigned(p[2]) | unsigned(p[3]) << 16);
    }
#pragma unroll
    for (int it = 0; it < kB; ++it) {
      const int i = threadIdx.x + (i0 + it) * kThreads, r = i / (COLS / 4), c = (i % (COLS / 4)) * 4;
      *reinterpret_cast<uint2*>(dst + r * ldd + c) = hv[it];
    }
  }
}

// acc[j] += fa times the 16 x 16 tile of B at rows kk .., columns 16 j .. of bh (rows ldb apart), for the column
// fragments j inside the nw valid columns (nw a multiple of 16, so the test is the warp's as a whole)
template <int NF, class FragA>
__device__ __forceinline__ void mma_row_tiles(wmma::fragment<wmma::accumulator, 16, 16, 16, float> (&acc)[NF],
                                              const FragA& fa, const bf* bh, int ldb, int kk, int nw) {
#pragma unroll
  for (int j = 0; j < NF; ++j) {
    if (j * 16 >= nw) continue;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, bf, wmma::row_major> fb;
    wmma::load_matrix_sync(fb, bh + kk * ldb + j * 16, ldb);
    wmma::mma_sync(acc[j], fa, fb, acc[j]);
  }
}

// One block per (64 tokens r0 .. r0 + 63 of a chunk and 128 columns n0 .. of d_state, run u of the block (a run is
// a whole group), (row, chunk)); warp w owns rows 16 w .. 16 w + 15 of each output tile and its 8 column fragments.
// For dB, then dC: the state terms of the group's heads, one head at a time over K = P (A = es Delta X or e_in dY
// rows of the head, B = its dH or S_in), then the intra-chunk term over the chunk's 64-token slices that can be
// non-zero (dB: W2^T C over l >= s, the slices from the tile's own on; dC: W2 B over s <= l, the slices up to the
// tile's own; W2 already summed over the run's heads), staged synchronously (loads batched, see batched()); the
// fp32 result goes through shared memory to the output columns, each element written once.
// Groups of several heads (kOne false): the state terms run as a pipeline over the heads, head hh + 1's operands
// arriving by cp.async in the fp32 staging (its row factors in registers) while head hh is multiplied; each thread
// converts the elements it copied itself into the bf16 tiles. One head a group (kOne): the head's factors once for
// both outputs and its operands staged synchronously straight into the bf16 tiles, with no staging, so 3 blocks an
// SM at headdim <= 64 instead of 2. (On an H200, thirty-second session, perf/RESULTS.md: the synchronous form for
// every group size took 17.6 ms a step of the 4 x 8,192 LM (24 heads a group) and the pipeline 14.7 ms; at the
// Mamba-3 block's one head a group the pipeline took 2.72 ms against the synchronous form's 2.20 ms.)
template <int PT, bool V4, bool kOne>
__global__ void __launch_bounds__(kThreads, PT <= 4 ? (kOne ? 3 : 2) : (kOne ? 2 : 1))
    bc_backward_kernel(const Args a) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int P = PT * 16, lda = bcg_ka(P) + kPad, ldb = kNT + kPad, ldo = kNT + 4, NF = kNT / 16;
  constexpr int lsa = P + 4, lsb = kNT + 4;  // fp32 staging rows: 16-byte aligned
  bf* ah = reinterpret_cast<bf*>(smem);
  bf* bh = ah + kTile * lda;
  float* sa = reinterpret_cast<float*>(smem + bcg_stage_offset(P));
  float* sb = sa + kTile * lsa;
  float* outs = reinterpret_cast<float*>(smem);  // after the products
  float* fac = reinterpret_cast<float*>(smem + bcg_fac_offset(P, kOne));  // kOne: es, e_in, Delta

  const int ntl = (a.N + kNT - 1) / kNT, hpg = a.H / a.G;
  const int rt = blockIdx.x / ntl, n0 = (blockIdx.x % ntl) * kNT, u = blockIdx.y, bc = blockIdx.z;
  const int b = bc / a.nc, ch = bc % a.nc, t0 = ch * a.Q, q = min(a.Q, a.L - t0), r0 = rt * kTile;
  if (r0 >= q) return;  // a tile past the short last chunk (the whole block, before any barrier)
  const int g = (a.h0 + u * a.run_len) / hpg;  // the run's group (runs are whole groups here)
  const int nr = min(kTile, q - r0), nw = min(kNT, a.N - n0), nsl = (q + kTile - 1) / kTile;
  const int warp = threadIdx.x / 32, tid = threadIdx.x;
  const std::int64_t row0 = std::int64_t(b) * a.L, rows = row0 + t0;  // the chunk's first token row
  const float* W2 = a.w2 + (std::int64_t(u) * a.batch * a.nc + bc) * a.Q * a.Q;
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  if constexpr (kOne) {  // the one head's factors, for both outputs
    epilogue_factors(a, b, g, ch, row0, t0, q, r0, nr, fac, fac + kTile, fac + 2 * kTile);
    __syncthreads();
  }

  for (int o = 0; o < 2; ++o) {
    const bool dc = o == 1;  // 0: dB, 1: dC
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[NF];
#pragma unroll
    for (int j = 0; j < NF; ++j) wmma::fill_fragment(acc[j], 0.f);
    auto state_product = [&]() {  // acc += the staged head's A tile (64 x P) times its B tile (P x 128)
#pragma unroll
      for (int kk = 0; kk < P; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, bf, wmma::row_major> fa;
        wmma::load_matrix_sync(fa, ah + warp * 16 * lda + kk, lda);
        mma_row_tiles(acc, fa, bh, ldb, kk, nw);
      }
    };
    if constexpr (kOne) {  // the state term of the group's one head (h = g), staged synchronously
      const float* src = dc ? a.dy + (rows + r0) * a.ldy + g * P : a.xs + (rows + r0) * a.ldxs + g * P;
      const std::int64_t lds = dc ? a.ldy : a.ldxs;
      batched<kTile, P>([&](int r, int c) { return r < nr ? load4<V4>(src + r * lds + c) : zero; },
                        [&](int r, int c, float4 v) {
                          store4_bf16(ah + r * lda + c, scale4(v, dc ? fac[kTile + r] : fac[r] * fac[2 * kTile + r]));
                        });
      const std::int64_t soff = (std::int64_t(bc) * a.H + g) * P * a.N + n0;
      if (!dc && a.dstates_b16) {  // dH as state_bwd_seq left it, already bf16: copied as it is
        copy_b16<P, kNT, true>(bh, ldb, a.dstates_b16 + soff, a.N, P, nw);
      } else {
        const float* st = (dc ? a.states : a.dstates) + soff;
        batched<P, kNT>([&](int r, int c) { return c < nw ? load4<true>(st + std::int64_t(r) * a.N + c) : zero; },
                        [&](int r, int c, float4 v) { store4_bf16(bh + r * ldb + c, v); });
      }
      __syncthreads();
      state_product();
      __syncthreads();  // before the intra-chunk term's stages
    } else {  // the pipeline over the group's heads
      // the state terms, K = P a head. issue(hh): head hh's rows and state tile into the staging (one cp.async
      // group; rows of X or dY by plain loads where they are not 16-byte aligned); row_factor(hh): this thread's
      // token's factor of head hh (threads < 64); convert(): the own staged elements into the bf16 tiles.
      auto issue = [&](int hh) {
        asm volatile("" ::: "memory");  // after this thread's reads of the staging (convert): the copies overwrite it
        const int h = g * hpg + hh;
        const float* src = dc ? a.dy + (rows + r0) * a.ldy + h * P : a.xs + (rows + r0) * a.ldxs + h * P;
        stage_f32<kTile, P, V4, 2>(sa, lsa, src, dc ? a.ldy : a.ldxs, nr, P);
        const float* st = (dc ? a.states : a.dstates) + (std::int64_t(bc) * a.H + h) * P * a.N + n0;
        stage_f32<P, kNT, true, 2>(sb, lsb, st, a.N, P, nw);
        cuda_k::cp_async_commit();
      };
      auto row_factor = [&](int hh) {
        const float3 f = token_factors(a, b, g * hpg + hh, ch, row0, t0, q, r0, nr, tid);
        return dc ? f.y : f.x * f.z;
      };
      auto convert = [&]() {
        convert_own<kTile, P, 2>(ah, lda, sa, lsa, [&](int r, int, float4 v) { return scale4(v, fac[r]); });
        convert_own<P, kNT, 2>(bh, ldb, sb, lsb, [](int, int, float4 v) { return v; });
      };
      issue(0);
      if (tid < kTile) fac[tid] = row_factor(0);
      cuda_k::cp_async_wait<0>();
      __syncthreads();  // head 0's factors
      convert();
      float fnext = 0.f;
      if (hpg > 1) {
        issue(1);
        if (tid < kTile) fnext = row_factor(1);
      }
      __syncthreads();  // head 0's tiles
      for (int hh = 0; hh < hpg; ++hh) {
        state_product();
        const bool more = hh + 1 < hpg;
        if (more) {
          if (tid < kTile) fac[tid] = fnext;
          cuda_k::cp_async_wait<0>();  // this thread's copies of head hh + 1 have landed
        }
        __syncthreads();  // the tiles are free, head hh + 1's factors visible
        if (more) {
          convert();
          if (hh + 2 < hpg) {
            issue(hh + 2);
            if (tid < kTile) fnext = row_factor(hh + 2);
          }
          __syncthreads();  // head hh + 1's tiles
        }
      }
    }
    // the intra-chunk term over the slices k of 64 tokens: A = W2 restricted to (l in the l range, s in the s
    // range) as [l][s] (zero where l < s or past the chunk), B = C (dB) or B (dC) rows of the slice
    const int k0 = dc ? 0 : rt, k1 = dc ? rt : nsl - 1;
    for (int k = k0; k <= k1; ++k) {
      const int c0 = k * kTile, nk = min(kTile, q - c0);
      const int l0 = dc ? r0 : c0, s0 = dc ? c0 : r0, nl = dc ? nr : nk, ns = dc ? nk : nr;
      batched<kTile, kTile>(
          [&](int l, int s) { return l < nl ? load4<true>(W2 + std::int64_t(l0 + l) * a.Q + s0 + s) : zero; },
          [&](int l, int s, float4 v) {
            auto m = [&](int i, float x) { return s + i < ns && l0 + l >= s0 + s + i ? x : 0.f; };
            store4_bf16(ah + l * lda + s, make_float4(m(0, v.x), m(1, v.y), m(2, v.z), m(3, v.w)));
          });
      const std::int64_t soff = (rows + c0) * a.ldx + (dc ? a.b_col : a.c_col) + std::int64_t(g) * a.N + n0;
      if (a.bc16) {  // B, C in bf16 (V4: 16-byte rows, so 8-byte groups)
        copy_b16<kTile, kNT, V4>(bh, ldb, a.bc16 + soff, a.ldx, nk, nw);
      } else {
        const float* src = a.xbc + soff;
        batched<kTile, kNT>([&](int r, int c) { return r < nk && c < nw ? load4<V4>(src + r * a.ldx + c) : zero; },
                            [&](int r, int c, float4 v) { store4_bf16(bh + r * ldb + c, v); });
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kTile; kk += 16) {
        if (dc) {  // W2 B: A(l, s) at ah[l lda + s]
          wmma::fragment<wmma::matrix_a, 16, 16, 16, bf, wmma::row_major> fa;
          wmma::load_matrix_sync(fa, ah + warp * 16 * lda + kk, lda);
          mma_row_tiles(acc, fa, bh, ldb, kk, nw);
        } else {  // W2^T C: A(s, l) = W2(l, s) at ah[l lda + s], a column-major fragment
          wmma::fragment<wmma::matrix_a, 16, 16, 16, bf, wmma::col_major> fa;
          wmma::load_matrix_sync(fa, ah + kk * lda + warp * 16, lda);
          mma_row_tiles(acc, fa, bh, ldb, kk, nw);
        }
      }
      __syncthreads();  // before the next slice is staged (or the output tile overwrites the stages)
    }
#pragma unroll
    for (int j = 0; j < NF; ++j)
      if (j * 16 < nw) wmma::store_matrix_sync(outs + warp * 16 * ldo + j * 16, acc[j], ldo, wmma::mem_row_major);
    __syncthreads();
    const std::int64_t o0 = (rows + r0) * a.lddbc + (dc ? a.c_col : a.b_col) + std::int64_t(g) * a.N + n0;
    if (a.dbc_b16) {  // bf16: 8 bytes a step (V4: rows and columns 4-aligned), else four 2-byte stores
      bf* dst = reinterpret_cast<bf*>(a.dbc_b16) + o0;
      for_own<kTile, kNT>([&](int r, int c) {
        if (r >= nr || c >= nw) return;
        const float4 v = *reinterpret_cast<const float4*>(outs + r * ldo + c);
        bf* d = dst + r * a.lddbc + c;
        if constexpr (V4) {
          store4_bf16(d, v);
        } else {
          d[0] = __float2bfloat16_rn(v.x), d[1] = __float2bfloat16_rn(v.y);
          d[2] = __float2bfloat16_rn(v.z), d[3] = __float2bfloat16_rn(v.w);
        }
      });
    } else {
      float* dst = a.dbc + o0;
      for_own<kTile, kNT>([&](int r, int c) {
        if (r < nr && c < nw) store4<V4>(dst + r * a.lddbc + c, *reinterpret_cast<const float4*>(outs + r * ldo + c));
      });
    }
    __syncthreads();  // before dC stages over the output tile
  }
}

std::size_t state_smem(int P, int Q) { return cstate_w_offset(P) + std::size_t(Q) * 4; }
std::size_t scan_smem(int P, int Q) { return scan_tok_offset(P) + 3 * std::size_t(Q) * 4; }

// 16-byte loads and stores when every row start is 16-byte aligned.
// (bc16, where given, as xbc: its rows' starts 16-byte aligned in elements of 2 bytes, for bc_backward's 8-byte
// groups; the sequential kernels' 16-byte copies ask bc16_rows_ok.)
bool aligned4(const Args& a) {
  return aligned16(a.xbc) && aligned16(a.bc16) && aligned16(a.xs) && aligned16(a.y) && a.ldx % 4 == 0 &&
         a.ldxs % 4 == 0 && a.ldy % 4 == 0 && a.b_col % 4 == 0 && a.c_col % 4 == 0;
}

template <int PT, bool V4>
void launch(const Args& a, bool scan) {
  const cudaStream_t st = Kokkos::DefaultExecutionSpace().cuda_stream();
  const std::size_t mma_bytes = scan_mma_smem(PT * 16, a.N, a.Q);
  const std::size_t ring_bytes = scan_ring_smem(PT * 16, a.N, a.Q);
  const bool grid_ok = std::int64_t(a.batch) * a.nc <= 65535;
  if constexpr (V4) {
    if (scan && scan_form == Form::mma_ring && ring_bytes <= max_block_smem() && grid_ok) {
      allow_smem<chunk_scan_mma_kernel<PT, V4, kRing>>(ring_bytes, "chunk scan (mma, ring)");
      chunk_scan_mma_kernel<PT, V4, kRing><<<dim3(a.H, a.batch * a.nc), kThreads, ring_bytes, st>>>(a);
      check_launch("chunk scan (mma, ring)");
      return;
    }
  }
  // (mma_ring where its ring does not apply: the mma form)
  if (scan && scan_form != Form::wmma && mma_bytes <= max_block_smem() && grid_ok) {
    allow_smem<chunk_scan_mma_kernel<PT, V4, 0>>(mma_bytes, "chunk scan (mma)");
    // the heads of a chunk side by side in the launch order: they read the same C and C B^T
    chunk_scan_mma_kernel<PT, V4, 0><<<dim3(a.H, a.batch * a.nc), kThreads, mma_bytes, st>>>(a);
    check_launch("chunk scan (mma)");
  } else if (scan) {
    const dim3 grid((a.Q + kTile - 1) / kTile, a.H, a.batch * a.nc);
    const std::size_t bytes = scan_smem(PT * 16, a.Q);
    allow_smem<chunk_scan_kernel<PT, V4>>(bytes, "chunk scan");
    chunk_scan_kernel<PT, V4><<<grid, kThreads, bytes, st>>>(a);
    check_launch("chunk scan");
  } else if ((state_form == StateForm::heads_ring || (state_form == StateForm::heads && a.H > a.G)) &&
             cstate_heads_smem(PT * 16, a.N, a.Q) <= max_block_smem() && grid_ok) {
    const std::size_t bytes = cstate_heads_smem(PT * 16, a.N, a.Q);
    // a run: the largest count of heads up to kStHeads that divides the heads of a group
    const int hpg = a.H / a.G;
    int hb = hpg < kStHeads ? hpg : kStHeads;
    while (hpg % hb != 0) --hb;
    if constexpr (V4) {  // heads_ring where its rows are aligned, one strip a warp covers d_state, and it fits
      const std::size_t sring_bytes = cstate_ring_smem(PT * 16, a.N, a.Q, hb);
      if (state_form == StateForm::heads_ring && a.N <= 16 * (kStThreads / 32) && sring_bytes <= max_block_smem()) {
        allow_smem<chunk_state_ring_kernel<PT>>(sring_bytes, "chunk state (heads, ring)");
        chunk_state_ring_kernel<PT><<<dim3(a.H / hb, a.batch * a.nc), kStThreads, sring_bytes, st>>>(a, hb);
        check_launch("chunk state (heads, ring)");
        return;
      }
    }
    allow_smem<chunk_state_heads_kernel<PT, V4>>(bytes, "chunk state (heads)");
    chunk_state_heads_kernel<PT, V4><<<dim3(a.H / hb, a.batch * a.nc), kStThreads, bytes, st>>>(a, hb);
    check_launch("chunk state (heads)");
  } else {
    const dim3 grid((a.N + kTile - 1) / kTile, a.H, a.batch * a.nc);
    const std::size_t bytes = state_smem(PT * 16, a.Q);
    allow_smem<chunk_state_kernel<PT, V4>>(bytes, "chunk state");
    chunk_state_kernel<PT, V4><<<grid, kThreads, bytes, st>>>(a);
    check_launch("chunk state");
  }
}

template <int PT>
void launch(const Args& a, bool scan) {
  if (aligned4(a))
    launch<PT, true>(a, scan);
  else
    launch<PT, false>(a, scan);
}

// 16-byte accesses to dy and dx as well.
bool aligned4_bwd(const Args& a) {
  return aligned4(a) && aligned16(a.dy) && aligned16(a.dx) && a.ldd % 4 == 0;
}

template <int PT, bool V4, bool kOne>
void launch_bc(const Args& a, const dim3& grid, cudaStream_t st) {
  const std::size_t bytes = bcg_smem(PT * 16, kOne);
  allow_smem<bc_backward_kernel<PT, V4, kOne>>(bytes, "dB, dC (bc_backward)");
  bc_backward_kernel<PT, V4, kOne><<<grid, kThreads, bytes, st>>>(a);
}

template <int PT>
void launch_bc(const Args& a) {
  const cudaStream_t st = Kokkos::DefaultExecutionSpace().cuda_stream();
  const dim3 grid(((a.Q + kTile - 1) / kTile) * ((a.N + kNT - 1) / kNT), a.nh / a.run_len, a.batch * a.nc);
  // (the bf16 output's 8-byte stores: its start 8-byte aligned, with the row stride and columns multiples of 4)
  const bool out_ok = a.dbc_b16 ? reinterpret_cast<std::uintptr_t>(a.dbc_b16) % 8 == 0 : aligned16(a.dbc);
  const bool v4 = aligned4(a) && aligned16(a.dy) && a.ldy % 4 == 0 && out_ok && a.lddbc % 4 == 0;
  const bool one = a.G == a.H;
  if (v4)
    one ? launch_bc<PT, true, true>(a, grid, st) : launch_bc<PT, true, false>(a, grid, st);
  else
    one ? launch_bc<PT, false, true>(a, grid, st) : launch_bc<PT, false, false>(a, grid, st);
  check_launch("dB, dC (bc_backward)");
}

template <int PT>
void launch_bwd(const Args& a) {
  const bool v4 = aligned4_bwd(a);
  if (intra_form == Form::wmma) {
    const std::size_t bytes = bwd_smem(PT * 16, a.Q);
    v4 ? launch_intra<intra_bwd_kernel<PT, true>>(a, bytes, "intra-chunk backward")
       : launch_intra<intra_bwd_kernel<PT, false>>(a, bytes, "intra-chunk backward");
  } else {
    const std::size_t bytes = mma_bwd_smem(PT * 16, a.Q);
    v4 ? launch_intra<intra_bwd_mma_kernel<PT, true>>(a, bytes, "intra-chunk backward (mma)")
       : launch_intra<intra_bwd_mma_kernel<PT, false>>(a, bytes, "intra-chunk backward (mma)");
  }
}

template <int PT>
void launch_epilogue(const Args& a) {
  if (aligned4_bwd(a))
    launch_epilogue<PT, true>(a);
  else
    launch_epilogue<PT, false>(a);
}

// f(std::integral_constant<int, P / 16>) for a shape the kernels take: the fragments per warp are a template
// argument of every kernel.
template <class F>
void with_tiles(const Args& a, F&& f) {
  require(fits(a.P, a.N, a.Q), "ssd fused", "shape P = ", a.P, ", N = ", a.N, ", Q = ", a.Q, " is not supported");
  switch (a.P / 16) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// The kernels that read B and C in fp32 only.
void refuse_bc16(const Args& a, const char* kernel) {
  require(a.bc16 == nullptr, "ssd fused", kernel, " reads B and C in fp32: bf16 B and C (Args::bc16) are read by the ",
          "sequential forward, state_bwd_seq and bc_backward only");
}

}  // namespace

bool bc16_rows_ok(const Args& a) {
  return a.bc16 == nullptr || (aligned16(a.bc16) && a.ldx % 8 == 0 && a.b_col % 8 == 0 && a.c_col % 8 == 0);
}

bool fits(int headdim, int dstate, int chunk) {
  return headdim % 16 == 0 && headdim >= 16 && headdim <= 128 && dstate % 16 == 0 && dstate >= 16 &&
         chunk % kTile == 0 && chunk <= kMaxChunk;
}

void chunk_state(const Args& a) {
  Kokkos::Profiling::ScopedRegion region("ssd::fused_chunk_state");
  refuse_bc16(a, "chunk state");
  with_tiles(a, [&](auto pt) { launch<decltype(pt)::value>(a, false); });
}

void chunk_scan(const Args& a) {
  Kokkos::Profiling::ScopedRegion region("ssd::fused_chunk_scan");
  refuse_bc16(a, "chunk scan");
  with_tiles(a, [&](auto pt) { launch<decltype(pt)::value>(a, true); });
}

void intra_backward(const Args& a) {
  Kokkos::Profiling::ScopedRegion region("ssd::fused_intra_backward");
  with_tiles(a, [&](auto pt) { launch_bwd<decltype(pt)::value>(a); });
}

void state_epilogue(const Args& a) {
  Kokkos::Profiling::ScopedRegion region("ssd::fused_state_epilogue");
  refuse_bc16(a, "state epilogue");
  with_tiles(a, [&](auto pt) { launch_epilogue<decltype(pt)::value>(a); });
}

bool epilogue_writes_wdecay(int headdim, int dstate) { return epr_smem(headdim, dstate) <= kEprMaxSmem; }

namespace {
long seq_count = 0;
// f(std::integral_constant<int, N>) for the d_state of the sequential kernels (seq_fits: 64 or 128)
template <class F>
decltype(auto) by_dstate(int N, F&& f) {
  if (N == 128) return f(std::integral_constant<int, 128>{});
  return f(std::integral_constant<int, 64>{});
}
std::size_t seq_smem(int N, bool b16) {
  return by_dstate(N, [&](auto n) {
    return b16 ? SeqLayout<decltype(n)::value, true>::bytes : SeqLayout<decltype(n)::value, false>::bytes;
  });
}
// the automatic forms' choice of the sequential kernels: batch x heads (of the call, or of the backward's block)
// fill the SMs (a choice, not a measured crossover)
bool fills_sms(int batch, int heads) { return std::int64_t(batch) * heads >= cuda_k::sm_count(); }
}  // namespace

bool seq_fits(int headdim, int dstate, int chunk) {
  return headdim == kSqP && chunk == kSqQ && (dstate == 64 || dstate == 128);
}

namespace {
// Whether the fused forward of batch x heads of this shape (its rows aligned; B and C in bf16 where b16) takes
// scan_seq: the form as set, the kernel's shapes and shared memory, and under automatic the SMs filled.
bool seq_takes(int batch, int heads, int P, int N, int Q, bool b16) {
  return fwd_form != FwdForm::chunks && seq_fits(P, N, Q) && batch <= 65535 &&
         seq_smem(N, b16) <= max_block_smem() && (fwd_form == FwdForm::sequential || fills_sms(batch, heads));
}
}  // namespace

bool seq_applies(const Args& a) {
  return aligned4(a) && bc16_rows_ok(a) && seq_takes(a.batch, a.H, a.P, a.N, a.Q, a.bc16 != nullptr);
}

void scan_seq(const Args& a) {
  Kokkos::Profiling::ScopedRegion region("ssd::fused_scan_seq");
  require(seq_fits(a.P, a.N, a.Q) && aligned4(a) && bc16_rows_ok(a), "ssd fused",
          "the sequential forward takes headdim 64, chunk 64, d_state 64 or 128 and 16-byte aligned rows (P = ", a.P,
          ", N = ", a.N, ", Q = ", a.Q, ")");
  const cudaStream_t st = Kokkos::DefaultExecutionSpace().cuda_stream();
  const bool b16 = a.bc16 != nullptr;
  const std::size_t bytes = seq_smem(a.N, b16);
  const dim3 grid(a.H, a.batch);
  by_dstate(a.N, [&](auto n) {
    constexpr int N = decltype(n)::value;
    b16 ? launch_with<scan_seq_kernel<N, true>>(grid, kThreads, bytes, st, a, "sequential forward")
        : launch_with<scan_seq_kernel<N, false>>(grid, kThreads, bytes, st, a, "sequential forward");
  });
  check_launch("sequential forward");
  ++seq_count;
}

long seq_launches() { return seq_count; }

namespace {
long dseq_count = 0;
// the 16-byte rows dstates_seq copies: dY and C
bool dseq_aligned(const Args& a) {
  return aligned16(a.xbc) && aligned16(a.dy) && a.ldx % 4 == 0 && a.ldy % 4 == 0 && a.c_col % 4 == 0;
}
}  // namespace

bool dseq_fits(int headdim, int dstate, int chunk) {
  return headdim == kSqP && chunk == kSqQ && dstate % kDsT == 0 && dstate > 0;
}

bool dseq_applies(const Args& a) {
  if (bwd_state_form == BwdStateForm::chunks || !dseq_fits(a.P, a.N, a.Q) || a.batch > 65535 || a.H > 65535) return false;
  if (!dseq_aligned(a)) return false;
  if (kDsSmem > max_block_smem()) return false;
  // automatic: where the blocks fill two per SM (a choice, not a measured crossover: with fewer, each SM's one or
  // two blocks wait on their loads one chunk at a time where the chunked kernels have every chunk in parallel)
  return bwd_state_form == BwdStateForm::dstates || bwd_state_form == BwdStateForm::sequential ||
         std::int64_t(a.batch) * a.H * (a.N / kDsT) >= 2 * std::int64_t(cuda_k::sm_count());
}

void dstates_seq(const Args& a) {
  Kokkos::Profiling::ScopedRegion region("ssd::fused_dstates_seq");
  refuse_bc16(a, "dstates_seq");
  require(dseq_fits(a.P, a.N, a.Q) && a.dstates_out && dseq_aligned(a), "ssd fused",
          "the sequential backward state passing takes headdim 64, chunk 64, d_state a multiple of 64 ",
          "and 16-byte aligned rows (P = ", a.P, ", N = ", a.N, ", Q = ", a.Q, ")");
  const cudaStream_t st = Kokkos::DefaultExecutionSpace().cuda_stream();
  allow_smem<dstates_seq_kernel>(kDsSmem, "sequential backward state passing");
  dstates_seq_kernel<<<dim3(a.N / kDsT, a.H, a.batch), kThreads, kDsSmem, st>>>(a);
  check_launch("sequential backward state passing");
  ++dseq_count;
}

long dseq_launches() { return dseq_count; }

namespace {
long sbseq_count = 0;
std::size_t sbseq_smem(int N, bool b16) {
  return by_dstate(N, [&](auto n) {
    constexpr int Nv = decltype(n)::value;
    return b16 ? SbLayout<Nv, true>::bytes : SbLayout<Nv, false>::bytes;
  });
}
bool sbseq_aligned(const Args& a) {
  return aligned4_bwd(a) && bc16_rows_ok(a) && a.ldx % 4 == 0 && a.ldxs % 4 == 0 && a.ldy % 4 == 0 &&
         a.ldd % 4 == 0;
}
}  // namespace

bool sbseq_fits(int headdim, int dstate, int chunk) { return seq_fits(headdim, dstate, chunk); }

namespace {
// Whether the fused backward's blocks of block_heads heads of this shape (rows aligned; B and C in bf16 where b16)
// take state_bwd_seq: the form as set, the kernel's shapes and shared memory, and under automatic the SMs filled.
bool sbseq_takes(int batch, int block_heads, int P, int N, int Q, bool b16) {
  return bwd_state_form != BwdStateForm::chunks && bwd_state_form != BwdStateForm::dstates && sbseq_fits(P, N, Q) &&
         batch <= 65535 && block_heads <= 65535 && sbseq_smem(N, b16) <= max_block_smem() &&
         (bwd_state_form == BwdStateForm::sequential || fills_sms(batch, block_heads));
}
}  // namespace

bool sbseq_applies(const Args& a) {
  return sbseq_aligned(a) && sbseq_takes(a.batch, a.nh, a.P, a.N, a.Q, a.bc16 != nullptr);
}

void state_bwd_seq(const Args& a) {
  Kokkos::Profiling::ScopedRegion region("ssd::fused_state_bwd_seq");
  require(sbseq_fits(a.P, a.N, a.Q) && sbseq_aligned(a) && (a.dstates_out || a.dstates_b16) && a.v, "ssd fused",
          "the sequential backward state terms take headdim 64, chunk 64, d_state 64 or 128 and 16-byte aligned ",
          "rows (P = ", a.P, ", N = ", a.N, ", Q = ", a.Q, ")");
  const cudaStream_t st = Kokkos::DefaultExecutionSpace().cuda_stream();
  const bool b16 = a.bc16 != nullptr;
  const std::size_t bytes = sbseq_smem(a.N, b16);
  const dim3 grid(a.nh, a.batch);
  by_dstate(a.N, [&](auto n) {
    constexpr int N = decltype(n)::value;
    const char* what = "sequential backward state terms";
    b16 ? launch_with<state_bwd_seq_kernel<N, true>>(grid, kSbThreads, bytes, st, a, what)
        : launch_with<state_bwd_seq_kernel<N, false>>(grid, kSbThreads, bytes, st, a, what);
  });
  check_launch("sequential backward state terms");
  ++sbseq_count;
}

long sbseq_launches() { return sbseq_count; }

bool bc16_forms_take(int batch, int heads, int block_heads, int headdim, int dstate, int chunk) {
  return seq_takes(batch, heads, headdim, dstate, chunk, true) &&
         sbseq_takes(batch, block_heads, headdim, dstate, chunk, true);
}

void bc_backward(const Args& a) {
  Kokkos::Profiling::ScopedRegion region("ssd::fused_bc_backward");
  const int hpg = a.G > 0 ? a.H / a.G : 0;
  require(hpg > 0 && a.run_len == hpg && a.h0 % hpg == 0 && a.nh % hpg == 0, "ssd fused",
          "bc_backward needs runs of whole groups (heads per group ", hpg, ", run length ", a.run_len, ", block of ",
          a.nh, " heads from ", a.h0, ")");
  with_tiles(a, [&](auto pt) { launch_bc<decltype(pt)::value>(a); });
}

#else  // host backends: never called (ssd.cpp asks `fits` first)

bool fits(int, int, int) { return false; }
void chunk_state(const Args&) { require(false, "ssd fused", "the fused kernels need the CUDA backend"); }
void chunk_scan(const Args&) { require(false, "ssd fused", "the fused kernels need the CUDA backend"); }
void intra_backward(const Args&) { require(false, "ssd fused", "the fused kernels need the CUDA backend"); }
void state_epilogue(const Args&) { require(false, "ssd fused", "the fused kernels need the CUDA backend"); }
bool epilogue_writes_wdecay(int, int) { return false; }
bool seq_fits(int, int, int) { return false; }
bool seq_applies(const Args&) { return false; }
void scan_seq(const Args&) { require(false, "ssd fused", "the fused kernels need the CUDA backend"); }
long seq_launches() { return 0; }
bool dseq_fits(int, int, int) { return false; }
bool dseq_applies(const Args&) { return false; }
void dstates_seq(const Args&) { require(false, "ssd fused", "the fused kernels need the CUDA backend"); }
long dseq_launches() { return 0; }
bool sbseq_fits(int, int, int) { return false; }
bool sbseq_applies(const Args&) { return false; }
void state_bwd_seq(const Args&) { require(false, "ssd fused", "the fused kernels need the CUDA backend"); }
long sbseq_launches() { return 0; }
void bc_backward(const Args&) { require(false, "ssd fused", "the fused kernels need the CUDA backend"); }
bool bc16_rows_ok(const Args& a) { return a.bc16 == nullptr; }
bool bc16_forms_take(int, int, int, int, int, int) { return false; }

#endif

}  // namespace mm::ssd_fused
