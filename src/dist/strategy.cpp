// dist.strategy = "auto": the plan component's strategy rule (kiln/plan.h choose_strategy) on the
// model this process built. Never a second rule: only the inputs are gathered here.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <optional>

#include "kiln/config.h"
#include "kiln/dist.h"
#include "kiln/error.h"
#include "kiln/plan.h"
#include "kiln/run.h"

namespace kiln {

#ifdef KILN_WITH_CUDA
double cuda_device_total_memory(const torch::Device& device);  // strategy_cuda.cpp
std::string cuda_device_name(const torch::Device& device);
#endif

namespace {

double device_total_memory([[maybe_unused]] const torch::Device& device) {
#ifdef KILN_WITH_CUDA
  if (device.is_cuda()) return cuda_device_total_memory(device);
#endif
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<double>(pages) * static_cast<double>(page) : 0.0;
}

// The name the hardware catalog matches: the CUDA device's own ("NVIDIA H200"), else "cpu".
std::string device_name([[maybe_unused]] const torch::Device& device) {
#ifdef KILN_WITH_CUDA
  if (device.is_cuda()) return cuda_device_name(device);
#endif
  return "cpu";
}

std::string gib(double bytes) {
  return fmt::format("{:.2f} GiB", bytes / (1024.0 * 1024.0 * 1024.0));
}

}  // namespace

StrategyChoice resolve_strategy(const Config& config, const Model& model,
                                const torch::Device& device, const StrategyWorld& world) {
  StrategyChoice out;
  const ProcessGroupOptions dist = ProcessGroupOptions::from_config(config);
  using Strategy = ProcessGroupOptions::Strategy;
  const int world_size = world.world_size;
  // dist.tp as set (0: 1, unless "auto" below chooses it), and the data-parallel ranks it leaves.
  const bool choose_tp = dist.strategy == Strategy::kAuto && dist.tp == 0 &&
                         world.tensor_parallel_allowed && world_size > 1;
  const int64_t tp = std::max<int64_t>(1, dist.tp);
  ddp_mesh_shape(world_size, tp);  // throws UserError naming dist.tp when tp does not divide it
  if (dist.strategy != Strategy::kAuto) {
    const bool fsdp = dist.strategy == Strategy::kFsdp;
    out.strategy = fsdp ? Parallelism::kFsdp : Parallelism::kDdp;
    out.mesh = fsdp ? fsdp_mesh_shape(dist.dp_replicate, world_size, 1, tp)
                    : ddp_mesh_shape(world_size, tp);
    out.reason = fmt::format("dist.strategy = \"{}\"", to_string(dist.strategy));
    if (out.mesh.dp_replicate > 1 && fsdp) {
      out.reason += fmt::format(", dist.dp_replicate = {}: hybrid sharding {}",
                                out.mesh.dp_replicate, out.mesh.text());
    }
    return out;
  }
  // The rule's input as `kiln plan` builds it for this job at the data-parallel world, then what
  // this process knows better: the model's own sizes, the pilot's activations, the device's
  // memory, the node and the links.
  const ModelShape shape = model_shape(config);
  const double configured = dist.device_memory_bytes;
  const double memory = configured > 0 ? configured : device_total_memory(device);
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
  std::string activation_source = "plan's estimate";
  double activation_ratio = 0;
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
  std::string links_source = "link bandwidths unknown";
  const std::optional<Device> row = catalog_device(config, device_name(device));
  if (row) links_source = fmt::format("links of catalog row {}", row->name);
  // The rule at `at_world` ranks, `node` of them on one node; a tp slice's ranks count as one
  // data-parallel rank of it.
  double device_memory_bytes = 0;
  auto decide = [&](int at_world, int node) {
    JobShape job = job_shape(config);
    job.world_size = choose_tp ? at_world : at_world / static_cast<int>(tp);
    StrategyInput input = strategy_input(shape, job, memory, dist.memory_headroom);
    if (!choose_tp) {
      input.tensor_parallel_degrees.clear();
      input.tensor_parallel_unit_bytes.clear();
      input.tensor_parallel_fraction = 0;
    }
    input.ddp_model_state_bytes = parameters * state_bytes_per_parameter(job);
    input.largest_unit_parameter_bytes = *std::max_element(group_bytes.begin(), group_bytes.end());
    input.parameter_bytes = 4.0 * parameters;
    if (activation_ratio > 0) input.activation_bytes *= activation_ratio;
    if (row) set_links(input, *row);
    // The node is where this job's ranks are, whatever the row says.
    input.gpus_per_node = std::max<int64_t>(1, choose_tp ? node : node / tp);
    device_memory_bytes = input.device_memory_bytes;
    return choose_strategy(input);
  };
  const int local = world.local_world_size > 0 ? world.local_world_size : world_size;
  // The pilot of a larger job: the production layout's tp and dp_shard, fewer replicas.
  std::optional<StrategyDecision> scaled;
  std::string production_note;
  if (world.production_world_size > world_size) {
    const int production = world.production_world_size;
    const int node = row ? static_cast<int>(row->gpus_per_node) : local;
    const StrategyDecision at = decide(production, node);
    const int64_t t = choose_tp ? std::max<int64_t>(1, at.tp_degree) : tp;
    const int64_t shard = at.fsdp_degree > 0 ? at.fsdp_degree : production / t;
    const std::string layout =
        at.strategy == "ddp" ? std::string("ddp") : fmt::format("fsdp {} x tp {}", shard, t);
    if (at.strategy == "fsdp" && world_size % (t * shard) == 0) {
      scaled = at;
      production_note = fmt::format(
          "; the production layout at plan.gpus = {} ({}, dp_replicate {}) scaled down to this "
          "world of {}: dp_replicate {}",
          production, layout, production / (t * shard), world_size, world_size / (t * shard));
    } else if (at.strategy != "ddp") {
      production_note = fmt::format(
          "; the production layout at plan.gpus = {} ({}) needs {} ranks per replica, which do "
          "not divide this world of {}: chosen for this world instead (its memory per rank is "
          "not production's)",
          production, layout, t * shard, world_size);
    }
  }
  const StrategyDecision decision = scaled ? *scaled : decide(world_size, local);
  const std::string memory_source =
      configured > 0 ? "dist.device_memory_bytes"
                     : (device.is_cuda() ? "the device's total" : "physical memory");
  out.decision = to_json(decision);
  out.decision["activation_source"] = activation_source;
  out.decision["device_memory_source"] = memory_source;
  out.decision["links_source"] = links_source;
  if (world.production_world_size > world_size) {
    out.decision["production_world_size"] = world.production_world_size;
    out.decision["production_layout_scaled"] = scaled.has_value();
  }
  out.strategy = decision.strategy == "ddp" ? Parallelism::kDdp : Parallelism::kFsdp;
  // FSDP at the plan's degree (over the tp slices when it chose TP), replicated over the rest
  // of the world (hybrid sharding); when even every rank does not fit, over every rank.
  const int64_t t = choose_tp ? std::max<int64_t>(1, decision.tp_degree) : tp;
  const int data_ranks = world_size / static_cast<int>(t);
  const int degree = decision.fsdp_degree > 0 ? static_cast<int>(decision.fsdp_degree) : data_ranks;
  out.mesh =
      out.strategy == Parallelism::kDdp
          ? ddp_mesh_shape(world_size, t)
          : fsdp_mesh_shape(dist.dp_replicate, world_size, data_ranks / std::max(1, degree), t);
  std::string layout(to_string(out.strategy));
  if (decision.strategy == "does-not-fit") {
    layout += " over all ranks, though even that does not fit";
  } else if (out.strategy == Parallelism::kFsdp && (out.mesh.dp_replicate > 1 || t > 1)) {
    layout = fmt::format("{}{}", t > 1 ? fmt::format("tp {} with fsdp: ", t) : "hybrid sharding ",
                         out.mesh.text());
  }
  out.reason = fmt::format(
      "dist.strategy = \"auto\": {}: {} (device memory {} from {}, activations from {}, {})",
      layout, decision.reason, gib(device_memory_bytes), memory_source, activation_source,
      links_source);
  out.reason += production_note;
  return out;
}

}  // namespace kiln
