// [profile] read into typed options (kiln/profile.h profiler_options, VerdictThresholds), and
// the job settings a verdict names (verdict_context).
#include "kiln/config.h"
#include "kiln/data.h"
#include "kiln/profile.h"
#include "kiln/train.h"

namespace kiln {

ProfilerOptions profiler_options(const Config& config, const std::filesystem::path& run_dir,
                                 const torch::Device& device, int rank, int world_size) {
  ProfilerOptions options;
  const std::string& dir = config.get_string("profile.dir");
  options.dir = dir.empty() ? run_dir / "traces" : std::filesystem::path(dir);
  options.schedule.skip_first = config.get_int("profile.skip_first");
  options.schedule.wait = config.get_int("profile.wait");
  options.schedule.warmup = config.get_int("profile.warmup");
  options.schedule.active = config.get_int("profile.active");
  options.schedule.repeat = config.get_int("profile.repeat");
  options.record_shapes = config.get_bool("profile.record_shapes");
  options.profile_memory = config.get_bool("profile.profile_memory");
  options.with_stack = config.get_bool("profile.with_stack");
  options.with_flops = config.get_bool("profile.with_flops");
  options.gzip = config.get_bool("profile.gzip");
  options.top_operators = static_cast<int>(config.get_int("profile.top_operators"));
  options.cuda = device.is_cuda();
  options.rank = rank;
  options.world_size = world_size;
  return options;
}

VerdictThresholds VerdictThresholds::from_config(const Config& config) {
  VerdictThresholds t;
  t.data_bound_share = config.get_float("profile.data_bound_share");
  t.comm_bound_share = config.get_float("profile.comm_bound_share");
  t.memory_bound_fraction = config.get_float("profile.memory_bound_fraction");
  t.host_bound_op_us = config.get_float("profile.host_bound_op_us");
  t.gpu_idle_share = config.get_float("profile.gpu_idle_share");
  return t;
}

VerdictContext verdict_context(const TrainOptions& train, const LoaderOptions& loader) {
  VerdictContext context;
  context.num_workers = loader.num_workers;
  context.prefetch = loader.prefetch;
  context.batch_size = train.batch_size;
  context.grad_accum_steps = train.grad_accum_steps;
  return context;
}

}  // namespace kiln
