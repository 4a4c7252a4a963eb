// The Mamba-2 backbone shared by every model: n_layer pre-norm residual blocks on an fp32 residual stream, then the
// final RMSNorm (mamba_ssm's MixerModel without the embedding).
//
//   block l:  h <- h + mixer_l(RMSNorm_l(h))          out = RMSNorm_f(h)
//
// forward() keeps what backward() needs (everything, or only each block's input under the mixer recompute policy);
// a forward without training keeps nothing and updates the residual stream in place.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "model/params.hpp"
#include "ssm/mamba2/mixer.hpp"

namespace mm {

enum class Recompute { none, mixer };

template <class T>
class MambaBackbone {
 public:
  using P = acc_t<T>;
  using R = P;  // residual stream type (fp32, or double in tests)

  // Registers "<prefix>layers.<l>.norm.weight", "<prefix>layers.<l>.mixer.*" and "<prefix>norm_f.weight".
  MambaBackbone(const Mamba2Config& mixer, index_t n_layer, double norm_eps, ParamStore<P>& store,
                const std::string& prefix);

  index_t d_model() const { return cfg_.d_model; }

  // h (batch * seqlen, d_model): the residual stream entering block 0 (kept when training, overwritten otherwise);
  // out: the final-norm output.
  void forward(const View2<R>& h, index_t batch, index_t seqlen, const SeqIdxView& seq, bool train, Recompute policy,
               const View2<T>& out);

  // After a training forward: d(out) -> dh (written) = d(loss)/d(h entering block 0); parameter gradients are
  // accumulated. Releases the saved activations.
  void backward(const View2<const T>& dout, const View2<R>& dh);

 private:
  Mamba2Config cfg_;
  index_t n_layer_;
  double eps_;
  ParamStore<P>* store_;
  std::vector<std::size_t> norm_;
  std::size_t norm_f_;
  std::vector<std::unique_ptr<Mamba2Mixer<T>>> mixers_;
  // saved by a training forward
  index_t batch_ = 0, seqlen_ = 0;
  SeqIdxView seq_;
  std::vector<View2<R>> h_;
  std::vector<View1<P>> rstd_;
  std::vector<View2<T>> xn_;
  std::vector<Mamba2Acts<T>> acts_;
  View1<P> rstd_f_;
};

}  // namespace mm
