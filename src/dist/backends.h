// The c10d backends kiln builds its process group on (not public API). Each lives in its own
// translation unit, so the third-party headers they need (Gloo's, NCCL's) are included by one file
// each and nowhere else; see docs/scale.md, "Gloo headers".
#pragma once

#include <chrono>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace kiln::dist {

/// c10d::ProcessGroupGloo over `store` (a prefix store private to this group), with the default
/// Gloo device (GLOO_SOCKET_IFNAME when set, else this host's address) and `timeout` for every
/// collective. Blocks until all `size` ranks connected (or throws c10::Error after `timeout`).
c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout);

/// True when this build of kiln compiled the NCCL backend (a LibTorch with CUDA and NCCL).
bool nccl_compiled();

/// Whether the calling thread's current CUDA stream on `device` is capturing a CUDA graph. A
/// collective started inside a capture becomes part of the graph: no host-side completion
/// callback may be attached to it (the callback's stream would join the capture and never be
/// rejoined). False for a CPU device or a LibTorch without NCCL.
bool capturing_cuda_graph(const torch::Device& device);

/// c10d::ProcessGroupNCCL on CUDA device `device_index` (made current). Throws UserError when
/// nccl_compiled() is false.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout,
                                                    int device_index);

}  // namespace kiln::dist
