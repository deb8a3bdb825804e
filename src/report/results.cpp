// Typed rung results (kiln/results.h): one field list per rung file, walked by from_json (ReadIo:
// strict, names the key path of whatever is missing or mistyped) and by to_json (WriteIo).
#include "kiln/results.h"

#include "report/result_reader.h"

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
}

// ---- compile -----------------------------------------------------------------------------------

template <class Io>
void compile_side_fields(const Io& io, CompileSide& s) {
  io("median_seconds", s.median_seconds);
  io("p90_seconds", s.p90_seconds);
  io("samples_per_second", s.samples_per_second);
  io("tokens_per_second", s.tokens_per_second);
  io("peak_memory_bytes", s.peak_memory_bytes);
}

template <class Io>
void compile_fields(const Io& io, CompileResult& c) {
  if (!status_fields(io, c.status, "backend")) return;
  io("backend", c.backend);
  io("dynamic", c.dynamic);
  io("device", c.device);
  io("fullgraph", c.fullgraph);
  io("world_size", c.world_size);
  // The rest once both sides were timed: a compile that failed before has no "eager".
  if constexpr (Io::kReading) c.timed = io.contains("eager");
  if (!c.timed) return;
  io("compile_seconds", c.compile_seconds);
  io("cache", c.cache);
  io("graphs", c.graphs);
  io("warmup_steps", c.warmup_steps);
  io("timed_steps", c.timed_steps);
  io.object("eager", [&](const Io& side) { compile_side_fields(side, c.eager); });
  io.object("compiled", [&](const Io& side) { compile_side_fields(side, c.compiled); });
  io("speedup", c.speedup);
  io("min_speedup", c.min_speedup);
  io.object("numerics", [&](const Io& n) {
    n("tolerance", c.tolerance);
    n("max_relative_loss_difference", c.max_relative_loss_difference);
    n("max_relative_parameter_difference", c.max_relative_parameter_difference);
  });
}

// ---- profile -----------------------------------------------------------------------------------

template <class Io>
void profile_fields(const Io& io, ProfileResult& p) {
  if (!status_fields(io, p.status, "analysis", /*verdict_inside=*/true)) return;
  io("device", p.device);
  io.object("verdict", [&](const Io& v) {
    v("reason", p.status.verdict);
    v("bottleneck", p.bottleneck);
    v("actions", p.actions);
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
    });
    a.list("memory_by_phase", p.memory_by_phase, [](const Io& x, ProfileMemoryPhase& m) {
      x("phase", m.phase);
      x("device", m.device);
      x("peak_allocated_bytes", m.peak_allocated_bytes);
      x("growth_bytes", m.growth_bytes);
    });
  });
  io("traces", p.traces);
}

// ---- scale -------------------------------------------------------------------------------------

template <class Io>
void scale_rank_fields(const Io& x, ScaleRank& k) {
  x("rank", k.rank);
  x("seconds", k.seconds);
  x("samples_per_second", k.samples_per_second);
  x.opt("tokens_per_second", k.tokens_per_second);
  x("compute_seconds", k.compute_seconds);
  x.object("phase_seconds", [&](const Io& phase) {
    phase("data_wait", k.data_wait_seconds);
    phase("forward", k.forward_seconds);
    phase("backward", k.backward_seconds);
    phase("comm_exposed", k.comm_exposed_seconds);
    phase("optimizer", k.optimizer_seconds);
  });
  x.object("comm", [&](const Io& comm) { comm("busy_seconds", k.comm_busy_seconds); });
}

template <class Io>
void scale_fields(const Io& io, ScaleResult& s) {
  if (!status_fields(io, s.status, "per_rank")) return;
  io("world_size", s.world_size);
  io("strategy", s.strategy);
  io("strategy_reason", s.strategy_reason);
  io("backend", s.backend);
  io("device", s.device);
  io.object("global", [&](const Io& g) {
    g("samples_per_second", s.global_samples_per_second);
    g("tokens_per_second", s.global_tokens_per_second);
    g("median_step_seconds", s.median_step_seconds);
    g("comm_exposed_share_of_step", s.comm_exposed_share_of_step);
  });
  std::optional<double> baseline = s.baseline_samples_per_second;
  io.nullable_object("baseline", baseline,
                     [](const Io& b, double& samples) { b("samples_per_second", samples); });
  s.baseline_samples_per_second = baseline;
  io("scaling_efficiency", s.scaling_efficiency);
  io("speedup", s.speedup);
  io("replicas_in_sync", s.replicas_in_sync);
  io.list("per_rank", s.per_rank, [](const Io& x, ScaleRank& k) { scale_rank_fields(x, k); });
}

}  // namespace

KILN_RESULT_FIELDS(BaselineResult, baseline_fields)
KILN_RESULT_FIELDS(CompileResult, compile_fields)
KILN_RESULT_FIELDS(ProfileResult, profile_fields)
KILN_RESULT_FIELDS(ScaleResult, scale_fields)

}  // namespace kiln
