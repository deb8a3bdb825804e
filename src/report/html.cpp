// report.html (kiln/report.h): one self-contained page from a run directory's files. Each section
// is one function that reads what it needs from RunFiles and adds charts and tables to the Page;
// a new rung's section is one more function in sections().
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <optional>
#include <tuple>

#include "core/files.h"
#include "core/strings.h"
#include "kiln/error.h"
#include "kiln/report.h"
#include "kiln/run.h"

#ifndef KILN_CHARTJS
#define KILN_CHARTJS ""
#endif

namespace kiln {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// ---- what a run directory holds ----------------------------------------------------------------

struct MetricsFile {
  std::string name;           // "metrics.jsonl", "metrics-baseline.jsonl"
  std::vector<json> records;  // the lines that are JSON objects
};

class RunFiles {
 public:
  explicit RunFiles(const fs::path& dir) : dir_(dir) {
    std::error_code ec;
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      const std::string name = entry.path().filename().string();
      if (name.starts_with("metrics") && name.ends_with(".jsonl")) names.push_back(name);
    }
    std::sort(names.begin(), names.end());
    for (const auto& name : names) metrics_.push_back(read_metrics(name));
    if (metrics_.empty()) missing_.push_back("metrics.jsonl");
  }
  const fs::path& dir() const { return dir_; }
  /// <name>.json as an object; null (and listed as missing) when absent or unreadable.
  const json& rung(const std::string& file) {
    auto it = json_.find(file);
    if (it != json_.end()) return it->second;
    json value = nullptr;
    std::error_code ec;
    if (!fs::is_regular_file(dir_ / file, ec)) {
      missing_.push_back(file);
    } else {
      try {
        value = json::parse(read_file(dir_ / file), nullptr, /*allow_exceptions=*/false);
      } catch (const std::exception&) {
        value = nullptr;
      }
      if (!value.is_object()) {
        value = nullptr;
        missing_.push_back(file + " (unreadable)");
      }
    }
    return json_.emplace(file, std::move(value)).first->second;
  }
  const std::vector<MetricsFile>& metrics() const { return metrics_; }
  const std::vector<std::string>& missing() const { return missing_; }
  /// A part of a file that a section needed and did not find ("pilot.json without restore").
  void note_missing(std::string what) { missing_.push_back(std::move(what)); }

 private:
  MetricsFile read_metrics(const std::string& name) {
    MetricsFile out{name, {}};
    std::ifstream in(dir_ / name);
    std::string line;
    while (std::getline(in, line)) {
      json record = json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (record.is_object() && record.contains("step")) out.records.push_back(std::move(record));
    }
    return out;
  }
  fs::path dir_;
  std::map<std::string, json> json_;
  std::vector<MetricsFile> metrics_;
  std::vector<std::string> missing_;
};

// ---- charts ------------------------------------------------------------------------------------

struct Series {
  std::string label;
  std::vector<double> x, y;  // line charts: points; bar charts: y per category (x unused)
  bool right_axis = false;
};

struct Chart {
  std::string id, title;
  bool bar = false;
  std::string x_label, y_label, y2_label;
  std::vector<std::string> categories;  // bar charts
  std::vector<Series> series;
};

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

json finite_or_null(double value) {
  return std::isfinite(value) ? json(value) : json(nullptr);
}

const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"};

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
      for (size_t k = 0; k < chart.series.size(); ++k) {
        const Series& s = chart.series[k];
        if (c >= s.y.size() || !std::isfinite(s.y[c])) continue;
        const double bw = slot * 0.8 / static_cast<double>(m);
        const double x =
            left + slot * static_cast<double>(c) + slot * 0.1 + bw * static_cast<double>(k);
        const double y0 = sy(0, s.right_axis), y1 = sy(s.y[c], s.right_axis);
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

// The exact numbers of a chart, as a table (collapsed when long).
std::string chart_table(const Chart& chart) {
  std::string out = "<table><tr><th>" + escape(chart.bar ? "" : chart.x_label) + "</th>";
  for (const auto& s : chart.series) out += "<th>" + escape(s.label) + "</th>";
  out += "</tr>";
  size_t rows = 0;
  if (chart.bar) {
    for (size_t c = 0; c < chart.categories.size(); ++c, ++rows) {
      out += "<tr><td>" + escape(chart.categories[c]) + "</td>";
      for (const auto& s : chart.series) {
        out += "<td>" + (c < s.y.size() ? number(s.y[c]) : std::string("-")) + "</td>";
      }
      out += "</tr>";
    }
  } else {  // one row per x of any series
    std::map<double, std::vector<std::string>> by_x;
    for (size_t k = 0; k < chart.series.size(); ++k) {
      const Series& s = chart.series[k];
      for (size_t i = 0; i < s.x.size(); ++i) {
        auto& row = by_x[s.x[i]];
        row.resize(chart.series.size(), "");
        row[k] = number(s.y[i]);
      }
    }
    for (auto& [x, row] : by_x) {
      row.resize(chart.series.size(), "");
      out += "<tr><td>" + number(x) + "</td>";
      for (const auto& cell : row) out += "<td>" + cell + "</td>";
      out += "</tr>";
      ++rows;
    }
  }
  out += "</table>";
  if (rows > 12) {
    return fmt::format("<details><summary>{} rows</summary>{}</details>", rows, out);
  }
  return out;
}

// ---- the page ----------------------------------------------------------------------------------

class Page {
 public:
  explicit Page(bool chartjs) : chartjs_(chartjs) {}
  void section(const std::string& title, const std::string& intro = "") {
    body_ += "<h2>" + escape(title) + "</h2>\n";
    if (!intro.empty()) body_ += "<p>" + escape(intro) + "</p>\n";
  }
  void chart(Chart chart) {
    chart.id = "chart-" + chart.id;
    body_ += "<div class=\"figure\">";
    if (chartjs_) {
      body_ +=
          fmt::format("<div class=\"canvas\"><canvas id=\"{}\"></canvas></div>", escape(chart.id));
      scripts_ += fmt::format("new Chart(document.getElementById({}), {});\n",
                              script_json(chart.id), script_json(chartjs_config(chart)));
    } else {
      body_ += svg_chart(chart);
    }
    body_ += "<div class=\"numbers\">" + chart_table(chart) + "</div></div>\n";
    ids_.push_back(chart.id);
  }
  /// A two-column table of measures.
  void table(const std::vector<std::pair<std::string, std::string>>& rows) {
    if (rows.empty()) return;
    body_ += "<table class=\"measures\">";
    for (const auto& [key, value] : rows) {
      body_ += "<tr><th>" + escape(key) + "</th><td>" + escape(value) + "</td></tr>";
    }
    body_ += "</table>\n";
  }
  /// A table with a header row; row `marked` (when >= 0) gets class "chosen". Each row has class
  /// "row" so a reader can count them; `kind` is the table's class.
  void grid(const std::vector<std::string>& headers,
            const std::vector<std::vector<std::string>>& rows, int marked,
            const std::string& kind) {
    body_ += "<div class=\"wide\"><table class=\"" + escape(kind) + "\"><tr>";
    for (const auto& h : headers) body_ += "<th>" + escape(h) + "</th>";
    body_ += "</tr>";
    for (size_t r = 0; r < rows.size(); ++r) {
      body_ += static_cast<int>(r) == marked ? "<tr class=\"row chosen\">" : "<tr class=\"row\">";
      for (const auto& cell : rows[r]) body_ += "<td>" + escape(cell) + "</td>";
      body_ += "</tr>";
    }
    body_ += "</table></div>\n";
  }
  /// A titled list.
  void bullets(const std::string& title, const std::vector<std::string>& items) {
    if (items.empty()) return;
    body_ += "<p>" + escape(title) + ":</p><ul>";
    for (const auto& item : items) body_ += "<li>" + escape(item) + "</li>";
    body_ += "</ul>\n";
  }
  void paragraph(const std::string& text) { body_ += "<p>" + escape(text) + "</p>\n"; }
  void subsection(const std::string& title) { body_ += "<h3>" + escape(title) + "</h3>\n"; }
  const std::string& body() const { return body_; }
  const std::string& scripts() const { return scripts_; }
  const std::vector<std::string>& ids() const { return ids_; }

 private:
  bool chartjs_;
  std::string body_, scripts_;
  std::vector<std::string> ids_;
};

double num(const json& value, const std::string& pointer, double fallback = NAN) {
  const json::json_pointer p(pointer);
  if (!value.is_object() || !value.contains(p) || !value[p].is_number()) return fallback;
  return value[p].get<double>();
}

std::string text_at(const json& value, const std::string& key) {
  if (!value.is_object() || !value.contains(key)) return "";
  return value[key].is_string() ? value[key].get<std::string>() : value[key].dump();
}

// Top-level scalars of a rung file as table rows (objects and arrays left to the charts).
std::vector<std::pair<std::string, std::string>> scalar_rows(const json& value) {
  std::vector<std::pair<std::string, std::string>> rows;
  if (!value.is_object()) return rows;
  for (const auto& [key, v] : value.items()) {
    if (v.is_number())
      rows.emplace_back(key, number(v.get<double>()));
    else if (v.is_string())
      rows.emplace_back(key, v.get<std::string>());
    else if (v.is_boolean())
      rows.emplace_back(key, v.get<bool>() ? "true" : "false");
  }
  return rows;
}

std::string slug(std::string text) {
  for (char& c : text) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '-';
  }
  return text;
}

// ---- sections: one function each ---------------------------------------------------------------

void run_section(Page& page, RunFiles& files) {
  const json& manifest = files.rung("manifest.json");
  if (manifest.is_null()) return;
  page.section("Run");
  std::vector<std::pair<std::string, std::string>> rows = {
      {"command", text_at(manifest, "command_line")},
      {"started (UTC)", text_at(manifest, "start_time_utc")},
      {"kiln",
       text_at(manifest["kiln"], "version") + " " + text_at(manifest["kiln"], "git_commit")},
      {"libtorch", text_at(manifest["libtorch"], "version")},
      {"device", text_at(manifest, "device")},
      {"model", text_at(manifest["model"], "architecture") + ", " +
                    number(num(manifest, "/model/parameter_count")) + " parameters"}};
  if (manifest.contains("model") && manifest["model"].contains("init_from")) {
    rows.emplace_back("model.init_from", text_at(manifest["model"]["init_from"], "path"));
  }
  page.table(rows);
}

// Loss, validation loss and learning rate by step; step time and the data-wait share.
void training_section(Page& page, const MetricsFile& metrics) {
  page.section("Training: " + metrics.name, fmt::format("{} records", metrics.records.size()));
  Series loss{"loss", {}, {}}, val{"val_loss", {}, {}}, lr{"lr", {}, {}, true};
  Series step_time{"step_seconds", {}, {}}, wait{"data_wait_share", {}, {}, true};
  for (const json& r : metrics.records) {
    const double step = num(r, "/step");
    if (r.contains("loss")) {
      loss.x.push_back(step);
      loss.y.push_back(num(r, "/loss"));
    }
    if (r.contains("val_loss")) {
      val.x.push_back(step);
      val.y.push_back(num(r, "/val_loss"));
    }
    if (r.contains("lr")) {
      lr.x.push_back(step);
      lr.y.push_back(num(r, "/lr"));
    }
    if (r.contains("step_seconds")) {
      const double seconds = num(r, "/step_seconds");
      step_time.x.push_back(step);
      step_time.y.push_back(seconds);
      wait.x.push_back(step);
      wait.y.push_back(num(r, "/data_wait_seconds", 0) / seconds);
    }
  }
  const std::string id = slug(metrics.name);
  Chart losses{id + "-loss", "Loss by step (" + metrics.name + ")",
               false,        "step",
               "loss",       "learning rate",
               {},           {}};
  for (Series* s : {&loss, &val, &lr}) {
    if (!s->x.empty()) losses.series.push_back(*s);
  }
  if (!losses.series.empty()) page.chart(losses);
  if (!step_time.x.empty()) {
    page.chart(Chart{id + "-step-time",
                     "Step time (" + metrics.name + ")",
                     false,
                     "step",
                     "seconds",
                     "data-wait share",
                     {},
                     {step_time, wait}});
  }
}

void baseline_section(Page& page, RunFiles& files) {
  const json& b = files.rung("baseline.json");
  if (b.is_null()) return;
  page.section("Baseline", text_at(b, "verdict"));
  Chart memory{"baseline-memory", "Memory by part (baseline)", true, "", "bytes", "", {}, {}};
  Series bytes{"bytes", {}, {}};
  for (const auto& [part, pointer] : std::vector<std::pair<std::string, std::string>>{
           {"parameters", "/state_bytes/parameters"},
           {"gradients", "/state_bytes/gradients"},
           {"optimizer state", "/state_bytes/optimizer"},
           {"activations and the rest (peak - state)", ""},
           {"peak (" + text_at(b["peak_memory"], "method").substr(0, 40) + ")",
            "/peak_memory/allocated_bytes"}}) {
    double value = NAN;
    if (!pointer.empty()) {
      value = num(b, pointer);
    } else {
      value = num(b, "/peak_memory/allocated_bytes") - num(b, "/state_bytes/parameters") -
              num(b, "/state_bytes/gradients") - num(b, "/state_bytes/optimizer");
    }
    if (!std::isfinite(value)) continue;
    memory.categories.push_back(part);
    bytes.y.push_back(value);
  }
  memory.series.push_back(bytes);
  if (!memory.categories.empty()) page.chart(memory);
  page.table(scalar_rows(b));
}

void compile_section(Page& page, RunFiles& files) {
  const json& c = files.rung("compile.json");
  if (c.is_null()) return;
  page.section("Compile", text_at(c, "verdict"));
  Chart chart{"compile-step-time",
              "Eager vs compiled step time",
              true,
              "",
              "seconds",
              "",
              {"eager", "compiled"},
              {}};
  chart.series.push_back({"median step seconds",
                          {},
                          {num(c, "/eager/median_seconds"), num(c, "/compiled/median_seconds")}});
  chart.series.push_back(
      {"p90 step seconds", {}, {num(c, "/eager/p90_seconds"), num(c, "/compiled/p90_seconds")}});
  page.chart(chart);
  page.table(scalar_rows(c));
}

void profile_section(Page& page, RunFiles& files) {
  const json& p = files.rung("profile.json");
  if (p.is_null()) return;
  const json analysis = p.value("analysis", json::object());
  std::string verdict = p.contains("verdict") ? text_at(p["verdict"], "reason") : "";
  page.section("Profile", verdict);
  if (analysis.contains("phases") && analysis["phases"].is_array()) {
    Chart phases{"profile-phases", "Step phases (profile)", true, "", "seconds", "share", {}, {}};
    Series seconds{"seconds", {}, {}}, share{"share", {}, {}, true};
    for (const json& phase : analysis["phases"]) {
      phases.categories.push_back(text_at(phase, "phase"));
      seconds.y.push_back(num(phase, "/seconds"));
      share.y.push_back(num(phase, "/share"));
    }
    phases.series = {seconds, share};
    page.chart(phases);
  }
  if (analysis.contains("top_operators") && analysis["top_operators"].is_array()) {
    Chart ops{"profile-top-operators",
              "Top operators by self CPU time",
              true,
              "",
              "microseconds",
              "",
              {},
              {}};
    Series self{"self_cpu_us", {}, {}}, total{"total_cpu_us", {}, {}};
    for (const json& op : analysis["top_operators"]) {
      if (ops.categories.size() == 10) break;
      ops.categories.push_back(text_at(op, "name"));
      self.y.push_back(num(op, "/self_cpu_us"));
      total.y.push_back(num(op, "/total_cpu_us"));
    }
    ops.series = {self, total};
    page.chart(ops);
  }
  if (analysis.contains("memory_by_phase") && analysis["memory_by_phase"].is_array()) {
    Chart memory{"profile-memory", "Peak memory by phase (profile)", true, "", "bytes", "", {}, {}};
    Series peak{"peak_allocated_bytes", {}, {}}, growth{"growth_bytes", {}, {}};
    for (const json& phase : analysis["memory_by_phase"]) {
      memory.categories.push_back(text_at(phase, "phase") + " (" + text_at(phase, "device") + ")");
      peak.y.push_back(num(phase, "/peak_allocated_bytes"));
      growth.y.push_back(num(phase, "/growth_bytes"));
    }
    memory.series = {peak, growth};
    page.chart(memory);
  }
  if (p.contains("verdict")) page.table(scalar_rows(p["verdict"]));
}

void scale_section(Page& page, RunFiles& files) {
  const json& s = files.rung("scale.json");
  if (s.is_null()) return;
  page.section("Scale", text_at(s, "verdict"));
  if (s.contains("per_rank") && s["per_rank"].is_array()) {
    Chart throughput{"scale-throughput",
                     "Throughput per rank and global",
                     true,
                     "",
                     "samples per second",
                     "",
                     {},
                     {}};
    Series rate{"samples_per_second", {}, {}};
    Chart time{"scale-compute-comm",
               "Compute vs exposed communication per rank",
               true,
               "",
               "seconds",
               "",
               {},
               {}};
    Series compute{"compute_seconds", {}, {}}, exposed{"comm_exposed_seconds", {}, {}};
    for (const json& rank : s["per_rank"]) {
      const std::string name = "rank " + text_at(rank, "rank");
      throughput.categories.push_back(name);
      rate.y.push_back(num(rank, "/samples_per_second"));
      time.categories.push_back(name);
      compute.y.push_back(num(rank, "/compute_seconds"));
      exposed.y.push_back(num(rank, "/phase_seconds/comm_exposed"));
    }
    throughput.categories.push_back("global");
    rate.y.push_back(num(s, "/global/samples_per_second"));
    throughput.categories.push_back("one process (baseline)");
    rate.y.push_back(num(s, "/baseline/samples_per_second"));
    throughput.series = {rate};
    time.series = {compute, exposed};
    page.chart(throughput);
    page.chart(time);
  }
  // DDP vs FSDP memory, when the scale rung measured both (scale.json "memory": {"ddp": bytes,
  // "fsdp": bytes}).
  if (s.contains("memory") && s["memory"].is_object()) {
    Chart memory{
        "scale-memory", "Peak memory per rank: DDP vs FSDP", true, "", "bytes", "", {}, {}};
    Series bytes{"peak bytes", {}, {}};
    for (const auto& [mode, value] : s["memory"].items()) {
      if (!value.is_number()) continue;
      memory.categories.push_back(mode);
      bytes.y.push_back(value.get<double>());
    }
    memory.series = {bytes};
    if (!memory.categories.empty()) page.chart(memory);
  }
  std::vector<std::pair<std::string, std::string>> rows = scalar_rows(s);
  for (auto& row : scalar_rows(s.value("global", json::object()))) {
    rows.emplace_back("global " + row.first, row.second);
  }
  page.table(rows);
}

void checkpoint_section(Page& page, RunFiles& files) {
  const json& c = files.rung("checkpoint.json");
  if (c.is_null()) return;
  page.section("Checkpoint", text_at(c, "verdict"));
  Chart times{"checkpoint-times",
              "Checkpoint drill: save, resume, uninterrupted reference",
              true,
              "",
              "seconds",
              "",
              {},
              {}};
  Series seconds{"seconds", {}, {}};
  for (const char* key :
       {"save_seconds", "resume_seconds", "reference_seconds", "stall_seconds", "load_seconds"}) {
    const double value = num(c, std::string("/") + key);
    if (!std::isfinite(value)) continue;
    times.categories.push_back(key);
    seconds.y.push_back(value);
  }
  times.series = {seconds};
  if (!times.categories.empty()) page.chart(times);
  page.table(scalar_rows(c));
}

// ---- the pilot and the plan (docs/plan.md: pilot.json, plan.json) ------------------------------

// A member of an object, or null (the const operator[] of a missing key is undefined).
const json& member(const json& value, const std::string& key) {
  static const json null_value = nullptr;
  if (!value.is_object()) return null_value;
  auto it = value.find(key);
  return it == value.end() ? null_value : *it;
}

std::string yes_no(const json& value) {
  if (!value.is_boolean()) return "-";
  return value.get<bool>() ? "yes" : "no";
}

std::string bytes_text(double value) {
  return std::isfinite(value) ? format_bytes(value) : "-";
}

std::string seconds_text(double value) {
  return std::isfinite(value) ? format_duration(value) : "-";
}

// A figure for a wide table (the charts' tables keep every digit): whole above 1000, else three
// significant digits.
std::string short_number(double value) {
  if (!std::isfinite(value)) return "-";
  return std::abs(value) >= 1000 ? fmt::format("{:.0f}", value) : fmt::format("{:.3g}", value);
}

// Parts of a rung file the report needs but did not find: one paragraph in its section and one
// entry of the page's "Not in this run" line.
void say_lacking(Page& page, RunFiles& files, const std::string& file,
                 const std::vector<std::string>& parts) {
  if (parts.empty()) return;
  std::string list;
  for (const auto& part : parts) list += (list.empty() ? "" : ", ") + part;
  files.note_missing(fmt::format("{} without {}", file, list));
  page.paragraph(
      fmt::format("{} lacks {}: the section shows what it holds (an interrupted rung "
                  "or an older format; rerun the rung to complete it).",
                  file, list));
}

// The pilot: its estimate vs measured memory by part, the cycle's times (step, evaluation, save,
// restore in a fresh process) and the restore's equality, the pins it recorded.
void pilot_report(Page& page, RunFiles& files) {
  const json& p = files.rung("pilot.json");
  if (p.is_null()) return;
  page.section("Pilot", text_at(p, "verdict"));
  std::vector<std::string> lacking;
  const json& memory = member(p, "memory");
  const json& measured = member(memory, "measured");
  const json& estimate = member(memory, "estimate");
  if (!measured.is_object()) lacking.push_back("memory.measured");
  if (!estimate.is_object()) lacking.push_back("memory.estimate");
  if (measured.is_object() || estimate.is_object()) {
    page.subsection("Memory: estimated vs measured");
    Chart chart{"pilot-memory",
                "Peak memory by part: estimated vs measured (pilot)",
                true,
                "",
                "bytes",
                "",
                {},
                {}};
    Series est{"estimated", {}, {}}, meas{"measured", {}, {}};
    const double est_peak = std::isfinite(num(memory, "/estimate_step_peak_bytes"))
                                ? num(memory, "/estimate_step_peak_bytes")
                                : num(estimate, "/step_peak_bytes");
    for (const auto& [part, estimated, measured_value] :
         std::vector<std::tuple<std::string, double, double>>{
             {"parameters", num(estimate, "/parameters_bytes"), num(measured, "/parameters_bytes")},
             {"gradients", num(estimate, "/gradients_bytes"), num(measured, "/gradients_bytes")},
             {"optimizer state", num(estimate, "/optimizer_bytes"),
              num(measured, "/optimizer_bytes")},
             {"activations + logits",
              num(estimate, "/activations_bytes") + num(estimate, "/logits_bytes"),
              num(measured, "/activations_and_logits_bytes")},
             {"step peak", est_peak, num(measured, "/peak_bytes")}}) {
      chart.categories.push_back(part);
      est.y.push_back(estimated);
      meas.y.push_back(measured_value);
    }
    chart.series = {est, meas};
    page.chart(chart);
    page.table({
        {"method", text_at(memory, "method")},
        {"measured / estimated peak", number(num(memory, "/measured_over_estimate"))},
        {"within pilot.max_estimate_error", yes_no(member(memory, "within_allowed_error"))},
        {"activation ratio (measured / estimated activations + logits)",
         number(num(memory, "/activation_ratio"))},
        {"estimate: activations", bytes_text(num(estimate, "/activations_bytes"))},
        {"estimate: logits buffers", bytes_text(num(estimate, "/logits_bytes"))},
        {"estimate: last block's backward extra",
         bytes_text(num(estimate, "/backward_extra_bytes"))},
        {"estimate: gradients held across micro-batches",
         yes_no(member(estimate, "gradients_held_across_micro_batches"))},
        {"measured: step's peak above the state",
         bytes_text(num(measured, "/step_peak_above_state_bytes"))},
        {"measured: process peak RSS", bytes_text(num(measured, "/process_peak_rss_bytes"))},
        {"measured: reserved", bytes_text(num(measured, "/reserved_bytes"))},
    });
  }

  // The cycle: one chart of its times, the exact figures and the restore's outcome as a table.
  const json& checkpoint = member(p, "checkpoint");
  const json& restore = member(p, "restore");
  if (!checkpoint.is_object()) lacking.push_back("checkpoint");
  if (!restore.is_object()) lacking.push_back("restore");
  page.subsection("Cycle: train, evaluate, save, restore");
  Chart cycle{"pilot-cycle",
              "The pilot's cycle: step, evaluation, save, restore in a fresh process",
              true,
              "",
              "seconds",
              "",
              {"measured step", "evaluation", "checkpoint save", "restore (fresh process)"},
              {}};
  cycle.series.push_back({"seconds",
                          {},
                          {num(p, "/step_seconds"), num(p, "/eval_seconds"),
                           num(checkpoint, "/save_seconds"), num(restore, "/seconds")}});
  page.chart(cycle);
  const json& shape = member(p, "shape");
  std::string equality = "-";
  if (member(restore, "loss_equal").is_boolean()) {
    const bool equal = member(restore, "loss_equal").get<bool>();
    const bool bitwise = member(restore, "loss_bitwise_equal").is_boolean() &&
                         member(restore, "loss_bitwise_equal").get<bool>();
    equality = fmt::format(
        "{} ({} here, {} restored{})", equal ? (bitwise ? "bitwise equal" : "equal") : "DIFFERENT",
        number(num(restore, "/loss_here")), number(num(restore, "/loss_restored")),
        num(restore, "/tolerance", 0) > 0
            ? fmt::format(", tolerance {:g} relative", num(restore, "/tolerance"))
            : "");
  }
  std::string differing = "-";
  if (member(restore, "differing_tensors").is_array()) {
    const json& names = member(restore, "differing_tensors");
    differing = names.empty() ? "none" : fmt::format("{}: {}", names.size(), names.dump());
  }
  std::string exits = text_at(restore, "exit_status");
  if (member(restore, "exit_status_by_rank").is_array()) {
    exits += " (by rank " + member(restore, "exit_status_by_rank").dump() + ")";
  }
  page.table({
      {"shape", fmt::format("micro-batch {} x seq {} x accum {} x {} process(es), {}",
                            text_at(shape, "micro_batch"), text_at(shape, "seq_len"),
                            text_at(shape, "grad_accum_steps"), text_at(p, "world_size"),
                            text_at(shape, "precision"))},
      {"device", text_at(p, "device") + " (" + text_at(p, "device_name") + ")"},
      {"steps", text_at(p, "steps")},
      {"measured step",
       fmt::format("{} s, loss {}", number(num(p, "/step_seconds")), number(num(p, "/loss")))},
      {"MFU", member(p, "mfu").is_number() ? fmt::format("{:.2f}%", 100 * num(p, "/mfu"))
                                           : "- (no peak FLOP/s for this device)"},
      {"evaluation", fmt::format("{} s, val loss {}", number(num(p, "/eval_seconds")),
                                 number(num(p, "/val_loss")))},
      {"checkpoint save", fmt::format("{} in {} s ({}/s)", bytes_text(num(checkpoint, "/bytes")),
                                      number(num(checkpoint, "/save_seconds")),
                                      bytes_text(num(checkpoint, "/write_bytes_per_second")))},
      {"restore", fmt::format("step {} at world {} in a fresh process: {} s, exit status {}",
                              text_at(restore, "step"), text_at(restore, "world_size"),
                              number(num(restore, "/seconds")), exits)},
      {"restored step's loss", equality},
      {"differing tensors", differing},
      {"restore check", yes_no(member(restore, "passed"))},
      {"whole pilot", number(num(p, "/wall_seconds")) + " s"},
  });

  // The pins: the job's hashes here, the environment in manifest.json (the pilot adds "pins").
  const json& manifest = files.rung("manifest.json");
  const json& pins = member(manifest, "pins");
  page.subsection("Pins");
  std::vector<std::pair<std::string, std::string>> pin_rows = {
      {"job hash (the plan's --pilot check)", text_at(p, "job_hash")},
      {"config hash", text_at(p, "config_hash")}};
  if (pins.is_object()) {
    const json& python = member(pins, "python");
    pin_rows.emplace_back("python",
                          text_at(python, "version") + " " + text_at(python, "executable"));
    if (member(python, "pip_freeze").is_array()) {
      pin_rows.emplace_back("pip freeze",
                            fmt::format("{} packages", member(python, "pip_freeze").size()));
    }
    if (member(pins, "debian_packages").is_array()) {
      std::string list;
      for (const auto& package : member(pins, "debian_packages")) {
        if (package.is_string()) list += (list.empty() ? "" : ", ") + package.get<std::string>();
      }
      pin_rows.emplace_back("Debian packages", list);
    }
    pin_rows.emplace_back("pins recorded (UTC)", text_at(pins, "recorded_utc"));
  } else {
    files.note_missing("manifest.json pins");
    page.paragraph(
        "manifest.json holds no pins (the pilot records Python, pip and Debian "
        "packages there): rerun `kiln pilot` to record them.");
  }
  if (manifest.is_object()) {
    const json& container = member(manifest, "container");
    pin_rows.emplace_back("container", member(container, "digest").is_string()
                                           ? text_at(container, "digest")
                                           : text_at(container, "digest_source"));
    const json& data = member(manifest, "data");
    const json& model = member(manifest, "model");
    pin_rows.emplace_back("data content (xxh3)", text_at(data, "content_xxh3"));
    pin_rows.emplace_back("initial weights (xxh3)", text_at(model, "initial_weights_xxh3"));
    for (const auto& [part, value] : {std::pair{"model", &model}, std::pair{"data", &data}}) {
      if (member(*value, "revision").is_string()) {
        pin_rows.emplace_back(std::string(part) + ".revision", text_at(*value, "revision"));
      }
    }
  }
  page.table(pin_rows);
  say_lacking(page, files, "pilot.json", lacking);
}

// The plan: a row per hardware candidate (strategy, memory per device, step time, tokens/s, MFU,
// days, ETTR, reservations and their cost), the recommended row marked; charts of the projected
// wall time (and cost) and of the memory needed per device against what is usable.
void plan_report(Page& page, RunFiles& files) {
  const json& p = files.rung("plan.json");
  if (p.is_null()) return;
  page.section("Plan",
               p.contains("verdict") ? text_at(p, "verdict") : text_at(p, "recommendation_text"));
  std::vector<std::string> lacking;
  const json& model = member(p, "model");
  const json& job = member(p, "job");
  const json& estimate = member(member(p, "memory_per_device"), "estimate");
  page.table({
      {"config", text_at(p, "config")},
      {"calibrated by", member(p, "pilot").is_string() ? "the pilot in " + text_at(p, "pilot")
                                                       : "no pilot: the assumptions below"},
      {"model",
       fmt::format("{}, {} parameters, {} FLOP/token", text_at(model, "architecture"),
                   number(num(model, "/parameters")), number(num(model, "/flops_per_token")))},
      {"job", fmt::format("micro-batch {} x seq {} x accum {} on {} GPUs, {}, {}",
                          text_at(job, "micro_batch"), text_at(job, "seq_len"),
                          text_at(job, "grad_accum_steps"), text_at(job, "gpus"),
                          text_at(job, "precision"), text_at(job, "optimizer"))},
      {"tokens", fmt::format("{} in {} steps ({} per step), {} evaluations",
                             number(num(job, "/tokens")), number(num(job, "/steps")),
                             number(num(job, "/tokens_per_step")), number(num(job, "/evals")))},
      {"memory per device (DDP, estimated)",
       fmt::format("step peak {}, everything at once {}, activations calibrated x{}",
                   bytes_text(num(estimate, "/step_peak_bytes")),
                   bytes_text(num(estimate, "/total_bytes")),
                   number(num(p, "/memory_per_device/activation_calibration")))},
      {"checkpoint", bytes_text(num(p, "/checkpoint/bytes"))},
  });

  const json& rows = member(p, "rows");
  if (!rows.is_array() || rows.empty()) {
    lacking.push_back("rows");
  } else {
    page.subsection("Hardware rows");
    const json& recommendation = member(p, "recommendation");
    const std::string chosen = text_at(recommendation, "hardware");
    const double tokens_per_step = num(job, "/tokens_per_step");
    Chart time{"plan-time", "Projected wall time per hardware row (plan)", true, "", "days", "", {},
               {}};
    Series days{"wall days", {}, {}};
    Series cost7{"7-day cost", {}, {}, true}, cost30{"30-day cost", {}, {}, true};
    Chart memory{"plan-memory",
                 "Memory per device: needed by the strategy vs usable (plan)",
                 true,
                 "",
                 "bytes",
                 "",
                 {},
                 {}};
    Series needed{"needed per device", {}, {}}, usable{"usable per device", {}, {}};
    bool any_cost = false;
    std::vector<std::vector<std::string>> table;
    int marked = -1;
    for (const json& row : rows) {
      const std::string hardware = text_at(row, "hardware");
      const bool is_chosen = !chosen.empty() && hardware == chosen;
      if (is_chosen) marked = static_cast<int>(table.size());
      const json& s = member(row, "strategy");
      const std::string strategy = text_at(s, "strategy");
      // What the chosen strategy holds per device; "does-not-fit": FSDP over every GPU, the least.
      const double need =
          strategy == "ddp" ? num(s, "/ddp_bytes_per_device") : num(s, "/fsdp_bytes_per_device");
      const bool fits =
          member(row, "fits_memory").is_boolean() && member(row, "fits_memory").get<bool>();
      const std::string label = hardware + (is_chosen ? " (chosen)" : "");
      time.categories.push_back(label);
      days.y.push_back(fits ? num(row, "/wall_days") : NAN);
      memory.categories.push_back(label);
      needed.y.push_back(need);
      usable.y.push_back(num(s, "/usable_bytes"));
      auto reservation = [&](const char* key, Series& series) {
        const json& r = member(row, key);
        const double cost = num(r, "/cost");
        series.y.push_back(cost);
        any_cost = any_cost || std::isfinite(cost);
        std::string text =
            member(r, "fits").is_boolean() ? (member(r, "fits").get<bool>() ? "fits" : "no") : "-";
        if (std::isfinite(cost)) text += ", cost " + short_number(cost);
        return text;
      };
      const std::string r7 = reservation("reservation_7d", cost7);
      const std::string r30 = reservation("reservation_30d", cost30);
      const double step = num(row, "/step_seconds");
      const std::string mfu_source = text_at(row, "mfu_source");
      table.push_back({
          label,
          text_at(row, "display_name"),
          text_at(row, "gpus"),
          yes_no(member(row, "fits_memory")),
          strategy + (strategy == "fsdp" ? " x" + text_at(s, "fsdp_degree") : ""),
          bytes_text(need),
          bytes_text(num(s, "/usable_bytes")),
          fmt::format("{} s ({} compute + {} comm)", short_number(step),
                      short_number(num(row, "/compute_seconds_per_step")),
                      short_number(num(row, "/communication_seconds_per_step"))),
          step > 0 ? short_number(tokens_per_step / step) : "-",
          fmt::format("{:.1f}% ({})", 100 * num(row, "/mfu"),
                      mfu_source.starts_with("pilot") ? "pilot" : "assumed"),
          fits ? short_number(num(row, "/wall_days")) : "-",
          fmt::format("{:.1f}%", 100 * num(row, "/ettr")),
          seconds_text(num(row, "/checkpoint_interval_seconds")),
          short_number(num(row, "/expected_failures")),
          r7,
          r30,
          is_chosen ? fmt::format("chosen: {} days", text_at(recommendation, "reservation_days"))
                    : "",
      });
    }
    time.series = {days};
    if (any_cost) {
      time.y2_label = "cost (reservation)";
      time.series.push_back(cost7);
      time.series.push_back(cost30);
    }
    memory.series = {needed, usable};
    page.chart(time);
    page.chart(memory);
    page.grid({"hardware", "device", "GPUs", "fits memory", "strategy", "memory per device",
               "usable per device", "step", "tokens/s", "MFU", "wall days", "ETTR",
               "checkpoint every", "expected failures", "7 days", "30 days", "recommended"},
              table, marked, "plan");
    page.paragraph("Recommendation: " + text_at(p, "recommendation_text") +
                   ". tokens/s = the job's tokens per step / the row's step time.");
    std::vector<std::string> reasons;
    for (const json& row : rows) {
      reasons.push_back(text_at(row, "hardware") + ": " +
                        text_at(member(row, "strategy"), "reason"));
    }
    page.bullets("Why each strategy", reasons);
  }
  if (member(p, "assumptions").is_array()) {
    std::vector<std::string> assumptions;
    for (const auto& a : member(p, "assumptions")) {
      assumptions.push_back(a.is_string() ? a.get<std::string>() : a.dump());
    }
    page.bullets("Assumptions", assumptions);
  }
  say_lacking(page, files, "plan.json", lacking);
}

using Section = std::function<void(Page&, RunFiles&)>;

const std::vector<Section>& sections() {
  static const std::vector<Section> list = {
      run_section,
      [](Page& page, RunFiles& files) {
        for (const auto& metrics : files.metrics()) training_section(page, metrics);
      },
      baseline_section,
      compile_section,
      profile_section,
      scale_section,
      checkpoint_section,
      pilot_report,
      plan_report,
  };
  return list;
}

const char* kStyle = R"(body{font-family:sans-serif;margin:2em;max-width:1400px;color:#222}
h2{border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:2em}
.figure{display:flex;gap:2em;align-items:flex-start;margin:1em 0}
.canvas{position:relative;width:640px;height:280px;flex:none}
.numbers{max-height:280px;overflow:auto;font-size:12px}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:2px 6px;text-align:right}
table.measures th{text-align:left}.note{color:#555;font-style:italic}
.wide{overflow-x:auto;margin:1em 0}tr.chosen td{background:#e6f2e6;font-weight:bold}
h3{margin:1.2em 0 .3em;font-size:1.05em;color:#444})";

}  // namespace

fs::path default_chart_library() {
  return KILN_CHARTJS;
}

ReportHtml make_report_html(const fs::path& run_dir, const fs::path& chart_library) {
  std::error_code ec;
  if (!fs::is_directory(run_dir, ec)) {
    throw UserError("report: " + run_dir.string() +
                    " is not a directory; give a run directory "
                    "(runs/<name>)");
  }
  ReportHtml out;
  const fs::path library = chart_library.empty() ? default_chart_library() : chart_library;
  std::string chartjs;
  if (!library.empty() && fs::is_regular_file(library, ec)) {
    chartjs = read_file(library);
    out.chart_library = true;
    out.chart_library_source = fs::canonical(library, ec).string();
  } else {
    out.chart_library_source =
        library.empty() ? "the build found no Chart.js (Debian: apt-get install libjs-chart.js)"
                        : library.string() + " is absent (Debian: apt-get install libjs-chart.js)";
  }
  RunFiles files(run_dir);
  Page page(out.chart_library);
  for (const auto& section : sections()) section(page, files);
  out.missing = files.missing();
  out.charts = page.ids();

  const std::string name = fs::absolute(run_dir).lexically_normal().filename().string();
  std::string html = fmt::format(
      "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n<title>kiln report: "
      "{}</title>\n<style>{}</style>\n",
      escape(name), kStyle);
  if (out.chart_library) {
    // The library file verbatim; "</script" cannot occur in a minified library's code.
    html += "<script>\n" + chartjs + "\n</script>\n";
  }
  html += fmt::format("</head><body>\n<h1>kiln report: {}</h1>\n", escape(name));
  html += fmt::format("<p class=\"note\">Generated {} from {}. ", utc_now_iso8601(),
                      escape(fs::absolute(run_dir).lexically_normal().string()));
  html += out.chart_library
              ? fmt::format("Charts: Chart.js inlined from {}.", escape(out.chart_library_source))
              : fmt::format("Charts: plain SVG, because {}.", escape(out.chart_library_source));
  html += "</p>\n";
  html += "<p class=\"missing\">" +
          (out.missing.empty() ? std::string("Every run file the report reads is here.")
                               : escape("Not in this run: " +
                                        [&] {
                                          std::string list;
                                          for (const auto& m : out.missing)
                                            list += (list.empty() ? "" : ", ") + m;
                                          return list;
                                        }() +
                                        ".")) +
          "</p>\n";
  html += page.body();
  if (out.chart_library) html += "<script>\n" + page.scripts() + "</script>\n";
  html += "</body></html>\n";
  out.html = std::move(html);
  return out;
}

ReportHtml write_report_html(const fs::path& run_dir, const fs::path& chart_library) {
  ReportHtml report = make_report_html(run_dir, chart_library);
  write_file_atomic(run_dir / "report.html", report.html);
  return report;
}

}  // namespace kiln
