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
  return l;
}

namespace {
std::shared_ptr<const Comm> split(MPI_Comm world, int color, int key, int expected_size) {
  if (expected_size == 1) return std::make_shared<SelfComm>();
  MPI_Comm c = MPI_COMM_NULL;
  MPI_Comm_split(world, color, key, &c);
  return std::make_shared<MpiComm>(c);
}
}  // namespace

ProcessGrid::ProcessGrid(const Layout& layout, MPI_Comm world) {
  MPI_Comm_rank(world, &world_rank_);
  MPI_Comm_size(world, &world_size_);
  layout_ = resolve_layout(layout, world_size_);
  const int tp = int(layout_.tp), cp = int(layout_.cp), ep = int(layout_.ep), dp = int(layout_.dp);
  const int r = world_rank_;
  const int t = r % tp, c = (r / tp) % cp, e = (r / (tp * cp)) % ep, d = r / (tp * cp * ep);
  // color = the other coordinates, key = the coordinate along the dimension
  tp_ = split(world, r / tp, t, tp);
  cp_ = split(world, t + tp * (e + ep * d), c, cp);
  ep_ = split(world, t + tp * (c + cp * d), e, ep);
  dp_ = split(world, t + tp * (c + cp * e), d, dp);
  data_ = split(world, t + tp * c, e + ep * d, ep * dp);
  tokens_ = split(world, t, r / tp, cp * ep * dp);
  world_ = split(world, 0, r, world_size_);
}

}  // namespace mm::parallel
