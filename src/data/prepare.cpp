// `kiln data prepare` from C++: checks the options, hands them to python/kiln_py/prepare.py in a
// child process, and turns its result into a PrepareResult or a one-line UserError.
#include "data/prepare.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include "core/files.h"
#include "core/process.h"
#include "core/strings.h"
#include "kiln/build_info.h"
#include "kiln/error.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The directory holding kiln_py, found as the compile step finds it: $KILN_PYTHON_DIR, else the
// source tree kiln was built from, else the installed share/kiln/python.
fs::path python_package_dir() {
  if (const char* env = std::getenv("KILN_PYTHON_DIR"); env && *env) return env;
  const fs::path source = build_info().python_dir;
  if (fs::exists(source / "kiln_py" / "prepare.py")) return source;
  std::error_code ec;
  return fs::read_symlink("/proc/self/exe", ec).parent_path().parent_path() / "share" / "kiln" /
         "python";
}

// A scratch directory for the spec and the result, removed on scope exit.
class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = (fs::temp_directory_path() / "kiln-prepare-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr)
      throw UserError("cannot create a temporary directory for kiln data prepare: " + errno_text());
    path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ec;
    if (!keep_) fs::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const fs::path& path() const { return path_; }
  void keep() { keep_ = true; }

 private:
  fs::path path_;
  bool keep_ = false;
};

json paths_json(const std::vector<fs::path>& paths) {
  json out = json::array();
  for (const fs::path& p : paths) out.push_back(p.string());
  return out;
}

}  // namespace

PrepareResult prepare_corpus(const PrepareOptions& options) {
  if (options.inputs.empty())
    throw UserError("kiln data prepare needs at least one input (a text file, JSONL or directory)");
  if (!(options.val_fraction >= 0 && options.val_fraction <= 0.9)) {
    throw UserError(fmt::format("--val-fraction {} is outside [0, 0.9]", options.val_fraction));
  }
  if (options.val_fraction == 0 && options.val_inputs.empty()) {
    throw UserError(
        "--val-fraction 0 without --val leaves no validation split; set --val-fraction in (0, "
        "0.9] or give --val inputs");
  }
  if (options.shard_tokens < 1024)
    throw UserError(fmt::format("--shard-tokens {} is below 1024", options.shard_tokens));
  if (options.field.empty()) throw UserError("--field is empty; name the JSONL key holding text");
  if (options.python.empty()) throw UserError("kiln data prepare: no Python given");

  const fs::path package = python_package_dir();
  if (!fs::exists(package / "kiln_py" / "prepare.py")) {
    throw UserError(fmt::format(
        "kiln data prepare's Python module is missing ({} not found); set KILN_PYTHON_DIR to the "
        "directory holding kiln_py (<kiln source>/python)",
        (package / "kiln_py" / "prepare.py").string()));
  }
  ScratchDir scratch;
  const json spec = {{"tokenizer", options.tokenizer.string()},
                     {"out", options.out.string()},
                     {"inputs", paths_json(options.inputs)},
                     {"val_inputs", paths_json(options.val_inputs)},
                     {"field", options.field},
                     {"val_fraction", options.val_fraction},
                     {"shard_tokens", options.shard_tokens},
                     {"separator", options.separator},
                     {"progress", options.progress},
                     {"kiln_version", build_info().version}};
  write_file_atomic(scratch.path() / "spec.json", spec.dump(2) + "\n");
  const std::string runner =
      "import sys, runpy\n"
      "sys.path.insert(0, sys.argv[1])\n"
      "sys.argv = ['kiln_py.prepare'] + sys.argv[2:]\n"
      "runpy.run_module('kiln_py.prepare', run_name='__main__', alter_sys=True)\n";
  const fs::path log = scratch.path() / "python.log";
  int status = 127;
  try {
    status = wait_process(spawn_process({options.python, "-c", runner, package.string(), "--spec",
                                         (scratch.path() / "spec.json").string(), "--result",
                                         (scratch.path() / "result.json").string()},
                                        options.progress ? fs::path() : log));
  } catch (const UserError&) {
  }
  json result;
  try {
    result = json::parse(read_file(scratch.path() / "result.json"));
  } catch (const std::exception&) {
    scratch.keep();
    throw UserError(fmt::format(
        "kiln data prepare could not run Python '{}' (exit {}; log {}); set $KILN_PYTHON to the "
        "Python with the tokenizers library, e.g. <kiln source>/.venv/bin/python",
        options.python, status, log.string()));
  }
  const std::string state = result.value("status", "");
  if (state == "error") throw UserError(result.value("message", "kiln data prepare failed"));
  if (state != "written" && state != "up_to_date") {
    scratch.keep();
    throw std::runtime_error(fmt::format("kiln data prepare failed in Python: {} (traceback: {})",
                                         result.value("message", "no message"),
                                         result.value("traceback", log.string())));
  }
  PrepareResult out;
  out.up_to_date = state == "up_to_date";
  out.seconds = result.value("seconds", 0.0);
  out.data_json = result.value("data_json", json::object());
  return out;
}

}  // namespace kiln
