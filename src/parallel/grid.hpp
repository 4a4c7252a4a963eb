// The process grid of a parallel run: the deck's [parallel] tp, cp, ep, dp, whose product is the number of ranks,
// with rank order tp fastest, then cp, ep, dp (world rank = tp_rank + tp * (cp_rank + cp * (ep_rank + ep * dp_rank))).
// Each dimension gets its own communicator, and so do the groups the training step reduces over:
//   data  = ep x dp  (same tp and cp coordinates): the ranks that hold different micro-batches (ep ranks hold
//                    different tokens like dp ranks; experts are what they split), ordered ep fastest;
//   cp    = the ranks that hold slices of the same sequences;
//   tp    = the ranks that hold slices of the same weights and see the same tokens.
#pragma once

#include <memory>

#include "parallel/comm.hpp"

namespace mm::parallel {

struct Layout {
  std::int64_t tp = 1, cp = 1, ep = 1;
  std::int64_t dp = 0;  // 0: the rest (world size / (tp * cp * ep))
};

// The transport of a grid's communicators: MPI on host memory (the CPU path; device Views are staged through host
// memory), or NCCL on device memory (CUDA builds with NCCL; host buffers are staged through the device).
enum class Backend { mpi, nccl };

// Whether Backend::nccl can be used: the build has NCCL and Kokkos' default execution space is Cuda.
bool nccl_available();
// Collective over `comm`: nccl_available() and every rank of `comm` drives a different GPU (NCCL cannot put two
// ranks of one communicator on the same device). False on every rank if any rank fails either test.
bool nccl_one_gpu_per_rank(MPI_Comm comm);
// An NcclComm over a duplicate of `comm` (collective). Throws mm::Error when !nccl_available() or when two ranks
// share a GPU.
std::shared_ptr<Comm> make_nccl_comm(MPI_Comm comm);

// Check `layout` against `world_size` ranks and fill in dp = 0. Throws mm::Error naming the values when a
// dimension is below 1 (dp below 0) or the product does not equal the rank count.
Layout resolve_layout(Layout layout, std::int64_t world_size);

// The communicators a model's layers use (never null: a dimension of size 1 gets a SelfComm).
struct ModelComms {
  std::shared_ptr<const Comm> tp = std::make_shared<SelfComm>();
  std::shared_ptr<const Comm> cp = std::make_shared<SelfComm>();
  std::shared_ptr<const Comm> ep = std::make_shared<SelfComm>();
};

class ProcessGrid {
 public:
  // Collective over `world` (splits it into the per-dimension communicators). With Backend::nccl every dimension
  // and group of more than one rank gets an NcclComm (size 1: a SelfComm, as with MPI); mm::Error when
  // !nccl_available().
  ProcessGrid(const Layout& layout, MPI_Comm world, Backend backend = Backend::mpi);

  const Layout& layout() const { return layout_; }
  Backend backend() const { return backend_; }
  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }
  int tp_rank() const { return tp_->rank(); }
  int cp_rank() const { return cp_->rank(); }
  int ep_rank() const { return ep_->rank(); }
  int dp_rank() const { return dp_->rank(); }
  std::shared_ptr<const Comm> tp_comm() const { return tp_; }
  std::shared_ptr<const Comm> cp_comm() const { return cp_; }
  std::shared_ptr<const Comm> ep_comm() const { return ep_; }
  // The data-parallel communicator: the ranks that share tp, cp and ep coordinates, ordered by dp rank.
  std::shared_ptr<const Comm> dp_comm() const { return dp_; }
  // ep x dp (same tp and cp), ordered by ep_rank + ep * dp_rank.
  std::shared_ptr<const Comm> data_comm() const { return data_; }
  // cp x ep x dp (same tp coordinate): the ranks whose tokens together make up the step (routing statistics).
  std::shared_ptr<const Comm> tokens_comm() const { return tokens_; }
  std::shared_ptr<const Comm> world_comm() const { return world_; }
  ModelComms model_comms() const { return ModelComms{tp_, cp_, ep_}; }

 private:
  Layout layout_;
  Backend backend_ = Backend::mpi;
  int world_rank_ = 0, world_size_ = 1;
  std::shared_ptr<const Comm> tp_, cp_, ep_, dp_, data_, tokens_, world_;
};

}  // namespace mm::parallel
