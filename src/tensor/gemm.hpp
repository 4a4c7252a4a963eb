// GEMM dispatch layer: C = alpha * op(A) * op(B) + beta * C on row-major 2-D views of the default memory space.
//
//   host builds (OpenMP/Serial): KokkosBlas::gemm, which calls the BLAS TPL (OpenBLAS here) for float/double;
//   CUDA builds: cuBLAS on the default execution space's stream; bf16 operands use cublasGemmEx with fp32
//   accumulation (CUBLAS_COMPUTE_32F), float uses fp32 compute, double uses cublasDgemm.
//
// The overloads are non-templates so that any contiguous row-major View2 (managed or unmanaged) converts
// implicitly.
#pragma once

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

// Name of the backend that serves gemm<T> in this build (for logs and benchmark tables).
const char* gemm_backend_name();

}  // namespace mm
