// Shared helpers for the unit tests: deterministic random tensors, host copies, error norms and
// finite-difference gradient checks.
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "catch.hpp"
#include "core/kokkos_types.hpp"
#include "core/rng.hpp"
#include "model/params.hpp"

namespace mmtest {

using mm::index_t;

// Internal linkage (the unnamed namespace): the KOKKOS_LAMBDAs in these header templates would otherwise give
// every translation unit that instantiates one the same lambda wrapper type, whose copy goes through function
// pointers nvcc keeps per translation unit; the linker keeps one unit's copy of the out-of-line code and the
// others' pointers stay null (a host call through address 0 on CUDA builds, at the first copy of such a lambda).
namespace {

// Fill any contiguous view with uniform values in [lo, hi) drawn from (seed, stream).
template <class V>
void fill_uniform(const V& v, std::uint64_t stream, double lo = -1.0, double hi = 1.0, std::uint64_t seed = 1234) {
  using T = typename V::non_const_value_type;
  auto p = v.data();
  const mm::CounterRNG rng{seed, stream};
  mm::par_for("test::fill_uniform", v.span(), KOKKOS_LAMBDA(index_t i) { p[i] = T(rng.uniform(i, lo, hi)); });
  Kokkos::fence();
}

template <class V>
std::vector<double> to_vec(const V& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  std::vector<double> out(h.span());
  for (std::size_t i = 0; i < h.span(); ++i) out[i] = double(h.data()[i]);
  return out;
}

template <class V>
void from_vec(const V& v, const std::vector<double>& src) {
  auto h = Kokkos::create_mirror_view(v);
  REQUIRE(h.span() == src.size());
  for (std::size_t i = 0; i < src.size(); ++i) h.data()[i] = typename V::non_const_value_type(src[i]);
  Kokkos::deep_copy(v, h);
}

// max_i |a_i - b_i| / max(max_i |b_i|, floor): relative to the reference's scale.
// (infinity where either side holds a NaN or an infinity: std::max passes over a NaN, so without that check an
// output with NaNs in it could pass every tolerance)
inline double rel_err(const std::vector<double>& a, const std::vector<double>& b, double floor = 1e-12) {
  REQUIRE(a.size() == b.size());
  double num = 0, den = floor;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return std::numeric_limits<double>::infinity();
    num = std::max(num, std::abs(a[i] - b[i]));
    den = std::max(den, std::abs(b[i]));
  }
  return num / den;
}

// Whether a mixer keeps its out_proj input only as a bf16 copy: under bf16 GEMMs on CUDA builds (host builds
// compute the GEMMs in fp32 and keep the fp32 activation).
inline bool keeps_bf16_copy(bool bf16_gemms) {
#if defined(KOKKOS_ENABLE_CUDA)
  return bf16_gemms;
#else
  (void)bf16_gemms;
  return false;
#endif
}

// One mixer's forward + backward on host: its output, the input gradient and every parameter gradient.
struct MixerRun {
  std::vector<double> out, du, grads;
};
// The bf16-copy checks of a mixer (Mamba-2's gated norm, Mamba-3's gate): the run under bf16 GEMMs (b16) within
// bf16 rounding of the fp32-GEMM run (ref) for the output and the parameter gradients (3e-2) and the input gradient
// (du_tol), and the same run under the recompute policy (b16rc) equal to it bit for bit.
inline void check_bf16_runs(const MixerRun& ref, const MixerRun& b16, const MixerRun& b16rc, double du_tol) {
  CHECK(rel_err(b16.out, ref.out) < 3e-2);
  CHECK(rel_err(b16.du, ref.du) < du_tol);
  CHECK(rel_err(b16.grads, ref.grads) < 3e-2);
  CHECK(b16rc.out == b16.out);
  CHECK(b16rc.du == b16.du);
  CHECK(b16rc.grads == b16.grads);
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Central finite differences of a scalar function of one tensor, at `count` evenly spread elements (all of them
// when the tensor is smaller), compared against the analytic gradient.
// `loss` evaluates the scalar objective after the tensor `x` has been modified in place.
struct FDResult {
  double max_abs_err = 0, max_ref = 0;
  double rel() const { return max_abs_err / std::max(max_ref, 1e-12); }
};

template <class V>
FDResult fd_check(const V& x, const std::vector<double>& analytic, const std::function<double()>& loss,
                  int count = 24, double eps = 1e-5) {
  std::vector<double> base = to_vec(x);
  REQUIRE(base.size() == analytic.size());
  FDResult r;
  const std::size_t n = base.size();
  const std::size_t stride = std::max<std::size_t>(1, n / std::size_t(count));
  for (std::size_t i = 0; i < n; i += stride) {
    std::vector<double> xp = base;
    xp[i] = base[i] + eps;
    from_vec(x, xp);
    const double lp = loss();
    xp[i] = base[i] - eps;
    from_vec(x, xp);
    const double lm = loss();
    const double fd = (lp - lm) / (2 * eps);
    r.max_abs_err = std::max(r.max_abs_err, std::abs(fd - analytic[i]));
    r.max_ref = std::max(r.max_ref, std::abs(analytic[i]));
  }
  from_vec(x, base);
  return r;
}

// Move a freshly initialised model away from its special values for a gradient check: every parameter gets
// U(-amplitude, amplitude) added (norm weights and D are no longer all ones, biases no longer zero), and dt_bias is
// redrawn in U(-1, 1), i.e. softplus(dt_bias) in 0.3-1.3. At mamba_ssm's initial dt (1e-3 to 0.1) the gradients of
// dt_bias and A_log are so small that finite differences of the loss resolve them to a few digits only.
template <class S>
void jitter_params(mm::ParamStore<S>& ps, std::uint64_t seed, double amplitude) {
  auto v = ps.values();
  const mm::CounterRNG rng{seed, 7};
  mm::par_for("test::jitter", v.extent(0), KOKKOS_LAMBDA(index_t i) { v(i) += S(amplitude * rng.uniform(i, -1, 1)); });
  for (const auto& e : ps.entries())
    if (e.name.size() >= 7 && e.name.compare(e.name.size() - 7, 7, "dt_bias") == 0)
      fill_uniform(ps.v1(ps.index(e.name)), mm::stream_id(e.name), -1.0, 1.0);
  Kokkos::fence();
}

}  // namespace
}  // namespace mmtest
