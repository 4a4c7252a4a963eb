// SwiGLU experts over grouped GEMMs, and the dispatch kernels that move tokens into and out of expert order.
//
// Expert g (of G) is a SwiGLU feed-forward on the rows [off[g], off[g+1]) of the permuted buffer xp:
//
//   h1 = xp W1_g^T,   h3 = xp W3_g^T   (W1_g, W3_g: (F, d))
//   a  = silu(h1) * h3
//   y  = a W2_g^T                      (W2_g: (d, F))
//
// The weights of all experts are stacked: W1, W3 (G, F, d), W2 (G, d, F), contiguous. The always-on shared
// expert is the same computation with G = 1 and off = {0, n}.
//
// All GEMMs go through grouped_gemm / grouped_gemm_wgrad, so a CUDA grouped kernel (cuBLAS grouped batched GEMM
// or a CUTLASS grouped GEMM) can replace the per-group loop without touching the callers. Today each group is one
// call of the GEMM dispatch (src/tensor/gemm.hpp) on sub-views; empty groups are skipped.
#pragma once

#include <cstdint>
#include <vector>

#include "core/kokkos_types.hpp"
#include "core/pool.hpp"
#include "tensor/gemm.hpp"

namespace mm {

// For every group g: C[rows_g] = alpha * A[rows_g] op(W_g) + beta * C[rows_g], W_g = W + g * wr * wc of shape
// (wr, wc); rows_g = [off[g], off[g+1]).
template <class T>
void grouped_gemm(Trans tw, acc_t<T> alpha, const View2<const T>& A, const T* W, index_t wr, index_t wc,
                  acc_t<T> beta, const View2<T>& C, const std::vector<index_t>& off);

// For every group g: dW_g = alpha * A[rows_g]^T B[rows_g] + beta * dW_g, dW_g = dW + g * A.cols * B.cols.
template <class T>
void grouped_gemm_wgrad(acc_t<T> alpha, const View2<const T>& A, const View2<const T>& B, acc_t<T> beta, T* dW,
                        const std::vector<index_t>& off);

template <class T>
struct SwiGLUWeights {
  const T* w1 = nullptr;  // (G, F, d)
  const T* w3 = nullptr;  // (G, F, d)
  const T* w2 = nullptr;  // (G, d, F)
  index_t d = 0, F = 0;
};

template <class T>
struct SwiGLUGrads {
  T* w1 = nullptr;
  T* w3 = nullptr;
  T* w2 = nullptr;
};

template <class T>
struct SwiGLUActs {
  View2<T> h1, h3, a;  // (m, F)
  bool empty() const { return h1.extent(0) == 0 && h1.data() == nullptr; }
};

// y (m, d) = expert outputs of xp (m, d); acts receives h1, h3, a (taken from `ws` when given, else allocated).
template <class T>
void swiglu_experts_forward(const SwiGLUWeights<T>& w, const View2<const T>& xp, const std::vector<index_t>& off,
                            SwiGLUActs<T>& acts, const View2<T>& y, PoolScope* ws = nullptr);

// dxp (m, d) = (accumulate ? dxp : 0) + d/dxp; weight gradients accumulated into g.
template <class T>
void swiglu_experts_backward(const SwiGLUWeights<T>& w, const View2<const T>& xp, const SwiGLUActs<T>& acts,
                             const View2<const T>& dy, const std::vector<index_t>& off, const View2<T>& dxp,
                             bool accumulate, const SwiGLUGrads<T>& g);

// ---------------------------------------------------------------- dispatch

// xp[r] = x[perm_token[r]]
template <class T>
void moe_permute(const View2<const T>& x, const View1<const index_t>& perm_token, const View2<T>& xp);

// out[x] = (accumulate ? out[x] : 0) + sum_j gate(x, j) * y[row(x, j)], slots in increasing order, dropped slots
// (row -1) skipped. A gather per token: fixed order, no atomics.
template <class T>
void moe_unpermute_combine(const View2<const T>& y, const View2<const index_t>& row,
                           const View2<const acc_t<T>>& gate, const View2<T>& out, bool accumulate);

// Backward of the combine: dy[r] = gate(tok, slot) * dout[tok]; dgate(x, j) = dout[x] . y[row(x, j)] (0 if dropped).
template <class T>
void moe_combine_backward(const View2<const T>& dout, const View2<const T>& y, const View2<const index_t>& row,
                          const View2<const acc_t<T>>& gate, const View1<const index_t>& perm_token,
                          const View1<const std::int32_t>& perm_slot, const View2<T>& dy,
                          const View2<acc_t<T>>& dgate);

// Backward of the permute: dx[x] = (accumulate ? dx[x] : 0) + sum_j dxp[row(x, j)], slots in increasing order.
template <class T>
void moe_permute_backward(const View2<const T>& dxp, const View2<const index_t>& row, const View2<T>& dx,
                          bool accumulate);

}  // namespace mm
