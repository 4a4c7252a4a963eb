// mambamoe: one executable, one driver per workload, selected by the deck's [run] driver.
//
//   mambamoe <deck.in> [--section.key=value ...]     run the deck's driver
//   mambamoe <deck.in> --print-deck                  print the effective deck and exit
//   mambamoe --help [deck.in] | --version | --list-drivers
//
// Start-up order: MPI, then Kokkos (which removes its own --kokkos-* flags from argv), then the deck.
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/error.hpp"
#include "tensor/gemm.hpp"
#include "lm_options.hpp"
#include "registry.hpp"

namespace {

void usage() {
  std::printf(
      "usage: mambamoe <deck.in> [--section.key=value ...] [--print-deck]\n"
      "       mambamoe --help [deck.in] | --version | --list-drivers\n"
      "Kokkos options (--kokkos-num-threads=N, ...) are accepted too.\n");
}

int run(int argc, char** argv, int rank) {
  std::string deck_path;
  std::vector<std::string> overrides;
  bool help = false, print_deck = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") help = true;
    else if (a == "--version") {
      if (rank == 0) std::printf("mambamoe %s (%s)\n", mm::kVersion, mm::kGitHash);
      return 0;
    } else if (a == "--list-drivers") {
      if (rank == 0)
        for (const auto& d : mm::drivers::all()) std::printf("%-20s %s\n", d.name.c_str(), d.summary.c_str());
      return 0;
    } else if (a == "--print-deck") print_deck = true;
    else if (a.rfind("--", 0) == 0 && a.find('.') != std::string::npos && a.find('=') != std::string::npos)
      overrides.push_back(a);
    else if (a.rfind("-", 0) != 0 && deck_path.empty()) deck_path = a;
    else throw mm::Error("command line", "unrecognised argument '" + a + "' (see mambamoe --help)");
  }
  if (deck_path.empty() && !help) {
    if (rank == 0) usage();
    throw mm::Error("command line", "no deck file given");
  }
  const mm::drivers::Driver& driver = mm::drivers::find(mm::io::peek(deck_path, overrides, "run.driver", "genomics_lm"));
  mm::io::Deck deck;
  mm::drivers::declare_run(deck);
  driver.declare(deck);
  if (help) {
    if (rank == 0) {
      usage();
      std::printf("\noptions of driver %s (deck sections and keys, default, meaning):\n%s", driver.name.c_str(),
                  deck.help().c_str());
    }
    return 0;
  }
  deck.parse(deck_path, overrides);
  if (rank == 0) {
    std::printf("mambamoe %s (%s) | Kokkos %s, %d thread(s) | driver %s | deck %s\n", mm::kVersion, mm::kGitHash,
                Kokkos::DefaultExecutionSpace::name(), Kokkos::DefaultExecutionSpace().concurrency(),
                driver.name.c_str(), deck_path.c_str());
    std::printf("---- effective deck ----\n%s------------------------\n", deck.effective().c_str());
    std::fflush(stdout);
  }
  if (print_deck) return 0;
  mm::set_float_gemm_compute(
      mm::parse_gemm_compute(deck.get<std::string>("run.gemm_precision"), deck_path + " [run] gemm_precision"));
  if (deck.get<std::int64_t>("parallel.plan_gpus") > 0) {  // a dry run of the planner: no grid, data or training
    mm::require(driver.name == "genomics_lm", "[parallel] plan_gpus", "the planner models the genomics_lm driver's "
                "language model; driver ", driver.name, " has no plan");
    return driver.run(deck);
  }
  const auto grid = mm::drivers::make_process_grid(deck);  // validates [parallel] against the MPI ranks
  mm::require(grid->world_size() == 1 || driver.name == "genomics_lm", "[parallel]", "driver ", driver.name,
              " runs on one rank (got ", grid->world_size(), "); parallel layouts are implemented for genomics_lm");
  return driver.run(deck);
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  // Rank 0 alone prints progress; the others keep stderr for errors.
  if (rank != 0 && !std::freopen("/dev/null", "w", stdout)) std::fprintf(stderr, "rank %d: cannot silence stdout\n", rank);
  int rc = 0;
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    try {
      rc = run(argc, argv, rank);
    } catch (const mm::Error& e) {
      std::fprintf(stderr, "mambamoe: error: %s\n", e.what());
      rc = 2;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "mambamoe: internal error: %s\n", e.what());
      rc = 3;
    }
  }
  // An error on some ranks only would leave the others waiting in a collective: take the whole job down.
  if (rc != 0 && size > 1) MPI_Abort(MPI_COMM_WORLD, rc);
  MPI_Finalize();
  return rc;
}
