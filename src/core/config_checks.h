// Value checks shared by the config parser (config.cpp) and the schema's own checks and
// documentation (config_docs.cpp). Not public API.
#pragma once

#include <string>

#include "kiln/config.h"

namespace kiln::config_detail {

/// "[min, max]" of a key's range ("-inf"/"inf" for a missing bound).
std::string range_text(const KeyDef& def);
/// What a key accepts, in words ("an integer in [1, inf]", "one of \"a\", \"b\"").
std::string expectation(const KeyDef& def);
/// Checks a value against its key's type, range and choices: an error text naming the key, or "".
std::string check_value(const KeyDef& def, const Value& value);

}  // namespace kiln::config_detail
