// `kiln report RUN_DIR`: regenerates <RUN_DIR>/report.html from the run directory's files
// (docs/report.md). Works on any run: a ladder's, a rung's or a plain `kiln train`.
#include "kiln/report.h"

#include <fmt/format.h>

#include "cli/commands.h"

namespace kiln::cli {

namespace {

void add_report_command(CLI::App& app, Action& action) {
  auto run_dir = std::make_shared<std::string>();
  auto* command =
      app.add_subcommand("report", "write <run dir>/report.html: charts and tables of a run");
  command->add_option("run_dir", *run_dir, "a run directory (runs/<name>)")->required();
  command->callback([&action, run_dir] {
    action = [run_dir] {
      const ReportHtml report = write_report_html(*run_dir);
      fmt::print("wrote {}: {} charts ({})\n",
                 (std::filesystem::path(*run_dir) / "report.html").string(), report.charts.size(),
                 report.chart_library ? "Chart.js from " + report.chart_library_source
                                      : "plain SVG: " + report.chart_library_source);
      if (!report.missing.empty()) {
        std::string list;
        for (const auto& m : report.missing) list += (list.empty() ? "" : ", ") + m;
        fmt::print("not in this run: {}\n", list);
      }
      return 0;
    };
  });
}

const Registration registration{80, add_report_command};

}  // namespace

}  // namespace kiln::cli
