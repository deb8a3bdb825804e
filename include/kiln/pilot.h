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
/// accumulation, world size unchanged), measures the last one's peak memory (CUDA max allocated
/// per rank; CPU the peak of live tensor bytes, kiln/memory.h, beside the process's peak RSS) and
/// sets it beside the analytic estimate (kiln/plan.h), evaluates once, saves a checkpoint, trains
/// one more step, frees the model, and restores the checkpoint in a fresh `kiln train` process
/// that trains the same step: loss and tensors must be bitwise equal (a world of one; under
/// torchrun the checkpoint rung's drill proves the restore). Writes <run dir>/pilot.json (what
/// `kiln plan --pilot` reads) and <run dir>/pilot/. Gate: the restore check.
RungResult run_pilot(const Config& config, const SessionOptions& options);

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
