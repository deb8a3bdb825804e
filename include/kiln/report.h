// Seeing a run: report.html, one self-contained page of charts and tables regenerated from a
// run directory's files, and the comparison of two runs (docs/report.md). The renderers read
// the typed rung files (kiln/results.h) and nothing of the rungs that wrote them.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace kiln {

// ---- report.html -------------------------------------------------------------------------------

struct ReportHtml {
  std::string html;                  // the whole page
  bool chart_library = false;        // Chart.js inlined (else the charts are plain SVG)
  std::string chart_library_source;  // the file it was read from, or why there is none
  std::vector<std::string> charts;   // the id of every chart, in page order
  // The run files that were absent ("plan.json") or unreadable ("pilot.json (unreadable)"), and
  // parts a section needed and did not find ("pilot.json without restore", "manifest.json pins").
  std::vector<std::string> missing;
};

/// The report of a run directory, from whatever of its files exist: manifest.json, config.toml,
/// metrics.jsonl and metrics-<rung>.jsonl, and each rung's file read through its typed result
/// (kiln/results.h). The first screen is the ladder's scorecard (one row per rung: status, the
/// numbers that matter, the decision and its config key, a link to its section) and the run's
/// identity; then the training curves and one section per rung, its key/value dump folded.
/// Missing files are listed in one line of the page (and in `missing`); a rung file the typed
/// reader refuses (a missing or renamed key, a newer schema) is listed as "<file> (unreadable)"
/// and its section and scorecard row carry the reader's one line (file, key, schema version, how
/// to regenerate), never an error; a metrics line that is not a step record is skipped. Charts
/// use Chart.js inlined from `chart_library` (the build's KILN_CHARTJS, Debian's libjs-chart.js,
/// when empty); when that file is absent the charts are plain SVG and the page says so. Each
/// chart's numbers sit beside it as a table. Nothing is fetched at view time. Throws UserError
/// only when `run_dir` is not a directory.
ReportHtml make_report_html(const std::filesystem::path& run_dir,
                            const std::filesystem::path& chart_library = {});

/// make_report_html, written atomically to <run_dir>/report.html; returns what it wrote. Throws
/// UserError (not a directory, cannot write).
ReportHtml write_report_html(const std::filesystem::path& run_dir,
                             const std::filesystem::path& chart_library = {});

/// Two runs side by side: the loss and throughput curves of both on shared axes, each rung's
/// numbers in run A and run B with their difference (B - A), and the config.toml keys whose
/// values differ. Throws UserError when either is not a directory.
ReportHtml make_comparison_html(const std::filesystem::path& run_a,
                                const std::filesystem::path& run_b,
                                const std::filesystem::path& chart_library = {});

/// make_comparison_html, written atomically to <out_dir>/report.html (out_dir created). Throws
/// UserError (not a directory, cannot write).
ReportHtml write_comparison_html(const std::filesystem::path& run_a,
                                 const std::filesystem::path& run_b,
                                 const std::filesystem::path& out_dir,
                                 const std::filesystem::path& chart_library = {});

/// The Chart.js file the build found (empty when it found none).
std::filesystem::path default_chart_library();

}  // namespace kiln
