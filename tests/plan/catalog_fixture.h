// A catalog row for this machine's CPU, for the plan tests that calibrate from a pilot run here.
#pragma once

#include <filesystem>

#include "support/helpers.h"

namespace kiln::testing {

/// Writes a one-row catalog, device "this-cpu" matching "CPU" (8 GB, fp32 peak 0.1 TFLOP/s), to
/// `file`, for plan.catalog with plan.hardware = this-cpu.
inline void write_this_cpu_catalog(const std::filesystem::path& file) {
  write_text(file, R"([device.this-cpu]
match = ["CPU"]
memory_gb = 8
memory_bandwidth_gb_per_s = 20
interconnect_gb_per_s = 10
network_gb_per_s = 1
peak_tflops = { fp32 = 0.1 }
source = "a test row"
date = "2026-12"
)");
}

}  // namespace kiln::testing
