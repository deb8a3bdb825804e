// Tensor parallelism as the first piece of the parallel layout (kiln/dist.h
// install_tensor_parallel): the same whole weights everywhere, the model sliced, the layout.
#include <fmt/format.h>

#include "dist/replicas.h"
#include "kiln/dist.h"
#include "kiln/log.h"
#include "kiln/models.h"

namespace kiln {

std::shared_ptr<ParallelLayout> tensor_parallel_layout(Model& model,
                                                       std::shared_ptr<Communicator> tp,
                                                       bool saved);  // sharded_layout.cpp

void install_tensor_parallel(Trainer& trainer, const DeviceMesh& mesh) {
  trainer.enter_composition_stage(CompositionStage::kTensorParallel,
                                  fmt::format("tensor parallel x{}", mesh.shape.tp));
  if (!mesh.tp) throw std::logic_error("install_tensor_parallel: a mesh without tp ranks");
  Model& model = trainer.model();
  const std::string hash = dist::replicate_rank0(*mesh.world, model);
  model.shard_tensor_parallel(mesh.tp);
  trainer.set_parallel_layout(tensor_parallel_layout(model, mesh.tp, mesh.dp_index() == 0));
  int64_t whole = 0, mine = 0;
  for (const auto& item : model.named_parameters()) {
    const auto it = model.tensor_parallel().find(item.key());
    int64_t numel = item.value().numel();
    if (it != model.tensor_parallel().end()) {
      numel = 1;
      for (int64_t d : it->second.global_shape) numel *= d;
    }
    whole += numel;
    mine += item.value().numel();
  }
  log::info(fmt::format(
      "tensor parallel over {} ranks (mesh {}): {} of {} parameters split, {:.1f}% of the "
      "model's {} elements on this rank; weights {} everywhere before the split",
      mesh.shape.tp, mesh.shape.text(), model.tensor_parallel().size(),
      model.named_parameters().size(),
      100.0 * static_cast<double>(mine) / std::max<int64_t>(1, whole), whole, hash));
}

}  // namespace kiln
