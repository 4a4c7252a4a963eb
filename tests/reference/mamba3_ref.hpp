// Naive double-precision references of Mamba-3 (mamba_ssm's Mamba3, SISO and MIMO rank R):
//
//   * mamba3_scan_reference: the token-by-token step recurrence (what mamba3_siso_step_ref / the MIMO step ref do),
//       Delta_t = softplus(dd_dt + dt_bias_h)          A_t = -max(heavy_tail(dd_A), A_floor)
//       lambda_t = sigmoid(trap_t)    alpha = exp(A Delta)   beta = (1 - lambda) Delta alpha   gamma = lambda Delta
//       phi_t = (phi_{t-1} + pi tanh(theta_t) Delta_t) mod 2 pi     (per head, S angles shared by the heads)
//       q_{t,r} = R(phi_t) (C_{t,r} + C_bias_{h,r}),   k_{t,r} = R(phi_t) (B_{t,r} + B_bias_{h,r}),   v_{t,r}
//       S_t = alpha S_{t-1} + beta sum_r v_{t-1,r} k_{t-1,r}^T + gamma sum_r v_{t,r} k_{t,r}^T
//       y_{t,r} = S_t q_{t,r} + D_h v_{t,r}
//     with the decode carry (phi, S, k_prev, v_prev) as initial and final state;
//   * mamba3_quadratic_reference: the same outputs from the chunked ("dual") form over the whole sequence as one
//     chunk (what mamba3_siso_fwd_ref does): per-token weights scale_t = gamma_t + gamma'_t, gamma'_t =
//     Delta_{t+1}(1 - lambda_{t+1}), and the diagonal with gamma_t only. It checks the algebra the chunked kernel
//     relies on, independently of the kernel;
//   * mamba3_mixer_reference: in_proj, RMSNorm of B and C, the MIMO up-projection, the scan, the gate (silu(z) or
//     the per-head norm-before-gate RMSNorm), the MIMO down-projection and out_proj.
//
// Layouts (row r = b * L + t): v (B*L, H*R*P) at (h*R + r)*P + p; qk (B*L, 2*R*G*N) with q (= C) at (r*G + g)*N + n
// and k (= B) at R*G*N + (r*G + g)*N + n, both RMS-normalised but without the bias; dd (B*L, 3H + S) =
// [dd_dt (H) | dd_A (H) | trap (H) | angles (S)]. Biases (H, R, N). Carry: phi (B,H,S), S (B,H,P,N),
// k (B,H,R,N) (rotated, biased), v (B,H,R,P). Rotary pairs: interleaved (2i, 2i+1) or halved (i, i + N/2), i < S.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

namespace mmref {

struct M3Shape {
  long B = 1, L = 1, H = 1, P = 1, G = 1, N = 2, R = 1, S = 0;
  bool halved = false;
  double A_floor = 1e-4;
  std::vector<int> seq;  // (B, L) record ids, or empty: at a new record the recurrence restarts from a zero carry
};

// token t of row b starts a record (t > 0 and its record id differs from token t-1's)
inline bool m3_new_record(const M3Shape& s, long b, long t) {
  return t > 0 && !s.seq.empty() && s.seq[b * s.L + t] != s.seq[b * s.L + t - 1];
}

struct M3Carry {
  std::vector<double> phi, S, k, v;  // empty = zero
};

inline double m3_softplus(double x) { return x > 20 ? x : std::log1p(std::exp(x)); }
inline double m3_sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
inline double m3_silu(double x) { return x * m3_sigmoid(x); }
inline double heavy_tail(double x) { return x >= 0 ? 1.0 + x : 1.0 / (1.0 - x); }

// Rotate the N-vector x (in place) by the S phases ph.
inline void m3_rotate(double* x, const double* ph, long N, long S, bool halved) {
  for (long i = 0; i < S; ++i) {
    const long i0 = halved ? i : 2 * i, i1 = halved ? i + N / 2 : 2 * i + 1;
    const double c = std::cos(ph[i]), s = std::sin(ph[i]);
    const double a = x[i0], b = x[i1];
    x[i0] = a * c - b * s;
    x[i1] = a * s + b * c;
  }
}

struct M3Token {  // per-token scalars of one head
  double delta, A, lam, alpha, beta, gamma;
};

inline M3Token m3_token(const M3Shape& s, const std::vector<double>& dd, const std::vector<double>& dt_bias, long row,
                        long h) {
  const long W = 3 * s.H + s.S;
  M3Token k;
  k.delta = m3_softplus(dd[row * W + h] + dt_bias[h]);
  k.A = -std::max(heavy_tail(dd[row * W + s.H + h]), s.A_floor);
  k.lam = m3_sigmoid(dd[row * W + 2 * s.H + h]);
  k.alpha = std::exp(k.A * k.delta);
  k.beta = (1 - k.lam) * k.delta * k.alpha;
  k.gamma = k.lam * k.delta;
  return k;
}

// Phases, rotated q and k of all tokens of head h of batch row b: phi (L, S), q and k (L, R, N).
inline void m3_rotated(const M3Shape& s, const std::vector<double>& qk, const std::vector<double>& dd,
                       const std::vector<double>& dt_bias, const std::vector<double>& q_bias,
                       const std::vector<double>& k_bias, const M3Carry& init, long b, long h,
                       std::vector<double>& phi, std::vector<double>& q, std::vector<double>& k) {
  const long W = 3 * s.H + s.S, RGN = s.R * s.G * s.N, g = h / (s.H / s.G);
  const double pi = 3.14159265358979323846;
  phi.assign(s.L * s.S, 0.0);
  q.assign(s.L * s.R * s.N, 0.0);
  k.assign(s.L * s.R * s.N, 0.0);
  std::vector<double> ph(s.S, 0.0);
  if (!init.phi.empty())
    for (long i = 0; i < s.S; ++i) ph[i] = init.phi[(b * s.H + h) * s.S + i];
  for (long t = 0; t < s.L; ++t) {
    const long row = b * s.L + t;
    const M3Token tk = m3_token(s, dd, dt_bias, row, h);
    if (m3_new_record(s, b, t)) std::fill(ph.begin(), ph.end(), 0.0);
    for (long i = 0; i < s.S; ++i) {
      double p = ph[i] + pi * std::tanh(dd[row * W + 3 * s.H + i]) * tk.delta;
      p -= 2 * pi * std::floor(p / (2 * pi));
      ph[i] = p;
      phi[t * s.S + i] = p;
    }
    for (long r = 0; r < s.R; ++r) {
      double* qr = &q[(t * s.R + r) * s.N];
      double* kr = &k[(t * s.R + r) * s.N];
      for (long n = 0; n < s.N; ++n) {
        qr[n] = qk[row * 2 * RGN + (r * s.G + g) * s.N + n] + q_bias[(h * s.R + r) * s.N + n];
        kr[n] = qk[row * 2 * RGN + RGN + (r * s.G + g) * s.N + n] + k_bias[(h * s.R + r) * s.N + n];
      }
      m3_rotate(qr, ph.data(), s.N, s.S, s.halved);
      m3_rotate(kr, ph.data(), s.N, s.S, s.halved);
    }
  }
}

// Token-by-token recurrence. Returns y (B*L, H*R*P); writes the final carry when `fin` is given.
inline std::vector<double> mamba3_scan_reference(const M3Shape& s, const std::vector<double>& v,
                                                 const std::vector<double>& qk, const std::vector<double>& dd,
                                                 const std::vector<double>& dt_bias, const std::vector<double>& D,
                                                 const std::vector<double>& q_bias, const std::vector<double>& k_bias,
                                                 const M3Carry& init, M3Carry* fin) {
  const long HRP = s.H * s.R * s.P;
  std::vector<double> y(s.B * s.L * HRP, 0.0);
  if (fin) {
    fin->phi.assign(s.B * s.H * s.S, 0.0);
    fin->S.assign(s.B * s.H * s.P * s.N, 0.0);
    fin->k.assign(s.B * s.H * s.R * s.N, 0.0);
    fin->v.assign(s.B * s.H * s.R * s.P, 0.0);
  }
  for (long b = 0; b < s.B; ++b)
    for (long h = 0; h < s.H; ++h) {
      std::vector<double> phi, q, k;
      m3_rotated(s, qk, dd, dt_bias, q_bias, k_bias, init, b, h, phi, q, k);
      const long bh = b * s.H + h;
      std::vector<double> S(s.P * s.N, 0.0), kp(s.R * s.N, 0.0), vp(s.R * s.P, 0.0);
      if (!init.S.empty()) std::copy(init.S.begin() + bh * s.P * s.N, init.S.begin() + (bh + 1) * s.P * s.N, S.begin());
      if (!init.k.empty()) std::copy(init.k.begin() + bh * s.R * s.N, init.k.begin() + (bh + 1) * s.R * s.N, kp.begin());
      if (!init.v.empty()) std::copy(init.v.begin() + bh * s.R * s.P, init.v.begin() + (bh + 1) * s.R * s.P, vp.begin());
      for (long t = 0; t < s.L; ++t) {
        const long row = b * s.L + t;
        const M3Token tk = m3_token(s, dd, dt_bias, row, h);
        const double* vt = &v[row * HRP + h * s.R * s.P];
        const double* kt = &k[t * s.R * s.N];
        const double* qt = &q[t * s.R * s.N];
        if (m3_new_record(s, b, t)) {  // a fresh sequence: zero S, k_prev, v_prev
          std::fill(S.begin(), S.end(), 0.0);
          std::fill(kp.begin(), kp.end(), 0.0);
          std::fill(vp.begin(), vp.end(), 0.0);
        }
        for (long p = 0; p < s.P; ++p)
          for (long n = 0; n < s.N; ++n) {
            double add = 0;
            for (long r = 0; r < s.R; ++r)
              add += tk.beta * vp[r * s.P + p] * kp[r * s.N + n] + tk.gamma * vt[r * s.P + p] * kt[r * s.N + n];
            S[p * s.N + n] = tk.alpha * S[p * s.N + n] + add;
          }
        for (long r = 0; r < s.R; ++r)
          for (long p = 0; p < s.P; ++p) {
            double acc = 0;
            for (long n = 0; n < s.N; ++n) acc += S[p * s.N + n] * qt[r * s.N + n];
            y[row * HRP + (h * s.R + r) * s.P + p] = acc + D[h] * vt[r * s.P + p];
          }
        std::copy(kt, kt + s.R * s.N, kp.begin());
        std::copy(vt, vt + s.R * s.P, vp.begin());
      }
      if (fin) {
        for (long i = 0; i < s.S; ++i) fin->phi[bh * s.S + i] = s.L > 0 ? phi[(s.L - 1) * s.S + i] : 0.0;
        std::copy(S.begin(), S.end(), fin->S.begin() + bh * s.P * s.N);
        std::copy(kp.begin(), kp.end(), fin->k.begin() + bh * s.R * s.N);
        std::copy(vp.begin(), vp.end(), fin->v.begin() + bh * s.R * s.P);
      }
    }
  return y;
}

// The chunked ("dual") form with the whole sequence as one chunk:
//   y_{t,r} = D v_{t,r} + exp(Acs_t) S0 q_{t,r} + sum_{s<t} exp(Acs_t - Acs_s) scale_s sum_r' (q_{t,r}.k_{s,r'}) v_{s,r'}
//             + gamma_t sum_r' (q_{t,r}.k_{t,r'}) v_{t,r'}
// with S0 = S_init + Delta_0 (1 - lambda_0) sum_r v_prev,r k_prev,r^T and Acs_t = sum_{j<=t} A_j Delta_j.
inline std::vector<double> mamba3_quadratic_reference(const M3Shape& s, const std::vector<double>& v,
                                                      const std::vector<double>& qk, const std::vector<double>& dd,
                                                      const std::vector<double>& dt_bias, const std::vector<double>& D,
                                                      const std::vector<double>& q_bias,
                                                      const std::vector<double>& k_bias, const M3Carry& init) {
  const long HRP = s.H * s.R * s.P;
  std::vector<double> y(s.B * s.L * HRP, 0.0);
  for (long b = 0; b < s.B; ++b)
    for (long h = 0; h < s.H; ++h) {
      std::vector<double> phi, q, k;
      m3_rotated(s, qk, dd, dt_bias, q_bias, k_bias, init, b, h, phi, q, k);
      const long bh = b * s.H + h;
      std::vector<M3Token> tk(s.L);
      std::vector<double> acs(s.L), scale(s.L);
      double run = 0;
      for (long t = 0; t < s.L; ++t) {
        tk[t] = m3_token(s, dd, dt_bias, b * s.L + t, h);
        run += tk[t].A * tk[t].delta;
        acs[t] = run;
      }
      for (long t = 0; t < s.L; ++t)
        scale[t] = tk[t].gamma + (t + 1 < s.L ? tk[t + 1].delta * (1 - tk[t + 1].lam) : 0.0);
      std::vector<double> S0(s.P * s.N, 0.0);
      if (!init.S.empty()) std::copy(init.S.begin() + bh * s.P * s.N, init.S.begin() + (bh + 1) * s.P * s.N, S0.begin());
      if (!init.k.empty() && !init.v.empty()) {
        const double gp = tk[0].delta * (1 - tk[0].lam);
        for (long r = 0; r < s.R; ++r)
          for (long p = 0; p < s.P; ++p)
            for (long n = 0; n < s.N; ++n)
              S0[p * s.N + n] += gp * init.v[(bh * s.R + r) * s.P + p] * init.k[(bh * s.R + r) * s.N + n];
      }
      for (long t = 0; t < s.L; ++t) {
        const long row = b * s.L + t;
        for (long r = 0; r < s.R; ++r) {
          const double* qt = &q[(t * s.R + r) * s.N];
          for (long p = 0; p < s.P; ++p) {
            double acc = D[h] * v[row * HRP + (h * s.R + r) * s.P + p];
            double sq = 0;
            for (long n = 0; n < s.N; ++n) sq += S0[p * s.N + n] * qt[n];
            acc += std::exp(acs[t]) * sq;
            for (long s2 = 0; s2 <= t; ++s2) {
              const double coef = s2 < t ? std::exp(acs[t] - acs[s2]) * scale[s2] : tk[t].gamma;
              for (long r2 = 0; r2 < s.R; ++r2) {
                const double* ks = &k[(s2 * s.R + r2) * s.N];
                double dot = 0;
                for (long n = 0; n < s.N; ++n) dot += qt[n] * ks[n];
                acc += coef * dot * v[(b * s.L + s2) * HRP + (h * s.R + r2) * s.P + p];
              }
            }
            y[row * HRP + (h * s.R + r) * s.P + p] = acc;
          }
        }
      }
    }
  return y;
}

// The mixer. Weights in PyTorch shapes: in_proj (2E + 2RGN + 3H + S, D) with output columns
// [z (E) | x (E) | B (R G N) | C (R G N) | dd_dt (H) | dd_A (H) | trap (H) | angles (S)]; B_norm, C_norm (N);
// B_bias, C_bias (H,R,N); mimo_x, mimo_z, mimo_o (H,R,P) (empty for SISO); norm (E) or empty (gate silu(z) only);
// out_proj (D, E).
struct M3MixerShape {
  M3Shape s;
  long D = 1;
  double eps = 1e-5;
};

inline std::vector<double> mamba3_mixer_reference(
    const M3MixerShape& ms, const std::vector<double>& u, const std::vector<double>& in_proj,
    const std::vector<double>& dt_bias, const std::vector<double>& Dskip, const std::vector<double>& B_norm,
    const std::vector<double>& C_norm, const std::vector<double>& B_bias, const std::vector<double>& C_bias,
    const std::vector<double>& mimo_x, const std::vector<double>& mimo_z, const std::vector<double>& mimo_o,
    const std::vector<double>& norm_w, const std::vector<double>& out_proj, const M3Carry& init, M3Carry* fin) {
  const M3Shape& s = ms.s;
  const long n = s.B * s.L, E = s.H * s.P, RGN = s.R * s.G * s.N, Z = 2 * E + 2 * RGN + 3 * s.H + s.S;
  std::vector<double> zx(n * Z);
  for (long i = 0; i < n; ++i)
    for (long o = 0; o < Z; ++o) {
      double acc = 0;
      for (long j = 0; j < ms.D; ++j) acc += u[i * ms.D + j] * in_proj[o * ms.D + j];
      zx[i * Z + o] = acc;
    }
  // RMSNorm of each N-group of B and C; qk = [C | B]
  std::vector<double> qk(n * 2 * RGN), dd(n * (3 * s.H + s.S)), v(n * s.H * s.R * s.P);
  for (long i = 0; i < n; ++i) {
    for (long part = 0; part < 2; ++part) {  // 0: C -> q, 1: B -> k
      const long src = 2 * E + (part == 0 ? RGN : 0);
      const std::vector<double>& w = part == 0 ? C_norm : B_norm;
      for (long grp = 0; grp < s.R * s.G; ++grp) {
        double ss = 0;
        for (long j = 0; j < s.N; ++j) ss += zx[i * Z + src + grp * s.N + j] * zx[i * Z + src + grp * s.N + j];
        const double r = 1.0 / std::sqrt(ss / s.N + ms.eps);
        for (long j = 0; j < s.N; ++j)
          qk[i * 2 * RGN + part * RGN + grp * s.N + j] = zx[i * Z + src + grp * s.N + j] * r * w[j];
      }
    }
    for (long c = 0; c < 3 * s.H + s.S; ++c) dd[i * (3 * s.H + s.S) + c] = zx[i * Z + 2 * E + 2 * RGN + c];
    for (long h = 0; h < s.H; ++h)
      for (long r = 0; r < s.R; ++r)
        for (long p = 0; p < s.P; ++p)
          v[i * s.H * s.R * s.P + (h * s.R + r) * s.P + p] =
              zx[i * Z + E + h * s.P + p] * (mimo_x.empty() ? 1.0 : mimo_x[(h * s.R + r) * s.P + p]);
  }
  const auto y = mamba3_scan_reference(s, v, qk, dd, dt_bias, Dskip, C_bias, B_bias, init, fin);
  std::vector<double> yo(n * E, 0.0);
  for (long i = 0; i < n; ++i)
    for (long h = 0; h < s.H; ++h)
      for (long r = 0; r < s.R; ++r) {
        const double* yr = &y[i * s.H * s.R * s.P + (h * s.R + r) * s.P];
        double rs = 1;
        if (!norm_w.empty()) {
          double ss = 0;
          for (long p = 0; p < s.P; ++p) ss += yr[p] * yr[p];
          rs = 1.0 / std::sqrt(ss / s.P + ms.eps);
        }
        for (long p = 0; p < s.P; ++p) {
          const long hrp = (h * s.R + r) * s.P + p;
          const double zz = zx[i * Z + h * s.P + p] * (mimo_z.empty() ? 1.0 : mimo_z[hrp]);
          const double g = norm_w.empty() ? yr[p] * m3_silu(zz) : yr[p] * rs * norm_w[h * s.P + p] * m3_silu(zz);
          yo[i * E + h * s.P + p] += (mimo_o.empty() ? 1.0 : mimo_o[hrp]) * g;
        }
      }
  std::vector<double> out(n * ms.D);
  for (long i = 0; i < n; ++i)
    for (long o = 0; o < ms.D; ++o) {
      double acc = 0;
      for (long j = 0; j < E; ++j) acc += yo[i * E + j] * out_proj[o * E + j];
      out[i * ms.D + o] = acc;
    }
  return out;
}

}  // namespace mmref
