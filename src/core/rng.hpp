// Counter-based random numbers (Philox-4x32-10, Salmon et al., SC'11). A draw is a pure function of
// (seed, stream, index): it does not depend on the backend, the thread count, the launch shape or the rank count,
// so parameter initialisation, data sampling and dropout-like noise are reproducible across every layout.
// Convention: `stream` names what is being drawn (a hash of a parameter name, a purpose constant combined with a
// step number), `index` is the global element index.
#pragma once

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <string_view>

namespace mm {

struct Philox4x32 {
  std::uint32_t v[4];
};

KOKKOS_INLINE_FUNCTION void mulhilo32(std::uint32_t a, std::uint32_t b, std::uint32_t& hi, std::uint32_t& lo) {
  const std::uint64_t p = static_cast<std::uint64_t>(a) * static_cast<std::uint64_t>(b);
  hi = static_cast<std::uint32_t>(p >> 32);
  lo = static_cast<std::uint32_t>(p);
}

// Philox-4x32 with 10 rounds on counter c and key k.
KOKKOS_INLINE_FUNCTION Philox4x32 philox4x32_10(Philox4x32 c, std::uint32_t k0, std::uint32_t k1) {
  constexpr std::uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
  constexpr std::uint32_t W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k0 += W0;
      k1 += W1;
    }
    std::uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(M0, c.v[0], hi0, lo0);
    mulhilo32(M1, c.v[2], hi1, lo1);
    c = Philox4x32{{hi1 ^ c.v[1] ^ k0, lo1, hi0 ^ c.v[3] ^ k1, lo0}};
  }
  return c;
}

// 64-bit FNV-1a: turns a name (e.g. a parameter name) into a stream id. Host only.
inline std::uint64_t stream_id(std::string_view name) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : name) {
    h ^= ch;
    h *= 1099511628211ull;
  }
  return h;
}

// Combine a stream id with a small integer (a step, a layer index) into a new stream id.
KOKKOS_INLINE_FUNCTION std::uint64_t stream_mix(std::uint64_t stream, std::uint64_t value) {
  std::uint64_t z = stream ^ (value + 0x9E3779B97F4A7C15ull + (stream << 6) + (stream >> 2));
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

struct CounterRNG {
  std::uint64_t seed = 0;
  std::uint64_t stream = 0;

  KOKKOS_INLINE_FUNCTION Philox4x32 bits(std::uint64_t index) const {
    const Philox4x32 ctr{{static_cast<std::uint32_t>(index), static_cast<std::uint32_t>(index >> 32),
                          static_cast<std::uint32_t>(stream), static_cast<std::uint32_t>(stream >> 32)}};
    return philox4x32_10(ctr, static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32));
  }
  // Uniform double in (0, 1], 53 random bits.
  KOKKOS_INLINE_FUNCTION double uniform(std::uint64_t index) const {
    const Philox4x32 r = bits(index);
    const std::uint64_t m = (static_cast<std::uint64_t>(r.v[0]) << 21) ^ static_cast<std::uint64_t>(r.v[1] >> 11);
    return (static_cast<double>(m & ((1ull << 53) - 1)) + 1.0) * (1.0 / 9007199254740992.0);
  }
  // Uniform double in (lo, hi].
  KOKKOS_INLINE_FUNCTION double uniform(std::uint64_t index, double lo, double hi) const {
    return lo + (hi - lo) * uniform(index);
  }
  // Standard normal (Box-Muller on two independent 53-bit uniforms from the same counter).
  KOKKOS_INLINE_FUNCTION double normal(std::uint64_t index) const {
    const Philox4x32 r = bits(index);
    const std::uint64_t m1 = (static_cast<std::uint64_t>(r.v[0]) << 21) ^ (r.v[1] >> 11);
    const std::uint64_t m2 = (static_cast<std::uint64_t>(r.v[2]) << 21) ^ (r.v[3] >> 11);
    const double u1 = (static_cast<double>(m1 & ((1ull << 53) - 1)) + 1.0) * (1.0 / 9007199254740992.0);
    const double u2 = static_cast<double>(m2 & ((1ull << 53) - 1)) * (1.0 / 9007199254740992.0);
    return Kokkos::sqrt(-2.0 * Kokkos::log(u1)) * Kokkos::cos(2.0 * Kokkos::numbers::pi * u2);
  }
  // Uniform integer in [0, n), n > 0 (64-bit multiply-shift on 32 random bits; bias below 2^-32 * n).
  KOKKOS_INLINE_FUNCTION std::uint64_t below(std::uint64_t index, std::uint64_t n) const {
    const Philox4x32 r = bits(index);
    const std::uint64_t x = (static_cast<std::uint64_t>(r.v[0]) << 32) | r.v[1];
    // high 64 bits of x * n via 128-bit emulation
    const std::uint64_t xl = x & 0xffffffffull, xh = x >> 32, nl = n & 0xffffffffull, nh = n >> 32;
    const std::uint64_t ll = xl * nl, lh = xl * nh, hl = xh * nl, hh = xh * nh;
    const std::uint64_t mid = (ll >> 32) + (lh & 0xffffffffull) + (hl & 0xffffffffull);
    return hh + (lh >> 32) + (hl >> 32) + (mid >> 32);
  }
};

}  // namespace mm
