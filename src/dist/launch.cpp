// Launching a kiln subcommand as local ranks under torchrun, from one process (the ladder's scale
// rung uses it). See kiln/dist.h for the contract.
#include <fmt/format.h>
#include <unistd.h>

#include <cstdlib>
#include <string_view>
#include <system_error>

#include "core/files.h"
#include "core/process.h"
#include "kiln/config.h"
#include "kiln/dist.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/run.h"

namespace kiln {
namespace {

bool is_executable(const std::filesystem::path& path) {
  std::error_code ec;
  return !path.empty() && ::access(path.c_str(), X_OK) == 0 &&
         std::filesystem::is_regular_file(path, ec);
}

// The first executable `torchrun` in the directories of $PATH; empty when there is none.
std::filesystem::path torchrun_on_path() {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return {};
  std::string_view rest(path);
  while (!rest.empty()) {
    const size_t colon = rest.find(':');
    const std::filesystem::path candidate =
        std::filesystem::path(rest.substr(0, colon)) / "torchrun";
    if (is_executable(candidate)) return candidate;
    rest = colon == std::string_view::npos ? std::string_view() : rest.substr(colon + 1);
  }
  return {};
}

}  // namespace

std::filesystem::path find_torchrun(const ProcessGroupOptions& options) {
  const std::string& configured = options.torchrun;
  if (!configured.empty()) {
    if (!is_executable(configured)) {
      throw UserError("dist.torchrun = \"" + configured +
                      "\" is not an executable file; point it at "
                      "torchrun (it comes with the torch package: <venv>/bin/torchrun)");
    }
    return configured;
  }
  if (auto found = torchrun_on_path(); !found.empty()) return found;
  const auto exe_dir = kiln_executable().parent_path();
  for (const auto& candidate :
       {exe_dir.parent_path() / ".venv/bin/torchrun", exe_dir / ".venv/bin/torchrun"}) {
    if (is_executable(candidate)) return candidate;
  }
  throw UserError(
      "the scale rung needs torchrun (it comes with the torch package) and found none "
      "on PATH or in .venv/bin next to the build; set dist.torchrun = \"/path/to/torchrun\"");
}

TorchrunOutcome launch_with_torchrun(const Config& config, const TorchrunJob& job) {
  const std::filesystem::path run_dir = run_directory(config);
  TorchrunOutcome outcome;
  outcome.run_dir = run_dir / job.run_name;
  std::error_code ec;
  std::filesystem::create_directories(outcome.run_dir, ec);
  if (ec) {
    throw UserError(fmt::format("cannot create {} for the {} ranks: {}; check run.dir",
                                outcome.run_dir.string(), job.command, ec.message()));
  }
  // The children load the resolved config, told to write into <run dir>/<run_name>/.
  Config child = config;
  child.set("run.dir", run_dir.string());
  child.set("run.name", job.run_name);
  const auto launch_config = outcome.run_dir / fmt::format("{}-launch.toml", job.command);
  write_file_atomic(launch_config, child.to_toml(false));
  for (const auto& stale : job.stale_outputs) {
    std::filesystem::remove(stale, ec);
    if (ec) {
      throw UserError(fmt::format("cannot remove the previous {}: {}; delete it and rerun",
                                  stale.string(), ec.message()));
    }
  }

  const std::vector<std::string> argv = {
      find_torchrun(ProcessGroupOptions::from_config(config)).string(),
      "--standalone",
      fmt::format("--nproc-per-node={}", job.processes),
      "--no-python",
      kiln_executable().string(),
      job.command,
      launch_config.string(),
      "--quiet"};
  std::string line;
  for (const auto& a : argv) line += (line.empty() ? "" : " ") + a;
  log::info(fmt::format("{}: launching {}", job.command, line));
  outcome.status = wait_process(spawn_process(argv));
  return outcome;
}

}  // namespace kiln
