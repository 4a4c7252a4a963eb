// The rotary pair and its backward, shared by the Mamba-3 scan's Kokkos kernels (scan.cpp) and its native CUDA
// rotation backward (rotate_cuda.cpp).
#pragma once

#include "core/kokkos_types.hpp"

namespace mm {

// The pair (x0, x1) rotated by the angle with sine s and cosine c: (x0 c - x1 s, x0 s + x1 c).
template <class T>
KOKKOS_INLINE_FUNCTION void rot_pair(T& x0, T& x1, T s, T c) {
  const T a = x0 * c - x1 * s, b = x0 * s + x1 * c;
  x0 = a;
  x1 = b;
}
// rot_pair's backward: back-rotates the gradient (g0, g1) of the rotated pair (y0, y1) by the angle, adding the
// angle's gradient to acc
template <class T>
KOKKOS_INLINE_FUNCTION void rot_pair_bwd(T& g0, T& g1, T y0, T y1, T s, T c, T& acc) {
  acc += -g0 * y1 + g1 * y0;
  const T a0 = g0 * c + g1 * s, a1 = -g0 * s + g1 * c;
  g0 = a0;
  g1 = a1;
}

}  // namespace mm
