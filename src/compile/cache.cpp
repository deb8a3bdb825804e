// The package cache and the Python that fills it. A package is a shared library, the one thing
// kiln loads from disk that executes code: only packages kiln built into this cache are loaded,
// each after its xxh3 hash matched the one recorded when it was built.
#include <ATen/Parallel.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <torch/headeronly/version.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

#include "compile/compiler_run.h"
#include "compile/internal.h"
#include "core/files.h"
#include "core/process.h"
#include "core/python_child.h"
#include "core/strings.h"
#include "kiln/build_info.h"
#include "kiln/compile.h"
#include "kiln/error.h"

namespace kiln {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// `python` as a path: as given when it names a file, else looked up on PATH.
std::string resolve_program(const std::string& program) {
  if (program.find('/') != std::string::npos) return program;
  const char* path = std::getenv("PATH");
  std::string_view rest = path ? path : "";
  while (!rest.empty()) {
    const size_t colon = rest.find(':');
    const fs::path candidate = fs::path(std::string(rest.substr(0, colon))) / program;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate.string();
    if (colon == std::string_view::npos) break;
    rest.remove_prefix(colon + 1);
  }
  return program;
}

std::string libtorch_version() {
  return fmt::format("{}.{}.{}", TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH);
}

}  // namespace

std::string Fingerprint::key() const {
  const std::string text = fields.dump();
  return hex64(XXH3_64bits(text.data(), text.size()));
}

PackageCache::PackageCache(fs::path dir) : dir_(std::move(dir)) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  const fs::path probe = dir_ / fmt::format(".write-test.{}", ::getpid());
  std::ofstream out(probe);
  if (ec || !out) {
    throw UserError(fmt::format(
        "compile.cache_dir {} cannot be written{}; set compile.cache_dir to a writable directory",
        dir_.string(), ec ? ": " + ec.message() : ""));
  }
  out.close();
  fs::remove(probe, ec);
}

std::optional<PackageCache::Hit> PackageCache::find(const Fingerprint& fingerprint,
                                                    std::string* why_not) const {
  const std::string key = fingerprint.key();
  const fs::path record_path = dir_ / (key + ".json");
  const fs::path package = dir_ / (key + ".pt2");
  auto miss = [&](std::string why) -> std::optional<Hit> {
    if (why_not) *why_not = std::move(why);
    return std::nullopt;
  };
  if (!fs::exists(record_path) || !fs::exists(package)) return miss("not built yet");
  json record;
  try {
    record = json::parse(read_file(record_path));
  } catch (const std::exception&) {
    return miss("its record " + record_path.filename().string() + " is not JSON");
  }
  if (!record.contains("fingerprint") || record["fingerprint"] != fingerprint.fields) {
    std::string field = "the record";
    if (record.contains("fingerprint") && record["fingerprint"].is_object()) {
      for (const auto& [name, value] : fingerprint.fields.items()) {
        if (!record["fingerprint"].contains(name) || record["fingerprint"][name] != value) {
          field = name;
          break;
        }
      }
    }
    return miss("built for another fingerprint (" + field + " differs)");
  }
  try {
    const std::string hash = hex64(hash_file(package));
    if (record.value("xxh3", "") != hash) {
      return miss(fmt::format("its hash {} differs from the one recorded ({}): corrupt or changed",
                              hash, record.value("xxh3", "none")));
    }
  } catch (const UserError& e) {
    return miss(std::string("it cannot be read: ") + e.what());
  }
  return Hit{package, record};
}

PackageCache::BuildLock::BuildLock(const PackageCache& cache, const Fingerprint& fingerprint) {
  const fs::path path = cache.dir() / (fingerprint.key() + ".lock");
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    throw UserError(
        fmt::format("cannot create {}: {}; set compile.cache_dir to a writable "
                    "directory",
                    path.string(), errno_text()));
  }
  while (::flock(fd_, LOCK_EX) != 0 && errno == EINTR) {
  }
}

PackageCache::BuildLock::~BuildLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

fs::path PackageCache::scratch_dir(const Fingerprint& fingerprint) const {
  const fs::path dir = dir_ / fmt::format("build-{}-{}", fingerprint.key(), ::getpid());
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::create_directories(dir, ec);
  if (ec) {
    throw UserError(
        fmt::format("cannot create {}: {}; set compile.cache_dir to a writable directory",
                    dir.string(), ec.message()));
  }
  return dir;
}

PackageCache::Hit PackageCache::publish(const Fingerprint& fingerprint, const fs::path& built,
                                        const json& report) const {
  const std::string key = fingerprint.key();
  const fs::path package = dir_ / (key + ".pt2");
  const fs::path staged = dir_ / fmt::format("{}.pt2.tmp.{}", key, ::getpid());
  std::error_code ec;
  fs::copy_file(built, staged, fs::copy_options::overwrite_existing, ec);
  if (ec) {
    throw UserError(
        fmt::format("cannot write {}: {}; set compile.cache_dir to a writable directory",
                    staged.string(), ec.message()));
  }
  json record = {{"fingerprint", fingerprint.fields},
                 {"package", package.filename().string()},
                 {"xxh3", hex64(hash_file(staged))},
                 {"bytes", fs::file_size(staged)},
                 {"report", report}};
  // The package first, then its record: a record always names a complete package.
  fs::rename(staged, package, ec);
  if (ec) throw UserError(fmt::format("cannot publish {}: {}", package.string(), ec.message()));
  write_file_atomic(dir_ / (key + ".json"), record.dump(2) + "\n");
  return {package, record};
}

const CompilerPython& CompilerPython::probe(const std::string& python) {
  static std::mutex mutex;
  static std::map<std::string, CompilerPython> probed;
  std::lock_guard lock(mutex);
  if (auto it = probed.find(python); it != probed.end()) return it->second;

  CompilerPython out;
  out.python = resolve_program(python);
  out.package_dir = kiln_python_dir("compile.py");
  const fs::path script = out.package_dir / "kiln_py" / "compile.py";
  if (!fs::exists(script)) {
    throw UserError(fmt::format(
        "the compile step's Python package is missing ({} not found); set KILN_PYTHON_DIR to the "
        "directory holding kiln_py (<kiln source>/python)",
        script.string()));
  }
  // The script's hash is part of every fingerprint: a changed compiler rebuilds.
  std::vector<fs::path> sources;
  for (const auto& entry : fs::directory_iterator(out.package_dir / "kiln_py")) {
    if (entry.path().extension() == ".py") sources.push_back(entry.path());
  }
  std::sort(sources.begin(), sources.end());
  std::string all;
  for (const fs::path& source : sources) all += source.filename().string() + read_file(source);
  out.script_hash = hex64(XXH3_64bits(all.data(), all.size()));

  const fs::path answer =
      fs::temp_directory_path() / fmt::format("kiln-python-probe-{}.txt", ::getpid());
  std::error_code ec;
  fs::remove(answer, ec);
  // torch's version without `import torch` (1.5-2 s on these machines, paid at every start of a
  // compiled job, warm cache or not): find the package and run its generated version.py, which
  // imports only `typing`. A torch that is present but cannot import fails in the compiler,
  // whose log says why.
  const std::string code =
      "import importlib.util, os, sys\n"
      "try:\n"
      "    spec = importlib.util.find_spec('torch')\n"
      "    if spec is None or not spec.submodule_search_locations:\n"
      "        raise ModuleNotFoundError(\"no module named 'torch'\")\n"
      "    path = os.path.join(list(spec.submodule_search_locations)[0], 'version.py')\n"
      "    with open(path) as f:\n"
      "        source = f.read()\n"
      "    ns = {}\n"
      "    exec(compile(source, path, 'exec'), ns)\n"
      "    version, git = ns['__version__'], ns.get('git_version', 'unknown')\n"
      "except Exception as e:\n"
      "    print('no-torch', type(e).__name__, e)\n"
      "    sys.exit(0)\n"
      "print('torch', version, git)\n";
  int status = 127;
  try {
    status = wait_process(spawn_process({out.python, "-c", code}, answer));
  } catch (const UserError&) {
  }
  std::string text;
  try {
    text = read_file(answer);
  } catch (const UserError&) {
  }
  fs::remove(answer, ec);
  const std::string fix =
      "set compile.python (or $KILN_PYTHON) to the Python whose torch kiln was built against, "
      "e.g. <kiln source>/.venv/bin/python";
  if (status != 0) {
    throw UserError(fmt::format("cannot run Python '{}' to compile the step (exit {}); {}", python,
                                status, fix));
  }
  const size_t line = text.rfind("torch ");
  if (text.rfind("no-torch", 0) == 0 || line == std::string::npos) {
    throw UserError(
        fmt::format("Python '{}' has no torch ({}); {}", python, std::string(trim(text)), fix));
  }
  std::istringstream words(text.substr(line + 6));
  words >> out.torch_version >> out.torch_git;
  const std::string release = out.torch_version.substr(0, out.torch_version.find('+'));
  if (release != libtorch_version()) {
    throw UserError(fmt::format(
        "Python '{}' has torch {}, but kiln was built against LibTorch {}: a package compiled by "
        "one cannot run on the other; {}",
        python, out.torch_version, libtorch_version(), fix));
  }
  return probed.emplace(python, out).first->second;
}

// ---- one run of the compiler
// ---------------------------------------------------------------------

namespace {

// The last non-empty line of a log (the error a Python traceback ends with).
std::string compiler_log_last_line(const fs::path& path) {
  std::string text;
  try {
    text = read_file(path);
  } catch (const UserError&) {
    return "no log";
  }
  const std::string_view all = trim(text);
  const size_t newline = all.rfind('\n');
  return std::string(newline == std::string_view::npos ? all : all.substr(newline + 1));
}

}  // namespace

bool CompilerRun::graph_breaks() const {
  return result.value("status", "error") == "graph_breaks";
}

std::vector<GraphBreak> CompilerRun::breaks() const {
  std::vector<GraphBreak> out;
  for (const auto& b : result.value("graph_breaks", json::array())) {
    out.push_back({b.value("reason", ""), b.value("where", "")});
  }
  return out;
}

void CompilerRun::check_built(const std::string& what) const {
  if (result.value("status", "error") != "ok" || exit_status != 0) {
    throw UserError(fmt::format("compiling {} failed: {} (log: {})", what,
                                result.value("error", "exit " + std::to_string(exit_status)),
                                log.string()));
  }
}

CompilerRun run_compiler(const CompilerPython& python, const fs::path& scratch, json spec,
                         torch::Device device, TrainOptions::Precision precision,
                         const std::string& what) {
  spec["device"] = device.is_cuda() ? "cuda" : "cpu";
  spec["precision"] = precision_name(precision);
  if (!spec.contains("threads")) spec["threads"] = at::get_num_threads();  // caller off-thread
  spec["deterministic"] = at::globalContext().deterministicAlgorithms();
  write_file_atomic(scratch / "spec.json", spec.dump(2) + "\n");
  const std::string runner =
      "import sys, runpy\n"
      "sys.path.insert(0, sys.argv[1])\n"
      "sys.argv = ['kiln_py.compile'] + sys.argv[2:]\n"
      "runpy.run_module('kiln_py.compile', run_name='__main__', alter_sys=True)\n";
  CompilerRun run;
  run.log = scratch / "compile.log";
  run.exit_status = wait_process(spawn_process(
      {python.python, "-c", runner, python.package_dir.string(), "--spec",
       (scratch / "spec.json").string(), "--result", (scratch / "result.json").string()},
      run.log));
  try {
    run.result = json::parse(read_file(scratch / "result.json"));
  } catch (const std::exception&) {
    throw UserError(
        fmt::format("compiling {} failed (exit {}) without a result; see {} (it ends: {})", what,
                    run.exit_status, run.log.string(), compiler_log_last_line(run.log)));
  }
  return run;
}

}  // namespace kiln
