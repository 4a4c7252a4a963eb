// One Catch2 main for the unit-test binaries: Kokkos first (it removes its own --kokkos-* flags from argv), then
// the Catch2 session in an inner scope so that every View dies before Kokkos finalizes. The unit tests need no MPI;
// the MPI tests have their own binaries run under mpiexec.
// With MM_TEST_BACKTRACE set, a segmentation fault also prints where it happened (Catch2 reports the test case,
// then hands the signal back to this handler): for crashes seen only on a machine without a debugger.
#define CATCH_CONFIG_RUNNER
#include <execinfo.h>
#include <signal.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <Kokkos_Core.hpp>

#include "catch.hpp"

namespace {
// The faulting instruction and the address it touched (from the signal's context, which backtrace() cannot unwind
// past on Catch2's alternate signal stack), the mapping that holds the instruction (for addr2line: offset =
// pc - start + file offset), then whatever backtrace() finds.
void print_fault(int sig, siginfo_t* info, void* ctx) {
  char buf[256];
  const auto pc = static_cast<unsigned long>(static_cast<ucontext_t*>(ctx)->uc_mcontext.gregs[REG_RIP]);
  int n = std::snprintf(buf, sizeof buf, "\nfault: signal %d at pc 0x%lx touching 0x%lx\n", sig, pc,
                        reinterpret_cast<unsigned long>(info->si_addr));
  (void)!write(2, buf, std::size_t(n));
  if (FILE* maps = std::fopen("/proc/self/maps", "r")) {
    char line[512];
    while (std::fgets(line, sizeof line, maps) != nullptr) {
      unsigned long lo = 0, hi = 0;
      if (std::sscanf(line, "%lx-%lx", &lo, &hi) == 2 && pc >= lo && pc < hi) (void)!write(2, line, std::strlen(line));
    }
    std::fclose(maps);
  }
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), 2);
  signal(sig, SIG_DFL);
  raise(sig);
}
}  // namespace

int main(int argc, char* argv[]) {
  if (std::getenv("MM_TEST_BACKTRACE") != nullptr) {
    struct sigaction sa = {};
    sa.sa_sigaction = print_fault;
    sa.sa_flags = SA_SIGINFO;
    sigaction(SIGSEGV, &sa, nullptr);
  }
  int result = 0;
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    result = Catch::Session().run(argc, argv);
  }
  return result;
}
