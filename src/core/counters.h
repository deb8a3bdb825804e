// Process-wide event counters for tests (not public API): how often a run did something costly
// or stateful that it should do once (build a model, resolve the checkpoint directory, take a
// directory lock, read a resume index). Incrementing is one relaxed atomic add; nothing reads them
// but tests (tests/rungs/job_test.cpp counts one `kiln train --resume auto`).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>

namespace kiln::counters {

enum class Event {
  kModelBuild,               // make_model
  kCheckpointDirResolution,  // checkpoint_options (checkpoint.dir -> a path)
  kDirectoryLock,            // lock_directories
  kResumeIndexRead,          // locate_resume reading a candidate's index.json
  kCount
};

inline std::array<std::atomic<int64_t>, static_cast<size_t>(Event::kCount)>& table() {
  static std::array<std::atomic<int64_t>, static_cast<size_t>(Event::kCount)> counts{};
  return counts;
}
inline void count(Event event) {
  table()[static_cast<size_t>(event)].fetch_add(1, std::memory_order_relaxed);
}
inline int64_t read(Event event) {
  return table()[static_cast<size_t>(event)].load(std::memory_order_relaxed);
}
inline void reset() {
  for (auto& c : table()) c.store(0, std::memory_order_relaxed);
}

}  // namespace kiln::counters
