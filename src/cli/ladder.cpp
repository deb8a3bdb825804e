#include <fmt/format.h>
#include <fmt/ranges.h>

#include <iostream>

#include "cli/commands.h"
#include "kiln/error.h"
#include "kiln/rungs.h"

namespace kiln::cli {

namespace {

void add_ladder_command(CLI::App& app, Action& action) {
  auto* command = app.add_subcommand(
      "ladder", "run the rungs in order, stop at the first failed gate, write report.md");
  auto args = std::make_shared<ConfigArgs>();
  args->add_to(*command);
  auto check = std::make_shared<bool>(false);
  command->add_flag("--check", *check,
                    "run only the ladder's preflight (config rules, each rung's start checks), "
                    "list the rungs that would run, write nothing; exit 2 naming a problem");
  command->callback([&action, args, check] {
    action = [args, check] {
      const Config config = args->load();
      check_run_inputs(config);  // run.device and data.path, as kiln train and config validate
      if (*check) {
        const std::vector<std::string> rungs = check_ladder(config);
        std::cout << fmt::format("ladder check passed: {} would run {}\n", config.source_name(),
                                 fmt::join(rungs, ", "));
        return 0;
      }
      auto results = run_ladder(config, {process_argv()});
      for (const auto& r : results) {
        if (!r.passed) throw TrainingError("ladder stopped at rung " + r.rung + ": " + r.verdict);
      }
      return 0;
    };
  });
}

const Registration ladder_registration{5, add_ladder_command};  // named apart: unity batches

}  // namespace

}  // namespace kiln::cli
