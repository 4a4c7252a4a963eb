// The layout planner: given a language model's configuration, the sequence length, the global batch, the GPU count
// and memory, it picks the parallel layout (tp, cp, ep, dp), the micro-batch and the recompute policy, and says how
// much device memory one rank will use. It is an estimate of THIS code's allocations (each formula below names the
// View it counts), not a rule of thumb, so that it can be checked against measured peak memory.
//
// Notation (one rank): D = d_model, V = vocab, t = activation bytes (sizeof T, 4 for fp32), a = bytes of acc_t<T>
// (4 for fp32, 8 for double; parameters, gradients and the residual stream h are acc_t), b = micro-batch rows,
// L = seqlen / cp (the rank's slice), n = b L tokens, nc = ceil(L / Q) chunks. Under tp a split dimension X appears
// as X' = X / tp (Megatron layout: every tp rank sees all n tokens, D-wide tensors are replicated); experts are split
// over ep (each ep rank holds n_experts / ep of them and sees m = n k assignments on average, times
// moe_load_factor for an imbalanced router).
//
// Parameters (ParamStore: one flat buffer of acc_t, each tensor padded to 16 elements), per rank:
//   M2  in_proj ((2E + 2GN + H)' D), conv (C' W + C'), dt_bias, A_log, D (H' each), norm (E'), out_proj (D E')
//       with E = expand D, H = E / headdim, G = ngroups, N = d_state, C = E + 2GN, W = d_conv
//   M1  in_proj (2E' D), conv (E' W + E'), x_proj ((R + 2N) E'), dt_proj (E' R + E'), A_log (E' N), D (E'),
//       out_proj (D E'), R = dt_rank
//   M3  in_proj ((2E + 2RGN + 3H)' + S) D, dt_bias, D (H'), B_norm, C_norm (N), B_bias, C_bias (H' R N),
//       MIMO: mimo_x, mimo_z, mimo_o (H' R P each), outproj norm (E'), out_proj (D E'), S = rotary angles
//   E   router (n_experts d_router), expert_bias (n_experts, if on; a buffer), w1, w3, w2 ((n_experts/ep) F' D each),
//       shared w1, w3, w2 (F_s' D each)
//   D   w1, w3, w2 (F' D each)
//   per block norm (D), norm_f (D), embedding (V D), lm_head (V D, untied only)
//   bytes_params = a * (padded elements); bytes_grads = the same (the gradient buffer mirrors it);
//   bytes_optimizer = (2a + 1) * (padded elements): AdamW m, v and the one-byte weight-decay mask. Nothing is
//   sharded over dp (no ZeRO yet).
//
// Activations (one micro-batch; micro-batches run one after the other), bytes per token:
//   every block keeps (backbone.cpp, train): h_{l+1} (a D), rstd_l (a), and under policy none xn_l (t D); the LM
//   keeps h_0 = lm::h (a D). Under policy mixer xn_l (every layer's input: u, or x of E and D) is dropped after the
//   block's forward and recomputed from h_l just before the layer's backward (t D, freed after it).
//   the layer's own, policy none (under policy mixer nothing but E's routing and router input; the input is xn_l):
//     M2  zxbcdt t (2E + 2GN + H)', xbc t C', y t E', yn t E', rstd a G'
//     M1  xz 2t E', xc t E', dt_low t R, bc 2t N, delta t E', y t E', checkpoints a N E' / Q (per token)
//     M3  proj t ((2E + 2RGN + 3H)' + S), qk 2t R G' N, v (MIMO) t H' R P, y t H' R P, o t E', rstd_qk 2a R G',
//         rstd_out (outproj norm) a H' R
//     E   routing (always kept): logits, probs a n_experts each, lse, psum a, expert 4k, gate a k, row 8k,
//         perm_token 8k, perm_slot 4k; router input t d_router if jitter; expert acts (policy none and not
//         moe.recompute) per assignment: xp t D, h1 h3 a t 3F', y t D; shared h1 h3 a t 3F_s' per token
//     D   h1, h3, a: t 3F'
//   LM head, live through the backward: hf t D, rstd_f a, logits t V, dlogits t V, dhf t D, dh a D, dxn t D,
//   batch tokens / targets / seq_idx 12.
//   Transients (one layer at a time, freed after it): the backbone forward's m (t D); a layer's forward allocates
//   its full activations (then drops them under mixer) plus its scan context; its backward the recomputed
//   activations (mixer) plus its gradient buffers and the scan's backward context:
//     M2 scan context: delta, acs (a H' per token), states (a H' P N per chunk per row), cb (a G' Q^2 per chunk
//        per row); backward adds dstates (as states), dBh and dCh (a H' N per token each) and the gradient
//        buffers dyn, dy (t E'), dzxbcdt (t (2E+2GN+H)'), dxbc (t C'); the conv backward's dpre (a C') comes
//        after the scan's context is freed.
//     M1 backward: dy, dxc, ddelta (t E'), dxz (2t E'), dbc (2t N), A and dA (a E' N) and the scan's delta and g
//        (a E' per token each), hs (a min(Q, L) N E' per row), dh (a N E' per row), dcarry (a nc N E' per row).
//     M3 scan context: delta, lambda, A, acs, w (a H'), phi (a H' S), qt, kt (a H' R N) per token, states (as M2);
//        backward adds dstates, dsh0, dgp0, dqt, dkt, da, dw, ddiag, dut, dphi, the dq_bias partial sums
//        (a H' R N per 256 tokens) and dO, dproj, dy, dqk (dv for MIMO).
//     E  backward: dy, dxp (t D per assignment), dh1, dh3 (2t F' per assignment), dgate, dlogits; under ep the
//        all-to-all send and receive buffers (2 t D per assignment, forward and backward).
//   The peak is the larger of the forward peak (lm::h, hf, the backbone's m, what the blocks before l keep, xn_l and
//   rstd_l, the layer's full activations and forward transient; h_{l+1} comes after the layer has dropped what it
//   does not keep) and the backward peak over the layers l (lm::h, the LM head's buffers, every block's h and rstd,
//   xn_0 .. xn_l under none or the recomputed xn_l under mixer, the layer activations kept by the layers <= l, the
//   recomputed activations of l and the larger of its recompute transient and its backward transient; a layer's
//   activations and its xn_l are released after its backward, the blocks' h and rstd only at the end).
//   Checked: tests/unit/test_planner.cpp compares this with the peak of the bytes a real training step allocates
//   (Kokkos allocation callbacks, host backend): within 0.3 % for M2 stacks and a M2 M1 M3 E D stack, both policies.
//   With PlanInput::eval_batch, the activations are the larger of that and the held-out evaluation's forward (no
//   training: the residual stream updated in place, each block's rstd kept to the end, one layer's activations and
//   transients at a time, then the logits), checked the same way.
//   Not modelled: GEMM library internals (cuBLAS workspace: in the reserve), the M1 and M3 scans' team scratch,
//   and the communication buffers of tp / cp (not implemented yet; cp's are O(b H P N) per layer, tp's all-reduce
//   works in place on the n D layer output).
// Workspace: Kokkos' level-1 team scratch of the SSD backward, kept by Kokkos between launches: 3 a Q^2 (+ the
//   dL/dH tile a P (N+1) if it does not fit on chip) per team times min(teams, gpu_concurrency / 256) (none for
//   the GEMM formulation); with ep * dp > 1 the trainer's gradient all-gather buffer (at most 64 MiB: it gathers
//   in buckets); plus runtime_reserve_bytes for the CUDA context, cuBLAS workspace and the communication library
//   (not modelled).
//
// Rules (a layout that breaks one is rejected, the reason says which): tp * cp * ep * dp = gpus; tp <= gpus per node;
// tp divides nheads and ngroups of M2 and M3 layers, d_inner of M1 layers, d_ff (and shared_d_ff) of E and D layers;
// ep divides n_experts and is 1 without E layers; cp divides seqlen and each rank's slice is at least one chunk of
// every M2/M3 layer (the state passing hands one state per chunk boundary); ep * dp divides the global batch (the
// ep x dp ranks hold different sequences) and the micro-batch divides the per-rank sequences.
//
// Objective: fit in memory_fraction of the GPU memory; among the layouts that fit, the least communication, in this
// order of preference (smallest first, compared one after the other):
//   tp  — an all-reduce of n D activations per layer, forward and backward, and smaller GEMMs: the most traffic,
//         needed only for models whose weights or per-token widths do not fit otherwise;
//   ep  — an all-to-all of n k D activations per MoE layer, twice forward and twice backward: only when expert
//         weights dominate the memory (ep does not reduce activations: ep ranks hold different tokens);
//   recompute none over mixer — recomputing the mixers costs about one more mixer forward (~30 % of the step);
//   cp  — state passing sends O(H P N) per layer per row, independent of L: cheap, needed when one sequence does not
//         fit (its activations are what it divides), but latency-bound (sequential over cp ranks);
//   dp  — (the rest) one gradient all-reduce per step, overlapped with the backward: the cheapest;
//   then the largest micro-batch that fits (fewer, larger kernels).
#pragma once

#include <string>
#include <vector>

#include "model/backbone.hpp"
#include "model/lm.hpp"
#include "parallel/grid.hpp"

namespace mm::parallel {

struct PlanModel {
  Mamba2Config mixer;        // mixer.d_model is the model width
  index_t n_layer = 1;
  LayerStackConfig layers;   // the pattern (empty: n_layer x M2) and the other kinds' configs
  index_t vocab_size = 16;
  bool tie_embeddings = true;
};

// The planner's view of a language model's configuration (what the deck's [model] gives the LM).
PlanModel plan_model(const LMConfig& lm);

struct PlanInput {
  PlanModel model;
  index_t seqlen = 0;               // tokens per sequence
  index_t global_batch = 1;         // sequences per optimizer step
  index_t gpus = 1;
  double gpu_memory_bytes = 0;
  index_t gpus_per_node = 8;
  index_t dtype_bytes = 4;          // sizeof(T) of the activations (4: fp32, 8: double)
  double memory_fraction = 0.9;     // the share of gpu_memory_bytes a plan may use
  double runtime_reserve_bytes = 1e9;   // CUDA context, cuBLAS workspace, communication buffers (not modelled)
  index_t gpu_concurrency = 132 * 2048; // resident threads (H200: 132 SMs x 2048): sizes Kokkos' scratch pool
  double moe_load_factor = 1.0;     // assignments per rank relative to the balanced n k (router imbalance)
  // [run] gemm_precision = bf16 with fp32 activations: the MoE layers' bf16 expert path (moe/experts.hpp: bf16
  // expert inputs, intermediates and weight copies instead of fp32 ones), and the Mamba-2 layers keep their gated
  // norm's output as a bf16 copy (Mamba2Acts::yn_b).
  bool moe_bf16 = false;
  // Held-out evaluation between steps (the drivers' [train] eval_batch_size and eval_seq_len): every rank runs
  // forward passes of eval_batch sequences of eval_seqlen tokens (0: seqlen; its cp slice under cp) while the
  // parameters, gradients and optimizer state stay. 0: not counted.
  index_t eval_batch = 0;
  index_t eval_seqlen = 0;
};

struct Plan {
  Layout layout;                    // dp filled in
  index_t micro_batch = 1;          // sequences per micro-batch per data rank
  index_t accumulation = 1;         // micro-batches per optimizer step
  Recompute policy = Recompute::none;
  index_t tokens_per_rank = 0;      // micro_batch * seqlen / cp
  index_t param_elements = 0;       // per rank, padded (ParamStore::total())
  double bytes_params = 0, bytes_grads = 0, bytes_optimizer = 0, bytes_activations = 0, bytes_workspace = 0;
  double bytes_train_activations = 0;  // the training step's peak; bytes_activations is the larger of it and
  double bytes_eval_activations = 0;   // the evaluation forward's peak (0 without PlanInput::eval_batch)
  double bytes_total = 0;           // the sum of the five above
  double bytes_available = 0;       // memory_fraction * gpu_memory_bytes
  std::string reasoning;            // one line per candidate considered (rejected and why, or accepted)
};

// Parameter elements one rank holds under (tp, ep): `count` as ParamStore::count() (buffers included), `padded`
// as ParamStore::total(). Throws if tp or ep does not divide what it splits.
struct ParamCount {
  index_t count = 0, padded = 0;
};
ParamCount planned_params(const PlanModel& m, index_t tp, index_t ep);

// Empty when `layout` (dp given or 0 = the rest) obeys every rule for `in`, else the reason, naming the values.
std::string check_layout(const PlanInput& in, const Layout& layout);

// The memory of one rank for a given layout, micro-batch and policy (no search; used to compare with measured
// peaks). Throws mm::Error when the layout breaks a rule or the micro-batch does not divide the per-rank batch.
Plan estimate(const PlanInput& in, const Layout& layout, index_t micro_batch, Recompute policy);

// Search every layout of in.gpus ranks (see the objective above). Throws mm::Error when nothing fits, naming the
// closest candidate, its memory by part, the memory available and the shortfall; or when no layout obeys the rules.
Plan plan(const PlanInput& in);

// A few lines for printing: the layout, micro-batch, policy and the memory by part in GB.
std::string describe(const Plan& p);

const char* recompute_name(Recompute r);  // "none", "mixer"

}  // namespace mm::parallel
