// The exported-graph runner (models/exported_graph.h): a serialized ExportedProgram parsed once
// into a list of dispatcher calls over numbered value slots, run without Python.
#include "models/exported_graph.h"

#include <ATen/ScalarOps.h>
#include <ATen/core/function_schema.h>
#include <ATen/core/jit_type.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <map>
#include <optional>
#include <set>

#include "kiln/error.h"
#include "models/exported_graph_parts.h"

namespace kiln {
namespace {

using nlohmann::json;

}  // namespace

namespace {

using graph_parts::ArgSource;
using graph_parts::bare_symbol;
using graph_parts::Node;
using graph_parts::Output;
using graph_parts::serde_layout;
using graph_parts::serde_memory_format;
using graph_parts::serde_scalar_type;
using graph_parts::slots_read;

// Nodes that only assert what export traced (dtypes, devices, shape facts): the inputs' dtypes
// and symbolic ranges are checked when the graph is entered instead (check_user_input), so these
// are not run. Under autocast, _assert_tensor_metadata would also refuse the lower-precision
// values autocast is there to give.
const std::set<std::string>& skipped_targets() {
  static const std::set<std::string> targets = {
      "torch.ops.aten._assert_tensor_metadata.default",
      "torch.ops.aten._assert_scalar.default",
      "torch.ops.aten.sym_constrain_range_for_size.default",
      "torch.ops.aten.sym_constrain_range.default",
      "torch.ops.aten._assert_async.msg",
      "torch.ops.aten._assert_async.default",
  };
  return targets;
}

}  // namespace

void ExportedGraph::Impl::fail(const std::string& node, const std::string& what) const {
  throw UserError(fmt::format("{}: node '{}': {}", file, node, what));
}

int ExportedGraph::Impl::define(const std::string& name, const std::string& node) {
  if (slot_of.count(name)) fail(node, fmt::format("the value '{}' is defined twice", name));
  slot_of[name] = slots;
  return slots++;
}

int ExportedGraph::Impl::use(const std::string& name, const std::string& node) const {
  auto it = slot_of.find(name);
  if (it == slot_of.end()) {
    fail(node, fmt::format("uses '{}', which no earlier node defines (or only an assertion "
                           "kiln does not run does)",
                           name));
  }
  return it->second;
}

ArgSource ExportedGraph::Impl::convert(const json& arg, const c10::Argument& schema_arg,
                                       const Node& node) {
  if (!arg.is_object() || arg.size() != 1) fail(node.name, "an argument is not a serde Argument");
  const std::string tag = arg.begin().key();
  const json& v = arg.begin().value();
  c10::TypePtr type = schema_arg.type();
  if (auto optional = type->cast<c10::OptionalType>()) type = optional->getElementType();
  ArgSource out;
  auto constant = [&](c10::IValue value) {
    out.kind = ArgSource::Kind::kConstant;
    out.constant = std::move(value);
    return out;
  };
  auto tensor_list = [&](const json& items, bool optional_items) {
    bool optional_elements = optional_items;
    if (auto list = type->cast<c10::ListType>()) {
      optional_elements = list->getElementType()->cast<c10::OptionalType>() != nullptr;
    }
    out.kind =
        optional_elements ? ArgSource::Kind::kOptionalTensorList : ArgSource::Kind::kTensorList;
    for (const json& item : items) {
      if (!optional_items) {
        out.slots.push_back(use(item.at("name"), node.name));
      } else if (item.contains("as_tensor")) {
        out.slots.push_back(use(item["as_tensor"].at("name"), node.name));
      } else if (optional_elements) {
        out.slots.push_back(-1);
      } else {
        fail(node.name,
             fmt::format("argument '{}': a None in a list of tensors", schema_arg.name()));
      }
    }
    return out;
  };
  // A Python number where the schema takes a Tensor (`x - 1` traced as sub.Tensor): a 0-dim
  // CPU tensor marked as a wrapped number, as Python's binding makes it, so type promotion
  // treats it as a scalar.
  if (type->kind() == c10::TypeKind::TensorType &&
      (tag == "as_int" || tag == "as_float" || tag == "as_bool")) {
    const c10::Scalar value = tag == "as_int"     ? c10::Scalar(v.get<int64_t>())
                              : tag == "as_float" ? c10::Scalar(v.get<double>())
                                                  : c10::Scalar(v.get<bool>());
    at::Tensor wrapped = c10::scalar_to_tensor(value);
    wrapped.unsafeGetTensorImpl()->set_wrapped_number(true);
    return constant(wrapped);
  }
  if (tag == "as_none") return constant(c10::IValue());
  if (tag == "as_tensor") {
    out.kind = ArgSource::Kind::kSlot;
    out.slot = use(v.at("name"), node.name);
    return out;
  }
  if (tag == "as_optional_tensor") {
    if (!v.contains("as_tensor")) return constant(c10::IValue());
    out.kind = ArgSource::Kind::kSlot;
    out.slot = use(v["as_tensor"].at("name"), node.name);
    return out;
  }
  if (tag == "as_tensors") return tensor_list(v, false);
  if (tag == "as_optional_tensors") return tensor_list(v, true);
  if (tag == "as_int") {
    if (type->kind() == c10::TypeKind::FloatType) return constant(v.get<double>());
    return constant(v.get<int64_t>());
  }
  if (tag == "as_float") return constant(v.get<double>());
  if (tag == "as_bool") return constant(v.get<bool>());
  if (tag == "as_string") return constant(v.get<std::string>());
  if (tag == "as_ints") return constant(c10::List<int64_t>(v.get<std::vector<int64_t>>()));
  if (tag == "as_floats") return constant(c10::List<double>(v.get<std::vector<double>>()));
  if (tag == "as_bools") {
    c10::List<bool> list;
    for (const json& b : v) list.push_back(b.get<bool>());
    return constant(std::move(list));
  }
  if (tag == "as_strings") {
    return constant(c10::List<std::string>(v.get<std::vector<std::string>>()));
  }
  if (tag == "as_scalar_type") {
    const auto dtype = serde_scalar_type(v.get<int64_t>());
    if (!dtype) fail(node.name, fmt::format("unknown scalar type {}", v.dump()));
    return constant(*dtype);
  }
  if (tag == "as_layout") {
    const auto layout = serde_layout(v.get<int64_t>());
    if (!layout) fail(node.name, fmt::format("unknown layout {}", v.dump()));
    return constant(*layout);
  }
  if (tag == "as_memory_format") {
    const auto format = serde_memory_format(v.get<int64_t>());
    if (!format) fail(node.name, fmt::format("unknown memory format {}", v.dump()));
    return constant(*format);
  }
  if (tag == "as_device") {
    out.kind = ArgSource::Kind::kDevice;
    return out;
  }
  if (tag == "as_sym_int") {
    if (v.contains("as_int")) return constant(v["as_int"].get<int64_t>());
    out.kind = ArgSource::Kind::kSlot;
    out.slot = use(v.at("as_name"), node.name);
    return out;
  }
  if (tag == "as_sym_ints") {
    out.kind = ArgSource::Kind::kIntList;
    for (const json& item : v) {
      if (item.contains("as_int")) {
        out.slots.push_back(-1);
        out.values.push_back(item["as_int"].get<int64_t>());
      } else {
        out.slots.push_back(use(item.at("as_name"), node.name));
        out.values.push_back(0);
      }
    }
    return out;
  }
  if (tag == "as_sym_float" && v.contains("as_float")) return constant(v["as_float"].get<double>());
  if (tag == "as_sym_bool" && v.contains("as_bool")) return constant(v["as_bool"].get<bool>());
  if (tag == "as_graph") {
    fail(node.name, fmt::format("a higher-order operator ({}) with a subgraph; kiln runs plain "
                                "ATen graphs (the importer decomposes with "
                                "run_decompositions)",
                                node.target));
  }
  fail(node.name, fmt::format("argument '{}' is a {}, which kiln's graph runner does not take",
                              schema_arg.name(), tag));
}

void ExportedGraph::Impl::load_op(Node& node, const json& n) {
  const std::string prefix = "torch.ops.";
  if (node.target.rfind(prefix, 0) != 0) {
    fail(node.name, fmt::format("'{}' is not an operator kiln can call (only torch.ops.* and "
                                "integer arithmetic on sizes)",
                                node.target));
  }
  const std::string rest = node.target.substr(prefix.size());
  const size_t a = rest.find('.');
  const size_t b = rest.rfind('.');
  if (a == std::string::npos || a == b)
    fail(node.name, "target '" + node.target + "' has no overload");
  const std::string qualified = rest.substr(0, a) + "::" + rest.substr(a + 1, b - a - 1);
  std::string overload = rest.substr(b + 1);
  if (overload == "default") overload.clear();
  node.op = c10::Dispatcher::singleton().findSchema({qualified, overload});
  if (!node.op) {
    fail(node.name, fmt::format("operator {} has no schema in this LibTorch (a custom op not "
                                "loaded, or a graph from another torch version)",
                                node.target));
  }
  const c10::FunctionSchema& schema = node.op->schema();
  const auto& arguments = schema.arguments();
  std::vector<std::optional<ArgSource>> given(arguments.size());
  for (const json& input : n.at("inputs")) {
    const std::string name = input.at("name");
    auto it = std::find_if(arguments.begin(), arguments.end(),
                           [&](const c10::Argument& x) { return x.name() == name; });
    if (it == arguments.end()) {
      fail(node.name, fmt::format("{} has no argument '{}' (a graph from another torch "
                                  "version?)",
                                  node.target, name));
    }
    given[it - arguments.begin()] = convert(input.at("arg"), *it, node);
    if (name == "query" && qualified == "aten::scaled_dot_product_attention") {
      const std::string q = input["arg"]["as_tensor"].value("name", "");
      auto sizes = tensor_sizes.find(q);
      ++math.attention_layers;
      if (sizes != tensor_sizes.end() && sizes->second.first.size() == 4 &&
          sizes->second.first[1] > 0 && sizes->second.first[3] > 0 && math.attention_width == 0) {
        math.attention_width = sizes->second.first[1] * sizes->second.first[3];
      }
    }
  }
  for (size_t i = 0; i < arguments.size(); ++i) {
    if (given[i]) {
      node.args.push_back(std::move(*given[i]));
    } else if (arguments[i].default_value()) {
      ArgSource source;
      source.constant = *arguments[i].default_value();
      node.args.push_back(std::move(source));
    } else {
      fail(node.name, fmt::format("{}: argument '{}' is required and missing", node.target,
                                  arguments[i].name()));
    }
  }
  const auto& outputs = n.at("outputs");
  if (outputs.size() != schema.returns().size()) {
    fail(node.name, fmt::format("{} returns {} value(s), the node binds {}", node.target,
                                schema.returns().size(), outputs.size()));
  }
}

void ExportedGraph::Impl::bind_outputs(Node& node, const json& n) {
  for (const json& out : n.at("outputs")) {
    Output o;
    if (out.contains("as_tensor")) {
      o.slots.push_back(define(out["as_tensor"].at("name"), node.name));
    } else if (out.contains("as_tensors")) {
      o.list = true;
      for (const json& t : out["as_tensors"]) o.slots.push_back(define(t.at("name"), node.name));
    } else if (out.contains("as_sym_int") && out["as_sym_int"].contains("as_name")) {
      o.slots.push_back(define(out["as_sym_int"]["as_name"], node.name));
    } else if (out.contains("as_optional_tensors")) {
      o.list = true;
      for (const json& t : out["as_optional_tensors"]) {
        o.slots.push_back(t.contains("as_tensor") ? define(t["as_tensor"].at("name"), node.name)
                                                  : -1);
      }
    } else if (out.contains("as_none") || out.contains("as_int")) {
      o.slots.push_back(-1);
    } else {
      fail(node.name, fmt::format("an output of kind {} kiln does not bind", out.dump()));
    }
    node.outputs.push_back(std::move(o));
  }
}

void ExportedGraph::Impl::load_node(const json& n) {
  Node node;
  node.name = n.value("name", "?");
  node.target = n.at("target").get<std::string>();
  if (skipped_targets().count(node.target)) return;
  const json& outputs = n.at("outputs");
  if (!outputs.empty() && std::all_of(outputs.begin(), outputs.end(), [](const json& o) {
        return o.contains("as_sym_bool") || o.contains("as_none");
      })) {
    return;  // a shape fact feeding an assertion (not run, see skipped_targets)
  }
  static const std::map<std::string, Node::Kind> sym_ops = {
      {"torch.ops.aten.sym_size.int", Node::Kind::kSymSize},
      {"torch.ops.aten.sym_numel.default", Node::Kind::kSymNumel},
      {"torch.ops.aten.sym_stride.int", Node::Kind::kSymStride},
      {"torch.ops.aten.sym_storage_offset.default", Node::Kind::kSymStorageOffset}};
  static const std::map<std::string, char> int_ops = {
      {"_operator.add", '+'},      {"_operator.sub", '-'}, {"_operator.mul", '*'},
      {"_operator.floordiv", '/'}, {"_operator.mod", '%'}, {"_operator.neg", 'n'}};
  if (auto it = sym_ops.find(node.target); it != sym_ops.end()) {
    node.kind = it->second;
    for (const json& input : n.at("inputs")) {
      const json& arg = input.at("arg");
      ArgSource s;
      if (arg.contains("as_tensor")) {
        s.kind = ArgSource::Kind::kSlot;
        s.slot = use(arg["as_tensor"].at("name"), node.name);
      } else if (arg.contains("as_int")) {
        s.constant = arg["as_int"].get<int64_t>();
      } else {
        fail(node.name, "a size query with an argument kiln does not take: " + arg.dump());
      }
      node.args.push_back(std::move(s));
    }
  } else if (auto op = int_ops.find(node.target); op != int_ops.end()) {
    node.kind = Node::Kind::kIntOp;
    node.int_op = op->second;
    for (const json& input : n.at("inputs")) {
      const json& arg = input.at("arg");
      ArgSource s;
      const json& value = arg.contains("as_sym_int") ? arg["as_sym_int"] : arg;
      if (value.contains("as_int")) {
        s.constant = value["as_int"].get<int64_t>();
      } else if (value.contains("as_name")) {
        s.kind = ArgSource::Kind::kSlot;
        s.slot = use(value["as_name"], node.name);
      } else {
        fail(node.name, "integer arithmetic on a value that is not an integer: " + arg.dump());
      }
      node.args.push_back(std::move(s));
    }
    if (node.args.size() != (node.int_op == 'n' ? 1u : 2u)) fail(node.name, "wrong arity");
  } else {
    load_op(node, n);
    const bool lookup = node.op->schema().name() == "aten::embedding";
    for (const ArgSource& a : node.args) {
      if (a.kind == ArgSource::Kind::kSlot) (lookup ? lookup_inputs : used_inputs).insert(a.slot);
    }
  }
  bind_outputs(node, n);
  // "key,path,type;key,path,type" from the outermost module in (the root's path is "").
  if (n.contains("metadata") && n["metadata"].contains("nn_module_stack")) {
    const std::string stack = n["metadata"]["nn_module_stack"].get<std::string>();
    for (size_t start = 0; start <= stack.size();) {
      size_t stop = stack.find(';', start);
      if (stop == std::string::npos) stop = stack.size();
      const std::string entry = stack.substr(start, stop - start);
      const size_t first = entry.find(','), last = entry.rfind(',');
      if (first != std::string::npos && last > first) {
        node.module_paths.push_back(entry.substr(first + 1, last - first - 1));
      }
      start = stop + 1;
    }
  }
  nodes.push_back(std::move(node));
}

ExportedGraph::ExportedGraph(const json& program, const std::string& file)
    : impl_(std::make_unique<Impl>()) {
  Impl& g = *impl_;
  g.file = file;
  try {
    const json& module = program.at("graph_module");
    const json& graph = module.at("graph");
    const json& signature = module.at("signature");
    const json& values = graph.at("tensor_values");
    for (const auto& [name, meta] : values.items()) {
      std::vector<int64_t> sizes;
      bool all_static = true;
      for (const json& s : meta.at("sizes")) {
        if (s.contains("as_int")) {
          sizes.push_back(s["as_int"].get<int64_t>());
        } else {
          sizes.push_back(-1);
          all_static = false;
        }
      }
      g.tensor_sizes[name] = {sizes, all_static};
    }
    if (program.contains("range_constraints")) {
      for (const auto& [symbol, range] : program["range_constraints"].items()) {
        SymbolRange r{symbol, 0, INT64_MAX};
        if (range.contains("min_val") && range["min_val"].is_number_integer())
          r.min = range["min_val"].get<int64_t>();
        if (range.contains("max_val") && range["max_val"].is_number_integer())
          r.max = range["max_val"].get<int64_t>();
        ranges_.push_back(r);
      }
    }
    const json& specs = signature.at("input_specs");
    const json& graph_inputs = graph.at("inputs");
    if (specs.size() != graph_inputs.size()) {
      throw UserError(fmt::format("{}: the graph has {} inputs and its signature {}", file,
                                  graph_inputs.size(), specs.size()));
    }
    for (const json& spec : specs) {
      const std::string kind = spec.begin().key();
      const json& body = spec.begin().value();
      GraphInput input;
      std::string value;
      if (kind == "parameter") {
        input.kind = GraphInput::Kind::kParameter;
        input.name = body.at("parameter_name");
        value = body.at("arg").at("name");
      } else if (kind == "buffer") {
        input.kind = GraphInput::Kind::kBuffer;
        input.name = body.at("buffer_name");
        value = body.at("arg").at("name");
      } else if (kind == "tensor_constant") {
        input.kind = GraphInput::Kind::kConstant;
        input.name = body.at("tensor_constant_name");
        value = body.at("arg").at("name");
      } else if (kind == "user_input" && body.at("arg").contains("as_tensor")) {
        input.kind = GraphInput::Kind::kUserInput;
        value = body["arg"]["as_tensor"].at("name");
        input.name = value;
      } else {
        throw UserError(
            fmt::format("{}: the graph takes a '{}' input ({}), which kiln cannot "
                        "supply (tensor inputs, parameters, buffers and constants "
                        "only)",
                        file, kind, body.dump()));
      }
      const json& meta = values.at(value);
      const auto dtype = serde_scalar_type(meta.at("dtype").get<int64_t>());
      if (!dtype) throw UserError(fmt::format("{}: input '{}' has an unknown dtype", file, value));
      input.dtype = *dtype;
      for (const json& s : meta.at("sizes")) {
        if (s.contains("as_int")) {
          input.sizes.push_back(s["as_int"].get<int64_t>());
          input.symbols.emplace_back();
        } else {
          input.sizes.push_back(-1);
          input.symbols.push_back(bare_symbol(s.at("as_expr").at("expr_str").get<std::string>()));
        }
      }
      if (input.kind == GraphInput::Kind::kParameter) {
        int64_t numel = 1;
        for (int64_t s : input.sizes) numel *= s;
        g.math.parameters += numel;
      }
      g.input_slots.push_back(g.define(value, "<input>"));
      inputs_.push_back(std::move(input));
    }
    for (const json& n : graph.at("nodes")) g.load_node(n);
    for (size_t i = 0; i < inputs_.size(); ++i) {
      // 6N counts every parameter a token's forward multiplies by: all but the lookup-only ones
      // (an untied token embedding), as kiln's own models count.
      const int slot = g.input_slots[i];
      if (inputs_[i].kind == GraphInput::Kind::kParameter &&
          !(g.lookup_inputs.count(slot) && !g.used_inputs.count(slot))) {
        int64_t numel = 1;
        for (int64_t s : inputs_[i].sizes) numel *= s;
        g.math.flop_parameters += numel;
      }
    }
    for (const json& spec : signature.at("output_specs")) {
      const std::string kind = spec.begin().key();
      const json& body = spec.begin().value();
      if (kind == "user_output") {
        const json& arg = body.at("arg");
        if (!arg.contains("as_tensor")) {
          throw UserError(
              fmt::format("{}: a user output that is not a tensor ({}); kiln takes "
                          "one logits tensor",
                          file, arg.dump()));
        }
        g.user_output_slots.push_back(g.use(arg["as_tensor"].at("name"), "<output>"));
      } else if (kind == "buffer_mutation") {
        g.buffer_output_slots.push_back(g.use(body.at("arg").at("name"), "<output>"));
        mutated_buffers_.push_back(body.at("buffer_name"));
      } else {
        throw UserError(
            fmt::format("{}: the graph has a '{}' output, which kiln does not apply "
                        "(a graph that mutates its inputs or computes gradients)",
                        file, kind));
      }
    }
  } catch (const json::exception& e) {
    throw UserError(
        fmt::format("{}: not a serialized ExportedProgram kiln can read: {}", file, e.what()));
  }
  // Each slot is released after the last node that reads it (outputs are kept to the end).
  std::vector<int> last(static_cast<size_t>(g.slots), -1);
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    for (int s : slots_read(g.nodes[i])) last[s] = static_cast<int>(i);
  }
  for (int s : g.user_output_slots) last[s] = INT_MAX;
  for (int s : g.buffer_output_slots) last[s] = INT_MAX;
  for (int s = 0; s < g.slots; ++s) {
    if (last[s] >= 0 && last[s] != INT_MAX) g.nodes[last[s]].release.push_back(s);
  }
}

ExportedGraph::~ExportedGraph() = default;

int64_t ExportedGraph::node_count() const {
  return static_cast<int64_t>(impl_->nodes.size());
}

GraphMath ExportedGraph::math() const {
  return impl_->math;
}

void ExportedGraph::set_no_grad_op_for_test(const std::string& target) {
  for (size_t i = 0; i < impl_->nodes.size(); ++i) {
    if (impl_->nodes[i].target == target) {
      no_grad_node_ = static_cast<int64_t>(i);
      return;
    }
  }
  throw std::invalid_argument("no node calls " + target);
}

}  // namespace kiln
