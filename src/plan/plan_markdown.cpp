// plan.md: the plan (kiln/results.h PlanResult, as make_plan fills it) as Markdown (docs/plan.md,
// "Outputs").
#include <fmt/format.h>

#include <cmath>
#include <limits>

#include "core/strings.h"
#include "kiln/plan.h"
#include "kiln/results.h"

namespace kiln {
namespace {

constexpr double kMarkdownDay = 86400.0;

// The table's wall-time cell: "12.34 d", or "1h02m" / "3m05s" for a job shorter than a day.
std::string markdown_wall_text(double seconds) {
  if (!std::isfinite(seconds)) return "never";
  return seconds >= kMarkdownDay ? fmt::format("{:.2f} d", seconds / kMarkdownDay)
                                 : format_duration(seconds);
}

// ETTR as a percentage that never rounds a small one to "0.0%" (a tiny job's ETTR is small: its
// wall time is mostly the pilot's fixed hours).
std::string markdown_ettr_text(double fraction) {
  const double percent = 100 * fraction;
  return percent >= 1 || percent == 0 ? fmt::format("{:.1f}%", percent)
                                      : fmt::format("{:.2g}%", percent);
}

std::string markdown_reservation(const PlanReservation& r) {
  std::string text = r.fits ? "fits" : "no";
  if (r.cost) text += fmt::format(", cost {:.0f}", *r.cost);
  return text;
}

}  // namespace

std::string plan_markdown(const PlanResult& plan) {
  std::string out = fmt::format(
      "Model: {} parameters ({}), {:.3g} FLOP/token; job: micro-batch {} x seq {} x accum {} on "
      "{} GPUs in {} (train.precision), {:.3g} tokens in {:.0f} steps; {}.\n\n",
      format_number(plan.parameters), plan.architecture, plan.flops_per_token, plan.micro_batch,
      plan.seq_len, plan.grad_accum_steps, plan.gpus, plan.precision, plan.tokens, plan.steps,
      plan.pilot ? "calibrated by the pilot in " + *plan.pilot : "no pilot: the assumptions below");
  out +=
      "| hardware | fits? | strategy | GPUs | step | wall | ETTR | ckpt every | 7 days | 30 days "
      "|\n";
  out += "|---|---|---|---|---|---|---|---|---|---|\n";
  for (const PlanRow& row : plan.rows) {
    const double wall = row.wall_seconds.value_or(std::numeric_limits<double>::infinity());
    out += fmt::format(
        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n", row.hardware,
        row.fits_memory ? "yes" : "**no**", row.strategy_text(), row.gpus,
        format_duration(row.step_seconds), row.fits_memory ? markdown_wall_text(wall) : "-",
        row.fits_memory ? markdown_ettr_text(row.ettr) : "-",
        row.checkpoint_interval_seconds > 0 ? format_duration(row.checkpoint_interval_seconds)
                                            : "-",
        markdown_reservation(row.reservation_7d), markdown_reservation(row.reservation_30d));
  }
  out +=
      "\nwall: the whole job with checkpoints, failures, drills, the pilot and the margin; ETTR: "
      "training time / wall; 7 days, 30 days: whether the job fits that reservation and, with "
      "prices, its cost (GPUs x hours x plan.price_<N>d_per_gpu_hour, in the prices' currency).\n";
  out += "\nRecommendation: " + plan.recommendation_text + ".\n";
  if (!plan.warnings.empty()) {
    out += "\nWarnings:\n";
    for (const auto& w : plan.warnings) out += "- " + w + "\n";
  }
  if (!plan.assumptions.empty()) {
    out += "\nAssumptions:\n";
    for (const auto& a : plan.assumptions) out += "- " + a + "\n";
  }
  out += "\nWhy each strategy:\n";
  for (const PlanRow& row : plan.rows) {
    const int64_t degree = row.fsdp_degree, gpus = row.gpus, tp = row.tp_degree;
    std::string how;
    if (row.strategy == "fsdp" && tp > 1) {
      const int64_t replicas = gpus / (degree * tp);
      how = fmt::format(
          "; tensor parallelism over {} inside a node, FSDP over {}{}: run it with "
          "dist.strategy = \"fsdp\", dist.tp = {}, dist.dp_replicate = {}",
          tp, degree, replicas > 1 ? fmt::format(" ({} replicas)", replicas) : "", tp, replicas);
    } else if (row.strategy == "fsdp" && degree > 0 && gpus > degree) {
      how = fmt::format(
          "; hybrid sharding: {} replicas of shard groups of {}, run by dist.strategy = \"auto\" "
          "(or \"fsdp\" with dist.dp_replicate = {})",
          gpus / degree, degree, gpus / degree);
    }
    out += fmt::format("- {}: {}{}\n", row.hardware, row.strategy_reason, how);
  }
  return out;
}

}  // namespace kiln
