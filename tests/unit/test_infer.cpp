// Inference (model/infer): streaming scoring in windows with the decode state carried between them equals the
// one-pass forward of the training objective, for any window (1, non-dividing, longer than the stream) and any way
// the stream is fed; the sampling distribution (temperature, top-k, top-p, candidates) on a known distribution;
// top-k 1 sampling is greedy decoding (checked against an argmax over full forwards); generation is deterministic
// in the seed and independent of the prompt window and of the number of rows generated together.
#include <cmath>
#include <limits>

#include "catch.hpp"
#include "core/error.hpp"
#include "model/infer.hpp"
#include "util.hpp"

using namespace mm;
using mmtest::rel_err;
using mmtest::to_vec;

namespace {

LMConfig infer_lm() {
  LMConfig c;
  c.vocab_size = 8;
  c.mixer.d_model = 8;
  c.mixer.d_state = 4;
  c.mixer.headdim = 4;
  c.mixer.chunk = 4;
  c.layers.pattern = parse_layer_pattern("M1 M2 E M3 D", "test pattern");
  c.n_layer = index_t(c.layers.pattern.size());
  c.layers.mamba1.d_state = 3;
  c.layers.mamba1.dt_rank = 2;
  c.layers.mamba1.chunk = 4;
  c.layers.mamba3.d_state = 4;
  c.layers.mamba3.headdim = 4;
  c.layers.mamba3.chunk_size = 4;
  c.layers.moe.n_experts = 4;
  c.layers.moe.top_k = 2;
  c.layers.moe.d_ff = 6;
  c.layers.moe.shared_d_ff = 3;
  c.layers.moe.capacity_factor = 0.0;  // dropless: routing is token-local, so windows cannot change it
  c.layers.dense_d_ff = 5;
  return c;
}

std::vector<std::int32_t> random_tokens(index_t n, std::uint64_t stream) {
  const CounterRNG rng{31, stream};
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  for (index_t i = 0; i < n; ++i) t[std::size_t(i)] = 1 + std::int32_t(rng.uniform(std::uint64_t(i), 0.0, 4.0));
  return t;
}

// One pass through the training forward: ln p(token_t | tokens before t) for t >= 1 (entry 0 unused).
template <class T>
std::vector<double> one_pass_logp(MambaLM<T>& lm, const std::vector<std::int32_t>& tok) {
  const index_t L = index_t(tok.size());
  io::HostBatch hb(1, L);
  for (index_t t = 0; t < L; ++t) {
    hb.tokens[std::size_t(t)] = tok[std::size_t(t)];
    hb.targets[std::size_t(t)] = t + 1 < L ? tok[std::size_t(t + 1)] : -1;
  }
  const auto nats = lm.token_nats(to_device(hb));
  std::vector<double> out(std::size_t(L), 0.0);
  for (index_t t = 1; t < L; ++t) out[std::size_t(t)] = -nats[std::size_t(t - 1)];
  return out;
}

template <class T>
void check_streaming(double tol) {
  MambaLM<double> ref(infer_lm());
  ref.initialize(3);
  mmtest::jitter_params(ref.params(), 8, 0.05);
  MambaLM<T> lm(infer_lm());  // the same parameters in T's precision
  {
    auto from = Kokkos::create_mirror_view_and_copy(HostMem(), ref.params().values());
    auto to = Kokkos::create_mirror_view(lm.params().values());
    REQUIRE(from.extent(0) == to.extent(0));
    for (std::size_t i = 0; i < from.extent(0); ++i) to(i) = acc_t<T>(from(i));
    Kokkos::deep_copy(lm.params().values(), to);
  }
  const index_t L = 37;
  const auto tok = random_tokens(L, 1);
  const auto want = one_pass_logp(lm, tok);
  double worst = 0;
  for (index_t window : {index_t(1), index_t(2), index_t(5), index_t(8), index_t(16), index_t(37), index_t(64)}) {
    // fed whole, and fed in uneven pieces (3, 10, 1, rest) that do not line up with the windows
    for (bool pieces : {false, true}) {
      StreamingScorer<T> sc(lm, window);
      std::vector<double> got, part;
      if (!pieces) {
        sc.feed(tok.data(), L, got);
      } else {
        index_t at = 0;
        for (index_t n : {index_t(3), index_t(10), index_t(1), L - 14}) {
          sc.feed(tok.data() + at, n, part);
          got.insert(got.end(), part.begin(), part.end());
          at += n;
        }
      }
      REQUIRE(index_t(got.size()) == L);
      REQUIRE(std::isnan(got[0]));
      got[0] = 0;
      const double e = rel_err(got, want);
      INFO("window " << window << (pieces ? " (uneven feeds)" : "") << " rel err " << e);
      CHECK(e < tol);
      worst = std::max(worst, e);
      CHECK(sc.consumed() == L);
    }
  }
  // control: without the carried state (a fresh scorer per window of 5) the scores differ, so the context matters
  {
    std::vector<double> cut(std::size_t(L), 0.0), part, ref = want;
    for (index_t at = 0; at < L; at += 5) {
      StreamingScorer<T> fresh(lm, 5);
      fresh.feed(tok.data() + at, std::min<index_t>(5, L - at), part);
      for (std::size_t i = 1; i < part.size(); ++i) cut[std::size_t(at) + i] = part[i];
      ref[std::size_t(at)] = 0;  // the first token of each piece has no score without context
    }
    const double e = rel_err(cut, ref);
    INFO("without the carried state: rel err " << e);
    CHECK(e > 1e3 * tol);
    WARN("control without the carried state: rel err " << e);
  }
  WARN("streaming vs one-pass scoring, worst rel err " << worst << (sizeof(T) == 8 ? " (double)" : " (float)"));
}

}  // namespace

TEST_CASE("streaming scoring in windows with a carried state equals one-pass scoring (double)", "[infer]") {
  check_streaming<double>(1e-12);
}

TEST_CASE("streaming scoring in windows with a carried state equals one-pass scoring (float)", "[infer]") {
  check_streaming<float>(1e-5);
}

TEST_CASE("sampling distribution: temperature, top-k, top-p and candidates on a known distribution", "[infer]") {
  const index_t V = 6;
  const std::vector<double> q = {0.05, 0.1, 0.4, 0.2, 0.25, 0.0};  // token 5 has probability 0 among the logits
  std::vector<double> logits(V);
  for (index_t v = 0; v < V; ++v) logits[v] = q[v] > 0 ? std::log(q[v]) + 1.5 : -1e30;
  auto probs = [&](double temp, index_t k, double p, std::vector<std::int32_t> cand = {}) {
    SamplingConfig sc;
    sc.temperature = temp, sc.top_k = k, sc.top_p = p;
    return sampling_probs(logits.data(), V, cand, sc);
  };
  auto expect = [&](const std::vector<double>& got, const std::vector<double>& want) {
    REQUIRE(got.size() == want.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      INFO("token " << i << ": " << got[i] << " vs " << want[i]);
      CHECK(std::abs(got[i] - want[i]) <= 1e-15);
      CHECK((got[i] == 0) == (want[i] == 0));  // the kept set is exact
    }
  };
  expect(probs(1, 0, 1), q);
  expect(probs(1, 2, 1), {0, 0, 0.4 / 0.65, 0, 0.25 / 0.65, 0});                    // top-2: 0.4, 0.25
  expect(probs(1, 0, 0.6), {0, 0, 0.4 / 0.65, 0, 0.25 / 0.65, 0});                  // 0.4 + 0.25 >= 0.6
  expect(probs(1, 0, 0.3), {0, 0, 1, 0, 0, 0});                                     // 0.4 alone reaches 0.3
  // top-p 0.8: 0.4 + 0.25 + 0.2 = 0.85 >= 0.8 -> tokens 2, 4, 3
  expect(probs(1, 0, 0.8), {0, 0, 0.4 / 0.85, 0.2 / 0.85, 0.25 / 0.85, 0});
  expect(probs(1, 3, 0.5), {0, 0, 0.4 / 0.65, 0, 0.25 / 0.65, 0});                  // top-3 then top-p 0.5
  // top-p acts on the top-k-renormalised distribution: top-2 gives 0.615, 0.385; p = 0.6 keeps the first only
  expect(probs(1, 2, 0.6), {0, 0, 1, 0, 0, 0});
  // temperature 2: p ~ sqrt(q)
  {
    double s = 0;
    std::vector<double> w(V, 0.0);
    for (index_t v = 0; v < V; ++v) s += (w[v] = std::sqrt(q[v]));
    for (auto& x : w) x /= s;
    const auto got = probs(2, 0, 1);
    for (index_t v = 0; v < V; ++v) CHECK(std::abs(got[v] - w[v]) <= 1e-15);
  }
  expect(probs(0, 0, 1), {0, 0, 1, 0, 0, 0});                                       // greedy
  expect(probs(1, 0, 1, {1, 3, 0}), {0.05 / 0.35, 0.1 / 0.35, 0, 0.2 / 0.35, 0, 0});  // candidates only
  expect(probs(0, 0, 1, {0, 1, 3}), {0, 0, 0, 1, 0, 0});
  // ties go to the lower id
  const std::vector<double> tie = {0.0, 2.0, 2.0, 1.0};
  SamplingConfig g;
  g.temperature = 0;
  CHECK(sampling_probs(tie.data(), 4, {}, g)[1] == 1.0);
  // drawing: the first token whose cumulative probability reaches u
  const std::vector<double> p2 = {0, 0.5, 0, 0.5};
  CHECK(sample_token(p2, 0.25) == 1);
  CHECK(sample_token(p2, 0.5) == 1);
  CHECK(sample_token(p2, 0.5000001) == 3);
  CHECK(sample_token(p2, 1.0) == 3);
  // bad settings name the value
  SamplingConfig bad;
  bad.top_p = 0;
  CHECK_THROWS_WITH(sampling_probs(logits.data(), V, {}, bad), ContainsSubstring("top_p") && ContainsSubstring("(got 0)"));
  bad = SamplingConfig{};
  bad.temperature = -1;
  CHECK_THROWS_WITH(sampling_probs(logits.data(), V, {}, bad), ContainsSubstring("temperature"));
  bad = SamplingConfig{};
  bad.top_k = -2;
  CHECK_THROWS_WITH(sampling_probs(logits.data(), V, {}, bad), ContainsSubstring("top_k"));
}

TEST_CASE("generation: top-k 1 is greedy argmax decoding; the same seed gives identical sequences", "[infer]") {
  MambaLM<double> lm(infer_lm());
  lm.initialize(4);
  mmtest::jitter_params(lm.params(), 9, 0.3);  // sharper logits than the 0.02 initialisation
  const std::vector<std::int32_t> bases = {1, 2, 3, 4};
  const auto prompt = random_tokens(9, 2);
  const index_t n = 14;

  SamplingConfig k1;
  k1.top_k = 1;
  const auto got = generate(lm, prompt, 1, n, k1, 11, 4, bases)[0];
  // greedy by full forwards over the growing sequence: argmax over the four bases of the last row's logits
  std::vector<std::int32_t> seq = prompt;
  const index_t V = lm.config().vocab_size;
  for (index_t t = 0; t < n; ++t) {
    io::HostBatch hb(1, index_t(seq.size()));
    for (std::size_t i = 0; i < seq.size(); ++i) hb.tokens[i] = seq[i], hb.targets[i] = -1;
    lm.forward(to_device(hb));
    const auto lg = to_vec(lm.logits());
    const double* row = &lg[(seq.size() - 1) * std::size_t(V)];
    std::int32_t best = 1;
    for (std::int32_t b : bases)
      if (row[b] > row[best]) best = b;
    seq.push_back(best);
  }
  REQUIRE(got.size() == std::size_t(n));
  CHECK(std::vector<std::int32_t>(seq.begin() + std::ptrdiff_t(prompt.size()), seq.end()) == got);
  SamplingConfig greedy;
  greedy.temperature = 0;
  CHECK(generate(lm, prompt, 1, n, greedy, 99, 100, bases)[0] == got);

  SamplingConfig sc;
  sc.temperature = 1.3;
  sc.top_k = 3;
  sc.top_p = 0.9;
  const auto a = generate(lm, prompt, 3, 40, sc, 7, 4, bases);
  const auto b = generate(lm, prompt, 3, 40, sc, 7, 4, bases);
  CHECK(a == b);                                                // bit-identical
  CHECK(generate(lm, prompt, 3, 40, sc, 7, 1, bases) == a);     // prompt window does not matter
  CHECK(generate(lm, prompt, 1, 40, sc, 7, 100, bases)[0] == a[0]);  // nor how many rows are generated together
  CHECK(a[0] != a[1]);                                          // rows are different samples
  CHECK(generate(lm, prompt, 3, 40, sc, 8, 4, bases) != a);     // another seed, other samples
  for (const auto& row : a)
    for (std::int32_t t : row) CHECK((t >= 1 && t <= 4));
  CHECK_THROWS_WITH(generate(lm, {}, 1, 4, sc, 7, 4, bases), ContainsSubstring("prompt is empty"));
}
