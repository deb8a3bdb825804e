// Datasets as plugins: a program that links kiln registers its own C++ dataset under a data.name
// (examples/custom_model), beside the built-in synthetic, text and tokens.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "kiln/config.h"
#include "kiln/data.h"

namespace kiln {

struct DatasetSpec {
  std::string name;         // data.name: lowercase letters, digits, '-', '_'
  std::string description;  // one line, for error messages
  /// Builds the train and validation datasets for the config (make_datasets calls it, possibly
  /// more than once per process: the pilot and the rungs build the job again). The same config
  /// must give the same samples: a checkpoint's resume and the restore drills compare bits.
  /// Datasets::identity goes into manifest.json as the data's identity (give it at least the
  /// "kind", the sizes and whatever seeds or files the samples come from). The datasets' get()
  /// must be thread-safe (kiln/data.h Dataset). Throws UserError naming the key to fix.
  std::function<Datasets(const Config& config)> build;
  /// Keys this dataset reads, added to the [data] section (each KeyDef's section is "data"; a
  /// key another dataset already declared, by full name, is shared) and cross-key rules (each
  /// returns "" unless data.name is this dataset), as ModelSpec::keys and rules. Part of the
  /// config schema only when registered before the first config is read.
  std::vector<KeyDef> keys;
  std::vector<ConfigRule> rules;
};

/// Adds a dataset under spec.name; data.name accepts it from then on (`kiln config validate` and
/// every run). Register before the first config is read, as models are. Thread-safe. Throws
/// std::invalid_argument for an empty name or build, a name with other characters, a name
/// already registered or built in (synthetic, text, tokens), a key outside [data], or keys and
/// rules given after the config schema was built.
void register_dataset(DatasetSpec spec);
/// The spec registered under `name`, or nullptr (also for the built-ins). Valid forever.
const DatasetSpec* find_dataset(const std::string& name);
/// Every name data.name accepts, sorted: the built-ins and the registered ones.
std::vector<std::string> dataset_names();

}  // namespace kiln
