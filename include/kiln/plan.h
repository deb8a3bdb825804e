// Plan: the analytic model of a training job — parameter count, FLOPs, memory, the DDP/FSDP
// strategy rule, the hardware catalog, and the time and budget of the whole process — computed
// from the config alone, never by allocating the model (so a 6.7B or 70B config plans in seconds
// on a laptop). Every formula and its source is in docs/plan.md.
//
// Pure functions of their inputs; thread-safe. Bytes are doubles (a 70B model's state exceeds
// what a reader can check in int64 at a glance, and every figure here is an estimate).
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace kiln {

class Config;

// ---- strategy rule (shared with dist.strategy = "auto") ----------------------------------------

/// What choose_strategy() needs, all per device of one job.
struct StrategyInput {
  /// Model state under DDP (every device holds all of it): parameters x bytes per parameter for
  /// the optimizer and precision (fp32 AdamW: 4 parameter + 4 gradient + 8 moments = 16 B).
  double ddp_model_state_bytes = 0;
  /// Parameter bytes of the largest FSDP unit, gathered whole on every device while it runs (one
  /// transformer block, or the embeddings + final-norm group, whichever is larger).
  double largest_unit_parameter_bytes = 0;
  /// Activation bytes per device for one micro-batch (measured by a pilot, or estimated).
  double activation_bytes = 0;
  /// Memory of one device (bytes).
  double device_memory_bytes = 0;
  /// Fraction of device memory kept free (allocator fragmentation, workspaces, comm buffers);
  /// usable memory is device_memory_bytes x (1 - headroom_fraction). In [0, 1).
  double headroom_fraction = 0.1;
  /// Devices in the job (world size); FSDP degrees considered are the divisors of it.
  int64_t gpu_count = 1;
};

/// The decision and the numbers behind it.
struct StrategyDecision {
  /// "ddp" when model state + activations fit on every device; else "fsdp" at the smallest degree
  /// that fits; else "does-not-fit".
  std::string strategy;
  /// The smallest FSDP degree (a divisor of gpu_count, >= 2) at which a device fits; 0 when none.
  int64_t fsdp_degree = 0;
  /// usable = device_memory_bytes x (1 - headroom_fraction).
  double usable_bytes = 0;
  /// DDP per device: ddp_model_state_bytes + activation_bytes.
  double ddp_bytes_per_device = 0;
  /// FSDP per device at fsdp_degree (at gpu_count when no degree fits; equal to the DDP figure
  /// when gpu_count is 1): state / degree + largest_unit_parameter_bytes + activation_bytes.
  double fsdp_bytes_per_device = 0;
  /// One line with the numbers, e.g. "ddp needs 107.3 GB/device > 72.0 GB usable; fsdp over 8
  /// needs 14.2 GB/device". For "does-not-fit" it names the ways out: activation checkpointing,
  /// a smaller micro-batch, more GPUs.
  std::string reason;
};

/// The strategy rule: DDP when it fits, else FSDP at the smallest fitting degree, else
/// does-not-fit (docs/plan.md, "Strategy"). Never throws for non-negative input; a gpu_count < 1
/// or a headroom outside [0, 1) is a programming error (std::invalid_argument).
StrategyDecision choose_strategy(const StrategyInput& input);

/// JSON of a decision (plan.json, reports).
nlohmann::json to_json(const StrategyDecision& decision);

}  // namespace kiln
