// The communicator interface of mambamoe: the collectives the parallel layouts need, on host buffers (typed
// helpers below also take Kokkos Views, copying through host memory when the View lives on the device). One
// interface, a backend per transport: MpiComm (host memory, the CPU path) here; an NCCL backend (device memory)
// comes with the GPU layouts. The collectives are blocking and their results do not depend on the rank count
// beyond what the caller asks for: allgather returns every rank's contribution in rank order, so callers that need
// bit-identical results at any layout sum the gathered parts themselves in a fixed order (allreduce_sum is for
// integer counts and for values whose reduction order does not matter).
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/error.hpp"
#include "core/kokkos_types.hpp"

namespace mm::parallel {

enum class DType { f32, f64, i64 };

template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::f32;
  else if constexpr (std::is_same_v<T, double>) return DType::f64;
  else {
    static_assert(std::is_same_v<T, std::int64_t>, "Comm: float, double or int64 buffers only");
    return DType::i64;
  }
}

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual void barrier() const = 0;
  // In place, over `count` elements of `buf` (host memory).
  virtual void allreduce_sum(void* buf, std::size_t count, DType t) const = 0;
  // `recv` holds size() * count elements: rank q's `count` elements at offset q * count.
  virtual void allgather(const void* send, void* recv, std::size_t count, DType t) const = 0;
  virtual void broadcast(void* buf, std::size_t count, DType t, int root) const = 0;

  // typed host helpers
  template <class T>
  void allreduce_sum(T* buf, std::size_t count) const { allreduce_sum(buf, count, dtype_of<T>()); }
  template <class T>
  std::vector<T> allgather(const std::vector<T>& send) const {
    std::vector<T> recv(send.size() * std::size_t(size()));
    allgather(send.data(), recv.data(), send.size(), dtype_of<T>());
    return recv;
  }
  template <class T>
  void broadcast(T* buf, std::size_t count, int root) const { broadcast(buf, count, dtype_of<T>(), root); }

  // Views (any memory space): `recv` has extent size() * send.extent(0).
  template <class T>
  void allgather(const View1<T>& send, const View1<T>& recv) const;
  template <class T>
  void allreduce_sum(const View1<T>& buf) const;
  template <class T>
  void broadcast(const View1<T>& buf, int root) const;
};

// MPI backend over a communicator it owns (a duplicate or a split of the one given).
class MpiComm final : public Comm {
 public:
  explicit MpiComm(MPI_Comm comm);  // takes ownership (frees it)
  ~MpiComm() override;
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void barrier() const override;
  void allreduce_sum(void* buf, std::size_t count, DType t) const override;
  void allgather(const void* send, void* recv, std::size_t count, DType t) const override;
  void broadcast(void* buf, std::size_t count, DType t, int root) const override;
  using Comm::allgather;
  using Comm::allreduce_sum;
  using Comm::broadcast;
  MPI_Comm handle() const { return comm_; }

 private:
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
};

// ---------------------------------------------------------------- View helpers (host staging)
template <class T>
void Comm::allgather(const View1<T>& send, const View1<T>& recv) const {
  const std::size_t n = send.extent(0);
  require(recv.extent(0) == n * std::size_t(size()), "Comm::allgather", "receive extent ", recv.extent(0),
          " is not ranks (", size(), ") x send extent (", n, ")");
  auto hs = Kokkos::create_mirror_view_and_copy(HostMem(), send);
  auto hr = Kokkos::create_mirror_view(HostMem(), recv);
  allgather(hs.data(), hr.data(), n, dtype_of<T>());
  Kokkos::deep_copy(recv, hr);
}

template <class T>
void Comm::allreduce_sum(const View1<T>& buf) const {
  auto h = Kokkos::create_mirror_view_and_copy(HostMem(), buf);
  allreduce_sum(h.data(), h.extent(0), dtype_of<T>());
  Kokkos::deep_copy(buf, h);
}

template <class T>
void Comm::broadcast(const View1<T>& buf, int root) const {
  auto h = Kokkos::create_mirror_view_and_copy(HostMem(), buf);
  broadcast(h.data(), h.extent(0), dtype_of<T>(), root);
  Kokkos::deep_copy(buf, h);
}

}  // namespace mm::parallel
