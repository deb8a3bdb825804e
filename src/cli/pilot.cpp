#include "kiln/pilot.h"

#include <fmt/format.h>

#include "cli/commands.h"
#include "kiln/error.h"
#include "kiln/rungs.h"

namespace kiln::cli {

namespace {

void add_pilot_command(CLI::App& app, Action& action) {
  auto* command = app.add_subcommand(
      "pilot",
      "prove the job once at its production shape: pins, train, eval, save, restore in a fresh "
      "process, peak memory against the estimate; writes pilot.json for kiln plan --pilot");
  auto args = std::make_shared<ConfigArgs>();
  args->add_to(*command);
  auto pins = std::make_shared<std::string>();
  command->add_option("--check-pins", *pins,
                      "compare this machine and inputs with a pinned manifest.json; exit 3 when "
                      "any pin differs");
  command->callback([&action, args, pins] {
    action = [args, pins] {
      const Config config = args->load();
      if (!pins->empty()) {
        const auto differences = check_pins(config, *pins);
        for (const auto& line : differences) fmt::print("differs: {}\n", line);
        if (!differences.empty()) {
          throw TrainingError(fmt::format("{} pin(s) differ from {}", differences.size(), *pins));
        }
        fmt::print("every pin of {} holds here\n", *pins);
        return 0;
      }
      check_run_inputs(config);
      RungResult result = run_pilot(config, {.argv = process_argv(), .rung = "pilot"});
      print_rung(result);
      if (!result.passed) throw TrainingError("pilot failed: " + result.verdict);
      return 0;
    };
  });
}

const Registration pilot_registration{61, add_pilot_command};  // named apart: unity batches

}  // namespace

}  // namespace kiln::cli
