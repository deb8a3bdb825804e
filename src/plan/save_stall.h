// What one checkpoint save stalls training (kiln train's CheckpointHook), for the forecast and
// the plan's delta: with checkpoint.async what the pilot measured on this device: the blocking
// part (capture, save call, what is left of the staging copy at the next optimizer step) and the
// wait that finished the save after an evaluation (the rest of the write and the commit that the
// evaluation did not cover, and the save's bookkeeping: a run pays it at a poll after a step, or
// for its last save at the end); the write runs beside training. Else, or with no such
// measurement, the whole save. Not public API.
#pragma once

#include <string>

#include "kiln/plan.h"

namespace kiln {

struct SaveStall {
  double seconds = 0;
  bool measured = false;  // the pilot's blocking part
  std::string source;     // in words, for plan.json and `kiln plan --actual`
};

/// `pilot_here`: `pilot` is non-null and ran on the device this row or forecast is for.
inline SaveStall save_stall(bool async_saves, const PilotCalibration* pilot, bool pilot_here,
                            double full_save_seconds) {
  SaveStall s;
  s.measured = async_saves && pilot_here && pilot->save_blocking_seconds > 0;
  s.seconds =
      s.measured ? pilot->save_blocking_seconds + pilot->save_end_wait_seconds : full_save_seconds;
  s.source = s.measured && pilot->save_end_wait_seconds > 0
                 ? "the blocking part of an async save and the wait that finished it after an "
                   "evaluation, measured by the pilot"
             : s.measured  ? "the blocking part of an async save, measured by the pilot"
             : async_saves ? "the whole save (checkpoint.async, but no blocking part measured on "
                             "this device)"
                           : "the whole save (checkpoint.async = false)";
  return s;
}

}  // namespace kiln
