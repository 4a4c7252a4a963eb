// Inference with a trained MambaLM over the decode state cache (MambaLM::make_decode_state / prefill / step):
//
//   StreamingScorer  log p(token_t | every token before it) of a token stream of any length, read in windows of
//                    `window` tokens: each window is prefilled from the state the previous one left (conv states,
//                    SSM states, Mamba-3 carries), and the last row's logits of a window score the first token of
//                    the next. Nothing is re-read, and memory is O(window * vocab + state), not O(stream length).
//                    The result does not depend on the window (up to rounding): windows of 1 are pure steps.
//   sampling_probs   the sampling distribution of one row of logits: candidate tokens only, temperature, then
//                    top-k, then top-p (nucleus), renormalised; temperature 0 is greedy (argmax, lowest id on ties).
//   generate         prompt prefill (in windows) then one step per sampled token, `n_samples` rows at once; draws
//                    come from a counter-based generator keyed by (seed, sample, position), so the same seed gives
//                    the same sequences whatever the batch or window.
//
// Log-probabilities are over the whole vocabulary (the training objective's softmax), computed in double on the host.
#pragma once

#include <cstdint>
#include <vector>

#include "model/lm.hpp"

namespace mm {

// log softmax of one row of V logits, in double.
std::vector<double> log_softmax_row(const double* logits, index_t V);

template <class T>
class StreamingScorer {
 public:
  // `window` >= 1 tokens per prefill; one row (batch 1).
  StreamingScorer(MambaLM<T>& lm, index_t window);

  // Feeds the next n tokens of the stream; logp (resized to n) receives ln p(token | every earlier token of the
  // stream) in nats, NaN for the stream's very first token (it has no context). Tokens are processed in windows of
  // at most `window`, each prefilled from the carried state.
  void feed(const std::int32_t* tokens, index_t n, std::vector<double>& logp);

  index_t consumed() const { return consumed_; }  // tokens fed so far
  index_t windows() const { return windows_; }    // prefills run so far

 private:
  MambaLM<T>* lm_;
  index_t window_, V_;
  BackboneState<T> state_;
  std::vector<double> last_;  // logits of the last token fed (predicting the next), empty before the first
  index_t consumed_ = 0, windows_ = 0;
};

struct SamplingConfig {
  double temperature = 1.0;  // 0: greedy
  index_t top_k = 0;         // 0: no top-k cut
  double top_p = 1.0;        // in (0, 1]; 1: no nucleus cut
  void validate(const std::string& context) const;
};

// The sampling distribution (size V, zero outside the kept set) of one row of V logits restricted to `candidates`
// (token ids < V; empty: every token). top-k keeps the k most probable candidates (ties: lower id first); top-p then
// keeps the smallest most-probable prefix whose probability reaches top_p (at least one token).
std::vector<double> sampling_probs(const double* logits, index_t V, const std::vector<std::int32_t>& candidates,
                                   const SamplingConfig& sc);
// The token whose cumulative probability (in id order) first reaches u * sum(probs); u in (0, 1].
std::int32_t sample_token(const std::vector<double>& probs, double u);

// Generates n_tokens tokens after `prompt` (non-empty) for each of n_samples rows; returns the generated tokens
// (n_samples rows of n_tokens). The prompt is prefilled in windows of `window` tokens.
template <class T>
std::vector<std::vector<std::int32_t>> generate(MambaLM<T>& lm, const std::vector<std::int32_t>& prompt,
                                                index_t n_samples, index_t n_tokens, const SamplingConfig& sc,
                                                std::uint64_t seed, index_t window,
                                                const std::vector<std::int32_t>& candidates);

}  // namespace mm
