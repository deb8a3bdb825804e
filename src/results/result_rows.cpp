// The rows a rung prints under its name and report.md shows (kiln/results.h result_rows), rendered
// from the rung's typed result: what the terminal says is what <rung>.json holds.
#include <fmt/format.h>

#include "core/strings.h"
#include "kiln/results.h"

namespace kiln {

ResultRows result_rows(const BaselineResult& b) {
  ResultRows t;
  if (!b.status.measured) return t;
  t.emplace_back("throughput", b.tokens_per_second
                                   ? fmt::format("{:.0f} tokens/s ({:.1f} sequences/s)",
                                                 *b.tokens_per_second, b.samples_per_second)
                                   : fmt::format("{:.0f} samples/s", b.samples_per_second));
  t.emplace_back("step time", fmt::format("median {:.2f} ms, p10 {:.2f} ms, p90 {:.2f} ms",
                                          1e3 * b.step_seconds.median, 1e3 * b.step_seconds.p10,
                                          1e3 * b.step_seconds.p90));
  t.emplace_back("data wait", fmt::format("{:.1f}% of step time", 100 * b.data_wait_share));
  t.emplace_back("peak memory", b.peak_allocated_bytes >= 0
                                    ? format_bytes(b.peak_allocated_bytes) +
                                          (b.device == "cpu" ? " (process peak RSS over one step)"
                                                             : " max allocated")
                                    : b.peak_memory_method);
  t.emplace_back("model state",
                 fmt::format("params {}, grads {}, optimizer {}", format_bytes(b.parameters_bytes),
                             format_bytes(b.gradients_bytes), format_bytes(b.optimizer_bytes)));
  t.emplace_back("compute",
                 fmt::format("{:.3g} FLOP/sample, {:.3g} FLOP/s{}", b.flops_per_sample,
                             b.achieved_flops_per_second,
                             b.mfu ? fmt::format(", MFU {:.1f}%", 100 * *b.mfu)
                                   : ", MFU n/a (device not in the hardware catalog; set "
                                     "baseline.peak_flops_per_second)") +
                     // Against the job's largest GEMM timed on this device (any device).
                     (b.mfu_of_matmul_peak && b.matmul_peak
                          ? fmt::format("; {:.1f}% of the measured {} matmul peak ({:.3g} "
                                        "FLOP/s, {}x{}x{})",
                                        100 * *b.mfu_of_matmul_peak, b.matmul_peak->dtype,
                                        b.matmul_peak->flops_per_second, b.matmul_peak->m,
                                        b.matmul_peak->n, b.matmul_peak->k)
                          : ""));
  t.emplace_back("loss", fmt::format("{:.4f} -> {:.4f}", b.loss_start, b.loss_end));
  t.emplace_back("val loss", fmt::format("{:.4f} -> {:.4f}", b.val_loss_initial, b.val_loss_final) +
                                 (b.val_accuracy_final ? fmt::format(" (accuracy {:.1f}%)",
                                                                     100 * *b.val_accuracy_final)
                                                       : ""));
  return t;
}

ResultRows result_rows(const CheckpointResult& c) {
  ResultRows t;
  // Rows only for a drill that got to its comparison: a failed stage says why in the verdict.
  if (!c.status.measured || !c.losses_compared) return t;
  const auto or_dash = [](const std::optional<int64_t>& v) {
    return v ? std::to_string(*v) : std::string("-");
  };
  t.emplace_back("checkpoint",
                 fmt::format("step {} of {}, {}, resumes at batch {} of epoch {}", c.drill_steps,
                             c.total_steps, format_bytes(c.checkpoint_bytes.value_or(0)),
                             or_dash(c.resume_batch_in_epoch), or_dash(c.resume_epoch)));
  t.emplace_back("kill", c.killed.value_or(false) ? "SIGKILL after the commit"
                                                  : "the run ended before the kill landed");
  t.emplace_back("verify", "checksums and headers ok");
  t.emplace_back("losses after resume",
                 c.losses_bitwise_equal.value_or(false)
                     ? fmt::format("{0}/{0} bitwise equal", *c.losses_compared)
                     : fmt::format("{} compared, not all bitwise equal (max |diff| {:.3g})",
                                   *c.losses_compared, c.max_abs_loss_difference.value_or(0)));
  t.emplace_back("final parameters",
                 c.parameters_bitwise_equal.value_or(false) ? "bitwise equal" : "differ");
  t.emplace_back("final optimizer state",
                 c.optimizer_state_bitwise_equal.value_or(false) ? "bitwise equal" : "differ");
  if (c.seconds) t.emplace_back("drill time", format_duration(*c.seconds));
  return t;
}

ResultRows result_rows(const PlanResult& p) {
  ResultRows t;
  for (const auto& row : p.rows) {
    std::string value = fmt::format("{}, {} GPUs", row.strategy_text(), row.gpus);
    if (row.fits_memory) {
      value += fmt::format(", step {}, {} days, ETTR {:.1f}%, checkpoint every {}",
                           format_duration(row.step_seconds),
                           row.wall_days ? fmt::format("{:.2f}", *row.wall_days) : "never",
                           100 * row.ettr, format_duration(row.checkpoint_interval_seconds));
      for (const auto& [days, r] :
           {std::pair{"7 d", &row.reservation_7d}, std::pair{"30 d", &row.reservation_30d}}) {
        value += fmt::format("; {}: {}{}", days, r->fits ? "fits" : "no",
                             r->cost ? fmt::format(" ({:.0f})", *r->cost) : "");
      }
    }
    t.emplace_back(row.hardware, value);
  }
  t.emplace_back("recommendation", p.recommendation_text);
  return t;
}

}  // namespace kiln
