// Causal depthwise conv1d over the sequence, followed by SiLU (mamba_ssm's causal_conv1d_fn, activation "silu").
//
//   pre(t, c) = bias(c) + sum_{k<W} w(c, k) * x(t - (W-1) + k, c),   y = silu(pre)
//
// Tokens are rows b * L + t of 2-D matrices. x(s, c) counts only when s >= 0 and seq_idx(b, s) == seq_idx(b, t),
// so packed records never see each other (the conv_state of a fresh record is zero).
//
// Decode / windowed processing: an optional `prefix` (batch, channels, W-1) holds the W-1 inputs that precede
// token 0 (the previous window's last inputs, mamba_ssm's conv_state); it belongs to the record of token 0.
// conv1d_state_out gives the prefix of the next window, conv1d_silu_step advances one token.
#pragma once

#include "core/kokkos_types.hpp"
#include "tensor/gemm.hpp"

namespace mm {

using SeqIdxView = Kokkos::View<const std::int32_t**, Layout, Mem>;  // (batch, seqlen); empty: one record

// Widest conv the kernels take (the backward keeps a row's W weight-gradient terms in registers); mamba_ssm's
// causal-conv1d takes 2 to 4.
inline constexpr index_t kMaxConvWidth = 8;

// Tokens of one batch row per work item of the kernels; the backward keeps partial sums of dw and dbias per run.
inline constexpr index_t kConvRun = 64;

template <class T>
struct Conv1dIn {
  View2<const T> x;  // (batch * seqlen, >= col + channels)
  index_t col = 0;    // first input column
  index_t batch = 0, seqlen = 0, channels = 0;
  View3<const T> prefix;  // (batch, channels, W-1): inputs before token 0, oldest first; empty: zeros
};

// w (channels, W), bias (channels), y (batch * seqlen, channels).
template <class T>
void conv1d_silu_forward(const Conv1dIn<T>& in, const View2<const acc_t<T>>& w, const View1<const acc_t<T>>& bias,
                         const SeqIdxView& seq_idx, const View2<T>& y);

// dx is written (not accumulated) into columns [dx_col, dx_col + channels) of dx; dw, dbias are accumulated.
template <class T>
void conv1d_silu_backward(const Conv1dIn<T>& in, const View2<const acc_t<T>>& w, const View1<const acc_t<T>>& bias,
                          const SeqIdxView& seq_idx, const View2<const T>& dy, const UView2<T>& dx, index_t dx_col,
                          const View2<acc_t<T>>& dw, const View1<acc_t<T>>& dbias);

// The float backward with dx written as a bf16 copy (the input gradient of a GEMM on bf16 operands: the Mamba-2
// in_proj under bf16 GEMMs; host builds: bf16-rounded floats). Everything else as conv1d_silu_backward.
void conv1d_silu_backward_bf16dx(const Conv1dIn<float>& in, const View2<const float>& w, const View1<const float>& bias,
                                 const SeqIdxView& seq_idx, const View2<const float>& dy, const UView2<bf16_op_t>& dx,
                                 index_t dx_col, const View2<float>& dw, const View1<float>& dbias);

// The prefix of the next window: state(b, c, k) = input at position seqlen - (W-1) + k (from in.prefix where that
// is negative), zero where it belongs to an older record than the last token. state may be in.prefix itself.
template <class T>
void conv1d_state_out(const Conv1dIn<T>& in, index_t W, const SeqIdxView& seq_idx, const View3<T>& state);

// One token per batch row: x (batch, >= col + channels) at column col; state (batch, channels, W-1) is shifted in
// place; y (batch, channels) = silu(bias + sum_k w(c, k) [state | x](k)).
template <class T>
void conv1d_silu_step(const View2<const T>& x, index_t col, const View2<const acc_t<T>>& w,
                      const View1<const acc_t<T>>& bias, const View3<T>& state, const View2<T>& y);

}  // namespace mm
