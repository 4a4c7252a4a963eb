#include "moe/router.hpp"

#include <cmath>

#include "core/error.hpp"
#include "tensor/ops.hpp"

namespace mm {

ScoreFunc parse_score_func(const std::string& name, const std::string& context) {
  if (name == "softmax") return ScoreFunc::softmax;
  if (name == "sigmoid") return ScoreFunc::sigmoid;
  throw Error(context, "unknown router score function '" + name + "' (known: softmax, sigmoid)");
}

const char* score_func_name(ScoreFunc f) { return f == ScoreFunc::softmax ? "softmax" : "sigmoid"; }

index_t expert_capacity(const RouterOptions& opt, index_t n) {
  if (opt.capacity_factor <= 0) return -1;
  return static_cast<index_t>(std::ceil(opt.capacity_factor * double(n) * double(opt.top_k) / double(opt.n_experts)));
}

template <class P>
void router_select(const RouterOptions& opt, const View1<const P>& bias, Routing<P>& r, PoolScope* ws) {
  const index_t n = r.logits.extent(0), E = opt.n_experts, k = opt.top_k;
  require(index_t(r.logits.extent(1)) == E, "moe::router", "logits have ", r.logits.extent(1),
          " columns, expected n_experts = ", E);
  require(bias.extent(0) == 0 || index_t(bias.extent(0)) == E, "moe::router", "expert bias has ", bias.extent(0),
          " entries, expected n_experts = ", E);
  r.n = n;
  r.probs = take_or_alloc<View2<P>>(ws, "moe::probs", n, E);
  r.lse = take_or_alloc<View1<P>>(ws, "moe::lse", n);
  r.psum = take_or_alloc<View1<P>>(ws, "moe::psum", n);
  r.expert = take_or_alloc<View2<std::int32_t>>(ws, "moe::expert", n, k);
  r.gate = take_or_alloc<View2<P>>(ws, "moe::gate", n, k);
  auto logits = r.logits;
  auto probs = r.probs;
  auto lse = r.lse;
  auto psum = r.psum;
  auto expert = r.expert;
  auto gate = r.gate;
  const P inv_tau = P(1.0 / opt.temperature), scale = P(opt.output_scale);
  const bool softmax = opt.score == ScoreFunc::softmax, renorm = opt.renormalize, has_bias = bias.extent(0) > 0;
  par_for("moe::router_select", n, KOKKOS_LAMBDA(index_t x) {
    P mx = -Kokkos::Experimental::infinity<P>::value;
    for (index_t i = 0; i < E; ++i) {
      const P l = logits(x, i) * inv_tau;
      logits(x, i) = l;
      mx = l > mx ? l : mx;
    }
    P se = 0;
    for (index_t i = 0; i < E; ++i) se += Kokkos::exp(logits(x, i) - mx);
    lse(x) = mx + Kokkos::log(se);
    P ps = 0;
    for (index_t i = 0; i < E; ++i) {
      const P p = softmax ? Kokkos::exp(logits(x, i) - mx) / se : sigmoid(logits(x, i));
      probs(x, i) = p;
      ps += p;
    }
    psum(x) = ps;
    // top-k of p + bias; strict '>' in increasing index order gives ties to the lower expert index
    P chosen_sum = 0;
    for (index_t j = 0; j < k; ++j) {
      index_t best = -1;
      P best_v = 0;
      for (index_t i = 0; i < E; ++i) {
        bool taken = false;
        for (index_t m = 0; m < j; ++m) taken = taken || expert(x, m) == i;
        if (taken) continue;
        const P v = probs(x, i) + (has_bias ? bias(i) : P(0));
        if (best < 0 || v > best_v) {
          best = i;
          best_v = v;
        }
      }
      expert(x, j) = static_cast<std::int32_t>(best);
      chosen_sum += probs(x, best);
    }
    for (index_t j = 0; j < k; ++j) {
      const P p = probs(x, expert(x, j));
      gate(x, j) = scale * (renorm ? p / chosen_sum : p);
    }
  });
}

namespace {
constexpr index_t kPlanBlock = 256;  // tokens per counting block of the dispatch plan
}

template <class P>
void router_plan(const RouterOptions& opt, Routing<P>& r, const std::vector<index_t>& keep, PoolScope* ws) {
  const index_t n = r.n, E = opt.n_experts, k = opt.top_k;
  const index_t nb = (n + kPlanBlock - 1) / kPlanBlock, items = k * nb;
  // Work item it = j * nb + b covers slot j of the tokens of block b: items in increasing order enumerate the
  // assignments in the slot-major order of the header. No atomics: each item owns its row of `pos`.
  PoolScope local;  // the plan's scratch: cached blocks, not allocations per step
  const View2<index_t> pos = local.take<View2<index_t>>("moe::plan_pos", items > 0 ? items : 1, E);
  Kokkos::deep_copy(Exec(), pos, index_t(0));
  r.row = take_or_alloc<View2<index_t>>(ws, "moe::row", n, k);
  r.count = take_or_alloc<View1<index_t>>(ws, "moe::count", E);
  auto expert = r.expert;
  auto row = r.row;
  auto count = r.count;
  par_for("moe::plan_count", items, KOKKOS_LAMBDA(index_t it) {
    const index_t j = it / nb, b = it % nb;
    const index_t x1 = (b + 1) * kPlanBlock < n ? (b + 1) * kPlanBlock : n;
    for (index_t x = b * kPlanBlock; x < x1; ++x) pos(it, expert(x, j)) += 1;
  });
  par_for("moe::plan_scan", E, KOKKOS_LAMBDA(index_t e) {
    index_t run = 0;
    for (index_t it = 0; it < items; ++it) {
      const index_t c = pos(it, e);
      pos(it, e) = run;
      run += c;
    }
    count(e) = run;
  });
  par_for("moe::plan_position", items, KOKKOS_LAMBDA(index_t it) {
    const index_t j = it / nb, b = it % nb;
    const index_t x1 = (b + 1) * kPlanBlock < n ? (b + 1) * kPlanBlock : n;
    for (index_t x = b * kPlanBlock; x < x1; ++x) {
      const index_t e = expert(x, j);
      row(x, j) = pos(it, e);
      pos(it, e) += 1;
    }
  });
  // kept per expert and group offsets (host: the grouped GEMM needs them there anyway)
  // (into a host vector: a mirror of the cached block would be a fresh, unlabelled host allocation every step)
  std::vector<index_t> hcount_v(std::size_t(E > 0 ? E : 1));
  const HostUView1<index_t> hcount(hcount_v.data(), E);
  Kokkos::deep_copy(hcount, count);
  r.capacity = expert_capacity(opt, n);
  r.routed.assign(E, 0);
  r.offsets.assign(E + 1, 0);
  if (!keep.empty())
    require(index_t(keep.size()) == E, "moe::router_plan", "keep has ", keep.size(), " entries, expected n_experts = ",
            E);
  for (index_t e = 0; e < E; ++e) {
    r.routed[e] = hcount(e);
    index_t kept = r.capacity < 0 ? hcount(e) : (hcount(e) < r.capacity ? hcount(e) : r.capacity);
    if (!keep.empty()) {
      require(keep[e] >= 0 && keep[e] <= hcount(e), "moe::router_plan", "keep[", e, "] = ", keep[e],
              " is outside [0, ", hcount(e), "] (the router's choices of the expert)");
      kept = keep[e];
    }
    r.offsets[e + 1] = r.offsets[e] + kept;
  }
  const index_t m = r.offsets[E];
  const View1<index_t> off = local.take<View1<index_t>>("moe::offsets", E + 1);
  Kokkos::deep_copy(off, HostUView1<const index_t>(r.offsets.data(), std::size_t(E + 1)));
  r.perm_token = take_or_alloc<View1<index_t>>(ws, "moe::perm_token", m);
  r.perm_slot = take_or_alloc<View1<std::int32_t>>(ws, "moe::perm_slot", m);
  auto perm_token = r.perm_token;
  auto perm_slot = r.perm_slot;
  par_for("moe::plan_rows", n, KOKKOS_LAMBDA(index_t x) {
    for (index_t j = 0; j < k; ++j) {
      const index_t e = expert(x, j), p = row(x, j);
      if (p < off(e + 1) - off(e)) {
        const index_t rr = off(e) + p;
        row(x, j) = rr;
        perm_token(rr) = x;
        perm_slot(rr) = static_cast<std::int32_t>(j);
      } else {
        row(x, j) = -1;
      }
    }
  });
}

template <class P>
std::vector<index_t> router_slot_counts(const RouterOptions& opt, const Routing<P>& r, index_t batch) {
  const index_t n = r.n, E = opt.n_experts, k = opt.top_k;
  require(batch > 0 && n % batch == 0, "moe::router_slot_counts", "rows = ", n, " do not divide into batch = ",
          batch, " sequences");
  const index_t L = n / batch, items = k * batch;
  View2<index_t> cnt("moe::slot_counts", items > 0 ? items : 1, E);
  auto expert = r.expert;
  // item it = j * batch + b owns row it of cnt: no atomics
  par_for("moe::slot_counts", items, KOKKOS_LAMBDA(index_t it) {
    const index_t j = it / batch, b = it % batch;
    for (index_t t = 0; t < L; ++t) cnt(it, expert(b * L + t, j)) += 1;
  });
  auto h = Kokkos::create_mirror_view_and_copy(HostMem(), cnt);
  std::vector<index_t> out(std::size_t(items * E));
  for (index_t it = 0; it < items; ++it)
    for (index_t e = 0; e < E; ++e) out[std::size_t(it * E + e)] = h(it, e);
  return out;
}

template <class P>
RouterLossSums router_loss_sums(const RouterOptions& opt, const Routing<P>& r) {
  RouterLossSums S;
  const index_t n = r.n, E = opt.n_experts;
  const bool aux = opt.aux_loss_coef != 0, z = opt.z_loss_coef != 0;
  if (aux) S.colsum.assign(E, 0.0);
  if (n > 0 && (aux || z)) {
    // one reduction (and one copy to the host) for both: columns [0, E) the scores' column sums (aux), column E
    // (or 0 without aux) the squared logsumexp (z)
    const index_t m = (aux ? E : 0) + (z ? 1 : 0), ze = aux ? E : 0;
    PoolScope local;
    const View1<P> sums = local.take<View1<P>>("moe::router_loss_sums", m);
    auto probs = r.probs;
    auto psum = r.psum;
    auto lse = r.lse;
    const bool softmax = opt.score == ScoreFunc::softmax;
    column_reduce<P>("moe::router_loss_sums", n, m, KOKKOS_LAMBDA(index_t x, index_t i) {
      if (i == ze) return lse(x) * lse(x);
      return softmax ? probs(x, i) : probs(x, i) / psum(x);
    }, sums, false);
    std::vector<P> hs(static_cast<std::size_t>(m));
    Kokkos::deep_copy(HostUView1<P>(hs.data(), hs.size()), sums);
    if (aux)
      for (index_t i = 0; i < E; ++i) S.colsum[i] = double(hs[i]);
    if (z) S.zsum = hs[ze];
  }
  return S;
}

RouterLosses router_losses_from(const RouterOptions& opt, const RouterLossSums& S, const std::vector<index_t>& routed,
                                index_t n) {
  RouterLosses L;
  const index_t E = opt.n_experts;
  if (n == 0) return L;
  if (opt.aux_loss_coef != 0) {
    double s = 0;
    for (index_t i = 0; i < E; ++i) s += double(routed[i]) * S.colsum[i];
    L.aux = opt.aux_loss_coef * double(E) / (double(opt.top_k) * double(n) * double(n)) * s;
  }
  if (opt.z_loss_coef != 0) L.z = opt.z_loss_coef * S.zsum / double(n);
  return L;
}

template <class P>
RouterLosses router_losses(const RouterOptions& opt, const Routing<P>& r) {
  if (r.n == 0) return RouterLosses{};
  return router_losses_from(opt, router_loss_sums<P>(opt, r), r.routed, r.n);
}

template <class P>
void router_backward(const RouterOptions& opt, const Routing<P>& r, const View2<const P>& dgate, double aux_scale,
                     const View2<P>& dl) {
  const index_t n = r.n, E = opt.n_experts, k = opt.top_k;
  require(index_t(dl.extent(0)) == n && index_t(dl.extent(1)) == E, "moe::router_backward",
          "dlogits must be (", n, ", ", E, "), got (", dl.extent(0), ", ", dl.extent(1), ")");
  auto probs = r.probs;
  auto logits = r.logits;
  auto lse = r.lse;
  auto psum = r.psum;
  auto expert = r.expert;
  auto count = r.count;
  const bool softmax = opt.score == ScoreFunc::softmax, renorm = opt.renormalize;
  const P scale = P(opt.output_scale), inv_tau = P(1.0 / opt.temperature);
  const index_t N = r.loss_tokens();  // n unless context parallelism set the whole sequences' count
  const P c_aux = N > 0 ? P(aux_scale * opt.aux_loss_coef * double(E) / (double(k) * double(N) * double(N))) : P(0);
  const P c_z = N > 0 ? P(aux_scale * opt.z_loss_coef * 2.0 / double(N)) : P(0);
  par_for("moe::router_backward", n, KOKKOS_LAMBDA(index_t x) {
    // dp (into dl's row): load-balancing loss first
    if (c_aux != P(0)) {
      if (softmax) {
        for (index_t i = 0; i < E; ++i) dl(x, i) = c_aux * P(count(i));
      } else {  // q = p / S: dp_i = (dq_i - sum_j dq_j q_j) / S
        const P S = psum(x);
        P dot = 0;
        for (index_t i = 0; i < E; ++i) dot += c_aux * P(count(i)) * probs(x, i) / S;
        for (index_t i = 0; i < E; ++i) dl(x, i) = (c_aux * P(count(i)) - dot) / S;
      }
    } else {
      for (index_t i = 0; i < E; ++i) dl(x, i) = P(0);
    }
    // through the gates
    if (renorm) {  // g_j = s p_j / Sc: dp_m += s (dg_m - sum_j dg_j p_j / Sc) / Sc
      P Sc = 0, dot = 0;
      for (index_t j = 0; j < k; ++j) Sc += probs(x, expert(x, j));
      for (index_t j = 0; j < k; ++j) dot += dgate(x, j) * probs(x, expert(x, j));
      for (index_t j = 0; j < k; ++j) dl(x, expert(x, j)) += scale * (dgate(x, j) - dot / Sc) / Sc;
    } else {
      for (index_t j = 0; j < k; ++j) dl(x, expert(x, j)) += scale * dgate(x, j);
    }
    // scores -> tempered logits
    if (softmax) {
      P dot = 0;
      for (index_t i = 0; i < E; ++i) dot += probs(x, i) * dl(x, i);
      for (index_t i = 0; i < E; ++i) dl(x, i) = probs(x, i) * (dl(x, i) - dot);
    } else {
      for (index_t i = 0; i < E; ++i) dl(x, i) *= probs(x, i) * (P(1) - probs(x, i));
    }
    // z-loss: d/dl_i (lse^2) = 2 lse softmax(l)_i
    if (c_z != P(0)) {
      const P z = lse(x);
      for (index_t i = 0; i < E; ++i) dl(x, i) += c_z * z * Kokkos::exp(logits(x, i) - z);
    }
    // tempered logits -> raw router output
    for (index_t i = 0; i < E; ++i) dl(x, i) *= inv_tau;
  });
}

template <class P>
void update_expert_bias(const View1<P>& bias, const std::vector<double>& load, double rate) {
  const index_t E = bias.extent(0);
  require(index_t(load.size()) == E, "moe::update_expert_bias", "load has ", load.size(),
          " entries, expected n_experts = ", E);
  if (E == 0) return;
  double mean = 0;
  for (double v : load) mean += v;
  mean /= double(E);
  auto h = Kokkos::create_mirror_view_and_copy(HostMem(), bias);
  for (index_t i = 0; i < E; ++i) {
    const double d = mean - load[i];
    const double sgn = d > 0 ? 1.0 : (d < 0 ? -1.0 : 0.0);
    h(i) = P(double(h(i)) + rate * sgn);
  }
  Kokkos::deep_copy(bias, h);
}

#define MM_INSTANTIATE(P)                                                                                   \
  template void router_select<P>(const RouterOptions&, const View1<const P>&, Routing<P>&, PoolScope*);    \
  template void router_plan<P>(const RouterOptions&, Routing<P>&, const std::vector<index_t>&, PoolScope*); \
  template std::vector<index_t> router_slot_counts<P>(const RouterOptions&, const Routing<P>&, index_t);    \
  template RouterLossSums router_loss_sums<P>(const RouterOptions&, const Routing<P>&);                    \
  template RouterLosses router_losses<P>(const RouterOptions&, const Routing<P>&);                         \
  template void router_backward<P>(const RouterOptions&, const Routing<P>&, const View2<const P>&, double, \
                                   const View2<P>&);                                                       \
  template void update_expert_bias<P>(const View1<P>&, const std::vector<double>&, double);
MM_INSTANTIATE(float)
MM_INSTANTIATE(double)
#undef MM_INSTANTIATE

}  // namespace mm
