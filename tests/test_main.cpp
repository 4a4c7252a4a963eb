// One Catch2 main for the unit-test binaries: Kokkos first (it removes its own --kokkos-* flags from argv), then
// the Catch2 session in an inner scope so that every View dies before Kokkos finalizes. The unit tests need no MPI;
// the MPI tests have their own binaries run under mpiexec.
// With MM_TEST_BACKTRACE set, a segmentation fault also prints the native call stack (Catch2 reports the test
// case, then hands the signal back to this handler): for crashes seen only on a machine without a debugger.
#define CATCH_CONFIG_RUNNER
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>

#include <Kokkos_Core.hpp>

#include "catch.hpp"

namespace {
void print_backtrace(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  const char msg[] = "\nnative backtrace:\n";
  (void)!write(2, msg, sizeof(msg) - 1);
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}
}  // namespace

int main(int argc, char* argv[]) {
  if (std::getenv("MM_TEST_BACKTRACE") != nullptr) signal(SIGSEGV, print_backtrace);
  int result = 0;
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    result = Catch::Session().run(argc, argv);
  }
  return result;
}
