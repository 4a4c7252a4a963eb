// Shared helpers of the MPI tests: the world's size and rank, and the layouts a test sweeps at that size.
#pragma once

#include <mpi.h>

#include <string>
#include <vector>

#include "parallel/grid.hpp"

namespace mmtest {

inline int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}
inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

inline std::string describe(const mm::parallel::Layout& l) {
  return "tp" + std::to_string(l.tp) + " cp" + std::to_string(l.cp) + " ep" + std::to_string(l.ep) + " dp" +
         std::to_string(l.dp);
}

// Every (tp, cp, ep, dp) whose product is `n`, each dimension a power of two (n is 1, 2 or 4 in ctest).
inline std::vector<mm::parallel::Layout> all_layouts(int n) {
  std::vector<mm::parallel::Layout> out;
  for (int tp = 1; tp <= n; tp *= 2)
    for (int cp = 1; tp * cp <= n; cp *= 2)
      for (int ep = 1; tp * cp * ep <= n; ep *= 2)
        if (n % (tp * cp * ep) == 0) out.push_back({tp, cp, ep, n / (tp * cp * ep)});
  return out;
}

}  // namespace mmtest
