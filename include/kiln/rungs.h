// The ladder's rungs. Each rung runs on a config, writes <run dir>/<rung>.json, and returns a
// RungResult whose `passed` is its gate. `kiln ladder` runs the enabled rungs in order and stops
// at the first failed gate; `kiln <rung>` runs one.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "kiln/session.h"

namespace kiln {

struct RungResult {
  std::string rung;
  bool passed = false;
  std::string verdict;                                     // one line: why it passed or failed
  nlohmann::json numbers;                                  // what <rung>.json holds
  std::vector<std::pair<std::string, std::string>> table;  // rows to print and report
};

/// Prints a rung's table to stdout.
void print_rung(const RungResult& result);

/// Baseline: eager, one process. Warm-up steps, then measured steps: throughput, step-time
/// percentiles, data-wait share, peak memory of a full step, FLOPs/MFU, loss and val loss.
/// Gate: finite losses, loss falls by baseline.min_loss_drop, val loss beats its initial value.
RungResult run_baseline(Session& session);

struct Rung {
  std::string name;
  std::function<bool(const Config&)> enabled;
  std::function<RungResult(const Config&, const SessionOptions&)> run;
};

/// The rungs in ladder order.
const std::vector<Rung>& ladder_rungs();

/// Runs the enabled rungs in order, stops at the first failed gate, writes <run dir>/report.md.
/// Returns the results of the rungs that ran.
std::vector<RungResult> run_ladder(const Config& config, const SessionOptions& options);

}  // namespace kiln
