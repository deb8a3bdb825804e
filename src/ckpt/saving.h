// The save machinery behind Checkpointer, shared by its sources (not public API):
//   save_plan.cpp    what each rank saves and writes, checked across ranks; rank 0's draft index
//   save_status.cpp  the status each rank reports while a save is in flight, and the decision
//                    every rank takes from the gathered statuses
//   writer.cpp       the background job: staging to CPU, writing this rank's file
//   commit.cpp       rank 0's commit (index, crash-safe rename, latest) and startup recovery
//   retention.cpp    pruning old checkpoints
//   checkpointer.cpp the Checkpointer and SaveHandle, driving the above
#pragma once

#include <torch/types.h>

#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <stop_token>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "ckpt/internal.h"
#include "core/clock.h"
#include "kiln/checkpoint.h"

namespace kiln::ckpt {

// ---- save planning (save_plan.cpp) ------------------------------------------------------------

/// One rank's account of its save request (step, a hash of the replicated tensors' names, dtypes
/// and shapes, the sharded pieces, rank_state), exchanged at the start of a save. Throws
/// UserError for a request that is wrong on its own: an empty or duplicate name, an undefined
/// tensor, a piece that does not fit in its global shape.
nlohmann::json describe_request(const SaveRequest& request, int rank);

/// The same verdict on every rank from every rank's description: "" when the save may go ahead,
/// else the error (a rank's own error, ranks disagreeing on the step or the replicated tensors,
/// sharded pieces that overlap or do not cover their tensor).
std::string check_descriptions(const std::vector<nlohmann::json>& descs);

/// Who writes what. Pointers into the SaveRequest the plan was made from.
struct SavePlan {
  std::vector<const StateTensor*> replicated;  // sorted by name
  std::vector<int> owner;                      // the rank that writes replicated[k]
  std::vector<const StateTensor*> to_write;    // this rank's file: its pieces, its replicated share
};

/// Each replicated tensor goes to one rank (largest first, to the rank with the fewest bytes so
/// far, sharded bytes included; ties to the lowest rank); every rank writes its own pieces.
/// Deterministic: every rank computes the same owners from the same descriptions.
SavePlan plan_save(const SaveRequest& request, const std::vector<nlohmann::json>& descs, int rank);

/// Rank 0: the index of the save (tensors, their chunks' files, training and rank states) without
/// the files' sizes and hashes and the chunks' byte ranges, which the commit fills in.
nlohmann::json draft_index(const SaveRequest& request, const SavePlan& plan,
                           const std::vector<nlohmann::json>& descs);

// ---- the status exchanged while a save is in flight (save_status.cpp) --------------------------

/// What one rank reports at each exchange (Checkpointer::poll, wait) of a save in flight.
struct SaveStatus {
  enum class Kind {
    kWriting,       // staging or writing this rank's file
    kWritten,       // the file is durable; message: its description (JSON: file, size, ranges)
    kFailed,        // staging or writing failed; message: the error
    kCommitting,    // rank 0: committing (every rank had written)
    kCommitted,     // rank 0: step-<N> is committed; bytes: every rank's files together
    kCommitFailed,  // rank 0: the commit failed; message: the error
  };
  Kind kind = Kind::kWriting;
  std::string message;
  uint64_t bytes = 0;

  bool operator==(const SaveStatus&) const = default;
};

/// "writing", "written", ... (the names encode_save_status writes).
std::string_view save_status_name(SaveStatus::Kind kind);

/// The bytes sent through Communicator::all_gather_bytes: a JSON object
/// {"status": <name>, "message": <string>, "bytes": <unsigned>}.
std::string encode_save_status(const SaveStatus& status);

/// The inverse of encode_save_status. Throws UserError naming `rank` and what is wrong for any
/// other input (not JSON, not an object, an unknown status, a missing, extra or mistyped field).
SaveStatus decode_save_status(std::string_view bytes, int rank);

/// What every rank does after an exchange. Every rank decides from the same gathered statuses, so
/// all take the same action at the same call.
struct SaveDecision {
  enum class Action {
    kWait,       // exchange again later
    kCommit,     // every rank has written: rank 0 commits in its writer thread
    kCommitted,  // resolve the handle as committed (total_bytes)
    kFailed,     // resolve the handle as failed (error)
  };
  Action action = Action::kWait;
  std::string error;         // kFailed: why, naming the rank when there are several
  uint64_t total_bytes = 0;  // kCommitted
};

/// The decision for the save of `step` from every rank's status (index = rank; at least one).
/// Rank 0's commit outcome decides first; otherwise nothing is decided while a rank is writing or
/// rank 0 is committing (a failed rank waits for the others, so no writer is still busy when the
/// save resolves); then the lowest failed rank fails the save; else it is committed.
SaveDecision decide_save(const std::vector<SaveStatus>& statuses, int64_t step);

// ---- the writer job (writer.cpp) ---------------------------------------------------------------

/// Copies `live` into `buffers` (reused across saves, resized as needed; pinned when the source
/// is on CUDA): real copies, never aliases. Returns the copies, named as in `live`.
std::vector<std::pair<std::string, torch::Tensor>> stage(
    std::vector<torch::Tensor>& buffers,
    const std::vector<std::pair<std::string, torch::Tensor>>& live);

// ---- commit and recovery (commit.cpp) ----------------------------------------------------------

/// remove_all, ignoring errors.
void remove_quietly(const std::filesystem::path& path);

/// Rank 0 at startup: puts back what a killed run's commit left half done (step-<N>.replaced
/// without step-<N> becomes step-<N> again), then removes unfinished saves (step-<N>.tmp, a
/// .replaced beside its step-<N>, latest.tmp.*). Throws UserError when a restore fails.
void recover_interrupted_commits(const std::filesystem::path& dir);

// ---- retention (retention.cpp) -----------------------------------------------------------------

/// After the commit of `step`: prune(options.dir, ..., step), logging what it removed. A failure
/// is logged as a warning (the checkpoints are kept), never thrown.
void apply_retention(const CheckpointOptions& options, int64_t step);

}  // namespace kiln::ckpt

namespace kiln {

/// The save in flight: its plan's output, the writer thread and the state it shares with the
/// training thread (under `mutex`).
struct Checkpointer::Job {
  std::shared_ptr<SaveHandle> handle;
  int64_t step = 0;
  int rank = 0;
  /// A one-process world: the writer thread commits as soon as its file is durable (no exchange
  /// of statuses needed), so a save commits while training runs on, the final one during the
  /// final evaluation, instead of at the training thread's next poll or wait.
  bool solo = false;
  CheckpointOptions options;
  std::filesystem::path tmp_dir, final_dir;
  std::vector<std::pair<std::string, torch::Tensor>> tensors;  // this rank's file, CPU tensors
  std::vector<std::pair<std::string, torch::Tensor>>
      sources;                                    // background staging: the live tensors
  std::vector<torch::Tensor>* staging = nullptr;  // ... and the buffers to copy them into
  std::map<std::string, std::string> metadata;
  nlohmann::json index;  // rank 0: the draft index (ckpt::draft_index)
  SteadyClock::time_point begin;

  std::mutex mutex;
  std::condition_variable_any cv;
  ckpt::SaveStatus status;  // what this rank reports at the next exchange
  double write_seconds = 0, staging_seconds = 0;
  bool staged = true;  // false while background staging has not copied `sources` yet
  uint64_t bytes_written = 0;
  bool commit_requested = false;
  std::vector<ckpt::SaveStatus> gathered;  // rank 0: every rank's kWritten status, for the commit
  // Declared last, so it is stopped and joined before the members it uses are destroyed.
  std::jthread thread;

  /// The writer thread (writer.cpp): stages (background_staging), writes this rank's file, and on
  /// rank 0 waits for commit_requested (solo: requests it itself) and commits, unless `stop` is
  /// requested first.
  void run(std::stop_token stop);
  /// Rank 0, after every rank's file is durable (commit.cpp): index.json, the crash-safe rename,
  /// latest, retention. Returns every rank's files' bytes together. Throws UserError.
  uint64_t commit();
  /// Asks the writer thread to stop (rank 0's stops waiting for a commit decision; a commit it
  /// has begun is finished) and joins it. After this, the thread's results may be read unlocked.
  void finish_thread() {
    thread.request_stop();
    if (thread.joinable()) thread.join();
  }
};

}  // namespace kiln
