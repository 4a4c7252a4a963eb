#include "registry.hpp"

#include <sstream>

#include "core/error.hpp"

namespace mm::drivers {

const std::vector<Driver>& all() {
  static const std::vector<Driver> drivers = {
      {"genomics_lm", "train a Mamba-2 DNA language model on a FASTA file and report held-out bits per base",
       declare_genomics_lm, run_genomics_lm},
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
