#include "ssm/mamba3/rotate_cuda.hpp"

#include <Kokkos_Core.hpp>
#include <Kokkos_Profiling_ScopedRegion.hpp>
#include <algorithm>
#include <atomic>

#include "core/error.hpp"
#include "ssm/mamba3/rotary.hpp"
#include "tensor/gemm.hpp"  // store_bf16_op_vec

namespace mm::mamba3_cuda {

namespace {
std::atomic<long> launches{0}, fwd_launches{0};
}  // namespace

long rotate_bwd_launches() { return launches.load(); }
long rotate_fwd_launches() { return fwd_launches.load(); }

#if defined(KOKKOS_ENABLE_CUDA)

namespace {

constexpr int kWarps = 8, kThreads = 32 * kWarps;

// W values a lane (4: one quad, interleaved pairs; 8: a quad of each half, halved pairs), KR rows a lane a tile
template <int W>
constexpr int kRows = W == 4 ? 2 : 1;

__host__ __device__ constexpr int lanes_per_row(int N, int W) { return N / W; }

__device__ __forceinline__ float4 load_quad(const float* p) { return *reinterpret_cast<const float4*>(p); }
// x[at .. at + 3] = the quad v
template <int W>
__device__ __forceinline__ void put_quad(float (&x)[W], int at, float4 v) {
  x[at] = v.x, x[at + 1] = v.y, x[at + 2] = v.z, x[at + 3] = v.w;
}
__device__ __forceinline__ float4 load_quad(const std::uint16_t* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  return make_float4(bf16_bits_to_float(u.x & 0xffffu), bf16_bits_to_float(u.x >> 16),
                     bf16_bits_to_float(u.y & 0xffffu), bf16_bits_to_float(u.y >> 16));
}

// Grid (blocks, groups), kThreads threads; block x takes the tiles x, x + blocks, ... of the rows. Lane u of row
// slot ri (lane = ri LR + u) holds, for each of its KR rows of a tile, the values at the state dimensions dim(e):
// 4u + e (interleaved), or 4u + e and N/2 + 4u + e - 4 (halved). Row kr of slot ri of warp w: (kr kWarps + w) RPW
// + ri in the tile. The biases' row sums of a head over a tile: over the warp's row slots by shuffles, then over
// the warps through shared memory (two buffers by head parity, kWarps x 2 N floats each) by one thread a column,
// which adds it to the block's row of `partial` (the same thread for every tile: the same order every run).
template <int W, class DQ>
__global__ void __launch_bounds__(kThreads, 2) rotate_bwd_kernel(const RotBwdArgs a, const DQ* __restrict__ dq) {
  constexpr int KR = kRows<W>, A = W / 2;  // angles a lane: interleaved pairs (2e, 2e + 1), halved (e, 4 + e)
  extern __shared__ float red[];
  const int N = a.N, LR = lanes_per_row(N, W), RPW = 32 / LR, rows_tile = kWarps * RPW * KR;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, ri = lane / LR, u = lane % LR;
  const int g = blockIdx.y, hpg = a.H / a.G, hn = N / 2;
  const index_t rows = index_t(a.batch) * a.L, HN = index_t(a.H) * N, ntiles = (rows + rows_tile - 1) / rows_tile;
  float* prow = a.partial + index_t(blockIdx.x) * 2 * HN;
  auto dim = [&](int e) { return W == 4 ? 4 * u + e : (e < 4 ? 4 * u + e : hn + 4 * u + e - 4); };
  const int left = a.S - A * u;  // this lane's angles A u .. A u + A - 1 below S: the first `left` of them

  int step = 0;  // heads done (over the tiles too): the parity of the shared buffer
  for (index_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const bool first_tile = tile == blockIdx.x;
    const index_t r0 = tile * rows_tile;
    float q[KR][W], k[KR][W], gq[KR][W], gk[KR][W];
    index_t rw[KR];
    int bb[KR], tt[KR];
#pragma unroll
    for (int kr = 0; kr < KR; ++kr) {
      const index_t r = r0 + index_t(kr * kWarps + warp) * RPW + ri;
      rw[kr] = r < rows ? r : -1;
      const index_t rc = r < rows ? r : rows - 1;
      bb[kr] = int(rc / a.L);
      tt[kr] = int(rc - index_t(bb[kr]) * a.L);
      const float* row = a.qk + rc * a.ldqk + index_t(g) * N;
#pragma unroll
      for (int part = 0; part < W / 4; ++part) {
        const float4 qv = load_quad(row + a.q_col + dim(4 * part)), kv = load_quad(row + a.k_col + dim(4 * part));
        put_quad(q[kr], 4 * part, qv);
        put_quad(k[kr], 4 * part, kv);
      }
#pragma unroll
      for (int e = 0; e < W; ++e) gq[kr][e] = gk[kr][e] = 0.f;
    }

    for (int hh = 0; hh < hpg; ++hh) {
      const int h = g * hpg + hh;
      float qb[W], kb[W], bq[W], bk[W];
#pragma unroll
      for (int part = 0; part < W / 4; ++part) {
        const float4 qv = load_quad(a.q_bias + index_t(h) * N + dim(4 * part));
        const float4 kv = load_quad(a.k_bias + index_t(h) * N + dim(4 * part));
        put_quad(qb, 4 * part, qv);
        put_quad(kb, 4 * part, kv);
      }
#pragma unroll
      for (int e = 0; e < W; ++e) bq[e] = bk[e] = 0.f;
#pragma unroll
      for (int kr = 0; kr < KR; ++kr) {
        if (rw[kr] < 0) continue;  // (past the last row: no shuffles below depend on it)
        const index_t r = rw[kr];
        const int b = bb[kr], t = tt[kr];
        const float* ph = a.phi + index_t(b) * a.ps0 + index_t(h) * a.ps1 + index_t(t) * a.ps2 + A * u;
        float* dph = a.dphi + index_t(b) * a.dps0 + index_t(h) * a.dps1 + index_t(t) * a.dps2 + A * u;
        float sn[A], cs[A];
#pragma unroll
        for (int e = 0; e < A; ++e) {
          sn[e] = 0.f, cs[e] = 1.f;
          if (e < left) sincosf(ph[e], &sn[e], &cs[e]);
        }
        // q~ and k~ of this head: the biased values rotated
        float qr[W], kq[W], dqv[W], dkv[W];
#pragma unroll
        for (int e = 0; e < W; ++e) qr[e] = q[kr][e] + qb[e], kq[e] = k[kr][e] + kb[e];
#pragma unroll
        for (int e = 0; e < A; ++e) {
          if (e >= left) break;
          const int i0 = W == 8 ? e : 2 * e, i1 = W == 8 ? 4 + e : 2 * e + 1;
          rot_pair(qr[i0], qr[i1], sn[e], cs[e]);
          rot_pair(kq[i0], kq[i1], sn[e], cs[e]);
        }
        const DQ* drow = dq + r * a.ldd + index_t(h) * N;
#pragma unroll
        for (int part = 0; part < W / 4; ++part) {
          const float4 dv = load_quad(drow + a.q_off + dim(4 * part)), kv = load_quad(drow + a.k_off + dim(4 * part));
          put_quad(dqv, 4 * part, dv);
          put_quad(dkv, 4 * part, kv);
        }
        if (a.fdv) {  // the diagonal's terms, and the final carry's k gradient at a row's last token
          const float fd = a.fdv[r * a.ldf + h];
          const float* fkr = a.fk && t == a.L - 1 ? a.fk + index_t(b) * a.fs0 + index_t(h) * a.fs1 : nullptr;
#pragma unroll
          for (int e = 0; e < W; ++e) {
            dqv[e] += fd * kq[e];
            dkv[e] += fd * qr[e] + (fkr ? fkr[dim(e)] : 0.f);
          }
        }
#pragma unroll
        for (int e = 0; e < A; ++e) {
          if (e >= left) break;
          const int i0 = W == 8 ? e : 2 * e, i1 = W == 8 ? 4 + e : 2 * e + 1;
          float acc = 0.f;
          rot_pair_bwd(dqv[i0], dqv[i1], qr[i0], qr[i1], sn[e], cs[e], acc);
          rot_pair_bwd(dkv[i0], dkv[i1], kq[i0], kq[i1], sn[e], cs[e], acc);
          dph[e] = acc;
        }
#pragma unroll
        for (int e = 0; e < W; ++e) {
          bq[e] += dqv[e], bk[e] += dkv[e];
          gq[kr][e] += dqv[e], gk[kr][e] += dkv[e];
        }
      }
#pragma unroll
      for (int e = 0; e < W; ++e)
        for (int o = LR; o < 32; o *= 2) {
          bq[e] += __shfl_xor_sync(0xffffffffu, bq[e], o);
          bk[e] += __shfl_xor_sync(0xffffffffu, bk[e], o);
        }
      float* buf = red + (step++ & 1) * kWarps * 2 * N;
      if (ri == 0)
#pragma unroll
        for (int e = 0; e < W; ++e) buf[warp * 2 * N + dim(e)] = bk[e], buf[warp * 2 * N + N + dim(e)] = bq[e];
      __syncthreads();  // (the other parity's buffer is free: every thread passed this barrier after reading it)
      for (int col = threadIdx.x; col < 2 * N; col += kThreads) {
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) s += buf[w * 2 * N + col];
        float* p = prow + (col < N ? 0 : HN) + index_t(h) * N + (col < N ? col : col - N);
        *p = first_tile ? s : *p + s;
      }
    }
    // the group sums of the lane's rows
#pragma unroll
    for (int kr = 0; kr < KR; ++kr) {
      if (rw[kr] < 0) continue;
      float* row = a.dqk + rw[kr] * a.lddqk + index_t(g) * N;
#pragma unroll
      for (int part = 0; part < W / 4; ++part) {
        const int e = 4 * part;
        *reinterpret_cast<float4*>(row + a.dq_col + dim(e)) =
            make_float4(gq[kr][e], gq[kr][e + 1], gq[kr][e + 2], gq[kr][e + 3]);
        *reinterpret_cast<float4*>(row + a.dk_col + dim(e)) =
            make_float4(gk[kr][e], gk[kr][e + 1], gk[kr][e + 2], gk[kr][e + 3]);
      }
    }
  }
}

// The forward: grid (ceil(rows / (kWarps RPW))), kThreads threads; lane u of row slot ri of warp w takes row
// (block kWarps + w) RPW + ri and the state dimensions dim(e) of the backward above. Rows past the last are
// clamped (their lanes still take part in the row's shuffles) and store nothing.
template <int W, bool kB16>
__global__ void __launch_bounds__(kThreads) rotate_fwd_kernel(const RotFwdArgs a) {
  constexpr int A = W / 2;  // angles a lane
  const int N = a.N, LR = lanes_per_row(N, W), RPW = 32 / LR;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, ri = lane / LR, u = lane % LR;
  const int hpg = a.H / a.G, hn = N / 2;
  const index_t rows = index_t(a.batch) * a.L;
  const index_t r = (index_t(blockIdx.x) * kWarps + warp) * RPW + ri;
  const bool valid = r < rows;
  const index_t rc = valid ? r : rows - 1;
  const int b = int(rc / a.L), t = int(rc - index_t(b) * a.L);
  auto dim = [&](int e) { return W == 4 ? 4 * u + e : (e < 4 ? 4 * u + e : hn + 4 * u + e - 4); };
  const int left = a.S - A * u;  // this lane's angles A u .. A u + A - 1 below S: the first `left` of them
  const float* row = a.qk + rc * a.ldqk;
  const float* ph_row = a.phi + index_t(b) * a.ps0 + index_t(t) * a.ps2 + A * u;
  const index_t orow = rc * a.ldo;
  for (int g = 0; g < a.G; ++g) {
    float q[W], k[W];
#pragma unroll
    for (int part = 0; part < W / 4; ++part) {
      const float4 qv = load_quad(row + a.q_col + index_t(g) * N + dim(4 * part));
      const float4 kv = load_quad(row + a.k_col + index_t(g) * N + dim(4 * part));
      put_quad(q, 4 * part, qv);
      put_quad(k, 4 * part, kv);
    }
#pragma unroll 2
    for (int hh = 0; hh < hpg; ++hh) {
      const int h = g * hpg + hh;
      float qr[W], kq[W];
#pragma unroll
      for (int part = 0; part < W / 4; ++part) {
        put_quad(qr, 4 * part, load_quad(a.q_bias + index_t(h) * N + dim(4 * part)));
        put_quad(kq, 4 * part, load_quad(a.k_bias + index_t(h) * N + dim(4 * part)));
      }
#pragma unroll
      for (int e = 0; e < W; ++e) qr[e] += q[e], kq[e] += k[e];
      const float* ph = ph_row + index_t(h) * a.ps1;
#pragma unroll
      for (int e = 0; e < A; ++e) {
        if (e >= left) break;
        float sn, cs;
        sincosf(ph[e], &sn, &cs);
        const int i0 = W == 8 ? e : 2 * e, i1 = W == 8 ? 4 + e : 2 * e + 1;
        rot_pair(qr[i0], qr[i1], sn, cs);
        rot_pair(kq[i0], kq[i1], sn, cs);
      }
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < W; ++e) dot += qr[e] * kq[e];
      if (valid) {
#pragma unroll
        for (int part = 0; part < W / 4; ++part) {
          const int e = 4 * part;
          const index_t qo = orow + a.q_off + index_t(h) * N + dim(e), ko = orow + a.k_off + index_t(h) * N + dim(e);
          const float qv[4] = {qr[e], qr[e + 1], qr[e + 2], qr[e + 3]}, kv[4] = {kq[e], kq[e + 1], kq[e + 2], kq[e + 3]};
          if constexpr (kB16) {
            store_bf16_op_vec<4>(reinterpret_cast<bf16_op_t*>(a.out16) + qo, qv);
            store_bf16_op_vec<4>(reinterpret_cast<bf16_op_t*>(a.out16) + ko, kv);
          } else {
            *reinterpret_cast<float4*>(a.out32 + qo) = make_float4(qv[0], qv[1], qv[2], qv[3]);
            *reinterpret_cast<float4*>(a.out32 + ko) = make_float4(kv[0], kv[1], kv[2], kv[3]);
          }
        }
      }
      for (int o = 1; o < LR; o *= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      if (valid && u == 0 && a.qkd) a.qkd[r * a.ldqkd + h] = dot;
    }
  }
}

int tile_rows(int N, bool halved) {
  const int W = halved ? 8 : 4;
  return kWarps * (32 / lanes_per_row(N, W)) * (halved ? kRows<8> : kRows<4>);
}

template <int W, class DQ>
void launch(const RotBwdArgs& a, const DQ* dq) {
  const index_t blocks = rotate_bwd_partial_rows(index_t(a.batch) * a.L, a.N, W == 8, a.G);
  const std::size_t bytes = std::size_t(2) * kWarps * 2 * a.N * sizeof(float);
  if (bytes > 48 * 1024) {
    const cudaError_t e =
        cudaFuncSetAttribute(rotate_bwd_kernel<W, DQ>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    require(e == cudaSuccess, "mamba3 rotation backward (CUDA)", bytes, " bytes of shared memory: ",
            cudaGetErrorString(e));
  }
  rotate_bwd_kernel<W, DQ><<<dim3(unsigned(blocks), unsigned(a.G)), kThreads, bytes,
                             Kokkos::DefaultExecutionSpace().cuda_stream()>>>(a, dq);
  const cudaError_t e = cudaGetLastError();
  require(e == cudaSuccess, "mamba3 rotation backward (CUDA)", "the kernel failed to launch: ", cudaGetErrorString(e));
}

// The shape rules both kernels check at their launch
bool in_fits(const RotIn& a) { return rotate_fits(a.N, a.halved) && a.G > 0 && a.H % a.G == 0; }

}  // namespace

bool rotate_fits(int N, bool halved) {
  const int W = halved ? 8 : 4;
  if (N <= 0 || N % W != 0) return false;
  const int lr = N / W;
  return lr <= 32 && 32 % lr == 0;
}

index_t rotate_bwd_partial_rows(index_t rows, int N, bool halved, int groups) {
  // two blocks an SM over the groups (the kernel's bound), each walking its tiles; at least one a group
  static const int sms = [] {
    int dev = 0, n = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return n > 0 ? n : 1;
  }();
  const index_t tiles = (rows + tile_rows(N, halved) - 1) / tile_rows(N, halved);
  const index_t want = std::max<index_t>(1, (2 * index_t(sms) + groups - 1) / groups);
  return std::max<index_t>(1, std::min(tiles, want));
}

void rotate_bwd(const RotBwdArgs& a) {
  require(in_fits(a) && (a.dq32 != nullptr) != (a.dq16 != nullptr), "mamba3 rotation backward (CUDA)",
          "shape or arguments outside the kernel's rules (d_state ", a.N, ")");
  Kokkos::Profiling::ScopedRegion region("mamba3::rotate_bwd_cuda");
  ++launches;
  if (a.halved)
    a.dq16 ? launch<8>(a, a.dq16) : launch<8>(a, a.dq32);
  else
    a.dq16 ? launch<4>(a, a.dq16) : launch<4>(a, a.dq32);
}

void rotate_fwd(const RotFwdArgs& a) {
  require(in_fits(a) && (a.out32 != nullptr) != (a.out16 != nullptr), "mamba3 rotation (CUDA)",
          "shape or arguments outside the kernel's rules (d_state ", a.N, ")");
  const index_t rows = index_t(a.batch) * a.L;
  if (rows == 0 || a.H == 0) return;
  Kokkos::Profiling::ScopedRegion region("mamba3::rotate_cuda");
  ++fwd_launches;
  const int W = a.halved ? 8 : 4, per_block = kWarps * (32 / lanes_per_row(a.N, W));
  const unsigned blocks = unsigned((rows + per_block - 1) / per_block);
  const cudaStream_t st = Kokkos::DefaultExecutionSpace().cuda_stream();
  if (a.halved && a.out16)
    rotate_fwd_kernel<8, true><<<blocks, kThreads, 0, st>>>(a);
  else if (a.halved)
    rotate_fwd_kernel<8, false><<<blocks, kThreads, 0, st>>>(a);
  else if (a.out16)
    rotate_fwd_kernel<4, true><<<blocks, kThreads, 0, st>>>(a);
  else
    rotate_fwd_kernel<4, false><<<blocks, kThreads, 0, st>>>(a);
  const cudaError_t e = cudaGetLastError();
  require(e == cudaSuccess, "mamba3 rotation (CUDA)", "the kernel failed to launch: ", cudaGetErrorString(e));
}

#else  // host backends: never called (scan.cpp asks rotate_fits first)

void rotate_fwd(const RotFwdArgs&) { require(false, "mamba3 rotation", "the kernel needs the CUDA backend"); }

bool rotate_fits(int, bool) { return false; }
index_t rotate_bwd_partial_rows(index_t, int, bool, int) { return 1; }
void rotate_bwd(const RotBwdArgs&) { require(false, "mamba3 rotation backward", "the kernel needs the CUDA backend"); }

#endif

}  // namespace mm::mamba3_cuda
