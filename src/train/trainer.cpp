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

double moe_max_imbalance(const std::vector<MoELayerStats>& moe) {
  double x = 0;
  for (const auto& m : moe) x = std::max(x, m.imbalance());
  return x;
}

std::vector<std::int64_t> shape_of(const ParamEntry& e) {
  return std::vector<std::int64_t>(e.shape.begin(), e.shape.end());
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
    : model_(model), cfg_(cfg), deck_(std::move(deck_text)), opt_(model.params(), cfg.adamw) {
  require(cfg.steps >= 1, "train", "steps must be at least 1");
  require(cfg.grad_accum >= 1, "train", "grad_accum must be at least 1");
  if (cfg_.dp) dp_rank_ = cfg_.dp->rank(), dp_size_ = cfg_.dp->size();
  lead_ = dp_rank_ == 0;
  cfg_.verbose = cfg_.verbose && lead_;
  require(cfg.grad_accum % dp_size_ == 0, "[train] grad_accum", "grad_accum = ", cfg.grad_accum,
          " micro-batches per step do not divide over dp = ", dp_size_, " ranks (make grad_accum a multiple of dp)");
  if (dp_size_ > 1)
    require(!has_moe(), "[parallel] dp", "dp = ", dp_size_,
            " with MoE layers is not implemented yet (routing statistics and router jitter are per rank)");
  const index_t n = model_.params().grads().extent(0);
  grad_sum_ = View1<P>("trainer::grad_sum", n);
  if (dp_size_ > 1) gathered_ = View1<P>("trainer::gathered_grads", n * index_t(dp_size_));
  if (!cfg_.resume.empty()) load(cfg_.resume);
}

template <class Model>
void Trainer<Model>::save(const std::string& path) const {
  const auto& ps = model_.params();
  auto values = Kokkos::create_mirror_view_and_copy(HostMem(), ps.values());
  auto m = Kokkos::create_mirror_view_and_copy(HostMem(), opt_.m());
  auto v = Kokkos::create_mirror_view_and_copy(HostMem(), opt_.v());
  if (const auto dir = std::filesystem::path(path).parent_path(); !dir.empty())
    std::filesystem::create_directories(dir);
  io::CheckpointWriter w(path);
  for (const auto& e : ps.entries()) {
    const auto shape = shape_of(e);
    w.write("params/" + e.name, shape, values.data() + e.offset);
    w.write("optimizer/adamw_m/" + e.name, shape, m.data() + e.offset);
    w.write("optimizer/adamw_v/" + e.name, shape, v.data() + e.offset);
  }
  w.attr("step", std::int64_t(step_));
  w.attr("seed", std::int64_t(cfg_.seed));
  w.attr("deck", deck_);
  w.attr("mambamoe_version", std::string(kVersion));
  w.attr("mambamoe_git", std::string(kGitHash));
  w.commit();
}

template <class P>
void load_parameters(ParamStore<P>& ps, const std::string& path) {
  io::CheckpointReader r(path);
  auto values = Kokkos::create_mirror_view(ps.values());
  for (const auto& e : ps.entries()) r.read("params/" + e.name, shape_of(e), values.data() + e.offset);
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
  auto m = Kokkos::create_mirror_view(opt_.m());
  auto v = Kokkos::create_mirror_view(opt_.v());
  for (const auto& e : ps.entries()) {
    const auto shape = shape_of(e);
    r.read("optimizer/adamw_m/" + e.name, shape, m.data() + e.offset);
    r.read("optimizer/adamw_v/" + e.name, shape, v.data() + e.offset);
  }
  Kokkos::deep_copy(opt_.m(), m);
  Kokkos::deep_copy(opt_.v(), v);
  step_ = r.attr_int("step");
  const auto seed = std::uint64_t(r.attr_int("seed"));
  if (seed != cfg_.seed && cfg_.verbose)
    std::printf("warning: %s was written with seed %llu, this run uses seed %llu: the data order changes\n",
                path.c_str(), (unsigned long long)seed, (unsigned long long)cfg_.seed);
  if (cfg_.verbose) std::printf("resumed from %s at step %lld\n", path.c_str(), (long long)step_);
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
    if (dp_size_ > 1) counts = cfg_.dp->allgather(counts);
    std::int64_t scored = 0;
    for (std::size_t i = 0; i < counts.size(); i += 2) scored += counts[i], tokens_since_log += counts[i + 1];
    require(scored > 0, "train", "step ", step_, " has no scored targets");
    if constexpr (kHasBackbone) model_.backbone().set_step(cfg_.seed, std::uint64_t(step_));
    Kokkos::deep_copy(grad_sum_, P(0));
    auto& ps = model_.params();
    const auto sum = grad_sum_;
    std::vector<double> losses(3 * rounds);  // (nats, aux, count) per local micro-batch
    double aux = 0;  // the MoE auxiliary term of the objective (each micro-batch weighted by its scored share)
    for (std::int64_t j = 0; j < rounds; ++j) {
      ps.zero_grads();
      const LossSum l = model_.forward_backward(micro[j], 1.0 / double(scored), cfg_.recompute);
      losses[3 * j] = l.nats, losses[3 * j + 1] = l.aux, losses[3 * j + 2] = double(l.count);
      if constexpr (kHasBackbone) aux += model_.backbone().last_aux() * double(l.count) / double(scored);
      // add this round's gradients (one per dp rank, in rank order = global micro-batch order) to the step's sum
      if (dp_size_ == 1) {
        const auto g = ps.grads();
        par_for("trainer::sum_grads", sum.extent(0), KOKKOS_LAMBDA(index_t i) { sum(i) = sum(i) + g(i); });
      } else {
        cfg_.dp->allgather(ps.grads(), gathered_);
        const auto g = gathered_;
        const index_t n = sum.extent(0);
        const int parts = dp_size_;
        par_for("trainer::sum_gathered_grads", n, KOKKOS_LAMBDA(index_t i) {
          P s = sum(i);
          for (int q = 0; q < parts; ++q) s = s + g(index_t(q) * n + i);
          sum(i) = s;
        });
      }
    }
    Kokkos::deep_copy(ps.grads(), grad_sum_);
    if (dp_size_ > 1) losses = cfg_.dp->allgather(losses);
    LossSum total;  // summed in global micro-batch order k = j * dp + q (gathered layout [q][j])
    for (std::int64_t j = 0; j < rounds; ++j)
      for (int q = 0; q < dp_size_; ++q) {
        const double* x = losses.data() + 3 * (std::size_t(q) * std::size_t(rounds) + std::size_t(j));
        total.nats += x[0];
        total.aux += x[1];
        total.count += std::int64_t(x[2]);
      }
    const double lr = cfg_.schedule.at(step_);
    const double gnorm = opt_.step(model_.params(), lr, step_ + 1);
    std::vector<MoELayerStats> moe;
    if constexpr (kHasBackbone) moe = model_.backbone().end_step();  // expert-bias update, once per step
    ++step_;
    history_.push_back({step_, total.mean_nats(), gnorm, lr, aux, moe});

    const bool last = step_ == cfg_.steps;
    // why to stop (0: don't; 1: time limit; otherwise the signal), decided by dp rank 0 so every rank agrees
    std::int64_t stop = 0;
    if (cfg_.time_limit_minutes > 0 && seconds_since(t_start) > 60.0 * cfg_.time_limit_minutes) stop = 1;
    if (g_stop_signal) stop = g_stop_signal;
    if (dp_size_ > 1) cfg_.dp->broadcast(&stop, 1, 0);
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
        std::printf("       moe: aux loss %.5f | dropped %.2f%% of assignments\n", aux,
                    100.0 * moe_dropped_fraction(moe));
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
      t_log = Clock::now();
    }
    if (eval && ((cfg_.eval_interval > 0 && step_ % cfg_.eval_interval == 0) || last || !stop_reason.empty())) {
      const auto t0 = Clock::now();
      const LossSum l = eval();
      log_eval(l, seconds_since(t0));
    }
    const bool periodic = cfg_.checkpoint_interval > 0 && step_ % cfg_.checkpoint_interval == 0;
    if (lead_ && !cfg_.checkpoint_path.empty() && (periodic || last || !stop_reason.empty())) {
      save(cfg_.checkpoint_path);
      if (cfg_.keep_all_checkpoints) {
        const std::filesystem::path p(cfg_.checkpoint_path);
        char suffix[32];
        std::snprintf(suffix, sizeof suffix, "_step%08lld", (long long)step_);
        save((p.parent_path() / (p.stem().string() + suffix + p.extension().string())).string());
      }
      if (cfg_.verbose) std::printf("checkpoint %s (step %lld)\n", cfg_.checkpoint_path.c_str(), (long long)step_);
    }
    if (dp_size_ > 1 && !cfg_.checkpoint_path.empty() && (periodic || last || !stop_reason.empty()))
      cfg_.dp->barrier();  // the checkpoint is complete before any rank goes on (or exits)
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
