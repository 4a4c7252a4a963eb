// Mamba-2 SSD (state-space duality) chunked scan, forward and backward: the portable Kokkos implementation.
//
// Per batch row b and head h (group g = h / (H/G); B_t, C_t in R^N shared by the heads of a group):
//   Delta_t = clamp(softplus(dt_t + dt_bias_h), dt_lo, dt_hi),   A_h = -exp(A_log_h),   a_t = Delta_t A_h
//   S_t = exp(a_t) S_{t-1} [same record as t-1] + Delta_t x_t B_t^T          S_{-1} = init_state (or 0)
//   y_t = S_t C_t + D_h x_t
// The state is reset at a record boundary of seq_idx (packed records never leak into each other); the initial
// state belongs to the record of the first token. The chunked algorithm (chunk Q) computes, per chunk c:
//   chunk-local states, the inter-chunk state passing, and the outputs from the intra-chunk (Q x Q) and inter-chunk
//   terms. Every exponent of a cumulative-sum difference is formed as exp(min(d, 0)).
// The backward recomputes the forward intermediates (chunk states) unless the forward kept them (SSDSaved).
//
// Inputs are column windows of row-major matrices with rows b * L + t, so the scan reads x, B, C straight out of
// the conv output and dt straight out of the in_proj output without copies.
#pragma once

#include <limits>

#include "core/kokkos_types.hpp"
#include "core/pool.hpp"
#include "layers/conv1d.hpp"  // SeqIdxView
#include "tensor/gemm.hpp"

namespace mm {

// How the chunked scan is computed (both give the same result up to rounding; tests run both):
//   portable: hierarchical Kokkos kernels, one team per (row, chunk, head) doing the Q x Q work in scalar loops;
//   gemm:     the chunk-local matrix products (C B^T, the masked Q x Q product with x, chunk states, the inter-chunk
//             outputs and every product of the backward) as strided batched GEMMs (cuBLAS on CUDA: tensor cores
//             under `compute` tf32/bf16), with the masks, decays and reductions in Kokkos elementwise kernels;
//   fused:    on CUDA with float activations (headdim a multiple of 16 up to 128, d_state a multiple of 16, chunk a
//             multiple of 64), the forward's chunk states and chunk scan and the backward's intra-chunk products
//             (dX = M^T dY, the sums of K o dY X^T, dC B^T summed over heads) as native tensor-core kernels
//             (ssd_fused.hpp: bf16 operands, fp32 accumulation, no per-head Q x Q workspace); the rest as gemm
//             (its GEMMs under `compute`, except that bf16 gives tf32 there: those operands are fp32, and cuBLAS ran
//             them slower in bf16 than in tf32), and every other build or shape entirely as gemm;
//   automatic: on CUDA fused when `compute` is bf16 (the arithmetic its products use), else gemm; gemm on host
//             backends too (its chunk products in the host batched GEMM ran a CPU training step 1.3-1.8x faster
//             than the portable kernels; Mamba-3's SISO scan keeps its own kernels there, scan.hpp).
enum class SSDAlgo { automatic, portable, gemm, fused };

struct SSDShape {
  index_t batch = 1, seqlen = 0, nheads = 1, headdim = 1, ngroups = 1, dstate = 1, chunk = 256;
  double dt_lo = 0.0;                                         // dt_limit[0]
  double dt_hi = std::numeric_limits<double>::infinity();    // dt_limit[1]
  SSDAlgo algo = SSDAlgo::automatic;
  GemmCompute compute = GemmCompute::fp32;  // arithmetic of the gemm algorithm's float GEMMs on CUDA
  double gemm_workspace_bytes = double(256ull << 20);  // gemm algorithm: bytes per Q x Q workspace (heads per block)
  index_t nchunks() const { return (seqlen + chunk - 1) / chunk; }
  void validate(const char* where) const;
};

template <class T>
struct SSDIn {
  View2<const T> xbc;   // x at column x_col + h * P + p, B at b_col + g * N + n, C at c_col + g * N + n
  index_t x_col = 0, b_col = 0, c_col = 0;
  // x from a matrix of its own where non-empty (rows b L + t, head h at column x_col + h P of it; xbc then holds
  // only B and C): Mamba-3 reads its v straight out of the in_proj output instead of copying it next to k~, q~.
  View2<const T> x;
  View2<const T> dt;    // raw dt (before dt_bias and softplus) at column dt_col + h
  index_t dt_col = 0;
  View1<const acc_t<T>> A_log, dt_bias, D;  // (H)
  SeqIdxView seq_idx;                         // (batch, seqlen) or empty
  View4<const acc_t<T>> init_state;           // (batch, H, P, N) or empty (zero)
  // Per-token decay and weight given directly, instead of dt, A_log and dt_bias (then unused, and may be empty):
  //   S_t = exp(log_decay_t) S_{t-1} + weight_t x_t B_t^T, both (batch, H, L), log_decay <= 0.
  // Mamba-3 runs its SISO scan through this form (data-dependent A, trapezoidal weights). ssd_step ignores it.
  View3<const acc_t<T>> log_decay, weight;
  bool per_token() const { return log_decay.extent(0) > 0; }
  // A per-token part of the skip coefficient, or empty: y_t = S_t C_t + (D_h + D_token(b, h, t)) x_t, (batch, H, L).
  // Mamba-3 gives its trapezoid's diagonal correction (gamma_t - w_t) (q~_t . k~_t) here, which would otherwise be
  // a pass of its own over y (and one over dy and x in the backward). ssd_step ignores it.
  View3<const acc_t<T>> D_token;
  // B and C in bf16 at the columns b_col, c_col (rows b L + t), in place of xbc's (xbc then empty, or holding only
  // x), where non-empty: Mamba-3 has its rotation write k~ and q~ so (half the bytes written and read back). Only
  // where ssd_bc_in_bf16_applies(shape), and the backward from the forward's kept context: the kernels that then
  // run round B and C to bf16 (or tf32, exact on bf16 values) for their products anyway; every other path refuses
  // it with an error.
  View2<const bf16_op_t> bc_bf16;
};

template <class T>
struct SSDGrad {
  View2<T> dxbc;  // dx, dB, dC are written into the same columns as the inputs
  // dx into a matrix of its own where non-empty (rows b L + t, head h at column dx_col + h P), its columns of dxbc
  // then left untouched: Mamba-3 has the SSD write dv straight into its in_proj gradient. Required when x was
  // given as a matrix of its own (SSDIn::x).
  View2<T> dx;
  index_t dx_col = 0;
  View2<T> ddt;   // d(raw dt) written at the same column as dt, or from column ddt_col where that is >= 0
  index_t ddt_col = -1;
  View1<acc_t<T>> dA_log, ddt_bias, dD;  // accumulated (+=)
  View4<acc_t<T>> dinit_state;           // written when non-empty
  // With SSDIn::per_token(): the gradients of log_decay and weight (batch, H, L) are written here instead of ddt,
  // dA_log and ddt_bias (left untouched); dD is accumulated as always.
  View3<acc_t<T>> dlog_decay, dweight;
  // With SSDIn::D_token, when non-empty: its gradient dy_t . x_t per (batch, H, L) is written here (fp32 products
  // where the fused kernels run, which then also give dD from them; the gemm algorithm's come from its dY X^T
  // product under `compute`).
  View3<acc_t<T>> dD_token;
  // dB and dC rounded to bf16 (dxbc's columns and row layout), where non-empty: written here in place of dxbc's B
  // and C columns, which are then left untouched (dxbc may be empty when dx is given). Only where
  // ssd_bc_bf16_applies(shape): Mamba-3 has its per-head dq~ and dk~ from here for its rotation backward.
  View2<bf16_op_t> dbc_bf16;
};

// What the forward of the gemm and fused algorithms can keep so that the backward does not form it again: Delta
// and the in-chunk cumsum of its exponent (batch, H, L), the state entering each chunk (batch, nchunks, H, P, N)
// and C B^T (batch, nchunks, G, Q, Q) (the planner counts them: ssd_saved_ctx_bytes). The backward then skips the
// cumsum, the chunk states, the state passing and C B^T (it still forms its own Delta-weighted x).
template <class T>
struct SSDSaved {
  View3<acc_t<T>> delta, acs;
  View5<acc_t<T>> states, cb;
  bool empty() const { return states.extent(0) == 0; }
};

// y (batch * seqlen, H * P) is written; final_state (batch, H, P, N) is written when non-empty. With `keep` (and
// the gemm or fused algorithm) the intermediates are left in *keep, their blocks taken from `pool` (live as long
// as it is); otherwise *keep is left empty.
template <class T>
void ssd_forward(const SSDShape& s, const SSDIn<T>& in, const View2<T>& y, const View4<acc_t<T>>& final_state,
                 SSDSaved<T>* keep = nullptr, PoolScope* pool = nullptr);

// dy (batch * seqlen, H * P); dfinal_state (batch, H, P, N) or empty. `kept`: what ssd_forward kept for the same
// shape and inputs (or null / empty: recomputed).
template <class T>
void ssd_backward(const SSDShape& s, const SSDIn<T>& in, const View2<const T>& dy,
                  const View4<const acc_t<T>>& dfinal_state, const SSDGrad<T>& g, const SSDSaved<T>* kept = nullptr);

// Blocks of heads of the GEMM formulation's Q x Q workspaces (ssd.cpp; the planner counts the same): `heads`
// per block (at most `budget_bytes` / `per_head_bytes`, and never straddling a group: a multiple of the heads per
// group, or a divisor of it), and `runs` per block, the groups (or parts of one) in a block, one summed dC B^T
// workspace each in the backward.
struct SSDGemmBlocks {
  index_t heads = 1, runs = 1;
};
SSDGemmBlocks ssd_gemm_blocks(index_t nheads, index_t ngroups, double per_head_bytes,
                              double budget_bytes = double(256ull << 20));
// The per-head bytes by which the fused backward sizes its blocks of heads: six per-token sums and one part of the
// incoming sums per 64-token tile, for `tokens` tokens of `elem_bytes` each (it has no per-head Q x Q workspace).
inline double ssd_fused_head_bytes(double tokens, index_t chunk, double elem_bytes) {
  return double(6 + (chunk + 63) / 64) * tokens * elem_bytes;
}

// One token per batch row (decode): `s.seqlen` must be 1 and the inputs hold `batch` rows; state (batch, H, P, N)
// is advanced in place (S = exp(Delta A) S + Delta x B^T) and y (batch, H * P) = S C + D x is written. seq_idx and
// init_state are ignored.
// The algorithm `s.algo` resolves to in this build.
SSDAlgo ssd_resolved_algo(const SSDShape& s);

// Whether the fused backward from a kept context forms its state terms (dS_in's own part, dB's and dC's) as GEMMs
// on bf16 operands: bf16 arithmetic asked for, and dB, dC not in the one-kernel form (ssd_fused::bc_kernel_for).
// It then takes bf16 copies of xw, e_in dY, C, dH and S_in in place of fp32 xw and e_in dY (the planner counts the
// same). fp32 activations only; the caller also checks that the fused kernels apply.
bool ssd_bf16_state_terms(const SSDShape& s, index_t heads_per_group);

// Whether ssd_backward on float activations of this shape forms dB and dC in the one-kernel form
// (ssd_fused::bc_backward) under bf16 arithmetic with one head a group, so that SSDGrad::dbc_bf16 may be given
// (CUDA builds; bf16 arithmetic rounds B and C to bf16 for those products already).
bool ssd_bc_bf16_applies(const SSDShape& s);

// Whether the fused forward and the backward (from the forward's kept context) of float activations of this shape
// run only kernels that read B and C in bf16 (SSDIn::bc_bf16): ssd_bc_bf16_applies, and the sequential forward and
// backward state terms taken (ssd_fused::bc16_forms_take: the forms as set, the device's SMs); CUDA builds only.
// The rows' alignment is the caller's to give (16-byte rows, ldx and the columns multiples of 8 elements).
bool ssd_bc_in_bf16_applies(const SSDShape& s);

template <class T>
void ssd_step(const SSDShape& s, const SSDIn<T>& in, const View4<acc_t<T>>& state, const View2<T>& y);

}  // namespace mm
