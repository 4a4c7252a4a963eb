// A Mamba language model over single-nucleotide tokens (mamba_ssm's MambaLMHeadModel): embedding -> MambaBackbone
// (a pattern of pre-norm residual blocks, Mamba-2 by default, on an fp32 residual stream, final RMSNorm) -> LM head
// (tied to the embedding or not) -> cross-entropy. With MoE layers the training objective is
//   mean cross-entropy over the step's scored targets + the MoE auxiliary losses,
// each micro-batch's auxiliary losses weighted by its share of the step's scored targets (grad_scale * count), so
// the auxiliary term is their (token-weighted) mean over the micro-batches, independent of gradient accumulation.
#pragma once

#include <memory>
#include <string>

#include "io/host_batch.hpp"
#include "layers/cross_entropy.hpp"
#include "model/backbone.hpp"

namespace mm {

struct LMConfig {
  index_t vocab_size = 16;  // padded vocabulary (single-nucleotide tokens use 6 ids)
  index_t n_layer = 2;
  bool tie_embeddings = true;
  double norm_eps = 1e-5;
  double initializer_range = 0.02;
  Mamba2Config mixer;  // mixer.d_model is the model width
  LayerStackConfig layers;  // the layer pattern (empty: n_layer x M2) and the other layer kinds' configs
  void validate(const std::string& context) const;
};

// One micro-batch on the device: tokens (batch, seqlen) as rows b * L + t, next-token targets (-1 = not scored),
// record ids.
struct Batch {
  index_t batch = 0, seqlen = 0;
  Kokkos::View<std::int32_t*, Layout, Mem> tokens, targets;  // (batch * seqlen)
  Kokkos::View<std::int32_t**, Layout, Mem> seq_idx;         // (batch, seqlen) or empty
};
Batch to_device(const io::HostBatch& hb);
// Columns [rank * L / parts, (rank + 1) * L / parts) of every row of `b` (seqlen must divide by parts).
Batch sequence_slice(const Batch& b, int rank, int parts);

template <class T>
class MambaLM {
 public:
  using P = acc_t<T>;
  using R = P;
  using HostBatch = io::HostBatch;

  // `comms`: the tensor-, context- and expert-parallel communicators of a parallel layout (default: one rank).
  // Under cp, forward_backward() takes the whole micro-batch, runs this rank's slice of every sequence (the seqlen
  // must divide by cp) and returns the loss summed over the cp ranks.
  explicit MambaLM(const LMConfig& cfg, const parallel::ModelComms& comms = {});

  const LMConfig& config() const { return cfg_; }
  ParamStore<P>& params() { return params_; }
  const ParamStore<P>& params() const { return params_; }

  // Initialise all parameters from the seed (independent of backend, threads and ranks).
  void initialize(std::uint64_t seed) { params_.initialize(seed); }

  // Forward (and, if `grad_scale` > 0, backward with d(loss_sum)/d(logits) scaled by grad_scale, accumulating
  // parameter gradients). Returns the summed loss (nats) and the number of scored targets.
  LossSum forward_backward(const Batch& b, double grad_scale, Recompute policy,
                           const View1<double>& row_nats = View1<double>());
  LossSum forward_backward(const HostBatch& hb, double grad_scale, Recompute policy) {
    return forward_backward(to_device(hb), grad_scale, policy);
  }
  LossSum forward(const Batch& b) { return forward_backward(b, 0.0, Recompute::mixer); }
  // Forward only; the loss of every row (-log p(target) in nats, 0 where the target is not scored).
  std::vector<double> token_nats(const Batch& b);

  // Logits of the last forward (batch * seqlen, vocab), kept for scoring and tests.
  const View2<T>& logits() const { return logits_; }

  MambaBackbone<T>& backbone() { return *backbone_; }
  // During forward_backward's backward, hook(offset) says that every gradient from flat offset `offset` of
  // params() to its end is final (the store holds the embedding, the backbone's blocks in order, norm_f, then
  // lm_head, whose backward runs before the backbone's; the embedding's runs last). See MambaBackbone.
  void set_grads_ready_hook(std::function<void(index_t)> hook) { backbone_->set_grads_ready_hook(std::move(hook)); }
  // Parameters: all, and those used per token (MoE layers: router, top_k experts, shared expert).
  index_t param_count() const;
  index_t active_param_count() const;

  // Decode: a zero per-layer state cache for `batch` rows; prefill reads tokens (batch * seqlen, rows b * L + t)
  // from the state, leaving the state after the last token, and returns their logits (batch * seqlen, vocab);
  // step reads one token per row (batch) and returns its logits (batch, vocab).
  BackboneState<T> make_decode_state(index_t batch) const { return backbone_->make_state(batch); }
  View2<T> prefill(const Kokkos::View<const std::int32_t*, Layout, Mem>& tokens, index_t batch, index_t seqlen,
                   BackboneState<T>& state);
  View2<T> step(const Kokkos::View<const std::int32_t*, Layout, Mem>& tokens, BackboneState<T>& state);

  // What the trainer needs to know of a model: its loss and its reporting metric.
  static std::int64_t scored(const HostBatch& hb) { return hb.scored(); }
  static std::int64_t tokens(const HostBatch& hb) { return hb.batch * hb.seqlen; }
  static constexpr const char* metric_name = "bits_per_base";
  static double metric(const LossSum& l) { return l.bits_per_token(); }

 private:
  LMConfig cfg_;
  parallel::ModelComms comms_;
  ParamStore<P> params_;
  std::size_t embedding_, lm_head_;
  std::unique_ptr<MambaBackbone<T>> backbone_;
  View2<T> logits_;
  View2<R> h_;  // the embedding output of the last forward (the backbone's input), reused while its shape holds
};

}  // namespace mm
