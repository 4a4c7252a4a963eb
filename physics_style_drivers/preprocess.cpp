// preprocess: turn a FASTA file (genome) or a CSV series into an HDF5 dataset that genomics_lm and
// timeseries_forecast stream windows from ([data] dataset = ...): tokenised or raw values, chunked and compressed,
// with the source, the split and the statistics recorded.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include "core/error.hpp"
#include "io/dataset_h5.hpp"
#include "io/fasta.hpp"
#include "io/timeseries.hpp"
#include "lm_options.hpp"
#include "registry.hpp"

namespace mm::drivers {

void declare_preprocess(io::Deck& d) {
  d.add<std::string>("preprocess.input", "", "FASTA (plain, gzip or bgzip) or CSV file, relative to the deck")
      .add<std::string>("preprocess.kind", "fasta", "fasta | csv")
      .add<std::string>("preprocess.output", "dataset.h5", "HDF5 dataset to write, under output_dir")
      .add<double>("preprocess.holdout_fraction", 0.1, "fasta: held-out tail of every record")
      .add<double>("preprocess.train_fraction", 0.7, "csv: chronological training part")
      .add<double>("preprocess.test_fraction", 0.2, "csv: chronological test part (validation is the rest)")
      .add<std::string>("preprocess.timestamp_column", "auto", "csv: auto | none | <column name>")
      .add<std::string>("preprocess.columns", "", "csv: value columns (spaces or commas; empty: all)")
      .add<bool>("preprocess.mask_missing", false, "csv: mask missing values instead of stopping with an error");
}

int run_preprocess(const io::Deck& d) {
  const std::string in = input_path(d, d.get<std::string>("preprocess.input"));
  const std::string kind = d.get<std::string>("preprocess.kind");
  require(!in.empty(), d.path() + " [preprocess] input", "no input file given");
  require(kind == "fasta" || kind == "csv", "[preprocess] kind", "'", kind, "' is not one of: fasta csv");
  std::filesystem::create_directories(d.get<std::string>("run.output_dir"));
  const std::string out = output_path(d, d.get<std::string>("preprocess.output"));
  if (kind == "fasta") {
    const auto recs = io::read_fasta(in);
    io::write_genome_dataset(out, recs, d.get<double>("preprocess.holdout_fraction"), in);
    std::int64_t bases = 0;
    for (const auto& r : recs) bases += std::int64_t(r.seq.size());
    std::printf("wrote %s: %zu record(s), %lld bases, held-out fraction %g\n", out.c_str(), recs.size(),
                (long long)bases, d.get<double>("preprocess.holdout_fraction"));
  } else {
    io::CsvOptions opt;
    const std::string ts = d.get<std::string>("preprocess.timestamp_column");
    opt.timestamp_column = ts == "none" ? "" : ts;
    std::string cols = d.get<std::string>("preprocess.columns");
    std::replace(cols.begin(), cols.end(), ',', ' ');
    std::istringstream is(cols);
    for (std::string w; is >> w;) opt.columns.push_back(w);
    opt.mask_missing = d.get<bool>("preprocess.mask_missing");
    const io::TimeSeries s = io::read_csv(in, opt);
    io::write_series_dataset(out, s, d.get<double>("preprocess.train_fraction"),
                             d.get<double>("preprocess.test_fraction"));
    std::printf("wrote %s: %lld steps x %zu channel(s)\n", out.c_str(), (long long)s.info().length,
                s.info().channels.size());
  }
  return 0;
}

}  // namespace mm::drivers
