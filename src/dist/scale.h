// The scale rung (not public API yet; the CLI and the ladder include it from src/).
#pragma once

#include "kiln/rungs.h"

namespace kiln {

/// The scale rung in this process, on a session whose communicator spans the job (under torchrun
/// or srun; a world of one measures one process). Every rank runs it.
///   1. Single-process baseline: rank 0 alone trains dist.scale_warmup_steps + at most
///      dist.scale_baseline_steps steps of a fresh copy of the job (same per-process batch, threads
///      and device, no communication) while the other ranks wait; stops early after half of
///      dist.timeout_seconds so the waiting ranks never time out. Skipped in a world of one.
///   2. Data-parallel: dist.scale_warmup_steps, then dist.scale_steps measured steps of the
///   session's
///      trainer, timing every phase (data wait, forward, backward, exposed communication,
///      optimizer) and the process group's traffic (busy time, bytes, collectives).
///   3. Replicas must still hold identical weights (all-gathered weights hash).
/// Rank 0 writes <run dir>/scale.json. Gate: finite losses, replicas in sync, and scaling
/// efficiency (global throughput / (world x baseline throughput)) >= dist.min_scaling_efficiency.
/// Throws CommunicationError when a rank fails.
RungResult run_scale(Session& session);

/// `kiln scale` and the ladder's entry. Already distributed (world > 1): opens a session and runs
/// run_scale. Otherwise, with dist.scale_processes > 1, launches `torchrun --standalone
/// --nproc-per-node=<dist.scale_processes> --no-python <this kiln> scale <config>` as a child
/// process (the resolved config is written to <run dir>/scale-launch.toml), waits for it and
/// reads back scale.json; with dist.scale_processes <= 1, runs a world of one in this process.
RungResult run_scale_rung(const Config& config, const SessionOptions& options);

}  // namespace kiln
