// A Mamba-2 forecaster for long time series, channel-independent (every channel of every window is its own row,
// sharing all weights, PatchTST-style):
//
//   RevIN:   x_hat = (x - mu) / sigma * gamma_c + beta_c      (mu, sigma per row over its observed inputs, no
//                                                              gradient; masked inputs enter as mu)
//   patches: the input window cut into input_len / patch_len tokens (patch_len = 1: one token per step), each
//            embedded by a linear map to d_model
//   MambaBackbone over the patch tokens
//   head:    a linear map from all patch tokens' outputs (flattened) to `horizon` values (direct multi-horizon)
//   de-RevIN: y_hat = (y' - beta_c) / (gamma_c + 1e-10) * sigma + mu
//
// The loss is the squared error against the targets over observed targets (the mean absolute error is reported
// alongside).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "layers/cross_entropy.hpp"
#include "model/backbone.hpp"

namespace mm {

struct ForecastConfig {
  index_t input_len = 336;
  index_t horizon = 96;     // the head predicts this many steps
  index_t patch_len = 16;   // 1: per-step tokens
  index_t channels = 1;     // RevIN's affine parameters are per channel
  bool revin_affine = true;
  index_t n_layer = 2;
  double norm_eps = 1e-5;
  Mamba2Config mixer;
  LayerStackConfig layers;  // the layer pattern (empty: n_layer x M2); MoE aux losses are added as in lm.hpp
  index_t n_patch() const { return input_len / patch_len; }
  void validate(const std::string& context) const;
};

// Rows of windows on the host: row r is one channel of one window; values are the protocol's z-scored values.
struct SeriesBatch {
  index_t rows = 0, input_len = 0, horizon = 0;
  std::vector<double> x, y;           // rows x input_len, rows x horizon (NaN where masked)
  std::vector<std::uint8_t> xm, ym;   // masks, 1 = observed
  std::vector<std::int32_t> channel;  // channel of each row
  std::int64_t scored() const;
};

template <class T>
class Forecaster {
 public:
  using P = acc_t<T>;
  using R = P;
  using HostBatch = SeriesBatch;

  explicit Forecaster(const ForecastConfig& cfg);

  const ForecastConfig& config() const { return cfg_; }
  ParamStore<P>& params() { return params_; }
  const ParamStore<P>& params() const { return params_; }
  void initialize(std::uint64_t seed) { params_.initialize(seed); }

  // Squared error summed over observed targets (aux: absolute error); with grad_scale > 0 also the backward of
  // grad_scale * (sum of squared errors), accumulating parameter gradients.
  LossSum forward_backward(const SeriesBatch& b, double grad_scale, Recompute policy);
  LossSum forward(const SeriesBatch& b) { return forward_backward(b, 0.0, Recompute::mixer); }

  // Forecasts of the last forward, rows x horizon, in the units of the batch's values.
  std::vector<double> predictions() const;

  MambaBackbone<T>& backbone() { return *backbone_; }

  static std::int64_t scored(const SeriesBatch& b) { return b.scored(); }
  static std::int64_t tokens(const SeriesBatch& b) { return b.rows * b.input_len; }
  static constexpr const char* metric_name = "mae";
  static double metric(const LossSum& l) { return l.count > 0 ? l.aux / double(l.count) : 0.0; }

 private:
  ForecastConfig cfg_;
  ParamStore<P> params_;
  std::size_t revin_w_, revin_b_, patch_w_, patch_b_, head_w_, head_b_;
  std::unique_ptr<MambaBackbone<T>> backbone_;
  View2<T> pred_;
};

}  // namespace mm
