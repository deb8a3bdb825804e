// Hugging Face interop (kiln/hf.h): the directory machinery both architectures share (weight
// files, sharded index, revision, checked copy, export directory) and GPT-2's own: config.json <->
// GptConfig, kiln's nn.Linear weights <-> Hugging Face's Conv1D layout. Llama: models/hf_llama.cpp.
#include "kiln/hf.h"

#include <fmt/format.h>
#include <nettle/sha2.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include "core/files.h"
#include "core/strings.h"
#include "kiln/error.h"
#include "kiln/safetensors.h"
#include "models/internal.h"

namespace kiln {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr double kLayerNormEpsilon = 1e-5;  // torch::nn::LayerNorm's default, kiln's gpt

// Hugging Face keeps these four as Conv1D, weight [in, out]; kiln as nn.Linear, [out, in].
bool is_conv1d_weight(const std::string& name) {
  for (const char* suffix :
       {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"}) {
    if (name.ends_with(suffix)) return true;
  }
  return false;
}

GptConfig gpt_shape_of(const Model& model, const std::string& what) {
  if (model.architecture() != "gpt") {
    throw UserError(
        fmt::format("{}: the model is {}; Hugging Face GPT-2 interop needs model.name "
                    "= \"gpt\"",
                    what, model.architecture()));
  }
  const json d = model.describe();
  GptConfig out;
  out.n_layer = d.at("n_layer").get<int64_t>();
  out.n_head = d.at("n_head").get<int64_t>();
  out.n_embd = d.at("n_embd").get<int64_t>();
  out.block_size = d.at("block_size").get<int64_t>();
  out.vocab_size = d.at("vocab_size").get<int64_t>();
  out.init_std = d.at("init_std").get<double>();
  return out;
}

// A config.json field as an integer, or nullopt when absent or not an integer.
std::optional<int64_t> int_field(const json& config, const char* name) {
  if (!config.contains(name) || !config[name].is_number_integer()) return std::nullopt;
  return config[name].get<int64_t>();
}

bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name.find('/') == std::string::npos && name != "." && name != "..";
}

// The weight files of a Hugging Face directory: model.safetensors, else the shards its index
// lists (sorted, each once).
std::vector<std::string> weight_files(const fs::path& dir, const std::string& key) {
  std::error_code ec;
  if (fs::is_regular_file(dir / "model.safetensors", ec)) return {"model.safetensors"};
  const fs::path index_path = dir / "model.safetensors.index.json";
  if (!fs::is_regular_file(index_path, ec)) {
    throw UserError(fmt::format(
        "{} = \"{}\": neither model.safetensors nor model.safetensors.index.json is there; save "
        "the model with save_pretrained(dir) (safetensors; kiln never reads pytorch_model.bin)",
        key, dir.string()));
  }
  const json index = json::parse(read_file(index_path), nullptr, /*allow_exceptions=*/false);
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    throw UserError(
        fmt::format("{}: {} has no \"weight_map\" object; re-save the model with "
                    "save_pretrained",
                    key, index_path.string()));
  }
  std::set<std::string> files;
  for (const auto& [tensor, file] : index["weight_map"].items()) {
    if (!file.is_string() || !is_plain_file_name(file.get<std::string>())) {
      throw UserError(fmt::format("{}: {} maps {} to {}, not a file name in that directory", key,
                                  index_path.string(), tensor, file.dump()));
    }
    files.insert(file.get<std::string>());
  }
  return {files.begin(), files.end()};
}

// Hugging Face's name for a tensor as kiln names it: GPT2Model saves without "transformer.".
std::string with_transformer_prefix(const std::string& name) {
  if (name.starts_with("transformer.") || name.starts_with("lm_head.")) return name;
  return "transformer." + name;
}

bool is_skipped_buffer(const std::string& name) {
  return name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias");
}

}  // namespace

json hf_gpt2_config(const GptConfig& gpt) {
  return {{"architectures", json::array({"GPT2LMHeadModel"})},
          {"model_type", "gpt2"},
          {"n_layer", gpt.n_layer},
          {"n_head", gpt.n_head},
          {"n_embd", gpt.n_embd},
          {"n_positions", gpt.block_size},
          {"n_ctx", gpt.block_size},
          {"vocab_size", gpt.vocab_size},
          {"n_inner", nullptr},
          {"activation_function", "gelu_new"},
          {"layer_norm_epsilon", kLayerNormEpsilon},
          {"resid_pdrop", 0.0},
          {"embd_pdrop", 0.0},
          {"attn_pdrop", 0.0},
          {"initializer_range", gpt.init_std},
          {"tie_word_embeddings", true},
          {"scale_attn_weights", true},
          {"scale_attn_by_inverse_layer_idx", false},
          {"reorder_and_upcast_attn", false},
          {"add_cross_attention", false},
          {"torch_dtype", "float32"}};
}

std::string hf_gpt2_config_mismatch(const json& hf, const GptConfig& gpt) {
  if (hf.contains("model_type") && hf["model_type"] != "gpt2") {
    return fmt::format("config.json has model_type = {}; kiln's gpt reads GPT-2 (\"gpt2\")",
                       hf["model_type"].dump());
  }
  struct Field {
    const char* hf;
    const char* key;
    int64_t kiln;
  };
  for (const Field& f :
       {Field{"n_layer", "model.n_layer", gpt.n_layer}, Field{"n_head", "model.n_head", gpt.n_head},
        Field{"n_embd", "model.n_embd", gpt.n_embd},
        Field{"n_positions", "model.block_size", gpt.block_size},
        Field{"vocab_size", "model.vocab_size", gpt.vocab_size}}) {
    const auto value = int_field(hf, f.hf);
    if (!value) return fmt::format("config.json has no integer {}", f.hf);
    if (*value != f.kiln) {
      return fmt::format("config.json has {} = {} but the model has {} = {}: set {} = {}", f.hf,
                         *value, f.key, f.kiln, f.key, *value);
    }
  }
  const std::string activation = hf.value("activation_function", std::string("gelu_new"));
  if (activation != "gelu_new" && activation != "gelu_pytorch_tanh") {
    return fmt::format(
        "config.json has activation_function = \"{}\"; kiln's gpt uses gelu_new (tanh)",
        activation);
  }
  const double epsilon = hf.value("layer_norm_epsilon", kLayerNormEpsilon);
  if (std::abs(epsilon - kLayerNormEpsilon) > 1e-12) {
    return fmt::format("config.json has layer_norm_epsilon = {}; kiln's gpt uses {}", epsilon,
                       kLayerNormEpsilon);
  }
  if (hf.contains("n_inner") && !hf["n_inner"].is_null() && hf["n_inner"] != 4 * gpt.n_embd) {
    return fmt::format("config.json has n_inner = {}; kiln's gpt has 4 * n_embd = {}",
                       hf["n_inner"].dump(), 4 * gpt.n_embd);
  }
  if (!hf.value("tie_word_embeddings", true)) {
    return "config.json has tie_word_embeddings = false; kiln's gpt ties its head to wte";
  }
  for (const char* flag :
       {"add_cross_attention", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"}) {
    if (hf.value(flag, false)) {
      return fmt::format("config.json has {} = true; kiln's gpt does not have it", flag);
    }
  }
  if (!hf.value("scale_attn_weights", true)) {
    return "config.json has scale_attn_weights = false; kiln's gpt scales by 1/sqrt(head size)";
  }
  return "";
}

json read_hf_config(const fs::path& dir, const std::string& key) {
  const fs::path path = dir / "config.json";
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) {
    throw UserError(
        fmt::format("{} = \"{}\": no config.json there; point it at a Hugging Face model "
                    "directory (save_pretrained)",
                    key, dir.string()));
  }
  const json config = json::parse(read_file(path), nullptr, /*allow_exceptions=*/false);
  if (!config.is_object()) {
    throw UserError(fmt::format("{}: {} is not a JSON object", key, path.string()));
  }
  return config;
}

void prepare_hf_export_dir(const fs::path& out_dir, bool force) {
  std::error_code ec;
  if (fs::exists(out_dir, ec) && !fs::is_directory(out_dir, ec)) {
    throw UserError(fmt::format("export: {} is a file; give a directory", out_dir.string()));
  }
  if (fs::is_directory(out_dir, ec) && !fs::is_empty(out_dir, ec)) {
    if (!force) {
      throw UserError(
          fmt::format("export: {} is not empty; pick an empty or new directory, or "
                      "pass --force to replace an earlier export there",
                      out_dir.string()));
    }
    for (const auto& entry : fs::directory_iterator(out_dir)) {
      const std::string name = entry.path().filename().string();
      if (name == "config.json" || name == "model.safetensors.index.json" ||
          name.ends_with(".safetensors") || is_hf_generation_file(name)) {
        fs::remove(entry.path(), ec);
      }
    }
  }
  fs::create_directories(out_dir, ec);
  if (ec) {
    throw UserError(fmt::format("export: cannot create {}: {}", out_dir.string(), ec.message()));
  }
}

void save_hf_gpt2(Model& model, const fs::path& out_dir, bool force) {
  const GptConfig gpt = gpt_shape_of(model, "export --format hf");
  prepare_hf_export_dir(out_dir, force);
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const auto& item : model.named_parameters()) {
    torch::Tensor t = item.value().detach().to(torch::kCPU);
    if (is_conv1d_weight(item.key())) t = t.t();  // [out, in] -> Conv1D [in, out]
    tensors.emplace_back(item.key(), t.contiguous());
  }
  write_safetensors(out_dir / "model.safetensors", tensors, {{"format", "pt"}});
  write_file_atomic(out_dir / "config.json", hf_gpt2_config(gpt).dump(2) + "\n");
}

HfWeights read_hf_weights(const fs::path& dir, const std::string& key) {
  HfWeights out;
  out.revision = {{"path", fs::absolute(dir).lexically_normal().string()},
                  {"config_sha256", sha256_file(dir / "config.json")},
                  {"files", json::array()}};
  for (const std::string& file : weight_files(dir, key)) {
    const fs::path path = dir / file;
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) {
      throw UserError(fmt::format("{}: {} lists {}, which is missing", key,
                                  (dir / "model.safetensors.index.json").string(), file));
    }
    out.revision["files"].push_back({{"file", file},
                                     {"bytes", static_cast<int64_t>(fs::file_size(path))},
                                     {"sha256", sha256_file(path)}});
    for (auto& [name, tensor] : read_safetensors(path)) {
      out.tensors[name] = {file, std::move(tensor)};
    }
  }
  return out;
}

void copy_hf_weights(Model& model, HfWeights& weights, const fs::path& dir, const std::string& key,
                     const std::string& what,
                     const std::function<bool(const std::string&)>& transposed) {
  auto& found = weights.tensors;
  // Check everything before copying anything.
  std::vector<std::pair<torch::Tensor, torch::Tensor>> copies;  // (parameter, value in kiln layout)
  for (const auto& item : model.named_parameters()) {
    const std::string& name = item.key();
    auto it = found.find(name);
    if (it == found.end()) {
      throw UserError(
          fmt::format("{} = \"{}\": no tensor {} in its weight files; the directory "
                      "does not hold a complete {} of this shape",
                      key, dir.string(), name, what));
    }
    const auto& [file, tensor] = it->second;
    std::vector<int64_t> want = item.value().sizes().vec();
    const bool swap = transposed && transposed(name);
    if (swap) std::swap(want[0], want[1]);  // stored [in, out]
    if (tensor.sizes().vec() != want) {
      throw UserError(fmt::format(
          "{} = \"{}\": tensor {} in {} has shape {}, the model needs {} (Hugging Face layout); "
          "the first mismatching tensor: check the directory's config.json against its weights",
          key, dir.string(), name, file, shape_text(tensor.sizes().vec()), shape_text(want)));
    }
    if (!at::isFloatingType(tensor.scalar_type())) {
      throw UserError(fmt::format("{} = \"{}\": tensor {} in {} has dtype {}, not a float type",
                                  key, dir.string(), name, file,
                                  c10::toString(tensor.scalar_type())));
    }
    copies.emplace_back(item.value(), swap ? tensor.t() : tensor);
    found.erase(it);
  }
  if (!found.empty()) {
    const auto& [name, entry] = *found.begin();
    throw UserError(
        fmt::format("{} = \"{}\": unexpected tensor {} in {} ({} unexpected in all); "
                    "kiln's {} has no such parameter",
                    key, dir.string(), name, entry.first, found.size(), model.architecture()));
  }
  torch::NoGradGuard no_grad;
  for (auto& [parameter, value] : copies) parameter.copy_(value);
}

json load_hf_gpt2(Model& model, const fs::path& dir, const std::string& key) {
  const GptConfig gpt = gpt_shape_of(model, key);
  const json hf_config = read_hf_config(dir, key);
  if (std::string mismatch = hf_gpt2_config_mismatch(hf_config, gpt); !mismatch.empty()) {
    throw UserError(fmt::format("{} = \"{}\": {}", key, dir.string(), mismatch));
  }
  HfWeights weights = read_hf_weights(dir, key);
  // By kiln's (GPT2LMHeadModel) name: GPT2Model saves without "transformer.".
  HfWeights renamed{std::move(weights.revision), {}};
  for (auto& [name, entry] : weights.tensors) {
    if (is_skipped_buffer(name)) continue;
    renamed.tensors[with_transformer_prefix(name)] = std::move(entry);
  }
  renamed.tensors.erase(
      "lm_head.weight");  // tied to transformer.wte.weight (checked by the config)
  copy_hf_weights(model, renamed, dir, key, "GPT-2", is_conv1d_weight);
  return renamed.revision;
}

std::optional<json> try_read_hf_config(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_regular_file(dir / "config.json", ec)) return std::nullopt;
  try {
    json config = json::parse(read_file(dir / "config.json"), nullptr, /*allow_exceptions=*/false);
    if (!config.is_object()) return std::nullopt;
    return config;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

std::string hf_model_name(const json& hf_config) {
  const std::string type = hf_config.value("model_type", std::string());
  if (type == "gpt2") return "gpt";
  if (type == "llama") return "llama";
  return "";
}

std::optional<GptConfig> gpt_config_from_hf_dir(const fs::path& dir) {
  const auto hf = try_read_hf_config(dir);
  if (!hf || (hf->contains("model_type") && hf_model_name(*hf) != "gpt")) return std::nullopt;
  GptConfig out;
  for (auto [field, value] :
       {std::pair{"n_layer", &out.n_layer}, std::pair{"n_head", &out.n_head},
        std::pair{"n_embd", &out.n_embd}, std::pair{"n_positions", &out.block_size},
        std::pair{"vocab_size", &out.vocab_size}}) {
    const auto v = int_field(*hf, field);
    if (!v || *v <= 0) return std::nullopt;
    *value = *v;
  }
  return out;
}

void save_hf(Model& model, const fs::path& out_dir, bool force) {
  const ModelSpec* spec = find_model(model.architecture());
  if (!spec || !spec->save_hf) {
    throw UserError(fmt::format(
        "export --format hf: model \"{}\" has no Hugging Face export (gpt and llama have)",
        model.architecture()));
  }
  spec->save_hf(model, out_dir, force);
}

json load_hf(Model& model, const fs::path& dir, const std::string& key) {
  const ModelSpec* spec = find_model(model.architecture());
  if (!spec || !spec->load_hf) {
    throw UserError(
        fmt::format("{}: model \"{}\" cannot load Hugging Face weights (gpt and llama can)", key,
                    model.architecture()));
  }
  return spec->load_hf(model, dir, key);
}

std::string sha256_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UserError("cannot read " + path.string() + ": " + errno_text());
  sha256_ctx ctx;
  sha256_init(&ctx);
  std::vector<char> buffer(1 << 20);
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    const auto n = in.gcount();
    if (n > 0)
      sha256_update(&ctx, static_cast<size_t>(n), reinterpret_cast<uint8_t*>(buffer.data()));
  }
  if (in.bad()) throw UserError("cannot read " + path.string() + ": " + errno_text());
  uint8_t digest[SHA256_DIGEST_SIZE];
  sha256_digest(&ctx, SHA256_DIGEST_SIZE, digest);
  std::string hex;
  for (uint8_t byte : digest) hex += fmt::format("{:02x}", byte);
  return hex;
}

}  // namespace kiln
