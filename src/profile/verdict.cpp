// The bottleneck verdict, profile.json and the printed tables.
#include <fmt/format.h>

#include <algorithm>

#include "core/strings.h"
#include "kiln/config.h"
#include "kiln/profile.h"

namespace kiln {
namespace {

using nlohmann::json;

double phase_share(const TraceAnalysis& analysis, const std::string& phase) {
  for (const auto& p : analysis.phases) {
    if (p.phase == phase) return p.share;
  }
  return 0;
}

double percent(double share) {
  return 100.0 * share;
}

// " (now 4)", or "" when the job's setting is unknown (-1: traces analysed without their config).
std::string now(int64_t value) {
  return value < 0 ? "" : fmt::format(" (now {})", value);
}

// `text` cut to `width` characters, "..." marking the cut.
std::string shorten(std::string_view text, size_t width) {
  if (text.size() <= width) return std::string(text);
  return fmt::format("{}...", text.substr(0, width - 3));
}

std::string format_us(double us) {
  if (us >= 1e6) return fmt::format("{:.2f} s", us * 1e-6);
  if (us >= 1e3) return fmt::format("{:.2f} ms", us * 1e-3);
  return fmt::format("{:.1f} us", us);
}

}  // namespace

Verdict decide_bottleneck(const TraceAnalysis& analysis, const VerdictThresholds& thresholds,
                          const VerdictContext& context) {
  Verdict v;
  const bool gpu = context.cuda && analysis.has_gpu;
  const auto& g = analysis.gpu;

  // The inputs.
  const double data_share = phase_share(analysis, "data_wait");
  const double comm_phase_share = phase_share(analysis, "comm");
  // On the GPU, communication that compute does not hide is exposed.
  const double exposed_comm_kernel_share =
      gpu && g.kernel_us > 0
          ? (g.communication_us * (1.0 - std::max(0.0, g.comm_overlap_share))) / g.kernel_us
          : 0;
  const double comm_share = std::max(comm_phase_share, exposed_comm_kernel_share);
  double peak_bytes = context.peak_memory_bytes;
  const std::string memory_device = context.cuda ? "cuda" : "cpu";
  for (const auto& m : analysis.memory) {
    if (m.device.rfind(memory_device, 0) == 0)
      peak_bytes = std::max(peak_bytes, m.peak_allocated_bytes);
  }
  const double capacity =
      analysis.device_memory_bytes > 0 ? analysis.device_memory_bytes : context.device_memory_bytes;
  const double memory_fraction = peak_bytes > 0 && capacity > 0 ? peak_bytes / capacity : -1;
  const double gpu_idle_share = gpu && g.kernel_us > 0 ? g.idle_us / g.kernel_us : 0;
  const bool idle_mostly_host = g.host_wait_us >= std::max(g.kernel_wait_us, g.other_wait_us);
  const OperatorStats* top = analysis.operators.empty() ? nullptr : &analysis.operators.front();
  double total_self = 0;
  for (const auto& op : analysis.operators) total_self += gpu ? op.self_device_us : op.self_cpu_us;
  const double top_share =
      top && total_self > 0 ? (gpu ? top->self_device_us : top->self_cpu_us) / total_self : 0;

  v.numbers = {
      {"data_wait_share", data_share},
      {"comm_share", comm_share},
      {"comm_phase_share", comm_phase_share},
      {"peak_memory_bytes", peak_bytes > 0 ? json(peak_bytes) : json(nullptr)},
      {"device_memory_bytes", capacity > 0 ? json(capacity) : json(nullptr)},
      {"memory_fraction", memory_fraction >= 0 ? json(memory_fraction) : json(nullptr)},
      {"mean_op_us", analysis.mean_op_us},
      {"operator_share", analysis.operator_share},
      {"top_operator", top ? json(top->name) : json(nullptr)},
      {"top_operator_share", top_share},
      {"thresholds",
       {{"data_bound_share", thresholds.data_bound_share},
        {"comm_bound_share", thresholds.comm_bound_share},
        {"memory_bound_fraction", thresholds.memory_bound_fraction},
        {"host_bound_op_us", thresholds.host_bound_op_us},
        {"gpu_idle_share", thresholds.gpu_idle_share}}},
  };
  if (gpu) {
    v.numbers["gpu_idle_share"] = gpu_idle_share;
    v.numbers["exposed_comm_kernel_share"] = exposed_comm_kernel_share;
  }

  auto& a = v.actions;
  if (data_share >= thresholds.data_bound_share) {
    v.bottleneck = "data-bound";
    v.reason =
        fmt::format("data-bound: the step waits for data {:.1f}% of its time (threshold {:.0f}%)",
                    percent(data_share), percent(thresholds.data_bound_share));
    a.push_back(
        fmt::format("raise data.num_workers{} so batches are built in parallel, ahead of the step",
                    now(context.num_workers)));
    a.push_back(fmt::format("raise data.prefetch{} so bursts of slow batches are absorbed",
                            now(context.prefetch)));
    a.push_back(
        "make the dataset's get() cheaper: pre-tokenize to a tokens .bin (data.name = \"tokens\"), "
        "memory-map instead of decoding per sample");
    if (context.cuda)
      a.push_back(
          "keep batches in pinned memory with non-blocking copies (the loader does this on CUDA)");
  } else if (comm_share >= thresholds.comm_bound_share) {
    v.bottleneck = "communication-bound";
    v.reason = fmt::format(
        "communication-bound: exposed communication takes {:.1f}% of the step (threshold {:.0f}%)",
        percent(comm_share), percent(thresholds.comm_bound_share));
    a.push_back(
        "tune the gradient bucket size so all-reduce of early buckets overlaps the rest of "
        "backward");
    a.push_back(fmt::format(
        "accumulate more micro-batches per step (train.grad_accum_steps{}) to all-reduce "
        "less often",
        now(context.grad_accum_steps)));
    a.push_back(
        fmt::format("raise the per-rank batch (train.batch_size{}) so compute hides communication",
                    now(context.batch_size)));
    a.push_back("check the interconnect (NCCL over NVLink/InfiniBand, not TCP)");
    a.push_back(
        "under FSDP (dist.strategy = \"fsdp\"), dist.reshard_after_forward = false keeps the "
        "gathered parameters until backward and skips its all-gather, where memory allows");
  } else if (memory_fraction >= thresholds.memory_bound_fraction) {
    v.bottleneck = "memory-bound";
    v.reason = fmt::format(
        "memory-bound: peak allocated {} is {:.1f}% of device memory {} (threshold {:.0f}%)",
        format_bytes(peak_bytes), percent(memory_fraction), format_bytes(capacity),
        percent(thresholds.memory_bound_fraction));
    a.push_back(
        fmt::format("halve train.batch_size{} and double train.grad_accum_steps{}: the same "
                    "effective batch with half the activations",
                    now(context.batch_size), now(context.grad_accum_steps)));
    a.push_back(
        "activation checkpointing: recompute activations in backward instead of keeping them "
        "(train.activation_checkpointing = \"block\")");
    a.push_back(
        "shard parameters, gradients and optimizer state across ranks (FSDP: dist.strategy = "
        "\"fsdp\", or \"auto\" to choose from memory; kiln plan sizes it)");
    a.push_back(
        "train in bf16 mixed precision to halve activation memory (train.precision = "
        "\"bf16-mixed\")");
  } else if ((!gpu && analysis.mean_op_us < thresholds.host_bound_op_us) ||
             (gpu && gpu_idle_share >= thresholds.gpu_idle_share && idle_mostly_host)) {
    v.bottleneck = "host-bound";
    v.reason =
        gpu ? fmt::format(
                  "host/launch-bound: the GPU is idle {:.1f}% of the time (threshold {:.0f}%), "
                  "{:.0f}% of it waiting for the host to launch kernels",
                  percent(gpu_idle_share), percent(thresholds.gpu_idle_share),
                  g.idle_us > 0 ? percent(g.host_wait_us / g.idle_us) : 0.0)
            : fmt::format(
                  "host/launch-bound: operators take {:.1f} us each on average (threshold {:.0f} "
                  "us), "
                  "{:.0f} calls per step; per-call dispatch and allocation dominate the math",
                  analysis.mean_op_us, thresholds.host_bound_op_us,
                  analysis.steps > 0
                      ? static_cast<double>(analysis.step_ops) / static_cast<double>(analysis.steps)
                      : 0.0);
    a.push_back(fmt::format("raise train.batch_size{} so each operator does more work per call",
                            now(context.batch_size)));
    a.push_back(
        context.cuda
            ? "capture the step as a CUDA graph to remove per-kernel launch cost (the compile "
              "rung: kiln compile with compile.backend = \"inductor+cudagraphs\")"
            : "fuse small operators: a compiled step skips per-call dispatch (the compile rung: "
              "kiln compile with compile.backend = \"inductor\")");
    a.push_back(
        "prefer fused kernels: optim.fused = true, fused attention, fewer elementwise passes");
  } else {
    v.bottleneck = "compute-bound";
    v.reason = top ? fmt::format(
                         "compute-bound: operators take {:.1f} us each on average (host-bound "
                         "below {:.0f} us); "
                         "{} takes {:.1f}% of {} time",
                         analysis.mean_op_us, thresholds.host_bound_op_us, top->name,
                         percent(top_share), gpu ? "device" : "operator")
                   : "compute-bound: no other bottleneck applies";
    if (gpu) {
      v.reason = fmt::format(
          "compute-bound: the GPU computes {:.1f}% of the time, idle {:.1f}%; {} takes {:.1f}% of "
          "device time",
          g.kernel_us > 0 ? percent(g.compute_us / g.kernel_us) : 0.0, percent(gpu_idle_share),
          top ? top->name : "?", percent(top_share));
    }
    a.push_back(
        "the math dominates: compare achieved FLOP/s with the device peak (baseline rung, MFU)");
    a.push_back(
        context.cuda
            ? "bf16 tensor-core matmuls (train.precision = \"bf16-mixed\"), and fusing the "
              "elementwise operators (the compile rung: kiln compile with compile.backend = "
              "\"inductor\")"
            : "fuse the elementwise operators around the matmuls (the compile rung: kiln compile "
              "with compile.backend = \"inductor\")");
    a.push_back(fmt::format(
        "spread the work: more ranks with data parallelism (the scale rung, "
        "dist.scale_processes){}",
        context.world_size > 0 ? fmt::format(", world size now {}", context.world_size) : ""));
  }
  v.numbers["bottleneck"] = v.bottleneck;
  v.numbers["reason"] = v.reason;
  v.numbers["actions"] = v.actions;
  return v;
}

json analysis_to_json(const TraceAnalysis& analysis, int top_operators) {
  json operators = json::array();
  for (size_t k = 0; k < analysis.operators.size() && k < static_cast<size_t>(top_operators); ++k) {
    const auto& op = analysis.operators[k];
    json shapes = json::array();
    for (size_t s = 0; s < op.input_shapes.size() && s < 3; ++s) {
      shapes.push_back(
          {{"input_dims", op.input_shapes[s].first}, {"calls", op.input_shapes[s].second}});
    }
    json row = {{"name", op.name},
                {"calls", op.calls},
                {"self_cpu_us", op.self_cpu_us},
                {"total_cpu_us", op.total_cpu_us},
                {"input_shapes", shapes}};
    if (analysis.has_gpu) row["self_device_us"] = op.self_device_us;
    if (op.flops > 0) row["flops"] = op.flops;
    operators.push_back(row);
  }
  json phases = json::array();
  for (const auto& p : analysis.phases)
    phases.push_back({{"phase", p.phase}, {"seconds", p.seconds}, {"share", p.share}});
  json memory = json::array();
  for (const auto& m : analysis.memory) {
    memory.push_back({{"phase", m.phase},
                      {"device", m.device},
                      {"peak_allocated_bytes", m.peak_allocated_bytes},
                      {"growth_bytes", m.growth_bytes}});
  }
  json out = {
      {"windows", analysis.windows},
      {"steps", analysis.steps},
      {"step_seconds_mean",
       analysis.steps > 0 ? analysis.step_seconds / static_cast<double>(analysis.steps) : 0},
      {"top_operators", operators},
      {"operators_sorted_by", analysis.device_sorted ? "self_device_us" : "self_cpu_us"},
      {"phases", phases},
      {"memory_by_phase", memory},
      {"training_thread",
       {{"operator_calls_per_step", analysis.steps > 0 ? static_cast<double>(analysis.step_ops) /
                                                             static_cast<double>(analysis.steps)
                                                       : 0},
        {"mean_op_us", analysis.mean_op_us},
        {"operator_share", analysis.operator_share}}}};
  if (analysis.has_gpu) {
    const auto& g = analysis.gpu;
    out["gpu"] = {{"kernel_us", g.kernel_us},
                  {"compute_us", g.compute_us},
                  {"non_compute_us", g.non_compute_us},
                  {"idle_us", g.idle_us},
                  {"communication_us", g.communication_us},
                  {"memory_us", g.memory_us},
                  {"idle_breakdown_us",
                   {{"host_wait", g.host_wait_us},
                    {"kernel_wait", g.kernel_wait_us},
                    {"other", g.other_wait_us}}},
                  {"comm_overlap_share",
                   g.comm_overlap_share >= 0 ? json(g.comm_overlap_share) : json(nullptr)},
                  {"kernels", g.kernels}};
  }
  return out;
}

std::string format_profile_tables(const TraceAnalysis& analysis, const Verdict& verdict,
                                  int top_operators) {
  std::string out;
  const bool device = analysis.has_gpu;
  double total_self = 0;
  for (const auto& op : analysis.operators)
    total_self += device ? op.self_device_us : op.self_cpu_us;
  out += fmt::format("\nTop operators by self {} time ({} steps, {} window{})\n",
                     device ? "device" : "CPU", analysis.steps, analysis.windows,
                     analysis.windows == 1 ? "" : "s");
  out += fmt::format("  {:<34} {:>7} {:>11} {:>7} {:>11}{}  {}\n", "operator", "calls", "self",
                     "self%", "total", device ? fmt::format(" {:>11}", "self device") : "",
                     "input shapes (most time)");
  for (size_t k = 0; k < analysis.operators.size() && k < static_cast<size_t>(top_operators); ++k) {
    const auto& op = analysis.operators[k];
    const double self = device ? op.self_device_us : op.self_cpu_us;
    const std::string name = shorten(op.name, 34);
    const std::string shapes =
        op.input_shapes.empty() ? "" : shorten(op.input_shapes.front().first, 48);
    out += fmt::format("  {:<34} {:>7} {:>11} {:>6.1f}% {:>11}{}  {}\n", name, op.calls,
                       format_us(op.self_cpu_us), total_self > 0 ? percent(self / total_self) : 0.0,
                       format_us(op.total_cpu_us),
                       device ? fmt::format(" {:>11}", format_us(op.self_device_us)) : "", shapes);
  }
  out += fmt::format("\nStep phases (mean step {})\n",
                     format_us(analysis.steps > 0 ? 1e6 * analysis.step_seconds /
                                                        static_cast<double>(analysis.steps)
                                                  : 0));
  for (const auto& p : analysis.phases) {
    const int bar = static_cast<int>(std::lround(30 * std::clamp(p.share, 0.0, 1.0)));
    out += fmt::format(
        "  {:<11} {:>6.1f}%  {:>11}/step  {}\n", p.phase, percent(p.share),
        format_us(analysis.steps > 0 ? 1e6 * p.seconds / static_cast<double>(analysis.steps) : 0),
        std::string(static_cast<size_t>(bar), '#'));
  }
  if (!analysis.memory.empty()) {
    out += "\nPeak memory by phase (allocator total)\n";
    for (const auto& m : analysis.memory) {
      out += fmt::format("  {:<11} {:<7} peak {:>10}  growth {:>10}\n", m.phase, m.device,
                         format_bytes(m.peak_allocated_bytes), format_bytes(m.growth_bytes));
    }
  }
  if (analysis.has_gpu) {
    const auto& g = analysis.gpu;
    auto share = [&](double us) { return g.kernel_us > 0 ? percent(us / g.kernel_us) : 0.0; };
    out += "\nGPU temporal breakdown (Holistic Trace Analysis definitions)\n";
    out += fmt::format("  compute {:.1f}%  non-compute {:.1f}%  idle {:.1f}% of {}\n",
                       share(g.compute_us), share(g.non_compute_us), share(g.idle_us),
                       format_us(g.kernel_us));
    out +=
        fmt::format("  idle: host wait {}  kernel wait {}  other {}\n", format_us(g.host_wait_us),
                    format_us(g.kernel_wait_us), format_us(g.other_wait_us));
    if (g.comm_overlap_share >= 0) {
      out += fmt::format("  communication {} ({:.1f}% overlapped with compute)\n",
                         format_us(g.communication_us), percent(g.comm_overlap_share));
    }
  }
  out += fmt::format("\nVerdict: {}\n", verdict.reason);
  for (const auto& action : verdict.actions) out += fmt::format("  - {}\n", action);
  return out;
}

}  // namespace kiln
