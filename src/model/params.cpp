#include "model/params.hpp"

#include <cmath>

namespace mm {

namespace {
index_t cols_of(const std::vector<index_t>& shape) {
  index_t n = 1;
  for (std::size_t d = 1; d < shape.size(); ++d) n *= shape[d];
  return n;
}
std::vector<index_t> expand(const std::vector<IndexRange>& ranges, index_t full) {
  std::vector<index_t> out;
  if (ranges.empty()) {
    out.resize(std::size_t(full));
    for (index_t i = 0; i < full; ++i) out[std::size_t(i)] = i;
    return out;
  }
  for (const IndexRange& r : ranges)
    for (index_t i = 0; i < r.count; ++i) out.push_back(r.begin + i);
  return out;
}
}  // namespace

std::vector<index_t> ParamEntry::global_index() const {
  const auto& g = global_shape();
  const index_t grows = g.empty() ? 1 : g[0], gcols = cols_of(g);
  const auto rows = expand(shard.rows, grows), cols = expand(shard.cols, gcols);
  std::vector<index_t> out;
  out.reserve(rows.size() * cols.size());
  for (index_t r : rows)
    for (index_t c : cols) out.push_back(r * gcols + c);
  return out;
}

template <class P>
void ParamStore<P>::check_shard(const ParamEntry& e) {
  const auto& g = e.shard.global_shape;
  require(g.size() == e.shape.size() && !g.empty(), "ParamStore", "parameter '", e.name,
          "': the global shape has a different rank from the local one");
  const index_t grows = g[0], gcols = cols_of(g);
  auto covered = [&](const std::vector<IndexRange>& rs, index_t full, index_t local, const char* what) {
    index_t n = 0;
    for (const IndexRange& r : rs) {
      require(r.begin >= 0 && r.count >= 0 && r.begin + r.count <= full, "ParamStore", "parameter '", e.name, "': ",
              what, " range [", r.begin, ", ", r.begin + r.count, ") outside 0..", full);
      n += r.count;
    }
    require((rs.empty() ? full : n) == local, "ParamStore", "parameter '", e.name, "': the ", what,
            " ranges cover ", rs.empty() ? full : n, " of the ", local, " local ", what);
  };
  covered(e.shard.rows, grows, e.shape[0], "rows");
  covered(e.shard.cols, gcols, cols_of(e.shape), "columns");
}

template <class P>
void ParamStore<P>::initialize(std::uint64_t seed) {
  require(allocated_, "ParamStore", "initialize() before allocate()");
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    const ParamEntry& e = entries_[i];
    const View1<P> v = v1(i);
    const CounterRNG rng{seed, stream_id(e.name)};
    const Init in = e.init;
    // draws by global element index: a shard holds exactly the values of the unsharded tensor
    View1<index_t> gidx("params::global_index", e.sharded() ? std::size_t(e.size) : 0);
    if (e.sharded()) {
      const auto gi = e.global_index();
      auto h = Kokkos::create_mirror_view(gidx);
      for (std::size_t k = 0; k < gi.size(); ++k) h(k) = gi[k];
      Kokkos::deep_copy(gidx, h);
    }
    const bool remap = e.sharded();
    par_for("params::initialize", e.size, KOKKOS_LAMBDA(index_t kl) {
      const index_t k = remap ? gidx(kl) : kl;
      double val = 0;
      switch (in.kind) {
        case Init::zeros: val = 0; break;
        case Init::ones: val = 1; break;
        case Init::constant: val = in.a; break;
        case Init::uniform: val = rng.uniform(k, in.a, in.b); break;
        case Init::normal: val = in.a + in.b * rng.normal(k); break;
        case Init::dt_bias: {
          // mamba_ssm: dt = exp(U[log dt_min, log dt_max]) clamped below by dt_init_floor, and the bias is the
          // inverse softplus of dt, so that softplus(bias) = dt at initialisation.
          double dt = Kokkos::exp(rng.uniform(k, Kokkos::log(in.a), Kokkos::log(in.b)));
          dt = dt < in.c ? in.c : dt;
          val = dt + Kokkos::log(-Kokkos::expm1(-dt));
          break;
        }
        case Init::a_log: val = Kokkos::log(rng.uniform(k, in.a, in.b)); break;
        case Init::log_column: val = Kokkos::log(double(k % index_t(in.a) + 1)); break;
      }
      v(kl) = P(val * in.scale);
    });
  }
  Kokkos::fence("params::initialize");
}

template class ParamStore<float>;
template class ParamStore<double>;

}  // namespace mm
