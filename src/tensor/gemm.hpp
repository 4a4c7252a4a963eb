// GEMM dispatch layer: C = alpha * op(A) * op(B) + beta * C on row-major 2-D views of the default memory space.
//
//   host builds (OpenMP/Serial): KokkosBlas::gemm, which calls the BLAS TPL (OpenBLAS here) for float/double;
//   CUDA builds: cuBLAS on the default execution space's stream; bf16 operands use cublasGemmEx with fp32
//   accumulation (CUBLAS_COMPUTE_32F), float uses fp32 compute, double uses cublasDgemm.
//
// The overloads are non-templates so that any contiguous row-major View2 (managed or unmanaged) converts
// implicitly.
#pragma once

#include <cstdint>
#include <string>

#include "core/kokkos_types.hpp"

namespace mm {

enum class Trans { N, T };

template <class T>
using GemmIn = UView2<const T>;
template <class T>
using GemmOut = UView2<T>;

void gemm(Trans ta, Trans tb, float alpha, GemmIn<float> A, GemmIn<float> B, float beta, GemmOut<float> C);
void gemm(Trans ta, Trans tb, double alpha, GemmIn<double> A, GemmIn<double> B, double beta, GemmOut<double> C);
#if defined(KOKKOS_ENABLE_CUDA)
void gemm(Trans ta, Trans tb, float alpha, GemmIn<bf16> A, GemmIn<bf16> B, float beta, GemmOut<bf16> C);
#endif

// Arithmetic of a float GEMM on CUDA: fp32 (CUDA cores, exact fp32), tf32 or bf16 (tensor cores: operands
// rounded to tf32 / bf16 inside cuBLAS, fp32 accumulation and output). Host builds and double always compute in
// the operands' own precision.
enum class GemmCompute { fp32, tf32, bf16 };
// "fp32" | "tf32" | "bf16" -> GemmCompute; anything else is an error naming `what` and the valid values.
GemmCompute parse_gemm_compute(const std::string& s, const std::string& what);
const char* gemm_compute_name(GemmCompute c);

// Process-wide arithmetic of the plain float gemm() on CUDA (the layers' weight GEMMs), like PyTorch's
// allow_tf32 switch: fp32 (the default), tf32 or bf16. Ignored by host builds.
void set_float_gemm_compute(GemmCompute c);
GemmCompute float_gemm_compute();

// CUDA: how a float gemm() under GemmCompute::bf16 runs. cast = true (the default): the operands are rounded to
// bf16 copies (blocks of at most block_elems elements each, so the copies stay small next to the activations)
// and cuBLAS runs on native bf16 operands with fp32 output, which takes the Hopper tensor-core kernels; false:
// cuBLAS rounds inside (CUBLAS_COMPUTE_32F_FAST_16BF on the fp32 operands). The arithmetic is the same (operands
// rounded to bf16, fp32 accumulation). Host builds ignore it (float_gemm_bf16_cast() is false there).
void set_float_gemm_bf16_cast(bool cast, index_t block_elems = index_t(1) << 26);
bool float_gemm_bf16_cast();

// The two products of the backward of a linear layer y = x W^T (dy T x O, W O x I, x T x I):
//   dx = dy W + beta_dx dx (skipped when dx has no rows),   dW = dy^T x + beta_dw dW.
// Two gemm() calls, except for float on CUDA under GemmCompute::bf16 with cast on, where each block of dy's rows
// is rounded to bf16 once for both products.
void linear_backward_gemms(GemmIn<float> dy, GemmIn<float> W, GemmIn<float> x, float beta_dx, GemmOut<float> dx,
                           float beta_dw, GemmOut<float> dW);
void linear_backward_gemms(GemmIn<double> dy, GemmIn<double> W, GemmIn<double> x, double beta_dx,
                           GemmOut<double> dx, double beta_dw, GemmOut<double> dW);

// The float GEMM arithmetic set to `c` for the scope's lifetime, the previous one restored after (the MoE router
// computes its logits in fp32 under any setting).
class FloatGemmComputeScope {
 public:
  explicit FloatGemmComputeScope(GemmCompute c) : prev_(float_gemm_compute()) { set_float_gemm_compute(c); }
  ~FloatGemmComputeScope() { set_float_gemm_compute(prev_); }
  FloatGemmComputeScope(const FloatGemmComputeScope&) = delete;
  FloatGemmComputeScope& operator=(const FloatGemmComputeScope&) = delete;

 private:
  GemmCompute prev_;
};

// A strided batch of row-major GEMMs on raw pointers into the default memory space: for i in [0, count),
//   C_i = alpha op(A_i) op(B_i) + beta C_i,   X_i = X + i * sX,
// op(A_i) m x k, op(B_i) k x n, C_i m x n, leading dimensions (row strides) lda, ldb, ldc. CUDA:
// cublasGemmStridedBatchedEx on the default stream; host: a Kokkos loop (meant for the small chunk GEMMs of the
// scans and for tests, not for large products).
void gemm_strided_batched(Trans ta, Trans tb, index_t m, index_t n, index_t k, float alpha, const float* A,
                          index_t lda, index_t sA, const float* B, index_t ldb, index_t sB, float beta, float* C,
                          index_t ldc, index_t sC, index_t count, GemmCompute compute = GemmCompute::fp32);
void gemm_strided_batched(Trans ta, Trans tb, index_t m, index_t n, index_t k, double alpha, const double* A,
                          index_t lda, index_t sA, const double* B, index_t ldb, index_t sB, double beta,
                          double* C, index_t ldc, index_t sC, index_t count,
                          GemmCompute compute = GemmCompute::fp32);

// A two-level batch of row-major GEMMs: for j in [0, nj) and i in [0, ni),
//   C_ji = alpha op(A_ji) op(B_ji) + beta C_ji,   X_ji = X + j * sXj + i * sXi,
// for operands whose batch entries are not one stride apart (per-head blocks of per-chunk matrices: one call
// instead of one per head). CUDA: one cublasGemmStridedBatchedEx when the two levels flatten into one stride,
// otherwise cublasGemmBatchedEx on pointer arrays built on the device in `pointers` (3 nj ni entries of device
// memory; null: a temporary allocation per call); host: a Kokkos loop.
void gemm_batched_2d(Trans ta, Trans tb, index_t m, index_t n, index_t k, float alpha, const float* A, index_t lda,
                     index_t sAj, index_t sAi, const float* B, index_t ldb, index_t sBj, index_t sBi, float beta,
                     float* C, index_t ldc, index_t sCj, index_t sCi, index_t nj, index_t ni,
                     GemmCompute compute = GemmCompute::fp32, std::uintptr_t* pointers = nullptr);
void gemm_batched_2d(Trans ta, Trans tb, index_t m, index_t n, index_t k, double alpha, const double* A,
                     index_t lda, index_t sAj, index_t sAi, const double* B, index_t ldb, index_t sBj, index_t sBi,
                     double beta, double* C, index_t ldc, index_t sCj, index_t sCi, index_t nj, index_t ni,
                     GemmCompute compute = GemmCompute::fp32, std::uintptr_t* pointers = nullptr);

// ---------------------------------------------------------------- bf16 operands with fp32 accumulation
//
// Storage of bf16 GEMM operands: bf16 on CUDA; on host builds float arrays that hold bf16-rounded values, so that
// a host build runs the same code with the same roundings (operands rounded to bf16, fp32 accumulation, a bf16
// output rounded again) on the host BLAS: the CPU emulation that CI tests.
#if defined(KOKKOS_ENABLE_CUDA)
using bf16_op_t = bf16;
#else
using bf16_op_t = float;
#endif

// Whether float gemm() runs on bf16 copies of its operands (CUDA under GemmCompute::bf16 with the cast on; never on
// host builds). Then a kernel that produces a GEMM's input can write the bf16 copy itself, and the two calls below
// take it in place of their own rounding pass over the input (a read of fp32 and a write of bf16 per GEMM), and a
// copy kept for the backward takes half the memory of the fp32 activation.
bool float_gemm_on_bf16_copies();

// The linear layer's products with the input given as its bf16 copy xb (T x in; host builds: bf16-rounded floats):
//   forward  y = xb W^T (W rounded to bf16 here, fp32 accumulation and output);
//   backward dx = dy W + beta_dx dx (skipped when dx has no rows), dW = dy^T xb + beta_dw dW.
// On CUDA these are the products gemm() / linear_backward_gemms() compute on bf16 copies; host builds run them in
// fp32 on the given values.
void linear_forward_gemm_bf16x(GemmIn<bf16_op_t> xb, GemmIn<float> W, GemmOut<float> y);
void linear_backward_gemms_bf16x(GemmIn<float> dy, GemmIn<float> W, GemmIn<bf16_op_t> xb, float beta_dx,
                                 GemmOut<float> dx, float beta_dw, GemmOut<float> dW);
// The linear backward with the output gradient given as its bf16 copy dyb (T x out): dx = dyb W + beta_dx dx,
// dW = dyb^T x + beta_dw dW (x and W rounded here on CUDA; host builds: fp32 products of the given values).
void linear_backward_gemms_bf16dy(GemmIn<bf16_op_t> dyb, GemmIn<float> W, GemmIn<float> x, float beta_dx,
                                  GemmOut<float> dx, float beta_dw, GemmOut<float> dW);
// ... and with both given as bf16 copies (only W rounded here on CUDA).
void linear_backward_gemms_bf16(GemmIn<bf16_op_t> dyb, GemmIn<float> W, GemmIn<bf16_op_t> xb, float beta_dx,
                                GemmOut<float> dx, float beta_dw, GemmOut<float> dW);

// v rounded to the nearest bf16 (ties to even), as a float; infinities and NaNs unchanged.
KOKKOS_INLINE_FUNCTION float bf16_round(float v) {
  std::uint32_t u = Kokkos::bit_cast<std::uint32_t>(v);
  if ((u & 0x7f800000u) == 0x7f800000u) return v;
  u += 0x7fffu + ((u >> 16) & 1u);
  return Kokkos::bit_cast<float>(u & 0xffff0000u);
}

// float -> bf16 operand storage (round to nearest even) and back.
KOKKOS_INLINE_FUNCTION bf16_op_t to_bf16_op(float v) {
#if defined(KOKKOS_ENABLE_CUDA)
  return bf16_op_t(v);
#else
  return bf16_round(v);
#endif
}
KOKKOS_INLINE_FUNCTION float from_bf16_op(bf16_op_t v) { return float(v); }

// dst(i, col + j) = src(i, j) rounded to bf16 operand storage, for every element of src: the bf16 copy of an fp32
// GEMM input formed after it (a producer's fallback where its kernel cannot write the copy itself).
void round_to_bf16(const char* label, const View2<const float>& src, const UView2<bf16_op_t>& dst, index_t col = 0);
// The same on raw pointers into the default memory space: dst(r, j) = src(r, j) for r < rows, j < cols, rows
// lds and ldd elements apart (a column block of a wider matrix on either side); four values an access where the
// rows allow (fp32 rows 16-byte aligned, bf16 rows 8-byte aligned).
void round_to_bf16(const char* label, const float* src, index_t lds, bf16_op_t* dst, index_t ldd, index_t rows,
                   index_t cols);

// VW values rounded to bf16 operand storage at p: on the device for VW = 4 one 8-byte store (the caller checked
// that p is 8-byte aligned), element by element otherwise.
template <int VW, class P>
KOKKOS_INLINE_FUNCTION void store_bf16_op_vec(bf16_op_t* p, const P (&in)[VW]) {
#if defined(__CUDA_ARCH__)
  constexpr bool packed = VW == 4;
#else
  constexpr bool packed = false;
#endif
  if constexpr (packed) {
    struct alignas(8) Pack {
      bf16_op_t v[4];
    } q;
    for (int k = 0; k < 4; ++k) q.v[k] = to_bf16_op(float(in[k]));
    *reinterpret_cast<Pack*>(p) = q;
  } else {
    for (int k = 0; k < VW; ++k) p[k] = to_bf16_op(float(in[k]));
  }
}

// Whether 4 consecutive values of every row can go as one access from fp32 rows (src, row stride lds: 16-byte
// aligned, float4_rows) to bf16 operand rows (dst, ldd: 8-byte aligned, store_bf16_op_vec's packed store).
inline bool bf16_rows_by_four(const float* src, index_t lds, const bf16_op_t* dst, index_t ldd) {
  return float4_rows({{src, lds}}) && ldd % 4 == 0 && reinterpret_cast<std::uintptr_t>(dst) % 8 == 0;
}

// Row-major C (m x n) = alpha op(A) op(B) + beta C on raw pointers into the default memory space, op(A) m x k,
// op(B) k x n, row strides lda, ldb, ldc (so a column block of a wider matrix is an operand): bf16 operands, fp32
// accumulation. gemm_bf16_f32 writes C in fp32, gemm_bf16_b16 in bf16 (rounded). CUDA: cublasGemmEx (CUDA_R_16BF
// operands, CUBLAS_COMPUTE_32F) on the default stream; host: the host BLAS on the bf16-rounded floats, the bf16
// output rounded after the product.
void gemm_bf16_f32(Trans ta, Trans tb, index_t m, index_t n, index_t k, float alpha, const bf16_op_t* A,
                   index_t lda, const bf16_op_t* B, index_t ldb, float beta, float* C, index_t ldc);
void gemm_bf16_b16(Trans ta, Trans tb, index_t m, index_t n, index_t k, float alpha, const bf16_op_t* A,
                   index_t lda, const bf16_op_t* B, index_t ldb, float beta, bf16_op_t* C, index_t ldc);
// `count` GEMMs of gemm_bf16_f32's form with X_i = X + i sX (strides >= 0; sB = 0 shares B): one cuBLAS call
// (cublasGemmStridedBatchedEx) on CUDA, so that small products fill the GPU together; a loop on host builds.
void gemm_bf16_f32_batched(Trans ta, Trans tb, index_t m, index_t n, index_t k, float alpha, const bf16_op_t* A,
                           index_t lda, index_t sA, const bf16_op_t* B, index_t ldb, index_t sB, float beta,
                           float* C, index_t ldc, index_t sC, index_t count);

// Name of the backend that serves gemm<T> in this build (for logs and benchmark tables).
const char* gemm_backend_name();

}  // namespace mm
