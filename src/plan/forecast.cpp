// One run's forecast from the plan model, logged when `kiln train` starts, and the forecast
// against what a run recorded (`kiln plan --actual`; docs/plan.md, "Forecast against actual").
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <fstream>
#include <map>

#include "core/strings.h"
#include "kiln/config.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/plan.h"
#include "plan/calibration.h"
#include "plan/options.h"
#include "plan/save_stall.h"

namespace kiln {
namespace {

using nlohmann::json;

// "cuda:1" -> 1, "cuda" -> 0, anything else (cpu) -> -1.
int forecast_cuda_index(const std::string& device) {
  if (!device.starts_with("cuda")) return -1;
  const auto colon = device.find(':');
  return colon == std::string::npos ? 0 : std::atoi(device.c_str() + colon + 1);
}

std::string forecast_strategy(const Config& config, int64_t world_size) {
  const PlanInputs inputs = PlanInputs::from_config(config);
  if (world_size <= 1) return "none";
  const std::string s = inputs.dist_strategy;
  return s == "fsdp" ? "fsdp" : "ddp";
}

}  // namespace

RunLayout run_layout(const Config& config, const std::filesystem::path& run_dir,
                     int64_t world_size) {
  RunLayout layout;
  if (std::filesystem::exists(run_dir / "strategy.json")) {
    // A record of another world (a run resumed at a different size, in one process: nothing
    // rewrote it) does not describe this one.
    const StrategyRecord record = read_result<StrategyRecord>(run_dir / "strategy.json");
    if (record.world_size == world_size) {
      layout.strategy = world_size <= 1 ? "none" : record.strategy;
      layout.tp = record.tp;
      layout.dp_replicate = record.dp_replicate;
      layout.source = "strategy.json";
      return layout;
    }
  }
  layout.strategy = forecast_strategy(config, world_size);
  layout.source = "the config (no strategy.json)";
  return layout;
}

namespace {

std::string forecast_utc_time(double seconds_from_now) {
  const auto when = std::chrono::system_clock::now() +
                    std::chrono::duration_cast<std::chrono::system_clock::duration>(
                        std::chrono::duration<double>(seconds_from_now));
  const std::time_t t = std::chrono::system_clock::to_time_t(when);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return text;
}

json forecast_ratio(double forecast, double actual) {
  return forecast > 0 && actual > 0 ? json(forecast / actual) : json(nullptr);
}

std::string forecast_value_text(double value, const std::string& unit) {
  if (!(value > 0)) return "-";
  if (unit == "seconds") return format_duration(value);
  if (unit == "bytes") return format_bytes(value);
  if (unit == "fraction") return fmt::format("{:.1f}%", 100 * value);
  if (unit == "money") return fmt::format("{:.2f}", value);
  return fmt::format("{:.4g}", value);
}

}  // namespace

Forecast forecast_run(const Config& config, const PilotCalibration* pilot,
                      std::string_view device_name, int64_t world_size, std::string_view strategy,
                      int64_t tp, int64_t dp_replicate) {
  const PlanInputs inputs = PlanInputs::from_config(config);
  const ModelShape shape = model_shape(config);
  JobShape job = job_shape(config);
  job.world_size = std::max<int64_t>(1, world_size);
  job.strategy = std::string(strategy);
  // The mesh the run's keys give (the memory walk is per rank of it).
  job.tp = std::max<int64_t>(1, tp > 0 ? tp : inputs.dist_tp);
  job.dp_replicate =
      job.strategy == "fsdp"
          ? std::max<int64_t>(1, dp_replicate > 0 ? dp_replicate : inputs.dist_dp_replicate)
          : 1;
  Forecast f;
  f.device = std::string(device_name);
  f.world_size = job.world_size;
  f.calibration = pilot ? "pilot " + pilot->run_dir.string() : "uncalibrated";
  // Per device: a data-parallel rank's tokens, shared by the dist.tp devices of its
  // tensor-parallel group (as kiln train counts them: the step's tokens over every device).
  f.tokens_per_step = static_cast<double>(job.micro_batch * job.grad_accum_steps * job.seq_len) /
                      static_cast<double>(job.tp);
  f.flops_per_step =
      train_flops_per_token(shape, job.seq_len, job.activation_checkpointing) * f.tokens_per_step;
  f.steps = static_cast<double>(inputs.train_steps);

  // The pilot stands for this run when it ran on this device (its runtime name, or the same
  // catalog row); the peak and MFU by the rule the plan uses (plan/calibration.h).
  const auto catalog = load_catalog(inputs.plan_catalog);
  const Device* row = device_for_name(catalog, f.device);
  const bool same_device = pilot_ran_on(pilot, catalog, row, f.device);
  const ComputeCalibration compute =
      calibrate_compute(pilot, same_device, inputs.baseline_peak_flops_per_second, row,
                        job.precision, f.flops_per_step, inputs.plan_mfu);
  f.peak_flops_per_second = compute.peak_flops_per_second;
  f.peak_source = compute.peak_source;
  f.mfu = compute.mfu;
  f.mfu_source = compute.mfu_source;
  if (f.peak_flops_per_second > 0 && f.mfu > 0) {
    f.step_seconds = f.flops_per_step / (f.peak_flops_per_second * f.mfu);
    f.tokens_per_second = f.tokens_per_step / f.step_seconds;
    f.train_seconds = f.steps * f.step_seconds;
  }

  const MemoryEstimate memory = estimate_memory(shape, job);
  const double held = memory.parameters + memory.optimizer +
                      (job.strategy == "none" ? 0.0 : memory.gradients_after_step);
  f.memory_calibration = same_device && pilot->activation_ratio > 0 ? pilot->activation_ratio : 1.0;
  f.peak_memory_bytes = held + (memory.step_peak() - held) * f.memory_calibration;

  // The checkpoint holds every parameter and optimizer tensor once (every rank's files together,
  // as the pilot's write speed counts them), not one rank's share.
  f.checkpoint_bytes =
      static_cast<double>(analytic_parameter_count(shape)) * (state_bytes_per_parameter(job) - 4.0);
  f.write_bytes_per_second = same_device && pilot->write_bytes_per_second > 0
                                 ? pilot->write_bytes_per_second
                                 : inputs.plan_checkpoint_write_gb_per_second * 1e9;
  f.save_seconds = f.checkpoint_bytes / f.write_bytes_per_second;
  f.async_save = inputs.checkpoint_async;
  const SaveStall stall = save_stall(f.async_save, pilot, same_device, f.save_seconds);
  f.save_stall_seconds = stall.seconds;
  f.save_stall_source = stall.source;

  // The run as a whole (Trainer::fit and CheckpointHook): an evaluation every eval_every steps
  // before the last and one at the end; a save every every_steps and the final one.
  const auto steps = inputs.train_steps;
  const auto eval_every = inputs.train_eval_every;
  f.evals = static_cast<double>((eval_every > 0 ? (steps - 1) / eval_every : 0) + 1);
  const auto save_every = inputs.checkpoint_every_steps;
  if (save_every > 0) {
    f.saves = static_cast<double>(steps / save_every) +
              (inputs.checkpoint_save_final && steps % save_every != 0 ? 1.0 : 0.0);
  }
  if (f.step_seconds > 0) {
    const double eval_tokens =
        static_cast<double>(inputs.train_eval_batches * job.micro_batch * job.seq_len);
    f.eval_seconds = same_device && pilot->eval_seconds > 0
                         ? pilot->eval_seconds
                         : eval_tokens * train_flops_per_token(shape, job.seq_len) / 3.0 /
                               (f.peak_flops_per_second * f.mfu);  // forward only
    // Time lost to checkpoints: every save's stall (with async saves measured, that includes the
    // wait that finishes a save after an evaluation: how the save at the last step ends). A final
    // save after the final evaluation (save_final, the steps not a multiple of every_steps) is
    // waited for at once: nothing covers the rest of its write.
    const bool final_save_after_eval =
        save_every > 0 && steps % save_every != 0 && inputs.checkpoint_save_final;
    const double final_write_exposed = stall.measured && final_save_after_eval
                                           ? std::max(0.0, f.save_seconds - f.save_stall_seconds)
                                           : 0.0;
    f.checkpoint_seconds = f.saves * f.save_stall_seconds + final_write_exposed;
    f.wall_seconds = f.train_seconds + f.checkpoint_seconds + f.evals * f.eval_seconds;
    f.ettr = f.train_seconds / f.wall_seconds;
  }
  if (row != nullptr) {
    const auto& prices = inputs.plan_price_7d_per_gpu_hour;
    if (auto price = prices.find(row->name); price != prices.end()) {
      f.price_per_gpu_hour = price->second;
      f.cost = f.wall_seconds / 3600.0 * static_cast<double>(f.world_size) * price->second;
    }
  }
  return f;
}

std::string forecast_text(const Forecast& f) {
  const std::string by =
      f.calibration == "uncalibrated" ? "uncalibrated" : "calibrated by the " + f.calibration;
  if (!(f.step_seconds > 0)) {
    return fmt::format(
        "forecast ({}, {}): peak memory {}; no step time: no catalog row for this device and no "
        "pilot on it (set plan.pilot to a pilot run on this device)",
        by, f.device, format_bytes(f.peak_memory_bytes));
  }
  return fmt::format(
      "forecast ({}, {}): step {}, {:.4g} tokens/s per device (MFU {:.1f}% of {:.3g} FLOP/s, {}), "
      "peak memory {}, {:.0f} steps in {}",
      by, f.device, format_duration(f.step_seconds), f.tokens_per_second, 100 * f.mfu,
      f.peak_flops_per_second, f.peak_source, format_bytes(f.peak_memory_bytes), f.steps,
      format_duration(f.train_seconds));
}

std::optional<Forecast> log_plan_forecast(const Config& config,
                                          const std::filesystem::path& run_dir, int rank) {
  if (rank != 0) return std::nullopt;
  const PlanInputs inputs = PlanInputs::from_config(config);
  json manifest = nullptr;
  {
    std::ifstream in(run_dir / "manifest.json");
    if (in) manifest = json::parse(in, nullptr, /*allow_exceptions=*/false);
  }
  const std::string device =
      manifest.is_object() ? manifest.value("device", std::string("cpu")) : std::string("cpu");
  const int64_t world =
      manifest.is_object() && manifest.contains("world_size") && manifest["world_size"].is_number()
          ? manifest["world_size"].get<int64_t>()
          : 1;
  std::optional<PilotCalibration> pilot;
  const std::string pilot_dir = inputs.plan_pilot;
  if (!pilot_dir.empty()) {
    try {
      pilot = read_pilot(pilot_dir, config);
    } catch (const UserError& e) {
      log::warn(fmt::format("plan.pilot: {}; the forecast is uncalibrated", e.what()));
    }
  }
  try {
    const RunLayout layout = run_layout(config, run_dir, world);
    const Forecast f = forecast_run(config, pilot ? &*pilot : nullptr,
                                    manifest_device_name(manifest, forecast_cuda_index(device)),
                                    world, layout.strategy, layout.tp, layout.dp_replicate);
    std::string line = forecast_text(f);
    if (f.train_seconds > 0) line += "; finish expected " + forecast_utc_time(f.train_seconds);
    log::info(line + " (compare: kiln plan CONFIG --actual " + run_dir.string() + ")");
    return f;
  } catch (const UserError& e) {  // advice only: a catalog problem does not stop training
    log::warn(fmt::format("no forecast: {}", e.what()));
  }
  return std::nullopt;
}

json compare_forecast(const Forecast& f, const ActualRun& a) {
  const std::string rate_input =
      fmt::format("achieved FLOP/s: peak {:.3g} ({}) x MFU {:.3g} ({})", f.peak_flops_per_second,
                  f.peak_source, f.mfu, f.mfu_source);
  const std::string memory_input =
      fmt::format("the memory model (activation calibration {:.3g})", f.memory_calibration);
  const std::string write_input =
      fmt::format("checkpoint write speed {}/s", format_bytes(f.write_bytes_per_second));
  const std::string stall_input =
      fmt::format("{:.0f} saves, each stalling training {} ({})", f.saves,
                  format_duration(f.save_stall_seconds), f.save_stall_source);
  struct Row {
    const char* quantity;
    const char* unit;
    double forecast, actual;
    std::string input;
  };
  const std::string run_input = fmt::format(
      "the run's shape: {:.0f} steps, {:.0f} saves, {:.0f} evaluations of {} each, at the step "
      "rate above",
      f.steps, f.saves, f.evals, format_duration(f.eval_seconds));
  const std::string price_input =
      f.price_per_gpu_hour > 0
          ? fmt::format("price {:.4g}/GPU-hour (plan.price_7d_per_gpu_hour) x {} GPU(s)",
                        f.price_per_gpu_hour, f.world_size)
          : std::string("no price (plan.price_7d_per_gpu_hour for this device's row)");
  // The actual cost: the run's wall time at the same price (what the reservation would bill).
  const double actual_cost =
      a.wall_seconds / 3600.0 * static_cast<double>(a.world_size) * f.price_per_gpu_hour;
  const std::vector<Row> rows = {
      {"step time", "seconds", f.step_seconds, a.step_seconds, rate_input},
      {"tokens/s per device", "per_second", f.tokens_per_second, a.tokens_per_second, rate_input},
      {"time of the recorded steps", "seconds", a.steps * f.step_seconds, a.train_seconds,
       rate_input},
      {"peak memory", "bytes", f.peak_memory_bytes, a.peak_memory_bytes, memory_input},
      {"checkpoint save", "seconds", f.save_seconds, a.save_seconds, write_input},
      {"wall time", "seconds", f.wall_seconds, a.wall_seconds, run_input},
      {"ETTR", "fraction", f.ettr, a.ettr, run_input},
      {"cost", "money", f.cost, actual_cost, price_input},
      {"time lost to checkpoints", "seconds", f.checkpoint_seconds, a.checkpoint_seconds,
       stall_input},
  };
  json out_rows = json::array();
  std::string worst_input;
  double worst_distance = -1, worst_ratio = 0;
  std::string worst_quantity;
  for (const Row& r : rows) {
    const json ratio = forecast_ratio(r.forecast, r.actual);
    out_rows.push_back(
        {{"quantity", r.quantity},
         {"unit", r.unit},
         {"forecast", r.forecast > 0 ? json(r.forecast) : json(nullptr)},
         {"actual", r.actual > 0 ? json(r.actual) : json(nullptr)},
         {"ratio", ratio},
         {"error", ratio.is_null() ? json(nullptr) : json(r.forecast / r.actual - 1)},
         {"input", r.input}});
    if (ratio.is_null()) continue;
    const double distance = std::abs(std::log(ratio.get<double>()));
    if (distance > worst_distance) {
      worst_distance = distance;
      worst_ratio = ratio.get<double>();
      worst_input = r.input;
      worst_quantity = r.quantity;
    }
  }
  json most_wrong = nullptr;
  if (worst_distance >= 0) {
    most_wrong = {
        {"input", worst_input},
        {"quantity", worst_quantity},
        {"ratio", worst_ratio},
        {"text", fmt::format("{}: forecast/actual {:.3f} on {} ({} than forecast)", worst_input,
                             worst_ratio, worst_quantity, worst_ratio > 1 ? "less" : "more")}};
  }
  return {{"run_dir", a.run_dir},
          {"device", a.device},
          {"world_size", a.world_size},
          {"calibration", f.calibration},
          {"step_source", a.step_source},
          {"memory_source", a.memory_source},
          {"rows", out_rows},
          {"most_wrong", most_wrong}};
}

std::string comparison_markdown(const json& c) {
  std::string out = fmt::format(
      "Forecast ({}) against the run in {} ({} x {}; step times from {}; memory from {}):\n\n",
      c["calibration"].get<std::string>(), c["run_dir"].get<std::string>(),
      c["world_size"].get<int64_t>(), c["device"].get<std::string>(),
      c["step_source"].get<std::string>(), c["memory_source"].get<std::string>());
  out +=
      "| quantity | forecast | actual | forecast/actual | error | set by |\n"
      "|---|---|---|---|---|---|\n";
  for (const auto& r : c["rows"]) {
    const std::string unit = r["unit"].get<std::string>();
    auto value = [&](const char* key) {
      return r[key].is_null() ? std::string("-") : forecast_value_text(r[key].get<double>(), unit);
    };
    out += fmt::format(
        "| {} | {} | {} | {} | {} | {} |\n", r["quantity"].get<std::string>(), value("forecast"),
        value("actual"),
        r["ratio"].is_null() ? std::string("-") : fmt::format("{:.3f}", r["ratio"].get<double>()),
        r["error"].is_null() ? std::string("-")
                             : fmt::format("{:+.1f}%", 100 * r["error"].get<double>()),
        r["input"].get<std::string>());
  }
  out += c["most_wrong"].is_null()
             ? "\nNothing to compare: the run recorded none of the forecast quantities.\n"
             : "\nMost wrong input: " + c["most_wrong"]["text"].get<std::string>() + ".\n";
  return out;
}

}  // namespace kiln
