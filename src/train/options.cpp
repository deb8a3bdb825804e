// The [optim] and [train] sections parsed once into OptimOptions and TrainOptions, and the
// learning-rate schedule.
#include <cmath>
#include <numbers>

#include "kiln/config.h"
#include "kiln/train.h"

namespace kiln {

OptimOptions OptimOptions::from_config(const Config& config) {
  OptimOptions o;
  o.kind = config.get_enum<Kind>("optim.name", {{"adamw", Kind::kAdamW}, {"sgd", Kind::kSGD}});
  o.lr = config.get_float("optim.lr");
  o.weight_decay = config.get_float("optim.weight_decay");
  o.beta1 = config.get_float("optim.beta1");
  o.beta2 = config.get_float("optim.beta2");
  o.eps = config.get_float("optim.eps");
  o.momentum = config.get_float("optim.momentum");
  o.nesterov = config.get_bool("optim.nesterov");
  o.fused = config.get_bool("optim.fused");
  o.cosine = config.get_string("optim.schedule") == "cosine";
  o.warmup_steps = config.get_int("optim.warmup_steps");
  o.min_lr_ratio = config.get_float("optim.min_lr_ratio");
  return o;
}

TrainOptions TrainOptions::from_config(const Config& config) {
  TrainOptions o;
  o.steps = config.get_int("train.steps");
  o.stop_after_step = config.get_int("train.stop_after_step");
  o.batch_size = config.get_int("train.batch_size");
  o.grad_accum_steps = static_cast<int>(config.get_int("train.grad_accum_steps"));
  o.clip_grad_norm = config.get_float("train.clip_grad_norm");
  o.eval_every = config.get_int("train.eval_every");
  o.eval_batches = config.get_int("train.eval_batches");
  o.nonfinite = config.get_enum<NonFinite>(
      "train.nonfinite", {{"abort", NonFinite::kAbort}, {"skip", NonFinite::kSkip}});
  o.max_skipped_steps = config.get_int("train.max_skipped_steps");
  o.metrics_every = config.get_int("train.metrics_every");
  o.log_every = config.get_int("run.log_every");
  o.progress = config.get_enum<Progress>("run.progress", {{"auto", Progress::kAuto},
                                                          {"bar", Progress::kBar},
                                                          {"log", Progress::kLog},
                                                          {"off", Progress::kOff}});
  o.precision =
      config.get_enum<Precision>("train.precision", {{"fp32", Precision::kFp32},
                                                     {"bf16-mixed", Precision::kBf16Mixed},
                                                     {"fp16-mixed", Precision::kFp16Mixed}});
  o.activation_checkpointing = config.get_enum<ActivationCheckpointing>(
      "train.activation_checkpointing",
      {{"none", ActivationCheckpointing::kNone}, {"block", ActivationCheckpointing::kBlock}});
  return o;
}

double learning_rate(const OptimOptions& o, int64_t total_steps, int64_t step) {
  const double peak = o.lr;
  if (step < o.warmup_steps) {
    return peak * static_cast<double>(step + 1) / static_cast<double>(o.warmup_steps);
  }
  if (!o.cosine) return peak;
  const double span = static_cast<double>(std::max<int64_t>(1, total_steps - o.warmup_steps));
  const double progress = std::min(1.0, static_cast<double>(step - o.warmup_steps) / span);
  const double floor = peak * o.min_lr_ratio;
  return floor + 0.5 * (1.0 + std::cos(std::numbers::pi * progress)) * (peak - floor);
}

TrainerSetup TrainerSetup::from_config(const Config& config) {
  TrainerSetup setup;
  setup.train = TrainOptions::from_config(config);
  setup.optim = OptimOptions::from_config(config);
  setup.loader.batch_size = setup.train.batch_size;
  setup.loader.num_workers = static_cast<int>(config.get_int("data.num_workers"));
  setup.loader.prefetch = static_cast<int>(config.get_int("data.prefetch"));
  setup.loader.shuffle = config.get_bool("data.shuffle");
  setup.loader.seed = data_seed(config);
  return setup;
}

RuntimeOptions RuntimeOptions::from_config(const Config& config) {
  RuntimeOptions o;
  o.threads = config.get_int("run.threads");
  o.deterministic = config.get_bool("run.deterministic");
  o.fill_uninitialized_memory = config.get_bool("run.fill_uninitialized_memory");
  o.keep_freed_memory = config.get_bool("run.keep_freed_memory");
  o.seed = static_cast<uint64_t>(config.get_int("run.seed"));
  o.device = config.get_string("run.device");
  return o;
}

void apply_runtime_settings(const Config& config) {
  apply_runtime_settings(RuntimeOptions::from_config(config));
}

torch::Device resolve_device(const Config& config) {
  return resolve_device(config.get_string("run.device"));
}

}  // namespace kiln
