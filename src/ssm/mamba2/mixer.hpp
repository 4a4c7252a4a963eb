// The Mamba-2 mixer (mamba_ssm's Mamba2 with d_mlp = 0), forward and backward:
//
//   zxbcdt = in_proj(u)                 columns [z (E) | x (E) | B (G N) | C (G N) | dt (H)]
//   xBC    = silu(causal_conv1d([x | B | C]))          (width d_conv, per channel, records never mixed)
//   y      = SSD(x, dt, A, B, C, D)                    (dt_bias + softplus, dt_limit clamp, D skip, groups)
//   yn     = RMSNorm_group(y * silu(z)) * w            (group size E / G, norm_before_gate = false)
//   out    = out_proj(yn)
//
// Initialisation follows mamba_ssm: in_proj and out_proj like torch.nn.Linear (out_proj then divided by
// sqrt(n_layer)), conv like torch.nn.Conv1d, A_log = log(U[A_init]), dt_bias = inverse softplus of
// exp(U[log dt_min, log dt_max]), D = 1, norm weight = 1.
//
// Decode: Mamba2State holds the last d_conv - 1 inputs of the conv ([x | B | C] columns) and the SSM state.
// forward() with an initial and/or final state processes a long sequence in windows (windowed == one pass);
// step() advances one token (dt_limit is applied there too, unlike mamba_ssm's step, so step == forward).
//
// Tensor parallelism (Megatron layout, comms.tp of size tp > 1; nheads and ngroups divide by tp): tp rank r holds
// in_proj rows [z_r | x_r | B_r | C_r | dt_r] (column-parallel, split per part), the conv channels [x_r | B_r | C_r],
// heads r*H/tp.. (dt_bias, A_log, D, the scan and the decode state), the norm weight of x_r (the norm is per group
// and each rank's groups are whole: no collective) and the out_proj columns of x_r (row-parallel). Every parameter
// carries its Shard and initialises to the slice of the unsharded model. The output is all-reduced over tp in the
// forward (and step), the input gradient in the backward; inputs and dout are the same on every tp rank.
// Context parallel (comms.cp of size > 1; parallel/context_parallel.hpp): each cp rank holds a contiguous slice
// of Lr tokens of every batch row (global record ids in seq_idx). forward()/backward() without explicit states
// then pass the state: the conv prefix is the left neighbour's last d_conv - 1 rows of [x | B | C] (the halo; its
// gradient goes back in the backward), the scan runs from a zero state, the pairs (total decay per (row, head),
// final local state) are all-gathered and folded into the incoming state S_in, and the outputs of the slice's
// first record get y_t += exp(l_t) C_t . S_in (l_t the in-slice decay cumsum). The backward forms
// G = sum_t exp(l_t) dy_t C_t^T, folds the pairs (decay, G) from the right into the gradient of the slice's final
// state and runs the local backward from S_in with it. Needs Lr >= d_conv - 1; explicit decode states with
// cp > 1 are an error. Bytes one rank r of cp ranks sends per layer, forward + backward (independent of Lr):
//   2 * batch * H * (1 + headdim * d_state) * sizeof(P)                     (the two all-gathers of the pairs)
// + batch * (d_conv - 1) * conv_dim * sizeof(T) * ([r < cp - 1] + [r > 0])  (halo forward, its gradient back)
// + batch * max(d_conv - 1, 1) * 8 * [r < cp - 1] * [seq_idx not empty]     (record ids of the halo rows)
// (cp_traffic_bytes() below evaluates it). cp == 1 runs the single-rank code unchanged.
#pragma once

#include <limits>
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
#include "ssm/mamba2/ssd.hpp"

namespace mm {

struct Mamba2Config {
  index_t d_model = 256;
  index_t d_state = 64;
  index_t d_conv = 4;
  index_t expand = 2;
  index_t headdim = 64;
  index_t ngroups = 1;
  index_t chunk = 256;
  double dt_min = 1e-3, dt_max = 0.1, dt_init_floor = 1e-4;
  double A_init_lo = 1, A_init_hi = 16;
  double dt_limit_lo = 0, dt_limit_hi = std::numeric_limits<double>::infinity();
  double norm_eps = 1e-5;
  // Sequences longer than this many tokens run in windows carrying the conv and SSM states (0: one pass); see
  // Mamba2Mixer::forward.
  index_t window = 0;
  SSDAlgo ssd_algo = SSDAlgo::automatic;        // how the chunked scan is computed (ssd.hpp)
  GemmCompute ssd_compute = GemmCompute::fp32;  // arithmetic of its chunk GEMMs on CUDA (fp32, tf32, bf16)

  index_t d_inner() const { return expand * d_model; }
  index_t nheads() const { return d_inner() / headdim; }
  index_t conv_dim() const { return d_inner() + 2 * ngroups * d_state; }
  index_t d_in_proj() const { return 2 * d_inner() + 2 * ngroups * d_state + nheads(); }
  // Shapes that do not divide are an error naming the values.
  void validate(const std::string& context) const;
};

// What the forward keeps for the backward. Under recompute only `u` is kept and the rest is rebuilt.
template <class T>
struct Mamba2Acts {
  View2<T> u;       // input (B*L, D)
  View2<T> zxbcdt;  // in_proj output
  View2<T> xbc;     // conv output
  View2<T> y;       // scan output (pre-norm)
  View2<T> yn;      // gated-norm output (out_proj input)
  // the gated-norm output as its bf16 copy only (instead of yn), where the GEMMs run on bf16 copies of their
  // operands (tensor/gemm.hpp, float_gemm_on_bf16_copies; T = float)
  View2<bf16_op_t> yn_b;
  // the input as its bf16 copy only (instead of u), from forward_bf16_input: in_proj's forward and weight gradient
  // read it
  View2<bf16_op_t> u_b;
  View2<acc_t<T>> rstd;
  SSDSaved<T> ssd;  // the scan's intermediates (gemm / fused algorithms), so its backward does not form them again
  // the blocks of zxbcdt, xbc, y, yn, rstd and ssd (core/pool.hpp): back to the cache when the last copy of these
  // acts goes (the forward's `save = false`, the backbone's reset after the layer's backward)
  std::shared_ptr<PoolScope> internals;
  View3<T> conv_init;           // copies of the initial state the forward started from (empty: zero)
  View4<acc_t<T>> ssm_init;     // (context parallel: the halo and the incoming state S_in)
  View2<T> cp_mask;             // context parallel: which halo entries are used (batch, d_conv - 1)
  std::vector<int> cp_cont;     // context parallel: per batch row, whether token 0 continues the left record
  // windowed (config window > 0 and seqlen > window): the state entering each window w >= 1 (index w - 1), already
  // zeroed for rows whose window starts a new record; the forward keeps only u and these
  std::vector<View3<T>> win_conv;
  std::vector<View4<acc_t<T>>> win_ssm;
  // the blocks of conv_init and ssm_init (an explicit initial state's copies) or, windowed, of win_conv and win_ssm
  std::shared_ptr<PoolScope> states;
};

// Decode state: conv (batch, conv_dim, d_conv - 1), the conv inputs before the next token, oldest first;
// ssm (batch, nheads, headdim, d_state).
template <class T>
struct Mamba2State {
  View3<T> conv;
  View4<acc_t<T>> ssm;
};

template <class T>
class Mamba2Mixer {
 public:
  using P = acc_t<T>;
  static_assert(std::is_same_v<T, P>, "bf16 activations need compute copies of the GEMM weights (GPU path)");

  // Registers the parameters under `prefix` (e.g. "backbone.layers.3.mixer.") in `store`: this rank's shards under
  // tensor parallelism (comms.tp of size > 1), the whole tensors otherwise.
  // comms.cp: the context-parallel communicator (size 1: the single-rank code).
  Mamba2Mixer(const Mamba2Config& cfg, ParamStore<P>& store, const std::string& prefix, index_t n_layer,
              const parallel::ModelComms& comms = {});

  // The unsharded configuration (the local widths under tp are d_inner / tp, nheads / tp, ngroups / tp).
  const Mamba2Config& config() const { return cfg_; }

  // out (B*L, D) = mixer(u). If `save` is true the intermediates are kept in `acts` for the backward; otherwise
  // only u is referenced and backward() recomputes them.
  void forward(const View2<T>& u, index_t batch, index_t seqlen, const SeqIdxView& seq, const View2<T>& out,
               Mamba2Acts<T>& acts, bool save) const;

  // The same, starting from `init` (nullptr: zero state) and writing the state after the last token into `final`
  // (nullptr: not wanted). final may be init (the state carried in place). The initial state belongs to the record
  // of the first token; the final state is that of the last token's record. backward() after this forward gives
  // the gradients for the given (fixed) initial state.
  void forward(const View2<T>& u, index_t batch, index_t seqlen, const SeqIdxView& seq, const View2<T>& out,
               Mamba2Acts<T>& acts, bool save, const Mamba2State<T>* init, Mamba2State<T>* final) const;

  // Whether forward_bf16_input may run at this length: T = float, GEMMs on bf16 copies of their operands
  // (tensor/gemm.hpp, float_gemm_on_bf16_copies: CUDA only), one rank along the sequence, no windows.
  bool takes_bf16_input(index_t seqlen) const;

  // forward(u, ..., save) with the input given only as its bf16 copy ub (B*L, D; host builds: bf16-rounded floats),
  // the backbone's block norm written in bf16 under bf16 GEMMs: in_proj's forward and weight gradient read ub in
  // place of rounding an fp32 input, so the caller keeps 2 bytes an element of the input instead of 4, and the
  // backward (acts.u_b = ub, acts.u empty) needs nothing else of it. The results are forward()'s on an fp32 input
  // holding the rounded values. T = float, cp = 1, no windows at this length (else an error).
  void forward_bf16_input(const View2<bf16_op_t>& ub, index_t batch, index_t seqlen, const SeqIdxView& seq,
                          const View2<T>& out, Mamba2Acts<T>& acts, bool save) const;

  // Windows (config window W > 0, seqlen > W, cp = 1, no explicit states): forward() and backward() run the
  // sequence in windows of W tokens with carried states (ssm/windows.hpp); the layer's working memory then
  // follows W instead of seqlen, the results are those of one pass up to rounding.

  // du (B*L, D) is written; parameter gradients are accumulated into the store's gradient buffer.
  void backward(Mamba2Acts<T>& acts, index_t batch, index_t seqlen, const SeqIdxView& seq,
                const View2<const T>& dout, const View2<T>& du) const;

  // The backward of forward(..., init, final): `dfinal` (nullptr: zero) is the gradient of the final state, and
  // `dinit` (nullptr: not wanted) receives the gradient of the initial state (zero where the forward had none).
  void backward(Mamba2Acts<T>& acts, index_t batch, index_t seqlen, const SeqIdxView& seq,
                const View2<const T>& dout, const View2<T>& du, const Mamba2State<T>* dfinal,
                Mamba2State<T>* dinit) const;

  // Bytes one cp rank sends per layer forward + backward (the formula above) for `batch` rows.
  std::uint64_t cp_traffic_bytes(index_t batch, bool with_seq_idx) const;

  // A zero decode state for `batch` rows (this rank's conv channels and heads under tp).
  Mamba2State<T> make_state(index_t batch) const;
  // The same zeroed state over blocks of `ws` (core/pool.hpp; the windowed forward and backward: no device
  // allocation a step)
  Mamba2State<T> make_state(index_t batch, PoolScope& ws) const;

  // One token per batch row: u (batch, D), state advanced in place, out (batch, D).
  void step(const View2<T>& u, Mamba2State<T>& state, const View2<T>& out) const;

 private:
  void run_internals(const View2<T>& u, index_t batch, index_t seqlen, const SeqIdxView& seq,
                     Mamba2Acts<T>& acts, const View4<P>& final_ssm) const;
  // acts.u = u, and zxbcdt, xbc, y, yn (or yn_b), rstd for n tokens from a new workspace scope (acts.internals)
  void take_activations(const View2<T>& u, index_t n, Mamba2Acts<T>& acts) const;
  void norm_forward(Mamba2Acts<T>& a) const;
  void out_proj_forward(const Mamba2Acts<T>& a, const View2<T>& out) const;
  void out_proj_backward(const Mamba2Acts<T>& a, const View2<const T>& dout, const View2<T>& dyn) const;
  bool bf16_out_proj() const;  // the gated-norm output kept as a bf16 copy only (yn_b)
  // the backward's d(zxbcdt) only as the bf16 copy in_proj's backward takes (one rank along the sequence; an
  // explicit final state's conv gradient is added into that copy after the conv's backward)
  bool bf16_in_proj_grad() const;
  SSDShape ssd_shape(index_t batch, index_t seqlen) const;
  SSDIn<T> ssd_in(const Mamba2Acts<T>& acts, const SeqIdxView& seq) const;
  void check_state(const Mamba2State<T>& s, index_t batch, const char* what) const;
  void forward_cp(const View2<T>& u, index_t batch, index_t seqlen, const SeqIdxView& seq, const View2<T>& out,
                  Mamba2Acts<T>& acts, bool save) const;
  bool windowed(index_t seqlen) const { return cfg_.window > 0 && seqlen > cfg_.window && cp_->size() == 1; }

  Mamba2Config cfg_;
  // this rank's widths: d_inner, nheads, ngroups, conv channels, in_proj rows (the global ones when tp = 1)
  index_t E_ = 0, H_ = 0, G_ = 0, C_ = 0, Din_ = 0;
  std::shared_ptr<const parallel::Comm> tp_;
  ParamStore<P>* store_;
  std::shared_ptr<const parallel::Comm> cp_;
  std::size_t in_proj_, conv_w_, conv_b_, dt_bias_, A_log_, D_, norm_w_, out_proj_;
};

}  // namespace mm
