// One run of kiln's Python compiler (python/kiln_py/compile.py, which hands a "graph": "unit" spec
// to compile_units.py), shared by the whole-step graphs (compiled_step.cpp) and the per-unit
// pairs (compiled_units.cpp). Internal to the compile component.
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "compile/internal.h"
#include "kiln/compile.h"
#include "kiln/train.h"

namespace kiln {

/// What the compiler left: its result.json, exit status and log.
struct CompilerRun {
  nlohmann::json result;  // "status": "ok" | "graph_breaks" | "error", and what was built
  int exit_status = 0;
  std::filesystem::path log;  // the compiler's stdout and stderr
  /// Status "graph_breaks": nothing was built, breaks() lists why.
  bool graph_breaks() const;
  std::vector<GraphBreak> breaks() const;
  /// Throws UserError "compiling <what> failed: <its error> (log: <log>)" unless the status is
  /// "ok" and the exit status 0.
  void check_built(const std::string& what) const;
};

/// Adds the fields every graph's spec has (device, precision, the thread count and
/// run.deterministic as this process runs them; a caller off the training thread sets "threads"
/// itself, since OpenMP's count is per thread) to `spec`, writes it to scratch/spec.json, runs
/// `python`'s kiln_py.compile on it in a child process (blocking; output to
/// scratch/compile.log) and reads scratch/result.json. `what` names the graph in errors ("the
/// step", "unit transformer.h.0"). Throws UserError "compiling <what> failed (exit N) without a
/// result; see <log> (it ends: <its last line>)" when there is no readable result. The caller
/// holds the PackageCache::BuildLock of the scratch directory.
CompilerRun run_compiler(const CompilerPython& python, const std::filesystem::path& scratch,
                         nlohmann::json spec, torch::Device device,
                         TrainOptions::Precision precision, const std::string& what);

}  // namespace kiln
