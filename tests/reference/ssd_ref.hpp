// Naive double-precision reference of the Mamba-2 SSD recurrence, token by token (no chunks).
#pragma once

#include <cmath>
#include <limits>
#include <vector>

namespace mmref {

struct SSDRefShape {
  long B, L, H, P, G, N;
  double dt_lo = 0, dt_hi = std::numeric_limits<double>::infinity();
};

inline double softplus(double x) { return x > 20 ? x : std::log1p(std::exp(x)); }

// xbc: rows b*L+t, columns [x (H*P) | B (G*N) | C (G*N)]; dt: rows b*L+t, H columns (raw).
// seq: (B*L) record ids or empty; init: (B,H,P,N) or empty. Returns y (B*L, H*P) and writes final (B,H,P,N).
inline std::vector<double> ssd_reference(const SSDRefShape& s, const std::vector<double>& xbc,
                                         const std::vector<double>& dt, const std::vector<double>& A_log,
                                         const std::vector<double>& dt_bias, const std::vector<double>& D,
                                         const std::vector<int>& seq, const std::vector<double>& init,
                                         std::vector<double>* final_state) {
  const long E = s.H * s.P, W = E + 2 * s.G * s.N, hpg = s.H / s.G;
  std::vector<double> y(s.B * s.L * E, 0.0);
  if (final_state) final_state->assign(s.B * s.H * s.P * s.N, 0.0);
  for (long b = 0; b < s.B; ++b)
    for (long h = 0; h < s.H; ++h) {
      const long g = h / hpg;
      const double A = -std::exp(A_log[h]);
      std::vector<double> S(s.P * s.N, 0.0);
      if (!init.empty())
        for (long i = 0; i < s.P * s.N; ++i) S[i] = init[((b * s.H + h) * s.P * s.N) + i];
      for (long t = 0; t < s.L; ++t) {
        const long r = b * s.L + t;
        double d = softplus(dt[r * s.H + h] + dt_bias[h]);
        d = std::min(std::max(d, s.dt_lo), s.dt_hi);
        const bool reset = !seq.empty() && t > 0 && seq[r] != seq[r - 1];
        const double decay = reset ? 0.0 : std::exp(d * A);
        for (long p = 0; p < s.P; ++p) {
          const double xv = xbc[r * W + h * s.P + p];
          double acc = 0;
          for (long n = 0; n < s.N; ++n) {
            const double Bv = xbc[r * W + E + g * s.N + n];
            const double Cv = xbc[r * W + E + s.G * s.N + g * s.N + n];
            double& st = S[p * s.N + n];
            st = decay * st + d * xv * Bv;
            acc += st * Cv;
          }
          y[r * E + h * s.P + p] = acc + D[h] * xv;
        }
      }
      if (final_state)
        for (long i = 0; i < s.P * s.N; ++i) (*final_state)[(b * s.H + h) * s.P * s.N + i] = S[i];
    }
  return y;
}

}  // namespace mmref
