// The composition root. A training job is resolved once from its validated Config into typed
// options (resolve_job), and every training the CLI starts (`kiln train`, the pilot, the
// baseline, compile, profile, scale and checkpoint rungs, the ladder) is composed from it by the
// two functions below, the only places that install the pieces of a step:
//
//   compose_step      Trainer <- model, data  (TrainerSetup)
//                     1. activation checkpointing   train.activation_checkpointing = "block"
//                     2. parallel layout            DDP or FSDP over the process group
//                     3. compilation                compile.backend: the step, or each unit
//                     4. capture                    a CUDA graph of the step as composed so far
//   compose_training  the run around it: lock (once) -> model and data (built once) -> resume
//                     pre-check -> run directory and manifest -> compose_step -> resume ->
//                     hooks, in this order: plan tracking, checkpointing, preemption,
//                     TensorBoard, the plan tracker's final record.
//
// Why this order: unit wrappers compose outermost first, so activation checkpointing must wrap
// FSDP's gather (its recomputation in backward gathers again) and both must wrap the compiled
// unit (the package runs on gathered, unsharded parameters); the layout must exist before
// compilation binds the parameters the optimizer steps and before DDP's gradient hooks can see
// the compiled step's gradients; a capture records whatever the step is by then. Each piece's
// attach function records its kiln::CompositionStage on the Trainer and refuses to be installed
// out of this order (std::logic_error), so a program composing by hand gets the same order or a
// clear refusal. Hooks run in the order added (kiln/train.h TrainerHook); the checkpoint hook
// comes after plan tracking so a save after a step is time between steps.
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kiln/checkpoint.h"
#include "kiln/compile.h"
#include "kiln/config.h"
#include "kiln/dist.h"
#include "kiln/run.h"
#include "kiln/train.h"

namespace kiln {

/// How a training process was asked to start (the command line's part of a job).
struct JobRequest {
  /// "" a fresh run; "auto" the newest valid checkpoint in the checkpoint directory (a fresh run
  /// when there is none); otherwise a step directory or a directory of them.
  std::string resume{};
  /// A fresh run in a run directory holding another run's records moves them into
  /// <run dir>/previous-<UTC time>/ first (else refused). Not with `resume`.
  bool overwrite = false;
  /// The keys set over the config file (--set, "section.key"): a resumed run keeps the saved
  /// checkpoint settings except these.
  std::vector<std::string> set_keys{};
  /// The command line recorded in manifest.json and the run lock.
  std::vector<std::string> argv{};
};

/// A training job resolved once: every component's options, the directories, the resume target
/// located and its index read. Built by resolve_job before anything is written; read-only after.
struct Job {
  Config config{};  // validated, with a resumed run's kept checkpoint settings applied
  JobRequest request{};
  std::filesystem::path run_dir{};         // run_directory(config)
  TrainingCheckpointOptions checkpoint{};  // checkpoint.dir resolved once
  ResumePlan resume{};                     // where --resume continues from
  RuntimeOptions runtime{};                // threads, determinism, seed, run.device
  TrainerSetup trainer{};                  // [train], [optim], the loader's [data] keys
  CompileOptions compile{};                // [compile]
  DataParallelOptions ddp{};               // [dist] for DDP
  FsdpOptions fsdp{};                      // [dist] for FSDP
  ProcessGroupOptions group{};             // [dist]: launcher, backend, strategy
  /// The step fit() trains to in this process: train.stop_after_step, else train.steps.
  int64_t last_step() const {
    const TrainOptions& train = trainer.train;
    return train.stop_after_step > 0 ? train.stop_after_step : train.steps;
  }
};

/// Resolves `config` (validated) and `request` into a Job: the run and checkpoint directories
/// (once), the resume target (located once; its recorded checkpoint settings applied, except
/// the keys set), every options struct. Writes nothing; the inputs (kiln/training_run.h
/// check_job_inputs) and the compile setup (check_compile_start) are the caller's to check, as
/// `kiln config validate` does. Throws UserError.
Job resolve_job(const Config& config, const JobRequest& request = {});

struct ComposedStep;

/// What compose_step installs besides activation checkpointing and the layout.
struct StepComposition {
  bool compile = true;  // the job's compile.backend (eager: nothing)
  /// The pilot: the production world (plan.gpus) whose "auto" layout it runs scaled down
  /// (StrategyWorld::production_world_size); 0: this world is production.
  int production_world_size = 0;
  /// Runs after the layout and before compilation: a resume restores the state there, so the
  /// compiled step binds the restored tensors (compose_training's resume and first hooks).
  std::function<void(ComposedStep&)> before_compilation{};
};

/// A Trainer with its step composed, and the pieces installed on it (null where not installed).
struct ComposedStep {
  std::unique_ptr<Trainer> trainer;
  /// With a parallel process group: the layout dist.strategy resolved to, and why.
  StrategyChoice strategy{Parallelism::kNone, {}, "", nullptr};
  /// The mesh the world runs: dp_replicate x dp_shard x tp (1 x 1 x 1 in one process).
  MeshShape mesh{};
  std::shared_ptr<DataParallel> ddp;
  std::shared_ptr<FullyShardedDataParallel> fsdp;
  std::shared_ptr<CompiledStep> compiled;
  std::shared_ptr<CapturedGraphStep> captured;
};

/// Builds the Trainer of `job` around `model` and `data` and installs, in CompositionStage
/// order, activation checkpointing, the parallel layout (when `options.comm` is parallel: DDP or
/// FSDP as dist.strategy resolves for this model; then each rank's own RNG stream), compilation
/// and capture. `options` places it (device, rank, world, comm). Throws UserError.
ComposedStep compose_step(const Job& job, std::shared_ptr<Model> model, Datasets data,
                          const TrainerOptions& options, const StepComposition& composition = {});

/// What compose_training adds around the step.
struct TrainingComposition {
  StepComposition step;
  bool checkpointing = false;  // resume from job.resume and the CheckpointHook ([checkpoint])
  bool preemption = false;     // SIGTERM/SIGUSR1: finish the step, commit, throw Preempted
  bool tensorboard = false;    // TensorBoard scalars beside metrics.jsonl
  bool plan_tracking = false;  // the plan's forecast for this run, and the run tracked against it
  /// The run's records: see RunOptions. A run that continues (job.resume) appends.
  std::string metrics_file = "metrics.jsonl";
  /// A fresh run's records in a directory holding another run's: refused unless moved aside
  /// (job.request.overwrite, or resume = "auto" finding nothing). kReplace: a rung's own files.
  RunOptions::Existing existing_records = RunOptions::Existing::kReplace;
  bool check_records = false;  // apply existing_records before the run opens (kiln train)
  std::string rung = {};       // a rung run alone: its records apart (RunOptions::rung)
};

struct Session;

/// Composes a whole training run of `job` in this process (or as one rank of `comm`; null: the
/// launcher's process group, kiln/dist.h process_communicator): locks the run and checkpoint
/// directories once for every rank, applies the runtime settings, builds the datasets and the
/// model once, checks what a resume or a fresh start into the checkpoint directory would refuse
/// (before anything is written), opens the run directory (manifest.json), composes the step
/// (compose_step), resumes, and adds the hooks. Throws UserError. Collective.
std::unique_ptr<Session> compose_training(const Job& job, std::shared_ptr<Communicator> comm,
                                          const TrainingComposition& composition);

/// The number of times this process built a model, resolved a checkpoint directory, took a
/// directory lock and read a resume index since reset_composition_counts (tests count one run).
struct CompositionCounts {
  int64_t model_builds = 0, checkpoint_dir_resolutions = 0, directory_locks = 0,
          resume_index_reads = 0;
};
CompositionCounts composition_counts();
void reset_composition_counts();

}  // namespace kiln
