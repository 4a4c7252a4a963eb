// Training: LR schedule, AdamW against a naive reference, the genome dataset, determinism, gradient accumulation,
// exact resume from a checkpoint, and no memory allocated per training step.
#include <cmath>
#include <csignal>
#include <filesystem>
#include <map>
#include <string>
#include <unistd.h>

#include "catch.hpp"
#include "io/genome_dataset.hpp"
#include "io/tokens.hpp"
#include "model/lm.hpp"
#include "train/optimizer.hpp"
#include "train/trainer.hpp"
#include "util.hpp"

using namespace mm;
using mmtest::to_vec;

TEST_CASE("LR schedule: linear warmup, then cosine to min_lr", "[train]") {
  LRSchedule s{1e-3, 1e-4, 10, 111};  // cosine over steps 10..110
  CHECK(s.at(0) == Approx(1e-4));
  CHECK(s.at(9) == Approx(1e-3));
  CHECK(s.at(10) == Approx(1e-3));
  CHECK(s.at(60) == Approx(0.5 * (1e-3 + 1e-4)));
  CHECK(s.at(110) == Approx(1e-4));
  CHECK(s.at(500) == Approx(1e-4));
  for (int i = 11; i < 111; ++i) CHECK(s.at(i) <= s.at(i - 1));
}

TEST_CASE("AdamW matches a naive reference (decay mask, clipping, bias correction)", "[train]") {
  ParamStore<double> ps;
  ps.add("w", {3, 2}, true, Init::Uniform(-1, 1));
  ps.add("b", {5}, false, Init::Uniform(-1, 1));
  ps.allocate();
  ps.initialize(1);
  AdamWConfig cfg;
  cfg.lr = 0.01;
  cfg.weight_decay = 0.2;
  cfg.grad_clip = 0.5;
  AdamW<double> opt(ps, cfg);
  std::vector<double> p = to_vec(ps.values()), m(p.size(), 0.0), v(p.size(), 0.0);
  const auto& entries = ps.entries();
  for (int step = 1; step <= 3; ++step) {
    ps.zero_grads();  // the alignment padding between parameters has no gradient
    for (std::size_t k = 0; k < entries.size(); ++k) mmtest::fill_uniform(ps.g1(k), 100 + 10 * step + k);
    auto g = to_vec(ps.grads());
    double norm = 0;
    for (double x : g) norm += x * x;
    norm = std::sqrt(norm);
    const double clip = norm > cfg.grad_clip ? cfg.grad_clip / (norm + 1e-6) : 1.0;
    const double lr = 0.01 * step;
    CHECK(opt.step(ps, lr, step) == Approx(norm).epsilon(1e-12));
    for (const auto& e : entries)
      for (index_t k = 0; k < e.size; ++k) {
        const std::size_t i = std::size_t(e.offset + k);
        const double gi = g[i] * clip;
        m[i] = cfg.beta1 * m[i] + (1 - cfg.beta1) * gi;
        v[i] = cfg.beta2 * v[i] + (1 - cfg.beta2) * gi * gi;
        const double upd = (m[i] / (1 - std::pow(cfg.beta1, step))) /
                           (std::sqrt(v[i] / (1 - std::pow(cfg.beta2, step))) + cfg.eps);
        p[i] -= lr * (upd + (e.decay ? cfg.weight_decay * p[i] : 0.0));
      }
    CHECK(mmtest::rel_err(to_vec(ps.values()), p) < 1e-14);
  }
}

namespace {

std::vector<io::FastaRecord> synthetic_genome() {
  // Two records with structure (a repeated motif with noise) and an N run.
  std::vector<io::FastaRecord> r(2);
  const char* motif = "ACGTTGCAAGGCTTAC";
  const CounterRNG rng{5, 5};
  for (int k = 0; k < 2; ++k) {
    r[k].name = "chr" + std::to_string(k + 1);
    for (int i = 0; i < 3000 + 700 * k; ++i) {
      char c = motif[(i * (k + 1)) % 16];
      if (rng.below(std::uint64_t(i + 10000 * k), 10) == 0) c = "ACGT"[rng.below(std::uint64_t(i + 77777 * k), 4)];
      r[k].seq.push_back(c);
    }
    r[k].seq.replace(100, 20, std::string(20, 'N'));
  }
  return r;
}

LMConfig tiny_lm() {
  LMConfig c;
  c.vocab_size = 8;
  c.n_layer = 2;
  c.mixer.d_model = 16;
  c.mixer.d_state = 8;
  c.mixer.headdim = 8;
  c.mixer.chunk = 16;
  return c;
}

TrainConfig tiny_train(std::int64_t steps) {
  TrainConfig t;
  t.steps = steps;
  t.schedule = LRSchedule{3e-3, 3e-4, 2, steps};
  t.log_interval = 0;
  t.verbose = false;
  t.seed = 7;
  return t;
}

std::string tmp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("mambamoe_train_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

}  // namespace

TEST_CASE("genome dataset: split, masked targets, held-out windows, reproducible sampling", "[train]") {
  const auto recs = synthetic_genome();
  io::GenomeDataset data(recs, 0.1, "synthetic");
  CHECK(data.train().size() + data.heldout().size() == std::int64_t(recs[0].seq.size() + recs[1].seq.size()));
  CHECK(data.heldout().size() == 300 + 370);
  // every held-out base except the first of each record is a target exactly once
  const auto wins = data.heldout_windows(64);
  const auto n_held = data.heldout().size();
  std::vector<std::int32_t> held_tok(static_cast<std::size_t>(n_held)), held_rec(held_tok.size());
  data.heldout().read(0, n_held, held_tok.data(), held_rec.data());
  std::vector<int> hits(std::size_t(n_held), 0);
  for (const auto& w : wins)
    for (std::int64_t t = 0; t < w.length; ++t) ++hits[std::size_t(w.start + t + 1)];
  for (std::size_t i = 0; i < hits.size(); ++i) {
    const bool first = i == 0 || held_rec[i] != held_rec[i - 1];
    CHECK(hits[i] == (first ? 0 : 1));
  }
  // held-out rows: targets are the next base when it is A/C/G/T, padding is never scored
  const auto hb = data.heldout_batch(wins, wins.size() - 1, 2, 64);
  const auto& last = wins.back();
  for (std::int64_t t = 0; t < 64; ++t) {
    if (t < last.length) {
      const auto next = held_tok[std::size_t(last.start + t + 1)];
      CHECK(hb.targets[std::size_t(t)] == (next == kN ? -1 : next));
    } else {
      CHECK(hb.targets[std::size_t(t)] == -1);
    }
    CHECK(hb.targets[std::size_t(64 + t)] == -1);  // the missing second row is padding
  }
  // targets: next base of the same record, -1 on N, at record ends and in padding
  const auto b1 = data.sample_train(7, 3, 1, 4, 50);
  const auto b2 = data.sample_train(7, 3, 1, 4, 50);
  CHECK(b1.tokens == b2.tokens);
  CHECK(b1.targets == b2.targets);
  const auto b3 = data.sample_train(7, 4, 1, 4, 50);
  CHECK(b1.tokens != b3.tokens);
  for (std::size_t i = 0; i + 1 < b1.tokens.size(); ++i) {
    if (i % 50 == 49) continue;
    if (b1.seq_idx[i + 1] == b1.seq_idx[i] && b1.tokens[i + 1] != kN) CHECK(b1.targets[i] == b1.tokens[i + 1]);
    if (b1.tokens[i + 1] == kN) CHECK(b1.targets[i] == -1);
  }
  CHECK_THROWS_WITH(data.sample_train(7, 0, 0, 1, 100000), ContainsSubstring("lower train.seq_len"));
}

TEST_CASE("training: the loss falls, runs are bit-identical, and a resumed run matches step for step",
          "[train]") {
  const auto recs = synthetic_genome();
  const io::GenomeDataset data(recs, 0.1, "synthetic");
  auto next = [&](std::int64_t step, std::int64_t micro) { return data.sample_train(7, step, micro, 4, 64); };
  const std::int64_t steps = 12;

  // Uninterrupted reference run.
  MambaLM<float> a(tiny_lm());
  a.initialize(7);
  Trainer<MambaLM<float>> ta(a, tiny_train(steps), "deck");
  ta.run(next, nullptr);
  REQUIRE(ta.history().size() == std::size_t(steps));
  CHECK(ta.history().back().loss < ta.history().front().loss - 0.1);

  // Same seed: bit-identical losses.
  MambaLM<float> b(tiny_lm());
  b.initialize(7);
  Trainer<MambaLM<float>> tb(b, tiny_train(steps), "deck");
  tb.run(next, nullptr);
  for (std::size_t i = 0; i < ta.history().size(); ++i) CHECK(ta.history()[i].loss == tb.history()[i].loss);

  const std::string ck = tmp_path("resume.h5");
  TrainConfig tr = tiny_train(steps);
  tr.resume = ck;

  // Interrupted run: a 5-step run on the 12-step schedule, then resume.
  {
    MambaLM<float> c(tiny_lm());
    c.initialize(7);
    TrainConfig tc = tiny_train(steps);
    tc.checkpoint_path = ck;
    Trainer<MambaLM<float>> t1(c, tc, "deck");
    int calls = 0;
    t1.run(
        [&](std::int64_t s, std::int64_t m) {
          if (++calls == 5) std::raise(SIGUSR1);  // a batch scheduler's warning signal during step 5
          return next(s, m);
        },
        nullptr);
    REQUIRE(t1.step() == 5);
    for (std::size_t i = 0; i < 5; ++i) CHECK(t1.history()[i].loss == ta.history()[i].loss);
  }
  MambaLM<float> e(tiny_lm());
  e.initialize(99);
  Trainer<MambaLM<float>> t3(e, tr, "deck");
  REQUIRE(t3.step() == 5);
  t3.run(next, nullptr);
  REQUIRE(t3.history().size() == std::size_t(steps - 5));
  for (std::size_t i = 0; i < t3.history().size(); ++i) {
    INFO("step " << t3.history()[i].step);
    CHECK(t3.history()[i].loss == ta.history()[5 + i].loss);
  }
  CHECK(to_vec(e.params().values()) == to_vec(a.params().values()));
  std::filesystem::remove(ck);
}

TEST_CASE("gradient accumulation: 2 micro-batches of B equal one batch of 2B", "[train]") {
  const auto recs = synthetic_genome();
  const io::GenomeDataset data(recs, 0.1, "synthetic");
  // The 2B batch is the concatenation of the two B-row micro-batches.
  auto micro = [&](std::int64_t step, std::int64_t m) { return data.sample_train(3, step, m, 2, 40); };
  auto whole = [&](std::int64_t step, std::int64_t) {
    auto x = micro(step, 0), y = micro(step, 1);
    x.batch += y.batch;
    x.tokens.insert(x.tokens.end(), y.tokens.begin(), y.tokens.end());
    x.targets.insert(x.targets.end(), y.targets.begin(), y.targets.end());
    x.seq_idx.insert(x.seq_idx.end(), y.seq_idx.begin(), y.seq_idx.end());
    return x;
  };
  TrainConfig ta = tiny_train(3), tb = tiny_train(3);
  ta.grad_accum = 2;
  MambaLM<double> a(tiny_lm()), b(tiny_lm());
  a.initialize(1);
  b.initialize(1);
  Trainer<MambaLM<double>> x(a, ta, "deck"), y(b, tb, "deck");
  x.run(micro, nullptr);
  y.run(whole, nullptr);
  for (int i = 0; i < 3; ++i) CHECK(x.history()[i].loss == Approx(y.history()[i].loss).epsilon(1e-12));
  CHECK(mmtest::rel_err(to_vec(a.params().values()), to_vec(b.params().values())) < 1e-10);
}

TEST_CASE("reverse-complement augmentation reads about half the windows on the other strand", "[train]") {
  const auto recs = synthetic_genome();
  const io::GenomeDataset data(recs, 0.1, "synthetic");
  const std::int64_t B = 64, L = 40;
  const auto f = data.sample_train(5, 2, 0, B, L, false);
  const auto r = data.sample_train(5, 2, 0, B, L, true);
  int flipped = 0;
  for (std::int64_t b = 0; b < B; ++b) {
    const auto row = [&](const io::HostBatch& h, std::int64_t t) { return h.tokens[std::size_t(b * L + t)]; };
    bool same = true;
    for (std::int64_t t = 0; t < L; ++t) same = same && row(f, t) == row(r, t);
    if (same) continue;
    ++flipped;
    // the flipped row is the forward window read backwards on the complementary strand
    for (std::int64_t t = 1; t < L; ++t) CHECK(row(r, t) == complement_token(row(f, L - t)));
    for (std::int64_t t = 0; t + 1 < L; ++t) {
      const auto tgt = r.targets[std::size_t(b * L + t)];
      if (tgt >= 0) CHECK(tgt == complement_token(row(f, L - t - 1)));
    }
  }
  CHECK(flipped > B / 5);
  CHECK(flipped < 4 * B / 5);
}

namespace {
// Kokkos allocations (any memory space) made while `on`, by label, from the Tools callbacks. Takes from the
// workspace cache ("pool:<label>", core/pool.hpp) allocate nothing and are not counted; nor are Kokkos' own
// buffers ("Kokkos::..."): on CUDA, Kokkos 4.6 reports a zero-byte "TeamScratchMemory" allocation for team
// launches without level-1 scratch, which is no memory at all.
struct AllocCounter {
  static inline bool on = false;
  static inline std::map<std::string, int> made;
  static void alloc(Kokkos_Profiling_SpaceHandle, const char* label, const void*, std::uint64_t) {
    const std::string l(label);
    if (!on || l.rfind("pool:", 0) == 0 || l.rfind("Kokkos", 0) == 0) return;
    ++made[l];
  }
  Kokkos::Tools::Experimental::EventSet saved = Kokkos::Tools::Experimental::get_callbacks();
  AllocCounter() {
    made.clear();
    Kokkos::Tools::Experimental::set_allocate_data_callback(alloc);
  }
  ~AllocCounter() {
    on = false;
    Kokkos::Tools::Experimental::set_callbacks(saved);
  }
};
}  // namespace

TEST_CASE("a training step on a device batch allocates no memory after the first one", "[train]") {
  // What the benchmark's LM step runs (zero the gradients, forward + backward, AdamW) for a model with every
  // layer kind: from the second step on, every buffer is a member kept while the shape holds or a block of the
  // workspace cache. An allocation per step is a cudaMalloc and a device-wide synchronizing cudaFree on CUDA.
  LMConfig c = tiny_lm();
  c.n_layer = 5;
  c.layers.pattern = parse_layer_pattern("M2 M1 M3 E D", "test");
  c.layers.mamba1.d_state = 8;
  c.layers.mamba3.d_state = 16;
  c.layers.mamba3.headdim = 8;
  c.layers.mamba3.chunk_size = 16;
  c.layers.moe.n_experts = 4;
  c.layers.moe.top_k = 2;
  c.layers.moe.d_ff = 48;
  c.layers.moe.shared_d_ff = 24;
  c.layers.dense_d_ff = 40;
  MambaLM<float> lm(c);
  lm.initialize(3);
  AdamW<float> opt(lm.params(), AdamWConfig{});
  io::HostBatch hb(2, 48);
  for (std::size_t i = 0; i < hb.tokens.size(); ++i) {
    hb.tokens[i] = std::int32_t(i * 7 % 5);
    hb.targets[i] = std::int32_t(i * 3 % 5);
    hb.seq_idx[i] = 0;
  }
  const Batch b = to_device(hb);
  std::int64_t step = 0;
  auto one = [&] {
    lm.params().zero_grads();
    lm.forward_backward(b, 1.0 / double(hb.batch * hb.seqlen), Recompute::mixer);
    opt.step(lm.params(), 1e-3, ++step);
  };
  AllocCounter count;
  one();
  Kokkos::fence();
  AllocCounter::on = true;
  one();
  one();
  Kokkos::fence();
  AllocCounter::on = false;
  std::string labels;
  for (const auto& [l, n] : AllocCounter::made) labels += " " + l + " x" + std::to_string(n);
  INFO("allocations in steps 2 and 3:" << labels);
  CHECK(AllocCounter::made.empty());
}
