// The MoE router: scores, top-k selection, the dispatch plan (capacity or dropless), the auxiliary losses and the
// backward of all of it to the router logits.
//
// Per token x (n tokens, E experts, k chosen per token, tau the temperature):
//
//   l_x      = (r_x W_r^T) / tau                    router logits in acc_t (r_x = router input, no bias)
//   p_x      = softmax(l_x)   or   sigmoid(l_x)      scores
//   chosen   = top-k of (p_x + b) over experts       b = aux-loss-free expert bias (selection only; zero if off);
//                                                    ties go to the lower expert index; slot 0 is the best
//   g_xj     = s * p_{x,e_j}                         (no renormalisation)
//   g_xj     = s * p_{x,e_j} / sum_m p_{x,e_m}       (renormalise over the k chosen)      s = output scale
//
// Load-balancing loss (Switch Transformer, normalised by k as Megatron-Core's switch_load_balancing_loss_func and
// docs/reference/distributed_moe.md 2.5):
//
//   L_aux = c_aux * E * sum_i f_i * P_i,   f_i = (1/(n k)) * #{(x, j) : e_xj = i},   P_i = (1/n) * sum_x q_xi
//         = c_aux * E / (k n^2) * sum_i count_i * sum_x q_xi
//
//   count_i counts the router's choices before any capacity drop (piecewise constant: no gradient); q = p for
//   softmax scores, q_x = p_x / sum_i p_xi for sigmoid scores (as Megatron's compute_routing_scores_for_aux_loss).
//
// Router z-loss (ST-MoE):   L_z = c_z * (1/n) * sum_x (logsumexp_i l_xi)^2,   on the tempered logits l.
//
// Dispatch plan. Assignments (x, j) are ordered slot-major: every token's slot 0 in token order, then every
// token's slot 1, and so on. Within an expert's group of the permuted buffer the rows follow this order (stable,
// deterministic), and in capacity mode (capacity = ceil(capacity_factor * n * k / E)) an expert keeps the first
// `capacity` assignments of this order: first choices have priority over second choices, earlier tokens over
// later ones. A dropped assignment contributes nothing to the layer output (the token passes through the block's
// residual for that expert); the gates of the other slots are not renormalised again. Dropless mode keeps all.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/kokkos_types.hpp"
#include "core/pool.hpp"

namespace mm {

enum class ScoreFunc { softmax, sigmoid };

// "softmax" | "sigmoid"; anything else is an mm::Error naming the value and the known names.
ScoreFunc parse_score_func(const std::string& name, const std::string& context);
const char* score_func_name(ScoreFunc f);

struct RouterOptions {
  index_t n_experts = 8;
  index_t top_k = 2;
  ScoreFunc score = ScoreFunc::softmax;
  bool renormalize = false;
  double temperature = 1.0;
  double output_scale = 1.0;
  double capacity_factor = 0.0;  // 0: dropless
  double aux_loss_coef = 0.0;
  double z_loss_coef = 0.0;
};

// Per-expert capacity of a batch of n tokens: ceil(capacity_factor * n * k / E), or -1 in dropless mode.
index_t expert_capacity(const RouterOptions& opt, index_t n);

// Everything the router decides in one forward. Device views unless marked host.
template <class P>
struct Routing {
  View2<P> logits;                  // (n, E) tempered logits l
  View2<P> probs;                   // (n, E) scores p
  View1<P> lse;                     // (n)    logsumexp_i l_xi
  View1<P> psum;                    // (n)    sum_i p_xi (1 for softmax up to rounding)
  View2<std::int32_t> expert;       // (n, k) chosen experts e_xj
  View2<P> gate;                    // (n, k) combine weights g_xj
  View2<index_t> row;               // (n, k) row of (x, j) in the permuted buffer, -1 when dropped
  View1<index_t> perm_token;        // (m)    token of each permuted row (m = kept assignments)
  View1<std::int32_t> perm_slot;    // (m)    slot of each permuted row
  View1<index_t> count;             // (E)    router choices per expert, before capacity (aux loss)
  std::vector<index_t> offsets;     // host (E + 1): expert i owns permuted rows [offsets[i], offsets[i+1])
  std::vector<index_t> routed;      // host (E): router choices per expert, before capacity
  index_t capacity = -1;            // -1: dropless
  index_t n = 0;
  // Tokens the auxiliary losses normalise over: 0 means n. Under context parallelism the layer sets the token
  // count of the whole sequences (all cp ranks), and count / routed then hold the all-reduced choices.
  index_t n_all = 0;
  index_t loss_tokens() const { return n_all > 0 ? n_all : n; }
  index_t rows() const { return offsets.empty() ? 0 : offsets.back(); }
};

struct RouterLosses {
  double aux = 0;  // c_aux * L_aux-formula above
  double z = 0;    // c_z * ...
};

// On entry r.logits holds the raw router output r_x W_r^T (n, E). Divides it by the temperature in place and
// fills probs, lse, expert and gate. `bias` (E) is the expert bias for selection; pass an empty view for none.
template <class P>
void router_select(const RouterOptions& opt, const View1<const P>& bias, Routing<P>& r, PoolScope* ws = nullptr);

// After router_select: the dispatch plan (row, perm_token, perm_slot, count, offsets, routed, capacity).
// `keep` (E, optional): keep the first keep[e] assignments of expert e in the slot-major order instead of the
// capacity of this batch (context parallelism: the caller derives it from the capacity over all cp ranks; it must
// not exceed the router's choices of the expert). r.capacity is then left for the caller to set.
template <class P>
void router_plan(const RouterOptions& opt, Routing<P>& r, const std::vector<index_t>& keep = {},
                 PoolScope* ws = nullptr);

// Router choices per (slot j, sequence b, expert e) when the n tokens are `batch` sequences of n / batch
// consecutive rows: host (k, batch, E) row-major, from a deterministic count (no atomics).
template <class P>
std::vector<index_t> router_slot_counts(const RouterOptions& opt, const Routing<P>& r, index_t batch);

// The sums the auxiliary losses need: colsum[i] = sum_x q_xi (when aux_loss_coef != 0) and zsum = sum_x lse_x^2
// (when z_loss_coef != 0), deterministic ordered sums over this batch's tokens.
struct RouterLossSums {
  std::vector<double> colsum;
  double zsum = 0;
};
template <class P>
RouterLossSums router_loss_sums(const RouterOptions& opt, const Routing<P>& r);

// The two losses from the sums, the router choices per expert and the token count n.
RouterLosses router_losses_from(const RouterOptions& opt, const RouterLossSums& s, const std::vector<index_t>& routed,
                                index_t n);

// The two auxiliary losses with their coefficients (deterministic ordered sums):
// router_losses_from(opt, router_loss_sums(opt, r), r.routed, r.n).
template <class P>
RouterLosses router_losses(const RouterOptions& opt, const Routing<P>& r);

// d(loss)/d(raw router output) (n, E), for loss = sum_xj dgate_xj * g_xj + aux_scale * (L_aux + L_z):
// through the gates (renormalisation, scores), the load-balancing loss and the z-loss, then the temperature.
// The losses' token count is r.loss_tokens() and their choices per expert r.count.
template <class P>
void router_backward(const RouterOptions& opt, const Routing<P>& r, const View2<const P>& dgate, double aux_scale,
                     const View2<P>& dlogits_raw);

// Aux-loss-free balancing (DeepSeek-V3, Megatron get_updated_expert_bias): bias_i += rate * sign(mean_load - load_i)
// with `load` the tokens routed to each expert over the step (summed over micro-batches and ranks by the caller).
template <class P>
void update_expert_bias(const View1<P>& bias, const std::vector<double>& load, double rate);

}  // namespace mm
