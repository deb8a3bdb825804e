// train.activation_checkpointing = "block": a UnitWrapper whose autograd node keeps only the
// unit's input and recomputes the unit in backward (LibTorch has no torch.utils.checkpoint).
//
// The unit's parameters are inputs of the node, so the outer graph's own AccumulateGrad nodes
// receive their gradients (the same tensors, in the same order, as without checkpointing: the
// bits match), and a unit whose input needs no gradient (the mlp's first layer) still trains.
// The recomputation runs with the autocast state and the CPU/CUDA generator state the forward
// had, so autocast casts and random ops (dropout, if a unit ever has one) repeat exactly.
#include "train/activation_checkpointing.h"

#include <ATen/Context.h>
#include <fmt/format.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <map>

#include "kiln/error.h"
#include "train/precision.h"

namespace kiln {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What a backward needs to recompute one unit call.
struct Recompute : torch::CustomClassHolder {
  UnitForward forward;
  std::vector<AutocastState> autocast;                       // CPU, and the input's device
  std::vector<std::pair<at::Generator, torch::Tensor>> rng;  // generator, state at forward
};

std::vector<at::Generator> generators_for(const torch::Tensor& input) {
  std::vector<at::Generator> out = {at::globalContext().defaultGenerator(at::kCPU)};
  if (input.device().type() != at::kCPU) {
    out.push_back(at::globalContext().defaultGenerator(input.device()));
  }
  return out;
}

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, c10::intrusive_ptr<Recompute> recompute,
                               const torch::Tensor& input, at::TensorList parameters) {
    // The parameters are inputs for the graph's sake (their gradients leave through this node);
    // the unit's forward captures them itself.
    variable_list saved = {input};
    saved.insert(saved.end(), parameters.begin(), parameters.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(recompute);
    return recompute->forward(input);  // grad mode is off here: no activation is kept
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto recompute =
        c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["recompute"].toCapsule());
    const variable_list saved_variables = ctx->get_saved_variables();
    const torch::Tensor& saved = saved_variables[0];
    torch::Tensor input = saved.detach();
    input.requires_grad_(saved.requires_grad());

    // Recompute with the forward's RNG and autocast state; restore both after.
    std::vector<torch::Tensor> rng_now;
    for (auto& [generator, state] : recompute->rng) {
      std::lock_guard lock(generator.mutex());
      rng_now.push_back(generator.get_state());
      generator.set_state(state);
    }
    torch::Tensor output;
    {
      std::vector<std::unique_ptr<AutocastGuard>> autocast;
      for (const AutocastState& state : recompute->autocast) {
        autocast.push_back(std::make_unique<AutocastGuard>(state));
      }
      torch::AutoGradMode grad_mode(true);
      output = recompute->forward(input);
      autocast.clear();  // the guards restore in reverse order
    }
    for (size_t k = 0; k < recompute->rng.size(); ++k) {
      auto& generator = recompute->rng[k].first;
      std::lock_guard lock(generator.mutex());
      generator.set_state(rng_now[k]);
    }

    // Gradients of the input and of every parameter the unit used, from the recomputed graph;
    // undefined for those that need none. saved_variables[0] stands for the detached input.
    variable_list with_respect_to;
    std::vector<size_t> position;  // index into saved_variables of each with_respect_to entry
    for (size_t k = 0; k < saved_variables.size(); ++k) {
      const torch::Tensor& x = k == 0 ? input : saved_variables[k];
      if (!x.requires_grad()) continue;
      with_respect_to.push_back(x);
      position.push_back(k);
    }
    variable_list out(saved_variables.size() + 1);  // [0]: the Recompute capsule
    if (!with_respect_to.empty() && output.requires_grad()) {
      const variable_list grads =
          torch::autograd::grad({output}, with_respect_to, {grad_outputs[0]},
                                /*retain_graph=*/false, /*create_graph=*/false,
                                /*allow_unused=*/true);
      for (size_t k = 0; k < grads.size(); ++k) out[position[k] + 1] = grads[k];
    }
    return out;
  }
};

class ActivationCheckpointing final : public UnitWrapper {
 public:
  explicit ActivationCheckpointing(std::vector<std::vector<torch::Tensor>> parameters)
      : parameters_(std::move(parameters)) {}

  torch::Tensor run(int unit, const UnitForward& forward, const torch::Tensor& input) override {
    // Evaluation (no grad) and units whose graph would need nothing keep the plain forward.
    if (!torch::GradMode::is_enabled()) return forward(input);
    auto recompute = c10::make_intrusive<Recompute>();
    recompute->forward = forward;
    recompute->autocast.push_back(AutocastState::current(c10::DeviceType::CPU));
    if (input.device().type() != at::kCPU) {
      recompute->autocast.push_back(AutocastState::current(input.device().type()));
    }
    for (auto& generator : generators_for(input)) {
      std::lock_guard lock(generator.mutex());
      recompute->rng.emplace_back(generator, generator.get_state());
    }
    return CheckpointFunction::apply(recompute, input,
                                     at::TensorList(parameters_.at(static_cast<size_t>(unit))));
  }

 private:
  std::vector<std::vector<torch::Tensor>> parameters_;  // per unit, Model::units() order
};

}  // namespace

std::shared_ptr<UnitWrapper> make_activation_checkpointing(Model& model,
                                                           const std::vector<ModelUnit>& units) {
  std::map<std::string, torch::Tensor> by_name;
  for (const auto& item : model.named_parameters()) by_name.emplace(item.key(), item.value());
  std::vector<std::vector<torch::Tensor>> parameters;
  for (const ModelUnit& unit : units) {
    auto& list = parameters.emplace_back();
    for (const std::string& name : unit.parameters) {
      auto it = by_name.find(name);
      if (it == by_name.end()) {
        throw std::logic_error(
            fmt::format("model unit {} names parameter {}, which the model "
                        "does not have",
                        unit.name, name));
      }
      list.push_back(it->second);
    }
  }
  return std::make_shared<ActivationCheckpointing>(std::move(parameters));
}

}  // namespace kiln
