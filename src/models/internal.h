// Internals of the models component (src/models/), not public API.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kiln/config.h"
#include "kiln/models.h"

namespace kiln {

/// The keys every model build reads (src/models/options.cpp, the only place src/models/ reads
/// a Config by key).
struct ModelBuildOptions {
  std::string name;                // model.name
  std::string init_from;           // model.init_from: a Hugging Face directory, or ""
  uint64_t seed = 0;               // run.seed: the initialisation's generator
  int64_t seq_len = 0;             // data.seq_len: a decoder's block_size must hold it
  std::string package;             // model.package: the exported model's directory
  bool compiled = false;           // compile.backend is not "eager"
  bool compiled_per_unit = false;  // compiles_per_unit (core/options.h)
  static ModelBuildOptions from_config(const Config& config);
};

/// The seed MLP's shape (model.input_dim, hidden_dim, num_classes, data_dependent_branch).
struct MlpShape {
  int64_t input_dim = 0, hidden_dim = 0, num_classes = 0;
  bool data_dependent_branch = false;
  static MlpShape from_config(const Config& config);
};

/// A GPT preset by name ("tiny", "small", "gpt2-124m"); any other name gives tiny (the [model]
/// rules refuse it).
GptConfig gpt_preset(const std::string& name);
/// The GPT shape for the config (src/models/options.cpp): model.preset (or model.init_from's
/// config.json), with any non-zero model.* key overriding it. Unchecked (resolve_gpt_config checks
/// it; the [model] rules explain what is wrong).
GptConfig gpt_shape(const Config& config);
/// The same for llama (models/llama.cpp).
LlamaConfig llama_shape(const Config& config);
/// A llama preset by name ("tiny"/"llama-tiny", "small"/"llama-small", "llama3-8b"); any other
/// name gives llama-tiny (the [model] rules refuse it).
LlamaConfig llama_preset(const std::string& name);
/// What makes a Llama shape unbuildable (head size, key/value heads), or "".
std::string llama_shape_problem(const LlamaConfig& shape);
/// Why the llama of `shape` cannot be split over `tp` tensor-parallel ranks ("" when it can).
std::string llama_tensor_parallel_problem(const LlamaConfig& shape, int64_t tp);
/// Parameter count and FLOPs of a shape.
ModelMath llama_math(const LlamaConfig& shape);
ModelMath gpt_math(const GptConfig& shape);
/// Why gpt cannot split over `tp` tensor-parallel ranks ("" when it can).
std::string gpt_tensor_parallel_problem(const GptConfig& shape, int64_t tp);

/// The one line for a model.name nobody registered, listing the registered ones.
std::string unknown_model_problem(const std::string& name);

/// One unit per block, named "<prefix>.<i>", with the block's parameters under that name (the
/// Model::units() of a stack of transformer blocks).
template <typename Block>
std::vector<ModelUnit> block_units(const std::string& prefix,
                                   const std::vector<std::shared_ptr<Block>>& blocks) {
  std::vector<ModelUnit> out;
  for (size_t i = 0; i < blocks.size(); ++i) {
    ModelUnit unit{prefix + "." + std::to_string(i), {}};
    for (const auto& item : blocks[i]->named_parameters()) {
      unit.parameters.push_back(unit.name + "." + item.key());
    }
    out.push_back(std::move(unit));
  }
  return out;
}
/// Every registered spec, for the [model] section of the schema; models registered after this
/// may add no keys or rules (register_model refuses them).
std::vector<const ModelSpec*> specs_for_schema();

/// The built-in models' registrations (the registry adds them first, through register_model).
ModelSpec mlp_spec();
ModelSpec gpt_spec();
ModelSpec llama_spec();

// ---- Hugging Face directories (models/hf.cpp), shared by the GPT-2 and Llama interop ----------

/// <dir>/config.json parsed, or nullopt when it is missing or not a JSON object (the rules say
/// why). Never throws.
std::optional<nlohmann::json> try_read_hf_config(const std::filesystem::path& dir);
/// The shape a GPT-2 / Llama config.json describes, or nullopt when `dir` holds none (missing
/// file, another model_type, a missing integer field).
std::optional<GptConfig> gpt_config_from_hf_dir(const std::filesystem::path& dir);
std::optional<LlamaConfig> llama_config_from_hf_dir(const std::filesystem::path& dir);
/// The registered model a config.json's model_type maps to: "gpt" for gpt2, "llama" for llama;
/// "" for anything else.
std::string hf_model_name(const nlohmann::json& hf_config);

/// Every tensor of a Hugging Face directory's weight files (model.safetensors or the shards of
/// model.safetensors.index.json), by its saved name, with the file it came from; and the
/// revision for the manifest ({"path", "config_sha256", "files"}). Throws UserError naming `key`.
struct HfWeights {
  nlohmann::json revision;
  std::map<std::string, std::pair<std::string, torch::Tensor>> tensors;  // name -> (file, tensor)
};
HfWeights read_hf_weights(const std::filesystem::path& dir, const std::string& key);

/// Checks that `found` holds exactly the model's parameters (by kiln name) with their shapes
/// (`transposed` names the ones stored [in, out]), then copies them. The first missing,
/// mismatching or unexpected tensor is named in the UserError; nothing is copied unless all pass.
/// `what` names the architecture in messages ("GPT-2", "Llama").
void copy_hf_weights(Model& model, HfWeights& found, const std::filesystem::path& dir,
                     const std::string& key, const std::string& what,
                     const std::function<bool(const std::string&)>& transposed);

/// The files write_hf_generation_files may write (generation_config.json, the tokenizer's), which
/// an export with --force replaces.
bool is_hf_generation_file(const std::string& name);

/// Makes `out_dir` an empty directory for an export (kiln/hf.h save_hf's rules). Throws UserError.
void prepare_hf_export_dir(const std::filesystem::path& out_dir, bool force);

}  // namespace kiln
