// Native CUDA forward of the Mamba-1 selective scan (fp32 data, d_state 8 or 16), behind selective_scan_forward:
// the portable Kokkos passes stay the fallback and the reference for every other case (double, other d_state,
// misaligned column windows, non-CUDA builds).
//
// Why a native kernel: the portable chunk-parallel forward walks each chunk twice (its end state, then again from
// the carried state for the outputs), so every decay exp(Delta A) is computed twice, and its per-token loads wait
// on device memory. The GPU's exp unit (16 results per clock per SM on an H200) then bounds it at twice the time of
// one pass. This kernel makes one pass over the sequence: a block owns 16 channels of one batch row and walks all
// tokens, with tiles of 32 tokens of u, delta, z, B and C brought into shared memory by asynchronous copies two
// tiles ahead. Per tile, three phases: every thread computes softplus and Delta u for (token, channel) elements;
// then each channel's 16 states, spread over 4 lanes (4 each), run through the tile's tokens, one exp2 per state
// and token, writing partial outputs; then every thread sums the partials of (token, channel) elements, adds the D
// skip, applies the z gate and stores. The sequential phase does nothing but the recurrence, and the elementwise
// work is spread over all threads. The checkpoints (the state entering every chunk of `chunk` tokens) and the
// final state are written on the way.
#pragma once

#include <cstdint>

namespace mm::mamba1_cuda {

using index_t = std::int64_t;

// Row-major inputs with their column offsets already applied to the pointers; strides in elements.
struct FwdArgs {
  const float *u = nullptr, *delta = nullptr, *B = nullptr, *C = nullptr, *z = nullptr;  // z may be null
  index_t ld_u = 0, ld_delta = 0, ld_bc = 0, ld_z = 0, ld_out = 0;
  const float *A = nullptr, *D = nullptr, *bias = nullptr;  // A (E, N) row-major, D and bias (E)
  const std::int32_t* seq = nullptr;                        // (batch, seqlen) with row stride ld_seq, or null
  index_t ld_seq = 0;
  const float* init = nullptr;   // (batch, E, N) or null
  float* out = nullptr;          // (batch * seqlen, E)
  float* final_state = nullptr;  // (batch, E, N) or null
  float* ckpt = nullptr;         // (nchunks, N, batch * E)
  index_t batch = 0, L = 0, E = 0, N = 0, cpg = 0, Q = 0;
};

// Channels per block; d_inner and the channels per group must be multiples of it.
constexpr index_t kChannels = 16;

// Whether this build has the kernel (CUDA as Kokkos' default execution space).
bool compiled();
// The shape rules the kernel needs besides 16-byte alignment (which the caller checks on the pointers): N of 8 or
// 16, E and cpg multiples of kChannels.
bool shape_fits(index_t E, index_t N, index_t cpg);
// Launches on Kokkos' default execution space instance (asynchronous, like the Kokkos kernels around it).
void forward(const FwdArgs& a);

}  // namespace mm::mamba1_cuda
