#include "kiln/compile.h"

#include "cli/commands.h"
#include "kiln/error.h"
#include "kiln/rungs.h"

namespace kiln::cli {

namespace {

void add_compile_command(CLI::App& app, Action& action) {
  auto* command = app.add_subcommand(
      "compile",
      "compiled step (AOTInductor) against eager: compile time, graph breaks, recompiles, "
      "speedup, numerics gate");
  auto args = std::make_shared<ConfigArgs>();
  args->add_to(*command);
  command->callback([&action, args] {
    action = [args] {
      Config config = args->load_for_run();
      check_compile_start(config);  // Python, torch, cache: before anything is written
      auto session = open_session(config, {.argv = process_argv(), .rung = "compile"});
      RungResult result = run_compile(*session);
      if (session->comm->rank() == 0) print_rung(result);  // torchrun: one report
      if (!result.passed) throw TrainingError("compile gate failed: " + result.verdict);
      return 0;
    };
  });
}

const Registration compile_registration{25, add_compile_command};  // named apart: unity batches

}  // namespace

}  // namespace kiln::cli
