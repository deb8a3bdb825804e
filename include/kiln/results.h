// Typed rung results: one struct per rung file (<run dir>/<rung>.json), with nlohmann
// to_json/from_json, so every reader (report.html today; the ladder, `kiln plan --actual` and the
// tests as they move over) reads a rung's numbers through one declaration instead of string keys
// (docs/report.md, "Rung files"). from_json and to_json walk one field list per struct
// (src/results/results*.cpp), so a key is named once for both directions. The baseline and
// checkpoint, compile, profile, scale, pilot and plan rungs fill their struct (the plan's by
// src/plan's make_plan) and write their file through to_json alone, so a file holds exactly what
// its struct holds. Parts of a file laid out by another component's own serializer (src/compile's
// CompileReport::to_json, src/profile's analysis and verdict numbers, the pilot's MemoryEstimate
// from src/plan, the session's strategy decision) are typed as far as kiln reads them; the rest of
// such a part is carried as JSON (the members named `*_more`, or nlohmann::json members that say
// whose layout they are) and written back unchanged. The plan's parts from src/plan's serializers
// (the strategy decision, host needs, memory estimate) are typed whole.
//
// Versions. A file's "schema_version" (absent = 1: every file kiln wrote before versions existed)
// says which layout it follows; to_json writes kResultSchemaVersion. Version 2 added the keys
// marked "v2" below (files of version 1 may lack them: they read as their defaults). from_json
// refuses a newer version and any required key that is missing or of the wrong type with
// ResultFormatError, never with a silent default: a renamed key in a rung fails its reader loudly.
// A non-finite number is written as null (JSON has no NaN) and a null number reads back as NaN.
//
// A rung that stopped before measuring (a failed gate before the measured steps, a drill that
// could not run, torchrun that failed) writes only "passed": false and its reason; its struct
// then has `status.measured == false` and its measurements at their defaults.
//
// Pure data: any thread; no I/O except read_result.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kiln/error.h"

namespace kiln {

/// The rung-file layout these structs read and write.
inline constexpr int kResultSchemaVersion = 2;

/// A rung file the typed readers cannot read: not JSON, a newer schema, or a required key missing
/// or of the wrong type. what() is one line: the file (when read from one), the key path, the
/// file's schema version and how to regenerate the file. A UserError (exit status 2).
class ResultFormatError : public UserError {
 public:
  using UserError::UserError;
};

/// What every rung file starts with.
struct RungStatus {
  int schema_version = kResultSchemaVersion;  // as read ("schema_version", absent = 1)
  bool passed = false;
  std::string verdict;   // one line: why it passed or failed ("reason" in a stopped rung's file)
  bool measured = true;  // false: the rung stopped before measuring (only passed and verdict)
};

// ---- baseline.json (src/rungs/baseline.cpp) ----------------------------------------------------

struct StepTimes {
  double median = 0, p10 = 0, p90 = 0, mean = 0;  // seconds
};

/// A timed GEMM (kiln/plan.h MatmulPeak): "matmul_peak" in baseline.json and pilot.json.
struct MatmulPeakRecord {
  double flops_per_second = 0;  // 2 m n k / median_seconds
  int64_t m = 0, n = 0, k = 0;
  std::string dtype;
  double median_seconds = 0;
  int64_t repeats = 0;
};

struct BaselineResult {
  static constexpr const char* kRung = "baseline";
  RungStatus status;
  std::string device;
  int64_t warmup_steps = 0, measured_steps = 0, batch_size = 0, seq_len = 0;
  int64_t grad_accum_steps = 1;  // v2
  double samples_per_second = 0;
  std::optional<double> tokens_per_second;  // null without a sequence length (mlp)
  StepTimes step_seconds;
  double data_wait_share = 0;
  std::string peak_memory_method;
  double peak_allocated_bytes = 0;
  double peak_reserved_bytes = -1, resident_after_bytes = -1;             // v2; -1: not measured
  double parameters_bytes = 0, gradients_bytes = 0, optimizer_bytes = 0;  // "state_bytes"
  double flops_per_sample = 0, achieved_flops_per_second = 0;
  std::optional<double> flops_per_token;             // v2; null without a sequence length
  std::optional<double> mfu, peak_flops_per_second;  // null: the device has no catalog peak
  std::optional<std::string> peak_flops_source;      // v2; the key or catalog row of the peak
  double loss_start = 0, loss_end = 0, val_loss_initial = 0, val_loss_final = 0;
  std::optional<double> val_accuracy_final;  // present for a classifier
  int64_t skipped_steps = 0;                 // v2; non-finite steps the trainer skipped
  std::vector<double> losses;  // v2; every synced step's loss, warm-up included (also when stopped)
  // v2: the job's largest GEMM timed on the device (src/plan measure_matmul_peak, as the pilot
  // records it) and MFU against it: achieved_flops_per_second / matmul_peak->flops_per_second.
  // Null in files written before the baseline timed it.
  std::optional<MatmulPeakRecord> matmul_peak;
  std::optional<double> mfu_of_matmul_peak;
};

// ---- compile.json (src/rungs/compile.cpp) ------------------------------------------------------

struct CompileSide {
  double median_seconds = 0, p90_seconds = 0, samples_per_second = 0;
  std::optional<double> tokens_per_second;
  double peak_memory_bytes = 0;
  // The model's FLOP per sample (CompileResult::flops_per_sample) at the median step's rate, and
  // that against the measured matmul (CompileResult::matmul_peak); null without them.
  std::optional<double> achieved_flops_per_second, share_of_matmul_peak;
};

/// The evaluation on both sides after the timed steps ("eval"; {} without a validation batch).
struct CompileEval {
  double loss_eager = 0, loss_compiled = 0, relative_difference = 0;
  int64_t samples = 0;
  std::optional<double> accuracy_eager, accuracy_compiled;  // a classifier's
};
/// One shape of the probe (compile.probe_seq_lens): one more step on both sides.
struct CompileProbeStep {
  bool recompiled = false, new_graph = false, eager = false;
  double loss_eager = 0, loss_compiled = 0;
};
struct CompileProbe {
  int64_t seq_len = 0;
  CompileProbeStep train;                // the keys sit in the entry itself
  std::optional<CompileProbeStep> eval;  // the eval graph on the same batch (AOTInductor)
};
/// Under DDP, one side's communication per timed step, averaged over ranks.
struct CompileDdpSide {
  double comm_exposed_seconds_per_step = 0, comm_busy_seconds_per_step = 0,
         comm_overlapped_share = 0, collectives_started_in_backward_per_step = 0;
};
struct CompileDdp {
  int64_t world_size = 0;
  std::string backend;
  std::vector<int64_t> bucket_bytes;
  CompileDdpSide eager;
  std::optional<CompileDdpSide> compiled;  // null: a captured step (not measurable)
  std::optional<double> overlap_lost_seconds_per_step, overlap_lost_share_of_compiled_step;
  std::string method;
};

struct CompileResult {
  static constexpr const char* kRung = "compile";
  RungStatus status;
  std::string backend, dynamic, device;
  std::string precision;        // v2
  int64_t recompile_limit = 0;  // v2
  bool fullgraph = false;
  int64_t world_size = 1;
  // "compile" and "capture": src/compile's CompileReport::to_json (its layout), "capture" only
  // when AOTInductor and a CUDA-graph capture both ran. v2.
  nlohmann::json compile_report = nlohmann::json::object();
  std::optional<nlohmann::json> capture_report;
  // compile_seconds and cache, once the step compiled (built == true).
  bool built = false;
  double compile_seconds = 0;
  std::string cache;  // "cold", "cached", "n/a"
  // The rest are present once both sides were timed; a compile that failed before (a graph
  // break under fullgraph) or ran eager (graph breaks, fullgraph = false) has timed == false.
  bool timed = false;
  int64_t graphs = 0, warmup_steps = 0, timed_steps = 0;
  int64_t eval_graphs = 0;  // v2
  // v2: CompileReport::to_json's "graph_breaks" and "recompiles", its eval part's "recompiles".
  nlohmann::json graph_breaks = nlohmann::json::array(), recompiles = nlohmann::json::array(),
                 eval_recompiles = nlohmann::json::array();
  std::optional<CompileEval> eval;  // v2
  std::vector<CompileProbe> probe;  // v2
  CompileSide eager, compiled;
  // The model's math per sample (Model::train_flops_per_sample) and the job's largest GEMM timed
  // on the device (as the baseline rung times it): each side's FLOP/s and share of that matmul.
  std::optional<double> flops_per_sample;
  std::optional<MatmulPeakRecord> matmul_peak;
  std::string peak_memory_method;  // v2
  std::optional<double> speedup;   // eager median / compiled median (null: ran eager)
  double min_speedup = 0;
  double tolerance = 0, max_relative_loss_difference = 0, max_relative_parameter_difference = 0;
  // v2, "numerics": where the numbers were worst, and every step's loss on each side.
  int64_t worst_loss_step = 0;
  std::string worst_parameter, worst_eval;
  double worst_parameter_relative_difference = 0, max_relative_eval_loss_difference = 0;
  std::vector<double> eager_losses, compiled_losses;
  std::optional<CompileDdp> ddp;  // under torchrun (DDP on both sides)
};

// ---- profile.json (src/rungs/profile.cpp, src/profile/verdict.cpp) -----------------------------

struct ProfilePhase {
  std::string phase;
  double seconds = 0, share = 0;
};
struct ProfileOperator {
  std::string name;
  int64_t calls = 0;
  double self_cpu_us = 0, total_cpu_us = 0;
  nlohmann::json more = nlohmann::json::object();  // the row's other keys (input_shapes, ...)
};
struct ProfileMemoryPhase {
  std::string phase, device;
  double peak_allocated_bytes = 0, growth_bytes = 0;
};

struct ProfileScheduleRecord {  // profile.schedule.*
  int64_t skip_first = 0, wait = 0, warmup = 0, active = 0, repeat = 0;
};
struct ProfileOptionsRecord {  // profile.* switches
  bool record_shapes = false, profile_memory = false, with_stack = false, with_flops = false,
       gzip = false;
};

struct ProfileResult {
  static constexpr const char* kRung = "profile";
  RungStatus status;  // verdict: the verdict's reason
  std::string device;
  ProfileScheduleRecord schedule;     // v2
  ProfileOptionsRecord options;       // v2
  std::vector<double> losses;         // v2; every synced step's loss (also when stopped)
  std::vector<std::string> problems;  // why the capture is incomplete (written when any)
  // The other keys of "analysis" and "verdict", as src/profile lays them out (analysis_to_json,
  // decide_bottleneck: shares, thresholds, the GPU's timeline); the report does not read them.
  nlohmann::json analysis_more = nlohmann::json::object(), verdict_more = nlohmann::json::object();
  std::string bottleneck;            // "compute-bound", "host-bound", ...
  std::vector<std::string> actions;  // each names the config key or rung that carries it out
  int64_t windows = 0, steps = 0;
  double step_seconds_mean = 0;
  std::vector<ProfilePhase> phases;
  std::vector<ProfileOperator> top_operators;
  std::vector<ProfileMemoryPhase> memory_by_phase;
  std::vector<std::string> traces;
};

// ---- scale.json (src/rungs/scale.cpp) ----------------------------------------------------------

/// A rank's memory for the strategy it ran (docs/scale.md, "Memory"), bytes.
struct ScaleRankMemory {
  std::string strategy;
  int64_t parameters = 0, gradients = 0, optimizer_state = 0, model_state = 0;
  int64_t gathered_parameters_peak = 0, largest_gathered_unit = 0;
  std::optional<int64_t> activations, step_peak_above_start, peak;  // null: not measured
  int64_t model_state_ddp = 0, model_state_fsdp = 0;                // "model_state_by_strategy"
  std::string method;
};

struct ScaleRank {
  int64_t rank = 0;
  int64_t local_rank = 0, samples = 0;  // v2
  double seconds = 0, samples_per_second = 0, compute_seconds = 0;
  double cpu_seconds = 0;                              // v2
  double step_median = 0, step_p10 = 0, step_p90 = 0;  // v2, "step_seconds"
  std::optional<double> tokens_per_second;
  // phase_seconds: summed over the measured steps
  double data_wait_seconds = 0, forward_seconds = 0, backward_seconds = 0, comm_exposed_seconds = 0,
         optimizer_seconds = 0;
  double comm_busy_seconds = 0;
  int64_t comm_collectives = 0, comm_bytes = 0;  // v2, "comm"
  double comm_blocked_seconds = 0;               // v2
  double comm_overlapped_share = 0;              // v2
  std::optional<ScaleRankMemory> memory;         // v2
};

struct ScaleBaseline {  // rank 0 alone
  std::string method, note;
  double samples_per_second = 0, median_step_seconds = 0;
  int64_t steps = 0;
};

struct ScaleResult {
  static constexpr const char* kRung = "scale";
  RungStatus status;
  int64_t world_size = 0;
  std::string strategy, strategy_reason, backend, device;
  // v2: dist.strategy = "auto"'s decision, as src/rungs/session.cpp's choice lays it out; null
  // otherwise.
  nlohmann::json strategy_decision;
  int64_t threads_per_process = 0, batch_size_per_process = 0, grad_accum_steps = 0,
          global_batch_samples = 0, seq_len = 0, warmup_steps = 0, measured_steps = 0;  // v2
  int64_t first_bucket_cap_bytes = 0, bucket_cap_bytes = 0;  // v2, "bucket_cap_bytes"
  double global_samples_per_second = 0;
  std::optional<double> global_tokens_per_second;
  double median_step_seconds = 0, comm_exposed_share_of_step = 0;
  double compute_seconds_per_step = 0, comm_busy_seconds_per_step = 0,
         comm_exposed_seconds_per_step = 0;  // v2, "global"
  std::optional<ScaleBaseline> baseline;     // null in a world of one
  std::optional<double> scaling_efficiency, speedup;
  bool replicas_in_sync = false;
  std::string weights_hash;    // v2; rank 0's
  std::vector<double> losses;  // v2
  std::vector<ScaleRank> per_rank;
  std::vector<std::pair<std::string, std::string>> table;  // v2; the rows the ranks printed
  // Written by the process that launched the ranks (kiln ladder, kiln scale without torchrun).
  std::optional<std::string> ranks_run_dir;
  std::optional<int64_t> torchrun_status;  // torchrun failed before the ranks wrote scale.json

  /// baseline->samples_per_second, when measured.
  std::optional<double> baseline_samples_per_second() const;
};

// ---- checkpoint.json (src/rungs/checkpoint_drill.cpp) ------------------------------------------

struct CheckpointResult {
  static constexpr const char* kRung = "checkpoint";
  RungStatus status;
  int64_t drill_steps = 0, total_steps = 0;
  std::string directory;  // v2; <run dir>/checkpoint-drill: the three runs' logs and checkpoints
  // Each stage's figure, present once the drill reached it.
  std::optional<double> reference_seconds, save_seconds, resume_seconds, checkpoint_bytes;
  std::optional<bool> killed;
  std::optional<int64_t> killed_exit_status;
  std::optional<bool> verify_ok;
  std::optional<int64_t> resume_epoch, resume_batch_in_epoch;  // the checkpoint's loader position
  std::optional<int64_t> losses_compared;
  std::optional<bool> losses_bitwise_equal, parameters_bitwise_equal, optimizer_state_bitwise_equal;
  std::optional<double> max_abs_loss_difference;
  std::optional<double> seconds;  // the whole drill
};

// ---- pilot.json (src/rungs/pilot.cpp) ----------------------------------------------------------

struct MemoryParts {  // bytes
  double parameters = 0, gradients = 0, optimizer = 0, activations_and_logits = 0, step_peak = 0;
};

struct PilotMemoryPart {  // memory.parts[]: measured beside estimated
  std::string part;
  double measured_bytes = 0, estimated_bytes = 0;
};

/// The restore in a fresh process (pilot.json "restore").
struct PilotRestore {
  bool passed = false;
  double seconds = 0;
  int64_t step = 0, exit_status = 0;
  bool loss_bitwise_equal = false;
  std::vector<std::string> differing_tensors;
  int64_t world_size = 1;                                   // v2
  double tolerance = 0, recovery_seconds = 0;               // v2
  std::optional<std::vector<int64_t>> exit_status_by_rank;  // world > 1
  std::optional<double> loss_here, loss_restored;           // once the restore ran
  std::optional<bool> loss_equal;
};

/// How the pilot timed its step (pilot.json "step_timing"; absent in a pilot written before it
/// was recorded, whose step_seconds is its memory-measured step alone).
struct PilotStepTiming {
  std::string method;                // in words: which steps, which statistic
  std::vector<int64_t> steps;        // the timed steps (step numbers), in order
  std::vector<double> step_seconds;  // their times, in order; step_seconds is their median
  double first_step_seconds = 0;     // step 1, left out: cold (allocations, the optimizer state)
  double memory_step_seconds = 0;    // the memory-measured step, left out: its meter slows it
};

struct PilotResult {
  static constexpr const char* kRung = "pilot";
  RungStatus status;
  std::string job_hash, config_hash, device, device_name;
  int64_t world_size = 1, steps = 0;
  int64_t micro_batch = 0, seq_len = 0, grad_accum_steps = 0;
  std::string precision;
  std::string compile_backend;  // v2
  double step_seconds = 0, loss = 0, eval_seconds = 0, val_loss = 0, wall_seconds = 0;
  double flops_per_step = 0;                    // v2
  std::optional<double> peak_flops_per_second;  // v2; null: no catalog peak for the device
  std::optional<double> mfu;
  MatmulPeakRecord matmul_peak;   // v2
  double mfu_of_matmul_peak = 0;  // v2
  double checkpoint_bytes = 0, save_seconds = 0, write_bytes_per_second = 0;
  std::optional<PilotStepTiming> step_timing;  // absent in older pilots
  /// checkpoint.async of the job, and the part of an async save that blocks training (the save
  /// call and the staging copy to host memory; the write runs beside training), measured.
  /// Absent in older pilots.
  std::optional<bool> checkpoint_async;
  std::optional<double> save_blocking_seconds;
  /// After the next step and an evaluation, the wait for that async save to finish (what of its
  /// write and commit the evaluation did not cover, and its bookkeeping): how a run's last save
  /// ends. Absent in older pilots.
  std::optional<double> save_end_wait_seconds;
  std::string memory_method;
  MemoryParts estimated, measured;  // estimated.activations_and_logits = activations + logits
  double estimated_activations_bytes = 0, estimated_logits_bytes = 0;  // the estimate's two parts
  // The estimate's other keys, as src/plan's to_json(MemoryEstimate) lays them out.
  nlohmann::json estimate_more = nlohmann::json::object();
  // v2, memory.measured's other parts.
  double measured_held_gradient_bytes = 0, measured_step_peak_above_state_bytes = 0;
  std::optional<double> measured_process_peak_rss_bytes, measured_reserved_bytes;
  std::vector<PilotMemoryPart> memory_parts;  // v2
  std::string memory_differs_most;            // v2
  double measured_over_estimate = 0;
  double activation_ratio = 0;  // v2
  bool within_allowed_error = false;
  PilotRestore restore;
};

// ---- plan.json (src/plan/planner.cpp make_plan fills it, src/rungs/plan.cpp writes it) ---------
// Every key the planner writes (docs/plan.md, "Outputs"). The keys the report read before the plan
// was written through this struct are required; the others were added to plan.json over time
// without a schema version of their own, so a file that lacks one reads it as its default.

struct PlanReservation {
  bool fits = false;
  std::optional<double> price_per_gpu_hour;  // the row's price (written only with one)
  std::optional<double> cost;                // GPUs x days x 24 h x price; null without a price
};

/// Host memory and storage of one row ("host": kiln/plan.h HostNeeds, as its to_json lays it out).
struct PlanHost {
  double staging_bytes_per_node = 0, loader_bytes_per_node = 0, host_bytes_per_node = 0;
  std::optional<double> host_memory_bytes;  // null: the row has no host_memory_gb
  bool host_fits = true;
  double storage_bytes = 0;
  std::optional<double> storage_limit_bytes;  // null: plan.storage_tb not set
  bool storage_fits = true;
  std::vector<std::string> warnings;
};

struct PlanRow {
  std::string hardware, display_name;
  int64_t gpus = 0;
  bool fits_memory = false;
  // "strategy": the rule's decision (kiln/plan.h StrategyDecision, as its to_json lays it out).
  std::string strategy;  // "ddp", "fsdp", "does-not-fit"
  int64_t fsdp_degree = 0;
  int64_t tp_degree = 1;                      // tensor parallelism (absent in older plans: 1)
  double strategy_communication_seconds = 0;  // "communication_seconds": the rule's figure
  double ddp_bytes_per_device = 0, fsdp_bytes_per_device = 0, usable_bytes = 0;
  std::string strategy_reason;                                    // "reason"
  double peak_flops_per_gpu = 0, catalog_peak_flops_per_gpu = 0;  // the peak used; the catalog's
  std::string peak_flops_source;
  PlanHost host;
  double mfu = 0;
  std::string mfu_source;
  double step_seconds = 0, compute_seconds_per_step = 0, communication_seconds_per_step = 0;
  // The budget (kiln/plan.h Budget): seconds over the whole job.
  double train_seconds = 0, eval_seconds = 0;
  double save_seconds = 0;       // delta: what one save stalls the job
  double full_save_seconds = 0;  // the whole save at write_bytes_per_second
  std::string save_stall_source;
  double write_bytes_per_second = 0;
  double restart_seconds = 0, recovery_seconds = 0;  // R, and its part after the requeue
  std::string recovery_source;
  double checkpoint_interval_seconds = 0, young_interval_seconds = 0, saves_seconds = 0;
  double job_mtbf_seconds = 0;                            // 0: failures not modelled
  std::optional<double> expected_failures, lost_seconds;  // null: not finite
  double drills_seconds = 0, pilot_seconds = 0;
  std::optional<double> margin_seconds, wall_seconds;  // null: never finishes
  std::optional<double> wall_days;                     // null: never finishes (does not fit)
  double ettr = 0;
  PlanReservation reservation_7d, reservation_30d;

  /// "ddp", "fsdp x8", "hsdp 2x4", "does-not-fit": the strategy as every table prints it.
  std::string strategy_text() const;
  /// The bytes per device the chosen strategy holds (FSDP's for "does-not-fit": the least).
  double bytes_per_device() const;
};

/// The memory model's step on one device (kiln/plan.h MemoryEstimate, as its to_json lays it out).
struct PlanMemoryEstimate {
  double parameters_bytes = 0, gradients_bytes = 0, optimizer_bytes = 0, activations_bytes = 0,
         logits_bytes = 0, backward_extra_bytes = 0, autocast_copies_bytes = 0,
         communication_bytes = 0, gradients_after_step_bytes = 0;
  bool gradients_held_across_micro_batches = false;
  std::string peak_at;
  double step_peak_bytes = 0, total_bytes = 0;
};

/// "memory_per_device".
struct PlanMemory {
  PlanMemoryEstimate estimate;
  double state_bytes_per_parameter = 0;
  double activation_calibration = 1;  // the pilot's measured / estimated activations (1: none)
};

/// "recommendation": the row and reservation advised (null when nothing fits 30 days).
struct PlanRecommendation {
  std::string hardware;
  int64_t reservation_days = 0;
  std::optional<double> cost;              // with prices: that reservation's cost
  std::optional<bool> reservation_needed;  // false for a job under a day (written only then)
};

struct PlanResult {
  static constexpr const char* kRung = "plan";
  RungStatus status;  // passed: some row fits a 30-day reservation
  std::string config, job_hash;
  std::optional<std::string> pilot;  // the pilot's run directory that calibrated it
  // "model"
  std::string architecture;
  double parameters = 0;
  int64_t largest_unit_parameters = 0;
  double flops_per_token = 0;
  // "job"
  int64_t micro_batch = 0, seq_len = 0, grad_accum_steps = 0, gpus = 0;
  std::string precision, optimizer;
  bool activation_checkpointing = false;
  double tokens = 0, tokens_per_step = 0, steps = 0, evals = 0;
  PlanMemory memory_per_device;
  // "checkpoint"
  double checkpoint_bytes = 0, assumed_write_bytes_per_second = 0;
  std::optional<double> pilot_write_bytes_per_second;  // null: no pilot measured it
  std::vector<std::string> assumptions, warnings;
  std::vector<PlanRow> rows;
  std::optional<PlanRecommendation> recommendation;
  std::string recommendation_text;

  /// The index of the recommended row in `rows`, or -1.
  int recommended_row() const;
};

// ---- manifest.json (src/core/run.cpp; docs/manifest.md): the run's identity --------------------

struct RunIdentity {
  std::string kiln_version, git_commit;
  bool git_dirty = false;
  std::string libtorch_version;
  std::string config_file, config_hash;
  std::string data_kind, data_content_hash;  // the data's xxh3 ("" when the kind has none)
  std::optional<std::string> data_revision;  // data.revision, the config's free text
  std::string model_architecture;
  double model_parameters = 0;
  std::string device;
  int64_t world_size = 1;
  std::string command_line, start_time_utc;
};

// ---- strategy.json: the layout a parallel kiln train, scale or pilot ran
// --------------------------
/// Written by rank 0 once the strategy is resolved (src/rungs/job.cpp): the strategy, the mesh
/// (dist.strategy = "auto" chooses it, tp included), and auto's decision. `kiln plan --actual` and
/// the run's own forecast read the mesh from it instead of the config's keys.
struct StrategyRecord {
  std::string strategy, reason;  // "ddp" | "fsdp"
  int64_t world_size = 1, dp_replicate = 1, dp_shard = 1, tp = 1;
  nlohmann::json decision;  // auto's decision (src/dist/strategy.cpp); null otherwise
};

// ---- metrics.jsonl: one record per line ---------------------------------------------------------

/// A step record (loss, lr, timing, throughput) or an evaluation record (val_loss).
/// kiln train's progress against the plan's forecast (src/rungs/plan_tracking.h): a metrics.jsonl
/// record {"step": N, "plan": {...}} every metrics_every steps and one at the end (final). The
/// forecast fields are present when a plan for the same job hash forecast them.
struct PlanProgress {
  std::optional<double> tokens_per_second;  // over the steps since the last record
  std::optional<double> tokens_per_second_forecast, tokens_per_second_vs_plan;
  double elapsed_seconds = 0;     // since training began (restore and compile included)
  double step_seconds = 0;        // summed step times (checkpoints inside steps included)
  double checkpoint_seconds = 0;  // time the saves cost the training loop so far
  double productive_seconds = 0;  // step_seconds less the checkpoint time inside steps
  double ettr = 0;                // productive / elapsed
  std::optional<double> ettr_forecast;
  double eta_seconds = 0;  // 0 in the final record
  std::optional<double> wall_seconds_forecast;
  bool final = false;
};

struct MetricsRecord {
  int64_t step = 0;
  std::optional<double> loss, lr, grad_norm, step_seconds, data_wait_seconds, samples_per_second,
      tokens_per_second, val_loss;
  std::optional<PlanProgress> plan;  // a plan-tracking record (no loss)
};

// ---- JSON ---------------------------------------------------------------------------------------
// from_json throws ResultFormatError naming the key path ("memory.estimate.logits_bytes is
// missing"); read_result adds the file.

#define KILN_RESULT_JSON(T)                        \
  void to_json(nlohmann::json& j, const T& value); \
  void from_json(const nlohmann::json& j, T& value);
KILN_RESULT_JSON(BaselineResult)
KILN_RESULT_JSON(CompileResult)
KILN_RESULT_JSON(ProfileResult)
KILN_RESULT_JSON(ScaleResult)
KILN_RESULT_JSON(CheckpointResult)
KILN_RESULT_JSON(PilotResult)
KILN_RESULT_JSON(PlanResult)
KILN_RESULT_JSON(RunIdentity)
KILN_RESULT_JSON(ScaleRank)     // one rank's entry: the ranks exchange them
KILN_RESULT_JSON(PilotRestore)  // rank 0's restore check: the ranks share it
KILN_RESULT_JSON(MetricsRecord)
KILN_RESULT_JSON(StrategyRecord)
#undef KILN_RESULT_JSON

/// The rows a rung prints under its name and report.md shows (kiln/rungs.h RungResult::table),
/// rendered from its result.
using ResultRows = std::vector<std::pair<std::string, std::string>>;
ResultRows result_rows(const BaselineResult& result);
ResultRows result_rows(const CheckpointResult& result);
ResultRows result_rows(const PlanResult& result);

/// `json` checked against T's reader: from_json(json) must succeed (else ResultFormatError naming
/// the key). A rung that still builds its file by hand calls it before writing, so a key it
/// renamed stops the rung instead of showing "-" in the report. Returns the parsed result.
template <class T>
T checked_result(const nlohmann::json& json);

/// Reads and parses `file` as T (one of the structs above). Throws ResultFormatError: the file is
/// unreadable or not JSON, or from_json refused it (the message names the file, the key, the
/// file's schema version and the command that regenerates it).
template <class T>
T read_result(const std::filesystem::path& file);

}  // namespace kiln
