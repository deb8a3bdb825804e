// The compile rung's table and verdict (rungs/compile_parts.h), rendered from its typed result
// (compile.json, kiln/results.h) and the compiler's report (its graphs' shapes and cache state).
#include <fmt/format.h>

#include <algorithm>

#include "core/strings.h"
#include "rungs/compile_parts.h"

namespace kiln::compile_rung {

std::string ddp_overlap_text(const CompileDdp& ddp) {
  const std::string eager_row =
      fmt::format("{} ranks ({}): all-reduce exposed per step eager {:.2f} ms of {:.2f} ms busy",
                  ddp.world_size, ddp.backend, 1e3 * ddp.eager.comm_exposed_seconds_per_step,
                  1e3 * ddp.eager.comm_busy_seconds_per_step);
  if (!ddp.compiled) {
    return fmt::format(
        "{}; the captured step replays its all-reduces inside the CUDA graph (not measured)",
        eager_row);
  }
  const CompileDdpSide& c = *ddp.compiled;
  return fmt::format(
      "{} ({:.0f}% overlapped, {:.1f} bucket(s) started in backward), compiled {:.2f} ms of "
      "{:.2f} ms ({:.0f}% overlapped, {:.1f} in backward); overlap lost {:.2f} ms per step",
      eager_row, 100 * ddp.eager.comm_overlapped_share,
      ddp.eager.collectives_started_in_backward_per_step, 1e3 * c.comm_exposed_seconds_per_step,
      1e3 * c.comm_busy_seconds_per_step, 100 * c.comm_overlapped_share,
      c.collectives_started_in_backward_per_step,
      1e3 * ddp.overlap_lost_seconds_per_step.value_or(0.0));
}

namespace {

std::string compile_graph_text(const std::vector<CompileReport::Graph>& list) {
  std::string text;
  for (const auto& g : list) {
    if (!text.empty()) text += "; ";
    text += fmt::format("{}: {}", g.shape.str(),
                        g.cache_hit ? fmt::format("cached (load {:.2f} s)", g.load_seconds)
                                    : fmt::format("built in {:.1f} s", g.build_seconds));
  }
  return text;
}

std::string compile_recompile_text(const std::vector<Recompile>& list, int64_t limit) {
  int64_t count = 0;
  std::string text;
  for (const Recompile& r : list) {
    count += r.compiled ? 1 : 0;
    text += fmt::format("; {}{}", r.reason, r.compiled ? "" : " [eager]");
  }
  return fmt::format("{} (limit {}){}", count, limit, text);
}

std::string compile_time_text(const CompileSide& side) {
  std::string rate;
  if (side.achieved_flops_per_second) {
    rate = fmt::format(", {:.3g} FLOP/s", *side.achieved_flops_per_second);
    if (side.share_of_matmul_peak)
      rate += fmt::format(" ({:.1f}% of the measured matmul)", 100 * *side.share_of_matmul_peak);
  }
  return fmt::format(
      "median {:.2f} ms, p90 {:.2f} ms, {}{}", 1e3 * side.median_seconds, 1e3 * side.p90_seconds,
      side.tokens_per_second ? fmt::format("{:.0f} tokens/s", *side.tokens_per_second)
                             : fmt::format("{:.0f} samples/s", side.samples_per_second),
      rate);
}

}  // namespace

ResultRows compile_table(const CompileResult& r, const CompileReport& report,
                         const CompileReport* eval_report, const CompileOptions& options) {
  ResultRows t;
  t.emplace_back("backend", fmt::format("{} (dynamic = {}, fullgraph = {}, precision {})",
                                        r.backend, r.dynamic, r.fullgraph, r.precision));
  t.emplace_back("compile time", fmt::format("{:.1f} s, {} cache", r.compile_seconds,
                                             r.cache == "cold" ? "cold" : "warm"));
  if (report.granularity == "unit") {
    std::string text;
    bool root = false;  // the root's pieces compiled (compile.root), listed with the units
    for (const auto& u : report.unit_graphs) {
      root = root || u.unit.starts_with("root.");
      text += fmt::format("{}{} {} ({})", text.empty() ? "" : "; ", u.unit, u.input,
                          u.eager       ? "eager: graph breaks"
                          : u.shared    ? "shares an earlier unit's pair"
                          : u.cache_hit ? "cached pair"
                                        : fmt::format("built in {:.1f} s", u.build_seconds));
    }
    t.emplace_back("graphs", fmt::format("per unit, {} call(s) compiled, root {}: {}",
                                         report.compiled_unit_forwards, root ? "compiled" : "eager",
                                         text.empty() ? std::string("none") : text));
  } else {
    t.emplace_back("graphs",
                   fmt::format("{}: {}", report.graphs.size(), compile_graph_text(report.graphs)));
  }
  if (eval_report) {
    const auto& eval_graphs = eval_report->eval_graphs;
    t.emplace_back("eval graphs",
                   fmt::format("{}: {}", eval_graphs.size(),
                               eval_graphs.empty() ? std::string("none (eager)")
                                                   : compile_graph_text(eval_graphs)));
  }
  // Graph breaks stop the rung (fullgraph = true) or make it run eager and return early
  // (fullgraph = false): here the step compiled whole; the line says which setting that ran under.
  t.emplace_back("graph breaks",
                 !report.breaks.empty() ? describe_breaks(report.breaks)
                 : r.fullgraph
                     ? std::string("none (compile.fullgraph = true: a break would stop the rung)")
                     : std::string("none found (compile.fullgraph = false: a break would have "
                                   "run the step eager)"));
  t.emplace_back("recompiles", compile_recompile_text(report.recompiles, r.recompile_limit));
  if (eval_report) {
    t.emplace_back("eval recompiles",
                   compile_recompile_text(eval_report->eval_recompiles, r.recompile_limit));
  }
  t.emplace_back("eager step", compile_time_text(r.eager));
  t.emplace_back("compiled step", compile_time_text(r.compiled));
  t.emplace_back("speedup", fmt::format("{:.2f}x (eager median / compiled median, {} interleaved "
                                        "steps after {} warm-up)",
                                        r.speedup.value_or(0.0), r.timed_steps, r.warmup_steps));
  t.emplace_back("numerics",
                 fmt::format("losses max rel diff {:.2e}, parameters {:.2e} (most in {}: {:.2e}), "
                             "eval losses {:.2e}; tolerance {:.0e}{}",
                             r.max_relative_loss_difference, r.max_relative_parameter_difference,
                             r.worst_parameter, r.worst_parameter_relative_difference,
                             r.max_relative_eval_loss_difference, r.tolerance,
                             options.tolerance_configured ? std::string(" (compile.tolerance)")
                                                          : " (" + r.precision + "'s default)"));
  if (r.ddp) t.emplace_back("DDP overlap", ddp_overlap_text(*r.ddp));
  t.emplace_back("peak memory",
                 fmt::format("eager {}, compiled {} ({})", format_bytes(r.eager.peak_memory_bytes),
                             format_bytes(r.compiled.peak_memory_bytes), r.peak_memory_method));
  return t;
}

std::pair<bool, std::string> compile_verdict(const CompileResult& r, int64_t steps) {
  const bool losses_agree = r.max_relative_loss_difference <= r.tolerance;
  const bool parameters_agree = r.max_relative_parameter_difference <= r.tolerance;
  const bool evals_agree = r.max_relative_eval_loss_difference <= r.tolerance;
  if (losses_agree && parameters_agree && !evals_agree) {
    return {false, fmt::format("compiled and eager eval losses differ by {:.2e} relative on {} "
                               "(tolerance compile.tolerance = {:.0e}); keep evaluation eager and "
                               "report the model",
                               r.max_relative_eval_loss_difference, r.worst_eval, r.tolerance)};
  }
  if (!losses_agree) {
    return {false, fmt::format("compiled and eager losses differ by {:.2e} relative at step {} "
                               "(tolerance compile.tolerance = {:.0e}); keep the step eager and "
                               "report the model",
                               r.max_relative_loss_difference, r.worst_loss_step, r.tolerance)};
  }
  if (!parameters_agree) {
    return {false, fmt::format("compiled and eager parameters differ by {:.2e} relative after {} "
                               "steps (most in {}: {:.2e}; tolerance compile.tolerance = {:.0e})",
                               r.max_relative_parameter_difference, steps, r.worst_parameter,
                               r.worst_parameter_relative_difference, r.tolerance)};
  }
  const double speedup = r.speedup.value_or(0.0);
  if (speedup >= r.min_speedup) {
    return {true, fmt::format("keep the compiled step: {:.2f}x faster than eager at equal "
                              "numerics (set compile.backend = \"{}\" for kiln train)",
                              speedup, r.backend)};
  }
  return {true, fmt::format("stay eager: the compiled step is {:.2f}x eager's speed, under "
                            "compile.min_speedup = {:.2f} (median {:.2f} ms vs {:.2f} ms); "
                            "profile both to see where the time goes",
                            speedup, r.min_speedup, 1e3 * r.compiled.median_seconds,
                            1e3 * r.eager.median_seconds)};
}

}  // namespace kiln::compile_rung
