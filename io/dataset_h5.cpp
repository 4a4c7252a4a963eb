// HDF5 (serial C API, 1.10+) implementation of the preprocessed datasets; see dataset_h5.hpp for the layouts.
#include "io/dataset_h5.hpp"

#include <algorithm>
#include <array>
#include <iterator>
#include <memory>
#include <utility>

#include "core/error.hpp"
#include "io/h5util.hpp"
#include "io/tokens.hpp"

namespace mm::io {

using namespace h5;

namespace {

constexpr const char* kGenome = "genome";
constexpr const char* kSeries = "series";
constexpr const char* kInFile = "the file";  // where a missing attribute was looked for

// Chunks of about 256 KiB: gzip's window is 32 KiB, so larger chunks compress no better, while every random
// training window decompresses whole chunks (a 1 MiB chunk would cost more than the window itself).
constexpr hsize_t kTokenChunk = hsize_t(1) << 18;
constexpr hsize_t kSeriesChunkBytes = hsize_t(1) << 18;
constexpr hsize_t kSeriesMaxChunkRows = 4096;
constexpr unsigned kGzipLevel = 4;
// Per-dataset chunk cache of the readers: 64 chunks, so a stride-1 sliding window (hundreds of rows of hundreds of
// channels) finds the chunks of its predecessor instead of decompressing them again; HDF5's default is 1 MiB.
constexpr std::size_t kCacheBytes = std::size_t(16) << 20;
constexpr std::size_t kCacheSlots = 12421;  // prime, about 100 per cached chunk, as HDF5 advises
constexpr double kCacheW0 = 0.75;            // HDF5's default eviction preference for fully read chunks

// ------------------------------------------------------------------------------------------ writing

Hid link_props(const std::string& path) {
  Hid lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  h5_require(lcpl.valid() && H5Pset_create_intermediate_group(lcpl.get(), 1) >= 0, path,
             "cannot set up group creation");
  return lcpl;
}

// A dataset of shape `dims`, chunked along its first dimension by `chunk_rows` rows (fewer when it has fewer) and
// compressed by gzip after the byte shuffle, which groups the bytes of equal significance for gzip to find.
Hid create_chunked(hid_t file, const std::string& path, const std::string& name, hid_t type,
                   const std::vector<hsize_t>& dims, hsize_t chunk_rows) {
  // Unlimited rows: a chunk may not exceed a fixed dimension, and an empty split still needs a chunk of one row.
  std::vector<hsize_t> max_dims = dims, chunk = dims;
  max_dims[0] = H5S_UNLIMITED;
  chunk[0] = std::clamp<hsize_t>(dims[0], 1, chunk_rows);
  const Hid space(H5Screate_simple(int(dims.size()), dims.data(), max_dims.data()), H5Sclose);
  h5_require(space.valid(), path, "dataset '", name, "': cannot make a dataspace");
  const Hid dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  h5_require(dcpl.valid() && H5Pset_chunk(dcpl.get(), int(chunk.size()), chunk.data()) >= 0 &&
                 H5Pset_shuffle(dcpl.get()) >= 0 && H5Pset_deflate(dcpl.get(), kGzipLevel) >= 0,
             path, "dataset '", name, "': cannot set up chunking and compression");
  Hid ds(H5Dcreate2(file, name.c_str(), type, space.get(), link_props(path).get(), dcpl.get(), H5P_DEFAULT),
         H5Dclose);
  h5_require(ds.valid(), path, "cannot create dataset '", name, "'");
  return ds;
}

// A contiguous dataset of shape `dims`, for the small ones read whole.
Hid create_plain(hid_t file, const std::string& path, const std::string& name, hid_t type,
                 const std::vector<hsize_t>& dims) {
  const Hid space(H5Screate_simple(int(dims.size()), dims.data(), nullptr), H5Sclose);
  h5_require(space.valid(), path, "dataset '", name, "': cannot make a dataspace");
  Hid ds(H5Dcreate2(file, name.c_str(), type, space.get(), link_props(path).get(), H5P_DEFAULT, H5P_DEFAULT),
         H5Dclose);
  h5_require(ds.valid(), path, "cannot create dataset '", name, "'");
  return ds;
}

// The file and memory dataspaces of rows [row0, row0 + n) of `ds`, every column.
std::pair<Hid, Hid> select_rows(hid_t ds, const std::string& path, const std::string& name, hsize_t row0,
                                hsize_t n) {
  Hid file_space(H5Dget_space(ds), H5Sclose);
  const int rank = file_space.valid() ? H5Sget_simple_extent_ndims(file_space.get()) : -1;
  h5_require(rank >= 1, path, "cannot read the shape of dataset '", name, "'");
  std::vector<hsize_t> start(static_cast<std::size_t>(rank), 0), count(static_cast<std::size_t>(rank));
  h5_require(H5Sget_simple_extent_dims(file_space.get(), count.data(), nullptr) >= 0, path,
             "cannot read the shape of dataset '", name, "'");
  start[0] = row0;
  count[0] = n;
  const herr_t selected =
      H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr);
  h5_require(selected >= 0, path, "dataset '", name, "': cannot select rows [", row0, ", ", row0 + n, ")");
  Hid mem_space(H5Screate_simple(rank, count.data(), nullptr), H5Sclose);
  h5_require(mem_space.valid(), path, "dataset '", name, "': cannot make a dataspace");
  return {std::move(file_space), std::move(mem_space)};
}

// Rows [row0, row0 + n) of `ds`, every column, from `data` of memory type `type`.
void write_rows(hid_t ds, const std::string& path, const std::string& name, hid_t type, hsize_t row0, hsize_t n,
                const void* data) {
  if (n == 0) return;
  const auto [file_space, mem_space] = select_rows(ds, path, name, row0, n);
  h5_require(H5Dwrite(ds, type, mem_space.get(), file_space.get(), H5P_DEFAULT, data) >= 0, path,
             "cannot write rows [", row0, ", ", row0 + n, ") of dataset '", name, "'");
}

void read_rows(hid_t ds, const std::string& path, const std::string& name, hid_t type, hsize_t row0, hsize_t n,
               void* data) {
  if (n == 0) return;
  const auto [file_space, mem_space] = select_rows(ds, path, name, row0, n);
  h5_require(H5Dread(ds, type, mem_space.get(), file_space.get(), H5P_DEFAULT, data) >= 0, path,
             "cannot read rows [", row0, ", ", row0 + n, ") of dataset '", name, "'");
}

// A contiguous dataset of shape `dims` holding `data` (of memory type `mem_type`), for the small ones read whole.
void write_plain(hid_t file, const std::string& path, const std::string& name, hid_t file_type, hid_t mem_type,
                 const std::vector<hsize_t>& dims, const void* data) {
  const Hid ds = create_plain(file, path, name, file_type, dims);
  write_rows(ds.get(), path, name, mem_type, 0, dims[0], data);
}

// Rows [row0, row0 + strings.size()) of a variable-length string dataset; a NUL would silently cut a string short.
void write_strings(hid_t ds, const std::string& path, const std::string& name, hsize_t row0,
                   const std::vector<std::string>& strings) {
  std::vector<const char*> text;
  for (const std::string& s : strings) {
    require(s.find('\0') == std::string::npos, path, "dataset '", name, "': string ", row0 + text.size(),
            " contains a NUL");
    text.push_back(s.c_str());
  }
  const Hid type = string_type(H5T_CSET_UTF8);
  h5_require(type.valid(), path, "dataset '", name, "': cannot make a string type");
  write_rows(ds, path, name, type.get(), row0, text.size(), text.data());
}

void write_plain_strings(hid_t file, const std::string& path, const std::string& name,
                         const std::vector<std::string>& strings) {
  const Hid type = string_type(H5T_CSET_UTF8);
  h5_require(type.valid(), path, "dataset '", name, "': cannot make a string type");
  const Hid ds = create_plain(file, path, name, type.get(), {strings.size()});
  write_strings(ds.get(), path, name, 0, strings);
}

// Fills a 1-D chunked dataset front to back, one whole chunk per write, so that no compressed chunk is ever read
// back and written again.
class ChunkAppender {
 public:
  ChunkAppender(hid_t ds, std::string path, std::string name)
      : ds_(ds), path_(std::move(path)), name_(std::move(name)) {
    buf_.reserve(kTokenChunk);
  }
  void push(std::uint8_t v) {
    buf_.push_back(v);
    if (buf_.size() == kTokenChunk) flush();
  }
  void flush() {
    write_rows(ds_, path_, name_, H5T_NATIVE_UINT8, offset_, buf_.size(), buf_.data());
    offset_ += buf_.size();
    buf_.clear();
  }

 private:
  hid_t ds_;
  std::string path_, name_;
  std::vector<std::uint8_t> buf_;
  hsize_t offset_ = 0;
};

// ------------------------------------------------------------------------------------------ reading

// Opens a dataset file of `kind` ("genome" or "series") with the readers' chunk cache, after checking its kind and
// format.
Hid open_dataset_file(const std::string& path, const std::string& kind) {
  const QuietHdf5 quiet;
  const Hid fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  h5_require(fapl.valid() && H5Pset_cache(fapl.get(), 0, kCacheSlots, kCacheBytes, kCacheW0) >= 0,
             path, "cannot set up the chunk cache");
  Hid file = open_read_only(path, "dataset", fapl.get());
  require(H5Aexists(file.get(), kDatasetKindAttr) > 0, path, "not a mambamoe dataset: the root attribute '",
          kDatasetKindAttr, "' is missing");
  const std::string got = read_string_attr(file.get(), path, kDatasetKindAttr, kInFile);
  require(got == kind, path, "not a mambamoe ", kind, " dataset: the root attribute '", kDatasetKindAttr, "' is '",
          got, "'");
  const auto format = read_scalar_attr<std::int64_t>(file.get(), path, kDatasetFormatAttr, kInFile);
  require(format <= kDatasetFormat, path, "dataset format ", format, " (attribute '", kDatasetFormatAttr,
          "') is newer than this build reads (", kDatasetFormat, "): use a newer mambamoe");
  require(format >= 1, path, "invalid dataset format ", format, " in attribute '", kDatasetFormatAttr, "'");
  return file;
}

struct Dataset {
  Hid ds;
  std::vector<std::int64_t> shape;
};

// Dataset `name`, checked to be stored as `want` (a type_name) with `rank` dimensions.
Dataset open_dataset(hid_t file, const std::string& path, const std::string& name, const std::string& want,
                     int rank) {
  Dataset d{open_object(file, name, H5I_DATASET), {}};
  require(d.ds.valid(), path, "no dataset '", name, "' in the file");
  const Hid type(H5Dget_type(d.ds.get()), H5Tclose);
  h5_require(type.valid(), path, "cannot read the type of dataset '", name, "'");
  const std::string stored = type_name(type.get());
  require(stored == want, path, "dataset '", name, "' is stored as ", stored, ", expected ", want);
  d.shape = dataset_shape(d.ds.get(), path, name);
  require(int(d.shape.size()) == rank, path, "dataset '", name, "' has shape ", shape_str(d.shape), ", expected ",
          rank, " dimensions");
  return d;
}

std::vector<std::string> read_strings(hid_t ds, const std::string& path, const std::string& name, hsize_t row0,
                                      hsize_t n) {
  const Hid stored(H5Dget_type(ds), H5Tclose);
  // Read in the stored character set: HDF5 does not convert between ASCII and UTF-8.
  const Hid type = stored.valid() ? string_type(H5Tget_cset(stored.get())) : Hid();
  h5_require(type.valid(), path, "dataset '", name, "': cannot make a string type");
  const Hid space(H5Screate_simple(1, &n, nullptr), H5Sclose);
  h5_require(space.valid(), path, "dataset '", name, "': cannot make a dataspace");
  std::vector<char*> text(n, nullptr);
  // HDF5 allocates every string it reads; they go back however the copy below ends (null ones are skipped).
  const auto reclaim = [&](char** buf) {
#if H5_VERSION_GE(1, 12, 0)
    H5Treclaim(type.get(), space.get(), H5P_DEFAULT, buf);
#else
    H5Dvlen_reclaim(type.get(), space.get(), H5P_DEFAULT, buf);
#endif
  };
  const std::unique_ptr<char*, decltype(reclaim)> owned(text.data(), reclaim);
  read_rows(ds, path, name, type.get(), row0, n, text.data());
  std::vector<std::string> out;
  out.reserve(n);
  for (const char* s : text) out.emplace_back(s ? s : "");
  return out;
}

void require_rows(const std::string& path, const std::string& name, std::int64_t row0, std::int64_t n,
                  std::int64_t rows) {
  require(row0 >= 0 && n >= 0 && row0 <= rows && n <= rows - row0, path, "read of rows [", row0, ", ", row0 + n,
          ") outside [0, ", rows, ") of dataset '", name, "'");
}

}  // namespace

// ================================================================================================== genome

void write_genome_dataset(const std::string& path, const std::vector<FastaRecord>& records, double holdout_fraction,
                          const std::string& source) {
  require(holdout_fraction >= 0 && holdout_fraction < 1, path, "holdout_fraction must be in [0, 1) (got ",
          holdout_fraction, ")");
  // The split of GenomeDataset's FASTA constructor, record by record.
  std::vector<std::int64_t> n_train;
  std::array<std::int64_t, 2> total{0, 0};
  for (const FastaRecord& r : records) {
    const auto n = std::int64_t(r.seq.size());
    n_train.push_back(n - std::int64_t(double(n) * holdout_fraction));
    total[0] += n_train.back();
    total[1] += n - n_train.back();
  }

  const QuietHdf5 quiet;
  PendingFile out;
  out.create(path);
  const hid_t file = out.get();
  const std::array<std::string, 2> splits{"train", "heldout"};
  for (std::size_t s = 0; s < splits.size(); ++s) {
    const std::string group = "genome/" + splits[s];
    std::vector<std::int64_t> runs;  // rows [start, length, record]
    std::vector<std::int64_t> counts(kN - kA + 1, 0);
    {
      const Hid tokens =
          create_chunked(file, path, group + "/tokens", H5T_STD_U8LE, {hsize_t(total[s])}, kTokenChunk);
      ChunkAppender append(tokens.get(), path, group + "/tokens");
      std::int64_t pos = 0;
      for (std::size_t r = 0; r < records.size(); ++r) {
        const std::string& seq = records[r].seq;
        const std::size_t begin = s == 0 ? 0 : std::size_t(n_train[r]);
        const std::size_t end = s == 0 ? std::size_t(n_train[r]) : seq.size();
        if (end == begin) continue;  // no run, as MemoryTokenSource::runs() has none for it
        runs.insert(runs.end(), {pos, std::int64_t(end - begin), std::int64_t(r)});
        pos += std::int64_t(end - begin);
        for (std::size_t i = begin; i < end; ++i) {
          const std::int32_t t = base_to_token(seq[i]);
          ++counts[std::size_t(t - kA)];
          append.push(std::uint8_t(t));
        }
      }
      append.flush();
    }
    write_plain(file, path, group + "/runs", H5T_STD_I64LE, H5T_NATIVE_INT64, {runs.size() / 3, 3}, runs.data());
    write_attr(file, path, splits[s] + "_counts", H5T_NATIVE_INT64, counts.data(), {counts.size()});
  }

  std::vector<std::string> names;
  std::vector<std::int64_t> lengths;
  for (const FastaRecord& r : records) {
    names.push_back(r.name);
    lengths.push_back(std::int64_t(r.seq.size()));
  }
  write_plain_strings(file, path, "genome/records/name", names);
  write_plain(file, path, "genome/records/length", H5T_STD_I64LE, H5T_NATIVE_INT64, {lengths.size()},
              lengths.data());

  write_string_attr(file, path, kDatasetKindAttr, kGenome);
  write_attr(file, path, kDatasetFormatAttr, H5T_NATIVE_INT64, &kDatasetFormat);
  write_string_attr(file, path, "source", source);
  write_attr(file, path, "holdout_fraction", H5T_NATIVE_DOUBLE, &holdout_fraction);
  const auto n_records = std::int64_t(records.size());
  write_attr(file, path, "n_records", H5T_NATIVE_INT64, &n_records);
  out.commit();
}

struct H5TokenSource::Impl {
  std::string path, name;  // the file, and the tokens dataset in it
  Hid file, tokens;
  std::int64_t size = 0;
  std::vector<RecordRun> runs;
};

H5TokenSource::H5TokenSource(const std::string& path, const std::string& split) : impl_(std::make_unique<Impl>()) {
  require(split == "train" || split == "heldout", path, "no split '", split,
          "' in a genome dataset (train or heldout)");
  const QuietHdf5 quiet;
  Impl& s = *impl_;
  s.path = path;
  s.name = "genome/" + split + "/tokens";
  s.file = open_dataset_file(path, kGenome);
  const auto n_records = read_scalar_attr<std::int64_t>(s.file.get(), path, "n_records", kInFile);
  Dataset tokens = open_dataset(s.file.get(), path, s.name, "uint8", 1);
  s.tokens = std::move(tokens.ds);
  s.size = tokens.shape[0];

  const std::string runs_name = "genome/" + split + "/runs";
  const Dataset runs = open_dataset(s.file.get(), path, runs_name, "int64", 2);
  require(runs.shape[1] == 3, path, "dataset '", runs_name, "' has shape ", shape_str(runs.shape),
          ", expected [runs, 3]");
  std::vector<std::int64_t> rows(std::size_t(runs.shape[0] * 3));
  read_rows(runs.ds.get(), path, runs_name, H5T_NATIVE_INT64, 0, hsize_t(runs.shape[0]), rows.data());
  // read() relies on the runs tiling the tokens in order, each of a record the dataset has.
  std::int64_t end = 0;
  for (std::size_t i = 0; i < rows.size(); i += 3) {
    const RecordRun run{rows[i], rows[i + 1], std::int32_t(rows[i + 2])};
    require(run.start == end && run.length > 0 && rows[i + 2] >= 0 && rows[i + 2] < n_records, path, "dataset '",
            runs_name, "': run ", i / 3, " [", rows[i], ", ", rows[i + 1], ", ", rows[i + 2],
            "] does not continue the runs at ", end, " with a record below n_records = ", n_records);
    s.runs.push_back(run);
    end += run.length;
  }
  require(end == s.size, path, "dataset '", runs_name, "' covers ", end, " tokens, but '", s.name, "' holds ",
          s.size);
}

H5TokenSource::~H5TokenSource() = default;

std::int64_t H5TokenSource::size() const { return impl_->size; }

std::vector<RecordRun> H5TokenSource::runs() const { return impl_->runs; }

void H5TokenSource::read(std::int64_t start, std::int64_t n, std::int32_t* tokens, std::int32_t* records) const {
  const Impl& s = *impl_;
  require_rows(s.path, s.name, start, n, s.size);
  if (n == 0) return;
  const QuietHdf5 quiet;
  // HDF5 widens the stored bytes to int32 on the way.
  read_rows(s.tokens.get(), s.path, s.name, H5T_NATIVE_INT32, hsize_t(start), hsize_t(n), tokens);
  // The run holding `start` is the last one to begin at or before it.
  auto run = std::prev(std::upper_bound(s.runs.begin(), s.runs.end(), start,
                                        [](std::int64_t pos, const RecordRun& r) { return pos < r.start; }));
  for (std::int64_t i = start; i < start + n; ++run) {
    const std::int64_t stop = std::min(run->start + run->length, start + n);
    std::fill(records + (i - start), records + (stop - start), run->record);
    i = stop;
  }
}

GenomeDataset open_genome_dataset(const std::string& path) {
  auto train = std::make_shared<const H5TokenSource>(path, "train");
  auto heldout = std::make_shared<const H5TokenSource>(path, "heldout");
  const QuietHdf5 quiet;
  const Hid file = open_dataset_file(path, kGenome);
  const auto n_records = read_scalar_attr<std::int64_t>(file.get(), path, "n_records", kInFile);
  return GenomeDataset(std::move(train), std::move(heldout), n_records, path);
}

// ================================================================================================== time series

void write_series_dataset(const std::string& path, const SeriesSource& series, double train_fraction,
                          double test_fraction) {
  const SeriesInfo& info = series.info();
  const std::size_t channels = info.channels.size();
  require(channels > 0, path, "the series ", info.source, " has no channels");
  const Split split = chronological_split(info.length, train_fraction, test_fraction);
  const ChannelStats stats = train_stats(series, split);

  const QuietHdf5 quiet;
  PendingFile out;
  out.create(path);
  const hid_t file = out.get();
  {
    const auto rows = hsize_t(info.length);
    const hsize_t chunk_rows = std::clamp<hsize_t>(kSeriesChunkBytes / (sizeof(double) * channels), 1,
                                                   kSeriesMaxChunkRows);
    const Hid values = create_chunked(file, path, "series/values", H5T_IEEE_F64LE, {rows, channels}, chunk_rows);
    const Hid mask = create_chunked(file, path, "series/mask", H5T_STD_U8LE, {rows, channels}, chunk_rows);
    Hid stamps;
    if (info.has_timestamps) {
      const Hid type = string_type(H5T_CSET_UTF8);
      h5_require(type.valid(), path, "dataset 'series/timestamps': cannot make a string type");
      stamps = create_plain(file, path, "series/timestamps", type.get(), {rows});
    }
    // Whole chunks at a time, so that only one block of the series is ever in memory.
    std::vector<double> v;
    std::vector<std::uint8_t> m;
    for (hsize_t row0 = 0; row0 < rows; row0 += chunk_rows) {
      const hsize_t n = std::min(chunk_rows, rows - row0);
      v.resize(n * channels);
      m.resize(n * channels);
      series.read(std::int64_t(row0), std::int64_t(n), v.data(), m.data());
      write_rows(values.get(), path, "series/values", H5T_NATIVE_DOUBLE, row0, n, v.data());
      write_rows(mask.get(), path, "series/mask", H5T_NATIVE_UINT8, row0, n, m.data());
      if (stamps.valid()) {
        const std::vector<std::string> text = series.timestamps(std::int64_t(row0), std::int64_t(n));
        require(text.size() == n, path, "the series ", info.source, " gave ", text.size(), " timestamps for rows [",
                row0, ", ", row0 + n, ")");
        write_strings(stamps.get(), path, "series/timestamps", row0, text);
      }
    }
  }
  write_plain_strings(file, path, "series/channels", info.channels);
  write_plain(file, path, "series/train_mean", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, {channels}, stats.mean.data());
  write_plain(file, path, "series/train_std", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, {channels}, stats.std.data());

  write_string_attr(file, path, kDatasetKindAttr, kSeries);
  write_attr(file, path, kDatasetFormatAttr, H5T_NATIVE_INT64, &kDatasetFormat);
  write_string_attr(file, path, "source", info.source);
  write_attr(file, path, "train_end", H5T_NATIVE_INT64, &split.train_end);
  write_attr(file, path, "val_end", H5T_NATIVE_INT64, &split.val_end);
  out.commit();
}

struct H5SeriesSource::Impl {
  std::string path;
  SeriesInfo info;
  Hid file, values, mask, stamps;  // stamps: invalid when the series has no timestamps
};

H5SeriesSource::H5SeriesSource(const std::string& path) : impl_(std::make_unique<Impl>()) {
  const QuietHdf5 quiet;
  Impl& s = *impl_;
  s.path = path;
  s.file = open_dataset_file(path, kSeries);
  const Dataset channels = open_dataset(s.file.get(), path, "series/channels", "string", 1);
  s.info.channels = read_strings(channels.ds.get(), path, "series/channels", 0, hsize_t(channels.shape[0]));
  Dataset values = open_dataset(s.file.get(), path, "series/values", "float64", 2);
  require(values.shape[1] == channels.shape[0], path, "dataset 'series/values' has shape ", shape_str(values.shape),
          ", but 'series/channels' names ", channels.shape[0], " channels");
  Dataset mask = open_dataset(s.file.get(), path, "series/mask", "uint8", 2);
  require(mask.shape == values.shape, path, "dataset 'series/mask' has shape ", shape_str(mask.shape),
          ", but 'series/values' has ", shape_str(values.shape));
  s.values = std::move(values.ds);
  s.mask = std::move(mask.ds);
  s.info.source = path + ":/series/values";
  s.info.length = values.shape[0];
  if (link_exists(s.file.get(), "series/timestamps")) {
    Dataset stamps = open_dataset(s.file.get(), path, "series/timestamps", "string", 1);
    require(stamps.shape[0] == s.info.length, path, "dataset 'series/timestamps' has shape ",
            shape_str(stamps.shape), ", but 'series/values' has ", s.info.length, " rows");
    s.stamps = std::move(stamps.ds);
    s.info.has_timestamps = true;
  }
}

H5SeriesSource::~H5SeriesSource() = default;

const SeriesInfo& H5SeriesSource::info() const { return impl_->info; }

void H5SeriesSource::read(std::int64_t row0, std::int64_t n, double* values, std::uint8_t* mask) const {
  const Impl& s = *impl_;
  require_rows(s.path, "series/values", row0, n, s.info.length);
  const QuietHdf5 quiet;
  read_rows(s.values.get(), s.path, "series/values", H5T_NATIVE_DOUBLE, hsize_t(row0), hsize_t(n), values);
  read_rows(s.mask.get(), s.path, "series/mask", H5T_NATIVE_UINT8, hsize_t(row0), hsize_t(n), mask);
}

std::vector<std::string> H5SeriesSource::timestamps(std::int64_t row0, std::int64_t n) const {
  const Impl& s = *impl_;
  require_rows(s.path, "series/timestamps", row0, n, s.info.length);
  if (!s.stamps.valid()) return {};
  const QuietHdf5 quiet;
  return read_strings(s.stamps.get(), s.path, "series/timestamps", hsize_t(row0), hsize_t(n));
}

SeriesDatasetMeta read_series_meta(const std::string& path) {
  const QuietHdf5 quiet;
  const Hid file = open_dataset_file(path, kSeries);
  const Dataset values = open_dataset(file.get(), path, "series/values", "float64", 2);
  SeriesDatasetMeta meta;
  meta.split.n = values.shape[0];
  meta.split.train_end = read_scalar_attr<std::int64_t>(file.get(), path, "train_end", kInFile);
  meta.split.val_end = read_scalar_attr<std::int64_t>(file.get(), path, "val_end", kInFile);
  require(0 <= meta.split.train_end && meta.split.train_end <= meta.split.val_end &&
              meta.split.val_end <= meta.split.n,
          path, "attributes 'train_end' = ", meta.split.train_end, " and 'val_end' = ", meta.split.val_end,
          " do not split the ", meta.split.n, " rows of 'series/values'");
  const auto read_stat = [&](const std::string& name) {
    const Dataset d = open_dataset(file.get(), path, name, "float64", 1);
    require(d.shape[0] == values.shape[1], path, "dataset '", name, "' has shape ", shape_str(d.shape),
            ", but 'series/values' has ", values.shape[1], " channels");
    std::vector<double> stat(std::size_t(d.shape[0]));
    read_rows(d.ds.get(), path, name, H5T_NATIVE_DOUBLE, 0, stat.size(), stat.data());
    return stat;
  };
  meta.stats.mean = read_stat("series/train_mean");
  meta.stats.std = read_stat("series/train_std");
  return meta;
}

}  // namespace mm::io
