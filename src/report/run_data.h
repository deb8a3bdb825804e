// A run directory as the report reads it (private to src/report): each rung file through its
// typed result (kiln/results.h), metrics files as typed records, config.toml as key = value.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kiln/results.h"

namespace kiln::report {

template <class T>
struct Loaded {
  bool present = false;    // the file exists
  std::optional<T> value;  // read
  std::string error;  // present but unreadable: one line (file, key, version, how to regenerate)
};

struct MetricsFile {
  std::string name;                    // "metrics.jsonl", "metrics-baseline.jsonl"
  std::vector<MetricsRecord> records;  // the lines that are step or evaluation records
};

struct RunData {
  std::filesystem::path dir;
  std::string name;  // the directory's name
  Loaded<RunIdentity> identity;
  Loaded<BaselineResult> baseline;
  Loaded<CompileResult> compile;
  Loaded<ProfileResult> profile;
  Loaded<ScaleResult> scale;
  Loaded<CheckpointResult> checkpoint;
  Loaded<PilotResult> pilot;
  Loaded<PlanResult> plan;
  std::vector<MetricsFile> metrics;
  /// config.toml's keys ("optim.lr") and values as TOML text; empty when there is none.
  std::vector<std::pair<std::string, std::string>> config;
  /// Files absent ("plan.json") or unreadable ("pilot.json (unreadable)").
  std::vector<std::string> missing;

  /// The training curve the report leads with: metrics.jsonl, else the baseline's, else the
  /// first metrics file; null when there is none.
  const MetricsFile* main_metrics() const;
};

/// Reads what exists of a run directory; never throws for a missing or broken file (each is in
/// `missing`, and an unreadable rung file's reason in its Loaded::error).
RunData load_run(const std::filesystem::path& dir);

}  // namespace kiln::report
