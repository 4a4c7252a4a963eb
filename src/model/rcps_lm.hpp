// A reverse-complement-equivariant masked DNA language model by parameter sharing (Caduceus-style RCPS, Schiff et
// al. 2024), on the Mamba-2 backbone.
//
// The same embedding and backbone read the sequence x and its reverse complement RC(x) = complement(reverse(x));
// the reverse stream's outputs are reversed back to x's coordinates, and the tied LM head combines both streams
// with the complement permutation P of the vocabulary:
//
//   o_f = backbone(E(x)),   o_r = reverse(backbone(E(RC(x)))),   logits_t = W o_f,t + P W o_r,t
//
// which makes the model exactly RC-equivariant: logits(RC(x)) = P reverse(logits(x)). The reverse stream sees the
// bases to the right, so the model is bidirectional and is trained with a masked-token objective (BERT-style
// 15 % masking) rather than next-base prediction. Both streams run as one batch of 2B rows.
#pragma once

#include <memory>

#include "io/host_batch.hpp"
#include "model/lm.hpp"

namespace mm {

inline constexpr std::int32_t kMaskToken = 6;  // after pad, A, C, G, T, N; its own complement

template <class T>
class RCPSMaskedLM {
 public:
  using P = acc_t<T>;
  using R = P;
  using HostBatch = io::HostBatch;

  explicit RCPSMaskedLM(const LMConfig& cfg);  // cfg.tie_embeddings must be true (the head is the embedding)

  const LMConfig& config() const { return cfg_; }
  ParamStore<P>& params() { return params_; }
  const ParamStore<P>& params() const { return params_; }
  void initialize(std::uint64_t seed) { params_.initialize(seed); }

  // Masked-token cross-entropy over the rows with a target >= 0 (targets are the original bases at masked
  // positions); with grad_scale > 0 also the backward. row_nats (optional) receives each position's loss.
  LossSum forward_backward(const Batch& b, double grad_scale, Recompute policy,
                           const View1<double>& row_nats = View1<double>());
  LossSum forward_backward(const HostBatch& hb, double grad_scale, Recompute policy) {
    return forward_backward(to_device(hb), grad_scale, policy);
  }
  LossSum forward(const Batch& b) { return forward_backward(b, 0.0, Recompute::mixer); }
  std::vector<double> token_nats(const Batch& b);
  const View2<T>& logits() const { return logits_; }
  MambaBackbone<T>& backbone() { return *backbone_; }

  static std::int64_t scored(const HostBatch& hb) { return hb.scored(); }
  static std::int64_t tokens(const HostBatch& hb) { return hb.batch * hb.seqlen; }
  static constexpr const char* metric_name = "masked_bits_per_base";
  static double metric(const LossSum& l) { return l.bits_per_token(); }

 private:
  LMConfig cfg_;
  ParamStore<P> params_;
  std::size_t embedding_;
  std::unique_ptr<MambaBackbone<T>> backbone_;
  View2<T> logits_;
};

// Complement of a token id: A<->T, C<->G; every other id (pad, N, mask, unused) is its own complement.
KOKKOS_INLINE_FUNCTION std::int32_t complement_id(std::int32_t t) { return (t >= 1 && t <= 4) ? 5 - t : t; }

// BERT-style masking of a batch of windows for the masked objective: each base (A/C/G/T) is chosen with
// probability `rate`; a chosen base becomes the mask token (80 %), a random base (10 %) or stays (10 %), and its
// target is the original base; every other target is -1. Draws come from (seed, stream).
io::HostBatch mask_for_mlm(const io::HostBatch& windows, std::uint64_t seed, std::uint64_t stream, double rate);

}  // namespace mm
