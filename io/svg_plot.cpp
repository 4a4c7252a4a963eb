#include "io/svg_plot.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "core/error.hpp"

namespace mm::io {

namespace {

std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '&') o += "&amp;";
    else if (c == '<') o += "&lt;";
    else if (c == '>') o += "&gt;";
    else if (c == '"') o += "&quot;";
    else o += c;
  }
  return o;
}

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", v);
  return b;
}

std::string tick_label(double v) {
  char b[32];
  if (v != 0 && (std::abs(v) >= 1e5 || std::abs(v) < 1e-3)) std::snprintf(b, sizeof b, "%.2g", v);
  else std::snprintf(b, sizeof b, "%g", v);
  return b;
}

// About five round tick values covering [lo, hi].
std::vector<double> ticks(double lo, double hi) {
  const double span = hi - lo, raw = span / 5, mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double r = raw / mag, step = (r < 1.5 ? 1 : r < 3 ? 2 : r < 7 ? 5 : 10) * mag;
  std::vector<double> t;
  for (double v = std::ceil(lo / step) * step; v <= hi + 1e-9 * span; v += step) t.push_back(v);
  return t;
}

}  // namespace

void write_svg(const std::string& path, const std::string& title, const std::vector<PlotPanel>& panels, int columns,
               int pw, int ph) {
  const int rows = (int(panels.size()) + columns - 1) / columns, top = 40;
  const int W = columns * pw, Hh = top + rows * ph;
  std::ostringstream s;
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << Hh << "\" viewBox=\"0 0 " << W
    << " " << Hh << "\" font-family=\"sans-serif\" font-size=\"11\">\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    << "<text x=\"" << W / 2 << "\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">" << esc(title) << "</text>\n";
  for (std::size_t pi = 0; pi < panels.size(); ++pi) {
    const PlotPanel& p = panels[pi];
    const double ox = double(int(pi) % columns) * pw, oy = top + double(int(pi) / columns) * ph;
    const double l = ox + 62, r = ox + pw - 16, t = oy + 26, b = oy + ph - 46;
    double xmin = std::numeric_limits<double>::infinity(), xmax = -xmin, ymin = xmin, ymax = -xmin;
    for (const auto& se : p.series)
      for (std::size_t i = 0; i < se.x.size(); ++i) {
        if (!std::isfinite(se.y[i])) continue;
        xmin = std::min(xmin, se.x[i]);
        xmax = std::max(xmax, se.x[i]);
        ymin = std::min(ymin, se.y[i]);
        ymax = std::max(ymax, se.y[i]);
      }
    if (!std::isfinite(xmin)) continue;  // nothing to draw
    if (xmax == xmin) xmax = xmin + 1;
    if (ymax == ymin) ymax = ymin + 1;
    const double pad = 0.05 * (ymax - ymin);
    ymin -= pad;
    ymax += pad;
    auto X = [&](double v) { return l + (v - xmin) / (xmax - xmin) * (r - l); };
    auto Y = [&](double v) { return b - (v - ymin) / (ymax - ymin) * (b - t); };
    s << "<text x=\"" << num((l + r) / 2) << "\" y=\"" << num(oy + 16) << "\" text-anchor=\"middle\" font-size=\"12\">"
      << esc(p.title) << "</text>\n";
    for (double v : ticks(ymin, ymax))
      s << "<line x1=\"" << num(l) << "\" y1=\"" << num(Y(v)) << "\" x2=\"" << num(r) << "\" y2=\"" << num(Y(v))
        << "\" stroke=\"#e6e6e6\"/><text x=\"" << num(l - 4) << "\" y=\"" << num(Y(v) + 4)
        << "\" text-anchor=\"end\">" << tick_label(v) << "</text>\n";
    for (double v : ticks(xmin, xmax))
      s << "<line x1=\"" << num(X(v)) << "\" y1=\"" << num(b) << "\" x2=\"" << num(X(v)) << "\" y2=\"" << num(b + 4)
        << "\" stroke=\"black\"/><text x=\"" << num(X(v)) << "\" y=\"" << num(b + 16) << "\" text-anchor=\"middle\">"
        << tick_label(v) << "</text>\n";
    s << "<rect x=\"" << num(l) << "\" y=\"" << num(t) << "\" width=\"" << num(r - l) << "\" height=\"" << num(b - t)
      << "\" fill=\"none\" stroke=\"black\"/>\n";
    s << "<text x=\"" << num((l + r) / 2) << "\" y=\"" << num(b + 32) << "\" text-anchor=\"middle\">" << esc(p.xlabel)
      << "</text>\n<text transform=\"translate(" << num(ox + 14) << "," << num((t + b) / 2)
      << ") rotate(-90)\" text-anchor=\"middle\">" << esc(p.ylabel) << "</text>\n";
    for (std::size_t si = 0; si < p.series.size(); ++si) {
      const PlotSeries& se = p.series[si];
      std::string pts;
      auto flush = [&]() {
        if (!pts.empty())
          s << "<polyline fill=\"none\" stroke=\"" << se.color << "\" stroke-width=\"1.4\""
            << (se.dashed ? " stroke-dasharray=\"5,3\"" : "") << " points=\"" << pts << "\"/>\n";
        pts.clear();
      };
      for (std::size_t i = 0; i < se.x.size(); ++i) {
        if (!std::isfinite(se.y[i])) {
          flush();
          continue;
        }
        pts += num(X(se.x[i])) + "," + num(Y(se.y[i])) + " ";
      }
      flush();
      const double ly = t + 12 + 14 * double(si);
      s << "<line x1=\"" << num(l + 8) << "\" y1=\"" << num(ly) << "\" x2=\"" << num(l + 28) << "\" y2=\"" << num(ly)
        << "\" stroke=\"" << se.color << "\" stroke-width=\"2\"" << (se.dashed ? " stroke-dasharray=\"5,3\"" : "")
        << "/><text x=\"" << num(l + 32) << "\" y=\"" << num(ly + 4) << "\">" << esc(se.label) << "</text>\n";
    }
  }
  s << "</svg>\n";
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    require(bool(f), path, "cannot write the plot");
    f << s.str();
    require(bool(f), path, "error while writing the plot");
  }
  std::filesystem::rename(tmp, path);
}

}  // namespace mm::io
