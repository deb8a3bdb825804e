// AdamW and SGD with torch.optim's semantics: per-parameter step counts, parameters without a
// gradient skipped, fused ATen kernels or the single-tensor reference path.
#include <ATen/ATen.h>

#include <cmath>

#include "kiln/config.h"
#include "kiln/error.h"
#include "kiln/train.h"

namespace kiln {

Optimizer::Optimizer(const Config& config, NamedTensors parameters)
    : Optimizer(OptimOptions::from_config(config), std::move(parameters)) {}

Optimizer::Optimizer(const OptimOptions& options, NamedTensors parameters)
    : options_(options), parameters_(std::move(parameters)) {
  for (const auto& [name, p] : parameters_) decays_.push_back(p.dim() >= 2);
  if (options_.nesterov && (options_.kind != OptimOptions::Kind::kSGD || options_.momentum <= 0)) {
    throw UserError("optim.nesterov = true needs optim.name = \"sgd\" and optim.momentum > 0");
  }
}

void Optimizer::ensure_state() {
  if (!step_tensor_.empty()) return;
  for (const auto& [name, p] : parameters_) {
    if (options_.kind == OptimOptions::Kind::kAdamW) {
      exp_avg_.push_back(torch::zeros_like(p, at::MemoryFormat::Preserve));
      exp_avg_sq_.push_back(torch::zeros_like(p, at::MemoryFormat::Preserve));
    } else if (options_.momentum > 0) {
      momentum_buffer_.push_back(torch::zeros_like(p, at::MemoryFormat::Preserve));
    }
    step_tensor_.push_back(torch::zeros({}, p.options().dtype(torch::kFloat)));
  }
}

void Optimizer::use_lr_tensor(torch::Tensor lr) {
  if (lr.defined() && !options_.fused) {
    throw UserError(
        "a learning rate read on the device (CUDA-graph capture) needs the fused optimizer; set "
        "optim.fused = true");
  }
  lr_tensor_ = std::move(lr);
}

void Optimizer::zero_grad() {
  for (auto& [name, p] : parameters_) p.mutable_grad().reset();
}

NamedTensors Optimizer::state() {
  ensure_state();
  NamedTensors out;
  for (size_t k = 0; k < parameters_.size(); ++k) {
    const std::string& name = parameters_[k].first;
    if (!exp_avg_.empty()) {
      out.emplace_back(name + ".exp_avg", exp_avg_[k]);
      out.emplace_back(name + ".exp_avg_sq", exp_avg_sq_[k]);
    }
    if (!momentum_buffer_.empty()) out.emplace_back(name + ".momentum", momentum_buffer_[k]);
  }
  return out;
}

NamedTensors Optimizer::step_counts() {
  ensure_state();
  NamedTensors out;
  for (size_t k = 0; k < parameters_.size(); ++k) {
    out.emplace_back(parameters_[k].first + ".step", step_tensor_[k]);
  }
  return out;
}

void Optimizer::load_state(const NamedTensors& state, int64_t steps_taken) {
  ensure_state();
  NamedTensors live = this->state();
  if (live.size() != state.size()) {
    throw UserError("optimizer state has " + std::to_string(state.size()) + " tensors, expected " +
                    std::to_string(live.size()) + " (was it saved with another optim.name?)");
  }
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < live.size(); ++k) {
    if (live[k].first != state[k].first ||
        !live[k].second.sizes().equals(state[k].second.sizes())) {
      throw UserError("optimizer state tensor " + state[k].first + " does not match " +
                      live[k].first);
    }
    if (!live[k].second.is_same(state[k].second)) live[k].second.copy_(state[k].second);
  }
  steps_taken_ = steps_taken;
  for (auto& t : step_tensor_) t.fill_(static_cast<double>(steps_taken));
}

void Optimizer::step(double lr, const torch::Tensor& found_nonfinite) {
  torch::NoGradGuard no_grad;
  ensure_state();
  // The fused kernels take the flag where it lives (no host round trip on a device); the
  // reference path reads it on the host.
  const bool on_host = found_nonfinite.defined() && !options_.fused;
  const bool skip = on_host && found_nonfinite.item<float>() != 0;
  ++steps_taken_;
  if (skip) return;
  // Two groups, as nanoGPT and torchtitan do: decayed (dim >= 2) and not decayed. A parameter
  // without a gradient takes no part (its moments and step count stay), as in torch.optim.
  for (bool decay : {true, false}) {
    std::vector<size_t> members;
    for (size_t k = 0; k < parameters_.size(); ++k) {
      if (decays_[k] == decay && parameters_[k].second.grad().defined()) members.push_back(k);
    }
    if (members.empty()) continue;
    const double weight_decay = decay ? options_.weight_decay : 0.0;
    const torch::Tensor flag = on_host ? torch::Tensor() : found_nonfinite;
    if (options_.kind == OptimOptions::Kind::kAdamW) {
      step_adamw(members, lr, weight_decay, flag);
    } else {
      step_sgd(members, lr, weight_decay, flag);
    }
  }
}

void Optimizer::step_adamw(const std::vector<size_t>& members, double lr, double wd,
                           const torch::Tensor& found_nonfinite) {
  std::vector<torch::Tensor> params, grads, avgs, avg_sqs, steps;
  for (size_t k : members) {
    params.push_back(parameters_[k].second);
    grads.push_back(parameters_[k].second.grad());
    avgs.push_back(exp_avg_[k]);
    avg_sqs.push_back(exp_avg_sq_[k]);
    steps.push_back(step_tensor_[k]);
  }
  const double beta1 = options_.beta1, beta2 = options_.beta2, eps = options_.eps;
  at::_foreach_add_(steps, 1.0);
  if (options_.fused) {
    const auto found =
        found_nonfinite.defined() ? std::optional<at::Tensor>(found_nonfinite) : std::nullopt;
    if (lr_tensor_.defined()) {
      at::_fused_adamw_(params, grads, avgs, avg_sqs, {}, steps, lr_tensor_, beta1, beta2, wd, eps,
                        /*amsgrad=*/false, /*maximize=*/false, /*grad_scale=*/std::nullopt, found);
    } else {
      at::_fused_adamw_(params, grads, avgs, avg_sqs, {}, steps, lr, beta1, beta2, wd, eps,
                        /*amsgrad=*/false, /*maximize=*/false, /*grad_scale=*/std::nullopt, found);
    }
    if (found_nonfinite.defined()) {
      at::_foreach_sub_(steps, std::vector<torch::Tensor>(steps.size(), found_nonfinite));
    }
    return;
  }
  // torch.optim.AdamW, single-tensor path: bias corrections from each parameter's own step.
  for (size_t k = 0; k < params.size(); ++k) {
    const double step = steps[k].item<double>();
    const double bias1 = 1.0 - std::pow(beta1, step);
    const double bias2_sqrt = std::sqrt(1.0 - std::pow(beta2, step));
    params[k].mul_(1.0 - lr * wd);
    avgs[k].lerp_(grads[k], 1.0 - beta1);
    avg_sqs[k].mul_(beta2).addcmul_(grads[k], grads[k], 1.0 - beta2);
    auto denom = (avg_sqs[k].sqrt() / bias2_sqrt).add_(eps);
    params[k].addcdiv_(avgs[k], denom, -lr / bias1);
  }
}

void Optimizer::step_sgd(const std::vector<size_t>& members, double lr, double wd,
                         const torch::Tensor& found_nonfinite) {
  std::vector<torch::Tensor> params, grads, buffers, steps;
  for (size_t k : members) {
    params.push_back(parameters_[k].second);
    grads.push_back(parameters_[k].second.grad());
    steps.push_back(step_tensor_[k]);
    if (!momentum_buffer_.empty()) buffers.push_back(momentum_buffer_[k]);
  }
  const double momentum = options_.momentum;
  // torch.optim.SGD starts a parameter's momentum buffer from its first gradient. With zero
  // dampening that equals momentum * 0 + gradient, so the fused kernel's first-step flag is only
  // needed for the very first call (it copies the gradient, keeping its zero signs).
  const bool first = steps_taken_ == 1;
  at::_foreach_add_(steps, 1.0);
  if (options_.fused) {
    const auto found =
        found_nonfinite.defined() ? std::optional<at::Tensor>(found_nonfinite) : std::nullopt;
    if (lr_tensor_.defined()) {
      at::_fused_sgd_(params, grads, buffers, wd, momentum, lr_tensor_, /*dampening=*/0.0,
                      options_.nesterov, /*maximize=*/false, first, /*grad_scale=*/std::nullopt,
                      found);
    } else {
      at::_fused_sgd_(params, grads, buffers, wd, momentum, lr, /*dampening=*/0.0,
                      options_.nesterov, /*maximize=*/false, first, /*grad_scale=*/std::nullopt,
                      found);
    }
    if (found_nonfinite.defined()) {
      at::_foreach_sub_(steps, std::vector<torch::Tensor>(steps.size(), found_nonfinite));
    }
    return;
  }
  // torch.optim.SGD, single-tensor path (L2 weight decay).
  for (size_t k = 0; k < params.size(); ++k) {
    auto d_p = wd != 0 ? grads[k].add(params[k], wd) : grads[k];
    if (momentum > 0) {
      if (steps[k].item<double>() == 1.0) {
        buffers[k].copy_(d_p);
      } else {
        buffers[k].mul_(momentum).add_(d_p);
      }
      d_p = options_.nesterov ? d_p.add(buffers[k], momentum) : buffers[k];
    }
    params[k].add_(d_p, -lr);
  }
}

}  // namespace kiln
