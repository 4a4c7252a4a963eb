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

// Name of the backend that serves gemm<T> in this build (for logs and benchmark tables).
const char* gemm_backend_name();

}  // namespace mm
