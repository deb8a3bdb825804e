// CUDA graphs for the captured step: warm-up and capture on a side stream (the current stream
// waits on events around them), one memory pool shared by every graph of the process's step,
// replays on the current stream. Built only against a CUDA LibTorch.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "compile/internal.h"
#include "kiln/compile.h"

namespace kiln {

namespace {

class CudaGraphRecorder final : public GraphRecorder {
 public:
  CudaGraphRecorder(c10::DeviceIndex device, at::cuda::MempoolId_t pool)
      : device_(device), pool_(pool), side_(c10::cuda::getStreamFromPool(false, device)) {}

  torch::Tensor warm_up(const std::function<torch::Tensor()>& work) override {
    return on_side_stream([&] { return work(); });
  }

  torch::Tensor capture(const std::function<torch::Tensor()>& work) override {
    c10::cuda::device_synchronize();  // nothing from before the capture runs inside it
    return on_side_stream([&] {
      graph_.capture_begin(pool_);
      torch::Tensor out;
      try {
        out = work();
      } catch (...) {
        try {
          graph_.capture_end();
        } catch (...) {
        }
        throw;
      }
      graph_.capture_end();
      return out;
    });
  }

  bool executed_on_capture() const override { return false; }

  void replay(const std::function<torch::Tensor()>&) override { graph_.replay(); }

 private:
  template <class Work>
  torch::Tensor on_side_stream(const Work& work) {
    c10::cuda::CUDAGuard device_guard(device_);
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device_);
    at::cuda::CUDAEvent ready;
    ready.record(current);
    ready.block(side_);  // the side stream sees everything queued before (batch copies, lr)
    torch::Tensor out;
    {
      c10::cuda::CUDAStreamGuard stream_guard(side_);
      out = work();
    }
    at::cuda::CUDAEvent done;
    done.record(side_);
    done.block(current);
    return out;
  }

  c10::DeviceIndex device_;
  at::cuda::MempoolId_t pool_;
  c10::cuda::CUDAStream side_;
  at::cuda::CUDAGraph graph_;
};

}  // namespace

GraphRecorderFactory make_cuda_graph_recorders(torch::Device device) {
  const c10::DeviceIndex index = device.has_index() ? device.index() : c10::cuda::current_device();
  c10::cuda::CUDAGuard guard(index);
  const at::cuda::MempoolId_t pool = at::cuda::graph_pool_handle();  // shared by every graph
  return [index, pool] { return std::make_unique<CudaGraphRecorder>(index, pool); };
}

}  // namespace kiln
