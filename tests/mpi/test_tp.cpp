// Tensor parallelism (Megatron layout) at tp = world size: the Mamba-2 mixer and the dense SwiGLU FFN, built once
// unsharded (the single-rank reference, computed by every rank) and once sharded over the tp communicator, on the
// same inputs. Each rank checks that its parameter shards are the slices of the unsharded initialisation (mapped by
// ParamEntry::global_index()), that the outputs and the input gradient (all-reduced: every rank holds them whole)
// equal the reference, that its shard of every parameter gradient equals the slice of the reference gradient, with
// the intermediates saved and recomputed, and that decoding (make_state / step, and a forward that returns its final
// state) gives the same outputs and this rank's heads and channels of the reference state. Shapes that do not
// divide by tp are errors naming the values. At one rank the tp path is the unsharded code: results equal bitwise.
#include <cmath>
#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

#include "catch.hpp"
#include "model/dense_ffn.hpp"
#include "ssm/mamba1/mixer.hpp"
#include "mpi/mpi_util.hpp"
#include "ssm/mamba2/mixer.hpp"
#include "ssm/mamba3/mixer.hpp"
#include "util.hpp"

using namespace mm;
using mmtest::fill_uniform;
using mmtest::rel_err;
using mmtest::to_vec;

namespace {

constexpr double tol = 1e-10;

// Move the parameters away from their special values (norm weights and D all ones, ...) by global element index, so
// the sharded and the unsharded stores stay slices of one another; dt_bias is redrawn in U(-1, 1).
void jitter_global(ParamStore<double>& ps, std::uint64_t seed, double amplitude) {
  for (std::size_t i = 0; i < ps.entries().size(); ++i) {
    const ParamEntry& e = ps.entries()[i];
    const auto gi = e.global_index();
    const CounterRNG rng{seed, stream_id(e.name)};
    const bool dt = e.name.size() >= 7 && e.name.compare(e.name.size() - 7, 7, "dt_bias") == 0;
    auto v = to_vec(ps.v1(i));
    for (std::size_t k = 0; k < v.size(); ++k)
      v[k] = dt ? rng.uniform(gi[k], -1, 1) : v[k] + amplitude * rng.uniform(gi[k], -1, 1);
    mmtest::from_vec(ps.v1(i), v);
  }
}

// The largest relative error over the parameters of `part` (values or gradients) against the matching slices of
// `whole`'s; also checks that every parameter carries the Shard it should (tp > 1) or none (tp = 1).
double shard_err(const ParamStore<double>& part, const ParamStore<double>& whole, bool grads, int tp,
                 const std::string& what) {
  double worst = 0;
  REQUIRE(part.entries().size() == whole.entries().size());
  for (std::size_t i = 0; i < part.entries().size(); ++i) {
    const ParamEntry& e = part.entries()[i];
    const std::size_t j = whole.index(e.name);
    const ParamEntry& w = whole.entries()[j];
    INFO(what << " " << e.name);
    CHECK(e.global_shape() == w.shape);
    CHECK(e.sharded() == (tp > 1));
    if (tp > 1) CHECK(e.shard.split == Split::tp);
    CHECK(e.size * tp == w.size);
    const auto gi = e.global_index();
    const auto a = to_vec(grads ? part.g1(i) : part.v1(i));
    const auto full = to_vec(grads ? whole.g1(j) : whole.v1(j));
    std::vector<double> b(a.size());
    for (std::size_t k = 0; k < a.size(); ++k) b[k] = full[std::size_t(gi[k])];
    const double err = rel_err(a, b);
    CHECK(err <= tol);
    worst = std::max(worst, err);
  }
  return worst;
}

Kokkos::View<std::int32_t**, Layout, Mem> records(index_t B, index_t L) {
  Kokkos::View<std::int32_t**, Layout, Mem> seq("seq", B, L);
  auto h = Kokkos::create_mirror_view(seq);
  for (index_t b = 0; b < B; ++b)
    for (index_t t = 0; t < L; ++t) h(b, t) = b == 0 ? int(t >= L / 2) : 0;
  Kokkos::deep_copy(seq, h);
  return seq;
}

void report(const char* what, int n, double err) {
  if (mmtest::world_rank() == 0) std::printf("[tp] %s at tp = %d: max relative error %.3e\n", what, n, err);
}

// This rank's slice of a state's channel or head dimension `dim` (1), given as global index ranges.
std::vector<double> slice_dim1(const std::vector<double>& full, index_t n0, index_t n1, index_t inner,
                               const std::vector<IndexRange>& ranges) {
  std::vector<double> out;
  for (index_t a = 0; a < n0; ++a)
    for (const IndexRange& r : ranges)
      for (index_t c = r.begin; c < r.begin + r.count; ++c)
        for (index_t k = 0; k < inner; ++k) out.push_back(full[std::size_t((a * n1 + c) * inner + k)]);
  return out;
}

// A mixer's decode state: conv (batch, conv_n, W1) and ssm (batch, ssm_n, ssm_inner...), and the global ranges of
// this rank's conv channels and SSM rows (heads or channels).
struct StateLayout {
  index_t conv_n = 0, W1 = 0, ssm_n = 0, ssm_inner = 0;
  std::vector<IndexRange> conv_chans, ssm_rows;
};

// The sharded mixer (Mamba2Mixer or Mamba1Mixer, with its Acts and State types) against the unsharded one:
// parameters, out, du and the parameter gradients (saved and recomputed), a forward that returns its final state,
// and decode steps from it.
template <class Mixer, class Acts, class State, class Cfg>
void compare_mixer(const std::string& name, const Cfg& cfg, const parallel::ModelComms& comms, const StateLayout& st) {
  const int tp = comms.tp->size();
  INFO(name << ", tp " << tp);
  const index_t B = 2, L = 21, D = cfg.d_model, n = B * L;
  ParamStore<double> ps1, psp;
  Mixer m1(cfg, ps1, "m.", 2);
  Mixer mp(cfg, psp, "m.", 2, comms);
  ps1.allocate();
  psp.allocate();
  ps1.initialize(5);
  psp.initialize(5);
  double init_err = shard_err(psp, ps1, false, tp, "initial values");
  jitter_global(ps1, 99, 0.1);
  jitter_global(psp, 99, 0.1);
  init_err = std::max(init_err, shard_err(psp, ps1, false, tp, "jittered values"));
  report((name + " parameter shards vs the unsharded initialisation").c_str(), tp, init_err);

  View2<double> u("u", n, D), dout("dout", n, D);
  fill_uniform(u, 1);
  fill_uniform(dout, 2);
  const auto seq = records(B, L);
  View2<double> out1("out1", n, D), outp("outp", n, D), du1("du1", n, D), dup("dup", n, D);
  Acts a1, ap;
  m1.forward(u, B, L, seq, out1, a1, true);
  m1.backward(a1, B, L, seq, dout, du1);
  for (bool save : {true, false}) {
    INFO("save " << save);
    psp.zero_grads();
    mp.forward(u, B, L, seq, outp, ap, save);
    mp.backward(ap, B, L, seq, dout, dup);
    const double eo = rel_err(to_vec(outp), to_vec(out1)), ed = rel_err(to_vec(dup), to_vec(du1));
    CHECK(eo <= tol);
    CHECK(ed <= tol);
    const double eg = shard_err(psp, ps1, true, tp, "gradients");
    if (tp == 1) CHECK((eo == 0 && ed == 0 && eg == 0));  // the unsharded code itself
    const std::string tag = save ? "" : " (recompute)";
    report((name + " out" + tag).c_str(), tp, eo);
    report((name + " du" + tag).c_str(), tp, ed);
    report((name + " parameter gradients" + tag).c_str(), tp, eg);
  }

  auto state_err = [&](const State& sp, const State& s1) {
    const index_t b = index_t(s1.conv.extent(0));
    const double ec = rel_err(to_vec(sp.conv), slice_dim1(to_vec(s1.conv), b, st.conv_n, st.W1, st.conv_chans));
    const double es = rel_err(to_vec(sp.ssm), slice_dim1(to_vec(s1.ssm), b, st.ssm_n, st.ssm_inner, st.ssm_rows));
    return std::max(ec, es);
  };
  // a forward that returns its final state (no records: one sequence per row), then decode steps from it
  State f1 = m1.make_state(B), fp = mp.make_state(B);
  m1.forward(u, B, L, SeqIdxView(), out1, a1, false, nullptr, &f1);
  mp.forward(u, B, L, SeqIdxView(), outp, ap, false, nullptr, &fp);
  const double eo = rel_err(to_vec(outp), to_vec(out1)), es = state_err(fp, f1);
  CHECK(eo <= tol);
  CHECK(es <= tol);
  report((name + " forward with final state: out").c_str(), tp, eo);
  report((name + " forward with final state: this rank's state").c_str(), tp, es);
  double worst = 0;
  View2<double> x("x", B, D), y1("y1", B, D), yp("yp", B, D);
  for (int s = 0; s < 4; ++s) {
    fill_uniform(x, 10 + s);
    m1.step(x, f1, y1);
    mp.step(x, fp, yp);
    worst = std::max({worst, rel_err(to_vec(yp), to_vec(y1)), state_err(fp, f1)});
  }
  CHECK(worst <= tol);
  if (tp == 1) CHECK(worst == 0);
  report((name + " decode steps: out and this rank's state").c_str(), tp, worst);
}

void compare_mamba2(const Mamba2Config& cfg, const parallel::ModelComms& comms) {
  const int tp = comms.tp->size(), r = comms.tp->rank();
  const index_t E = cfg.d_inner(), GN = cfg.ngroups * cfg.d_state, H = cfg.nheads();
  StateLayout st;
  st.conv_n = cfg.conv_dim();
  st.W1 = cfg.d_conv - 1;
  st.ssm_n = H;
  st.ssm_inner = cfg.headdim * cfg.d_state;
  st.conv_chans = {{E / tp * r, E / tp}, {E + GN / tp * r, GN / tp}, {E + GN + GN / tp * r, GN / tp}};
  st.ssm_rows = {{H / tp * r, H / tp}};
  compare_mixer<Mamba2Mixer<double>, Mamba2Acts<double>, Mamba2State<double>>(
      "Mamba-2 (ngroups " + std::to_string(cfg.ngroups) + ")", cfg, comms, st);
}

}  // namespace

TEST_CASE("tensor parallel Mamba-2 mixer equals the unsharded one", "[tp]") {
  const int n = mmtest::world_size();
  parallel::ProcessGrid grid(parallel::Layout{n, 1, 1, 1}, MPI_COMM_WORLD);
  const auto comms = grid.model_comms();
  Mamba2Config cfg;
  cfg.d_model = 16;
  cfg.expand = 2;
  cfg.headdim = 4;  // 8 heads
  cfg.d_state = 8;
  cfg.chunk = 8;
  for (index_t g : {4, 2, 1}) {
    cfg.ngroups = g;
    if (g % n == 0) {
      compare_mamba2(cfg, comms);
    } else {  // groups that do not divide by tp: an error naming both (before any collective)
      ParamStore<double> ps;
      std::string msg;
      try {
        Mamba2Mixer<double> m(cfg, ps, "m.", 2, comms);
      } catch (const Error& e) {
        msg = e.what();
      }
      INFO(msg);
      CHECK(msg.find("ngroups = " + std::to_string(g) + " does not divide by tp = " + std::to_string(n)) !=
            std::string::npos);
    }
  }
}

TEST_CASE("tensor parallel Mamba-1 mixer equals the unsharded one; Mamba-3 refuses tp", "[tp]") {
  const int n = mmtest::world_size();
  parallel::ProcessGrid grid(parallel::Layout{n, 1, 1, 1}, MPI_COMM_WORLD);
  const auto comms = grid.model_comms();
  const int tp = comms.tp->size(), r = comms.tp->rank();
  Mamba1Config cfg;
  cfg.d_model = 8;
  cfg.expand = 2;  // d_inner 16
  cfg.d_state = 4;
  cfg.dt_rank = 3;
  cfg.chunk = 8;
  const index_t E = cfg.d_inner();
  StateLayout st;
  st.conv_n = E;
  st.W1 = cfg.d_conv - 1;
  st.ssm_n = E;
  st.ssm_inner = cfg.d_state;
  st.conv_chans = st.ssm_rows = {{E / tp * r, E / tp}};
  compare_mixer<Mamba1Mixer<double>, Mamba1Acts<double>, Mamba1State<double>>("Mamba-1", cfg, comms, st);
  if (n > 1) {
    Mamba1Config bad = cfg;
    bad.d_model = 6, bad.expand = 1;  // d_inner 6: does not divide by 4; with tp 2, 5 (d_model 5)
    if (n == 2) bad.d_model = 5;
    ParamStore<double> ps;
    std::string msg;
    try {
      Mamba1Mixer<double> m(bad, ps, "m.", 2, comms);
    } catch (const Error& e) {
      msg = e.what();
    }
    INFO(msg);
    CHECK(msg.find("d_inner = expand * d_model = " + std::to_string(bad.d_inner()) + " does not divide by tp = " +
                   std::to_string(n)) != std::string::npos);
    Mamba3Config m3;
    m3.d_model = 16, m3.d_state = 8, m3.headdim = 4;
    msg.clear();
    try {
      Mamba3Mixer<double> m(m3, ps, "m3.", 2, comms);
    } catch (const Error& e) {
      msg = e.what();
    }
    INFO(msg);
    CHECK(msg.find("tensor parallelism (tp = " + std::to_string(n) + ") is not implemented for the Mamba-3 mixer") !=
          std::string::npos);
  }
}

TEST_CASE("tensor parallel dense SwiGLU FFN equals the unsharded one", "[tp]") {
  const int n = mmtest::world_size();
  parallel::ProcessGrid grid(parallel::Layout{n, 1, 1, 1}, MPI_COMM_WORLD);
  const auto comms = grid.model_comms();
  const int tp = comms.tp->size();
  DenseFFNConfig cfg;
  cfg.d_model = 16;
  cfg.d_ff = 32;
  const index_t N = 42, D = cfg.d_model;
  ParamStore<double> ps1, psp;
  DenseFFN<double> f1(cfg, ps1, "ffn.", 3);
  DenseFFN<double> fp(cfg, psp, "ffn.", 3, comms);
  ps1.allocate();
  psp.allocate();
  ps1.initialize(11);
  psp.initialize(11);
  const double init_err = shard_err(psp, ps1, false, tp, "initial values");
  report("FFN parameter shards vs the unsharded initialisation", tp, init_err);
  View2<double> x("x", N, D), dout("dout", N, D), out1("out1", N, D), outp("outp", N, D), dx1("dx1", N, D),
      dxp("dxp", N, D);
  fill_uniform(x, 3);
  fill_uniform(dout, 4);
  DenseFFNActs<double> a1, ap;
  f1.forward(x, out1, a1, true);
  f1.backward(a1, dout, dx1);
  for (bool save : {true, false}) {
    INFO("save " << save);
    psp.zero_grads();
    fp.forward(x, outp, ap, save);
    fp.backward(ap, dout, dxp);
    const double eo = rel_err(to_vec(outp), to_vec(out1)), ed = rel_err(to_vec(dxp), to_vec(dx1));
    CHECK(eo <= tol);
    CHECK(ed <= tol);
    const double eg = shard_err(psp, ps1, true, tp, "gradients");
    if (tp == 1) CHECK((eo == 0 && ed == 0 && eg == 0));
    report(save ? "FFN out" : "FFN out (recompute)", tp, eo);
    report(save ? "FFN dx" : "FFN dx (recompute)", tp, ed);
    report(save ? "FFN parameter gradients" : "FFN parameter gradients (recompute)", tp, eg);
  }
  if (n > 1) {  // d_ff that does not divide by tp
    DenseFFNConfig bad = cfg;
    bad.d_ff = 2 * n + 1;
    ParamStore<double> ps;
    std::string msg;
    try {
      DenseFFN<double> f(bad, ps, "ffn.", 3, comms);
    } catch (const Error& e) {
      msg = e.what();
    }
    INFO(msg);
    CHECK(msg.find("d_ff = " + std::to_string(2 * n + 1) + " does not divide by tp = " + std::to_string(n)) !=
          std::string::npos);
  }
}
