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
  std::shared_ptr<PoolScope> internals;  // owns h1, h3, a when the caller gave no scope (cached blocks)
  bool empty() const { return h1.extent(0) == 0 && h1.data() == nullptr; }
};

// y (m, d) = expert outputs of xp (m, d); acts receives h1, h3, a (taken from `ws` when given, else from a scope of
// their own in acts.internals: no allocation per call either way).
template <class T>
void swiglu_experts_forward(const SwiGLUWeights<T>& w, const View2<const T>& xp, const std::vector<index_t>& off,
                            SwiGLUActs<T>& acts, const View2<T>& y, PoolScope* ws = nullptr);

// dxp (m, d) = (accumulate ? dxp : 0) + d/dxp; weight gradients accumulated into g.
template <class T>
void swiglu_experts_backward(const SwiGLUWeights<T>& w, const View2<const T>& xp, const SwiGLUActs<T>& acts,
                             const View2<const T>& dy, const std::vector<index_t>& off, const View2<T>& dxp,
                             bool accumulate, const SwiGLUGrads<T>& g);

// ---------------------------------------------------------------- bf16 expert path (float layers)
//
// The experts of a float layer whose float GEMM arithmetic is bf16 (set_float_gemm_compute(GemmCompute::bf16),
// the deck's [run] gemm_precision = bf16): bf16 operands and fp32 accumulation throughout, fp32 master weights and
// fp32 weight gradients.
//
//   forward:  W13_g = [W1_g; W3_g] and W2_g converted to bf16 once per forward (swiglu_weights_to_bf16);
//             xp in bf16 (written so by the permute: moe_permute_bf16);
//             h13 = xp W13_g^T    one GEMM per expert, (m_g, 2F), bf16 out
//             a   = silu(h1) h3   one elementwise kernel, bf16 out
//             y   = a W2_g^T      fp32 out (it feeds the fp32 combine)
//   backward: dy in bf16 (written so by the combine's backward: moe_combine_backward_bf16);
//             da = dy W2_g (bf16 out), dW2_g += dy^T a (fp32, beta = 1);
//             dh13 = [da h3 silu'(h1) | da silu(h1)] (bf16, one elementwise kernel);
//             dxp = dh13 W13_g (fp32 out, one GEMM per expert);
//             dW1_g += dh13[:, :F]^T xp, dW3_g += dh13[:, F:]^T xp (fp32, beta = 1).
//
// Storage type bf16_op_t (tensor/gemm.hpp): bf16 on CUDA; bf16-rounded floats on host builds, where the same code
// runs on the host BLAS with the same roundings (the CPU emulation that the tests check).
struct SwiGLUBF16 {
  View1<bf16_op_t> w13;      // (G, 2F, d): W1_g rows, then W3_g rows
  View1<bf16_op_t> w2;       // (G, d, F)
  View2<bf16_op_t> h13, a;   // (m, 2F), (m, F)
};

// acts.w13, acts.w2 = the bf16 weights of the G experts (from `ws` when given, else allocated).
void swiglu_weights_to_bf16(const SwiGLUWeights<float>& w, index_t G, SwiGLUBF16& acts, PoolScope* ws = nullptr);

// y (m, d, fp32) = expert outputs of xp (m, d, bf16); needs acts.w13, acts.w2 (swiglu_weights_to_bf16); acts
// receives h13 and a.
void swiglu_experts_forward_bf16(const SwiGLUWeights<float>& w, const View2<const bf16_op_t>& xp,
                                 const std::vector<index_t>& off, SwiGLUBF16& acts, const View2<float>& y,
                                 PoolScope* ws = nullptr);

// dxp (m, d, fp32) = (accumulate ? dxp : 0) + d/dxp from dy (m, d, bf16); fp32 weight gradients accumulated into g.
void swiglu_experts_backward_bf16(const SwiGLUWeights<float>& w, const View2<const bf16_op_t>& xp,
                                  const SwiGLUBF16& acts, const View2<const bf16_op_t>& dy,
                                  const std::vector<index_t>& off, const View2<float>& dxp, bool accumulate,
                                  const SwiGLUGrads<float>& g);

// For every group g with rows [off[g], off[g+1]): C_g = alpha A_g op(W_g) + beta C_g, A (m, k) and C (m, n) with row
// strides lda and ldc, W_g = W + g wr wc of shape (wr, wc); bf16 operands, C in fp32 (the _b16 form: bf16). Empty
// groups are skipped (C_g has no rows).
void grouped_gemm_bf16_f32(Trans tw, float alpha, const bf16_op_t* A, index_t lda, const bf16_op_t* W, index_t wr,
                           index_t wc, float beta, float* C, index_t ldc, const std::vector<index_t>& off);
void grouped_gemm_bf16_b16(Trans tw, float alpha, const bf16_op_t* A, index_t lda, const bf16_op_t* W, index_t wr,
                           index_t wc, float beta, bf16_op_t* C, index_t ldc, const std::vector<index_t>& off);

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

// bf16 forms for the bf16 expert path: xp[r] = bf16(x[perm_token[r]]), and the combine's backward with dy written
// in bf16 (dgate from the fp32 dout and y as above).
void moe_permute_bf16(const View2<const float>& x, const View1<const index_t>& perm_token,
                      const View2<bf16_op_t>& xp);
void moe_combine_backward_bf16(const View2<const float>& dout, const View2<const float>& y,
                               const View2<const index_t>& row, const View2<const float>& gate,
                               const View1<const index_t>& perm_token, const View1<const std::int32_t>& perm_slot,
                               const View2<bf16_op_t>& dy, const View2<float>& dgate);

// Backward of the permute: dx[x] = (accumulate ? dx[x] : 0) + sum_j dxp[row(x, j)], slots in increasing order.
template <class T>
void moe_permute_backward(const View2<const T>& dxp, const View2<const index_t>& row, const View2<T>& dx,
                          bool accumulate);

// ---------------------------------------------------------------- router products (fp32)

// Native CUDA forms of the router's fp32 products, taken for float layers with E <= 16 experts; each returns false
// (and does nothing) where it does not apply (host backends, other shapes): the caller then uses the GEMM path.
//   logits (n, E) = x (n, d) W^T, W (E, d)
bool router_logits_fp32(const View2<const float>& x, const View2<const float>& W, const View2<float>& logits);
//   dx = (accumulate ? dx : 0) + sum_j dxp[row(x, j)] + dl W   (the permute's backward and the router's, one pass)
//   dW += dl^T x                                               (dW contiguous (E, d); fixed summation order)
bool router_backward_fp32(const View2<const float>& x, const View2<const float>& W, const View2<const float>& dl,
                          const View2<const float>& dxp, const View2<const index_t>& row, const View2<float>& dx,
                          bool accumulate, const View2<float>& dW);

}  // namespace mm
