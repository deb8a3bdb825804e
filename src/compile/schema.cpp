// The [compile] section of the config schema.
#include "core/schema_sections.h"

namespace kiln {

std::vector<KeyDef> compile_keys() {
  return {};
}

}  // namespace kiln
