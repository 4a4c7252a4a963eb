// Minimal SVG line charts (no plotting library is a dependency): a grid of panels, each with axes, ticks, a title
// and several labelled series. Used for forecast-versus-truth figures and loss curves.
#pragma once

#include <string>
#include <vector>

namespace mm::io {

struct PlotSeries {
  std::string label;
  std::vector<double> x, y;  // NaN in y breaks the line
  std::string color = "#1f77b4";
  bool dashed = false;
};

struct PlotPanel {
  std::string title, xlabel, ylabel;
  std::vector<PlotSeries> series;
};

// Writes `panels` in a grid of `columns` columns to `path` (through a temporary file, renamed when complete).
void write_svg(const std::string& path, const std::string& title, const std::vector<PlotPanel>& panels,
               int columns = 2, int panel_width = 560, int panel_height = 320);

}  // namespace mm::io
