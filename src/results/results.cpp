// Typed rung results (kiln/results.h): one field list per rung file, walked by from_json (ReadIo:
// strict, names the key path of whatever is missing or mistyped) and by to_json (WriteIo).
#include "kiln/results.h"

#include "results/result_reader.h"

namespace kiln {
using namespace result_json;
using nlohmann::json;

// ---- baseline ----------------------------------------------------------------------------------

namespace {
template <class Io>
void baseline_fields(const Io& io, BaselineResult& b) {
  if (!status_fields(io, b.status, "samples_per_second")) {
    io.since(2, "losses", b.losses);  // a stopped baseline keeps the losses it saw
    return;
  }
  io("device", b.device);
  io("warmup_steps", b.warmup_steps);
  io("measured_steps", b.measured_steps);
  io("batch_size", b.batch_size);
  io.since(2, "grad_accum_steps", b.grad_accum_steps);
  io("seq_len", b.seq_len);
  io("samples_per_second", b.samples_per_second);
  io("tokens_per_second", b.tokens_per_second);
  io.object("step_seconds", [&](const Io& t) {
    t("median", b.step_seconds.median);
    t("p10", b.step_seconds.p10);
    t("p90", b.step_seconds.p90);
    t("mean", b.step_seconds.mean);
  });
  io("data_wait_share", b.data_wait_share);
  io.object("peak_memory", [&](const Io& peak) {
    peak("method", b.peak_memory_method);
    peak("allocated_bytes", b.peak_allocated_bytes);
    peak.since(2, "reserved_bytes", b.peak_reserved_bytes);
    peak.since(2, "resident_after_bytes", b.resident_after_bytes);
  });
  io.object("state_bytes", [&](const Io& state) {
    state("parameters", b.parameters_bytes);
    state("gradients", b.gradients_bytes);
    state("optimizer", b.optimizer_bytes);
  });
  io("flops_per_sample", b.flops_per_sample);
  io.since(2, "flops_per_token", b.flops_per_token);
  io("achieved_flops_per_second", b.achieved_flops_per_second);
  io("mfu", b.mfu);
  io("peak_flops_per_second", b.peak_flops_per_second);
  io.since(2, "peak_flops_source", b.peak_flops_source);
  io("loss_start", b.loss_start);
  io("loss_end", b.loss_end);
  io.since(2, "losses", b.losses);
  io("val_loss_initial", b.val_loss_initial);
  io("val_loss_final", b.val_loss_final);
  io.opt("val_accuracy_final", b.val_accuracy_final);
  io.since(2, "skipped_steps", b.skipped_steps);
  io.opt_object("matmul_peak", b.matmul_peak,
                [](const Io& m, MatmulPeakRecord& peak) { matmul_peak_fields(m, peak); });
  io.opt("mfu_of_matmul_peak", b.mfu_of_matmul_peak);
}

// ---- compile -----------------------------------------------------------------------------------

template <class Io>
void compile_side_fields(const Io& io, CompileSide& s) {
  io("median_seconds", s.median_seconds);
  io("p90_seconds", s.p90_seconds);
  io("samples_per_second", s.samples_per_second);
  io("tokens_per_second", s.tokens_per_second);
  io("peak_memory_bytes", s.peak_memory_bytes);
  io.opt("achieved_flops_per_second", s.achieved_flops_per_second);
  io.opt("share_of_matmul_peak", s.share_of_matmul_peak);
}

template <class Io>
void compile_eval_fields(const Io& e, CompileEval& x) {
  e("loss_eager", x.loss_eager);
  e("loss_compiled", x.loss_compiled);
  e("relative_difference", x.relative_difference);
  e("samples", x.samples);
  e.opt("accuracy_eager", x.accuracy_eager);
  e.opt("accuracy_compiled", x.accuracy_compiled);
}

template <class Io>
void compile_probe_step_fields(const Io& x, CompileProbeStep& p) {
  x("recompiled", p.recompiled);
  x("new_graph", p.new_graph);
  x("eager", p.eager);
  x("loss_eager", p.loss_eager);
  x("loss_compiled", p.loss_compiled);
}

template <class Io>
void compile_ddp_side_fields(const Io& x, CompileDdpSide& d) {
  x("comm_exposed_seconds_per_step", d.comm_exposed_seconds_per_step);
  x("comm_busy_seconds_per_step", d.comm_busy_seconds_per_step);
  x("comm_overlapped_share", d.comm_overlapped_share);
  x("collectives_started_in_backward_per_step", d.collectives_started_in_backward_per_step);
}

template <class Io>
void compile_ddp_fields(const Io& x, CompileDdp& d) {
  x("world_size", d.world_size);
  x("backend", d.backend);
  x("bucket_bytes", d.bucket_bytes);
  x.object("eager", [&](const Io& side) { compile_ddp_side_fields(side, d.eager); });
  x.nullable_object("compiled", d.compiled,
                    [](const Io& side, CompileDdpSide& c) { compile_ddp_side_fields(side, c); });
  x("overlap_lost_seconds_per_step", d.overlap_lost_seconds_per_step);
  x("overlap_lost_share_of_compiled_step", d.overlap_lost_share_of_compiled_step);
  x("method", d.method);
}

template <class Io>
void compile_fields(const Io& io, CompileResult& c) {
  if (!status_fields(io, c.status, "backend")) return;
  io("backend", c.backend);
  io.since(2, "precision", c.precision);
  io("dynamic", c.dynamic);
  io("device", c.device);
  io("fullgraph", c.fullgraph);
  io.since(2, "recompile_limit", c.recompile_limit);
  io("world_size", c.world_size);
  io.since(2, "compile", c.compile_report);
  io.opt("capture", c.capture_report);
  io.opt_object("ddp", c.ddp, [](const Io& x, CompileDdp& d) { compile_ddp_fields(x, d); });
  // Once the step compiled: its time and cache; a step that must run eager (graph breaks under
  // compile.fullgraph = false) stops there with a null speedup.
  bool built = c.built || c.timed;  // a timed result compiled
  if constexpr (Io::kReading) built = c.built = io.contains("compile_seconds");
  if (!built) return;
  io("compile_seconds", c.compile_seconds);
  io("cache", c.cache);
  // The rest once both sides were timed.
  if constexpr (Io::kReading) c.timed = io.contains("eager");
  if (!c.timed) {
    io.since(2, "speedup", c.speedup);
    return;
  }
  io("graphs", c.graphs);
  io.since(2, "eval_graphs", c.eval_graphs);
  io.since(2, "graph_breaks", c.graph_breaks);
  io.since(2, "recompiles", c.recompiles);
  io.since(2, "eval_recompiles", c.eval_recompiles);
  io.since_object(2, "eval", [&](const Io& e) {  // {} without a validation batch
    if constexpr (Io::kReading) {
      if (!e.contains("loss_eager")) return;
      c.eval.emplace();
    }
    if (c.eval) compile_eval_fields(e, *c.eval);
  });
  bool has_probe = true;
  if constexpr (Io::kReading) has_probe = io.version() >= 2 || io.contains("probe");
  if (has_probe) {
    io.list("probe", c.probe, [](const Io& x, CompileProbe& p) {
      x("seq_len", p.seq_len);
      compile_probe_step_fields(x, p.train);
      x.opt_object("eval", p.eval,
                   [](const Io& e, CompileProbeStep& step) { compile_probe_step_fields(e, step); });
    });
  }
  io("warmup_steps", c.warmup_steps);
  io("timed_steps", c.timed_steps);
  io.object("eager", [&](const Io& side) { compile_side_fields(side, c.eager); });
  io.object("compiled", [&](const Io& side) { compile_side_fields(side, c.compiled); });
  io.opt("flops_per_sample", c.flops_per_sample);
  io.opt_object("matmul_peak", c.matmul_peak,
                [](const Io& m, MatmulPeakRecord& peak) { matmul_peak_fields(m, peak); });
  io.since(2, "peak_memory_method", c.peak_memory_method);
  io("speedup", c.speedup);
  io("min_speedup", c.min_speedup);
  io.object("numerics", [&](const Io& n) {
    n("tolerance", c.tolerance);
    n("max_relative_loss_difference", c.max_relative_loss_difference);
    n("max_relative_parameter_difference", c.max_relative_parameter_difference);
    n.since(2, "worst_loss_step", c.worst_loss_step);
    n.since(2, "worst_parameter", c.worst_parameter);
    n.since(2, "worst_parameter_relative_difference", c.worst_parameter_relative_difference);
    n.since(2, "max_relative_eval_loss_difference", c.max_relative_eval_loss_difference);
    n.since(2, "worst_eval", c.worst_eval);
    n.since(2, "eager_losses", c.eager_losses);
    n.since(2, "compiled_losses", c.compiled_losses);
  });
}

// ---- profile -----------------------------------------------------------------------------------

template <class Io>
void profile_fields(const Io& io, ProfileResult& p) {
  if (!status_fields(io, p.status, "analysis", /*verdict_inside=*/true)) {
    io.since(2, "losses", p.losses);  // a stopped profile keeps the losses it saw
    return;
  }
  io("device", p.device);
  io.since_object(2, "schedule", [&](const Io& s) {
    s("skip_first", p.schedule.skip_first);
    s("wait", p.schedule.wait);
    s("warmup", p.schedule.warmup);
    s("active", p.schedule.active);
    s("repeat", p.schedule.repeat);
  });
  io.since_object(2, "options", [&](const Io& o) {
    o("record_shapes", p.options.record_shapes);
    o("profile_memory", p.options.profile_memory);
    o("with_stack", p.options.with_stack);
    o("with_flops", p.options.with_flops);
    o("gzip", p.options.gzip);
  });
  io.object("verdict", [&](const Io& v) {
    v("reason", p.status.verdict);
    v("bottleneck", p.bottleneck);
    v("actions", p.actions);
    v.rest(p.verdict_more);
  });
  io.object("analysis", [&](const Io& a) {
    a("windows", p.windows);
    a("steps", p.steps);
    a("step_seconds_mean", p.step_seconds_mean);
    a.list("phases", p.phases, [](const Io& x, ProfilePhase& phase) {
      x("phase", phase.phase);
      x("seconds", phase.seconds);
      x("share", phase.share);
    });
    a.list("top_operators", p.top_operators, [](const Io& x, ProfileOperator& op) {
      x("name", op.name);
      x("calls", op.calls);
      x("self_cpu_us", op.self_cpu_us);
      x("total_cpu_us", op.total_cpu_us);
      x.rest(op.more);
    });
    a.list("memory_by_phase", p.memory_by_phase, [](const Io& x, ProfileMemoryPhase& m) {
      x("phase", m.phase);
      x("device", m.device);
      x("peak_allocated_bytes", m.peak_allocated_bytes);
      x("growth_bytes", m.growth_bytes);
    });
    a.rest(p.analysis_more);
  });
  io("traces", p.traces);
  io.since(2, "losses", p.losses);
  bool has_problems = !p.problems.empty();
  if constexpr (Io::kReading) has_problems = io.contains("problems");
  if (has_problems) io("problems", p.problems);
}

// ---- scale -------------------------------------------------------------------------------------

template <class Io>
void scale_memory_fields(const Io& x, ScaleRankMemory& m) {
  x("strategy", m.strategy);
  x("parameters", m.parameters);
  x("gradients", m.gradients);
  x("optimizer_state", m.optimizer_state);
  x("model_state", m.model_state);
  x("gathered_parameters_peak", m.gathered_parameters_peak);
  x("largest_gathered_unit", m.largest_gathered_unit);
  x("activations", m.activations);
  x("step_peak_above_start", m.step_peak_above_start);
  x("peak", m.peak);
  x.object("model_state_by_strategy", [&](const Io& both) {
    both("ddp", m.model_state_ddp);
    both("fsdp", m.model_state_fsdp);
  });
  x("method", m.method);
}

template <class Io>
void scale_rank_fields(const Io& x, ScaleRank& k) {
  x("rank", k.rank);
  x.since(2, "local_rank", k.local_rank);
  x.since(2, "samples", k.samples);
  x("seconds", k.seconds);
  x.since(2, "cpu_seconds", k.cpu_seconds);
  x("samples_per_second", k.samples_per_second);
  x.opt("tokens_per_second", k.tokens_per_second);
  x.since_object(2, "step_seconds", [&](const Io& step) {
    step("median", k.step_median);
    step("p10", k.step_p10);
    step("p90", k.step_p90);
  });
  x("compute_seconds", k.compute_seconds);
  x.object("phase_seconds", [&](const Io& phase) {
    phase("data_wait", k.data_wait_seconds);
    phase("forward", k.forward_seconds);
    phase("backward", k.backward_seconds);
    phase("comm_exposed", k.comm_exposed_seconds);
    phase("optimizer", k.optimizer_seconds);
  });
  x.object("comm", [&](const Io& comm) {
    comm("busy_seconds", k.comm_busy_seconds);
    comm.since(2, "collectives", k.comm_collectives);
    double bytes = static_cast<double>(k.comm_bytes);  // the communicator counts in a double
    comm.since(2, "bytes", bytes);
    k.comm_bytes = static_cast<int64_t>(bytes);
    comm.since(2, "blocked_seconds", k.comm_blocked_seconds);
  });
  x.since(2, "comm_overlapped_share", k.comm_overlapped_share);
  x.opt_object("memory", k.memory,
               [](const Io& m, ScaleRankMemory& memory) { scale_memory_fields(m, memory); });
}

template <class Io>
void scale_fields(const Io& io, ScaleResult& s) {
  // Written by the launching process beside the ranks' file (or alone, when torchrun failed).
  io.opt("ranks_run_dir", s.ranks_run_dir);
  io.opt("torchrun_status", s.torchrun_status);
  if (!status_fields(io, s.status, "per_rank")) return;
  io("world_size", s.world_size);
  io("strategy", s.strategy);
  io("strategy_reason", s.strategy_reason);
  io.since(2, "strategy_decision", s.strategy_decision);
  io("backend", s.backend);
  io("device", s.device);
  io.since(2, "threads_per_process", s.threads_per_process);
  io.since(2, "batch_size_per_process", s.batch_size_per_process);
  io.since(2, "grad_accum_steps", s.grad_accum_steps);
  io.since(2, "global_batch_samples", s.global_batch_samples);
  io.since(2, "seq_len", s.seq_len);
  io.since(2, "warmup_steps", s.warmup_steps);
  io.since(2, "measured_steps", s.measured_steps);
  io.since_object(2, "bucket_cap_bytes", [&](const Io& b) {
    b("first", s.first_bucket_cap_bytes);
    b("other", s.bucket_cap_bytes);
  });
  io.object("global", [&](const Io& g) {
    g("samples_per_second", s.global_samples_per_second);
    g("tokens_per_second", s.global_tokens_per_second);
    g("median_step_seconds", s.median_step_seconds);
    g.since(2, "compute_seconds_per_step", s.compute_seconds_per_step);
    g.since(2, "comm_busy_seconds_per_step", s.comm_busy_seconds_per_step);
    g.since(2, "comm_exposed_seconds_per_step", s.comm_exposed_seconds_per_step);
    g("comm_exposed_share_of_step", s.comm_exposed_share_of_step);
  });
  io.nullable_object("baseline", s.baseline, [](const Io& b, ScaleBaseline& base) {
    b("samples_per_second", base.samples_per_second);
    b.since(2, "method", base.method);
    b.since(2, "median_step_seconds", base.median_step_seconds);
    b.since(2, "steps", base.steps);
    b.since(2, "note", base.note);
  });
  io("scaling_efficiency", s.scaling_efficiency);
  io("speedup", s.speedup);
  io("replicas_in_sync", s.replicas_in_sync);
  io.since(2, "weights_hash", s.weights_hash);
  io.since(2, "losses", s.losses);
  io.list("per_rank", s.per_rank, [](const Io& x, ScaleRank& k) { scale_rank_fields(x, k); });
  io.since(2, "table", s.table);
}

}  // namespace

KILN_RESULT_FIELDS(BaselineResult, baseline_fields)
KILN_RESULT_FIELDS(CompileResult, compile_fields)
KILN_RESULT_FIELDS(ProfileResult, profile_fields)
KILN_RESULT_FIELDS(ScaleResult, scale_fields)
KILN_RESULT_FIELDS(ScaleRank, scale_rank_fields)

std::optional<double> ScaleResult::baseline_samples_per_second() const {
  if (!baseline) return std::nullopt;
  return baseline->samples_per_second;
}

}  // namespace kiln
