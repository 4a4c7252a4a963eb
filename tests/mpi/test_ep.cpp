// The MoE layer under expert and context parallelism against the single-rank layer that every rank also runs by
// itself on the same inputs (double, relative error <= 1e-10):
//   ep = n:         every ep rank has its own sequences; outputs, input gradients, router/shared-expert gradients,
//                   the losses and the routing statistics equal the single-rank layer on that rank's rows, and an
//                   owner's expert-weight gradients equal the sum over the ep ranks of the single-rank gradients;
//   cp = n:         one set of sequences split over the cp ranks; everything equals the single-rank layer on the
//                   whole sequences (parameter gradients after the sum over cp), dropped assignments included;
//   cp = 2, ep = 2: both at once (4 ranks).
// Plus the layout errors: n_experts not divisible by ep, a cp layer without the batch structure.
#include <memory>
#include <string>
#include <vector>

#include "catch.hpp"
#include "moe/moe_layer.hpp"
#include "mpi/mpi_util.hpp"
#include "util.hpp"

using namespace mm;
using mmtest::fill_uniform;
using mmtest::rel_err;
using mmtest::to_vec;

namespace {

constexpr double kTol = 1e-10;

struct EpCase {
  const char* name;
  index_t E, k;
  double cf;  // capacity factor, 0 dropless
  index_t shared;
  ScoreFunc score;
  bool renorm, state_aware, bias, jitter;
};

// top-1 and top-2, 4 and 8 experts, dropless and capacity, shared expert on and off, and one case with the state-aware
// router, the expert bias and the router jitter (drawn by the single-rank row index)
const EpCase kCases[] = {
    {"E4 top1 dropless", 4, 1, 0.0, 0, ScoreFunc::softmax, false, false, false, false},
    {"E4 top2 dropless shared", 4, 2, 0.0, 5, ScoreFunc::softmax, false, false, false, false},
    {"E4 top2 capacity", 4, 2, 0.75, 0, ScoreFunc::softmax, false, false, false, false},
    {"E8 top1 capacity sigmoid renorm shared", 8, 1, 1.0, 6, ScoreFunc::sigmoid, true, false, false, false},
    {"E8 top2 dropless sigmoid", 8, 2, 0.0, 0, ScoreFunc::sigmoid, false, false, false, false},
    {"E8 top2 capacity shared state bias jitter", 8, 2, 0.6, 4, ScoreFunc::softmax, false, true, true, true},
};

MoEConfig make_cfg(const EpCase& c) {
  MoEConfig m;
  m.d_model = 8;
  m.d_ff = 12;
  m.n_experts = c.E;
  m.top_k = c.k;
  m.score_func = c.score;
  m.renormalize = c.renorm;
  m.capacity_factor = c.cf;
  m.shared_d_ff = c.shared;
  m.state_aware = c.state_aware;
  m.bias_update_rate = c.bias ? 1e-3 : 0.0;
  m.jitter = c.jitter ? 0.2 : 0.0;
  m.aux_loss_coef = 0.3;  // large, so the aux-loss gradients matter in the comparison
  m.z_loss_coef = 0.05;
  return m;
}

// Same seed on every rank: the replicated parameters agree, and the expert shards are slices of the full tensors
// (initialisation draws by global index). The router weight and the expert bias are redrawn larger, so routing
// varies and the bias changes selections.
void init_params(ParamStore<double>& ps) {
  ps.allocate();
  ps.initialize(11);
  fill_uniform(ps.v1(ps.index("moe.router.weight")), 41, -1.0, 1.0);
  if (ps.has("moe.router.expert_bias")) fill_uniform(ps.v1(ps.index("moe.router.expert_bias")), 43, -0.1, 0.1);
}

struct Inputs {
  View2<double> x, state, dout;
};

// Sequence set `set`: B sequences of L tokens, rows b * L + t.
Inputs make_inputs(const MoEConfig& cfg, index_t rows, int set) {
  Inputs in;
  in.x = View2<double>("x", rows, cfg.d_model);
  in.state = View2<double>("state", cfg.state_aware ? rows : 0, cfg.d_model);
  in.dout = View2<double>("dout", rows, cfg.d_model);
  fill_uniform(in.x, 100 + set, -1.5, 1.5);
  if (cfg.state_aware) fill_uniform(in.state, 300 + set);
  fill_uniform(in.dout, 200 + set);
  return in;
}

// Rows [c * Lr, (c+1) * Lr) of every sequence: local row b * Lr + t = row b * L + c * Lr + t.
View2<double> cp_slice(const View2<double>& full, index_t B, index_t L, int c, int C) {
  const index_t Lr = L / C, d = full.extent(1);
  View2<double> out("slice", B * Lr, d);
  auto hf = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), full);
  auto ho = Kokkos::create_mirror_view(Kokkos::HostSpace(), out);
  for (index_t b = 0; b < B; ++b)
    for (index_t t = 0; t < Lr; ++t)
      for (index_t j = 0; j < d; ++j) ho(b * Lr + t, j) = hf(b * L + c * Lr + t, j);
  Kokkos::deep_copy(out, ho);
  return out;
}

struct Run {
  std::vector<double> out, dx, dstate;
  MoELosses L;
  MoEStats stats;
  std::vector<double> grads;  // the whole gradient buffer
};

Run run(const MoELayer<double>& layer, ParamStore<double>& ps, const Inputs& in, const MoEStep& step, bool save) {
  Run r;
  const index_t n = in.x.extent(0), d = in.x.extent(1);
  View2<double> out("out", n, d), dx("dx", n, d), dstate("dstate", in.state.extent(0), d);
  MoEActs<double> acts;
  r.L = layer.forward(in.x, out, acts, save, step, in.state);
  r.stats = acts.stats;
  ps.zero_grads();
  layer.backward(acts, in.dout, dx, 0.7, dstate);
  r.out = to_vec(out);
  r.dx = to_vec(dx);
  r.dstate = to_vec(dstate);
  r.grads = to_vec(ps.grads());
  return r;
}

std::vector<double> part(const std::vector<double>& v, index_t off, index_t n) {
  return std::vector<double>(v.begin() + off, v.begin() + off + n);
}

// One layout (cp x ep ranks, the others data-parallel copies): ep rank e holds its own B sequences of
// L_e = cp * (5 + e) tokens, split over the cp ranks.
// The ep rank's parameter gradients `got` (store `ps`) against the single-rank layer's (store `rs`), one reference
// run per ep rank: a replicated parameter's against this rank's run, the owner's block of an expert tensor against
// the sum of that block over every ep rank's run (each rank's rows reach the owner).
template <class Store, class RunT, class Check>
void check_ep_grads(const Store& ps, const Store& rs, const std::vector<double>& got, const std::vector<RunT>& refs,
                    int er, index_t El, const Check& chk) {
  for (const auto& pe : ps.entries()) {
    const ParamEntry& re = rs.entry(pe.name);
    const auto g = part(got, pe.offset, pe.size);
    if (pe.name.find("experts.") == std::string::npos) {
      chk(pe.name, g, part(refs[std::size_t(er)].grads, re.offset, re.size));
    } else {
      const index_t per = pe.size / El;
      std::vector<double> sum(std::size_t(pe.size), 0.0);
      for (const RunT& ref : refs) {
        const auto r = part(ref.grads, re.offset + er * El * per, El * per);
        for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += r[i];
      }
      chk(pe.name, g, sum);
    }
  }
}

void check_layout(const parallel::Layout& layout, const EpCase& c, bool save, double& worst) {
  const int n = mmtest::world_size();
  const parallel::Layout lay = parallel::resolve_layout(layout, n);
  parallel::ProcessGrid grid(lay, MPI_COMM_WORLD);
  const parallel::ModelComms comms = grid.model_comms();
  const int C = int(lay.cp), R = int(lay.ep), cr = grid.cp_rank(), er = grid.ep_rank();
  const MoEConfig cfg = make_cfg(c);
  const index_t B = 2, E = cfg.n_experts, El = E / R;
  auto seqlen = [&](int e) { return index_t(C) * (5 + e); };
  const MoEStep step0{true, 77, 3, 0};

  // the single-rank references of every ep rank's sequences
  ParamStore<double> rps;
  MoELayer<double> ref(cfg, rps, "moe.", 2);
  init_params(rps);
  std::vector<Run> refs;
  index_t dropped_ref = 0;
  for (int e = 0; e < R; ++e) {
    refs.push_back(run(ref, rps, make_inputs(cfg, B * seqlen(e), e), step0, true));
    dropped_ref += refs.back().stats.dropped;
  }
  if (c.cf > 0) CHECK(dropped_ref > 0);  // the capacity cases do drop assignments
  else CHECK(dropped_ref == 0);

  // the parallel layer
  ParamStore<double> pps;
  MoELayer<double> par(cfg, pps, "moe.", 2, comms);
  init_params(pps);
  CHECK(par.local_experts() == El);
  CHECK(par.first_expert() == er * El);
  for (const char* w : {"experts.w1", "experts.w3", "experts.w2"}) {
    const ParamEntry& pe = pps.entry(std::string("moe.") + w);
    const ParamEntry& re = rps.entry(std::string("moe.") + w);
    CHECK(pe.shape[0] == El);
    CHECK(pe.global_shape() == re.shape);
    if (R > 1) {
      CHECK(pe.shard.split == Split::ep);
      REQUIRE(pe.shard.rows.size() == 1);
      CHECK(pe.shard.rows[0].begin == er * El);
      CHECK(pe.shard.rows[0].count == El);
    } else {
      CHECK(!pe.sharded());  // ep = 1: exactly the single-rank registration
    }
    // the shard holds the slice of the unsharded tensor
    const index_t per = pe.size / El;
    CHECK(to_vec(pps.v1(pps.index(pe.name))) == part(to_vec(rps.v1(rps.index(re.name))), er * El * per, El * per));
  }
  for (const auto& e : pps.entries())
    if (e.name.find("experts.") == std::string::npos) CHECK(!e.sharded());

  const index_t L = seqlen(er);
  const Inputs full = make_inputs(cfg, B * L, er);
  Inputs mine;
  mine.x = cp_slice(full.x, B, L, cr, C);
  mine.state = cfg.state_aware ? cp_slice(full.state, B, L, cr, C) : full.state;
  mine.dout = cp_slice(full.dout, B, L, cr, C);
  MoEStep step = step0;
  step.batch = B;
  comms.ep->reset_bytes_sent();
  par.take_exchange_seconds();
  Run got = run(par, pps, mine, step, save);
  if (R > 1) CHECK(comms.ep->bytes_sent() > 0);  // the experts' tokens did travel
  // the all-to-all time is counted under ep > 1 only, and reading it starts a new count
  const double exchange = par.take_exchange_seconds();
  CHECK((R > 1 ? exchange > 0 : exchange == 0));
  CHECK(par.take_exchange_seconds() == 0);
  // parameter gradients: the sum over the cp ranks (each holds its tokens' part)
  comms.cp->allreduce_sum(got.grads.data(), got.grads.size());

  const Run& want = refs[er];
  auto local_rows = [&](const std::vector<double>& v) {
    View2<double> f("f", B * L, cfg.d_model);
    if (v.empty()) return v;
    mmtest::from_vec(f, v);
    return to_vec(cp_slice(f, B, L, cr, C));
  };
  auto chk = [&](const std::string& what, const std::vector<double>& a, const std::vector<double>& b) {
    const double err = rel_err(a, b);
    worst = std::max(worst, err);
    INFO(what << " rel err " << err);
    CHECK(err <= kTol);
  };
  chk("out", got.out, local_rows(want.out));
  chk("dx", got.dx, local_rows(want.dx));
  if (cfg.state_aware) chk("dstate", got.dstate, local_rows(want.dstate));
  CHECK(std::abs(got.L.aux - want.L.aux) <= kTol * std::abs(want.L.aux));
  CHECK(std::abs(got.L.z - want.L.z) <= kTol * std::abs(want.L.z));
  CHECK(want.L.aux > 0);
  CHECK(got.stats.routed == want.stats.routed);
  CHECK(got.stats.kept == want.stats.kept);
  CHECK(got.stats.dropped == want.stats.dropped);
  CHECK(got.stats.tokens == want.stats.tokens);
  CHECK(got.stats.capacity == want.stats.capacity);
  check_ep_grads(pps, rps, got.grads, refs, er, El, chk);
}

void sweep(const parallel::Layout& layout) {
  double worst = 0;
  for (const EpCase& c : kCases)
    for (bool save : {true, false}) {
      INFO(mmtest::describe(layout) << ", " << c.name << ", save " << save);
      check_layout(layout, c, save, worst);
    }
  if (mmtest::world_rank() == 0)
    std::printf("[ep] %s at %d ranks: worst relative error %.3g\n", mmtest::describe(layout).c_str(),
                mmtest::world_size(), worst);
}

// A communicator of a given size that never communicates (for the constructor's layout checks).
class SizeOnlyComm final : public parallel::Comm {
 public:
  explicit SizeOnlyComm(int n) : n_(n) {}
  int rank() const override { return 0; }
  int size() const override { return n_; }
  void barrier() const override {}
  void allreduce_sum(void*, std::size_t, parallel::DType) const override { fail(); }
  void allgather(const void*, void*, std::size_t, parallel::DType) const override { fail(); }
  void broadcast(void*, std::size_t, parallel::DType, int) const override { fail(); }
  void sendrecv(const void*, std::size_t, int, void*, std::size_t, int, parallel::DType) const override { fail(); }
  void alltoallv(const void*, const std::vector<std::size_t>&, void*, const std::vector<std::size_t>&,
                 parallel::DType) const override {
    fail();
  }

 private:
  static void fail() { throw Error("SizeOnlyComm", "no communication expected"); }
  int n_;
};

// The bf16 expert path (float layers under set_float_gemm_compute(bf16)) under ep = world size: the parallel
// layer against the single-rank bf16 layer on every ep rank's rows. Both round the same values to bf16, but the
// owner's GEMMs see other row counts (the rows of all source ranks), so fp32 sums may differ in the last bit and a
// rounding may land one bf16 step apart: the tolerance is 1e-2 of the largest magnitude.
void check_ep_bf16(const EpCase& c, bool save, double& worst) {
  const int R = mmtest::world_size();
  parallel::ProcessGrid grid(parallel::resolve_layout({1, 1, R, 1}, R), MPI_COMM_WORLD);
  const parallel::ModelComms comms = grid.model_comms();
  const int er = grid.ep_rank();
  const MoEConfig cfg = make_cfg(c);
  const index_t El = cfg.n_experts / R, d = cfg.d_model;
  const MoEStep step{true, 77, 3, 0};
  auto init = [](ParamStore<float>& ps) {
    ps.allocate();
    ps.initialize(11);
    fill_uniform(ps.v1(ps.index("moe.router.weight")), 41, -1.0, 1.0);
    if (ps.has("moe.router.expert_bias")) fill_uniform(ps.v1(ps.index("moe.router.expert_bias")), 43, -0.1, 0.1);
  };
  struct RunF {
    std::vector<double> out, dx, ds, grads;
    bool bf16 = false;
  };
  auto go = [&](const MoELayer<float>& layer, ParamStore<float>& ps, int set) {
    const index_t n = 2 * (5 + set);
    View2<float> x("x", n, d), st("st", cfg.state_aware ? n : 0, d), dout("dout", n, d);
    fill_uniform(x, 100 + set, -1.5, 1.5);
    if (cfg.state_aware) fill_uniform(st, 300 + set);
    fill_uniform(dout, 200 + set);
    View2<float> out("out", n, d), dx("dx", n, d), ds("ds", st.extent(0), d);
    MoEActs<float> acts;
    RunF r;
    layer.forward(x, out, acts, save, step, st);
    r.bf16 = acts.bf16_experts;
    ps.zero_grads();
    layer.backward(acts, dout, dx, 0.7, ds);
    r.out = to_vec(out);
    r.dx = to_vec(dx);
    r.ds = to_vec(ds);
    r.grads = to_vec(ps.grads());
    return r;
  };
  ParamStore<float> rps, pps;
  MoELayer<float> ref(cfg, rps, "moe.", 2), par(cfg, pps, "moe.", 2, comms);
  init(rps);
  init(pps);
  std::vector<RunF> refs;
  RunF got;
  {
    const FloatGemmComputeScope b16(GemmCompute::bf16);  // the float layers take their bf16 expert path
    for (int e = 0; e < R; ++e) refs.push_back(go(ref, rps, e));
    comms.ep->reset_bytes_sent();
    got = go(par, pps, er);
  }
  if (R > 1) CHECK(comms.ep->bytes_sent() > 0);
  CHECK(got.bf16);
  CHECK(refs[er].bf16);
  auto chk = [&](const std::string& what, const std::vector<double>& a, const std::vector<double>& b) {
    const double err = rel_err(a, b);
    worst = std::max(worst, err);
    INFO(what << " rel err " << err);
    CHECK(err <= 1e-2);
  };
  const RunF& want = refs[er];
  chk("out", got.out, want.out);
  chk("dx", got.dx, want.dx);
  if (cfg.state_aware) chk("dstate", got.ds, want.ds);
  check_ep_grads(pps, rps, got.grads, refs, er, El, chk);
}

}  // namespace

TEST_CASE("MoE expert parallelism with the bf16 expert path equals the single-rank bf16 layer per rank", "[ep]") {
  double worst = 0;
  for (const EpCase& c : kCases)
    for (bool save : {true, false}) {
      INFO(c.name << ", save " << save);
      check_ep_bf16(c, save, worst);
    }
  if (mmtest::world_rank() == 0)
    std::printf("[ep] bf16 expert path, ep at %d ranks: worst relative error %.3g\n", mmtest::world_size(), worst);
}

TEST_CASE("MoE expert parallelism (ep = world size) equals the single-rank layer per rank", "[ep]") {
  sweep({1, 1, mmtest::world_size(), 1});
}

TEST_CASE("MoE under context parallelism (cp = world size) equals the single-rank layer on whole sequences", "[ep]") {
  sweep({1, mmtest::world_size(), 1, 1});
}

TEST_CASE("MoE under cp = 2 and ep = 2 together", "[ep]") {
  if (mmtest::world_size() != 4) return;  // the layout needs 4 ranks
  sweep({1, 2, 2, 1});
}

TEST_CASE("MoE parallel layout errors name the values", "[ep]") {
  MoEConfig cfg = make_cfg(kCases[1]);
  parallel::ModelComms comms;
  comms.ep = std::make_shared<SizeOnlyComm>(3);
  ParamStore<double> ps;
  CHECK_THROWS_WITH(MoELayer<double>(cfg, ps, "moe.", 1, comms),
                    ContainsSubstring("n_experts = 4 does not divide by ep = 3"));
  // cp > 1 needs the sequence structure of the rows
  parallel::ModelComms cpc;
  cpc.cp = std::make_shared<SizeOnlyComm>(2);
  ParamStore<double> ps2;
  MoELayer<double> layer(cfg, ps2, "moe.", 1, cpc);
  init_params(ps2);
  View2<double> x("x", 6, cfg.d_model), out("out", 6, cfg.d_model);
  MoEActs<double> acts;
  CHECK_THROWS_WITH(layer.forward(x, out, acts, true, MoEStep{}), ContainsSubstring("needs MoEStep::batch"));
  CHECK_THROWS_WITH(layer.forward(x, out, acts, true, MoEStep{false, 0, 0, 4}),
                    ContainsSubstring("rows = 6 do not divide into batch = 4 sequences"));
}
