// [dist] read into the layouts' typed options (kiln/dist.h data_parallel_options, fsdp_options).
#include <algorithm>

#include "kiln/config.h"
#include "kiln/dist.h"
#include "kiln/train.h"

namespace kiln {

DataParallelOptions data_parallel_options(const Config& config) {
  constexpr double kMiB = 1024.0 * 1024.0;
  DataParallelOptions options;
  options.bucket_bytes =
      std::max<int64_t>(1, static_cast<int64_t>(config.get_float("dist.bucket_mb") * kMiB));
  options.first_bucket_bytes =
      std::max<int64_t>(1, static_cast<int64_t>(config.get_float("dist.first_bucket_mb") * kMiB));
  return options;
}

FsdpOptions fsdp_options(const Config& config) {
  FsdpOptions options;
  options.reshard_after_forward = config.get_bool("dist.reshard_after_forward");
  options.accumulate_sharded = config.get_string("dist.fsdp_accumulate") == "sharded";
  options.prefetch = config.get_bool("dist.fsdp_prefetch");
  const TrainOptions::Precision precision = TrainOptions::from_config(config).precision;
  if (precision != TrainOptions::Precision::kFp32) options.param_dtype = compute_dtype(precision);
  return options;
}

ProcessGroupOptions ProcessGroupOptions::from_config(const Config& config) {
  using Launcher = ProcessGroupOptions::Launcher;
  using Backend = ProcessGroupOptions::Backend;
  using Strategy = ProcessGroupOptions::Strategy;
  ProcessGroupOptions o;
  o.launcher = config.get_enum<Launcher>("dist.launcher", {{"auto", Launcher::kAuto},
                                                           {"torchrun", Launcher::kTorchrun},
                                                           {"slurm", Launcher::kSlurm},
                                                           {"none", Launcher::kNone}});
  o.backend = config.get_enum<Backend>(
      "dist.backend",
      {{"auto", Backend::kAuto}, {"gloo", Backend::kGloo}, {"nccl", Backend::kNccl}});
  o.master_addr = config.get_string("dist.master_addr");
  o.master_port = static_cast<int>(config.get_int("dist.master_port"));
  o.timeout_seconds = config.get_float("dist.timeout_seconds");
  o.torchrun = config.get_string("dist.torchrun");
  o.device = RuntimeOptions::from_config(config).device;
  o.config_hash = config.hash();
  o.strategy = config.get_enum<Strategy>(
      "dist.strategy",
      {{"auto", Strategy::kAuto}, {"ddp", Strategy::kDdp}, {"fsdp", Strategy::kFsdp}});
  o.dp_replicate = config.get_int("dist.dp_replicate");
  o.tp = config.get_int("dist.tp");
  o.tp_across_nodes = config.get_bool("dist.tp_across_nodes");
  o.device_memory_bytes = config.get_float("dist.device_memory_bytes");
  o.memory_headroom = config.get_float("dist.memory_headroom");
  return o;
}

std::string_view to_string(Parallelism parallelism) {
  switch (parallelism) {
    case Parallelism::kDdp:
      return "ddp";
    case Parallelism::kFsdp:
      return "fsdp";
    case Parallelism::kNone:
      break;
  }
  return "none";
}

std::string_view to_string(ProcessGroupOptions::Backend backend) {
  switch (backend) {
    case ProcessGroupOptions::Backend::kGloo:
      return "gloo";
    case ProcessGroupOptions::Backend::kNccl:
      return "nccl";
    case ProcessGroupOptions::Backend::kAuto:
      break;
  }
  return "auto";
}

std::string_view to_string(ProcessGroupOptions::Strategy strategy) {
  switch (strategy) {
    case ProcessGroupOptions::Strategy::kDdp:
      return "ddp";
    case ProcessGroupOptions::Strategy::kFsdp:
      return "fsdp";
    case ProcessGroupOptions::Strategy::kAuto:
      break;
  }
  return "auto";
}

}  // namespace kiln
