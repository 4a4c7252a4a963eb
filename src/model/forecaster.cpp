#include "model/forecaster.hpp"

#include <cmath>

#include "core/error.hpp"
#include "layers/linear.hpp"
#include "tensor/ops.hpp"

namespace mm {

namespace {
constexpr double kRevinEps = 1e-5;     // added to the variance (RevIN)
constexpr double kAffineEps = 1e-10;   // guards the division by gamma when de-normalising (RevIN)
}  // namespace

void ForecastConfig::validate(const std::string& context) const {
  require(input_len >= 1 && horizon >= 1, context, "input_len and horizon must be positive");
  require(patch_len >= 1 && input_len % patch_len == 0, context, "input_len = ", input_len,
          " is not divisible by patch_len = ", patch_len);
  require(channels >= 1, context, "the series needs at least one channel");
  require(n_layer >= 1, context, "n_layer must be at least 1");
  mixer.validate(context);
  layers.validate(mixer.d_model, n_layer, context);
}

std::int64_t SeriesBatch::scored() const {
  std::int64_t n = 0;
  for (auto m : ym) n += m;
  return n;
}

template <class T>
Forecaster<T>::Forecaster(const ForecastConfig& cfg) : cfg_(cfg) {
  cfg_.validate("forecaster");
  const index_t D = cfg.mixer.d_model, p = cfg.patch_len, F = cfg.n_patch() * D, H = cfg.horizon;
  revin_w_ = params_.add("revin.weight", {cfg.channels}, false, Init::Ones());
  revin_b_ = params_.add("revin.bias", {cfg.channels}, false, Init::Zeros());
  const double bp = 1.0 / std::sqrt(double(p)), bf = 1.0 / std::sqrt(double(F));
  patch_w_ = params_.add("patch_embed.weight", {D, p}, true, Init::Uniform(-bp, bp));
  patch_b_ = params_.add("patch_embed.bias", {D}, false, Init::Uniform(-bp, bp));
  backbone_ =
      std::make_unique<MambaBackbone<T>>(cfg.mixer, cfg.n_layer, cfg.norm_eps, params_, "backbone.", cfg.layers);
  head_w_ = params_.add("head.weight", {H, F}, true, Init::Uniform(-bf, bf));
  head_b_ = params_.add("head.bias", {H}, false, Init::Uniform(-bf, bf));
  params_.allocate();
}

template <class T>
LossSum Forecaster<T>::forward_backward(const SeriesBatch& hb, double grad_scale, Recompute policy) {
  const index_t N = hb.rows, L = cfg_.input_len, H = cfg_.horizon, p = cfg_.patch_len, K = cfg_.n_patch();
  const index_t D = cfg_.mixer.d_model, C = cfg_.channels;
  require(hb.input_len == L && hb.horizon == H, "forecaster", "batch windows are ", hb.input_len, " + ", hb.horizon,
          " steps, the model expects ", L, " + ", H);
  require(index_t(hb.x.size()) == N * L && index_t(hb.y.size()) == N * H && index_t(hb.channel.size()) == N,
          "forecaster", "batch arrays do not match rows x steps");
  const bool train = grad_scale > 0;

  // Upload (masked values enter as 0 and are never read as data).
  View2<T> x = make_uninit<View2<T>>("forecast::x", N, L), y = make_uninit<View2<T>>("forecast::y", N, H);
  Kokkos::View<std::uint8_t**, Layout, Mem> xm("forecast::xm", N, L), ym("forecast::ym", N, H);
  Kokkos::View<std::int32_t*, Layout, Mem> ch("forecast::channel", N);
  {
    auto hx = Kokkos::create_mirror_view(x);
    auto hy = Kokkos::create_mirror_view(y);
    for (index_t i = 0; i < N * L; ++i) hx.data()[i] = hb.xm[std::size_t(i)] ? T(hb.x[std::size_t(i)]) : T(0);
    for (index_t i = 0; i < N * H; ++i) hy.data()[i] = hb.ym[std::size_t(i)] ? T(hb.y[std::size_t(i)]) : T(0);
    Kokkos::deep_copy(x, hx);
    Kokkos::deep_copy(y, hy);
    Kokkos::deep_copy(xm, Kokkos::View<const std::uint8_t**, Layout, HostMem>(hb.xm.data(), N, L));
    Kokkos::deep_copy(ym, Kokkos::View<const std::uint8_t**, Layout, HostMem>(hb.ym.data(), N, H));
    Kokkos::deep_copy(ch, Kokkos::View<const std::int32_t*, Layout, HostMem>(hb.channel.data(), N));
  }
  for (auto c : hb.channel) require(c >= 0 && c < C, "forecaster", "row channel ", c, " outside [0, ", C, ")");

  // RevIN statistics per row (no gradient flows through them) and the normalised input.
  const auto gamma = params_.v1(revin_w_);
  const auto beta = params_.v1(revin_b_);
  View1<P> mu = make_uninit<View1<P>>("forecast::mu", N), sd = make_uninit<View1<P>>("forecast::sd", N);
  View2<T> nrm = make_uninit<View2<T>>("forecast::nrm", N, L), xhat = make_uninit<View2<T>>("forecast::xhat", N, L);
  const bool affine = cfg_.revin_affine;
  par_for("forecast::revin_stats", N, KOKKOS_LAMBDA(index_t i) {
    P s = 0, n = 0;
    for (index_t t = 0; t < L; ++t)
      if (xm(i, t)) {
        s += P(x(i, t));
        n += 1;
      }
    const P m = n > 0 ? s / n : P(0);
    P v = 0;
    for (index_t t = 0; t < L; ++t)
      if (xm(i, t)) v += (P(x(i, t)) - m) * (P(x(i, t)) - m);
    mu(i) = m;
    sd(i) = n > 0 ? Kokkos::sqrt(v / n + P(kRevinEps)) : P(1);
  });
  par_for("forecast::revin", N, L, KOKKOS_LAMBDA(index_t i, index_t t) {
    const P v = xm(i, t) ? (P(x(i, t)) - mu(i)) / sd(i) : P(0);
    nrm(i, t) = T(v);
    xhat(i, t) = affine ? T(v * gamma(ch(i)) + beta(ch(i))) : T(v);
  });

  // Patch tokens: the (N, L) window is (N * K, p) row-major; embed, run the backbone, flatten, head.
  const UView2<T> patches(xhat.data(), N * K, p);
  View2<R> h = make_uninit<View2<R>>("forecast::h", N * K, D);
  linear_forward<T>(patches, params_.v2(patch_w_), params_.v1(patch_b_), h);
  View2<T> hf = make_uninit<View2<T>>("forecast::hf", N * K, D);
  backbone_->forward(h, N, K, SeqIdxView(), train, policy, hf);
  const UView2<T> flat(hf.data(), N, K * D);
  View2<T> yp = make_uninit<View2<T>>("forecast::yprime", N, H);
  linear_forward<T>(flat, params_.v2(head_w_), params_.v1(head_b_), yp);
  pred_ = make_uninit<View2<T>>("forecast::pred", N, H);
  const auto pred = pred_;
  const P aeps = P(kAffineEps);
  par_for("forecast::denorm", N, H, KOKKOS_LAMBDA(index_t i, index_t k) {
    const P v = affine ? (P(yp(i, k)) - beta(ch(i))) / (gamma(ch(i)) + aeps) : P(yp(i, k));
    pred(i, k) = T(v * sd(i) + mu(i));
  });

  LossSum loss;
  loss.nats = ordered_sum<double>("forecast::se", N * H, KOKKOS_LAMBDA(index_t r) {
    const index_t i = r / H, k = r % H;
    const double e = double(pred(i, k)) - double(y(i, k));
    return ym(i, k) ? e * e : 0.0;
  });
  loss.aux = ordered_sum<double>("forecast::ae", N * H, KOKKOS_LAMBDA(index_t r) {
    const index_t i = r / H, k = r % H;
    return ym(i, k) ? Kokkos::fabs(double(pred(i, k)) - double(y(i, k))) : 0.0;
  });
  loss.count = hb.scored();
  if (!train) return loss;

  // Backward.
  const P scale = P(grad_scale);
  View2<T> dyp = make_uninit<View2<T>>("forecast::dyprime", N, H);
  View2<P> dpred = make_uninit<View2<P>>("forecast::dpred", N, H);
  par_for("forecast::dloss", N, H, KOKKOS_LAMBDA(index_t i, index_t k) {
    const P d = ym(i, k) ? P(2) * scale * (P(pred(i, k)) - P(y(i, k))) : P(0);
    dpred(i, k) = d;
    dyp(i, k) = affine ? T(d * sd(i) / (gamma(ch(i)) + aeps)) : T(d * sd(i));
  });
  View2<T> dflat_v = make_uninit<View2<T>>("forecast::dhf", N * K, D);
  const UView2<T> dflat(dflat_v.data(), N, K * D);
  linear_backward<T>(flat, params_.v2(head_w_), dyp, dflat, false, params_.g2(head_w_), params_.g1(head_b_));
  View2<R> dh = make_uninit<View2<R>>("forecast::dh", N * K, D);
  backbone_->backward(dflat_v, dh, grad_scale * double(loss.count));  // MoE aux losses: see lm.hpp
  View2<T> dxhat = make_uninit<View2<T>>("forecast::dxhat", N, L);
  const UView2<T> dpatches(dxhat.data(), N * K, p);
  linear_backward<T>(patches, params_.v2(patch_w_), dh, dpatches, false, params_.g2(patch_w_),
                     params_.g1(patch_b_));
  if (affine) {
    // gamma_c and beta_c: from the normalisation of the inputs and the de-normalisation of the outputs, summed over
    // the rows of channel c in row order (deterministic).
    const auto dgamma = params_.g1(revin_w_);
    const auto dbeta = params_.g1(revin_b_);
    par_for("forecast::revin_grad", C, KOKKOS_LAMBDA(index_t c) {
      P dg = 0, db = 0;
      for (index_t i = 0; i < N; ++i) {
        if (ch(i) != c) continue;
        for (index_t t = 0; t < L; ++t) {
          dg += P(dxhat(i, t)) * P(nrm(i, t));
          db += P(dxhat(i, t));
        }
        const P g = gamma(c) + aeps;
        for (index_t k = 0; k < H; ++k) {
          const P d = dpred(i, k) * sd(i);
          dg -= d * (P(yp(i, k)) - beta(c)) / (g * g);
          db -= d / g;
        }
      }
      dgamma(c) += dg;
      dbeta(c) += db;
    });
  }
  return loss;
}

template <class T>
std::vector<double> Forecaster<T>::predictions() const {
  auto h = Kokkos::create_mirror_view_and_copy(HostMem(), pred_);
  return std::vector<double>(h.data(), h.data() + h.span());
}

template class Forecaster<float>;
template class Forecaster<double>;

}  // namespace mm
