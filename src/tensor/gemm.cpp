#include "tensor/gemm.hpp"

#include <algorithm>
#include <type_traits>

#include "core/error.hpp"
#include "core/pool.hpp"

#include <Kokkos_Profiling_ScopedRegion.hpp>

#if defined(KOKKOS_ENABLE_CUDA)
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/cuda_launch.hpp"
#else
#include <KokkosBlas3_gemm.hpp>
#include <KokkosKernels_config.h>
#if defined(KOKKOSKERNELS_ENABLE_TPL_BLAS)
#include <KokkosBlas_Host_tpl.hpp>
#endif
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

// cuBLAS and the host BLAS take int sizes, leading dimensions and batch counts.
[[maybe_unused]] void require_int32_dims(const char* what, index_t m, index_t n, index_t k, index_t lda, index_t ldb,
                                         index_t ldc, index_t count) {
  require(std::max({m, n, k, lda, ldb, ldc, count}) < (1ll << 31), what, "dimension exceeds int32");
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
  Kokkos::Profiling::ScopedRegion region("gemm::cublas");
  check(cublasGemmEx(handle(), op(tb), op(ta), int(s.n), int(s.m), int(s.k), &alpha, B.data(), dtype,
                     int(B.stride(0)), A.data(), dtype, int(A.stride(0)), &beta, C.data(), dtype, int(C.stride(0)),
                     compute, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx");
}

// Row-major raw-pointer GEMM with bf16 operands and fp32 accumulation; C of type ctype (fp32 or bf16).
void gemm_bf16_cublas(Trans ta, Trans tb, index_t m, index_t n, index_t k, float alpha, const void* A, index_t lda,
                      const void* B, index_t ldb, float beta, void* C, cudaDataType_t ctype, index_t ldc) {
  if (m == 0 || n == 0) return;
  require_int32_dims("gemm_bf16", m, n, k, lda, ldb, ldc, 1);
  Kokkos::Profiling::ScopedRegion region("gemm::cublas_bf16");
  check(cublasGemmEx(handle(), op(tb), op(ta), int(n), int(m), int(k), &alpha, B, CUDA_R_16BF, int(ldb), A,
                     CUDA_R_16BF, int(lda), &beta, C, ctype, int(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx (bf16 operands)");
}

// dst (rows x cols, contiguous) = src (rows x cols, row stride ld) rounded to bf16 (nearest even): 8 values a
// thread (two 16-byte loads, one 16-byte store) when the rows allow it, one otherwise.
__global__ void cast_bf16_vec8(const float* __restrict__ src, long long ld, long long rows, long long c8,
                               uint4* __restrict__ dst) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < rows * c8;
       i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / c8, c = i - r * c8;
    const float4* p = reinterpret_cast<const float4*>(src + r * ld) + 2 * c;
    const float4 a = __ldg(p), b = __ldg(p + 1);
    const float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    dst[i] = cuda_k::pack8(f);
  }
}
__global__ void cast_bf16_scalar(const float* __restrict__ src, long long ld, long long rows, long long cols,
                                 __nv_bfloat16* __restrict__ dst) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < rows * cols;
       i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / cols;
    dst[i] = __float2bfloat16_rn(src[r * ld + (i - r * cols)]);
  }
}
void cast_bf16(const float* src, index_t ld, index_t rows, index_t cols, void* dst) {
  if (rows == 0 || cols == 0) return;
  if (cols % 8 == 0 && cuda_k::float4_rows({{src, ld}}) && cuda_k::aligned16(dst))
    cuda_k::launch("gemm::cast_bf16", rows * (cols / 8), cast_bf16_vec8, src, (long long)ld, (long long)rows,
                   (long long)(cols / 8), static_cast<uint4*>(dst));
  else
    cuda_k::launch("gemm::cast_bf16", rows * cols, cast_bf16_scalar, src, (long long)ld, (long long)rows,
                   (long long)cols, static_cast<__nv_bfloat16*>(dst));
}

bool g_bf16_cast = true;
index_t g_bf16_cast_block = index_t(1) << 26;

// A float GEMM in bf16 arithmetic on native bf16 operands: the operands rounded to bf16 copies (blocks of at most
// g_bf16_cast_block elements each, from the workspace cache), then cublasGemmEx on them with fp32 output. With
// op(A) = A the rows of A and C go in blocks (B rounded once); with op(A) = A^T the K dimension goes in blocks
// (rows of A, rows or columns of B), the later blocks accumulating onto C.
void gemm_float_via_bf16(Trans ta, Trans tb, float alpha, GemmIn<float> A, GemmIn<float> B, float beta,
                         GemmOut<float> C) {
  const Shape s = check_shapes(ta, tb, A, B, C);
  if (s.m == 0 || s.n == 0) return;
  const index_t lda = A.stride(0), ldb = B.stride(0), ldc = C.stride(0);
  const index_t rb = B.extent(0), cb = B.extent(1);
  if (s.k == 0) {  // C = beta C: nothing to round
    gemm_cublas<float>(ta, tb, alpha, A, B, beta, C, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    return;
  }
  PoolScope ws;
  if (ta == Trans::N) {
    auto Bb = ws.take<View1<bf16>>("gemm::b_bf16", rb * cb);
    cast_bf16(B.data(), ldb, rb, cb, Bb.data());
    const index_t ca = A.extent(1);
    const index_t rows = std::clamp<index_t>(g_bf16_cast_block / std::max<index_t>(ca, 1), 1, s.m);
    auto Ab = ws.take<View1<bf16>>("gemm::a_bf16", rows * ca);
    for (index_t i0 = 0; i0 < s.m; i0 += rows) {
      const index_t r = std::min(rows, s.m - i0);
      cast_bf16(A.data() + i0 * lda, lda, r, ca, Ab.data());
      gemm_bf16_cublas(ta, tb, r, s.n, s.k, alpha, Ab.data(), ca, Bb.data(), cb, beta, C.data() + i0 * ldc,
                       CUDA_R_32F, ldc);
    }
    return;
  }
  const index_t kb = std::clamp<index_t>(g_bf16_cast_block / std::max(s.m, s.n), 1, s.k);
  auto Ab = ws.take<View1<bf16>>("gemm::a_bf16", kb * s.m);
  auto Bb = ws.take<View1<bf16>>("gemm::b_bf16", kb * s.n);
  for (index_t k0 = 0; k0 < s.k; k0 += kb) {
    const index_t kr = std::min(kb, s.k - k0);
    cast_bf16(A.data() + k0 * lda, lda, kr, s.m, Ab.data());
    if (tb == Trans::N)
      cast_bf16(B.data() + k0 * ldb, ldb, kr, s.n, Bb.data());
    else
      cast_bf16(B.data() + k0, ldb, s.n, kr, Bb.data());
    gemm_bf16_cublas(ta, tb, s.m, s.n, kr, alpha, Ab.data(), s.m, Bb.data(), tb == Trans::N ? s.n : kr,
                     k0 == 0 ? beta : 1.0f, C.data(), CUDA_R_32F, ldc);
  }
}

// C *= beta in place (the outputs of an empty product: no rows, or an empty K)
void scale_in_place(const char* label, GemmOut<float> C, float beta) {
  par_for(label, C.extent(0), C.extent(1), KOKKOS_LAMBDA(index_t i, index_t j) { C(i, j) *= beta; });
}

// The linear backward's two products with bf16 copies shared between them: token rows in blocks, each block of
// dy rounded once for dx = dy W and dW += dy^T x (W rounded once).
// xg, dyg: bf16 copies of the input and of the output gradient where the caller has them (their blocks are then used
// in place of rounding x or dy).
void linear_backward_via_bf16(GemmIn<float> dy, GemmIn<float> W, GemmIn<float> x, float beta_dx, GemmOut<float> dx,
                              float beta_dw, GemmOut<float> dW, GemmIn<bf16> xg = GemmIn<bf16>(),
                              GemmIn<bf16> dyg = GemmIn<bf16>()) {
  const bool given = xg.data() != nullptr, dy_given = dyg.data() != nullptr;
  const index_t T = dy_given ? dyg.extent(0) : dy.extent(0), O = W.extent(0), I = W.extent(1);
  PoolScope ws;
  auto Wb = ws.take<View1<bf16>>("gemm::w_bf16", O * I);
  cast_bf16(W.data(), W.stride(0), O, I, Wb.data());
  const index_t rows =
      std::clamp<index_t>(g_bf16_cast_block / std::max<index_t>({O, I, 1}), 1, std::max<index_t>(T, 1));
  auto dyb = dy_given ? View1<bf16>() : ws.take<View1<bf16>>("gemm::dy_bf16", rows * O);
  auto xb = given ? View1<bf16>() : ws.take<View1<bf16>>("gemm::x_bf16", rows * I);
  for (index_t t0 = 0; t0 < T; t0 += rows) {
    const index_t r = std::min(rows, T - t0);
    if (!dy_given) cast_bf16(dy.data() + t0 * dy.stride(0), dy.stride(0), r, O, dyb.data());
    if (!given) cast_bf16(x.data() + t0 * x.stride(0), x.stride(0), r, I, xb.data());
    const bf16* xr = given ? xg.data() + t0 * xg.stride(0) : xb.data();
    const bf16* dyr = dy_given ? dyg.data() + t0 * dyg.stride(0) : dyb.data();
    const index_t lddy = dy_given ? dyg.stride(0) : O;
    if (dx.extent(0) > 0)
      gemm_bf16_cublas(Trans::N, Trans::N, r, I, O, 1.0f, dyr, lddy, Wb.data(), I, beta_dx,
                       dx.data() + t0 * dx.stride(0), CUDA_R_32F, dx.stride(0));
    gemm_bf16_cublas(Trans::T, Trans::N, O, I, r, 1.0f, dyr, lddy, xr, given ? xg.stride(0) : I,
                     t0 == 0 ? beta_dw : 1.0f, dW.data(), CUDA_R_32F, dW.stride(0));
  }
}

// cuBLAS compute type of a float GEMM: tensor cores with tf32 or bf16 operand rounding, or plain fp32.
cublasComputeType_t float_compute_type(GemmCompute c) {
  return c == GemmCompute::tf32   ? CUBLAS_COMPUTE_32F_FAST_TF32
         : c == GemmCompute::bf16 ? CUBLAS_COMPUTE_32F_FAST_16BF
                                  : CUBLAS_COMPUTE_32F;
}

template <class T>
void batched_cublas(Trans ta, Trans tb, index_t m, index_t n, index_t k, T alpha, const T* A, index_t lda,
                    index_t sA, const T* B, index_t ldb, index_t sB, T beta, T* C, index_t ldc, index_t sC,
                    index_t count, cudaDataType_t dtype, cublasComputeType_t compute) {
  if (m == 0 || n == 0 || count == 0) return;
  require_int32_dims("gemm_strided_batched", m, n, k, lda, ldb, ldc, count);
  Kokkos::Profiling::ScopedRegion region("gemm::cublas_strided_batched");
  check(cublasGemmStridedBatchedEx(handle(), op(tb), op(ta), int(n), int(m), int(k), &alpha, B, dtype, int(ldb),
                                   (long long)sB, A, dtype, int(lda), (long long)sA, &beta, C, dtype, int(ldc),
                                   (long long)sC, int(count), compute, CUBLAS_GEMM_DEFAULT),
        "cublasGemmStridedBatchedEx");
}

template <class T>
void batched2d_cublas(Trans ta, Trans tb, index_t m, index_t n, index_t k, T alpha, const T* A, index_t lda,
                      index_t sAj, index_t sAi, const T* B, index_t ldb, index_t sBj, index_t sBi, T beta, T* C,
                      index_t ldc, index_t sCj, index_t sCi, index_t nj, index_t ni, cudaDataType_t dtype,
                      cublasComputeType_t compute, std::uintptr_t* pointers) {
  if (m == 0 || n == 0 || nj == 0 || ni == 0) return;
  // one stride when the levels flatten (entry j ni + i at (j ni + i) s)
  const bool flat = ni == 1 || (sAj == ni * sAi && sBj == ni * sBi && sCj == ni * sCi);
  if (flat || nj == 1) {
    const bool by_i = ni > 1;
    batched_cublas<T>(ta, tb, m, n, k, alpha, A, lda, by_i ? sAi : sAj, B, ldb, by_i ? sBi : sBj, beta, C, ldc,
                      by_i ? sCi : sCj, nj * ni, dtype, compute);
    return;
  }
  const index_t count = nj * ni;
  require_int32_dims("gemm_batched_2d", m, n, k, lda, ldb, ldc, count);
  Kokkos::Profiling::ScopedRegion region("gemm::cublas_batched_2d");
  View1<std::uintptr_t> own;
  if (pointers == nullptr) own = View1<std::uintptr_t>("gemm::pointers", 3 * count);
  std::uintptr_t* ptr = pointers != nullptr ? pointers : own.data();
  const auto a0 = reinterpret_cast<std::uintptr_t>(A), b0 = reinterpret_cast<std::uintptr_t>(B),
             c0 = reinterpret_cast<std::uintptr_t>(C);
  const index_t sz = sizeof(T);
  // cuBLAS cannot see the alignment of pointers in a device array: tensor-core modes only when every entry and
  // row is 16-byte aligned, plain fp32 otherwise
  const index_t steps = (sAj | sAi | sBj | sBi | sCj | sCi | lda | ldb | ldc) * sz;
  if ((a0 | b0 | c0) % 16 != 0 || steps % 16 != 0)
    compute = dtype == CUDA_R_32F ? CUBLAS_COMPUTE_32F : compute;
  par_for("gemm::batched_2d_pointers", count, KOKKOS_LAMBDA(index_t e) {
    const index_t j = e / ni, i = e % ni;
    ptr[e] = a0 + std::uintptr_t((j * sAj + i * sAi) * sz);
    ptr[count + e] = b0 + std::uintptr_t((j * sBj + i * sBi) * sz);
    ptr[2 * count + e] = c0 + std::uintptr_t((j * sCj + i * sCi) * sz);
  });
  auto arr = reinterpret_cast<void**>(ptr);
  check(cublasGemmBatchedEx(handle(), op(tb), op(ta), int(n), int(m), int(k), &alpha, arr + count, dtype, int(ldb),
                            arr, dtype, int(lda), &beta, arr + 2 * count, dtype, int(ldc), int(count), compute,
                            CUBLAS_GEMM_DEFAULT),
        "cublasGemmBatchedEx");
}

#else

// sum_k x_k y_k of two contiguous rows, vectorised as an OpenMP simd reduction where OpenMP is on (without it the
// compiler keeps the sum's order and so a scalar dependency chain).
template <class T>
inline T dot_rows(const T* x, const T* y, index_t k) {
  T acc = 0;
#if defined(_OPENMP)
#pragma omp simd reduction(+ : acc)
#endif
  for (index_t kk = 0; kk < k; ++kk) acc += x[kk] * y[kk];
  return acc;
}

// Host: one work item per output row of a two-level batch (entry (j, i) at X + j sXj + i sXi; row-major, op as
// given): with B not transposed the row is alpha sum_k op(A)_ik B_k + beta C_i, 16 columns at a time held in
// registers over k (contiguous loads of B's rows, vectorised; B reused from cache by the entry's other rows); with
// B transposed each element is a dot product of contiguous rows (A's row where A is not transposed). One thread
// per output element with the k loop inside, the earlier form, read B down its columns: 60 % of a CPU training
// step of a 4-layer d_model 128 LM with the GEMM form of the SSD went there, and the step took 1.5x as long (2
// cores, 20 steps of 8 x 1,024 tokens: 33.1 against 22.1-22.5 s).
template <class T>
void batched2d_host(Trans ta, Trans tb, index_t m, index_t n, index_t k, T alpha, const T* A, index_t lda,
                    index_t sAj, index_t sAi, const T* B, index_t ldb, index_t sBj, index_t sBi, T beta, T* C,
                    index_t ldc, index_t sCj, index_t sCi, index_t nj, index_t ni) {
  if (m == 0 || n == 0 || nj == 0 || ni == 0) return;
  const bool at = ta == Trans::T, bt = tb == Trans::T;
  par_for("gemm::batched_2d", nj * ni * m, KOKKOS_LAMBDA(index_t row) {
    const index_t e = row / m, i = row % m, bj = e / ni, b_i = e % ni;
    const T* a = A + bj * sAj + b_i * sAi;
    const T* bb = B + bj * sBj + b_i * sBi;
    T* c = C + bj * sCj + b_i * sCi + i * ldc;
    if (bt) {
      for (index_t jj = 0; jj < n; ++jj) {
        const T* br = bb + jj * ldb;
        T acc = 0;
        if (!at) {
          acc = dot_rows(a + i * lda, br, k);
        } else {
          for (index_t kk = 0; kk < k; ++kk) acc += a[kk * lda + i] * br[kk];
        }
        c[jj] = alpha * acc + (beta == T(0) ? T(0) : beta * c[jj]);
      }
      return;
    }
    // blocks of 16 columns in registers across the k loop (one load of B and one multiply-add an element)
    // (op(A)_ik at ap[k as]: the branch on the transpose out of the loops, which it kept from vectorising)
    constexpr int kW = 16;
    const T* ap = at ? a + i : a + i * lda;
    const index_t as = at ? lda : 1;
    index_t j0 = 0;
    for (; j0 + kW <= n; j0 += kW) {
      T acc[kW];
      for (int u = 0; u < kW; ++u) acc[u] = T(0);
      for (index_t kk = 0; kk < k; ++kk) {
        const T aik = ap[kk * as];
        const T* br = bb + kk * ldb + j0;
        for (int u = 0; u < kW; ++u) acc[u] += aik * br[u];
      }
      for (int u = 0; u < kW; ++u) c[j0 + u] = alpha * acc[u] + (beta == T(0) ? T(0) : beta * c[j0 + u]);
    }
    for (index_t jj = j0; jj < n; ++jj) {
      T acc = 0;
      for (index_t kk = 0; kk < k; ++kk) acc += ap[kk * as] * bb[kk * ldb + jj];
      c[jj] = alpha * acc + (beta == T(0) ? T(0) : beta * c[jj]);
    }
  });
}

// Row-major raw-pointer float GEMM on the host: the BLAS TPL (column-major: C^T = op(B)^T op(A)^T, operands
// swapped), or the loop kernel above when Kokkos Kernels has no BLAS.
void gemm_host_raw(Trans ta, Trans tb, index_t m, index_t n, index_t k, float alpha, const float* A, index_t lda,
                   const float* B, index_t ldb, float beta, float* C, index_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // C = beta C
    par_for("gemm::scale_k0", m, n, KOKKOS_LAMBDA(index_t i, index_t j) {
      C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
    });
    return;
  }
#if defined(KOKKOSKERNELS_ENABLE_TPL_BLAS)
  require_int32_dims("gemm_bf16", m, n, k, lda, ldb, ldc, 1);
  Kokkos::Profiling::ScopedRegion region("gemm::host_blas");
  Exec().fence("gemm::host_blas");  // the BLAS runs outside Kokkos: earlier kernels first
  KokkosBlas::Impl::HostBlas<float>::gemm(tb == Trans::N ? 'N' : 'T', ta == Trans::N ? 'N' : 'T', int(n), int(m),
                                          int(k), alpha, B, int(ldb), A, int(lda), beta, C, int(ldc));
#else
  batched2d_host<float>(ta, tb, m, n, k, alpha, A, lda, 0, 0, B, ldb, 0, 0, beta, C, ldc, 0, 0, 1, 1);
#endif
}

template <class T>
void gemm_kokkosblas(Trans ta, Trans tb, T alpha, GemmIn<T> A, GemmIn<T> B, T beta, GemmOut<T> C) {
  const Shape s = check_shapes(ta, tb, A, B, C);
  if (s.m == 0 || s.n == 0) return;
  if (s.k == 0) {  // C = beta C (BLAS may reject k = 0 leading dimensions)
    par_for("gemm::scale_k0", s.m, s.n, KOKKOS_LAMBDA(index_t i, index_t j) { C(i, j) *= beta; });
    return;
  }
  Kokkos::Profiling::ScopedRegion region("gemm::kokkosblas");
  KokkosBlas::gemm(ta == Trans::N ? "N" : "T", tb == Trans::N ? "N" : "T", alpha, A, B, beta, C);
}

#endif

GemmCompute g_float_compute = GemmCompute::fp32;

}  // namespace

void set_float_gemm_compute(GemmCompute c) { g_float_compute = c; }
GemmCompute float_gemm_compute() { return g_float_compute; }

void set_float_gemm_bf16_cast([[maybe_unused]] bool cast, index_t block_elems) {
  require(block_elems > 0, "set_float_gemm_bf16_cast", "block of ", block_elems, " elements");
#if defined(KOKKOS_ENABLE_CUDA)
  g_bf16_cast = cast;
  g_bf16_cast_block = block_elems;
#endif
}
template <class P>
void linear_backward_gemms_impl(GemmIn<P> dy, GemmIn<P> W, GemmIn<P> x, P beta_dx, GemmOut<P> dx, P beta_dw,
                                GemmOut<P> dW) {
  const index_t T = dy.extent(0), O = dy.extent(1), I = W.extent(1);
  require(index_t(W.extent(0)) == O && index_t(x.extent(0)) == T && index_t(x.extent(1)) == I &&
              index_t(dW.extent(0)) == O && index_t(dW.extent(1)) == I &&
              (dx.extent(0) == 0 || (index_t(dx.extent(0)) == T && index_t(dx.extent(1)) == I)),
          "linear_backward_gemms", "shapes do not match: dy ", T, "x", O, ", W ", W.extent(0), "x", I, ", x ",
          x.extent(0), "x", x.extent(1), ", dx ", dx.extent(0), "x", dx.extent(1), ", dW ", dW.extent(0), "x",
          dW.extent(1));
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same_v<P, float>)
    if (g_float_compute == GemmCompute::bf16 && g_bf16_cast && T > 0 && O > 0 && I > 0)
      return linear_backward_via_bf16(dy, W, x, beta_dx, dx, beta_dw, dW);
#endif
  if (dx.extent(0) > 0) gemm(Trans::N, Trans::N, P(1), dy, W, beta_dx, dx);
  gemm(Trans::T, Trans::N, P(1), dy, x, beta_dw, dW);
}

void linear_backward_gemms(GemmIn<float> dy, GemmIn<float> W, GemmIn<float> x, float beta_dx, GemmOut<float> dx,
                           float beta_dw, GemmOut<float> dW) {
  linear_backward_gemms_impl<float>(dy, W, x, beta_dx, dx, beta_dw, dW);
}
void linear_backward_gemms(GemmIn<double> dy, GemmIn<double> W, GemmIn<double> x, double beta_dx,
                           GemmOut<double> dx, double beta_dw, GemmOut<double> dW) {
  linear_backward_gemms_impl<double>(dy, W, x, beta_dx, dx, beta_dw, dW);
}

bool float_gemm_bf16_cast() {
#if defined(KOKKOS_ENABLE_CUDA)
  return g_bf16_cast;
#else
  return false;
#endif
}

bool float_gemm_on_bf16_copies() { return float_gemm_bf16_cast() && g_float_compute == GemmCompute::bf16; }

namespace {
void check_linear_bf16_shapes(const char* what, index_t T, index_t I, index_t O, GemmIn<bf16_op_t> xb, GemmIn<float> W) {
  require(index_t(xb.extent(0)) == T && index_t(xb.extent(1)) == I && index_t(W.extent(0)) == O &&
              index_t(W.extent(1)) == I,
          what, "shapes do not match: x (bf16 copy) ", xb.extent(0), "x", xb.extent(1), ", W ", W.extent(0), "x",
          W.extent(1), ", rows ", T, ", outputs ", O);
}

// The gradients' shapes: dx (no rows: not wanted) T x I, dW O x I.
void check_linear_grad_shapes(const char* what, index_t T, index_t I, index_t O, GemmOut<float> dx,
                              GemmOut<float> dW) {
  require(index_t(dW.extent(0)) == O && index_t(dW.extent(1)) == I &&
              (dx.extent(0) == 0 || (index_t(dx.extent(0)) == T && index_t(dx.extent(1)) == I)),
          what, "shapes do not match: dx ", dx.extent(0), "x", dx.extent(1), ", dW ", dW.extent(0), "x", dW.extent(1),
          " for ", T, " rows, ", I, " inputs, ", O, " outputs");
}

#if defined(KOKKOS_ENABLE_CUDA)
// The linear backward with dy given as its bf16 copy dyb and x as fp32 or (xb) its bf16 copy: the products on bf16
// copies, or for an empty product dx = beta_dx dx (O = 0) and dW = beta_dw dW (no rows).
void linear_backward_from_dyb(GemmIn<bf16_op_t> dyb, GemmIn<float> W, GemmIn<float> x, GemmIn<bf16_op_t> xb,
                              float beta_dx, GemmOut<float> dx, float beta_dw, GemmOut<float> dW) {
  const index_t T = dyb.extent(0), O = dyb.extent(1), I = W.extent(1);
  if (T > 0 && O > 0 && I > 0)
    return linear_backward_via_bf16(GemmIn<float>(), W, x, beta_dx, dx, beta_dw, dW, xb, dyb);
  if (dx.extent(0) > 0 && I > 0) scale_in_place("gemm::scale_dx", dx, beta_dx);
  if (T == 0 && O > 0 && I > 0) scale_in_place("gemm::scale_dw", dW, beta_dw);
}
#endif
}  // namespace

void linear_forward_gemm_bf16x(GemmIn<bf16_op_t> xb, GemmIn<float> W, GemmOut<float> y) {
  const index_t T = y.extent(0), O = y.extent(1), I = W.extent(1);
  check_linear_bf16_shapes("linear_forward_gemm_bf16x", T, I, O, xb, W);
#if defined(KOKKOS_ENABLE_CUDA)
  if (T == 0 || O == 0) return;
  if (I == 0) return Kokkos::deep_copy(y, 0.0f);
  PoolScope ws;
  auto Wb = ws.take<View1<bf16>>("gemm::w_bf16", O * I);
  cast_bf16(W.data(), W.stride(0), O, I, Wb.data());
  gemm_bf16_cublas(Trans::N, Trans::T, T, O, I, 1.0f, xb.data(), xb.stride(0), Wb.data(), I, 0.0f, y.data(),
                   CUDA_R_32F, y.stride(0));
#else
  gemm(Trans::N, Trans::T, 1.0f, xb, W, 0.0f, y);
#endif
}

void linear_backward_gemms_bf16x(GemmIn<float> dy, GemmIn<float> W, GemmIn<bf16_op_t> xb, float beta_dx,
                                 GemmOut<float> dx, float beta_dw, GemmOut<float> dW) {
  const index_t T = dy.extent(0), O = dy.extent(1), I = W.extent(1);
  check_linear_bf16_shapes("linear_backward_gemms_bf16x", T, I, O, xb, W);
  check_linear_grad_shapes("linear_backward_gemms_bf16x", T, I, O, dx, dW);
#if defined(KOKKOS_ENABLE_CUDA)
  if (T > 0 && O > 0 && I > 0) return linear_backward_via_bf16(dy, W, GemmIn<float>(), beta_dx, dx, beta_dw, dW, xb);
  // an empty product: dx = beta_dx dx + dy W (K = O may be 0), dW = beta_dw dW when there are no rows
  if (dx.extent(0) > 0) gemm(Trans::N, Trans::N, 1.0f, dy, W, beta_dx, dx);
  if (T == 0 && O > 0 && I > 0) scale_in_place("gemm::scale_dw", dW, beta_dw);
#else
  linear_backward_gemms(dy, W, xb, beta_dx, dx, beta_dw, dW);
#endif
}

void linear_backward_gemms_bf16dy(GemmIn<bf16_op_t> dyb, GemmIn<float> W, GemmIn<float> x, float beta_dx,
                                  GemmOut<float> dx, float beta_dw, GemmOut<float> dW) {
  const index_t T = dyb.extent(0), O = dyb.extent(1), I = W.extent(1);
  require(index_t(W.extent(0)) == O && index_t(x.extent(0)) == T && index_t(x.extent(1)) == I,
          "linear_backward_gemms_bf16dy", "shapes do not match: dy (bf16 copy) ", T, "x", O, ", W ", W.extent(0), "x",
          I, ", x ", x.extent(0), "x", x.extent(1));
  check_linear_grad_shapes("linear_backward_gemms_bf16dy", T, I, O, dx, dW);
#if defined(KOKKOS_ENABLE_CUDA)
  linear_backward_from_dyb(dyb, W, x, GemmIn<bf16_op_t>(), beta_dx, dx, beta_dw, dW);
#else
  linear_backward_gemms(dyb, W, x, beta_dx, dx, beta_dw, dW);
#endif
}

void linear_backward_gemms_bf16(GemmIn<bf16_op_t> dyb, GemmIn<float> W, GemmIn<bf16_op_t> xb, float beta_dx,
                                GemmOut<float> dx, float beta_dw, GemmOut<float> dW) {
  const index_t T = dyb.extent(0), O = dyb.extent(1), I = W.extent(1);
  check_linear_bf16_shapes("linear_backward_gemms_bf16", T, I, O, xb, W);
  check_linear_grad_shapes("linear_backward_gemms_bf16", T, I, O, dx, dW);
#if defined(KOKKOS_ENABLE_CUDA)
  linear_backward_from_dyb(dyb, W, GemmIn<float>(), xb, beta_dx, dx, beta_dw, dW);
#else
  linear_backward_gemms(dyb, W, xb, beta_dx, dx, beta_dw, dW);
#endif
}

void round_to_bf16(const char* label, const View2<const float>& src, const UView2<bf16_op_t>& dst, index_t col) {
  require(index_t(dst.extent(0)) == index_t(src.extent(0)) && col >= 0 &&
              col + index_t(src.extent(1)) <= index_t(dst.extent(1)),
          label, "a bf16 copy of ", dst.extent(0), "x", dst.extent(1), " cannot hold ", src.extent(0), "x",
          src.extent(1), " from column ", col);
  round_to_bf16(label, src.data(), index_t(src.stride(0)), dst.data() + col, index_t(dst.stride(0)),
                index_t(src.extent(0)), index_t(src.extent(1)));
}

namespace {
template <int VW>
void round_rows_to_bf16(const char* label, const float* src, index_t lds, bf16_op_t* dst, index_t ldd, index_t rows,
                        index_t cols) {
  par_for(label, rows, cols / VW, KOKKOS_LAMBDA(index_t r, index_t j) {
    float v[VW];
    load_vec<VW>(src + r * lds + j * VW, v);
    store_bf16_op_vec<VW>(dst + r * ldd + j * VW, v);
  });
}
}  // namespace

void round_to_bf16(const char* label, const float* src, index_t lds, bf16_op_t* dst, index_t ldd, index_t rows,
                   index_t cols) {
  if (rows == 0 || cols == 0) return;
  if (cols % 4 == 0 && bf16_rows_by_four(src, lds, dst, ldd))
    return round_rows_to_bf16<4>(label, src, lds, dst, ldd, rows, cols);
  round_rows_to_bf16<1>(label, src, lds, dst, ldd, rows, cols);
}

GemmCompute parse_gemm_compute(const std::string& s, const std::string& what) {
  if (s == "fp32") return GemmCompute::fp32;
  if (s == "tf32") return GemmCompute::tf32;
  if (s == "bf16") return GemmCompute::bf16;
  throw Error(what, "unknown value '" + s + "' (valid: fp32, tf32, bf16)");
}

const char* gemm_compute_name(GemmCompute c) {
  return c == GemmCompute::tf32 ? "tf32" : c == GemmCompute::bf16 ? "bf16" : "fp32";
}

#if defined(KOKKOS_ENABLE_CUDA)
void gemm(Trans ta, Trans tb, float alpha, GemmIn<float> A, GemmIn<float> B, float beta, GemmOut<float> C) {
  if (g_float_compute == GemmCompute::bf16 && g_bf16_cast) return gemm_float_via_bf16(ta, tb, alpha, A, B, beta, C);
  gemm_cublas<float>(ta, tb, alpha, A, B, beta, C, CUDA_R_32F, float_compute_type(g_float_compute));
}
void gemm(Trans ta, Trans tb, double alpha, GemmIn<double> A, GemmIn<double> B, double beta,
          GemmOut<double> C) {
  gemm_cublas<double>(ta, tb, alpha, A, B, beta, C, CUDA_R_64F, CUBLAS_COMPUTE_64F);
}
void gemm(Trans ta, Trans tb, float alpha, GemmIn<bf16> A, GemmIn<bf16> B, float beta, GemmOut<bf16> C) {
  gemm_cublas<bf16>(ta, tb, alpha, A, B, beta, C, CUDA_R_16BF, CUBLAS_COMPUTE_32F);
}
void gemm_strided_batched(Trans ta, Trans tb, index_t m, index_t n, index_t k, float alpha, const float* A,
                          index_t lda, index_t sA, const float* B, index_t ldb, index_t sB, float beta, float* C,
                          index_t ldc, index_t sC, index_t count, GemmCompute compute) {
  batched_cublas<float>(ta, tb, m, n, k, alpha, A, lda, sA, B, ldb, sB, beta, C, ldc, sC, count, CUDA_R_32F,
                        float_compute_type(compute));
}
void gemm_strided_batched(Trans ta, Trans tb, index_t m, index_t n, index_t k, double alpha, const double* A,
                          index_t lda, index_t sA, const double* B, index_t ldb, index_t sB, double beta,
                          double* C, index_t ldc, index_t sC, index_t count, GemmCompute) {
  batched_cublas<double>(ta, tb, m, n, k, alpha, A, lda, sA, B, ldb, sB, beta, C, ldc, sC, count, CUDA_R_64F,
                         CUBLAS_COMPUTE_64F);
}
void gemm_batched_2d(Trans ta, Trans tb, index_t m, index_t n, index_t k, float alpha, const float* A, index_t lda,
                     index_t sAj, index_t sAi, const float* B, index_t ldb, index_t sBj, index_t sBi, float beta,
                     float* C, index_t ldc, index_t sCj, index_t sCi, index_t nj, index_t ni, GemmCompute compute,
                     std::uintptr_t* pointers) {
  batched2d_cublas<float>(ta, tb, m, n, k, alpha, A, lda, sAj, sAi, B, ldb, sBj, sBi, beta, C, ldc, sCj, sCi, nj, ni,
                          CUDA_R_32F, float_compute_type(compute), pointers);
}
void gemm_batched_2d(Trans ta, Trans tb, index_t m, index_t n, index_t k, double alpha, const double* A,
                     index_t lda, index_t sAj, index_t sAi, const double* B, index_t ldb, index_t sBj, index_t sBi,
                     double beta, double* C, index_t ldc, index_t sCj, index_t sCi, index_t nj, index_t ni,
                     GemmCompute, std::uintptr_t* pointers) {
  batched2d_cublas<double>(ta, tb, m, n, k, alpha, A, lda, sAj, sAi, B, ldb, sBj, sBi, beta, C, ldc, sCj, sCi, nj,
                           ni, CUDA_R_64F, CUBLAS_COMPUTE_64F, pointers);
}
void gemm_bf16_f32(Trans ta, Trans tb, index_t m, index_t n, index_t k, float alpha, const bf16_op_t* A,
                   index_t lda, const bf16_op_t* B, index_t ldb, float beta, float* C, index_t ldc) {
  gemm_bf16_cublas(ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, CUDA_R_32F, ldc);
}
void gemm_bf16_b16(Trans ta, Trans tb, index_t m, index_t n, index_t k, float alpha, const bf16_op_t* A,
                   index_t lda, const bf16_op_t* B, index_t ldb, float beta, bf16_op_t* C, index_t ldc) {
  gemm_bf16_cublas(ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, CUDA_R_16BF, ldc);
}
void gemm_bf16_f32_batched(Trans ta, Trans tb, index_t m, index_t n, index_t k, float alpha, const bf16_op_t* A,
                           index_t lda, index_t sA, const bf16_op_t* B, index_t ldb, index_t sB, float beta,
                           float* C, index_t ldc, index_t sC, index_t count) {
  if (m == 0 || n == 0 || count == 0) return;
  require(sA >= 0 && sB >= 0 && sC >= 0, "gemm_bf16_f32_batched", "negative batch stride");
  require_int32_dims("gemm_bf16_f32_batched", m, n, k, lda, ldb, ldc, count);
  Kokkos::Profiling::ScopedRegion region("gemm::cublas_bf16");
  check(cublasGemmStridedBatchedEx(handle(), op(tb), op(ta), int(n), int(m), int(k), &alpha, B, CUDA_R_16BF,
                                   int(ldb), (long long)sB, A, CUDA_R_16BF, int(lda), (long long)sA, &beta, C,
                                   CUDA_R_32F, int(ldc), (long long)sC, int(count), CUBLAS_COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT),
        "cublasGemmStridedBatchedEx (bf16 operands)");
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
void gemm_strided_batched(Trans ta, Trans tb, index_t m, index_t n, index_t k, float alpha, const float* A,
                          index_t lda, index_t sA, const float* B, index_t ldb, index_t sB, float beta, float* C,
                          index_t ldc, index_t sC, index_t count, GemmCompute) {
  batched2d_host<float>(ta, tb, m, n, k, alpha, A, lda, sA, 0, B, ldb, sB, 0, beta, C, ldc, sC, 0, count, 1);
}
void gemm_strided_batched(Trans ta, Trans tb, index_t m, index_t n, index_t k, double alpha, const double* A,
                          index_t lda, index_t sA, const double* B, index_t ldb, index_t sB, double beta,
                          double* C, index_t ldc, index_t sC, index_t count, GemmCompute) {
  batched2d_host<double>(ta, tb, m, n, k, alpha, A, lda, sA, 0, B, ldb, sB, 0, beta, C, ldc, sC, 0, count, 1);
}
void gemm_batched_2d(Trans ta, Trans tb, index_t m, index_t n, index_t k, float alpha, const float* A, index_t lda,
                     index_t sAj, index_t sAi, const float* B, index_t ldb, index_t sBj, index_t sBi, float beta,
                     float* C, index_t ldc, index_t sCj, index_t sCi, index_t nj, index_t ni, GemmCompute,
                     std::uintptr_t*) {
  batched2d_host<float>(ta, tb, m, n, k, alpha, A, lda, sAj, sAi, B, ldb, sBj, sBi, beta, C, ldc, sCj, sCi, nj, ni);
}
void gemm_batched_2d(Trans ta, Trans tb, index_t m, index_t n, index_t k, double alpha, const double* A,
                     index_t lda, index_t sAj, index_t sAi, const double* B, index_t ldb, index_t sBj, index_t sBi,
                     double beta, double* C, index_t ldc, index_t sCj, index_t sCi, index_t nj, index_t ni,
                     GemmCompute, std::uintptr_t*) {
  batched2d_host<double>(ta, tb, m, n, k, alpha, A, lda, sAj, sAi, B, ldb, sBj, sBi, beta, C, ldc, sCj, sCi, nj,
                         ni);
}
void gemm_bf16_f32(Trans ta, Trans tb, index_t m, index_t n, index_t k, float alpha, const bf16_op_t* A,
                   index_t lda, const bf16_op_t* B, index_t ldb, float beta, float* C, index_t ldc) {
  gemm_host_raw(ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc);
}
void gemm_bf16_b16(Trans ta, Trans tb, index_t m, index_t n, index_t k, float alpha, const bf16_op_t* A,
                   index_t lda, const bf16_op_t* B, index_t ldb, float beta, bf16_op_t* C, index_t ldc) {
  gemm_host_raw(ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc);
  if (m == 0 || n == 0) return;
  par_for("gemm::bf16_round_output", m, n, KOKKOS_LAMBDA(index_t i, index_t j) {
    C[i * ldc + j] = bf16_round(C[i * ldc + j]);
  });
}
void gemm_bf16_f32_batched(Trans ta, Trans tb, index_t m, index_t n, index_t k, float alpha, const bf16_op_t* A,
                           index_t lda, index_t sA, const bf16_op_t* B, index_t ldb, index_t sB, float beta,
                           float* C, index_t ldc, index_t sC, index_t count) {
  require(sA >= 0 && sB >= 0 && sC >= 0, "gemm_bf16_f32_batched", "negative batch stride");
  for (index_t i = 0; i < count; ++i)
    gemm_host_raw(ta, tb, m, n, k, alpha, A + i * sA, lda, B + i * sB, ldb, beta, C + i * sC, ldc);
}
const char* gemm_backend_name() { return "KokkosBlas::gemm (host BLAS TPL)"; }
#endif

}  // namespace mm
