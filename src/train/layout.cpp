// The replicated parallel layout (kiln/train.h): every tensor whole on every rank.
#include <ATen/ATen.h>

#include "kiln/models.h"
#include "kiln/train.h"

namespace kiln {
namespace {

class ReplicatedLayout final : public ParallelLayout {
 public:
  NamedTensors optimizer_parameters(Model& model) override {
    NamedTensors out;
    for (auto& item : model.named_parameters()) out.emplace_back(item.key(), item.value());
    return out;
  }

  // As torch.nn.utils.clip_grad_norm_: the norm of the per-tensor norms. DDP's gradients are
  // already averaged over the ranks, so this rank's norm is everyone's.
  torch::Tensor global_gradient_norm(const std::vector<torch::Tensor>& grads,
                                     torch::Tensor& /*overflow*/) override {
    return at::linalg_vector_norm(at::stack(at::_foreach_norm(grads, 2)), 2);
  }

  void add_state(Model& model, const NamedTensors& optimizer_state, TrainState& state) override {
    for (const auto& item : model.named_parameters())
      state.model.emplace_back(item.key(), item.value());
    for (const auto& item : model.named_buffers())
      state.model.emplace_back(item.key(), item.value());
    state.optimizer = optimizer_state;
  }
};

}  // namespace

std::shared_ptr<ParallelLayout> replicated_layout() {
  return std::make_shared<ReplicatedLayout>();
}

}  // namespace kiln
