#include "parallel/comm.hpp"

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
  check(MPI_Allreduce(MPI_IN_PLACE, buf, as_count(count, "allreduce"), mpi_type(t), MPI_SUM, comm_),
        "MPI_Allreduce");
}

void MpiComm::allgather(const void* send, void* recv, std::size_t count, DType t) const {
  const int n = as_count(count, "allgather");
  check(MPI_Allgather(send, n, mpi_type(t), recv, n, mpi_type(t), comm_), "MPI_Allgather");
}

void MpiComm::broadcast(void* buf, std::size_t count, DType t, int root) const {
  check(MPI_Bcast(buf, as_count(count, "broadcast"), mpi_type(t), root, comm_), "MPI_Bcast");
}

}  // namespace mm::parallel
