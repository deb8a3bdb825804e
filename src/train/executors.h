// The Trainer's default step executor and step runner (kiln/train.h StepExecutor, StepRunner):
// eager autograd under train.precision, and the device work run as it is. Not public API.
#pragma once

#include <memory>

#include "kiln/train.h"

namespace kiln {

class MixedPrecision;

/// Forward and loss inside precision.autocast_scope() (phase forward), backward of
/// precision.scale_loss(loss) (phase backward); evaluation the same forward without a backward.
/// Holds references: `model` and `precision` must outlive it (the Trainer owns all three).
std::shared_ptr<StepExecutor> make_eager_executor(Model& model, const MixedPrecision& precision);

/// Runs the device work directly, each micro-batch fetched when its micro-step asks for it.
std::shared_ptr<StepRunner> make_direct_runner();

}  // namespace kiln
