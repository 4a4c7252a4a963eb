// The reverse-complement-equivariant masked LM: exact RC equivariance, finite-difference gradients, and the
// masking of training windows.
#include <vector>

#include "catch.hpp"
#include "io/tokens.hpp"
#include "model/rcps_lm.hpp"
#include "util.hpp"

using namespace mm;
using mmtest::fd_check;
using mmtest::to_vec;

namespace {

LMConfig tiny() {
  LMConfig c;
  c.vocab_size = 8;
  c.n_layer = 2;
  c.mixer.d_model = 8;
  c.mixer.d_state = 4;
  c.mixer.headdim = 4;
  c.mixer.chunk = 4;
  return c;
}

// Rows of random bases (with an N and a mask token), row 0 split into two records.
io::HostBatch windows(std::int64_t B, std::int64_t L, std::uint64_t seed) {
  io::HostBatch hb(B, L);
  const CounterRNG rng{seed, 1};
  for (std::int64_t i = 0; i < B * L; ++i) {
    hb.tokens[std::size_t(i)] = std::int32_t(1 + rng.below(std::uint64_t(i), 4));
    hb.targets[std::size_t(i)] = (i % 3 == 0) ? std::int32_t(1 + rng.below(std::uint64_t(i + 999), 4)) : -1;
    hb.seq_idx[std::size_t(i)] = (i < L / 2) ? 0 : 1;
  }
  hb.tokens[3] = kN;
  hb.tokens[5] = kMaskToken;
  return hb;
}

io::HostBatch reverse_complement(const io::HostBatch& hb) {
  io::HostBatch r = hb;
  for (std::int64_t b = 0; b < hb.batch; ++b)
    for (std::int64_t t = 0; t < hb.seqlen; ++t) {
      const auto src = std::size_t(b * hb.seqlen + (hb.seqlen - 1 - t)), dst = std::size_t(b * hb.seqlen + t);
      r.tokens[dst] = complement_id(hb.tokens[src]);
      r.targets[dst] = hb.targets[src] >= 0 ? complement_id(hb.targets[src]) : -1;
      r.seq_idx[dst] = hb.seq_idx[src];
    }
  return r;
}


}  // namespace

TEST_CASE("RCPS model is exactly reverse-complement equivariant", "[rcps]") {
  RCPSMaskedLM<double> m(tiny());
  m.initialize(4);
  mmtest::jitter_params(m.params(), 3, 0.2);
  const std::int64_t B = 2, L = 11, V = 8;
  const auto x = windows(B, L, 7);
  const LossSum lx = m.forward(to_device(x));
  const auto logits_x = to_vec(m.logits());
  const LossSum lr = m.forward(to_device(reverse_complement(x)));
  const auto logits_r = to_vec(m.logits());
  // logits(RC(x))[b, t, v] = logits(x)[b, L-1-t, P(v)]
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < L; ++t)
      for (std::int64_t v = 0; v < V; ++v)
        CHECK(logits_r[std::size_t((b * L + t) * V + v)] ==
              Approx(logits_x[std::size_t((b * L + (L - 1 - t)) * V + complement_id(std::int32_t(v)))])
                  .epsilon(1e-13)
                  .margin(1e-13));
  CHECK(lx.nats == Approx(lr.nats).epsilon(1e-13));
  CHECK(lx.count == lr.count);
}

TEST_CASE("RCPS model backward matches finite differences", "[rcps][gradcheck]") {
  RCPSMaskedLM<double> m(tiny());
  m.initialize(5);
  mmtest::jitter_params(m.params(), 3, 0.2);
  const auto b = to_device(windows(2, 9, 3));
  const double scale = 0.2;
  m.params().zero_grads();
  m.forward_backward(b, scale, Recompute::none);
  const auto grads = to_vec(m.params().grads());
  auto loss = [&]() { return scale * m.forward(b).nats; };
  for (const auto& e : m.params().entries()) {
    INFO(e.name);
    const std::vector<double> g(grads.begin() + e.offset, grads.begin() + e.offset + e.size);
    CHECK(fd_check(m.params().v1(m.params().index(e.name)), g, loss, 12).rel() < 1e-6);
  }
}

TEST_CASE("masking for the masked objective: bases only, about the rate, targets the originals", "[rcps]") {
  io::HostBatch w = windows(8, 500, 11);
  w.tokens[7] = kN;
  const auto m = mask_for_mlm(w, 5, 9, 0.15);
  std::int64_t masked = 0, replaced_by_mask = 0;
  for (std::size_t i = 0; i < w.tokens.size(); ++i) {
    if (m.targets[i] < 0) {
      CHECK(m.tokens[i] == w.tokens[i]);
      continue;
    }
    ++masked;
    CHECK(m.targets[i] == w.tokens[i]);
    CHECK(w.tokens[i] >= kA);
    CHECK(w.tokens[i] <= kT);
    replaced_by_mask += m.tokens[i] == kMaskToken;
  }
  const double frac = double(masked) / double(w.tokens.size());
  CHECK(frac > 0.12);
  CHECK(frac < 0.18);
  CHECK(double(replaced_by_mask) / double(masked) > 0.7);
  CHECK(m.tokens == mask_for_mlm(w, 5, 9, 0.15).tokens);  // reproducible from (seed, stream)
}
