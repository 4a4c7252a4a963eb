// Checks shared by the mixers with decode states and windows (Mamba-1, Mamba-2): the explicit-state backward
// against finite differences, and a run in windows against one pass. Mixer is the double mixer class, Acts its
// activation struct; `prepare(ps)` runs after the parameters are initialised and jittered.
#pragma once

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "catch.hpp"
#include "layers/conv1d.hpp"
#include "model/params.hpp"
#include "util.hpp"

namespace mmtest {

using SeqView = Kokkos::View<std::int32_t**, mm::Layout, mm::Mem>;

// Two rows over L tokens: row 0 switches record at `cut`, row 1 is one record (id 3); rows = 1: row 0 alone.
inline SeqView two_records(index_t L, index_t cut, index_t rows = 2) {
  SeqView seq("seq", rows, L);
  auto h = Kokkos::create_mirror_view(seq);
  for (index_t b = 0; b < rows; ++b)
    for (index_t t = 0; t < L; ++t) h(b, t) = b == 0 ? int(t >= cut) : 3;
  Kokkos::deep_copy(seq, h);
  return seq;
}

// loss = out . dout + final.conv . gc + final.ssm . gs with a given initial state: the backward with dfinal =
// (gc, gs) gives du, the parameter gradients and dinit; all are checked against finite differences. L shorter
// than d_conv - 1 takes the final conv state partly from the initial one.
template <class Mixer, class Acts, class Config, class Prepare>
void explicit_state_gradcheck(const Config& cfg, index_t L, const SeqView& seq, const Prepare& prepare) {
  const index_t B = 2;
  mm::ParamStore<double> ps;
  Mixer mixer(cfg, ps, "m.", 2);
  ps.allocate();
  ps.initialize(5);
  jitter_params(ps, 99, 0.1);
  prepare(ps);
  mm::View2<double> u("u", B * L, cfg.d_model), dout("dout", B * L, cfg.d_model), du("du", B * L, cfg.d_model);
  fill_uniform(u, 1);
  fill_uniform(dout, 2);
  auto init = mixer.make_state(B), gfin = mixer.make_state(B);
  fill_uniform(init.conv, 3);
  fill_uniform(init.ssm, 4);
  fill_uniform(gfin.conv, 5);
  fill_uniform(gfin.ssm, 6);
  const auto dov = to_vec(dout), gcv = to_vec(gfin.conv), gsv = to_vec(gfin.ssm);
  auto loss = [&]() {
    mm::View2<double> o("o", B * L, cfg.d_model);
    Acts a;
    auto fin = mixer.make_state(B);
    mixer.forward(u, B, L, seq, o, a, false, &init, &fin);
    return dot(to_vec(o), dov) + dot(to_vec(fin.conv), gcv) + dot(to_vec(fin.ssm), gsv);
  };
  Acts acts;
  mm::View2<double> out("out", B * L, cfg.d_model);
  auto fin = mixer.make_state(B), dinit = mixer.make_state(B);
  mixer.forward(u, B, L, seq, out, acts, true, &init, &fin);
  ps.zero_grads();
  mixer.backward(acts, B, L, seq, dout, du, &gfin, &dinit);
  INFO("L = " << L);
  CHECK(fd_check(u, to_vec(du), loss, 40).rel() < 1e-6);
  CHECK(fd_check(init.conv, to_vec(dinit.conv), loss).rel() < 1e-6);
  CHECK(fd_check(init.ssm, to_vec(dinit.ssm), loss).rel() < 1e-6);
  for (const auto& e : ps.entries()) {
    const auto idx = ps.index(e.name);
    INFO(e.name);
    CHECK(fd_check(ps.v1(idx), to_vec(ps.g1(idx)), loss, 20).rel() < 1e-6);
  }
}

// Windows of 2 (shorter than d_conv - 1 = 3 for d_conv 4), 5 and 7 tokens over L = 19, both recompute policies:
// output, input gradient and parameter gradients equal one pass to `tol` (1e-12 in double; float mixers, whose
// arithmetic may be bf16's, pass their own). Row 0 holds two records, split at
// t = 9 (inside a window for every W) or t = 10 (a window boundary for W = 2 and 5: that window starts from zero),
// or has no record ids (cut -1: one record per row). Batch 1 (row 0 alone) hands the windows row ranges of u,
// out, dout and du (ssm/windows.hpp); batch 2 gathers them into packed buffers.
template <class Mixer, class Acts, class Config>
void windows_equal_one_pass(const Config& base, double tol = 1e-12) {
  using S = typename Mixer::P;
  const index_t L = 19;
  for (index_t B : {1, 2})
    for (index_t cut : {9, 10, -1})
      for (index_t W : {2, 5, 7})
        for (bool save : {true, false}) {
          const SeqView seq = cut < 0 ? SeqView() : two_records(L, cut, B);
          std::vector<double> outs[2], dus[2], grads[2];
          for (int windowed = 0; windowed < 2; ++windowed) {
            Config cfg = base;
            cfg.window = windowed ? W : 0;
            mm::ParamStore<S> ps;
            Mixer mixer(cfg, ps, "m.", 2);
            ps.allocate();
            ps.initialize(5);
            jitter_params(ps, 99, 0.1);
            mm::View2<S> u("u", B * L, cfg.d_model), out("out", B * L, cfg.d_model);
            mm::View2<S> dout("dout", B * L, cfg.d_model), du("du", B * L, cfg.d_model);
            fill_uniform(u, 1);
            fill_uniform(dout, 2);
            // every element of out and du is written, not added to (the windows' row ranges of them included)
            Kokkos::deep_copy(out, std::numeric_limits<S>::quiet_NaN());
            Kokkos::deep_copy(du, std::numeric_limits<S>::quiet_NaN());
            Acts acts;
            mixer.forward(u, B, L, seq, out, acts, save);
            ps.zero_grads();
            mixer.backward(acts, B, L, seq, dout, du);
            outs[windowed] = to_vec(out);
            dus[windowed] = to_vec(du);
            grads[windowed] = to_vec(ps.grads());
          }
          INFO("batch " << B << ", records cut " << cut << ", window " << W << ", save " << save);
          auto finite = [](const std::vector<double>& v) {  // (rel_err fails on them too; this names the output)
            for (double x : v)
              if (!std::isfinite(x)) return false;
            return true;
          };
          for (int k = 0; k < 2; ++k) {
            CHECK(finite(outs[k]));
            CHECK(finite(dus[k]));
          }
          CHECK(rel_err(outs[1], outs[0]) < tol);
          CHECK(rel_err(dus[1], dus[0]) < tol);
          CHECK(rel_err(grads[1], grads[0]) < tol);
        }
}

}  // namespace mmtest
