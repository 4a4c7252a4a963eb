// Time series input: CSV files (an optional timestamp column and one or more value columns), a chronological
// split, training-set statistics, stride-1 evaluation windows and the naive forecasting baselines every forecast
// is reported next to.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/sources.hpp"

namespace mm::io {

struct CsvOptions {
  // "auto": the first column is the timestamp when its header is date/time/timestamp/datetime (any case) or its
  // first value does not parse as a number; "": no timestamp column; otherwise the column of that name.
  std::string timestamp_column = "auto";
  // Value columns to read (empty: every column but the timestamp).
  std::vector<std::string> columns;
  // false: a missing value (empty cell, NA, NaN) is an error naming the line; true: it is masked.
  bool mask_missing = false;
  char delimiter = ',';
};

// A series held in memory.
class TimeSeries : public SeriesSource {
 public:
  SeriesInfo meta;
  std::vector<double> values;         // length x channels, row-major; NaN where masked
  std::vector<std::uint8_t> mask;     // 1 = observed
  std::vector<std::string> stamps;    // one per row, or empty

  const SeriesInfo& info() const override { return meta; }
  void read(std::int64_t row0, std::int64_t n, double* v, std::uint8_t* m) const override;
  std::vector<std::string> timestamps(std::int64_t row0, std::int64_t n) const override;
};

// Reads a CSV file with a header row. Errors (mm::Error, context "path:line") for: a missing or empty file, no
// header, a ragged row (wrong number of fields), a value that is not a number, a missing value unless
// mask_missing, timestamps that are not strictly increasing (unsorted or duplicated; ISO 8601 text or numbers), an
// unknown column name. Nothing is silently dropped.
TimeSeries read_csv(const std::string& path, const CsvOptions& opt);

// Chronological split, LTSF convention: train = floor(n * train_fraction), test = floor(n * test_fraction),
// validation = the rest, in that order.
struct Split {
  std::int64_t train_end = 0, val_end = 0, n = 0;  // train [0, train_end), val [train_end, val_end), test [val_end, n)
};
Split chronological_split(std::int64_t n, double train_fraction, double test_fraction);

// Per-channel mean and standard deviation over the observed training rows (the z-score of the LTSF protocol).
struct ChannelStats {
  std::vector<double> mean, std;
};
ChannelStats train_stats(const SeriesSource& s, const Split& split);

// Stride-1 windows whose targets [start + input, start + input + horizon) lie in [begin, end); their inputs may
// reach back before `begin` (the protocol's val/test windows start `input` steps early).
std::vector<std::int64_t> window_starts(std::int64_t begin, std::int64_t end, std::int64_t input,
                                        std::int64_t horizon);

struct Metrics {
  double mse = 0, mae = 0;          // on z-scored values
  double mse_orig = 0, mae_orig = 0;  // in original units
  std::int64_t count = 0;           // observed target values scored
};

// Naive forecasts over the test windows (z-scored with `stats`), every horizon step and channel, observed targets
// only: lag 0 means "last value"; lag s > 0 repeats the last season, y_hat(t + h) = y(t + h - s * ceil(h / s)).
Metrics naive_baseline(const SeriesSource& s, const Split& split, const ChannelStats& stats, std::int64_t input,
                       std::int64_t horizon, std::int64_t lag);

}  // namespace mm::io
