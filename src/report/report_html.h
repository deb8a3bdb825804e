// Shared by the single-run report and the comparison (private to src/report).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "kiln/report.h"

namespace kiln::report {

/// The chart library's text ("" when absent); sets out.chart_library and its source.
std::string load_chart_library(const std::filesystem::path& chart_library, ReportHtml& out);
/// One sentence: where the charts come from.
std::string charts_note(const ReportHtml& out);
/// "Not in this run: a, b." or "Every run file the report reads is here."
std::string missing_line(const std::vector<std::string>& missing);
/// Throws UserError when `dir` is not a directory.
void check_run_directory(const std::filesystem::path& dir);

}  // namespace kiln::report
