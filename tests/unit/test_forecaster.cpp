// The time-series forecaster: finite-difference gradients of every parameter (with masked inputs and targets, two
// channels), the loss against a direct computation from the predictions, and RevIN's invariance to the scale and
// offset of each input window.
#include <cmath>
#include <vector>

#include "catch.hpp"
#include "model/forecaster.hpp"
#include "util.hpp"

using namespace mm;
using mmtest::fd_check;
using mmtest::to_vec;

namespace {

ForecastConfig tiny() {
  ForecastConfig c;
  c.input_len = 12;
  c.horizon = 5;
  c.patch_len = 4;
  c.channels = 2;
  c.n_layer = 2;
  c.mixer.d_model = 8;
  c.mixer.d_state = 4;
  c.mixer.headdim = 4;
  c.mixer.chunk = 2;
  return c;
}

SeriesBatch batch(const ForecastConfig& c, index_t windows, std::uint64_t seed, bool with_masks) {
  SeriesBatch b;
  b.rows = windows * c.channels;
  b.input_len = c.input_len;
  b.horizon = c.horizon;
  const CounterRNG rng{seed, 3};
  for (index_t r = 0; r < b.rows; ++r) {
    b.channel.push_back(std::int32_t(r % c.channels));
    for (index_t t = 0; t < c.input_len + c.horizon; ++t) {
      const double v = std::sin(0.7 * double(t) + double(r)) + 0.3 * rng.normal(std::uint64_t(r * 100 + t));
      const bool masked = with_masks && (r * 7 + t) % 9 == 4;
      if (t < c.input_len) {
        b.x.push_back(masked ? std::nan("") : v);
        b.xm.push_back(masked ? 0 : 1);
      } else {
        b.y.push_back(masked ? std::nan("") : v);
        b.ym.push_back(masked ? 0 : 1);
      }
    }
  }
  return b;
}


}  // namespace

TEST_CASE("forecaster loss is the squared error of its predictions over observed targets", "[forecast]") {
  const ForecastConfig c = tiny();
  Forecaster<double> f(c);
  f.initialize(3);
  const SeriesBatch b = batch(c, 3, 1, true);
  const LossSum l = f.forward(b);
  const auto p = f.predictions();
  double se = 0, ae = 0;
  std::int64_t n = 0;
  for (std::size_t i = 0; i < p.size(); ++i)
    if (b.ym[i]) {
      se += (p[i] - b.y[i]) * (p[i] - b.y[i]);
      ae += std::abs(p[i] - b.y[i]);
      ++n;
    }
  CHECK(l.count == n);
  CHECK(l.nats == Approx(se).epsilon(1e-12));
  CHECK(l.aux == Approx(ae).epsilon(1e-12));
  for (double v : p) CHECK(std::isfinite(v));
}

TEST_CASE("forecaster backward matches finite differences for every parameter", "[forecast][gradcheck]") {
  const ForecastConfig c = tiny();
  Forecaster<double> f(c);
  f.initialize(5);
  mmtest::jitter_params(f.params(), 77, 0.2);
  const SeriesBatch b = batch(c, 2, 9, true);
  const double scale = 0.3;
  f.params().zero_grads();
  f.forward_backward(b, scale, Recompute::none);
  const auto grads = to_vec(f.params().grads());
  auto loss = [&]() { return scale * f.forward(b).nats; };
  for (const auto& e : f.params().entries()) {
    INFO(e.name);
    const std::vector<double> g(grads.begin() + e.offset, grads.begin() + e.offset + e.size);
    CHECK(fd_check(f.params().v1(f.params().index(e.name)), g, loss, 12).rel() < 1e-6);
  }
}

TEST_CASE("RevIN makes forecasts follow the scale and offset of each input window", "[forecast]") {
  // f(a x + b) = a f(x) + b per row, up to the variance epsilon of RevIN (negligible at these scales).
  const ForecastConfig c = tiny();
  Forecaster<double> f(c);
  f.initialize(8);
  mmtest::jitter_params(f.params(), 77, 0.2);
  SeriesBatch b = batch(c, 2, 4, false);
  for (double& v : b.x) v *= 100;  // variance far above RevIN's epsilon, so the identity holds to rounding
  for (double& v : b.y) v *= 100;
  f.forward(b);
  const auto p0 = f.predictions();
  const double a[] = {50.0, 20.0, 7.5, 300.0}, off[] = {1e3, -20.0, 3.0, 0.5};
  for (index_t r = 0; r < b.rows; ++r) {
    for (index_t t = 0; t < c.input_len; ++t) {
      double& v = b.x[std::size_t(r * c.input_len + t)];
      v = a[r] * v + off[r];
    }
    for (index_t k = 0; k < c.horizon; ++k) {
      double& v = b.y[std::size_t(r * c.horizon + k)];
      v = a[r] * v + off[r];
    }
  }
  f.forward(b);
  const auto p1 = f.predictions();
  for (index_t r = 0; r < b.rows; ++r)
    for (index_t k = 0; k < c.horizon; ++k) {
      const std::size_t i = std::size_t(r * c.horizon + k);
      CHECK(p1[i] == Approx(a[r] * p0[i] + off[r]).epsilon(1e-7));
    }
}

TEST_CASE("forecaster shapes that do not divide are errors naming the values", "[forecast]") {
  ForecastConfig c = tiny();
  c.patch_len = 5;
  CHECK_THROWS_WITH(Forecaster<double>(c), ContainsSubstring("input_len = 12 is not divisible by patch_len = 5"));
}
