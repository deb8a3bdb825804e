// Process-wide settings a run applies before training: threads, determinism, seed, device.
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>
#include <torch/utils.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <climits>
#include <cstdlib>
#include <string>

#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/train.h"

namespace kiln {

namespace {

// glibc serves allocations above its mmap threshold (128 KiB, growing to 32 MiB) with mmap and
// unmaps them when freed, so every step maps its large tensors afresh (activations, the head's
// logits, the embedding gradient) and the kernel zero-fills each page on first touch; freed heap
// above 128 KiB at the top is trimmed back to the OS. A training step allocates the same sizes
// every step: with no mmap'd chunks and no trim, they are reused from the heap instead, as
// PyTorch's CUDA caching allocator reuses device memory. Process-wide.
// Under AddressSanitizer its allocator replaces glibc's (and its mallopt does nothing).
void keep_freed_memory() {
#if defined(__GLIBC__) && !defined(__SANITIZE_ADDRESS__)
  if (::mallopt(M_MMAP_MAX, 0) != 1 || ::mallopt(M_TRIM_THRESHOLD, INT_MAX) != 1) {
    log::warn(
        "run.keep_freed_memory: glibc's mallopt refused the settings; freed memory goes back to "
        "the OS as usual");
  }
#endif
}

}  // namespace

void apply_runtime_settings(const RuntimeOptions& options) {
  if (options.keep_freed_memory) keep_freed_memory();
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
