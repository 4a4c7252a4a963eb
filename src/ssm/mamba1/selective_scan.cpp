#include "ssm/mamba1/selective_scan.hpp"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/error.hpp"
#include "core/pool.hpp"
#include "ssm/mamba1/scan_cuda.hpp"

namespace mm {

void SelScanShape::validate(const char* where) const {
  require(batch > 0 && seqlen > 0, where, "batch (", batch, ") and seqlen (", seqlen, ") must be positive");
  require(dinner > 0 && dstate > 0 && chunk > 0, where, "d_inner (", dinner, "), d_state (", dstate,
          ") and chunk (", chunk, ") must be positive");
  require(ngroups > 0 && dinner % ngroups == 0, where, "d_inner (", dinner, ") is not divisible by ngroups (",
          ngroups, ")");
  require(native_variant >= 0 && native_variant <= mamba1_cuda::kVariants, where, "native kernel variant ",
          native_variant, " is not one of 0..", mamba1_cuda::kVariants);
}

namespace {

// Everything a kernel needs, copied by value into the lambdas.
template <class T>
struct Ctx {
  using P = acc_t<T>;
  View2<const T> u, delta, bc, z;
  index_t u_col, delta_col, b_col, c_col, z_col;
  View2<const P> A;
  View1<const P> D, bias;
  SeqIdxView seq;
  index_t Bsz, L, E, G, N, Q, nc, cpg;
  bool has_z;

  KOKKOS_INLINE_FUNCTION index_t row(index_t b, index_t t) const { return b * L + t; }
  // The state is reset before token t (t starts a new record).
  KOKKOS_INLINE_FUNCTION bool reset(index_t b, index_t t) const {
    return t > 0 && seq.extent(0) > 0 && seq(b, t) != seq(b, t - 1);
  }
  KOKKOS_INLINE_FUNCTION index_t chunk_end(index_t c) const { return (c + 1) * Q < L ? (c + 1) * Q : L; }
  KOKKOS_INLINE_FUNCTION P uval(index_t r, index_t d) const { return P(u(r, u_col + d)); }
  KOKKOS_INLINE_FUNCTION P Bv(index_t r, index_t g, index_t n) const { return P(bc(r, b_col + g * N + n)); }
  KOKKOS_INLINE_FUNCTION P Cv(index_t r, index_t g, index_t n) const { return P(bc(r, c_col + g * N + n)); }
  KOKKOS_INLINE_FUNCTION P raw_delta(index_t r, index_t d) const { return P(delta(r, delta_col + d)) + bias(d); }
  // The decay exp(Delta A) as exp2(Delta A2) with A2 = A log2(e) (one ex2 instruction instead of expf's range
  // reduction on GPUs); every kernel forms it this way, so the backward's rebuilt states equal the forward's.
  KOKKOS_INLINE_FUNCTION P A2(index_t d, index_t n) const { return A(d, n) * P(1.4426950408889634074); }
  KOKKOS_INLINE_FUNCTION static P decay(P dlt, P a2) { return Kokkos::exp2(dlt * a2); }
};

template <class T>
Ctx<T> make_ctx(const SelScanShape& s, const SelScanIn<T>& in, const char* where) {
  s.validate(where);
  const index_t n = s.batch * s.seqlen, E = s.dinner, GN = s.ngroups * s.dstate;
  auto rows_ok = [&](auto v, index_t col, index_t width) {
    return index_t(v.extent(0)) == n && col >= 0 && col + width <= index_t(v.extent(1));
  };
  require(rows_ok(in.u, in.u_col, E), where, "u must have batch * seqlen = ", n, " rows and columns [", in.u_col,
          ", ", in.u_col + E, "); it is ", in.u.extent(0), " x ", in.u.extent(1));
  require(rows_ok(in.delta, in.delta_col, E), where, "delta must have ", n, " rows and columns [", in.delta_col,
          ", ", in.delta_col + E, "); it is ", in.delta.extent(0), " x ", in.delta.extent(1));
  require(rows_ok(in.bc, in.b_col, GN) && rows_ok(in.bc, in.c_col, GN), where, "B/C must have ", n,
          " rows and columns [", in.b_col, ", ", in.b_col + GN, ") and [", in.c_col, ", ", in.c_col + GN,
          "); it is ", in.bc.extent(0), " x ", in.bc.extent(1));
  require(in.z.extent(0) == 0 || rows_ok(in.z, in.z_col, E), where, "z must have ", n, " rows and columns [",
          in.z_col, ", ", in.z_col + E, ")");
  require(index_t(in.A.extent(0)) == E && index_t(in.A.extent(1)) == s.dstate, where, "A must be (", E, ", ",
          s.dstate, "), it is (", in.A.extent(0), ", ", in.A.extent(1), ")");
  require(index_t(in.D.extent(0)) == E && index_t(in.delta_bias.extent(0)) == E, where,
          "D and delta_bias must have d_inner = ", E, " entries");
  require(in.seq_idx.extent(0) == 0 ||
              (index_t(in.seq_idx.extent(0)) == s.batch && index_t(in.seq_idx.extent(1)) == s.seqlen),
          where, "seq_idx must be (batch, seqlen) = (", s.batch, ", ", s.seqlen, ")");
  require(in.init_state.extent(0) == 0 ||
              (index_t(in.init_state.extent(0)) == s.batch && index_t(in.init_state.extent(1)) == E &&
               index_t(in.init_state.extent(2)) == s.dstate),
          where, "init_state must be (batch, d_inner, d_state) = (", s.batch, ", ", E, ", ", s.dstate, ")");
  Ctx<T> c;
  c.u = in.u;
  c.delta = in.delta;
  c.bc = in.bc;
  c.z = in.z;
  c.u_col = in.u_col;
  c.delta_col = in.delta_col;
  c.b_col = in.b_col;
  c.c_col = in.c_col;
  c.z_col = in.z_col;
  c.A = in.A;
  c.D = in.D;
  c.bias = in.delta_bias;
  c.seq = in.seq_idx;
  c.Bsz = s.batch;
  c.L = s.seqlen;
  c.E = E;
  c.G = s.ngroups;
  c.N = s.dstate;
  c.Q = s.chunk;
  c.nc = s.nchunks();
  c.cpg = E / s.ngroups;
  c.has_z = in.z.extent(0) > 0;
  return c;
}

template <class P>
void require_state(const View3<P>& v, const SelScanShape& s, const char* where, const char* what) {
  require(v.extent(0) == 0 || (index_t(v.extent(0)) == s.batch && index_t(v.extent(1)) == s.dinner &&
                               index_t(v.extent(2)) == s.dstate),
          where, what, " must be (batch, d_inner, d_state) = (", s.batch, ", ", s.dinner, ", ", s.dstate,
          "), it is (", v.extent(0), ", ", v.extent(1), ", ", v.extent(2), ")");
}

template <class P>
void require_checkpoints(const View3<P>& v, const SelScanShape& s, const char* where) {
  require(v.extent(0) == 0 || (index_t(v.extent(0)) == s.nchunks() && index_t(v.extent(1)) == s.dstate &&
                               index_t(v.extent(2)) == s.batch * s.dinner),
          where, "checkpoints must be (nchunks, d_state, batch * d_inner) = (", s.nchunks(), ", ", s.dstate, ", ",
          s.batch * s.dinner, ")");
}

// The forward in three passes over (chunk, batch, channel) work items with the states in registers (NM >= N):
//   1. each chunk from a zero state: its local end state hl and, per state, the factor m by which the state
//      entering the chunk reaches its end (the product of the decays since the chunk's last record start: 0 after
//      one);
//   2. per (state, batch, channel), in chunk order: the state entering each chunk, H_c+1 = m_c H_c + hl_c, into the
//      checkpoints (H_0 = the initial state), and the final state;
//   3. each chunk again from its checkpoint, writing the outputs.
// A work item per (batch, channel) walking all L tokens (pass 3 alone, with the states in device memory) left the
// GPU with B E threads and a dependent memory round trip per token: 0.8 % of the copy bandwidth on an H200.
constexpr index_t kMaxRegStates = 64;
// Channels per work item of the backward's dB/dC pass (their states in registers).
constexpr int kBCBlock = 32;

template <int NM, class T>
void forward_chunked(const Ctx<T>& c, const View3<const acc_t<T>>& init, const View2<T>& out,
                     const View3<acc_t<T>>& final_state, const View3<acc_t<T>>& ckpt) {
  using P = acc_t<T>;
  const index_t BE = c.Bsz * c.E, N = c.N;
  const bool has_init = init.extent(0) > 0, has_final = final_state.extent(0) > 0;
  PoolScope ws;
  View3<P> hl = ws.take<View3<P>>("selective_scan::chunk_end", c.nc, N, BE);
  View3<P> ml = ws.take<View3<P>>("selective_scan::chunk_decay", c.nc, N, BE);
  par_for("selective_scan::chunk_local", c.nc, BE, KOKKOS_LAMBDA(index_t ch, index_t bd) {
    const index_t b = bd / c.E, d = bd % c.E, g = d / c.cpg;
    P h[NM], m[NM], a[NM];
MM_UNROLL
    for (int n = 0; n < NM; ++n) h[n] = P(0), m[n] = P(1), a[n] = n < N ? c.A2(d, n) : P(0);
    for (index_t t = ch * c.Q; t < c.chunk_end(ch); ++t) {
      const index_t r = c.row(b, t);
      const P dlt = softplus(c.raw_delta(r, d)), du = dlt * c.uval(r, d);
      const bool rs = c.reset(b, t);
  MM_UNROLL
    for (int n = 0; n < NM; ++n)
        if (n < N) {
          const P e = c.decay(dlt, a[n]);
          h[n] = (rs ? P(0) : e * h[n]) + du * c.Bv(r, g, n);
          m[n] = rs ? P(0) : e * m[n];
        }
    }
MM_UNROLL
    for (int n = 0; n < NM; ++n)
      if (n < N) hl(ch, n, bd) = h[n], ml(ch, n, bd) = m[n];
  });
  par_for("selective_scan::chunk_carry", N, BE, KOKKOS_LAMBDA(index_t n, index_t bd) {
    const index_t b = bd / c.E, d = bd % c.E;
    P H = has_init ? init(b, d, n) : P(0);
    for (index_t ch = 0; ch < c.nc; ++ch) {
      ckpt(ch, n, bd) = H;
      H = ml(ch, n, bd) * H + hl(ch, n, bd);
    }
    if (has_final) final_state(b, d, n) = H;
  });
  par_for("selective_scan::forward", c.nc, BE, KOKKOS_LAMBDA(index_t ch, index_t bd) {
    const index_t b = bd / c.E, d = bd % c.E, g = d / c.cpg;
    P h[NM], a[NM];
MM_UNROLL
    for (int n = 0; n < NM; ++n) h[n] = n < N ? ckpt(ch, n, bd) : P(0), a[n] = n < N ? c.A2(d, n) : P(0);
    const P Dd = c.D(d);
    for (index_t t = ch * c.Q; t < c.chunk_end(ch); ++t) {
      const index_t r = c.row(b, t);
      const P dlt = softplus(c.raw_delta(r, d)), uu = c.uval(r, d), du = dlt * uu;
      const bool rs = c.reset(b, t);
      P y = 0;
  MM_UNROLL
    for (int n = 0; n < NM; ++n)
        if (n < N) {
          h[n] = (rs ? P(0) : c.decay(dlt, a[n]) * h[n]) + du * c.Bv(r, g, n);
          y += c.Cv(r, g, n) * h[n];
        }
      y += Dd * uu;
      if (c.has_z) y *= silu(P(c.z(r, c.z_col + d)));
      out(r, d) = static_cast<T>(y);
    }
  });
}

// What the backward's first pass writes: per token Delta and g (the gradient of y) for pass 2, the carried dh
// entering each chunk from the right, and the partial sums of dA (K, E, N), dD and d(delta_bias) (K, E, 2) over
// K = batch (per-channel walk) or batch x nchunks (chunk-parallel) blocks of tokens, summed in order later.
template <class T>
struct BwdPass1 {
  using P = acc_t<T>;
  View2<P> dlt, g;   // (batch L, E)
  View3<P> dcarry;   // (nchunks, N, batch E)
  View3<P> dA_part;  // (K, E, N)
  View3<P> dv_part;  // (K, E, 2)
};

// The carry between chunks, per (state, batch, channel) from the last chunk: the dh entering each chunk from the
// right (dfinal for the last; dl and dm from each chunk's local reverse scan) and the gradient of the initial state.
template <class T>
void chunk_carry(const Ctx<T>& c, const View3<const acc_t<T>>& dfinal, const View3<acc_t<T>>& dl,
                 const View3<acc_t<T>>& dm, const View3<acc_t<T>>& dcarry, const View3<acc_t<T>>& dinit) {
  using P = acc_t<T>;
  const bool has_dfinal = dfinal.extent(0) > 0, has_dinit = dinit.extent(0) > 0;
  par_for("selective_scan::bwd_chunk_carry", c.N, c.Bsz * c.E, KOKKOS_LAMBDA(index_t n, index_t bd) {
    const index_t b = bd / c.E, d = bd % c.E;
    P D = has_dfinal ? dfinal(b, d, n) : P(0);
    for (index_t ch = c.nc - 1; ch >= 0; --ch) {
      dcarry(ch, n, bd) = D;
      D = dm(ch, n, bd) * D + dl(ch, n, bd);
    }
    if (has_dinit) dinit(b, d, n) = D;
  });
}

// The backward's first pass in three passes over (chunk, batch, channel) work items with the carried dh in
// registers (NM >= N), as the forward:
//   1. each chunk's reverse scan dh_t = C_t g_t + [t+1 same record] exp(Delta_{t+1} A) dh_{t+1} from a zero carry,
//      giving the dh it passes to the left and the factor by which the carry entering from the right reaches it;
//   2. per (state, batch, channel), from the last chunk: the carry entering each chunk (dfinal for the last) and
//      the gradient of the initial state;
//   3. each chunk from its checkpoint (the states rebuilt into `hs`, a slab of chunks at a time) and its carry:
//      du, d(raw delta), dz and the chunk's partial sums.
// (One work item per (batch, channel) walking all L tokens left a GPU with B E threads: 116 ms of a 119 ms
// forward + backward at batch 4 x 8,192, d_inner 1,536, d_state 16 on an H200.)
template <int NM, class T>
void backward_chunked(const Ctx<T>& c, const View2<const T>& dout, const View3<const acc_t<T>>& dfinal,
                      const View3<const acc_t<T>>& ckpt, const SelScanGrad<T>& gr, const BwdPass1<T>& o) {
  using P = acc_t<T>;
  const index_t BE = c.Bsz * c.E, N = c.N, Q = c.Q;
  // g_t = dout_t silu(z_t) (or dout_t)
  auto gate = [=] KOKKOS_FUNCTION(index_t r, index_t d) {
    const P go = P(dout(r, d));
    return c.has_z ? go * silu(P(c.z(r, c.z_col + d))) : go;
  };
  {
    PoolScope ws;
    View3<P> dl = ws.take<View3<P>>("selective_scan::bwd_chunk_carry", c.nc, N, BE);
    View3<P> dm = ws.take<View3<P>>("selective_scan::bwd_chunk_decay", c.nc, N, BE);
    par_for("selective_scan::bwd_chunk_local", c.nc, BE, KOKKOS_LAMBDA(index_t ch, index_t bd) {
      const index_t b = bd / c.E, d = bd % c.E, g = d / c.cpg;
      P dh[NM], m[NM], a[NM];
  MM_UNROLL
      for (int n = 0; n < NM; ++n) dh[n] = P(0), m[n] = P(1), a[n] = n < N ? c.A2(d, n) : P(0);
      for (index_t t = c.chunk_end(ch) - 1; t >= ch * Q; --t) {
        const index_t r = c.row(b, t);
        const P dlt = softplus(c.raw_delta(r, d)), gt = gate(r, d);
        const bool rs = c.reset(b, t);
    MM_UNROLL
        for (int n = 0; n < NM; ++n)
          if (n < N) {
            const P e = c.decay(dlt, a[n]);
            dh[n] = rs ? P(0) : e * (dh[n] + c.Cv(r, g, n) * gt);
            m[n] = rs ? P(0) : e * m[n];
          }
      }
  MM_UNROLL
      for (int n = 0; n < NM; ++n)
        if (n < N) dl(ch, n, bd) = dh[n], dm(ch, n, bd) = m[n];
    });
    chunk_carry(c, dfinal, dl, dm, o.dcarry, gr.dinit_state);
  }
  // pass 3 over slabs of chunks whose rebuilt states fit in 1 GiB
  const index_t q = Q < c.L ? Q : c.L;
  const double chunk_bytes = double(q) * double(N) * double(BE) * sizeof(P);
  const index_t slab = std::clamp<index_t>(index_t(double(1ull << 30) / chunk_bytes), 1, c.nc);
  PoolScope ws;
  View3<P> hs = ws.take<View3<P>>("selective_scan::hs", slab * q, N, BE);
  const auto du = gr.du;
  const auto ddelta = gr.ddelta;
  const auto dz = gr.dz;
  const index_t du_col = gr.du_col, ddelta_col = gr.ddelta_col, dz_col = gr.dz_col;
  const View2<P> dlt_buf = o.dlt, g_buf = o.g;
  const View3<P> dcarry = o.dcarry, dA_part = o.dA_part, dv_part = o.dv_part;
  for (index_t ch0 = 0; ch0 < c.nc; ch0 += slab) {
    const index_t nch = std::min(slab, c.nc - ch0);
    par_for("selective_scan::bwd_chunk", nch, BE, KOKKOS_LAMBDA(index_t ci, index_t bd) {
      const index_t ch = ch0 + ci, b = bd / c.E, d = bd % c.E, g = d / c.cpg;
      const index_t t0 = ch * Q, t1 = c.chunk_end(ch), k = b * c.nc + ch;
      const P Dd = c.D(d);
      P h[NM], dh[NM], a[NM], dA[NM];  // a: A2 = A log2(e)
  MM_UNROLL
      for (int n = 0; n < NM; ++n) {
        h[n] = n < N ? ckpt(ch, n, bd) : P(0);
        dh[n] = n < N ? dcarry(ch, n, bd) : P(0);
        a[n] = n < N ? c.A2(d, n) : P(0);
        dA[n] = P(0);
      }
      // the states h_t of the chunk (h_{t0-1} is the checkpoint)
      for (index_t t = t0; t < t1; ++t) {
        const index_t r = c.row(b, t);
        const P dlt = softplus(c.raw_delta(r, d)), du_ = dlt * c.uval(r, d);
        const bool rs = c.reset(b, t);
        dlt_buf(r, d) = dlt;
    MM_UNROLL
        for (int n = 0; n < NM; ++n)
          if (n < N) {
            h[n] = (rs ? P(0) : c.decay(dlt, a[n]) * h[n]) + du_ * c.Bv(r, g, n);
            hs(ci * q + t - t0, n, bd) = h[n];
          }
      }
      P dD_acc = 0, dbias_acc = 0;
      for (index_t t = t1 - 1; t >= t0; --t) {
        const index_t r = c.row(b, t);
        const P dlt = dlt_buf(r, d), uu = c.uval(r, d);
        const bool rs = c.reset(b, t);
        P gt = P(dout(r, d));
        if (c.has_z) {
          P y = Dd * uu;
      MM_UNROLL
          for (int n = 0; n < NM; ++n)
            if (n < N) y += c.Cv(r, g, n) * hs(ci * q + t - t0, n, bd);
          const P zz = P(c.z(r, c.z_col + d));
          dz(r, dz_col + d) = static_cast<T>(gt * y * dsilu(zz));
          gt *= silu(zz);
        }
        g_buf(r, d) = gt;
        P dut = Dd * gt, ddl = 0;
    MM_UNROLL
        for (int n = 0; n < NM; ++n)
          if (n < N) {
            const P Bn = c.Bv(r, g, n);
            const P prev = rs ? P(0) : (t == t0 ? ckpt(ch, n, bd) : hs(ci * q + t - 1 - t0, n, bd));
            const P e = c.decay(dlt, a[n]);
            const P dhn = dh[n] + c.Cv(r, g, n) * gt;
            dut += dhn * dlt * Bn;
            ddl += dhn * (Bn * uu + c.A(d, n) * e * prev);
            dA[n] += dhn * dlt * e * prev;
            dh[n] = rs ? P(0) : e * dhn;  // carried to t - 1
          }
        dD_acc += gt * uu;
        const P draw = ddl * dsoftplus(c.raw_delta(r, d));
        dbias_acc += draw;
        du(r, du_col + d) = static_cast<T>(dut);
        ddelta(r, ddelta_col + d) = static_cast<T>(draw);
      }
  MM_UNROLL
      for (int n = 0; n < NM; ++n)
        if (n < N) dA_part(k, d, n) = dA[n];
      dv_part(k, d, 0) = dD_acc;
      dv_part(k, d, 1) = dbias_acc;
    });
  }
}

}  // namespace

template <class T>
View3<acc_t<T>> selective_scan_alloc_checkpoints(const SelScanShape& s, PoolScope* ws) {
  return take_or_alloc<View3<acc_t<T>>>(ws, "selective_scan::checkpoints", s.nchunks(), s.dstate, s.batch * s.dinner);
}

namespace {
// The native kernel's view of the inputs, where it can run them: fp32, its shape rules, and every row-major
// window starting on 16 bytes with a row stride of a multiple of 4 floats (so that 16-byte copies never straddle).
template <class T>
bool native_fits(const SelScanShape& s, const SelScanIn<T>& in, mamba1_cuda::FwdArgs* a) {
  if constexpr (!std::is_same_v<T, float>) {
    return false;
  } else {
    if (!s.native || !mamba1_cuda::compiled() || !mamba1_cuda::shape_fits(s.dinner, s.dstate, s.dinner / s.ngroups))
      return false;
    auto window = [](const auto& v, index_t col, const float** p, index_t* ld) {
      *p = v.data() + col;
      *ld = index_t(v.stride(0));
      return reinterpret_cast<std::uintptr_t>(*p) % 16 == 0 && *ld % 4 == 0;
    };
    mamba1_cuda::FwdArgs x;
    index_t ld_c = 0;
    bool ok = window(in.u, in.u_col, &x.u, &x.ld_u) && window(in.delta, in.delta_col, &x.delta, &x.ld_delta) &&
              window(in.bc, in.b_col, &x.B, &x.ld_bc) && window(in.bc, in.c_col, &x.C, &ld_c);
    if (in.z.extent(0) > 0) ok = ok && window(in.z, in.z_col, &x.z, &x.ld_z);
    // A (E, N) and the initial state (batch, E, N) are indexed as dense row-major arrays
    if (!ok || !in.A.span_is_contiguous() || !in.init_state.span_is_contiguous()) return false;
    x.A = in.A.data();
    x.D = in.D.data();
    x.bias = in.delta_bias.data();
    x.seq = in.seq_idx.extent(0) > 0 ? in.seq_idx.data() : nullptr;
    x.ld_seq = index_t(in.seq_idx.stride(0));
    x.init = in.init_state.extent(0) > 0 ? in.init_state.data() : nullptr;
    x.batch = s.batch;
    x.L = s.seqlen;
    x.E = s.dinner;
    x.N = s.dstate;
    x.cpg = s.dinner / s.ngroups;
    x.Q = s.chunk;
    x.variant = s.native_variant;
    if (a) *a = x;
    return true;
  }
}
}  // namespace

template <class T>
bool selective_scan_native_forward(const SelScanShape& s, const SelScanIn<T>& in) {
  make_ctx(s, in, "selective_scan_native_forward");
  return native_fits(s, in, nullptr);
}

template <class T>
void selective_scan_forward(const SelScanShape& s, const SelScanIn<T>& in, const View2<T>& out,
                            const View3<acc_t<T>>& final_state, const View3<acc_t<T>>& checkpoints) {
  using P = acc_t<T>;
  const Ctx<T> c = make_ctx(s, in, "selective_scan_forward");
  require(index_t(out.extent(0)) == c.Bsz * c.L && index_t(out.extent(1)) == c.E, "selective_scan_forward",
          "out must be (batch * seqlen, d_inner) = (", c.Bsz * c.L, ", ", c.E, ")");
  require_state(final_state, s, "selective_scan_forward", "final_state");
  require_checkpoints(checkpoints, s, "selective_scan_forward");
  const auto init = in.init_state;
  if (mamba1_cuda::FwdArgs a; native_fits(s, in, &a) && final_state.span_is_contiguous() &&
                               checkpoints.span_is_contiguous()) {  // one pass; checkpoints as the portable ones
    PoolScope ws;
    const View3<P> ck = checkpoints.extent(0) > 0 ? checkpoints
                                                   : ws.take<View3<P>>("selective_scan::checkpoints", c.nc, c.N,
                                                                       c.Bsz * c.E);
    if constexpr (std::is_same_v<T, float>) {
      a.out = out.data();
      a.ld_out = index_t(out.stride(0));
      a.final_state = final_state.extent(0) > 0 ? final_state.data() : nullptr;
      a.ckpt = ck.data();
      mamba1_cuda::forward(a);
    }
    return;
  }
  if (c.N <= kMaxRegStates) {  // the chunk-parallel passes; they need the checkpoints (a scratch block if not given)
    PoolScope ws;
    const View3<P> ck = checkpoints.extent(0) > 0 ? checkpoints
                                                   : ws.take<View3<P>>("selective_scan::checkpoints", c.nc, c.N,
                                                                       c.Bsz * c.E);
    if (c.N <= 16)
      forward_chunked<16, T>(c, init, out, final_state, ck);
    else if (c.N <= 32)
      forward_chunked<32, T>(c, init, out, final_state, ck);
    else
      forward_chunked<int(kMaxRegStates), T>(c, init, out, final_state, ck);
    return;
  }
  // larger d_state: one work item per (batch, channel), the states in device memory
  const bool has_init = init.extent(0) > 0, has_final = final_state.extent(0) > 0;
  const bool has_ckpt = checkpoints.extent(0) > 0;
  // The running state of every (batch, channel), with the work item index fastest (coalesced on GPUs).
  View2<P> h(Kokkos::view_alloc(Kokkos::WithoutInitializing, "selective_scan::h"), c.N, c.Bsz * c.E);
  par_for("selective_scan::forward", c.Bsz * c.E, KOKKOS_LAMBDA(index_t bd) {
    const index_t b = bd / c.E, d = bd % c.E, g = d / c.cpg;
    for (index_t n = 0; n < c.N; ++n) h(n, bd) = has_init ? init(b, d, n) : P(0);
    const P Dd = c.D(d);
    for (index_t ch = 0; ch < c.nc; ++ch) {
      if (has_ckpt)
        for (index_t n = 0; n < c.N; ++n) checkpoints(ch, n, bd) = h(n, bd);
      for (index_t t = ch * c.Q; t < c.chunk_end(ch); ++t) {
        const index_t r = c.row(b, t);
        const P dlt = softplus(c.raw_delta(r, d));
        const P uu = c.uval(r, d);
        const bool rs = c.reset(b, t);
        P y = 0;
        for (index_t n = 0; n < c.N; ++n) {
          const P prev = rs ? P(0) : h(n, bd);
          const P hn = c.decay(dlt, c.A2(d, n)) * prev + dlt * c.Bv(r, g, n) * uu;
          h(n, bd) = hn;
          y += c.Cv(r, g, n) * hn;
        }
        y += Dd * uu;
        if (c.has_z) y *= silu(P(c.z(r, c.z_col + d)));
        out(r, d) = static_cast<T>(y);
      }
    }
    if (has_final)
      for (index_t n = 0; n < c.N; ++n) final_state(b, d, n) = h(n, bd);
  });
}

namespace {
// Channel blocks per round of dB and dC parts: as many of the nsub blocks as SelScanShape::bc_parts_bytes holds
// (at least one), each part n_tok x 2 G N values of `elem` bytes.
index_t bc_parts_round(const SelScanShape& s, index_t n_tok, index_t GN, index_t nsub, std::size_t elem) {
  const double part_bytes = double(n_tok) * double(2 * GN) * double(elem);
  return std::clamp<index_t>(index_t(s.bc_parts_bytes / part_bytes), 1, nsub);
}

// dB and dC from their parts (round, batch L, 2 G N; B's then C's columns) of ns channel blocks, summed in block
// order; `first`: the first round (later rounds add to the sums of the earlier ones, waiting in dbc itself).
template <class T>
void sum_bc_parts(const View3<acc_t<T>>& pbc, index_t ns, bool first, const View2<T>& dbc, index_t b_col,
                  index_t c_col) {
  using P = acc_t<T>;
  const index_t n_tok = index_t(pbc.extent(1)), GN = index_t(pbc.extent(2)) / 2;
  par_for("selective_scan::backward_bc_sum", n_tok, GN, KOKKOS_LAMBDA(index_t r, index_t gn) {
    P sb = first ? P(0) : P(dbc(r, b_col + gn)), sc = first ? P(0) : P(dbc(r, c_col + gn));
    for (index_t k = 0; k < ns; ++k) {
      sb += pbc(k, r, gn);
      sc += pbc(k, r, GN + gn);
    }
    dbc(r, b_col + gn) = static_cast<T>(sb);
    dbc(r, c_col + gn) = static_cast<T>(sc);
  });
}

// The chunk passes of the backward on the native CUDA kernels (mamba1_cuda::backward_local / backward_chunk, with
// the portable carry pass between them), dB and dC included (the chunk kernel writes a part per block of 16
// channels, as many blocks at a time as SelScanShape::bc_parts_bytes holds), where s.native_backward asks for them
// and they fit: fp32, the kernel's shape rules, dense A and checkpoints. Returns false (nothing done) otherwise.
template <class T>
bool backward_native(const SelScanShape& s, const Ctx<T>& c, const View2<const T>& dout,
                     const View3<const acc_t<T>>& dfinal, const View3<const acc_t<T>>& ckpt,
                     const SelScanGrad<T>& gr, const BwdPass1<T>& o) {
  if constexpr (!std::is_same_v<T, float>) {
    return false;
  } else {
    if (!s.native_backward || !mamba1_cuda::compiled() || !mamba1_cuda::backward_fits(c.E, c.N, c.cpg, c.Q))
      return false;
    const auto dense = [](const auto& v) { return v.span_is_contiguous(); };
    if (!dense(c.A) || !dense(c.D) || !dense(c.bias) || !dense(ckpt) || !dense(o.dcarry) || !dense(o.dlt) ||
        !dense(o.g) || !dense(o.dA_part) || !dense(o.dv_part))
      return false;
    mamba1_cuda::BwdArgs a;
    a.u = c.u.data() + c.u_col, a.ld_u = index_t(c.u.stride(0));
    a.delta = c.delta.data() + c.delta_col, a.ld_delta = index_t(c.delta.stride(0));
    a.B = c.bc.data() + c.b_col, a.C = c.bc.data() + c.c_col, a.ld_bc = index_t(c.bc.stride(0));
    if (c.has_z) a.z = c.z.data() + c.z_col, a.ld_z = index_t(c.z.stride(0));
    a.dout = dout.data(), a.ld_dout = index_t(dout.stride(0));
    a.A = c.A.data(), a.D = c.D.data(), a.bias = c.bias.data();
    if (c.seq.extent(0) > 0) a.seq = c.seq.data(), a.ld_seq = index_t(c.seq.stride(0));
    a.ckpt = ckpt.data();
    a.du = gr.du.data() + gr.du_col, a.ld_du = index_t(gr.du.stride(0));
    a.ddelta = gr.ddelta.data() + gr.ddelta_col, a.ld_ddelta = index_t(gr.ddelta.stride(0));
    if (c.has_z) a.dz = gr.dz.data() + gr.dz_col, a.ld_dz = index_t(gr.dz.stride(0));
    a.dlt = o.dlt.data(), a.g = o.g.data(), a.dA_part = o.dA_part.data(), a.dv_part = o.dv_part.data();
    a.batch = c.Bsz, a.L = c.L, a.E = c.E, a.N = c.N, a.cpg = c.cpg, a.Q = c.Q;
    PoolScope ws;
    const index_t BE = c.Bsz * c.E;
    View3<float> dl = ws.take<View3<float>>("selective_scan::bwd_chunk_carry", c.nc, c.N, BE);
    View3<float> dm = ws.take<View3<float>>("selective_scan::bwd_chunk_decay", c.nc, c.N, BE);
    a.dl = dl.data(), a.dm = dm.data();
    mamba1_cuda::backward_local(a);
    chunk_carry(c, dfinal, dl, dm, o.dcarry, gr.dinit_state);
    a.dcarry = o.dcarry.data();
    const index_t n_tok = c.Bsz * c.L, GN = c.G * c.N, nsub = c.cpg / mamba1_cuda::kBwdBlock;
    const index_t round = bc_parts_round(s, n_tok, GN, nsub, sizeof(float));
    View3<float> pbc = ws.take<View3<float>>("selective_scan::dbc_parts", round, n_tok, 2 * GN);
    a.bc_parts = pbc.data();
    for (index_t s0 = 0; s0 < nsub; s0 += round) {
      a.blk0 = s0, a.nblk = std::min(round, nsub - s0);
      mamba1_cuda::backward_chunk(a);
      sum_bc_parts<T>(pbc, a.nblk, s0 == 0, gr.dbc, c.b_col, c.c_col);
    }
    return true;
  }
}
}  // namespace

template <class T>
void selective_scan_backward(const SelScanShape& s, const SelScanIn<T>& in, const View2<const T>& dout,
                             const View3<const acc_t<T>>& dfinal_state, const View3<const acc_t<T>>& checkpoints_in,
                             const SelScanGrad<T>& gr) {
  using P = acc_t<T>;
  const char* where = "selective_scan_backward";
  const Ctx<T> c = make_ctx(s, in, where);
  const index_t n_tok = c.Bsz * c.L, BE = c.Bsz * c.E;
  require(index_t(dout.extent(0)) == n_tok && index_t(dout.extent(1)) == c.E, where,
          "dout must be (batch * seqlen, d_inner) = (", n_tok, ", ", c.E, ")");
  require_state(dfinal_state, s, where, "dfinal_state");
  require_state(gr.dinit_state, s, where, "dinit_state");
  require_checkpoints(checkpoints_in, s, where);
  require(index_t(gr.du.extent(0)) == n_tok && gr.du_col + c.E <= index_t(gr.du.extent(1)), where,
          "du must have ", n_tok, " rows and columns [", gr.du_col, ", ", gr.du_col + c.E, ")");
  require(index_t(gr.ddelta.extent(0)) == n_tok && gr.ddelta_col + c.E <= index_t(gr.ddelta.extent(1)), where,
          "ddelta must have ", n_tok, " rows and columns [", gr.ddelta_col, ", ", gr.ddelta_col + c.E, ")");
  require(gr.dbc.extent(0) == c.bc.extent(0) && gr.dbc.extent(1) >= c.bc.extent(1), where,
          "dbc must have the shape of the B/C input");
  require(!c.has_z || (index_t(gr.dz.extent(0)) == n_tok && gr.dz_col + c.E <= index_t(gr.dz.extent(1))), where,
          "dz must have ", n_tok, " rows and columns [", gr.dz_col, ", ", gr.dz_col + c.E, ")");
  require(index_t(gr.dA.extent(0)) == c.E && index_t(gr.dA.extent(1)) == c.N && index_t(gr.dD.extent(0)) == c.E &&
              index_t(gr.ddelta_bias.extent(0)) == c.E,
          where, "dA must be (d_inner, d_state), dD and ddelta_bias (d_inner)");

  PoolScope ws;  // the pass buffers: cached device blocks, not allocations per call
  View3<const P> ckpt = checkpoints_in;
  if (ckpt.extent(0) == 0) {  // rebuild the checkpoints with a forward pass
    View3<P> fresh = selective_scan_alloc_checkpoints<T>(s, &ws);
    View2<T> scratch_out = ws.take<View2<T>>("selective_scan::out_recompute", n_tok, c.E);
    selective_scan_forward<T>(s, in, scratch_out, View3<P>(), fresh);
    ckpt = fresh;
  }

  const auto du = gr.du;
  const auto ddelta = gr.ddelta;
  const auto dz = gr.dz;
  const auto dinit = gr.dinit_state;
  const index_t du_col = gr.du_col, ddelta_col = gr.ddelta_col, dz_col = gr.dz_col;
  const bool has_dfinal = dfinal_state.extent(0) > 0, has_dinit = dinit.extent(0) > 0;
  const index_t Q = c.Q;

  // Pass 1, per (batch, channel): recompute the states of a chunk from its checkpoint, then the reverse scan
  //   dh_t = C_t g_t + [t+1 same record] exp(Delta_{t+1} A) dh_{t+1}
  // giving du, d(raw delta), dz and per-(batch, channel) partials of dA, dD, d(delta_bias). It keeps Delta_t and
  // g_t (the gradient of y_t) per token and the carried dh entering each chunk from the right for pass 2.
  const bool chunked = c.N <= kMaxRegStates;
  const index_t K = chunked ? c.Bsz * c.nc : c.Bsz;  // blocks of the parameter partial sums
  BwdPass1<T> p1;
  p1.dlt = ws.take<View2<P>>("selective_scan::delta", n_tok, c.E);
  p1.g = ws.take<View2<P>>("selective_scan::g", n_tok, c.E);
  p1.dcarry = ws.take<View3<P>>("selective_scan::dcarry", c.nc, c.N, BE);
  p1.dA_part = ws.take<View3<P>>("selective_scan::dA_partial", K, c.E, c.N);
  p1.dv_part = ws.take<View3<P>>("selective_scan::dD_dbias_partial", K, c.E, 2);
  const View2<P> dlt_buf = p1.dlt, g_buf = p1.g;
  const View3<P> dcarry = p1.dcarry, dA_part = p1.dA_part, dv_part = p1.dv_part;
  bool bc_done = false;  // the native kernels formed dB and dC too
  if (chunked) {
    bc_done = backward_native(s, c, dout, dfinal_state, ckpt, gr, p1);
    if (!bc_done) {
      if (c.N <= 16)
        backward_chunked<16, T>(c, dout, dfinal_state, ckpt, gr, p1);
      else if (c.N <= 32)
        backward_chunked<32, T>(c, dout, dfinal_state, ckpt, gr, p1);
      else
        backward_chunked<int(kMaxRegStates), T>(c, dout, dfinal_state, ckpt, gr, p1);
    }
  } else {
  // larger d_state: one work item per (batch, channel), the states of a chunk and dh in device memory
  View3<P> hs(Kokkos::view_alloc(Kokkos::WithoutInitializing, "selective_scan::hs"), Q < c.L ? Q : c.L, c.N, BE);
  View2<P> dh(Kokkos::view_alloc(Kokkos::WithoutInitializing, "selective_scan::dh"), c.N, BE);
  par_for("selective_scan::backward_scan", BE, KOKKOS_LAMBDA(index_t bd) {
    const index_t b = bd / c.E, d = bd % c.E, g = d / c.cpg;
    const P Dd = c.D(d);
    for (index_t n = 0; n < c.N; ++n) {
      dh(n, bd) = has_dfinal ? dfinal_state(b, d, n) : P(0);
      dA_part(b, d, n) = P(0);
    }
    P dD_acc = 0, dbias_acc = 0;
    for (index_t ch = c.nc - 1; ch >= 0; --ch) {
      const index_t t0 = ch * Q, t1 = c.chunk_end(ch);
      // recompute h_t for t in the chunk
      for (index_t t = t0; t < t1; ++t) {
        const index_t r = c.row(b, t);
        const P dlt = softplus(c.raw_delta(r, d));
        dlt_buf(r, d) = dlt;
        const P uu = c.uval(r, d);
        const bool rs = c.reset(b, t);
        for (index_t n = 0; n < c.N; ++n) {
          const P prev = rs ? P(0) : (t == t0 ? ckpt(ch, n, bd) : hs(t - 1 - t0, n, bd));
          hs(t - t0, n, bd) = c.decay(dlt, c.A2(d, n)) * prev + dlt * c.Bv(r, g, n) * uu;
        }
      }
      for (index_t n = 0; n < c.N; ++n) dcarry(ch, n, bd) = dh(n, bd);
      // reverse scan through the chunk
      for (index_t t = t1 - 1; t >= t0; --t) {
        const index_t r = c.row(b, t);
        const P dlt = dlt_buf(r, d), uu = c.uval(r, d);
        const bool rs = c.reset(b, t);
        P gt = P(dout(r, d));
        if (c.has_z) {
          P y = Dd * uu;
          for (index_t n = 0; n < c.N; ++n) y += c.Cv(r, g, n) * hs(t - t0, n, bd);
          const P zz = P(c.z(r, c.z_col + d));
          dz(r, dz_col + d) = static_cast<T>(gt * y * dsilu(zz));
          gt *= silu(zz);
        }
        g_buf(r, d) = gt;
        P dut = Dd * gt, ddl = 0;
        for (index_t n = 0; n < c.N; ++n) {
          const P An = c.A(d, n), Bn = c.Bv(r, g, n);
          const P prev = rs ? P(0) : (t == t0 ? ckpt(ch, n, bd) : hs(t - 1 - t0, n, bd));
          const P a = c.decay(dlt, c.A2(d, n));
          const P dhn = dh(n, bd) + c.Cv(r, g, n) * gt;
          dut += dhn * dlt * Bn;
          ddl += dhn * (Bn * uu + An * a * prev);
          dA_part(b, d, n) += dhn * dlt * a * prev;
          dh(n, bd) = rs ? P(0) : a * dhn;  // carried to t - 1
        }
        dD_acc += gt * uu;
        const P draw = ddl * dsoftplus(c.raw_delta(r, d));
        dbias_acc += draw;
        du(r, du_col + d) = static_cast<T>(dut);
        ddelta(r, ddelta_col + d) = static_cast<T>(draw);
      }
    }
    dv_part(b, d, 0) = dD_acc;
    dv_part(b, d, 1) = dbias_acc;
    if (has_dinit)
      for (index_t n = 0; n < c.N; ++n) dinit(b, d, n) = dh(n, bd);
  });
  }

  // Pass 2, per (batch, chunk, group, state, block of kBCBlock channels): the block's part of
  // dC_t = sum_d g_t,d h_t,d and dB_t = sum_d dh_t,d Delta_t,d u_t,d, the block's states in registers (h rebuilt
  // forward from the checkpoints, then dh backward from the carries) and summed in channel order at each token,
  // each part written once; then the parts summed in block order. The parts of as many blocks as
  // SelScanShape::bc_parts_bytes (256 MiB) holds are formed at a time (a round); later rounds add to the earlier rounds' sums in the same order. (Blocks that
  // accumulated each channel into device memory, a read and a write per (channel, token, state), took 23 ms of a
  // 48 ms forward + backward on an H200 at batch 4 x 8,192, d_inner 1,536, d_state 16.) The native chunk kernel
  // forms its parts itself (bc_done).
  if (!bc_done) {
    const index_t GN = c.G * c.N, nsub = (c.cpg + kBCBlock - 1) / kBCBlock;
    const index_t round = bc_parts_round(s, n_tok, GN, nsub, sizeof(P));
    PoolScope ws;
    View3<P> pbc = ws.take<View3<P>>("selective_scan::dbc_parts", round, n_tok, 2 * GN);
    const index_t b_col = c.b_col, c_col = c.c_col;
    for (index_t s0 = 0; s0 < nsub; s0 += round) {
      const index_t ns = std::min(round, nsub - s0);
      par_for("selective_scan::backward_bc", c.Bsz * c.nc * ns, GN, KOKKOS_LAMBDA(index_t item, index_t gn) {
        const index_t slot = item % ns, bc_id = item / ns, b = bc_id / c.nc, ch = bc_id % c.nc;
        const index_t g = gn / c.N, n = gn % c.N;
        const index_t t0 = ch * Q, t1 = c.chunk_end(ch);
        const index_t d0 = g * c.cpg + (s0 + slot) * kBCBlock, bd0 = b * c.E + d0;
        const index_t nd = (g + 1) * c.cpg - d0 < index_t(kBCBlock) ? (g + 1) * c.cpg - d0 : index_t(kBCBlock);
        P hj[kBCBlock], aj[kBCBlock];
    MM_UNROLL
        for (int j = 0; j < kBCBlock; ++j) {
          hj[j] = j < nd ? ckpt(ch, n, bd0 + j) : P(0);
          aj[j] = j < nd ? c.A2(d0 + j, n) : P(0);
        }
        for (index_t t = t0; t < t1; ++t) {
          const index_t r = c.row(b, t);
          const bool rs = c.reset(b, t);
          const P Bn = c.Bv(r, g, n);
          P sum = 0;
      MM_UNROLL
          for (int j = 0; j < kBCBlock; ++j)
            if (j < nd) {
              const P dlt = dlt_buf(r, d0 + j);
              hj[j] = (rs ? P(0) : c.decay(dlt, aj[j]) * hj[j]) + dlt * Bn * c.uval(r, d0 + j);
              sum += g_buf(r, d0 + j) * hj[j];
            }
          pbc(slot, r, GN + gn) = sum;
        }
    MM_UNROLL
        for (int j = 0; j < kBCBlock; ++j) hj[j] = j < nd ? dcarry(ch, n, bd0 + j) : P(0);  // now dh
        for (index_t t = t1 - 1; t >= t0; --t) {
          const index_t r = c.row(b, t);
          const bool rs = c.reset(b, t);
          const P Cn = c.Cv(r, g, n);
          P sum = 0;
      MM_UNROLL
          for (int j = 0; j < kBCBlock; ++j)
            if (j < nd) {
              const P dlt = dlt_buf(r, d0 + j);
              const P dhn = hj[j] + Cn * g_buf(r, d0 + j);
              sum += dhn * dlt * c.uval(r, d0 + j);
              hj[j] = rs ? P(0) : c.decay(dlt, aj[j]) * dhn;
            }
          pbc(slot, r, gn) = sum;
        }
      });
      sum_bc_parts<T>(pbc, ns, s0 == 0, gr.dbc, b_col, c_col);
    }
  }

  // Parameter gradients: the partials summed over the batch (and the chunks) in order.
  const auto dA = gr.dA;
  const auto dD = gr.dD;
  const auto dbias = gr.ddelta_bias;
  par_for("selective_scan::param_reduce", c.E, c.N, KOKKOS_LAMBDA(index_t d, index_t n) {
    P sa = 0;
    for (index_t k = 0; k < K; ++k) sa += dA_part(k, d, n);
    dA(d, n) += sa;
    if (n == 0) {
      P sd = 0, sb = 0;
      for (index_t k = 0; k < K; ++k) {
        sd += dv_part(k, d, 0);
        sb += dv_part(k, d, 1);
      }
      dD(d) += sd;
      dbias(d) += sb;
    }
  });
}

template <class T>
void selective_scan_step(const SelScanShape& s, const SelScanIn<T>& in, const View3<acc_t<T>>& state,
                         const View2<T>& out) {
  using P = acc_t<T>;
  require(s.seqlen == 1, "selective_scan_step", "seqlen must be 1 (got ", s.seqlen, ")");
  SelScanIn<T> in1 = in;
  in1.seq_idx = SeqIdxView();
  in1.init_state = View3<const P>();
  const Ctx<T> c = make_ctx(s, in1, "selective_scan_step");
  require_state(state, s, "selective_scan_step", "state");
  require(state.extent(0) > 0, "selective_scan_step", "state must be given");
  require(index_t(out.extent(0)) == c.Bsz && index_t(out.extent(1)) == c.E, "selective_scan_step",
          "out must be (batch, d_inner) = (", c.Bsz, ", ", c.E, ")");
  par_for("selective_scan::step", c.Bsz, c.E, KOKKOS_LAMBDA(index_t b, index_t d) {
    const index_t g = d / c.cpg;
    const P dlt = softplus(c.raw_delta(b, d));
    const P uu = c.uval(b, d);
    P y = 0;
    for (index_t n = 0; n < c.N; ++n) {
      const P hn = c.decay(dlt, c.A2(d, n)) * state(b, d, n) + dlt * c.Bv(b, g, n) * uu;
      state(b, d, n) = hn;
      y += c.Cv(b, g, n) * hn;
    }
    y += c.D(d) * uu;
    if (c.has_z) y *= silu(P(c.z(b, c.z_col + d)));
    out(b, d) = static_cast<T>(y);
  });
}

#define MM_INSTANTIATE(T)                                                                                         \
  template View3<acc_t<T>> selective_scan_alloc_checkpoints<T>(const SelScanShape&, PoolScope*);                             \
  template bool selective_scan_native_forward<T>(const SelScanShape&, const SelScanIn<T>&);                      \
  template void selective_scan_forward<T>(const SelScanShape&, const SelScanIn<T>&, const View2<T>&,              \
                                          const View3<acc_t<T>>&, const View3<acc_t<T>>&);                        \
  template void selective_scan_backward<T>(const SelScanShape&, const SelScanIn<T>&, const View2<const T>&,       \
                                           const View3<const acc_t<T>>&, const View3<const acc_t<T>>&,            \
                                           const SelScanGrad<T>&);                                                \
  template void selective_scan_step<T>(const SelScanShape&, const SelScanIn<T>&, const View3<acc_t<T>>&,          \
                                       const View2<T>&);
MM_INSTANTIATE(float)
MM_INSTANTIATE(double)
#undef MM_INSTANTIATE

}  // namespace mm
