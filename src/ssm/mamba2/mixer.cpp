#include "ssm/mamba2/mixer.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "core/pool.hpp"
#include "layers/linear.hpp"
#include "layers/rmsnorm.hpp"
#include "parallel/tensor_parallel.hpp"
#include "ssm/windows.hpp"

namespace mm {

namespace {
// per batch row, 1 where token 0 continues the left neighbour's record, as a device vector of P
template <class P>
View1<P> cp_cont_view(const std::vector<int>& cont, PoolScope& ws) {
  View1<P> v = ws.take<View1<P>>("mamba2::cp_cont", cont.size());
  auto h = Kokkos::create_mirror_view(HostMem(), v);
  for (std::size_t i = 0; i < cont.size(); ++i) h(i) = cont[i] ? P(1) : P(0);
  Kokkos::deep_copy(v, h);
  return v;
}

// Tokens per block of the two-level prefix sum in m2_cp_decay_weights.
constexpr index_t kCpDecayBlock = 256;

// Delta = softplus(dt + dt_bias) clamped to dt_limit.
template <class P>
KOKKOS_INLINE_FUNCTION P cp_delta(P raw, P bias, P lo, P hi) {
  const P d = softplus(raw + bias);
  return d < lo ? lo : (d > hi ? hi : d);
}

// exp(l_t), l_t = sum_{j <= t} Delta_j A_h inside the slice, for the tokens of the slice's first record; 0 after.
// rows_nz: 1 + the largest t (over rows and heads) whose weight is not zero (0 if none): exp(l_t) only decreases
// and underflows to exactly 0 after enough decay, so the correction and its gradient need only rows t < rows_nz.
// (Free functions: CUDA lambdas may not sit in private member functions.)
template <class T>
View2<acc_t<T>> m2_cp_decay_weights(const View2<T>& dt, index_t dtc, const View1<const acc_t<T>>& A_log,
                                    const View1<const acc_t<T>>& dt_bias, double dt_lo, double dt_hi,
                                    const SeqIdxView& seq, index_t batch, index_t L, index_t H, PoolScope* ws,
                                    index_t& rows_nz) {
  using P = acc_t<T>;
  View2<P> lexp = take_or_alloc<View2<P>>(ws, "mamba2::cp_lexp", batch * L, H);
  const P lo = P(dt_lo);
  const P hi = std::isinf(dt_hi) ? Kokkos::Experimental::finite_max_v<P> : P(dt_hi);
  const bool has_seq = seq.extent(0) > 0;
  // A two-level prefix sum of Delta_t A, parallel over (row, block of kBlk tokens, head): the blocks' sums, their
  // exclusive scan per (row, head) with the row's first record boundary, then the running sum inside each block.
  // (One team per (row, head) with a team scan over the slice left 131,072-token slices to batch * H teams: 1.85 ms
  // per call on an H200, 48 calls per step.)
  const index_t nb = (L + kCpDecayBlock - 1) / kCpDecayBlock;
  View2<P> part = take_or_alloc<View2<P>>(ws, "mamba2::cp_lpart", batch * nb, H);
  View2<index_t> fb = take_or_alloc<View2<index_t>>(ws, "mamba2::cp_first_part", batch * nb, 1);
  View1<index_t> first = take_or_alloc<View1<index_t>>(ws, "mamba2::cp_first", batch);
  View2<index_t> lastp = take_or_alloc<View2<index_t>>(ws, "mamba2::cp_last_part", batch * nb, H);
  par_for("mamba2::cp_decay_part", batch * nb, H, KOKKOS_LAMBDA(index_t bk, index_t h) {
    const index_t b = bk / nb, t0 = (bk % nb) * kCpDecayBlock, t1 = t0 + kCpDecayBlock < L ? t0 + kCpDecayBlock : L;
    const P A = -Kokkos::exp(A_log(h)), bias = dt_bias(h);
    P sum = 0;
    for (index_t t = t0; t < t1; ++t) sum += cp_delta(P(dt(b * L + t, dtc + h)), bias, lo, hi) * A;
    part(bk, h) = sum;
    if (h == 0) {
      index_t f = L;
      if (has_seq)
        for (index_t t = t0; t < t1 && f == L; ++t)
          if (seq(b, t) != seq(b, 0)) f = t;
      fb(bk, 0) = f;
    }
  });
  par_for("mamba2::cp_decay_offsets", batch, H, KOKKOS_LAMBDA(index_t b, index_t h) {
    P run = 0;
    index_t f = L;
    for (index_t k = 0; k < nb; ++k) {
      const P v = part(b * nb + k, h);
      part(b * nb + k, h) = run;
      run += v;
      f = fb(b * nb + k, 0) < f ? fb(b * nb + k, 0) : f;
    }
    if (h == 0) first(b) = f;
  });
  par_for("mamba2::cp_decay", batch * nb, H, KOKKOS_LAMBDA(index_t bk, index_t h) {
    const index_t b = bk / nb, t0 = (bk % nb) * kCpDecayBlock, t1 = t0 + kCpDecayBlock < L ? t0 + kCpDecayBlock : L;
    const index_t f = first(b);
    const P A = -Kokkos::exp(A_log(h)), bias = dt_bias(h);
    P run = part(bk, h);
    index_t last = -1;
    for (index_t t = t0; t < t1; ++t) {
      run += cp_delta(P(dt(b * L + t, dtc + h)), bias, lo, hi) * A;
      const P w = t < f ? Kokkos::exp(run) : P(0);
      lexp(b * L + t, h) = w;
      if (w != P(0)) last = t;
    }
    lastp(bk, h) = last;
  });
  index_t last = -1;
  Kokkos::parallel_reduce(
      "mamba2::cp_rows", Kokkos::RangePolicy<Exec>(0, batch * nb * H),
      KOKKOS_LAMBDA(index_t i, index_t& m) {
        const index_t v = lastp(i / H, i % H);
        if (v > m) m = v;
      },
      Kokkos::Max<index_t>(last));
  rows_nz = last + 1;
  return lexp;
}

// g(b, h): the slice's total decay, zero when a record starts inside it (or at its first token)
template <class P>
View1<P> m2_cp_total_decay(const View2<P>& lexp, const View1<P>& c, index_t batch, index_t L, index_t H,
                           PoolScope& ws) {
  View1<P> g = ws.take<View1<P>>("mamba2::cp_g", batch * H);
  par_for("mamba2::cp_total_decay", batch * H, KOKKOS_LAMBDA(index_t bh) {
    const index_t b = bh / H, h = bh % H;
    g(bh) = c(b) * lexp(b * L + L - 1, h);
  });
  return g;
}

// S_in (batch, H, P, N) from the fold (zero where token 0 starts a record), then the correction of the first
// record's outputs y_t += exp(l_t) C_t . S_in over the rows t < Lnz where exp(l_t) is not zero: per (row, group)
// one GEMM C_g S_g^T (the group's heads' outputs, tokens x heads * headdim, into a cached scratch block), then
// the rows scaled by exp(l_t) and added to y.
// (An elementwise kernel with a 128-term dot product per output took 4.6 ms per layer at 131,072 tokens.)
template <class T>
void m2_cp_apply_state_in(const View1<acc_t<T>>& S_fold, const View1<acc_t<T>>& cont, const View4<acc_t<T>>& Sin4,
                          const View2<acc_t<T>>& lexp, const View2<T>& xbc, index_t ccol, const View2<T>& y,
                          index_t batch, index_t L, index_t Lnz, index_t H, index_t Pd, index_t N, index_t HG,
                          GemmCompute cmp, PoolScope& ws) {
  using P = acc_t<T>;
  const index_t PN = Pd * N, G = H / HG, HP = H * Pd, ldx = index_t(xbc.stride(0));
  par_for("mamba2::cp_state_in", batch, H * PN, KOKKOS_LAMBDA(index_t b, index_t i) {
    Sin4(b, i / PN, (i % PN) / N, i % N) = cont(b) * S_fold(b * H * PN + i);
  });
  if (Lnz == 0) return;
  View2<P> corr = ws.take<View2<P>>("mamba2::cp_correction", batch * Lnz, HP);
  gemm_batched_2d(Trans::N, Trans::T, Lnz, HG * Pd, N, P(1), xbc.data() + ccol, ldx, L * ldx, N, Sin4.data(), N,
                  H * PN, HG * PN, P(0), corr.data(), HP, Lnz * HP, HG * Pd, batch, G, cmp);
  par_for("mamba2::cp_correct", batch * Lnz, HP, KOKKOS_LAMBDA(index_t r, index_t hp) {
    const index_t row = (r / Lnz) * L + r % Lnz;
    const P w = lexp(row, hp / Pd);
    if (w != P(0)) y(row, hp) = static_cast<T>(P(y(row, hp)) + w * corr(r, hp));
  });
}

// G(b, h, p, n) = sum_t exp(l_t) dy_t C_t^T over the first record, zero when the slice starts a record: dy scaled
// by exp(l_t) (zero after the first record) into a cached scratch block, then per (row, group) the GEMMs
// (dy_h)^T C_g of the group's heads (C shared by them), over the rows t < Lnz where exp(l_t) is not zero.
template <class T>
View4<acc_t<T>> m2_cp_state_grad(const View2<acc_t<T>>& lexp, const View1<acc_t<T>>& cont, const View2<T>& dy,
                                 const View2<T>& xbc, index_t ccol, index_t batch, index_t L, index_t Lnz, index_t H,
                                 index_t Pd, index_t N, index_t HG, GemmCompute cmp, PoolScope& ws) {
  using P = acc_t<T>;
  const index_t G = H / HG, HP = H * Pd, PN = Pd * N, ldx = index_t(xbc.stride(0));
  View4<P> Gs = ws.take<View4<P>>("mamba2::cp_G", batch, H, Pd, N);
  if (Lnz == 0) {
    Kokkos::deep_copy(Gs, P(0));
    return Gs;
  }
  View2<P> dyw = ws.take<View2<P>>("mamba2::cp_dy_scaled", batch * Lnz, HP);
  par_for("mamba2::cp_dy_scaled", batch * Lnz, HP, KOKKOS_LAMBDA(index_t r, index_t hp) {
    const index_t row = (r / Lnz) * L + r % Lnz;
    dyw(r, hp) = lexp(row, hp / Pd) * P(dy(row, hp));
  });
  for (index_t b = 0; b < batch; ++b)
    gemm_batched_2d(Trans::T, Trans::N, Pd, N, Lnz, P(1), dyw.data() + b * Lnz * HP, HP, HG * Pd, Pd,
                    xbc.data() + ccol + b * L * ldx, ldx, N, 0, P(0), Gs.data() + b * H * PN, N, HG * PN, PN, G, HG,
                    cmp);
  par_for("mamba2::cp_G", batch, H * PN, KOKKOS_LAMBDA(index_t b, index_t i) {
    Gs(b, i / PN, (i % PN) / N, i % N) *= cont(b);
  });
  return Gs;
}
}  // namespace

void Mamba2Config::validate(const std::string& context) const {
  require(d_model > 0 && d_state > 0 && expand > 0 && headdim > 0 && ngroups > 0 && chunk > 0, context,
          "d_model, d_state, expand, headdim, ngroups and chunk_size must be positive");
  require(d_conv >= 1 && d_conv <= kMaxConvWidth, context, "d_conv must be in [1, ", kMaxConvWidth, "] (got ", d_conv, ")");
  require(d_inner() % headdim == 0, context, "d_inner = expand * d_model = ", d_inner(),
          " is not divisible by headdim = ", headdim);
  require(nheads() % ngroups == 0, context, "nheads = d_inner / headdim = ", nheads(),
          " is not divisible by ngroups = ", ngroups);
  require(dt_min > 0 && dt_max >= dt_min, context, "need 0 < dt_min <= dt_max (got ", dt_min, ", ", dt_max, ")");
  require(A_init_lo > 0 && A_init_hi >= A_init_lo, context, "need 0 < A_init_range[0] <= A_init_range[1]");
  require(dt_limit_lo >= 0 && dt_limit_hi > dt_limit_lo, context, "dt_limit must be an interval in [0, inf)");
  require(window >= 0, context, "window must be 0 (off) or a positive number of tokens (got ", window, ")");
}


template <class T>
Mamba2Mixer<T>::Mamba2Mixer(const Mamba2Config& cfg, ParamStore<P>& store, const std::string& prefix,
                            index_t n_layer, const parallel::ModelComms& comms)
    : cfg_(cfg), tp_(comms.tp), store_(&store), cp_(comms.cp) {
  const std::string ctx = prefix.empty() ? "mamba2" : prefix;
  cfg_.validate(ctx);
  require(cfg.window == 0 || cp_->size() == 1, ctx, "window = ", cfg.window,
          " (model.mixer_window) needs cp = 1: with context parallelism each rank already holds a slice");
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
  s.algo = cfg_.ssd_algo;
  s.compute = cfg_.ssd_compute;
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
void Mamba2Mixer<T>::take_activations(const View2<T>& u, index_t n, Mamba2Acts<T>& a) const {
  a.u = u;
  a.internals = std::make_shared<PoolScope>();
  PoolScope& ws = *a.internals;
  a.zxbcdt = ws.take<View2<T>>("mamba2::zxbcdt", n, Din_);
  a.xbc = ws.take<View2<T>>("mamba2::xbc", n, C_);
  a.y = ws.take<View2<T>>("mamba2::y", n, E_);
  if (bf16_out_proj())
    a.yn_b = ws.take<View2<bf16_op_t>>("mamba2::yn_bf16", n, E_);
  else
    a.yn = ws.take<View2<T>>("mamba2::yn", n, E_);
  a.rstd = ws.take<View2<P>>("mamba2::rstd", n, G_);
}

template <class T>
void Mamba2Mixer<T>::run_internals(const View2<T>& u, index_t batch, index_t seqlen, const SeqIdxView& seq,
                                   Mamba2Acts<T>& a, const View4<P>& final_ssm) const {
  const index_t E = E_;
  take_activations(u, batch * seqlen, a);
  bool in_done = false;
  if constexpr (std::is_same_v<T, float>) {
    in_done = a.u_b.extent(0) > 0;
    if (in_done) linear_forward_gemm_bf16x(a.u_b, store_->v2(in_proj_), a.zxbcdt);
  }
  if (!in_done) linear_forward<T>(u, store_->v2(in_proj_), View1<const P>(), a.zxbcdt);
  conv1d_silu_forward<T>(Conv1dIn<T>{a.zxbcdt, E, batch, seqlen, C_, a.conv_init},
                         store_->v2(conv_w_), store_->v1(conv_b_), seq, a.xbc);
  ssd_forward<T>(ssd_shape(batch, seqlen), ssd_in(a, seq), a.y, final_ssm, &a.ssd, a.internals.get());
  norm_forward(a);
}

// yn (or its bf16 copy yn_b) = the gated norm of y by silu(z).
template <class T>
void Mamba2Mixer<T>::norm_forward(Mamba2Acts<T>& a) const {
  const index_t E = E_, G = G_;
  if constexpr (std::is_same_v<T, float>)
    if (a.yn_b.extent(0) > 0)
      return gated_rmsnorm_forward_bf16(GatedNormIn<T>{a.y, 0, a.zxbcdt, 0}, E, E / G, GateOrder::gate_first,
                                        store_->v1(norm_w_), cfg_.norm_eps, a.yn_b, a.rstd);
  gated_rmsnorm_forward<T>(GatedNormIn<T>{a.y, 0, a.zxbcdt, 0}, E, E / G, GateOrder::gate_first,
                           store_->v1(norm_w_), cfg_.norm_eps, a.yn, a.rstd);
}

// out = yn W_out^T from the kept gated-norm output, fp32 or its bf16 copy.
template <class T>
void Mamba2Mixer<T>::out_proj_forward(const Mamba2Acts<T>& a, const View2<T>& out) const {
  if constexpr (std::is_same_v<T, float>)
    if (a.yn_b.extent(0) > 0) return linear_forward_gemm_bf16x(a.yn_b, store_->v2(out_proj_), out);
  linear_forward<T>(a.yn, store_->v2(out_proj_), View1<const P>(), out);
}

// dyn = dout W_out, dW_out += dout^T yn, from the kept gated-norm output, fp32 or its bf16 copy.
template <class T>
void Mamba2Mixer<T>::out_proj_backward(const Mamba2Acts<T>& a, const View2<const T>& dout, const View2<T>& dyn) const {
  if constexpr (std::is_same_v<T, float>)
    if (a.yn_b.extent(0) > 0)
      return linear_backward_gemms_bf16x(dout, store_->v2(out_proj_), a.yn_b, 0.0f, dyn, 1.0f, store_->g2(out_proj_));
  linear_backward<T>(a.yn, store_->v2(out_proj_), dout, dyn, false, store_->g2(out_proj_), View1<P>());
}

template <class T>
bool Mamba2Mixer<T>::bf16_out_proj() const {
  return std::is_same_v<T, float> && float_gemm_on_bf16_copies();
}

template <class T>
bool Mamba2Mixer<T>::bf16_in_proj_grad() const {
  return bf16_out_proj() && cp_->size() == 1;
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
  if (cp_->size() > 1) {
    require(!init && !final, "Mamba2Mixer::forward", "explicit initial/final states are not supported with cp = ",
            cp_->size(), " (the state is passed between the cp ranks)");
    forward_cp(u, batch, seqlen, seq, out, acts, save);
    return;
  }
  if (!init && !final && windowed(seqlen)) {
    windows::forward(*this, cfg_.window, u, batch, seqlen, seq, out, acts);
    return;
  }
  acts = Mamba2Acts<T>{};
  if (init) {  // copies: `final` may be `init`, and the backward needs the state the forward started from
    check_state(*init, batch, "Mamba2Mixer::forward (initial state)");
    acts.states = std::make_shared<PoolScope>();
    PoolScope& ws = *acts.states;
    acts.conv_init =
        ws.take<View3<T>>("mamba2::conv_init", init->conv.extent(0), init->conv.extent(1), init->conv.extent(2));
    acts.ssm_init = ws.take<View4<P>>("mamba2::ssm_init", init->ssm.extent(0), init->ssm.extent(1), init->ssm.extent(2),
                                      init->ssm.extent(3));
    Kokkos::deep_copy(acts.conv_init, init->conv);
    Kokkos::deep_copy(acts.ssm_init, init->ssm);
  }
  if (final) check_state(*final, batch, "Mamba2Mixer::forward (final state)");
  run_internals(u, batch, seqlen, seq, acts, final ? final->ssm : View4<P>());
  out_proj_forward(acts, out);
  parallel::tp_allreduce_sum(*tp_, out, "Mamba2Mixer::forward");  // row-parallel out_proj: partial sums
  if (final)
    conv1d_state_out<T>(Conv1dIn<T>{acts.zxbcdt, E_, batch, seqlen, C_, acts.conv_init},
                        cfg_.d_conv, seq, final->conv);
  if (!save) {
    Mamba2Acts<T> kept;
    kept.u = u;
    kept.conv_init = acts.conv_init;
    kept.ssm_init = acts.ssm_init;
    kept.states = acts.states;
    acts = kept;
  }
}

template <class T>
bool Mamba2Mixer<T>::takes_bf16_input(index_t seqlen) const {
  return bf16_out_proj() && cp_->size() == 1 && !windowed(seqlen);
}

template <class T>
void Mamba2Mixer<T>::forward_bf16_input(const View2<bf16_op_t>& ub, index_t batch, index_t seqlen,
                                        const SeqIdxView& seq, const View2<T>& out, Mamba2Acts<T>& acts,
                                        bool save) const {
  constexpr const char* ctx = "Mamba2Mixer::forward_bf16_input";
  require(std::is_same_v<T, float>, ctx, "the input's bf16 copy is taken by float mixers only");
  require(cp_->size() == 1 && !windowed(seqlen), ctx,
          "needs cp = 1 and no windows at this length (cp = ", cp_->size(), ", window ", cfg_.window, ", seqlen ",
          seqlen, ")");
  require(index_t(ub.extent(0)) == batch * seqlen && index_t(ub.extent(1)) == cfg_.d_model, ctx,
          "the input must be (batch * seqlen, d_model) = (", batch * seqlen, ", ", cfg_.d_model, "), it is (",
          ub.extent(0), ", ", ub.extent(1), ")");
  acts = Mamba2Acts<T>{};
  acts.u_b = ub;
  run_internals(View2<T>(), batch, seqlen, seq, acts, View4<P>());
  out_proj_forward(acts, out);
  parallel::tp_allreduce_sum(*tp_, out, "Mamba2Mixer::forward");  // row-parallel out_proj: partial sums
  if (!save) {
    Mamba2Acts<T> kept;
    kept.u_b = ub;
    acts = kept;
  }
}

template <class T>
void Mamba2Mixer<T>::backward(Mamba2Acts<T>& a, index_t batch, index_t seqlen, const SeqIdxView& seq,
                              const View2<const T>& dout, const View2<T>& du) const {
  backward(a, batch, seqlen, seq, dout, du, nullptr, nullptr);
}

template <class T>
void Mamba2Mixer<T>::backward(Mamba2Acts<T>& a, index_t batch, index_t seqlen, const SeqIdxView& seq,
                              const View2<const T>& dout, const View2<T>& du, const Mamba2State<T>* dfinal_state,
                              Mamba2State<T>* dinit_state) const {
  require(cp_->size() == 1 || (!dfinal_state && !dinit_state), "Mamba2Mixer::backward",
          "explicit state gradients are not supported with cp = ", cp_->size());
  if (!a.win_ssm.empty()) {
    require(!dfinal_state && !dinit_state, "Mamba2Mixer::backward", "a windowed forward has no explicit states");
    windows::backward(*this, cfg_.window, a, batch, seqlen, seq, dout, du);
    return;
  }
  if (dfinal_state) check_state(*dfinal_state, batch, "Mamba2Mixer::backward (final state gradient)");
  if (dinit_state) check_state(*dinit_state, batch, "Mamba2Mixer::backward (initial state gradient)");
  if (a.zxbcdt.extent(0) == 0) run_internals(a.u, batch, seqlen, seq, a, View4<P>());  // recompute policy
  const index_t n = batch * seqlen, E = E_, G = G_;
  PoolScope ws;  // the gradients of the internals: cached device blocks, returned at the end
  // out_proj
  View2<T> dyn = ws.take<View2<T>>("mamba2::dyn", n, E);
  out_proj_backward(a, dout, dyn);
  // d(zxbcdt), in_proj's output gradient: fp32, or under bf16 GEMMs only the bf16 copy in_proj's backward takes,
  // written by its producers (the gated norm's dz, the conv's d(xBC), the scan's d(dt) rounded from a narrow fp32
  // block) with one rank along the sequence (cp > 1 adds the left neighbour's halo gradient after the conv); an
  // explicit final state's conv gradient (a window's) is added into the copy's last d_conv - 1 rows below
  const bool gb = bf16_in_proj_grad();
  View2<T> dzxbcdt = gb ? View2<T>() : ws.take<View2<T>>("mamba2::dzxbcdt", n, Din_);
  View2<bf16_op_t> dzb = gb ? ws.take<View2<bf16_op_t>>("mamba2::dzxbcdt_bf16", n, Din_) : View2<bf16_op_t>();
  View2<T> ddt = gb ? ws.take<View2<T>>("mamba2::ddt", n, H_) : View2<T>();
  // gated norm: dy, and dz straight into the z columns of d(zxbcdt)
  View2<T> dy = ws.take<View2<T>>("mamba2::dy", n, E);
  bool norm_done = false;
  if constexpr (std::is_same_v<T, float>) {
    norm_done = gb;
    if (norm_done)
      gated_rmsnorm_backward_bf16dz(GatedNormIn<T>{a.y, 0, a.zxbcdt, 0}, E, E / G, GateOrder::gate_first,
                                    store_->v1(norm_w_), a.rstd, dyn, dy, 0, dzb, 0, store_->g1(norm_w_));
  }
  if (!norm_done)
    gated_rmsnorm_backward<T>(GatedNormIn<T>{a.y, 0, a.zxbcdt, 0}, E, E / G, GateOrder::gate_first,
                              store_->v1(norm_w_), a.rstd, dyn, dy, 0, dzxbcdt, 0, store_->g1(norm_w_));
  // scan: d(xBC) and d(dt) (written into the dt columns of d(zxbcdt), or into ddt)
  View2<T> dxbc = ws.take<View2<T>>("mamba2::dxbc", n, C_);
  SSDGrad<T> g;
  g.dxbc = dxbc;
  g.ddt = gb ? ddt : dzxbcdt;
  if (gb) g.ddt_col = 0;
  g.dA_log = store_->g1(A_log_);
  g.ddt_bias = store_->g1(dt_bias_);
  g.dD = store_->g1(D_);
  View4<P> dfinal = dfinal_state ? dfinal_state->ssm : View4<P>();
  if (dinit_state) g.dinit_state = dinit_state->ssm;
  if (cp_->size() > 1) {
    // the incoming state's gradient from this slice, G = sum_t exp(l_t) dy_t C_t^T (first record, zero when the
    // slice starts a record), then the fold from the right gives the gradient of this slice's final state
    const index_t H = H_, Pd = cfg_.headdim, N = cfg_.d_state, HG = H / G, ccol = E + G * N;
    require(index_t(a.cp_cont.size()) == batch, "Mamba2Mixer::backward", "cp = ", cp_->size(),
            " needs the forward of the same mixer with cp (no context-parallel state kept for batch = ", batch, ")");
    // (the decay weights and the scaled dy, a token-sized block each, go back before the scan's backward)
    dfinal = ws.take<View4<P>>("mamba2::cp_dfinal", batch, H, Pd, N);
    PoolScope cpws;
    index_t Lnz = 0;
    View2<P> lexp = m2_cp_decay_weights<T>(a.zxbcdt, 2 * E + 2 * G * N, store_->v1(A_log_), store_->v1(dt_bias_),
                                           cfg_.dt_limit_lo, cfg_.dt_limit_hi, seq, batch, seqlen, H, &cpws, Lnz);
    const View1<P> cont = cp_cont_view<P>(a.cp_cont, cpws);
    View4<P> Gs = m2_cp_state_grad<T>(lexp, cont, dy, a.xbc, ccol, batch, seqlen, Lnz, H, Pd, N, HG,
                                      ssd_shape(batch, seqlen).compute, cpws);
    View1<P> gdec = m2_cp_total_decay<P>(lexp, cont, batch, seqlen, H, cpws);
    View1<P> dS =
        parallel::cp_state_scan_backward<P>(*cp_, gdec, View1<const P>(Gs.data(), Gs.size()), Pd * N, &cpws);
    Kokkos::deep_copy(View1<P>(dfinal.data(), dfinal.size()), dS);
  }
  ssd_backward<T>(ssd_shape(batch, seqlen), ssd_in(a, seq), dy, dfinal, g, &a.ssd);
  // conv: d([x | B | C]) into its columns of d(zxbcdt)
  bool conv_done = false;
  if constexpr (std::is_same_v<T, float>) {
    conv_done = gb;
    if (conv_done) {
      const index_t dtc = 2 * E + 2 * G * cfg_.d_state;  // d(dt)'s columns
      round_to_bf16("mamba2::ddt_bf16", ddt, dzb, dtc);
      conv1d_silu_backward_bf16dx(Conv1dIn<T>{a.zxbcdt, E, batch, seqlen, C_, a.conv_init}, store_->v2(conv_w_),
                                  store_->v1(conv_b_), seq, dxbc, dzb, E, store_->g2(conv_w_), store_->g1(conv_b_));
    }
  }
  if (!conv_done)
    conv1d_silu_backward<T>(Conv1dIn<T>{a.zxbcdt, E, batch, seqlen, C_, a.conv_init}, store_->v2(conv_w_),
                            store_->v1(conv_b_), seq, dxbc, dzxbcdt, E, store_->g2(conv_w_), store_->g1(conv_b_));
  if (dinit_state)  // the conv prefix fed the outputs of token 0's record
    windows::conv_init_backward<T>(Conv1dIn<T>{a.zxbcdt, E, batch, seqlen, C_, a.conv_init}, store_->v2(conv_w_),
                                   store_->v1(conv_b_), seq, dxbc, dinit_state->conv);
  if (dfinal_state) {  // the final conv state: the last d_conv - 1 conv inputs ([x | B | C] columns of zxbcdt)
    if (gb)
      windows::conv_state_out_backward<T>(dfinal_state->conv, a.conv_init, seq, seqlen, dzb, E,
                                          dinit_state ? dinit_state->conv : View3<T>());
    else
      windows::conv_state_out_backward<T>(dfinal_state->conv, a.conv_init, seq, seqlen, dzxbcdt, E,
                                          dinit_state ? dinit_state->conv : View3<T>());
  }
  if (cp_->size() > 1) {  // the halo's gradient goes back to the left neighbour, which adds it to its rows
    View3<T> dprefix = ws.take<View3<T>>("mamba2::cp_dprefix", batch, C_, cfg_.d_conv - 1);
    parallel::conv1d_silu_prefix_grad<T>(Conv1dIn<T>{a.zxbcdt, E, batch, seqlen, C_, a.conv_init},
                                         store_->v2(conv_w_), store_->v1(conv_b_), seq, dxbc, a.cp_mask, dprefix);
    parallel::cp_conv_halo_backward<T>(*cp_, dprefix, dzxbcdt, E, batch, seqlen);
  }
  // in_proj
  bool in_done = false;
  if constexpr (std::is_same_v<T, float>) {
    const bool ub = a.u_b.extent(0) > 0;
    in_done = gb || ub;
    if (gb && ub)
      linear_backward_gemms_bf16(dzb, store_->v2(in_proj_), a.u_b, 0.0f, du, 1.0f, store_->g2(in_proj_));
    else if (gb)
      linear_backward_gemms_bf16dy(dzb, store_->v2(in_proj_), a.u, 0.0f, du, 1.0f, store_->g2(in_proj_));
    else if (ub)
      linear_backward_gemms_bf16x(dzxbcdt, store_->v2(in_proj_), a.u_b, 0.0f, du, 1.0f, store_->g2(in_proj_));
  }
  if (!in_done) linear_backward<T>(a.u, store_->v2(in_proj_), dzxbcdt, du, false, store_->g2(in_proj_), View1<P>());
  parallel::tp_allreduce_sum(*tp_, du, "Mamba2Mixer::backward");  // column-parallel in_proj: partial sums
}

template <class T>
void Mamba2Mixer<T>::forward_cp(const View2<T>& u, index_t batch, index_t seqlen, const SeqIdxView& seq,
                                const View2<T>& out, Mamba2Acts<T>& a, bool save) const {
  // local widths (this rank's heads and groups under tp)
  const index_t n = batch * seqlen, E = E_, G = G_, H = H_, Pd = cfg_.headdim, N = cfg_.d_state, C = C_,
                HG = H / G, L = seqlen, ccol = E + G * N;
  a = Mamba2Acts<T>{};
  // the activations from the workspace cache (dropped below when not saved): no cudaMalloc/cudaFree of gigabytes
  // per layer and step; the incoming states (kept for the recompute) stay allocations of their own
  take_activations(u, n, a);
  linear_forward<T>(u, store_->v2(in_proj_), View1<const P>(), a.zxbcdt);
  // conv with the left neighbour's halo as its prefix
  auto halo = parallel::cp_conv_halo_forward<T>(*cp_, a.zxbcdt, E, C, batch, seqlen, cfg_.d_conv, seq);
  a.conv_init = halo.prefix;
  a.cp_mask = halo.mask;
  a.cp_cont = halo.cont;
  conv1d_silu_forward<T>(Conv1dIn<T>{a.zxbcdt, E, batch, seqlen, C, a.conv_init}, store_->v2(conv_w_),
                         store_->v1(conv_b_), seq, a.xbc);
  // local scan from a zero state, then the exclusive scan of (total decay, final state) across the ranks and the
  // correction (its buffers, a token-sized block or two, go back before the norm)
  {
    PoolScope cpws;
    View4<P> S_loc = cpws.take<View4<P>>("mamba2::cp_S_loc", batch, H, Pd, N);
    ssd_forward<T>(ssd_shape(batch, seqlen), ssd_in(a, seq), a.y, S_loc);
    index_t Lnz = 0;
    View2<P> lexp = m2_cp_decay_weights<T>(a.zxbcdt, 2 * E + 2 * G * N, store_->v1(A_log_), store_->v1(dt_bias_),
                                           cfg_.dt_limit_lo, cfg_.dt_limit_hi, seq, batch, L, H, &cpws, Lnz);
    const View1<P> cont = cp_cont_view<P>(a.cp_cont, cpws);
    View1<P> gdec = m2_cp_total_decay<P>(lexp, cont, batch, L, H, cpws);
    View1<P> S_in =
        parallel::cp_state_scan_forward<P>(*cp_, gdec, View1<const P>(S_loc.data(), S_loc.size()), Pd * N, &cpws);
    a.ssm_init = View4<P>(Kokkos::view_alloc(Kokkos::WithoutInitializing, "mamba2::ssm_init"), batch, H, Pd, N);
    m2_cp_apply_state_in<T>(S_in, cont, a.ssm_init, lexp, a.xbc, ccol, a.y, batch, L, Lnz, H, Pd, N, HG,
                            ssd_shape(batch, seqlen).compute, cpws);
  }
  norm_forward(a);
  out_proj_forward(a, out);
  parallel::tp_allreduce_sum(*tp_, out, "Mamba2Mixer::forward");  // row-parallel out_proj: partial sums
  if (!save) {  // the recompute then runs the local code from the kept halo and incoming state
    Mamba2Acts<T> kept;
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
std::uint64_t Mamba2Mixer<T>::cp_traffic_bytes(index_t batch, bool with_seq_idx) const {
  if (cp_->size() == 1) return 0;
  const std::uint64_t B = std::uint64_t(batch), H = std::uint64_t(H_);
  return 2 * B * H * (1 + std::uint64_t(cfg_.headdim * cfg_.d_state)) * sizeof(P) +
         parallel::cp_conv_halo_bytes(*cp_, batch, cfg_.d_conv, C_, sizeof(T), with_seq_idx);
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
Mamba2State<T> Mamba2Mixer<T>::make_state(index_t batch, PoolScope& ws) const {
  require(batch > 0, "Mamba2Mixer::make_state", "batch must be positive (got ", batch, ")");
  Mamba2State<T> s;
  s.conv = ws.take<View3<T>>("mamba2::conv_state", batch, C_, cfg_.d_conv - 1);
  s.ssm = ws.take<View4<P>>("mamba2::ssm_state", batch, H_, cfg_.headdim, cfg_.d_state);
  Kokkos::deep_copy(s.conv, T(0));
  Kokkos::deep_copy(s.ssm, P(0));
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
