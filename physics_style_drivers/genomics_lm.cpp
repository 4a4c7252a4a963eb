// genomics_lm: train a Mamba-2 language model on the records of a FASTA file (first 1 - holdout_fraction of each
// record) and report bits per base on the rest.
#include <cstdio>

#include "core/error.hpp"
#include "io/fasta.hpp"
#include "io/dataset_h5.hpp"
#include "io/genome_dataset.hpp"
#include "lm_options.hpp"
#include "registry.hpp"

namespace mm::drivers {

void declare_genomics_lm(io::Deck& d) {
  declare_lm_options(d);
  d.add<std::string>("data.fasta", "", "FASTA file (plain, gzip or bgzip), relative to the deck's directory")
      .add<std::string>("data.dataset", "", "HDF5 genome dataset from the preprocess driver (instead of fasta)")
      .add<std::string>("data.reverse_complement", "none",
                        "none | augment: read each training window on the reverse strand with probability 1/2")
      .add<double>("data.holdout_fraction", 0.1, "held-out tail of every record (fasta only: a dataset keeps the split it was made with)");
}

namespace {

// Held-out bits per base over every held-out window.
LossSum evaluate(MambaLM<float>& model, const io::GenomeDataset& data, std::int64_t seqlen, std::int64_t batch) {
  const auto windows = data.heldout_windows(seqlen);
  LossSum total;
  for (std::size_t w = 0; w < windows.size(); w += std::size_t(batch)) {
    const LossSum l = model.forward(to_device(data.heldout_batch(windows, w, batch, seqlen)));
    total.nats += l.nats;
    total.count += l.count;
  }
  return total;
}

}  // namespace

int run_genomics_lm(const io::Deck& d) {
  const std::string fasta = input_path(d, d.get<std::string>("data.fasta"));
  const std::string dataset = input_path(d, d.get<std::string>("data.dataset"));
  require(fasta.empty() != dataset.empty(), d.path() + " [data]", "give exactly one of fasta and dataset");
  const LMConfig lm = make_lm_config(d);
  const TrainConfig tc = make_train_config(d);
  const std::int64_t batch = d.get<std::int64_t>("train.batch_size"), seqlen = d.get<std::int64_t>("train.seq_len");
  const std::int64_t eval_len = d.get<std::int64_t>("train.eval_seq_len") > 0 ? d.get<std::int64_t>("train.eval_seq_len")
                                                                             : seqlen;
  const std::int64_t eval_batch = d.get<std::int64_t>("train.eval_batch_size");
  require(lm.vocab_size >= 6, "[model] vocab_size", "must hold the 6 DNA tokens (got ", lm.vocab_size, ")");
  require(seqlen >= 2, "[train] seq_len", "must be at least 2 (got ", seqlen, ")");

  const io::GenomeDataset data =
      dataset.empty() ? io::GenomeDataset(io::read_fasta(fasta), d.get<double>("data.holdout_fraction"), fasta)
                      : io::open_genome_dataset(dataset);
  const std::string source = dataset.empty() ? fasta : dataset;
  std::printf("data: %s: %lld record(s), %lld training bases, %lld held-out bases\n", source.c_str(),
              (long long)data.n_records(), (long long)data.train().size(), (long long)data.heldout().size());
  require(data.heldout().size() > 1, source, "the held-out part is empty: raise [data] holdout_fraction");

  MambaLM<float> model(lm);
  model.initialize(tc.seed);
  std::printf("model: Mamba-2 LM, %lld layers, d_model %lld, d_state %lld, %lld heads of %lld, %lld parameters\n",
              (long long)lm.n_layer, (long long)lm.mixer.d_model, (long long)lm.mixer.d_state,
              (long long)lm.mixer.nheads(), (long long)lm.mixer.headdim, (long long)model.params().count());
  std::printf("train: %lld steps of %lld x %lld x %lld tokens, lr %g -> %g (warmup %lld), recompute %s\n",
              (long long)tc.steps, (long long)tc.grad_accum, (long long)batch, (long long)seqlen, tc.schedule.lr,
              tc.schedule.min_lr, (long long)tc.schedule.warmup,
              tc.recompute == Recompute::mixer ? "mixer" : "none");
  std::fflush(stdout);

  Trainer<MambaLM<float>> trainer(model, tc, d.effective());
  const std::string rc = d.get<std::string>("data.reverse_complement");
  require(rc == "none" || rc == "augment", "[data] reverse_complement", "'", rc, "' is not one of: none augment");
  trainer.run([&](std::int64_t step, std::int64_t micro) {
                return data.sample_train(tc.seed, step, micro, batch, seqlen, rc == "augment");
              },
              [&]() { return evaluate(model, data, eval_len, eval_batch); });
  if (!trainer.evals().empty()) {
    const auto& e = trainer.evals().back();
    std::printf("result: held-out %.4f bits/base over %lld bases at step %lld\n", e.loss.bits_per_token(),
                (long long)e.loss.count, (long long)e.step);
  }
  return 0;
}

}  // namespace mm::drivers
