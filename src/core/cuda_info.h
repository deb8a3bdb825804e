// What only a CUDA build of kiln can read about the machine, for the run manifest. The
// definitions live in cuda_info_cuda.cpp, built only against a CUDA LibTorch (KILN_WITH_CUDA);
// callers guard their calls with the same macro. Not public API.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace kiln {

/// {"type": "cuda", "index", "name", "total_memory_bytes", "compute_capability"} of device
/// `index`; only type and index when the driver cannot say more.
nlohmann::json cuda_device_record(int index);

/// The NCCL version LibTorch was built with ("2.27.3"), or "" when it has no NCCL.
std::string nccl_version();

}  // namespace kiln
