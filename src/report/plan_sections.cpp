// The report's pilot and plan sections (docs/plan.md), from their typed results: the pilot's
// memory by part, estimated beside measured, and its cycle; the plan's rows with the
// recommended one marked.
#include <fmt/format.h>

#include <cmath>

#include "report/sections.h"

namespace kiln::report {

void pilot_section(const RunData& run, SectionSink& sink) {
  Section* section = rung_section(run.pilot, sink, "Pilot");
  if (section == nullptr) return;
  const PilotResult& p = *run.pilot.value;
  Chart memory{"pilot-memory",
               "Memory by part: estimated beside measured",
               true,
               true,
               false,
               "",
               "bytes",
               "",
               {"estimated", "measured"},
               {}};
  for (const auto& [label, estimated, measured] :
       {std::tuple{"parameters", p.estimated.parameters, p.measured.parameters},
        std::tuple{"gradients", p.estimated.gradients, p.measured.gradients},
        std::tuple{"optimizer state", p.estimated.optimizer, p.measured.optimizer},
        std::tuple{"activations + logits", p.estimated.activations_and_logits,
                   p.measured.activations_and_logits}}) {
    memory.series.push_back({label, {}, {estimated, measured}});
  }
  section->chart(memory);
  const std::string restore =
      p.restore.passed
          ? fmt::format("step {} restored in a fresh process in {}: loss {}", p.restore.step,
                        seconds_text(p.restore.seconds),
                        p.restore.loss_bitwise_equal ? "bitwise equal" : "equal within tolerance")
          : fmt::format("FAILED (exit status {}), {} differing tensor(s)", p.restore.exit_status,
                        p.restore.differing_tensors.size());
  section->measures({
      {"step peak",
       fmt::format("{} measured, {} estimated ({:.2f}x){}", bytes_text(p.measured.step_peak),
                   bytes_text(p.estimated.step_peak), p.measured_over_estimate,
                   p.within_allowed_error ? "" : ": outside pilot.max_estimate_error")},
      {"memory method", p.memory_method},
      {"shape",
       fmt::format("micro-batch {} x seq {} x accum {} x {} process(es), {}", p.micro_batch,
                   p.seq_len, p.grad_accum_steps, p.world_size, p.precision)},
      {"measured step", fmt::format("{}, loss {}{}", seconds_text(p.step_seconds), number(p.loss),
                                    p.mfu ? ", MFU " + percent_text(*p.mfu) : "")},
      {"evaluation",
       fmt::format("{}, validation loss {}", seconds_text(p.eval_seconds), number(p.val_loss))},
      {"checkpoint save",
       fmt::format("{} in {} ({}/s)", bytes_text(p.checkpoint_bytes), seconds_text(p.save_seconds),
                   bytes_text(p.write_bytes_per_second))},
      {"restore", restore},
      {"pins", fmt::format("job hash {} (the plan's --pilot check), config hash {}", p.job_hash,
                           p.config_hash)},
      {"whole pilot", seconds_text(p.wall_seconds)},
  });
  if (!p.restore.differing_tensors.empty())
    section->bullets("Differing tensors", p.restore.differing_tensors);
  section->details("Every number of pilot.json the report reads", flatten(nlohmann::json(p)));
}

void plan_section(const RunData& run, SectionSink& sink) {
  Section* section = rung_section(run.plan, sink, "Plan");
  if (section == nullptr) return;
  const PlanResult& p = *run.plan.value;
  section->measures({
      {"calibrated by", p.pilot ? "the pilot in " + *p.pilot : "no pilot: the assumptions below"},
      {"model", fmt::format("{}, {} parameters, {} FLOP/token", p.architecture,
                            number(p.parameters), short_number(p.flops_per_token))},
      {"job", fmt::format("micro-batch {} x seq {} x accum {} on {} GPUs, {}, {}", p.micro_batch,
                          p.seq_len, p.grad_accum_steps, p.gpus, p.precision, p.optimizer)},
      {"tokens", fmt::format("{} in {} steps ({} per step)", short_number(p.tokens),
                             short_number(p.steps), short_number(p.tokens_per_step))},
      {"checkpoint", bytes_text(p.checkpoint_bytes)},
  });
  const int chosen = p.recommended_row();
  std::vector<std::vector<std::string>> rows;
  std::vector<std::string> reasons;
  for (size_t k = 0; k < p.rows.size(); ++k) {
    const PlanRow& r = p.rows[k];
    auto reservation = [](const PlanReservation& x) {
      return std::string(x.fits ? "fits" : "no") +
             (x.cost ? ", cost " + short_number(*x.cost) : std::string());
    };
    const bool is_chosen = static_cast<int>(k) == chosen;
    rows.push_back({
        r.hardware + (is_chosen ? " (recommended)" : ""),
        r.display_name,
        std::to_string(r.gpus),
        yes_no(r.fits_memory),
        r.strategy_text(),
        bytes_text(r.bytes_per_device()),
        bytes_text(r.usable_bytes),
        fmt::format("{} ({} compute + {} comm)", seconds_text(r.step_seconds),
                    seconds_text(r.compute_seconds_per_step),
                    seconds_text(r.communication_seconds_per_step)),
        r.step_seconds > 0 ? short_number(p.tokens_per_step / r.step_seconds) : "-",
        fmt::format("{} ({})", percent_text(r.mfu),
                    r.mfu_source.starts_with("pilot") ? "pilot" : "assumed"),
        r.wall_days ? short_number(*r.wall_days) : "-",
        percent_text(r.ettr),
        seconds_text(r.checkpoint_interval_seconds),
        r.expected_failures ? short_number(*r.expected_failures) : "-",
        reservation(r.reservation_7d),
        reservation(r.reservation_30d),
    });
    reasons.push_back(r.hardware + ": " + r.strategy_reason);
  }
  section->subsection("Hardware rows");
  section->grid({"hardware", "device", "GPUs", "fits memory", "strategy", "memory per device",
                 "usable per device", "step", "tokens/s", "MFU", "wall days", "ETTR",
                 "checkpoint every", "expected failures", "7 days", "30 days"},
                rows, chosen, "plan");
  section->paragraph("Recommendation: " + p.recommendation_text +
                     ". tokens/s = the job's tokens per step / the row's step time.");
  section->bullets("Why each strategy", reasons);
  section->bullets("Assumptions", p.assumptions);
  section->details("Every number of plan.json the report reads", flatten(nlohmann::json(p)));
}

}  // namespace kiln::report
