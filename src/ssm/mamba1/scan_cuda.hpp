// Native CUDA forward of the Mamba-1 selective scan (fp32 data, d_state 8 or 16), behind selective_scan_forward:
// the portable Kokkos passes stay the fallback and the reference for every other case (double, other d_state,
// misaligned column windows, non-CUDA builds).
//
// Why a native kernel, and why this shape. The recurrence h_t = exp(Delta_t A) h_{t-1} + Delta_t B_t u_t is a
// scan of affine maps; walking each channel's sequence in one thread leaves the GPU batch x d_inner threads
// (6,144 for 4 x 1,536: far too few to hide the latency of the exp unit and the recurrence) and the portable
// chunk-parallel passes compute every decay twice (the exp unit, 16 results per clock per SM on an H200, is then
// the bound). This kernel parallelises over time inside a block, with one exp per (token, state):
//   - a block owns 8 channels (32-byte rows of u, delta, z: whole sectors) of one batch row and walks the sequence
//     in iterations of S x K tokens; within a warp, S lanes ("slots") share a channel, each owning K consecutive
//     tokens (32 / S channels per warp);
//   - per group of G states, each lane runs its K tokens from a zero state (keeping the K decays in registers)
//     and forms its aggregate (decay product = exp2(A log2e sum Delta), local end state); an inclusive shuffle scan
//     over the S slots composes the aggregates, the channel's carried state enters, and each lane reruns its K
//     tokens from its true entering state, adding C h to its outputs (the decays reused, not recomputed);
//   - B and C (shared by the block's channels) arrive by asynchronous copies one iteration ahead, in units of the
//     G states a lane reads at once, rotated by slot so that the S slots reading the same state hit different banks;
//   - u and delta arrive with them in shared memory (staged variants: 16-byte copies of whole 32-byte rows, rows
//     skewed by slot), or are read by each lane straight into registers (the others: a warp load then touches 16
//     sectors for 8 useful bytes each, which ncu showed keeping L1 79 % busy).
// The checkpoints (the state entering every chunk of `chunk` tokens) and the final state are written on the way.
// Variants (S, K, G, staged) trade warps for registers and shuffles; `variant` picks one (1..4).
//
// The second kernel, the "state lanes" (variants 5 to 8; the default where it fits: 2.5x faster than the first on
// an H200), does not parallelise over time: a thread per (channel, 2 of the 16 states) walks the sequence in tiles
// of 32 tokens (4 x 1,536 channels x 8 threads are enough threads), so each (token, state) costs one exp and one
// pass, with the per-(token, channel) work (softplus, Delta u, D skip, gate) done once per tile cooperatively and
// the per-token sum over states through shared memory (scan_cuda.cpp says more).
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
  int variant = 0;               // 0: the default; 1..kVariants as listed in variant_name
};

// Channels per block; d_inner and the channels per group must be multiples of it.
constexpr index_t kChannels = 8;
// The kernel variants one may ask for by number (1..kVariants).
constexpr int kVariants = 8;

// Whether this build has the kernel (CUDA as Kokkos' default execution space).
bool compiled();
// The shape rules the kernel needs besides 16-byte alignment (which the caller checks on the pointers): N of 8 or
// 16, E and cpg multiples of kChannels.
bool shape_fits(index_t E, index_t N, index_t cpg);
// Whether the state-lanes kernel (variants 5 to 8: tiles of 32 tokens, the recurrence's loop unrolled 2 or 8
// times, 8 pipelined with its partial outputs summed in the warp) takes this shape: N of 8 or 16, E and cpg
// multiples of 16, 32 dividing the checkpoint interval Q. Variant 0 (the default) is variant 8 where it fits and
// S8 K8 G4 staged elsewhere.
bool lanes_fit(index_t E, index_t N, index_t cpg, index_t Q);
// "S16 K8 G4" etc. for variant v (0: the default's name).
const char* variant_name(int v);
// Launches on Kokkos' default execution space instance (asynchronous, like the Kokkos kernels around it).
void forward(const FwdArgs& a);

// The native backward's two chunk kernels, the same "state lanes" layout as the forward (a block of 16 channels x
// 8 slots of 2 states per (batch row, chunk), tiles of 32 tokens), replacing the portable backward's per-chunk
// passes (selective_scan.cpp, backward_chunked: the local reverse scans and the pass that rebuilds each chunk's
// states in device memory); the carry between chunks, dB/dC and the parameter sums stay portable:
//   backward_local: per chunk, the reverse scan dh_t = [t same record] exp(Delta_t A) (dh_{t+1} + C_t g_t) from a
//     zero carry, writing dl (the dh the chunk passes to the left) and dm (the factor the carry from the right
//     reaches it by), both (nchunks, N, batch E);
//   backward_chunk: per chunk, from its checkpoint and the carried dcarry: the states rebuilt on chip (the tile
//     starts in shared memory, a tile's states in registers), then the reverse scan: du, d(raw delta), dz, the
//     Delta and g buffers of the dB/dC pass, and the chunk's partials of dA (batch nchunks, E, N) and of dD and
//     d(delta_bias) (batch nchunks, E, 2), in the portable passes' layouts.
struct BwdArgs {
  const float *u = nullptr, *delta = nullptr, *B = nullptr, *C = nullptr, *z = nullptr, *dout = nullptr;
  index_t ld_u = 0, ld_delta = 0, ld_bc = 0, ld_z = 0, ld_dout = 0;
  const float *A = nullptr, *D = nullptr, *bias = nullptr;
  const std::int32_t* seq = nullptr;
  index_t ld_seq = 0;
  const float *ckpt = nullptr, *dcarry = nullptr;  // (nchunks, N, batch E)
  float *dl = nullptr, *dm = nullptr;              // backward_local's outputs, (nchunks, N, batch E)
  float *du = nullptr, *ddelta = nullptr, *dz = nullptr;  // dz only with z
  index_t ld_du = 0, ld_ddelta = 0, ld_dz = 0;
  float *dlt = nullptr, *g = nullptr;          // (batch L, E), dense
  float *dA_part = nullptr, *dv_part = nullptr;  // (batch nchunks, E, N) and (batch nchunks, E, 2)
  // backward_chunk's parts of dB and dC, one per block of kBwdBlock channels: (nblk, batch L, 2 G N), B's at column
  // g N + n, C's at G N + g N + n. A launch covers the blocks blk0 .. blk0 + nblk - 1 of every group.
  float* bc_parts = nullptr;
  index_t blk0 = 0, nblk = 0;
  index_t batch = 0, L = 0, E = 0, N = 0, cpg = 0, Q = 0;
};
// Channels per block of the backward's kernels (and per part of dB and dC).
constexpr index_t kBwdBlock = 16;
// Whether the native backward takes this shape: lanes_fit's rules, and Q at most 512 (the tile starts of a chunk in
// shared memory).
bool backward_fits(index_t E, index_t N, index_t cpg, index_t Q);
void backward_local(const BwdArgs& a);
// The chunk pass over the blocks blk0 .. blk0 + nblk - 1 of every group: du, ddelta, dz, Delta and g of their
// channels, the parameter partials, and their parts of dB and dC.
void backward_chunk(const BwdArgs& a);

}  // namespace mm::mamba1_cuda
