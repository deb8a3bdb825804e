// The scale rung's parts shared by its two files (private to src/rungs): scale.cpp measures (the
// single-process baseline, the data-parallel steps) and launches the ranks; scale_report.cpp
// turns the measurements into scale.json, the gate, the verdict and the table.
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kiln/dist.h"
#include "kiln/results.h"
#include "kiln/rungs.h"
#include "kiln/session.h"

namespace kiln::scale_rung {

using nlohmann::json;

struct Baseline {
  bool measured = false;
  int64_t steps = 0;
  double samples_per_second = 0;
  double median_step_seconds = 0;
  std::string note;
};

// What this rank's data-parallel steps measured.
struct StepMeasurement {
  std::vector<double> losses;        // warm-up and measured steps
  std::vector<double> step_seconds;  // measured steps
  int64_t samples = 0;               // this rank's samples in the measured steps
  std::string failure;               // the TrainingError that ended the steps early, if any
  double cpu_seconds = 0;            // process CPU time over the measured steps
  CommunicationStats before, after;  // the process group's counters around the measured steps
  std::map<Phase, double> phase_seconds;
  ScaleRankMemory memory;  // this rank's memory parts (memory_parts)

  double phase(Phase p) const {
    auto it = phase_seconds.find(p);
    return it == phase_seconds.end() ? 0.0 : it->second;
  }
};

// Everything the report is made of, gathered from every rank.
struct ScaleOutcome {
  int world = 1;
  int64_t warmup = 0, measured = 0, seq_len = 0;
  Baseline baseline;
  StepMeasurement steps;
  std::vector<ScaleRank> per_rank;  // every rank's numbers, in rank order
  std::vector<std::string> hashes;  // every rank's weights hash
  int tp = 1;  // dist.tp: rank r holds tensor-parallel slice r % tp (kiln/dist.h DeviceMesh)

  /// Every data-parallel replica of each tensor-parallel slice holds the same weights.
  bool in_sync() const {
    for (size_t r = 0; r < hashes.size(); ++r) {
      if (hashes[r] != hashes[r % static_cast<size_t>(std::max(1, tp))]) return false;
    }
    return true;
  }
  bool have_baseline() const { return baseline.measured && baseline.samples_per_second > 0; }
};

/// This rank's numbers (scale.json's per_rank entry).
ScaleRank rank_numbers(const Communicator& comm, const StepMeasurement& m, int64_t seq_len);

/// The rung's outcome from every rank's measurements: its typed result (scale.json, kiln/results.h,
/// with the gate, the verdict and the table), the same on every rank.
RungResult scale_result(const Session& session, const ScaleOutcome& o);

/// The outcome as the ranks' scale.json holds it (launched under torchrun).
RungResult result_from_file(const ScaleResult& numbers);

}  // namespace kiln::scale_rung
