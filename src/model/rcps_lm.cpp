#include "model/rcps_lm.hpp"

#include "core/error.hpp"
#include "core/rng.hpp"
#include "layers/embedding.hpp"
#include "layers/linear.hpp"

namespace mm {

template <class T>
RCPSMaskedLM<T>::RCPSMaskedLM(const LMConfig& cfg) : cfg_(cfg) {
  cfg_.validate("model");
  require(cfg.tie_embeddings, "model", "the RC-equivariant model ties its head to the embedding (tie_embeddings)");
  require(cfg.vocab_size > kMaskToken, "model", "vocab_size must hold the mask token (at least ", kMaskToken + 1,
          ")");
  const index_t D = cfg.mixer.d_model, V = cfg.vocab_size;
  embedding_ = params_.add("backbone.embedding.weight", {V, D}, true, Init::Normal(0.0, cfg.initializer_range));
  backbone_ =
      std::make_unique<MambaBackbone<T>>(cfg.mixer, cfg.n_layer, cfg.norm_eps, params_, "backbone.", cfg.layers);
  params_.allocate();
}

template <class T>
LossSum RCPSMaskedLM<T>::forward_backward(const Batch& b, double grad_scale, Recompute policy,
                                          const View1<double>& row_nats) {
  const index_t B = b.batch, L = b.seqlen, n = B * L, D = cfg_.mixer.d_model, V = cfg_.vocab_size;
  require(index_t(b.tokens.extent(0)) == n && index_t(b.targets.extent(0)) == n, "model",
          "batch tokens/targets must have batch * seqlen = ", n, " entries");
  const bool train = grad_scale > 0;
  // Rows [0, B): x; rows [B, 2B): RC(x) = complement(reverse(x)), records reversed with it.
  Kokkos::View<std::int32_t*, Layout, Mem> tok2("rcps::tokens", 2 * n);
  Kokkos::View<std::int32_t**, Layout, Mem> seq2("rcps::seq_idx", 2 * B, L);
  const auto tok = b.tokens;
  const auto seq = b.seq_idx;
  const bool has_seq = seq.extent(0) > 0;
  par_for("rcps::streams", B, L, KOKKOS_LAMBDA(index_t r, index_t t) {
    const index_t s = L - 1 - t;
    tok2(r * L + t) = tok(r * L + t);
    tok2(n + r * L + t) = complement_id(tok(r * L + s));
    seq2(r, t) = has_seq ? seq(r, t) : 0;
    seq2(B + r, t) = has_seq ? seq(r, s) : 0;
  });
  View2<R> h = make_uninit<View2<R>>("rcps::h", 2 * n, D);
  embedding_forward<R>(params_.v2(embedding_), tok2, h);
  View2<T> hf = make_uninit<View2<T>>("rcps::hf", 2 * n, D);
  backbone_->forward(h, 2 * B, L, seq2, train, policy, hf);
  View2<T> l2 = make_uninit<View2<T>>("rcps::stream_logits", 2 * n, V);
  linear_forward<T>(hf, params_.v2(embedding_), View1<const P>(), l2);
  logits_ = make_uninit<View2<T>>("rcps::logits", n, V);
  const auto logits = logits_;
  par_for("rcps::combine", n, V, KOKKOS_LAMBDA(index_t i, index_t v) {
    const index_t r = i / L, t = i % L;
    logits(i, v) = l2(i, v) + l2(n + r * L + (L - 1 - t), complement_id(std::int32_t(v)));
  });
  View2<T> dlogits = train ? make_uninit<View2<T>>("rcps::dlogits", n, V) : View2<T>();
  const LossSum loss = cross_entropy<T>(logits_, b.targets, grad_scale, dlogits, row_nats);
  if (!train) return loss;

  View2<T> dl2 = make_uninit<View2<T>>("rcps::dstream_logits", 2 * n, V);
  par_for("rcps::split", n, V, KOKKOS_LAMBDA(index_t i, index_t v) {
    const index_t r = i / L, t = i % L;
    dl2(i, v) = dlogits(i, v);
    // stream row (n + r L + t) position t holds original position L - 1 - t, its vocabulary complemented
    dl2(n + r * L + t, v) = dlogits(r * L + (L - 1 - t), complement_id(std::int32_t(v)));
  });
  View2<T> dhf = make_uninit<View2<T>>("rcps::dhf", 2 * n, D);
  linear_backward<T>(hf, params_.v2(embedding_), dl2, dhf, false, params_.g2(embedding_), View1<P>());
  View2<R> dh = make_uninit<View2<R>>("rcps::dh", 2 * n, D);
  backbone_->backward(dhf, dh, grad_scale * double(loss.count));  // MoE aux losses: see lm.hpp
  embedding_backward<R>(dh, tok2, params_.g2(embedding_));
  return loss;
}

template <class T>
std::vector<double> RCPSMaskedLM<T>::token_nats(const Batch& b) {
  View1<double> nats("rcps::token_nats", b.batch * b.seqlen);
  forward_backward(b, 0.0, Recompute::mixer, nats);
  auto h = Kokkos::create_mirror_view_and_copy(HostMem(), nats);
  return std::vector<double>(h.data(), h.data() + h.span());
}

io::HostBatch mask_for_mlm(const io::HostBatch& w, std::uint64_t seed, std::uint64_t stream, double rate) {
  io::HostBatch out = w;
  const CounterRNG rng{seed, stream};
  for (std::size_t i = 0; i < w.tokens.size(); ++i) {
    const std::int32_t t = w.tokens[i];
    out.targets[i] = -1;
    if (t < 1 || t > 4 || rng.uniform(3 * i) >= rate) continue;  // only bases are masked
    out.targets[i] = t;
    const double u = rng.uniform(3 * i + 1);
    if (u < 0.8) out.tokens[i] = kMaskToken;
    else if (u < 0.9) out.tokens[i] = std::int32_t(1 + rng.below(3 * i + 2, 4));
  }
  return out;
}

template class RCPSMaskedLM<float>;
template class RCPSMaskedLM<double>;

}  // namespace mm
