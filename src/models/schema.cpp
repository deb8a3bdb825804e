// The [model] section of the config schema and its rules: the shapes a model cannot be built with
// (checked by `kiln config validate` and before `kiln train` writes anything). model.name takes
// any registered model (kiln/models.h); the keys and rules of models registered before the schema
// is built join the section.
#include <fmt/format.h>

#include <algorithm>
#include <string>

#include "core/schema_sections.h"
#include "kiln/hf.h"
#include "kiln/models.h"
#include "models/internal.h"

namespace kiln {

namespace {

bool is_gpt(const Config& c) {
  return c.get_string("model.name") == "gpt";
}

bool is_llama(const Config& c) {
  return c.get_string("model.name") == "llama";
}

bool is_builtin_decoder(const Config& c) {
  return is_gpt(c) || is_llama(c);
}

// The decoder shape the rules check, whichever of the two decoders is configured.
struct DecoderShape {
  int64_t n_head, n_embd, block_size, vocab_size;
};

DecoderShape decoder_shape(const Config& c) {
  if (is_llama(c)) {
    const LlamaConfig l = llama_shape(c);
    return {l.n_head, l.n_embd, l.block_size, l.vocab_size};
  }
  const GptConfig g = gpt_shape(c);
  return {g.n_head, g.n_embd, g.block_size, g.vocab_size};
}

bool is_llama_preset(const std::string& preset) {
  return preset.starts_with("llama");
}

// An explicitly set (non-zero) shape key that disagrees with model.init_from's config.json: one
// line naming both values; "" when none does or the directory holds no shape of this model.
std::string init_from_shape_conflict(const Config& c) {
  const std::string& dir = c.get_string("model.init_from");
  struct Field {
    const char* key;
    const char* hf;
    int64_t theirs;
  };
  std::vector<Field> fields;
  if (is_gpt(c)) {
    const auto g = gpt_config_from_hf_dir(dir);
    if (!g) return "";
    fields = {{"model.n_layer", "n_layer", g->n_layer},
              {"model.n_head", "n_head", g->n_head},
              {"model.n_embd", "n_embd", g->n_embd},
              {"model.block_size", "n_positions", g->block_size},
              {"model.vocab_size", "vocab_size", g->vocab_size}};
  } else {
    const auto l = llama_config_from_hf_dir(dir);
    if (!l) return "";
    fields = {{"model.n_layer", "num_hidden_layers", l->n_layer},
              {"model.n_head", "num_attention_heads", l->n_head},
              {"model.n_kv_head", "num_key_value_heads", l->n_kv_head},
              {"model.n_embd", "hidden_size", l->n_embd},
              {"model.intermediate_size", "intermediate_size", l->intermediate_size},
              {"model.block_size", "max_position_embeddings", l->block_size},
              {"model.vocab_size", "vocab_size", l->vocab_size}};
  }
  for (const Field& f : fields) {
    const int64_t ours = c.get_int(f.key);
    if (ours > 0 && ours != f.theirs) {
      return fmt::format(
          "model.init_from = \"{}\": config.json has {} = {} but {} = {} is set; leave {} at 0 "
          "to take config.json's shape, or set {} = {}",
          dir, f.hf, f.theirs, f.key, ours, f.key, f.key, f.theirs);
    }
  }
  return "";
}

}  // namespace

ConfigSection model_section() {
  ConfigSection section{
      "model",
      {
          string_key("model", "name", "mlp", {},
                     "model architecture: a registered model (built in: mlp, gpt, llama; a C++ "
                     "model registers with kiln::register_model)"),
          int_key("model", "input_dim", 100, 1, 1e7, "mlp: input features"),
          int_key("model", "hidden_dim", 256, 1, 1e7, "mlp: hidden units"),
          int_key("model", "num_classes", 10, 2, 1e7, "mlp: output classes"),
          bool_key("model", "data_dependent_branch", false,
                   "mlp: a test model for graph breaks: relu when the batch's inputs sum > 0, "
                   "else tanh (a host sync each step)"),
          string_key("model", "preset", "tiny",
                     {"tiny", "small", "gpt2-124m", "llama-tiny", "llama-small", "llama3-8b"},
                     "gpt, llama: size preset: tiny and small are each model's own (gpt ~1M and "
                     "~10M, llama ~1M and ~19M); gpt2-124m (gpt); llama-tiny, llama-small, "
                     "llama3-8b (llama); ignored with model.init_from"),
          int_key("model", "n_layer", 0, 0, 1000, "gpt, llama: transformer blocks (0 = preset)"),
          int_key("model", "n_head", 0, 0, 1000, "gpt, llama: attention heads (0 = preset)"),
          int_key("model", "n_kv_head", 0, 0, 1000,
                  "llama: key/value heads of grouped-query attention (0 = preset)"),
          int_key("model", "n_embd", 0, 0, 1e6, "gpt, llama: embedding width (0 = preset)"),
          int_key("model", "intermediate_size", 0, 0, 1e7, "llama: SwiGLU MLP width (0 = preset)"),
          int_key("model", "block_size", 0, 0, 1e7,
                  "gpt, llama: maximum sequence length (0 = preset)"),
          int_key("model", "vocab_size", 0, 0, 1e7,
                  "gpt, llama: vocabulary size (0 = preset; byte text needs >= 256)"),
          float_key("model", "rope_theta", 0.0, 0.0, 1e12,
                    "llama: rotary embedding base (0 = preset: 10000, llama3-8b 500000)"),
          float_key("model", "norm_eps", 0.0, 0.0, 1.0, "llama: RMSNorm epsilon (0 = 1e-5)"),
          bool_key("model", "tie_embeddings", false,
                   "llama: the head shares model.embed_tokens.weight (no lm_head.weight)"),
          string_key("model", "revision", "", {},
                     "free text naming the model's source revision (e.g. a hub commit), "
                     "recorded in the manifest and checked by kiln pilot --check-pins"),
          float_key("model", "init_std", 0.02, 0.0, 10.0,
                    "gpt, llama: std of the normal init (residual projections scaled by "
                    "1/sqrt(2*n_layer))"),
          string_key("model", "init_from", "", {},
                     "gpt, llama: a Hugging Face GPT2LMHeadModel or LlamaForCausalLM directory "
                     "(config.json + model.safetensors or a sharded index) to start from instead "
                     "of the random init; the shape comes from its config.json "
                     "(docs/models.md)"),
      },
      {
          {"model.name names a registered model",
           [](const Config& c) -> std::string {
             const std::string& name = c.get_string("model.name");
             return find_model(name) ? "" : unknown_model_problem(name);
           },
           {"model.name=nonexistent"}},
          {"gpt, llama: model.n_embd must be divisible by model.n_head (llama: into an even "
           "head size)",
           [](const Config& c) -> std::string {
             if (is_llama(c)) {
               const LlamaConfig l = llama_shape(c);
               if (l.n_embd % l.n_head == 0 && l.head_dim() % 2 == 0) return "";
               return llama_shape_problem(l);
             }
             if (!is_gpt(c)) return "";
             const GptConfig gpt = gpt_shape(c);
             if (gpt.n_embd % gpt.n_head == 0) return "";
             return "model.n_embd = " + std::to_string(gpt.n_embd) +
                    " is not divisible by model.n_head = " + std::to_string(gpt.n_head) +
                    "; pick a head count that divides the width";
           },
           {"model.name=gpt", "data.name=text", "model.n_head=3"}},
          {"llama: model.n_head must be a multiple of model.n_kv_head",
           [](const Config& c) -> std::string {
             if (!is_llama(c)) return "";
             const LlamaConfig l = llama_shape(c);
             if (l.n_embd % l.n_head != 0 || l.n_head % l.n_kv_head == 0) return "";
             return llama_shape_problem(l);
           },
           {"model.name=llama", "data.name=text", "model.n_kv_head=3"}},
          {"gpt, llama: model.preset names a preset of model.name",
           [](const Config& c) -> std::string {
             const std::string& preset = c.get_string("model.preset");
             if (!c.get_string("model.init_from").empty()) return "";
             if (is_gpt(c) && is_llama_preset(preset)) {
               return "model.preset = \"" + preset +
                      "\" is a llama preset; model.name = \"gpt\" takes tiny, small or "
                      "gpt2-124m";
             }
             if (is_llama(c) && preset == "gpt2-124m") {
               return "model.preset = \"gpt2-124m\" is a gpt preset; model.name = \"llama\" "
                      "takes tiny, small, llama-tiny, llama-small or llama3-8b";
             }
             return "";
           },
           {"model.name=llama", "data.name=text", "model.preset=gpt2-124m"}},
          {"gpt, llama: data.seq_len must not exceed the model's block_size",
           [](const Config& c) -> std::string {
             if (!is_builtin_decoder(c)) return "";
             const DecoderShape shape = decoder_shape(c);
             const int64_t seq_len = c.get_int("data.seq_len");
             if (seq_len <= shape.block_size) return "";
             return "data.seq_len = " + std::to_string(seq_len) +
                    " exceeds the model's block_size " + std::to_string(shape.block_size) +
                    "; lower data.seq_len or raise model.block_size";
           },
           {"model.name=gpt", "data.name=text", "data.seq_len=512"}},
          {"gpt, llama on data.name = \"text\": the vocabulary holds the 256 byte values",
           [](const Config& c) -> std::string {
             if (!is_builtin_decoder(c) || c.get_string("data.name") != "text") return "";
             const DecoderShape shape = decoder_shape(c);
             if (shape.vocab_size >= 256) return "";
             return "model.vocab_size = " + std::to_string(shape.vocab_size) +
                    " is smaller than the 256 byte values of data.name = \"text\"; set it to "
                    "256 or more";
           },
           {"model.name=gpt", "data.name=text", "model.vocab_size=100"}},
          {"dist.tp > 1 needs a model with a tensor-parallel plan (gpt, llama) whose shape "
           "splits over dist.tp ranks",
           [](const Config& c) -> std::string {
             const int64_t tp = c.get_int("dist.tp");
             const ModelSpec* spec = find_model(c.get_string("model.name"));
             if (tp <= 1 || !spec) return "";
             if (!spec->tensor_parallel_problem) {
               return fmt::format(
                   "dist.tp = {} splits each layer over {} ranks, but model.name = \"{}\" "
                   "declares no tensor-parallel plan; set dist.tp = 1 (model.name = \"gpt\" "
                   "and \"llama\" have one)",
                   tp, tp, spec->name);
             }
             return spec->tensor_parallel_problem(c, tp);
           },
           {"dist.tp=2"}},
          {"model.init_from needs a model with Hugging Face import (gpt, llama)",
           [](const Config& c) -> std::string {
             const ModelSpec* spec = find_model(c.get_string("model.name"));
             if (!spec || spec->load_hf || c.get_string("model.init_from").empty()) return "";
             return "model.init_from loads Hugging Face weights, which model.name = \"" +
                    spec->name + "\" cannot take; set model.name = \"gpt\" or \"llama\"";
           },
           {"model.init_from=/tmp/gpt2"}},
          {"model.init_from: its config.json is of model.name's architecture, and the shape keys "
           "set agree with it",
           [](const Config& c) -> std::string {
             const std::string& dir = c.get_string("model.init_from");
             if (!is_builtin_decoder(c) || dir.empty()) return "";
             try {
               const nlohmann::json hf = read_hf_config(dir, "model.init_from");
               const std::string theirs = hf_model_name(hf);
               const std::string& ours = c.get_string("model.name");
               if (theirs != ours) {
                 return fmt::format("model.init_from = \"{}\" holds model_type {}{}", dir,
                                    hf.contains("model_type") ? hf["model_type"].dump() : "(none)",
                                    theirs.empty()
                                        ? "; kiln reads GPT-2 (gpt2) and Llama (llama) directories"
                                        : fmt::format("; set model.name = \"{}\"", theirs));
               }
               if (std::string conflict = init_from_shape_conflict(c); !conflict.empty()) {
                 return conflict;
               }
               const std::string mismatch = is_gpt(c)
                                                ? hf_gpt2_config_mismatch(hf, gpt_shape(c))
                                                : hf_llama_config_mismatch(hf, llama_shape(c));
               return mismatch.empty() ? "" : "model.init_from = \"" + dir + "\": " + mismatch;
             } catch (const std::exception& e) {
               return e.what();
             }
           },
           {"model.name=gpt", "data.name=text", "model.init_from=/nonexistent/gpt2"}},
      }};
  // The keys and rules of the registered models (the built-ins declare theirs above).
  for (const ModelSpec* spec : specs_for_schema())
    add_registered_keys(section, spec->keys, spec->rules);
  return section;
}

}  // namespace kiln
