// How FSDP shards lie (ShardLayout) and the sharded parallel layout
// (sharded_layout()): the optimizer steps each rank's parameter shards; the gradient norm and the
// training state follow the shards.
#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <optional>
#include <stdexcept>

#include "kiln/comm.h"
#include "kiln/dist.h"
#include "kiln/models.h"

namespace kiln {

int64_t ShardLayout::valid_rows(int rank) const {
  return std::clamp<int64_t>(rows - rank * rows_per_rank, 0, rows_per_rank);
}

std::vector<int64_t> ShardLayout::shard_shape() const {
  std::vector<int64_t> out = shape;
  if (out.empty()) return {rows_per_rank};
  out[0] = rows_per_rank;
  return out;
}

ShardLayout shard_layout(const std::string& name, const std::vector<int64_t>& shape,
                         int world_size) {
  ShardLayout layout;
  layout.name = name;
  layout.shape = shape;
  layout.rows = shape.empty() ? 1 : shape[0];
  layout.row_numel = 1;
  for (size_t d = 1; d < shape.size(); ++d) layout.row_numel *= shape[d];
  layout.rows_per_rank = std::max<int64_t>(1, (layout.rows + world_size - 1) / world_size);
  return layout;
}

namespace {

// Which of `grads` (the gradients of those of `parameters` that have one, in order, as the
// Trainer lists them) belong to tensor-parallel slices (`split`, by parameter).
std::vector<bool> split_of_grads(const std::vector<torch::Tensor>& parameters,
                                 const std::vector<bool>& split, size_t grads) {
  std::vector<bool> out;
  for (size_t k = 0; k < parameters.size(); ++k) {
    if (parameters[k].grad().defined()) out.push_back(split[k]);
  }
  if (out.size() != grads) {
    throw std::logic_error("tensor-parallel gradient norm: the gradients are not the layout's");
  }
  return out;
}

// sqrt of the gradients' summed squares: all of them summed over `group` (null: this rank's
// are everyone's), the tensor-parallel slices' (`split`, by gradient) over `tp` too (null:
// none), with the fp16 overflow flag (when defined) in the same all-reduces, so every rank
// agrees.
torch::Tensor split_gradient_norm(const std::vector<torch::Tensor>& grads,
                                  const std::vector<bool>& split, Communicator* group,
                                  Communicator* tp, torch::Tensor& overflow) {
  const torch::Tensor norms = at::stack(at::_foreach_norm(grads, 2));
  if (!group && !tp) return at::linalg_vector_norm(norms, 2);  // one rank: as replicated
  const torch::Tensor squares = norms.square();
  auto mask = torch::tensor(std::vector<uint8_t>(split.begin(), split.end()),
                            torch::TensorOptions().dtype(torch::kBool))
                  .to(squares.device());
  const auto zero = torch::zeros({}, squares.options());
  torch::Tensor parts =
      at::stack({torch::where(mask, squares, zero).sum(), torch::where(mask, zero, squares).sum(),
                 overflow.defined() ? overflow.to(squares.scalar_type()) : zero});
  if (group) group->all_reduce_sum(parts);
  if (tp) {
    torch::Tensor sliced = at::stack({parts[0], parts[2]});
    tp->all_reduce_sum(sliced);
    parts = at::stack({sliced[0], parts[1], sliced[1]});
  }
  if (overflow.defined()) overflow = (parts[2] > 0).to(overflow.scalar_type());
  return (parts[0] + parts[1]).sqrt();
}

// Where a piece of `rows` rows from `row_offset` on dim 0 of a parameter of `local_shape` (this
// rank's tensor-parallel slice, when `tp`) lies in the whole one: one box, or one per fused block
// it touches (TensorParallelPlacement::chunks).
TensorPiece whole_piece(const std::vector<int64_t>& local_shape, int64_t row_offset, int64_t rows,
                        const std::optional<TensorParallelPlacement>& tp, bool saved) {
  TensorPiece piece;
  piece.global_shape = tp ? tp->global_shape : local_shape;
  piece.offsets.assign(piece.global_shape.size(), 0);
  piece.saved = saved;
  if (piece.offsets.empty()) return piece;
  piece.offsets[0] = row_offset;
  if (!tp) return piece;
  if (tp->dim != 0) {
    piece.offsets[static_cast<size_t>(tp->dim)] += tp->offset;
    return piece;
  }
  const auto runs = tp->runs(row_offset, rows);
  if (runs.size() == 1) {
    piece.offsets[0] = runs[0].global;
    return piece;
  }
  for (const auto& run : runs) {
    TensorPiece::Box box{run.local - row_offset, run.length, piece.offsets};
    box.offsets[0] = run.global;
    piece.boxes.push_back(std::move(box));
  }
  return piece;
}

class ShardedLayout final : public ParallelLayout {
 public:
  ShardedLayout(std::vector<ParameterShard> shards, std::shared_ptr<Communicator> comm,
                std::shared_ptr<Communicator> tp)
      : shards_(std::move(shards)), comm_(std::move(comm)), tp_(std::move(tp)) {
    for (const auto& s : shards_) {
      split_.push_back(s.tensor_parallel.has_value());
      parameters_.push_back(s.shard);
    }
  }

  NamedTensors optimizer_parameters(Model& /*model*/) override {
    NamedTensors out;
    for (const auto& s : shards_) out.emplace_back(s.name, s.shard);
    return out;
  }

  // The squared shard norms summed over the ranks (with the overflow flags in the same
  // all-reduce), so clipping, the non-finite guard and the loss scaler agree on every rank.
  torch::Tensor global_gradient_norm(const std::vector<torch::Tensor>& grads,
                                     torch::Tensor& overflow) override {
    const std::vector<bool> split =
        tp_ ? split_of_grads(parameters_, split_, grads.size()) : std::vector<bool>(grads.size());
    return split_gradient_norm(grads, split, comm_.get(), tp_.get(), overflow);
  }

  // Each shard's own rows (padding dropped; none when it holds padding only), and the same rows
  // of its optimizer state, as pieces of the whole tensors.
  void add_state(Model& model, const NamedTensors& optimizer_state, TrainState& state) override {
    std::map<std::string, const ParameterShard*> shard_of;
    for (const auto& s : shards_) shard_of[s.name] = &s;
    auto add_piece = [&](NamedTensors& into, const std::string& name, const torch::Tensor& t,
                         const ParameterShard& s) {
      if (s.rows == 0) return;
      into.emplace_back(name, s.global_shape.empty() ? t.view({}) : t.narrow(0, 0, s.rows));
      state.pieces[name] =
          whole_piece(s.global_shape, s.row_offset, s.rows, s.tensor_parallel, s.saved);
    };
    for (const auto& s : shards_) add_piece(state.model, s.name, s.shard, s);
    for (const auto& item : model.named_buffers())
      state.model.emplace_back(item.key(), item.value());
    for (const auto& [name, tensor] : optimizer_state) {
      auto it = shard_of.find(name.substr(0, name.rfind('.')));
      if (it == shard_of.end()) {
        state.optimizer.emplace_back(name, tensor);
      } else {
        add_piece(state.optimizer, name, tensor, *it->second);
      }
    }
  }

 private:
  std::vector<ParameterShard> shards_;
  std::shared_ptr<Communicator> comm_;     // null: one rank
  std::shared_ptr<Communicator> tp_;       // null: no tensor parallelism
  std::vector<bool> split_;                // by shard: a tensor-parallel slice
  std::vector<torch::Tensor> parameters_;  // the shards, as the optimizer holds them
};

// Tensor parallelism without sharding (alone, or under DDP): every parameter stepped whole on
// this rank, the slices saved as pieces of the whole parameters by data-parallel rank 0.
class TensorParallelLayout final : public ParallelLayout {
 public:
  TensorParallelLayout(Model& model, std::shared_ptr<Communicator> tp, bool saved)
      : tp_(std::move(tp)), saved_(saved) {
    for (const auto& item : model.named_parameters()) {
      split_.push_back(model.tensor_parallel().count(item.key()) > 0);
      parameters_.push_back(item.value());
    }
  }

  NamedTensors optimizer_parameters(Model& model) override {
    NamedTensors out;
    for (auto& item : model.named_parameters()) out.emplace_back(item.key(), item.value());
    return out;
  }

  // DDP's gradients are already averaged over the data-parallel ranks: only the slices' squares
  // are summed, over the tensor-parallel ranks.
  torch::Tensor global_gradient_norm(const std::vector<torch::Tensor>& grads,
                                     torch::Tensor& overflow) override {
    return split_gradient_norm(grads, split_of_grads(parameters_, split_, grads.size()), nullptr,
                               tp_.get(), overflow);
  }

  void add_state(Model& model, const NamedTensors& optimizer_state, TrainState& state) override {
    const auto& placements = model.tensor_parallel();
    auto add = [&](NamedTensors& into, const std::string& name, const std::string& parameter,
                   const torch::Tensor& t) {
      into.emplace_back(name, t);
      auto it = placements.find(parameter);
      if (it != placements.end())
        state.pieces[name] = whole_piece(t.sizes().vec(), 0, t.size(0), it->second, saved_);
    };
    for (const auto& item : model.named_parameters())
      add(state.model, item.key(), item.key(), item.value());
    for (const auto& item : model.named_buffers())
      state.model.emplace_back(item.key(), item.value());
    for (const auto& [name, tensor] : optimizer_state)
      add(state.optimizer, name, name.substr(0, name.rfind('.')), tensor);
  }

 private:
  std::shared_ptr<Communicator> tp_;
  bool saved_;               // data-parallel rank 0 writes the slices
  std::vector<bool> split_;  // by parameter, registration order: a tensor-parallel slice
  std::vector<torch::Tensor> parameters_;
};

}  // namespace

std::shared_ptr<ParallelLayout> sharded_layout(std::vector<ParameterShard> shards,
                                               std::shared_ptr<Communicator> comm,
                                               std::shared_ptr<Communicator> tp) {
  if (comm && comm->world_size() <= 1) comm = nullptr;
  if (tp && tp->world_size() <= 1) tp = nullptr;
  return std::make_shared<ShardedLayout>(std::move(shards), std::move(comm), std::move(tp));
}

std::shared_ptr<ParallelLayout> tensor_parallel_layout(Model& model,
                                                       std::shared_ptr<Communicator> tp,
                                                       bool saved) {
  return std::make_shared<TensorParallelLayout>(model, std::move(tp), saved);
}

}  // namespace kiln
