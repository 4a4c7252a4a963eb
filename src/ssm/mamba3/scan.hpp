// Mamba-3 chunked scan (SISO, and MIMO of rank R), forward and backward: the portable Kokkos implementation.
//
// Per batch row b and head h (group g = h / (H/G); rank copies r < R; SISO is R = 1):
//   Delta_t = softplus(dd_dt_t + dt_bias_h)         A_t = -max(heavy_tail(dd_A_t), A_floor)
//   lambda_t = sigmoid(trap_t)      alpha_t = exp(A_t Delta_t)
//   beta_t = (1 - lambda_t) Delta_t alpha_t         gamma_t = lambda_t Delta_t      (exponential-trapezoidal rule)
//   phi_t = (phi_{t-1} + pi tanh(theta_t) Delta_t) mod 2 pi      (S angles theta per token, shared by the heads)
//   q_{t,r} = Rot(phi_t) (qn_{t,r,g} + q_bias_{h,r}),  k_{t,r} = Rot(phi_t) (kn_{t,r,g} + k_bias_{h,r})
//   S_t = alpha_t S_{t-1} + beta_t sum_r v_{t-1,r} k_{t-1,r}^T + gamma_t sum_r v_{t,r} k_{t,r}^T       (P x N)
//   y_{t,r} = S_t q_{t,r} + D_h v_{t,r}
// qn and kn are the RMS-normalised C and B (the mixer applies the norm); the rotation acts on S pairs of state
// dimensions: interleaved (2i, 2i+1) (upstream SISO) or halved (i, i + N/2) (upstream MIMO); the others are not
// rotated. The decode carry is (phi, S, k_prev, v_prev) of the last token; it is both the optional initial state
// and the final state, so a long sequence can be processed in windows, or one token at a time.
//
// Packed records (seq_idx, (batch, seqlen) int32, contiguous runs per row; empty = one record per row): at a token t
// whose record differs from that of t-1 the recurrence restarts as for a fresh sequence with a zero carry:
// S_{t-1}, k_{t-1}, v_{t-1} are taken as zero (alpha_t and beta_t drop out) and phi_{t-1} = 0, so the rotary phase
// restarts at 0 (phi_t = pi tanh(theta_t) Delta_t mod 2 pi), exactly what running the record on its own gives. No
// term couples tokens of different records; the initial carry belongs to the record of the first token, and the
// final carry is that of the last token's record.
//
// Chunked algorithm (chunk Q): with gamma'_t = Delta_{t+1} (1 - lambda_{t+1}) (0 at the last token) the beta term
// of token t+1 folds into a per-token weight w_t = gamma_t + gamma'_t, and inside a chunk (Acs = in-chunk cumsum of
// A Delta)
//   y_{t,r} = D v_{t,r} + exp(Acs_t) Sh_in q_{t,r} + sum_{s<t} exp(Acs_t - Acs_s) w_s sum_r' (q_{t,r}.k_{s,r'}) v_{s,r'}
//             + gamma_t sum_r' (q_{t,r}.k_{t,r'}) v_{t,r'}
//   Sh_out = exp(Acs_last) Sh_in + sum_s exp(Acs_last - Acs_s) w_s sum_r' v_{s,r'} k_{s,r'}^T
// where Sh_{-1} = S_init + Delta_0 (1 - lambda_0) sum_r v_prev,r k_prev,r^T. The backward recomputes the per-token
// quantities, rotated q/k and the chunk states unless the forward kept them (Mamba3ScanSaved, SSD route); every
// reduction is ordered (no atomics).
//
// SISO (R = 1) is the Mamba-2 SSD of ssm/mamba2/ssd.hpp with per-token decay exponent A_t Delta_t, weight w_t,
// x = v (read where it lies: SSDIn::x) and, per head (ngroups = nheads), B = k~, C = q~ (SSDIn::log_decay /
// weight), plus the diagonal's correction as a per-token skip coefficient (SSDIn::D_token)
//   y_t += (gamma_t - w_t) (q~_t . k~_t) v_t
// and Sh_{-1} as the SSD's initial state; Mamba3ScanShape::algo chooses between this file's kernels (portable) and
// that route (gemm, fused: the SSD's GEMM formulation or tensor-core kernels, under `compute`).
#pragma once

#include <string>

#include "core/kokkos_types.hpp"
#include "layers/conv1d.hpp"  // SeqIdxView
#include "ssm/mamba2/ssd.hpp"

namespace mm {

enum class RopePairing { interleaved, halved };

struct Mamba3ScanShape {
  index_t batch = 1, seqlen = 0, nheads = 1, headdim = 1, ngroups = 1, dstate = 2, rank = 1;
  index_t nangles = 0;  // S rotary angles (pairs of state dimensions)
  index_t chunk = 64;
  RopePairing pairing = RopePairing::interleaved;
  double A_floor = 1e-4;
  // How the chunked scan is computed: portable = this file's kernels (every rank); gemm / fused = SISO through the
  // SSD kernels (ssd.hpp) under `compute`; automatic = the SSD route on CUDA for SISO (gemm, or fused when compute
  // is bf16, as ssd_resolved_algo), portable elsewhere. MIMO (rank > 1) always runs the portable kernels.
  SSDAlgo algo = SSDAlgo::automatic;
  GemmCompute compute = GemmCompute::fp32;
  index_t nchunks() const { return (seqlen + chunk - 1) / chunk; }
  // The SSD route applies: SISO with gemm or fused, or with automatic on CUDA.
  bool via_ssd() const;
  void validate(const char* where) const;
};

// The decode carry. All views empty = a zero carry. Only (batch, nheads, ...) extents are used.
template <class P>
struct Mamba3Carry {
  View3<P> phi;  // (batch, H, S)     cumulative rotary phase of the last token
  View4<P> S;    // (batch, H, P, N)  state after the last token
  View4<P> k;    // (batch, H, R, N)  rotated, biased k of the last token
  View4<P> v;    // (batch, H, R, P)  v of the last token
  bool empty() const { return S.extent(0) == 0; }
  static Mamba3Carry allocate(const std::string& label, const Mamba3ScanShape& s) {
    Mamba3Carry c;
    c.phi = View3<P>(label + "::phi", s.batch, s.nheads, s.nangles);
    c.S = View4<P>(label + "::S", s.batch, s.nheads, s.headdim, s.dstate);
    c.k = View4<P>(label + "::k", s.batch, s.nheads, s.rank, s.dstate);
    c.v = View4<P>(label + "::v", s.batch, s.nheads, s.rank, s.headdim);
    return c;
  }
};

// Inputs are column windows of row-major matrices with rows b * L + t (the mixer passes its in_proj output).
template <class T>
struct Mamba3ScanIn {
  View2<const T> v;  // v_{t,h,r,p} at column v_col + (h R + r) P + p
  index_t v_col = 0;
  View2<const T> qk;  // q (normalised C) at q_col + (r G + g) N + n; k (normalised B) at k_col + (r G + g) N + n
  index_t q_col = 0, k_col = 0;
  View2<const T> dd;  // dd_dt at dt_col + h, dd_A at A_col + h, trap at trap_col + h, angles at angle_col + i
  index_t dt_col = 0, A_col = 0, trap_col = 0, angle_col = 0;
  View1<const acc_t<T>> dt_bias, D;       // (H)
  View1<const acc_t<T>> q_bias, k_bias;   // (H, R, N) flattened
  Mamba3Carry<acc_t<T>> init;             // optional initial carry
  SeqIdxView seq_idx;                     // (batch, seqlen) record ids, or empty (one record per row)
};

template <class T>
struct Mamba3ScanGrad {
  View2<T> dv;   // written at the columns of v
  View2<T> dqk;  // written at the columns of q and k
  View2<T> ddd;  // written at the columns of dd_dt, dd_A, trap and angles
  View1<acc_t<T>> ddt_bias, dD, dq_bias, dk_bias;  // accumulated (+=)
  Mamba3Carry<acc_t<T>> dinit;                     // written when non-empty
  // dv and ddd hold the input's column c at c - col0: buffers that leave out the columns before the first they
  // are written at (dv's and ddd's widths then are those of v and dd less col0)
  index_t col0 = 0;
};

// What the forward of the SSD route (via_ssd) can keep so that the backward does not form it again: the per-token
// quantities Delta, lambda, A_t, w_t, A_t Delta_t (batch, H, L), the phases (batch, H, L, S), [k~ | q~] per head
// (batch L, 2 H N; the SSD reads v, its x, out of the input) with q~ . k~ per (row, head), and the SSD's own
// SSDSaved (the chunk states and C B^T, with one group per head). The backward then skips the per-token pass, the
// phases, the rotation and the SSD's recomputation. The planner counts these with the layer's activations
// (parallel/planner.cpp, mem_mamba3).
template <class T>
struct Mamba3ScanSaved {
  View3<acc_t<T>> delta, lam, Av, w, ad;
  View4<acc_t<T>> phi;
  View2<acc_t<T>> qkv, qkd;
  View2<bf16_op_t> qkv16;  // [k~ | q~] in bf16 in place of qkv (then empty) where the forward stored them so
  SSDSaved<T> ssd;
  bool empty() const { return qkv.extent(0) == 0 && qkv16.extent(0) == 0; }
};

// y (batch * seqlen, H * R * P) is written; the final carry is written when non-empty. The final carry may be
// the same views as the initial carry (it is written after the initial one has been read). With `keep` (and the
// SSD route) the intermediates are left in *keep, their blocks taken from `pool` (live as long as it is);
// otherwise *keep is left empty.
template <class T>
void mamba3_scan_forward(const Mamba3ScanShape& s, const Mamba3ScanIn<T>& in, const View2<T>& y,
                         const Mamba3Carry<acc_t<T>>& final_carry, Mamba3ScanSaved<T>* keep = nullptr,
                         PoolScope* pool = nullptr);

// The rotation backward of the SISO scan on quads (float, rank 1): automatic takes the native CUDA kernel
// (rotate_cuda.hpp) where it applies, kokkos the Kokkos form (its reference; also every other build). Tests and
// the benchmark set it; nothing else changes it.
enum class RotBwdForm { automatic, kokkos };
extern RotBwdForm rot_bwd_form;
// The same for the rotation forward on quads (mamba3_cuda::rotate_fwd, or the Kokkos form).
enum class RotFwdForm { automatic, kokkos };
extern RotFwdForm rot_fwd_form;

// How the SSD route's rotation stores q~ and k~ (the SSD's C and B, per head): automatic in bf16 where
// mamba3_qk_bf16 holds (half the bytes written, kept and read back by the SSD's kernels, which round them to bf16,
// or to tf32, for their products anyway), fp32 (the form before; every other case). Tests and the benchmark set
// it; nothing else changes it.
enum class QkStore { automatic, fp32 };
extern QkStore qk_store;

// Whether the SSD route of this shape stores q~ and k~ in bf16 under qk_store = automatic: float activations, SISO
// through the fused SSD under bf16 arithmetic with the kernels that read them so (ssd_bc_in_bf16_applies) and the
// dq~, dk~ in bf16 (ssd_bc_bf16_applies), d_state a multiple of 8, and the quad kernels' 16-byte rows (`rows_ok`,
// the caller's check of its input rows and column offsets). The forward stores them so (and keeps them, where it
// keeps its context); a backward from that kept context reads them, one that recomputes stores fp32 (the SSD's
// recomputation reads fp32 B and C).
bool mamba3_qk_bf16(const Mamba3ScanShape& s, bool float_acts, bool rows_ok);

// The SSD's shape for the SISO route: one group per head (q~ and k~ are per head: biases, phases).
SSDShape mamba3_ssd_shape(const Mamba3ScanShape& s);

// dy (batch * seqlen, H * R * P); dfinal: gradient of the final carry, or empty. `kept`: what mamba3_scan_forward
// kept for the same shape, inputs and initial carry (or null / empty: recomputed). It is only read, so several
// backwards (context parallel: one per stage) can use it.
template <class T>
void mamba3_scan_backward(const Mamba3ScanShape& s, const Mamba3ScanIn<T>& in, const View2<const T>& dy,
                          const Mamba3Carry<acc_t<T>>& dfinal, const Mamba3ScanGrad<T>& g,
                          const Mamba3ScanSaved<T>* kept = nullptr);

}  // namespace mm
