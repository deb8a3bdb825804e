// Trace analysis: Kineto Chrome traces in, TraceAnalysis out. Pure functions of the JSON, so the
// same code reads kiln's traces and torch.profiler's.
//
// Event kinds used (Kineto's "cat"): cpu_op (ATen operators), user_annotation (ProfilerStep#N
// and the phase scopes), cpu_instant_event "[memory]" (allocations: args "Total Allocated",
// "Device Type", "Device Id"), kernel / gpu_memcpy / gpu_memset (device activity: args "stream",
// "correlation", "External id"), cuda_runtime / cuda_driver (launches: args "correlation").
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>

#include "kiln/error.h"
#include "kiln/profile.h"

namespace kiln {
namespace {

using nlohmann::json;

// Kineto writes microseconds with fractional nanoseconds; nesting tests allow rounding.
constexpr double kNestingSlackUs = 0.002;
// HTA's default threshold for "kernel wait": gaps shorter than this between consecutive kernels
// on a stream are launch delays (30 ns).
constexpr double kConsecutiveKernelDelayUs = 0.030;

const std::vector<std::string>& phase_order() {
  static const std::vector<std::string> order = {"data_wait", "forward",    "backward", "comm",
                                                 "optimizer", "checkpoint", "eval"};
  return order;
}

bool is_phase_name(const std::string& name) {
  const auto& order = phase_order();
  return std::find(order.begin(), order.end(), name) != order.end();
}

bool starts_with(const std::string& text, std::string_view prefix) {
  return text.size() >= prefix.size() && text.compare(0, prefix.size(), prefix) == 0;
}

// Field readers for foreign input (any torch.profiler trace): a missing field, or one of another
// type, reads as the fallback. json::value() would throw on a type mismatch, operator[] on a
// missing key is undefined behaviour for a const json.
double number_or(const json& object, const char* key, double fallback) {
  if (!object.is_object()) return fallback;
  auto it = object.find(key);
  if (it == object.end() || !it->is_number()) return fallback;
  return it->get<double>();
}

std::string string_or_empty(const json& object, const char* key) {
  if (!object.is_object()) return {};
  auto it = object.find(key);
  if (it == object.end() || !it->is_string()) return {};
  return it->get<std::string>();
}

// The event's "args" object; an empty object when absent or not an object.
const json& args_of(const json& event) {
  static const json empty = json::object();
  if (!event.is_object()) return empty;
  auto it = event.find("args");
  return it != event.end() && it->is_object() ? *it : empty;
}

// An integer field (correlation and External ids), or nullopt.
std::optional<int64_t> integer_of(const json& object, const char* key) {
  if (!object.is_object()) return std::nullopt;
  auto it = object.find(key);
  if (it == object.end() || !it->is_number_integer()) return std::nullopt;
  return it->get<int64_t>();
}

// A thread's identity: Kineto writes pid and tid as numbers (sometimes strings for GPU rows).
std::string thread_key(const json& event) {
  auto field = [&](const char* key) -> std::string {
    auto it = event.find(key);
    if (it == event.end()) return "?";
    return it->is_string() ? it->get<std::string>() : it->dump();
  };
  return field("pid") + "/" + field("tid");
}

struct Interval {
  double begin = 0, end = 0;
};

// Sorted, non-overlapping union of intervals.
std::vector<Interval> merge_intervals(std::vector<Interval> intervals) {
  std::sort(intervals.begin(), intervals.end(),
            [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
  std::vector<Interval> merged;
  for (const auto& interval : intervals) {
    if (!merged.empty() && interval.begin <= merged.back().end) {
      merged.back().end = std::max(merged.back().end, interval.end);
    } else {
      merged.push_back(interval);
    }
  }
  return merged;
}

double total_length(const std::vector<Interval>& merged) {
  double sum = 0;
  for (const auto& interval : merged) sum += interval.end - interval.begin;
  return sum;
}

// Length of the intersection of two merged interval lists.
double overlap_length(const std::vector<Interval>& a, const std::vector<Interval>& b) {
  double sum = 0;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const double lo = std::max(a[i].begin, b[j].begin);
    const double hi = std::min(a[i].end, b[j].end);
    if (hi > lo) sum += hi - lo;
    if (a[i].end < b[j].end) {
      ++i;
    } else {
      ++j;
    }
  }
  return sum;
}

// One duration event on a CPU thread.
struct HostEvent {
  const json* source = nullptr;
  std::string name;
  bool is_op = false;  // cpu_op (else a user annotation)
  double ts = 0, dur = 0;
  double children_us = 0;
  bool outermost_of_name = true;  // no ancestor with the same name
  int parent = -1;
  double end() const { return ts + dur; }
};

struct OperatorAccumulator {
  int64_t calls = 0;
  double self_cpu_us = 0, total_cpu_us = 0, self_device_us = 0, flops = 0;
  std::map<std::string, std::pair<double, int64_t>> shapes;  // dims -> (self us, calls)
};

struct MemoryAccumulator {
  double peak = -1;
  double growth = 0;
};

// A trace's events by kind (Kineto's "cat" and "ph").
struct ClassifiedEvents {
  std::map<std::string, std::vector<HostEvent>> threads;  // thread -> cpu_op and annotations
  std::vector<const json*> memory;                        // "[memory]" instant events
  std::vector<const json*> device;                        // kernels, memcpys, memsets
  std::unordered_map<int64_t, double> launch_ts;          // correlation -> runtime call start
};

bool is_step_annotation(const HostEvent& e) {
  return !e.is_op && starts_with(e.name, "ProfilerStep#");
}

ClassifiedEvents classify_events(const json& trace_events) {
  ClassifiedEvents out;
  for (const auto& event : trace_events) {
    if (!event.is_object()) continue;
    const std::string cat = string_or_empty(event, "cat");
    const std::string ph = string_or_empty(event, "ph");
    if (ph == "X" && (cat == "cpu_op" || cat == "user_annotation")) {
      HostEvent host;
      host.source = &event;
      host.name = string_or_empty(event, "name");
      host.is_op = cat == "cpu_op";
      host.ts = number_or(event, "ts", 0);
      host.dur = std::max(0.0, number_or(event, "dur", 0));
      out.threads[thread_key(event)].push_back(std::move(host));
    } else if (ph == "i" && string_or_empty(event, "name") == "[memory]") {
      out.memory.push_back(&event);
    } else if (ph == "X" && (cat == "kernel" || cat == "gpu_memcpy" || cat == "gpu_memset")) {
      out.device.push_back(&event);
    } else if (ph == "X" && (cat == "cuda_runtime" || cat == "cuda_driver")) {
      if (auto correlation = integer_of(args_of(event), "correlation"))
        out.launch_ts[*correlation] = number_or(event, "ts", 0);
    }
  }
  return out;
}

// Parent links, children time and same-name nesting for one thread's events.
void build_tree(std::vector<HostEvent>& events) {
  std::sort(events.begin(), events.end(), [](const HostEvent& a, const HostEvent& b) {
    if (a.ts != b.ts) return a.ts < b.ts;
    return a.dur > b.dur;  // the enclosing event first
  });
  std::vector<int> stack;
  for (size_t k = 0; k < events.size(); ++k) {
    auto& e = events[k];
    while (!stack.empty() && events[stack.back()].end() < e.end() - kNestingSlackUs)
      stack.pop_back();
    if (!stack.empty()) {
      e.parent = stack.back();
      events[stack.back()].children_us += e.dur;
      for (int a : stack) {
        if (events[a].name == e.name) {
          e.outermost_of_name = false;
          break;
        }
      }
    }
    stack.push_back(static_cast<int>(k));
  }
}

// Builds every thread's tree; returns the training thread (the last, in key order, that holds a
// ProfilerStep#N annotation), or "" when none does.
std::string nest_threads(std::map<std::string, std::vector<HostEvent>>& threads) {
  std::string step_thread;
  for (auto& [key, events] : threads) {
    build_tree(events);
    for (const auto& e : events) {
      if (is_step_annotation(e)) step_thread = key;
    }
  }
  return step_thread;
}

// The ProfilerStep#N event enclosing events[k], or -1.
int enclosing_step(const std::vector<HostEvent>& events, size_t k) {
  int p = events[k].parent;
  while (p >= 0 && !is_step_annotation(events[p])) p = events[p].parent;
  return p;
}

// A phase scope on the training thread, in trace order (innermost phases after their parents).
struct PhaseOccurrence {
  std::string name;
  Interval interval;
};

// The innermost phase open at `ts` (the latest-beginning one that contains it), or -1.
int innermost_phase_at(const std::vector<PhaseOccurrence>& phases, double ts) {
  int phase_index = -1;
  for (size_t k = phases.size(); k-- > 0;) {
    if (ts >= phases[k].interval.begin && ts <= phases[k].interval.end) {
      if (phase_index < 0 || phases[k].interval.begin >= phases[phase_index].interval.begin) {
        phase_index = static_cast<int>(k);
      }
    }
  }
  return phase_index;
}

bool inside_any(const std::vector<Interval>& intervals, double ts) {
  bool inside = false;
  for (const auto& s : intervals) inside = inside || (ts >= s.begin && ts <= s.end);
  return inside;
}

// A "[memory]" event's device: "cuda:N" for Device Type 1, else "cpu".
std::string memory_event_device(const json& args) {
  const int device_type = static_cast<int>(number_or(args, "Device Type", 0));
  const int device_id = static_cast<int>(number_or(args, "Device Id", -1));
  return device_type == 1 ? fmt::format("cuda:{}", std::max(device_id, 0)) : "cpu";
}

// Device activity by kind, as HTA's temporal breakdown counts it.
enum class DeviceWork { kCompute, kCommunication, kMemory };

DeviceWork device_work(const std::string& cat, const std::string& name) {
  const bool is_memory = cat != "kernel" || name.find("Memcpy") != std::string::npos ||
                         name.find("Memset") != std::string::npos;
  if (is_memory) return DeviceWork::kMemory;
  return name.find("nccl") != std::string::npos ? DeviceWork::kCommunication : DeviceWork::kCompute;
}

struct Kernel {
  double ts, end, launch;  // launch: the runtime call's start, -1 when unknown
};

// HTA's idle-time breakdown: each gap between consecutive kernels on a stream is host wait (the
// next kernel was launched after the previous ended), kernel wait (a launch delay under 30 ns) or
// other.
void add_idle_breakdown(std::map<std::string, std::vector<Kernel>>& streams, GpuBreakdown& g) {
  for (auto& [stream, kernels] : streams) {
    std::sort(kernels.begin(), kernels.end(),
              [](const Kernel& a, const Kernel& b) { return a.ts < b.ts; });
    for (size_t k = 1; k < kernels.size(); ++k) {
      const double gap = kernels[k].ts - kernels[k - 1].end;
      if (gap <= 0) continue;
      if (kernels[k].launch >= 0 && kernels[k].launch > kernels[k - 1].end) {
        g.host_wait_us += gap;
      } else if (gap < kConsecutiveKernelDelayUs) {
        g.kernel_wait_us += gap;
      } else {
        g.other_wait_us += gap;
      }
    }
  }
}

class Analyzer {
 public:
  // Adds one window's trace: events are classified, the host threads nested, then operators,
  // the training thread's steps and phases, memory by phase and the GPU breakdown accumulated.
  void add(const json& trace) {
    if (!trace.is_object() || !trace.contains("traceEvents") || !trace["traceEvents"].is_array()) {
      throw UserError(
          "not a Chrome trace: no traceEvents array (expected a Kineto .pt.trace.json)");
    }
    ++result_.windows;
    read_device_properties(trace);
    ClassifiedEvents events = classify_events(trace["traceEvents"]);
    const std::string step_thread = nest_threads(events.threads);
    const auto op_by_external_id = add_operators(events.threads);
    if (step_thread.empty()) return;

    const auto& main = events.threads[step_thread];
    const std::vector<Interval> steps = add_steps(main);
    const std::vector<PhaseOccurrence> phases = add_phases_and_step_ops(main);
    add_memory_by_phase(events.memory, phases, steps);
    // Device activity (CUDA): HTA's temporal and idle-time breakdowns, self device time.
    if (!events.device.empty())
      add_device_breakdown(events.device, events.launch_ts, op_by_external_id);
  }

  TraceAnalysis finish() {
    if (result_.steps == 0) {
      throw UserError(
          "the trace holds no ProfilerStep#N annotation: it was not recorded on a "
          "schedule (kiln's profiler or torch.profiler.profile(schedule=...) with "
          "prof.step())");
    }
    for (auto& [name, acc] : operators_) {
      OperatorStats op;
      op.name = name;
      op.calls = acc.calls;
      op.self_cpu_us = acc.self_cpu_us;
      op.total_cpu_us = acc.total_cpu_us;
      op.self_device_us = acc.self_device_us;
      op.flops = acc.flops;
      std::vector<std::pair<std::string, std::pair<double, int64_t>>> shapes(acc.shapes.begin(),
                                                                             acc.shapes.end());
      std::sort(shapes.begin(), shapes.end(),
                [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
      for (const auto& [dims, stat] : shapes) op.input_shapes.emplace_back(dims, stat.second);
      result_.operators.push_back(std::move(op));
    }
    result_.device_sorted = result_.has_gpu;
    std::sort(result_.operators.begin(), result_.operators.end(),
              [&](const OperatorStats& a, const OperatorStats& b) {
                if (result_.device_sorted && a.self_device_us != b.self_device_us) {
                  return a.self_device_us > b.self_device_us;
                }
                if (a.self_cpu_us != b.self_cpu_us) return a.self_cpu_us > b.self_cpu_us;
                return a.name < b.name;
              });
    const double step = result_.step_seconds;
    for (const auto& name : phase_order()) {
      auto it = phase_seconds_.find(name);
      if (it == phase_seconds_.end()) continue;
      result_.phases.push_back({name, it->second, step > 0 ? it->second / step : 0});
    }
    const double other = std::max(0.0, step - top_phase_seconds_);
    result_.phases.push_back({"other", other, step > 0 ? other / step : 0});
    for (const auto& name : phase_order()) {
      for (const auto& [key, acc] : memory_) {
        if (key.first == name) result_.memory.push_back({name, key.second, acc.peak, acc.growth});
      }
    }
    for (const auto& [key, acc] : memory_) {
      if (key.first == "other")
        result_.memory.push_back({"other", key.second, acc.peak, acc.growth});
    }
    // The median over steps of each step's mean: one step stretched by the OS (a preempted
    // operator on a busy machine) does not move it.
    if (!step_mean_op_us_.empty()) {
      auto& v = step_mean_op_us_;
      std::sort(v.begin(), v.end());
      const size_t n = v.size();
      result_.mean_op_us = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
    }
    result_.operator_share = step > 0 ? result_.step_op_self_us * 1e-6 / step : 0;
    if (result_.has_gpu) {
      auto& g = result_.gpu;
      g.non_compute_us = std::max(0.0, g.kernel_us - g.compute_us - g.idle_us);
      g.comm_overlap_share = g.communication_us > 0 ? comm_overlap_us_ / g.communication_us : -1;
    }
    return result_;
  }

 private:
  // Per-operator calls, self and total CPU time, FLOPs and input shapes, every thread. Returns
  // the operators by External id (to attribute kernels to them).
  std::unordered_map<int64_t, std::string> add_operators(
      const std::map<std::string, std::vector<HostEvent>>& threads) {
    std::unordered_map<int64_t, std::string> op_by_external_id;
    for (const auto& [key, events] : threads) {
      for (const auto& e : events) {
        if (!e.is_op) continue;
        auto& op = operators_[e.name];
        const double self = std::max(0.0, e.dur - e.children_us);
        ++op.calls;
        op.self_cpu_us += self;
        if (e.outermost_of_name) op.total_cpu_us += e.dur;
        const json& args = args_of(*e.source);
        op.flops += number_or(args, "flops", 0);
        auto dims = args.find("Input Dims");
        if (dims != args.end()) {
          auto& shape = op.shapes[dims->dump()];
          shape.first += self;
          shape.second += 1;
        }
        if (auto id = integer_of(args, "External id")) op_by_external_id[*id] = e.name;
      }
    }
    return op_by_external_id;
  }

  // The training thread's ProfilerStep#N events: counted, timed, and returned as intervals.
  std::vector<Interval> add_steps(const std::vector<HostEvent>& main) {
    std::vector<Interval> steps;
    for (const auto& e : main) {
      if (is_step_annotation(e)) {
        steps.push_back({e.ts, e.end()});
        result_.step_seconds += e.dur * 1e-6;
        ++result_.steps;
      }
    }
    return steps;
  }

  // Inside the steps: operator granularity (self time and calls per step) and the phase scopes'
  // time. Returns the phase occurrences for memory attribution.
  std::vector<PhaseOccurrence> add_phases_and_step_ops(const std::vector<HostEvent>& main) {
    std::vector<PhaseOccurrence> phases;
    std::map<int, std::pair<double, int64_t>> ops_by_step;  // step event -> (self us, calls)
    for (size_t k = 0; k < main.size(); ++k) {
      const int step = enclosing_step(main, k);
      if (step < 0) continue;
      const auto& e = main[k];
      if (e.is_op) {
        const double self = std::max(0.0, e.dur - e.children_us);
        ++result_.step_ops;
        result_.step_op_self_us += self;
        ops_by_step[step].first += self;
        ops_by_step[step].second += 1;
      } else if (is_phase_name(e.name)) {
        phases.push_back({e.name, {e.ts, e.end()}});
        add_phase_time(e, main[e.parent]);
      }
    }
    for (const auto& [step, ops] : ops_by_step) {
      step_mean_op_us_.push_back(ops.first / static_cast<double>(ops.second));
    }
    return phases;
  }

  // Top-level phases (directly under the step) make up the step; nested ones (comm inside
  // backward) are counted in their own row but not again in "other".
  void add_phase_time(const HostEvent& phase, const HostEvent& parent) {
    const bool top = parent.name.rfind("ProfilerStep#", 0) == 0;
    phase_seconds_[phase.name] += phase.dur * 1e-6;
    if (top) top_phase_seconds_ += phase.dur * 1e-6;
  }

  // Peak memory by phase: each allocation event belongs to the innermost phase of the training
  // thread open at its time ("other" inside a step outside any phase; outside steps, none).
  void add_memory_by_phase(const std::vector<const json*>& memory_events,
                           const std::vector<PhaseOccurrence>& phases,
                           const std::vector<Interval>& steps) {
    for (const json* event : memory_events) {
      const json& args = args_of(*event);
      if (!args.contains("Total Allocated")) continue;
      const double ts = number_or(*event, "ts", 0);
      const int phase_index = innermost_phase_at(phases, ts);
      if (phase_index < 0 && !inside_any(steps, ts)) continue;
      const std::string phase = phase_index >= 0 ? phases[phase_index].name : "other";
      const std::string device = memory_event_device(args);
      const double total = number_or(args, "Total Allocated", 0);
      auto& acc = memory_[{phase, device}];
      acc.peak = std::max(acc.peak, total);
      // Growth within this occurrence of the phase: relative to the total before its first
      // allocation event.
      auto& baseline = phase_baseline_[{phase_index, device}];
      if (!baseline.second) baseline = {total - number_or(args, "Bytes", 0), true};
      acc.growth = std::max(acc.growth, total - baseline.first);
    }
    phase_baseline_.clear();
  }

  void read_device_properties(const json& trace) {
    auto it = trace.find("deviceProperties");
    if (it == trace.end() || !it->is_array()) return;
    for (const auto& device : *it) {
      const double bytes = number_or(device, "totalGlobalMem", -1);
      if (bytes > 0) result_.device_memory_bytes = std::max(result_.device_memory_bytes, bytes);
    }
  }

  // The GPU breakdown of one window: HTA's temporal breakdown (span, idle, compute,
  // communication, memory, communication overlapped by compute), the idle-time breakdown per
  // stream, and each operator's self device time (kernels matched by External id).
  void add_device_breakdown(const std::vector<const json*>& events,
                            const std::unordered_map<int64_t, double>& launch_ts,
                            const std::unordered_map<int64_t, std::string>& op_by_external_id) {
    result_.has_gpu = true;
    auto& g = result_.gpu;
    std::vector<Interval> all, compute, communication, memory;
    std::map<std::string, std::vector<Kernel>> streams;
    for (const json* event : events) {
      const std::string cat = string_or_empty(*event, "cat");
      const double ts = number_or(*event, "ts", 0);
      const double dur = std::max(0.0, number_or(*event, "dur", 0));
      const Interval interval{ts, ts + dur};
      all.push_back(interval);
      ++g.kernels;
      switch (device_work(cat, string_or_empty(*event, "name"))) {
        case DeviceWork::kMemory:
          memory.push_back(interval);
          break;
        case DeviceWork::kCommunication:
          communication.push_back(interval);
          break;
        case DeviceWork::kCompute:
          compute.push_back(interval);
          break;
      }
      const json& args = args_of(*event);
      auto stream_field = args.find("stream");
      const std::string stream =
          stream_field != args.end() ? stream_field->dump() : thread_key(*event);
      streams[stream].push_back({ts, ts + dur, launch_time(args, launch_ts)});
      if (auto id = integer_of(args, "External id")) {
        auto op = op_by_external_id.find(*id);
        if (op != op_by_external_id.end()) operators_[op->second].self_device_us += dur;
      }
    }
    const auto merged_all = merge_intervals(all);
    const auto merged_compute = merge_intervals(compute);
    const auto merged_comm = merge_intervals(communication);
    const double span = merged_all.back().end - merged_all.front().begin;
    g.kernel_us += span;
    g.idle_us += span - total_length(merged_all);
    g.compute_us += total_length(merged_compute);
    g.communication_us += total_length(merged_comm);
    g.memory_us += total_length(merge_intervals(memory));
    comm_overlap_us_ += overlap_length(merged_comm, merged_compute);
    add_idle_breakdown(streams, g);
  }

  // When the runtime call that launched a device event started (by correlation id), or -1.
  static double launch_time(const json& args,
                            const std::unordered_map<int64_t, double>& launch_ts) {
    if (auto correlation = integer_of(args, "correlation")) {
      auto found = launch_ts.find(*correlation);
      if (found != launch_ts.end()) return found->second;
    }
    return -1;
  }

  TraceAnalysis result_;
  std::map<std::string, OperatorAccumulator> operators_;
  std::map<std::string, double> phase_seconds_;
  double top_phase_seconds_ = 0;
  std::map<std::pair<std::string, std::string>, MemoryAccumulator> memory_;
  std::map<std::pair<int, std::string>, std::pair<double, bool>> phase_baseline_;
  double comm_overlap_us_ = 0;
  std::vector<double> step_mean_op_us_;
};

}  // namespace

TraceAnalysis analyze_traces(const std::vector<nlohmann::json>& traces) {
  Analyzer analyzer;
  for (const auto& trace : traces) analyzer.add(trace);
  return analyzer.finish();
}

}  // namespace kiln
