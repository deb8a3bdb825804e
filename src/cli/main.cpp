#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "cli/commands.h"
#include "core/strings.h"
#include "kiln/build_info.h"
#include "kiln/dist.h"
#include "kiln/error.h"

namespace kiln::cli {

namespace {
std::vector<std::string> g_argv;
std::string g_kiln_set;  // KILN_SET, read once at start (the processes kiln starts never see it)

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

namespace {
// The --set assignments, then KILN_SET's (white-space separated; docs/config.md): the last wins.
std::vector<std::string> all_overrides(const std::vector<std::string>& overrides) {
  std::vector<std::string> all = overrides;
  std::istringstream words(g_kiln_set);
  for (std::string word; words >> word;) all.push_back(word);
  return all;
}
}  // namespace

Config ConfigArgs::load() const {
  const auto all = all_overrides(overrides);
  return path.empty() ? Config::parse("", "<defaults>", all) : Config::load(path, all);
}

Config ConfigArgs::load_for_run() const {
  Config config = load();
  check_run_inputs(config);
  return config;
}

std::vector<std::string> ConfigArgs::set_keys() const {
  std::vector<std::string> keys;
  for (const auto& o : all_overrides(overrides))
    keys.push_back(std::string(trim(o.substr(0, o.find('=')))));
  return keys;
}

}  // namespace kiln::cli

int main(int argc, char** argv) {
  using namespace kiln;
  for (int k = 0; k < argc; ++k) cli::g_argv.emplace_back(argv[k]);
  // KILN_SET applies to this command's config; the processes it starts (drill, pilot, scale
  // ranks) get the resolved config from their parent, never these overrides a second time.
  if (const char* env = std::getenv("KILN_SET"); env != nullptr) {
    cli::g_kiln_set = env;
    ::unsetenv("KILN_SET");
  }
  die_with_launcher();  // under torchrun: a worker must not outlive its agent
  CLI::App app{
      "kiln: a C++ training workbench on LibTorch. The ladder: baseline -> compile -> profile -> "
      "scale -> checkpoint, then the pilot and the plan"};
  app.require_subcommand(1);
  app.set_version_flag("--version",
                       std::string(build_info().version) + " (" + build_info().git_commit + ")");
  cli::Action action;
  cli::add_registered_commands(app, action);
  // A mistyped subcommand ("kiln trian", "kiln ckpt verfy"): name it and the closest one. The
  // command words are followed down while each names a subcommand of the one before.
  const CLI::App* level = &app;
  std::string path = "kiln";
  for (int k = 1; k < argc && argv[k][0] != '-'; ++k) {
    const auto subs = level->get_subcommands([](const CLI::App*) { return true; });
    if (subs.empty()) break;
    const std::string given = argv[k];
    std::string closest;
    size_t best = std::string::npos;
    const CLI::App* next = nullptr;
    for (const CLI::App* sub : subs) {
      if (sub->check_name(given)) {
        next = sub;
        break;
      }
      const size_t d = edit_distance(given, sub->get_name());
      if (d < best) best = d, closest = sub->get_name();
    }
    if (next == nullptr) {
      const std::string of = level == &app ? "" : " of '" + path + "'";
      std::fprintf(stderr, "kiln: error: unknown subcommand '%s'%s%s (see %s --help)\n",
                   given.c_str(), of.c_str(),
                   best <= std::max<size_t>(2, given.size() / 3)
                       ? (": did you mean '" + closest + "'?").c_str()
                       : "",
                   path.c_str());
      return kExitUserError;
    }
    level = next;
    path += " " + next->get_name();
  }
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
