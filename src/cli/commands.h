// The `kiln` command line: one file per subcommand, each thin — it reads the config, builds the
// components and calls one library function.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

#include "kiln/config.h"

namespace kiln::cli {

/// What every config-taking subcommand shares: the config path and --set overrides, followed by
/// the KILN_SET environment variable's (white-space separated assignments: the docs test shrinks
/// documented commands with it).
struct ConfigArgs {
  std::string path;
  std::vector<std::string> overrides;
  /// Adds the positional <config> and repeatable --set to `command`.
  void add_to(CLI::App& command, bool config_required = true);
  Config load() const;
  /// load(), then check_run_inputs(): for the commands that run a job.
  Config load_for_run() const;
  /// The keys the --set overrides (and KILN_SET's) name ("section.key"), in order.
  std::vector<std::string> set_keys() const;
};

/// What `kiln config validate` and every command that trains check beyond the config's rules,
/// cheaply and before anything is written: run.device = "cuda" needs a CUDA device; data.path
/// (and data.val_path) must exist and a token file must open for reading (never read or hashed
/// here; a prepared token directory is the data component's to check).
/// Throws UserError with the same line the run itself would stop with.
void check_run_inputs(const Config& config);

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
