// The run against its plan forecast, step by step (src/rungs/plan_tracking.h).
#include "rungs/plan_tracking.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/strings.h"
#include "kiln/log.h"
#include "kiln/run.h"

namespace kiln {

PlanTrackingHook::PlanTrackingHook(Run& run, Forecast forecast, int64_t total_steps,
                                   int64_t world_size, int64_t every, int64_t log_every)
    : run_(run),
      forecast_(std::move(forecast)),
      total_steps_(total_steps),
      world_size_(std::max<int64_t>(1, world_size)),
      every_(std::max<int64_t>(1, every)),
      log_every_(std::max<int64_t>(1, log_every)) {}

void PlanTrackingHook::on_train_begin(Trainer& trainer) {
  begin_ = SteadyClock::now();
  first_step_ = trainer.step();  // a resumed run tracks the steps it runs
}

void PlanTrackingHook::on_phase_begin(Trainer&, Phase phase) {
  if (phase != Phase::kCheckpoint || checkpoint_depth_++ > 0) return;
  checkpoint_begin_ = SteadyClock::now();
}

void PlanTrackingHook::on_phase_end(Trainer&, Phase phase) {
  if (phase != Phase::kCheckpoint || --checkpoint_depth_ > 0) return;
  const double seconds = seconds_since(checkpoint_begin_);
  checkpoint_seconds_ += seconds;
  if (in_step_) checkpoint_in_steps_seconds_ += seconds;  // inside the step's own time
}

void PlanTrackingHook::on_step_end(Trainer& trainer, const StepStats& stats) {
  in_step_ = false;
  ++steps_done_;
  step_seconds_ += stats.step_seconds;
  window_seconds_ += stats.step_seconds;
  window_tokens_ += static_cast<double>(stats.tokens > 0 ? stats.tokens : stats.samples) /
                    static_cast<double>(world_size_);
  if (!stats.synced || stats.step % every_ != 0) return;
  const PlanProgress plan = record(trainer.step(), /*final=*/false);
  if (stats.step - last_logged_step_ >= log_every_) {
    log_line(plan);
    last_logged_step_ = stats.step;
  }
}

void PlanTrackingHook::finish(Trainer& trainer) {
  log_line(record(trainer.step(), /*final=*/true));
}

namespace {

class PlanTrackingFinisher final : public TrainerHook {
 public:
  explicit PlanTrackingFinisher(std::shared_ptr<PlanTrackingHook> tracker)
      : tracker_(std::move(tracker)) {}
  void on_train_end(Trainer& trainer) override { tracker_->finish(trainer); }

 private:
  std::shared_ptr<PlanTrackingHook> tracker_;
};

}  // namespace

std::shared_ptr<TrainerHook> PlanTrackingHook::finisher(std::shared_ptr<PlanTrackingHook> tracker) {
  return std::make_shared<PlanTrackingFinisher>(std::move(tracker));
}

PlanProgress PlanTrackingHook::record(int64_t step, bool final) {
  PlanProgress plan;
  const double elapsed = seconds_since(begin_);
  if (window_seconds_ > 0) {
    const double rate = window_tokens_ / window_seconds_;
    plan.tokens_per_second = rate;
    if (forecast_.tokens_per_second > 0) {
      plan.tokens_per_second_forecast = forecast_.tokens_per_second;
      plan.tokens_per_second_vs_plan = rate / forecast_.tokens_per_second;
    }
  }
  plan.elapsed_seconds = elapsed;
  plan.step_seconds = step_seconds_;
  plan.checkpoint_seconds = checkpoint_seconds_;
  plan.productive_seconds = step_seconds_ - checkpoint_in_steps_seconds_;
  plan.ettr = elapsed > 0 ? plan.productive_seconds / elapsed : 0.0;
  if (forecast_.ettr > 0) plan.ettr_forecast = forecast_.ettr;
  const int64_t left = std::max<int64_t>(0, total_steps_ - step);
  plan.eta_seconds =
      final || steps_done_ == 0 ? 0.0 : elapsed / static_cast<double>(steps_done_) * left;
  if (forecast_.wall_seconds > 0) plan.wall_seconds_forecast = forecast_.wall_seconds;
  plan.final = final;
  MetricsRecord line;
  line.step = step;
  line.plan = plan;
  run_.append_metrics(nlohmann::json(line));  // {"step": N, "plan": {...}}
  window_tokens_ = 0;
  window_seconds_ = 0;
  return plan;
}

void PlanTrackingHook::log_line(const PlanProgress& plan) const {
  std::string line = "against plan:";
  if (plan.tokens_per_second_vs_plan && plan.tokens_per_second_forecast) {
    line += fmt::format(" {:.4g} tokens/s per device = {:.1f}% of the forecast {:.4g};",
                        plan.tokens_per_second.value_or(0), 100 * *plan.tokens_per_second_vs_plan,
                        *plan.tokens_per_second_forecast);
  } else if (plan.tokens_per_second) {
    line += fmt::format(" {:.4g} tokens/s per device (no step-time forecast);",
                        *plan.tokens_per_second);
  }
  line += fmt::format(" checkpoints {} so far; ETTR {:.1f}%",
                      format_duration(plan.checkpoint_seconds), 100 * plan.ettr);
  if (plan.ettr_forecast) line += fmt::format(" (forecast {:.1f}%)", 100 * *plan.ettr_forecast);
  if (plan.final) {
    line += fmt::format("; finished in {}", format_duration(plan.elapsed_seconds));
    if (plan.wall_seconds_forecast)
      line += fmt::format(" (forecast {})", format_duration(*plan.wall_seconds_forecast));
  } else {
    line += fmt::format("; ETA {}", format_duration(plan.eta_seconds));
  }
  log::info(line);
}

}  // namespace kiln
