// Strict resume (not public API): a `--resume` restores exactly the training state it saved —
// every model and optimizer tensor of the checkpoint has its place in the trainer's state and
// every one of the trainer's is in the checkpoint, with the same name, shape and dtype — or it
// stops naming the first difference. Loading a subset on purpose is model.init_from's job.
#pragma once

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "kiln/checkpoint.h"
#include "kiln/config.h"
#include "kiln/error.h"

namespace kiln::ckpt {

/// A checkpoint that reads but holds another training state than the trainer's. Not a damaged
/// checkpoint: load_newest does not fall back to an older one past it (they hold the same).
struct StateMismatch : UserError {
  using UserError::UserError;
};

/// The whole shape and the dtype of one tensor of a training state.
struct TensorShape {
  std::vector<int64_t> shape;
  torch::ScalarType dtype = torch::kFloat;
  bool operator==(const TensorShape&) const = default;
};
/// "model/<name>" and "optim/<name>" tensors of a training state, by checkpoint name.
using StateShapes = std::map<std::string, TensorShape>;

/// The model and optimizer tensors of a trainer's `state` (whole shapes for FSDP pieces), merged
/// over the ranks of `comm` (a rank may hold no piece of a small tensor). Collective.
StateShapes live_state_shapes(const TrainState& state, Communicator& comm);

/// The model and optimizer tensors a Trainer of `model` holds: the model's parameters and
/// buffers, and the state of an optimizer of `optim` over them, on meta tensors (no memory).
StateShapes model_state_shapes(Model& model, const OptimOptions& optim);

/// "" when the checkpoint's model/ and optim/ tensors are exactly `live`'s; else "<n> differences;
/// the first: <what>" (by tensor name). A checkpoint without any per-parameter step count (format
/// 1, before they existed) is not asked for them.
std::string state_difference(const CheckpointIndex& index, const StateShapes& live);

/// What a mismatch error says to do.
std::string state_mismatch_advice();

/// The checkpoint settings a resumed run keeps (resume_config), as a checkpoint records them in
/// training_state.checkpointing: every_steps, keep_last_k, keep_every, save_final, async,
/// on_save_error.
nlohmann::json checkpoint_settings(const Config& config);

}  // namespace kiln::ckpt
