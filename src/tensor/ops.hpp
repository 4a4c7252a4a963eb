// Small elementwise and reduction helpers shared by the layers.
//
// Reductions here are deterministic and independent of the thread count: rows are cut into fixed blocks, each
// block is summed in order, and the block partials are summed in order (in blocks again when there are more than
// a block's worth of them). No atomics, so a run with
// `[run] deterministic = true` is bit-identical between runs on the same hardware and layout.
#pragma once

#include "core/kokkos_types.hpp"
#include "core/pool.hpp"

namespace mm {
// Internal linkage (the unnamed namespace): the KOKKOS_LAMBDAs in these header templates would otherwise give
// every translation unit that instantiates one the same lambda wrapper type, whose copy goes through function
// pointers nvcc keeps per translation unit; the linker keeps one unit's copy of the out-of-line code and the
// others' pointers stay null (a host call through address 0 on CUDA builds, at the first copy of such a lambda).
namespace {

inline constexpr index_t kReduceRowBlock = 256;  // rows per partial sum
// On CUDA, column_reduce cuts the rows into blocks of fewer rows where (blocks) x (columns) threads would stay
// below kReduceFirstItems: halved from kReduceRowBlock, not below kReduceRowBlockFew. With 256-row blocks such a
// reduction runs on (rows / 256) x (columns) threads, each walking 256 rows in turn: the MoE router's 8-column
// load-balancing sum and 1-column z-loss sum over 65,536 tokens took 0.12 and 0.07 ms on an H200, for 2 MB of data
// (a rule for fewer than 64 columns, 32-row blocks, before this one), and the Mamba-3 block's B and C norm weight
// gradients (128 columns over 65,536 tokens, 32,768 threads) 0.19 ms each on an H100 for 67 MB.
inline constexpr index_t kReduceRowBlockFew = 32;
inline constexpr index_t kReduceFirstItems = index_t(1) << 17;
// column_reduce's rows per block for n rows of m columns: a function of n and m only (runs stay bit-identical)
inline index_t reduce_first_rows(index_t n, index_t m) {
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same_v<Exec, Kokkos::Cuda>) {
    index_t r = kReduceRowBlock;
    while (r > kReduceRowBlockFew && ((n + r - 1) / r) * m < kReduceFirstItems) r /= 2;
    return r;
  }
#endif
  (void)n;
  (void)m;
  return kReduceRowBlock;
}
// Columns per work item: on host backends 32 (a work item streams 32 contiguous values of each row); on CUDA 1, so
// consecutive threads take consecutive columns and a warp reads 32 contiguous values per row (with 32 columns per
// thread the H200 ran these reductions at ~2% occupancy with strided reads: 1-2 ms each in the LM step). The sums
// are the same either way: every partial(b, j) adds its block's rows in order.
#if defined(KOKKOS_ENABLE_CUDA)
inline constexpr index_t kReduceColBlock = std::is_same_v<Exec, Kokkos::Cuda> ? 1 : 32;
#else
inline constexpr index_t kReduceColBlock = 32;
#endif

// On CUDA the rounds of reduce_partials keep at least this many threads busy where their blocks allow (a round of
// (partials / 256) x (columns) threads each walking 256 partials in turn leaves most SMs idle). Measured on an
// H200 (perf/RESULTS.md, twenty-fifth session): the conv1d weight gradient's two rounds over 512 x 8,960 partials
// still took ~20 us each (1.00 ms for 48 calls before and after), so the blocking was not what held them.
inline constexpr index_t kReduceMinItems = index_t(1) << 16;
// The rows per block of a round over nb partials of m columns: rb, or on CUDA the largest power-of-two fraction of
// it (not below 8) that gives at least kReduceMinItems work items. Sums stay in a fixed order (a function of nb
// and m, so runs are bit-identical); host backends keep rb.
inline index_t reduce_round_rows(index_t nb, index_t m, index_t rb) {
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same_v<Exec, Kokkos::Cuda>) {
    index_t r = rb;
    while (r > 8 && ((nb + r - 1) / r) * m < kReduceMinItems) r /= 2;
    return r;
  }
#endif
  (void)nb;
  (void)m;
  return rb;
}
// Partials the last round of reduce_partials sums per column: rb on host backends, at most 16 on CUDA (one thread
// a column walks them).
inline index_t reduce_last_rows(index_t rb) {
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same_v<Exec, Kokkos::Cuda>) return rb < 16 ? rb : 16;
#endif
  return rb;
}

// out[j] = (accumulate ? out[j] : 0) + sum_{b<nb} partial(b, j) for j < m, and with out2 (m2 > 0 columns)
// out2[j] likewise from partial(b, m + j): one reduction for two outputs whose partials share the rows. While
// there are more partials than the last round takes (reduce_last_rows) they are summed in blocks again (one
// thread per column walking all of them took 11 ms for the 90 M parameters of a gradient norm on an H200).
template <class R>
void reduce_partials(const char* label, View2<R> partial, index_t nb, index_t m, const View1<R>& out,
                     bool accumulate, index_t rb = kReduceRowBlock, const View1<R>& out2 = View1<R>(),
                     index_t m2 = 0) {
  PoolScope ws;  // each round's partial sums: cached device blocks, all held until the last kernel is queued
  const index_t mt = m + m2;
  while (nb > reduce_last_rows(rb)) {
    const index_t r = reduce_round_rows(nb, mt, rb);
    const index_t nb2 = (nb + r - 1) / r;
    View2<R> next = ws.take<View2<R>>(std::string(label) + "::partial", nb2, mt);
    const auto p = partial;
    const index_t n = nb;
    par_for(label, nb2, mt, KOKKOS_LAMBDA(index_t b, index_t j) {
      const index_t i1 = (b + 1) * r < n ? (b + 1) * r : n;
      R t = R(0);
      for (index_t i = b * r; i < i1; ++i) t += p(i, j);
      next(b, j) = t;
    });
    partial = next;
    nb = nb2;
  }
  par_for(label, mt, KOKKOS_LAMBDA(index_t j) {
    R& o = j < m ? out(j) : out2(j - m);
    R s = accumulate ? o : R(0);
    R t = R(0);
    for (index_t b = 0; b < nb; ++b) t += partial(b, j);
    o = s + t;
  });
}

// out[j] = (accumulate ? out[j] : 0) + sum_{i<n} f(i, j), for j < m. f must be callable on the device.
template <class R, class F>
void column_reduce(const char* label, index_t n, index_t m, const F& f, const View1<R>& out, bool accumulate) {
  const index_t rb = reduce_first_rows(n, m);
  const index_t nb = (n + rb - 1) / rb;
  const index_t ncb = (m + kReduceColBlock - 1) / kReduceColBlock;
  PoolScope ws;  // the partial sums: a cached device block
  View2<R> partial = ws.take<View2<R>>(std::string(label) + "::partial", nb > 0 ? nb : 1, m);
  par_for(label, nb, ncb, KOKKOS_LAMBDA(index_t b, index_t cb) {
    const index_t j0 = cb * kReduceColBlock;
    const index_t j1 = j0 + kReduceColBlock < m ? j0 + kReduceColBlock : m;
    const index_t i0 = b * rb;
    const index_t i1 = i0 + rb < n ? i0 + rb : n;
    // the sums in registers (stored once): partial(b, j) itself in the loop is a global read-modify-write per row,
    // which the compiler cannot keep in a register (it may alias what f reads); same order of additions
    R acc[kReduceColBlock];
    for (index_t j = 0; j < kReduceColBlock; ++j) acc[j] = R(0);
MM_UNROLL4
    for (index_t i = i0; i < i1; ++i)
      for (index_t j = j0; j < j1; ++j) acc[j - j0] += f(i, j);
    for (index_t j = j0; j < j1; ++j) partial(b, j) = acc[j - j0];
  });
  reduce_partials<R>(label, partial, nb, m, out, accumulate, rb);
}

// Deterministic sum of f(i) over i < n, returned on the host (the one-element result from the workspace cache
// and copied into a host scalar: no device or host allocation per call; it runs in every training step).
template <class R, class F>
R ordered_sum(const char* label, index_t n, const F& f) {
  PoolScope ws;
  const View1<R> out = ws.take<View1<R>>(std::string(label) + "::out", 1);
  column_reduce<R>(label, n, 1, KOKKOS_LAMBDA(index_t i, index_t) { return f(i); }, out, false);
  R h{};
  Kokkos::deep_copy(h, Kokkos::subview(out, 0));
  return h;
}

// y = x (element conversion), over a whole view of any rank with the same extents.
template <class Dst, class Src>
void copy_convert(const char* label, const Dst& dst, const Src& src) {
  const index_t n = src.span();
  auto d = dst.data();
  auto s = src.data();
  par_for(label, n, KOKKOS_LAMBDA(index_t i) { d[i] = static_cast<std::remove_pointer_t<decltype(d)>>(s[i]); });
}

}  // namespace
}  // namespace mm
