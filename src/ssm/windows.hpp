// Running a mixer over a long sequence in windows with carried states (the mixers' `window` setting).
//
// A mixer with decode states (conv: the last d_conv - 1 conv inputs; ssm: the scan state) and an explicit-state
// forward/backward pair
//   forward(u, batch, L, seq, out, acts, save, const State* init, State* final)
//   backward(acts, batch, L, seq, dout, du, const State* dfinal, State* dinit)
// runs a sequence longer than W tokens as windows of W (the last one shorter): window w starts from the state
// window w - 1 left (zeroed for the rows whose window starts a new record: a state never crosses records) and
// only u and the boundary states are kept; the backward runs the windows right to left, each recomputing its
// internals from its boundary state and handing the gradient of that state to the window on its left. The
// results are those of one pass up to rounding; the working memory follows W.
//
// A window's rows need no device allocation of their own (on CUDA each was a cudaMalloc and a synchronising
// cudaFree per window): with batch 1 a window's rows [t0, t0 + Lw) of the row-major (L, D) u, out, dout, du (and
// its record ids) are contiguous, so the mixer gets subviews of them (it overwrites out and du, never adds to
// them, and keeps none of a window's views past the window); with batch > 1 they are gathered into and scattered
// from packed buffers that one PoolScope per call takes once (core/pool.hpp: cached blocks) for every window. The
// boundary states and their gradients are cached blocks too (the mixer's make_state(batch, ws)): the forward's in
// acts.states, kept for the backward, the backward's in its own scope.
//
// Acts must have the members u, conv_init, ssm_init (what an explicit-state forward keeps), win_conv, win_ssm
// (vectors of the boundary states, entry w - 1 for window w) and states (a shared PoolScope holding them); a State
// the members conv and ssm.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>

#include "core/error.hpp"
#include "core/kokkos_types.hpp"
#include "core/pool.hpp"
#include "layers/conv1d.hpp"
#include "parallel/context_parallel.hpp"
#include "tensor/gemm.hpp"  // bf16_op_t

namespace mm::windows {
// Internal linkage (the unnamed namespace): the KOKKOS_LAMBDAs in these header templates would otherwise give
// every translation unit that instantiates one the same lambda wrapper type, whose copy goes through function
// pointers nvcc keeps per translation unit; the linker keeps one unit's copy of the out-of-line code and the
// others' pointers stay null (a host call through address 0 on CUDA builds, at the first copy of such a lambda).
namespace {

// Rows [t0, t0 + Lw) of every batch row of a (batch * L, D) matrix, packed as (batch * Lw, D), and back.
template <class T>
void gather(const View2<const T>& src, index_t L, index_t t0, index_t Lw, const View2<T>& dst) {
  par_for("window::gather", dst.extent(0), dst.extent(1), KOKKOS_LAMBDA(index_t r, index_t j) {
    dst(r, j) = src((r / Lw) * L + t0 + r % Lw, j);
  });
}
template <class T>
void scatter(const View2<const T>& src, index_t L, index_t t0, index_t Lw, const View2<T>& dst) {
  par_for("window::scatter", src.extent(0), src.extent(1), KOKKOS_LAMBDA(index_t r, index_t j) {
    dst((r / Lw) * L + t0 + r % Lw, j) = src(r, j);
  });
}

// Rows [r0, r0 + n) of a row-major matrix: contiguous, so a subview with the matrix's own (LayoutRight) type.
template <class T>
View2<T> row_range(const View2<T>& x, index_t r0, index_t n) {
  return Kokkos::subview(x, Kokkos::make_pair(r0, r0 + n), Kokkos::ALL);
}

// The record ids of tokens [t0, t0 + Lw) (empty stays empty): with one batch row the ids themselves (contiguous,
// an unmanaged view of them), else copied into `buf` (batch * W >= batch * Lw ids, a pool block of the caller's).
inline SeqIdxView seq_window(const SeqIdxView& seq, index_t t0, index_t Lw, const View1<std::int32_t>& buf) {
  if (seq.extent(0) == 0) return seq;
  using Ids = Kokkos::View<const std::int32_t**, Layout, Mem, Unmanaged>;
  if (seq.extent(0) == 1) return Ids(seq.data() + t0, 1, Lw);
  const Kokkos::View<std::int32_t**, Layout, Mem, Unmanaged> w(buf.data(), seq.extent(0), Lw);
  par_for("window::seq", seq.extent(0), Lw, KOKKOS_LAMBDA(index_t b, index_t t) { w(b, t) = seq(b, t0 + t); });
  return Ids(w.data(), seq.extent(0), Lw);
}

// Zeroes the batch rows of a state (or of its gradient) whose window starts a new record at t0.
template <class State>
void zero_new_records(const SeqIdxView& seq, index_t t0, const State& s) {
  if (seq.extent(0) == 0) return;
  const index_t batch = seq.extent(0), nc = s.conv.size() / batch, ns = s.ssm.size() / batch;
  auto* cd = s.conv.data();
  auto* sd = s.ssm.data();
  using C = std::remove_pointer_t<decltype(cd)>;
  using S = std::remove_pointer_t<decltype(sd)>;
  par_for("window::new_record", batch, nc + ns, KOKKOS_LAMBDA(index_t b, index_t i) {
    if (seq(b, t0 - 1) == seq(b, t0)) return;
    if (i < nc) cd[b * nc + i] = C(0);
    else sd[b * ns + (i - nc)] = S(0);
  });
}

// x += g for a gradient element x of type D: T itself, or bf16 operand storage (a bf16 copy of a GEMM input,
// rounded again after the sum).
template <class D, class T>
KOKKOS_INLINE_FUNCTION void add_grad(D& x, T g) {
  if constexpr (std::is_same_v<D, T>)
    x += g;
  else
    x = to_bf16_op(from_bf16_op(x) + float(g));
}

// The backward of conv1d_state_out (the last W - 1 conv inputs of the last token's record, read from the columns
// [col, col + C) of x, or from the prefix where the sequence is shorter): the state gradient dstate
// (batch, C, W - 1) is added to those rows of dx (same columns; dx of T or, in Mamba-2's bf16 route, the bf16 copy
// of d(zxbcdt) its in_proj backward takes) and, for taps before the sequence, to dprefix (when it and the prefix
// are not empty).
template <class T, class D>
void conv_state_out_backward(const View3<const T>& dstate, const View3<const T>& prefix, const SeqIdxView& seq,
                             index_t L, const View2<D>& dx, index_t col, const View3<T>& dprefix) {
  const index_t batch = dstate.extent(0), C = dstate.extent(1), H = dstate.extent(2);
  if (H == 0) return;
  const bool has_seq = seq.extent(0) > 0, to_prefix = prefix.extent(0) > 0 && dprefix.extent(0) > 0;
  par_for("window::conv_state_grad", batch * C, H, KOKKOS_LAMBDA(index_t bc, index_t k) {
    const index_t b = bc / C, c = bc % C, s = L - H + k;
    const T g = dstate(b, c, k);
    if (s >= 0) {
      if (!has_seq || seq(b, L - 1) == seq(b, s)) add_grad(dx(b * L + s, col + c), g);
    } else if (to_prefix && (!has_seq || seq(b, L - 1) == seq(b, 0))) {
      dprefix(b, c, H + s) += g;
    }
  });
}

// The gradient of a conv prefix (the initial conv state `in.prefix`) of conv1d_silu_forward(in, w, bias, seq),
// given the gradient dy of its output, into dprefix (batch, channels, W - 1); zero when the forward had no prefix.
template <class T>
void conv_init_backward(const Conv1dIn<T>& in, const View2<const acc_t<T>>& w, const View1<const acc_t<T>>& bias,
                        const SeqIdxView& seq, const View2<const T>& dy, const View3<T>& dprefix) {
  const index_t H = w.extent(1) - 1;
  if (in.prefix.extent(0) == 0 || H == 0) {
    Kokkos::deep_copy(dprefix, T(0));
    return;
  }
  PoolScope ws;
  const View2<T> all = ws.take<View2<T>>("window::prefix_mask", in.batch, H);
  Kokkos::deep_copy(all, T(1));  // the prefix feeds token 0's record on every row
  parallel::conv1d_silu_prefix_grad<T>(in, w, bias, seq, dy, all, dprefix);
}

// The windowed forward (see the top of this file); W < seqlen.
template <class Mixer, class Acts, class T>
void forward(const Mixer& m, index_t W, const View2<T>& u, index_t batch, index_t seqlen, const SeqIdxView& seq,
             const View2<T>& out, Acts& acts) {
  const index_t nw = (seqlen + W - 1) / W, D = u.extent(1), Dout = out.extent(1);
  const bool packed = batch > 1;  // batch 1: the window's rows are a row range of u and out
  acts = Acts{};
  acts.u = u;
  acts.states = std::make_shared<PoolScope>();
  PoolScope ws;  // the packed buffers and record ids, sized for a full window and reused by every window
  const View2<T> ubuf = packed ? ws.take<View2<T>>("window::u", batch * W, D) : View2<T>();
  const View2<T> obuf = packed ? ws.take<View2<T>>("window::out", batch * W, Dout) : View2<T>();
  const View1<std::int32_t> sbuf =
      packed && seq.extent(0) > 0 ? ws.take<View1<std::int32_t>>("window::seq", batch * W) : View1<std::int32_t>();
  using State = decltype(m.make_state(batch));
  State cur;
  for (index_t w = 0; w < nw; ++w) {
    const index_t t0 = w * W, Lw = std::min(W, seqlen - t0);
    const View2<T> uw = packed ? row_range(ubuf, 0, batch * Lw) : row_range(u, t0, Lw);
    const View2<T> ow = packed ? row_range(obuf, 0, batch * Lw) : row_range(out, t0, Lw);
    if (packed) gather<T>(u, seqlen, t0, Lw, uw);
    if (w > 0) zero_new_records(seq, t0, cur);
    State next;
    if (w + 1 < nw) next = m.make_state(batch, *acts.states);
    Acts aw;  // dropped at the end of the window (with its views of uw and its copy of cur)
    m.forward(uw, batch, Lw, seq_window(seq, t0, Lw, sbuf), ow, aw, false, w > 0 ? &cur : nullptr,
              w + 1 < nw ? &next : nullptr);
    if (w > 0) {  // the state the window started from (nothing writes it after the forward's copy of it)
      acts.win_conv.push_back(cur.conv);
      acts.win_ssm.push_back(cur.ssm);
    }
    if (packed) scatter<T>(ow, seqlen, t0, Lw, out);
    cur = next;
  }
}

// The windowed backward: windows right to left, each recomputed from its boundary state.
template <class Mixer, class Acts, class T>
void backward(const Mixer& m, index_t W, Acts& a, index_t batch, index_t seqlen, const SeqIdxView& seq,
              const View2<const T>& dout, const View2<T>& du) {
  const index_t nw = (seqlen + W - 1) / W, D = du.extent(1), Dout = dout.extent(1);
  require(index_t(a.win_ssm.size()) == nw - 1, "windowed backward", "the windowed forward kept ", a.win_ssm.size(),
          " boundary states for ", nw, " windows");
  const bool packed = batch > 1;  // batch 1: the window's rows are a row range of u, dout and du
  PoolScope ws;  // the packed buffers and record ids, sized for a full window and reused by every window
  const View2<T> ubuf = packed ? ws.take<View2<T>>("window::u", batch * W, D) : View2<T>();
  const View2<T> dobuf = packed ? ws.take<View2<T>>("window::dout", batch * W, Dout) : View2<T>();
  const View2<T> dubuf = packed ? ws.take<View2<T>>("window::du", batch * W, D) : View2<T>();
  const View1<std::int32_t> sbuf =
      packed && seq.extent(0) > 0 ? ws.take<View1<std::int32_t>>("window::seq", batch * W) : View1<std::int32_t>();
  using State = decltype(m.make_state(batch));
  // the gradients of the boundary states in two blocks used in turn (one with two windows): the window's dinit and
  // dcarry, its right neighbour's
  State dstates[2];
  if (nw > 1) dstates[0] = m.make_state(batch, ws);
  if (nw > 2) dstates[1] = m.make_state(batch, ws);
  State dcarry;  // gradient of the state the window to the right started from
  for (index_t w = nw - 1; w >= 0; --w) {
    const index_t t0 = w * W, Lw = std::min(W, seqlen - t0);
    const View2<T> uw = packed ? row_range(ubuf, 0, batch * Lw) : row_range(a.u, t0, Lw);
    const View2<const T> dow = packed ? View2<const T>(row_range(dobuf, 0, batch * Lw)) : row_range(dout, t0, Lw);
    const View2<T> duw = packed ? row_range(dubuf, 0, batch * Lw) : row_range(du, t0, Lw);
    if (packed) {
      gather<T>(a.u, seqlen, t0, Lw, uw);
      gather<T>(dout, seqlen, t0, Lw, row_range(dobuf, 0, batch * Lw));
    }
    Acts aw;
    aw.u = uw;
    if (w > 0) {
      aw.conv_init = a.win_conv[std::size_t(w - 1)];
      aw.ssm_init = a.win_ssm[std::size_t(w - 1)];
    }
    State dinit;
    if (w > 0) {  // zero, as make_state leaves it
      dinit = dstates[nw > 2 ? w % 2 : 0];
      Kokkos::deep_copy(dinit.conv, 0);
      Kokkos::deep_copy(dinit.ssm, 0);
    }
    m.backward(aw, batch, Lw, seq_window(seq, t0, Lw, sbuf), dow, duw, w + 1 < nw ? &dcarry : nullptr,
               w > 0 ? &dinit : nullptr);
    if (packed) scatter<T>(duw, seqlen, t0, Lw, du);
    if (w > 0) {
      zero_new_records(seq, t0, dinit);  // those rows started from zero, not from the state
      dcarry = dinit;
    }
  }
}

}  // namespace
}  // namespace mm::windows
