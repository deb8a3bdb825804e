#include "kiln/plan.h"

#include <cstdio>

#include "cli/commands.h"
#include "kiln/error.h"
#include "kiln/rungs.h"

namespace kiln::cli {

namespace {

void add_plan_command(CLI::App& app, Action& action) {
  auto* command = app.add_subcommand(
      "plan",
      "plan the job on each hardware row without building the model: strategy, step time, days, "
      "ETTR, checkpoint interval, 7- and 30-day fit and cost; writes plan.json");
  auto args = std::make_shared<ConfigArgs>();
  args->add_to(*command);
  auto pilot = std::make_shared<std::string>();
  auto cost = std::make_shared<bool>(false);
  command->add_option("--pilot", *pilot, "a pilot's run directory to calibrate against");
  command->add_flag("--cost", *cost,
                    "cost every row: a missing price (plan.price_*_per_gpu_hour) or MTBF is an "
                    "error");
  command->callback([&action, args, pilot, cost] {
    action = [args, pilot, cost] {
      RungResult result = run_plan(args->load(), *pilot, *cost);
      std::fputs(("\n" + plan_markdown(result.numbers)).c_str(), stdout);
      return 0;
    };
  });
}

const Registration registration{62, add_plan_command};

}  // namespace

}  // namespace kiln::cli
