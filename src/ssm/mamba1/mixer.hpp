// The Mamba-1 mixer (mamba_ssm's Mamba, the mamba_inner_fn path), forward, backward and decode:
//
//   xz     = in_proj(u)                                  columns [x (E) | z (E)], no bias
//   xc     = silu(causal_conv1d(x))                      (width d_conv, per channel, records never mixed)
//   x_dbl  = x_proj(xc)                                  [dt_low (R) | B (N) | C (N)], no bias
//   delta  = dt_proj.weight . dt_low                      (the bias is the scan's delta_bias)
//   y      = selective_scan(xc, delta, A = -exp(A_log), B, C, D, z, delta_bias = dt_proj.bias)
//   out    = out_proj(y)
//
// Initialisation follows mamba_ssm: in_proj, x_proj and out_proj like torch.nn.Linear (out_proj then divided by
// sqrt(n_layer), as Mamba2Mixer does), conv like torch.nn.Conv1d, dt_proj.weight U(-R^-1/2, R^-1/2), dt_proj.bias
// the inverse softplus of exp(U[log dt_min, log dt_max]) floored at dt_init_floor, A_log(d, n) = log(n + 1), D = 1.
//
// Decode: Mamba1State holds the last d_conv - 1 conv inputs per channel and the SSM state. forward() with an
// initial and/or final state processes a long sequence in windows (windowed == one pass); step() advances one token.
//
// Tensor parallelism (comms.tp of size tp > 1, d_inner divides by tp): tp rank r holds the channels
// c = r*E/tp.. of the inner width: in_proj rows [x_r | z_r] (column-parallel), the conv, dt_proj rows
// (column-parallel), dt_proj.bias, A_log, D and the decode state of those channels, the x_proj and out_proj columns
// of those channels (row-parallel). Every parameter carries its Shard and initialises to the slice of the unsharded
// model. Collectives (all-reduce over tp): x_proj's output [dt_low | B | C] and the output in the forward (and
// step); d[dt_low | B | C] and du in the backward. Inputs and dout are the same on every tp rank.
// Context parallel (comms.cp of size > 1; parallel/context_parallel.hpp, as Mamba2Mixer): each cp rank holds a
// contiguous slice of Lr tokens of every batch row. forward()/backward() without explicit states pass the state:
// the conv prefix is the left neighbour's last d_conv - 1 rows of x (its gradient goes back in the backward); the
// scan runs from a zero state, the pairs (total decay exp(sum_t Delta_t A) per (row, channel, state), final local
// state), both (batch, E, N), are all-gathered and folded into the incoming state S_in, and the scan is run again
// from S_in (a second local scan instead of an output correction: the scan fuses the z gate and the backward
// checkpoints, which then are right). The backward forms G = sum_t exp(l_t) (dout_t silu(z_t)) C_t for the first
// record, folds (decay, G) from the right into the gradient of the final state and runs the local backward from
// S_in with it. Needs Lr >= d_conv - 1; explicit states with cp > 1 are an error. Bytes one rank r of cp ranks sends
// per layer, forward + backward (independent of Lr):
//   2 * batch * E * N * 2 * sizeof(P)                                       (the two all-gathers of the pairs)
// + batch * (d_conv - 1) * E * sizeof(T) * ([r < cp - 1] + [r > 0])         (halo forward, its gradient back)
// + batch * max(d_conv - 1, 1) * 8 * [r < cp - 1] * [seq_idx not empty]     (record ids of the halo rows)
// (cp_traffic_bytes() evaluates it). cp == 1 runs the single-rank code unchanged.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/kokkos_types.hpp"
#include "core/pool.hpp"
#include "layers/conv1d.hpp"
#include "model/params.hpp"
#include "parallel/context_parallel.hpp"
#include "parallel/grid.hpp"
#include "ssm/mamba1/selective_scan.hpp"

namespace mm {

struct Mamba1Config {
  index_t d_model = 256;
  index_t d_state = 16;
  index_t d_conv = 4;
  index_t expand = 2;
  index_t dt_rank = 0;  // 0: ceil(d_model / 16)
  index_t chunk = 256;  // checkpoint interval of the selective scan (does not change results)
  index_t window = 0;   // sequences longer than this run in windows with carried states (ssm/windows.hpp); 0: off
  double dt_min = 1e-3, dt_max = 0.1, dt_init_floor = 1e-4;

  index_t d_inner() const { return expand * d_model; }
  index_t rank() const { return dt_rank > 0 ? dt_rank : (d_model + 15) / 16; }
  index_t d_xproj() const { return rank() + 2 * d_state; }
  // Bad values are an error naming them.
  void validate(const std::string& context) const;
};

// What the forward keeps for the backward. Under recompute only `u` (and the initial state) is kept.
template <class T>
struct Mamba1Acts {
  View2<T> u;       // input (B*L, D)
  View2<T> xz;      // in_proj output (B*L, 2E)
  View2<T> xc;      // conv output (B*L, E)
  View2<T> dt_low;  // (B*L, R)
  View2<T> bc;      // [B | C] (B*L, 2N)
  View2<T> delta;   // dt_proj output, without bias (B*L, E)
  View2<T> y;       // scan output (B*L, E)
  // the blocks of xz .. y (core/pool.hpp): back to the cache when the last copy of these acts goes
  std::shared_ptr<PoolScope> internals;
  View3<acc_t<T>> checkpoints;  // scan states at chunk starts
  View3<T> conv_init;           // copies of the initial state the forward started from (empty: zero)
  View3<acc_t<T>> ssm_init;     // (context parallel: the halo and the incoming state S_in)
  View2<T> cp_mask;             // context parallel: which halo entries are used (batch, d_conv - 1)
  std::vector<int> cp_cont;     // context parallel: per batch row, whether token 0 continues the left record
  std::vector<View3<T>> win_conv;        // windowed: the state entering each window w >= 1 (entry w - 1)
  std::vector<View3<acc_t<T>>> win_ssm;
  // the blocks of conv_init and ssm_init (an explicit initial state's copies) or, windowed, of win_conv and win_ssm
  std::shared_ptr<PoolScope> states;
};

// Decode state: conv (batch, E, d_conv - 1), the inputs before the next token, oldest first; ssm (batch, E, N).
template <class T>
struct Mamba1State {
  View3<T> conv;
  View3<acc_t<T>> ssm;
};

template <class T>
class Mamba1Mixer {
 public:
  using P = acc_t<T>;
  static_assert(std::is_same_v<T, P>, "bf16 activations need compute copies of the GEMM weights (GPU path)");

  // Registers the parameters under `prefix` (e.g. "backbone.layers.3.mixer.") in `store`: this rank's shards under
  // tensor parallelism (comms.tp of size > 1), the whole tensors otherwise.
  // comms.cp: the context-parallel communicator (size 1: the single-rank code).
  Mamba1Mixer(const Mamba1Config& cfg, ParamStore<P>& store, const std::string& prefix, index_t n_layer,
              const parallel::ModelComms& comms = {});

  // The unsharded configuration (this rank's inner width is d_inner / tp).
  const Mamba1Config& config() const { return cfg_; }

  // A zero decode state for `batch` rows (this rank's channels under tp).
  Mamba1State<T> make_state(index_t batch) const;
  // The same zeroed state over blocks of `ws` (core/pool.hpp; the windowed forward and backward: no device
  // allocation a step)
  Mamba1State<T> make_state(index_t batch, PoolScope& ws) const;

  // out (B*L, D) = mixer(u). If `save` is true the intermediates are kept in `acts` for the backward; otherwise
  // only u is referenced and backward() recomputes them.
  void forward(const View2<T>& u, index_t batch, index_t seqlen, const SeqIdxView& seq, const View2<T>& out,
               Mamba1Acts<T>& acts, bool save) const;

  // The same, starting from `init` (nullptr: zero state) and writing the state after the last token into `final`
  // (nullptr: not wanted). final may be init (the state carried in place). The initial state belongs to the record
  // of the first token; the final state is that of the last token's record. backward() after this forward gives
  // the gradients for the given (fixed) initial state.
  void forward(const View2<T>& u, index_t batch, index_t seqlen, const SeqIdxView& seq, const View2<T>& out,
               Mamba1Acts<T>& acts, bool save, const Mamba1State<T>* init, Mamba1State<T>* final) const;

  // Windows (config window W > 0, seqlen > W, cp = 1, no explicit states): forward() and backward() run the
  // sequence in windows of W tokens with carried states (ssm/windows.hpp); the layer's working memory then
  // follows W instead of seqlen, the results are those of one pass up to rounding.

  // du (B*L, D) is written; parameter gradients are accumulated into the store's gradient buffer.
  void backward(Mamba1Acts<T>& acts, index_t batch, index_t seqlen, const SeqIdxView& seq,
                const View2<const T>& dout, const View2<T>& du) const;

  // The backward of forward(..., init, final): `dfinal` (nullptr: zero) is the gradient of the final state, and
  // `dinit` (nullptr: not wanted) receives the gradient of the initial state (zero where the forward had none).
  void backward(Mamba1Acts<T>& acts, index_t batch, index_t seqlen, const SeqIdxView& seq,
                const View2<const T>& dout, const View2<T>& du, const Mamba1State<T>* dfinal,
                Mamba1State<T>* dinit) const;

  // Bytes one cp rank sends per layer forward + backward (the formula above) for `batch` rows.
  std::uint64_t cp_traffic_bytes(index_t batch, bool with_seq_idx) const;

  // One token per batch row: u (batch, D), state advanced in place, out (batch, D).
  void step(const View2<T>& u, Mamba1State<T>& state, const View2<T>& out) const;

 private:
  void run_internals(const View2<T>& u, index_t batch, index_t seqlen, const SeqIdxView& seq, Mamba1Acts<T>& acts,
                     bool keep_checkpoints, const View3<P>& final_ssm) const;
  // acts.u = u, and xz, xc, dt_low, bc, delta, y for n tokens from a new workspace scope (acts.internals)
  void take_activations(const View2<T>& u, index_t n, Mamba1Acts<T>& acts) const;
  SelScanShape scan_shape(index_t batch, index_t seqlen) const;
  SelScanIn<T> scan_in(const Mamba1Acts<T>& acts, const View2<P>& A, const SeqIdxView& seq) const;
  View2<P> A_matrix(PoolScope& ws) const;  // A = -exp(A_log), in a block of ws
  UView2<P> xproj_dt(const View1<P>& buf) const;  // rows [0, R) of an x_proj-shaped (R + 2N, E) slice
  UView2<P> xproj_bc(const View1<P>& buf) const;  // rows [R, R + 2N)
  void check_state(const Mamba1State<T>& s, index_t batch, const char* what) const;
  void forward_cp(const View2<T>& u, index_t batch, index_t seqlen, const SeqIdxView& seq, const View2<T>& out,
                  Mamba1Acts<T>& acts, bool save) const;

  Mamba1Config cfg_;
  index_t E_ = 0;  // this rank's inner width (d_inner when tp = 1)
  std::shared_ptr<const parallel::Comm> tp_;
  ParamStore<P>* store_;
  std::shared_ptr<const parallel::Comm> cp_;
  std::size_t in_proj_, conv_w_, conv_b_, x_proj_, dt_w_, dt_b_, A_log_, D_, out_proj_;
};

}  // namespace mm
