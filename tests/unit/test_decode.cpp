// Decode support of the Mamba-1 and Mamba-2 mixers: a prefill of t tokens followed by one-token steps reproduces the
// full forward at every position; a long sequence processed in windows with the state carried in place equals one
// pass (windows shorter than the conv width included); and the backward of a forward that starts from a given
// state matches finite differences (so the conv prefix and the initial SSM state enter the gradients correctly).
#include <memory>
#include <vector>

#include "catch.hpp"
#include "ssm/mamba1/mixer.hpp"
#include "ssm/mamba2/mixer.hpp"
#include "util.hpp"

using namespace mm;
using mmtest::fd_check;
using mmtest::fill_uniform;
using mmtest::rel_err;
using mmtest::to_vec;

namespace {

Mamba1Config m1_cfg() {
  Mamba1Config c;
  c.d_model = 5;
  c.d_state = 3;
  c.d_conv = 4;
  c.dt_rank = 2;
  c.chunk = 4;
  return c;
}

Mamba2Config m2_cfg() {
  Mamba2Config c;
  c.d_model = 6;
  c.d_state = 4;
  c.expand = 2;
  c.headdim = 3;  // 4 heads
  c.ngroups = 2;
  c.chunk = 4;
  return c;
}

// A mixer with its parameter store, moved away from the special initial values.
template <class Mixer, class Cfg>
struct Setup {
  ParamStore<double> ps;
  std::unique_ptr<Mixer> mixer;
  explicit Setup(const Cfg& cfg) {
    mixer = std::make_unique<Mixer>(cfg, ps, "m.", 2);
    ps.allocate();
    ps.initialize(5);
    mmtest::jitter_params(ps, 99, 0.1);
  }
};

// Rows [t0, t1) of every batch row of a (B*L, D) host matrix, as a (B*(t1-t0), D) device matrix.
View2<double> window(const std::vector<double>& full, index_t B, index_t L, index_t D, index_t t0, index_t t1) {
  View2<double> w("window", B * (t1 - t0), D);
  std::vector<double> h;
  for (index_t b = 0; b < B; ++b)
    h.insert(h.end(), full.begin() + (b * L + t0) * D, full.begin() + (b * L + t1) * D);
  mmtest::from_vec(w, h);
  return w;
}

// Largest |a - ref| over rows [t0, t1) of every batch row, with a: (B*(t1-t0), D) and ref: (B*L, D).
double window_err(const std::vector<double>& a, const std::vector<double>& ref, index_t B, index_t L, index_t D,
                  index_t t0, index_t t1) {
  double e = 0;
  for (index_t b = 0; b < B; ++b)
    for (index_t t = t0; t < t1; ++t)
      for (index_t j = 0; j < D; ++j)
        e = std::max(e, std::abs(a[(b * (t1 - t0) + t - t0) * D + j] - ref[(b * L + t) * D + j]));
  return e;
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

// Prefill t tokens, then step one token at a time: every output equals the full forward's.
template <class Mixer, class Cfg, class Acts>
double prefill_then_step(const Cfg& cfg, index_t B, index_t L, const std::vector<index_t>& prefills) {
  Setup<Mixer, Cfg> s(cfg);
  const index_t D = cfg.d_model;
  View2<double> u("u", B * L, D), out("out", B * L, D);
  fill_uniform(u, 1);
  Acts acts;
  s.mixer->forward(u, B, L, SeqIdxView(), out, acts, false);
  const auto uv = to_vec(u), ref = to_vec(out);
  const double scale = max_abs(ref);
  double worst = 0;
  for (index_t t : prefills) {
    auto state = s.mixer->make_state(B);
    if (t > 0) {
      View2<double> o("o", B * t, D);
      Acts a;
      s.mixer->forward(window(uv, B, L, D, 0, t), B, t, SeqIdxView(), o, a, false, nullptr, &state);
      worst = std::max(worst, window_err(to_vec(o), ref, B, L, D, 0, t) / scale);
    }
    for (index_t k = t; k < L; ++k) {
      View2<double> o("o", B, D);
      s.mixer->step(window(uv, B, L, D, k, k + 1), state, o);
      const double e = window_err(to_vec(o), ref, B, L, D, k, k + 1) / scale;
      INFO("prefill " << t << ", step at position " << k);
      CHECK(e < 1e-12);
      worst = std::max(worst, e);
    }
  }
  return worst;
}

// Windows with the state carried in place equal one pass, outputs and final state.
template <class Mixer, class Cfg, class Acts>
double windowed_equals_one_pass(const Cfg& cfg, index_t B, const std::vector<index_t>& cuts) {
  Setup<Mixer, Cfg> s(cfg);
  const index_t D = cfg.d_model, L = cuts.back();
  View2<double> u("u", B * L, D), out("out", B * L, D);
  fill_uniform(u, 1);
  auto one = s.mixer->make_state(B);
  Acts acts;
  s.mixer->forward(u, B, L, SeqIdxView(), out, acts, false, nullptr, &one);
  const auto uv = to_vec(u), ref = to_vec(out);
  const double scale = max_abs(ref);
  auto carried = s.mixer->make_state(B);
  double worst = 0;
  for (std::size_t w = 0; w + 1 < cuts.size(); ++w) {
    const index_t t0 = cuts[w], t1 = cuts[w + 1];
    View2<double> o("o", B * (t1 - t0), D);
    Acts a;
    s.mixer->forward(window(uv, B, L, D, t0, t1), B, t1 - t0, SeqIdxView(), o, a, false, &carried, &carried);
    const double e = window_err(to_vec(o), ref, B, L, D, t0, t1) / scale;
    INFO("window [" << t0 << ", " << t1 << ")");
    CHECK(e < 1e-12);
    worst = std::max(worst, e);
  }
  const double e_conv = rel_err(to_vec(carried.conv), to_vec(one.conv));
  const double e_ssm = rel_err(to_vec(carried.ssm), to_vec(one.ssm));
  CHECK(e_conv < 1e-14);
  CHECK(e_ssm < 1e-12);
  return std::max(worst, std::max(e_conv, e_ssm));
}

// Backward of a forward that starts from a random state, against finite differences of u and every parameter.
template <class Mixer, class Cfg, class Acts>
double backward_from_state(const Cfg& cfg, index_t B, index_t L) {
  Setup<Mixer, Cfg> s(cfg);
  const index_t D = cfg.d_model;
  auto init = s.mixer->make_state(B);
  fill_uniform(init.conv, 31);
  fill_uniform(init.ssm, 32);
  View2<double> u("u", B * L, D), out("out", B * L, D), dout("dout", B * L, D), du("du", B * L, D);
  fill_uniform(u, 1);
  fill_uniform(dout, 2);
  const auto dov = to_vec(dout);
  auto loss = [&]() {
    View2<double> o("o", B * L, D);
    Acts a;
    s.mixer->forward(u, B, L, SeqIdxView(), o, a, false, &init, nullptr);
    return mmtest::dot(to_vec(o), dov);
  };
  Acts acts;
  s.mixer->forward(u, B, L, SeqIdxView(), out, acts, true, &init, nullptr);
  s.ps.zero_grads();
  s.mixer->backward(acts, B, L, SeqIdxView(), dout, du);
  double worst = fd_check(u, to_vec(du), loss, 30).rel();
  CHECK(worst < 1e-6);
  for (const auto& e : s.ps.entries()) {
    const auto idx = s.ps.index(e.name);
    INFO(e.name);
    const double err = fd_check(s.ps.v1(idx), to_vec(s.ps.g1(idx)), loss, 16).rel();
    CHECK(err < 1e-6);
    worst = std::max(worst, err);
  }
  return worst;
}

}  // namespace

TEST_CASE("Mamba-1 prefill then step reproduces the full forward at every position", "[decode]") {
  const double e = prefill_then_step<Mamba1Mixer<double>, Mamba1Config, Mamba1Acts<double>>(m1_cfg(), 2, 13,
                                                                                            {0, 1, 3, 9});
  WARN("Mamba-1 prefill + step vs full forward, worst relative error: " << e);
}

TEST_CASE("Mamba-2 prefill then step reproduces the full forward at every position", "[decode]") {
  const double e = prefill_then_step<Mamba2Mixer<double>, Mamba2Config, Mamba2Acts<double>>(m2_cfg(), 2, 13,
                                                                                            {0, 2, 5, 12});
  WARN("Mamba-2 prefill + step vs full forward, worst relative error: " << e);
}

TEST_CASE("Mamba-1 windows with a carried state equal one pass", "[decode]") {
  // window [5, 7) and [7, 8) are shorter than d_conv - 1 = 3: the conv prefix reaches into two earlier windows
  const double e = windowed_equals_one_pass<Mamba1Mixer<double>, Mamba1Config, Mamba1Acts<double>>(
      m1_cfg(), 2, {0, 5, 7, 8, 19, 30});
  WARN("Mamba-1 windowed vs one pass, worst relative error: " << e);
}

TEST_CASE("Mamba-2 windows with a carried state equal one pass", "[decode]") {
  const double e = windowed_equals_one_pass<Mamba2Mixer<double>, Mamba2Config, Mamba2Acts<double>>(
      m2_cfg(), 2, {0, 6, 8, 9, 21, 30});
  WARN("Mamba-2 windowed vs one pass, worst relative error: " << e);
}

TEST_CASE("Mamba-1 backward from a given state matches finite differences", "[decode]") {
  const double e = backward_from_state<Mamba1Mixer<double>, Mamba1Config, Mamba1Acts<double>>(m1_cfg(), 2, 9);
  WARN("Mamba-1 backward from a state, FD worst relative error: " << e);
}

TEST_CASE("Mamba-2 backward from a given state matches finite differences", "[decode]") {
  const double e = backward_from_state<Mamba2Mixer<double>, Mamba2Config, Mamba2Acts<double>>(m2_cfg(), 2, 9);
  WARN("Mamba-2 backward from a state, FD worst relative error: " << e);
}

TEST_CASE("decode states of the wrong shape are errors naming the values", "[decode]") {
  Setup<Mamba2Mixer<double>, Mamba2Config> s(m2_cfg());
  auto st = s.mixer->make_state(2);
  View2<double> u("u", 3 * 4, 6), out("out", 3 * 4, 6);
  Mamba2Acts<double> a;
  CHECK_THROWS_WITH(s.mixer->forward(u, 3, 4, SeqIdxView(), out, a, false, &st, nullptr),
                    ContainsSubstring("conv state must be (batch, conv_dim, d_conv - 1) = (3, 28, 3)"));
}
