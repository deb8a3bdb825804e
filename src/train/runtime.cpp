// Process-wide settings a run applies before training: threads, determinism, seed, device.
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>
#include <torch/utils.h>

#include <cstdlib>
#include <string>

#include "kiln/error.h"
#include "kiln/train.h"

namespace kiln {

void apply_runtime_settings(const RuntimeOptions& options) {
  if (options.threads > 0) at::set_num_threads(static_cast<int>(options.threads));
  if (options.deterministic) {
    // cuBLAS needs a fixed workspace for deterministic results; set before CUDA initialises.
    ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
    at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/true);
    at::globalContext().setDeterministicFillUninitializedMemory(options.fill_uninitialized_memory);
    at::globalContext().setDeterministicCuDNN(true);
    at::globalContext().setBenchmarkCuDNN(false);
  }
  torch::manual_seed(options.seed);
}

torch::Device resolve_device(const std::string& device) {
  const bool cuda = torch::cuda::is_available();
  if (device == "cuda" && !cuda) {
#ifdef KILN_WITH_CUDA
    const char* build = "a CUDA LibTorch, but the driver reports no device";
#else
    const char* build = "a CPU-only LibTorch";
#endif
    throw UserError(
        std::string("run.device = \"cuda\" but no CUDA device is available (kiln is built "
                    "with ") +
        build + "); set run.device = \"cpu\"");
  }
  if (device == "cuda" || (device == "auto" && cuda)) return torch::Device(torch::kCUDA, 0);
  return torch::kCPU;
}

}  // namespace kiln
