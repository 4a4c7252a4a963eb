// A next-base-prediction dataset over FASTA records: each record is split into a training part (its first
// 1 - holdout_fraction) and a held-out part (the rest). Training windows are drawn at random positions of the
// concatenated training parts (records packed back to back, told apart by a record id so that nothing leaks across
// a boundary); held-out windows tile each record's held-out part in order.
//
// Targets are the next base; a target is not scored (-1) when it lies in another record or is not one of A, C, G, T
// (N runs carry no information), so bits per base are over real bases only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <memory>

#include "io/fasta.hpp"
#include "io/host_batch.hpp"
#include "io/sources.hpp"

namespace mm::io {

struct Window {
  std::int64_t start = 0, length = 0;  // inputs [start, start + length) of the held-out stream; targets shifted by 1
};

class GenomeDataset {
 public:
  // Split parsed FASTA records in memory.
  GenomeDataset(const std::vector<FastaRecord>& records, double holdout_fraction, const std::string& source);
  // Read from two token sources (e.g. the train and held-out parts of an HDF5 dataset), streamed on demand.
  GenomeDataset(std::shared_ptr<const TokenSource> train, std::shared_ptr<const TokenSource> heldout,
                std::int64_t n_records, const std::string& source);

  const TokenSource& train() const { return *train_; }
  const TokenSource& heldout() const { return *heldout_; }
  std::int64_t n_records() const { return n_records_; }

  // Training micro-batch `micro` of optimizer step `step`: `batch` windows of `seqlen` inputs each, at positions
  // drawn from the counter RNG (seed, step, micro, row), so any step can be regenerated exactly (resume).
  // With rc_augment, each window is read on the reverse strand (reverse complement) with probability 1/2, so a
  // model trained on both strands learns strand-symmetric statistics.
  HostBatch sample_train(std::uint64_t seed, std::int64_t step, std::int64_t micro, std::int64_t batch,
                         std::int64_t seqlen, bool rc_augment = false) const;

  // Consecutive windows of at most `seqlen` inputs over every record's held-out part; every held-out base except
  // the first of each record is a target exactly once.
  std::vector<Window> heldout_windows(std::int64_t seqlen) const;
  // Rows for windows [first, first + batch) (missing rows and the tail of short windows are padding).
  HostBatch heldout_batch(const std::vector<Window>& windows, std::size_t first, std::int64_t batch,
                          std::int64_t seqlen) const;

 private:
  static void fill_row(const TokenSource& s, std::int64_t start, std::int64_t length, std::int64_t seqlen,
                       std::int64_t row, HostBatch& out, bool reverse_complement = false);
  std::shared_ptr<const TokenSource> train_, heldout_;
  std::int64_t n_records_ = 0;
  std::string source_;
};

}  // namespace mm::io
