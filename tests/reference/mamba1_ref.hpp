// Naive double-precision references of the Mamba-1 selective scan (token by token, mamba_ssm's selective_scan_ref
// with delta_softplus, plus records and an initial state) and of the Mamba-1 mixer (mamba_inner_ref's data flow).
#pragma once

#include <cmath>
#include <vector>

namespace mmref {

struct SelScanRefShape {
  long B, L, E, G, N;
};

inline double m1_softplus(double x) { return x > 20 ? x : std::log1p(std::exp(x)); }
inline double m1_silu(double x) { return x / (1.0 + std::exp(-x)); }

// u, delta, z: (B*L, E) (z empty: no gate); bc: (B*L, 2*G*N) = [B (G*N) | C (G*N)]; A (E*N); D, bias (E);
// seq (B*L) record ids or empty; init (B*E*N) or empty. Returns out (B*L, E), writes final (B*E*N).
inline std::vector<double> selective_scan_reference(const SelScanRefShape& s, const std::vector<double>& u,
                                                    const std::vector<double>& delta, const std::vector<double>& A,
                                                    const std::vector<double>& bc, const std::vector<double>& D,
                                                    const std::vector<double>& bias, const std::vector<double>& z,
                                                    const std::vector<int>& seq, const std::vector<double>& init,
                                                    std::vector<double>* final_state) {
  const long GN = s.G * s.N, cpg = s.E / s.G;
  std::vector<double> out(s.B * s.L * s.E, 0.0);
  if (final_state) final_state->assign(s.B * s.E * s.N, 0.0);
  for (long b = 0; b < s.B; ++b)
    for (long d = 0; d < s.E; ++d) {
      const long g = d / cpg;
      std::vector<double> h(s.N, 0.0);
      if (!init.empty())
        for (long n = 0; n < s.N; ++n) h[n] = init[(b * s.E + d) * s.N + n];
      for (long t = 0; t < s.L; ++t) {
        const long r = b * s.L + t;
        if (!seq.empty() && t > 0 && seq[r] != seq[r - 1]) h.assign(s.N, 0.0);
        const double dl = m1_softplus(delta[r * s.E + d] + bias[d]);
        const double uu = u[r * s.E + d];
        double y = 0;
        for (long n = 0; n < s.N; ++n) {
          h[n] = std::exp(dl * A[d * s.N + n]) * h[n] + dl * bc[r * 2 * GN + g * s.N + n] * uu;
          y += bc[r * 2 * GN + GN + g * s.N + n] * h[n];
        }
        y += D[d] * uu;
        if (!z.empty()) y *= m1_silu(z[r * s.E + d]);
        out[r * s.E + d] = y;
      }
      if (final_state)
        for (long n = 0; n < s.N; ++n) (*final_state)[(b * s.E + d) * s.N + n] = h[n];
    }
  return out;
}

struct Mamba1RefShape {
  long B, L, D, E, N, R, W;
};

// u (B*L, D); weights in PyTorch shapes: in_proj (2E, D), conv (E, W), conv_b (E), x_proj (R+2N, E), dt_w (E, R),
// dt_b (E), A_log (E*N), Dskip (E), out_proj (D, E). seq (B*L) or empty.
inline std::vector<double> mamba1_reference(const Mamba1RefShape& s, const std::vector<double>& u,
                                            const std::vector<double>& in_proj, const std::vector<double>& conv_w,
                                            const std::vector<double>& conv_b, const std::vector<double>& x_proj,
                                            const std::vector<double>& dt_w, const std::vector<double>& dt_b,
                                            const std::vector<double>& A_log, const std::vector<double>& Dskip,
                                            const std::vector<double>& out_proj, const std::vector<int>& seq) {
  const long n = s.B * s.L, X = s.R + 2 * s.N;
  auto matmul = [&](const std::vector<double>& x, long in, const std::vector<double>& w, long outc, long w_row0) {
    std::vector<double> y(n * outc, 0.0);
    for (long i = 0; i < n; ++i)
      for (long o = 0; o < outc; ++o) {
        double acc = 0;
        for (long k = 0; k < in; ++k) acc += x[i * in + k] * w[(w_row0 + o) * in + k];
        y[i * outc + o] = acc;
      }
    return y;
  };
  const auto xz = matmul(u, s.D, in_proj, 2 * s.E, 0);
  std::vector<double> xc(n * s.E), z(n * s.E);
  for (long b = 0; b < s.B; ++b)
    for (long t = 0; t < s.L; ++t) {
      const long r = b * s.L + t;
      for (long c = 0; c < s.E; ++c) {
        double acc = conv_b[c];
        for (long k = 0; k < s.W; ++k) {
          const long src = t - (s.W - 1) + k;
          if (src < 0) continue;
          if (!seq.empty() && seq[b * s.L + src] != seq[r]) continue;
          acc += conv_w[c * s.W + k] * xz[(b * s.L + src) * 2 * s.E + c];
        }
        xc[r * s.E + c] = m1_silu(acc);
        z[r * s.E + c] = xz[r * 2 * s.E + s.E + c];
      }
    }
  const auto xdbl = matmul(xc, s.E, x_proj, X, 0);
  std::vector<double> dt_low(n * s.R), bc(n * 2 * s.N);
  for (long i = 0; i < n; ++i) {
    for (long k = 0; k < s.R; ++k) dt_low[i * s.R + k] = xdbl[i * X + k];
    for (long k = 0; k < 2 * s.N; ++k) bc[i * 2 * s.N + k] = xdbl[i * X + s.R + k];
  }
  const auto delta = matmul(dt_low, s.R, dt_w, s.E, 0);
  std::vector<double> A(s.E * s.N);
  for (long i = 0; i < s.E * s.N; ++i) A[i] = -std::exp(A_log[i]);
  const auto y = selective_scan_reference({s.B, s.L, s.E, 1, s.N}, xc, delta, A, bc, Dskip, dt_b, z, seq, {},
                                          nullptr);
  return matmul(y, s.E, out_proj, s.D, 0);
}

}  // namespace mmref
