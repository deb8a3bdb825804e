#include <fmt/format.h>

#include <map>

#include "core/files.h"
#include "core/strings.h"
#include "kiln/checkpoint.h"
#include "kiln/compile.h"
#include "kiln/dist.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/pilot.h"
#include "kiln/profile.h"
#include "kiln/report.h"
#include "kiln/results.h"
#include "kiln/run.h"
#include "kiln/rungs.h"

namespace kiln {
namespace {

std::string report_markdown(const Config& config, const std::vector<RungResult>& results,
                            const std::vector<std::string>& skipped) {
  std::string out = fmt::format(
      "# kiln ladder report\n\nConfig `{}` (hash `{}`), generated {}.\n"
      "See `manifest.json` for the pinned environment.\n\n",
      config.source_name(), config.hash(), utc_now_iso8601());
  out += "| rung | gate | verdict |\n|---|---|---|\n";
  for (const auto& r : results) {
    out += fmt::format("| {} | {} | {} |\n", r.rung, r.passed ? "passed" : "**failed**", r.verdict);
  }
  for (const auto& name : skipped)
    out += fmt::format("| {} | not run | an earlier rung failed |\n", name);
  for (const auto& r : results) {
    if (r.table.empty()) {  // the rung stopped with an error before it measured anything
      out += fmt::format("\n## {}\n\n{}\n", r.rung, r.verdict);
      continue;
    }
    out += fmt::format("\n## {}\n\n| measure | value |\n|---|---|\n", r.rung);
    for (const auto& [key, value] : r.table) out += fmt::format("| {} | {} |\n", key, value);
    out += fmt::format("\nNumbers: `{}.json`.\n", r.rung);
  }
  return out;
}

template <class T>
RungStatus status_in_file(const std::filesystem::path& file) {
  return read_result<T>(file).status;
}

// The rung's outcome as its <rung>.json says it, read back through the rung's typed result
// (kiln/results.h): the ladder acts on what the report shows. A file that does not read back fails
// the rung with the reader's one line.
void read_back_outcome(const std::filesystem::path& run_dir, RungResult& result) {
  using Reader = RungStatus (*)(const std::filesystem::path&);
  static const std::map<std::string, Reader> readers = {
      {"baseline", status_in_file<BaselineResult>},
      {"compile", status_in_file<CompileResult>},
      {"profile", status_in_file<ProfileResult>},
      {"scale", status_in_file<ScaleResult>},
      {"checkpoint", status_in_file<CheckpointResult>},
      {"pilot", status_in_file<PilotResult>},
      {"plan", status_in_file<PlanResult>}};
  const auto reader = readers.find(result.rung);
  const auto file = run_dir / (result.rung + ".json");
  if (reader == readers.end() || !std::filesystem::exists(file)) return;
  try {
    const RungStatus status = reader->second(file);
    if (status.passed != result.passed) {
      result.passed = false;
      result.verdict = fmt::format("{} says the rung {} but it returned {}: {}", file.string(),
                                   status.passed ? "passed" : "failed",
                                   result.passed ? "passed" : "failed", result.verdict);
    }
  } catch (const ResultFormatError& e) {
    result.passed = false;
    result.verdict = one_line_error(e);
  }
}

}  // namespace

const std::vector<Rung>& ladder_rungs() {
  static const std::vector<Rung> rungs = {
      {"baseline", [](const Config&) { return true; },
       [](const Config& config, const SessionOptions& options) {
         auto session = open_session(config, options);
         return run_baseline(*session);
       }},
      // Between baseline and profile, when a compiled step is asked for (compile.backend).
      {"compile",
       [](const Config& config) { return config.get_string("compile.backend") != "eager"; },
       [](const Config& config, const SessionOptions& options) {
         auto session = open_session(config, options);  // setup checked by run_ladder
         return run_compile(*session);
       }},
      {"profile", [](const Config&) { return true; },
       [](const Config& config, const SessionOptions& options) {
         auto session = open_session(config, options);
         return run_profile(*session);
       }},
      // After profile: data-parallel scaling, when dist.scale_processes asks for it.
      {"scale", [](const Config& config) { return config.get_int("dist.scale_processes") > 0; },
       [](const Config& config, const SessionOptions& options) {
         return run_scale_rung(config, options);
       }},
      // Last: the restore drill (save, kill, restore in a fresh process, resume, compare).
      {"checkpoint", [](const Config& config) { return config.get_bool("checkpoint.drill"); },
       run_checkpoint_drill},
      // Then the pilot (the whole job once at its production shape) and the plan it calibrates.
      {"pilot", [](const Config&) { return true; }, run_pilot},
      {"plan", [](const Config&) { return true; },
       [](const Config& config, const SessionOptions&) {
         const auto run_dir = run_directory(config);
         return run_plan(config, std::filesystem::exists(run_dir / "pilot.json")
                                     ? run_dir
                                     : std::filesystem::path{});
       }},
  };
  return rungs;
}

std::vector<std::string> check_ladder(const Config& config) {
  std::vector<std::string> rungs;
  for (const auto& rung : ladder_rungs()) {
    if (rung.enabled(config)) rungs.push_back(rung.name);
  }
  check_compile_start(config);  // a compile rung's bad setup stops the ladder before any rung
  return rungs;
}

std::vector<RungResult> run_ladder(const Config& config, const SessionOptions& options) {
  check_ladder(config);  // before the lock: a refused ladder leaves no run directory behind
  // Held for every rung: each rung's session in this process shares it, the processes the rungs
  // start (the drill's, the scale rung's ranks) run under it.
  const auto lock = lock_run_directories(
      config, options.comm ? *options.comm : *process_communicator(config), options.argv);
  std::vector<RungResult> results;
  std::vector<std::string> skipped;
  bool stopped = false;
  std::exception_ptr error;
  for (const auto& rung : ladder_rungs()) {
    if (!rung.enabled(config)) continue;
    if (stopped) {
      skipped.push_back(rung.name);
      continue;
    }
    log::info("ladder: rung " + rung.name);
    SessionOptions rung_options = options;  // each rung keeps its own step records
    rung_options.metrics_file = "metrics-" + rung.name + ".jsonl";
    try {
      results.push_back(rung.run(config, rung_options));
      // A single-process ladder reads the file each rung wrote back (under torchrun only rank 0
      // has it).
      if (!options.comm || options.comm->world_size() == 1)
        read_back_outcome(run_directory(config), results.back());
    } catch (const std::exception& e) {  // the report still shows what ran; the error is rethrown
      error = std::current_exception();
      RungResult failed;
      failed.rung = rung.name;
      failed.verdict = "error: " + one_line_error(e);
      failed.numbers = {{"passed", false}, {"error", failed.verdict}};
      results.push_back(std::move(failed));
    }
    print_rung(results.back());
    if (!results.back().passed) {
      log::error("ladder stopped at rung " + rung.name + ": " + results.back().verdict);
      stopped = true;
    }
  }
  if (!options.comm || options.comm->rank() == 0) {
    std::filesystem::path path = run_directory(config) / "report.md";
    std::error_code ec;
    std::filesystem::create_directories(path.parent_path(), ec);
    if (ec) throw UserError("cannot create " + path.parent_path().string() + ": " + ec.message());
    write_file_atomic(path, report_markdown(config, results, skipped));
    log::info("report written to " + path.string());
    write_report_html(path.parent_path());  // report.html: charts of every rung's files
    log::info("report written to " + (path.parent_path() / "report.html").string());
  }
  if (error) std::rethrow_exception(error);
  return results;
}

}  // namespace kiln
