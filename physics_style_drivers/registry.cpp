#include "registry.hpp"

#include <sstream>

#include "core/error.hpp"

namespace mm::drivers {

const std::vector<Driver>& all() {
  static const std::vector<Driver> drivers = {
      {"genomics_lm", "train a Mamba-2 DNA language model on a FASTA file and report held-out bits per base",
       declare_genomics_lm, run_genomics_lm},
      {"timeseries_forecast",
       "train a Mamba-2 forecaster on a CSV/HDF5 series and report test MSE/MAE next to the naive baselines",
       declare_timeseries_forecast, run_timeseries_forecast},
      {"variant_effect",
       "score the variants of a VCF against a reference FASTA with a trained genomics_lm checkpoint",
       declare_variant_effect, run_variant_effect},
      {"lm_score", "per-base log-likelihood of a FASTA region under a trained genomics_lm checkpoint (streamed)",
       declare_lm_score, run_lm_score},
      {"lm_generate", "sample DNA after a prompt from a trained genomics_lm checkpoint (temperature/top-k/top-p)",
       declare_lm_generate, run_lm_generate},
      {"preprocess", "turn a FASTA or CSV file into an HDF5 dataset the training drivers stream from",
       declare_preprocess, run_preprocess},
  };
  return drivers;
}

const Driver& find(const std::string& name) {
  for (const auto& d : all())
    if (d.name == name) return d;
  std::ostringstream known;
  for (const auto& d : all()) known << " " << d.name;
  throw Error("[run] driver", "unknown driver '" + name + "'; known drivers:" + known.str());
}

}  // namespace mm::drivers
