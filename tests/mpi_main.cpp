// The Catch2 main of the MPI test binary (mpi_tests), run by ctest under mpiexec at 1, 2 and 4 ranks: MPI first,
// then Kokkos, then the Catch2 session. Every rank runs every test case (the cases make their collective calls
// unconditionally, so one rank's failed check never leaves the others waiting); rank 0 reports in full, the other
// ranks only their failures. The exit status is that of the worst rank.
#define CATCH_CONFIG_RUNNER
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <cstdio>
#include <vector>

#include "catch.hpp"

int main(int argc, char* argv[]) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int result = 0;
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    std::vector<char*> args(argv, argv + argc);
    char quiet[] = "--reporter=compact";
    if (rank != 0) args.push_back(quiet);
    result = Catch::Session().run(int(args.size()), args.data());
  }
  int worst = 0;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && worst != 0 && result == 0) std::fprintf(stderr, "a rank other than 0 failed (see its output)\n");
  MPI_Finalize();
  return worst;
}
