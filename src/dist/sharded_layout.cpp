// How FSDP shards lie (ShardLayout) and the sharded parallel layout
// (sharded_layout()): the optimizer steps each rank's parameter shards; the gradient norm and the
// training state follow the shards.
#include <ATen/ATen.h>

#include <algorithm>
#include <map>

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

class ShardedLayout final : public ParallelLayout {
 public:
  ShardedLayout(std::vector<ParameterShard> shards, std::shared_ptr<Communicator> comm, bool saved)
      : shards_(std::move(shards)), comm_(std::move(comm)), saved_(saved) {}

  NamedTensors optimizer_parameters(Model& /*model*/) override {
    NamedTensors out;
    for (const auto& s : shards_) out.emplace_back(s.name, s.shard);
    return out;
  }

  // The squared shard norms summed over the ranks (with the overflow flags in the same
  // all-reduce), so clipping, the non-finite guard and the loss scaler agree on every rank.
  torch::Tensor global_gradient_norm(const std::vector<torch::Tensor>& grads,
                                     torch::Tensor& overflow) override {
    const torch::Tensor norms = at::stack(at::_foreach_norm(grads, 2));
    if (!comm_) return at::linalg_vector_norm(norms, 2);  // one rank: as the replicated layout
    torch::Tensor squares = norms.square().sum();
    if (overflow.defined()) {
      torch::Tensor both = at::stack({squares, overflow.to(squares.scalar_type())});
      comm_->all_reduce_sum(both);
      squares = both[0];
      overflow = (both[1] > 0).to(overflow.scalar_type());
    } else {
      comm_->all_reduce_sum(squares);
    }
    return squares.sqrt();
  }

  // Each shard's own rows (padding dropped; none when it holds padding only), and the same rows
  // of its optimizer state, as pieces of the whole tensors.
  void add_state(Model& model, const NamedTensors& optimizer_state, TrainState& state) override {
    std::map<std::string, const ParameterShard*> shard_of;
    for (const auto& s : shards_) shard_of[s.name] = &s;
    auto add_piece = [&](NamedTensors& into, const std::string& name, const torch::Tensor& t,
                         const ParameterShard& s) {
      if (s.rows == 0) return;
      std::vector<int64_t> offsets(s.global_shape.size(), 0);
      if (!offsets.empty()) offsets[0] = s.row_offset;
      into.emplace_back(name, s.global_shape.empty() ? t.view({}) : t.narrow(0, 0, s.rows));
      state.pieces[name] = TensorPiece{s.global_shape, offsets, saved_};
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
  std::shared_ptr<Communicator> comm_;  // null: one rank
  bool saved_;                          // false: a replica's copy (TensorPiece::saved)
};

}  // namespace

std::shared_ptr<ParallelLayout> sharded_layout(std::vector<ParameterShard> shards,
                                               std::shared_ptr<Communicator> comm, bool saved) {
  if (comm && comm->world_size() <= 1) comm = nullptr;
  return std::make_shared<ShardedLayout>(std::move(shards), std::move(comm), saved);
}

}  // namespace kiln
