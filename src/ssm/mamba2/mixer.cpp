#include "ssm/mamba2/mixer.hpp"

#include <cmath>

#include "core/error.hpp"
#include "layers/linear.hpp"
#include "layers/rmsnorm.hpp"

namespace mm {

void Mamba2Config::validate(const std::string& context) const {
  require(d_model > 0 && d_state > 0 && expand > 0 && headdim > 0 && ngroups > 0 && chunk > 0, context,
          "d_model, d_state, expand, headdim, ngroups and chunk_size must be positive");
  require(d_conv >= 1, context, "d_conv must be at least 1 (got ", d_conv, ")");
  require(d_inner() % headdim == 0, context, "d_inner = expand * d_model = ", d_inner(),
          " is not divisible by headdim = ", headdim);
  require(nheads() % ngroups == 0, context, "nheads = d_inner / headdim = ", nheads(),
          " is not divisible by ngroups = ", ngroups);
  require(dt_min > 0 && dt_max >= dt_min, context, "need 0 < dt_min <= dt_max (got ", dt_min, ", ", dt_max, ")");
  require(A_init_lo > 0 && A_init_hi >= A_init_lo, context, "need 0 < A_init_range[0] <= A_init_range[1]");
  require(dt_limit_lo >= 0 && dt_limit_hi > dt_limit_lo, context, "dt_limit must be an interval in [0, inf)");
}

template <class T>
Mamba2Mixer<T>::Mamba2Mixer(const Mamba2Config& cfg, ParamStore<P>& store, const std::string& prefix,
                            index_t n_layer)
    : cfg_(cfg), store_(&store) {
  cfg_.validate(prefix.empty() ? "mamba2" : prefix);
  const index_t D = cfg.d_model, E = cfg.d_inner(), H = cfg.nheads(), W = cfg.d_conv, C = cfg.conv_dim();
  const double lin_in = 1.0 / std::sqrt(double(D)), lin_out = 1.0 / std::sqrt(double(E));
  const double conv = 1.0 / std::sqrt(double(W));
  in_proj_ = store.add(prefix + "in_proj.weight", {cfg.d_in_proj(), D}, true, Init::Uniform(-lin_in, lin_in));
  conv_w_ = store.add(prefix + "conv1d.weight", {C, W}, true, Init::Uniform(-conv, conv));
  conv_b_ = store.add(prefix + "conv1d.bias", {C}, false, Init::Uniform(-conv, conv));
  dt_bias_ = store.add(prefix + "dt_bias", {H}, false, Init::DtBias(cfg.dt_min, cfg.dt_max, cfg.dt_init_floor));
  A_log_ = store.add(prefix + "A_log", {H}, false, Init::ALog(cfg.A_init_lo, cfg.A_init_hi));
  D_ = store.add(prefix + "D", {H}, false, Init::Ones());
  norm_w_ = store.add(prefix + "norm.weight", {E}, false, Init::Ones());
  out_proj_ = store.add(prefix + "out_proj.weight", {D, E}, true,
                        Init::Uniform(-lin_out, lin_out, 1.0 / std::sqrt(double(n_layer))));
}

template <class T>
SSDShape Mamba2Mixer<T>::ssd_shape(index_t batch, index_t seqlen) const {
  SSDShape s;
  s.batch = batch;
  s.seqlen = seqlen;
  s.nheads = cfg_.nheads();
  s.headdim = cfg_.headdim;
  s.ngroups = cfg_.ngroups;
  s.dstate = cfg_.d_state;
  s.chunk = cfg_.chunk;
  s.dt_lo = cfg_.dt_limit_lo;
  s.dt_hi = cfg_.dt_limit_hi;
  return s;
}

template <class T>
SSDIn<T> Mamba2Mixer<T>::ssd_in(const Mamba2Acts<T>& acts, const SeqIdxView& seq) const {
  const index_t E = cfg_.d_inner(), GN = cfg_.ngroups * cfg_.d_state;
  SSDIn<T> in;
  in.xbc = acts.xbc;
  in.x_col = 0;
  in.b_col = E;
  in.c_col = E + GN;
  in.dt = acts.zxbcdt;
  in.dt_col = 2 * E + 2 * GN;
  in.A_log = store_->v1(A_log_);
  in.dt_bias = store_->v1(dt_bias_);
  in.D = store_->v1(D_);
  in.seq_idx = seq;
  return in;
}

template <class T>
void Mamba2Mixer<T>::run_internals(const View2<T>& u, index_t batch, index_t seqlen, const SeqIdxView& seq,
                                   Mamba2Acts<T>& a) const {
  const index_t n = batch * seqlen, E = cfg_.d_inner(), G = cfg_.ngroups;
  a.u = u;
  a.zxbcdt = make_uninit<View2<T>>("mamba2::zxbcdt", n, cfg_.d_in_proj());
  a.xbc = make_uninit<View2<T>>("mamba2::xbc", n, cfg_.conv_dim());
  a.y = make_uninit<View2<T>>("mamba2::y", n, E);
  a.yn = make_uninit<View2<T>>("mamba2::yn", n, E);
  a.rstd = make_uninit<View2<P>>("mamba2::rstd", n, G);
  linear_forward<T>(u, store_->v2(in_proj_), View1<const P>(), a.zxbcdt);
  conv1d_silu_forward<T>(Conv1dIn<T>{a.zxbcdt, E, batch, seqlen, cfg_.conv_dim()}, store_->v2(conv_w_),
                         store_->v1(conv_b_), seq, a.xbc);
  ssd_forward<T>(ssd_shape(batch, seqlen), ssd_in(a, seq), a.y, View4<P>());
  gated_rmsnorm_forward<T>(GatedNormIn<T>{a.y, 0, a.zxbcdt, 0}, E, E / G, GateOrder::gate_first,
                           store_->v1(norm_w_), cfg_.norm_eps, a.yn, a.rstd);
}

template <class T>
void Mamba2Mixer<T>::forward(const View2<T>& u, index_t batch, index_t seqlen, const SeqIdxView& seq,
                             const View2<T>& out, Mamba2Acts<T>& acts, bool save) const {
  run_internals(u, batch, seqlen, seq, acts);
  linear_forward<T>(acts.yn, store_->v2(out_proj_), View1<const P>(), out);
  if (!save) acts = Mamba2Acts<T>{u, {}, {}, {}, {}, {}};
}

template <class T>
void Mamba2Mixer<T>::backward(Mamba2Acts<T>& a, index_t batch, index_t seqlen, const SeqIdxView& seq,
                              const View2<const T>& dout, const View2<T>& du) const {
  if (a.zxbcdt.extent(0) == 0) run_internals(a.u, batch, seqlen, seq, a);  // recompute policy
  const index_t n = batch * seqlen, E = cfg_.d_inner(), G = cfg_.ngroups;
  // out_proj
  View2<T> dyn = make_uninit<View2<T>>("mamba2::dyn", n, E);
  linear_backward<T>(a.yn, store_->v2(out_proj_), dout, dyn, false, store_->g2(out_proj_), View1<P>());
  // gated norm: dy, and dz straight into the z columns of d(zxbcdt)
  View2<T> dzxbcdt = make_uninit<View2<T>>("mamba2::dzxbcdt", n, cfg_.d_in_proj());
  View2<T> dy = make_uninit<View2<T>>("mamba2::dy", n, E);
  gated_rmsnorm_backward<T>(GatedNormIn<T>{a.y, 0, a.zxbcdt, 0}, E, E / G, GateOrder::gate_first,
                            store_->v1(norm_w_), a.rstd, dyn, dy, 0, dzxbcdt, 0, store_->g1(norm_w_));
  // scan: d(xBC) and d(dt) (written into the dt columns of d(zxbcdt))
  View2<T> dxbc = make_uninit<View2<T>>("mamba2::dxbc", n, cfg_.conv_dim());
  SSDGrad<T> g;
  g.dxbc = dxbc;
  g.ddt = dzxbcdt;
  g.dA_log = store_->g1(A_log_);
  g.ddt_bias = store_->g1(dt_bias_);
  g.dD = store_->g1(D_);
  ssd_backward<T>(ssd_shape(batch, seqlen), ssd_in(a, seq), dy, View4<const P>(), g);
  // conv: d([x | B | C]) into its columns of d(zxbcdt)
  conv1d_silu_backward<T>(Conv1dIn<T>{a.zxbcdt, E, batch, seqlen, cfg_.conv_dim()}, store_->v2(conv_w_),
                          store_->v1(conv_b_), seq, dxbc, dzxbcdt, E, store_->g2(conv_w_), store_->g1(conv_b_));
  // in_proj
  linear_backward<T>(a.u, store_->v2(in_proj_), dzxbcdt, du, false, store_->g2(in_proj_), View1<P>());
}

template class Mamba2Mixer<float>;
template class Mamba2Mixer<double>;

}  // namespace mm
