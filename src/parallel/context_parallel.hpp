// Context parallelism by state passing: the pieces every mixer uses (see /work/shared/docs/CONTEXT_PARALLEL.md).
//
// The cp ranks of a communicator each hold a contiguous slice of every sequence: with batch rows b and global length
// L = cp * Lr, rank c holds tokens [c * Lr, (c + 1) * Lr) of every row as a (batch * Lr, ...) matrix (row b * Lr + t).
// Record ids (seq_idx) are global, so a record may span ranks; a state carried into a slice belongs to the record
// of the slice's first token (the `init` state semantics of the mixers).
//
//   * conv halo: the causal depthwise conv of width W needs the W - 1 conv inputs before the slice, which are the
//     last W - 1 rows of the left neighbour (one sendrecv to the right; rank 0 gets zeros). Entries of another
//     record than the slice's first token are zeroed (a record boundary at or just before the slice start). In the
//     backward the gradient of those W - 1 inputs goes back to the left neighbour and is added to its d(input).
//   * state scan: the pairs (g, S) (total decay of a slice, state after the slice from a zero start) combine as
//     (g1, S1) o (g2, S2) = (g1 g2, g2 S1 + S2); an all-gather of the pairs and a fold in rank order gives every
//     rank its incoming state (exclusive scan), and the mirrored fold from the right its outgoing-state gradient.
//
// Every function here is collective over `cp` (call it on every rank of it). The traffic does not depend on the
// sequence length: a halo is batch * (W - 1) * channels values, a pair batch * (decays + states) values.
#pragma once

#include <algorithm>
#include <cstdint>

#include <vector>

#include "core/kokkos_types.hpp"
#include "core/pool.hpp"
#include "layers/conv1d.hpp"
#include "parallel/comm.hpp"

namespace mm::parallel {

// What a cp rank keeps of its forward conv-halo exchange for the backward.
template <class T>
struct CpConvHalo {
  View3<T> prefix;        // (batch, channels, W - 1): the conv prefix of this slice (rank 0: zeros), masked
  View2<T> mask;          // (batch, W - 1): 1 where the prefix entry belongs to the record of this slice's token 0
  std::vector<int> cont;  // per batch row: 1 when token 0 continues the left neighbour's last record (rank 0: 0)
};

// The halo of the conv inputs at columns [col, col + channels) of x (batch * seqlen rows). Needs seqlen >= W - 1
// when cp has more than one rank (mm::Error naming the values otherwise). Sends batch * (W - 1) * channels values
// of T to the right neighbour, and, when seq is not empty, batch * max(W - 1, 1) record ids (int64) too.
template <class T>
CpConvHalo<T> cp_conv_halo_forward(const Comm& cp, const View2<const T>& x, index_t col, index_t channels,
                                   index_t batch, index_t seqlen, index_t W, const SeqIdxView& seq);

// Bytes this rank sends for one conv halo, forward and backward: the halo to the right neighbour and its gradient
// back to the left one (batch * (W - 1) * channels values of elem_bytes each way), plus the record ids with it.
inline std::uint64_t cp_conv_halo_bytes(const Comm& cp, index_t batch, index_t W, index_t channels,
                                        std::size_t elem_bytes, bool with_seq_idx) {
  const bool right = cp.rank() + 1 < cp.size(), left = cp.rank() > 0;
  const std::uint64_t B = std::uint64_t(batch), W1 = std::uint64_t(W - 1);
  std::uint64_t bytes = B * W1 * std::uint64_t(channels) * elem_bytes * ((right ? 1 : 0) + (left ? 1 : 0));
  if (with_seq_idx && right) bytes += B * std::max<std::uint64_t>(W1, 1) * 8;
  return bytes;
}

// Per batch row: cont = 1 when this slice's token 0 continues the left neighbour's last record (rank 0: 0), and
// whole = 1 when no record starts inside the slice after token 0. Sends batch record ids (int64) to the right
// neighbour when seq is not empty (nothing otherwise).
struct CpRecords {
  std::vector<int> cont, whole;
};
CpRecords cp_record_continuity(const Comm& cp, const SeqIdxView& seq, index_t batch, index_t seqlen);

// The gradient of the conv prefix (batch, channels, W - 1) of conv1d_silu_forward(in, w, bias, seq) given the
// gradient dy of its output, times `mask` (batch, W - 1).
template <class T>
void conv1d_silu_prefix_grad(const Conv1dIn<T>& in, const View2<const acc_t<T>>& w,
                             const View1<const acc_t<T>>& bias, const SeqIdxView& seq, const View2<const T>& dy,
                             const View2<const T>& mask, const View3<T>& dprefix);

// Sends dprefix to the left neighbour (none on rank 0) and adds what the right neighbour sends into rows
// seqlen - (W - 1) + k, columns [dx_col, dx_col + channels) of dx (nothing on the last rank). Sends
// batch * (W - 1) * channels values of T (ranks > 0).
template <class T>
void cp_conv_halo_backward(const Comm& cp, const View3<const T>& dprefix, const UView2<T>& dx, index_t dx_col,
                           index_t batch, index_t seqlen);

// Exclusive scan over the ranks of the pairs (g, S): returns the S part of (pair_0 o ... o pair_{r-1}) on rank r
// (zero on rank 0). g has m entries, S has m * block; S[i] decays with g[i / block]. One allgather of
// m * (1 + block) values per rank (device buffers under NCCL); the fold runs on the device in rank order (the same
// on every rank, deterministic). With `ws` the buffers and the result are taken from it (the result lives as long
// as the scope), else allocated.
template <class P>
View1<P> cp_state_scan_forward(const Comm& cp, const View1<const P>& g, const View1<const P>& S, index_t block,
                               PoolScope* ws = nullptr);

// The mirror for the backward: D = 0; for q = size - 1 down to r + 1: D = g_q D + S_q (zero on the last rank).
template <class P>
View1<P> cp_state_scan_backward(const Comm& cp, const View1<const P>& g, const View1<const P>& S, index_t block,
                                PoolScope* ws = nullptr);

}  // namespace mm::parallel
