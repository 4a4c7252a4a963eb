#include "parallel/grid.hpp"

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
  require(l.tp == 1 && l.cp == 1 && l.ep == 1, ctx, "tp = ", l.tp, ", cp = ", l.cp, ", ep = ", l.ep,
          ": tensor, context and expert parallelism are not implemented yet (only dp; set tp = cp = ep = 1)");
  return l;
}

ProcessGrid::ProcessGrid(const Layout& layout, MPI_Comm world) {
  MPI_Comm_rank(world, &world_rank_);
  MPI_Comm_size(world, &world_size_);
  layout_ = resolve_layout(layout, world_size_);
  const std::int64_t model = layout_.tp * layout_.cp * layout_.ep;
  const int dp_rank = int(world_rank_ / model), model_rank = int(world_rank_ % model);
  MPI_Comm dp = MPI_COMM_NULL;
  MPI_Comm_split(world, model_rank, dp_rank, &dp);
  dp_ = std::make_shared<MpiComm>(dp);
}

}  // namespace mm::parallel
