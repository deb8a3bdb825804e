// Fully sharded data parallelism: the gathers around each unit's forward and backward, the
// reduce-scatters (and, hybrid sharded, the replicas' all-reduces), the accessors. The state and
// its notes: fsdp_state.h; building it: fsdp_attach.cpp.

#include <fmt/format.h>

#include "dist/fsdp_state.h"
#include "kiln/dist.h"
#include "kiln/error.h"

namespace kiln {

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
