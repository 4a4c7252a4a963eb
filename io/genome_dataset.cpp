#include "io/genome_dataset.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "io/tokens.hpp"

namespace mm::io {

std::vector<RecordRun> MemoryTokenSource::runs() const {
  std::vector<RecordRun> out;
  for (std::int64_t i = 0; i < size(); ++i) {
    if (out.empty() || record[std::size_t(i)] != out.back().record) out.push_back({i, 0, record[std::size_t(i)]});
    ++out.back().length;
  }
  return out;
}

void MemoryTokenSource::read(std::int64_t start, std::int64_t n, std::int32_t* t, std::int32_t* r) const {
  require(start >= 0 && n >= 0 && start + n <= size(), "MemoryTokenSource", "read of [", start, ", ", start + n,
          ") outside [0, ", size(), ")");
  std::copy_n(tokens.begin() + start, n, t);
  std::copy_n(record.begin() + start, n, r);
}

GenomeDataset::GenomeDataset(const std::vector<FastaRecord>& records, double holdout_fraction,
                             const std::string& source)
    : n_records_(std::int64_t(records.size())), source_(source) {
  require(holdout_fraction >= 0 && holdout_fraction < 1, source, "holdout_fraction must be in [0, 1) (got ",
          holdout_fraction, ")");
  auto train = std::make_shared<MemoryTokenSource>();
  auto heldout = std::make_shared<MemoryTokenSource>();
  for (std::size_t r = 0; r < records.size(); ++r) {
    const std::string& s = records[r].seq;
    const auto n = std::int64_t(s.size());
    const auto n_train = n - std::int64_t(double(n) * holdout_fraction);
    for (std::int64_t i = 0; i < n; ++i) {
      MemoryTokenSource& dst = i < n_train ? *train : *heldout;
      dst.tokens.push_back(base_to_token(s[std::size_t(i)]));
      dst.record.push_back(std::int32_t(r));
    }
  }
  train_ = std::move(train);
  heldout_ = std::move(heldout);
}

GenomeDataset::GenomeDataset(std::shared_ptr<const TokenSource> train, std::shared_ptr<const TokenSource> heldout,
                             std::int64_t n_records, const std::string& source)
    : train_(std::move(train)), heldout_(std::move(heldout)), n_records_(n_records), source_(source) {}

void GenomeDataset::fill_row(const TokenSource& s, std::int64_t start, std::int64_t length, std::int64_t seqlen,
                             std::int64_t row, HostBatch& out, bool reverse_complement) {
  // the inputs and one more token: the last input's target
  const std::int64_t n = std::min(length + 1, s.size() - start);
  std::vector<std::int32_t> tok(std::size_t(std::max<std::int64_t>(n, 0))), rec(tok.size());
  if (n > 0) s.read(start, n, tok.data(), rec.data());
  if (reverse_complement) {  // the same bases read on the other strand
    std::reverse(tok.begin(), tok.end());
    std::reverse(rec.begin(), rec.end());
    for (auto& t : tok) t = complement_token(t);
  }
  for (std::int64_t t = 0; t < seqlen; ++t) {
    const std::int64_t o = row * seqlen + t;
    if (t >= length) {  // padding: its own record id, never scored
      out.tokens[o] = kPad;
      out.targets[o] = -1;
      out.seq_idx[o] = -1;
      continue;
    }
    out.tokens[o] = tok[std::size_t(t)];
    out.seq_idx[o] = rec[std::size_t(t)];
    const bool next_ok = t + 1 < n && rec[std::size_t(t + 1)] == rec[std::size_t(t)];
    const std::int32_t next = next_ok ? tok[std::size_t(t + 1)] : kPad;
    out.targets[o] = (next >= kA && next <= kT) ? next : -1;
  }
}

HostBatch GenomeDataset::sample_train(std::uint64_t seed, std::int64_t step, std::int64_t micro,
                                      std::int64_t batch, std::int64_t seqlen, bool rc_augment) const {
  require(train_->size() > seqlen + 1, source_, "the training part (", train_->size(),
          " bases) is shorter than seq_len + 1 = ", seqlen + 1, ": lower train.seq_len");
  HostBatch out(batch, seqlen);
  const CounterRNG rng{seed, stream_mix(stream_mix(stream_id("genome_dataset::train_window"), std::uint64_t(step)),
                                        std::uint64_t(micro))};
  const auto span = std::uint64_t(train_->size() - seqlen);  // starts in [0, size - seqlen): last target exists
  // Row b's start and strand come from counters (b) and (batch + b) of the step's stream.
  for (std::int64_t b = 0; b < batch; ++b)
    fill_row(*train_, std::int64_t(rng.below(std::uint64_t(b), span)), seqlen, seqlen, b, out,
             rc_augment && rng.below(std::uint64_t(batch + b), 2) == 1);
  return out;
}

std::vector<Window> GenomeDataset::heldout_windows(std::int64_t seqlen) const {
  std::vector<Window> out;
  for (const RecordRun& run : heldout_->runs()) {
    const std::int64_t end = run.start + run.length;
    // inputs [s, s + len) predict [s + 1, s + len]; the record's last base is an input of no scored target
    for (std::int64_t s = run.start; s < end - 1; s += seqlen) out.push_back({s, std::min(seqlen, end - 1 - s)});
  }
  return out;
}

HostBatch GenomeDataset::heldout_batch(const std::vector<Window>& windows, std::size_t first, std::int64_t batch,
                                       std::int64_t seqlen) const {
  HostBatch out(batch, seqlen);
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::size_t w = first + std::size_t(b);
    if (w < windows.size()) {
      fill_row(*heldout_, windows[w].start, windows[w].length, seqlen, b, out);
    } else {
      fill_row(*heldout_, 0, 0, seqlen, b, out);
    }
  }
  return out;
}

}  // namespace mm::io
