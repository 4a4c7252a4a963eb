#include "moe/experts.hpp"

#include "core/error.hpp"

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
  acts.h1 = take_or_alloc<View2<T>>(ws, "moe::h1", m, F);
  acts.h3 = take_or_alloc<View2<T>>(ws, "moe::h3", m, F);
  acts.a = take_or_alloc<View2<T>>(ws, "moe::a", m, F);
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
  par_for("moe::unpermute_combine", n, d, KOKKOS_LAMBDA(index_t x, index_t c) {
    P s = accumulate ? P(out(x, c)) : P(0);
    for (index_t j = 0; j < k; ++j) {
      const index_t r = row(x, j);
      if (r >= 0) s += gate(x, j) * P(y(r, c));
    }
    out(x, c) = static_cast<T>(s);
  });
}

template <class T>
void moe_combine_backward(const View2<const T>& dout, const View2<const T>& y, const View2<const index_t>& row,
                          const View2<const acc_t<T>>& gate, const View1<const index_t>& perm_token,
                          const View1<const std::int32_t>& perm_slot, const View2<T>& dy,
                          const View2<acc_t<T>>& dgate) {
  using P = acc_t<T>;
  const index_t m = dy.extent(0), d = dy.extent(1), n = row.extent(0), k = row.extent(1);
  par_for("moe::combine_backward_dy", m, d, KOKKOS_LAMBDA(index_t r, index_t c) {
    const index_t x = perm_token(r);
    dy(r, c) = static_cast<T>(gate(x, perm_slot(r)) * P(dout(x, c)));
  });
  par_for("moe::combine_backward_dgate", n, k, KOKKOS_LAMBDA(index_t x, index_t j) {
    const index_t r = row(x, j);
    P s = 0;
    if (r >= 0)
      for (index_t c = 0; c < d; ++c) s += P(dout(x, c)) * P(y(r, c));
    dgate(x, j) = s;
  });
}

template <class T>
void moe_permute_backward(const View2<const T>& dxp, const View2<const index_t>& row, const View2<T>& dx,
                          bool accumulate) {
  using P = acc_t<T>;
  const index_t n = dx.extent(0), d = dx.extent(1), k = row.extent(1);
  par_for("moe::permute_backward", n, d, KOKKOS_LAMBDA(index_t x, index_t c) {
    P s = accumulate ? P(dx(x, c)) : P(0);
    for (index_t j = 0; j < k; ++j) {
      const index_t r = row(x, j);
      if (r >= 0) s += P(dxp(r, c));
    }
    dx(x, c) = static_cast<T>(s);
  });
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
