// Deck sections shared by the drivers: [run], [model] (the backbone, plus the LM's head), [train], [checkpoint],
// and their translation into the model and trainer configurations.
#pragma once

#include "io/deck.hpp"
#include "model/lm.hpp"
#include "train/trainer.hpp"

namespace mm::drivers {

void declare_run(io::Deck& deck);              // [run]: driver, seed, deterministic, output_dir
void declare_backbone_options(io::Deck& deck);  // [model]: the Mamba-2 backbone
void declare_train_options(io::Deck& deck);     // [train] (model-independent keys) and [checkpoint]
void declare_lm_options(io::Deck& deck);        // the above plus the language-model keys

Mamba2Config make_mixer_config(const io::Deck& deck);
LMConfig make_lm_config(const io::Deck& deck);
TrainConfig make_train_config(const io::Deck& deck);

// Input paths in a deck are relative to the deck file's directory (so a deck and its data move together);
// output paths are relative to the working directory.
std::string input_path(const io::Deck& deck, const std::string& value);
std::string output_path(const io::Deck& deck, const std::string& value);  // under [run] output_dir

}  // namespace mm::drivers
