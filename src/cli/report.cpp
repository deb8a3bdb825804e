// `kiln report RUN_DIR`: regenerates <RUN_DIR>/report.html from the run directory's files
// (docs/report.md). Works on any run: a ladder's, a rung's or a plain `kiln train`.
// `kiln report RUN_A RUN_B --out DIR`: the two runs side by side in DIR/report.html.
#include "kiln/report.h"

#include <fmt/format.h>

#include "cli/commands.h"
#include "core/files.h"
#include "kiln/error.h"

namespace kiln::cli {

namespace {

// A run directory is what kiln train, a rung or the ladder wrote: config.toml, manifest.json,
// metrics*.jsonl. Anything else (docs/, runs/, an empty folder) is refused before report.html is
// written into it.
void check_run_directory(const std::filesystem::path& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    throw UserError(dir.string() + " is not a directory; give a run directory (runs/<run.name>)");
  }
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name == "config.toml" || name == "manifest.json" ||
        (name.starts_with("metrics") && name.ends_with(".jsonl")))
      return;
  }
  throw UserError(dir.string() +
                  " is not a run directory: a run directory (runs/<run.name>, written by kiln "
                  "train, a rung or kiln ladder) holds config.toml, manifest.json and "
                  "metrics.jsonl or metrics-<rung>.jsonl");
}

void add_report_command(CLI::App& app, Action& action) {
  auto run_dir = std::make_shared<std::string>();
  auto* command =
      app.add_subcommand("report", "write <run dir>/report.html: charts and tables of a run");
  command->add_option("run_dir", *run_dir, "a run directory (runs/<name>)")->required();
  auto run_b = std::make_shared<std::string>();
  auto out_dir = std::make_shared<std::string>();
  command->add_option("run_b", *run_b, "a second run directory: the two side by side (with --out)");
  command->add_option("--out", *out_dir, "write report.html into this directory instead");
  command->callback([&action, run_dir, run_b, out_dir] {
    if (!run_b->empty()) {
      action = [run_dir, run_b, out_dir] {
        if (out_dir->empty()) {
          throw UserError(
              "kiln report RUN_A RUN_B compares two runs: give --out DIR for its "
              "report.html");
        }
        check_run_directory(*run_dir);
        check_run_directory(*run_b);
        const ReportHtml report = write_comparison_html(*run_dir, *run_b, *out_dir);
        fmt::print("wrote {}: {} and {} side by side, {} charts\n",
                   (std::filesystem::path(*out_dir) / "report.html").string(), *run_dir, *run_b,
                   report.charts.size());
        return 0;
      };
      return;
    }
    action = [run_dir, out_dir] {
      check_run_directory(*run_dir);
      const std::filesystem::path into = out_dir->empty() ? *run_dir : *out_dir;
      ReportHtml report;
      if (out_dir->empty()) {
        report = write_report_html(*run_dir);
      } else {
        report = make_report_html(*run_dir);
        std::error_code ec;
        std::filesystem::create_directories(into, ec);
        if (ec) throw UserError("cannot create " + into.string() + " (" + ec.message() + ")");
        write_file_atomic(into / "report.html", report.html);
      }
      fmt::print("wrote {}: {} charts ({})\n", (into / "report.html").string(),
                 report.charts.size(),
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

const Registration report_registration{80, add_report_command};  // named apart: unity batches

}  // namespace

}  // namespace kiln::cli
