// An exported graph split into units (models/exported_graph.h split_units): the nodes of each
// module of the package's unit list (package.json "units", found by `kiln model import`), so
// activation checkpointing and FSDP wrap each as they wrap a C++ model's units.
#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <map>

#include "models/exported_graph_parts.h"

namespace kiln {

using graph_parts::Node;
using graph_parts::UnitPlan;

std::vector<int> graph_parts::slots_read(const Node& node) {
  std::vector<int> out;
  for (const ArgSource& a : node.args) {
    if (a.slot >= 0) out.push_back(a.slot);
    for (int s : a.slots) {
      if (s >= 0) out.push_back(s);
    }
  }
  return out;
}

namespace {

// The unit index `path` names under `prefix` ("model.layers.3" under "model.layers": 3), or -1.
int64_t unit_of_path(const std::string& path, const std::string& prefix) {
  if (path.size() <= prefix.size() + 1 || path.compare(0, prefix.size(), prefix) != 0 ||
      path[prefix.size()] != '.') {
    return -1;
  }
  const std::string rest = path.substr(prefix.size() + 1);
  if (rest.size() > 9 || !std::all_of(rest.begin(), rest.end(), ::isdigit)) return -1;
  return std::stoll(rest);
}

}  // namespace

std::string ExportedGraph::split_units(const std::string& prefix, int64_t count) {
  Impl& g = *impl_;
  g.unit_plans.clear();
  units_.clear();
  if (prefix.empty() || count < 1) return "no unit list (an empty prefix or no units)";
  const size_t n = g.nodes.size();
  auto unit_name = [&](int64_t k) { return fmt::format("{}.{}", prefix, k); };

  // Each node's unit, from the module path that names one.
  std::vector<int64_t> unit_of(n, -1);
  for (size_t i = 0; i < n; ++i) {
    for (const std::string& path : g.nodes[i].module_paths) {
      const int64_t k = unit_of_path(path, prefix);
      if (k < 0) continue;
      if (k >= count) {
        return fmt::format("node '{}' runs in module {}, past the {} units listed", g.nodes[i].name,
                           path, count);
      }
      unit_of[i] = k;
      break;
    }
  }
  std::vector<UnitPlan> plans(static_cast<size_t>(count));
  for (int64_t k = 0; k < count; ++k) {
    UnitPlan& plan = plans[k];
    const auto first = std::find(unit_of.begin(), unit_of.end(), k);
    if (first == unit_of.end()) {
      return fmt::format("no node of the graph runs in module {}", unit_name(k));
    }
    plan.begin = static_cast<size_t>(first - unit_of.begin());
    plan.end =
        n - static_cast<size_t>(std::find(unit_of.rbegin(), unit_of.rend(), k) - unit_of.rbegin());
    for (size_t i = plan.begin; i < plan.end; ++i) {
      if (unit_of[i] != k) {
        return fmt::format("node '{}' ({}) runs between the nodes of module {}", g.nodes[i].name,
                           unit_of[i] < 0 ? "outside every unit" : "in " + unit_name(unit_of[i]),
                           unit_name(k));
      }
    }
    if (k > 0 && plan.begin < plans[k - 1].end) {
      return fmt::format("module {} runs before module {}", unit_name(k), unit_name(k - 1));
    }
  }

  // What defines each slot (-1: a graph input), which slots carry gradients (computed from a
  // parameter), where each is read last, and which are parameters.
  const size_t slots = static_cast<size_t>(g.slots);
  std::vector<std::string> name(slots);
  for (const auto& [value, slot] : g.slot_of) name[slot] = value;
  std::vector<int64_t> defined(slots, -1), last(slots, -1);
  std::vector<char> grad(slots, 0);
  std::map<int, size_t> parameter;  // slot -> input index
  for (size_t i = 0; i < inputs_.size(); ++i) {
    if (inputs_[i].kind == GraphInput::Kind::kParameter) {
      parameter[g.input_slots[i]] = i;
      grad[g.input_slots[i]] = 1;
    }
  }
  std::map<int, int64_t> parameter_piece;  // slot -> the unit reading it (-1: the root)
  for (size_t i = 0; i < n; ++i) {
    const Node& node = g.nodes[i];
    bool carries = false;
    for (int s : slots_read(node)) {
      last[s] = static_cast<int64_t>(i);
      carries = carries || grad[s];
      if (!parameter.count(s)) continue;
      auto [it, fresh] = parameter_piece.emplace(s, unit_of[i]);
      if (!fresh && it->second != unit_of[i]) {
        return fmt::format("parameter '{}' is read {} and {}; a parameter belongs to one unit",
                           inputs_[parameter[s]].name,
                           it->second < 0 ? "outside the units" : "by " + unit_name(it->second),
                           unit_of[i] < 0 ? "outside the units" : "by " + unit_name(unit_of[i]));
      }
    }
    for (const auto& out : node.outputs) {
      for (int s : out.slots) {
        if (s < 0) continue;
        defined[s] = static_cast<int64_t>(i);
        grad[s] = carries && node.kind == Node::Kind::kOp;
      }
    }
  }
  for (int s : g.user_output_slots) last[s] = INT64_MAX;
  for (int s : g.buffer_output_slots) {
    last[s] = INT64_MAX;
    if (defined[s] >= 0 && unit_of[defined[s]] >= 0) {
      return fmt::format(
          "module {} writes a buffer (node '{}'); a unit's forward runs again "
          "when it is recomputed, so it may not",
          unit_name(unit_of[defined[s]]), g.nodes[defined[s]].name);
    }
  }

  std::vector<GraphUnit> units;
  for (int64_t k = 0; k < count; ++k) {
    UnitPlan& plan = plans[k];
    const auto begin = static_cast<int64_t>(plan.begin), end = static_cast<int64_t>(plan.end);
    std::vector<int> external, hidden, outputs;
    for (size_t i = plan.begin; i < plan.end; ++i) {
      for (int s : slots_read(g.nodes[i])) {
        if (defined[s] < begin && std::find(external.begin(), external.end(), s) == external.end())
          external.push_back(s);
      }
      for (const auto& out : g.nodes[i].outputs) {
        for (int s : out.slots) {
          if (s >= 0 && last[s] >= end) outputs.push_back(s);
        }
      }
    }
    std::sort(external.begin(), external.end());
    for (int s : external) {
      if (grad[s] && !parameter.count(s)) hidden.push_back(s);
    }
    auto names = [&](const std::vector<int>& list) {
      std::string out;
      for (int s : list) out += (out.empty() ? "'" : ", '") + name[s] + "'";
      return out;
    };
    if (hidden.size() != 1) {
      return hidden.empty() ? fmt::format("module {} reads no value computed from the parameters",
                                          unit_name(k))
                            : fmt::format(
                                  "module {} reads {} values that carry gradients from outside it "
                                  "({}); a unit runs from one hidden state",
                                  unit_name(k), hidden.size(), names(hidden));
    }
    plan.in_slot = hidden[0];
    if (k > 0 && plan.in_slot != plans[k - 1].out_slot) {
      return fmt::format("module {} reads '{}', not module {}'s output", unit_name(k),
                         name[plan.in_slot], unit_name(k - 1));
    }
    if (outputs.size() != 1) {
      return fmt::format("module {} gives {} values to the nodes after it ({}); a unit gives one",
                         unit_name(k), outputs.size(), names(outputs));
    }
    plan.out_slot = outputs[0];
    if (g.nodes[defined[plan.out_slot]].kind != Node::Kind::kOp) {
      return fmt::format("module {} gives an integer '{}' to the nodes after it", unit_name(k),
                         name[plan.out_slot]);
    }
    if (k + 1 < count) {
      for (size_t i = plan.end; i < n; ++i) {
        const std::vector<int> read = slots_read(g.nodes[i]);
        if (unit_of[i] != k + 1 &&
            std::find(read.begin(), read.end(), plan.out_slot) != read.end()) {
          return fmt::format("module {}'s output '{}' is read by node '{}', outside module {}",
                             unit_name(k), name[plan.out_slot], g.nodes[i].name, unit_name(k + 1));
        }
      }
      if (last[plan.out_slot] == INT64_MAX) {
        return fmt::format("module {}'s output '{}' is an output of the graph", unit_name(k),
                           name[plan.out_slot]);
      }
    }
    GraphUnit unit{unit_name(k), {}, 0};
    for (int s : external) {
      if (s == plan.in_slot) continue;
      plan.captured.push_back(s);
      if (last[s] >= begin && last[s] < end) plan.release_after.push_back(s);
      if (auto it = parameter.find(s); it != parameter.end()) {
        unit.parameters.push_back(inputs_[it->second].name);
        int64_t numel = 1;
        for (int64_t d : inputs_[it->second].sizes) numel *= d;
        unit.elements += numel;
      }
    }
    if (last[plan.in_slot] < end) plan.release_after.push_back(plan.in_slot);
    if (unit.parameters.empty()) {
      return fmt::format("module {} reads no parameter", unit_name(k));
    }
    units.push_back(std::move(unit));
  }
  g.unit_plans = std::move(plans);
  units_ = std::move(units);
  return "";
}

}  // namespace kiln
