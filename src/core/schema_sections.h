// Building blocks of the config schema. Each component declares its section next to its code
// (src/<component>/schema.cpp defines one function below); src/rungs/schema.cpp, the top layer,
// defines config_sections() from them in display order. Core only declares these functions and
// never calls them. Not public API.
#pragma once

#include <limits>
#include <string>
#include <vector>

#include "kiln/config.h"

namespace kiln {

inline constexpr double kUnbounded = std::numeric_limits<double>::infinity();

KeyDef bool_key(std::string section, std::string name, bool def, std::string doc);
KeyDef int_key(std::string section, std::string name, int64_t def, double lo, double hi,
               std::string doc);
KeyDef float_key(std::string section, std::string name, double def, double lo, double hi,
                 std::string doc);
KeyDef string_key(std::string section, std::string name, std::string def,
                  std::vector<std::string> choices, std::string doc);
/// A table of per-name numbers (default: empty), each value in [lo, hi]; `names` lists the
/// allowed names (empty = any name).
KeyDef table_key(std::string section, std::string name, double lo, double hi,
                 std::vector<std::string> names, std::string doc);

/// Adds a registered model's or dataset's keys and rules to its section: a key the section
/// already declares (by name) is shared, not added twice.
void add_registered_keys(ConfigSection& section, const std::vector<KeyDef>& keys,
                         const std::vector<ConfigRule>& rules);

/// Problems in a schema, one line each: a section or key declared twice, a key outside its
/// section, a missing doc, a default of the wrong type or outside its range / choices, a rule
/// without a description, check or example. Empty for a sound schema.
std::vector<std::string> schema_problems(const ConfigSections& sections);

// The sections, each defined next to its component's code.
ConfigSection run_section();         // src/core/schema.cpp        [run]
ConfigSection model_section();       // src/models/schema.cpp      [model]
ConfigSection data_section();        // src/data/schema.cpp        [data]
ConfigSection train_section();       // src/train/schema.cpp       [train]
ConfigSection optim_section();       // src/train/schema.cpp       [optim]
ConfigSection baseline_section();    // src/rungs/schema.cpp       [baseline]
ConfigSection compile_section();     // src/compile/schema.cpp     [compile]
ConfigSection profile_section();     // src/profile/schema.cpp     [profile]
ConfigSection dist_section();        // src/dist/schema.cpp        [dist]
ConfigSection checkpoint_section();  // src/ckpt/schema.cpp        [checkpoint]
ConfigSection pilot_section();       // src/plan/schema.cpp        [pilot]
ConfigSection plan_section();        // src/plan/schema.cpp        [plan]

}  // namespace kiln
