// dist.strategy = "auto": the plan component's strategy rule (kiln/plan.h choose_strategy) on the
// model this process built. Never a second rule: only the inputs are gathered here.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <map>

#include "kiln/config.h"
#include "kiln/dist.h"
#include "kiln/error.h"
#include "kiln/plan.h"
#include "kiln/run.h"

namespace kiln {

#ifdef KILN_WITH_CUDA
double cuda_device_total_memory(const torch::Device& device);  // strategy_cuda.cpp
#endif

namespace {

double device_total_memory([[maybe_unused]] const torch::Device& device) {
#ifdef KILN_WITH_CUDA
  if (device.is_cuda()) return cuda_device_total_memory(device);
#endif
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<double>(pages) * static_cast<double>(page) : 0.0;
}

std::string gib(double bytes) {
  return fmt::format("{:.2f} GiB", bytes / (1024.0 * 1024.0 * 1024.0));
}

}  // namespace

StrategyChoice resolve_strategy(const Config& config, const Model& model,
                                const torch::Device& device, int world_size) {
  StrategyChoice out;
  const ProcessGroupOptions dist = ProcessGroupOptions::from_config(config);
  using Strategy = ProcessGroupOptions::Strategy;
  if (dist.strategy != Strategy::kAuto) {
    const bool fsdp = dist.strategy == Strategy::kFsdp;
    out.strategy = fsdp ? Parallelism::kFsdp : Parallelism::kDdp;
    out.mesh = fsdp ? fsdp_mesh_shape(dist.dp_replicate, world_size) : MeshShape{world_size, 1};
    out.reason = fmt::format("dist.strategy = \"{}\"", to_string(dist.strategy));
    if (out.mesh.dp_replicate > 1 && fsdp) {
      out.reason += fmt::format(", dist.dp_replicate = {}: hybrid sharding {}",
                                out.mesh.dp_replicate, out.mesh.text());
    }
    return out;
  }
  JobShape job = job_shape(config);
  job.world_size = world_size;
  // Model state from the model itself; the largest group as FSDP gathers it.
  double parameters = 0;
  std::map<std::string, int> unit_of;
  const std::vector<ModelUnit> units = model.units();
  for (size_t u = 0; u < units.size(); ++u) {
    for (const auto& name : units[u].parameters) unit_of[name] = static_cast<int>(u);
  }
  std::vector<double> group_bytes(units.size() + 1, 0.0);  // the units, then the root
  for (const auto& item : model.named_parameters()) {
    if (!item.value().requires_grad()) continue;
    parameters += static_cast<double>(item.value().numel());
    auto it = unit_of.find(item.key());
    group_bytes[it == unit_of.end() ? units.size() : static_cast<size_t>(it->second)] +=
        static_cast<double>(item.value().nbytes());
  }
  const MemoryEstimate estimate = estimate_memory(model_shape(config), job);
  double activation_ratio = 1.0;
  std::string activation_source = "plan's estimate";
  try {
    const PilotCalibration pilot = read_pilot(run_directory(config), config);
    if (pilot.activation_ratio > 0) {
      activation_ratio = pilot.activation_ratio;
      activation_source =
          fmt::format("plan's estimate x {:.2f} measured by the pilot", pilot.activation_ratio);
    }
  } catch (const UserError&) {
    // No pilot of this job in the run directory: the analytic estimate alone.
  }
  StrategyInput input;
  input.ddp_model_state_bytes = parameters * state_bytes_per_parameter(job);
  input.largest_unit_parameter_bytes = *std::max_element(group_bytes.begin(), group_bytes.end());
  input.activation_bytes = (estimate.activations + estimate.logits) * activation_ratio;
  input.weight_copy_bytes = estimate.autocast_copies;  // mixed precision's whole-model copies
  input.activation_checkpointing = job.activation_checkpointing;
  const double configured = dist.device_memory_bytes;
  input.device_memory_bytes = configured > 0 ? configured : device_total_memory(device);
  input.headroom_fraction = dist.memory_headroom;
  input.gpu_count = world_size;
  const StrategyDecision decision = choose_strategy(input);
  const std::string memory_source =
      configured > 0 ? "dist.device_memory_bytes"
                     : (device.is_cuda() ? "the device's total" : "physical memory");
  out.decision = to_json(decision);
  out.decision["activation_source"] = activation_source;
  out.decision["device_memory_source"] = memory_source;
  out.strategy = decision.strategy == "ddp" ? Parallelism::kDdp : Parallelism::kFsdp;
  // FSDP at the plan's degree, replicated over the rest of the world (hybrid sharding); when
  // even every rank does not fit, over every rank.
  const int degree = decision.fsdp_degree > 0 ? static_cast<int>(decision.fsdp_degree) : world_size;
  out.mesh = out.strategy == Parallelism::kDdp
                 ? MeshShape{world_size, 1}
                 : fsdp_mesh_shape(dist.dp_replicate, world_size, world_size / std::max(1, degree));
  std::string layout(to_string(out.strategy));
  if (decision.strategy == "does-not-fit") {
    layout += " over all ranks, though even that does not fit";
  } else if (out.strategy == Parallelism::kFsdp && out.mesh.dp_replicate > 1) {
    layout = fmt::format("hybrid sharding {}", out.mesh.text());
  }
  out.reason = fmt::format(
      "dist.strategy = \"auto\": {}: {} (device memory {} from {}, activations from {})", layout,
      decision.reason, gib(input.device_memory_bytes), memory_source, activation_source);
  return out;
}

}  // namespace kiln
