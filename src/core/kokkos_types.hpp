// The one header that owns the Kokkos types of mambamoe: execution and memory spaces, View aliases, the bf16
// alias, and the labelled parallel-dispatch wrappers every kernel launch goes through. Model and layer code never
// spells Kokkos::View<...> or Kokkos::parallel_for by hand.
#pragma once

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>

namespace mm {

// ------------------------------------------------------------------ spaces
using Exec = Kokkos::DefaultExecutionSpace;
using Mem = Exec::memory_space;
using HostExec = Kokkos::DefaultHostExecutionSpace;
using HostMem = Kokkos::HostSpace;
using Layout = Kokkos::LayoutRight;  // row-major: the last index is contiguous
using Team = Kokkos::TeamPolicy<Exec>::member_type;

// 64-bit index everywhere a product of extents may exceed 2^31 (10^6 tokens times d_inner does).
using index_t = std::int64_t;

// bf16 storage type for device activations and GEMM operands.
using bf16 = Kokkos::Experimental::bhalf_t;

// Accumulation type: fp32 for fp32/bf16 data, double for double data.
template <class T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// ------------------------------------------------------------------ views (device / default space)
template <class T>
using View1 = Kokkos::View<T*, Layout, Mem>;
template <class T>
using View2 = Kokkos::View<T**, Layout, Mem>;
template <class T>
using View3 = Kokkos::View<T***, Layout, Mem>;
template <class T>
using View4 = Kokkos::View<T****, Layout, Mem>;
template <class T>
using View5 = Kokkos::View<T*****, Layout, Mem>;

// Unmanaged views over memory owned elsewhere (parameter slices of one flat buffer, arena slices).
using Unmanaged = Kokkos::MemoryTraits<Kokkos::Unmanaged>;
template <class T>
using UView1 = Kokkos::View<T*, Layout, Mem, Unmanaged>;
template <class T>
using UView2 = Kokkos::View<T**, Layout, Mem, Unmanaged>;

// Host views (I/O, checkpoints, references in tests).
template <class T>
using HostView1 = Kokkos::View<T*, Layout, HostMem>;
template <class T>
using HostView2 = Kokkos::View<T**, Layout, HostMem>;
// A host array seen as a view (e.g. a std::vector's data): a deep_copy to or from a device view without a mirror.
template <class T>
using HostUView1 = Kokkos::View<T*, Layout, HostMem, Unmanaged>;

// Team scratch (shared memory on GPUs, stack-like scratch on CPUs).
using ScratchMem = Exec::scratch_memory_space;
template <class T>
using Scratch1 = Kokkos::View<T*, ScratchMem, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
template <class T>
using Scratch2 = Kokkos::View<T**, Layout, ScratchMem, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

// Loop unrolling hints that every compiler of the project understands (nvcc's `unroll`, GCC's `GCC unroll`).
#if defined(__CUDACC__)
#define MM_UNROLL _Pragma("unroll")
#define MM_UNROLL4 _Pragma("unroll 4")
#else
#define MM_UNROLL _Pragma("GCC unroll 16")
#define MM_UNROLL4 _Pragma("GCC unroll 4")
#endif

// Whether p is 16-byte aligned (a 16-byte access may start there).
inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }
// Whether rows of floats at these (first row, row stride in floats) pairs can be read as float4: every first row
// 16-byte aligned and every stride a multiple of 4.
inline bool float4_rows(std::initializer_list<std::pair<const void*, long long>> rows) {
  for (const auto& [p, ld] : rows)
    if (!aligned16(p) || ld % 4 != 0) return false;
  return true;
}

// Four consecutive floats at a 16-byte aligned address: one 16-byte load or store in CUDA device code, element by
// element elsewhere. A Kokkos loop moving one 4-byte value per thread ran near 1.7 TB/s on an H200 (a 1-D copy:
// 1.67 TB/s; 4.15 TB/s with 16 bytes a thread, as deep_copy's 4.16; perf/RESULTS.md).
struct alignas(16) Float4 {
  float v[4];
};
KOKKOS_INLINE_FUNCTION Float4 load_f4(const float* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const Float4*>(p);
#else
  return Float4{{p[0], p[1], p[2], p[3]}};
#endif
}
KOKKOS_INLINE_FUNCTION void store_f4(float* p, const Float4& q) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<Float4*>(p) = q;
#else
  for (int k = 0; k < 4; ++k) p[k] = q.v[k];
#endif
}

// The float whose bits are the bf16 value h (bf16 is the top half of a float).
KOKKOS_INLINE_FUNCTION float bf16_bits_to_float(std::uint32_t h) { return Kokkos::bit_cast<float>(h << 16); }

// VW consecutive values of a row into (from) an array: for VW = 4 floats one 16-byte access (load_f4 / store_f4;
// the caller checked the alignment), for VW = 4 bf16 one 8-byte load in CUDA device code (8-byte aligned), element
// by element otherwise.
template <int VW, class T, class P>
KOKKOS_INLINE_FUNCTION void load_vec(const T* p, P (&out)[VW]) {
  if constexpr (VW == 4 && std::is_same_v<T, float>) {
    const Float4 q = load_f4(p);
    for (int k = 0; k < 4; ++k) out[k] = q.v[k];
  } else if constexpr (VW == 4 && std::is_same_v<T, bf16>) {
#if defined(__CUDA_ARCH__)
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    out[0] = P(bf16_bits_to_float(u.x & 0xffffu)), out[1] = P(bf16_bits_to_float(u.x >> 16));
    out[2] = P(bf16_bits_to_float(u.y & 0xffffu)), out[3] = P(bf16_bits_to_float(u.y >> 16));
#else
    for (int k = 0; k < 4; ++k) out[k] = P(float(p[k]));
#endif
  } else {
    for (int k = 0; k < VW; ++k) out[k] = P(p[k]);
  }
}
template <int VW, class T, class P>
KOKKOS_INLINE_FUNCTION void store_vec(T* p, const P (&in)[VW]) {
  if constexpr (VW == 4 && std::is_same_v<T, float>) {
    Float4 q;
    for (int k = 0; k < 4; ++k) q.v[k] = in[k];
    store_f4(p, q);
  } else {
    for (int k = 0; k < VW; ++k) p[k] = static_cast<T>(in[k]);
  }
}

// ------------------------------------------------------------------ labelled dispatch
using Range = Kokkos::RangePolicy<Exec, Kokkos::IndexType<index_t>>;

// Every kernel of the wrappers below is launched with its functor as a kernel argument (HintLightWeight). Without
// the hint Kokkos' CUDA backend sends a functor of 512 bytes or more (the SSD's context is one) through constant
// memory, and each such launch first waits on the host for the previous one to finish: a GPU idle gap per launch.
template <class Policy>
inline auto light(const Policy& p) {
  return Kokkos::Experimental::require(p, Kokkos::Experimental::WorkItemProperty::HintLightWeight);
}

// 1-D loop over [0, n).
template <class F>
inline void par_for(const char* label, index_t n, const F& f) {
  Kokkos::parallel_for(label, light(Range(0, n)), f);
}

// 2-D loop over [0, n0) x [0, n1), f(i, j), with j the fast (contiguous) index. On CUDA a flattened 1-D range
// with consecutive threads on consecutive j (coalesced rows; 32-bit index division where the size allows):
// Kokkos' CUDA MDRange puts i on threadIdx.x, so lanes of a warp would read rows n1 apart (the SSD's state
// passing took 5-7 ms instead of ~0.2 ms that way). On host backends an MDRange, which iterates in tiles without
// a division per element. Bounds: the launch bounds (Kokkos::LaunchBounds<max threads, min blocks>; the default
// leaves the register count to the compiler), e.g. for a kernel whose registers would cut its occupancy.
template <class Bounds = Kokkos::LaunchBounds<>, class F>
inline void par_for(const char* label, index_t n0, index_t n1, const F& f) {
  if (n0 <= 0 || n1 <= 0) return;
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same_v<Exec, Kokkos::Cuda>) {
    const index_t n = n0 * n1;
    if (n < (index_t(1) << 31)) {
      const std::uint32_t m1 = static_cast<std::uint32_t>(n1);
      using R32 = Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int32_t>, Bounds>;
      Kokkos::parallel_for(label, light(R32(0, std::int32_t(n))), KOKKOS_LAMBDA(const std::int32_t k) {
        const std::uint32_t u = static_cast<std::uint32_t>(k);
        f(index_t(u / m1), index_t(u % m1));
      });
    } else {
      using R64 = Kokkos::RangePolicy<Exec, Kokkos::IndexType<index_t>, Bounds>;
      Kokkos::parallel_for(label, light(R64(0, n)), KOKKOS_LAMBDA(const index_t k) { f(k / n1, k % n1); });
    }
    return;
  }
#endif
  using MD = Kokkos::MDRangePolicy<Exec, Kokkos::Rank<2, Kokkos::Iterate::Right, Kokkos::Iterate::Right>,
                                   Kokkos::IndexType<index_t>, Bounds>;
  Kokkos::parallel_for(label, light(MD({0, 0}, {n0, n1})), f);
}

// 1-D reduction (sum by default) over [0, n).
template <class F, class R>
inline void par_reduce(const char* label, index_t n, const F& f, R& result) {
  Kokkos::parallel_reduce(label, Range(0, n), f, result);
}

// Hierarchical loop: one team per league index. `team_bytes` of scratch per team and `thread_bytes` per thread
// are requested at `scratch_level` (0: fast on-chip memory on GPUs; 1: larger, backed by global memory).
template <class F>
inline void par_for_team(const char* label, index_t league, const F& f, std::size_t team_bytes = 0,
                         std::size_t thread_bytes = 0, int scratch_level = 0) {
  auto policy = Kokkos::TeamPolicy<Exec>(static_cast<int>(league), Kokkos::AUTO);
  if (team_bytes > 0 || thread_bytes > 0)
    policy = policy.set_scratch_size(scratch_level, Kokkos::PerTeam(team_bytes), Kokkos::PerThread(thread_bytes));
  Kokkos::parallel_for(label, light(policy), f);
}

// Hierarchical loop with vector lanes: on a GPU, teams of `gpu_team` threads of `gpu_vector` lanes each (a warp's
// lanes share a thread's work through ThreadVectorRange, so row accesses coalesce); on host backends one lane per
// thread and an AUTO team size. Scratch as in par_for_team. Bounds: launch bounds as in par_for (the default leaves
// the register count to the compiler).
template <class Bounds = Kokkos::LaunchBounds<>, class F>
inline void par_for_team_vec(const char* label, index_t league, int gpu_team, int gpu_vector, const F& f,
                             std::size_t team_bytes = 0, std::size_t thread_bytes = 0, int scratch_level = 0) {
#if defined(KOKKOS_ENABLE_CUDA)
  constexpr bool gpu = std::is_same_v<Exec, Kokkos::Cuda>;
#else
  constexpr bool gpu = false;
#endif
  using Policy = Kokkos::TeamPolicy<Exec, Bounds>;
  auto policy = gpu ? Policy(static_cast<int>(league), gpu_team, gpu_vector)
                    : Policy(static_cast<int>(league), Kokkos::AUTO);
  if (team_bytes > 0 || thread_bytes > 0)
    policy = policy.set_scratch_size(scratch_level, Kokkos::PerTeam(team_bytes), Kokkos::PerThread(thread_bytes));
  Kokkos::parallel_for(label, light(policy), f);
}

// The same with per-team scratch at both levels: `fast_bytes` on chip (level 0), `large_bytes` in global memory.
template <class F>
inline void par_for_team_vec2(const char* label, index_t league, int gpu_team, int gpu_vector, const F& f,
                              std::size_t fast_bytes, std::size_t large_bytes) {
#if defined(KOKKOS_ENABLE_CUDA)
  constexpr bool gpu = std::is_same_v<Exec, Kokkos::Cuda>;
#else
  constexpr bool gpu = false;
#endif
  auto policy = gpu ? Kokkos::TeamPolicy<Exec>(static_cast<int>(league), gpu_team, gpu_vector)
                    : Kokkos::TeamPolicy<Exec>(static_cast<int>(league), Kokkos::AUTO);
  policy = policy.set_scratch_size(0, Kokkos::PerTeam(fast_bytes)).set_scratch_size(1, Kokkos::PerTeam(large_bytes));
  Kokkos::parallel_for(label, light(policy), f);
}

// Rows per team of par_for_rows (one per team thread on GPUs).
inline constexpr int kRowsPerTeam = 8;

// Row kernels: f(team, i) for every row i < n, with the work inside a row on the calling thread's vector lanes
// (Kokkos::ThreadVectorRange). On a GPU kRowsPerTeam rows per team of kRowsPerTeam x 32, so a warp walks one row
// contiguously (a plain thread-per-row loop has the lanes of a warp reading rows apart); on host backends the
// lanes are one, so the inner loops run in order, exactly as a sequential loop over the row.
template <class F>
inline void par_for_rows(const char* label, index_t n, const F& f) {
  if (n <= 0) return;
  const index_t league = (n + kRowsPerTeam - 1) / kRowsPerTeam;
  par_for_team_vec(label, league, kRowsPerTeam, 32, KOKKOS_LAMBDA(const Team& tm) {
    const index_t i0 = index_t(tm.league_rank()) * kRowsPerTeam;
    const index_t cnt = n - i0 < index_t(kRowsPerTeam) ? n - i0 : index_t(kRowsPerTeam);
    Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, cnt), [&](index_t k) { f(tm, i0 + k); });
  });
}

// Allocate a device view without initialising it (for outputs that every kernel overwrites).
template <class V, class... Extents>
inline V make_uninit(const std::string& label, Extents... ext) {
  return V(Kokkos::view_alloc(Kokkos::WithoutInitializing, label), ext...);
}

inline void fence(const char* label) { Kokkos::fence(label); }

// ------------------------------------------------------------------ small device math
template <class T>
KOKKOS_INLINE_FUNCTION T sigmoid(T x) {
  return T(1) / (T(1) + Kokkos::exp(-x));
}
template <class T>
KOKKOS_INLINE_FUNCTION T silu(T x) {
  return x * sigmoid(x);
}
// d silu / dx = s (1 + x (1 - s)), s = sigmoid(x)
template <class T>
KOKKOS_INLINE_FUNCTION T dsilu(T x) {
  const T s = sigmoid(x);
  return s * (T(1) + x * (T(1) - s));
}
// sin and cos of one angle: on CUDA devices sincosf / sincos (one argument reduction for both), elsewhere
// Kokkos::sin and Kokkos::cos.
template <class T>
KOKKOS_INLINE_FUNCTION void sin_cos(T x, T& s, T& c) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, float>) {
    sincosf(x, &s, &c);
    return;
  } else if constexpr (std::is_same_v<T, double>) {
    sincos(x, &s, &c);
    return;
  }
#endif
  s = Kokkos::sin(x);
  c = Kokkos::cos(x);
}
// softplus with the threshold used by mamba_ssm's kernels: identity above 20.
template <class T>
KOKKOS_INLINE_FUNCTION T softplus(T x) {
  return x > T(20) ? x : Kokkos::log1p(Kokkos::exp(x));
}
template <class T>
KOKKOS_INLINE_FUNCTION T dsoftplus(T x) {
  return x > T(20) ? T(1) : sigmoid(x);
}
// exp of a non-positive argument; positive arguments (padded or masked lanes) are clamped to 0 so they never
// overflow to inf and then NaN.
template <class T>
KOKKOS_INLINE_FUNCTION T exp_nonpos(T x) {
  return Kokkos::exp(x < T(0) ? x : T(0));
}

}  // namespace mm
