// Tracking a training run against its plan forecast (docs/plan.md, "Forecast against actual"):
// `kiln train` adds a PlanTrackingHook when the plan could forecast the job (kiln/plan.h
// log_plan_forecast), so every train.metrics_every steps metrics.jsonl carries a "plan" record
// and the log says how the run is doing against the plan. Rank 0 only.
#pragma once

#include <memory>

#include "core/clock.h"
#include "kiln/plan.h"
#include "kiln/results.h"
#include "kiln/train.h"

namespace kiln {

class Run;

/// Every `every` steps (at synced steps: their metrics records exist beside), and once more at
/// the end of fit(), appends {"step": N, "plan": {...}} to the run's metrics file, a
/// MetricsRecord whose `plan` is a PlanProgress (kiln/results.h; written through its to_json, so
/// the keys are the ones the report and `kiln plan --actual` read):
///   tokens_per_second            per device over the steps since the last plan record
///                                (tokens of those steps / world size / their step seconds)
///   tokens_per_second_forecast   the forecast's (absent when it has no step time)
///   tokens_per_second_vs_plan    the first over the second
///   elapsed_seconds              wall time since fit() began
///   step_seconds                 the steps' times summed (StepStats::step_seconds)
///   checkpoint_seconds           time spent in the checkpoint phase, inside steps or between
///   productive_seconds           step_seconds less the checkpoint time inside steps
///   ettr                         productive_seconds / elapsed_seconds
///   eta_seconds                  the steps left at this run's pace so far (elapsed / steps
///                                done); 0 at the end
///   final                        true on the record written at the end of fit()
/// and logs one line with them at most every `log_every` steps (and at the end: finish()).
/// `world_size` divides StepStats::tokens (all processes) into per-device figures. Runs on the
/// training thread.
class PlanTrackingHook final : public TrainerHook {
 public:
  PlanTrackingHook(Run& run, Forecast forecast, int64_t total_steps, int64_t world_size,
                   int64_t every, int64_t log_every);
  void on_train_begin(Trainer& trainer) override;
  void on_step_begin(Trainer&, int64_t) override { in_step_ = true; }
  void on_phase_begin(Trainer&, Phase phase) override;
  void on_phase_end(Trainer&, Phase phase) override;
  void on_step_end(Trainer& trainer, const StepStats& stats) override;
  /// Writes the final record: called by the hook finisher() returns, which the caller adds after
  /// the checkpoint hook, so the final save (and the wait for it) is counted.
  void finish(Trainer& trainer);
  /// A hook whose on_train_end calls tracker->finish().
  static std::shared_ptr<TrainerHook> finisher(std::shared_ptr<PlanTrackingHook> tracker);

 private:
  PlanProgress record(int64_t step, bool final);
  void log_line(const PlanProgress& plan) const;

  Run& run_;
  Forecast forecast_;
  int64_t total_steps_, world_size_, every_, log_every_;
  SteadyClock::time_point begin_;
  int64_t first_step_ = 0, steps_done_ = 0, last_logged_step_ = 0;
  bool in_step_ = false;
  int checkpoint_depth_ = 0;
  SteadyClock::time_point checkpoint_begin_;
  double step_seconds_ = 0, checkpoint_seconds_ = 0, checkpoint_in_steps_seconds_ = 0;
  // Since the last plan record.
  double window_tokens_ = 0, window_seconds_ = 0;
};

}  // namespace kiln
