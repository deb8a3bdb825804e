// A run's compute rate against its device (device_rate.h).
#include "rungs/device_rate.h"

#include <fmt/format.h>

#include "core/files.h"
#include "core/strings.h"
#include "kiln/error.h"
#include "kiln/log.h"

namespace kiln {

double run_catalog_peak_flops(const Config& config, const std::filesystem::path& manifest_path,
                              const torch::Device& device, std::string& source) {
  using nlohmann::json;
  const std::string device_name = manifest_device_name(
      std::filesystem::exists(manifest_path)
          ? json::parse(read_file(manifest_path), nullptr, /*allow_exceptions=*/false)
          : json(nullptr),
      device.is_cuda() ? static_cast<int>(device.index()) : -1);
  const std::string precision = training_precision(config);
  source = fmt::format("hardware catalog ({}, {})", device_name, precision);
  return catalog_peak_flops(config, device_name, precision);
}

std::optional<MatmulPeak> time_job_matmul(const Config& config, const torch::Device& device,
                                          double budget_seconds, const std::string& who) {
  try {
    const JobShape job = job_shape(config);
    return measure_matmul_peak(job_matmul_shape(model_shape(config), job), job.precision,
                               device.str(), budget_seconds);
  } catch (const std::exception& e) {
    log::warn(who + ": the matmul peak was not timed: " + one_line_error(e));
  }
  return std::nullopt;
}

MatmulPeakRecord matmul_peak_record(const MatmulPeak& m) {
  return MatmulPeakRecord{m.flops_per_second, m.shape.m, m.shape.n, m.shape.k, m.dtype,
                          m.median_seconds,   m.repeats};
}

}  // namespace kiln
