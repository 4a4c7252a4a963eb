#include "layers/conv1d.hpp"

#include <initializer_list>
#include <tuple>
#include <type_traits>

#include "core/error.hpp"
#include "core/pool.hpp"
#include "tensor/gemm.hpp"
#include "tensor/ops.hpp"

namespace mm {

namespace {
KOKKOS_INLINE_FUNCTION bool same_record(const SeqIdxView& seq, index_t b, index_t t, index_t s) {
  return seq.extent(0) == 0 || seq(b, s) == seq(b, t);
}

// Input (s, c) as seen by output token t of batch row b: x for s >= 0, the prefix for s < 0; zero when it belongs to
// another record than t (the prefix belongs to the record of token 0).
template <class T, class P>
KOKKOS_INLINE_FUNCTION P conv_tap(const View2<const T>& x, index_t col, const View3<const T>& prefix, index_t L,
                                  index_t W, const SeqIdxView& seq, index_t b, index_t t, index_t s, index_t c) {
  if (s >= 0) return same_record(seq, b, t, s) ? P(x(b * L + s, col + c)) : P(0);
  if (prefix.extent(0) == 0 || !same_record(seq, b, t, 0)) return P(0);
  return P(prefix(b, c, W - 1 + s));
}

template <class T>
void check_prefix(const Conv1dIn<T>& in, index_t W, const char* where) {
  require(W >= 1 && W <= kMaxConvWidth, where, "conv width d_conv = ", W, " is outside [1, ", kMaxConvWidth, "]");
  require(in.prefix.extent(0) == 0 ||
              (index_t(in.prefix.extent(0)) == in.batch && index_t(in.prefix.extent(1)) == in.channels &&
               index_t(in.prefix.extent(2)) == W - 1),
          where, "prefix must be (batch, channels, d_conv - 1) = (", in.batch, ", ", in.channels, ", ", W - 1,
          "), it is (", in.prefix.extent(0), ", ", in.prefix.extent(1), ", ", in.prefix.extent(2), ")");
}
}  // namespace

// Runs of kConvRun tokens of one batch row per work item (b, run, channel), consecutive work items on
// consecutive channels (coalesced rows): the item keeps the last K inputs of its channel and their record ids in
// registers (K = 4 for d_conv <= 4, else kMaxConvWidth; fixed trip counts), so every input is read once and the
// row index is divided once per run (kConvRun, conv1d.hpp). A flat (row, channel) range re-reading W taps per output
// ran the forward at about a quarter of the H200's bandwidth (0.58 ms per call in the LM step), row kernels slower
// still.
// Inputs a work item loads ahead of their use (one load per dependent step left too few bytes in flight to fill the
// H200's memory pipe: the forward ran at ~1.7 TB/s).
constexpr int kConvAhead = 4;
// ... and with 4 channels a work item (16 bytes a load), 2 tokens ahead: as many bytes in flight, fewer registers.
template <int CV>
inline constexpr int kConvAheadCV = CV == 4 ? 2 : kConvAhead;

namespace {
// f(row, pre, xs, rs) for every output of rows [t0, t1) of batch row b, channels [c, c + CV): pre[v] = bias + the
// causal taps of t's record; xs[j][v] and rs[j] are the K-slot window (slot K - 1 is t, tap k of W in slot
// K - W + k) and its record ids (the same for every channel).
// kEx: f also gets e[v] = ey(row, c + v), loaded with the window's inputs ahead of their use (the backward's dy: a
// load issued only after the window's step left one dependent load in flight per step, and the backward ran at
// 37 % of the H200's copy bandwidth against the forward's 70 %).
// kRecs: whether record ids are given (seq not empty); without them the ids are constant zeros and their registers
// and comparisons fold away. wr: the taps from load_taps (tap k of W in slot K - W + k, zeros before), which the
// backward's dx also reads (one copy of the weights in registers: the backward used ~165 registers a thread, half
// the forward's occupancy).
template <int K, int CV, bool kEx, bool kRecs, class T, class P, class F>
KOKKOS_INLINE_FUNCTION void conv_run(const View2<const T>& x, index_t col, const View3<const T>& prefix, index_t L,
                                     const P (&wr)[K][CV], index_t W, const View1<const P>& bias,
                                     const SeqIdxView& seq, index_t b, index_t t0, index_t t1, index_t c,
                                     const View2<const T>& ey, const F& f) {
  constexpr bool recs = kRecs;
  const bool pre_given = prefix.extent(0) > 0;
  P xs[K][CV];
  int rs[K];
  const int r0 = recs ? seq(b, 0) : 0;
  // slot j holds position t - (K - 1) + j, tap k of W sits in slot K - W + k; before the first token the window
  // stands at t0 - 1 (slot 0 is shifted out at once)
  for (int j = 0; j < K; ++j) {
    const index_t s = t0 - K + j;
    if (j == 0) continue;
    if (s >= 0) {
      load_vec<CV>(&x(b * L + s, col + c), xs[j]);
      rs[j] = recs ? seq(b, s) : 0;
    } else {
      for (int v = 0; v < CV; ++v)
        xs[j][v] = (pre_given && s >= -(W - 1)) ? P(prefix(b, c + v, W - 1 + s)) : P(0);
      rs[j] = r0;  // the prefix belongs to the record of token 0
    }
  }
  P bc[CV];
  for (int v = 0; v < CV; ++v) bc[v] = bias(c + v);
  constexpr int AH = kConvAheadCV<CV>;
  for (index_t tg = t0; tg < t1; tg += AH) {
    // the next AH inputs loaded together (independent loads in flight), then used in order
    P xn[AH][CV], en[kEx ? AH : 1][CV];
    int rn[AH];
MM_UNROLL
    for (int u = 0; u < AH; ++u) {
      const bool in = tg + u < t1;
      if (in) {
        load_vec<CV>(&x(b * L + tg + u, col + c), xn[u]);
        if constexpr (kEx) load_vec<CV>(&ey(b * L + tg + u, c), en[u]);
      } else {
        for (int v = 0; v < CV; ++v) xn[u][v] = P(0);
        if constexpr (kEx)
          for (int v = 0; v < CV; ++v) en[u][v] = P(0);
      }
      rn[u] = in && recs ? seq(b, tg + u) : 0;
    }
MM_UNROLL
    for (int u = 0; u < AH; ++u) {
      if (tg + u >= t1) break;
      for (int j = 0; j < K - 1; ++j) {
        for (int v = 0; v < CV; ++v) xs[j][v] = xs[j + 1][v];
        rs[j] = rs[j + 1];
      }
      for (int v = 0; v < CV; ++v) xs[K - 1][v] = xn[u][v];
      rs[K - 1] = rn[u];
      P pre[CV];
      for (int v = 0; v < CV; ++v) pre[v] = bc[v];
      for (int j = 0; j < K; ++j)
        if (j >= K - W && rs[j] == rs[K - 1])
          for (int v = 0; v < CV; ++v) pre[v] += wr[j][v] * xs[j][v];
      if constexpr (kEx)
        f(b * L + tg + u, pre, xs, rs, en[u]);
      else
        f(b * L + tg + u, pre, xs, rs);
    }
  }
}

// wr[j][v] = tap j - (K - W) of channel c + v for slots j >= K - W, zeros before (conv_run's layout).
template <int K, int CV, class P>
KOKKOS_INLINE_FUNCTION void load_taps(const View2<const P>& w, index_t c, P (&wr)[K][CV]) {
  const index_t W = w.extent(1);
  for (int j = 0; j < K; ++j)
    for (int v = 0; v < CV; ++v) wr[j][v] = j >= K - W ? w(c + v, j - (K - W)) : P(0);
}
}  // namespace

namespace {
// Work item br of the runs of kConvRun tokens: batch row b and tokens [t0, t1).
KOKKOS_INLINE_FUNCTION void run_of(index_t br, index_t nr, index_t L, index_t& b, index_t& t0, index_t& t1) {
  b = br / nr;
  t0 = (br - b * nr) * kConvRun;
  t1 = t0 + kConvRun < L ? t0 + kConvRun : L;
}

// y(row, c) = silu(pre) for every output, over runs with a K-slot window, CV channels a work item.
template <int K, int CV, bool kRecs, class T>
void conv_forward_runs(const Conv1dIn<T>& in, const View2<const acc_t<T>>& w, const View1<const acc_t<T>>& bias,
                       const SeqIdxView& seq_idx, const View2<T>& y) {
  using P = acc_t<T>;
  const auto x = in.x;
  const auto prefix = in.prefix;
  const index_t col = in.col, L = in.seqlen, nr = (L + kConvRun - 1) / kConvRun;
  par_for("conv1d::forward", in.batch * nr, in.channels / CV, KOKKOS_LAMBDA(index_t br, index_t cg) {
    index_t b, t0, t1;
    run_of(br, nr, L, b, t0, t1);
    const index_t c = cg * CV;
    P wr[K][CV];
    load_taps<K, CV>(w, c, wr);
    conv_run<K, CV, false, kRecs, T, P>(x, col, prefix, L, wr, w.extent(1), bias, seq_idx, b, t0, t1, c,
                                        View2<const T>(),
                                        [&](index_t row, const P (&pre)[CV], const P (&)[K][CV], const int*) {
                                          P o[CV];
                                          for (int v = 0; v < CV; ++v) o[v] = silu(pre[v]);
                                          store_vec<CV>(&y(row, c), o);
                                        });
  });
}

// The backward in one pass over runs: each work item walks its run [t0, t1) and the W - 1 tokens after it (the
// halo, recomputed: their dpre feed the run's last inputs), with dpre(t, c) = dy silu'(pre) (pre recomputed) kept in
// a K-slot window of its own: dx(s) = sum_k w(c, k) dpre(s + (W-1) - k) over outputs of s's record that exist (< L)
// is written once the window holds dpre(s + W - 1), and the run's sums of dpre x(t - (W-1) + k) (dw) and of dpre
// (dbias) go to partials pw(run item, c W + k) and pw(run item, C W + c). dpre never goes to memory: a first pass that
// wrote it and a second that read it back for dx took 14.3 ms of a 217 ms LM step on an H200.
// DX, kRound: dx's element type, and whether dx is written rounded to bf16 (a bf16 copy for a GEMM on bf16 operands;
// bf16_op_t is float on host builds, where the rounding is emulated).
// kFull: W = K (d_conv 4 on the 4-slot window), where dx's taps are the forward's in reverse slot order and the
// work item keeps one copy of them.
template <int K, int CV, bool kRecs, bool kFull, class T, class DX = T, bool kRound = false>
void conv_backward_runs(const Conv1dIn<T>& in, const View2<const acc_t<T>>& w, const View1<const acc_t<T>>& bias,
                        const SeqIdxView& seq_idx, const View2<const T>& dy, const UView2<DX>& dx, index_t dx_col,
                        const View2<acc_t<T>>& pw) {
  using P = acc_t<T>;
  const auto x = in.x;
  const auto prefix = in.prefix;
  const index_t col = in.col, L = in.seqlen, nr = (L + kConvRun - 1) / kConvRun, W = w.extent(1);
  const index_t cw = in.channels * W;  // dbias' partials after dw's
  // The LM's variant (4 channels, no records, d_conv 4) held to 128 registers a thread: at its 136 Kokkos' blocks
  // of 128 threads left 3 blocks (12 warps) an SM, and the H200 ran it at 1.6 TB/s (ncu: 34 % of peak bandwidth,
  // the warps waiting on their loads); bounded, 4 blocks, with ptxas spilling 24 bytes
  using Bounds = std::conditional_t<CV == 4 && K == 4 && kFull && !kRecs, Kokkos::LaunchBounds<128, 4>,
                                    Kokkos::LaunchBounds<>>;
  par_for<Bounds>("conv1d::backward", in.batch * nr, in.channels / CV, KOKKOS_LAMBDA(index_t br, index_t cg) {
    index_t b, t0, t1;
    run_of(br, nr, L, b, t0, t1);
    const index_t c = cg * CV;
    P acc[K + 1][CV] = {};
    P wr[K][CV];
    load_taps<K, CV>(w, c, wr);
    // wb[j] = w(c, K-1-j): the tap by which dpre in slot j (position t - (K-1-j)) feeds dx(t - (W-1)); with
    // kFull that is wr[K-1-j] and wb is not filled (a plain `if`: nvcc's extended lambdas may not first capture W
    // inside an `if constexpr`)
    P wb[kFull ? 1 : K][CV], gs[K][CV];
    int gr[K];
    for (int j = 0; j < K; ++j) {
      for (int v = 0; v < CV; ++v) {
        if (!kFull) wb[kFull ? 0 : j][v] = K - 1 - j < W ? w(c + v, K - 1 - j) : P(0);
        gs[j][v] = P(0);
      }
      gr[j] = 0;
    }
    // dpre(t) = g of record r enters the window; dx(t - (W-1)) follows when that position is in the run
    const auto push = [&](index_t t, const P (&g)[CV], int r) {
      for (int j = 0; j < K - 1; ++j) {
        for (int v = 0; v < CV; ++v) gs[j][v] = gs[j + 1][v];
        gr[j] = gr[j + 1];
      }
      for (int v = 0; v < CV; ++v) gs[K - 1][v] = g[v];
      gr[K - 1] = r;
      const index_t s = t - (W - 1);
      if (s < t0) return;
      const int rs = gr[K - W];  // the record of s
      P d[CV] = {};
      for (int j = 0; j < K; ++j)
        if (j >= K - W && gr[j] == rs)
          for (int v = 0; v < CV; ++v) {
            if constexpr (kFull)
              d[v] += wr[K - 1 - j][v] * gs[j][v];
            else
              d[v] += wb[j][v] * gs[j][v];
          }
      DX* o = &dx(b * L + s, dx_col + c);
      if constexpr (kRound) {
        store_bf16_op_vec<CV>(o, d);
      } else {
        store_vec<CV>(o, d);
      }
    };
    const index_t te = t1 + W - 1 < L ? t1 + W - 1 : L;
    const auto step = [&](index_t row, const P (&pre)[CV], const P (&xs)[K][CV], const int* rs, const P (&e)[CV]) {
      P g[CV];
      for (int v = 0; v < CV; ++v) g[v] = e[v] * dsilu(pre[v]);
      const index_t t = row - b * L;
      if (t < t1) {
        for (int j = 0; j < K; ++j)
          if (j >= K - W && rs[j] == rs[K - 1])
            for (int v = 0; v < CV; ++v) acc[j][v] += g[v] * xs[j][v];
        for (int v = 0; v < CV; ++v) acc[K][v] += g[v];
      }
      push(t, g, rs[K - 1]);
    };
    conv_run<K, CV, true, kRecs, T, P>(x, col, prefix, L, wr, W, bias, seq_idx, b, t0, te, c, dy, step);
    const P zero[CV] = {};
    for (index_t t = te; t < t1 + W - 1; ++t) push(t, zero, gr[K - 1]);  // past the sequence's end: no outputs
    for (int v = 0; v < CV; ++v) {
      for (int j = 0; j < K; ++j)
        if (j >= K - W) pw(br, (c + v) * W + j - (K - W)) = acc[j][v];
      pw(br, cw + c + v) = acc[K][v];
    }
  });
}

// f(std::integral_constant<int, CV>): 4 channels a work item (where `allow`) for float data of C channels whose rows
// allow 16-byte accesses at these (pointer, column, row stride) triples, else 1.
template <class T, class F>
void with_channels(bool allow, index_t C, std::initializer_list<std::tuple<const void*, index_t, index_t>> rows,
                   const F& f) {
  if constexpr (std::is_same_v<T, float>) {
    bool four = allow && C % 4 == 0;
    for (const auto& [p, col, ld] : rows)
      four = four && aligned16(p) && col % 4 == 0 && ld % 4 == 0;
    if (four) return f(std::integral_constant<int, 4>());
  }
  f(std::integral_constant<int, 1>());
}
// f(std::integral_constant<int, K>) with the window K for conv width W: 4 up to d_conv 4, else kMaxConvWidth.
template <class F>
void with_window(index_t W, const F& f) {
  if (W <= 4) f(std::integral_constant<int, 4>());
  else f(std::integral_constant<int, int(kMaxConvWidth)>());
}
// f(std::bool_constant<b>) for a runtime b (a kernel specialised on it).
template <class F>
void with_flag(bool b, const F& f) {
  if (b) f(std::true_type());
  else f(std::false_type());
}
}  // namespace

template <class T>
void conv1d_silu_forward(const Conv1dIn<T>& in, const View2<const acc_t<T>>& w, const View1<const acc_t<T>>& bias,
                         const SeqIdxView& seq_idx, const View2<T>& y) {
  check_prefix(in, w.extent(1), "conv1d_silu_forward");
  using Row = std::tuple<const void*, index_t, index_t>;
  const auto rows = {Row{in.x.data(), in.col, in.x.stride(0)}, Row{y.data(), 0, y.stride(0)}};
  with_channels<T>(true, in.channels, rows, [&](auto cv) {
    with_window(w.extent(1), [&](auto k) {
      with_flag(seq_idx.extent(0) > 0, [&](auto recs) {
        conv_forward_runs<decltype(k)::value, decltype(cv)::value, decltype(recs)::value, T>(in, w, bias, seq_idx, y);
      });
    });
  });
}

namespace {
template <class T, class DX, bool kRound>
void conv_backward(const Conv1dIn<T>& in, const View2<const acc_t<T>>& w, const View1<const acc_t<T>>& bias,
                   const SeqIdxView& seq_idx, const View2<const T>& dy, const UView2<DX>& dx, index_t dx_col,
                   const View2<acc_t<T>>& dw, const View1<acc_t<T>>& dbias) {
  using P = acc_t<T>;
  check_prefix(in, w.extent(1), "conv1d_silu_backward");
  const index_t L = in.seqlen, W = w.extent(1), C = in.channels;
  // dx, and the runs' partial sums of dw and dbias (dpre = dy silu'(pre) recomputed in registers), then the partials
  // summed in order (as column_reduce does)
  PoolScope ws;  // the partial sums: cached device blocks, returned at the end
  const index_t nb = in.batch * ((L + kConvRun - 1) / kConvRun);
  // dw's partials in columns c W + k, dbias' in C W + c: one reduction for both
  View2<P> pw = ws.take<View2<P>>("conv1d::backward_dw::partial", nb, C * W + C);
  // 4 channels a work item up to d_conv 4 (the 8-slot window of wider convs with 4 channels spills registers)
  using Row = std::tuple<const void*, index_t, index_t>;
  const auto rows = {Row{in.x.data(), in.col, in.x.stride(0)}, Row{dy.data(), 0, dy.stride(0)},
                     Row{dx.data(), dx_col, dx.stride(0)}};
  with_channels<T>(W <= 4, C, rows, [&](auto cv) {
    with_window(W, [&](auto k) {
      constexpr int K = decltype(k)::value, CV = decltype(cv)::value;
      with_flag(seq_idx.extent(0) > 0, [&](auto recs) {
        with_flag(W == K, [&](auto full) {
          conv_backward_runs<K, CV, decltype(recs)::value, decltype(full)::value, T, DX, kRound>(
              in, w, bias, seq_idx, dy, dx, dx_col, pw);
        });
      });
    });
  });
  reduce_partials<P>("conv1d::backward_dw", pw, nb, C * W, View1<P>(dw.data(), C * W), true, kReduceRowBlock, dbias,
                     C);
}
}  // namespace

template <class T>
void conv1d_silu_backward(const Conv1dIn<T>& in, const View2<const acc_t<T>>& w, const View1<const acc_t<T>>& bias,
                          const SeqIdxView& seq_idx, const View2<const T>& dy, const UView2<T>& dx, index_t dx_col,
                          const View2<acc_t<T>>& dw, const View1<acc_t<T>>& dbias) {
  conv_backward<T, T, false>(in, w, bias, seq_idx, dy, dx, dx_col, dw, dbias);
}

void conv1d_silu_backward_bf16dx(const Conv1dIn<float>& in, const View2<const float>& w, const View1<const float>& bias,
                                 const SeqIdxView& seq_idx, const View2<const float>& dy, const UView2<bf16_op_t>& dx,
                                 index_t dx_col, const View2<float>& dw, const View1<float>& dbias) {
  conv_backward<float, bf16_op_t, true>(in, w, bias, seq_idx, dy, dx, dx_col, dw, dbias);
}

template <class T>
void conv1d_state_out(const Conv1dIn<T>& in, index_t W, const SeqIdxView& seq_idx, const View3<T>& state) {
  check_prefix(in, W, "conv1d_state_out");
  require(index_t(state.extent(0)) == in.batch && index_t(state.extent(1)) == in.channels &&
              index_t(state.extent(2)) == W - 1,
          "conv1d_state_out", "state must be (batch, channels, d_conv - 1) = (", in.batch, ", ", in.channels, ", ",
          W - 1, ")");
  using P = acc_t<T>;
  const auto x = in.x;
  const auto prefix = in.prefix;
  const index_t col = in.col, L = in.seqlen;
  // One work item per (b, c) walks k upwards: it reads prefix index k + L > k before overwriting it, so the
  // state may be the prefix itself.
  par_for("conv1d::state_out", in.batch, in.channels, KOKKOS_LAMBDA(index_t b, index_t c) {
    for (index_t k = 0; k < W - 1; ++k) {
      const index_t s = L - (W - 1) + k;
      state(b, c, k) = static_cast<T>(conv_tap<T, P>(x, col, prefix, L, W, seq_idx, b, L - 1, s, c));
    }
  });
}

template <class T>
void conv1d_silu_step(const View2<const T>& x, index_t col, const View2<const acc_t<T>>& w,
                      const View1<const acc_t<T>>& bias, const View3<T>& state, const View2<T>& y) {
  using P = acc_t<T>;
  const index_t Bsz = y.extent(0), C = y.extent(1), W = w.extent(1);
  require(index_t(x.extent(0)) == Bsz && col + C <= index_t(x.extent(1)) && index_t(w.extent(0)) == C &&
              index_t(state.extent(0)) == Bsz && index_t(state.extent(1)) == C && index_t(state.extent(2)) == W - 1,
          "conv1d_silu_step", "shapes: x (", x.extent(0), ", ", x.extent(1), ") at column ", col, ", w (",
          w.extent(0), ", ", W, "), state (", state.extent(0), ", ", state.extent(1), ", ", state.extent(2),
          "), y (", Bsz, ", ", C, ")");
  par_for("conv1d::step", Bsz, C, KOKKOS_LAMBDA(index_t b, index_t c) {
    const P xt = P(x(b, col + c));
    P acc = bias(c) + w(c, W - 1) * xt;
    for (index_t k = 0; k < W - 1; ++k) {
      acc += w(c, k) * P(state(b, c, k));
      state(b, c, k) = k + 1 < W - 1 ? state(b, c, k + 1) : static_cast<T>(xt);
    }
    y(b, c) = static_cast<T>(silu(acc));
  });
}

#define MM_INSTANTIATE(T)                                                                                       \
  template void conv1d_silu_forward<T>(const Conv1dIn<T>&, const View2<const acc_t<T>>&,                      \
                                       const View1<const acc_t<T>>&, const SeqIdxView&, const View2<T>&);     \
  template void conv1d_silu_backward<T>(const Conv1dIn<T>&, const View2<const acc_t<T>>&,                     \
                                        const View1<const acc_t<T>>&, const SeqIdxView&, const View2<const T>&, \
                                        const UView2<T>&, index_t, const View2<acc_t<T>>&, const View1<acc_t<T>>&); \
  template void conv1d_state_out<T>(const Conv1dIn<T>&, index_t, const SeqIdxView&, const View3<T>&);                     \
  template void conv1d_silu_step<T>(const View2<const T>&, index_t, const View2<const acc_t<T>>&,              \
                                    const View1<const acc_t<T>>&, const View3<T>&, const View2<T>&);
MM_INSTANTIATE(float)
MM_INSTANTIATE(double)
#undef MM_INSTANTIATE

}  // namespace mm
