// The one rule by which the plan (each catalog row) and the forecast (the device a run is on)
// know a device's compute rate: its peak FLOP/s and the MFU, and where each came from
// (docs/plan.md, "Measured matmul peak").
#pragma once

#include <string>

#include "kiln/plan.h"

namespace kiln {

struct ComputeCalibration {
  double peak_flops_per_second = 0;  // 0: unknown (no step time can be forecast)
  std::string peak_source;
  double catalog_peak_flops_per_second = 0;  // the configured or catalogued peak (0: none)
  double mfu = 0;
  std::string mfu_source;
  bool measured = false;  // the pilot's step on this device gave the MFU
};

/// Whether `pilot` ran on the device named `device_name` (its runtime name) or of catalog `row`.
bool pilot_ran_on(const PilotCalibration* pilot, const std::vector<Device>& catalog,
                  const Device* row, const std::string& device_name);

/// The device's peak and MFU for a step of `flops_per_step` FLOPs (per device) in `precision`:
/// with a pilot that ran here (`pilot_here`) and timed its step, the MFU is its achieved rate
/// over the peak, and the peak is the matmul it timed, else `configured_peak` (> 0), else `row`'s
/// catalogued peak, else the achieved rate itself; without one, that peak and `assumed_mfu`
/// (plan.mfu). Pure.
ComputeCalibration calibrate_compute(const PilotCalibration* pilot, bool pilot_here,
                                     double configured_peak, const Device* row,
                                     const std::string& precision, double flops_per_step,
                                     double assumed_mfu);

}  // namespace kiln
