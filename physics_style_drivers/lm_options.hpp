// Deck sections shared by the drivers: [run], [model] (the backbone, plus the LM's head), [train], [checkpoint],
// and their translation into the model and trainer configurations.
#pragma once

#include "io/deck.hpp"
#include "model/lm.hpp"
#include "parallel/grid.hpp"
#include "parallel/planner.hpp"
#include "train/trainer.hpp"

namespace mm::drivers {

void declare_run(io::Deck& deck);              // [run]: driver, seed, deterministic, output_dir; [parallel]
// The process grid of the deck's [parallel] layout over MPI_COMM_WORLD (collective; throws on a bad layout).
// The run's process grid from [parallel] (created once per process: collective over MPI_COMM_WORLD).
std::shared_ptr<const parallel::ProcessGrid> make_process_grid(const io::Deck& deck);
// An mm::Error naming the layout unless tp = cp = ep = 1 (models and modes without tensor, context or expert
// parallelism).
void require_data_parallel_only(const io::Deck& deck, const std::string& what);
// [parallel] plan_gpus = N > 0: prints the planner's layout and memory for N GPUs (rank 0) and returns true: the
// driver then exits without reading data or training.
bool print_plan_only(const io::Deck& deck);
// The planner's plan for `gpus` ranks: layout = auto: its choice; manual: the deck's tp, cp, ep (dp the rest) with
// its micro-batch and recompute policy, and their memory estimate. Throws on a layout that does not fit the count.
parallel::Plan deck_plan(const io::Deck& deck, std::int64_t gpus);
// [model]: the backbone (Mamba-2 keys, the layer pattern, model.dense_d_ff), [mamba1], [mamba3], [moe]
void declare_backbone_options(io::Deck& deck);
void declare_train_options(io::Deck& deck);     // [train] (model-independent keys) and [checkpoint]
void declare_lm_options(io::Deck& deck);        // the above plus the language-model keys

Mamba2Config make_mixer_config(const io::Deck& deck);
LayerStackConfig make_layer_stack_config(const io::Deck& deck);  // model.pattern and the other kinds' configs
// model.n_layer, or the pattern's length when a pattern is given (a given n_layer must agree).
std::int64_t make_n_layer(const io::Deck& deck, const LayerStackConfig& layers);
LMConfig make_lm_config(const io::Deck& deck);
TrainConfig make_train_config(const io::Deck& deck);

// Input paths in a deck are relative to the deck file's directory (so a deck and its data move together);
// output paths are relative to the working directory.
std::string input_path(const io::Deck& deck, const std::string& value);
std::string output_path(const io::Deck& deck, const std::string& value);  // under [run] output_dir

}  // namespace mm::drivers
