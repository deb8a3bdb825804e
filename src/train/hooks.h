// Hooks the Trainer adds for fit() (not public API).
#pragma once

#include <memory>

#include "kiln/train.h"

namespace kiln {

/// The progress display: a bar with rate and ETA on a terminal (rank 0), a log line every
/// run.log_every steps otherwise, on steps whose loss was read back; evaluations as log lines.
std::shared_ptr<TrainerHook> make_progress_hook(const TrainOptions& options, int64_t total_steps,
                                                int rank, int64_t first_step);

}  // namespace kiln
