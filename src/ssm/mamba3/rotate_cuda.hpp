// Native CUDA rotation backward of the Mamba-3 SISO scan on quads: scan.cpp's rotate_bwd_reduce (the Kokkos form,
// kept as the fallback and the reference it is tested against) with the same outputs. Per (row, head, state
// dimension) the un-rotated gradients of q~ and k~ (after, where the diagonal's factors are given, dq~ += fdv k~,
// dk~ += fdv q~ and the final carry's k gradient at a row's last token), dphi per angle (written), their sums
// over each group's heads (dqk, written) and over the rows each block walks (partial: [k: h N + n | q: H N + h N
// + n] a block of the kernel; their sum over the blocks is the biases' gradient).
//
// Why a kernel of its own: the Kokkos form ran 1.69 ms on an H100 for the Mamba-3 block's 8 x 8,192 tokens, 24
// heads, d_state 128 (ncu: 1.0 G warp instructions at 57 % issue-slot use, 1.4 TB/s), i.e. about 650 warp
// instructions per (row, head) where the arithmetic is some 200: 64-bit index arithmetic, the group sums
// read-modified-written in team scratch for every head, and q, k and the biases loaded again per row and head.
// Here a block of one group walks tiles of rows (two blocks an SM in all); a lane owns one quad (interleaved
// pairs) or two quads (halved pairs) of a row's state dimensions for KR rows of a tile, keeps the group's
// un-rotated q and k and the group sums of those rows in registers across the group's heads, loads each head's
// biases once a tile, and adds the biases' row sums over the tile by shuffles and one shared-memory pass per head
// into its own row of `partial` (in a fixed order: the same sums every run on a device).
// Measured (H100, fortieth session, perf/RESULTS.md): 1.51-1.53 ms against 1.584 ms for the Kokkos form in the
// same run (the Kokkos form itself 1.69 -> 1.58 ms by 32-bit row divisions in that session), block 16.89 against
// 17.04 ms: less than its instruction count promised. Not yet profiled; the likely limit is the barrier a head
// (its loads wait for the previous head's reduction), with 16 warps an SM at 116-128 registers.
#pragma once

#include <cstdint>

namespace mm::mamba3_cuda {

using index_t = std::int64_t;

// Row-major arrays; strides in elements. Row r = b L + t. The inputs both kernels read:
struct RotIn {
  const float* qk = nullptr;  // the un-rotated q of group g at q_col + g N, k at k_col + g N (row stride ldqk)
  index_t ldqk = 0, q_col = 0, k_col = 0;
  const float *q_bias = nullptr, *k_bias = nullptr;  // (H N)
  const float* phi = nullptr;  // phases (b, h, t, i) at b ps0 + h ps1 + t ps2 + i
  index_t ps0 = 0, ps1 = 0, ps2 = 0;
  index_t q_off = 0, k_off = 0;  // head h's q~ (or dq~) at q_off + h N of its row, k~ (dk~) at k_off + h N
  int batch = 0, L = 0, H = 0, G = 0, N = 0, S = 0;
  bool halved = false;
};

// The forward: q~ = Rot(phi) (q + q_bias), k~ = Rot(phi) (k + k_bias) per (row, head) into [k~ | q~] (fp32 or bf16),
// with q~ . k~ per (row, head) where qkd is given: scan.cpp's rotate_quads (the Kokkos form, kept as the fallback
// and the reference it is tested against) with the same arithmetic per element (sincosf, bias, then the pair) and
// the dot product summed in another order. A warp takes 32 / (N / W) rows, a lane W of a row's state dimensions
// (as the backward below), and walks the heads with the group's q and k in registers.
// Why a kernel of its own: the Kokkos form ran 0.95 ms on an H100 for the Mamba-3 block's 8 x 8,192 tokens, 24
// heads, d_state 128 (bf16 [k~ | q~]: 0.8 GB written, 0.2 GB of phases read), a third of the copy bandwidth, with
// a reduction over the row's lanes (Kokkos' vector reduce) and a 64-bit row decode per head.
struct RotFwdArgs : RotIn {
  // q~ and k~ (row stride ldo): fp32 (out32) or bf16 (out16), one of them
  float* out32 = nullptr;
  std::uint16_t* out16 = nullptr;
  index_t ldo = 0;
  float* qkd = nullptr;  // (rows, H) at r ldqkd + h: q~ . k~ (before the bf16 rounding), or null
  index_t ldqkd = 0;
};
// The launch (asynchronous on the default stream; rotate_fits, and rotate_bwd's alignment below: 16-byte aligned
// fp32 rows and quads, 8-byte aligned bf16 ones).
void rotate_fwd(const RotFwdArgs& a);
long rotate_fwd_launches();

struct RotBwdArgs : RotIn {
  float* dphi = nullptr;  // the phases' gradients, strides dps*, written for i < S
  index_t dps0 = 0, dps1 = 0, dps2 = 0;
  // dq~ and dk~ (row stride ldd): fp32 (dq32) or bf16 (dq16), one of them
  const float* dq32 = nullptr;
  const std::uint16_t* dq16 = nullptr;
  index_t ldd = 0;
  const float* fdv = nullptr;  // (rows, H) at r ldf + h: the diagonal's factor, or null (no diagonal terms)
  index_t ldf = 0;
  const float* fk = nullptr;  // the final carry's k gradient (b, h, n) at b fs0 + h fs1 + n, or null
  index_t fs0 = 0, fs1 = 0;
  float* dqk = nullptr;  // group sums: dq at dq_col + g N, dk at dk_col + g N (row stride lddqk)
  index_t lddqk = 0, dq_col = 0, dk_col = 0;
  float* partial = nullptr;  // (rotate_bwd_partial_rows, 2 H N), written
};

// Whether the kernels (rotate_fwd, rotate_bwd) take d_state N with this pairing (N a multiple of 4, of 8 halved,
// and the lanes of a row, N / 4 or N / 8, dividing 32), in this build (CUDA).
bool rotate_fits(int N, bool halved);
// The rows of `partial` for this many token rows and groups: the kernel's blocks a group (each adds its tiles'
// sums into its own row).
index_t rotate_bwd_partial_rows(index_t rows, int N, bool halved, int groups);
// The launch (asynchronous on the default stream; pointers 16-byte aligned and column offsets and strides
// multiples of 4, as scan.cpp's quads_ok checks; bf16 dq~, dk~ 8-byte aligned).
void rotate_bwd(const RotBwdArgs& a);
// Launches so far (the tests check which form ran).
long rotate_bwd_launches();

}  // namespace mm::mamba3_cuda
