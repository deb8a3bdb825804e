// A training session: the resolved config, its run directory, and a Trainer built from it.
// Every CLI command that trains starts here, so they all share one setup path.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kiln/config.h"
#include "kiln/dist.h"
#include "kiln/job.h"
#include "kiln/run.h"
#include "kiln/train.h"

namespace kiln {

struct Session {
  std::shared_ptr<RunLock> lock{};  // first: released last (null on ranks other than 0)
  Job job;                          // the job, resolved once (kiln/job.h)
  torch::Device device = torch::kCPU;
  std::shared_ptr<Communicator> comm{};  // the process group (a world of one when not distributed)
  std::unique_ptr<Run> run{};
  std::unique_ptr<Trainer> trainer{};
  // With world size > 1: DDP or FSDP (dist.strategy, resolved), why, and FSDP's hook.
  Parallelism strategy = Parallelism::kNone;
  std::string strategy_reason{};
  nlohmann::json strategy_decision{};  // dist.strategy = "auto": the rule's numbers; else null
  MeshShape mesh{};                    // dp_replicate x dp_shard x tp (ComposedStep::mesh)
  std::shared_ptr<FullyShardedDataParallel> fsdp{};
  std::shared_ptr<CompiledStep> compiled{};       // compile.backend = "inductor" (else null)
  std::shared_ptr<CapturedGraphStep> captured{};  // CUDA graph capture (else null)
  std::shared_ptr<CheckpointHook> checkpoints{};  // [checkpoint] saves (else null)
  /// The plan's forecast tracked against the run (kiln train; null when nothing to track).
  std::shared_ptr<TrainerHook> plan_tracking{};
};

struct SessionOptions {
  std::vector<std::string> argv;                 // recorded in the manifest
  std::shared_ptr<Communicator> comm = nullptr;  // null: process_communicator() (launcher env)
  std::string metrics_file = "metrics.jsonl";    // see RunOptions
  bool compile = false;   // compose the job's compiled step (compile.backend) too
  std::string rung = {};  // a rung run alone (its CLI command): its records apart (RunOptions)
  int production_world_size = 0;  // the pilot: plan.gpus (StepComposition)
};

/// Locks the directories `job` writes, for every rank of `comm` at once: rank 0 locks the run
/// directory and the checkpoint directory (kiln/run.h lock_directories); every rank learns the
/// outcome before it writes anything, and every rank throws the same UserError when rank 0 was
/// refused ("run directory runs/x is in use by pid ..."), or when rank 0's `precheck` (run
/// first, before the lock) returned a problem. Returns rank 0's lock (null elsewhere); keep it
/// while writing. Collective.
std::shared_ptr<RunLock> lock_run_directories(const Job& job, Communicator& comm,
                                              const std::function<std::string()>& precheck = {});

/// For the rungs: resolves `config` (resolve_job, a fresh run) and composes its training
/// (compose_training: lock, runtime settings, datasets, model, run directory and manifest, the
/// Trainer with activation checkpointing and the parallel layout, and the compiled step with
/// options.compile). Throws UserError.
std::unique_ptr<Session> open_session(const Config& config, const SessionOptions& options);

/// Peak memory of the last measured region. On CUDA, the caching allocator's max allocated and
/// max reserved bytes; on CPU, the process's peak resident set (VmHWM), reset before the region.
struct PeakMemory {
  std::string method;                // how it was measured, in words
  double allocated_bytes = -1;       // CUDA: max allocated; CPU: peak RSS
  double reserved_bytes = -1;        // CUDA: max reserved; CPU: -1
  double resident_after_bytes = -1;  // CPU: resident set when read
};

/// Starts a peak-memory region on `device` (resets the peak counters).
void reset_peak_memory(const torch::Device& device);
/// Reads the peak since reset_peak_memory (synchronizes the device first).
PeakMemory read_peak_memory(const torch::Device& device);

}  // namespace kiln
