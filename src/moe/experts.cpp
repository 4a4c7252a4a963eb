#include "moe/experts.hpp"

#include <algorithm>

#include "core/cuda_launch.hpp"
#include "core/error.hpp"

#if defined(KOKKOS_ENABLE_CUDA)
#include <cuda_bf16.h>
#endif

namespace mm {

namespace {

template <class T>
UView2<T> rows_of(const View2<T>& v, index_t r0, index_t r1) {
  return UView2<T>(v.data() + r0 * index_t(v.extent(1)), r1 - r0, v.extent(1));
}

void check_offsets(const std::vector<index_t>& off, index_t rows, const char* where) {
  require(!off.empty() && off.front() == 0 && off.back() == rows, where, "group offsets end at ",
          off.empty() ? -1 : off.back(), ", expected ", rows, " rows");
  for (std::size_t g = 0; g + 1 < off.size(); ++g)
    require(off[g] <= off[g + 1], where, "group offsets decrease at group ", g);
}

}  // namespace

#if defined(KOKKOS_ENABLE_CUDA)
// Native CUDA forms of the expert path's elementwise and gather kernels (one thread per 8 bf16 or 4 fp32 values of
// a row, 16-byte loads and stores, fast exp and division for the bf16 results): the Kokkos forms, one value per
// thread with the library's expf and IEEE division, ran at 1.2-2.1 TB/s on an H200 and took 2.4 ms of a 7.85 ms
// top-1 step (fenced profile, perf/RESULTS.md). Taken where the rows are 16-byte aligned; the Kokkos forms stay the
// fallback and the host path.
namespace cuda_k {

using bf2 = __nv_bfloat162;

// Grid-stride loop over n items.
#define MM_GRID_LOOP(i, n) \
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (n); i += (long long)gridDim.x * blockDim.x)

// a = silu(h1) h3, rows of h13 = [h1 | h3] (2 F8 pieces of 8), a (F8 pieces)
__global__ void swiglu_fwd(const uint4* h13, uint4* a, long long m, int F8) {
  MM_GRID_LOOP(i, m * F8) {
    const long long r = i / F8, c = i - r * F8;
    float u[8], v[8], o[8];
    unpack8(h13[r * 2 * F8 + c], u);
    unpack8(h13[r * 2 * F8 + F8 + c], v);
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] = u[j] * sigm(u[j]) * v[j];
    a[i] = pack8(o);
  }
}

// dh1 = da h3 silu'(h1), dh3 = da silu(h1)
__global__ void swiglu_bwd(const uint4* da, const uint4* h13, uint4* dh13, long long m, int F8) {
  MM_GRID_LOOP(i, m * F8) {
    const long long r = i / F8, c = i - r * F8;
    float g[8], u[8], v[8], o1[8], o3[8];
    unpack8(da[i], g);
    unpack8(h13[r * 2 * F8 + c], u);
    unpack8(h13[r * 2 * F8 + F8 + c], v);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float sg = sigm(u[j]);
      o1[j] = g[j] * v[j] * (sg * (1.f + u[j] * (1.f - sg)));
      o3[j] = g[j] * (u[j] * sg);
    }
    dh13[r * 2 * F8 + c] = pack8(o1);
    dh13[r * 2 * F8 + F8 + c] = pack8(o3);
  }
}

// xp[r] = bf16(x[tok(r)]): 8 values per thread
__global__ void gather_bf16(const float* x, long long ldx, const index_t* tok, uint4* xp, long long m, int d8) {
  MM_GRID_LOOP(i, m * d8) {
    const long long r = i / d8, c = i - r * d8;
    const float4* src = reinterpret_cast<const float4*>(x + tok[r] * ldx) + 2 * c;
    const float4 p = src[0], q = src[1];
    const float f[8] = {p.x, p.y, p.z, p.w, q.x, q.y, q.z, q.w};
    xp[i] = pack8(f);
  }
}

// The combine's backward on the bf16 path, one warp per token x and slot j with r = row(x, j) >= 0:
//   dy[r] = bf16(gate(x, j) dout[x]),  dgate(x, j) = dout[x] . y[r]   (0 for a dropped slot)
// dout is read once per slot (once in all for top-1) for both; lane sums folded by a fixed butterfly.
__global__ void __launch_bounds__(256)
    combine_backward_bf16(const float* __restrict__ dout, long long ldo, const float* __restrict__ y, long long ldy,
                          const index_t* __restrict__ row, int k, const float* __restrict__ gate, long long ldg,
                          uint2* __restrict__ dy, float* __restrict__ dgate, long long ldd, long long n, int d4) {
  const int lane = threadIdx.x & 31;
  const long long nw = (long long)gridDim.x * (blockDim.x >> 5);
  for (long long it = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); it < n * k; it += nw) {
    const long long x = it / k;
    const int j = int(it - x * k);
    const index_t r = row[x * k + j];
    float s = 0.f;
    if (r >= 0) {
      const float g = gate[x * ldg + j];
      const float4* o4 = reinterpret_cast<const float4*>(dout + x * ldo);
      const float4* y4 = reinterpret_cast<const float4*>(y + r * ldy);
      for (int c = lane; c < d4; c += 32) {
        const float4 o = o4[c], v = y4[c];
        s = fmaf(o.w, v.w, fmaf(o.z, v.z, fmaf(o.y, v.y, fmaf(o.x, v.x, s))));
        uint2 q;
        bf2* p = reinterpret_cast<bf2*>(&q);
        p[0] = __floats2bfloat162_rn(g * o.x, g * o.y);
        p[1] = __floats2bfloat162_rn(g * o.z, g * o.w);
        dy[r * d4 + c] = q;
      }
      s = warp_sum(s);
    }
    if (lane == 0) dgate[x * ldd + j] = s;
  }
}

// out[x] = (acc ? out[x] : 0) + sum_j [row(x, j) >= 0] g(x, j) y[row(x, j)] + sum_e dl(x, e) W[e], slots and
// experts in order (g = 1 without gates; the last term only with dl: the router's backward, W (E, 4 d4) read
// through L1)
__global__ void combine_rows(const float* y, long long ldy, const index_t* row, const float* gate, long long ldg,
                             int k, const float* dl, long long ldl, const float* W, long long ldw, int E, float* out,
                             long long ldo, bool acc, long long n, int d4) {
  MM_GRID_LOOP(i, n * d4) {
    const long long x = i / d4, c = i - x * d4;
    float4* o = reinterpret_cast<float4*>(out + x * ldo) + c;
    float4 s = acc ? *o : make_float4(0.f, 0.f, 0.f, 0.f);
    for (int j = 0; j < k; ++j) {
      const index_t r = row[x * k + j];
      if (r < 0) continue;
      const float4 v = reinterpret_cast<const float4*>(y + r * ldy)[c];
      if (gate) {
        const float g = gate[x * ldg + j];
        s.x += g * v.x, s.y += g * v.y, s.z += g * v.z, s.w += g * v.w;
      } else {
        s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
      }
    }
    if (dl)
      for (int e = 0; e < E; ++e) {
        const float l = __ldg(dl + x * ldl + e);
        const float4 w = __ldg(reinterpret_cast<const float4*>(W + e * ldw) + c);
        s.x = fmaf(l, w.x, s.x), s.y = fmaf(l, w.y, s.y), s.z = fmaf(l, w.z, s.z), s.w = fmaf(l, w.w, s.w);
      }
    *o = s;
  }
}

// bf16 copies of fp32 weights, 8 values per thread: with w3, out = [w1_g; w3_g] for g < G (blocks of Fd8 pieces
// each); without, out = w1 (G Fd8 pieces)
__global__ void weights_to_bf16(const float* w1, const float* w3, uint4* out, long long G, long long Fd8) {
  MM_GRID_LOOP(i, (w3 ? 2 : 1) * G * Fd8) {
    const float* src;
    if (w3) {
      const long long gh = i / Fd8, c = i - gh * Fd8;
      src = ((gh & 1) ? w3 : w1) + ((gh >> 1) * Fd8 + c) * 8;
    } else {
      src = w1 + i * 8;
    }
    const float4 p = reinterpret_cast<const float4*>(src)[0], q = reinterpret_cast<const float4*>(src)[1];
    const float f[8] = {p.x, p.y, p.z, p.w, q.x, q.y, q.z, q.w};
    out[i] = pack8(f);
  }
}

#undef MM_GRID_LOOP

// Router logits in fp32, out (n, E) = x (n, d) W^T (W: (E, d), E <= EP): one warp per R rows, each lane a float4
// column slice of the rows (x read once, W from L1), lane sums folded by a fixed butterfly (deterministic).
template <int EP, int R>
__global__ void __launch_bounds__(256)
    router_logits(const float* __restrict__ x, long long ldx, const float* __restrict__ W, long long ldw, int E,
                  float* __restrict__ out, long long ldo, long long n, int d4) {
  const int lane = threadIdx.x & 31;
  const long long nw = (long long)gridDim.x * (blockDim.x >> 5);
  for (long long r0 = ((long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R; r0 < n; r0 += nw * R) {
    float acc[R][EP];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int e = 0; e < EP; ++e) acc[r][e] = 0.f;
    for (int c = lane; c < d4; c += 32) {
      float4 xv[R];
#pragma unroll
      for (int r = 0; r < R; ++r)
        xv[r] = r0 + r < n ? __ldg(reinterpret_cast<const float4*>(x + (r0 + r) * ldx) + c)
                           : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int e = 0; e < EP; ++e) {
        if (e < E) {
          const float4 w = __ldg(reinterpret_cast<const float4*>(W + e * ldw) + c);
#pragma unroll
          for (int r = 0; r < R; ++r)
            acc[r][e] = fmaf(xv[r].w, w.w, fmaf(xv[r].z, w.z, fmaf(xv[r].y, w.y, fmaf(xv[r].x, w.x, acc[r][e]))));
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int e = 0; e < EP; ++e)
        acc[r][e] = warp_sum(acc[r][e]);
    if (lane == 0)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int e = 0; e < EP; ++e)
          if (e < E && r0 + r < n) out[(r0 + r) * ldo + e] = acc[r][e];
  }
}

// The router's weight gradient, per block of rows: part[block, e, 4c..4c+3] = sum_{t in block} dl[t, e] x[t, 4c..]
// (rows in order; one thread per float4 column, rows loaded 8 at a time), summed over the blocks by sum_partials.
template <int EP>
__global__ void __launch_bounds__(256) router_wgrad(const float* __restrict__ x, long long ldx,
                                                    const float* __restrict__ dl, long long ldl, int E,
                                                    float4* __restrict__ part, long long n, int d4,
                                                    long long rows_per_block) {
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= d4) return;
  float4 g[EP];
#pragma unroll
  for (int e = 0; e < EP; ++e) g[e] = make_float4(0.f, 0.f, 0.f, 0.f);
  const long long t0 = blockIdx.x * rows_per_block, t1 = t0 + rows_per_block < n ? t0 + rows_per_block : n;
  for (long long t = t0; t < t1; t += 8) {
    float4 xv[8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
      xv[i] = t + i < t1 ? __ldg(reinterpret_cast<const float4*>(x + (t + i) * ldx) + c)
                         : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (t + i >= t1) break;
#pragma unroll
      for (int e = 0; e < EP; ++e) {
        if (e < E) {
          const float l = __ldg(dl + (t + i) * ldl + e);
          g[e].x = fmaf(l, xv[i].x, g[e].x), g[e].y = fmaf(l, xv[i].y, g[e].y);
          g[e].z = fmaf(l, xv[i].z, g[e].z), g[e].w = fmaf(l, xv[i].w, g[e].w);
        }
      }
    }
  }
#pragma unroll
  for (int e = 0; e < EP; ++e)
    if (e < E) part[(blockIdx.x * (long long)E + e) * d4 + c] = g[e];
}

}  // namespace cuda_k
#endif

template <class T>
void grouped_gemm(Trans tw, acc_t<T> alpha, const View2<const T>& A, const T* W, index_t wr, index_t wc,
                  acc_t<T> beta, const View2<T>& C, const std::vector<index_t>& off) {
  check_offsets(off, A.extent(0), "moe::grouped_gemm");
  require(C.extent(0) == A.extent(0), "moe::grouped_gemm", "A has ", A.extent(0), " rows, C has ", C.extent(0));
  const index_t G = index_t(off.size()) - 1;
  for (index_t g = 0; g < G; ++g) {
    if (off[g + 1] == off[g]) continue;
    const UView2<const T> Wg(W + g * wr * wc, wr, wc);
    gemm(Trans::N, tw, alpha, rows_of(A, off[g], off[g + 1]), Wg, beta, rows_of(C, off[g], off[g + 1]));
  }
}

template <class T>
void grouped_gemm_wgrad(acc_t<T> alpha, const View2<const T>& A, const View2<const T>& B, acc_t<T> beta, T* dW,
                        const std::vector<index_t>& off) {
  check_offsets(off, A.extent(0), "moe::grouped_gemm_wgrad");
  require(B.extent(0) == A.extent(0), "moe::grouped_gemm_wgrad", "A has ", A.extent(0), " rows, B has ",
          B.extent(0));
  const index_t G = index_t(off.size()) - 1, wr = A.extent(1), wc = B.extent(1);
  for (index_t g = 0; g < G; ++g) {
    const UView2<T> dWg(dW + g * wr * wc, wr, wc);
    if (off[g + 1] == off[g]) {
      if (beta != acc_t<T>(1))
        par_for("moe::wgrad_scale", wr, wc, KOKKOS_LAMBDA(index_t i, index_t j) { dWg(i, j) *= beta; });
      continue;
    }
    gemm(Trans::T, Trans::N, alpha, rows_of(A, off[g], off[g + 1]), rows_of(B, off[g], off[g + 1]), beta, dWg);
  }
}

template <class T>
void swiglu_experts_forward(const SwiGLUWeights<T>& w, const View2<const T>& xp, const std::vector<index_t>& off,
                            SwiGLUActs<T>& acts, const View2<T>& y, PoolScope* ws) {
  using P = acc_t<T>;
  const index_t m = xp.extent(0), F = w.F;
  require(index_t(xp.extent(1)) == w.d && index_t(y.extent(1)) == w.d && index_t(y.extent(0)) == m,
          "moe::swiglu_experts", "xp is (", xp.extent(0), ", ", xp.extent(1), "), y is (", y.extent(0), ", ",
          y.extent(1), "), d_model = ", w.d);
  if (ws == nullptr) {
    acts.internals = std::make_shared<PoolScope>();
    ws = acts.internals.get();
  }
  acts.h1 = ws->take<View2<T>>("moe::h1", m, F);
  acts.h3 = ws->take<View2<T>>("moe::h3", m, F);
  acts.a = ws->take<View2<T>>("moe::a", m, F);
  grouped_gemm<T>(Trans::T, P(1), xp, w.w1, F, w.d, P(0), acts.h1, off);
  grouped_gemm<T>(Trans::T, P(1), xp, w.w3, F, w.d, P(0), acts.h3, off);
  auto h1 = acts.h1;
  auto h3 = acts.h3;
  auto a = acts.a;
  par_for("moe::swiglu", m, F, KOKKOS_LAMBDA(index_t r, index_t f) {
    a(r, f) = static_cast<T>(silu(P(h1(r, f))) * P(h3(r, f)));
  });
  grouped_gemm<T>(Trans::T, P(1), acts.a, w.w2, w.d, F, P(0), y, off);
}

template <class T>
void swiglu_experts_backward(const SwiGLUWeights<T>& w, const View2<const T>& xp, const SwiGLUActs<T>& acts,
                             const View2<const T>& dy, const std::vector<index_t>& off, const View2<T>& dxp,
                             bool accumulate, const SwiGLUGrads<T>& g) {
  using P = acc_t<T>;
  const index_t m = xp.extent(0), F = w.F;
  PoolScope ws;  // cached device blocks (no cudaMalloc/cudaFree per call), returned at the end
  View2<T> dh1 = ws.take<View2<T>>("moe::dh1", m, F);
  View2<T> dh3 = ws.take<View2<T>>("moe::dh3", m, F);
  // da = dy W2_g (into dh1), dW2_g += dy^T a
  grouped_gemm<T>(Trans::N, P(1), dy, w.w2, w.d, F, P(0), dh1, off);
  grouped_gemm_wgrad<T>(P(1), dy, acts.a, P(1), g.w2, off);
  auto h1 = acts.h1;
  auto h3 = acts.h3;
  par_for("moe::swiglu_backward", m, F, KOKKOS_LAMBDA(index_t r, index_t f) {
    const P da = P(dh1(r, f)), u = P(h1(r, f)), v = P(h3(r, f));
    dh1(r, f) = static_cast<T>(da * v * dsilu(u));
    dh3(r, f) = static_cast<T>(da * silu(u));
  });
  grouped_gemm<T>(Trans::N, P(1), dh1, w.w1, F, w.d, accumulate ? P(1) : P(0), dxp, off);
  grouped_gemm<T>(Trans::N, P(1), dh3, w.w3, F, w.d, P(1), dxp, off);
  grouped_gemm_wgrad<T>(P(1), dh1, xp, P(1), g.w1, off);
  grouped_gemm_wgrad<T>(P(1), dh3, xp, P(1), g.w3, off);
}

// ---------------------------------------------------------------- bf16 expert path

namespace {

template <class C, class G>
void grouped_bf16(G gemm_fn, Trans tw, float alpha, const bf16_op_t* A, index_t lda, const bf16_op_t* W,
                  index_t wr, index_t wc, float beta, C* out, index_t ldc, const std::vector<index_t>& off) {
  require(!off.empty() && off.front() == 0, "moe::grouped_gemm_bf16", "group offsets must start at 0");
  const index_t G_ = index_t(off.size()) - 1, n = tw == Trans::T ? wr : wc, k = tw == Trans::T ? wc : wr;
  for (index_t g = 0; g < G_; ++g) {
    const index_t r0 = off[g], mg = off[g + 1] - off[g];
    require(mg >= 0, "moe::grouped_gemm_bf16", "group offsets decrease at group ", g);
    if (mg == 0) continue;
    gemm_fn(Trans::N, tw, mg, n, k, alpha, A + r0 * lda, lda, W + g * wr * wc, wc, beta,
            out + r0 * ldc, ldc);
  }
}

}  // namespace

void grouped_gemm_bf16_f32(Trans tw, float alpha, const bf16_op_t* A, index_t lda, const bf16_op_t* W, index_t wr,
                           index_t wc, float beta, float* C, index_t ldc, const std::vector<index_t>& off) {
  grouped_bf16<float>(gemm_bf16_f32, tw, alpha, A, lda, W, wr, wc, beta, C, ldc, off);
}

void grouped_gemm_bf16_b16(Trans tw, float alpha, const bf16_op_t* A, index_t lda, const bf16_op_t* W, index_t wr,
                           index_t wc, float beta, bf16_op_t* C, index_t ldc, const std::vector<index_t>& off) {
  grouped_bf16<bf16_op_t>(gemm_bf16_b16, tw, alpha, A, lda, W, wr, wc, beta, C, ldc, off);
}

void swiglu_weights_to_bf16(const SwiGLUWeights<float>& w, index_t G, SwiGLUBF16& acts, PoolScope* ws) {
  const index_t F = w.F, d = w.d;
  acts.w13 = take_or_alloc<View1<bf16_op_t>>(ws, "moe::w13_bf16", G * 2 * F * d);
  acts.w2 = take_or_alloc<View1<bf16_op_t>>(ws, "moe::w2_bf16", G * d * F);
  const float* w1 = w.w1;
  const float* w3 = w.w3;
  const float* w2 = w.w2;
  auto w13 = acts.w13;
  auto w2b = acts.w2;
  const index_t Fd = F * d;
#if defined(KOKKOS_ENABLE_CUDA)
  if (Fd % 8 == 0 && cuda_k::aligned16(w1) && cuda_k::aligned16(w3) && cuda_k::aligned16(w2) &&
      cuda_k::aligned16(w13.data()) && cuda_k::aligned16(w2b.data())) {
    cuda_k::launch("moe::w13_to_bf16", 2 * G * (Fd / 8), cuda_k::weights_to_bf16, w1, w3,
                   reinterpret_cast<uint4*>(w13.data()), G, Fd / 8);
    cuda_k::launch("moe::w2_to_bf16", G * (Fd / 8), cuda_k::weights_to_bf16, w2, nullptr,
                   reinterpret_cast<uint4*>(w2b.data()), G, Fd / 8);
    return;
  }
#endif
  // W13_g = [W1_g; W3_g]: row block g of 2F rows
  par_for("moe::w13_to_bf16", G * 2, Fd, KOKKOS_LAMBDA(index_t gh, index_t i) {
    const index_t g = gh / 2;
    w13(gh * Fd + i) = to_bf16_op(gh % 2 == 0 ? w1[g * Fd + i] : w3[g * Fd + i]);
  });
  par_for("moe::w2_to_bf16", G, Fd, KOKKOS_LAMBDA(index_t g, index_t i) { w2b(g * Fd + i) = to_bf16_op(w2[g * Fd + i]); });
}

void swiglu_experts_forward_bf16(const SwiGLUWeights<float>& w, const View2<const bf16_op_t>& xp,
                                 const std::vector<index_t>& off, SwiGLUBF16& acts, const View2<float>& y,
                                 PoolScope* ws) {
  const index_t m = xp.extent(0), F = w.F, d = w.d, G = index_t(off.size()) - 1;
  require(index_t(xp.extent(1)) == d && index_t(y.extent(1)) == d && index_t(y.extent(0)) == m,
          "moe::swiglu_experts_bf16", "xp is (", xp.extent(0), ", ", xp.extent(1), "), y is (", y.extent(0), ", ",
          y.extent(1), "), d_model = ", d);
  check_offsets(off, m, "moe::swiglu_experts_bf16");
  require(index_t(acts.w13.extent(0)) == G * 2 * F * d && index_t(acts.w2.extent(0)) == G * d * F,
          "moe::swiglu_experts_bf16", "the bf16 weights are not converted for ", G, " experts");
  acts.h13 = take_or_alloc<View2<bf16_op_t>>(ws, "moe::h13_bf16", m, 2 * F);
  acts.a = take_or_alloc<View2<bf16_op_t>>(ws, "moe::a_bf16", m, F);
  // h13 = xp W13_g^T (one GEMM per expert)
  grouped_gemm_bf16_b16(Trans::T, 1.0f, xp.data(), d, acts.w13.data(), 2 * F, d, 0.0f, acts.h13.data(), 2 * F, off);
  auto h13 = acts.h13;
  auto a = acts.a;
  bool native = false;
#if defined(KOKKOS_ENABLE_CUDA)
  if (F % 8 == 0 && index_t(h13.stride(0)) == 2 * F && index_t(a.stride(0)) == F && cuda_k::aligned16(h13.data()) &&
      cuda_k::aligned16(a.data())) {
    cuda_k::launch("moe::swiglu_bf16", m * (F / 8), cuda_k::swiglu_fwd, reinterpret_cast<const uint4*>(h13.data()),
                   reinterpret_cast<uint4*>(a.data()), m, int(F / 8));
    native = true;
  }
#endif
  if (!native)
    par_for("moe::swiglu_bf16", m, F, KOKKOS_LAMBDA(index_t r, index_t f) {
      const float u = from_bf16_op(h13(r, f)), v = from_bf16_op(h13(r, F + f));
      a(r, f) = to_bf16_op(silu(u) * v);
    });
  // y = a W2_g^T, fp32 out
  grouped_gemm_bf16_f32(Trans::T, 1.0f, acts.a.data(), F, acts.w2.data(), d, F, 0.0f, y.data(), d, off);
}

void swiglu_experts_backward_bf16(const SwiGLUWeights<float>& w, const View2<const bf16_op_t>& xp,
                                  const SwiGLUBF16& acts, const View2<const bf16_op_t>& dy,
                                  const std::vector<index_t>& off, const View2<float>& dxp, bool accumulate,
                                  const SwiGLUGrads<float>& g) {
  const index_t m = xp.extent(0), F = w.F, d = w.d, G = index_t(off.size()) - 1;
  require(index_t(dy.extent(0)) == m && index_t(dxp.extent(0)) == m && index_t(acts.h13.extent(0)) == m,
          "moe::swiglu_experts_backward_bf16", "xp has ", m, " rows, dy ", dy.extent(0), ", dxp ", dxp.extent(0),
          ", the saved activations ", acts.h13.extent(0));
  check_offsets(off, m, "moe::swiglu_experts_backward_bf16");
  PoolScope ws;  // cached device blocks, returned at the end
  View2<bf16_op_t> da = ws.take<View2<bf16_op_t>>("moe::da_bf16", m, F);
  View2<bf16_op_t> dh13 = ws.take<View2<bf16_op_t>>("moe::dh13_bf16", m, 2 * F);
  const bf16_op_t* w13 = acts.w13.data();
  const bf16_op_t* w2 = acts.w2.data();
  // da = dy W2_g (bf16 out); dW2_g += dy_g^T a_g (fp32)
  grouped_gemm_bf16_b16(Trans::N, 1.0f, dy.data(), d, w2, d, F, 0.0f, da.data(), F, off);
  for (index_t e = 0; e < G; ++e) {
    const index_t r0 = off[e], mg = off[e + 1] - off[e];
    if (mg == 0) continue;
    gemm_bf16_f32(Trans::T, Trans::N, d, F, mg, 1.0f, dy.data() + r0 * d, d, acts.a.data() + r0 * F, F, 1.0f,
                  g.w2 + e * d * F, F);
  }
  auto h13 = acts.h13;
  bool native = false;
#if defined(KOKKOS_ENABLE_CUDA)
  if (F % 8 == 0 && index_t(h13.stride(0)) == 2 * F && index_t(da.stride(0)) == F &&
      index_t(dh13.stride(0)) == 2 * F && cuda_k::aligned16(h13.data()) && cuda_k::aligned16(da.data()) &&
      cuda_k::aligned16(dh13.data())) {
    cuda_k::launch("moe::swiglu_backward_bf16", m * (F / 8), cuda_k::swiglu_bwd,
                   reinterpret_cast<const uint4*>(da.data()), reinterpret_cast<const uint4*>(h13.data()),
                   reinterpret_cast<uint4*>(dh13.data()), m, int(F / 8));
    native = true;
  }
#endif
  if (!native)
    par_for("moe::swiglu_backward_bf16", m, F, KOKKOS_LAMBDA(index_t r, index_t f) {
      const float dav = from_bf16_op(da(r, f)), u = from_bf16_op(h13(r, f)), v = from_bf16_op(h13(r, F + f));
      dh13(r, f) = to_bf16_op(dav * v * dsilu(u));
      dh13(r, F + f) = to_bf16_op(dav * silu(u));
    });
  // dxp = dh13 W13_g (fp32 out, one GEMM per expert)
  grouped_gemm_bf16_f32(Trans::N, 1.0f, dh13.data(), 2 * F, w13, 2 * F, d, accumulate ? 1.0f : 0.0f, dxp.data(), d,
                        off);
  // dW1_g += dh13_g[:, :F]^T xp_g, dW3_g += dh13_g[:, F:]^T xp_g (fp32)
  for (index_t e = 0; e < G; ++e) {
    const index_t r0 = off[e], mg = off[e + 1] - off[e];
    if (mg == 0) continue;
    const bf16_op_t* dh = dh13.data() + r0 * 2 * F;
    const bf16_op_t* xg = xp.data() + r0 * d;
    if (g.w3 > g.w1) {  // both in one call (the two column halves of dh13_g against the same xp_g)
      gemm_bf16_f32_batched(Trans::T, Trans::N, F, d, mg, 1.0f, dh, 2 * F, F, xg, d, 0, 1.0f, g.w1 + e * F * d, d,
                            index_t(g.w3 - g.w1), 2);
    } else {
      gemm_bf16_f32(Trans::T, Trans::N, F, d, mg, 1.0f, dh, 2 * F, xg, d, 1.0f, g.w1 + e * F * d, d);
      gemm_bf16_f32(Trans::T, Trans::N, F, d, mg, 1.0f, dh + F, 2 * F, xg, d, 1.0f, g.w3 + e * F * d, d);
    }
  }
}

template <class T>
void moe_permute(const View2<const T>& x, const View1<const index_t>& perm_token, const View2<T>& xp) {
  const index_t m = xp.extent(0), d = xp.extent(1);
  par_for("moe::permute", m, d, KOKKOS_LAMBDA(index_t r, index_t c) { xp(r, c) = x(perm_token(r), c); });
}

template <class T>
void moe_unpermute_combine(const View2<const T>& y, const View2<const index_t>& row,
                           const View2<const acc_t<T>>& gate, const View2<T>& out, bool accumulate) {
  using P = acc_t<T>;
  const index_t n = out.extent(0), d = out.extent(1), k = row.extent(1);
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same_v<T, float>) {
    if (d % 4 == 0 && index_t(row.stride(0)) == k &&
        cuda_k::float4_rows({{y.data(), y.stride(0)}, {out.data(), out.stride(0)}})) {
      cuda_k::launch("moe::unpermute_combine", n * (d / 4), cuda_k::combine_rows, y.data(), y.stride(0), row.data(),
                     gate.data(), gate.stride(0), int(k), nullptr, 0, nullptr, 0, 0, out.data(), out.stride(0),
                     accumulate, n, int(d / 4));
      return;
    }
  }
#endif
  par_for("moe::unpermute_combine", n, d, KOKKOS_LAMBDA(index_t x, index_t c) {
    P s = accumulate ? P(out(x, c)) : P(0);
    for (index_t j = 0; j < k; ++j) {
      const index_t r = row(x, j);
      if (r >= 0) s += gate(x, j) * P(y(r, c));
    }
    out(x, c) = static_cast<T>(s);
  });
}

namespace {

template <class T>
struct CastTo {
  KOKKOS_INLINE_FUNCTION T operator()(acc_t<T> v) const { return static_cast<T>(v); }
};
struct ToBF16Op {
  KOKKOS_INLINE_FUNCTION bf16_op_t operator()(float v) const { return to_bf16_op(v); }
};

// dy[r] = conv(gate(tok, slot) * dout[tok]) in dy's storage type; dgate as documented
template <class T, class D, class Conv>
void combine_backward_impl(const View2<const T>& dout, const View2<const T>& y, const View2<const index_t>& row,
                           const View2<const acc_t<T>>& gate, const View1<const index_t>& perm_token,
                           const View1<const std::int32_t>& perm_slot, const View2<D>& dy, const View2<acc_t<T>>& dgate,
                           Conv conv) {
  using P = acc_t<T>;
  const index_t m = dy.extent(0), d = dy.extent(1), n = row.extent(0), k = row.extent(1);
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same_v<T, float> && std::is_same_v<D, bf16_op_t>) {  // dy and dgate in one pass
    if (d % 4 == 0 && index_t(dout.stride(0)) % 4 == 0 && index_t(y.stride(0)) % 4 == 0 && index_t(dy.stride(0)) == d &&
        index_t(row.stride(0)) == k && cuda_k::aligned16(dout.data()) && cuda_k::aligned16(y.data()) &&
        cuda_k::aligned16(dy.data())) {
      const long long warps = std::max<long long>(1, n * k);
      cuda_k::launch_grid("moe::combine_backward_bf16",
                          dim3(unsigned(std::min<long long>((warps + 7) / 8, 132LL * 16))), dim3(256),
                          cuda_k::combine_backward_bf16, dout.data(), dout.stride(0), y.data(), y.stride(0), row.data(),
                          int(k), gate.data(), gate.stride(0), reinterpret_cast<uint2*>(dy.data()), dgate.data(),
                          dgate.stride(0), n, int(d / 4));
      return;
    }
  }
#endif
  par_for(
      "moe::combine_backward_dy", m, d, KOKKOS_LAMBDA(index_t r, index_t c) {
        const index_t x = perm_token(r);
        dy(r, c) = conv(gate(x, perm_slot(r)) * P(dout(x, c)));
      });
  // one row per vector-lane group (coalesced reads of dout and y rows on GPUs; on host backends one lane, the
  // columns summed in order)
  par_for_rows("moe::combine_backward_dgate", n, KOKKOS_LAMBDA(const Team& tm, index_t x) {
    for (index_t j = 0; j < k; ++j) {
      const index_t r = row(x, j);
      P s = 0;
      if (r >= 0)
        Kokkos::parallel_reduce(
            Kokkos::ThreadVectorRange(tm, d), [&](index_t c, P& acc) { acc += P(dout(x, c)) * P(y(r, c)); }, s);
      Kokkos::single(Kokkos::PerThread(tm), [&]() { dgate(x, j) = s; });
    }
  });
}

}  // namespace

template <class T>
void moe_combine_backward(const View2<const T>& dout, const View2<const T>& y, const View2<const index_t>& row,
                          const View2<const acc_t<T>>& gate, const View1<const index_t>& perm_token,
                          const View1<const std::int32_t>& perm_slot, const View2<T>& dy,
                          const View2<acc_t<T>>& dgate) {
  combine_backward_impl<T>(dout, y, row, gate, perm_token, perm_slot, dy, dgate, CastTo<T>{});
}

void moe_combine_backward_bf16(const View2<const float>& dout, const View2<const float>& y,
                               const View2<const index_t>& row, const View2<const float>& gate,
                               const View1<const index_t>& perm_token, const View1<const std::int32_t>& perm_slot,
                               const View2<bf16_op_t>& dy, const View2<float>& dgate) {
  combine_backward_impl<float>(dout, y, row, gate, perm_token, perm_slot, dy, dgate, ToBF16Op{});
}

void moe_permute_bf16(const View2<const float>& x, const View1<const index_t>& perm_token,
                      const View2<bf16_op_t>& xp) {
  const index_t m = xp.extent(0), d = xp.extent(1);
#if defined(KOKKOS_ENABLE_CUDA)
  if (d % 8 == 0 && index_t(x.stride(0)) % 4 == 0 && index_t(xp.stride(0)) == d && cuda_k::aligned16(x.data()) &&
      cuda_k::aligned16(xp.data())) {
    cuda_k::launch("moe::permute_bf16", m * (d / 8), cuda_k::gather_bf16, x.data(), x.stride(0), perm_token.data(),
                   reinterpret_cast<uint4*>(xp.data()), m, int(d / 8));
    return;
  }
#endif
  par_for("moe::permute_bf16", m, d, KOKKOS_LAMBDA(index_t r, index_t c) {
    xp(r, c) = to_bf16_op(x(perm_token(r), c));
  });
}

template <class T>
void moe_permute_backward(const View2<const T>& dxp, const View2<const index_t>& row, const View2<T>& dx,
                          bool accumulate) {
  using P = acc_t<T>;
  const index_t n = dx.extent(0), d = dx.extent(1), k = row.extent(1);
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same_v<T, float>) {
    if (d % 4 == 0 && index_t(row.stride(0)) == k &&
        cuda_k::float4_rows({{dxp.data(), dxp.stride(0)}, {dx.data(), dx.stride(0)}})) {
      cuda_k::launch("moe::permute_backward", n * (d / 4), cuda_k::combine_rows, dxp.data(), dxp.stride(0), row.data(),
                     nullptr, 0, int(k), nullptr, 0, nullptr, 0, 0, dx.data(), dx.stride(0), accumulate, n,
                     int(d / 4));
      return;
    }
  }
#endif
  par_for("moe::permute_backward", n, d, KOKKOS_LAMBDA(index_t x, index_t c) {
    P s = accumulate ? P(dx(x, c)) : P(0);
    for (index_t j = 0; j < k; ++j) {
      const index_t r = row(x, j);
      if (r >= 0) s += P(dxp(r, c));
    }
    dx(x, c) = static_cast<T>(s);
  });
}

bool router_logits_fp32(const View2<const float>& x, const View2<const float>& W, const View2<float>& logits) {
#if defined(KOKKOS_ENABLE_CUDA)
  const index_t n = x.extent(0), d = x.extent(1), E = W.extent(0);
  if (n == 0 || E < 1 || E > 16 || d % 4 != 0 || index_t(W.extent(1)) != d || index_t(logits.extent(0)) != n ||
      index_t(logits.extent(1)) != E || !cuda_k::float4_rows({{x.data(), x.stride(0)}, {W.data(), W.stride(0)}}))
    return false;
  constexpr int R = 4;  // rows per warp
  const long long blocks = std::clamp<long long>((n + 8 * R - 1) / (8 * R), 1, 132LL * 16);
  auto kernel = E <= 8 ? cuda_k::router_logits<8, R> : cuda_k::router_logits<16, R>;
  cuda_k::launch_grid("moe::router_logits", dim3(unsigned(blocks)), dim3(256), kernel, x.data(), x.stride(0), W.data(),
                      W.stride(0), int(E), logits.data(), logits.stride(0), n, int(d / 4));
  return true;
#else
  (void)x, (void)W, (void)logits;
  return false;
#endif
}

bool router_backward_fp32(const View2<const float>& x, const View2<const float>& W, const View2<const float>& dl,
                          const View2<const float>& dxp, const View2<const index_t>& row, const View2<float>& dx,
                          bool accumulate, const View2<float>& dW) {
#if defined(KOKKOS_ENABLE_CUDA)
  const index_t n = x.extent(0), d = x.extent(1), E = W.extent(0), k = row.extent(1);
  if (n == 0 || E < 1 || E > 16 || d % 4 != 0 || index_t(W.extent(1)) != d || index_t(dl.extent(0)) != n ||
      index_t(dl.extent(1)) != E || index_t(row.extent(0)) != n || index_t(row.stride(0)) != k ||
      index_t(dxp.extent(1)) != d || index_t(dx.extent(0)) != n || index_t(dx.extent(1)) != d ||
      index_t(dW.extent(0)) != E || index_t(dW.extent(1)) != d || index_t(dW.stride(0)) != d ||
      !cuda_k::float4_rows({{x.data(), x.stride(0)}, {W.data(), W.stride(0)}, {dxp.data(), dxp.stride(0)},
                            {dx.data(), dx.stride(0)}, {dW.data(), dW.stride(0)}}))
    return false;
  // dx: the permute's backward plus dl W, one float4 of a row per thread
  cuda_k::launch("moe::permute_router_backward", n * (d / 4), cuda_k::combine_rows, dxp.data(), dxp.stride(0),
                 row.data(), nullptr, 0, int(k), dl.data(), dl.stride(0), W.data(), W.stride(0), int(E), dx.data(),
                 dx.stride(0), accumulate, n, int(d / 4));
  // dW: per-block partials over about 3 blocks of rows per SM (90 registers a thread for E <= 8), then their sum in
  // block order
  const index_t d4 = d / 4, bx = std::min<index_t>(256, (d4 + 31) / 32 * 32), gy = (d4 + bx - 1) / bx;
  index_t chunks = std::clamp<index_t>(index_t(cuda_k::sm_count()) * 3 / gy, 1, (n + 7) / 8);
  const index_t rpb = ((n + chunks - 1) / chunks + 7) / 8 * 8;
  chunks = (n + rpb - 1) / rpb;
  PoolScope ws;
  View1<float> part = ws.take<View1<float>>("moe::router_wgrad_partials", chunks * E * d);
  auto kernel = E <= 8 ? cuda_k::router_wgrad<8> : cuda_k::router_wgrad<16>;
  cuda_k::launch_grid("moe::router_wgrad", dim3(unsigned(chunks), unsigned(gy)), dim3(unsigned(bx)), kernel, x.data(),
                      x.stride(0), dl.data(), dl.stride(0), int(E), reinterpret_cast<float4*>(part.data()), n,
                      int(d4), rpb);
  cuda_k::add_partials("moe::router_wgrad_sum", part.data(), chunks, E * d, dW.data());
  return true;
#else
  (void)x, (void)W, (void)dl, (void)dxp, (void)row, (void)dx, (void)accumulate, (void)dW;
  return false;
#endif
}

#define MM_INSTANTIATE(T)                                                                                          \
  template void grouped_gemm<T>(Trans, acc_t<T>, const View2<const T>&, const T*, index_t, index_t, acc_t<T>,     \
                                const View2<T>&, const std::vector<index_t>&);                                     \
  template void grouped_gemm_wgrad<T>(acc_t<T>, const View2<const T>&, const View2<const T>&, acc_t<T>, T*,       \
                                      const std::vector<index_t>&);                                                \
  template void swiglu_experts_forward<T>(const SwiGLUWeights<T>&, const View2<const T>&,                          \
                                          const std::vector<index_t>&, SwiGLUActs<T>&, const View2<T>&,            \
                                          PoolScope*);                                                             \
  template void swiglu_experts_backward<T>(const SwiGLUWeights<T>&, const View2<const T>&, const SwiGLUActs<T>&,   \
                                           const View2<const T>&, const std::vector<index_t>&, const View2<T>&,    \
                                           bool, const SwiGLUGrads<T>&);                                           \
  template void moe_permute<T>(const View2<const T>&, const View1<const index_t>&, const View2<T>&);               \
  template void moe_unpermute_combine<T>(const View2<const T>&, const View2<const index_t>&,                       \
                                         const View2<const acc_t<T>>&, const View2<T>&, bool);                     \
  template void moe_combine_backward<T>(const View2<const T>&, const View2<const T>&, const View2<const index_t>&, \
                                        const View2<const acc_t<T>>&, const View1<const index_t>&,                 \
                                        const View1<const std::int32_t>&, const View2<T>&,                         \
                                        const View2<acc_t<T>>&);                                                   \
  template void moe_permute_backward<T>(const View2<const T>&, const View2<const index_t>&, const View2<T>&, bool);
MM_INSTANTIATE(float)
MM_INSTANTIATE(double)
#undef MM_INSTANTIATE

}  // namespace mm
