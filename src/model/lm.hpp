// A Mamba-2 language model over single-nucleotide tokens (mamba_ssm's MambaLMHeadModel with Mamba-2 mixers and
// no MLP): embedding -> n_layer pre-norm residual blocks (fp32 residual stream) -> final RMSNorm -> LM head (tied
// to the embedding or not) -> cross-entropy.
//
//   block:  h <- h + mixer(RMSNorm(h))
#pragma once

#include <memory>
#include <vector>

#include "layers/cross_entropy.hpp"
#include "model/params.hpp"
#include "ssm/mamba2/mixer.hpp"

namespace mm {

struct LMConfig {
  index_t vocab_size = 16;  // padded vocabulary (single-nucleotide tokens use 6 ids)
  index_t n_layer = 2;
  bool tie_embeddings = true;
  double norm_eps = 1e-5;
  double initializer_range = 0.02;
  Mamba2Config mixer;  // mixer.d_model is the model width
  void validate(const std::string& context) const;
};

// One micro-batch: tokens (batch, seqlen) as rows b * L + t, next-token targets (-1 = not scored), record ids.
struct Batch {
  index_t batch = 0, seqlen = 0;
  Kokkos::View<std::int32_t*, Layout, Mem> tokens, targets;  // (batch * seqlen)
  Kokkos::View<std::int32_t**, Layout, Mem> seq_idx;         // (batch, seqlen) or empty
};

enum class Recompute { none, mixer };

template <class T>
class MambaLM {
 public:
  using P = acc_t<T>;
  using R = P;  // residual stream type (fp32, or double in tests)

  explicit MambaLM(const LMConfig& cfg);

  const LMConfig& config() const { return cfg_; }
  ParamStore<P>& params() { return params_; }
  const ParamStore<P>& params() const { return params_; }

  // Initialise all parameters from the seed (independent of backend, threads and ranks).
  void initialize(std::uint64_t seed) { params_.initialize(seed); }

  // Forward (and, if `grad_scale` > 0, backward with d(loss_sum)/d(logits) scaled by grad_scale, accumulating
  // parameter gradients). Returns the summed loss (nats) and the number of scored targets.
  LossSum forward_backward(const Batch& b, double grad_scale, Recompute policy);
  LossSum forward(const Batch& b) { return forward_backward(b, 0.0, Recompute::mixer); }

  // Logits of the last forward (batch * seqlen, vocab), kept for scoring and tests.
  const View2<T>& logits() const { return logits_; }

 private:
  LMConfig cfg_;
  ParamStore<P> params_;
  std::size_t embedding_, norm_f_, lm_head_;
  std::vector<std::size_t> norm_;
  std::vector<std::unique_ptr<Mamba2Mixer<T>>> mixers_;
  View2<T> logits_;
};

}  // namespace mm
