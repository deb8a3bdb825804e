// Hugging Face LlamaForCausalLM interop (kiln/hf.h): config.json <-> LlamaConfig, and the weights,
// whose names and layout are kiln's own (no transposes); the directory machinery is models/hf.cpp.
#include <fmt/format.h>

#include <cmath>

#include "core/files.h"
#include "kiln/error.h"
#include "kiln/hf.h"
#include "kiln/safetensors.h"
#include "models/internal.h"

namespace kiln {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

LlamaConfig llama_shape_of(const Model& model, const std::string& what) {
  if (model.architecture() != "llama") {
    throw UserError(
        fmt::format("{}: the model is {}; Hugging Face Llama interop needs model.name = \"llama\"",
                    what, model.architecture()));
  }
  const json d = model.describe();
  LlamaConfig out;
  out.n_layer = d.at("n_layer").get<int64_t>();
  out.n_head = d.at("n_head").get<int64_t>();
  out.n_kv_head = d.at("n_kv_head").get<int64_t>();
  out.n_embd = d.at("n_embd").get<int64_t>();
  out.intermediate_size = d.at("intermediate_size").get<int64_t>();
  out.block_size = d.at("block_size").get<int64_t>();
  out.vocab_size = d.at("vocab_size").get<int64_t>();
  out.rope_theta = d.at("rope_theta").get<double>();
  out.norm_eps = d.at("norm_eps").get<double>();
  out.tie_embeddings = d.at("tie_embeddings").get<bool>();
  out.init_std = d.at("init_std").get<double>();
  return out;
}

// config.json's integer fields and the model.* keys they set.
struct IntField {
  const char* hf;
  const char* key;
  int64_t LlamaConfig::*field;
};
constexpr IntField kIntFields[] = {
    {"num_hidden_layers", "model.n_layer", &LlamaConfig::n_layer},
    {"num_attention_heads", "model.n_head", &LlamaConfig::n_head},
    {"num_key_value_heads", "model.n_kv_head", &LlamaConfig::n_kv_head},
    {"hidden_size", "model.n_embd", &LlamaConfig::n_embd},
    {"intermediate_size", "model.intermediate_size", &LlamaConfig::intermediate_size},
    {"max_position_embeddings", "model.block_size", &LlamaConfig::block_size},
    {"vocab_size", "model.vocab_size", &LlamaConfig::vocab_size},
};

bool same(double a, double b) {
  return std::abs(a - b) <= 1e-12 * std::max(1.0, std::abs(b));
}

}  // namespace

json hf_llama_config(const LlamaConfig& c) {
  return {{"architectures", json::array({"LlamaForCausalLM"})},
          {"model_type", "llama"},
          {"hidden_size", c.n_embd},
          {"intermediate_size", c.intermediate_size},
          {"num_hidden_layers", c.n_layer},
          {"num_attention_heads", c.n_head},
          {"num_key_value_heads", c.n_kv_head},
          {"head_dim", c.head_dim()},
          {"max_position_embeddings", c.block_size},
          {"vocab_size", c.vocab_size},
          {"hidden_act", "silu"},
          {"rms_norm_eps", c.norm_eps},
          {"rope_theta", c.rope_theta},
          {"rope_scaling", nullptr},
          {"attention_bias", false},
          {"mlp_bias", false},
          {"attention_dropout", 0.0},
          {"pretraining_tp", 1},
          {"initializer_range", c.init_std},
          {"tie_word_embeddings", c.tie_embeddings},
          {"torch_dtype", "float32"}};
}

LlamaConfig llama_config_from_hf(const json& hf, std::string& problem) {
  LlamaConfig out;
  problem.clear();
  if (hf.value("model_type", std::string()) != "llama") {
    problem = fmt::format("config.json has model_type = {}; kiln's llama reads \"llama\"",
                          hf.contains("model_type") ? hf["model_type"].dump() : "(none)");
    return out;
  }
  for (const IntField& f : kIntFields) {
    if (std::string(f.hf) == "num_key_value_heads" && (!hf.contains(f.hf) || hf[f.hf].is_null())) {
      continue;  // transformers' default: one key/value head per query head
    }
    if (!hf.contains(f.hf) || !hf[f.hf].is_number_integer() || hf[f.hf].get<int64_t>() <= 0) {
      problem = fmt::format("config.json has no positive integer {}", f.hf);
      return out;
    }
    out.*f.field = hf[f.hf].get<int64_t>();
  }
  if (out.n_kv_head == 0) out.n_kv_head = out.n_head;
  // rope_theta at the top (transformers 4) or in rope_parameters (transformers 5).
  const json* rope = hf.contains("rope_parameters") && hf["rope_parameters"].is_object()
                         ? &hf["rope_parameters"]
                         : nullptr;
  if (hf.contains("rope_theta") && hf["rope_theta"].is_number()) {
    out.rope_theta = hf["rope_theta"].get<double>();
  } else if (rope && rope->contains("rope_theta") && (*rope)["rope_theta"].is_number()) {
    out.rope_theta = (*rope)["rope_theta"].get<double>();
  }
  out.norm_eps = hf.value("rms_norm_eps", 1e-6);  // transformers' LlamaConfig default
  out.tie_embeddings = hf.value("tie_word_embeddings", false);
  if (hf.contains("initializer_range") && hf["initializer_range"].is_number()) {
    out.init_std = hf["initializer_range"].get<double>();
  }
  const json scaling = hf.contains("rope_scaling") ? hf["rope_scaling"] : json(nullptr);
  const std::string rope_type =
      rope ? rope->value("rope_type", std::string("default"))
           : (scaling.is_object() ? scaling.value("rope_type", scaling.value("type", "?")) : "");
  if ((!scaling.is_null() && !rope) || (rope && rope_type != "default")) {
    problem = fmt::format(
        "config.json has rope scaling (rope_type \"{}\"); kiln's llama has the default rope only",
        rope_type);
  } else if (hf.value("hidden_act", std::string("silu")) != "silu") {
    problem = fmt::format("config.json has hidden_act = \"{}\"; kiln's llama uses silu (SwiGLU)",
                          hf.value("hidden_act", std::string()));
  } else if (hf.value("attention_bias", false) || hf.value("mlp_bias", false)) {
    problem = "config.json has attention_bias or mlp_bias = true; kiln's llama has no biases";
  } else if (hf.value("pretraining_tp", 1) != 1) {
    problem = "config.json has pretraining_tp != 1; kiln's llama computes the projections whole";
  } else if (hf.contains("head_dim") && !hf["head_dim"].is_null() &&
             (!hf["head_dim"].is_number_integer() || out.n_embd % out.n_head != 0 ||
              hf["head_dim"].get<int64_t>() != out.n_embd / out.n_head)) {
    problem = fmt::format(
        "config.json has head_dim = {}, not hidden_size / num_attention_heads; kiln's llama "
        "derives the head size from the width",
        hf["head_dim"].dump());
  } else if (std::string shape = llama_shape_problem(out); !shape.empty()) {
    problem = "config.json's shape: " + shape;
  }
  return out;
}

std::string hf_llama_config_mismatch(const json& hf, const LlamaConfig& llama) {
  std::string problem;
  const LlamaConfig theirs = llama_config_from_hf(hf, problem);
  if (!problem.empty()) return problem;
  for (const IntField& f : kIntFields) {
    if (theirs.*f.field != llama.*f.field) {
      return fmt::format("config.json has {} = {} but the model has {} = {}: set {} = {}", f.hf,
                         theirs.*f.field, f.key, llama.*f.field, f.key, theirs.*f.field);
    }
  }
  if (!same(theirs.rope_theta, llama.rope_theta)) {
    return fmt::format(
        "config.json has rope_theta = {} but the model has model.rope_theta = {}: set "
        "model.rope_theta = {}",
        theirs.rope_theta, llama.rope_theta, theirs.rope_theta);
  }
  if (!same(theirs.norm_eps, llama.norm_eps)) {
    return fmt::format(
        "config.json has rms_norm_eps = {} but the model has model.norm_eps = {}: set "
        "model.norm_eps = {}",
        theirs.norm_eps, llama.norm_eps, theirs.norm_eps);
  }
  if (theirs.tie_embeddings != llama.tie_embeddings) {
    return fmt::format(
        "config.json has tie_word_embeddings = {} but the model has model.tie_embeddings = {}: "
        "set model.tie_embeddings = {}",
        theirs.tie_embeddings, llama.tie_embeddings, theirs.tie_embeddings);
  }
  return "";
}

std::optional<LlamaConfig> llama_config_from_hf_dir(const fs::path& dir) {
  const auto hf = try_read_hf_config(dir);
  if (!hf) return std::nullopt;
  std::string problem;
  LlamaConfig out = llama_config_from_hf(*hf, problem);
  if (!problem.empty()) return std::nullopt;
  return out;
}

void save_hf_llama(Model& model, const fs::path& out_dir, bool force) {
  const LlamaConfig llama = llama_shape_of(model, "export --format hf");
  prepare_hf_export_dir(out_dir, force);
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const auto& item : model.named_parameters()) {
    tensors.emplace_back(item.key(), item.value().detach().to(torch::kCPU).contiguous());
  }
  write_safetensors(out_dir / "model.safetensors", tensors, {{"format", "pt"}});
  write_file_atomic(out_dir / "config.json", hf_llama_config(llama).dump(2) + "\n");
}

json load_hf_llama(Model& model, const fs::path& dir, const std::string& key) {
  const LlamaConfig llama = llama_shape_of(model, key);
  const json hf_config = read_hf_config(dir, key);
  if (std::string mismatch = hf_llama_config_mismatch(hf_config, llama); !mismatch.empty()) {
    throw UserError(fmt::format("{} = \"{}\": {}", key, dir.string(), mismatch));
  }
  HfWeights weights = read_hf_weights(dir, key);
  for (auto it = weights.tensors.begin(); it != weights.tensors.end();) {
    // Rotary tables some versions saved as buffers; a tied head (it is embed_tokens).
    const bool skip = it->first.ends_with(".rotary_emb.inv_freq") ||
                      (llama.tie_embeddings && it->first == "lm_head.weight");
    it = skip ? weights.tensors.erase(it) : std::next(it);
  }
  copy_hf_weights(model, weights, dir, key, "LlamaForCausalLM", nullptr);
  return weights.revision;
}

}  // namespace kiln
