#include "model/lm.hpp"

#include <cmath>

#include "core/error.hpp"
#include "core/pool.hpp"
#include "layers/embedding.hpp"
#include "layers/linear.hpp"

namespace mm {

void LMConfig::validate(const std::string& context) const {
  require(vocab_size >= 2, context, "vocab_size must be at least 2 (got ", vocab_size, ")");
  require(n_layer >= 1, context, "n_layer must be at least 1 (got ", n_layer, ")");
  require(norm_eps > 0, context, "norm_eps must be positive");
  mixer.validate(context);
  layers.validate(mixer.d_model, n_layer, context);
}

Batch to_device(const io::HostBatch& hb) {
  Batch b;
  b.batch = hb.batch;
  b.seqlen = hb.seqlen;
  const index_t n = hb.batch * hb.seqlen;
  require(index_t(hb.tokens.size()) == n && index_t(hb.targets.size()) == n && index_t(hb.seq_idx.size()) == n,
          "batch", "host batch arrays do not match batch * seqlen = ", n);
  b.tokens = Kokkos::View<std::int32_t*, Layout, Mem>("batch::tokens", n);
  b.targets = Kokkos::View<std::int32_t*, Layout, Mem>("batch::targets", n);
  b.seq_idx = Kokkos::View<std::int32_t**, Layout, Mem>("batch::seq_idx", hb.batch, hb.seqlen);
  Kokkos::deep_copy(b.tokens, Kokkos::View<const std::int32_t*, Layout, HostMem>(hb.tokens.data(), n));
  Kokkos::deep_copy(b.targets, Kokkos::View<const std::int32_t*, Layout, HostMem>(hb.targets.data(), n));
  Kokkos::deep_copy(b.seq_idx,
                    Kokkos::View<const std::int32_t**, Layout, HostMem>(hb.seq_idx.data(), hb.batch, hb.seqlen));
  return b;
}

template <class T>
MambaLM<T>::MambaLM(const LMConfig& cfg, const parallel::ModelComms& comms) : cfg_(cfg), comms_(comms) {
  cfg_.validate("model");
  const index_t D = cfg.mixer.d_model, V = cfg.vocab_size;
  embedding_ = params_.add("backbone.embedding.weight", {V, D}, true, Init::Normal(0.0, cfg.initializer_range));
  backbone_ =
      std::make_unique<MambaBackbone<T>>(cfg.mixer, cfg.n_layer, cfg.norm_eps, params_, "backbone.", cfg.layers,
                                         comms);
  lm_head_ = cfg.tie_embeddings ? embedding_
                                : params_.add("lm_head.weight", {V, D}, true,
                                              Init::Uniform(-1.0 / std::sqrt(double(D)), 1.0 / std::sqrt(double(D))));
  params_.allocate();
}

Batch sequence_slice(const Batch& b, int rank, int parts) {
  require(parts >= 1 && b.seqlen % parts == 0, "[parallel] cp", "the sequence length ", b.seqlen,
          " does not divide by cp = ", parts);
  Batch s;
  s.batch = b.batch, s.seqlen = b.seqlen / parts;
  const index_t L = b.seqlen, Lr = s.seqlen, off = index_t(rank) * Lr;
  s.tokens = decltype(s.tokens)("batch::tokens", b.batch * Lr);
  s.targets = decltype(s.targets)("batch::targets", b.batch * Lr);
  const auto tok = s.tokens, tgt = s.targets, btok = b.tokens, btgt = b.targets;
  par_for("lm::sequence_slice", b.batch * Lr, KOKKOS_LAMBDA(index_t i) {
    const index_t row = i / Lr, t = i % Lr;
    tok(i) = btok(row * L + off + t);
    tgt(i) = btgt(row * L + off + t);
  });
  if (b.seq_idx.extent(0) > 0) {
    s.seq_idx = decltype(s.seq_idx)("batch::seq_idx", b.batch, Lr);
    const auto sq = s.seq_idx, bsq = b.seq_idx;
    par_for("lm::sequence_slice_seq", b.batch * Lr, KOKKOS_LAMBDA(index_t i) {
      sq(i / Lr, i % Lr) = bsq(i / Lr, off + i % Lr);
    });
  }
  return s;
}

template <class T>
std::vector<double> MambaLM<T>::token_nats(const Batch& b) {
  View1<double> nats("lm::token_nats", b.batch * b.seqlen);
  forward_backward(b, 0.0, Recompute::mixer, nats);
  auto h = Kokkos::create_mirror_view_and_copy(HostMem(), nats);
  return std::vector<double>(h.data(), h.data() + h.span());
}

template <class T>
LossSum MambaLM<T>::forward_backward(const Batch& full, double grad_scale, Recompute policy,
                                     const View1<double>& row_nats) {
  const parallel::Comm& cp = *comms_.cp;
  require(cp.size() == 1 || row_nats.extent(0) == 0, "model", "per-token losses are not available under cp = ",
          cp.size());
  const Batch b = cp.size() > 1 ? sequence_slice(full, cp.rank(), cp.size()) : full;
  const index_t n = b.batch * b.seqlen, D = cfg_.mixer.d_model, V = cfg_.vocab_size;
  require(index_t(b.tokens.extent(0)) == n && index_t(b.targets.extent(0)) == n, "model",
          "batch tokens/targets must have batch * seqlen = ", n, " entries");
  const bool train = grad_scale > 0;
  // h stays a View (the backbone keeps it as its input after an inference forward), and so do the logits
  // (logits()): both are members reused while the shape holds (a fresh allocation per step frees the last one,
  // and cudaFree waits for the whole device); the step's other buffers are cached blocks (core/pool.hpp)
  PoolScope ws;
  if (index_t(h_.extent(0)) != n || index_t(h_.extent(1)) != D) {
    h_ = View2<R>();
    h_ = make_uninit<View2<R>>("lm::h", n, D);
  }
  View2<R> h = h_;
  embedding_forward<R>(params_.v2(embedding_), b.tokens, h);
  View2<T> hf = ws.take<View2<T>>("lm::hf", n, D);
  backbone_->forward(h, b.batch, b.seqlen, b.seq_idx, train, policy, hf);
  if (index_t(logits_.extent(0)) != n || index_t(logits_.extent(1)) != V) {
    logits_ = View2<T>();
    logits_ = make_uninit<View2<T>>("lm::logits", n, V);
  }
  linear_forward<T>(hf, params_.v2(lm_head_), View1<const P>(), logits_);
  View2<T> dlogits = train ? ws.take<View2<T>>("lm::dlogits", n, V) : View2<T>();
  LossSum loss = cross_entropy<T>(logits_, b.targets, grad_scale, dlogits, row_nats);
  if (cp.size() > 1) {  // the micro-batch's loss: every cp rank's slice
    double buf[2] = {loss.nats, double(loss.count)};
    cp.allreduce_sum(buf, 2);
    loss.nats = buf[0], loss.count = std::int64_t(buf[1]);
  }
  if (!train) return loss;

  View2<T> dhf = ws.take<View2<T>>("lm::dhf", n, D);
  linear_backward<T>(hf, params_.v2(lm_head_), dlogits, dhf, false, params_.g2(lm_head_), View1<P>());
  View2<R> dh = ws.take<View2<R>>("lm::dh", n, D);
  backbone_->backward(dhf, dh, grad_scale * double(loss.count));
  embedding_backward<R>(dh, b.tokens, params_.g2(embedding_));
  return loss;
}

template <class T>
index_t MambaLM<T>::param_count() const {
  // the expert-bias buffers are in the store (checkpoints carry them) but are not trained parameters
  return params_.global_count() - backbone_->buffer_count();
}

template <class T>
index_t MambaLM<T>::active_param_count() const {
  return param_count() - (backbone_->param_count() - backbone_->active_param_count());
}

template <class T>
View2<T> MambaLM<T>::prefill(const Kokkos::View<const std::int32_t*, Layout, Mem>& tokens, index_t batch,
                             index_t seqlen, BackboneState<T>& state) {
  const index_t n = batch * seqlen, D = cfg_.mixer.d_model, V = cfg_.vocab_size;
  require(index_t(tokens.extent(0)) == n, "model prefill", "tokens must have batch * seqlen = ", n, " entries");
  View2<R> h = make_uninit<View2<R>>("lm::h", n, D);
  embedding_forward<R>(params_.v2(embedding_), tokens, h);
  View2<T> hf = make_uninit<View2<T>>("lm::hf", n, D);
  backbone_->prefill(h, batch, seqlen, state, hf);
  View2<T> logits = make_uninit<View2<T>>("lm::logits", n, V);
  linear_forward<T>(hf, params_.v2(lm_head_), View1<const P>(), logits);
  return logits;
}

template <class T>
View2<T> MambaLM<T>::step(const Kokkos::View<const std::int32_t*, Layout, Mem>& tokens, BackboneState<T>& state) {
  const index_t B = tokens.extent(0), D = cfg_.mixer.d_model, V = cfg_.vocab_size;
  View2<R> h = make_uninit<View2<R>>("lm::h", B, D);
  embedding_forward<R>(params_.v2(embedding_), tokens, h);
  View2<T> hf = make_uninit<View2<T>>("lm::hf", B, D);
  backbone_->step(h, state, hf);
  View2<T> logits = make_uninit<View2<T>>("lm::logits", B, V);
  linear_forward<T>(hf, params_.v2(lm_head_), View1<const P>(), logits);
  return logits;
}

template class MambaLM<float>;
template class MambaLM<double>;

}  // namespace mm
