#include "model/infer.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/error.hpp"
#include "core/rng.hpp"

namespace mm {

namespace {

using TokView = Kokkos::View<std::int32_t*, Layout, Mem>;

TokView to_device_tokens(const std::int32_t* t, index_t n) {
  TokView d("infer::tokens", n);
  Kokkos::deep_copy(d, Kokkos::View<const std::int32_t*, Layout, HostMem>(t, n));
  return d;
}

template <class T>
std::vector<double> to_host(const View2<T>& v) {
  auto h = Kokkos::create_mirror_view_and_copy(HostMem(), v);
  std::vector<double> out(h.span());
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = double(h.data()[i]);
  return out;
}

}  // namespace

std::vector<double> log_softmax_row(const double* logits, index_t V) {
  double m = -std::numeric_limits<double>::infinity();
  for (index_t v = 0; v < V; ++v) m = std::max(m, logits[v]);
  double s = 0;
  for (index_t v = 0; v < V; ++v) s += std::exp(logits[v] - m);
  const double lse = m + std::log(s);
  std::vector<double> out(static_cast<std::size_t>(V));
  for (index_t v = 0; v < V; ++v) out[std::size_t(v)] = logits[v] - lse;
  return out;
}

template <class T>
StreamingScorer<T>::StreamingScorer(MambaLM<T>& lm, index_t window)
    : lm_(&lm), window_(window), V_(lm.config().vocab_size), state_(lm.make_decode_state(1)) {
  require(window >= 1, "scorer window", "must be at least 1 token (got ", window, ")");
}

template <class T>
void StreamingScorer<T>::feed(const std::int32_t* tokens, index_t n, std::vector<double>& logp) {
  logp.assign(std::size_t(n), std::numeric_limits<double>::quiet_NaN());
  for (index_t i = 0; i < n; ++i)
    require(tokens[i] >= 0 && tokens[i] < V_, "scorer", "token ", tokens[i], " at stream position ", consumed_ + i,
            " is outside the vocabulary of ", V_);
  for (index_t w0 = 0; w0 < n; w0 += window_) {
    const index_t w = std::min(window_, n - w0);
    const auto logits = to_host(lm_->prefill(to_device_tokens(tokens + w0, w), 1, w, state_));
    ++windows_;
    // token w0 + i is predicted by the row before it: the carried last row for i = 0, row i - 1 otherwise
    for (index_t i = 0; i < w; ++i) {
      const double* row = i == 0 ? (last_.empty() ? nullptr : last_.data()) : &logits[std::size_t((i - 1) * V_)];
      if (row) logp[std::size_t(w0 + i)] = log_softmax_row(row, V_)[std::size_t(tokens[w0 + i])];
    }
    last_.assign(logits.begin() + std::ptrdiff_t((w - 1) * V_), logits.begin() + std::ptrdiff_t(w * V_));
  }
  consumed_ += n;
}

void SamplingConfig::validate(const std::string& context) const {
  require(std::isfinite(temperature) && temperature >= 0, context, "temperature must be >= 0 (got ", temperature,
          ")");
  require(top_k >= 0, context, "top_k must be >= 0 (got ", top_k, "; 0 = no cut)");
  require(top_p > 0 && top_p <= 1, context, "top_p must be in (0, 1] (got ", top_p, ")");
}

std::vector<double> sampling_probs(const double* logits, index_t V, const std::vector<std::int32_t>& candidates,
                                   const SamplingConfig& sc) {
  sc.validate("sampling");
  std::vector<std::int32_t> cand = candidates;
  if (cand.empty()) {
    cand.resize(std::size_t(V));
    std::iota(cand.begin(), cand.end(), 0);
  }
  for (std::int32_t c : cand) require(c >= 0 && c < V, "sampling", "candidate token ", c, " outside vocabulary ", V);
  // most probable first; ties by lower id (a stable order that does not depend on the candidates' order)
  std::sort(cand.begin(), cand.end(), [&](std::int32_t a, std::int32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  });
  std::vector<double> p(static_cast<std::size_t>(V), 0.0);
  if (sc.temperature == 0) {
    p[std::size_t(cand[0])] = 1.0;
    return p;
  }
  std::size_t keep = cand.size();
  if (sc.top_k > 0) keep = std::min(keep, std::size_t(sc.top_k));
  const double m = logits[cand[0]];
  double s = 0;
  std::vector<double> e(keep);
  for (std::size_t i = 0; i < keep; ++i) s += (e[i] = std::exp((logits[cand[i]] - m) / sc.temperature));
  if (sc.top_p < 1) {
    double c = 0;
    std::size_t k = 0;
    while (k < keep) {
      c += e[k++] / s;
      if (c >= sc.top_p) break;
    }
    keep = k;
    s = 0;
    for (std::size_t i = 0; i < keep; ++i) s += e[i];
  }
  for (std::size_t i = 0; i < keep; ++i) p[std::size_t(cand[i])] = e[i] / s;
  return p;
}

std::int32_t sample_token(const std::vector<double>& probs, double u) {
  double total = 0;
  std::int32_t last = -1;
  for (std::size_t i = 0; i < probs.size(); ++i)
    if (probs[i] > 0) total += probs[i], last = std::int32_t(i);
  require(last >= 0, "sampling", "the distribution is empty");
  const double target = u * total;
  double c = 0;
  for (std::size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] <= 0) continue;
    c += probs[i];
    if (c >= target) return std::int32_t(i);
  }
  return last;  // rounding: u = 1
}

template <class T>
std::vector<std::vector<std::int32_t>> generate(MambaLM<T>& lm, const std::vector<std::int32_t>& prompt,
                                                index_t n_samples, index_t n_tokens, const SamplingConfig& sc,
                                                std::uint64_t seed, index_t window,
                                                const std::vector<std::int32_t>& candidates) {
  const index_t V = lm.config().vocab_size, P = index_t(prompt.size()), B = n_samples;
  require(P >= 1, "generate", "the prompt is empty (at least one token is needed to condition on)");
  require(B >= 1 && n_tokens >= 0 && window >= 1, "generate", "n_samples (", B, ") and window (", window,
          ") must be >= 1 and n_tokens (", n_tokens, ") >= 0");
  sc.validate("generate");
  for (std::int32_t t : prompt) require(t >= 0 && t < V, "generate", "prompt token ", t, " outside vocabulary ", V);
  auto state = lm.make_decode_state(B);
  std::vector<double> last;  // (B, V) logits after the last token read
  for (index_t w0 = 0; w0 < P; w0 += window) {
    const index_t w = std::min(window, P - w0);
    std::vector<std::int32_t> rows(std::size_t(B * w));
    for (index_t b = 0; b < B; ++b)
      std::copy(prompt.begin() + w0, prompt.begin() + w0 + w, rows.begin() + std::ptrdiff_t(b * w));
    const auto logits = to_host(lm.prefill(to_device_tokens(rows.data(), B * w), B, w, state));
    last.assign(std::size_t(B * V), 0.0);
    for (index_t b = 0; b < B; ++b)
      std::copy_n(logits.begin() + std::ptrdiff_t(((b + 1) * w - 1) * V), V, last.begin() + std::ptrdiff_t(b * V));
  }
  std::vector<std::vector<std::int32_t>> out(static_cast<std::size_t>(B));
  const std::uint64_t base = stream_id("generate");
  std::vector<std::int32_t> next(static_cast<std::size_t>(B));
  for (index_t t = 0; t < n_tokens; ++t) {
    for (index_t b = 0; b < B; ++b) {
      const auto p = sampling_probs(&last[std::size_t(b * V)], V, candidates, sc);
      const CounterRNG rng{seed, stream_mix(base, std::uint64_t(b))};
      next[std::size_t(b)] = sample_token(p, rng.uniform(std::uint64_t(t)));
      out[std::size_t(b)].push_back(next[std::size_t(b)]);
    }
    if (t + 1 < n_tokens) last = to_host(lm.step(to_device_tokens(next.data(), B), state));
  }
  return out;
}

template class StreamingScorer<float>;
template class StreamingScorer<double>;
template std::vector<std::vector<std::int32_t>> generate<float>(MambaLM<float>&, const std::vector<std::int32_t>&,
                                                                index_t, index_t, const SamplingConfig&,
                                                                std::uint64_t, index_t,
                                                                const std::vector<std::int32_t>&);
template std::vector<std::vector<std::int32_t>> generate<double>(MambaLM<double>&, const std::vector<std::int32_t>&,
                                                                 index_t, index_t, const SamplingConfig&,
                                                                 std::uint64_t, index_t,
                                                                 const std::vector<std::int32_t>&);

}  // namespace mm
