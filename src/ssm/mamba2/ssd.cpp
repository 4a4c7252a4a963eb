#include "ssm/mamba2/ssd.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "core/error.hpp"
#include "core/pool.hpp"
#include "ssm/mamba2/ssd_fused.hpp"

namespace mm {

void SSDShape::validate(const char* where) const {
  require(batch > 0 && seqlen > 0, where, "batch (", batch, ") and seqlen (", seqlen, ") must be positive");
  require(nheads > 0 && headdim > 0 && dstate > 0 && chunk > 0, where,
          "nheads, headdim, dstate and chunk must be positive");
  require(ngroups > 0 && nheads % ngroups == 0, where, "nheads (", nheads, ") is not divisible by ngroups (",
          ngroups, ")");
  require(dt_lo >= 0 && dt_hi > dt_lo, where, "dt_limit (", dt_lo, ", ", dt_hi, ") is not an interval in [0, inf)");
}

SSDGemmBlocks ssd_gemm_blocks(index_t nheads, index_t ngroups, double per_head_bytes, double budget_bytes) {
  const index_t hpg = nheads / ngroups;
  const index_t fit =
      std::max<index_t>(1, std::min<index_t>(nheads, index_t(budget_bytes / std::max(per_head_bytes, 1.0))));
  SSDGemmBlocks b;
  if (fit >= hpg) {
    b.heads = fit / hpg * hpg;  // whole groups
    b.runs = b.heads / hpg;
  } else {
    b.heads = fit;  // part of one group: the largest divisor of the heads per group that fits
    while (hpg % b.heads != 0) --b.heads;
    b.runs = 1;
  }
  return b;
}

namespace {

// Decay factors below this are dropped: such a source contributes less than 1e-30 of its value, far below any
// working precision, and dropping it keeps the arithmetic out of subnormal numbers, which run up to 100x slower on
// x86 (a trained model's strongly decaying heads made scoring 10x slower before this cutoff).
constexpr double kNegligibleDecay = 1e-30;

// GPU launch shape of the hierarchical kernels: 8 threads of 32 vector lanes (one warp each) per team.
constexpr int kTeam = 8, kVector = 32;
// The backward's token epilogue: 32 rows per team, 8 lanes per row (a headdim of 64 is 8 loads per lane in flight
// and a 3-step reduction tree, where 32 lanes gave 2 loads and 5 steps).
constexpr int kEpiRows = 32, kEpiLanes = 8;
// On-chip team scratch is asked for only up to this size (the default per-block limit of CUDA, less a margin);
// larger staging buffers (big headdim x d_state) go to global-memory scratch instead.
constexpr std::size_t kFastScratchLimit = 46 * 1024;

// Everything a kernel needs, copied by value into the lambdas.
template <class T>
struct Ctx {
  using P = acc_t<T>;
  View2<const T> xbc, dt;
  View2<const T> xs;  // x: SSDIn::x where given, else xbc (its column x_col + h P)
  View2<const bf16_op_t> bc16;  // SSDIn::bc_bf16 (B and C in bf16, fused kernels only), or empty
  index_t x_col, b_col, c_col, dt_col;
  View1<const P> A_log, dt_bias, D;
  SeqIdxView seq;
  index_t Bsz, L, H, Pd, G, N, Q, nc, hpg;
  P dt_lo, dt_hi;
  View3<P> delta, acs;  // (batch, H, L)
  View5<P> states;      // (batch, nchunks, H, P, N): chunk-local states, then the state entering each chunk
  View5<P> cb;          // (batch, nchunks, G, Q, Q): C_l . B_s for s <= l, shared by the heads of a group
  View3<const P> pa, pw;  // SSDIn::log_decay and weight (per_token: delta holds the weight), or empty
  View3<const P> dtok;    // SSDIn::D_token, or empty
  bool pre = false;
  std::uintptr_t* gptrs = nullptr;  // with G > 1: pointer arrays of the per-group GEMMs batched over groups

  KOKKOS_INLINE_FUNCTION index_t row(index_t b, index_t t) const { return b * L + t; }
  KOKKOS_INLINE_FUNCTION int rec(index_t b, index_t t) const { return seq.extent(0) > 0 ? seq(b, t) : 0; }
  // record of the state carried into chunk c (the last token of chunk c-1; the first token for c = 0)
  KOKKOS_INLINE_FUNCTION int rec_in(index_t b, index_t c) const { return c == 0 ? rec(b, 0) : rec(b, c * Q - 1); }
  KOKKOS_INLINE_FUNCTION index_t chunk_end(index_t c) const { return (c + 1) * Q < L ? (c + 1) * Q : L; }
  KOKKOS_INLINE_FUNCTION P x(index_t b, index_t t, index_t h, index_t p) const {
    return P(xs(row(b, t), x_col + h * Pd + p));
  }
  KOKKOS_INLINE_FUNCTION P Bm(index_t b, index_t t, index_t g, index_t n) const {
    return P(xbc(row(b, t), b_col + g * N + n));
  }
  KOKKOS_INLINE_FUNCTION P Cm(index_t b, index_t t, index_t g, index_t n) const {
    return P(xbc(row(b, t), c_col + g * N + n));
  }
  KOKKOS_INLINE_FUNCTION P A(index_t h) const { return -Kokkos::exp(A_log(h)); }
  // the skip coefficient of head h at token t: D_h, plus D_token where given
  KOKKOS_INLINE_FUNCTION P Dt(index_t b, index_t h, index_t t) const {
    return dtok.extent(0) > 0 ? D(h) + dtok(b, h, t) : D(h);
  }
  // the per-token exponent a_t of the decay (after dt_cumsum: delta holds Delta_t, or the given weight)
  KOKKOS_INLINE_FUNCTION P a_tok(index_t b, index_t h, index_t t) const {
    return pre ? pa(b, h, t) : delta(b, h, t) * A(h);
  }
  // League index of the per-(batch, chunk, head) kernels -> (b, ch, h), head fastest.
  KOKKOS_INLINE_FUNCTION void decode(index_t id, index_t& b, index_t& ch, index_t& h) const {
    h = id % H;
    ch = (id / H) % nc;
    b = id / (H * nc);
  }
  // Rows of x (P values of head h), B and C (N values of group g) of token t: contiguous.
  KOKKOS_INLINE_FUNCTION const T* xrow(index_t b, index_t t, index_t h) const {
    return &xs(row(b, t), x_col + h * Pd);
  }
  KOKKOS_INLINE_FUNCTION const T* brow(index_t b, index_t t, index_t g) const { return &xbc(row(b, t), b_col + g * N); }
  KOKKOS_INLINE_FUNCTION const T* crow(index_t b, index_t t, index_t g) const { return &xbc(row(b, t), c_col + g * N); }
};

// The call's context: the intermediates from `kept` when given and not empty (what a forward kept), else taken
// from `keep_pool` (when given: to outlive the call) or the call's own `ws`.
template <class T>
Ctx<T> make_ctx(const SSDShape& s, const SSDIn<T>& in, PoolScope& ws, PoolScope* keep_pool = nullptr,
                const SSDSaved<T>* kept = nullptr) {
  using P = acc_t<T>;
  s.validate("ssd");
  const bool pre = in.per_token();
  const bool b16 = in.bc_bf16.extent(0) > 0;
  const index_t in_rows = b16 ? index_t(in.bc_bf16.extent(0)) : index_t(in.xbc.extent(0));
  require(in_rows == s.batch * s.seqlen && (pre || index_t(in.dt.extent(0)) == s.batch * s.seqlen),
          "ssd", "inputs have ", in_rows, " rows, expected batch * seqlen = ", s.batch * s.seqlen);
  require(!b16 || (std::is_same_v<T, float> && in.x.extent(0) > 0 && (in.xbc.extent(0) == 0 ||
                   index_t(in.xbc.extent(0)) == s.batch * s.seqlen) &&
                   index_t(in.bc_bf16.extent(1)) >= std::max(in.b_col, in.c_col) + s.ngroups * s.dstate),
          "ssd", "bc_bf16 needs float activations, x as a matrix of its own (SSDIn::x) and the columns of B and C");
  auto per_token_shape = [&](const View3<const P>& v) {
    return index_t(v.extent(0)) == s.batch && index_t(v.extent(1)) == s.nheads && index_t(v.extent(2)) == s.seqlen;
  };
  require(!pre || (per_token_shape(in.log_decay) && per_token_shape(in.weight)), "ssd",
          "log_decay and weight must be (batch, nheads, seqlen) = (", s.batch, ", ", s.nheads, ", ", s.seqlen, ")");
  require(in.D_token.extent(0) == 0 || per_token_shape(in.D_token), "ssd",
          "D_token must be (batch, nheads, seqlen) = (", s.batch, ", ", s.nheads, ", ", s.seqlen, ")");
  require(in.seq_idx.extent(0) == 0 ||
              (index_t(in.seq_idx.extent(0)) == s.batch && index_t(in.seq_idx.extent(1)) == s.seqlen),
          "ssd", "seq_idx must be (batch, seqlen)");
  require(in.x.extent(0) == 0 || (index_t(in.x.extent(0)) == s.batch * s.seqlen &&
                                  index_t(in.x.extent(1)) >= in.x_col + s.nheads * s.headdim),
          "ssd", "x has ", in.x.extent(0), " rows and ", in.x.extent(1), " columns, expected batch * seqlen = ",
          s.batch * s.seqlen, " rows and columns from x_col = ", in.x_col, " for nheads * headdim = ",
          s.nheads * s.headdim);
  Ctx<T> c;
  c.xbc = in.xbc;
  c.xs = in.x.extent(0) > 0 ? in.x : in.xbc;
  c.bc16 = in.bc_bf16;
  c.dt = in.dt;
  c.x_col = in.x_col;
  c.b_col = in.b_col;
  c.c_col = in.c_col;
  c.dt_col = in.dt_col;
  c.A_log = in.A_log;
  c.dt_bias = in.dt_bias;
  c.D = in.D;
  c.seq = in.seq_idx;
  c.pa = in.log_decay;
  c.pw = in.weight;
  c.dtok = in.D_token;
  c.pre = pre;
  c.Bsz = s.batch;
  c.L = s.seqlen;
  c.H = s.nheads;
  c.Pd = s.headdim;
  c.G = s.ngroups;
  c.N = s.dstate;
  c.Q = s.chunk;
  c.nc = s.nchunks();
  c.hpg = s.nheads / s.ngroups;
  c.dt_lo = P(s.dt_lo);
  c.dt_hi = std::isinf(s.dt_hi) ? Kokkos::Experimental::finite_max_v<P> : P(s.dt_hi);
  if (kept && !kept->empty()) {
    auto is = [](const auto& v, std::initializer_list<index_t> ext) {
      int i = 0;
      for (index_t e : ext)
        if (index_t(v.extent(i++)) != e) return false;
      return true;
    };
    require(is(kept->delta, {s.batch, s.nheads, s.seqlen}) && is(kept->acs, {s.batch, s.nheads, s.seqlen}) &&
                is(kept->states, {s.batch, c.nc, s.nheads, s.headdim, s.dstate}) &&
                is(kept->cb, {s.batch, c.nc, s.ngroups, s.chunk, s.chunk}),
            "ssd_backward", "the kept forward intermediates do not match the shape (batch ", s.batch, ", seqlen ",
            s.seqlen, ", nheads ", s.nheads, ", chunk ", s.chunk, ")");
    c.delta = kept->delta;
    c.acs = kept->acs;
    c.states = kept->states;
    c.cb = kept->cb;
  } else {
    PoolScope& at = keep_pool ? *keep_pool : ws;
    c.delta = at.take<View3<P>>("ssd::delta", s.batch, s.nheads, s.seqlen);
    c.acs = at.take<View3<P>>("ssd::acs", s.batch, s.nheads, s.seqlen);
    c.states = at.take<View5<P>>("ssd::states", s.batch, c.nc, s.nheads, s.headdim, s.dstate);
    c.cb = at.take<View5<P>>("ssd::cb", s.batch, c.nc, s.ngroups, s.chunk, s.chunk);
  }
  if (s.ngroups > 1)
    c.gptrs = ws.take<View1<std::uintptr_t>>("ssd::group_pointers", 3 * s.ngroups * s.batch * c.nc).data();
  return c;
}

// Where a backward writes dx: head h of token row r at p + r ld + h P (SSDGrad::dx from its dx_col where given,
// else dxbc's x columns).
template <class T>
struct DxOut {
  T* p;
  index_t ld;
};
template <class T>
DxOut<T> dx_out(const Ctx<T>& c, const SSDGrad<T>& gr) {
  if (gr.dx.extent(0) > 0) return {gr.dx.data() + gr.dx_col, index_t(gr.dx.stride(0))};
  return {gr.dxbc.data() + c.x_col, index_t(gr.dxbc.stride(0))};
}

// Segments of team_inclusive_scan: the scratch its totals take (the most segments a team scans in).
constexpr int kScanSegments = 32;

// In team scratch: out(i) = sum_{j <= i} in(j) for i < n (reverse: sum_{j >= i}); tot holds kScanSegments values.
// Each thread of the team (up to kScanSegments) scans one contiguous segment of the order on its vector lanes,
// then adds the totals of the segments before its own; with one thread a team (host backends) that is the
// sequential loop. (A single thread's serial loop over the chunk left the other 255 of a GPU team idle.) Ends
// with a team barrier.
template <class P>
KOKKOS_INLINE_FUNCTION void team_inclusive_scan(const Team& tm, index_t n, bool reverse, const Scratch1<P>& in,
                                                const Scratch1<P>& out, const Scratch1<P>& tot) {
  const int nt = tm.team_size() < kScanSegments ? tm.team_size() : kScanSegments;
  const index_t seg = (n + nt - 1) / nt;
  // (ThreadVectorRange from 0: the CUDA vector scan of Kokkos 4.6 ignores a range's start)
  Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nt), [&](int k) {
    const index_t i0 = k * seg, len = Kokkos::max(index_t(0), Kokkos::min(n, i0 + seg) - i0);
    P total = 0;
    Kokkos::parallel_scan(
        Kokkos::ThreadVectorRange(tm, len),
        [&](index_t j, P& acc, bool final) {
          const index_t i = reverse ? n - 1 - (i0 + j) : i0 + j;
          acc += in(i);
          if (final) out(i) = acc;
        },
        total);
    Kokkos::single(Kokkos::PerThread(tm), [&]() { tot(k) = total; });
  });
  tm.team_barrier();
  Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nt), [&](int k) {
    const index_t i0 = k * seg, len = Kokkos::max(index_t(0), Kokkos::min(n, i0 + seg) - i0);
    P off = 0;
    for (int j = 0; j < k; ++j) off += tot(j);
    if (k > 0)
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(tm, len), [&](index_t j) {
        out(reverse ? n - 1 - (i0 + j) : i0 + j) += off;
      });
  });
  tm.team_barrier();
}

// Delta (or the given per-token weight) and the in-chunk inclusive cumsum of a = Delta * A (or the given per-token
// exponent).
template <class T>
void dt_cumsum(const Ctx<T>& c) {
  using P = acc_t<T>;
  // One team per (row, head, chunk): Delta of every token in parallel into scratch, then the team's scan on chip
  // (team_inclusive_scan), then the cumsum written in parallel. (A thread per (row, head, chunk) walking its chunk
  // in global memory took 0.24 ms per call on an H200.)
  par_for_team_vec(
      "ssd::dt_cumsum", c.Bsz * c.H * c.nc, kTeam, kVector,
      KOKKOS_LAMBDA(const Team& tm) {
        const index_t id = tm.league_rank(), ch = id % c.nc, bh = id / c.nc, b = bh / c.H, h = bh % c.H;
        const index_t t0 = ch * c.Q, q = c.chunk_end(ch) - t0;
        Scratch1<P> d(tm.team_scratch(0), c.Q), a(tm.team_scratch(0), c.Q), tot(tm.team_scratch(0), kScanSegments);
        Kokkos::parallel_for(Kokkos::TeamVectorRange(tm, q), [&](index_t i) {
          const index_t t = t0 + i;
          if (c.pre) {
            c.delta(b, h, t) = c.pw(b, h, t);
            d(i) = c.pa(b, h, t);
            return;
          }
          P v = softplus(P(c.dt(c.row(b, t), c.dt_col + h)) + c.dt_bias(h));
          v = v < c.dt_lo ? c.dt_lo : (v > c.dt_hi ? c.dt_hi : v);
          d(i) = v * c.A(h);
          c.delta(b, h, t) = v;
        });
        tm.team_barrier();
        team_inclusive_scan(tm, q, false, d, a, tot);
        Kokkos::parallel_for(Kokkos::TeamVectorRange(tm, q), [&](index_t i) { c.acs(b, h, t0 + i) = a(i); });
      },
      2 * Scratch1<P>::shmem_size(c.Q) + Scratch1<P>::shmem_size(kScanSegments));
}

// states(b, c, h) = sum_{s in c, same record as the chunk's last token} exp(Acs_last - Acs_s) Delta_s x_s B_s^T
// Threads over p, vector lanes over n (coalesced rows of B), the per-token weight computed once per team.
template <class T>
void chunk_state(const Ctx<T>& c) {
  using P = acc_t<T>;
  par_for_team_vec(
      "ssd::chunk_state", c.Bsz * c.nc * c.H, kTeam, kVector,
      KOKKOS_LAMBDA(const Team& tm) {
        const index_t id = tm.league_rank();
        index_t b, ch, h;
        c.decode(id, b, ch, h);
        const index_t g = h / c.hpg, t0 = ch * c.Q, t1 = c.chunk_end(ch), last = t1 - 1;
        const P acs_last = c.acs(b, h, last);
        const int r_last = c.rec(b, last);
        Scratch1<P> wt(tm.team_scratch(0), c.Q);  // exp(Acs_last - Acs_s) Delta_s, 0 where cut off
        Kokkos::parallel_for(Kokkos::TeamVectorRange(tm, t0, t1), [&](index_t s2) {
          const P e = exp_nonpos(acs_last - c.acs(b, h, s2));
          wt(s2 - t0) = (c.rec(b, s2) != r_last || e < P(kNegligibleDecay)) ? P(0) : e * c.delta(b, h, s2);
        });
        tm.team_barrier();
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, c.Pd), [&](index_t p) {
          Kokkos::parallel_for(Kokkos::ThreadVectorRange(tm, c.N), [&](index_t n) {
            P acc = 0;
            for (index_t s2 = t0; s2 < t1; ++s2) {
              const P w = wt(s2 - t0);
              if (w == P(0)) continue;
              acc += w * c.x(b, s2, h, p) * c.Bm(b, s2, g, n);
            }
            c.states(b, ch, h, p, n) = acc;
          });
        });
      },
      Scratch1<P>::shmem_size(c.Q), 0, 0);
}

// cb(b, c, g, l, s) = C_l . B_s for s <= l within chunk c (the Q x Q "bmm" of the SSD; records are masked later).
// Threads over l, a vector-lane reduction over n per (l, s).
template <class T>
void chunk_bmm(const Ctx<T>& c) {
  using P = acc_t<T>;
  par_for_team_vec("ssd::bmm", c.Bsz * c.nc * c.G, kTeam, kVector, KOKKOS_LAMBDA(const Team& tm) {
    const index_t id = tm.league_rank();
    const index_t g = id % c.G, ch = (id / c.G) % c.nc, b = id / (c.G * c.nc);
    const index_t t0 = ch * c.Q, q = c.chunk_end(ch) - t0;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, q), [&](index_t il) {
      const T* Cl = c.crow(b, t0 + il, g);
      for (index_t is = 0; is <= il; ++is) {
        const T* Bs = c.brow(b, t0 + is, g);
        P acc = 0;
        Kokkos::parallel_reduce(
            Kokkos::ThreadVectorRange(tm, c.N), [&](index_t n, P& a) { a += P(Cl[n]) * P(Bs[n]); }, acc);
        Kokkos::single(Kokkos::PerThread(tm), [&]() { c.cb(b, ch, g, il, is) = acc; });
      }
    });
  });
}

// Whether the (p, n) elements of states at these base pointers (null: absent) can go 4 at a time as 16-byte
// accesses: float data, N a multiple of 4, every base 16-byte aligned.
template <class P>
bool states_by_four(index_t N, std::initializer_list<const void*> bases) {
  if (!std::is_same_v<P, float> || N % 4 != 0) return false;
  for (const void* p : bases)
    if (p != nullptr && !aligned16(p)) return false;
  return true;
}

// In place: states(b, c) becomes the state entering chunk c; final (if non-empty) gets the state after the last.
// Each work item walks VW consecutive (p, n) elements through the chunks (VW = 4: one 16-byte access per chunk; with
// one 4-byte value per thread the pass ran near 1.8 TB/s on an H200), with the loads of the next kAhead chunks, the
// states and the chunks' decay factors, in flight (rings in registers, the chunk loop unrolled by kAhead) while the
// chain runs. The decay's loads (the cumsum and the record ids) matter most: read in the chunk's own iteration they
// come after the previous chunk's store, which the compiler cannot move them above (the arrays might alias), so
// every chunk waited one load's latency: at batch 1 x 65,536 (256 chunks) on an H200 the pass took 0.199 ms
// (forward) and 0.248 ms (backward) with the states alone kAhead ahead, as with one ahead, and 0.179 / 0.237 ms with
// the decays ahead too (about 2.25 TB/s forward; perf/RESULTS.md, twenty-ninth session).
constexpr int kAhead = 4;

// The factor a state is carried by across chunk ch (zero where a record starts inside it).
template <class T>
KOKKOS_INLINE_FUNCTION acc_t<T> chunk_decay(const Ctx<T>& c, index_t b, index_t h, index_t ch) {
  const index_t last = c.chunk_end(ch) - 1;
  return c.rec(b, last) == c.rec_in(b, ch) ? exp_nonpos(c.acs(b, h, last)) : acc_t<T>(0);
}

template <int VW, class T>
void state_passing_vw(const Ctx<T>& c, const View4<const acc_t<T>>& init, const View4<acc_t<T>>& final_state) {
  using P = acc_t<T>;
  const bool has_init = init.extent(0) > 0, has_final = final_state.extent(0) > 0;
  const index_t cstride = c.H * c.Pd * c.N;
  par_for("ssd::state_passing", c.Bsz * c.H, c.Pd * c.N / VW, KOKKOS_LAMBDA(index_t bh, index_t q) {
    const index_t b = bh / c.H, h = bh % c.H, pn = q * VW, p = pn / c.N, n = pn % c.N;
    P* st = &c.states(b, 0, h, p, n);
    P H[VW], ring[kAhead][VW] = {}, dring[kAhead] = {};
    if (has_init)
      load_vec<VW>(&init(b, h, p, n), H);
    else
      for (int k = 0; k < VW; ++k) H[k] = P(0);
    for (int j = 0; j < kAhead; ++j)
      if (j < c.nc) {
        load_vec<VW>(st + j * cstride, ring[j]);
        dring[j] = chunk_decay(c, b, h, j);
      }
    for (index_t c0 = 0; c0 < c.nc; c0 += kAhead) {
      MM_UNROLL
      for (int j = 0; j < kAhead; ++j) {  // (unrolled: ring[j] stays in registers)
        const index_t ch = c0 + j;
        if (ch >= c.nc) break;
        P local[VW];
        for (int k = 0; k < VW; ++k) local[k] = ring[j][k];
        const P decay = dring[j];
        if (ch + kAhead < c.nc) {
          load_vec<VW>(st + (ch + kAhead) * cstride, ring[j]);
          dring[j] = chunk_decay(c, b, h, ch + kAhead);
        }
        store_vec<VW>(st + ch * cstride, H);
        for (int k = 0; k < VW; ++k) H[k] = decay * H[k] + local[k];
      }
    }
    if (has_final) store_vec<VW>(&final_state(b, h, p, n), H);
  });
}
template <class T>
void state_passing(const Ctx<T>& c, const View4<const acc_t<T>>& init, const View4<acc_t<T>>& final_state) {
  if constexpr (std::is_same_v<acc_t<T>, float>)
    if (states_by_four<acc_t<T>>(c.N, {c.states.data(), init.data(), final_state.data()}))
      return state_passing_vw<4, T>(c, init, final_state);
  state_passing_vw<1, T>(c, init, final_state);
}

// Reverse state passing, in place: dstates(b, c) (on entry dL/dS_in(c) from chunk c's own outputs) becomes
// dL/dH_c (the state at the end of chunk c); dinit = dL/dH_{-1}. Where dhb is not null, dL/dH_c also goes there
// rounded to bf16 (same layout as dstates: the bf16 state terms' operand, without a pass that reads dH again).
// Work items as in state_passing.
template <int VW, class T>
void state_passing_bwd_vw(const Ctx<T>& c, const View5<acc_t<T>>& dstates, const View4<const acc_t<T>>& dfinal_state,
                          const View4<acc_t<T>>& dinit, bf16_op_t* dhb) {
  using P = acc_t<T>;
  const bool has_dfinal = dfinal_state.extent(0) > 0, has_dinit = dinit.extent(0) > 0, has_dhb = dhb != nullptr;
  const index_t cstride = c.H * c.Pd * c.N;
  par_for("ssd::state_passing_bwd", c.Bsz * c.H, c.Pd * c.N / VW, KOKKOS_LAMBDA(index_t bh, index_t q) {
    const index_t b = bh / c.H, h = bh % c.H, pn = q * VW, p = pn / c.N, n = pn % c.N;
    P* st = &dstates(b, 0, h, p, n);
    P dH[VW], ring[kAhead][VW] = {}, dring[kAhead] = {};
    if (has_dfinal)
      load_vec<VW>(&dfinal_state(b, h, p, n), dH);
    else
      for (int k = 0; k < VW; ++k) dH[k] = P(0);
    for (int j = 0; j < kAhead; ++j)
      if (j < c.nc) {
        load_vec<VW>(st + (c.nc - 1 - j) * cstride, ring[j]);
        dring[j] = chunk_decay(c, b, h, c.nc - 1 - j);
      }
    for (index_t r0 = 0; r0 < c.nc; r0 += kAhead) {  // r: chunks from the last
      MM_UNROLL
      for (int j = 0; j < kAhead; ++j) {
        const index_t r = r0 + j, ch = c.nc - 1 - r;
        if (ch < 0) break;
        P from_outputs[VW];
        for (int k = 0; k < VW; ++k) from_outputs[k] = ring[j][k];
        const P decay = dring[j];
        if (ch - kAhead >= 0) {
          load_vec<VW>(st + (ch - kAhead) * cstride, ring[j]);
          dring[j] = chunk_decay(c, b, h, ch - kAhead);
        }
        store_vec<VW>(st + ch * cstride, dH);
        if (has_dhb) store_bf16_op_vec<VW>(dhb + (st - dstates.data()) + ch * cstride, dH);
        for (int k = 0; k < VW; ++k) dH[k] = from_outputs[k] + decay * dH[k];
      }
    }
    if (has_dinit) store_vec<VW>(&dinit(b, h, p, n), dH);
  });
}
template <class T>
void state_passing_bwd(const Ctx<T>& c, const View5<acc_t<T>>& dstates, const View4<const acc_t<T>>& dfinal_state,
                       const View4<acc_t<T>>& dinit, bf16_op_t* dhb = nullptr) {
  if constexpr (std::is_same_v<acc_t<T>, float>)
    if (states_by_four<acc_t<T>>(c.N, {dstates.data(), dfinal_state.data(), dinit.data()}) &&
        reinterpret_cast<std::uintptr_t>(dhb) % 8 == 0)
      return state_passing_bwd_vw<4, T>(c, dstates, dfinal_state, dinit, dhb);
  state_passing_bwd_vw<1, T>(c, dstates, dfinal_state, dinit, dhb);
}

// The per-(b, c, h) partial sums of dA, d dt_bias, dD summed over (batch, chunk) in order into the parameter
// gradients.
template <class T>
void param_reduce(const Ctx<T>& c, const View4<acc_t<T>>& partial, const SSDGrad<T>& gr) {
  using P = acc_t<T>;
  // Per-head parameter gradients, summed over (batch, chunk) in order.
  const auto dA_log = gr.dA_log;
  const auto ddt_bias = gr.ddt_bias;
  const auto dD = gr.dD;
  par_for("ssd::param_reduce", c.H, KOKKOS_LAMBDA(index_t h) {
    P sa = 0, sb = 0, sd = 0;
    for (index_t b = 0; b < c.Bsz; ++b)
      for (index_t ch = 0; ch < c.nc; ++ch) {
        sa += partial(b, ch, h, 0);
        sb += partial(b, ch, h, 1);
        sd += partial(b, ch, h, 2);
      }
    if (!c.pre) {  // per-token decays and weights: their gradients were written per token
      dA_log(h) += sa * c.A(h);  // dA/dA_log = A
      ddt_bias(h) += sb;
    }
    dD(h) += sd;
  });
}

// dB and dC summed over the heads of each group into the input's gradient columns; the per-(b, c, h) partial
// sums of dA, d dt_bias, dD summed over (batch, chunk) in order into the parameter gradients.
template <class T>
void group_param_reduce(const Ctx<T>& c, const View3<acc_t<T>>& dBh, const View3<acc_t<T>>& dCh,
                        const View4<acc_t<T>>& partial, const SSDGrad<T>& gr) {
  using P = acc_t<T>;
  const auto dxbc = gr.dxbc;
  // Sum dB and dC over the heads of each group into the input's gradient columns.
  par_for("ssd::group_reduce", c.Bsz * c.L, c.G * c.N, KOKKOS_LAMBDA(index_t r, index_t gn) {
    const index_t g = gn / c.N, n = gn % c.N;
    P sb = 0, sc = 0;
    for (index_t h = g * c.hpg; h < (g + 1) * c.hpg; ++h) {
      sb += dBh(r, h, n);
      sc += dCh(r, h, n);
    }
    dxbc(r, c.b_col + g * c.N + n) = static_cast<T>(sb);
    dxbc(r, c.c_col + g * c.N + n) = static_cast<T>(sc);
  });
  param_reduce(c, partial, gr);
}

// ------------------------------------------------------------------ the GEMM formulation (SSDAlgo::gemm)
//
// Per (row b, chunk c, head h), chunk tokens l, s in [0, q), a = Acs (in-chunk inclusive cumsum of Delta A):
//   E(l, s)  = [s <= l, same record, exp(a_l - a_s) >= cutoff] exp(a_l - a_s)       (the decay mask)
//   M(l, s)  = (C_l . B_s) E(l, s) Delta_s
//   e_in(l)  = [rec(l) == rec_in, cutoff] exp(a_l),   es(s) = [rec(s) == rec(last), cutoff] exp(a_last - a_s)
//   forward:  S_loc = sum_s es(s) Delta_s x_s B_s^T,  y = e_in . (C S_in^T) + M X + D x
//   backward: DX = dY X^T; dX = M^T dY + diag(Delta es) B dH^T + D dY; dCB = DX o E Delta_s;
//             dC = (sum_h dCB) B + diag(e_in) dY S_in; dB = (sum_h dCB)^T C + diag(Delta es) X dH;
//             dS_in(local) = (diag(e_in) dY)^T C, then the reverse state passing gives dH per chunk.
// B and C are shared by the heads of a group, so the products with them take all the group's heads at once (the
// heads side by side in x, y and the states: a GEMM dimension of (heads per group) P), and the sums over heads in
// dB and dC are the K dimension of one GEMM. Products with a per-head Q x Q matrix (M X, dY X^T, M^T dY) are one
// two-level batched GEMM over (chunk, head) per block of heads, whose Q x Q matrices live in a workspace of at most
// SSDShape::gemm_workspace_bytes.
constexpr index_t kQ = -1;  // "the chunk length" in chunk_gemm's dimensions
constexpr index_t kRowSlab = 32;  // output rows per team of the backward's row kernel

// One operand of a per-chunk GEMM: token-indexed (chunk (b, c) starts at row b L + c Q of a row-major matrix with
// row stride ld) or chunk-indexed (blocks of `bs` elements, block b nc + c, row stride ld inside a block); `hs`
// is the step between the heads of a two-level batch.
template <class Ptr>
struct ChunkOp {
  Ptr p;
  index_t ld;
  bool token;
  index_t bs;
  index_t hs = 0;
};
template <class Ptr>
ChunkOp<Ptr> tok(Ptr p, index_t ld, index_t hs = 0) {
  return {p, ld, true, 0, hs};
}
template <class Ptr>
ChunkOp<Ptr> blk(Ptr p, index_t ld, index_t bs, index_t hs = 0) {
  return {p, ld, false, bs, hs};
}

// The chunk GEMMs' batches: call(b, ch, count, q) for runs of `count` chunks of q tokens starting at chunk ch of
// row b, and the pieces of an operand there: chunk_dim (a size, or kQ: the chunk's length), chunk_stride (the step
// between chunks), chunk_at (chunk ch of row b). All chunks in one run when Q divides L; else per row, the shorter
// last chunk apart.
template <class T, class Call>
void over_chunk_runs(const Ctx<T>& c, const Call& call) {
  const index_t tail = c.L - (c.nc - 1) * c.Q;
  if (tail == c.Q) {
    call(0, 0, c.Bsz * c.nc, c.Q);  // row b chunk c is batch entry b nc + c for both kinds of operand
    return;
  }
  for (index_t b = 0; b < c.Bsz; ++b) {
    if (c.nc > 1) call(b, 0, c.nc - 1, c.Q);
    call(b, c.nc - 1, 1, tail);
  }
}
inline index_t chunk_dim(index_t d, index_t q) { return d == kQ ? q : d; }
template <class T, class Ptr>
index_t chunk_stride(const Ctx<T>& c, const ChunkOp<Ptr>& o) {
  return o.token ? c.Q * o.ld : o.bs;
}
template <class T, class Ptr>
Ptr chunk_at(const Ctx<T>& c, const ChunkOp<Ptr>& o, index_t b, index_t ch) {
  return o.p + (o.token ? (b * c.L + ch * c.Q) * o.ld : (b * c.nc + ch) * o.bs);
}

// C_ji = alpha op(A_ji) op(B_ji) + beta C_ji for every chunk j = (b, c) and head i < ni of the operands' head
// steps; m, n, k are sizes or kQ (the chunk's length: Q, or the shorter last chunk when Q does not divide L, which
// gets its own call per row).
template <class T>
void chunk_gemm(const Ctx<T>& c, GemmCompute cmp, Trans ta, Trans tb, index_t m, index_t n, index_t k, T alpha,
                ChunkOp<const T*> A, ChunkOp<const T*> B, T beta, ChunkOp<T*> C, index_t ni = 1,
                std::uintptr_t* pointers = nullptr) {
  over_chunk_runs(c, [&](index_t b, index_t ch, index_t count, index_t q) {
    gemm_batched_2d(ta, tb, chunk_dim(m, q), chunk_dim(n, q), chunk_dim(k, q), alpha, chunk_at(c, A, b, ch), A.ld,
                    chunk_stride(c, A), A.hs, chunk_at(c, B, b, ch), B.ld, chunk_stride(c, B), B.hs, beta,
                    chunk_at(c, C, b, ch), C.ld, chunk_stride(c, C), C.hs, count, ni, cmp, pointers);
  });
}

// chunk_gemm's products on bf16 operands (fp32 accumulation and output; gemm_bf16_f32_batched): one strided
// batched call per head step i < ni (and per row for a short last chunk), alpha = 1.
template <class T>
void chunk_gemm_bf16(const Ctx<T>& c, Trans ta, Trans tb, index_t m, index_t n, index_t k,
                     ChunkOp<const bf16_op_t*> A, ChunkOp<const bf16_op_t*> B, float beta, ChunkOp<float*> C,
                     index_t ni = 1) {
  over_chunk_runs(c, [&](index_t b, index_t ch, index_t count, index_t q) {
    for (index_t i = 0; i < ni; ++i)
      gemm_bf16_f32_batched(ta, tb, chunk_dim(m, q), chunk_dim(n, q), chunk_dim(k, q), 1.0f,
                            chunk_at(c, A, b, ch) + i * A.hs, A.ld, chunk_stride(c, A),
                            chunk_at(c, B, b, ch) + i * B.hs, B.ld, chunk_stride(c, B), beta,
                            chunk_at(c, C, b, ch) + i * C.hs, C.ld, chunk_stride(c, C), count);
  });
}

// For every token row r and column hp = (head h, p) of the H P-wide token matrices: body(r, hp, h, s) with
// s = factor(b, h, t) computed once per (token, head) into team scratch, not once per element (an exp and two
// gathered loads of the (B, H, L) decay arrays per element). One team per row, lanes over the columns.
template <class T, class S, class Body>
void per_token_heads(const char* label, const Ctx<T>& c, const S& factor, const Body& body) {
  par_for_team_vec(
      label, c.Bsz * c.L, kTeam, kVector,
      KOKKOS_LAMBDA(const Team& tm) {
        const index_t r = tm.league_rank(), b = r / c.L, t = r - b * c.L;
        Scratch1<T> f(tm.team_scratch(0), c.H);
        Kokkos::parallel_for(Kokkos::TeamVectorRange(tm, int(c.H)), [&](int h) { f(h) = factor(b, index_t(h), t); });
        tm.team_barrier();
        const int Pd = int(c.Pd);
        Kokkos::parallel_for(Kokkos::TeamVectorRange(tm, int(c.H * c.Pd)), [&](int hp) {
          const int h = hp / Pd;
          body(r, hp, h, f(h));
        });
      },
      Scratch1<T>::shmem_size(c.H));
}

// dst(r, hp) = factor(b, h, t) src(r, hp) for every token row r = b L + t and column hp = (head h, p) of the H P-wide
// token matrices (rows lds and ldd apart): VW consecutive columns of one head a work item, the factor computed per
// item (the lanes of a warp cover two heads of 64, so its gathered loads are mostly broadcasts). As a team per row
// with one 4-byte value a lane (per_token_heads) these passes moved about 2.3 TB/s on an H200.
// VW values to p: rounded to bf16 operand storage (kB16) or as they are. (A function of its own: an extended
// device lambda cannot hold the constexpr-if.)
template <bool kB16, int VW, class D, class P>
KOKKOS_INLINE_FUNCTION void store_scaled(D* p, const P (&v)[VW]) {
  if constexpr (kB16)
    store_bf16_op_vec<VW>(p, v);
  else
    store_vec<VW>(p, v);
}

// (kB16: dst is bf16 operand storage, the scaled values rounded to it; D is then bf16_op_t, which on host builds is
// float itself, hence the flag and not the type)
template <int VW, bool kB16 = false, class T, class D, class S>
void scale_token_heads_vw(const char* label, const Ctx<T>& c, const S& factor, const T* src, index_t lds, D* dst,
                          index_t ldd) {
  const index_t Pd = c.Pd, L = c.L;
  par_for(label, c.Bsz * c.L, c.H * c.Pd / VW, KOKKOS_LAMBDA(index_t r, index_t j) {
    const index_t hp = j * VW, b = r / L;
    const T f = factor(b, hp / Pd, r - b * L);
    T v[VW];
    load_vec<VW>(src + r * lds + hp, v);
    for (int k = 0; k < VW; ++k) v[k] *= f;
    store_scaled<kB16, VW>(dst + r * ldd + hp, v);
  });
}
template <class T, class S>
void scale_token_heads(const char* label, const Ctx<T>& c, const S& factor, const T* src, index_t lds, T* dst,
                       index_t ldd) {
  if constexpr (std::is_same_v<T, float>)
    if (c.Pd % 4 == 0 && float4_rows({{src, lds}, {dst, ldd}}))
      return scale_token_heads_vw<4>(label, c, factor, src, lds, dst, ldd);
  scale_token_heads_vw<1>(label, c, factor, src, lds, dst, ldd);
}

// scale_token_heads with the scaled values rounded to bf16 operand storage (the fused backward's state-term GEMM
// operands: half the bytes of the fp32 copy to write and for the GEMM to read).
template <class S>
void scale_token_heads_bf16(const char* label, const Ctx<float>& c, const S& factor, const float* src, index_t lds,
                            bf16_op_t* dst, index_t ldd) {
  if (c.Pd % 4 == 0 && bf16_rows_by_four(src, lds, dst, ldd))
    return scale_token_heads_vw<4, true>(label, c, factor, src, lds, dst, ldd);
  scale_token_heads_vw<1, true>(label, c, factor, src, lds, dst, ldd);
}

// Views and sizes shared by the forward and backward of the GEMM formulation.
template <class T>
struct GemmCtx {
  index_t ldx, HP, hb, runs, run_len;  // xbc row stride, H P, heads per workspace block, runs per block and heads per run
  View2<T> xw;                                // (B L, H P): es(s) Delta_s x_s, the chunk-state operand
  View4<T> w1;                                // (hb, B nc, Q, Q): M or DX per head of a block
  View4<T> w2;                                // (runs, B nc, Q, Q): dCB summed over the heads of each run
  View1<std::uintptr_t> ptrs;                 // (3 hb B nc): operand pointers of the (chunk, head) GEMMs
};

// The per-head bytes by which the GEMM formulation sizes its blocks of heads (ssd_gemm_blocks): a Q x Q workspace
// per (row, chunk), or where the fused backward runs (per_head_qq false: no such workspace) its per-head arrays,
// the six per-token sums and the incoming sums' parts (ssd_fused_head_bytes).
inline double gemm_head_bytes(bool per_head_qq, index_t batch, index_t seqlen, index_t nchunks, index_t Q,
                              std::size_t elem) {
  return per_head_qq ? double(batch * nchunks) * double(Q * Q) * double(elem)
                     : ssd_fused_head_bytes(double(batch * seqlen), Q, double(elem));
}

// (skip_xw_for_groups: no xw where the blocks of heads are whole groups: the fused backward from a kept context
// under BcForm::kernel, which never reads it; skip_xw: none in any case, the fused backward's bf16 state terms,
// which take a bf16 xw of their own)
template <class T>
GemmCtx<T> make_gemm_ctx(const Ctx<T>& c, double budget, bool backward, PoolScope& ws, bool per_head_qq = true,
                         bool skip_xw_for_groups = false, bool skip_xw = false) {
  GemmCtx<T> g;
  g.ldx = index_t(c.xbc.stride(0));
  g.HP = c.H * c.Pd;
  // heads per block: as many per-head workspaces as the budget holds
  const SSDGemmBlocks bl =
      ssd_gemm_blocks(c.H, c.G, gemm_head_bytes(per_head_qq, c.Bsz, c.L, c.nc, c.Q, sizeof(T)), budget);
  g.hb = bl.heads;
  g.runs = bl.runs;
  g.run_len = g.hb / g.runs;
  if (!skip_xw && !(skip_xw_for_groups && g.run_len == c.hpg)) g.xw = ws.take<View2<T>>("ssd::xw", c.Bsz * c.L, g.HP);
  if (per_head_qq) {  // the fused backward needs neither the per-head Q x Q workspace nor the pointer arrays
    g.w1 = ws.take<View4<T>>("ssd::qq1", g.hb, c.Bsz * c.nc, c.Q, c.Q);
    g.ptrs = ws.take<View1<std::uintptr_t>>("ssd::gemm_pointers", 3 * g.hb * c.Bsz * c.nc);
  }
  if (backward) g.w2 = ws.take<View4<T>>("ssd::qq2", g.runs, c.Bsz * c.nc, c.Q, c.Q);
  return g;
}

// C B^T of every chunk and group (into c.cb).
template <class T>
void chunk_cb(const Ctx<T>& c, GemmCompute cmp) {
  const T* X = c.xbc.data();
  const index_t ldx = index_t(c.xbc.stride(0));
  chunk_gemm<T>(c, cmp, Trans::N, Trans::T, kQ, kQ, c.N, T(1), tok(X + c.c_col, ldx, c.N), tok(X + c.b_col, ldx, c.N),
                T(0), blk(c.cb.data(), c.Q, c.G * c.Q * c.Q, c.Q * c.Q), c.G, c.gptrs);
}

// es(t) Delta_t of head h at token t of row b: the weight of x_t in its chunk's state.
template <class T>
KOKKOS_INLINE_FUNCTION T state_weight_of(const Ctx<T>& c, index_t b, index_t h, index_t t) {
  const index_t last = c.chunk_end(t / c.Q) - 1;
  const T e = exp_nonpos(c.acs(b, h, last) - c.acs(b, h, t));
  return (c.rec(b, t) != c.rec(b, last) || e < T(kNegligibleDecay)) ? T(0) : e * c.delta(b, h, t);
}

// xw = es(s) Delta_s x_s, the chunk-state operand (and the backward's for dB's state term).
template <class T>
void state_weights(const Ctx<T>& c, const GemmCtx<T>& g) {
  const auto xw = g.xw;
  scale_token_heads(
      "ssd::state_weights", c, KOKKOS_LAMBDA(index_t b, index_t h, index_t t) { return state_weight_of(c, b, h, t); },
      c.xs.data() + c.x_col, index_t(c.xs.stride(0)), xw.data(), index_t(xw.stride(0)));
}

// Chunk-local states (into c.states), then the state passing (c.states becomes the state entering each chunk),
// then C B^T (into c.cb).
template <class T>
void gemm_states_and_cb(const Ctx<T>& c, const GemmCtx<T>& g, GemmCompute cmp, const View4<const T>& init,
                        const View4<T>& final_state) {
  const auto xw = g.xw;
  state_weights(c, g);
  const T* X = c.xbc.data();
  const index_t PN = c.Pd * c.N, gP = c.hpg * c.Pd;
  // S_loc of a group's heads (rows (h, p) of the states): (xw of the group)^T B
  chunk_gemm<T>(c, cmp, Trans::T, Trans::N, gP, c.N, kQ, T(1), tok<const T*>(xw.data(), g.HP, gP),
                tok(X + c.b_col, g.ldx, c.N), T(0), blk(c.states.data(), c.N, c.H * PN, c.hpg * PN), c.G, c.gptrs);
  state_passing(c, init, final_state);
  chunk_cb(c, cmp);
}

template <class T>
KOKKOS_INLINE_FUNCTION T e_in_of(const Ctx<T>& c, index_t b, index_t h, index_t t) {
  const T e = c.rec(b, t) == c.rec_in(b, t / c.Q) ? exp_nonpos(c.acs(b, h, t)) : T(0);
  return e < T(kNegligibleDecay) ? T(0) : e;
}

// The fused kernels apply (ssd_fused.hpp): CUDA, float activations, a shape they take.
bool fused_shape_ok(index_t P, index_t N, index_t Q, index_t batch, index_t nchunks, index_t L) {
  return ssd_fused::fits(int(P), int(N), int(Q)) && batch * nchunks <= 65535 &&
         batch * L < (index_t(1) << 31);  // a grid's z extent; int token rows
}

template <class T>
bool fused_applies(const Ctx<T>& c) {
  return std::is_same_v<T, float> && fused_shape_ok(c.Pd, c.N, c.Q, c.Bsz, c.nc, c.L);
}

// The arrays of a fused call (float activations).
inline ssd_fused::Args fused_args(const Ctx<float>& c) {
  ssd_fused::Args a;
  const bool b16 = c.bc16.extent(0) > 0;  // B and C in bf16: no fp32 B and C for the kernels
  a.xbc = b16 ? nullptr : c.xbc.data();
  a.bc16 = b16 ? reinterpret_cast<const std::uint16_t*>(c.bc16.data()) : nullptr;
  a.ldx = b16 ? index_t(c.bc16.stride(0)) : index_t(c.xbc.stride(0));
  a.xs = c.xs.data() + c.x_col;
  a.ldxs = index_t(c.xs.stride(0));
  a.b_col = c.b_col;
  a.c_col = c.c_col;
  a.acs = c.acs.data();
  a.delta = c.delta.data();
  a.seq = c.seq.extent(0) > 0 ? c.seq.data() : nullptr;
  a.D = c.D.data();
  a.dtok = c.dtok.extent(0) > 0 ? c.dtok.data() : nullptr;
  a.states = c.states.data();
  a.cb = c.cb.data();
  a.batch = int(c.Bsz);
  a.L = int(c.L);
  a.H = int(c.H);
  a.P = int(c.Pd);
  a.G = int(c.G);
  a.N = int(c.N);
  a.Q = int(c.Q);
  a.nc = int(c.nc);
  a.cutoff = float(kNegligibleDecay);
  return a;
}

// The arrays of a fused backward call for the block of nh heads from blk0: fused_args plus dY, dX and the
// per-token sums.
inline ssd_fused::Args fused_block_args(const Ctx<float>& c, const float* dy, index_t ldy, float* dx, index_t ldd,
                                        float* v, index_t blk0, index_t nh) {
  ssd_fused::Args a = fused_args(c);
  a.dy = dy;
  a.ldy = ldy;
  a.dx = dx;
  a.ldd = ldd;
  a.v = v;
  a.h0 = int(blk0);
  a.nh = int(nh);
  return a;
}

// The arithmetic of the fused algorithm's cuBLAS chunk products (C B^T; in the backward the states, dH and the
// state terms of dB, dC): their operands are fp32 activations, and cuBLAS under bf16 compute on fp32 operands
// (CUBLAS_COMPUTE_32F_FAST_16BF) ran slower than tf32 on them: the 192 batched calls of a 24-layer LM step took
// 19.1 ms against 15.3 ms (H200, perf/RESULTS.md, eighteenth session). So bf16 asked for gives tf32 here (more
// mantissa, less time); the gemm algorithm keeps s.compute as asked.
inline GemmCompute fused_chunk_compute(GemmCompute asked) {
  return asked == GemmCompute::bf16 ? GemmCompute::tf32 : asked;
}

// A contiguous (batch, H, P, N) state view's data, or null where empty; `ok` cleared where it is not contiguous.
template <class V>
auto state_ptr(const V& v, bool& ok) -> decltype(v.data()) {
  if (v.extent(0) == 0) return nullptr;
  ok = ok && v.span_is_contiguous() && v.span() == v.size();
  return v.data();
}

// SSDAlgo::fused, forward: where ssd_fused::seq_applies, the sequential kernel (one pass over each row's chunks:
// y, the final state and, when the intermediates are kept, S_in and C B^T); otherwise the chunk-local states and
// the chunk scan in the tensor-core kernels of ssd_fused.cpp, with the cumsum, the state passing and C B^T (a
// cuBLAS batched GEMM, fused_chunk_compute) as in the GEMM formulation.
template <class T>
void ssd_forward_fused(const Ctx<T>& c, const SSDShape& s, const SSDIn<T>& in, const View2<T>& y,
                       const View4<T>& final_state, bool keeping) {
  if constexpr (std::is_same_v<T, float>) {
    dt_cumsum(c);
    ssd_fused::Args a = fused_args(c);
    a.y = y.data();
    a.ldy = index_t(y.stride(0));
    bool contiguous = true;
    a.init = state_ptr(in.init_state, contiguous);
    a.final_state = state_ptr(final_state, contiguous);
    require(!a.bc16 || (contiguous && ssd_fused::seq_applies(a)), "ssd_forward",
            "bc_bf16 given where the sequential forward does not run (ask ssd_bc_in_bf16_applies first; its rows ",
            "16-byte aligned, their stride and the B and C columns multiples of 8)");
    if (contiguous && ssd_fused::seq_applies(a)) {
      a.write_states = keeping;
      a.cb_out = keeping ? c.cb.data() : nullptr;
      ssd_fused::scan_seq(a);
      return;
    }
    a.init = nullptr;
    a.final_state = nullptr;
    ssd_fused::chunk_state(a);
    state_passing(c, in.init_state, final_state);
    chunk_cb(c, fused_chunk_compute(s.compute));
    ssd_fused::chunk_scan(a);
  } else {
    (void)c, (void)s, (void)in, (void)y, (void)final_state, (void)keeping;
  }
}

template <class T>
void ssd_forward_gemm(const Ctx<T>& c, const SSDShape& s, const SSDIn<T>& in, const View2<T>& y,
                      const View4<T>& final_state, PoolScope& ws) {
  const GemmCompute cmp = s.compute;
  dt_cumsum(c);
  const GemmCtx<T> g = make_gemm_ctx(c, s.gemm_workspace_bytes, false, ws);
  gemm_states_and_cb(c, g, cmp, in.init_state, final_state);
  const T* X = c.xbc.data();
  const index_t PN = c.Pd * c.N, ldy = index_t(y.stride(0)), gP = c.hpg * c.Pd;
  // inter-chunk outputs C S_in^T of a group's heads, then y = e_in y + D x
  chunk_gemm<T>(c, cmp, Trans::N, Trans::T, kQ, gP, c.N, T(1), tok(X + c.c_col, g.ldx, c.N),
                blk<const T*>(c.states.data(), c.N, c.H * PN, c.hpg * PN), T(0), tok(y.data(), ldy, gP), c.G, c.gptrs);
  per_token_heads(
      "ssd::out_scale", c, KOKKOS_LAMBDA(index_t b, index_t h, index_t t) { return e_in_of(c, b, h, t); },
      KOKKOS_LAMBDA(index_t r, int hp, int h, T e) {
        const T Dv = c.dtok.extent(0) > 0 ? c.Dt(r / c.L, h, r % c.L) : c.D(h);
        y(r, hp) = e * y(r, hp) + Dv * c.xs(r, c.x_col + hp);
      });
  // intra-chunk outputs M X, a block of heads at a time
  const auto w1 = g.w1;
  const index_t nbc = c.Bsz * c.nc, QQ = c.Q * c.Q;
  for (index_t blk0 = 0; blk0 < c.H; blk0 += g.hb) {
    const index_t nh = std::min(g.hb, c.H - blk0);
    par_for_team_vec("ssd::decay_matrix", nh * nbc, kTeam, kVector, KOKKOS_LAMBDA(const Team& tm) {
      const index_t hj = tm.league_rank(), j = hj % nbc, hi = hj / nbc, h = blk0 + hi;
      const index_t b = j / c.nc, ch = j % c.nc, t0 = ch * c.Q, q = c.chunk_end(ch) - t0;
      const int Q = int(c.Q);
      const T* CB = &c.cb(b, ch, h / c.hpg, 0, 0);
      T* W = &w1(hi, j, 0, 0);
      Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, Q), [&](int il) {
        const bool row = il < q;
        const int r_l = row ? c.rec(b, t0 + il) : 0;
        const T acs_l = row ? c.acs(b, h, t0 + il) : T(0);
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(tm, Q), [&](int is) {
          T v = 0;
          if (row && is <= il && c.rec(b, t0 + is) == r_l) {
            const T e = exp_nonpos(acs_l - c.acs(b, h, t0 + is));
            if (e >= T(kNegligibleDecay)) v = CB[il * Q + is] * e * c.delta(b, h, t0 + is);
          }
          W[il * Q + is] = v;
        });
      });
    });
    chunk_gemm<T>(c, cmp, Trans::N, Trans::N, kQ, c.Pd, kQ, T(1), blk<const T*>(w1.data(), c.Q, QQ, nbc * QQ),
                  tok(c.xs.data() + c.x_col + blk0 * c.Pd, index_t(c.xs.stride(0)), c.Pd), T(1),
                  tok(y.data() + blk0 * c.Pd, ldy, c.Pd), nh,
                  g.ptrs.data());
  }
}

// ssd_bf16_state_terms for this call (fused: the fused kernels run it; from_kept: a kept context).
template <class T>
bool bf16_state_terms(const Ctx<T>& c, const SSDShape& s, bool fused, bool from_kept) {
  return std::is_same_v<T, float> && fused && from_kept && ssd_bf16_state_terms(s, c.hpg);
}

template <class T>
void ssd_backward_gemm(const Ctx<T>& c, const SSDShape& s, const SSDIn<T>& in, const View2<const T>& dy,
                       const View4<const T>& dfinal_state, const SSDGrad<T>& gr, PoolScope& ws, bool fused,
                       bool from_kept) {
  const GemmCompute cmp = fused ? fused_chunk_compute(s.compute) : s.compute;
  if (!from_kept) dt_cumsum(c);
  // BcForm::kernel (by default where a group is one head), where every block of heads is whole groups: dB and dC
  // of a block's groups in one kernel (ssd_fused::bc_backward), which scales X and dY itself: no xw (from a kept
  // context not even taken), no scaled dY, no state-term or W2 GEMMs
  const bool bc_asked = fused && ssd_fused::bc_kernel_for(int(c.hpg));
  // Otherwise, under bf16 arithmetic from a kept context: the state terms (dS_in's own part, dB's and dC's) as
  // GEMMs on bf16 operands (ssd_bf16_state_terms): xw and e_in dY written as bf16 copies, S_in, dH and C rounded
  const bool b16 = bf16_state_terms(c, s, fused, from_kept);
  const GemmCtx<T> g = make_gemm_ctx(c, s.gemm_workspace_bytes, true, ws, !fused, bc_asked && from_kept, b16);
  const bool bc_kernel = bc_asked && g.run_len == c.hpg;
  const bool bc16 = gr.dbc_bf16.extent(0) > 0;  // dB, dC to the caller's bf16 array (ssd_bc_bf16_applies)
  require(!bc16 || (bc_kernel && c.G == c.H && s.compute == GemmCompute::bf16), "ssd_backward",
          "dbc_bf16 given where dB and dC are not formed by the one-kernel form under bf16 arithmetic with one head "
          "a group (ask ssd_bc_bf16_applies first)");
  require(!bc16 || (index_t(gr.dbc_bf16.extent(0)) == c.Bsz * c.L &&
                    index_t(gr.dbc_bf16.extent(1)) >= std::max(c.b_col, c.c_col) + c.G * c.N),
          "ssd_backward", "dbc_bf16 must have batch * seqlen rows and the columns of B and C");
  View2<bf16_op_t> xwb, dyeb, cb16;  // (n, H P), (n, H P), (n, G N)
  if (b16) {
    xwb = ws.take<View2<bf16_op_t>>("ssd::xw_bf16", c.Bsz * c.L, c.H * c.Pd);
    dyeb = ws.take<View2<bf16_op_t>>("ssd::dye_bf16", c.Bsz * c.L, c.H * c.Pd);
    cb16 = ws.take<View2<bf16_op_t>>("ssd::c_bf16", c.Bsz * c.L, c.G * c.N);
  }
  if (from_kept) {  // Delta, the cumsum, S_in and C B^T as the forward left them
    if (b16) {
      if constexpr (std::is_same_v<T, float>)
        scale_token_heads_bf16(
            "ssd::state_weights", c,
            KOKKOS_LAMBDA(index_t b, index_t h, index_t t) { return state_weight_of(c, b, h, t); },
            c.xs.data() + c.x_col, index_t(c.xs.stride(0)), xwb.data(), index_t(xwb.stride(0)));
    } else if (!bc_kernel) {
      state_weights(c, g);
    }
  } else {
    gemm_states_and_cb(c, g, cmp, in.init_state, View4<T>());
  }
  const T* X = c.xbc.data();
  const index_t PN = c.Pd * c.N, ldy = index_t(dy.stride(0)), nbc = c.Bsz * c.nc, QQ = c.Q * c.Q, nr = c.Bsz * c.L;
  const index_t gP = c.hpg * c.Pd;

  // dL/dS_in from each chunk's own outputs: (diag(e_in) dY)^T C; xw (es Delta x) stays for dB's state term.
  // Under bc_kernel nothing else reads e_in dY, and the chunk-state kernel forms the product per head from dY and C
  // with the weights e_in (no scaled copy of dY: 2 x 4 B L H P bytes less)
  // Under bc_kernel: where state_bwd_seq applies (asked with the first block's heads, then taken for every block),
  // dH, dinit and the state epilogue come per block from it; else where dstates_seq applies, dH of every chunk in
  // one reverse pass per row before the blocks (no state passing); else the chunk-state kernel with the weights
  // e_in and the state passing. Under state_bwd_seq with one head a group dH goes to bc_backward as bf16 (both
  // round it to bf16 for their products): no fp32 dstates.
  bool sbseq = false, dstates_done = false;
  ssd_fused::Args sa;
  if constexpr (std::is_same_v<T, float>) {
    if (bc_kernel) {
      sa = fused_args(c);
      sa.dy = dy.data();
      sa.ldy = ldy;
      const DxOut<T> dxo0 = dx_out(c, gr);
      sa.dx = dxo0.p;
      sa.ldd = dxo0.ld;
      sa.nh = int(g.hb);
      bool contiguous = true;
      sa.dfinal = state_ptr(dfinal_state, contiguous);
      sa.dinit = state_ptr(gr.dinit_state, contiguous);
      sbseq = contiguous && ssd_fused::sbseq_applies(sa) && ssd_fused::epilogue_writes_wdecay(int(c.Pd), int(c.N));
      dstates_done = !sbseq && contiguous && ssd_fused::dseq_applies(sa);
    }
  }
  require(c.bc16.extent(0) == 0 || (bc_kernel && sbseq), "ssd_backward",
          "bc_bf16 given where the backward's state terms or dB, dC are not the sequential and one-kernel forms (ask ",
          "ssd_bc_in_bf16_applies first; rows 16-byte aligned, their stride and the B and C columns multiples of 8)");
  const bool dh16 = sbseq && c.G == c.H;
  View5<T> dstates = dh16 ? View5<T>() : ws.take<View5<T>>("ssd::dstates", c.Bsz, c.nc, c.H, c.Pd, c.N);
  const View1<bf16_op_t> dstates16 =
      dh16 ? ws.take<View1<bf16_op_t>>("ssd::dstates_bf16", c.Bsz * c.nc * c.H * PN) : View1<bf16_op_t>();
  View2<T> dye;
  if (bc_kernel) {
    if constexpr (std::is_same_v<T, float>) {
      if (dstates_done) {
        sa.dstates_out = dstates.data();
        ssd_fused::dstates_seq(sa);
      } else if (!sbseq) {
        ssd_fused::Args a = fused_args(c);
        a.xs = dy.data();
        a.ldxs = ldy;
        a.b_col = c.c_col;
        a.states = dstates.data();
        a.ein_weights = true;
        ssd_fused::chunk_state(a);
      }
    }
  } else if (b16) {
    if constexpr (std::is_same_v<T, float>) {
      scale_token_heads_bf16(
          "ssd::dy_scaled", c, KOKKOS_LAMBDA(index_t b, index_t h, index_t t) { return e_in_of(c, b, h, t); },
          dy.data(), ldy, dyeb.data(), index_t(dyeb.stride(0)));
      round_to_bf16("ssd::c_bf16", X + c.c_col, g.ldx, cb16.data(), index_t(cb16.stride(0)), nr, c.G * c.N);
      chunk_gemm_bf16(c, Trans::T, Trans::N, gP, c.N, kQ, tok<const bf16_op_t*>(dyeb.data(), g.HP, gP),
                      tok<const bf16_op_t*>(cb16.data(), index_t(cb16.stride(0)), c.N), 0.0f,
                      blk(dstates.data(), c.N, c.H * PN, c.hpg * PN), c.G);
    }
  } else {
    dye = ws.take<View2<T>>("ssd::dye", nr, g.HP);
    scale_token_heads(
        "ssd::dy_scaled", c, KOKKOS_LAMBDA(index_t b, index_t h, index_t t) { return e_in_of(c, b, h, t); },
        dy.data(), ldy, dye.data(), index_t(dye.stride(0)));
    chunk_gemm<T>(c, cmp, Trans::T, Trans::N, gP, c.N, kQ, T(1), tok<const T*>(dye.data(), g.HP, gP),
                  tok(X + c.c_col, g.ldx, c.N), T(0), blk(dstates.data(), c.N, c.H * PN, c.hpg * PN), c.G, c.gptrs);
  }
  // under the bf16 state terms, dH also as the bf16 copy their GEMM takes, written by the state passing
  const index_t srows = nbc * c.H * c.Pd;
  const View1<bf16_op_t> dHb = b16 ? ws.take<View1<bf16_op_t>>("ssd::dh_bf16", srows * c.N) : View1<bf16_op_t>();
  if (!dstates_done && !sbseq) state_passing_bwd(c, dstates, dfinal_state, gr.dinit_state, dHb.data());

  const auto dxbc = gr.dxbc;
  const auto ddt = gr.ddt;
  const index_t ddt_col = gr.ddt_col >= 0 ? gr.ddt_col : c.dt_col;
  const index_t ldd = index_t(dxbc.stride(0));
  T* dX = dxbc.data();
  const DxOut<T> dxo = dx_out(c, gr);  // dx of head h at dXx + r lddx + h P
  T* const dXx = dxo.p;
  const index_t lddx = dxo.ld;
  // the state terms of dB and dC, summed over a group's heads by the K dimension:
  // dB = (es Delta X) dH, dC = (e_in dY) S_in (the Q x Q terms are added per block below)
  // (every group in one two-level batched call)
  if (b16) {
    if constexpr (std::is_same_v<T, float>) {
      // S_in as a bf16 copy (dH's is the state passing's), then the two products with K = the group's heads x P
      const View1<bf16_op_t> Sb = ws.take<View1<bf16_op_t>>("ssd::sin_bf16", srows * c.N);
      round_to_bf16("ssd::sin_bf16", c.states.data(), c.N, Sb.data(), c.N, srows, c.N);
      chunk_gemm_bf16(c, Trans::N, Trans::N, kQ, c.N, gP, tok<const bf16_op_t*>(xwb.data(), g.HP, gP),
                      blk<const bf16_op_t*>(dHb.data(), c.N, c.H * PN, c.hpg * PN), 0.0f,
                      tok(dX + c.b_col, ldd, c.N), c.G);
      chunk_gemm_bf16(c, Trans::N, Trans::N, kQ, c.N, gP, tok<const bf16_op_t*>(dyeb.data(), g.HP, gP),
                      blk<const bf16_op_t*>(Sb.data(), c.N, c.H * PN, c.hpg * PN), 0.0f,
                      tok(dX + c.c_col, ldd, c.N), c.G);
    }
  } else if (!bc_kernel) {
    const ChunkOp<const T*> dHg = blk<const T*>(dstates.data(), c.N, c.H * PN, c.hpg * PN),
                            Sg = blk<const T*>(c.states.data(), c.N, c.H * PN, c.hpg * PN);
    chunk_gemm<T>(c, cmp, Trans::N, Trans::N, kQ, c.N, gP, T(1), tok<const T*>(g.xw.data(), g.HP, gP), dHg, T(0),
                  tok(dX + c.b_col, ldd, c.N), c.G, c.gptrs);
    chunk_gemm<T>(c, cmp, Trans::N, Trans::N, kQ, c.N, gP, T(1), tok<const T*>(dye.data(), g.HP, gP), Sg, T(0),
                  tok(dX + c.c_col, ldd, c.N), c.G, c.gptrs);
  }

  View4<T> partial = ws.take<View4<T>>("ssd::partial", c.Bsz, c.nc, c.H, 3);
  // sum(dH o S_in) per (chunk, head), from the fused state epilogue where it forms it (else the dA pass does)
  const bool have_wdec = fused && ssd_fused::epilogue_writes_wdecay(int(c.Pd), int(c.N));
  const View3<T> wdec = have_wdec ? ws.take<View3<T>>("ssd::wdecay", c.Bsz, c.nc, c.H) : View3<T>();
  // Per-token sums of a block of heads: 0 dd = sum_{l>=s} K DX, 1 out = Delta_s sum_{l>s} K DX,
  // 2 in = sum_{s<l} Delta_s K DX, 3 ddot = dy_l . x_l, 4 w_inter, 5 dd_state (K = E (C.B)).
  View3<T> v = ws.take<View3<T>>("ssd::token_sums", g.hb, nr, 6);
  // B_s dH^T and C_l S_in^T of each head of the block (the fused backward keeps them on chip)
  View2<T> t1 = fused ? View2<T>() : ws.take<View2<T>>("ssd::bdh", nr, g.hb * c.Pd);
  View2<T> t2 = fused ? View2<T>() : ws.take<View2<T>>("ssd::csin", nr, g.hb * c.Pd);
  const auto w1 = g.w1, w2 = g.w2;
  const index_t ldt1 = g.hb * c.Pd, rl = g.run_len;
  for (index_t blk0 = 0; blk0 < c.H; blk0 += g.hb) {
    const index_t nh = std::min(g.hb, c.H - blk0), nruns = (nh + rl - 1) / rl;
    if (fused) {
      // the Q x Q products on tensor cores without the workspaces (ssd_fused.hpp): dX = M^T dY, the column and
      // row sums of K o DX, and w2
      if constexpr (std::is_same_v<T, float>) {
        const index_t ntile = (c.Q + 63) / 64;  // the fused kernels' 64-token tiles
        const View3<T> insum = ws.take<View3<T>>("ssd::insum_parts", ntile, nh, nr);
        ssd_fused::Args a = fused_block_args(c, dy.data(), ldy, dXx, lddx, v.data(), blk0, nh);
        a.insum = insum.data();
        a.w2 = w2.data();
        a.run_len = int(rl);
        ssd_fused::intra_backward(a);
        // v2 = the source tiles' parts, in tile order
        par_for("ssd::insum", nh, nr, KOKKOS_LAMBDA(index_t hi, index_t r) {
          const index_t i = ((r % c.L) % c.Q) / 64;
          T acc = 0;
          for (index_t j = 0; j <= i; ++j) acc += insum(j, hi, r);
          v(hi, r, 2) = acc;
        });
      }
    } else {
      // DX = dY X^T of every head of the block
      chunk_gemm<T>(c, cmp, Trans::N, Trans::T, kQ, kQ, c.Pd, T(1), tok(dy.data() + blk0 * c.Pd, ldy, c.Pd),
                    tok(c.xs.data() + c.x_col + blk0 * c.Pd, index_t(c.xs.stride(0)), c.Pd), T(0),
                    blk(w1.data(), c.Q, QQ, nbc * QQ), nh,
                    g.ptrs.data());
      // column sums over l >= s (one thread per source token; rows of the workspace are read coalesced)
      par_for_team_vec("ssd::bwd_colsums", nh * nbc, kTeam, kVector, KOKKOS_LAMBDA(const Team& tm) {
        const index_t hj = tm.league_rank(), j = hj % nbc, hi = hj / nbc, h = blk0 + hi;
        const index_t b = j / c.nc, ch = j % c.nc, t0 = ch * c.Q, grp = h / c.hpg;
        const int q = int(c.chunk_end(ch) - t0), Q = int(c.Q);
        const T* W = &w1(hi, j, 0, 0);
        const T* CB = &c.cb(b, ch, grp, 0, 0);
        Kokkos::parallel_for(Kokkos::TeamVectorRange(tm, q), [&](int is) {
          const index_t ts = t0 + is;
          const int r_s = c.rec(b, ts);
          const T acs_s = c.acs(b, h, ts);
          T dd = 0, out = 0;
          for (int il = is; il < q; ++il) {
            if (c.rec(b, t0 + il) != r_s) break;  // records are contiguous runs
            const T e = exp_nonpos(c.acs(b, h, t0 + il) - acs_s);
            if (e < T(kNegligibleDecay)) break;  // decays only shrink with distance
            const T kd = e * CB[il * Q + is] * W[il * Q + is];
            dd += kd;
            if (il > is) out += kd;
          }
          const index_t r = b * c.L + ts;
          v(hi, r, 0) = dd;
          v(hi, r, 1) = c.delta(b, h, ts) * out;
          v(hi, r, 3) = W[is * Q + is];
        });
      });
      // rows, one team per (run, chunk, kRowSlab output rows) looping over the run's heads: w1 <- M (masked,
      // Delta_s) of each head, w2 <- dCB summed over the run's heads (each element by the same lane for every head,
      // in head order); the incoming sum of each output token
      const index_t nslab = (c.Q + kRowSlab - 1) / kRowSlab;
      par_for_team_vec(
          "ssd::bwd_rows", nruns * nbc * nslab, kTeam, kVector, KOKKOS_LAMBDA(const Team& tm) {
            const index_t ujs = tm.league_rank(), sl = ujs % nslab, uj = ujs / nslab;
            const index_t j = uj % nbc, u = uj / nbc, b = j / c.nc, ch = j % c.nc, t0 = ch * c.Q;
            const index_t q = c.chunk_end(ch) - t0, hi0 = u * rl, hi1 = hi0 + rl < nh ? hi0 + rl : nh;
            const index_t il0 = sl * kRowSlab, il1 = il0 + kRowSlab < q ? il0 + kRowSlab : q;
            const index_t grp = (blk0 + hi0) / c.hpg;
            for (index_t hi = hi0; hi < hi1; ++hi) {
              const index_t h = blk0 + hi;
              const bool first = hi == hi0;
              Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, il0, il1 > il0 ? il1 : il0), [&](index_t il) {
                const index_t tl = t0 + il;
                const int r_l = c.rec(b, tl);
                const T acs_l = c.acs(b, h, tl);
                T insum = 0;
                Kokkos::parallel_reduce(
                    Kokkos::ThreadVectorRange(tm, q),
                    [&](index_t is, T& acc) {
                      T m = 0, dcb = 0;
                      if (is <= il && c.rec(b, t0 + is) == r_l) {
                        const T e = exp_nonpos(acs_l - c.acs(b, h, t0 + is));
                        if (e >= T(kNegligibleDecay)) {
                          const T dlt = c.delta(b, h, t0 + is), dx = w1(hi, j, il, is),
                                  kk = e * c.cb(b, ch, grp, il, is);
                          m = kk * dlt;
                          dcb = dx * e * dlt;
                          if (is < il) acc += m * dx;
                        }
                      }
                      w1(hi, j, il, is) = m;
                      w2(u, j, il, is) = first ? dcb : w2(u, j, il, is) + dcb;
                    },
                    insum);
                Kokkos::single(Kokkos::PerThread(tm), [&]() { v(hi, b * c.L + tl, 2) = insum; });
              });
            }
          });
      // dX = M^T dY of every head of the block (the rest added below)
      chunk_gemm<T>(c, cmp, Trans::T, Trans::N, kQ, c.Pd, kQ, T(1), blk<const T*>(w1.data(), c.Q, QQ, nbc * QQ),
                    tok(dy.data() + blk0 * c.Pd, ldy, c.Pd), T(0), tok(dXx + blk0 * c.Pd, lddx, c.Pd), nh,
                    g.ptrs.data());
    }
    // runs of whole groups (a run per group): the dB and dC products of every run in one two-level batched call
    const bool group_runs = !bc_kernel && rl == c.hpg && nruns > 1 && c.gptrs != nullptr;
    if (bc_kernel) {
      if constexpr (std::is_same_v<T, float>) {
        if (sbseq) {  // the block's dH (bc_backward reads it), dinit and state epilogue in one reverse pass
          ssd_fused::Args a = fused_block_args(c, dy.data(), ldy, dXx, lddx, v.data(), blk0, nh);
          a.dfinal = sa.dfinal;  // (contiguous: sbseq was decided on them)
          a.dinit = sa.dinit;
          a.dstates_out = dstates.data();
          a.dstates_b16 = reinterpret_cast<std::uint16_t*>(dstates16.data());
          a.wdecay = wdec.data();
          a.ddot_f32 = gr.dD_token.extent(0) > 0;
          ssd_fused::state_bwd_seq(a);
        }
        ssd_fused::Args a = fused_block_args(c, dy.data(), ldy, dXx, lddx, v.data(), blk0, nh);
        a.w2 = w2.data();
        a.run_len = int(rl);
        a.dstates = dstates.data();
        a.dstates_b16 = reinterpret_cast<std::uint16_t*>(dstates16.data());
        if (bc16) {
          a.dbc_b16 = reinterpret_cast<std::uint16_t*>(gr.dbc_bf16.data());
          a.lddbc = index_t(gr.dbc_bf16.stride(0));
        } else {
          a.dbc = dX;
          a.lddbc = ldd;
        }
        ssd_fused::bc_backward(a);
      }
    } else if (group_runs) {
      const index_t grp0 = blk0 / c.hpg;
      const ChunkOp<const T*> W2 = blk<const T*>(w2.data(), c.Q, QQ, nbc * QQ);
      chunk_gemm<T>(c, cmp, Trans::T, Trans::N, kQ, c.N, kQ, T(1), W2, tok(X + c.c_col + grp0 * c.N, g.ldx, c.N),
                    T(1), tok(dX + c.b_col + grp0 * c.N, ldd, c.N), nruns, c.gptrs);
      chunk_gemm<T>(c, cmp, Trans::N, Trans::N, kQ, c.N, kQ, T(1), W2, tok(X + c.b_col + grp0 * c.N, g.ldx, c.N),
                    T(1), tok(dX + c.c_col + grp0 * c.N, ldd, c.N), nruns, c.gptrs);
    }
    for (index_t u = 0; u < nruns; ++u) {
      const index_t hi0 = u * rl, hn = std::min(rl, nh - hi0), h0 = blk0 + hi0, grp = h0 / c.hpg;
      const ChunkOp<const T*> Bg = tok(X + c.b_col + grp * c.N, g.ldx), Cg = tok(X + c.c_col + grp * c.N, g.ldx);
      if (!fused) {
        // B dH^T and C S_in^T of the run's heads (for the per-token decay sums)
        chunk_gemm<T>(c, cmp, Trans::N, Trans::T, kQ, hn * c.Pd, c.N, T(1), Bg,
                      blk<const T*>(dstates.data() + h0 * PN, c.N, c.H * PN), T(0), tok(t1.data() + hi0 * c.Pd, ldt1));
        chunk_gemm<T>(c, cmp, Trans::N, Trans::T, kQ, hn * c.Pd, c.N, T(1), Cg,
                      blk<const T*>(c.states.data() + h0 * PN, c.N, c.H * PN), T(0), tok(t2.data() + hi0 * c.Pd, ldt1));
      }
      if (!group_runs && !bc_kernel) {
        // dB += (sum_h dCB)^T C, dC += (sum_h dCB) B
        const ChunkOp<const T*> W2 = blk<const T*>(w2.data() + u * nbc * QQ, c.Q, QQ);
        chunk_gemm<T>(c, cmp, Trans::T, Trans::N, kQ, c.N, kQ, T(1), W2, Cg, T(1), tok(dX + c.b_col + grp * c.N, ldd));
        chunk_gemm<T>(c, cmp, Trans::N, Trans::N, kQ, c.N, kQ, T(1), W2, Bg, T(1), tok(dX + c.c_col + grp * c.N, ldd));
      }
    }
    // per token: finish dx, and the decay sums w_inter = e_in dy . (C S_in^T) and dd_state = es x . (B dH^T)
    // (kEpiRows itself in the lambda: a local constant read through std::min's reference would be odr-used and
    // not captured, which reads host stack memory on the device)
    if (fused) {
      if constexpr (std::is_same_v<T, float>) {
        if (!sbseq) {  // (else state_bwd_seq formed them)
          ssd_fused::Args a = fused_block_args(c, dy.data(), ldy, dXx, lddx, v.data(), blk0, nh);
          a.dstates = dstates.data();
          a.wdecay = wdec.data();
          a.ddot_f32 = gr.dD_token.extent(0) > 0;
          ssd_fused::state_epilogue(a);
        }
      }
    } else {
      const index_t nrt = (nr + kEpiRows - 1) / kEpiRows;
      par_for_team_vec(
          "ssd::bwd_token_epilogue", nh * nrt, kEpiRows, kEpiLanes, KOKKOS_LAMBDA(const Team& tm) {
            const index_t hr = tm.league_rank(), hi = hr / nrt, h = blk0 + hi, r0 = (hr % nrt) * kEpiRows;
            const index_t nrows = nr - r0 < index_t(kEpiRows) ? nr - r0 : index_t(kEpiRows);
            Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nrows), [&](index_t ri) {
              const index_t r = r0 + ri;
              const index_t b = r / c.L, t = r % c.L, last = c.chunk_end(t / c.Q) - 1;
              T es = c.rec(b, t) == c.rec(b, last) ? exp_nonpos(c.acs(b, h, last) - c.acs(b, h, t)) : T(0);
              es = es < T(kNegligibleDecay) ? T(0) : es;
              const T dlt = c.delta(b, h, t), Dh = c.Dt(b, h, t);
              T dds = 0, winter = 0;
              Kokkos::parallel_reduce(
                  Kokkos::ThreadVectorRange(tm, c.Pd),
                  [&](index_t p, T& acc) {
                    const T bdh = t1(r, hi * c.Pd + p);
                    acc += c.xs(r, c.x_col + h * c.Pd + p) * bdh;
                    dXx[r * lddx + h * c.Pd + p] += Dh * dy(r, h * c.Pd + p) + dlt * es * bdh;
                  },
                  dds);
              Kokkos::parallel_reduce(
                  Kokkos::ThreadVectorRange(tm, c.Pd),
                  [&](index_t p, T& acc) { acc += dye(r, h * c.Pd + p) * t2(r, hi * c.Pd + p); }, winter);
              Kokkos::single(Kokkos::PerThread(tm), [&]() {
                v(hi, r, 4) = winter;
                v(hi, r, 5) = es * dds;
              });
            });
          });
    }
    // dAcs per token, its reverse cumsum da, dDelta, d(raw dt) and the per-(b, c, h) partial sums: the per-token
    // terms in parallel into team scratch, then the team's reverse scan and reductions.
    const auto dla = gr.dlog_decay;
    const auto dwt = gr.dweight;
    const auto dDtok = gr.dD_token;
    const bool want_dtok = dDtok.extent(0) > 0;
    par_for_team_vec(
        "ssd::bwd_dacs", nh * nbc, kTeam, kVector,
        KOKKOS_LAMBDA(const Team& tm) {
          const index_t hj = tm.league_rank(), j = hj % nbc, hi = hj / nbc, h = blk0 + hi;
          const index_t b = j / c.nc, ch = j % c.nc, t0 = ch * c.Q, q = c.chunk_end(ch) - t0, last = t0 + q - 1;
          Scratch1<T> dacs(tm.team_scratch(0), c.Q), base(tm.team_scratch(0), c.Q), dsp(tm.team_scratch(0), c.Q),
              dlt(tm.team_scratch(0), c.Q), ddot(tm.team_scratch(0), c.Q), du(tm.team_scratch(0), c.Q),
              run(tm.team_scratch(0), c.Q), tot(tm.team_scratch(0), kScanSegments);
          T wdecay = 0;
          if (c.rec(b, last) == c.rec_in(b, ch)) {
            if (have_wdec) {
              wdecay = wdec(b, ch, h);
            } else {  // (dstates is empty where wdec is given: state_bwd_seq may pass dH on in bf16)
              const T* dH = &dstates(b, ch, h, 0, 0);
              const T* Sin = &c.states(b, ch, h, 0, 0);
              Kokkos::parallel_reduce(
                  Kokkos::TeamVectorRange(tm, PN), [&](index_t pn, T& acc) { acc += dH[pn] * Sin[pn]; }, wdecay);
            }
            wdecay *= exp_nonpos(c.acs(b, h, last));
          }
          T wstate_total = 0;
          Kokkos::parallel_reduce(
              Kokkos::TeamVectorRange(tm, q),
              [&](index_t il, T& acc) {
                const index_t t = t0 + il, r = b * c.L + t;
                const T d = c.delta(b, h, t), wstate = d * v(hi, r, 5);
                acc += wstate;
                dacs(il) = v(hi, r, 2) + v(hi, r, 4) - v(hi, r, 1) - wstate;
                base(il) = v(hi, r, 0) + v(hi, r, 5);
                dlt(il) = d;
                ddot(il) = v(hi, r, 3);
                if (c.pre) return;
                const T u = c.dt(r, c.dt_col + h) + c.dt_bias(h);
                const T sp = softplus(u);
                dsp(il) = (sp >= c.dt_lo && sp <= c.dt_hi) ? dsoftplus(u) : T(0);
              },
              wstate_total);
          tm.team_barrier();
          // run(il) = the reverse cumsum of dacs, with the chunk's state terms entering at its last token
          Kokkos::single(Kokkos::PerTeam(tm), [&]() { dacs(q - 1) += wstate_total + wdecay; });
          tm.team_barrier();
          team_inclusive_scan(tm, q, true, dacs, run, tot);
          const T A = c.pre ? T(0) : c.A(h);
          Kokkos::parallel_for(Kokkos::TeamVectorRange(tm, q), [&](index_t il) {
            // with per-token decays da_t itself (base keeps d weight_t), else d(raw dt_t)
            du(il) = c.pre ? run(il) : (base(il) + run(il) * A) * dsp(il);
          });
          tm.team_barrier();
          T dA = 0, dbias = 0, dD = 0;
          Kokkos::parallel_reduce(
              Kokkos::TeamVectorRange(tm, q), [&](index_t il, T& acc) { acc += ddot(il); }, dD);
          if (!c.pre) {
            Kokkos::parallel_reduce(
                Kokkos::TeamVectorRange(tm, q), [&](index_t il, T& acc) { acc += run(il) * dlt(il); }, dA);
            Kokkos::parallel_reduce(
                Kokkos::TeamVectorRange(tm, q), [&](index_t il, T& acc) { acc += du(il); }, dbias);
          }
          Kokkos::single(Kokkos::PerTeam(tm), [&]() {
            partial(b, ch, h, 0) = dA;
            partial(b, ch, h, 1) = dbias;
            partial(b, ch, h, 2) = dD;
          });
          Kokkos::parallel_for(Kokkos::TeamVectorRange(tm, q), [&](index_t il) {
            if (want_dtok) dDtok(b, h, t0 + il) = ddot(il);
            if (c.pre) {
              dla(b, h, t0 + il) = du(il);
              dwt(b, h, t0 + il) = base(il);
            } else {
              ddt(b * c.L + t0 + il, ddt_col + h) = du(il);
            }
          });
        },
        7 * Scratch1<T>::shmem_size(c.Q) + Scratch1<T>::shmem_size(kScanSegments), 0, 0);
  }
  param_reduce(c, partial, gr);
}

}  // namespace

bool ssd_bf16_state_terms(const SSDShape& s, index_t heads_per_group) {
  return ssd_fused::bf16_state_gemms && ssd_resolved_algo(s) == SSDAlgo::fused && s.compute == GemmCompute::bf16 &&
         !ssd_fused::bc_kernel_for(int(heads_per_group));
}

bool ssd_bc_bf16_applies(const SSDShape& s) {
  return ssd_resolved_algo(s) == SSDAlgo::fused && s.compute == GemmCompute::bf16 && s.ngroups == s.nheads &&
         ssd_fused::bc_kernel_for(1) &&
         fused_shape_ok(s.headdim, s.dstate, s.chunk, s.batch, s.nchunks(), s.seqlen);
}

bool ssd_bc_in_bf16_applies(const SSDShape& s) {
  if (!ssd_bc_bf16_applies(s)) return false;
  // the backward's blocks of heads as make_gemm_ctx forms them for the fused kernels (no Q x Q workspaces)
  const SSDGemmBlocks bl = ssd_gemm_blocks(
      s.nheads, s.ngroups, gemm_head_bytes(false, s.batch, s.seqlen, s.nchunks(), s.chunk, sizeof(float)),
      s.gemm_workspace_bytes);
  return ssd_fused::bc16_forms_take(int(s.batch), int(s.nheads), int(bl.heads), int(s.headdim), int(s.dstate),
                                    int(s.chunk));
}

SSDAlgo ssd_resolved_algo(const SSDShape& s) {
  if (s.algo != SSDAlgo::automatic) return s.algo;
#if defined(KOKKOS_ENABLE_CUDA)
  // bf16 arithmetic asked for: the fused kernels (bf16 operands; they fall back to gemm where the shape does not
  // suit them); fp32 or tf32: gemm, whose products keep that arithmetic
  if (std::is_same_v<Exec, Kokkos::Cuda>) return s.compute == GemmCompute::bf16 ? SSDAlgo::fused : SSDAlgo::gemm;
#endif
  // host: gemm (the chunk products in the host batched GEMM)
  return SSDAlgo::gemm;
}

template <class T>
void ssd_forward(const SSDShape& s, const SSDIn<T>& in, const View2<T>& y, const View4<acc_t<T>>& final_state,
                 SSDSaved<T>* keep, PoolScope* pool) {
  using P = acc_t<T>;
  require(!keep || pool, "ssd_forward", "keeping the intermediates needs the pool that holds them");
  const SSDAlgo algo = ssd_resolved_algo(s);
  const bool keeping = keep && (algo == SSDAlgo::gemm || algo == SSDAlgo::fused);
  if (keep) *keep = SSDSaved<T>{};
  PoolScope ws;  // the call's scratch (ctx, GEMM workspaces): cached device blocks, returned at the end
  const Ctx<T> c = make_ctx(s, in, ws, keeping ? pool : nullptr);
  require(index_t(y.extent(0)) == c.Bsz * c.L && index_t(y.extent(1)) == c.H * c.Pd, "ssd_forward",
          "y must be (batch * seqlen, nheads * headdim)");
  require(c.bc16.extent(0) == 0 || (algo == SSDAlgo::fused && fused_applies(c)), "ssd_forward",
          "bc_bf16 (B and C in bf16) is read by the fused kernels only (ask ssd_bc_in_bf16_applies first)");
  if (algo == SSDAlgo::gemm || algo == SSDAlgo::fused) {
    static_assert(std::is_same_v<T, P>, "the GEMM formulation keeps activations in the accumulation type");
    if (algo == SSDAlgo::fused && fused_applies(c))
      ssd_forward_fused<T>(c, s, in, y, final_state, keeping);
    else
      ssd_forward_gemm<T>(c, s, in, y, final_state, ws);
    if (keeping) *keep = SSDSaved<T>{c.delta, c.acs, c.states, c.cb};
    return;
  }
  dt_cumsum(c);
  chunk_state(c);
  state_passing(c, in.init_state, final_state);

  // y_l = D x_l + [rec(l) == rec_in] exp(Acs_l) C_l . S_in + sum_{s <= l, same record} (C_l . B_s) exp(Acs_l - Acs_s)
  //       Delta_s x_s
  chunk_bmm(c);
  // Threads over output tokens l, vector lanes over p; the entering state is staged on chip with rows padded to
  // N + 1 so that the lanes (one row each) hit distinct banks.
  const index_t ldS = c.N + 1;
  const std::size_t fwd_bytes = Scratch1<P>::shmem_size(c.Q) + Scratch1<P>::shmem_size(c.Pd * ldS);
  const int lvl = fwd_bytes <= kFastScratchLimit ? 0 : 1;
  par_for_team_vec(
      "ssd::chunk_scan", c.Bsz * c.nc * c.H, kTeam, kVector,
      KOKKOS_LAMBDA(const Team& tm) {
        const index_t id = tm.league_rank();
        index_t b, ch, h;
        c.decode(id, b, ch, h);
        const index_t g = h / c.hpg, t0 = ch * c.Q, t1 = c.chunk_end(ch);
        const int r_in = c.rec_in(b, ch);
        Scratch1<P> ea(tm.team_scratch(lvl), c.Q);         // exp(a_t) = exp(Delta_t A): one exponential per token
        Scratch1<P> S(tm.team_scratch(lvl), c.Pd * ldS);   // state entering the chunk, (P, N + 1)
        Kokkos::parallel_for(Kokkos::TeamVectorRange(tm, t0, t1),
                             [&](index_t t) { ea(t - t0) = exp_nonpos(c.a_tok(b, h, t)); });
        Kokkos::parallel_for(Kokkos::TeamVectorRange(tm, c.Pd * c.N), [&](index_t pn) {
          S((pn / c.N) * ldS + pn % c.N) = c.states(b, ch, h, pn / c.N, pn % c.N);
        });
        tm.team_barrier();
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, t0, t1), [&](index_t l) {
          const int r_l = c.rec(b, l);
          const P acs_l = c.acs(b, h, l), Dl = c.Dt(b, h, l);
          P e_in = r_l == r_in ? exp_nonpos(acs_l) : P(0);
          e_in = e_in < P(kNegligibleDecay) ? P(0) : e_in;
          const T* xl = c.xrow(b, l, h);
          const T* Cl = c.crow(b, l, g);
          T* yl = &y(c.row(b, l), h * c.Pd);
          Kokkos::parallel_for(Kokkos::ThreadVectorRange(tm, c.Pd), [&](index_t p) {
            P acc = Dl * P(xl[p]);
            if (e_in != P(0)) {
              const P* Sp = &S(p * ldS);
              P cs = 0;
              for (index_t n = 0; n < c.N; ++n) cs += P(Cl[n]) * Sp[n];
              acc += e_in * cs;
            }
            // Sources from l back to the chunk start: exp(Acs_l - Acs_s) = prod_{s < j <= l} exp(a_j), built up one
            // factor per step (each factor <= 1, so it can only underflow to 0). Records are contiguous runs, so
            // the first source of another record ends the loop.
            P decay = 1;
            for (index_t s2 = l; s2 >= t0; --s2) {
              if (c.rec(b, s2) != r_l || decay < P(kNegligibleDecay)) break;
              const P w = c.cb(b, ch, g, l - t0, s2 - t0) * decay * c.delta(b, h, s2);
              acc += w * P(c.xrow(b, s2, h)[p]);
              decay *= ea(s2 - t0);
            }
            yl[p] = static_cast<T>(acc);
          });
        });
      },
      fwd_bytes, 0, lvl);
}

template <class T>
void ssd_backward(const SSDShape& s, const SSDIn<T>& in, const View2<const T>& dy,
                  const View4<const acc_t<T>>& dfinal_state, const SSDGrad<T>& gr, const SSDSaved<T>* kept) {
  using P = acc_t<T>;
  PoolScope ws;  // the call's scratch (ctx, GEMM workspaces): cached device blocks, returned at the end
  const bool from_kept = kept && !kept->empty() && ssd_resolved_algo(s) != SSDAlgo::portable;
  const Ctx<T> c = make_ctx(s, in, ws, nullptr, from_kept ? kept : nullptr);
  require(index_t(dy.extent(0)) == c.Bsz * c.L && index_t(dy.extent(1)) == c.H * c.Pd, "ssd_backward",
          "dy must be (batch * seqlen, nheads * headdim)");
  require(!c.pre || (gr.dlog_decay.extent(0) == c.delta.extent(0) && gr.dlog_decay.extent(1) == c.delta.extent(1) &&
                     gr.dlog_decay.extent(2) == c.delta.extent(2) && gr.dweight.extent(0) == c.delta.extent(0) &&
                     gr.dweight.extent(1) == c.delta.extent(1) && gr.dweight.extent(2) == c.delta.extent(2)),
          "ssd_backward", "with per-token decays and weights, dlog_decay and dweight must be (batch, nheads, seqlen)");
  require(in.x.extent(0) == 0 || gr.dx.extent(0) > 0, "ssd_backward",
          "x given as a matrix of its own (SSDIn::x) needs one for its gradient (SSDGrad::dx)");
  require(gr.dx.extent(0) == 0 || (index_t(gr.dx.extent(0)) == c.Bsz * c.L &&
                                     index_t(gr.dx.extent(1)) >= gr.dx_col + c.H * c.Pd && gr.dx_col >= 0),
          "ssd_backward", "dx must have batch * seqlen rows and columns from dx_col for nheads * headdim");
  require(gr.dD_token.extent(0) == 0 ||
              (gr.dD_token.extent(0) == c.delta.extent(0) && gr.dD_token.extent(1) == c.delta.extent(1) &&
               gr.dD_token.extent(2) == c.delta.extent(2)),
          "ssd_backward", "dD_token must be (batch, nheads, seqlen)");
  require(c.bc16.extent(0) == 0 || (ssd_resolved_algo(s) == SSDAlgo::fused && fused_applies(c) && from_kept),
          "ssd_backward",
          "bc_bf16 (B and C in bf16) is read by the fused kernels only, from the forward's kept context");
  if (ssd_resolved_algo(s) != SSDAlgo::portable) {  // fused: the backward is the GEMM formulation's
    ssd_backward_gemm<T>(c, s, in, dy, dfinal_state, gr, ws,
                         ssd_resolved_algo(s) == SSDAlgo::fused && fused_applies(c), from_kept);
    return;
  }
  // Recompute the forward intermediates.
  dt_cumsum(c);
  chunk_state(c);
  state_passing(c, in.init_state, View4<P>());

  // dstates(b, c) = gradient w.r.t. the state entering chunk c from chunk c's own outputs:
  //   sum_{l in c, rec(l) == rec_in} exp(Acs_l) dy_l C_l^T
  View5<P> dstates = ws.take<View5<P>>("ssd::dstates", c.Bsz, c.nc, c.H, c.Pd, c.N);
  par_for_team_vec(
      "ssd::dstates_local", c.Bsz * c.nc * c.H, kTeam, kVector,
      KOKKOS_LAMBDA(const Team& tm) {
        const index_t id = tm.league_rank();
        index_t b, ch, h;
        c.decode(id, b, ch, h);
        const index_t g = h / c.hpg, t0 = ch * c.Q, t1 = c.chunk_end(ch);
        const int r_in = c.rec_in(b, ch);
        Scratch1<P> wt(tm.team_scratch(0), c.Q);  // exp(Acs_l), 0 where cut off or another record
        Kokkos::parallel_for(Kokkos::TeamVectorRange(tm, t0, t1), [&](index_t l) {
          const P e = exp_nonpos(c.acs(b, h, l));
          wt(l - t0) = (c.rec(b, l) != r_in || e < P(kNegligibleDecay)) ? P(0) : e;
        });
        tm.team_barrier();
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, c.Pd), [&](index_t p) {
          Kokkos::parallel_for(Kokkos::ThreadVectorRange(tm, c.N), [&](index_t n) {
            P acc = 0;
            for (index_t l = t0; l < t1; ++l) {
              const P e = wt(l - t0);
              if (e == P(0)) continue;
              acc += e * P(dy(c.row(b, l), h * c.Pd + p)) * c.Cm(b, l, g, n);
            }
            dstates(b, ch, h, p, n) = acc;
          });
        });
      },
      Scratch1<P>::shmem_size(c.Q), 0, 0);

  state_passing_bwd(c, dstates, dfinal_state, gr.dinit_state);

  // Per chunk and head: dx, dB_h, dC_h, dDelta -> d(raw dt), and per-(b, c, h) partial sums of dA, ddt_bias, dD.
  chunk_bmm(c);
  View3<P> dBh = ws.take<View3<P>>("ssd::dBh", c.Bsz * c.L, c.H, c.N);
  View3<P> dCh = ws.take<View3<P>>("ssd::dCh", c.Bsz * c.L, c.H, c.N);
  View4<P> partial = ws.take<View4<P>>("ssd::partial", c.Bsz, c.nc, c.H, 3);
  const auto dxbc = gr.dxbc;
  const DxOut<T> dxo = dx_out(c, gr);  // dx of head h at dXx + r lddx + h P
  T* const dXx = dxo.p;
  const index_t lddx = dxo.ld;
  const auto ddt = gr.ddt;
  const index_t ddt_col = gr.ddt_col >= 0 ? gr.ddt_col : c.dt_col;
  const auto dla = gr.dlog_decay;
  const auto dwt = gr.dweight;
  const auto dDtok = gr.dD_token;
  const bool want_dtok = dDtok.extent(0) > 0;
  const index_t Q = c.Q;
  // Large (global-memory) team scratch: K = E' (C.B), DX = dy_l . x_s, E' = [same record] exp(Acs_l - Acs_s)
  // (Q x Q each, s <= l). On chip: seven per-token vectors and dL/dH_c with rows padded to N + 1 (lanes over p read
  // distinct banks).
  const index_t ldS = c.N + 1;
  const std::size_t dh_bytes = Scratch1<P>::shmem_size(c.Pd * ldS);
  const bool dh_fast = 7 * Scratch1<P>::shmem_size(Q) + dh_bytes <= kFastScratchLimit;
  const int dh_lvl = dh_fast ? 0 : 1;
  const std::size_t large_bytes = 3 * Scratch2<P>::shmem_size(Q, Q) + (dh_fast ? 0 : dh_bytes);
  const std::size_t fast_bytes = 7 * Scratch1<P>::shmem_size(Q) + (dh_fast ? dh_bytes : 0);
  par_for_team_vec2(
      "ssd::chunk_bwd", c.Bsz * c.nc * c.H, kTeam, kVector,
      KOKKOS_LAMBDA(const Team& tm) {
        const index_t id = tm.league_rank();
        index_t b, ch, h;
        c.decode(id, b, ch, h);
        const index_t g = h / c.hpg, t0 = ch * c.Q, t1 = c.chunk_end(ch), q = t1 - t0, last = t1 - 1;
        const int r_in = c.rec_in(b, ch), r_last = c.rec(b, last);
        const P A = c.pre ? P(0) : c.A(h), acs_last = c.acs(b, h, last);
        Scratch2<P> K(tm.team_scratch(1), Q, Q), DX(tm.team_scratch(1), Q, Q), E(tm.team_scratch(1), Q, Q);
        Scratch1<P> in_sum(tm.team_scratch(0), Q), out_sum(tm.team_scratch(0), Q), w_inter(tm.team_scratch(0), Q),
            w_state(tm.team_scratch(0), Q), ddelta(tm.team_scratch(0), Q), ddot(tm.team_scratch(0), Q),
            ea(tm.team_scratch(0), Q);
        Scratch1<P> dHs(tm.team_scratch(dh_lvl), c.Pd * ldS);
        auto dyrow = [&](index_t t) { return &dy(c.row(b, t), h * c.Pd); };
        const P* dH = &dstates(b, ch, h, 0, 0);        // dL/dH_c, (P, N) row-major
        const P* Sin = &c.states(b, ch, h, 0, 0);      // state entering the chunk, (P, N)

        // Phase A: pairwise quantities for s <= l; the decays are products of exp(a_t) as in the forward.
        Kokkos::parallel_for(Kokkos::TeamVectorRange(tm, q),
                             [&](index_t it) { ea(it) = exp_nonpos(c.a_tok(b, h, t0 + it)); });
        Kokkos::parallel_for(Kokkos::TeamVectorRange(tm, c.Pd * c.N),
                             [&](index_t pn) { dHs((pn / c.N) * ldS + pn % c.N) = dH[pn]; });
        tm.team_barrier();
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, q), [&](index_t il) {
          const index_t l = t0 + il;
          const int r_l = c.rec(b, l);
          const T* dyl = dyrow(l);
          P decay = 1;
          bool same = true;
          for (index_t is = il; is >= 0; --is) {
            const index_t s2 = t0 + is;
            same = same && c.rec(b, s2) == r_l && decay >= P(kNegligibleDecay);  // records are contiguous runs
            if (!same) {
              Kokkos::single(Kokkos::PerThread(tm), [&]() { E(il, is) = K(il, is) = DX(il, is) = P(0); });
              continue;
            }
            const T* xs = c.xrow(b, s2, h);
            P dxv = 0;
            Kokkos::parallel_reduce(
                Kokkos::ThreadVectorRange(tm, c.Pd), [&](index_t p, P& a) { a += P(dyl[p]) * P(xs[p]); }, dxv);
            const P kv = decay * c.cb(b, ch, g, il, is);
            Kokkos::single(Kokkos::PerThread(tm), [&]() {
              E(il, is) = decay;
              K(il, is) = kv;
              DX(il, is) = dxv;
            });
            decay *= ea(is);
          }
        });
        tm.team_barrier();

        // Phase B (per output token l; lanes over n): dC_l (intra + inter), the inter term of dAcs_l, and the
        // incoming intra sum.
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, q), [&](index_t il) {
          const index_t l = t0 + il, rl = c.row(b, l);
          P e_in = c.rec(b, l) == r_in ? exp_nonpos(c.acs(b, h, l)) : P(0);
          e_in = e_in < P(kNegligibleDecay) ? P(0) : e_in;  // as in the forward
          const T* dyl = dyrow(l);
          const T* Cl = c.crow(b, l, g);
          P insum = 0;
          for (index_t is = 0; is < il; ++is) insum += c.delta(b, h, t0 + is) * K(il, is) * DX(il, is);
          P winter = 0;
          Kokkos::parallel_reduce(
              Kokkos::ThreadVectorRange(tm, c.N),
              [&](index_t n, P& wacc) {
                P a = 0;
                for (index_t is = 0; is <= il; ++is) {
                  const P coef = c.delta(b, h, t0 + is) * E(il, is) * DX(il, is);
                  a += coef * c.Bm(b, t0 + is, g, n);
                }
                P a2 = 0;
                if (e_in != P(0))
                  for (index_t p = 0; p < c.Pd; ++p) a2 += P(dyl[p]) * Sin[p * c.N + n];
                const P inter = e_in * a2;
                dCh(rl, h, n) = a + inter;
                wacc += inter * P(Cl[n]);
              },
              winter);
          Kokkos::single(Kokkos::PerThread(tm), [&]() {
            w_inter(il) = winter;
            in_sum(il) = insum;
            ddot(il) = DX(il, il);
          });
        });

        // Phase C (per source token s; lanes over p, then over n): dx_s, dB_s, the direct part of dDelta_s,
        // outgoing intra and state sums.
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, q), [&](index_t is) {
          const index_t s2 = t0 + is, rs = c.row(b, s2);
          const P dlt = c.delta(b, h, s2), Ds = c.Dt(b, h, s2);
          P es = c.rec(b, s2) == r_last ? exp_nonpos(acs_last - c.acs(b, h, s2)) : P(0);
          es = es < P(kNegligibleDecay) ? P(0) : es;  // as in chunk_state
          const T* xs = c.xrow(b, s2, h);
          const T* Bs = c.brow(b, s2, g);
          P dd = 0, outsum = 0;
          for (index_t il = is; il < q; ++il) {
            const P k = K(il, is), dxv = DX(il, is);
            dd += k * dxv;
            if (il > is) outsum += dlt * k * dxv;
          }
          // the chunk-state term (dH_c flows back into the tokens that built the chunk's final state)
          const T* dys = dyrow(s2);
          T* dxs = dXx + rs * lddx + h * c.Pd;
          P dd_state = 0;
          Kokkos::parallel_reduce(
              Kokkos::ThreadVectorRange(tm, c.Pd),
              [&](index_t p, P& dacc) {
                P ap = 0;
                for (index_t il = is; il < q; ++il) ap += K(il, is) * P(dyrow(t0 + il)[p]);
                const P* dHp = &dHs(p * ldS);
                P bdh = 0;
                for (index_t n = 0; n < c.N; ++n) bdh += P(Bs[n]) * dHp[n];
                dacc += P(xs[p]) * bdh;
                dxs[p] = static_cast<T>(Ds * P(dys[p]) + dlt * ap + dlt * es * bdh);
              },
              dd_state);
          Kokkos::parallel_for(Kokkos::ThreadVectorRange(tm, c.N), [&](index_t n) {
            P an = 0;
            for (index_t il = is; il < q; ++il) an += E(il, is) * DX(il, is) * c.Cm(b, t0 + il, g, n);
            P an2 = 0;
            for (index_t p = 0; p < c.Pd; ++p) an2 += P(xs[p]) * dH[p * c.N + n];
            dBh(rs, h, n) = dlt * an + dlt * es * an2;
          });
          dd_state *= es;
          Kokkos::single(Kokkos::PerThread(tm), [&]() {
            ddelta(is) = dd + dd_state;
            out_sum(is) = outsum;
            w_state(is) = dlt * dd_state;
          });
        });

        // Decay term of the state passing: dAcs_last += exp(Acs_last) [same record] sum(dH_c * S_in_c).
        P wdecay = 0;
        if (r_last == r_in) {
          Kokkos::parallel_reduce(
              Kokkos::TeamVectorRange(tm, c.Pd * c.N), [&](index_t pn, P& acc) { acc += dH[pn] * Sin[pn]; }, wdecay);
          wdecay *= exp_nonpos(acs_last);
        }
        tm.team_barrier();

        // dAcs_j, then da_j = sum_{l >= j} dAcs_l, dDelta_j += da_j A, d(raw dt) and the per-head partial sums.
        Kokkos::single(Kokkos::PerTeam(tm), [&]() {
          P wstate_total = 0;
          for (index_t is = 0; is < q; ++is) wstate_total += w_state(is);
          P run = 0, dA = 0, dbias = 0, dD = 0;
          for (index_t ij = q - 1; ij >= 0; --ij) {
            const index_t j = t0 + ij;
            P dacs = in_sum(ij) + w_inter(ij) - out_sum(ij) - w_state(ij);
            if (ij == q - 1) dacs += wstate_total + wdecay;
            run += dacs;  // da_j
            dD += ddot(ij);
            if (want_dtok) dDtok(b, h, j) = ddot(ij);
            if (c.pre) {  // per-token decay and weight: their gradients as they are
              dla(b, h, j) = run;
              dwt(b, h, j) = ddelta(ij);
              continue;
            }
            const P dlt = c.delta(b, h, j);
            const P ddel = ddelta(ij) + run * A;
            const P u = P(c.dt(c.row(b, j), c.dt_col + h)) + c.dt_bias(h);
            const P sp = softplus(u);
            const P du = (sp >= c.dt_lo && sp <= c.dt_hi) ? ddel * dsoftplus(u) : P(0);
            ddt(c.row(b, j), ddt_col + h) = static_cast<T>(du);
            dA += run * dlt;
            dbias += du;
          }
          partial(b, ch, h, 0) = dA;
          partial(b, ch, h, 1) = dbias;
          partial(b, ch, h, 2) = dD;
        });
      },
      fast_bytes, large_bytes);

  group_param_reduce(c, dBh, dCh, partial, gr);
}

template <class T>
void ssd_step(const SSDShape& s, const SSDIn<T>& in, const View4<acc_t<T>>& state, const View2<T>& y) {
  using P = acc_t<T>;
  require(s.seqlen == 1, "ssd_step", "seqlen must be 1 (got ", s.seqlen, ")");
  SSDIn<T> in1 = in;
  in1.seq_idx = SeqIdxView();
  in1.init_state = View4<const P>();
  PoolScope ws;
  const Ctx<T> c = make_ctx(s, in1, ws);
  require(index_t(state.extent(0)) == c.Bsz && index_t(state.extent(1)) == c.H && index_t(state.extent(2)) == c.Pd &&
              index_t(state.extent(3)) == c.N,
          "ssd_step", "state must be (batch, nheads, headdim, dstate) = (", c.Bsz, ", ", c.H, ", ", c.Pd, ", ", c.N,
          ")");
  require(index_t(y.extent(0)) == c.Bsz && index_t(y.extent(1)) == c.H * c.Pd, "ssd_step",
          "y must be (batch, nheads * headdim)");
  par_for("ssd::step", c.Bsz * c.H, c.Pd, KOKKOS_LAMBDA(index_t bh, index_t p) {
    const index_t b = bh / c.H, h = bh % c.H, g = h / c.hpg;
    P d = softplus(P(c.dt(b, c.dt_col + h)) + c.dt_bias(h));
    d = d < c.dt_lo ? c.dt_lo : (d > c.dt_hi ? c.dt_hi : d);
    const P a = Kokkos::exp(d * c.A(h)), xv = c.x(b, 0, h, p);
    P acc = 0;
    for (index_t n = 0; n < c.N; ++n) {
      const P sn = a * state(b, h, p, n) + d * xv * c.Bm(b, 0, g, n);
      state(b, h, p, n) = sn;
      acc += sn * c.Cm(b, 0, g, n);
    }
    y(b, h * c.Pd + p) = static_cast<T>(acc + c.D(h) * xv);
  });
}

#define MM_INSTANTIATE(T)                                                                                 \
  template void ssd_forward<T>(const SSDShape&, const SSDIn<T>&, const View2<T>&, const View4<acc_t<T>>&,  \
                               SSDSaved<T>*, PoolScope*);                                                 \
  template void ssd_backward<T>(const SSDShape&, const SSDIn<T>&, const View2<const T>&,                  \
                                const View4<const acc_t<T>>&, const SSDGrad<T>&, const SSDSaved<T>*);     \
  template void ssd_step<T>(const SSDShape&, const SSDIn<T>&, const View4<acc_t<T>>&, const View2<T>&);
MM_INSTANTIATE(float)
MM_INSTANTIATE(double)
#undef MM_INSTANTIATE

}  // namespace mm
