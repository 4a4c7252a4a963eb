#include "moe/moe_layer.hpp"

#include <cmath>
#include <sstream>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "layers/linear.hpp"

namespace mm {

// ------------------------------------------------------------------ config

index_t MoEConfig::param_count() const {
  return n_experts * router_in() + 3 * n_experts * d_model * d_ff + 3 * d_model * shared_d_ff;
}

index_t MoEConfig::active_param_count() const {
  return n_experts * router_in() + 3 * top_k * d_model * d_ff + 3 * d_model * shared_d_ff;
}

RouterOptions MoEConfig::router_options() const {
  RouterOptions o;
  o.n_experts = n_experts;
  o.top_k = top_k;
  o.score = score_func;
  o.renormalize = renormalize;
  o.temperature = temperature;
  o.output_scale = output_scale;
  o.capacity_factor = capacity_factor;
  o.aux_loss_coef = aux_loss_coef;
  o.z_loss_coef = z_loss_coef;
  return o;
}

void MoEConfig::validate(const std::string& context) const {
  require(d_model > 0, context, "d_model must be positive (got ", d_model, ")");
  require(n_experts > 0, context, "n_experts must be positive (got ", n_experts, ")");
  require(top_k >= 1 && top_k <= n_experts, context, "top_k = ", top_k, " must be in [1, n_experts = ", n_experts,
          "]");
  require(d_ff > 0, context, "d_ff must be positive (got ", d_ff, ")");
  require(shared_d_ff >= 0, context, "shared_d_ff must be >= 0 (got ", shared_d_ff, ")");
  require(std::isfinite(temperature) && temperature > 0, context, "temperature must be positive (got ",
          temperature, ")");
  require(std::isfinite(output_scale) && output_scale > 0, context, "output_scale must be positive (got ",
          output_scale, ")");
  require(std::isfinite(capacity_factor) && capacity_factor >= 0, context,
          "capacity_factor must be >= 0, 0 meaning dropless (got ", capacity_factor, ")");
  require(jitter >= 0 && jitter < 1, context, "jitter must be in [0, 1) (got ", jitter, ")");
  require(std::isfinite(aux_loss_coef) && aux_loss_coef >= 0, context, "aux_loss_coef must be >= 0 (got ",
          aux_loss_coef, ")");
  require(std::isfinite(z_loss_coef) && z_loss_coef >= 0, context, "z_loss_coef must be >= 0 (got ", z_loss_coef,
          ")");
  require(std::isfinite(bias_update_rate) && bias_update_rate >= 0, context, "bias_update_rate must be >= 0 (got ",
          bias_update_rate, ")");
}

double MoEStats::load_imbalance() const {
  if (routed.empty()) return 0;
  double mx = 0, sum = 0;
  for (index_t c : routed) {
    mx = std::max(mx, double(c));
    sum += double(c);
  }
  return sum > 0 ? mx * double(routed.size()) / sum : 0;
}

std::string MoEStats::summary() const {
  std::ostringstream os;
  os << "tokens " << tokens << ", dropped " << dropped << "/" << assignments;
  if (capacity >= 0)
    os << " (capacity " << capacity << ")";
  else
    os << " (dropless)";
  os << ", imbalance " << load_imbalance() << ", aux " << aux_loss << ", z " << z_loss << ", routed [";
  for (std::size_t i = 0; i < routed.size(); ++i) os << (i ? " " : "") << routed[i];
  os << "]";
  return os.str();
}

// ------------------------------------------------------------------ layer

template <class T>
MoELayer<T>::MoELayer(const MoEConfig& cfg, ParamStore<P>& store, const std::string& prefix, index_t n_layer)
    : cfg_(cfg), store_(&store), prefix_(prefix) {
  cfg_.validate(prefix.empty() ? "moe" : prefix);
  require(n_layer > 0, prefix.empty() ? "moe" : prefix, "n_layer must be positive (got ", n_layer, ")");
  const index_t E = cfg.n_experts, D = cfg.d_model, F = cfg.d_ff, Fs = cfg.shared_d_ff;
  const double r_in = 1.0 / std::sqrt(double(cfg.router_in())), w_in = 1.0 / std::sqrt(double(D));
  const double out_scale = 1.0 / std::sqrt(double(n_layer));
  router_w_ = store.add(prefix + "router.weight", {E, cfg.router_in()}, true, Init::Uniform(-r_in, r_in));
  if (cfg.bias_update_rate > 0) bias_ = store.add(prefix + "router.expert_bias", {E}, false, Init::Zeros());
  const double w_out = 1.0 / std::sqrt(double(F));
  w1_ = store.add(prefix + "experts.w1", {E, F, D}, true, Init::Uniform(-w_in, w_in));
  w3_ = store.add(prefix + "experts.w3", {E, F, D}, true, Init::Uniform(-w_in, w_in));
  w2_ = store.add(prefix + "experts.w2", {E, D, F}, true, Init::Uniform(-w_out, w_out, out_scale));
  if (Fs > 0) {
    const double s_out = 1.0 / std::sqrt(double(Fs));
    s1_ = store.add(prefix + "shared.w1", {Fs, D}, true, Init::Uniform(-w_in, w_in));
    s3_ = store.add(prefix + "shared.w3", {Fs, D}, true, Init::Uniform(-w_in, w_in));
    s2_ = store.add(prefix + "shared.w2", {D, Fs}, true, Init::Uniform(-s_out, s_out, out_scale));
  }
}

template <class T>
std::uint64_t MoELayer<T>::jitter_stream(std::uint64_t step) const {
  return stream_mix(stream_id(prefix_ + "router.jitter"), step);
}

template <class T>
SwiGLUWeights<T> MoELayer<T>::expert_weights() const {
  return {store_->v1(w1_).data(), store_->v1(w3_).data(), store_->v1(w2_).data(), cfg_.d_model, cfg_.d_ff};
}

template <class T>
SwiGLUWeights<T> MoELayer<T>::shared_weights() const {
  return {store_->v1(s1_).data(), store_->v1(s3_).data(), store_->v1(s2_).data(), cfg_.d_model, cfg_.shared_d_ff};
}

template <class T>
View2<T> MoELayer<T>::experts_forward(MoEActs<T>& a) const {
  const Routing<P>& r = a.routing;
  const index_t n = a.x.extent(0), m = r.rows(), d = cfg_.d_model;
  a.xp = make_uninit<View2<T>>("moe::xp", m, d);
  moe_permute<T>(a.x, r.perm_token, a.xp);
  a.y = make_uninit<View2<T>>("moe::y", m, d);
  swiglu_experts_forward<T>(expert_weights(), a.xp, r.offsets, a.ex, a.y);
  View2<T> ys;
  if (cfg_.shared_d_ff > 0) {
    ys = make_uninit<View2<T>>("moe::shared_y", n, d);
    swiglu_experts_forward<T>(shared_weights(), a.x, {0, n}, a.sh, ys);
  }
  a.expert_acts_kept = true;
  return ys;
}

template <class T>
MoELosses MoELayer<T>::forward(const View2<T>& x, const View2<T>& out, MoEActs<T>& acts, bool save,
                               const MoEStep& step, const View2<T>& state) const {
  const std::string ctx = prefix_.empty() ? "moe" : prefix_;
  const index_t n = x.extent(0), d = cfg_.d_model, dr = cfg_.router_in();
  require(index_t(x.extent(1)) == d, ctx, "input has ", x.extent(1), " columns, expected d_model = ", d);
  require(out.extent(0) == x.extent(0) && index_t(out.extent(1)) == d, ctx, "output is (", out.extent(0), ", ",
          out.extent(1), "), expected (", n, ", ", d, ")");
  if (cfg_.state_aware)
    require(state.extent(0) == x.extent(0) && index_t(state.extent(1)) == d, ctx,
            "state_aware router needs a state input of shape (", n, ", ", d, "), got (", state.extent(0), ", ",
            state.extent(1), ")");
  acts = MoEActs<T>{};
  acts.x = x;
  acts.state = cfg_.state_aware ? state : View2<T>();
  acts.step = step;

  // router input
  const bool jit = cfg_.jitter > 0 && step.training;
  View2<T> xr = x;
  if (cfg_.state_aware || jit) {
    acts.xr = make_uninit<View2<T>>("moe::router_in", n, dr);
    auto xin = x;
    auto sv = acts.state;
    auto xro = acts.xr;
    const CounterRNG rng{step.seed, jitter_stream(step.step)};
    const double lo = 1.0 - cfg_.jitter, hi = 1.0 + cfg_.jitter;
    par_for("moe::router_input", n, dr, KOKKOS_LAMBDA(index_t t, index_t c) {
      P v = c < d ? P(xin(t, c)) : P(sv(t, c - d));
      if (jit) v *= P(rng.uniform(std::uint64_t(t * dr + c), lo, hi));
      xro(t, c) = static_cast<T>(v);
    });
    xr = acts.xr;
  }

  // routing
  const RouterOptions opt = cfg_.router_options();
  Routing<P>& r = acts.routing;
  r.logits = make_uninit<View2<P>>("moe::logits", n, cfg_.n_experts);
  linear_forward<T>(xr, store_->v2(router_w_), View1<const P>(), r.logits);
  router_select<P>(opt, has_expert_bias() ? View1<const P>(store_->v1(bias_)) : View1<const P>(), r);
  router_plan<P>(opt, r);
  const RouterLosses L = router_losses<P>(opt, r);

  // experts and combine (shared expert first, then the routed experts in slot order)
  const View2<T> ys = experts_forward(acts);
  if (ys.extent(0) > 0) Kokkos::deep_copy(out, ys);
  moe_unpermute_combine<T>(acts.y, r.row, r.gate, out, ys.extent(0) > 0);
  if (!save || cfg_.recompute) {
    acts.xp = View2<T>();
    acts.y = View2<T>();
    acts.ex = SwiGLUActs<T>{};
    acts.sh = SwiGLUActs<T>{};
    acts.expert_acts_kept = false;
  }

  MoEStats& s = acts.stats;
  s.routed = r.routed;
  s.kept.assign(cfg_.n_experts, 0);
  for (index_t e = 0; e < cfg_.n_experts; ++e) s.kept[e] = r.offsets[e + 1] - r.offsets[e];
  s.tokens = n;
  s.assignments = n * cfg_.top_k;
  s.dropped = s.assignments - r.rows();
  s.capacity = r.capacity;
  s.aux_loss = L.aux;
  s.z_loss = L.z;
  return MoELosses{L.aux, L.z};
}

template <class T>
void MoELayer<T>::backward(MoEActs<T>& a, const View2<const T>& dout, const View2<T>& dx, double aux_scale,
                           const View2<T>& dstate) const {
  const std::string ctx = prefix_.empty() ? "moe" : prefix_;
  const index_t n = a.x.extent(0), d = cfg_.d_model, dr = cfg_.router_in(), E = cfg_.n_experts, k = cfg_.top_k;
  require(index_t(dout.extent(0)) == n && index_t(dx.extent(0)) == n && index_t(dout.extent(1)) == d &&
              index_t(dx.extent(1)) == d,
          ctx, "dout and dx must be (", n, ", ", d, ")");
  if (cfg_.state_aware)
    require(index_t(dstate.extent(0)) == n && index_t(dstate.extent(1)) == d, ctx,
            "state_aware router needs dstate of shape (", n, ", ", d, ")");
  if (!a.expert_acts_kept) experts_forward(a);  // recompute policy
  const Routing<P>& r = a.routing;
  const index_t m = r.rows();

  // combine -> experts -> tokens
  View2<T> dy = make_uninit<View2<T>>("moe::dy", m, d);
  View2<P> dgate = make_uninit<View2<P>>("moe::dgate", n, k);
  moe_combine_backward<T>(dout, a.y, r.row, r.gate, r.perm_token, r.perm_slot, dy, dgate);
  View2<T> dxp = make_uninit<View2<T>>("moe::dxp", m, d);
  swiglu_experts_backward<T>(expert_weights(), a.xp, a.ex, dy, r.offsets, dxp, false,
                             {store_->g1(w1_).data(), store_->g1(w3_).data(), store_->g1(w2_).data()});
  moe_permute_backward<T>(dxp, r.row, dx, false);
  if (cfg_.shared_d_ff > 0)
    swiglu_experts_backward<T>(shared_weights(), a.x, a.sh, dout, {0, n}, dx, true,
                               {store_->g1(s1_).data(), store_->g1(s3_).data(), store_->g1(s2_).data()});

  // router: gates, load-balancing loss, z-loss -> logits -> router weight and input
  View2<P> dl = make_uninit<View2<P>>("moe::dlogits", n, E);
  router_backward<P>(cfg_.router_options(), r, dgate, aux_scale, dl);
  if (a.xr.extent(0) == 0 && a.xr.data() == nullptr) {
    linear_backward<T>(a.x, store_->v2(router_w_), dl, dx, true, store_->g2(router_w_), View1<P>());
  } else {
    View2<T> dxr = make_uninit<View2<T>>("moe::drouter_in", n, dr);
    linear_backward<T>(a.xr, store_->v2(router_w_), dl, dxr, false, store_->g2(router_w_), View1<P>());
    const bool jit = cfg_.jitter > 0 && a.step.training, sa = cfg_.state_aware;
    const CounterRNG rng{a.step.seed, jitter_stream(a.step.step)};
    const double lo = 1.0 - cfg_.jitter, hi = 1.0 + cfg_.jitter;
    auto dxo = dx;
    auto dso = dstate;
    par_for("moe::router_input_backward", n, dr, KOKKOS_LAMBDA(index_t t, index_t c) {
      P g = P(dxr(t, c));
      if (jit) g *= P(rng.uniform(std::uint64_t(t * dr + c), lo, hi));
      if (c < d)
        dxo(t, c) = static_cast<T>(P(dxo(t, c)) + g);
      else if (sa)
        dso(t, c - d) = static_cast<T>(g);
    });
  }
}

template <class T>
void MoELayer<T>::update_expert_bias(const std::vector<double>& load) const {
  if (!has_expert_bias()) return;
  mm::update_expert_bias<P>(store_->v1(bias_), load, cfg_.bias_update_rate);
}

template class MoELayer<float>;
template class MoELayer<double>;

}  // namespace mm
