// Naive double-precision reference of the MoE layer (moe/moe_layer.hpp, moe/router.hpp): one token at a time, one
// chosen expert at a time, plain loops. Forward (output, chosen experts, kept assignments, aux and z losses) and
// backward (for loss = sum(dout * out) + aux_scale * (aux + z)).
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

namespace mmref {

struct MoERefConfig {
  long n = 0, d = 0, E = 0, k = 1, F = 0, Fs = 0;
  bool softmax = true, renorm = false, state_aware = false;
  double tau = 1, scale = 1, cf = 0, aux = 0, z = 0;
};

// Weights in the layer's shapes: wr (E, dr), bias (E or empty), w1/w3 (E, F, d), w2 (E, d, F), s1/s3 (Fs, d),
// s2 (d, Fs).
struct MoERefParams {
  std::vector<double> wr, bias, w1, w3, w2, s1, s3, s2;
};

struct MoERefResult {
  std::vector<double> out;                      // (n, d)
  double aux = 0, z = 0;
  std::vector<int> expert;                      // (n, k)
  std::vector<int> kept;                        // (n, k) 1 = computed, 0 = dropped by capacity
  std::vector<long> routed;                     // (E)
  // gradients (backward only)
  std::vector<double> dx, dstate, dwr, dw1, dw3, dw2, ds1, ds3, ds2;
};

namespace moe_detail {
inline double sig(double v) { return 1.0 / (1.0 + std::exp(-v)); }
inline double moe_silu(double v) { return v * sig(v); }
inline double moe_dsilu(double v) { return sig(v) * (1 + v * (1 - sig(v))); }

// SwiGLU of one token with one expert's weights (w1, w3: (F, d) at o13; w2: (d, F) at o2). Accumulates
// g * y into out; with dout non-null, backward of g * y: weight grads, dx, and returns dout . y.
inline double swiglu(long d, long F, const double* x, const double* w1, const double* w3, const double* w2, double g,
                     double* out, const double* dout, double* dw1, double* dw3, double* dw2, double* dx) {
  std::vector<double> h1(F, 0), h3(F, 0), a(F), y(d, 0);
  for (long f = 0; f < F; ++f) {
    for (long c = 0; c < d; ++c) {
      h1[f] += w1[f * d + c] * x[c];
      h3[f] += w3[f * d + c] * x[c];
    }
    a[f] = moe_silu(h1[f]) * h3[f];
  }
  for (long c = 0; c < d; ++c)
    for (long f = 0; f < F; ++f) y[c] += w2[c * F + f] * a[f];
  if (out)
    for (long c = 0; c < d; ++c) out[c] += g * y[c];
  if (!dout) return 0;
  double dg = 0;
  for (long c = 0; c < d; ++c) dg += dout[c] * y[c];
  std::vector<double> da(F, 0);
  for (long c = 0; c < d; ++c)
    for (long f = 0; f < F; ++f) {
      dw2[c * F + f] += g * dout[c] * a[f];
      da[f] += g * dout[c] * w2[c * F + f];
    }
  for (long f = 0; f < F; ++f) {
    const double dh1 = da[f] * h3[f] * moe_dsilu(h1[f]), dh3 = da[f] * moe_silu(h1[f]);
    for (long c = 0; c < d; ++c) {
      dw1[f * d + c] += dh1 * x[c];
      dw3[f * d + c] += dh3 * x[c];
      dx[c] += dh1 * w1[f * d + c] + dh3 * w3[f * d + c];
    }
  }
  return dg;
}
}  // namespace moe_detail

// x, state (n, d) (state only with state_aware), noise (n, dr) multiplicative router-input jitter (empty: none).
// With dout non-empty the gradients are filled too.
inline MoERefResult moe_reference(const MoERefConfig& c, const MoERefParams& p, const std::vector<double>& x,
                                  const std::vector<double>& state, const std::vector<double>& noise,
                                  const std::vector<double>& dout = {}, double aux_scale = 1.0) {
  using namespace moe_detail;
  const long n = c.n, d = c.d, E = c.E, k = c.k, F = c.F, Fs = c.Fs, dr = c.state_aware ? 2 * d : d;
  const bool bwd = !dout.empty();
  MoERefResult R;
  R.out.assign(n * d, 0.0);
  R.expert.assign(n * k, -1);
  R.kept.assign(n * k, 0);
  R.routed.assign(E, 0);
  if (bwd) {
    R.dx.assign(n * d, 0.0);
    R.dstate.assign(n * d, 0.0);
    R.dwr.assign(p.wr.size(), 0.0);
    R.dw1.assign(p.w1.size(), 0.0);
    R.dw3.assign(p.w3.size(), 0.0);
    R.dw2.assign(p.w2.size(), 0.0);
    R.ds1.assign(p.s1.size(), 0.0);
    R.ds3.assign(p.s3.size(), 0.0);
    R.ds2.assign(p.s2.size(), 0.0);
  }
  // router, token by token
  std::vector<double> rin(n * dr), l(n * E), pr(n * E), lse(n), gate(n * k);
  for (long t = 0; t < n; ++t) {
    for (long q = 0; q < dr; ++q) {
      const double v = q < d ? x[t * d + q] : state[t * d + q - d];
      rin[t * dr + q] = noise.empty() ? v : v * noise[t * dr + q];
    }
    double mx = -1e300;
    for (long i = 0; i < E; ++i) {
      double s = 0;
      for (long q = 0; q < dr; ++q) s += p.wr[i * dr + q] * rin[t * dr + q];
      l[t * E + i] = s / c.tau;
      mx = std::max(mx, l[t * E + i]);
    }
    double se = 0;
    for (long i = 0; i < E; ++i) se += std::exp(l[t * E + i] - mx);
    lse[t] = mx + std::log(se);
    for (long i = 0; i < E; ++i)
      pr[t * E + i] = c.softmax ? std::exp(l[t * E + i] - lse[t]) : sig(l[t * E + i]);
    // top-k of p + bias, ties to the lower index: a stable sort by decreasing value
    std::vector<long> order(E);
    for (long i = 0; i < E; ++i) order[i] = i;
    auto val = [&](long i) { return pr[t * E + i] + (p.bias.empty() ? 0.0 : p.bias[i]); };
    std::stable_sort(order.begin(), order.end(), [&](long a, long b) { return val(a) > val(b); });
    double sc = 0;
    for (long j = 0; j < k; ++j) {
      R.expert[t * k + j] = int(order[j]);
      R.routed[order[j]] += 1;
      sc += pr[t * E + order[j]];
    }
    for (long j = 0; j < k; ++j) gate[t * k + j] = c.scale * pr[t * E + order[j]] / (c.renorm ? sc : 1.0);
  }
  // capacity: slot-major, token order
  const long cap = c.cf > 0 ? long(std::ceil(c.cf * double(n) * double(k) / double(E))) : -1;
  std::vector<long> used(E, 0);
  for (long j = 0; j < k; ++j)
    for (long t = 0; t < n; ++t) {
      const int e = R.expert[t * k + j];
      if (cap < 0 || used[e] < cap) {
        R.kept[t * k + j] = 1;
        used[e] += 1;
      }
    }
  // losses
  for (long i = 0; i < E; ++i) {
    double colsum = 0;
    for (long t = 0; t < n; ++t) {
      double S = 0;
      for (long m = 0; m < E; ++m) S += pr[t * E + m];
      colsum += c.softmax ? pr[t * E + i] : pr[t * E + i] / S;
    }
    R.aux += c.aux * double(E) / (double(k) * n * n) * double(R.routed[i]) * colsum;
  }
  for (long t = 0; t < n; ++t) R.z += c.z * lse[t] * lse[t] / double(n);
  // experts and backward, token by token
  for (long t = 0; t < n; ++t) {
    const double* xt = &x[t * d];
    const double* dt = bwd ? &dout[t * d] : nullptr;
    std::vector<double> dgate(k, 0.0);
    for (long j = 0; j < k; ++j) {
      if (!R.kept[t * k + j]) continue;
      const long e = R.expert[t * k + j];
      const long o13 = e * F * d, o2 = e * d * F;
      dgate[j] = swiglu(d, F, xt, &p.w1[o13], &p.w3[o13], &p.w2[o2], gate[t * k + j], &R.out[t * d], dt,
                        bwd ? &R.dw1[o13] : nullptr, bwd ? &R.dw3[o13] : nullptr, bwd ? &R.dw2[o2] : nullptr,
                        bwd ? &R.dx[t * d] : nullptr);
    }
    if (Fs > 0)
      swiglu(d, Fs, xt, p.s1.data(), p.s3.data(), p.s2.data(), 1.0, &R.out[t * d], dt, bwd ? R.ds1.data() : nullptr,
             bwd ? R.ds3.data() : nullptr, bwd ? R.ds2.data() : nullptr, bwd ? &R.dx[t * d] : nullptr);
    if (!bwd) continue;
    // router backward of token t
    std::vector<double> dp(E, 0.0), dl(E, 0.0);
    double S = 0;
    for (long i = 0; i < E; ++i) S += pr[t * E + i];
    for (long i = 0; i < E; ++i) {  // aux: d/dq_i = s c E / (k n^2) count_i, then q -> p
      const double cA = aux_scale * c.aux * double(E) / (double(k) * n * n);
      if (c.softmax) {
        dp[i] += cA * double(R.routed[i]);
      } else {
        for (long m = 0; m < E; ++m) {
          const double dq_dp = ((m == i ? 1.0 : 0.0) - pr[t * E + m] / S) / S;  // d q_m / d p_i
          dp[i] += cA * double(R.routed[m]) * dq_dp;
        }
      }
    }
    double sc = 0;
    for (long j = 0; j < k; ++j) sc += pr[t * E + R.expert[t * k + j]];
    for (long j = 0; j < k; ++j)      // g_j = s p_{e_j} / (renorm ? sc : 1)
      for (long m = 0; m < k; ++m) {  // d g_j / d p_{e_m}
        const double pj = pr[t * E + R.expert[t * k + j]];
        const double dgdp = c.renorm ? c.scale * ((j == m ? 1.0 : 0.0) / sc - pj / (sc * sc))
                                     : c.scale * (j == m ? 1.0 : 0.0);
        dp[R.expert[t * k + m]] += dgate[j] * dgdp;
      }
    for (long i = 0; i < E; ++i)
      for (long m = 0; m < E; ++m) {  // d p_m / d l_i
        const double pm = pr[t * E + m], pi = pr[t * E + i];
        const double dpdl = c.softmax ? pm * ((m == i ? 1.0 : 0.0) - pi) : (m == i ? pm * (1 - pm) : 0.0);
        dl[i] += dp[m] * dpdl;
      }
    for (long i = 0; i < E; ++i) {
      dl[i] += aux_scale * c.z / double(n) * 2 * lse[t] * std::exp(l[t * E + i] - lse[t]);
      dl[i] /= c.tau;
    }
    for (long i = 0; i < E; ++i)
      for (long q = 0; q < dr; ++q) {
        R.dwr[i * dr + q] += dl[i] * rin[t * dr + q];
        const double g = dl[i] * p.wr[i * dr + q] * (noise.empty() ? 1.0 : noise[t * dr + q]);
        if (q < d)
          R.dx[t * d + q] += g;
        else
          R.dstate[t * d + q - d] += g;
      }
  }
  return R;
}

}  // namespace mmref
