// The plan: every hardware row of the catalog, from the config alone, calibrated by a pilot when
// one is given (docs/plan.md).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <tuple>

#include "core/strings.h"
#include "kiln/config.h"
#include "kiln/error.h"
#include "kiln/plan.h"
#include "plan/calibration.h"
#include "plan/options.h"
#include "plan/save_stall.h"

namespace kiln {
namespace {

using nlohmann::json;

constexpr double kDay = 86400.0;

std::vector<std::string> split_names(const std::string& text) {
  std::vector<std::string> out;
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t end = text.find(',', begin);
    if (end == std::string::npos) end = text.size();
    std::string name(trim(std::string_view(text).substr(begin, end - begin)));
    if (!name.empty()) out.push_back(name);
    begin = end + 1;
  }
  return out;
}

std::optional<double> finite_or_null(double value) {
  return std::isfinite(value) ? std::optional<double>(value) : std::nullopt;
}

std::string days_text(double seconds) {
  return std::isfinite(seconds) ? fmt::format("{:.2f}", seconds / kDay) : "never";
}

// The planner's parts as plan.json lays them out (kiln/results.h; their to_json in src/plan).
PlanHost plan_host(const HostNeeds& h) {
  PlanHost out;
  out.staging_bytes_per_node = h.staging_bytes_per_node;
  out.loader_bytes_per_node = h.loader_bytes_per_node;
  out.host_bytes_per_node = h.host_bytes_per_node;
  if (h.host_memory_bytes > 0) out.host_memory_bytes = h.host_memory_bytes;
  out.host_fits = h.host_fits;
  out.storage_bytes = h.storage_bytes;
  if (h.storage_limit_bytes > 0) out.storage_limit_bytes = h.storage_limit_bytes;
  out.storage_fits = h.storage_fits;
  out.warnings = h.warnings;
  return out;
}

PlanMemoryEstimate plan_memory_estimate(const MemoryEstimate& m) {
  PlanMemoryEstimate out;
  out.parameters_bytes = m.parameters;
  out.gradients_bytes = m.gradients;
  out.optimizer_bytes = m.optimizer;
  out.activations_bytes = m.activations;
  out.logits_bytes = m.logits;
  out.backward_extra_bytes = m.backward_extra;
  out.autocast_copies_bytes = m.autocast_copies;
  out.communication_bytes = m.communication;
  out.gradients_after_step_bytes = m.gradients_after_step;
  out.gradients_held_across_micro_batches = m.gradients_held;
  out.peak_at = m.peak_at;
  out.step_peak_bytes = m.step_peak();
  out.total_bytes = m.total();
  return out;
}

// Why no row fits 30 days, from the row that comes closest: memory, failures (the job's MTBF
// against a checkpoint period and a restart), communication, a global batch so large the run is
// a few steps, or plain compute (the only case more GPUs help).
std::string what_limits(const std::vector<PlanRow>& rows, double steps, double tokens_per_step,
                        bool activation_checkpointing) {
  const PlanRow* closest = nullptr;
  double closest_wall = std::numeric_limits<double>::infinity();
  bool any_fits_memory = false;
  for (const auto& row : rows) {
    if (!row.fits_memory) continue;
    any_fits_memory = true;
    const double wall = row.wall_seconds.value_or(std::numeric_limits<double>::infinity());
    if (closest == nullptr || wall < closest_wall) closest = &row, closest_wall = wall;
  }
  if (!any_fits_memory) {
    return std::string("memory: no row holds the job even sharded over every GPU; ") +
           (activation_checkpointing ? ""
                                     : "enable activation checkpointing "
                                       "(train.activation_checkpointing = \"block\"), ") +
           "lower train.batch_size, plan more GPUs (plan.gpus) or a row with more memory";
  }
  const PlanRow& row = *closest;
  std::vector<std::string> limits;
  const double mtbf = row.job_mtbf_seconds;
  const double period = row.checkpoint_interval_seconds;
  const double restart = row.restart_seconds;
  if (mtbf > 0 && (!std::isfinite(closest_wall) || row.ettr < 0.5)) {
    limits.push_back(fmt::format(
        "failures: the job's MTBF on {} at {} GPUs is {} (plan.gpu_mtbf_hours / GPUs), against a "
        "checkpoint period of {} and a restart of {}; more GPUs fail more often: use fewer, "
        "faster saves (checkpoint.async) and faster restarts",
        row.hardware, row.gpus, format_duration(mtbf), format_duration(period),
        format_duration(restart)));
  }
  const double comm = row.communication_seconds_per_step;
  const double compute = row.compute_seconds_per_step;
  if (comm > compute) {
    limits.push_back(fmt::format(
        "communication: {} of each {} step is communication at {} GPUs, and more GPUs add to it",
        format_duration(comm), format_duration(comm + compute), row.gpus));
  }
  constexpr double kFewSteps = 100;
  if (steps < kFewSteps) {
    limits.push_back(fmt::format(
        "the global batch: {:.3g} tokens per optimizer step leaves {:.0f} steps for the planned "
        "tokens; more GPUs only grow the batch (lower plan.gpus, train.batch_size or "
        "train.grad_accum_steps)",
        tokens_per_step, steps));
  }
  if (limits.empty()) {
    return "compute: add GPUs (plan.gpus), lower plan.tokens, or plan on a faster row";
  }
  std::string out;
  for (const auto& l : limits) out += (out.empty() ? "" : "; ") + l;
  return out;
}

}  // namespace

std::string job_hash(const Config& config) {
  Config job = config;
  for (const auto& section : config.sections()) {
    for (const auto& key : section.keys) {
      const bool planning = section.name == "plan" || section.name == "pilot";
      const bool where = key.full_name() == "run.dir" || key.full_name() == "run.name" ||
                         key.full_name() == "run.progress" || key.full_name() == "run.log_every";
      if (planning || where) job.set(key.full_name(), key.default_value);
    }
  }
  return job.hash();
}

PilotCalibration read_pilot(const std::filesystem::path& run_dir, const Config& config) {
  const auto path = run_dir / "pilot.json";
  std::ifstream in(path);
  if (!in) {
    throw UserError(fmt::format("--pilot {}: no pilot.json there; run `kiln pilot CONFIG` first",
                                run_dir.string()));
  }
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    throw UserError(fmt::format("{}: not JSON ({})", path.string(), e.what()));
  }
  PilotCalibration p;
  p.run_dir = run_dir;
  p.job_hash = j.value("job_hash", "");
  const std::string mine = job_hash(config);
  if (p.job_hash != mine) {
    throw UserError(fmt::format(
        "--pilot {}: that pilot ran another job (job hash {} there, {} for {}); run `kiln pilot` "
        "on this config",
        run_dir.string(), p.job_hash, mine, config.source_name()));
  }
  auto number = [&](const json& node, const char* key) {
    return node.contains(key) && node[key].is_number() ? node[key].get<double>() : 0.0;
  };
  p.device = j.value("device_name", "cpu");
  p.mfu = number(j, "mfu");
  p.eval_seconds = number(j, "eval_seconds");
  p.wall_seconds = number(j, "wall_seconds");
  if (j.contains("checkpoint")) {
    p.write_bytes_per_second = number(j["checkpoint"], "write_bytes_per_second");
    p.save_blocking_seconds = number(j["checkpoint"], "save_blocking_seconds");
    p.save_end_wait_seconds = number(j["checkpoint"], "save_end_wait_seconds");
  }
  if (j.contains("step_timing") && j["step_timing"].is_object())
    p.step_timing = j["step_timing"].value("method", "");
  if (j.contains("memory")) p.activation_ratio = number(j["memory"], "activation_ratio");
  if (j.contains("restore")) p.recovery_seconds = number(j["restore"], "recovery_seconds");
  p.step_seconds = number(j, "step_seconds");
  p.world_size = std::max<int64_t>(1, static_cast<int64_t>(number(j, "world_size")));
  if (j.contains("matmul_peak") && j["matmul_peak"].is_object())
    p.matmul_peak_flops_per_second = number(j["matmul_peak"], "flops_per_second");
  if (j.contains("memory") && j["memory"].contains("measured"))
    p.peak_memory_bytes = number(j["memory"]["measured"], "peak_bytes");
  return p;
}

PlanResult make_plan(const Config& config, const PilotCalibration* pilot, bool require_cost) {
  const PlanInputs inputs = PlanInputs::from_config(config);
  const ModelShape shape = model_shape(config);
  const JobShape job = job_shape(config);
  const auto catalog = load_catalog(inputs.plan_catalog);
  std::vector<const Device*> rows;
  const auto names = split_names(inputs.plan_hardware);
  if (names.empty()) {
    for (const auto& d : catalog) rows.push_back(&d);
  } else {
    for (const auto& name : names) rows.push_back(&find_device(catalog, name, "plan.hardware"));
  }

  const double n = static_cast<double>(analytic_parameter_count(shape));
  const MemoryEstimate memory = estimate_memory(shape, job);
  const int64_t gpus = job.world_size;
  const double tokens_per_step =
      static_cast<double>(job.micro_batch * job.grad_accum_steps * job.seq_len * gpus);
  const double planned_tokens = inputs.plan_tokens > 0
                                    ? inputs.plan_tokens
                                    : static_cast<double>(inputs.train_steps) * tokens_per_step;
  const double steps = std::ceil(planned_tokens / tokens_per_step);
  const double flops_per_token =
      train_flops_per_token(shape, job.seq_len, job.activation_checkpointing);
  const double flops_per_step = flops_per_token * tokens_per_step;
  const int64_t eval_every = inputs.train_eval_every;
  const double evals =
      (eval_every > 0 ? std::floor(steps / static_cast<double>(eval_every)) : 0) + 1;
  const double eval_tokens_per_rank =
      static_cast<double>(inputs.train_eval_batches * job.micro_batch * job.seq_len);
  const double checkpoint_bytes = memory.parameters + memory.optimizer;
  // The pilot's write speed is its own machine's storage: it calibrates only that device's row.
  const double assumed_write_speed = inputs.plan_checkpoint_write_gb_per_second * 1e9;
  const double mtbf = inputs.plan_gpu_mtbf_hours;
  const bool async_saves = inputs.checkpoint_async;
  const double headroom = inputs.plan_headroom;
  const double activation_ratio =
      pilot && pilot->activation_ratio > 0 ? pilot->activation_ratio : 1.0;
  const auto& price_7d = inputs.plan_price_7d_per_gpu_hour;
  const auto& price_30d = inputs.plan_price_30d_per_gpu_hour;
  for (const auto& [key, prices] : {std::pair{"plan.price_7d_per_gpu_hour", &price_7d},
                                    std::pair{"plan.price_30d_per_gpu_hour", &price_30d}}) {
    for (const auto& [name, price] : *prices) {
      const std::string where = fmt::format("{}.{}", key, name);
      const Device& device = find_device(catalog, name, where);  // unknown: names the closest
      if (device.name != name) {
        throw UserError(fmt::format("{}: write the row's name as the catalog does: {}.{}", where,
                                    key, device.name));
      }
      if (!(price > 0)) {
        throw UserError(
            fmt::format("{} = {}: a price per GPU-hour must be positive", where, price));
      }
    }
  }
  if (require_cost && mtbf <= 0) {
    throw UserError(
        "plan.gpu_mtbf_hours = 0 (unknown) but --cost needs the failure model; set "
        "plan.gpu_mtbf_hours (docs/plan.md gives a default from a public large-run report)");
  }

  // Rows the pilot measured (its own device) use its MFU, eval time, write speed and duration;
  // every other row uses the assumed figures, listed below with the rows they apply to.
  std::vector<std::string> measured_rows, assumed_rows, warnings, no_host_rows;
  PlanResult plan;
  std::vector<PlanRow>& out_rows = plan.rows;
  std::optional<PlanRecommendation>& best = plan.recommendation;
  double best_cost = 0, best_days = 0;
  for (const Device* device : rows) {
    StrategyInput input = strategy_input(shape, job, device->memory_bytes, headroom);
    input.activation_bytes *= activation_ratio;
    set_links(input, *device);
    const StrategyDecision decision = choose_strategy(input);
    // The pilot ran on this row's device: its measurements (the MFU over the matmul it timed,
    // eval, write speed, restart, its own duration) stand for this row; the peak and MFU by the
    // rule the forecast uses (plan/calibration.h). A catalog figure far from the measured one
    // is the wrong-denominator bug (MFU above 100%): warned.
    const bool measured_here = pilot_ran_on(pilot, catalog, device, "");
    const double per_device_tokens =
        static_cast<double>(job.micro_batch * job.grad_accum_steps * job.seq_len);
    const ComputeCalibration compute =
        calibrate_compute(pilot, measured_here, 0.0, device, job.precision,
                          flops_per_token * per_device_tokens, inputs.plan_mfu);
    const double catalog_peak = compute.catalog_peak_flops_per_second;
    if (catalog_peak <= 0) {
      throw UserError(
          fmt::format("hardware row {} has no peak_tflops.{} (train.precision = \"{}\"); add "
                      "it to the catalog row",
                      device->name, compute_precision(job.precision), job.precision));
    }
    const double peak = compute.peak_flops_per_second;
    const bool peak_measured = measured_here && pilot->matmul_peak_flops_per_second > 0;
    if (peak_measured && compute.measured) {
      const double over = catalog_peak / peak;
      if (over > 1.25 || over < 0.5) {
        warnings.push_back(fmt::format(
            "{}: the catalog's peak {:.3g} FLOP/s is {:.2f}x the matmul the pilot measured on "
            "{} ({:.3g} FLOP/s): the plan uses the measured one; check the row's "
            "peak_tflops.{} or the device",
            device->name, catalog_peak, over, pilot->device, peak,
            compute_precision(job.precision)));
      }
    }
    const double mfu = compute.mfu;
    (measured_here ? measured_rows : assumed_rows).push_back(device->name);
    const double write_speed = measured_here && pilot->write_bytes_per_second > 0
                                   ? pilot->write_bytes_per_second
                                   : assumed_write_speed;
    const double save_seconds = checkpoint_bytes / write_speed;
    // R: the requeue (plan.restart_minutes), then process start, restore and the first step as
    // the pilot measured them on this device, else the checkpoint's load at the write speed.
    const double recovery_seconds =
        measured_here && pilot->recovery_seconds > 0 ? pilot->recovery_seconds : save_seconds;
    const double restart_seconds = inputs.plan_restart_minutes * 60.0 + recovery_seconds;
    // The rule's own figure for every layout: DDP's all-reduce, FSDP's gathers and
    // reduce-scatters on the shard group's link and the replicas' all-reduce, TP's all-reduces.
    const double g = static_cast<double>(gpus);
    const double comm = decision.communication_seconds;
    BudgetInput b;
    b.steps = steps;
    b.compute_seconds_per_step = flops_per_step / (g * peak * mfu);
    b.communication_seconds_per_step = comm;
    b.evals = evals;
    b.eval_seconds = measured_here && pilot->eval_seconds > 0
                         ? pilot->eval_seconds
                         : eval_tokens_per_rank * flops_per_token / 3.0 / (peak * mfu);
    // delta: what one save stalls the job (plan/save_stall.h).
    const SaveStall stall = save_stall(async_saves, pilot, measured_here, save_seconds);
    b.save_seconds = stall.seconds;
    b.restart_seconds = restart_seconds;
    b.gpus = gpus;
    b.gpu_mtbf_hours = mtbf;
    b.restore_drills = inputs.plan_restore_drills;
    b.pilot_seconds = pilot && pilot->wall_seconds > 0 && measured_here
                          ? pilot->wall_seconds
                          : inputs.plan_pilot_hours * 3600.0;
    b.margin_fraction = inputs.plan_margin;
    const Budget result = budget(b);
    const bool fits_memory = decision.strategy != "does-not-fit";
    const HostNeeds host = host_needs(config, *device, gpus, decision, checkpoint_bytes,
                                      result.checkpoint_interval_seconds);
    if (fits_memory) warnings.insert(warnings.end(), host.warnings.begin(), host.warnings.end());
    if (device->host_memory_bytes <= 0) no_host_rows.push_back(device->name);
    PlanRow row;
    row.hardware = device->name;
    row.display_name = device->display_name;
    row.gpus = gpus;
    row.strategy = decision.strategy;
    row.fsdp_degree = decision.fsdp_degree;
    row.tp_degree = decision.tp_degree;
    row.strategy_communication_seconds = decision.communication_seconds;
    row.usable_bytes = decision.usable_bytes;
    row.ddp_bytes_per_device = decision.ddp_bytes_per_device;
    row.fsdp_bytes_per_device = decision.fsdp_bytes_per_device;
    row.strategy_reason = decision.reason;
    row.fits_memory = fits_memory;
    row.peak_flops_per_gpu = peak;
    row.peak_flops_source = compute.peak_source;
    row.catalog_peak_flops_per_gpu = catalog_peak;
    row.host = plan_host(host);
    row.mfu = mfu;
    row.mfu_source = compute.mfu_source;
    row.step_seconds = result.step_seconds;
    row.compute_seconds_per_step = result.compute_seconds;
    row.communication_seconds_per_step = result.communication_seconds;
    row.train_seconds = result.train_seconds;
    row.eval_seconds = result.eval_seconds;
    row.save_seconds = result.save_seconds;
    row.full_save_seconds = save_seconds;
    row.save_stall_source = stall.source;
    row.write_bytes_per_second = write_speed;
    row.restart_seconds = restart_seconds;
    row.recovery_seconds = recovery_seconds;
    row.recovery_source = measured_here && pilot->recovery_seconds > 0
                              ? "pilot (process start, restore, first step)"
                              : "checkpoint load at the write speed (assumed)";
    row.checkpoint_interval_seconds = result.checkpoint_interval_seconds;
    row.young_interval_seconds = result.young_interval_seconds;
    row.saves_seconds = result.saves_seconds;
    row.job_mtbf_seconds = result.job_mtbf_seconds;
    row.expected_failures = finite_or_null(result.expected_failures);
    row.lost_seconds = finite_or_null(result.lost_seconds);
    row.drills_seconds = result.drills_seconds;
    row.pilot_seconds = result.pilot_seconds;
    row.margin_seconds = finite_or_null(result.margin_seconds);
    row.wall_seconds = finite_or_null(result.wall_seconds);
    row.wall_days = finite_or_null(result.wall_seconds / kDay);
    row.ettr = result.ettr;
    for (const auto& [days, prices, key, r] :
         {std::tuple{7, &price_7d, "plan.price_7d_per_gpu_hour", &row.reservation_7d},
          std::tuple{30, &price_30d, "plan.price_30d_per_gpu_hour", &row.reservation_30d}}) {
      const bool fits = fits_memory && result.wall_seconds <= days * kDay;
      r->fits = fits;
      auto price = prices->find(device->name);
      if (price != prices->end()) {
        const double cost = g * days * 24.0 * price->second;
        r->price_per_gpu_hour = price->second;
        r->cost = cost;
        if (fits && (!best || cost < best_cost ||
                     (cost == best_cost && result.wall_seconds / kDay < best_days))) {
          best = PlanRecommendation{device->name, days, cost, std::nullopt};
          best_cost = cost;
          best_days = result.wall_seconds / kDay;
        }
      } else if (require_cost) {
        throw UserError(
            fmt::format("{} has no price for {}; set {}.{} = <price per GPU-hour> "
                        "(prices are never built in)",
                        key, device->name, key, device->name));
      }
    }
    out_rows.push_back(std::move(row));
  }

  std::vector<std::string> assumptions;
  if (!assumed_rows.empty()) {
    const std::string where =
        measured_rows.empty()
            ? (pilot ? fmt::format("on every row (the pilot ran on {}, not a catalog row)",
                                   pilot->device)
                     : "on every row: no pilot given")
            : fmt::format("on {} (the pilot measured {})", fmt::join(assumed_rows, ", "),
                          fmt::join(measured_rows, ", "));
    assumptions.push_back(fmt::format("MFU {} (plan.mfu) {}", inputs.plan_mfu, where));
    assumptions.push_back(
        fmt::format("checkpoint write speed {} GB/s (plan.checkpoint_write_gb_per_second) {}",
                    inputs.plan_checkpoint_write_gb_per_second, where));
    assumptions.push_back("eval time from FLOPs at the planned MFU " + where);
    assumptions.push_back(
        fmt::format("pilot time {} h (plan.pilot_hours) {}", inputs.plan_pilot_hours, where));
  }
  if (!pilot) assumptions.push_back("activations from the analytic model, uncalibrated");
  assumptions.push_back(
      fmt::format("GPU MTBF {} h (plan.gpu_mtbf_hours), restart {} min (plan.restart_minutes)",
                  mtbf, inputs.plan_restart_minutes));
  assumptions.push_back("communication not overlapped with compute (an upper bound)");
  if (!no_host_rows.empty()) {
    assumptions.push_back(
        fmt::format("host memory not checked on {} (no host_memory_gb in the row)",
                    fmt::join(no_host_rows, ", ")));
  }

  // Without prices: the shortest reservation that fits, then the fewest days. A job shorter than
  // a day (a tiny model, a short fine-tune) is not worth a 7-day reservation: said so instead.
  const bool priced = best.has_value();
  double best_wall = best_days * kDay;
  if (!priced) {
    int shortest = 0;
    for (const auto& row : out_rows) {
      for (const auto& [days, r] :
           {std::pair{7, &row.reservation_7d}, std::pair{30, &row.reservation_30d}}) {
        if (!r->fits) continue;
        const double wall = row.wall_seconds.value_or(std::numeric_limits<double>::infinity());
        if (shortest == 0 || days < shortest || (days == shortest && wall < best_wall)) {
          best = PlanRecommendation{row.hardware, days, std::nullopt, std::nullopt};
          shortest = days;
          best_wall = wall;
        }
      }
    }
  }
  std::string recommendation;
  if (!best) {
    recommendation =
        fmt::format("nothing fits a 30-day reservation at {} GPUs: {}", gpus,
                    what_limits(out_rows, steps, tokens_per_step, job.activation_checkpointing));
  } else if (best_wall < kDay) {
    best->reservation_needed = false;
    recommendation = fmt::format(
        "{}: the whole job takes {} with the margin, far less than the shortest reservation "
        "(7 days): run it on demand or on hardware at hand rather than reserving",
        best->hardware, format_duration(best_wall));
  } else if (priced) {
    recommendation = fmt::format(
        "{} for {} days: the cheapest row that fits with the margin ({:.0f} in the prices given)",
        best->hardware, best->reservation_days, best_cost);
  } else {
    recommendation = fmt::format(
        "{} for {} days: the shortest reservation that fits with the margin ({} days); set "
        "plan.price_7d_per_gpu_hour and plan.price_30d_per_gpu_hour to compare costs",
        best->hardware, best->reservation_days, days_text(best_wall));
  }

  plan.config = config.source_name();
  plan.job_hash = job_hash(config);
  if (pilot) plan.pilot = pilot->run_dir.string();
  plan.architecture = shape.architecture;
  plan.parameters = n;
  plan.largest_unit_parameters = largest_unit_parameter_count(shape);
  plan.flops_per_token = flops_per_token;
  plan.micro_batch = job.micro_batch;
  plan.seq_len = job.seq_len;
  plan.grad_accum_steps = job.grad_accum_steps;
  plan.gpus = gpus;
  plan.precision = job.precision;
  plan.optimizer = job.optimizer;
  plan.activation_checkpointing = job.activation_checkpointing;
  plan.tokens = planned_tokens;
  plan.tokens_per_step = tokens_per_step;
  plan.steps = steps;
  plan.evals = evals;
  plan.memory_per_device.estimate = plan_memory_estimate(memory);
  plan.memory_per_device.state_bytes_per_parameter = state_bytes_per_parameter(job);
  plan.memory_per_device.activation_calibration = activation_ratio;
  plan.checkpoint_bytes = checkpoint_bytes;
  plan.assumed_write_bytes_per_second = assumed_write_speed;
  if (pilot && pilot->write_bytes_per_second > 0)
    plan.pilot_write_bytes_per_second = pilot->write_bytes_per_second;
  plan.assumptions = std::move(assumptions);
  plan.warnings = std::move(warnings);
  plan.recommendation_text = recommendation;
  // The plan is advice, not a gate on the job: it "passes" when some row fits 30 days.
  bool any_fits = false;
  for (const auto& row : plan.rows) any_fits = any_fits || row.reservation_30d.fits;
  plan.status.passed = any_fits;
  plan.status.verdict =
      any_fits ? recommendation : "nothing fits a 30-day reservation: " + recommendation;
  return plan;
}

}  // namespace kiln
