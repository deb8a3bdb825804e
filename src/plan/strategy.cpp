// The DDP / FSDP strategy rule (docs/plan.md, "Strategy").
#include <fmt/format.h>

#include <stdexcept>

#include "kiln/plan.h"

namespace kiln {
namespace {

std::string gb(double bytes) {
  return fmt::format("{:.1f} GB", bytes / 1e9);
}

}  // namespace

StrategyDecision choose_strategy(const StrategyInput& in) {
  if (in.gpu_count < 1) throw std::invalid_argument("choose_strategy: gpu_count < 1");
  if (!(in.headroom_fraction >= 0 && in.headroom_fraction < 1)) {
    throw std::invalid_argument("choose_strategy: headroom_fraction outside [0, 1)");
  }
  StrategyDecision out;
  out.usable_bytes = in.device_memory_bytes * (1.0 - in.headroom_fraction);
  out.ddp_bytes_per_device = in.ddp_model_state_bytes + in.activation_bytes;
  auto fsdp_bytes = [&](int64_t degree) {
    return in.ddp_model_state_bytes / static_cast<double>(degree) +
           in.largest_unit_parameter_bytes + in.activation_bytes;
  };
  const std::string usable = gb(out.usable_bytes) + " usable";
  if (out.ddp_bytes_per_device <= out.usable_bytes) {
    out.strategy = "ddp";
    out.fsdp_bytes_per_device =
        in.gpu_count > 1 ? fsdp_bytes(in.gpu_count) : out.ddp_bytes_per_device;
    out.reason = fmt::format("ddp fits: {}/device (state {} + activations {}) <= {}",
                             gb(out.ddp_bytes_per_device), gb(in.ddp_model_state_bytes),
                             gb(in.activation_bytes), usable);
    return out;
  }
  const std::string ddp_line = fmt::format(
      "ddp needs {}/device (state {} + activations {}) > {}", gb(out.ddp_bytes_per_device),
      gb(in.ddp_model_state_bytes), gb(in.activation_bytes), usable);
  for (int64_t degree = 2; degree <= in.gpu_count; ++degree) {
    if (in.gpu_count % degree != 0) continue;
    if (fsdp_bytes(degree) <= out.usable_bytes) {
      out.strategy = "fsdp";
      out.fsdp_degree = degree;
      out.fsdp_bytes_per_device = fsdp_bytes(degree);
      out.reason = fmt::format(
          "{}; fsdp over {} fits: {}/device (state/{} {} + largest unit {} + activations {})",
          ddp_line, degree, gb(out.fsdp_bytes_per_device), degree,
          gb(in.ddp_model_state_bytes / static_cast<double>(degree)),
          gb(in.largest_unit_parameter_bytes), gb(in.activation_bytes));
      return out;
    }
  }
  out.strategy = "does-not-fit";
  out.fsdp_bytes_per_device =
      in.gpu_count > 1 ? fsdp_bytes(in.gpu_count) : out.ddp_bytes_per_device;
  out.reason = in.gpu_count > 1
                   ? fmt::format(
                         "does not fit: {}; fsdp over all {} needs {}/device (state/{} {} + "
                         "largest unit {} + activations {}); use activation checkpointing, a "
                         "smaller micro-batch or more GPUs",
                         ddp_line, in.gpu_count, gb(out.fsdp_bytes_per_device), in.gpu_count,
                         gb(in.ddp_model_state_bytes / static_cast<double>(in.gpu_count)),
                         gb(in.largest_unit_parameter_bytes), gb(in.activation_bytes))
                   : fmt::format(
                         "does not fit: {} on 1 GPU; use activation checkpointing, a smaller "
                         "micro-batch or more GPUs (fsdp)",
                         ddp_line);
  return out;
}

nlohmann::json to_json(const StrategyDecision& d) {
  return {{"strategy", d.strategy},
          {"fsdp_degree", d.fsdp_degree},
          {"usable_bytes", d.usable_bytes},
          {"ddp_bytes_per_device", d.ddp_bytes_per_device},
          {"fsdp_bytes_per_device", d.fsdp_bytes_per_device},
          {"reason", d.reason}};
}

}  // namespace kiln
