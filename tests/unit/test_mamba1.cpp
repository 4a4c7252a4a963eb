// Mamba-1: the selective scan against the token-by-token double recurrence (lengths, chunk sizes, z, initial state,
// records), chunk-size independence, finite-difference gradients of every scan input; the mixer against a naive
// double reference, finite differences of the input and every parameter, the recompute policy, its initialisation
// and its configuration errors.
#include <algorithm>
#include <cmath>
#include <vector>

#include "catch.hpp"
#include "reference/mamba1_ref.hpp"
#include "ssm/mamba1/mixer.hpp"
#include "ssm/mamba1/scan_cuda.hpp"
#include "ssm/mamba1/selective_scan.hpp"
#include "mixer_checks.hpp"
#include "util.hpp"

using namespace mm;
using mmtest::fd_check;
using mmtest::fill_uniform;
using mmtest::rel_err;
using mmtest::to_vec;

namespace {

struct Case {
  index_t B = 2, L = 37, E = 6, G = 2, N = 3, Q = 16;
  bool z = true, init = true, records = true;
  bool aligned = false;  // u at column 0 and B at column 0 (16-byte windows the native CUDA forward can take)
};

// Inputs laid out as column windows of wider matrices, as the mixer feeds them: u at column u0 = 1 of (n, E + 1),
// z at column E of (n, 2E), B and C at columns b0 = 2 and 2 + G N of (n, 2 + 2 G N); with Case::aligned u0 = b0 =
// 0.
template <class T>
struct Data {
  using Pt = acc_t<T>;
  Case cs;
  SelScanShape shape;
  View2<T> u, delta, bc, z;
  View2<Pt> A;
  View1<Pt> D, bias;
  Kokkos::View<std::int32_t**, Layout, Mem> seq;
  View3<Pt> init;
  index_t u0 = 1, b0 = 2;

  explicit Data(const Case& c) : cs(c), u0(c.aligned ? 0 : 1), b0(c.aligned ? 0 : 2) {
    shape.batch = c.B;
    shape.seqlen = c.L;
    shape.dinner = c.E;
    shape.ngroups = c.G;
    shape.dstate = c.N;
    shape.chunk = c.Q;
    const index_t n = c.B * c.L;
    u = View2<T>("u", n, c.E + u0);
    delta = View2<T>("delta", n, c.E);
    bc = View2<T>("bc", n, b0 + 2 * c.G * c.N);
    fill_uniform(u, 1);
    fill_uniform(delta, 2, -2.0, 1.0);
    fill_uniform(bc, 3);
    A = View2<Pt>("A", c.E, c.N);
    fill_uniform(A, 4, -1.5, -0.2);
    D = View1<Pt>("D", c.E);
    bias = View1<Pt>("bias", c.E);
    fill_uniform(D, 5);
    fill_uniform(bias, 6, -1.0, 0.5);
    if (c.z) {
      z = View2<T>("z", n, 2 * c.E);
      fill_uniform(z, 7, -2.0, 2.0);
    }
    if (c.init) {
      init = View3<Pt>("init", c.B, c.E, c.N);
      fill_uniform(init, 8);
    }
    if (c.records) {
      // row 0 switches record at t = L/3 and 2L/3 + 1, row 1 is one record
      seq = Kokkos::View<std::int32_t**, Layout, Mem>("seq", c.B, c.L);
      auto h = Kokkos::create_mirror_view(seq);
      for (index_t b = 0; b < c.B; ++b)
        for (index_t t = 0; t < c.L; ++t) h(b, t) = b == 0 ? int(t >= c.L / 3) + int(t >= 2 * c.L / 3 + 1) : 0;
      Kokkos::deep_copy(seq, h);
    }
  }

  SelScanIn<T> in() const {
    SelScanIn<T> i;
    i.u = u;
    i.u_col = u0;
    i.delta = delta;
    i.bc = bc;
    i.b_col = b0;
    i.c_col = b0 + cs.G * cs.N;
    if (cs.z) {
      i.z = z;
      i.z_col = cs.E;
    }
    i.A = A;
    i.D = D;
    i.delta_bias = bias;
    i.seq_idx = seq;
    i.init_state = init;
    return i;
  }

  // Columns [c0, c0 + w) of a host copy of an (n, cols) matrix.
  static std::vector<double> cols(const std::vector<double>& m, index_t n, index_t ncol, index_t c0, index_t w) {
    std::vector<double> out(n * w);
    for (index_t i = 0; i < n; ++i)
      for (index_t j = 0; j < w; ++j) out[i * w + j] = m[i * ncol + c0 + j];
    return out;
  }

  std::vector<double> reference(std::vector<double>* fin) const {
    const index_t n = cs.B * cs.L, GN = cs.G * cs.N;
    std::vector<int> sq;
    if (cs.records)
      for (double v : to_vec(seq)) sq.push_back(int(v));
    const auto zv = cs.z ? cols(to_vec(z), n, 2 * cs.E, cs.E, cs.E) : std::vector<double>{};
    return mmref::selective_scan_reference({cs.B, cs.L, cs.E, cs.G, cs.N}, cols(to_vec(u), n, cs.E + u0, u0, cs.E),
                                           to_vec(delta), to_vec(A), cols(to_vec(bc), n, b0 + 2 * GN, b0, 2 * GN),
                                           to_vec(D), to_vec(bias), zv, sq,
                                           cs.init ? to_vec(init) : std::vector<double>{}, fin);
  }
};

template <class T>
double forward_error(const Case& c, bool with_checkpoints) {
  Data<T> d(c);
  View2<T> out("out", c.B * c.L, c.E);
  View3<acc_t<T>> fin("fin", c.B, c.E, c.N);
  View3<acc_t<T>> ck = with_checkpoints ? selective_scan_alloc_checkpoints<T>(d.shape) : View3<acc_t<T>>();
  selective_scan_forward<T>(d.shape, d.in(), out, fin, ck);
  std::vector<double> fin_ref;
  const auto ref = d.reference(&fin_ref);
  return std::max(rel_err(to_vec(out), ref), rel_err(to_vec(fin), fin_ref));
}

// All gradients of one backward run, concatenated per input.
struct Grads {
  std::vector<double> du, ddelta, dbc, dz, dA, dD, dbias, dinit;
};

template <class T>
Grads run_backward(const Data<T>& d, const View2<T>& dout, const View3<acc_t<T>>& dfin, bool use_checkpoints) {
  using Pt = acc_t<T>;
  const Case& c = d.cs;
  const index_t n = c.B * c.L;
  View3<Pt> ck;
  if (use_checkpoints) {
    ck = selective_scan_alloc_checkpoints<T>(d.shape);
    View2<T> out("out", n, c.E);
    selective_scan_forward<T>(d.shape, d.in(), out, View3<Pt>(), ck);
  }
  SelScanGrad<T> g;
  g.du = View2<T>("du", n, c.E + 3);
  g.du_col = 2;
  g.ddelta = View2<T>("ddelta", n, c.E);
  g.dbc = View2<T>("dbc", d.bc.extent(0), d.bc.extent(1));
  if (c.z) {
    g.dz = View2<T>("dz", n, 2 * c.E);
    g.dz_col = c.E;
  }
  g.dA = View2<Pt>("dA", c.E, c.N);
  g.dD = View1<Pt>("dD", c.E);
  g.ddelta_bias = View1<Pt>("dbias", c.E);
  if (c.init) g.dinit_state = View3<Pt>("dinit", c.B, c.E, c.N);
  selective_scan_backward<T>(d.shape, d.in(), dout, dfin, ck, g);
  Grads r;
  r.du = Data<T>::cols(to_vec(g.du), n, c.E + 3, 2, c.E);
  r.ddelta = to_vec(g.ddelta);
  r.dbc = to_vec(g.dbc);
  if (c.z) r.dz = Data<T>::cols(to_vec(g.dz), n, 2 * c.E, c.E, c.E);
  r.dA = to_vec(g.dA);
  r.dD = to_vec(g.dD);
  r.dbias = to_vec(g.ddelta_bias);
  if (c.init) r.dinit = to_vec(g.dinit_state);
  return r;
}

// Widen a gradient of a column window back to the full matrix (zeros elsewhere), for fd_check on the full view.
std::vector<double> widen(const std::vector<double>& g, index_t n, index_t ncol, index_t c0, index_t w) {
  std::vector<double> out(n * ncol, 0.0);
  for (index_t i = 0; i < n; ++i)
    for (index_t j = 0; j < w; ++j) out[i * ncol + c0 + j] = g[i * w + j];
  return out;
}

}  // namespace

TEST_CASE("selective scan equals the token-by-token recurrence (double)", "[mamba1]") {
  double worst = 0;
  for (index_t L : {1, 5, 37, 100}) {
    for (index_t Q : {4, 16, 64}) {
      for (int variant = 0; variant < 4; ++variant) {
        Case c;
        c.L = L;
        c.Q = Q;
        c.z = variant != 1;
        c.init = variant != 2;
        c.records = variant != 3;
        if (variant == 1) c.G = 1;
        INFO("L=" << L << " Q=" << Q << " z=" << c.z << " init=" << c.init << " records=" << c.records);
        const double e = forward_error<double>(c, variant % 2 == 0);
        worst = std::max(worst, e);
        CHECK(e < 1e-12);
      }
    }
  }
  WARN("selective scan vs reference, worst relative error (double): " << worst);
}

TEST_CASE("selective scan in float stays close to the double recurrence", "[mamba1]") {
  Case c;
  c.L = 150;
  c.Q = 32;
  const double e = forward_error<float>(c, true);
  WARN("selective scan float vs double reference: " << e);
  CHECK(e < 2e-5);
}

TEST_CASE("selective scan: the native CUDA forward equals the double recurrence and the portable passes",
          "[mamba1]") {
  // Shapes the native kernel takes (fp32, d_state 16 and 8, blocks of 8 channels inside a group), at lengths that
  // are not multiples of its 128-token iterations or a lane's tokens, with records, an initial state and chunk sizes that
  // do not divide the length. Builds without the kernel (or inputs it cannot take) run the portable passes: there
  // the comparisons hold trivially, and the routing checks below say which path ran.
  double worst_ref = 0, worst_out = 0, worst_grad = 0, worst_nbwd = 0;
  // Cases 1, 2, 3, 6 and 7 fit the state-lanes kernel (the default there); 0, 4 and 5 take the time-parallel kernel
  // by default, and the loop over variants below runs both kernels on every case that fits them.
  for (int variant = 0; variant < 8; ++variant) {
    Case c;
    c.aligned = true;
    c.B = 2;
    // variant 5: three groups of 8 channels, three 128-token iterations; 6: three groups of 16 channels, a partial
    // last tile, checkpoints every 3 tiles of 32; 7: d_state 8 in the lanes, one state per thread
    c.E = variant == 5 ? 24 : variant == 6 ? 48 : 32;
    c.G = variant == 1 ? 1 : variant == 5 || variant == 6 ? 3 : 2;
    c.N = variant == 2 || variant == 7 ? 8 : 16;
    c.L = variant == 3 ? 1 : variant == 4 ? 64 : variant == 5 || variant == 6 ? 300 : 203;
    c.Q = variant == 0 ? 50 : variant == 4 ? 16 : variant == 5 ? 128 : variant == 6 ? 96 : 64;
    c.z = variant != 1;
    c.init = variant != 2;
    c.records = variant != 3;
    INFO("variant " << variant << ": L=" << c.L << " Q=" << c.Q << " G=" << c.G << " N=" << c.N);
    Data<float> native(c), portable(c);
    portable.shape.native = false;
    portable.shape.native_backward = false;
    native.shape.native_backward = false;  // the native forward's checkpoints into the portable backward; the
                                           // native backward (the default) is checked below
    CHECK(selective_scan_native_forward<float>(native.shape, native.in()) == mamba1_cuda::compiled());
    CHECK_FALSE(selective_scan_native_forward<float>(portable.shape, portable.in()));
    CHECK(mamba1_cuda::lanes_fit(c.E, c.N, c.E / c.G, c.Q) ==
          (variant == 1 || variant == 2 || variant == 3 || variant == 6 || variant == 7));
    const double e_ref = forward_error<float>(c, true);
    CHECK(e_ref < 2e-5);
    const index_t n = c.B * c.L;
    std::vector<double> outs[2], fins[2], cks[2];
    for (int k = 0; k < 2; ++k) {
      const Data<float>& d = k == 0 ? native : portable;
      View2<float> out("out", n, c.E);
      View3<float> fin("fin", c.B, c.E, c.N);
      const View3<float> ck = selective_scan_alloc_checkpoints<float>(d.shape);
      selective_scan_forward<float>(d.shape, d.in(), out, fin, ck);
      outs[k] = to_vec(out);
      fins[k] = to_vec(fin);
      cks[k] = to_vec(ck);
    }
    double e_out = std::max({rel_err(outs[0], outs[1]), rel_err(fins[0], fins[1]), rel_err(cks[0], cks[1])});
    // Every variant of the native kernel (the default ran above) against the portable passes.
    for (int v = 1; v <= mamba1_cuda::kVariants && mamba1_cuda::compiled(); ++v) {
      Data<float> other(c);
      other.shape.native_variant = v;
      View2<float> out("out", n, c.E);
      View3<float> fin("fin", c.B, c.E, c.N);
      const View3<float> ck = selective_scan_alloc_checkpoints<float>(other.shape);
      selective_scan_forward<float>(other.shape, other.in(), out, fin, ck);
      INFO("native variant " << mamba1_cuda::variant_name(v));
      const double e = std::max({rel_err(to_vec(out), outs[1]), rel_err(to_vec(fin), fins[1]), rel_err(to_vec(ck), cks[1])});
      CHECK(e < 2e-5);
      e_out = std::max(e_out, e);
    }
    CHECK(e_out < 2e-5);
    // The backward from each forward's checkpoints.
    View2<float> dout("dout", n, c.E);
    View3<float> dfin("dfin", c.B, c.E, c.N);
    fill_uniform(dout, 31);
    fill_uniform(dfin, 32);
    const Grads a = run_backward<float>(native, dout, dfin, true), b = run_backward<float>(portable, dout, dfin, true);
    auto grad_err = [](const Grads& x, const Grads& y) {
      double w = 0;
      for (double e : {rel_err(x.du, y.du), rel_err(x.ddelta, y.ddelta), rel_err(x.dbc, y.dbc), rel_err(x.dz, y.dz),
                       rel_err(x.dA, y.dA), rel_err(x.dD, y.dD), rel_err(x.dbias, y.dbias), rel_err(x.dinit, y.dinit)})
        w = std::max(w, e);
      return w;
    };
    const double e_grad = grad_err(a, b);
    CHECK(e_grad < 2e-5);
    // The backward's chunk passes on the native kernels (SelScanShape::native_backward) against the portable ones.
    CHECK(mamba1_cuda::backward_fits(c.E, c.N, c.E / c.G, c.Q) ==
          (variant == 1 || variant == 2 || variant == 3 || variant == 6 || variant == 7));
    if (mamba1_cuda::compiled()) {
      Data<float> nb(c);  // the defaults: the native forward and backward where they fit
      double e_nb = grad_err(run_backward<float>(nb, dout, dfin, true), b);
      INFO("native backward");
      CHECK(e_nb < 2e-5);
      nb.shape.bc_parts_bytes = 1;  // dB and dC formed one block of channels at a time
      const double e_rounds = grad_err(run_backward<float>(nb, dout, dfin, true), b);
      INFO("native backward, one block of channels a round");
      CHECK(e_rounds < 2e-5);
      e_nb = std::max(e_nb, e_rounds);
      worst_nbwd = std::max(worst_nbwd, e_nb);
    }
    worst_ref = std::max(worst_ref, e_ref);
    worst_out = std::max(worst_out, e_out);
    worst_grad = std::max(worst_grad, e_grad);
  }
  // Inputs the kernel cannot take go the portable way: a column window off 16 bytes, double, d_state 3.
  Case off;
  off.E = 32;
  off.N = 16;
  CHECK_FALSE(selective_scan_native_forward<float>(Data<float>(off).shape, Data<float>(off).in()));
  off.aligned = true;
  CHECK_FALSE(selective_scan_native_forward<double>(Data<double>(off).shape, Data<double>(off).in()));
  off.N = 3;
  CHECK_FALSE(selective_scan_native_forward<float>(Data<float>(off).shape, Data<float>(off).in()));
  WARN("selective scan native (" << (mamba1_cuda::compiled() ? "CUDA" : "not built") << "): vs double reference "
                                 << worst_ref << ", vs portable outputs/states " << worst_out << ", gradients "
                                 << worst_grad << ", native backward " << worst_nbwd);
}

TEST_CASE("selective scan results and gradients do not depend on the chunk size", "[mamba1]") {
  std::vector<std::vector<double>> outs, fins;
  std::vector<Grads> grads;
  for (index_t Q : {3, 16, 50, 1000}) {
    Case c;
    c.L = 50;
    c.Q = Q;
    Data<double> d(c);
    View2<double> out("out", c.B * c.L, c.E), dout("dout", c.B * c.L, c.E);
    View3<double> fin("fin", c.B, c.E, c.N), dfin("dfin", c.B, c.E, c.N);
    fill_uniform(dout, 21);
    fill_uniform(dfin, 22);
    selective_scan_forward<double>(d.shape, d.in(), out, fin);
    outs.push_back(to_vec(out));
    fins.push_back(to_vec(fin));
    grads.push_back(run_backward<double>(d, dout, dfin, Q != 16));  // Q = 16 rebuilds its checkpoints
  }
  double worst = 0;
  for (std::size_t k = 1; k < outs.size(); ++k) {
    const Grads &a = grads[k], &b = grads[0];
    for (double e : {rel_err(outs[k], outs[0]), rel_err(fins[k], fins[0]), rel_err(a.du, b.du),
                     rel_err(a.ddelta, b.ddelta), rel_err(a.dbc, b.dbc), rel_err(a.dz, b.dz), rel_err(a.dA, b.dA),
                     rel_err(a.dD, b.dD), rel_err(a.dbias, b.dbias), rel_err(a.dinit, b.dinit)}) {
      worst = std::max(worst, e);
      CHECK(e < 1e-13);
    }
  }
  WARN("selective scan chunk sizes 3/16/50/1000, worst relative difference: " << worst);
}

TEST_CASE("selective scan backward is deterministic (bit-identical runs)", "[mamba1]") {
  Case c;
  c.L = 40;
  c.Q = 8;
  Data<double> d(c);
  View2<double> dout("dout", c.B * c.L, c.E);
  fill_uniform(dout, 23);
  const Grads a = run_backward<double>(d, dout, View3<double>(), true);
  const Grads b = run_backward<double>(d, dout, View3<double>(), true);
  CHECK(a.dbc == b.dbc);
  CHECK(a.dA == b.dA);
  CHECK(a.dD == b.dD);
  CHECK(a.dbias == b.dbias);
  CHECK(a.du == b.du);
}

TEST_CASE("selective scan backward matches finite differences for every input", "[mamba1]") {
  // variant 3: 64 channels per group, which the backward splits into 2 blocks whose dB/dC parts it adds in order;
  // variant 4: the same with room for one block's parts at a time (two rounds, the second added to the first)
  for (int variant = 0; variant < 5; ++variant) {
    Case c;
    c.L = variant >= 3 ? 19 : 23;
    c.Q = variant == 0 ? 4 : variant >= 3 ? 8 : 16;
    c.z = variant != 1;
    c.records = variant != 2;
    if (variant >= 3) c.E = 128, c.G = 2, c.N = 3;
    Data<double> d(c);
    if (variant == 4) d.shape.bc_parts_bytes = 1;
    const index_t n = c.B * c.L;
    View2<double> dout("dout", n, c.E);
    View3<double> dfin("dfin", c.B, c.E, c.N);
    fill_uniform(dout, 11);
    fill_uniform(dfin, 12);
    const auto dov = to_vec(dout), dfv = to_vec(dfin);
    auto loss = [&]() {
      View2<double> out("out", n, c.E);
      View3<double> fin("fin", c.B, c.E, c.N);
      selective_scan_forward<double>(d.shape, d.in(), out, fin);
      return mmtest::dot(to_vec(out), dov) + mmtest::dot(to_vec(fin), dfv);
    };
    const Grads g = run_backward<double>(d, dout, dfin, variant != 1);
    INFO("variant " << variant << " (Q=" << c.Q << " E=" << c.E << " z=" << c.z << " records=" << c.records << ")");
    const double e_u = fd_check(d.u, widen(g.du, n, c.E + d.u0, d.u0, c.E), loss, 60).rel();
    const double e_delta = fd_check(d.delta, g.ddelta, loss, 40).rel();
    const double e_bc = fd_check(d.bc, g.dbc, loss, 60).rel();
    const double e_A = fd_check(d.A, g.dA, loss).rel();
    const double e_D = fd_check(d.D, g.dD, loss).rel();
    const double e_bias = fd_check(d.bias, g.dbias, loss).rel();
    const double e_init = fd_check(d.init, g.dinit, loss).rel();
    CHECK(e_u < 1e-7);
    CHECK(e_delta < 1e-7);
    CHECK(e_bc < 1e-7);
    CHECK(e_A < 1e-7);
    CHECK(e_D < 1e-7);
    CHECK(e_bias < 1e-7);
    CHECK(e_init < 1e-7);
    double e_z = 0;
    if (c.z) {
      e_z = fd_check(d.z, widen(g.dz, n, 2 * c.E, c.E, c.E), loss, 40).rel();
      CHECK(e_z < 1e-7);
    }
    WARN("scan FD variant " << variant << ": du " << e_u << " ddelta " << e_delta << " dB/dC " << e_bc << " dA "
                            << e_A << " dD " << e_D << " dbias " << e_bias << " dinit " << e_init << " dz " << e_z);
  }
}

TEST_CASE("selective scan rejects shapes that do not fit, naming the values", "[mamba1]") {
  Case c;
  c.L = 10;
  Data<double> d(c);
  View2<double> out("out", c.B * c.L, c.E);
  SelScanShape s = d.shape;
  s.ngroups = 4;  // 6 % 4
  CHECK_THROWS_WITH(selective_scan_forward<double>(s, d.in(), out, View3<double>()),
                    ContainsSubstring("d_inner (6) is not divisible by ngroups (4)"));
  s = d.shape;
  s.seqlen = 11;
  CHECK_THROWS_WITH(selective_scan_forward<double>(s, d.in(), out, View3<double>()),
                    ContainsSubstring("batch * seqlen = 22"));
  View3<double> bad("bad", c.B, c.E, c.N + 1);
  CHECK_THROWS_WITH(selective_scan_forward<double>(d.shape, d.in(), out, bad), ContainsSubstring("final_state"));
  s = d.shape;
  s.chunk = 0;
  CHECK_THROWS_WITH(selective_scan_forward<double>(s, d.in(), out, View3<double>()),
                    ContainsSubstring("chunk (0)"));
}

// ------------------------------------------------------------------ mixer

namespace {

Mamba1Config tiny_m1() {
  Mamba1Config c;
  c.d_model = 5;
  c.d_state = 3;
  c.d_conv = 4;
  c.expand = 2;  // E = 10
  c.dt_rank = 2;
  c.chunk = 4;
  return c;
}

Kokkos::View<std::int32_t**, Layout, Mem> m1_records(index_t B, index_t L) {
  Kokkos::View<std::int32_t**, Layout, Mem> seq("seq", B, L);
  auto h = Kokkos::create_mirror_view(seq);
  for (index_t b = 0; b < B; ++b)
    for (index_t t = 0; t < L; ++t) h(b, t) = b == 0 ? int(t >= L / 2) : 0;
  Kokkos::deep_copy(seq, h);
  return seq;
}

}  // namespace

TEST_CASE("Mamba-1 mixer forward equals the naive double reference", "[mamba1]") {
  const Mamba1Config cfg = tiny_m1();
  const index_t B = 2, L = 19;
  ParamStore<double> ps;
  Mamba1Mixer<double> mixer(cfg, ps, "m.", 2);
  ps.allocate();
  ps.initialize(5);
  mmtest::jitter_params(ps, 99, 0.1);
  fill_uniform(ps.v1(ps.index("m.dt_proj.bias")), 77, -1.0, 1.0);
  View2<double> u("u", B * L, cfg.d_model), out("out", B * L, cfg.d_model);
  fill_uniform(u, 1);
  const auto seq = m1_records(B, L);
  std::vector<int> sq;
  for (double v : to_vec(seq)) sq.push_back(int(v));
  Mamba1Acts<double> acts;
  mixer.forward(u, B, L, seq, out, acts, true);
  auto p = [&](const char* name) { return to_vec(ps.v1(ps.index(std::string("m.") + name))); };
  mmref::Mamba1RefShape s{B, L, cfg.d_model, cfg.d_inner(), cfg.d_state, cfg.rank(), cfg.d_conv};
  const auto ref = mmref::mamba1_reference(s, to_vec(u), p("in_proj.weight"), p("conv1d.weight"), p("conv1d.bias"),
                                           p("x_proj.weight"), p("dt_proj.weight"), p("dt_proj.bias"), p("A_log"),
                                           p("D"), p("out_proj.weight"), sq);
  const double e = rel_err(to_vec(out), ref);
  WARN("Mamba-1 mixer vs reference: " << e);
  CHECK(e < 1e-12);
}

TEST_CASE("Mamba-1 mixer backward matches finite differences for the input and every parameter", "[mamba1]") {
  const Mamba1Config cfg = tiny_m1();
  const index_t B = 2, L = 13;
  ParamStore<double> ps;
  Mamba1Mixer<double> mixer(cfg, ps, "m.", 2);
  ps.allocate();
  ps.initialize(5);
  mmtest::jitter_params(ps, 99, 0.1);
  fill_uniform(ps.v1(ps.index("m.dt_proj.bias")), 77, -1.0, 1.0);
  View2<double> u("u", B * L, cfg.d_model), out("out", B * L, cfg.d_model), dout("dout", B * L, cfg.d_model);
  View2<double> du("du", B * L, cfg.d_model);
  fill_uniform(u, 1);
  fill_uniform(dout, 2);
  const auto seq = m1_records(B, L);
  const auto dov = to_vec(dout);
  auto loss = [&]() {
    View2<double> o("o", B * L, cfg.d_model);
    Mamba1Acts<double> a;
    mixer.forward(u, B, L, seq, o, a, false);
    return mmtest::dot(to_vec(o), dov);
  };
  Mamba1Acts<double> acts;
  mixer.forward(u, B, L, seq, out, acts, true);
  ps.zero_grads();
  mixer.backward(acts, B, L, seq, dout, du);
  const double e_u = fd_check(u, to_vec(du), loss, 40).rel();
  CHECK(e_u < 1e-6);
  double worst = e_u;
  for (const auto& e : ps.entries()) {
    const auto idx = ps.index(e.name);
    INFO(e.name);
    const double err = fd_check(ps.v1(idx), to_vec(ps.g1(idx)), loss, 20).rel();
    worst = std::max(worst, err);
    CHECK(err < 1e-6);
  }
  WARN("Mamba-1 mixer FD, worst relative error over u and all parameters: " << worst);
}

TEST_CASE("Mamba-1 mixer recompute policy gives bit-identical gradients", "[mamba1]") {
  const Mamba1Config cfg = tiny_m1();
  const index_t B = 1, L = 21;
  ParamStore<float> ps;
  Mamba1Mixer<float> mixer(cfg, ps, "m.", 2);
  ps.allocate();
  ps.initialize(5);
  View2<float> u("u", B * L, cfg.d_model), out("out", B * L, cfg.d_model), dout("dout", B * L, cfg.d_model);
  fill_uniform(u, 1);
  fill_uniform(dout, 2);
  std::vector<double> grads[2], dus[2];
  for (int mode = 0; mode < 2; ++mode) {
    Mamba1Acts<float> acts;
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

TEST_CASE("Mamba-1 mixer backward with explicit states matches finite differences (initial and final state)",
          "[mamba1][gradcheck]") {
  for (index_t L : {2, 11})
    mmtest::explicit_state_gradcheck<Mamba1Mixer<double>, Mamba1Acts<double>>(
        tiny_m1(), L, m1_records(2, L),
        [](ParamStore<double>& ps) { fill_uniform(ps.v1(ps.index("m.dt_proj.bias")), 77, -1.0, 1.0); });
}

TEST_CASE("Mamba-1 mixer in windows with carried states equals one pass (forward and backward)", "[mamba1]") {
  mmtest::windows_equal_one_pass<Mamba1Mixer<double>, Mamba1Acts<double>>(tiny_m1());
}

TEST_CASE("Mamba-1 initialisation follows mamba_ssm", "[mamba1]") {
  Mamba1Config cfg;
  cfg.d_model = 40;  // dt_rank = ceil(40 / 16) = 3
  ParamStore<double> ps;
  const index_t n_layer = 4;
  Mamba1Mixer<double> mixer(cfg, ps, "m.", n_layer);
  ps.allocate();
  ps.initialize(11);
  CHECK(cfg.rank() == 3);
  CHECK(ps.entry("m.x_proj.weight").shape == std::vector<index_t>{3 + 2 * 16, 80});
  CHECK(ps.entry("m.dt_proj.weight").shape == std::vector<index_t>{80, 3});
  const auto a_log = to_vec(ps.v1(ps.index("m.A_log")));
  REQUIRE(a_log.size() == std::size_t(80 * 16));
  for (index_t d = 0; d < 80; ++d)
    for (index_t n = 0; n < 16; ++n) CHECK(a_log[d * 16 + n] == Approx(std::log(double(n + 1))).margin(1e-15));
  for (double b : to_vec(ps.v1(ps.index("m.dt_proj.bias")))) {
    const double dt = b > 20 ? b : std::log1p(std::exp(b));
    CHECK(dt >= cfg.dt_min * (1 - 1e-12));
    CHECK(dt <= cfg.dt_max * (1 + 1e-12));
  }
  for (double v : to_vec(ps.v1(ps.index("m.D")))) CHECK(v == 1.0);
  double dtw = 0, outw = 0;
  for (double w : to_vec(ps.v1(ps.index("m.dt_proj.weight")))) dtw = std::max(dtw, std::abs(w));
  for (double w : to_vec(ps.v1(ps.index("m.out_proj.weight")))) outw = std::max(outw, std::abs(w));
  CHECK(dtw <= 1.0 / std::sqrt(3.0));
  CHECK(dtw > 0.9 / std::sqrt(3.0));
  CHECK(outw <= 1.0 / std::sqrt(80.0) / 2.0);
  CHECK(outw > 0.9 / std::sqrt(80.0) / 2.0);
  for (const char* nd : {"m.A_log", "m.D", "m.dt_proj.bias", "m.conv1d.bias"}) CHECK_FALSE(ps.entry(nd).decay);
  CHECK(ps.entry("m.in_proj.weight").decay);
}

TEST_CASE("Mamba-1 bad configurations are errors naming the values", "[mamba1]") {
  ParamStore<double> ps;
  Mamba1Config c = tiny_m1();
  c.d_state = 0;
  CHECK_THROWS_WITH(Mamba1Mixer<double>(c, ps, "m.", 1), ContainsSubstring("d_state must be positive (got 0)"));
  c = tiny_m1();
  c.dt_rank = -2;
  CHECK_THROWS_WITH(Mamba1Mixer<double>(c, ps, "m.", 1), ContainsSubstring("(got -2)"));
  c = tiny_m1();
  c.d_conv = 0;
  CHECK_THROWS_WITH(Mamba1Mixer<double>(c, ps, "m.", 1), ContainsSubstring("d_conv must be in [1, 8] (got 0)"));
  c = tiny_m1();
  c.chunk = 0;
  CHECK_THROWS_WITH(Mamba1Mixer<double>(c, ps, "m.", 1), ContainsSubstring("chunk_size must be positive (got 0)"));
  c = tiny_m1();
  c.dt_min = 0.5;
  c.dt_max = 0.1;
  CHECK_THROWS_WITH(Mamba1Mixer<double>(c, ps, "m.", 1), ContainsSubstring("dt_min <= dt_max (got 0.5, 0.1)"));
  // a state of the wrong shape
  c = tiny_m1();
  Mamba1Mixer<double> mixer(c, ps, "ok.", 1);
  ps.allocate();
  ps.initialize(1);
  auto st = mixer.make_state(3);
  View2<double> u("u", 2, c.d_model), out("out", 2, c.d_model);
  CHECK_THROWS_WITH(mixer.step(u, st, out), ContainsSubstring("conv state must be (batch, d_inner, d_conv - 1) = (2"));
}
