// The [plan] and [pilot] sections of the config schema (docs/plan.md).
#include "core/schema_sections.h"

namespace kiln {

ConfigSection plan_section() {
  return {
      "plan",
      {
          string_key("plan", "hardware", "", {},
                     "catalog rows to plan on, comma-separated (empty = every row)"),
          string_key("plan", "catalog", "", {},
                     "a TOML file of extra hardware rows (configs/hardware.toml's format; a row "
                     "of the same name replaces the built-in one)"),
          int_key("plan", "gpus", 8, 1, 1e6, "GPUs the plan runs on (the world size)"),
          float_key("plan", "tokens", 0.0, 0.0, kUnbounded,
                    "training tokens (0 = train.steps x tokens per optimizer step)"),
          float_key("plan", "mfu", 0.4, 1e-4, 1.0,
                    "model FLOPs utilisation assumed where no pilot measured it on that device"),
          float_key("plan", "headroom", 0.1, 0.0, 0.9,
                    "share of device memory kept free (allocator, workspaces, buffers)"),
          bool_key("plan", "activation_checkpointing", false,
                   "plan with full activation checkpointing (one more forward, block inputs "
                   "only); train.activation_checkpointing = \"block\" implies it"),
          float_key("plan", "gpu_mtbf_hours", 50676.0, 0.0, kUnbounded,
                    "mean time between failures of one GPU with its share of the host (default: "
                    "Llama 3, 419 interruptions in 54 days on 16,384 GPUs; 0 = unknown)"),
          float_key("plan", "restart_minutes", 10.0, 0.0, kUnbounded,
                    "per failure: requeue and reschedule (the pilot's measured process start, "
                    "restore and first step is added; without a pilot, the checkpoint's load)"),
          float_key("plan", "checkpoint_write_gb_per_second", 2.0, 1e-6, kUnbounded,
                    "the job's checkpoint write and read speed where no pilot measured it"),
          int_key("plan", "restore_drills", 1, 0, 1e6, "restore drills budgeted in the run"),
          string_key("plan", "pilot", "", {},
                     "a pilot's run directory that calibrates kiln plan (--pilot overrides) "
                     "and the forecast kiln train logs at its start (empty = none)"),
          float_key("plan", "storage_tb", 0.0, 0.0, kUnbounded,
                    "storage for checkpoints and data, TB (10^12 bytes); the plan warns when a "
                    "7-day reservation's kept checkpoints and the data exceed it (0 = not "
                    "checked)"),
          float_key("plan", "pilot_hours", 1.0, 0.0, kUnbounded,
                    "time budgeted for the pilot on the rented GPUs (without --pilot)"),
          float_key("plan", "margin", 0.1, 0.0, 10.0,
                    "share added to the whole process for what the model does not know"),
          table_key("plan", "price_7d_per_gpu_hour", 0.0, kUnbounded, {},
                    "price per GPU-hour of a 7-day reservation, per hardware row "
                    "(e.g. { h100-sxm = 2.99 }); never built in"),
          table_key("plan", "price_30d_per_gpu_hour", 0.0, kUnbounded, {},
                    "price per GPU-hour of a 30-day reservation, per hardware row"),
      },
      {}};
}

ConfigSection pilot_section() {
  return {"pilot",
          {
              int_key("pilot", "steps", 6, 2, 1e6,
                      "optimizer steps of the pilot: the first allocates the optimizer state, "
                      "the second's memory is measured, the median of the rest is the step time"),
              float_key("pilot", "max_estimate_error", 0.25, 0.0, 10.0,
                        "the memory estimate's allowed error against the measured peak (the "
                        "pilot fails beyond it, naming the part that differs most)"),
          },
          {}};
}

}  // namespace kiln
