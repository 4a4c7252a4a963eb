// Core: counter-based RNG, error type, dispatch wrappers, deterministic reductions, GEMM dispatch.
#include <cmath>
#include <set>
#include <vector>

#include <limits>
#include <type_traits>
#include "catch.hpp"
#include "core/error.hpp"
#include "core/pool.hpp"
#include "core/rng.hpp"
#include "tensor/gemm.hpp"
#include "tensor/ops.hpp"
#include "util.hpp"

using namespace mm;

TEST_CASE("Philox-4x32-10 reproduces the Random123 known-answer vectors", "[core]") {
  // kat_vectors of Random123 1.09 for philox4x32_10
  const Philox4x32 a = philox4x32_10(Philox4x32{{0, 0, 0, 0}}, 0, 0);
  CHECK(a.v[0] == 0x6627e8d5u);
  CHECK(a.v[1] == 0xe169c58du);
  CHECK(a.v[2] == 0xbc57ac4cu);
  CHECK(a.v[3] == 0x9b00dbd8u);
  const Philox4x32 b =
      philox4x32_10(Philox4x32{{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}}, 0xffffffffu, 0xffffffffu);
  CHECK(b.v[0] == 0x408f276du);
  CHECK(b.v[1] == 0x41c83b0eu);
  CHECK(b.v[2] == 0xa20bc7c6u);
  CHECK(b.v[3] == 0x6d5451fdu);
  const Philox4x32 c = philox4x32_10(Philox4x32{{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}},
                                     0xa4093822u, 0x299f31d0u);
  CHECK(c.v[0] == 0xd16cfe09u);
  CHECK(c.v[1] == 0x94fdccebu);
  CHECK(c.v[2] == 0x5001e420u);
  CHECK(c.v[3] == 0x24126ea1u);
}

TEST_CASE("Counter RNG draws are a pure function of (seed, stream, index)", "[core]") {
  const CounterRNG rng{42, stream_id("backbone.layers.0.mixer.in_proj.weight")};
  const index_t n = 10007;
  View1<double> dev_u("uniform draws", n), dev_n("normal draws", n);
  // Drawn in a parallel kernel (any thread count, any backend) ...
  par_for("test::draw", n, KOKKOS_LAMBDA(index_t i) {
    dev_u(i) = rng.uniform(i + n);
    dev_n(i) = rng.normal(i);
  });
  auto got_u = mmtest::to_vec(dev_u);
  auto got_n = mmtest::to_vec(dev_n);
  // ... equals the same draws made one by one on the host, in reverse order: uniforms bit for bit (integer
  // arithmetic and one exact scaling); normals bit for bit on a host backend, and within a few ulp of the host's
  // on a GPU, whose log/cos/sqrt round differently from the host's libm (seen on an H200: 1 ulp).
  const bool host_backend = std::is_same_v<Mem, Kokkos::HostSpace>;
  for (index_t i = n - 1; i >= 0; --i) {
    REQUIRE(got_u[i] == rng.uniform(i + n));
    if (host_backend)
      REQUIRE(got_n[i] == rng.normal(i));
    else
      REQUIRE(std::abs(got_n[i] - rng.normal(i)) <=
              8 * std::numeric_limits<double>::epsilon() * std::abs(rng.normal(i)) + 1e-300);
  }
  // Moments of the normal draws are sane.
  double mean = 0, var = 0;
  for (index_t i = 0; i < n; ++i) mean += rng.normal(i);
  mean /= n;
  for (index_t i = 0; i < n; ++i) var += (rng.normal(i) - mean) * (rng.normal(i) - mean);
  var /= n;
  CHECK(std::abs(mean) < 0.05);
  CHECK(std::abs(var - 1.0) < 0.05);
  // Different streams and seeds give different draws.
  const CounterRNG other{42, stream_id("backbone.layers.1.mixer.in_proj.weight")};
  const CounterRNG seed2{43, rng.stream};
  CHECK(rng.uniform(0) != other.uniform(0));
  CHECK(rng.uniform(0) != seed2.uniform(0));
  // below(n) stays in range and covers it.
  std::set<std::uint64_t> seen;
  for (index_t i = 0; i < 1000; ++i) {
    const auto v = rng.below(i, 7);
    REQUIRE(v < 7);
    seen.insert(v);
  }
  CHECK(seen.size() == 7);
}

TEST_CASE("mm::Error carries its context", "[core]") {
  try {
    require(false, "inputs/x.in:12", "unknown key 'foo'");
    FAIL("require did not throw");
  } catch (const Error& e) {
    CHECK(e.context() == "inputs/x.in:12");
    CHECK(std::string(e.what()) == "inputs/x.in:12: unknown key 'foo'");
  }
}

TEST_CASE("Workspace cache: blocks come back at scope end, are reused, reported to tools, and trimmed", "[core]") {
  using namespace mm;
  pool_trim();
  const std::size_t base = pool_cached_bytes();
  static long takes = 0, returns = 0;
  takes = returns = 0;
  const auto saved = Kokkos::Tools::Experimental::get_callbacks();
  Kokkos::Tools::Experimental::set_allocate_data_callback(
      [](Kokkos_Profiling_SpaceHandle, const char* label, const void*, std::uint64_t size) {
        if (std::string(label) == "pool:test::a") {
          ++takes;
          CHECK(size == 300 * 70 * sizeof(float));
        }
      });
  Kokkos::Tools::Experimental::set_deallocate_data_callback(
      [](Kokkos_Profiling_SpaceHandle, const char* label, const void*, std::uint64_t) {
        if (std::string(label) == "pool:test::a") ++returns;
      });
  const float* first = nullptr;
  {
    PoolScope ws;
    View2<float> a = ws.take<View2<float>>("test::a", 300, 70);
    View1<double> b = ws.take<View1<double>>("test::b", 1000);
    CHECK(a.extent(0) == 300);
    CHECK(a.extent(1) == 70);
    CHECK(static_cast<const void*>(a.data()) != static_cast<const void*>(b.data()));
    Kokkos::deep_copy(a, 2.5f);
    Kokkos::deep_copy(b, 1.0);
    float sum = 0;
    Kokkos::parallel_reduce(
        "test::pool_sum", Range(0, 300 * 70), KOKKOS_LAMBDA(index_t i, float& acc) { acc += a(i / 70, i % 70); }, sum);
    CHECK(sum == Approx(2.5 * 300 * 70));
    first = a.data();
    CHECK(takes == 1);
    CHECK(returns == 0);
  }
  CHECK(returns == 1);
  CHECK(pool_cached_bytes() >= base + 300 * 70 * sizeof(float) + 1000 * sizeof(double));
  {
    PoolScope ws;
    View2<float> a = ws.take<View2<float>>("test::a", 300, 70);  // the same request gets the same block back
    CHECK(a.data() == first);
    PoolScope inner;  // a nested scope takes its own blocks while the outer one holds its
    View2<float> c = inner.take<View2<float>>("test::c", 300, 70);
    CHECK(c.data() != a.data());
  }
  Kokkos::Tools::Experimental::set_callbacks(saved);
  pool_trim();
  CHECK(pool_cached_bytes() == base);
}

TEST_CASE("column_reduce is exact and ordered", "[core]") {
  const index_t n = 1000, m = 37;
  View1<double> out("out", m);
  Kokkos::deep_copy(out, 1.0);
  column_reduce<double>("test::colred", n, m, KOKKOS_LAMBDA(index_t i, index_t j) { return double(i * m + j); },
                        out, true);
  auto h = mmtest::to_vec(out);
  for (index_t j = 0; j < m; ++j) {
    double expect = 1.0;
    for (index_t i = 0; i < n; ++i) expect += double(i * m + j);
    CHECK(h[j] == expect);
  }
  CHECK(ordered_sum<double>("test::sum", 100, KOKKOS_LAMBDA(index_t i) { return double(i); }) == 4950.0);
  // the first pass's row blocks: on CUDA fewer rows where blocks x columns stay below 2^17 threads (not below 32),
  // on host backends 256
  const bool cuda = kReduceColBlock == 1;  // (CUDA builds)
  CHECK(reduce_first_rows(65536, 128) == (cuda ? 64 : 256));
  CHECK(reduce_first_rows(65536, 8) == (cuda ? 32 : 256));
  CHECK(reduce_first_rows(index_t(1) << 20, 1024) == 256);
  {
    // reduce_partials into two outputs (the first m1 columns, then m2): 600 partials, several rounds on CUDA
    const index_t nb = 600, m1 = 300, m2 = 5;
    View2<double> part("part", nb, m1 + m2);
    par_for("test::fill", nb, m1 + m2, KOKKOS_LAMBDA(index_t b, index_t j) { part(b, j) = double((b * 7 + j) % 97); });
    View1<double> o1("o1", m1), o2("o2", m2);
    Kokkos::deep_copy(o1, 2.0);
    Kokkos::deep_copy(o2, 3.0);
    reduce_partials<double>("test::partials", part, nb, m1, o1, true, kReduceRowBlock, o2, m2);
    const auto h1 = mmtest::to_vec(o1), h2 = mmtest::to_vec(o2);
    for (index_t j = 0; j < m1 + m2; ++j) {
      double expect = j < m1 ? 2.0 : 3.0;
      for (index_t b = 0; b < nb; ++b) expect += double((b * 7 + j) % 97);
      CHECK((j < m1 ? h1[j] : h2[j - m1]) == expect);
    }
  }
  // more than 256 x 256 rows: the block partials are summed in blocks again (integers: exact in double)
  const index_t big = 3 * 256 * 256 + 17;
  CHECK(ordered_sum<double>("test::sum_big", big, KOKKOS_LAMBDA(index_t i) { return double(i % 1000); }) ==
        [&] {
          double e = 0;
          for (index_t i = 0; i < big; ++i) e += double(i % 1000);
          return e;
        }());
}

TEST_CASE("GEMM dispatch matches a naive product for every transpose combination", "[gemm]") {
  const index_t m = 13, n = 7, k = 11;
  for (auto ta : {Trans::N, Trans::T})
    for (auto tb : {Trans::N, Trans::T}) {
      View2<double> A("A", ta == Trans::N ? m : k, ta == Trans::N ? k : m);
      View2<double> B("B", tb == Trans::N ? k : n, tb == Trans::N ? n : k);
      View2<double> C("C", m, n);
      mmtest::fill_uniform(A, 1);
      mmtest::fill_uniform(B, 2);
      mmtest::fill_uniform(C, 3);
      const auto a = mmtest::to_vec(A), b = mmtest::to_vec(B), c0 = mmtest::to_vec(C);
      gemm(ta, tb, 0.5, A, B, 2.0, C);
      std::vector<double> ref(m * n);
      for (index_t i = 0; i < m; ++i)
        for (index_t j = 0; j < n; ++j) {
          double s = 0;
          for (index_t l = 0; l < k; ++l) {
            const double av = ta == Trans::N ? a[i * k + l] : a[l * m + i];
            const double bv = tb == Trans::N ? b[l * n + j] : b[j * k + l];
            s += av * bv;
          }
          ref[i * n + j] = 0.5 * s + 2.0 * c0[i * n + j];
        }
      CHECK(mmtest::rel_err(mmtest::to_vec(C), ref) < 1e-14);
    }
  // float goes through the same dispatch
  View2<float> Af("Af", m, k), Bf("Bf", k, n), Cf("Cf", m, n);
  mmtest::fill_uniform(Af, 4);
  mmtest::fill_uniform(Bf, 5);
  gemm(Trans::N, Trans::N, 1.0f, Af, Bf, 0.0f, Cf);
  const auto a = mmtest::to_vec(Af), b = mmtest::to_vec(Bf);
  std::vector<double> ref(m * n, 0.0);
  for (index_t i = 0; i < m; ++i)
    for (index_t j = 0; j < n; ++j)
      for (index_t l = 0; l < k; ++l) ref[i * n + j] += a[i * k + l] * b[l * n + j];
  CHECK(mmtest::rel_err(mmtest::to_vec(Cf), ref) < 1e-6);
  // mismatched shapes are an error naming the shapes
  View2<double> bad("bad", m + 1, n);
  View2<double> A2("A2", m, k), B2("B2", k, n);
  CHECK_THROWS_WITH(gemm(Trans::N, Trans::N, 1.0, A2, B2, 0.0, bad), ContainsSubstring("shapes do not match"));
}

TEST_CASE("Two-level batched GEMM matches a naive product (strided and pointer-array cases)", "[gemm]") {
  // (nj, ni) batch over a buffer where entry (j, i) of X starts at j sXj + i sXi: with sXj = ni sXi the levels
  // flatten into one stride; with interleaved heads (sXi < the matrix size) they do not.
  const index_t m = 5, n = 6, k = 4, nj = 3, ni = 4;
  for (bool flat : {true, false})
    for (auto ta : {Trans::N, Trans::T})
      for (auto tb : {Trans::N, Trans::T}) {
        // A entries are ra x ca row-major with row stride lda; not flat: heads side by side in a row
        const index_t ra = ta == Trans::N ? m : k, ca = ta == Trans::N ? k : m;
        const index_t rb = tb == Trans::N ? k : n, cb = tb == Trans::N ? n : k;
        const index_t lda = flat ? ca : ni * ca, ldb = flat ? cb : ni * cb, ldc = flat ? n : ni * n;
        const index_t sAi = flat ? ra * ca : ca, sBi = flat ? rb * cb : cb, sCi = flat ? m * n : n;
        const index_t sAj = flat ? ni * sAi : ra * lda, sBj = flat ? ni * sBi : rb * ldb, sCj = flat ? ni * sCi : m * ldc;
        View1<double> A("A", nj * sAj), B("B", nj * sBj), C("C", nj * sCj);
        mmtest::fill_uniform(A, 1);
        mmtest::fill_uniform(B, 2);
        mmtest::fill_uniform(C, 3);
        const auto a = mmtest::to_vec(A), b = mmtest::to_vec(B), c0 = mmtest::to_vec(C);
        gemm_batched_2d(ta, tb, m, n, k, 0.5, A.data(), lda, sAj, sAi, B.data(), ldb, sBj, sBi, 2.0, C.data(), ldc,
                        sCj, sCi, nj, ni);
        std::vector<double> ref = c0;
        for (index_t j = 0; j < nj; ++j)
          for (index_t i = 0; i < ni; ++i)
            for (index_t r = 0; r < m; ++r)
              for (index_t q = 0; q < n; ++q) {
                const double* ap = a.data() + j * sAj + i * sAi;
                const double* bp = b.data() + j * sBj + i * sBi;
                double s = 0;
                for (index_t l = 0; l < k; ++l)
                  s += (ta == Trans::N ? ap[r * lda + l] : ap[l * lda + r]) *
                       (tb == Trans::N ? bp[l * ldb + q] : bp[q * ldb + l]);
                double& cr = ref[j * sCj + i * sCi + r * ldc + q];
                cr = 0.5 * s + 2.0 * cr;
              }
        INFO("flat=" << flat << " ta=" << int(ta) << " tb=" << int(tb));
        CHECK(mmtest::rel_err(mmtest::to_vec(C), ref) < 1e-14);
      }
}

TEST_CASE("float GEMM in bf16 arithmetic: bf16 copies in blocks equal cuBLAS' own rounding", "[gemm]") {
  // Shapes with rows of 8 floats (the vectorised rounding) and without; a block of 64 elements cuts op(A) = A into
  // row blocks and op(A) = A^T into K blocks. CUDA: the bf16 copies give the product of the bf16-rounded operands
  // (fp32 accumulation); host builds compute in fp32 (the exact product).
  for (const index_t m : {40, 13})
    for (auto ta : {Trans::N, Trans::T})
      for (auto tb : {Trans::N, Trans::T}) {
        const index_t n = m == 40 ? 24 : 7, k = m == 40 ? 56 : 11;
        View2<float> A("A", ta == Trans::N ? m : k, ta == Trans::N ? k : m);
        View2<float> B("B", tb == Trans::N ? k : n, tb == Trans::N ? n : k);
        mmtest::fill_uniform(A, 11);
        mmtest::fill_uniform(B, 12);
        View2<float> C0("C0", m, n);
        mmtest::fill_uniform(C0, 13);
        const auto a = mmtest::to_vec(A), b = mmtest::to_vec(B), c0 = mmtest::to_vec(C0);
        std::vector<double> exact(m * n), rounded(m * n);
        for (index_t i = 0; i < m; ++i)
          for (index_t j = 0; j < n; ++j) {
            double s = 0, r = 0;
            for (index_t l = 0; l < k; ++l) {
              const float av = ta == Trans::N ? a[i * k + l] : a[l * m + i];
              const float bv = tb == Trans::N ? b[l * n + j] : b[j * k + l];
              s += double(av) * bv;
              r += double(bf16_round(av)) * bf16_round(bv);
            }
            exact[i * n + j] = 0.75 * s + 0.5 * c0[i * n + j];
            rounded[i * n + j] = 0.75 * r + 0.5 * c0[i * n + j];
          }
        const FloatGemmComputeScope scope(GemmCompute::bf16);
        for (const bool cast : {true, false}) {
          set_float_gemm_bf16_cast(cast, 64);
          View2<float> C("C", m, n);
          Kokkos::deep_copy(C, C0);
          gemm(ta, tb, 0.75f, A, B, 0.5f, C);
          set_float_gemm_bf16_cast(true);
          INFO("m=" << m << " ta=" << int(ta) << " tb=" << int(tb) << " cast=" << cast);
#if defined(KOKKOS_ENABLE_CUDA)
          CHECK(float_gemm_bf16_cast());
          if (cast) {
            CHECK(mmtest::rel_err(mmtest::to_vec(C), rounded) < 1e-5);
            CHECK(mmtest::rel_err(mmtest::to_vec(C), exact) > 1e-5);  // the rounding did happen
          } else {  // cuBLAS may take a plain fp32 kernel for so small a product
            CHECK(mmtest::rel_err(mmtest::to_vec(C), exact) < 1e-2);
          }
#else
          CHECK_FALSE(float_gemm_bf16_cast());
          CHECK(mmtest::rel_err(mmtest::to_vec(C), exact) < 1e-5);
#endif
        }
      }
  CHECK_THROWS_WITH(set_float_gemm_bf16_cast(true, 0), ContainsSubstring("block"));
}

namespace {
// The linear-layer GEMM tests' operands, dy (T x O), W (O x I), x (T x I), dx0 (T x I), dW0 (O x I), filled from
// seeds seed .. seed + 4, with their host copies; the backward's references in double with each operand through its
// rounding, dx = rdy(dy) rw(W) + 0.5 dx0 and dW = rdy(dy)^T rx(x) + dW0; and check_backward, which runs a backward
// from dx0 and dW0 (with dx, and without: no rows) and compares.
struct LinearCase {
  static constexpr index_t T = 37, O = 16, I = 24;
  View2<float> dy{"dy", T, O}, W{"W", O, I}, x{"x", T, I}, dx0{"dx0", T, I}, dW0{"dW0", O, I};
  std::vector<double> g, w, xv, dxi, dWi;

  explicit LinearCase(int seed) {
    mmtest::fill_uniform(dy, seed);
    mmtest::fill_uniform(W, seed + 1);
    mmtest::fill_uniform(x, seed + 2);
    mmtest::fill_uniform(dx0, seed + 3);
    mmtest::fill_uniform(dW0, seed + 4);
    g = mmtest::to_vec(dy), w = mmtest::to_vec(W), xv = mmtest::to_vec(x), dxi = mmtest::to_vec(dx0),
    dWi = mmtest::to_vec(dW0);
  }

  template <class Rdy, class Rw, class Rx>
  std::pair<std::vector<double>, std::vector<double>> backward_ref(Rdy rdy, Rw rw, Rx rx) const {
    std::vector<double> dx_ref(T * I), dW_ref(O * I);
    for (index_t t = 0; t < T; ++t)
      for (index_t i = 0; i < I; ++i) {
        double s = 0;
        for (index_t o = 0; o < O; ++o) s += rdy(g[t * O + o]) * rw(w[o * I + i]);
        dx_ref[t * I + i] = s + 0.5 * dxi[t * I + i];
      }
    for (index_t o = 0; o < O; ++o)
      for (index_t i = 0; i < I; ++i) {
        double s = 0;
        for (index_t t = 0; t < T; ++t) s += rdy(g[t * O + o]) * rx(xv[t * I + i]);
        dW_ref[o * I + i] = s + dWi[o * I + i];
      }
    return {dx_ref, dW_ref};
  }

  // run(dx, dW): the backward with beta_dx 0.5 and beta_dw 1
  template <class Run>
  void check_backward(const std::pair<std::vector<double>, std::vector<double>>& ref, Run&& run) const {
    for (const bool with_dx : {true, false}) {
      View2<float> dx("dx", with_dx ? T : 0, I), dW("dW", O, I);
      if (with_dx) Kokkos::deep_copy(dx, dx0);
      Kokkos::deep_copy(dW, dW0);
      run(dx, dW);
      INFO("with_dx=" << with_dx);
      if (with_dx) CHECK(mmtest::rel_err(mmtest::to_vec(dx), ref.first) < 1e-5);
      CHECK(mmtest::rel_err(mmtest::to_vec(dW), ref.second) < 1e-5);
    }
  }
};

double bf16_rounded(double v) { return double(bf16_round(float(v))); }
}  // namespace

TEST_CASE("linear backward GEMMs: dx and dW from one rounding of dy equal the reference", "[gemm]") {
  // dy (T x O), W (O x I), x (T x I): dx = dy W + 0.5 dx, dW = dy^T x + dW0, and without dx; a block of 100
  // elements puts the token rows in blocks (CUDA, bf16 arithmetic), whose dW contributions accumulate.
  const LinearCase lc(21);
  for (const GemmCompute c : {GemmCompute::fp32, GemmCompute::bf16}) {
#if defined(KOKKOS_ENABLE_CUDA)
    const bool rounds = c == GemmCompute::bf16;
#else
    const bool rounds = false;
#endif
    auto r = [&](double v) { return rounds ? bf16_rounded(v) : v; };
    const auto ref = lc.backward_ref(r, r, r);
    const FloatGemmComputeScope scope(c);
    set_float_gemm_bf16_cast(true, 100);
    INFO("compute=" << gemm_compute_name(c));
    lc.check_backward(ref, [&](const View2<float>& dx, const View2<float>& dW) {
      linear_backward_gemms(lc.dy, lc.W, lc.x, 0.5f, dx, 1.0f, dW);
    });
    set_float_gemm_bf16_cast(true);
  }
  View2<float> bad("bad", LinearCase::O + 1, LinearCase::I), dx("dx", LinearCase::T, LinearCase::I);
  CHECK_THROWS_WITH(linear_backward_gemms(lc.dy, lc.W, lc.x, 0.0f, dx, 1.0f, bad),
                    ContainsSubstring("shapes do not match"));
}

TEST_CASE("linear products on a given bf16 copy of the input equal those on the rounded input", "[gemm]") {
  // y = xb W^T, dx = dy W + 0.5 dx0, dW = dy^T xb + dW0 with xb the input rounded to bf16 by its producer. CUDA:
  // W and dy are rounded here as the other bf16 GEMMs round them (a block of 100 elements puts the rows in blocks);
  // host builds: fp32 products of the given values.
  const LinearCase lc(31);
  constexpr index_t T = LinearCase::T, O = LinearCase::O, I = LinearCase::I;
  const auto x = lc.x;
  View2<bf16_op_t> xb("xb", T, I);
  Kokkos::parallel_for(
      "round", Kokkos::MDRangePolicy<Exec, Kokkos::Rank<2>>({0, 0}, {T, I}),
      KOKKOS_LAMBDA(index_t t, index_t i) { xb(t, i) = to_bf16_op(x(t, i)); });
#if defined(KOKKOS_ENABLE_CUDA)
  auto r = [](double v) { return bf16_rounded(v); };
#else
  auto r = [](double v) { return v; };
#endif
  std::vector<double> y_ref(T * O);
  for (index_t t = 0; t < T; ++t)
    for (index_t o = 0; o < O; ++o) {
      double s = 0;
      for (index_t i = 0; i < I; ++i) s += bf16_rounded(lc.xv[t * I + i]) * r(lc.w[o * I + i]);
      y_ref[t * O + o] = s;
    }
  const auto ref = lc.backward_ref(r, r, bf16_rounded);
  const FloatGemmComputeScope scope(GemmCompute::bf16);
  set_float_gemm_bf16_cast(true, 100);
#if defined(KOKKOS_ENABLE_CUDA)
  CHECK(float_gemm_on_bf16_copies());
#else
  CHECK_FALSE(float_gemm_on_bf16_copies());
#endif
  View2<float> y("y", T, O);
  linear_forward_gemm_bf16x(xb, lc.W, y);
  CHECK(mmtest::rel_err(mmtest::to_vec(y), y_ref) < 1e-5);
  lc.check_backward(ref, [&](const View2<float>& dx, const View2<float>& dW) {
    linear_backward_gemms_bf16x(lc.dy, lc.W, xb, 0.5f, dx, 1.0f, dW);
  });
  // the output gradient given as its bf16 copy dyb: dx = dyb W + 0.5 dx0, dW = dyb^T x + dW0 (CUDA: x and W
  // rounded as well)
  View2<bf16_op_t> dyb("dyb", T, O);
  const auto dy = lc.dy;
  Kokkos::parallel_for(
      "round", Kokkos::MDRangePolicy<Exec, Kokkos::Rank<2>>({0, 0}, {T, O}),
      KOKKOS_LAMBDA(index_t t, index_t o) { dyb(t, o) = to_bf16_op(dy(t, o)); });
  const auto ref_dyb = lc.backward_ref(bf16_rounded, r, r);
  INFO("dy given as its bf16 copy");
  lc.check_backward(ref_dyb, [&](const View2<float>& dx, const View2<float>& dW) {
    linear_backward_gemms_bf16dy(dyb, lc.W, lc.x, 0.5f, dx, 1.0f, dW);
  });
  // both given as their bf16 copies: dx = dyb W + 0.5 dx0, dW = dyb^T xb + dW0 (CUDA: W rounded as well)
  const auto ref_both = lc.backward_ref(bf16_rounded, r, bf16_rounded);
  INFO("dy and x given as their bf16 copies");
  lc.check_backward(ref_both, [&](const View2<float>& dx, const View2<float>& dW) {
    linear_backward_gemms_bf16(dyb, lc.W, xb, 0.5f, dx, 1.0f, dW);
  });
  set_float_gemm_bf16_cast(true);
  View2<float> bad("bad", T, O + 1), dx("dx", T, I), dWbad("dWbad", O + 1, I);
  CHECK_THROWS_WITH(linear_forward_gemm_bf16x(xb, lc.W, bad), ContainsSubstring("shapes do not match"));
  CHECK_THROWS_WITH(linear_backward_gemms_bf16(dyb, lc.W, xb, 0.0f, dx, 1.0f, dWbad),
                    ContainsSubstring("linear_backward_gemms_bf16") && ContainsSubstring("shapes do not match"));
}
