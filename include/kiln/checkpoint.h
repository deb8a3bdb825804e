// Checkpoints: the full training state in per-rank safetensors files plus a checksummed index,
// committed atomically, saved synchronously or in the background, loaded at any world size.
//
// On disk (docs/checkpoint-format.md): <dir>/step-<N>/ holds rank-<r>.safetensors for every rank r
// of the saving world and index.json (format version, step, world size, every logical tensor's
// dtype, global shape and chunks, every file's size and xxh3, the training state). A save writes
// into step-<N>.tmp/, fsyncs each file, waits for every rank, then rank 0 writes index.json,
// fsyncs it, renames the directory to step-<N>, fsyncs <dir> and updates <dir>/latest. A
// directory without a valid index (a .tmp one in particular) is never loaded.
//
// Every function that takes a Communicator is collective: every rank calls it, in the same order,
// from its training thread (the Communicator's rule). They return the same outcome on every rank:
// when one rank fails, all throw.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "kiln/comm.h"
#include "kiln/train.h"

namespace kiln {

inline constexpr int kCheckpointFormatVersion = 1;

// ---- the state to save
// ---------------------------------------------------------------------------

/// How a logical tensor is spread over the ranks.
enum class Placement {
  kReplicated,  // every rank holds the whole tensor, identical (DDP); written once, by one rank
  kSharded,     // each rank holds one piece of it at `offsets` (FSDP-style); every piece is written
};

/// One tensor of a rank's state. Save reads `tensor`; load writes into it in place.
struct StateTensor {
  StateTensor() = default;
  /// A replicated tensor: every rank holds all of it.
  StateTensor(std::string name, torch::Tensor tensor)
      : name(std::move(name)), tensor(std::move(tensor)) {}
  /// A sharded piece: `tensor` sits at `offsets` of a whole tensor of `global_shape`.
  StateTensor(std::string name, torch::Tensor tensor, std::vector<int64_t> global_shape,
              std::vector<int64_t> offsets)
      : name(std::move(name)),
        tensor(std::move(tensor)),
        placement(Placement::kSharded),
        global_shape(std::move(global_shape)),
        offsets(std::move(offsets)) {}

  std::string name;      // logical name, unique in the checkpoint ("model/<param>", "optim/...")
  torch::Tensor tensor;  // this rank's whole tensor (replicated) or piece (sharded); any device
  Placement placement = Placement::kReplicated;
  std::vector<int64_t> global_shape;  // sharded: the whole tensor's shape (ignored if replicated)
  std::vector<int64_t> offsets;       // sharded: index of tensor[0, ..., 0] in the whole tensor
  /// Sharded: which of this rank's boxes of `name` this is, when it holds several that are not
  /// one box (a fused tensor-parallel weight's slice: one per fused block). Box k > 0 is stored
  /// in the rank's file as "<name>#k" (stored_name()); the index lists each as a chunk of `name`.
  int part = 0;
  std::string stored_name() const { return part == 0 ? name : name + "#" + std::to_string(part); }
};

/// What one rank hands to Checkpointer::save.
struct SaveRequest {
  int64_t step = 0;  // the same on every rank
  std::vector<StateTensor>
      tensors;                    // this rank's tensors; replicated ones listed alike on every rank
  nlohmann::json rank_state;      // this rank's small state (loader position, RNG tensor names)
  nlohmann::json training_state;  // the run's state (step, epoch, schedule...); rank 0's is kept
};

// ---- saving ------------------------------------------------------------------------------------

struct CheckpointOptions {
  std::filesystem::path dir;  // holds step-<N>/ directories and `latest`
  int64_t keep_last_k = 3;    // committed checkpoints kept (>= 2)
  int64_t keep_every = 0;     // steps that are multiples of this are kept for good (0 = none)
  bool async = true;          // stage to CPU and write in a background thread
  /// Async only: copy the tensors to CPU in the background thread too, so save() returns at once.
  /// The caller must then not change the saved tensors until wait_for_staging() returns (the
  /// CheckpointHook fences before the optimizer step: the copy overlaps data, forward, backward).
  bool background_staging = false;
};

/// Timings and sizes of one save, on this rank.
struct SaveStats {
  uint64_t bytes_written = 0;        // this rank's file
  uint64_t total_bytes = 0;          // every rank's files (known once committed)
  double stall_seconds = 0;          // the caller blocked in save(): agreeing, staging, waiting
  double wait_previous_seconds = 0;  // of which: waiting for the previous save to finish
  double staging_seconds = 0;        // copying the state to CPU (async; in the background with
                                     // background_staging, else part of the stall)
  double write_seconds = 0;          // writing and fsyncing this rank's file
  double total_seconds = 0;          // save() called -> committed or failed
};

/// The outcome of one save, shared between the Checkpointer and the caller. It is resolved by the
/// Checkpointer's collective calls (save, poll, wait), so every rank sees the same outcome at the
/// same call. Thread-safe to read.
class SaveHandle {
 public:
  int64_t step() const { return step_; }
  /// True once the save is committed or has failed.
  bool finished() const;
  /// True once step-<N> is committed (renamed, with a valid index) on disk.
  bool committed() const;
  /// Why the save failed ("" while pending or when committed), naming the rank and file.
  std::string error() const;
  /// Throws UserError(error()) when the save failed.
  void rethrow_if_failed() const;
  SaveStats stats() const;

 private:
  friend class Checkpointer;
  explicit SaveHandle(int64_t step) : step_(step) {}
  int64_t step_;
  mutable std::mutex mutex_;
  bool finished_ = false, committed_ = false;
  std::string error_;
  SaveStats stats_;
};

/// Writes checkpoints of one run into options.dir. One per process; not thread-safe (the training
/// thread calls it). At most one save is in flight: a new save first waits for the previous one.
class Checkpointer {
 public:
  /// `comm` must outlive the Checkpointer. Rank 0 creates options.dir, restores a step-<N> that a
  /// killed run left as step-<N>.replaced only, and removes step-*.tmp directories (and other
  /// leftovers) of a killed run. Collective. Throws UserError (e.g. unwritable dir).
  Checkpointer(CheckpointOptions options, Communicator& comm);
  /// Joins the background writer. A commit rank 0 had begun is finished; any other save not
  /// committed yet is abandoned: rank 0 removes its .tmp directory (call wait() first to commit
  /// it). Rank 0 logs which of the two happened.
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  /// Saves `request` as step-<request.step>. Collective. Waits for the save in flight first (and
  /// logs how long). Async: copies every tensor to CPU (real copies, never aliases of the live
  /// state; with background_staging in the writer thread, see wait_for_staging) and returns while
  /// a background thread writes; sync: writes the tensors as they are and returns when committed.
  /// Throws UserError for an inconsistent request (ranks disagree on the step or on the replicated
  /// tensors, a duplicate name, shards that do not tile their tensor). Write errors (ENOSPC, ...)
  /// do not throw: they fail the handle, the previous checkpoints stay intact.
  std::shared_ptr<const SaveHandle> save(SaveRequest request);
  /// Advances the save in flight (one small all-gather when one is in flight, nothing otherwise):
  /// when every rank has written its file, rank 0 commits in the background; once committed or
  /// failed, the handle resolves. Collective. Call once per training step.
  void poll();
  /// Blocks until the save in flight resolves (and logs how long it waited). Collective.
  void wait();
  /// With background_staging: blocks until the save in flight has copied the tensors it was given
  /// (after that, changing them is safe). Returns the seconds it blocked. Not collective; cheap
  /// when there is nothing to wait for.
  double wait_for_staging();
  /// True while a save is in flight (the same on every rank).
  bool in_flight() const { return job_ != nullptr; }
  /// The most recent save's handle, or nullptr.
  std::shared_ptr<const SaveHandle> last() const { return last_; }
  const CheckpointOptions& options() const { return options_; }

 private:
  struct Job;
  void advance(bool blocking);
  void resolve(const std::string& error, uint64_t total_bytes);

  CheckpointOptions options_;
  Communicator& comm_;
  std::unique_ptr<Job> job_;
  std::shared_ptr<SaveHandle> last_;
  std::vector<torch::Tensor> staging_;  // reusable CPU copies for async saves
};

/// Removes committed checkpoints beyond the retention policy: keeps the highest keep_last_k steps,
/// every step that is a multiple of keep_every, and always the highest one; never touches .tmp
/// directories. (A commit also never prunes the step it just committed.) Returns the removed
/// directories. Single-process (rank 0 calls it).
std::vector<std::filesystem::path> prune_checkpoints(const std::filesystem::path& dir,
                                                     int64_t keep_last_k, int64_t keep_every);

// ---- reading -----------------------------------------------------------------------------------

struct ChunkInfo {
  std::string file;              // a file of the checkpoint directory (a plain name)
  std::string name;              // the tensor's name inside that safetensors file
  std::vector<int64_t> offsets;  // where the chunk starts in the whole tensor
  std::vector<int64_t> sizes;    // the chunk's shape
  uint64_t byte_begin = 0;       // absolute byte range of the chunk in the file
  uint64_t byte_end = 0;
};

struct TensorInfo {
  std::string name;
  torch::ScalarType dtype = torch::kFloat;
  std::vector<int64_t> shape;  // the whole tensor's shape
  Placement placement = Placement::kReplicated;
  std::vector<ChunkInfo> chunks;  // tile the whole tensor exactly
  uint64_t bytes() const;
};

struct FileInfo {
  std::string name;  // "rank-<r>.safetensors"
  int rank = 0;      // the rank that wrote it
  uint64_t size_bytes = 0;
  uint64_t xxh3 = 0;  // of the whole file
};

/// A parsed, validated index.json.
struct CheckpointIndex {
  int format_version = kCheckpointFormatVersion;
  int64_t step = 0;
  int world_size = 1;
  std::string created_utc;
  std::vector<FileInfo> files;
  std::vector<TensorInfo> tensors;  // sorted by name
  nlohmann::json training_state;    // as saved by rank 0
  nlohmann::json ranks;             // array: each saving rank's rank_state
  /// The tensor named `name`, or nullptr.
  const TensorInfo* find(std::string_view name) const;
  uint64_t total_file_bytes() const;
};

/// Parses and validates index.json text: known format version, file names that are plain names
/// (no '/', no "..", not absolute), chunks inside their tensor that tile it exactly and whose
/// byte ranges match their shape and dtype, the index's own checksum. Throws UserError naming
/// `source` and the offending field.
CheckpointIndex parse_checkpoint_index(std::string_view json_text, const std::string& source);
/// Reads <step_dir>/index.json. Throws UserError (missing: "not a committed checkpoint").
CheckpointIndex read_checkpoint_index(const std::filesystem::path& step_dir);

struct VerifyReport {
  std::vector<std::string> problems;  // one line each, naming the file
  uint64_t bytes_checked = 0;
  bool ok() const { return problems.empty(); }
};

/// Checks a checkpoint fully, in this process: the index, every file's size and xxh3, and that
/// each file's safetensors header holds every chunk the index names at the byte range it names.
/// Never throws: every problem (a missing or invalid index included) is in the report. Any thread.
VerifyReport verify_checkpoint(const std::filesystem::path& step_dir);

struct LoadOptions {
  bool verify = true;  // check every file's xxh3 (each file hashed once, spread over the ranks)
  /// The step directory's index when the caller has read it already (locate_resume): used as it
  /// is, not read again. Null: read it. Must outlive the load_checkpoint call.
  const CheckpointIndex* index = nullptr;
};

struct LoadResult {
  std::filesystem::path path;  // the step directory loaded
  CheckpointIndex index;
  uint64_t bytes_read = 0;  // tensor bytes this rank read (not counting hashing)
  double seconds = 0;
};

/// Loads the tensors named by `targets` (this rank's view: whole tensors for replicated, the piece
/// at `offsets` for sharded) from a checkpoint saved at any world size. Each rank reads only the
/// byte ranges overlapping its targets. Nothing is written into a target before every file has
/// been verified on every rank. Collective. Throws UserError: a target missing from the checkpoint
/// or with another dtype/shape, a checksum mismatch, an unreadable file.
LoadResult load_checkpoint(const std::filesystem::path& step_dir, std::vector<StateTensor>& targets,
                           Communicator& comm, LoadOptions options = {});

struct CheckpointEntry {
  int64_t step = 0;
  std::filesystem::path path;
  bool committed = false;  // false for step-<N>.tmp (being written, or left by a killed run)
};

/// The step-<N> and step-<N>.tmp directories in `dir`, oldest step first. Empty if `dir` is absent.
std::vector<CheckpointEntry> list_checkpoints(const std::filesystem::path& dir);

/// A step directory for a user-given path: `path` itself when it holds index.json, else the newest
/// committed step-<N> inside it. Throws UserError when there is none.
std::filesystem::path resolve_checkpoint_path(const std::filesystem::path& path);

/// Tries the committed checkpoints in `dir` from the newest; one that fails to load (bad index,
/// checksum mismatch, missing tensor) is reported with log::warn and the previous one is tried.
/// Returns nullopt when `dir` holds no committed checkpoint; throws UserError when it holds some
/// but none loads. Collective.
std::optional<LoadResult> load_latest_checkpoint(const std::filesystem::path& dir,
                                                 std::vector<StateTensor>& targets,
                                                 Communicator& comm, LoadOptions options = {});

/// Writes the whole tensors of a checkpoint (model parameters, and the optimizer state when
/// `include_optimizer`) into one standard safetensors file, reassembling sharded tensors. Model
/// tensors keep their model names ("transformer.wte.weight"); optimizer tensors keep their logical
/// names ("optim/..."). Verifies checksums first. Returns the number of tensors written.
/// Single-process. Throws UserError.
int64_t consolidate_checkpoint(const std::filesystem::path& step_dir,
                               const std::filesystem::path& out, bool include_optimizer);

// ---- training integration ---------------------------------------------------------------------

/// checkpoint.dir resolved for a run in `run_dir` ("" -> <run dir>/checkpoints). A run resolves
/// it once (kiln/job.h resolve_job).
std::filesystem::path checkpoint_directory(const Config& config,
                                           const std::filesystem::path& run_dir);
/// The [checkpoint] section resolved for a run (checkpoint_directory, then the store's keys).
CheckpointOptions checkpoint_options(const Config& config, const std::filesystem::path& run_dir);

/// What a training checkpoint records about the run that saved it (capture_training_state).
struct CheckpointRecord {
  std::string config_hash;            // the run's Config::hash() ("" : not recorded)
  nlohmann::json settings = nullptr;  // the checkpoint settings a resumed run keeps (null: none)
  std::filesystem::path manifest;     // the run's manifest.json ("" : none)
};

/// Everything `kiln train`'s checkpointing reads, resolved once from the config
/// (training_checkpoint_options): the store, when to save, what each save records.
struct TrainingCheckpointOptions {
  CheckpointOptions store;          // the [checkpoint] section, dir resolved
  int64_t every_steps = 0;          // checkpoint.every_steps (0: no periodic saves)
  bool save_final = true;           // checkpoint.save_final
  bool stop_on_error = true;        // checkpoint.on_save_error = "stop" (else "continue")
  int preempt_timeout_seconds = 0;  // checkpoint.preempt_timeout_seconds
  CheckpointRecord record;          // manifest: <run dir>/manifest.json
};
/// The [checkpoint] section of `config` for a run in `run_dir` saving into `checkpoint_dir`
/// (checkpoint_directory's, resolved by the caller).
TrainingCheckpointOptions training_checkpoint_options(const Config& config,
                                                      const std::filesystem::path& run_dir,
                                                      const std::filesystem::path& checkpoint_dir);

/// The Trainer's full state as this rank's SaveRequest: model parameters and buffers
/// ("model/<name>") and optimizer state ("optim/<name>"), replicated; this rank's CPU (and CUDA)
/// RNG state ("rng/rank-<r>/cpu"); rank state: loader position and RNG names; training state:
/// step, epoch, optimizer steps, LR-schedule state, grad scaler (null), and `record` (config
/// hash, the checkpoint settings, the manifest's path and hash).
SaveRequest capture_training_state(Trainer& trainer, Communicator& comm,
                                   const CheckpointRecord& record = {});

/// Restores a Trainer from the checkpoint at `step_dir` (or, with `dir_fallback`, the newest
/// loadable one in that directory): parameters, optimizer state and steps, step, loader position
/// (converted when the world size changed), RNG states. Warns when the LR schedule differs, and
/// when `config_hash` is given and differs from the saved one. Returns what was loaded, or
/// nullopt when `dir_fallback` found no checkpoint. Collective.
std::optional<LoadResult> restore_training_state(Trainer& trainer, Communicator& comm,
                                                 const std::filesystem::path& path,
                                                 bool dir_fallback,
                                                 const std::string& config_hash = "");

/// Where `kiln train --resume` continues from, located once before anything is written
/// (locate_resume) and handed to resume_config, check_train_start and attach_checkpointing, so
/// the checkpoint directory is searched and the index read once per process.
struct ResumePlan {
  std::string argument;          // "" (fresh), "auto", or a path, as given
  std::filesystem::path search;  // "auto": the checkpoint directory; else the given path
  bool exact = false;            // `search` is a step directory: no falling back past it
  /// The checkpoint to load first: the newest committed one whose index reads (or `search`
  /// itself when exact), and that index. Empty for a fresh start or when none reads.
  std::optional<std::filesystem::path> step_dir;
  std::optional<CheckpointIndex> index;
  bool any_committed = false;  // `search` holds a committed checkpoint (readable or not)
  /// The run continues an earlier history (it appends to metrics.jsonl): a checkpoint to load,
  /// or committed ones that do not read (the load then says why).
  bool continues() const { return step_dir.has_value() || any_committed; }
};
/// Locates the checkpoint `resume` names ("" fresh, "auto" the newest in `checkpoint_dir`, or a
/// step directory or a directory of them). Throws UserError for a path that does not exist, or
/// one that holds no committed checkpoint. Not collective: every rank reads the same files.
ResumePlan locate_resume(const std::string& resume, const std::filesystem::path& checkpoint_dir);

/// The periodic checkpointer as a TrainerHook: saves every checkpoint.every_steps steps (and at
/// the end with checkpoint.save_final), polls the save in flight after every step, waits for it at
/// the end. Async saves stage in the background; the hook fences on the staging before the next
/// optimizer step (on_gradients_ready), the first moment the saved tensors change. A failed save
/// stops training with a TrainingError (checkpoint.on_save_error = "stop") or is logged and
/// training continues ("continue"). Training thread only.
class CheckpointHook : public TrainerHook {
 public:
  /// `comm` must outlive the hook (the session holds both).
  CheckpointHook(const TrainingCheckpointOptions& options, Communicator& comm);
  void on_train_begin(Trainer& trainer) override;
  void on_gradients_ready(Trainer& trainer) override;
  void on_step_end(Trainer& trainer, const StepStats& stats) override;
  void on_train_end(Trainer& trainer) override;
  Checkpointer& checkpointer() { return checkpointer_; }
  /// Commits a checkpoint of the trainer's current step now, unless one is already committed or
  /// in flight for it, and waits for every save to finish (preemption). Collective; throws like
  /// a failed save does.
  void save_now(Trainer& trainer);
  /// Every save this hook started, in order.
  const std::vector<std::shared_ptr<const SaveHandle>>& saves() const { return saves_; }

 private:
  void save(Trainer& trainer);
  void check();
  int64_t every_steps_;
  bool save_final_;
  bool stop_on_error_;
  Communicator& comm_;
  CheckpointRecord record_;
  Checkpointer checkpointer_;
  std::vector<std::shared_ptr<const SaveHandle>> saves_;
  size_t checked_ = 0;
  int64_t last_saved_step_ = -1;
};

/// Graceful preemption for `kiln train`. attach_preemption installs handlers for SIGTERM and
/// SIGUSR1 (Slurm's --signal=USR1@<seconds>). Before every step the ranks agree whether any of them
/// was signalled (one small all-gather per step when world > 1, none in a world of one); once one
/// was, every rank stops before that same step: the CheckpointHook (when checkpointing is on)
/// waits for an in-flight save and commits one of this step synchronously, then the hook throws
/// Preempted (the CLI exits 75). A second SIGTERM, or checkpoint.preempt_timeout_seconds passing
/// after the first signal, ends the process at once; the last committed checkpoint stays intact.
/// Add it after the CheckpointHook (attach_preemption does).
class PreemptionHook : public TrainerHook {
 public:
  /// `comm` must outlive the hook (the session holds both).
  PreemptionHook(Communicator& comm, std::shared_ptr<CheckpointHook> checkpoints);
  void on_step_begin(Trainer& trainer, int64_t step) override;

 private:
  Communicator& comm_;
  std::shared_ptr<CheckpointHook> checkpoints_;  // null when the run saves no checkpoints
};

/// Installs the signal handlers (`timeout_seconds`: checkpoint.preempt_timeout_seconds) and adds
/// a PreemptionHook to `trainer`. `checkpoints` is attach_checkpointing's hook (may be null).
std::shared_ptr<PreemptionHook> attach_preemption(Trainer& trainer, Communicator& comm,
                                                  std::shared_ptr<CheckpointHook> checkpoints,
                                                  int timeout_seconds);

/// What to tell the user about a failed checkpoint write or commit, from the error text's cause
/// (strerror): ENOSPC/EDQUOT/EFBIG: free space (and checkpoint.on_save_error = "continue", when
/// `continuable`); EACCES/EPERM/EROFS: permissions; ENOENT: another process removed a path kiln
/// created (a second run in the directory?). `dir` is the checkpoint directory.
std::string checkpoint_error_advice(const std::string& error, const std::filesystem::path& dir,
                                    bool continuable);

/// The tensors of a checkpoint whose names start with `prefix` ("model/", "optim/"), whole
/// (reassembled from every rank's chunks), in name order, on the CPU. Verifies the checksums first
/// when `verify`. Single-process; throws UserError naming the step directory.
std::vector<std::pair<std::string, torch::Tensor>> read_checkpoint_tensors(
    const std::filesystem::path& step_dir, const std::string& prefix, bool verify);

/// The directory of step `step` in checkpoint directory `dir` (<dir>/step-<step>), committed or
/// not.
std::filesystem::path checkpoint_step_dir(const std::filesystem::path& dir, int64_t step);
/// Whether `step_dir` holds a committed checkpoint (its index file exists).
bool checkpoint_committed(const std::filesystem::path& step_dir);

/// For `kiln train`, before the run directory opens (so that bad input writes nothing,
/// metrics.jsonl included), with the model the run will train (built once): when the run saves
/// checkpoints (every_steps > 0), refuses what attach_checkpointing would refuse and can be seen
/// already: a fresh start into a checkpoint directory holding committed checkpoints, a resume
/// from a step directory older than the directory's newest. On a resume it also checks that the
/// checkpoint `plan` loads first holds exactly the model and optimizer tensors `model` and
/// `optim` make (the checkpoint's recorded names, shapes and dtypes against the model's and the
/// optimizer's on meta tensors), naming the first difference: `--resume` restores a run exactly;
/// model.init_from loads a subset. Throws UserError naming the directory and the fix. Not
/// collective.
void check_train_start(const ResumePlan& plan, const TrainingCheckpointOptions& options,
                       Model& model, const OptimOptions& optim);

/// For `kiln train --resume`: `config` with the checkpoint settings of the run it continues
/// (checkpoint.every_steps, keep_last_k, keep_every, save_final, async, on_save_error, as the
/// checkpoint `plan` loads first recorded them), except the keys named in `explicit_keys` (those
/// given with --set, "section.key"), so a resumed run keeps saving as it did. `config` unchanged
/// for a fresh start or a checkpoint that recorded no settings. Reads no file.
Config resume_config(const Config& config, const ResumePlan& plan,
                     const std::vector<std::string>& explicit_keys);

/// For `kiln train`: resumes the trainer from `plan` (the checkpoint it located, falling back
/// past damaged ones in a directory; a fresh start when there is none and the argument was
/// "auto"), and adds a CheckpointHook when options.every_steps > 0. When it saves, the checkpoint
/// directory must hold one history: a fresh start into a directory with committed checkpoints,
/// or a resume at a step older than one of them, throws UserError naming those checkpoints and
/// the fix, before anything is written. Returns the hook (nullptr when none). Collective.
std::shared_ptr<CheckpointHook> attach_checkpointing(Trainer& trainer, Communicator& comm,
                                                     const TrainingCheckpointOptions& options,
                                                     const ResumePlan& plan);

}  // namespace kiln
