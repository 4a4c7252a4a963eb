// Mamba-1 selective scan (mamba_ssm's selective_scan_fn with delta_softplus = true), forward, backward and the
// one-token decode step: the portable Kokkos implementation.
//
// Per batch row b, channel d (group g = d / (E/G)) and state n:
//   Delta_t = softplus(delta_t + delta_bias_d)
//   h_t,n   = exp(Delta_t A_d,n) h_{t-1},n [same record as t-1] + Delta_t B_t,g,n u_t        h_{-1} = init (or 0)
//   y_t     = sum_n C_t,g,n h_t,n + D_d u_t
//   out_t   = y_t silu(z_t)                 (without z: out_t = y_t)
// The state is reset at a record boundary of seq_idx; the initial state belongs to the record of the first token.
//
// Parallel over (batch, channel); the time recurrence runs inside each work item with the N states. The forward
// stores the state entering every chunk of `chunk` tokens (checkpoints); the backward reruns the forward inside a
// chunk from its checkpoint, then runs the reverse scan for dh through the chunk. The results do not depend on the
// chunk size (it trades checkpoint memory, L / chunk states, for recompute buffers, chunk states).
// dB and dC (sums over the channels of a group) are formed by a second pass parallel over (batch, chunk, group,
// state) that loops over the channels in order; dA, dD and delta_bias are per-(batch, channel) partials summed over
// the batch in order. No atomics: the backward is deterministic.
//
// Inputs are column windows of row-major matrices with rows b * L + t (like SSDIn), so the scan reads u from the
// conv output, z from the in_proj output and B, C from the x_proj output without copies.
#pragma once

#include "core/kokkos_types.hpp"
#include "core/pool.hpp"
#include "layers/conv1d.hpp"  // SeqIdxView

namespace mm {

struct SelScanShape {
  index_t batch = 1, seqlen = 0, dinner = 1, ngroups = 1, dstate = 1, chunk = 256;
  // The backward forms dB and dC as parts over blocks of 32 channels (16 on the native CUDA backward), as many at a
  // time as this many bytes hold.
  double bc_parts_bytes = double(256ull << 20);
  // Let the forward take the native CUDA kernel (ssm/mamba1/scan_cuda.hpp) where it fits; false: always the
  // portable passes (to compare the two).
  bool native = true;
  // Which variant of the native kernel (mamba1_cuda::variant_name; 0: the default). For measurements.
  int native_variant = 0;
  // Let the backward's chunk passes take the native CUDA kernels (mamba1_cuda::backward_local / backward_chunk)
  // where they fit, dB and dC included (fwd+bwd 4.35x faster than with the portable passes on an H200,
  // perf/RESULTS.md); false: always the portable passes (to compare the two).
  bool native_backward = true;
  index_t nchunks() const { return (seqlen + chunk - 1) / chunk; }
  void validate(const char* where) const;
};

template <class T>
struct SelScanIn {
  View2<const T> u;       // u_t,d at column u_col + d
  index_t u_col = 0;
  View2<const T> delta;   // raw delta (before delta_bias and softplus) at column delta_col + d
  index_t delta_col = 0;
  View2<const T> bc;      // B at column b_col + g * N + n, C at column c_col + g * N + n
  index_t b_col = 0, c_col = 0;
  View2<const T> z;       // gate at column z_col + d; empty: no gating
  index_t z_col = 0;
  View2<const acc_t<T>> A;              // (E, N), real (A = -exp(A_log) in the mixer)
  View1<const acc_t<T>> D, delta_bias;  // (E)
  SeqIdxView seq_idx;                   // (batch, seqlen) or empty
  View3<const acc_t<T>> init_state;     // (batch, E, N) or empty (zero)
};

template <class T>
struct SelScanGrad {
  View2<T> du;      // written at column du_col + d
  index_t du_col = 0;
  View2<T> ddelta;  // d(raw delta) written at column ddelta_col + d
  index_t ddelta_col = 0;
  View2<T> dbc;     // dB and dC written (not accumulated) at the input's b_col / c_col columns
  View2<T> dz;      // written at column dz_col + d when the input has z
  index_t dz_col = 0;
  View2<acc_t<T>> dA;                // (E, N), accumulated (+=)
  View1<acc_t<T>> dD, ddelta_bias;   // (E), accumulated (+=)
  View3<acc_t<T>> dinit_state;       // (batch, E, N), written when non-empty
};

// Checkpoints saved by the forward for the backward: the state entering each chunk, (nchunks, N, batch * E);
// taken from `ws` when given (core/pool.hpp), else allocated.
template <class T>
View3<acc_t<T>> selective_scan_alloc_checkpoints(const SelScanShape& s, PoolScope* ws = nullptr);

// out (batch * seqlen, E) is written; final_state (batch, E, N) is written when non-empty and may be the same view
// as in.init_state (the state carried in place); checkpoints are written when non-empty.
template <class T>
void selective_scan_forward(const SelScanShape& s, const SelScanIn<T>& in, const View2<T>& out,
                            const View3<acc_t<T>>& final_state, const View3<acc_t<T>>& checkpoints = {});

// Whether selective_scan_forward runs these inputs through the native CUDA kernel (a CUDA build, fp32 data, d_state
// 8 or 16, d_inner and channels per group multiples of 16, 16-byte aligned column windows, s.native).
template <class T>
bool selective_scan_native_forward(const SelScanShape& s, const SelScanIn<T>& in);

// dout (batch * seqlen, E); dfinal_state (batch, E, N) or empty. `checkpoints` from the forward of the same inputs,
// or empty: then they are recomputed (one extra forward pass).
template <class T>
void selective_scan_backward(const SelScanShape& s, const SelScanIn<T>& in, const View2<const T>& dout,
                             const View3<const acc_t<T>>& dfinal_state, const View3<const acc_t<T>>& checkpoints,
                             const SelScanGrad<T>& g);

// One token per batch row (mamba_ssm's selective_state_update): `s.seqlen` must be 1, the inputs hold `batch`
// rows, `state` (batch, E, N) is advanced in place and out (batch, E) is written. seq_idx and init_state are
// ignored.
template <class T>
void selective_scan_step(const SelScanShape& s, const SelScanIn<T>& in, const View3<acc_t<T>>& state,
                         const View2<T>& out);

}  // namespace mm
