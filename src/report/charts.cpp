// report.html's charts: Chart.js configurations, plain SVG, and their numbers as rows.
#include "report/charts.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <map>

#include "core/strings.h"

namespace kiln::report {

using nlohmann::json;

namespace {
const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                         "#9467bd", "#8c564b", "#17becf", "#7f7f7f"};

json finite_or_null(double value) {
  return std::isfinite(value) ? json(value) : json(nullptr);
}
}  // namespace

std::string escape(std::string_view text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// JSON inside <script>: "</" would end the element.
std::string script_json(const json& value) {
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  std::string out;
  for (size_t k = 0; k < text.size(); ++k) {
    if (text[k] == '<' && k + 1 < text.size() && text[k + 1] == '/') {
      out += "<\\/";
      ++k;
    } else {
      out += text[k];
    }
  }
  return out;
}

// For reading, not for round trips (the charts' JSON keeps every digit): whole numbers as they
// are, others to 5 significant digits ("0.053475", "0.00089553", "6.3599e+07").
std::string number(double value) {
  if (!std::isfinite(value)) return "-";
  if (std::abs(value) < 1e15 && value == std::round(value)) return format_number(value);
  return fmt::format("{:.5g}", value);
}

json chartjs_config(const Chart& chart) {
  json datasets = json::array();
  for (size_t k = 0; k < chart.series.size(); ++k) {
    const Series& s = chart.series[k];
    json data = json::array();
    if (chart.bar) {
      for (double y : s.y) data.push_back(finite_or_null(y));
    } else {
      for (size_t i = 0; i < s.x.size(); ++i) {
        data.push_back({{"x", s.x[i]}, {"y", finite_or_null(s.y[i])}});
      }
    }
    const char* color = kColors[k % std::size(kColors)];
    json dataset = {
        {"label", s.label}, {"data", data}, {"borderColor", color}, {"backgroundColor", color}};
    if (!chart.bar) {
      dataset["pointRadius"] = s.x.size() > 60 ? 0 : 2;
      dataset["borderWidth"] = 1.5;
      dataset["showLine"] = true;
    }
    dataset["yAxisID"] = s.right_axis ? "y1" : "y";
    datasets.push_back(dataset);
  }
  json scales = {{"y", {{"title", {{"display", true}, {"text", chart.y_label}}}}}};
  if (chart.bar) {
    scales["x"] = {{"title", {{"display", !chart.x_label.empty()}, {"text", chart.x_label}}}};
  } else {
    scales["x"] = {{"type", "linear"}, {"title", {{"display", true}, {"text", chart.x_label}}}};
  }
  if (chart.stacked) {
    scales["x"]["stacked"] = true;
    scales["y"]["stacked"] = true;
  }
  if (!chart.y2_label.empty()) {
    scales["y1"] = {{"position", "right"},
                    {"grid", {{"drawOnChartArea", false}}},
                    {"title", {{"display", true}, {"text", chart.y2_label}}}};
  }
  json config = {{"type", chart.bar ? "bar" : "line"},
                 {"data", {{"datasets", datasets}}},
                 {"options",
                  {{"animation", false},
                   {"responsive", true},
                   {"maintainAspectRatio", false},
                   {"scales", scales},
                   {"plugins", {{"title", {{"display", true}, {"text", chart.title}}}}}}}};
  if (chart.bar) config["data"]["labels"] = chart.categories;
  return config;
}

// Plain SVG: axes, one polyline per series (lines) or grouped bars; the right axis is scaled
// separately.
std::string svg_chart(const Chart& chart) {
  const double W = 640, H = 260, left = 60, right = 60, top = 28, bottom = 36;
  const double pw = W - left - right, ph = H - top - bottom;
  auto range = [&](bool right_axis) {
    double lo = std::numeric_limits<double>::infinity(), hi = -lo;
    for (const auto& s : chart.series) {
      if (s.right_axis != right_axis) continue;
      for (double y : s.y) {
        if (!std::isfinite(y)) continue;
        lo = std::min(lo, y);
        hi = std::max(hi, y);
      }
    }
    if (chart.stacked) {  // the tallest stack
      for (size_t c = 0; c < chart.categories.size(); ++c) {
        double sum = 0;
        for (const auto& s : chart.series) {
          if (c < s.y.size() && std::isfinite(s.y[c])) sum += s.y[c];
        }
        hi = std::max(hi, sum);
      }
    }
    if (!std::isfinite(lo)) return std::pair<double, double>{0, 1};
    if (chart.bar) lo = std::min(lo, 0.0);
    if (hi <= lo) hi = lo + 1;
    return std::pair<double, double>{lo, hi};
  };
  const auto [ylo, yhi] = range(false);
  const auto [y2lo, y2hi] = range(true);
  std::string out = fmt::format(
      "<svg class=\"svg-chart\" id=\"{}\" viewBox=\"0 0 {} {}\" width=\"{}\" height=\"{}\" "
      "xmlns=\"http://www.w3.org/2000/svg\" font-size=\"11\">",
      escape(chart.id), W, H, W, H);
  out +=
      fmt::format("<text x=\"{}\" y=\"16\" text-anchor=\"middle\" font-weight=\"bold\">{}</text>",
                  W / 2, escape(chart.title));
  out += fmt::format(
      "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#999\"/>", left,
      top, pw, ph);
  out += fmt::format("<text x=\"4\" y=\"{}\">{}</text><text x=\"4\" y=\"{}\">{}</text>", top + 4,
                     escape(number(yhi)), top + ph, escape(number(ylo)));
  out += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>", left + pw / 2,
                     H - 4, escape(chart.x_label));
  auto sy = [&](double y, bool r) {
    const double lo = r ? y2lo : ylo, hi = r ? y2hi : yhi;
    return top + ph * (1 - (y - lo) / (hi - lo));
  };
  if (chart.bar) {
    const size_t n = chart.categories.size(), m = std::max<size_t>(chart.series.size(), 1);
    const double slot = n ? pw / static_cast<double>(n) : pw;
    for (size_t c = 0; c < n; ++c) {
      double base = 0;  // stacked: the top of the segments below
      for (size_t k = 0; k < chart.series.size(); ++k) {
        const Series& s = chart.series[k];
        if (c >= s.y.size() || !std::isfinite(s.y[c])) continue;
        const double bw = chart.stacked ? slot * 0.8 : slot * 0.8 / static_cast<double>(m);
        const double x = left + slot * static_cast<double>(c) + slot * 0.1 +
                         (chart.stacked ? 0.0 : bw * static_cast<double>(k));
        const double from = chart.stacked ? base : 0.0;
        if (chart.stacked) base += s.y[c];
        const double y0 = sy(from, s.right_axis), y1 = sy(from + s.y[c], s.right_axis);
        out += fmt::format(
            "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"{}\"/>", x,
            std::min(y0, y1), bw, std::abs(y0 - y1), kColors[k % std::size(kColors)]);
      }
      out += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
                         left + slot * (static_cast<double>(c) + 0.5), top + ph + 12,
                         escape(chart.categories[c].substr(0, 18)));
    }
  } else {
    double xlo = std::numeric_limits<double>::infinity(), xhi = -xlo;
    for (const auto& s : chart.series) {
      for (double x : s.x) {
        xlo = std::min(xlo, x);
        xhi = std::max(xhi, x);
      }
    }
    if (!std::isfinite(xlo)) xlo = 0, xhi = 1;
    if (xhi <= xlo) xhi = xlo + 1;
    out += fmt::format(
        "<text x=\"{}\" y=\"{}\">{}</text><text x=\"{}\" y=\"{}\" "
        "text-anchor=\"end\">{}</text>",
        left, top + ph + 12, escape(number(xlo)), left + pw, top + ph + 12, escape(number(xhi)));
    for (size_t k = 0; k < chart.series.size(); ++k) {
      const Series& s = chart.series[k];
      std::string points;
      for (size_t i = 0; i < s.x.size(); ++i) {
        if (!std::isfinite(s.y[i])) continue;
        points += fmt::format("{:.1f},{:.1f} ", left + pw * (s.x[i] - xlo) / (xhi - xlo),
                              sy(s.y[i], s.right_axis));
      }
      out += fmt::format(
          "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" "
          "points=\"{}\"/>",
          kColors[k % std::size(kColors)], points);
    }
  }
  for (size_t k = 0; k < chart.series.size(); ++k) {  // legend
    out += fmt::format("<text x=\"{}\" y=\"{}\" fill=\"{}\">{}{}</text>", left + 6 + 120.0 * k,
                       top + 12, kColors[k % std::size(kColors)], escape(chart.series[k].label),
                       chart.series[k].right_axis ? " (right)" : "");
  }
  return out + "</svg>";
}

std::string short_number(double value) {
  if (!std::isfinite(value)) return "-";
  return std::abs(value) >= 1000 ? fmt::format("{:.0f}", value) : fmt::format("{:.3g}", value);
}

std::vector<std::vector<std::string>> chart_rows(const Chart& chart) {
  std::vector<std::vector<std::string>> rows;
  std::vector<std::string> header = {chart.bar ? std::string() : chart.x_label};
  for (const auto& s : chart.series) header.push_back(s.label);
  rows.push_back(header);
  if (chart.bar) {
    for (size_t c = 0; c < chart.categories.size(); ++c) {
      std::vector<std::string> row = {chart.categories[c]};
      for (const auto& s : chart.series) row.push_back(c < s.y.size() ? number(s.y[c]) : "-");
      rows.push_back(row);
    }
    return rows;
  }
  std::map<double, std::vector<std::string>> by_x;  // one row per x of any series
  for (size_t k = 0; k < chart.series.size(); ++k) {
    const Series& s = chart.series[k];
    for (size_t i = 0; i < s.x.size(); ++i) {
      auto& row = by_x[s.x[i]];
      row.resize(chart.series.size(), "");
      row[k] = number(s.y[i]);
    }
  }
  for (auto& [x, cells] : by_x) {
    cells.resize(chart.series.size(), "");
    std::vector<std::string> row = {number(x)};
    row.insert(row.end(), cells.begin(), cells.end());
    rows.push_back(row);
  }
  return rows;
}

}  // namespace kiln::report
