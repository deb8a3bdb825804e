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
  nlohmann::json plan = make_plan(config, pilot ? &*pilot : nullptr, require_cost);
  // The plan's document is the planner's (kiln/plan.h); the rung reads it through its typed
  // result (a key the reader needs and the planner did not write stops here) and renders its
  // table and verdict from that.
  PlanResult typed = checked_result<PlanResult>(plan);
  bool any_fits = false;
  for (const auto& row : typed.rows) any_fits = any_fits || row.reservation_30d.fits;
  // The plan is advice, not a gate on the job: it "passes" when some row fits 30 days.
  typed.status.passed = any_fits;
  typed.status.verdict = any_fits
                             ? typed.recommendation_text
                             : "nothing fits a 30-day reservation: " + typed.recommendation_text;
  plan["schema_version"] = kResultSchemaVersion;  // as every rung's JSON: the report reads them
  plan["passed"] = typed.status.passed;
  plan["verdict"] = typed.status.verdict;
  RungResult result;
  result.rung = "plan";
  result.passed = typed.status.passed;
  result.verdict = typed.status.verdict;
  result.numbers = typed;
  result.table = result_rows(typed);
  const auto dir = run_directory(config);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    throw UserError(fmt::format("cannot create {} ({}); fix run.dir", dir.string(), ec.message()));
  write_file_atomic(dir / "plan.json", plan.dump(2) + "\n");
  write_file_atomic(dir / "plan.md", "# kiln plan\n\n" + plan_markdown(plan));
  log::info("plan written to " + (dir / "plan.json").string());
  return result;
}

}  // namespace kiln
