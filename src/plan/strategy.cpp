// The strategy rule over DDP, FSDP, hybrid sharding and tensor parallelism (docs/plan.md,
// "Strategy").
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include "kiln/plan.h"

namespace kiln {
namespace {

// Decimal units (the catalog's device memory is in GB) that fit the size: "114.3 GB", "12.0 MB",
// "512 kB", never "0.0 GB" for a small model.
std::string gb(double bytes) {
  if (bytes >= 1e9) return fmt::format("{:.1f} GB", bytes / 1e9);
  if (bytes >= 1e6) return fmt::format("{:.1f} MB", bytes / 1e6);
  return fmt::format("{:.0f} kB", bytes / 1e3);
}

}  // namespace

namespace {

// One layout the rule considers: dp_shard d x tp t (the rest of the world replicas).
struct Layout {
  int64_t d = 0, t = 1;
  double bytes = 0;  // per device
  double comm = 0;   // seconds per step; NaN when a link's bandwidth is unknown
};

std::string layout_name(const Layout& l, int64_t gpus) {
  const int64_t replicas = gpus / (l.d * l.t);
  std::string out =
      replicas > 1 ? fmt::format("hsdp {}x{}", replicas, l.d) : fmt::format("fsdp over {}", l.d);
  if (l.t > 1) out += fmt::format(" x tp {}", l.t);
  return out;
}

}  // namespace

StrategyDecision choose_strategy(const StrategyInput& in) {
  if (in.gpu_count < 1) throw std::invalid_argument("choose_strategy: gpu_count < 1");
  if (!(in.headroom_fraction >= 0 && in.headroom_fraction < 1)) {
    throw std::invalid_argument("choose_strategy: headroom_fraction outside [0, 1)");
  }
  StrategyDecision out;
  const int64_t W = in.gpu_count;
  const int64_t node = in.gpus_per_node > 0 ? std::min(in.gpus_per_node, W) : W;
  out.usable_bytes = in.device_memory_bytes * (1.0 - in.headroom_fraction);
  out.ddp_bytes_per_device = in.ddp_model_state_bytes + in.weight_copy_bytes + in.activation_bytes;
  // What a device keeps of the state and of a gathered unit at TP degree t.
  auto keep = [&](int64_t t) {
    return 1.0 - in.tensor_parallel_fraction + in.tensor_parallel_fraction / static_cast<double>(t);
  };
  auto unit = [&](int64_t t) {
    if (t == 1) return in.largest_unit_parameter_bytes;
    auto it = in.tensor_parallel_unit_bytes.find(t);
    return it != in.tensor_parallel_unit_bytes.end() ? it->second
                                                     : in.largest_unit_parameter_bytes * keep(t);
  };
  auto bytes = [&](int64_t degree, int64_t t) {
    return in.ddp_model_state_bytes * keep(t) / static_cast<double>(degree) + unit(t) +
           in.activation_bytes;
  };
  auto fsdp_bytes = [&](int64_t degree) { return bytes(degree, 1); };
  // A group of `span` consecutive ranks (tp innermost, then dp_shard, then dp_replicate) is
  // inside a node when the span fits in one.
  auto bandwidth = [&](int64_t span) {
    return span <= node ? in.intra_node_bytes_per_second : in.inter_node_bytes_per_second;
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  auto ring = [&](double volume, int64_t ranks, double bw) {
    if (ranks <= 1) return 0.0;
    if (!(bw > 0)) return nan;
    const double k = static_cast<double>(ranks);
    return volume * (k - 1) / k / bw;
  };
  auto layout = [&](int64_t d, int64_t t) {
    Layout l{d, t, bytes(d, t), 0};
    const double accum = static_cast<double>(std::max<int64_t>(1, in.grad_accum_steps));
    const double params = in.parameter_bytes * keep(t);
    const int64_t replicas = W / (d * t);
    // TP's all-reduces (ring: 2x), FSDP's two gathers and one reduce-scatter per micro-batch,
    // the replicas' all-reduce of the gradient shards once per step.
    l.comm = accum * ring(2.0 * in.tensor_parallel_bytes, t, bandwidth(t)) +
             accum * ring(3.0 * params, d, bandwidth(d * t)) +
             ring(2.0 * params / static_cast<double>(d), replicas, bandwidth(W));
    return l;
  };
  const std::string usable = gb(out.usable_bytes) + " usable";
  const std::string ddp_parts =
      fmt::format("state {}{} + activations {}", gb(in.ddp_model_state_bytes),
                  in.weight_copy_bytes > 0 ? " + weight copies " + gb(in.weight_copy_bytes) : "",
                  gb(in.activation_bytes));
  if (out.ddp_bytes_per_device <= out.usable_bytes) {
    out.strategy = "ddp";
    out.fsdp_bytes_per_device = W > 1 ? fsdp_bytes(W) : out.ddp_bytes_per_device;
    // The ring all-reduce of the gradients, once per step.
    const double comm = ring(2.0 * in.parameter_bytes, W, bandwidth(W));
    out.communication_seconds = std::isnan(comm) ? 0.0 : comm;
    out.reason = fmt::format("ddp fits: {}/device ({}) <= {}", gb(out.ddp_bytes_per_device),
                             ddp_parts, usable);
    return out;
  }
  const std::string ddp_line =
      fmt::format("ddp needs {}/device ({}) > {}", gb(out.ddp_bytes_per_device), ddp_parts, usable);
  auto fsdp_line = [&](const Layout& l) {
    return fmt::format("{}/device (state/{} {} + largest unit {} + activations {})", gb(l.bytes),
                       l.d, gb(in.ddp_model_state_bytes / static_cast<double>(l.d)), gb(unit(1)),
                       gb(in.activation_bytes));
  };
  auto choose = [&](const Layout& l) {
    out.strategy = "fsdp";
    out.fsdp_degree = l.d;
    out.tp_degree = l.t;
    out.fsdp_bytes_per_device = l.bytes;
    out.communication_seconds = std::isnan(l.comm) ? 0.0 : l.comm;
  };
  // 1. FSDP inside a node (the shard group on the fast link; replicas across nodes).
  for (int64_t degree = 2; degree <= node; ++degree) {
    if (W % degree != 0 || node % degree != 0) continue;
    if (fsdp_bytes(degree) <= out.usable_bytes) {
      const Layout l = layout(degree, 1);
      choose(l);
      out.reason = fmt::format("{}; fsdp over {} fits: {}", ddp_line, degree, fsdp_line(l));
      return out;
    }
  }
  // 2. Past one node's sharding: FSDP across nodes, or TP inside a node with FSDP over the rest.
  std::vector<Layout> candidates;
  for (int64_t degree = node + 1; degree <= W; ++degree) {
    if (W % degree == 0 && fsdp_bytes(degree) <= out.usable_bytes) {
      candidates.push_back(layout(degree, 1));
      break;
    }
  }
  std::vector<int64_t> degrees = in.tensor_parallel_degrees;
  std::sort(degrees.begin(), degrees.end());
  for (int64_t t : degrees) {
    if (t < 2 || node % t != 0 || W % t != 0) continue;
    for (int64_t degree = 2; degree <= W / t; ++degree) {
      if ((W / t) % degree == 0 && bytes(degree, t) <= out.usable_bytes) {
        candidates.push_back(layout(degree, t));
        break;
      }
    }
  }
  if (!candidates.empty()) {
    const bool known = std::none_of(candidates.begin(), candidates.end(),
                                    [](const Layout& l) { return std::isnan(l.comm); });
    size_t best = 0;
    if (known) {
      for (size_t i = 1; i < candidates.size(); ++i) {
        if (candidates[i].comm < candidates[best].comm) best = i;
      }
    }
    const Layout& l = candidates[best];
    choose(l);
    std::string why;
    for (size_t i = 0; i < candidates.size(); ++i) {
      if (!why.empty()) why += ", ";
      why += known ? fmt::format("{} {:.3g} s", layout_name(candidates[i], W), candidates[i].comm)
                   : layout_name(candidates[i], W);
    }
    const std::string inside = node >= 2
                                   ? fmt::format("; fsdp inside a node (over {}) needs {}/device",
                                                 node, gb(fsdp_bytes(node)))
                                   : "";
    out.reason = fmt::format(
        "{}{}; {} fits: {}/device (state x {:.3f} / {} {} + largest unit {} + activations {}); "
        "{}",
        ddp_line, inside, layout_name(l, W), gb(l.bytes), keep(l.t), l.d,
        gb(in.ddp_model_state_bytes * keep(l.t) / static_cast<double>(l.d)), gb(unit(l.t)),
        gb(in.activation_bytes),
        candidates.size() == 1
            ? "the only layout that fits"
            : (known ? "the least communication per step of those that fit (" + why + ")"
                     : "link bandwidths unknown: the first of those that fit (" + why + ")"));
    return out;
  }
  out.strategy = "does-not-fit";
  const std::string advice = in.activation_checkpointing
                                 ? "use a smaller micro-batch or more GPUs"
                                 : "use activation checkpointing, a smaller micro-batch or more "
                                   "GPUs";
  out.fsdp_bytes_per_device = W > 1 ? fsdp_bytes(W) : out.ddp_bytes_per_device;
  std::string tp_line;
  if (!degrees.empty() && degrees.back() > 1 && W % degrees.back() == 0 && W > degrees.back()) {
    tp_line = fmt::format(", with tp {} {}/device", degrees.back(),
                          gb(bytes(W / degrees.back(), degrees.back())));
  }
  out.reason = W > 1 ? fmt::format(
                           "does not fit: {}; fsdp over all {} needs {}/device (state/{} {} + "
                           "largest unit {} + activations {}){}; {}",
                           ddp_line, W, gb(out.fsdp_bytes_per_device), W,
                           gb(in.ddp_model_state_bytes / static_cast<double>(W)), gb(unit(1)),
                           gb(in.activation_bytes), tp_line, advice)
                     : fmt::format("does not fit: {} on 1 GPU; {} (fsdp)", ddp_line, advice);
  return out;
}

nlohmann::json to_json(const StrategyDecision& d) {
  return {{"strategy", d.strategy},
          {"fsdp_degree", d.fsdp_degree},
          {"tp_degree", d.tp_degree},
          {"communication_seconds", d.communication_seconds},
          {"usable_bytes", d.usable_bytes},
          {"ddp_bytes_per_device", d.ddp_bytes_per_device},
          {"fsdp_bytes_per_device", d.fsdp_bytes_per_device},
          {"reason", d.reason}};
}

}  // namespace kiln
