#include "model/dense_ffn.hpp"

#include <cmath>

#include "core/error.hpp"

namespace mm {

void DenseFFNConfig::validate(const std::string& context) const {
  require(d_model > 0, context, "d_model must be positive (got ", d_model, ")");
  require(d_ff > 0, context, "dense d_ff must be positive (got ", d_ff, ")");
}

template <class T>
DenseFFN<T>::DenseFFN(const DenseFFNConfig& cfg, ParamStore<P>& store, const std::string& prefix, index_t n_layer)
    : cfg_(cfg), store_(&store) {
  const std::string ctx = prefix.empty() ? "dense_ffn" : prefix;
  cfg_.validate(ctx);
  require(n_layer > 0, ctx, "n_layer must be positive (got ", n_layer, ")");
  const index_t D = cfg.d_model, F = cfg.d_ff;
  const double w_in = 1.0 / std::sqrt(double(D)), w_out = 1.0 / std::sqrt(double(F));
  w1_ = store.add(prefix + "w1", {F, D}, true, Init::Uniform(-w_in, w_in));
  w3_ = store.add(prefix + "w3", {F, D}, true, Init::Uniform(-w_in, w_in));
  w2_ = store.add(prefix + "w2", {D, F}, true, Init::Uniform(-w_out, w_out, 1.0 / std::sqrt(double(n_layer))));
}

template <class T>
SwiGLUWeights<T> DenseFFN<T>::weights() const {
  return {store_->v1(w1_).data(), store_->v1(w3_).data(), store_->v1(w2_).data(), cfg_.d_model, cfg_.d_ff};
}

template <class T>
void DenseFFN<T>::forward(const View2<T>& x, const View2<T>& out, DenseFFNActs<T>& acts, bool save) const {
  const index_t n = x.extent(0);
  require(index_t(x.extent(1)) == cfg_.d_model && index_t(out.extent(0)) == n &&
              index_t(out.extent(1)) == cfg_.d_model,
          "dense_ffn", "x and out must be (n, d_model = ", cfg_.d_model, ")");
  acts.x = x;
  acts.a = SwiGLUActs<T>{};
  swiglu_experts_forward<T>(weights(), x, {0, n}, acts.a, out);
  if (!save) acts.a = SwiGLUActs<T>{};
}

template <class T>
void DenseFFN<T>::backward(DenseFFNActs<T>& acts, const View2<const T>& dout, const View2<T>& dx) const {
  const index_t n = acts.x.extent(0), D = cfg_.d_model;
  require(index_t(dout.extent(0)) == n && index_t(dx.extent(0)) == n && index_t(dout.extent(1)) == D &&
              index_t(dx.extent(1)) == D,
          "dense_ffn", "dout and dx must be (", n, ", ", D, ")");
  if (acts.a.empty()) {  // recompute policy
    View2<T> y = make_uninit<View2<T>>("dense_ffn::y", n, D);
    swiglu_experts_forward<T>(weights(), acts.x, {0, n}, acts.a, y);
  }
  swiglu_experts_backward<T>(weights(), acts.x, acts.a, dout, {0, n}, dx, false,
                             {store_->g1(w1_).data(), store_->g1(w3_).data(), store_->g1(w2_).data()});
  acts.a = SwiGLUActs<T>{};
}

template class DenseFFN<float>;
template class DenseFFN<double>;

}  // namespace mm
