// train.activation_checkpointing = "block": the unit wrapper that recomputes each unit in
// backward (src/train/activation_checkpointing.cpp). Not the checkpointer (src/ckpt/), which
// saves the training state.
#pragma once

#include <memory>
#include <vector>

#include "kiln/models.h"

namespace kiln {

/// train.activation_checkpointing = "block": runs each unit's forward without keeping its
/// activations (only its input) and recomputes them in backward, with the autocast and RNG
/// state the forward had. Losses and gradients are bitwise those without it (CPU, deterministic
/// ops). `units` are Model::units() with their parameters resolved from the model.
std::shared_ptr<UnitWrapper> make_activation_checkpointing(Model& model,
                                                           const std::vector<ModelUnit>& units);

}  // namespace kiln
