#include <ATen/ATen.h>

#include <cmath>
#include <numbers>

#include "kiln/config.h"
#include "kiln/error.h"
#include "kiln/train.h"

namespace kiln {

Optimizer::Optimizer(const Config& config, NamedTensors parameters)
    : name_(config.get_string("optim.name")),
      weight_decay_(config.get_float("optim.weight_decay")),
      beta1_(config.get_float("optim.beta1")),
      beta2_(config.get_float("optim.beta2")),
      eps_(config.get_float("optim.eps")),
      momentum_(config.get_float("optim.momentum")),
      nesterov_(config.get_bool("optim.nesterov")),
      fused_(config.get_bool("optim.fused")),
      parameters_(std::move(parameters)) {
  for (const auto& [name, p] : parameters_) decays_.push_back(p.dim() >= 2);
  if (nesterov_ && momentum_ <= 0) {
    throw UserError("optim.nesterov = true needs optim.momentum > 0");
  }
}

void Optimizer::ensure_state() {
  if (!step_tensor_.empty()) return;
  for (const auto& [name, p] : parameters_) {
    if (name_ == "adamw") {
      exp_avg_.push_back(torch::zeros_like(p, at::MemoryFormat::Preserve));
      exp_avg_sq_.push_back(torch::zeros_like(p, at::MemoryFormat::Preserve));
    } else if (momentum_ > 0) {
      momentum_buffer_.push_back(torch::zeros_like(p, at::MemoryFormat::Preserve));
    }
    step_tensor_.push_back(torch::zeros({}, p.options().dtype(torch::kFloat)));
  }
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
    live[k].second.copy_(state[k].second);
  }
  steps_taken_ = steps_taken;
  for (auto& t : step_tensor_) t.fill_(static_cast<double>(steps_taken));
}

void Optimizer::step(double lr) {
  torch::NoGradGuard no_grad;
  ensure_state();
  // Two groups, as nanoGPT and torchtitan do: decayed (dim >= 2) and not decayed.
  for (bool decay : {true, false}) {
    std::vector<torch::Tensor> params, grads, avgs, avg_sqs, buffers, steps;
    for (size_t k = 0; k < parameters_.size(); ++k) {
      const auto& p = parameters_[k].second;
      if (decays_[k] != decay || !p.grad().defined()) continue;
      params.push_back(p);
      grads.push_back(p.grad());
      steps.push_back(step_tensor_[k]);
      if (!exp_avg_.empty()) avgs.push_back(exp_avg_[k]), avg_sqs.push_back(exp_avg_sq_[k]);
      if (!momentum_buffer_.empty()) buffers.push_back(momentum_buffer_[k]);
    }
    if (params.empty()) continue;
    const double wd = decay ? weight_decay_ : 0.0;
    at::_foreach_add_(steps, 1.0);
    const int64_t step = steps_taken_ + 1;
    if (name_ == "adamw") {
      if (fused_) {
        at::_fused_adamw_(params, grads, avgs, avg_sqs, {}, steps, lr, beta1_, beta2_, wd, eps_,
                          /*amsgrad=*/false, /*maximize=*/false);
        continue;
      }
      // torch.optim.AdamW, single-tensor path.
      const double bias1 = 1.0 - std::pow(beta1_, static_cast<double>(step));
      const double bias2_sqrt = std::sqrt(1.0 - std::pow(beta2_, static_cast<double>(step)));
      for (size_t k = 0; k < params.size(); ++k) {
        params[k].mul_(1.0 - lr * wd);
        avgs[k].lerp_(grads[k], 1.0 - beta1_);
        avg_sqs[k].mul_(beta2_).addcmul_(grads[k], grads[k], 1.0 - beta2_);
        auto denom = (avg_sqs[k].sqrt() / bias2_sqrt).add_(eps_);
        params[k].addcdiv_(avgs[k], denom, -lr / bias1);
      }
    } else {
      const bool first = steps_taken_ == 0;
      if (fused_) {
        at::_fused_sgd_(params, grads, buffers, wd, momentum_, lr, /*dampening=*/0.0, nesterov_,
                        /*maximize=*/false, first);
        continue;
      }
      // torch.optim.SGD, single-tensor path (L2 weight decay).
      for (size_t k = 0; k < params.size(); ++k) {
        auto d_p = wd != 0 ? grads[k].add(params[k], wd) : grads[k];
        if (momentum_ > 0) {
          if (first) {
            buffers[k].copy_(d_p);
          } else {
            buffers[k].mul_(momentum_).add_(d_p);
          }
          d_p = nesterov_ ? d_p.add(buffers[k], momentum_) : buffers[k];
        }
        params[k].add_(d_p, -lr);
      }
    }
  }
  ++steps_taken_;
}

double learning_rate(const Config& config, int64_t step) {
  const double peak = config.get_float("optim.lr");
  const int64_t warmup = config.get_int("optim.warmup_steps");
  if (step < warmup) return peak * static_cast<double>(step + 1) / static_cast<double>(warmup);
  if (config.get_string("optim.schedule") == "constant") return peak;
  const int64_t total = config.get_int("train.steps");
  const double span = static_cast<double>(std::max<int64_t>(1, total - warmup));
  const double progress = std::min(1.0, static_cast<double>(step - warmup) / span);
  const double floor = peak * config.get_float("optim.min_lr_ratio");
  return floor + 0.5 * (1.0 + std::cos(std::numbers::pi * progress)) * (peak - floor);
}

}  // namespace kiln
