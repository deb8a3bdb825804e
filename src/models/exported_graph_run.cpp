// The exported-graph runner's hot path (models/exported_graph.h): one forward, node by node,
// through the dispatcher; and the input check that guards it.
#include <ATen/core/function_schema.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include <climits>
#include <map>
#include <stdexcept>

#include "models/exported_graph_parts.h"

namespace kiln {

using graph_parts::ArgSource;
using graph_parts::Node;
using graph_parts::Output;

std::string ExportedGraph::check_user_input(size_t index, const at::Tensor& value) const {
  const GraphInput& input = inputs_.at(index);
  if (value.scalar_type() != input.dtype) {
    return fmt::format("input '{}' is {}, the exported graph takes {}", input.name,
                       c10::toString(value.scalar_type()), c10::toString(input.dtype));
  }
  if (value.dim() != static_cast<int64_t>(input.sizes.size())) {
    return fmt::format("input '{}' has {} dimensions, the exported graph takes {}", input.name,
                       value.dim(), input.sizes.size());
  }
  std::map<std::string, int64_t> bound;
  for (size_t d = 0; d < input.sizes.size(); ++d) {
    const int64_t size = value.size(static_cast<int64_t>(d));
    if (input.sizes[d] >= 0) {
      if (size != input.sizes[d]) {
        return fmt::format(
            "input '{}' dimension {} is {}; the graph was exported with it fixed "
            "at {}",
            input.name, d, size, input.sizes[d]);
      }
      continue;
    }
    const std::string& symbol = input.symbols[d];
    if (symbol.empty()) continue;
    if (auto it = bound.find(symbol); it != bound.end() && it->second != size) {
      return fmt::format("input '{}' dimension {} is {}, but the graph needs it equal to {}",
                         input.name, d, size, it->second);
    }
    bound[symbol] = size;
    for (const SymbolRange& r : ranges_) {
      if (r.symbol == symbol && (size < r.min || size > r.max)) {
        return fmt::format(
            "input '{}' dimension {} is {}, outside the exported range [{}, {}] "
            "(re-import with a larger --max-seq / --max-batch)",
            input.name, d, size, r.min, r.max);
      }
    }
  }
  return "";
}

std::vector<at::Tensor> ExportedGraph::run(const std::vector<at::Tensor>& inputs,
                                           c10::Device device, const ThroughUnit& through) const {
  const Impl& g = *impl_;
  if (inputs.size() != g.input_slots.size()) {
    throw std::invalid_argument(fmt::format("ExportedGraph::run: {} inputs, the graph takes {}",
                                            inputs.size(), g.input_slots.size()));
  }
  std::vector<c10::IValue> env(static_cast<size_t>(g.slots));
  for (size_t i = 0; i < inputs.size(); ++i) env[g.input_slots[i]] = inputs[i];
  size_t next = 0;  // the next node to run
  if (through) {
    for (size_t k = 0; k < g.unit_plans.size(); ++k) {
      const graph_parts::UnitPlan& plan = g.unit_plans[k];
      run_range(next, plan.begin, env, device);
      std::vector<c10::IValue> captured;
      captured.reserve(plan.captured.size());
      for (int s : plan.captured) captured.push_back(env[s]);
      // What the forward needs is captured by value; the graph lives as long as its model.
      const ExportedGraph* graph = this;
      auto forward = [graph, k, captured = std::move(captured), device](const at::Tensor& input) {
        return graph->run_unit(k, captured, input, device);
      };
      env[plan.out_slot] = through(static_cast<int>(k), forward, env[plan.in_slot].toTensor());
      for (int s : plan.release_after) env[s] = c10::IValue();
      next = plan.end;
    }
  }
  run_range(next, g.nodes.size(), env, device);
  std::vector<at::Tensor> out;
  for (int s : g.user_output_slots) out.push_back(env[s].toTensor());
  for (int s : g.buffer_output_slots) out.push_back(env[s].toTensor());
  return out;
}

at::Tensor ExportedGraph::run_unit(size_t k, const std::vector<c10::IValue>& captured,
                                   const at::Tensor& input, c10::Device device) const {
  const Impl& g = *impl_;
  const graph_parts::UnitPlan& plan = g.unit_plans.at(k);
  std::vector<c10::IValue> env(static_cast<size_t>(g.slots));
  for (size_t i = 0; i < plan.captured.size(); ++i) env[plan.captured[i]] = captured[i];
  env[plan.in_slot] = input;
  run_range(plan.begin, plan.end, env, device);
  return env[plan.out_slot].toTensor();
}

void ExportedGraph::run_range(size_t begin, size_t end, std::vector<c10::IValue>& env,
                              c10::Device device) const {
  const Impl& g = *impl_;
  std::vector<c10::IValue> stack;
  for (size_t index = begin; index < end; ++index) {
    const Node& node = g.nodes[index];
    try {
      run_node(g, node, static_cast<int64_t>(index) == no_grad_node_, env, stack, device);
    } catch (const c10::Error& e) {
      throw std::runtime_error(fmt::format("{}: node '{}' ({}): {}", g.file, node.name, node.target,
                                           e.what_without_backtrace()));
    }
    for (int s : node.release) env[s] = c10::IValue();
  }
}

void ExportedGraph::run_node(const Impl& g, const graph_parts::Node& node, bool no_grad,
                             std::vector<c10::IValue>& env, std::vector<c10::IValue>& stack,
                             c10::Device device) {
  (void)g;
  {
    auto integer = [&](const ArgSource& a) {
      return a.kind == ArgSource::Kind::kSlot ? env[a.slot].toInt() : a.constant.toInt();
    };
    switch (node.kind) {
      case Node::Kind::kSymSize:
      case Node::Kind::kSymStride: {
        const at::Tensor& t = env[node.args.at(0).slot].toTensor();
        const int64_t dim = integer(node.args.at(1));
        env[node.outputs[0].slots[0]] =
            node.kind == Node::Kind::kSymSize ? t.size(dim) : t.stride(dim);
        break;
      }
      case Node::Kind::kSymNumel:
        env[node.outputs[0].slots[0]] = env[node.args.at(0).slot].toTensor().numel();
        break;
      case Node::Kind::kSymStorageOffset:
        env[node.outputs[0].slots[0]] = env[node.args.at(0).slot].toTensor().storage_offset();
        break;
      case Node::Kind::kIntOp: {
        const int64_t x = integer(node.args[0]);
        int64_t r = 0;
        if (node.int_op == 'n') {
          r = -x;
        } else {
          const int64_t y = integer(node.args[1]);
          switch (node.int_op) {
            case '+':
              r = x + y;
              break;
            case '-':
              r = x - y;
              break;
            case '*':
              r = x * y;
              break;
            case '/':
              r = (x / y) - ((x % y != 0) && ((x < 0) != (y < 0)) ? 1 : 0);
              break;
            default:
              r = ((x % y) + y) % y;
              break;
          }
        }
        env[node.outputs[0].slots[0]] = r;
        break;
      }
      case Node::Kind::kOp: {
        stack.clear();
        for (const ArgSource& a : node.args) {
          switch (a.kind) {
            case ArgSource::Kind::kConstant:
              stack.push_back(a.constant);
              break;
            case ArgSource::Kind::kSlot:
              stack.push_back(env[a.slot]);
              break;
            case ArgSource::Kind::kDevice:
              stack.emplace_back(device);
              break;
            case ArgSource::Kind::kTensorList: {
              c10::List<at::Tensor> list;
              list.reserve(a.slots.size());
              for (int s : a.slots) list.push_back(env[s].toTensor());
              stack.emplace_back(std::move(list));
              break;
            }
            case ArgSource::Kind::kOptionalTensorList: {
              c10::List<std::optional<at::Tensor>> list;
              list.reserve(a.slots.size());
              for (int s : a.slots) {
                list.push_back(s >= 0 ? std::optional<at::Tensor>(env[s].toTensor())
                                      : std::nullopt);
              }
              stack.emplace_back(std::move(list));
              break;
            }
            case ArgSource::Kind::kIntList: {
              c10::List<int64_t> list;
              list.reserve(a.slots.size());
              for (size_t k = 0; k < a.slots.size(); ++k) {
                list.push_back(a.slots[k] >= 0 ? env[a.slots[k]].toInt() : a.values[k]);
              }
              stack.emplace_back(std::move(list));
              break;
            }
          }
        }
        if (no_grad) {
          at::NoGradGuard no_grad;
          node.op->callBoxed(&stack);
        } else {
          node.op->callBoxed(&stack);
        }
        for (size_t r = 0; r < node.outputs.size(); ++r) {
          const Output& out = node.outputs[r];
          if (out.list) {
            const c10::IValue& value = stack[r];
            if (value.isTensorList()) {
              const auto list = value.toTensorList();
              for (size_t k = 0; k < out.slots.size() && k < list.size(); ++k) {
                if (out.slots[k] >= 0) env[out.slots[k]] = list.get(k);
              }
            } else {
              const auto list = value.toListRef();
              for (size_t k = 0; k < out.slots.size() && k < list.size(); ++k) {
                if (out.slots[k] >= 0) env[out.slots[k]] = list[k];
              }
            }
          } else if (out.slots[0] >= 0) {
            env[out.slots[0]] = std::move(stack[r]);
          }
        }
        break;
      }
    }
  }
}

}  // namespace kiln
