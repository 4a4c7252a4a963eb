#include "model/dense_ffn.hpp"

#include <cmath>

#include "core/error.hpp"
#include "parallel/tensor_parallel.hpp"

namespace mm {

void DenseFFNConfig::validate(const std::string& context) const {
  require(d_model > 0, context, "d_model must be positive (got ", d_model, ")");
  require(d_ff > 0, context, "dense d_ff must be positive (got ", d_ff, ")");
}

template <class T>
DenseFFN<T>::DenseFFN(const DenseFFNConfig& cfg, ParamStore<P>& store, const std::string& prefix, index_t n_layer,
                      const parallel::ModelComms& comms)
    : cfg_(cfg), tp_(comms.tp), store_(&store) {
  const std::string ctx = prefix.empty() ? "dense_ffn" : prefix;
  cfg_.validate(ctx);
  require(n_layer > 0, ctx, "n_layer must be positive (got ", n_layer, ")");
  const index_t D = cfg.d_model, F = cfg.d_ff;
  // the fan-ins of the bounds are the unsharded ones (a shard holds the slice of the unsharded initialisation)
  const double w_in = 1.0 / std::sqrt(double(D)), w_out = 1.0 / std::sqrt(double(F));
  const Init in_init = Init::Uniform(-w_in, w_in);
  const Init out_init = Init::Uniform(-w_out, w_out, 1.0 / std::sqrt(double(n_layer)));
  const int tp = tp_->size();
  if (tp == 1) {
    F_ = F;
    w1_ = store.add(prefix + "w1", {F, D}, true, in_init);
    w3_ = store.add(prefix + "w3", {F, D}, true, in_init);
    w2_ = store.add(prefix + "w2", {D, F}, true, out_init);
    return;
  }
  require(F % tp == 0, ctx, "dense d_ff = ", F, " does not divide by tp = ", tp);
  const auto f = parallel::tp_slice(F, tp_->rank(), tp);
  F_ = f.count;
  const IndexRange fr{f.first, f.count};
  w1_ = store.add(prefix + "w1", {F_, D}, true, in_init, Shard{Split::tp, {F, D}, {fr}, {}});
  w3_ = store.add(prefix + "w3", {F_, D}, true, in_init, Shard{Split::tp, {F, D}, {fr}, {}});
  w2_ = store.add(prefix + "w2", {D, F_}, true, out_init, Shard{Split::tp, {D, F}, {}, {fr}});
}

template <class T>
SwiGLUWeights<T> DenseFFN<T>::weights() const {
  return {store_->v1(w1_).data(), store_->v1(w3_).data(), store_->v1(w2_).data(), cfg_.d_model, F_};
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
  parallel::tp_allreduce_sum(*tp_, out, "dense_ffn forward");  // row-parallel w2: partial sums
  if (!save) acts.a = SwiGLUActs<T>{};
}

template <class T>
void DenseFFN<T>::backward(DenseFFNActs<T>& acts, const View2<const T>& dout, const View2<T>& dx) const {
  const index_t n = acts.x.extent(0), D = cfg_.d_model;
  require(index_t(dout.extent(0)) == n && index_t(dx.extent(0)) == n && index_t(dout.extent(1)) == D &&
              index_t(dx.extent(1)) == D,
          "dense_ffn", "dout and dx must be (", n, ", ", D, ")");
  if (acts.a.empty()) {  // recompute policy (the output itself is not needed again: a cached block)
    PoolScope ws;
    View2<T> y = ws.take<View2<T>>("dense_ffn::y", n, D);
    swiglu_experts_forward<T>(weights(), acts.x, {0, n}, acts.a, y);
  }
  swiglu_experts_backward<T>(weights(), acts.x, acts.a, dout, {0, n}, dx, false,
                             {store_->g1(w1_).data(), store_->g1(w3_).data(), store_->g1(w2_).data()});
  parallel::tp_allreduce_sum(*tp_, dx, "dense_ffn backward");  // column-parallel w1, w3: partial sums
  acts.a = SwiGLUActs<T>{};
}

template class DenseFFN<float>;
template class DenseFFN<double>;

}  // namespace mm
