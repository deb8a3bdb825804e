// The profile rung: run the schedule with a Profiler attached, analyse the windows, decide.
#include "kiln/profile.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>

#include "core/strings.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/results.h"
#include "kiln/rungs.h"

namespace kiln {
namespace {

using nlohmann::json;

// MemTotal from /proc/meminfo, in bytes; -1 when unknown.
double host_memory_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  double kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemTotal:") return kib * 1024.0;
  }
  return -1;
}

// A ProfileResult holding src/profile's analysis and verdict documents, read through the result's
// field list (the rung fills the rest).
ProfileResult profile_parts(const json& analysis, const json& verdict) {
  try {
    // Version 1: the keys the rung fills itself (added in version 2) may be absent here.
    return json{{"schema_version", 1},     {"passed", true},       {"device", ""},
                {"traces", json::array()}, {"analysis", analysis}, {"verdict", verdict}}
        .get<ProfileResult>();
  } catch (const ResultFormatError& e) {
    throw ResultFormatError(fmt::format(
        "profile.json as written would not read back: {} (src/profile's analysis or verdict "
        "lacks a key src/report/results.cpp reads)",
        e.what()));
  }
}

}  // namespace

RungResult run_profile(Session& session, std::string* tables) {
  Trainer& trainer = *session.trainer;
  const Config& config = session.job.config;
  RungResult result;
  result.rung = "profile";

  ProfilerOptions options = profiler_options(config, session.run->dir(), session.device,
                                             session.comm->rank(), session.comm->world_size());
  ProfileSchedule schedule = options.schedule;
  if (schedule.repeat == 0)
    schedule.repeat = 1;  // the rung runs one cycle of an open-ended schedule
  options.schedule = schedule;
  const int64_t total_steps = schedule.total_steps();
  const int64_t expected_windows = schedule.repeat;
  const int64_t expected_steps = schedule.repeat * schedule.active;
  auto profiler = std::make_shared<Profiler>(options);  // checks profile.dir before any step
  trainer.add_hook(profiler);

  log::info(fmt::format(
      "profile: {} steps (skip_first {}, then {} x [wait {}, warmup {}, active {}]) on {}; "
      "traces in {}",
      total_steps, schedule.skip_first, schedule.repeat, schedule.wait, schedule.warmup,
      schedule.active, session.device.str(), options.dir.string()));
  auto log_hook = std::make_shared<StepLog>();
  trainer.add_hook(log_hook);
  trainer.add_hook(std::make_shared<MetricsHook>(
      *session.run,
      [&](json& record) {
        // The profiler action after the step, as the Profiler hook (added first) left it.
        record["profiler"] = profiler_action_name(profiler->current_action());
      },
      /*record_evals=*/false));
  std::string failure;
  try {
    trainer.run_steps(total_steps);
    profiler->finish(trainer);
  } catch (const TrainingError& e) {
    failure = e.what();
    try {
      profiler->finish(trainer);
    } catch (...) {
    }
  }
  std::vector<double> losses;
  for (const auto& s : log_hook->steps) {
    if (s.synced) losses.push_back(s.loss);
  }
  if (!failure.empty()) {
    ProfileResult stopped;
    stopped.status = {kResultSchemaVersion, false, failure, /*measured=*/false};
    stopped.losses = losses;
    result.verdict = failure;
    result.numbers = stopped;
    session.run->write_json("profile.json", json(stopped));
    return result;
  }

  std::vector<json> traces;
  for (const auto& path : profiler->traces()) traces.push_back(read_trace(path));
  TraceAnalysis analysis = analyze_traces(traces);

  const TrainerSetup& setup = session.job.trainer;
  VerdictContext context = verdict_context(setup.train, setup.loader);
  context.world_size = session.comm->world_size();
  context.cuda = session.device.is_cuda();
  if (!context.cuda) context.device_memory_bytes = host_memory_bytes();
  const Verdict verdict =
      decide_bottleneck(analysis, VerdictThresholds::from_config(config), context);
  const int top = options.top_operators;

  // The gate: the capture worked. Every window written, every active step annotated, the step's
  // phases and operators present.
  std::vector<std::string> problems;
  if (static_cast<int64_t>(traces.size()) != expected_windows) {
    problems.push_back(
        fmt::format("{} trace files written, expected {}", traces.size(), expected_windows));
  }
  if (analysis.steps != expected_steps) {
    problems.push_back(fmt::format("{} ProfilerStep annotations in the traces, expected {}",
                                   analysis.steps, expected_steps));
  }
  for (const char* phase : {"forward", "backward", "optimizer"}) {
    bool found = false;
    for (const auto& p : analysis.phases) found = found || (p.phase == phase && p.seconds > 0);
    if (!found) problems.push_back(fmt::format("no {} scope in the traces", phase));
  }
  if (analysis.operators.empty()) problems.push_back("no operators recorded");
  result.passed = problems.empty();
  result.verdict = result.passed ? verdict.reason : "capture incomplete: " + problems.front();

  // profile.json through its typed result. The analysis and the verdict are src/profile's
  // layouts (analysis_to_json, decide_bottleneck's numbers): they enter the result through its
  // reader, so a key the report needs that src/profile renamed stops the rung here.
  ProfileResult out = profile_parts(analysis_to_json(analysis, top), verdict.numbers);
  out.status = {kResultSchemaVersion, result.passed, verdict.reason, /*measured=*/true};
  out.device = session.device.str();
  out.schedule = {schedule.skip_first, schedule.wait, schedule.warmup, schedule.active,
                  schedule.repeat};
  out.options = {options.record_shapes, options.profile_memory, options.with_stack,
                 options.with_flops, options.gzip};
  out.traces.clear();
  for (const auto& path : profiler->traces()) out.traces.push_back(path.string());
  out.losses = losses;
  out.problems = problems;
  result.numbers = out;
  session.run->write_json("profile.json", json(out));

  auto& t = result.table;
  t.emplace_back("bottleneck", verdict.bottleneck);
  t.emplace_back("captured",
                 fmt::format("{} steps in {} window{} ({})", analysis.steps, analysis.windows,
                             analysis.windows == 1 ? "" : "s", options.dir.string()));
  std::string phases;
  for (const auto& p : analysis.phases) {
    if (p.share < 0.0005) continue;
    phases += fmt::format("{}{} {:.1f}%", phases.empty() ? "" : ", ", p.phase, 100 * p.share);
  }
  t.emplace_back("step phases", phases);
  // The five operators with the most self time: share of all operators' self time, ms per step.
  double total_self_us = 0;
  for (const auto& op : analysis.operators) {
    total_self_us += analysis.has_gpu ? op.self_device_us : op.self_cpu_us;
  }
  std::string operators;
  for (size_t k = 0; k < analysis.operators.size() && k < 5; ++k) {
    const auto& op = analysis.operators[k];
    const double self_us = analysis.has_gpu ? op.self_device_us : op.self_cpu_us;
    operators +=
        fmt::format("{}{} {:.1f}% ({:.2f} ms/step{})", k ? ", " : "", op.name,
                    total_self_us > 0 ? 100 * self_us / total_self_us : 0.0,
                    1e-3 * self_us / static_cast<double>(std::max<int64_t>(1, analysis.steps)),
                    analysis.has_gpu ? " on the device" : "");
  }
  t.emplace_back(
      analysis.has_gpu ? "top operators (self device time)" : "top operators (self CPU time)",
      operators);
  t.emplace_back("operator granularity",
                 fmt::format("{:.1f} us per call, {:.0f} calls per step", analysis.mean_op_us,
                             analysis.steps ? static_cast<double>(analysis.step_ops) /
                                                  static_cast<double>(analysis.steps)
                                            : 0.0));
  std::string actions;
  for (const auto& action : verdict.actions) actions += (actions.empty() ? "" : "; ") + action;
  t.emplace_back("actions", actions);
  if (tables) *tables = format_profile_tables(analysis, verdict, top);
  return result;
}

}  // namespace kiln
