// The [checkpoint] section of the config schema.
#include "core/schema_sections.h"

namespace kiln {

std::vector<KeyDef> checkpoint_keys() {
  return {};
}

}  // namespace kiln
