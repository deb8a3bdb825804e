// report.html's charts (private to src/report): what a chart shows, as Chart.js's configuration
// or, without Chart.js, as plain SVG; and its exact numbers as table rows.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace kiln::report {

struct Series {
  std::string label;
  std::vector<double> x, y;  // line charts: points; bar charts: y per category (x unused)
  bool right_axis = false;
};

struct Chart {
  std::string id, title;  // id without the "chart-" prefix the page adds
  bool bar = false;
  bool stacked = false;     // bar charts: series stacked on one bar per category
  bool log_toggle = false;  // a "log scale" checkbox for the y axis
  std::string x_label, y_label, y2_label;
  std::vector<std::string> categories;  // bar charts
  std::vector<Series> series;
};

/// Chart.js's `new Chart(canvas, config)` configuration (animation off, fixed colours).
nlohmann::json chartjs_config(const Chart& chart);
/// The chart drawn as an <svg> element (grouped or stacked bars, polylines).
std::string svg_chart(const Chart& chart);
/// The chart's numbers: a header row, then one row per category (bars) or per x (lines).
std::vector<std::vector<std::string>> chart_rows(const Chart& chart);

/// JSON for inside a <script> element ("</" escaped).
std::string script_json(const nlohmann::json& value);
/// HTML text escaping (&, <, >, ").
std::string escape(std::string_view text);
/// For reading: whole numbers as they are, others to 5 significant digits; "-" when not finite.
std::string number(double value);
/// A figure for a table: whole above 1000, else three significant digits; "-" when not finite.
std::string short_number(double value);

}  // namespace kiln::report
