// The [parallel] layout check: the product of tp, cp, ep, dp must equal the MPI ranks (dp = 0 takes the rest), and
// every rejected layout names its values. (The collectives and the grid run under mpiexec in tests/mpi/.)
#include "catch.hpp"
#include "core/error.hpp"
#include "parallel/grid.hpp"

using mm::parallel::Layout;
using mm::parallel::resolve_layout;

namespace {
std::string error_of(const Layout& l, std::int64_t world) {
  try {
    resolve_layout(l, world);
  } catch (const mm::Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("process grid: dp = 0 takes the rest, and bad layouts name their values", "[parallel]") {
  Layout l;
  CHECK(resolve_layout(l, 1).dp == 1);
  CHECK(resolve_layout(l, 6).dp == 6);
  l.dp = 4;
  const Layout r = resolve_layout(l, 4);
  CHECK((r.tp == 1 && r.cp == 1 && r.ep == 1 && r.dp == 4));

  l.dp = 3;  // 3 != 2 ranks
  auto msg = error_of(l, 2);
  CHECK(msg.find("dp = 3") != std::string::npos);
  CHECK(msg.find("2 MPI ranks") != std::string::npos);

  l = Layout{};
  l.dp = -1;
  CHECK(error_of(l, 2).find("dp = -1") != std::string::npos);
  l = Layout{};
  l.tp = 0;
  CHECK(error_of(l, 2).find("tp = 0") != std::string::npos);

  l = Layout{};
  l.tp = 3;  // dp = 0: 3 does not divide 4 ranks
  msg = error_of(l, 4);
  CHECK(msg.find("= 3 does not divide the 4 MPI ranks") != std::string::npos);

  l = Layout{};
  l.tp = 2, l.cp = 2;  // dp = 0 takes the rest
  const Layout t = resolve_layout(l, 8);
  CHECK((t.tp == 2 && t.cp == 2 && t.ep == 1 && t.dp == 2));
}
