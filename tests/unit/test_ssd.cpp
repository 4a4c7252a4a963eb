// Mamba-2 SSD chunked scan against the token-by-token double recurrence, chunk-size independence, and
// finite-difference gradients of every input.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "catch.hpp"
#include "reference/ssd_ref.hpp"
#include "ssm/mamba2/ssd.hpp"
#include "ssm/mamba2/ssd_fused.hpp"
#include "util.hpp"

using namespace mm;
using mmtest::fd_check;
using mmtest::fill_uniform;
using mmtest::rel_err;
using mmtest::to_vec;

namespace {

struct Case {
  index_t B = 2, L = 37, H = 4, P = 3, G = 2, N = 5, Q = 16;
  bool init = true, records = true;
  double dt_lo = 0, dt_hi = std::numeric_limits<double>::infinity();
  SSDAlgo algo = SSDAlgo::portable;
  GemmCompute compute = GemmCompute::fp32;
  double workspace = double(256ull << 20);  // gemm: bytes per Q x Q workspace
};

// The sizes of a fused-kernel test case (CUDA shapes); the rest of the Case as its defaults.
struct FusedShape {
  index_t L, H, P, G, N, Q;
  Case to_case() const {
    Case c;
    c.L = L;
    c.H = H;
    c.P = P;
    c.G = G;
    c.N = N;
    c.Q = Q;
    return c;
  }
};

// A fused-kernel shape with a workspace budget of this many heads (blocks of heads and runs), and that budget in
// bytes for case c: per head a Q x Q workspace, or where the fused backward runs (fused_blocks) its own per-head
// arrays, by which it sizes its blocks of heads.
struct BlockedShape : FusedShape {
  double workspace_heads;
};
double head_budget(const Case& c, bool fused_blocks, double heads) {
  const index_t nc = (c.L + c.Q - 1) / c.Q;
  const double per_head = fused_blocks ? ssd_fused_head_bytes(double(c.B * c.L), c.Q, sizeof(float))
                                       : double(c.B * nc * c.Q * c.Q * sizeof(float));
  return per_head * heads;
}

const char* algo_name(SSDAlgo a) {
  return a == SSDAlgo::gemm ? "gemm" : a == SSDAlgo::fused ? "fused" : "portable";
}
// (fused is gemm wherever its CUDA kernels do not apply: host builds, double, the small shapes of most cases here;
// its own test case below takes shapes they do)
constexpr SSDAlgo kAlgos[] = {SSDAlgo::portable, SSDAlgo::gemm};

template <class T>
struct Data {
  using Pt = acc_t<T>;
  Case cs;
  SSDShape shape;
  View2<T> xbc, dt;
  View1<Pt> A_log, dt_bias, D;
  Kokkos::View<std::int32_t**, Layout, Mem> seq;
  View4<Pt> init;

  explicit Data(const Case& c) : cs(c) {
    shape.batch = c.B;
    shape.seqlen = c.L;
    shape.nheads = c.H;
    shape.headdim = c.P;
    shape.ngroups = c.G;
    shape.dstate = c.N;
    shape.chunk = c.Q;
    shape.dt_lo = c.dt_lo;
    shape.dt_hi = c.dt_hi;
    shape.algo = c.algo;
    shape.compute = c.compute;
    shape.gemm_workspace_bytes = c.workspace;
    const index_t E = c.H * c.P;
    xbc = View2<T>("xbc", c.B * c.L, E + 2 * c.G * c.N);
    dt = View2<T>("dt", c.B * c.L, c.H);
    A_log = View1<Pt>("A_log", c.H);
    dt_bias = View1<Pt>("dt_bias", c.H);
    D = View1<Pt>("D", c.H);
    fill_uniform(xbc, 1);
    fill_uniform(dt, 2, -2.0, 1.0);
    fill_uniform(A_log, 3, -0.5, 1.0);
    fill_uniform(dt_bias, 4, -2.0, 0.0);
    fill_uniform(D, 5);
    if (c.init) {
      init = View4<Pt>("init", c.B, c.H, c.P, c.N);
      fill_uniform(init, 6);
    }
    if (c.records) {
      // records: row 0 switches at t = L/3 and 2L/3 + 1, row 1 is one record
      seq = Kokkos::View<std::int32_t**, Layout, Mem>("seq", c.B, c.L);
      auto h = Kokkos::create_mirror_view(seq);
      for (index_t b = 0; b < c.B; ++b)
        for (index_t t = 0; t < c.L; ++t) h(b, t) = b == 0 ? int(t >= c.L / 3) + int(t >= 2 * c.L / 3 + 1) : 0;
      Kokkos::deep_copy(seq, h);
    }
  }

  SSDIn<T> in() const {
    const index_t E = cs.H * cs.P;
    SSDIn<T> i;
    i.xbc = xbc;
    i.x_col = 0;
    i.b_col = E;
    i.c_col = E + cs.G * cs.N;
    i.dt = dt;
    i.dt_col = 0;
    i.A_log = A_log;
    i.dt_bias = dt_bias;
    i.D = D;
    i.seq_idx = seq;
    i.init_state = init;
    return i;
  }

  // Zeroed gradient buffers for ssd_backward (the initial-state gradient only when asked for).
  SSDGrad<T> grads(bool with_dinit) const {
    SSDGrad<T> g;
    g.dxbc = View2<T>("dxbc", xbc.extent(0), xbc.extent(1));
    g.ddt = View2<T>("ddt", dt.extent(0), dt.extent(1));
    g.dA_log = View1<Pt>("dA_log", cs.H);
    g.ddt_bias = View1<Pt>("ddt_bias", cs.H);
    g.dD = View1<Pt>("dD", cs.H);
    if (with_dinit) g.dinit_state = View4<Pt>("dinit", cs.B, cs.H, cs.P, cs.N);
    return g;
  }

  std::vector<double> reference(std::vector<double>* fin) const {
    mmref::SSDRefShape s{cs.B, cs.L, cs.H, cs.P, cs.G, cs.N, cs.dt_lo, cs.dt_hi};
    std::vector<int> sq;
    if (cs.records)
      for (double v : to_vec(seq)) sq.push_back(int(v));
    return mmref::ssd_reference(s, to_vec(xbc), to_vec(dt), to_vec(A_log), to_vec(dt_bias), to_vec(D), sq,
                                cs.init ? to_vec(init) : std::vector<double>{}, fin);
  }
};

template <class T>
void check_forward(const Case& c, double tol) {
  Data<T> d(c);
  View2<T> y("y", c.B * c.L, c.H * c.P);
  View4<acc_t<T>> fin("fin", c.B, c.H, c.P, c.N);
  ssd_forward<T>(d.shape, d.in(), y, fin);
  std::vector<double> fin_ref;
  const auto y_ref = d.reference(&fin_ref);
  INFO("L=" << c.L << " Q=" << c.Q << " init=" << c.init << " records=" << c.records << " algo=" << algo_name(c.algo));
  CHECK(rel_err(to_vec(y), y_ref) < tol);
  CHECK(rel_err(to_vec(fin), fin_ref) < tol);
}

// Every gradient of one backward run of d with the same seeded dy and final-state gradient: dxbc, ddt, dA_log,
// ddt_bias, dD, dinit_state.
template <class T>
std::vector<std::vector<double>> backward_grads(const Data<T>& d, const SSDSaved<T>* kept = nullptr) {
  const Case& c = d.cs;
  View2<T> dy("dy", c.B * c.L, c.H * c.P);
  View4<acc_t<T>> dfin("dfin", c.B, c.H, c.P, c.N);
  fill_uniform(dy, 21);
  fill_uniform(dfin, 22);
  SSDGrad<T> g = d.grads(true);
  ssd_backward<T>(d.shape, d.in(), dy, dfin, g, kept);
  return {to_vec(g.dxbc), to_vec(g.ddt), to_vec(g.dA_log), to_vec(g.ddt_bias), to_vec(g.dD), to_vec(g.dinit_state)};
}

}  // namespace

TEST_CASE("SSD algorithm `auto` resolves by backend and arithmetic", "[ssd]") {
  SSDShape s;
  const bool cuda = std::string(Exec::name()) == "Cuda";
  for (GemmCompute cmp : {GemmCompute::fp32, GemmCompute::tf32, GemmCompute::bf16}) {
    s.compute = cmp;
    // host builds: gemm (the chunk products in the host batched GEMM: faster than the portable kernels there)
    const SSDAlgo want = cuda && cmp == GemmCompute::bf16 ? SSDAlgo::fused : SSDAlgo::gemm;
    CHECK(ssd_resolved_algo(s) == want);
  }
  s.algo = SSDAlgo::gemm;  // an explicit choice is kept
  CHECK(ssd_resolved_algo(s) == SSDAlgo::gemm);
}

TEST_CASE("SSD chunked forward equals the token-by-token recurrence (double)", "[ssd]") {
  for (SSDAlgo algo : kAlgos)
    for (index_t L : {1, 16, 37, 64, 100}) {
      for (index_t Q : {8, 16, 32}) {
        Case c;
        c.L = L;
        c.Q = Q;
        c.algo = algo;
        check_forward<double>(c, 1e-12);
        c.init = false;
        c.records = false;
        check_forward<double>(c, 1e-12);
      }
    }
}

TEST_CASE("SSD chunked forward in float stays close to the double recurrence", "[ssd]") {
  for (SSDAlgo algo : kAlgos) {
    Case c;
    c.L = 150;
    c.Q = 64;
    c.algo = algo;
    check_forward<float>(c, 2e-5);
  }
}

TEST_CASE("SSD GEMM formulation on tensor cores (tf32, bf16 operands) stays within their rounding", "[ssd]") {
  // On host builds these compute in fp32 and meet the fp32 bound; on CUDA the chunk GEMMs round their operands to
  // tf32 (10-bit mantissa) or bf16 (7-bit), with fp32 accumulation.
  for (GemmCompute cmp : {GemmCompute::tf32, GemmCompute::bf16}) {
    Case c;
    c.L = 300;
    c.Q = 64;
    c.P = 16;
    c.N = 32;
    c.algo = SSDAlgo::gemm;
    c.compute = cmp;
    check_forward<float>(c, cmp == GemmCompute::tf32 ? 3e-3 : 2e-2);
  }
}

TEST_CASE("SSD fused tensor-core forward stays within bf16 rounding of the double recurrence", "[ssd]") {
  // Shapes the CUDA kernels take (headdim a multiple of 16, d_state a multiple of 16, chunk a multiple of 64): a
  // short last chunk, packed records, an initial state, two groups, d_state over one 64-wide slab, headdim 64 and
  // 128. On host builds fused is the GEMM formulation in fp32 and meets the same bound with room to spare.
  for (const FusedShape& sh : {FusedShape{300, 4, 16, 2, 32, 64}, FusedShape{333, 2, 64, 1, 128, 128},
                               FusedShape{200, 2, 128, 2, 80, 64}, FusedShape{256, 3, 48, 1, 16, 256}}) {
    Case c = sh.to_case();
    c.algo = SSDAlgo::fused;
    c.compute = GemmCompute::bf16;
    // the chunk scan's mma.sync kernel, (CUDA builds) its earlier WMMA form and its form with a cp.async ring; the
    // chunk states in their tiles form with the mma scan, heads form with the WMMA scan (tiles where a group is one
    // head), and heads form through a cp.async ring with the ring scan
    const bool kernels = ssd_fused::fits(int(sh.P), int(sh.N), int(sh.Q));
    for (ssd_fused::Form f : {ssd_fused::Form::mma, ssd_fused::Form::wmma, ssd_fused::Form::mma_ring}) {
      if (f != ssd_fused::Form::mma && !kernels) continue;
      const ssd_fused::FormScope form(ssd_fused::scan_form, f);
      const ssd_fused::FormScope sform(ssd_fused::state_form, f == ssd_fused::Form::mma    ? ssd_fused::StateForm::tiles
                                                              : f == ssd_fused::Form::wmma ? ssd_fused::StateForm::heads
                                                                                          : ssd_fused::StateForm::heads_ring);
      const char* form_name = f == ssd_fused::Form::wmma       ? " (WMMA form, chunk states: heads form where G < H)"
                              : f == ssd_fused::Form::mma_ring ? " (ring form, chunk states: heads form, ring)"
                              : kernels                        ? " (chunk states: tiles form)"
                                                               : "";
      INFO("P=" << sh.P << " N=" << sh.N << " Q=" << sh.Q << form_name);
      c.records = true;
      c.init = true;
      check_forward<float>(c, 2e-2);
      c.records = false;
      c.init = false;
      check_forward<float>(c, 2e-2);
    }
  }
}

TEST_CASE("SSD fused tensor-core backward equals the fp32 GEMM formulation's within bf16 rounding", "[ssd][gradcheck]") {
  // The same shapes as the fused forward (short last chunk, records, initial state, groups, headdim 16 to 128, a
  // workspace budget that splits the heads into blocks), and headdim 128 with d_state 128, whose state epilogue
  // takes the per-tile form (ssd_fused::epilogue_writes_wdecay is false there; true for the others); every
  // gradient against the gemm algorithm in fp32, which the double tests tie to finite differences. On host builds
  // both are the fp32 GEMM formulation.
  using Shape = BlockedShape;
  for (const Shape& sh : {Shape{{300, 4, 16, 2, 32, 64}, 8}, Shape{{333, 2, 64, 1, 128, 128}, 1},
                          Shape{{200, 4, 128, 2, 80, 64}, 2}, Shape{{256, 3, 48, 1, 16, 256}, 3},
                          Shape{{160, 2, 128, 1, 128, 64}, 2}}) {
    for (bool records : {true, false}) {
      // k = 0: the reference; 1: fused; 2: fused with the intra-chunk backward's WMMA kernel (CUDA builds only)
      std::vector<std::vector<double>> grads[3];
      const bool kernels = ssd_fused::fits(int(sh.P), int(sh.N), int(sh.Q));
      // one record a row: the native kernels' unmasked path for tile pairs below the diagonal (CUDA builds)
      if (!records && !kernels) continue;
      for (int k = 0; k < (kernels ? 3 : 2); ++k) {
        Case c = sh.to_case();
        c.records = records;
        c.dt_lo = 0.02;
        c.algo = k == 0 ? SSDAlgo::gemm : SSDAlgo::fused;
        c.compute = k == 0 ? GemmCompute::fp32 : GemmCompute::bf16;
        c.workspace = head_budget(c, k >= 1 && kernels, sh.workspace_heads);
        const ssd_fused::FormScope form(ssd_fused::intra_form, k == 2 ? ssd_fused::Form::wmma : ssd_fused::Form::mma);
        grads[k] = backward_grads(Data<float>(c));
      }
      for (int k = 1; k < (kernels ? 3 : 2); ++k)
        for (std::size_t i = 0; i < grads[0].size(); ++i) {
          INFO("P=" << sh.P << " N=" << sh.N << " Q=" << sh.Q << " records=" << records << " gradient " << i
                    << (k == 2 ? " (WMMA form)" : ""));
          // per-token gradients (dxbc, ddt) to bf16 rounding; the parameter sums over all tokens get some
          // cancellation
          CHECK(rel_err(grads[k][i], grads[0][i]) < (i < 2 ? 2e-2 : 5e-2));
        }
    }
  }
  if (ssd_fused::fits(64, 128, 256)) {  // CUDA builds: both forms of the state epilogue ran above
    CHECK(ssd_fused::epilogue_writes_wdecay(64, 128));
    CHECK(ssd_fused::epilogue_writes_wdecay(128, 80));
    CHECK_FALSE(ssd_fused::epilogue_writes_wdecay(128, 128));
  }
}

TEST_CASE("SSD backward from the forward's kept intermediates equals the recomputing backward", "[ssd][gradcheck]") {
  // gemm: the kept arrays are what the backward would form again, so the gradients agree to the last bits; fused
  // (CUDA): the forward's chunk states come from its bf16 tensor-core kernel where the recompute uses a tf32 GEMM,
  // so to bf16 rounding. portable keeps nothing. A kept set of another shape is refused.
  for (SSDAlgo algo : {SSDAlgo::portable, SSDAlgo::gemm, SSDAlgo::fused}) {
    Case c;
    c.L = 300;
    c.H = 4;
    c.P = 16;
    c.G = 2;
    c.N = 32;
    c.Q = 64;
    c.dt_lo = 0.02;
    c.algo = algo;
    c.compute = algo == SSDAlgo::fused ? GemmCompute::bf16 : GemmCompute::fp32;
    INFO("algo " << algo_name(algo));
    Data<float> d(c);
    View2<float> y("y", c.B * c.L, c.H * c.P);
    PoolScope pool;
    SSDSaved<float> kept;
    ssd_forward<float>(d.shape, d.in(), y, View4<float>(), &kept, &pool);
    if (algo == SSDAlgo::portable) {
      CHECK(kept.empty());
      continue;
    }
    REQUIRE_FALSE(kept.empty());
    const auto recomputed = backward_grads(d);
    const auto from_kept = backward_grads(d, &kept);
    const bool fused_kernels = algo == SSDAlgo::fused && ssd_fused::fits(int(c.P), int(c.N), int(c.Q));
    for (std::size_t i = 0; i < recomputed.size(); ++i) {
      INFO("gradient " << i);
      CHECK(rel_err(from_kept[i], recomputed[i]) < (fused_kernels ? 2e-2 : 1e-6));
    }
    Case other = c;
    other.L = 200;
    Data<float> d2(other);
    SSDGrad<float> g = d2.grads(false);
    View2<float> dy("dy", other.B * other.L, other.H * other.P);
    CHECK_THROWS_WITH(ssd_backward<float>(d2.shape, d2.in(), dy, View4<const float>(), g, &kept),
                      ContainsSubstring("kept forward intermediates do not match"));
  }
}

TEST_CASE("SSD dt_limit clamp matches the reference", "[ssd]") {
  for (SSDAlgo algo : kAlgos) {
    Case c;
    c.L = 50;
    c.dt_lo = 0.05;
    c.dt_hi = 0.3;
    c.algo = algo;
    check_forward<double>(c, 1e-12);
  }
}

TEST_CASE("SSD results do not depend on the chunk size (32, 64, 256) or the algorithm", "[ssd]") {
  std::vector<std::vector<double>> ys, fins;
  for (SSDAlgo algo : kAlgos)
  for (index_t Q : {32, 64, 256}) {
    Case c;
    c.algo = algo;
    c.L = 300;
    c.H = 2;
    c.P = 4;
    c.G = 1;
    c.N = 8;
    c.Q = Q;
    Data<double> d(c);
    View2<double> y("y", c.B * c.L, c.H * c.P);
    View4<double> fin("fin", c.B, c.H, c.P, c.N);
    ssd_forward<double>(d.shape, d.in(), y, fin);
    ys.push_back(to_vec(y));
    fins.push_back(to_vec(fin));
  }
  for (std::size_t i = 1; i < ys.size(); ++i) {
    INFO("run " << i << " (algo " << i / 3 << ", chunk " << i % 3 << ")");
    CHECK(rel_err(ys[i], ys[0]) < 1e-12);
    CHECK(rel_err(fins[i], fins[0]) < 1e-12);
  }
}

TEST_CASE("SSD packed records equal separate runs (seq_idx never leaks)", "[ssd]") {
  // One row holding records [0, 20) and [20, 45) against two separate single-record rows.
  const index_t L1 = 20, L2 = 25, L = L1 + L2, H = 2, P = 3, G = 1, N = 4;
  Case c;
  c.B = 1;
  c.L = L;
  c.H = H;
  c.P = P;
  c.G = G;
  c.N = N;
  c.Q = 16;
  c.init = false;
  c.records = false;
  Data<double> packed(c);
  packed.seq = Kokkos::View<std::int32_t**, Layout, Mem>("seq", 1, L);
  {
    auto h = Kokkos::create_mirror_view(packed.seq);
    for (index_t t = 0; t < L; ++t) h(0, t) = t < L1 ? 7 : 9;
    Kokkos::deep_copy(packed.seq, h);
  }
  View2<double> y("y", L, H * P);
  ssd_forward<double>(packed.shape, packed.in(), y, View4<double>());
  const auto yp = to_vec(y);
  const auto xbc = to_vec(packed.xbc), dt = to_vec(packed.dt);
  const index_t W = H * P + 2 * G * N;
  for (int part = 0; part < 2; ++part) {
    const index_t t0 = part == 0 ? 0 : L1, len = part == 0 ? L1 : L2;
    Case c2 = c;
    c2.L = len;
    Data<double> one(c2);
    Kokkos::deep_copy(one.A_log, packed.A_log);
    Kokkos::deep_copy(one.dt_bias, packed.dt_bias);
    Kokkos::deep_copy(one.D, packed.D);
    mmtest::from_vec(one.xbc, std::vector<double>(xbc.begin() + t0 * W, xbc.begin() + (t0 + len) * W));
    mmtest::from_vec(one.dt, std::vector<double>(dt.begin() + t0 * H, dt.begin() + (t0 + len) * H));
    View2<double> y1("y1", len, H * P);
    ssd_forward<double>(one.shape, one.in(), y1, View4<double>());
    const std::vector<double> expect(yp.begin() + t0 * H * P, yp.begin() + (t0 + len) * H * P);
    CHECK(rel_err(to_vec(y1), expect) < 1e-13);
  }
}

TEST_CASE("SSD backward matches finite differences for every input", "[ssd][gradcheck]") {
  for (SSDAlgo algo : kAlgos)
  for (index_t Q : {5, 8, 16}) {  // 6, 4 and 2 chunks (the state passing keeps 4 in flight)
    Case c;
    c.L = 29;
    c.Q = Q;
    c.algo = algo;
    c.dt_lo = 0.0;
    Data<double> d(c);
    View2<double> dy("dy", c.B * c.L, c.H * c.P);
    View4<double> dfin("dfin", c.B, c.H, c.P, c.N);
    fill_uniform(dy, 11);
    fill_uniform(dfin, 12);
    const auto dyv = to_vec(dy), dfv = to_vec(dfin);
    auto loss = [&]() {
      View2<double> y("y", c.B * c.L, c.H * c.P);
      View4<double> fin("fin", c.B, c.H, c.P, c.N);
      ssd_forward<double>(d.shape, d.in(), y, fin);
      return mmtest::dot(to_vec(y), dyv) + mmtest::dot(to_vec(fin), dfv);
    };
    SSDGrad<double> g = d.grads(true);
    ssd_backward<double>(d.shape, d.in(), dy, dfin, g);
    INFO("Q=" << Q << " algo=" << algo_name(algo));
    CHECK(fd_check(d.xbc, to_vec(g.dxbc), loss, 60).rel() < 1e-6);
    CHECK(fd_check(d.dt, to_vec(g.ddt), loss, 30).rel() < 1e-6);
    CHECK(fd_check(d.A_log, to_vec(g.dA_log), loss).rel() < 1e-6);
    CHECK(fd_check(d.dt_bias, to_vec(g.ddt_bias), loss).rel() < 1e-6);
    CHECK(fd_check(d.D, to_vec(g.dD), loss).rel() < 1e-6);
    CHECK(fd_check(d.init, to_vec(g.dinit_state), loss).rel() < 1e-6);
  }
}

TEST_CASE("SSD backward gives zero dt gradient where dt_limit clamps", "[ssd][gradcheck]") {
  Case c;
  c.L = 20;
  c.dt_lo = 0.2;
  c.dt_hi = 0.4;
  Data<double> d(c);
  View2<double> dy("dy", c.B * c.L, c.H * c.P);
  fill_uniform(dy, 13);
  SSDGrad<double> g = d.grads(false);
  ssd_backward<double>(d.shape, d.in(), dy, View4<const double>(), g);
  const auto dt = to_vec(d.dt), bias = to_vec(d.dt_bias), ddt = to_vec(g.ddt);
  int clamped = 0, free = 0;
  for (index_t r = 0; r < c.B * c.L; ++r)
    for (index_t h = 0; h < c.H; ++h) {
      const double sp = mmref::softplus(dt[r * c.H + h] + bias[h]);
      if (sp < c.dt_lo || sp > c.dt_hi) {
        ++clamped;
        CHECK(ddt[r * c.H + h] == 0.0);
      } else {
        ++free;
      }
    }
  CHECK(clamped > 0);
  CHECK(free > 0);
  auto loss = [&]() {
    View2<double> y("y", c.B * c.L, c.H * c.P);
    ssd_forward<double>(d.shape, d.in(), y, View4<double>());
    return mmtest::dot(to_vec(y), to_vec(dy));
  };
  CHECK(fd_check(d.dt, ddt, loss, 40).rel() < 1e-6);
}


TEST_CASE("SSD GEMM formulation: backward equals the portable kernels' (double)", "[ssd][gradcheck]") {
  // L a multiple of Q (one batched call over rows and chunks) and not (a shorter last chunk per row); records,
  // an initial state and a final-state gradient; dt_limit active on some tokens.
  for (index_t L : {64, 77})
    for (bool records : {true, false}) {
      std::vector<std::vector<double>> grads[2];
      for (int ai = 0; ai < 2; ++ai) {
        Case c;
        c.L = L;
        c.Q = 16;
        c.records = records;
        c.dt_lo = 0.05;
        c.algo = kAlgos[ai];
        grads[ai] = backward_grads(Data<double>(c));
      }
      for (std::size_t i = 0; i < grads[0].size(); ++i) {
        INFO("L=" << L << " records=" << records << " gradient " << i);
        CHECK(rel_err(grads[1][i], grads[0][i]) < 1e-12);
      }
    }
}

TEST_CASE("SSD GEMM formulation: blocks of heads never straddle a group", "[ssd]") {
  auto blocks = [](index_t H, index_t G, index_t fit) { return ssd_gemm_blocks(H, G, 100.0, 100.0 * fit + 50); };
  CHECK(blocks(24, 1, 8).heads == 8);   // part of the one group: 8 divides 24
  CHECK(blocks(24, 1, 7).heads == 6);   // 7 does not
  CHECK(blocks(24, 1, 100).heads == 24);
  CHECK(blocks(8, 4, 5).heads == 4);    // two whole groups of 2
  CHECK(blocks(8, 4, 5).runs == 2);
  CHECK(blocks(6, 2, 2).heads == 1);    // 2 does not divide 3 heads per group
  CHECK(blocks(6, 2, 0).heads == 1);    // at least one head
  CHECK(blocks(6, 2, 6).runs == 2);
}

TEST_CASE("SSD GEMM formulation: forward and backward do not depend on the workspace's blocks of heads", "[ssd][gradcheck]") {
  // Blocks of one head, of part of a group, of whole groups; groups of 1, 2 and 3 heads; a shorter last chunk.
  struct HG {
    index_t H, G;
  };
  for (HG hg : {HG{4, 2}, HG{4, 1}, HG{6, 2}, HG{6, 3}})
    for (index_t fit : {1, 2, 3, 4, 6}) {
      std::vector<std::vector<double>> out[2];
      for (int ai = 0; ai < 2; ++ai) {
        Case c;
        c.L = 45;
        c.Q = 16;
        c.H = hg.H;
        c.G = hg.G;
        c.dt_lo = 0.05;
        c.algo = kAlgos[ai];
        const index_t nc = (c.L + c.Q - 1) / c.Q;
        c.workspace = double(c.B * nc * c.Q * c.Q * sizeof(double)) * fit;
        Data<double> d(c);
        View2<double> y("y", c.B * c.L, c.H * c.P);
        View4<double> fin("fin", c.B, c.H, c.P, c.N);
        ssd_forward<double>(d.shape, d.in(), y, fin);
        out[ai] = {to_vec(y), to_vec(fin)};
        for (auto& gv : backward_grads(d)) out[ai].push_back(std::move(gv));
      }
      for (std::size_t i = 0; i < out[0].size(); ++i) {
        INFO("H=" << hg.H << " G=" << hg.G << " heads that fit " << fit << " output " << i);
        CHECK(rel_err(out[1][i], out[0][i]) < 1e-12);
      }
    }
}

TEST_CASE("SSD with per-token decays and weights equals the dt form, forward and backward (chain rule)",
          "[ssd][gradcheck]") {
  // log_decay = Delta A and weight = Delta, both given per token, must reproduce the dt form exactly; their
  // gradients, chained through Delta = softplus(dt + dt_bias) and A = -exp(A_log), must give its ddt, dA_log and
  // ddt_bias (Mamba-3 runs its SISO scan in this form).
  for (SSDAlgo algo : kAlgos) {
    Case c;
    c.L = 45;
    c.algo = algo;
    Data<double> d(c);
    const index_t rows = c.B * c.L;
    const auto dt = to_vec(d.dt), bias = to_vec(d.dt_bias), A_log = to_vec(d.A_log);
    View3<double> la("log_decay", c.B, c.H, c.L), w("weight", c.B, c.H, c.L);
    auto hla = Kokkos::create_mirror_view(la);
    auto hw = Kokkos::create_mirror_view(w);
    auto sp = [](double u) { return u > 20 ? u : std::log1p(std::exp(u)); };
    for (index_t b = 0; b < c.B; ++b)
      for (index_t h = 0; h < c.H; ++h)
        for (index_t t = 0; t < c.L; ++t) {
          const double delta = sp(dt[(b * c.L + t) * c.H + h] + bias[h]);
          hw(b, h, t) = delta;
          hla(b, h, t) = -std::exp(A_log[h]) * delta;
        }
    Kokkos::deep_copy(la, hla);
    Kokkos::deep_copy(w, hw);
    SSDIn<double> pin = d.in();
    pin.log_decay = la;
    pin.weight = w;
    INFO("algo " << algo_name(algo));
    View2<double> y("y", rows, c.H * c.P), yp("yp", rows, c.H * c.P);
    View4<double> fin("fin", c.B, c.H, c.P, c.N), finp("finp", c.B, c.H, c.P, c.N);
    ssd_forward<double>(d.shape, d.in(), y, fin);
    ssd_forward<double>(d.shape, pin, yp, finp);
    CHECK(rel_err(to_vec(yp), to_vec(y)) < 1e-12);
    CHECK(rel_err(to_vec(finp), to_vec(fin)) < 1e-12);

    View2<double> dy("dy", rows, c.H * c.P);
    View4<double> dfin("dfin", c.B, c.H, c.P, c.N);
    fill_uniform(dy, 21);
    fill_uniform(dfin, 22);
    SSDGrad<double> g = d.grads(true), gp = d.grads(true);
    gp.dlog_decay = View3<double>("dla", c.B, c.H, c.L);
    gp.dweight = View3<double>("dw", c.B, c.H, c.L);
    ssd_backward<double>(d.shape, d.in(), dy, dfin, g);
    ssd_backward<double>(d.shape, pin, dy, dfin, gp);
    CHECK(rel_err(to_vec(gp.dxbc), to_vec(g.dxbc)) < 1e-12);
    CHECK(rel_err(to_vec(gp.dD), to_vec(g.dD)) < 1e-12);
    CHECK(rel_err(to_vec(gp.dinit_state), to_vec(g.dinit_state)) < 1e-12);
    // the per-token form leaves the dt-form gradients alone
    auto all_zero = [](const std::vector<double>& v) {
      for (double x : v)
        if (x != 0) return false;
      return true;
    };
    CHECK(all_zero(to_vec(gp.ddt)));
    CHECK(all_zero(to_vec(gp.dA_log)));
    CHECK(all_zero(to_vec(gp.ddt_bias)));
    const auto dla = to_vec(gp.dlog_decay), dw = to_vec(gp.dweight);
    std::vector<double> ddt(rows * c.H), dA_log(c.H, 0.0), dbias(c.H, 0.0);
    for (index_t b = 0; b < c.B; ++b)
      for (index_t h = 0; h < c.H; ++h)
        for (index_t t = 0; t < c.L; ++t) {
          const index_t i = (b * c.H + h) * c.L + t;
          const double u = dt[(b * c.L + t) * c.H + h] + bias[h], A = -std::exp(A_log[h]);
          const double delta = sp(u), du = (dw[i] + dla[i] * A) / (1 + std::exp(-u));
          ddt[(b * c.L + t) * c.H + h] = du;
          dA_log[h] += dla[i] * delta * A;
          dbias[h] += du;
        }
    CHECK(rel_err(ddt, to_vec(g.ddt)) < 1e-10);
    CHECK(rel_err(dA_log, to_vec(g.dA_log)) < 1e-10);
    CHECK(rel_err(dbias, to_vec(g.ddt_bias)) < 1e-10);
  }
}

namespace {
// Per-token skip coefficients (batch, H, L) for d's shape, seeded.
template <class T>
View3<acc_t<T>> token_skip(const Data<T>& d) {
  View3<acc_t<T>> v("D_token", d.cs.B, d.cs.H, d.cs.L);
  fill_uniform(v, 31);
  return v;
}
}  // namespace

TEST_CASE("SSD per-token skip coefficient D_token: y gains D_token x, dx gains D_token dy, its gradient is dy . x",
          "[ssd][gradcheck]") {
  // y is linear in D_token, so against the same call without it the forward must differ by exactly D_token x and
  // the backward by D_token dy in dx, every other gradient unchanged, and dL/dD_token(b, h, t) = dy_t . x_t (h).
  for (SSDAlgo algo : kAlgos) {
    Case c;
    c.L = 45;
    c.algo = algo;
    INFO("algo " << algo_name(algo));
    Data<double> d(c);
    const index_t rows = c.B * c.L, E = c.H * c.P;
    const View3<double> dtok = token_skip(d);
    SSDIn<double> in_t = d.in();
    in_t.D_token = dtok;
    View2<double> y0("y0", rows, E), y1("y1", rows, E);
    View4<double> f0("f0", c.B, c.H, c.P, c.N), f1("f1", c.B, c.H, c.P, c.N);
    ssd_forward<double>(d.shape, d.in(), y0, f0);
    ssd_forward<double>(d.shape, in_t, y1, f1);
    const auto x = to_vec(d.xbc), dk = to_vec(dtok), v0 = to_vec(y0);
    const index_t ldx = index_t(d.xbc.extent(1));
    std::vector<double> want(v0);
    for (index_t b = 0; b < c.B; ++b)
      for (index_t t = 0; t < c.L; ++t)
        for (index_t h = 0; h < c.H; ++h)
          for (index_t p = 0; p < c.P; ++p)
            want[(b * c.L + t) * E + h * c.P + p] += dk[(b * c.H + h) * c.L + t] * x[(b * c.L + t) * ldx + h * c.P + p];
    CHECK(rel_err(to_vec(y1), want) < 1e-12);
    CHECK(rel_err(to_vec(f1), to_vec(f0)) == 0.0);

    View2<double> dy("dy", rows, E);
    View4<double> dfin("dfin", c.B, c.H, c.P, c.N);
    fill_uniform(dy, 21);
    fill_uniform(dfin, 22);
    SSDGrad<double> g0 = d.grads(true), g1 = d.grads(true);
    g1.dD_token = View3<double>("dD_token", c.B, c.H, c.L);
    ssd_backward<double>(d.shape, d.in(), dy, dfin, g0);
    ssd_backward<double>(d.shape, in_t, dy, dfin, g1);
    const auto dyv = to_vec(dy);
    std::vector<double> dx_want = to_vec(g0.dxbc), ddot(c.B * c.H * c.L, 0.0);
    for (index_t b = 0; b < c.B; ++b)
      for (index_t t = 0; t < c.L; ++t)
        for (index_t h = 0; h < c.H; ++h)
          for (index_t p = 0; p < c.P; ++p) {
            const index_t r = b * c.L + t;
            dx_want[r * ldx + h * c.P + p] += dk[(b * c.H + h) * c.L + t] * dyv[r * E + h * c.P + p];
            ddot[(b * c.H + h) * c.L + t] += dyv[r * E + h * c.P + p] * x[r * ldx + h * c.P + p];
          }
    CHECK(rel_err(to_vec(g1.dxbc), dx_want) < 1e-12);
    CHECK(rel_err(to_vec(g1.dD_token), ddot) < 1e-12);
    CHECK(rel_err(to_vec(g1.ddt), to_vec(g0.ddt)) < 1e-12);
    CHECK(rel_err(to_vec(g1.dA_log), to_vec(g0.dA_log)) < 1e-12);
    CHECK(rel_err(to_vec(g1.ddt_bias), to_vec(g0.ddt_bias)) < 1e-12);
    CHECK(rel_err(to_vec(g1.dD), to_vec(g0.dD)) < 1e-12);
    CHECK(rel_err(to_vec(g1.dinit_state), to_vec(g0.dinit_state)) < 1e-12);

    SSDIn<double> bad = d.in();
    bad.D_token = View3<double>("short", c.B, c.H, c.L - 1);
    CHECK_THROWS_WITH(ssd_forward<double>(d.shape, bad, y1, f1), ContainsSubstring("D_token must be (batch, nheads"));
  }
}

TEST_CASE("SSD fused backward's one-kernel dB and dC (BcForm::kernel) equal the fp32 GEMM formulation's",
          "[ssd][gradcheck]") {
  // ssd_fused::bc_backward with one head a group and with groups of 2 and 3 heads: a short last chunk, chunks of
  // 128 and 256 (the intra-chunk term over several 64-token slices), d_state 160 (a second, partial block of 128
  // columns) and 80, headdim 16 to 128, records, an initial state, blocks of heads after the first (h0 > 0), and a
  // workspace that splits a group (where the GEMM form is kept); the recomputing backward and the one from the
  // forward's kept intermediates. Each against the gemm algorithm in fp32 (tied to finite differences by the
  // double tests) and against the fused backward with the GEMM form. On host builds every side is the GEMM
  // formulation in fp32.
  using Shape = BlockedShape;
  for (const Shape& sh : {Shape{{300, 4, 16, 4, 32, 64}, 8}, Shape{{333, 2, 64, 2, 128, 128}, 1},
                          Shape{{200, 3, 128, 3, 160, 64}, 2}, Shape{{256, 2, 48, 2, 80, 256}, 1},
                          Shape{{300, 4, 16, 2, 32, 64}, 8}, Shape{{200, 4, 128, 2, 160, 64}, 2},
                          Shape{{256, 3, 48, 1, 80, 256}, 3}, Shape{{300, 4, 16, 2, 32, 64}, 1}}) {
    for (bool records : {true, false})
      for (bool kept : {false, true}) {
        const bool kernels = ssd_fused::fits(int(sh.P), int(sh.N), int(sh.Q));
        std::vector<std::vector<double>> grads[3];  // 0: gemm fp32; 1: fused, dB dC by GEMMs; 2: by bc_backward
        for (int k = 0; k < 3; ++k) {
          Case c = sh.to_case();
          c.records = records;
          c.dt_lo = 0.02;
          c.algo = k == 0 ? SSDAlgo::gemm : SSDAlgo::fused;
          c.compute = k == 0 ? GemmCompute::fp32 : GemmCompute::bf16;
          c.workspace = head_budget(c, kernels && k > 0, sh.workspace_heads);
          const ssd_fused::FormScope form(ssd_fused::bc_form,
                                          k == 2 ? ssd_fused::BcForm::kernel : ssd_fused::BcForm::gemm);
          Data<float> d(c);
          if (!kept) {
            grads[k] = backward_grads(d);
            continue;
          }
          View2<float> y("y", c.B * c.L, c.H * c.P);
          PoolScope pool;
          SSDSaved<float> sv;
          ssd_forward<float>(d.shape, d.in(), y, View4<float>(), &sv, &pool);
          grads[k] = backward_grads(d, &sv);
        }
        for (int k = 1; k < 3; ++k)
          for (std::size_t i = 0; i < grads[0].size(); ++i) {
            INFO("P=" << sh.P << " G=" << sh.G << " N=" << sh.N << " Q=" << sh.Q << " records=" << records
                      << " kept=" << kept << " workspace heads " << sh.workspace_heads << " gradient " << i
                      << (k == 2 ? " (bc_backward)" : " (GEMM dB, dC)"));
            CHECK(rel_err(grads[k][i], grads[0][i]) < (i < 2 ? 2e-2 : 5e-2));
          }
        // the two fused forms differ only in how dB and dC are formed (bf16 operands against tf32 GEMMs)
        for (std::size_t i = 0; i < grads[1].size(); ++i) {
          INFO("P=" << sh.P << " G=" << sh.G << " N=" << sh.N << " Q=" << sh.Q << " records=" << records
                    << " kept=" << kept << " workspace heads " << sh.workspace_heads << " gradient " << i
                    << ", bc_backward against the GEMM form");
          CHECK(rel_err(grads[2][i], grads[1][i]) < (i < 2 ? 2e-2 : 5e-2));
        }
      }
  }
  // the kernel asks for runs of whole groups
  if (ssd_fused::fits(16, 32, 64)) {
    ssd_fused::Args a;
    a.H = 4;
    a.G = 2;
    a.P = 16;
    a.N = 32;
    a.Q = 64;
    a.nh = 4;
    a.run_len = 1;
    CHECK_THROWS_WITH(ssd_fused::bc_backward(a), ContainsSubstring("runs of whole groups"));
  }
}

TEST_CASE("SSD fused backward: BcForm::automatic takes the one-kernel dB and dC for one head a group only", "[ssd]") {
  using ssd_fused::BcForm;
  CHECK(ssd_fused::bc_form == BcForm::automatic);  // the default
  {
    const ssd_fused::FormScope form(ssd_fused::bc_form, BcForm::automatic);
    CHECK(ssd_fused::bc_kernel_for(1));
    CHECK_FALSE(ssd_fused::bc_kernel_for(2));
    CHECK_FALSE(ssd_fused::bc_kernel_for(24));
  }
  {
    const ssd_fused::FormScope form(ssd_fused::bc_form, BcForm::gemm);
    CHECK_FALSE(ssd_fused::bc_kernel_for(1));
  }
  {
    const ssd_fused::FormScope form(ssd_fused::bc_form, BcForm::kernel);
    CHECK(ssd_fused::bc_kernel_for(24));
  }
  CHECK(ssd_fused::bc_form == BcForm::automatic);  // restored
}

TEST_CASE("SSD fused tensor-core kernels with D_token equal the fp32 GEMM formulation's within bf16 rounding",
          "[ssd][gradcheck]") {
  // The chunk scan's three forms and the state epilogue's two (headdim 128 with d_state 128 takes the per-tile
  // one) add D_token per row, and the epilogue gives its gradient in fp32; on host builds both sides are the GEMM
  // formulation in fp32.
  for (const FusedShape& sh : {FusedShape{300, 4, 16, 2, 32, 64}, FusedShape{333, 2, 64, 1, 128, 128},
                               FusedShape{160, 2, 128, 1, 128, 64}}) {
    const bool kernels = ssd_fused::fits(int(sh.P), int(sh.N), int(sh.Q));
    std::vector<double> ref[4];
    for (int k = 0; k < (kernels ? 4 : 2); ++k) {  // 0 gemm fp32; 1 fused (mma); 2 WMMA scan; 3 ring scan
      Case c = sh.to_case();
      c.dt_lo = 0.02;
      c.algo = k == 0 ? SSDAlgo::gemm : SSDAlgo::fused;
      c.compute = k == 0 ? GemmCompute::fp32 : GemmCompute::bf16;
      const ssd_fused::FormScope form(ssd_fused::scan_form, k == 2   ? ssd_fused::Form::wmma
                                                            : k == 3 ? ssd_fused::Form::mma_ring
                                                                     : ssd_fused::Form::mma);
      Data<float> d(c);
      const index_t rows = c.B * c.L;
      SSDIn<float> in = d.in();
      const View3<float> dtok = token_skip(d);
      in.D_token = dtok;
      View2<float> y("y", rows, c.H * c.P), dy("dy", rows, c.H * c.P);
      ssd_forward<float>(d.shape, in, y, View4<float>());
      fill_uniform(dy, 21);
      SSDGrad<float> g = d.grads(false);
      g.dD_token = View3<float>("dD_token", c.B, c.H, c.L);
      ssd_backward<float>(d.shape, in, dy, View4<const float>(), g);
      const std::vector<double> got[4] = {to_vec(y), to_vec(g.dxbc), to_vec(g.dD_token), to_vec(g.dD)};
      INFO("P=" << sh.P << " N=" << sh.N << " Q=" << sh.Q << " variant " << k);
      for (int i = 0; i < 4; ++i) {
        if (k == 0) {
          ref[i] = got[i];
          continue;
        }
        INFO("output " << i);
        // y and dx to bf16 rounding; dD_token (and so dD) from fp32 products of the same fp32 inputs
        CHECK(rel_err(got[i], ref[i]) < (i < 2 ? 2e-2 : 1e-4));
      }
    }
  }
}

namespace {
// The runs of the own-x and own-dx tests: portable and gemm in double, fused in float at a shape its kernels take
// (CUDA builds; elsewhere gemm).
struct OwnRun {
  SSDAlgo algo;
  bool fused_shape;
};
constexpr OwnRun kOwnRuns[] = {{SSDAlgo::portable, false}, {SSDAlgo::gemm, false}, {SSDAlgo::fused, true}};
Case own_case(const OwnRun& run) {
  Case c;
  if (run.fused_shape) c = FusedShape{300, 4, 16, 2, 32, 64}.to_case();
  c.dt_lo = 0.02;
  c.algo = run.algo;
  c.compute = run.algo == SSDAlgo::fused ? GemmCompute::bf16 : GemmCompute::fp32;
  return c;
}
// g0's dxbc (x in its first E columns) against g1's dx given as a matrix of its own (x from column off): the x
// gradients of both, the other dxbc columns of both, and whether g1's dxbc x columns were left at zero.
struct DxSplit {
  std::vector<double> x0, x1, rest0, rest1;
  bool untouched = true;
};
template <class T>
DxSplit split_dx(const SSDGrad<T>& g0, const SSDGrad<T>& g1, index_t E, index_t off) {
  const auto a = to_vec(g0.dxbc), b = to_vec(g1.dxbc), own = to_vec(g1.dx);
  const index_t ld = index_t(g0.dxbc.extent(1)), lo = index_t(g1.dx.extent(1)), rows = index_t(g0.dxbc.extent(0));
  DxSplit s;
  for (index_t r = 0; r < rows; ++r)
    for (index_t j = 0; j < ld; ++j) {
      if (j < E) {
        s.x0.push_back(a[r * ld + j]);
        s.x1.push_back(own[r * lo + off + j]);
        s.untouched = s.untouched && b[r * ld + j] == 0.0;
      } else {
        s.rest0.push_back(a[r * ld + j]);
        s.rest1.push_back(b[r * ld + j]);
      }
    }
  return s;
}
}  // namespace

namespace {
// The sequential kernels' test shapes (headdim 64, chunk 64): a short last chunk, two heads a group and one, d_state
// 128 and 64; and their case at variant v (0 and 2: packed records and an initial state; 1: neither) under bf16.
const FusedShape kSeqShapes[] = {FusedShape{300, 2, 64, 1, 128, 64}, FusedShape{333, 3, 64, 3, 64, 64},
                                 FusedShape{64, 2, 64, 2, 128, 64}};
Case seq_case(const FusedShape& sh, int variant) {
  Case c = sh.to_case();
  c.algo = SSDAlgo::fused;
  c.compute = GemmCompute::bf16;
  c.dt_lo = 0.02;
  c.records = c.init = variant != 1;
  return c;
}
}  // namespace

TEST_CASE("SSD fused sequential forward (one block walking a row's chunks) equals the chunked kernels' within bf16 rounding",
          "[ssd][gradcheck]") {
  // ssd_fused::scan_seq against the chunked fused kernels (FwdForm::chunks) on shapes it takes (headdim 64, chunk
  // 64): a short last chunk, packed records and an initial state, with and without D_token; groups of two heads (C
  // B^T written by each group's first head) and one head a group; d_state 128 and 64. Compared: y, the final state,
  // the kept S_in and C B^T, and every gradient of a backward from the kept intermediates; and y and the final state
  // against the double recurrence (check_forward). Host builds have no such kernel: seq_fits is false there.
  using ssd_fused::FwdForm;
  CHECK(ssd_fused::fwd_form == FwdForm::automatic);  // the default
  if (!ssd_fused::seq_fits(64, 128, 64)) {
    CHECK(std::string(Exec::name()) != "Cuda");
    CHECK_FALSE(ssd_fused::seq_fits(64, 64, 64));
    return;
  }
  CHECK_FALSE(ssd_fused::seq_fits(64, 128, 128));
  CHECK_FALSE(ssd_fused::seq_fits(32, 128, 64));
  for (const FusedShape& sh : kSeqShapes) {
    for (int variant = 0; variant < 3; ++variant) {  // 0 records + init, 1 neither, 2 records + init + D_token
      Case c = seq_case(sh, variant);
      INFO("L=" << sh.L << " H=" << sh.H << " G=" << sh.G << " N=" << sh.N << " variant " << variant);
      if (variant < 2) {
        const ssd_fused::FormScope form(ssd_fused::fwd_form, FwdForm::sequential);
        const long before = ssd_fused::seq_launches();
        check_forward<float>(c, 2e-2);
        CHECK(ssd_fused::seq_launches() == before + 1);
      }
      Data<float> d(c);
      SSDIn<float> in = d.in();
      if (variant == 2) in.D_token = token_skip(d);
      std::vector<double> out[2][10];
      for (int k = 0; k < 2; ++k) {  // 0 chunks, 1 sequential
        const ssd_fused::FormScope form(ssd_fused::fwd_form, k ? FwdForm::sequential : FwdForm::chunks);
        const long before = ssd_fused::seq_launches();
        View2<float> y("y", c.B * c.L, c.H * c.P);
        View4<float> fin("fin", c.B, c.H, c.P, c.N);
        PoolScope pool;
        SSDSaved<float> kept;
        ssd_forward<float>(d.shape, in, y, fin, &kept, &pool);
        CHECK(ssd_fused::seq_launches() == before + k);
        REQUIRE_FALSE(kept.empty());
        View2<float> dy("dy", c.B * c.L, c.H * c.P);
        View4<float> dfin("dfin", c.B, c.H, c.P, c.N);
        fill_uniform(dy, 21);
        fill_uniform(dfin, 22);
        SSDGrad<float> g = d.grads(true);
        if (variant == 2) g.dD_token = View3<float>("dD_token", c.B, c.H, c.L);
        ssd_backward<float>(d.shape, in, dy, dfin, g, &kept);
        // C B^T of the tokens inside each chunk (past a short last chunk's end the forms leave different values)
        std::vector<double> cb;
        {
          const auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), kept.cb);
          for (index_t b = 0; b < index_t(h.extent(0)); ++b)
            for (index_t ch = 0; ch < index_t(h.extent(1)); ++ch) {
              const index_t q = std::min(c.Q, c.L - ch * c.Q);
              for (index_t gi = 0; gi < index_t(h.extent(2)); ++gi)
                for (index_t l = 0; l < q; ++l)
                  for (index_t s2 = 0; s2 < q; ++s2) cb.push_back(h(b, ch, gi, l, s2));
            }
        }
        const std::vector<double> got[10] = {to_vec(y),        to_vec(fin),        to_vec(kept.states),
                                             cb,               to_vec(g.dxbc),     to_vec(g.ddt),
                                             to_vec(g.dA_log), to_vec(g.ddt_bias), to_vec(g.dD),
                                             to_vec(g.dinit_state)};
        for (int i = 0; i < 10; ++i) out[k][i] = got[i];
      }
      for (int i = 0; i < 10; ++i) {
        INFO("output " << i << " (y, final state, S_in, C B^T, dxbc, ddt, dA_log, ddt_bias, dD, dinit)");
        // C B^T in tf32 on both sides; the rest through bf16 operands
        CHECK(rel_err(out[1][i], out[0][i]) < (i == 3 ? 2e-3 : 2e-2));
      }
    }
  }
  CHECK(ssd_fused::fwd_form == FwdForm::automatic);  // restored
}

TEST_CASE("SSD fused sequential backward state terms (blocks walking a row's chunks back) equal the chunked "
          "kernels' within bf16 rounding",
          "[ssd][gradcheck]") {
  // Under bc_backward (BcForm::kernel, where these forms apply), against chunk_state (ein_weights) + the reverse
  // state passing + state_epilogue (BwdStateForm::chunks): dstates_seq + state_epilogue (dstates) and
  // state_bwd_seq (sequential); a short last chunk, packed records, an initial state and a final state's gradient,
  // with and without D_token (which also takes the fp32 dY . X); one head a group and groups of two; d_state 128
  // and 64; the SSD's heads in one block and (a workspace budget of one head) in blocks of one. Compared: every
  // gradient, dinit included. Host builds have neither kernel: dseq_fits and sbseq_fits are false there.
  using ssd_fused::BwdStateForm;
  CHECK(ssd_fused::bwd_state_form == BwdStateForm::automatic);  // the default
  if (!ssd_fused::dseq_fits(64, 128, 64)) {
    CHECK(std::string(Exec::name()) != "Cuda");
    CHECK_FALSE(ssd_fused::dseq_fits(64, 64, 64));
    CHECK_FALSE(ssd_fused::sbseq_fits(64, 128, 64));
    return;
  }
  CHECK(ssd_fused::dseq_fits(64, 192, 64));
  CHECK_FALSE(ssd_fused::dseq_fits(64, 128, 128));
  CHECK_FALSE(ssd_fused::dseq_fits(32, 128, 64));
  CHECK_FALSE(ssd_fused::dseq_fits(64, 96, 64));
  CHECK(ssd_fused::sbseq_fits(64, 64, 64));
  CHECK_FALSE(ssd_fused::sbseq_fits(64, 192, 64));
  CHECK_FALSE(ssd_fused::sbseq_fits(64, 128, 128));
  const ssd_fused::FormScope bc(ssd_fused::bc_form, ssd_fused::BcForm::kernel);
  for (const FusedShape& sh : kSeqShapes) {
    for (int variant = 0; variant < 4; ++variant) {
      // 0 records + init, 1 neither, 2 records + init + D_token, 3 as 0 in blocks of one head (one a group)
      if (variant == 3 && sh.G != sh.H) continue;
      Case c = seq_case(sh, variant);
      INFO("L=" << sh.L << " H=" << sh.H << " G=" << sh.G << " N=" << sh.N << " variant " << variant);
      if (variant == 3) c.workspace = head_budget(c, true, 1);
      Data<float> d(c);
      SSDIn<float> in = d.in();
      if (variant == 2) in.D_token = token_skip(d);
      View2<float> y("y", c.B * c.L, c.H * c.P);
      View4<float> fin("fin", c.B, c.H, c.P, c.N);
      PoolScope pool;
      SSDSaved<float> kept;
      ssd_forward<float>(d.shape, in, y, fin, &kept, &pool);
      REQUIRE_FALSE(kept.empty());
      View2<float> dy("dy", c.B * c.L, c.H * c.P);
      View4<float> dfin("dfin", c.B, c.H, c.P, c.N);
      fill_uniform(dy, 21);
      fill_uniform(dfin, 22);
      std::vector<double> out[3][7];
      for (int k = 0; k < 3; ++k) {  // 0 chunks, 1 dstates, 2 sequential
        const BwdStateForm f = std::array{BwdStateForm::chunks, BwdStateForm::dstates, BwdStateForm::sequential}[k];
        const ssd_fused::FormScope form(ssd_fused::bwd_state_form, f);
        const long before = ssd_fused::dseq_launches(), sb_before = ssd_fused::sbseq_launches();
        SSDGrad<float> g = d.grads(true);
        if (variant == 2) g.dD_token = View3<float>("dD_token", c.B, c.H, c.L);
        ssd_backward<float>(d.shape, in, dy, variant == 1 ? View4<float>() : dfin, g, &kept);
        CHECK(ssd_fused::dseq_launches() == before + (k == 1 ? 1 : 0));
        if (k == 2) CHECK(ssd_fused::sbseq_launches() > sb_before);  // one a block of heads
        else CHECK(ssd_fused::sbseq_launches() == sb_before);
        const std::vector<double> got[7] = {to_vec(g.dxbc),     to_vec(g.ddt), to_vec(g.dA_log),
                                            to_vec(g.ddt_bias), to_vec(g.dD),  to_vec(g.dinit_state),
                                            variant == 2 ? to_vec(g.dD_token) : std::vector<double>{}};
        for (int i = 0; i < 7; ++i) out[k][i] = got[i];
      }
      for (int k = 1; k < 3; ++k)
        for (int i = 0; i < 7; ++i) {
          INFO("form " << k << " (dstates, sequential), output " << i
                       << " (dxbc, ddt, dA_log, ddt_bias, dD, dinit, dD_token)");
          REQUIRE(out[k][i].size() == out[0][i].size());
          if (!out[0][i].empty()) CHECK(rel_err(out[k][i], out[0][i]) < 1e-2);
        }
    }
  }
  CHECK(ssd_fused::bwd_state_form == BwdStateForm::automatic);  // restored
}

TEST_CASE("SSD backward writes dx into a matrix of its own when given, the same values", "[ssd][gradcheck]") {
  // SSDGrad::dx (Mamba-3 has its dv written straight into the in_proj gradient): dx at column dx_col + h P of the
  // given matrix equals the x columns of dxbc in a call without it, which are then left untouched; every other
  // gradient is the same. Double on portable and gemm (exactly), float on fused at a shape its kernels take (CUDA
  // builds; elsewhere gemm) to the last bits, since only the destination changes.
  for (const OwnRun& run : kOwnRuns) {
    const Case c = own_case(run);
    INFO("algo " << algo_name(run.algo));
    auto grads = [&](auto tag) {
      using T = decltype(tag);
      Data<T> d(c);
      const index_t rows = c.B * c.L, E = c.H * c.P, off = 4;
      View2<T> dy("dy", rows, E);
      fill_uniform(dy, 21);
      SSDGrad<T> g0 = d.grads(true), g1 = d.grads(true);
      g1.dx = View2<T>("dx_own", rows, off + E + 4);  // rows 16-byte aligned: the same kernels as dxbc
      g1.dx_col = off;
      ssd_backward<T>(d.shape, d.in(), dy, View4<const acc_t<T>>(), g0);
      ssd_backward<T>(d.shape, d.in(), dy, View4<const acc_t<T>>(), g1);
      const DxSplit sp = split_dx(g0, g1, E, off);
      CHECK(sp.untouched);
      CHECK(rel_err(sp.x1, sp.x0) == 0.0);
      CHECK(rel_err(sp.rest1, sp.rest0) == 0.0);
      CHECK(rel_err(to_vec(g1.ddt), to_vec(g0.ddt)) == 0.0);
      CHECK(rel_err(to_vec(g1.dD), to_vec(g0.dD)) == 0.0);
      CHECK(rel_err(to_vec(g1.dinit_state), to_vec(g0.dinit_state)) == 0.0);
      SSDGrad<T> bad = d.grads(false);
      bad.dx = View2<T>("dx_short", rows, E);
      bad.dx_col = 1;
      CHECK_THROWS_WITH(ssd_backward<T>(d.shape, d.in(), dy, View4<const acc_t<T>>(), bad),
                        ContainsSubstring("dx must have batch * seqlen rows"));
    };
    if (run.fused_shape)
      grads(float{});
    else
      grads(double{});
  }
}

namespace {
// The values of a bf16 operand array (bf16 on CUDA builds, bf16-rounded floats elsewhere), row-major.
std::vector<double> bf16_values(const View2<bf16_op_t>& v) {
  const auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  std::vector<double> out;
  for (std::size_t i = 0; i < h.extent(0); ++i)
    for (std::size_t j = 0; j < h.extent(1); ++j) out.push_back(from_bf16_op(h(i, j)));
  return out;
}
}  // namespace

TEST_CASE("SSD backward writes dB and dC in bf16 where given dbc_bf16: the fp32 call's values rounded",
          "[ssd][gradcheck]") {
  // SSDGrad::dbc_bf16 (Mamba-3's per-head dq~ and dk~ for its rotation backward): where ssd_bc_bf16_applies (CUDA
  // builds: fused, bf16 arithmetic, one head a group, dB and dC by ssd_fused::bc_backward) dB and dC there are the
  // fp32 call's B and C columns of dxbc rounded to bf16 (the same accumulators; only the store differs), dxbc's B
  // and C columns are left at zero and every other gradient is the same to the last bit. Where it does not apply
  // (the GEMM form of dB and dC; host builds) the call refuses dbc_bf16.
  for (const FusedShape& sh : {FusedShape{300, 4, 16, 4, 32, 64}, FusedShape{333, 2, 64, 2, 128, 64}})
    for (const bool gemm_form : {false, true}) {
      Case c = sh.to_case();
      c.dt_lo = 0.02;
      c.algo = SSDAlgo::fused;
      c.compute = GemmCompute::bf16;
      const ssd_fused::FormScope form(ssd_fused::bc_form,
                                      gemm_form ? ssd_fused::BcForm::gemm : ssd_fused::BcForm::automatic);
      INFO("P=" << sh.P << " N=" << sh.N << (gemm_form ? ", dB and dC by GEMMs" : ""));
      Data<float> d(c);
      const bool applies = ssd_bc_bf16_applies(d.shape);
      CHECK(applies == (!gemm_form && ssd_fused::fits(int(sh.P), int(sh.N), int(sh.Q))));
      const index_t rows = c.B * c.L, E = c.H * c.P, ld = index_t(d.xbc.extent(1));
      View2<float> dy("dy", rows, E);
      fill_uniform(dy, 23);
      SSDGrad<float> g0 = d.grads(true), g1 = d.grads(true);
      g1.dbc_bf16 = View2<bf16_op_t>("dbc_bf16", rows, ld);
      ssd_backward<float>(d.shape, d.in(), dy, View4<const float>(), g0);
      if (!applies) {
        CHECK_THROWS_WITH(ssd_backward<float>(d.shape, d.in(), dy, View4<const float>(), g1),
                          ContainsSubstring("dbc_bf16 given where"));
        continue;
      }
      ssd_backward<float>(d.shape, d.in(), dy, View4<const float>(), g1);
      const auto a = to_vec(g0.dxbc), b = to_vec(g1.dxbc), h = bf16_values(g1.dbc_bf16);
      long x_diff = 0, bc_touched = 0, bc_off = 0;
      for (index_t r = 0; r < rows; ++r)
        for (index_t j = 0; j < ld; ++j) {
          const std::size_t i = std::size_t(r * ld + j);
          if (j < E) {
            x_diff += b[i] != a[i];
          } else {
            bc_touched += b[i] != 0.0;
            bc_off += h[i] != double(bf16_round(float(a[i])));
          }
        }
      CHECK(x_diff == 0);
      CHECK(bc_touched == 0);
      CHECK(bc_off == 0);
      CHECK(rel_err(to_vec(g1.ddt), to_vec(g0.ddt)) == 0.0);
      CHECK(rel_err(to_vec(g1.dA_log), to_vec(g0.dA_log)) == 0.0);
      CHECK(rel_err(to_vec(g1.ddt_bias), to_vec(g0.ddt_bias)) == 0.0);
      CHECK(rel_err(to_vec(g1.dD), to_vec(g0.dD)) == 0.0);
      CHECK(rel_err(to_vec(g1.dinit_state), to_vec(g0.dinit_state)) == 0.0);
    }
}

TEST_CASE("SSD reads B and C in bf16 where given bc_bf16: the results of B and C rounded to bf16, to the last bit",
          "[ssd][gradcheck]") {
  // SSDIn::bc_bf16 (Mamba-3's per-head k~ and q~ as its rotation stores them): where ssd_bc_in_bf16_applies (CUDA
  // builds: fused, bf16 arithmetic, one head a group, the sequential forward and backward state terms) the forward,
  // the kept S_in and C B^T, and every gradient of a backward from the kept context equal, bit for bit, those of the
  // fp32 call given B and C rounded to bf16: its kernels round B and C to bf16 or to tf32 for their products, and
  // both hold such values exactly. A short last chunk; packed records and an initial state, neither, and D_token;
  // d_state 128 and 64. Refused with an error: the chunked forward, the backward's other state-term forms, a
  // backward that recomputes, and every build or shape without those kernels (host builds here).
  using ssd_fused::BwdStateForm;
  using ssd_fused::FwdForm;
  for (const FusedShape& sh : {FusedShape{300, 2, 64, 2, 128, 64}, FusedShape{333, 3, 64, 3, 64, 64}})
    for (int variant = 0; variant < 3; ++variant) {  // 0 records + init, 1 neither, 2 records + init + D_token
      Case c = seq_case(sh, variant);
      INFO("L=" << sh.L << " H=" << sh.H << " N=" << sh.N << " variant " << variant);
      Data<float> d(c);
      const index_t rows = c.B * c.L, E = c.H * c.P, ld = index_t(d.xbc.extent(1));
      // B and C rounded to bf16: the fp32 call's xbc (x as it was) and the bf16 array (x columns unused)
      View2<float> xr("xbc_rounded", rows, ld);
      View2<bf16_op_t> bc16("bc_bf16", rows, ld);
      {
        auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), d.xbc);
        auto hb = Kokkos::create_mirror_view(bc16);
        for (index_t r = 0; r < rows; ++r)
          for (index_t j = 0; j < ld; ++j) {
            if (j >= E) h(r, j) = bf16_round(h(r, j));
            hb(r, j) = to_bf16_op(h(r, j));
          }
        Kokkos::deep_copy(xr, h);
        Kokkos::deep_copy(bc16, hb);
      }
      SSDIn<float> in0 = d.in();
      in0.xbc = xr;
      in0.x = xr;  // x from a matrix of its own in both calls (bc_bf16 needs it)
      if (variant == 2) in0.D_token = token_skip(d);
      SSDIn<float> in1 = in0;
      in1.xbc = View2<const float>();
      in1.bc_bf16 = bc16;
      View2<float> dy("dy", rows, E);
      View4<float> dfin("dfin", c.B, c.H, c.P, c.N);
      fill_uniform(dy, 21);
      fill_uniform(dfin, 22);
      if (!ssd_fused::seq_fits(64, 128, 64)) {  // host builds: no kernel reads bf16 B and C
        CHECK_FALSE(ssd_bc_in_bf16_applies(d.shape));
        View2<float> y("y", rows, E);
        CHECK_THROWS_WITH(ssd_forward<float>(d.shape, in1, y, View4<float>()),
                          ContainsSubstring("read by the fused kernels only"));
        continue;
      }
      // at 2 x 300 tokens the automatic forms take the chunked kernels (batch x heads short of the SMs)
      CHECK_FALSE(ssd_bc_in_bf16_applies(d.shape));
      const ssd_fused::FormScope fwd(ssd_fused::fwd_form, FwdForm::sequential);
      const ssd_fused::FormScope bwd(ssd_fused::bwd_state_form, BwdStateForm::sequential);
      REQUIRE(ssd_bc_in_bf16_applies(d.shape));
      std::vector<double> out[2][11];
      for (int k = 0; k < 2; ++k) {  // 0 fp32 (rounded), 1 bf16
        const SSDIn<float>& in = k ? in1 : in0;
        View2<float> y("y", rows, E);
        View4<float> fin("fin", c.B, c.H, c.P, c.N);
        PoolScope pool;
        SSDSaved<float> kept;
        ssd_forward<float>(d.shape, in, y, fin, &kept, &pool);
        REQUIRE_FALSE(kept.empty());
        SSDGrad<float> g = d.grads(true);
        g.dx = View2<float>("dx_own", rows, E);
        if (variant == 2) g.dD_token = View3<float>("dD_token", c.B, c.H, c.L);
        ssd_backward<float>(d.shape, in, dy, variant == 1 ? View4<float>() : dfin, g, &kept);
        const std::vector<double> got[11] = {
            to_vec(y),        to_vec(fin),        to_vec(kept.states), to_vec(kept.cb),
            to_vec(g.dxbc),   to_vec(g.dx),       to_vec(g.ddt),       to_vec(g.dA_log),
            to_vec(g.dD),     to_vec(g.dinit_state), variant == 2 ? to_vec(g.dD_token) : std::vector<double>{}};
        for (int i = 0; i < 11; ++i) out[k][i] = got[i];
        if (k == 1) {  // the refusals, on the bf16 call's inputs
          {
            const ssd_fused::FormScope chunks(ssd_fused::fwd_form, FwdForm::chunks);
            CHECK_THROWS_WITH(ssd_forward<float>(d.shape, in1, y, fin),
                              ContainsSubstring("bc_bf16 given where the sequential forward does not run"));
          }
          for (const BwdStateForm f : {BwdStateForm::chunks, BwdStateForm::dstates}) {
            const ssd_fused::FormScope other(ssd_fused::bwd_state_form, f);
            SSDGrad<float> g2 = d.grads(true);
            g2.dx = View2<float>("dx_own", rows, E);
            CHECK_THROWS_WITH(ssd_backward<float>(d.shape, in1, dy, dfin, g2, &kept),
                              ContainsSubstring("bc_bf16 given where the backward's state terms"));
          }
          SSDGrad<float> g3 = d.grads(true);
          g3.dx = View2<float>("dx_own", rows, E);
          CHECK_THROWS_WITH(ssd_backward<float>(d.shape, in1, dy, dfin, g3),
                            ContainsSubstring("from the forward's kept context"));
        }
      }
      for (int i = 0; i < 11; ++i) {
        INFO("output " << i << " (y, final state, S_in, C B^T, dxbc, dx, ddt, dA_log, dD, dinit, dD_token)");
        REQUIRE(out[1][i].size() == out[0][i].size());
        long differ = 0;
        for (std::size_t j = 0; j < out[0][i].size(); ++j) differ += out[1][i][j] != out[0][i][j];
        INFO("where they differ, by how much: max |diff| / max |fp32 value| " << rel_err(out[1][i], out[0][i]));
        CHECK(differ == 0);
      }
    }
}

TEST_CASE("SSD reads x from a matrix of its own when given, the same results", "[ssd][gradcheck]") {
  // SSDIn::x (Mamba-3 has the SSD read its v out of the in_proj output): x at column x_col + h P of the given
  // matrix, with xbc's x columns zeroed so that a read of them would show, gives the forward and every gradient
  // of the call that reads x from xbc (dx then into a matrix of its own, which such a call must give). Double on
  // portable and gemm, float on fused at a shape its kernels take (CUDA builds; elsewhere gemm): only the source
  // changes, so exactly.
  for (const OwnRun& run : kOwnRuns) {
    const Case c = own_case(run);
    INFO("algo " << algo_name(run.algo));
    auto check = [&](auto tag) {
      using T = decltype(tag);
      using Pt = acc_t<T>;
      Data<T> d(c);
      const index_t rows = c.B * c.L, E = c.H * c.P, off = 4;
      // x moved into its own matrix (rows 16-byte aligned: the same kernels), xbc's copy zeroed
      View2<T> xo("x_own", rows, off + E + 4), xbc2("xbc2", rows, d.xbc.extent(1));
      Kokkos::deep_copy(xbc2, d.xbc);
      Kokkos::deep_copy(Kokkos::subview(xo, Kokkos::ALL, std::make_pair(off, off + E)),
                        Kokkos::subview(d.xbc, Kokkos::ALL, std::make_pair(index_t(0), E)));
      Kokkos::deep_copy(Kokkos::subview(xbc2, Kokkos::ALL, std::make_pair(index_t(0), E)), T(0));
      SSDIn<T> in1 = d.in();
      in1.xbc = xbc2;
      in1.x = xo;
      in1.x_col = off;
      View2<T> y0("y0", rows, E), y1("y1", rows, E), dy("dy", rows, E);
      View4<Pt> f0("f0", c.B, c.H, c.P, c.N), f1("f1", c.B, c.H, c.P, c.N);
      ssd_forward<T>(d.shape, d.in(), y0, f0);
      ssd_forward<T>(d.shape, in1, y1, f1);
      CHECK(rel_err(to_vec(y1), to_vec(y0)) == 0.0);
      CHECK(rel_err(to_vec(f1), to_vec(f0)) == 0.0);
      fill_uniform(dy, 21);
      SSDGrad<T> g0 = d.grads(true), g1 = d.grads(true);
      ssd_backward<T>(d.shape, d.in(), dy, View4<const Pt>(), g0);
      CHECK_THROWS_WITH(ssd_backward<T>(d.shape, in1, dy, View4<const Pt>(), g1),
                        ContainsSubstring("needs one for its gradient (SSDGrad::dx)"));
      g1.dx = View2<T>("dx_own", rows, off + E + 4);
      g1.dx_col = off;
      ssd_backward<T>(d.shape, in1, dy, View4<const Pt>(), g1);
      // dx in its own matrix, dB and dC where they were
      const DxSplit sp = split_dx(g0, g1, E, off);
      CHECK(sp.untouched);
      CHECK(rel_err(sp.x1, sp.x0) == 0.0);
      CHECK(rel_err(sp.rest1, sp.rest0) == 0.0);
      CHECK(rel_err(to_vec(g1.ddt), to_vec(g0.ddt)) == 0.0);
      CHECK(rel_err(to_vec(g1.dA_log), to_vec(g0.dA_log)) == 0.0);
      CHECK(rel_err(to_vec(g1.dD), to_vec(g0.dD)) == 0.0);
      CHECK(rel_err(to_vec(g1.dinit_state), to_vec(g0.dinit_state)) == 0.0);
      SSDIn<T> bad = in1;
      bad.x_col = 9;  // past the columns x has
      CHECK_THROWS_WITH(ssd_forward<T>(d.shape, bad, y1, f1), ContainsSubstring("x has"));
    };
    if (run.fused_shape)
      check(float{});
    else
      check(double{});
  }
}
