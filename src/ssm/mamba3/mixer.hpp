// The Mamba-3 mixer (mamba_ssm's Mamba3, SISO or MIMO of rank R), forward, backward and single-token step:
//
//   proj = in_proj(u)      columns [z (E) | x (E) | B (R G N) | C (R G N) | dd_dt (H) | dd_A (H) | trap (H) | angles (S)]
//   kn = RMSNorm_N(B) * B_norm,  qn = RMSNorm_N(C) * C_norm          (per (r, g) group of N, eps norm_eps)
//   v_{t,h,r} = x_{t,h} (* mimo_x[h, r] for MIMO)
//   y_{t,h,r} = Mamba-3 scan (see ssm/mamba3/scan.hpp: trapezoidal rule, data-dependent A, rotary, biases, D)
//   g_{t,h,r} = y * silu(z_h (* mimo_z[h, r]))                    or, with is_outproj_norm (norm_before_gate):
//             = RMSNorm_P(y) * norm_w[h] * silu(z_h (* mimo_z[h, r]))
//   o_{t,h} = sum_r (mimo_o[h, r] *) g_{t,h,r}
//   out = out_proj(o)
// There is no conv1d and no A_log. Initialisation follows mamba_ssm: in_proj and out_proj like torch.nn.Linear
// (out_proj then divided by sqrt(n_layer)), dt_bias = inverse softplus of exp(U[log dt_min, log dt_max]), D = 1,
// B_norm = C_norm = 1, B_bias = C_bias = 1, mimo_x = 1/R, mimo_z = 1, mimo_o = 1/R, norm weight = 1.
// The state (phi, S, k_prev, v_prev) lets a long sequence run in windows, and decoding run one token at a time.
//
// Context parallel (comms.cp of size > 1): each cp rank holds a contiguous slice of Lr tokens of every batch row
// (global record ids in seq). forward()/backward() without explicit states pass the carry (phi, S, k, v) along the
// ranks, in stages that each exchange a length-independent summary (parallel/context_parallel.hpp):
//   1. the local scan from a zero carry gives the slice's phase increment; an exclusive sum-scan of the phases
//      over the ranks (pairs (pass, phi) with pass = 0 where a record starts) gives the incoming phase phi_in;
//   2. the scan from (phi_in, 0, 0, 0) gives the slice's last rotated k and v, sent to the right neighbour
//      (k_prev, v_prev: the trapezoid's one-token halo);
//   3. the scan from (phi_in, 0, k_prev, v_prev) gives the final state, and the pairs (total decay
//      prod_t exp(A_t Delta_t) per (row, head), final state) fold into the incoming state S_in;
//   4. the mixer runs from the carry (phi_in, S_in, k_prev, v_prev).
// The backward mirrors it: G = d(init S) of the local backward with no final gradient, folded from the right into
// the final-state gradient dS; the local backward with (0, dS, 0, 0) gives d(k_prev), d(v_prev), sent to the left;
// the one with (0, dS, dk, dv) gives the phase gradient of the slice, folded from the right into d(phi_out); the
// last local backward runs with the full final-carry gradient. Correct, not yet fast: 4 local scans forward and
// 4 scan backwards (a kernel for the correction terms would remove most). Explicit states with cp > 1 are an error.
// Bytes one rank r of cp ranks sends per layer, forward + backward (independent of Lr):
//   2 * batch * (1 + H * S) * sizeof(P)  +  2 * batch * H * (1 + headdim * d_state) * sizeof(P)
// + batch * H * R * (d_state + headdim) * sizeof(P) * ([r < cp - 1] + [r > 0])  +  8 * batch * [r < cp - 1] * [seq]
// (S = nangles(), R = rank(); cp_traffic_bytes() evaluates it). cp == 1 runs the single-rank code unchanged.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/kokkos_types.hpp"
#include "core/pool.hpp"
#include "model/params.hpp"
#include "parallel/context_parallel.hpp"
#include "parallel/grid.hpp"
#include "ssm/mamba3/scan.hpp"
#include "tensor/gemm.hpp"  // bf16_op_t

namespace mm {

struct Mamba3Config {
  // Rotary pair convention: upstream SISO uses interleaved pairs, upstream MIMO halved ones (by_variant).
  enum class Pairing { by_variant, interleaved, halved };

  index_t d_model = 256;
  index_t d_state = 128;
  index_t headdim = 64;
  index_t expand = 2;
  index_t ngroups = 1;
  bool is_mimo = false;
  index_t mimo_rank = 4;
  index_t chunk_size = 64;
  bool is_outproj_norm = false;
  double rope_fraction = 0.5;
  Pairing rope_pairing = Pairing::by_variant;
  double A_floor = 1e-4;
  double dt_min = 1e-3, dt_max = 0.1, dt_init_floor = 1e-4;
  double norm_eps = 1e-5;
  // How the scan is computed (Mamba3ScanShape::algo, compute: SISO through the SSD kernels on CUDA by default)
  SSDAlgo scan_algo = SSDAlgo::automatic;
  GemmCompute scan_compute = GemmCompute::fp32;

  index_t d_inner() const { return expand * d_model; }
  index_t nheads() const { return d_inner() / headdim; }
  index_t rank() const { return is_mimo ? mimo_rank : 1; }
  // S = floor_even(N * rope_fraction) / 2 rotary angles
  index_t nangles() const {
    const index_t n = static_cast<index_t>(double(d_state) * rope_fraction);
    return (n - n % 2) / 2;
  }
  RopePairing pairing() const {
    if (rope_pairing == Pairing::interleaved) return RopePairing::interleaved;
    if (rope_pairing == Pairing::halved) return RopePairing::halved;
    return is_mimo ? RopePairing::halved : RopePairing::interleaved;
  }
  index_t d_in_proj() const { return 2 * d_inner() + 2 * rank() * ngroups * d_state + 3 * nheads() + nangles(); }
  // SISO with the gate's quads of columns (headdim and the in_proj width multiples of 4): the shapes whose backward
  // can hold in_proj's output gradient as its bf16 copy (Mamba3Mixer::bf16_in_proj_grad, and the planner)
  bool dproj_bf16_shape() const { return !is_mimo && headdim % 4 == 0 && d_in_proj() % 4 == 0; }
  // The scan's shape for `batch` rows of `seqlen` tokens (the mixer's; the planner's estimates)
  Mamba3ScanShape scan_shape(index_t batch, index_t seqlen) const;
  // Shapes that do not divide and out-of-range values are errors naming the values.
  void validate(const std::string& context) const;
};

// The recurrent state of one mixer for `batch` sequences (decode cache / window carry).
template <class T>
struct Mamba3State {
  Mamba3Carry<acc_t<T>> carry;
  index_t batch = 0;
};

// What the forward keeps for the backward. Under recompute only u (and the initial state) is kept.
template <class T>
struct Mamba3Acts {
  View2<T> u;     // input (B*L, D)
  View2<T> proj;  // in_proj output
  View2<T> qk;    // [qn (R G N) | kn (R G N)]
  View2<T> v;     // MIMO only: x * mimo_x (B*L, H R P)
  View2<T> y;     // scan output (B*L, H R P)
  View2<T> o;     // out_proj input (B*L, E); empty where it is kept only as its bf16 copy
  View2<bf16_op_t> o_b;  // ... its bf16 copy only, under bf16 GEMMs on CUDA (T = float; Mamba3Mixer::bf16_out_proj)
  View2<acc_t<T>> rstd_qk;   // (B*L, 2 R G)
  View2<acc_t<T>> rstd_out;  // (B*L, H R) with is_outproj_norm
  Mamba3ScanSaved<T> scan;   // the scan's forward context on the SSD route (scan.hpp), read by the backward
  Mamba3Carry<acc_t<T>> init;  // the initial state the forward started from (empty = zero)
  SeqIdxView seq;              // the record ids the forward used (empty = one record per row)
  std::vector<int> cp_cont, cp_whole;  // context parallel: per row, token 0 continues the left record / no record
                                       // starts inside the slice
  std::shared_ptr<PoolScope> internals;  // owns proj .. scan (cached blocks, not an allocation per step)
};

// How the backward holds in_proj's output gradient dproj (the dy of in_proj's GEMMs): automatic as its bf16 copy
// only where Mamba3Mixer::bf16_in_proj_grad holds (the gate and the B/C norms write their columns in bf16, the scan
// writes its v and dd columns in fp32 to a buffer without the z columns, rounded into the copy after it: the fp32
// block is neither written whole nor rounded whole for the GEMMs), fp32 (the form before; every other case). The
// GEMMs get the same bf16 operands either way. Tests and the benchmark set it; nothing else changes it.
enum class DprojStore { automatic, fp32 };
extern DprojStore dproj_store;

template <class T>
class Mamba3Mixer {
 public:
  using P = acc_t<T>;
  static_assert(std::is_same_v<T, P>, "bf16 activations need compute copies of the GEMM weights (GPU path)");

  // Registers the parameters under `prefix` in `store`.
  // Tensor parallelism (comms.tp of size > 1) is not implemented for Mamba-3: an error naming tp.
  // comms.cp: the context-parallel communicator (size 1: the single-rank code).
  Mamba3Mixer(const Mamba3Config& cfg, ParamStore<P>& store, const std::string& prefix, index_t n_layer,
              const parallel::ModelComms& comms = {});

  const Mamba3Config& config() const { return cfg_; }
  Mamba3ScanShape scan_shape(index_t batch, index_t seqlen) const;

  // A zero state for `batch` sequences.
  Mamba3State<T> make_state(index_t batch) const;

  // out (B*L, D) = mixer(u). `init` (optional) is the state before the first token; `final_state` (optional) gets
  // the state after the last token (it may be the same object as `init`, as in step(); then the backward cannot
  // use this forward, since the initial state is overwritten). If `save` is false only u and the initial state are
  // kept (by reference) and backward() recomputes the rest.
  void forward(const View2<T>& u, index_t batch, index_t seqlen, const View2<T>& out, Mamba3Acts<T>& acts,
               bool save, const Mamba3State<T>* init = nullptr, Mamba3State<T>* final_state = nullptr) const;

  // The same over packed records: seq (batch, seqlen) record ids, contiguous runs per row, or empty (one record).
  // The state (S, k_prev, v_prev, and the rotary phase, which restarts at 0) resets at a record boundary; the
  // initial state belongs to the record of the first token, the final state is that of the last token's record.
  void forward(const View2<T>& u, index_t batch, index_t seqlen, const SeqIdxView& seq, const View2<T>& out,
               Mamba3Acts<T>& acts, bool save, const Mamba3State<T>* init = nullptr,
               Mamba3State<T>* final_state = nullptr) const;

  // du (B*L, D) is written; parameter gradients are accumulated into the store's gradient buffer. `dfinal`
  // (optional) is the gradient of the final state; `dinit` (optional, allocated by the caller with make_state) gets
  // the gradient of the initial state.
  void backward(Mamba3Acts<T>& acts, index_t batch, index_t seqlen, const View2<const T>& dout, const View2<T>& du,
                const Mamba3State<T>* dfinal = nullptr, Mamba3State<T>* dinit = nullptr) const;
  // The same, with the record ids of the forward (as the other mixers take them; it must be the forward's seq).
  void backward(Mamba3Acts<T>& acts, index_t batch, index_t seqlen, const SeqIdxView& seq,
                const View2<const T>& dout, const View2<T>& du, const Mamba3State<T>* dfinal = nullptr,
                Mamba3State<T>* dinit = nullptr) const;

  // Whether the backward holds dproj as its bf16 copy only (DprojStore above): dproj_store automatic, T = float
  // under bf16 GEMMs (CUDA), SISO, and the gate's quads of columns (headdim and the in_proj width multiples of 4).
  bool bf16_in_proj_grad() const;

  // Bytes one cp rank sends per layer forward + backward (the formula above) for `batch` rows.
  std::uint64_t cp_traffic_bytes(index_t batch, bool with_seq_idx) const;

  // One decoding step: u (batch, D) -> out (batch, D), state updated in place.
  void step(const View2<T>& u, Mamba3State<T>& state, const View2<T>& out) const;

 private:
  void run_internals(const View2<T>& u, index_t batch, index_t seqlen, Mamba3Acts<T>& acts,
                     const Mamba3Carry<P>& final_carry) const;
  Mamba3ScanIn<T> scan_in(const Mamba3Acts<T>& acts) const;
  // out_proj's input kept only as the bf16 copy its GEMMs take (acts.o_b): T = float under bf16 GEMMs
  // (tensor/gemm.hpp, float_gemm_on_bf16_copies: CUDA only)
  bool bf16_out_proj() const;
  void out_proj_forward(const Mamba3Acts<T>& acts, const View2<T>& out) const;
  void out_proj_backward(const Mamba3Acts<T>& acts, const View2<const T>& dout, const View2<T>& dO) const;
  void forward_cp(const View2<T>& u, index_t batch, index_t seqlen, const SeqIdxView& seq, const View2<T>& out,
                  Mamba3Acts<T>& acts, bool save) const;

  Mamba3Config cfg_;
  ParamStore<P>* store_;
  std::shared_ptr<const parallel::Comm> cp_;
  std::size_t in_proj_, dt_bias_, D_, B_norm_, C_norm_, B_bias_, C_bias_, out_proj_;
  std::size_t mimo_x_ = 0, mimo_z_ = 0, mimo_o_ = 0, norm_w_ = 0;
};

}  // namespace mm
