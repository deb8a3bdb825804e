// Typed rung results (kiln/results.h), continued: checkpoint, pilot, plan, the manifest, metrics
// records, and reading a file (read_result).
#include <fmt/format.h>

#include <cmath>

#include "core/files.h"
#include "core/strategy_text.h"
#include "core/strings.h"
#include "kiln/results.h"
#include "results/result_reader.h"

namespace kiln {
using namespace result_json;
using nlohmann::json;

namespace {

// ---- checkpoint --------------------------------------------------------------------------------

template <class Io>
void checkpoint_fields(const Io& io, CheckpointResult& c) {
  if (!status_fields(io, c.status, "drill_steps")) return;
  io("drill_steps", c.drill_steps);
  io("total_steps", c.total_steps);
  io.since(2, "directory", c.directory);
  // Each stage's figures once the drill reached it.
  io.opt("reference_seconds", c.reference_seconds);
  io.opt("killed", c.killed);
  io.opt("killed_exit_status", c.killed_exit_status);
  io.opt("save_seconds", c.save_seconds);
  io.opt("verify_ok", c.verify_ok);
  io.opt("checkpoint_bytes", c.checkpoint_bytes);
  io.opt("resume_epoch", c.resume_epoch);
  io.opt("resume_batch_in_epoch", c.resume_batch_in_epoch);
  io.opt("resume_seconds", c.resume_seconds);
  io.opt("losses_compared", c.losses_compared);
  io.opt("losses_bitwise_equal", c.losses_bitwise_equal);
  io.opt("max_abs_loss_difference", c.max_abs_loss_difference);
  io.opt("parameters_bitwise_equal", c.parameters_bitwise_equal);
  io.opt("optimizer_state_bitwise_equal", c.optimizer_state_bitwise_equal);
  io.opt("seconds", c.seconds);
}

// ---- pilot -------------------------------------------------------------------------------------

template <class Io>
void pilot_restore_fields(const Io& restore, PilotRestore& r) {
  restore("passed", r.passed);
  restore("seconds", r.seconds);
  restore("step", r.step);
  restore("exit_status", r.exit_status);
  restore("loss_bitwise_equal", r.loss_bitwise_equal);
  restore("differing_tensors", r.differing_tensors);
  restore.since(2, "world_size", r.world_size);
  restore.since(2, "tolerance", r.tolerance);
  restore.since(2, "recovery_seconds", r.recovery_seconds);
  restore.opt("exit_status_by_rank", r.exit_status_by_rank);
  restore.opt("loss_here", r.loss_here);
  restore.opt("loss_restored", r.loss_restored);
  restore.opt("loss_equal", r.loss_equal);
}

template <class Io>
void pilot_fields(const Io& io, PilotResult& p) {
  if (!status_fields(io, p.status, "memory")) return;
  io("job_hash", p.job_hash);
  io("config_hash", p.config_hash);
  io("device", p.device);
  io("device_name", p.device_name);
  io("world_size", p.world_size);
  io("steps", p.steps);
  io.object("shape", [&](const Io& shape) {
    shape("micro_batch", p.micro_batch);
    shape("seq_len", p.seq_len);
    shape("grad_accum_steps", p.grad_accum_steps);
    shape("precision", p.precision);
  });
  io.since(2, "compile_backend", p.compile_backend);
  io("step_seconds", p.step_seconds);
  io("loss", p.loss);
  io.since(2, "flops_per_step", p.flops_per_step);
  io.since(2, "peak_flops_per_second", p.peak_flops_per_second);
  io("mfu", p.mfu);
  io.since_object(2, "matmul_peak", [&](const Io& m) { matmul_peak_fields(m, p.matmul_peak); });
  io.since(2, "mfu_of_matmul_peak", p.mfu_of_matmul_peak);
  io("eval_seconds", p.eval_seconds);
  io("val_loss", p.val_loss);
  io("wall_seconds", p.wall_seconds);
  io.object("checkpoint", [&](const Io& ckpt) {
    ckpt("bytes", p.checkpoint_bytes);
    ckpt("save_seconds", p.save_seconds);
    ckpt("write_bytes_per_second", p.write_bytes_per_second);
    ckpt.opt("async", p.checkpoint_async);
    ckpt.opt("save_blocking_seconds", p.save_blocking_seconds);
    ckpt.opt("save_end_wait_seconds", p.save_end_wait_seconds);
  });
  io.opt_object("step_timing", p.step_timing, [](const Io& x, PilotStepTiming& t) {
    x("method", t.method);
    x("steps", t.steps);
    x("step_seconds", t.step_seconds);
    x("first_step_seconds", t.first_step_seconds);
    x("memory_step_seconds", t.memory_step_seconds);
  });
  io.object("memory", [&](const Io& memory) {
    memory("method", p.memory_method);
    memory.object("estimate", [&](const Io& est) {
      est("parameters_bytes", p.estimated.parameters);
      est("gradients_bytes", p.estimated.gradients);
      est("optimizer_bytes", p.estimated.optimizer);
      est("activations_bytes", p.estimated_activations_bytes);
      est("logits_bytes", p.estimated_logits_bytes);
      est.rest(p.estimate_more);
    });
    if constexpr (Io::kReading) {
      p.estimated.activations_and_logits = p.estimated_activations_bytes + p.estimated_logits_bytes;
    }
    memory("estimate_step_peak_bytes", p.estimated.step_peak);
    memory.object("measured", [&](const Io& meas) {
      meas("parameters_bytes", p.measured.parameters);
      meas("gradients_bytes", p.measured.gradients);
      meas("optimizer_bytes", p.measured.optimizer);
      meas("activations_and_logits_bytes", p.measured.activations_and_logits);
      meas("peak_bytes", p.measured.step_peak);
      meas.since(2, "held_gradient_bytes", p.measured_held_gradient_bytes);
      meas.since(2, "step_peak_above_state_bytes", p.measured_step_peak_above_state_bytes);
      meas.since(2, "process_peak_rss_bytes", p.measured_process_peak_rss_bytes);
      meas.since(2, "reserved_bytes", p.measured_reserved_bytes);
    });
    bool has_parts = true;
    if constexpr (Io::kReading) has_parts = memory.version() >= 2 || memory.contains("parts");
    if (has_parts) {
      memory.list("parts", p.memory_parts, [](const Io& x, PilotMemoryPart& part) {
        x("part", part.part);
        x("measured_bytes", part.measured_bytes);
        x("estimated_bytes", part.estimated_bytes);
      });
    }
    memory.since(2, "differs_most", p.memory_differs_most);
    memory("measured_over_estimate", p.measured_over_estimate);
    memory.since(2, "activation_ratio", p.activation_ratio);
    memory("within_allowed_error", p.within_allowed_error);
  });
  io.object("restore", [&](const Io& restore) { pilot_restore_fields(restore, p.restore); });
}

// ---- strategy.json ------------------------------------------------------------------------------
template <class Io>
void strategy_record_fields(const Io& io, StrategyRecord& r) {
  io("strategy", r.strategy);
  io("reason", r.reason);
  io("world_size", r.world_size);
  io.object("mesh", [&](const Io& m) {
    m("dp_replicate", r.dp_replicate);
    m("dp_shard", r.dp_shard);
    m("tp", r.tp);
  });
  io("decision", r.decision);
}

// ---- plan --------------------------------------------------------------------------------------
// The keys read before the plan was written through PlanResult are required; the rest ("added")
// came into plan.json over time without a schema version: an older file may lack them.

template <class Io>
void reservation_fields(const Io& io, PlanReservation& r) {
  io("fits", r.fits);
  io.opt("price_per_gpu_hour", r.price_per_gpu_hour);
  io("cost", r.cost);
}

template <class Io>
void plan_host_fields(const Io& h, PlanHost& host) {
  h.added("staging_bytes_per_node", host.staging_bytes_per_node);
  h.added("loader_bytes_per_node", host.loader_bytes_per_node);
  h.added("host_bytes_per_node", host.host_bytes_per_node);
  h.added("host_memory_bytes", host.host_memory_bytes);
  h.added("host_fits", host.host_fits);
  h.added("storage_bytes", host.storage_bytes);
  h.added("storage_limit_bytes", host.storage_limit_bytes);
  h.added("storage_fits", host.storage_fits);
  h.added("warnings", host.warnings);
}

template <class Io>
void plan_row_fields(const Io& x, PlanRow& row) {
  x("hardware", row.hardware);
  x("display_name", row.display_name);
  x("gpus", row.gpus);
  x("fits_memory", row.fits_memory);
  x.object("strategy", [&](const Io& s) {
    s("strategy", row.strategy);
    s("fsdp_degree", row.fsdp_degree);
    s.or_default("tp_degree", row.tp_degree, int64_t{1});
    s.added("communication_seconds", row.strategy_communication_seconds);
    s("ddp_bytes_per_device", row.ddp_bytes_per_device);
    s("fsdp_bytes_per_device", row.fsdp_bytes_per_device);
    s("usable_bytes", row.usable_bytes);
    s("reason", row.strategy_reason);
  });
  x.added("peak_flops_per_gpu", row.peak_flops_per_gpu);
  x.added("peak_flops_source", row.peak_flops_source);
  x.added("catalog_peak_flops_per_gpu", row.catalog_peak_flops_per_gpu);
  x.added_object("host", [&](const Io& h) { plan_host_fields(h, row.host); });
  x("mfu", row.mfu);
  x("mfu_source", row.mfu_source);
  x("step_seconds", row.step_seconds);
  x("compute_seconds_per_step", row.compute_seconds_per_step);
  x("communication_seconds_per_step", row.communication_seconds_per_step);
  x.added("train_seconds", row.train_seconds);
  x.added("eval_seconds", row.eval_seconds);
  x.added("save_seconds", row.save_seconds);
  x.added("full_save_seconds", row.full_save_seconds);
  x.added("save_stall_source", row.save_stall_source);
  x.added("write_bytes_per_second", row.write_bytes_per_second);
  x.added("restart_seconds", row.restart_seconds);
  x.added("recovery_seconds", row.recovery_seconds);
  x.added("recovery_source", row.recovery_source);
  x("checkpoint_interval_seconds", row.checkpoint_interval_seconds);
  x.added("young_interval_seconds", row.young_interval_seconds);
  x.added("saves_seconds", row.saves_seconds);
  x.added("job_mtbf_seconds", row.job_mtbf_seconds);
  x("expected_failures", row.expected_failures);
  x.added("lost_seconds", row.lost_seconds);
  x.added("drills_seconds", row.drills_seconds);
  x.added("pilot_seconds", row.pilot_seconds);
  x.added("margin_seconds", row.margin_seconds);
  x.added("wall_seconds", row.wall_seconds);
  x("wall_days", row.wall_days);
  x("ettr", row.ettr);
  x.object("reservation_7d", [&](const Io& r) { reservation_fields(r, row.reservation_7d); });
  x.object("reservation_30d", [&](const Io& r) { reservation_fields(r, row.reservation_30d); });
}

template <class Io>
void plan_memory_fields(const Io& m, PlanMemory& memory) {
  m.added_object("estimate", [&](const Io& e) {
    PlanMemoryEstimate& x = memory.estimate;
    e.added("parameters_bytes", x.parameters_bytes);
    e.added("gradients_bytes", x.gradients_bytes);
    e.added("optimizer_bytes", x.optimizer_bytes);
    e.added("activations_bytes", x.activations_bytes);
    e.added("logits_bytes", x.logits_bytes);
    e.added("backward_extra_bytes", x.backward_extra_bytes);
    e.added("autocast_copies_bytes", x.autocast_copies_bytes);
    e.added("communication_bytes", x.communication_bytes);
    e.added("gradients_after_step_bytes", x.gradients_after_step_bytes);
    e.added("gradients_held_across_micro_batches", x.gradients_held_across_micro_batches);
    e.added("peak_at", x.peak_at);
    e.added("step_peak_bytes", x.step_peak_bytes);
    e.added("total_bytes", x.total_bytes);
  });
  m.added("state_bytes_per_parameter", memory.state_bytes_per_parameter);
  m.added("activation_calibration", memory.activation_calibration);
}

template <class Io>
void plan_fields(const Io& io, PlanResult& p) {
  io("recommendation_text", p.recommendation_text);
  if constexpr (Io::kReading) {
    // plan.json had no passed/verdict before the ladder ran the plan: advice that passed.
    p.status.schema_version = io.version();
    std::optional<bool> passed;
    std::optional<std::string> verdict;
    io.opt("passed", passed);
    io.opt("verdict", verdict);
    p.status.passed = passed.value_or(true);
    p.status.verdict = verdict.value_or(p.recommendation_text);
  } else {
    status_fields(io, p.status, "rows");
  }
  io("config", p.config);
  io.added("job_hash", p.job_hash);
  io("pilot", p.pilot);
  io.object("model", [&](const Io& model) {
    model("architecture", p.architecture);
    model("parameters", p.parameters);
    model.added("largest_unit_parameters", p.largest_unit_parameters);
    model("flops_per_token", p.flops_per_token);
  });
  io.object("job", [&](const Io& job) {
    job("micro_batch", p.micro_batch);
    job("seq_len", p.seq_len);
    job("grad_accum_steps", p.grad_accum_steps);
    job("gpus", p.gpus);
    job("precision", p.precision);
    job("optimizer", p.optimizer);
    job.added("activation_checkpointing", p.activation_checkpointing);
    job("tokens", p.tokens);
    job("tokens_per_step", p.tokens_per_step);
    job("steps", p.steps);
    job.added("evals", p.evals);
  });
  io.added_object("memory_per_device",
                  [&](const Io& memory) { plan_memory_fields(memory, p.memory_per_device); });
  io.object("checkpoint", [&](const Io& ckpt) {
    ckpt("bytes", p.checkpoint_bytes);
    ckpt.added("assumed_write_bytes_per_second", p.assumed_write_bytes_per_second);
    ckpt.added("pilot_write_bytes_per_second", p.pilot_write_bytes_per_second);
  });
  io("assumptions", p.assumptions);
  io.added("warnings", p.warnings);
  io.list("rows", p.rows, [](const Io& x, PlanRow& row) { plan_row_fields(x, row); });
  io.nullable_object("recommendation", p.recommendation, [](const Io& r, PlanRecommendation& rec) {
    r("hardware", rec.hardware);
    r("reservation_days", rec.reservation_days);
    r.opt("cost", rec.cost);
    r.opt("reservation_needed", rec.reservation_needed);
  });
}

// ---- manifest.json: what the report shows of it -------------------------------------------------

template <class Io>
void identity_fields(const Io& io, RunIdentity& m) {
  io.object("kiln", [&](const Io& kiln) {
    kiln("version", m.kiln_version);
    kiln("git_commit", m.git_commit);
    kiln.or_default("git_dirty", m.git_dirty, false);
  });
  io.object("libtorch", [&](const Io& libtorch) { libtorch("version", m.libtorch_version); });
  io.object("config", [&](const Io& config) {
    config.or_default("file", m.config_file, std::string());
    config("hash_xxh64", m.config_hash);
  });
  const auto data = [&](const Io& d) {
    d.or_default("kind", m.data_kind, std::string());
    if (Io::kReading || !m.data_content_hash.empty())  // written only when the kind has one
      d.or_default("content_xxh3", m.data_content_hash, std::string());
    d.opt("revision", m.data_revision);
  };
  if (!Io::kReading || io.has("data")) io.object("data", data);
  io.object("model", [&](const Io& model) {
    model("architecture", m.model_architecture);
    model("parameter_count", m.model_parameters);
  });
  io("device", m.device);
  io.or_default("world_size", m.world_size, int64_t{1});
  io.or_default("command_line", m.command_line, std::string());
  io.or_default("start_time_utc", m.start_time_utc, std::string());
}

// ---- metrics.jsonl records ----------------------------------------------------------------------

/// kiln train's progress against the plan (src/rungs/plan_tracking.h writes it through this list).
template <class Io>
void plan_progress_fields(const Io& io, PlanProgress& p) {
  io.opt("tokens_per_second", p.tokens_per_second);
  io.opt("tokens_per_second_forecast", p.tokens_per_second_forecast);
  io.opt("tokens_per_second_vs_plan", p.tokens_per_second_vs_plan);
  io("elapsed_seconds", p.elapsed_seconds);
  io("step_seconds", p.step_seconds);
  io("checkpoint_seconds", p.checkpoint_seconds);
  io("productive_seconds", p.productive_seconds);
  io("ettr", p.ettr);
  io.opt("ettr_forecast", p.ettr_forecast);
  io("eta_seconds", p.eta_seconds);
  io.opt("wall_seconds_forecast", p.wall_seconds_forecast);
  io("final", p.final);
}

template <class Io>
void metrics_fields(const Io& io, MetricsRecord& m) {
  io("step", m.step);
  io.opt("loss", m.loss);
  io.opt("lr", m.lr);
  io.opt("grad_norm", m.grad_norm);
  io.opt("step_seconds", m.step_seconds);
  io.opt("data_wait_seconds", m.data_wait_seconds);
  io.opt("samples_per_second", m.samples_per_second);
  io.opt("tokens_per_second", m.tokens_per_second);
  io.opt("val_loss", m.val_loss);
  io.opt_object("plan", m.plan,
                [](const auto& sub, PlanProgress& p) { plan_progress_fields(sub, p); });
}

}  // namespace

KILN_RESULT_FIELDS(CheckpointResult, checkpoint_fields)
KILN_RESULT_FIELDS(PilotResult, pilot_fields)
KILN_RESULT_FIELDS(PilotRestore, pilot_restore_fields)
KILN_RESULT_FIELDS(PlanResult, plan_fields)
KILN_RESULT_FIELDS(StrategyRecord, strategy_record_fields)

// The manifest and metrics records are not rung files: no schema version of their own.
void from_json(const json& j, RunIdentity& value) {
  value = {};
  identity_fields(ReadIo(j, "", 1), value);
}
void to_json(json& j, const RunIdentity& value) {
  identity_fields(WriteIo(j), const_cast<RunIdentity&>(value));  // WriteIo only reads it
}
void from_json(const json& j, MetricsRecord& value) {
  value = {};
  metrics_fields(ReadIo(j, "", 1), value);
}
void to_json(json& j, const MetricsRecord& value) {
  metrics_fields(WriteIo(j), const_cast<MetricsRecord&>(value));  // WriteIo only reads it
}

std::string PlanRow::strategy_text() const {
  return kiln::strategy_text(strategy, fsdp_degree, gpus, tp_degree);
}

double PlanRow::bytes_per_device() const {
  return strategy == "ddp" ? ddp_bytes_per_device : fsdp_bytes_per_device;
}

int PlanResult::recommended_row() const {
  if (!recommendation) return -1;
  for (size_t k = 0; k < rows.size(); ++k) {
    if (rows[k].hardware == recommendation->hardware) return static_cast<int>(k);
  }
  return -1;
}

// ---- reading a file ----------------------------------------------------------------------------

namespace {
template <class T>
std::string regenerate_hint() {
  if constexpr (std::is_same_v<T, RunIdentity>) {
    return "every kiln command writes it at the start of a run";
  } else if constexpr (std::is_same_v<T, MetricsRecord> || std::is_same_v<T, StrategyRecord>) {
    return "kiln train writes it";
  } else {
    return fmt::format("rerun `kiln {}` (or `kiln ladder`) with this kiln to regenerate it",
                       std::string(T::kRung) == "checkpoint" ? "ladder" : T::kRung);
  }
}
}  // namespace

template <class T>
T read_result(const std::filesystem::path& file) {
  json value;
  try {
    value = json::parse(read_file(file));
  } catch (const std::exception& e) {
    throw ResultFormatError(fmt::format("{}: not a JSON object ({}); {}", file.string(),
                                        one_line_error(e), regenerate_hint<T>()));
  }
  int version = 1;
  if (value.is_object() && value.contains("schema_version") &&
      value["schema_version"].is_number_integer()) {
    version = value["schema_version"].get<int>();
  }
  try {
    return value.get<T>();
  } catch (const ResultFormatError& e) {
    throw ResultFormatError(fmt::format(
        "{}: {} (schema version {}{}); {}", file.string(), e.what(), version,
        version == 1 && !value.contains("schema_version") ? ", the unversioned format" : "",
        regenerate_hint<T>()));
  }
}

template <class T>
T checked_result(const json& value) {
  try {
    return value.get<T>();
  } catch (const ResultFormatError& e) {
    throw ResultFormatError(fmt::format(
        "{}.json as written would not read back: {} (a key the reader needs is missing or "
        "renamed in the rung; src/report/results*.cpp lists the keys)",
        T::kRung, e.what()));
  }
}

template CompileResult checked_result<CompileResult>(const json&);
template ProfileResult checked_result<ProfileResult>(const json&);
template ScaleResult checked_result<ScaleResult>(const json&);
template PilotResult checked_result<PilotResult>(const json&);
template PlanResult checked_result<PlanResult>(const json&);

template BaselineResult read_result<BaselineResult>(const std::filesystem::path&);
template CompileResult read_result<CompileResult>(const std::filesystem::path&);
template ProfileResult read_result<ProfileResult>(const std::filesystem::path&);
template ScaleResult read_result<ScaleResult>(const std::filesystem::path&);
template CheckpointResult read_result<CheckpointResult>(const std::filesystem::path&);
template PilotResult read_result<PilotResult>(const std::filesystem::path&);
template PlanResult read_result<PlanResult>(const std::filesystem::path&);
template RunIdentity read_result<RunIdentity>(const std::filesystem::path&);
template StrategyRecord read_result<StrategyRecord>(const std::filesystem::path&);

}  // namespace kiln
