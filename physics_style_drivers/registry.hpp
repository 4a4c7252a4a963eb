// Drivers ("physics-style" problem setups) are selected by name from the deck's [run] driver key. Each declares its
// own deck options and runs one workload; an unknown name is an error that lists the known ones.
#pragma once

#include <string>
#include <vector>

#include "io/deck.hpp"

namespace mm::drivers {

struct Driver {
  std::string name;
  std::string summary;
  void (*declare)(io::Deck&);
  int (*run)(const io::Deck&);
};

const std::vector<Driver>& all();
const Driver& find(const std::string& name);  // throws mm::Error listing the known drivers

void declare_genomics_lm(io::Deck& deck);
int run_genomics_lm(const io::Deck& deck);
void declare_timeseries_forecast(io::Deck& deck);
int run_timeseries_forecast(const io::Deck& deck);
void declare_variant_effect(io::Deck& deck);
int run_variant_effect(const io::Deck& deck);
void declare_lm_score(io::Deck& deck);
int run_lm_score(const io::Deck& deck);
void declare_lm_generate(io::Deck& deck);
int run_lm_generate(const io::Deck& deck);
void declare_preprocess(io::Deck& deck);
int run_preprocess(const io::Deck& deck);

}  // namespace mm::drivers
