// mambamoe_bench: times the device ceilings (copy bandwidth, GEMM rate) and our kernels on the shapes of the GPU
// acceptance criteria, and prints one table. Every figure is a median over repetitions after warm-up, timed
// around Kokkos::fence(); inputs are random (never zeros).
//
//   mambamoe_bench [--out DIR] [--only copy,gemm,ssd,mamba1,mamba3,moe,lm] [--reps N] [--lm-batch B --lm-seqlen L]
//                  [--profile] [--moe-tokens N]   (moe: the issue-5 MoE layer, GEMMs under --lm-ssd's first compute)
//                  [--lm-window W]   (the LM's Mamba-2 layers in windows of W tokens: model.mixer_window)
//                  [--ssd V,..] [--lm-ssd V,..]   V: portable | gemm-C | fused-C, C = fp32 | tf32 | bf16 (SSD variants
//                  timed; the first is the reference the others' outputs are compared with)
//                  [--bc-form automatic|gemm|kernel]   (how the fused backward forms dB and dC: ssd_fused::BcForm,
//                  automatic by default; the ssd and mamba3 cases also time the form not taken)
//                  [--state-terms bf16|tf32]   (the fused backward's state-term GEMMs: ssd_fused::bf16_state_gemms,
//                  bf16 by default; the ssd case also times tf32)
//                  [--qk-store automatic|fp32]   (Mamba-3's rotated q~, k~ for the fused SSD: mamba3 QkStore; the
//                  mamba3 case also times fp32 where automatic stores bf16)
//                  [--dproj-store automatic|fp32]   (how the Mamba-3 backward holds in_proj's output gradient:
//                  DprojStore; the mamba3 case also times fp32 where automatic holds the bf16 copy)
//   mpiexec -n N mambamoe_bench --only lm --cp N ...   (the LM step with every sequence split over N ranks)
//   mpiexec -n N mambamoe_bench --only lm --cp N --backend nccl   (the same over NCCL: device buffers, one GPU per rank)
//
// --profile: after the timings, one more call of each SSD variant (forward, then backward) and one LM step run with
// a fence around every Kokkos kernel and profiling region (the cuBLAS calls are regions), and the time per label
// is printed, largest first (fences add launch gaps, so the sum exceeds the unprofiled time).
// Each case writes "name,metric,value,unit" rows to DIR/ours.csv (the perf script joins them with the peers').
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <set>
#include <sstream>
#include <array>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <map>

#include "core/error.hpp"
#include "core/kokkos_types.hpp"
#include "core/mem_sampler.hpp"
#include "core/pool.hpp"
#include "core/rng.hpp"
#include "model/lm.hpp"
#include "moe/experts.hpp"
#include "moe/moe_layer.hpp"
#include "parallel/grid.hpp"
#include "ssm/mamba1/scan_cuda.hpp"
#include "ssm/mamba1/selective_scan.hpp"
#include "ssm/mamba2/ssd.hpp"
#include "ssm/mamba2/ssd_fused.hpp"
#include "ssm/mamba3/mixer.hpp"
#include "ssm/mamba3/rotate_cuda.hpp"
#include "ssm/mamba3/scan.hpp"
#include "tensor/gemm.hpp"
#include "train/optimizer.hpp"

#if defined(KOKKOS_ENABLE_CUDA)
#include <cuda_runtime.h>
#endif

using namespace mm;

// ------------------------------------------------------------------ --profile: fenced time per kernel label
bool g_profile = false;

namespace kprof {
using clk = std::chrono::steady_clock;
struct Acc {
  double s = 0;
  long n = 0;
};
std::map<std::string, Acc> acc;
std::map<std::uint64_t, std::pair<std::string, clk::time_point>> open;
std::vector<std::pair<std::string, clk::time_point>> regions;
std::uint64_t next_id = 0;
bool on = false;
void begin(const char* name, const std::uint32_t, std::uint64_t* id) {
  if (!on) return;
  Kokkos::fence();
  *id = ++next_id;
  open[*id] = {name, clk::now()};
}
void end(std::uint64_t id) {
  if (!on) return;
  Kokkos::fence();
  auto it = open.find(id);
  if (it == open.end()) return;
  Acc& a = acc[it->second.first];
  a.s += std::chrono::duration<double>(clk::now() - it->second.second).count();
  ++a.n;
  open.erase(it);
}
void push(const char* name) {
  if (!on) return;
  Kokkos::fence();
  regions.push_back({std::string("[region] ") + name, clk::now()});
}
void pop() {
  if (!on || regions.empty()) return;
  Kokkos::fence();
  Acc& a = acc[regions.back().first];
  a.s += std::chrono::duration<double>(clk::now() - regions.back().second).count();
  ++a.n;
  regions.pop_back();
}
// Allocations while profiling, per memory space: count and bytes (device allocations are the synchronising
// cudaMalloc / cudaFree calls an activation arena would remove); buffers taken from the workspace cache
// (core/pool.hpp, labels "pool:...") are counted apart: they allocate nothing. So are zero-byte requests: Kokkos'
// CUDA team launches without level-1 scratch report one each ("Kokkos::CudaSpace::TeamScratchMemory", 0 bytes: an
// empty scratch slot is "allocated" again at every launch, Kokkos_Cuda_Instance.cpp resize_team_scratch_space),
// which holds no memory and is no cudaMalloc/cudaFree pair an arena could remove.
std::map<std::string, std::pair<long, double>> allocs;
std::map<std::string, long> alloc_labels;  // device allocations (not cache takes) by label
void allocate(const Kokkos_Profiling_SpaceHandle h, const char* label, const void*, const uint64_t size) {
  if (!on) return;
  const bool taken = std::string(label).rfind("pool:", 0) == 0;
  if (size == 0 && !taken) {
    ++allocs[std::string(h.name) + " (zero bytes)"].first;
    return;
  }
  auto& a = allocs[std::string(h.name) + (taken ? " (taken from the cache)" : "")];
  ++a.first;
  a.second += double(size);
  if (!taken && std::string(h.name) == mm::Mem::name()) ++alloc_labels[label];
}
clk::time_point copy_start;
void begin_copy(Kokkos_Profiling_SpaceHandle, const char*, const void*, Kokkos_Profiling_SpaceHandle, const char*,
                const void*, uint64_t) {
  if (!on) return;
  Kokkos::fence();
  copy_start = clk::now();
}
void end_copy() {
  if (!on) return;
  Kokkos::fence();
  Acc& a = acc["[deep_copy]"];
  a.s += std::chrono::duration<double>(clk::now() - copy_start).count();
  ++a.n;
}
void install() {
  namespace KT = Kokkos::Tools::Experimental;
  KT::set_allocate_data_callback(allocate);
  KT::set_begin_deep_copy_callback(begin_copy);
  KT::set_end_deep_copy_callback(end_copy);
  KT::set_begin_parallel_for_callback(begin);
  KT::set_end_parallel_for_callback(end);
  KT::set_begin_parallel_reduce_callback(begin);
  KT::set_end_parallel_reduce_callback(end);
  KT::set_begin_parallel_scan_callback(begin);
  KT::set_end_parallel_scan_callback(end);
  KT::set_push_region_callback(push);
  KT::set_pop_region_callback(pop);
  // paused outside report(): with a tool loaded Kokkos does work around every launch even while `on` is false, and
  // the LM step timed 154-159 ms with the callbacks installed against 135-137 ms without (H100, perf/RESULTS.md,
  // thirty-third session), so the timed runs of a --profile run were not those of a plain run
  KT::pause_tools();
}
// Runs f once with every kernel fenced and timed; prints the labels by total time.
template <class F>
void report(const std::string& title, const F& f) {
  Kokkos::fence();
  acc.clear();
  allocs.clear();
  alloc_labels.clear();
  Kokkos::Tools::Experimental::resume_tools();
  on = true;
  const auto t0 = clk::now();
  f();
  Kokkos::fence();
  const double total = std::chrono::duration<double>(clk::now() - t0).count();
  on = false;
  Kokkos::Tools::Experimental::pause_tools();
  std::vector<std::pair<std::string, Acc>> v(acc.begin(), acc.end());
  std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.second.s > b.second.s; });
  std::printf("  profile of %s (fenced, %.2f ms in all):\n", title.c_str(), total * 1e3);
  double all = 0, rest = 0;
  long rest_labels = 0, rest_calls = 0;
  for (const auto& [name, a] : v) {
    all += a.s;
    if (a.s >= 0.002 * total) {
      std::printf("    %-48s %9.3f ms %6ld calls\n", name.c_str(), a.s * 1e3, a.n);
    } else {
      rest += a.s;
      ++rest_labels;
      rest_calls += a.n;
    }
  }
  std::printf("    %-48s %9.3f ms %6ld calls\n", ("(" + std::to_string(rest_labels) + " labels under 0.2 % each)").c_str(),
              rest * 1e3, rest_calls);
  // regions hold cuBLAS calls and a few small kernels, counted in both: the gap is an upper bound's complement
  std::printf("    %-48s %9.3f ms\n", "(outside kernels, regions and copies)", (total - all) * 1e3);
  for (const auto& [space, a] : allocs)
    std::printf("    allocations in %-32s %9ld (%.3f GiB)\n", space.c_str(), a.first, a.second / double(1 << 30));
  std::vector<std::pair<long, std::string>> top;
  for (const auto& [label, n] : alloc_labels) top.emplace_back(n, label);
  std::sort(top.rbegin(), top.rend());
  std::string line;
  for (std::size_t i = 0; i < top.size() && i < 8; ++i) {
    if (i > 0) line += ", ";
    line += top[i].second;
    line += ' ';
    line += std::to_string(top[i].first);
  }
  if (!line.empty()) std::printf("    most frequent device allocations: %s\n", line.c_str());
}
}  // namespace kprof

namespace {

struct Row {
  std::string name, metric;
  double value;
  std::string unit;
};
std::vector<Row> g_rows;

int g_rank = 0;  // with --cp, only rank 0 prints and writes

void record(const std::string& name, const std::string& metric, double value, const std::string& unit) {
  g_rows.push_back({name, metric, value, unit});
  if (g_rank == 0) std::printf("  %-34s %-22s %14.4g %s\n", name.c_str(), metric.c_str(), value, unit.c_str());
  std::fflush(stdout);
}

// Median seconds of `reps` runs of f after `warm` runs.
double time_median(int warm, int reps, const std::function<void()>& f) {
  for (int i = 0; i < warm; ++i) f();
  Kokkos::fence();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    Kokkos::fence();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

template <class V>
void fill(const V& v, std::uint64_t stream, double lo = -1, double hi = 1) {
  using T = typename V::non_const_value_type;
  auto p = v.data();
  const CounterRNG rng{977, stream};
  par_for("bench::fill", index_t(v.span()), KOKKOS_LAMBDA(index_t i) { p[i] = T(rng.uniform(i, lo, hi)); });
  Kokkos::fence();
}

// Times `one` (median of reps after a warm-up) while sampling device memory; records the peak memory and the time
// under `name`, and with --profile the per-kernel profile of one more run. Returns the median in seconds.
double time_with_memory(const std::string& name, int reps, const std::function<void()>& one) {
  double t = 0;
  {
    DeviceMemorySampler mem;
    t = time_median(1, reps, one);
    record(name, "peak device memory", mem.peak_bytes() / double(1 << 30), "GiB");
  }
  record(name, "time", t * 1e3, "ms");
  if (g_profile) kprof::report(name, one);
  return t;
}

// A device view's elements on the host (float), and max |a - b| / max |b| of two such copies: the agreement of two
// variants' outputs that the bench prints.
template <class V>
std::vector<float> to_host(const V& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return std::vector<float>(h.data(), h.data() + h.size());
}
double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::abs(double(a[i]) - double(b[i])));
    den = std::max(den, std::abs(double(b[i])));
  }
  return den > 0 ? num / den : num;
}

// The form of the fused backward's dB and dC other than the one the run's --bc-form takes for groups of hpg heads
// (automatic: the kernel for one head a group), and the row label of a form.
ssd_fused::BcForm other_bc_form(int hpg) {
  return ssd_fused::bc_kernel_for(hpg) ? ssd_fused::BcForm::gemm : ssd_fused::BcForm::kernel;
}
const char* bc_form_label(ssd_fused::BcForm f) {
  return f == ssd_fused::BcForm::kernel ? " (dB, dC: one kernel)" : " (dB, dC: GEMMs)";
}

// The device floors measured in this run (0 when --only leaves them out): the fastest copy's bandwidth and the
// fastest GEMM rate (bf16 on CUDA, fp32 on host builds); kernels report their achieved fraction of them.
double g_copy_tbs = 0, g_gemm_tflops = 0;

// bandwidth and rate of a kernel moving `bytes` and doing `flops` in `t` seconds, and their fractions of the floors
void record_rates(const std::string& name, double bytes, double flops, double t) {
  const double bw = bytes / t / 1e12, rate = flops / t / 1e12;
  record(name, "bandwidth", bw, "TB/s");
  if (flops > 0) record(name, "rate", rate, "TFLOP/s");
  if (g_copy_tbs > 0) record(name, "of measured copy bandwidth", 100.0 * bw / g_copy_tbs, "%");
  if (g_gemm_tflops > 0 && flops > 0) record(name, "of measured GEMM rate", 100.0 * rate / g_gemm_tflops, "%");
}

struct alignas(16) F4 {  // 16 bytes a thread in the vector copy
  float v[4];
};

void bench_copy(int reps) {
  const index_t n = index_t(1) << 29;  // 2 GiB of float
  View1<float> a("a", n), b("b", n);
  fill(a, 1);
  const double t = time_median(3, reps, [&] {
    auto pa = a.data();
    auto pb = b.data();
    par_for("bench::copy", n, KOKKOS_LAMBDA(index_t i) { pb[i] = pa[i]; });
  });
  record("copy (Kokkos 1-D par_for, fp32)", "bandwidth", 2.0 * n * 4 / t / 1e12, "TB/s");
  // the forms our elementwise kernels take: the 2-D par_for (flattened, 32-bit index) over rows of 768, and a 1-D
  // par_for moving a float4 per thread
  const double t3 = time_median(3, reps, [&] {
    auto pa = a.data();
    auto pb = b.data();
    par_for("bench::copy_2d", n / 768, 768, KOKKOS_LAMBDA(index_t i, index_t j) { pb[i * 768 + j] = pa[i * 768 + j]; });
  });
  record("copy (Kokkos 2-D par_for, rows of 768, fp32)", "bandwidth", 2.0 * (n / 768 * 768) * 4 / t3 / 1e12, "TB/s");
  const double t4 = time_median(3, reps, [&] {
    auto pa = reinterpret_cast<const F4*>(a.data());
    auto pb = reinterpret_cast<F4*>(b.data());
    par_for("bench::copy_vec4", n / 4, KOKKOS_LAMBDA(index_t i) { pb[i] = pa[i]; });
  });
  record("copy (Kokkos 1-D par_for, 4 floats a thread)", "bandwidth", 2.0 * n * 4 / t4 / 1e12, "TB/s");
  const double t2 = time_median(3, reps, [&] { Kokkos::deep_copy(b, a); });
  record("copy (Kokkos deep_copy)", "bandwidth", 2.0 * n * 4 / t2 / 1e12, "TB/s");
  g_copy_tbs = 2.0 * n * 4 / std::min(t, t2) / 1e12;
}

template <class T>
void bench_gemm_one(const char* label, index_t m, index_t n, index_t k, int reps) {
  View2<T> A("A", m, k), B("B", k, n), C("C", m, n);
  fill(A, 2);
  fill(B, 3);
  const double t = time_median(3, reps, [&] { gemm(Trans::N, Trans::N, 1.0f, A, B, 0.0f, C); });
  record(label, "rate", 2.0 * m * n * k / t / 1e12, "TFLOP/s");
  g_gemm_tflops = std::max(g_gemm_tflops, 2.0 * m * n * k / t / 1e12);
}

#if defined(KOKKOS_ENABLE_CUDA)
// The LM's largest weight GEMMs (in_proj of d_model 768 -> 3352 at 4 x 8192 tokens: forward, dx, dW) on fp32
// operands in each float arithmetic, bf16 by cuBLAS' internal rounding and by our bf16 copies, and on native bf16
// operands: what the training step's GEMMs can reach.
void bench_gemm_lm(int reps) {
  const index_t T = 32768, d = 768, e = 3352;
  struct Sh {
    const char* name;
    Trans ta, tb;
    index_t m, n, k;
  };
  const Sh shapes[] = {{"fwd x W^T", Trans::N, Trans::T, T, e, d},
                       {"dx = dy W", Trans::N, Trans::N, T, d, e},
                       {"dW = dy^T x", Trans::T, Trans::N, e, d, T}};
  for (const Sh& sh : shapes) {
    const index_t ra = sh.ta == Trans::N ? sh.m : sh.k, ca = sh.ta == Trans::N ? sh.k : sh.m;
    const index_t rb = sh.tb == Trans::N ? sh.k : sh.n, cb = sh.tb == Trans::N ? sh.n : sh.k;
    View2<float> A("A", ra, ca), B("B", rb, cb), C("C", sh.m, sh.n);
    fill(A, 2);
    fill(B, 3);
    const double flop = 2.0 * sh.m * sh.n * sh.k;
    const std::string base = std::string("gemm lm in_proj ") + sh.name;
    struct Mode {
      const char* name;
      GemmCompute c;
      bool cast;
    };
    for (const Mode& md : {Mode{"tf32", GemmCompute::tf32, false}, Mode{"bf16 (cuBLAS rounds)", GemmCompute::bf16, false},
                           Mode{"bf16 (bf16 copies)", GemmCompute::bf16, true}}) {
      const FloatGemmComputeScope scope(md.c);
      const bool cast0 = float_gemm_bf16_cast();
      set_float_gemm_bf16_cast(md.cast);
      const double t = time_median(3, reps, [&] { gemm(sh.ta, sh.tb, 1.0f, A, B, 0.0f, C); });
      set_float_gemm_bf16_cast(cast0);
      record(base + " fp32 operands, " + md.name, "rate", flop / t / 1e12, "TFLOP/s");
    }
    View2<bf16> Ah("Ah", ra, ca), Bh("Bh", rb, cb), Ch("Ch", sh.m, sh.n);
    Kokkos::deep_copy(Ah, bf16(0.5f));
    Kokkos::deep_copy(Bh, bf16(0.25f));
    const double t = time_median(3, reps, [&] { gemm(sh.ta, sh.tb, 1.0f, Ah, Bh, 0.0f, Ch); });
    record(base + " bf16 operands", "rate", flop / t / 1e12, "TFLOP/s");
  }
}
#endif

void bench_gemm(int reps) {
  bench_gemm_one<float>("gemm fp32 8192^3", 8192, 8192, 8192, reps);
#if defined(KOKKOS_ENABLE_CUDA)
  bench_gemm_one<bf16>("gemm bf16 8192^3", 8192, 8192, 8192, reps);
  bench_gemm_lm(reps);
#endif
}

// One SSD configuration: "portable" or "gemm-fp32" / "gemm-tf32" / "gemm-bf16" (the GEMM formulation with that
// GEMM arithmetic; activations are fp32 in every case).
struct SSDVariant {
  SSDAlgo algo;
  GemmCompute compute;
  std::string name;
};
SSDVariant parse_ssd_variant(const std::string& v) {
  if (v == "portable") return {SSDAlgo::portable, GemmCompute::fp32, v};
  if (v.rfind("gemm-", 0) == 0) return {SSDAlgo::gemm, parse_gemm_compute(v.substr(5), "--ssd " + v), v};
  if (v.rfind("fused-", 0) == 0) return {SSDAlgo::fused, parse_gemm_compute(v.substr(6), "--ssd " + v), v};
  throw Error("mambamoe_bench", "--ssd: unknown variant '" + v +
                                    "' (valid: portable, gemm-fp32, gemm-tf32, gemm-bf16, fused-fp32, fused-tf32, "
                                    "fused-bf16)");
}

// The SSD of issue 3: batch 1, length 65,536, 24 heads, headdim 64, d_state 128, one group, chunk 256, fp32
// activations; each variant is timed and checked against the first variant's output on the same inputs.
void bench_ssd(int reps, const std::vector<SSDVariant>& variants) {
  for (std::size_t vi = 0; vi < variants.size(); ++vi) {
    const SSDVariant& var = variants[vi];
    SSDShape s;
    s.algo = var.algo;
    s.compute = var.compute;
    s.batch = 1;
    s.seqlen = 65536;
    s.nheads = 24;
    s.headdim = 64;
    s.ngroups = 1;
    s.dstate = 128;
    s.chunk = 256;
    using T = float;
    const index_t BL = s.batch * s.seqlen, E = s.nheads * s.headdim, GN = s.ngroups * s.dstate;
    View2<T> xbc("xbc", BL, E + 2 * GN), dt("dt", BL, s.nheads), y("y", BL, E), dy("dy", BL, E);
    View2<T> dxbc("dxbc", BL, E + 2 * GN), ddt("ddt", BL, s.nheads);
    View1<float> A_log("A_log", s.nheads), dt_bias("dt_bias", s.nheads), D("D", s.nheads);
    View1<float> dA("dA", s.nheads), ddtb("ddtb", s.nheads), dD("dD", s.nheads);
    fill(xbc, 4);
    fill(dt, 5, -3, 0);
    fill(A_log, 6, 0, 2.7);
    fill(dt_bias, 7, -4, -2);
    fill(D, 8);
    fill(dy, 9);
    SSDIn<T> in;
    in.xbc = xbc;
    in.x_col = 0;
    in.b_col = E;
    in.c_col = E + GN;
    in.dt = dt;
    in.A_log = A_log;
    in.dt_bias = dt_bias;
    in.D = D;
    SSDGrad<T> g;
    g.dxbc = dxbc;
    g.ddt = ddt;
    g.dA_log = dA;
    g.ddt_bias = ddtb;
    g.dD = dD;
    // Bytes a fused kernel must move at least: read x, B, C, dt; write y (forward); backward also reads dy and
    // writes dx, dB, dC, ddt. FLOPs: the chunked algorithm's matrix work (CB, intra-chunk, chunk state, output);
    // forward + backward counted as 3x the forward's (the backward's products are twice the forward's, as for a
    // GEMM; the recomputed forward quantities are not counted).
    const double Q = s.chunk, L = s.seqlen, H = s.nheads, P = s.headdim, N = s.dstate;
    const double fwd_flops = 2 * L * Q * N /*CB, per group*/ + H * (2 * L * Q * P /*intra*/ + 2 * L * P * N * 2);
    const double fwd_bytes = 4.0 * (L * (E + 2 * GN + H) + L * E);
    const double fb_bytes = fwd_bytes + 4.0 * (2 * L * (E + 2 * GN + H) + L * E), fb_flops = 3 * fwd_flops;
    const std::string nf = "ssd fwd " + var.name + " L=65536 H24 P64 N128",
                      nfb = "ssd fwd+bwd " + var.name + " L=65536 H24 P64 N128";
    // the slow portable kernels get fewer repetitions (one call takes ~0.4 s on an H200)
    const int r = var.algo == SSDAlgo::portable ? std::min(reps, 3) : reps;
    const double t_f = time_median(1, r, [&] { ssd_forward<T>(s, in, y, View4<float>()); });
    record(nf, "time", t_f * 1e3, "ms");
    record_rates(nf, fwd_bytes, fwd_flops, t_f);
    // the native kernels run (CUDA, a shape they take): each also timed in its other forms
    const bool kernels = var.algo == SSDAlgo::fused && ssd_fused::fits(int(P), int(N), int(Q));
    if (kernels) {  // each form of the chunk scan (one of them the default above)
      for (auto [f, label] : {std::pair{ssd_fused::Form::wmma, " (chunk scan: WMMA kernel)"},
                              std::pair{ssd_fused::Form::mma, " (chunk scan: mma, operands in registers)"},
                              std::pair{ssd_fused::Form::mma_ring, " (chunk scan: mma, cp.async ring)"}}) {
        const ssd_fused::FormScope form(ssd_fused::scan_form, f);
        record(nf + label, "time", time_median(1, r, [&] { ssd_forward<T>(s, in, y, View4<float>()); }) * 1e3, "ms");
      }
      // the chunk states' other forms (the default is the heads form)
      for (auto [f, label] : {std::pair{ssd_fused::StateForm::tiles, " (chunk states: tiles form)"},
                              std::pair{ssd_fused::StateForm::heads_ring, " (chunk states: heads form, cp.async ring)"}}) {
        const ssd_fused::FormScope form(ssd_fused::state_form, f);
        record(nf + label, "time", time_median(1, r, [&] { ssd_forward<T>(s, in, y, View4<float>()); }) * 1e3, "ms");
      }
    }
    // agreement with the first variant: max |y - y_0| / max |y_0| and the same for dx, dB, dC
    static std::vector<float> y0, dx0;
    // forward + backward as the mixer runs them: the forward keeps its context (Delta, cumsum, S_in, C B^T) for
    // the backward (SSDSaved; nothing for portable); and, recorded apart, a backward that forms it again
    auto fwd_bwd = [&](bool keep) {
      PoolScope pool;
      SSDSaved<T> kept;
      ssd_forward<T>(s, in, y, View4<float>(), keep ? &kept : nullptr, keep ? &pool : nullptr);
      ssd_backward<T>(s, in, dy, View4<const float>(), g, &kept);
    };
    const double t_fb = time_median(1, r, [&] { fwd_bwd(true); });
    record(nfb, "time", t_fb * 1e3, "ms");
    record_rates(nfb, fb_bytes, fb_flops, t_fb);
    if (var.algo != SSDAlgo::portable)
      record(nfb + " (backward recomputing the context)", "time", time_median(1, r, [&] { fwd_bwd(false); }) * 1e3,
             "ms");
    if (kernels) {  // the former WMMA intra-chunk backward
      const ssd_fused::FormScope form(ssd_fused::intra_form, ssd_fused::Form::wmma);
      record(nfb + " (intra-chunk backward: WMMA kernel)", "time", time_median(1, r, [&] { fwd_bwd(true); }) * 1e3,
             "ms");
    }
    if (kernels) {  // the other form of dB and dC (ssd_fused::BcForm; the group of 24 heads is one run here)
      const ssd_fused::FormScope form(ssd_fused::bc_form, other_bc_form(int(s.nheads / s.ngroups)));
      record(nfb + bc_form_label(ssd_fused::bc_form), "time", time_median(1, r, [&] { fwd_bwd(true); }) * 1e3, "ms");
    }
    if (kernels && ssd_bf16_state_terms(s, s.nheads / s.ngroups)) {  // the state terms' other arithmetic
      const ssd_fused::FormScope form(ssd_fused::bf16_state_gemms, false);
      record(nfb + " (state terms: tf32 GEMMs on fp32 copies)", "time",
             time_median(1, r, [&] { fwd_bwd(true); }) * 1e3, "ms");
    }
    if (g_profile) {
      kprof::report(nf, [&] { ssd_forward<T>(s, in, y, View4<float>()); });
      PoolScope pool;
      SSDSaved<T> kept;
      ssd_forward<T>(s, in, y, View4<float>(), &kept, &pool);
      kprof::report("ssd bwd " + var.name + " (from the kept context)",
                    [&] { ssd_backward<T>(s, in, dy, View4<const float>(), g, &kept); });
    }
    Kokkos::fence();
    if (vi == 0) {
      y0 = to_host(y);
      dx0 = to_host(dxbc);
    } else {
      record(nf, "max abs diff of y vs " + variants[0].name + " / max abs y", max_rel_diff(to_host(y), y0), "");
      record(nfb, "max abs diff of dx,dB,dC vs " + variants[0].name + " / max abs", max_rel_diff(to_host(dxbc), dx0),
             "");
    }
  }
}

// Mamba-1 selective scan (issue 4: at least 50 % of the measured copy bandwidth on its bytes), the shape of a
// d_model 768 Mamba-1 layer: batch 4 x 8,192 tokens, d_inner 1,536, d_state 16, one group, with the z gate. Bytes:
// the forward reads u, delta, z (E each) and B, C (N each) per token and writes the output (E); the backward also
// reads dout and writes du, ddelta, dz, dB, dC (the checkpoints, N E per chunk, are not counted).
void bench_mamba1(int reps, index_t batch, index_t seqlen) {
  SelScanShape s;
  s.batch = batch;
  s.seqlen = seqlen;
  s.dinner = 1536;
  s.ngroups = 1;
  s.dstate = 16;
  s.chunk = 256;
  using T = float;
  const index_t BL = s.batch * s.seqlen, E = s.dinner, N = s.dstate;
  View2<T> u("u", BL, E), delta("delta", BL, E), z("z", BL, E), bc("bc", BL, 2 * N), out("out", BL, E),
      dout("dout", BL, E), du("du", BL, E), ddelta("ddelta", BL, E), dz("dz", BL, E), dbc("dbc", BL, 2 * N);
  View2<float> A("A", E, N), dA("dA", E, N);
  View1<float> D("D", E), dbias("delta_bias", E), dD("dD", E), ddbias("ddelta_bias", E);
  fill(u, 21);
  fill(delta, 22, -4, -1);
  fill(z, 23);
  fill(bc, 24);
  fill(A, 25, -2, -0.1);
  fill(D, 26);
  fill(dbias, 27, -1, 0);
  fill(dout, 28);
  SelScanIn<T> in;
  in.u = u;
  in.delta = delta;
  in.bc = bc;
  in.b_col = 0;
  in.c_col = N;
  in.z = z;
  in.A = A;
  in.D = D;
  in.delta_bias = dbias;
  SelScanGrad<T> g;
  g.du = du;
  g.ddelta = ddelta;
  g.dbc = dbc;
  g.dz = dz;
  g.dA = dA;
  g.dD = dD;
  g.ddelta_bias = ddbias;
  const View3<float> ck = selective_scan_alloc_checkpoints<T>(s);
  const double L = double(BL), fwd_bytes = 4.0 * L * (4.0 * E + 2.0 * N);
  const double bwd_bytes = fwd_bytes + 4.0 * L * (4.0 * E + 2.0 * N);
  const std::string shape = std::to_string(batch) + "x" + std::to_string(seqlen);
  const std::string nf = "mamba1 scan fwd " + shape + " E1536 N16", nb = "mamba1 scan fwd+bwd " + shape + " E1536 N16";
  const double t_f = time_median(1, reps, [&] { selective_scan_forward<T>(s, in, out, View3<float>(), ck); });
  record(nf, "time", t_f * 1e3, "ms");
  record_rates(nf, fwd_bytes, 0, t_f);
  if (selective_scan_native_forward<T>(s, in)) {  // the portable passes on the same inputs, side by side
    for (int v = 1; v <= mamba1_cuda::kVariants; ++v) {  // and each variant of the native kernel
      SelScanShape sv = s;
      sv.native_variant = v;
      const std::string nv = "mamba1 scan fwd native " + std::string(mamba1_cuda::variant_name(v)) + " " + shape +
                             " E1536 N16";
      const double t_v = time_median(1, reps, [&] { selective_scan_forward<T>(sv, in, out, View3<float>(), ck); });
      record(nv, "time", t_v * 1e3, "ms");
      record_rates(nv, fwd_bytes, 0, t_v);
    }
    SelScanShape sp = s;
    sp.native = false;
    const std::string np = "mamba1 scan fwd portable " + shape + " E1536 N16";
    const double t_p = time_median(1, reps, [&] { selective_scan_forward<T>(sp, in, out, View3<float>(), ck); });
    record(np, "time", t_p * 1e3, "ms");
    record_rates(np, fwd_bytes, 0, t_p);
  }
  const double t_fb = time_median(1, reps, [&] {
    selective_scan_forward<T>(s, in, out, View3<float>(), ck);
    selective_scan_backward<T>(s, in, dout, View3<const float>(), ck, g);
  });
  record(nb, "time", t_fb * 1e3, "ms");
  record_rates(nb, bwd_bytes, 0, t_fb);
  if (mamba1_cuda::compiled() && mamba1_cuda::backward_fits(s.dinner, s.dstate, s.dinner / s.ngroups, s.chunk)) {
    SelScanShape sn = s;  // the backward's chunk passes on the portable kernels, for comparison
    sn.native_backward = false;
    const std::string nn = "mamba1 scan fwd+bwd portable bwd " + shape + " E1536 N16";
    const double t_n = time_median(1, reps, [&] {
      selective_scan_forward<T>(sn, in, out, View3<float>(), ck);
      selective_scan_backward<T>(sn, in, dout, View3<const float>(), ck, g);
    });
    record(nn, "time", t_n * 1e3, "ms");
    record_rates(nn, bwd_bytes, 0, t_n);
  }
  if (g_profile) {
    kprof::report(nf, [&] { selective_scan_forward<T>(s, in, out, View3<float>(), ck); });
    kprof::report("mamba1 scan bwd", [&] { selective_scan_backward<T>(s, in, dout, View3<const float>(), ck, g); });
  }
}

// Mamba-3 SISO block (issue 4): d_model 768, d_state 128, headdim 64, expand 2, chunk 64, batch 8 x 8,192; the
// mixer's forward (in_proj, scan, gate, out_proj) and backward, fp32 activations, per --lm-ssd variant: the scan
// through that SSD algorithm (SISO runs on the SSD kernels; portable: the Mamba-3 scan's own kernels) and the
// layer GEMMs in that variant's arithmetic.
void bench_mamba3(int reps, const SSDVariant& var, index_t batch, index_t seqlen) {
  const GemmCompute compute = var.compute;
  set_float_gemm_compute(compute);
  Mamba3Config cfg;
  cfg.scan_algo = var.algo;
  cfg.scan_compute = var.compute;
  cfg.d_model = 768;
  cfg.d_state = 128;
  cfg.headdim = 64;
  cfg.expand = 2;
  cfg.chunk_size = 64;
  ParamStore<float> ps;
  Mamba3Mixer<float> mixer(cfg, ps, "m3.", 1);
  ps.allocate();
  ps.initialize(3);
  const index_t n = batch * seqlen, D = cfg.d_model;
  View2<float> u("u", n, D), out("out", n, D), dout("dout", n, D), du("du", n, D);
  fill(u, 31);
  fill(dout, 32);
  const std::string shape = std::to_string(batch) + "x" + std::to_string(seqlen);
  const std::string name = "mamba3 siso block fwd+bwd " + shape + " d768 N128 P64 chunk64, " + var.name;
  Mamba3Acts<float> acts;
  const double t_f = time_median(1, reps, [&] { mixer.forward(u, batch, seqlen, out, acts, false); });
  record("mamba3 siso block fwd " + shape + " d768 N128 P64 chunk64, " + var.name, "time", t_f * 1e3, "ms");
  auto one = [&] {
    ps.zero_grads();
    mixer.forward(u, batch, seqlen, out, acts, true);
    mixer.backward(acts, batch, seqlen, dout, du);
  };
  time_with_memory(name, reps, one);
  // the step again with one ssd_fused form `which` set to `form` (named `other`; with `fwd_other` the forward timed
  // too), and how far its du and parameter gradients are from the form above
  auto time_other = [&](auto& which, auto form, const std::string& other, const std::string& fwd_other) {
    one();
    Kokkos::fence();
    const std::vector<float> du0 = to_host(du), g0 = to_host(ps.grads());
    const ssd_fused::FormScope scope(which, form);
    if (!fwd_other.empty())
      record(fwd_other, "time",
             time_median(1, reps, [&] { mixer.forward(u, batch, seqlen, out, acts, false); }) * 1e3, "ms");
    time_with_memory(other, reps, one);
    one();
    Kokkos::fence();
    record(other, "du: max diff / max |du| of the other form", max_rel_diff(to_host(du), du0), "");
    record(other, "parameter gradients: max diff / max of the other form", max_rel_diff(to_host(ps.grads()), g0),
           "");
  };
  // where the fused forward takes the sequential kernel (ssd_fused::FwdForm; automatic: batch x heads fill the
  // SMs), the same with the chunked kernels, side by side
  if (var.algo == SSDAlgo::fused && ssd_fused::fwd_form != ssd_fused::FwdForm::chunks &&
      ssd_fused::seq_fits(int(cfg.headdim), int(cfg.d_state), int(cfg.chunk_size))) {
    const std::string suffix = " (SSD forward: chunked kernels)";
    time_other(ssd_fused::fwd_form, ssd_fused::FwdForm::chunks, name + suffix,
               "mamba3 siso block fwd " + shape + " d768 N128 P64 chunk64, " + var.name + suffix);
  }
  // where the fused backward walks each row's chunks back (ssd_fused::BwdStateForm: state_bwd_seq, or dstates_seq
  // and the state epilogue), the same with the other forms, side by side
  if (var.algo == SSDAlgo::fused && ssd_fused::bwd_state_form != ssd_fused::BwdStateForm::chunks &&
      ssd_fused::dseq_fits(int(cfg.headdim), int(cfg.d_state), int(cfg.chunk_size))) {
    using F = ssd_fused::BwdStateForm;
    time_other(ssd_fused::bwd_state_form, F::chunks, name + " (backward state terms: chunked kernels)", "");
    if (ssd_fused::bwd_state_form != F::dstates)
      time_other(ssd_fused::bwd_state_form, F::dstates, name + " (backward state terms: dstates_seq + epilogue)", "");
  }
  // where the rotation backward takes its native kernel (rotate_cuda.hpp), the same with its Kokkos form
  if (rot_bwd_form == RotBwdForm::automatic &&
      mamba3_cuda::rotate_fits(int(cfg.d_state), cfg.pairing() == RopePairing::halved))
    time_other(rot_bwd_form, RotBwdForm::kokkos, name + " (rotation backward: Kokkos kernel)", "");
  // the same for the rotation forward (mamba3_cuda::rotate_fwd against the Kokkos form), the forward timed too
  if (rot_fwd_form == RotFwdForm::automatic &&
      mamba3_cuda::rotate_fits(int(cfg.d_state), cfg.pairing() == RopePairing::halved))
    time_other(rot_fwd_form, RotFwdForm::kokkos, name + " (rotation forward: Kokkos kernel)",
               "mamba3 siso block fwd " + shape + " d768 N128 P64 chunk64, " + var.name +
                   " (rotation forward: Kokkos kernel)");
  // where the rotation stores q~ and k~ in bf16 for the SSD (mamba3_qk_bf16; the quad kernels' rows, which this
  // layer's widths give), the same with them in fp32
  if (qk_store == QkStore::automatic && mamba3_qk_bf16(mixer.scan_shape(batch, seqlen), true, true))
    time_other(qk_store, QkStore::fp32, name + " (q~, k~ stored in fp32)",
               "mamba3 siso block fwd " + shape + " d768 N128 P64 chunk64, " + var.name + " (q~, k~ stored in fp32)");
  // where the backward holds in_proj's output gradient only as its bf16 copy (Mamba3Mixer::bf16_in_proj_grad), the
  // same with it in fp32 (the same GEMM operands: du and the gradients equal)
  if (mixer.bf16_in_proj_grad()) time_other(dproj_store, DprojStore::fp32, name + " (dproj in fp32)", "");
  // the native kernels run (CUDA, a shape they take): the backward's dB and dC (one head a group here) also in the
  // other ssd_fused::BcForm (--bc-form picks the one above)
  if (var.algo == SSDAlgo::fused && ssd_fused::fits(int(cfg.headdim), int(cfg.d_state), int(cfg.chunk_size)))
    time_other(ssd_fused::bc_form, other_bc_form(1), name + bc_form_label(other_bc_form(1)), "");
}

// MoE layer (issue 5): 65,536 tokens, d_model 768, 8 SwiGLU experts of d_ff 2,048, top-1 and top-2, softmax
// router, dropless; fp32 activations with every GEMM (router excluded: fp32 logits) under `compute`; under bf16 the
// layer takes its bf16 expert path (moe/experts.hpp: bf16 expert inputs, weights and intermediates, fp32
// accumulation). Times the layer's forward and forward + backward, and the expert GEMMs alone, each as our grouped
// GEMM over 8 equal groups against one dense GEMM of the same total size in the same arithmetic (the issue's "at
// least 70 % of the dense rate"): fp32 / tf32: W1 (x W1^T per expert) on fp32 data; bf16: the bf16 path's two
// forward products, h13 = xp W13^T (bf16 operands and output, n = 2 d_ff) and y = a W2^T (fp32 output), against a
// dense GEMM with bf16 operands and the same output type.
void bench_moe(int reps, GemmCompute compute, index_t tokens) {
  set_float_gemm_compute(compute);
  const bool b16 = compute == GemmCompute::bf16;
  const std::string cname = std::string(gemm_compute_name(compute)) + (b16 ? " (bf16 expert path)" : "");
  for (index_t k : {1, 2}) {
    MoEConfig cfg;
    cfg.d_model = 768;
    cfg.n_experts = 8;
    cfg.d_ff = 2048;
    cfg.top_k = k;
    ParamStore<float> ps;
    MoELayer<float> layer(cfg, ps, "moe.", 1);
    ps.allocate();
    ps.initialize(5);
    const index_t D = cfg.d_model;
    View2<float> x("x", tokens, D), out("out", tokens, D), dout("dout", tokens, D), dx("dx", tokens, D);
    fill(x, 41);
    fill(dout, 42);
    const std::string shape = std::to_string(tokens) + " tok d768 ff2048 E8 top" + std::to_string(k) + ", " + cname;
    MoEActs<float> acts;
    const double t_f = time_median(1, reps, [&] { layer.forward(x, out, acts, false); });
    record("moe layer fwd " + shape, "time", t_f * 1e3, "ms");
    auto one = [&] {
      ps.zero_grads();
      layer.forward(x, out, acts, true);
      layer.backward(acts, dout, dx);
    };
    const std::string name = "moe layer fwd+bwd " + shape;
    time_with_memory(name, reps, one);
  }
  // the expert GEMM rate: k = 1's rows in 8 equal groups against one GEMM of the same total size
  const index_t E = 8, D = 768, F = 2048;
  std::vector<index_t> off(E + 1);
  for (index_t e = 0; e <= E; ++e) off[e] = tokens * e / E;
  auto rates = [&](const std::string& gname, double flops, double t_g, double t_d) {
    record(gname, "rate", flops / t_g / 1e12, "TFLOP/s");
    record(gname, "dense rate, same size", flops / t_d / 1e12, "TFLOP/s");
    record(gname, "of the dense rate", 100.0 * t_d / t_g, "%");
  };
  if (!b16) {
    View2<float> xp("xp", tokens, D), h("h", tokens, F), w("w", E * F, D);
    fill(xp, 43);
    fill(w, 44);
    const double flops = 2.0 * double(tokens) * double(D) * double(F);
    const double t_g = time_median(3, reps, [&] {
      grouped_gemm<float>(Trans::T, 1.0f, xp, w.data(), F, D, 0.0f, h, off);
    });
    const UView2<const float> w0(w.data(), F, D);
    const double t_d = time_median(3, reps, [&] { gemm(Trans::N, Trans::T, 1.0f, xp, w0, 0.0f, h); });
    rates("moe expert GEMM " + std::to_string(tokens) + "x768x2048 in 8 groups, " + cname, flops, t_g, t_d);
    return;
  }
  // bf16 path: operands in bf16 storage, filled from uniform fp32 values
  View1<bf16_op_t> xp("xp16", tokens * D), w13("w13_16", E * 2 * F * D), h13("h13_16", tokens * 2 * F),
      a("a16", tokens * F), w2("w2_16", E * D * F);
  auto fill16 = [](const View1<bf16_op_t>& v, std::uint64_t stream) {
    View1<float> f32("bench::fill16", v.extent(0));
    fill(f32, stream);
    auto vv = v;
    par_for("bench::to_bf16", index_t(v.extent(0)), KOKKOS_LAMBDA(index_t i) { vv(i) = to_bf16_op(f32(i)); });
    Kokkos::fence();
  };
  fill16(xp, 43);
  fill16(w13, 44);
  fill16(a, 45);
  fill16(w2, 46);
  View2<float> y("y", tokens, D);
  {  // h13 = xp W13_g^T: (tokens, 2F, D), bf16 out
    const double flops = 2.0 * double(tokens) * double(D) * double(2 * F);
    const double t_g = time_median(3, reps, [&] {
      grouped_gemm_bf16_b16(Trans::T, 1.0f, xp.data(), D, w13.data(), 2 * F, D, 0.0f, h13.data(), 2 * F, off);
    });
    const double t_d = time_median(3, reps, [&] {
      gemm_bf16_b16(Trans::N, Trans::T, tokens, 2 * F, D, 1.0f, xp.data(), D, w13.data(), D, 0.0f, h13.data(), 2 * F);
    });
    rates("moe expert GEMM h13 " + std::to_string(tokens) + "x768x4096 in 8 groups, bf16 op, bf16 out", flops, t_g,
          t_d);
  }
  {  // y = a W2_g^T: (tokens, D, F), fp32 out
    const double flops = 2.0 * double(tokens) * double(D) * double(F);
    const double t_g = time_median(3, reps, [&] {
      grouped_gemm_bf16_f32(Trans::T, 1.0f, a.data(), F, w2.data(), D, F, 0.0f, y.data(), D, off);
    });
    const double t_d = time_median(3, reps, [&] {
      gemm_bf16_f32(Trans::N, Trans::T, tokens, D, F, 1.0f, a.data(), F, w2.data(), F, 0.0f, y.data(), D);
    });
    rates("moe expert GEMM y " + std::to_string(tokens) + "x2048x768 in 8 groups, bf16 op, fp32 out", flops, t_g,
          t_d);
  }
}

// Training step of the issue-3 LM: 24 layers, d_model 768, d_state 128, headdim 64, expand 2, vocab 16, AdamW.
// With cp > 1 (run under mpiexec with cp ranks, one GPU each): every sequence is split over the cp ranks, the
// parameter gradients are all-reduced over them as the trainer does; the rows report per-rank memory, the whole
// sequence's tokens/s, and the bytes each rank sent per step beyond the gradient all-reduce (state passing, conv
// halos, loss sums).
void bench_lm(index_t batch, index_t seqlen, int reps, int cp_size, parallel::Backend backend,
              const SSDVariant& ssd, index_t window, Recompute policy) {
  // the previous runs' cached workspace blocks go back to the device, so that the peak below is this run's
  Kokkos::fence();
  pool_trim();
  LMConfig cfg;
  cfg.mixer.window = window;
  cfg.mixer.ssd_algo = ssd.algo;
  cfg.mixer.ssd_compute = ssd.compute;
  set_float_gemm_compute(ssd.compute);  // the layers' weight GEMMs in the same arithmetic
  cfg.vocab_size = 16;
  cfg.n_layer = 24;
  cfg.mixer.d_model = 768;
  cfg.mixer.d_state = 128;
  cfg.mixer.headdim = 64;
  cfg.mixer.expand = 2;
  cfg.mixer.chunk = 256;
  std::shared_ptr<parallel::ProcessGrid> grid;
  parallel::ModelComms comms;
  if (cp_size > 1) {
    parallel::Layout l;
    l.cp = cp_size;
    grid = std::make_shared<parallel::ProcessGrid>(l, MPI_COMM_WORLD, backend);
    comms = grid->model_comms();
  }
  const parallel::Comm& cp = *comms.cp;
  MambaLM<float> lm(cfg, comms);
  lm.initialize(1);
  AdamWConfig ocfg;
  AdamW<float> opt(lm.params(), ocfg);
  Batch b;
  b.batch = batch;
  b.seqlen = seqlen;
  b.tokens = Kokkos::View<std::int32_t*, Layout, Mem>("tokens", batch * seqlen);
  b.targets = Kokkos::View<std::int32_t*, Layout, Mem>("targets", batch * seqlen);
  {
    auto tk = b.tokens;
    auto tg = b.targets;
    const CounterRNG rng{5, 11};
    par_for("bench::tokens", batch * seqlen, KOKKOS_LAMBDA(index_t i) {
      tk[i] = std::int32_t(rng.below(i, 4));
      tg[i] = std::int32_t(rng.below(i + 7, 4));
    });
  }
  const std::string name = "lm train step fp32 act, " + ssd.name + " " + std::to_string(batch) + "x" + std::to_string(seqlen) +
                           (cp_size > 1 ? " cp" + std::to_string(cp_size) : "") +
                           (cp_size > 1 && backend == parallel::Backend::nccl ? " nccl" : "") +
                           (window > 0 ? " window " + std::to_string(window) : "") +
                           (policy == Recompute::none ? " keep all" : " recompute mixer") +
                           (ssd_fused::bc_kernel_for(int(cfg.mixer.nheads() / cfg.mixer.ngroups))
                                ? bc_form_label(ssd_fused::BcForm::kernel)
                                : "");
  record(name, "parameters", double(lm.params().count()) / 1e6, "M");
  std::int64_t step = 0;
  auto one = [&] {
    lm.params().zero_grads();
    lm.forward_backward(b, 1.0 / double(batch * seqlen), policy);
    if (cp.size() > 1) cp.allreduce_sum(lm.params().grads());
    opt.step(lm.params(), 1e-4, ++step);
  };
  one();  // warm
  Kokkos::fence();
  const double t = time_with_memory(name, reps, one);
  record(name, "throughput", double(batch * seqlen) / t / 1e3, "k tokens/s");
  const double flops = 6.0 * double(lm.params().count()) * double(batch * seqlen);
  record(name, "model FLOP rate (6 N T)", flops / t / 1e12, "TFLOP/s");
  // MFU against the H200's dense bf16 tensor-core peak (989 TFLOP/s, NVIDIA's data sheet), the convention of
  // training reports; compare with the measured cuBLAS rate of `--only gemm` for what is reachable.
  record(name, "MFU (6 N T over 989 TFLOP/s)", 100.0 * flops / t / 989e12, "%");
  if (g_gemm_tflops > 0) record(name, "6 N T rate of measured GEMM rate", 100.0 * flops / t / 1e12 / g_gemm_tflops, "%");
  if (cp.size() > 1) {
    cp.reset_bytes_sent();
    one();
    const double grads = 4.0 * double(lm.params().grads().extent(0));
    record(name, "cp bytes sent per step beyond the gradient all-reduce", double(cp.bytes_sent()) - grads, "B");
    record(name, "cp bytes per layer per step beyond the gradient all-reduce",
           (double(cp.bytes_sent()) - grads) / double(cfg.n_layer), "B");
  }
}

// The position of `value` among the choices of option `opt`, or -1 after saying which they are.
int choice(const char* opt, const std::string& value, std::initializer_list<const char*> choices) {
  int i = 0;
  for (const char* c : choices) {
    if (value == c) return i;
    ++i;
  }
  std::cerr << "mambamoe_bench: " << opt << " " << value << " is not one of:";
  for (const char* c : choices) std::cerr << ' ' << c;
  std::cerr << '\n';
  return -1;
}

}  // namespace

int run(int argc, char** argv, int cp_size, int rank);

int main(int argc, char** argv) {
  int cp_size = 1;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--cp") cp_size = std::stoi(argv[i + 1]);
  if (cp_size > 1) MPI_Init(&argc, &argv);
  int rank = 0;
  if (cp_size > 1) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int rc = run(argc, argv, cp_size, rank);
  if (cp_size > 1) MPI_Finalize();
  return rc;
}

int run(int argc, char** argv, int cp_size, int rank) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  g_rank = rank;
  std::string out = ".", only = "copy,gemm,ssd,lm";
  int reps = 10;
  index_t lm_batch = 4, lm_seqlen = 8192, lm_window = 0;
  index_t m1_batch = 4, m3_batch = 8, m_seqlen = 8192;  // the Mamba-1 scan and Mamba-3 block shapes (issue 4)
  index_t moe_tokens = 65536;                             // the MoE layer's tokens (issue 5)
  parallel::Backend backend = parallel::Backend::mpi;
  // the defaults time the SSD's formulations against the fp32 GEMM one, among them fused-bf16 (Mamba-2's CUDA
  // default: the fused kernels, bf16 GEMMs and state terms), and the LM step in that configuration
  std::string ssd_list = "gemm-fp32,gemm-tf32,fused-tf32,fused-bf16,gemm-bf16,portable", lm_ssd = "fused-bf16",
              lm_recompute = "mixer";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::cerr << "mambamoe_bench: " << a << " needs a value\n";
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--out") out = next();
    else if (a == "--only") only = next();
    else if (a == "--reps") reps = std::stoi(next());
    else if (a == "--lm-batch") lm_batch = std::stoll(next());
    else if (a == "--lm-seqlen") lm_seqlen = std::stoll(next());
    else if (a == "--lm-window") lm_window = std::stoll(next());
    else if (a == "--mamba-seqlen") m_seqlen = std::stoll(next());
    else if (a == "--mamba-batch") m1_batch = m3_batch = std::stoll(next());
    else if (a == "--moe-tokens") moe_tokens = std::stoll(next());
    else if (a == "--cp") next();
    else if (a == "--ssd") ssd_list = next();
    else if (a == "--profile") g_profile = true;
    else if (a == "--lm-ssd") lm_ssd = next();
    else if (a == "--lm-recompute") lm_recompute = next();
    else if (a == "--state-terms") {  // the fused backward's state-term GEMMs (ssd_fused::bf16_state_gemms)
      const int k = choice("--state-terms", next(), {"bf16", "tf32"});
      if (k < 0) return 2;
      ssd_fused::bf16_state_gemms = k == 0;
    }
    else if (a == "--qk-store") {  // how Mamba-3's rotation stores q~, k~ for the fused SSD (QkStore)
      const int k = choice("--qk-store", next(), {"automatic", "fp32"});
      if (k < 0) return 2;
      qk_store = k == 0 ? QkStore::automatic : QkStore::fp32;
    }
    else if (a == "--dproj-store") {  // how the Mamba-3 backward holds in_proj's output gradient (DprojStore)
      const int k = choice("--dproj-store", next(), {"automatic", "fp32"});
      if (k < 0) return 2;
      dproj_store = k == 0 ? DprojStore::automatic : DprojStore::fp32;
    }
    else if (a == "--bc-form") {  // how every fused backward in the run forms dB and dC (ssd_fused::BcForm)
      using F = ssd_fused::BcForm;
      const int k = choice("--bc-form", next(), {"automatic", "gemm", "kernel"});
      if (k < 0) return 2;
      ssd_fused::bc_form = std::array{F::automatic, F::gemm, F::kernel}[k];
    }
    else if (a == "--state-form") {  // the fused forward's chunk-state kernel for the whole run (ssd_fused::StateForm)
      using F = ssd_fused::StateForm;
      const int k = choice("--state-form", next(), {"heads", "tiles", "heads-ring"});
      if (k < 0) return 2;
      ssd_fused::state_form = std::array{F::heads, F::tiles, F::heads_ring}[k];
    }
    else if (a == "--fwd-form") {  // the fused SSD forward's form for the whole run (ssd_fused::FwdForm)
      using F = ssd_fused::FwdForm;
      const int k = choice("--fwd-form", next(), {"automatic", "chunks", "sequential"});
      if (k < 0) return 2;
      ssd_fused::fwd_form = std::array{F::automatic, F::chunks, F::sequential}[k];
    }
    else if (a == "--bwd-state-form") {  // the fused SSD backward's state-term form for the run (BwdStateForm)
      using F = ssd_fused::BwdStateForm;
      const int k = choice("--bwd-state-form", next(), {"automatic", "chunks", "dstates", "sequential"});
      if (k < 0) return 2;
      ssd_fused::bwd_state_form = std::array{F::automatic, F::chunks, F::dstates, F::sequential}[k];
    }
    else if (a == "--backend") {
      const int k = choice("--backend", next(), {"mpi", "nccl"});
      if (k < 0) return 2;
      backend = k == 1 ? parallel::Backend::nccl : parallel::Backend::mpi;
    }
    else {
      std::cerr << "mambamoe_bench: unknown option " << a
                << " (known: --out DIR, --only copy,gemm,ssd,mamba1,mamba3,moe,lm, --reps N, --lm-batch B, --lm-seqlen L, --lm-window W, --mamba-batch B, --mamba-seqlen L, --moe-tokens N, --cp N, --backend mpi|nccl, --ssd V1,V2,.., --lm-ssd V1,.., --lm-recompute mixer,none, --bc-form gemm|kernel, --state-terms bf16|tf32, --state-form heads|tiles|heads-ring, --fwd-form automatic|chunks|sequential, --bwd-state-form automatic|chunks|dstates|sequential; V: portable, gemm-C, fused-C with C = fp32, tf32, bf16)\n";
      return 2;
    }
  }
  std::set<std::string> want;
  {
    std::stringstream ss(only);
    for (std::string w; std::getline(ss, w, ',');) want.insert(w);
  }
  if (g_profile) kprof::install();
  if (rank == 0) std::printf("mambamoe_bench on %s, gemm backend %s\n", Exec::name(), gemm_backend_name());
  try {
    if (want.count("copy")) bench_copy(reps);
    if (want.count("gemm")) bench_gemm(reps);
    auto variants = [](const std::string& list) {
      std::vector<SSDVariant> v;
      std::stringstream ss(list);
      for (std::string w; std::getline(ss, w, ',');) v.push_back(parse_ssd_variant(w));
      return v;
    };
    if (want.count("ssd")) bench_ssd(reps, variants(ssd_list));
    // (at most 5 repetitions: the portable Mamba-1 and Mamba-3 kernels take up to seconds per call)
    if (want.count("mamba1")) bench_mamba1(std::min(reps, 5), m1_batch, m_seqlen);
    if (want.count("mamba3"))
      for (const SSDVariant& v : variants(lm_ssd)) bench_mamba3(std::min(reps, 5), v, m3_batch, m_seqlen);
    if (want.count("moe")) bench_moe(reps, variants(lm_ssd).front().compute, moe_tokens);
    if (want.count("lm")) {
      std::vector<Recompute> policies;
      std::stringstream ss(lm_recompute);
      for (std::string w; std::getline(ss, w, ',');) {
        if (w != "mixer" && w != "none") throw std::runtime_error("--lm-recompute " + w + " is not one of: mixer none");
        policies.push_back(w == "none" ? Recompute::none : Recompute::mixer);
      }
      for (Recompute pol : policies)
        for (const auto& v : variants(lm_ssd))
          bench_lm(lm_batch, lm_seqlen, std::max(3, reps / 3), cp_size, backend, v, lm_window, pol);
    }
  } catch (const std::exception& e) {
    std::cerr << "mambamoe_bench: " << e.what() << "\n";
    return 1;
  }
  if (rank != 0) return 0;
  std::ofstream f(out + "/ours.csv");
  f << "name,metric,value,unit\n";
  for (const auto& r : g_rows) f << '"' << r.name << "\"," << r.metric << ',' << r.value << ',' << r.unit << '\n';
  return 0;
}
