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
  command->callback([&action, args] {
    action = [args] {
      auto results = run_ladder(args->load(), {process_argv()});
      for (const auto& r : results) {
        if (!r.passed) throw TrainingError("ladder stopped at rung " + r.rung + ": " + r.verdict);
      }
      return 0;
    };
  });
}

const Registration registration{5, add_ladder_command};

}  // namespace

}  // namespace kiln::cli
