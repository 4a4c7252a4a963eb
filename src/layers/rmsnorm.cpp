#include "layers/rmsnorm.hpp"

#include "core/error.hpp"
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

template <class X, class T>
void rmsnorm_forward(const View2<const X>& x, const View1<const acc_t<T>>& w, double eps, const View2<T>& y,
                     const View1<acc_t<T>>& rstd) {
  using P = acc_t<T>;
  const index_t n = x.extent(0), d = x.extent(1);
  const P e = P(eps);
  par_for_rows("rmsnorm::forward", n, KOKKOS_LAMBDA(const Team& tm, index_t i) {
    const P ss = strands_sum<P>(tm, 0, d, [&](index_t j) { return P(x(i, j)) * P(x(i, j)); });
    const P r = P(1) / Kokkos::sqrt(ss / P(d) + e);
    Kokkos::single(Kokkos::PerThread(tm), [&]() { rstd(i) = r; });
    strands_for(tm, 0, d, [&](index_t j) { y(i, j) = static_cast<T>(P(x(i, j)) * r * w(j)); });
  });
}

template <class X, class T>
void rmsnorm_backward(const View2<const X>& x, const View1<const acc_t<T>>& w, const View1<const acc_t<T>>& rstd,
                      const View2<const T>& dy, const View2<X>& dx, bool accumulate_dx,
                      const View1<acc_t<T>>& dw) {
  using P = acc_t<T>;
  const index_t n = x.extent(0), d = x.extent(1);
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
