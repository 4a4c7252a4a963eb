// The training step of a small Mamba-2 + MoE language model (pattern M2 E M2 E, top-2 dropless experts with a shared
// expert, load-balancing and z losses, packed records) under every layout the world's size allows with tp <= 2:
// at 2 ranks (dp2), (tp2), (cp2), (ep2); at 4 ranks (dp4), (cp4), (ep4), (tp2, cp2), (tp2, ep2), (tp2, dp2),
// (cp2, ep2), (cp2, dp2), (ep2, dp2), (cp2, ep2)... The sequence length (36) is not a multiple of the chunk (8),
// nor is any cp slice. Each rank also trains the same model alone (the one-rank reference); the step's loss, its
// gradient norm and every gradient element (a slice compared with the matching elements of the reference) agree
// within 1e-5 relative (fp32). Parameters after the update are compared too. A second model (M1 M3 D E) runs the
// layouts with tp = 1 (Mamba-3 has no tensor parallelism): Mamba-1 and Mamba-3 state passing under cp, the dense
// FFN and MoE layers token-local. The sweep runs over MPI communicators,
// and again over NCCL ones where the build has NCCL on CUDA and every rank has its own GPU.
#include <algorithm>
#include <cmath>

#include "catch.hpp"
#include "core/rng.hpp"
#include "model/lm.hpp"
#include "mpi/mpi_util.hpp"
#include "train/trainer.hpp"

using namespace mm;

namespace {

LMConfig layouts_lm() {
  LMConfig c;
  c.vocab_size = 8;
  c.mixer.d_model = 16;
  c.mixer.d_state = 8;
  c.mixer.headdim = 4;  // 8 heads
  c.mixer.ngroups = 2;
  c.mixer.chunk = 8;
  c.layers.pattern = parse_layer_pattern("M2 E M2 E", "test");
  c.n_layer = 4;
  c.layers.moe.n_experts = 4;
  c.layers.moe.top_k = 2;
  c.layers.moe.d_ff = 8;
  c.layers.moe.aux_loss_coef = 0.1;
  c.layers.moe.z_loss_coef = 0.01;
  c.layers.moe.shared_d_ff = 4;
  return c;
}

constexpr index_t kBatch = 2, kLen = 36;

io::HostBatch micro_batch(std::int64_t step, std::int64_t micro) {
  io::HostBatch hb(kBatch, kLen);
  const CounterRNG rng{5, std::uint64_t(100 * step + micro)};
  for (index_t i = 0; i < kBatch * kLen; ++i) hb.tokens[i] = 1 + std::int32_t(rng.uniform(std::uint64_t(i), 0.0, 6.0));
  for (index_t i = 0; i < kBatch * kLen; ++i) {
    const index_t t = i % kLen;
    hb.seq_idx[i] = (i / kLen == 0 && t >= 15) ? 1 : 0;  // row 0 packs two records (boundary inside a cp slice)
    hb.targets[i] = t == kLen - 1 ? -1 : hb.tokens[i + 1];
  }
  return hb;
}

TrainConfig one_step() {
  TrainConfig t;
  t.steps = 1;
  t.grad_accum = 4;
  t.schedule = LRSchedule{3e-3, 3e-4, 0, 1};
  t.log_interval = 0;
  t.verbose = false;
  t.seed = 7;
  t.gather_buffer_bytes = 4096;  // many all-gather buckets: the data-parallel sums must not notice
  return t;
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-30); }

}  // namespace

namespace {
// MPI, and NCCL where the build and the machine allow it (one GPU per rank)
std::vector<parallel::Backend> backends_here() {
  std::vector<parallel::Backend> backends{parallel::Backend::mpi};
  if (parallel::nccl_one_gpu_per_rank(MPI_COMM_WORLD)) backends.push_back(parallel::Backend::nccl);
  else if (mmtest::world_rank() == 0) std::printf("layouts: the NCCL backend is not run (%s)\n",
                                                  parallel::nccl_available() ? "fewer GPUs than ranks" : "not built");
  return backends;
}

// One training step of `cfg` under every layout at the world's size with tp <= max_tp, against the one-rank step.
void check_layouts(const LMConfig& cfg, std::int64_t max_tp, const char* label) {
  const int n = mmtest::world_size();
  auto next = [](std::int64_t s, std::int64_t m) { return micro_batch(s, m); };

  MambaLM<float> ref(cfg);
  ref.initialize(7);
  Trainer<MambaLM<float>> tref(ref, one_step(), "deck");
  tref.run(next, {});
  const auto& rps = ref.params();
  auto rg = Kokkos::create_mirror_view_and_copy(HostMem(), rps.grads());
  auto rv = Kokkos::create_mirror_view_and_copy(HostMem(), rps.values());

  // every layout over MPI, then again over NCCL where the build and the machine allow it
  for (const auto backend : backends_here())
  for (const auto& l : mmtest::all_layouts(n)) {
    if (l.tp > max_tp) continue;
    const bool nccl = backend == parallel::Backend::nccl;
    INFO(label << ": " << mmtest::describe(l) << (nccl ? " nccl" : ""));
    auto grid = std::make_shared<parallel::ProcessGrid>(l, MPI_COMM_WORLD, backend);
    MambaLM<float> model(cfg, grid->model_comms());
    model.initialize(7);
    // the model's parameter counts, not this rank's slice (the driver prints them)
    CHECK(model.param_count() == ref.param_count());
    CHECK(model.active_param_count() == ref.active_param_count());
    TrainConfig tc = one_step();
    tc.grid = grid;
    Trainer<MambaLM<float>> t(model, tc, "deck");
    t.run(next, {});
    REQUIRE(t.history().size() == 1);
    const double el = rel(t.history()[0].loss, tref.history()[0].loss);
    const double en = rel(t.history()[0].grad_norm, tref.history()[0].grad_norm);
    CHECK(el < 1e-5);
    CHECK(en < 1e-5);
    const auto& ps = model.params();
    auto g = Kokkos::create_mirror_view_and_copy(HostMem(), ps.grads());
    auto v = Kokkos::create_mirror_view_and_copy(HostMem(), ps.values());
    double worst_g = 0, worst_v = 0;
    std::string worst_name;
    for (const auto& e : ps.entries()) {
      const auto& re = rps.entry(e.name);
      const auto gi = e.global_index();
      double dg = 0, ng = 0, dv = 0, nv = 0;
      for (std::size_t k = 0; k < gi.size(); ++k) {
        const double a = g(e.offset + index_t(k)), b = rg(re.offset + gi[k]);
        dg += (a - b) * (a - b), ng += b * b;
        const double x = v(e.offset + index_t(k)), y = rv(re.offset + gi[k]);
        dv += (x - y) * (x - y), nv += y * y;
      }
      const double eg = ng > 0 ? std::sqrt(dg / ng) : std::sqrt(dg), ev = nv > 0 ? std::sqrt(dv / nv) : std::sqrt(dv);
      if (eg > worst_g) worst_g = eg, worst_name = e.name;
      worst_v = std::max(worst_v, ev);
    }
    INFO("worst gradient " << worst_name);
    CHECK(worst_g < 1e-5);
    CHECK(worst_v < 1e-5);
    if (mmtest::world_rank() == 0)
      std::printf("%s layout %s%s: loss rel err %.2e, grad norm rel err %.2e, worst gradient rel err %.2e (%s), "
                  "worst parameter rel err %.2e\n",
                  label, mmtest::describe(l).c_str(), nccl ? " (nccl)" : "", el, en, worst_g, worst_name.c_str(), worst_v);
  }
}
}  // namespace

TEST_CASE("layouts: a Mamba-2 + MoE training step equals the one-rank step", "[layouts]") {
  check_layouts(layouts_lm(), 2, "M2 E M2 E");  // tp <= 2: ngroups = 2
}

// Every other layer kind under the layouts it supports: Mamba-1 and Mamba-3 pass their states under cp, the dense
// FFN and the MoE layer are token-local (Mamba-3 has no tensor parallelism: tp = 1 only).
TEST_CASE("layouts: a Mamba-1 + Mamba-3 + dense + MoE training step equals the one-rank step", "[layouts]") {
  LMConfig c = layouts_lm();
  c.layers.pattern = parse_layer_pattern("M1 M3 D E", "test");
  c.layers.mamba1.d_state = 4;
  c.layers.mamba1.dt_rank = 2;
  c.layers.mamba1.chunk = 8;
  c.layers.mamba3.d_state = 4;
  c.layers.mamba3.headdim = 4;
  c.layers.mamba3.chunk_size = 8;
  c.layers.dense_d_ff = 8;
  check_layouts(c, 1, "M1 M3 D E");
}

TEST_CASE("ZeRO-1: sharded AdamW moments give the parameters of plain data parallelism, bit for bit", "[layouts]") {
  const int n = mmtest::world_size();
  const LMConfig cfg = layouts_lm();
  auto next = [](std::int64_t s, std::int64_t m) { return micro_batch(s, m); };
  parallel::Layout l;
  l.dp = n;
  auto grid = std::make_shared<parallel::ProcessGrid>(l, MPI_COMM_WORLD);
  std::vector<std::vector<float>> values;
  for (bool zero : {false, true}) {
    MambaLM<float> model(cfg, grid->model_comms());
    model.initialize(7);
    TrainConfig tc = one_step();
    tc.steps = 4;
    tc.grid = grid;
    tc.zero1 = zero;
    Trainer<MambaLM<float>> t(model, tc, "deck");
    t.run(next, {});
    // the moments are sharded: each rank holds 1/dp of them
    const index_t total = model.params().total(), shard = (total + n - 1) / n;
    const index_t expect = zero ? std::min(total, shard * (mmtest::world_rank() + 1)) - shard * mmtest::world_rank()
                                : total;
    CHECK(index_t(t.optimizer().m().extent(0)) == expect);
    auto h = Kokkos::create_mirror_view_and_copy(HostMem(), model.params().values());
    values.emplace_back(h.data(), h.data() + h.extent(0));
  }
  CHECK(values[0] == values[1]);
}

// The data-parallel gradient exchange overlapped with the backward (buckets started from the model's hook, several
// in flight; the default) sums exactly what the exchange after the backward sums: two steps under every layout
// with data ranks (ep * dp > 1), bit for bit, including the cp all-reduce per bucket and the expert slices.
TEST_CASE("layouts: the gradient exchange overlapped with the backward equals the one after it, bit for bit",
          "[layouts]") {
  const int n = mmtest::world_size();
  auto next = [](std::int64_t s, std::int64_t m) { return micro_batch(s, m); };
  int checked = 0;
  for (const auto backend : backends_here())
    for (const auto& l : mmtest::all_layouts(n)) {
      if (l.tp > 2 || l.ep * l.dp == 1) continue;
      INFO(mmtest::describe(l) << (backend == parallel::Backend::nccl ? " nccl" : ""));
      auto grid = std::make_shared<parallel::ProcessGrid>(l, MPI_COMM_WORLD, backend);
      std::vector<std::vector<float>> values, grads;
      std::vector<double> losses;
      for (bool overlap : {false, true}) {
        MambaLM<float> model(layouts_lm(), grid->model_comms());
        model.initialize(7);
        TrainConfig tc = one_step();
        tc.steps = 2;
        tc.grid = grid;
        tc.overlap_grad_reduce = overlap;
        Trainer<MambaLM<float>> t(model, tc, "deck");
        t.run(next, {});
        // overlapped: most buckets start inside the backward (only those holding the embedding wait for its end)
        const auto [during, after] = t.overlap_counts();
        CHECK(during > (overlap ? after : -1));
        if (!overlap) CHECK(during + after == 0);
        for (const auto& h : t.history()) losses.push_back(h.loss), losses.push_back(h.grad_norm);
        auto v = Kokkos::create_mirror_view_and_copy(HostMem(), model.params().values());
        auto g = Kokkos::create_mirror_view_and_copy(HostMem(), model.params().grads());
        values.emplace_back(v.data(), v.data() + v.extent(0));
        grads.emplace_back(g.data(), g.data() + g.extent(0));
      }
      REQUIRE(losses.size() == 8);
      CHECK(std::equal(losses.begin(), losses.begin() + 4, losses.begin() + 4));
      CHECK(grads[0] == grads[1]);
      CHECK(values[0] == values[1]);
      ++checked;
    }
  if (n > 1) CHECK(checked > 0);
}
