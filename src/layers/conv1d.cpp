#include "layers/conv1d.hpp"

#include "tensor/ops.hpp"

namespace mm {

namespace {
KOKKOS_INLINE_FUNCTION bool same_record(const SeqIdxView& seq, index_t b, index_t t, index_t s) {
  return seq.extent(0) == 0 || seq(b, s) == seq(b, t);
}

// The pre-activation of output (row, c): bias + the causal taps of the same record (forward and backward).
template <class T, class P>
KOKKOS_INLINE_FUNCTION P conv_pre(const View2<const T>& x, index_t col, index_t L, const View2<const P>& w,
                                  const View1<const P>& bias, const SeqIdxView& seq, index_t row, index_t c) {
  const index_t b = row / L, t = row % L, W = w.extent(1);
  P acc = bias(c);
  for (index_t k = 0; k < W; ++k) {
    const index_t s = t - (W - 1) + k;
    if (s >= 0 && same_record(seq, b, t, s)) acc += w(c, k) * P(x(b * L + s, col + c));
  }
  return acc;
}
}  // namespace

template <class T>
void conv1d_silu_forward(const Conv1dIn<T>& in, const View2<const acc_t<T>>& w, const View1<const acc_t<T>>& bias,
                         const SeqIdxView& seq_idx, const View2<T>& y) {
  const auto x = in.x;
  const index_t col = in.col, L = in.seqlen;
  par_for("conv1d::forward", in.batch * L, in.channels, KOKKOS_LAMBDA(index_t row, index_t c) {
    y(row, c) = static_cast<T>(silu(conv_pre(x, col, L, w, bias, seq_idx, row, c)));
  });
}

template <class T>
void conv1d_silu_backward(const Conv1dIn<T>& in, const View2<const acc_t<T>>& w, const View1<const acc_t<T>>& bias,
                          const SeqIdxView& seq_idx, const View2<const T>& dy, const UView2<T>& dx, index_t dx_col,
                          const View2<acc_t<T>>& dw, const View1<acc_t<T>>& dbias) {
  using P = acc_t<T>;
  const auto x = in.x;
  const index_t col = in.col, L = in.seqlen, W = w.extent(1), C = in.channels, n = in.batch * L;
  // dpre(t, c) = dy(t, c) * silu'(pre(t, c)), recomputing pre.
  View2<P> dpre(Kokkos::view_alloc(Kokkos::WithoutInitializing, "conv1d::dpre"), n, C);
  par_for("conv1d::backward_dpre", n, C, KOKKOS_LAMBDA(index_t row, index_t c) {
    dpre(row, c) = P(dy(row, c)) * dsilu(conv_pre(x, col, L, w, bias, seq_idx, row, c));
  });
  // dx(s, c) = sum_k w(c, k) dpre(s + (W-1) - k, c) over outputs t of the same record.
  par_for("conv1d::backward_dx", n, C, KOKKOS_LAMBDA(index_t row, index_t c) {
    const index_t b = row / L, s = row % L;
    P acc = 0;
    for (index_t k = 0; k < W; ++k) {
      const index_t t = s + (W - 1) - k;
      if (t < L && same_record(seq_idx, b, t, s)) acc += w(c, k) * dpre(b * L + t, c);
    }
    dx(row, dx_col + c) = static_cast<T>(acc);
  });
  // dw(c, k) = sum_t dpre(t, c) x(t - (W-1) + k, c); laid out as a (n) x (C * W) column reduction.
  View1<P> dw_flat(dw.data(), C * W);
  column_reduce<P>(
      "conv1d::backward_dw", n, C * W,
      KOKKOS_LAMBDA(index_t row, index_t ck) {
        const index_t c = ck / W, k = ck % W;
        const index_t b = row / L, t = row % L, s = t - (W - 1) + k;
        return (s >= 0 && same_record(seq_idx, b, t, s)) ? dpre(row, c) * P(x(b * L + s, col + c)) : P(0);
      },
      dw_flat, true);
  column_reduce<P>("conv1d::backward_dbias", n, C, KOKKOS_LAMBDA(index_t row, index_t c) { return dpre(row, c); },
                   dbias, true);
}

#define MM_INSTANTIATE(T)                                                                                       \
  template void conv1d_silu_forward<T>(const Conv1dIn<T>&, const View2<const acc_t<T>>&,                      \
                                       const View1<const acc_t<T>>&, const SeqIdxView&, const View2<T>&);     \
  template void conv1d_silu_backward<T>(const Conv1dIn<T>&, const View2<const acc_t<T>>&,                     \
                                        const View1<const acc_t<T>>&, const SeqIdxView&, const View2<const T>&, \
                                        const UView2<T>&, index_t, const View2<acc_t<T>>&, const View1<acc_t<T>>&);
MM_INSTANTIATE(float)
MM_INSTANTIATE(double)
#undef MM_INSTANTIATE

}  // namespace mm
