// The [checkpoint] section of the config schema (docs/checkpoint.md).
#include "core/schema_sections.h"

namespace kiln {

ConfigSection checkpoint_section() {
  return {
      "checkpoint",
      {
          string_key("checkpoint", "dir", "", {},
                     "checkpoint directory (default: <run dir>/checkpoints)"),
          int_key(
              "checkpoint", "every_steps", 0, 0, 1e12,
              "save the full training state every this many steps (0 = no periodic checkpoints)"),
          bool_key("checkpoint", "save_final", true,
                   "with every_steps > 0: also save at the last step"),
          int_key("checkpoint", "keep_last_k", 3, 2, 1e9,
                  "committed checkpoints kept (>= 2; older ones are pruned after each commit)"),
          int_key("checkpoint", "keep_every", 0, 0, 1e12,
                  "keep checkpoints at multiples of this step for good (0 = none)"),
          bool_key("checkpoint", "async", true,
                   "stage the state to CPU and write in the background while training continues"),
          string_key("checkpoint", "on_save_error", "stop", {"stop", "continue"},
                     "a failed save (e.g. disk full): stop training, or log it and continue"),
          int_key("checkpoint", "preempt_timeout_seconds", 120, 0, 1e6,
                  "kiln train on SIGTERM/SIGUSR1 (preemption): finish the step, commit a "
                  "checkpoint and exit 75; past this many seconds it stops at once (0 = no limit)"),
          bool_key("checkpoint", "drill", true,
                   "the ladder runs the checkpoint rung (a save / kill / restore / compare drill)"),
          int_key("checkpoint", "drill_steps", 10, 1, 1e6,
                  "checkpoint rung: steps before the save, and again after the restore"),
      },
      {}};
}

}  // namespace kiln
