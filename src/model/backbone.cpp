#include "model/backbone.hpp"

#include "core/error.hpp"
#include "layers/rmsnorm.hpp"

namespace mm {

template <class T>
MambaBackbone<T>::MambaBackbone(const Mamba2Config& mixer, index_t n_layer, double norm_eps, ParamStore<P>& store,
                                const std::string& prefix)
    : cfg_(mixer), n_layer_(n_layer), eps_(norm_eps), store_(&store) {
  require(n_layer >= 1, prefix, "n_layer must be at least 1 (got ", n_layer, ")");
  for (index_t l = 0; l < n_layer; ++l) {
    const std::string p = prefix + "layers." + std::to_string(l) + ".";
    norm_.push_back(store.add(p + "norm.weight", {mixer.d_model}, false, Init::Ones()));
    mixers_.push_back(std::make_unique<Mamba2Mixer<T>>(mixer, store, p + "mixer.", n_layer));
  }
  norm_f_ = store.add(prefix + "norm_f.weight", {mixer.d_model}, false, Init::Ones());
}

template <class T>
void MambaBackbone<T>::forward(const View2<R>& h, index_t batch, index_t seqlen, const SeqIdxView& seq, bool train,
                               Recompute policy, const View2<T>& out) {
  const index_t n = batch * seqlen, D = cfg_.d_model, NL = n_layer_;
  require(index_t(h.extent(0)) == n && index_t(h.extent(1)) == D && index_t(out.extent(0)) == n, "backbone",
          "inputs must be (batch * seqlen, d_model)");
  const bool save = train && policy == Recompute::none;
  batch_ = batch;
  seqlen_ = seqlen;
  seq_ = seq;
  h_.assign(train ? NL + 1 : 1, View2<R>());
  rstd_.assign(NL, View1<P>());
  xn_.assign(NL, View2<T>());
  acts_.assign(NL, Mamba2Acts<T>());
  h_[0] = h;
  View2<T> m = make_uninit<View2<T>>("backbone::mixer_out", n, D);
  for (index_t l = 0; l < NL; ++l) {
    const View2<R> hin = train ? h_[l] : h;
    xn_[l] = make_uninit<View2<T>>("backbone::xn", n, D);
    rstd_[l] = make_uninit<View1<P>>("backbone::rstd", n);
    rmsnorm_forward<R, T>(hin, store_->v1(norm_[l]), eps_, xn_[l], rstd_[l]);
    mixers_[l]->forward(xn_[l], batch, seqlen, seq, m, acts_[l], save);
    const View2<R> hout = train ? (h_[l + 1] = make_uninit<View2<R>>("backbone::h", n, D)) : h;
    par_for("backbone::residual_add", n, D,
            KOKKOS_LAMBDA(index_t i, index_t j) { hout(i, j) = hin(i, j) + R(m(i, j)); });
    if (!train) {
      xn_[l] = View2<T>();
      acts_[l] = Mamba2Acts<T>();
    }
  }
  rstd_f_ = make_uninit<View1<P>>("backbone::rstd_f", n);
  rmsnorm_forward<R, T>(train ? h_[NL] : h, store_->v1(norm_f_), eps_, out, rstd_f_);
}

template <class T>
void MambaBackbone<T>::backward(const View2<const T>& dout, const View2<R>& dh) {
  const index_t NL = n_layer_, n = batch_ * seqlen_, D = cfg_.d_model;
  require(index_t(h_.size()) == NL + 1, "backbone", "backward() needs a training forward() first");
  rmsnorm_backward<R, T>(h_[NL], store_->v1(norm_f_), rstd_f_, dout, dh, false, store_->g1(norm_f_));
  View2<T> dxn = make_uninit<View2<T>>("backbone::dxn", n, D);
  for (index_t l = NL - 1; l >= 0; --l) {
    // the residual passes dh through unchanged: it is also d(mixer output); then through the pre-norm into dh
    mixers_[l]->backward(acts_[l], batch_, seqlen_, seq_, dh, dxn);
    acts_[l] = Mamba2Acts<T>();
    rmsnorm_backward<R, T>(h_[l], store_->v1(norm_[l]), rstd_[l], dxn, dh, true, store_->g1(norm_[l]));
  }
  h_.clear();
  xn_.clear();
  rstd_.clear();
}

template class MambaBackbone<float>;
template class MambaBackbone<double>;

}  // namespace mm
