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
};

class Run {
 public:
  /// Creates the directory (writer only), writes config.toml, opens train.log and metrics.jsonl.
  /// Throws UserError when the directory cannot be created or written.
  Run(const Config& config, RunOptions options);
  ~Run();
  Run(const Run&) = delete;
  Run& operator=(const Run&) = delete;

  const Config& config() const { return config_; }
  const std::filesystem::path& dir() const { return dir_; }
  bool writer() const { return options_.writer; }
  const std::string& command_line() const { return command_line_; }
  const std::string& start_time_utc() const { return start_time_utc_; }

  /// Writes <dir>/<filename> atomically (temp file, fsync, rename). Writer only; else no-op.
  void write_json(std::string_view filename, const nlohmann::json& value) const;
  void write_text(std::string_view filename, std::string_view text) const;
  /// Appends one JSON object as a line to the metrics file and flushes. Writer only.
  void append_metrics(const nlohmann::json& record);
  /// Writes manifest.json: everything needed to reproduce the run (see docs/manifest.md).
  /// `data` and `model` are the dataset's and model's identity objects.
  void write_manifest(const nlohmann::json& data, const nlohmann::json& model,
                      const nlohmann::json& extra = nlohmann::json::object()) const;

 private:
  Config config_;
  RunOptions options_;
  std::filesystem::path dir_;
  std::string command_line_;
  std::string start_time_utc_;
  std::ofstream metrics_;
};

/// The manifest object (docs/manifest.md). Pure apart from reading the environment.
nlohmann::json make_manifest(const Config& config, const std::string& command_line,
                             const std::string& start_time_utc, const nlohmann::json& data,
                             const nlohmann::json& model);

/// The run directory a config resolves to: <run.dir>/<run.name or config stem or "run">.
std::filesystem::path run_directory(const Config& config);

/// Current UTC time as ISO 8601 ("2026-11-29T08:26:23Z").
std::string utc_now_iso8601();

/// Training losses by step from a metrics.jsonl file (lines that are not a JSON object with
/// "step" and "loss" are skipped). Empty when the file is missing.
std::map<int64_t, double> read_step_losses(const std::filesystem::path& metrics);

}  // namespace kiln
