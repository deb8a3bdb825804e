// The dataset registry (kiln/dataset_registry.h): datasets a program registers beside the
// built-in synthetic, text and tokens (make_datasets asks it for any other data.name).
#include <algorithm>
#include <cctype>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>

#include "data/internal.h"
#include "kiln/dataset_registry.h"

namespace kiln {
namespace {

const std::vector<std::string> kBuiltinDatasetNames = {"synthetic", "text", "tokens"};

struct DatasetRegistry {
  std::mutex mutex;
  std::map<std::string, std::unique_ptr<const DatasetSpec>> specs;
  bool schema_built = false;  // data_section() has taken the keys and rules
};

DatasetRegistry& dataset_registry() {
  static DatasetRegistry* instance = new DatasetRegistry;  // never destroyed: specs stay valid
  return *instance;
}

}  // namespace

void register_dataset(DatasetSpec spec) {
  if (spec.name.empty() || !spec.build) {
    throw std::invalid_argument("register_dataset: a dataset needs a name and a build function");
  }
  for (char c : spec.name) {
    if (!(std::islower(static_cast<unsigned char>(c)) ||
          std::isdigit(static_cast<unsigned char>(c)) || c == '-' || c == '_')) {
      throw std::invalid_argument("register_dataset(\"" + spec.name +
                                  "\"): a name is lowercase letters, digits, '-' and '_'");
    }
  }
  DatasetRegistry& r = dataset_registry();
  std::lock_guard lock(r.mutex);
  if (r.specs.count(spec.name) ||
      std::count(kBuiltinDatasetNames.begin(), kBuiltinDatasetNames.end(), spec.name)) {
    throw std::invalid_argument("register_dataset(\"" + spec.name + "\"): already registered");
  }
  if (r.schema_built && (!spec.keys.empty() || !spec.rules.empty())) {
    throw std::invalid_argument("register_dataset(\"" + spec.name +
                                "\"): its keys and rules come after the config schema was "
                                "built; register the dataset before the first config is read");
  }
  for (const KeyDef& key : spec.keys) {
    if (key.section != "data") {
      throw std::invalid_argument("register_dataset(\"" + spec.name + "\"): key " +
                                  key.full_name() + " is not in the [data] section");
    }
  }
  std::string name = spec.name;
  r.specs.emplace(std::move(name), std::make_unique<const DatasetSpec>(std::move(spec)));
}

const DatasetSpec* find_dataset(const std::string& name) {
  DatasetRegistry& r = dataset_registry();
  std::lock_guard lock(r.mutex);
  auto it = r.specs.find(name);
  return it == r.specs.end() ? nullptr : it->second.get();
}

std::vector<std::string> dataset_names() {
  std::vector<std::string> out = kBuiltinDatasetNames;
  {
    DatasetRegistry& r = dataset_registry();
    std::lock_guard lock(r.mutex);
    for (const auto& [name, spec] : r.specs) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<const DatasetSpec*> dataset_specs_for_schema() {
  DatasetRegistry& r = dataset_registry();
  std::lock_guard lock(r.mutex);
  r.schema_built = true;
  std::vector<const DatasetSpec*> out;
  for (const auto& [name, spec] : r.specs) out.push_back(spec.get());
  return out;
}

}  // namespace kiln
