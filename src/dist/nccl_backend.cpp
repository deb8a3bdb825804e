// The NCCL backend: compiled only when the LibTorch build has NCCL (torch's CMake package then
// defines USE_C10D_NCCL for its users, as it defines USE_C10D_GLOO on every Linux build).
#include "dist/backends.h"
#include "kiln/error.h"

#ifdef USE_C10D_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace kiln::dist {

#ifdef USE_C10D_NCCL

bool nccl_compiled() {
  return true;
}

bool capturing_cuda_graph(const torch::Device& device) {
  if (!device.is_cuda()) return false;
  c10::cuda::CUDAGuard guard(device);
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout,
                                                    int device_index) {
  // One process per device: make LOCAL_RANK's device current before NCCL creates communicators
  // (it does so lazily, on the first collective, for the current device).
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device_index));
  auto options = c10d::ProcessGroupNCCL::Options::create();
  // c10d's watchdog aborts a collective that runs past this and tears the process down
  // (TORCH_NCCL_ASYNC_ERROR_HANDLING), so a dead or hung peer ends every rank.
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}

#else

bool nccl_compiled() {
  return false;
}

bool capturing_cuda_graph(const torch::Device&) {
  return false;
}

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>&, int,
                                                    int, std::chrono::milliseconds, int) {
  throw UserError(
      "dist.backend = \"nccl\" but this kiln was built against a LibTorch without "
      "NCCL (CPU-only); set dist.backend = \"gloo\" or rebuild with a CUDA LibTorch");
}

#endif

}  // namespace kiln::dist
