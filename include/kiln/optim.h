// The optimizer (AdamW, SGD: PyTorch's math, fused or reference kernels) and the learning-rate
// schedule, with the [optim] section they read. The Trainer (kiln/train.h) owns one.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kiln {

class Config;

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

/// The [optim] section (docs/config.md), parsed once; the step loop reads no string keys.
struct OptimOptions {
  enum class Kind { kAdamW, kSGD };
  Kind kind = Kind::kAdamW;
  double lr = 1e-3;
  double weight_decay = 0;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // AdamW
  double momentum = 0;                            // SGD
  bool nesterov = false;                          // SGD
  bool fused = true;
  bool cosine = false;  // optim.schedule: cosine decay after warmup, else constant
  int64_t warmup_steps = 0;
  double min_lr_ratio = 0.1;
  static OptimOptions from_config(const Config& config);
};

// ---- optimizer and schedule --------------------------------------------------------------------

/// AdamW (decoupled weight decay) or SGD (L2 weight decay, as torch.optim.SGD), with the same
/// math as PyTorch's: each parameter has its own step count, advanced only on steps where it has
/// a gradient (a parameter without one is skipped, as torch.optim does). Weight decay applies to
/// parameters with >= 2 dimensions only. fused = true uses ATen's _fused_adamw_ / _fused_sgd_
/// kernels; false, the single-tensor reference path of torch.optim. Not thread-safe.
class Optimizer {
 public:
  Optimizer(const OptimOptions& options, NamedTensors parameters);
  Optimizer(const Config& config, NamedTensors parameters);
  /// Updates every parameter that has a gradient, at learning rate `lr`. `found_nonfinite`, when
  /// defined, is a 0-dim float tensor on the parameters' device: where it is nonzero, nothing
  /// changes (no parameter, moment or step count). The fused kernels read it on the device (no
  /// host synchronisation); the reference path reads it on the host.
  void step(double lr, const torch::Tensor& found_nonfinite = {});
  /// Takes the learning rate from `lr` (a 0-dim tensor on the parameters' device: float32 on CUDA,
  /// float64 on the CPU, whose fused kernels read it as a double) from
  /// now on: step()'s `lr` argument is ignored and the caller fills the tensor before each step
  /// (outside a captured CUDA graph, so the graph reads the current rate). Needs optim.fused
  /// (the fused kernels' tensor_lr overloads); throws UserError otherwise. Undefined: back to
  /// step()'s argument.
  void use_lr_tensor(torch::Tensor lr);
  const torch::Tensor& lr_tensor() const { return lr_tensor_; }
  /// Drops all gradients (sets them undefined, like zero_grad(set_to_none=True)).
  void zero_grad();
  /// step() calls so far (skipped ones included).
  int64_t steps_taken() const { return steps_taken_; }
  /// Every moment tensor by name ("<param>.exp_avg", "<param>.exp_avg_sq", "<param>.momentum");
  /// the tensors alias the live state (for checkpointing). Created lazily on the first call.
  NamedTensors state();
  /// Each parameter's step count, "<param>.step": 0-dim float32 tensors on the parameters'
  /// device, aliasing the live counts (torch.optim's state["step"]).
  NamedTensors step_counts();
  /// Restores state written by state(); every parameter's step count and steps_taken() become
  /// `steps_taken`. Throws UserError on a mismatch (another optim.name, another model).
  void load_state(const NamedTensors& state, int64_t steps_taken);
  /// Sets steps_taken() alone (restoring a TrainState whose step counts are restored as tensors).
  void set_steps_taken(int64_t steps_taken) { steps_taken_ = steps_taken; }
  const NamedTensors& parameters() const { return parameters_; }
  const OptimOptions& options() const { return options_; }

 private:
  void ensure_state();
  void step_adamw(const std::vector<size_t>& members, double lr, double weight_decay,
                  const torch::Tensor& found_nonfinite);
  void step_sgd(const std::vector<size_t>& members, double lr, double weight_decay,
                const torch::Tensor& found_nonfinite);
  OptimOptions options_;
  NamedTensors parameters_;
  std::vector<bool> decays_;  // per parameter: weight decay applies
  std::vector<torch::Tensor> exp_avg_, exp_avg_sq_, momentum_buffer_, step_tensor_;
  torch::Tensor lr_tensor_;  // defined: the learning rate, read on the device
  int64_t steps_taken_ = 0;
};

/// Learning rate at optimizer step `step` (0-based): linear warmup from 0 over warmup_steps,
/// then constant, or cosine decay to lr * min_lr_ratio at `total_steps`. Pure.
double learning_rate(const OptimOptions& options, int64_t total_steps, int64_t step);

}  // namespace kiln
