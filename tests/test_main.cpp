// One Catch2 main for the unit-test binaries: Kokkos first (it removes its own --kokkos-* flags from argv), then
// the Catch2 session in an inner scope so that every View dies before Kokkos finalizes. The unit tests need no MPI;
// the MPI tests have their own binaries run under mpiexec.
// With MM_TEST_BACKTRACE set, a segmentation fault prints where it happened (the faulting instruction, its mapping
// and a backtrace), for crashes seen only on a machine without a debugger. Catch2 installs its own handler around
// every test case and, on a fault, re-raises the signal from that handler, whose context then says nothing about
// the fault; so this handler is put back in front of Catch2's at every Kokkos allocation and kernel launch.
#define CATCH_CONFIG_RUNNER
#include <execinfo.h>
#include <signal.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <Kokkos_Core.hpp>

#include "catch.hpp"

namespace {
// Prints the mapping (and file offset, for addr2line -e) of one code address.
void print_address(const char* what, unsigned long addr) {
  char buf[512];
  int n = 0;
  if (FILE* maps = std::fopen("/proc/self/maps", "r")) {
    char line[512];
    while (std::fgets(line, sizeof line, maps) != nullptr) {
      unsigned long lo = 0, hi = 0, off = 0;
      char path[256] = "";
      if (std::sscanf(line, "%lx-%lx %*s %lx %*s %*s %255s", &lo, &hi, &off, path) >= 3 && addr >= lo && addr < hi) {
        n = std::snprintf(buf, sizeof buf, "%s 0x%lx: %s(+0x%lx)\n", what, addr, path, addr - lo + off);
        (void)!write(2, buf, std::size_t(n));
      }
    }
    std::fclose(maps);
  }
  if (n == 0) {
    n = std::snprintf(buf, sizeof buf, "%s 0x%lx: not in a mapping\n", what, addr);
    (void)!write(2, buf, std::size_t(n));
  }
}

// The faulting instruction and the address it touched (from the signal's context), where they are mapped, the
// words at the top of the stack (after a call through a null or stale function pointer, pc is 0 and backtrace()
// stops at once, but the first word is the caller's return address), then whatever backtrace() finds.
void print_fault(int sig, siginfo_t* info, void* ctx) {
  std::fflush(stdout);  // Catch2's buffered report so far (not async-signal-safe; this is a diagnostic)
  char buf[256];
  const auto& regs = static_cast<ucontext_t*>(ctx)->uc_mcontext.gregs;
  const auto pc = static_cast<unsigned long>(regs[REG_RIP]);
  const auto* sp = reinterpret_cast<const unsigned long*>(regs[REG_RSP]);
  int n = std::snprintf(buf, sizeof buf, "\nfault: signal %d at pc 0x%lx touching 0x%lx\n", sig, pc,
                        reinterpret_cast<unsigned long>(info->si_addr));
  (void)!write(2, buf, std::size_t(n));
  print_address("fault pc", pc);
  for (int i = 0; i < 4; ++i) print_address(i == 0 ? "stack[0] (return address after a call)" : "stack word", sp[i]);
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

void install_fault_handler() {
  struct sigaction cur = {};
  sigaction(SIGSEGV, nullptr, &cur);
  if ((cur.sa_flags & SA_SIGINFO) != 0 && cur.sa_sigaction == print_fault) return;
  struct sigaction sa = {};
  sa.sa_sigaction = print_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;  // on Catch2's alternate stack while it has one (stack overflows)
  sigaction(SIGSEGV, &sa, nullptr);
}
void on_kernel(const char*, std::uint32_t, std::uint64_t*) { install_fault_handler(); }
void on_alloc(Kokkos::Profiling::SpaceHandle, const char*, const void*, std::uint64_t) { install_fault_handler(); }
}  // namespace

int main(int argc, char* argv[]) {
  const bool trace = std::getenv("MM_TEST_BACKTRACE") != nullptr;
  if (trace) install_fault_handler();
  int result = 0;
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    if (trace) {
      namespace KT = Kokkos::Tools::Experimental;
      KT::set_begin_parallel_for_callback(on_kernel);
      KT::set_begin_parallel_reduce_callback(on_kernel);
      KT::set_allocate_data_callback(on_alloc);
    }
    result = Catch::Session().run(argc, argv);
  }
  return result;
}
