// The [run] keys and revisions the run's records read (src/core/options.cpp, the only place in
// src/core/ outside the schema that reads a Config by key).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "kiln/config.h"

namespace kiln {

/// What manifest.json pins of the config besides its hash.
struct ManifestPins {
  int64_t run_seed = 0;       // run.seed
  uint64_t data_seed = 0;     // data_seed(config)
  bool deterministic = true;  // run.deterministic
  /// data.revision / model.revision: the free text a user pins ("" none); nullopt where the
  /// schema has no such key.
  std::optional<std::string> data_revision = {}, model_revision = {};
  static ManifestPins from_config(const Config& config);
};

/// Whether the config compiles per unit (kiln/compile.h has the rule it decides).
bool compiles_per_unit(const Config& config);

}  // namespace kiln
