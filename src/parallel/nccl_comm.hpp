// The NCCL backend of the communicator interface (CUDA builds with MAMBAMOE_ENABLE_NCCL only; everything else goes
// through parallel/grid.hpp: nccl_available(), make_nccl_comm(), ProcessGrid(..., Backend::nccl)).
//
// NcclComm runs every collective on Kokkos' CUDA stream (Kokkos::Cuda().cuda_stream()) and synchronises that stream
// before it returns: the interface stays blocking, as with MpiComm (start_allgather alone runs on a side stream
// and returns at once, for the data-parallel gradient exchange that overlaps the backward). Each call first fences
// Kokkos, so device data that any Kokkos kernel wrote is complete. Every method takes device pointers (device or
// managed memory, passed to NCCL as they are) and host pointers (pageable or pinned: staged through a device
// scratch buffer that the communicator keeps and grows), so the callers written for MpiComm's host buffers work
// unchanged, and the View helpers of Comm hand it view.data() directly (device_buffers() is true). bytes_sent()
// counts exactly what MpiComm counts. NCCL and CUDA failures throw mm::Error naming the call and the library's
// error string.
#pragma once

#include <memory>
#include <string>

#include "parallel/comm.hpp"

namespace mm::parallel {

// Collective over `comm`: "" when every rank drives a different GPU (host name + PCI bus id of Kokkos' device),
// else a sentence naming two ranks that share one (NCCL cannot put them in one communicator).
std::string nccl_device_conflict(MPI_Comm comm);
inline bool nccl_devices_distinct(MPI_Comm comm) { return nccl_device_conflict(comm).empty(); }

class NcclComm final : public Comm {
 public:
  // Collective over `comm` (rank 0 makes the NCCL unique id, MPI_Bcast hands it out, every rank joins with
  // ncclCommInitRank on Kokkos' device). Takes ownership of `comm` (frees it; it also serves barrier()).
  explicit NcclComm(MPI_Comm comm);
  ~NcclComm() override;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  bool device_buffers() const override { return true; }
  void barrier() const override;
  void allreduce_sum(void* buf, std::size_t count, DType t) const override;
  void allgather(const void* send, void* recv, std::size_t count, DType t) const override;
  void broadcast(void* buf, std::size_t count, DType t, int root) const override;
  void sendrecv(const void* send, std::size_t send_count, int dest, void* recv, std::size_t recv_count, int src,
                DType t) const override;
  void alltoallv(const void* send, const std::vector<std::size_t>& send_counts, void* recv,
                 const std::vector<std::size_t>& recv_counts, DType t) const override;
  // Device buffers: on a side stream that first waits for Kokkos' stream; wait() makes Kokkos' stream wait for
  // it, the host never does. Host buffers: the blocking allgather.
  std::unique_ptr<Pending> start_allgather(const void* send, void* recv, std::size_t count, DType t) const override;
  using Comm::allgather;
  using Comm::allreduce_sum;
  using Comm::alltoallv;
  using Comm::broadcast;
  using Comm::sendrecv;
  using Comm::start_allgather;
  MPI_Comm mpi_handle() const;

 private:
  struct Impl;  // the NCCL communicator and the scratch buffer (no NCCL or CUDA types in this header)
  std::unique_ptr<Impl> impl_;
  int rank_ = 0, size_ = 1;
};

}  // namespace mm::parallel
