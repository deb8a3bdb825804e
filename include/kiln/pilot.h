// The pilot and plan rungs (docs/plan.md): the last two of the ladder. The pilot proves the job
// once at its production shape and measures it; the plan turns that (or the config alone) into a
// strategy, a hardware choice and a 7- or 30-day budget (kiln/plan.h holds the arithmetic).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "kiln/rungs.h"

namespace kiln {

/// The pilot (docs/plan.md): pins the environment into manifest.json (kiln/run.h
/// environment_pins), trains pilot.steps steps at the config's production shape (micro-batch, seq,
/// accumulation, world size unchanged), measures the last one's peak memory (measure_step_memory:
/// CUDA max allocated per rank; CPU the peak of live tensor bytes, kiln/memory.h, beside the
/// process's peak RSS) and sets it beside the analytic estimate (kiln/plan.h): outside
/// 1 +- pilot.max_estimate_error the pilot fails, naming the part that differs most (a plan built
/// on that estimate would be wrong). It evaluates once, saves a checkpoint, trains
/// one more step, frees the model, and restores the checkpoint in a fresh `kiln train` process
/// that trains the same step: loss and tensors must be bitwise equal (a world of one; under
/// torchrun the checkpoint rung's drill proves the restore). Writes <run dir>/pilot.json (what
/// `kiln plan --pilot` reads; its restore.recovery_seconds is the restart the plan counts) and
/// <run dir>/pilot/. Gates: the restore check and the memory estimate.
RungResult run_pilot(const Config& config, const SessionOptions& options);

/// One full optimizer step's memory on one device, measured the way the pilot measures it.
struct StepMemory {
  double parameters_bytes = 0;     // distinct storages of the parameters (FSDP: the shards)
  double optimizer_bytes = 0;      // the optimizer's state (moments, momentum buffers)
  double held_gradient_bytes = 0;  // kept across steps: FSDP's gradient shards, DDP's buckets
  /// The step's own peak above what was live before it: CPU, the peak of live tensor bytes
  /// allocated in the step (kiln::MemoryMeter); CUDA, max_memory_allocated less the held state.
  double step_peak_bytes = 0;
  double gradients_after_step_bytes = 0;  // distinct storages of the gradients after the step
  double process_peak_rss_bytes = -1;     // CPU: the process's peak resident set (VmHWM)
  double reserved_bytes = -1;             // CUDA: max reserved
  StepStats stats;                        // of the measured step
  double held_bytes() const { return parameters_bytes + optimizer_bytes + held_gradient_bytes; }
  double peak_bytes() const { return held_bytes() + step_peak_bytes; }
};

/// Trains one step on `trainer` (train_step, synchronised) and measures it as above.
/// `held_gradient_bytes`: the gradient buffers a parallel layout keeps between steps (FSDP's
/// memory().gradient_shards, DDP's bucket bytes; 0 for one process, whose gradients are freed at
/// the step's start). Call it after the optimizer state exists (a step before). Thread: the
/// trainer's.
StepMemory measure_step_memory(Trainer& trainer, const torch::Device& device,
                               double held_gradient_bytes);

/// `kiln pilot --check-pins MANIFEST`: every difference between a pinned manifest and this
/// machine and these inputs (the config's data and initial weights, the environment pins when the
/// manifest has them), one line each (kiln/run.h manifest_differences). Builds the datasets and
/// the model; writes nothing. Throws UserError for a file that is not a kiln manifest.
std::vector<std::string> check_pins(const Config& config, const std::filesystem::path& manifest);

/// The plan (kiln/plan.h make_plan): the job on each hardware row from the config alone, never
/// building the model, calibrated by the pilot in `pilot_dir` when not empty (its job hash must
/// match). Writes <run dir>/plan.json and plan.md. `passed`: some row fits a 30-day reservation
/// (advice, not a gate of the job). Throws UserError (unknown hardware, a pilot of another job,
/// with `require_cost` a missing price or MTBF).
RungResult run_plan(const Config& config, const std::filesystem::path& pilot_dir = {},
                    bool require_cost = false);

}  // namespace kiln
