// Built only against a CUDA LibTorch (see cuda_info.h).
#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <torch/csrc/cuda/nccl.h>

#include "core/cuda_info.h"

namespace kiln {

nlohmann::json cuda_device_record(int index) {
  nlohmann::json out = {{"type", "cuda"}, {"index", index}};
  cudaDeviceProp properties{};
  if (cudaGetDeviceProperties(&properties, index) == cudaSuccess) {
    out["name"] = properties.name;
    out["total_memory_bytes"] = properties.totalGlobalMem;
    out["compute_capability"] = fmt::format("{}.{}", properties.major, properties.minor);
  }
  return out;
}

std::string nccl_version() {
  try {  // packed as torch.cuda.nccl.version(): major << 32 | minor << 16 | patch
    const std::uint64_t packed = torch::cuda::nccl::version();
    if (packed == 0) return "";
    return fmt::format("{}.{}.{}", packed >> 32, (packed >> 16) & 0xffff, packed & 0xffff);
  } catch (const std::exception&) {  // a LibTorch built without NCCL
    return "";
  }
}

}  // namespace kiln
