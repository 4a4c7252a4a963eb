#include "io/genome_dataset.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "io/tokens.hpp"

namespace mm::io {

std::int64_t HostBatch::scored() const {
  return std::count_if(targets.begin(), targets.end(), [](std::int32_t t) { return t >= 0; });
}

GenomeDataset::GenomeDataset(const std::vector<FastaRecord>& records, double holdout_fraction,
                             const std::string& source)
    : n_records_(std::int64_t(records.size())), source_(source) {
  require(holdout_fraction >= 0 && holdout_fraction < 1, source, "holdout_fraction must be in [0, 1) (got ",
          holdout_fraction, ")");
  for (std::size_t r = 0; r < records.size(); ++r) {
    const std::string& s = records[r].seq;
    const auto n = std::int64_t(s.size());
    const auto n_train = n - std::int64_t(double(n) * holdout_fraction);
    for (std::int64_t i = 0; i < n; ++i) {
      TokenStream& dst = i < n_train ? train_ : heldout_;
      dst.tokens.push_back(base_to_token(s[i]));
      dst.record.push_back(std::int32_t(r));
    }
  }
}

void GenomeDataset::fill_row(const TokenStream& s, std::int64_t start, std::int64_t length, std::int64_t seqlen,
                             std::int64_t row, HostBatch& out) {
  for (std::int64_t t = 0; t < seqlen; ++t) {
    const std::int64_t o = row * seqlen + t, i = start + t;
    if (t >= length) {  // padding: its own record id, never scored
      out.tokens[o] = kPad;
      out.targets[o] = -1;
      out.seq_idx[o] = -1;
      continue;
    }
    out.tokens[o] = s.tokens[i];
    out.seq_idx[o] = s.record[i];
    const bool next_ok = i + 1 < s.size() && s.record[i + 1] == s.record[i];
    const std::int32_t next = next_ok ? s.tokens[i + 1] : kPad;
    out.targets[o] = (next >= kA && next <= kT) ? next : -1;
  }
}

HostBatch GenomeDataset::sample_train(std::uint64_t seed, std::int64_t step, std::int64_t micro,
                                      std::int64_t batch, std::int64_t seqlen) const {
  require(train_.size() > seqlen + 1, source_, "the training part (", train_.size(),
          " bases) is shorter than seq_len + 1 = ", seqlen + 1, ": lower train.seq_len");
  HostBatch out(batch, seqlen);
  const CounterRNG rng{seed, stream_mix(stream_mix(stream_id("genome_dataset::train_window"), std::uint64_t(step)),
                                        std::uint64_t(micro))};
  const auto span = std::uint64_t(train_.size() - seqlen);  // starts in [0, size - seqlen): last target exists
  for (std::int64_t b = 0; b < batch; ++b)
    fill_row(train_, std::int64_t(rng.below(std::uint64_t(b), span)), seqlen, seqlen, b, out);
  return out;
}

std::vector<Window> GenomeDataset::heldout_windows(std::int64_t seqlen) const {
  std::vector<Window> out;
  std::int64_t begin = 0;
  while (begin < heldout_.size()) {
    std::int64_t end = begin;
    while (end < heldout_.size() && heldout_.record[end] == heldout_.record[begin]) ++end;
    // inputs [s, s + len) predict [s + 1, s + len]; the record's last base is an input of no scored target
    for (std::int64_t s = begin; s < end - 1; s += seqlen) out.push_back({s, std::min(seqlen, end - 1 - s)});
    begin = end;
  }
  return out;
}

HostBatch GenomeDataset::heldout_batch(const std::vector<Window>& windows, std::size_t first, std::int64_t batch,
                                       std::int64_t seqlen) const {
  HostBatch out(batch, seqlen);
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::size_t w = first + std::size_t(b);
    if (w < windows.size()) {
      fill_row(heldout_, windows[w].start, windows[w].length, seqlen, b, out);
    } else {
      fill_row(heldout_, 0, 0, seqlen, b, out);
    }
  }
  return out;
}

}  // namespace mm::io
