// timeseries_forecast: train a channel-independent Mamba-2 forecaster (RevIN, patch tokens, direct multi-horizon
// head) on a CSV or HDF5 series with the LTSF protocol (chronological train/validation/test split, z-scored with
// the training statistics, stride-1 windows), keep the parameters of the best validation loss, and report test
// MSE/MAE on z-scored values and in original units next to the naive baselines (last value and seasonal lags).
// Writes results.csv, forecasts.csv (every test window of the first horizon), forecast.svg and
// forecasts_plotted.csv (the rows of the windows drawn in the plot).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "io/dataset_h5.hpp"
#include "io/svg_plot.hpp"
#include "io/timeseries.hpp"
#include "lm_options.hpp"
#include "model/forecaster.hpp"
#include "registry.hpp"

namespace mm::drivers {

using I = std::int64_t;

void declare_timeseries_forecast(io::Deck& d) {
  declare_backbone_options(d);
  declare_train_options(d);
  d.add<std::string>("data.csv", "", "CSV series (header row; optional timestamp column), relative to the deck")
      .add<std::string>("data.dataset", "", "HDF5 series dataset written by the preprocess driver (instead of csv)")
      .add<std::string>("data.timestamp_column", "auto", "auto | none | <column name>")
      .add<std::string>("data.columns", "", "value columns to use, separated by spaces or commas (empty: all)")
      .add<bool>("data.mask_missing", false, "mask missing values (NaN, NA, empty) instead of stopping with an error")
      .add<double>("data.train_fraction", 0.7, "chronological split: training part")
      .add<double>("data.test_fraction", 0.2, "chronological split: test part (validation is the rest)");
  d.add<I>("forecast.input_len", 336, "input window (steps)")
      .add<std::string>("forecast.horizons", "96", "forecast horizons, e.g. \"96 192 336 720\"; the head predicts "
                                                    "the longest and each is scored on its prefix")
      .add<I>("forecast.patch_len", 16, "steps per token (1: one token per step); must divide input_len")
      .add<bool>("forecast.revin_affine", true, "learnable per-channel affine of RevIN")
      .add<std::string>("forecast.season_lags", "48 336", "seasonal-naive baselines to report (e.g. daily and "
                                                          "weekly for half-hourly data); last value is always "
                                                          "reported")
      .add<I>("forecast.plot_windows", 4, "test windows drawn in forecast.svg");
}

namespace {

std::vector<I> parse_list(const std::string& key, const std::string& text) {
  std::vector<I> out;
  std::string t = text;
  std::replace(t.begin(), t.end(), ',', ' ');
  std::istringstream is(t);
  std::string w;
  while (is >> w) {
    try {
      std::size_t used = 0;
      const long long v = std::stoll(w, &used);
      require(used == w.size() && v > 0, "[" + key + "]", "'", w, "' is not a positive integer");
      out.push_back(v);
    } catch (const std::logic_error&) {
      throw Error("[" + key + "]", "'" + w + "' is not a positive integer");
    }
  }
  return out;
}

std::vector<std::string> parse_names(const std::string& text) {
  std::string t = text;
  std::replace(t.begin(), t.end(), ',', ' ');
  std::istringstream is(t);
  std::vector<std::string> out;
  std::string w;
  while (is >> w) out.push_back(w);
  return out;
}

// The z-scored rows of `windows` (each window x every channel) with input `L` and horizon `H`; targets beyond the
// end of the series are masked.
SeriesBatch make_batch(const io::SeriesSource& s, const io::ChannelStats& st, const std::vector<I>& starts, I L,
                       I H) {
  const I C = I(s.info().channels.size()), n = s.info().length;
  SeriesBatch b;
  b.rows = I(starts.size()) * C;
  b.input_len = L;
  b.horizon = H;
  b.x.assign(std::size_t(b.rows * L), 0.0);
  b.y.assign(std::size_t(b.rows * H), 0.0);
  b.xm.assign(b.x.size(), 0);
  b.ym.assign(b.y.size(), 0);
  b.channel.resize(std::size_t(b.rows));
  std::vector<double> v;
  std::vector<std::uint8_t> m;
  for (std::size_t w = 0; w < starts.size(); ++w) {
    const I s0 = starts[w], len = std::min(L + H, n - s0);
    v.resize(std::size_t(len * C));
    m.resize(v.size());
    s.read(s0, len, v.data(), m.data());
    for (I c = 0; c < C; ++c) {
      const I r = I(w) * C + c;
      b.channel[std::size_t(r)] = std::int32_t(c);
      for (I t = 0; t < len; ++t) {
        const double z = (v[std::size_t(t * C + c)] - st.mean[std::size_t(c)]) / st.std[std::size_t(c)];
        const std::uint8_t ok = m[std::size_t(t * C + c)];
        if (t < L) {
          b.x[std::size_t(r * L + t)] = z;
          b.xm[std::size_t(r * L + t)] = ok;
        } else {
          b.y[std::size_t(r * H + t - L)] = z;
          b.ym[std::size_t(r * H + t - L)] = ok;
        }
      }
    }
  }
  return b;
}

struct Eval {
  io::Metrics m;
  std::vector<double> pred;  // per window and channel, horizon steps (z-scored)
};

// Forecasts for `starts`, scored on the first `h` steps (z-scored and in original units).
Eval evaluate(Forecaster<float>& model, const io::SeriesSource& s, const io::ChannelStats& st,
              const std::vector<I>& starts, I L, I Hmax, I h, I batch_windows) {
  Eval out;
  const I C = I(s.info().channels.size());
  double se = 0, ae = 0, se_o = 0, ae_o = 0;
  for (std::size_t w0 = 0; w0 < starts.size(); w0 += std::size_t(batch_windows)) {
    const std::vector<I> ws(starts.begin() + w0, starts.begin() + std::min(starts.size(), w0 + batch_windows));
    const SeriesBatch b = make_batch(s, st, ws, L, Hmax);
    model.forward(b);
    const auto p = model.predictions();
    out.pred.insert(out.pred.end(), p.begin(), p.end());
    for (I r = 0; r < b.rows; ++r)
      for (I k = 0; k < h; ++k) {
        const std::size_t i = std::size_t(r * Hmax + k);
        if (!b.ym[i]) continue;
        const double e = p[i] - b.y[i], sd = st.std[std::size_t(b.channel[std::size_t(r)])];
        se += e * e;
        ae += std::abs(e);
        se_o += e * e * sd * sd;
        ae_o += std::abs(e) * sd;
        ++out.m.count;
      }
  }
  (void)C;
  if (out.m.count > 0) {
    out.m.mse = se / double(out.m.count);
    out.m.mae = ae / double(out.m.count);
    out.m.mse_orig = se_o / double(out.m.count);
    out.m.mae_orig = ae_o / double(out.m.count);
  }
  return out;
}

}  // namespace

int run_timeseries_forecast(const io::Deck& d) {
  const I L = d.get<I>("forecast.input_len");
  const std::vector<I> horizons = parse_list("forecast] horizons", d.get<std::string>("forecast.horizons"));
  require(!horizons.empty(), "[forecast] horizons", "no horizon given");
  const I Hmax = *std::max_element(horizons.begin(), horizons.end());
  const std::vector<I> lags = parse_list("forecast] season_lags", d.get<std::string>("forecast.season_lags"));

  // The series, its split and its training statistics: from an HDF5 dataset (as recorded there) or a CSV file.
  std::shared_ptr<io::SeriesSource> series;
  io::Split split;
  io::ChannelStats stats;
  const std::string dataset = d.get<std::string>("data.dataset");
  if (!dataset.empty()) {
    const std::string path = input_path(d, dataset);
    series = std::make_shared<io::H5SeriesSource>(path);
    const io::SeriesDatasetMeta meta = io::read_series_meta(path);
    split = meta.split;
    stats = meta.stats;
  } else {
    const std::string csv = input_path(d, d.get<std::string>("data.csv"));
    require(!csv.empty(), d.path() + " [data]", "give csv or dataset");
    io::CsvOptions opt;
    const std::string ts = d.get<std::string>("data.timestamp_column");
    opt.timestamp_column = ts == "none" ? "" : ts;
    opt.columns = parse_names(d.get<std::string>("data.columns"));
    opt.mask_missing = d.get<bool>("data.mask_missing");
    auto ts_series = std::make_shared<io::TimeSeries>(io::read_csv(csv, opt));
    split = io::chronological_split(ts_series->info().length, d.get<double>("data.train_fraction"),
                                    d.get<double>("data.test_fraction"));
    stats = io::train_stats(*ts_series, split);
    series = ts_series;
  }
  const io::SeriesInfo& info = series->info();
  const I C = I(info.channels.size()), n = info.length;
  std::printf("data: %s: %lld steps x %lld channel(s); train [0, %lld), validation [%lld, %lld), test [%lld, %lld)\n",
              info.source.c_str(), (long long)n, (long long)C, (long long)split.train_end,
              (long long)split.train_end, (long long)split.val_end, (long long)split.val_end, (long long)n);
  const auto train_starts = io::window_starts(0, split.train_end, L, Hmax);
  const auto val_starts = io::window_starts(split.train_end, split.val_end, L, Hmax);
  require(!train_starts.empty(), "[forecast]", "the training part (", split.train_end,
          " steps) is shorter than input_len + horizon = ", L + Hmax);
  require(!val_starts.empty(), "[forecast]", "the validation part cannot hold one window of horizon ", Hmax);

  ForecastConfig fc;
  fc.input_len = L;
  fc.horizon = Hmax;
  fc.patch_len = d.get<I>("forecast.patch_len");
  fc.channels = C;
  fc.revin_affine = d.get<bool>("forecast.revin_affine");
  fc.layers = make_layer_stack_config(d);
  fc.n_layer = make_n_layer(d, fc.layers);
  fc.norm_eps = d.get<double>("model.norm_eps");
  fc.mixer = make_mixer_config(d);
  fc.validate(d.path() + " [forecast]");
  const TrainConfig tc = make_train_config(d);
  require_data_parallel_only(d, "the forecaster");
  const I batch = d.get<I>("train.batch_size"), eval_batch = d.get<I>("train.eval_batch_size");

  Forecaster<float> model(fc);
  model.initialize(tc.seed);
  std::printf("model: Mamba-2 forecaster, %lld layers, d_model %lld, %lld patch tokens of %lld steps, horizon %lld, "
              "%lld parameters\n",
              (long long)fc.n_layer, (long long)fc.mixer.d_model, (long long)fc.n_patch(), (long long)fc.patch_len,
              (long long)Hmax, (long long)model.params().count());
  std::printf("train: %lld windows of %lld + %lld steps; %lld steps of %lld windows x %lld channel(s)\n",
              (long long)train_starts.size(), (long long)L, (long long)Hmax, (long long)tc.steps, (long long)batch,
              (long long)C);
  std::fflush(stdout);

  // Keep the parameters of the best validation loss (early stopping without stopping).
  double best_val = std::numeric_limits<double>::infinity();
  I best_step = -1;
  std::vector<float> best;
  Trainer<Forecaster<float>> trainer(model, tc, d.effective());
  trainer.run(
      [&](I step, I micro) {
        const CounterRNG rng{tc.seed, stream_mix(stream_mix(stream_id("forecast::train_window"), std::uint64_t(step)),
                                                 std::uint64_t(micro))};
        std::vector<I> ws(static_cast<std::size_t>(batch));
        for (I k = 0; k < batch; ++k)
          ws[std::size_t(k)] = train_starts[rng.below(std::uint64_t(k), train_starts.size())];
        return make_batch(*series, stats, ws, L, Hmax);
      },
      [&]() {
        LossSum total;
        for (std::size_t w0 = 0; w0 < val_starts.size(); w0 += std::size_t(eval_batch)) {
          const std::vector<I> ws(val_starts.begin() + w0,
                                  val_starts.begin() + std::min(val_starts.size(), w0 + eval_batch));
          const LossSum l = model.forward(make_batch(*series, stats, ws, L, Hmax));
          total.nats += l.nats;
          total.aux += l.aux;
          total.count += l.count;
        }
        if (total.mean_nats() < best_val) {
          best_val = total.mean_nats();
          best_step = trainer.step();
          auto h = Kokkos::create_mirror_view_and_copy(HostMem(), model.params().values());
          best.assign(h.data(), h.data() + h.span());
        }
        return total;
      });
  if (!best.empty()) {
    Kokkos::deep_copy(model.params().values(),
                      Kokkos::View<const float*, Layout, HostMem>(best.data(), I(best.size())));
    std::printf("using the parameters of step %lld (best validation MSE %.4f)\n", (long long)best_step, best_val);
  }

  // Test: the model and the naive baselines on the same windows, for every horizon.
  const std::string out_dir = d.get<std::string>("run.output_dir");
  std::filesystem::create_directories(out_dir);
  std::ofstream res(output_path(d, "results.csv"));
  res << "horizon,method,mse,mae,mse_orig,mae_orig,targets\n";
  std::printf("\ntest (%lld steps; z-scored with the training statistics | original units)\n", (long long)(n - split.val_end));
  std::printf("%8s  %-22s %10s %10s | %12s %12s\n", "horizon", "method", "MSE", "MAE", "MSE", "MAE");
  Eval first;
  std::vector<I> first_starts;
  for (I h : horizons) {
    const auto starts = io::window_starts(split.val_end, n, L, h);
    require(!starts.empty(), "[forecast] horizons", "the test part cannot hold one window of horizon ", h);
    Eval ev = evaluate(model, *series, stats, starts, L, Hmax, h, eval_batch);
    auto row = [&](const std::string& name, const io::Metrics& m) {
      std::printf("%8lld  %-22s %10.4f %10.4f | %12.4g %12.4g\n", (long long)h, name.c_str(), m.mse, m.mae,
                  m.mse_orig, m.mae_orig);
      res << h << "," << name << "," << m.mse << "," << m.mae << "," << m.mse_orig << "," << m.mae_orig << ","
          << m.count << "\n";
    };
    row("mamba2 forecaster", ev.m);
    row("naive: last value", io::naive_baseline(*series, split, stats, L, h, 0));
    for (I lag : lags) row("naive: seasonal lag " + std::to_string(lag), io::naive_baseline(*series, split, stats, L, h, lag));
    if (first_starts.empty()) {
      first = std::move(ev);
      first_starts = starts;
    }
  }
  std::printf("results: %s\n", output_path(d, "results.csv").c_str());

  // Forecasts of the first horizon for every test window (original units), and a plot of a few of them.
  const I h0 = horizons.front();
  std::ofstream fo(output_path(d, "forecasts.csv")), fp(output_path(d, "forecasts_plotted.csv"));
  fo << "window_start,target_start_time,channel,step,truth,forecast\n";
  fp << "window_start,target_start_time,channel,step,truth,forecast\n";
  const I plots = std::min<I>(d.get<I>("forecast.plot_windows"), I(first_starts.size()));
  std::vector<io::PlotPanel> panels;
  const char* palette[] = {"#1f77b4", "#d62728", "#2ca02c"};
  for (std::size_t w = 0; w < first_starts.size(); ++w) {
    const I s0 = first_starts[w];
    const I len = std::min(L + h0, n - s0);
    std::vector<double> v(std::size_t(len * C));
    std::vector<std::uint8_t> m(v.size());
    series->read(s0, len, v.data(), m.data());
    const auto stamps = series->timestamps(s0 + L, 1);
    const bool plot = plots > 0 && (w % std::max<std::size_t>(1, first_starts.size() / std::size_t(plots))) == 0 &&
                      I(panels.size()) < plots * C;
    for (I c = 0; c < C; ++c) {
      io::PlotPanel panel;
      panel.title = info.channels[std::size_t(c)] + ", test window from step " + std::to_string(s0 + L);
      panel.xlabel = "step";
      panel.ylabel = info.channels[std::size_t(c)];
      io::PlotSeries truth{"truth", {}, {}, palette[0], false}, fc_s{"forecast", {}, {}, palette[1], false};
      for (I t = std::max<I>(0, L - 2 * h0); t < len; ++t) {
        truth.x.push_back(double(s0 + t));
        truth.y.push_back(m[std::size_t(t * C + c)] ? v[std::size_t(t * C + c)] : std::nan(""));
      }
      for (I k = 0; k < h0 && L + k < len; ++k) {
        const double z = first.pred[std::size_t((I(w) * C + c) * Hmax + k)];
        const double f = z * stats.std[std::size_t(c)] + stats.mean[std::size_t(c)];
        const double tr = m[std::size_t((L + k) * C + c)] ? v[std::size_t((L + k) * C + c)] : std::nan("");
        std::ostringstream row;
        row << s0 << "," << (stamps.empty() ? "" : stamps[0]) << "," << info.channels[std::size_t(c)] << ","
            << k + 1 << "," << tr << "," << f << "\n";
        fo << row.str();
        if (plot) fp << row.str();
        fc_s.x.push_back(double(s0 + L + k));
        fc_s.y.push_back(f);
      }
      if (plot) {
        panel.series = {truth, fc_s};
        panels.push_back(std::move(panel));
      }
    }
  }
  if (!panels.empty()) {
    io::write_svg(output_path(d, "forecast.svg"),
                  "Mamba-2 forecaster: " + std::to_string(h0) + "-step forecasts against the truth (test windows)",
                  panels);
    std::printf("plot: %s (%zu test windows)\n", output_path(d, "forecast.svg").c_str(), panels.size());
  }
  return 0;
}

}  // namespace mm::drivers
