#include "train/optimizer.hpp"

#include <cmath>

#include "tensor/ops.hpp"

namespace mm {

double LRSchedule::at(std::int64_t step) const {
  if (warmup > 0 && step < warmup) return lr * double(step + 1) / double(warmup);
  const std::int64_t span = total - warmup - 1;
  if (span <= 0) return lr;
  const double progress = std::min(1.0, double(step - warmup) / double(span));
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

template <class P>
AdamW<P>::AdamW(const ParamStore<P>& params, const AdamWConfig& cfg, index_t lo, index_t hi)
    : cfg_(cfg), lo_(lo), hi_(hi) {
  require(0 <= lo && lo <= hi && hi <= params.total(), "AdamW", "range [", lo, ", ", hi, ") outside the ",
          params.total(), " parameters");
  m_ = View1<P>("adamw::m", hi - lo);
  v_ = View1<P>("adamw::v", hi - lo);
  decay_ = Kokkos::View<std::uint8_t*, Layout, Mem>("adamw::decay", hi - lo);
  auto h = Kokkos::create_mirror_view(decay_);
  for (const auto& e : params.entries())
    for (index_t i = 0; i < e.size; ++i)
      if (e.offset + i >= lo && e.offset + i < hi) h(e.offset + i - lo) = e.decay ? 1 : 0;
  Kokkos::deep_copy(decay_, h);
}

template <class P>
double AdamW<P>::grad_norm(const ParamStore<P>& params) const {
  const auto g = params.grads();
  const double ss = ordered_sum<double>("adamw::grad_norm", g.extent(0), KOKKOS_LAMBDA(index_t i) {
    return double(g(i)) * double(g(i));
  });
  return std::sqrt(ss);
}

template <class P>
double AdamW<P>::step(ParamStore<P>& params, double lr, std::int64_t step, double norm) {
  const P clip = (cfg_.grad_clip > 0 && norm > cfg_.grad_clip) ? P(cfg_.grad_clip / (norm + 1e-6)) : P(1);
  const P b1 = P(cfg_.beta1), b2 = P(cfg_.beta2), eps = P(cfg_.eps), wd = P(cfg_.weight_decay), lr_ = P(lr);
  const P bc1 = P(1.0 - std::pow(cfg_.beta1, double(step))), bc2 = P(1.0 - std::pow(cfg_.beta2, double(step)));
  const auto p = params.values();
  const auto g = params.grads();
  const auto m = m_;
  const auto v = v_;
  const auto decay = decay_;
  const index_t lo = lo_;
  par_for("adamw::step", hi_ - lo_, KOKKOS_LAMBDA(index_t k) {
    const index_t i = lo + k;
    const P gi = g(i) * clip;
    const P mi = b1 * m(k) + (P(1) - b1) * gi;
    const P vi = b2 * v(k) + (P(1) - b2) * gi * gi;
    m(k) = mi;
    v(k) = vi;
    const P upd = (mi / bc1) / (Kokkos::sqrt(vi / bc2) + eps);
    p(i) -= lr_ * (upd + (decay(k) ? wd * p(i) : P(0)));
  });
  return norm;
}

template class AdamW<float>;
template class AdamW<double>;

}  // namespace mm
