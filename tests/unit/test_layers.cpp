// Every layer against a naive double reference, and its backward against finite differences.
#include <cmath>
#include <vector>

#include "catch.hpp"
#include "layers/conv1d.hpp"
#include "layers/cross_entropy.hpp"
#include "layers/embedding.hpp"
#include "layers/linear.hpp"
#include "layers/rmsnorm.hpp"
#include "tensor/ops.hpp"
#include "util.hpp"

using namespace mm;
using mmtest::dot;
using mmtest::fd_check;
using mmtest::fill_uniform;
using mmtest::rel_err;
using mmtest::to_vec;

namespace {
double sig(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double silu_d(double x) { return x * sig(x); }
constexpr double kFdTol = 1e-6;
}  // namespace

TEST_CASE("embedding forward gathers rows and backward scatters them", "[layers]") {
  const index_t V = 6, D = 5, n = 300;
  View2<double> table("table", V, D);
  fill_uniform(table, 1);
  Kokkos::View<std::int32_t*, Layout, Mem> tok("tok", n);
  {
    auto h = Kokkos::create_mirror_view(tok);
    for (index_t i = 0; i < n; ++i) h(i) = std::int32_t((i * 7 + 3) % V);
    Kokkos::deep_copy(tok, h);
  }
  View2<double> out("out", n, D);
  embedding_forward<double>(table, tok, out);
  const auto tv = to_vec(table), ov = to_vec(out);
  std::vector<double> ref(n * D);
  for (index_t i = 0; i < n; ++i)
    for (index_t j = 0; j < D; ++j) ref[i * D + j] = tv[((i * 7 + 3) % V) * D + j];
  CHECK(rel_err(ov, ref) == 0.0);

  View2<double> dout("dout", n, D), dtable("dtable", V, D);
  fill_uniform(dout, 2);
  embedding_backward<double>(dout, tok, dtable);
  const auto dov = to_vec(dout);
  auto loss = [&]() {
    View2<double> o("o", n, D);
    embedding_forward<double>(table, tok, o);
    return dot(to_vec(o), dov);
  };
  CHECK(fd_check(table, to_vec(dtable), loss, 30).rel() < kFdTol);
}

TEST_CASE("RMSNorm matches the reference and finite differences", "[layers]") {
  const index_t n = 7, D = 9;
  const double eps = 1e-5;
  View2<double> x("x", n, D), y("y", n, D), dy("dy", n, D), dx("dx", n, D);
  View1<double> w("w", D), rstd("rstd", n), dw("dw", D);
  fill_uniform(x, 1);
  fill_uniform(w, 2, 0.5, 1.5);
  fill_uniform(dy, 3);
  rmsnorm_forward<double, double>(x, w, eps, y, rstd);
  const auto xv = to_vec(x), wv = to_vec(w);
  std::vector<double> ref(n * D);
  for (index_t i = 0; i < n; ++i) {
    double ss = 0;
    for (index_t j = 0; j < D; ++j) ss += xv[i * D + j] * xv[i * D + j];
    const double r = 1.0 / std::sqrt(ss / D + eps);
    for (index_t j = 0; j < D; ++j) ref[i * D + j] = xv[i * D + j] * r * wv[j];
  }
  CHECK(rel_err(to_vec(y), ref) < 1e-14);
  rmsnorm_backward<double, double>(x, w, rstd, dy, dx, false, dw);
  const auto dyv = to_vec(dy);
  auto loss = [&]() {
    View2<double> yy("yy", n, D);
    View1<double> rr("rr", n);
    rmsnorm_forward<double, double>(x, w, eps, yy, rr);
    return dot(to_vec(yy), dyv);
  };
  CHECK(fd_check(x, to_vec(dx), loss, 63).rel() < kFdTol);
  CHECK(fd_check(w, to_vec(dw), loss).rel() < kFdTol);
  // accumulate_dx adds to what is there
  View2<double> dx2("dx2", n, D);
  Kokkos::deep_copy(dx2, 1.0);
  View1<double> dw2("dw2", D);
  rmsnorm_backward<double, double>(x, w, rstd, dy, dx2, true, dw2);
  auto a = to_vec(dx2), b = to_vec(dx);
  for (auto& v : b) v += 1.0;
  CHECK(rel_err(a, b) < 1e-15);
}

TEST_CASE("gated RMSNorm (group-wise, both gate orders) matches the reference and finite differences",
          "[layers]") {
  const index_t n = 5, E = 12, ld = 30, xcol = 3, zcol = 17;
  const double eps = 1e-5;
  for (index_t gs : {4, 12}) {
    for (GateOrder order : {GateOrder::gate_first, GateOrder::norm_first}) {
      // x and z live in column windows of one wider matrix, as in the Mamba-2 mixer
      View2<double> src("src", n, ld), y("y", n, E), dy("dy", n, E), dsrc("dsrc", n, ld);
      View1<double> w("w", E), dw("dw", E);
      View2<double> rstd("rstd", n, E / gs);
      fill_uniform(src, 1);
      fill_uniform(w, 2, 0.5, 1.5);
      fill_uniform(dy, 3);
      GatedNormIn<double> in{src, xcol, src, zcol};
      gated_rmsnorm_forward<double>(in, E, gs, order, w, eps, y, rstd);
      const auto sv = to_vec(src), wv = to_vec(w);
      std::vector<double> ref(n * E);
      for (index_t i = 0; i < n; ++i)
        for (index_t g = 0; g < E / gs; ++g) {
          double ss = 0;
          for (index_t j = g * gs; j < (g + 1) * gs; ++j) {
            const double xx = sv[i * ld + xcol + j], zz = sv[i * ld + zcol + j];
            const double v = order == GateOrder::gate_first ? xx * silu_d(zz) : xx;
            ss += v * v;
          }
          const double r = 1.0 / std::sqrt(ss / gs + eps);
          for (index_t j = g * gs; j < (g + 1) * gs; ++j) {
            const double xx = sv[i * ld + xcol + j], zz = sv[i * ld + zcol + j];
            ref[i * E + j] = order == GateOrder::gate_first ? xx * silu_d(zz) * r * wv[j]
                                                            : xx * r * wv[j] * silu_d(zz);
          }
        }
      INFO("group " << gs << " order " << int(order));
      CHECK(rel_err(to_vec(y), ref) < 1e-14);
      gated_rmsnorm_backward<double>(in, E, gs, order, w, rstd, dy, dsrc, xcol, dsrc, zcol, dw);
      const auto dyv = to_vec(dy);
      auto loss = [&]() {
        View2<double> yy("yy", n, E), rr("rr", n, E / gs);
        gated_rmsnorm_forward<double>(in, E, gs, order, w, eps, yy, rr);
        return dot(to_vec(yy), dyv);
      };
      CHECK(fd_check(src, to_vec(dsrc), loss, 150).rel() < kFdTol);
      CHECK(fd_check(w, to_vec(dw), loss).rel() < kFdTol);
    }
  }
  View2<double> src("src", 2, 10), y("y", 2, 10), r("r", 2, 3);
  View1<double> w("w", 10);
  CHECK_THROWS_WITH(gated_rmsnorm_forward<double>(GatedNormIn<double>{src, 0, src, 0}, 10, 3,
                                                  GateOrder::gate_first, w, 1e-5, y, r),
                    ContainsSubstring("not divisible"));
}

TEST_CASE("RMSNorm in float equals the double form (the native CUDA kernels' shapes)", "[layers]") {
  // on CUDA builds the native kernels take these rows (768 and 2,048 columns); host builds the Kokkos form
  const index_t n = 37;
  for (index_t d : {768, 2048})
    for (bool acc : {false, true}) {
      INFO("d " << d << " accumulate dx " << acc);
      View2<double> x("x", n, d), dy("dy", n, d), y("y", n, d), dx("dx", n, d);
      View1<double> w("w", d), rstd("rstd", n), dw("dw", d);
      fill_uniform(x, 21);
      fill_uniform(dy, 22);
      fill_uniform(w, 23, 0.5, 1.5);
      View2<float> xf("xf", n, d), dyf("dyf", n, d), yf("yf", n, d), dxf("dxf", n, d);
      View1<float> wf("wf", d), rstdf("rstdf", n), dwf("dwf", d);
      mmtest::from_vec(xf, to_vec(x));
      mmtest::from_vec(dyf, to_vec(dy));
      mmtest::from_vec(wf, to_vec(w));
      Kokkos::deep_copy(dx, 0.5);
      Kokkos::deep_copy(dxf, 0.5f);
      Kokkos::deep_copy(dwf, 0.25f);
      rmsnorm_forward<double, double>(x, w, 1e-5, y, rstd);
      rmsnorm_backward<double, double>(x, w, rstd, dy, dx, acc, dw);
      rmsnorm_forward<float, float>(xf, wf, 1e-5, yf, rstdf);
      rmsnorm_backward<float, float>(xf, wf, rstdf, dyf, dxf, acc, dwf);
      CHECK(rel_err(to_vec(yf), to_vec(y)) < 1e-5);
      CHECK(rel_err(to_vec(rstdf), to_vec(rstd)) < 1e-5);
      CHECK(rel_err(to_vec(dxf), to_vec(dx)) < 1e-5);
      auto dwv = to_vec(dw);
      for (auto& v : dwv) v += 0.25;
      CHECK(rel_err(to_vec(dwf), dwv) < 1e-5);
    }
}

TEST_CASE("gated RMSNorm in float equals the double form (the native CUDA kernels' shapes)", "[layers]") {
  // float data in 16-byte aligned column windows, groups of 128 to 1,536 columns: on CUDA builds the native
  // kernels take these (one warp per row and group, weight gradient from per-warp partials); on host builds the
  // Kokkos form. Both against the double form, which the test above checks against the reference.
  const index_t n = 37;
  const double eps = 1e-5;
  for (const auto& [E, gs] : std::vector<std::pair<index_t, index_t>>{{512, 128}, {1536, 1536}, {1024, 256}}) {
    for (GateOrder order : {GateOrder::gate_first, GateOrder::norm_first}) {
      INFO("width " << E << " group " << gs << " order " << int(order));
      const index_t ld = 2 * E + 8, xcol = 4, zcol = E + 8;
      View2<double> src("src", n, ld), dy("dy", n, E);
      View1<double> w("w", E);
      fill_uniform(src, 11);
      fill_uniform(w, 12, 0.5, 1.5);
      fill_uniform(dy, 13);
      View2<float> srcf("srcf", n, ld), dyf("dyf", n, E);
      View1<float> wf("wf", E);
      mmtest::from_vec(srcf, to_vec(src));
      mmtest::from_vec(dyf, to_vec(dy));
      mmtest::from_vec(wf, to_vec(w));
      View2<double> y("y", n, E), rstd("rstd", n, E / gs), dsrc("dsrc", n, ld);
      View1<double> dw("dw", E);
      gated_rmsnorm_forward<double>(GatedNormIn<double>{src, xcol, src, zcol}, E, gs, order, w, eps, y, rstd);
      gated_rmsnorm_backward<double>(GatedNormIn<double>{src, xcol, src, zcol}, E, gs, order, w, rstd, dy, dsrc,
                                     xcol, dsrc, zcol, dw);
      // the float forms: y, rstd, the source's gradient (dx and dz in their windows), dw (accumulated onto 0.25)
      auto run_float = [&]() {
        View2<float> yf("yf", n, E), rstdf("rstdf", n, E / gs), dsrcf("dsrcf", n, ld);
        View1<float> dwf("dwf", E);
        Kokkos::deep_copy(dwf, 0.25f);
        gated_rmsnorm_forward<float>(GatedNormIn<float>{srcf, xcol, srcf, zcol}, E, gs, order, wf, eps, yf, rstdf);
        gated_rmsnorm_backward<float>(GatedNormIn<float>{srcf, xcol, srcf, zcol}, E, gs, order, wf, rstdf, dyf,
                                      dsrcf, xcol, dsrcf, zcol, dwf);
        return std::vector<std::vector<double>>{to_vec(yf), to_vec(rstdf), to_vec(dsrcf), to_vec(dwf)};
      };
      const auto f = run_float();
      CHECK(rel_err(f[0], to_vec(y)) < 1e-5);
      CHECK(rel_err(f[1], to_vec(rstd)) < 1e-5);
      // dx and dz land in their windows; the columns outside them stay zero
      CHECK(rel_err(f[2], to_vec(dsrc)) < 1e-5);
      auto dwv = to_vec(dw);
      for (auto& v : dwv) v += 0.25;
      CHECK(rel_err(f[3], dwv) < 1e-5);
      // repeatable bit for bit
      const auto f2 = run_float();
      CHECK(f2[0] == f[0]);
      CHECK(f2[2] == f[2]);
      CHECK(f2[3] == f[3]);
      // y written only as its bf16 copy (the out_proj's input where the GEMMs take bf16 copies): the fp32 output
      // rounded to nearest even, the same rstd
      View2<bf16_op_t> yb("yb", n, E);
      View2<float> rstdb("rstdb", n, E / gs);
      gated_rmsnorm_forward_bf16(GatedNormIn<float>{srcf, xcol, srcf, zcol}, E, gs, order, wf, eps, yb, rstdb);
      std::vector<double> y_rounded = f[0];
      for (auto& v : y_rounded) v = bf16_round(float(v));
      CHECK(to_vec(yb) == y_rounded);
      CHECK(to_vec(rstdb) == f[1]);
      // dz written as a bf16 copy into its window of a bf16 matrix (dx into the float source as before; dw the same)
      {
        View2<float> dsrcf("dsrcf_b", n, ld);
        View2<bf16_op_t> dzb("dzb", n, ld);
        View1<float> dwf("dwf_b", E);
        Kokkos::deep_copy(dwf, 0.25f);
        gated_rmsnorm_backward_bf16dz(GatedNormIn<float>{srcf, xcol, srcf, zcol}, E, gs, order, wf, rstdb, dyf,
                                      dsrcf, xcol, dzb, zcol, dwf);
        const auto dx = to_vec(dsrcf), dzv = to_vec(dzb);
        for (index_t i = 0; i < n; ++i)
          for (index_t j = 0; j < E; ++j) {
            INFO("row " << i << " column " << j);
            REQUIRE(dx[i * ld + xcol + j] == f[2][i * ld + xcol + j]);
            REQUIRE(dzv[i * ld + zcol + j] == double(bf16_round(float(f[2][i * ld + zcol + j]))));
          }
        CHECK(to_vec(dwf) == f[3]);
      }
    }
  }
}

TEST_CASE("linear (with and without bias) matches the reference and finite differences", "[layers]") {
  const index_t n = 6, in = 5, out = 4;
  View2<double> x("x", n, in), W("W", out, in), y("y", n, out), dy("dy", n, out), dx("dx", n, in), dW("dW", out, in);
  View1<double> b("b", out), db("db", out);
  fill_uniform(x, 1);
  fill_uniform(W, 2);
  fill_uniform(b, 3);
  fill_uniform(dy, 4);
  linear_forward<double>(x, W, b, y);
  const auto xv = to_vec(x), Wv = to_vec(W), bv = to_vec(b);
  std::vector<double> ref(n * out);
  for (index_t i = 0; i < n; ++i)
    for (index_t o = 0; o < out; ++o) {
      double s = bv[o];
      for (index_t k = 0; k < in; ++k) s += xv[i * in + k] * Wv[o * in + k];
      ref[i * out + o] = s;
    }
  CHECK(rel_err(to_vec(y), ref) < 1e-14);
  linear_backward<double>(x, W, dy, dx, false, dW, db);
  const auto dyv = to_vec(dy);
  auto loss = [&]() {
    View2<double> yy("yy", n, out);
    linear_forward<double>(x, W, b, yy);
    return dot(to_vec(yy), dyv);
  };
  CHECK(fd_check(x, to_vec(dx), loss).rel() < kFdTol);
  CHECK(fd_check(W, to_vec(dW), loss).rel() < kFdTol);
  CHECK(fd_check(b, to_vec(db), loss).rel() < kFdTol);
  // no bias: an empty bias view
  View2<double> y2("y2", n, out);
  linear_forward<double>(x, W, View1<const double>(), y2);
  auto yv = to_vec(y2);
  for (index_t i = 0; i < n; ++i)
    for (index_t o = 0; o < out; ++o) CHECK(std::abs(yv[i * out + o] - (ref[i * out + o] - bv[o])) < 1e-14);
}

TEST_CASE("causal depthwise conv1d + SiLU matches the reference (with records) and finite differences",
          "[layers]") {
  // Lengths beyond one run of the kernels (64 tokens; a shorter last run), widths 2, 4 and 6 (the wider window),
  // with and without a prefix (the inputs before token 0, of token 0's record).
  // recs false: no record ids (the kernels' specialisation without them; one record per row).
  struct Shape {
    index_t L, W;
    bool prefix, recs = true;
  };
  for (Shape sh : {Shape{11, 4, false}, Shape{150, 4, true}, Shape{150, 6, false}, Shape{70, 2, true},
                   Shape{130, 5, true}, Shape{150, 4, true, false}, Shape{70, 3, true, false}}) {
    const index_t B = 2, L = sh.L, C = 3, W = sh.W, ld = 8, col = 2;
    INFO("L=" << L << " W=" << W << " prefix=" << sh.prefix << " records=" << sh.recs);
    View2<double> src("src", B * L, ld), y("y", B * L, C), dy("dy", B * L, C), dsrc("dsrc", B * L, ld);
    View2<double> w("w", C, W), dw("dw", C, W);
    View1<double> bias("bias", C), dbias("dbias", C);
    View3<double> pre("prefix", sh.prefix ? B : 0, C, W - 1);
    fill_uniform(src, 1);
    fill_uniform(w, 2);
    fill_uniform(bias, 3);
    fill_uniform(dy, 4);
    fill_uniform(pre, 5);
    Kokkos::View<std::int32_t**, Layout, Mem> seq("seq", sh.recs ? B : 0, sh.recs ? L : 0);
    std::vector<int> sq(B * L, 0);
    if (sh.recs) {
      auto h = Kokkos::create_mirror_view(seq);
      for (index_t b = 0; b < B; ++b)
        for (index_t t = 0; t < L; ++t) sq[b * L + t] = h(b, t) = b == 0 ? int(t >= 5) + int(t >= 66) : 3;
      Kokkos::deep_copy(seq, h);
    }
    Conv1dIn<double> in{src, col, B, L, C, pre};
    conv1d_silu_forward<double>(in, w, bias, seq, y);
    const auto sv = to_vec(src), wv = to_vec(w), bv = to_vec(bias), pv = to_vec(pre);
    std::vector<double> ref(B * L * C);
    for (index_t b = 0; b < B; ++b)
      for (index_t t = 0; t < L; ++t)
        for (index_t c = 0; c < C; ++c) {
          double acc = bv[c];
          for (index_t k = 0; k < W; ++k) {
            const index_t s = t - (W - 1) + k;
            if (s >= 0 && sq[b * L + s] == sq[b * L + t]) acc += wv[c * W + k] * sv[(b * L + s) * ld + col + c];
            if (s < 0 && sh.prefix && sq[b * L] == sq[b * L + t])
              acc += wv[c * W + k] * pv[(b * C + c) * (W - 1) + (W - 1 + s)];
          }
          ref[(b * L + t) * C + c] = silu_d(acc);
        }
    CHECK(rel_err(to_vec(y), ref) < 1e-14);
    conv1d_silu_backward<double>(in, w, bias, seq, dy, dsrc, col, dw, dbias);
    const auto dyv = to_vec(dy);
    auto loss = [&]() {
      View2<double> yy("yy", B * L, C);
      conv1d_silu_forward<double>(in, w, bias, seq, yy);
      return dot(to_vec(yy), dyv);
    };
    auto dsv = to_vec(dsrc);
    CHECK(fd_check(src, dsv, loss, 200).rel() < kFdTol);
    CHECK(fd_check(w, to_vec(dw), loss).rel() < kFdTol);
    CHECK(fd_check(bias, to_vec(dbias), loss).rel() < kFdTol);
  }
}

TEST_CASE("cross-entropy matches the reference, ignores masked targets, and its gradient is exact", "[layers]") {
  const index_t n = 9, V = 6;
  View2<double> logits("logits", n, V), dlogits("dlogits", n, V);
  fill_uniform(logits, 1, -3, 3);
  Kokkos::View<std::int32_t*, Layout, Mem> tgt("tgt", n);
  std::vector<int> tv(n);
  {
    auto h = Kokkos::create_mirror_view(tgt);
    for (index_t i = 0; i < n; ++i) tv[i] = h(i) = (i == 4) ? -1 : int((i * 5) % V);
    Kokkos::deep_copy(tgt, h);
  }
  const double scale = 0.37;
  const LossSum ls = cross_entropy<double>(logits, tgt, scale, dlogits);
  const auto lv = to_vec(logits);
  double ref = 0;
  for (index_t i = 0; i < n; ++i) {
    if (tv[i] < 0) continue;
    double mx = -1e300, se = 0;
    for (index_t v = 0; v < V; ++v) mx = std::max(mx, lv[i * V + v]);
    for (index_t v = 0; v < V; ++v) se += std::exp(lv[i * V + v] - mx);
    ref += mx + std::log(se) - lv[i * V + tv[i]];
  }
  CHECK(ls.count == n - 1);
  CHECK(std::abs(ls.nats - ref) < 1e-12);
  CHECK(std::abs(ls.bits_per_token() - ref / (n - 1) / std::log(2.0)) < 1e-12);
  auto loss = [&]() { return scale * cross_entropy<double>(logits, tgt, 0, View2<double>()).nats; };
  const auto dl = to_vec(dlogits);
  for (index_t v = 0; v < V; ++v) CHECK(dl[4 * V + v] == 0.0);
  CHECK(fd_check(logits, dl, loss, 60).rel() < kFdTol);
}

TEST_CASE("conv1d + SiLU in float, 4 channels a work item, equals the double form", "[layers]") {
  // 8 channels at column 4 of rows of 16 (the 16-byte path on CUDA, the same arrays of 4 channels on the host),
  // records across a run boundary or none, a prefix, widths 4 (the full 4-slot window), 3 and 6; against the double
  // form (1 channel a work item).
  for (const index_t W : {4, 6, 3})
    for (const bool recs : {true, false}) {
      const index_t B = 2, L = 150, C = 8, ld = 16, col = 4;
      INFO("W=" << W << " records=" << recs);
      View2<double> src("src", B * L, ld), dy("dy", B * L, C), w("w", C, W);
      View1<double> bias("bias", C);
      View3<double> pre("prefix", B, C, W - 1);
      fill_uniform(src, 31);
      fill_uniform(dy, 32);
      fill_uniform(w, 33);
      fill_uniform(bias, 34);
      fill_uniform(pre, 35);
      Kokkos::View<std::int32_t**, Layout, Mem> seq("seq", recs ? B : 0, recs ? L : 0);
      if (recs) {
        auto h = Kokkos::create_mirror_view(seq);
        for (index_t b = 0; b < B; ++b)
          for (index_t t = 0; t < L; ++t) h(b, t) = b == 0 ? int(t >= 62) + int(t >= 100) : 1;
        Kokkos::deep_copy(seq, h);
      }
      View2<float> srcf("srcf", B * L, ld), dyf("dyf", B * L, C), wf("wf", C, W);
      View1<float> biasf("biasf", C);
      View3<float> pref("preff", B, C, W - 1);
      copy_convert("test::f", srcf, src);
      copy_convert("test::f", dyf, dy);
      copy_convert("test::f", wf, w);
      copy_convert("test::f", biasf, bias);
      copy_convert("test::f", pref, pre);
      View2<double> y("y", B * L, C), dsrc("dsrc", B * L, ld), dw("dw", C, W);
      View1<double> db("db", C);
      View2<float> yf("yf", B * L, C), dsrcf("dsrcf", B * L, ld), dwf("dwf", C, W);
      View1<float> dbf("dbf", C);
      conv1d_silu_forward<double>(Conv1dIn<double>{src, col, B, L, C, pre}, w, bias, seq, y);
      conv1d_silu_backward<double>(Conv1dIn<double>{src, col, B, L, C, pre}, w, bias, seq, dy, dsrc, col, dw, db);
      conv1d_silu_forward<float>(Conv1dIn<float>{srcf, col, B, L, C, pref}, wf, biasf, seq, yf);
      conv1d_silu_backward<float>(Conv1dIn<float>{srcf, col, B, L, C, pref}, wf, biasf, seq, dyf, dsrcf, col, dwf, dbf);
      CHECK(rel_err(to_vec(yf), to_vec(y)) < 1e-5);
      CHECK(rel_err(to_vec(dsrcf), to_vec(dsrc)) < 1e-5);
      CHECK(rel_err(to_vec(dwf), to_vec(dw)) < 1e-5);
      CHECK(rel_err(to_vec(dbf), to_vec(db)) < 1e-5);
      // dx written as a bf16 copy (the Mamba-2 in_proj's output gradient under bf16 GEMMs): the float dx rounded to
      // nearest even in its window, the columns outside it untouched (zero); dw and dbias the same as the float form's
      View2<bf16_op_t> dsrcb("dsrcb", B * L, ld);
      View2<float> dwb("dwb", C, W);
      View1<float> dbb("dbb", C);
      conv1d_silu_backward_bf16dx(Conv1dIn<float>{srcf, col, B, L, C, pref}, wf, biasf, seq, dyf, dsrcb, col, dwb, dbb);
      std::vector<double> rounded = to_vec(dsrcf);
      for (auto& v : rounded) v = bf16_round(float(v));
      CHECK(to_vec(dsrcb) == rounded);
      CHECK(to_vec(dwb) == to_vec(dwf));
      CHECK(to_vec(dbb) == to_vec(dbf));
    }
}
