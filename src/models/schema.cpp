// The [model] section of the config schema and its rules: the shapes a model cannot be built with
// (checked by `kiln config validate` and before `kiln train` writes anything).
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

}  // namespace

ConfigSection model_section() {
  return {
      "model",
      {
          string_key("model", "name", "mlp", {"mlp", "gpt"}, "model architecture"),
          int_key("model", "input_dim", 100, 1, 1e7, "mlp: input features"),
          int_key("model", "hidden_dim", 256, 1, 1e7, "mlp: hidden units"),
          int_key("model", "num_classes", 10, 2, 1e7, "mlp: output classes"),
          bool_key("model", "data_dependent_branch", false,
                   "mlp: a test model for graph breaks: relu when the batch's inputs sum > 0, "
                   "else tanh (a host sync each step)"),
          string_key("model", "preset", "tiny", {"tiny", "small", "gpt2-124m"},
                     "gpt: size preset (tiny ~1M, small ~10M, gpt2-124m)"),
          int_key("model", "n_layer", 0, 0, 1000, "gpt: transformer blocks (0 = preset)"),
          int_key("model", "n_head", 0, 0, 1000, "gpt: attention heads (0 = preset)"),
          int_key("model", "n_embd", 0, 0, 1e6, "gpt: embedding width (0 = preset)"),
          int_key("model", "block_size", 0, 0, 1e7, "gpt: maximum sequence length (0 = preset)"),
          int_key("model", "vocab_size", 0, 0, 1e7,
                  "gpt: vocabulary size (0 = preset; byte text needs >= 256)"),
          string_key("model", "revision", "", {},
                     "free text naming the model's source revision (e.g. a hub commit), "
                     "recorded in the manifest and checked by kiln pilot --check-pins"),
          float_key(
              "model", "init_std", 0.02, 0.0, 10.0,
              "gpt: std of the normal init (residual projections scaled by 1/sqrt(2*n_layer))"),
          string_key("model", "init_from", "", {},
                     "gpt: a Hugging Face GPT-2 directory (config.json + model.safetensors or a "
                     "sharded index) to start from instead of the random init; its config must "
                     "match the model.* shape (docs/models.md)"),
      },
      {
          {"gpt: model.n_embd must be divisible by model.n_head",
           [](const Config& c) -> std::string {
             if (!is_gpt(c)) return "";
             const GptConfig gpt = gpt_shape(c);
             if (gpt.n_embd % gpt.n_head == 0) return "";
             return "model.n_embd = " + std::to_string(gpt.n_embd) +
                    " is not divisible by model.n_head = " + std::to_string(gpt.n_head) +
                    "; pick a head count that divides the width";
           },
           {"model.name=gpt", "data.name=text", "model.n_head=3"}},
          {"gpt: data.seq_len must not exceed the model's block_size",
           [](const Config& c) -> std::string {
             if (!is_gpt(c)) return "";
             const GptConfig gpt = gpt_shape(c);
             const int64_t seq_len = c.get_int("data.seq_len");
             if (seq_len <= gpt.block_size) return "";
             return "data.seq_len = " + std::to_string(seq_len) +
                    " exceeds the model's block_size " + std::to_string(gpt.block_size) +
                    "; lower data.seq_len or raise model.block_size";
           },
           {"model.name=gpt", "data.name=text", "data.seq_len=512"}},
          {"gpt on data.name = \"text\": the vocabulary holds the 256 byte values",
           [](const Config& c) -> std::string {
             if (!is_gpt(c) || c.get_string("data.name") != "text") return "";
             const GptConfig gpt = gpt_shape(c);
             if (gpt.vocab_size >= 256) return "";
             return "model.vocab_size = " + std::to_string(gpt.vocab_size) +
                    " is smaller than the 256 byte values of data.name = \"text\"; set it to "
                    "256 or more";
           },
           {"model.name=gpt", "data.name=text", "model.vocab_size=100"}},
          {"model.init_from needs model.name = \"gpt\"",
           [](const Config& c) -> std::string {
             if (is_gpt(c) || c.get_string("model.init_from").empty()) return "";
             return "model.init_from loads Hugging Face GPT-2 weights; set model.name = \"gpt\"";
           },
           {"model.init_from=/tmp/gpt2"}},
          {"model.init_from: its config.json matches the model.* shape",
           [](const Config& c) -> std::string {
             const std::string& dir = c.get_string("model.init_from");
             if (!is_gpt(c) || dir.empty()) return "";
             try {
               const std::string mismatch =
                   hf_gpt2_config_mismatch(read_hf_config(dir, "model.init_from"), gpt_shape(c));
               return mismatch.empty() ? "" : "model.init_from = \"" + dir + "\": " + mismatch;
             } catch (const std::exception& e) {
               return e.what();
             }
           },
           {"model.name=gpt", "data.name=text", "model.init_from=/nonexistent/gpt2"}},
      }};
}

}  // namespace kiln
