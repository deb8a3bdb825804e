// The report's pilot and plan sections (docs/plan.md), from their typed results: the pilot's
// memory by part, estimated beside measured, and its cycle; the plan's rows with the
// recommended one marked; a kiln train run against the plan's forecast (its metrics file's plan
// records, kiln/results.h PlanProgress).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "report/sections.h"

namespace kiln::report {

void pilot_section(const RunData& run, SectionSink& sink) {
  Section* section = rung_section(run.pilot, sink, "Pilot");
  if (section == nullptr) return;
  const PilotResult& p = *run.pilot.value;
  // Grouped, not stacked: the step peak (the headline) is its own pair of bars, since the parts
  // are not all held at once (the parts' sum is not the peak). In the unit that fits the sizes.
  const double largest = std::max(p.estimated.step_peak, p.measured.step_peak);
  const auto [unit, scale] = largest >= 1e9   ? std::pair{"GB", 1e9}
                             : largest >= 1e6 ? std::pair{"MB", 1e6}
                                              : std::pair{"kB", 1e3};
  Chart memory{"pilot-memory",
               fmt::format("Memory by part and the step peak, {}: estimated beside measured", unit),
               true,
               false,
               false,
               "",
               unit,
               "",
               {"parameters", "gradients", "optimizer state", "activations + logits", "step peak"},
               {}};
  Series estimated{"estimated", {}, {}}, measured{"measured", {}, {}};
  for (const auto& [e, m] :
       {std::pair{p.estimated.parameters, p.measured.parameters},
        std::pair{p.estimated.gradients, p.measured.gradients},
        std::pair{p.estimated.optimizer, p.measured.optimizer},
        std::pair{p.estimated.activations_and_logits, p.measured.activations_and_logits},
        std::pair{p.estimated.step_peak, p.measured.step_peak}}) {
    estimated.y.push_back(e / scale);
    measured.y.push_back(m / scale);
  }
  memory.series = {estimated, measured};
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
        !r.expected_failures          ? "-"
        : *r.expected_failures < 0.01 ? "< 0.01"
                                      : short_number(*r.expected_failures),
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

namespace {

// "+12.3%": (forecast - actual) / actual, as `kiln plan --actual` writes its error column.
std::string forecast_error_text(double forecast, double actual) {
  if (!(actual > 0) || !std::isfinite(forecast)) return "";
  return fmt::format(", error {:+.1f}%", 100 * (forecast - actual) / actual);
}

}  // namespace

const MetricsFile* plan_tracking_metrics(const RunData& run) {
  auto has_plan = [](const MetricsFile& m) {
    return std::any_of(m.records.begin(), m.records.end(),
                       [](const MetricsRecord& r) { return r.plan.has_value(); });
  };
  if (const MetricsFile* main = run.main_metrics(); main != nullptr && has_plan(*main)) return main;
  for (const auto& m : run.metrics) {
    if (has_plan(m)) return &m;
  }
  return nullptr;
}

void plan_tracking_section(const RunData& run, SectionSink& sink) {
  const MetricsFile* metrics = plan_tracking_metrics(run);
  if (metrics == nullptr) return;
  const bool tokens = records_tokens(*metrics);
  const std::string unit = tokens ? "tokens/s" : "samples/s";
  Series rate{unit + " per device (since the last record)", {}, {}};
  Series rate_forecast{"forecast", {}, {}};
  Series ettr{"ETTR so far", {}, {}}, ettr_forecast{"forecast", {}, {}};
  std::vector<double> vs_plan;
  const MetricsRecord* last = nullptr;
  const PlanProgress* last_rate = nullptr;  // the final record may have no steps since the last
  for (const auto& r : metrics->records) {
    if (!r.plan) continue;
    const PlanProgress& p = *r.plan;
    const double step = static_cast<double>(r.step);
    last = &r;
    if (p.tokens_per_second) last_rate = &p;
    if (p.tokens_per_second) rate.x.push_back(step), rate.y.push_back(*p.tokens_per_second);
    if (p.tokens_per_second_forecast)
      rate_forecast.x.push_back(step), rate_forecast.y.push_back(*p.tokens_per_second_forecast);
    if (p.tokens_per_second_vs_plan) vs_plan.push_back(*p.tokens_per_second_vs_plan);
    ettr.x.push_back(step), ettr.y.push_back(p.ettr);
    if (p.ettr_forecast)
      ettr_forecast.x.push_back(step), ettr_forecast.y.push_back(*p.ettr_forecast);
  }
  const PlanProgress& end = *last->plan;
  Section& section = sink.add("plan-tracking", "Against the plan: " + metrics->name);
  section.intro(fmt::format(
      "kiln train tracked this run against the plan's forecast: {} plan record(s), the last at "
      "step {}{}.",
      ettr.x.size(), last->step,
      end.final ? " (the final one, after the last save)"
                : " (no final record: the run stopped before the end of training)"));
  Chart throughput{"plan-tracking-throughput",
                   "Throughput per device against the forecast",
                   false,
                   false,
                   false,
                   "step",
                   unit + " per device",
                   "",
                   {},
                   {}};
  for (const Series* s : {&rate, &rate_forecast}) {
    if (!s->x.empty()) throughput.series.push_back(*s);
  }
  if (!throughput.series.empty()) section.chart(throughput);
  Chart ettr_chart{"plan-tracking-ettr",
                   "ETTR so far against the forecast",
                   false,
                   false,
                   false,
                   "step",
                   "ETTR",
                   "",
                   {},
                   {}};
  for (const Series* s : {&ettr, &ettr_forecast}) {
    if (!s->x.empty()) ettr_chart.series.push_back(*s);
  }
  section.chart(ettr_chart);
  std::string rate_text = "-";
  if (!vs_plan.empty()) {
    std::vector<double> sorted = vs_plan;
    std::sort(sorted.begin(), sorted.end());
    const size_t n = sorted.size();
    const double median = n % 2 == 1 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
    rate_text = fmt::format(
        "{} of the forecast {} (median over the records; {} to {}); the last record's {}",
        percent_text(median),
        throughput_text(last_rate->tokens_per_second_forecast.value_or(NAN), tokens),
        percent_text(sorted.front()), percent_text(sorted.back()),
        throughput_text(*last_rate->tokens_per_second, tokens));
  } else if (last_rate != nullptr) {
    rate_text = throughput_text(*last_rate->tokens_per_second, tokens) + " (no step-time forecast)";
  }
  const std::string time_name = end.final ? "wall time" : "elapsed so far";
  section.measures({
      {unit + " per device", rate_text},
      {"ETTR", end.ettr_forecast ? fmt::format("{} (forecast {}{})", percent_text(end.ettr),
                                               percent_text(*end.ettr_forecast),
                                               forecast_error_text(*end.ettr_forecast, end.ettr))
                                 : percent_text(end.ettr) + " (no forecast)"},
      {time_name,
       end.wall_seconds_forecast && end.final
           ? fmt::format("{} (forecast {}{})", seconds_text(end.elapsed_seconds),
                         seconds_text(*end.wall_seconds_forecast),
                         forecast_error_text(*end.wall_seconds_forecast, end.elapsed_seconds))
           : seconds_text(end.elapsed_seconds) +
                 (end.final ? "" : fmt::format(", ETA {}", seconds_text(end.eta_seconds)))},
      {"checkpoint time",
       fmt::format(
           "{} ({} of the elapsed time)", seconds_text(end.checkpoint_seconds),
           percent_text(end.elapsed_seconds > 0 ? end.checkpoint_seconds / end.elapsed_seconds
                                                : NAN))},
      {"steps", fmt::format("{} summed step time, {} productive", seconds_text(end.step_seconds),
                            seconds_text(end.productive_seconds))},
  });
  section.paragraph(
      "Error = (forecast - actual) / actual, as kiln plan --actual prints it (docs/plan.md, "
      "\"Forecast against actual\") beside the run's step time, memory and checkpoint save "
      "against the forecast.");
}

}  // namespace kiln::report
