// The report's sections for the baseline, compile, profile, scale and checkpoint rungs, each from
// its typed result (kiln/results.h): a few focused charts, the measures as a table, and the whole
// result as a key/value dump behind a fold.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "report/sections.h"

namespace kiln::report {

namespace {

template <class T>
void dump(Section& section, const T& result, const std::string& file) {
  section.details("Every number of " + file + " the report reads", flatten(nlohmann::json(result)));
}

std::string step_times(const StepTimes& t) {
  return fmt::format("median {}, p10 {}, p90 {}", seconds_text(t.median), seconds_text(t.p10),
                     seconds_text(t.p90));
}

}  // namespace

void baseline_section(const RunData& run, SectionSink& sink) {
  Section* section = rung_section(run.baseline, sink, "Baseline");
  if (section == nullptr) return;
  const BaselineResult& b = *run.baseline.value;
  section->measures({
      {"throughput", b.tokens_per_second
                         ? fmt::format("{} ({})", throughput_text(*b.tokens_per_second, true),
                                       throughput_text(b.samples_per_second, false))
                         : throughput_text(b.samples_per_second, false)},
      {"step time", step_times(b.step_seconds)},
      {"data wait", percent_text(b.data_wait_share) + " of step time"},
      {"MFU", b.mfu ? fmt::format("{} of {} FLOP/s peak", percent_text(*b.mfu),
                                  short_number(b.peak_flops_per_second.value_or(NAN)))
                    : "n/a: the device has no peak in the hardware catalog"},
      {"MFU of the measured matmul",
       b.mfu_of_matmul_peak && b.matmul_peak
           ? fmt::format("{} of {} FLOP/s ({} GEMM {} x {} x {}, median of {})",
                         percent_text(*b.mfu_of_matmul_peak),
                         short_number(b.matmul_peak->flops_per_second), b.matmul_peak->dtype,
                         b.matmul_peak->m, b.matmul_peak->n, b.matmul_peak->k,
                         b.matmul_peak->repeats)
           : std::string("n/a: not timed (a model whose math names no GEMM: the baseline's "
                         "log says why; or a baseline.json older than the timed matmul)")},
      {"achieved",
       fmt::format("{} FLOP/s ({} FLOP/sample)", short_number(b.achieved_flops_per_second),
                   short_number(b.flops_per_sample))},
      {"peak memory",
       fmt::format("{} ({})", bytes_text(b.peak_allocated_bytes), b.peak_memory_method)},
      {"model state",
       fmt::format("parameters {}, gradients {}, optimizer {}", bytes_text(b.parameters_bytes),
                   bytes_text(b.gradients_bytes), bytes_text(b.optimizer_bytes))},
      {"loss", fmt::format("{} -> {}", number(b.loss_start), number(b.loss_end))},
      {"validation loss",
       fmt::format("{} -> {}", number(b.val_loss_initial), number(b.val_loss_final))},
      {"steps", fmt::format("{} warm-up, {} measured, batch {} x seq {} on {}", b.warmup_steps,
                            b.measured_steps, b.batch_size, b.seq_len, b.device)},
  });
  dump(*section, b, "baseline.json");
}

void compile_section(const RunData& run, SectionSink& sink) {
  Section* section = rung_section(run.compile, sink, "Compile");
  if (section == nullptr) return;
  const CompileResult& c = *run.compile.value;
  if (c.timed) {
    section->chart(Chart{"compile-step-time",
                         "Eager vs compiled step time",
                         true,
                         false,
                         false,
                         "",
                         "seconds",
                         "",
                         {"eager", "compiled"},
                         {{"median", {}, {c.eager.median_seconds, c.compiled.median_seconds}},
                          {"p90", {}, {c.eager.p90_seconds, c.compiled.p90_seconds}}}});
    section->measures({
        {"backend", fmt::format("{} (dynamic = {}, fullgraph = {})", c.backend, c.dynamic,
                                c.fullgraph ? "true" : "false")},
        {"speedup", c.speedup ? fmt::format("{:.2f}x (compile.min_speedup = {})", *c.speedup,
                                            number(c.min_speedup))
                              : "-"},
        {"compile time", fmt::format("{} ({} cache), {} graph(s)", seconds_text(c.compile_seconds),
                                     c.cache, c.graphs)},
        {"numerics", fmt::format("losses max relative difference {:.2e}, parameters {:.2e}; "
                                 "tolerance {:.0e}",
                                 c.max_relative_loss_difference,
                                 c.max_relative_parameter_difference, c.tolerance)},
        {"peak memory", fmt::format("eager {}, compiled {}", bytes_text(c.eager.peak_memory_bytes),
                                    bytes_text(c.compiled.peak_memory_bytes))},
        {"steps", fmt::format("{} warm-up, {} timed, interleaved", c.warmup_steps, c.timed_steps)},
    });
  } else {
    section->paragraph("The compiled step was not timed (the rung stopped at its compile check).");
  }
  dump(*section, c, "compile.json");
}

void profile_section(const RunData& run, SectionSink& sink) {
  Section* section = rung_section(run.profile, sink, "Profile");
  if (section == nullptr) return;
  const ProfileResult& p = *run.profile.value;
  section->bullets("Actions, each naming the key that carries it out", p.actions);
  // profile.json's phase seconds are summed over the profiled steps: the chart shows them per
  // step, as the text beside it does.
  const double profiled = static_cast<double>(std::max<int64_t>(p.steps, 1));
  Chart phases{"profile-phases",
               fmt::format("Where a step's time goes (mean of {} profiled steps)", p.steps),
               true,
               true,
               false,
               "",
               "seconds per step",
               "",
               {"one step"},
               {}};
  for (const auto& phase : p.phases) {
    phases.series.push_back({fmt::format("{} ({})", phase.phase, percent_text(phase.share)),
                             {},
                             {phase.seconds / profiled}});
  }
  if (!phases.series.empty()) section->chart(phases);
  std::vector<std::vector<std::string>> operators;
  for (size_t k = 0; k < p.top_operators.size() && k < 10; ++k) {
    const auto& op = p.top_operators[k];
    operators.push_back({op.name, std::to_string(op.calls), short_number(op.self_cpu_us),
                         short_number(op.total_cpu_us)});
  }
  if (!operators.empty()) {
    section->subsection("Top operators by self time");
    section->grid({"operator", "calls", "self CPU us", "total CPU us"}, operators, -1, "operators");
  }
  std::vector<std::vector<std::string>> memory;
  for (const auto& m : p.memory_by_phase) {
    memory.push_back(
        {m.phase, m.device, bytes_text(m.peak_allocated_bytes), bytes_text(m.growth_bytes)});
  }
  if (!memory.empty()) {
    section->subsection("Peak memory by phase");
    section->grid({"phase", "device", "peak allocated", "growth"}, memory, -1, "memory");
  }
  section->measures(
      {{"captured", fmt::format("{} steps in {} window(s), {} per step on {}", p.steps, p.windows,
                                seconds_text(p.step_seconds_mean), p.device)},
       {"traces",
        fmt::format("{} file(s) in traces/ (Perfetto, TensorBoard, HTA)", p.traces.size())}});
  dump(*section, p, "profile.json");
}

void scale_section(const RunData& run, SectionSink& sink) {
  Section* section = rung_section(run.scale, sink, "Scale");
  if (section == nullptr) return;
  const ScaleResult& s = *run.scale.value;
  const bool tokens = s.global_tokens_per_second.has_value();
  Chart throughput{"scale-throughput",
                   "Throughput per rank",
                   true,
                   false,
                   false,
                   "",
                   tokens ? "tokens/s" : "samples/s",
                   "",
                   {},
                   {}};
  Series rate{tokens ? "tokens/s" : "samples/s", {}, {}};
  // scale.json's phase seconds are summed over the measured steps: shown per step (their sum is
  // about the median step time of the text).
  const double measured = static_cast<double>(std::max<int64_t>(s.measured_steps, 1));
  Chart phases{"scale-phases",
               fmt::format("Each rank's step time: compute and exposed communication (mean of {} "
                           "measured steps)",
                           s.measured_steps),
               true,
               true,
               false,
               "",
               "seconds per step",
               "",
               {},
               {}};
  Series data{"data wait", {}, {}}, forward{"forward", {}, {}}, backward{"backward", {}, {}},
      comm{"exposed communication", {}, {}}, optimizer{"optimizer", {}, {}};
  for (const auto& r : s.per_rank) {
    const std::string name = fmt::format("rank {}", r.rank);
    throughput.categories.push_back(name);
    rate.y.push_back(tokens ? r.tokens_per_second.value_or(NAN) : r.samples_per_second);
    phases.categories.push_back(name);
    data.y.push_back(r.data_wait_seconds / measured);
    forward.y.push_back(r.forward_seconds / measured);
    backward.y.push_back(r.backward_seconds / measured);
    comm.y.push_back(r.comm_exposed_seconds / measured);
    optimizer.y.push_back(r.optimizer_seconds / measured);
  }
  throughput.series = {rate};
  phases.series = {data, forward, backward, comm, optimizer};
  if (!s.per_rank.empty()) {
    section->chart(throughput);
    section->chart(phases);
  }
  const double global = tokens ? *s.global_tokens_per_second : s.global_samples_per_second;
  section->measures({
      {"strategy", s.strategy + (s.strategy_reason.empty() ? "" : ": " + s.strategy_reason)},
      {"processes", fmt::format("{} ({} backend, {})", s.world_size, s.backend, s.device)},
      {"global throughput", throughput_text(global, tokens)},
      {"one process", s.baseline_samples_per_second()
                          ? throughput_text(*s.baseline_samples_per_second(), false)
                          : "- (a world of one)"},
      {"scaling efficiency", s.scaling_efficiency ? percent_text(*s.scaling_efficiency) : "-"},
      {"speedup", s.speedup ? fmt::format("{:.2f}x", *s.speedup) : "-"},
      {"exposed communication", percent_text(s.comm_exposed_share_of_step) + " of the step"},
      {"replicas in sync", yes_no(s.replicas_in_sync)},
  });
  dump(*section, s, "scale.json");
}

void checkpoint_section(const RunData& run, SectionSink& sink) {
  Section* section = rung_section(run.checkpoint, sink, "Checkpoint");
  if (section == nullptr) return;
  const CheckpointResult& c = *run.checkpoint.value;
  auto equal = [](const std::optional<bool>& v) {
    return v ? (*v ? "bitwise equal" : "DIFFER") : "-";
  };
  auto seconds = [](const std::optional<double>& v) { return v ? seconds_text(*v) : "-"; };
  section->measures({
      {"drill", fmt::format("checkpoint at step {} of {}; killed {}", c.drill_steps, c.total_steps,
                            c.killed ? (*c.killed ? "after the commit (SIGKILL)"
                                                  : "no (the run ended first)")
                                     : "-")},
      {"checkpoint", c.checkpoint_bytes ? bytes_text(*c.checkpoint_bytes) : "-"},
      {"losses after resume",
       fmt::format("{} compared, {}", c.losses_compared ? std::to_string(*c.losses_compared) : "-",
                   equal(c.losses_bitwise_equal))},
      {"final parameters", equal(c.parameters_bitwise_equal)},
      {"final optimizer state", equal(c.optimizer_state_bitwise_equal)},
      {"times",
       fmt::format("reference run {}, saving run (to its kill) {}, resumed run {}; whole drill {}",
                   seconds(c.reference_seconds), seconds(c.save_seconds), seconds(c.resume_seconds),
                   seconds(c.seconds))},
  });
  dump(*section, c, "checkpoint.json");
}

}  // namespace kiln::report
