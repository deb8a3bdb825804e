// The `kiln` command line: one file per subcommand, each thin — it reads the config, builds the
// components and calls one library function.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

#include "kiln/config.h"

namespace kiln::cli {

/// What every config-taking subcommand shares: the config path and --set overrides.
struct ConfigArgs {
  std::string path;
  std::vector<std::string> overrides;
  /// Adds the positional <config> and repeatable --set to `command`.
  void add_to(CLI::App& command, bool config_required = true);
  Config load() const;
};

/// The process's argv, recorded in run manifests.
const std::vector<std::string>& process_argv();

/// A subcommand's action; returns the exit status.
using Action = std::function<int()>;

/// Adds a subcommand to `app`; its callback stores the action to run in `action`.
using CommandAdder = void (*)(CLI::App& app, Action& action);

/// Subcommands register themselves from their own file:
///   static const kiln::cli::Registration reg{40, add_train_command};
/// `order` sorts them in `kiln --help`.
struct Registration {
  Registration(int order, CommandAdder adder);
};

/// Every registered subcommand, in order.
void add_registered_commands(CLI::App& app, Action& action);

}  // namespace kiln::cli
