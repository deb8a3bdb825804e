// Precompiled header for the library, CLI and tests: the heavy LibTorch headers, parsed once.
#pragma once
#include <torch/torch.h>

#include <nlohmann/json.hpp>
