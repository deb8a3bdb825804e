// The data component's own declarations (not public API).
#pragma once

#include <vector>

#include "kiln/dataset_registry.h"

namespace kiln {

/// Every registered dataset, for the [data] section's keys and rules; after this call a
/// dataset registering keys is refused (they would miss the schema).
std::vector<const DatasetSpec*> dataset_specs_for_schema();

}  // namespace kiln
