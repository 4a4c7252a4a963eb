#include "tensor/gemm.hpp"

#include "core/error.hpp"

#if defined(KOKKOS_ENABLE_CUDA)
#include <cublas_v2.h>
#include <cuda_runtime.h>
#else
#include <KokkosBlas3_gemm.hpp>
#endif

namespace mm {

namespace {

struct Shape {
  index_t m, n, k;
};

template <class A, class B, class C>
Shape check_shapes(Trans ta, Trans tb, const A& a, const B& b, const C& c) {
  const index_t m = ta == Trans::N ? a.extent(0) : a.extent(1);
  const index_t k = ta == Trans::N ? a.extent(1) : a.extent(0);
  const index_t kb = tb == Trans::N ? b.extent(0) : b.extent(1);
  const index_t n = tb == Trans::N ? b.extent(1) : b.extent(0);
  require(k == kb && index_t(c.extent(0)) == m && index_t(c.extent(1)) == n, "gemm",
          "shapes do not match: op(A) is ", m, "x", k, ", op(B) is ", kb, "x", n, ", C is ", c.extent(0), "x",
          c.extent(1));
  return {m, n, k};
}

#if defined(KOKKOS_ENABLE_CUDA)

const char* cublas_status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "cuBLAS error";
  }
}

void check(cublasStatus_t s, const char* what) {
  require(s == CUBLAS_STATUS_SUCCESS, "cuBLAS", what, " failed: ", cublas_status_name(s));
}

// One handle per process, bound to the default execution space's stream at every call.
cublasHandle_t handle() {
  static cublasHandle_t h = [] {
    cublasHandle_t x;
    check(cublasCreate(&x), "cublasCreate");
    return x;
  }();
  check(cublasSetStream(h, Exec().cuda_stream()), "cublasSetStream");
  return h;
}

cublasOperation_t op(Trans t) { return t == Trans::N ? CUBLAS_OP_N : CUBLAS_OP_T; }

// Row-major C(m,n) = op(A) op(B) is column-major C^T(n,m) = op(B)^T op(A)^T: call cuBLAS with the operands
// swapped and the same transpose flags; leading dimensions are the row strides.
template <class T, class S>
void gemm_cublas(Trans ta, Trans tb, S alpha, GemmIn<T> A, GemmIn<T> B, S beta, GemmOut<T> C,
                 cudaDataType_t dtype, cublasComputeType_t compute) {
  const Shape s = check_shapes(ta, tb, A, B, C);
  if (s.m == 0 || s.n == 0) return;
  require(s.m < (1ll << 31) && s.n < (1ll << 31) && s.k < (1ll << 31), "gemm", "dimension exceeds int32");
  check(cublasGemmEx(handle(), op(tb), op(ta), int(s.n), int(s.m), int(s.k), &alpha, B.data(), dtype,
                     int(B.stride(0)), A.data(), dtype, int(A.stride(0)), &beta, C.data(), dtype, int(C.stride(0)),
                     compute, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx");
}

#else

template <class T>
void gemm_kokkosblas(Trans ta, Trans tb, T alpha, GemmIn<T> A, GemmIn<T> B, T beta, GemmOut<T> C) {
  const Shape s = check_shapes(ta, tb, A, B, C);
  if (s.m == 0 || s.n == 0) return;
  if (s.k == 0) {  // C = beta C (BLAS may reject k = 0 leading dimensions)
    par_for("gemm::scale_k0", s.m, s.n, KOKKOS_LAMBDA(index_t i, index_t j) { C(i, j) *= beta; });
    return;
  }
  KokkosBlas::gemm(ta == Trans::N ? "N" : "T", tb == Trans::N ? "N" : "T", alpha, A, B, beta, C);
}

#endif

}  // namespace

#if defined(KOKKOS_ENABLE_CUDA)
void gemm(Trans ta, Trans tb, float alpha, GemmIn<float> A, GemmIn<float> B, float beta, GemmOut<float> C) {
  gemm_cublas<float>(ta, tb, alpha, A, B, beta, C, CUDA_R_32F, CUBLAS_COMPUTE_32F);
}
void gemm(Trans ta, Trans tb, double alpha, GemmIn<double> A, GemmIn<double> B, double beta,
          GemmOut<double> C) {
  gemm_cublas<double>(ta, tb, alpha, A, B, beta, C, CUDA_R_64F, CUBLAS_COMPUTE_64F);
}
void gemm(Trans ta, Trans tb, float alpha, GemmIn<bf16> A, GemmIn<bf16> B, float beta, GemmOut<bf16> C) {
  gemm_cublas<bf16>(ta, tb, alpha, A, B, beta, C, CUDA_R_16BF, CUBLAS_COMPUTE_32F);
}
const char* gemm_backend_name() { return "cuBLAS (bf16: cublasGemmEx, CUBLAS_COMPUTE_32F)"; }
#else
void gemm(Trans ta, Trans tb, float alpha, GemmIn<float> A, GemmIn<float> B, float beta, GemmOut<float> C) {
  gemm_kokkosblas<float>(ta, tb, alpha, A, B, beta, C);
}
void gemm(Trans ta, Trans tb, double alpha, GemmIn<double> A, GemmIn<double> B, double beta,
          GemmOut<double> C) {
  gemm_kokkosblas<double>(ta, tb, alpha, A, B, beta, C);
}
const char* gemm_backend_name() { return "KokkosBlas::gemm (host BLAS TPL)"; }
#endif

}  // namespace mm
