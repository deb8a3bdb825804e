// The [run] keys that place a run and the pins its manifest records: the only place in src/core/
// outside the schema that reads a Config by key.
#include "core/options.h"

#include <filesystem>

#include "kiln/error.h"
#include "kiln/run.h"

namespace kiln {

uint64_t data_seed(const Config& config) {
  const int64_t seed = config.get_int("data.seed");
  return static_cast<uint64_t>(seed == 0 ? config.get_int("run.seed") : seed);
}

std::filesystem::path run_directory(const Config& config) {
  std::string name = config.get_string("run.name");
  if (name.empty()) name = config.source().empty() ? "run" : config.source().stem().string();
  if (name.find('/') != std::string::npos || name == "." || name == "..") {
    throw UserError("run.name = \"" + name + "\" must be a plain directory name (no '/')");
  }
  return std::filesystem::path(config.get_string("run.dir")) / name;
}

Config with_resolved_run_name(const Config& config) {
  Config out = config;
  if (config.get_string("run.name").empty())
    out.set("run.name", run_directory(config).filename().string());
  return out;
}

ManifestPins ManifestPins::from_config(const Config& config) {
  auto revision = [&](const char* key) -> std::optional<std::string> {
    if (find_key(key) == nullptr) return std::nullopt;
    return config.get_string(key);
  };
  return {.run_seed = config.get_int("run.seed"),
          .data_seed = kiln::data_seed(config),
          .deterministic = config.get_bool("run.deterministic"),
          .data_revision = revision("data.revision"),
          .model_revision = revision("model.revision")};
}

// Declared in kiln/compile.h too (the [compile] rules and CompileOptions use it); defined here,
// below every component, since a model's own rules (the exported model's) ask it as well.
bool compiles_per_unit(const Config& config) {
  const std::string& granularity = config.get_string("compile.granularity");
  if (granularity != "auto") return granularity == "unit";
  return config.get_string("compile.backend") == "inductor" &&
         (config.get_string("train.activation_checkpointing") != "none" ||
          config.get_string("dist.strategy") == "fsdp");
}

}  // namespace kiln
