#include <fmt/format.h>

#include <filesystem>

#include "cli/commands.h"
#include "kiln/error.h"
#include "kiln/train.h"
#include "kiln/training_run.h"

namespace kiln::cli {

void check_run_inputs(const Config& config) {
  check_job_inputs(config);  // kiln/training_run.h: the library's run_training checks the same
}

namespace {

void add_config_command(CLI::App& app, Action& action) {
  auto* group = app.add_subcommand("config", "show or validate a config");
  group->require_subcommand(1);
  auto* show = group->add_subcommand("show", "print the resolved config with defaults and docs");
  auto show_args = std::make_shared<ConfigArgs>();
  show_args->add_to(*show, /*config_required=*/false);
  show->callback([&action, show_args] {
    action = [show_args] {
      Config config = show_args->load();
      fmt::print("# resolved from {} (hash {})\n{}", config.source_name(), config.hash(),
                 config.to_toml(true));
      return 0;
    };
  });
  auto* keys = group->add_subcommand(
      "keys", "print every key and cross-key rule of the schema as Markdown tables");
  keys->callback([&action] {
    action = [] {
      fmt::print("{}\n## Every cross-key rule\n\n{}", keys_markdown(), rules_markdown());
      return 0;
    };
  });
  auto* validate = group->add_subcommand("validate", "check a config; exit 0 when valid");
  auto validate_args = std::make_shared<ConfigArgs>();
  validate_args->add_to(*validate);
  validate->callback([&action, validate_args] {
    action = [validate_args] {
      Config config = validate_args->load();
      check_run_inputs(config);
      fmt::print("{}: valid (hash {})\n", config.source_name(), config.hash());
      return 0;
    };
  });
}

const Registration config_registration{90, add_config_command};  // named apart: unity batches

}  // namespace

}  // namespace kiln::cli
