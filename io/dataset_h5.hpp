// Preprocessed datasets in HDF5: a genome (FASTA records split into training and held-out tokens) or a time series,
// written once and then streamed in windows through the TokenSource / SeriesSource interfaces, so that a driver
// never reads the whole file and trains exactly as from the source file. Every failure throws mm::Error with the
// file path as context and a message naming the dataset or attribute.
//
// Genome layout (mambamoe_dataset = "genome"):
//   /genome/train/tokens, /genome/heldout/tokens   uint8 [n], token ids of io/tokens.hpp (chunked, gzip 4 + shuffle)
//   /genome/train/runs, /genome/heldout/runs       int64 [runs, 3], rows [start, length, record], tiling [0, n)
//   /genome/records/name                           variable-length strings [records]
//   /genome/records/length                         int64 [records], whole record lengths in bases
//   root attributes: source (string), holdout_fraction (float64), n_records (int64), and
//                    train_counts, heldout_counts (int64 arrays of 5: the A, C, G, T, N bases of each split)
//
// Series layout (mambamoe_dataset = "series"):
//   /series/values                                 float64 [rows, channels], NaN where masked (chunked by rows,
//                                                  gzip 4 + shuffle)
//   /series/mask                                   uint8 [rows, channels], 1 = observed (chunked like values)
//   /series/timestamps                             variable-length strings [rows], only when the source has them
//   /series/channels                               variable-length strings [channels]
//   /series/train_mean, /series/train_std          float64 [channels], train_stats over the training rows
//   root attributes: source (string), train_end, val_end (int64, from chronological_split)
//
// Both carry the root attributes mambamoe_dataset (string, the kind) and mambamoe_dataset_format (int64) =
// kDatasetFormat, which the readers require. Writers write `path + ".tmp"` and rename it onto `path` when complete
// (like checkpoints), so a crash never leaves a half-written dataset under the real name.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "io/fasta.hpp"
#include "io/genome_dataset.hpp"
#include "io/sources.hpp"
#include "io/timeseries.hpp"

namespace mm::io {

// Bump when the layout changes incompatibly; readers refuse files newer than they know.
inline constexpr std::int64_t kDatasetFormat = 1;
inline constexpr const char* kDatasetKindAttr = "mambamoe_dataset";
inline constexpr const char* kDatasetFormatAttr = "mambamoe_dataset_format";

// ----------------------------------------------------------------------------------------------- genome
// Splits `records` exactly as GenomeDataset's FASTA constructor does (the first n - floor(n * holdout_fraction)
// bases of each record train, the rest are held out) and writes the dataset. `source` is recorded as provenance
// (the FASTA path).
void write_genome_dataset(const std::string& path, const std::vector<FastaRecord>& records, double holdout_fraction,
                          const std::string& source);

// One split ("train" or "heldout") of a genome dataset. Keeps the file open and holds only the runs in memory;
// read() reads the requested tokens and nothing else from the file.
class H5TokenSource : public TokenSource {
 public:
  H5TokenSource(const std::string& path, const std::string& split);
  ~H5TokenSource() override;
  H5TokenSource(const H5TokenSource&) = delete;
  H5TokenSource& operator=(const H5TokenSource&) = delete;

  std::int64_t size() const override;
  std::vector<RecordRun> runs() const override;
  void read(std::int64_t start, std::int64_t n, std::int32_t* tokens, std::int32_t* records) const override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A GenomeDataset streaming both splits from the file (`path` is its source in errors).
GenomeDataset open_genome_dataset(const std::string& path);

// ----------------------------------------------------------------------------------------------- time series
// Writes every row of `series`, reading it in blocks of rows, with the split of chronological_split(length,
// train_fraction, test_fraction) and the train_stats of that split.
void write_series_dataset(const std::string& path, const SeriesSource& series, double train_fraction,
                          double test_fraction);

// The series of a series dataset, read in blocks of rows on demand. info().source is "<path>:/series/values".
class H5SeriesSource : public SeriesSource {
 public:
  explicit H5SeriesSource(const std::string& path);
  ~H5SeriesSource() override;
  H5SeriesSource(const H5SeriesSource&) = delete;
  H5SeriesSource& operator=(const H5SeriesSource&) = delete;

  const SeriesInfo& info() const override;
  void read(std::int64_t row0, std::int64_t n, double* values, std::uint8_t* mask) const override;
  std::vector<std::string> timestamps(std::int64_t row0, std::int64_t n) const override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The split and training statistics stored with a series dataset.
struct SeriesDatasetMeta {
  Split split;
  ChannelStats stats;
};
SeriesDatasetMeta read_series_meta(const std::string& path);

}  // namespace mm::io
