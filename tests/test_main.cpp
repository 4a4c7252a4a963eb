// One Catch2 main for every test binary: MPI first, then Kokkos (which strips its --kokkos-* flags from argv),
// then the Catch2 session in an inner scope so that every View dies before Kokkos finalizes.
#define CATCH_CONFIG_RUNNER
#include <mpi.h>

#include <Kokkos_Core.hpp>

#include "catch.hpp"

int main(int argc, char* argv[]) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int result = 0;
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    result = Catch::Session().run(argc, argv);
  }
  MPI_Finalize();
  return result;
}
