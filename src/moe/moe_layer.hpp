// The MoE feed-forward layer: router -> dispatch -> SwiGLU experts (grouped GEMM) -> weighted combine, plus an
// optional always-on shared expert. Token-local: rows are tokens (batch * seqlen flattened), no sequence structure.
//
//   out_x = sum_{j < k, (x, j) kept} g_xj * SwiGLU_{e_xj}(x)  +  SwiGLU_shared(x)
//
// The router and its losses are documented in moe/router.hpp (Switch load-balancing loss normalised by k, ST-MoE
// z-loss, capacity priority order), the experts and dispatch kernels in moe/experts.hpp.
//
// The layer output does not include the residual: a dropped (token, expert) assignment contributes zero, so the
// token passes through the block's residual for that expert.
//
// Router input: x, or [x | s] with s a second (n, d_model) input when `state_aware` is on (experimental: e.g. the
// preceding mixer's output; its gradient is returned). Multiplicative jitter (training only): the router input is
// multiplied elementwise by U(1 - jitter, 1 + jitter), drawn from the counter RNG with (seed, hash(prefix +
// "router.jitter") mixed with the step, element index): reproducible and regenerated in the backward. The experts
// see the un-jittered x.
//
// Parameters under the prefix: router.weight (E, d_r), experts.w1 / experts.w3 (E, d_ff, d), experts.w2 (E, d, d_ff),
// shared.w1 / shared.w3 (d_ff_shared, d), shared.w2 (d, d_ff_shared) when the shared expert is on, and
// router.expert_bias (E) when bias_update_rate > 0: a buffer, not trained by gradient (its gradient stays zero),
// changed only by update_expert_bias(); it lives in the store so that checkpoints carry it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/kokkos_types.hpp"
#include "model/params.hpp"
#include "moe/experts.hpp"
#include "moe/router.hpp"

namespace mm {

struct MoEConfig {
  index_t d_model = 256;
  index_t n_experts = 8;
  index_t top_k = 2;
  index_t d_ff = 512;               // per expert
  ScoreFunc score_func = ScoreFunc::softmax;
  bool renormalize = false;         // renormalise the k chosen scores to sum to 1
  double temperature = 1.0;         // router logits are divided by it
  double output_scale = 1.0;        // multiplies every gate
  double capacity_factor = 0.0;     // 0: dropless
  double jitter = 0.0;              // multiplicative router-input jitter epsilon (training only)
  double aux_loss_coef = 1e-2;
  double z_loss_coef = 1e-3;
  double bias_update_rate = 0.0;    // > 0: aux-loss-free expert bias on
  index_t shared_d_ff = 0;          // 0: no shared expert
  bool state_aware = false;         // router input [x | s] (experimental)
  bool recompute = false;           // keep no expert activations; recompute them in the backward
  // Bit-identical runs. Every kernel of this layer is deterministic today (ordered gathers and reductions, no
  // atomics), so the flag selects nothing yet: it is where a faster atomic scatter-add path would be switched off.
  bool deterministic = true;

  index_t router_in() const { return state_aware ? 2 * d_model : d_model; }
  // Parameters of the layer (the expert bias buffer excluded), total and used per token (router, k experts, shared).
  index_t param_count() const;
  index_t active_param_count() const;
  RouterOptions router_options() const;
  // Bad values are an mm::Error naming them.
  void validate(const std::string& context) const;
};

// Routing statistics of one forward (host), for logs.
struct MoEStats {
  std::vector<index_t> routed;  // router choices per expert (before capacity)
  std::vector<index_t> kept;    // assignments each expert computed (after capacity)
  index_t tokens = 0;           // tokens in the batch
  index_t assignments = 0;      // tokens * top_k
  index_t dropped = 0;          // assignments dropped by the capacity limit
  index_t capacity = -1;        // per-expert capacity, -1 dropless
  double aux_loss = 0, z_loss = 0;
  // max_i routed_i / mean_i routed_i (1 = perfectly balanced)
  double load_imbalance() const;
  std::string summary() const;  // one line
};

struct MoELosses {
  double aux = 0;  // coefficient included
  double z = 0;    // coefficient included
  double total() const { return aux + z; }
};

// Training context of a forward: jitter is drawn only when training, from (seed, step).
struct MoEStep {
  bool training = false;
  std::uint64_t seed = 0;
  std::uint64_t step = 0;
};

template <class T>
struct MoEActs {
  View2<T> x;             // input (n, d)
  View2<T> state;         // second router input (state_aware), else empty
  View2<T> xr;            // router input (jittered and/or concatenated); empty when it is x itself
  MoEStep step;
  Routing<acc_t<T>> routing;
  View2<T> xp;            // permuted tokens (m, d)       } expert activations: empty under recompute,
  SwiGLUActs<T> ex;       // expert intermediates         } rebuilt by backward()
  View2<T> y;             // expert outputs (m, d)        }
  SwiGLUActs<T> sh;       // shared expert intermediates  }
  bool expert_acts_kept = false;
  MoEStats stats;
};

template <class T>
class MoELayer {
 public:
  using P = acc_t<T>;
  static_assert(std::is_same_v<T, P>, "bf16 activations need compute copies of the GEMM weights (GPU path)");

  // Registers the parameters under `prefix` (e.g. "backbone.layers.3.moe.") in `store`. The expert output
  // projections (w2) are scaled by 1/sqrt(n_layer) at initialisation like Mamba-2's out_proj.
  MoELayer(const MoEConfig& cfg, ParamStore<P>& store, const std::string& prefix, index_t n_layer);

  const MoEConfig& config() const { return cfg_; }
  index_t param_count() const { return cfg_.param_count(); }
  index_t active_param_count() const { return cfg_.active_param_count(); }

  // out (n, d) = MoE(x). Returns the auxiliary losses (already multiplied by their coefficients; add them to the
  // training loss); acts.stats has the routing statistics. With save = false or cfg.recompute the expert
  // activations are not kept (the routing is: it is small) and backward() recomputes them.
  MoELosses forward(const View2<T>& x, const View2<T>& out, MoEActs<T>& acts, bool save, const MoEStep& step = {},
                    const View2<T>& state = View2<T>()) const;

  // dx (n, d) is written with d(loss)/dx for loss = sum(dout * out) + aux_scale * (aux + z); parameter gradients
  // (router through the chosen scores and the aux losses, experts, shared expert) are accumulated into the store.
  // With state_aware, dstate (n, d) is written too.
  void backward(MoEActs<T>& acts, const View2<const T>& dout, const View2<T>& dx, double aux_scale = 1.0,
                const View2<T>& dstate = View2<T>()) const;

  // Aux-loss-free balancing, once per optimizer step: bias_i += rate * sign(mean(load) - load_i). `load` is the
  // tokens routed to each expert over the step (e.g. the sum of stats.routed over micro-batches, all-reduced over
  // the data-parallel ranks). A no-op when the expert bias is off.
  void update_expert_bias(const std::vector<double>& load) const;
  bool has_expert_bias() const { return cfg_.bias_update_rate > 0; }

  // The RNG stream of the router jitter at a step (the tests' reference draws the same numbers).
  std::uint64_t jitter_stream(std::uint64_t step) const;

 private:
  // Fills xp, ex, y and sh from x and the routing; returns the shared expert's output (empty when off).
  View2<T> experts_forward(MoEActs<T>& a) const;
  SwiGLUWeights<T> expert_weights() const;
  SwiGLUWeights<T> shared_weights() const;

  MoEConfig cfg_;
  ParamStore<P>* store_;
  std::string prefix_;
  std::size_t router_w_, bias_ = 0, w1_, w3_, w2_, s1_ = 0, s3_ = 0, s2_ = 0;
};

}  // namespace mm
