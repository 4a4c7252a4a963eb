// Mamba-3 (SISO and MIMO): the chunked scan against the token-by-token double recurrence and the chunked-form
// reference, the reduction to Mamba-2's SSD, finite-difference gradients of every scan input and mixer parameter,
// prefill + step decoding, windowed processing with a carried state, and configuration errors.
#include <cmath>
#include <string>
#include <vector>

#include "catch.hpp"
#include "reference/mamba3_ref.hpp"
#include "reference/ssd_ref.hpp"
#include "ssm/mamba2/ssd.hpp"
#include "ssm/mamba2/ssd_fused.hpp"
#include "ssm/mamba3/rotate_cuda.hpp"
#include "ssm/mamba3/mixer.hpp"
#include "ssm/mamba3/scan.hpp"
#include "util.hpp"

using namespace mm;
using mmtest::fd_check;
using mmtest::fill_uniform;
using mmtest::from_vec;
using mmtest::rel_err;
using mmtest::to_vec;

namespace {

struct M3Case {
  index_t B = 2, L = 23, H = 2, P = 3, G = 1, N = 6, R = 1, S = 2, Q = 8;
  bool halved = false, init = true;
  std::vector<int> seq;  // (B*L) record ids, or empty (one record per row)
  SSDAlgo algo = SSDAlgo::automatic;  // gemm / fused: SISO through the SSD kernels (fused is gemm on the CPU)
  GemmCompute compute = GemmCompute::fp32;
};

// Record ids for B rows of L tokens: row b starts a new record at each position of starts[b % starts.size()].
std::vector<int> make_records(index_t B, index_t L, const std::vector<std::vector<index_t>>& starts) {
  std::vector<int> seq(B * L);
  for (index_t b = 0; b < B; ++b) {
    const auto& st = starts[b % starts.size()];
    int id = int(100 * b);
    for (index_t t = 0; t < L; ++t) {
      for (index_t x : st)
        if (x == t && t > 0) ++id;
      seq[b * L + t] = id;
    }
  }
  return seq;
}

template <class T>
struct M3Data {
  using Pt = acc_t<T>;
  M3Case cs;
  Mamba3ScanShape shape;
  View2<T> v, qk, dd;
  View1<Pt> dt_bias, D, qb, kb;
  Mamba3Carry<Pt> init;
  Kokkos::View<std::int32_t**, Layout, Mem> seqv;

  explicit M3Data(const M3Case& c) : cs(c) {
    shape.batch = c.B;
    shape.seqlen = c.L;
    shape.nheads = c.H;
    shape.headdim = c.P;
    shape.ngroups = c.G;
    shape.dstate = c.N;
    shape.rank = c.R;
    shape.nangles = c.S;
    shape.chunk = c.Q;
    shape.pairing = c.halved ? RopePairing::halved : RopePairing::interleaved;
    shape.algo = c.algo;
    shape.compute = c.compute;
    const index_t rows = c.B * c.L, RGN = c.R * c.G * c.N;
    v = View2<T>("v", rows, c.H * c.R * c.P);
    qk = View2<T>("qk", rows, 2 * RGN);
    dd = View2<T>("dd", rows, 3 * c.H + c.S);
    dt_bias = View1<Pt>("dt_bias", c.H);
    D = View1<Pt>("D", c.H);
    qb = View1<Pt>("qb", c.H * c.R * c.N);
    kb = View1<Pt>("kb", c.H * c.R * c.N);
    fill_uniform(v, 1);
    fill_uniform(qk, 2);
    fill_uniform(dd, 3, -1.5, 1.0);
    fill_uniform(dt_bias, 4, -1.0, 0.0);
    fill_uniform(D, 5);
    fill_uniform(qb, 6, 0.5, 1.5);
    fill_uniform(kb, 7, 0.5, 1.5);
    if (c.init) {
      init = Mamba3Carry<Pt>::allocate("init", shape);
      fill_uniform(init.phi, 8, 0.5, 5.5);
      fill_uniform(init.S, 9);
      fill_uniform(init.k, 10);
      fill_uniform(init.v, 11);
    }
    if (!c.seq.empty()) {
      seqv = Kokkos::View<std::int32_t**, Layout, Mem>("seq", c.B, c.L);
      auto h = Kokkos::create_mirror_view(seqv);
      for (index_t b = 0; b < c.B; ++b)
        for (index_t t = 0; t < c.L; ++t) h(b, t) = c.seq[b * c.L + t];
      Kokkos::deep_copy(seqv, h);
    }
  }

  Mamba3ScanIn<T> in() const {
    Mamba3ScanIn<T> i;
    i.v = v;
    i.qk = qk;
    i.q_col = 0;
    i.k_col = cs.R * cs.G * cs.N;
    i.dd = dd;
    i.dt_col = 0;
    i.A_col = cs.H;
    i.trap_col = 2 * cs.H;
    i.angle_col = 3 * cs.H;
    i.dt_bias = dt_bias;
    i.D = D;
    i.q_bias = qb;
    i.k_bias = kb;
    i.init = init;
    i.seq_idx = seqv;
    return i;
  }

  mmref::M3Shape ref_shape() const {
    mmref::M3Shape s;
    s.B = cs.B;
    s.L = cs.L;
    s.H = cs.H;
    s.P = cs.P;
    s.G = cs.G;
    s.N = cs.N;
    s.R = cs.R;
    s.S = cs.S;
    s.halved = cs.halved;
    s.A_floor = shape.A_floor;
    s.seq = cs.seq;
    return s;
  }
  mmref::M3Carry ref_init() const {
    mmref::M3Carry c;
    if (cs.init) {
      c.phi = to_vec(init.phi);
      c.S = to_vec(init.S);
      c.k = to_vec(init.k);
      c.v = to_vec(init.v);
    }
    return c;
  }
  std::vector<double> reference(mmref::M3Carry* fin) const {
    return mmref::mamba3_scan_reference(ref_shape(), to_vec(v), to_vec(qk), to_vec(dd), to_vec(dt_bias), to_vec(D),
                                        to_vec(qb), to_vec(kb), ref_init(), fin);
  }
  // The backward tests' seeded output gradient (batch * seqlen, H R P) and final-carry gradient.
  View2<T> seeded_dy() const {
    View2<T> dy("dy", cs.B * cs.L, cs.H * cs.R * cs.P);
    fill_uniform(dy, 20);
    return dy;
  }
  Mamba3Carry<Pt> seeded_dfinal() const {
    auto dfin = Mamba3Carry<Pt>::allocate("dfin", shape);
    fill_uniform(dfin.phi, 21);
    fill_uniform(dfin.S, 22);
    fill_uniform(dfin.k, 23);
    fill_uniform(dfin.v, 24);
    return dfin;
  }
  // Zeroed gradients of every input, the initial carry included.
  Mamba3ScanGrad<T> zero_grads() const {
    const index_t rows = cs.B * cs.L, HRN = cs.H * cs.R * cs.N;
    Mamba3ScanGrad<T> g;
    g.dv = View2<T>("dv", rows, v.extent(1));
    g.dqk = View2<T>("dqk", rows, qk.extent(1));
    g.ddd = View2<T>("ddd", rows, dd.extent(1));
    g.ddt_bias = View1<Pt>("ddt_bias", cs.H);
    g.dD = View1<Pt>("dD", cs.H);
    g.dq_bias = View1<Pt>("dqb", HRN);
    g.dk_bias = View1<Pt>("dkb", HRN);
    g.dinit = Mamba3Carry<Pt>::allocate("dinit", shape);
    return g;
  }
  std::vector<double> quadratic() const {
    return mmref::mamba3_quadratic_reference(ref_shape(), to_vec(v), to_vec(qk), to_vec(dd), to_vec(dt_bias),
                                             to_vec(D), to_vec(qb), to_vec(kb), ref_init());
  }
};

// Worst relative error of the chunked scan (y and the four parts of the final carry) against the recurrence.
template <class T>
double scan_error(const M3Case& c) {
  M3Data<T> d(c);
  View2<T> y("y", c.B * c.L, c.H * c.R * c.P);
  auto fin = Mamba3Carry<acc_t<T>>::allocate("fin", d.shape);
  mamba3_scan_forward<T>(d.shape, d.in(), y, fin);
  mmref::M3Carry rf;
  const auto yr = d.reference(&rf);
  double e = rel_err(to_vec(y), yr);
  e = std::max(e, rel_err(to_vec(fin.S), rf.S));
  e = std::max(e, rel_err(to_vec(fin.k), rf.k));
  e = std::max(e, rel_err(to_vec(fin.v), rf.v));
  if (c.S > 0) e = std::max(e, rel_err(to_vec(fin.phi), rf.phi));
  return e;
}

}  // namespace

TEST_CASE("Mamba-3 step reference equals the chunked-form (quadratic) reference", "[mamba3]") {
  double worst = 0;
  for (index_t R : {1, 3})
    for (bool halved : {false, true})
      for (bool init : {false, true}) {
        M3Case c;
        c.L = 31;
        c.R = R;
        c.halved = halved;
        c.init = init;
        M3Data<double> d(c);
        const double e = rel_err(d.quadratic(), d.reference(nullptr));
        INFO("R=" << R << " halved=" << halved << " init=" << init);
        CHECK(e < 1e-12);
        worst = std::max(worst, e);
      }
  WARN("step vs quadratic reference, worst rel err " << worst);
}

TEST_CASE("Mamba-3 chunked scan equals the token-by-token recurrence (double)", "[mamba3]") {
  double worst = 0;
  int cases = 0;
  for (SSDAlgo algo : {SSDAlgo::portable, SSDAlgo::gemm})
  for (index_t R : {1, 2})
    for (bool halved : {false, true})
      for (index_t L : {1, 7, 23, 40})
        for (index_t Q : {1, 4, 8, 16, 64}) {
          if (algo != SSDAlgo::portable && R > 1) continue;  // the SSD route is SISO
          M3Case c;
          c.L = L;
          c.Q = Q;
          c.R = R;
          c.halved = halved;
          c.algo = algo;
          c.init = (L + Q) % 2 == 1;
          if (Q == 8) {  // groups: 4 heads in 2 groups
            c.H = 4;
            c.G = 2;
          }
          const double e = scan_error<double>(c);
          INFO("SSD route=" << (algo != SSDAlgo::portable) << " R=" << R << " halved=" << halved << " L=" << L
                            << " Q=" << Q << " init=" << c.init);
          CHECK(e < 1e-10);
          worst = std::max(worst, e);
          ++cases;
        }
  WARN("chunked vs recurrence over " << cases << " cases, worst rel err " << worst);
}

TEST_CASE("Mamba-3 chunked scan with packed records equals the recurrence that resets at each record", "[mamba3]") {
  double worst = 0, least_effect = 1e300;
  int cases = 0;
  for (SSDAlgo algo : {SSDAlgo::portable, SSDAlgo::gemm})
  for (index_t R : {1, 2})
    for (bool halved : {false, true})
      for (index_t L : {7, 23, 40})
        for (index_t Q : {1, 4, 8, 16, 64}) {
          if (algo != SSDAlgo::portable && R > 1) continue;  // the SSD route is SISO
          M3Case c;
          c.L = L;
          c.Q = Q;
          c.R = R;
          c.halved = halved;
          c.algo = algo;
          c.init = (L + Q + R) % 2 == 1;
          if (Q == 8) {
            c.H = 4;
            c.G = 2;
          }
          // boundaries at chunk edges (Q, 2Q), inside chunks, a 1-token record (2Q, 2Q + 1) and one at the end
          std::vector<index_t> r0 = {3, Q, 2 * Q, 2 * Q + 1, L - 1}, r1 = {1, Q - 1, Q + 2, 3 * Q};
          for (auto* r : {&r0, &r1}) {
            std::vector<index_t> keep;
            for (index_t x : *r)
              if (x > 0 && x < L) keep.push_back(x);
            *r = keep;
          }
          c.seq = make_records(c.B, c.L, {r0, r1});
          const double e = scan_error<double>(c);
          INFO("SSD route=" << (algo != SSDAlgo::portable) << " R=" << R << " halved=" << halved << " L=" << L
                            << " Q=" << Q << " init=" << c.init);
          CHECK(e < 1e-10);
          worst = std::max(worst, e);
          // the records matter: the resetting recurrence differs from the one without records
          M3Data<double> with(c);
          M3Case c1 = c;
          c1.seq.clear();
          M3Data<double> without(c1);
          const double effect = rel_err(with.reference(nullptr), without.reference(nullptr));
          CHECK(effect > 1e-3);
          least_effect = std::min(least_effect, effect);
          ++cases;
        }
  WARN("chunked vs resetting recurrence with records over " << cases << " cases, worst rel err " << worst
                                                              << " (records change y by at least " << least_effect
                                                              << ")");
}

TEST_CASE("Mamba-3 scan rejects seq_idx of the wrong shape", "[mamba3]") {
  M3Case c;
  M3Data<double> d(c);
  Kokkos::View<std::int32_t**, Layout, Mem> bad("seq", c.B, c.L - 1);
  auto in = d.in();
  in.seq_idx = bad;
  View2<double> y("y", c.B * c.L, c.H * c.R * c.P);
  CHECK_THROWS_WITH(mamba3_scan_forward<double>(d.shape, in, y, Mamba3Carry<double>{}),
                    ContainsSubstring("seq_idx is (2, 22), expected (batch, seqlen) = (2, 23)"));
}

TEST_CASE("Mamba-3 chunked scan in float stays close to the double recurrence", "[mamba3]") {
  M3Case c;
  c.L = 70;
  c.Q = 16;
  c.R = 2;
  const double e = scan_error<float>(c);
  WARN("float chunked vs double recurrence, rel err " << e);
  CHECK(e < 1e-4);
}

namespace {
// Every gradient of one scan backward (float, or double: the row kernels), with seeded output and final-carry
// gradients.
template <class T = float>
std::vector<std::vector<double>> scan_grads_float(const M3Case& c) {
  M3Data<T> d(c);
  Mamba3ScanGrad<T> g = d.zero_grads();
  mamba3_scan_backward<T>(d.shape, d.in(), d.seeded_dy(), d.seeded_dfinal(), g);
  return {to_vec(g.dv),       to_vec(g.dqk),     to_vec(g.ddd),     to_vec(g.ddt_bias),
          to_vec(g.dD),       to_vec(g.dq_bias), to_vec(g.dk_bias), to_vec(g.dinit.S),
          to_vec(g.dinit.phi), to_vec(g.dinit.k), to_vec(g.dinit.v)};
}

// c (float, its algo through the SSD): the forward against the double recurrence within fwd_tol, and every gradient
// against the portable route's, the per-token ones (dv, dqk, ddd) within tok_tol and the sums over tokens within
// sum_tol.
void check_ssd_route(M3Case c, double fwd_tol, double tok_tol, double sum_tol) {
  CHECK(scan_error<float>(c) < fwd_tol);
  const auto ssd = scan_grads_float(c);
  c.algo = SSDAlgo::portable;
  const auto portable = scan_grads_float(c);
  // and against the double portable route, whose token passes are the row kernels (the quad kernels, with the
  // rotation backward fused with its sums over heads and rows, are float only)
  const auto dbl = scan_grads_float<double>(c);
  for (std::size_t i = 0; i < ssd.size(); ++i) {
    INFO("gradient " << i);
    CHECK(rel_err(ssd[i], portable[i]) < (i < 3 ? tok_tol : sum_tol));
    CHECK(rel_err(ssd[i], dbl[i]) < (i < 3 ? tok_tol : sum_tol));
    CHECK(rel_err(portable[i], dbl[i]) < (i < 3 ? tok_tol : sum_tol));
  }
}
}  // namespace

TEST_CASE("Mamba-3 SISO's automatic route: through the SSD on CUDA, the scan's own kernels on host builds", "[mamba3]") {
  Mamba3ScanShape s;
  s.rank = 1;
  const bool cuda = std::string(Exec::name()) == "Cuda";
  CHECK(s.via_ssd() == cuda);
  s.algo = SSDAlgo::gemm;  // an explicit SSD algorithm is taken on any backend
  CHECK(s.via_ssd());
  s.algo = SSDAlgo::portable;
  CHECK_FALSE(s.via_ssd());
  s.algo = SSDAlgo::gemm;
  s.rank = 2;  // MIMO: always the scan's own kernels
  CHECK_FALSE(s.via_ssd());
}

TEST_CASE("Mamba-3 SISO through the fused SSD kernels stays within bf16 rounding (forward and backward)", "[mamba3]") {
  // Shapes the CUDA kernels take (headdim and d_state multiples of 16, chunk 64): the forward against the double
  // recurrence, every gradient against this file's portable kernels in fp32 (tied to finite differences in double
  // above). On host builds fused is the SSD's GEMM formulation in fp32.
  struct Shape {
    index_t L, H, P, N, S;
  };
  // (both forms of the SSD backward's dB and dC, one head a group here: GEMMs and ssd_fused::bc_backward; both
  // forms of the SSD forward where the sequential kernel takes the shape: headdim 64, chunk 64, CUDA builds; and
  // with bc_backward the backward's state terms by dstates_seq + the epilogue and by state_bwd_seq)
  using ssd_fused::BwdStateForm;
  for (const Shape& sh : {Shape{200, 2, 16, 32, 8}, Shape{150, 2, 64, 128, 32}})
    for (int k = 0; k < 6; ++k) {
      const ssd_fused::BcForm bc = k % 2 || k >= 4 ? ssd_fused::BcForm::kernel : ssd_fused::BcForm::gemm;
      const bool seq = k >= 2;
      const BwdStateForm bwd = k == 4 ? BwdStateForm::dstates : k == 5 ? BwdStateForm::sequential : BwdStateForm::chunks;
      if (seq && !ssd_fused::seq_fits(int(sh.P), int(sh.N), 64)) continue;
      if (k >= 4 && !ssd_fused::sbseq_fits(int(sh.P), int(sh.N), 64)) continue;
      M3Case c;
      c.L = sh.L;
      c.H = sh.H;
      c.P = sh.P;
      c.N = sh.N;
      c.S = sh.S;
      c.Q = 64;
      c.seq = make_records(c.B, c.L, {{70, 128}, {}});
      c.algo = SSDAlgo::fused;
      c.compute = GemmCompute::bf16;
      const ssd_fused::FormScope form(ssd_fused::bc_form, bc);
      const ssd_fused::FormScope fform(ssd_fused::fwd_form,
                                       seq ? ssd_fused::FwdForm::sequential : ssd_fused::FwdForm::chunks);
      const ssd_fused::FormScope bform(ssd_fused::bwd_state_form, bwd);
      const long before = ssd_fused::seq_launches(), d_before = ssd_fused::dseq_launches(),
                 sb_before = ssd_fused::sbseq_launches();
      INFO("P=" << sh.P << " N=" << sh.N << " dB, dC " << (bc == ssd_fused::BcForm::kernel ? "kernel" : "GEMMs")
                << (seq ? ", SSD forward: sequential kernel" : "")
                << (k == 4 ? ", state terms: dstates_seq" : k == 5 ? ", state terms: state_bwd_seq" : ""));
      // per-token gradients to bf16 rounding; the sums over all tokens (biases, D) get some cancellation
      check_ssd_route(c, 2e-2, 2e-2, 5e-2);
      CHECK((ssd_fused::seq_launches() > before) == seq);
      CHECK((ssd_fused::dseq_launches() > d_before) == (k == 4));
      CHECK((ssd_fused::sbseq_launches() > sb_before) == (k == 5));
    }
}

TEST_CASE("Mamba-3 SISO stores q~ and k~ in bf16 for the fused SSD: within bf16 rounding of fp32, forward and "
          "backward from the kept context",
          "[mamba3]") {
  // QkStore::automatic: where mamba3_qk_bf16 holds (CUDA builds: float, the fused SSD under bf16 arithmetic with
  // its sequential forward and backward state terms and the one-kernel dB, dC; forced here, the automatic forms
  // want batch x heads to fill the SMs) the rotation writes [k~ | q~] in bf16, the forward keeps that copy and the
  // backward from the kept context reads it (SSDIn::bc_bf16). Against QkStore::fp32 on the same inputs: y, the
  // final carry (its k~ formed in fp32 from the inputs, as the fp32 store holds it) and every gradient, within
  // bf16 rounding; y also against the double recurrence. Packed records, an initial carry, both pairings with a
  // partial rotary. Host builds: mamba3_qk_bf16 is false and nothing is stored in bf16.
  using ssd_fused::BwdStateForm;
  using ssd_fused::FwdForm;
  const ssd_fused::FormScope fform(ssd_fused::fwd_form, FwdForm::sequential);
  const ssd_fused::FormScope bform(ssd_fused::bwd_state_form, BwdStateForm::sequential);
  const ssd_fused::FormScope bc(ssd_fused::bc_form, ssd_fused::BcForm::kernel);
  const bool cuda = std::string(Exec::name()) == "Cuda";
  for (const bool halved : {false, true}) {
    M3Case c;
    c.L = 150;
    c.H = 3;
    c.G = 1;
    c.P = 64;
    c.N = 128;
    c.S = 40;
    c.Q = 64;
    c.halved = halved;
    c.seq = make_records(c.B, c.L, {{70, 128}, {}});
    c.algo = SSDAlgo::fused;
    c.compute = GemmCompute::bf16;
    INFO("halved=" << halved);
    M3Data<float> d(c);
    CHECK(mamba3_qk_bf16(d.shape, true, true) == cuda);
    CHECK_FALSE(mamba3_qk_bf16(d.shape, false, true));  // double activations
    CHECK_FALSE(mamba3_qk_bf16(d.shape, true, false));  // rows the quad kernels do not take
    std::vector<double> out[2][15];
    for (int k = 0; k < 2; ++k) {  // 0 fp32, 1 automatic
      const ssd_fused::FormScope store(qk_store, k ? QkStore::automatic : QkStore::fp32);
      CHECK(mamba3_qk_bf16(d.shape, true, true) == (cuda && k == 1));
      View2<float> y("y", c.B * c.L, c.H * c.R * c.P);
      auto fin = Mamba3Carry<float>::allocate("fin", d.shape);
      PoolScope pool;
      Mamba3ScanSaved<float> kept;
      mamba3_scan_forward<float>(d.shape, d.in(), y, fin, &kept, &pool);
      REQUIRE_FALSE(kept.empty());
      CHECK((kept.qkv16.extent(0) > 0) == (cuda && k == 1));
      CHECK((kept.qkv.extent(0) > 0) == !(cuda && k == 1));
      const double e = rel_err(to_vec(y), d.reference(nullptr));
      INFO("y against the double recurrence: " << e);
      CHECK(e < 2e-2);
      Mamba3ScanGrad<float> g = d.zero_grads();
      mamba3_scan_backward<float>(d.shape, d.in(), d.seeded_dy(), d.seeded_dfinal(), g, &kept);
      const std::vector<double> got[15] = {to_vec(y),         to_vec(fin.S),     to_vec(fin.k),     to_vec(fin.v),
                                           to_vec(fin.phi),   to_vec(g.dv),      to_vec(g.dqk),     to_vec(g.ddd),
                                           to_vec(g.ddt_bias), to_vec(g.dD),     to_vec(g.dq_bias), to_vec(g.dk_bias),
                                           to_vec(g.dinit.S), to_vec(g.dinit.k), to_vec(g.dinit.v)};
      for (int i = 0; i < 15; ++i) out[k][i] = got[i];
    }
    for (int i = 0; i < 15; ++i) {
      INFO("output " << i << " (y, final S, k, v, phi, dv, dqk, ddd, ddt_bias, dD, dq_bias, dk_bias, dinit S, k, v)");
      // the final carry's k~, v and phases are formed in fp32 either way; the rest through bf16 q~ and k~
      const double tol = i == 2 ? 1e-5 : i == 3 || i == 4 ? 0.0 : i < 8 || i >= 12 ? 2e-2 : 5e-2;
      CHECK(rel_err(out[1][i], out[0][i]) <= tol);
    }
  }
}

TEST_CASE("Mamba-3 SISO through the SSD in fp32: the token passes agree with the recurrence and the portable kernels",
          "[mamba3]") {
  // float, rank 1, headdim and d_state multiples of 4: the rotation, the trapezoid's diagonal and their backwards
  // run on quads of dimensions a lane (16-byte accesses on GPUs), the portable route's on rows. Both pairings,
  // partial (S = 3: a quad half rotated) and full rotary, 4 heads in 2 groups, packed records, an initial carry and
  // final-carry gradients (the last token's k and v terms). The forward against the double recurrence, every
  // gradient against the portable route's in fp32.
  // Both forms of the rotation and of its backward: the native CUDA kernels (rotate_cuda.hpp; CUDA builds) and the
  // Kokkos forms.
  for (const RotBwdForm form : {RotBwdForm::automatic, RotBwdForm::kokkos})
    for (const bool halved : {false, true})
      for (const index_t S : {3, 8}) {
        const ssd_fused::FormScope scope(rot_bwd_form, form);
        const ssd_fused::FormScope fscope(
            rot_fwd_form, form == RotBwdForm::automatic ? RotFwdForm::automatic : RotFwdForm::kokkos);
        const long before = mamba3_cuda::rotate_bwd_launches(), fbefore = mamba3_cuda::rotate_fwd_launches();
        M3Case c;
        // 600 rows (140 at S = 3): tiles of 16 rows (8 halved) in the Kokkos rotation backward, of 256 in the
        // native one at d_state 16 (three, the last partial; one partial at S = 3)
        c.L = S == 8 ? 300 : 70;
        c.H = 4;
        c.G = 2;
        c.P = 8;
        c.N = 16;
        c.S = S;
        c.Q = 16;
        c.halved = halved;
        c.seq = make_records(c.B, c.L, {{20, 33}, {}});
        c.algo = SSDAlgo::gemm;
        c.compute = GemmCompute::fp32;
        INFO("halved=" << halved << " S=" << S << (form == RotBwdForm::kokkos ? ", Kokkos rotation backward" : ""));
        check_ssd_route(c, 1e-4, 1e-4, 1e-3);
        const bool cuda = std::string(Exec::name()) == "Cuda";
        CHECK((mamba3_cuda::rotate_bwd_launches() > before) == (cuda && form == RotBwdForm::automatic));
        CHECK((mamba3_cuda::rotate_fwd_launches() > fbefore) == (cuda && form == RotBwdForm::automatic));
      }
}

TEST_CASE("Mamba-3 with lambda = 1 and no rotary reduces to Mamba-2's SSD recurrence", "[mamba3]") {
  // trap = 800 gives sigmoid(trap) == 1 exactly in double (the beta term vanishes: exponential-Euler); no angles;
  // zero biases; dd_A chosen per head so that heavy_tail(dd_A) = exp(A_log_h) (a constant A per head).
  M3Case c;
  c.L = 45;
  c.H = 4;
  c.G = 2;
  c.S = 0;
  c.Q = 16;
  M3Data<double> d(c);
  const index_t rows = c.B * c.L, W = 3 * c.H, RGN = c.G * c.N, E = c.H * c.P;
  const std::vector<double> A_log = {-0.7, 0.0, 0.4, 1.3};
  auto dd = to_vec(d.dd);
  for (index_t i = 0; i < rows; ++i)
    for (index_t h = 0; h < c.H; ++h) {
      const double a = std::exp(A_log[h]);
      dd[i * W + c.H + h] = a >= 1 ? a - 1 : 1 - 1 / a;
      dd[i * W + 2 * c.H + h] = 800.0;
    }
  from_vec(d.dd, dd);
  Kokkos::deep_copy(d.qb, 0.0);
  Kokkos::deep_copy(d.kb, 0.0);
  View2<double> y("y", rows, E);
  auto fin = Mamba3Carry<double>::allocate("fin", d.shape);
  mamba3_scan_forward<double>(d.shape, d.in(), y, fin);
  // SSD inputs: xbc = [x = v | B = k | C = q], dt = dd_dt
  const auto v = to_vec(d.v), qk = to_vec(d.qk);
  std::vector<double> xbc(rows * (E + 2 * RGN)), dt(rows * c.H);
  for (index_t i = 0; i < rows; ++i) {
    for (index_t j = 0; j < E; ++j) xbc[i * (E + 2 * RGN) + j] = v[i * E + j];
    for (index_t j = 0; j < RGN; ++j) {
      xbc[i * (E + 2 * RGN) + E + j] = qk[i * 2 * RGN + RGN + j];
      xbc[i * (E + 2 * RGN) + E + RGN + j] = qk[i * 2 * RGN + j];
    }
    for (index_t h = 0; h < c.H; ++h) dt[i * c.H + h] = dd[i * W + h];
  }
  mmref::SSDRefShape ss{c.B, c.L, c.H, c.P, c.G, c.N};
  std::vector<double> ssd_fin;
  const auto y_ssd = mmref::ssd_reference(ss, xbc, dt, A_log, to_vec(d.dt_bias), to_vec(d.D), {}, to_vec(d.init.S),
                                          &ssd_fin);
  const double e = rel_err(to_vec(y), y_ssd), ef = rel_err(to_vec(fin.S), ssd_fin);
  WARN("Mamba-3 (lambda = 1) vs Mamba-2 SSD reference: y " << e << ", final state " << ef);
  CHECK(e < 1e-12);
  CHECK(ef < 1e-12);
  // and the Kokkos SSD agrees with the same numbers
  SSDShape sh;
  sh.batch = c.B;
  sh.seqlen = c.L;
  sh.nheads = c.H;
  sh.headdim = c.P;
  sh.ngroups = c.G;
  sh.dstate = c.N;
  sh.chunk = 8;
  View2<double> xbc_v("xbc", rows, E + 2 * RGN), dt_v("dt", rows, c.H), y2("y2", rows, E);
  View1<double> A_log_v("A_log", c.H);
  from_vec(xbc_v, xbc);
  from_vec(dt_v, dt);
  from_vec(A_log_v, A_log);
  SSDIn<double> si;
  si.xbc = xbc_v;
  si.b_col = E;
  si.c_col = E + RGN;
  si.dt = dt_v;
  si.A_log = A_log_v;
  si.dt_bias = d.dt_bias;
  si.D = d.D;
  si.init_state = d.init.S;
  ssd_forward<double>(sh, si, y2, View4<double>());
  CHECK(rel_err(to_vec(y), to_vec(y2)) < 1e-12);
}

namespace {

// Finite-difference check of every scan input (y and all four parts of the final carry in the loss).
void scan_fd_check(const M3Case& c, const std::string& name) {
  M3Data<double> d(c);
  const index_t rows = c.B * c.L;
  const View2<double> dy = d.seeded_dy();
  const Mamba3Carry<double> dfin = d.seeded_dfinal();
  const auto dyv = to_vec(dy);
  const auto dphi = to_vec(dfin.phi), dS = to_vec(dfin.S), dk = to_vec(dfin.k), dvv = to_vec(dfin.v);
  auto loss = [&]() {
    View2<double> y("y", rows, c.H * c.R * c.P);
    auto fin = Mamba3Carry<double>::allocate("fin", d.shape);
    mamba3_scan_forward<double>(d.shape, d.in(), y, fin);
    return mmtest::dot(to_vec(y), dyv) + mmtest::dot(to_vec(fin.phi), dphi) + mmtest::dot(to_vec(fin.S), dS) +
           mmtest::dot(to_vec(fin.k), dk) + mmtest::dot(to_vec(fin.v), dvv);
  };
  Mamba3ScanGrad<double> g = d.zero_grads();
  mamba3_scan_backward<double>(d.shape, d.in(), dy, dfin, g);
  INFO(name);
  if (d.shape.via_ssd()) {
    // the backward from the context the forward kept (Mamba3ScanSaved: per-token quantities, phases, q~ and k~,
    // the SSD's chunk states and C B^T) gives the recomputing backward's gradients; the kept context is only
    // read, so a second backward from it gives them again
    PoolScope pool;
    Mamba3ScanSaved<double> kept;
    View2<double> y("y", rows, c.H * c.R * c.P);
    auto fin = Mamba3Carry<double>::allocate("fin", d.shape);
    mamba3_scan_forward<double>(d.shape, d.in(), y, fin, &kept, &pool);
    REQUIRE(!kept.empty());
    REQUIRE(!kept.ssd.empty());
    for (int pass = 0; pass < 2; ++pass) {
      Mamba3ScanGrad<double> gk = d.zero_grads();
      mamba3_scan_backward<double>(d.shape, d.in(), dy, dfin, gk, &kept);
      INFO("backward " << pass << " from the kept context");
      CHECK(rel_err(to_vec(gk.dv), to_vec(g.dv)) < 1e-13);
      CHECK(rel_err(to_vec(gk.dqk), to_vec(g.dqk)) < 1e-13);
      CHECK(rel_err(to_vec(gk.ddd), to_vec(g.ddd)) < 1e-13);
      CHECK(rel_err(to_vec(gk.ddt_bias), to_vec(g.ddt_bias)) < 1e-13);
      CHECK(rel_err(to_vec(gk.dD), to_vec(g.dD)) < 1e-13);
      CHECK(rel_err(to_vec(gk.dq_bias), to_vec(g.dq_bias)) < 1e-13);
      CHECK(rel_err(to_vec(gk.dk_bias), to_vec(g.dk_bias)) < 1e-13);
      CHECK(rel_err(to_vec(gk.dinit.phi), to_vec(g.dinit.phi)) < 1e-13);
      CHECK(rel_err(to_vec(gk.dinit.S), to_vec(g.dinit.S)) < 1e-13);
      CHECK(rel_err(to_vec(gk.dinit.k), to_vec(g.dinit.k)) < 1e-13);
      CHECK(rel_err(to_vec(gk.dinit.v), to_vec(g.dinit.v)) < 1e-13);
    }
  } else {  // nothing to keep off the SSD route
    PoolScope pool;
    Mamba3ScanSaved<double> kept;
    View2<double> y("y", rows, c.H * c.R * c.P);
    mamba3_scan_forward<double>(d.shape, d.in(), y, Mamba3Carry<double>{}, &kept, &pool);
    CHECK(kept.empty());
  }
  double worst = 0;
  auto chk = [&](const char* what, const auto& x, const auto& grad, int count) {
    const auto r = fd_check(x, to_vec(grad), loss, count);
    const double e = r.rel();
    INFO(what << ": max |gradient| " << r.max_ref);
    CHECK(e < 1e-6);
    CHECK(r.max_ref > 1e-3);  // the gradient is not trivially zero
    worst = std::max(worst, e);
  };
  chk("v", d.v, g.dv, 40);
  chk("qk", d.qk, g.dqk, 40);
  chk("dd (dd_dt, dd_A, trap, angles)", d.dd, g.ddd, 100000);  // every element
  chk("dt_bias", d.dt_bias, g.ddt_bias, 24);
  chk("D", d.D, g.dD, 24);
  chk("q_bias", d.qb, g.dq_bias, 24);
  chk("k_bias", d.kb, g.dk_bias, 24);
  chk("init phi", d.init.phi, g.dinit.phi, 24);
  chk("init S", d.init.S, g.dinit.S, 24);
  chk("init k", d.init.k, g.dinit.k, 24);
  chk("init v", d.init.v, g.dinit.v, 24);
  WARN("scan FD check " << name << ": worst rel err " << worst);
}

}  // namespace

TEST_CASE("Mamba-3 scan backward matches finite differences for every input", "[mamba3]") {
  for (int variant = 0; variant < 3; ++variant) {
    M3Case c;
    if (variant < 2) {  // SISO, interleaved pairs; this file's kernels, then through the SSD (gemm)
      c.L = 21;
      c.Q = 8;
      c.algo = variant == 0 ? SSDAlgo::portable : SSDAlgo::gemm;
    } else {  // MIMO rank 2, halved pairs, groups
      c.L = 17;
      c.Q = 5;
      c.R = 2;
      c.H = 4;
      c.G = 2;
      c.N = 4;
      c.halved = true;
    }
    scan_fd_check(c, variant == 0 ? "SISO" : variant == 1 ? "SISO through the SSD" : "MIMO");
  }
}

TEST_CASE("Mamba-3 scan backward with packed records matches finite differences for every input", "[mamba3]") {
  for (int variant = 0; variant < 3; ++variant) {
    M3Case c;
    if (variant < 2) {  // SISO; boundaries inside chunks and at the chunk edges 8 and 16, a 1-token record
      c.L = 21;
      c.Q = 8;
      c.seq = make_records(c.B, c.L, {{5, 8, 16, 17}, {13}});
      c.algo = variant == 0 ? SSDAlgo::portable : SSDAlgo::gemm;
    } else {  // MIMO rank 2, halved pairs, groups; chunk edges 5 and 10
      c.L = 17;
      c.Q = 5;
      c.R = 2;
      c.H = 4;
      c.G = 2;
      c.N = 4;
      c.halved = true;
      c.seq = make_records(c.B, c.L, {{5, 11}, {2, 10, 16}});
    }
    scan_fd_check(c, variant == 0   ? "SISO with records"
                     : variant == 1 ? "SISO through the SSD with records"
                                    : "MIMO with records");
  }
}

TEST_CASE("Mamba-3 scan backward writes dv and dd into buffers that start at Mamba3ScanGrad::col0", "[mamba3]") {
  // v and dd as column blocks of one wide input (a pad of W columns, then v, then dd, as in the mixer's in_proj
  // output), with dv and ddd one buffer as the mixer has them: the buffer without the pad (col0 = W) holds, bit for
  // bit, the full-width buffer's columns from W on, which hold the gradients of the separate v and dd inputs; a
  // col0 past the first written column is an error naming it
  for (int variant = 0; variant < 3; ++variant) {
    M3Case c;
    c.L = 13;
    c.Q = 4;
    if (variant == 1) c.algo = SSDAlgo::gemm;  // SISO through the SSD (its dx at dx_col)
    if (variant == 2) {                        // MIMO rank 2, the scan's own kernels
      c.R = 2;
      c.N = 4;
    }
    INFO("variant " << variant);
    M3Data<double> d(c);
    const index_t rows = c.B * c.L, W = 5, vc = index_t(d.v.extent(1)), dc = index_t(d.dd.extent(1));
    View2<double> wide("wide", rows, W + vc + dc);
    fill_uniform(wide, 30);
    Kokkos::deep_copy(Kokkos::subview(wide, Kokkos::ALL, std::make_pair(W, W + vc)), d.v);
    Kokkos::deep_copy(Kokkos::subview(wide, Kokkos::ALL, std::make_pair(W + vc, W + vc + dc)), d.dd);
    Mamba3ScanIn<double> in = d.in();
    in.v = in.dd = wide;
    in.v_col = W;
    in.dt_col = W + vc;
    in.A_col = in.dt_col + c.H;
    in.trap_col = in.dt_col + 2 * c.H;
    in.angle_col = in.dt_col + 3 * c.H;
    const View2<double> dy = d.seeded_dy();
    const Mamba3Carry<double> dfin = d.seeded_dfinal();
    auto run = [&](const Mamba3ScanIn<double>& i, index_t col0, index_t width) {
      Mamba3ScanGrad<double> g = d.zero_grads();
      if (width > 0) g.dv = g.ddd = View2<double>("dvdd", rows, width);
      g.col0 = col0;
      mamba3_scan_backward<double>(d.shape, i, dy, dfin, g);
      return g;
    };
    const auto sep = run(d.in(), 0, 0);
    const auto full = run(in, 0, W + vc + dc);
    const auto narrow = run(in, W, vc + dc);
    const auto fh = to_vec(full.dv), nh = to_vec(narrow.dv), dvh = to_vec(sep.dv), ddh = to_vec(sep.ddd);
    std::size_t diff = 0, diff_sep = 0;
    for (index_t r = 0; r < rows; ++r)
      for (index_t j = 0; j < vc + dc; ++j) {
        const double f = fh[r * (W + vc + dc) + W + j];
        diff += f != nh[r * (vc + dc) + j];
        diff_sep += f != (j < vc ? dvh[r * vc + j] : ddh[r * dc + j - vc]);
      }
    CHECK(diff == 0);
    CHECK(diff_sep == 0);
    CHECK(to_vec(narrow.dqk) == to_vec(sep.dqk));
    CHECK(to_vec(narrow.ddt_bias) == to_vec(sep.ddt_bias));
    CHECK(to_vec(narrow.dinit.S) == to_vec(sep.dinit.S));
    CHECK_THROWS_WITH(run(in, W + 1, vc + dc - 1), ContainsSubstring("col0 = 6"));
  }
}

// ---------------------------------------------------------------------------------------------- the mixer
namespace {

Mamba3Config tiny_m3(bool mimo, bool norm) {
  Mamba3Config c;
  c.d_model = 6;
  c.d_state = 8;  // rope_fraction 0.5: 2 angles
  c.headdim = 3;  // 4 heads
  c.expand = 2;
  c.ngroups = 2;
  c.is_mimo = mimo;
  c.mimo_rank = 2;
  c.chunk_size = 5;
  c.is_outproj_norm = norm;
  return c;
}
// tiny_m3 at d_model 8, d_state 16, headdim 4, chunk 8: the shapes the float mixer's quad kernels (gate, rotation,
// and on CUDA the diagonal's through the SSD) take
Mamba3Config quad_m3(bool mimo, bool norm) {
  Mamba3Config c = tiny_m3(mimo, norm);
  c.d_model = 8;
  c.d_state = 16;
  c.headdim = 4;
  c.chunk_size = 8;
  return c;
}

struct MixerRig {
  Mamba3Config cfg;
  ParamStore<double> ps;
  Mamba3Mixer<double> mixer;
  MixerRig(const Mamba3Config& c, std::uint64_t seed = 5) : cfg(c), mixer(c, ps, "m.", 2) {
    ps.allocate();
    ps.initialize(seed);
    mmtest::jitter_params(ps, 99, 0.1);
  }
  std::vector<double> p(const std::string& name) const {
    return ps.has("m." + name) ? to_vec(ps.v1(ps.index("m." + name))) : std::vector<double>{};
  }
  Mamba3State<double> random_state(index_t batch, std::uint64_t seed) const {
    auto st = mixer.make_state(batch);
    fill_uniform(st.carry.phi, seed, 0.5, 5.5);
    fill_uniform(st.carry.S, seed + 1);
    fill_uniform(st.carry.k, seed + 2);
    fill_uniform(st.carry.v, seed + 3);
    return st;
  }
  std::vector<double> reference(const View2<double>& u, index_t B, index_t L, const Mamba3State<double>* init,
                                mmref::M3Carry* fin, const std::vector<int>& seq = {}) const {
    mmref::M3MixerShape ms;
    ms.s.seq = seq;
    ms.s.B = B;
    ms.s.L = L;
    ms.s.H = cfg.nheads();
    ms.s.P = cfg.headdim;
    ms.s.G = cfg.ngroups;
    ms.s.N = cfg.d_state;
    ms.s.R = cfg.rank();
    ms.s.S = cfg.nangles();
    ms.s.halved = cfg.pairing() == RopePairing::halved;
    ms.s.A_floor = cfg.A_floor;
    ms.D = cfg.d_model;
    ms.eps = cfg.norm_eps;
    mmref::M3Carry ic;
    if (init) {
      ic.phi = to_vec(init->carry.phi);
      ic.S = to_vec(init->carry.S);
      ic.k = to_vec(init->carry.k);
      ic.v = to_vec(init->carry.v);
    }
    return mmref::mamba3_mixer_reference(ms, to_vec(u), p("in_proj.weight"), p("dt_bias"), p("D"), p("B_norm.weight"),
                                         p("C_norm.weight"), p("B_bias"), p("C_bias"), p("mimo_x"), p("mimo_z"),
                                         p("mimo_o"), p("norm.weight"), p("out_proj.weight"), ic, fin);
  }
};

const char* variant_name(const Mamba3Config& c) {
  if (c.is_mimo) return c.is_outproj_norm ? "MIMO + output norm" : "MIMO";
  return c.is_outproj_norm ? "SISO + output norm" : "SISO";
}

}  // namespace

TEST_CASE("Mamba-3 mixer forward equals the naive double reference (SISO, MIMO, output norm, both pairings)",
          "[mamba3]") {
  double worst = 0;
  for (bool mimo : {false, true})
    for (bool norm : {false, true})
      for (auto pairing : {Mamba3Config::Pairing::interleaved, Mamba3Config::Pairing::halved}) {
        Mamba3Config cfg = tiny_m3(mimo, norm);
        cfg.rope_pairing = pairing;
        MixerRig rig(cfg);
        const index_t B = 2, L = 13;
        View2<double> u("u", B * L, cfg.d_model), out("out", B * L, cfg.d_model);
        fill_uniform(u, 1);
        const auto init = rig.random_state(B, 40);
        auto fin = rig.mixer.make_state(B);
        Mamba3Acts<double> acts;
        rig.mixer.forward(u, B, L, out, acts, true, &init, &fin);
        mmref::M3Carry rf;
        const auto ref = rig.reference(u, B, L, &init, &rf);
        INFO(variant_name(cfg) << (pairing == Mamba3Config::Pairing::halved ? ", halved" : ", interleaved"));
        const double e = std::max({rel_err(to_vec(out), ref), rel_err(to_vec(fin.carry.S), rf.S),
                                   rel_err(to_vec(fin.carry.k), rf.k), rel_err(to_vec(fin.carry.v), rf.v),
                                   rel_err(to_vec(fin.carry.phi), rf.phi)});
        CHECK(e < 1e-12);
        worst = std::max(worst, e);
      }
  WARN("mixer vs reference, worst rel err " << worst);
}

TEST_CASE("Mamba-3 mixer backward matches finite differences for the input, the state and every parameter",
          "[mamba3]") {
  // SISO also through the SSD's GEMM formulation (route 1): its backward reads the scan context the forward kept
  // (the forward saves here; under the recompute policy the backward's own forward keeps it)
  for (int route = 0; route < 2; ++route)
  for (bool mimo : {false, true})
    for (bool norm : {false, true}) {
      if (route == 1 && mimo) continue;
      Mamba3Config cfg = tiny_m3(mimo, norm);
      if (route == 1) cfg.scan_algo = SSDAlgo::gemm;
      MixerRig rig(cfg);
      const index_t B = 2, L = 11;
      View2<double> u("u", B * L, cfg.d_model), out("out", B * L, cfg.d_model), dout("dout", B * L, cfg.d_model);
      View2<double> du("du", B * L, cfg.d_model);
      fill_uniform(u, 1);
      fill_uniform(dout, 2);
      auto init = rig.random_state(B, 40);
      auto dfin = rig.random_state(B, 50);
      const auto dov = to_vec(dout);
      const std::vector<double> dfv[4] = {to_vec(dfin.carry.phi), to_vec(dfin.carry.S), to_vec(dfin.carry.k),
                                          to_vec(dfin.carry.v)};
      auto loss = [&]() {
        View2<double> o("o", B * L, cfg.d_model);
        auto fin = rig.mixer.make_state(B);
        Mamba3Acts<double> a;
        rig.mixer.forward(u, B, L, o, a, false, &init, &fin);
        return mmtest::dot(to_vec(o), dov) + mmtest::dot(to_vec(fin.carry.phi), dfv[0]) +
               mmtest::dot(to_vec(fin.carry.S), dfv[1]) + mmtest::dot(to_vec(fin.carry.k), dfv[2]) +
               mmtest::dot(to_vec(fin.carry.v), dfv[3]);
      };
      Mamba3Acts<double> acts;
      auto fin = rig.mixer.make_state(B);
      // route 0: the recompute policy in the backward; route 1: the forward's saved activations
      rig.mixer.forward(u, B, L, out, acts, route == 1, &init, &fin);
      if (route == 1) REQUIRE(!acts.scan.empty());
      rig.ps.zero_grads();
      auto dinit = rig.mixer.make_state(B);
      rig.mixer.backward(acts, B, L, dout, du, &dfin, &dinit);
      INFO(variant_name(cfg) << (route == 1 ? ", through the SSD (gemm)" : ""));
      double worst = 0;
      auto chk = [&](const std::string& what, const auto& x, const std::vector<double>& grad, int count) {
        const auto r = fd_check(x, grad, loss, count);
        INFO(what << ": max |gradient| " << r.max_ref);
        CHECK(r.rel() < 1e-6);
        CHECK(r.max_ref > 1e-4);
        worst = std::max(worst, r.rel());
      };
      chk("u", u, to_vec(du), 40);
      for (const auto& e : rig.ps.entries()) {
        const auto idx = rig.ps.index(e.name);
        chk(e.name, rig.ps.v1(idx), to_vec(rig.ps.g1(idx)), 24);
      }
      chk("init phi", init.carry.phi, to_vec(dinit.carry.phi), 24);
      chk("init S", init.carry.S, to_vec(dinit.carry.S), 24);
      chk("init k", init.carry.k, to_vec(dinit.carry.k), 24);
      chk("init v", init.carry.v, to_vec(dinit.carry.v), 24);
      WARN("mixer FD check (" << variant_name(cfg) << (route == 1 ? ", through the SSD" : "") << "): worst rel err "
                               << worst);
    }
}

namespace {
// dst = src rounded to float, element by element of two views of one shape and contiguous layout
template <class Src, class Dst>
void to_float(const Src& src, const Dst& dst) {
  REQUIRE(src.size() == dst.size());
  par_for("test::to_float", index_t(src.size()), KOKKOS_LAMBDA(index_t i) { dst.data()[i] = float(src.data()[i]); });
}
}  // namespace

TEST_CASE("Mamba-3 mixer in float equals the double mixer with the same parameters (SISO, forward and backward)",
          "[mamba3]") {
  // headdim 4 and d_state 16 (in_proj's 112 columns): the float SISO mixer takes the quad kernels of the gate and
  // the rotation (CUDA: also the diagonal's, through the SSD); the double one the row kernels. Parameters copied
  // from the double store, an initial state and final-state gradients.
  for (const bool norm : {false, true}) {
    const Mamba3Config cfg = quad_m3(false, norm);
    INFO(variant_name(cfg));
    MixerRig rig(cfg);
    ParamStore<float> psf;
    Mamba3Mixer<float> mf(cfg, psf, "m.", 2);
    psf.allocate();
    REQUIRE(psf.values().extent(0) == rig.ps.values().extent(0));
    to_float(rig.ps.values(), psf.values());
    const index_t B = 2, L = 21, D = cfg.d_model;
    View2<double> u("u", B * L, D), out("out", B * L, D), dout("dout", B * L, D), du("du", B * L, D);
    View2<float> uf("uf", B * L, D), outf("outf", B * L, D), doutf("doutf", B * L, D), duf("duf", B * L, D);
    fill_uniform(u, 1);
    fill_uniform(dout, 2);
    to_float(u, uf);
    to_float(dout, doutf);
    const auto init = rig.random_state(B, 40), dfin = rig.random_state(B, 50);
    auto initf = mf.make_state(B), dfinf = mf.make_state(B);
    to_float(init.carry.phi, initf.carry.phi), to_float(init.carry.S, initf.carry.S);
    to_float(init.carry.k, initf.carry.k), to_float(init.carry.v, initf.carry.v);
    to_float(dfin.carry.phi, dfinf.carry.phi), to_float(dfin.carry.S, dfinf.carry.S);
    to_float(dfin.carry.k, dfinf.carry.k), to_float(dfin.carry.v, dfinf.carry.v);
    Kokkos::fence();
    auto fin = rig.mixer.make_state(B), dinit = rig.mixer.make_state(B);
    auto finf = mf.make_state(B), dinitf = mf.make_state(B);
    Mamba3Acts<double> acts;
    Mamba3Acts<float> actsf;
    rig.mixer.forward(u, B, L, out, acts, true, &init, &fin);
    mf.forward(uf, B, L, outf, actsf, true, &initf, &finf);
    rig.ps.zero_grads();
    psf.zero_grads();
    rig.mixer.backward(acts, B, L, dout, du, &dfin, &dinit);
    mf.backward(actsf, B, L, doutf, duf, &dfinf, &dinitf);
    CHECK(rel_err(to_vec(outf), to_vec(out)) < 1e-5);
    CHECK(rel_err(to_vec(finf.carry.S), to_vec(fin.carry.S)) < 1e-5);
    CHECK(rel_err(to_vec(duf), to_vec(du)) < 1e-4);
    CHECK(rel_err(to_vec(dinitf.carry.S), to_vec(dinit.carry.S)) < 1e-4);
    CHECK(rel_err(to_vec(dinitf.carry.phi), to_vec(dinit.carry.phi)) < 1e-4);
    for (const auto& e : rig.ps.entries()) {
      INFO("gradient of " << e.name);
      CHECK(rel_err(to_vec(psf.g1(psf.index(e.name))), to_vec(rig.ps.g1(rig.ps.index(e.name)))) < 1e-4);
    }
  }
}

TEST_CASE("Mamba-3 mixer under bf16 GEMMs keeps its gate output only as a bf16 copy (CUDA), within bf16 rounding",
          "[mamba3]") {
  // Under bf16 GEMMs on CUDA the gate writes out_proj's input only as a bf16 copy (quads for SISO, the element
  // kernel for MIMO), which out_proj's forward and weight gradient take in place of rounding an fp32 copy: outputs
  // and gradients stay within bf16 rounding of the fp32 GEMMs', and the recompute policy reproduces them bit for bit.
  // The backward (SISO, CUDA) holds in_proj's output gradient only as its bf16 copy (DprojStore::automatic): the
  // GEMMs' operands are those rounded from the fp32 dproj (DprojStore::fp32), so every result equals that form's
  // bit for bit. Host builds compute the GEMMs in fp32 and keep the fp32 output and gradient.
  for (const bool mimo : {false, true}) {
    const Mamba3Config cfg = quad_m3(mimo, true);
    INFO(variant_name(cfg));
    ParamStore<float> ps;
    Mamba3Mixer<float> mixer(cfg, ps, "m.", 2);
    ps.allocate();
    ps.initialize(7);
    const index_t B = 2, L = 19, D = cfg.d_model;
    View2<float> u("u", B * L, D), dout("dout", B * L, D);
    fill_uniform(u, 3);
    fill_uniform(dout, 4);
    auto run = [&](GemmCompute c, bool save, DprojStore ds = DprojStore::automatic) {
      const FloatGemmComputeScope scope(c);
      const ssd_fused::FormScope store(dproj_store, ds);
      CHECK(mixer.bf16_in_proj_grad() ==
            (mmtest::keeps_bf16_copy(c == GemmCompute::bf16) && !mimo && ds == DprojStore::automatic));
      Mamba3Acts<float> acts;
      View2<float> out("out", B * L, D), du("du", B * L, D);
      mixer.forward(u, B, L, out, acts, save);
      if (save) {
        const bool copy = mmtest::keeps_bf16_copy(c == GemmCompute::bf16);
        CHECK((acts.o_b.extent(0) > 0) == copy);
        CHECK((acts.o.extent(0) > 0) == !copy);
      }
      ps.zero_grads();
      mixer.backward(acts, B, L, dout, du);
      return mmtest::MixerRun{to_vec(out), to_vec(du), to_vec(ps.grads())};
    };
    // du passes through every bf16 GEMM of the block (in_proj's forward and backward, out_proj's) and the output
    // norm: 0.043 of its largest element on an H200 for SISO + norm (d_model 8), so 6e-2 for it
    const mmtest::MixerRun ref = run(GemmCompute::fp32, true), b16 = run(GemmCompute::bf16, true),
                           b16rc = run(GemmCompute::bf16, false);
    mmtest::check_bf16_runs(ref, b16, b16rc, 6e-2);
    const mmtest::MixerRun b16f = run(GemmCompute::bf16, true, DprojStore::fp32);
    CHECK(b16f.out == b16.out);
    CHECK(b16f.du == b16.du);
    CHECK(b16f.grads == b16.grads);
  }
}

TEST_CASE("Mamba-3 MIMO with rank 1 equals SISO", "[mamba3]") {
  Mamba3Config siso = tiny_m3(false, true), mimo = tiny_m3(true, true);
  mimo.mimo_rank = 1;
  siso.rope_pairing = mimo.rope_pairing = Mamba3Config::Pairing::halved;
  MixerRig a(siso);
  ParamStore<double> ps;
  Mamba3Mixer<double> m(mimo, ps, "m.", 2);
  ps.allocate();
  ps.initialize(5);  // mimo_x = mimo_z = mimo_o = 1 for rank 1
  for (const auto& e : a.ps.entries()) Kokkos::deep_copy(ps.v1(ps.index(e.name)), a.ps.v1(a.ps.index(e.name)));
  const index_t B = 2, L = 17;
  View2<double> u("u", B * L, siso.d_model), o1("o1", B * L, siso.d_model), o2("o2", B * L, siso.d_model);
  fill_uniform(u, 1);
  Mamba3Acts<double> acts;
  a.mixer.forward(u, B, L, o1, acts, false);
  m.forward(u, B, L, o2, acts, false);
  const double e = rel_err(to_vec(o2), to_vec(o1));
  WARN("MIMO rank 1 vs SISO, rel err " << e);
  CHECK(e < 1e-14);
}

TEST_CASE("Mamba-3 prefill + step decoding reproduces the full forward at every position", "[mamba3]") {
  for (bool mimo : {false, true}) {
    const Mamba3Config cfg = tiny_m3(mimo, mimo);
    MixerRig rig(cfg);
    const index_t B = 2, L = 14, D = cfg.d_model;
    View2<double> u("u", B * L, D), out("out", B * L, D);
    fill_uniform(u, 1);
    Mamba3Acts<double> acts;
    rig.mixer.forward(u, B, L, out, acts, false);
    const auto full = to_vec(out), uv = to_vec(u);
    for (index_t T0 : {0, 6}) {
      auto state = rig.mixer.make_state(B);
      std::vector<double> got(B * L * D);
      if (T0 > 0) {  // prefill the first T0 tokens
        View2<double> up("up", B * T0, D), op("op", B * T0, D);
        std::vector<double> uh(B * T0 * D);
        for (index_t b = 0; b < B; ++b)
          for (index_t i = 0; i < T0 * D; ++i) uh[b * T0 * D + i] = uv[b * L * D + i];
        from_vec(up, uh);
        rig.mixer.forward(up, B, T0, op, acts, false, nullptr, &state);
        const auto oh = to_vec(op);
        for (index_t b = 0; b < B; ++b)
          for (index_t i = 0; i < T0 * D; ++i) got[b * L * D + i] = oh[b * T0 * D + i];
      }
      View2<double> ut("ut", B, D), ot("ot", B, D);
      for (index_t t = T0; t < L; ++t) {
        std::vector<double> uh(B * D);
        for (index_t b = 0; b < B; ++b)
          for (index_t j = 0; j < D; ++j) uh[b * D + j] = uv[(b * L + t) * D + j];
        from_vec(ut, uh);
        rig.mixer.step(ut, state, ot);
        const auto oh = to_vec(ot);
        for (index_t b = 0; b < B; ++b)
          for (index_t j = 0; j < D; ++j) got[(b * L + t) * D + j] = oh[b * D + j];
      }
      const double e = rel_err(got, full);
      INFO(variant_name(cfg) << ", prefill " << T0);
      CHECK(e < 1e-12);
      WARN("prefill " << T0 << " + step vs full forward (" << variant_name(cfg) << "): rel err " << e);
    }
  }
}

TEST_CASE("Mamba-3 windows with a carried state equal one pass, forward and backward", "[mamba3]") {
  for (bool mimo : {false, true}) {
    const Mamba3Config cfg = tiny_m3(mimo, !mimo);
    MixerRig rig(cfg);
    const index_t B = 2, L = 23, D = cfg.d_model;
    const std::vector<index_t> cuts = {0, 7, 16, 23};  // windows of 7, 9 and 7 tokens (chunk 5)
    View2<double> u("u", B * L, D), out("out", B * L, D), dout("dout", B * L, D), du("du", B * L, D);
    fill_uniform(u, 1);
    fill_uniform(dout, 2);
    const auto init = rig.random_state(B, 40);
    auto fin = rig.mixer.make_state(B);
    Mamba3Acts<double> acts;
    rig.mixer.forward(u, B, L, out, acts, true, &init, &fin);
    rig.ps.zero_grads();
    auto dinit = rig.mixer.make_state(B);
    rig.mixer.backward(acts, B, L, dout, du, nullptr, &dinit);
    const auto grads_one = to_vec(rig.ps.grads()), du_one = to_vec(du), out_one = to_vec(out);
    const auto uv = to_vec(u), dov = to_vec(dout);
    // windows: forward left to right carrying the state, backward right to left carrying its gradient
    const std::size_t nw = cuts.size() - 1;
    std::vector<Mamba3State<double>> states;  // state entering window k
    states.push_back(init);
    std::vector<Mamba3Acts<double>> wacts(nw);
    std::vector<View2<double>> wu(nw);
    std::vector<double> out_w(B * L * D), du_w(B * L * D);
    auto slice = [&](const std::vector<double>& src, index_t t0, index_t len) {
      std::vector<double> r(B * len * D);
      for (index_t b = 0; b < B; ++b)
        for (index_t i = 0; i < len * D; ++i) r[b * len * D + i] = src[(b * L + t0) * D + i];
      return r;
    };
    auto unslice = [&](std::vector<double>& dst, const std::vector<double>& src, index_t t0, index_t len) {
      for (index_t b = 0; b < B; ++b)
        for (index_t i = 0; i < len * D; ++i) dst[(b * L + t0) * D + i] = src[b * len * D + i];
    };
    for (std::size_t k = 0; k < nw; ++k) {
      const index_t t0 = cuts[k], len = cuts[k + 1] - cuts[k];
      wu[k] = View2<double>("wu", B * len, D);
      from_vec(wu[k], slice(uv, t0, len));
      View2<double> wo("wo", B * len, D);
      states.push_back(rig.mixer.make_state(B));
      rig.mixer.forward(wu[k], B, len, wo, wacts[k], k % 2 == 0, &states[k], &states[k + 1]);
      unslice(out_w, to_vec(wo), t0, len);
    }
    rig.ps.zero_grads();
    Mamba3State<double> dcarry;  // gradient of the state leaving the current window
    bool has_dcarry = false;
    for (std::size_t k = nw; k-- > 0;) {
      const index_t t0 = cuts[k], len = cuts[k + 1] - cuts[k];
      View2<double> wdo("wdo", B * len, D), wdu("wdu", B * len, D);
      from_vec(wdo, slice(dov, t0, len));
      auto dprev = rig.mixer.make_state(B);
      rig.mixer.backward(wacts[k], B, len, wdo, wdu, has_dcarry ? &dcarry : nullptr, &dprev);
      unslice(du_w, to_vec(wdu), t0, len);
      dcarry = dprev;
      has_dcarry = true;
    }
    INFO(variant_name(cfg));
    const double eo = rel_err(out_w, out_one), ef = rel_err(to_vec(states.back().carry.S), to_vec(fin.carry.S));
    const double eg = rel_err(to_vec(rig.ps.grads()), grads_one), eu = rel_err(du_w, du_one);
    const double ei = rel_err(to_vec(dcarry.carry.S), to_vec(dinit.carry.S));
    CHECK(eo < 1e-12);
    CHECK(ef < 1e-12);
    CHECK(rel_err(to_vec(states.back().carry.k), to_vec(fin.carry.k)) < 1e-12);
    CHECK(rel_err(to_vec(states.back().carry.phi), to_vec(fin.carry.phi)) < 1e-12);
    CHECK(eg < 1e-12);
    CHECK(eu < 1e-12);
    CHECK(ei < 1e-12);
    CHECK(rel_err(to_vec(dcarry.carry.phi), to_vec(dinit.carry.phi)) < 1e-12);
    WARN("windows vs one pass (" << variant_name(cfg) << "): out " << eo << ", final state " << ef
                                 << ", param grads " << eg << ", du " << eu << ", d(initial state) " << ei);
  }
}

TEST_CASE("Mamba-3 mixer: a packed row of records equals running each record alone, forward and backward",
          "[mamba3]") {
  for (bool mimo : {false, true}) {
    const Mamba3Config cfg = tiny_m3(mimo, mimo);
    MixerRig rig(cfg);
    const index_t D = cfg.d_model;
    // one row of three records: [0, 9) (boundary inside chunk 1 of size 5), [9, 15), [15, 23) (at a chunk edge)
    const std::vector<index_t> cuts = {0, 9, 15, 23};
    const index_t L = cuts.back();
    std::vector<int> ids(L);
    for (std::size_t k = 0; k + 1 < cuts.size(); ++k)
      for (index_t t = cuts[k]; t < cuts[k + 1]; ++t) ids[t] = int(7 + 3 * k);
    Kokkos::View<std::int32_t**, Layout, Mem> seq("seq", 1, L);
    {
      auto h = Kokkos::create_mirror_view(seq);
      for (index_t t = 0; t < L; ++t) h(0, t) = ids[t];
      Kokkos::deep_copy(seq, h);
    }
    View2<double> u("u", L, D), out("out", L, D), dout("dout", L, D), du("du", L, D);
    fill_uniform(u, 1);
    fill_uniform(dout, 2);
    const auto init = rig.random_state(1, 40);  // belongs to the first record
    const auto dfin = rig.random_state(1, 50);  // gradient of the final state (the last record's)
    auto fin = rig.mixer.make_state(1);
    Mamba3Acts<double> acts;
    rig.mixer.forward(u, 1, L, seq, out, acts, false, &init, &fin);
    rig.ps.zero_grads();
    auto dinit = rig.mixer.make_state(1);
    rig.mixer.backward(acts, 1, L, seq, dout, du, &dfin, &dinit);
    const auto grads_packed = to_vec(rig.ps.grads());
    // each record alone: the first from init, the others from a zero state
    const auto uv = to_vec(u), dov = to_vec(dout);
    std::vector<double> out_s(L * D), du_s(L * D), grads_s(grads_packed.size(), 0.0);
    Mamba3State<double> fin_s, dinit_s;
    for (std::size_t k = 0; k + 1 < cuts.size(); ++k) {
      const index_t t0 = cuts[k], len = cuts[k + 1] - t0;
      const bool first = k == 0, last = k + 2 == cuts.size();
      View2<double> wu("wu", len, D), wo("wo", len, D), wdo("wdo", len, D), wdu("wdu", len, D);
      from_vec(wu, std::vector<double>(uv.begin() + t0 * D, uv.begin() + (t0 + len) * D));
      from_vec(wdo, std::vector<double>(dov.begin() + t0 * D, dov.begin() + (t0 + len) * D));
      auto f = rig.mixer.make_state(1);
      Mamba3Acts<double> a;
      rig.mixer.forward(wu, 1, len, wo, a, true, first ? &init : nullptr, &f);
      rig.ps.zero_grads();
      auto di = rig.mixer.make_state(1);
      rig.mixer.backward(a, 1, len, wdo, wdu, last ? &dfin : nullptr, &di);
      const auto gk = to_vec(rig.ps.grads());
      for (std::size_t i = 0; i < gk.size(); ++i) grads_s[i] += gk[i];
      const auto wov = to_vec(wo), wduv = to_vec(wdu);
      std::copy(wov.begin(), wov.end(), out_s.begin() + t0 * D);
      std::copy(wduv.begin(), wduv.end(), du_s.begin() + t0 * D);
      if (first) dinit_s = di;
      if (last) fin_s = f;
    }
    // and the packed forward equals the naive reference that resets at each record
    mmref::M3Carry rf;
    const double er = std::max({rel_err(to_vec(out), rig.reference(u, 1, L, &init, &rf, ids)),
                                rel_err(to_vec(fin.carry.S), rf.S), rel_err(to_vec(fin.carry.phi), rf.phi)});
    INFO(variant_name(cfg));
    CHECK(er < 1e-12);
    const double eo = rel_err(to_vec(out), out_s), eu = rel_err(to_vec(du), du_s),
                 eg = rel_err(grads_packed, grads_s);
    const double ef = std::max({rel_err(to_vec(fin.carry.S), to_vec(fin_s.carry.S)),
                                rel_err(to_vec(fin.carry.k), to_vec(fin_s.carry.k)),
                                rel_err(to_vec(fin.carry.v), to_vec(fin_s.carry.v)),
                                rel_err(to_vec(fin.carry.phi), to_vec(fin_s.carry.phi))});
    const double ei = std::max({rel_err(to_vec(dinit.carry.S), to_vec(dinit_s.carry.S)),
                                rel_err(to_vec(dinit.carry.k), to_vec(dinit_s.carry.k)),
                                rel_err(to_vec(dinit.carry.v), to_vec(dinit_s.carry.v)),
                                rel_err(to_vec(dinit.carry.phi), to_vec(dinit_s.carry.phi))});
    CHECK(eo < 1e-12);
    CHECK(eu < 1e-12);
    CHECK(eg < 1e-12);
    CHECK(ef < 1e-12);
    CHECK(ei < 1e-12);
    WARN("packed vs separate records (" << variant_name(cfg) << "): out " << eo << ", du " << eu << ", param grads "
                                        << eg << ", final state " << ef << ", d(initial state) " << ei
                                        << "; vs reference " << er);
  }
}

TEST_CASE("Mamba-3 initialisation follows mamba_ssm", "[mamba3]") {
  Mamba3Config cfg = tiny_m3(true, true);
  cfg.d_model = 32;
  cfg.headdim = 16;  // 4 heads
  cfg.mimo_rank = 4;
  ParamStore<double> ps;
  const index_t n_layer = 4;
  Mamba3Mixer<double> mixer(cfg, ps, "m.", n_layer);
  ps.allocate();
  ps.initialize(11);
  for (double b : to_vec(ps.v1(ps.index("m.dt_bias")))) {
    const double dt = mmref::m3_softplus(b);
    CHECK(dt >= cfg.dt_min * (1 - 1e-12));
    CHECK(dt <= cfg.dt_max * (1 + 1e-12));
  }
  for (const char* one : {"m.D", "m.B_norm.weight", "m.C_norm.weight", "m.B_bias", "m.C_bias", "m.mimo_z",
                          "m.norm.weight"})
    for (double x : to_vec(ps.v1(ps.index(one)))) CHECK(x == 1.0);
  for (const char* inv : {"m.mimo_x", "m.mimo_o"})
    for (double x : to_vec(ps.v1(ps.index(inv)))) CHECK(x == Approx(0.25).epsilon(1e-15));
  CHECK(ps.entry("m.in_proj.weight").shape == std::vector<index_t>{cfg.d_in_proj(), cfg.d_model});
  // 2E + 2 R G N + 3H + S = 128 + 2*4*2*8 + 12 + 2
  CHECK(cfg.d_in_proj() == 128 + 128 + 12 + 2);
  const double out_bound = 1.0 / std::sqrt(double(cfg.d_inner())) / std::sqrt(double(n_layer));
  double out_max = 0;
  for (double w : to_vec(ps.v1(ps.index("m.out_proj.weight")))) out_max = std::max(out_max, std::abs(w));
  CHECK(out_max <= out_bound);
  CHECK(out_max > 0.9 * out_bound);
  CHECK(ps.entry("m.in_proj.weight").decay);
  CHECK(ps.entry("m.out_proj.weight").decay);
  CHECK_FALSE(ps.entry("m.B_bias").decay);
  // defaults: d_state 128, rope_fraction 0.5 -> 32 angles; SISO pairs interleaved, MIMO halved
  Mamba3Config def;
  CHECK(def.nangles() == 32);
  CHECK(def.pairing() == RopePairing::interleaved);
  def.is_mimo = true;
  CHECK(def.pairing() == RopePairing::halved);
}

TEST_CASE("Mamba-3 bad configurations are errors naming the values", "[mamba3]") {
  ParamStore<double> ps;
  Mamba3Config c = tiny_m3(false, false);
  c.headdim = 5;  // d_inner 12 % 5
  CHECK_THROWS_WITH(Mamba3Mixer<double>(c, ps, "m.", 1), ContainsSubstring("not divisible by headdim = 5"));
  c = tiny_m3(false, false);
  c.ngroups = 3;  // 4 heads % 3
  CHECK_THROWS_WITH(Mamba3Mixer<double>(c, ps, "m.", 1), ContainsSubstring("not divisible by ngroups = 3"));
  c = tiny_m3(true, false);
  c.mimo_rank = 0;
  CHECK_THROWS_WITH(Mamba3Mixer<double>(c, ps, "m.", 1), ContainsSubstring("mimo_rank must be at least 1 (got 0)"));
  c = tiny_m3(false, false);
  c.rope_fraction = 1.5;
  CHECK_THROWS_WITH(Mamba3Mixer<double>(c, ps, "m.", 1), ContainsSubstring("rope_fraction must be in [0, 1] (got 1.5)"));
  c = tiny_m3(false, false);
  c.chunk_size = 0;
  CHECK_THROWS_WITH(Mamba3Mixer<double>(c, ps, "m.", 1), ContainsSubstring("chunk_size (0)"));
  c = tiny_m3(false, false);
  c.d_state = 7;
  c.rope_fraction = 1.0;
  c.rope_pairing = Mamba3Config::Pairing::halved;
  CHECK_THROWS_WITH(Mamba3Mixer<double>(c, ps, "m.", 1), ContainsSubstring("even d_state (got 7)"));
  c = tiny_m3(false, false);
  c.dt_min = 0.2;
  c.dt_max = 0.1;
  CHECK_THROWS_WITH(Mamba3Mixer<double>(c, ps, "m.", 1), ContainsSubstring("got 0.2, 0.1"));
  // shapes handed to the mixer and the scan
  MixerRig rig(tiny_m3(false, false));
  View2<double> u("u", 10, 6), out("out", 10, 6);
  Mamba3Acts<double> acts;
  CHECK_THROWS_WITH(rig.mixer.forward(u, 2, 4, out, acts, false), ContainsSubstring("expected (batch * seqlen, d_model) = (8, 6)"));
  auto st = rig.mixer.make_state(3);
  CHECK_THROWS_WITH(rig.mixer.forward(u, 2, 5, out, acts, false, &st), ContainsSubstring("batch 3, not 2"));
  Mamba3ScanShape s;
  s.nheads = 4;
  s.ngroups = 3;
  s.seqlen = 5;
  CHECK_THROWS_WITH(s.validate("scan"), ContainsSubstring("nheads (4) is not divisible by ngroups (3)"));
  s.ngroups = 1;
  s.dstate = 4;
  s.nangles = 3;
  CHECK_THROWS_WITH(s.validate("scan"), ContainsSubstring("nangles (3) rotary pairs do not fit in dstate (4)"));
}
