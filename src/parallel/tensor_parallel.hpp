// Tensor-parallel (Megatron layout) helpers shared by the layers: the slice of a dimension a tp rank owns, and the
// all-reduce of a row-parallel layer's partial outputs (or of a column-parallel layer's partial input gradients).
//
// Over MPI the all-reduce gathers every rank's partial sum and adds the parts in rank order on each rank, so every
// tp rank holds bit-identical activations whatever algorithm the transport uses (the replicated computations
// downstream of a tp layer must not drift apart between the ranks of a tp group), and the result is deterministic.
// Over NCCL (device buffers) it is NCCL's all-reduce in place, whose result is the same on every rank.
#pragma once

#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/kokkos_types.hpp"
#include "parallel/comm.hpp"

namespace mm::parallel {

// Rank `rank` of `size` owns elements [first, first + count) of a dimension of `n` elements (n divides by size).
struct TpSlice {
  index_t first = 0, count = 0;
};
inline TpSlice tp_slice(index_t n, int rank, int size) { return {n / size * rank, n / size}; }

// x (any shape, contiguous) = the sum over the ranks of `comm` of their x. Nothing happens when comm has one rank.
template <class V>
void tp_allreduce_sum(const Comm& comm, const V& x, const char* what) {
  using T = typename V::non_const_value_type;
  const int n = comm.size();
  if (n == 1) return;
  require(x.span_is_contiguous(), what, "the tensor-parallel all-reduce needs a contiguous buffer");
  const std::size_t count = x.span();
  if (comm.device_buffers()) {  // NCCL: in place on the device; every rank receives the same reduced bits
    comm.allreduce_sum(x.data(), count, dtype_of<T>());
    return;
  }
  auto h = Kokkos::create_mirror_view_and_copy(HostMem(), x);
  std::vector<T> all(count * std::size_t(n));
  comm.allgather(h.data(), all.data(), count, dtype_of<T>());
  T* out = h.data();
  for (std::size_t i = 0; i < count; ++i) {
    T s = all[i];
    for (int q = 1; q < n; ++q) s += all[std::size_t(q) * count + i];
    out[i] = s;
  }
  Kokkos::deep_copy(x, h);
}

}  // namespace mm::parallel
