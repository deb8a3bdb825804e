// The device's memory and name for dist.strategy = "auto" on CUDA (built only against a CUDA
// LibTorch).
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#include <torch/types.h>

#include <string>

namespace kiln {

double cuda_device_total_memory(const torch::Device& device) {
  c10::cuda::CUDAGuard guard(device.index());
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) return 0.0;
  return static_cast<double>(total_bytes);
}

std::string cuda_device_name(const torch::Device& device) {
  cudaDeviceProp properties{};
  if (cudaGetDeviceProperties(&properties, device.index()) != cudaSuccess) return "cuda";
  return properties.name;
}

}  // namespace kiln
