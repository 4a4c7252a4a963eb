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
//
// Expert parallelism (comms.ep of size R > 1). The ep ranks hold different tokens (each rank's rows are its own
// micro-batch, like data-parallel ranks) and split the experts in contiguous blocks: rank q owns experts
// [q E/R, (q+1) E/R) and registers only their weights (experts.w1/w3/w2 of local shape (E/R, ...), with a Shard
// {Split::ep, the global shape, rows = the expert range}); the router, the expert bias and the shared expert are
// replicated (no Shard). Routing, top-k, the auxiliary losses, the expert-bias selection and the capacity decision
// stay local to each rank's tokens. The expert computation is distributed: an all-to-all of the per-expert kept
// counts, the token exchange to the owners (dropless: variable sizes; capacity mode: static shapes, every
// expert's block padded with zero rows to the capacity, which the experts compute and which add nothing), on the owner the received rows in the order
// (local expert, source rank, the source's permuted order) through the grouped GEMM, the reverse exchange and the
// local combine. The backward mirrors it: the gradients of the expert inputs return to their source ranks, the
// expert-weight gradients accumulate on the owner (the sum over all ep ranks' tokens). So on every rank the output,
// the input gradient and the router/shared gradients are the single-rank layer's on that rank's rows, and an
// owner's expert-weight gradient is the sum over the ep ranks of the single-rank gradients of those experts.
// backward() (and a forward) is collective over comms.ep.
//
// Arithmetic of the routed experts: a float layer whose float GEMMs compute in bf16 (set_float_gemm_compute(
// GemmCompute::bf16), i.e. the deck's [run] gemm_precision = bf16) takes the bf16 expert path of moe/experts.hpp
// (bf16 expert inputs, weights and intermediates, fp32 accumulation, fp32 expert outputs, master weights and
// gradients); host builds emulate it (bf16-rounded floats). The choice is made at each forward and kept for its
// backward. Otherwise (fp32, tf32, and double layers) the experts run the float GEMMs of gemm(). The router and the
// shared expert always use gemm() (in its float arithmetic).
//
// Context parallelism (comms.cp of size C > 1). The cp ranks hold consecutive slices of the same sequences: with
// MoEStep::batch = B sequences, the rows are b * Lr + t (Lr = rows / B), rank c holding tokens [c Lr, (c+1) Lr) of
// every sequence, i.e. rows b * L + c * Lr + t of the single-rank layer on the whole sequences (L = C Lr). The
// per-token math is local; what the layer computes over all its tokens is the value over the whole sequences:
// the load-balancing and z losses (their sums, token counts and router choices are gathered over cp and summed in
// rank order), the statistics (MoEStats: counts of the whole sequences, identical on every cp rank), the capacity
// (ceil(cf * B L k / E)) and which assignments it drops: a rank keeps the assignments whose position in the
// single-rank slot-major order over rows b * L + t is below the capacity (from the per-(slot, sequence, expert)
// choices of all cp ranks), and the router jitter is drawn by the single-rank row index. The returned losses are
// the whole sequences' values on every cp rank (count them once); their gradients are split over the cp ranks'
// tokens, so the parameter gradients summed over cp equal the single-rank ones.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/kokkos_types.hpp"
#include "model/params.hpp"
#include "moe/experts.hpp"
#include "moe/router.hpp"
#include "parallel/grid.hpp"

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

// Routing statistics of one forward (host), for logs. Under context parallelism they count the whole sequences
// (all cp ranks, identical on each), so sum them over micro-batches and the data ranks (ep x dp), not over cp.
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
  // Sequences in the rows (rows = batch * local seqlen). Needed only under context parallelism (cp > 1), where it
  // is required; ignored otherwise.
  index_t batch = 0;
};

// Expert parallelism: the token exchange of one forward (host counts, device index maps).
struct MoEExchange {
  std::vector<std::size_t> send_rows, recv_rows;  // rows sent to / received from each ep rank
  std::vector<index_t> offsets;                   // (E/R + 1) local experts' groups of the expert-major buffer
  View1<index_t> to_expert;                       // expert-major row -> received row
  View1<index_t> to_recv;                         // received row -> expert-major row
  View1<index_t> to_pad;                          // capacity mode: permuted row -> row of the padded buffer
};

template <class T>
struct MoEActs {
  View2<T> x;             // input (n, d)
  View2<T> state;         // second router input (state_aware), else empty
  View2<T> xr;            // router input (jittered and/or concatenated); empty when it is x itself
  MoEStep step;
  Routing<acc_t<T>> routing;
  View2<T> xp;            // the local experts' input rows } expert activations: empty under recompute,
  SwiGLUActs<T> ex;       // expert intermediates          } rebuilt by backward()
  View2<T> y;             // expert outputs (m, d)         }
  SwiGLUActs<T> sh;       // shared expert intermediates  }
  // The bf16 expert path (float layers under set_float_gemm_compute(GemmCompute::bf16), decided at the forward;
  // see moe/experts.hpp): the experts' input rows in bf16 instead of xp, the bf16 weights and intermediates
  // instead of ex (same lifetime rules as xp and ex). y stays fp32.
  bool bf16_experts = false;
  View2<bf16_op_t> xp16;
  SwiGLUBF16 ex16;
  bool expert_acts_kept = false;
  // Cached device blocks (core/pool.hpp) behind the views above: `ws` for the router's, `expert_ws` for xp, ex and
  // y (and, under ep, the exchange's index maps), dropped with them under recompute.
  std::shared_ptr<PoolScope> ws, expert_ws;
  MoEExchange ep;         // expert parallelism only: xp is then the received rows in expert-major order,
                          // y the outputs of this rank's m permuted rows after the reverse exchange
  MoEStats stats;
};

template <class T>
class MoELayer {
 public:
  using P = acc_t<T>;
  static_assert(std::is_same_v<T, P>, "bf16 activations need compute copies of the GEMM weights (GPU path)");

  // Registers the parameters under `prefix` (e.g. "backbone.layers.3.moe.") in `store`. The expert output
  // projections (w2) are scaled by 1/sqrt(n_layer) at initialisation like Mamba-2's out_proj. `comms`: expert
  // parallelism over comms.ep (n_experts must divide by its size) and context parallelism over comms.cp (see the
  // header); comms.tp is not used (the layer is replicated over tp). Size-1 communicators run the single-rank code.
  MoELayer(const MoEConfig& cfg, ParamStore<P>& store, const std::string& prefix, index_t n_layer,
           const parallel::ModelComms& comms = {});

  const MoEConfig& config() const { return cfg_; }
  index_t param_count() const { return cfg_.param_count(); }
  index_t active_param_count() const { return cfg_.active_param_count(); }

  // Expert parallelism: wall seconds this rank spent in the layer's all-to-alls (counts and token rows, forward
  // and backward) since the last take, device work issued before each one excluded (it is fenced first). Reading
  // it starts a new count.
  double take_exchange_seconds() const { return std::exchange(exchange_s_, 0.0); }

  // Experts this rank holds: [first_expert(), first_expert() + local_experts()).
  index_t local_experts() const { return cfg_.n_experts / ep_size_; }
  index_t first_expert() const { return local_experts() * ep_rank_; }

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
  // Fills xp, ex, y and sh from x and the routing, and writes the shared expert's output into shared_out (when
  // given; the recompute discards it); returns whether there is a shared expert.
  bool experts_forward(MoEActs<T>& a, const View2<T>& shared_out = View2<T>()) const;
  SwiGLUWeights<T> expert_weights() const;
  SwiGLUWeights<T> shared_weights() const;
  // expert parallelism: rows (n_rows, d) sent by the counts `send` to the ep ranks, received by `recv` into a
  // block of `ws`
  View2<T> exchange(const View2<T>& src, const std::vector<std::size_t>& send, const std::vector<std::size_t>& recv,
                    PoolScope& ws) const;
  // context parallelism: the global capacity decision, statistics and loss sums (see the header)
  struct CpRows {
    index_t L = 0, Lr = 0, c0 = 0;  // whole and local sequence length, first token of this rank
  };
  CpRows cp_rows(index_t n, const MoEStep& step, const std::string& ctx) const;

  MoEConfig cfg_;
  parallel::ModelComms comms_;
  int ep_size_ = 1, ep_rank_ = 0, cp_size_ = 1, cp_rank_ = 0;
  mutable double exchange_s_ = 0;  // see take_exchange_seconds()
  ParamStore<P>* store_;
  std::string prefix_;
  std::size_t router_w_, bias_ = 0, w1_, w3_, w2_, s1_ = 0, s3_ = 0, s2_ = 0;
};

}  // namespace mm
