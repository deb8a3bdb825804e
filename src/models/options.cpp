// The models' reads of the config by key: each built-in model's shape and the keys the registry
// and the exported model read. The only place in src/models/ that reads a Config by key; the
// model code takes what these return.
#include "core/options.h"

#include <fmt/format.h>

#include "kiln/config.h"
#include "kiln/models.h"
#include "models/internal.h"

namespace kiln {

ModelBuildOptions ModelBuildOptions::from_config(const Config& config) {
  return {.name = config.get_string("model.name"),
          .init_from = config.get_string("model.init_from"),
          .seed = static_cast<uint64_t>(config.get_int("run.seed")),
          .seq_len = config.get_int("data.seq_len"),
          .package = config.get_string("model.package"),
          .compiled = config.get_string("compile.backend") != "eager",
          .compiled_per_unit = compiles_per_unit(config)};
}

MlpShape MlpShape::from_config(const Config& config) {
  return {.input_dim = config.get_int("model.input_dim"),
          .hidden_dim = config.get_int("model.hidden_dim"),
          .num_classes = config.get_int("model.num_classes"),
          .data_dependent_branch = config.get_bool("model.data_dependent_branch")};
}

namespace {

// Any non-zero model.<key> overrides the preset's (or model.init_from's) field.
void override_from(const Config& config, const char* key, int64_t& field) {
  if (const int64_t v = config.get_int(key); v > 0) field = v;
}

}  // namespace

GptConfig gpt_shape(const Config& config) {
  GptConfig out = gpt_preset(config.get_string("model.preset"));
  // As from_pretrained: the shape of model.init_from's config.json, not the preset's.
  if (const std::string& dir = config.get_string("model.init_from"); !dir.empty()) {
    if (auto from_hf = gpt_config_from_hf_dir(dir)) out = *from_hf;
  }
  override_from(config, "model.n_layer", out.n_layer);
  override_from(config, "model.n_head", out.n_head);
  override_from(config, "model.n_embd", out.n_embd);
  override_from(config, "model.block_size", out.block_size);
  override_from(config, "model.vocab_size", out.vocab_size);
  out.init_std = config.get_float("model.init_std");
  return out;
}

LlamaConfig llama_shape(const Config& config) {
  LlamaConfig out = llama_preset(config.get_string("model.preset"));
  if (const std::string& dir = config.get_string("model.init_from"); !dir.empty()) {
    if (auto from_hf = llama_config_from_hf_dir(dir)) out = *from_hf;
  }
  override_from(config, "model.n_layer", out.n_layer);
  override_from(config, "model.n_head", out.n_head);
  override_from(config, "model.n_kv_head", out.n_kv_head);
  override_from(config, "model.n_embd", out.n_embd);
  override_from(config, "model.intermediate_size", out.intermediate_size);
  override_from(config, "model.block_size", out.block_size);
  override_from(config, "model.vocab_size", out.vocab_size);
  if (const double theta = config.get_float("model.rope_theta"); theta > 0) out.rope_theta = theta;
  if (const double eps = config.get_float("model.norm_eps"); eps > 0) out.norm_eps = eps;
  if (config.get_bool("model.tie_embeddings")) out.tie_embeddings = true;
  out.init_std = config.get_float("model.init_std");
  return out;
}

}  // namespace kiln
