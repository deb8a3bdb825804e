// Host memory (async checkpoint staging, the loader's buffers) and a reservation's storage
// against the catalog row and plan.storage_tb (docs/plan.md, "Host memory and storage").
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <system_error>

#include "core/strings.h"
#include "kiln/config.h"
#include "kiln/plan.h"
#include "plan/options.h"

namespace kiln {
namespace {

// Bytes of a file, or of every regular file under a directory; 0 when it does not exist.
double host_storage_path_bytes(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (path.empty() || !fs::exists(path, ec)) return 0;
  if (fs::is_regular_file(path, ec)) return static_cast<double>(fs::file_size(path, ec));
  double total = 0;
  for (fs::recursive_directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code size_ec;
    if (it->is_regular_file(size_ec)) total += static_cast<double>(it->file_size(size_ec));
  }
  return total;
}

constexpr double kSevenDaysSeconds = 7 * 86400.0;

}  // namespace

HostNeeds host_needs(const Config& config, const Device& device, int64_t gpus,
                     const StrategyDecision& decision, double checkpoint_bytes,
                     double checkpoint_interval_seconds) {
  const PlanInputs inputs = PlanInputs::from_config(config);
  HostNeeds h;
  const int64_t ranks_per_node = std::max<int64_t>(1, std::min(gpus, device.gpus_per_node));
  if (inputs.checkpoint_async) {
    if (decision.strategy == "fsdp" && decision.fsdp_degree > 1) {
      // One replica's shards save; a node holds min(degree, ranks on the node) of them.
      const double d = static_cast<double>(decision.fsdp_degree);
      h.staging_bytes_per_node =
          checkpoint_bytes * static_cast<double>(std::min(decision.fsdp_degree, ranks_per_node)) /
          d;
    } else {
      h.staging_bytes_per_node = checkpoint_bytes;  // rank 0 saves the whole state
    }
  }
  const ModelShape shape = model_shape(config);
  const JobShape job = job_shape(config);
  const double batch_bytes =
      !shape.tokens  // features (fp32) and a label per sample; else inputs and targets (int64)
          ? static_cast<double>(job.micro_batch) * static_cast<double>(shape.input_dim + 1) * 4.0
          : static_cast<double>(job.micro_batch * job.seq_len) * 2.0 * 8.0;
  h.loader_bytes_per_node =
      static_cast<double>(ranks_per_node) * static_cast<double>(inputs.data_prefetch) * batch_bytes;
  h.host_bytes_per_node = h.staging_bytes_per_node + h.loader_bytes_per_node;
  h.host_memory_bytes = device.host_memory_bytes;
  const double usable = h.host_memory_bytes * (1.0 - inputs.plan_headroom);
  if (h.host_memory_bytes > 0 && h.host_bytes_per_node > usable) {
    h.host_fits = false;
    h.warnings.push_back(fmt::format(
        "{}: host memory per node needs {} (async checkpoint staging {} + loader buffers {}) > "
        "{} usable of the node's {}; set checkpoint.async = false, shard the state (FSDP) or "
        "lower data.prefetch",
        device.name, format_bytes(h.host_bytes_per_node), format_bytes(h.staging_bytes_per_node),
        format_bytes(h.loader_bytes_per_node), format_bytes(usable),
        format_bytes(h.host_memory_bytes)));
  }

  const double keep = static_cast<double>(inputs.checkpoint_keep_last_k);
  const double saves_in_7d = checkpoint_interval_seconds > 0
                                 ? std::ceil(kSevenDaysSeconds / checkpoint_interval_seconds)
                                 : keep;
  const double data_bytes =
      host_storage_path_bytes(inputs.data_path) + host_storage_path_bytes(inputs.data_val_path);
  h.storage_bytes = std::min(keep, std::max(1.0, saves_in_7d)) * checkpoint_bytes + data_bytes;
  h.storage_limit_bytes = inputs.plan_storage_tb * 1e12;
  if (h.storage_limit_bytes > 0 && h.storage_bytes > h.storage_limit_bytes) {
    h.storage_fits = false;
    h.warnings.push_back(fmt::format(
        "{}: a 7-day reservation's checkpoints ({:.0f} kept x {}) and data ({}) need {} > "
        "plan.storage_tb = {:g} TB; lower checkpoint.keep_last_k or raise plan.storage_tb",
        device.name, std::min(keep, std::max(1.0, saves_in_7d)), format_bytes(checkpoint_bytes),
        format_bytes(data_bytes), format_bytes(h.storage_bytes), inputs.plan_storage_tb));
  }
  return h;
}

nlohmann::json to_json(const HostNeeds& h) {
  return {{"staging_bytes_per_node", h.staging_bytes_per_node},
          {"loader_bytes_per_node", h.loader_bytes_per_node},
          {"host_bytes_per_node", h.host_bytes_per_node},
          {"host_memory_bytes",
           h.host_memory_bytes > 0 ? nlohmann::json(h.host_memory_bytes) : nlohmann::json(nullptr)},
          {"host_fits", h.host_fits},
          {"storage_bytes", h.storage_bytes},
          {"storage_limit_bytes", h.storage_limit_bytes > 0 ? nlohmann::json(h.storage_limit_bytes)
                                                            : nlohmann::json(nullptr)},
          {"storage_fits", h.storage_fits},
          {"warnings", h.warnings}};
}

}  // namespace kiln
