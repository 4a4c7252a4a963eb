// The single-nucleotide vocabulary of the DNA language model. Sequences come from io/fasta (already normalised to
// upper-case A, C, G, T and N), so one token per base is enough; 0 is kept for padding so that a zero-initialised
// buffer is all padding and never looks like sequence.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace mm {

enum Token : std::int32_t { kPad = 0, kA = 1, kC = 2, kG = 3, kT = 4, kN = 5 };
inline constexpr int kNumTokens = 6;

// Expects a normalised base; anything other than A/C/G/T (lower case included) is unknown, hence kN.
constexpr std::int32_t base_to_token(char b) noexcept {
  switch (b) {
    case 'A': return kA;
    case 'C': return kC;
    case 'G': return kG;
    case 'T': return kT;
    default: return kN;
  }
}

// '-' for padding; out-of-vocabulary ids print as 'N' like any other unknown base.
constexpr char token_to_base(std::int32_t t) noexcept {
  constexpr char kBases[kNumTokens] = {'-', 'A', 'C', 'G', 'T', 'N'};
  return t >= 0 && t < kNumTokens ? kBases[t] : 'N';
}

inline std::vector<std::int32_t> tokenize(std::string_view seq) {
  std::vector<std::int32_t> out(seq.size());
  for (std::size_t i = 0; i < seq.size(); ++i) out[i] = base_to_token(seq[i]);
  return out;
}

// Watson-Crick complement (A<->T, C<->G, the ids are laid out so that it is 5 - t); N and padding map to
// themselves, out-of-vocabulary ids to N.
constexpr std::int32_t complement_token(std::int32_t t) noexcept {
  if (t >= kA && t <= kT) return kA + kT - t;
  return t == kPad ? std::int32_t{kPad} : std::int32_t{kN};
}

}  // namespace mm
