// The device's achievable matmul rate at the job's shape and precision, timed (docs/plan.md,
// "Measured matmul peak"): the denominator MFU means something against on any device, the CPU
// included, and the figure the plan uses for the row the pilot ran on.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "kiln/plan.h"

namespace kiln {
namespace {

torch::Dtype matmul_peak_dtype(std::string_view precision) {
  const std::string p = compute_precision(precision);
  if (p == "bf16") return torch::kBFloat16;
  if (p == "fp16") return torch::kFloat16;
  return torch::kFloat32;
}

std::string matmul_peak_dtype_name(torch::Dtype dtype) {
  if (dtype == torch::kBFloat16) return "bfloat16";
  if (dtype == torch::kFloat16) return "float16";
  return "float32";
}

void matmul_peak_sync(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

}  // namespace

MatmulShape job_matmul_shape(const ModelShape& shape, const JobShape& job) {
  MatmulShape out;
  if (!shape.tokens && shape.input_dim > 0 && shape.hidden_dim > 0) {  // the mlp's first layer
    out.m = job.micro_batch;
    out.k = shape.input_dim;
    out.n = shape.hidden_dim;
  } else if (shape.n_embd <= 0) {
    // A model of your own whose ModelMath gives no width: a square GEMM [b*s, w] x [w, w] with
    // w = sqrt(the largest unit's parameters), so its 2 b s w^2 FLOPs are the largest unit's
    // forward on the micro-batch (a unit of P weights does 2 P FLOPs per row); the whole model's
    // parameters when no unit is known. With neither, nothing to time: refused, and the caller
    // records the peak as not measured.
    const int64_t weights = shape.math_largest_unit_parameters > 0
                                ? shape.math_largest_unit_parameters
                                : shape.math_parameters;
    if (weights <= 0) {
      throw std::invalid_argument(
          "model " + shape.architecture +
          ": its ModelMath gives neither a width (n_embd) nor parameters, so kiln cannot tell "
          "which GEMM its step is made of; set ModelMath::n_embd or largest_unit_parameters");
    }
    out.m = job.micro_batch * job.seq_len;
    out.k = std::llround(std::sqrt(static_cast<double>(weights)));
    out.n = out.k;
  } else {  // gpt: [b*s, C] x [C, 4C]; llama: [b*s, C] x [C, I] (gate and up projections)
    out.m = job.micro_batch * job.seq_len;
    out.k = shape.n_embd;
    out.n = shape.intermediate_size > 0 ? shape.intermediate_size : 4 * shape.n_embd;
  }
  out.m = std::max<int64_t>(1, out.m);
  out.n = std::max<int64_t>(1, out.n);
  out.k = std::max<int64_t>(1, out.k);
  return out;
}

MatmulPeak measure_matmul_peak(const MatmulShape& shape, std::string_view precision,
                               std::string_view device_text, double budget_seconds) {
  torch::Device device{std::string(device_text)};  // throws for an unknown device string
  torch::NoGradGuard no_grad;
  const torch::Dtype dtype = matmul_peak_dtype(precision);
  const auto options = torch::TensorOptions().dtype(dtype).device(device);
  // Fixed values (not random): the timing does not depend on the generator's state, and the
  // caller's random stream is left untouched.
  const torch::Tensor a = torch::full({shape.m, shape.k}, 0.5, options);
  const torch::Tensor b = torch::full({shape.k, shape.n}, 0.25, options);
  torch::Tensor c = torch::empty({shape.m, shape.n}, options);
  using Clock = std::chrono::steady_clock;
  for (int i = 0; i < 2; ++i) torch::mm_out(c, a, b);  // warm-up: allocation, kernel selection
  matmul_peak_sync(device);
  std::vector<double> times;
  const auto began = Clock::now();
  constexpr size_t kMinRepeats = 5, kMaxRepeats = 10000;
  while (times.size() < kMaxRepeats) {
    const auto t0 = Clock::now();
    torch::mm_out(c, a, b);
    matmul_peak_sync(device);
    times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    const double spent = std::chrono::duration<double>(Clock::now() - began).count();
    if (times.size() >= kMinRepeats && spent >= budget_seconds) break;
  }
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  MatmulPeak out;
  out.shape = shape;
  out.dtype = matmul_peak_dtype_name(dtype);
  out.median_seconds = times[times.size() / 2];
  out.repeats = static_cast<int64_t>(times.size());
  const double flops = 2.0 * static_cast<double>(shape.m) * static_cast<double>(shape.n) *
                       static_cast<double>(shape.k);
  out.flops_per_second = out.median_seconds > 0 ? flops / out.median_seconds : 0;
  return out;
}

nlohmann::json to_json(const MatmulPeak& peak) {
  return {{"flops_per_second", peak.flops_per_second},
          {"m", peak.shape.m},
          {"n", peak.shape.n},
          {"k", peak.shape.k},
          {"dtype", peak.dtype},
          {"median_seconds", peak.median_seconds},
          {"repeats", peak.repeats}};
}

}  // namespace kiln
