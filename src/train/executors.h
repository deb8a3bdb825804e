// The Trainer's default step executor and step runner (kiln/train.h StepExecutor, StepRunner):
// eager autograd under train.precision, and the device work run as it is. Not public API.
#pragma once

#include <functional>
#include <memory>

#include "kiln/train.h"

namespace kiln {

class MixedPrecision;

/// One training micro-step as every autograd executor runs it: `forward_loss()` (the forward
/// and the loss, 0-dim) under train.precision's autocast (`precision` on `device_type`) in phase
/// forward, divided by the micro-step count round(1 / scale) (exact for 1 / scale an integer, as
/// the step's loss is averaged); then, in phase backward, backward of that loss x `loss_scale`
/// (fp16-mixed's scale, float32 [1]; undefined: the loss itself). Returns the divided loss. The
/// eager executor's `forward_loss` is model.loss(model.forward(inputs), targets); per-unit
/// compilation's is the model's split forward with its root compiled (src/compile). Throws what
/// `forward_loss`, autograd or a phase hook throws.
torch::Tensor autograd_micro_step(Trainer& trainer, TrainOptions::Precision precision,
                                  c10::DeviceType device_type, double scale,
                                  const torch::Tensor& loss_scale,
                                  const std::function<torch::Tensor()>& forward_loss);

/// autograd_micro_step of model.loss(model.forward(inputs), targets) under `precision` (its
/// autocast and loss scale); evaluation the same forward and loss without a backward.
/// Holds references: `model` and `precision` must outlive it (the Trainer owns all three).
std::shared_ptr<StepExecutor> make_eager_executor(Model& model, const MixedPrecision& precision);

/// Runs the device work directly, each micro-batch fetched when its micro-step asks for it.
std::shared_ptr<StepRunner> make_direct_runner();

}  // namespace kiln
