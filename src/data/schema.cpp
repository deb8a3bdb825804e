// The [data] section of the config schema and its rules: which model trains on which data, and
// the sizes a dataset needs (checked by `kiln config validate` and before `kiln train` writes
// anything).
#include <algorithm>
#include <string>

#include "core/schema_sections.h"
#include "data/internal.h"
#include "kiln/dataset_registry.h"
#include "kiln/models.h"

namespace kiln {

ConfigSection data_section() {
  ConfigSection section = {
      "data",
      {
          string_key("data", "name", "synthetic", {},
                     "dataset: synthetic teacher task, text file bytes, token .bin files, or a "
                     "registered one (a C++ dataset registers with kiln::register_dataset)"),
          string_key("data", "path", "", {},
                     "text: a file or directory (default: Debian's fortunes corpus); tokens: the "
                     "train .bin, or a directory written by kiln data prepare (docs/data.md)"),
          string_key("data", "val_path", "", {},
                     "tokens: validation .bin (default: split data.path by data.val_fraction)"),
          string_key("data", "revision", "", {},
                     "free text naming the data's revision, recorded beside its content hash in "
                     "the manifest (kiln pilot --check-pins names a revision whose hash changed)"),
          string_key("data", "format", "auto", {"auto", "nanogpt", "llmc"},
                     "tokens: file format (auto = llm.c when its magic is present)"),
          float_key("data", "val_fraction", 0.1, 0.0, 0.9,
                    "share of the data held out for validation (the tail of the file)"),
          int_key("data", "seq_len", 64, 1, 1e7, "text/tokens: tokens per sample"),
          int_key("data", "num_samples", 8192, 1, 1e9, "synthetic: training samples"),
          int_key("data", "val_samples", 1024, 1, 1e9, "synthetic: validation samples"),
          int_key("data", "teacher_hidden", 4, 1, 1e6,
                  "synthetic: hidden units of the random teacher network"),
          int_key("data", "seed", 0, 0, 9.2e18,
                  "seed for data generation and shuffling (0 = run.seed)"),
          bool_key("data", "shuffle", true,
                   "reshuffle the training samples every epoch (by data seed and epoch)"),
          int_key("data", "num_workers", 2, 0, 256,
                  "background loader threads (0 = load in the training thread)"),
          int_key("data", "prefetch", 4, 1, 1024,
                  "batches the loader may prepare ahead of the training step"),
      },
      {
          {"data.name is synthetic, text, tokens or a registered dataset",
           [](const Config& c) -> std::string {
             const std::string& name = c.get_string("data.name");
             const auto names = dataset_names();
             if (std::find(names.begin(), names.end(), name) != names.end()) return "";
             std::string list;
             for (const auto& known : names) list += (list.empty() ? "" : ", ") + known;
             return "data.name = \"" + name + "\" is not a dataset; the known ones: " + list +
                    " (a C++ dataset registers with kiln::register_dataset, docs/models.md)";
           },
           {"data.name=nonexistent"}},
          {"model.name = \"mlp\" trains on feature vectors (synthetic or a registered dataset), "
           "not "
           "text or tokens",
           [](const Config& c) -> std::string {
             const std::string& data = c.get_string("data.name");
             if (c.get_string("model.name") != "mlp" || (data != "text" && data != "tokens"))
               return "";  // synthetic, or a registered dataset of feature vectors
             return "model.name = \"mlp\" trains on data.name = \"synthetic\"; set data.name = "
                    "\"synthetic\" or model.name = \"gpt\"";
           },
           {"data.name=text"}},
          {"a token model (gpt, llama) trains on token data (text or tokens)",
           [](const Config& c) -> std::string {
             if (!model_takes_tokens(c) || c.get_string("data.name") != "synthetic") return "";
             return "model.name = \"" + c.get_string("model.name") +
                    "\" needs token data; set data.name = \"text\" or \"tokens\"";
           },
           {"model.name=gpt"}},
          {"text and tokens need validation data: data.val_fraction > 0 (or tokens' "
           "data.val_path)",
           [](const Config& c) -> std::string {
             const std::string& data = c.get_string("data.name");
             if (data == "synthetic" || c.get_float("data.val_fraction") != 0 ||
                 (data == "tokens" && !c.get_string("data.val_path").empty()))
               return "";
             return std::string(
                        "data.val_fraction = 0 leaves no validation data; set it in "
                        "(0, 0.9]") +
                    (data == "tokens" ? " or give data.val_path" : "");
           },
           {"model.name=gpt", "data.name=text", "data.val_fraction=0"}},
          {"data.name = \"tokens\" needs data.path",
           [](const Config& c) -> std::string {
             if (c.get_string("data.name") != "tokens" || !c.get_string("data.path").empty())
               return "";
             return "data.name = \"tokens\" needs data.path = \"<train .bin file>\"";
           },
           {"model.name=gpt", "data.name=tokens"}},
          {"synthetic: data.num_samples holds at least one batch (train.batch_size)",
           [](const Config& c) -> std::string {
             const int64_t samples = c.get_int("data.num_samples");
             const int64_t batch = c.get_int("train.batch_size");
             if (c.get_string("data.name") != "synthetic" || samples >= batch) return "";
             return "data.num_samples = " + std::to_string(samples) +
                    " is fewer than one batch (train.batch_size = " + std::to_string(batch) +
                    "); raise data.num_samples or lower train.batch_size";
           },
           {"data.num_samples=16"}},
          {"synthetic: data.val_samples holds at least one batch (train.batch_size)",
           [](const Config& c) -> std::string {
             const int64_t samples = c.get_int("data.val_samples");
             const int64_t batch = c.get_int("train.batch_size");
             if (c.get_string("data.name") != "synthetic" || samples >= batch) return "";
             return "data.val_samples = " + std::to_string(samples) +
                    " is fewer than one batch (train.batch_size = " + std::to_string(batch) +
                    "); raise data.val_samples or lower train.batch_size";
           },
           {"data.val_samples=16"}},
      }};
  // The keys and rules of the registered datasets (the built-ins declare theirs above).
  for (const DatasetSpec* spec : dataset_specs_for_schema())
    add_registered_keys(section, spec->keys, spec->rules);
  return section;
}

}  // namespace kiln
