#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>

#include "cli/commands.h"
#include "core/strings.h"
#include "kiln/build_info.h"
#include "kiln/dist.h"
#include "kiln/error.h"

namespace kiln::cli {

namespace {
std::vector<std::string> g_argv;

std::vector<std::pair<int, CommandAdder>>& registry() {
  static std::vector<std::pair<int, CommandAdder>> adders;
  return adders;
}
}  // namespace

Registration::Registration(int order, CommandAdder adder) {
  registry().emplace_back(order, adder);
}

void add_registered_commands(CLI::App& app, Action& action) {
  auto adders = registry();
  std::stable_sort(adders.begin(), adders.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  for (const auto& [order, adder] : adders) adder(app, action);
}

const std::vector<std::string>& process_argv() {
  return g_argv;
}

void ConfigArgs::add_to(CLI::App& command, bool config_required) {
  auto* option = command.add_option("config", path, "TOML config file");
  if (config_required) option->required();
  command.add_option("--set", overrides, "override a key: --set section.key=value (repeatable)")
      ->allow_extra_args(false);
}

Config ConfigArgs::load() const {
  return path.empty() ? Config::parse("", "<defaults>", overrides) : Config::load(path, overrides);
}

}  // namespace kiln::cli

int main(int argc, char** argv) {
  using namespace kiln;
  for (int k = 0; k < argc; ++k) cli::g_argv.emplace_back(argv[k]);
  die_with_launcher();  // under torchrun: a worker must not outlive its agent
  CLI::App app{
      "kiln: a C++ training workbench on LibTorch. The ladder: baseline -> profile -> scale -> "
      "checkpoint (compile and pilot are planned)"};
  app.require_subcommand(1);
  app.set_version_flag("--version",
                       std::string(build_info().version) + " (" + build_info().git_commit + ")");
  cli::Action action;
  cli::add_registered_commands(app, action);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "kiln: error: %s (see kiln --help)\n", e.what());
    return kExitUserError;
  }
  try {
    return action ? action() : kExitOk;
  } catch (const Preempted& e) {
    std::fprintf(stderr, "kiln: preempted: %s\n", one_line_error(e).c_str());
    return kExitPreempted;
  } catch (const UserError& e) {
    std::fprintf(stderr, "kiln: error: %s\n", one_line_error(e).c_str());
    return kExitUserError;
  } catch (const TrainingError& e) {
    std::fprintf(stderr, "kiln: stopped: %s\n", one_line_error(e).c_str());
    return kExitGateFailed;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "kiln: internal error (LibTorch): %s\n", one_line_error(e).c_str());
    return kExitInternal;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln: internal error: %s\n", one_line_error(e).c_str());
    return kExitInternal;
  }
}
