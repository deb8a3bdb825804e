#include "kiln/session.h"

#include <fmt/format.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <fstream>
#include <string>

namespace kiln {
namespace {

// A field of /proc/self/status in bytes ("VmHWM:  123 kB"), or -1.
double proc_status_bytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return 1024.0 * std::stod(line.substr(field.size() + 1));
  }
  return -1;
}

}  // namespace

std::unique_ptr<Session> open_session(const Config& config, const SessionOptions& options) {
  TrainingComposition composition;
  composition.step.compile = options.compile;
  composition.step.production_world_size = options.production_world_size;
  composition.metrics_file = options.metrics_file;
  composition.rung = options.rung;
  return compose_training(resolve_job(config, JobRequest{.argv = options.argv}), options.comm,
                          composition);
}

#ifdef KILN_WITH_CUDA
void reset_cuda_peak_memory(const torch::Device& device);  // session_cuda.cpp
PeakMemory read_cuda_peak_memory(const torch::Device& device);
#endif

void reset_peak_memory(const torch::Device& device) {
#ifdef KILN_WITH_CUDA
  if (device.is_cuda()) return reset_cuda_peak_memory(device);
#endif
  if (device.is_cpu()) {
#if defined(__GLIBC__)
    // Free heap the allocator kept (run.keep_freed_memory) goes back first, so the region's peak
    // starts from what is live rather than from an earlier region's high-water mark.
    ::malloc_trim(0);
#endif
    // Writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS (Linux >= 4.0).
    std::ofstream out("/proc/self/clear_refs");
    out << "5";
  }
}

PeakMemory read_peak_memory(const torch::Device& device) {
#ifdef KILN_WITH_CUDA
  if (device.is_cuda()) return read_cuda_peak_memory(device);
#endif
  PeakMemory peak;
  if (device.is_cpu()) {
    peak.method =
        "CPU: process peak resident set size (VmHWM) over the region, reset through "
        "/proc/self/clear_refs; includes allocator caches, code and libraries";
    peak.allocated_bytes = proc_status_bytes("VmHWM");
    peak.resident_after_bytes = proc_status_bytes("VmRSS");
  } else {
    peak.method = "not measured on " + device.str() + " (this build has no CUDA allocator access)";
  }
  return peak;
}

}  // namespace kiln
