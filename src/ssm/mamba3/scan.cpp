#include "ssm/mamba3/scan.hpp"
#include "ssm/mamba3/rotary.hpp"
#include "ssm/mamba3/rotate_cuda.hpp"

#include "core/error.hpp"
#include "core/pool.hpp"
#include "tensor/ops.hpp"

namespace mm {

void Mamba3ScanShape::validate(const char* where) const {
  require(batch > 0 && seqlen > 0, where, "batch (", batch, ") and seqlen (", seqlen, ") must be positive");
  require(nheads > 0 && headdim > 0 && dstate > 0 && rank > 0 && chunk > 0, where,
          "nheads (", nheads, "), headdim (", headdim, "), dstate (", dstate, "), rank (", rank, ") and chunk (",
          chunk, ") must be positive");
  require(ngroups > 0 && nheads % ngroups == 0, where, "nheads (", nheads, ") is not divisible by ngroups (",
          ngroups, ")");
  require(nangles >= 0 && 2 * nangles <= dstate, where, "nangles (", nangles, ") rotary pairs do not fit in dstate (",
          dstate, ")");
  require(pairing != RopePairing::halved || nangles == 0 || dstate % 2 == 0, where,
          "halved rotary pairs need an even dstate (got ", dstate, ")");
  require(A_floor >= 0, where, "A_floor (", A_floor, ") must be non-negative");
}

RotBwdForm rot_bwd_form = RotBwdForm::automatic;
RotFwdForm rot_fwd_form = RotFwdForm::automatic;
QkStore qk_store = QkStore::automatic;

bool Mamba3ScanShape::via_ssd() const {
  if (rank != 1 || algo == SSDAlgo::portable) return false;
  if (algo != SSDAlgo::automatic) return true;
  // automatic: through the SSD on CUDA (as ssd_resolved_algo picks there), this file's own kernels on host builds
#if defined(KOKKOS_ENABLE_CUDA)
  return std::is_same_v<Exec, Kokkos::Cuda>;
#else
  return false;
#endif
}

// (scan.hpp)
SSDShape mamba3_ssd_shape(const Mamba3ScanShape& s) {
  SSDShape sh;
  sh.batch = s.batch;
  sh.seqlen = s.seqlen;
  sh.nheads = s.nheads;
  sh.headdim = s.headdim;
  sh.ngroups = s.nheads;  // q~ and k~ are per head (biases, phases)
  sh.dstate = s.dstate;
  sh.chunk = s.chunk;
  sh.algo = s.algo;
  sh.compute = s.compute;
  return sh;
}

bool mamba3_qk_bf16(const Mamba3ScanShape& s, bool float_acts, bool rows_ok) {
  if (qk_store != QkStore::automatic || !float_acts || !rows_ok || !s.via_ssd() || s.dstate % 8 != 0) return false;
  const SSDShape sh = mamba3_ssd_shape(s);
  return ssd_bc_bf16_applies(sh) && ssd_bc_in_bf16_applies(sh);
}

namespace {

template <class P>
KOKKOS_INLINE_FUNCTION P heavy_tail(P x) {
  return x >= P(0) ? P(1) + x : P(1) / (P(1) - x);
}
template <class P>
KOKKOS_INLINE_FUNCTION P dheavy_tail(P x) {
  return x >= P(0) ? P(1) : P(1) / ((P(1) - x) * (P(1) - x));
}

// Everything a kernel needs, copied by value into the lambdas.
template <class T>
struct Ctx {
  using P = acc_t<T>;
  View2<const T> v, qk, dd;
  index_t v_col, q_col, k_col, dt_col, A_col, trap_col, angle_col;
  View1<const P> dt_bias, D, q_bias, k_bias;
  SeqIdxView seq;  // (batch, L) or empty
  bool has_seq;
  index_t Bsz, L, H, Pd, G, N, R, S, Q, nc, hpg;
  bool halved;
  P A_floor;
  View3<P> delta, lam, Av, acs, w;  // (batch, H, L): Delta, lambda, A_t, in-chunk cumsum of A Delta, weight w
  View3<P> ad;                      // (batch, H, L): A_t Delta_t (the SSD route's decay exponents), else empty
  View4<P> phi;                     // (batch, H, L, S)
  // (batch * L, ld): rotated, biased q at q_off + (h R + r) N + n and k at k_off + ...; the SSD route also copies
  // v to columns h P + p (its x, before k (its B) and q (its C)); the backward's gradients use the same layout
  View2<P> qkv;
  View2<bf16_op_t> qkv16;  // the same in bf16 in place of qkv (then empty), where mamba3_qk_bf16 (SSD route only)
  index_t q_off, k_off;
  bool ssd;
  // SSD route (used where quads_ok): q~ . k~ per (row, head), formed by the rotation for the diagonal's passes,
  // and the backward's (gamma_t - w_t) (dy . v) per (row, head), applied to dq~ and dk~ by the rotation's backward
  View2<P> qkd, fdv;
  View5<P> states;                  // (batch, nchunks, H, P, N): chunk-local states, then the state entering

  KOKKOS_INLINE_FUNCTION index_t row(index_t b, index_t t) const { return b * L + t; }
  // tokens t and s of row b belong to the same record
  KOKKOS_INLINE_FUNCTION bool same(index_t b, index_t t, index_t s) const { return !has_seq || seq(b, t) == seq(b, s); }
  // the token whose record owns the state entering chunk ch (the initial carry belongs to token 0's record)
  KOKKOS_INLINE_FUNCTION index_t in_tok(index_t ch) const { return ch > 0 ? ch * Q - 1 : 0; }
  KOKKOS_INLINE_FUNCTION index_t chunk_end(index_t c) const { return (c + 1) * Q < L ? (c + 1) * Q : L; }
  KOKKOS_INLINE_FUNCTION void decode(index_t id, index_t& b, index_t& ch, index_t& h) const {
    h = id % H;
    ch = (id / H) % nc;
    b = id / (H * nc);
  }
  KOKKOS_INLINE_FUNCTION void pair(index_t i, index_t& i0, index_t& i1) const {
    i0 = halved ? i : 2 * i;
    i1 = halved ? i + N / 2 : 2 * i + 1;
  }
  // State dimension n: false if it is not rotated, else its angle i, the other member m of its pair and whether n
  // is the pair's first member (pair(i) = (n, m)) or its second ((m, n)).
  KOKKOS_INLINE_FUNCTION bool partner(index_t n, index_t& i, index_t& m, bool& first) const {
    if (halved) {
      first = n < N / 2;
      i = first ? n : n - N / 2;
      m = first ? n + N / 2 : n - N / 2;
    } else {
      first = n % 2 == 0;
      i = n / 2;
      m = first ? n + 1 : n - 1;
    }
    return i < S;
  }
  KOKKOS_INLINE_FUNCTION P gamma(index_t b, index_t h, index_t t) const { return lam(b, h, t) * delta(b, h, t); }
  // rows of length P (v of rank r) and N (rotated q, k of rank r) of token t, head h
  KOKKOS_INLINE_FUNCTION const T* vrow(index_t rw, index_t h, index_t r) const {
    return &v(rw, v_col + (h * R + r) * Pd);
  }
  KOKKOS_INLINE_FUNCTION const P* qrow(index_t rw, index_t h, index_t r) const {
    return &qkv(rw, q_off + (h * R + r) * N);
  }
  KOKKOS_INLINE_FUNCTION const P* krow(index_t rw, index_t h, index_t r) const {
    return &qkv(rw, k_off + (h * R + r) * N);
  }
  // element n of the rotated, biased q and k of row rw (position t), head h, rank r, from the inputs and phases:
  // the rotation's row kernel, and the final carry's k~ where [k~ | q~] is stored in bf16. With the pair (i0, i1)
  // of n: out_i0 = x_i0 cos - x_i1 sin, out_i1 = x_i0 sin + x_i1 cos.
  KOKKOS_INLINE_FUNCTION void rot_qk(index_t rw, index_t t, index_t h, index_t r, index_t n, P& qo, P& ko) const {
    const index_t g = h / hpg, hr = h * R + r;
    const T* qin = &qk(rw, q_col + (r * G + g) * N);
    const T* kin = &qk(rw, k_col + (r * G + g) * N);
    const P* qb = &q_bias(hr * N);
    const P* kb = &k_bias(hr * N);
    const P qn = P(qin[n]) + qb[n], kn = P(kin[n]) + kb[n];
    index_t ai, m;
    bool first;
    if (!partner(n, ai, m, first)) {
      qo = qn;
      ko = kn;
      return;
    }
    P cs, sn;
    sin_cos(phi(rw / L, h, t, ai), sn, cs);
    const P qm = P(qin[m]) + qb[m], km = P(kin[m]) + kb[m];
    qo = first ? qn * cs - qm * sn : qm * sn + qn * cs;
    ko = first ? kn * cs - km * sn : km * sn + kn * cs;
  }
};

// Whether the quad kernels apply to c: float, rank 1, N and Pd multiples of 4 (halved pairs: N a multiple of 8),
// every column offset and row stride a multiple of 4 floats and every row 16-byte aligned; `more` are further
// (first row, row stride) pairs to check.
template <class T>
bool quads_ok(const Ctx<T>& c, std::initializer_list<std::pair<const void*, long long>> more = {}) {
  if constexpr (!std::is_same_v<T, float>) {
    return false;
  } else {
    if (c.R != 1 || c.N % 4 != 0 || c.Pd % 4 != 0 || (c.halved && c.N % 8 != 0) || c.q_col % 4 != 0 ||
        c.k_col % 4 != 0 || c.v_col % 4 != 0 || c.q_off % 4 != 0 || c.k_off % 4 != 0)
      return false;
    for (const auto& [p, ld] : more)
      if (!float4_rows({{p, ld}})) return false;
    return float4_rows({{c.qk.data(), c.qk.stride(0)}, {c.v.data(), c.v.stride(0)}, {c.qkv.data(), c.qkv.stride(0)},
                        {c.q_bias.data(), 0}, {c.k_bias.data(), 0}});
  }
}

// The call's context. Its per-token quantities, phases, [k~ | q~] and q~ . k~ come from `kept` where given
// (non-empty; the caller then skips `recompute`), else from `keep_pool` where given (the forward keeping them),
// else from the call's pool ws. `bf16_qk`: [k~ | q~] in bf16 (qkv16) where mamba3_qk_bf16 holds (the forward;
// a backward that recomputes keeps fp32, which the SSD's recomputation reads).
template <class T>
Ctx<T> make_ctx(const Mamba3ScanShape& s, const Mamba3ScanIn<T>& in, PoolScope& ws, PoolScope* keep_pool = nullptr,
                const Mamba3ScanSaved<T>* kept = nullptr, bool bf16_qk = false) {
  using P = acc_t<T>;
  s.validate("mamba3_scan");
  const index_t rows = s.batch * s.seqlen;
  require(index_t(in.v.extent(0)) == rows && index_t(in.qk.extent(0)) == rows && index_t(in.dd.extent(0)) == rows,
          "mamba3_scan", "inputs have ", in.v.extent(0), ", ", in.qk.extent(0), " and ", in.dd.extent(0),
          " rows, expected batch * seqlen = ", rows);
  require(index_t(in.v.extent(1)) >= in.v_col + s.nheads * s.rank * s.headdim, "mamba3_scan",
          "v has ", in.v.extent(1), " columns, too few for column ", in.v_col, " + H*R*P = ",
          s.nheads * s.rank * s.headdim);
  const index_t RGN = s.rank * s.ngroups * s.dstate;
  require(index_t(in.qk.extent(1)) >= in.q_col + RGN && index_t(in.qk.extent(1)) >= in.k_col + RGN, "mamba3_scan",
          "qk has ", in.qk.extent(1), " columns, too few for R*G*N = ", RGN);
  require(index_t(in.dd.extent(1)) >= in.angle_col + s.nangles, "mamba3_scan", "dd has too few columns");
  const index_t HRN = s.nheads * s.rank * s.dstate;
  require(index_t(in.dt_bias.extent(0)) == s.nheads && index_t(in.D.extent(0)) == s.nheads &&
              index_t(in.q_bias.extent(0)) == HRN && index_t(in.k_bias.extent(0)) == HRN,
          "mamba3_scan", "dt_bias and D must have nheads = ", s.nheads, " entries and the biases H*R*N = ", HRN);
  if (!in.init.empty())
    require(index_t(in.init.S.extent(0)) == s.batch && index_t(in.init.S.extent(1)) == s.nheads &&
                index_t(in.init.S.extent(2)) == s.headdim && index_t(in.init.S.extent(3)) == s.dstate &&
                index_t(in.init.k.extent(2)) == s.rank && index_t(in.init.v.extent(2)) == s.rank &&
                index_t(in.init.phi.extent(2)) == s.nangles,
            "mamba3_scan", "initial carry does not match (batch ", s.batch, ", nheads ", s.nheads, ", headdim ",
            s.headdim, ", dstate ", s.dstate, ", rank ", s.rank, ", nangles ", s.nangles, ")");
  require(in.seq_idx.extent(0) == 0 ||
              (index_t(in.seq_idx.extent(0)) == s.batch && index_t(in.seq_idx.extent(1)) == s.seqlen),
          "mamba3_scan", "seq_idx is (", in.seq_idx.extent(0), ", ", in.seq_idx.extent(1),
          "), expected (batch, seqlen) = (", s.batch, ", ", s.seqlen, ")");
  Ctx<T> c;
  c.seq = in.seq_idx;
  c.has_seq = in.seq_idx.extent(0) > 0;
  c.v = in.v;
  c.qk = in.qk;
  c.dd = in.dd;
  c.v_col = in.v_col;
  c.q_col = in.q_col;
  c.k_col = in.k_col;
  c.dt_col = in.dt_col;
  c.A_col = in.A_col;
  c.trap_col = in.trap_col;
  c.angle_col = in.angle_col;
  c.dt_bias = in.dt_bias;
  c.D = in.D;
  c.q_bias = in.q_bias;
  c.k_bias = in.k_bias;
  c.Bsz = s.batch;
  c.L = s.seqlen;
  c.H = s.nheads;
  c.Pd = s.headdim;
  c.G = s.ngroups;
  c.N = s.dstate;
  c.R = s.rank;
  c.S = s.nangles;
  c.Q = s.chunk;
  c.nc = s.nchunks();
  c.hpg = s.nheads / s.ngroups;
  c.halved = s.pairing == RopePairing::halved;
  c.A_floor = P(s.A_floor);
  c.ssd = s.via_ssd();
  // qkv: [k~ | q~] (the SSD route reads v, its x, straight out of the input: SSDIn::x)
  c.k_off = 0;
  c.q_off = HRN;
  if (kept && !kept->empty()) {
    const bool k16 = kept->qkv16.extent(0) > 0;
    const index_t qr = k16 ? index_t(kept->qkv16.extent(0)) : index_t(kept->qkv.extent(0)),
                  qc = k16 ? index_t(kept->qkv16.extent(1)) : index_t(kept->qkv.extent(1));
    require(c.ssd && qr == rows && qc == 2 * HRN &&
                index_t(kept->delta.extent(0)) == s.batch && index_t(kept->delta.extent(1)) == s.nheads &&
                index_t(kept->delta.extent(2)) == s.seqlen && index_t(kept->phi.extent(3)) == s.nangles,
            "mamba3_scan", "the kept forward context does not match this call's shape");
    c.delta = kept->delta;
    c.lam = kept->lam;
    c.Av = kept->Av;
    c.w = kept->w;
    c.ad = kept->ad;
    c.phi = kept->phi;
    c.qkv = kept->qkv;
    c.qkv16 = kept->qkv16;
    c.qkd = kept->qkd;
  } else {
    PoolScope& kp = keep_pool ? *keep_pool : ws;
    auto v3 = [&](const std::string& l) { return kp.take<View3<P>>(l, s.batch, s.nheads, s.seqlen); };
    c.delta = v3("mamba3::delta");
    c.lam = v3("mamba3::lambda");
    c.Av = v3("mamba3::A");
    if (!c.ssd) c.acs = v3("mamba3::acs");
    c.w = v3("mamba3::w");
    c.phi = kp.take<View4<P>>("mamba3::phi", s.batch, s.nheads, s.seqlen, s.nangles);
    if (bf16_qk && mamba3_qk_bf16(s, std::is_same_v<T, float>, quads_ok(c)))
      c.qkv16 = kp.take<View2<bf16_op_t>>("mamba3::qkv_bf16", rows, 2 * HRN);
    else
      c.qkv = kp.take<View2<P>>("mamba3::qkv", rows, 2 * HRN);
    if (c.ssd) {
      c.ad = v3("mamba3::a_delta");
    } else {  // the portable kernels' chunk states (the SSD keeps its own)
      c.states = ws.take<View5<P>>("mamba3::states", s.batch, c.nc, s.nheads, s.headdim, s.dstate);
    }
    // used where the quad kernels apply (the planner counts it on every SSD route)
    if (c.ssd) c.qkd = kp.take<View2<P>>("mamba3::qk_dots", rows, s.nheads);
  }
  if (c.ssd) c.fdv = ws.take<View2<P>>("mamba3::diag_dy_v", rows, s.nheads);  // the backward's, never kept
  return c;
}

// Per-token scalars: Delta, lambda, A_t and the weight w_t = gamma_t + gamma'_t (gamma'_t = Delta_{t+1}
// (1 - lambda_{t+1}) is recomputed from the next token's inputs, so every token is independent); then A_t Delta_t
// (the SSD route's decay exponents) or the in-chunk cumsum of A Delta (the portable kernels').
template <class T>
void token_scalars(const Ctx<T>& c) {
  using P = acc_t<T>;
  par_for("mamba3::token_scalars", c.Bsz * c.H, c.L, KOKKOS_LAMBDA(index_t bh, index_t t) {
    const index_t b = bh / c.H, h = bh % c.H, rw = c.row(b, t);
    const P d = softplus(P(c.dd(rw, c.dt_col + h)) + c.dt_bias(h));
    const P f = heavy_tail(P(c.dd(rw, c.A_col + h)));
    const P A = -(f > c.A_floor ? f : c.A_floor);
    const P lm = sigmoid(P(c.dd(rw, c.trap_col + h)));
    c.delta(b, h, t) = d;
    c.lam(b, h, t) = lm;
    c.Av(b, h, t) = A;
    if (c.ssd) c.ad(b, h, t) = A * d;
    P gp = 0;
    if (t + 1 < c.L && c.same(b, t + 1, t)) {  // no beta term across a record boundary
      const P dn = softplus(P(c.dd(rw + 1, c.dt_col + h)) + c.dt_bias(h));
      gp = dn * (P(1) - sigmoid(P(c.dd(rw + 1, c.trap_col + h))));
    }
    c.w(b, h, t) = lm * d + gp;
  });
  if (c.ssd) return;
  par_for("mamba3::chunk_cumsum", c.Bsz * c.H, c.nc, KOKKOS_LAMBDA(index_t bh, index_t ch) {
    const index_t b = bh / c.H, h = bh % c.H;
    P run = 0;
    for (index_t t = ch * c.Q; t < c.chunk_end(ch); ++t) {
      run += c.Av(b, h, t) * c.delta(b, h, t);
      c.acs(b, h, t) = run;
    }
  });
}

// Phase step of token t, angle i: (ph + pi tanh(theta_t) Delta_t) mod 2 pi, from 0 where a record starts.
template <class T>
KOKKOS_INLINE_FUNCTION acc_t<T> phase_step(const Ctx<T>& c, acc_t<T> ph, index_t b, index_t h, index_t t, index_t i) {
  using P = acc_t<T>;
  const P pi = Kokkos::numbers::pi_v<P>, two_pi = P(2) * pi;
  if (t > 0 && !c.same(b, t, t - 1)) ph = P(0);  // a new record restarts its phase
  ph += pi * Kokkos::tanh(P(c.dd(c.row(b, t), c.angle_col + i))) * c.delta(b, h, t);
  return ph - two_pi * Kokkos::floor(ph / two_pi);
}

// Cumulative rotary phases phi_t = (phi_{t-1} + pi tanh(theta_t) Delta_t) mod 2 pi, over the chunks in parallel
// (a thread walking a whole row was latency-bound: one dependent step per token): each chunk's phase from 0, then
// per (row, head, angle) in chunk order the phase entering each chunk, then each chunk's phases from it. Without a
// record start in a chunk (tokens t0 .. t1 - 1 continue the record of in_tok) its phases are the entering phase
// plus its own; with one, its own from there on.
template <class T>
void phases(const Ctx<T>& c, const View3<acc_t<T>>& init_phi) {
  using P = acc_t<T>;
  const bool has_init = init_phi.extent(0) > 0;
  PoolScope ws;  // the chunks' carries, returned at the end
  View4<P> carry = ws.take<View4<P>>("mamba3::phase_carry", c.Bsz, c.H, c.nc, c.S);
  par_for("mamba3::phases_local", c.Bsz * c.H * c.nc, c.S, KOKKOS_LAMBDA(index_t bhc, index_t i) {
    const index_t ch = bhc % c.nc, bh = bhc / c.nc, b = bh / c.H, h = bh % c.H;
    P ph = 0;
    for (index_t t = ch * c.Q; t < c.chunk_end(ch); ++t) ph = phase_step(c, ph, b, h, t, i);
    carry(b, h, ch, i) = ph;
  });
  par_for("mamba3::phases_carry", c.Bsz * c.H, c.S, KOKKOS_LAMBDA(index_t bh, index_t i) {
    const index_t b = bh / c.H, h = bh % c.H;
    const P two_pi = P(2) * Kokkos::numbers::pi_v<P>;
    P ph = has_init ? init_phi(b, h, i) : P(0);
    for (index_t ch = 0; ch < c.nc; ++ch) {
      const P own = carry(b, h, ch, i);
      carry(b, h, ch, i) = ph;
      if (c.same(b, c.chunk_end(ch) - 1, c.in_tok(ch))) {
        ph += own;
        ph -= two_pi * Kokkos::floor(ph / two_pi);
      } else {
        ph = own;
      }
    }
  });
  par_for("mamba3::phases", c.Bsz * c.H * c.nc, c.S, KOKKOS_LAMBDA(index_t bhc, index_t i) {
    const index_t ch = bhc % c.nc, bh = bhc / c.nc, b = bh / c.H, h = bh % c.H;
    P ph = carry(b, h, ch, i);
    for (index_t t = ch * c.Q; t < c.chunk_end(ch); ++t) {
      ph = phase_step(c, ph, b, h, t, i);
      c.phi(b, h, t, i) = ph;
    }
  });
}

// ---------------------------------------------------------------- the token passes on quads (float, rank 1)
// The rotation, the trapezoid's diagonal and their backwards with each vector lane on quads of four consecutive
// state (or head) dimensions: one 16-byte load or store a quad on GPUs (load_vec), and sine and cosine once per
// angle. On the SSD route the rotation also forms q~ . k~ (c.qkd) for the diagonal's passes, and the rotation's
// backward adds the diagonal's dq~ and dk~ terms. The row kernels further below (4 bytes a lane, sine and cosine per
// element of a pair) ran at 25-40 % of the copy bandwidth on an H200 and stay for other types, ranks and shapes.
// (the pairs by rot_pair and rot_pair_bwd, rotary.hpp)

// The native rotation kernels' inputs (rotate_cuda.hpp, RotIn) from the call's context.
inline void rot_in(const Ctx<float>& c, mamba3_cuda::RotIn& r) {
  r.qk = c.qk.data();
  r.ldqk = index_t(c.qk.stride(0));
  r.q_col = c.q_col;
  r.k_col = c.k_col;
  r.q_bias = c.q_bias.data();
  r.k_bias = c.k_bias.data();
  r.phi = c.phi.data();
  r.ps0 = index_t(c.phi.stride(0)), r.ps1 = index_t(c.phi.stride(1)), r.ps2 = index_t(c.phi.stride(2));
  r.q_off = c.q_off;
  r.k_off = c.k_off;
  r.batch = int(c.Bsz), r.L = int(c.L), r.H = int(c.H), r.G = int(c.G), r.N = int(c.N), r.S = int(c.S);
  r.halved = c.halved;
}

// q~ = Rot(phi) (q + q_bias), k~ = Rot(phi) (k + k_bias). A team thread takes a row (token) and walks its heads, so
// the row's batch and position are divided out once a row. With a (row, head) a team thread (686db24: five 64-bit
// divisions for 2 angles' work a lane) ncu on an H100 put the kernel at 63 % SM and 48 % DRAM throughput, 1.15 ms
// for the 8 x 8,192-token block's 2 GB (q~ and k~ written in fp32, the phases read); a row a team thread ran
// 0.908 against 1.152 ms in alternating runs on one H100, ncu 890 us at 61 % SM and 63 % DRAM throughput
// (perf/RESULTS.md, thirty-seventh session).
// Where c.qkv16 is given, q~ and k~ go to it in bf16 (8-byte stores) instead of qkv; q~ . k~ is formed before that
// rounding.
// The native kernel (rotate_cuda.hpp) in its place where rot_fwd_form is automatic and it takes the shape (and the
// bf16 rows its 8-byte stores).
template <class T>
void rotate_quads(const Ctx<T>& c) {
  using P = acc_t<T>;
  const bool b16 = c.qkv16.extent(0) > 0;
  const index_t ldo = b16 ? index_t(c.qkv16.stride(0)) : index_t(c.qkv.stride(0));
  if constexpr (std::is_same_v<T, float>) {
    if (rot_fwd_form == RotFwdForm::automatic && mamba3_cuda::rotate_fits(int(c.N), c.halved) &&
        (!b16 || (ldo % 4 == 0 && reinterpret_cast<std::uintptr_t>(c.qkv16.data()) % 8 == 0))) {
      mamba3_cuda::RotFwdArgs ra;
      rot_in(c, ra);
      if (b16)
        ra.out16 = reinterpret_cast<std::uint16_t*>(c.qkv16.data());
      else
        ra.out32 = c.qkv.data();
      ra.ldo = ldo;
      if (c.qkd.extent(0) > 0) {
        ra.qkd = c.qkd.data();
        ra.ldqkd = index_t(c.qkd.stride(0));
      }
      return mamba3_cuda::rotate_fwd(ra);
    }
  }
  par_for_rows("mamba3::rotate", c.Bsz * c.L, KOKKOS_LAMBDA(const Team& tm, index_t rw) {
    const index_t b = rw / c.L, t = rw % c.L, N = c.N;
    for (index_t h = 0; h < c.H; ++h) {
      const index_t g = int(h) / int(c.hpg);
      const T* qi = &c.qk(rw, c.q_col + g * N);
      const T* ki = &c.qk(rw, c.k_col + g * N);
      const P* qb = c.q_bias.data() + h * N;
      const P* kb = c.k_bias.data() + h * N;
      const index_t qo = rw * ldo + c.q_off + h * N, ko = rw * ldo + c.k_off + h * N;  // [k~ | q~] offsets
      auto put = [&](index_t at, const P(&x)[4]) {
        if (b16)
          store_bf16_op_vec<4>(c.qkv16.data() + at, x);
        else
          store_vec<4>(c.qkv.data() + at, x);
      };
      const P* ph = c.phi.data() + b * c.phi.stride(0) + h * c.phi.stride(1) + t * c.phi.stride(2);
      // x = the quad of `in` at element `at` plus its bias
      auto biased = [&](const T* in, const P* bias, index_t at, P (&x)[4]) {
        P bb[4];
        load_vec<4>(in + at, x);
        load_vec<4>(bias + at, bb);
        for (int e = 0; e < 4; ++e) x[e] += bb[e];
      };
      P qk = 0;  // q~ . k~ (the diagonal's passes read it instead of both rows)
      if (!c.halved) {  // quad j: pairs (4j, 4j + 1) and (4j + 2, 4j + 3), angles 2j and 2j + 1
        Kokkos::parallel_reduce(
            Kokkos::ThreadVectorRange(tm, N / 4),
            [&](index_t j, P& acc) {
              P q[4], k[4];
              biased(qi, qb, 4 * j, q);
              biased(ki, kb, 4 * j, k);
              for (int e = 0; e < 2 && 2 * j + e < c.S; ++e) {
                P s, co;
                sin_cos(ph[2 * j + e], s, co);
                rot_pair(q[2 * e], q[2 * e + 1], s, co);
                rot_pair(k[2 * e], k[2 * e + 1], s, co);
              }
              put(qo + 4 * j, q);
              put(ko + 4 * j, k);
              acc += q[0] * k[0] + q[1] * k[1] + q[2] * k[2] + q[3] * k[3];
            },
            qk);
      } else {  // quad j of the first half with quad j of the second: pairs (4j + e, N/2 + 4j + e), angles 4j + e
        const index_t hn = N / 2;
        Kokkos::parallel_reduce(
            Kokkos::ThreadVectorRange(tm, hn / 4),
            [&](index_t j, P& acc) {
              P q0[4], q1[4], k0[4], k1[4];
              biased(qi, qb, 4 * j, q0);
              biased(qi, qb, hn + 4 * j, q1);
              biased(ki, kb, 4 * j, k0);
              biased(ki, kb, hn + 4 * j, k1);
              for (int e = 0; e < 4 && 4 * j + e < c.S; ++e) {
                P s, co;
                sin_cos(ph[4 * j + e], s, co);
                rot_pair(q0[e], q1[e], s, co);
                rot_pair(k0[e], k1[e], s, co);
              }
              put(qo + 4 * j, q0);
              put(qo + hn + 4 * j, q1);
              put(ko + 4 * j, k0);
              put(ko + hn + 4 * j, k1);
              for (int e = 0; e < 4; ++e) acc += q0[e] * k0[e] + q1[e] * k1[e];
            },
            qk);
      }
      if (c.qkd.extent(0) > 0) Kokkos::single(Kokkos::PerThread(tm), [&]() { c.qkd(rw, h) = qk; });
    }
  });
}

// q~ . k~ of row rw, head h (rank 0) by the team's vector lanes: the diagonal's passes where the rotation's quad
// kernel did not leave it in c.qkd.
template <class T>
KOKKOS_INLINE_FUNCTION acc_t<T> qk_dot(const Ctx<T>& c, const Team& tm, index_t rw, index_t h) {
  using P = acc_t<T>;
  const P* q = c.qrow(rw, h, 0);
  const P* k = c.krow(rw, h, 0);
  P qk = 0;
  Kokkos::parallel_reduce(Kokkos::ThreadVectorRange(tm, c.N), [&](index_t n, P& a) { a += q[n] * k[n]; }, qk);
  return qk;
}

// The trapezoid's diagonal correction as the SSD's per-token skip coefficient (SSDIn::D_token):
//   dtok(b, h, t) = (gamma_t - w_t) (q~_t . k~_t)
// so that y_t = SSD(w) + D v_t + dtok v_t (the diagonal's weight is gamma_t where the SSD's is w_t) and the SSD's
// backward adds dtok dy_t to dv and gives dy_t . v_t (dD_token). q~ . k~ from the rotation (c.qkd) where its quad
// kernel ran, else formed here.
template <class T>
void diag_coefficient(const Ctx<T>& c, const View3<acc_t<T>>& dtok) {
  using P = acc_t<T>;
  if (c.qkd.extent(0) > 0 && quads_ok(c)) {
    par_for("mamba3::diag_coefficient", c.Bsz * c.H, c.L, KOKKOS_LAMBDA(index_t bh, index_t t) {
      const index_t b = bh / c.H, h = bh % c.H;
      dtok(b, h, t) = (c.gamma(b, h, t) - c.w(b, h, t)) * c.qkd(b * c.L + t, h);
    });
    return;
  }
  par_for_rows("mamba3::diag_coefficient", c.Bsz * c.L * c.H, KOKKOS_LAMBDA(const Team& tm, index_t i) {
    const index_t rw = i / c.H, h = i % c.H, b = rw / c.L, t = rw % c.L;
    const P qk = qk_dot(c, tm, rw, h);
    Kokkos::single(Kokkos::PerThread(tm), [&]() { dtok(b, h, t) = (c.gamma(b, h, t) - c.w(b, h, t)) * qk; });
  });
}

// The diagonal's backward on quads (see backward_ssd), from the SSD's dyv = dy . v per token (its D_token
// gradient) and the rotation's q~ . k~: ddg, dw and fdv = (gamma_t - w_t) (dy . v), whose terms in dq~ and dk~ the
// rotation's backward adds (rotate_bwd_reduce, with the final carry's k gradient). (dv's term dtok dy is the SSD's.)
template <class T>
void diagonal_bwd_quads(const Ctx<T>& c, const View3<acc_t<T>>& dyv, const View3<acc_t<T>>& ddg,
                        const View3<acc_t<T>>& dw) {
  using P = acc_t<T>;
  par_for("mamba3::diagonal_bwd", c.Bsz * c.H, c.L, KOKKOS_LAMBDA(index_t bh, index_t t) {
    const index_t b = bh / c.H, h = bh % c.H;
    const P d = dyv(b, h, t), m = c.qkd(b * c.L + t, h) * d;
    ddg(b, h, t) = m;
    dw(b, h, t) -= m;  // the SSD counted the diagonal with weight w_t
    c.fdv(b * c.L + t, h) = (c.gamma(b, h, t) - c.w(b, h, t)) * d;
  });
}

// The fused rotation backward (rotate_bwd_reduce): a team of kRotSlots slots (a warp each on GPUs) takes a tile of
// kRotSlots x kRotRows rows; its team scratch holds the tile's group sums (2 N values a row) and the slots' column
// sums of one head (2 N values a slot): 24 KB at N = 128 with interleaved pairs (past 46 KB, from N = 512 on, the
// scratch is the global-memory level).
constexpr int kRotSlots = 8;
template <bool kHalved>
constexpr int kRotRows = kHalved ? 1 : 2;  // rows a slot (the registers of their q, k, dq, dk: 32 a lane)
constexpr std::size_t kRotFastScratch = 46 * 1024;  // on-chip team scratch up to this (as ssd.cpp)

// The W values of lane u of a row at src (the state dimensions dim(u, e)) into dst, a quad at a time.
template <int W, class S, class Dim, class P>
KOKKOS_INLINE_FUNCTION void lane_quads(const S* src, const Dim& dim, index_t u, P (&dst)[W]) {
  for (int part = 0; part < W / 4; ++part) {
    P tq[4];
    load_vec<4>(src + dim(u, 4 * part), tq);
    for (int e = 0; e < 4; ++e) dst[4 * part + e] = tq[e];
  }
}

// The rotation's backward on quads (SISO), fused with the two reductions that follow it: per (row, head, state
// dimension) the un-rotated gradients of q~ and k~ (after, with `diag`, the diagonal's terms dq~ += fdv k~,
// dk~ += fdv q~ and the final carry's k gradient at a row's last token), and dphi = sum over q and k of
// -g0 y1 + g1 y0 per angle; the un-rotated gradients are not written back: they are summed over the heads of each
// group into dqk (columns q_col / k_col + g N + n, written) and over each tile of rows into `partial`
// (tile, [k: h N + n | q: H N + h N + n]), whose sum over the tiles is the biases' gradient. One team per (tile of
// rows, group); for each head of the group every slot loads its rows' q, k (the group's, un-rotated: the head's q~
// and k~ are formed again from them, its biases and its phases, which reads 2 N values a row from the cache where
// the head's own q~ and k~ were 2 N a head from memory), dq and dk at once, then handles them in turn; the group
// sums stay in team scratch and the slots' column sums are added in slot order (no atomics; the same sums for any
// team size). Interleaved pairs: a lane takes one quad (two angles); halved pairs: a quad of
// each half (four angles). In team scratch value e of lane u sits at column e U + u (U lanes), so a warp's
// accesses fall in distinct banks. dq~ and dk~ (dqkv) come in fp32 or, from the SSD's fused dB, dC kernel under
// bf16 arithmetic, in bf16 (D; a quad in one 8-byte load).
template <class T, bool kHalved, class D>
void rotate_bwd_reduce(const Ctx<T>& c, const View2<D>& dqkv, const View4<acc_t<T>>& dphi, bool diag,
                       const Mamba3Carry<acc_t<T>>& dfin, const View2<T>& dqk, index_t q_col, index_t k_col,
                       const View2<acc_t<T>>& partial) {
  using P = acc_t<T>;
  constexpr int W = kHalved ? 8 : 4;  // values of q (and of k, dq, dk) a lane holds
  constexpr int KR = kRotRows<kHalved>;
  const bool has_fk = diag && !dfin.empty();
  const auto fk = dfin.k;
  const index_t N = c.N, rows = c.Bsz * c.L, RT = kRotSlots * KR;
  const index_t ntiles = (rows + RT - 1) / RT, U = N / W, HN = c.H * N;
  const bool rows32 = rows < (index_t(1) << 32);
  const std::size_t bytes = Scratch2<P>::shmem_size(RT, 2 * N) + Scratch2<P>::shmem_size(kRotSlots, 2 * N);
  const int lvl = bytes <= kRotFastScratch ? 0 : 1;
  // registers held to 80 a thread (3 teams, 24 warps an SM; ptxas gave it 108 unbounded, 2 teams)
  par_for_team_vec<Kokkos::LaunchBounds<kRotSlots * 32, 3>>(
      "mamba3::rotate_bwd", ntiles * c.G, kRotSlots, 32,
      KOKKOS_LAMBDA(const Team& tm) {
        const index_t tile = index_t(tm.league_rank()) / c.G, g = index_t(tm.league_rank()) % c.G;
        const index_t r0 = tile * RT, nr = rows - r0 < RT ? rows - r0 : RT, hn = kHalved ? N / 2 : 0;
        Scratch2<P> gsum(tm.team_scratch(lvl), RT, 2 * N);   // [k | q] summed over the group's heads so far
        Scratch2<P> red(tm.team_scratch(lvl), kRotSlots, 2 * N);  // each slot's column sums of the current head
        // the state dimension of value e of lane u: 4u + e (interleaved), or 4u + e and hn + 4u + e - 4 (halved)
        auto dim = [=](index_t u, int e) { return kHalved ? (e < 4 ? 4 * u + e : hn + 4 * u + e - 4) : 4 * u + e; };
        for (index_t hh = 0; hh < c.hpg; ++hh) {
          const index_t h = g * c.hpg + hh;
          Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, kRotSlots), [&](int sl) {
            Kokkos::parallel_for(Kokkos::ThreadVectorRange(tm, U), [&](index_t u) {
              // the lane's W values of a row, 16 bytes at a time
              auto ld = [&](const P* src, P(&dst)[W]) { lane_quads(src, dim, u, dst); };
              // the slot's rows first, all loads in flight together (a row past the tile's end reads the tile's
              // last row again; its values are not used): the group's un-rotated q and k (shared by the group's
              // heads, so mostly from cache after the first head) with this head's biases, rotated below, in
              // place of reading the head's own q~ and k~ (two rows of N a head from memory)
              P q[KR][W], k[KR][W], dq[KR][W], dk[KR][W];
              for (int rr = 0; rr < KR; ++rr) {
                const index_t lr = sl * KR + rr < nr ? sl * KR + rr : nr - 1, rw = r0 + lr;
                const P* grow = c.qk.data() + rw * c.qk.stride(0);
                const D* drow = dqkv.data() + rw * dqkv.stride(0);
                ld(grow + c.q_col + g * N, q[rr]);
                ld(grow + c.k_col + g * N, k[rr]);
                lane_quads(drow + c.q_off + h * N, dim, u, dq[rr]);
                lane_quads(drow + c.k_off + h * N, dim, u, dk[rr]);
              }
              P bq[W], bk[W];
              for (int e = 0; e < W; ++e) bq[e] = bk[e] = P(0);
              for (int rr = 0; rr < KR; ++rr) {  // (arrays indexed directly: a pointer into one sends it to the stack)
                const index_t lr = sl * KR + rr;
                if (lr < nr) {
                  // (a row's batch and position by a 32-bit division where the rows allow it: the 64-bit one
                  // is a long instruction sequence, here once a row and head)
                  const index_t rw = r0 + lr, b = rows32 ? index_t(std::uint32_t(rw) / std::uint32_t(c.L)) : rw / c.L,
                                t = rw - b * c.L;
                  P* dph = dphi.data() + b * dphi.stride(0) + h * dphi.stride(1) + t * dphi.stride(2);
                  const P* ph = c.phi.data() + b * c.phi.stride(0) + h * c.phi.stride(1) + t * c.phi.stride(2);
                  // angles 4u + e on pairs (e, 4 + e) of the lane's values (halved), or 2u + e on (2e, 2e + 1);
                  // past the S angles a pair is not rotated. Interleaved pairs hold their two sines and cosines
                  // for the backward below; halved ones form their four again there (ptxas, sm_90, at the
                  // 80-register bound: holding them spilled 136 bytes where forming them again spills 52;
                  // interleaved 64 bytes held, 88 formed again). One sincosf (sin_cos) in place of the two calls
                  // raised the spills to 76 (halved) and 92 bytes (interleaved) and was not timed on its own in this
                  // kernel, so the two calls stay here
                  constexpr int A = kHalved ? 4 : 2, AH = kHalved ? 1 : A;
                  const index_t left = c.S - A * u;
                  P sn[AH], co[AH];
                  if constexpr (!kHalved) {
                    for (int e = 0; e < A; ++e) {
                      sn[e] = e < left ? Kokkos::sin(ph[A * u + e]) : P(0);
                      co[e] = e < left ? Kokkos::cos(ph[A * u + e]) : P(1);
                    }
                  }
                  {  // q~ = Rot(phi) (q + q_bias), k~ likewise: rotate_quads' arithmetic
                    P bb[W];
                    ld(c.q_bias.data() + h * N, bb);
                    for (int e = 0; e < W; ++e) q[rr][e] += bb[e];
                    ld(c.k_bias.data() + h * N, bb);
                    for (int e = 0; e < W; ++e) k[rr][e] += bb[e];
                    for (int e = 0; e < A; ++e) {
                      if (e >= left) break;
                      const int i0 = kHalved ? e : 2 * e, i1 = kHalved ? 4 + e : 2 * e + 1;
                      if constexpr (kHalved) {
                        const P se = Kokkos::sin(ph[A * u + e]), ce = Kokkos::cos(ph[A * u + e]);
                        rot_pair(q[rr][i0], q[rr][i1], se, ce);
                        rot_pair(k[rr][i0], k[rr][i1], se, ce);
                      } else {
                        rot_pair(q[rr][i0], q[rr][i1], sn[e], co[e]);
                        rot_pair(k[rr][i0], k[rr][i1], sn[e], co[e]);
                      }
                    }
                  }
                  if (diag) {
                    const P fd = c.fdv(rw, h);
                    const bool last = has_fk && t == c.L - 1;
                    for (int e = 0; e < W; ++e) {
                      dq[rr][e] += fd * k[rr][e];
                      dk[rr][e] += fd * q[rr][e] + (last ? fk(b, h, 0, dim(u, e)) : P(0));
                    }
                  }
                  for (int e = 0; e < A; ++e) {
                    if (e >= left) break;
                    const int i0 = kHalved ? e : 2 * e, i1 = kHalved ? 4 + e : 2 * e + 1;
                    P acc = 0;
                    if constexpr (kHalved) {
                      const P se = Kokkos::sin(ph[A * u + e]), ce = Kokkos::cos(ph[A * u + e]);
                      rot_pair_bwd(dq[rr][i0], dq[rr][i1], q[rr][i0], q[rr][i1], se, ce, acc);
                      rot_pair_bwd(dk[rr][i0], dk[rr][i1], k[rr][i0], k[rr][i1], se, ce, acc);
                    } else {
                      rot_pair_bwd(dq[rr][i0], dq[rr][i1], q[rr][i0], q[rr][i1], sn[e], co[e], acc);
                      rot_pair_bwd(dk[rr][i0], dk[rr][i1], k[rr][i0], k[rr][i1], sn[e], co[e], acc);
                    }
                    dph[A * u + e] = acc;
                  }
                  for (int e = 0; e < W; ++e) {
                    bq[e] += dq[rr][e];
                    bk[e] += dk[rr][e];
                    const index_t col = e * U + u;
                    gsum(lr, col) = (hh == 0 ? P(0) : gsum(lr, col)) + dk[rr][e];
                    gsum(lr, N + col) = (hh == 0 ? P(0) : gsum(lr, N + col)) + dq[rr][e];
                  }
                }
              }
              for (int e = 0; e < W; ++e) {
                red(sl, e * U + u) = bk[e];
                red(sl, N + e * U + u) = bq[e];
              }
            });
          });
          tm.team_barrier();
          Kokkos::parallel_for(Kokkos::TeamVectorRange(tm, 2 * N), [&](index_t col) {
            P acc = 0;
            for (int sl = 0; sl < kRotSlots; ++sl) acc += red(sl, col);
            const int ci = int(col), Ni = int(N), Ui = int(U);  // (column indices: 32-bit divisions)
            const index_t part = ci / Ni, e = (ci % Ni) / Ui, u = ci % Ui, n = dim(u, int(e));
            partial(tile, part == 0 ? h * N + n : HN + h * N + n) = acc;
          });
          tm.team_barrier();
        }
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nr), [&](index_t lr) {
          Kokkos::parallel_for(Kokkos::ThreadVectorRange(tm, N), [&](index_t col) {
            const int ci = int(col), Ui = int(U);
            const index_t e = ci / Ui, u = ci % Ui, n = dim(u, int(e));
            dqk(r0 + lr, k_col + g * N + n) = static_cast<T>(gsum(lr, col));
            dqk(r0 + lr, q_col + g * N + n) = static_cast<T>(gsum(lr, N + col));
          });
        });
      },
      bytes, 0, lvl);
}

// The rotation backward by the native kernel (rotate_cuda.hpp): rotate_bwd_reduce's outputs, dq~ and dk~ from
// dqkv16 (bf16) where it is non-empty, else from dqkv; `partial` has rotate_bwd_partial_rows rows.
inline void rotate_bwd_native(const Ctx<float>& c, const View2<float>& dqkv, const View2<bf16_op_t>& dqkv16,
                              const View4<float>& dphi, bool diag, const Mamba3Carry<float>& dfin,
                              const View2<float>& dqk, index_t q_col, index_t k_col, const View2<float>& partial) {
  mamba3_cuda::RotBwdArgs ra;
  rot_in(c, ra);
  ra.dphi = dphi.data();
  ra.dps0 = index_t(dphi.stride(0)), ra.dps1 = index_t(dphi.stride(1)), ra.dps2 = index_t(dphi.stride(2));
  if (dqkv16.extent(0) > 0) {
    ra.dq16 = reinterpret_cast<const std::uint16_t*>(dqkv16.data());
    ra.ldd = index_t(dqkv16.stride(0));
  } else {
    ra.dq32 = dqkv.data();
    ra.ldd = index_t(dqkv.stride(0));
  }
  if (diag) {  // the diagonal's terms, with the final carry's k gradient where there is one
    ra.fdv = c.fdv.data();
    ra.ldf = index_t(c.fdv.stride(0));
    if (!dfin.empty()) {
      ra.fk = dfin.k.data();
      ra.fs0 = index_t(dfin.k.stride(0)), ra.fs1 = index_t(dfin.k.stride(1));
    }
  }
  ra.dqk = dqk.data();
  ra.lddqk = index_t(dqk.stride(0));
  ra.dq_col = q_col;
  ra.dk_col = k_col;
  ra.partial = partial.data();
  mamba3_cuda::rotate_bwd(ra);
}

// q~ = Rot(phi) (qn + q_bias), k~ = Rot(phi) (kn + k_bias), per token, head and rank.
template <class T>
void rotate(const Ctx<T>& c) {
  using P = acc_t<T>;
  if (quads_ok(c)) {
    rotate_quads(c);
    return;
  }
  require(c.qkv16.extent(0) == 0, "mamba3_scan", "internal: bf16 q~ and k~ need the quad kernels");
  // one (token, head, rank) per thread, lanes over the state dimensions: each lane forms its own element of the
  // rotated pair (a row is read and written contiguously)
  par_for_rows("mamba3::rotate", c.Bsz * c.L * c.H * c.R, KOKKOS_LAMBDA(const Team& tm, index_t i) {
    const index_t rw = i / (c.H * c.R), hr = i % (c.H * c.R);
    const index_t t = rw % c.L, h = hr / c.R, r = hr % c.R;
    P* qo = &c.qkv(rw, c.q_off + hr * c.N);
    P* ko = &c.qkv(rw, c.k_off + hr * c.N);
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(tm, c.N),
                         [&](index_t n) { c.rot_qk(rw, t, h, r, n, qo[n], ko[n]); });
  });
}

// states(b, c, h) = sum_{s in c} exp(Acs_last - Acs_s) w_s sum_r v_{s,r} k~_{s,r}^T
template <class T>
void chunk_state(const Ctx<T>& c) {
  using P = acc_t<T>;
  par_for_team("mamba3::chunk_state", c.Bsz * c.nc * c.H, KOKKOS_LAMBDA(const Team& tm) {
    index_t b, ch, h;
    c.decode(tm.league_rank(), b, ch, h);
    const index_t t0 = ch * c.Q, t1 = c.chunk_end(ch);
    const P acs_last = c.acs(b, h, t1 - 1);
    Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, c.Pd), [&](index_t p) {
      P* st = &c.states(b, ch, h, p, 0);
      for (index_t n = 0; n < c.N; ++n) st[n] = P(0);
      for (index_t s = t0; s < t1; ++s) {
        const index_t rs = c.row(b, s);
        const P e = c.same(b, t1 - 1, s) ? exp_nonpos(acs_last - c.acs(b, h, s)) * c.w(b, h, s) : P(0);
        for (index_t r = 0; r < c.R; ++r) {
          const P vv = e * P(c.vrow(rs, h, r)[p]);
          const P* k = c.krow(rs, h, r);
          for (index_t n = 0; n < c.N; ++n) st[n] += vv * k[n];
        }
      }
    });
  });
}

// Sh_{-1} = S_init + Delta_0 (1 - lambda_0) sum_r v_prev,r k_prev,r^T, element (p, n) of row b, head h.
template <class T>
KOKKOS_INLINE_FUNCTION acc_t<T> entering(const Ctx<T>& c, const Mamba3Carry<acc_t<T>>& init, index_t b, index_t h,
                                         index_t p, index_t n) {
  using P = acc_t<T>;
  const P gp0 = c.delta(b, h, 0) * (P(1) - c.lam(b, h, 0));
  P kv = 0;
  for (index_t r = 0; r < c.R; ++r) kv += init.v(b, h, r, p) * init.k(b, h, r, n);
  return init.S(b, h, p, n) + gp0 * kv;
}

// In place: states(b, c) becomes the state entering chunk c (Sh_{t0 - 1}); final.S gets the state after the last.
template <class T>
void state_passing(const Ctx<T>& c, const Mamba3Carry<acc_t<T>>& init, const View4<acc_t<T>>& final_S) {
  using P = acc_t<T>;
  const bool has_init = !init.empty(), has_final = final_S.extent(0) > 0;
  par_for("mamba3::state_passing", c.Bsz * c.H, c.Pd * c.N, KOKKOS_LAMBDA(index_t bh, index_t pn) {
    const index_t b = bh / c.H, h = bh % c.H, p = pn / c.N, n = pn % c.N;
    P Sh = has_init ? entering(c, init, b, h, p, n) : P(0);
    for (index_t ch = 0; ch < c.nc; ++ch) {
      const P local = c.states(b, ch, h, p, n);
      c.states(b, ch, h, p, n) = Sh;
      const index_t te = c.chunk_end(ch) - 1;
      Sh = (c.same(b, te, c.in_tok(ch)) ? exp_nonpos(c.acs(b, h, te)) * Sh : P(0)) + local;
    }
    if (has_final) final_S(b, h, p, n) = Sh;
  });
}

// The per-token quantities, the rotated q and k, and (portable kernels) the chunk states.
template <class T>
void recompute(const Ctx<T>& c, const Mamba3Carry<acc_t<T>>& init, const View4<acc_t<T>>& final_S) {
  token_scalars(c);
  phases(c, init.phi);
  rotate(c);
  if (c.ssd) return;
  chunk_state(c);
  state_passing(c, init, final_S);
}

// ---------------------------------------------------------------- SISO through the SSD kernels (ssd.hpp)

// The SSD's inputs: x = v straight out of the input, B = k~, C = q~ out of c.qkv, decay exponents A_t Delta_t,
// weights w_t, and Sh_{-1} (entering_states) as the initial state. (The fused kernels take 16-byte accesses only
// where every operand's rows allow them: an in_proj width d_in_proj or a v column that is not a multiple of 4
// floats, e.g. nheads = 6, sends them to their 4-byte form. Until 3b2779d v was copied next to k~ and q~, which
// kept x aligned at the cost of that copy.)
template <class T>
SSDIn<T> ssd_in(const Ctx<T>& c, const View4<acc_t<T>>& sh0) {
  SSDIn<T> in;
  if (c.qkv16.extent(0) > 0)
    in.bc_bf16 = c.qkv16;  // (xbc left empty: the SSD reads v from x)
  else
    in.xbc = c.qkv;
  in.x = c.v;
  in.x_col = c.v_col;
  in.b_col = c.k_off;
  in.c_col = c.q_off;
  in.D = c.D;
  in.seq_idx = c.seq;
  in.init_state = sh0;
  in.log_decay = c.ad;
  in.weight = c.w;
  return in;
}

// Sh_{-1} of every (row, head), or empty without an initial carry.
template <class T>
View4<acc_t<T>> entering_states(const Ctx<T>& c, const Mamba3Carry<acc_t<T>>& init, PoolScope& ws) {
  using P = acc_t<T>;
  if (init.empty()) return View4<P>();
  View4<P> sh0 = ws.take<View4<P>>("mamba3::sh0", c.Bsz, c.H, c.Pd, c.N);
  par_for("mamba3::entering_states", c.Bsz * c.H, c.Pd * c.N, KOKKOS_LAMBDA(index_t bh, index_t pn) {
    const index_t b = bh / c.H, h = bh % c.H, p = pn / c.N, n = pn % c.N;
    sh0(b, h, p, n) = entering(c, init, b, h, p, n);
  });
  return sh0;
}

// y = the SSD's output with the per-token skip coefficient (gamma_t - w_t) (q~_t . k~_t) (diag_coefficient: the
// trapezoid's diagonal weight is gamma_t, the SSD's w_t); final_S (when non-empty) gets the state after the last
// token; keep (with pool): the SSD's intermediates.
template <class T>
void forward_ssd(const Ctx<T>& c, const Mamba3ScanShape& s, const Mamba3Carry<acc_t<T>>& init, const View2<T>& y,
                 const View4<acc_t<T>>& final_S, PoolScope& ws, SSDSaved<T>* keep, PoolScope* pool) {
  using P = acc_t<T>;
  View3<P> dtok = ws.take<View3<P>>("mamba3::d_token", c.Bsz, c.H, c.L);
  diag_coefficient(c, dtok);
  SSDIn<T> si = ssd_in(c, entering_states(c, init, ws));
  si.D_token = dtok;
  ssd_forward<T>(mamba3_ssd_shape(s), si, y, final_S, keep, pool);
}

}  // namespace

template <class T>
void mamba3_scan_forward(const Mamba3ScanShape& s, const Mamba3ScanIn<T>& in, const View2<T>& y,
                         const Mamba3Carry<acc_t<T>>& fin, Mamba3ScanSaved<T>* keep, PoolScope* pool) {
  using P = acc_t<T>;
  require(!keep || pool, "mamba3_scan_forward", "keeping the intermediates needs the pool that holds them");
  if (keep) *keep = Mamba3ScanSaved<T>{};
  const bool keeping = keep && s.via_ssd();
  PoolScope ws;  // the call's buffers: cached device blocks, returned at the end
  const Ctx<T> c = make_ctx<T>(s, in, ws, keeping ? pool : nullptr, nullptr, true);
  require(index_t(y.extent(0)) == c.Bsz * c.L && index_t(y.extent(1)) == c.H * c.R * c.Pd, "mamba3_scan_forward",
          "y must be (batch * seqlen, nheads * rank * headdim) = (", c.Bsz * c.L, ", ", c.H * c.R * c.Pd, ")");
  const bool has_final = !fin.empty();
  if (has_final)
    require(index_t(fin.S.extent(0)) == c.Bsz && index_t(fin.S.extent(1)) == c.H &&
                index_t(fin.S.extent(2)) == c.Pd && index_t(fin.S.extent(3)) == c.N &&
                index_t(fin.k.extent(2)) == c.R && index_t(fin.v.extent(2)) == c.R &&
                index_t(fin.phi.extent(2)) == c.S,
            "mamba3_scan_forward", "final carry does not match the shape");
  recompute(c, in.init, fin.S);
  if (c.ssd)
    forward_ssd(c, s, in.init, y, fin.S, ws, keeping ? &keep->ssd : nullptr, pool);
  else
    par_for_team(
      "mamba3::chunk_scan", c.Bsz * c.nc * c.H,
      KOKKOS_LAMBDA(const Team& tm) {
        index_t b, ch, h;
        c.decode(tm.league_rank(), b, ch, h);
        const index_t t0 = ch * c.Q, t1 = c.chunk_end(ch);
        const P Dh = c.D(h);
        Scratch1<P> acc(tm.thread_scratch(1), c.R * c.Pd);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, t0, t1), [&](index_t t) {
          const index_t rt = c.row(b, t);
          const P acs_t = c.acs(b, h, t), e_in = c.same(b, t, c.in_tok(ch)) ? exp_nonpos(acs_t) : P(0);
          for (index_t r = 0; r < c.R; ++r) {
            const T* vt = c.vrow(rt, h, r);
            const P* q = c.qrow(rt, h, r);
            for (index_t p = 0; p < c.Pd; ++p) {
              const P* Sp = &c.states(b, ch, h, p, 0);
              P sq = 0;
              for (index_t n = 0; n < c.N; ++n) sq += Sp[n] * q[n];
              acc(r * c.Pd + p) = Dh * P(vt[p]) + e_in * sq;
            }
          }
          for (index_t s2 = t0; s2 <= t; ++s2) {
            const index_t rs = c.row(b, s2);
            const P coef = s2 < t ? (c.same(b, t, s2) ? exp_nonpos(acs_t - c.acs(b, h, s2)) * c.w(b, h, s2) : P(0))
                                  : c.gamma(b, h, t);
            for (index_t r2 = 0; r2 < c.R; ++r2) {
              const P* k = c.krow(rs, h, r2);
              const T* vs = c.vrow(rs, h, r2);
              for (index_t r = 0; r < c.R; ++r) {
                const P* q = c.qrow(rt, h, r);
                P dot = 0;
                for (index_t n = 0; n < c.N; ++n) dot += q[n] * k[n];
                const P f = coef * dot;
                for (index_t p = 0; p < c.Pd; ++p) acc(r * c.Pd + p) += f * P(vs[p]);
              }
            }
          }
          T* yt = &y(rt, h * c.R * c.Pd);
          for (index_t i = 0; i < c.R * c.Pd; ++i) yt[i] = static_cast<T>(acc(i));
        });
      },
      0, Scratch1<P>::shmem_size(c.R * c.Pd), 1);

  if (has_final) {
    const auto fphi = fin.phi;
    const auto fk = fin.k;
    const auto fv = fin.v;
    par_for("mamba3::final_carry", c.Bsz * c.H, KOKKOS_LAMBDA(index_t bh) {
      const index_t b = bh / c.H, h = bh % c.H, rl = c.row(b, c.L - 1);
      for (index_t i = 0; i < c.S; ++i) fphi(b, h, i) = c.phi(b, h, c.L - 1, i);
      for (index_t r = 0; r < c.R; ++r) {
        const T* vv = c.vrow(rl, h, r);
        if (c.qkv16.extent(0) > 0) {  // k~ in fp32 from the inputs (the stored copy is bf16)
          for (index_t n = 0; n < c.N; ++n) {
            P qd, kd;
            c.rot_qk(rl, c.L - 1, h, r, n, qd, kd);
            fk(b, h, r, n) = kd;
          }
        } else {
          const P* k = c.krow(rl, h, r);
          for (index_t n = 0; n < c.N; ++n) fk(b, h, r, n) = k[n];
        }
        for (index_t p = 0; p < c.Pd; ++p) fv(b, h, r, p) = P(vv[p]);
      }
    });
  }
  if (keeping) {  // the context the backward reads (its blocks from pool; the SSD's own kept above)
    keep->delta = c.delta;
    keep->lam = c.lam;
    keep->Av = c.Av;
    keep->w = c.w;
    keep->ad = c.ad;
    keep->phi = c.phi;
    keep->qkv = c.qkv;
    keep->qkv16 = c.qkv16;
    keep->qkd = c.qkd;
  }
}

namespace {

// The portable kernels' part of the backward: dv (into gr.dv), dq~ and dk~ (into dqkv at the q and k columns),
// the per-token gradients da (of A_t Delta_t), dw (of w_t off the diagonal) and ddg (of gamma_t on it), dsh0
// (of Sh_{-1}) and dD (accumulated).
template <class T>
void backward_portable(const Ctx<T>& c, const Mamba3ScanIn<T>& in, const View2<const T>& dy,
                       const Mamba3Carry<acc_t<T>>& dfin, const Mamba3ScanGrad<T>& gr, const View2<acc_t<T>>& dqkv,
                       const View3<acc_t<T>>& da, const View3<acc_t<T>>& dw, const View3<acc_t<T>>& ddg,
                       const View4<acc_t<T>>& dsh0) {
  using P = acc_t<T>;
  PoolScope ws;  // dstates and the partial sums of dD, returned at the end
  const bool has_dfinal = !dfin.empty();
  // dstates(b, c) = sum_{t in c} exp(Acs_t) sum_r dy_{t,r} q~_{t,r}^T  (gradient of Sh_in from chunk c's outputs)
  View5<P> dstates = ws.take<View5<P>>("mamba3::dstates", c.Bsz, c.nc, c.H, c.Pd, c.N);
  par_for_team("mamba3::dstates_local", c.Bsz * c.nc * c.H, KOKKOS_LAMBDA(const Team& tm) {
    index_t b, ch, h;
    c.decode(tm.league_rank(), b, ch, h);
    const index_t t0 = ch * c.Q, t1 = c.chunk_end(ch);
    Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, c.Pd), [&](index_t p) {
      P* ds = &dstates(b, ch, h, p, 0);
      for (index_t n = 0; n < c.N; ++n) ds[n] = P(0);
      for (index_t t = t0; t < t1; ++t) {
        const index_t rt = c.row(b, t);
        const P e = c.same(b, t, c.in_tok(ch)) ? exp_nonpos(c.acs(b, h, t)) : P(0);
        for (index_t r = 0; r < c.R; ++r) {
          const P d = e * P(dy(rt, (h * c.R + r) * c.Pd + p));
          const P* q = c.qrow(rt, h, r);
          for (index_t n = 0; n < c.N; ++n) ds[n] += d * q[n];
        }
      }
    });
  });

  // Reverse state passing, in place: dstates(b, c) becomes dL/dSh_out(c); dsh0 = dL/dSh_{-1}.
  {
    const auto dS = dfin.S;
    par_for("mamba3::state_passing_bwd", c.Bsz * c.H, c.Pd * c.N, KOKKOS_LAMBDA(index_t bh, index_t pn) {
      const index_t b = bh / c.H, h = bh % c.H, p = pn / c.N, n = pn % c.N;
      P dH = has_dfinal ? dS(b, h, p, n) : P(0);
      for (index_t ch = c.nc - 1; ch >= 0; --ch) {
        const P local = dstates(b, ch, h, p, n);
        dstates(b, ch, h, p, n) = dH;
        const index_t te = c.chunk_end(ch) - 1;
        dH = local + (c.same(b, te, c.in_tok(ch)) ? exp_nonpos(c.acs(b, h, te)) * dH : P(0));
      }
      dsh0(b, h, p, n) = dH;
    });
  }

  // Per chunk and head: dv, dq~, dk~, and the per-token scalar gradients da (of A_t Delta_t), dw, and dgamma_diag.
  View3<P> dD_part = ws.take<View3<P>>("mamba3::dD_part", c.Bsz, c.nc, c.H);
  {
    const auto dvo = gr.dv;
    const index_t v_col = in.v_col - gr.col0, Q = c.Q;
    const auto fv = dfin.v;
    const auto fk = dfin.k;
    // Team scratch: M (s <= t: sum_{r,r'} (q~_{t,r}.k~_{s,r'}) (dy_{t,r}.v_{s,r'})), Cf (the coefficient of the
    // pair: exp(Acs_t - Acs_s) w_s below the diagonal, gamma_t on it), Ex (exp(Acs_t - Acs_s)); six vectors of Q.
    const std::size_t team_bytes = 3 * Scratch2<P>::shmem_size(Q, Q) + 6 * Scratch1<P>::shmem_size(Q);
    const std::size_t thread_bytes = Scratch1<P>::shmem_size(c.R * c.Pd) + Scratch1<P>::shmem_size(c.R * c.N);
    par_for_team(
        "mamba3::chunk_bwd", c.Bsz * c.nc * c.H,
        KOKKOS_LAMBDA(const Team& tm) {
          index_t b, ch, h;
          c.decode(tm.league_rank(), b, ch, h);
          const index_t t0 = ch * c.Q, t1 = c.chunk_end(ch), q = t1 - t0;
          const P Dh = c.D(h), acs_last = c.acs(b, h, t1 - 1);
          const bool last_chunk = t1 == c.L;
          Scratch2<P> M(tm.team_scratch(1), Q, Q), Cf(tm.team_scratch(1), Q, Q), Ex(tm.team_scratch(1), Q, Q);
          Scratch1<P> insum(tm.team_scratch(1), Q), outsum(tm.team_scratch(1), Q), inter(tm.team_scratch(1), Q),
              wstate(tm.team_scratch(1), Q), dwv(tm.team_scratch(1), Q), ddot(tm.team_scratch(1), Q);
          Scratch1<P> accP(tm.thread_scratch(1), c.R * c.Pd), accN(tm.thread_scratch(1), c.R * c.N);
          const P* dH = &dstates(b, ch, h, 0, 0);  // dL/dSh_out, (P, N)
          const P* Sin = &c.states(b, ch, h, 0, 0);
          auto dyrow = [&](index_t rw, index_t r) { return &dy(rw, (h * c.R + r) * c.Pd); };

          // Phase A: pair quantities.
          Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, q), [&](index_t il) {
            const index_t t = t0 + il, rt = c.row(b, t);
            const P acs_t = c.acs(b, h, t);
            for (index_t is = 0; is <= il; ++is) {
              const index_t s2 = t0 + is, rs = c.row(b, s2);
              P m = 0;
              for (index_t r = 0; r < c.R; ++r) {
                const P* qv = c.qrow(rt, h, r);
                const T* dyv = dyrow(rt, r);
                for (index_t r2 = 0; r2 < c.R; ++r2) {
                  const P* kv = c.krow(rs, h, r2);
                  const T* vv = c.vrow(rs, h, r2);
                  P gqk = 0, dxv = 0;
                  for (index_t n = 0; n < c.N; ++n) gqk += qv[n] * kv[n];
                  for (index_t p = 0; p < c.Pd; ++p) dxv += P(dyv[p]) * P(vv[p]);
                  m += gqk * dxv;
                }
              }
              M(il, is) = m;
              const P e = is < il ? (c.same(b, t, s2) ? exp_nonpos(acs_t - c.acs(b, h, s2)) : P(0)) : P(1);
              Ex(il, is) = e;
              Cf(il, is) = is < il ? e * c.w(b, h, s2) : c.gamma(b, h, t);
            }
          });
          tm.team_barrier();

          // Phase B (output token t): dq~_t (intra + inter), the inter and incoming-intra terms of dAcs_t.
          Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, q), [&](index_t il) {
            const index_t t = t0 + il, rt = c.row(b, t);
            const P e_in = c.same(b, t, c.in_tok(ch)) ? exp_nonpos(c.acs(b, h, t)) : P(0);
            P in_term = 0;
            for (index_t r = 0; r < c.R; ++r) {
              const T* dyv = dyrow(rt, r);
              const P* qv = c.qrow(rt, h, r);
              for (index_t n = 0; n < c.N; ++n) accN(r * c.N + n) = 0;
              for (index_t p = 0; p < c.Pd; ++p) {
                const P d = e_in * P(dyv[p]);
                for (index_t n = 0; n < c.N; ++n) accN(r * c.N + n) += d * Sin[p * c.N + n];
              }
              for (index_t n = 0; n < c.N; ++n) in_term += qv[n] * accN(r * c.N + n);
            }
            P ins = 0;
            for (index_t is = 0; is <= il; ++is) {
              const index_t rs = c.row(b, t0 + is);
              const P cf = Cf(il, is);
              if (is < il) ins += M(il, is) * cf;
              for (index_t r = 0; r < c.R; ++r) {
                const T* dyv = dyrow(rt, r);
                for (index_t r2 = 0; r2 < c.R; ++r2) {
                  const T* vv = c.vrow(rs, h, r2);
                  P dxv = 0;
                  for (index_t p = 0; p < c.Pd; ++p) dxv += P(dyv[p]) * P(vv[p]);
                  const P f = cf * dxv;
                  const P* kv = c.krow(rs, h, r2);
                  for (index_t n = 0; n < c.N; ++n) accN(r * c.N + n) += f * kv[n];
                }
              }
            }
            for (index_t i = 0; i < c.R * c.N; ++i) dqkv(rt, c.q_off + h * c.R * c.N + i) = accN(i);
            inter(il) = in_term;
            insum(il) = ins;
            ddg(b, h, t) = M(il, il);
          });

          // Phase C (source token s): dv_s, dk~_s, the outgoing-intra and state terms of dAcs_s, dw_s.
          Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, q), [&](index_t is) {
            const index_t s2 = t0 + is, rs = c.row(b, s2);
            const P es = c.same(b, t1 - 1, s2) ? exp_nonpos(acs_last - c.acs(b, h, s2)) : P(0), ws = c.w(b, h, s2);
            P vdk = 0, dd = 0;
            for (index_t r2 = 0; r2 < c.R; ++r2) {
              const P* kv = c.krow(rs, h, r2);
              const T* vv = c.vrow(rs, h, r2);
              const T* dys = dyrow(rs, r2);
              for (index_t n = 0; n < c.N; ++n) accN(r2 * c.N + n) = 0;
              for (index_t p = 0; p < c.Pd; ++p) {
                const P* dHp = dH + p * c.N;
                P hk = 0;
                for (index_t n = 0; n < c.N; ++n) hk += dHp[n] * kv[n];
                const P vp = P(vv[p]);
                vdk += vp * hk;
                dd += P(dys[p]) * vp;
                accP(r2 * c.Pd + p) = Dh * P(dys[p]) + es * ws * hk;
                for (index_t n = 0; n < c.N; ++n) accN(r2 * c.N + n) += es * ws * dHp[n] * vp;
              }
            }
            P outs = 0, dwi = 0;
            for (index_t il = is; il < q; ++il) {
              const index_t rt = c.row(b, t0 + il);
              const P cf = Cf(il, is);
              if (il > is) {
                outs += M(il, is) * cf;
                dwi += M(il, is) * Ex(il, is);
              }
              for (index_t r2 = 0; r2 < c.R; ++r2) {
                const P* kv = c.krow(rs, h, r2);
                const T* vv = c.vrow(rs, h, r2);
                for (index_t r = 0; r < c.R; ++r) {
                  const P* qv = c.qrow(rt, h, r);
                  const T* dyv = dyrow(rt, r);
                  P gqk = 0, dxv = 0;
                  for (index_t n = 0; n < c.N; ++n) gqk += qv[n] * kv[n];
                  for (index_t p = 0; p < c.Pd; ++p) dxv += P(dyv[p]) * P(vv[p]);
                  const P fv2 = cf * gqk, fk2 = cf * dxv;
                  for (index_t p = 0; p < c.Pd; ++p) accP(r2 * c.Pd + p) += fv2 * P(dyv[p]);
                  for (index_t n = 0; n < c.N; ++n) accN(r2 * c.N + n) += fk2 * qv[n];
                }
              }
            }
            if (has_dfinal && last_chunk && s2 == c.L - 1) {
              for (index_t r2 = 0; r2 < c.R; ++r2) {
                for (index_t p = 0; p < c.Pd; ++p) accP(r2 * c.Pd + p) += fv(b, h, r2, p);
                for (index_t n = 0; n < c.N; ++n) accN(r2 * c.N + n) += fk(b, h, r2, n);
              }
            }
            for (index_t r2 = 0; r2 < c.R; ++r2)
              for (index_t p = 0; p < c.Pd; ++p)
                dvo(rs, v_col + (h * c.R + r2) * c.Pd + p) = static_cast<T>(accP(r2 * c.Pd + p));
            for (index_t i = 0; i < c.R * c.N; ++i) dqkv(rs, c.k_off + h * c.R * c.N + i) = accN(i);
            outsum(is) = outs;
            wstate(is) = es * ws * vdk;
            dwv(is) = dwi + es * vdk;
            ddot(is) = dd;
          });

          // Decay of the state passing: dAcs_last += exp(Acs_last) <dSh_out, Sh_in>.
          P wdecay = 0;
          Kokkos::parallel_reduce(
              Kokkos::TeamThreadRange(tm, c.Pd * c.N), [&](index_t pn, P& a) { a += dH[pn] * Sin[pn]; }, wdecay);
          wdecay *= c.same(b, t1 - 1, c.in_tok(ch)) ? exp_nonpos(acs_last) : P(0);
          tm.team_barrier();

          Kokkos::single(Kokkos::PerTeam(tm), [&]() {
            P wtot = 0, dsum = 0;
            for (index_t i = 0; i < q; ++i) {
              wtot += wstate(i);
              dsum += ddot(i);
            }
            P run = 0;
            for (index_t ij = q - 1; ij >= 0; --ij) {
              P dacs = insum(ij) - outsum(ij) + inter(ij) - wstate(ij);
              if (ij == q - 1) dacs += wtot + wdecay;
              run += dacs;
              da(b, h, t0 + ij) = run;
              dw(b, h, t0 + ij) = dwv(ij);
            }
            dD_part(b, ch, h) = dsum;
          });
        },
        team_bytes, thread_bytes, 1);
  }
  const auto dD = gr.dD;
  par_for("mamba3::dD", c.H, KOKKOS_LAMBDA(index_t h) {
    P acc = 0;
    for (index_t b = 0; b < c.Bsz; ++b)
      for (index_t ch = 0; ch < c.nc; ++ch) acc += dD_part(b, ch, h);
    dD(h) += acc;
  });
}

// The SSD route's part of the backward, with the outputs of backward_portable: the SSD's backward (per-token
// gradients of the decay exponents and weights; dv written straight into gr.dv; the diagonal's correction
// (gamma_t - w_t) (q~ . k~) v as its per-token skip coefficient, so dv gets its term there and dy . v comes back as
// that coefficient's gradient), then the rest of the diagonal's gradient and the final carry's k and v (those of
// each row's last token).
template <class T>
bool backward_ssd(const Ctx<T>& c, const Mamba3ScanShape& s, const Mamba3ScanIn<T>& in, const View2<const T>& dy,
                  const Mamba3Carry<acc_t<T>>& dfin, const Mamba3ScanGrad<T>& gr, const View2<acc_t<T>>& dqkv,
                  const View2<bf16_op_t>& dqkv16, const View3<acc_t<T>>& da, const View3<acc_t<T>>& dw,
                  const View3<acc_t<T>>& ddg, const View4<acc_t<T>>& dsh0, PoolScope& ws, const SSDSaved<T>* kept) {
  using P = acc_t<T>;
  View3<P> dtok = ws.take<View3<P>>("mamba3::d_token", c.Bsz, c.H, c.L);
  View3<P> dyv = ws.take<View3<P>>("mamba3::dy_dot_v", c.Bsz, c.H, c.L);
  diag_coefficient(c, dtok);
  SSDIn<T> si = ssd_in(c, entering_states(c, in.init, ws));
  si.D_token = dtok;
  SSDGrad<T> g;
  g.dxbc = dqkv;
  g.dbc_bf16 = dqkv16;  // (where given, dqkv is empty: dq~ and dk~ in bf16 only)
  g.dD = gr.dD;
  g.dinit_state = dsh0;
  g.dlog_decay = da;
  g.dweight = dw;
  g.dD_token = dyv;
  g.dx = gr.dv;  // dv straight into the in_proj gradient (with the diagonal's term dtok dy)
  g.dx_col = in.v_col - gr.col0;
  ssd_backward<T>(mamba3_ssd_shape(s), si, dy, dfin.S, g, kept);
  const bool has_dfinal = !dfin.empty();
  const auto fv = dfin.v;
  const auto fk = dfin.k;
  const auto dvo = gr.dv;
  const index_t v_col = in.v_col - gr.col0;
  if (has_dfinal)  // the final carry's v is the last token's
    par_for("mamba3::dv_final", c.Bsz * c.H, c.Pd, KOKKOS_LAMBDA(index_t bh, index_t p) {
      const index_t b = bh / c.H, h = bh % c.H, rw = b * c.L + c.L - 1;
      dvo(rw, v_col + h * c.Pd + p) = static_cast<T>(P(dvo(rw, v_col + h * c.Pd + p)) + fv(b, h, 0, p));
    });
  if (c.qkd.extent(0) > 0 && quads_ok(c, {{dqkv.data(), dqkv.stride(0)}})) {
    diagonal_bwd_quads(c, dyv, ddg, dw);
    return true;  // the terms in dq~ and dk~ are the rotation backward's to add
  }
  require(dqkv16.extent(0) == 0, "mamba3_scan_backward", "internal: bf16 dq~ and dk~ need the quad kernels");
  par_for_rows("mamba3::diagonal_bwd", c.Bsz * c.L * c.H, KOKKOS_LAMBDA(const Team& tm, index_t i) {
    const index_t rw = i / c.H, h = i % c.H, b = rw / c.L, t = rw % c.L;
    const P* q = c.qrow(rw, h, 0);
    const P* k = c.krow(rw, h, 0);
    const P qk = qk_dot(c, tm, rw, h);
    const P d = dyv(b, h, t), f = c.gamma(b, h, t) - c.w(b, h, t), m = qk * d;
    Kokkos::single(Kokkos::PerThread(tm), [&]() {
      ddg(b, h, t) = m;
      dw(b, h, t) -= m;  // the SSD counted the diagonal with weight w_t
    });
    const bool last = has_dfinal && t == c.L - 1;
    P* dq = &dqkv(rw, c.q_off + h * c.N);
    P* dk = &dqkv(rw, c.k_off + h * c.N);
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(tm, c.N), [&](index_t n) {
      dq[n] += f * d * k[n];
      dk[n] += f * d * q[n] + (last ? fk(b, h, 0, n) : P(0));
    });
  });
  return false;
}

}  // namespace

template <class T>
void mamba3_scan_backward(const Mamba3ScanShape& s, const Mamba3ScanIn<T>& in, const View2<const T>& dy,
                          const Mamba3Carry<acc_t<T>>& dfin, const Mamba3ScanGrad<T>& gr,
                          const Mamba3ScanSaved<T>* kept) {
  using P = acc_t<T>;
  PoolScope ws;  // the call's buffers: cached device blocks, returned at the end
  const bool from_kept = kept && !kept->empty() && s.via_ssd();
  const Ctx<T> c = make_ctx(s, in, ws, nullptr, from_kept ? kept : nullptr);
  const index_t rows = c.Bsz * c.L, HRN = c.H * c.R * c.N;
  require(index_t(dy.extent(0)) == rows && index_t(dy.extent(1)) == c.H * c.R * c.Pd, "mamba3_scan_backward",
          "dy must be (batch * seqlen, nheads * rank * headdim) = (", rows, ", ", c.H * c.R * c.Pd, ")");
  require(gr.col0 >= 0 && gr.col0 <= in.v_col && gr.col0 <= in.dt_col && gr.col0 <= in.A_col &&
              gr.col0 <= in.trap_col && gr.col0 <= in.angle_col && index_t(gr.dv.extent(0)) == rows &&
              index_t(gr.dv.extent(1)) + gr.col0 == index_t(in.v.extent(1)) && index_t(gr.dqk.extent(0)) == rows &&
              gr.dqk.extent(1) == in.qk.extent(1) && index_t(gr.ddd.extent(0)) == rows &&
              index_t(gr.ddd.extent(1)) + gr.col0 == index_t(in.dd.extent(1)),
          "mamba3_scan_backward", "gradient matrices must have the shapes of the inputs, dv and ddd less col0 = ",
          gr.col0, " columns (at most the first column they are written at: v at ", in.v_col, ", dd at ",
          std::min({in.dt_col, in.A_col, in.trap_col, in.angle_col}), ")");
  if (!from_kept) recompute(c, in.init, View4<P>());
  const bool has_dfinal = !dfin.empty(), has_init = !in.init.empty(), want_dinit = !gr.dinit.empty();
  View4<P> dsh0 = ws.take<View4<P>>("mamba3::dsh0", c.Bsz, c.H, c.Pd, c.N);
  // dq~ and dk~ (the SSD's dB and dC): in bf16 where the SSD forms them in its one fused kernel under bf16
  // arithmetic (which rounds its operands to bf16 already) and the rotation backward on quads reads them (half the
  // bytes of fp32 written and read: 0.8 of 1.6 GB at 8 x 8,192 tokens, 24 heads, d_state 128), else fp32
  const bool d16 = std::is_same_v<T, float> && c.ssd && c.qkd.extent(0) > 0 && quads_ok(c) &&
                   ssd_bc_bf16_applies(mamba3_ssd_shape(s));
  View2<P> dqkv = d16 ? View2<P>() : ws.take<View2<P>>("mamba3::dqkv", rows, 2 * HRN);
  View2<bf16_op_t> dqkv16 =
      d16 ? ws.take<View2<bf16_op_t>>("mamba3::dqkv_bf16", rows, 2 * HRN) : View2<bf16_op_t>();
  View3<P> da = ws.take<View3<P>>("mamba3::da", c.Bsz, c.H, c.L);
  View3<P> dw = ws.take<View3<P>>("mamba3::dw", c.Bsz, c.H, c.L);
  View3<P> ddg = ws.take<View3<P>>("mamba3::ddiag", c.Bsz, c.H, c.L);
  bool diag_pending = false;  // the diagonal's dq~ and dk~ terms left to the rotation's backward
  if (c.ssd)
    diag_pending =
        backward_ssd(c, s, in, dy, dfin, gr, dqkv, dqkv16, da, dw, ddg, dsh0, ws, from_kept ? &kept->ssd : nullptr);
  else
    backward_portable(c, in, dy, dfin, gr, dqkv, da, dw, ddg, dsh0);

  // Initial carry: Sh_{-1} = S_init + gp0 sum_r v_r k_r^T with gp0 = Delta_0 (1 - lambda_0).
  View2<P> dgp0 = ws.take<View2<P>>("mamba3::dgp0", c.Bsz, c.H);  // every entry written below
  if (!has_init && !want_dinit) {
    Kokkos::deep_copy(dgp0, P(0));  // no carry in, none asked for
  } else {
    const auto iv = in.init.v;
    const auto ik = in.init.k;
    const auto dS = gr.dinit.S;
    const auto dk = gr.dinit.k;
    const auto dv = gr.dinit.v;
    par_for("mamba3::init_carry_bwd", c.Bsz * c.H, KOKKOS_LAMBDA(index_t bh) {
      const index_t b = bh / c.H, h = bh % c.H;
      const P gp0 = c.delta(b, h, 0) * (P(1) - c.lam(b, h, 0));
      P acc = 0;
      for (index_t r = 0; r < c.R; ++r) {
        for (index_t p = 0; p < c.Pd; ++p) {
          P dk_row = 0;  // sum_n dSh[p, n] k_r[n]
          for (index_t n = 0; n < c.N; ++n) dk_row += dsh0(b, h, p, n) * (has_init ? ik(b, h, r, n) : P(0));
          const P vv = has_init ? iv(b, h, r, p) : P(0);
          acc += vv * dk_row;
          if (want_dinit) dv(b, h, r, p) = gp0 * dk_row;
        }
        if (want_dinit)
          for (index_t n = 0; n < c.N; ++n) {
            P s2 = 0;
            for (index_t p = 0; p < c.Pd; ++p) s2 += dsh0(b, h, p, n) * (has_init ? iv(b, h, r, p) : P(0));
            dk(b, h, r, n) = gp0 * s2;
          }
      }
      dgp0(b, h) = has_init ? acc : P(0);
      if (want_dinit)
        for (index_t p = 0; p < c.Pd; ++p)
          for (index_t n = 0; n < c.N; ++n) dS(b, h, p, n) = dsh0(b, h, p, n);
    });
  }

  // Rotation backward: dphi (direct) and the un-rotated gradients of the biased q, k (in place in dqkv); one
  // (token, head) per thread, lanes over the angles.
  View4<P> dphi = ws.take<View4<P>>("mamba3::dphi", c.Bsz, c.H, c.L, c.S);
  const bool rotated = d16 || quads_ok(c, {{dqkv.data(), dqkv.stride(0)}});
  require(rotated || !diag_pending, "mamba3_scan_backward", "internal: the diagonal's terms need the quad kernels");
  // the biases' gradient from a column sum of the un-rotated gradients [dk~ | dq~] (dkq, 2 H R N)
  auto add_bias_grads = [&](const View1<P>& dkq) {
    const auto dqb = gr.dq_bias;
    const auto dkb = gr.dk_bias;
    par_for("mamba3::dkq_bias_add", HRN, KOKKOS_LAMBDA(index_t j) {
      dkb(j) += dkq(j);
      dqb(j) += dkq(HRN + j);
    });
  };
  if (rotated) {  // fused with the sums over each group's heads (into gr.dqk) and over the rows (the biases)
    PoolScope local;  // returned at the end of the block
    // the native kernel (rotate_cuda.hpp) where it takes the shape and gr.dqk's rows take its 16-byte stores, else
    // the Kokkos form
    const bool native = std::is_same_v<T, float> && rot_bwd_form == RotBwdForm::automatic &&
                        mamba3_cuda::rotate_fits(int(c.N), c.halved) &&
                        float4_rows({{gr.dqk.data(), gr.dqk.stride(0)}}) && in.q_col % 4 == 0 && in.k_col % 4 == 0;
    const index_t RT = kRotSlots * (c.halved ? kRotRows<true> : kRotRows<false>),
                  ntiles = native ? mamba3_cuda::rotate_bwd_partial_rows(rows, int(c.N), c.halved, int(c.G))
                                  : (rows + RT - 1) / RT;
    View2<P> part = local.take<View2<P>>("mamba3::dkq_bias::tiles", ntiles, 2 * HRN);
    if (native) {
      if constexpr (std::is_same_v<T, float>)
        rotate_bwd_native(c, dqkv, dqkv16, dphi, diag_pending, dfin, gr.dqk, in.q_col, in.k_col, part);
    } else {
      auto run = [&](const auto& d) {
        if (c.halved)
          rotate_bwd_reduce<T, true>(c, d, dphi, diag_pending, dfin, gr.dqk, in.q_col, in.k_col, part);
        else
          rotate_bwd_reduce<T, false>(c, d, dphi, diag_pending, dfin, gr.dqk, in.q_col, in.k_col, part);
      };
      if (d16)
        run(dqkv16);
      else
        run(dqkv);
    }
    View1<P> dkq = local.take<View1<P>>("mamba3::dkq_bias", 2 * HRN);
    reduce_partials<P>("mamba3::dkq_bias", part, ntiles, 2 * HRN, dkq, false);
    add_bias_grads(dkq);
  } else
    par_for_rows("mamba3::rotate_bwd", rows * c.H, KOKKOS_LAMBDA(const Team& tm, index_t j) {
      const index_t rw = j / c.H, h = j % c.H, b = rw / c.L, t = rw % c.L;
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(tm, c.S), [&](index_t i) {
        index_t i0, i1;
        c.pair(i, i0, i1);
        P cs, sn;
        sin_cos(c.phi(b, h, t, i), sn, cs);
        P acc = 0;
        for (index_t r = 0; r < c.R; ++r)
          for (int which = 0; which < 2; ++which) {
            const index_t base = (which == 0 ? c.q_off : c.k_off) + (h * c.R + r) * c.N;
            P g0 = dqkv(rw, base + i0), g1 = dqkv(rw, base + i1);
            rot_pair_bwd(g0, g1, c.qkv(rw, base + i0), c.qkv(rw, base + i1), sn, cs, acc);
            dqkv(rw, base + i0) = g0;
            dqkv(rw, base + i1) = g1;
          }
        dphi(b, h, t, i) = acc;
      });
    });

  // Phase cumsum backward, in place: dphi(t) becomes the total gradient of the increment at t,
  //   run_t = dphi_t + [t + 1 continues t's record] run_{t+1}   (run_L = the final phase's gradient),
  // over the chunks in parallel as the forward: each chunk's sum flowing out to the left from 0, then per (row,
  // head, angle) from the right the sum flowing into each chunk, then each chunk's sums from it.
  {
    const auto fphi = dfin.phi;
    const auto dphi0 = gr.dinit.phi;
    PoolScope local;  // returned at the end of the block
    View4<P> flow = local.take<View4<P>>("mamba3::phase_flow", c.Bsz, c.H, c.nc, c.S);
    auto walk = [=] KOKKOS_FUNCTION(index_t b, index_t h, index_t ch, index_t i, P run, bool write) {
      for (index_t t = c.chunk_end(ch) - 1; t >= ch * c.Q; --t) {
        run += dphi(b, h, t, i);
        if (write) dphi(b, h, t, i) = run;
        if (t > 0 && !c.same(b, t, t - 1)) run = P(0);  // phi_t does not depend on the previous record
      }
      return run;
    };
    par_for("mamba3::phases_bwd_local", c.Bsz * c.H * c.nc, c.S, KOKKOS_LAMBDA(index_t bhc, index_t i) {
      const index_t ch = bhc % c.nc, bh = bhc / c.nc;
      flow(bh / c.H, bh % c.H, ch, i) = walk(bh / c.H, bh % c.H, ch, i, P(0), false);
    });
    par_for("mamba3::phases_bwd_carry", c.Bsz * c.H, c.S, KOKKOS_LAMBDA(index_t bh, index_t i) {
      const index_t b = bh / c.H, h = bh % c.H;
      P run = has_dfinal ? fphi(b, h, i) : P(0);
      for (index_t ch = c.nc - 1; ch >= 0; --ch) {
        const P own = flow(b, h, ch, i);
        flow(b, h, ch, i) = run;
        run = own + (c.same(b, c.chunk_end(ch) - 1, c.in_tok(ch)) ? run : P(0));
      }
      if (want_dinit) dphi0(b, h, i) = run;
    });
    par_for("mamba3::phases_bwd", c.Bsz * c.H * c.nc, c.S, KOKKOS_LAMBDA(index_t bhc, index_t i) {
      const index_t ch = bhc % c.nc, bh = bhc / c.nc;
      walk(bh / c.H, bh % c.H, ch, i, flow(bh / c.H, bh % c.H, ch, i), true);
    });
  }

  // Per-token chain: Delta, lambda, A_t -> dd_dt, dd_A, trap; dut keeps d(dd_dt) in the accumulation type.
  const auto ddd = gr.ddd;
  const index_t dt_o = c.dt_col - gr.col0, A_o = c.A_col - gr.col0, trap_o = c.trap_col - gr.col0,
                angle_o = c.angle_col - gr.col0;  // their columns in ddd
  View3<P> dut = ws.take<View3<P>>("mamba3::dut", c.Bsz, c.H, c.L);
  par_for("mamba3::token_bwd", c.Bsz * c.H, c.L, KOKKOS_LAMBDA(index_t bh, index_t t) {
    const index_t b = bh / c.H, h = bh % c.H;
    const P pi = Kokkos::numbers::pi_v<P>;
    const index_t rw = c.row(b, t);
    const P d = c.delta(b, h, t), lm = c.lam(b, h, t), A = c.Av(b, h, t), dat = da(b, h, t);
    const P dgam = dw(b, h, t) + ddg(b, h, t);
    const P dgp_prev = t > 0 ? (c.same(b, t, t - 1) ? dw(b, h, t - 1) : P(0)) : dgp0(b, h);
    P dphase = 0;
    for (index_t i = 0; i < c.S; ++i) dphase += dphi(b, h, t, i) * pi * Kokkos::tanh(P(c.dd(rw, c.angle_col + i)));
    const P ddelta = dgam * lm + dgp_prev * (P(1) - lm) + dat * A + dphase;
    const P dlam = (dgam - dgp_prev) * d;
    const P u = P(c.dd(rw, c.dt_col + h)) + c.dt_bias(h);
    const P du = ddelta * dsoftplus(u);
    const P xa = P(c.dd(rw, c.A_col + h));
    const P dxa = heavy_tail(xa) > c.A_floor ? -dat * d * dheavy_tail(xa) : P(0);
    ddd(rw, dt_o + h) = static_cast<T>(du);
    ddd(rw, A_o + h) = static_cast<T>(dxa);
    ddd(rw, trap_o + h) = static_cast<T>(dlam * lm * (P(1) - lm));
    dut(b, h, t) = du;
  });
  // Angles: dtheta_{t,i} = sum_h dphi_{t,h,i} pi (1 - tanh^2) Delta_{t,h}.
  par_for("mamba3::angles_bwd", rows, c.S, KOKKOS_LAMBDA(index_t rw, index_t i) {
    const index_t b = rw / c.L, t = rw % c.L;
    const P th = Kokkos::tanh(P(c.dd(rw, c.angle_col + i))), pi = Kokkos::numbers::pi_v<P>;
    P acc = 0;
    for (index_t h = 0; h < c.H; ++h) acc += dphi(b, h, t, i) * c.delta(b, h, t);
    ddd(rw, angle_o + i) = static_cast<T>(acc * pi * (P(1) - th * th));
  });
  // q and k: sum over the heads of each group (the quads' rotation backward formed these and the biases').
  const auto dqk = gr.dqk;
  const index_t q_col = in.q_col, k_col = in.k_col;
  if (!rotated) {
    par_for("mamba3::qk_group_reduce", rows, c.R * c.G * c.N, KOKKOS_LAMBDA(index_t rw, index_t rgn) {
      const index_t r = rgn / (c.G * c.N), g = (rgn / c.N) % c.G, n = rgn % c.N;
      P sq = 0, sk = 0;
      for (index_t h = g * c.hpg; h < (g + 1) * c.hpg; ++h) {
        sq += dqkv(rw, c.q_off + (h * c.R + r) * c.N + n);
        sk += dqkv(rw, c.k_off + (h * c.R + r) * c.N + n);
      }
      dqk(rw, q_col + rgn) = static_cast<T>(sq);
      dqk(rw, k_col + rgn) = static_cast<T>(sk);
    });
    // Parameter gradients, ordered sums over rows.
    // the q and k biases in one pass over the adjacent k and q columns (k_off, then q_off = k_off + H R N)
    {
      const index_t k_off = c.k_off;
      View1<P> dkq = ws.take<View1<P>>("mamba3::dkq_bias", 2 * HRN);
      column_reduce<P>("mamba3::dkq_bias", rows, 2 * HRN,
                       KOKKOS_LAMBDA(index_t i, index_t j) { return dqkv(i, k_off + j); }, dkq, false);
      add_bias_grads(dkq);
    }
  }
  const index_t L = c.L;
  column_reduce<P>("mamba3::ddt_bias", rows, c.H,
                   KOKKOS_LAMBDA(index_t i, index_t h) { return dut(i / L, h, i % L); }, gr.ddt_bias, true);
}

#define MM_INSTANTIATE(T)                                                                                     \
  template void mamba3_scan_forward<T>(const Mamba3ScanShape&, const Mamba3ScanIn<T>&, const View2<T>&,      \
                                       const Mamba3Carry<acc_t<T>>&, Mamba3ScanSaved<T>*, PoolScope*);      \
  template void mamba3_scan_backward<T>(const Mamba3ScanShape&, const Mamba3ScanIn<T>&, const View2<const T>&, \
                                        const Mamba3Carry<acc_t<T>>&, const Mamba3ScanGrad<T>&,                \
                                        const Mamba3ScanSaved<T>*);
MM_INSTANTIATE(float)
MM_INSTANTIATE(double)
#undef MM_INSTANTIATE

}  // namespace mm
