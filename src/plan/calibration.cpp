// The compute calibration the plan and the forecast share (plan/calibration.h).
#include "plan/calibration.h"

#include <fmt/format.h>

namespace kiln {

bool pilot_ran_on(const PilotCalibration* pilot, const std::vector<Device>& catalog,
                  const Device* row, const std::string& device_name) {
  if (pilot == nullptr) return false;
  if (!device_name.empty() && pilot->device == device_name) return true;
  return row != nullptr && device_for_name(catalog, pilot->device) == row;
}

ComputeCalibration calibrate_compute(const PilotCalibration* pilot, bool pilot_here,
                                     double configured_peak, const Device* row,
                                     const std::string& precision, double flops_per_step,
                                     double assumed_mfu) {
  ComputeCalibration c;
  std::string catalog_source;
  if (configured_peak > 0) {
    c.catalog_peak_flops_per_second = configured_peak;
    catalog_source = "baseline.peak_flops_per_second";
  } else if (row != nullptr && row->peak_flops_for(precision) > 0) {
    c.catalog_peak_flops_per_second = row->peak_flops_for(precision);
    catalog_source =
        fmt::format("hardware catalog ({}, {})", row->name, compute_precision(precision));
  }
  if (pilot_here && pilot != nullptr && pilot->step_seconds > 0 && flops_per_step > 0) {
    // The pilot ran this job's step on this device: its achieved rate (the FLOPs counted here,
    // per device) over the peak it measured.
    const double achieved = flops_per_step / pilot->step_seconds;
    if (pilot->matmul_peak_flops_per_second > 0) {
      c.peak_flops_per_second = pilot->matmul_peak_flops_per_second;
      c.peak_source = "matmul at the job's shape, measured by the pilot";
    } else if (c.catalog_peak_flops_per_second > 0) {
      c.peak_flops_per_second = c.catalog_peak_flops_per_second;
      c.peak_source = catalog_source;
    } else {
      c.peak_flops_per_second = achieved;
      c.peak_source = "the pilot's achieved rate (no peak measured or catalogued)";
    }
    c.mfu = achieved / c.peak_flops_per_second;
    c.mfu_source = pilot->step_timing.empty()
                       ? std::string("pilot (measured on this device)")
                       : "pilot (measured on this device: " + pilot->step_timing + ")";
    c.measured = true;
    return c;
  }
  c.peak_flops_per_second = c.catalog_peak_flops_per_second;
  c.peak_source =
      c.peak_flops_per_second > 0 ? catalog_source : "none: no catalog row for this device";
  c.mfu = assumed_mfu;
  c.mfu_source = "plan.mfu (assumed)";
  return c;
}

}  // namespace kiln
