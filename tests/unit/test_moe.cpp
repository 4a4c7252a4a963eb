// The MoE layer against a naive per-token double reference (forward, losses, backward) in dropless and capacity
// mode, finite-difference gradient checks through the auxiliary losses, exact capacity drops and tie-breaking,
// determinism, the expert-bias update, parameter counts and config errors.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "catch.hpp"
#include "moe/moe_layer.hpp"
#include "reference/moe_ref.hpp"
#include "util.hpp"

using namespace mm;
using mmtest::fd_check;
using mmtest::fill_uniform;
using mmtest::rel_err;
using mmtest::to_vec;

namespace {

struct Case {
  const char* name;
  index_t k;
  ScoreFunc score;
  bool renorm;
  double tau, scale;
  index_t shared;
  bool state_aware, bias, jitter;
};

// top-1 and top-2, softmax and sigmoid, with and without the optional features
const Case kCases[] = {
    {"top1 softmax", 1, ScoreFunc::softmax, false, 1.0, 1.0, 0, false, false, false},
    {"top2 softmax renorm", 2, ScoreFunc::softmax, true, 1.0, 1.0, 0, false, false, false},
    {"top2 sigmoid", 2, ScoreFunc::sigmoid, false, 1.0, 1.0, 0, false, false, false},
    {"top1 sigmoid renorm shared", 1, ScoreFunc::sigmoid, true, 0.7, 1.5, 5, false, false, false},
    {"top2 softmax tau scale shared state bias jitter", 2, ScoreFunc::softmax, false, 1.7, 2.5, 4, true, true, true},
    {"top3 sigmoid renorm state bias jitter", 3, ScoreFunc::sigmoid, true, 0.8, 1.0, 0, true, true, true},
};

MoEConfig make_cfg(const Case& c, double capacity_factor) {
  MoEConfig m;
  m.d_model = 6;
  m.n_experts = 5;
  m.top_k = c.k;
  m.d_ff = 7;
  m.score_func = c.score;
  m.renormalize = c.renorm;
  m.temperature = c.tau;
  m.output_scale = c.scale;
  m.capacity_factor = capacity_factor;
  m.jitter = c.jitter ? 0.2 : 0.0;
  m.aux_loss_coef = 0.3;  // large, so the aux-loss gradients are visible in the checks
  m.z_loss_coef = 0.05;
  m.bias_update_rate = c.bias ? 1e-3 : 0.0;
  m.shared_d_ff = c.shared;
  m.state_aware = c.state_aware;
  return m;
}

struct Fixture {
  MoEConfig cfg;
  ParamStore<double> ps;
  std::unique_ptr<MoELayer<double>> layer;
  View2<double> x, state, dout;
  index_t n;
  MoEStep step{true, 77, 3};

  Fixture(const MoEConfig& c, index_t ntok) : cfg(c), n(ntok) {
    layer = std::make_unique<MoELayer<double>>(cfg, ps, "moe.", 2);
    ps.allocate();
    ps.initialize(5);
    mmtest::jitter_params(ps, 99, 0.3);
    if (layer->has_expert_bias())  // a bias large enough to change some selections
      fill_uniform(ps.v1(ps.index("moe.router.expert_bias")), 17, -0.15, 0.15);
    x = View2<double>("x", n, cfg.d_model);
    state = View2<double>("state", cfg.state_aware ? n : 0, cfg.d_model);
    dout = View2<double>("dout", n, cfg.d_model);
    fill_uniform(x, 1, -1.5, 1.5);
    if (cfg.state_aware) fill_uniform(state, 3);
    fill_uniform(dout, 2);
  }
  std::vector<double> p(const std::string& name) const {
    return ps.has("moe." + name) ? to_vec(ps.v1(ps.index("moe." + name))) : std::vector<double>{};
  }
  mmref::MoERefConfig ref_cfg() const {
    mmref::MoERefConfig r;
    r.n = n;
    r.d = cfg.d_model;
    r.E = cfg.n_experts;
    r.k = cfg.top_k;
    r.F = cfg.d_ff;
    r.Fs = cfg.shared_d_ff;
    r.softmax = cfg.score_func == ScoreFunc::softmax;
    r.renorm = cfg.renormalize;
    r.state_aware = cfg.state_aware;
    r.tau = cfg.temperature;
    r.scale = cfg.output_scale;
    r.cf = cfg.capacity_factor;
    r.aux = cfg.aux_loss_coef;
    r.z = cfg.z_loss_coef;
    return r;
  }
  mmref::MoERefParams ref_params() const {
    return {p("router.weight"), p("router.expert_bias"), p("experts.w1"), p("experts.w3"), p("experts.w2"),
            p("shared.w1"),     p("shared.w3"),          p("shared.w2")};
  }
  // the jitter the layer draws, from the same counter RNG stream
  std::vector<double> noise() const {
    if (!(cfg.jitter > 0 && step.training)) return {};
    const index_t dr = cfg.router_in();
    const CounterRNG rng{step.seed, layer->jitter_stream(step.step)};
    std::vector<double> v(n * dr);
    for (index_t i = 0; i < n * dr; ++i) v[i] = rng.uniform(std::uint64_t(i), 1 - cfg.jitter, 1 + cfg.jitter);
    return v;
  }
  mmref::MoERefResult reference(bool with_grad) const {
    return mmref::moe_reference(ref_cfg(), ref_params(), to_vec(x), cfg.state_aware ? to_vec(state) : std::vector<double>{},
                                noise(), with_grad ? to_vec(dout) : std::vector<double>{});
  }
  // sum(dout * out) + aux + z
  double loss() const {
    View2<double> o("o", n, cfg.d_model);
    MoEActs<double> a;
    const MoELosses L = layer->forward(x, o, a, false, step, state);
    return mmtest::dot(to_vec(o), to_vec(dout)) + L.total();
  }
};

}  // namespace

TEST_CASE("MoE forward, losses and routing equal the naive double reference (dropless and capacity)", "[moe]") {
  for (const Case& c : kCases)
    for (double cf : {0.0, 0.75, 1.25}) {
      INFO(c.name << ", capacity_factor " << cf);
      Fixture f(make_cfg(c, cf), 23);
      View2<double> out("out", f.n, f.cfg.d_model);
      MoEActs<double> acts;
      const MoELosses L = f.layer->forward(f.x, out, acts, true, f.step, f.state);
      const auto ref = f.reference(false);
      const double e_out = rel_err(to_vec(out), ref.out);
      INFO("out rel err " << e_out << ", aux " << L.aux << " vs " << ref.aux << ", z " << L.z << " vs " << ref.z);
      CHECK(e_out < 1e-12);
      CHECK(std::abs(L.aux - ref.aux) <= 1e-13 * std::abs(ref.aux));
      CHECK(std::abs(L.z - ref.z) <= 1e-13 * std::abs(ref.z));
      CHECK(ref.aux > 0);
      // same choices, and exactly the same assignments dropped
      std::vector<int> expert, kept;
      for (double v : to_vec(acts.routing.expert)) expert.push_back(int(v));
      for (double v : to_vec(acts.routing.row)) kept.push_back(v >= 0 ? 1 : 0);
      CHECK(expert == ref.expert);
      CHECK(kept == ref.kept);
      index_t ref_dropped = 0;
      for (int v : ref.kept) ref_dropped += 1 - v;
      CHECK(acts.stats.dropped == ref_dropped);
      if (cf == 0.0) CHECK(acts.stats.dropped == 0);
      if (cf == 0.75) CHECK(acts.stats.dropped > 0);  // the capacity binds
      for (index_t e = 0; e < f.cfg.n_experts; ++e) {
        CHECK(acts.stats.routed[e] == ref.routed[e]);
        if (cf > 0) CHECK(acts.stats.kept[e] <= acts.stats.capacity);
      }
    }
}

TEST_CASE("MoE backward equals the naive double reference (dropless and capacity)", "[moe]") {
  for (const Case& c : kCases)
    for (double cf : {0.0, 0.75}) {
      for (bool save : {true, false}) {
        INFO(c.name << ", capacity_factor " << cf << ", save " << save);
        Fixture f(make_cfg(c, cf), 19);
        View2<double> out("out", f.n, f.cfg.d_model), dx("dx", f.n, f.cfg.d_model);
        View2<double> dstate("dstate", f.cfg.state_aware ? f.n : 0, f.cfg.d_model);
        MoEActs<double> acts;
        f.layer->forward(f.x, out, acts, save, f.step, f.state);
        f.ps.zero_grads();
        f.layer->backward(acts, f.dout, dx, 1.0, dstate);
        const auto ref = f.reference(true);
        auto g = [&](const char* name) { return to_vec(f.ps.g1(f.ps.index(std::string("moe.") + name))); };
        auto chk = [&](const char* what, const std::vector<double>& a, const std::vector<double>& b) {
          const double e = rel_err(a, b);
          INFO(what << " rel err " << e);
          CHECK(e < 1e-12);
        };
        chk("dx", to_vec(dx), ref.dx);
        if (f.cfg.state_aware) chk("dstate", to_vec(dstate), ref.dstate);
        chk("router.weight", g("router.weight"), ref.dwr);
        chk("experts.w1", g("experts.w1"), ref.dw1);
        chk("experts.w3", g("experts.w3"), ref.dw3);
        chk("experts.w2", g("experts.w2"), ref.dw2);
        if (f.cfg.shared_d_ff > 0) {
          chk("shared.w1", g("shared.w1"), ref.ds1);
          chk("shared.w3", g("shared.w3"), ref.ds3);
          chk("shared.w2", g("shared.w2"), ref.ds2);
        }
        if (f.layer->has_expert_bias())
          for (double v : g("router.expert_bias")) CHECK(v == 0.0);  // selection only: no gradient
      }
    }
}

TEST_CASE("MoE gradients match finite differences of sum(w * out) + aux + z", "[moe]") {
  for (const Case& c : kCases)
    for (double cf : {0.0, 0.75}) {
      INFO(c.name << ", capacity_factor " << cf);
      Fixture f(make_cfg(c, cf), 13);
      View2<double> out("out", f.n, f.cfg.d_model), dx("dx", f.n, f.cfg.d_model);
      View2<double> dstate("dstate", f.cfg.state_aware ? f.n : 0, f.cfg.d_model);
      MoEActs<double> acts;
      f.layer->forward(f.x, out, acts, true, f.step, f.state);
      f.ps.zero_grads();
      f.layer->backward(acts, f.dout, dx, 1.0, dstate);
      auto loss = [&]() { return f.loss(); };
      auto chk = [&](const std::string& what, mmtest::FDResult r) {
        INFO(what << " fd rel err " << r.rel() << " (max |grad| " << r.max_ref << ")");
        CHECK(r.rel() < 1e-7);
        CHECK(r.max_ref > 0);
      };
      chk("x", fd_check(f.x, to_vec(dx), loss, 40));
      if (f.cfg.state_aware) chk("state", fd_check(f.state, to_vec(dstate), loss, 40));
      for (const auto& e : f.ps.entries()) {
        if (e.name == "moe.router.expert_bias") continue;  // not differentiable: selection only
        const auto idx = f.ps.index(e.name);
        chk(e.name, fd_check(f.ps.v1(idx), to_vec(f.ps.g1(idx)), loss, 30));
      }
    }
}

TEST_CASE("MoE aux-loss gradients alone match finite differences (router only)", "[moe]") {
  // dout = 0: the only loss is aux + z, so the router weight gradient comes from the losses alone
  for (ScoreFunc sf : {ScoreFunc::softmax, ScoreFunc::sigmoid}) {
    Fixture f(make_cfg(kCases[1], 0.0), 17);
    f.cfg.score_func = sf;
    ParamStore<double> ps2;
    MoEConfig cfg = f.cfg;
    cfg.score_func = sf;
    MoELayer<double> layer(cfg, ps2, "moe.", 2);
    ps2.allocate();
    ps2.initialize(5);
    mmtest::jitter_params(ps2, 99, 0.3);
    View2<double> out("out", f.n, cfg.d_model), dx("dx", f.n, cfg.d_model), zero("zero", f.n, cfg.d_model);
    MoEActs<double> acts;
    const double scale = 0.37;
    layer.forward(f.x, out, acts, true);
    ps2.zero_grads();
    layer.backward(acts, zero, dx, scale);
    auto loss = [&]() {
      View2<double> o("o", f.n, cfg.d_model);
      MoEActs<double> a;
      return scale * layer.forward(f.x, o, a, false).total();
    };
    const auto idx = ps2.index("moe.router.weight");
    const auto r = fd_check(ps2.v1(idx), to_vec(ps2.g1(idx)), loss, 30);
    INFO(score_func_name(sf) << " fd rel err " << r.rel());
    CHECK(r.rel() < 1e-7);
    CHECK(r.max_ref > 0);
    CHECK(fd_check(f.x, to_vec(dx), loss, 30).rel() < 1e-7);
    for (double v : to_vec(ps2.g1(ps2.index("moe.experts.w1")))) CHECK(v == 0.0);
  }
}

TEST_CASE("MoE capacity drops follow the documented order and ties go to the lower expert", "[moe]") {
  // A zero router weight makes every score equal: every token picks experts 0 and 1 (ties -> lower index).
  MoEConfig cfg;
  cfg.d_model = 4;
  cfg.n_experts = 4;
  cfg.top_k = 2;
  cfg.d_ff = 3;
  cfg.capacity_factor = 1.0;  // capacity = ceil(1 * 8 * 2 / 4) = 4
  for (ScoreFunc sf : {ScoreFunc::softmax, ScoreFunc::sigmoid}) {
    cfg.score_func = sf;
    ParamStore<double> ps;
    MoELayer<double> layer(cfg, ps, "", 1);
    ps.allocate();
    ps.initialize(1);
    Kokkos::deep_copy(ps.v2(ps.index("router.weight")), 0.0);
    const index_t n = 8;
    View2<double> x("x", n, 4), out("out", n, 4);
    fill_uniform(x, 4);
    MoEActs<double> acts;
    layer.forward(x, out, acts, true);
    const auto expert = to_vec(acts.routing.expert);
    const auto row = to_vec(acts.routing.row);
    for (index_t t = 0; t < n; ++t) {
      CHECK(expert[t * 2 + 0] == 0);
      CHECK(expert[t * 2 + 1] == 1);
      // tokens 0-3 keep both slots; rows: expert 0 owns [0, 4), expert 1 owns [4, 8), in token order
      CHECK(row[t * 2 + 0] == (t < 4 ? double(t) : -1.0));
      CHECK(row[t * 2 + 1] == (t < 4 ? double(4 + t) : -1.0));
    }
    CHECK(acts.stats.capacity == 4);
    CHECK(acts.stats.dropped == 8);
    CHECK(acts.stats.routed == std::vector<index_t>{8, 8, 0, 0});
    CHECK(acts.stats.kept == std::vector<index_t>{4, 4, 0, 0});
    // dropped tokens get a zero output (they pass through the block's residual)
    const auto o = to_vec(out);
    for (index_t t = 4; t < n; ++t)
      for (index_t c = 0; c < 4; ++c) CHECK(o[t * 4 + c] == 0.0);
    CHECK(std::abs(o[0]) > 0);
    // slot priority: with k = 2 and capacity 1 per expert... first choices win over second choices
    MoEConfig c2 = cfg;
    c2.n_experts = 2;
    c2.capacity_factor = 0.25;  // capacity = ceil(0.25 * 2 * 2 / 2) = 1
    ParamStore<double> ps2;
    MoELayer<double> l2(c2, ps2, "", 1);
    ps2.allocate();
    ps2.initialize(1);
    auto hw = Kokkos::create_mirror_view(ps2.v2(ps2.index("router.weight")));
    Kokkos::deep_copy(hw, 0.0);
    hw(1, 0) = 1.0;  // logit of expert 1 = x_0
    Kokkos::deep_copy(ps2.v2(ps2.index("router.weight")), hw);
    View2<double> x2("x2", 2, 4), out2("out2", 2, 4);
    auto hx = Kokkos::create_mirror_view(x2);
    Kokkos::deep_copy(hx, 0.5);
    hx(0, 0) = -1.0;  // token 0 prefers expert 0, token 1 prefers expert 1
    hx(1, 0) = 1.0;
    Kokkos::deep_copy(x2, hx);
    MoEActs<double> a2;
    l2.forward(x2, out2, a2, true);
    const auto r2 = to_vec(a2.routing.row);
    // slot 0 of both tokens is kept (their first choices differ); both second choices overflow
    CHECK(r2[0] >= 0);
    CHECK(r2[2] >= 0);
    CHECK(r2[1] == -1.0);
    CHECK(r2[3] == -1.0);
  }
}

TEST_CASE("MoE is bit-identical across runs, and recompute gives the same gradients", "[moe]") {
  MoEConfig cfg = make_cfg(kCases[4], 0.75);
  MoEConfig cfg_rc = cfg;
  cfg_rc.recompute = true;
  ParamStore<float> ps, ps_rc;  // same names and seed: same parameters
  MoELayer<float> layer(cfg, ps, "moe.", 2), layer_rc(cfg_rc, ps_rc, "moe.", 2);
  ps.allocate();
  ps.initialize(5);
  ps_rc.allocate();
  ps_rc.initialize(5);
  const index_t n = 300;  // more than one counting block of the dispatch plan
  View2<float> x("x", n, cfg.d_model), s("s", n, cfg.d_model), dout("dout", n, cfg.d_model);
  fill_uniform(x, 1);
  fill_uniform(s, 3);
  fill_uniform(dout, 2);
  const MoEStep step{true, 5, 11};
  // runs 0, 1: saved activations; run 2: save = false; run 3: cfg.recompute
  std::vector<double> outs[4], grads[4], dxs[4], dss[4];
  double aux[4];
  for (int run = 0; run < 4; ++run) {
    const MoELayer<float>& l = run == 3 ? layer_rc : layer;
    ParamStore<float>& p = run == 3 ? ps_rc : ps;
    View2<float> out("out", n, cfg.d_model), dx("dx", n, cfg.d_model), ds("ds", n, cfg.d_model);
    MoEActs<float> acts;
    aux[run] = l.forward(x, out, acts, run != 2, step, s).total();
    CHECK(acts.expert_acts_kept == (run < 2));
    p.zero_grads();
    l.backward(acts, dout, dx, 1.0, ds);
    outs[run] = to_vec(out);
    grads[run] = to_vec(p.grads());
    dxs[run] = to_vec(dx);
    dss[run] = to_vec(ds);
  }
  for (int run = 1; run < 4; ++run) {
    INFO("run " << run);
    CHECK(outs[run] == outs[0]);
    CHECK(grads[run] == grads[0]);
    CHECK(dxs[run] == dxs[0]);
    CHECK(dss[run] == dss[0]);
    CHECK(aux[run] == aux[0]);
  }
}

TEST_CASE("MoE expert bias: update rule, and it steers selection but not the gates", "[moe]") {
  MoEConfig cfg = make_cfg(kCases[2], 0.0);  // top-2 sigmoid
  cfg.bias_update_rate = 0.01;
  ParamStore<double> ps;
  MoELayer<double> layer(cfg, ps, "moe.", 1);
  ps.allocate();
  ps.initialize(3);
  const auto bias = ps.v1(ps.index("moe.router.expert_bias"));
  layer.update_expert_bias({4, 1, 2, 2, 1});  // mean 2
  CHECK(to_vec(bias) == std::vector<double>{-0.01, 0.01, 0.0, 0.0, 0.01});
  CHECK_THROWS_WITH(layer.update_expert_bias({1, 2}), ContainsSubstring("expected n_experts = 5"));
  // a large bias on expert 3 puts it in slot 0 of every token, with its unbiased score as the gate
  Kokkos::deep_copy(bias, 0.0);
  auto hb = Kokkos::create_mirror_view(bias);
  Kokkos::deep_copy(hb, 0.0);
  hb(3) = 10.0;
  Kokkos::deep_copy(bias, hb);
  const index_t n = 9;
  View2<double> x("x", n, cfg.d_model), out("out", n, cfg.d_model);
  fill_uniform(x, 8);
  MoEActs<double> acts;
  layer.forward(x, out, acts, true);
  const auto ex = to_vec(acts.routing.expert);
  const auto gate = to_vec(acts.routing.gate);
  const auto probs = to_vec(acts.routing.probs);
  for (index_t t = 0; t < n; ++t) {
    CHECK(ex[t * 2] == 3);
    CHECK(gate[t * 2] == probs[t * 5 + 3]);
    CHECK(gate[t * 2] < 1.0);
  }
  CHECK(acts.stats.routed[3] == n);
  // a layer without the bias has no such parameter and ignores updates
  ParamStore<double> ps2;
  MoELayer<double> l2(make_cfg(kCases[2], 0.0), ps2, "moe.", 1);
  CHECK_FALSE(ps2.has("moe.router.expert_bias"));
  CHECK_FALSE(l2.has_expert_bias());
}

TEST_CASE("MoE parameter counts (total and active per token)", "[moe]") {
  for (const Case& c : kCases) {
    const MoEConfig cfg = make_cfg(c, 0.0);
    ParamStore<double> ps;
    MoELayer<double> layer(cfg, ps, "moe.", 1);
    index_t stored = ps.count() - (layer.has_expert_bias() ? cfg.n_experts : 0);
    CHECK(layer.param_count() == stored);
    const index_t d = cfg.d_model, dr = c.state_aware ? 2 * d : d;
    const index_t per_expert = 3 * d * cfg.d_ff;
    CHECK(layer.active_param_count() == cfg.n_experts * dr + c.k * per_expert + 3 * d * cfg.shared_d_ff);
    CHECK(layer.param_count() - layer.active_param_count() == (cfg.n_experts - c.k) * per_expert);
  }
}

TEST_CASE("MoE bad configs and shapes are errors naming the values", "[moe]") {
  auto bad = [](auto edit, const char* msg) {
    MoEConfig c = make_cfg(kCases[1], 0.0);
    edit(c);
    ParamStore<double> ps;
    CHECK_THROWS_WITH(MoELayer<double>(c, ps, "moe.", 1), ContainsSubstring(msg));
  };
  bad([](MoEConfig& c) { c.top_k = 6; }, "top_k = 6 must be in [1, n_experts = 5]");
  bad([](MoEConfig& c) { c.top_k = 0; }, "top_k = 0");
  bad([](MoEConfig& c) { c.n_experts = 0; }, "n_experts must be positive (got 0)");
  bad([](MoEConfig& c) { c.d_ff = -3; }, "d_ff must be positive (got -3)");
  bad([](MoEConfig& c) { c.temperature = 0; }, "temperature must be positive (got 0)");
  bad([](MoEConfig& c) { c.output_scale = -1; }, "output_scale must be positive (got -1)");
  bad([](MoEConfig& c) { c.capacity_factor = -0.5; }, "capacity_factor must be >= 0, 0 meaning dropless (got -0.5)");
  bad([](MoEConfig& c) { c.jitter = 1.5; }, "jitter must be in [0, 1) (got 1.5)");
  bad([](MoEConfig& c) { c.aux_loss_coef = -1; }, "aux_loss_coef must be >= 0 (got -1)");
  bad([](MoEConfig& c) { c.z_loss_coef = -2; }, "z_loss_coef must be >= 0 (got -2)");
  bad([](MoEConfig& c) { c.bias_update_rate = -1; }, "bias_update_rate must be >= 0 (got -1)");
  bad([](MoEConfig& c) { c.shared_d_ff = -1; }, "shared_d_ff must be >= 0 (got -1)");
  CHECK_THROWS_WITH(parse_score_func("relu", "[moe] score_func"),
                    ContainsSubstring("unknown router score function 'relu' (known: softmax, sigmoid)"));
  CHECK(parse_score_func("sigmoid", "x") == ScoreFunc::sigmoid);
  // shapes
  MoEConfig c = make_cfg(kCases[4], 0.0);
  ParamStore<double> ps;
  MoELayer<double> layer(c, ps, "moe.", 1);
  ps.allocate();
  View2<double> x("x", 4, 5), out("out", 4, 6), s("s", 4, 6);
  MoEActs<double> acts;
  CHECK_THROWS_WITH(layer.forward(x, out, acts, true, {}, s), ContainsSubstring("expected d_model = 6"));
  View2<double> x6("x6", 4, 6);
  CHECK_THROWS_WITH(layer.forward(x6, out, acts, true), ContainsSubstring("needs a state input of shape (4, 6)"));
}

// ------------------------------------------------------------------ bf16 expert path

namespace {

// bf16 operand storage <-> doubles (host values, rounded to bf16 on the way in)
View1<bf16_op_t> bf16_from(const std::vector<double>& v) {
  View1<bf16_op_t> d("bf16_from", v.size());
  auto h = Kokkos::create_mirror_view(d);
  for (std::size_t i = 0; i < v.size(); ++i) h(i) = to_bf16_op(float(v[i]));
  Kokkos::deep_copy(d, h);
  return d;
}
std::vector<double> bf16_to_vec(const View1<bf16_op_t>& d) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), d);
  std::vector<double> v(h.extent(0));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = double(from_bf16_op(h(i)));
  return v;
}
std::vector<double> uniform_vec(std::size_t n, std::uint64_t stream) {
  View1<double> v("u", n);
  fill_uniform(v, stream);
  return to_vec(v);
}
double round_bf16(double v) { return double(bf16_round(float(v))); }

}  // namespace

TEST_CASE("bf16 rounding is to the nearest bf16, ties to even", "[moe][gemm]") {
  CHECK(bf16_round(1.0f) == 1.0f);
  CHECK(bf16_round(1.0f + 0x1p-8f) == 1.0f);                     // tie: to the even mantissa 0
  CHECK(bf16_round(1.0f + 3 * 0x1p-8f) == 1.0f + 0x1p-6f);       // tie: to the even mantissa 2
  CHECK(bf16_round(1.0f + 0x1p-8f + 0x1p-12f) == 1.0f + 0x1p-7f);  // above the tie: up
  CHECK(bf16_round(-3.14159f) == -3.140625f);
  CHECK(std::isinf(bf16_round(INFINITY)));
  CHECK(std::isnan(bf16_round(NAN)));
  CHECK(float(from_bf16_op(to_bf16_op(1.0f + 3 * 0x1p-8f))) == 1.0f + 0x1p-6f);
}

TEST_CASE("bf16 GEMMs: rounded operands, fp32 accumulation, fp32 or bf16 output, column-block operands", "[moe][gemm]") {
  // C (m x n) = alpha op(A) op(B) + beta C with A a column block (lda > its columns) of a wider matrix
  const index_t m = 7, n = 5, k = 9, lda = 13, ldc = 6;
  for (Trans ta : {Trans::N, Trans::T})
    for (Trans tb : {Trans::N, Trans::T}) {
      INFO("ta " << (ta == Trans::T) << " tb " << (tb == Trans::T));
      const index_t arows = ta == Trans::N ? m : k, brows = tb == Trans::N ? k : n, bcols = tb == Trans::N ? n : k;
      const auto av = uniform_vec(arows * lda, 21), bv = uniform_vec(brows * bcols, 22), cv = uniform_vec(m * ldc, 23);
      const auto A = bf16_from(av), B = bf16_from(bv);
      View1<float> C32("C32", m * ldc);
      mmtest::from_vec(C32, cv);
      const auto Cb = bf16_from(cv);
      const float alpha = 0.75f, beta = 1.0f;
      gemm_bf16_f32(ta, tb, m, n, k, alpha, A.data() + 2, lda, B.data(), bcols, beta, C32.data(), ldc);
      gemm_bf16_b16(ta, tb, m, n, k, alpha, A.data() + 2, lda, B.data(), bcols, beta, Cb.data(), ldc);
      const auto c32 = to_vec(C32), cb = bf16_to_vec(Cb);
      double err32 = 0, errb = 0, scale = 0;
      bool representable = true;
      for (index_t i = 0; i < m; ++i)
        for (index_t j = 0; j < n; ++j) {
          double s = 0;  // double product of the bf16-rounded operands
          for (index_t l = 0; l < k; ++l)
            s += round_bf16(ta == Trans::N ? av[i * lda + 2 + l] : av[l * lda + 2 + i]) *
                 round_bf16(tb == Trans::N ? bv[l * bcols + j] : bv[j * bcols + l]);
          const double ref32 = alpha * s + beta * cv[i * ldc + j];
          const double refb = alpha * s + beta * round_bf16(cv[i * ldc + j]);
          err32 = std::max(err32, std::abs(c32[i * ldc + j] - ref32));
          errb = std::max(errb, std::abs(cb[i * ldc + j] - refb));
          scale = std::max(scale, std::abs(ref32));
          representable = representable && round_bf16(cb[i * ldc + j]) == cb[i * ldc + j];
        }
      INFO("fp32-out err " << err32 << ", bf16-out err " << errb << ", scale " << scale);
      CHECK(scale > 0.5);
      CHECK(err32 <= 1e-5 * scale);  // fp32 accumulation of exactly representable products
      CHECK(errb <= 0x1p-8 * scale);  // plus one bf16 rounding of the output
      CHECK(representable);
      // the padding columns of C (ldc > n) are untouched
      for (index_t i = 0; i < m; ++i) CHECK(c32[i * ldc + n] == float(cv[i * ldc + n]));
    }
}

TEST_CASE("MoE bf16 expert path: output, dx and gradients against the fp32 path and the double reference",
          "[moe]") {
  // top-1 and top-2, softmax and sigmoid, with a shared expert and the state-aware / bias / jitter router; dropless
  // and capacity mode. The float layer has the double fixture's parameters and inputs.
  for (int ci : {0, 1, 3, 4})
    for (double cf : {0.0, 0.75}) {
      const Case& c = kCases[ci];
      INFO(c.name << ", capacity_factor " << cf);
      MoEConfig cfg = make_cfg(c, cf);
      cfg.d_model = 32;
      cfg.d_ff = 40;
      Fixture f(cfg, 61);
      const auto ref = f.reference(true);
      ParamStore<float> ps;
      MoELayer<float> layer(cfg, ps, "moe.", 2);
      ps.allocate();
      REQUIRE(ps.total() == f.ps.total());
      mmtest::from_vec(ps.values(), to_vec(f.ps.values()));
      const index_t n = f.n, d = cfg.d_model;
      View2<float> x("x", n, d), s("s", cfg.state_aware ? n : 0, d), dout("dout", n, d);
      mmtest::from_vec(x, to_vec(f.x));
      if (cfg.state_aware) mmtest::from_vec(s, to_vec(f.state));
      mmtest::from_vec(dout, to_vec(f.dout));
      struct Run {
        std::vector<double> out, dx, ds;
        std::vector<double> expert;
        std::vector<double> g[7];
        double aux = 0;
      };
      const char* names[7] = {"router.weight", "experts.w1", "experts.w3", "experts.w2",
                              "shared.w1",     "shared.w3",  "shared.w2"};
      auto run = [&](GemmCompute comp, bool save) {
        const FloatGemmComputeScope scope(comp);  // bf16: the layer takes its bf16 expert path
        View2<float> out("out", n, d), dx("dx", n, d), ds("ds", cfg.state_aware ? n : 0, d);
        MoEActs<float> acts;
        Run r;
        r.aux = layer.forward(x, out, acts, save, f.step, s).total();
        CHECK(acts.bf16_experts == (comp == GemmCompute::bf16));
        ps.zero_grads();
        layer.backward(acts, dout, dx, 1.0, ds);
        r.out = to_vec(out);
        r.dx = to_vec(dx);
        r.ds = to_vec(ds);
        r.expert = to_vec(acts.routing.expert);
        for (int i = 0; i < 7; ++i)
          if (ps.has(std::string("moe.") + names[i])) r.g[i] = to_vec(ps.g1(ps.index(std::string("moe.") + names[i])));
        return r;
      };
      const Run r32 = run(GemmCompute::fp32, true);
      const Run r16 = run(GemmCompute::bf16, true);
      const Run r16rc = run(GemmCompute::bf16, false);  // the backward recomputes the bf16 experts
      // same routing as the reference (the router is fp32 in both paths)
      std::vector<int> e16;
      for (double v : r16.expert) e16.push_back(int(v));
      REQUIRE(e16 == ref.expert);
      const std::vector<double>* refg[7] = {&ref.dwr, &ref.dw1, &ref.dw3, &ref.dw2, &ref.ds1, &ref.ds3, &ref.ds2};
      auto chk = [&](const std::string& what, const std::vector<double>& a32, const std::vector<double>& a16,
                     const std::vector<double>& a16rc, const std::vector<double>& b) {
        const double e32 = rel_err(a32, b), e16 = rel_err(a16, b), d16 = rel_err(a16, a32);
        INFO(what << ": fp32 path rel err " << e32 << ", bf16 path rel err " << e16 << ", bf16 vs fp32 " << d16);
        CHECK(e32 < 1e-5);
        CHECK(e16 < 2e-2);
        CHECK(a16rc == a16);  // recompute: bit-identical
        return d16;
      };
      // the bf16 rounding is really there: the routed experts' output and every expert weight gradient differ
      // from the fp32 path by far more than fp32 rounding
      CHECK(chk("out", r32.out, r16.out, r16rc.out, ref.out) > 1e-4);
      CHECK(chk("dx", r32.dx, r16.dx, r16rc.dx, ref.dx) > 1e-4);
      if (cfg.state_aware) chk("dstate", r32.ds, r16.ds, r16rc.ds, ref.dstate);
      for (int i = 0; i < 7; ++i) {
        if (i >= 4 && cfg.shared_d_ff == 0) continue;
        const double dd = chk(names[i], r32.g[i], r16.g[i], r16rc.g[i], *refg[i]);
        if (i >= 1 && i <= 3) CHECK(dd > 1e-4);
      }
      CHECK(r16.aux == r32.aux);  // the router and its losses do not depend on the expert arithmetic
    }
}
