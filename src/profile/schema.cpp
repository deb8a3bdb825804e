// The [profile] section of the config schema.
#include "core/schema_sections.h"

namespace kiln {

std::vector<KeyDef> profile_keys() {
  return {};
}

}  // namespace kiln
