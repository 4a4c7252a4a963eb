#include "parallel/context_parallel.hpp"

#include <algorithm>
#include <cstdint>

#include "core/error.hpp"

namespace mm::parallel {

template <class T>
CpConvHalo<T> cp_conv_halo_forward(const Comm& cp, const View2<const T>& x, index_t col, index_t channels,
                                   index_t batch, index_t seqlen, index_t W, const SeqIdxView& seq) {
  const int r = cp.rank(), n = cp.size();
  const index_t H = W - 1, C = channels, L = seqlen;
  require(n == 1 || seqlen >= H, "context parallel conv halo", "the local slice length ", seqlen,
          " is shorter than d_conv - 1 = ", H, " (cp = ", n, ")");
  CpConvHalo<T> out;
  out.prefix = View3<T>("cp::conv_prefix", batch, C, H);
  out.mask = View2<T>("cp::conv_mask", batch, H);
  out.cont.assign(std::size_t(batch), 0);
  const int dest = r + 1 < n ? r + 1 : -1, src = r > 0 ? r - 1 : -1;
  // the last H rows of x, packed (batch, C, H)
  View3<T> send(Kokkos::view_alloc(Kokkos::WithoutInitializing, "cp::halo_send"), batch, C, H);
  if (H > 0)
    par_for("cp::halo_pack", batch * C, H, KOKKOS_LAMBDA(index_t bc, index_t k) {
      const index_t b = bc / C, c = bc % C;
      send(b, c, k) = x(b * L + L - H + k, col + c);
    });
  auto hsend = Kokkos::create_mirror_view_and_copy(HostMem(), send);
  auto hrecv = Kokkos::create_mirror_view(HostMem(), out.prefix);
  Kokkos::deep_copy(hrecv, T(0));
  cp.sendrecv(hsend.data(), dest >= 0 ? hsend.size() : 0, dest, hrecv.data(), src >= 0 ? hrecv.size() : 0, src);
  // record ids of the halo rows (the last max(H, 1) of the left neighbour) and of this slice's first token
  const index_t hs = std::max<index_t>(H, 1);
  std::vector<std::int64_t> ids_left(std::size_t(batch * hs), 0), ids_first(std::size_t(batch), 0);
  if (seq.extent(0) > 0) {
    auto hseq = Kokkos::create_mirror_view_and_copy(HostMem(), seq);
    std::vector<std::int64_t> ids_send(std::size_t(batch * hs));
    for (index_t b = 0; b < batch; ++b) {
      ids_first[b] = hseq(b, 0);
      for (index_t k = 0; k < hs; ++k) ids_send[b * hs + k] = hseq(b, L - hs + k);
    }
    cp.sendrecv(ids_send.data(), dest >= 0 ? ids_send.size() : 0, dest, ids_left.data(),
                src >= 0 ? ids_left.size() : 0, src);
  }
  auto hmask = Kokkos::create_mirror_view(HostMem(), out.mask);
  for (index_t b = 0; b < batch; ++b) {
    out.cont[b] = r > 0 && ids_left[b * hs + hs - 1] == ids_first[b];
    for (index_t k = 0; k < H; ++k) {
      const bool use = r > 0 && ids_left[b * hs + (hs - H) + k] == ids_first[b];
      hmask(b, k) = use ? T(1) : T(0);
      for (index_t c = 0; c < C; ++c)
        if (!use) hrecv(b, c, k) = T(0);
    }
  }
  Kokkos::deep_copy(out.prefix, hrecv);
  Kokkos::deep_copy(out.mask, hmask);
  return out;
}

CpRecords cp_record_continuity(const Comm& cp, const SeqIdxView& seq, index_t batch, index_t seqlen) {
  const int r = cp.rank(), n = cp.size();
  const int dest = r + 1 < n ? r + 1 : -1, src = r > 0 ? r - 1 : -1;
  CpRecords out;
  out.cont.assign(std::size_t(batch), r > 0 ? 1 : 0);
  out.whole.assign(std::size_t(batch), 1);
  if (seq.extent(0) == 0) return out;
  auto hseq = Kokkos::create_mirror_view_and_copy(HostMem(), seq);
  std::vector<std::int64_t> last(static_cast<std::size_t>(batch), 0), left(static_cast<std::size_t>(batch), 0);
  for (index_t b = 0; b < batch; ++b) {
    last[b] = hseq(b, seqlen - 1);
    for (index_t t = 1; t < seqlen; ++t)
      if (hseq(b, t) != hseq(b, 0)) out.whole[b] = 0;
  }
  cp.sendrecv(last.data(), dest >= 0 ? last.size() : 0, dest, left.data(), src >= 0 ? left.size() : 0, src);
  for (index_t b = 0; b < batch; ++b) out.cont[b] = r > 0 && left[b] == hseq(b, 0);
  return out;
}

template <class T>
void conv1d_silu_prefix_grad(const Conv1dIn<T>& in, const View2<const acc_t<T>>& w,
                             const View1<const acc_t<T>>& bias, const SeqIdxView& seq, const View2<const T>& dy,
                             const View2<const T>& mask, const View3<T>& dprefix) {
  using P = acc_t<T>;
  const index_t W = w.extent(1), H = W - 1, L = in.seqlen, C = in.channels, col = in.col;
  require(index_t(dprefix.extent(0)) == in.batch && index_t(dprefix.extent(1)) == C &&
              index_t(dprefix.extent(2)) == H && index_t(in.prefix.extent(2)) == H,
          "conv1d_silu_prefix_grad", "dprefix and prefix must be (batch, channels, d_conv - 1) = (", in.batch, ", ",
          C, ", ", H, ")");
  const auto x = in.x;
  const auto prefix = in.prefix;
  const bool has_seq = seq.extent(0) > 0;
  if (H == 0) return;
  par_for("cp::conv_prefix_grad", in.batch * C, H, KOKKOS_LAMBDA(index_t bc, index_t j) {
    const index_t b = bc / C, c = bc % C;
    P acc = 0;
    // prefix entry j (input position s = j - H) feeds outputs t = 0..j through tap k = j - t, for t in token 0's record
    for (index_t t = 0; t <= j && t < L; ++t) {
      if (has_seq && seq(b, t) != seq(b, 0)) break;
      P pre = bias(c);
      for (index_t k = 0; k < W; ++k) {
        const index_t s = t - H + k;
        P v;
        if (s >= 0) v = (!has_seq || seq(b, s) == seq(b, t)) ? P(x(b * L + s, col + c)) : P(0);
        else v = P(prefix(b, c, H + s));
        pre += w(c, k) * v;
      }
      acc += w(c, j - t) * P(dy(b * L + t, c)) * dsilu(pre);
    }
    dprefix(b, c, j) = static_cast<T>(acc * P(mask(b, j)));
  });
}

template <class T>
void cp_conv_halo_backward(const Comm& cp, const View3<const T>& dprefix, const UView2<T>& dx, index_t dx_col,
                           index_t batch, index_t seqlen) {
  const int r = cp.rank(), n = cp.size();
  const index_t C = dprefix.extent(1), H = dprefix.extent(2), L = seqlen;
  const int dest = r > 0 ? r - 1 : -1, src = r + 1 < n ? r + 1 : -1;
  auto hsend = Kokkos::create_mirror_view_and_copy(HostMem(), dprefix);
  HostView1<T> hrecv("cp::halo_grad_recv", std::size_t(batch * C * H));
  cp.sendrecv(hsend.data(), dest >= 0 ? hsend.size() : 0, dest, hrecv.data(), src >= 0 ? hrecv.size() : 0, src);
  if (src < 0 || H == 0) return;
  View3<T> recv(Kokkos::view_alloc(Kokkos::WithoutInitializing, "cp::halo_grad"), batch, C, H);
  Kokkos::deep_copy(recv, Kokkos::View<T***, Layout, HostMem, Unmanaged>(hrecv.data(), batch, C, H));
  par_for("cp::halo_grad_add", batch * C, H, KOKKOS_LAMBDA(index_t bc, index_t k) {
    const index_t b = bc / C, c = bc % C;
    dx(b * L + L - H + k, dx_col + c) += recv(b, c, k);
  });
}

namespace {
// The pairs of every rank (device memory, rank-major: m decays then m * block states per rank), folded on the
// device from rank `from` towards `to` (exclusive) in steps of `step`: acc = g_q acc + S_q.
template <class P>
View1<P> state_scan(const Comm& cp, const View1<const P>& g, const View1<const P>& S, index_t block, int from, int to,
                    int step, PoolScope* ws) {
  const std::size_t m = g.extent(0), ms = m * std::size_t(block), stride = m + ms;
  require(S.extent(0) == ms, "context parallel state scan", "states hold ", S.extent(0), " values, not decays (", m,
          ") x block (", block, ")");
  View1<P> send = take_or_alloc<View1<P>>(ws, "cp::pairs_send", stride);
  View1<P> all = take_or_alloc<View1<P>>(ws, "cp::pairs", stride * std::size_t(cp.size()));
  Kokkos::deep_copy(Kokkos::subview(send, std::make_pair(std::size_t(0), m)), g);
  Kokkos::deep_copy(Kokkos::subview(send, std::make_pair(m, stride)), S);
  cp.allgather(send, all);
  View1<P> out = take_or_alloc<View1<P>>(ws, "cp::state_in", ms);
  const std::size_t bl = std::size_t(block);
  par_for("cp::fold", index_t(ms), KOKKOS_LAMBDA(index_t i) {
    P acc = 0;
    for (int q = from; q != to; q += step) {
      const std::size_t base = std::size_t(q) * stride;
      acc = all(base + std::size_t(i) / bl) * acc + all(base + m + std::size_t(i));
    }
    out(i) = acc;
  });
  return out;
}
}  // namespace

template <class P>
View1<P> cp_state_scan_forward(const Comm& cp, const View1<const P>& g, const View1<const P>& S, index_t block,
                               PoolScope* ws) {
  return state_scan(cp, g, S, block, 0, cp.rank(), 1, ws);
}

template <class P>
View1<P> cp_state_scan_backward(const Comm& cp, const View1<const P>& g, const View1<const P>& S, index_t block,
                                PoolScope* ws) {
  return state_scan(cp, g, S, block, cp.size() - 1, cp.rank(), -1, ws);
}

#define MM_CP_INST(T)                                                                                             \
  template CpConvHalo<T> cp_conv_halo_forward<T>(const Comm&, const View2<const T>&, index_t, index_t, index_t,  \
                                                 index_t, index_t, const SeqIdxView&);                            \
  template void conv1d_silu_prefix_grad<T>(const Conv1dIn<T>&, const View2<const acc_t<T>>&,                     \
                                           const View1<const acc_t<T>>&, const SeqIdxView&, const View2<const T>&, \
                                           const View2<const T>&, const View3<T>&);                               \
  template void cp_conv_halo_backward<T>(const Comm&, const View3<const T>&, const UView2<T>&, index_t, index_t,  \
                                         index_t);                                                                \
  template View1<T> cp_state_scan_forward<T>(const Comm&, const View1<const T>&, const View1<const T>&, index_t,   \
                                             PoolScope*);                                                          \
  template View1<T> cp_state_scan_backward<T>(const Comm&, const View1<const T>&, const View1<const T>&, index_t,  \
                                              PoolScope*);
MM_CP_INST(float)
MM_CP_INST(double)
#undef MM_CP_INST

}  // namespace mm::parallel
