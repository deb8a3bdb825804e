// The pilot's memory measurement beside the analytic estimate, part by part (docs/plan.md, "The
// pilot"). Not public API: kiln/pilot.h declares measure_step_memory.
#pragma once

#include <string>
#include <vector>

#include "kiln/pilot.h"
#include "kiln/plan.h"
#include "kiln/results.h"

namespace kiln {

// Measured against estimated memory, by the parts both sides can see: the held state
// (parameters, optimizer state, the gradient buffers a layout keeps), the gradients after the
// step, and the step's own peak above the held state (activations, logits, gradients, buffers).
struct MemoryComparison {
  double ratio = 0;          // measured / estimated peak
  double working_ratio = 0;  // measured / estimated step peak above the held state
  std::vector<PilotMemoryPart> parts;
  std::string worst;       // the part whose |measured - estimated| is largest, in words
  std::string table_text;  // one line for the pilot's table
};

MemoryComparison compare_memory(const StepMemory& measured, const MemoryEstimate& estimate,
                                const JobShape& job);

}  // namespace kiln
