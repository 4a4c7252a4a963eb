#include "io/timeseries.hpp"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string_view>
#include <system_error>
#include <utility>

#include "core/error.hpp"

namespace mm::io {
namespace {

constexpr std::string_view kBlank = " \t\r";

std::string_view trim(std::string_view s) {
  const auto b = s.find_first_not_of(kBlank);
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(kBlank) - b + 1);
}

bool iequals(std::string_view a, std::string_view b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](char x, char y) {
    return (x >= 'A' && x <= 'Z' ? char(x - 'A' + 'a') : x) == (y >= 'A' && y <= 'Z' ? char(y - 'A' + 'a') : y);
  });
}

struct FileCloser {
  void operator()(std::FILE* fp) const noexcept { std::fclose(fp); }
};

// The whole file in one buffer: the parser splits it in place, which is what keeps 10^8 cells at memory speed.
std::string read_whole_file(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  require(fs::exists(st), path, "CSV file does not exist");
  require(!fs::is_directory(st), path, "is a directory, not a CSV file");
  errno = 0;
  const std::unique_ptr<std::FILE, FileCloser> fp(std::fopen(path.c_str(), "rb"));
  require(fp != nullptr, path, "cannot open CSV file: ", std::strerror(errno ? errno : EIO));
  // One read of the size the file has now, then on to the end in case it is a pipe or still growing.
  std::string text;
  const std::uintmax_t size = fs::file_size(path, ec);
  text.resize(ec ? 0 : std::size_t(size));
  text.resize(std::fread(text.data(), 1, text.size(), fp.get()));
  char chunk[1 << 16];
  for (std::size_t n = 0; (n = std::fread(chunk, 1, sizeof chunk, fp.get())) > 0;) text.append(chunk, n);
  require(!std::ferror(fp.get()), path, "read error after ", text.size(),
          " bytes: ", std::strerror(errno ? errno : EIO));
  return text;
}

// Splits a CSV buffer into records, RFC 4180 style: fields separated by the delimiter, optionally double-quoted
// (a quoted field may hold delimiters, newlines and "" for a quote), records ended by \n or \r\n. Quoted fields are
// unescaped in place, so every field is a view into the buffer and nothing is allocated per cell.
class CsvSplitter {
 public:
  CsvSplitter(const std::string& path, char* begin, char* end, char delimiter)
      : path_(path), p_(begin), end_(end), delim_(delimiter) {}

  // The next record's fields and the line it starts on; false once only blank lines remain. A blank line before
  // more data is a record (one empty field), so that it is reported rather than skipped.
  bool next(std::vector<std::string_view>& fields, std::int64_t& line) {
    fields.clear();
    if (rest_is_blank()) return false;
    line = line_;
    for (;;) {
      char* r = p_;
      while (r < end_ && is_pad(*r)) ++r;
      if (r < end_ && *r == '"') {
        r = quoted_field(r, fields);
      } else {
        r = p_;
        while (r < end_ && *r != delim_ && *r != '\n') ++r;
        fields.emplace_back(p_, std::size_t(r - p_));
      }
      if (r < end_ && *r == delim_) {
        p_ = r + 1;
        continue;
      }
      if (r < end_) ++line_;  // at '\n'; a '\r' before it belongs to the field and is trimmed with the blanks
      p_ = r < end_ ? r + 1 : r;
      return true;
    }
  }

 private:
  std::string at(std::int64_t line) const { return path_ + ":" + std::to_string(line); }
  bool is_pad(char c) const { return (c == ' ' || c == '\t') && c != delim_; }

  bool rest_is_blank() const {
    return std::all_of(static_cast<const char*>(p_), static_cast<const char*>(end_),
                       [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; });
  }

  // `q` is at the opening quote; returns the position after the field (at a delimiter, a line end or the end).
  char* quoted_field(char* q, std::vector<std::string_view>& fields) {
    const std::int64_t open_line = line_;
    char* out = q;
    char* r = q + 1;
    for (;;) {
      require(r < end_, at(open_line), "quoted field never closed (no matching '\"')");
      if (*r == '"') {
        if (r + 1 < end_ && r[1] == '"') {
          *out++ = '"';
          r += 2;
          continue;
        }
        ++r;
        break;
      }
      if (*r == '\n') ++line_;
      *out++ = *r++;
    }
    fields.emplace_back(q, std::size_t(out - q));
    while (r < end_ && (is_pad(*r) || (*r == '\r' && (r + 1 == end_ || r[1] == '\n')))) ++r;
    if (r < end_ && *r != delim_ && *r != '\n') {
      throw Error(at(line_), detail::concat("unexpected '", *r, "' after the closing quote of field ", fields.size(),
                                            " (a quoted field must end at a delimiter or the line end)"));
    }
    return r;
  }

  const std::string& path_;
  char* p_;
  char* end_;
  char delim_;
  std::int64_t line_ = 1;
};

enum class Cell { number, missing, infinite, out_of_range, invalid };

// A cell as a number. Empty, NA, NaN and null (any case) are missing, and so is any NaN spelling from_chars accepts.
Cell parse_cell(std::string_view field, double& v) {
  const std::string_view s = trim(field);
  if (s.empty()) return Cell::missing;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec == std::errc::result_out_of_range) return Cell::out_of_range;
  if (ec != std::errc() || ptr != s.data() + s.size()) {
    return iequals(s, "na") || iequals(s, "null") ? Cell::missing : Cell::invalid;
  }
  if (std::isnan(v)) return Cell::missing;
  return std::isinf(v) ? Cell::infinite : Cell::number;
}

// The n decimal digits at s[pos, pos + n) as a number.
std::optional<int> digits(std::string_view s, std::size_t pos, std::size_t n) {
  if (pos + n > s.size()) return std::nullopt;
  int v = 0;
  for (std::size_t i = pos; i < pos + n; ++i) {
    if (s[i] < '0' || s[i] > '9') return std::nullopt;
    v = v * 10 + (s[i] - '0');
  }
  return v;
}

// Seconds since 1970-01-01 00:00 (proleptic Gregorian, no time zone but a trailing Z) of YYYY-MM-DD,
// YYYY-MM-DD HH:MM[:SS] or YYYY-MM-DDTHH:MM[:SS][Z].
std::optional<double> parse_iso8601(std::string_view s) {
  using namespace std::chrono;
  const auto y = digits(s, 0, 4), mo = digits(s, 5, 2), d = digits(s, 8, 2);
  if (!y || !mo || !d || s[4] != '-' || s[7] != '-') return std::nullopt;
  const year_month_day ymd{year(*y), month(unsigned(*mo)), day(unsigned(*d))};
  if (!ymd.ok()) return std::nullopt;
  const double day_start = double(sys_days(ymd).time_since_epoch().count()) * 86400.0;
  if (s.size() == 10) return day_start;
  const char sep = s[10];
  const auto hh = digits(s, 11, 2), mm = digits(s, 14, 2);
  if ((sep != ' ' && sep != 'T') || !hh || !mm || s[13] != ':' || *hh > 23 || *mm > 59) return std::nullopt;
  std::size_t end = 16;
  int ss = 0;
  if (s.size() > end && s[end] == ':') {
    const auto sec = digits(s, 17, 2);
    if (!sec || *sec > 59) return std::nullopt;
    ss = *sec;
    end = 19;
  }
  if (sep == 'T' && s.size() == end + 1 && s[end] == 'Z') ++end;
  if (s.size() != end) return std::nullopt;
  return day_start + *hh * 3600.0 + *mm * 60.0 + ss;
}

bool is_time_name(std::string_view name) {
  for (std::string_view n : {"date", "time", "timestamp", "datetime"}) {
    if (iequals(name, n)) return true;
  }
  return false;
}

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

}  // namespace

void TimeSeries::read(std::int64_t row0, std::int64_t n, double* v, std::uint8_t* m) const {
  require(row0 >= 0 && n >= 0 && row0 + n <= meta.length, meta.source, "read of rows [", row0, ", ", row0 + n,
          ") outside [0, ", meta.length, ")");
  const auto c = std::int64_t(meta.channels.size());
  std::copy_n(values.begin() + row0 * c, n * c, v);
  std::copy_n(mask.begin() + row0 * c, n * c, m);
}

std::vector<std::string> TimeSeries::timestamps(std::int64_t row0, std::int64_t n) const {
  require(row0 >= 0 && n >= 0 && row0 + n <= meta.length, meta.source, "timestamps of rows [", row0, ", ", row0 + n,
          ") outside [0, ", meta.length, ")");
  if (stamps.empty()) return {};
  return {stamps.begin() + row0, stamps.begin() + row0 + n};
}

TimeSeries read_csv(const std::string& path, const CsvOptions& opt) {
  require(opt.delimiter != '"' && opt.delimiter != '\n' && opt.delimiter != '\r', path,
          "the CSV delimiter cannot be a quote or a line break");
  std::string text = read_whole_file(path);
  require(!text.empty(), path, "CSV file is empty");
  const auto at = [&path](std::int64_t line) { return path + ":" + std::to_string(line); };

  // Spreadsheets often start a UTF-8 CSV with a byte-order mark; it is not part of the first column's name.
  const std::size_t bom = text.starts_with("\xEF\xBB\xBF") ? 3 : 0;
  const auto newlines = std::count(text.begin(), text.end(), '\n');

  CsvSplitter csv(path, text.data() + bom, text.data() + text.size(), opt.delimiter);
  std::vector<std::string_view> fields;
  std::int64_t line = 0;
  require(csv.next(fields, line), path, "CSV file is empty (no header row)");
  const std::int64_t header_line = line;
  std::vector<std::string> names;
  for (std::string_view f : fields) {
    names.emplace_back(trim(f));
    require(!names.back().empty(), at(header_line), "column ", names.size(), " of the header has no name");
    const auto first = std::find(names.begin(), names.end() - 1, names.back());
    require(first == names.end() - 1, at(header_line), "duplicate column name '", names.back(), "' (columns ",
            first - names.begin() + 1, " and ", names.size(), ")");
  }
  const auto column = [&](const std::string& name, const char* what) {
    const auto it = std::find(names.begin(), names.end(), name);
    require(it != names.end(), at(header_line), "unknown ", what, " '", name, "' (the header has: ", join(names), ")");
    return std::size_t(it - names.begin());
  };

  require(csv.next(fields, line), path, "no data rows (the file has only the header line)");

  // The timestamp column, then the value columns in the order asked for.
  std::optional<std::size_t> ts_col;
  const auto listed = [&opt](const std::string& name) {
    return std::find(opt.columns.begin(), opt.columns.end(), name) != opt.columns.end();
  };
  if (opt.timestamp_column == "auto") {
    double v = 0;
    const Cell first = parse_cell(fields[0], v);
    const bool looks_like_time = is_time_name(names[0]) || (first != Cell::number && first != Cell::missing);
    if (looks_like_time && !listed(names[0])) ts_col = 0;
  } else if (!opt.timestamp_column.empty()) {
    ts_col = column(opt.timestamp_column, "timestamp column");
  }
  std::vector<std::size_t> sel;
  if (opt.columns.empty()) {
    for (std::size_t c = 0; c < names.size(); ++c) {
      if (c != ts_col) sel.push_back(c);
    }
  } else {
    for (const std::string& name : opt.columns) {
      const std::size_t c = column(name, "column");
      require(c != ts_col, at(header_line), "column '", name, "' is both the timestamp and a value column");
      require(std::find(sel.begin(), sel.end(), c) == sel.end(), path, "column '", name, "' is selected twice");
      sel.push_back(c);
    }
  }
  require(!sel.empty(), at(header_line), "no value columns (column '", names[0],
          "' is read as the timestamp; set timestamp_column to \"\" if it holds values)");

  TimeSeries ts;
  ts.meta.source = path;
  ts.meta.has_timestamps = ts_col.has_value();
  for (std::size_t c : sel) ts.meta.channels.push_back(names[c]);
  const std::size_t n_ch = sel.size();
  const auto rows_hint = std::size_t(std::max<std::ptrdiff_t>(newlines, 1));
  ts.values.reserve(rows_hint * n_ch);
  ts.mask.reserve(rows_hint * n_ch);
  if (ts_col) ts.stamps.reserve(rows_hint);

  // The row loop tests and throws by hand: require() would build the "path:line" context for every row.
  const auto error = [&](auto&&... message) {
    return Error(at(line), detail::concat(std::forward<decltype(message)>(message)...));
  };
  double prev_time = 0;
  bool iso_stamps = false;
  std::int64_t prev_line = 0;
  do {
    if (fields.size() != names.size()) {
      if (fields.size() == 1 && trim(fields[0]).empty()) {
        throw error("blank line (only blank lines at the end of the file are ignored)");
      }
      throw error(fields.size(), fields.size() == 1 ? " field" : " fields", ", expected ", names.size(),
                  " (header has ", names.size(), " columns)");
    }
    if (ts_col) {
      const std::string_view stamp = trim(fields[*ts_col]);
      double t = 0;
      const Cell kind = parse_cell(stamp, t);
      if (kind == Cell::missing) throw error("missing timestamp in column '", names[*ts_col], "'");
      const std::optional<double> iso = kind == Cell::number ? std::nullopt : parse_iso8601(stamp);
      if (kind != Cell::number && !iso) {
        throw error("column '", names[*ts_col], "': '", stamp, "' is not a timestamp (expected YYYY-MM-DD, ",
                    "YYYY-MM-DD HH:MM[:SS], YYYY-MM-DDTHH:MM[:SS][Z] or a number)");
      }
      if (iso) t = *iso;
      if (!ts.stamps.empty()) {
        // Numbers and dates do not compare: a file uses one kind throughout.
        if (iso.has_value() != iso_stamps) {
          throw error("timestamp '", stamp, "' is ", iso ? "a date" : "a number", " but the one on line ", prev_line,
                      " ('", ts.stamps.back(), "') is not");
        }
        if (!(t > prev_time)) {
          throw error("timestamp '", stamp, "' is not after the previous one ('", ts.stamps.back(), "' on line ",
                      prev_line, ")");
        }
      }
      iso_stamps = iso.has_value();
      prev_time = t;
      prev_line = line;
      ts.stamps.emplace_back(stamp);
    }
    for (std::size_t k = 0; k < n_ch; ++k) {
      const std::string_view cell = fields[sel[k]];
      double v = 0;
      switch (parse_cell(cell, v)) {
        case Cell::number:
          ts.values.push_back(v);
          ts.mask.push_back(1);
          break;
        case Cell::missing:
          if (!opt.mask_missing) {
            throw error("missing value in column '", names[sel[k]], "' (set mask_missing to mask it)");
          }
          ts.values.push_back(std::nan(""));
          ts.mask.push_back(0);
          break;
        case Cell::infinite:
          throw error("column '", names[sel[k]], "': '", trim(cell), "' is infinite");
        case Cell::out_of_range:
          throw error("column '", names[sel[k]], "': '", trim(cell), "' is out of the range of a double");
        case Cell::invalid:
          throw error("column '", names[sel[k]], "': '", trim(cell), "' is not a number");
      }
    }
    ++ts.meta.length;
  } while (csv.next(fields, line));
  return ts;
}

Split chronological_split(std::int64_t n, double train_fraction, double test_fraction) {
  const std::string ctx = "chronological split";
  require(train_fraction > 0 && train_fraction < 1, ctx, "train fraction must be in (0, 1) (got ", train_fraction, ")");
  require(test_fraction > 0 && test_fraction < 1, ctx, "test fraction must be in (0, 1) (got ", test_fraction, ")");
  require(train_fraction + test_fraction <= 1, ctx, "train fraction ", train_fraction, " + test fraction ",
          test_fraction, " exceed 1");
  // int(n * fraction) on the double product, as the LTSF data loaders compute it, so the borders match theirs.
  const auto train = std::int64_t(std::floor(double(n) * train_fraction));
  const auto test = std::int64_t(std::floor(double(n) * test_fraction));
  require(train > 0 && test > 0, ctx, n, " rows leave ", train, " for training and ", test, " for testing");
  return {train, n - test, n};
}

ChannelStats train_stats(const SeriesSource& s, const Split& split) {
  const SeriesInfo& info = s.info();
  require(split.n == info.length && split.train_end > 0 && split.train_end <= split.val_end && split.val_end <= split.n,
          info.source, "split [0, ", split.train_end, ", ", split.val_end, ", ", split.n, ") does not fit a series of ",
          info.length, " rows");
  const std::size_t n_ch = info.channels.size();
  // Two passes (mean, then squared deviations) in bounded chunks: exact enough for 10^6 rows of large values and
  // works for a source streamed from disk.
  constexpr std::int64_t kChunk = 1 << 16;
  std::vector<double> v, sum(n_ch, 0.0), sq(n_ch, 0.0);
  std::vector<std::uint8_t> m;
  std::vector<std::int64_t> count(n_ch, 0);
  ChannelStats st;
  st.mean.assign(n_ch, 0.0);
  for (int pass = 0; pass < 2; ++pass) {
    for (std::int64_t r0 = 0; r0 < split.train_end; r0 += kChunk) {
      const std::int64_t n = std::min(kChunk, split.train_end - r0);
      v.resize(std::size_t(n) * n_ch);
      m.resize(v.size());
      s.read(r0, n, v.data(), m.data());
      for (std::size_t i = 0; i < v.size(); i += n_ch) {
        for (std::size_t c = 0; c < n_ch; ++c) {
          if (!m[i + c]) continue;
          if (pass == 0) {
            sum[c] += v[i + c];
            ++count[c];
          } else {
            sq[c] += (v[i + c] - st.mean[c]) * (v[i + c] - st.mean[c]);
          }
        }
      }
    }
    if (pass == 0) {
      for (std::size_t c = 0; c < n_ch; ++c) {
        require(count[c] > 0, info.source, "channel '", info.channels[c], "' has no observed value in the ",
                split.train_end, " training rows");
        st.mean[c] = sum[c] / double(count[c]);
      }
    }
  }
  // Population deviation (divide by the count), as scikit-learn's StandardScaler in the LTSF loaders.
  for (std::size_t c = 0; c < n_ch; ++c) {
    st.std.push_back(std::sqrt(sq[c] / double(count[c])));
    require(st.std[c] > 0, info.source, "channel '", info.channels[c],
            "' is constant over the training rows (standard deviation 0): it cannot be z-scored");
  }
  return st;
}

std::vector<std::int64_t> window_starts(std::int64_t begin, std::int64_t end, std::int64_t input,
                                        std::int64_t horizon) {
  require(input > 0 && horizon > 0, "window_starts", "input (", input, ") and horizon (", horizon,
          ") must be positive");
  require(begin >= 0 && begin <= end, "window_starts", "invalid range [", begin, ", ", end, ")");
  std::vector<std::int64_t> out;
  // Inputs cannot reach before row 0, so the first windows of a range that starts early are dropped.
  for (std::int64_t s = std::max<std::int64_t>(begin - input, 0); s + input + horizon <= end; ++s) out.push_back(s);
  return out;
}

Metrics naive_baseline(const SeriesSource& s, const Split& split, const ChannelStats& stats, std::int64_t input,
                       std::int64_t horizon, std::int64_t lag) {
  const SeriesInfo& info = s.info();
  const std::size_t n_ch = info.channels.size();
  require(split.n == info.length && split.val_end <= split.n, info.source, "split ends at ", split.n,
          " but the series has ", info.length, " rows");
  require(stats.mean.size() == n_ch && stats.std.size() == n_ch, info.source, "statistics for ", stats.mean.size(),
          " channels, the series has ", n_ch);
  require(lag >= 0 && lag <= input, info.source, "naive lag ", lag, " must be in [0, input window ", input,
          "]: the forecast may only repeat values of its input");
  const std::vector<std::int64_t> starts = window_starts(split.val_end, split.n, input, horizon);
  require(!starts.empty(), info.source, "no test window: the test part has ", split.n - split.val_end,
          " rows, horizon ", horizon, ", input ", input);

  // Every window reads from [first start, n): hold that stretch once.
  const std::int64_t r0 = starts.front();
  const std::int64_t rows = split.n - r0;
  std::vector<double> v(std::size_t(rows) * n_ch);
  std::vector<std::uint8_t> m(v.size());
  s.read(r0, rows, v.data(), m.data());
  // Masks become exactly 0/1 and masked values 0, so that multiplying by a mask drops a term exactly (NaN * 0 is
  // NaN); a multiply, unlike a branch, lets the compiler vectorise the loop over channels.
  for (std::size_t i = 0; i < v.size(); ++i) {
    m[i] = m[i] != 0;
    v[i] = m[i] ? v[i] : 0.0;
  }

  // Sums per channel in original units, so the inner loop runs over contiguous channels without divisions; the
  // z-scored error of channel c is the original one over std[c].
  std::vector<double> se(n_ch, 0.0), ae(n_ch, 0.0);
  std::vector<std::int64_t> cnt(n_ch, 0);
  for (const std::int64_t start : starts) {
    const std::int64_t t = start + input - 1 - r0;  // last input row, relative to r0
    for (std::int64_t h = 1; h <= horizon; ++h) {
      const std::int64_t src = lag == 0 ? t : t + h - lag * ((h + lag - 1) / lag);
      const double* y = v.data() + std::size_t(t + h) * n_ch;
      const double* y_hat = v.data() + std::size_t(src) * n_ch;
      const std::uint8_t* my = m.data() + std::size_t(t + h) * n_ch;
      const std::uint8_t* m_hat = m.data() + std::size_t(src) * n_ch;
      for (std::size_t c = 0; c < n_ch; ++c) {
        // A masked target is not scored, and neither is one whose naive source is masked: the naive method has no
        // forecast for it, and inventing one (zero, the mean) would score a different method.
        const std::uint8_t scored = my[c] & m_hat[c];
        const double d = (y[c] - y_hat[c]) * double(scored);
        se[c] += d * d;
        ae[c] += std::abs(d);
        cnt[c] += scored;
      }
    }
  }
  Metrics out;
  for (std::size_t c = 0; c < n_ch; ++c) {
    out.mse += se[c] / (stats.std[c] * stats.std[c]);
    out.mae += ae[c] / stats.std[c];
    out.mse_orig += se[c];
    out.mae_orig += ae[c];
    out.count += cnt[c];
  }
  require(out.count > 0, info.source, "no test target to score: every one (or its naive source) is masked");
  for (double* x : {&out.mse, &out.mae, &out.mse_orig, &out.mae_orig}) *x /= double(out.count);
  return out;
}

}  // namespace mm::io
