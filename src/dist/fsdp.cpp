// Fully sharded data parallelism: parameters, gradients and optimizer state sharded on dim 0
// over the ranks, gathered per unit around its forward and backward (kiln/dist.h has the
// contract; docs/scale.md the knobs).
//
// Freeing: a gathered parameter's storage (its StorageImpl, which the module's tensor and every
// autograd SavedVariable of it share) is given a fresh allocation before the all-gather's data is
// copied in, and set to a null 0-byte allocation when freed, as FSDP1's _free_storage /
// _alloc_storage resize the storage to 0 and back. The copy goes through variable_data() (a
// tensor sharing the storage but not the version counter), so autograd does not see the regather
// as an in-place modification of a saved tensor.
//
// Mixed precision (FsdpOptions::param_dtype, FSDP2's MixedPrecisionPolicy(param_dtype,
// reduce_dtype = the shards' dtype)): the module's parameters are set (set_data) to param_dtype
// tensors at attach, so they are gathered, computed with and differentiated in that dtype; the
// all-gather sends a param_dtype copy of the shard (half the bytes for bf16), and the full
// gradients are copied into the shards' dtype for the reduce-scatter.
#include <fmt/format.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <map>

#include "dist/replicas.h"
#include "kiln/config.h"
#include "kiln/dist.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/models.h"

namespace kiln {

namespace {

void free_storage(const torch::Tensor& tensor) {
  c10::StorageImpl* storage = tensor.unsafeGetTensorImpl()->storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, tensor.device()));
  storage->set_nbytes(0);
}

void allocate_storage(const torch::Tensor& tensor) {
  c10::StorageImpl* storage = tensor.unsafeGetTensorImpl()->storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(tensor.numel()) * tensor.element_size();
  at::Allocator* allocator = storage->allocator();
  if (allocator == nullptr) allocator = c10::GetAllocator(tensor.device().type());
  storage->set_data_ptr_noswap(allocator->allocate(bytes));
  storage->set_nbytes(bytes);
}

}  // namespace

struct FullyShardedDataParallel::State {
  struct Param {
    ShardLayout layout;
    torch::Tensor param;       // the module's parameter; storage released while not gathered
    torch::Tensor shard;       // this rank's rows: a view of the group's flat shard
    torch::Tensor grad_shard;  // its gradient: a view of the group's flat gradient
    // Mixed precision, unsharded accumulation: the full gradient of the micro-steps so far, in
    // the shards' dtype (as FSDP2 upcasts to reduce_dtype), the low-precision .grad cleared.
    torch::Tensor accumulated;
    int64_t offset = 0;  // elements into the group's flat shard
    size_t group = 0;
    bool ready = false;  // gradient accumulated in this micro-step
  };
  struct Group {
    std::string name;
    std::vector<size_t> params;
    torch::Tensor flat_shard, flat_grad;  // [S]
    int64_t full_bytes = 0;
    bool gathered = false;
    torch::Tensor gather_input;   // [S] the shard cast to the gather dtype, while in flight
    torch::Tensor gather_buffer;  // [W * S] while its all-gather is in flight
    std::unique_ptr<PendingCollective> gather;
    size_t ready = 0;       // parameters whose gradient accumulated this micro-step
    bool launched = false;  // this micro-step's reduce-scatter started
    torch::Tensor reduce_input, reduce_output;
    std::unique_ptr<PendingCollective> reduce;
    std::unique_ptr<PendingCollective> replica_reduce;  // HSDP: reduce_output over the replicas
    bool has_gradient = false;                          // flat_grad holds this step's gradient
  };

  std::shared_ptr<Communicator> comm;       // the shard group (every rank without replicas)
  std::shared_ptr<Communicator> replicate;  // HSDP: the ranks holding the same shards; or null
  int replicas = 1;
  int64_t replica_all_reduces = 0;
  Model* model = nullptr;
  FsdpOptions options;
  int rank = 0, world = 1;
  torch::ScalarType gather_dtype = torch::kFloat;  // of the all-gather and the full parameters
  std::vector<Param> params;                       // trainable parameters, registration order
  std::vector<Group> groups;         // the units in forward order, then the root (when not empty)
  int units = 0;                     // groups [0, units) are Model::units()
  int root = -1;                     // index of the root group, -1 when empty
  std::vector<size_t> reduce_order;  // units last to first, then the root
  size_t next_launch = 0;
  bool communicating = false;  // this micro-step reduce-scatters
  bool in_eval = false;
  int64_t all_gathers = 0, reduce_scatters = 0;
  int64_t gathered_bytes = 0, gathered_peak = 0;
  std::string weights_hash;

  int64_t shard_numel(const Group& g) const { return g.flat_shard.numel(); }

  void account_gathered(int64_t delta) {
    gathered_bytes += delta;
    gathered_peak = std::max(gathered_peak, gathered_bytes);
  }

  void start_gather(size_t index) {
    Group& g = groups[index];
    if (g.gathered || g.gather) return;
    const int64_t S = shard_numel(g);
    if (S == 0) return;
    if (g.flat_shard.scalar_type() != gather_dtype) {
      torch::NoGradGuard no_grad;
      g.gather_input = g.flat_shard.to(gather_dtype);
      account_gathered(static_cast<int64_t>(g.gather_input.nbytes()));
    }
    g.gather_buffer = torch::empty({world * S}, g.flat_shard.options().dtype(gather_dtype));
    account_gathered(static_cast<int64_t>(g.gather_buffer.nbytes()));
    g.gather = comm->all_gather_async(g.gather_input.defined() ? g.gather_input : g.flat_shard,
                                      g.gather_buffer);
    ++all_gathers;
  }

  // Drops the all-gather's buffers (after its data was copied out, or for a prefetch unused).
  void release_gather_buffers(Group& g) {
    for (torch::Tensor* t : {&g.gather_input, &g.gather_buffer}) {
      if (!t->defined()) continue;
      account_gathered(-static_cast<int64_t>(t->nbytes()));
      *t = torch::Tensor();
    }
  }

  // Parameter p's rows out of a group's all-gathered [W * S] buffer into `full` (flat, numel of
  // the full parameter), padding dropped.
  void copy_rows(const Param& p, int64_t S, const torch::Tensor& gathered,
                 torch::Tensor full) const {
    const ShardLayout& l = p.layout;
    for (int r = 0; r < world; ++r) {
      const int64_t n = l.valid_rows(r) * l.row_numel;
      if (n == 0) continue;
      full.narrow(0, r * l.rows_per_rank * l.row_numel, n)
          .copy_(gathered.narrow(0, r * S + p.offset, n));
    }
  }

  void ensure_gathered(size_t index) {
    Group& g = groups[index];
    if (g.gathered) return;
    start_gather(index);
    if (g.gather) {
      g.gather->wait();
      g.gather.reset();
    }
    torch::NoGradGuard no_grad;
    const int64_t S = shard_numel(g);
    for (size_t k : g.params) {
      Param& p = params[k];
      allocate_storage(p.param);
      copy_rows(p, S, g.gather_buffer, torch::Tensor(p.param.variable_data()).view(-1));
    }
    release_gather_buffers(g);
    g.gathered = true;
    account_gathered(g.full_bytes);
  }

  void free_group(size_t index) {
    Group& g = groups[index];
    if (g.gather) {  // a prefetch nobody used: finish it, so no collective is left behind
      g.gather->wait();
      g.gather.reset();
      release_gather_buffers(g);
    }
    if (!g.gathered) return;
    for (size_t k : g.params) free_storage(params[k].param);
    g.gathered = false;
    account_gathered(-g.full_bytes);
  }

  // The group's full gradients (zeros where undefined) into its reduce-scatter input, in the
  // shards' dtype (a mixed-precision gradient is cast here), this rank's chunk after a sum over
  // ranks; frees the full gradients and parameters.
  void launch_reduce(size_t index) {
    Group& g = groups[index];
    g.launched = true;
    const int64_t S = shard_numel(g);
    if (S == 0) return;
    torch::NoGradGuard no_grad;
    g.reduce_input = torch::zeros({world * S}, g.flat_shard.options());
    for (size_t k : g.params) {
      Param& p = params[k];
      torch::Tensor grad = p.param.grad();
      if (p.accumulated.defined()) {
        if (grad.defined()) p.accumulated.add_(grad);
        grad = p.accumulated;
        p.accumulated = torch::Tensor();
      }
      if (!grad.defined()) continue;
      const torch::Tensor flat = grad.reshape(-1);
      const ShardLayout& l = p.layout;
      for (int r = 0; r < world; ++r) {
        const int64_t n = l.valid_rows(r) * l.row_numel;
        if (n == 0) continue;
        g.reduce_input.narrow(0, r * S + p.offset, n)
            .copy_(flat.narrow(0, r * l.rows_per_rank * l.row_numel, n));
      }
      p.param.mutable_grad() = torch::Tensor();
    }
    g.reduce_output = torch::empty({S}, g.flat_shard.options());
    g.reduce = comm->reduce_scatter_sum_async(g.reduce_input, g.reduce_output);
    ++reduce_scatters;
    free_group(index);
  }

  void launch_ready() {
    while (next_launch < reduce_order.size()) {
      const size_t index = reduce_order[next_launch];
      if (groups[index].ready < groups[index].params.size()) return;
      ++next_launch;
      launch_reduce(index);
    }
  }

  void gradient_accumulated(size_t k) {
    Param& p = params[k];
    if (!communicating && p.param.scalar_type() != p.shard.scalar_type() &&
        p.param.grad().defined()) {  // mixed precision: accumulate in the shards' dtype
      torch::NoGradGuard no_grad;
      if (p.accumulated.defined()) {
        p.accumulated.add_(p.param.grad());
      } else {
        p.accumulated = p.param.grad().to(p.shard.scalar_type());
      }
      p.param.mutable_grad() = torch::Tensor();
    }
    if (p.ready) return;
    p.ready = true;
    Group& g = groups[p.group];
    if (++g.ready < g.params.size()) return;
    if (communicating) {
      launch_ready();
    } else {
      free_group(p.group);  // the full gradients stay, accumulating
    }
  }

  // Starts every reduce-scatter of this micro-step not yet started (in order), waits for all,
  // all-reduces each shard over the replicas (HSDP; each started as its reduce-scatter is
  // waited for, in the same order on every rank) and adds them into the sharded gradients.
  void finish_reduces() {
    while (next_launch < reduce_order.size()) launch_reduce(reduce_order[next_launch++]);
    torch::NoGradGuard no_grad;
    for (size_t index : reduce_order) {
      Group& g = groups[index];
      if (!g.reduce) continue;
      g.reduce->wait();
      g.reduce.reset();
      if (replicate) {
        g.replica_reduce = replicate->all_reduce_sum_async(g.reduce_output);
        ++replica_all_reduces;
      }
    }
    for (size_t index : reduce_order) {
      Group& g = groups[index];
      if (!g.reduce_output.defined()) continue;
      if (g.replica_reduce) {
        g.replica_reduce->wait();
        g.replica_reduce.reset();
      }
      g.reduce_output.div_(static_cast<double>(world) * replicas);
      if (g.has_gradient) {
        g.flat_grad.add_(g.reduce_output);
      } else {
        g.flat_grad.copy_(g.reduce_output);
        g.has_gradient = true;
      }
      g.reduce_input = torch::Tensor();
      g.reduce_output = torch::Tensor();
    }
  }

  void begin_micro_step() {
    for (auto& p : params) p.ready = false;
    for (auto& g : groups) {
      g.ready = 0;
      g.launched = false;
    }
    next_launch = 0;
  }

  void before_unit_backward(int unit) {
    ensure_gathered(static_cast<size_t>(unit));
    if (options.prefetch && options.reshard_after_forward && unit > 0)
      start_gather(static_cast<size_t>(unit - 1));
  }

  // Group `index`'s full parameters in the shards' dtype, from an all-gather of the shards
  // (whatever the gather dtype): copies, the module's parameters untouched.
  std::vector<torch::Tensor> gather_exact(size_t index) {
    Group& g = groups[index];
    std::vector<torch::Tensor> out;
    const int64_t S = shard_numel(g);
    torch::Tensor buffer;
    if (S > 0) {
      buffer = torch::empty({world * S}, g.flat_shard.options());
      comm->all_gather_async(g.flat_shard, buffer)->wait();
      ++all_gathers;
    }
    torch::NoGradGuard no_grad;
    for (size_t k : g.params) {
      const Param& p = params[k];
      torch::Tensor full = torch::empty(p.layout.shape, g.flat_shard.options());
      if (full.numel() > 0) copy_rows(p, S, buffer, full.view(-1));
      out.push_back(full);
    }
    return out;
  }
};

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
      free_storage(p.param);
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

NamedTensors FullyShardedDataParallel::shards() const {
  NamedTensors out;
  for (const auto& p : state_->params) out.emplace_back(p.layout.name, p.shard);
  return out;
}

std::vector<ShardLayout> FullyShardedDataParallel::layouts() const {
  std::vector<ShardLayout> out;
  for (const auto& p : state_->params) out.push_back(p.layout);
  return out;
}

std::vector<std::string> FullyShardedDataParallel::group_names() const {
  std::vector<std::string> out;
  for (const auto& g : state_->groups) out.push_back(g.name);
  return out;
}

NamedTensors FullyShardedDataParallel::full_parameters() {
  State& s = *state_;
  std::vector<torch::Tensor> copies(s.params.size());
  for (size_t index = 0; index < s.groups.size(); ++index) {
    std::vector<torch::Tensor> full = s.gather_exact(index);
    for (size_t j = 0; j < full.size(); ++j) copies[s.groups[index].params[j]] = full[j];
  }
  NamedTensors out;
  for (size_t k = 0; k < s.params.size(); ++k) out.emplace_back(s.params[k].layout.name, copies[k]);
  return out;
}

std::string FullyShardedDataParallel::full_weights_hash() {
  State& s = *state_;
  const NamedTensors full = full_parameters();
  // The full values in the module for the hash only; set_data back restores each parameter's
  // own storage (gathered or released) and dtype.
  std::vector<torch::Tensor> own;
  for (size_t k = 0; k < s.params.size(); ++k) {
    own.emplace_back(s.params[k].param.variable_data());
    s.params[k].param.set_data(full[k].second);
  }
  const std::string hash = weights_hash(*s.model);
  for (size_t k = 0; k < s.params.size(); ++k) s.params[k].param.set_data(own[k]);
  return hash;
}

int64_t FullyShardedDataParallel::all_gathers() const {
  return state_->all_gathers;
}
int64_t FullyShardedDataParallel::reduce_scatters() const {
  return state_->reduce_scatters;
}
int64_t FullyShardedDataParallel::replica_all_reduces() const {
  return state_->replica_all_reduces;
}

FsdpMemory FullyShardedDataParallel::memory() const {
  FsdpMemory out;
  for (const auto& g : state_->groups) {
    out.parameter_shards += static_cast<int64_t>(g.flat_shard.nbytes());
    out.gradient_shards += static_cast<int64_t>(g.flat_grad.nbytes());
    out.largest_unit = std::max(out.largest_unit, g.full_bytes);
  }
  out.gathered_peak = state_->gathered_peak;
  out.gathered_now = state_->gathered_bytes;
  return out;
}

void FullyShardedDataParallel::on_micro_step_begin(Trainer&, int micro_step, bool last) {
  State& s = *state_;
  if (micro_step == 0) {
    for (auto& g : s.groups) g.has_gradient = false;
    for (auto& p : s.params) p.accumulated = torch::Tensor();
  } else if (s.options.accumulate_sharded) {
    s.finish_reduces();  // the previous micro-step's
  }
  s.begin_micro_step();
  s.communicating = last || s.options.accumulate_sharded;
  // Units a previous backward left gathered (a gradient that never came): freed.
  for (int u = 0; u < s.units; ++u) s.free_group(static_cast<size_t>(u));
  if (s.root >= 0) s.ensure_gathered(static_cast<size_t>(s.root));
  if (s.options.prefetch && s.units > 0) s.start_gather(0);
}

void FullyShardedDataParallel::on_gradients_ready(Trainer& trainer) {
  State& s = *state_;
  if (!s.communicating) return;
  s.communicating = false;
  PhaseScope phase(trainer, Phase::kComm);
  s.finish_reduces();
  for (size_t index = 0; index < s.groups.size(); ++index) s.free_group(index);
  for (auto& p : s.params) p.shard.mutable_grad() = p.grad_shard;
}

void FullyShardedDataParallel::on_phase_begin(Trainer&, Phase phase) {
  State& s = *state_;
  if (phase != Phase::kEval || s.in_eval) return;
  s.in_eval = true;
  if (s.root >= 0) s.ensure_gathered(static_cast<size_t>(s.root));
}

void FullyShardedDataParallel::on_phase_end(Trainer&, Phase phase) {
  State& s = *state_;
  if (phase != Phase::kEval || !s.in_eval) return;
  s.in_eval = false;
  for (size_t index = 0; index < s.groups.size(); ++index) s.free_group(index);
}

torch::Tensor FullyShardedDataParallel::run(int unit, const UnitForward& forward,
                                            const torch::Tensor& input) {
  State& s = *state_;
  const auto index = static_cast<size_t>(unit);
  if (torch::autograd::get_current_graph_task_id() != -1) {
    // Called from backward: activation checkpointing recomputes the unit. Gathered for the
    // backward that follows, which frees it (gradient_accumulated); the previous unit's
    // all-gather overlaps it, as in before_unit_backward.
    s.ensure_gathered(index);
    if (s.options.prefetch && unit > 0) s.start_gather(index - 1);
    return forward(input);
  }
  s.ensure_gathered(index);
  if (s.options.prefetch && unit + 1 < s.units) s.start_gather(index + 1);
  torch::Tensor out = forward(input);
  const bool backward_follows = torch::GradMode::is_enabled() && out.requires_grad();
  if (!backward_follows || s.options.reshard_after_forward) s.free_group(index);
  if (backward_follows) {
    State* raw = state_.get();
    out.register_hook([raw, unit](const torch::Tensor&) { raw->before_unit_backward(unit); });
  }
  return out;
}

}  // namespace kiln
