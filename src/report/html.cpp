// report.html (kiln/report.h): one self-contained page from a run directory's files. The first
// screen is the ladder's scorecard and the run's identity; then the training curves and one
// section per rung (src/report/*_sections.cpp), each from its typed result (kiln/results.h);
// the markup comes from the templates in src/report/page.cpp.
#include <fmt/format.h>

#include "core/files.h"
#include "kiln/error.h"
#include "kiln/report.h"
#include "report/report_html.h"
#include "report/sections.h"

#ifndef KILN_CHARTJS
#define KILN_CHARTJS ""
#endif

namespace kiln {

namespace fs = std::filesystem;

namespace report {

std::string load_chart_library(const fs::path& chart_library, ReportHtml& out) {
  std::error_code ec;
  const fs::path library = chart_library.empty() ? default_chart_library() : chart_library;
  if (!library.empty() && fs::is_regular_file(library, ec)) {
    out.chart_library = true;
    out.chart_library_source = fs::canonical(library, ec).string();
    return read_file(library);
  }
  out.chart_library_source =
      library.empty() ? "the build found no Chart.js (Debian: apt-get install libjs-chart.js)"
                      : library.string() + " is absent (Debian: apt-get install libjs-chart.js)";
  return "";
}

std::string charts_note(const ReportHtml& out) {
  return out.chart_library
             ? fmt::format("Charts: Chart.js inlined from {}.", out.chart_library_source)
             : fmt::format("Charts: plain SVG, because {}.", out.chart_library_source);
}

std::string missing_line(const std::vector<std::string>& missing) {
  if (missing.empty()) return "Every run file the report reads is here.";
  std::string list;
  for (const auto& m : missing) list += (list.empty() ? "" : ", ") + m;
  return "Not in this run: " + list + ".";
}

void check_run_directory(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    throw UserError("report: " + dir.string() +
                    " is not a directory; give a run directory (runs/<name>)");
  }
}

}  // namespace report

fs::path default_chart_library() {
  return KILN_CHARTJS;
}

ReportHtml make_report_html(const fs::path& run_dir, const fs::path& chart_library) {
  using namespace report;
  check_run_directory(run_dir);
  ReportHtml out;
  PageParts parts;
  parts.chartjs = load_chart_library(chart_library, out);
  const RunData run = load_run(run_dir);
  parts.title = run.name;
  parts.source = fs::absolute(run_dir).lexically_normal().string();
  parts.charts_note = charts_note(out);
  parts.scorecard = scorecard_data(run);
  parts.identity = identity_data(run);
  SectionSink sink{out.chart_library, &out.charts, &parts.sections};
  for (auto* section :
       {training_section, plan_tracking_section, baseline_section, compile_section, profile_section,
        scale_section, checkpoint_section, pilot_section, plan_section}) {
    section(run, sink);
  }
  out.missing = run.missing;
  parts.missing_line = missing_line(out.missing);
  out.html = render_page(parts);
  return out;
}

ReportHtml write_report_html(const fs::path& run_dir, const fs::path& chart_library) {
  ReportHtml report = make_report_html(run_dir, chart_library);
  write_file_atomic(run_dir / "report.html", report.html);
  return report;
}

}  // namespace kiln
