// MemoryMeter: a c10 memory reporter in the thread's PROFILER_STATE slot, summing the allocator's
// reports per device.
//
// The reporter derives from torch's ProfilerStateBase (itself a c10::MemoryReportingInfoBase)
// with a disabled profiler config rather than from MemoryReportingInfoBase alone: torch reads the
// PROFILER_STATE slot as a ProfilerStateBase in several places (profilerEnabled(), Kineto's
// enable check), so whatever sits there must be one.
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/profiler/orchestration/observer.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <utility>

#include "kiln/memory.h"

namespace kiln {

namespace profiler_impl = torch::profiler::impl;

class MemoryMeter::Reporter final : public profiler_impl::ProfilerStateBase {
 public:
  explicit Reporter(Reporter* outer)
      : ProfilerStateBase(profiler_impl::ProfilerConfig(profiler_impl::ProfilerState::Disabled)),
        outer_(outer) {}

  void reportMemoryUsage(void* ptr, int64_t alloc_size, size_t total_allocated,
                         size_t total_reserved, c10::Device device) override {
    {
      std::lock_guard lock(mutex_);
      int64_t counted = alloc_size;
      if (device.is_cpu()) {
        // c10's CPU reporter keeps one global pointer -> size table, updated only while some
        // thread profiles memory: a block freed while nobody profiled leaves its entry behind,
        // and a later block at the same address, allocated unprofiled, is then "freed" in our
        // scope with the stale size. So on the CPU a free counts only for a block this scope saw
        // allocated, with the size it was allocated with (the header's contract: frees of
        // blocks from before the scope are not subtracted).
        if (alloc_size > 0) {
          cpu_blocks_[ptr] = alloc_size;
        } else {
          auto it = cpu_blocks_.find(ptr);
          if (it == cpu_blocks_.end()) {
            counted = 0;
          } else {
            counted = -it->second;
            cpu_blocks_.erase(it);
          }
        }
      }
      MemoryPeak& peak = devices_[{static_cast<int>(device.type()), device.index()}];
      peak.device = device;
      peak.end_bytes += counted;
      peak.peak_bytes = std::max(peak.peak_bytes, peak.end_bytes);
      peak.allocator_peak_bytes =
          std::max(peak.allocator_peak_bytes, static_cast<int64_t>(total_allocated));
      if (alloc_size > 0) ++peak.allocations;
    }
    if (outer_) outer_->reportMemoryUsage(ptr, alloc_size, total_allocated, total_reserved, device);
  }
  bool memoryProfilingEnabled() const override { return true; }
  profiler_impl::ActiveProfilerType profilerType() override {
    return profiler_impl::ActiveProfilerType::NONE;
  }

  std::vector<MemoryPeak> peaks() const {
    std::lock_guard lock(mutex_);
    std::vector<MemoryPeak> out;
    for (const auto& [key, peak] : devices_) out.push_back(peak);
    return out;
  }

 private:
  Reporter* outer_;  // an enclosing meter on the same thread (outlives this one: LIFO)
  mutable std::mutex mutex_;
  std::unordered_map<void*, int64_t> cpu_blocks_;      // CPU blocks allocated in this scope, live
  std::map<std::pair<int, int>, MemoryPeak> devices_;  // by (device type, index); CPU is type 0
};

MemoryMeter::MemoryMeter() {
  auto* current = profiler_impl::ProfilerStateBase::get(/*global=*/false);
  Reporter* outer = nullptr;
  if (current != nullptr) {
    if (current->profilerType() != profiler_impl::ActiveProfilerType::NONE) {
      throw std::logic_error(
          "MemoryMeter: a profiler (Kineto) is active on this thread; measure outside the "
          "profiled window, or read the profile's memory events instead");
    }
    outer = dynamic_cast<Reporter*>(current);
    if (outer == nullptr) {
      throw std::logic_error("MemoryMeter: another memory reporter is installed on this thread");
    }
  }
  reporter_ = std::make_shared<Reporter>(outer);
  guard_ = std::make_shared<c10::DebugInfoGuard>(c10::DebugInfoKind::PROFILER_STATE, reporter_);
}

MemoryMeter::~MemoryMeter() {
  stop();
}

void MemoryMeter::stop() {
  guard_.reset();  // restores the slot as it was before the constructor
}

std::vector<MemoryPeak> MemoryMeter::peaks() const {
  return reporter_->peaks();
}

MemoryPeak MemoryMeter::find(const torch::Device& device) const {
  for (const MemoryPeak& peak : peaks()) {
    if (peak.device.type() != device.type()) continue;
    // An unindexed device asks for the one this thread used (c10 reports CPU without an index).
    if (device.has_index() && peak.device.has_index() && peak.device.index() != device.index())
      continue;
    return peak;
  }
  return MemoryPeak{device};
}

int64_t MemoryMeter::peak_bytes(const torch::Device& device) const {
  return find(device).peak_bytes;
}

int64_t MemoryMeter::allocator_peak_bytes(const torch::Device& device) const {
  return find(device).allocator_peak_bytes;
}

}  // namespace kiln
