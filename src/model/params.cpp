#include "model/params.hpp"

#include <cmath>

namespace mm {

template <class P>
void ParamStore<P>::initialize(std::uint64_t seed) {
  require(allocated_, "ParamStore", "initialize() before allocate()");
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    const ParamEntry& e = entries_[i];
    const View1<P> v = v1(i);
    const CounterRNG rng{seed, stream_id(e.name)};
    const Init in = e.init;
    par_for("params::initialize", e.size, KOKKOS_LAMBDA(index_t k) {
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
      v(k) = P(val * in.scale);
    });
  }
  Kokkos::fence("params::initialize");
}

template class ParamStore<float>;
template class ParamStore<double>;

}  // namespace mm
