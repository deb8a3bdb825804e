// Generation metadata of a Hugging Face export (kiln/hf.h write_hf_generation_files): the end of
// document token as bos/eos and the tokenizer the model trained with, from the run's records.
#include <fmt/format.h>

#include <array>
#include <optional>

#include "core/files.h"
#include "kiln/hf.h"
#include "kiln/log.h"
#include "models/internal.h"

namespace kiln {

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// A Hugging Face model directory's tokenizer files (fast and slow tokenizers' both).
constexpr std::array<const char*, 6> kTokenizerFiles = {
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt",     "tokenizer.model"};

json read_json_object(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return nullptr;
  json value = json::parse(read_file(path), nullptr, /*allow_exceptions=*/false);
  return value.is_object() ? value : json(nullptr);
}

// What the export carries: the end token (id and text) and the tokenizer files to copy.
struct Generation {
  json bos_id = nullptr, eos_id = nullptr;
  std::optional<std::string> eos_token;  // for a tokenizer_config.json written here
  std::vector<fs::path> files;           // copied under their own names
  std::string said;                      // what was carried, from where
};

// The corpus kiln data prepare wrote, as the run's manifest records it (data.prepared.dir).
std::optional<Generation> from_prepared_corpus(const json& run_manifest) {
  if (!run_manifest.is_object()) return std::nullopt;
  const json data = run_manifest.value("data", json::object());
  if (!data.is_object() || !data.contains("prepared") || !data["prepared"].is_object() ||
      !data["prepared"].value("dir", json()).is_string()) {
    return std::nullopt;
  }
  const fs::path corpus = data["prepared"]["dir"].get<std::string>();
  const json prepared = read_json_object(corpus / "data.json");
  Generation out;
  if (prepared.is_null() || !prepared.value("tokenizer", json()).is_object()) {
    out.said = fmt::format("no tokenizer: the corpus {} has no readable data.json any more",
                           corpus.string());
    log::warn("export: " + out.said);
    return out;
  }
  const json& tokenizer = prepared["tokenizer"];
  const json separator = tokenizer.value("separator", json());
  if (separator.is_object() && separator.value("id", json()).is_number_integer()) {
    out.bos_id = out.eos_id = separator["id"];
    out.eos_token = separator.value("token", std::string());
  }
  const std::string path = tokenizer.value("path", std::string());
  std::error_code ec;
  if (path.empty() || !fs::is_regular_file(path, ec)) {
    out.said = fmt::format("the corpus's tokenizer {} is gone: not carried (bos/eos {})",
                           path.empty() ? "(none recorded)" : path, out.eos_id.dump());
    log::warn("export: " + out.said);
  } else if (sha256_file(path) != tokenizer.value("sha256", std::string())) {
    out.said = fmt::format(
        "{} changed since the data was prepared (its SHA-256 is not {}'s): not carried; copy "
        "the tokenizer the corpus was made with by hand",
        path, (corpus / "data.json").string());
    log::warn("export: " + out.said);
  } else {
    out.files.push_back(path);
    out.said = fmt::format("tokenizer {} and end token {} from the corpus {}", path,
                           out.eos_id.dump(), corpus.string());
  }
  return out;
}

// model.init_from's directory: its ids and tokenizer files, when it is still there.
std::optional<Generation> from_init_dir(const json& init_from) {
  if (!init_from.is_object() || !init_from.value("path", json()).is_string()) return std::nullopt;
  const fs::path dir = init_from["path"].get<std::string>();
  const json config = read_json_object(dir / "config.json");
  if (config.is_null()) return std::nullopt;
  Generation out;
  out.bos_id = config.value("bos_token_id", json());
  out.eos_id = config.value("eos_token_id", json());
  std::error_code ec;
  for (const char* name : kTokenizerFiles) {
    if (fs::is_regular_file(dir / name, ec)) out.files.push_back(dir / name);
  }
  if (fs::is_regular_file(dir / "generation_config.json", ec))
    out.files.push_back(dir / "generation_config.json");
  out.said = fmt::format("end token {} and {} tokenizer file(s) from model.init_from {}",
                         out.eos_id.dump(), out.files.size(), dir.string());
  return out;
}

}  // namespace

bool is_hf_generation_file(const std::string& name) {
  if (name == "generation_config.json") return true;
  for (const char* file : kTokenizerFiles) {
    if (name == file) return true;
  }
  return false;
}

std::string write_hf_generation_files(const fs::path& out_dir, const json& run_manifest,
                                      const json& init_from) {
  std::optional<Generation> found = from_prepared_corpus(run_manifest);
  if (!found) found = from_init_dir(init_from);
  Generation g = found ? *found : Generation{};
  if (!found) g.said = "no tokenizer and no end token: the data was bytes (token = byte value)";

  json config = read_json_object(out_dir / "config.json");
  config["bos_token_id"] = g.bos_id;
  config["eos_token_id"] = g.eos_id;
  write_file_atomic(out_dir / "config.json", config.dump(2) + "\n");
  bool generation_copied = false;
  for (const fs::path& file : g.files) {
    write_file_atomic(out_dir / file.filename(), read_file(file));
    generation_copied |= file.filename() == "generation_config.json";
  }
  if (!generation_copied) {
    write_file_atomic(out_dir / "generation_config.json",
                      json{{"bos_token_id", g.bos_id}, {"eos_token_id", g.eos_id}}.dump(2) + "\n");
  }
  // A bare tokenizer.json (a prepared corpus's) loads in AutoTokenizer through this, which also
  // names its end token (tokenizer.eos_token).
  std::error_code ec;
  if (g.eos_token && fs::is_regular_file(out_dir / "tokenizer.json", ec) &&
      !fs::exists(out_dir / "tokenizer_config.json", ec)) {
    write_file_atomic(out_dir / "tokenizer_config.json",
                      json{{"tokenizer_class", "PreTrainedTokenizerFast"},
                           {"bos_token", *g.eos_token},
                           {"eos_token", *g.eos_token}}
                              .dump(2) +
                          "\n");
  }
  return g.said;
}

}  // namespace kiln
