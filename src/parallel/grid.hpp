// The process grid of a parallel run: the deck's [parallel] tp, cp, ep, dp, whose product is the number of ranks,
// with rank order tp fastest, then cp, ep, dp (world rank = tp_rank + tp * (cp_rank + cp * (ep_rank + ep * dp_rank))).
// Each dimension gets its own communicator. Implemented today: data parallelism (tp = cp = ep = 1); the other
// dimensions are validated and refused with an error that says so.
#pragma once

#include <memory>

#include "parallel/comm.hpp"

namespace mm::parallel {

struct Layout {
  std::int64_t tp = 1, cp = 1, ep = 1;
  std::int64_t dp = 0;  // 0: the rest (world size / (tp * cp * ep))
};

// Check `layout` against `world_size` ranks and fill in dp = 0. Throws mm::Error naming the values when a
// dimension is below 1 (dp below 0), the product does not equal the rank count, or a dimension other than dp
// exceeds 1 (not implemented yet).
Layout resolve_layout(Layout layout, std::int64_t world_size);

class ProcessGrid {
 public:
  // Collective over `world` (splits it into the per-dimension communicators).
  ProcessGrid(const Layout& layout, MPI_Comm world);

  const Layout& layout() const { return layout_; }
  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }
  int dp_rank() const { return dp_->rank(); }
  // The data-parallel communicator: the ranks that share tp, cp and ep coordinates, ordered by dp rank.
  std::shared_ptr<const Comm> dp_comm() const { return dp_; }

 private:
  Layout layout_;
  int world_rank_ = 0, world_size_ = 1;
  std::shared_ptr<const Comm> dp_;
};

}  // namespace mm::parallel
