// Hugging Face interop for kiln's gpt (GPT2LMHeadModel) and llama (LlamaForCausalLM): export to
// the layout transformers' from_pretrained reads, and load such a directory as a model's initial
// weights (model.init_from). Data-only: config.json and safetensors; never pytorch_model.bin
// (pickle).
//
// Llama (docs/models.md): kiln's parameter names are Hugging Face's, every weight in the same
// [out, in] layout; with tie_word_embeddings the head is not written. RMSNorm, SiLU, the default
// rope (no rope_scaling), no biases.
//
// GPT-2's layout (docs/models.md): parameter names are the same as kiln's ("transformer.h.0.attn.
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

/// config.json for a kiln Llama shape: LlamaConfig's fields (architectures ["LlamaForCausalLM"],
/// model_type "llama", hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
/// num_key_value_heads, head_dim, max_position_embeddings = block_size, vocab_size,
/// rms_norm_eps, rope_theta, tie_word_embeddings, hidden_act "silu", no biases). Pure.
nlohmann::json hf_llama_config(const LlamaConfig& llama);

/// The Llama shape a LlamaForCausalLM config.json describes, or "" in `problem` naming the first
/// field kiln's llama cannot express (rope_scaling, biases, another activation, a head_dim other
/// than hidden_size / num_attention_heads, a missing field). Pure.
LlamaConfig llama_config_from_hf(const nlohmann::json& hf_config, std::string& problem);

/// The first difference between a Llama config.json and the kiln shape, as one line naming the
/// config.json field and the model.* key with both values; "" when they describe the same network.
std::string hf_llama_config_mismatch(const nlohmann::json& hf_config, const LlamaConfig& llama);

/// As save_hf_gpt2 / load_hf_gpt2, for a llama (names as they are, no transposes; a tied head is
/// neither written nor read: lm_head.weight in the directory is skipped).
void save_hf_llama(Model& model, const std::filesystem::path& out_dir, bool force);
nlohmann::json load_hf_llama(Model& model, const std::filesystem::path& dir,
                             const std::string& key);

/// The model's registered Hugging Face export / import (ModelSpec::save_hf, load_hf). Throws
/// UserError for a model without one (the mlp) or any error of theirs.
void save_hf(Model& model, const std::filesystem::path& out_dir, bool force);
nlohmann::json load_hf(Model& model, const std::filesystem::path& dir, const std::string& key);

/// What generation needs beside an exported model's weights, so that `generate` runs as the model
/// trained: the data's end-of-document token as bos_token_id and eos_token_id in config.json and
/// generation_config.json (kiln data prepare's separator, from the corpus's data.json named in the
/// run's manifest; else model.init_from's config.json's ids; else null, written so, since
/// transformers would fall back on GPT-2's 50256 otherwise), and the tokenizer: the corpus's
/// tokenizer.json when its SHA-256 is the one data.json recorded (a tokenizer_config.json naming
/// the end token beside it), else model.init_from's tokenizer files. A tokenizer that moved or
/// changed since the data was prepared is not carried: said in the returned text, which tells
/// what was carried and from where (one line for the export's message). `run_manifest` is the
/// training run's manifest.json (null when it is gone), `init_from` the model's record of
/// model.init_from (null without one).
std::string write_hf_generation_files(const std::filesystem::path& out_dir,
                                      const nlohmann::json& run_manifest,
                                      const nlohmann::json& init_from);

/// SHA-256 of a file's content as 64 hex digits (streamed). Throws UserError naming the path.
std::string sha256_file(const std::filesystem::path& path);

}  // namespace kiln
