// The rungs' keys read into typed options (src/rungs/options.h).
#include "rungs/options.h"

namespace kiln {

BaselineRungOptions BaselineRungOptions::from_config(const Config& config) {
  BaselineRungOptions o;
  o.warmup_steps = config.get_int("baseline.warmup_steps");
  o.steps = config.get_int("baseline.steps");
  o.peak_flops_per_second = config.get_float("baseline.peak_flops_per_second");
  o.min_loss_drop = config.get_float("baseline.min_loss_drop");
  return o;
}

PilotRungOptions PilotRungOptions::from_config(const Config& config) {
  PilotRungOptions o;
  o.steps = config.get_int("pilot.steps");
  o.max_estimate_error = config.get_float("pilot.max_estimate_error");
  o.peak_flops_per_second = config.get_float("baseline.peak_flops_per_second");
  return o;
}

ScaleRungOptions ScaleRungOptions::from_config(const Config& config) {
  ScaleRungOptions o;
  o.processes = static_cast<int>(config.get_int("dist.scale_processes"));
  o.warmup_steps = config.get_int("dist.scale_warmup_steps");
  o.steps = config.get_int("dist.scale_steps");
  o.baseline_steps = config.get_int("dist.scale_baseline_steps");
  o.min_scaling_efficiency = config.get_float("dist.min_scaling_efficiency");
  o.timeout_seconds = config.get_float("dist.timeout_seconds");
  return o;
}

DrillRungOptions DrillRungOptions::from_config(const Config& config) {
  DrillRungOptions o;
  o.drill = config.get_bool("checkpoint.drill");
  o.drill_steps = config.get_int("checkpoint.drill_steps");
  return o;
}

}  // namespace kiln
