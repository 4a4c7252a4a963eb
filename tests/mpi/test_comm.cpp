// The communicator and the process grid under MPI: every layout at the world's size gives each rank the coordinates
// of the documented order (tp fastest, then cp, ep, dp), each dimension's communicator holds exactly the ranks that
// differ only along it, and the point-to-point and all-to-all collectives deliver what was sent.
#include <numeric>

#include "catch.hpp"
#include "mpi/mpi_util.hpp"

using namespace mm::parallel;

TEST_CASE("process grid: coordinates and communicators of every layout", "[comm]") {
  const int n = mmtest::world_size(), r = mmtest::world_rank();
  for (const Layout& l : mmtest::all_layouts(n)) {
    INFO(mmtest::describe(l));
    ProcessGrid g(l, MPI_COMM_WORLD);
    const int tp = int(l.tp), cp = int(l.cp), ep = int(l.ep);
    CHECK(g.tp_rank() == r % tp);
    CHECK(g.cp_rank() == (r / tp) % cp);
    CHECK(g.ep_rank() == (r / (tp * cp)) % ep);
    CHECK(g.dp_rank() == r / (tp * cp * ep));
    CHECK(g.tp_comm()->size() == tp);
    CHECK(g.cp_comm()->size() == cp);
    CHECK(g.ep_comm()->size() == ep);
    CHECK(g.dp_comm()->size() == l.dp);
    CHECK(g.data_comm()->size() == ep * l.dp);
    CHECK(g.data_comm()->rank() == g.ep_rank() + ep * g.dp_rank());
    // the members of each communicator, by world rank
    const std::vector<std::int64_t> me{r};
    auto tps = g.tp_comm()->allgather(me);
    for (int q = 0; q < tp; ++q) CHECK(tps[q] == r - g.tp_rank() + q);
    auto cps = g.cp_comm()->allgather(me);
    for (int q = 0; q < cp; ++q) CHECK(cps[q] == r + (q - g.cp_rank()) * tp);
    auto eps = g.ep_comm()->allgather(me);
    for (int q = 0; q < ep; ++q) CHECK(eps[q] == r + (q - g.ep_rank()) * tp * cp);
  }
}

TEST_CASE("comm: sendrecv along a chain and alltoallv with uneven counts", "[comm]") {
  const int n = mmtest::world_size(), r = mmtest::world_rank();
  MpiComm world([] {
    MPI_Comm c;
    MPI_Comm_dup(MPI_COMM_WORLD, &c);
    return c;
  }());
  // each rank sends r + 1 values to its right neighbour and receives r values from its left one
  std::vector<double> send(std::size_t(r + 1), 10.0 * r), recv(std::size_t(r), -1.0);
  world.sendrecv(send.data(), r + 1 < n ? send.size() : 0, r + 1 < n ? r + 1 : -1, recv.data(),
                 r > 0 ? recv.size() : 0, r > 0 ? r - 1 : -1);
  for (double v : recv) CHECK(v == 10.0 * (r - 1));

  // rank r sends q + r + 1 values (value 1000 r + q) to rank q
  std::vector<std::size_t> counts(std::size_t(n), 0);
  std::vector<float> data;
  for (int q = 0; q < n; ++q) {
    counts[q] = std::size_t(q + r + 1);
    data.insert(data.end(), counts[q], float(1000 * r + q));
  }
  std::vector<std::size_t> got;
  auto out = world.alltoallv(data, counts, got);
  REQUIRE(got.size() == std::size_t(n));
  std::size_t off = 0;
  for (int q = 0; q < n; ++q) {
    CHECK(got[q] == std::size_t(r + q + 1));
    for (std::size_t i = 0; i < got[q]; ++i) CHECK(out[off + i] == float(1000 * q + r));
    off += got[q];
  }
  CHECK(off == out.size());
}
