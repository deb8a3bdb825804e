// Internals of the models component (src/models/), not public API.
#pragma once

#include "kiln/config.h"
#include "kiln/models.h"

namespace kiln {

/// The GPT shape for the config: model.preset, with any non-zero model.* key overriding it.
/// Unchecked (resolve_gpt_config checks it; the [model] rules explain what is wrong).
GptConfig gpt_shape(const Config& config);

}  // namespace kiln
