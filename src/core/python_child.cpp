// Child processes running kiln's Python modules (core/python_child.h).
#include "core/python_child.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "core/files.h"
#include "core/process.h"
#include "core/strings.h"
#include "kiln/build_info.h"
#include "kiln/error.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A scratch directory for the spec and the result, removed on scope exit unless kept.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& what) {
    std::string pattern = (fs::temp_directory_path() / "kiln-python-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr)
      throw UserError(
          fmt::format("cannot create a temporary directory for {}: {}", what, errno_text()));
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

}  // namespace

fs::path kiln_python_dir(const std::string& module_file) {
  if (const char* env = std::getenv("KILN_PYTHON_DIR"); env && *env) return env;
  const fs::path source = build_info().python_dir;
  if (fs::exists(source / "kiln_py" / module_file)) return source;
  std::error_code ec;
  return fs::read_symlink("/proc/self/exe", ec).parent_path().parent_path() / "share" / "kiln" /
         "python";
}

json run_python_child(const PythonChild& child, const json& spec) {
  if (child.python.empty()) throw UserError(child.what + ": no Python given");
  const std::string file = child.module + ".py";
  const fs::path package = kiln_python_dir(file);
  if (!fs::exists(package / "kiln_py" / file)) {
    throw UserError(fmt::format(
        "{}'s Python module is missing ({} not found); set KILN_PYTHON_DIR to the directory "
        "holding kiln_py (<kiln source>/python)",
        child.what, (package / "kiln_py" / file).string()));
  }
  ScratchDir scratch(child.what);
  write_file_atomic(scratch.path() / "spec.json", spec.dump(2) + "\n");
  const std::string runner = fmt::format(
      "import sys, runpy\n"
      "sys.path.insert(0, sys.argv[1])\n"
      "sys.argv = ['kiln_py.{0}'] + sys.argv[2:]\n"
      "runpy.run_module('kiln_py.{0}', run_name='__main__', alter_sys=True)\n",
      child.module);
  const fs::path log = scratch.path() / "python.log";
  int status = 127;
  try {
    status = wait_process(spawn_process({child.python, "-c", runner, package.string(), "--spec",
                                         (scratch.path() / "spec.json").string(), "--result",
                                         (scratch.path() / "result.json").string()},
                                        child.inherit_output ? fs::path() : log));
  } catch (const UserError&) {
  }
  json result;
  try {
    result = json::parse(read_file(scratch.path() / "result.json"));
  } catch (const std::exception&) {
    scratch.keep();
    throw UserError(
        fmt::format("{} could not run Python '{}' (exit {}; log {}); set $KILN_PYTHON "
                    "to the Python with {}, e.g. <kiln source>/.venv/bin/python",
                    child.what, child.python, status, log.string(), child.python_hint));
  }
  const std::string state = result.value("status", "");
  if (state == "error") throw UserError(result.value("message", child.what + " failed"));
  if (std::find(child.ok_statuses.begin(), child.ok_statuses.end(), state) ==
      child.ok_statuses.end()) {
    scratch.keep();
    throw std::runtime_error(fmt::format("{} failed in Python: {} (traceback: {})", child.what,
                                         result.value("message", "no message"),
                                         result.value("traceback", log.string())));
  }
  return result;
}

}  // namespace kiln
