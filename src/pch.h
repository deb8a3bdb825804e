// Precompiled header for the library, CLI, tests and benchmarks: the LibTorch and JSON headers
// nearly every file needs, parsed once. Deliberately not <torch/torch.h>: its optim, data and
// serialization parts make a PCH that costs more to load in each file than it saves (measured:
// a light file took 20 s with it, 13 s with this one). Files include what they use.
#pragma once
#include <fmt/format.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <nlohmann/json.hpp>
