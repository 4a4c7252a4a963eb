#include "moe/moe_layer.hpp"

#include <algorithm>
#include <chrono>
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

namespace {

// dst[idx[r]] = src[r] for every row r of src (distinct targets: no conflicts)
template <class T>
void scatter_rows(const View2<T>& src, const View1<index_t>& idx, const View2<T>& dst) {
  const index_t m = src.extent(0), d = src.extent(1);
  par_for("moe::scatter_rows", m, d, KOKKOS_LAMBDA(index_t r, index_t c) { dst(idx(r), c) = src(r, c); });
}

}  // namespace

template <class T>
MoELayer<T>::MoELayer(const MoEConfig& cfg, ParamStore<P>& store, const std::string& prefix, index_t n_layer,
                      const parallel::ModelComms& comms)
    : cfg_(cfg), comms_(comms), store_(&store), prefix_(prefix) {
  const std::string ctx = prefix.empty() ? "moe" : prefix;
  cfg_.validate(ctx);
  require(n_layer > 0, ctx, "n_layer must be positive (got ", n_layer, ")");
  require(comms_.ep != nullptr && comms_.cp != nullptr, ctx, "the ep and cp communicators must not be null");
  ep_size_ = comms_.ep->size();
  ep_rank_ = comms_.ep->rank();
  cp_size_ = comms_.cp->size();
  cp_rank_ = comms_.cp->rank();
  require(cfg.n_experts % ep_size_ == 0, ctx, "n_experts = ", cfg.n_experts, " does not divide by ep = ", ep_size_);
  const index_t E = cfg.n_experts, D = cfg.d_model, F = cfg.d_ff, Fs = cfg.shared_d_ff;
  const double r_in = 1.0 / std::sqrt(double(cfg.router_in())), w_in = 1.0 / std::sqrt(double(D));
  const double out_scale = 1.0 / std::sqrt(double(n_layer));
  router_w_ = store.add(prefix + "router.weight", {E, cfg.router_in()}, true, Init::Uniform(-r_in, r_in));
  if (cfg.bias_update_rate > 0) bias_ = store.add(prefix + "router.expert_bias", {E}, false, Init::Zeros());
  const double w_out = 1.0 / std::sqrt(double(F));
  if (ep_size_ == 1) {
    w1_ = store.add(prefix + "experts.w1", {E, F, D}, true, Init::Uniform(-w_in, w_in));
    w3_ = store.add(prefix + "experts.w3", {E, F, D}, true, Init::Uniform(-w_in, w_in));
    w2_ = store.add(prefix + "experts.w2", {E, D, F}, true, Init::Uniform(-w_out, w_out, out_scale));
  } else {  // this rank's block of experts: rows [first_expert(), + local_experts()) of the stacked tensors
    const index_t El = local_experts();
    auto shard = [&](std::vector<index_t> global) {
      return Shard{Split::ep, std::move(global), {IndexRange{first_expert(), El}}, {}};
    };
    w1_ = store.add(prefix + "experts.w1", {El, F, D}, true, Init::Uniform(-w_in, w_in), shard({E, F, D}));
    w3_ = store.add(prefix + "experts.w3", {El, F, D}, true, Init::Uniform(-w_in, w_in), shard({E, F, D}));
    w2_ = store.add(prefix + "experts.w2", {El, D, F}, true, Init::Uniform(-w_out, w_out, out_scale),
                    shard({E, D, F}));
  }
  if (Fs > 0) {
    const double s_out = 1.0 / std::sqrt(double(Fs));
    s1_ = store.add(prefix + "shared.w1", {Fs, D}, true, Init::Uniform(-w_in, w_in));
    s3_ = store.add(prefix + "shared.w3", {Fs, D}, true, Init::Uniform(-w_in, w_in));
    s2_ = store.add(prefix + "shared.w2", {D, Fs}, true, Init::Uniform(-s_out, s_out, out_scale));
  }
}

template <class T>
typename MoELayer<T>::CpRows MoELayer<T>::cp_rows(index_t n, const MoEStep& step, const std::string& ctx) const {
  require(step.batch > 0, ctx, "context parallelism (cp = ", cp_size_,
          ") needs MoEStep::batch, the number of sequences in the rows (got ", step.batch, ")");
  require(n % step.batch == 0, ctx, "rows = ", n, " do not divide into batch = ", step.batch, " sequences");
  CpRows c;
  c.Lr = n / step.batch;
  c.L = c.Lr * cp_size_;
  c.c0 = c.Lr * cp_rank_;
  return c;
}

namespace {
// Runs `f` (an all-to-all) after the device work already issued, adding its wall seconds to `acc`.
template <class F>
void timed_exchange(double& acc, F&& f) {
  Kokkos::fence("moe::exchange");
  const auto t0 = std::chrono::steady_clock::now();
  f();
  acc += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

template <class T>
View2<T> MoELayer<T>::exchange(const View2<T>& src, const std::vector<std::size_t>& send,
                               const std::vector<std::size_t>& recv, PoolScope& ws) const {
  const index_t d = cfg_.d_model;
  std::size_t total = 0;
  for (std::size_t c : recv) total += c;
  View2<T> dst = ws.take<View2<T>>("moe::ep_exchange", index_t(total), d);
  std::vector<std::size_t> sc(send), rc(recv);
  for (auto& c : sc) c *= std::size_t(d);
  for (auto& c : rc) c *= std::size_t(d);
  // NCCL takes the device rows as they are (they went through two pageable host copies each way before)
  timed_exchange(exchange_s_, [&] { comms_.ep->alltoallv_view(src, sc, dst, rc); });
  return dst;
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
bool MoELayer<T>::experts_forward(MoEActs<T>& a, const View2<T>& shared_out) const {
  const Routing<P>& r = a.routing;
  const index_t n = a.x.extent(0), m = r.rows(), d = cfg_.d_model;
  // the routed experts on rows `src` in the order `perm` (xp[i] = src[perm[i]]), groups `off`, into y
  auto run_experts = [&](const View2<T>& src, const View1<index_t>& perm, const std::vector<index_t>& off,
                         const View2<T>& y, PoolScope* ws) {
    const index_t rows = perm.extent(0);
    if constexpr (std::is_same_v<T, float>) {
      if (a.bf16_experts) {
        a.xp16 = ws->template take<View2<bf16_op_t>>("moe::xp_bf16", rows, d);
        moe_permute_bf16(src, perm, a.xp16);
        swiglu_weights_to_bf16(expert_weights(), local_experts(), a.ex16, ws);
        swiglu_experts_forward_bf16(expert_weights(), a.xp16, off, a.ex16, y, ws);
        return;
      }
    }
    a.xp = ws->template take<View2<T>>("moe::xp", rows, d);
    moe_permute<T>(src, perm, a.xp);
    swiglu_experts_forward<T>(expert_weights(), a.xp, off, a.ex, y, ws);
  };
  if (ep_size_ == 1) {
    a.expert_ws = std::make_shared<PoolScope>();
    PoolScope* ws = a.expert_ws.get();
    a.y = ws->template take<View2<T>>("moe::y", m, d);
    run_experts(a.x, r.perm_token, r.offsets, a.y, ws);
  } else {
    // expert parallelism: the permuted rows are expert-major, so the rows of owner q are one contiguous block
    const int R = ep_size_;
    const index_t El = local_experts();
    MoEExchange& X = a.ep;
    const index_t E = cfg_.n_experts, cap = r.capacity;
    // what the backward reads (xp, y, the expert intermediates, the index maps) from expert_ws, as on one rank; the
    // rest from `local`, returned at the end
    a.expert_ws = std::make_shared<PoolScope>();
    PoolScope* ws = a.expert_ws.get();
    PoolScope local;
    View2<T> xs = local.take<View2<T>>("moe::xp_local", m, d);
    moe_permute<T>(a.x, r.perm_token, xs);
    // rows sent per expert: the kept ones (dropless), or `capacity` (capacity mode: static shapes, each expert's
    // block zero-padded to the capacity, so the buffers have the same shape at every step)
    std::vector<std::int64_t> kept(static_cast<std::size_t>(E)), rk(static_cast<std::size_t>(E));
    for (index_t e = 0; e < E; ++e) kept[e] = cap >= 0 ? cap : r.offsets[e + 1] - r.offsets[e];
    X.to_pad = View1<index_t>();
    if (cap >= 0) {
      X.to_pad = ws->template take<View1<index_t>>("moe::ep_to_pad", m);
      std::vector<index_t> hp_v(static_cast<std::size_t>(m));  // host vectors, not per-step host mirrors
      const HostUView1<index_t> hp(hp_v.data(), m);
      for (index_t e = 0; e < E; ++e)
        for (index_t i = r.offsets[e]; i < r.offsets[e + 1]; ++i) hp(i) = e * cap + (i - r.offsets[e]);
      Kokkos::deep_copy(X.to_pad, hp);
      View2<T> padded = local.take<View2<T>>("moe::xp_padded", E * cap, d);
      Kokkos::deep_copy(padded, T(0));  // the padding rows go through the experts too
      scatter_rows<T>(xs, X.to_pad, padded);
      xs = padded;
    }
    // all-to-all of the counts: rk[s * El + e] = rows source s sends for local expert e
    const std::vector<std::size_t> per(static_cast<std::size_t>(R), static_cast<std::size_t>(El));
    timed_exchange(exchange_s_, [&] { comms_.ep->alltoallv(kept.data(), per, rk.data(), per, parallel::DType::i64); });
    X.send_rows.assign(R, 0);
    X.recv_rows.assign(R, 0);
    for (int q = 0; q < R; ++q)
      for (index_t e = 0; e < El; ++e) {
        X.send_rows[q] += std::size_t(kept[q * El + e]);
        X.recv_rows[q] += std::size_t(rk[q * El + e]);
      }
    View2<T> xr = exchange(xs, X.send_rows, X.recv_rows, local);
    // expert-major order of the received rows: local expert, then source rank, then the source's order
    const index_t mr = xr.extent(0);
    std::vector<index_t> src_base(std::size_t(R) + 1, 0);
    for (int q = 0; q < R; ++q) src_base[q + 1] = src_base[q] + index_t(X.recv_rows[q]);
    X.to_expert = ws->template take<View1<index_t>>("moe::ep_to_expert", mr);
    X.to_recv = ws->template take<View1<index_t>>("moe::ep_to_recv", mr);
    std::vector<index_t> hte_v(static_cast<std::size_t>(mr)), htr_v(static_cast<std::size_t>(mr));
    const HostUView1<index_t> hte(hte_v.data(), mr), htr(htr_v.data(), mr);
    X.offsets.assign(std::size_t(El) + 1, 0);
    index_t pos = 0;
    for (index_t e = 0; e < El; ++e) {
      X.offsets[e] = pos;
      for (int q = 0; q < R; ++q) {
        index_t start = src_base[q];
        for (index_t e2 = 0; e2 < e; ++e2) start += rk[q * El + e2];
        for (index_t i = 0; i < rk[q * El + e]; ++i, ++pos) {
          hte(pos) = start + i;
          htr(start + i) = pos;
        }
      }
    }
    X.offsets[El] = pos;
    Kokkos::deep_copy(X.to_expert, hte);
    Kokkos::deep_copy(X.to_recv, htr);
    View2<T> ye = local.take<View2<T>>("moe::y_experts", mr, d);
    run_experts(xr, X.to_expert, X.offsets, ye, ws);
    View2<T> yr = local.take<View2<T>>("moe::y_recv", mr, d);
    moe_permute<T>(ye, X.to_recv, yr);
    a.y = exchange(yr, X.recv_rows, X.send_rows, cap >= 0 ? local : *ws);
    if (cap >= 0) {  // drop the padding
      View2<T> y = ws->template take<View2<T>>("moe::y", m, d);
      moe_permute<T>(a.y, X.to_pad, y);
      a.y = y;
    }
  }
  if (cfg_.shared_d_ff > 0) {
    PoolScope scratch;  // the recompute's shared-expert output, not needed again
    const View2<T> ys = shared_out.extent(0) > 0 ? shared_out : scratch.take<View2<T>>("moe::shared_y", n, d);
    swiglu_experts_forward<T>(shared_weights(), a.x, {0, n}, a.sh, ys);
  }
  a.expert_acts_kept = true;
  return cfg_.shared_d_ff > 0;
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
  acts.ws = std::make_shared<PoolScope>();
  acts.x = x;
  acts.state = cfg_.state_aware ? state : View2<T>();
  acts.step = step;
  acts.bf16_experts = std::is_same_v<T, float> && float_gemm_compute() == GemmCompute::bf16;
  const bool cpx = cp_size_ > 1;
  const CpRows cr = cpx ? cp_rows(n, step, ctx) : CpRows{};

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
    const index_t Lr = cr.Lr > 0 ? cr.Lr : 1, Lg = cr.L, c0 = cr.c0;
    par_for("moe::router_input", n, dr, KOKKOS_LAMBDA(index_t t, index_t c) {
      P v = c < d ? P(xin(t, c)) : P(sv(t, c - d));
      const index_t tg = cpx ? (t / Lr) * Lg + c0 + t % Lr : t;  // the single-rank row (cp: whole sequences)
      if (jit) v *= P(rng.uniform(std::uint64_t(tg * dr + c), lo, hi));
      xro(t, c) = static_cast<T>(v);
    });
    xr = acts.xr;
  }

  // routing
  const RouterOptions opt = cfg_.router_options();
  Routing<P>& r = acts.routing;
  r.logits = acts.ws->template take<View2<P>>("moe::logits", n, cfg_.n_experts);
  bool native_logits = false;  // the router's logits in fp32 arithmetic
  if constexpr (std::is_same_v<T, float>) native_logits = router_logits_fp32(xr, store_->v2(router_w_), r.logits);
  if (!native_logits) {
    const FloatGemmComputeScope fp32_logits(GemmCompute::fp32);
    linear_forward<T>(xr, store_->v2(router_w_), View1<const P>(), r.logits);
  }
  router_select<P>(opt, has_expert_bias() ? View1<const P>(store_->v1(bias_)) : View1<const P>(), r, acts.ws.get());
  RouterLosses L;
  std::vector<index_t> kept_all;  // cp: kept assignments per expert over all cp ranks
  if (!cpx) {
    router_plan<P>(opt, r, {}, acts.ws.get());
    L = router_losses<P>(opt, r);
  } else {
    const index_t E = cfg_.n_experts, k = cfg_.top_k, B = step.batch, N = n * cp_size_;
    const index_t cap = expert_capacity(opt, N);
    std::vector<index_t> keep;
    if (cap >= 0) {
      // position of each assignment in the single-rank slot-major order over rows b * L + t: slot, then
      // sequence, then cp rank, then the local order; keep those below the capacity
      const auto loc = router_slot_counts<P>(opt, r, B);
      const auto all = comms_.cp->allgather(std::vector<std::int64_t>(loc.begin(), loc.end()));
      const std::size_t per = std::size_t(k * B * E);
      keep.assign(E, 0);
      for (index_t e = 0; e < E; ++e) {
        index_t pos = 0;
        for (index_t j = 0; j < k; ++j)
          for (index_t b = 0; b < B; ++b)
            for (int c = 0; c < cp_size_; ++c) {
              const index_t cnt = all[c * per + std::size_t((j * B + b) * E + e)];
              if (c == cp_rank_) keep[e] += std::max<index_t>(0, std::min<index_t>(cap - pos, cnt));
              pos += cnt;
            }
      }
    }
    router_plan<P>(opt, r, keep, acts.ws.get());
    r.capacity = cap;
    // router choices, kept assignments and the loss sums of all cp ranks, summed in rank order
    std::vector<std::int64_t> cnt(std::size_t(2 * E));
    for (index_t e = 0; e < E; ++e) {
      cnt[e] = r.routed[e];
      cnt[E + e] = r.offsets[e + 1] - r.offsets[e];
    }
    const auto cnt_all = comms_.cp->allgather(cnt);
    const RouterLossSums S = router_loss_sums<P>(opt, r);
    std::vector<double> sums(S.colsum);
    sums.push_back(S.zsum);
    const auto sums_all = comms_.cp->allgather(sums);
    RouterLossSums G;
    G.colsum.assign(S.colsum.size(), 0.0);
    std::vector<index_t> routed(E, 0);
    kept_all.assign(E, 0);
    for (int c = 0; c < cp_size_; ++c) {
      for (index_t e = 0; e < E; ++e) {
        routed[e] += cnt_all[std::size_t(c) * cnt.size() + e];
        kept_all[e] += cnt_all[std::size_t(c) * cnt.size() + E + e];
      }
      for (std::size_t i = 0; i < G.colsum.size(); ++i) G.colsum[i] += sums_all[c * sums.size() + i];
      G.zsum += sums_all[c * sums.size() + G.colsum.size()];
    }
    r.routed = routed;
    r.n_all = N;
    std::vector<index_t> hc_v(static_cast<std::size_t>(E));
    const HostUView1<index_t> hc(hc_v.data(), E);
    for (index_t e = 0; e < E; ++e) hc(e) = routed[e];
    Kokkos::deep_copy(r.count, hc);
    L = router_losses_from(opt, G, r.routed, N);
  }

  // experts and combine (shared expert first, then the routed experts in slot order)
  const bool shared = experts_forward(acts, out);  // the shared expert's output straight into out
  moe_unpermute_combine<T>(acts.y, r.row, r.gate, out, shared);
  if (!save || cfg_.recompute) {
    acts.xp = View2<T>();
    acts.xp16 = View2<bf16_op_t>();
    acts.y = View2<T>();
    acts.ex = SwiGLUActs<T>{};
    acts.ex16 = SwiGLUBF16{};
    acts.sh = SwiGLUActs<T>{};
    acts.expert_ws.reset();
    acts.expert_acts_kept = false;
  }

  MoEStats& s = acts.stats;
  s.routed = r.routed;
  s.kept.assign(cfg_.n_experts, 0);
  for (index_t e = 0; e < cfg_.n_experts; ++e) s.kept[e] = cpx ? kept_all[e] : r.offsets[e + 1] - r.offsets[e];
  s.tokens = cpx ? n * cp_size_ : n;
  s.assignments = s.tokens * cfg_.top_k;
  index_t kept_total = 0;
  for (index_t v : s.kept) kept_total += v;
  s.dropped = s.assignments - kept_total;
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

  // combine -> experts -> tokens (the buffers below: cached device blocks, returned at the end)
  PoolScope ws;
  const SwiGLUGrads<T> eg{store_->g1(w1_).data(), store_->g1(w3_).data(), store_->g1(w2_).data()};
  bool b16 = false;  // the bf16 expert path (float layers only)
  if constexpr (std::is_same_v<T, float>) b16 = a.bf16_experts;
  // the experts' backward on dy rows `src` in the order `perm` (dy_e[i] = src[perm[i]]; perm empty: src itself,
  // already in expert order), groups `off`, into dxe
  auto experts_backward = [&](const View2<T>& src, const View1<index_t>& perm, const std::vector<index_t>& off,
                              const View2<T>& dxe) {
    if constexpr (std::is_same_v<T, float>) {
      if (b16) {
        View2<bf16_op_t> d16 = ws.take<View2<bf16_op_t>>("moe::dy_experts_bf16", index_t(perm.extent(0)), d);
        moe_permute_bf16(src, perm, d16);
        swiglu_experts_backward_bf16(expert_weights(), a.xp16, a.ex16, d16, off, dxe, false, eg);
        return;
      }
    }
    View2<T> dye = src;
    if (perm.data() != nullptr) {
      dye = ws.take<View2<T>>("moe::dy_experts", index_t(perm.extent(0)), d);
      moe_permute<T>(src, perm, dye);
    }
    swiglu_experts_backward<T>(expert_weights(), a.xp, a.ex, dye, off, dxe, false, eg);
  };
  View2<P> dgate = ws.take<View2<P>>("moe::dgate", n, k);
  View2<T> dxp;
  if (ep_size_ == 1 && b16) {  // dy written in bf16 by the combine's backward
    if constexpr (std::is_same_v<T, float>) {
      View2<bf16_op_t> dy16 = ws.take<View2<bf16_op_t>>("moe::dy_bf16", m, d);
      moe_combine_backward_bf16(dout, a.y, r.row, r.gate, r.perm_token, r.perm_slot, dy16, dgate);
      dxp = ws.take<View2<T>>("moe::dxp", m, d);
      swiglu_experts_backward_bf16(expert_weights(), a.xp16, a.ex16, dy16, r.offsets, dxp, false, eg);
    }
  } else if (ep_size_ == 1) {
    View2<T> dy = ws.take<View2<T>>("moe::dy", m, d);
    moe_combine_backward<T>(dout, a.y, r.row, r.gate, r.perm_token, r.perm_slot, dy, dgate);
    dxp = ws.take<View2<T>>("moe::dxp", m, d);
    experts_backward(dy, View1<index_t>(), r.offsets, dxp);
  } else {
    View2<T> dy = ws.take<View2<T>>("moe::dy", m, d);
    moe_combine_backward<T>(dout, a.y, r.row, r.gate, r.perm_token, r.perm_slot, dy, dgate);
    // mirror of the forward exchange: dy to the owners, the input gradients back to the sources
    const MoEExchange& X = a.ep;
    const index_t mr = X.to_expert.extent(0);
    const bool padded = r.capacity >= 0;  // capacity mode: the static-shape (padded) exchange
    View2<T> dys = dy;
    if (padded) {
      dys = ws.take<View2<T>>("moe::dy_padded", cfg_.n_experts * r.capacity, d);
      Kokkos::deep_copy(dys, T(0));
      scatter_rows<T>(dy, X.to_pad, dys);
    }
    View2<T> dyr = exchange(dys, X.send_rows, X.recv_rows, ws);
    View2<T> dxe = ws.take<View2<T>>("moe::dx_experts", mr, d);
    experts_backward(dyr, X.to_expert, X.offsets, dxe);
    View2<T> dxr = ws.take<View2<T>>("moe::dx_recv", mr, d);
    moe_permute<T>(dxe, X.to_recv, dxr);
    dxp = exchange(dxr, X.recv_rows, X.send_rows, ws);
    if (padded) {
      View2<T> g = ws.take<View2<T>>("moe::dxp", m, d);
      moe_permute<T>(dxp, X.to_pad, g);
      dxp = g;
    }
  }
  // dx = shared expert's + the experts' (back to token order) + the router's
  const bool shared = cfg_.shared_d_ff > 0;
  if (shared)
    swiglu_experts_backward<T>(shared_weights(), a.x, a.sh, dout, {0, n}, dx, false,
                               {store_->g1(s1_).data(), store_->g1(s3_).data(), store_->g1(s2_).data()});

  // router: gates, load-balancing loss, z-loss -> logits -> router weight and input
  View2<P> dl = ws.take<View2<P>>("moe::dlogits", n, E);
  router_backward<P>(cfg_.router_options(), r, dgate, aux_scale, dl);
  const bool plain_input = a.xr.extent(0) == 0 && a.xr.data() == nullptr;
  if constexpr (std::is_same_v<T, float>) {  // native: dx's permute and router terms in one pass, then dW
    if (plain_input && router_backward_fp32(a.x, store_->v2(router_w_), dl, dxp, r.row, dx, shared,
                                            store_->g2(router_w_)))
      return;
  }
  moe_permute_backward<T>(dxp, r.row, dx, shared);
  const FloatGemmComputeScope fp32_router(GemmCompute::fp32);  // as the forward's logits
  if (plain_input) {
    linear_backward<T>(a.x, store_->v2(router_w_), dl, dx, true, store_->g2(router_w_), View1<P>());
  } else {
    View2<T> dxr = ws.take<View2<T>>("moe::drouter_in", n, dr);
    linear_backward<T>(a.xr, store_->v2(router_w_), dl, dxr, false, store_->g2(router_w_), View1<P>());
    const bool jit = cfg_.jitter > 0 && a.step.training, sa = cfg_.state_aware;
    const CounterRNG rng{a.step.seed, jitter_stream(a.step.step)};
    const double lo = 1.0 - cfg_.jitter, hi = 1.0 + cfg_.jitter;
    const bool cpx = cp_size_ > 1;
    const CpRows cr = cpx ? cp_rows(n, a.step, ctx) : CpRows{};
    const index_t Lr = cr.Lr > 0 ? cr.Lr : 1, Lg = cr.L, c0 = cr.c0;
    auto dxo = dx;
    auto dso = dstate;
    par_for("moe::router_input_backward", n, dr, KOKKOS_LAMBDA(index_t t, index_t c) {
      P g = P(dxr(t, c));
      const index_t tg = cpx ? (t / Lr) * Lg + c0 + t % Lr : t;
      if (jit) g *= P(rng.uniform(std::uint64_t(tg * dr + c), lo, hi));
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
