#include "lm_options.hpp"

#include <filesystem>
#include <limits>

#include "core/error.hpp"

namespace mm::drivers {

using I = std::int64_t;

void declare_run(io::Deck& d) {
  d.add<std::string>("run.driver", "genomics_lm", "workload to run (see mambamoe --list-drivers)")
      .add<I>("run.seed", 1, "seed of every random draw (initialisation, data order)")
      .add<bool>("run.deterministic", true,
                 "bit-identical results between runs on the same hardware and layout (the CPU kernels always are: "
                 "no atomics in any reduction)")
      .add<std::string>("run.output_dir", "runs/default", "directory for metrics and checkpoints (created)");
}

void declare_backbone_options(io::Deck& d) {
  const Mamba2Config m;
  d.add<I>("model.d_model", 128, "model width")
      .add<I>("model.n_layer", 4, "number of Mamba-2 blocks")
      .add<I>("model.d_state", m.d_state, "SSM state size N")
      .add<I>("model.d_conv", m.d_conv, "causal conv1d width")
      .add<I>("model.expand", m.expand, "d_inner = expand * d_model")
      .add<I>("model.headdim", m.headdim, "head dimension P (nheads = d_inner / headdim)")
      .add<I>("model.ngroups", m.ngroups, "B/C groups G (nheads must divide by it)")
      .add<I>("model.chunk_size", m.chunk, "SSD chunk length Q (results do not depend on it)")
      .add<double>("model.dt_min", m.dt_min, "initial dt range, lower end")
      .add<double>("model.dt_max", m.dt_max, "initial dt range, upper end")
      .add<double>("model.dt_init_floor", m.dt_init_floor, "smallest initial dt")
      .add<double>("model.A_init_min", m.A_init_lo, "A_log = log(U[A_init_min, A_init_max])")
      .add<double>("model.A_init_max", m.A_init_hi, "A_log = log(U[A_init_min, A_init_max])")
      .add<double>("model.dt_limit_min", m.dt_limit_lo, "clamp of softplus(dt + dt_bias), lower")
      .add<double>("model.dt_limit_max", std::numeric_limits<double>::infinity(),
                   "clamp of softplus(dt + dt_bias), upper (inf: none)")
      .add<double>("model.norm_eps", m.norm_eps, "RMSNorm epsilon");
}

void declare_train_options(io::Deck& d) {
  d.add<I>("train.steps", 1000, "optimizer steps")
      .add<I>("train.batch_size", 8, "sequences (windows) per micro-batch")
      .add<I>("train.grad_accum", 1, "micro-batches per optimizer step")
      .add<double>("train.lr", 2e-3, "peak learning rate")
      .add<double>("train.min_lr", 2e-4, "final learning rate of the cosine schedule")
      .add<I>("train.warmup_steps", 100, "linear warmup steps")
      .add<double>("train.weight_decay", 0.1, "AdamW decoupled weight decay (matrices only)")
      .add<double>("train.beta1", 0.9, "AdamW beta1")
      .add<double>("train.beta2", 0.95, "AdamW beta2")
      .add<double>("train.adam_eps", 1e-8, "AdamW epsilon")
      .add<double>("train.grad_clip", 1.0, "clip the global gradient norm to this (0: off)")
      .add<std::string>("train.recompute", "none", "none | mixer: re-run the mixer internals in the backward")
      .add<I>("train.log_interval", 10, "steps between progress lines")
      .add<I>("train.eval_interval", 0, "steps between held-out evaluations (0: at the end only)")
      .add<I>("train.eval_batch_size", 8, "sequences (windows) per evaluation batch")
      .add<double>("train.time_limit_minutes", 0, "stop (with a checkpoint) after this wall time (0: none)");
  d.add<std::string>("checkpoint.path", "checkpoint.h5", "checkpoint file under output_dir (empty: none)")
      .add<I>("checkpoint.interval", 0, "steps between checkpoints (0: only at the end or on a stop)")
      .add<bool>("checkpoint.keep_all", false, "also keep a copy of every checkpoint as <name>_stepNNNNNNNN.h5")
      .add<std::string>("checkpoint.resume", "", "checkpoint to resume from (relative to the working directory)");
}

void declare_lm_options(io::Deck& d) {
  d.add<I>("model.vocab_size", 16, "vocabulary size (6 DNA tokens: pad A C G T N, padded up for GEMM shapes)")
      .add<bool>("model.tie_embeddings", true, "share the embedding matrix with the LM head");
  declare_backbone_options(d);
  declare_train_options(d);
  d.add<I>("train.seq_len", 1024, "tokens per sequence")
      .add<I>("train.eval_seq_len", 0, "tokens per evaluation window (0: seq_len)");
}

Mamba2Config make_mixer_config(const io::Deck& d) {
  Mamba2Config m;
  m.d_model = d.get<I>("model.d_model");
  m.d_state = d.get<I>("model.d_state");
  m.d_conv = d.get<I>("model.d_conv");
  m.expand = d.get<I>("model.expand");
  m.headdim = d.get<I>("model.headdim");
  m.ngroups = d.get<I>("model.ngroups");
  m.chunk = d.get<I>("model.chunk_size");
  m.dt_min = d.get<double>("model.dt_min");
  m.dt_max = d.get<double>("model.dt_max");
  m.dt_init_floor = d.get<double>("model.dt_init_floor");
  m.A_init_lo = d.get<double>("model.A_init_min");
  m.A_init_hi = d.get<double>("model.A_init_max");
  m.dt_limit_lo = d.get<double>("model.dt_limit_min");
  m.dt_limit_hi = d.get<double>("model.dt_limit_max");
  m.norm_eps = d.get<double>("model.norm_eps");
  m.validate(d.path().empty() ? "[model]" : d.path() + " [model]");
  return m;
}

LMConfig make_lm_config(const io::Deck& d) {
  LMConfig c;
  c.vocab_size = d.get<I>("model.vocab_size");
  c.n_layer = d.get<I>("model.n_layer");
  c.tie_embeddings = d.get<bool>("model.tie_embeddings");
  c.norm_eps = d.get<double>("model.norm_eps");
  c.mixer = make_mixer_config(d);
  c.validate(d.path().empty() ? "[model]" : d.path() + " [model]");
  return c;
}

TrainConfig make_train_config(const io::Deck& d) {
  TrainConfig t;
  t.steps = d.get<I>("train.steps");
  t.grad_accum = d.get<I>("train.grad_accum");
  t.log_interval = d.get<I>("train.log_interval");
  t.eval_interval = d.get<I>("train.eval_interval");
  t.schedule.lr = d.get<double>("train.lr");
  t.schedule.min_lr = d.get<double>("train.min_lr");
  t.schedule.warmup = d.get<I>("train.warmup_steps");
  t.schedule.total = t.steps;
  t.adamw.lr = t.schedule.lr;
  t.adamw.beta1 = d.get<double>("train.beta1");
  t.adamw.beta2 = d.get<double>("train.beta2");
  t.adamw.eps = d.get<double>("train.adam_eps");
  t.adamw.weight_decay = d.get<double>("train.weight_decay");
  t.adamw.grad_clip = d.get<double>("train.grad_clip");
  const std::string rc = d.get<std::string>("train.recompute");
  require(rc == "none" || rc == "mixer", "[train] recompute", "unknown policy '", rc, "'; valid: none mixer");
  t.recompute = rc == "mixer" ? Recompute::mixer : Recompute::none;
  t.time_limit_minutes = d.get<double>("train.time_limit_minutes");
  const std::string ck = d.get<std::string>("checkpoint.path");
  t.checkpoint_path = ck.empty() ? "" : output_path(d, ck);
  t.checkpoint_interval = d.get<I>("checkpoint.interval");
  t.keep_all_checkpoints = d.get<bool>("checkpoint.keep_all");
  t.resume = d.get<std::string>("checkpoint.resume");
  t.metrics_path = output_path(d, "metrics.csv");
  t.seed = std::uint64_t(d.get<I>("run.seed"));
  require(t.steps >= 1, "[train] steps", "must be at least 1");
  require(t.grad_accum >= 1, "[train] grad_accum", "must be at least 1");
  require(t.schedule.lr > 0 && t.schedule.min_lr >= 0, "[train] lr", "lr must be positive and min_lr >= 0");
  require(d.get<I>("train.batch_size") >= 1, "[train] batch_size", "must be at least 1");
  return t;
}

std::string input_path(const io::Deck& deck, const std::string& value) {
  namespace fs = std::filesystem;
  if (value.empty() || fs::path(value).is_absolute() || deck.path().empty()) return value;
  return (fs::path(deck.path()).parent_path() / value).lexically_normal().string();
}

std::string output_path(const io::Deck& deck, const std::string& value) {
  namespace fs = std::filesystem;
  if (fs::path(value).is_absolute()) return value;
  return (fs::path(deck.get<std::string>("run.output_dir")) / value).lexically_normal().string();
}

}  // namespace mm::drivers
