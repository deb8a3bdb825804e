// Models: a registry of named architectures (the seed MLP, a GPT-2-style decoder and a Llama-style
// decoder are registered through the same public API a user's own model uses), each built from
// the config and initialised from run.seed with a private generator, so the same config gives the
// same initial bits.
//
// Parameter names follow Hugging Face: gpt as GPT2LMHeadModel (transformer.wte.weight,
// transformer.h.0.attn.c_attn.weight, ...), llama as LlamaForCausalLM (model.embed_tokens.weight,
// model.layers.0.self_attn.q_proj.weight, ..., lm_head.weight). One documented difference: HF
// stores GPT-2's four attention/MLP projection weights as Conv1D [in, out]; kiln uses nn.Linear
// [out, in], so export needs no rename, only a transpose of those (docs/models.md).
#pragma once

#include <ATen/core/Generator.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kiln/config.h"

namespace kiln {

/// One unit of a model: the granularity at which FSDP shards and gathers parameters and
/// activation checkpointing recomputes. gpt: each transformer block ("transformer.h.<i>"); mlp:
/// each layer ("fc1", "fc2"); llama: each decoder layer ("model.layers.<i>"). The parameters
/// outside every unit (gpt's embeddings, final norm and tied head) form the root group, which the
/// model uses directly in forward().
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

class Communicator;  // kiln/comm.h

/// How one parameter is split over the tensor-parallel ranks (Model::tensor_parallel()): this
/// rank holds indices [offset, offset + its size) of the whole parameter along `dim`. A fused
/// parameter (gpt's c_attn: q, k and v stacked on dim 0) is `chunks` equal blocks along `dim`,
/// each split alike: this rank holds [offset, offset + part) of every block, concatenated in
/// block order (part = its size along `dim` / chunks).
struct TensorParallelPlacement {
  int dim = 0;  // 0: column-parallel (output features), 1: row-parallel (input features)
  std::vector<int64_t> global_shape;  // the whole parameter's shape
  int64_t offset = 0;                 // within each block
  int64_t length = 0;                 // this rank's indices of each block along `dim`
  int64_t chunks = 1;                 // fused blocks along `dim`
  /// A run of this rank's slice along `dim`: `length` indices from `local` in the slice are the
  /// whole parameter's from `global` on.
  struct Run {
    int64_t local = 0, global = 0, length = 0;
  };
  /// Where the slice's indices [begin, begin + count) along `dim` (FSDP's rows of a slice) lie in
  /// the whole parameter: one run per block they touch.
  std::vector<Run> runs(int64_t begin, int64_t count) const;
};

/// A trainable model: logits from inputs, and a loss from logits and targets.
class Model : public torch::nn::Module {
 public:
  /// mlp: [B, D] float -> [B, C] logits. gpt, llama: [B, T] int64 -> [B, T, V] logits.
  virtual torch::Tensor forward(const torch::Tensor& inputs) = 0;
  /// The training loss from forward()'s output. The default: mean cross-entropy over every
  /// target (for token models over the B*T positions). A model that overrides it needs a Python
  /// twin with the same loss for the compile rung.
  virtual torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& targets) const;
  /// Whether the model is a classifier whose accuracy evaluation reports (the mlp): its
  /// forward() gives [B, C] logits and correct_predictions() counts argmax hits. False (the
  /// default) for token models, whose measure is the loss alone.
  virtual bool classifier() const { return false; }
  /// For a classifier: the number of samples whose argmax logit is the target, a 0-dim int64
  /// tensor on the logits' device. Undefined for other models.
  torch::Tensor correct_predictions(const torch::Tensor& logits,
                                    const torch::Tensor& targets) const;
  /// The registered name it was built under (ModelSpec::name): "mlp", "gpt", "llama", ...
  virtual std::string architecture() const = 0;
  /// Architecture hyper-parameters as JSON (for the manifest and reports).
  virtual nlohmann::json describe() const = 0;
  /// Training FLOPs (forward + backward) per sample of `seq_len` tokens (ignored by the mlp):
  /// 6 x parameters (+ attention 12 * L * C * T per token for gpt and llama), as nanoGPT/PaLM
  /// count them (ModelMath says which parameters count).
  virtual double train_flops_per_sample(int64_t seq_len) const = 0;
  /// Where the initial weights came from when not from run.seed: model.init_from's revision
  /// (kiln/hf.h load_hf: path and each weight file's SHA-256); null otherwise.
  nlohmann::json init_from = nullptr;
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

  /// Tensor parallelism (Megatron-LM's): shards the model over `tp`'s ranks in place. Each
  /// split parameter keeps its name and becomes this rank's slice (its placement in
  /// tensor_parallel()); every other parameter stays whole and equal on every rank; forward then
  /// computes the local slice of each split layer with a collective at each block's edges (an
  /// all-reduce of the input's gradient before the column-parallel layers, of the output after
  /// the row-parallel ones). Call once, on every rank of `tp` with the same weights, before the
  /// optimizer sees the parameters (kiln/dist.h install_tensor_parallel). The default throws
  /// UserError: the model declares no tensor-parallel plan (ModelSpec::tensor_parallel_problem).
  virtual void shard_tensor_parallel(std::shared_ptr<Communicator> tp);
  /// The split parameters' placements by name (empty before shard_tensor_parallel).
  const std::map<std::string, TensorParallelPlacement>& tensor_parallel() const {
    return tensor_parallel_;
  }

 protected:
  std::map<std::string, TensorParallelPlacement> tensor_parallel_;

  /// Runs unit `unit` on `input` through the wrappers (directly when there are none).
  torch::Tensor run_unit(int unit, const UnitForward& forward, const torch::Tensor& input);

 private:
  std::vector<std::shared_ptr<UnitWrapper>> unit_wrappers_;
};

struct GptConfig {
  int64_t n_layer = 0, n_head = 0, n_embd = 0, block_size = 0, vocab_size = 0;
  double init_std = 0.02;
};

/// The GPT shape for the config: model.preset, with any non-zero model.* key overriding it; with
/// model.init_from, the directory's config.json instead of the preset. Throws UserError (e.g.
/// n_embd not divisible by n_head, seq_len > block_size).
GptConfig resolve_gpt_config(const Config& config);

/// A Llama-style decoder: RMSNorm, rotary position embeddings, SwiGLU MLP, grouped-query
/// attention, no biases (Hugging Face LlamaForCausalLM).
struct LlamaConfig {
  int64_t n_layer = 0, n_head = 0, n_kv_head = 0, n_embd = 0, intermediate_size = 0, block_size = 0,
          vocab_size = 0;
  double rope_theta = 10000.0, norm_eps = 1e-5, init_std = 0.02;
  bool tie_embeddings = false;  // lm_head shares model.embed_tokens.weight
  int64_t head_dim() const { return n_embd / n_head; }
};

/// The Llama shape for the config, as resolve_gpt_config (presets llama-tiny, llama-small,
/// llama3-8b; "tiny" and "small" name llama's own). Throws UserError.
LlamaConfig resolve_llama_config(const Config& config);

// ---- the registry ------------------------------------------------------------------------------

/// What a model takes: token ids [B, T] int64 (data.seq_len is T; text and token data) or
/// feature vectors [B, D] float32 (synthetic data).
enum class ModelInput { kTokens, kFeatures };

/// A model's size and cost, computed from the config without building it (kiln plan).
struct ModelMath {
  int64_t parameters = 0;               // == parameter_count(*make_model(config))
  int64_t largest_unit_parameters = 0;  // the largest unit, or the root group if larger
  /// N of 6N: the parameters a token's forward multiplies by (the head, every projection), not the
  /// lookup-only ones (position embeddings; an untied token embedding).
  int64_t flop_parameters = 0;
  /// Token models: layers and attention width (query heads x head size) for the attention term.
  int64_t n_layer = 0, attention_width = 0;
  /// Token models, for memory models: widths and vocabulary (0 where the model has none).
  int64_t n_embd = 0, n_head = 0, n_kv_head = 0, intermediate_size = 0, vocab_size = 0;
  /// A model of your own, for the memory estimate (the pilot's gate, kiln plan): the values
  /// autograd saves for backward per sample (per data.seq_len tokens for token models), in
  /// elements of the compute dtype (4 bytes in fp32, 2 under bf16/fp16-mixed). All 0: unknown,
  /// and the estimate counts the held state and gradients only. gpt, llama and mlp ignore them
  /// (kiln walks their steps).
  double activation_elements_per_sample = 0;  // the whole forward's, the loss's included
  /// Activation checkpointing (train.activation_checkpointing = "block"): the largest unit's saved
  /// values (recomputed in backward, so only one unit's are live), what a checkpointed unit keeps
  /// instead (its input), and how many units Model::units() returns.
  double unit_activation_elements_per_sample = 0, unit_input_elements_per_sample = 0;
  int64_t units = 0;
  /// Parameters in the tensors the model's tensor-parallel plan slices (ModelSpec::
  /// tensor_parallel_problem; 0 without a plan): the planner's TP memory and traffic.
  int64_t tensor_parallel_parameters = 0;
  /// The parameters of one of the `units` blocks the plan slices (an equal share of
  /// tensor_parallel_parameters each); the rest of the model is one whole group.
  int64_t tensor_parallel_block_parameters = 0;
  /// Token models: the positions the model holds (a learned position table's rows; the context
  /// length), and whether the head is the token embedding's weight.
  int64_t block_size = 0;
  bool tie_embeddings = false;
  /// Feature models: input features, hidden width, classes per sample.
  int64_t input_dim = 0, hidden_dim = 0, num_classes = 0;
  /// The walk kiln's memory model takes through this model's step (src/plan/memory_model.cpp):
  /// a layout it knows allocation by allocation, or kGeneric, the estimate from the figures
  /// above. A model of your own built like one of kiln's may name its layout.
  enum class StepLayout { kGeneric, kMlp, kGptDecoder, kLlamaDecoder };
  StepLayout step_layout = StepLayout::kGeneric;
  /// Training FLOPs (forward + backward) per token at `seq_len`: 6N + 12 * L * width * T.
  double train_flops_per_token(int64_t seq_len) const {
    const double attention = 12.0 * static_cast<double>(n_layer) *
                             static_cast<double>(attention_width) * static_cast<double>(seq_len);
    return 6.0 * static_cast<double>(flop_parameters) + attention;
  }
};

/// Everything kiln needs to know about a model architecture. Only `name` and `build` are
/// required; the rest turn on the rungs and checks that need them.
struct ModelSpec {
  std::string name;         // model.name: lowercase letters, digits, '-', '_'
  std::string description;  // one line, for error messages and docs
  ModelInput input = ModelInput::kTokens;
  /// Builds and initialises the model on the CPU, drawing its random init from `generator`
  /// (seeded by run.seed). Called by make_model, possibly from several threads at once (one
  /// model each). Throws UserError for a shape it cannot build.
  std::function<std::shared_ptr<Model>(const Config& config, at::Generator& generator)> build;
  /// Token models: the vocabulary size the config gives (data checks token ids against it).
  std::function<int64_t(const Config& config)> vocab_size;
  /// The model's size and FLOPs for `kiln plan`; without it, planning refuses the model.
  std::function<ModelMath(const Config& config)> math;
  /// Keys this model reads, added to the [model] section (a key another model already declared,
  /// by full name, is shared) and cross-key rules (each returns "" unless model.name is this
  /// model). Part of the config schema only when registered before the first config is read.
  std::vector<KeyDef> keys;
  std::vector<ConfigRule> rules;
  /// The Python twin for the compile rung: a module the compile step imports, whose
  /// build(spec) returns a torch.nn.Module with the same parameter names ("kiln_py.models").
  /// Empty: the compile rung refuses the model with one line.
  std::string python_twin;
  /// Hugging Face interop (model.init_from, `kiln export --format hf`); empty: refused.
  /// load_hf copies the weights of a save_pretrained directory into the model and returns the
  /// revision for the manifest (kiln/hf.h load_hf); save_hf writes one.
  std::function<nlohmann::json(Model& model, const std::filesystem::path& dir,
                               const std::string& key)>
      load_hf;
  std::function<void(Model& model, const std::filesystem::path& dir, bool force)> save_hf;
  /// Tensor parallelism: why this model cannot be split over `tp` ranks as the config shapes it
  /// ("" when it can: e.g. tp divides the heads), checked by a config rule when dist.tp > 1.
  /// Null: the model has no tensor-parallel plan and dist.tp > 1 is refused.
  std::function<std::string(const Config& config, int64_t tp)> tensor_parallel_problem;
};

/// Adds a model architecture under spec.name. Thread-safe. Registering before the first config is
/// read puts its keys and rules into the schema; model.name accepts it whenever registered.
/// Throws std::invalid_argument for an empty name or build, or a name already registered (the
/// built-ins mlp, gpt, llama are registered before anything else can be).
void register_model(ModelSpec spec);
/// The spec registered under `name`, or nullptr. The pointer stays valid (never unregistered).
const ModelSpec* find_model(const std::string& name);
/// The registered names, sorted.
std::vector<std::string> registered_models();
/// The spec of the config's model.name. Throws UserError naming the registered ones.
const ModelSpec& model_spec(const Config& config);
/// True when the configured model takes token ids (data.seq_len applies).
bool model_takes_tokens(const Config& config);
/// The configured token model's vocabulary size; 0 for a feature model or an unknown name.
int64_t model_vocab_size(const Config& config);
/// The configured model's math (ModelSpec::math). Throws UserError when it has none.
ModelMath model_math(const Config& config);

/// Builds and initialises the configured model on the CPU (its spec's build); with
/// model.init_from, its weights are then loaded from that Hugging Face directory (kiln/hf.h).
/// Throws UserError.
std::shared_ptr<Model> make_model(const Config& config);

/// Number of scalar parameters.
int64_t parameter_count(const torch::nn::Module& module);
/// xxh3-64 over every parameter's and buffer's name, dtype, shape and bytes, in order.
std::string weights_hash(const torch::nn::Module& module);
/// The manifest's "model" object: architecture, hyper-parameters, parameter count, weights hash,
/// and "init_from" (Model::init_from) when the weights were loaded from a directory.
nlohmann::json model_identity(const Model& model);

}  // namespace kiln
