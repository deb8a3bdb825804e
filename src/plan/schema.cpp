// The [pilot] section of the config schema.
#include "core/schema_sections.h"

namespace kiln {

std::vector<KeyDef> pilot_keys() {
  return {};
}

}  // namespace kiln
