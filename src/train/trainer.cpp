#include "train/trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "core/config.hpp"
#include "core/error.hpp"
#include "tensor/ops.hpp"
#include "io/checkpoint.hpp"
#include "model/forecaster.hpp"
#include "model/lm.hpp"
#include "model/rcps_lm.hpp"

namespace mm {

namespace {

volatile std::sig_atomic_t g_stop_signal = 0;
extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string si(double v) {
  char buf[32];
  if (v >= 1e6) std::snprintf(buf, sizeof buf, "%.2fM", v / 1e6);
  else if (v >= 1e3) std::snprintf(buf, sizeof buf, "%.1fk", v / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f", v);
  return buf;
}

// tokens per expert of every MoE layer of a step, for the metrics file: "L1:12/9/...|L3:..." (no commas)
std::string moe_tokens_field(const std::vector<MoELayerStats>& moe) {
  std::string s;
  for (const auto& m : moe) {
    s += (s.empty() ? "L" : "|L") + std::to_string(m.layer) + ":";
    for (std::size_t e = 0; e < m.routed.size(); ++e) s += (e ? "/" : "") + std::to_string(std::llround(m.routed[e]));
  }
  return s;
}

double moe_dropped_fraction(const std::vector<MoELayerStats>& moe) {
  double a = 0, d = 0;
  for (const auto& m : moe) a += m.assignments, d += m.dropped;
  return a > 0 ? d / a : 0.0;
}

double moe_exchange_seconds(const std::vector<MoELayerStats>& moe) {
  double t = 0;
  for (const auto& m : moe) t += m.exchange_seconds;
  return t;
}

double moe_max_imbalance(const std::vector<MoELayerStats>& moe) {
  double x = 0;
  for (const auto& m : moe) x = std::max(x, m.imbalance());
  return x;
}

}  // namespace

std::string format_duration(double s) {
  char buf[32];
  if (s < 60) std::snprintf(buf, sizeof buf, "%.0fs", s);
  else if (s < 3600) std::snprintf(buf, sizeof buf, "%dm%02ds", int(s) / 60, int(s) % 60);
  else std::snprintf(buf, sizeof buf, "%dh%02dm", int(s) / 3600, (int(s) % 3600) / 60);
  return buf;
}

template <class Model>
Trainer<Model>::Trainer(Model& model, const TrainConfig& cfg, std::string deck_text)
    : model_(model),
      cfg_(cfg),
      deck_(std::move(deck_text)),
      opt_(model.params(), cfg.adamw, zero1_range(cfg, model.params().total()).first,
           zero1_range(cfg, model.params().total()).second) {
  require(cfg.steps >= 1, "train", "steps must be at least 1");
  require(cfg.grad_accum >= 1, "train", "grad_accum must be at least 1");
  const auto self = std::make_shared<parallel::SelfComm>();
  data_ = cp_ = tp_ = ep_ = tokens_ = world_ = self;
  if (cfg_.grid) {
    const auto& g = *cfg_.grid;
    data_ = g.data_comm(), cp_ = g.cp_comm(), tp_ = g.tp_comm(), ep_ = g.ep_comm(), tokens_ = g.tokens_comm();
    world_ = g.world_comm();
  }
  dp_rank_ = data_->rank(), dp_size_ = data_->size();
  ep_rank_ = ep_->rank(), ep_size_ = ep_->size();
  lead_ = world_->rank() == 0;
  cfg_.verbose = cfg_.verbose && lead_;
  require(cfg.grad_accum % dp_size_ == 0, "[train] grad_accum", "grad_accum = ", cfg.grad_accum,
          " micro-batches per step do not divide over ep * dp = ", dp_size_,
          " ranks (make grad_accum a multiple of ep * dp)");
  const index_t n = model_.params().grads().extent(0);
  grad_sum_ = View1<P>("trainer::grad_sum", n);
  if constexpr (kGradsReadyHook) overlap_ = cfg_.overlap_grad_reduce && dp_size_ > 1;
  if (dp_size_ > 1) {  // the all-gather runs in buckets, so its buffer is at most cfg.gather_buffer_bytes
    const index_t slots = overlap_ ? TrainConfig::kOverlapSlots : 1;
    gather_bucket_ = std::min<index_t>(
        n, std::max<index_t>(1, index_t(cfg_.gather_buffer_bytes / sizeof(P)) / index_t(dp_size_) / slots));
    gathered_ = View1<P>("trainer::gathered_grads", slots * gather_bucket_ * index_t(dp_size_));
  }
  if constexpr (kGradsReadyHook)
    if (overlap_)
      model_.set_grads_ready_hook([this](index_t lo) { buckets_in_backward_ += start_ready_buckets(lo); });
  // which gradient elements are slices (for the global norm and the reduction over the data ranks)
  split_ = Kokkos::View<std::uint8_t*, Layout, Mem>("trainer::split", n);
  auto hs = Kokkos::create_mirror_view(split_);
  for (const auto& e : model_.params().entries()) {
    const std::uint8_t k = e.shard.split == Split::tp ? 1 : e.shard.split == Split::ep ? 2 : 0;
    require(e.shard.split != Split::tp_ep, "train", "parameter '", e.name, "' is sliced over both tp and ep (not supported)");
    sharded_ = sharded_ || k != 0;
    for (index_t i = 0; i < e.size; ++i) hs(e.offset + i) = k;
  }
  Kokkos::deep_copy(split_, hs);
  if (cfg_.zero1 && cfg_.grid && cfg_.grid->dp_comm()->size() > 1) {
    zero_ = cfg_.grid->dp_comm();
    const index_t S = (n + zero_->size() - 1) / zero_->size();
    zero_send_ = View1<P>("trainer::zero1_send", S);
    zero_recv_ = View1<P>("trainer::zero1_recv", S * zero_->size());
  }
  if (!cfg_.resume.empty()) load(cfg_.resume);
}

template <class Model>
Trainer<Model>::~Trainer() {
  if constexpr (kGradsReadyHook)
    if (overlap_) model_.set_grads_ready_hook(nullptr);
  in_flight_.clear();  // (after an exception inside a round) each waits for its transfer
}

template <class Model>
std::pair<index_t, index_t> Trainer<Model>::zero1_range(const TrainConfig& cfg, index_t n) {
  if (!cfg.zero1 || !cfg.grid || cfg.grid->dp_comm()->size() == 1) return {0, n};
  const index_t q = cfg.grid->dp_comm()->size(), r = cfg.grid->dp_comm()->rank();
  const index_t S = (n + q - 1) / q;
  return {std::min(n, r * S), std::min(n, (r + 1) * S)};
}

template <class Model>
std::vector<typename Trainer<Model>::P> Trainer<Model>::full_moment(const View1<P>& shard) const {
  const index_t n = model_.params().total();
  auto h = Kokkos::create_mirror_view_and_copy(HostMem(), shard);
  if (!zero_) return std::vector<P>(h.data(), h.data() + n);
  const std::size_t S = zero_send_.extent(0);
  std::vector<P> send(S, P(0));
  std::copy(h.data(), h.data() + h.extent(0), send.begin());
  auto all = zero_->allgather(send);
  all.resize(std::size_t(n));
  return all;
}

template <class Model>
void Trainer<Model>::allgather_parameters() {
  const auto p = model_.params().values();
  const auto send = zero_send_, recv = zero_recv_;
  const index_t lo = opt_.lo(), len = opt_.hi() - opt_.lo(), n = p.extent(0);
  Kokkos::deep_copy(send, P(0));
  par_for("trainer::zero1_pack", len, KOKKOS_LAMBDA(index_t i) { send(i) = p(lo + i); });
  zero_->allgather(send, recv);
  par_for("trainer::zero1_unpack", n, KOKKOS_LAMBDA(index_t i) { p(i) = recv(i); });
}

template <class Model>
void Trainer<Model>::gather_global(const ParamEntry& e, const P* local, std::vector<P>& global) const {
  global.assign(std::size_t(e.global_size()), P(0));
  if (!e.sharded()) {
    std::copy(local, local + e.size, global.begin());
    return;
  }
  const parallel::Comm& c = e.shard.split == Split::ep ? *ep_ : *tp_;
  const auto gi = e.global_index();
  const std::vector<std::int64_t> n_here{std::int64_t(gi.size())};
  for (std::int64_t m : c.allgather(n_here))
    require(m == n_here[0], "checkpoint", "parameter '", e.name, "': its slices differ in size over the ranks");
  const auto vals = c.allgather(std::vector<P>(local, local + e.size));
  const auto idx = c.allgather(std::vector<std::int64_t>(gi.begin(), gi.end()));
  for (std::size_t k = 0; k < idx.size(); ++k) global[std::size_t(idx[k])] = vals[k];
}

template <class Model>
void Trainer<Model>::save(const std::string& path) const {
  const auto& ps = model_.params();
  auto values = Kokkos::create_mirror_view_and_copy(HostMem(), ps.values());
  const auto m = full_moment(opt_.m()), v = full_moment(opt_.v());
  std::unique_ptr<io::CheckpointWriter> w;
  if (lead_) {
    if (const auto dir = std::filesystem::path(path).parent_path(); !dir.empty())
      std::filesystem::create_directories(dir);
    w = std::make_unique<io::CheckpointWriter>(path);
  }
  std::vector<P> gv, gm, gvv;
  for (const auto& e : ps.entries()) {
    gather_global(e, values.data() + e.offset, gv);
    gather_global(e, m.data() + e.offset, gm);
    gather_global(e, v.data() + e.offset, gvv);
    if (!w) continue;
    const std::vector<std::int64_t> shape(e.global_shape().begin(), e.global_shape().end());
    w->write("params/" + e.name, shape, gv.data());
    w->write("optimizer/adamw_m/" + e.name, shape, gm.data());
    w->write("optimizer/adamw_v/" + e.name, shape, gvv.data());
  }
  if (!w) return;
  w->attr("step", std::int64_t(step_));
  w->attr("seed", std::int64_t(cfg_.seed));
  w->attr("deck", deck_);
  w->attr("mambamoe_version", std::string(kVersion));
  w->attr("mambamoe_git", std::string(kGitHash));
  w->commit();
}

namespace {
// Reads the unsharded tensor `name` and keeps this rank's slice of it (entry e's local elements) at `local`.
template <class P>
void read_slice(const io::CheckpointReader& r, const std::string& name, const ParamEntry& e, P* local) {
  const std::vector<std::int64_t> shape(e.global_shape().begin(), e.global_shape().end());
  if (!e.sharded()) {
    r.read(name, shape, local);
    return;
  }
  std::vector<P> global(std::size_t(e.global_size()));
  r.read(name, shape, global.data());
  const auto gi = e.global_index();
  for (std::size_t k = 0; k < gi.size(); ++k) local[k] = global[std::size_t(gi[k])];
}
}  // namespace

template <class P>
void load_parameters(ParamStore<P>& ps, const std::string& path) {
  io::CheckpointReader r(path);
  auto values = Kokkos::create_mirror_view(ps.values());
  for (const auto& e : ps.entries()) read_slice(r, "params/" + e.name, e, values.data() + e.offset);
  Kokkos::deep_copy(ps.values(), values);
}
template void load_parameters<float>(ParamStore<float>&, const std::string&);
template void load_parameters<double>(ParamStore<double>&, const std::string&);

std::string checkpoint_deck(const std::string& path) { return io::CheckpointReader(path).attr_string("deck"); }

template <class Model>
void Trainer<Model>::load(const std::string& path) {
  auto& ps = model_.params();
  load_parameters(ps, path);
  io::CheckpointReader r(path);
  std::vector<P> m(std::size_t(ps.total()), P(0)), v(m.size(), P(0));
  for (const auto& e : ps.entries()) {
    read_slice(r, "optimizer/adamw_m/" + e.name, e, m.data() + e.offset);
    read_slice(r, "optimizer/adamw_v/" + e.name, e, v.data() + e.offset);
  }
  // this rank's range of the moments (all of them without ZeRO-1)
  auto hm = Kokkos::create_mirror_view(opt_.m()), hv = Kokkos::create_mirror_view(opt_.v());
  for (index_t i = 0; i < opt_.hi() - opt_.lo(); ++i) hm(i) = m[std::size_t(opt_.lo() + i)], hv(i) = v[std::size_t(opt_.lo() + i)];
  Kokkos::deep_copy(opt_.m(), hm);
  Kokkos::deep_copy(opt_.v(), hv);
  step_ = r.attr_int("step");
  const auto seed = std::uint64_t(r.attr_int("seed"));
  if (seed != cfg_.seed && cfg_.verbose)
    std::printf("warning: %s was written with seed %llu, this run uses seed %llu: the data order changes\n",
                path.c_str(), (unsigned long long)seed, (unsigned long long)cfg_.seed);
  if (cfg_.verbose) std::printf("resumed from %s at step %lld\n", path.c_str(), (long long)step_);
}

namespace {
// One bucket [off, off + len) of the round's gradients g summed over the data ranks as a reduce-scatter and an
// all-gather: rank q receives every rank's part q (ceil(len / ranks) elements), adds them to its running sums in
// rank order (the same additions, in the same order, as the all-gather path: bit-identical), and the summed parts
// are all-gathered. Each rank receives about 2 len elements instead of (ranks - 1) len. Needs every rank to hold
// the same running sums (ep = 1: no expert slice summed over a subset of the ranks); the buffers are carved from
// `buf`, and it returns false (nothing done) when they do not fit there.
template <class P>
bool reduce_scatter_bucket(const parallel::Comm& data, const View1<P>& g, const View1<P>& sum, const View1<P>& buf,
                           index_t off, index_t len) {
  const index_t parts = data.size(), s = (len + parts - 1) / parts, me = data.rank();
  if (3 * parts * s + s > index_t(buf.extent(0))) return false;
  using Kokkos::make_pair;
  using Kokkos::subview;
  const View1<P> send = subview(buf, make_pair(index_t(0), parts * s));
  const View1<P> recv = subview(buf, make_pair(parts * s, 2 * parts * s));
  const View1<P> part = subview(buf, make_pair(2 * parts * s, 2 * parts * s + s));
  const View1<P> all = subview(buf, make_pair(2 * parts * s + s, 3 * parts * s + s));
  par_for("trainer::rs_pack", parts * s, KOKKOS_LAMBDA(index_t k) { send(k) = k < len ? g(off + k) : P(0); });
  data.alltoall(send, recv, std::size_t(s));
  par_for("trainer::rs_sum", s, KOKKOS_LAMBDA(index_t k) {
    const bool in = me * s + k < len;
    P acc = in ? sum(off + me * s + k) : P(0);
    for (index_t q = 0; q < parts; ++q) acc = acc + recv(q * s + k);
    part(k) = acc;
  });
  data.allgather(part, all);
  par_for("trainer::rs_unpack", len, KOKKOS_LAMBDA(index_t k) { sum(off + k) = all(k); });
  return true;
}
}  // namespace

template <class Model>
void Trainer<Model>::add_gathered(const View1<P>& sum, const View1<P>& recv, index_t off, index_t len) const {
  const auto split = split_;
  const int parts = dp_size_, ep = ep_size_, me = ep_rank_;
  par_for("trainer::sum_gathered_grads", len, KOKKOS_LAMBDA(index_t k) {
    const index_t i = off + k;
    P s = sum(i);
    const bool expert = split(i) == 2;
    for (int q = 0; q < parts; ++q)
      if (!expert || q % ep == me) s = s + recv(index_t(q) * len + k);
    sum(i) = s;
  });
}

template <class Model>
index_t Trainer<Model>::start_ready_buckets(index_t lo) {
  if (!in_round_) return 0;  // a backward outside run()'s rounds (tests, tools)
  const View1<P> g = model_.params().grads();
  const index_t n = g.extent(0), B = gather_bucket_, parts = dp_size_;
  using Kokkos::make_pair;
  using Kokkos::subview;
  index_t started = 0;
  for (; next_bucket_ >= 0 && next_bucket_ * B >= lo; --next_bucket_, ++started) {
    if (index_t(in_flight_.size()) == TrainConfig::kOverlapSlots) finish_oldest_bucket();
    InFlight f;
    f.off = next_bucket_ * B, f.len = std::min(B, n - f.off), f.slot = next_slot_;
    next_slot_ = (next_slot_ + 1) % TrainConfig::kOverlapSlots;  // the slot of the bucket just finished, if any
    const View1<P> send = subview(g, make_pair(f.off, f.off + f.len));
    if (cp_->size() > 1) cp_->allreduce_sum(send);  // the cp ranks hold partial gradients of the micro-batch
    const index_t at = index_t(f.slot) * B * parts;
    f.op = data_->start_allgather(send, View1<P>(subview(gathered_, make_pair(at, at + f.len * parts))));
    in_flight_.push_back(std::move(f));
  }
  for (auto& f : in_flight_) f.op->poll();
  return started;
}

template <class Model>
void Trainer<Model>::finish_oldest_bucket() {
  InFlight f = std::move(in_flight_.front());
  in_flight_.pop_front();
  f.op->wait();
  const index_t at = index_t(f.slot) * gather_bucket_ * index_t(dp_size_);
  const View1<P> recv = Kokkos::subview(gathered_, Kokkos::make_pair(at, at + f.len * index_t(dp_size_)));
  add_gathered(grad_sum_, recv, f.off, f.len);
}

template <class Model>
void Trainer<Model>::reduce_round_gradients(const View1<P>& sum) {
  if (overlap_) {  // what the backward's hook did not start, then everything in flight
    require(sum.data() == grad_sum_.data(), "train", "the overlapped exchange sums into the step's gradient");
    buckets_after_backward_ += start_ready_buckets(0);
    while (!in_flight_.empty()) finish_oldest_bucket();
    in_round_ = false;
    return;
  }
  auto& ps = model_.params();
  // the cp ranks hold partial gradients of the same micro-batch
  if (cp_->size() > 1) cp_->allreduce_sum(ps.grads());
  const auto g = ps.grads();
  if (dp_size_ == 1) {
    par_for("trainer::sum_grads", sum.extent(0), KOKKOS_LAMBDA(index_t i) { sum(i) = sum(i) + g(i); });
    return;
  }
  // one gradient per data rank, in rank order = global micro-batch order; an expert slice (split 2) adds only the
  // data ranks of its own ep coordinate (data rank q = ep_rank + ep * dp_rank). Bucket by bucket: the sums are
  // the same as from one all-gather of everything.
  const index_t n = sum.extent(0), parts = dp_size_;
  for (index_t off = 0; off < n; off += gather_bucket_) {
    const index_t len = std::min(gather_bucket_, n - off);
    if (ep_size_ == 1 && parts >= 4 && reduce_scatter_bucket<P>(*data_, g, sum, gathered_, off, len)) continue;
    const View1<P> send = Kokkos::subview(g, Kokkos::make_pair(off, off + len));
    const View1<P> recv = Kokkos::subview(gathered_, Kokkos::make_pair(index_t(0), len * parts));
    data_->allgather(send, recv);
    add_gathered(sum, recv, off, len);
  }
}

template <class Model>
double Trainer<Model>::grad_norm() const {
  const auto& ps = model_.params();
  if (!sharded_) return opt_.grad_norm(ps);
  // replicated elements count once; tp and ep slices are summed over their group
  const auto g = ps.grads();
  const auto split = split_;
  // one pass for the three kinds (replicated, tp slice, ep slice): the same block sums as three ordered_sums
  PoolScope ws;  // (no allocation per step)
  const View1<double> sums = ws.take<View1<double>>("trainer::grad_norm_sums", 3);
  column_reduce<double>(
      "trainer::grad_norm", g.extent(0), 3,
      KOKKOS_LAMBDA(index_t i, index_t k) { return index_t(split(i)) == k ? double(g(i)) * double(g(i)) : 0.0; },
      sums, false);
  std::vector<double> ss(3);
  Kokkos::deep_copy(HostUView1<double>(ss.data(), 3), sums);
  tp_->allreduce_sum(&ss[1], 1);
  ep_->allreduce_sum(&ss[2], 1);
  return std::sqrt(ss[0] + ss[1] + ss[2]);
}

template <class Model>
void Trainer<Model>::log_eval(const LossSum& l, double seconds) {
  evals_.push_back({step_, l});
  if (cfg_.verbose)
    std::printf("eval  step %6lld | held-out loss %.4f | %s %.4f | %lld targets | %s\n", (long long)step_,
                l.mean_nats(), Model::metric_name, Model::metric(l), (long long)l.count,
                format_duration(seconds).c_str());
  if (lead_ && !cfg_.metrics_path.empty()) {
    std::ofstream f(cfg_.metrics_path, std::ios::app);
    f << "eval," << step_ << "," << l.mean_nats() << "," << Model::metric(l) << ",,,," << seconds
      << (has_moe() ? ",,,,\n" : "\n");
  }
  std::fflush(stdout);
}

template <class Model>
std::int64_t Trainer<Model>::run(const NextBatch& next, const Evaluate& eval) {
  if (lead_ && !cfg_.metrics_path.empty()) {
    if (const auto dir = std::filesystem::path(cfg_.metrics_path).parent_path(); !dir.empty())
      std::filesystem::create_directories(dir);
    const bool fresh = !std::filesystem::exists(cfg_.metrics_path) || std::filesystem::file_size(cfg_.metrics_path) == 0;
    std::ofstream f(cfg_.metrics_path, std::ios::app);
    require(bool(f), cfg_.metrics_path, "cannot open the metrics file for writing");
    if (fresh)
      f << "kind,step,loss," << Model::metric_name << ",lr,grad_norm,tokens_per_s,elapsed_s"
        << (has_moe() ? ",aux_loss,moe_dropped_frac,moe_max_imbalance,moe_tokens_per_expert\n" : "\n");
  }
  g_stop_signal = 0;
  auto old_term = std::signal(SIGTERM, on_stop_signal);
  auto old_usr1 = std::signal(SIGUSR1, on_stop_signal);

  const auto t_start = Clock::now();
  const std::int64_t first = step_;
  std::int64_t tokens_since_log = 0;
  double exchange_since_log = 0;  // expert parallelism: this rank's seconds in the MoE all-to-alls
  auto t_log = Clock::now();
  std::string stop_reason;
  if (eval && step_ == 0 && cfg_.eval_interval > 0) {  // the untrained model: where the held-out curve starts
    const auto t0 = Clock::now();
    const LossSum l = eval();
    log_eval(l, seconds_since(t0));
  }
  while (step_ < cfg_.steps) {
    // Forward + backward over the micro-batches; the loss is normalised by the step's total scored targets.
    // Rank r of dp runs the micro-batches k = j * dp + r, j = 0 .. rounds - 1.
    const std::int64_t rounds = cfg_.grad_accum / dp_size_;
    std::vector<HostBatch> micro(rounds);
    std::vector<std::int64_t> counts(2 * rounds);  // (scored, tokens) per local micro-batch
    for (std::int64_t j = 0; j < rounds; ++j) {
      micro[j] = next(step_, j * dp_size_ + dp_rank_);
      counts[2 * j] = Model::scored(micro[j]);
      counts[2 * j + 1] = Model::tokens(micro[j]);
    }
    if (dp_size_ > 1) counts = data_->allgather(counts);
    std::int64_t scored = 0;
    for (std::size_t i = 0; i < counts.size(); i += 2) scored += counts[i], tokens_since_log += counts[i + 1];
    require(scored > 0, "train", "step ", step_, " has no scored targets");
    if constexpr (kHasBackbone) model_.backbone().set_step(cfg_.seed, std::uint64_t(step_));
    Kokkos::deep_copy(grad_sum_, P(0));
    auto& ps = model_.params();
    const auto sum = grad_sum_;
    std::vector<double> losses(4 * rounds);  // (nats, aux, count, weighted aux) per local micro-batch
    for (std::int64_t j = 0; j < rounds; ++j) {
      ps.zero_grads();
      if (overlap_) {  // every bucket of this round's gradient is to be exchanged, the last first
        in_round_ = true, next_slot_ = 0;
        next_bucket_ = (index_t(ps.grads().extent(0)) + gather_bucket_ - 1) / gather_bucket_ - 1;
      }
      const LossSum l = model_.forward_backward(micro[j], 1.0 / double(scored), cfg_.recompute);
      losses[4 * j] = l.nats, losses[4 * j + 1] = l.aux, losses[4 * j + 2] = double(l.count);
      // the MoE auxiliary term of the objective (each micro-batch weighted by its scored share)
      if constexpr (kHasBackbone) losses[4 * j + 3] = model_.backbone().last_aux() * double(l.count) / double(scored);
      reduce_round_gradients(sum);
    }
    Kokkos::deep_copy(ps.grads(), grad_sum_);
    if (dp_size_ > 1) losses = data_->allgather(losses);
    LossSum total;  // summed in global micro-batch order k = j * dp + q (gathered layout [q][j])
    double aux = 0;
    for (std::int64_t j = 0; j < rounds; ++j)
      for (int q = 0; q < dp_size_; ++q) {
        const double* x = losses.data() + 4 * (std::size_t(q) * std::size_t(rounds) + std::size_t(j));
        total.nats += x[0];
        total.aux += x[1];
        total.count += std::int64_t(x[2]);
        aux += x[3];
      }
    const double lr = cfg_.schedule.at(step_);
    const double gnorm = opt_.step(model_.params(), lr, step_ + 1, grad_norm());
    if (zero_) allgather_parameters();
    std::vector<MoELayerStats> moe;
    // the expert-bias update, once per step (the MoE statistics are cp-wide already)
    if constexpr (kHasBackbone) moe = model_.backbone().end_step(data_.get());
    exchange_since_log += moe_exchange_seconds(moe);
    ++step_;
    history_.push_back({step_, total.mean_nats(), gnorm, lr, aux, moe});

    const bool last = step_ == cfg_.steps;
    // why to stop (0: don't; 1: time limit; otherwise the signal), decided by dp rank 0 so every rank agrees
    std::int64_t stop = 0;
    if (cfg_.time_limit_minutes > 0 && seconds_since(t_start) > 60.0 * cfg_.time_limit_minutes) stop = 1;
    if (g_stop_signal) stop = g_stop_signal;
    if (world_->size() > 1) world_->broadcast(&stop, 1, 0);
    if (stop == 1) stop_reason = "time limit of " + format_duration(60.0 * cfg_.time_limit_minutes) + " reached";
    else if (stop != 0) stop_reason = std::string("signal ") + (stop == SIGTERM ? "SIGTERM" : "SIGUSR1");

    if (cfg_.log_interval > 0 && (step_ % cfg_.log_interval == 0 || last || !stop_reason.empty())) {
      Kokkos::fence("trainer::log");
      const double dt = seconds_since(t_log), elapsed = seconds_since(t_start);
      const double tps = double(tokens_since_log) / dt;
      const double eta = elapsed / double(step_ - first) * double(cfg_.steps - step_);
      if (cfg_.verbose)
        std::printf("step %6lld/%lld | loss %.4f | %s %.4f | lr %.2e | gnorm %.3f | %s tok/s | %s | ETA %s\n",
                    (long long)step_, (long long)cfg_.steps, total.mean_nats(), Model::metric_name,
                    Model::metric(total), lr, gnorm, si(tps).c_str(), format_duration(elapsed).c_str(),
                    format_duration(eta).c_str());
      if (cfg_.verbose && !moe.empty()) {
        std::printf("       moe: aux loss %.5f | dropped %.2f%% of assignments", aux,
                    100.0 * moe_dropped_fraction(moe));
        if (ep_size_ > 1)  // rank 0's share of the interval in the expert all-to-alls
          std::printf(" | expert all-to-all %.3f s, %.1f%% of the time", exchange_since_log,
                      100.0 * exchange_since_log / dt);
        std::printf("\n");
        for (const auto& m : moe) {
          std::printf("       moe layer %lld: imbalance %.3f, dropped %.0f/%.0f, tokens per expert [",
                      (long long)m.layer, m.imbalance(), m.dropped, m.assignments);
          for (std::size_t e = 0; e < m.routed.size(); ++e) std::printf("%s%.0f", e ? " " : "", m.routed[e]);
          std::printf("]\n");
        }
      }
      if (lead_ && !cfg_.metrics_path.empty()) {
        std::ofstream f(cfg_.metrics_path, std::ios::app);
        f << "train," << step_ << "," << total.mean_nats() << "," << Model::metric(total) << "," << lr << ","
          << gnorm << "," << tps << "," << elapsed;
        if (has_moe())
          f << "," << aux << "," << moe_dropped_fraction(moe) << "," << moe_max_imbalance(moe) << ","
            << moe_tokens_field(moe);
        f << "\n";
      }
      std::fflush(stdout);
      tokens_since_log = 0;
      exchange_since_log = 0;
      t_log = Clock::now();
    }
    if (eval && ((cfg_.eval_interval > 0 && step_ % cfg_.eval_interval == 0) || last || !stop_reason.empty())) {
      const auto t0 = Clock::now();
      const LossSum l = eval();
      log_eval(l, seconds_since(t0));
    }
    const bool periodic = cfg_.checkpoint_interval > 0 && step_ % cfg_.checkpoint_interval == 0;
    if (!cfg_.checkpoint_path.empty() && (periodic || last || !stop_reason.empty())) {
      save(cfg_.checkpoint_path);
      if (cfg_.keep_all_checkpoints) {
        const std::filesystem::path p(cfg_.checkpoint_path);
        char suffix[32];
        std::snprintf(suffix, sizeof suffix, "_step%08lld", (long long)step_);
        save((p.parent_path() / (p.stem().string() + suffix + p.extension().string())).string());
      }
      if (cfg_.verbose) std::printf("checkpoint %s (step %lld)\n", cfg_.checkpoint_path.c_str(), (long long)step_);
    }
    if (world_->size() > 1 && !cfg_.checkpoint_path.empty() && (periodic || last || !stop_reason.empty()))
      world_->barrier();  // the checkpoint is complete before any rank goes on (or exits)
    if (!stop_reason.empty()) {
      if (cfg_.verbose)
        std::printf("stopping at step %lld: %s%s\n", (long long)step_, stop_reason.c_str(),
                    cfg_.checkpoint_path.empty() ? " (no checkpoint path configured: progress is not saved)"
                                                 : "; resume with --checkpoint.resume=<checkpoint>");
      break;
    }
  }
  std::signal(SIGTERM, old_term);
  std::signal(SIGUSR1, old_usr1);
  return step_ - first;
}

template class Trainer<MambaLM<float>>;
template class Trainer<MambaLM<double>>;
template class Trainer<Forecaster<float>>;
template class Trainer<Forecaster<double>>;
template class Trainer<RCPSMaskedLM<float>>;
template class Trainer<RCPSMaskedLM<double>>;

}  // namespace mm
