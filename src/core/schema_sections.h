// Building blocks of the config schema (src/core/schema.cpp). Each rung declares its own
// section in its own folder (e.g. src/profile/schema.cpp defines profile_keys()); schema()
// concatenates them in ladder order. Not public API.
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

// Sections owned by the rungs, each defined in its rung's folder.
std::vector<KeyDef> profile_keys();     // src/profile/schema.cpp   [profile]
std::vector<KeyDef> dist_keys();        // src/dist/schema.cpp      [dist]
std::vector<KeyDef> checkpoint_keys();  // src/ckpt/schema.cpp      [checkpoint]

// Cross-key checks that need a component's knowledge (a preset's shape), called by
// Config::validate() so that `kiln config validate` and every command reject the same configs
// before anything is written. Each throws UserError naming the keys and the fix.
void check_model_keys(const Config& config);  // src/models/models.cpp

}  // namespace kiln
