#include "parallel/grid.hpp"

#include <type_traits>

#include "core/config.hpp"
#if MAMBAMOE_ENABLE_NCCL
#include "parallel/nccl_comm.hpp"
#endif

namespace mm::parallel {

Layout resolve_layout(Layout l, std::int64_t world) {
  const char* ctx = "[parallel]";
  require(l.tp >= 1 && l.cp >= 1 && l.ep >= 1 && l.dp >= 0, ctx, "tp, cp and ep must be at least 1 and dp at least 0 (",
          "0: the rest); got tp = ", l.tp, ", cp = ", l.cp, ", ep = ", l.ep, ", dp = ", l.dp);
  const std::int64_t model = l.tp * l.cp * l.ep;
  if (l.dp == 0) {
    require(world % model == 0, ctx, "tp * cp * ep = ", l.tp, " * ", l.cp, " * ", l.ep, " = ", model,
            " does not divide the ", world, " MPI ranks (dp = 0 takes the rest)");
    l.dp = world / model;
  }
  require(model * l.dp == world, ctx, "tp = ", l.tp, ", cp = ", l.cp, ", ep = ", l.ep, ", dp = ", l.dp,
          ": the product tp * cp * ep * dp = ", model * l.dp, " but the run has ", world,
          " MPI ranks (they must be equal; dp = 0 takes the rest)");
  return l;
}

bool nccl_available() {
#if MAMBAMOE_ENABLE_NCCL && defined(KOKKOS_ENABLE_CUDA)
  return std::is_same_v<Kokkos::DefaultExecutionSpace, Kokkos::Cuda>;
#else
  return false;
#endif
}

namespace {
// Backend::nccl asked for where it cannot run: say which half is missing.
void require_nccl() {
  if (nccl_available()) return;
  const char* ctx = "[parallel] backend = nccl";
#if !MAMBAMOE_ENABLE_NCCL
  throw Error(ctx, "this build has no NCCL (configure a CUDA build with MAMBAMOE_ENABLE_NCCL=ON and NCCL_ROOT or "
                   "MAMBAMOE_NCCL_ROOT where NCCL is not found by itself); use backend = mpi");
#else
  throw Error(ctx, std::string("NCCL needs Kokkos' default execution space to be Cuda, and it is ") +
                       Kokkos::DefaultExecutionSpace::name() + "; use backend = mpi");
#endif
}
}  // namespace

bool nccl_one_gpu_per_rank(MPI_Comm comm) {
#if MAMBAMOE_ENABLE_NCCL && defined(KOKKOS_ENABLE_CUDA)
  int ok = nccl_available() && nccl_devices_distinct(comm) ? 1 : 0;
#else
  int ok = 0;
#endif
  MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, comm);
  return ok == 1;
}

std::shared_ptr<Comm> make_nccl_comm(MPI_Comm comm) {
  require_nccl();
#if MAMBAMOE_ENABLE_NCCL && defined(KOKKOS_ENABLE_CUDA)
  MPI_Comm c = MPI_COMM_NULL;
  MPI_Comm_dup(comm, &c);
  return std::make_shared<NcclComm>(c);
#else
  return nullptr;
#endif
}

namespace {
std::shared_ptr<const Comm> split(MPI_Comm world, int color, int key, int expected_size, Backend backend) {
  if (expected_size == 1) return std::make_shared<SelfComm>();
  MPI_Comm c = MPI_COMM_NULL;
  MPI_Comm_split(world, color, key, &c);
#if MAMBAMOE_ENABLE_NCCL && defined(KOKKOS_ENABLE_CUDA)
  if (backend == Backend::nccl) return std::make_shared<NcclComm>(c);
#endif
  return std::make_shared<MpiComm>(c);
}
}  // namespace

ProcessGrid::ProcessGrid(const Layout& layout, MPI_Comm world, Backend backend) : backend_(backend) {
  if (backend == Backend::nccl) require_nccl();
  MPI_Comm_rank(world, &world_rank_);
  MPI_Comm_size(world, &world_size_);
  layout_ = resolve_layout(layout, world_size_);
  const int tp = int(layout_.tp), cp = int(layout_.cp), ep = int(layout_.ep), dp = int(layout_.dp);
  const int r = world_rank_;
  const int t = r % tp, c = (r / tp) % cp, e = (r / (tp * cp)) % ep, d = r / (tp * cp * ep);
  // color = the other coordinates, key = the coordinate along the dimension
  tp_ = split(world, r / tp, t, tp, backend);
  cp_ = split(world, t + tp * (e + ep * d), c, cp, backend);
  ep_ = split(world, t + tp * (c + cp * d), e, ep, backend);
  dp_ = split(world, t + tp * (c + cp * e), d, dp, backend);
  data_ = split(world, t + tp * c, e + ep * d, ep * dp, backend);
  tokens_ = split(world, t, r / tp, cp * ep * dp, backend);
  world_ = split(world, 0, r, world_size_, backend);
}

}  // namespace mm::parallel
