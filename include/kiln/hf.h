// Hugging Face GPT-2 interop for kiln's gpt: export to the layout transformers'
// GPT2LMHeadModel.from_pretrained reads, and load such a directory as a model's initial weights
// (model.init_from). Data-only: config.json and safetensors; never pytorch_model.bin (pickle).
//
// The layout (docs/models.md): parameter names are the same as kiln's ("transformer.h.0.attn.
// c_attn.weight", ...); the four projection weights (attn.c_attn, attn.c_proj, mlp.c_fc,
// mlp.c_proj) are Conv1D [in, out] in Hugging Face and nn.Linear [out, in] in kiln, so they are
// transposed both ways; the head is tied to transformer.wte.weight and not written (HF ties it
// from tie_word_embeddings). Activation gelu_new (tanh), LayerNorm epsilon 1e-5, no dropout.
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "kiln/models.h"

namespace kiln {

/// config.json for a kiln GPT shape: GPT2Config's fields (model_type "gpt2", n_layer, n_head,
/// n_embd, n_positions = block_size, vocab_size, activation_function "gelu_new",
/// layer_norm_epsilon 1e-5, tie_word_embeddings true, zero dropout). Pure.
nlohmann::json hf_gpt2_config(const GptConfig& gpt);

/// The first difference between a Hugging Face config.json (parsed) and the kiln GPT shape, as
/// one line naming the config.json field and the model.* key to set ("config.json has n_embd =
/// 64 but the model has 128: set model.n_embd = 64"); empty when they describe the same network.
/// Also refuses what kiln's gpt cannot express: an untied head, another activation or epsilon,
/// n_inner other than 4 * n_embd, cross-attention, scaled-by-layer or upcast attention. Pure.
std::string hf_gpt2_config_mismatch(const nlohmann::json& hf_config, const GptConfig& gpt);

/// Reads <dir>/config.json. Throws UserError naming the file and `key` (e.g. "model.init_from")
/// when it is missing or not a JSON object.
nlohmann::json read_hf_config(const std::filesystem::path& dir, const std::string& key);

/// Writes `model` (a gpt; any device) as <out_dir>/config.json and <out_dir>/model.safetensors
/// (metadata format "pt"). A non-empty `out_dir` is refused unless `force`, which first removes
/// the files an export writes (config.json, *.safetensors, model.safetensors.index.json).
/// Throws UserError (an mlp, a non-empty directory, a write failure).
void save_hf_gpt2(Model& model, const std::filesystem::path& out_dir, bool force);

/// Copies the weights of the Hugging Face GPT-2 directory `dir` into `model` (a gpt), checking
/// first that config.json matches the model's shape (hf_gpt2_config_mismatch) and that every
/// parameter is there with its shape: the first missing, mismatching or unexpected tensor is
/// named in the UserError. Reads model.safetensors, or the shards a model.safetensors.index.json
/// lists; tensor names with or without the "transformer." prefix (GPT2LMHeadModel or GPT2Model);
/// the attention-mask buffers (attn.bias, attn.masked_bias) and a tied lm_head.weight are
/// skipped. Any float dtype is converted to the parameter's. Returns the model revision for the
/// manifest: {"path", "config_sha256", "files": [{"file", "bytes", "sha256"}]}. `key` names the
/// setting in errors ("model.init_from"). Nothing is copied unless every check passes.
nlohmann::json load_hf_gpt2(Model& model, const std::filesystem::path& dir, const std::string& key);

/// SHA-256 of a file's content as 64 hex digits (streamed). Throws UserError naming the path.
std::string sha256_file(const std::filesystem::path& path);

}  // namespace kiln
