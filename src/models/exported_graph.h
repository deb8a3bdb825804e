// A graph of torch.export's serialized ExportedProgram (torch/_export/serde/schema.py's JSON),
// run from C++ through the c10 dispatcher: each node's operator schema is found once at load, its
// arguments converted to the schema's types, its outputs bound by name. Calls go through the
// dispatcher's autograd and autocast keys as a C++ model's do, so backward is LibTorch autograd.
// Internal to src/models/ (the "exported" model, models/exported.cpp).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace kiln {

namespace graph_parts {
struct Node;
}

/// What the graph takes, in the order run() wants its inputs (the graph signature's input specs).
struct GraphInput {
  enum class Kind { kParameter, kBuffer, kConstant, kUserInput };
  Kind kind = Kind::kUserInput;
  std::string name;  // the state_dict name (parameter, buffer, constant) or the user input's name
  /// The tensor's dtype (c10) and sizes; a size of -1 is symbolic, bound by `symbols`.
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> sizes;
  /// For each dimension: the symbol it binds ("" when static or an expression).
  std::vector<std::string> symbols;
};

/// The exported range of a symbolic dimension.
struct SymbolRange {
  std::string symbol;
  int64_t min = 0, max = INT64_MAX;
};

/// Per-op figures for ModelMath, from the graph's static shapes.
struct GraphMath {
  int64_t parameters = 0;       // elements of every parameter input
  int64_t flop_parameters = 0;  // elements of every parameter but the lookup-only ones
  int64_t attention_layers = 0, attention_width = 0;  // scaled_dot_product_attention calls; H*D
};

/// One unit of the graph (Model::units()): the nodes of one module of the package's unit list
/// (`prefix`.k in their nn_module_stack), run as one forward from the hidden state it takes to the
/// one it gives.
struct GraphUnit {
  std::string name;                     // "model.layers.0"
  std::vector<std::string> parameters;  // the parameter inputs it reads, in input order
  int64_t elements = 0;                 // their elements
};

/// run()'s hook around each unit: called with the unit's index, its forward and its input; returns
/// what the forward returns (Model::run_unit, so every unit wrapper runs).
using ThroughUnit = std::function<at::Tensor(
    int, const std::function<at::Tensor(const at::Tensor&)>&, const at::Tensor&)>;

class ExportedGraph {
 public:
  /// Loads the program (the parsed JSON). Throws UserError naming `file` and the node, op or
  /// argument that cannot run: an operator with no schema in this LibTorch, a higher-order op,
  /// an argument the schema does not have, a mutated user input.
  ExportedGraph(const nlohmann::json& program, const std::string& file);
  ~ExportedGraph();
  ExportedGraph(const ExportedGraph&) = delete;
  ExportedGraph& operator=(const ExportedGraph&) = delete;

  const std::vector<GraphInput>& inputs() const { return inputs_; }
  const std::vector<SymbolRange>& ranges() const { return ranges_; }
  /// Buffers the graph writes: (buffer name, output index) pairs; run() returns their new values
  /// after the user outputs.
  const std::vector<std::string>& mutated_buffers() const { return mutated_buffers_; }
  int64_t node_count() const;
  GraphMath math() const;

  /// Checks a user input against its exported shape: the dtype, every static size, and every
  /// symbolic size inside its range (and equal where one symbol binds several). Returns "" or the
  /// problem naming the input, the dimension and the range.
  std::string check_user_input(size_t input, const at::Tensor& value) const;

  /// Runs the graph: `inputs` in inputs() order. Returns the user outputs, then the mutated
  /// buffers' new values. Device arguments in the graph (arange, full, ...) take `device`.
  /// With `through` (and units split), each unit's nodes run inside through(k, forward, input).
  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs, c10::Device device,
                              const ThroughUnit& through = nullptr) const;

  /// Splits the graph into the units `prefix`.0 .. `prefix`.(count - 1) (the modules in each
  /// node's nn_module_stack). Returns "" or the problem, naming the node or value that keeps the
  /// graph from splitting there: a unit's nodes not contiguous, a unit reading more than one value
  /// that carries gradients from outside it (or not its predecessor's output), giving more than one
  /// value to the nodes after it, writing a buffer, or sharing a parameter with another piece.
  std::string split_units(const std::string& prefix, int64_t count);
  /// The units split_units made, in forward order (none before it).
  const std::vector<GraphUnit>& units() const { return units_; }

  /// For tests: run the first node calling `target` under no-grad.
  void set_no_grad_op_for_test(const std::string& target);

 private:
  struct Impl;
  static void run_node(const Impl& g, const graph_parts::Node& node, bool no_grad,
                       std::vector<c10::IValue>& env, std::vector<c10::IValue>& stack,
                       c10::Device device);
  // Runs nodes [begin, end) in `env` (errors name the node).
  void run_range(size_t begin, size_t end, std::vector<c10::IValue>& env, c10::Device device) const;
  // Unit k's forward: its nodes in an environment of their own, from `captured` and `input`.
  at::Tensor run_unit(size_t k, const std::vector<c10::IValue>& captured, const at::Tensor& input,
                      c10::Device device) const;
  std::unique_ptr<Impl> impl_;
  std::vector<GraphUnit> units_;
  std::vector<GraphInput> inputs_;
  std::vector<SymbolRange> ranges_;
  std::vector<std::string> mutated_buffers_;
  int64_t no_grad_node_ = -1;
};

}  // namespace kiln
