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
#include "kiln/run.h"
#include "kiln/rungs.h"

namespace kiln {

RungResult run_plan(const Config& config, const std::filesystem::path& pilot_dir,
                    bool require_cost) {
  std::optional<PilotCalibration> pilot;
  if (!pilot_dir.empty()) pilot = read_pilot(pilot_dir, config);
  nlohmann::json plan = make_plan(config, pilot ? &*pilot : nullptr, require_cost);
  RungResult result;
  result.rung = "plan";
  result.numbers = plan;
  bool any_fits = false;
  for (const auto& row : plan["rows"]) {
    any_fits = any_fits || row["reservation_30d"]["fits"].get<bool>();
    const auto& s = row["strategy"];
    std::string strategy = s["strategy"].get<std::string>();
    if (strategy == "fsdp") strategy += fmt::format(" x{}", s["fsdp_degree"].get<int64_t>());
    const bool fits = row["fits_memory"].get<bool>();
    std::string value = fmt::format("{}, {} GPUs", strategy, row["gpus"].get<int64_t>());
    if (fits) {
      value += fmt::format(", step {}, {} days, ETTR {:.1f}%, checkpoint every {}",
                           format_duration(row["step_seconds"].get<double>()),
                           row["wall_days"].is_null()
                               ? std::string("never")
                               : fmt::format("{:.2f}", row["wall_days"].get<double>()),
                           100 * row["ettr"].get<double>(),
                           format_duration(row["checkpoint_interval_seconds"].get<double>()));
      for (const char* key : {"reservation_7d", "reservation_30d"}) {
        const auto& r = row[key];
        value += fmt::format(
            "; {}: {}{}", key == std::string("reservation_7d") ? "7 d" : "30 d",
            r["fits"].get<bool>() ? "fits" : "no",
            r["cost"].is_null() ? "" : fmt::format(" ({:.0f})", r["cost"].get<double>()));
      }
    }
    result.table.emplace_back(row["hardware"].get<std::string>(), value);
  }
  result.table.emplace_back("recommendation", plan["recommendation_text"].get<std::string>());
  // The plan is advice, not a gate on the job: it "passes" when some row fits 30 days.
  result.passed = any_fits;
  result.verdict = any_fits ? plan["recommendation_text"].get<std::string>()
                            : "nothing fits a 30-day reservation: " +
                                  plan["recommendation_text"].get<std::string>();
  plan["passed"] = result.passed;  // as every rung's JSON: the ladder's report reads them
  plan["verdict"] = result.verdict;
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
