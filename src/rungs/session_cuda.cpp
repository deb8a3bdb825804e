// Peak-memory probes on CUDA (built only against a CUDA LibTorch): the caching allocator's
// peak counters, as torch.cuda.reset_peak_memory_stats / max_memory_allocated /
// max_memory_reserved.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

#include "kiln/session.h"

namespace kiln {

void reset_cuda_peak_memory(const torch::Device& device) {
  c10::cuda::device_synchronize();
  c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
}

PeakMemory read_cuda_peak_memory(const torch::Device& device) {
  c10::cuda::device_synchronize();
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
  const auto aggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  PeakMemory peak;
  peak.method =
      "CUDA caching allocator: peak counters reset before the step, device synchronized, "
      "max allocated and max reserved read after it";
  peak.allocated_bytes = static_cast<double>(stats.allocated_bytes[aggregate].peak);
  peak.reserved_bytes = static_cast<double>(stats.reserved_bytes[aggregate].peak);
  return peak;
}

}  // namespace kiln
