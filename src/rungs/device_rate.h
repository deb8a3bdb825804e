// A run's compute rate against the device it ran on, for the baseline rung and `kiln train`'s
// summary: the catalog's dense peak for the device (none on a CPU), and the job's largest GEMM
// timed there (kiln/plan.h measure_matmul_peak), the peak that means something on any device.
#pragma once

#include <torch/types.h>

#include <filesystem>
#include <optional>
#include <string>

#include "kiln/config.h"
#include "kiln/plan.h"
#include "kiln/results.h"

namespace kiln {

/// The catalog's dense peak FLOP/s for the training precision of the device named in the run's
/// manifest (`manifest_path`, Run::manifest_file(); 0: no row matches, e.g. "cpu"); `source`
/// says which row.
double run_catalog_peak_flops(const Config& config, const std::filesystem::path& manifest_path,
                              const torch::Device& device, std::string& source);

/// The job's GEMM (job_matmul_shape) timed on `device` in the job's compute precision for about
/// `budget_seconds`; nullopt with a warning naming `who` when the plan's shapes do not describe
/// the model.
std::optional<MatmulPeak> time_job_matmul(const Config& config, const torch::Device& device,
                                          double budget_seconds, const std::string& who);

/// The timed GEMM as a result file records it ("matmul_peak").
MatmulPeakRecord matmul_peak_record(const MatmulPeak& matmul);

}  // namespace kiln
