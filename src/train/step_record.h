// One metrics.jsonl record per optimizer step, the same for `kiln train`, the baseline rung and
// every other writer of step records (docs/training.md lists the fields). Not public API.
#pragma once

#include <nlohmann/json.hpp>

#include "kiln/train.h"

namespace kiln {

inline nlohmann::json step_record(const StepStats& s) {
  nlohmann::json record = {{"step", s.step},
                           {"loss", s.loss},
                           {"lr", s.lr},
                           {"grad_norm", s.grad_norm},
                           {"step_seconds", s.step_seconds},
                           {"data_wait_seconds", s.data_wait_seconds},
                           {"samples_per_second", static_cast<double>(s.samples) / s.step_seconds}};
  if (s.tokens > 0) record["tokens_per_second"] = static_cast<double>(s.tokens) / s.step_seconds;
  if (s.skipped) record["skipped"] = true;
  return record;
}

}  // namespace kiln
