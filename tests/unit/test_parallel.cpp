// The [parallel] layout check: the product of tp, cp, ep, dp must equal the MPI ranks (dp = 0 takes the rest), and
// every rejected layout names its values. Tensor-parallel layers: shapes that do not divide by tp are errors naming
// the values, and a rank's shards are the slices of the unsharded initialisation. (The collectives, the grid and
// the tp layers' numerics run under mpiexec in tests/mpi/.)
#include <memory>
#include <stdexcept>

#include "catch.hpp"
#include "core/error.hpp"
#include "model/dense_ffn.hpp"
#include "parallel/grid.hpp"
#include "ssm/mamba1/mixer.hpp"
#include "ssm/mamba2/mixer.hpp"
#include "ssm/mamba3/mixer.hpp"

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

// ---------------------------------------------------------------- tensor parallelism: shapes and shards (no MPI)
namespace {
// A communicator that only says its rank and size: the tp constructors register shards and check shapes without
// any collective, so they can be exercised here without MPI.
class FakeComm final : public mm::parallel::Comm {
 public:
  FakeComm(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void barrier() const override { fail(); }
  void allreduce_sum(void*, std::size_t, mm::parallel::DType) const override { fail(); }
  void allgather(const void*, void*, std::size_t, mm::parallel::DType) const override { fail(); }
  void broadcast(void*, std::size_t, mm::parallel::DType, int) const override { fail(); }
  void sendrecv(const void*, std::size_t, int, void*, std::size_t, int, mm::parallel::DType) const override {
    fail();
  }
  void alltoallv(const void*, const std::vector<std::size_t>&, void*, const std::vector<std::size_t>&,
                 mm::parallel::DType) const override {
    fail();
  }

 private:
  static void fail() { throw std::logic_error("FakeComm: no collectives"); }
  int rank_, size_;
};

mm::parallel::ModelComms tp_comms(int rank, int size) {
  mm::parallel::ModelComms c;
  c.tp = std::make_shared<FakeComm>(rank, size);
  return c;
}

template <class F>
std::string error_of_ctor(F&& f) {
  try {
    f();
  } catch (const mm::Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("tensor parallel: shapes that do not divide by tp name their values", "[parallel]") {
  mm::Mamba2Config m;
  m.d_model = 12, m.expand = 2, m.headdim = 4, m.d_state = 8, m.ngroups = 2;  // 6 heads
  mm::ParamStore<double> ps;
  auto msg = error_of_ctor([&] { mm::Mamba2Mixer<double>(m, ps, "m.", 1, tp_comms(0, 4)); });
  CHECK(msg.find("nheads = 6 does not divide by tp = 4") != std::string::npos);
  m.d_model = 16, m.ngroups = 1;  // 8 heads, 1 group
  msg = error_of_ctor([&] { mm::Mamba2Mixer<double>(m, ps, "m2.", 1, tp_comms(1, 2)); });
  CHECK(msg.find("ngroups = 1 does not divide by tp = 2") != std::string::npos);
  mm::DenseFFNConfig f;
  f.d_model = 8, f.d_ff = 6;
  msg = error_of_ctor([&] { mm::DenseFFN<double>(f, ps, "f.", 1, tp_comms(3, 4)); });
  CHECK(msg.find("dense d_ff = 6 does not divide by tp = 4") != std::string::npos);
  mm::Mamba1Config m1;
  m1.d_model = 5, m1.expand = 2;  // d_inner 10
  msg = error_of_ctor([&] { mm::Mamba1Mixer<double>(m1, ps, "a.", 1, tp_comms(0, 4)); });
  CHECK(msg.find("d_inner = expand * d_model = 10 does not divide by tp = 4") != std::string::npos);
  mm::Mamba3Config m3;
  m3.d_model = 16, m3.d_state = 8, m3.headdim = 4;
  msg = error_of_ctor([&] { mm::Mamba3Mixer<double>(m3, ps, "b.", 1, tp_comms(0, 2)); });
  CHECK(msg.find("tensor parallelism (tp = 2) is not implemented for the Mamba-3 mixer") != std::string::npos);
}

TEST_CASE("tensor parallel: a rank's shards are the slices of the unsharded parameters", "[parallel]") {
  mm::Mamba2Config m;
  m.d_model = 16, m.expand = 2, m.headdim = 4, m.d_state = 8, m.ngroups = 4;  // E 32, 8 heads, GN 32
  mm::ParamStore<double> whole;
  mm::Mamba2Mixer<double> mw(m, whole, "m.", 2);
  mm::DenseFFNConfig f;
  f.d_model = 16, f.d_ff = 12;
  mm::DenseFFN<double> fw(f, whole, "f.", 2);
  mm::Mamba1Config m1;
  m1.d_model = 8, m1.expand = 2, m1.d_state = 4;  // d_inner 16
  mm::Mamba1Mixer<double> m1w(m1, whole, "a.", 2);
  whole.allocate();
  whole.initialize(3);
  for (const auto& e : whole.entries()) CHECK(!e.sharded());  // tp = 1: no Shard, the old registration
  for (int tp : {2, 4})
    for (int r = 0; r < tp; ++r) {
      INFO("tp " << tp << " rank " << r);
      mm::ParamStore<double> part;
      mm::Mamba2Mixer<double> mp(m, part, "m.", 2, tp_comms(r, tp));
      mm::DenseFFN<double> fp(f, part, "f.", 2, tp_comms(r, tp));
      mm::Mamba1Mixer<double> m1p(m1, part, "a.", 2, tp_comms(r, tp));
      part.allocate();
      part.initialize(3);
      const auto& in = part.entry("m.in_proj.weight");
      const mm::index_t E = 32, GN = 32, H = 8;
      REQUIRE(in.shard.rows.size() == 5);
      CHECK(in.shard.rows[0].begin == E / tp * r);
      CHECK(in.shard.rows[1].begin == E + E / tp * r);
      CHECK(in.shard.rows[2].begin == 2 * E + GN / tp * r);
      CHECK(in.shard.rows[3].begin == 2 * E + GN + GN / tp * r);
      CHECK(in.shard.rows[4].begin == 2 * E + 2 * GN + H / tp * r);
      CHECK(in.shape == std::vector<mm::index_t>{(2 * E + 2 * GN + H) / tp, 16});
      CHECK(part.entry("m.out_proj.weight").shard.cols.size() == 1);
      CHECK(part.entry("f.w2").shape == std::vector<mm::index_t>{16, 12 / tp});
      for (std::size_t i = 0; i < part.entries().size(); ++i) {
        const auto& e = part.entries()[i];
        INFO(e.name);
        CHECK(e.sharded());
        CHECK(e.shard.split == mm::Split::tp);
        const auto gi = e.global_index();
        const auto a = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), part.v1(i));
        const auto b = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), whole.v1(whole.index(e.name)));
        bool same = true;
        for (std::size_t k = 0; k < gi.size(); ++k) same = same && a(k) == b(gi[k]);
        CHECK(same);
      }
    }
}
