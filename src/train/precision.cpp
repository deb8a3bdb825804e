// train.precision: the autocast scope and the fp16 dynamic loss scaler (torch.amp.GradScaler's
// algorithm on ATen's own kernels, with no host synchronisation in a step).
#include "train/precision.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "kiln/error.h"

namespace kiln {

const char* precision_name(TrainOptions::Precision precision) {
  switch (precision) {
    case TrainOptions::Precision::kFp32:
      return "fp32";
    case TrainOptions::Precision::kBf16Mixed:
      return "bf16-mixed";
    case TrainOptions::Precision::kFp16Mixed:
      return "fp16-mixed";
  }
  return "?";
}

torch::ScalarType compute_dtype(TrainOptions::Precision precision) {
  switch (precision) {
    case TrainOptions::Precision::kBf16Mixed:
      return torch::kBFloat16;
    case TrainOptions::Precision::kFp16Mixed:
      return torch::kHalf;
    case TrainOptions::Precision::kFp32:
      break;
  }
  return torch::kFloat;
}

// ---- autocast ----------------------------------------------------------------------------------

AutocastState AutocastState::current(c10::DeviceType device_type) {
  return {device_type, at::autocast::is_autocast_enabled(device_type),
          at::autocast::get_autocast_dtype(device_type), at::autocast::is_autocast_cache_enabled()};
}

AutocastGuard::AutocastGuard(const AutocastState& state)
    : previous_(AutocastState::current(state.device_type)) {
  at::autocast::set_autocast_enabled(state.device_type, state.enabled);
  at::autocast::set_autocast_dtype(state.device_type, state.dtype);
  at::autocast::set_autocast_cache_enabled(state.cache_enabled);
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(previous_.device_type, previous_.enabled);
  at::autocast::set_autocast_dtype(previous_.device_type, previous_.dtype);
  at::autocast::set_autocast_cache_enabled(previous_.cache_enabled);
}

// ---- the precision policy ----------------------------------------------------------------------

MixedPrecision::MixedPrecision(TrainOptions::Precision precision, const torch::Device& device)
    : precision_(precision), device_(device) {
  if (!scales_loss()) return;
  const auto on = torch::TensorOptions().device(device_);
  scale_ = torch::full({1}, init_scale_, on.dtype(torch::kFloat));
  growth_tracker_ = torch::zeros({1}, on.dtype(torch::kInt));
  overflow_since_sync_ = torch::zeros({}, on.dtype(torch::kFloat64));
}

std::unique_ptr<AutocastGuard> precision_autocast(TrainOptions::Precision precision,
                                                  c10::DeviceType device_type) {
  if (precision == TrainOptions::Precision::kFp32) return nullptr;
  return std::make_unique<AutocastGuard>(
      AutocastState{device_type, true, compute_dtype(precision), true});
}

std::unique_ptr<AutocastGuard> MixedPrecision::autocast_scope() const {
  return precision_autocast(precision_, device_.type());
}

torch::Tensor MixedPrecision::unscale_gradients(const std::vector<torch::Tensor>& gradients) {
  if (!scales_loss()) return {};
  torch::Tensor found = torch::zeros({1}, scale_.options());
  // GradScaler.unscale_: the reciprocal in float64, then float32.
  const torch::Tensor inv_scale = scale_.to(torch::kFloat64).reciprocal().to(torch::kFloat);
  if (!gradients.empty())
    at::_amp_foreach_non_finite_check_and_unscale_(gradients, found, inv_scale);
  return found.squeeze();
}

void MixedPrecision::update(const torch::Tensor& found_overflow, const torch::Tensor& loss) {
  if (!scales_loss()) return;
  at::_amp_update_scale_(scale_, growth_tracker_, found_overflow.reshape({1}), growth_factor_,
                         backoff_factor_, growth_interval_);
  overflow_since_sync_ += at::logical_and(found_overflow > 0, at::isfinite(loss));
}

torch::Tensor MixedPrecision::sync_values() const {
  if (!scales_loss())
    return torch::zeros({2}, torch::TensorOptions().device(device_).dtype(torch::kFloat64));
  return at::cat({overflow_since_sync_.reshape({1}), scale_.to(torch::kFloat64)});
}

void MixedPrecision::reset_since_sync() {
  if (scales_loss()) overflow_since_sync_.zero_();
}

nlohmann::json MixedPrecision::state() const {
  if (!scales_loss()) return nullptr;
  return {{"scale", scale_.item<float>()},
          {"growth_factor", growth_factor_},
          {"backoff_factor", backoff_factor_},
          {"growth_interval", growth_interval_},
          {"growth_tracker", growth_tracker_.item<int>()},
          {"overflow_steps", overflow_steps_}};
}

void MixedPrecision::load_state(const nlohmann::json& state) {
  if (!scales_loss() || state.is_null()) return;
  try {
    const double scale = state.at("scale").get<double>();
    const int tracker = state.at("growth_tracker").get<int>();
    if (!(scale > 0) || tracker < 0) throw std::invalid_argument("out of range");
    scale_.fill_(scale);
    growth_tracker_.fill_(tracker);
    overflow_steps_ = state.value("overflow_steps", int64_t{0});
  } catch (const std::exception& e) {
    throw UserError(fmt::format(
        "the checkpoint's training_state.grad_scaler {} is not a loss scaler's state ({}); "
        "resume from a checkpoint kiln wrote with train.precision = \"fp16-mixed\"",
        state.dump(), e.what()));
  }
}

}  // namespace kiln
