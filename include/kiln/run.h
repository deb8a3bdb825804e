// A run directory: <run.dir>/<run.name>/ holding config.toml (resolved), manifest.json,
// metrics.jsonl, train.log and each rung's <rung>.json. Only the writer (rank 0) writes files;
// other ranks get a Run whose writes are no-ops, so callers never branch on rank.
//
// An existing run directory is reused: config.toml, manifest.json, metrics.jsonl and the rung
// files are replaced (metrics.jsonl is appended to when RunOptions::append_metrics is set, as on
// --resume); train.log is always appended to; anything else (checkpoints in particular) is left
// alone.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "kiln/config.h"

namespace kiln {

struct RunOptions {
  std::vector<std::string> argv;               // the command line, recorded in the manifest
  bool writer = true;                          // false on ranks other than 0
  std::string metrics_file = "metrics.jsonl";  // the ladder gives each rung its own
  bool append_metrics = false;  // keep earlier records (a resumed run); else start the file anew
  /// A run that does not append, in a directory that holds another run's records (the metrics
  /// file, train.log, TensorBoard event files): kReplace starts them anew (the ladder's own rung
  /// records); kRefuse throws UserError naming them and the fix (--resume auto, --overwrite,
  /// run.name) before anything is written; kMoveAside moves them into <dir>/previous-<UTC time>/
  /// and logs where (--overwrite).
  enum class Existing { kReplace, kRefuse, kMoveAside };
  Existing existing_records = Existing::kReplace;
  /// A rung run alone ("baseline", "profile", ...; empty for kiln train and the ladder): its
  /// records never replace a training run's. Its steps go to metrics-<rung>.jsonl (as in the
  /// ladder) and its log to <rung>.log; and where the directory holds a training run's records
  /// (a non-empty metrics.jsonl), its config and manifest go to config-<rung>.toml and
  /// manifest-<rung>.json instead of config.toml and manifest.json.
  std::string rung = {};
};

class Run {
 public:
  /// Creates the directory (writer only), writes config.toml, opens train.log and metrics.jsonl
  /// (a rung's own names: RunOptions::rung).
  /// With append_metrics, a last line without its newline (a run killed mid-write) is truncated
  /// before appending, and a warning says so. Throws UserError when the directory cannot be
  /// created or written. Callers hold the directory's RunLock first (open_session does).
  Run(const Config& config, RunOptions options);
  ~Run();
  Run(const Run&) = delete;
  Run& operator=(const Run&) = delete;

  const Config& config() const { return config_; }
  const std::filesystem::path& dir() const { return dir_; }
  bool writer() const { return options_.writer; }
  const std::string& command_line() const { return command_line_; }
  const std::string& start_time_utc() const { return start_time_utc_; }
  /// The names of this run's records in dir() (RunOptions::rung).
  const std::string& metrics_file() const { return options_.metrics_file; }
  const std::string& manifest_file() const { return manifest_file_; }
  const std::string& config_file() const { return config_file_; }

  /// Writes <dir>/<filename> atomically (temp file, fsync, rename). Writer only; else no-op.
  void write_json(std::string_view filename, const nlohmann::json& value) const;
  void write_text(std::string_view filename, std::string_view text) const;
  /// Appends one JSON object as a line to the metrics file with a single write() of the whole
  /// line (O_APPEND), so a kill leaves at most a line without its newline, never interleaved
  /// bytes. Writer only. A failed write is logged once and training goes on.
  void append_metrics(const nlohmann::json& record);
  /// Writes manifest_file(): everything needed to reproduce the run (see docs/manifest.md).
  /// `data` and `model` are the dataset's and model's identity objects.
  void write_manifest(const nlohmann::json& data, const nlohmann::json& model,
                      const nlohmann::json& extra = nlohmann::json::object()) const;

 private:
  Config config_;
  RunOptions options_;
  std::filesystem::path dir_;
  std::string command_line_;
  std::string start_time_utc_;
  std::string config_file_ = "config.toml", manifest_file_ = "manifest.json",
              log_file_ = "train.log";
  int metrics_fd_ = -1;  // O_APPEND; one write() per record
  bool metrics_failed_ = false;
};

/// The manifest object (docs/manifest.md). Pure apart from reading the environment.
nlohmann::json make_manifest(const Config& config, const std::string& command_line,
                             const std::string& start_time_utc, const nlohmann::json& data,
                             const nlohmann::json& model);

/// The run directory a config resolves to: <run.dir>/<run.name or config stem or "run">.
std::filesystem::path run_directory(const Config& config);

/// `config` with run.name resolved (run.name = "" takes the config file's stem): what a run saves
/// as its config.toml, so that file trains into the same directory again.
Config with_resolved_run_name(const Config& config);

/// Current UTC time as ISO 8601 ("2026-11-29T08:26:23Z").
std::string utc_now_iso8601();

// ---- one writer per directory ------------------------------------------------------------------

/// The lock file kiln keeps in every directory it locks.
inline constexpr const char* kRunLockFile = ".kiln-lock";
/// The environment variable that hands a process's locks to the children it starts (spawn_process
/// sets it): {"pid": <holder>, "dirs": [<locked directories>]} as JSON.
inline constexpr const char* kRunLockEnv = "KILN_RUN_LOCK";

/// A directory to lock and the words its refusal uses: "<what> <path> is in use by pid ... (cmd);
/// wait for it, or set <key>".
struct LockTarget {
  std::filesystem::path dir;
  std::string what = "run directory";  // or "checkpoint directory"
  std::string key = "run.name";        // the setting that picks another directory
  std::string place_key = "run.dir";   // the setting to fix when it cannot be created
};

/// This process's exclusive hold on the directories a run writes. Each directory is locked with an
/// advisory flock(2) on <dir>/.kiln-lock, which records the holder's pid, host, start time and
/// command line. The kernel drops the lock when the holder's last descriptor closes, so a process
/// that dies (even by SIGKILL) leaves no stale lock. Held while any RunLock naming the directory
/// lives; a process that locks a directory it already holds shares the hold (the ladder's rungs).
/// flock is local to one host on NFS (unless the server maps it to NLM locks) and per-node on
/// some Lustre mounts: see docs/checkpoint.md.
class RunLock {
 public:
  struct Held;  // one locked directory of this process (run_lock.cpp)
  RunLock(std::vector<std::shared_ptr<Held>> held, std::vector<std::filesystem::path> covered);
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;
  /// The directories this lock covers (absolute): held here, or inherited from the parent.
  const std::vector<std::filesystem::path>& dirs() const { return covered_; }

 private:
  std::vector<std::shared_ptr<Held>> held_;
  std::vector<std::filesystem::path> covered_;
};

/// Locks each target for this process, in order, before anything is written there (the directory
/// is created when missing; the lock file is the only thing written before the lock is held).
///  - A directory this process already holds is shared.
///  - A process started by a lock holder (KILN_RUN_LOCK in its environment: the ladder's drill
///    children, the scale rung's ranks) runs under its parent's lock: each target must lie inside
///    a directory the parent holds (and still holds), else UserError naming the parent's
///    directories.
///  - Otherwise, when another process holds it, throws UserError in one line: "run directory
///    runs/same is in use by pid 1234 on host h since 14:02:11 (kiln train ...); wait for it, or
///    set run.name". A file system without flock support is a UserError too.
std::shared_ptr<RunLock> lock_directories(const std::vector<LockTarget>& targets,
                                          const std::string& command_line);

/// The KILN_RUN_LOCK value for a child of this process: this process's held directories, or the
/// value it inherited; empty when it holds none and inherited none.
std::string run_lock_handoff();

/// Training losses by step from a metrics.jsonl file (lines that are not a JSON object with
/// "step" and "loss" are skipped). Empty when the file is missing.
std::map<int64_t, double> read_step_losses(const std::filesystem::path& metrics);

}  // namespace kiln
