#include "layers/rmsnorm.hpp"

#include "core/cuda_launch.hpp"
#include "core/error.hpp"
#include "core/pool.hpp"
#include "tensor/gemm.hpp"
#include "tensor/ops.hpp"

namespace mm {

namespace {
// A row segment [j0, j0 + n) over the vector lanes in kStrands interleaved strands: lane i takes j0 + i + k m for
// k < kStrands, m = ceil(n / kStrands). Each strand reads coalesced, and a lane has kStrands independent loads in
// flight instead of one per dependent step (one element per lane and step ran the norms at ~1.3 TB/s on an H200).
constexpr index_t kStrands = 4;

template <class F>
KOKKOS_INLINE_FUNCTION void strands_for(const Team& tm, index_t j0, index_t n, const F& f) {
  const index_t m = (n + kStrands - 1) / kStrands;
  Kokkos::parallel_for(Kokkos::ThreadVectorRange(tm, m), [&](index_t i) {
MM_UNROLL
    for (index_t k = 0; k < kStrands; ++k)
      if (i + k * m < n) f(j0 + i + k * m);
  });
}

template <class P, class F>
KOKKOS_INLINE_FUNCTION P strands_sum(const Team& tm, index_t j0, index_t n, const F& f) {
  const index_t m = (n + kStrands - 1) / kStrands;
  P total = 0;
  Kokkos::parallel_reduce(
      Kokkos::ThreadVectorRange(tm, m),
      [&](index_t i, P& a) {
        P v[kStrands];
MM_UNROLL
        for (index_t k = 0; k < kStrands; ++k) v[k] = i + k * m < n ? f(j0 + i + k * m) : P(0);
MM_UNROLL
        for (index_t k = 0; k < kStrands; ++k) a += v[k];
      },
      total);
  return total;
}
}  // namespace

#if defined(KOKKOS_ENABLE_CUDA)
// Native CUDA forms of the gated norm and the plain RMSNorm for float data: one warp (groups of up to 512 columns)
// or one block of 4 warps (up to 2,048) per (row, group) with the group's x and z in registers (float4 loads),
// silu from the exp unit and a fast reciprocal, and the backward's
// weight gradient summed in the same pass (partials per row slot, then their sum in slot order). The Kokkos forms
// (scalar loads, library expf and IEEE division in each of their passes, the weight gradient as a separate column
// reduction over x, z and dy again) took 39.9 ms of a 303 ms 24-layer LM step on an H200 (perf/RESULTS.md, fourth
// session). Taken for groups of up to 2,048 columns in 16-byte aligned windows; the Kokkos forms stay the fallback
// and the host path.
namespace cuda_k {

constexpr int kNormWarps = 4;  // warps per block

__device__ __forceinline__ float& comp(float4& v, int k) { return (&v.x)[k]; }
__device__ __forceinline__ float comp(const float4& v, int k) { return (&v.x)[k]; }

// The threads of a row: WPR warps (1, or all kNormWarps of the block for groups of more than 128 float4), thread li
// of the row holding float4 li + 32 WPR v (v < V) of the group; kNormWarps / WPR rows per block at a time. One warp
// per row held a 1,536-column group in 12 float4 per lane for each of x, z and the weight gradient's sums: about
// 200 registers a thread, few warps per SM, and the backward ran at 2.2 TB/s on an H200.
template <int V, int WPR>
struct RowThreads {
  static constexpr int kRows = kNormWarps / WPR, kStride = 32 * WPR;
  int lane, slot, li;  // lane in its warp, row slot in the block, thread in the row
  __device__ RowThreads() : lane(threadIdx.x & 31), slot((threadIdx.x >> 5) / WPR), li(threadIdx.x % (32 * WPR)) {}
  __device__ bool has(int v, int gs4) const { return li + kStride * v < gs4; }
  __device__ int col(int v) const { return li + kStride * v; }
  // the row's sum of every thread's s (red: kNormWarps floats of shared memory; every thread of the block calls it)
  __device__ float sum(float s, float* red) const {
    s = warp_sum(s);
    if constexpr (WPR == 1) {
      return s;
    } else {
      if (lane == 0) red[threadIdx.x >> 5] = s;
      __syncthreads();
      float t = 0.f;
#pragma unroll
      for (int w = 0; w < WPR; ++w) t += red[slot * WPR + w];
      __syncthreads();
      return t;
    }
  }
};

// Row i's group g of x and of z (z null: zeros) into registers, where they exist.
template <int V, int WPR>
__device__ __forceinline__ void load_group(const RowThreads<V, WPR>& rt, const float* __restrict__ x, long long ldx,
                                           const float* __restrict__ z, long long ldz, long long i, int g, int gs4,
                                           float4 (&xv)[V], float4 (&zv)[V]) {
  const float4* x4 = reinterpret_cast<const float4*>(x + i * ldx) + g * gs4;
  const float4* z4 = reinterpret_cast<const float4*>(z + i * ldz) + g * gs4;
#pragma unroll
  for (int v = 0; v < V; ++v)
    if (rt.has(v, gs4)) xv[v] = x4[rt.col(v)], zv[v] = z ? z4[rt.col(v)] : float4{};
}

// y = x silu(z) rstd w (both orders), rstd = 1 / sqrt(mean(v^2) + eps) over the group, v = x silu(z) (gate_first)
// or x (gs4 float4 a group). z null: the plain RMSNorm (silu(z) = 1, norm_first). yb (rows ldyb apart) not null:
// y rounded to bf16 there as well (y null: only there), the input of a GEMM on bf16 operands.
template <int V, int WPR>
__global__ void __launch_bounds__(32 * kNormWarps)
    gated_norm_fwd(const float* __restrict__ x, long long ldx, const float* __restrict__ z, long long ldz,
                   const float* __restrict__ w, float* __restrict__ y, long long ldy, __nv_bfloat16* __restrict__ yb,
                   long long ldyb, float* __restrict__ rstd, long long ldr, long long n, int gs4, bool gate_first,
                   float eps) {
  using RT = RowThreads<V, WPR>;
  __shared__ float red[kNormWarps];
  const RT rt;
  const int g = blockIdx.y;
  const float4* w4 = reinterpret_cast<const float4*>(w) + g * gs4;
  // the block's rows advance together (the row sum synchronises the block)
  for (long long i0 = (long long)blockIdx.x * RT::kRows; i0 < n; i0 += (long long)gridDim.x * RT::kRows) {
    const long long i = i0 + rt.slot;
    const bool live = i < n;
    float4 xv[V], sv[V];
    if (live) load_group<V, WPR>(rt, x, ldx, z, ldz, i, g, gs4, xv, sv);
    float ss = 0.f;
#pragma unroll
    for (int v = 0; v < V; ++v)
      if (live && rt.has(v, gs4))
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float zz = comp(sv[v], k), s = z ? zz * sigm(zz) : 1.f, xx = comp(xv[v], k);
          comp(sv[v], k) = s;
          const float u = gate_first ? xx * s : xx;
          ss = fmaf(u, u, ss);
        }
    ss = rt.sum(ss, red);
    if (!live) continue;
    const float r = 1.f / sqrtf(ss / float(4 * gs4) + eps);
    if (rt.li == 0) rstd[i * ldr + g] = r;
#pragma unroll
    for (int v = 0; v < V; ++v)
      if (rt.has(v, gs4)) {
        float4 wv = w4[rt.col(v)], o;
#pragma unroll
        for (int k = 0; k < 4; ++k) comp(o, k) = comp(xv[v], k) * comp(sv[v], k) * r * comp(wv, k);
        if (y) (reinterpret_cast<float4*>(y + i * ldy) + g * gs4)[rt.col(v)] = o;
        if (yb) (reinterpret_cast<uint2*>(yb + i * ldyb) + g * gs4)[rt.col(v)] = pack4(o);
      }
  }
}

// dx (plus the old dx with acc_dx), dz of the gated norm (formulas as the Kokkos form below; z and dz null: the
// plain RMSNorm); dwpart[slot, col] = the sum of dy x silu(z) rstd over the rows of one row slot of one block (every
// slot writes its row of partials, zeros when it had no rows).
template <int V, int WPR>
__global__ void __launch_bounds__(32 * kNormWarps)
    gated_norm_bwd(const float* __restrict__ x, long long ldx, const float* __restrict__ z, long long ldz,
                   const float* __restrict__ w, const float* __restrict__ rstd, long long ldr,
                   const float* __restrict__ dy, long long lddy, float* __restrict__ dx, long long lddx,
                   float* __restrict__ dz, long long lddz, __nv_bfloat16* __restrict__ dzb, long long lddzb,
                   float* __restrict__ dwpart, long long width, long long n, int gs4, bool gate_first, bool acc_dx) {
  using RT = RowThreads<V, WPR>;
  __shared__ float red[kNormWarps];
  const RT rt;
  const int g = blockIdx.y;
  const float4* w4 = reinterpret_cast<const float4*>(w) + g * gs4;
  const float inv_gs = 1.f / float(4 * gs4);
  float4 acc[V];
#pragma unroll
  for (int v = 0; v < V; ++v) acc[v] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (long long i0 = (long long)blockIdx.x * RT::kRows; i0 < n; i0 += (long long)gridDim.x * RT::kRows) {
    const long long i = i0 + rt.slot;
    const bool live = i < n;
    const float r = live ? rstd[i * ldr + g] : 0.f;
    const float4* d4 = reinterpret_cast<const float4*>(dy + i * lddy) + g * gs4;
    float4 xv[V], zv[V], dv4[V];
    if (live) load_group<V, WPR>(rt, x, ldx, z, ldz, i, g, gs4, xv, zv);
    // v = the normalised quantity (x silu(z) if gate_first, x otherwise); dv = dL/d(normalised v)
    float dot = 0.f;
#pragma unroll
    for (int v = 0; v < V; ++v)
      if (live && rt.has(v, gs4)) {
        const float4 dd = d4[rt.col(v)], wv = w4[rt.col(v)];
        dv4[v] = dd;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float zz = comp(zv[v], k), s = z ? zz * sigm(zz) : 1.f, xx = comp(xv[v], k), dk = comp(dd, k);
          const float vv = gate_first ? xx * s : xx, dv = gate_first ? dk * comp(wv, k) : dk * comp(wv, k) * s;
          dot = fmaf(dv, vv, dot);
          comp(acc[v], k) += dk * xx * s * r;
        }
      }
    dot = rt.sum(dot, red);
    if (!live) continue;
    const float c = r * r * dot * inv_gs;
    float4* dx4 = reinterpret_cast<float4*>(dx + i * lddx) + g * gs4;
    float4* dz4 = reinterpret_cast<float4*>(dz + i * lddz) + g * gs4;
#pragma unroll
    for (int v = 0; v < V; ++v)
      if (rt.has(v, gs4)) {
        const float4 dd = dv4[v], wv = w4[rt.col(v)];
        float4 ox, oz;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float zz = comp(zv[v], k), sg = z ? sigm(zz) : 1.f, s = z ? zz * sg : 1.f;
          const float ds = sg * (1.f + zz * (1.f - sg));
          const float xx = comp(xv[v], k), dk = comp(dd, k), wk = comp(wv, k);
          if (gate_first) {
            const float du = r * (dk * wk - xx * s * c);
            comp(ox, k) = du * s;
            comp(oz, k) = du * xx * ds;
          } else {
            comp(ox, k) = r * (dk * wk * s - xx * c);
            comp(oz, k) = dk * xx * r * wk * ds;
          }
        }
        if (acc_dx) {
          const float4 o = dx4[rt.col(v)];
#pragma unroll
          for (int k = 0; k < 4; ++k) comp(ox, k) = comp(o, k) + comp(ox, k);
        }
        dx4[rt.col(v)] = ox;
        if (dz) dz4[rt.col(v)] = oz;
        // dz as a bf16 copy (the input gradient of a GEMM on bf16 operands)
        if (dzb) (reinterpret_cast<uint2*>(dzb + i * lddzb) + g * gs4)[rt.col(v)] = pack4(oz);
      }
  }
  float4* p4 = reinterpret_cast<float4*>(dwpart + ((long long)blockIdx.x * RT::kRows + rt.slot) * width) + g * gs4;
#pragma unroll
  for (int v = 0; v < V; ++v)
    if (rt.has(v, gs4)) p4[rt.col(v)] = acc[v];
}

// Whether the native kernels take groups of gs columns: a multiple of 4 columns, at most 2,048.
inline bool norm_size_fits(index_t gs) { return gs % 4 == 0 && gs > 0 && gs <= 2048; }

// Whether the native kernels take groups of gs columns over these (pointer, row stride) pairs: 16-byte aligned
// rows, group sizes the kernels hold.
inline bool norm_fits(index_t gs, std::initializer_list<std::pair<const void*, long long>> rows) {
  return norm_size_fits(gs) && float4_rows(rows);
}

// The kernel K<V, WPR> for groups of gs4 float4: one warp a row up to 128 float4 (V = 1..4), the block's 4 warps a
// row beyond (V = 2..4).
template <class F>
F pick_norm_kernel(index_t gs4, F k11, F k21, F k31, F k41, F k24, F k34, F k44) {
  if (gs4 <= 32) return k11;
  if (gs4 <= 64) return k21;
  if (gs4 <= 96) return k31;
  if (gs4 <= 128) return k41;
  if (gs4 <= 256) return k24;
  if (gs4 <= 384) return k34;
  return k44;
}
inline int norm_rows_per_block(index_t gs4) { return gs4 <= 128 ? kNormWarps : 1; }

// Blocks along the rows for ng groups: one wave of the kernel's resident blocks, at most one row slot per row.
template <class K>
unsigned norm_row_blocks(K kernel, index_t n, index_t ng, int rows_per_block) {
  const index_t resident = resident_blocks(kernel, 32 * kNormWarps);
  return unsigned(std::clamp<index_t>(resident / ng, 1, (n + rows_per_block - 1) / rows_per_block));
}

// The launches (norm_fits checked by the caller; z null: the plain RMSNorm).
void norm_forward(const char* name, const float* x, index_t ldx, const float* z, index_t ldz, const float* w,
                  float* y, index_t ldy, float* rstd, index_t ldr, index_t n, index_t width, index_t gs,
                  bool gate_first, double eps, __nv_bfloat16* yb = nullptr, index_t ldyb = 0) {
  const index_t gs4 = gs / 4, ng = width / gs;
  auto kernel = pick_norm_kernel(gs4, gated_norm_fwd<1, 1>, gated_norm_fwd<2, 1>, gated_norm_fwd<3, 1>,
                                 gated_norm_fwd<4, 1>, gated_norm_fwd<2, 4>, gated_norm_fwd<3, 4>,
                                 gated_norm_fwd<4, 4>);
  const int rpb = norm_rows_per_block(gs4);
  launch_grid(name, dim3(norm_row_blocks(kernel, n, ng, rpb), unsigned(ng)), dim3(32 * kNormWarps), kernel, x, ldx,
              z, ldz, w, y, ldy, yb, ldyb, rstd, ldr, n, int(gs4), gate_first, float(eps));
}

void norm_backward(const char* name, const char* name_dw, const float* x, index_t ldx, const float* z, index_t ldz,
                   const float* w, const float* rstd, index_t ldr, const float* dy, index_t lddy, float* dx,
                   index_t lddx, bool acc_dx, float* dz, index_t lddz, float* dw, index_t n, index_t width, index_t gs,
                   bool gate_first, __nv_bfloat16* dzb = nullptr, index_t lddzb = 0) {
  const index_t gs4 = gs / 4, ng = width / gs;
  auto kernel = pick_norm_kernel(gs4, gated_norm_bwd<1, 1>, gated_norm_bwd<2, 1>, gated_norm_bwd<3, 1>,
                                 gated_norm_bwd<4, 1>, gated_norm_bwd<2, 4>, gated_norm_bwd<3, 4>,
                                 gated_norm_bwd<4, 4>);
  const int rpb = norm_rows_per_block(gs4);
  const unsigned rb = norm_row_blocks(kernel, n, ng, rpb);
  const index_t parts = index_t(rb) * rpb;
  PoolScope ws;
  View1<float> part = ws.take<View1<float>>(std::string(name_dw) + "_partials", parts * width);
  launch_grid(name, dim3(rb, unsigned(ng)), dim3(32 * kNormWarps), kernel, x, ldx, z, ldz, w, rstd, ldr, dy, lddy, dx,
              lddx, dz, lddz, dzb, lddzb, part.data(), width, n, int(gs4), gate_first, acc_dx);
  add_partials(name_dw, part.data(), parts, width, dw);
}

}  // namespace cuda_k
#endif

template <class X, class T>
void rmsnorm_forward(const View2<const X>& x, const View1<const acc_t<T>>& w, double eps, const View2<T>& y,
                     const View1<acc_t<T>>& rstd) {
  using P = acc_t<T>;
  const index_t n = x.extent(0), d = x.extent(1);
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same_v<X, float> && std::is_same_v<T, float>) {
    if (n > 0 && cuda_k::norm_fits(d, {{x.data(), x.stride(0)}, {y.data(), y.stride(0)}, {w.data(), 0}})) {
      cuda_k::norm_forward("rmsnorm::forward", x.data(), x.stride(0), nullptr, 0, w.data(), y.data(), y.stride(0),
                           rstd.data(), 1, n, d, d, false, eps);
      return;
    }
  }
#endif
  const P e = P(eps);
  par_for_rows("rmsnorm::forward", n, KOKKOS_LAMBDA(const Team& tm, index_t i) {
    const P ss = strands_sum<P>(tm, 0, d, [&](index_t j) { return P(x(i, j)) * P(x(i, j)); });
    const P r = P(1) / Kokkos::sqrt(ss / P(d) + e);
    Kokkos::single(Kokkos::PerThread(tm), [&]() { rstd(i) = r; });
    strands_for(tm, 0, d, [&](index_t j) { y(i, j) = static_cast<T>(P(x(i, j)) * r * w(j)); });
  });
}

void rmsnorm_forward_bf16(const View2<const float>& x, const View1<const float>& w, double eps,
                          const View2<bf16_op_t>& yb, const View1<float>& rstd) {
  const index_t n = x.extent(0), d = x.extent(1);
  require(index_t(yb.extent(0)) == n && index_t(yb.extent(1)) == d, "rmsnorm", "bf16 output of ", yb.extent(0), "x",
          yb.extent(1), " for an input of ", n, "x", d);
#if defined(KOKKOS_ENABLE_CUDA)
  // (8-byte stores of 4 bf16: rows of a multiple of 4 columns, 8-byte aligned)
  if (n > 0 && d % 4 == 0 && yb.stride(0) % 4 == 0 && reinterpret_cast<std::uintptr_t>(yb.data()) % 8 == 0 &&
      cuda_k::norm_fits(d, {{x.data(), x.stride(0)}, {w.data(), 0}})) {
    cuda_k::norm_forward("rmsnorm::forward", x.data(), x.stride(0), nullptr, 0, w.data(), nullptr, 0, rstd.data(), 1,
                         n, d, d, false, eps, reinterpret_cast<__nv_bfloat16*>(yb.data()), yb.stride(0));
    return;
  }
#endif
  // elsewhere: the fp32 output, then rounded
  PoolScope ws;
  View2<float> y = ws.take<View2<float>>("rmsnorm::y_fp32", n, d);
  rmsnorm_forward<float, float>(x, w, eps, y, rstd);
  round_to_bf16("rmsnorm::round_bf16", y, yb);
}

template <class X, class T>
void rmsnorm_backward(const View2<const X>& x, const View1<const acc_t<T>>& w, const View1<const acc_t<T>>& rstd,
                      const View2<const T>& dy, const View2<X>& dx, bool accumulate_dx,
                      const View1<acc_t<T>>& dw) {
  using P = acc_t<T>;
  const index_t n = x.extent(0), d = x.extent(1);
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same_v<X, float> && std::is_same_v<T, float>) {
    if (n > 0 && index_t(dw.extent(0)) == d &&
        cuda_k::norm_fits(d, {{x.data(), x.stride(0)}, {dy.data(), dy.stride(0)}, {dx.data(), dx.stride(0)},
                              {w.data(), 0}, {dw.data(), 0}})) {
      cuda_k::norm_backward("rmsnorm::backward", "rmsnorm::backward_dw", x.data(), x.stride(0), nullptr, 0, w.data(),
                            rstd.data(), 1, dy.data(), dy.stride(0), dx.data(), dx.stride(0), accumulate_dx, nullptr,
                            0, dw.data(), n, d, d, false);
      return;
    }
  }
#endif
  par_for_rows("rmsnorm::backward_dx", n, KOKKOS_LAMBDA(const Team& tm, index_t i) {
    const P r = rstd(i);
    const P dot = strands_sum<P>(tm, 0, d, [&](index_t j) { return P(dy(i, j)) * w(j) * P(x(i, j)); });
    const P c = r * r * dot / P(d);
    strands_for(tm, 0, d, [&](index_t j) {
      const P g = r * (P(dy(i, j)) * w(j) - P(x(i, j)) * c);
      dx(i, j) = accumulate_dx ? static_cast<X>(P(dx(i, j)) + g) : static_cast<X>(g);
    });
  });
  column_reduce<P>("rmsnorm::backward_dw", n, d,
                   KOKKOS_LAMBDA(index_t i, index_t j) { return P(dy(i, j)) * P(x(i, j)) * rstd(i); }, dw, true);
}

template <class T>
void gated_rmsnorm_forward(const GatedNormIn<T>& in, index_t width, index_t group_size, GateOrder order,
                           const View1<const acc_t<T>>& w, double eps, const View2<T>& y,
                           const View2<acc_t<T>>& rstd) {
  using P = acc_t<T>;
  require(group_size > 0 && width % group_size == 0, "gated_rmsnorm", "width ", width,
          " is not divisible by group_size ", group_size);
  const index_t n = y.extent(0), ng = width / group_size;
  const auto x = in.x;
  const auto z = in.z;
  const index_t xc = in.x_col, zc = in.z_col;
  const bool gate_first = order == GateOrder::gate_first;
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same_v<T, float>) {
    if (n > 0 && xc % 4 == 0 && zc % 4 == 0 &&
        cuda_k::norm_fits(group_size, {{x.data() + xc, x.stride(0)}, {z.data() + zc, z.stride(0)},
                                       {y.data(), y.stride(0)}, {w.data(), 0}})) {
      cuda_k::norm_forward("gated_rmsnorm::forward", x.data() + xc, x.stride(0), z.data() + zc, z.stride(0), w.data(),
                           y.data(), y.stride(0), rstd.data(), rstd.stride(0), n, width, group_size, gate_first, eps);
      return;
    }
  }
#endif
  const P e = P(eps);
  par_for_rows("gated_rmsnorm::forward", n * ng, KOKKOS_LAMBDA(const Team& tm, index_t ig) {
    const index_t i = ig / ng, g = ig % ng, j0 = g * group_size;
    // (one element per lane and step: the strands of the plain norm ran these ~40 % slower on an H200)
    P ss = 0;
    Kokkos::parallel_reduce(
        Kokkos::ThreadVectorRange(tm, j0, j0 + group_size),
        [&](index_t j, P& a) {
          const P u = gate_first ? P(x(i, xc + j)) * silu(P(z(i, zc + j))) : P(x(i, xc + j));
          a += u * u;
        },
        ss);
    const P r = P(1) / Kokkos::sqrt(ss / P(group_size) + e);
    Kokkos::single(Kokkos::PerThread(tm), [&]() { rstd(i, g) = r; });
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(tm, j0, j0 + group_size), [&](index_t j) {
      const P s = silu(P(z(i, zc + j)));
      y(i, j) = static_cast<T>(P(x(i, xc + j)) * s * r * w(j));
    });
  });
}

void gated_rmsnorm_forward_bf16(const GatedNormIn<float>& in, index_t width, index_t group_size, GateOrder order,
                                const View1<const float>& w, double eps, const View2<bf16_op_t>& yb,
                                const View2<float>& rstd) {
  const index_t n = yb.extent(0);
  require(index_t(yb.extent(1)) == width, "gated_rmsnorm", "bf16 output of ", yb.extent(1), " columns for width ",
          width);
#if defined(KOKKOS_ENABLE_CUDA)
  // (8-byte stores of 4 bf16: rows of a multiple of 4 columns, 8-byte aligned)
  if (n > 0 && in.x_col % 4 == 0 && in.z_col % 4 == 0 && width % 4 == 0 &&
      reinterpret_cast<std::uintptr_t>(yb.data()) % 8 == 0 &&
      cuda_k::norm_fits(group_size, {{in.x.data() + in.x_col, in.x.stride(0)}, {in.z.data() + in.z_col, in.z.stride(0)},
                                     {w.data(), 0}})) {
    require(width % group_size == 0, "gated_rmsnorm", "width ", width, " is not divisible by group_size ", group_size);
    cuda_k::norm_forward("gated_rmsnorm::forward", in.x.data() + in.x_col, in.x.stride(0), in.z.data() + in.z_col,
                         in.z.stride(0), w.data(), nullptr, 0, rstd.data(), rstd.stride(0), n, width, group_size,
                         order == GateOrder::gate_first, eps, reinterpret_cast<__nv_bfloat16*>(yb.data()), yb.stride(0));
    return;
  }
#endif
  // elsewhere: the fp32 output, then rounded
  PoolScope ws;
  View2<float> y = ws.take<View2<float>>("gated_rmsnorm::y_fp32", n, width);
  gated_rmsnorm_forward<float>(in, width, group_size, order, w, eps, y, rstd);
  round_to_bf16("gated_rmsnorm::round_bf16", y, yb);
}

template <class T>
void gated_rmsnorm_backward(const GatedNormIn<T>& in, index_t width, index_t group_size, GateOrder order,
                            const View1<const acc_t<T>>& w, const View2<const acc_t<T>>& rstd,
                            const View2<const T>& dy, const UView2<T>& dx, index_t dx_col, const UView2<T>& dz,
                            index_t dz_col, const View1<acc_t<T>>& dw) {
  using P = acc_t<T>;
  const index_t n = dy.extent(0), ng = width / group_size;
  const auto x = in.x;
  const auto z = in.z;
  const index_t xc = in.x_col, zc = in.z_col;
  const bool gate_first = order == GateOrder::gate_first;
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same_v<T, float>) {
    if (n > 0 && index_t(dw.extent(0)) == width && xc % 4 == 0 && zc % 4 == 0 && dx_col % 4 == 0 &&
        dz_col % 4 == 0 &&
        cuda_k::norm_fits(group_size, {{x.data() + xc, x.stride(0)}, {z.data() + zc, z.stride(0)},
                                       {dy.data(), dy.stride(0)}, {dx.data() + dx_col, dx.stride(0)},
                                       {dz.data() + dz_col, dz.stride(0)}, {w.data(), 0}, {dw.data(), 0}})) {
      cuda_k::norm_backward("gated_rmsnorm::backward", "gated_rmsnorm::backward_dw", x.data() + xc, x.stride(0),
                            z.data() + zc, z.stride(0), w.data(), rstd.data(), rstd.stride(0), dy.data(),
                            dy.stride(0), dx.data() + dx_col, dx.stride(0), false, dz.data() + dz_col, dz.stride(0),
                            dw.data(), n, width, group_size, gate_first);
      return;
    }
  }
#endif
  par_for_rows("gated_rmsnorm::backward_dx", n * ng, KOKKOS_LAMBDA(const Team& tm, index_t ig) {
    const index_t i = ig / ng, g = ig % ng, j0 = g * group_size;
    const P r = rstd(i, g);
    // v = the normalised quantity (u = x silu(z) if gate_first, x otherwise); dv = dL/d(normalised v)
    P dot = 0;
    Kokkos::parallel_reduce(
        Kokkos::ThreadVectorRange(tm, j0, j0 + group_size),
        [&](index_t j, P& a) {
          const P s = silu(P(z(i, zc + j)));
          const P v = gate_first ? P(x(i, xc + j)) * s : P(x(i, xc + j));
          const P dv = gate_first ? P(dy(i, j)) * w(j) : P(dy(i, j)) * w(j) * s;
          a += dv * v;
        },
        dot);
    const P c = r * r * dot / P(group_size);
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(tm, j0, j0 + group_size), [&](index_t j) {
      const P zz = P(z(i, zc + j));
      const P s = silu(zz);
      const P xx = P(x(i, xc + j));
      if (gate_first) {
        const P u = xx * s;
        const P du = r * (P(dy(i, j)) * w(j) - u * c);
        dx(i, dx_col + j) = static_cast<T>(du * s);
        dz(i, dz_col + j) = static_cast<T>(du * xx * dsilu(zz));
      } else {
        const P dnx = P(dy(i, j)) * w(j) * s;
        dx(i, dx_col + j) = static_cast<T>(r * (dnx - xx * c));
        dz(i, dz_col + j) = static_cast<T>(P(dy(i, j)) * xx * r * w(j) * dsilu(zz));
      }
    });
  });
  column_reduce<P>(
      "gated_rmsnorm::backward_dw", n, width,
      KOKKOS_LAMBDA(index_t i, index_t j) {
        const P s = silu(P(z(i, zc + j)));
        return P(dy(i, j)) * P(x(i, xc + j)) * s * rstd(i, j / group_size);
      },
      dw, true);
}

void gated_rmsnorm_backward_bf16dz(const GatedNormIn<float>& in, index_t width, index_t group_size, GateOrder order,
                                   const View1<const float>& w, const View2<const float>& rstd,
                                   const View2<const float>& dy, const UView2<float>& dx, index_t dx_col,
                                   const UView2<bf16_op_t>& dzb, index_t dz_col, const View1<float>& dw) {
  const index_t n = dy.extent(0);
#if defined(KOKKOS_ENABLE_CUDA)
  // (8-byte stores of 4 bf16: the window's start a multiple of 4 columns, rows 8-byte aligned)
  if (n > 0 && index_t(dw.extent(0)) == width && in.x_col % 4 == 0 && in.z_col % 4 == 0 && dx_col % 4 == 0 &&
      dz_col % 4 == 0 && dzb.stride(0) % 4 == 0 && reinterpret_cast<std::uintptr_t>(dzb.data()) % 8 == 0 &&
      cuda_k::norm_fits(group_size, {{in.x.data() + in.x_col, in.x.stride(0)}, {in.z.data() + in.z_col, in.z.stride(0)},
                                     {dy.data(), dy.stride(0)}, {dx.data() + dx_col, dx.stride(0)}, {w.data(), 0},
                                     {dw.data(), 0}})) {
    cuda_k::norm_backward("gated_rmsnorm::backward", "gated_rmsnorm::backward_dw", in.x.data() + in.x_col,
                          in.x.stride(0), in.z.data() + in.z_col, in.z.stride(0), w.data(), rstd.data(),
                          rstd.stride(0), dy.data(), dy.stride(0), dx.data() + dx_col, dx.stride(0), false, nullptr, 0,
                          dw.data(), n, width, group_size, order == GateOrder::gate_first,
                          reinterpret_cast<__nv_bfloat16*>(dzb.data()) + dz_col, dzb.stride(0));
    return;
  }
#endif
  // elsewhere: dz in fp32, then rounded into its window
  PoolScope ws;
  View2<float> dz = ws.take<View2<float>>("gated_rmsnorm::dz_fp32", n, width);
  gated_rmsnorm_backward<float>(in, width, group_size, order, w, rstd, dy, dx, dx_col, dz, 0, dw);
  round_to_bf16("gated_rmsnorm::round_dz_bf16", dz, dzb, dz_col);
}

#define MM_INSTANTIATE(X, T)                                                                                      \
  template void rmsnorm_forward<X, T>(const View2<const X>&, const View1<const acc_t<T>>&, double,               \
                                      const View2<T>&, const View1<acc_t<T>>&);                                  \
  template void rmsnorm_backward<X, T>(const View2<const X>&, const View1<const acc_t<T>>&,                      \
                                       const View1<const acc_t<T>>&, const View2<const T>&, const View2<X>&,     \
                                       bool, const View1<acc_t<T>>&);
MM_INSTANTIATE(float, float)
MM_INSTANTIATE(double, double)
#undef MM_INSTANTIATE

#define MM_INSTANTIATE(T)                                                                                         \
  template void gated_rmsnorm_forward<T>(const GatedNormIn<T>&, index_t, index_t, GateOrder,                     \
                                         const View1<const acc_t<T>>&, double, const View2<T>&,                  \
                                         const View2<acc_t<T>>&);                                                \
  template void gated_rmsnorm_backward<T>(const GatedNormIn<T>&, index_t, index_t, GateOrder,                    \
                                          const View1<const acc_t<T>>&, const View2<const acc_t<T>>&,            \
                                          const View2<const T>&, const UView2<T>&, index_t, const UView2<T>&,    \
                                          index_t, const View1<acc_t<T>>&);
MM_INSTANTIATE(float)
MM_INSTANTIATE(double)
#undef MM_INSTANTIATE

}  // namespace mm
