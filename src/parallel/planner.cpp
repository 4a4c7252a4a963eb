#include "parallel/planner.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <tuple>
#include <utility>

#include "core/error.hpp"
#include "layers/conv1d.hpp"
#include "ssm/mamba1/scan_cuda.hpp"
#include "ssm/mamba2/ssd_fused.hpp"
#include "tensor/gemm.hpp"  // bf16_op_t

namespace mm::parallel {

namespace {

constexpr const char* kWhere = "layout planner";

index_t pad16(index_t x) { return (x + 15) / 16 * 16; }

struct Acc {
  index_t count = 0, padded = 0;
  void add(index_t e) { count += e, padded += pad16(e); }
};

std::string gb(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GB", bytes / 1e9);
  return buf;
}

std::string layout_str(const Layout& l) {
  return "tp=" + std::to_string(l.tp) + " cp=" + std::to_string(l.cp) + " ep=" + std::to_string(l.ep) +
         " dp=" + std::to_string(l.dp);
}

std::vector<LayerKind> kinds_of(const PlanModel& m) { return m.layers.resolve(m.n_layer, kWhere); }

bool uses(const std::vector<LayerKind>& p, LayerKind k) { return std::find(p.begin(), p.end(), k) != p.end(); }

Mamba1Config m1_cfg(const PlanModel& m) {
  Mamba1Config c = m.layers.mamba1;
  c.d_model = m.mixer.d_model;
  return c;
}
Mamba3Config m3_cfg(const PlanModel& m) {
  Mamba3Config c = m.layers.mamba3;
  c.d_model = m.mixer.d_model;
  return c;
}
MoEConfig moe_cfg(const PlanModel& m) {
  MoEConfig c = m.layers.moe;
  c.d_model = m.mixer.d_model;
  return c;
}
index_t dense_ff(const PlanModel& m) { return m.layers.dense_d_ff > 0 ? m.layers.dense_d_ff : m.layers.moe.d_ff; }

// The tp / ep divisibility rules; empty when they hold.
std::string split_rules(const PlanModel& m, index_t tp, index_t ep) {
  const auto p = kinds_of(m);
  std::ostringstream why;
  auto need = [&](index_t value, const char* what, index_t by, const char* dim) {
    if (value % by != 0 && why.tellp() == 0) why << what << " = " << value << " does not divide by " << dim << " = " << by;
  };
  if (uses(p, LayerKind::mamba2)) {
    need(m.mixer.nheads(), "nheads (Mamba-2)", tp, "tp");
    need(m.mixer.ngroups, "ngroups (Mamba-2)", tp, "tp");
  }
  if (uses(p, LayerKind::mamba1)) need(m1_cfg(m).d_inner(), "d_inner (Mamba-1)", tp, "tp");
  if (uses(p, LayerKind::mamba3)) {
    need(m3_cfg(m).nheads(), "nheads (Mamba-3)", tp, "tp");
    need(m3_cfg(m).ngroups, "ngroups (Mamba-3)", tp, "tp");
  }
  if (uses(p, LayerKind::moe)) {
    const MoEConfig c = moe_cfg(m);
    need(c.d_ff, "d_ff (MoE)", tp, "tp");
    need(c.shared_d_ff, "shared_d_ff (MoE)", tp, "tp");
    need(c.n_experts, "n_experts", ep, "ep");
  } else if (ep != 1 && why.tellp() == 0) {
    why << "ep = " << ep << " but the model has no MoE layers (ep must be 1)";
  }
  if (uses(p, LayerKind::dense)) need(dense_ff(m), "d_ff (dense)", tp, "tp");
  return why.str();
}

// Activation terms of one layer (bytes), see the header.
struct LayerMem {
  double full = 0;       // every activation the layer's forward allocates and the backward reads
  double keep = 0;       // what stays until the layer's backward under the policy
  double fwd_extra = 0;  // forward transient beyond `full` (scan context)
  double rec_extra = -1; // transient beyond `full` while the backward recomputes (-1: as fwd_extra)
  double bwd_extra = 0;  // backward transient beyond the (kept or recomputed) activations
  double scratch = 0;    // Kokkos level-1 team scratch (pooled: the largest launch counts)
  double xn_elem = 0;    // bytes of an element of the block's normed input xn kept for the layer (0: d.t)
};

struct Dims {
  double t, a;           // activation and acc_t bytes
  double b, L, n;        // rows, tokens per row (the rank's slice), tokens
  index_t tp, ep, cp = 1;
  double concurrency_teams;
  double moe_b16 = 0;    // bytes of a bf16 operand on the MoE bf16 expert path (0: the path is off)
  // bytes of an element of the Mamba-2 and Mamba-3 layers' bf16 copies under bf16 GEMMs (the gated norm's or the
  // gate's kept output, the backward's d(zxbcdt)): 2 on CUDA builds; 0 elsewhere (fp32 GEMMs, double data, host
  // builds, which keep fp32)
  double copy_b16 = 0;
};

// A mixer run in windows of W tokens (ssm/windows.hpp), from the terms `x` of one window of W tokens
// (Recompute::mixer) and the bytes S of one decode state: the forward keeps the state entering each window but the
// first, (nw - 1) S, and has at most nw states live at once; each window allocates u and out (the backward u,
// dout, du) and its record ids besides one window's activations and transients; the backward carries two state
// gradients.
LayerMem windowed_mem(const LayerMem& x, double nw, double S, double window_rows, double d_model, const Dims& d) {
  const double seqw = 4.0 * window_rows, s2 = std::min(2.0, nw - 1.0) * S, io = window_rows * d_model * d.t;
  LayerMem m;
  m.keep = (nw - 1) * S;
  m.full = x.full + m.keep;
  m.fwd_extra = x.fwd_extra + 2 * io + seqw + S;
  const double rec = x.rec_extra >= 0 ? x.rec_extra : x.fwd_extra;
  m.rec_extra = 3 * io + seqw + s2 + rec;
  m.bwd_extra = 3 * io + seqw + s2 + x.bwd_extra;
  m.scratch = x.scratch;
  return m;
}

Dims window_dims(const Dims& d, index_t window) {
  Dims w = d;
  w.L = double(window);
  w.n = d.b * w.L;
  return w;
}

// What ssd.cpp's forward can keep for its backward (SSDSaved): Delta and the cumsum (H n), the chunk states and
// C B^T per group.
double ssd_saved_ctx_bytes(double H, double G, double N, double P, double Q, const Dims& d) {
  const double nc = std::ceil(d.L / Q);
  return d.a * 2 * H * d.n + d.a * d.b * nc * H * P * N + d.a * d.b * nc * G * Q * Q;
}
// ssd.cpp's per-call context: the above, and with G > 1 the pointer arrays of its GEMMs batched over groups.
double ssd_ctx_bytes(double H, double G, double N, double P, double Q, const Dims& d) {
  return ssd_saved_ctx_bytes(H, G, N, P, Q, d) + (G > 1 ? 3.0 * 8.0 * G * d.b * std::ceil(d.L / Q) : 0.0);
}

// The SSD's own buffers in its GEMM formulation or fused kernels (ssd.cpp) for H heads of headdim P in G groups,
// beyond its inputs and outputs: {forward, backward}.
std::pair<double, double> ssd_gemm_mem(double H, double G, double N, double P, double Q, const SSDShape& shape,
                                       const Dims& d) {
  const double E = H * P, nc = std::ceil(d.L / Q);
  const double states = d.a * d.b * nc * H * P * N;
  const double ctx = ssd_ctx_bytes(H, G, N, P, Q, d);
  // xw (n, H P), Q x Q workspaces for hb heads at a time (ssd_gemm_blocks), and in the backward e_in dY (n, H P),
  // one summed dCB workspace per run of a block, the GEMMs' pointer arrays, dstates, the partial sums, six per-token
  // sums and B dH^T and C S_in^T of the block's heads. No team scratch.
  const double per_head = d.a * d.b * nc * Q * Q;
  const SSDGemmBlocks bl = ssd_gemm_blocks(index_t(H), index_t(G), per_head);
  const double hb = double(bl.heads), runs = double(bl.runs);
  const double pointers = 3.0 * 8.0 * hb * d.b * nc;  // operand pointers of the (chunk, head) GEMMs
  const double fwd = ctx + d.a * d.n * E + hb * per_head + pointers;
  double bwd = ctx + 2 * d.a * d.n * E + (hb + runs) * per_head + pointers + states + d.a * d.b * nc * H * 3 +
               6 * d.a * hb * d.n + 2 * d.a * d.n * hb * P;
  if (ssd_resolved_algo(shape) == SSDAlgo::fused && d.a == 4.0 && ssd_fused::fits(int(P), int(N), int(Q))) {
    // the fused backward: no per-head Q x Q workspace, pointers, B dH^T or C S_in^T; blocks of heads sized by
    // the six per-token sums and each source tile's part of the incoming sums
    const double tiles = std::ceil(Q / 64);
    const SSDGemmBlocks fb = ssd_gemm_blocks(index_t(H), index_t(G), ssd_fused_head_bytes(d.n, index_t(Q), d.a));
    const double fh = double(fb.heads), fr = double(fb.runs);
    // xw and e_in dY in fp32, or (a kept context: cp = 1) under bf16 state terms bf16 copies of them, of C, and of
    // dH and S_in (two of states' size in bf16)
    const double b16 = double(sizeof(bf16_op_t));
    const double state_terms = d.cp == 1 && ssd_bf16_state_terms(shape, index_t(H / G))
                                   ? b16 * (2 * d.n * E + d.n * G * N) + 2 * states / d.a * b16
                                   : 2 * d.a * d.n * E;
    bwd = ctx + state_terms + fr * per_head + states + d.a * d.b * nc * H * 3 + 6 * d.a * fh * d.n +
          d.a * tiles * fh * d.n;
  }
  return {fwd, bwd};
}

// explicit_states: the windows of a windowed mixer (each takes its fp32 input, not the block's bf16 copy)
LayerMem mem_mamba2(const Mamba2Config& c, const Dims& d, Recompute pol, bool explicit_states = false) {
  if (c.window > 0 && d.L > double(c.window)) {
    Mamba2Config cw = c;
    cw.window = 0;
    const Dims dw = window_dims(d, c.window);
    const double S = d.b * (double(c.conv_dim()) / d.tp * double(c.d_conv - 1) * d.t +
                            double(c.nheads()) / d.tp * double(c.headdim) * double(c.d_state) * d.a);
    return windowed_mem(mem_mamba2(cw, dw, Recompute::mixer, true), std::ceil(d.L / double(c.window)), S, dw.n,
                        double(c.d_model), d);
  }
  const double E = double(c.d_inner()) / d.tp, H = double(c.nheads()) / d.tp, G = double(c.ngroups) / d.tp;
  const double N = double(c.d_state), P = double(c.headdim), Q = double(c.chunk);
  const double GN = G * N, C = E + 2 * GN, din = 2 * E + 2 * GN + H;
  const double nc = std::ceil(d.L / Q);
  LayerMem m;
  // the bf16 route under bf16 GEMMs without cp: d(zxbcdt) only as its bf16 copy (mixer.cpp,
  // Mamba2Mixer::bf16_in_proj_grad), and without explicit states (this unwindowed form with explicit states is a
  // window's, whose input is the window's own fp32 rows) the block's input xn_l only as its bf16 copy
  // (backbone.cpp, bf16_input)
  const bool b16_route = d.copy_b16 > 0 && d.cp == 1;
  if (b16_route && !explicit_states) m.xn_elem = d.copy_b16;
  // zxbcdt, xbc, y, rstd, and yn: fp32, or its bf16 copy only under bf16 GEMMs (mixer.cpp, Mamba2Acts::yn_b)
  const double yn = d.copy_b16 > 0 ? d.copy_b16 : d.t;
  m.full = d.n * (d.t * (din + C + E) + yn * E + d.a * G);
  m.keep = pol == Recompute::none ? m.full : 0.0;
  const double states = d.a * d.b * nc * H * P * N;
  const double ctx = ssd_ctx_bytes(H, G, N, P, Q, d);
  m.fwd_extra = ctx;
  // dyn, dy, dzxbcdt, dxbc; on the bf16 route d(zxbcdt) only as its bf16 copy, and d(dt) in a block of its own
  const double grads = d.n * (d.t * (2 * E + C) + (b16_route ? d.copy_b16 * din + d.t * H : d.t * din));
  // conv1d backward: its partial sums of dw and dbias, one row per run of kConvRun tokens (layers/conv1d.hpp)
  const double conv_bwd = d.a * d.b * std::ceil(d.L / double(kConvRun)) * C * double(c.d_conv + 1);
  // cp > 1 (mixer.cpp forward_cp / backward): after the scan, the decay weights cp_lexp (a H per token) with the
  // correction's scratch cp_correction (a E per token) in the forward, with cp_dy_scaled (a E per token) in the
  // backward before the scan's backward; both freed before what follows (rows past the last nonzero weight are
  // skipped, so these are upper bounds)
  const double cp_extra = d.cp > 1 ? d.a * d.n * (H + E) : 0.0;
  SSDShape shape;
  shape.algo = c.ssd_algo;
  shape.compute = c.ssd_compute;
  if (ssd_resolved_algo(shape) != SSDAlgo::portable) {  // gemm, or fused (whose backward is gemm's)
    const auto [fwd, bwd] = ssd_gemm_mem(H, G, N, P, Q, shape, d);
    // without cp the scan's context stays with the layer's activations (mixer.cpp: Mamba2Acts::ssd, SSDSaved),
    // and the backward reads it instead of forming it; with cp > 1 the forward's scan is transient and the
    // backward forms its own
    const double saved = d.cp > 1 ? 0.0 : ssd_saved_ctx_bytes(H, G, N, P, Q, d);
    m.full += saved;
    m.keep = pol == Recompute::none ? m.full : 0.0;
    m.fwd_extra = std::max(fwd - saved, cp_extra);
    m.bwd_extra = grads + std::max({bwd - saved, conv_bwd, cp_extra});
    return m;
  }
  m.fwd_extra = std::max(m.fwd_extra, cp_extra);
  const double scan_bwd = ctx + states + 2 * d.a * d.n * H * N + d.a * d.b * nc * H * 3;
  m.bwd_extra = grads + std::max({scan_bwd, conv_bwd, cp_extra});
  // ssd::chunk_bwd: 3 Q x Q tiles in level-1 scratch (+ the dL/dH tile when it does not fit on chip)
  const double dh = d.a * P * (N + 1);
  const bool fast = 7 * d.a * Q + dh <= 46.0 * 1024;
  const double per_team = 3 * d.a * Q * Q + (fast ? 0.0 : dh);
  m.scratch = per_team * std::min(d.b * nc * H, d.concurrency_teams);
  return m;
}

LayerMem mem_mamba1(const Mamba1Config& c, const Dims& d, Recompute pol) {
  if (c.window > 0 && d.L > double(c.window)) {
    Mamba1Config cw = c;
    cw.window = 0;
    const Dims dw = window_dims(d, c.window);
    const double E1 = double(c.d_inner()) / d.tp;
    const double S = d.b * (E1 * double(c.d_conv - 1) * d.t + E1 * double(c.d_state) * d.a);
    return windowed_mem(mem_mamba1(cw, dw, Recompute::mixer), std::ceil(d.L / double(c.window)), S, dw.n,
                        double(c.d_model), d);
  }
  const double E = double(c.d_inner()) / d.tp, N = double(c.d_state), R = double(c.rank()), Q = double(c.chunk);
  const double nc = std::ceil(d.L / Q);
  LayerMem m;
  const double ckpt = d.a * nc * N * d.b * E;
  m.full = d.n * d.t * (2 * E + E + R + 2 * N + E + E) + ckpt;
  m.keep = pol == Recompute::none ? m.full : 0.0;
  // selective_scan: the native CUDA forward (fp32, ssm/mamba1/scan_cuda.hpp) needs nothing beyond the checkpoints;
  // the chunk-parallel forward keeps chunk-local end states and decay factors (d_state <= 64), the per-channel one
  // its running state
  const bool native =
      mamba1_cuda::compiled() && d.t == 4 && mamba1_cuda::shape_fits(index_t(E), index_t(N), index_t(E));
  m.fwd_extra = native ? 0.0 : N <= 64 ? 2 * d.a * nc * N * d.b * E : d.a * N * d.b * E;
  // dy, dxz, dxc, ddelta, dbc, and A = -exp(A_log) and dA (E' x N); ddt_low comes after the scan's buffers are freed
  const double grads = d.n * d.t * (E + 2 * E + E + E + 2 * N) + 2 * d.a * E * N;
  // pass 2's parts of dB and dC: one per block of 32 channels (one group; 16 for the native CUDA chunk passes,
  // fp32 where they fit), as many at a time as 256 MiB holds
  const bool native_bwd = mamba1_cuda::compiled() && d.t == 4 &&
                          mamba1_cuda::backward_fits(index_t(E), index_t(N), index_t(E), index_t(Q));
  const double part = d.n * 2 * N * d.a;
  const double nblk =
      std::clamp(std::floor(double(256ull << 20) / part), 1.0, std::ceil(E / (native_bwd ? 16.0 : 32.0)));
  double scan = d.a * (std::min(Q, d.L) * N * d.b * E + N * d.b * E + 2 * d.n * E + nc * N * d.b * E +
                       d.b * E * N + 2 * d.b * E) +
                nblk * part;
  if (N <= 64) {
    // the chunk-parallel first pass: Delta and g per token, the carries, the partial sums per (batch, chunk), and
    // one at a time the chunks' local carries and decays, the rebuilt states of a slab of chunks (at most 1 GiB),
    // then pass 2's parts
    // (the native CUDA chunk passes, fp32 where they fit, rebuild the states in registers, no slab, and form the
    // parts while the local carries and decays are held)
    const double q = std::min(Q, d.L), chunk_states = d.a * q * N * d.b * E;
    const double slab = std::clamp(std::floor(double(1ull << 30) / chunk_states), 1.0, nc);
    scan = d.a * (2 * d.n * E + nc * N * d.b * E + d.b * nc * E * (N + 2)) +
           (native_bwd ? 2 * d.a * nc * N * d.b * E + nblk * part
                       : std::max({2 * d.a * nc * N * d.b * E, slab * chunk_states, nblk * part}));
  }
  m.bwd_extra = grads + scan;
  return m;
}

LayerMem mem_mamba3(const Mamba3Config& c, const Dims& d, Recompute pol) {
  const double E = double(c.d_inner()) / d.tp, H = double(c.nheads()) / d.tp, G = double(c.ngroups) / d.tp;
  const double N = double(c.d_state), R = double(c.rank()), P = double(c.headdim), S = double(c.nangles());
  const double Q = double(c.chunk_size), nc = std::ceil(d.L / Q);
  const double RGN = R * G * N, HRP = H * R * P, din = 2 * E + 2 * RGN + 3 * H + S;
  LayerMem m;
  // proj, qk, v (MIMO), y, and o: fp32, or its bf16 copy only under bf16 GEMMs (mixer.cpp, Mamba3Acts::o_b)
  const double o_el = d.copy_b16 > 0 ? d.copy_b16 : d.t;
  m.full = d.n * (d.t * (din + 2 * RGN + (c.is_mimo ? HRP : 0.0) + HRP) + o_el * E + d.a * 2 * R * G +
                  (c.is_outproj_norm ? d.a * H * R : 0.0));
  m.keep = pol == Recompute::none ? m.full : 0.0;
  // dproj: fp32, or SISO under bf16 GEMMs (Mamba3Mixer::bf16_in_proj_grad, DprojStore::automatic) its bf16 copy
  // with the scan's columns (all but z) in fp32
  const bool dproj_b16 = d.copy_b16 > 0 && c.dproj_bf16_shape();
  const double dproj = dproj_b16 ? d.copy_b16 * din + d.t * (din - E) : d.t * din;
  const double grads = d.n * (d.t * (E + HRP + 2 * RGN + (c.is_mimo ? HRP : 0.0)) + dproj);
  const double carry = d.a * d.b * H * nc * S;  // the rotary phases' per-chunk carries (while they are formed)
  Mamba3ScanShape ss;
  ss.rank = c.rank();
  ss.algo = c.scan_algo;
  ss.compute = c.scan_compute;
  if (ss.via_ssd()) {
    // SISO through the SSD (scan.cpp): Delta, lambda, A, w, A Delta, the phases, [k~ | q~] per head and
    // q~ . k~, with the SSD's own saved context (one group per head), stay with the layer's activations
    // (Mamba3Acts::scan, Mamba3ScanSaved) and the backward reads them instead of forming them; transient: the
    // diagonal's backward factor (one per (token, head), taken in the forward too) and its coefficient (the SSD's
    // D_token, one per (token, head), in both passes), the phases' carries, the SSD's other buffers; the
    // backward's dsh0, d[k~ | q~] and three per-token gradients around the SSD's backward, and D_token's
    SSDShape sh;
    sh.algo = c.scan_algo;
    sh.compute = c.scan_compute;
    const auto [fwd, bwd] = ssd_gemm_mem(H, H, N, P, Q, sh, d);
    // the quad kernels' 16-byte rows and columns (scan.cpp, quads_ok), for the bf16 forms below
    const auto m4 = [](double x) { return index_t(x) % 4 == 0; };
    const bool quads = R == 1 && m4(N) && m4(P) && m4(E) && m4(din) && m4(2 * RGN) &&
                       (c.pairing() != RopePairing::halved || index_t(N) % 8 == 0);
    const bool f32 = d.t == 4 && d.a == 4;  // float activations and accumulation
    // [k~ | q~] in bf16 where the rotation stores them so (mamba3_qk_bf16), else in acc_t
    Mamba3ScanShape full = c.scan_shape(index_t(d.b), index_t(d.L));
    full.nheads = index_t(H);  // a rank's heads and groups
    full.ngroups = index_t(G) > 0 ? index_t(G) : 1;
    const double qk_el = mamba3_qk_bf16(full, f32, quads) ? 2.0 : d.a;
    const double saved = ssd_saved_ctx_bytes(H, H, N, P, Q, d);
    const double kept_ctx = d.a * d.n * (6 * H + H * S) + qk_el * d.n * 2 * H * N + saved, fdv = d.a * d.n * H;
    m.full += kept_ctx;
    m.keep = pol == Recompute::none ? m.full : 0.0;
    m.fwd_extra = 2 * fdv + std::max(carry, fwd - saved);
    // d[k~ | q~] in bf16 where the SSD's one-kernel dB, dC gives them so (scan.cpp: float activations, bf16
    // arithmetic, one head a group, and the quad kernels' rows), else in acc_t
    const double dqk_el = f32 && quads && ssd_bc_bf16_applies(mamba3_ssd_shape(full)) ? 2.0 : d.a;
    m.bwd_extra = grads + 2 * fdv + d.a * d.b * H * P * N + d.n * (dqk_el * 2 * H * N + d.a * 4 * H) + bwd - saved;
    return m;
  }
  // the portable kernels (scan.cpp): Delta, lambda, A, the in-chunk cumsum, w, the phases, rotated q and k, and the
  // chunk states
  const double states = d.a * d.b * nc * H * P * N;
  const double ctx = d.a * d.n * (5 * H + H * S + 2 * H * R * N) + states;
  m.fwd_extra = ctx + carry;
  // backward: dsh0, dq~ and dk~, da, dw, ddiag, then dstates and the partial sums of dD (freed at the end of
  // the chunk kernels), or later dgp0, dphi and the phases' flows, then in their place dut, the k and q bias sums
  // and their column_reduce partials (ceil(n / 256) rows of 2 H R N)
  const double base = ctx + d.a * d.b * H * P * N + d.a * d.n * (2 * H * R * N + 3 * H);
  const double chunks = states + d.a * d.b * nc * H;
  const double late = d.a * d.b * H + d.a * d.n * H * S +
                      std::max(carry, d.a * d.n * H + d.a * (std::ceil(d.n / 256.0) + 1) * 2 * H * R * N);
  m.bwd_extra = grads + base + std::max(chunks, late);
  return m;
}

LayerMem mem_moe(const MoEConfig& c, const Dims& d, Recompute pol, double load) {
  const double D = double(c.d_model), ne = double(c.n_experts), k = double(c.top_k);
  const double F = double(c.d_ff) / d.tp, Fs = double(c.shared_d_ff) / d.tp, dr = double(c.router_in());
  const double mrows = d.n * k * load;  // assignments this rank's experts compute
  const double routing = d.n * (2 * d.a * ne + 2 * d.a + 4 * k + d.a * k + 8 * k) + mrows * (8 + 4) + 8 * ne;
  const double xr = (c.jitter > 0 || c.state_aware) ? d.n * d.t * dr : 0.0;
  const double bb = d.moe_b16, ne_l = ne / double(d.ep);
  // xp, y and h1, h3, a; on the bf16 path xp, [h1 | h3] and a in bf16 (y stays fp32) and the bf16 copies of the
  // local experts' weights, kept with them
  const double routed = bb > 0 ? mrows * (d.t * D + bb * (D + 3 * F)) + bb * 3 * ne_l * F * D
                               : mrows * d.t * (2 * D + 3 * F);
  const double experts = routed + d.n * d.t * 3 * Fs;
  const double a2a = d.ep > 1 ? 2 * mrows * d.t * D : 0.0;
  LayerMem m;
  m.full = routing + xr + experts;
  m.keep = routing + xr + ((pol == Recompute::none && !c.recompute) ? experts : 0.0);
  m.fwd_extra = a2a;  // (the shared expert writes into the layer output: no buffer of its own)
  // dy, dgate, dxp stay through the backward; then, one after the other: the experts' dh1, dh3; the shared
  // expert's; the router's dlogits (with d(router input) when the input is a copy)
  // (bf16 path: dy in bf16, and the experts' da and [dh1 | dh3] in bf16)
  const double dy_dxp = bb > 0 ? mrows * (bb + d.t) * D : mrows * d.t * 2 * D;
  const double dh = bb > 0 ? 3 * mrows * bb * F : 2 * mrows * d.t * F;
  m.bwd_extra = dy_dxp + d.n * d.a * k + std::max({dh, 2 * d.n * d.t * Fs, d.n * d.a * ne + xr}) + a2a;
  return m;
}

LayerMem mem_dense(index_t d_ff, const Dims& d, double D, Recompute pol) {
  const double F = double(d_ff) / d.tp;
  LayerMem m;
  m.full = d.n * d.t * 3 * F;
  m.keep = pol == Recompute::none ? m.full : 0.0;
  m.rec_extra = d.n * d.t * D;  // dense_ffn::y of the recompute, freed before the backward's dh1, dh3
  m.bwd_extra = d.n * d.t * 2 * F;
  return m;
}

}  // namespace

PlanModel plan_model(const LMConfig& lm) {
  PlanModel m;
  m.mixer = lm.mixer;
  m.n_layer = lm.n_layer;
  m.layers = lm.layers;
  m.vocab_size = lm.vocab_size;
  m.tie_embeddings = lm.tie_embeddings;
  return m;
}

const char* recompute_name(Recompute r) { return r == Recompute::none ? "none" : "mixer"; }

ParamCount planned_params(const PlanModel& m, index_t tp, index_t ep) {
  require(tp >= 1 && ep >= 1, kWhere, "tp and ep must be at least 1 (got tp = ", tp, ", ep = ", ep, ")");
  const std::string why = split_rules(m, tp, ep);
  require(why.empty(), kWhere, why);
  const index_t D = m.mixer.d_model, V = m.vocab_size;
  Acc acc;
  acc.add(V * D);  // embedding
  for (LayerKind k : kinds_of(m)) {
    acc.add(D);  // block norm
    switch (k) {
      case LayerKind::mamba2: {
        const Mamba2Config& c = m.mixer;
        const index_t E = c.d_inner() / tp, H = c.nheads() / tp, GN = c.ngroups / tp * c.d_state, C = E + 2 * GN;
        acc.add((2 * E + 2 * GN + H) * D);
        acc.add(C * c.d_conv);
        acc.add(C);
        for (int i = 0; i < 3; ++i) acc.add(H);  // dt_bias, A_log, D
        acc.add(E);                              // norm
        acc.add(D * E);                          // out_proj
        break;
      }
      case LayerKind::mamba1: {
        const Mamba1Config c = m1_cfg(m);
        const index_t E = c.d_inner() / tp, N = c.d_state, R = c.rank();
        acc.add(2 * E * D);
        acc.add(E * c.d_conv);
        acc.add(E);
        acc.add((R + 2 * N) * E);
        acc.add(E * R);
        acc.add(E);
        acc.add(E * N);
        acc.add(E);
        acc.add(D * E);
        break;
      }
      case LayerKind::mamba3: {
        const Mamba3Config c = m3_cfg(m);
        const index_t E = c.d_inner() / tp, H = c.nheads() / tp, N = c.d_state, R = c.rank(), G = c.ngroups / tp;
        acc.add((2 * E + 2 * R * G * N + 3 * H + c.nangles()) * D);
        acc.add(H);
        acc.add(H);
        acc.add(N);
        acc.add(N);
        acc.add(H * R * N);
        acc.add(H * R * N);
        if (c.is_mimo)
          for (int i = 0; i < 3; ++i) acc.add(H * R * c.headdim);
        if (c.is_outproj_norm) acc.add(E);
        acc.add(D * E);
        break;
      }
      case LayerKind::moe: {
        const MoEConfig c = moe_cfg(m);
        acc.add(c.n_experts * c.router_in());
        if (c.bias_update_rate > 0) acc.add(c.n_experts);
        const index_t el = c.n_experts / ep, F = c.d_ff / tp;
        for (int i = 0; i < 3; ++i) acc.add(el * F * D);
        if (c.shared_d_ff > 0)
          for (int i = 0; i < 3; ++i) acc.add(c.shared_d_ff / tp * D);
        break;
      }
      case LayerKind::dense:
        for (int i = 0; i < 3; ++i) acc.add(dense_ff(m) / tp * D);
        break;
    }
  }
  acc.add(D);  // norm_f
  if (!m.tie_embeddings) acc.add(V * D);
  return {acc.count, acc.padded};
}

std::string check_layout(const PlanInput& in, const Layout& layout_in) {
  Layout l = layout_in;
  if (l.tp < 1 || l.cp < 1 || l.ep < 1 || l.dp < 0) return "every dimension must be at least 1";
  const std::int64_t tce = l.tp * l.cp * l.ep;
  if (l.dp == 0) {
    if (in.gpus % tce != 0)
      return "tp * cp * ep = " + std::to_string(tce) + " does not divide the GPU count " + std::to_string(in.gpus);
    l.dp = in.gpus / tce;
  }
  if (tce * l.dp != in.gpus)
    return "tp * cp * ep * dp = " + std::to_string(tce * l.dp) + " is not the GPU count " + std::to_string(in.gpus);
  if (l.tp > in.gpus_per_node)
    return "tp = " + std::to_string(l.tp) + " exceeds the " + std::to_string(in.gpus_per_node) +
           " GPUs of a node (tensor parallelism needs the intra-node links)";
  std::string why = split_rules(in.model, l.tp, l.ep);
  if (!why.empty()) return why;
  if (in.seqlen % l.cp != 0)
    return "seqlen = " + std::to_string(in.seqlen) + " does not divide by cp = " + std::to_string(l.cp);
  {
    const auto kinds = kinds_of(in.model);
    const index_t w = std::max(uses(kinds, LayerKind::mamba2) ? in.model.mixer.window : 0,
                               uses(kinds, LayerKind::mamba1) ? in.model.layers.mamba1.window : 0);
    if (l.cp > 1 && w > 0)
      return "model.mixer_window = " + std::to_string(w) + " needs cp = 1 (got cp = " + std::to_string(l.cp) + ")";
  }
  const auto p = kinds_of(in.model);
  const index_t slice = in.seqlen / l.cp;
  auto chunk_rule = [&](index_t chunk, const char* kind) -> std::string {
    if (slice >= chunk) return "";
    return "cp = " + std::to_string(l.cp) + " leaves each rank " + std::to_string(slice) + " tokens, less than one " +
           kind + " chunk (" + std::to_string(chunk) +
           "): the state passing hands one state per chunk boundary, a slice needs at least one chunk";
  };
  if (uses(p, LayerKind::mamba2) && !(why = chunk_rule(in.model.mixer.chunk, "Mamba-2")).empty()) return why;
  if (uses(p, LayerKind::mamba3) && !(why = chunk_rule(in.model.layers.mamba3.chunk_size, "Mamba-3")).empty())
    return why;
  const std::int64_t data = l.ep * l.dp;
  if (in.global_batch % data != 0)
    return "the global batch of " + std::to_string(in.global_batch) + " sequences does not divide by ep * dp = " +
           std::to_string(data) + " (the ep x dp ranks hold different sequences)";
  return "";
}

// The activation dimensions of one rank under layout l for `rows` sequences of the training (or, with eval, the
// evaluation) length, its cp slice.
Dims lm_dims(const PlanInput& in, const Layout& l, index_t rows, bool eval) {
  Dims d;
  d.t = double(in.dtype_bytes);
  d.a = in.dtype_bytes == 8 ? 8.0 : 4.0;
  d.b = double(rows);
  d.L = double((eval && in.eval_seqlen > 0 ? in.eval_seqlen : in.seqlen) / l.cp);
  d.n = d.b * d.L;
  d.tp = l.tp;
  d.ep = l.ep;
  d.cp = l.cp;
  d.concurrency_teams = std::max(1.0, std::floor(double(in.gpu_concurrency) / 256.0));
  d.moe_b16 = in.moe_bf16 && in.dtype_bytes == 4 ? double(sizeof(bf16_op_t)) : 0.0;
#if defined(KOKKOS_ENABLE_CUDA)
  d.copy_b16 = d.moe_b16;
#endif
  return d;
}

// Every layer's activation terms, in pattern order.
std::vector<LayerMem> layer_mems(const PlanInput& in, const Dims& d, Recompute policy) {
  const PlanModel& M = in.model;
  std::vector<LayerMem> lm;
  for (LayerKind k : kinds_of(M)) {
    switch (k) {
      case LayerKind::mamba2: lm.push_back(mem_mamba2(M.mixer, d, policy)); break;
      case LayerKind::mamba1: lm.push_back(mem_mamba1(m1_cfg(M), d, policy)); break;
      case LayerKind::mamba3: lm.push_back(mem_mamba3(m3_cfg(M), d, policy)); break;
      case LayerKind::moe: lm.push_back(mem_moe(moe_cfg(M), d, policy, in.moe_load_factor)); break;
      case LayerKind::dense: lm.push_back(mem_dense(dense_ff(M), d, double(M.mixer.d_model), policy)); break;
    }
  }
  return lm;
}

// The evaluation forward (MambaLM::forward, no training) on d.n tokens: lm::h (updated in place) and the batch, the
// final-norm output hf and the backbone's layer output m, each block's rstd (kept until the next forward), the
// current block's xn and its layer's activations and transients; after the blocks, rstd_f and the logits.
double eval_activations(const PlanInput& in, const Dims& d) {
  const double D = double(in.model.mixer.d_model), V = double(in.model.vocab_size);
  const double base = d.n * (d.a * D + 12) + d.n * 2 * d.t * D;
  double peak = 0, rstd = 0;
  for (const LayerMem& x : layer_mems(in, d, Recompute::mixer)) {
    rstd += d.a * d.n;
    peak = std::max(peak, base + rstd + d.n * d.t * D + x.full + x.fwd_extra);
  }
  return std::max(peak, base - d.n * d.t * D + rstd + d.a * d.n + d.n * d.t * V);
}

Plan estimate(const PlanInput& in, const Layout& layout_in, index_t micro_batch, Recompute policy) {
  require(in.seqlen >= 1 && in.global_batch >= 1 && in.gpus >= 1, kWhere,
          "seqlen, global batch and GPU count must be positive (got ", in.seqlen, ", ", in.global_batch, ", ",
          in.gpus, ")");
  require(in.dtype_bytes == 4 || in.dtype_bytes == 8, kWhere, "dtype bytes must be 4 or 8 (got ", in.dtype_bytes,
          ")");
  const std::string why = check_layout(in, layout_in);
  require(why.empty(), kWhere, layout_str(layout_in), ": ", why);
  Layout l = layout_in;
  if (l.dp == 0) l.dp = in.gpus / (l.tp * l.cp * l.ep);
  const index_t per_rank = in.global_batch / (l.ep * l.dp);
  require(micro_batch >= 1 && per_rank % micro_batch == 0, kWhere, "micro-batch ", micro_batch,
          " does not divide the ", per_rank, " sequences of a data rank (global batch ", in.global_batch,
          " / (ep * dp = ", l.ep * l.dp, "))");

  const PlanModel& M = in.model;
  const Dims d = lm_dims(in, l, micro_batch, false);
  const double t = d.t, a = d.a;
  const double D = double(M.mixer.d_model), V = double(M.vocab_size);

  Plan p;
  p.layout = l;
  p.micro_batch = micro_batch;
  p.accumulation = per_rank / micro_batch;
  p.policy = policy;
  p.tokens_per_rank = index_t(d.n);
  const ParamCount pc = planned_params(M, l.tp, l.ep);
  p.param_elements = pc.padded;
  p.bytes_params = a * double(pc.padded);
  p.bytes_grads = a * double(pc.padded);
  p.bytes_optimizer = (2 * a + 1) * double(pc.padded);

  const std::vector<LayerMem> lm = layer_mems(in, d, policy);
  // kept per block: h_{l+1}, rstd_l and, under policy none only, xn_l (under mixer the backbone drops xn_l after the
  // block's forward and recomputes it just before the layer's backward)
  // (xn_l in fp32, or as a bf16 copy for the layers that take one: LayerMem::xn_elem)
  const auto xn_of = [&](const LayerMem& x) { return d.n * (x.xn_elem > 0 ? x.xn_elem : t) * D; };
  const bool keep_xn = policy == Recompute::none;
  const double block = d.n * (a * D + a);  // + xn_l when kept
  const double lm_h = d.n * (a * D + 12);  // lm::h (= h_0) and the batch
  // forward: kept so far + hf + the backbone's m + the current layer's full activations and scan context
  // (the layer's h_{l+1} is allocated after its forward has dropped what it does not keep)
  double fwd_peak = 0, kept = 0;
  for (const LayerMem& x : lm) {
    fwd_peak = std::max(fwd_peak, lm_h + d.n * 2 * t * D + kept + xn_of(x) + d.n * a + x.full + x.fwd_extra);
    kept += block + (keep_xn ? xn_of(x) : 0.0) + x.keep;
  }
  // backward: all blocks' h, rstd + the LM head's buffers (hf, rstd_f, logits, dlogits, dhf, dh, dxn) + the layers
  // not yet done + the live xn + the current layer's recomputed activations and backward transient
  const double head = d.n * (t * D + a + 2 * t * V + t * D + a * D + t * D);
  // (xn_l, kept or recomputed, is freed right after the layer's backward: at layer l only xn_0 .. xn_l are live)
  double base = lm_h + head + block * double(lm.size()), below = 0, bwd_peak = 0, scratch = 0, xn_live = 0;
  for (const LayerMem& x : lm) {
    below += x.keep;
    xn_live = keep_xn ? xn_live + xn_of(x) : xn_of(x);
    const bool rebuilt = x.full > x.keep;
    const double rec = rebuilt ? (x.rec_extra >= 0 ? x.rec_extra : x.fwd_extra) : 0.0;
    bwd_peak = std::max(bwd_peak, base + below + xn_live + (x.full - x.keep) + std::max(rec, x.bwd_extra));
    scratch = std::max(scratch, x.scratch);
  }
  p.bytes_train_activations = std::max(fwd_peak, bwd_peak);
  p.bytes_eval_activations = in.eval_batch > 0 ? eval_activations(in, lm_dims(in, l, in.eval_batch, true)) : 0.0;
  p.bytes_activations = std::max(p.bytes_train_activations, p.bytes_eval_activations);
  // with ep * dp > 1 the trainer's all-gather buffer of per-micro-batch gradients (TrainConfig::gather_buffer_bytes,
  // 64 MiB, or all data ranks' gradients when smaller)
  const double data_ranks = double(l.ep * l.dp);
  const double gather = data_ranks > 1 ? std::min(a * double(pc.padded) * data_ranks, double(64ull << 20)) : 0.0;
  p.bytes_workspace = scratch + gather + in.runtime_reserve_bytes;
  p.bytes_total = p.bytes_params + p.bytes_grads + p.bytes_optimizer + p.bytes_activations + p.bytes_workspace;
  p.bytes_available = in.memory_fraction * in.gpu_memory_bytes;
  return p;
}

Plan plan(const PlanInput& in) {
  require(in.gpus >= 1, kWhere, "the GPU count must be positive (got ", in.gpus, ")");
  require(in.gpu_memory_bytes > 0, kWhere, "the GPU memory must be positive (got ", in.gpu_memory_bytes, ")");
  require(in.gpus_per_node >= 1, kWhere, "GPUs per node must be positive (got ", in.gpus_per_node, ")");
  in.model.mixer.validate(kWhere);
  in.model.layers.validate(in.model.mixer.d_model, in.model.n_layer, kWhere);
  const double avail = in.memory_fraction * in.gpu_memory_bytes;

  std::vector<index_t> divs;
  for (index_t x = 1; x <= in.gpus; ++x)
    if (in.gpus % x == 0) divs.push_back(x);

  std::ostringstream lines;
  bool have_best = false, have_valid = false;
  Plan best, closest;
  double closest_total = 0;
  auto key = [](const Plan& p) {
    return std::make_tuple(p.layout.tp, p.layout.ep, p.policy == Recompute::none ? 0 : 1, p.layout.cp,
                           -p.micro_batch);
  };
  for (index_t tp : divs)
    for (index_t ep : divs)
      for (index_t cp : divs) {
        if (in.gpus % (tp * ep * cp) != 0) continue;
        const Layout l{tp, cp, ep, in.gpus / (tp * ep * cp)};
        const std::string why = check_layout(in, l);
        if (!why.empty()) {
          lines << layout_str(l) << ": rejected: " << why << "\n";
          continue;
        }
        have_valid = true;
        const index_t per_rank = in.global_batch / (l.ep * l.dp);
        for (Recompute pol : {Recompute::none, Recompute::mixer}) {
          bool fit = false;
          for (index_t mb = per_rank; mb >= 1 && !fit; --mb) {
            if (per_rank % mb != 0) continue;
            const Plan p = estimate(in, l, mb, pol);
            if (mb == 1 && (!have_valid || closest_total == 0 || p.bytes_total < closest_total)) {
              closest = p;
              closest_total = p.bytes_total;
            }
            if (p.bytes_total <= avail) {
              fit = true;
              lines << layout_str(l) << " recompute " << recompute_name(pol) << ": fits with micro-batch " << mb
                    << " (" << gb(p.bytes_total) << " of " << gb(avail) << ")\n";
              if (!have_best || key(p) < key(best)) best = p, have_best = true;
            } else if (mb == 1) {
              lines << layout_str(l) << " recompute " << recompute_name(pol) << ": does not fit even at micro-batch 1 ("
                    << gb(p.bytes_total) << " > " << gb(avail) << ", activations " << gb(p.bytes_activations)
                    << ")\n";
            }
          }
        }
      }
  if (!have_valid)
    throw Error(kWhere, "no layout of " + std::to_string(in.gpus) + " GPUs obeys the rules:\n" + lines.str());
  if (!have_best) {
    const Plan& c = closest;
    throw Error(kWhere, "the model does not fit in " + gb(avail) + " (" + std::to_string(int(in.memory_fraction * 100)) +
                            " % of " + gb(in.gpu_memory_bytes) + ") on any layout of " + std::to_string(in.gpus) +
                            " GPU(s) at seqlen " + std::to_string(in.seqlen) + "; the closest, " +
                            layout_str(c.layout) + " with recompute " + recompute_name(c.policy) +
                            " and micro-batch 1, needs " + gb(c.bytes_total) + " (params " + gb(c.bytes_params) +
                            ", grads " + gb(c.bytes_grads) + ", optimizer " + gb(c.bytes_optimizer) +
                            ", activations " + gb(c.bytes_activations) + ", workspace " + gb(c.bytes_workspace) +
                            "): " + gb(c.bytes_total - avail) + " too much\n" + lines.str());
  }
  best.reasoning = lines.str() + "chosen: " + layout_str(best.layout) + " recompute " + recompute_name(best.policy) +
                   " micro-batch " + std::to_string(best.micro_batch) +
                   " (preference: smallest tp, then ep, recompute none, smallest cp, largest micro-batch)\n";
  return best;
}

std::string describe(const Plan& p) {
  std::ostringstream s;
  s << "layout " << layout_str(p.layout) << ", micro-batch " << p.micro_batch << " (x" << p.accumulation
    << " accumulation), recompute " << recompute_name(p.policy) << ", " << p.tokens_per_rank
    << " tokens per rank per micro-batch\n";
  s << "memory per GPU: params " << gb(p.bytes_params) << ", grads " << gb(p.bytes_grads) << ", optimizer "
    << gb(p.bytes_optimizer) << ", activations " << gb(p.bytes_activations);
  if (p.bytes_eval_activations > 0)
    s << " (the larger of training " << gb(p.bytes_train_activations) << " and evaluation "
      << gb(p.bytes_eval_activations) << ")";
  s << ", workspace " << gb(p.bytes_workspace) << "; total " << gb(p.bytes_total) << " of " << gb(p.bytes_available)
    << " usable\n";
  return s.str();
}

}  // namespace mm::parallel
