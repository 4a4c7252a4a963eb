// The training loop: gradient accumulation over micro-batches, AdamW with clipping and the LR schedule, progress
// lines and a metrics CSV, periodic held-out evaluation, and checkpoints (written to a temporary file, renamed when
// complete) that resume exactly: a resumed run reproduces the uninterrupted one step for step, because every
// micro-batch is a pure function of (seed, step, micro) and the checkpoint holds the parameters, both AdamW moments
// and the step.
//
// A run stops cleanly, writing a checkpoint first, at its step budget, at `time_limit_minutes`, or on SIGTERM /
// SIGUSR1 (what batch schedulers send before the wall-clock limit).
#pragma once

#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "layers/cross_entropy.hpp"
#include "model/backbone.hpp"
#include "parallel/grid.hpp"
#include "train/optimizer.hpp"

namespace mm {

struct TrainConfig {
  std::int64_t steps = 100;
  std::int64_t grad_accum = 1;
  std::int64_t log_interval = 10;
  std::int64_t eval_interval = 0;  // 0: evaluate only at the end
  LRSchedule schedule;
  AdamWConfig adamw;
  Recompute recompute = Recompute::none;
  double time_limit_minutes = 0;  // 0: none
  std::string checkpoint_path;    // empty: no checkpoints
  std::int64_t checkpoint_interval = 0;
  bool keep_all_checkpoints = false;  // also keep <stem>_stepNNNNNNNN<ext> for every checkpoint written
  std::string resume;             // checkpoint to resume from (empty: fresh start)
  std::string metrics_path;       // CSV of train and eval rows (empty: none)
  std::uint64_t seed = 0;
  bool verbose = true;            // progress lines on stdout
  // The process grid of a parallel run (null: one rank). The model must have been built with the grid's model
  // communicators (tp, cp, ep). Micro-batches are split over the data ranks (ep x dp): data rank r runs micro-batches
  // r, r + n, r + 2 n, ... of each step (grad_accum must divide by n = ep * dp); every micro-batch's gradient is
  // computed into a zeroed buffer (summed over the cp ranks, which hold slices of the same sequences) and the
  // gathered per-micro-batch gradients are summed in global micro-batch order on every rank, exactly as one rank
  // sums its own, so any dp alone gives bit-identical parameters, losses and checkpoints; an expert-parallel
  // parameter's gradient is summed over the dp ranks only (its owner already holds every ep rank's tokens'
  // contribution). With tp, cp or ep the results equal one rank's to rounding (sums in another order). World rank 0
  // alone prints and writes the metrics file; checkpoints are gathered to it and hold the unsharded tensors, so any
  // layout resumes from any other; every rank reads a checkpoint to resume.
  std::shared_ptr<const parallel::ProcessGrid> grid;
  // ZeRO-1 over the dp ranks (those with identical parameter slices): each keeps the AdamW moments of and updates
  // 1/dp of the flat parameter buffer, then the parameters are all-gathered. The summed gradient is the one plain
  // data parallelism forms (gathered per micro-batch and summed in order), so the parameters are bit-identical to
  // plain dp; the saving is the optimizer state (8 of the 16 bytes per parameter) divided by dp.
  bool zero1 = false;
  // With ep * dp > 1 the per-micro-batch gradients are exchanged in buckets, so the receive buffer holds at
  // most this many bytes (data ranks x bucket); the sums do not depend on it. With ep = 1 and 4 or more data ranks
  // a bucket is a reduce-scatter (each rank sums one part of every rank's bucket, in rank order) and an all-gather
  // of the sums: about 2 buckets received per rank instead of (ranks - 1), with bit-identical sums.
  std::size_t gather_buffer_bytes = std::size_t(64) << 20;
  // With ep * dp > 1 and a model that reports when its gradients are final during the backward (MambaLM): each
  // bucket's exchange starts as soon as the backward has passed its parameters (the last blocks' first), on its
  // own stream with NCCL (MPI_Iallgather on the CPU), and is summed as the next buckets start; what is left is
  // finished after the backward. Up to kOverlapSlots buckets are in flight, so a bucket is a quarter of the above
  // buffer (more, smaller buckets). The sums are the same (bit for bit) as without it. With cp > 1 each bucket's
  // cp all-reduce runs (blocking) just before its exchange starts. Off: the exchange of all buckets after the
  // backward (and, with ep = 1 and 4 or more data ranks, the reduce-scatter form above).
  bool overlap_grad_reduce = true;
  static constexpr int kOverlapSlots = 4;
};

struct StepRecord {
  std::int64_t step = 0;
  double loss = 0;  // mean nats per scored target over the whole step (all micro-batches)
  double grad_norm = 0, lr = 0;
  double aux_loss = 0;  // MoE auxiliary losses of the step (coefficients included; 0 without MoE layers)
  std::vector<MoELayerStats> moe;  // routing statistics of the step's training forwards, per MoE layer
};

struct EvalRecord {
  std::int64_t step = 0;
  LossSum loss;
};

// Model is any model with: a HostBatch type; LossSum forward_backward(const HostBatch&, double grad_scale,
// Recompute); ParamStore<P>& params(); static scored(hb) (targets in the batch) and tokens(hb) (inputs, for
// throughput); and a reporting metric (metric_name, metric(LossSum)) next to the mean loss. A model with a
// backbone() (MambaBackbone) also gets the MoE hooks: the router-jitter step before each step, the auxiliary loss
// in the progress lines, the expert-bias update (end_step) after each optimizer step, and the expert utilisation
// in the progress output and the metrics file.
template <class Model>
class Trainer {
 public:
  using P = typename Model::P;
  using HostBatch = typename Model::HostBatch;
  using NextBatch = std::function<HostBatch(std::int64_t step, std::int64_t micro)>;
  using Evaluate = std::function<LossSum()>;

  Trainer(Model& model, const TrainConfig& cfg, std::string deck_text);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Train from the current step to cfg.steps (or until stopped). Returns the number of steps run in this call.
  std::int64_t run(const NextBatch& next, const Evaluate& eval);

  // Collective over the grid's ranks (the sharded tensors are gathered); world rank 0 writes.
  void save(const std::string& path) const;
  void load(const std::string& path);

  std::int64_t step() const { return step_; }
  const std::vector<StepRecord>& history() const { return history_; }
  const std::vector<EvalRecord>& evals() const { return evals_; }
  const AdamW<P>& optimizer() const { return opt_; }

  // Steps of run(), public only because CUDA's extended lambdas may not live in private member functions:
  // add this round's gradients to `sum` (cp all-reduce, then the data ranks' gather in micro-batch order); the
  // global gradient norm (slices summed over their group); ZeRO-1's all-gather of the updated parameters.
  void reduce_round_gradients(const View1<P>& sum);
  double grad_norm() const;
  void allgather_parameters();
  // The gathered bucket `recv` (every data rank's [off, off + len) of its round gradient, rank order) added to
  // sum[off, off + len) in rank order (an expert slice: only the ranks of its own ep coordinate).
  void add_gathered(const View1<P>& sum, const View1<P>& recv, index_t off, index_t len) const;
  // Overlap (TrainConfig::overlap_grad_reduce): start the exchange of every bucket within [lo, n) not yet started
  // this round (the model's hook during the backward; lo = 0 after it), and finish the oldest one in flight
  // (wait, then add it to grad_sum_).
  index_t start_ready_buckets(index_t lo);  // returns how many it started
  void finish_oldest_bucket();
  // Overlap: the buckets whose exchange started during the backward and those started after it, since construction.
  std::pair<std::int64_t, std::int64_t> overlap_counts() const {
    return {buckets_in_backward_, buckets_after_backward_};
  }

 private:
  // ZeRO-1: the flat-buffer range of dp rank q, and the moments of the whole buffer (collective)
  static std::pair<index_t, index_t> zero1_range(const TrainConfig& cfg, index_t n);
  std::vector<P> full_moment(const View1<P>& shard) const;

 private:
  void log_eval(const LossSum& l, double seconds);
  static constexpr bool kHasBackbone = requires(Model& m) { m.backbone().end_step(); };
  static constexpr bool kGradsReadyHook = requires(Model& m) { m.set_grads_ready_hook(nullptr); };
  bool has_moe() const {
    if constexpr (kHasBackbone) return model_.backbone().has_moe();
    else return false;
  }
  Model& model_;
  TrainConfig cfg_;
  std::string deck_;
  AdamW<P> opt_;
  std::int64_t step_ = 0;  // the next step to run
  std::vector<StepRecord> history_;
  std::vector<EvalRecord> evals_;
  // the tensors of a checkpoint: every parameter's value and AdamW moments, unsharded (collective over the grid)
  void gather_global(const ParamEntry& e, const P* local, std::vector<P>& global) const;
  std::shared_ptr<const parallel::Comm> data_, cp_, tp_, ep_, tokens_, world_;
  int dp_rank_ = 0, dp_size_ = 1;  // over the data ranks (ep x dp)
  int ep_rank_ = 0, ep_size_ = 1;
  bool lead_ = true;      // world rank 0: prints, writes metrics and checkpoints
  bool sharded_ = false;  // some parameter is sliced over tp or ep
  Kokkos::View<std::uint8_t*, Layout, Mem> split_;
  std::shared_ptr<const parallel::Comm> zero_;  // ZeRO-1: the dp communicator (null: off)
  View1<P> zero_send_, zero_recv_;  // per gradient element: 0 replicated, 1 tp slice, 2 ep slice
  View1<P> grad_sum_;     // the step's gradient: per-micro-batch gradients summed in global micro-batch order
  View1<P> gathered_;     // dp > 1: one bucket (overlap: kOverlapSlots) of every dp rank's round gradient, rank order
  index_t gather_bucket_ = 0;  // gradient elements per all-gather
  // overlap: whether it is on, inside a round (between zeroing the gradients and their reduction), the highest
  // bucket not started yet this round (-1: all), the next slot of gathered_ and the buckets in flight (oldest first)
  struct InFlight {
    index_t off = 0, len = 0;
    int slot = 0;
    std::unique_ptr<parallel::Pending> op;
  };
  bool overlap_ = false, in_round_ = false;
  index_t next_bucket_ = -1;
  int next_slot_ = 0;
  std::deque<InFlight> in_flight_;
  std::int64_t buckets_in_backward_ = 0, buckets_after_backward_ = 0;
};

// Read a checkpoint's parameters into `params` (names and shapes must match), and the deck it was written with.
template <class P>
void load_parameters(ParamStore<P>& params, const std::string& path);
std::string checkpoint_deck(const std::string& path);

// Human-readable durations for progress lines ("4m12s").
std::string format_duration(double seconds);

}  // namespace mm
