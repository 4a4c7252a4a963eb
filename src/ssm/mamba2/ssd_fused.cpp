#include "ssm/mamba2/ssd_fused.hpp"

#include <Kokkos_Core.hpp>
#include <Kokkos_Profiling_ScopedRegion.hpp>

#include "core/error.hpp"

#include <cstdint>
#include <type_traits>

#if defined(KOKKOS_ENABLE_CUDA)
#include <cuda_bf16.h>
#include <mma.h>
#endif

namespace mm::ssd_fused {

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

void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  require(e == cudaSuccess, "ssd fused", what, " failed to launch: ", cudaGetErrorString(e));
}

// Four consecutive floats at p (16-byte aligned when V4, else four scalar loads).
template <bool V4>
__device__ __forceinline__ float4 load4(const float* p) {
  if constexpr (V4) return *reinterpret_cast<const float4*>(p);
  return make_float4(p[0], p[1], p[2], p[3]);
}

__device__ __forceinline__ void store4_bf16(bf* d, float4 v) {
  reinterpret_cast<__nv_bfloat162*>(d)[0] = __floats2bfloat162_rn(v.x, v.y);
  reinterpret_cast<__nv_bfloat162*>(d)[1] = __floats2bfloat162_rn(v.z, v.w);
}

// dst (ROWS x COLS bf16, row stride ldd) <- scale(r) src(r, c) for r < nr, c < nc, zero elsewhere; src rows lds
// apart; COLS and nc multiples of 4. Four elements per thread and step, all of a thread's loads issued together.
template <int ROWS, int COLS, bool V4, class Scale>
__device__ __forceinline__ void stage(bf* dst, int ldd, const float* src, std::int64_t lds, int nr, int nc,
                                      Scale scale) {
  constexpr int C4 = COLS / 4;
  static_assert(ROWS * C4 % kThreads == 0, "whole steps of the block");
#pragma unroll 4
  for (int it = 0; it < ROWS * C4 / kThreads; ++it) {
    const int i = threadIdx.x + it * kThreads, r = i / C4, c = (i % C4) * 4;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (r < nr && c < nc) {
      v = load4<V4>(src + r * lds + c);
      const float f = scale(r);
      v.x *= f, v.y *= f, v.z *= f, v.w *= f;
    }
    store4_bf16(dst + r * ldd + c, v);
  }
}

struct One {
  __device__ float operator()(int) const { return 1.f; }
};

// One block per (64 columns n of the state, head, (row, chunk)); PT = P / 16 fragments per warp.
template <int PT, bool V4>
__global__ void __launch_bounds__(kThreads, 4) chunk_state_kernel(const Args a) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int P = PT * 16, ldx = P + kPad;
  bf* xs = reinterpret_cast<bf*>(smem);  // (kTile tokens, P): es Delta x, read as X^T (column-major A)
  bf* bs = xs + kTile * ldx;             // (kTile tokens, 64 columns of B)
  float* w = reinterpret_cast<float*>(bs + kTile * kLdTile);  // per-token weight of the tile

  const int n0 = blockIdx.x * kTile, h = blockIdx.y, bc = blockIdx.z;
  const int b = bc / a.nc, ch = bc % a.nc, t0 = ch * a.Q, q = min(a.Q, a.L - t0), g = h / (a.H / a.G);
  const int warp = threadIdx.x / 32, nw = min(kTile, a.N - n0);
  const std::int64_t row0 = std::int64_t(b) * a.L;
  const float* acs = a.acs + (std::int64_t(b) * a.H + h) * a.L;
  const float* dlt = a.delta + (std::int64_t(b) * a.H + h) * a.L;
  const float acs_last = acs[t0 + q - 1];
  const int rec_last = a.seq ? a.seq[row0 + t0 + q - 1] : 0;

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[PT];
#pragma unroll
  for (int i = 0; i < PT; ++i) wmma::fill_fragment(acc[i], 0.f);

  for (int s0 = 0; s0 < q; s0 += kTile) {
    const int ns = min(kTile, q - s0);
    if (threadIdx.x < kTile) {
      const int t = t0 + s0 + threadIdx.x;
      float v = 0.f;
      if (int(threadIdx.x) < ns && (!a.seq || a.seq[row0 + t] == rec_last)) {
        const float e = decay(acs_last - acs[t]);
        v = e < a.cutoff ? 0.f : e * dlt[t];
      }
      w[threadIdx.x] = v;
    }
    __syncthreads();
    const float* xrow = a.xbc + (row0 + t0 + s0) * a.ldx;
    stage<kTile, P, V4>(xs, ldx, xrow + a.x_col + h * P, a.ldx, ns, P, [w](int r) { return w[r]; });
    stage<kTile, kTile, V4>(bs, kLdTile, xrow + a.b_col + g * a.N + n0, a.ldx, ns, nw, One{});
    __syncthreads();
    if (warp * 16 < nw) {
#pragma unroll
      for (int k = 0; k < kTile; k += 16) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf, wmma::row_major> fb;
        wmma::load_matrix_sync(fb, bs + k * kLdTile + warp * 16, kLdTile);
#pragma unroll
        for (int i = 0; i < PT; ++i) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, bf, wmma::col_major> fa;
          wmma::load_matrix_sync(fa, xs + k * ldx + i * 16, ldx);
          wmma::mma_sync(acc[i], fa, fb, acc[i]);
        }
      }
    }
    __syncthreads();
  }
  if (warp * 16 < nw) {
    float* S = a.states + ((std::int64_t(bc) * a.H + h) * P) * a.N + n0 + warp * 16;
#pragma unroll
    for (int i = 0; i < PT; ++i) wmma::store_matrix_sync(S + std::int64_t(i) * 16 * a.N, acc[i], a.N, wmma::mem_row_major);
  }
}

// Bytes of the chunk scan's shared stage buffer (the largest of its three uses).
__host__ __device__ constexpr std::size_t scan_stage_bytes(int P) {
  const std::size_t a = std::size_t(kTile + P) * kLdTile * 2, b = std::size_t(kTile) * (kLdTile + P + kPad) * 2,
                    c = std::size_t(kTile) * (P + 4) * 4;
  return a > b ? (a > c ? a : c) : (b > c ? b : c);
}

// One block per (64 output tokens l, head, (row, chunk)); warp w owns rows 16 w .. 16 w + 15 of the tile.
template <int PT, bool V4>
__global__ void __launch_bounds__(kThreads, 4) chunk_scan_kernel(const Args a) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int P = PT * 16, ldx = P + kPad, ldy = P + 4;
  // stage A: cs (64 l, 64 n) e_in C, ss (P, 64 n) S_in; stage B: ms (64 l, 64 s) the masked decays, xs (64 s, P);
  // stage C: ys (64 l, P) fp32. The three share the buffer; the per-token arrays follow it.
  bf* cs = reinterpret_cast<bf*>(smem);
  bf* ss = cs + kTile * kLdTile;
  bf* ms = cs;
  bf* xs = cs + kTile * kLdTile;
  float* ys = reinterpret_cast<float*>(smem);
  float* acs_l = reinterpret_cast<float*>(smem + scan_stage_bytes(P));
  float* ein = acs_l + kTile;
  float* acs_s = ein + kTile;
  float* dt_s = acs_s + kTile;
  int* rec_l = reinterpret_cast<int*>(dt_s + kTile);
  int* rec_s = rec_l + kTile;

  const int l0 = blockIdx.x * kTile, h = blockIdx.y, bc = blockIdx.z;
  const int b = bc / a.nc, ch = bc % a.nc, t0 = ch * a.Q, q = min(a.Q, a.L - t0), g = h / (a.H / a.G);
  if (l0 >= q) return;  // the short last chunk
  const int warp = threadIdx.x / 32, nl = min(kTile, q - l0);
  const std::int64_t row0 = std::int64_t(b) * a.L;
  const float* acs = a.acs + (std::int64_t(b) * a.H + h) * a.L;
  const float* dlt = a.delta + (std::int64_t(b) * a.H + h) * a.L;

  if (threadIdx.x < kTile) {
    const int l = threadIdx.x, t = t0 + l0 + l;
    const int r_in = a.seq ? a.seq[row0 + (ch == 0 ? 0 : t0 - 1)] : 0;
    float al = 0.f, e = 0.f;
    int r = 0;
    if (l < nl) {
      al = acs[t];
      r = a.seq ? a.seq[row0 + t] : 0;
      e = r == r_in ? decay(al) : 0.f;
      e = e < a.cutoff ? 0.f : e;
    }
    acs_l[l] = al;
    ein[l] = e;
    rec_l[l] = r;
  }
  __syncthreads();

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[PT];
#pragma unroll
  for (int i = 0; i < PT; ++i) wmma::fill_fragment(acc[i], 0.f);

  // inter-chunk term: (e_in C) S_in^T, 64 columns n at a time
  const float* S = a.states + (std::int64_t(bc) * a.H + h) * P * a.N;
  const float* lrow = a.xbc + (row0 + t0 + l0) * a.ldx;
  for (int n0 = 0; n0 < a.N; n0 += kTile) {
    const int nw = min(kTile, a.N - n0);
    stage<kTile, kTile, V4>(cs, kLdTile, lrow + a.c_col + g * a.N + n0, a.ldx, nl, nw, [ein](int r) { return ein[r]; });
    stage<P, kTile, V4>(ss, kLdTile, S + n0, a.N, P, nw, One{});
    __syncthreads();
    for (int k = 0; k < nw; k += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf, wmma::row_major> fa;
      wmma::load_matrix_sync(fa, cs + warp * 16 * kLdTile + k, kLdTile);
#pragma unroll
      for (int i = 0; i < PT; ++i) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf, wmma::col_major> fb;
        wmma::load_matrix_sync(fb, ss + i * 16 * kLdTile + k, kLdTile);
        wmma::mma_sync(acc[i], fa, fb, acc[i]);
      }
    }
    __syncthreads();
  }

  // intra-chunk term: source tiles up to and including the diagonal one
  const float* CB = a.cb + ((std::int64_t(bc) * a.G + g) * a.Q + l0) * a.Q;
  for (int s0 = 0; s0 <= l0; s0 += kTile) {
    const int ns = min(kTile, q - s0);
    if (threadIdx.x < kTile) {
      const int s = threadIdx.x, t = t0 + s0 + s;
      acs_s[s] = s < ns ? acs[t] : 0.f;
      dt_s[s] = s < ns ? dlt[t] : 0.f;
      rec_s[s] = s < ns ? (a.seq ? a.seq[row0 + t] : 0) : -1;
    }
    __syncthreads();
    constexpr int C4 = kTile / 4;
#pragma unroll
    for (int it = 0; it < kTile * C4 / kThreads; ++it) {
      const int i = threadIdx.x + it * kThreads, l = i / C4, s = (i % C4) * 4;
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (l < nl && s0 + s <= l0 + l) {
        const float4 cb = load4<true>(CB + std::int64_t(l) * a.Q + s0 + s);  // Q % 64 == 0: always aligned
        const float al = acs_l[l];
        const int rl = rec_l[l];
        float m[4] = {cb.x, cb.y, cb.z, cb.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int sj = s + j;
          float e = decay(al - acs_s[sj]);
          const bool keep = sj < ns && s0 + sj <= l0 + l && rec_s[sj] == rl && e >= a.cutoff;
          m[j] = keep ? m[j] * e * dt_s[sj] : 0.f;
        }
        v = make_float4(m[0], m[1], m[2], m[3]);
      }
      store4_bf16(ms + l * kLdTile + s, v);
    }
    stage<kTile, P, V4>(xs, ldx, a.xbc + (row0 + t0 + s0) * a.ldx + a.x_col + h * P, a.ldx, ns, P, One{});
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kTile; k += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf, wmma::row_major> fa;
      wmma::load_matrix_sync(fa, ms + warp * 16 * kLdTile + k, kLdTile);
#pragma unroll
      for (int i = 0; i < PT; ++i) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf, wmma::row_major> fb;
        wmma::load_matrix_sync(fb, xs + k * ldx + i * 16, ldx);
        wmma::mma_sync(acc[i], fa, fb, acc[i]);
      }
    }
    __syncthreads();
  }

  // y = acc + D x
#pragma unroll
  for (int i = 0; i < PT; ++i) wmma::store_matrix_sync(ys + warp * 16 * ldy + i * 16, acc[i], ldy, wmma::mem_row_major);
  __syncthreads();
  const float Dh = a.D[h];
  constexpr int P4 = P / 4;
#pragma unroll
  for (int it = 0; it < kTile * P4 / kThreads; ++it) {
    const int i = threadIdx.x + it * kThreads, l = i / P4, p = (i % P4) * 4;
    if (l < nl) {
      const std::int64_t r = row0 + t0 + l0 + l;
      const float4 x = load4<V4>(a.xbc + r * a.ldx + a.x_col + h * P + p);
      const float* yv = ys + l * ldy + p;
      const float4 o = make_float4(yv[0] + Dh * x.x, yv[1] + Dh * x.y, yv[2] + Dh * x.z, yv[3] + Dh * x.w);
      float* dst = a.y + r * a.ldy + h * P + p;
      if constexpr (V4)
        *reinterpret_cast<float4*>(dst) = o;
      else
        dst[0] = o.x, dst[1] = o.y, dst[2] = o.z, dst[3] = o.w;
    }
  }
}

// ------------------------------------------------------------------ backward, intra-chunk part

// Shared layout of the backward kernels: xs (64 source tokens, P) and dys (64 output tokens, P) bf16, f (64, ldf)
// fp32 (DX, then K o DX; at the end dX), ms (64 l, 64 s) bf16, then the per-token arrays.
constexpr int kLdF = kTile + 4;
__host__ __device__ constexpr std::size_t bwd_f_floats(int P) {
  return std::size_t(kTile) * ((P + 4) > kLdF ? (P + 4) : kLdF);
}
__host__ __device__ constexpr std::size_t bwd_smem(int P) {
  return 2 * std::size_t(kTile) * (P + kPad) * 2 + bwd_f_floats(P) * 4 + std::size_t(kTile) * kLdTile * 2 +
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

// One block per (64 source tokens s, head of the block, (row, chunk)), over the output tiles l >= s.
template <int PT, bool V4>
__global__ void __launch_bounds__(kThreads, 3) intra_dx_kernel(const Args a) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int P = PT * 16, ldx = P + kPad;
  bf* xs = reinterpret_cast<bf*>(smem);
  bf* dys = xs + kTile * ldx;
  float* f = reinterpret_cast<float*>(dys + kTile * ldx);
  bf* ms = reinterpret_cast<bf*>(f + bwd_f_floats(P));
  float* acs_s = reinterpret_cast<float*>(ms + kTile * kLdTile);
  float* dt_s = acs_s + kTile;
  float* acs_l = dt_s + kTile;
  float* diag = acs_l + kTile;
  int* rec_s = reinterpret_cast<int*>(diag + kTile);
  int* rec_l = rec_s + kTile;

  const int s0 = blockIdx.x * kTile, hi = blockIdx.y, h = a.h0 + hi, bc = blockIdx.z;
  const int b = bc / a.nc, ch = bc % a.nc, t0 = ch * a.Q, q = min(a.Q, a.L - t0), g = h / (a.H / a.G);
  if (s0 >= q) return;
  const int warp = threadIdx.x / 32, tid = threadIdx.x, ns = min(kTile, q - s0);
  const std::int64_t row0 = std::int64_t(b) * a.L, nr = std::int64_t(a.batch) * a.L;
  const float* acs = a.acs + (std::int64_t(b) * a.H + h) * a.L;
  const float* dlt = a.delta + (std::int64_t(b) * a.H + h) * a.L;
  const float* CB = a.cb + (std::int64_t(bc) * a.G + g) * a.Q * a.Q;

  if (tid < kTile) {
    const int t = t0 + s0 + tid;
    acs_s[tid] = tid < ns ? acs[t] : 0.f;
    dt_s[tid] = tid < ns ? dlt[t] : 0.f;
    rec_s[tid] = tid < ns ? (a.seq ? a.seq[row0 + t] : 0) : -1;
    diag[tid] = 0.f;
  }
  stage<kTile, P, V4>(xs, ldx, a.xbc + (row0 + t0 + s0) * a.ldx + a.x_col + h * P, a.ldx, ns, P, One{});
  float dd = 0.f, off = 0.f;  // threads < 64: column sums of K o DX over l (all, and l != s)
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[PT];  // dX rows s 16 w .., all of P
#pragma unroll
  for (int i = 0; i < PT; ++i) wmma::fill_fragment(acc[i], 0.f);

  for (int l0 = s0; l0 < q; l0 += kTile) {
    const int nl = min(kTile, q - l0);
    if (tid < kTile) {
      const int t = t0 + l0 + tid;
      acs_l[tid] = tid < nl ? acs[t] : 0.f;
      rec_l[tid] = tid < nl ? (a.seq ? a.seq[row0 + t] : 0) : -2;
    }
    stage<kTile, P, V4>(dys, ldx, a.dy + (row0 + t0 + l0) * a.ldy + h * P, a.ldy, nl, P, One{});
    __syncthreads();
    dx_tile<PT>(dys, xs, f);
    __syncthreads();
    // K, K o DX (in place), M = K Delta_s (bf16), the diagonal DX(s, s)
    for (int it = 0; it < kTile * kTile / kThreads; ++it) {
      const int idx = tid + it * kThreads, l = idx / kTile, s = idx % kTile;
      const float dxv = f[l * kLdF + s];
      float K = 0.f;
      if (l < nl && s < ns && s0 + s <= l0 + l && rec_s[s] == rec_l[l]) {
        const float e = decay(acs_l[l] - acs_s[s]);
        if (e >= a.cutoff) K = e * CB[std::int64_t(l0 + l) * a.Q + s0 + s];
      }
      if (l0 == s0 && l == s) diag[s] = dxv;
      f[l * kLdF + s] = K * dxv;
      ms[l * kLdTile + s] = __float2bfloat16(K * dt_s[s]);
    }
    __syncthreads();
    if (tid < kTile) {  // column s = tid
      float cs = 0.f;
      for (int l = 0; l < kTile; ++l) cs += f[l * kLdF + tid];
      dd += cs;
      off += cs - (l0 == s0 ? f[tid * kLdF + tid] : 0.f);
    } else {  // row l = tid - 64: sum over s < l of Delta_s K DX (rotated start: rows hit different banks), this
              // source tile's part (ssd.cpp adds the parts in tile order: no atomics, runs repeat bit for bit)
      const int l = tid - kTile;
      float rs = 0.f;
      for (int k = 0; k < kTile; ++k) {
        const int s = (k + l) % kTile;
        if (s0 + s != l0 + l) rs += dt_s[s] * f[l * kLdF + s];
      }
      if (l < nl) a.insum[(std::int64_t(blockIdx.x) * a.nh + hi) * nr + row0 + t0 + l0 + l] = rs;
    }
    // dX (rows s) += M^T dY: A = M^T (element (s, l) at l kLdTile + s), B = dY (l, p)
#pragma unroll
    for (int k = 0; k < kTile; k += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf, wmma::col_major> fa;
      wmma::load_matrix_sync(fa, ms + k * kLdTile + warp * 16, kLdTile);
#pragma unroll
      for (int i = 0; i < PT; ++i) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf, wmma::row_major> fb;
        wmma::load_matrix_sync(fb, dys + k * ldx + i * 16, ldx);
        wmma::mma_sync(acc[i], fa, fb, acc[i]);
      }
    }
    __syncthreads();
  }
  if (tid < ns) {
    float* vr = a.v + (std::int64_t(hi) * nr + row0 + t0 + s0 + tid) * 6;
    vr[0] = dd;
    vr[1] = dt_s[tid] * off;
    vr[3] = diag[tid];
  }
  constexpr int ldo = P + 4;
#pragma unroll
  for (int i = 0; i < PT; ++i) wmma::store_matrix_sync(f + warp * 16 * ldo + i * 16, acc[i], ldo, wmma::mem_row_major);
  __syncthreads();
  for (int idx = tid; idx < ns * P; idx += kThreads) {
    const int s = idx / P, p = idx % P;
    a.dx[(row0 + t0 + s0 + s) * a.ldd + a.x_col + h * P + p] = f[s * ldo + p];
  }
}

// One block per (tile pair (l, s), run of heads, (row, chunk)): w2 tile = sum over the run's heads of
// DX o E diag(Delta); zero above the diagonal and outside the chunk.
template <int PT, bool V4>
__global__ void __launch_bounds__(kThreads, 3) intra_dcb_kernel(const Args a) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int P = PT * 16, ldx = P + kPad, kPer = kTile * kTile / kThreads;
  bf* xs = reinterpret_cast<bf*>(smem);
  bf* dys = xs + kTile * ldx;
  float* f = reinterpret_cast<float*>(dys + kTile * ldx);
  float* acs_s = reinterpret_cast<float*>(reinterpret_cast<bf*>(f + bwd_f_floats(P)) + kTile * kLdTile);
  float* dt_s = acs_s + kTile;
  float* acs_l = dt_s + kTile;
  int* rec_s = reinterpret_cast<int*>(acs_l + 2 * kTile);
  int* rec_l = rec_s + kTile;

  const int nt = (a.Q + kTile - 1) / kTile;
  const int il = blockIdx.x / nt, is = blockIdx.x % nt, u = blockIdx.y, bc = blockIdx.z;
  const int l0 = il * kTile, s0 = is * kTile;
  const int b = bc / a.nc, ch = bc % a.nc, t0 = ch * a.Q, q = min(a.Q, a.L - t0);
  const int tid = threadIdx.x;
  const std::int64_t nbc = std::int64_t(a.batch) * a.nc;
  float* W = a.w2 + ((std::int64_t(u) * nbc + bc) * a.Q + l0) * a.Q + s0;
  float* acc = reinterpret_cast<float*>(smem + bwd_smem(P));  // the w2 tile; each thread owns its kPer elements
#pragma unroll
  for (int k = 0; k < kPer; ++k) acc[tid + k * kThreads] = 0.f;
  if (s0 <= l0 && l0 < q) {
    const int nl = min(kTile, q - l0), ns = min(kTile, q - s0);
    const std::int64_t row0 = std::int64_t(b) * a.L;
    if (tid < kTile) {
      rec_s[tid] = tid < ns ? (a.seq ? a.seq[row0 + t0 + s0 + tid] : 0) : -1;
      rec_l[tid] = tid < nl ? (a.seq ? a.seq[row0 + t0 + l0 + tid] : 0) : -2;
    }
    const int hi0 = u * a.run_len, hi1 = min(hi0 + a.run_len, a.nh);
    for (int hi = hi0; hi < hi1; ++hi) {
      const int h = a.h0 + hi;
      const float* acs = a.acs + (std::int64_t(b) * a.H + h) * a.L;
      if (tid < kTile) {
        acs_s[tid] = tid < ns ? acs[t0 + s0 + tid] : 0.f;
        dt_s[tid] = tid < ns ? a.delta[(std::int64_t(b) * a.H + h) * a.L + t0 + s0 + tid] : 0.f;
        acs_l[tid] = tid < nl ? acs[t0 + l0 + tid] : 0.f;
      }
      stage<kTile, P, V4>(xs, ldx, a.xbc + (row0 + t0 + s0) * a.ldx + a.x_col + h * P, a.ldx, ns, P, One{});
      stage<kTile, P, V4>(dys, ldx, a.dy + (row0 + t0 + l0) * a.ldy + h * P, a.ldy, nl, P, One{});
      __syncthreads();
      dx_tile<PT>(dys, xs, f);
      __syncthreads();
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const int idx = tid + k * kThreads, l = idx / kTile, s = idx % kTile;
        if (s0 + s <= l0 + l && rec_s[s] == rec_l[l]) {
          const float e = decay(acs_l[l] - acs_s[s]);
          if (e >= a.cutoff) acc[idx] += f[l * kLdF + s] * e * dt_s[s];
        }
      }
      __syncthreads();
    }
  }
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int idx = tid + k * kThreads, l = idx / kTile, s = idx % kTile;
    if (l0 + l < a.Q && s0 + s < a.Q) W[std::int64_t(l) * a.Q + s] = acc[idx];
  }
}

template <int PT, bool V4>
void launch_bwd(const Args& a) {
  const cudaStream_t st = Kokkos::DefaultExecutionSpace().cuda_stream();
  const std::size_t bytes = bwd_smem(PT * 16), dcb_bytes = bytes + kTile * kTile * 4;
  const int nt = (a.Q + kTile - 1) / kTile, runs = (a.nh + a.run_len - 1) / a.run_len;
  static const bool attr = [&] {  // more than the default 48 KB of shared memory per block for large headdim
    cudaFuncSetAttribute(intra_dx_kernel<PT, V4>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    cudaFuncSetAttribute(intra_dcb_kernel<PT, V4>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(dcb_bytes));
    return true;
  }();
  (void)attr;
  intra_dx_kernel<PT, V4><<<dim3(nt, a.nh, a.batch * a.nc), kThreads, bytes, st>>>(a);
  check_launch("intra-chunk backward (dX)");
  intra_dcb_kernel<PT, V4><<<dim3(nt * nt, runs, a.batch * a.nc), kThreads, dcb_bytes, st>>>(a);
  check_launch("intra-chunk backward (dC B^T)");
}

std::size_t state_smem(int P) {
  return std::size_t(kTile) * (P + kPad) * 2 + std::size_t(kTile) * kLdTile * 2 + kTile * 4;
}

std::size_t scan_smem(int P) { return scan_stage_bytes(P) + 6 * kTile * 4; }

// 16-byte loads and stores when every row start is 16-byte aligned.
bool aligned4(const Args& a) {
  auto al = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
  return al(a.xbc) && al(a.y) && a.ldx % 4 == 0 && a.ldy % 4 == 0 && a.x_col % 4 == 0 && a.b_col % 4 == 0 &&
         a.c_col % 4 == 0;
}

template <int PT, bool V4>
void launch(const Args& a, bool scan) {
  const cudaStream_t st = Kokkos::DefaultExecutionSpace().cuda_stream();
  if (scan) {
    const dim3 grid((a.Q + kTile - 1) / kTile, a.H, a.batch * a.nc);
    chunk_scan_kernel<PT, V4><<<grid, kThreads, scan_smem(PT * 16), st>>>(a);
    check_launch("chunk scan");
  } else {
    const dim3 grid((a.N + kTile - 1) / kTile, a.H, a.batch * a.nc);
    chunk_state_kernel<PT, V4><<<grid, kThreads, state_smem(PT * 16), st>>>(a);
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

template <int PT>
void launch_bwd(const Args& a) {
  const bool v4 = aligned4(a) && reinterpret_cast<std::uintptr_t>(a.dy) % 16 == 0 &&
                  reinterpret_cast<std::uintptr_t>(a.dx) % 16 == 0 && a.ldd % 4 == 0;
  if (v4)
    launch_bwd<PT, true>(a);
  else
    launch_bwd<PT, false>(a);
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

}  // namespace

bool fits(int headdim, int dstate, int chunk) {
  return headdim % 16 == 0 && headdim >= 16 && headdim <= 128 && dstate % 16 == 0 && dstate >= 16 &&
         chunk % kTile == 0;
}

void chunk_state(const Args& a) {
  Kokkos::Profiling::ScopedRegion region("ssd::fused_chunk_state");
  with_tiles(a, [&](auto pt) { launch<decltype(pt)::value>(a, false); });
}

void chunk_scan(const Args& a) {
  Kokkos::Profiling::ScopedRegion region("ssd::fused_chunk_scan");
  with_tiles(a, [&](auto pt) { launch<decltype(pt)::value>(a, true); });
}

void intra_backward(const Args& a) {
  Kokkos::Profiling::ScopedRegion region("ssd::fused_intra_backward");
  with_tiles(a, [&](auto pt) { launch_bwd<decltype(pt)::value>(a); });
}

#else  // host backends: never called (ssd.cpp asks `fits` first)

bool fits(int, int, int) { return false; }
void chunk_state(const Args&) { require(false, "ssd fused", "the fused kernels need the CUDA backend"); }
void chunk_scan(const Args&) { require(false, "ssd fused", "the fused kernels need the CUDA backend"); }
void intra_backward(const Args&) { require(false, "ssd fused", "the fused kernels need the CUDA backend"); }

#endif

}  // namespace mm::ssd_fused
