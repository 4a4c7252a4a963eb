#include "parallel/comm.hpp"

#include <cstring>

namespace mm::parallel {

namespace {

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::i64: return MPI_INT64_T;
  }
  return MPI_BYTE;
}

void check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    throw Error("MPI", std::string(what) + " failed: " + std::string(msg, std::size_t(len)));
  }
}

int as_count(std::size_t n, const char* what) {
  require(n <= std::size_t(0x7fffffff), "MPI", what, ": ", n, " elements exceed one MPI message (2^31 - 1)");
  return int(n);
}

}  // namespace

std::size_t dtype_size(DType t) { return t == DType::f32 ? 4 : 8; }

std::unique_ptr<Pending> Comm::finished() {
  struct Done final : Pending {
    void wait() override {}
  };
  return std::make_unique<Done>();
}

std::unique_ptr<Pending> Comm::start_allgather(const void* send, void* recv, std::size_t count, DType t) const {
  allgather(send, recv, count, t);
  return finished();
}

namespace {
struct MpiPending final : Pending {
  MPI_Request req = MPI_REQUEST_NULL;
  ~MpiPending() override {
    if (req != MPI_REQUEST_NULL) MPI_Wait(&req, MPI_STATUS_IGNORE);
  }
  void wait() override { check(MPI_Wait(&req, MPI_STATUS_IGNORE), "MPI_Wait (MPI_Iallgather)"); }
  void poll() override {
    int done = 0;
    check(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "MPI_Test (MPI_Iallgather)");
  }
};
}  // namespace

std::unique_ptr<Pending> MpiComm::start_allgather(const void* send, void* recv, std::size_t count, DType t) const {
  bytes_sent_ += count * dtype_size(t);
  auto p = std::make_unique<MpiPending>();
  Kokkos::fence("mm::MpiComm::start_allgather");
  const int n = as_count(count, "MPI_Iallgather");
  check(MPI_Iallgather(send, n, mpi_type(t), recv, n, mpi_type(t), comm_, &p->req), "MPI_Iallgather");
  return p;
}

void SelfComm::allgather(const void* send, void* recv, std::size_t count, DType t) const {
  if (count) std::memmove(recv, send, count * dtype_size(t));
}

void SelfComm::sendrecv(const void*, std::size_t send_count, int dest, void*, std::size_t recv_count, int src,
                        DType) const {
  require((dest < 0 || send_count == 0) && (src < 0 || recv_count == 0), "SelfComm::sendrecv",
          "a one-rank communicator has no neighbour (dest = ", dest, ", src = ", src, ")");
}

void SelfComm::alltoallv(const void* send, const std::vector<std::size_t>& send_counts, void* recv,
                         const std::vector<std::size_t>& recv_counts, DType t) const {
  require(send_counts.size() == 1 && recv_counts.size() == 1 && send_counts[0] == recv_counts[0],
          "SelfComm::alltoallv", "one rank sends to itself: the counts must agree");
  if (send_counts[0]) std::memmove(recv, send, send_counts[0] * dtype_size(t));
}

MpiComm::MpiComm(MPI_Comm comm) : comm_(comm) {
  check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
}

MpiComm::~MpiComm() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && comm_ != MPI_COMM_NULL && comm_ != MPI_COMM_WORLD && comm_ != MPI_COMM_SELF)
    MPI_Comm_free(&comm_);
}

void MpiComm::barrier() const { check(MPI_Barrier(comm_), "MPI_Barrier"); }

void MpiComm::allreduce_sum(void* buf, std::size_t count, DType t) const {
  bytes_sent_ += count * dtype_size(t);
  check(MPI_Allreduce(MPI_IN_PLACE, buf, as_count(count, "allreduce"), mpi_type(t), MPI_SUM, comm_),
        "MPI_Allreduce");
}

void MpiComm::allgather(const void* send, void* recv, std::size_t count, DType t) const {
  const int n = as_count(count, "allgather");
  bytes_sent_ += count * dtype_size(t);
  check(MPI_Allgather(send, n, mpi_type(t), recv, n, mpi_type(t), comm_), "MPI_Allgather");
}

void MpiComm::broadcast(void* buf, std::size_t count, DType t, int root) const {
  if (root == rank_) bytes_sent_ += count * dtype_size(t);
  check(MPI_Bcast(buf, as_count(count, "broadcast"), mpi_type(t), root, comm_), "MPI_Bcast");
}

void MpiComm::sendrecv(const void* send, std::size_t send_count, int dest, void* recv, std::size_t recv_count,
                       int src, DType t) const {
  if (dest >= 0) bytes_sent_ += send_count * dtype_size(t);
  check(MPI_Sendrecv(send, as_count(send_count, "sendrecv"), mpi_type(t), dest < 0 ? MPI_PROC_NULL : dest, 7301,
                     recv, as_count(recv_count, "sendrecv"), mpi_type(t), src < 0 ? MPI_PROC_NULL : src, 7301, comm_,
                     MPI_STATUS_IGNORE),
        "MPI_Sendrecv");
}

void MpiComm::alltoallv(const void* send, const std::vector<std::size_t>& send_counts, void* recv,
                        const std::vector<std::size_t>& recv_counts, DType t) const {
  const std::size_t n = std::size_t(size_);
  require(send_counts.size() == n && recv_counts.size() == n, "MPI", "alltoallv needs one count per rank");
  std::vector<int> sc(n), sd(n), rc(n), rd(n);
  std::size_t so = 0, ro = 0;
  for (std::size_t q = 0; q < n; ++q) {
    sc[q] = as_count(send_counts[q], "alltoallv"), sd[q] = as_count(so, "alltoallv offset"), so += send_counts[q];
    rc[q] = as_count(recv_counts[q], "alltoallv"), rd[q] = as_count(ro, "alltoallv offset"), ro += recv_counts[q];
    if (int(q) != rank_) bytes_sent_ += send_counts[q] * dtype_size(t);
  }
  check(MPI_Alltoallv(send, sc.data(), sd.data(), mpi_type(t), recv, rc.data(), rd.data(), mpi_type(t), comm_),
        "MPI_Alltoallv");
}

}  // namespace mm::parallel
