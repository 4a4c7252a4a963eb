#include "model/lm.hpp"

#include "core/error.hpp"
#include "layers/embedding.hpp"
#include "layers/linear.hpp"
#include "layers/rmsnorm.hpp"

namespace mm {

void LMConfig::validate(const std::string& context) const {
  require(vocab_size >= 2, context, "vocab_size must be at least 2 (got ", vocab_size, ")");
  require(n_layer >= 1, context, "n_layer must be at least 1 (got ", n_layer, ")");
  require(norm_eps > 0, context, "norm_eps must be positive");
  mixer.validate(context);
}

template <class T>
MambaLM<T>::MambaLM(const LMConfig& cfg) : cfg_(cfg) {
  cfg_.validate("model");
  const index_t D = cfg.mixer.d_model, V = cfg.vocab_size;
  embedding_ = params_.add("backbone.embedding.weight", {V, D}, true, Init::Normal(0.0, cfg.initializer_range));
  for (index_t l = 0; l < cfg.n_layer; ++l) {
    const std::string p = "backbone.layers." + std::to_string(l) + ".";
    norm_.push_back(params_.add(p + "norm.weight", {D}, false, Init::Ones()));
    mixers_.push_back(std::make_unique<Mamba2Mixer<T>>(cfg.mixer, params_, p + "mixer.", cfg.n_layer));
  }
  norm_f_ = params_.add("backbone.norm_f.weight", {D}, false, Init::Ones());
  lm_head_ = cfg.tie_embeddings ? embedding_
                                : params_.add("lm_head.weight", {V, D}, true,
                                              Init::Uniform(-1.0 / std::sqrt(double(D)), 1.0 / std::sqrt(double(D))));
  params_.allocate();
}

template <class T>
LossSum MambaLM<T>::forward_backward(const Batch& b, double grad_scale, Recompute policy) {
  const index_t n = b.batch * b.seqlen, D = cfg_.mixer.d_model, V = cfg_.vocab_size, NL = cfg_.n_layer;
  require(index_t(b.tokens.extent(0)) == n && index_t(b.targets.extent(0)) == n, "model",
          "batch tokens/targets must have batch * seqlen = ", n, " entries");
  const bool train = grad_scale > 0;
  const bool save = train && policy == Recompute::none;
  const double eps = cfg_.norm_eps;

  // Forward. h[l] is the residual stream entering layer l (kept for the backward when training).
  std::vector<View2<R>> h(train ? NL + 1 : 1);
  std::vector<View1<P>> rstd(NL);
  std::vector<View2<T>> xn(NL);
  std::vector<Mamba2Acts<T>> acts(NL);
  h[0] = make_uninit<View2<R>>("lm::h", n, D);
  embedding_forward<R>(params_.v2(embedding_), b.tokens, h[0]);
  View2<T> m = make_uninit<View2<T>>("lm::mixer_out", n, D);
  for (index_t l = 0; l < NL; ++l) {
    const View2<R> hin = train ? h[l] : h[0];
    xn[l] = make_uninit<View2<T>>("lm::xn", n, D);
    rstd[l] = make_uninit<View1<P>>("lm::rstd", n);
    rmsnorm_forward<R, T>(hin, params_.v1(norm_[l]), eps, xn[l], rstd[l]);
    mixers_[l]->forward(xn[l], b.batch, b.seqlen, b.seq_idx, m, acts[l], save);
    const View2<R> hout = train ? (h[l + 1] = make_uninit<View2<R>>("lm::h", n, D)) : h[0];
    par_for("lm::residual_add", n, D, KOKKOS_LAMBDA(index_t i, index_t j) { hout(i, j) = hin(i, j) + R(m(i, j)); });
    if (!train) xn[l] = View2<T>();
  }
  const View2<R> hlast = train ? h[NL] : h[0];
  View2<T> hf = make_uninit<View2<T>>("lm::hf", n, D);
  View1<P> rstd_f = make_uninit<View1<P>>("lm::rstd_f", n);
  rmsnorm_forward<R, T>(hlast, params_.v1(norm_f_), eps, hf, rstd_f);
  logits_ = make_uninit<View2<T>>("lm::logits", n, V);
  linear_forward<T>(hf, params_.v2(lm_head_), View1<const P>(), logits_);
  View2<T> dlogits = train ? make_uninit<View2<T>>("lm::dlogits", n, V) : View2<T>();
  const LossSum loss = cross_entropy<T>(logits_, b.targets, grad_scale, dlogits);
  if (!train) return loss;

  // Backward.
  View2<T> dhf = make_uninit<View2<T>>("lm::dhf", n, D);
  linear_backward<T>(hf, params_.v2(lm_head_), dlogits, dhf, false, params_.g2(lm_head_), View1<P>());
  View2<R> dh = make_uninit<View2<R>>("lm::dh", n, D);
  rmsnorm_backward<R, T>(hlast, params_.v1(norm_f_), rstd_f, dhf, dh, false, params_.g1(norm_f_));
  View2<T> dxn = make_uninit<View2<T>>("lm::dxn", n, D);
  for (index_t l = NL - 1; l >= 0; --l) {
    // d(mixer out) = dh (the residual passes dh through unchanged); then through the pre-norm into dh.
    mixers_[l]->backward(acts[l], b.batch, b.seqlen, b.seq_idx, dh, dxn);
    acts[l] = Mamba2Acts<T>{};
    rmsnorm_backward<R, T>(h[l], params_.v1(norm_[l]), rstd[l], dxn, dh, true, params_.g1(norm_[l]));
  }
  embedding_backward<R>(dh, b.tokens, params_.g2(embedding_));
  return loss;
}

template class MambaLM<float>;
template class MambaLM<double>;

}  // namespace mm
