// Naive double-precision reference of the Mamba-2 mixer: the same data flow as mamba_ssm's
// mamba_split_conv1d_scan_ref, written with plain loops on top of the token-by-token SSD reference.
#pragma once

#include <cmath>
#include <vector>

#include "reference/ssd_ref.hpp"

namespace mmref {

struct Mamba2RefShape {
  long B, L, D, E, H, P, G, N, W;
  double eps = 1e-5;
  double dt_lo = 0, dt_hi = std::numeric_limits<double>::infinity();
};

inline double silu(double x) { return x / (1.0 + std::exp(-x)); }

// u (B*L, D); weights in PyTorch shapes: in_proj (2E+2GN+H, D), conv (E+2GN, W), conv_b (E+2GN), out_proj (D, E).
inline std::vector<double> mamba2_reference(const Mamba2RefShape& s, const std::vector<double>& u,
                                            const std::vector<double>& in_proj, const std::vector<double>& conv_w,
                                            const std::vector<double>& conv_b, const std::vector<double>& dt_bias,
                                            const std::vector<double>& A_log, const std::vector<double>& Dskip,
                                            const std::vector<double>& norm_w, const std::vector<double>& out_proj,
                                            const std::vector<int>& seq) {
  const long n = s.B * s.L, GN = s.G * s.N, C = s.E + 2 * GN, Z = 2 * s.E + 2 * GN + s.H;
  std::vector<double> zx(n * Z, 0.0);
  for (long i = 0; i < n; ++i)
    for (long o = 0; o < Z; ++o) {
      double acc = 0;
      for (long k = 0; k < s.D; ++k) acc += u[i * s.D + k] * in_proj[o * s.D + k];
      zx[i * Z + o] = acc;
    }
  // conv over [x | B | C] = columns [E, E + C)
  std::vector<double> xbc(n * C), dt(n * s.H);
  for (long b = 0; b < s.B; ++b)
    for (long t = 0; t < s.L; ++t) {
      const long r = b * s.L + t;
      for (long c = 0; c < C; ++c) {
        double acc = conv_b[c];
        for (long k = 0; k < s.W; ++k) {
          const long src = t - (s.W - 1) + k;
          if (src < 0) continue;
          if (!seq.empty() && seq[b * s.L + src] != seq[r]) continue;
          acc += conv_w[c * s.W + k] * zx[(b * s.L + src) * Z + s.E + c];
        }
        xbc[r * C + c] = silu(acc);
      }
      for (long h = 0; h < s.H; ++h) dt[r * s.H + h] = zx[r * Z + 2 * s.E + 2 * GN + h];
    }
  SSDRefShape ss{s.B, s.L, s.H, s.P, s.G, s.N, s.dt_lo, s.dt_hi};
  const auto y = ssd_reference(ss, xbc, dt, A_log, dt_bias, Dskip, seq, {}, nullptr);
  // gated RMSNorm, group E/G, norm_before_gate = false
  const long gs = s.E / s.G;
  std::vector<double> yn(n * s.E);
  for (long i = 0; i < n; ++i)
    for (long g = 0; g < s.G; ++g) {
      double ss2 = 0;
      for (long j = g * gs; j < (g + 1) * gs; ++j) {
        const double v = y[i * s.E + j] * silu(zx[i * Z + j]);
        ss2 += v * v;
      }
      const double r = 1.0 / std::sqrt(ss2 / gs + s.eps);
      for (long j = g * gs; j < (g + 1) * gs; ++j) yn[i * s.E + j] = y[i * s.E + j] * silu(zx[i * Z + j]) * r * norm_w[j];
    }
  std::vector<double> out(n * s.D);
  for (long i = 0; i < n; ++i)
    for (long o = 0; o < s.D; ++o) {
      double acc = 0;
      for (long k = 0; k < s.E; ++k) acc += yn[i * s.E + k] * out_proj[o * s.E + k];
      out[i * s.D + o] = acc;
    }
  return out;
}

}  // namespace mmref
