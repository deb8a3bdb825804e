// The scale rung (not public API yet; the CLI and the ladder include it from src/).
#pragma once

#include "kiln/rungs.h"

namespace kiln {

/// The scale rung in this process, on a session whose communicator spans the job (under torchrun
/// or srun; a world of one measures one process). Every rank runs it.
///   1. Single-process baseline: rank 0 alone builds a fresh copy of the job (same per-process
///      batch, threads and device, no communication) and trains dist.scale_warmup_steps + at most
///      dist.scale_baseline_steps steps while the other ranks wait in a barrier, which times out
///      after dist.timeout_seconds. The baseline's budget is half of dist.timeout_seconds, counted
///      from the start (building the copy included): once spent, warm-up stops after its first
///      step and measuring after its second (scale.json's baseline.note says so). Building the
///      copy and those three steps cannot be cut short: if they alone take longer than
///      dist.timeout_seconds, the waiting ranks time out (CommunicationError); raise the key.
///      Skipped in a world of one.
///   2. Data-parallel: dist.scale_warmup_steps, then dist.scale_steps measured steps of the
///      session's trainer, timing every phase (data wait, forward, backward, exposed
///      communication, optimizer) and the process group's traffic (busy time, bytes, collectives).
///   3. Replicas must still hold identical weights (all-gathered weights hash).
/// Rank 0 writes <run dir>/scale.json. Gate: finite losses, replicas in sync, and scaling
/// efficiency (global throughput / (world x baseline throughput)) >= dist.min_scaling_efficiency.
/// Throws CommunicationError when a rank fails.
RungResult run_scale(Session& session);

/// `kiln scale` and the ladder's entry. Already distributed (world > 1): opens a session and runs
/// run_scale. Otherwise, with dist.scale_processes > 1, launches `torchrun --standalone
/// --nproc-per-node=<dist.scale_processes> --no-python <kiln> scale <config>` as a child process.
/// The ranks are a run of their own in <run dir>/scale/ (run.dir = <run dir>, run.name = scale;
/// the resolved config is written to <run dir>/scale/scale-launch.toml), so the caller's
/// manifest.json, config.toml and metrics stay as they were; their scale.json is read back and
/// copied to <run dir>/scale.json (with "ranks_run_dir"). With dist.scale_processes <= 1, runs a
/// world of one in this process. Throws UserError when the run directory cannot be written or
/// the ranks' scale.json is not JSON.
RungResult run_scale_rung(const Config& config, const SessionOptions& options);

}  // namespace kiln
