// The [dist] section of the config schema.
#include "core/schema_sections.h"

namespace kiln {

std::vector<KeyDef> dist_keys() {
  return {};
}

}  // namespace kiln
