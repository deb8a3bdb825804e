// A model whose forward() is three calls: the root's piece before its units, the units (each
// through Model::run_unit, so every unit wrapper runs), and the root's piece after them. Per-unit
// compilation (src/compile/compiled_units.cpp, compile.root) compiles the two root pieces as
// graphs of their own, with the wrapped units (activation checkpointing, FSDP's gather/free, the
// compiled units) still between them. Internal to kiln (src/): gpt and llama implement it beside
// Model; a model that does not keeps its root eager.
#pragma once

#include <string>
#include <vector>

#include "kiln/models.h"

namespace kiln {

class SplitForward {
 public:
  virtual ~SplitForward() = default;
  /// The root parameters each piece reads, by full name (as named_parameters() spells them), in
  /// the order a compiled piece takes them. A parameter may be read by both pieces (gpt's token
  /// embedding, tied to the head).
  virtual std::vector<std::string> before_units_parameters() const = 0;
  virtual std::vector<std::string> after_units_parameters() const = 0;
  /// Token ids [B, T] int64 -> the first unit's input [B, T, C]. Throws UserError when T is
  /// over the model's block size (as forward() does).
  virtual torch::Tensor before_units(const torch::Tensor& inputs) = 0;
  /// Every unit in forward order, each through Model::run_unit. What the units share besides the
  /// hidden (llama's rotary tables) is built here, from `hidden`.
  virtual torch::Tensor through_units(const torch::Tensor& hidden) = 0;
  /// The last unit's output -> logits [B, T, V]; Model::loss of them is the training loss.
  /// forward(x) is after_units(through_units(before_units(x))).
  virtual torch::Tensor after_units(const torch::Tensor& hidden) = 0;
};

/// `model` as a SplitForward, or null when its forward does not split so.
inline SplitForward* split_forward_of(Model& model) {
  return dynamic_cast<SplitForward*>(&model);
}

}  // namespace kiln
