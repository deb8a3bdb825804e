// `kiln train` as a library function: the CLI's `kiln train`, the rungs' child processes (the
// checkpoint drill's and the pilot's restores) and a program of one's own (examples/custom_model)
// all train through run_training, so what the CLI can do, the library can.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "kiln/compile.h"
#include "kiln/config.h"
#include "kiln/job.h"
#include "kiln/train.h"

namespace kiln {

/// How `kiln train` was asked to start: --resume, --overwrite, the keys set, the command line
/// (kiln/job.h JobRequest, the command line's part of a job).
using TrainingRunOptions = JobRequest;

struct TrainingRunResult {
  TrainSummary summary;
  std::filesystem::path run_dir;
  /// checkpoint.every_steps = 0: the run saved nothing (the summary says how to keep it).
  bool saved_nothing = false;
  /// A resumed run already at its last step trains nothing: the step it is at (else -1).
  int64_t already_at_step = -1;
  /// With compile.backend other than "eager": the compiled step's report (graphs, recompiles).
  std::optional<CompileReport> compile_report;
  /// The rate the run achieved per device (the model's FLOPs per sample x its samples/s) and
  /// the device's peaks it compares with: the catalog's for the device (0: no row, e.g. a CPU)
  /// and the job's GEMM timed on it after training (0: not timed; a run shorter than
  /// kRateMinSeconds is not, the timing would be a noticeable share of it).
  static constexpr double kRateMinSeconds = 5.0;
  double achieved_flops_per_second = 0;
  double catalog_peak_flops_per_second = 0;
  double matmul_peak_flops_per_second = 0;
};

/// Checks a config's inputs beyond its rules, cheaply and before anything is written: run.device
/// = "cuda" needs a CUDA device; data.path (and data.val_path) must exist and a token file must
/// open for reading (never read or hashed here). `kiln config validate` and every command that
/// trains call it. Throws UserError with the line the run itself would stop with.
void check_job_inputs(const Config& config);

/// Trains `config` as `kiln train` does, in this process (or as one rank under torchrun):
/// checks the inputs (check_job_inputs, the compile backend), locks the run and checkpoint
/// directories (a second run into them is refused naming the holder), checks `resume`, opens the
/// run directory (manifest.json, metrics.jsonl, TensorBoard scalars), attaches checkpointing
/// ([checkpoint], `resume`), the compiled step ([compile]) and graceful preemption (SIGTERM /
/// SIGUSR1: the step finishes, a checkpoint is committed, Preempted is thrown), and trains to
/// train.steps. Prints progress as run.progress says; the caller prints the summary.
/// Throws UserError (bad input: nothing written), TrainingError (a failed run), Preempted.
/// Call from the thread that owns the process's signal handling; one at a time per process.
TrainingRunResult run_training(const Config& config, const TrainingRunOptions& options);

/// What `kiln train` prints when a run ends: steps, time, first and last loss, val loss (and
/// accuracy), throughput, skipped steps, the compiled step's graphs, the run directory.
std::string training_summary_text(const TrainingRunResult& result);

/// For a program of one's own that registers its own model or dataset (examples/custom_model).
/// The checkpoint drill and the pilot start fresh training processes as
///   <program> train CONFIG [--set KEY=VALUE]... [--resume auto|CHECKPOINT] [--overwrite]
/// with <program> = $KILN_EXECUTABLE (else the `kiln` beside this program), and `kiln` knows only
/// the built-in models. Call this in main() after registering and before anything else: it sets
/// KILN_EXECUTABLE to this program (unless already set), and when argv is such a `train` command
/// it runs it through run_training, prints the summary line (or one error line on stderr) and
/// returns the exit status: 0, 2 user error, 3 training failure, 75 preempted, 1 internal error.
/// For any other command line it returns nullopt and the program goes on.
std::optional<int> serve_training_command(int argc, char** argv);

}  // namespace kiln
