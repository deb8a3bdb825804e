// The rungs' own keys read into typed options, once per rung ([baseline], [pilot], the scale
// rung's and the drill's keys of [dist] and [checkpoint]). src/rungs/options.cpp is the only
// place the rungs read a key by name.
#pragma once

#include <cstdint>

#include "kiln/config.h"

namespace kiln {

struct BaselineRungOptions {
  int64_t warmup_steps = 0, steps = 0;  // baseline.warmup_steps, baseline.steps
  double peak_flops_per_second = 0;     // baseline.peak_flops_per_second (0: the catalog's)
  double min_loss_drop = 0;             // baseline.min_loss_drop
  static BaselineRungOptions from_config(const Config& config);
};

struct PilotRungOptions {
  int64_t steps = 0;                 // pilot.steps
  double max_estimate_error = 0;     // pilot.max_estimate_error
  double peak_flops_per_second = 0;  // baseline.peak_flops_per_second (0: the catalog's)
  static PilotRungOptions from_config(const Config& config);
};

struct ScaleRungOptions {
  int processes = 0;  // dist.scale_processes (0: the rung is off)
  int64_t warmup_steps = 0, steps = 0, baseline_steps = 0;  // dist.scale_*
  double min_scaling_efficiency = 0;                        // dist.min_scaling_efficiency
  double timeout_seconds = 0;                               // dist.timeout_seconds
  static ScaleRungOptions from_config(const Config& config);
};

struct DrillRungOptions {
  bool drill = false;       // checkpoint.drill
  int64_t drill_steps = 0;  // checkpoint.drill_steps (each half)
  static DrillRungOptions from_config(const Config& config);
};

}  // namespace kiln
