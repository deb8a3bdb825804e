// Timing and summary statistics shared inside the library (not public API).
#pragma once

#include <chrono>
#include <vector>

namespace kiln {

using SteadyClock = std::chrono::steady_clock;

/// Seconds elapsed since `begin` on the steady clock.
inline double seconds_since(SteadyClock::time_point begin) {
  return std::chrono::duration<double>(SteadyClock::now() - begin).count();
}

/// The q-quantile (0 <= q <= 1) by linear interpolation between order statistics; 0 when empty.
double percentile(std::vector<double> values, double q);

}  // namespace kiln
