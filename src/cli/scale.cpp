#include "cli/commands.h"
#include "kiln/dist.h"
#include "kiln/error.h"
#include "kiln/rungs.h"

namespace kiln::cli {

namespace {

void add_scale_command(CLI::App& app, Action& action) {
  auto* command = app.add_subcommand(
      "scale",
      "data-parallel scaling under torchrun: per-rank and global throughput, efficiency "
      "against one process, communication against compute");
  auto args = std::make_shared<ConfigArgs>();
  args->add_to(*command);
  auto quiet = std::make_shared<bool>(false);
  command->add_flag("--quiet", *quiet,
                    "do not print the result table (the ladder's launch reads scale.json)");
  command->callback([&action, args, quiet] {
    action = [args, quiet] {
      Config config = args->load_for_run();
      RungResult result = run_scale_rung(config, {.argv = process_argv(), .rung = "scale"});
      if (!*quiet && process_communicator(config)->rank() == 0) print_rung(result);
      if (!result.passed) throw TrainingError("scale gate failed: " + result.verdict);
      return 0;
    };
  });
}

const Registration scale_registration{40, add_scale_command};  // named apart: unity batches

}  // namespace

}  // namespace kiln::cli
