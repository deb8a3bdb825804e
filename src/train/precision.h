// train.precision inside the step loop: the autocast scope and the fp16 loss scaler (activation
// checkpointing is train/activation_checkpointing.h). The Trainer calls a
// MixedPrecision at fixed points of a step (see trainer.cpp's device_step):
//
//   forward + loss    inside autocast_scope()
//   backward          on loss x loss_scale() (src/train/executors.h: autograd_micro_step)
//   optimizer phase   unscale_gradients(grads) before the norm and clipping, whose overflow flag
//                     joins the non-finite guard; update(found_overflow, loss) after the update
//   read-back         sync_values() joins the Trainer's one device-to-host copy
#pragma once

#include <ATen/autocast_mode.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "kiln/models.h"
#include "kiln/train.h"

namespace kiln {

/// The autocast state of one device type, as torch.autocast sets and restores it.
struct AutocastState {
  c10::DeviceType device_type = c10::DeviceType::CPU;
  bool enabled = false;
  at::ScalarType dtype = at::kBFloat16;
  bool cache_enabled = true;
  /// The state the calling thread has now.
  static AutocastState current(c10::DeviceType device_type);
};

/// Sets an autocast state for a scope and restores the previous one at exit, clearing the cast
/// cache when the outermost autocast scope ends (torch.autocast's __enter__ / __exit__).
class AutocastGuard {
 public:
  explicit AutocastGuard(const AutocastState& state);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  AutocastState previous_;
};

/// train.precision's autocast for the forward and the loss on `device_type` (as
/// torch.autocast(device_type, compute_dtype(precision))) while the result lives; null under fp32.
std::unique_ptr<AutocastGuard> precision_autocast(TrainOptions::Precision precision,
                                                  c10::DeviceType device_type);

/// The precision policy of one Trainer. Not thread-safe: the training thread calls it.
class MixedPrecision {
 public:
  MixedPrecision(TrainOptions::Precision precision, const torch::Device& device);

  TrainOptions::Precision precision() const { return precision_; }
  const torch::Device& device() const { return device_; }
  bool scales_loss() const { return precision_ == TrainOptions::Precision::kFp16Mixed; }

  /// precision_autocast on the trainer's device type.
  std::unique_ptr<AutocastGuard> autocast_scope() const;
  /// fp16-mixed: the current scale (float32 [1] on the device, updated in place); undefined
  /// otherwise. A compiled step differentiates loss x this inside its graph.
  const torch::Tensor& loss_scale() const { return scale_; }
  /// fp16-mixed: divides every gradient by the scale in place (ATen's
  /// _amp_foreach_non_finite_check_and_unscale_) and returns the overflow flag, a 0-dim float
  /// tensor on the device (1: some gradient is inf or NaN). Undefined tensor otherwise.
  torch::Tensor unscale_gradients(const std::vector<torch::Tensor>& gradients);
  /// fp16-mixed, after the optimizer (skipped or not): grows or backs off the scale
  /// (_amp_update_scale_, on the device) and counts a skipped step whose loss was finite as the
  /// scaler's overflow step. No-op otherwise.
  void update(const torch::Tensor& found_overflow, const torch::Tensor& loss);
  /// [overflow steps since the last call to reset_since_sync(), current scale] as a float64 [2]
  /// tensor on the device (zeros without a scaler), for the Trainer's read-back.
  torch::Tensor sync_values() const;
  void reset_since_sync();
  /// Overflow steps the scaler skipped, counted at read-backs (host).
  int64_t overflow_steps() const { return overflow_steps_; }
  void add_overflow_steps(int64_t steps) { overflow_steps_ += steps; }

  /// TrainState::grad_scaler (reads the device state back): null without a scaler.
  nlohmann::json state() const;
  /// Restores state(). null (a checkpoint from fp32 or bf16) keeps a fresh scaler; a scaler state
  /// under fp32/bf16 is ignored. Throws UserError on a malformed state.
  void load_state(const nlohmann::json& state);

 private:
  TrainOptions::Precision precision_;
  torch::Device device_;
  // fp16-mixed: torch.amp.GradScaler's defaults.
  double init_scale_ = 65536.0, growth_factor_ = 2.0, backoff_factor_ = 0.5;
  int64_t growth_interval_ = 2000;
  torch::Tensor scale_;                // float32 [1] on the device
  torch::Tensor growth_tracker_;       // int32 [1]: unskipped steps since the last change
  torch::Tensor overflow_since_sync_;  // float64 0-dim
  int64_t overflow_steps_ = 0;
};

}  // namespace kiln
