#include "ssm/mamba1/mixer.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "core/pool.hpp"
#include "layers/linear.hpp"
#include "parallel/tensor_parallel.hpp"
#include "ssm/windows.hpp"

namespace mm {

void Mamba1Config::validate(const std::string& context) const {
  require(d_model > 0, context, "d_model must be positive (got ", d_model, ")");
  require(d_state > 0, context, "d_state must be positive (got ", d_state, ")");
  require(expand > 0, context, "expand must be positive (got ", expand, ")");
  require(d_conv >= 1 && d_conv <= kMaxConvWidth, context, "d_conv must be in [1, ", kMaxConvWidth, "] (got ", d_conv, ")");
  require(dt_rank >= 0, context, "dt_rank must be positive, or 0 for ceil(d_model / 16) (got ", dt_rank, ")");
  require(chunk > 0, context, "chunk_size must be positive (got ", chunk, ")");
  require(dt_min > 0 && dt_max >= dt_min, context, "need 0 < dt_min <= dt_max (got ", dt_min, ", ", dt_max, ")");
  require(dt_init_floor >= 0, context, "dt_init_floor must be non-negative (got ", dt_init_floor, ")");
  require(window >= 0, context, "window must be 0 (off) or a positive number of tokens (got ", window, ")");
}

template <class T>
Mamba1Mixer<T>::Mamba1Mixer(const Mamba1Config& cfg, ParamStore<P>& store, const std::string& prefix,
                            index_t n_layer, const parallel::ModelComms& comms)
    : cfg_(cfg), tp_(comms.tp), store_(&store), cp_(comms.cp) {
  const std::string ctx = prefix.empty() ? "mamba1" : prefix;
  cfg_.validate(ctx);
  require(n_layer > 0, ctx, "n_layer must be positive (got ", n_layer, ")");
  require(cfg_.window == 0 || cp_->size() == 1, ctx, "window = ", cfg_.window,
          " (model.mixer_window) needs cp = 1: with context parallelism each rank already holds a slice");
  const index_t D = cfg_.d_model, E = cfg_.d_inner(), W = cfg_.d_conv, R = cfg_.rank(), N = cfg_.d_state;
  // the fan-ins of the bounds are the unsharded ones (a shard holds the slice of the unsharded initialisation)
  const double lin_in = 1.0 / std::sqrt(double(D)), lin_e = 1.0 / std::sqrt(double(E));
  const double conv = 1.0 / std::sqrt(double(W)), dt_std = 1.0 / std::sqrt(double(R));
  const Init in_init = Init::Uniform(-lin_in, lin_in), conv_init = Init::Uniform(-conv, conv);
  const Init x_init = Init::Uniform(-lin_e, lin_e), dt_init = Init::Uniform(-dt_std, dt_std);
  const Init dtb_init = Init::DtBias(cfg_.dt_min, cfg_.dt_max, cfg_.dt_init_floor);
  const Init A_init = Init::LogColumn(N);  // log(n + 1)
  const Init out_init = Init::Uniform(-lin_e, lin_e, 1.0 / std::sqrt(double(n_layer)));
  const int tp = tp_->size();
  if (tp == 1) {
    E_ = E;
    in_proj_ = store.add(prefix + "in_proj.weight", {2 * E, D}, true, in_init);
    conv_w_ = store.add(prefix + "conv1d.weight", {E, W}, true, conv_init);
    conv_b_ = store.add(prefix + "conv1d.bias", {E}, false, conv_init);
    x_proj_ = store.add(prefix + "x_proj.weight", {R + 2 * N, E}, true, x_init);
    dt_w_ = store.add(prefix + "dt_proj.weight", {E, R}, true, dt_init);
    dt_b_ = store.add(prefix + "dt_proj.bias", {E}, false, dtb_init);
    A_log_ = store.add(prefix + "A_log", {E, N}, false, A_init);
    D_ = store.add(prefix + "D", {E}, false, Init::Ones());
    out_proj_ = store.add(prefix + "out_proj.weight", {D, E}, true, out_init);
    return;
  }
  require(E % tp == 0, ctx, "d_inner = expand * d_model = ", E, " does not divide by tp = ", tp);
  const auto c = parallel::tp_slice(E, tp_->rank(), tp);
  E_ = c.count;
  const IndexRange ch{c.first, c.count}, z_r{E + c.first, c.count};
  auto rows = [](std::vector<index_t> global, std::vector<IndexRange> r) {
    return Shard{Split::tp, std::move(global), std::move(r), {}};
  };
  auto cols = [](std::vector<index_t> global, IndexRange c) { return Shard{Split::tp, std::move(global), {}, {c}}; };
  in_proj_ = store.add(prefix + "in_proj.weight", {2 * E_, D}, true, in_init, rows({2 * E, D}, {ch, z_r}));
  conv_w_ = store.add(prefix + "conv1d.weight", {E_, W}, true, conv_init, rows({E, W}, {ch}));
  conv_b_ = store.add(prefix + "conv1d.bias", {E_}, false, conv_init, rows({E}, {ch}));
  x_proj_ = store.add(prefix + "x_proj.weight", {R + 2 * N, E_}, true, x_init, cols({R + 2 * N, E}, ch));
  dt_w_ = store.add(prefix + "dt_proj.weight", {E_, R}, true, dt_init, rows({E, R}, {ch}));
  dt_b_ = store.add(prefix + "dt_proj.bias", {E_}, false, dtb_init, rows({E}, {ch}));
  A_log_ = store.add(prefix + "A_log", {E_, N}, false, A_init, rows({E, N}, {ch}));
  D_ = store.add(prefix + "D", {E_}, false, Init::Ones(), rows({E}, {ch}));
  out_proj_ = store.add(prefix + "out_proj.weight", {D, E_}, true, out_init, cols({D, E}, ch));
}

template <class T>
Mamba1State<T> Mamba1Mixer<T>::make_state(index_t batch) const {
  require(batch > 0, "Mamba1Mixer::make_state", "batch must be positive (got ", batch, ")");
  Mamba1State<T> s;
  s.conv = View3<T>("mamba1::conv_state", batch, E_, cfg_.d_conv - 1);
  s.ssm = View3<P>("mamba1::ssm_state", batch, E_, cfg_.d_state);
  return s;
}

template <class T>
Mamba1State<T> Mamba1Mixer<T>::make_state(index_t batch, PoolScope& ws) const {
  require(batch > 0, "Mamba1Mixer::make_state", "batch must be positive (got ", batch, ")");
  Mamba1State<T> s;
  s.conv = ws.take<View3<T>>("mamba1::conv_state", batch, E_, cfg_.d_conv - 1);
  s.ssm = ws.take<View3<P>>("mamba1::ssm_state", batch, E_, cfg_.d_state);
  Kokkos::deep_copy(s.conv, T(0));
  Kokkos::deep_copy(s.ssm, P(0));
  return s;
}

template <class T>
void Mamba1Mixer<T>::check_state(const Mamba1State<T>& s, index_t batch, const char* what) const {
  const index_t E = E_;
  require(index_t(s.conv.extent(0)) == batch && index_t(s.conv.extent(1)) == E &&
              index_t(s.conv.extent(2)) == cfg_.d_conv - 1,
          what, "conv state must be (batch, d_inner, d_conv - 1) = (", batch, ", ", E, ", ", cfg_.d_conv - 1,
          "), it is (", s.conv.extent(0), ", ", s.conv.extent(1), ", ", s.conv.extent(2), ")");
  require(index_t(s.ssm.extent(0)) == batch && index_t(s.ssm.extent(1)) == E &&
              index_t(s.ssm.extent(2)) == cfg_.d_state,
          what, "ssm state must be (batch, d_inner, d_state) = (", batch, ", ", E, ", ", cfg_.d_state, "), it is (",
          s.ssm.extent(0), ", ", s.ssm.extent(1), ", ", s.ssm.extent(2), ")");
}

template <class T>
UView2<acc_t<T>> Mamba1Mixer<T>::xproj_dt(const View1<P>& buf) const {
  return UView2<P>(buf.data(), cfg_.rank(), E_);
}

template <class T>
UView2<acc_t<T>> Mamba1Mixer<T>::xproj_bc(const View1<P>& buf) const {
  return UView2<P>(buf.data() + cfg_.rank() * E_, 2 * cfg_.d_state, E_);
}

namespace {
// A = -exp(A_log), (E, N). A free function: CUDA lambdas may not sit in private member functions.
template <class P>
View2<P> a_from_log(const View1<P>& a_log, index_t E, index_t N, PoolScope& ws) {
  const View2<P> A = ws.take<View2<P>>("mamba1::A", E, N);
  par_for("mamba1::A", E, N, KOKKOS_LAMBDA(index_t d, index_t n) { A(d, n) = -Kokkos::exp(a_log(d * N + n)); });
  return A;
}

template <class P>
View1<P> m1_cont_view(const std::vector<int>& cont) {
  View1<P> v(Kokkos::view_alloc(Kokkos::WithoutInitializing, "mamba1::cp_cont"), cont.size());
  auto h = Kokkos::create_mirror_view(HostMem(), v);
  for (std::size_t i = 0; i < cont.size(); ++i) h(i) = cont[i] ? P(1) : P(0);
  Kokkos::deep_copy(v, h);
  return v;
}

// Context parallel: the incoming state (batch, E, N) from the fold, zero where token 0 starts a record.
// (Free functions: CUDA lambdas may not sit in private member functions.)
template <class P>
View3<P> m1_cp_state_in(const View1<P>& S_fold, const std::vector<int>& cont_v, index_t batch, index_t E,
                        index_t N) {
  View1<P> cont = m1_cont_view<P>(cont_v);
  View3<P> Sin3(Kokkos::view_alloc(Kokkos::WithoutInitializing, "mamba1::ssm_init"), batch, E, N);
  par_for("mamba1::cp_state_in", batch, E * N, KOKKOS_LAMBDA(index_t b, index_t i) {
    Sin3(b, i / N, i % N) = cont(b) * S_fold(b * E * N + i);
  });
  return Sin3;
}

// Context parallel: the slice's total decay g(b, d, n) = exp(sum_t Delta_t A(d, n)), zero when a record starts
// inside the slice or at its first token.
template <class T>
View1<acc_t<T>> m1_cp_total_decay(const Mamba1Acts<T>& a, const View2<acc_t<T>>& A,
                                  const View1<const acc_t<T>>& delta_bias, const SeqIdxView& seq, index_t batch,
                                  index_t L, index_t E, index_t N) {
  using P = acc_t<T>;
  View1<P> cont = m1_cont_view<P>(a.cp_cont);
  View1<P> g(Kokkos::view_alloc(Kokkos::WithoutInitializing, "mamba1::cp_g"), batch * E * N);
  const auto delta = a.delta;
  const bool has_seq = seq.extent(0) > 0;
  par_for("mamba1::cp_total_decay", batch * E, N, KOKKOS_LAMBDA(index_t bd, index_t k) {
    const index_t b = bd / E, d = bd % E;
    P run = 0;
    bool same = true;
    for (index_t t = 0; t < L; ++t) {
      if (has_seq && seq(b, t) != seq(b, 0)) same = false;
      run += softplus(P(delta(b * L + t, d)) + delta_bias(d)) * A(d, k);
    }
    g(bd * N + k) = same ? cont(b) * Kokkos::exp(run) : P(0);
  });
  return g;
}

// Context parallel backward: the decay as above and G(b, d, n) = sum_t exp(l_t) dout_t silu(z_t) C_t,n over the
// slice's first record (zero when the slice starts a record), l_t the in-slice cumsum of Delta A.
template <class T>
void m1_cp_state_grad(const Mamba1Acts<T>& a, const View2<acc_t<T>>& A, const View1<const acc_t<T>>& delta_bias,
                      const SeqIdxView& seq, const View2<T>& dy, index_t batch, index_t L, index_t E, index_t N,
                      View1<acc_t<T>>& gdec, View1<acc_t<T>>& Gs) {
  using P = acc_t<T>;
  gdec = m1_cp_total_decay<T>(a, A, delta_bias, seq, batch, L, E, N);
  View1<P> cont = m1_cont_view<P>(a.cp_cont);
  View1<P> G(Kokkos::view_alloc(Kokkos::WithoutInitializing, "mamba1::cp_G"), batch * E * N);
  const auto delta = a.delta;
  const auto xz = a.xz;
  const auto bc = a.bc;
  const bool has_seq = seq.extent(0) > 0;
  par_for("mamba1::cp_G", batch * E, N, KOKKOS_LAMBDA(index_t bd, index_t k) {
    const index_t b = bd / E, d = bd % E;
    P run = 0, acc = 0;
    for (index_t t = 0; t < L; ++t) {
      if (has_seq && seq(b, t) != seq(b, 0)) break;
      const index_t row = b * L + t;
      run += softplus(P(delta(row, d)) + delta_bias(d)) * A(d, k);
      acc += Kokkos::exp(run) * P(dy(row, d)) * silu(P(xz(row, E + d))) * P(bc(row, N + k));
    }
    G(bd * N + k) = cont(b) * acc;
  });
  Gs = G;
}
}  // namespace

template <class T>
View2<acc_t<T>> Mamba1Mixer<T>::A_matrix(PoolScope& ws) const {
  return a_from_log<P>(store_->v1(A_log_), E_, cfg_.d_state, ws);
}

template <class T>
SelScanShape Mamba1Mixer<T>::scan_shape(index_t batch, index_t seqlen) const {
  SelScanShape s;
  s.batch = batch;
  s.seqlen = seqlen;
  s.dinner = E_;
  s.ngroups = 1;
  s.dstate = cfg_.d_state;
  s.chunk = cfg_.chunk;
  return s;
}

template <class T>
SelScanIn<T> Mamba1Mixer<T>::scan_in(const Mamba1Acts<T>& a, const View2<P>& A, const SeqIdxView& seq) const {
  SelScanIn<T> in;
  in.u = a.xc;
  in.delta = a.delta;
  in.bc = a.bc;
  in.b_col = 0;
  in.c_col = cfg_.d_state;
  in.z = a.xz;
  in.z_col = E_;
  in.A = A;
  in.D = store_->v1(D_);
  in.delta_bias = store_->v1(dt_b_);
  in.seq_idx = seq;
  in.init_state = a.ssm_init;
  return in;
}

template <class T>
void Mamba1Mixer<T>::take_activations(const View2<T>& u, index_t n, Mamba1Acts<T>& a) const {
  const index_t E = E_, R = cfg_.rank(), N = cfg_.d_state;
  a.u = u;
  a.internals = std::make_shared<PoolScope>();
  PoolScope& ws = *a.internals;
  a.xz = ws.take<View2<T>>("mamba1::xz", n, 2 * E);
  a.xc = ws.take<View2<T>>("mamba1::xc", n, E);
  a.dt_low = ws.take<View2<T>>("mamba1::dt_low", n, R);
  a.bc = ws.take<View2<T>>("mamba1::bc", n, 2 * N);
  a.delta = ws.take<View2<T>>("mamba1::delta", n, E);
  a.y = ws.take<View2<T>>("mamba1::y", n, E);
}

template <class T>
void Mamba1Mixer<T>::run_internals(const View2<T>& u, index_t batch, index_t seqlen, const SeqIdxView& seq,
                                   Mamba1Acts<T>& a, bool keep_checkpoints, const View3<P>& final_ssm) const {
  const index_t n = batch * seqlen, E = E_;
  require(index_t(u.extent(0)) == n && index_t(u.extent(1)) == cfg_.d_model, "Mamba1Mixer",
          "u must be (batch * seqlen, d_model) = (", n, ", ", cfg_.d_model, "), it is (", u.extent(0), ", ",
          u.extent(1), ")");
  take_activations(u, n, a);
  PoolScope& ws = *a.internals;
  const SelScanShape ss = scan_shape(batch, seqlen);
  a.checkpoints = keep_checkpoints ? selective_scan_alloc_checkpoints<T>(ss, &ws) : View3<P>();
  linear_forward<T>(u, store_->v2(in_proj_), View1<const P>(), a.xz);
  conv1d_silu_forward<T>(Conv1dIn<T>{a.xz, 0, batch, seqlen, E, a.conv_init}, store_->v2(conv_w_),
                         store_->v1(conv_b_), seq, a.xc);
  linear_forward<T>(a.xc, xproj_dt(store_->v1(x_proj_)), View1<const P>(), a.dt_low);
  linear_forward<T>(a.xc, xproj_bc(store_->v1(x_proj_)), View1<const P>(), a.bc);
  parallel::tp_allreduce_sum(*tp_, a.dt_low, "Mamba1Mixer (x_proj)");  // row-parallel x_proj: partial sums
  parallel::tp_allreduce_sum(*tp_, a.bc, "Mamba1Mixer (x_proj)");
  linear_forward<T>(a.dt_low, store_->v2(dt_w_), View1<const P>(), a.delta);
  {
    PoolScope aws;
    selective_scan_forward<T>(ss, scan_in(a, A_matrix(aws), seq), a.y, final_ssm, a.checkpoints);
  }
}

template <class T>
void Mamba1Mixer<T>::forward(const View2<T>& u, index_t batch, index_t seqlen, const SeqIdxView& seq,
                             const View2<T>& out, Mamba1Acts<T>& acts, bool save) const {
  forward(u, batch, seqlen, seq, out, acts, save, nullptr, nullptr);
}

template <class T>
void Mamba1Mixer<T>::forward(const View2<T>& u, index_t batch, index_t seqlen, const SeqIdxView& seq,
                             const View2<T>& out, Mamba1Acts<T>& acts, bool save, const Mamba1State<T>* init,
                             Mamba1State<T>* final) const {
  if (cp_->size() > 1) {
    require(!init && !final, "Mamba1Mixer::forward", "explicit initial/final states are not supported with cp = ",
            cp_->size(), " (the state is passed between the cp ranks)");
    forward_cp(u, batch, seqlen, seq, out, acts, save);
    return;
  }
  if (!init && !final && cfg_.window > 0 && seqlen > cfg_.window) {
    windows::forward(*this, cfg_.window, u, batch, seqlen, seq, out, acts);
    return;
  }
  acts = Mamba1Acts<T>{};
  if (init) {  // copies: `final` may be `init`, and the backward needs the state the forward started from
    check_state(*init, batch, "Mamba1Mixer::forward (initial state)");
    acts.states = std::make_shared<PoolScope>();
    PoolScope& ws = *acts.states;
    acts.conv_init =
        ws.take<View3<T>>("mamba1::conv_init", init->conv.extent(0), init->conv.extent(1), init->conv.extent(2));
    acts.ssm_init =
        ws.take<View3<P>>("mamba1::ssm_init", init->ssm.extent(0), init->ssm.extent(1), init->ssm.extent(2));
    Kokkos::deep_copy(acts.conv_init, init->conv);
    Kokkos::deep_copy(acts.ssm_init, init->ssm);
  }
  if (final) check_state(*final, batch, "Mamba1Mixer::forward (final state)");
  run_internals(u, batch, seqlen, seq, acts, save, final ? final->ssm : View3<P>());
  linear_forward<T>(acts.y, store_->v2(out_proj_), View1<const P>(), out);
  parallel::tp_allreduce_sum(*tp_, out, "Mamba1Mixer::forward");  // row-parallel out_proj: partial sums
  if (final)
    conv1d_state_out<T>(Conv1dIn<T>{acts.xz, 0, batch, seqlen, E_, acts.conv_init}, cfg_.d_conv, seq,
                        final->conv);
  if (!save) {
    Mamba1Acts<T> kept;
    kept.u = u;
    kept.conv_init = acts.conv_init;
    kept.ssm_init = acts.ssm_init;
    kept.states = acts.states;
    acts = kept;
  }
}

template <class T>
void Mamba1Mixer<T>::backward(Mamba1Acts<T>& a, index_t batch, index_t seqlen, const SeqIdxView& seq,
                              const View2<const T>& dout, const View2<T>& du) const {
  backward(a, batch, seqlen, seq, dout, du, nullptr, nullptr);
}

template <class T>
void Mamba1Mixer<T>::backward(Mamba1Acts<T>& a, index_t batch, index_t seqlen, const SeqIdxView& seq,
                              const View2<const T>& dout, const View2<T>& du, const Mamba1State<T>* dfinal_state,
                              Mamba1State<T>* dinit_state) const {
  require(cp_->size() == 1 || (!dfinal_state && !dinit_state), "Mamba1Mixer::backward",
          "explicit state gradients are not supported with cp = ", cp_->size());
  if (!a.win_ssm.empty()) {
    require(!dfinal_state && !dinit_state, "Mamba1Mixer::backward", "a windowed forward has no explicit states");
    windows::backward(*this, cfg_.window, a, batch, seqlen, seq, dout, du);
    return;
  }
  if (dfinal_state) check_state(*dfinal_state, batch, "Mamba1Mixer::backward (final state gradient)");
  if (dinit_state) check_state(*dinit_state, batch, "Mamba1Mixer::backward (initial state gradient)");
  if (a.xz.extent(0) == 0) run_internals(a.u, batch, seqlen, seq, a, true, View3<P>());  // recompute policy
  const index_t n = batch * seqlen, E = E_, R = cfg_.rank(), N = cfg_.d_state;
  PoolScope ws;  // A and the gradients of the internals: cached device blocks, returned at the end
  const View2<P> A = A_matrix(ws);
  // out_proj
  View2<T> dy = ws.take<View2<T>>("mamba1::dy", n, E);
  linear_backward<T>(a.y, store_->v2(out_proj_), dout, dy, false, store_->g2(out_proj_), View1<P>());
  // selective scan: du into dxc, dz into the z columns of d(xz), dB/dC, d(delta), dA, dD, d(dt_proj.bias)
  View2<T> dxz = ws.take<View2<T>>("mamba1::dxz", n, 2 * E);
  View2<T> dxc = ws.take<View2<T>>("mamba1::dxc", n, E);
  View2<T> ddelta = ws.take<View2<T>>("mamba1::ddelta", n, E);
  View2<T> dbc = ws.take<View2<T>>("mamba1::dbc", n, 2 * N);
  const View2<P> dA = ws.take<View2<P>>("mamba1::dA", E, N);
  Kokkos::deep_copy(Exec(), dA, P(0));
  SelScanGrad<T> g;
  g.du = dxc;
  g.ddelta = ddelta;
  g.dbc = dbc;
  g.dz = dxz;
  g.dz_col = E;
  g.dA = dA;
  g.dD = store_->g1(D_);
  g.ddelta_bias = store_->g1(dt_b_);
  View3<P> dfinal = dfinal_state ? dfinal_state->ssm : View3<P>();
  if (dinit_state) g.dinit_state = dinit_state->ssm;
  if (cp_->size() > 1) {
    require(index_t(a.cp_cont.size()) == batch, "Mamba1Mixer::backward", "cp = ", cp_->size(),
            " needs the forward of the same mixer with cp (no context-parallel state kept for batch = ", batch, ")");
    View1<P> gdec, Gs;
    m1_cp_state_grad<T>(a, A, store_->v1(dt_b_), seq, dy, batch, seqlen, E, N, gdec, Gs);
    View1<P> dS = parallel::cp_state_scan_backward<P>(*cp_, gdec, Gs, 1);
    dfinal = ws.take<View3<P>>("mamba1::cp_dfinal", batch, E, N);
    Kokkos::deep_copy(View1<P>(dfinal.data(), dfinal.size()), dS);
  }
  selective_scan_backward<T>(scan_shape(batch, seqlen), scan_in(a, A, seq), dy, dfinal, a.checkpoints, g);
  const View1<P> gA_log = store_->g1(A_log_);
  par_for("mamba1::dA_log", E, N, KOKKOS_LAMBDA(index_t d, index_t k) { gA_log(d * N + k) += dA(d, k) * A(d, k); });
  // dt_proj (its bias gradient came from the scan)
  View2<T> ddt_low = ws.take<View2<T>>("mamba1::ddt_low", n, R);
  linear_backward<T>(a.dt_low, store_->v2(dt_w_), ddelta, ddt_low, false, store_->g2(dt_w_), View1<P>());
  // under tp each rank's channels gave a part of d(dt_low) (column-parallel dt_proj) and of dB, dC (the scan)
  parallel::tp_allreduce_sum(*tp_, ddt_low, "Mamba1Mixer::backward (dt_proj)");
  parallel::tp_allreduce_sum(*tp_, dbc, "Mamba1Mixer::backward (scan)");
  // x_proj, accumulated into dxc
  linear_backward<T>(a.xc, xproj_bc(store_->v1(x_proj_)), dbc, dxc, true, xproj_bc(store_->g1(x_proj_)),
                     View1<P>());
  linear_backward<T>(a.xc, xproj_dt(store_->v1(x_proj_)), ddt_low, dxc, true, xproj_dt(store_->g1(x_proj_)),
                     View1<P>());
  // conv: d(x) into the x columns of d(xz)
  conv1d_silu_backward<T>(Conv1dIn<T>{a.xz, 0, batch, seqlen, E, a.conv_init}, store_->v2(conv_w_),
                          store_->v1(conv_b_), seq, dxc, dxz, 0, store_->g2(conv_w_), store_->g1(conv_b_));
  if (dinit_state)  // the conv prefix fed the outputs of token 0's record
    windows::conv_init_backward<T>(Conv1dIn<T>{a.xz, 0, batch, seqlen, E, a.conv_init}, store_->v2(conv_w_),
                                   store_->v1(conv_b_), seq, dxc, dinit_state->conv);
  if (dfinal_state)  // the final conv state: the last d_conv - 1 conv inputs (the x columns of xz)
    windows::conv_state_out_backward<T>(dfinal_state->conv, a.conv_init, seq, seqlen, dxz, 0,
                                        dinit_state ? dinit_state->conv : View3<T>());
  if (cp_->size() > 1) {  // the halo's gradient goes back to the left neighbour, which adds it to its rows
    View3<T> dprefix = ws.take<View3<T>>("mamba1::cp_dprefix", batch, E, cfg_.d_conv - 1);
    parallel::conv1d_silu_prefix_grad<T>(Conv1dIn<T>{a.xz, 0, batch, seqlen, E, a.conv_init}, store_->v2(conv_w_),
                                         store_->v1(conv_b_), seq, dxc, a.cp_mask, dprefix);
    parallel::cp_conv_halo_backward<T>(*cp_, dprefix, dxz, 0, batch, seqlen);
  }
  // in_proj
  linear_backward<T>(a.u, store_->v2(in_proj_), dxz, du, false, store_->g2(in_proj_), View1<P>());
  parallel::tp_allreduce_sum(*tp_, du, "Mamba1Mixer::backward");  // column-parallel in_proj: partial sums
}

template <class T>
void Mamba1Mixer<T>::forward_cp(const View2<T>& u, index_t batch, index_t seqlen, const SeqIdxView& seq,
                                const View2<T>& out, Mamba1Acts<T>& a, bool save) const {
  const index_t n = batch * seqlen, E = E_, N = cfg_.d_state;
  require(index_t(u.extent(0)) == n && index_t(u.extent(1)) == cfg_.d_model, "Mamba1Mixer",
          "u must be (batch * seqlen, d_model) = (", n, ", ", cfg_.d_model, "), it is (", u.extent(0), ", ",
          u.extent(1), ")");
  a = Mamba1Acts<T>{};
  take_activations(u, n, a);
  PoolScope& ws = *a.internals;
  const SelScanShape ss = scan_shape(batch, seqlen);
  linear_forward<T>(u, store_->v2(in_proj_), View1<const P>(), a.xz);
  auto halo = parallel::cp_conv_halo_forward<T>(*cp_, a.xz, 0, E, batch, seqlen, cfg_.d_conv, seq);
  a.conv_init = halo.prefix;
  a.cp_mask = halo.mask;
  a.cp_cont = halo.cont;
  conv1d_silu_forward<T>(Conv1dIn<T>{a.xz, 0, batch, seqlen, E, a.conv_init}, store_->v2(conv_w_),
                         store_->v1(conv_b_), seq, a.xc);
  linear_forward<T>(a.xc, xproj_dt(store_->v1(x_proj_)), View1<const P>(), a.dt_low);
  linear_forward<T>(a.xc, xproj_bc(store_->v1(x_proj_)), View1<const P>(), a.bc);
  parallel::tp_allreduce_sum(*tp_, a.dt_low, "Mamba1Mixer (x_proj)");  // row-parallel x_proj: partial sums
  parallel::tp_allreduce_sum(*tp_, a.bc, "Mamba1Mixer (x_proj)");
  linear_forward<T>(a.dt_low, store_->v2(dt_w_), View1<const P>(), a.delta);
  // local scan from a zero state for the final local state, the exclusive scan across the ranks, the scan again
  // from the incoming state
  PoolScope aws;
  const View2<P> A = A_matrix(aws);
  View3<P> S_loc = aws.take<View3<P>>("mamba1::cp_S_loc", batch, E, N);
  selective_scan_forward<T>(ss, scan_in(a, A, seq), a.y, S_loc);
  View1<P> gdec = m1_cp_total_decay<T>(a, A, store_->v1(dt_b_), seq, batch, seqlen, E, N);
  View1<P> S_in = parallel::cp_state_scan_forward<P>(*cp_, gdec, View1<const P>(S_loc.data(), S_loc.size()), 1);
  a.ssm_init = m1_cp_state_in<P>(S_in, a.cp_cont, batch, E, N);
  a.checkpoints = save ? selective_scan_alloc_checkpoints<T>(ss, &ws) : View3<P>();
  selective_scan_forward<T>(ss, scan_in(a, A, seq), a.y, View3<P>(), a.checkpoints);
  linear_forward<T>(a.y, store_->v2(out_proj_), View1<const P>(), out);
  parallel::tp_allreduce_sum(*tp_, out, "Mamba1Mixer::forward");  // row-parallel out_proj: partial sums
  if (!save) {  // the recompute then runs the local code from the kept halo and incoming state
    Mamba1Acts<T> kept;
    kept.u = u;
    kept.conv_init = a.conv_init;
    kept.ssm_init = a.ssm_init;
    kept.states = a.states;
    kept.cp_mask = a.cp_mask;
    kept.cp_cont = a.cp_cont;
    a = kept;
  }
}

template <class T>
std::uint64_t Mamba1Mixer<T>::cp_traffic_bytes(index_t batch, bool with_seq_idx) const {
  if (cp_->size() == 1) return 0;
  const std::uint64_t B = std::uint64_t(batch), E = std::uint64_t(E_), N = std::uint64_t(cfg_.d_state);
  return 2 * B * E * N * 2 * sizeof(P) +
         parallel::cp_conv_halo_bytes(*cp_, batch, cfg_.d_conv, E_, sizeof(T), with_seq_idx);
}

template <class T>
void Mamba1Mixer<T>::step(const View2<T>& u, Mamba1State<T>& state, const View2<T>& out) const {
  const index_t batch = u.extent(0), E = E_, R = cfg_.rank(), N = cfg_.d_state;
  require(index_t(u.extent(1)) == cfg_.d_model && out.extent(0) == u.extent(0) &&
              index_t(out.extent(1)) == cfg_.d_model,
          "Mamba1Mixer::step", "u and out must be (batch, d_model) with d_model = ", cfg_.d_model);
  check_state(state, batch, "Mamba1Mixer::step");
  Mamba1Acts<T> a;
  a.xz = make_uninit<View2<T>>("mamba1::xz", batch, 2 * E);
  a.xc = make_uninit<View2<T>>("mamba1::xc", batch, E);
  a.dt_low = make_uninit<View2<T>>("mamba1::dt_low", batch, R);
  a.bc = make_uninit<View2<T>>("mamba1::bc", batch, 2 * N);
  a.delta = make_uninit<View2<T>>("mamba1::delta", batch, E);
  a.y = make_uninit<View2<T>>("mamba1::y", batch, E);
  linear_forward<T>(u, store_->v2(in_proj_), View1<const P>(), a.xz);
  conv1d_silu_step<T>(a.xz, 0, store_->v2(conv_w_), store_->v1(conv_b_), state.conv, a.xc);
  linear_forward<T>(a.xc, xproj_dt(store_->v1(x_proj_)), View1<const P>(), a.dt_low);
  linear_forward<T>(a.xc, xproj_bc(store_->v1(x_proj_)), View1<const P>(), a.bc);
  parallel::tp_allreduce_sum(*tp_, a.dt_low, "Mamba1Mixer::step (x_proj)");
  parallel::tp_allreduce_sum(*tp_, a.bc, "Mamba1Mixer::step (x_proj)");
  linear_forward<T>(a.dt_low, store_->v2(dt_w_), View1<const P>(), a.delta);
  {
    PoolScope aws;
    selective_scan_step<T>(scan_shape(batch, 1), scan_in(a, A_matrix(aws), SeqIdxView()), state.ssm, a.y);
  }
  linear_forward<T>(a.y, store_->v2(out_proj_), View1<const P>(), out);
  parallel::tp_allreduce_sum(*tp_, out, "Mamba1Mixer::step");
}

template class Mamba1Mixer<float>;
template class Mamba1Mixer<double>;

}  // namespace mm
