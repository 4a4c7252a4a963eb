// Data sources the drivers read training and evaluation windows from, in pieces: from memory (a parsed FASTA or
// CSV file) or streamed from an HDF5 dataset without reading the whole file. A driver sees only these interfaces,
// so training from a preprocessed dataset equals training from its source file.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mm::io {

// ----------------------------------------------------------------------------------------------- DNA tokens
// A contiguous run of tokens of one FASTA record.
struct RecordRun {
  std::int64_t start = 0, length = 0;
  std::int32_t record = 0;
};

// A token stream (one token per base) with the record each token belongs to.
class TokenSource {
 public:
  virtual ~TokenSource() = default;
  virtual std::int64_t size() const = 0;
  // The records' runs in order; they tile [0, size()).
  virtual std::vector<RecordRun> runs() const = 0;
  // Tokens and record ids of [start, start + n); start + n <= size().
  virtual void read(std::int64_t start, std::int64_t n, std::int32_t* tokens, std::int32_t* records) const = 0;
};

class MemoryTokenSource : public TokenSource {
 public:
  std::vector<std::int32_t> tokens, record;
  std::int64_t size() const override { return std::int64_t(tokens.size()); }
  std::vector<RecordRun> runs() const override;
  void read(std::int64_t start, std::int64_t n, std::int32_t* t, std::int32_t* r) const override;
};

// ----------------------------------------------------------------------------------------------- time series
struct SeriesInfo {
  std::string source;                 // where the values came from (file, and dataset if any)
  std::vector<std::string> channels;  // one name per channel
  std::int64_t length = 0;            // rows (time steps)
  bool has_timestamps = false;
};

// A multichannel series, rows are time steps. Missing values are NaN with mask 0.
class SeriesSource {
 public:
  virtual ~SeriesSource() = default;
  virtual const SeriesInfo& info() const = 0;
  // Rows [row0, row0 + n) as n x channels values (row-major) and the same shape of masks (1 = observed).
  virtual void read(std::int64_t row0, std::int64_t n, double* values, std::uint8_t* mask) const = 0;
  // Timestamps of rows [row0, row0 + n) as text (empty when the series has none).
  virtual std::vector<std::string> timestamps(std::int64_t row0, std::int64_t n) const = 0;
};

}  // namespace mm::io
