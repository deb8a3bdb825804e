// Two runs side by side (kiln/report.h, make_comparison_html): each rung's scorecard numbers in
// run A and run B with their difference, the config keys that differ, and the loss and
// throughput curves of both on shared axes.
#include <fmt/format.h>

#include <cmath>
#include <map>

#include "core/files.h"
#include "kiln/report.h"
#include "report/report_html.h"
#include "report/sections.h"

namespace kiln {

namespace fs = std::filesystem;

namespace report {
namespace {

std::string difference_text(double a, double b) {
  if (!std::isfinite(a) || !std::isfinite(b)) return "-";
  const double d = b - a;
  if (a == 0) return fmt::format("{:+.4g}", d);
  return fmt::format("{:+.4g} ({:+.1f}%)", d, 100 * d / std::abs(a));
}

std::vector<CompareRow> compare_rows(const RunData& a, const RunData& b) {
  const std::vector<ScoreRow> rows_a = score_rows(a), rows_b = score_rows(b);
  std::vector<CompareRow> out;
  for (size_t k = 0; k < rows_a.size() && k < rows_b.size(); ++k) {
    const ScoreRow &ra = rows_a[k], &rb = rows_b[k];
    if (ra.status_class == "absent" && rb.status_class == "absent") continue;
    out.push_back({ra.rung, "status", "status", ra.status, rb.status,
                   ra.status == rb.status ? "same" : "changed", NAN, NAN});
    std::vector<std::string> names;
    for (const auto& f : ra.figures) names.push_back(f.name);
    for (const auto& f : rb.figures) {
      if (std::find(names.begin(), names.end(), f.name) == names.end()) names.push_back(f.name);
    }
    for (const auto& name : names) {
      auto find = [&](const ScoreRow& row) -> const Figure* {
        for (const auto& f : row.figures) {
          if (f.name == name) return &f;
        }
        return nullptr;
      };
      const Figure *fa = find(ra), *fb = find(rb);
      CompareRow row{ra.rung,
                     name,
                     name,
                     fa ? fa->text : "-",
                     fb ? fb->text : "-",
                     "",
                     fa ? fa->exact : NAN,
                     fb ? fb->exact : NAN};
      const bool numeric = std::isfinite(row.a_exact) || std::isfinite(row.b_exact);
      row.difference = numeric ? difference_text(row.a_exact, row.b_exact)
                               : (row.a_text == row.b_text ? "same" : "changed");
      out.push_back(row);
    }
  }
  return out;
}

std::vector<std::vector<std::string>> config_differences(const RunData& a, const RunData& b) {
  std::map<std::string, std::pair<std::string, std::string>> keys;
  for (const auto& [key, value] : a.config) keys[key].first = value;
  for (const auto& [key, value] : b.config) keys[key].second = value;
  std::vector<std::vector<std::string>> rows;
  for (const auto& [key, values] : keys) {
    if (values.first == values.second) continue;
    rows.push_back({key, values.first.empty() ? "(absent)" : values.first,
                    values.second.empty() ? "(absent)" : values.second});
  }
  return rows;
}

void curves(const RunData& a, const RunData& b, Section& section) {
  Chart loss{"compare-loss",
             "Train and validation loss, both runs",
             false,
             false,
             true,
             "step",
             "loss",
             "",
             {},
             {}};
  Chart rate{"compare-throughput",
             "Throughput by step, both runs",
             false,
             false,
             false,
             "step",
             "",
             "",
             {},
             {}};
  bool tokens = false;
  for (const RunData* run : {&a, &b}) {
    if (const MetricsFile* m = run->main_metrics()) tokens = tokens || records_tokens(*m);
  }
  rate.y_label = tokens ? "tokens/s" : "samples/s";
  for (const auto& [tag, run] : {std::pair{"A", &a}, std::pair{"B", &b}}) {
    const MetricsFile* m = run->main_metrics();
    if (m == nullptr) continue;
    const MetricsCurves c = metrics_curves(*m, tokens, fmt::format("{}: ", tag));
    for (const Series* s : {&c.loss, &c.val}) {
      if (!s->x.empty()) loss.series.push_back(*s);
    }
    if (!c.rate.x.empty()) rate.series.push_back(c.rate);
  }
  if (!loss.series.empty()) section.chart(loss);
  if (!rate.series.empty()) section.chart(rate);
  if (loss.series.empty() && rate.series.empty()) {
    section.paragraph("Neither run has a metrics file with step records.");
  }
}

Data identity_pair(const RunData& a, const RunData& b) {
  auto field = [](const RunData& run, const std::string& name) -> std::string {
    if (name == "run") return run.dir.string();
    if (!run.identity.value)
      return run.identity.present ? run.identity.error : "(no manifest.json)";
    const RunIdentity& m = *run.identity.value;
    if (name == "commit") return m.git_commit + (m.git_dirty ? " (with local changes)" : "");
    if (name == "config_hash") return m.config_hash;
    if (name == "data") {
      return m.data_revision.value_or(m.data_content_hash.empty() ? m.data_kind
                                                                  : m.data_content_hash);
    }
    return fmt::format("{} x {}", m.world_size, m.device);
  };
  Data list{Data::type::list};
  for (const auto& [name, key] :
       {std::pair{"run", "run directory"}, std::pair{"commit", "commit"},
        std::pair{"config_hash", "config hash (xxh64)"}, std::pair{"data", "data revision"},
        std::pair{"device", "device"}}) {
    Data row;
    row.set("name", name);
    row.set("key", key);
    Data values{Data::type::list};
    values.push_back(Data("A: " + field(a, name)));
    values.push_back(Data("B: " + field(b, name)));
    row.set("values", values);
    list.push_back(row);
  }
  Data out;
  out.set("rows", list);
  return out;
}

}  // namespace
}  // namespace report

ReportHtml make_comparison_html(const fs::path& run_a, const fs::path& run_b,
                                const fs::path& chart_library) {
  using namespace report;
  check_run_directory(run_a);
  check_run_directory(run_b);
  ReportHtml out;
  PageParts parts;
  parts.chartjs = load_chart_library(chart_library, out);
  const RunData a = load_run(run_a), b = load_run(run_b);
  parts.title = fmt::format("{} (A) vs {} (B)", a.name, b.name);
  parts.source = fs::absolute(run_a).lexically_normal().string() + " and " +
                 fs::absolute(run_b).lexically_normal().string();
  parts.charts_note = charts_note(out);
  parts.identity = identity_pair(a, b);
  SectionSink sink{out.chart_library, &out.charts, &parts.sections};
  Section& ladder = sink.add("comparison", "The ladder, side by side");
  ladder.intro(
      fmt::format("A: {}. B: {}.", next_step(a, score_rows(a)), next_step(b, score_rows(b))));
  ladder.compare(compare_rows(a, b));
  Section& config = sink.add("config-differences", "Config keys that differ");
  const auto differences = config_differences(a, b);
  if (differences.empty()) {
    config.paragraph(a.config.empty() || b.config.empty()
                         ? "A run has no config.toml to compare."
                         : "None: the two resolved configs are equal.");
  } else {
    config.grid({"key", "A", "B"}, differences, -1, "config-differences");
  }
  curves(a, b, sink.add("curves", "Training curves"));
  for (const auto& m : a.missing) out.missing.push_back("A: " + m);
  for (const auto& m : b.missing) out.missing.push_back("B: " + m);
  parts.missing_line = missing_line(out.missing);
  out.html = render_page(parts);
  return out;
}

ReportHtml write_comparison_html(const fs::path& run_a, const fs::path& run_b,
                                 const fs::path& out_dir, const fs::path& chart_library) {
  ReportHtml report = make_comparison_html(run_a, run_b, chart_library);
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) {
    throw UserError(fmt::format("report: cannot create {} ({}); give a writable --out directory",
                                out_dir.string(), ec.message()));
  }
  write_file_atomic(out_dir / "report.html", report.html);
  return report;
}

}  // namespace kiln
