// MemoryMeter: the peak of live tensor bytes over a scope, per device, from c10's own allocator
// reports (no Kineto, no trace). For a step's peak memory (pilot), per-rank memory parts (FSDP)
// and activation checkpointing's saving.
//
// How: the meter installs a reporter in c10's thread-local PROFILER_STATE debug-info slot (a
// c10::DebugInfoGuard, as torch.profiler's memory profile does). While it is installed the CPU
// allocator and the CUDA caching allocator report every allocation and free made by that thread
// to it, and so do the threads that inherit the thread's state: autograd's device threads during
// backward, and kiln's loader workers when they are (re)started inside the scope. The meter sums
// those reports per device; the running sum's maximum is the peak.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace kiln {

/// One device's numbers from a MemoryMeter.
struct MemoryPeak {
  torch::Device device = torch::kCPU;
  /// Maximum, over the scope, of (bytes allocated in the scope) - (of those, bytes freed in it):
  /// the peak of live bytes above what was live at start, as long as no tensor allocated before
  /// the scope is freed before the peak. On the CPU such a free is not subtracted (c10's size of
  /// an older block can be stale, so only blocks the scope saw allocated count); on CUDA it is.
  int64_t peak_bytes = 0;
  /// The same sum when the meter stopped (bytes allocated in the scope and still live).
  int64_t end_bytes = 0;
  /// The largest total the allocator itself reported with an event: on CUDA, every byte live on
  /// the device (all threads, allocated before the scope too): the absolute peak. On the CPU, c10
  /// counts only blocks allocated while a meter or a memory profile was installed on some
  /// thread, so this is not the process's total; use peak_bytes there.
  int64_t allocator_peak_bytes = 0;
  int64_t allocations = 0;  // allocation reports received in the scope
};

/// Measures live tensor bytes from construction until stop() (or destruction), on the thread that
/// constructs it and the threads that inherit its thread-local state (see above).
///
/// Contract:
/// - Construct, stop and destroy it on one thread; meters on one thread nest (LIFO): an inner
///   meter forwards every report to the outer one, so both see the inner scope's allocations.
/// - It does not nest with a Kineto profile (kiln's Profiler, torch.profiler) on the same thread,
///   either way: both live in c10's one PROFILER_STATE slot. Started while a profile is active on
///   the thread, the constructor throws std::logic_error (the meter would hide the profile's
///   state from Kineto's operator callbacks); a profile started inside a meter's scope is refused
///   by Kineto itself ("Profiler is already enabled on this thread", a c10::Error; kiln's
///   Profiler turns it into a TrainingError). Measure outside the profiled steps.
/// - Reports arrive from several threads (autograd's device threads); the counters are guarded by
///   a mutex, so the getters may be called from any thread, also while the meter runs.
/// - Only allocations through c10's allocators are seen (tensors and their storage); a
///   third-party library's own malloc is not.
class MemoryMeter {
 public:
  /// Starts measuring. Throws std::logic_error inside an active Kineto profile on this thread.
  MemoryMeter();
  /// Stops if still running.
  ~MemoryMeter();
  MemoryMeter(const MemoryMeter&) = delete;
  MemoryMeter& operator=(const MemoryMeter&) = delete;

  /// Stops measuring; the numbers stay readable. Idempotent; on the constructing thread only.
  void stop();
  bool running() const { return guard_ != nullptr; }

  /// MemoryPeak::peak_bytes for `device` (0 when the device saw no allocation).
  int64_t peak_bytes(const torch::Device& device = torch::kCPU) const;
  /// MemoryPeak::allocator_peak_bytes for `device` (the absolute peak on CUDA).
  int64_t allocator_peak_bytes(const torch::Device& device = torch::kCPU) const;
  /// Every device that reported, CPU first, then by type and index.
  std::vector<MemoryPeak> peaks() const;

  class Reporter;  // the c10 reporter (src/profile/memory_meter.cpp)

 private:
  MemoryPeak find(const torch::Device& device) const;
  std::shared_ptr<Reporter> reporter_;
  std::shared_ptr<void> guard_;  // the c10::DebugInfoGuard while running
};

}  // namespace kiln
