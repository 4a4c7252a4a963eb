// Preprocessed HDF5 datasets: a genome and a time series round-trip exactly (streamed reads equal the in-memory
// sources at any offset, chunk boundaries included, and so do the windows and batches drawn from them), the
// streamed datasets are chunked and compressed, files are published by rename, and errors name the file and the
// dataset or attribute.
#include <hdf5.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "catch.hpp"
#include "files.hpp"
#include "core/error.hpp"
#include "io/checkpoint.hpp"
#include "io/dataset_h5.hpp"
#include "io/genome_dataset.hpp"
#include "io/timeseries.hpp"
#include "io/tokens.hpp"

namespace fs = std::filesystem;
using mm::io::GenomeDataset;
using mm::io::H5SeriesSource;
using mm::io::H5TokenSource;
using mm::io::TimeSeries;

using mmtest::error_of;
using mmtest::TempDir;

namespace {

// What read_fasta makes of sequence text: upper case, U as T, every other letter N.
std::string normalise(std::string s) {
  for (char& c : s) {
    c = char(std::toupper(static_cast<unsigned char>(c)));
    if (c == 'U') c = 'T';
    if (c != 'A' && c != 'C' && c != 'G' && c != 'T') c = 'N';
  }
  return s;
}

// A random sequence with soft-masked (lower-case) stretches, IUPAC codes and N runs, as in real assemblies.
std::string random_sequence(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::string s(n, 'A');
  for (char& c : s) c = "ACGT"[gen() % 4];
  for (std::size_t i = n / 7; i < n / 7 + n / 20; ++i) s[i] = char(std::tolower(s[i]));
  for (std::size_t i = n / 3; i < n / 3 + 777 && i < n; ++i) s[i] = 'n';
  for (std::size_t i = 0; i < n; i += 4099) s[i] = "RYKMu"[i % 5];
  return normalise(s);
}

// Four records: two long ones (so that both splits span several token chunks), a short one and a single base
// (which has no held-out part).
std::vector<mm::io::FastaRecord> test_records() {
  return {{"chr1", "chromosome 1", random_sequence(600000, 1)},
          {"plasmid", "", normalise("acgtNNr")},
          {"tiny", "", "G"},
          {"chr2", "chromosome 2", random_sequence(520000, 2)}};
}

// Raw HDF5 access, for what the API does not show (attributes, creation properties) and to tamper with files.
// (No Catch2 assertion inside the constructor: with Catch2 v3, nvcc 13's front end never finishes such a file.)
struct RawFile {
  hid_t id;
  RawFile(const std::string& path, unsigned flags) : id(H5Fopen(path.c_str(), flags, H5P_DEFAULT)) {
    if (id < 0) throw std::runtime_error("H5Fopen failed: " + path);
  }
  ~RawFile() { H5Fclose(id); }
  RawFile(const RawFile&) = delete;
  RawFile& operator=(const RawFile&) = delete;
};

std::vector<std::int64_t> int64_attr(const std::string& path, const std::string& key) {
  const RawFile f(path, H5F_ACC_RDONLY);
  const hid_t a = H5Aopen(f.id, key.c_str(), H5P_DEFAULT);
  REQUIRE(a >= 0);
  const hid_t space = H5Aget_space(a);
  std::vector<std::int64_t> v(std::size_t(H5Sget_simple_extent_npoints(space)));
  CHECK(H5Aread(a, H5T_NATIVE_INT64, v.data()) >= 0);
  H5Sclose(space);
  H5Aclose(a);
  return v;
}

// Replaces root attribute `key` by a scalar int64 `value`.
void set_int64_attr(const std::string& path, const std::string& key, std::int64_t value) {
  const RawFile f(path, H5F_ACC_RDWR);
  REQUIRE(H5Adelete(f.id, key.c_str()) >= 0);
  const hid_t space = H5Screate(H5S_SCALAR);
  const hid_t a = H5Acreate2(f.id, key.c_str(), H5T_NATIVE_INT64, space, H5P_DEFAULT, H5P_DEFAULT);
  REQUIRE(H5Awrite(a, H5T_NATIVE_INT64, &value) >= 0);
  H5Aclose(a);
  H5Sclose(space);
}

// Replaces dataset `name` by an int64 one of shape `dims` holding `data`.
void replace_dataset(const std::string& path, const std::string& name, const std::vector<hsize_t>& dims,
                     const std::vector<std::int64_t>& data) {
  const RawFile f(path, H5F_ACC_RDWR);
  REQUIRE(H5Ldelete(f.id, name.c_str(), H5P_DEFAULT) >= 0);
  const hid_t space = H5Screate_simple(int(dims.size()), dims.data(), nullptr);
  const hid_t ds = H5Dcreate2(f.id, name.c_str(), H5T_NATIVE_INT64, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  REQUIRE(ds >= 0);
  REQUIRE(H5Dwrite(ds, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, data.data()) >= 0);
  H5Dclose(ds);
  H5Sclose(space);
}

// The chunk dimensions of dataset `name`, after checking that it is chunked and compressed by shuffle + gzip.
std::vector<hsize_t> chunked_gzip(const std::string& path, const std::string& name) {
  const RawFile f(path, H5F_ACC_RDONLY);
  const hid_t ds = H5Dopen2(f.id, name.c_str(), H5P_DEFAULT);
  REQUIRE(ds >= 0);
  const hid_t dcpl = H5Dget_create_plist(ds);
  CHECK(H5Pget_layout(dcpl) == H5D_CHUNKED);
  std::vector<H5Z_filter_t> filters;
  for (int i = 0; i < H5Pget_nfilters(dcpl); ++i) {
    unsigned flags = 0, config = 0;
    std::size_t n_values = 0;
    filters.push_back(H5Pget_filter2(dcpl, unsigned(i), &flags, &n_values, nullptr, 0, nullptr, &config));
  }
  CHECK(filters == std::vector<H5Z_filter_t>{H5Z_FILTER_SHUFFLE, H5Z_FILTER_DEFLATE});
  std::vector<hsize_t> chunk(8);
  const int rank = H5Pget_chunk(dcpl, int(chunk.size()), chunk.data());
  REQUIRE(rank > 0);
  chunk.resize(std::size_t(rank));
  H5Pclose(dcpl);
  H5Dclose(ds);
  return chunk;
}

struct Tokens {
  std::vector<std::int32_t> tokens, records;
  bool operator==(const Tokens&) const = default;
};

Tokens read_tokens(const mm::io::TokenSource& s, std::int64_t start, std::int64_t n) {
  Tokens t{std::vector<std::int32_t>(std::size_t(n), -7), std::vector<std::int32_t>(std::size_t(n), -7)};
  s.read(start, n, t.tokens.data(), t.records.data());
  return t;
}

bool same_runs(const std::vector<mm::io::RecordRun>& a, const std::vector<mm::io::RecordRun>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](const auto& x, const auto& y) {
    return x.start == y.start && x.length == y.length && x.record == y.record;
  });
}

bool same_batch(const mm::io::HostBatch& a, const mm::io::HostBatch& b) {
  return a.batch == b.batch && a.seqlen == b.seqlen && a.tokens == b.tokens && a.targets == b.targets &&
         a.seq_idx == b.seq_idx;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// A series of `rows` x 3 channels with masked (NaN) cells, a masked stretch, signed zeros and subnormals, and
// ISO 8601 timestamps unless `stamps` is false.
TimeSeries test_series(std::int64_t rows, bool stamps) {
  TimeSeries ts;
  ts.meta.source = "weather.csv";
  ts.meta.channels = {"temperature", "wind speed", "pressure (hPa)"};
  ts.meta.length = rows;
  ts.meta.has_timestamps = stamps;
  std::mt19937_64 gen(7);
  std::normal_distribution<double> normal;
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < 3; ++c) {
      const bool missing = (r * 3 + c) % 37 == 5 || (c == 1 && r >= 5000 && r < 5100);
      ts.values.push_back(missing ? std::numeric_limits<double>::quiet_NaN() : 10.0 * double(c) + normal(gen));
      ts.mask.push_back(missing ? 0 : 1);
    }
    if (stamps) {
      char text[32];
      std::snprintf(text, sizeof(text), "2016-07-%02d %02d:%02d:00", int(1 + r / 1440), int(r / 60 % 24),
                    int(r % 60));
      ts.stamps.push_back(text);
    }
  }
  ts.values[3] = -0.0;
  ts.values[4] = std::numeric_limits<double>::denorm_min();
  return ts;
}

struct Rows {
  std::vector<double> values;
  std::vector<std::uint8_t> mask;
};

Rows read_rows(const mm::io::SeriesSource& s, std::int64_t row0, std::int64_t n) {
  const std::size_t size = std::size_t(n) * s.info().channels.size();
  Rows r{std::vector<double>(size, 1.5), std::vector<std::uint8_t>(size, 7)};
  s.read(row0, n, r.values.data(), r.mask.data());
  return r;
}

// Fails in read() once writing has got to `fail_row` (statistics read only the training rows before that), and
// records whether the temporary file was there, and the published one not, while the rows were being written.
class WatchedSeries : public mm::io::SeriesSource {
 public:
  WatchedSeries(const TimeSeries& s, std::string path, std::int64_t fail_row)
      : s_(s), path_(std::move(path)), fail_row_(fail_row) {}
  const mm::io::SeriesInfo& info() const override { return s_.info(); }
  void read(std::int64_t row0, std::int64_t n, double* v, std::uint8_t* m) const override {
    if (fs::exists(path_ + ".tmp")) saw_tmp = true;
    if (fs::exists(path_)) saw_published = true;
    if (row0 >= fail_row_) throw mm::Error("watched series", "the disk is full");
    s_.read(row0, n, v, m);
  }
  std::vector<std::string> timestamps(std::int64_t row0, std::int64_t n) const override {
    return s_.timestamps(row0, n);
  }
  mutable bool saw_tmp = false, saw_published = false;

 private:
  const TimeSeries& s_;
  std::string path_;
  std::int64_t fail_row_;
};

}  // namespace

TEST_CASE("Genome dataset streams exactly the tokens, runs, windows and batches of the in-memory one", "[dataset]") {
  const TempDir tmp("genome");
  const std::string path = tmp.file("genome.h5");
  const auto records = test_records();
  const double holdout = 0.3;
  mm::io::write_genome_dataset(path, records, holdout, "data/genome.fa.gz");
  CHECK(tmp.entries() == std::vector<std::string>{"genome.h5"});

  const GenomeDataset mem(records, holdout, "data/genome.fa.gz");
  const GenomeDataset file = mm::io::open_genome_dataset(path);
  CHECK(file.n_records() == 4);

  for (const std::string split : {"train", "heldout"}) {
    INFO("split " << split);
    const mm::io::TokenSource& want = split == "train" ? mem.train() : mem.heldout();
    const H5TokenSource got(path, split);
    const std::int64_t n = want.size();
    REQUIRE(got.size() == n);
    CHECK(same_runs(got.runs(), want.runs()));
    CHECK(read_tokens(got, 0, n) == read_tokens(want, 0, n));

    // Pieces around every chunk and record boundary, and random ones, each read on its own.
    const auto chunk = std::int64_t(chunked_gzip(path, "genome/" + split + "/tokens").at(0));
    REQUIRE(chunk < n);  // the test genome spans several chunks
    std::vector<std::int64_t> edges;
    for (std::int64_t c = chunk; c < n; c += chunk) edges.push_back(c);
    for (const auto& run : want.runs()) edges.push_back(run.start);
    edges.push_back(n);
    std::vector<std::pair<std::int64_t, std::int64_t>> pieces;
    for (const std::int64_t e : edges) {
      for (const std::int64_t len : std::vector<std::int64_t>{0, 1, 2, 1000, chunk + 3}) {
        for (const std::int64_t back : {std::int64_t{0}, std::int64_t{1}, len / 2, len}) {
          const std::int64_t start = std::clamp<std::int64_t>(e - back, 0, n);
          pieces.emplace_back(start, std::min(len, n - start));
        }
      }
    }
    std::mt19937_64 gen(11);
    for (int i = 0; i < 40; ++i) {
      const auto start = std::int64_t(gen() % std::uint64_t(n));
      pieces.emplace_back(start, std::int64_t(gen() % std::uint64_t(n - start + 1)));
    }
    for (const auto& [start, len] : pieces) {
      INFO("tokens [" << start << ", " << start + len << ")");
      CHECK(read_tokens(got, start, len) == read_tokens(want, start, len));
    }
  }

  for (const std::int64_t seqlen : {1, 7, 1000, 70000}) {
    INFO("seqlen " << seqlen);
    const auto windows = file.heldout_windows(seqlen);
    const auto want = mem.heldout_windows(seqlen);
    REQUIRE(windows.size() == want.size());
    CHECK(std::equal(windows.begin(), windows.end(), want.begin(), want.end(),
                     [](const auto& a, const auto& b) { return a.start == b.start && a.length == b.length; }));
    for (std::size_t first = 0; first < windows.size(); first += std::max<std::size_t>(1, windows.size() / 5)) {
      CHECK(same_batch(file.heldout_batch(windows, first, 3, seqlen), mem.heldout_batch(want, first, 3, seqlen)));
    }
  }
  for (const std::uint64_t seed : {1u, 42u}) {
    for (const std::int64_t step : {0, 1, 999}) {
      for (const std::int64_t micro : {0, 3}) {
        INFO("seed " << seed << ", step " << step << ", micro " << micro);
        CHECK(same_batch(file.sample_train(seed, step, micro, 4, 512), mem.sample_train(seed, step, micro, 4, 512)));
      }
    }
  }

  // Provenance and statistics.
  std::vector<std::int64_t> train_counts(5, 0), heldout_counts(5, 0);
  for (const auto& [source, counts] : {std::pair{&mem.train(), &train_counts}, {&mem.heldout(), &heldout_counts}}) {
    const Tokens all = read_tokens(*source, 0, source->size());
    for (const std::int32_t t : all.tokens) ++(*counts)[std::size_t(t - mm::kA)];
  }
  CHECK(int64_attr(path, "train_counts") == train_counts);
  CHECK(int64_attr(path, "heldout_counts") == heldout_counts);
  CHECK(train_counts[4] > 0);  // IUPAC codes became N in both parts
  CHECK(heldout_counts[4] > 0);
  CHECK(int64_attr(path, "n_records") == std::vector<std::int64_t>{4});
  CHECK(int64_attr(path, mm::io::kDatasetFormatAttr) == std::vector<std::int64_t>{mm::io::kDatasetFormat});
}

TEST_CASE("Genome dataset keeps the record names and lengths and the provenance", "[dataset]") {
  const TempDir tmp("genome_meta");
  const std::string path = tmp.file("genome.h5");
  const auto records = test_records();
  mm::io::write_genome_dataset(path, records, 0.25, "data/genome.fa.gz");
  const RawFile f(path, H5F_ACC_RDONLY);

  const hid_t names = H5Dopen2(f.id, "genome/records/name", H5P_DEFAULT);
  REQUIRE(names >= 0);
  const hid_t type = H5Dget_type(names);
  std::vector<char*> text(records.size());
  REQUIRE(H5Dread(names, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, text.data()) >= 0);
  for (std::size_t r = 0; r < records.size(); ++r) {
    CHECK(std::string(text[r]) == records[r].name);
    H5free_memory(text[r]);
  }
  H5Tclose(type);
  H5Dclose(names);

  const hid_t lengths = H5Dopen2(f.id, "genome/records/length", H5P_DEFAULT);
  std::vector<std::int64_t> len(records.size());
  REQUIRE(H5Dread(lengths, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, len.data()) >= 0);
  H5Dclose(lengths);
  CHECK(len == std::vector<std::int64_t>{600000, 7, 1, 520000});

  const auto string_attr = [&](const char* key) {
    const hid_t a = H5Aopen(f.id, key, H5P_DEFAULT);
    const hid_t t = H5Aget_type(a);
    char* s = nullptr;
    CHECK(H5Aread(a, t, &s) >= 0);
    std::string out = s;
    H5free_memory(s);
    H5Tclose(t);
    H5Aclose(a);
    return out;
  };
  CHECK(string_attr(mm::io::kDatasetKindAttr) == "genome");
  CHECK(string_attr("source") == "data/genome.fa.gz");
  const hid_t a = H5Aopen(f.id, "holdout_fraction", H5P_DEFAULT);
  double fraction = 0;
  CHECK(H5Aread(a, H5T_NATIVE_DOUBLE, &fraction) >= 0);
  H5Aclose(a);
  CHECK(fraction == 0.25);
}

TEST_CASE("Genome and series datasets are chunked and gzip-compressed", "[dataset]") {
  const TempDir tmp("chunked");
  const std::string genome = tmp.file("genome.h5"), series = tmp.file("series.h5");
  mm::io::write_genome_dataset(genome, test_records(), 0.3, "genome.fa");
  for (const char* name : {"genome/train/tokens", "genome/heldout/tokens"}) {
    INFO(name);
    const auto chunk = chunked_gzip(genome, name);
    CHECK(chunk.size() == 1);
  }
  mm::io::write_series_dataset(series, test_series(10000, true), 0.7, 0.2);
  for (const char* name : {"series/values", "series/mask"}) {
    INFO(name);
    const auto chunk = chunked_gzip(series, name);
    CHECK(chunk.size() == 2);
    CHECK(chunk.at(1) == 3);
  }
  // Compression pays: one byte per base goes down to about two bits.
  CHECK(fs::file_size(genome) < 1120008 / 3);
}

TEST_CASE("Series dataset round-trips values, mask, timestamps, split and statistics", "[dataset]") {
  const TempDir tmp("series");
  const std::string path = tmp.file("series.h5");
  const std::int64_t rows = 10000;
  const TimeSeries ts = test_series(rows, true);
  mm::io::write_series_dataset(path, ts, 0.7, 0.2);
  CHECK(tmp.entries() == std::vector<std::string>{"series.h5"});

  const H5SeriesSource src(path);
  CHECK(src.info().channels == ts.meta.channels);
  CHECK(src.info().length == rows);
  CHECK(src.info().has_timestamps);
  CHECK_THAT(src.info().source, ContainsSubstring(path));

  const Rows all = read_rows(src, 0, rows);
  CHECK(same_bits(all.values, ts.values));  // NaN payloads, signed zeros and subnormals included
  CHECK(all.mask == ts.mask);
  CHECK(src.timestamps(0, rows) == ts.stamps);

  const mm::io::Split split = mm::io::chronological_split(rows, 0.7, 0.2);
  const mm::io::SeriesDatasetMeta meta = mm::io::read_series_meta(path);
  CHECK(meta.split.train_end == split.train_end);
  CHECK(meta.split.val_end == split.val_end);
  CHECK(meta.split.n == rows);
  const mm::io::ChannelStats stats = mm::io::train_stats(ts, split);
  CHECK(same_bits(meta.stats.mean, stats.mean));
  CHECK(same_bits(meta.stats.std, stats.std));
  // Statistics computed from the streamed source agree too.
  const mm::io::ChannelStats streamed = mm::io::train_stats(src, meta.split);
  CHECK(same_bits(streamed.mean, stats.mean));
  CHECK(same_bits(streamed.std, stats.std));

  SECTION("without timestamps") {
    const std::string plain = tmp.file("plain.h5");
    const TimeSeries no_stamps = test_series(rows, false);
    mm::io::write_series_dataset(plain, no_stamps, 0.7, 0.2);
    const H5SeriesSource p(plain);
    CHECK_FALSE(p.info().has_timestamps);
    CHECK(p.timestamps(0, 10).empty());
    CHECK(same_bits(read_rows(p, 0, rows).values, no_stamps.values));
    const RawFile f(plain, H5F_ACC_RDONLY);
    CHECK(H5Lexists(f.id, "series/timestamps", H5P_DEFAULT) == 0);
  }
}

TEST_CASE("Series dataset streams row ranges across chunk boundaries", "[dataset]") {
  const TempDir tmp("series_rows");
  const std::string path = tmp.file("series.h5");
  const std::int64_t rows = 10000;
  const TimeSeries ts = test_series(rows, true);
  mm::io::write_series_dataset(path, ts, 0.6, 0.3);
  const H5SeriesSource src(path);
  const auto chunk = std::int64_t(chunked_gzip(path, "series/values").at(0));
  REQUIRE(chunk < rows / 2);

  std::vector<std::pair<std::int64_t, std::int64_t>> ranges = {{0, 0}, {0, 1}, {rows - 1, 1}, {rows, 0}};
  for (std::int64_t c = chunk; c < rows; c += chunk) {
    for (const std::int64_t len : {std::int64_t{1}, std::int64_t{2}, std::int64_t{96}, chunk + 1}) {
      const std::int64_t start = std::max<std::int64_t>(0, c - len / 2);
      ranges.emplace_back(start, std::min(len, rows - start));
    }
  }
  for (std::int64_t start = 0; start + 816 <= rows; start += 997) ranges.emplace_back(start, 816);  // sliding windows
  for (const auto& [row0, n] : ranges) {
    INFO("rows [" << row0 << ", " << row0 + n << ")");
    const Rows got = read_rows(src, row0, n);
    const Rows want = read_rows(ts, row0, n);
    CHECK(same_bits(got.values, want.values));
    CHECK(got.mask == want.mask);
    CHECK(src.timestamps(row0, n) == ts.timestamps(row0, n));
  }
}

TEST_CASE("Dataset writers publish the file only when it is complete, by rename", "[dataset]") {
  const TempDir tmp("publish");
  const std::string path = tmp.file("series.h5"), partial = path + ".tmp";
  const TimeSeries first = test_series(10000, true);
  TimeSeries second = test_series(10000, false);
  second.values[0] = 123.0;

  // A stale temporary file from a crashed run is simply replaced.
  std::ofstream(partial) << "left over by a crash";
  const WatchedSeries watched(first, path, 10000);
  mm::io::write_series_dataset(path, watched, 0.7, 0.2);
  CHECK(watched.saw_tmp);
  CHECK_FALSE(watched.saw_published);
  CHECK(tmp.entries() == std::vector<std::string>{"series.h5"});
  CHECK(read_rows(H5SeriesSource(path), 0, 1).values[0] == first.values[0]);

  // A failure half-way through the rows leaves the published file intact and no temporary file.
  const WatchedSeries failing(second, path, 8000);
  CHECK_THAT(error_of([&] { mm::io::write_series_dataset(path, failing, 0.7, 0.2); }),
             ContainsSubstring("the disk is full"));
  CHECK(failing.saw_tmp);
  CHECK(tmp.entries() == std::vector<std::string>{"series.h5"});
  CHECK(read_rows(H5SeriesSource(path), 0, 1).values[0] == first.values[0]);
  CHECK(H5SeriesSource(path).info().has_timestamps);

  // A complete write replaces it.
  mm::io::write_series_dataset(path, second, 0.7, 0.2);
  CHECK(read_rows(H5SeriesSource(path), 0, 1).values[0] == 123.0);
  CHECK_FALSE(H5SeriesSource(path).info().has_timestamps);

  // The genome writer publishes the same way.
  const std::string genome = tmp.file("genome.h5");
  std::ofstream(genome + ".tmp") << "left over by a crash";
  mm::io::write_genome_dataset(genome, test_records(), 0.3, "genome.fa");
  mm::io::write_genome_dataset(genome, {{"one", "", "ACGTACGTAC"}}, 0.5, "one.fa");
  CHECK(tmp.entries() == std::vector<std::string>{"genome.h5", "series.h5"});
  CHECK(mm::io::open_genome_dataset(genome).n_records() == 1);
  CHECK(H5TokenSource(genome, "heldout").size() == 5);
}

TEST_CASE("Dataset errors name the file and the dataset or attribute", "[dataset]") {
  const TempDir tmp("errors");
  const auto open_ids = [] { return H5Fget_obj_count(H5F_OBJ_ALL, H5F_OBJ_ALL); };
  const ssize_t before = open_ids();
  REQUIRE(before >= 0);

  const std::string genome = tmp.file("genome.h5"), series = tmp.file("series.h5");
  const std::vector<mm::io::FastaRecord> records = {{"a", "", "ACGTNACGTA"}, {"b", "", "GGGCCCAAATTT"}};
  mm::io::write_genome_dataset(genome, records, 0.5, "ab.fa");
  mm::io::write_series_dataset(series, test_series(1000, true), 0.7, 0.2);

  SECTION("missing, foreign, truncated, other kinds and newer formats") {
    const std::string missing = tmp.file("missing.h5");
    for (const auto& open : std::vector<std::function<void(const std::string&)>>{
             [](const std::string& p) { H5TokenSource(p, "train"); },
             [](const std::string& p) { mm::io::open_genome_dataset(p); },
             [](const std::string& p) { H5SeriesSource{p}; },
             [](const std::string& p) { mm::io::read_series_meta(p); }}) {
      CHECK_THAT(error_of([&] { open(missing); }), ContainsSubstring(missing) && ContainsSubstring("no such"));
    }

    const std::string text = tmp.file("notes.h5");
    std::ofstream(text) << "this is not HDF5\n";
    CHECK_THAT(error_of([&] { H5SeriesSource{text}; }), ContainsSubstring(text) && ContainsSubstring("not an HDF5"));

    const std::string truncated = tmp.file("truncated.h5");
    fs::copy_file(genome, truncated);
    fs::resize_file(truncated, fs::file_size(truncated) / 2);
    CHECK_THAT(error_of([&] { H5TokenSource(truncated, "train"); }),
               ContainsSubstring(truncated) && ContainsSubstring("truncated"));

    const std::string checkpoint = tmp.file("ckpt.h5");
    {
      mm::io::CheckpointWriter w(checkpoint);
      w.commit();
    }
    CHECK_THAT(error_of([&] { mm::io::open_genome_dataset(checkpoint); }),
               ContainsSubstring(checkpoint) && ContainsSubstring("not a mambamoe dataset") &&
                   ContainsSubstring(mm::io::kDatasetKindAttr));

    CHECK_THAT(error_of([&] { H5TokenSource(series, "train"); }),
               ContainsSubstring(series) && ContainsSubstring("not a mambamoe genome dataset") &&
                   ContainsSubstring("'series'"));
    CHECK_THAT(error_of([&] { H5SeriesSource{genome}; }),
               ContainsSubstring(genome) && ContainsSubstring("not a mambamoe series dataset"));
    CHECK_THAT(error_of([&] { mm::io::read_series_meta(genome); }), ContainsSubstring("'genome'"));

    const std::string newer = tmp.file("newer.h5");
    fs::copy_file(genome, newer);
    set_int64_attr(newer, mm::io::kDatasetFormatAttr, mm::io::kDatasetFormat + 1);
    CHECK_THAT(error_of([&] { mm::io::open_genome_dataset(newer); }),
               ContainsSubstring(newer) && ContainsSubstring("newer") && ContainsSubstring(mm::io::kDatasetFormatAttr));
  }

  SECTION("reads out of range") {
    const H5TokenSource train(genome, "train");
    std::vector<std::int32_t> t(16), r(16);
    CHECK(train.size() == 11);
    const std::vector<std::pair<std::int64_t, std::int64_t>> bad = {{10, 2}, {-1, 1}, {0, -1}, {12, 0}};
    for (const auto& [start, n] : bad) {
      CHECK_THAT(error_of([&] { train.read(start, n, t.data(), r.data()); }),
                 ContainsSubstring(genome) && ContainsSubstring("'genome/train/tokens'") &&
                     ContainsSubstring("outside"));
    }
    CHECK_THAT(error_of([&] { H5TokenSource(genome, "test"); }),
               ContainsSubstring(genome) && ContainsSubstring("'test'"));

    const H5SeriesSource src(series);
    std::vector<double> v(3 * 16);
    std::vector<std::uint8_t> m(v.size());
    CHECK_THAT(error_of([&] { src.read(999, 2, v.data(), m.data()); }),
               ContainsSubstring(series) && ContainsSubstring("'series/values'") && ContainsSubstring("[999, 1001)"));
    CHECK_THAT(error_of([&] { src.timestamps(-1, 2); }),
               ContainsSubstring(series) && ContainsSubstring("'series/timestamps'"));
  }

  SECTION("shape mismatches and inconsistent contents") {
    // Runs that do not cover the tokens.
    replace_dataset(genome, "genome/heldout/runs", {1, 3}, {0, 4, 1});
    CHECK_THAT(error_of([&] { mm::io::open_genome_dataset(genome); }),
               ContainsSubstring(genome) && ContainsSubstring("'genome/heldout/runs'") &&
                   ContainsSubstring("covers 4"));
    replace_dataset(genome, "genome/heldout/runs", {2, 2}, {0, 5, 5, 6});
    CHECK_THAT(error_of([&] { H5TokenSource(genome, "heldout"); }),
               ContainsSubstring("'genome/heldout/runs'") && ContainsSubstring("[2, 2]"));
    replace_dataset(genome, "genome/heldout/runs", {2, 3}, {0, 5, 0, 5, 6, 2});
    CHECK_THAT(error_of([&] { H5TokenSource(genome, "heldout"); }),
               ContainsSubstring("'genome/heldout/runs'") && ContainsSubstring("n_records = 2"));
    // Tokens of another type.
    replace_dataset(genome, "genome/train/tokens", {11}, std::vector<std::int64_t>(11, 1));
    CHECK_THAT(error_of([&] { H5TokenSource(genome, "train"); }),
               ContainsSubstring("'genome/train/tokens'") && ContainsSubstring("int64") && ContainsSubstring("uint8"));

    const std::string mask = tmp.file("mask.h5");
    fs::copy_file(series, mask);
    replace_dataset(mask, "series/mask", {1000, 4}, std::vector<std::int64_t>(4000, 1));
    CHECK_THAT(error_of([&] { H5SeriesSource{mask}; }), ContainsSubstring(mask) && ContainsSubstring("'series/mask'"));

    const std::string values = tmp.file("values.h5");
    fs::copy_file(series, values);
    {
      const RawFile f(values, H5F_ACC_RDWR);
      REQUIRE(H5Ldelete(f.id, "series/values", H5P_DEFAULT) >= 0);
      const hsize_t dims[2] = {1000, 2};
      const hid_t space = H5Screate_simple(2, dims, nullptr);
      const hid_t ds = H5Dcreate2(f.id, "series/values", H5T_NATIVE_DOUBLE, space, H5P_DEFAULT, H5P_DEFAULT,
                                  H5P_DEFAULT);
      H5Dclose(ds);
      H5Sclose(space);
    }
    CHECK_THAT(error_of([&] { H5SeriesSource{values}; }),
               ContainsSubstring(values) && ContainsSubstring("'series/values'") && ContainsSubstring("[1000, 2]") &&
                   ContainsSubstring("3 channels"));
    CHECK_THAT(error_of([&] { mm::io::read_series_meta(values); }),
               ContainsSubstring("'series/train_mean'") && ContainsSubstring("2 channels"));

    const std::string stamps = tmp.file("stamps.h5");
    fs::copy_file(series, stamps);
    replace_dataset(stamps, "series/timestamps", {1000}, std::vector<std::int64_t>(1000, 0));
    CHECK_THAT(error_of([&] { H5SeriesSource{stamps}; }),
               ContainsSubstring("'series/timestamps'") && ContainsSubstring("int64") && ContainsSubstring("string"));

    const std::string split = tmp.file("split.h5");
    fs::copy_file(series, split);
    set_int64_attr(split, "val_end", 1001);
    CHECK_THAT(error_of([&] { mm::io::read_series_meta(split); }),
               ContainsSubstring(split) && ContainsSubstring("'val_end'"));
    const RawFile f(split, H5F_ACC_RDWR);
    REQUIRE(H5Adelete(f.id, "train_end") >= 0);
    CHECK_THAT(error_of([&] { mm::io::read_series_meta(split); }), ContainsSubstring("'train_end'"));
  }

  SECTION("bad writes") {
    const std::string out = tmp.file("out.h5");
    CHECK_THAT(error_of([&] { mm::io::write_genome_dataset(out, records, 1.0, "ab.fa"); }),
               ContainsSubstring(out) && ContainsSubstring("holdout_fraction"));
    const std::string nowhere = tmp.file("no/such/dir/out.h5");
    CHECK_THAT(error_of([&] { mm::io::write_genome_dataset(nowhere, records, 0.5, "ab.fa"); }),
               ContainsSubstring(nowhere));
    CHECK_THAT(error_of([&] { mm::io::write_series_dataset(nowhere, test_series(100, true), 0.7, 0.2); }),
               ContainsSubstring(nowhere));
    CHECK_THAT(error_of([&] { mm::io::write_series_dataset(out, test_series(100, true), 0.9, 0.2); }),
               ContainsSubstring("fraction"));
    TimeSeries no_channels;
    no_channels.meta.source = "empty.csv";
    CHECK_THAT(error_of([&] { mm::io::write_series_dataset(out, no_channels, 0.7, 0.2); }),
               ContainsSubstring(out) && ContainsSubstring("no channels"));
    CHECK(tmp.entries() == std::vector<std::string>{"genome.h5", "series.h5"});
  }

  CHECK(open_ids() == before);
}
