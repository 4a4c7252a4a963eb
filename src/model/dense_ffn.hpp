// The dense SwiGLU feed-forward layer (GatedMLP): the non-MoE baseline of an `E` layer, computed with the MoE
// expert kernels as one always-used expert (G = 1, every token in the group):
//
//   out = (silu(x W1^T) * (x W3^T)) W2^T          W1, W3 (d_ff, d), W2 (d, d_ff), no biases
//
// Parameters under the prefix: w1, w3, w2, initialised like one MoE expert (W1, W3 ~ U(+-1/sqrt(d)), W2 ~
// U(+-1/sqrt(d_ff)) / sqrt(n_layer)), so a dense layer with d_ff equal to an expert's has exactly the parameters of
// one expert. Token-local: rows are tokens.
//
// Tensor parallelism (comms.tp of size tp > 1, d_ff divides by tp): w1 and w3 are column-parallel (tp rank r holds
// rows r*d_ff/tp.. of each), w2 row-parallel (the matching columns); each carries its Shard and initialises to the
// slice of the unsharded layer. The output is all-reduced over tp in the forward, dx in the backward.
#pragma once

#include <string>

#include "core/kokkos_types.hpp"
#include "model/params.hpp"
#include "moe/experts.hpp"
#include "parallel/grid.hpp"

namespace mm {

struct DenseFFNConfig {
  index_t d_model = 256;
  index_t d_ff = 512;
  index_t param_count() const { return 3 * d_model * d_ff; }
  void validate(const std::string& context) const;
};

template <class T>
struct DenseFFNActs {
  View2<T> x;          // input (n, d)
  SwiGLUActs<T> a;     // h1, h3, a (n, d_ff); empty when not saved (rebuilt by backward)
};

template <class T>
class DenseFFN {
 public:
  using P = acc_t<T>;
  static_assert(std::is_same_v<T, P>, "bf16 activations need compute copies of the GEMM weights (GPU path)");

  DenseFFN(const DenseFFNConfig& cfg, ParamStore<P>& store, const std::string& prefix, index_t n_layer,
           const parallel::ModelComms& comms = {});

  // The unsharded configuration (this rank's d_ff is d_ff / tp).
  const DenseFFNConfig& config() const { return cfg_; }

  // out (n, d) = FFN(x). With save = false only x is kept and backward() recomputes the intermediates.
  void forward(const View2<T>& x, const View2<T>& out, DenseFFNActs<T>& acts, bool save) const;

  // dx (n, d) is written; weight gradients are accumulated into the store.
  void backward(DenseFFNActs<T>& acts, const View2<const T>& dout, const View2<T>& dx) const;

 private:
  SwiGLUWeights<T> weights() const;
  DenseFFNConfig cfg_;
  index_t F_ = 0;  // this rank's d_ff
  std::shared_ptr<const parallel::Comm> tp_;
  ParamStore<P>* store_;
  std::size_t w1_, w3_, w2_;
};

}  // namespace mm
