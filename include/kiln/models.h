// Models: the seed MLP and a GPT-2-style decoder. Built by name from the config; initialised
// from run.seed with a private generator, so the same config gives the same initial bits.
//
// Parameter names follow Hugging Face GPT-2 (transformer.wte.weight, transformer.h.0.attn.c_attn.
// weight, ...). One documented difference: HF stores the four attention/MLP projection weights as
// Conv1D [in, out]; kiln uses nn.Linear [out, in], so export needs no rename, only a transpose of
// those (docs/models.md).
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace kiln {

class Config;

/// One unit of a model: the granularity at which FSDP shards and gathers parameters and
/// activation checkpointing recomputes. gpt: each transformer block ("transformer.h.<i>"); mlp:
/// each layer ("fc1", "fc2"). The parameters outside every unit (gpt's embeddings, final norm and
/// tied head) form the root group, which the model uses directly in forward().
struct ModelUnit {
  std::string name;                     // module path, e.g. "transformer.h.0"
  std::vector<std::string> parameters;  // full names, as named_parameters() spells them
};

/// The forward of one unit, from its input to its output (the unit's parameters are captured).
/// Models capture by value what a unit's forward needs, so a copy stays callable while the model
/// lives.
using UnitForward = std::function<torch::Tensor(const torch::Tensor&)>;

/// Runs around every unit's forward (activation checkpointing, FSDP's gather and free). A wrapper
/// must call `forward` (once, or again to recompute) and return what it returns; it may do work
/// before and after, and attach autograd hooks to the output. It may keep a copy of `forward`
/// and call it again later (in backward, to recompute). Called on the thread running the
/// model's forward (and, for recomputation, its backward).
class UnitWrapper {
 public:
  virtual ~UnitWrapper() = default;
  /// `unit` indexes Model::units().
  virtual torch::Tensor run(int unit, const UnitForward& forward, const torch::Tensor& input) = 0;
};

/// A trainable model: logits from inputs, and a loss from logits and targets.
class Model : public torch::nn::Module {
 public:
  /// mlp: [B, D] float -> [B, C] logits. gpt: [B, T] int64 -> [B, T, V] logits.
  virtual torch::Tensor forward(const torch::Tensor& inputs) = 0;
  /// Mean cross-entropy over every target (for gpt, over B*T positions).
  torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& targets) const;
  /// "mlp" or "gpt".
  virtual std::string architecture() const = 0;
  /// Architecture hyper-parameters as JSON (for the manifest and reports).
  virtual nlohmann::json describe() const = 0;
  /// Training FLOPs (forward + backward) per sample of `seq_len` tokens (ignored by the mlp):
  /// 6 x parameters (+ attention 12 * L * C * T per token for gpt), as nanoGPT/PaLM count them.
  virtual double train_flops_per_sample(int64_t seq_len) const = 0;
  /// The units, in forward order. Every parameter belongs to at most one unit. A model without
  /// units (the default) is one root group: FSDP gathers it whole, checkpointing skips it.
  virtual std::vector<ModelUnit> units() const { return {}; }
  /// Adds a wrapper around every unit's forward from the next forward on. Wrappers compose: one
  /// added later runs inside those added earlier (e.g. checkpointing outside FSDP's gather, so
  /// the recomputation in backward gathers too).
  void add_unit_wrapper(std::shared_ptr<UnitWrapper> wrapper);
  /// Removes every wrapper.
  void clear_unit_wrappers() { unit_wrappers_.clear(); }
  bool has_unit_wrappers() const { return !unit_wrappers_.empty(); }

 protected:
  /// Runs unit `unit` on `input` through the wrappers (directly when there are none).
  torch::Tensor run_unit(int unit, const UnitForward& forward, const torch::Tensor& input);

 private:
  std::vector<std::shared_ptr<UnitWrapper>> unit_wrappers_;
};

struct GptConfig {
  int64_t n_layer = 0, n_head = 0, n_embd = 0, block_size = 0, vocab_size = 0;
  double init_std = 0.02;
};

/// The GPT shape for the config: model.preset, with any non-zero model.* key overriding it.
/// Throws UserError (e.g. n_embd not divisible by n_head, seq_len > block_size).
GptConfig resolve_gpt_config(const Config& config);

/// Builds and initialises the configured model on the CPU. Throws UserError.
std::shared_ptr<Model> make_model(const Config& config);

/// Number of scalar parameters.
int64_t parameter_count(const torch::nn::Module& module);
/// xxh3-64 over every parameter's and buffer's name, dtype, shape and bytes, in order.
std::string weights_hash(const torch::nn::Module& module);
/// The manifest's "model" object: architecture, hyper-parameters, parameter count, weights hash.
nlohmann::json model_identity(const Model& model);

}  // namespace kiln
