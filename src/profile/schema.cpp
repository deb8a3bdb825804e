// The [profile] section of the config schema: the capture schedule (torch.profiler.schedule
// semantics), what Kineto records, where traces go, and the verdict thresholds
// (docs/profile.md explains each one).
#include "core/schema_sections.h"

namespace kiln {

ConfigSection profile_section() {
  return {
      "profile",
      {
          string_key("profile", "dir", "", {},
                     "trace directory (default: <run dir>/traces); one file per active window"),
          int_key("profile", "skip_first", 5, 0, 1e9,
                  "steps ignored before the first wait (allocator and cache warm-up)"),
          int_key("profile", "wait", 0, 0, 1e9, "steps of each cycle with the profiler off"),
          int_key("profile", "warmup", 2, 0, 1e9,
                  "steps of each cycle with Kineto prepared but not recording (results discarded)"),
          int_key("profile", "active", 5, 1, 1e9,
                  "recorded steps of each cycle; each cycle writes one trace file"),
          int_key("profile", "repeat", 1, 0, 1e6,
                  "cycles (0 = until training ends; the profile rung then runs one cycle)"),
          bool_key("profile", "record_shapes", true,
                   "record operator input shapes (shown in the top-operators table)"),
          bool_key("profile", "profile_memory", true,
                   "record allocations and frees (peak memory by phase)"),
          bool_key("profile", "with_stack", false,
                   "record source stacks (LibTorch has them for TorchScript/Python frames only, so "
                   "none for kiln's C++ operators; kept for parity)"),
          bool_key("profile", "with_flops", true,
                   "estimate FLOPs of matrix multiplications and convolutions"),
          bool_key("profile", "gzip", true,
                   "write traces as .pt.trace.json.gz (TensorBoard and Perfetto read both)"),
          int_key("profile", "top_operators", 15, 1, 1000,
                  "operators listed in the top-operators table"),
          float_key("profile", "data_bound_share", 0.15, 0.0, 1.0,
                    "verdict: data-bound when data_wait takes at least this share of the step"),
          float_key(
              "profile", "comm_bound_share", 0.20, 0.0, 1.0,
              "verdict: communication-bound when exposed communication takes at least this share "
              "of the step"),
          float_key(
              "profile", "memory_bound_fraction", 0.90, 0.0, 1.0,
              "verdict: memory-bound when peak allocated memory reaches this fraction of device "
              "memory"),
          float_key("profile", "host_bound_op_us", 20.0, 0.0, kUnbounded,
                    "verdict (CPU): host-bound when the training thread's operators take less than "
                    "this many microseconds per call (median over steps of the mean)"),
          float_key(
              "profile", "gpu_idle_share", 0.30, 0.0, 1.0,
              "verdict (CUDA): host/launch-bound when the GPU is idle for at least this share of "
              "the step, mostly waiting on the host"),
      },
      {}};
}

}  // namespace kiln
