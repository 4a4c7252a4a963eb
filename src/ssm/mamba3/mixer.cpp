#include "ssm/mamba3/mixer.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "core/pool.hpp"
#include "layers/linear.hpp"
#include "tensor/ops.hpp"

namespace mm {

void Mamba3Config::validate(const std::string& context) const {
  require(d_model > 0 && d_state > 0 && expand > 0 && headdim > 0 && ngroups > 0 && chunk_size > 0, context,
          "d_model (", d_model, "), d_state (", d_state, "), expand (", expand, "), headdim (", headdim,
          "), ngroups (", ngroups, ") and chunk_size (", chunk_size, ") must be positive");
  require(d_inner() % headdim == 0, context, "d_inner = expand * d_model = ", d_inner(),
          " is not divisible by headdim = ", headdim);
  require(nheads() % ngroups == 0, context, "nheads = d_inner / headdim = ", nheads(),
          " is not divisible by ngroups = ", ngroups);
  require(!is_mimo || mimo_rank >= 1, context, "mimo_rank must be at least 1 (got ", mimo_rank, ")");
  require(rope_fraction >= 0 && rope_fraction <= 1, context, "rope_fraction must be in [0, 1] (got ", rope_fraction,
          ")");
  require(pairing() != RopePairing::halved || nangles() == 0 || d_state % 2 == 0, context,
          "halved rotary pairs need an even d_state (got ", d_state, ")");
  require(A_floor >= 0, context, "A_floor must be non-negative (got ", A_floor, ")");
  require(dt_min > 0 && dt_max >= dt_min, context, "need 0 < dt_min <= dt_max (got ", dt_min, ", ", dt_max, ")");
  require(norm_eps > 0, context, "norm_eps must be positive (got ", norm_eps, ")");
}

namespace {
// Context parallel helpers (free functions: CUDA lambdas may not sit in private member functions).
// Per batch row: a[b] (times b2[b] when given) as a device vector of P.
template <class P>
View1<P> m3_rows(const std::vector<int>& a, const std::vector<int>* b2) {
  View1<P> v(Kokkos::view_alloc(Kokkos::WithoutInitializing, "mamba3::cp_rows"), a.size());
  auto h = Kokkos::create_mirror_view(HostMem(), v);
  for (std::size_t i = 0; i < a.size(); ++i) h(i) = (a[i] && (!b2 || (*b2)[i])) ? P(1) : P(0);
  Kokkos::deep_copy(v, h);
  return v;
}

// data (batch rows of total / batch values each) *= w(row)
template <class P>
void m3_scale_rows(P* data, std::size_t total, index_t batch, const View1<P>& w) {
  if (total == 0) return;
  const index_t per = index_t(total) / batch;
  View1<P> d(data, total);
  par_for("mamba3::cp_scale_rows", index_t(total), KOKKOS_LAMBDA(index_t i) { d(i) *= w(i / per); });
}

// g(b, h) = w(b) prod_t exp(A_t Delta_t) over the slice (the scan's Delta and A)
template <class T>
View1<acc_t<T>> m3_total_decay(const View2<T>& dd, index_t dt_col, const View1<const acc_t<T>>& dt_bias,
                               double A_floor, const View1<acc_t<T>>& w, index_t batch, index_t L, index_t H) {
  using P = acc_t<T>;
  View1<P> g(Kokkos::view_alloc(Kokkos::WithoutInitializing, "mamba3::cp_g"), batch * H);
  const P floor_ = P(A_floor);
  const index_t A_col = dt_col + H;
  // one team per (row, head), the sum over the slice reduced across the team (not a serial loop over 10^5 tokens)
  par_for_team("mamba3::cp_total_decay", batch * H, KOKKOS_LAMBDA(const Team& tm) {
    const index_t bh = tm.league_rank(), b = bh / H, h = bh % H;
    P run = 0;
    Kokkos::parallel_reduce(
        Kokkos::TeamThreadRange(tm, L),
        [&](index_t t, P& acc) {
          const P d = softplus(P(dd(b * L + t, dt_col + h)) + dt_bias(h));
          const P x = P(dd(b * L + t, A_col + h));
          const P f = x >= P(0) ? P(1) + x : P(1) / (P(1) - x);  // the scan's heavy tail
          acc += -(f > floor_ ? f : floor_) * d;
        },
        run);
    Kokkos::single(Kokkos::PerTeam(tm), [&] { g(bh) = w(b) * Kokkos::exp(run); });
  });
  return g;
}

// k and v (batch, H, R, .) to the right neighbour (forward) or the left one (backward); what arrives lands in
// k_out, v_out (zero at the chain's end).
template <class P>
void m3_shift_kv(const parallel::Comm& cp, const View4<P>& k, const View4<P>& v, const View4<P>& k_out,
                 const View4<P>& v_out, bool to_right) {
  const int r = cp.rank(), n = cp.size();
  const int dest = to_right ? (r + 1 < n ? r + 1 : -1) : (r > 0 ? r - 1 : -1);
  const int src = to_right ? (r > 0 ? r - 1 : -1) : (r + 1 < n ? r + 1 : -1);
  auto hk = Kokkos::create_mirror_view_and_copy(HostMem(), k);
  auto hv = Kokkos::create_mirror_view_and_copy(HostMem(), v);
  std::vector<P> send(hk.size() + hv.size()), recv(send.size(), P(0));
  std::copy(hk.data(), hk.data() + hk.size(), send.begin());
  std::copy(hv.data(), hv.data() + hv.size(), send.begin() + hk.size());
  cp.sendrecv(send.data(), dest >= 0 ? send.size() : 0, dest, recv.data(), src >= 0 ? recv.size() : 0, src);
  auto ok = Kokkos::create_mirror_view(HostMem(), k_out);
  auto ov = Kokkos::create_mirror_view(HostMem(), v_out);
  std::copy(recv.begin(), recv.begin() + hk.size(), ok.data());
  std::copy(recv.begin() + hk.size(), recv.end(), ov.data());
  Kokkos::deep_copy(k_out, ok);
  Kokkos::deep_copy(v_out, ov);
}
}  // namespace

template <class T>
Mamba3Mixer<T>::Mamba3Mixer(const Mamba3Config& cfg, ParamStore<P>& store, const std::string& prefix,
                            index_t n_layer, const parallel::ModelComms& comms)
    : cfg_(cfg), store_(&store), cp_(comms.cp) {
  cfg_.validate(prefix.empty() ? "mamba3" : prefix);
  require(comms.tp->size() == 1, prefix.empty() ? "mamba3" : prefix, "tensor parallelism (tp = ", comms.tp->size(),
          ") is not implemented for the Mamba-3 mixer (layer kind mamba3)");
  require(n_layer > 0, prefix.empty() ? "mamba3" : prefix, "n_layer must be positive (got ", n_layer, ")");
  const index_t D = cfg.d_model, E = cfg.d_inner(), H = cfg.nheads(), N = cfg.d_state, R = cfg_.rank(),
                Pd = cfg.headdim;
  const double lin_in = 1.0 / std::sqrt(double(D)), lin_out = 1.0 / std::sqrt(double(E));
  Init inv_rank;
  inv_rank.kind = Init::constant;
  inv_rank.a = 1.0 / double(R);
  in_proj_ = store.add(prefix + "in_proj.weight", {cfg_.d_in_proj(), D}, true, Init::Uniform(-lin_in, lin_in));
  dt_bias_ = store.add(prefix + "dt_bias", {H}, false, Init::DtBias(cfg.dt_min, cfg.dt_max, cfg.dt_init_floor));
  D_ = store.add(prefix + "D", {H}, false, Init::Ones());
  B_norm_ = store.add(prefix + "B_norm.weight", {N}, false, Init::Ones());
  C_norm_ = store.add(prefix + "C_norm.weight", {N}, false, Init::Ones());
  B_bias_ = store.add(prefix + "B_bias", {H, R, N}, false, Init::Ones());
  C_bias_ = store.add(prefix + "C_bias", {H, R, N}, false, Init::Ones());
  if (cfg.is_mimo) {
    mimo_x_ = store.add(prefix + "mimo_x", {H, R, Pd}, false, inv_rank);
    mimo_z_ = store.add(prefix + "mimo_z", {H, R, Pd}, false, Init::Ones());
    mimo_o_ = store.add(prefix + "mimo_o", {H, R, Pd}, false, inv_rank);
  }
  if (cfg.is_outproj_norm) norm_w_ = store.add(prefix + "norm.weight", {E}, false, Init::Ones());
  out_proj_ = store.add(prefix + "out_proj.weight", {D, E}, true,
                        Init::Uniform(-lin_out, lin_out, 1.0 / std::sqrt(double(n_layer))));
}

Mamba3ScanShape Mamba3Config::scan_shape(index_t batch, index_t seqlen) const {
  Mamba3ScanShape s;
  s.batch = batch;
  s.seqlen = seqlen;
  s.nheads = nheads();
  s.headdim = headdim;
  s.ngroups = ngroups;
  s.dstate = d_state;
  s.rank = rank();
  s.nangles = nangles();
  s.chunk = chunk_size;
  s.pairing = pairing();
  s.A_floor = A_floor;
  s.algo = scan_algo;
  s.compute = scan_compute;
  return s;
}

template <class T>
Mamba3ScanShape Mamba3Mixer<T>::scan_shape(index_t batch, index_t seqlen) const {
  return cfg_.scan_shape(batch, seqlen);
}

template <class T>
Mamba3State<T> Mamba3Mixer<T>::make_state(index_t batch) const {
  Mamba3State<T> st;
  st.batch = batch;
  st.carry = Mamba3Carry<P>::allocate("mamba3::state", scan_shape(batch, 1));
  return st;
}

template <class T>
Mamba3ScanIn<T> Mamba3Mixer<T>::scan_in(const Mamba3Acts<T>& a) const {
  const index_t E = cfg_.d_inner(), H = cfg_.nheads(), RGN = cfg_.rank() * cfg_.ngroups * cfg_.d_state;
  Mamba3ScanIn<T> in;
  if (cfg_.is_mimo) {
    in.v = a.v;
    in.v_col = 0;
  } else {
    in.v = a.proj;
    in.v_col = E;
  }
  in.qk = a.qk;
  in.q_col = 0;
  in.k_col = RGN;
  in.dd = a.proj;
  in.dt_col = 2 * E + 2 * RGN;
  in.A_col = in.dt_col + H;
  in.trap_col = in.dt_col + 2 * H;
  in.angle_col = in.dt_col + 3 * H;
  in.dt_bias = store_->v1(dt_bias_);
  in.D = store_->v1(D_);
  in.q_bias = store_->v1(C_bias_);
  in.k_bias = store_->v1(B_bias_);
  in.init = a.init;
  in.seq_idx = a.seq;
  return in;
}

namespace {

// The output gate of one (token, head, rank, p): g = (norm ? y rstd w : y) silu(z mimo_z), o += mimo_o g.
template <class T>
struct Gate {
  using P = acc_t<T>;
  View2<const T> y, proj;
  View2<P> rstd;  // (rows, H R) with the norm
  View1<const P> mz, mo, w;
  index_t H, R, Pd;
  bool mimo, norm;
  KOKKOS_INLINE_FUNCTION P zz(index_t i, index_t h, index_t r, index_t p) const {
    const P z = P(proj(i, h * Pd + p));  // z is the first E columns of the in_proj output
    return mimo ? z * mz((h * R + r) * Pd + p) : z;
  }
  KOKKOS_INLINE_FUNCTION P mo_of(index_t h, index_t r, index_t p) const {
    return mimo ? mo((h * R + r) * Pd + p) : P(1);
  }
  // the normalised (or plain) y times the norm weight
  KOKKOS_INLINE_FUNCTION P yw(index_t i, index_t h, index_t r, index_t p) const {
    const P yv = P(y(i, (h * R + r) * Pd + p));
    return norm ? yv * rstd(i, h * R + r) * w(h * Pd + p) : yv;
  }
};


// RMSNorm of every N-group of C (-> q, columns [0, RGN)) and B (-> k, columns [RGN, 2 RGN)) of the in_proj output.
template <class T>
void bc_norm_forward(const View2<T>& proj, const View1<const acc_t<T>>& wB, const View1<const acc_t<T>>& wC,
                     acc_t<T> eps, index_t E, index_t N, index_t RG, const View2<T>& qk,
                     const View2<acc_t<T>>& rstd) {
  using P = acc_t<T>;
  const index_t RGN = RG * N;
  // one (token, group) per thread, lanes over the N values
  par_for_rows("mamba3::bc_norm", proj.extent(0) * 2 * RG, KOKKOS_LAMBDA(const Team& tm, index_t ij) {
    const index_t i = ij / (2 * RG), j = ij % (2 * RG), part = j / RG, grp = j % RG;
    const index_t src = 2 * E + (part == 0 ? RGN : 0) + grp * N, dst = part * RGN + grp * N;
    const auto& wt = part == 0 ? wC : wB;
    const T* x = &proj(i, src);
    P ss = 0;
    Kokkos::parallel_reduce(Kokkos::ThreadVectorRange(tm, N), [&](index_t m, P& a) { a += P(x[m]) * P(x[m]); }, ss);
    const P r = P(1) / Kokkos::sqrt(ss / P(N) + eps);
    Kokkos::single(Kokkos::PerThread(tm), [&]() { rstd(i, j) = r; });
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(tm, N),
                         [&](index_t m) { qk(i, dst + m) = static_cast<T>(P(x[m]) * r * wt(m)); });
  });
}

// MIMO up-projection v_{h,r,p} = x_{h,p} mimo_x[h,r,p].
template <class T>
void mimo_x_forward(const View2<T>& proj, const View1<const acc_t<T>>& mx, index_t E, index_t R, index_t Pd,
                    const View2<T>& v) {
  using P = acc_t<T>;
  par_for("mamba3::mimo_x", v.extent(0), v.extent(1), KOKKOS_LAMBDA(index_t i, index_t hrp) {
    const index_t h = hrp / (R * Pd), p = hrp % Pd;
    v(i, hrp) = static_cast<T>(P(proj(i, E + h * Pd + p)) * mx(hrp));
  });
}

// Row kernels over (token i, head h, rank r), lanes over p: body(team, i, h, r).
template <class F>
void per_head_rank(const char* label, index_t n, index_t H, index_t R, const F& body) {
  par_for_rows(label, n * H * R, KOKKOS_LAMBDA(const Team& tm, index_t ihr) {
    body(tm, ihr / (H * R), (ihr / R) % H, ihr % R);
  });
}

// Whether the gate's passes can take quads of columns (float SISO: no MIMO projections, headdim a multiple of 4,
// y, the in_proj output (z at column 0) and `more` float4-aligned rows).
template <class T>
bool gate_quads_ok(const Gate<T>& gt, std::initializer_list<std::pair<const void*, long long>> more) {
  if constexpr (!std::is_same_v<T, float>) {
    return false;
  } else {
    if (gt.mimo || gt.R != 1 || gt.Pd % 4 != 0 || (gt.norm && !aligned16(gt.w.data()))) return false;
    for (const auto& [p, ld] : more)
      if (!float4_rows({{p, ld}})) return false;
    return float4_rows({{gt.y.data(), gt.y.stride(0)}, {gt.proj.data(), gt.proj.stride(0)}});
  }
}

// Gate (and the per-head norm, whose rstd it stores first) and the MIMO down-projection into o; elementwise over
// (token, column) so that a warp reads and writes contiguous columns. kB16: o is out_proj's bf16 copy (float T only).
template <class T, bool kB16 = false>
void gate_forward(const Gate<T>& gt, acc_t<T> eps, const View2<std::conditional_t<kB16, bf16_op_t, T>>& o) {
  using P = acc_t<T>;
  static_assert(!kB16 || std::is_same_v<T, float>);
  const index_t n = o.extent(0);
  if (gt.norm)
    per_head_rank("mamba3::gate_rstd", n, gt.H, gt.R, KOKKOS_LAMBDA(const Team& tm, index_t i, index_t h, index_t r) {
      const T* yr = &gt.y(i, (h * gt.R + r) * gt.Pd);
      P ss = 0;
      Kokkos::parallel_reduce(
          Kokkos::ThreadVectorRange(tm, gt.Pd), [&](index_t p, P& a) { a += P(yr[p]) * P(yr[p]); }, ss);
      Kokkos::single(Kokkos::PerThread(tm), [&]() { gt.rstd(i, h * gt.R + r) = P(1) / Kokkos::sqrt(ss / P(gt.Pd) + eps); });
    });
  // SISO: quads of columns, 16-byte accesses on GPUs (8-byte stores of the bf16 copy)
  const bool quads = kB16 ? gate_quads_ok(gt, {}) && reinterpret_cast<std::uintptr_t>(o.data()) % 8 == 0 &&
                                o.stride(0) % 4 == 0
                          : gate_quads_ok(gt, {{o.data(), o.stride(0)}});
  if (quads) {
    par_for("mamba3::gate", n, gt.H * gt.Pd / 4, KOKKOS_LAMBDA(index_t i, index_t qu) {
      const index_t hp = 4 * qu, h = hp / gt.Pd;
      P yv[4], zv[4], sc[4] = {P(1), P(1), P(1), P(1)}, ov[4];
      load_vec<4>(&gt.y(i, hp), yv);
      load_vec<4>(&gt.proj(i, hp), zv);
      if (gt.norm) {
        load_vec<4>(&gt.w(hp), sc);
        for (int e = 0; e < 4; ++e) sc[e] *= gt.rstd(i, h);
      }
      for (int e = 0; e < 4; ++e) ov[e] = yv[e] * sc[e] * silu(zv[e]);
      auto* dst = &o(i, hp);  // (o captured outside the constexpr-if: nvcc's extended lambdas need that)
      if constexpr (kB16)
        store_bf16_op_vec<4>(dst, ov);
      else
        store_vec<4>(dst, ov);
    });
    return;
  }
  par_for("mamba3::gate", n, gt.H * gt.Pd, KOKKOS_LAMBDA(index_t i, index_t hp) {
    const index_t h = hp / gt.Pd, p = hp % gt.Pd;
    P acc = 0;
    for (index_t r = 0; r < gt.R; ++r) acc += gt.mo_of(h, r, p) * gt.yw(i, h, r, p) * silu(gt.zz(i, h, r, p));
    auto& dst = o(i, hp);
    if constexpr (kB16)
      dst = to_bf16_op(float(acc));
    else
      dst = static_cast<T>(acc);
  });
}

}  // namespace

template <class T>
void Mamba3Mixer<T>::run_internals(const View2<T>& u, index_t batch, index_t seqlen, Mamba3Acts<T>& a,
                                   const Mamba3Carry<P>& fin) const {
  const index_t n = batch * seqlen, E = cfg_.d_inner(), H = cfg_.nheads(), N = cfg_.d_state, R = cfg_.rank(),
                G = cfg_.ngroups, Pd = cfg_.headdim, RG = R * G, RGN = RG * N;
  a.u = u;
  a.internals = std::make_shared<PoolScope>();
  PoolScope& ws = *a.internals;
  a.proj = ws.take<View2<T>>("mamba3::proj", n, cfg_.d_in_proj());
  a.qk = ws.take<View2<T>>("mamba3::qk", n, 2 * RGN);
  a.y = ws.take<View2<T>>("mamba3::y", n, H * R * Pd);
  if (bf16_out_proj())
    a.o_b = ws.take<View2<bf16_op_t>>("mamba3::o_bf16", n, E);
  else
    a.o = ws.take<View2<T>>("mamba3::o", n, E);
  a.rstd_qk = ws.take<View2<P>>("mamba3::rstd_qk", n, 2 * RG);
  linear_forward<T>(u, store_->v2(in_proj_), View1<const P>(), a.proj);

  bc_norm_forward<T>(a.proj, store_->v1(B_norm_), store_->v1(C_norm_), P(cfg_.norm_eps), E, N, RG, a.qk, a.rstd_qk);
  if (cfg_.is_mimo) {
    a.v = ws.take<View2<T>>("mamba3::v", n, H * R * Pd);
    mimo_x_forward<T>(a.proj, store_->v1(mimo_x_), E, R, Pd, a.v);
  }
  mamba3_scan_forward<T>(scan_shape(batch, seqlen), scan_in(a), a.y, fin, &a.scan, a.internals.get());

  // Gate (and the per-head norm) and the MIMO down-projection.
  Gate<T> gt;
  gt.y = a.y;
  gt.proj = a.proj;
  gt.H = H;
  gt.R = R;
  gt.Pd = Pd;
  gt.mimo = cfg_.is_mimo;
  gt.norm = cfg_.is_outproj_norm;
  if (gt.mimo) {
    gt.mz = store_->v1(mimo_z_);
    gt.mo = store_->v1(mimo_o_);
  }
  if (gt.norm) {
    a.rstd_out = ws.take<View2<P>>("mamba3::rstd_out", n, H * R);
    gt.rstd = a.rstd_out;
    gt.w = store_->v1(norm_w_);
  }
  if constexpr (std::is_same_v<T, float>) {
    if (a.o_b.extent(0) > 0) return gate_forward<T, true>(gt, P(cfg_.norm_eps), a.o_b);
  }
  gate_forward<T>(gt, P(cfg_.norm_eps), a.o);
}

template <class T>
bool Mamba3Mixer<T>::bf16_out_proj() const {
  return std::is_same_v<T, float> && float_gemm_on_bf16_copies();
}

DprojStore dproj_store = DprojStore::automatic;

template <class T>
bool Mamba3Mixer<T>::bf16_in_proj_grad() const {
  return dproj_store == DprojStore::automatic && std::is_same_v<T, float> && float_gemm_on_bf16_copies() &&
         cfg_.dproj_bf16_shape();
}

// out = o W_out^T from the kept gate output, fp32 or its bf16 copy.
template <class T>
void Mamba3Mixer<T>::out_proj_forward(const Mamba3Acts<T>& acts, const View2<T>& out) const {
  if constexpr (std::is_same_v<T, float>) {
    if (acts.o_b.extent(0) > 0) return linear_forward_gemm_bf16x(acts.o_b, store_->v2(out_proj_), out);
  }
  linear_forward<T>(acts.o, store_->v2(out_proj_), View1<const P>(), out);
}

// dO = dout W_out, dW_out += dout^T o, from the kept gate output, fp32 or its bf16 copy.
template <class T>
void Mamba3Mixer<T>::out_proj_backward(const Mamba3Acts<T>& a, const View2<const T>& dout, const View2<T>& dO) const {
  if constexpr (std::is_same_v<T, float>) {
    if (a.o_b.extent(0) > 0)
      return linear_backward_gemms_bf16x(dout, store_->v2(out_proj_), a.o_b, 0.0f, dO, 1.0f, store_->g2(out_proj_));
  }
  linear_backward<T>(a.o, store_->v2(out_proj_), dout, dO, false, store_->g2(out_proj_), View1<P>());
}

template <class T>
void Mamba3Mixer<T>::forward(const View2<T>& u, index_t batch, index_t seqlen, const View2<T>& out,
                             Mamba3Acts<T>& acts, bool save, const Mamba3State<T>* init,
                             Mamba3State<T>* final_state) const {
  forward(u, batch, seqlen, SeqIdxView(), out, acts, save, init, final_state);
}

template <class T>
void Mamba3Mixer<T>::forward(const View2<T>& u, index_t batch, index_t seqlen, const SeqIdxView& seq,
                             const View2<T>& out, Mamba3Acts<T>& acts, bool save, const Mamba3State<T>* init,
                             Mamba3State<T>* final_state) const {
  const std::string ctx = "mamba3_mixer";
  require(index_t(u.extent(0)) == batch * seqlen && index_t(u.extent(1)) == cfg_.d_model, ctx, "u is (",
          u.extent(0), ", ", u.extent(1), "), expected (batch * seqlen, d_model) = (", batch * seqlen, ", ",
          cfg_.d_model, ")");
  require(index_t(out.extent(0)) == batch * seqlen && index_t(out.extent(1)) == cfg_.d_model, ctx,
          "out must be (batch * seqlen, d_model)");
  if (init) require(init->batch == batch, ctx, "initial state is for batch ", init->batch, ", not ", batch);
  if (final_state)
    require(final_state->batch == batch, ctx, "final state is for batch ", final_state->batch, ", not ", batch);
  if (cp_->size() > 1) {
    require(!init && !final_state, ctx, "explicit initial/final states are not supported with cp = ", cp_->size(),
            " (the state is passed between the cp ranks)");
    forward_cp(u, batch, seqlen, seq, out, acts, save);
    return;
  }
  acts = Mamba3Acts<T>{};
  acts.init = init ? init->carry : Mamba3Carry<P>{};
  acts.seq = seq;
  run_internals(u, batch, seqlen, acts, final_state ? final_state->carry : Mamba3Carry<P>{});
  out_proj_forward(acts, out);
  if (!save) {
    Mamba3Acts<T> keep;
    keep.u = u;
    keep.init = acts.init;
    keep.seq = acts.seq;
    acts = keep;
  }
}

template <class T>
void Mamba3Mixer<T>::backward(Mamba3Acts<T>& a, index_t batch, index_t seqlen, const SeqIdxView& seq,
                              const View2<const T>& dout, const View2<T>& du, const Mamba3State<T>* dfinal,
                              Mamba3State<T>* dinit) const {
  a.seq = seq;
  backward(a, batch, seqlen, dout, du, dfinal, dinit);
}

template <class T>
void Mamba3Mixer<T>::backward(Mamba3Acts<T>& a, index_t batch, index_t seqlen, const View2<const T>& dout,
                              const View2<T>& du, const Mamba3State<T>* dfinal, Mamba3State<T>* dinit) const {
  if (a.proj.extent(0) == 0) run_internals(a.u, batch, seqlen, a, Mamba3Carry<P>{});  // recompute policy
  const index_t n = batch * seqlen, E = cfg_.d_inner(), H = cfg_.nheads(), N = cfg_.d_state, R = cfg_.rank(),
                G = cfg_.ngroups, Pd = cfg_.headdim, RG = R * G, RGN = RG * N;
  // the backward's buffers from the workspace pool (no device allocation and synchronizing free per call)
  PoolScope ws;
  // out_proj
  View2<T> dO = ws.take<View2<T>>("mamba3::dO", n, E);
  out_proj_backward(a, dout, dO);

  View2<T> dy = ws.take<View2<T>>("mamba3::dy", n, H * R * Pd);
  // Gate backward: dy, and dz into the z columns of dproj.
  Gate<T> gt;
  gt.y = a.y;
  gt.proj = a.proj;
  gt.H = H;
  gt.R = R;
  gt.Pd = Pd;
  gt.mimo = cfg_.is_mimo;
  gt.norm = cfg_.is_outproj_norm;
  if (gt.mimo) {
    gt.mz = store_->v1(mimo_z_);
    gt.mo = store_->v1(mimo_o_);
  }
  if (gt.norm) {
    gt.rstd = a.rstd_out;
    gt.w = store_->v1(norm_w_);
  }
  // dproj, in_proj's output gradient, fp32, or (gb: DprojStore) its bf16 copy dproj_b with the scan's columns
  // (from E: v, then dd) in the fp32 dproj, column c at c - E
  const index_t din = cfg_.d_in_proj();
  const bool gb = bf16_in_proj_grad() && gate_quads_ok(gt, {{dO.data(), dO.stride(0)}, {dy.data(), dy.stride(0)}});
  const index_t dcol0 = gb ? E : 0;  // dproj's first column
  View2<bf16_op_t> dproj_b = gb ? ws.take<View2<bf16_op_t>>("mamba3::dproj_bf16", n, din) : View2<bf16_op_t>();
  View2<T> dproj = ws.take<View2<T>>(gb ? "mamba3::dproj_scan" : "mamba3::dproj", n, din - dcol0);
  // SISO: every column is written below (z by the gate's backward, x by the scan's dv, C and B by their norms'
  // backward, the dt, A, trapezoid and angle columns by the scan's token passes), so the pool's block is not
  // cleared first (a 0.9 GB memset at 8 x 8,192 tokens of d_model 768); under MIMO it is, as before
  if (cfg_.is_mimo) Kokkos::deep_copy(dproj, T(0));
  // dn = dL/d(yw) per p; with the norm, yw = y rstd w and dy = rstd (dn w - nrm * mean(dn w nrm)): the means per
  // (token, head, rank) first, then every element (dy, and dz into the z columns of dproj) on its own
  {
  PoolScope gate_ws;  // dots, returned at the end of the block
  View2<P> dots;
  if (gt.norm) {
    dots = gate_ws.take<View2<P>>("mamba3::gate_dots", n, H * R);
    per_head_rank("mamba3::gate_bwd_dots", n, H, R, KOKKOS_LAMBDA(const Team& tm, index_t i, index_t h, index_t r) {
      P dot = 0;
      Kokkos::parallel_reduce(
          Kokkos::ThreadVectorRange(tm, gt.Pd),
          [&](index_t p, P& acc) {
            const P G_ = P(dO(i, h * gt.Pd + p)) * gt.mo_of(h, r, p);
            const P nrm = P(gt.y(i, (h * gt.R + r) * gt.Pd + p)) * gt.rstd(i, h * gt.R + r);
            acc += G_ * silu(gt.zz(i, h, r, p)) * gt.w(h * gt.Pd + p) * nrm;
          },
          dot);
      Kokkos::single(Kokkos::PerThread(tm), [&]() { dots(i, h * gt.R + r) = dot; });
    });
  }
  if (gb || gate_quads_ok(gt, {{dO.data(), dO.stride(0)}, {dy.data(), dy.stride(0)}, {dproj.data(), dproj.stride(0)}})) {
    par_for("mamba3::gate_bwd", n, H * Pd / 4, KOKKOS_LAMBDA(index_t i, index_t qu) {
      const index_t hp = 4 * qu, h = hp / gt.Pd;
      P g[4], yv[4], zv[4], wv[4] = {P(1), P(1), P(1), P(1)}, dyv[4], dzv[4];
      load_vec<4>(&dO(i, hp), g);
      load_vec<4>(&gt.y(i, hp), yv);
      load_vec<4>(&gt.proj(i, hp), zv);
      const P rs = gt.norm ? gt.rstd(i, h) : P(1), mdot = gt.norm ? dots(i, h) / P(gt.Pd) : P(0);
      if (gt.norm) load_vec<4>(&gt.w(hp), wv);
      for (int e = 0; e < 4; ++e) {
        const P s = silu(zv[e]), nrm = yv[e] * rs;
        dyv[e] = gt.norm ? rs * (g[e] * s * wv[e] - nrm * mdot) : g[e] * s;
        dzv[e] = g[e] * nrm * wv[e] * dsilu(zv[e]);
      }
      store_vec<4>(&dy(i, hp), dyv);
      if (gb)
        store_bf16_op_vec<4>(&dproj_b(i, hp), dzv);
      else
        store_vec<4>(&dproj(i, hp), dzv);
    });
  } else {
    par_for("mamba3::gate_bwd", n, H * Pd, KOKKOS_LAMBDA(index_t i, index_t hp) {
      const index_t h = hp / gt.Pd, p = hp % gt.Pd;
      P dzsum = 0;
      for (index_t r = 0; r < gt.R; ++r) {
        const P G_ = P(dO(i, hp)) * gt.mo_of(h, r, p);
        const P z2 = gt.zz(i, h, r, p), s = silu(z2);
        P dyv;
        if (gt.norm) {
          const P rs = gt.rstd(i, h * gt.R + r);
          const P nrm = P(gt.y(i, (h * gt.R + r) * gt.Pd + p)) * rs;
          dyv = rs * (G_ * s * gt.w(h * gt.Pd + p) - nrm * dots(i, h * gt.R + r) / P(gt.Pd));
        } else {
          dyv = G_ * s;
        }
        dy(i, (h * gt.R + r) * gt.Pd + p) = static_cast<T>(dyv);
        const P dzz = G_ * gt.yw(i, h, r, p) * dsilu(z2);
        dzsum += gt.mimo ? dzz * gt.mz((h * gt.R + r) * gt.Pd + p) : dzz;
      }
      dproj(i, hp) = static_cast<T>(dzsum);
    });
  }
  }
  if (gt.norm) {
    const index_t Rr = R, Pp = Pd;
    column_reduce<P>(
        "mamba3::dnorm_w", n, E,
        KOKKOS_LAMBDA(index_t i, index_t hp) {
          const index_t h = hp / Pp, p = hp % Pp;
          P acc = 0;
          for (index_t r = 0; r < Rr; ++r) {
            const P nrm = P(gt.y(i, (h * Rr + r) * Pp + p)) * gt.rstd(i, h * Rr + r);
            acc += P(dO(i, hp)) * gt.mo_of(h, r, p) * nrm * silu(gt.zz(i, h, r, p));
          }
          return acc;
        },
        store_->g1(norm_w_), true);
  }
  if (gt.mimo) {
    const index_t Rr = R, Pp = Pd;
    column_reduce<P>(
        "mamba3::dmimo_o", n, H * R * Pd,
        KOKKOS_LAMBDA(index_t i, index_t hrp) {
          const index_t h = hrp / (Rr * Pp), r = (hrp / Pp) % Rr, p = hrp % Pp;
          return P(dO(i, h * Pp + p)) * gt.yw(i, h, r, p) * silu(gt.zz(i, h, r, p));
        },
        store_->g1(mimo_o_), true);
    column_reduce<P>(
        "mamba3::dmimo_z", n, H * R * Pd,
        KOKKOS_LAMBDA(index_t i, index_t hrp) {
          const index_t h = hrp / (Rr * Pp), r = (hrp / Pp) % Rr, p = hrp % Pp;
          const P G_ = P(dO(i, h * Pp + p)) * gt.mo_of(h, r, p);
          return G_ * gt.yw(i, h, r, p) * dsilu(gt.zz(i, h, r, p)) * P(gt.proj(i, h * Pp + p));
        },
        store_->g1(mimo_z_), true);
  }

  // Scan backward: dv (SISO: straight into the x columns of dproj), dqk, and the dd columns of dproj.
  View2<T> dqk = ws.take<View2<T>>("mamba3::dqk", n, 2 * RGN);
  View2<T> dv = cfg_.is_mimo ? ws.take<View2<T>>("mamba3::dv", n, H * R * Pd) : dproj;
  Mamba3ScanGrad<T> g;
  g.dv = dv;
  g.dqk = dqk;
  g.ddd = dproj;
  g.col0 = dcol0;
  g.ddt_bias = store_->g1(dt_bias_);
  g.dD = store_->g1(D_);
  g.dq_bias = store_->g1(C_bias_);
  g.dk_bias = store_->g1(B_bias_);
  if (dinit) {
    require(dinit->batch == batch, "mamba3_mixer", "dinit is for batch ", dinit->batch, ", not ", batch);
    g.dinit = dinit->carry;
  }
  if (dfinal) require(dfinal->batch == batch, "mamba3_mixer", "dfinal is for batch ", dfinal->batch, ", not ", batch);
  Mamba3Carry<P> cp_dfinal;
  if (cp_->size() > 1) {
    require(!dfinal && !dinit, "mamba3_mixer", "explicit state gradients are not supported with cp = ", cp_->size());
    require(index_t(a.cp_cont.size()) == batch, "mamba3_mixer", "cp = ", cp_->size(),
            " needs the forward of the same mixer with cp (no context-parallel state kept for batch = ", batch, ")");
    const Mamba3ScanShape sh = scan_shape(batch, seqlen);
    const index_t S = cfg_.nangles();
    const View1<P> cont = m3_rows<P>(a.cp_cont, nullptr), pass = m3_rows<P>(a.cp_cont, &a.cp_whole);
    // throwaway gradients of the auxiliary scan backwards
    View2<T> junk("mamba3::cp_junk", n, cfg_.d_in_proj());
    Mamba3ScanGrad<T> sg;
    sg.dv = cfg_.is_mimo ? View2<T>("mamba3::cp_junk_v", n, H * R * Pd) : junk;
    sg.dqk = View2<T>("mamba3::cp_junk_qk", n, 2 * RGN);
    sg.ddd = junk;
    sg.ddt_bias = View1<P>("mamba3::cp_junk_b", H);
    sg.dD = View1<P>("mamba3::cp_junk_D", H);
    sg.dq_bias = View1<P>("mamba3::cp_junk_q", H * R * N);
    sg.dk_bias = View1<P>("mamba3::cp_junk_k", H * R * N);
    // G: the incoming state's gradient from this slice; folded from the right into the final-state gradient
    sg.dinit = Mamba3Carry<P>::allocate("mamba3::cp_d1", sh);
    mamba3_scan_backward<T>(sh, scan_in(a), dy, Mamba3Carry<P>{}, sg, &a.scan);
    m3_scale_rows<P>(sg.dinit.S.data(), sg.dinit.S.size(), batch, cont);
    const View1<P> gS = m3_total_decay<T>(a.proj, 2 * E + 2 * RGN, store_->v1(dt_bias_), cfg_.A_floor, pass, batch,
                                          seqlen, H);
    cp_dfinal = Mamba3Carry<P>::allocate("mamba3::cp_dfinal", sh);
    Kokkos::deep_copy(View1<P>(cp_dfinal.S.data(), cp_dfinal.S.size()),
                      parallel::cp_state_scan_backward<P>(
                          *cp_, gS, View1<const P>(sg.dinit.S.data(), sg.dinit.S.size()), Pd * N));
    // d(k_prev), d(v_prev) go back to the left neighbour: the gradient of its last k and v
    sg.dinit = Mamba3Carry<P>::allocate("mamba3::cp_d2", sh);
    mamba3_scan_backward<T>(sh, scan_in(a), dy, cp_dfinal, sg, &a.scan);
    m3_scale_rows<P>(sg.dinit.k.data(), sg.dinit.k.size(), batch, cont);
    m3_scale_rows<P>(sg.dinit.v.data(), sg.dinit.v.size(), batch, cont);
    m3_shift_kv<P>(*cp_, sg.dinit.k, sg.dinit.v, cp_dfinal.k, cp_dfinal.v, false);
    // the phase gradient of the slice, folded from the right into d(phi_out)
    sg.dinit = Mamba3Carry<P>::allocate("mamba3::cp_d3", sh);
    mamba3_scan_backward<T>(sh, scan_in(a), dy, cp_dfinal, sg, &a.scan);
    m3_scale_rows<P>(sg.dinit.phi.data(), sg.dinit.phi.size(), batch, cont);
    Kokkos::deep_copy(View1<P>(cp_dfinal.phi.data(), cp_dfinal.phi.size()),
                      parallel::cp_state_scan_backward<P>(
                          *cp_, pass, View1<const P>(sg.dinit.phi.data(), sg.dinit.phi.size()), H * S));
  }
  mamba3_scan_backward<T>(scan_shape(batch, seqlen), scan_in(a), dy,
                          dfinal ? dfinal->carry : cp_dfinal, g, &a.scan);

  const auto proj = a.proj;
  if (cfg_.is_mimo) {
    const View1<const P> mx = store_->v1(mimo_x_);
    par_for("mamba3::mimo_x_bwd", n, E, KOKKOS_LAMBDA(index_t i, index_t hp) {
      const index_t h = hp / Pd, p = hp % Pd;
      P acc = 0;
      for (index_t r = 0; r < R; ++r) acc += P(dv(i, (h * R + r) * Pd + p)) * mx((h * R + r) * Pd + p);
      dproj(i, E + hp) = static_cast<T>(acc);
    });
    column_reduce<P>(
        "mamba3::dmimo_x", n, H * R * Pd,
        KOKKOS_LAMBDA(index_t i, index_t hrp) {
          const index_t h = hrp / (R * Pd), p = hrp % Pd;
          return P(dv(i, hrp)) * P(proj(i, E + h * Pd + p));
        },
        store_->g1(mimo_x_), true);
  }

  // B / C RMSNorm backward into their columns of dproj; the norm weights' gradients.
  {
    const auto rstd = a.rstd_qk;
    const View1<const P> wB = store_->v1(B_norm_), wC = store_->v1(C_norm_);
    par_for_rows("mamba3::bc_norm_bwd", n * 2 * RG, KOKKOS_LAMBDA(const Team& tm, index_t ij) {
      const index_t i = ij / (2 * RG), j = ij % (2 * RG), part = j / RG, grp = j % RG;
      const index_t src = 2 * E + (part == 0 ? RGN : 0) + grp * N, dst = part * RGN + grp * N;
      const auto& wt = part == 0 ? wC : wB;
      const P r = rstd(i, j);
      P dot = 0;
      Kokkos::parallel_reduce(
          Kokkos::ThreadVectorRange(tm, N),
          [&](index_t m, P& a) { a += P(dqk(i, dst + m)) * wt(m) * P(proj(i, src + m)); }, dot);
      const P cc = r * r * dot / P(N);
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(tm, N), [&](index_t m) {
        const P d = r * (P(dqk(i, dst + m)) * wt(m) - P(proj(i, src + m)) * cc);
        if (gb)
          dproj_b(i, src + m) = to_bf16_op(float(d));
        else
          dproj(i, src + m) = static_cast<T>(d);
      });
    });
    for (int part = 0; part < 2; ++part) {
      const index_t src0 = 2 * E + (part == 0 ? RGN : 0), dst0 = part * RGN, jo = part * RG;
      column_reduce<P>(
          part == 0 ? "mamba3::dC_norm" : "mamba3::dB_norm", n, N,
          KOKKOS_LAMBDA(index_t i, index_t m) {
            P acc = 0;
            for (index_t grp = 0; grp < RG; ++grp)
              acc += P(dqk(i, dst0 + grp * N + m)) * P(proj(i, src0 + grp * N + m)) * rstd(i, jo + grp);
            return acc;
          },
          store_->g1(part == 0 ? C_norm_ : B_norm_), true);
    }
  }
  // in_proj
  if constexpr (std::is_same_v<T, float>) {
    if (gb) {  // the scan's columns rounded into the copy: v, then dd (dt, A, trapezoid, angles)
      const index_t ld = dproj.stride(0), ldb = dproj_b.stride(0), dd0 = 2 * E + 2 * RGN;
      round_to_bf16("mamba3::dproj_v_bf16", dproj.data(), ld, dproj_b.data() + E, ldb, n, E);
      round_to_bf16("mamba3::dproj_dd_bf16", dproj.data() + (dd0 - E), ld, dproj_b.data() + dd0, ldb, n, din - dd0);
      return linear_backward_gemms_bf16dy(dproj_b, store_->v2(in_proj_), a.u, 0.0f, du, 1.0f, store_->g2(in_proj_));
    }
  }
  linear_backward<T>(a.u, store_->v2(in_proj_), dproj, du, false, store_->g2(in_proj_), View1<P>());
}

template <class T>
void Mamba3Mixer<T>::step(const View2<T>& u, Mamba3State<T>& state, const View2<T>& out) const {
  // One token is a sequence of length 1 that starts from and ends in `state` (the scan reads the whole initial
  // carry before it writes the final one).
  Mamba3Acts<T> a;
  forward(u, index_t(u.extent(0)), 1, out, a, false, &state, &state);
}

template <class T>
void Mamba3Mixer<T>::forward_cp(const View2<T>& u, index_t batch, index_t seqlen, const SeqIdxView& seq,
                                const View2<T>& out, Mamba3Acts<T>& acts, bool save) const {
  const index_t H = cfg_.nheads(), S = cfg_.nangles(), Pd = cfg_.headdim, N = cfg_.d_state, R = cfg_.rank(),
                RGN = R * cfg_.ngroups * N, E = cfg_.d_inner(), n = batch * seqlen;
  const Mamba3ScanShape sh = scan_shape(batch, seqlen);
  const auto rec = parallel::cp_record_continuity(*cp_, seq, batch, seqlen);
  const View1<P> cont = m3_rows<P>(rec.cont, nullptr), pass = m3_rows<P>(rec.cont, &rec.whole);
  // 1. the phase: the local run from a zero carry gives the slice's phase increment, summed over the ranks
  acts = Mamba3Acts<T>{};
  acts.seq = seq;
  Mamba3Carry<P> f = Mamba3Carry<P>::allocate("mamba3::cp_f0", sh);
  run_internals(u, batch, seqlen, acts, f);
  Mamba3Carry<P> init = Mamba3Carry<P>::allocate("mamba3::cp_init", sh);
  Kokkos::deep_copy(View1<P>(init.phi.data(), init.phi.size()),
                    parallel::cp_state_scan_forward<P>(*cp_, pass, View1<const P>(f.phi.data(), f.phi.size()), H * S));
  m3_scale_rows<P>(init.phi.data(), init.phi.size(), batch, cont);
  // 2. the last rotated k and v of the left neighbour (the trapezoid's one-token halo)
  acts.init = init;
  View2<T> ytmp("mamba3::cp_y", n, H * R * Pd);
  f = Mamba3Carry<P>::allocate("mamba3::cp_f1", sh);
  mamba3_scan_forward<T>(sh, scan_in(acts), ytmp, f);
  m3_shift_kv<P>(*cp_, f.k, f.v, init.k, init.v, true);
  m3_scale_rows<P>(init.k.data(), init.k.size(), batch, cont);
  m3_scale_rows<P>(init.v.data(), init.v.size(), batch, cont);
  // 3. the final state from a zero state, and the exclusive scan of (total decay, final state)
  f = Mamba3Carry<P>::allocate("mamba3::cp_f2", sh);
  mamba3_scan_forward<T>(sh, scan_in(acts), ytmp, f);
  const View1<P> gS = m3_total_decay<T>(acts.proj, 2 * E + 2 * RGN, store_->v1(dt_bias_), cfg_.A_floor, pass,
                                        batch, seqlen, H);
  Kokkos::deep_copy(View1<P>(init.S.data(), init.S.size()),
                    parallel::cp_state_scan_forward<P>(*cp_, gS, View1<const P>(f.S.data(), f.S.size()), Pd * N));
  m3_scale_rows<P>(init.S.data(), init.S.size(), batch, cont);
  // 4. the mixer from the incoming carry
  acts = Mamba3Acts<T>{};
  acts.init = init;
  acts.seq = seq;
  run_internals(u, batch, seqlen, acts, Mamba3Carry<P>{});
  out_proj_forward(acts, out);
  acts.cp_cont = rec.cont;
  acts.cp_whole = rec.whole;
  if (!save) {
    Mamba3Acts<T> keep;
    keep.u = u;
    keep.init = acts.init;
    keep.seq = acts.seq;
    keep.cp_cont = acts.cp_cont;
    keep.cp_whole = acts.cp_whole;
    acts = keep;
  }
}

template <class T>
std::uint64_t Mamba3Mixer<T>::cp_traffic_bytes(index_t batch, bool with_seq_idx) const {
  const std::uint64_t r = std::uint64_t(cp_->rank()), n = std::uint64_t(cp_->size());
  if (n == 1) return 0;
  const std::uint64_t B = std::uint64_t(batch), H = std::uint64_t(cfg_.nheads()), S = std::uint64_t(cfg_.nangles()),
                      Pd = std::uint64_t(cfg_.headdim), N = std::uint64_t(cfg_.d_state), R = std::uint64_t(cfg_.rank());
  std::uint64_t bytes = 2 * B * (1 + H * S) * sizeof(P) + 2 * B * H * (1 + Pd * N) * sizeof(P);
  bytes += B * H * R * (N + Pd) * sizeof(P) * ((r + 1 < n ? 1 : 0) + (r > 0 ? 1 : 0));
  if (with_seq_idx && r + 1 < n) bytes += 8 * B;
  return bytes;
}

template class Mamba3Mixer<float>;
template class Mamba3Mixer<double>;

}  // namespace mm
