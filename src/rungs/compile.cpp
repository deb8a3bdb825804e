// The compile rung: eager against the compiled step (compile.backend, or "inductor" when that is
// eager) in one process, from the same initial weights on the same batches. Compile time apart
// (cold or cached), warm-up untimed, then interleaved timed steps, the shape probe (recompiles),
// the numerics gate (losses and parameters), peak memory of a step on each side, the verdict.
#include "kiln/compile.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/clock.h"
#include "core/strings.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/models.h"
#include "kiln/rungs.h"

namespace kiln {
namespace {

using nlohmann::json;

double relative_difference(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return INFINITY;
  return std::abs(a - b) / std::max(std::abs(b), 1e-12);
}

// Parameters after the same steps: the relative difference over all of them, ||a - b|| / ||b||
// with every tensor in one vector, and the tensor that differs most relative to its own norm
// (informative: a tensor whose gradient is zero in exact arithmetic, like an attention key bias,
// follows rounding noise that Adam normalises, and can differ more on its own).
struct ParameterDifference {
  double overall = 0;
  double worst_tensor = 0;
  std::string worst_name;
};

ParameterDifference parameter_difference(Model& compiled, Model& eager) {
  ParameterDifference out;
  double diff_squared = 0, norm_squared = 0;
  auto theirs = eager.named_parameters();
  for (const auto& item : compiled.named_parameters()) {
    const torch::Tensor& b = theirs[item.key()];
    const double diff = (item.value() - b).norm().item<double>();
    const double norm = b.norm().item<double>();
    diff_squared += diff * diff;
    norm_squared += norm * norm;
    const double relative = diff / std::max(norm, 1e-12);
    if (!(relative <= out.worst_tensor)) {
      out.worst_tensor = std::isnan(relative) ? INFINITY : relative;
      out.worst_name = item.key();
    }
  }
  out.overall = std::sqrt(diff_squared) / std::max(std::sqrt(norm_squared), 1e-12);
  if (std::isnan(out.overall)) out.overall = INFINITY;
  return out;
}

json step_time_json(const std::vector<double>& seconds, int64_t tokens_per_step,
                    int64_t samples_per_step) {
  const double median = percentile(seconds, 0.5);
  return {
      {"median_seconds", median},
      {"p90_seconds", percentile(seconds, 0.9)},
      {"samples_per_second", static_cast<double>(samples_per_step) / median},
      {"tokens_per_second",
       tokens_per_step > 0 ? json(static_cast<double>(tokens_per_step) / median) : json(nullptr)}};
}

}  // namespace

RungResult run_compile(Session& session) {
  const Config& config = session.config;
  CompileOptions options = CompileOptions::from_config(config);
  Config compiled_config = config;
  if (options.backend == CompileOptions::Backend::kEager) {
    compiled_config.set("compile.backend", std::string("inductor"));
    options.backend = CompileOptions::Backend::kInductor;
  }
  if (session.comm && session.comm->world_size() > 1) {
    throw UserError("the compile rung runs in one process; run `kiln compile` without torchrun");
  }
  RungResult result;
  result.rung = "compile";
  Trainer& eager = *session.trainer;
  // The compiled side: the same job built again (same seed: same initial weights and batches).
  Trainer compiled(compiled_config, make_model(compiled_config), make_datasets(compiled_config),
                   eager.options());
  std::shared_ptr<CompiledStep> step;  // AOTInductor
  if (options.inductor()) {
    step = std::make_shared<CompiledStep>(compiled_config, compiled.model(),
                                          compiled.options().device);
    compiled.set_compiled_step(step);
  }
  const auto captured = attach_captured_step(compiled, compiled_config);  // CUDA graphs
  // The report of the compiler that decides graphs and recompiles: AOTInductor's when it runs
  // (the capture's is written beside it), else the capture's.
  auto report_of = [&]() -> const CompileReport& {
    return step ? step->report() : captured->report();
  };
  auto eager_log = std::make_shared<StepLog>();
  auto compiled_log = std::make_shared<StepLog>();
  eager.add_hook(eager_log);
  compiled.add_hook(compiled_log);
  eager.add_hook(std::make_shared<MetricsHook>(
      *session.run, [](json& record) { record["side"] = "eager"; }, /*record_evals=*/false));

  json numbers = {{"backend", backend_name(options.backend)},
                  {"dynamic", dynamic_name(options.dynamic)},
                  {"fullgraph", options.fullgraph},
                  {"recompile_limit", options.recompile_limit},
                  {"device", session.device.str()}};
  auto finish = [&](bool passed, const std::string& verdict) {
    result.passed = passed;
    result.verdict = verdict;
    numbers["compile"] = report_of().to_json();
    if (step && captured) numbers["capture"] = captured->report().to_json();
    numbers["passed"] = passed;
    numbers["verdict"] = verdict;
    result.numbers = numbers;
    session.run->write_json("compile.json", numbers);
    return result;
  };

  // 1. Compile (or load from the cache) the training shape's graph, timed apart.
  std::vector<int64_t> first_indices(static_cast<size_t>(eager.train_options().batch_size));
  for (size_t k = 0; k < first_indices.size(); ++k) first_indices[k] = static_cast<int64_t>(k);
  const Batch example = eager.data().train->get(first_indices);
  const InputShapes train_shapes = InputShapes::of(example);
  log::info(fmt::format("compile: {} step for {} (dynamic = {}, cache {})",
                        backend_name(options.backend), train_shapes.str(),
                        dynamic_name(options.dynamic), options.cache_dir.string()));
  const auto compile_begin = SteadyClock::now();
  try {
    if (step) step->prepare(train_shapes);
    // A capture warms up, probes for host synchronisations and captures on its first steps:
    // take them (both sides, untimed) before timing.
    for (int64_t k = 0; captured && k <= options.warmup_steps; ++k) {
      eager.train_step(/*sync=*/true);
      compiled.train_step(/*sync=*/true);
    }
  } catch (const TrainingError& e) {  // graph breaks with compile.fullgraph = true
    result.table.emplace_back("graph breaks", describe_breaks(report_of().breaks));
    return finish(false, e.what());
  }
  const double compile_seconds =
      captured && !step
          ? (report_of().graphs.empty() ? 0.0 : report_of().graphs.front().build_seconds)
          : seconds_since(compile_begin);
  const auto& graphs = report_of().graphs;
  const bool cold = !graphs.empty() && !graphs.front().cache_hit;
  numbers["compile_seconds"] = compile_seconds;
  numbers["cache"] = graphs.empty() ? "n/a" : (cold ? "cold" : "cached");
  if (report_of().fallback_to_eager) {
    result.table.emplace_back("graph breaks", describe_breaks(report_of().breaks));
    numbers["speedup"] = nullptr;
    return finish(true,
                  fmt::format("stay eager: the step has {} graph break(s) and "
                              "compile.fullgraph = false, so it runs eager: {}",
                              report_of().breaks.size(), describe_breaks(report_of().breaks)));
  }

  // 2. Warm-up (untimed), then timed steps, interleaved so both sides see the same machine.
  //    Both sides take the same batches from their own loaders (same seed).
  std::vector<double> eager_seconds, compiled_seconds, loss_differences;
  std::vector<double> eager_losses, compiled_losses;
  double worst_loss_difference = 0;
  int64_t worst_loss_step = 0;
  for (int64_t k = 0; k < options.warmup_steps + options.steps; ++k) {
    const StepStats e = eager.train_step(/*sync=*/true);
    const StepStats c = compiled.train_step(/*sync=*/true);
    eager_losses.push_back(e.loss);
    compiled_losses.push_back(c.loss);
    const double diff = relative_difference(c.loss, e.loss);
    if (!(diff <= worst_loss_difference)) {
      worst_loss_difference = diff;
      worst_loss_step = e.step;
    }
    if (k < options.warmup_steps) continue;
    eager_seconds.push_back(e.step_seconds);
    compiled_seconds.push_back(c.step_seconds);
  }
  const int64_t samples_per_step = eager_log->steps.back().samples;
  const int64_t tokens_per_step = eager_log->steps.back().tokens;

  // 3. Peak memory of one step on each side (not timed).
  reset_peak_memory(session.device);
  eager.train_step(/*sync=*/true);
  const PeakMemory eager_peak = read_peak_memory(session.device);
  reset_peak_memory(session.device);
  compiled.train_step(/*sync=*/true);
  const PeakMemory compiled_peak = read_peak_memory(session.device);
  {
    const double diff =
        relative_difference(compiled_log->steps.back().loss, eager_log->steps.back().loss);
    if (!(diff <= worst_loss_difference)) {
      worst_loss_difference = diff;
      worst_loss_step = eager_log->steps.back().step;
    }
  }

  // 4. The shape probe: shorter sequences stand in for variable-length data. Each is one more
  //    step on both sides (same truncated batch), so numerics are checked on every graph.
  json probe = json::array();
  const bool tokens = example.inputs.dim() == 2 && example.targets.dim() == 2;
  if (tokens) {
    Batch next = eager.data().train->get(first_indices);
    for (int64_t length : options.probe_seq_lens) {
      if (length >= example.inputs.size(1)) continue;
      const size_t recompiles_before = report_of().recompiles.size();
      const size_t graphs_before = report_of().graphs.size();
      const Batch truncated{next.inputs.narrow(1, 0, length).contiguous(),
                            next.targets.narrow(1, 0, length).contiguous()};
      const StepStats e = eager.train_step_on({truncated});
      const StepStats c = compiled.train_step_on({truncated});
      const double diff = relative_difference(c.loss, e.loss);
      if (!(diff <= worst_loss_difference)) {
        worst_loss_difference = diff;
        worst_loss_step = e.step;
      }
      const auto& recompiles = report_of().recompiles;
      probe.push_back(
          {{"seq_len", length},
           {"recompiled", recompiles.size() > recompiles_before},
           {"new_graph", report_of().graphs.size() > graphs_before},
           {"eager", recompiles.size() > recompiles_before && !recompiles.back().compiled},
           {"loss_eager", e.loss},
           {"loss_compiled", c.loss}});
    }
  }

  // 5. Numerics: losses of every step and the parameters after all of them.
  const ParameterDifference parameters = parameter_difference(compiled.model(), eager.model());
  const double parameter_diff = parameters.overall;
  const bool losses_agree = worst_loss_difference <= options.tolerance;
  const bool parameters_agree = parameter_diff <= options.tolerance;
  const double eager_median = percentile(eager_seconds, 0.5);
  const double compiled_median = percentile(compiled_seconds, 0.5);
  const double speedup = eager_median / compiled_median;
  const auto& report = report_of();
  int64_t recompiled = 0;
  for (const Recompile& r : report.recompiles) recompiled += r.compiled ? 1 : 0;

  numbers["graphs"] = report.graphs.size();
  numbers["graph_breaks"] = report.to_json()["graph_breaks"];
  numbers["recompiles"] = report.to_json()["recompiles"];
  numbers["probe"] = probe;
  numbers["warmup_steps"] = options.warmup_steps;
  numbers["timed_steps"] = options.steps;
  numbers["eager"] = step_time_json(eager_seconds, tokens_per_step, samples_per_step);
  numbers["compiled"] = step_time_json(compiled_seconds, tokens_per_step, samples_per_step);
  numbers["eager"]["peak_memory_bytes"] = eager_peak.allocated_bytes;
  numbers["compiled"]["peak_memory_bytes"] = compiled_peak.allocated_bytes;
  numbers["peak_memory_method"] = eager_peak.method;
  numbers["speedup"] = speedup;
  numbers["min_speedup"] = options.min_speedup;
  numbers["numerics"] = {{"tolerance", options.tolerance},
                         {"max_relative_loss_difference", worst_loss_difference},
                         {"worst_loss_step", worst_loss_step},
                         {"max_relative_parameter_difference", parameter_diff},
                         {"worst_parameter", parameters.worst_name},
                         {"worst_parameter_relative_difference", parameters.worst_tensor},
                         {"eager_losses", eager_losses},
                         {"compiled_losses", compiled_losses}};

  auto& t = result.table;
  t.emplace_back("backend",
                 fmt::format("{} (dynamic = {}, fullgraph = {})", backend_name(options.backend),
                             dynamic_name(options.dynamic), options.fullgraph));
  std::string graph_text;
  for (const auto& g : report.graphs) {
    if (!graph_text.empty()) graph_text += "; ";
    graph_text += fmt::format("{}: {}", g.shape.str(),
                              g.cache_hit ? fmt::format("cached (load {:.2f} s)", g.load_seconds)
                                          : fmt::format("built in {:.1f} s", g.build_seconds));
  }
  t.emplace_back("compile time",
                 fmt::format("{:.1f} s, {} cache", compile_seconds, cold ? "cold" : "warm"));
  t.emplace_back("graphs", fmt::format("{}: {}", report.graphs.size(), graph_text));
  t.emplace_back("graph breaks", "none (fullgraph)");
  std::string recompile_text = fmt::format("{} (limit {})", recompiled, options.recompile_limit);
  for (const Recompile& r : report.recompiles) {
    recompile_text += fmt::format("; {}{}", r.reason, r.compiled ? "" : " [eager]");
  }
  t.emplace_back("recompiles", recompile_text);
  auto time_row = [&](const std::vector<double>& seconds) {
    const double median = percentile(seconds, 0.5);
    return fmt::format(
        "median {:.2f} ms, p90 {:.2f} ms, {}", 1e3 * median, 1e3 * percentile(seconds, 0.9),
        tokens_per_step > 0
            ? fmt::format("{:.0f} tokens/s", static_cast<double>(tokens_per_step) / median)
            : fmt::format("{:.0f} samples/s", static_cast<double>(samples_per_step) / median));
  };
  t.emplace_back("eager step", time_row(eager_seconds));
  t.emplace_back("compiled step", time_row(compiled_seconds));
  t.emplace_back("speedup", fmt::format("{:.2f}x (eager median / compiled median, {} interleaved "
                                        "steps after {} warm-up)",
                                        speedup, options.steps, options.warmup_steps));
  t.emplace_back("numerics",
                 fmt::format("losses max rel diff {:.2e}, parameters {:.2e} (most in {}: {:.2e}; "
                             "tolerance {:.0e})",
                             worst_loss_difference, parameter_diff, parameters.worst_name,
                             parameters.worst_tensor, options.tolerance));
  t.emplace_back("peak memory",
                 fmt::format("eager {}, compiled {} ({})", format_bytes(eager_peak.allocated_bytes),
                             format_bytes(compiled_peak.allocated_bytes), eager_peak.method));

  if (!losses_agree || !parameters_agree) {
    return finish(
        false,
        !losses_agree
            ? fmt::format(
                  "compiled and eager losses differ by {:.2e} relative at step {} (tolerance "
                  "compile.tolerance = {:.0e}); keep the step eager and report the model",
                  worst_loss_difference, worst_loss_step, options.tolerance)
            : fmt::format("compiled and eager parameters differ by {:.2e} relative after {} steps "
                          "(most in {}: {:.2e}; tolerance compile.tolerance = {:.0e})",
                          parameter_diff, eager.step(), parameters.worst_name,
                          parameters.worst_tensor, options.tolerance));
  }
  if (speedup >= options.min_speedup) {
    return finish(true, fmt::format("keep the compiled step: {:.2f}x faster than eager at equal "
                                    "numerics (set compile.backend = \"{}\" for kiln train)",
                                    speedup, backend_name(options.backend)));
  }
  return finish(
      true, fmt::format("stay eager: the compiled step is {:.2f}x eager's speed, under "
                        "compile.min_speedup = {:.2f} (median {:.2f} ms vs {:.2f} ms); "
                        "profile both to see where the time goes",
                        speedup, options.min_speedup, 1e3 * compiled_median, 1e3 * eager_median));
}

}  // namespace kiln
