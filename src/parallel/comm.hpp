// The communicator interface of mambamoe: the collectives the parallel layouts need, on host buffers (typed
// helpers below also take Kokkos Views, copying through host memory when the View lives on the device, unless the
// backend takes device buffers itself). One interface, a backend per transport: MpiComm (host memory, the CPU path)
// here; NcclComm (parallel/nccl_comm.hpp, CUDA builds with NCCL: device memory, and host memory staged through the
// device) for the GPU layouts. The collectives are blocking and their results do not depend on the rank count
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

// A collective started by one of Comm's start_* calls (see there). wait() returns once work issued afterwards
// (host code, and kernels on Kokkos' default execution space) may use its result; poll() lets a host transport
// advance it (MPI progresses non-blocking collectives only inside MPI calls) and never blocks. Destroying it
// unwaited waits.
class Pending {
 public:
  virtual ~Pending() = default;
  virtual void wait() = 0;
  virtual void poll() {}
};

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // True when the backend accepts device pointers (and host pointers) itself: the View helpers below then hand it
  // view.data() instead of a host mirror.
  virtual bool device_buffers() const { return false; }
  // Bytes this rank has handed to the transport since construction (or the last reset): what sendrecv sends, what
  // alltoallv sends to other ranks, an allgather's or allreduce's contribution, a broadcast root's buffer. The
  // traffic formulas of the parallel layers are checked against it.
  std::uint64_t bytes_sent() const { return bytes_sent_; }
  void reset_bytes_sent() const { bytes_sent_ = 0; }
  virtual void barrier() const = 0;
  // In place, over `count` elements of `buf` (host memory).
  virtual void allreduce_sum(void* buf, std::size_t count, DType t) const = 0;
  // `recv` holds size() * count elements: rank q's `count` elements at offset q * count.
  virtual void allgather(const void* send, void* recv, std::size_t count, DType t) const = 0;
  virtual void broadcast(void* buf, std::size_t count, DType t, int root) const = 0;
  // Point to point, both directions at once: send `send_count` elements to rank `dest` and receive `recv_count`
  // from rank `src`; -1 for either rank means none (a chain's ends).
  virtual void sendrecv(const void* send, std::size_t send_count, int dest, void* recv, std::size_t recv_count,
                        int src, DType t) const = 0;
  // Every rank sends send_counts[q] elements to rank q (from `send`, packed in rank order) and receives
  // recv_counts[q] from rank q (into `recv`, packed in rank order).
  virtual void alltoallv(const void* send, const std::vector<std::size_t>& send_counts, void* recv,
                         const std::vector<std::size_t>& recv_counts, DType t) const = 0;
  // Non-blocking allgather (the layout of allgather) of buffers the backend can take as they are (host memory for
  // MpiComm, device memory for NcclComm): `send` is read as the work already issued to Kokkos' default execution
  // space leaves it, and the call returns without waiting for that work or for the transfer. Until wait(), the
  // caller must not write `send` nor touch `recv`, and must start no other collective on this communicator (the
  // transports order one communicator's collectives by their start). The default runs the blocking allgather.
  virtual std::unique_ptr<Pending> start_allgather(const void* send, void* recv, std::size_t count, DType t) const;

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
  template <class T>
  void sendrecv(const T* send, std::size_t send_count, int dest, T* recv, std::size_t recv_count, int src) const {
    sendrecv(send, send_count, dest, recv, recv_count, src, dtype_of<T>());
  }
  // alltoallv of counts (one per rank) then of the data: returns what every rank sent here, packed in rank order,
  // and fills `recv_counts`.
  template <class T>
  std::vector<T> alltoallv(const std::vector<T>& send, const std::vector<std::size_t>& send_counts,
                           std::vector<std::size_t>& recv_counts) const;

  // Views (any memory space): `recv` has extent size() * send.extent(0).
  template <class T>
  void allgather(const View1<T>& send, const View1<T>& recv) const;
  // Views (any memory space), `count` elements to and from every rank: rank q's part of `send` is
  // [q count, (q + 1) count), and what rank q sent here lands at the same place in `recv`.
  template <class T>
  void alltoall(const View1<T>& send, const View1<T>& recv, std::size_t count) const;
  // Contiguous Views of any rank (any memory space): alltoallv of their elements, counts in elements (see the
  // pointer version). A backend that takes device buffers gets the Views' memory as it is.
  template <class V>
  void alltoallv_view(const V& send, const std::vector<std::size_t>& send_counts, const V& recv,
                      const std::vector<std::size_t>& recv_counts) const;
  template <class T>
  void allreduce_sum(const View1<T>& buf) const;
  template <class T>
  void broadcast(const View1<T>& buf, int root) const;
  // Views: start_allgather when the backend takes the Views' memory as it is, else the blocking (staged)
  // allgather with an already finished Pending.
  template <class T>
  std::unique_ptr<Pending> start_allgather(const View1<T>& send, const View1<T>& recv) const;

 protected:
  // The Pending of a collective that already ran to completion (the blocking fallbacks of start_allgather).
  static std::unique_ptr<Pending> finished();
  mutable std::uint64_t bytes_sent_ = 0;
};

// One rank, no MPI: what a dimension of size 1 uses (unit tests and single-rank runs need no MPI_Init).
class SelfComm final : public Comm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void barrier() const override {}
  void allreduce_sum(void*, std::size_t, DType) const override {}
  void allgather(const void* send, void* recv, std::size_t count, DType t) const override;
  void broadcast(void*, std::size_t, DType, int) const override {}
  void sendrecv(const void* send, std::size_t send_count, int dest, void* recv, std::size_t recv_count, int src,
                DType t) const override;
  void alltoallv(const void* send, const std::vector<std::size_t>& send_counts, void* recv,
                 const std::vector<std::size_t>& recv_counts, DType t) const override;
  using Comm::allgather;
  using Comm::allreduce_sum;
  using Comm::alltoallv;
  using Comm::broadcast;
  using Comm::sendrecv;
};

std::size_t dtype_size(DType t);

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
  void sendrecv(const void* send, std::size_t send_count, int dest, void* recv, std::size_t recv_count, int src,
                DType t) const override;
  void alltoallv(const void* send, const std::vector<std::size_t>& send_counts, void* recv,
                 const std::vector<std::size_t>& recv_counts, DType t) const override;
  // MPI_Iallgather on host memory (after a Kokkos fence, so `send` is complete)
  std::unique_ptr<Pending> start_allgather(const void* send, void* recv, std::size_t count, DType t) const override;
  using Comm::allgather;
  using Comm::allreduce_sum;
  using Comm::alltoallv;
  using Comm::broadcast;
  using Comm::sendrecv;
  using Comm::start_allgather;
  MPI_Comm handle() const { return comm_; }

 private:
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
};

// ---------------------------------------------------------------- View helpers (host staging unless device_buffers())
template <class T>
std::vector<T> Comm::alltoallv(const std::vector<T>& send, const std::vector<std::size_t>& send_counts,
                               std::vector<std::size_t>& recv_counts) const {
  const std::size_t n = std::size_t(size());
  require(send_counts.size() == n, "Comm::alltoallv", send_counts.size(), " send counts for ", n, " ranks");
  std::size_t total = 0;
  for (auto c : send_counts) total += c;
  require(total == send.size(), "Comm::alltoallv", "send counts sum to ", total, " but ", send.size(),
          " elements are given");
  std::vector<std::int64_t> sc(send_counts.begin(), send_counts.end()), rc(n);
  std::vector<std::size_t> ones(n, 1);
  alltoallv(sc.data(), ones, rc.data(), ones, DType::i64);
  recv_counts.assign(rc.begin(), rc.end());
  std::size_t rtotal = 0;
  for (auto c : recv_counts) rtotal += c;
  std::vector<T> recv(rtotal);
  alltoallv(send.data(), send_counts, recv.data(), recv_counts, dtype_of<T>());
  return recv;
}

template <class T>
void Comm::allgather(const View1<T>& send, const View1<T>& recv) const {
  const std::size_t n = send.extent(0);
  require(recv.extent(0) == n * std::size_t(size()), "Comm::allgather", "receive extent ", recv.extent(0),
          " is not ranks (", size(), ") x send extent (", n, ")");
  if (device_buffers()) {
    allgather(send.data(), recv.data(), n, dtype_of<T>());
    return;
  }
  auto hs = Kokkos::create_mirror_view_and_copy(HostMem(), send);
  auto hr = Kokkos::create_mirror_view(HostMem(), recv);
  allgather(hs.data(), hr.data(), n, dtype_of<T>());
  Kokkos::deep_copy(recv, hr);
}

template <class T>
void Comm::alltoall(const View1<T>& send, const View1<T>& recv, std::size_t count) const {
  const std::size_t total = count * std::size_t(size());
  require(send.extent(0) >= total && recv.extent(0) >= total, "Comm::alltoall", "buffers of ", send.extent(0),
          " and ", recv.extent(0), " elements for ", size(), " ranks x ", count);
  const std::vector<std::size_t> counts(std::size_t(size()), count);
  alltoallv_view(send, counts, recv, counts);
}

template <class V>
void Comm::alltoallv_view(const V& send, const std::vector<std::size_t>& send_counts, const V& recv,
                          const std::vector<std::size_t>& recv_counts) const {
  using T = typename V::non_const_value_type;
  require(send.span_is_contiguous() && recv.span_is_contiguous(), "Comm::alltoallv_view", "non-contiguous View");
  if (device_buffers()) {
    alltoallv(send.data(), send_counts, recv.data(), recv_counts, dtype_of<T>());
    return;
  }
  auto hs = Kokkos::create_mirror_view_and_copy(HostMem(), send);
  auto hr = Kokkos::create_mirror_view(HostMem(), recv);
  alltoallv(hs.data(), send_counts, hr.data(), recv_counts, dtype_of<T>());
  Kokkos::deep_copy(recv, hr);
}

template <class T>
void Comm::allreduce_sum(const View1<T>& buf) const {
  if (device_buffers()) {
    allreduce_sum(buf.data(), buf.extent(0), dtype_of<T>());
    return;
  }
  auto h = Kokkos::create_mirror_view_and_copy(HostMem(), buf);
  allreduce_sum(h.data(), h.extent(0), dtype_of<T>());
  Kokkos::deep_copy(buf, h);
}

template <class T>
void Comm::broadcast(const View1<T>& buf, int root) const {
  if (device_buffers()) {
    broadcast(buf.data(), buf.extent(0), dtype_of<T>(), root);
    return;
  }
  auto h = Kokkos::create_mirror_view_and_copy(HostMem(), buf);
  broadcast(h.data(), h.extent(0), dtype_of<T>(), root);
  Kokkos::deep_copy(buf, h);
}

template <class T>
std::unique_ptr<Pending> Comm::start_allgather(const View1<T>& send, const View1<T>& recv) const {
  const std::size_t n = send.extent(0);
  require(recv.extent(0) == n * std::size_t(size()), "Comm::start_allgather", "receive extent ", recv.extent(0),
          " is not ranks (", size(), ") x send extent (", n, ")");
  constexpr bool host = Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename View1<T>::memory_space>::accessible;
  if (device_buffers() != host) return start_allgather(send.data(), recv.data(), n, dtype_of<T>());
  allgather(send, recv);
  return finished();
}

}  // namespace mm::parallel
