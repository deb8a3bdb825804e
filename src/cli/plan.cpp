#include "kiln/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <fstream>

#include "cli/commands.h"
#include "core/files.h"
#include "kiln/config.h"
#include "kiln/dist.h"
#include "kiln/error.h"
#include "kiln/pilot.h"
#include "kiln/results.h"
#include "kiln/run.h"
#include "kiln/rungs.h"
#include "plan/options.h"

namespace kiln::cli {

namespace {

using nlohmann::json;

double plan_cli_median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// What the run in `dir` recorded, read through the typed results (kiln/results.h): step times
// from baseline.json, else pilot.json, else metrics.jsonl (the first tenth of the steps left out
// as warm-up); peak memory from pilot.json, else a CUDA baseline.json; one save from
// pilot.json, else checkpoint.json.
ActualRun read_actual_run(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  if (!fs::exists(dir / "manifest.json")) {
    throw UserError(fmt::format(
        "--actual {}: no manifest.json there; give the run directory of a kiln train, baseline "
        "or pilot",
        dir.string()));
  }
  ActualRun a;
  a.run_dir = dir.string();
  const RunIdentity identity = read_result<RunIdentity>(dir / "manifest.json");
  const json manifest = json::parse(read_file(dir / "manifest.json"));
  const int cuda_index =
      identity.device.starts_with("cuda")
          ? (identity.device.find(':') == std::string::npos
                 ? 0
                 : std::atoi(identity.device.c_str() + identity.device.find(':') + 1))
          : -1;
  a.device = manifest_device_name(manifest, cuda_index);
  a.world_size = identity.world_size;

  std::optional<BaselineResult> baseline;
  std::optional<PilotResult> pilot;
  std::optional<CheckpointResult> checkpoint;
  if (fs::exists(dir / "baseline.json"))
    baseline = read_result<BaselineResult>(dir / "baseline.json");
  if (fs::exists(dir / "pilot.json")) pilot = read_result<PilotResult>(dir / "pilot.json");
  if (fs::exists(dir / "checkpoint.json"))
    checkpoint = read_result<CheckpointResult>(dir / "checkpoint.json");

  std::vector<MetricsRecord> steps;
  if (std::ifstream in(dir / "metrics.jsonl"); in) {
    std::string line;
    for (int64_t number = 1; std::getline(in, line); ++number) {
      if (line.empty()) continue;
      MetricsRecord record;
      try {
        record = json::parse(line).get<MetricsRecord>();
      } catch (const std::exception& e) {
        throw UserError(
            fmt::format("{}:{}: {}", (dir / "metrics.jsonl").string(), number, e.what()));
      }
      if (record.step_seconds && *record.step_seconds > 0) steps.push_back(record);
      // kiln train's plan-tracking records (src/rungs/plan_tracking.h, a PlanProgress): the last
      // one holds the run's wall time, checkpoint time and ETTR so far (the final one, the whole
      // run's).
      if (record.plan) {
        a.wall_seconds = record.plan->elapsed_seconds;
        a.checkpoint_seconds = record.plan->checkpoint_seconds;
        a.ettr = record.plan->ettr;
      }
    }
  }
  // A baseline's steady-state median, a pilot's measured step, else a training run's steps (a
  // baseline or pilot directory's metrics.jsonl holds its few warm-up steps too).
  if (baseline && baseline->status.measured) {
    a.step_seconds = baseline->step_seconds.median;
    a.tokens_per_second = baseline->tokens_per_second.value_or(baseline->samples_per_second);
    a.steps = static_cast<double>(baseline->measured_steps);
    a.train_seconds = baseline->step_seconds.mean * a.steps;
    a.step_source =
        fmt::format("baseline.json, the median of {} measured steps", baseline->measured_steps);
  } else if (pilot && pilot->status.measured) {
    a.step_seconds = pilot->step_seconds;
    a.steps = 1;
    a.train_seconds = pilot->step_seconds;
    a.step_source = pilot->step_timing ? "pilot.json, " + pilot->step_timing->method
                                       : std::string("pilot.json, its one measured step");
  } else if (!steps.empty()) {
    const size_t warmup = steps.size() >= 10 ? steps.size() / 10 : 0;
    std::vector<double> seconds, tokens;
    for (size_t i = warmup; i < steps.size(); ++i) {
      seconds.push_back(*steps[i].step_seconds);
      a.train_seconds += *steps[i].step_seconds;
      if (steps[i].tokens_per_second)
        tokens.push_back(*steps[i].tokens_per_second);
      else if (steps[i].samples_per_second)
        tokens.push_back(*steps[i].samples_per_second);
    }
    a.steps = static_cast<double>(seconds.size());
    a.step_seconds = plan_cli_median(seconds);
    // metrics.jsonl records the step's tokens over every rank; the forecast is per device.
    a.tokens_per_second =
        plan_cli_median(tokens) / static_cast<double>(std::max<int64_t>(1, a.world_size));
    a.step_source = fmt::format("metrics.jsonl, the median of steps {}-{} (the first {} left out)",
                                steps[warmup].step, steps.back().step, warmup);
  } else {
    a.step_source = "nothing (no metrics.jsonl, baseline.json or pilot.json)";
  }
  // The forecast counts tensor bytes: a CPU baseline's process RSS (LibTorch's code and caches
  // included) is not that, a pilot's metered peak is.
  const bool baseline_counts_tensors =
      baseline && baseline->status.measured && baseline->peak_allocated_bytes > 0 &&
      baseline->peak_memory_method.find("resident set") == std::string::npos;
  if (pilot && pilot->status.measured) {
    a.peak_memory_bytes = pilot->measured.step_peak;
    a.memory_source = "pilot.json (" + pilot->memory_method + ")";
  } else if (baseline_counts_tensors) {
    a.peak_memory_bytes = baseline->peak_allocated_bytes;
    a.memory_source = "baseline.json (" + baseline->peak_memory_method + ")";
  } else {
    a.memory_source =
        "nothing comparable (kiln train records no peak, a CPU baseline the process RSS; a "
        "pilot's metered peak is)";
  }
  if (pilot && pilot->status.measured) {
    a.save_seconds = pilot->save_seconds;
  } else if (checkpoint && checkpoint->save_seconds) {
    a.save_seconds = *checkpoint->save_seconds;
  }
  return a;
}

// `kiln plan CONFIG --actual RUN`: the forecast for the run's device and world against what the
// run recorded; writes RUN/plan-vs-actual.json.
int plan_against_actual(const Config& config, const std::string& pilot_dir,
                        const std::filesystem::path& run_dir) {
  if (std::filesystem::exists(run_dir / "config.toml")) {
    const Config ran = Config::load(run_dir / "config.toml");
    if (job_hash(ran) != job_hash(config)) {
      throw UserError(fmt::format(
          "--actual {}: that run trained another job (job hash {} there, {} for {}); plan from "
          "the config it ran, its overrides included: kiln plan {} --actual {}",
          run_dir.string(), job_hash(ran), job_hash(config), config.source_name(),
          (run_dir / "config.toml").string(), run_dir.string()));
    }
  }
  std::optional<PilotCalibration> pilot;
  if (!pilot_dir.empty()) pilot = read_pilot(pilot_dir, config);
  const ActualRun actual = read_actual_run(run_dir);
  // The layout the run recorded (strategy.json: auto's choice, tp included), else the config's.
  const RunLayout layout = run_layout(config, run_dir, actual.world_size);
  const Forecast forecast =
      forecast_run(config, pilot ? &*pilot : nullptr, actual.device, actual.world_size,
                   layout.strategy, layout.tp, layout.dp_replicate);
  json comparison = compare_forecast(forecast, actual);
  comparison["forecast_text"] = forecast_text(forecast);
  comparison["layout"] = {{"strategy", layout.strategy},
                          {"tp", layout.tp},
                          {"dp_replicate", layout.dp_replicate},
                          {"source", layout.source}};
  write_file_atomic(run_dir / "plan-vs-actual.json", comparison.dump(2) + "\n");
  std::fputs((forecast_text(forecast) + "\n\n" + comparison_markdown(comparison)).c_str(), stdout);
  return 0;
}

void add_plan_command(CLI::App& app, Action& action) {
  auto* command = app.add_subcommand(
      "plan",
      "plan the job on each hardware row without building the model: strategy, step time, days, "
      "ETTR, checkpoint interval, 7- and 30-day fit and cost; writes plan.json");
  auto args = std::make_shared<ConfigArgs>();
  args->add_to(*command);
  auto pilot = std::make_shared<std::string>();
  auto actual = std::make_shared<std::string>();
  auto cost = std::make_shared<bool>(false);
  command->add_option("--pilot", *pilot,
                      "a pilot's run directory to calibrate against (default: plan.pilot)");
  command->add_option("--actual", *actual,
                      "a run directory (kiln train, baseline or pilot): print the forecast for "
                      "its device against what it recorded, row by row, and the most wrong "
                      "input; writes <run>/plan-vs-actual.json");
  command->add_flag("--cost", *cost,
                    "cost every row: a missing price (plan.price_*_per_gpu_hour) or MTBF is an "
                    "error");
  command->callback([&action, args, pilot, actual, cost] {
    action = [args, pilot, actual, cost] {
      const Config config = args->load();
      const std::string pilot_dir =
          pilot->empty() ? PlanInputs::from_config(config).plan_pilot : *pilot;
      if (!actual->empty()) return plan_against_actual(config, pilot_dir, *actual);
      run_plan(config, pilot_dir, *cost);
      // The plan's Markdown as the rung wrote it beside plan.json (the planner's document).
      std::string markdown = read_file(run_directory(config) / "plan.md");
      const std::string title = "# kiln plan\n\n";
      if (markdown.rfind(title, 0) == 0) markdown.erase(0, title.size());
      std::fputs(("\n" + markdown).c_str(), stdout);
      return 0;
    };
  });
}

const Registration plan_registration{62, add_plan_command};  // named apart: unity batches

}  // namespace

}  // namespace kiln::cli
