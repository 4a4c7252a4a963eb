#include "layers/embedding.hpp"

#include "tensor/ops.hpp"

namespace mm {

template <class T>
void embedding_forward(const View2<const acc_t<T>>& table, const TokenView& tokens, const View2<T>& out) {
  par_for("embedding::forward", out.extent(0), out.extent(1),
          KOKKOS_LAMBDA(index_t i, index_t j) { out(i, j) = static_cast<T>(table(tokens(i), j)); });
}

template <class T>
void embedding_backward(const View2<const T>& dout, const TokenView& tokens, const View2<acc_t<T>>& dtable) {
  using P = acc_t<T>;
  const index_t n = dout.extent(0), d = dout.extent(1), V = dtable.extent(0);
  // Rows are summed per (row block, column) in order, then block partials in order: no atomics.
  const index_t nb = (n + kReduceRowBlock - 1) / kReduceRowBlock;
  PoolScope ws;  // a cached block (zeroed here), not an allocation per training step
  const View3<P> partial = ws.take<View3<P>>("embedding::partial", nb > 0 ? nb : 1, V, d);
  Kokkos::deep_copy(Exec(), partial, P(0));
  par_for("embedding::backward_partial", nb, d, KOKKOS_LAMBDA(index_t b, index_t j) {
    const index_t i1 = (b + 1) * kReduceRowBlock < n ? (b + 1) * kReduceRowBlock : n;
    for (index_t i = b * kReduceRowBlock; i < i1; ++i) partial(b, tokens(i), j) += P(dout(i, j));
  });
  par_for("embedding::backward_sum", V, d, KOKKOS_LAMBDA(index_t v, index_t j) {
    P s = P(0);
    for (index_t b = 0; b < nb; ++b) s += partial(b, v, j);
    dtable(v, j) += s;
  });
}

#define MM_INSTANTIATE(T)                                                                                   \
  template void embedding_forward<T>(const View2<const acc_t<T>>&, const TokenView&, const View2<T>&);    \
  template void embedding_backward<T>(const View2<const T>&, const TokenView&, const View2<acc_t<T>>&);
MM_INSTANTIATE(float)
MM_INSTANTIATE(double)
#undef MM_INSTANTIATE

}  // namespace mm
