// FullyShardedDataParallel::attach: the parameters grouped per unit into flat shards of this
// rank's rows (fsdp_state.h has the storage and mixed-precision notes), the gradient hooks and the
// checkpoint's pieces.

#include <fmt/format.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <map>

#include "dist/fsdp_state.h"
#include "dist/replicas.h"
#include "kiln/dist.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/models.h"

namespace kiln {

namespace {

class ShardGradientHook final : public torch::autograd::PostAccumulateGradHook {
 public:
  ShardGradientHook(FullyShardedDataParallel::State* state, size_t index)
      : state_(state), index_(index) {}
  void operator()(const torch::autograd::Variable&) override {
    state_->gradient_accumulated(index_);
  }

 private:
  FullyShardedDataParallel::State* state_;
  size_t index_;
};

}  // namespace

FullyShardedDataParallel::FullyShardedDataParallel(std::unique_ptr<State> state)
    : state_(std::move(state)) {}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  for (auto& p : state_->params) {
    torch::autograd::impl::set_post_acc_grad_hooks(p.param, nullptr);
  }
}

std::shared_ptr<FullyShardedDataParallel> FullyShardedDataParallel::attach(
    Trainer& trainer, std::shared_ptr<Communicator> comm, const FsdpOptions& options) {
  DeviceMesh mesh;
  mesh.shape = {1, comm->world_size()};
  mesh.shard_index = comm->rank();
  mesh.world = comm;
  mesh.dp = comm;
  mesh.shard = std::move(comm);
  return attach(trainer, mesh, options);
}

std::shared_ptr<FullyShardedDataParallel> FullyShardedDataParallel::attach(
    Trainer& trainer, const DeviceMesh& mesh, const FsdpOptions& options) {
  trainer.enter_composition_stage(CompositionStage::kParallelLayout, "FSDP");
  auto state = std::make_unique<State>();
  State& s = *state;
  s.comm = mesh.shard;
  if (mesh.shape.dp_replicate > 1) {
    s.replicate = mesh.replicate;
    s.replicas = mesh.shape.dp_replicate;
  }
  s.options = options;
  s.rank = s.comm->rank();
  s.world = s.comm->world_size();
  Model& model = trainer.model();
  s.model = &model;
  // The data-parallel ranks start from rank 0's weights (tensor-parallel slices differ across
  // mesh.tp: install_tensor_parallel made the whole model equal before slicing it).
  s.weights_hash = dist::replicate_rank0(*mesh.dp, model);

  // Groups: the units in forward order, then every other trainable parameter (the root).
  std::map<std::string, int> unit_of;
  const std::vector<ModelUnit> units = model.units();
  for (size_t u = 0; u < units.size(); ++u) {
    for (const auto& name : units[u].parameters) unit_of[name] = static_cast<int>(u);
    s.groups.push_back({});
    s.groups.back().name = units[u].name;
  }
  s.units = static_cast<int>(units.size());
  std::vector<int> group_of;
  for (const auto& item : model.named_parameters()) {
    if (!item.value().requires_grad()) continue;
    auto it = unit_of.find(item.key());
    int group = it == unit_of.end() ? -1 : it->second;
    if (group < 0) {
      if (s.root < 0) {
        s.root = static_cast<int>(s.groups.size());
        s.groups.push_back({});
        s.groups.back().name = "root";
      }
      group = s.root;
    }
    State::Param p;
    p.layout = shard_layout(item.key(), item.value().sizes().vec(), s.world);
    p.param = item.value();
    p.group = static_cast<size_t>(group);
    s.groups[p.group].params.push_back(s.params.size());
    s.params.push_back(std::move(p));
  }
  if (s.params.empty())
    throw UserError("fully sharded training needs trainable parameters; the model has none");
  s.gather_dtype = options.param_dtype.value_or(s.params.front().param.scalar_type());

  // Each group's flat shard: its parameters' rows of this rank, padded, one after the other.
  torch::NoGradGuard no_grad;
  for (auto& g : s.groups) {
    int64_t elements = 0;
    for (size_t k : g.params) {
      State::Param& p = s.params[k];
      if (p.param.scalar_type() != s.params[g.params.front()].param.scalar_type()) {
        throw UserError(fmt::format(
            "fully sharded training: unit {} mixes parameter dtypes ({} is {}); FSDP gathers "
            "one flat buffer per unit",
            g.name, p.layout.name, c10::toString(p.param.scalar_type())));
      }
      p.offset = elements;
      elements += p.layout.rows_per_rank * p.layout.row_numel;
      g.full_bytes += p.param.numel() * static_cast<int64_t>(c10::elementSize(s.gather_dtype));
    }
    const auto options_of =
        g.params.empty() ? torch::TensorOptions() : s.params[g.params.front()].param.options();
    g.flat_shard = torch::zeros({elements}, options_of.requires_grad(false));
    g.flat_grad = torch::zeros({elements}, options_of.requires_grad(false));
    for (size_t k : g.params) {
      State::Param& p = s.params[k];
      const ShardLayout& l = p.layout;
      const int64_t numel = l.rows_per_rank * l.row_numel;
      p.shard = g.flat_shard.narrow(0, p.offset, numel).view(l.shard_shape());
      p.grad_shard = g.flat_grad.narrow(0, p.offset, numel).view(l.shard_shape());
      const int64_t valid = l.valid_rows(s.rank) * l.row_numel;
      if (valid > 0) {
        g.flat_shard.narrow(0, p.offset, valid)
            .copy_(p.param.reshape(-1).narrow(0, s.rank * l.rows_per_rank * l.row_numel, valid));
      }
      if (p.param.scalar_type() != s.gather_dtype) {  // mixed precision: compute in gather dtype
        p.param.set_data(torch::empty(l.shape, p.param.options().dtype(s.gather_dtype)));
      }
      fsdp_storage::free_storage(p.param);
    }
  }
  for (int u = s.units - 1; u >= 0; --u) s.reduce_order.push_back(static_cast<size_t>(u));
  if (s.root >= 0) s.reduce_order.push_back(static_cast<size_t>(s.root));

  State* raw = state.get();
  auto hook =
      std::shared_ptr<FullyShardedDataParallel>(new FullyShardedDataParallel(std::move(state)));
  for (size_t k = 0; k < raw->params.size(); ++k) {
    torch::autograd::impl::set_post_acc_grad_hooks(raw->params[k].param,
                                                   std::make_unique<ShardGradientHook>(raw, k));
  }
  std::vector<ParameterShard> shards;
  const auto& placements = model.tensor_parallel();
  for (const auto& p : raw->params) {
    ParameterShard shard;
    shard.name = p.layout.name;
    shard.shard = p.shard;
    shard.global_shape = p.layout.shape;
    shard.row_offset = raw->rank * p.layout.rows_per_rank;
    shard.rows = p.layout.valid_rows(raw->rank);
    auto placement = placements.find(p.layout.name);
    if (placement != placements.end()) shard.tensor_parallel = placement->second;
    // Replica 0's shards are the checkpoint's (the other replicas hold the same and load them);
    // of a parameter tensor parallelism keeps whole, tp rank 0's.
    shard.saved = mesh.replica == 0 && (shard.tensor_parallel || mesh.tp_index == 0);
    shards.push_back(std::move(shard));
  }
  trainer.set_parallel_layout(sharded_layout(std::move(shards), raw->comm, mesh.tp));
  trainer.add_hook(hook);
  model.add_unit_wrapper(hook);
  const FsdpMemory memory = hook->memory();
  log::info(fmt::format(
      "fully sharded data parallel over {} ranks ({}){}: {} parameters in {} groups, {:.2f} MiB "
      "of parameter shards on this rank (largest unit {:.2f} MiB gathered), reshard after "
      "forward {}, {} accumulation, prefetch {}; weights {} on every rank",
      raw->world, mesh.world->backend_name(),
      raw->replicas > 1 ? fmt::format(", replicated {} times (hybrid sharding)", raw->replicas)
                        : "",
      raw->params.size(), raw->groups.size(), memory.parameter_shards / 1048576.0,
      memory.largest_unit / 1048576.0, options.reshard_after_forward ? "on" : "off",
      options.accumulate_sharded ? "sharded" : "unsharded", options.prefetch ? "on" : "off",
      raw->weights_hash));
  return hook;
}

}  // namespace kiln
