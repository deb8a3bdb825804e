// [checkpoint] read into typed options: the only place the checkpointer's keys are read
// (kiln/checkpoint.h checkpoint_options, training_checkpoint_options).
#include <string>

#include "ckpt/resume.h"
#include "core/counters.h"
#include "kiln/checkpoint.h"

namespace kiln {

std::filesystem::path checkpoint_directory(const Config& config,
                                           const std::filesystem::path& run_dir) {
  counters::count(counters::Event::kCheckpointDirResolution);
  const std::string& dir = config.get_string("checkpoint.dir");
  return dir.empty() ? run_dir / "checkpoints" : std::filesystem::path(dir);
}

namespace {

CheckpointOptions store_options(const Config& config, std::filesystem::path dir) {
  CheckpointOptions options;
  options.dir = std::move(dir);
  options.keep_last_k = config.get_int("checkpoint.keep_last_k");
  options.keep_every = config.get_int("checkpoint.keep_every");
  options.async = config.get_bool("checkpoint.async");
  options.background_staging = options.async;  // CheckpointHook fences before the optimizer step
  return options;
}

}  // namespace

CheckpointOptions checkpoint_options(const Config& config, const std::filesystem::path& run_dir) {
  return store_options(config, checkpoint_directory(config, run_dir));
}

TrainingCheckpointOptions training_checkpoint_options(const Config& config,
                                                      const std::filesystem::path& run_dir,
                                                      const std::filesystem::path& checkpoint_dir) {
  TrainingCheckpointOptions options;
  options.store = store_options(config, checkpoint_dir);
  options.every_steps = config.get_int("checkpoint.every_steps");
  options.save_final = config.get_bool("checkpoint.save_final");
  options.stop_on_error = config.get_string("checkpoint.on_save_error") == "stop";
  options.preempt_timeout_seconds =
      static_cast<int>(config.get_int("checkpoint.preempt_timeout_seconds"));
  options.record = {config.hash(), ckpt::checkpoint_settings(config), run_dir / "manifest.json"};
  return options;
}

}  // namespace kiln
