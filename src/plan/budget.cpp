// Young's interval, the recovery-aware period and the whole-process budget (docs/plan.md,
// "Budget").
#include <algorithm>
#include <cmath>
#include <limits>

#include "kiln/plan.h"

namespace kiln {

double young_interval_seconds(double save_seconds, double job_mtbf_seconds) {
  if (save_seconds <= 0 || job_mtbf_seconds <= 0) return 0;
  return std::sqrt(2.0 * save_seconds * job_mtbf_seconds);
}

double recovery_aware_interval_seconds(double save_seconds, double job_mtbf_seconds,
                                       double recovery_seconds) {
  if (save_seconds <= 0 || job_mtbf_seconds <= 0) return 0;
  const double d = save_seconds, m = job_mtbf_seconds, r = std::max(0.0, recovery_seconds);
  return d + std::sqrt(2.0 * (m + r) * d + d * d);
}

Budget budget(const BudgetInput& in) {
  Budget b;
  b.compute_seconds = in.compute_seconds_per_step;
  b.communication_seconds = in.communication_seconds_per_step;
  b.step_seconds = b.compute_seconds + b.communication_seconds;
  b.train_seconds = in.steps * b.step_seconds;
  b.eval_seconds = in.evals * in.eval_seconds;
  b.save_seconds = in.save_seconds;
  b.pilot_seconds = in.pilot_seconds;
  const double work = b.train_seconds + b.eval_seconds;
  double run = work;
  if (in.gpu_mtbf_hours > 0 && in.gpus > 0) {
    b.job_mtbf_seconds = in.gpu_mtbf_hours * 3600.0 / static_cast<double>(in.gpus);
    b.young_interval_seconds = young_interval_seconds(in.save_seconds, b.job_mtbf_seconds);
    b.checkpoint_interval_seconds =
        recovery_aware_interval_seconds(in.save_seconds, b.job_mtbf_seconds, in.restart_seconds);
    if (b.checkpoint_interval_seconds > in.save_seconds) {
      // One save of delta per Tc - delta of work.
      b.saves_seconds = work / (b.checkpoint_interval_seconds - in.save_seconds) * in.save_seconds;
    }
    // Each failure loses half a period on average, and the restart.
    const double lost_per_failure = b.checkpoint_interval_seconds / 2.0 + in.restart_seconds;
    const double waste = lost_per_failure / b.job_mtbf_seconds;
    if (waste >= 1.0) {
      run = std::numeric_limits<double>::infinity();
    } else {
      run = (work + b.saves_seconds) / (1.0 - waste);
    }
    b.expected_failures = run / b.job_mtbf_seconds;
    b.lost_seconds = b.expected_failures * lost_per_failure;
  }
  b.drills_seconds =
      static_cast<double>(in.restore_drills) * (in.restart_seconds + in.save_seconds);
  const double subtotal = run + b.drills_seconds + b.pilot_seconds;
  b.margin_seconds = subtotal * in.margin_fraction;
  b.wall_seconds = subtotal + b.margin_seconds;
  b.ettr =
      b.wall_seconds > 0 && std::isfinite(b.wall_seconds) ? b.train_seconds / b.wall_seconds : 0;
  return b;
}

}  // namespace kiln
