#include "ssm/mamba2/mixer.hpp"

#include <cmath>

#include "core/error.hpp"
#include "layers/linear.hpp"
#include "layers/rmsnorm.hpp"
#include "parallel/tensor_parallel.hpp"

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
                            index_t n_layer, const parallel::ModelComms& comms)
    : cfg_(cfg), tp_(comms.tp), store_(&store) {
  const std::string ctx = prefix.empty() ? "mamba2" : prefix;
  cfg_.validate(ctx);
  const index_t D = cfg.d_model, E = cfg.d_inner(), H = cfg.nheads(), W = cfg.d_conv, C = cfg.conv_dim();
  const index_t G = cfg.ngroups, GN = G * cfg.d_state;
  // the fan-ins of the bounds are the unsharded ones (a shard holds the slice of the unsharded initialisation)
  const double lin_in = 1.0 / std::sqrt(double(D)), lin_out = 1.0 / std::sqrt(double(E));
  const double conv = 1.0 / std::sqrt(double(W));
  const Init in_init = Init::Uniform(-lin_in, lin_in), conv_init = Init::Uniform(-conv, conv);
  const Init dt_init = Init::DtBias(cfg.dt_min, cfg.dt_max, cfg.dt_init_floor);
  const Init A_init = Init::ALog(cfg.A_init_lo, cfg.A_init_hi);
  const Init out_init = Init::Uniform(-lin_out, lin_out, 1.0 / std::sqrt(double(n_layer)));
  const int tp = tp_->size();
  if (tp == 1) {
    E_ = E, H_ = H, G_ = G, C_ = C, Din_ = cfg.d_in_proj();
    in_proj_ = store.add(prefix + "in_proj.weight", {Din_, D}, true, in_init);
    conv_w_ = store.add(prefix + "conv1d.weight", {C, W}, true, conv_init);
    conv_b_ = store.add(prefix + "conv1d.bias", {C}, false, conv_init);
    dt_bias_ = store.add(prefix + "dt_bias", {H}, false, dt_init);
    A_log_ = store.add(prefix + "A_log", {H}, false, A_init);
    D_ = store.add(prefix + "D", {H}, false, Init::Ones());
    norm_w_ = store.add(prefix + "norm.weight", {E}, false, Init::Ones());
    out_proj_ = store.add(prefix + "out_proj.weight", {D, E}, true, out_init);
    return;
  }
  require(H % tp == 0, ctx, "nheads = ", H, " does not divide by tp = ", tp);
  require(G % tp == 0, ctx, "ngroups = ", G, " does not divide by tp = ", tp);
  const int r = tp_->rank();
  const auto e = parallel::tp_slice(E, r, tp), gn = parallel::tp_slice(GN, r, tp), h = parallel::tp_slice(H, r, tp);
  E_ = e.count, H_ = h.count, G_ = G / tp, C_ = E_ + 2 * gn.count, Din_ = 2 * E_ + 2 * gn.count + H_;
  const IndexRange z_r{e.first, e.count}, x_r{E + e.first, e.count}, B_r{2 * E + gn.first, gn.count},
      C_r{2 * E + GN + gn.first, gn.count}, dt_r{2 * E + 2 * GN + h.first, h.count};
  // conv channels are [x | B | C]
  const IndexRange cx_r{e.first, e.count}, cB_r{E + gn.first, gn.count}, cC_r{E + GN + gn.first, gn.count};
  const IndexRange heads{h.first, h.count}, chans{e.first, e.count};
  auto shard = [](std::vector<index_t> global, std::vector<IndexRange> rows, std::vector<IndexRange> cols = {}) {
    return Shard{Split::tp, std::move(global), std::move(rows), std::move(cols)};
  };
  in_proj_ = store.add(prefix + "in_proj.weight", {Din_, D}, true, in_init,
                       shard({cfg.d_in_proj(), D}, {z_r, x_r, B_r, C_r, dt_r}));
  conv_w_ = store.add(prefix + "conv1d.weight", {C_, W}, true, conv_init, shard({C, W}, {cx_r, cB_r, cC_r}));
  conv_b_ = store.add(prefix + "conv1d.bias", {C_}, false, conv_init, shard({C}, {cx_r, cB_r, cC_r}));
  dt_bias_ = store.add(prefix + "dt_bias", {H_}, false, dt_init, shard({H}, {heads}));
  A_log_ = store.add(prefix + "A_log", {H_}, false, A_init, shard({H}, {heads}));
  D_ = store.add(prefix + "D", {H_}, false, Init::Ones(), shard({H}, {heads}));
  norm_w_ = store.add(prefix + "norm.weight", {E_}, false, Init::Ones(), shard({E}, {chans}));
  out_proj_ = store.add(prefix + "out_proj.weight", {D, E_}, true, out_init, shard({D, E}, {}, {chans}));
}

template <class T>
SSDShape Mamba2Mixer<T>::ssd_shape(index_t batch, index_t seqlen) const {
  SSDShape s;
  s.batch = batch;
  s.seqlen = seqlen;
  s.nheads = H_;
  s.headdim = cfg_.headdim;
  s.ngroups = G_;
  s.dstate = cfg_.d_state;
  s.chunk = cfg_.chunk;
  s.dt_lo = cfg_.dt_limit_lo;
  s.dt_hi = cfg_.dt_limit_hi;
  return s;
}

template <class T>
SSDIn<T> Mamba2Mixer<T>::ssd_in(const Mamba2Acts<T>& acts, const SeqIdxView& seq) const {
  const index_t E = E_, GN = G_ * cfg_.d_state;
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
  in.init_state = acts.ssm_init;
  return in;
}

template <class T>
void Mamba2Mixer<T>::run_internals(const View2<T>& u, index_t batch, index_t seqlen, const SeqIdxView& seq,
                                   Mamba2Acts<T>& a, const View4<P>& final_ssm) const {
  const index_t n = batch * seqlen, E = E_, G = G_;
  a.u = u;
  a.zxbcdt = make_uninit<View2<T>>("mamba2::zxbcdt", n, Din_);
  a.xbc = make_uninit<View2<T>>("mamba2::xbc", n, C_);
  a.y = make_uninit<View2<T>>("mamba2::y", n, E);
  a.yn = make_uninit<View2<T>>("mamba2::yn", n, E);
  a.rstd = make_uninit<View2<P>>("mamba2::rstd", n, G);
  linear_forward<T>(u, store_->v2(in_proj_), View1<const P>(), a.zxbcdt);
  conv1d_silu_forward<T>(Conv1dIn<T>{a.zxbcdt, E, batch, seqlen, C_, a.conv_init},
                         store_->v2(conv_w_), store_->v1(conv_b_), seq, a.xbc);
  ssd_forward<T>(ssd_shape(batch, seqlen), ssd_in(a, seq), a.y, final_ssm);
  gated_rmsnorm_forward<T>(GatedNormIn<T>{a.y, 0, a.zxbcdt, 0}, E, E / G, GateOrder::gate_first,
                           store_->v1(norm_w_), cfg_.norm_eps, a.yn, a.rstd);
}

template <class T>
void Mamba2Mixer<T>::forward(const View2<T>& u, index_t batch, index_t seqlen, const SeqIdxView& seq,
                             const View2<T>& out, Mamba2Acts<T>& acts, bool save) const {
  forward(u, batch, seqlen, seq, out, acts, save, nullptr, nullptr);
}

template <class T>
void Mamba2Mixer<T>::forward(const View2<T>& u, index_t batch, index_t seqlen, const SeqIdxView& seq,
                             const View2<T>& out, Mamba2Acts<T>& acts, bool save, const Mamba2State<T>* init,
                             Mamba2State<T>* final) const {
  acts = Mamba2Acts<T>{};
  if (init) {  // copies: `final` may be `init`, and the backward needs the state the forward started from
    check_state(*init, batch, "Mamba2Mixer::forward (initial state)");
    acts.conv_init = View3<T>(Kokkos::view_alloc(Kokkos::WithoutInitializing, "mamba2::conv_init"),
                              init->conv.extent(0), init->conv.extent(1), init->conv.extent(2));
    acts.ssm_init = View4<P>(Kokkos::view_alloc(Kokkos::WithoutInitializing, "mamba2::ssm_init"),
                             init->ssm.extent(0), init->ssm.extent(1), init->ssm.extent(2), init->ssm.extent(3));
    Kokkos::deep_copy(acts.conv_init, init->conv);
    Kokkos::deep_copy(acts.ssm_init, init->ssm);
  }
  if (final) check_state(*final, batch, "Mamba2Mixer::forward (final state)");
  run_internals(u, batch, seqlen, seq, acts, final ? final->ssm : View4<P>());
  linear_forward<T>(acts.yn, store_->v2(out_proj_), View1<const P>(), out);
  parallel::tp_allreduce_sum(*tp_, out, "Mamba2Mixer::forward");  // row-parallel out_proj: partial sums
  if (final)
    conv1d_state_out<T>(Conv1dIn<T>{acts.zxbcdt, E_, batch, seqlen, C_, acts.conv_init},
                        cfg_.d_conv, seq, final->conv);
  if (!save) {
    Mamba2Acts<T> kept;
    kept.u = u;
    kept.conv_init = acts.conv_init;
    kept.ssm_init = acts.ssm_init;
    acts = kept;
  }
}

template <class T>
void Mamba2Mixer<T>::backward(Mamba2Acts<T>& a, index_t batch, index_t seqlen, const SeqIdxView& seq,
                              const View2<const T>& dout, const View2<T>& du) const {
  if (a.zxbcdt.extent(0) == 0) run_internals(a.u, batch, seqlen, seq, a, View4<P>());  // recompute policy
  const index_t n = batch * seqlen, E = E_, G = G_;
  // out_proj
  View2<T> dyn = make_uninit<View2<T>>("mamba2::dyn", n, E);
  linear_backward<T>(a.yn, store_->v2(out_proj_), dout, dyn, false, store_->g2(out_proj_), View1<P>());
  // gated norm: dy, and dz straight into the z columns of d(zxbcdt)
  View2<T> dzxbcdt = make_uninit<View2<T>>("mamba2::dzxbcdt", n, Din_);
  View2<T> dy = make_uninit<View2<T>>("mamba2::dy", n, E);
  gated_rmsnorm_backward<T>(GatedNormIn<T>{a.y, 0, a.zxbcdt, 0}, E, E / G, GateOrder::gate_first,
                            store_->v1(norm_w_), a.rstd, dyn, dy, 0, dzxbcdt, 0, store_->g1(norm_w_));
  // scan: d(xBC) and d(dt) (written into the dt columns of d(zxbcdt))
  View2<T> dxbc = make_uninit<View2<T>>("mamba2::dxbc", n, C_);
  SSDGrad<T> g;
  g.dxbc = dxbc;
  g.ddt = dzxbcdt;
  g.dA_log = store_->g1(A_log_);
  g.ddt_bias = store_->g1(dt_bias_);
  g.dD = store_->g1(D_);
  ssd_backward<T>(ssd_shape(batch, seqlen), ssd_in(a, seq), dy, View4<const P>(), g);
  // conv: d([x | B | C]) into its columns of d(zxbcdt)
  conv1d_silu_backward<T>(Conv1dIn<T>{a.zxbcdt, E, batch, seqlen, C_, a.conv_init}, store_->v2(conv_w_),
                          store_->v1(conv_b_), seq, dxbc, dzxbcdt, E, store_->g2(conv_w_), store_->g1(conv_b_));
  // in_proj
  linear_backward<T>(a.u, store_->v2(in_proj_), dzxbcdt, du, false, store_->g2(in_proj_), View1<P>());
  parallel::tp_allreduce_sum(*tp_, du, "Mamba2Mixer::backward");  // column-parallel in_proj: partial sums
}

template <class T>
Mamba2State<T> Mamba2Mixer<T>::make_state(index_t batch) const {
  require(batch > 0, "Mamba2Mixer::make_state", "batch must be positive (got ", batch, ")");
  Mamba2State<T> s;
  s.conv = View3<T>("mamba2::conv_state", batch, C_, cfg_.d_conv - 1);
  s.ssm = View4<P>("mamba2::ssm_state", batch, H_, cfg_.headdim, cfg_.d_state);
  return s;
}

template <class T>
void Mamba2Mixer<T>::check_state(const Mamba2State<T>& s, index_t batch, const char* what) const {
  const index_t C = C_, H = H_;
  require(index_t(s.conv.extent(0)) == batch && index_t(s.conv.extent(1)) == C &&
              index_t(s.conv.extent(2)) == cfg_.d_conv - 1,
          what, "conv state must be (batch, conv_dim, d_conv - 1) = (", batch, ", ", C, ", ", cfg_.d_conv - 1,
          "), it is (", s.conv.extent(0), ", ", s.conv.extent(1), ", ", s.conv.extent(2), ")");
  require(index_t(s.ssm.extent(0)) == batch && index_t(s.ssm.extent(1)) == H &&
              index_t(s.ssm.extent(2)) == cfg_.headdim && index_t(s.ssm.extent(3)) == cfg_.d_state,
          what, "ssm state must be (batch, nheads, headdim, d_state) = (", batch, ", ", H, ", ", cfg_.headdim, ", ",
          cfg_.d_state, ")");
}

template <class T>
void Mamba2Mixer<T>::step(const View2<T>& u, Mamba2State<T>& state, const View2<T>& out) const {
  const index_t batch = u.extent(0), E = E_, G = G_;
  require(index_t(u.extent(1)) == cfg_.d_model && out.extent(0) == u.extent(0) &&
              index_t(out.extent(1)) == cfg_.d_model,
          "Mamba2Mixer::step", "u and out must be (batch, d_model) with d_model = ", cfg_.d_model);
  check_state(state, batch, "Mamba2Mixer::step");
  Mamba2Acts<T> a;
  a.zxbcdt = make_uninit<View2<T>>("mamba2::zxbcdt", batch, Din_);
  a.xbc = make_uninit<View2<T>>("mamba2::xbc", batch, C_);
  a.y = make_uninit<View2<T>>("mamba2::y", batch, E);
  a.yn = make_uninit<View2<T>>("mamba2::yn", batch, E);
  a.rstd = make_uninit<View2<P>>("mamba2::rstd", batch, G);
  linear_forward<T>(u, store_->v2(in_proj_), View1<const P>(), a.zxbcdt);
  conv1d_silu_step<T>(a.zxbcdt, E, store_->v2(conv_w_), store_->v1(conv_b_), state.conv, a.xbc);
  ssd_step<T>(ssd_shape(batch, 1), ssd_in(a, SeqIdxView()), state.ssm, a.y);
  gated_rmsnorm_forward<T>(GatedNormIn<T>{a.y, 0, a.zxbcdt, 0}, E, E / G, GateOrder::gate_first,
                           store_->v1(norm_w_), cfg_.norm_eps, a.yn, a.rstd);
  linear_forward<T>(a.yn, store_->v2(out_proj_), View1<const P>(), out);
  parallel::tp_allreduce_sum(*tp_, out, "Mamba2Mixer::step");
}

template class Mamba2Mixer<float>;
template class Mamba2Mixer<double>;

}  // namespace mm
