// Linear layer y = x W^T (+ b), W of shape (out, in) as in PyTorch, through the GEMM dispatch layer.
#pragma once

#include "core/kokkos_types.hpp"
#include "tensor/gemm.hpp"

namespace mm {

// x (n, in), W (out, in), optional bias (out) (pass an empty view for none), y (n, out).
template <class T>
void linear_forward(const UView2<const T>& x, const UView2<const T>& W, const View1<const acc_t<T>>& bias,
                    const UView2<T>& y);

// dx = (accumulate_dx ? dx : 0) + dy W ; dW += dy^T x ; db += sum_rows dy. Pass an empty dx to skip it
// (the first layer's input needs no gradient) and an empty db when there is no bias.
template <class T>
void linear_backward(const UView2<const T>& x, const UView2<const T>& W, const UView2<const T>& dy,
                     const UView2<T>& dx, bool accumulate_dx, const UView2<acc_t<T>>& dW,
                     const View1<acc_t<T>>& db);

}  // namespace mm
