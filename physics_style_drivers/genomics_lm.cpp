// genomics_lm: train a Mamba-2 DNA language model on the records of a FASTA file or HDF5 genome dataset (first
// 1 - holdout_fraction of each record) and report bits per base on the rest. [model] objective chooses the model:
//   causal              next-base prediction (MambaLM); held-out bits per base
//   rc_equivariant_mlm  the reverse-complement-equivariant masked LM (RCPSMaskedLM); held-out bits per masked base
#include <algorithm>
#include <cstdio>

#include "core/error.hpp"
#include "core/mem_sampler.hpp"
#include "io/fasta.hpp"
#include "io/dataset_h5.hpp"
#include "io/genome_dataset.hpp"
#include "lm_options.hpp"
#include "model/rcps_lm.hpp"
#include "registry.hpp"

namespace mm::drivers {

void declare_genomics_lm(io::Deck& d) {
  declare_lm_options(d);
  d.add<std::string>("data.fasta", "", "FASTA file (plain, gzip or bgzip), relative to the deck's directory")
      .add<std::string>("data.dataset", "", "HDF5 genome dataset from the preprocess driver (instead of fasta)")
      .add<std::string>("data.reverse_complement", "none",
                        "none | augment: read each training window on the reverse strand with probability 1/2")
      .add<double>("data.holdout_fraction", 0.1,
                   "held-out tail of every record (fasta only: a dataset keeps the split it was made with)");
  d.add<std::string>("model.objective", "causal",
                     "causal | rc_equivariant_mlm (reverse-complement-equivariant masked LM, Caduceus-style "
                     "parameter sharing)")
      .add<double>("train.mask_rate", 0.15, "rc_equivariant_mlm: fraction of bases masked per window");
}

namespace {

constexpr std::uint64_t kHeldoutMaskStream = 0x5eed0f4e1d0u;  // held-out masks: the same at every evaluation

// Batches of the objective: next-base windows as they are, or masked for the masked objective.
template <class Model>
io::HostBatch objective_batch(const io::HostBatch& w, std::uint64_t seed, std::uint64_t stream, double rate) {
  if constexpr (std::is_same_v<Model, RCPSMaskedLM<float>>) return mask_for_mlm(w, seed, stream, rate);
  else return w;
}

template <class Model>
int train(const io::Deck& d, const io::GenomeDataset& data, const LMConfig& lm, const char* what) {
  const TrainConfig tc = make_train_config(d);
  const std::int64_t batch = d.get<std::int64_t>("train.batch_size"), seqlen = d.get<std::int64_t>("train.seq_len");
  const std::int64_t eval_len =
      d.get<std::int64_t>("train.eval_seq_len") > 0 ? d.get<std::int64_t>("train.eval_seq_len") : seqlen;
  const std::int64_t eval_batch = d.get<std::int64_t>("train.eval_batch_size");
  const double rate = d.get<double>("train.mask_rate");
  require(rate > 0 && rate < 1, "[train] mask_rate", "must be in (0, 1) (got ", rate, ")");
  const std::string rc = d.get<std::string>("data.reverse_complement");
  require(rc == "none" || rc == "augment", "[data] reverse_complement", "'", rc, "' is not one of: none augment");

  Model model = [&] {
    if constexpr (std::is_same_v<Model, MambaLM<float>>) return Model(lm, tc.grid->model_comms());
    else {
      require_data_parallel_only(d, what);
      return Model(lm);
    }
  }();
  model.initialize(tc.seed);
  auto& bb = model.backbone();
  const index_t total = model.params().global_count() - bb.buffer_count();  // the model's, not this rank's slice
  const index_t active = total - (bb.param_count() - bb.active_param_count());
  std::printf("model: %s, %lld layers, d_model %lld, d_state %lld, %lld heads of %lld, %lld parameters\n", what,
              (long long)lm.n_layer, (long long)lm.mixer.d_model, (long long)lm.mixer.d_state,
              (long long)lm.mixer.nheads(), (long long)lm.mixer.headdim, (long long)total);
  std::printf("layers: %s | parameters: %lld total, %lld active per token (backbone %lld total, %lld active)\n",
              pattern_string(bb.pattern()).c_str(), (long long)total, (long long)active, (long long)bb.param_count(),
              (long long)bb.active_param_count());
  std::printf("train: %lld steps of %lld x %lld x %lld tokens, lr %g -> %g (warmup %lld), recompute %s\n",
              (long long)tc.steps, (long long)tc.grad_accum, (long long)batch, (long long)seqlen, tc.schedule.lr,
              tc.schedule.min_lr, (long long)tc.schedule.warmup,
              tc.recompute == Recompute::mixer ? "mixer" : "none");
  const int ranks = tc.grid->world_comm()->size();
  if constexpr (std::is_same_v<Model, MambaLM<float>>) {  // the planner's view of this run, to compare with the peak
    try {
      const std::string plan = parallel::describe(deck_plan(d, ranks));
      std::printf("planner, %d rank%s: %s", ranks, ranks == 1 ? "" : "s", plan.c_str());
    } catch (const Error& e) {
      std::printf("planner: no estimate for this run (%s)\n", e.what());
    }
  }
  std::fflush(stdout);
  DeviceMemorySampler memory(std::chrono::milliseconds(20));

  const auto windows = data.heldout_windows(eval_len);
  auto evaluate = [&]() {
    LossSum total;
    for (std::size_t w = 0; w < windows.size(); w += std::size_t(eval_batch)) {
      const auto hb = objective_batch<Model>(data.heldout_batch(windows, w, eval_batch, eval_len), tc.seed,
                                             stream_mix(kHeldoutMaskStream, w), rate);
      const LossSum l = model.forward(to_device(hb));
      total.nats += l.nats;
      total.count += l.count;
    }
    return total;
  };
  Trainer<Model> trainer(model, tc, d.effective());
  trainer.run(
      [&](std::int64_t step, std::int64_t micro) {
        return objective_batch<Model>(data.sample_train(tc.seed, step, micro, batch, seqlen, rc == "augment"),
                                      tc.seed, stream_mix(stream_mix(stream_id("mlm"), std::uint64_t(step)),
                                                          std::uint64_t(micro)),
                                      rate);
      },
      evaluate);
  if (DeviceMemorySampler::sampling()) {  // collective: every rank's peak, the largest printed
    const auto peaks = tc.grid->world_comm()->allgather(std::vector<double>{memory.peak_bytes()});
    std::printf("memory: peak %.2f GB on the fullest of %d GPUs (device-wide, sampled every 20 ms: the CUDA context, "
                "libraries and the workspace cache included)\n",
                *std::max_element(peaks.begin(), peaks.end()) / 1e9, ranks);
  }
  if (!trainer.evals().empty()) {
    const auto& e = trainer.evals().back();
    std::printf("result: held-out %.4f %s over %lld bases at step %lld\n", e.loss.bits_per_token(),
                Model::metric_name, (long long)e.loss.count, (long long)e.step);
  }
  return 0;
}

}  // namespace

int run_genomics_lm(const io::Deck& d) {
  const std::string fasta = input_path(d, d.get<std::string>("data.fasta"));
  const std::string dataset = input_path(d, d.get<std::string>("data.dataset"));
  require(fasta.empty() != dataset.empty(), d.path() + " [data]", "give exactly one of fasta and dataset");
  const LMConfig lm = make_lm_config(d);
  require(lm.vocab_size >= 6, "[model] vocab_size", "must hold the 6 DNA tokens (got ", lm.vocab_size, ")");
  require(d.get<std::int64_t>("train.seq_len") >= 2, "[train] seq_len", "must be at least 2");
  const std::string objective = d.get<std::string>("model.objective");
  require(objective == "causal" || objective == "rc_equivariant_mlm", "[model] objective", "'", objective,
          "' is not one of: causal rc_equivariant_mlm");
  if (print_plan_only(d)) return 0;

  const io::GenomeDataset data =
      dataset.empty() ? io::GenomeDataset(io::read_fasta(fasta), d.get<double>("data.holdout_fraction"), fasta)
                      : io::open_genome_dataset(dataset);
  const std::string source = dataset.empty() ? fasta : dataset;
  std::printf("data: %s: %lld record(s), %lld training bases, %lld held-out bases\n", source.c_str(),
              (long long)data.n_records(), (long long)data.train().size(), (long long)data.heldout().size());
  require(data.heldout().size() > 1, source, "the held-out part is empty: raise [data] holdout_fraction");
  if (objective == "causal") return train<MambaLM<float>>(d, data, lm, "Mamba-2 LM (next base)");
  return train<RCPSMaskedLM<float>>(d, data, lm, "RC-equivariant Mamba-2 masked LM (RCPS)");
}

}  // namespace mm::drivers
