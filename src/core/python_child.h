// kiln's Python modules (python/kiln_py) run as child processes before or beside training, never
// in the step loop: `kiln data prepare`, `kiln model import`. Each takes a spec JSON and writes
// one result JSON whose "status" says what happened. Not public API.
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace kiln {

/// The directory holding kiln_py: $KILN_PYTHON_DIR, else the source tree kiln was built from
/// (when it holds kiln_py/<module_file>), else the installed share/kiln/python.
std::filesystem::path kiln_python_dir(const std::string& module_file);

struct PythonChild {
  std::string python;  // the interpreter (required)
  std::string module;  // "prepare" runs kiln_py.prepare
  std::string what;    // the command, for messages ("kiln data prepare")
  /// Statuses that are results; "error" is a UserError with the result's "message"; any other
  /// status (or none) is a failure reported with the traceback.
  std::vector<std::string> ok_statuses = {"written"};
  bool inherit_output = false;  // the child's stdout/stderr to the terminal, else to a log file
  std::string python_hint;      // what the Python needs, for the message when it cannot run
};

/// Runs kiln_py.<module> with `spec` (written to a scratch spec.json) and returns the result.
/// Throws UserError (Python missing, kiln_py missing, status "error") or std::runtime_error.
nlohmann::json run_python_child(const PythonChild& child, const nlohmann::json& spec);

}  // namespace kiln
