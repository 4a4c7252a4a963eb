// One Catch2 main for the unit-test binaries: Kokkos first (it removes its own --kokkos-* flags from argv), then
// the Catch2 session in an inner scope so that every View dies before Kokkos finalizes. The unit tests need no MPI;
// the MPI tests have their own binaries run under mpiexec.
#define CATCH_CONFIG_RUNNER
#include <Kokkos_Core.hpp>

#include "catch.hpp"

int main(int argc, char* argv[]) {
  int result = 0;
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    result = Catch::Session().run(argc, argv);
  }
  return result;
}
