#include "layers/cross_entropy.hpp"

#include "tensor/ops.hpp"

namespace mm {

template <class T>
LossSum cross_entropy(const View2<const T>& logits, const Kokkos::View<const std::int32_t*, Layout, Mem>& targets,
                      double grad_scale, const View2<T>& dlogits, const View1<double>& row_nats) {
  using P = acc_t<T>;
  const index_t n = logits.extent(0), V = logits.extent(1);
  const bool want_grad = dlogits.extent(0) > 0;
  const P scale = P(grad_scale);
  PoolScope ws;  // the per-row losses when the caller does not keep them: a cached block, not an allocation per step
  const View1<double> row_loss =
      row_nats.extent(0) == std::size_t(n) ? row_nats : ws.take<View1<double>>("cross_entropy::row_loss", n);
  par_for("cross_entropy::rows", n, KOKKOS_LAMBDA(index_t i) {
    const int tgt = targets(i);
    P mx = P(logits(i, 0));
    for (index_t v = 1; v < V; ++v) mx = P(logits(i, v)) > mx ? P(logits(i, v)) : mx;
    P se = 0;
    for (index_t v = 0; v < V; ++v) se += Kokkos::exp(P(logits(i, v)) - mx);
    const P lse = mx + Kokkos::log(se);
    row_loss(i) = tgt >= 0 ? double(lse - P(logits(i, tgt))) : 0.0;
    if (want_grad) {
      for (index_t v = 0; v < V; ++v) {
        const P p = Kokkos::exp(P(logits(i, v)) - lse);
        dlogits(i, v) = tgt >= 0 ? static_cast<T>(scale * (p - (v == tgt ? P(1) : P(0)))) : T(0);
      }
    }
  });
  LossSum out;
  out.nats = ordered_sum<double>("cross_entropy::sum", n, KOKKOS_LAMBDA(index_t i) { return row_loss(i); });
  out.count = ordered_sum<double>("cross_entropy::count", n,
                                  KOKKOS_LAMBDA(index_t i) { return targets(i) >= 0 ? 1.0 : 0.0; });
  return out;
}

#define MM_INSTANTIATE(T)                                                                                      \
  template LossSum cross_entropy<T>(const View2<const T>&, const Kokkos::View<const std::int32_t*, Layout, Mem>&, \
                                    double, const View2<T>&, const View1<double>&);
MM_INSTANTIATE(float)
MM_INSTANTIATE(double)
#undef MM_INSTANTIATE

}  // namespace mm
