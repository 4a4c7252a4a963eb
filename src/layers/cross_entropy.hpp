// Softmax cross-entropy over the vocabulary, with ignored targets (< 0). Reported in nats and in bits per base
// (nats / ln 2) by the callers.
#pragma once

#include "core/kokkos_types.hpp"

namespace mm {

inline constexpr double kLn2 = 0.69314718055994530941723212145818;

// A summed loss: `nats` is the summed loss (cross-entropy in nats, or squared error for regression), `aux` a
// second summed quantity a model may report (absolute error for regression), over `count` targets.
struct LossSum {
  double nats = 0;
  double aux = 0;
  std::int64_t count = 0;
  double bits_per_token() const { return count > 0 ? nats / double(count) / kLn2 : 0.0; }
  double mean_nats() const { return count > 0 ? nats / double(count) : 0.0; }
};

// Loss summed over rows with target >= 0. If dlogits is non-empty it receives
// grad_scale * (softmax(logits) - onehot(target)) (rows with ignored targets get 0); if row_nats is non-empty it
// receives each row's loss (0 for ignored targets).
template <class T>
LossSum cross_entropy(const View2<const T>& logits, const Kokkos::View<const std::int32_t*, Layout, Mem>& targets,
                      double grad_scale, const View2<T>& dlogits, const View1<double>& row_nats = View1<double>());

}  // namespace mm
