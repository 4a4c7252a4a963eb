#include "model/backbone.hpp"

#include <algorithm>
#include <cctype>

#include "core/error.hpp"
#include "layers/rmsnorm.hpp"

namespace mm {

// ------------------------------------------------------------------ pattern

namespace {
constexpr const char* kValidCodes = "M1 (Mamba-1), M2 (Mamba-2), M3 (Mamba-3), E (MoE feed-forward), D (dense feed-forward)";
}  // namespace

const char* layer_code(LayerKind k) {
  switch (k) {
    case LayerKind::mamba1: return "M1";
    case LayerKind::mamba2: return "M2";
    case LayerKind::mamba3: return "M3";
    case LayerKind::moe: return "E";
    case LayerKind::dense: return "D";
  }
  return "?";
}

std::vector<LayerKind> parse_layer_pattern(const std::string& text, const std::string& context) {
  std::vector<LayerKind> out;
  std::size_t i = 0;
  while (i < text.size()) {
    const char c = text[i];
    if (std::isspace(static_cast<unsigned char>(c)) || c == ',') {
      ++i;
      continue;
    }
    const char u = char(std::toupper(static_cast<unsigned char>(c)));
    if (u == 'E' || u == 'D') {
      out.push_back(u == 'E' ? LayerKind::moe : LayerKind::dense);
      ++i;
      continue;
    }
    if (u == 'M' && i + 1 < text.size() && text[i + 1] >= '1' && text[i + 1] <= '3') {
      out.push_back(text[i + 1] == '1' ? LayerKind::mamba1 : text[i + 1] == '2' ? LayerKind::mamba2 : LayerKind::mamba3);
      i += 2;
      continue;
    }
    // the unknown token: up to the next separator
    std::size_t j = i;
    while (j < text.size() && !std::isspace(static_cast<unsigned char>(text[j])) && text[j] != ',') ++j;
    throw Error(context, "unknown layer code '" + text.substr(i, j - i) + "' at position " + std::to_string(i) +
                             " of pattern '" + text + "'; valid codes: " + kValidCodes);
  }
  return out;
}

std::string pattern_string(const std::vector<LayerKind>& p) {
  std::string s;
  for (std::size_t i = 0; i < p.size(); ++i) s += (i ? " " : "") + std::string(layer_code(p[i]));
  return s;
}

std::vector<LayerKind> LayerStackConfig::resolve(index_t n_layer, const std::string& context) const {
  if (pattern.empty()) return std::vector<LayerKind>(std::max<index_t>(n_layer, 0), LayerKind::mamba2);
  require(index_t(pattern.size()) == n_layer, context, "the layer pattern '", pattern_string(pattern), "' has ",
          pattern.size(), " layers but n_layer = ", n_layer);
  return pattern;
}

void LayerStackConfig::validate(index_t d_model, index_t n_layer, const std::string& context) const {
  const auto p = resolve(n_layer, context);
  auto uses = [&](LayerKind k) { return std::find(p.begin(), p.end(), k) != p.end(); };
  if (uses(LayerKind::mamba1)) {
    Mamba1Config c = mamba1;
    c.d_model = d_model;
    c.validate(context + " (Mamba-1 layers)");
  }
  if (uses(LayerKind::mamba3)) {
    Mamba3Config c = mamba3;
    c.d_model = d_model;
    c.validate(context + " (Mamba-3 layers)");
  }
  if (uses(LayerKind::moe)) {
    MoEConfig c = moe;
    c.d_model = d_model;
    require(!c.state_aware, context, "the state-aware router is not available in a layer pattern");
    c.validate(context + " (MoE layers)");
  }
  if (uses(LayerKind::dense))
    DenseFFNConfig{d_model, dense_d_ff > 0 ? dense_d_ff : moe.d_ff}.validate(context + " (dense layers)");
}

double MoELayerStats::imbalance() const {
  double mx = 0, sum = 0;
  for (double c : routed) mx = std::max(mx, c), sum += c;
  return sum > 0 ? mx * double(routed.size()) / sum : 0.0;
}

// ------------------------------------------------------------------ layers

namespace {
// out = a + m over (rows, d_model) (out may be a): four floats a work item where the rows allow it.
template <class R, class T>
void residual_add(const View2<R>& out, const View2<R>& a, const View2<T>& m) {
  const index_t n = out.extent(0), D = out.extent(1);
  if constexpr (std::is_same_v<R, float> && std::is_same_v<T, float>) {
    if (D % 4 == 0 && out.span_is_contiguous() && a.span_is_contiguous() && m.span_is_contiguous() &&
        aligned16(out.data()) && aligned16(a.data()) && aligned16(m.data())) {
      float* o = out.data();
      const float* x = a.data();
      const float* y = m.data();
      par_for("backbone::residual_add", n * D / 4, KOKKOS_LAMBDA(index_t q) {
        Float4 u = load_f4(x + 4 * q);
        const Float4 v = load_f4(y + 4 * q);
        for (int k = 0; k < 4; ++k) u.v[k] += v.v[k];
        store_f4(o + 4 * q, u);
      });
      return;
    }
  }
  par_for("backbone::residual_add", n, D, KOKKOS_LAMBDA(index_t i, index_t j) { out(i, j) = a(i, j) + R(m(i, j)); });
}
}  // namespace

template <class T>
struct MambaBackbone<T>::Layer {
  LayerKind kind;
  std::unique_ptr<Mamba1Mixer<T>> m1;
  std::unique_ptr<Mamba2Mixer<T>> m2;
  std::unique_ptr<Mamba3Mixer<T>> m3;
  std::unique_ptr<MoELayer<T>> moe;
  std::unique_ptr<DenseFFN<T>> dense;
};

template <class T>
struct MambaBackbone<T>::Acts {
  Mamba1Acts<T> m1;
  Mamba2Acts<T> m2;
  Mamba3Acts<T> m3;
  MoEActs<T> moe;
  DenseFFNActs<T> dense;
};

template <class T>
MambaBackbone<T>::~MambaBackbone() = default;

template <class T>
void MambaBackbone<T>::set_layer_input(Acts& a, LayerKind kind, const View2<T>& xn) {
  switch (kind) {
    case LayerKind::mamba1: a.m1.u = xn; break;
    case LayerKind::mamba2: a.m2.u = xn; break;
    case LayerKind::mamba3: a.m3.u = xn; break;
    case LayerKind::moe: a.moe.x = xn; break;
    case LayerKind::dense: a.dense.x = xn; break;
  }
}

template <class T>
MambaBackbone<T>::MambaBackbone(const Mamba2Config& mixer, index_t n_layer, double norm_eps, ParamStore<P>& store,
                                const std::string& prefix, const LayerStackConfig& layers,
                                const parallel::ModelComms& comms)
    : cfg_(mixer), comms_(comms), n_layer_(n_layer), eps_(norm_eps), store_(&store) {
  require(n_layer >= 1, prefix, "n_layer must be at least 1 (got ", n_layer, ")");
  kinds_ = layers.resolve(n_layer, prefix);
  const index_t D = mixer.d_model;
  for (index_t l = 0; l < n_layer; ++l) {
    const std::string p = prefix + "layers." + std::to_string(l) + ".";
    norm_.push_back(store.add(p + "norm.weight", {D}, false, Init::Ones()));
    auto L = std::make_unique<Layer>();
    L->kind = kinds_[l];
    switch (L->kind) {
      case LayerKind::mamba1: {
        Mamba1Config c = layers.mamba1;
        c.d_model = D;
        L->m1 = std::make_unique<Mamba1Mixer<T>>(c, store, p + "mixer.", n_layer, comms);
        break;
      }
      case LayerKind::mamba2: L->m2 = std::make_unique<Mamba2Mixer<T>>(mixer, store, p + "mixer.", n_layer, comms); break;
      case LayerKind::mamba3: {
        Mamba3Config c = layers.mamba3;
        c.d_model = D;
        L->m3 = std::make_unique<Mamba3Mixer<T>>(c, store, p + "mixer.", n_layer, comms);
        break;
      }
      case LayerKind::moe: {
        MoEConfig c = layers.moe;
        c.d_model = D;
        require(!c.state_aware, p + "moe.", "the state-aware router is not available in a layer pattern");
        L->moe = std::make_unique<MoELayer<T>>(c, store, p + "moe.", n_layer, comms);
        MoELayerStats s;
        s.layer = l;
        s.routed.assign(c.n_experts, 0.0);
        s.kept.assign(c.n_experts, 0.0);
        moe_acc_.push_back(s);
        break;
      }
      case LayerKind::dense: {
        const DenseFFNConfig c{D, layers.dense_d_ff > 0 ? layers.dense_d_ff : layers.moe.d_ff};
        L->dense = std::make_unique<DenseFFN<T>>(c, store, p + "mlp.", n_layer, comms);
        break;
      }
    }
    layers_.push_back(std::move(L));
  }
  norm_f_ = store.add(prefix + "norm_f.weight", {D}, false, Init::Ones());
}

template <class T>
bool MambaBackbone<T>::has_moe() const {
  return !moe_acc_.empty();
}

template <class T>
index_t MambaBackbone<T>::param_count() const {
  // the constructor registers the backbone's parameters one after the other: norms, layers, final norm (the
  // unsharded sizes: the model's parameters, whatever slice of them this rank holds)
  const auto& e = store_->entries();
  index_t n = 0;
  for (std::size_t i = norm_.front(); i <= norm_f_; ++i) n += e[i].global_size();
  return n - buffer_count();
}

template <class T>
index_t MambaBackbone<T>::buffer_count() const {
  index_t n = 0;
  for (const auto& L : layers_)
    if (L->kind == LayerKind::moe && L->moe->has_expert_bias()) n += L->moe->config().n_experts;
  return n;
}

template <class T>
index_t MambaBackbone<T>::active_param_count() const {
  index_t n = param_count();
  for (const auto& L : layers_)
    if (L->kind == LayerKind::moe) n -= L->moe->param_count() - L->moe->active_param_count();
  return n;
}

template <class T>
bool MambaBackbone<T>::bf16_input(index_t l, index_t seqlen) const {
  if constexpr (std::is_same_v<T, float> && std::is_same_v<R, float>)
    return kinds_[l] == LayerKind::mamba2 && layers_[l]->m2->takes_bf16_input(seqlen);
  return false;
}

template <class T>
void MambaBackbone<T>::norm_input(index_t l, const View2<R>& h, index_t n, Acts& a, bool train) {
  const index_t D = cfg_.d_model;
  xn_ws_[l] = std::make_unique<PoolScope>();
  if constexpr (std::is_same_v<T, float> && std::is_same_v<R, float>) {
    if (train && bf16_input(l, seqlen_)) {
      xnb_[l] = xn_ws_[l]->take<View2<bf16_op_t>>("backbone::xn_bf16", n, D);
      rmsnorm_forward_bf16(h, store_->v1(norm_[l]), eps_, xnb_[l], rstd_[l]);
      a.m2.u_b = xnb_[l];
      return;
    }
  }
  xn_[l] = xn_ws_[l]->take<View2<T>>("backbone::xn", n, D);
  rmsnorm_forward<R, T>(h, store_->v1(norm_[l]), eps_, xn_[l], rstd_[l]);
  set_layer_input(a, kinds_[l], xn_[l]);
}

template <class T>
double MambaBackbone<T>::layer_forward(index_t l, const View2<T>& xn, index_t batch, index_t seqlen,
                                       const SeqIdxView& seq, const View2<T>& m, Acts& a, bool save, bool train,
                                       LayerState<T>* state) {
  Layer& L = *layers_[l];
  switch (L.kind) {
    case LayerKind::mamba1: {
      auto* s = state ? &std::get<Mamba1State<T>>(*state) : nullptr;
      L.m1->forward(xn, batch, seqlen, seq, m, a.m1, save, s, s);
      return 0;
    }
    case LayerKind::mamba2: {
      if (state) {
        auto* s = &std::get<Mamba2State<T>>(*state);
        L.m2->forward(xn, batch, seqlen, seq, m, a.m2, save, s, s);
      } else {
        L.m2->forward(xn, batch, seqlen, seq, m, a.m2, save);
      }
      return 0;
    }
    case LayerKind::mamba3: {
      auto* s = state ? &std::get<Mamba3State<T>>(*state) : nullptr;
      L.m3->forward(xn, batch, seqlen, seq, m, a.m3, save, s, s);
      return 0;
    }
    case LayerKind::moe: {
      const MoELosses losses = L.moe->forward(xn, m, a.moe, save, MoEStep{train, step_seed_, step_, batch});
      if (train) {
        auto it = std::find_if(moe_acc_.begin(), moe_acc_.end(), [&](const MoELayerStats& s) { return s.layer == l; });
        const MoEStats& st = a.moe.stats;
        for (std::size_t e = 0; e < st.routed.size(); ++e) {
          it->routed[e] += double(st.routed[e]);
          it->kept[e] += double(st.kept[e]);
        }
        it->assignments += double(st.assignments);
        it->dropped += double(st.dropped);
      }
      return losses.total();
    }
    case LayerKind::dense: L.dense->forward(xn, m, a.dense, save); return 0;
  }
  return 0;
}

template <class T>
void MambaBackbone<T>::forward(const View2<R>& h, index_t batch, index_t seqlen, const SeqIdxView& seq, bool train,
                               Recompute policy, const View2<T>& out) {
  const index_t n = batch * seqlen, D = cfg_.d_model, NL = n_layer_;
  require(index_t(h.extent(0)) == n && index_t(h.extent(1)) == D && index_t(out.extent(0)) == n, "backbone",
          "inputs must be (batch * seqlen, d_model)");
  const bool save = train && policy == Recompute::none;
  batch_ = batch;
  seqlen_ = seqlen;
  seq_ = seq;
  h_.assign(train ? NL + 1 : 1, View2<R>());
  rstd_.assign(NL, View1<P>());
  xn_.assign(NL, View2<T>());
  xnb_.assign(NL, View2<bf16_op_t>());
  rstd_f_ = View1<P>();
  acts_.clear();
  xn_ws_.clear();
  xn_ws_.resize(std::size_t(NL));
  step_ws_ = std::make_unique<PoolScope>();  // the previous step's blocks go back (their views are gone above)
  for (index_t l = 0; l < NL; ++l) acts_.push_back(std::make_unique<Acts>());
  h_[0] = h;
  last_aux_ = 0;
  PoolScope local;
  View2<T> m = local.take<View2<T>>("backbone::mixer_out", n, D);
  for (index_t l = 0; l < NL; ++l) {
    const View2<R> hin = train ? h_[l] : h;
    rstd_[l] = step_ws_->take<View1<P>>("backbone::rstd", n);
    norm_input(l, hin, n, *acts_[l], train);
    if (xnb_[l].extent(0) > 0)
      layers_[l]->m2->forward_bf16_input(xnb_[l], batch, seqlen, seq, m, acts_[l]->m2, save);
    else
      last_aux_ += layer_forward(l, xn_[l], batch, seqlen, seq, m, *acts_[l], save, train, nullptr);
    // under the mixer policy every layer keeps only xn_l of what reads it (as its input), and backward()
    // recomputes xn_l from h_l: drop both references so the memory is freed now
    if (train && !save) {
      xn_[l] = View2<T>();
      xnb_[l] = View2<bf16_op_t>();
      set_layer_input(*acts_[l], kinds_[l], View2<T>());
      acts_[l]->m2.u_b = View2<bf16_op_t>();
      xn_ws_[l].reset();
    }
    const View2<R> hout = train ? (h_[l + 1] = step_ws_->take<View2<R>>("backbone::h", n, D)) : h;
    residual_add(hout, hin, m);
    if (!train) {
      xn_[l] = View2<T>();
      acts_[l] = std::make_unique<Acts>();
      xn_ws_[l].reset();
    }
  }
  rstd_f_ = step_ws_->take<View1<P>>("backbone::rstd_f", n);
  rmsnorm_forward<R, T>(train ? h_[NL] : h, store_->v1(norm_f_), eps_, out, rstd_f_);
}

template <class T>
void MambaBackbone<T>::backward(const View2<const T>& dout, const View2<R>& dh, double aux_scale) {
  const index_t NL = n_layer_, n = batch_ * seqlen_, D = cfg_.d_model;
  require(index_t(h_.size()) == NL + 1, "backbone", "backward() needs a training forward() first");
  rmsnorm_backward<R, T>(h_[NL], store_->v1(norm_f_), rstd_f_, dout, dh, false, store_->g1(norm_f_));
  PoolScope local;
  View2<T> dxn = local.take<View2<T>>("backbone::dxn", n, D);
  for (index_t l = NL - 1; l >= 0; --l) {
    // the residual passes dh through unchanged: it is also d(layer output); then through the pre-norm into dh
    Layer& L = *layers_[l];
    Acts& a = *acts_[l];
    // mixer policy: the same kernel on the same h_l and weight gives xn_l bit for bit (rstd_l is rewritten with
    // the values it holds)
    if (xn_[l].extent(0) == 0 && xnb_[l].extent(0) == 0) norm_input(l, h_[l], n, a, true);
    switch (L.kind) {
      case LayerKind::mamba1: L.m1->backward(a.m1, batch_, seqlen_, seq_, dh, dxn); break;
      case LayerKind::mamba2: L.m2->backward(a.m2, batch_, seqlen_, seq_, dh, dxn); break;
      case LayerKind::mamba3: L.m3->backward(a.m3, batch_, seqlen_, seq_, dh, dxn); break;
      case LayerKind::moe: L.moe->backward(a.moe, dh, dxn, aux_scale); break;
      case LayerKind::dense: L.dense->backward(a.dense, dh, dxn); break;
    }
    acts_[l].reset();
    xn_[l] = View2<T>();
    xnb_[l] = View2<bf16_op_t>();
    xn_ws_[l].reset();
    rmsnorm_backward<R, T>(h_[l], store_->v1(norm_[l]), rstd_[l], dxn, dh, true, store_->g1(norm_[l]));
    if (grads_ready_) grads_ready_(store_->entries()[norm_[l]].offset);
  }
  h_.clear();
  xn_.clear();
  xnb_.clear();
  rstd_.clear();
  rstd_f_ = View1<P>();
  acts_.clear();
  xn_ws_.clear();
  step_ws_.reset();
}

template <class T>
void MambaBackbone<T>::set_step(std::uint64_t seed, std::uint64_t step) {
  step_seed_ = seed, step_ = step;
  for (const auto& s : moe_acc_) layers_[s.layer]->moe->take_exchange_seconds();
}

template <class T>
std::vector<MoELayerStats> MambaBackbone<T>::end_step(const parallel::Comm* reduce) {
  if (reduce && reduce->size() > 1)
    for (auto& s : moe_acc_) {
      std::vector<double> buf(s.routed);
      buf.insert(buf.end(), s.kept.begin(), s.kept.end());
      buf.push_back(s.assignments);
      buf.push_back(s.dropped);
      reduce->allreduce_sum(buf.data(), buf.size());
      const std::size_t E = s.routed.size();
      std::copy(buf.begin(), buf.begin() + E, s.routed.begin());
      std::copy(buf.begin() + E, buf.begin() + 2 * E, s.kept.begin());
      s.assignments = buf[2 * E], s.dropped = buf[2 * E + 1];
    }
  for (auto& s : moe_acc_) s.exchange_seconds = layers_[s.layer]->moe->take_exchange_seconds();
  std::vector<MoELayerStats> out = moe_acc_;
  for (auto& s : moe_acc_) {
    layers_[s.layer]->moe->update_expert_bias(s.routed);
    std::fill(s.routed.begin(), s.routed.end(), 0.0);
    std::fill(s.kept.begin(), s.kept.end(), 0.0);
    s.assignments = s.dropped = 0;
  }
  return out;
}

// ------------------------------------------------------------------ decode

template <class T>
BackboneState<T> MambaBackbone<T>::make_state(index_t batch) const {
  BackboneState<T> s;
  s.batch = batch;
  for (const auto& L : layers_) {
    switch (L->kind) {
      case LayerKind::mamba1: s.layers.emplace_back(L->m1->make_state(batch)); break;
      case LayerKind::mamba2: s.layers.emplace_back(L->m2->make_state(batch)); break;
      case LayerKind::mamba3: s.layers.emplace_back(L->m3->make_state(batch)); break;
      default: s.layers.emplace_back(std::monostate{}); break;
    }
  }
  return s;
}

template <class T>
void MambaBackbone<T>::check_state(const BackboneState<T>& s, index_t batch) const {
  require(index_t(s.layers.size()) == n_layer_, "backbone decode", "the state has ", s.layers.size(),
          " layers, the backbone ", n_layer_);
  require(s.batch == batch, "backbone decode", "the state is for batch ", s.batch, ", not ", batch);
  for (index_t l = 0; l < n_layer_; ++l) {
    const auto k = kinds_[l];
    const std::size_t want = k == LayerKind::mamba1 ? 1 : k == LayerKind::mamba2 ? 2 : k == LayerKind::mamba3 ? 3 : 0;
    require(s.layers[l].index() == want, "backbone decode", "layer ", l, " (", layer_code(k),
            ") has a state of another layer kind");
  }
}

template <class T>
void MambaBackbone<T>::prefill(const View2<R>& h, index_t batch, index_t seqlen, BackboneState<T>& state,
                               const View2<T>& out) {
  const index_t n = batch * seqlen, D = cfg_.d_model;
  require(index_t(h.extent(0)) == n && index_t(h.extent(1)) == D && index_t(out.extent(0)) == n, "backbone prefill",
          "inputs must be (batch * seqlen, d_model)");
  check_state(state, batch);
  View2<T> m = make_uninit<View2<T>>("backbone::mixer_out", n, D);
  View2<T> xn = make_uninit<View2<T>>("backbone::xn", n, D);
  View1<P> rstd = make_uninit<View1<P>>("backbone::rstd", n);
  for (index_t l = 0; l < n_layer_; ++l) {
    rmsnorm_forward<R, T>(h, store_->v1(norm_[l]), eps_, xn, rstd);
    Acts a;
    LayerState<T>* s = state.layers[l].index() == 0 ? nullptr : &state.layers[l];
    layer_forward(l, xn, batch, seqlen, SeqIdxView(), m, a, false, false, s);
    residual_add(h, h, m);
  }
  rmsnorm_forward<R, T>(h, store_->v1(norm_f_), eps_, out, rstd);
}

template <class T>
void MambaBackbone<T>::step(const View2<R>& h, BackboneState<T>& state, const View2<T>& out) {
  const index_t B = h.extent(0), D = cfg_.d_model;
  require(index_t(h.extent(1)) == D && index_t(out.extent(0)) == B && index_t(out.extent(1)) == D,
          "backbone step", "h and out must be (batch, d_model = ", D, ")");
  check_state(state, B);
  View2<T> m = make_uninit<View2<T>>("backbone::mixer_out", B, D);
  View2<T> xn = make_uninit<View2<T>>("backbone::xn", B, D);
  View1<P> rstd = make_uninit<View1<P>>("backbone::rstd", B);
  for (index_t l = 0; l < n_layer_; ++l) {
    rmsnorm_forward<R, T>(h, store_->v1(norm_[l]), eps_, xn, rstd);
    Layer& L = *layers_[l];
    Acts a;
    switch (L.kind) {
      case LayerKind::mamba1: L.m1->step(xn, std::get<Mamba1State<T>>(state.layers[l]), m); break;
      case LayerKind::mamba2: L.m2->step(xn, std::get<Mamba2State<T>>(state.layers[l]), m); break;
      case LayerKind::mamba3: L.m3->step(xn, std::get<Mamba3State<T>>(state.layers[l]), m); break;
      case LayerKind::moe: L.moe->forward(xn, m, a.moe, false); break;
      case LayerKind::dense: L.dense->forward(xn, m, a.dense, false); break;
    }
    residual_add(h, h, m);
  }
  rmsnorm_forward<R, T>(h, store_->v1(norm_f_), eps_, out, rstd);
}

template class MambaBackbone<float>;
template class MambaBackbone<double>;

}  // namespace mm
