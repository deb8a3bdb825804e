// The model registry (kiln/models.h): register_model, the lookups, and make_model. The built-in
// models register first, through the same register_model a user's model calls.
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <mutex>
#include <stdexcept>

#include "core/counters.h"
#include "kiln/error.h"
#include "kiln/hf.h"
#include "kiln/models.h"
#include "models/exported.h"
#include "models/internal.h"

namespace kiln {
namespace {

struct Registry {
  std::mutex mutex;
  std::map<std::string, std::unique_ptr<const ModelSpec>> specs;
  bool schema_built = false;  // model_section() has taken the keys and rules
};

void add(Registry& registry, ModelSpec spec) {
  if (spec.name.empty() || !spec.build) {
    throw std::invalid_argument("register_model: a model needs a name and a build function");
  }
  for (char c : spec.name) {
    if (!(std::islower(static_cast<unsigned char>(c)) ||
          std::isdigit(static_cast<unsigned char>(c)) || c == '-' || c == '_')) {
      throw std::invalid_argument("register_model(\"" + spec.name +
                                  "\"): a name is lowercase letters, digits, '-' and '_'");
    }
  }
  if (registry.schema_built && (!spec.keys.empty() || !spec.rules.empty())) {
    throw std::invalid_argument("register_model(\"" + spec.name +
                                "\"): its keys and rules come after the config schema was built; "
                                "register the model before the first config is read");
  }
  if (registry.specs.count(spec.name)) {
    throw std::invalid_argument("register_model(\"" + spec.name + "\"): already registered");
  }
  std::string name = spec.name;
  registry.specs.emplace(std::move(name), std::make_unique<const ModelSpec>(std::move(spec)));
}

Registry& registry() {
  static Registry* instance = [] {
    auto* r = new Registry;
    for (ModelSpec spec : {mlp_spec(), gpt_spec(), llama_spec(), exported_spec()})
      add(*r, std::move(spec));
    return r;
  }();
  return *instance;
}

}  // namespace

void register_model(ModelSpec spec) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  add(r, std::move(spec));
}

const ModelSpec* find_model(const std::string& name) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  auto it = r.specs.find(name);
  return it == r.specs.end() ? nullptr : it->second.get();
}

std::vector<std::string> registered_models() {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  std::vector<std::string> out;
  for (const auto& [name, spec] : r.specs) out.push_back(name);
  return out;
}

std::string unknown_model_problem(const std::string& name) {
  std::string list;
  for (const auto& known : registered_models()) list += (list.empty() ? "" : ", ") + known;
  return fmt::format(
      "model.name = \"{}\" is not a registered model; the registered ones: {} (a C++ model "
      "registers with kiln::register_model, docs/models.md)",
      name, list);
}

const ModelSpec& model_spec(const Config& config) {
  const std::string name = ModelBuildOptions::from_config(config).name;
  const ModelSpec* spec = find_model(name);
  if (!spec) throw UserError(unknown_model_problem(name));
  return *spec;
}

bool model_takes_tokens(const Config& config) {
  const ModelSpec* spec = find_model(ModelBuildOptions::from_config(config).name);
  return spec && spec->input == ModelInput::kTokens;
}

int64_t model_vocab_size(const Config& config) {
  const ModelSpec* spec = find_model(ModelBuildOptions::from_config(config).name);
  if (!spec || spec->input != ModelInput::kTokens || !spec->vocab_size) return 0;
  return spec->vocab_size(config);
}

ModelMath model_math(const Config& config) {
  const ModelSpec& spec = model_spec(config);
  if (!spec.math) {
    throw UserError(fmt::format(
        "model.name = \"{}\" registers no ModelSpec::math (parameters and FLOPs): kiln cannot "
        "plan it",
        spec.name));
  }
  return spec.math(config);
}

std::vector<const ModelSpec*> specs_for_schema() {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  r.schema_built = true;
  std::vector<const ModelSpec*> out;
  for (const auto& [name, spec] : r.specs) out.push_back(spec.get());
  return out;
}

std::shared_ptr<Model> make_model(const Config& config) {
  counters::count(counters::Event::kModelBuild);
  const ModelSpec& spec = model_spec(config);
  const ModelBuildOptions options = ModelBuildOptions::from_config(config);
  auto generator = at::make_generator<at::CPUGeneratorImpl>(options.seed);
  std::shared_ptr<Model> model = spec.build(config, generator);
  if (const std::string& dir = options.init_from; !dir.empty()) {
    if (!spec.load_hf) {
      throw UserError(fmt::format(
          "model.init_from loads Hugging Face weights, which model.name = \"{}\" cannot take",
          spec.name));
    }
    model->init_from = spec.load_hf(*model, dir, "model.init_from");
  }
  return model;
}

}  // namespace kiln
