// RMSNorm and group-wise gated RMSNorm (mamba_ssm's RMSNormGated), forward and backward.
//
//   rmsnorm:        y = x * rstd(x) * w,               rstd(x) = 1 / sqrt(mean(x^2) + eps) over the row
//   gated, gate_first (norm_before_gate = false, Mamba-2's default):
//                   y = rmsnorm_g(x * silu(z)) * w     (statistics per group of `group_size` columns)
//   gated, norm_first (norm_before_gate = true, Mamba-3's optional output norm):
//                   y = rmsnorm_g(x) * w * silu(z)
//
// X is the input type (the fp32 residual stream for the block norms), T the output/activation type, P = acc_t<T>
// the parameter and statistics type. rstd is saved by the forward for the backward.
#pragma once

#include "core/kokkos_types.hpp"
#include "tensor/gemm.hpp"

namespace mm {

template <class X, class T>
void rmsnorm_forward(const View2<const X>& x, const View1<const acc_t<T>>& w, double eps, const View2<T>& y,
                     const View1<acc_t<T>>& rstd);

// The float RMSNorm with y written only as its bf16 copy yb (host builds: bf16-rounded floats): the backbone's
// block input for a layer whose GEMMs take it on bf16 operands (tensor/gemm.hpp, float_gemm_on_bf16_copies), one
// pass writing 2 bytes an element instead of the fp32 output and the GEMM's rounding pass over it. yb holds the
// values the fp32 form would give, each rounded to bf16.
void rmsnorm_forward_bf16(const View2<const float>& x, const View1<const float>& w, double eps,
                          const View2<bf16_op_t>& yb, const View1<float>& rstd);

// dx = (accumulate_dx ? dx : 0) + d/dx ; dw += d/dw.
template <class X, class T>
void rmsnorm_backward(const View2<const X>& x, const View1<const acc_t<T>>& w, const View1<const acc_t<T>>& rstd,
                      const View2<const T>& dy, const View2<X>& dx, bool accumulate_dx,
                      const View1<acc_t<T>>& dw);

enum class GateOrder { gate_first, norm_first };

// x, z (n, E) may be column windows of wider matrices: pass the full matrix and the first column.
template <class T>
struct GatedNormIn {
  View2<const T> x;
  index_t x_col = 0;
  View2<const T> z;
  index_t z_col = 0;
};

template <class T>
void gated_rmsnorm_forward(const GatedNormIn<T>& in, index_t width, index_t group_size, GateOrder order,
                           const View1<const acc_t<T>>& w, double eps, const View2<T>& y,
                           const View2<acc_t<T>>& rstd /* (n, width / group_size) */);

// The float gated norm with y written only as its bf16 copy yb (n x width; host builds: bf16-rounded floats), the
// input of a GEMM on bf16 copies (tensor/gemm.hpp, float_gemm_on_bf16_copies): one pass writing 2 bytes an element
// instead of the fp32 output and the GEMM's rounding pass over it.
void gated_rmsnorm_forward_bf16(const GatedNormIn<float>& in, index_t width, index_t group_size, GateOrder order,
                                const View1<const float>& w, double eps, const View2<bf16_op_t>& yb,
                                const View2<float>& rstd);

// Writes dx and dz into column windows (dx_col, dz_col) of the given matrices; dw += .
template <class T>
void gated_rmsnorm_backward(const GatedNormIn<T>& in, index_t width, index_t group_size, GateOrder order,
                            const View1<const acc_t<T>>& w, const View2<const acc_t<T>>& rstd,
                            const View2<const T>& dy, const UView2<T>& dx, index_t dx_col, const UView2<T>& dz,
                            index_t dz_col, const View1<acc_t<T>>& dw);

// The float backward with dz written as a bf16 copy into its window of dzb (the Mamba-2 in_proj's output gradient
// under bf16 GEMMs; host builds: bf16-rounded floats); dx and dw as gated_rmsnorm_backward.
void gated_rmsnorm_backward_bf16dz(const GatedNormIn<float>& in, index_t width, index_t group_size, GateOrder order,
                                   const View1<const float>& w, const View2<const float>& rstd,
                                   const View2<const float>& dy, const UView2<float>& dx, index_t dx_col,
                                   const UView2<bf16_op_t>& dzb, index_t dz_col, const View1<float>& dw);

}  // namespace mm
