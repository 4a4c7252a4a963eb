// AdamW over a ParamStore's flat buffers (fp32 master weights and moments), global-norm gradient clipping, and the
// warmup + cosine learning-rate schedule.
#pragma once

#include "model/params.hpp"

namespace mm {

struct AdamWConfig {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
  double grad_clip = 1.0;  // max global gradient norm; <= 0 disables clipping
};

// lr(step) for step = 0, 1, ...: linear warmup from lr/warmup to lr over `warmup` steps, then a half cosine from lr
// down to min_lr at step `total` - 1 (and min_lr after).
struct LRSchedule {
  double lr = 1e-3, min_lr = 1e-4;
  std::int64_t warmup = 0, total = 1;
  double at(std::int64_t step) const;
};

template <class P>
class AdamW {
 public:
  AdamW(const ParamStore<P>& params, const AdamWConfig& cfg) : AdamW(params, cfg, 0, params.total()) {}
  // ZeRO-1: the moments of the flat-buffer elements [lo, hi) only; step() updates those parameters only.
  AdamW(const ParamStore<P>& params, const AdamWConfig& cfg, index_t lo, index_t hi);

  // Global L2 norm of the gradients (deterministic ordered sum).
  double grad_norm(const ParamStore<P>& params) const;

  // One update at learning rate `lr`; `step` counts from 1 (bias correction). Gradients are scaled by
  // min(1, grad_clip / norm) first. Returns the pre-clip gradient norm.
  double step(ParamStore<P>& params, double lr, std::int64_t t) { return step(params, lr, t, grad_norm(params)); }
  // The same with the gradient norm given (a sharded model's global norm).
  double step(ParamStore<P>& params, double lr, std::int64_t step, double norm);

  index_t lo() const { return lo_; }
  index_t hi() const { return hi_; }
  // The moments of [lo, hi).
  const View1<P>& m() const { return m_; }
  const View1<P>& v() const { return v_; }
  const AdamWConfig& config() const { return cfg_; }

 private:
  AdamWConfig cfg_;
  index_t lo_ = 0, hi_ = 0;
  View1<P> m_, v_;
  Kokkos::View<std::uint8_t*, Layout, Mem> decay_;  // 1 where weight decay applies
};

}  // namespace mm
