// The ladder's rungs. Each rung runs on a config, writes <run dir>/<rung>.json, and returns a
// RungResult whose `passed` is its gate. `kiln ladder` runs the enabled rungs in order and stops
// at the first failed gate; `kiln <rung>` runs one.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "kiln/results.h"
#include "kiln/session.h"

namespace kiln {

/// What a rung wrote to <rung>.json, typed (kiln/results.h); monostate when the rung stopped with
/// an error before writing it.
using RungNumbers = std::variant<std::monostate, BaselineResult, CompileResult, ProfileResult,
                                 ScaleResult, CheckpointResult, PilotResult, PlanResult>;

struct RungResult {
  std::string rung;
  bool passed = false;
  std::string verdict;                                     // one line: why it passed or failed
  RungNumbers numbers;                                     // what <rung>.json holds
  std::vector<std::pair<std::string, std::string>> table;  // rows to print and report

  /// The rung's status as its result holds it (nullptr for monostate).
  const RungStatus* status() const;
};

/// Prints a rung's table to stdout.
void print_rung(const RungResult& result);

/// Baseline: eager, one process. Warm-up steps, then measured steps: throughput, step-time
/// percentiles, data-wait share, peak memory of a full step, FLOPs/MFU, loss and val loss.
/// Gate: finite losses, loss falls by baseline.min_loss_drop, val loss beats its initial value.
RungResult run_baseline(Session& session);

/// Compile rung: eager against the compiled step (compile.backend, or "inductor" when that is
/// "eager") in one process, from the same initial weights on the same batches: compile time
/// (cold or cached cache), compile.warmup_steps untimed then compile.steps interleaved timed
/// steps, the shape probe (compile.probe_seq_lens: recompiles and their reasons), peak memory of
/// a step on each side, an evaluation on each side (the compiled side through its eval graph).
/// Under torchrun both sides are DDP and compile.json's "ddp" reports the overlap the compiled
/// step loses. Writes <run dir>/compile.json. Gate: every step's loss, the eval losses and the
/// final parameters agree within compile.tolerance, and no graph break under compile.fullgraph.
/// The verdict keeps the compiled step at compile.min_speedup or more. Throws UserError (bad
/// setup: Python, torch version, cache directory, an unbuilt backend, FSDP, CUDA graphs with
/// more than one process).
RungResult run_compile(Session& session);

/// Profile rung: runs the schedule (skip_first + max(repeat, 1) cycles) on the session's
/// Trainer with a Profiler attached, writes the traces, analyses them, decides the verdict and
/// writes <run dir>/profile.json. Gate: every window was written and holds its steps, phases
/// and operators. Throws UserError (e.g. an unwritable profile.dir) before the first step.
/// When `tables` is given, it receives the printable tables (format_profile_tables).
RungResult run_profile(Session& session, std::string* tables = nullptr);

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

/// The checkpoint rung, a restore drill: a reference process trains 2K steps (K =
/// checkpoint.drill_steps); a second process trains with a checkpoint at step K and is killed
/// (SIGKILL) once it is committed; a third, fresh process verifies it, resumes from it and trains
/// to 2K. Gate: its losses and final parameters are bitwise equal to the reference's. Runs the
/// kiln executable ($KILN_EXECUTABLE, else /proc/self/exe). Writes <run dir>/checkpoint.json.
RungResult run_checkpoint_drill(const Config& config, const SessionOptions& options);

struct Rung {
  std::string name;
  std::function<bool(const Config&)> enabled;
  std::function<RungResult(const Config&, const SessionOptions&)> run;
};

/// The rungs in ladder order.
const std::vector<Rung>& ladder_rungs();

/// The ladder's preflight: every check run_ladder makes before its first rung (the config's rules,
/// already applied when it was loaded, and each enabled rung's start checks, such as the compile
/// rung's Python and package cache). Writes nothing into the run directory. Returns the names of
/// the rungs that would run, in order; throws UserError with one line for the first problem.
/// `kiln ladder --check` calls it; scripts/gpu-check runs that before its GPU ladder.
std::vector<std::string> check_ladder(const Config& config);

/// Under torchrun, after each rung: every rank's outcome of it shared, so every rank takes the same
/// branch (stop, or the next rung's collectives). The rung passed only if it passed on every rank;
/// the verdict is rank 0's (its file's, which only rank 0 reads back), or the first failed rank's
/// as "rank N: ...". Collective: every rank calls it once per rung (also after a rung that threw).
void agree_on_rung_outcome(Communicator& comm, RungResult& result);

/// Runs the enabled rungs in order, stops at the first failed gate, writes <run dir>/report.md.
/// Under torchrun every rank runs it; rank 0 reads each rung's file back and writes the reports.
/// Calls check_ladder first. Returns the results of the rungs that ran.
std::vector<RungResult> run_ladder(const Config& config, const SessionOptions& options);

}  // namespace kiln
