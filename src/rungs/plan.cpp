// The plan rung: the job planned on each hardware row from the config (and a pilot), without
// building the model. Writes <run dir>/plan.json and plan.md (docs/plan.md).
#include "kiln/plan.h"

#include <fmt/format.h>

#include <cmath>

#include "core/files.h"
#include "core/strings.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/pilot.h"
#include "kiln/results.h"
#include "kiln/run.h"
#include "kiln/rungs.h"

namespace kiln {

RungResult run_plan(const Config& config, const std::filesystem::path& pilot_dir,
                    bool require_cost) {
  std::optional<PilotCalibration> pilot;
  if (!pilot_dir.empty()) pilot = read_pilot(pilot_dir, config);
  // The planner fills the plan's typed result whole (passed: some row fits 30 days); the rung
  // writes plan.json through it, as every rung writes its file.
  const PlanResult plan = make_plan(config, pilot ? &*pilot : nullptr, require_cost);
  RungResult result;
  result.rung = "plan";
  result.passed = plan.status.passed;
  result.verdict = plan.status.verdict;
  result.numbers = plan;
  result.table = result_rows(plan);
  const auto dir = run_directory(config);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    throw UserError(fmt::format("cannot create {} ({}); fix run.dir", dir.string(), ec.message()));
  write_file_atomic(dir / "plan.json", nlohmann::json(plan).dump(2) + "\n");
  write_file_atomic(dir / "plan.md", "# kiln plan\n\n" + plan_markdown(plan));
  log::info("plan written to " + (dir / "plan.json").string());
  return result;
}

}  // namespace kiln
