// The training core: optimizer, learning-rate schedule and the Trainer's step loop.
//
// One optimizer step = grad_accum_steps micro-batches of (data -> forward -> backward), then
// gradient clipping on the global norm, the non-finite guard, and the optimizer update.
// Rungs plug in through TrainerHook (profiler scopes, gradient all-reduce, checkpoints); the
// Trainer does not know which command drives it.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kiln/data.h"
#include "kiln/models.h"

namespace kiln {

class Communicator;
class Config;
class Run;

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

/// AdamW (decoupled weight decay) or SGD (L2 weight decay, as torch.optim.SGD), with the same
/// math as PyTorch's. Weight decay applies to parameters with >= 2 dimensions only.
/// fused = true uses ATen's _fused_adamw_ / _fused_sgd_ kernels. Not thread-safe.
class Optimizer {
 public:
  Optimizer(const Config& config, NamedTensors parameters);
  /// Updates every parameter that has a gradient, at learning rate `lr`.
  void step(double lr);
  /// Drops all gradients (sets them undefined, like zero_grad(set_to_none=True)).
  void zero_grad();
  /// Steps taken so far.
  int64_t steps_taken() const { return steps_taken_; }
  /// Every state tensor by name ("<param>.exp_avg", "<param>.exp_avg_sq", "<param>.momentum");
  /// the tensors alias the live state (for checkpointing). Created lazily on the first step.
  NamedTensors state();
  /// Restores state written by state() and the step count. Throws UserError on a mismatch.
  void load_state(const NamedTensors& state, int64_t steps_taken);
  const NamedTensors& parameters() const { return parameters_; }

 private:
  void ensure_state();
  std::string name_;
  double weight_decay_, beta1_, beta2_, eps_, momentum_;
  bool nesterov_, fused_;
  NamedTensors parameters_;
  std::vector<bool> decays_;  // per parameter: weight decay applies
  std::vector<torch::Tensor> exp_avg_, exp_avg_sq_, momentum_buffer_, step_tensor_;
  int64_t steps_taken_ = 0;
};

/// Learning rate at optimizer step `step` (0-based): linear warmup from 0 over optim.warmup_steps,
/// then constant, or cosine decay to optim.lr * optim.min_lr_ratio at train.steps.
double learning_rate(const Config& config, int64_t step);

enum class Phase { kDataWait, kForward, kBackward, kComm, kOptimizer, kCheckpoint, kEval };
/// "data_wait", "forward", "backward", "comm", "optimizer", "checkpoint", "eval".
const char* phase_name(Phase phase);

struct StepStats {
  int64_t step = 0;  // 1-based number of the optimizer step just completed
  double loss = 0;   // mean training loss over the step's micro-batches
  double lr = 0;
  double grad_norm = 0;          // global gradient norm before clipping
  double step_seconds = 0;       // wall time of the whole step
  double data_wait_seconds = 0;  // time blocked waiting for batches
  int64_t samples = 0;           // samples in the step, all processes
  int64_t tokens = 0;            // tokens in the step, all processes (0 for classification)
  bool skipped = false;          // a non-finite step skipped under train.nonfinite = "skip"
};

struct EvalStats {
  double loss = 0;
  double accuracy = -1;  // classification only; -1 otherwise
  int64_t samples = 0;
};

class Trainer;

/// A rung's plug into the step loop. Every method runs on the training thread, in the order
/// listed; the defaults do nothing. Hooks run in the order they were added.
class TrainerHook {
 public:
  virtual ~TrainerHook() = default;
  virtual void on_train_begin(Trainer&) {}
  virtual void on_step_begin(Trainer&, int64_t /*step*/) {}
  virtual void on_micro_step_begin(Trainer&, int /*micro_step*/, bool /*last*/) {}
  virtual void on_phase_begin(Trainer&, Phase) {}
  virtual void on_phase_end(Trainer&, Phase) {}
  /// After the last backward of a step, before clipping (e.g. wait for gradient all-reduce).
  virtual void on_gradients_ready(Trainer&) {}
  virtual void on_step_end(Trainer&, const StepStats&) {}
  virtual void on_train_end(Trainer&) {}
};

struct TrainerOptions {
  torch::Device device = torch::kCPU;
  int rank = 0;
  int world_size = 1;
  /// The process group when world_size > 1: the logged step loss and evaluate() are averaged
  /// over every rank through it (gradients are averaged by the DataParallel hook, kiln/dist.h).
  /// Null: this process only.
  std::shared_ptr<Communicator> comm = nullptr;
};

struct TrainSummary {
  int64_t steps = 0;
  double first_loss = 0;
  double last_loss = 0;
  EvalStats final_eval;
  double seconds = 0;
  double samples_per_second = 0;
  double tokens_per_second = 0;
  int64_t skipped_steps = 0;
};

class Trainer {
 public:
  /// Moves the model to the device and builds the loader and optimizer from the config.
  Trainer(const Config& config, std::shared_ptr<Model> model, Datasets data,
          TrainerOptions options = {});
  ~Trainer();

  void add_hook(std::shared_ptr<TrainerHook> hook);

  /// One optimizer step. Throws TrainingError on a non-finite loss or gradient (policy abort,
  /// or too many skipped steps), naming the step.
  StepStats train_step();
  /// One optimizer step on the given micro-batches (one per accumulation step, on any device)
  /// instead of the loader's. Used to replay exact batches (peer comparison, tests).
  StepStats train_step_on(const std::vector<Batch>& micro_batches);
  /// Mean loss (and accuracy) over the first train.eval_batches batches of the validation set.
  EvalStats evaluate();
  /// Steps until step() == total_steps; evaluates every train.eval_every steps and at the end;
  /// shows progress; appends metrics to `run` when given.
  TrainSummary fit(int64_t total_steps, Run* run);

  int64_t step() const { return step_; }
  const Config& config() const { return *config_; }
  Model& model() { return *model_; }
  std::shared_ptr<Model> model_ptr() { return model_; }
  Optimizer& optimizer() { return *optimizer_; }
  Loader& loader() { return *loader_; }
  const Datasets& data() const { return data_; }
  const TrainerOptions& options() const { return options_; }
  /// Sets the completed-step counter (checkpoint resume).
  void set_step(int64_t step) { step_ = step; }
  int64_t skipped_steps() const { return skipped_steps_; }
  /// Sets the skipped-step counter (checkpoint resume).
  void set_skipped_steps(int64_t skipped) { skipped_steps_ = skipped; }

  /// Marks a phase for every hook (profiler scopes, timers). Components call these around their
  /// own work, e.g. a checkpointer around its staging (Phase::kCheckpoint), DDP around waiting
  /// for all-reduce (Phase::kComm). Begin/end pairs must nest.
  void phase_begin(Phase phase);
  void phase_end(Phase phase);

 private:
  StepStats run_step(int micro_steps, const std::function<Batch(int)>& next_batch);

  std::unique_ptr<Config> config_;
  std::shared_ptr<Model> model_;
  Datasets data_;
  TrainerOptions options_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<Loader> loader_;
  std::unique_ptr<Sampler> val_sampler_;
  std::vector<std::shared_ptr<TrainerHook>> hooks_;
  int64_t step_ = 0;
  int64_t skipped_steps_ = 0;
};

/// Applies run.threads, run.deterministic and the global seed to this process.
void apply_runtime_settings(const Config& config);
/// The device run.device resolves to. Throws UserError for "cuda" without a GPU.
torch::Device resolve_device(const Config& config);

}  // namespace kiln
