// The backbone shared by every model: a pattern of pre-norm residual blocks on an fp32 residual stream, then the
// final RMSNorm (mamba_ssm's MixerModel without the embedding, generalised to mixed layer kinds):
//
//   block l:  h <- h + layer_l(RMSNorm_l(h))          out = RMSNorm_f(h)
//
// layer_l is one of (codes of the layer pattern):
//   M1  Mamba-1 mixer (ssm/mamba1)      M2  Mamba-2 mixer (ssm/mamba2)      M3  Mamba-3 mixer (ssm/mamba3)
//   E   MoE SwiGLU feed-forward (moe/moe_layer)      D   dense SwiGLU feed-forward (model/dense_ffn)
// The default pattern is n_layer x M2 (the original Mamba-2 backbone, same parameter names and bit-identical
// results). Parameter names: "<prefix>layers.<l>.norm.weight", then the layer's own under "<prefix>layers.<l>.mixer."
// (M1, M2, M3), ".moe." (E) or ".mlp." (D); "<prefix>norm_f.weight".
//
// forward() keeps what backward() needs: everything under Recompute::none; under Recompute::mixer only each
// block's residual input h_l and rstd_l (plus what a layer keeps beyond its input: MoE routing, the jittered router
// input, decode/cp initial states). The normed input xn_l = RMSNorm_l(h_l), which is also the layer's input, is
// dropped after the block's forward and recomputed by backward() with the same kernel (bit-identical) just before
// the layer's backward, which then rebuilds the layer's activations from it. Where a Mamba-2 layer's GEMMs run on
// bf16 copies (Mamba2Mixer::takes_bf16_input: CUDA, float, bf16 GEMMs, cp = 1, no windows), xn_l is written only as
// its bf16 copy (the norm's output rounded, which is what in_proj's GEMMs take) and kept or recomputed as such.
// a forward without training keeps nothing and updates the residual stream in place. MoE layers return auxiliary
// losses (load balancing, z-loss): the backbone sums them (last_aux()) and backward() takes their gradient scale;
// routing statistics of the training forwards are accumulated until end_step(), which also applies the expert-bias
// update once per optimizer step.
//
// Decode: BackboneState holds one state per layer (monostate for the stateless E and D layers); prefill() runs a
// forward from a state and leaves the final state in it, step() advances one token per row. MoE routing is
// token-local only when dropless (capacity_factor 0): with a capacity limit a step (one token per row) and a full
// forward may drop different assignments.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "model/dense_ffn.hpp"
#include "model/params.hpp"
#include "parallel/grid.hpp"
#include "moe/moe_layer.hpp"
#include "ssm/mamba1/mixer.hpp"
#include "ssm/mamba2/mixer.hpp"
#include "ssm/mamba3/mixer.hpp"

namespace mm {

enum class Recompute { none, mixer };

enum class LayerKind { mamba1, mamba2, mamba3, moe, dense };

// "M1" ... "D".
const char* layer_code(LayerKind k);
// Layer codes separated by spaces ("M2 M2 M3 E") or written together ("M2M2M3E"); an unknown code is an
// mm::Error naming `context` (the deck key), the offending text and the valid codes. Empty text: empty pattern.
std::vector<LayerKind> parse_layer_pattern(const std::string& text, const std::string& context);
std::string pattern_string(const std::vector<LayerKind>& p);  // space-separated codes

// The layer kinds beyond Mamba-2 and their configurations (d_model is taken from the Mamba-2 config).
struct LayerStackConfig {
  std::vector<LayerKind> pattern;  // empty: n_layer x M2
  Mamba1Config mamba1;
  Mamba3Config mamba3;
  MoEConfig moe;
  index_t dense_d_ff = 0;          // 0: moe.d_ff (a D layer then has exactly one expert's parameters)

  // The pattern actually used for n_layer layers; throws if a given pattern's length is not n_layer.
  std::vector<LayerKind> resolve(index_t n_layer, const std::string& context) const;
  // Validates the configurations of the kinds that `pattern` uses (d_model filled in).
  void validate(index_t d_model, index_t n_layer, const std::string& context) const;
};

// Decode state of the whole backbone: one entry per layer.
template <class T>
using LayerState = std::variant<std::monostate, Mamba1State<T>, Mamba2State<T>, Mamba3State<T>>;
template <class T>
struct BackboneState {
  index_t batch = 0;
  std::vector<LayerState<T>> layers;
};

// Routing statistics of one MoE layer accumulated over the training forwards of a step.
struct MoELayerStats {
  index_t layer = 0;
  std::vector<double> routed, kept;  // per expert
  double assignments = 0, dropped = 0;
  double exchange_seconds = 0;       // this rank's wall seconds in the layer's all-to-alls during the step (ep > 1)
  double imbalance() const;          // max / mean of routed (1 = balanced)
};

template <class T>
class MambaBackbone {
 public:
  using P = acc_t<T>;
  using R = P;  // residual stream type (fp32, or double in tests)

  // Registers the parameters (see above). `layers` (optional) gives the pattern and the other kinds' configs.
  MambaBackbone(const Mamba2Config& mixer, index_t n_layer, double norm_eps, ParamStore<P>& store,
                const std::string& prefix, const LayerStackConfig& layers = {},
                const parallel::ModelComms& comms = {});
  ~MambaBackbone();

  index_t d_model() const { return cfg_.d_model; }
  const std::vector<LayerKind>& pattern() const { return kinds_; }
  bool has_moe() const;

  // Parameters of the backbone (all of them; norms included), and those used per token: an MoE layer counts its
  // router, top_k experts and shared expert only (the expert-bias buffer is not a parameter used by the gradient
  // and counts in neither).
  index_t param_count() const;
  index_t active_param_count() const;
  index_t buffer_count() const;  // the expert-bias buffers' entries

  // Router-jitter context of the next training forwards (the step of the optimizer).
  // Also the start of the step's all-to-all timing (what evaluations in between spent is dropped).
  void set_step(std::uint64_t seed, std::uint64_t step);

  // h (batch * seqlen, d_model): the residual stream entering block 0 (kept when training, overwritten otherwise);
  // out: the final-norm output. seq (batch, seqlen) record ids, or empty: every mixer resets its state at a record
  // boundary.
  void forward(const View2<R>& h, index_t batch, index_t seqlen, const SeqIdxView& seq, bool train, Recompute policy,
               const View2<T>& out);

  // Sum of the MoE auxiliary losses (coefficients included) of the last forward; 0 without MoE layers.
  double last_aux() const { return last_aux_; }

  // After a training forward: d(out) -> dh (written) = d(loss)/d(h entering block 0), for loss = (the loss whose
  // gradient is dout) + aux_scale * last_aux(); parameter gradients are accumulated. Releases the activations.
  void backward(const View2<const T>& dout, const View2<R>& dh, double aux_scale = 1.0);
  // Called by backward() after block l's backward has been issued, with the flat offset (in the store) of block
  // l's first parameter: from there to the end of the backbone's parameters every gradient of this backward is
  // final (block l's, the later blocks', norm_f's). For the data-parallel exchange that overlaps the backward.
  void set_grads_ready_hook(std::function<void(index_t)> hook) { grads_ready_ = std::move(hook); }

  // Once per optimizer step, after it: updates the expert biases from the load of the step's training forwards,
  // returns the step's routing statistics (one entry per MoE layer) and starts a new accumulation.
  // `reduce` (optional): the ranks whose tokens together make up the step (the statistics are summed over them
  // first, so every rank applies the same update).
  std::vector<MoELayerStats> end_step(const parallel::Comm* reduce = nullptr);

  // Decode: a zero state for `batch` rows; prefill (batch * seqlen rows, single record per row) from the state,
  // leaving the state after the last token in it; step: one token per row, h (batch, d_model).
  BackboneState<T> make_state(index_t batch) const;
  void prefill(const View2<R>& h, index_t batch, index_t seqlen, BackboneState<T>& state, const View2<T>& out);
  void step(const View2<R>& h, BackboneState<T>& state, const View2<T>& out);

 private:
  struct Layer;
  struct Acts;
  void check_state(const BackboneState<T>& s, index_t batch) const;
  // The layer's input reference in its acts (Mamba*Acts::u, MoEActs::x, DenseFFNActs::x): set to xn, or cleared.
  static void set_layer_input(Acts& a, LayerKind kind, const View2<T>& xn);
  // Whether block l's training forward writes xn_l only as its bf16 copy (xnb_[l]): a Mamba-2 layer that takes it.
  bool bf16_input(index_t l, index_t seqlen) const;
  // xn_l = RMSNorm_l(h_l) into a new block of xn_ws_[l] (fp32 xn_[l], or for training the bf16 xnb_[l] where
  // bf16_input), set as the layer's input in `a`
  void norm_input(index_t l, const View2<R>& h, index_t n, Acts& a, bool train);
  // One block's layer on xn (n rows) -> m; decode states optional (nullptr: zero / not wanted).
  double layer_forward(index_t l, const View2<T>& xn, index_t batch, index_t seqlen, const SeqIdxView& seq,
                       const View2<T>& m, Acts& a, bool save, bool train, LayerState<T>* state);

  Mamba2Config cfg_;
  parallel::ModelComms comms_;
  std::vector<LayerKind> kinds_;
  index_t n_layer_;
  double eps_;
  ParamStore<P>* store_;
  std::vector<std::size_t> norm_;
  std::size_t norm_f_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::uint64_t step_seed_ = 0, step_ = 0;
  double last_aux_ = 0;
  std::vector<MoELayerStats> moe_acc_;
  std::function<void(index_t)> grads_ready_;
  // saved by a training forward
  index_t batch_ = 0, seqlen_ = 0;
  SeqIdxView seq_;
  std::vector<View2<R>> h_;
  std::vector<View1<P>> rstd_;
  std::vector<View2<T>> xn_;
  std::vector<View2<bf16_op_t>> xnb_;  // xn_l as its bf16 copy only (bf16_input(l))
  std::vector<std::unique_ptr<Acts>> acts_;
  View1<P> rstd_f_;
  // the blocks (core/pool.hpp) of h_, rstd_ and rstd_f_ (from forward() to the end of backward() or the next
  // forward()), and of each xn_[l] (dropped and taken again with it)
  std::unique_ptr<PoolScope> step_ws_;
  std::vector<std::unique_ptr<PoolScope>> xn_ws_;
};

}  // namespace mm
