// The Mamba-2 mixer against a naive double reference and finite differences; its initialisation; the recompute
// policy; and a whole-model gradient check on a tiny language model.
#include <cmath>
#include <vector>

#include "catch.hpp"
#include "model/lm.hpp"
#include "reference/mamba2_ref.hpp"
#include "ssm/mamba2/mixer.hpp"
#include "mixer_checks.hpp"
#include "util.hpp"

using namespace mm;
using mmtest::fd_check;
using mmtest::fill_uniform;
using mmtest::rel_err;
using mmtest::to_vec;

namespace {

Mamba2Config tiny_mixer() {
  Mamba2Config c;
  c.d_model = 6;
  c.d_state = 4;
  c.expand = 2;
  c.headdim = 3;  // 4 heads
  c.ngroups = 2;
  c.chunk = 8;
  return c;
}

Kokkos::View<std::int32_t**, Layout, Mem> records(index_t B, index_t L) {
  Kokkos::View<std::int32_t**, Layout, Mem> seq("seq", B, L);
  auto h = Kokkos::create_mirror_view(seq);
  for (index_t b = 0; b < B; ++b)
    for (index_t t = 0; t < L; ++t) h(b, t) = b == 0 ? int(t >= L / 2) : 0;
  Kokkos::deep_copy(seq, h);
  return seq;
}

std::vector<int> seq_vec(const Kokkos::View<std::int32_t**, Layout, Mem>& s) {
  std::vector<int> v;
  for (double x : to_vec(s)) v.push_back(int(x));
  return v;
}


}  // namespace

TEST_CASE("Mamba-2 mixer forward equals the naive double reference", "[mamba2]") {
  const Mamba2Config cfg = tiny_mixer();
  const index_t B = 2, L = 19;
  ParamStore<double> ps;
  Mamba2Mixer<double> mixer(cfg, ps, "m.", 2);
  ps.allocate();
  ps.initialize(5);
  mmtest::jitter_params(ps, 99, 0.1);
  View2<double> u("u", B * L, cfg.d_model), out("out", B * L, cfg.d_model);
  fill_uniform(u, 1);
  const auto seq = records(B, L);
  Mamba2Acts<double> acts;
  mixer.forward(u, B, L, seq, out, acts, true);
  auto p = [&](const char* name) { return to_vec(ps.v1(ps.index(std::string("m.") + name))); };
  mmref::Mamba2RefShape s{B, L, cfg.d_model, cfg.d_inner(), cfg.nheads(), cfg.headdim, cfg.ngroups, cfg.d_state,
                          cfg.d_conv};
  const auto ref = mmref::mamba2_reference(s, to_vec(u), p("in_proj.weight"), p("conv1d.weight"), p("conv1d.bias"),
                                           p("dt_bias"), p("A_log"), p("D"), p("norm.weight"), p("out_proj.weight"),
                                           seq_vec(seq));
  CHECK(rel_err(to_vec(out), ref) < 1e-12);
}

TEST_CASE("Mamba-2 mixer backward matches finite differences for the input and every parameter",
          "[mamba2][gradcheck]") {
  const Mamba2Config cfg = tiny_mixer();
  const index_t B = 2, L = 13;
  ParamStore<double> ps;
  Mamba2Mixer<double> mixer(cfg, ps, "m.", 2);
  ps.allocate();
  ps.initialize(5);
  mmtest::jitter_params(ps, 99, 0.1);
  View2<double> u("u", B * L, cfg.d_model), out("out", B * L, cfg.d_model), dout("dout", B * L, cfg.d_model);
  View2<double> du("du", B * L, cfg.d_model);
  fill_uniform(u, 1);
  fill_uniform(dout, 2);
  const auto seq = records(B, L);
  const auto dov = to_vec(dout);
  auto loss = [&]() {
    View2<double> o("o", B * L, cfg.d_model);
    Mamba2Acts<double> a;
    mixer.forward(u, B, L, seq, o, a, false);
    return mmtest::dot(to_vec(o), dov);
  };
  Mamba2Acts<double> acts;
  mixer.forward(u, B, L, seq, out, acts, true);
  ps.zero_grads();
  mixer.backward(acts, B, L, seq, dout, du);
  CHECK(fd_check(u, to_vec(du), loss, 40).rel() < 1e-6);
  for (const auto& e : ps.entries()) {
    const auto idx = ps.index(e.name);
    INFO(e.name);
    CHECK(fd_check(ps.v1(idx), to_vec(ps.g1(idx)), loss, 20).rel() < 1e-6);
  }
}

TEST_CASE("Mamba-2 mixer recompute policy gives bit-identical gradients", "[mamba2]") {
  const Mamba2Config cfg = tiny_mixer();
  const index_t B = 1, L = 21;
  ParamStore<float> ps;
  Mamba2Mixer<float> mixer(cfg, ps, "m.", 2);
  ps.allocate();
  ps.initialize(5);
  View2<float> u("u", B * L, cfg.d_model), out("out", B * L, cfg.d_model), dout("dout", B * L, cfg.d_model);
  fill_uniform(u, 1);
  fill_uniform(dout, 2);
  std::vector<double> grads[2], dus[2];
  for (int mode = 0; mode < 2; ++mode) {
    Mamba2Acts<float> acts;
    View2<float> du("du", B * L, cfg.d_model);
    mixer.forward(u, B, L, SeqIdxView(), out, acts, mode == 0);
    ps.zero_grads();
    mixer.backward(acts, B, L, SeqIdxView(), dout, du);
    grads[mode] = to_vec(ps.grads());
    dus[mode] = to_vec(du);
  }
  CHECK(grads[0] == grads[1]);
  CHECK(dus[0] == dus[1]);
}

TEST_CASE("Mamba-2 mixer with bf16 GEMMs: the out_proj input kept as the norm's bf16 copy", "[mamba2]") {
  // Under bf16 GEMMs on CUDA the gated norm writes its output only as a bf16 copy, which out_proj's forward and
  // weight gradient take in place of rounding an fp32 copy: the outputs and gradients stay within bf16 rounding of
  // the fp32 GEMMs', and the recompute policy reproduces them bit for bit. Host builds compute the GEMMs in fp32
  // and keep the fp32 output.
  Mamba2Config cfg = tiny_mixer();
  cfg.d_model = 16;
  cfg.headdim = 8;  // 4 heads; groups of 16 columns (the native norm kernel's shapes)
  const index_t B = 2, L = 19;
  ParamStore<float> ps;
  Mamba2Mixer<float> mixer(cfg, ps, "m.", 2);
  ps.allocate();
  ps.initialize(7);
  View2<float> u("u", B * L, cfg.d_model), dout("dout", B * L, cfg.d_model);
  fill_uniform(u, 3);
  fill_uniform(dout, 4);
  auto run = [&](GemmCompute c, bool save) {
    const FloatGemmComputeScope scope(c);
    Mamba2Acts<float> acts;
    View2<float> out("out", B * L, cfg.d_model), du("du", B * L, cfg.d_model);
    mixer.forward(u, B, L, SeqIdxView(), out, acts, save);
    if (save) {
      const bool copy = mmtest::keeps_bf16_copy(c == GemmCompute::bf16);
      CHECK((acts.yn_b.extent(0) > 0) == copy);
      CHECK((acts.yn.extent(0) > 0) == !copy);
    }
    ps.zero_grads();
    mixer.backward(acts, B, L, SeqIdxView(), dout, du);
    return mmtest::MixerRun{to_vec(out), to_vec(du), to_vec(ps.grads())};
  };
  const mmtest::MixerRun ref = run(GemmCompute::fp32, true), b16 = run(GemmCompute::bf16, true),
                         b16rc = run(GemmCompute::bf16, false);
  mmtest::check_bf16_runs(ref, b16, b16rc, 3e-2);
}

TEST_CASE("Mamba-2 mixer given its input only as a bf16 copy equals the mixer on the rounded fp32 input",
          "[mamba2]") {
  // forward_bf16_input (the backbone's block norm written in bf16 under bf16 GEMMs): in_proj's forward and weight
  // gradient read the copy in place of rounding an fp32 input. On CUDA under bf16 GEMMs the products are the ones the
  // fp32 input's rounding feeds them, so outputs and gradients are equal bit for bit; host builds compute both in
  // fp32 on the same values. The recompute policy reproduces them bit for bit.
  Mamba2Config cfg = tiny_mixer();
  cfg.d_model = 16;
  cfg.headdim = 8;
  const index_t B = 2, L = 19, n = B * L, D = cfg.d_model;
  ParamStore<float> ps;
  Mamba2Mixer<float> mixer(cfg, ps, "m.", 2);
  ps.allocate();
  ps.initialize(5);
  View2<float> u("u", n, D), ur("ur", n, D), dout("dout", n, D);
  fill_uniform(u, 8);
  fill_uniform(dout, 9);
  View2<bf16_op_t> ub("ub", n, D);
  par_for("test::round_u", n, D, KOKKOS_LAMBDA(index_t i, index_t j) {
    ub(i, j) = to_bf16_op(u(i, j));
    ur(i, j) = bf16_round(u(i, j));
  });
  struct Run {
    std::vector<double> out, du, grads;
  };
  auto run = [&](bool copy, bool save) {
    Mamba2Acts<float> acts;
    View2<float> out("out", n, D), du("du", n, D);
    if (copy) {
      mixer.forward_bf16_input(ub, B, L, SeqIdxView(), out, acts, save);
      CHECK(acts.u.extent(0) == 0);
      CHECK(acts.u_b.extent(0) == std::size_t(n));
    } else {
      mixer.forward(ur, B, L, SeqIdxView(), out, acts, save);
    }
    ps.zero_grads();
    mixer.backward(acts, B, L, SeqIdxView(), dout, du);
    return Run{to_vec(out), to_vec(du), to_vec(ps.grads())};
  };
  for (GemmCompute c : {GemmCompute::fp32, GemmCompute::bf16}) {
    const FloatGemmComputeScope scope(c);
#if defined(KOKKOS_ENABLE_CUDA)
    // (fp32 GEMMs on CUDA would round the copy's products differently from the fp32 input's: bf16 only)
    if (c != GemmCompute::bf16) continue;
#endif
    CHECK(mixer.takes_bf16_input(L) == float_gemm_on_bf16_copies());
    INFO("compute " << gemm_compute_name(c));
    const Run ref = run(false, true), got = run(true, true), rec = run(true, false);
    CHECK(got.out == ref.out);
    CHECK(got.du == ref.du);
    CHECK(got.grads == ref.grads);
    CHECK(rec.out == got.out);
    CHECK(rec.du == got.du);
    CHECK(rec.grads == got.grads);
  }
  // cp = 1 but windowed at this length: refused, naming the call
  Mamba2Config wc = cfg;
  wc.window = 8;
  ParamStore<float> ps2;
  Mamba2Mixer<float> windowed(wc, ps2, "w.", 2);
  ps2.allocate();
  Mamba2Acts<float> acts;
  View2<float> out("out", n, D);
  CHECK_FALSE(windowed.takes_bf16_input(L));
  CHECK_THROWS_WITH(windowed.forward_bf16_input(ub, B, L, SeqIdxView(), out, acts, true),
                    ContainsSubstring("forward_bf16_input") && ContainsSubstring("window"));
}

TEST_CASE("Mamba-2 float mixer in windows under bf16 GEMMs equals one pass to bf16 rounding", "[mamba2]") {
  // Under bf16 GEMMs on CUDA the backward keeps d(zxbcdt) only as the bf16 copy in_proj's backward takes, also in
  // a window, whose final conv state's gradient (the next window's) is then added into that copy's last
  // d_conv - 1 rows after the conv's backward; a missing or misplaced term there moves du and the in_proj and conv
  // gradients at every window boundary. Host builds run both sides in fp32 (and must agree far closer).
  Mamba2Config cfg = tiny_mixer();
  cfg.d_model = 16;
  cfg.headdim = 8;
  const FloatGemmComputeScope scope(GemmCompute::bf16);
  const double tol = float_gemm_on_bf16_copies() ? 2e-2 : 1e-5;
  mmtest::windows_equal_one_pass<Mamba2Mixer<float>, Mamba2Acts<float>>(cfg, tol);
}

TEST_CASE("Mamba-2 mixer backward with explicit states matches finite differences (initial and final state)",
          "[mamba2][gradcheck]") {
  for (index_t L : {2, 11})
    mmtest::explicit_state_gradcheck<Mamba2Mixer<double>, Mamba2Acts<double>>(tiny_mixer(), L, records(2, L),
                                                                            [](ParamStore<double>&) {});
}

TEST_CASE("Mamba-2 mixer in windows with carried states equals one pass (forward and backward)", "[mamba2]") {
  mmtest::windows_equal_one_pass<Mamba2Mixer<double>, Mamba2Acts<double>>(tiny_mixer());
}

TEST_CASE("Mamba-2 initialisation follows mamba_ssm", "[mamba2]") {
  Mamba2Config cfg;
  cfg.d_model = 64;
  cfg.headdim = 16;  // 8 heads
  cfg.d_state = 16;
  ParamStore<double> ps;
  const index_t n_layer = 4;
  Mamba2Mixer<double> mixer(cfg, ps, "m.", n_layer);
  ps.allocate();
  ps.initialize(11);
  for (double b : to_vec(ps.v1(ps.index("m.dt_bias")))) {
    const double dt = b > 20 ? b : std::log1p(std::exp(b));  // softplus(dt_bias) = dt at init
    CHECK(dt >= cfg.dt_init_floor * (1 - 1e-12));
    CHECK(dt <= cfg.dt_max * (1 + 1e-12));
    CHECK(dt >= cfg.dt_min * (1 - 1e-12));
  }
  for (double a : to_vec(ps.v1(ps.index("m.A_log")))) {
    CHECK(a >= std::log(cfg.A_init_lo) - 1e-12);
    CHECK(a <= std::log(cfg.A_init_hi) + 1e-12);
  }
  for (double d : to_vec(ps.v1(ps.index("m.D")))) CHECK(d == 1.0);
  for (double w : to_vec(ps.v1(ps.index("m.norm.weight")))) CHECK(w == 1.0);
  const double in_bound = 1.0 / std::sqrt(double(cfg.d_model));
  const double out_bound = 1.0 / std::sqrt(double(cfg.d_inner())) / std::sqrt(double(n_layer));
  double in_max = 0, out_max = 0;
  for (double w : to_vec(ps.v1(ps.index("m.in_proj.weight")))) in_max = std::max(in_max, std::abs(w));
  for (double w : to_vec(ps.v1(ps.index("m.out_proj.weight")))) out_max = std::max(out_max, std::abs(w));
  CHECK(in_max <= in_bound);
  CHECK(in_max > 0.9 * in_bound);
  CHECK(out_max <= out_bound);
  CHECK(out_max > 0.9 * out_bound);
  // decay flags: only matrices decay
  CHECK(ps.entry("m.in_proj.weight").decay);
  CHECK(ps.entry("m.out_proj.weight").decay);
  for (const char* nd : {"m.A_log", "m.D", "m.dt_bias", "m.norm.weight", "m.conv1d.bias"}) CHECK_FALSE(ps.entry(nd).decay);
}

TEST_CASE("Mamba-2 shapes that do not divide are errors naming the values", "[mamba2]") {
  ParamStore<double> ps;
  Mamba2Config c = tiny_mixer();
  c.headdim = 5;  // d_inner 12 % 5 != 0
  CHECK_THROWS_WITH(Mamba2Mixer<double>(c, ps, "m.", 1), ContainsSubstring("not divisible by headdim = 5"));
  c = tiny_mixer();
  c.ngroups = 3;  // 4 heads % 3
  CHECK_THROWS_WITH(Mamba2Mixer<double>(c, ps, "m.", 1), ContainsSubstring("not divisible by ngroups = 3"));
}

namespace {
Batch tiny_batch(index_t B, index_t L, index_t vocab_tokens) {
  Batch b;
  b.batch = B;
  b.seqlen = L;
  b.tokens = Kokkos::View<std::int32_t*, Layout, Mem>("tok", B * L);
  b.targets = Kokkos::View<std::int32_t*, Layout, Mem>("tgt", B * L);
  auto ht = Kokkos::create_mirror_view(b.tokens);
  auto hg = Kokkos::create_mirror_view(b.targets);
  for (index_t i = 0; i < B * L; ++i) {
    ht(i) = std::int32_t(1 + (i * 7 + i / 3) % vocab_tokens);
    hg(i) = i % 5 == 4 ? -1 : std::int32_t(1 + (i * 3 + 1) % vocab_tokens);
  }
  Kokkos::deep_copy(b.tokens, ht);
  Kokkos::deep_copy(b.targets, hg);
  b.seq_idx = records(B, L);
  return b;
}
}  // namespace

TEST_CASE("whole-model gradient check on a tiny Mamba-2 LM (tied and untied head)", "[model][gradcheck]") {
  for (bool tie : {true, false}) {
    LMConfig cfg;
    cfg.vocab_size = 8;
    cfg.n_layer = 2;
    cfg.tie_embeddings = tie;
    cfg.mixer = tiny_mixer();
    MambaLM<double> model(cfg);
    model.initialize(3);
    mmtest::jitter_params(model.params(), 99, 0.1);
    const Batch b = tiny_batch(2, 11, 5);
    model.params().zero_grads();
    const double scale = 0.25;
    const LossSum ls = model.forward_backward(b, scale, Recompute::none);
    CHECK(ls.count > 0);
    const auto grads = to_vec(model.params().grads());
    auto loss = [&]() { return scale * model.forward(b).nats; };
    auto& ps = model.params();
    INFO("tie_embeddings=" << tie);
    for (const auto& e : ps.entries()) {
      INFO(e.name);
      const std::vector<double> g(grads.begin() + e.offset, grads.begin() + e.offset + e.size);
      CHECK(fd_check(ps.v1(ps.index(e.name)), g, loss, 12).rel() < 1e-6);
    }
    // the recompute policy gives the same gradients
    ps.zero_grads();
    model.forward_backward(b, scale, Recompute::mixer);
    CHECK(rel_err(to_vec(ps.grads()), grads) < 1e-13);
  }
}

TEST_CASE("a tiny Mamba-2 LM with its mixers in windows gives the one-pass loss and gradients", "[model]") {
  // windows of 4 tokens over sequences of 11 (the last window shorter), records inside the batch; batch 1 runs
  // the windows on row ranges of the layer's buffers, batch 2 on packed copies (ssm/windows.hpp)
  for (index_t B : {1, 2}) {
    std::vector<double> grads[2];
    double nats[2] = {0, 0};
    for (int windowed = 0; windowed < 2; ++windowed) {
      LMConfig cfg;
      cfg.vocab_size = 8;
      cfg.n_layer = 2;
      cfg.mixer = tiny_mixer();
      cfg.mixer.window = windowed ? 4 : 0;
      MambaLM<double> model(cfg);
      model.initialize(3);
      mmtest::jitter_params(model.params(), 99, 0.1);
      const Batch b = tiny_batch(B, 11, 5);
      model.params().zero_grads();
      nats[windowed] = model.forward_backward(b, 0.25, Recompute::mixer).nats;
      grads[windowed] = to_vec(model.params().grads());
    }
    INFO("batch " << B);
    CHECK(std::abs(nats[1] - nats[0]) < 1e-12 * std::abs(nats[0]));
    CHECK(rel_err(grads[1], grads[0]) < 1e-12);
  }
}
