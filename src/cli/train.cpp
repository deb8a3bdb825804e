// `kiln train`: a thin parser over run_training (kiln/training_run.h), the library function a
// program of one's own and the rungs' child processes train through too.
#include <fmt/format.h>

#include "cli/commands.h"
#include "kiln/training_run.h"

namespace kiln::cli {

namespace {

void add_train_command(CLI::App& app, Action& action) {
  auto* command = app.add_subcommand("train", "train a model from a TOML config");
  auto args = std::make_shared<ConfigArgs>();
  args->add_to(*command);
  auto resume = std::make_shared<std::string>();
  command->add_option(
      "--resume", *resume,
      "auto (the newest valid checkpoint in checkpoint.dir, if any) or a checkpoint path");
  auto overwrite = std::make_shared<bool>(false);
  command->add_flag("--overwrite", *overwrite,
                    "start afresh in a run directory that holds another run's records: move them "
                    "into <run dir>/previous-<UTC time>/ first");
  command->callback([&action, args, resume, overwrite] {
    action = [args, resume, overwrite] {
      const TrainingRunResult result =
          run_training(args->load(), TrainingRunOptions{.resume = *resume,
                                                        .overwrite = *overwrite,
                                                        .set_keys = args->set_keys(),
                                                        .argv = process_argv()});
      fmt::print("{}", training_summary_text(result));
      return 0;
    };
  });
}

const Registration train_registration{10, add_train_command};  // named apart: unity batches

}  // namespace

}  // namespace kiln::cli
