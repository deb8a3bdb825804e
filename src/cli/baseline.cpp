#include "cli/commands.h"
#include "kiln/error.h"
#include "kiln/rungs.h"

namespace kiln::cli {

namespace {

void add_baseline_command(CLI::App& app, Action& action) {
  auto* command = app.add_subcommand(
      "baseline", "eager single-device run: throughput, step time, data wait, peak memory, gate");
  auto args = std::make_shared<ConfigArgs>();
  args->add_to(*command);
  command->callback([&action, args] {
    action = [args] {
      auto session =
          open_session(args->load_for_run(), {.argv = process_argv(), .rung = "baseline"});
      RungResult result = run_baseline(*session);
      print_rung(result);
      if (!result.passed) throw TrainingError("baseline gate failed: " + result.verdict);
      return 0;
    };
  });
}

const Registration baseline_registration{20, add_baseline_command};  // named apart: unity batches

}  // namespace

}  // namespace kiln::cli
