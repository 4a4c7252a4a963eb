#include "layers/linear.hpp"

#include "tensor/ops.hpp"

namespace mm {

template <class T>
void linear_forward(const UView2<const T>& x, const UView2<const T>& W, const View1<const acc_t<T>>& bias,
                    const UView2<T>& y) {
  using P = acc_t<T>;
  gemm(Trans::N, Trans::T, P(1), x, W, P(0), y);
  if (bias.extent(0) > 0) {
    par_for("linear::bias", y.extent(0), y.extent(1),
            KOKKOS_LAMBDA(index_t i, index_t j) { y(i, j) = static_cast<T>(P(y(i, j)) + bias(j)); });
  }
}

template <class T>
void linear_backward(const UView2<const T>& x, const UView2<const T>& W, const UView2<const T>& dy,
                     const UView2<T>& dx, bool accumulate_dx, const UView2<acc_t<T>>& dW,
                     const View1<acc_t<T>>& db) {
  using P = acc_t<T>;
  linear_backward_gemms(dy, W, x, accumulate_dx ? P(1) : P(0), dx, P(1), dW);
  if (db.extent(0) > 0)
    column_reduce<P>("linear::backward_db", dy.extent(0), dy.extent(1),
                     KOKKOS_LAMBDA(index_t i, index_t j) { return P(dy(i, j)); }, db, true);
}

#define MM_INSTANTIATE(T)                                                                                      \
  template void linear_forward<T>(const UView2<const T>&, const UView2<const T>&, const View1<const acc_t<T>>&, \
                                  const UView2<T>&);                                                          \
  template void linear_backward<T>(const UView2<const T>&, const UView2<const T>&, const UView2<const T>&,      \
                                   const UView2<T>&, bool, const UView2<acc_t<T>>&, const View1<acc_t<T>>&);
MM_INSTANTIATE(float)
MM_INSTANTIATE(double)
#undef MM_INSTANTIATE

}  // namespace mm
