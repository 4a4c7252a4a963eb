// Native CUDA tensor-core kernels of the SSD forward (SSDAlgo::fused): the chunk-local states and the chunk scan
// (intra-chunk masked product, inter-chunk term and D x in one pass, no Q x Q workspace in global memory), with
// bf16 operands and fp32 accumulation (mma.sync m16n8k16, or WMMA 16 x 16 x 16 in the earlier forms). The portable Kokkos kernels and the GEMM formulation in
// ssd.cpp stay the reference and the fallback: ssd.cpp calls these only on CUDA, for float activations and shapes
// that `fits` accepts.
#pragma once

#include <cstdint>

namespace mm::ssd_fused {

// Raw row-major views of one call (the same arrays as ssd.cpp's Ctx).
struct Args {
  const float* xbc = nullptr;  // B at column b_col + g N + n, C at c_col + g N + n of rows ldx apart
  std::int64_t ldx = 0, b_col = 0, c_col = 0;
  // B and C in bf16 at the same columns of rows ldx elements apart, in place of xbc (then null), where given:
  // Mamba-3's per-head k~ and q~ as its rotation leaves them (half the bytes to write and to read back). Read by
  // scan_seq, state_bwd_seq and bc_backward, whose products round B and C to bf16, or to tf32, which holds a bf16
  // value exactly: given B and C already rounded, they compute what they compute from fp32 B and C rounded to bf16.
  // The other kernels refuse it. Rows 16-byte aligned, ldx and the columns multiples of 8 (bc16_rows_ok).
  const std::uint16_t* bc16 = nullptr;
  const float* xs = nullptr;  // x: token row r, head h at xs + r ldxs + h P (xbc's x columns, or a matrix of its own)
  std::int64_t ldxs = 0;
  const float* acs = nullptr;    // (batch, H, L): in-chunk inclusive cumsum of Delta A
  const float* delta = nullptr;  // (batch, H, L)
  const std::int32_t* seq = nullptr;  // (batch, L) record ids, or null (one record)
  const float* D = nullptr;           // (H)
  const float* dtok = nullptr;        // (batch, H, L): added to D[h] per token (SSDIn::D_token), or null
  float* states = nullptr;            // (batch, nchunks, H, P, N)
  const float* cb = nullptr;          // (batch, nchunks, G, Q, Q): C_l . B_s
  float* y = nullptr;                 // (batch L, ldy), head h at columns h P
  std::int64_t ldy = 0;
  int batch = 0, L = 0, H = 0, P = 0, G = 0, N = 0, Q = 0, nc = 0;
  float cutoff = 0;  // decay factors below this are dropped (ssd.cpp's kNegligibleDecay)
  // backward (intra_backward): a block of heads h0 .. h0 + nh - 1, in runs of run_len heads (never straddling a
  // group); dy (batch L, ldy) is read with head h at columns h P
  const float* dy = nullptr;
  float* dx = nullptr;  // dX: token row r, head h at dx + r ldd + h P (written by intra_backward, then added to)
  std::int64_t ldd = 0;
  float* v = nullptr;   // (nh, batch L, 6) per-token sums of ssd.cpp's GEMM backward (entries 0, 1, 3 here)
  float* insum = nullptr;  // (Q / 64, nh, batch L): entry 2's part from each source tile j (for tokens in tiles >= j)
  float* w2 = nullptr;  // (runs, batch nchunks, Q, Q): dC B^T summed over each run's heads
  const float* dstates = nullptr;  // (batch, nchunks, H, P, N): dL/d(state at each chunk's end) (state_epilogue)
  float* wdecay = nullptr;  // (batch, nchunks, H): sum(dH o S_in) per chunk and head, where epilogue_writes_wdecay
  bool ddot_f32 = false;    // state_epilogue: v3(l) = dY_l . X_l in fp32, over intra_backward's bf16 DX(l, l)
  // chunk_state: the weights e_in(l) (the decay from the chunk's start, zero outside the record entering it) instead
  // of es Delta: with xs = dY and b_col = c_col, the gradient of the state at each chunk's end from its outputs
  bool ein_weights = false;
  float* dbc = nullptr;  // bc_backward: d(xBC), dB at dbc + r lddbc + b_col + g N + n, dC at c_col (xbc's columns)
  std::int64_t lddbc = 0;
  // bc_backward: dB and dC rounded to bf16 at the same places of this array (row stride lddbc) in place of dbc,
  // where given (Mamba-3's per-head dq~ and dk~, which its rotation backward reads: half the bytes each way)
  std::uint16_t* dbc_b16 = nullptr;
  int h0 = 0, nh = 0, run_len = 1;
  // scan_seq (the sequential forward): the initial state (batch, H, P, N) or null (zero), the final state to write
  // (batch, H, P, N) or null; whether to write S_in of every chunk to `states`, and C B^T to cb_out where given
  // (the backward's kept intermediates; an inference forward needs neither)
  const float* init = nullptr;
  float* final_state = nullptr;
  bool write_states = true;
  float* cb_out = nullptr;
  // dstates_seq (the sequential backward state passing): dL/d(final state) (batch, H, P, N) or null (zero); writes
  // dH of every chunk (batch, nchunks, H, P, N) to dstates_out and dL/d(initial state) to dinit where given
  const float* dfinal = nullptr;
  float* dstates_out = nullptr;
  float* dinit = nullptr;
  // dH of every chunk in bf16 (same layout as dstates): written by state_bwd_seq in place of dstates_out and read
  // by bc_backward (one head a group) in place of dstates, where given (both round dH to bf16 for their products)
  std::uint16_t* dstates_b16 = nullptr;
};

// Where bc16 is given: its rows 16-byte aligned, ldx and the B and C columns multiples of 8 elements (true where
// it is not given).
bool bc16_rows_ok(const Args& a);

// Whether the fused forward and backward of a batch x heads of this shape take the kernels that read bc16:
// scan_seq and, for blocks of block_heads heads, state_bwd_seq (the forms as set, the device's SMs; rows aligned).
bool bc16_forms_take(int batch, int heads, int block_heads, int headdim, int dstate, int chunk);

// True when this build has the kernels (CUDA) and the shape suits them: headdim a multiple of 16 up to 128,
// d_state a multiple of 16, chunk a multiple of 64 up to 512 (the backward keeps a block's column of dC B^T tiles
// in shared memory).
bool fits(int headdim, int dstate, int chunk);

// states <- the chunk-local states sum_s [same record as the chunk's last token] exp(acs_last - acs_s) Delta_s
// x_s B_s^T (before the state passing); with ein_weights the weights are e_in(s) = [same record as the state
// entering the chunk] exp(acs_s) (the backward's dH from the chunk's own outputs: xs = dY, B = C).
void chunk_state(const Args& a);

// y <- e_in(l) C_l S_in^T + sum_{s <= l, same record} (C_l . B_s) exp(acs_l - acs_s) Delta_s x_s + D x_l, with
// states holding the state entering each chunk (D: D[h], plus dtok at token l where given).
void chunk_scan(const Args& a);

// The intra-chunk part of the backward for the block of heads in `a` (ssd.cpp's GEMM formulation computes the
// same with Q x Q workspaces): with K = E o (C B^T), M = K diag(Delta), DX = dY X^T per head,
//   dX    = M^T dY                                   (written; the state and D terms are added later)
//   v0(s) = sum_l K DX,  v1(s) = Delta_s sum_{l > s} K DX,  v3(s) = DX(s, s)
//   insum(j, l) = sum_{s < l, s in source tile j} Delta_s K DX   (v2(l) is their sum over the tiles j up to l's)
//   w2    = sum over a run's heads of DX o E diag(Delta)
// on tensor cores (bf16 operands, fp32 accumulation), without atomics, in one kernel that forms each DX tile once
// (dX and the sums over l come from A = K^T dY: dX = Delta A + the diagonal, sum_{l > s} K DX = X_s . A_s).
void intra_backward(const Args& a);

// Which kernel a fused pass runs: mma (mma.sync with the A operands and the elementwise steps in registers; the
// intra-chunk backward's default), mma_ring (the chunk scan only, its default; elsewhere, and where its rows are not
// 16-byte aligned or its shared memory exceeds the device's limit, mma: the mma kernel with its A operands, C then
// C B^T, copied by cp.async into a ring of 4 steps a warp in shared memory, 3 steps ahead of their use, at 3 blocks
// an SM instead of 4: on an H200 at L 65,536, 24 heads, headdim 64, d_state 128 the forward took 1.384 against
// 1.477 ms with mma in the same run, the kernel 836 against 906 us under ncu, perf/RESULTS.md, twenty-ninth
// session) or wmma (the earlier WMMA kernels, whose tiles go through shared memory; kept for the tests and for
// timing the forms side by side in perf/bench.cpp). scan_form picks the forward's chunk scan (wmma is also taken
// where the mma form's shared memory, x and S_in of a whole chunk, would exceed the device's limit per block, or
// batch x chunks would exceed 65,535, its grid's second dimension), intra_form the backward's intra-chunk kernel.
enum class Form { mma, wmma, mma_ring };
extern Form scan_form, intra_form;

// Which kernel forms the chunk-local states (chunk_state):
// - heads (the default): one block per run of up to 4 heads of a group and chunk, B of the chunk staged once in
//   bf16 for the run and x of each head once; taken where a group has more than one head (Mamba-2's routes), else
//   tiles (Mamba-3's SISO route, one head a group, whose block was not timed with it). It ran at 55 % of the L2's
//   throughput against 86 % for tiles, and 6 % faster, on an H100 at L 65,536, 24 heads, headdim 64, d_state 128;
//   on an H200 a variant of it ran level (perf/RESULTS.md, thirty-sixth session);
// - tiles: one block per 64 columns of the state, head and chunk (the earlier form, kept for the tests and for
//   timing side by side in perf/bench.cpp; also taken where the heads form's shared memory, B and x of a whole
//   chunk, would exceed the device's limit per block, or batch x chunks would exceed 65,535);
// - heads_ring (not the default: timed on an H100 only, where the SSD forward ran 2 % faster than with heads in
//   each of four runs, perf/RESULTS.md, thirty-seventh session; not yet on an H200): the heads form with x through
//   a cp.async ring of 32-token slices, two ahead of their use, at any heads a group, where x's rows are 16-byte
//   aligned and d_state is at most 128 (else heads).
enum class StateForm { heads, tiles, heads_ring };
extern StateForm state_form;

// How the fused backward forms dB and dC: gemm, two-level batched cuBLAS products per block of heads (the state
// terms (es Delta X) dH and (e_in dY) S_in of every group, then W2^T C and W2 B added) over operands in device
// memory (copies of es Delta X and of e_in dY included); kernel, where each block of heads is whole groups (always
// for one head a group, as Mamba-3's SISO route has; for Mamba-2's groups where the workspace budget holds a whole
// group): bc_backward, both outputs of a (64 tokens, group, chunk) formed in one pass and written once, and dH's
// chunk terms (e_in dY)^T C by chunk_state with ein_weights instead of a GEMM on the scaled copy of dY, which is then
// not formed (nor that of X). automatic (the default): kernel where a group is one head, gemm otherwise, as timed
// side by side on an H200 (perf/RESULTS.md, thirty-second session): the Mamba-3 SISO block (8 x 8,192 tokens, 24
// heads, one a group, headdim 64, d_state 128, chunk 64) 19.05 ms with the kernel against 19.92 ms with the GEMMs;
// the 24-layer Mamba-2 LM (4 x 8,192 tokens, one group of 24 heads, chunk 256) 141.8-142.7 ms against
// 139.7-140.2 ms, and the SSD alone (1 x 65,536, the same heads) 6.14 against 5.93 ms.
enum class BcForm { automatic, gemm, kernel };
extern BcForm bc_form;

// How the fused forward runs (ssd.cpp, SSDAlgo::fused):
// - chunks: chunk_state, the state passing, C B^T (cuBLAS) and chunk_scan, each parallel over every chunk (the
//   states of all chunks go through device memory three times);
// - sequential: scan_seq, one block per (row, head) walking its chunks in order with the state in registers: it
//   reads B, C and x once and writes y (and, for the backward, S_in and C B^T) once. Its parallelism is batch x
//   heads blocks, so it suits many rows (Mamba-3's 8 x 8,192 tokens, 24 heads) and not one long row;
// - automatic (the default): sequential where seq_fits and batch x heads fills the device's SMs, else chunks.
enum class FwdForm { automatic, chunks, sequential };
extern FwdForm fwd_form;

// The shapes the sequential forward takes: headdim 64, chunk 64, d_state 64 or 128 (this build has it: CUDA).
bool seq_fits(int headdim, int dstate, int chunk);

// Whether the fused forward of `a` (shape, alignment, batch x heads against the device's SMs) runs scan_seq.
bool seq_applies(const Args& a);

// The sequential forward: per (row b, head h) over chunks c in order, S = S_in(c) (a.init for c = 0):
//   y_l = e_in(l) C_l S^T + sum_{s <= l, same record} (C_l . B_s) exp(acs_l - acs_s) Delta_s x_s + D x_l,
//   S_in(c + 1) = [last token in the record entering] exp(acs_last) S + sum_{s, last token's record}
//                 exp(acs_last - acs_s) Delta_s x_s B_s^T
// (the same terms and cutoffs as chunk_state, the state passing and chunk_scan); C B^T in tf32, the inter-chunk
// term in tf32 against S rounded to bf16, the intra-chunk and state products on bf16 operands, fp32 accumulation.
// Writes y, the final state where given, and with write_states S_in of every chunk to states, with cb_out C B^T.
void scan_seq(const Args& a);

// The count of scan_seq launches in this process (the tests check that a forced form ran).
long seq_launches();

// How the fused backward forms dH, the gradient of the state at each chunk's end, and the state terms per token,
// where bc_backward forms dB and dC (BcForm::kernel as resolved):
// - chunks: each chunk's own term (e_in dY)^T C by chunk_state (ein_weights, every chunk in parallel, written to
//   device memory), the reverse state passing over them, then state_epilogue (T1 = B dH^T, T2 = C S_in^T and the
//   per-token terms, every chunk in parallel, reading dH and S_in);
// - dstates: dstates_seq for dH (one block per (64 columns of d_state, head, row) walking the row's chunks from
//   the last with its tile of dH in registers: dY and C read once, dH written once), then state_epilogue;
// - sequential: state_bwd_seq, dstates_seq's walk with state_epilogue's terms folded in (one block per (head,
//   row) holding all of dH): dH is written once for bc_backward and not read back by the epilogue;
// - automatic (the default): sequential where sbseq_fits and batch x heads fill the SMs, else dstates where
//   dseq_fits and its blocks fill two an SM, else chunks.
// On an H100 (perf/RESULTS.md, thirty-ninth session), the Mamba-3 SISO block of 8 x 8,192 tokens (24 heads, one a
// group, headdim 64, d_state 128, chunk 64): the state terms took 3.28 ms chunked (0.71 + 0.65 + 1.92), 2.69 ms
// as dstates (0.76 + 1.93) and 2.63 ms sequential; the block's forward + backward 18.0, 17.3-17.5 and 17.3 ms,
// its peak 10.84, 10.84 and 10.09 GiB (sequential passes dH to bc_backward in bf16, no fp32 dstates).
enum class BwdStateForm { automatic, chunks, dstates, sequential };
extern BwdStateForm bwd_state_form;

// The shapes dstates_seq takes: headdim 64, chunk 64, d_state a multiple of 64 (this build has it: CUDA).
bool dseq_fits(int headdim, int dstate, int chunk);

// Whether the fused backward of `a` (shape, alignment of dY and C, the blocks against the device's SMs) runs
// dstates_seq.
bool dseq_applies(const Args& a);

// dH of every chunk into a.dstates_out and dL/d(initial state) into a.dinit (where given), from dY (a.dy, a.ldy),
// C (a.xbc's C columns), the cumsum, the records and a.dfinal (null: zero), as chunk_state with ein_weights and
// the reverse state passing compute them (the same cutoffs); the products on bf16 operands, fp32 accumulation.
void dstates_seq(const Args& a);

// The count of dstates_seq launches in this process.
long dseq_launches();

// The shapes state_bwd_seq takes: headdim 64, chunk 64, d_state 64 or 128 (this build has it: CUDA).
bool sbseq_fits(int headdim, int dstate, int chunk);

// Whether the fused backward's block of heads in `a` (shape, alignment, batch x its heads against the SMs) runs
// state_bwd_seq.
bool sbseq_applies(const Args& a);

// For the block of heads h0 .. h0 + nh - 1 (a.v, a.dx as state_epilogue takes them, after intra_backward): dH of
// every chunk into a.dstates_out, dL/d(initial state) into a.dinit (where given), and state_epilogue's outputs
// (dX added to, v3 with ddot_f32, v4, v5, wdecay where given), from dY, X, B, C, the kept S_in (a.states), the
// cumsum, the records and a.dfinal (null: zero); dH's products on bf16 operands, T1 and T2 in tf32 against dH and
// S_in rounded to bf16, fp32 accumulation.
void state_bwd_seq(const Args& a);

// The count of state_bwd_seq launches in this process.
long sbseq_launches();

// Whether the fused backward's GEMM form (BcForm::gemm as resolved) takes its state terms on bf16 operands under
// bf16 arithmetic from a kept context (ssd_bf16_state_terms, ssd.hpp; default) or on tf32 from fp32 copies (the
// form before, kept for side-by-side timing: mambamoe_bench --state-terms).
extern bool bf16_state_gemms;

// Whether the fused backward takes the one-kernel dB and dC (bc_form, automatic resolved) for groups of
// heads_per_group heads, where its blocks of heads are whole groups (ssd.cpp checks that).
bool bc_kernel_for(int heads_per_group);

// `which` set to `f` for the scope's life, then restored (also when the scope is left by an exception).
template <class F>
struct FormScope {
  F& which;
  F saved;
  FormScope(F& w, F f) : which(w), saved(w) { which = f; }
  ~FormScope() { which = saved; }
  FormScope(const FormScope&) = delete;
  FormScope& operator=(const FormScope&) = delete;
};

// The per-token state terms of the backward for the block of heads in `a`, with states holding S_in (the state
// entering each chunk) and dstates dH: T1 = B dH^T, T2 = C S_in^T per (chunk, head) on tensor cores (bf16 with
// dH and S_in resident per chunk where epilogue_writes_wdecay, else tf32 per 64-token tile), then
//   dX += D dY + Delta es T1   (added to head h at dx + r ldd + h P; D + dtok(l) where dtok is given),
//   v4(l) = e_in(l) dY_l . T2_l,   v5(l) = es(l) X_l . T1_l   (and v3(l) = dY_l . X_l in fp32 with ddot_f32)
// (ssd.cpp's GEMM formulation writes T1 and T2 to device memory and reads them back in a Kokkos kernel), and in
// the resident form, where wdecay is given, wdecay(b, c, h) = sum(dH o S_in) in fp32.
void state_epilogue(const Args& a);

// Whether state_epilogue takes the resident form for this headdim and d_state (and so fills Args::wdecay).
bool epilogue_writes_wdecay(int headdim, int dstate);

// dB and dC of every group of the block of heads in `a`, whose runs (run_len) are whole groups (BcForm::kernel),
// written (not added) to the B and C columns of dbc: over the group's heads h
//   dB_s = sum_h es_h(s) Delta_h(s) X_h(s) dH_h + sum_{l >= s} W2(l, s) C_l,
//   dC_l = sum_h e_in,h(l) dY_h(l) S_in,h + sum_{s <= l} W2(l, s) B_s
// with dstates dH, states S_in and w2 (summed over each run's heads) as intra_backward left it. One block per
// (64 tokens, 128 columns of d_state, group, chunk) on tensor cores (WMMA, bf16 operands, fp32 accumulation).
void bc_backward(const Args& a);

}  // namespace mm::ssd_fused
