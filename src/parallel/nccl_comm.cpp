#include "parallel/nccl_comm.hpp"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <initializer_list>

namespace mm::parallel {

namespace {

void cuda_check(cudaError_t rc, const char* call) {
  if (rc != cudaSuccess) throw Error("CUDA", std::string(call) + " failed: " + cudaGetErrorString(rc));
}

void nccl_check(ncclResult_t rc, const char* call) {
  if (rc != ncclSuccess) throw Error("NCCL", std::string(call) + " failed: " + ncclGetErrorString(rc));
}

void mpi_check(int rc, const char* call) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    throw Error("MPI", std::string(call) + " failed: " + std::string(msg, std::size_t(len)));
  }
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::i64: return ncclInt64;
  }
  return ncclFloat64;
}

// Device or managed memory goes to NCCL as it is; anything else (pageable or pinned host memory) is staged.
bool on_device(const void* p) {
  if (p == nullptr) return false;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();  // older runtimes flag unregistered host memory as an error: clear it
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

constexpr std::size_t kAlign = 256;
std::size_t aligned(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// One buffer of a call: `user` is the caller's pointer; `dev` what NCCL gets (the same pointer, or a scratch
// region for host memory, filled before the collective when `in` and copied back after it when `out`).
struct Region {
  void* user;
  std::size_t bytes;
  bool in, out;
  void* dev = nullptr;
  bool staged = false;
};

cudaStream_t kokkos_stream() { return Kokkos::Cuda().cuda_stream(); }

}  // namespace

struct NcclComm::Impl {
  MPI_Comm mpi = MPI_COMM_NULL;
  ncclComm_t nccl = nullptr;
  char* scratch = nullptr;
  std::size_t scratch_bytes = 0;
  cudaStream_t side = nullptr;  // the started (non-blocking) collectives' stream, made on first use

  // Point every region at its device buffer (growing the scratch buffer for the host ones) and copy the staged
  // inputs in. Every call ends with the stream synchronised, so the old scratch buffer is idle when it is replaced.
  void stage(std::initializer_list<Region*> regions, cudaStream_t s) {
    std::size_t need = 0;
    for (Region* r : regions) {
      r->staged = r->bytes > 0 && !on_device(r->user);
      if (r->staged) need += aligned(r->bytes);
    }
    if (need > scratch_bytes) {
      if (scratch) cuda_check(cudaFree(scratch), "cudaFree");
      scratch = nullptr, scratch_bytes = 0;
      const std::size_t bytes = std::max(need, std::size_t(1) << 20);
      cuda_check(cudaMalloc(reinterpret_cast<void**>(&scratch), bytes), "cudaMalloc (NcclComm scratch)");
      scratch_bytes = bytes;
    }
    std::size_t off = 0;
    for (Region* r : regions) {
      if (!r->staged) {
        r->dev = r->user;
        continue;
      }
      r->dev = scratch + off;
      off += aligned(r->bytes);
      if (r->in) cuda_check(cudaMemcpyAsync(r->dev, r->user, r->bytes, cudaMemcpyHostToDevice, s), "cudaMemcpyAsync");
    }
  }
  // Copy the staged outputs back and wait for the stream: the interface is blocking.
  void finish(std::initializer_list<Region*> regions, cudaStream_t s) {
    for (Region* r : regions)
      if (r->staged && r->out)
        cuda_check(cudaMemcpyAsync(r->user, r->dev, r->bytes, cudaMemcpyDeviceToHost, s), "cudaMemcpyAsync");
    cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  }
};

std::string nccl_device_conflict(MPI_Comm comm) {
  int rank = 0, size = 1;
  mpi_check(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  mpi_check(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  constexpr int kLen = 2 * MPI_MAX_PROCESSOR_NAME + 64;
  std::vector<char> mine(kLen, '\0'), all(std::size_t(kLen) * std::size_t(size), '\0');
  int len = 0;
  std::vector<char> host(MPI_MAX_PROCESSOR_NAME + 1, '\0');
  mpi_check(MPI_Get_processor_name(host.data(), &len), "MPI_Get_processor_name");
  char bus[64] = {0};
  const int device = Kokkos::Cuda().cuda_device();
  const cudaError_t rc = cudaDeviceGetPCIBusId(bus, int(sizeof bus), device);
  if (rc != cudaSuccess) std::snprintf(bus, sizeof bus, "device %d", device);
  std::snprintf(mine.data(), kLen, "%s GPU %s", host.data(), bus);
  mpi_check(MPI_Allgather(mine.data(), kLen, MPI_CHAR, all.data(), kLen, MPI_CHAR, comm), "MPI_Allgather");
  for (int p = 0; p < size; ++p)
    for (int q = p + 1; q < size; ++q)
      if (std::strncmp(&all[std::size_t(p) * kLen], &all[std::size_t(q) * kLen], kLen) == 0)
        return "ranks " + std::to_string(p) + " and " + std::to_string(q) + " of the communicator both drive " +
               std::string(&all[std::size_t(p) * kLen]) +
               " (NCCL needs one GPU per rank: run as many ranks per node as GPUs, or use backend = mpi)";
  return "";
}

NcclComm::NcclComm(MPI_Comm comm) : impl_(std::make_unique<Impl>()) {
  impl_->mpi = comm;
  mpi_check(MPI_Comm_rank(comm, &rank_), "MPI_Comm_rank");
  mpi_check(MPI_Comm_size(comm, &size_), "MPI_Comm_size");
  const std::string conflict = nccl_device_conflict(comm);
  require(conflict.empty(), "NcclComm", conflict);
  cuda_check(cudaSetDevice(Kokkos::Cuda().cuda_device()), "cudaSetDevice");
  // rank 0's unique id and the result of making it travel together, so a failure throws on every rank
  struct {
    int rc;
    ncclUniqueId id;
  } msg{};
  if (rank_ == 0) msg.rc = int(ncclGetUniqueId(&msg.id));
  mpi_check(MPI_Bcast(&msg, int(sizeof msg), MPI_BYTE, 0, comm), "MPI_Bcast");
  nccl_check(ncclResult_t(msg.rc), "ncclGetUniqueId (rank 0)");
  nccl_check(ncclCommInitRank(&impl_->nccl, size_, msg.id, rank_), "ncclCommInitRank");
}

NcclComm::~NcclComm() {
  // After Kokkos::finalize (a communicator held until static destruction) the CUDA context may be gone: leave the
  // NCCL resources to the process's exit then.
  if (Kokkos::is_initialized() && !Kokkos::is_finalized()) {
    if (impl_->nccl) (void)ncclCommDestroy(impl_->nccl);
    if (impl_->scratch) (void)cudaFree(impl_->scratch);
    if (impl_->side) (void)cudaStreamDestroy(impl_->side);
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && impl_->mpi != MPI_COMM_NULL && impl_->mpi != MPI_COMM_WORLD && impl_->mpi != MPI_COMM_SELF)
    MPI_Comm_free(&impl_->mpi);
}

MPI_Comm NcclComm::mpi_handle() const { return impl_->mpi; }

void NcclComm::barrier() const {
  Kokkos::fence("mm::NcclComm::barrier");
  mpi_check(MPI_Barrier(impl_->mpi), "MPI_Barrier");
}

void NcclComm::allreduce_sum(void* buf, std::size_t count, DType t) const {
  const std::size_t bytes = count * dtype_size(t);
  bytes_sent_ += bytes;
  if (count == 0) return;
  Kokkos::fence("mm::NcclComm::allreduce_sum");
  const cudaStream_t s = kokkos_stream();
  Region b{buf, bytes, true, true};
  impl_->stage({&b}, s);
  nccl_check(ncclAllReduce(b.dev, b.dev, count, nccl_type(t), ncclSum, impl_->nccl, s), "ncclAllReduce");
  impl_->finish({&b}, s);
}

void NcclComm::allgather(const void* send, void* recv, std::size_t count, DType t) const {
  const std::size_t bytes = count * dtype_size(t);
  bytes_sent_ += bytes;
  if (count == 0) return;
  Kokkos::fence("mm::NcclComm::allgather");
  const cudaStream_t s = kokkos_stream();
  Region in{const_cast<void*>(send), bytes, true, false}, out{recv, bytes * std::size_t(size_), false, true};
  impl_->stage({&in, &out}, s);
  nccl_check(ncclAllGather(in.dev, out.dev, count, nccl_type(t), impl_->nccl, s), "ncclAllGather");
  impl_->finish({&in, &out}, s);
}

namespace {
// A collective on the side stream: `done` is recorded there after it; wait() makes Kokkos' stream wait for it
// (no host synchronisation).
struct NcclPending final : Pending {
  cudaEvent_t done = nullptr;
  bool waited = false;
  ~NcclPending() override {
    if (!done) return;
    if (!waited) (void)cudaStreamWaitEvent(kokkos_stream(), done, 0);
    (void)cudaEventDestroy(done);
  }
  void wait() override {
    if (!waited) cuda_check(cudaStreamWaitEvent(kokkos_stream(), done, 0), "cudaStreamWaitEvent");
    waited = true;
  }
};
}  // namespace

std::unique_ptr<Pending> NcclComm::start_allgather(const void* send, void* recv, std::size_t count,
                                                   DType t) const {
  if (count == 0 || !on_device(send) || !on_device(recv)) return Comm::start_allgather(send, recv, count, t);
  bytes_sent_ += count * dtype_size(t);
  if (!impl_->side) cuda_check(cudaStreamCreateWithFlags(&impl_->side, cudaStreamNonBlocking), "cudaStreamCreate");
  // the side stream starts after what is already on Kokkos' stream
  cudaEvent_t ready = nullptr;
  cuda_check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate");
  cuda_check(cudaEventRecord(ready, kokkos_stream()), "cudaEventRecord");
  cuda_check(cudaStreamWaitEvent(impl_->side, ready, 0), "cudaStreamWaitEvent");
  (void)cudaEventDestroy(ready);  // released once recorded work completes
  auto p = std::make_unique<NcclPending>();
  cuda_check(cudaEventCreateWithFlags(&p->done, cudaEventDisableTiming), "cudaEventCreate");
  nccl_check(ncclAllGather(send, recv, count, nccl_type(t), impl_->nccl, impl_->side), "ncclAllGather (started)");
  cuda_check(cudaEventRecord(p->done, impl_->side), "cudaEventRecord");
  return p;
}

void NcclComm::broadcast(void* buf, std::size_t count, DType t, int root) const {
  require(root >= 0 && root < size_, "NcclComm::broadcast", "root ", root, " is not a rank of ", size_);
  const std::size_t bytes = count * dtype_size(t);
  if (root == rank_) bytes_sent_ += bytes;
  if (count == 0) return;
  Kokkos::fence("mm::NcclComm::broadcast");
  const cudaStream_t s = kokkos_stream();
  Region b{buf, bytes, root == rank_, root != rank_};
  impl_->stage({&b}, s);
  nccl_check(ncclBroadcast(b.dev, b.dev, count, nccl_type(t), root, impl_->nccl, s), "ncclBroadcast");
  impl_->finish({&b}, s);
}

void NcclComm::sendrecv(const void* send, std::size_t send_count, int dest, void* recv, std::size_t recv_count,
                        int src, DType t) const {
  require(dest < size_ && src < size_, "NcclComm::sendrecv", "dest = ", dest, ", src = ", src, " on ", size_,
          " ranks");
  const std::size_t sz = dtype_size(t);
  if (dest >= 0) bytes_sent_ += send_count * sz;
  const bool do_send = dest >= 0 && send_count > 0, do_recv = src >= 0 && recv_count > 0;
  if (!do_send && !do_recv) return;
  Kokkos::fence("mm::NcclComm::sendrecv");
  const cudaStream_t s = kokkos_stream();
  Region in{const_cast<void*>(send), do_send ? send_count * sz : 0, true, false},
      out{recv, do_recv ? recv_count * sz : 0, false, true};
  impl_->stage({&in, &out}, s);
  nccl_check(ncclGroupStart(), "ncclGroupStart");
  if (do_send) nccl_check(ncclSend(in.dev, send_count, nccl_type(t), dest, impl_->nccl, s), "ncclSend");
  if (do_recv) nccl_check(ncclRecv(out.dev, recv_count, nccl_type(t), src, impl_->nccl, s), "ncclRecv");
  nccl_check(ncclGroupEnd(), "ncclGroupEnd");
  impl_->finish({&in, &out}, s);
}

void NcclComm::alltoallv(const void* send, const std::vector<std::size_t>& send_counts, void* recv,
                         const std::vector<std::size_t>& recv_counts, DType t) const {
  const std::size_t n = std::size_t(size_), sz = dtype_size(t);
  require(send_counts.size() == n && recv_counts.size() == n, "NcclComm::alltoallv",
          "one count per rank is needed: got ", send_counts.size(), " send and ", recv_counts.size(),
          " receive counts for ", n, " ranks");
  require(send_counts[std::size_t(rank_)] == recv_counts[std::size_t(rank_)], "NcclComm::alltoallv", "rank ", rank_,
          " sends ", send_counts[std::size_t(rank_)], " elements to itself but expects ",
          recv_counts[std::size_t(rank_)]);
  std::vector<std::size_t> soff(n), roff(n);
  std::size_t stotal = 0, rtotal = 0;
  for (std::size_t q = 0; q < n; ++q) {
    soff[q] = stotal, stotal += send_counts[q];
    roff[q] = rtotal, rtotal += recv_counts[q];
    if (int(q) != rank_) bytes_sent_ += send_counts[q] * sz;
  }
  if (stotal == 0 && rtotal == 0) return;
  Kokkos::fence("mm::NcclComm::alltoallv");
  const cudaStream_t s = kokkos_stream();
  Region in{const_cast<void*>(send), stotal * sz, true, false}, out{recv, rtotal * sz, false, true};
  impl_->stage({&in, &out}, s);
  const char* sd = static_cast<const char*>(in.dev);
  char* rd = static_cast<char*>(out.dev);
  const std::size_t self = std::size_t(rank_);
  if (send_counts[self] > 0)
    cuda_check(cudaMemcpyAsync(rd + roff[self] * sz, sd + soff[self] * sz, send_counts[self] * sz,
                               cudaMemcpyDeviceToDevice, s),
               "cudaMemcpyAsync");
  if (n > 1) {
    nccl_check(ncclGroupStart(), "ncclGroupStart");
    for (std::size_t q = 0; q < n; ++q) {
      if (q == self) continue;
      if (send_counts[q] > 0)
        nccl_check(ncclSend(sd + soff[q] * sz, send_counts[q], nccl_type(t), int(q), impl_->nccl, s), "ncclSend");
      if (recv_counts[q] > 0)
        nccl_check(ncclRecv(rd + roff[q] * sz, recv_counts[q], nccl_type(t), int(q), impl_->nccl, s), "ncclRecv");
    }
    nccl_check(ncclGroupEnd(), "ncclGroupEnd");
  }
  impl_->finish({&in, &out}, s);
}

}  // namespace mm::parallel
