// The pilot's memory: one optimizer step metered (measure_step_memory, kiln/pilot.h) and set
// beside the memory model's estimate part by part (rungs/pilot_memory.h).
#include "rungs/pilot_memory.h"

#include <fmt/format.h>

#include <cmath>
#include <set>

#include "core/strings.h"
#include "kiln/memory.h"
#include "kiln/models.h"

namespace kiln {
namespace {

// Bytes of the distinct storages behind `tensors` (views of one flat buffer count once; a
// parameter whose storage FSDP released counts 0).
double storage_bytes(const std::vector<torch::Tensor>& tensors) {
  std::set<const void*> seen;
  double total = 0;
  for (const auto& t : tensors) {
    if (!t.defined()) continue;
    const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
    if (!seen.insert(storage).second) continue;
    total += static_cast<double>(storage->nbytes());
  }
  return total;
}

}  // namespace

MemoryComparison compare_memory(const StepMemory& measured, const MemoryEstimate& estimate,
                                const JobShape& job) {
  const double held_gradients = job.strategy == "none" ? 0.0 : estimate.gradients_after_step;
  const double estimated_held = estimate.parameters + estimate.optimizer + held_gradients;
  const double estimated_working = estimate.step_peak() - estimated_held;
  struct Row {
    const char* name;
    double measured, estimated;
  };
  const std::vector<Row> rows = {
      {"parameters", measured.parameters_bytes, estimate.parameters},
      {"optimizer state", measured.optimizer_bytes, estimate.optimizer},
      {"gradient buffers held across steps", measured.held_gradient_bytes, held_gradients},
      {"gradients after the step", measured.gradients_after_step_bytes,
       estimate.gradients_after_step},
      {"the step's working memory (activations, logits, gradients, buffers) at its peak",
       measured.step_peak_bytes, estimated_working},
  };
  MemoryComparison out;
  out.ratio = estimate.step_peak() > 0 ? measured.peak_bytes() / estimate.step_peak() : 0;
  out.working_ratio = estimated_working > 0 ? measured.step_peak_bytes / estimated_working : 0;
  double largest = -1;
  for (const Row& row : rows) {
    out.parts.push_back({row.name, row.measured, row.estimated});
    const double difference = std::abs(row.measured - row.estimated);
    if (difference > largest) {
      largest = difference;
      out.worst = fmt::format("{}, {} measured vs {} estimated", row.name,
                              format_bytes(row.measured), format_bytes(row.estimated));
    }
  }
  out.table_text = fmt::format(
      "params {}, optimizer {}, gradients {}, the step's working memory {} measured vs {} "
      "estimated (peak at {})",
      format_bytes(measured.parameters_bytes), format_bytes(measured.optimizer_bytes),
      format_bytes(measured.gradients_after_step_bytes), format_bytes(measured.step_peak_bytes),
      format_bytes(estimated_working), estimate.peak_at);
  return out;
}

StepMemory measure_step_memory(Trainer& trainer, const torch::Device& device,
                               double held_gradient_bytes) {
  StepMemory out;
  std::vector<torch::Tensor> parameters, state;
  for (const auto& p : trainer.model().parameters()) parameters.push_back(p);
  for (const auto& [name, p] : trainer.optimizer().parameters()) parameters.push_back(p);
  for (const auto& [name, t] : trainer.optimizer().state()) state.push_back(t);
  out.parameters_bytes = storage_bytes(parameters);
  out.optimizer_bytes = storage_bytes(state);
  out.held_gradient_bytes = held_gradient_bytes;
  reset_peak_memory(device);
  int64_t meter_peak = 0;
  {
    MemoryMeter meter;
    out.stats = trainer.train_step(/*sync=*/true);
    meter.stop();
    meter_peak = meter.peak_bytes(device);
  }
  const PeakMemory process = read_peak_memory(device);
  out.step_peak_bytes = device.is_cuda() && process.allocated_bytes > 0
                            ? process.allocated_bytes - out.held_bytes()
                            : static_cast<double>(meter_peak);
  if (device.is_cpu()) out.process_peak_rss_bytes = process.allocated_bytes;
  out.reserved_bytes = process.reserved_bytes;
  std::vector<torch::Tensor> gradients;
  for (const auto& [name, p] : trainer.optimizer().parameters())
    if (p.grad().defined()) gradients.push_back(p.grad());
  out.gradients_after_step_bytes = storage_bytes(gradients);
  return out;
}

}  // namespace kiln
