#include <fmt/format.h>

#include <map>
#include <type_traits>
#include <variant>

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
#include "rungs/options.h"

namespace kiln {
namespace {

using nlohmann::json;

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

// The rung's outcome as its <rung>.json says it, read back through the rung's typed result (the
// type the rung returned, kiln/results.h): the ladder acts on what the report shows. A file that
// does not read back, or says otherwise than the rung returned, fails the rung with one line.
// Only the process that wrote the file (rank 0) reads it; agree_on_outcome shares it.
void read_back_outcome(const std::filesystem::path& run_dir, RungResult& result) {
  const auto file = run_dir / (result.rung + ".json");
  if (std::holds_alternative<std::monostate>(result.numbers) || !std::filesystem::exists(file))
    return;
  try {
    const RungStatus status = std::visit(
        [&](const auto& returned) -> RungStatus {
          using T = std::decay_t<decltype(returned)>;
          if constexpr (std::is_same_v<T, std::monostate>) {
            return {};
          } else {
            return read_result<T>(file).status;
          }
        },
        result.numbers);
    if (status.passed != result.passed) {
      result.verdict = fmt::format("{} says the rung {} but it returned {}: {}", file.string(),
                                   status.passed ? "passed" : "failed",
                                   result.passed ? "passed" : "failed", result.verdict);
      result.passed = false;
    }
  } catch (const ResultFormatError& e) {
    result.passed = false;
    result.verdict = one_line_error(e);
  }
}

}  // namespace

// Under torchrun every rank runs the ladder; only rank 0 wrote (and read back) the rung's file.
void agree_on_rung_outcome(Communicator& comm, RungResult& result) {
  const json mine = {{"passed", result.passed}, {"verdict", result.verdict}};
  const auto all = comm.all_gather_bytes(mine.dump(-1, ' ', false, json::error_handler_t::replace));
  bool passed = true;
  std::string verdict;
  for (size_t rank = 0; rank < all.size(); ++rank) {
    const json theirs = json::parse(all[rank]);
    const bool ok = theirs.at("passed").get<bool>();
    const std::string text = theirs.at("verdict").get<std::string>();
    if (rank == 0) verdict = text;
    if (!ok && passed) verdict = rank == 0 ? text : fmt::format("rank {}: {}", rank, text);
    passed = passed && ok;
  }
  result.passed = passed;
  result.verdict = verdict;
}

const std::vector<Rung>& ladder_rungs() {
  static const std::vector<Rung> rungs = {
      {"baseline", [](const Config&) { return true; },
       [](const Config& config, const SessionOptions& options) {
         auto session = open_session(config, options);
         return run_baseline(*session);
       }},
      // Between baseline and profile, when a compiled step is asked for (compile.backend).
      {"compile",
       [](const Config& config) {
         return CompileOptions::from_config(config).backend != CompileOptions::Backend::kEager;
       },
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
      {"scale",
       [](const Config& config) { return ScaleRungOptions::from_config(config).processes > 0; },
       [](const Config& config, const SessionOptions& options) {
         return run_scale_rung(config, options);
       }},
      // Last: the restore drill (save, kill, restore in a fresh process, resume, compare).
      {"checkpoint",
       [](const Config& config) { return DrillRungOptions::from_config(config).drill; },
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
  // The job's communicator (under torchrun every rank runs the ladder; each rung's session finds
  // the same process group): who writes, and the ranks' agreement after each rung.
  const std::shared_ptr<Communicator> comm =
      options.comm ? options.comm : process_communicator(config);
  const bool writer = comm->rank() == 0;
  const auto lock =
      lock_run_directories(resolve_job(config, JobRequest{.argv = options.argv}), *comm);
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
      if (writer) read_back_outcome(run_directory(config), results.back());
    } catch (const std::exception& e) {  // the report still shows what ran; the error is rethrown
      error = std::current_exception();
      RungResult failed;  // no typed numbers: the rung stopped before its result
      failed.rung = rung.name;
      failed.verdict = "error: " + one_line_error(e);
      results.push_back(std::move(failed));
    }
    if (comm->world_size() > 1) {
      try {
        agree_on_rung_outcome(*comm, results.back());
      } catch (const std::exception& e) {  // the group is broken: stop here with what this rank saw
        results.back().passed = false;
        results.back().verdict +=
            " (the ranks could not share the outcome: " + one_line_error(e) + ")";
        if (!error) error = std::current_exception();
      }
    }
    print_rung(results.back());
    if (!results.back().passed) {
      log::error("ladder stopped at rung " + rung.name + ": " + results.back().verdict);
      stopped = true;
    }
  }
  if (writer) {
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
